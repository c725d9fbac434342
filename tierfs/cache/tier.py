"""The tier interface: every place a chunk's bytes can come from answers the same calls.

A tier is the memory tier, the disk tier (tierfs/cache/tiers.py), a peer's cache or the
object store (tierfs/read/sources.py). A read walks them nearest first (tierfs/read/
walk.py): the first that has the chunk answers, and every tier above it is handed the
bytes (`put`) to do with them what it does: the memory and disk tiers keep them, the
peer tier checks what it had been told against them. A new tier (an on-prem store in
front of a cloud bucket) is a new implementation of this, not a new special case.

Integrity checks stay where bytes are received: block CRCs in the disk tier, the store's
checksums in the backend, the HMAC of a peer's reply in the peer client.
"""

from __future__ import annotations

from typing import Protocol

from .keys import ObjectVersion

Bytes = bytes | bytearray | memoryview  # a GET's own buffer is a bytearray: no copy

# the tiers' names, as metrics, usage and the report count bytes by them: nearest first
SOURCES = ("memory", "disk", "peer", "near", "backend")
FETCHED = ("peer", "near", "backend")  # the sources a read waits on a fetch from


def chunk_length(chunk_size: int, size: int, index: int) -> int:
    """Bytes of chunk `index` of an object of `size` bytes (the last one may be short)."""
    return max(0, min(chunk_size, size - index * chunk_size))


class Want:
    """What a caller wants of one chunk: blocks first..last (the cache's block size;
    last -1: to the chunk's end) of chunk `index` of one object version. Made once per
    chunk of a read and never changed: a plain class with its chunk key computed once
    (a frozen dataclass's init and a key hashed per tier cost a small read 20%)."""

    __slots__ = ("obj", "index", "first", "last", "access", "background", "ask_peers",
                 "tenant", "ckey")

    def __init__(self, obj: ObjectVersion, index: int, first: int = 0, last: int = -1, *,
                 access: bool = False, background: bool = False, ask_peers: bool = True,
                 tenant: str | None = None) -> None:
        self.obj = obj
        self.index = index
        self.first = first
        self.last = last
        self.access = access  # a reader's first access of the chunk: it adds heat
        self.background = background  # read-ahead: the store's background lane
        self.ask_peers = ask_peers  # False when serving a peer: never round in circles
        self.tenant = tenant  # the reader's tenant, if not its key's: owns what is cached
        self.ckey = obj.chunk_key(index)

    @property
    def whole(self) -> bool:
        return self.first == 0 and self.last == -1


class Tier(Protocol):
    name: str  # where bytes came from, as metrics and usage say it: "memory", "disk", ...

    async def get(self, want: Want) -> Bytes | None:
        """The wanted bytes if this tier has them (a source: the whole chunk), else None.
        A failure of a source raises (tierfs.errors); a cache tier's failure is a miss."""
        ...

    async def put(self, want: Want, data: Bytes) -> None:
        """A tier below answered `data` (the blocks `want` names) for a chunk this one did
        not have."""
        ...
