"""The memory tier: a byte-bounded LRU of verified blocks in front of the disk tier.

Keys are (chunk key, WHOLE) for a whole chunk, stored as fetched without a copy, or
(chunk key, block number) for single blocks a partial disk read brought in. Values are
immutable bytes, so a reader may keep a reference after the entry is evicted. LRU suffices here: the disk tier's heat ordering
is what protects the working set from scans; this tier only absorbs re-reads.
"""

from __future__ import annotations

from cachetools import LRUCache

WHOLE = -1


class MemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._lru: LRUCache | None = (LRUCache(maxsize=capacity_bytes, getsizeof=len)
                                      if capacity_bytes > 0 else None)

    def get(self, key: tuple[bytes, int]) -> bytes | None:
        return self._lru.get(key) if self._lru is not None else None

    def put(self, key: tuple[bytes, int], data: bytes) -> None:
        if self._lru is not None and len(data) <= self.capacity:
            self._lru[key] = data

    def drop_chunk(self, ckey: bytes, blocks: int) -> None:
        if self._lru is not None:
            for b in range(WHOLE, blocks):
                self._lru.pop((ckey, b), None)

    @property
    def bytes(self) -> int:
        return int(self._lru.currsize) if self._lru is not None else 0
