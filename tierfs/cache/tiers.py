"""The memory and disk tiers of a ChunkCache, as tiers (tier.py) of the read walk.

Thin: what each does lives in ChunkCache (the index, heat, room) and in memory.py and
disk.py (the bytes). A hit here is blocks of a chunk; `put` keeps what a tier below
answered: the memory tier at once, the disk tier by writing a chunk file (the walk runs
that in the background, tierfs/read/walk.py).
"""

from __future__ import annotations

from . import ChunkCache
from .tier import Bytes, Want


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
        # a read-ahead's bytes take no room the tier holds for readers' chunks
        self.cache.keep(want.ckey, first, last, data, whole=whole, ahead=want.background)


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


def blocks(cache: ChunkCache, chunk_size: int, want: Want) -> tuple[int, int, int]:
    """The wanted blocks first..last (a `last` of -1 spelled out) and the chunk's last."""
    length = max(0, min(chunk_size, want.obj.size - want.index * chunk_size))
    final = cache.blocks_of(length) - 1
    return want.first, final if want.last < 0 else want.last, final
