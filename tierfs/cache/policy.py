"""The placement policy: what the disk tier keeps, and what leaves to make room.

One object, `Placement`, holds everything eviction and admission decide on, in memory
(state.py: the chunk records, the bytes used, reserved and dirty, the heat clock, the
admission policy's memory, the tenants' counts). The cache tells it events (a chunk read,
stored or dropped, a job opened, a pin changed, unsaved bytes reserved or released) and
asks it decisions. It does no I/O and never waits: the only outside fact it asks for is
the disk budget (`budget(used)`, the free-space guard's statvfs in the daemon, a
constant in bench/evict.py).

A decision that evicts is a generator (`room_for_fill`, `room_for_dirty`, `idle`): it
yields (chunk key, reason) for each chunk to evict, the caller deletes the chunk and
tells `dropped`, then resumes it; its return value is the outcome. So the daemon deletes
files between steps (other fills may run meanwhile: a step looks at the state again) and
bench/evict.py replays the same code without any I/O (`carry_out`).

What goes: chunks being written and chunks of pinned objects never; when usage would pass
high x budget, the coldest (order.py) until it is at low x budget; a tenant at its hard
share evicts its own coldest. A write's room comes from earlier written chunks read at
most once first (`_recycle`).
"""

from __future__ import annotations

import enum
from typing import Callable, Generator, TypeVar

from ..index.chunks import ChunkRecord
from ..tenants import TenantMap
from . import order
from .admission import Admission, Fill
from .shares import Pinned
from .state import TierState

Eviction = tuple[bytes, "str | None"]  # a chunk to evict; why a refused chunk may take its room
Plan = Generator[Eviction, None, "Outcome"]
T = TypeVar("T")


class Outcome(enum.Enum):
    STORED = "stored"  # room made (and reserved): the chunk or the dirty bytes go in
    REFUSED = "refused"  # the admission policy keeps a reader's chunk out (admission.py)
    FULL = "full"  # no room in the budget even after evicting
    OVER_HARD = "over_hard"  # the tenant is at its hard share with nothing of its own to evict


def carry_out(plan: Generator[Eviction, None, T], drop: Callable[[bytes, str | None], None]) -> T:
    """Run a decision without I/O: `drop(key, why)` evicts each chunk it names."""
    try:
        while True:
            drop(*next(plan))
    except StopIteration as done:
        return done.value


