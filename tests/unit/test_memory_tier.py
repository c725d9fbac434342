"""The memory tier's accounting under any mix of puts, holds, reservations and drops
(issue 26, M1: `put` looped on an empty LRU once reservations alone passed the capacity,
and raised StopIteration into a reader's read).

A hypothesis state machine drives one MemoryTier with random operations and checks after
each one what the tier promises (tierfs/cache/memory.py):
- entries, held entries and reservations together never pass the capacity, and its byte
  counts are the sums of what it holds;
- nothing raises: a put or a reservation that cannot fit says False instead;
- nothing pushes out a held entry or reserved bytes; a put is kept whenever held and
  reserved bytes leave room for it (a reader whose chunk is not kept keeps it itself:
  cache/tiers.py, OwnChunk);
- every entry that leaves hands its buffer to `released` exactly once, and only then.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierfs.cache.memory import WHOLE, MemoryTier

KEYS = st.sampled_from([(b"c%d" % i, b) for i in range(6) for b in (WHOLE, 0, 1)])
SIZES = st.integers(min_value=0, max_value=120)


class TierMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(min_value=0, max_value=400))
    def start(self, capacity: int) -> None:
        self.tier = MemoryTier(capacity)
        self.released: list[object] = []
        self.tier.released = self.released.append
        self.owners: dict[tuple, object] = {}  # key -> the buffer its entry is a view of
        self.gone: set[int] = set()  # ids of buffers whose entry left
        self.reservations: list[int] = []

    def _view(self, n: int) -> memoryview:
        return memoryview(bytearray(n)).toreadonly()

    def _held(self) -> set:
        return set(self.tier._held)

    def _after(self, before: dict) -> None:
        """Entries no longer kept were released, once each; kept ones were not."""
        for key, owner in before.items():
            if self.tier.get(key) is None:
                assert self.owners.pop(key) is owner
                self.gone.add(id(owner))
        ids = [id(o) for o in self.released]
        assert len(ids) == len(set(ids)), "an entry released twice"
        assert set(ids) == self.gone

    @rule(key=KEYS, n=SIZES, hold=st.booleans())
    def put(self, key: tuple, n: int, hold: bool) -> None:
        before, held = dict(self.owners), self._held()
        had = key in self.owners
        fits = (0 < self.tier.capacity
                and n + self.tier._reserved + self.tier._held_bytes <= self.tier.capacity)
        data = self._view(n)
        kept = self.tier.put(key, data, hold=hold)
        if had:
            assert kept  # kept as it was
        elif kept:
            self.owners[key] = data.obj
            before[key] = data.obj
        else:
            assert not fits, "a chunk refused although held and reserved bytes left room"
        assert held <= self._held(), "a put pushed out a held entry"
        self._after(before)

    @rule(key=KEYS)
    def hold(self, key: tuple) -> None:
        before = dict(self.owners)
        assert self.tier.hold(key) == (key in self.owners)
        if key in self.owners:
            assert key in self.tier._held
        self._after(before)

    @rule(key=KEYS)
    def unhold(self, key: tuple) -> None:
        before = dict(self.owners)
        self.tier.unhold(key)
        self._after(before)

    @rule(n=SIZES)
    def reserve(self, n: int) -> None:
        before, held = dict(self.owners), self._held()
        if self.tier.reserve(n):
            self.reservations.append(n)
        assert held <= self._held(), "a reservation pushed out a held entry"
        self._after(before)

    @precondition(lambda self: self.reservations)
    @rule(i=st.integers(min_value=0))
    def unreserve(self, i: int) -> None:
        self.tier.unreserve(self.reservations.pop(i % len(self.reservations)))

    @rule(i=st.integers(min_value=0, max_value=5))
    def drop(self, i: int) -> None:
        before = dict(self.owners)
        self.tier.drop_chunk(b"c%d" % i, 2)
        assert all(self.tier.get((b"c%d" % i, b)) is None for b in (WHOLE, 0, 1))
        self._after(before)

    @invariant()
    def within_capacity(self) -> None:
        t = self.tier
        assert t._size == sum(len(v) for v in t._lru.values())
        assert t._held_bytes == sum(len(e[0]) for e in t._held.values())
        assert t._reserved == sum(self.reservations)
        assert t.bytes == t._size + t._held_bytes + t._reserved <= max(t.capacity, 0)
        assert not set(t._lru) & set(t._held)
        assert all(e[1] > 0 for e in t._held.values())
        assert set(t._lru) | set(t._held) == set(self.owners)


TierMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60,
                                          deadline=None)
test_memory_tier_accounting = TierMachine.TestCase


def test_reservations_over_capacity_leave_puts_nothing_to_evict():
    """The M1 case itself: reservations fill the tier, then a chunk arrives."""
    tier = MemoryTier(64)
    assert tier.reserve(32) and tier.reserve(32)
    assert not tier.reserve(8)  # not counted: the caller goes on without the tier
    assert not tier.put((b"a", WHOLE), b"x" * 8)  # served, not kept; nothing raised
    tier.unreserve(32)
    assert tier.put((b"a", WHOLE), b"x" * 8) and tier.bytes == 40


def test_a_held_entry_stays_until_it_is_read():
    tier = MemoryTier(30)
    assert tier.put((b"ahead", WHOLE), b"a" * 10, hold=True)
    assert tier.put((b"old", WHOLE), b"o" * 10)
    assert tier.put((b"next", WHOLE), b"n" * 10, hold=True)
    assert not tier.put((b"more", WHOLE), b"m" * 20, hold=True)  # would push out a held one
    assert tier.reserve(10) and tier.get((b"old", WHOLE)) is None  # the LRU's went
    assert not tier.reserve(1)
    tier.unreserve(10)
    # a reader's chunk with no room is not kept (its reader keeps it: OwnChunk); the
    # chunks read ahead stay until read
    assert not tier.put((b"reader", WHOLE), b"r" * 20)
    assert tier.get((b"ahead", WHOLE)) is not None and tier.get((b"next", WHOLE)) is not None
    tier.unhold((b"ahead", WHOLE))
    tier.unhold((b"next", WHOLE))
    assert tier.held_bytes == 0 and tier.put((b"reader", WHOLE), b"r" * 20)
    # released, they are the LRU's: the older one left for the reader's chunk
    assert tier.get((b"ahead", WHOLE)) is None and tier.get((b"next", WHOLE)) is not None
