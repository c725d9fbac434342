"""ChunkCache: the memory tier in front of the disk tier, with heat and eviction.

Contract (see docs/architecture.md, "Concurrency"):
- everything here runs on the trio thread except DiskTier calls, which go to worker
  threads (but `DiskTier.read_cached`, which never blocks: page-cache hits are read on the
  trio thread); the in-memory index (`_index`) is only touched on the trio thread;
- the index is persisted to LMDB in batches by `flush_index` (at most a second behind):
  a crash loses recent index entries, whose files recovery then deletes as orphans;
- a chunk whose blocks fail verification is dropped and reported as a miss, so the
  caller fetches it again: the cache is a hint, never a source of wrong bytes.

Tenants (docs/tenants.md): every cached chunk, pin and dirty byte is counted to the tenant
of its object's key (`tenant_bytes`, the gauges tierfs_tenant_cache_bytes). The tenant of
a chunk is kept per object id in memory, recomputed at `recover` from the objects db, so
the counts survive a restart (and follow a changed tenants option). The counts drive the
quotas: tenants above their soft share are evicted first, a tenant at its hard share
evicts its own chunks to admit new ones (or serves without the disk tier), and
`sweep_idle` evicts what a tenant's max_idle says nobody reads any more.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterable

import trio

from ..errors import CacheCorrupt
from ..index.chunks import ChunkRecord
from ..index.meta import MetaStore
from ..metrics import Metrics
from ..tenants import DEFAULT, TenantMap
from .admission import Admission, Fill
from .disk import REUSE_MIN, DiskTier
from .evictor import Evictor
from .heat import HalfLife, touched
from .keys import ObjectVersion, chunk_name
from .memory import WHOLE, MemoryTier
from .pins import Pins

log = logging.getLogger(__name__)

__all__ = ["Admission", "ChunkCache", "Fill", "ObjectVersion", "TenantBytes"]

KINDS = ("cached", "pinned", "dirty")  # the kind label of tierfs_tenant_cache_bytes
IDLE_SWEEP_MIN_S, IDLE_SWEEP_MAX_S = 10.0, 600.0


@dataclass(frozen=True)
class TenantBytes:
    """One tenant's bytes in the cache: chunks on disk, the part of them pinned, and
    unsaved writes (which are not chunks: they live in the staging files)."""

    cached: int = 0
    pinned: int = 0
    dirty: int = 0


@dataclass
class _Tally:
    cached: int = 0
    pinned: int = 0
    dirty: int = 0
    reserved: int = 0  # chunks being written, staging copies held: in the shares already

    @property
    def share_used(self) -> int:
        """What counts against the tenant's soft and hard shares (pins are cached chunks)."""
        return self.cached + self.reserved + self.dirty


