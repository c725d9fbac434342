"""Fetcher: gets chunks from the backend exactly once, however many readers want them.

Singleflight: the first caller for a chunk fetches it; later callers wait for that flight
and take its bytes. If the first caller fails or is cancelled, each waiter tries for
itself, so a cancelled FUSE request never strands the others. Ranged GETs carry If-Match
on the ETag the chunk key was made from, so a chunk is always bytes of that version.

A reader's GET that failed is remembered for FAILED_MEMO_S: the kernel asks again for a
read that failed (about three times per read() call, and each page of a read-ahead
window), and those immediate re-asks get the same errno at once instead of each waiting
out the backend's timeouts and retries again. A success clears it; a read after the memo
has expired tries the store again. Fast failures (StoreDown: the store is known down) and
changed objects (PreconditionFailed, which the reader handles) are not remembered.

With --peers, a flight asks the chunk's owner among the peers first (tierfs/peers:
verified bytes or None) and the backend only when the owner is this node or cannot give
it. A chunk fetched for a peer (`for_peer`) always comes from the backend, so nodes whose
peer lists disagree for a moment never send a request around in a circle. A peer's chunk is
also checked against the store's checksum where the object has one (tierfs/read/storecheck.py);
a refuted one is fetched from the store, and its peer is blamed if the store's bytes differ.
"""

from __future__ import annotations

import trio

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache, Fill, ObjectVersion
from ..cache.disk import REUSE_MIN
from ..errors import BackendError, CacheUnwritable, PreconditionFailed, RecentFailure
from ..peers import PeerChunk, PeerTier
from .storecheck import StoreChecks
from ..tasks import Tasks

# long enough to cover the kernel's immediate re-asks of a failed read, short enough that
# an application that retries by itself a little later meets the store again
FAILED_MEMO_S = 3.0


class _Flight:
    def __init__(self) -> None:
        self.done = trio.Event()  # the GET ended (data is set if it succeeded)
        self.stored = trio.Event()  # ...and the disk tier has the chunk (or will not)
        self.data: bytes | None = None
        self.source = "backend"  # or "peer": where the bytes came from
        self.joined = 0  # readers' first accesses that joined this flight: heat for the fill
        # a reader waits on this (read-ahead) flight: if it fails, the failure is the
        # reader's too and is remembered, so the reader does not wait out a second GET
        self.reader_waiting = False


