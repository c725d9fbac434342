"""What the disk tier holds, as the placement policy (policy.py) sees it.

`TierState` keeps, in memory: the record of every cached chunk (length, heat, last
access), the bytes used, reserved (chunks being written, staging copies moving in) and
dirty (unsaved writes), the chunks being written, the written chunks read at most once
(the room writes take first), the heat half-life (heat.py), the admission policy's memory
(admission.py) and the tenants' counts (shares.py). Its methods are the events the cache
tells it (a chunk read, stored or dropped, a job opened, a pin changed, unsaved bytes
reserved, held or released); it decides nothing: `Placement` adds the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..index.chunks import ChunkRecord
from ..tenants import TenantMap
from .admission import Admission, Fill
from .heat import HalfLife, touched
from .shares import Pinned, Shares


@dataclass
class Filling:
    """A chunk being written to the disk tier (`fill_started` to `fill_ended`)."""

    length: int
    kind: Fill
    tenant: str
    lru_hit: bool  # plain LRU would have hit this reader's chunk (admission.py)
    held: bool  # it moves into the room of a staging copy: no room to make
    reserved: bool = False  # its bytes are counted in `reserved`


class TierState:
    """The state (module doc). `half_life`: the configured heat half-life."""

    def __init__(self, admission: Admission, *, half_life: float,
                 tenants: TenantMap | None = None, pinned: Pinned = frozenset()) -> None:
        self.admission = admission
        self.half_life = HalfLife(half_life, admission.chunks)
        self.shares = Shares(tenants if tenants is not None else TenantMap(), pinned)
        self.chunks: dict[bytes, ChunkRecord] = {}
        self.used = 0
        self.reserved = 0
        self.dirty = 0
        self.being_written: dict[bytes, Filling] = {}
        # written chunks read at most once (heat below 1), oldest stored first: the room
        # writes take first (policy.py `_recycle`, docs/architecture.md decision 3e)
        self.written: dict[bytes, None] = {}
        self.last_read = 0.0  # clock of the last reader's access (a touch or a reader's fill)
        # bumped by every change that can change which chunk is the coldest (policy.py)
        self._version = 0

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
        if ckey in self.chunks or ckey in self.being_written:
            return False
        lru_hit = False
        if kind is Fill.READ:
            self.last_read = now
            lru_hit = self.admission.missed(ckey, length)
        self._accessed(now)
        self.being_written[ckey] = Filling(length, kind, tenant, lru_hit, held)
        return True

    def stored(self, ckey: bytes, crcs: tuple[int, ...], now: float) -> ChunkRecord:
        """The chunk's file is written: indexed at its entry heat (admission.entry_heat)."""
        f = self.being_written[ckey]
        heat = self.admission.entry_heat(ckey, f.kind, now, f.length)
        rec = ChunkRecord(f.length, heat, now, crcs)
        self.add(ckey, rec, f.tenant)
        return rec

    def fill_ended(self, ckey: bytes) -> None:
        """The fill is over (stored or not): its reservation, if it had one, ends."""
        f = self.being_written.pop(ckey)
        if f.reserved:
            self._version += 1
            self._reserve(f.tenant, -f.length)

    def _reserve(self, tenant: str, n: int) -> None:
        self.reserved += n
        self.shares.tally[tenant].reserved += n
