"""TierWalk: every read of a chunk walks the tiers nearest first, the same way.

Reading a file (tierfs/files/fileio.py), read-ahead (prefetch.py), serving a peer
(tierfs/mount/peerserve.py) and the base of a partial write (tierfs/writeback) all call
`read`: the cache tiers first (memory, then disk: tierfs/cache/tiers.py); the first that
has the chunk answers and the tiers above it keep the bytes. On a miss, one flight per
chunk (singleflight.py) asks the sources in order (the chunk's owner among the peers,
then the object store: sources.py); the memory tier keeps the bytes at once and the disk
tier writes them in the background while the reader already has them. `warm` fills the
disk tier straight from the store for `tierfs warm`, on the same flights.

Backpressure: while `max_unstored` fetched chunks wait for their disk write, a new fetch
waits for one to be written (a pile-up in memory is worse than a short wait); never on a
reader's bytes, which it gets as soon as they are verified. Ranged GETs carry If-Match
on the ETag the chunk key was made from, so a chunk is always bytes of its version.
"""

from __future__ import annotations

from typing import NamedTuple

import trio

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache, Fill, ObjectVersion
from ..cache.tier import Bytes, Tier, Want, chunk_length
from ..cache.tiers import DiskCache, MemoryCache
from ..errors import BackendError, CacheUnwritable, PreconditionFailed
from ..peers import PeerTier
from ..tasks import Tasks
from .singleflight import FailureMemo, Flight, Flights
from .sources import PeerSource, StoreSource
from .storecheck import StoreChecks


class Got(NamedTuple):
    data: Bytes  # the wanted blocks
    source: str  # the tier that had them: "memory", "disk", "peer", "backend"
    fetched: bool  # not in a cache tier at the first look: the reader waited for a fetch