class Placement(TierState):
    """The policy (module doc) over the state it keeps (state.py). `budget(used)`: the bytes
    the disk tier may hold given `used`; high and low: its watermarks; `half_life`: the
    configured heat half-life."""

    def __init__(self, admission: Admission, *, budget: Callable[[int], int], high: float,
                 low: float, half_life: float, tenants: TenantMap | None = None,
                 pinned: Pinned = frozenset()) -> None:
        super().__init__(admission, half_life=half_life, tenants=tenants, pinned=pinned)
        self.budget = budget
        self.high, self.low = high, low
        # The coldest chunk the last sort found, per scope (None: the whole cache; a
        # tenant's name: its own chunks at its hard share), with the state's version then
        # and its last read. A reader's chunk refused against it is compared with it again,
        # not after a new sort (a refusal changes nothing). A chunk added, removed or
        # pinned, a change of the bytes reserved or dirty, or a read of that chunk make it
        # stale; reads of other chunks only make them hotter.
        self._coldest: dict[str | None, tuple[int, bytes, float]] = {}

    # ---- fills ---------------------------------------------------------------------

    def room_for_fill(self, ckey: bytes, now: float) -> Plan:
        """Room for a chunk `fill_started`: its tenant's own chunks first when at its hard
        share, then the budget's eviction; a reader's chunk that would push out a chunk
        with more reads is refused (admission.py). STORED reserves its bytes."""
        f = self.being_written[ckey]
        if not f.held:
            reader = ckey if f.kind is Fill.READ else None  # the chunk admission decides on
            outcome = yield from self._own_room(f.tenant, f.length, reader, now)
            if outcome is Outcome.STORED:
                outcome = yield from self._make_room(f.length, reader, f.tenant, f.lru_hit, now)
            # again after the evictions (other fills of the tenant may have come in)
            if outcome is Outcome.STORED and not self._within_hard(f.tenant, f.length):
                outcome = Outcome.OVER_HARD
            if outcome is not Outcome.STORED:
                return outcome
        self._version += 1  # a tenant's share used, hence the soft order, changed
        self._reserve(f.tenant, f.length)
        f.reserved = True
        return Outcome.STORED

    def _make_room(self, incoming: int, reader: bytes | None, tenant: str, lru_hit: bool,
                   now: float) -> Plan:
        known = self._known_coldest(None) if reader is not None else None
        if known is not None and self.must_evict(incoming) and self._refuses(
                reader, incoming, known, tenant, now):
            assert reader is not None
            return (yield from self._room_of_refused(reader, incoming, lru_hit, now))
        victims, fits = self.victims(incoming)
        if self._refuses(reader, incoming, self._remember_coldest(None, victims), tenant, now):
            assert reader is not None
            return (yield from self._room_of_refused(reader, incoming, lru_hit, now))
        for key in victims:
            yield key, None
        return Outcome.STORED if fits else Outcome.FULL

    def _room_of_refused(self, ckey: bytes, incoming: int, lru_hit: bool, now: float) -> Plan:
        """A reader's chunk the comparison refused takes the room of one chunk that gives
        way to it (admission.replaceable: one not read for long, or one plain LRU let go)
        at least its size: a big chunk never takes the room of small files, whose misses
        cost as much per file (decision 3c). Else it is refused: its read remembered, and
        a budget the free-space guard shrank is kept."""
        given = self.admission.replaceable(
            ckey, lambda k: (k not in self.being_written and k[:16] not in self.pinned
                             and self.chunks[k].length >= incoming), lru_hit)
        if given is not None:
            yield given
            if not self.must_evict(incoming):
                return Outcome.STORED
        self.admission.refused(ckey, now)
        if self.must_evict(0):
            for key in self.victims(0)[0]:
                yield key, None
        return Outcome.REFUSED

    def _refuses(self, ckey: bytes | None, length: int, victim: bytes | None, tenant: str,
                 now: float) -> bool:
        """Whether admission keeps a reader's chunk `ckey` out rather than evict `victim`
        (the coldest of those to go) for it. Other fills (ckey None) are not its to
        refuse, nor is a victim of another tenant above its soft share: the operator's
        shares come before heat."""
        if ckey is None or victim is None:
            return False
        owner = self.shares.owner(victim)
        if owner != tenant and owner in self.shares.soft and self.shares.over_soft(
                self.budget(self.total)).get(owner):
            return False
        return not self.admission.admits(ckey, length, victim, self.chunks[victim], now)

    def _own_room(self, tenant: str, incoming: int, reader: bytes | None, now: float) -> Plan:
        """A tenant at its hard share makes room for `incoming` bytes from its own chunks
        (coldest first), never from another tenant's."""
        limit = self.hard_limit(tenant)
        if limit is None:
            return Outcome.STORED
        used = self.shares.tally[tenant].share_used
        if reader is not None and used + incoming > limit and self._refuses(
                reader, incoming, self._known_coldest(tenant), tenant, now):
            self.admission.refused(reader, now)
            return Outcome.REFUSED
        victims = self._own_victims(tenant, used, incoming, limit)
        if self._refuses(reader, incoming, self._remember_coldest(tenant, victims), tenant, now):
            assert reader is not None
            self.admission.refused(reader, now)
            return Outcome.REFUSED
        for key in victims:
            yield key, None
        return Outcome.STORED if self._within_hard(tenant, incoming) else Outcome.OVER_HARD

    def hard_limit(self, tenant: str) -> int | None:
        """The tenant's hard share of the budget in bytes (None: it has none)."""
        if tenant not in self.shares.hard:  # no statvfs then
            return None
        return self.shares.hard_limit(tenant, self.budget(self.total))

    def _within_hard(self, tenant: str, incoming: int) -> bool:
        limit = self.hard_limit(tenant)
        return limit is None or self.shares.tally[tenant].share_used + incoming <= limit

    def _known_coldest(self, scope: str | None) -> bytes | None:
        """The coldest chunk of `scope` the last sort found, if it still is (__init__)."""
        known = self._coldest.get(scope)
        if known is None or known[0] != self._version:
            return None
        rec = self.chunks.get(known[1])
        return known[1] if rec is not None and rec.last_access == known[2] else None

    def _remember_coldest(self, scope: str | None, victims: list[bytes]) -> bytes | None:
        if not victims:
            return None
        self._coldest[scope] = (self._version, victims[0], self.chunks[victims[0]].last_access)
        return victims[0]

    # ---- unsaved writes and idle chunks --------------------------------------------

    def room_for_dirty(self, tenant: str, n: int, *, shared: bool = True) -> Plan:
        """Room for n bytes of unsaved writes of `tenant`, clean chunks evicted for them:
        earlier written chunks first (`_recycle`), then as for any fill. `shared`: the
        tenant's hard share holds them too (its own chunks evicted first). STORED counts
        them dirty."""
        outcome = (yield from self._own_room(tenant, n, None, 0.0)) if shared \
            else Outcome.STORED
        if outcome is Outcome.STORED:
            yield from self._recycle(tenant, n)
            victims, fits = self.victims(n)
            for key in victims:
                yield key, None
            outcome = Outcome.STORED if fits else Outcome.FULL
            if fits and shared and not self._within_hard(tenant, n):
                outcome = Outcome.OVER_HARD
        if outcome is Outcome.STORED:
            self.add_dirty(tenant, n)
        return outcome

    def _recycle(self, tenant: str, incoming: int) -> Generator[Eviction, None, None]:
        """While `incoming` more bytes would pass the high mark, the tenant's oldest written
        chunk read at most once (not pinned) goes, one for one, before any chunk read more.
        So a job's checkpoints take each other's room (the newest is kept for its restore)
        instead of pushing out a batch of its data set each time. Not chunks written since
        the last read: those are this save's earlier files (a checkpoint must not take its
        own room when the one before left less than it needs)."""
        while self.must_evict(incoming):
            victim = next((k for k in self.written if self.shares.owner(k) == tenant
                           and k[:16] not in self.pinned), None)
            if victim is None or self.chunks[victim].last_access > self.last_read:
                return
            yield victim, None

    def idle(self, now: float) -> Generator[Eviction, None, None]:
        """Evict the chunks not read for their tenant's max_idle (pinned ones and those
        being written excepted)."""
        if not self.shares.max_idle:
            return
        for key in [k for k, r in self.chunks.items() if self._idle(k, r, now)]:
            rec = self.chunks.get(key)
            if rec is not None and self._idle(key, rec, now):  # a read or pin meanwhile
                yield key, None

    def _idle(self, ckey: bytes, rec: ChunkRecord, now: float) -> bool:
        limit = self.shares.idle_limit(ckey)
        return (limit is not None and now - rec.last_access >= limit
                and ckey[:16] not in self.pinned and ckey not in self.being_written)

    # ---- eviction order ------------------------------------------------------------

    def must_evict(self, incoming: int) -> bool:
        """Whether storing `incoming` more bytes would pass the high watermark."""
        return self.total + incoming > self.high * self.budget(self.total)

    def coldest(self, only: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """The evictable chunks (of those `only` accepts), coldest first: not being
        written, not of a pinned object."""
        pinned, filling = self.pinned, self.being_written
        return order.coldest(self.chunks, self.half_life.value, lambda k: (
            k not in filling and k[:16] not in pinned and (only is None or only(k))))

    def victims(self, incoming: int) -> tuple[list[bytes], bool]:
        """Chunks to evict so that `incoming` more bytes fit, and whether they then fit:
        down to the low mark, tenants above their soft share first (order.py)."""
        used = self.total
        budget = self.budget(used)  # one statvfs
        if used + incoming <= self.high * budget:
            return [], True
        over_soft = self.shares.over_soft(budget) if self.shares.soft else {}
        out, used = order.victims(self.coldest(), self.chunks, used, self.low * budget - incoming,
                                  over_soft, self.shares.owner)
        return out, used + incoming <= budget

    def _own_victims(self, tenant: str, used: int, incoming: int, share: int) -> list[bytes]:
        """A tenant using `used` bytes of its hard `share`: its own chunks to evict so that
        `incoming` more bytes fit. A batch (high - low of the share) at once, as the
        budget's eviction does, so a tenant at its share does not sort for every chunk."""
        if used + incoming <= share:
            return []
        target = share - incoming - int((self.high - self.low) * share)
        out: list[bytes] = []
        order.take(self.coldest(lambda k: self.shares.owner(k) == tenant), self.chunks, used,
                   target, out)
        return out
