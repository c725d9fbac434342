"""The memory tier: a byte-bounded LRU of verified blocks in front of the disk tier.

Keys are (chunk key, WHOLE) for a whole chunk, or (chunk key, block number) for single
blocks a partial disk read brought in. Values are kept as they arrived, never copied: the
bytes of a GET or of a disk read, or read-only views (a page-cache read's buffer; a
partial read's blocks, views of one buffer that lives while any of them does). Nobody
writes to them, so a reader may keep a reference after the entry is evicted. LRU suffices
here: the disk tier's heat ordering is what protects the working set from scans; this
tier only absorbs re-reads.

What the tier counts, and what may leave for what (issue 26, M1/M3):
- entries in the LRU: evictable, oldest first;
- held entries (`hold`): chunks read ahead and not read yet, and the chunk a sequential
  reader is in (prefetch.py). Never evicted for anything, so no chunk leaves before its
  reader gets to it; a chunk that finds no room is not kept here, and the reader that
  fetched it keeps it itself while it reads it (cache/tiers.py, OwnChunk: issue 26, M3);
- reserved bytes (`reserve`): a GET or a big disk read in flight, whose bytes arrive into
  a buffer and are `put` then. Never evictable: they are not entries.
Their sum never passes the capacity: a reservation or a put that cannot fit after
evicting what it may evict is refused (False) instead, and the bytes go around the tier
(the reader still gets them; they are just not kept). So `put` never evicts past what it
can evict (it used to loop on an empty LRU while reservations alone were over capacity).

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

Block = Union[bytes, bytearray, memoryview]  # never written once kept (a GET's bytearray too)
Key = tuple[bytes, int]


class MemoryTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        # a plain OrderedDict: cachetools' LRUCache cost a few us per get and put
        self._lru: OrderedDict[Key, Block] = OrderedDict()
        self._size = 0  # bytes of the LRU's entries
        # held entries, oldest hold first: key -> [bytes, holders]
        self._held: dict[Key, list] = {}
        self._held_bytes = 0
        self._reserved = 0
        self.released: Callable[[object], None] | None = None  # gets a view's owner

    def get(self, key: Key) -> Block | None:
        data = self._lru.get(key)
        if data is not None:
            self._lru.move_to_end(key)
            return data
        entry = self._held.get(key)
        return None if entry is None else entry[0]

    def put(self, key: Key, data: Block, *, hold: bool = False) -> bool:
        """Keep `data` under `key` (held, with `hold`: a read-ahead's chunk); False when it
        was not kept. A key already kept is kept as it is (keys are versioned: the same
        bytes), held once more with `hold`. Room comes from the LRU, oldest first; held
        entries and reserved bytes are never taken."""
        if self._keep(key, hold):
            return True
        n = len(data)
        if self.capacity <= 0 or n + self._reserved + self._held_bytes > self.capacity:
            return False
        self._evict_lru(n)
        if hold:
            self._held[key] = [data, 1]
            self._held_bytes += n
        else:
            self._lru[key] = data
            self._size += n
        return True

    def hold(self, key: Key) -> bool:
        """One more holder of a kept entry (it leaves the LRU until released); False if
        the tier does not have it."""
        return self._keep(key, True)

    def unhold(self, key: Key) -> None:
        """A holder read its chunk or gave up on it: with no holder left it is the LRU's
        newest entry. A key the tier no longer has (a reader's put took it) is ignored."""
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._held[key]
            n = len(entry[0])
            self._held_bytes -= n
            self._lru[key] = entry[0]
            self._size += n

    def reserve(self, n: int) -> bool:
        """Count `n` bytes about to arrive (a GET in flight) as kept, evicting LRU entries for
        them now: bytes in flight and entries together stay within capacity (the daemon's
        peak RSS), and the entry that leaves gives its buffer to that very GET (read/sources.py).
        False when nothing was counted: the bytes could never be kept, or held entries and
        other reservations leave no room (the caller goes on without the tier)."""
        if self.capacity <= 0 or n + self._reserved + self._held_bytes > self.capacity:
            return False  # decided before evicting anything for it
        self._evict_lru(n)
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        """The reserved bytes arrived (and are `put`, counted again) or never will."""
        self._reserved -= n

    def room_for_holds(self) -> int:
        """Bytes held entries and reservations leave free: what more may be held."""
        return self.capacity - self._held_bytes - self._reserved

    def drop_chunk(self, ckey: bytes, blocks: int) -> None:
        if self._lru or self._held:
            for b in range(WHOLE, blocks):
                self._pop((ckey, b))

    def _keep(self, key: Key, hold: bool) -> bool:
        """Whether `key` is kept already (and, with `hold`, held once more)."""
        entry = self._held.get(key)
        if entry is not None:
            entry[1] += hold
            return True
        data = self._lru.get(key)
        if data is None:
            return False
        if hold:
            del self._lru[key]
            self._size -= len(data)
            self._held[key] = [data, 1]
            self._held_bytes += len(data)
        else:
            self._lru.move_to_end(key)
        return True

    def _over(self, n: int) -> bool:
        return self._size + self._held_bytes + self._reserved + n > self.capacity

    def _evict_lru(self, n: int) -> None:
        while self._over(n) and self._lru:
            self._pop(next(iter(self._lru)))

    def _pop(self, key: Key) -> None:
        data = self._lru.pop(key, None)
        if data is not None:
            self._size -= len(data)
        elif key in self._held:
            data = self._held.pop(key)[0]
            self._held_bytes -= len(data)
        else:
            return
        owner = data.obj if isinstance(data, memoryview) else None
        del data  # the owner can be reused only once this view is gone too
        if owner is not None and self.released is not None:
            self.released(owner)

    @property
    def bytes(self) -> int:
        """Entries (held or not) and reservations: what the tier's memory holds now."""
        return self._size + self._held_bytes + self._reserved

    @property
    def held_bytes(self) -> int:
        return self._held_bytes