class Fetcher:
    def __init__(self, backend: AsyncBackend, cache: ChunkCache, chunk_size: int,
                 tasks: Tasks, *, disk_writers: int = 4) -> None:
        self.backend = backend
        self.cache = cache
        self.chunk_size = chunk_size
        self._tasks = tasks
        self._flights: dict[bytes, _Flight] = {}
        # chunk -> (when a reader's GET of it failed, what failed): see FAILED_MEMO_S
        self._failed: dict[bytes, tuple[float, BackendError]] = {}
        self.failed_memo_s = FAILED_MEMO_S
        # fetched chunks not yet on disk (the disk tier writes them in the background):
        # while there are `disk_writers` of them, a new GET waits for one to be written.
        # Backpressure on fetching, not a pile-up in memory; never on a reader's bytes,
        # which it gets as soon as its GET is verified
        self.max_unstored = disk_writers
        self._unstored = 0
        self._stored_one = trio.Event()
        self._disk_writes = trio.Semaphore(disk_writers)  # chunk files written at once
        self.peers: PeerTier | None = None  # set by the core with --peers
        self.store_checks = StoreChecks(backend, chunk_size)

    def chunk_length(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.chunk_size, obj.size - index * self.chunk_size))

    def in_flight(self, ckey: bytes) -> bool:
        return ckey in self._flights

    async def _get(self, obj: ObjectVersion, index: int, ckey: bytes, *,
                   background: bool, ask_peers: bool) -> tuple[_Flight, bytes]:
        """Start a flight and get the chunk (from its owner among the peers, else the
        backend); on failure the flight is gone and settled."""
        flight = self._flights[ckey] = _Flight()
        try:
            got = await self._from_peer(obj, index, ckey) if ask_peers else None
            refuted = None
            if got is not None and not await self.store_checks.agree(obj, index, got.data):
                refuted, got = got, None
            if got is not None:
                data = got.data
                flight.source = "peer"
            else:
                data = await self._from_store(obj, index, background)
                if refuted is not None and self.peers is not None and refuted.data != data:
                    self.peers.refuted(refuted.peer, f"chunk {index} of {obj.key!r} differs "
                                                     "from the store's checksum and bytes")
            if len(data) != self.chunk_length(obj, index):
                # a shorter or longer body than the listed size: the object changed
                raise PreconditionFailed(f"get {obj.key!r}: size differs from the listing")
            flight.data = data
        except BaseException as exc:
            del self._flights[ckey]
            flight.stored.set()
            if ((not background or flight.reader_waiting) and isinstance(exc, BackendError)
                    and not isinstance(exc, PreconditionFailed)):
                self._remember_failure(ckey, exc)
            raise
        finally:
            flight.done.set()
        self._failed.pop(ckey, None)
        return flight, data

    async def _from_store(self, obj: ObjectVersion, index: int,
                          background: bool) -> bytes | memoryview:
        """A chunk from the store: a big one into a reused buffer of the disk tier (a fresh
        8 MiB buffer per GET page-faults in, and its memory-tier entry could not be reused
        for the next read: bench/README.md), its bytes reserved in the memory tier while in
        flight (the tier's size bounds GETs in flight too); a small one into new bytes (a
        1 MiB mapping per small file would waste address space and map count)."""
        start, length = index * self.chunk_size, self.chunk_length(obj, index)
        if length < REUSE_MIN:
            return await self.backend.get(obj.key, start, length, obj.etag,
                                          background=background, size=obj.size)
        memory = self.cache.memory
        # may free the very buffer taken next; a read-ahead's room is reserved already,
        # from its start until its reader reads past it (prefetch.py)
        reserved = not background and memory.reserve(length)
        view = self.cache.disk.read_buffer(length)
        owner = view.obj
        try:
            n = await self.backend.get_into(obj.key, start, view, obj.etag,
                                            background=background, size=obj.size)
            data = view[:n].toreadonly()
        except BaseException:
            view.release()
            self.cache.disk.reuse(owner)  # nothing of it was handed out
            raise
        finally:
            if reserved:
                memory.unreserve(length)
        view.release()  # the read-only view keeps the buffer from reuse while it lives
        return data

    async def _from_peer(self, obj: ObjectVersion, index: int, ckey: bytes) -> PeerChunk | None:
        if self.peers is None:
            return None
        return await self.peers.fetch(ckey, bucket=obj.bucket, key=obj.key, etag=obj.etag,
                                      size=obj.size, index=index, chunk_size=self.chunk_size)

    def _remember_failure(self, ckey: bytes, exc: BackendError) -> None:
        now = trio.current_time()
        if len(self._failed) >= 1024:  # an outage over many chunks: keep only the live ones
            self._failed = {k: v for k, v in self._failed.items()
                            if now - v[0] < self.failed_memo_s}
        self._failed[ckey] = (now, exc)

    def _recent_failure(self, obj: ObjectVersion, index: int, ckey: bytes) -> None:
        """Raise RecentFailure if a reader's GET of this chunk failed within the memo."""
        entry = self._failed.get(ckey)
        if entry is None:
            return
        age = trio.current_time() - entry[0]
        if age >= self.failed_memo_s:
            del self._failed[ckey]
            return
        err = RecentFailure(f"get {obj.key!r} at {index * self.chunk_size} failed {age:.1f}s "
                            f"ago ({entry[1]}); not asked again before {self.failed_memo_s:g}s")
        err.errno = entry[1].errno  # the re-ask gets what the first ask got
        raise err

    async def chunk(self, obj: ObjectVersion, index: int, *, background: bool = False,
                    access: bool = False) -> bytes:
        """A chunk's bytes, fetched once however many callers want them."""
        return (await self.fetch(obj, index, background=background, access=access))[0]

    async def for_peer(self, obj: ObjectVersion, index: int) -> bytes | memoryview:
        """A whole chunk a peer asked this node (its owner) for: from the cache, else from
        the backend, once however many ask, and kept. A peer's read is heat, as a reader's."""
        ckey = obj.chunk_key(index)
        hit = await self.cache.read(ckey, 0, self.cache.blocks_of(self.chunk_length(obj, index))
                                    - 1, touch=True)
        if hit is not None:
            return hit[0]
        return (await self.fetch(obj, index, access=True, ask_peers=False))[0]

    async def fetch(self, obj: ObjectVersion, index: int, *, background: bool = False,
                    access: bool = False, ask_peers: bool = True) -> tuple[bytes, str]:
        """(A chunk's bytes, where they came from: "backend", "peer", or a cache tier if it
        was stored meanwhile), fetched once however many callers want them. `access`: this
        is a reader's first access of the chunk (its heat); the caller that fetches gets
        that from the fill, a caller that joins another's flight adds one when the fill
        lands."""
        ckey = obj.chunk_key(index)
        while True:
            flight = self._flights.get(ckey)
            if flight is None:
                self._recent_failure(obj, index, ckey)  # read-ahead does not hammer it either
                if self._unstored < self.max_unstored:
                    break
                # the disk tier is behind: wait for it before fetching more (then look
                # again: another caller may have fetched this chunk meanwhile)
                await self._stored_one.wait()
                if self.cache.has(ckey) or self.cache.in_memory(ckey, 0, 0) is not None:
                    last = self.cache.blocks_of(self.chunk_length(obj, index)) - 1
                    hit = await self.cache.read(ckey, 0, last, touch=access)
                    if hit is not None:
                        return hit[0], hit[1]
                continue
            if access:
                flight.joined += 1
                access = False
            if not background:
                flight.reader_waiting = True
            await flight.done.wait()
            if flight.data is not None:
                return flight.data, flight.source
            if self.cache.has(ckey):  # stored by a warm, which keeps no bytes in memory
                last = self.cache.blocks_of(self.chunk_length(obj, index)) - 1
                hit = await self.cache.read(ckey, 0, last, touch=False)
                if hit is not None:
                    return hit[0], hit[1]
        flight, data = await self._get(obj, index, ckey, background=background,
                                       ask_peers=ask_peers)
        # the flight (holding the bytes) stays until the disk tier has the chunk: with a
        # small or no memory tier, a reader arriving meanwhile must not fetch it again.
        # The caller returns now; the disk write is the fill task's, which owns the bytes
        # and ends the flight whatever happens next (a chunk left in `_flights` unstored
        # was held for good: issue 26, M2)
        self._unstored += 1
        self._tasks.spawn("fill", self._store, obj, ckey, data, flight)
        # kept if the tier has room; a read-ahead's bytes no reader waits for yet take no
        # room read-ahead holds for readers (cache/memory.py)
        self.cache.remember(ckey, data, ahead=background and not flight.reader_waiting)
        return data, flight.source

    async def _store(self, obj: ObjectVersion, ckey: bytes, data: bytes, flight: _Flight) -> None:
        try:
            async with self._disk_writes:
                await self.cache.fill(obj, ckey, data)
        finally:
            self._unstored -= 1
            self._stored_one.set()
            self._stored_one = trio.Event()
            self._settle(ckey, flight)

    def _settle(self, ckey: bytes, flight: _Flight) -> None:
        """The flight is over: joiners' accesses go to the stored chunk, waiters wake."""
        for _ in range(flight.joined):
            self.cache.touch(ckey)
        if self._flights.get(ckey) is flight:
            del self._flights[ckey]
        flight.stored.set()

    async def warm(self, obj: ObjectVersion, index: int) -> tuple[int, bool]:
        """Bring a chunk to the disk tier for `tierfs warm`: (bytes fetched, cached now).

        On the backend's warm lane, with the GET's body read straight into the disk tier's
        write buffer in the same worker thread, and no memory tier (a warm of a large set
        must not push out what readers use). The fill is awaited here, so the warm's own
        width bounds its bytes in flight. A chunk another request is fetching is waited
        for, not fetched twice; a reader that asks for a chunk being warmed waits for it
        and reads it from disk.
        """
        ckey = obj.chunk_key(index)
        while not self.cache.has(ckey):
            flight = self._flights.get(ckey)
            if flight is None:
                break
            await flight.stored.wait()
            if flight.data is not None:  # fetched by another request: stored, or no room
                return 0, self.cache.has(ckey)
        else:
            return 0, True
        length = self.chunk_length(obj, index)
        start = index * self.chunk_size
        sync = self.backend.sync

        def fill(view: memoryview) -> None:  # in the worker thread
            if sync.get_into(obj.key, start, view, obj.etag, size=obj.size) != length:
                raise PreconditionFailed(f"get {obj.key!r}: size differs from the listing")

        flight = self._flights[ckey] = _Flight()
        try:
            async with self.cache.filling(obj, ckey, length, Fill.WARM) as stored:
                if stored is None:
                    return 0, self.cache.has(ckey)
                try:
                    crcs = await self.backend.warm_get(
                        lambda: self.cache.disk.write_via(ckey, length, fill), length,
                        key=obj.key, offset=start)
                except OSError as exc:
                    raise CacheUnwritable(f"cannot write to the cache dir: {exc}") from None
                stored(crcs)
        finally:
            flight.done.set()
            self._settle(ckey, flight)
        return length, True

    async def read_through(self, obj: ObjectVersion, index: int) -> bytes | memoryview:
        """A whole chunk, from the cache if it has it, else from the backend."""
        length = self.chunk_length(obj, index)
        hit = await self.cache.read(obj.chunk_key(index), 0, self.cache.blocks_of(length) - 1,
                                    touch=False)
        return hit[0] if hit is not None else await self.chunk(obj, index)
