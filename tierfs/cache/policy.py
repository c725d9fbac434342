"""The placement policy: what the disk tier keeps, and what leaves to make room.

One object, `Placement`, holds everything eviction and admission decide on, in memory:
the record of every cached chunk (length, heat, last access), the bytes used, reserved
(chunks being written, staging copies moving in) and dirty (unsaved writes), the heat
half-life (heat.py), the admission policy's memory (admission.py) and the tenants' counts
(shares.py). The cache tells it events (a chunk read, stored or dropped, a job opened, a
pin changed, unsaved bytes reserved or released) and asks it decisions. It does no I/O
and never waits: the only outside fact it asks for is the disk budget (`budget(used)`,
the free-space guard's statvfs in the daemon, a constant in bench/evict.py).

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
from dataclasses import dataclass
from typing import Callable, Generator, TypeVar

from ..index.chunks import ChunkRecord
from ..tenants import TenantMap
from . import order
from .admission import Admission, Fill
from .heat import HalfLife, touched
from .shares import Pinned, Shares

Eviction = tuple[bytes, "str | None"]  # a chunk to evict; why a refused chunk may take its room
Plan = Generator[Eviction, None, "Outcome"]
T = TypeVar("T")


class Outcome(enum.Enum):
    STORED = "stored"  # room made (and reserved): the chunk or the dirty bytes go in
    REFUSED = "refused"  # the admission policy keeps a reader's chunk out (admission.py)
    FULL = "full"  # no room in the budget even after evicting
    OVER_HARD = "over_hard"  # the tenant is at its hard share with nothing of its own to evict


@dataclass
class _Filling:
    """A chunk being written to the disk tier (`fill_started` to `fill_ended`)."""

    length: int
    kind: Fill
    tenant: str
    lru_hit: bool  # plain LRU would have hit this reader's chunk (admission.py)
    held: bool  # it moves into the room of a staging copy: no room to make
    reserved: bool = False  # its bytes are counted in `reserved`


def carry_out(plan: Generator[Eviction, None, T], drop: Callable[[bytes, str | None], None]) -> T:
    """Run a decision without I/O: `drop(key, why)` evicts each chunk it names."""
    try:
        while True:
            drop(*next(plan))
    except StopIteration as done:
        return done.value


class Placement:
    """The policy (module doc). `budget(used)`: the bytes the disk tier may hold given
    `used`; high and low: its watermarks; `half_life`: the configured heat half-life."""

    def __init__(self, admission: Admission, *, budget: Callable[[int], int], high: float,
                 low: float, half_life: float, tenants: TenantMap | None = None,
                 pinned: Pinned = frozenset()) -> None:
        self.admission = admission
        self.budget = budget
        self.high, self.low = high, low
        self.half_life = HalfLife(half_life, admission.chunks)
        self.shares = Shares(tenants if tenants is not None else TenantMap(), pinned)
        self.chunks: dict[bytes, ChunkRecord] = {}
        self.used = 0
        self.reserved = 0
        self.dirty = 0
        self._filling: dict[bytes, _Filling] = {}
        # written chunks read at most once (heat below 1), oldest stored first: the room
        # writes take first (`_recycle`, docs/architecture.md decision 3e)
        self.written: dict[bytes, None] = {}
        self.last_read = 0.0  # clock of the last reader's access (a touch or a reader's fill)
        # The coldest chunk the last sort found, per scope (None: the whole cache; a
        # tenant's name: its own chunks at its hard share), with the state's version then
        # and its last read. A reader's chunk refused against it is compared with it again,
        # not after a new sort (a refusal changes nothing). A chunk added, removed or
        # pinned, a change of the bytes reserved or dirty, or a read of that chunk make it
        # stale; reads of other chunks only make them hotter.
        self._version = 0
        self._coldest: dict[str | None, tuple[int, bytes, float]] = {}

    @property
    def pinned(self) -> Pinned:
        return self.shares.pinned

    @pinned.setter
    def pinned(self, pinned: Pinned) -> None:
        self.shares.pinned = pinned

    @property
    def total(self) -> int:
        """Bytes counted against the budget: cached, reserved and dirty."""
        return self.used + self.reserved + self.dirty

    # ---- events --------------------------------------------------------------------

    def add(self, ckey: bytes, rec: ChunkRecord, tenant: str) -> None:
        """A chunk is in the disk tier (stored, recovered at start-up, or linked)."""
        self._version += 1
        self.chunks[ckey] = rec
        if rec.heat < 1.0:
            self.written[ckey] = None
        self.used += rec.length
        self.shares.added(ckey, rec.length, tenant)

    def dropped(self, ckey: bytes, *, evicted: bool = False) -> ChunkRecord | None:
        """A chunk left the disk tier (evicted: by this policy's decision); its record."""
        self._version += 1
        rec = self.chunks.pop(ckey, None)
        if rec is None:
            return None
        self.written.pop(ckey, None)
        self.admission.dropped(ckey)
        if evicted:
            self.admission.evicted(ckey, rec)
        self.used -= rec.length
        self.shares.removed(ckey, rec.length)
        return rec

    def touch(self, ckey: bytes, now: float) -> ChunkRecord | None:
        """A reader's access to a chunk (once per handle per chunk): its record if cached,
        its heat and last access updated."""
        rec = self.chunks.get(ckey)
        if rec is not None:
            self.admission.read(ckey, rec)
            rec.heat = touched(rec.heat, rec.last_access, now, self.half_life.value)
            rec.last_access = now
            if rec.heat >= 1.0:
                self.written.pop(ckey, None)
        self.last_read = now
        self._accessed(now)
        return rec

    def _accessed(self, now: float) -> None:
        """Count a chunk access (a touch or a fill) on the heat clock (heat.HalfLife)."""
        self.admission.accessed()
        if self.half_life.accessed(now):
            self.admission.set_half_life(self.half_life.value)
            self._version += 1  # the order of the chunks changed

    def opened_by(self, reader: str) -> None:
        """A file was opened by `reader` (admission.py, `job_opened`)."""
        self.admission.job_opened(reader)

    def pin_changed(self, oid: bytes, pinned: bool) -> None:
        self._version += 1
        self.shares.pin_changed(oid, pinned)

    def add_dirty(self, tenant: str, n: int) -> None:
        """n bytes of unsaved writes of `tenant`: budgeted, never evicted."""
        self._version += 1
        self.dirty += n
        self.shares.dirty(tenant, n)

    def release_dirty(self, tenant: str, n: int) -> None:
        """n dirty bytes uploaded or dropped (`tenant`'s first: shares.release_dirty)."""
        self._version += 1
        self.dirty -= n
        self.shares.release_dirty(tenant, n)

    def hold(self, tenant: str, n: int) -> None:
        """n dirty bytes are uploaded but their staging copy stays until its chunks move
        into the disk tier: reserved now, no longer dirty."""
        self.release_dirty(tenant, n)
        self._reserve(tenant, n)

    def release_held(self, tenant: str, n: int) -> None:
        """n held bytes (`hold`) whose staging copy is gone."""
        self._version += 1
        self._reserve(tenant, -n)

    # ---- fills ---------------------------------------------------------------------

    def fill_started(self, ckey: bytes, length: int, kind: Fill, tenant: str, now: float,
                     *, held: bool = False) -> bool:
        """A chunk may be written to the disk tier: False if it is cached or being written
        already; else counted as an access and protected until `fill_ended`. `held`: it
        moves into the room of a staging copy released just before (`release_held`), so
        `room_for_fill` evicts nothing for it."""
        if ckey in self.chunks or ckey in self._filling:
            return False
        lru_hit = False
        if kind is Fill.READ:
            self.last_read = now
            lru_hit = self.admission.missed(ckey, length)
        self._accessed(now)
        self._filling[ckey] = _Filling(length, kind, tenant, lru_hit, held)
        return True

    def room_for_fill(self, ckey: bytes, now: float) -> Plan:
        """Room for a chunk `fill_started`: its tenant's own chunks first when at its hard
        share, then the budget's eviction; a reader's chunk that would push out a chunk
        with more reads is refused (admission.py). STORED reserves its bytes."""
        f = self._filling[ckey]
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

    def stored(self, ckey: bytes, crcs: tuple[int, ...], now: float) -> ChunkRecord:
        """The chunk's file is written: indexed at its entry heat (admission.entry_heat)."""
        f = self._filling[ckey]
        heat = self.admission.entry_heat(ckey, f.kind, now, f.length)
        rec = ChunkRecord(f.length, heat, now, crcs)
        self.add(ckey, rec, f.tenant)
        return rec

    def fill_ended(self, ckey: bytes) -> None:
        """The fill is over (stored or not): its reservation, if it had one, ends."""
        f = self._filling.pop(ckey)
        if f.reserved:
            self._version += 1
            self._reserve(f.tenant, -f.length)

    def _reserve(self, tenant: str, n: int) -> None:
        self.reserved += n
        self.shares.tally[tenant].reserved += n

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
            ckey, lambda k: (k not in self._filling and k[:16] not in self.pinned
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
                and ckey[:16] not in self.pinned and ckey not in self._filling)

    # ---- eviction order ------------------------------------------------------------

    def must_evict(self, incoming: int) -> bool:
        """Whether storing `incoming` more bytes would pass the high watermark."""
        return self.total + incoming > self.high * self.budget(self.total)

    def coldest(self, only: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """The evictable chunks (of those `only` accepts), coldest first: not being
        written, not of a pinned object."""
        pinned, filling = self.pinned, self._filling
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
