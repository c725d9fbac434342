"""The memory tier: a byte-bounded LRU of verified blocks in front of the disk tier.

Keys are (chunk key, WHOLE) for a whole chunk, or (chunk key, block number) for single
blocks a partial disk read brought in. Values are kept as they arrived, never copied: the
bytes of a GET or of a disk read, or read-only views (a page-cache read's buffer; a
partial read's blocks, views of one buffer that lives while any of them does). Nobody
writes to them, so a reader may keep a reference after the entry is evicted. LRU suffices
here: the disk tier's heat ordering is what protects the working set from scans; this
tier only absorbs re-reads.

An entry that leaves (evicted, replaced, dropped) is handed to `released`, which
ChunkCache points at the disk tier: a big disk read's buffer is reused for the next one
once no view of it is left (DiskTier.reuse checks that), so a warm read does not
page-fault fresh memory in and unmap it again for every chunk. A GET in flight reserves its
bytes here first (`reserve`): what leaves for it is the buffer it then reads into.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Union

WHOLE = -1

Block = Union[bytes, memoryview]  # immutable bytes or a read-only view


class MemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        # a plain OrderedDict: cachetools' LRUCache cost a few us per get and put
        self._lru: OrderedDict[tuple[bytes, int], Block] = OrderedDict()
        self._size = 0
        self.released: Callable[[object], None] | None = None  # gets a view's owner

    def get(self, key: tuple[bytes, int]) -> Block | None:
        data = self._lru.get(key)
        if data is not None:
            self._lru.move_to_end(key)
        return data

    def put(self, key: tuple[bytes, int], data: Block) -> None:
        n = len(data)
        if n > self.capacity or self.capacity <= 0:
            return
        self._pop(key)
        self._lru[key] = data
        self._size += n
        while self._size > self.capacity:
            self._pop(next(iter(self._lru)))

    def reserve(self, n: int) -> bool:
        """Count `n` bytes about to arrive (a GET in flight) as held, evicting for them now:
        the bytes in flight and the entries together stay within capacity (the daemon's
        peak RSS), and the entry that leaves gives its buffer to that very GET
        (fetch.py). False when nothing was counted (the bytes could never be kept)."""
        if n > self.capacity or self.capacity <= 0:
            return False
        self._size += n
        while self._size > self.capacity and self._lru:
            self._pop(next(iter(self._lru)))
        return True

    def unreserve(self, n: int) -> None:
        """The reserved bytes arrived (and are `put`, counted again) or never will."""
        self._size -= n

    def drop_chunk(self, ckey: bytes, blocks: int) -> None:
        if self._lru:
            for b in range(WHOLE, blocks):
                self._pop((ckey, b))

    def _pop(self, key: tuple[bytes, int]) -> None:
        data = self._lru.pop(key, None)
        if data is None:
            return
        self._size -= len(data)
        owner = data.obj if isinstance(data, memoryview) else None
        del data  # the owner can be reused only once this view is gone too
        if owner is not None and self.released is not None:
            self.released(owner)

    @property
    def bytes(self) -> int:
        return self._size
