"""ChunkCache: the memory tier in front of the disk tier, and the disk tier's index.

ChunkCache does the I/O of the cache: it reads and writes chunk files, deletes what the
placement policy (policy.py) says must go, and persists the index. What stays, what is
admitted and what is evicted is the policy's: ChunkCache tells it every read, store and
drop, and asks it for room before a fill or an unsaved write.

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
quotas (shares.py), and `sweep_idle` evicts what a tenant's max_idle says nobody reads any
more.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Generator, Iterable

import trio

from ..errors import CacheCorrupt
from ..index.chunks import ChunkRecord
from ..index.meta import MetaStore
from ..metrics import Metrics
from ..tenants import DEFAULT, TenantMap
from .admission import Admission, Fill
from .disk import REUSE_MIN, DiskTier
from .evictor import Evictor
from .keys import ObjectVersion, chunk_name
from .memory import WHOLE, MemoryTier
from .pins import Pins
from .policy import Eviction, Outcome, Placement
from .shares import TenantBytes

log = logging.getLogger(__name__)

__all__ = ["Admission", "ChunkCache", "Fill", "ObjectVersion", "TenantBytes"]

KINDS = ("cached", "pinned", "dirty")  # the kind label of tierfs_tenant_cache_bytes


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
        self.tenants = tenants if tenants is not None else TenantMap()
        self.policy = Placement(admission, budget=evictor.budget, high=evictor.high,
                                low=evictor.low, half_life=evictor.half_life,
                                tenants=self.tenants)
        # the heat clock; longer on a node slow to read its cache (heat.HalfLife)
        self.half_life = self.policy.half_life
        self._half_life_shown = self.half_life.value
        metrics.heat_half_life.set(self._half_life_shown)
        self.block_size = disk.block_size
        self._clock = clock
        self._index = self.policy.chunks  # the policy's records: read here, changed there
        self._dirty_released = trio.Event()
        self._pending_puts: dict[bytes, ChunkRecord] = {}
        self._pending_deletes: set[bytes] = set()
        self._pending_objects: dict[bytes, dict] = {}
        self._full_logged = False
        self._shares = self.policy.shares
        # the tenant label's values are the configured tenants and default: a bounded set
        self._tenant_gauges = {name: tuple(metrics.tenant_cache_bytes.labels(name, kind)
                                           for kind in KINDS) for name in self._shares.tally}
        self._hard_logged: set[str] = set()
        self.pins = Pins(meta, clock=clock, on_change=self.policy.pin_changed)
        self.policy.pinned = self.pins
        # the labelled children, looked up once: every read counts one (a lookup per read
        # was a few % of a small read's CPU)
        self._memory_hits = metrics.cache_hits.labels("memory")
        self._disk_hits = metrics.cache_hits.labels("disk")
        self._disk_bytes = metrics.cache_bytes.labels("disk")
        self._memory_bytes = metrics.cache_bytes.labels("memory")
        self._publish()

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
        # oldest first, the order of the policy's `written`
        kept.sort(key=lambda kr: kr[1].last_access)
        for key, rec in kept:
            self.policy.add(key, rec, self._stored_tenant(key[:16]))
            if rec.heat > 0:  # read (or warmed) at its last access: the last read we know
                self.policy.last_read = max(self.policy.last_read, rec.last_access)
        self._publish()
        return len(self._index), len(dropped) + len(present)

    # ---- reads ---------------------------------------------------------------------

    def blocks_of(self, length: int) -> int:
        return max(1, -(-length // self.block_size))

    def in_memory(self, ckey: bytes, first: int, last: int
                  ) -> bytes | bytearray | memoryview | None:
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
        rec = self.policy.touch(ckey, self._clock())
        if rec is not None:
            self._pending_puts[ckey] = rec
        self._show_half_life()

    def _show_half_life(self) -> None:
        if self.half_life.value != self._half_life_shown:
            self._half_life_shown = self.half_life.value
            self.metrics.heat_half_life.set(self._half_life_shown)

    def has(self, ckey: bytes) -> bool:
        return ckey in self._index

    def opened_by(self, reader: str) -> None:
        """A file was opened by `reader` (tierfs/telemetry/callers.py): a new job's data is
        cached as plain LRU caches it (admission.py, `job_opened`)."""
        self.policy.opened_by(reader)

    def read_memory(self, ckey: bytes, first: int, last: int
                    ) -> bytes | bytearray | memoryview | None:
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
            data: bytes | memoryview | None = self.disk.read_cached(ckey, rec.length, rec.crcs,
                                                                     first, last)
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

    def keep(self, ckey: bytes, first: int, last: int, data: bytes | bytearray | memoryview, *,
             whole: bool) -> bool:
        """Put blocks first..last of a chunk (`whole`: all of it) in the memory tier, or
        views of them, without a copy; False if the tier had no room (memory.py: held
        entries and reserved bytes are not evictable)."""
        if whole:
            return self.memory.put((ckey, WHOLE), data)
        if first == last:
            return self.memory.put((ckey, first), data)
        bs, view, kept = self.block_size, memoryview(data), True
        for i, b in enumerate(range(first, last + 1)):
            kept &= self.memory.put((ckey, b), view[i * bs:(i + 1) * bs])
        return kept

    async def read(self, ckey: bytes, first: int, last: int, *, touch: bool
                   ) -> tuple[bytes | bytearray | memoryview, str] | None:
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
            self.keep(ckey, first, last, data, whole=whole)
        if touch:
            self.touch(ckey)
        return data, source

    # ---- fills and eviction --------------------------------------------------------

    async def fill(self, obj: ObjectVersion, ckey: bytes, data: bytes | bytearray | memoryview,
                   kind: Fill = Fill.READ, *, held: int = 0, tenant: str | None = None
                   ) -> None:
        """Write a chunk to the disk tier: fetched for a reader (who has the bytes already),
        or written through the mount (`Fill.WRITTEN`, with `held`: see `filling`)."""
        async with self.filling(obj, ckey, len(data), kind, held=held, tenant=tenant) as stored:
            if stored is None:
                return
            try:
                stored(await trio.to_thread.run_sync(self.disk.write, ckey, data))
            except OSError as exc:
                # a full or failing cache disk must not fail the read: serve from memory only
                log.warning("cannot write chunk to the cache dir: %s", exc)

    @asynccontextmanager
    async def filling(self, obj: ObjectVersion, ckey: bytes, length: int, kind: Fill = Fill.READ,
                      *, held: int = 0, tenant: str | None = None
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

        `tenant`: the reader's, when it is not the key's (a pod whose tenant is its
        namespace: docs/tenants.md); an object's chunks all count for the tenant of its
        first chunk here.
        """
        if held:
            # before any await: no other fill or write can take the room in between
            self.release_held(held, key=obj.key)
        tenant = self._shares.oid_tenant.get(obj.oid) or self._known(tenant) or \
            self.tenants.of(obj.key)
        if not self.policy.fill_started(ckey, length, kind, tenant, self._clock(),
                                        held=bool(held)):
            yield None
            return
        try:
            outcome = await self._carry_out(self.policy.room_for_fill(ckey, self._clock()))
            self._show_half_life()
            if outcome is not Outcome.STORED:
                self._not_stored(outcome, tenant)
                yield None
                return

            def stored(crcs: tuple[int, ...]) -> None:
                rec = self.policy.stored(ckey, crcs, self._clock())
                self._pending_puts[ckey] = rec
                self._pending_deletes.discard(ckey)
                info = {"bucket": obj.bucket, "key": obj.key, "etag": obj.etag,
                        "size": obj.size}
                if tenant != self.tenants.of(obj.key):  # a reader's tenant: kept for recover
                    info["tenant"] = tenant
                self._pending_objects.setdefault(ckey[:16], info)

            yield stored
        finally:
            self.policy.fill_ended(ckey)
            self._publish()

    async def _carry_out(self, plan: Generator[Eviction, None, Outcome]) -> Outcome:
        """Evict each chunk a decision of the policy names (policy.py), in turn."""
        try:
            while True:
                key, why = next(plan)
                if why is not None:  # a refused reader's chunk takes this chunk's room
                    self.metrics.cache_yielded.labels(why).inc()
                await self.drop(key, evicted=True)
        except StopIteration as done:
            return done.value

    def _not_stored(self, outcome: Outcome, tenant: str) -> None:
        """Count or log why a chunk or unsaved bytes got no room in the disk tier."""
        if outcome is Outcome.REFUSED:  # served from memory only, its read remembered
            self.metrics.cache_refused.inc()
        elif outcome is Outcome.FULL and not self._full_logged:
            log.warning("cache budget exhausted (%d bytes used): serving without the disk tier",
                        self.policy.used)
            self._full_logged = True
        elif outcome is Outcome.OVER_HARD and tenant not in self._hard_logged:
            self._hard_logged.add(tenant)
            log.warning("tenant %s is at its hard share (%s: %d bytes) and nothing of its "
                        "own can be evicted (pinned, unsaved or being written): serving it "
                        "without the disk tier", tenant, self._shares.hard[tenant],
                        self.policy.hard_limit(tenant))

    # ---- tenants -------------------------------------------------------------------

    def _stored_tenant(self, oid: bytes) -> str:
        """The tenant of an object id from the objects db (recovery: no ObjectVersion)."""
        tenant = self._shares.oid_tenant.get(oid)
        if tenant is None:
            info = self.meta.chunks.object_info(oid)
            key = info.get("key") if info else None
            tenant = (self._known(info.get("tenant")) if info else None) or (
                self.tenants.of(key) if isinstance(key, str) else DEFAULT)
        return tenant

    def _known(self, tenant: object) -> str | None:
        """`tenant` if it is one of this mount's tenants (a reader's tenant the options no
        longer declare counts for its key's tenant)."""
        return tenant if isinstance(tenant, str) and tenant in self.tenants.names() else None

    def _show_tenants(self) -> None:
        """Publish the counts of the tenants whose bytes changed (shares.py)."""
        shares = self._shares
        for tenant in shares.changed:
            tally = shares.tally[tenant]
            cached, pinned, dirty = self._tenant_gauges[tenant]
            cached.set(tally.cached)
            pinned.set(tally.pinned)
            dirty.set(tally.dirty)
        shares.changed.clear()

    def tenant_bytes(self) -> dict[str, TenantBytes]:
        """Cached, pinned and dirty bytes of every tenant (default included), exact."""
        return self._shares.counts()

    def tenant_of(self, obj: ObjectVersion) -> str:
        return self._shares.oid_tenant.get(obj.oid) or self.tenants.of(obj.key)

    def hard_share(self, tenant: str) -> int | None:
        """Bytes of the tenant's hard share of the current budget (None: it has none)."""
        return self._shares.hard_limit(tenant, self.budget())

    def pinned_bytes(self, tenant: str, exclude: Iterable[bytes] = ()) -> int:
        """Cached bytes of the tenant's pinned objects, except those in `exclude`."""
        return self._shares.pinned_bytes(tenant, exclude)

    # ---- lifecycle: max_idle -------------------------------------------------------

    def idle_sweep_interval(self) -> float | None:
        """How often `sweep_idle` runs (shares.py); None when no tenant has a max_idle."""
        return self._shares.idle_sweep_interval()

    async def sweep_idle(self) -> int:
        """Evict the chunks not read for their tenant's max_idle (pins and chunks being
        written excepted); returns the bytes freed."""
        freed = chunks = 0
        for key, _ in self.policy.idle(self._clock()):
            rec = self._index.get(key)
            await self.drop(key, evicted=True)
            if rec is not None:
                freed += rec.length
                chunks += 1
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
        """Drop a chunk from both tiers and delete its file (`evicted`: the policy's call)."""
        rec = self.policy.dropped(ckey, evicted=evicted)
        if rec is None:
            return
        self.memory.drop_chunk(ckey, self.blocks_of(rec.length))
        self._pending_puts.pop(ckey, None)
        self._pending_deletes.add(ckey)
        if evicted:
            self.metrics.cache_evictions.inc()
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
        return self._shares.bytes_of(oids)

    # ---- dirty data ----------------------------------------------------------------

    async def reserve_dirty(self, nbytes: int, wait_s: float, *, key: str | None = None) -> bool:
        """Count nbytes of new dirty data against the budget, evicting clean chunks first.

        If they do not fit, wait up to wait_s for dirty data to be released (uploads to
        finish); False if they still do not fit: the writer answers ENOSPC. With the
        file's `key` the bytes are its tenant's, and its hard share holds them too (its
        own clean chunks are evicted first); without, they are counted to the default
        tenant and no share holds them. The room comes from earlier writes first
        (policy.py, `_recycle`).
        """
        tenant = self._shares.of(key)
        with trio.move_on_after(wait_s):
            while True:
                outcome = await self._carry_out(
                    self.policy.room_for_dirty(tenant, nbytes, shared=key is not None))
                if outcome is Outcome.STORED:
                    self._publish()
                    return True
                if outcome is Outcome.OVER_HARD:
                    self._not_stored(outcome, tenant)
                await self._dirty_released.wait()
        return False

    def force_dirty(self, nbytes: int, *, key: str | None = None) -> None:
        """Count recovered dirty data, whatever the budget: it must be uploaded, not refused."""
        self.policy.add_dirty(self._shares.of(key), nbytes)
        self._publish()

    def hold(self, nbytes: int, *, key: str | None = None) -> None:
        """nbytes of unsaved data of the file `key` are in the store now, but their staging
        copy stays on disk until its chunks move into the disk tier (`filling(held=)`):
        still counted against the budget (as reserved), no longer as dirty."""
        self.policy.hold(self._shares.of(key), nbytes)
        self._room_released()

    def release_held(self, nbytes: int, *, key: str | None = None) -> None:
        """Held bytes (`hold`) whose staging copy is gone."""
        self.policy.release_held(self._shares.of(key), nbytes)
        self._room_released()

    def _room_released(self) -> None:
        self._dirty_released.set()  # writers waiting for room look again
        self._dirty_released = trio.Event()
        self._publish()

    def release_dirty(self, nbytes: int, *, key: str | None = None) -> None:
        """Dirty bytes uploaded or dropped, of the file `key` (None: the default tenant's).
        A file renamed into another tenant meanwhile releases what its first tenant is
        left with, then the rest from the others: the tenants' sum stays the total."""
        self.policy.release_dirty(self._shares.of(key), nbytes)
        self._room_released()

    @property
    def dirty_bytes(self) -> int:
        return self.policy.dirty

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
            self.policy.add(nkey, copy, self.tenant_of(new))
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
        self._disk_bytes.set(self.policy.used)
        self.metrics.dirty_bytes.set(self.policy.dirty)
        self._memory_bytes.set(self.memory.bytes)
        self._show_tenants()

    @property
    def used_bytes(self) -> int:
        return self.policy.used

    @property
    def chunk_count(self) -> int:
        return len(self._index)

    def budget(self) -> int:
        b = self.evictor.budget(self.policy.used)
        self.metrics.cache_budget_bytes.set(b)
        return b
