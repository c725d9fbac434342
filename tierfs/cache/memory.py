"""The memory tier: a byte-bounded LRU of verified blocks in front of the disk tier.

Keys are (chunk key, WHOLE) for a whole chunk, or (chunk key, block number) for single
blocks a partial disk read brought in. Values are kept as they arrived, never copied: the
bytes of a GET or of a disk read, or read-only views (a page-cache read's buffer; a
partial read's blocks, views of one buffer that lives while any of them does). Nobody
writes to them, so a reader may keep a reference after the entry is evicted. LRU suffices
here: the disk tier's heat ordering is what protects the working set from scans; this
tier only absorbs re-reads.
"""

from __future__ import annotations

from typing import Union

from cachetools import LRUCache

WHOLE = -1

Block = Union[bytes, memoryview]  # immutable bytes or a read-only view


class MemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._lru: LRUCache | None = (LRUCache(maxsize=capacity_bytes, getsizeof=len)
                                      if capacity_bytes > 0 else None)

    def get(self, key: tuple[bytes, int]) -> Block | None:
        return self._lru.get(key) if self._lru is not None else None

    def put(self, key: tuple[bytes, int], data: Block) -> None:
        if self._lru is not None and len(data) <= self.capacity:
            self._lru[key] = data

    def drop_chunk(self, ckey: bytes, blocks: int) -> None:
        if self._lru is not None:
            for b in range(WHOLE, blocks):
                self._lru.pop((ckey, b), None)

    @property
    def bytes(self) -> int:
        return int(self._lru.currsize) if self._lru is not None else 0