class TierWalk:
    def __init__(self, backend: AsyncBackend, cache: ChunkCache, chunk_size: int,
                 tasks: Tasks, *, disk_writers: int = 4) -> None:
        self.cache = cache
        self.chunk_size = chunk_size
        self._tasks = tasks
        self.memory = MemoryCache(cache, chunk_size)
        self.disk = DiskCache(cache, chunk_size)
        self.cached: list[Tier] = [self.memory, self.disk]  # nearest first
        self.store = StoreSource(backend, cache, chunk_size)
        self.sources: list[Tier] = [self.store]  # asked in order on a miss
        # asked by `warm` before the store (the near store: a job's prolog on a fleet with
        # one fills the node's cache from it, not over the WAN)
        self.warm_sources: list[Tier] = []
        self.store_checks = StoreChecks(backend, chunk_size)
        self.flights = Flights()
        self.failures = FailureMemo()
        self.max_unstored = disk_writers
        self._unstored = 0  # fetched chunks not yet written to the disk tier
        self._stored_one = trio.Event()
        self._disk_writes = trio.Semaphore(disk_writers)  # chunk files written at once

    def add_peers(self, peers: PeerTier) -> None:
        """--peers: the chunk's owner among the peers is asked before the store."""
        self.sources.insert(0, PeerSource(peers, self.store_checks, self.chunk_size))

    def chunk_length(self, obj: ObjectVersion, index: int) -> int:
        return chunk_length(self.chunk_size, obj.size, index)

    def in_flight(self, ckey: bytes) -> bool:
        return ckey in self.flights

    async def read(self, want: Want, own: Tier | None = None) -> Got:
        """The wanted blocks of a chunk, from the nearest tier that has them. `own`: a
        reader's own tier in front of the others (cache/tiers.py, OwnChunk), which gets
        the whole chunk when it is fetched."""
        ckey, access, fetched = want.ckey, want.access, False
        cached = self.cached if own is None else [own, *self.cached]
        while True:
            for level, tier in enumerate(cached):
                data = await tier.get(want)
                if data is not None:
                    for upper in cached[:level]:
                        await upper.put(want, data)
                    if access:
                        self.cache.touch(ckey)
                    return Got(data, tier.name, fetched)
            fetched = True
            flight = self.flights.get(ckey)
            if flight is None:
                self.failures.check(ckey, f"get {want.obj.key!r} at "
                                          f"{want.index * self.chunk_size}")
                if self._unstored < self.max_unstored:
                    data, source = await self._fly(want)
                    return await self._fetched(want, own, data, source)
                # the disk tier is behind: wait for it, then look again (another caller
                # may have fetched this chunk meanwhile)
                await self._stored_one.wait()
                continue
            if access:  # the heat of this access goes with the flight's fill
                flight.joined += 1
                access = False
            if not want.background:
                flight.reader_waiting = True
            await flight.done.wait()
            if flight.data is not None:
                return await self._fetched(want, own, flight.data, flight.source)
            # failed (each waiter tries for itself), or a warm stored it without bytes

    async def _fetched(self, want: Want, own: Tier | None, data: Bytes, source: str) -> Got:
        """A whole fetched chunk: the reader's own tier keeps it; the wanted blocks."""
        if own is not None:
            await own.put(Want(want.obj, want.index), data)
        return Got(self._blocks(want, data), source, True)

    def _blocks(self, want: Want, data: Bytes) -> Bytes:
        if want.whole:
            return data
        bs = self.cache.block_size
        end = None if want.last < 0 else (want.last + 1) * bs
        return memoryview(data)[want.first * bs:end]

    async def _fly(self, want: Want) -> tuple[Bytes, str]:
        """Fetch the whole chunk from the first source that has it, as the one flight."""
        whole = Want(want.obj, want.index, background=want.background,
                     ask_peers=want.ask_peers, tenant=want.tenant)
        ckey = whole.ckey
        flight = self.flights.start(ckey)
        try:
            data, source = await self._from_sources(whole)
            if len(data) != self.chunk_length(whole.obj, whole.index):
                # a shorter or longer body than the listed size: the object changed
                raise PreconditionFailed(f"get {whole.obj.key!r}: size differs from the listing")
            flight.data, flight.source = data, source
        except BaseException as exc:
            self.flights.end(ckey, flight)
            if ((not whole.background or flight.reader_waiting)
                    and isinstance(exc, BackendError)
                    and not isinstance(exc, PreconditionFailed)):
                self.failures.remember(ckey, exc)
            raise
        finally:
            flight.done.set()
        self.failures.clear(ckey)
        await self._keep_fetched(whole, data, flight)
        return data, source

    async def _from_sources(self, whole: Want) -> tuple[Bytes, str]:
        for level, tier in enumerate(self.sources):
            data = await tier.get(whole)
            if data is not None:
                for upper in self.sources[:level]:
                    await upper.put(whole, data)
                return data, tier.name
        raise AssertionError("the store is the last source and always answers")

    async def _keep_fetched(self, whole: Want, data: Bytes, flight: Flight) -> None:
        """The cache tiers keep a fetched chunk: the memory tier now (if it has room), the
        disk tier in the background. The flight, holding the bytes, stays until the disk
        tier has them: with a small or no memory tier, a reader arriving meanwhile must not
        fetch the chunk again (a flight left unstored was held for good: issue 26, M2)."""
        await self.memory.put(whole, data)
        self._unstored += 1
        self._tasks.spawn("fill", self._store, whole, data, flight)

    async def _store(self, whole: Want, data: Bytes, flight: Flight) -> None:
        try:
            async with self._disk_writes:
                await self.disk.put(whole, data)
        finally:
            self._unstored -= 1
            self._stored_one.set()
            self._stored_one = trio.Event()
            self._landed(whole.ckey, flight)

    def _landed(self, ckey: bytes, flight: Flight) -> None:
        """The flight is over: joiners' accesses go to the stored chunk, waiters wake."""
        for _ in range(flight.joined):
            self.cache.touch(ckey)
        self.flights.end(ckey, flight)

    async def warm(self, obj: ObjectVersion, index: int) -> tuple[int, bool]:
        """Bring a chunk to the disk tier for `tierfs warm`: (bytes fetched, cached now).

        From the first of `warm_sources` that has it (the near store), else on the
        backend's warm lane, with the GET's body read straight into the disk tier's write
        buffer in the same worker thread; no memory tier either way (a warm of a large set
        must not push out what readers use). The fill is awaited here, so the warm's own
        width bounds its bytes in flight. A chunk another request is fetching is waited
        for, not fetched twice; a reader that asks for a chunk being warmed waits for it
        and reads it from disk.
        """
        ckey = obj.chunk_key(index)
        while not self.cache.has(ckey):
            flight = self.flights.get(ckey)
            if flight is None:
                break
            await flight.stored.wait()
            if flight.data is not None:  # fetched by another request: stored, or no room
                return 0, self.cache.has(ckey)
        else:
            return 0, True
        length = self.chunk_length(obj, index)
        start = index * self.chunk_size
        sync = self.store.backend.sync

        def fill(view: memoryview) -> None:  # in the worker thread
            if sync.get_into(obj.key, start, view, obj.etag, size=obj.size) != length:
                raise PreconditionFailed(f"get {obj.key!r}: size differs from the listing")

        flight = self.flights.start(ckey)
        try:
            async with self.cache.filling(obj, ckey, length, Fill.WARM) as stored:
                if stored is None:
                    return 0, self.cache.has(ckey)
                for tier in self.warm_sources:
                    data = await tier.get(Want(obj, index, background=True))
                    if data is None:
                        continue
                    try:
                        crcs = await trio.to_thread.run_sync(self.cache.disk.write, ckey, data)
                    except OSError as exc:
                        raise CacheUnwritable(f"cannot write to the cache dir: {exc}") from None
                    stored(crcs)
                    return length, True
                try:
                    crcs = await self.store.backend.warm_get(
                        lambda: self.cache.disk.write_via(ckey, length, fill), length,
                        key=obj.key, offset=start)
                except OSError as exc:
                    raise CacheUnwritable(f"cannot write to the cache dir: {exc}") from None
                stored(crcs)
        finally:
            self._landed(ckey, flight)
        return length, True


