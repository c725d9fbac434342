"""The tiers a chunk is fetched from when no cache tier has it: the peers' caches and the
object store (the near store, near.py, is one more). All give whole chunks; the read walk
(walk.py) asks them in order, once per chunk however many readers want it
(singleflight.py).
"""

from __future__ import annotations

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache
from ..cache.disk import REUSE_MIN
from ..cache.tier import Bytes, Want, chunk_length
from ..peers import PeerChunk, PeerTier
from .storecheck import StoreChecks

REFUTED_MAX = 64  # refuted chunks waiting for the store's bytes to blame their peer


class PeerSource:
    """The chunk's owner among the peers (tierfs/peers): bytes its HMAC vouches for, also
    checked against the store's own checksums where the object has them (storecheck.py),
    or None. A peer whose bytes the store refutes is blamed once the store's bytes are
    known to differ (`put`)."""

    name = "peer"

    def __init__(self, peers: PeerTier, checks: StoreChecks, chunk_size: int) -> None:
        self.peers = peers
        self.checks = checks
        self.chunk_size = chunk_size
        self._refuted: dict[bytes, PeerChunk] = {}

    async def get(self, want: Want) -> Bytes | None:
        if not want.ask_peers:
            return None
        obj = want.obj
        got = await self.peers.fetch(want.ckey, bucket=obj.bucket, key=obj.key, etag=obj.etag,
                                     size=obj.size, index=want.index,
                                     chunk_size=self.chunk_size)
        if got is None:
            return None
        if not await self.checks.agree(obj, want.index, got.data):
            if len(self._refuted) >= REFUTED_MAX:  # the store failed for those: forget them
                self._refuted.clear()
            self._refuted[want.ckey] = got
            return None
        return got.data

    async def put(self, want: Want, data: Bytes) -> None:
        refuted = self._refuted.pop(want.ckey, None)
        if refuted is not None and refuted.data != data:
            self.peers.refuted(refuted.peer, f"chunk {want.index} of {want.obj.key!r} "
                                             "differs from the store's checksum and bytes")


class StoreSource:
    """The object store: a ranged GET with If-Match on the version's ETag."""

    name = "backend"

    def __init__(self, backend: AsyncBackend, cache: ChunkCache, chunk_size: int) -> None:
        self.backend = backend
        self.cache = cache
        self.chunk_size = chunk_size

    async def get(self, want: Want) -> Bytes:
        obj = want.obj
        return await self.fetch(want, obj.key, obj.etag)

    async def fetch(self, want: Want, key: str, etag: str | None,
                    metadata: dict[str, str] | None = None) -> Bytes:
        """The wanted chunk's bytes from `key` of this store (If-Match `etag`; the user
        `metadata` it must carry). A big chunk into a reused buffer of the disk tier (a
        fresh 8 MiB buffer per GET page-faults in, and its memory-tier entry could not be
        reused for the next read: bench/README.md), its bytes reserved in the memory tier
        while in flight (the tier's size bounds GETs in flight too); a small one into new
        bytes (a 1 MiB mapping per small file would waste address space and map count)."""
        obj, background = want.obj, want.background
        start = want.index * self.chunk_size
        length = chunk_length(self.chunk_size, obj.size, want.index)
        if length < REUSE_MIN:
            if metadata is None:
                return await self.backend.get(key, start, length, etag,
                                              background=background, size=obj.size)
            buf = bytearray(length)
            n = await self.backend.get_into(key, start, memoryview(buf), etag,
                                            background=background, size=obj.size,
                                            metadata=metadata)
            return buf if n == length else buf[:n]
        memory = self.cache.memory
        # may free the very buffer taken next; a read-ahead's room is reserved already,
        # from its start until its reader reads past it (prefetch.py)
        reserved = not background and memory.reserve(length)
        view = self.cache.disk.read_buffer(length)
        owner = view.obj
        try:
            n = await self.backend.get_into(key, start, view, etag, background=background,
                                            size=obj.size, metadata=metadata)
            data = view[:n].toreadonly()
        except BaseException:
            view.release()
            self.cache.disk.reuse(owner)  # nothing of it was handed out
            raise
        finally:
            if reserved:
                memory.unreserve(length)
        view.release()  # the read-only view keeps the buffer from reuse while it lives
        return data

    async def put(self, want: Want, data: Bytes) -> None:
        """Nothing is below the store."""
