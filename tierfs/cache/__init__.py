"""ChunkCache: the memory tier in front of the disk tier, with heat and eviction.

Contract (see docs/architecture.md, "Concurrency"):
- everything here runs on the trio thread except DiskTier calls, which go to worker
  threads (but `DiskTier.read_cached`, which never blocks: page-cache hits are read on the
  trio thread); the in-memory index (`_index`) is only touched on the trio thread;
- the index is persisted to LMDB in batches by `flush_index` (at most a second behind):
  a crash loses recent index entries, whose files recovery then deletes as orphans;
- a chunk whose blocks fail verification is dropped and reported as a miss, so the
  caller fetches it again: the cache is a hint, never a source of wrong bytes.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Container, Iterable

import trio

from ..errors import CacheCorrupt
from ..meta import ChunkRecord, MetaStore
from ..metrics import Metrics
from .disk import DiskTier
from .evictor import Evictor
from .heat import touched
from .keys import ObjectVersion, chunk_name
from .memory import WHOLE, MemoryTier
from .pins import Pins

log = logging.getLogger(__name__)

__all__ = ["ChunkCache", "ObjectVersion"]


class ChunkCache:
    def __init__(self, meta: MetaStore, disk: DiskTier, memory: MemoryTier, evictor: Evictor,
                 metrics: Metrics, *, clock: Callable[[], float] = time.time) -> None:
        self.meta = meta
        self.disk = disk
        self.memory = memory
        memory.released = disk.reuse  # a big read's buffer serves the next one (disk.py)
        self.evictor = evictor
        self.metrics = metrics
        self.block_size = disk.block_size
        self._clock = clock
        self._index: dict[bytes, ChunkRecord] = {}
        self._used = 0
        self._writing: set[bytes] = set()
        self._reserved = 0  # bytes of chunks being written, already counted against the budget
        self._dirty = 0  # bytes of unsaved writes (write-back staging): budgeted, never evicted
        self._dirty_released = trio.Event()
        self._pending_puts: dict[bytes, ChunkRecord] = {}
        self._pending_deletes: set[bytes] = set()
        self._pending_objects: dict[bytes, dict] = {}
        self._full_logged = False
        self.pins = Pins(meta, clock=clock)
        # the labelled children, looked up once: every read counts one (a lookup per read
        # was a few % of a small read's CPU)
        self._memory_hits = metrics.cache_hits.labels("memory")
        self._disk_hits = metrics.cache_hits.labels("disk")
        self._disk_bytes = metrics.cache_bytes.labels("disk")
        self._memory_bytes = metrics.cache_bytes.labels("memory")

    # ---- start-up ------------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Reconcile index and disk (blocking; run before serving). Returns (kept, dropped)."""
        present = self.disk.scan()
        dropped = []
        for key, rec in self.meta.chunks():
            name = chunk_name(key)
            size = present.pop(name, None)
            # a record salvaged from a damaged index must at least have a CRC per block
            if size == rec.length and len(rec.crcs) == self.blocks_of(rec.length):
                self._index[key] = rec
                self._used += rec.length
                continue
            dropped.append(key)
            if size is not None:
                self.disk.delete_name(name)
        for name in present:  # files the index never recorded (crash before a flush)
            self.disk.delete_name(name)
        self.meta.apply_chunks({}, dropped)
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
        rec = self._index.get(ckey)
        if rec is not None:
            now = self._clock()
            rec.heat = touched(rec.heat, rec.last_access, now, self.evictor.half_life)
            rec.last_access = now
            self._pending_puts[ckey] = rec

    def has(self, ckey: bytes) -> bool:
        return ckey in self._index

    async def read(self, ckey: bytes, first: int, last: int, *,
                   touch: bool) -> tuple[bytes | memoryview, str] | None:
        """(bytes of blocks first..last of a chunk, "memory" | "disk"), or None on a miss."""
        data = self.in_memory(ckey, first, last)
        if data is not None:
            self._memory_hits.inc()
            if touch:
                self.touch(ckey)
            return data, "memory"
        rec = self._index.get(ckey)
        if rec is None:
            self.metrics.cache_misses.inc()
            return None
        try:
            # from the page cache on this thread when it can (no hand-off), else a worker's
            data = self.disk.read_cached(ckey, rec.length, rec.crcs, first, last)
            if data is None:
                data = await trio.to_thread.run_sync(self.disk.read_blocks, ckey, rec.length,
                                                     rec.crcs, first, last)
        except CacheCorrupt as exc:
            if self._index.get(ckey) is rec:  # a concurrent reader may have dropped it already
                log.warning("dropping cached chunk: %s", exc)
                self.metrics.cache_corrupt.inc()
                await self.drop(ckey)
            self.metrics.cache_misses.inc()
            return None
        self._disk_hits.inc()
        bs = self.block_size
        # the memory tier keeps what was read, or views of it, without a copy
        if first == 0 and last == self.blocks_of(rec.length) - 1:
            self.memory.put((ckey, WHOLE), data)
        elif first == last:
            self.memory.put((ckey, first), data)
        else:
            view = memoryview(data)
            for i, b in enumerate(range(first, last + 1)):
                self.memory.put((ckey, b), view[i * bs:(i + 1) * bs])
        if touch:
            self.touch(ckey)
        self._publish()
        return data, "disk"

    # ---- fills and eviction --------------------------------------------------------

    def remember(self, ckey: bytes, data: bytes) -> None:
        """Put a freshly fetched chunk in the memory tier (synchronous, before any await)."""
        self.memory.put((ckey, WHOLE), data)

    async def fill(self, obj: ObjectVersion, ckey: bytes, data: bytes) -> None:
        """Write a freshly fetched chunk to the disk tier (the reader already has the bytes)."""
        async with self.filling(obj, ckey, len(data)) as stored:
            if stored is None:
                return
            try:
                stored(await trio.to_thread.run_sync(self.disk.write, ckey, data))
            except OSError as exc:
                # a full or failing cache disk must not fail the read: serve from memory only
                log.warning("cannot write chunk to the cache dir: %s", exc)

    @asynccontextmanager
    async def filling(self, obj: ObjectVersion, ckey: bytes,
                      length: int) -> AsyncIterator[Callable[[tuple[int, ...]], None] | None]:
        """Room and bookkeeping for writing one chunk to the disk tier.

        Yields None when the chunk is there already, being written, or does not fit;
        else a function to call with the chunk's CRCs once its file is written, which
        indexes it. Room is made and reserved before the caller's write (concurrent fills
        see each other); the reservation ends with the block.
        """
        if ckey in self._index or ckey in self._writing:
            yield None
            return
        self._writing.add(ckey)
        reserved = 0
        try:
            if not await self._make_room(length):
                yield None
                return
            reserved = length
            self._reserved += reserved

            def stored(crcs: tuple[int, ...]) -> None:
                rec = ChunkRecord(length, 1.0, self._clock(), crcs)
                self._index[ckey] = rec
                self._used += rec.length
                self._pending_puts[ckey] = rec
                self._pending_deletes.discard(ckey)
                self._pending_objects.setdefault(ckey[:16], {
                    "bucket": obj.bucket, "key": obj.key, "etag": obj.etag, "size": obj.size})

            yield stored
        finally:
            self._reserved -= reserved
            self._writing.discard(ckey)
            self._publish()

    async def _make_room(self, incoming: int) -> bool:
        victims, fits = self.evictor.victims(self._index, self._used + self._reserved + self._dirty,
                                             incoming, self._writing, self.pins)
        for key in victims:
            await self.drop(key, evicted=True)
        if not fits and not self._full_logged:
            log.warning("cache budget exhausted (%d bytes used): serving without the disk tier",
                        self._used)
            self._full_logged = True
        return fits

    async def drop(self, ckey: bytes, *, evicted: bool = False) -> None:
        rec = self._index.pop(ckey, None)
        if rec is None:
            return
        self._used -= rec.length
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

    def bytes_of(self, oids: Container[bytes]) -> int:
        """Bytes on disk of the chunks of these object versions (a scan of the index)."""
        return sum(r.length for k, r in self._index.items() if k[:16] in oids)

    # ---- dirty data ----------------------------------------------------------------

    async def reserve_dirty(self, nbytes: int, wait_s: float) -> bool:
        """Count nbytes of new dirty data against the budget, evicting clean chunks first.

        If they do not fit, wait up to wait_s for dirty data to be released (uploads to
        finish); False if they still do not fit: the writer answers ENOSPC.
        """
        with trio.move_on_after(wait_s):
            while True:
                victims, fits = self.evictor.victims(
                    self._index, self._used + self._reserved + self._dirty, nbytes, self._writing,
                    self.pins)
                for key in victims:
                    await self.drop(key, evicted=True)
                if fits:
                    self._dirty += nbytes
                    self._publish()
                    return True
                await self._dirty_released.wait()
        return False

    def force_dirty(self, nbytes: int) -> None:
        """Count recovered dirty data, whatever the budget: it must be uploaded, not refused."""
        self._dirty += nbytes
        self._publish()

    def release_dirty(self, nbytes: int) -> None:
        self._dirty -= nbytes
        self._dirty_released.set()
        self._dirty_released = trio.Event()
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
            self._index[nkey] = copy
            self._used += copy.length
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
        await trio.to_thread.run_sync(self.meta.apply_chunks, puts, dels, objs)

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