class ChunkCache:
    def __init__(self, meta: MetaStore, disk: DiskTier, memory: MemoryTier, evictor: Evictor,
                 metrics: Metrics, *, admission: Admission, clock: Callable[[], float] = time.time,
                 tenants: TenantMap | None = None) -> None:
        self.meta = meta
        self.disk = disk
        self.memory = memory
        memory.released = disk.reuse  # a big read's buffer serves the next one (disk.py)
        self.evictor = evictor
        self.admission = admission
        self.metrics = metrics
        # the heat clock evictor and admission share; longer on a node slow to read its cache
        self.half_life = HalfLife(evictor.half_life, admission.chunks)
        metrics.heat_half_life.set(evictor.half_life)
        self.block_size = disk.block_size
        self._clock = clock
        self._index: dict[bytes, ChunkRecord] = {}
        # written chunks read at most once (heat below 1), oldest stored first: the room
        # writes take first (reserve_dirty, decision 3e)
        self._written: dict[bytes, None] = {}
        self._last_read = 0.0  # clock of the last reader's access (a touch or a reader's fill)
        self._used = 0
        self._writing: set[bytes] = set()
        # bytes of chunks being written, and of uploaded staging copies waiting to move into
        # the disk tier (`hold`): counted against the budget, not indexed
        self._reserved = 0
        self._dirty = 0  # bytes of unsaved writes (write-back staging): budgeted, never evicted
        self._dirty_released = trio.Event()
        self._pending_puts: dict[bytes, ChunkRecord] = {}
        self._pending_deletes: set[bytes] = set()
        self._pending_objects: dict[bytes, dict] = {}
        self._full_logged = False
        # The coldest chunk the last sort of the index found, per scope (None: the whole
        # cache; a tenant's name: its own chunks at its hard share), with the index
        # generation it was found in and its last read. A reader's chunk refused against
        # it is compared with it again, not after a sort of the whole index (a refusal
        # changes nothing). A chunk added, removed or pinned, dirty bytes, or a read of
        # that chunk make it stale; reads of other chunks only make them hotter.
        self._generation = 0
        self._coldest: dict[str | None, tuple[int, bytes, float]] = {}
        self.tenants = tenants if tenants is not None else TenantMap()
        self._oid_tenant: dict[bytes, str] = {}  # object id -> tenant, objects with chunks here
        self._oid_bytes: dict[bytes, int] = {}  # object id -> bytes of its chunks here
        self._tally = {name: _Tally() for name in self.tenants.names()}
        # the tenant label's values are the configured tenants and default: a bounded set
        self._tenant_gauges = {name: tuple(metrics.tenant_cache_bytes.labels(name, kind)
                                           for kind in KINDS) for name in self._tally}
        self._soft = {t.name: t.soft for t in self.tenants if t.soft is not None}
        self._hard = {t.name: t.hard for t in self.tenants if t.hard is not None}
        self._max_idle = {t.name: t.max_idle for t in self.tenants if t.max_idle}
        self._hard_logged: set[str] = set()
        self.pins = Pins(meta, clock=clock, on_change=self._pin_changed)
        # the labelled children, looked up once: every read counts one (a lookup per read
        # was a few % of a small read's CPU)
        self._memory_hits = metrics.cache_hits.labels("memory")
        self._disk_hits = metrics.cache_hits.labels("disk")
        self._disk_bytes = metrics.cache_bytes.labels("disk")
        self._memory_bytes = metrics.cache_bytes.labels("memory")
        for name in self._tally:
            self._show(name)

    # ---- start-up ------------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Reconcile index and disk (blocking; run before serving). Returns (kept, dropped)."""
        present = self.disk.scan()
        dropped = []
        kept = []
        for key, rec in self.meta.chunks.all():
            name = chunk_name(key)
            size = present.pop(name, None)
            # a record salvaged from a damaged index must at least have a CRC per block
            if size == rec.length and len(rec.crcs) == self.blocks_of(rec.length):
                kept.append((key, rec))
                continue
            dropped.append(key)
            if size is not None:
                self.disk.delete_name(name)
        for name in present:  # files the index never recorded (crash before a flush)
            self.disk.delete_name(name)
        self.meta.chunks.apply({}, dropped)
        # tenants from the objects db (after the walk: one read transaction at a time);
        # oldest first, the order of `_written`
        kept.sort(key=lambda kr: kr[1].last_access)
        for key, rec in kept:
            self._add_chunk(key, rec, self._stored_tenant(key[:16]))
            if rec.heat > 0:  # read (or warmed) at its last access: the last read we know
                self._last_read = max(self._last_read, rec.last_access)
        self._publish()
        return len(self._index), len(dropped) + len(present)

    # ---- reads ---------------------------------------------------------------------

    def blocks_of(self, length: int) -> int:
        return max(1, -(-length // self.block_size))

    def in_memory(self, ckey: bytes, first: int, last: int) -> bytes | memoryview | None:
        """Bytes of blocks first..last of a chunk if the memory tier has them all."""
        whole = self.memory.get((ckey, WHOLE))
        bs = self.block_size
        if whole is not None:
            return memoryview(whole)[first * bs:(last + 1) * bs]
        blocks = []
        for b in range(first, last + 1):
            data = self.memory.get((ckey, b))
            if data is None:
                return None
            blocks.append(data)
        return blocks[0] if len(blocks) == 1 else b"".join(blocks)

    def touch(self, ckey: bytes) -> None:
        """A reader's access to a chunk (once per handle per chunk): its heat, if cached."""
        now = self._clock()
        rec = self._index.get(ckey)
        if rec is not None:
            self.admission.read(ckey, rec)
            rec.heat = touched(rec.heat, rec.last_access, now, self.evictor.half_life)
            rec.last_access = now
            self._pending_puts[ckey] = rec
            if rec.heat >= 1.0:
                self._written.pop(ckey, None)
        self._last_read = now
        self._accessed(now)

    def _accessed(self, now: float) -> None:
        """Count a chunk access (a touch or a fill) on the heat clock (heat.HalfLife)."""
        self.admission.accessed()
        if self.half_life.accessed(now):
            value = self.half_life.value
            self.evictor.half_life = value
            self.admission.set_half_life(value)
            self._generation += 1  # the order of the index changed
            self.metrics.heat_half_life.set(value)

    def has(self, ckey: bytes) -> bool:
        return ckey in self._index

    def opened_by(self, reader: str) -> None:
        """A file was opened by `reader` (tierfs/telemetry/callers.py): a new job's data is cached as
        plain LRU caches it (admission.py, `job_opened`)."""
        self.admission.job_opened(reader)

    def read_memory(self, ckey: bytes, first: int, last: int) -> bytes | memoryview | None:
        """Blocks first..last of a chunk if the memory tier has them all (a hit counted)."""
        data = self.in_memory(ckey, first, last)
        if data is not None:
            self._memory_hits.inc()
        return data

    async def read_disk(self, ckey: bytes, first: int, last: int) -> bytes | memoryview | None:
        """Blocks first..last of a chunk from the disk tier, verified, or None (a miss; a
        chunk that fails verification is dropped and is a miss: the cache is a hint)."""
        rec = self._index.get(ckey)
        if rec is None:
            self.metrics.cache_misses.inc()
            return None
        try:
            # from the page cache on this thread when it can (no hand-off), else a worker's
            data = self.disk.read_cached(ckey, rec.length, rec.crcs, first, last)
            if data is None:
                # a big read goes into a reused buffer: reserved in the memory tier while in
                # flight, as a GET is (the tier's size bounds both; what leaves for it is
                # the buffer it reads into)
                span = min(rec.length, (last + 1) * self.block_size) - first * self.block_size
                reserved = span >= REUSE_MIN and self.memory.reserve(span)
                try:
                    data = await trio.to_thread.run_sync(self.disk.read_blocks, ckey,
                                                         rec.length, rec.crcs, first, last)
                finally:
                    if reserved:
                        self.memory.unreserve(span)
        except CacheCorrupt as exc:
            if self._index.get(ckey) is rec:  # a concurrent reader may have dropped it already
                log.warning("dropping cached chunk: %s", exc)
                self.metrics.cache_corrupt.inc()
                await self.drop(ckey)
            self.metrics.cache_misses.inc()
            return None
        self._disk_hits.inc()
        self._publish()
        return data

    def keep(self, ckey: bytes, first: int, last: int, data: bytes | memoryview, *,
             whole: bool, ahead: bool = False) -> bool:
        """Put blocks first..last of a chunk (`whole`: all of it) in the memory tier, or
        views of them, without a copy; False if the tier had no room (memory.py: reserved
        bytes are not evictable, and a read-ahead's bytes, `ahead`, do not take held
        ones' room)."""
        if whole:
            return self.memory.put((ckey, WHOLE), data, ahead=ahead)
        if first == last:
            return self.memory.put((ckey, first), data, ahead=ahead)
        bs, view, kept = self.block_size, memoryview(data), True
        for i, b in enumerate(range(first, last + 1)):
            kept &= self.memory.put((ckey, b), view[i * bs:(i + 1) * bs], ahead=ahead)
        return kept

    async def read(self, ckey: bytes, first: int, last: int, *, touch: bool,
                   ahead: bool = False) -> tuple[bytes | memoryview, str] | None:
        """The memory tier, then the disk tier, for callers that know a chunk key only
        (tests, tools); the daemon reads through tierfs/read/walk.py."""
        data = self.read_memory(ckey, first, last)
        source = "memory"
        if data is None:
            data, source = await self.read_disk(ckey, first, last), "disk"
            if data is None:
                return None
            rec = self._index.get(ckey)
            whole = first == 0 and rec is not None and last == self.blocks_of(rec.length) - 1
            self.keep(ckey, first, last, data, whole=whole, ahead=ahead)
        if touch:
            self.touch(ckey)
        return data, source

    # ---- fills and eviction --------------------------------------------------------

    async def fill(self, obj: ObjectVersion, ckey: bytes, data: bytes,
                   kind: Fill = Fill.READ, *, held: int = 0) -> None:
        """Write a chunk to the disk tier: fetched for a reader (who has the bytes already),
        or written through the mount (`Fill.WRITTEN`, with `held`: see `filling`)."""
        async with self.filling(obj, ckey, len(data), kind, held=held) as stored:
            if stored is None:
                return
            try:
                stored(await trio.to_thread.run_sync(self.disk.write, ckey, data))
            except OSError as exc:
                # a full or failing cache disk must not fail the read: serve from memory only
                log.warning("cannot write chunk to the cache dir: %s", exc)

    @asynccontextmanager
    async def filling(self, obj: ObjectVersion, ckey: bytes, length: int, kind: Fill = Fill.READ,
                      *, held: int = 0
                      ) -> AsyncIterator[Callable[[tuple[int, ...]], None] | None]:
        """Room and bookkeeping for writing one chunk to the disk tier.

        Yields None when the chunk is there already, being written, does not fit (in
        the budget, or in its tenant's hard share), or is a reader's chunk the admission
        policy refuses (it would push out a chunk with more reads: admission.py);
        else a function to call with the chunk's CRCs once its file is written, which
        indexes it. Room is made and reserved before the caller's write (concurrent fills
        see each other); the reservation ends with the block.

        `held`: bytes of an uploaded staging copy (`hold`) this chunk moves out of, a
        written chunk leaving its staging file. They are released at once, and the chunk
        takes their room without evicting anything, so a written file holds its size in
        the cache once, not twice (docs/architecture.md, decision 3d).
        """
        if held:
            # before any await: no other fill or write can take the room in between
            self.release_held(held, key=obj.key)
        if ckey in self._index or ckey in self._writing:
            yield None
            return
        now = self._clock()
        lru_hit = False  # plain LRU would have hit this reader's chunk (admission.py)
        if kind is Fill.READ:
            self._last_read = now
            lru_hit = self.admission.missed(ckey, length)
        self._accessed(now)
        self._writing.add(ckey)
        tenant = self._oid_tenant.get(ckey[:16]) or self.tenants.of(obj.key)
        tally = self._tally[tenant]
        reserved = 0
        try:
            # its own chunks first when at its hard share; the check again after the
            # global eviction's awaits (other fills of the tenant may have come in)
            reader = ckey if kind is Fill.READ else None  # the chunk admission decides on
            if not held and not (await self._admit(tenant, length, reader)
                                  and await self._make_room(length, reader, tenant, lru_hit)
                                  and self._within_hard(tenant, length)):
                yield None
                return
            reserved = length
            self._reserved += reserved
            tally.reserved += reserved
            self._generation += 1  # a tenant's share used, hence the soft order, changed

            def stored(crcs: tuple[int, ...]) -> None:
                now = self._clock()
                rec = ChunkRecord(length, self.admission.entry_heat(ckey, kind, now, length), now,
                                  crcs)
                self._add_chunk(ckey, rec, tenant)
                self._pending_puts[ckey] = rec
                self._pending_deletes.discard(ckey)
                self._pending_objects.setdefault(ckey[:16], {
                    "bucket": obj.bucket, "key": obj.key, "etag": obj.etag, "size": obj.size})

            yield stored
        finally:
            self._reserved -= reserved
            tally.reserved -= reserved
            self._generation += bool(reserved)
            self._writing.discard(ckey)
            self._publish()

    async def _make_room(self, incoming: int, reader: bytes | None = None,
                         tenant: str = DEFAULT, lru_hit: bool = False) -> bool:
        known = self._known_coldest(None) if reader is not None else None
        if known is not None and self.evictor.must_evict(
                self._used + self._reserved + self._dirty, incoming) and self._refuses(
                reader, incoming, known, tenant):
            return await self._yielded_room(reader, incoming, lru_hit)
        victims, fits = self._victims(incoming)
        if self._refuses(reader, incoming, self._remember_coldest(None, victims), tenant):
            assert reader is not None
            return await self._yielded_room(reader, incoming, lru_hit)
        for key in victims:
            await self.drop(key, evicted=True)
        if not fits and not self._full_logged:
            log.warning("cache budget exhausted (%d bytes used): serving without the disk tier",
                        self._used)
            self._full_logged = True
        return fits

    async def _yielded_room(self, ckey: bytes, incoming: int, lru_hit: bool) -> bool:
        """A reader's chunk the comparison refused takes the room of one chunk that yields
        it (an abandoned one, or one plain LRU let go while the cache trails it or a new job
        reads: admission.py `yielding`) at least its size: a big chunk never takes the room
        of small files, whose misses cost as much per file (decision 3c; bench/report_run.py:
        each 8 MiB training chunk LRU would hit pushed out label files, 0.86 -> 0.10 of
        their reads hit). Else it is refused: counted, its read remembered, and a budget
        the free-space guard shrank is kept."""
        yielded = self.admission.yielding(
            ckey, lambda k: (k not in self._writing and k[:16] not in self.pins
                             and self._index[k].length >= incoming), lru_hit)
        if yielded is not None:
            self.metrics.cache_yielded.labels(yielded[1]).inc()
            await self.drop(yielded[0], evicted=True)
            if not self.evictor.must_evict(self._used + self._reserved + self._dirty,
                                           incoming):
                return True
        self._refused(ckey)
        await self._keep_budget()
        return False

    def _refused(self, ckey: bytes) -> None:
        """A reader's chunk is served from memory only: counted, its read remembered."""
        self.admission.refused(ckey, self._clock())
        self.metrics.cache_refused.inc()

    async def _keep_budget(self) -> None:
        """A refused chunk stays out, but a budget the free-space guard shrank is kept."""
        if self.evictor.must_evict(self._used + self._reserved + self._dirty, 0):
            for key in self._victims(0)[0]:
                await self.drop(key, evicted=True)

    def _known_coldest(self, scope: str | None) -> bytes | None:
        """The coldest chunk of `scope` the last sort found, if it still is (see __init__)."""
        known = self._coldest.get(scope)
        if known is None or known[0] != self._generation:
            return None
        rec = self._index.get(known[1])
        return known[1] if rec is not None and rec.last_access == known[2] else None

    def _remember_coldest(self, scope: str | None, victims: list[bytes]) -> bytes | None:
        if not victims:
            return None
        self._coldest[scope] = (self._generation, victims[0], self._index[victims[0]].last_access)
        return victims[0]

    def _victims(self, incoming: int) -> tuple[list[bytes], bool]:
        return self.evictor.victims(
            self._index, self._used + self._reserved + self._dirty, incoming, self._writing,
            self.pins, over_soft=self._over_soft if self._soft else None, owner=self._owner)

    def _refuses(self, ckey: bytes | None, length: int, victim: bytes | None,
                 tenant: str) -> bool:
        """Whether the admission policy keeps a reader's chunk `ckey` (`length` bytes, of
        `tenant`) out rather than evict `victim` (the coldest of those to go) for it (then
        _yielded_room). Other fills (ckey None) are not the policy's, nor a victim of
        another tenant above its soft share: the operator's shares come before heat."""
        if ckey is None or victim is None:
            return False
        owner = self._owner(victim)
        if owner != tenant and owner in self._soft and self._over_soft(
                self.evictor.budget(self._used + self._reserved + self._dirty)).get(owner):
            return False
        return not self.admission.admits(ckey, length, victim, self._index[victim],
                                         self._clock())

    # ---- tenants -------------------------------------------------------------------

    def _owner(self, ckey: bytes) -> str:
        return self._oid_tenant.get(ckey[:16], DEFAULT)

    def _stored_tenant(self, oid: bytes) -> str:
        """The tenant of an object id from the objects db (recovery: no ObjectVersion)."""
        tenant = self._oid_tenant.get(oid)
        if tenant is None:
            info = self.meta.chunks.object_info(oid)
            key = info.get("key") if info else None
            tenant = self.tenants.of(key) if isinstance(key, str) else DEFAULT
        return tenant

    def _add_chunk(self, ckey: bytes, rec: ChunkRecord, tenant: str) -> None:
        self._generation += 1
        self._index[ckey] = rec
        if rec.heat < 1.0:
            self._written[ckey] = None
        self._used += rec.length
        oid = ckey[:16]
        self._oid_tenant[oid] = tenant
        self._oid_bytes[oid] = self._oid_bytes.get(oid, 0) + rec.length
        tally = self._tally[tenant]
        tally.cached += rec.length
        if oid in self.pins:
            tally.pinned += rec.length
        self._show(tenant)

    def _remove_chunk(self, ckey: bytes) -> ChunkRecord | None:
        self._generation += 1
        rec = self._index.pop(ckey, None)
        if rec is None:
            return None
        self._written.pop(ckey, None)
        self.admission.dropped(ckey)
        self._used -= rec.length
        oid = ckey[:16]
        tenant = self._oid_tenant.get(oid, DEFAULT)
        left = self._oid_bytes.pop(oid, 0) - rec.length
        if left > 0:
            self._oid_bytes[oid] = left
        else:
            self._oid_tenant.pop(oid, None)
        tally = self._tally[tenant]
        tally.cached -= rec.length
        if oid in self.pins:
            tally.pinned -= rec.length
        self._show(tenant)
        return rec

    def _pin_changed(self, oid: bytes, pinned: bool) -> None:
        self._generation += 1
        n = self._oid_bytes.get(oid)
        if n:
            tenant = self._oid_tenant[oid]
            self._tally[tenant].pinned += n if pinned else -n
            self._show(tenant)

    def _show(self, tenant: str) -> None:
        tally = self._tally[tenant]
        cached, pinned, dirty = self._tenant_gauges[tenant]
        cached.set(tally.cached)
        pinned.set(tally.pinned)
        dirty.set(tally.dirty)

    def tenant_bytes(self) -> dict[str, TenantBytes]:
        """Cached, pinned and dirty bytes of every tenant (default included), exact."""
        return {name: TenantBytes(t.cached, t.pinned, t.dirty) for name, t in self._tally.items()}

    def tenant_of(self, obj: ObjectVersion) -> str:
        return self._oid_tenant.get(obj.oid) or self.tenants.of(obj.key)

    def hard_share(self, tenant: str) -> int | None:
        """Bytes of the tenant's hard share of the current budget (None: it has none)."""
        share = self._hard.get(tenant)
        return None if share is None else share.of(self.budget())

    def pinned_bytes(self, tenant: str, exclude: Iterable[bytes] = ()) -> int:
        """Cached bytes of the tenant's pinned objects, except those in `exclude`."""
        skip = set(exclude)
        return sum(n for oid, n in self._oid_bytes.items()
                   if oid in self.pins and oid not in skip and self._oid_tenant[oid] == tenant)

    def _over_soft(self, budget: int) -> dict[str, int]:
        """Bytes each tenant is above its soft share of `budget` (the evictor asks)."""
        out = {}
        for name, share in self._soft.items():
            over = self._tally[name].share_used - share.of(budget)
            if over > 0:
                out[name] = over
        return out

    def _within_hard(self, tenant: str, incoming: int) -> bool:
        share = self._hard.get(tenant)
        if share is None:
            return True
        limit = share.of(self.evictor.budget(self._used + self._reserved + self._dirty))
        if self._tally[tenant].share_used + incoming <= limit:
            return True
        if tenant not in self._hard_logged:
            self._hard_logged.add(tenant)
            log.warning("tenant %s is at its hard share (%s: %d bytes) and nothing of its "
                        "own can be evicted (pinned, unsaved or being written): serving it "
                        "without the disk tier", tenant, share, limit)
        return False

    async def _admit(self, tenant: str, incoming: int, reader: bytes | None = None) -> bool:
        """A tenant at its hard share makes room for `incoming` bytes from its own chunks
        (coldest first), never from another tenant's; False if it cannot (or the admission
        policy refuses the reader's chunk `reader` those chunks' room)."""
        share = self._hard.get(tenant)
        if share is None:
            return True
        limit = share.of(self.evictor.budget(self._used + self._reserved + self._dirty))
        used = self._tally[tenant].share_used
        if reader is not None and used + incoming > limit and self._refuses(
                reader, incoming, self._known_coldest(tenant), tenant):
            self._refused(reader)
            return False
        victims, _ = self.evictor.own_victims(
            self._index, tenant, self._owner, used, incoming, limit, self._writing, self.pins)
        if self._refuses(reader, incoming, self._remember_coldest(tenant, victims), tenant):
            assert reader is not None
            self._refused(reader)
            return False
        for key in victims:
            await self.drop(key, evicted=True)
        return self._within_hard(tenant, incoming)

    # ---- lifecycle: max_idle -------------------------------------------------------

    def idle_sweep_interval(self) -> float | None:
        """How often `sweep_idle` runs: a tenth of the shortest max_idle, within 10 s -
        10 min; None when no tenant has a max_idle (no sweep)."""
        if not self._max_idle:
            return None
        return min(max(min(self._max_idle.values()) / 10, IDLE_SWEEP_MIN_S), IDLE_SWEEP_MAX_S)

    def _idle(self, ckey: bytes, rec: ChunkRecord, now: float) -> bool:
        limit = self._max_idle.get(self._owner(ckey))
        return (limit is not None and now - rec.last_access >= limit
                and ckey[:16] not in self.pins and ckey not in self._writing)

    async def sweep_idle(self) -> int:
        """Evict the chunks not read for their tenant's max_idle (pins and chunks being
        written excepted); returns the bytes freed."""
        if not self._max_idle:
            return 0
        now = self._clock()
        idle = [k for k, r in self._index.items() if self._idle(k, r, now)]
        freed = chunks = 0
        for key in idle:
            rec = self._index.get(key)
            if rec is not None and self._idle(key, rec, now):  # a read or pin meanwhile
                freed += rec.length
                chunks += 1
                await self.drop(key, evicted=True)
        if chunks:
            log.info("max_idle: evicted %d chunks (%d bytes) not read for their tenant's "
                     "max_idle", chunks, freed)
        return freed

    async def run_idle_sweeper(self) -> None:
        """The periodic max_idle sweep (a supervised service of the core)."""
        interval = self.idle_sweep_interval()
        if interval is None:
            await trio.sleep_forever()
        assert interval is not None
        while True:
            await trio.sleep(interval)
            await self.sweep_idle()

    # ---- dropping ------------------------------------------------------------------

    async def drop(self, ckey: bytes, *, evicted: bool = False) -> None:
        rec = self._remove_chunk(ckey)
        if rec is None:
            return
        self.memory.drop_chunk(ckey, self.blocks_of(rec.length))
        self._pending_puts.pop(ckey, None)
        self._pending_deletes.add(ckey)
        if evicted:
            self.metrics.cache_evictions.inc()
            self.admission.evicted(ckey, rec)
        await trio.to_thread.run_sync(self.disk.delete, ckey)
        self._publish()

    async def evict(self, ckey: bytes, length: int) -> int:
        """Drop a chunk on request (`tierfs evict`) from both tiers: bytes freed on disk."""
        rec = self._index.get(ckey)
        self.memory.drop_chunk(ckey, self.blocks_of(length))
        if rec is None:
            return 0
        await self.drop(ckey)
        return rec.length

    def bytes_of(self, oids: Iterable[bytes]) -> int:
        """Bytes on disk of the chunks of these object versions."""
        return sum(self._oid_bytes.get(oid, 0) for oid in set(oids))

    # ---- dirty data ----------------------------------------------------------------

    async def reserve_dirty(self, nbytes: int, wait_s: float, *, key: str | None = None) -> bool:
        """Count nbytes of new dirty data against the budget, evicting clean chunks first.

        If they do not fit, wait up to wait_s for dirty data to be released (uploads to
        finish); False if they still do not fit: the writer answers ENOSPC. With the
        file's `key` the bytes are its tenant's, and its hard share holds them too (its
        own clean chunks are evicted first); without, they are counted to the default
        tenant and no share holds them. The room comes from earlier writes first
        (`_recycle`).
        """
        tenant = DEFAULT if key is None else self.tenants.of(key)
        with trio.move_on_after(wait_s):
            while True:
                if key is None or await self._admit(tenant, nbytes):
                    await self._recycle(tenant, nbytes)
                    victims, fits = self._victims(nbytes)
                    for victim in victims:
                        await self.drop(victim, evicted=True)
                    if fits and (key is None or self._within_hard(tenant, nbytes)):
                        self._add_dirty(tenant, nbytes)
                        return True
                await self._dirty_released.wait()
        return False

    async def _recycle(self, tenant: str, incoming: int) -> None:
        """A write's room comes from earlier writes first (decision 3e): while `incoming`
        more bytes would pass the high mark, the tenant's oldest written chunk read at
        most once (not pinned) goes, one for one, before any chunk read more. So a job's
        checkpoints take each other's room (the newest is kept for its restore) instead
        of pushing out a batch of its data set each time. Not chunks written since the
        last read: those are this save's earlier files (a checkpoint must not take its
        own room when the one before left less than it needs)."""
        while self.evictor.must_evict(self._used + self._reserved + self._dirty, incoming):
            victim = next((k for k in self._written
                           if self._owner(k) == tenant and k[:16] not in self.pins), None)
            if victim is None or self._index[victim].last_access > self._last_read:
                return
            await self.drop(victim, evicted=True)

    def force_dirty(self, nbytes: int, *, key: str | None = None) -> None:
        """Count recovered dirty data, whatever the budget: it must be uploaded, not refused."""
        self._add_dirty(DEFAULT if key is None else self.tenants.of(key), nbytes)

    def _add_dirty(self, tenant: str, nbytes: int) -> None:
        self._generation += 1
        self._dirty += nbytes
        self._tally[tenant].dirty += nbytes
        self._show(tenant)
        self._publish()

    def hold(self, nbytes: int, *, key: str | None = None) -> None:
        """nbytes of unsaved data of the file `key` are in the store now, but their staging
        copy stays on disk until its chunks move into the disk tier (`filling(held=)`):
        still counted against the budget (as reserved), no longer as dirty."""
        self.release_dirty(nbytes, key=key)
        tenant = DEFAULT if key is None else self.tenants.of(key)
        self._reserved += nbytes
        self._tally[tenant].reserved += nbytes
        self._publish()

    def release_held(self, nbytes: int, *, key: str | None = None) -> None:
        """Held bytes (`hold`) whose staging copy is gone."""
        tenant = DEFAULT if key is None else self.tenants.of(key)
        self._generation += 1
        self._reserved -= nbytes
        self._tally[tenant].reserved -= nbytes
        self._room_released()
        self._publish()

    def _room_released(self) -> None:
        self._dirty_released.set()  # writers waiting for room look again
        self._dirty_released = trio.Event()

    def release_dirty(self, nbytes: int, *, key: str | None = None) -> None:
        """Dirty bytes uploaded or dropped, of the file `key` (None: the default tenant's).
        A file renamed into another tenant meanwhile releases what its first tenant is
        left with, then the rest from the others: the tenants' sum stays the total."""
        self._generation += 1
        self._dirty -= nbytes
        first = DEFAULT if key is None else self.tenants.of(key)
        left = nbytes
        for name in (first, *self._tally):
            tally = self._tally[name]
            take = min(left, tally.dirty)
            if take:
                tally.dirty -= take
                left -= take
                self._show(name)
            if not left:
                break
        self._room_released()
        self._publish()

    @property
    def dirty_bytes(self) -> int:
        return self._dirty

    async def rekey(self, old: ObjectVersion, new: ObjectVersion, indices: Iterable[int]) -> None:
        """Cached chunks of `old` also serve `new` (same bytes: a copy, rename or an
        untouched part of a rewritten object). Files are hard-linked, not copied."""
        for index in indices:
            okey, nkey = old.chunk_key(index), new.chunk_key(index)
            rec = self._index.get(okey)
            if rec is None or nkey in self._index:
                continue
            self.disk.forget(nkey)  # an fd still kept for an earlier file of that name
            try:
                await trio.to_thread.run_sync(os.link, self.disk.path(okey), self.disk.path(nkey))
            except FileNotFoundError:
                await trio.to_thread.run_sync(os.makedirs, os.path.dirname(self.disk.path(nkey)),
                                              0o755, True)
                await trio.to_thread.run_sync(os.link, self.disk.path(okey), self.disk.path(nkey))
            copy = ChunkRecord(rec.length, rec.heat, rec.last_access, rec.crcs)
            self._add_chunk(nkey, copy, self.tenant_of(new))
            self._pending_puts[nkey] = copy
            self._pending_objects.setdefault(nkey[:16], {"bucket": new.bucket, "key": new.key,
                                                         "etag": new.etag, "size": new.size})
        self._publish()

    # ---- persistence ---------------------------------------------------------------

    async def flush_index(self) -> None:
        if not (self._pending_puts or self._pending_deletes or self._pending_objects):
            return
        puts, dels, objs = self._pending_puts, self._pending_deletes, self._pending_objects
        self._pending_puts, self._pending_deletes, self._pending_objects = {}, set(), {}
        # records are copied so later touches do not race the worker thread's pack()
        puts = {k: ChunkRecord(r.length, r.heat, r.last_access, r.crcs) for k, r in puts.items()}
        await trio.to_thread.run_sync(self.meta.chunks.apply, puts, dels, objs)

    async def run_flusher(self, interval_s: float = 1.0) -> None:
        while True:
            await trio.sleep(interval_s)
            await self.flush_index()

    def close(self) -> None:
        """Close the chunk files the disk tier keeps open (at shutdown, after the last read)."""
        self.disk.close()

    def _publish(self) -> None:
        self._disk_bytes.set(self._used)
        self.metrics.dirty_bytes.set(self._dirty)
        self._memory_bytes.set(self.memory.bytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def chunk_count(self) -> int:
        return len(self._index)

    def budget(self) -> int:
        b = self.evictor.budget(self._used)
        self.metrics.cache_budget_bytes.set(b)
        return b
