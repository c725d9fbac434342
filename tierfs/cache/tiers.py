"""The memory and disk tiers of a ChunkCache, as tiers (tier.py) of the read walk.

Thin: what each does lives in ChunkCache (the index, heat, room) and in memory.py and
disk.py (the bytes). A hit here is blocks of a chunk; `put` keeps what a tier below
answered: the memory tier at once, the disk tier by writing a chunk file (the walk runs
that in the background, tierfs/read/walk.py).
"""

from __future__ import annotations

from . import ChunkCache
from .tier import Bytes, Want, chunk_length


class MemoryCache:
    """The memory tier: blocks or whole chunks, LRU with holds (memory.py)."""

    name = "memory"

    def __init__(self, cache: ChunkCache, chunk_size: int) -> None:
        self.cache = cache
        self.chunk_size = chunk_size

    async def get(self, want: Want) -> Bytes | None:
        first, last, _ = blocks(self.cache, self.chunk_size, want)
        return self.cache.read_memory(want.ckey, first, last)

    async def put(self, want: Want, data: Bytes) -> None:
        first, last, final = blocks(self.cache, self.chunk_size, want)
        whole = first == 0 and last == final
        self.cache.keep(want.ckey, first, last, data, whole=whole)


class DiskCache:
    """The disk tier: chunk files with block CRCs, indexed, heat-evicted (ChunkCache)."""

    name = "disk"

    def __init__(self, cache: ChunkCache, chunk_size: int) -> None:
        self.cache = cache
        self.chunk_size = chunk_size

    async def get(self, want: Want) -> Bytes | None:
        first, last, _ = blocks(self.cache, self.chunk_size, want)
        return await self.cache.read_disk(want.ckey, first, last)

    async def put(self, want: Want, data: Bytes) -> None:
        """Write a whole chunk a tier below answered (`fill`: room, admission, index)."""
        assert want.whole, "the disk tier keeps whole chunks"
        await self.cache.fill(want.obj, want.ckey, data, tenant=want.tenant)


class OwnChunk:
    """The chunks one reader fetched and is reading, kept by its handle while it reads
    them: a tier in front of the memory tier for that handle's reads only. A memory tier
    with no room for every reader's chunk (or another reader's put that took the room)
    then never makes a reader fetch a chunk again half-way through it (issue 26, M3).
    Two chunks: the one being read and the next (a kernel read-ahead or an mmap fault may
    ask for the next before the last pages of this one). They are the buffers the memory
    tier keeps, so they cost memory only while the tier has let them go; a read away from
    them lets them go."""

    name = "memory"
    KEEP = 2

    def __init__(self, cache: ChunkCache, chunk_size: int) -> None:
        self.cache = cache
        self.chunk_size = chunk_size
        self._chunks: dict[bytes, tuple[int, Bytes]] = {}  # ckey -> (index, bytes), oldest first

    async def get(self, want: Want) -> Bytes | None:
        got = self._chunks.get(want.ckey)
        if got is None:
            if all(abs(want.index - i) > 1 for i, _ in self._chunks.values()):
                self._chunks.clear()  # the reader moved on: let them go
            return None
        first, last, _ = blocks(self.cache, self.chunk_size, want)
        bs = self.cache.block_size
        return memoryview(got[1])[first * bs:(last + 1) * bs]

    async def put(self, want: Want, data: Bytes) -> None:
        if want.whole:  # a fetched chunk; a cache tier's blocks stay the cache's
            self._chunks.pop(want.ckey, None)
            self._chunks[want.ckey] = (want.index, data)
            while len(self._chunks) > self.KEEP:
                del self._chunks[next(iter(self._chunks))]


def blocks(cache: ChunkCache, chunk_size: int, want: Want) -> tuple[int, int, int]:
    """The wanted blocks first..last (a `last` of -1 spelled out) and the chunk's last."""
    final = cache.blocks_of(chunk_length(chunk_size, want.obj.size, want.index)) - 1
    return want.first, final if want.last < 0 else want.last, final
