"""Fetcher: gets chunks from the backend exactly once, however many readers want them.

Singleflight: the first caller for a chunk fetches it; later callers wait for that flight
and take its bytes. If the first caller fails or is cancelled, each waiter tries for
itself, so a cancelled FUSE request never strands the others. Ranged GETs carry If-Match
on the ETag the chunk key was made from, so a chunk is always bytes of that version.
The peer tier (chunks from other nodes) will slot in here, before the backend.
"""

from __future__ import annotations

import trio

from .backend.runner import AsyncBackend
from .cache import ChunkCache, ObjectVersion
from .errors import PreconditionFailed


class _Flight:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None


class Fetcher:
    def __init__(self, backend: AsyncBackend, cache: ChunkCache, chunk_size: int,
                 nursery: trio.Nursery, *, disk_writers: int = 4) -> None:
        self.backend = backend
        self.cache = cache
        self.chunk_size = chunk_size
        self._nursery = nursery
        self._flights: dict[bytes, _Flight] = {}
        # bounds the fetched bytes waiting for the disk tier: backpressure, not a pile-up
        self._disk_writes = trio.Semaphore(disk_writers)

    def chunk_length(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.chunk_size, obj.size - index * self.chunk_size))

    def in_flight(self, ckey: bytes) -> bool:
        return ckey in self._flights

    async def chunk(self, obj: ObjectVersion, index: int, *, background: bool = False) -> bytes:
        ckey = obj.chunk_key(index)
        while True:
            flight = self._flights.get(ckey)
            if flight is None:
                break
            await flight.done.wait()
            if flight.data is not None:
                return flight.data
        flight = self._flights[ckey] = _Flight()
        try:
            data = await self.backend.get(obj.key, index * self.chunk_size,
                                          self.chunk_length(obj, index), obj.etag,
                                          background=background)
            if len(data) != self.chunk_length(obj, index):
                # a shorter or longer body than the listed size: the object changed
                raise PreconditionFailed(f"get {obj.key!r}: size differs from the listing")
            self.cache.remember(ckey, data)
            flight.data = data
        except BaseException:
            del self._flights[ckey]
            raise
        finally:
            flight.done.set()
        # the flight (holding the bytes) stays until the disk tier has the chunk: with a
        # small or no memory tier, a reader arriving meanwhile must not fetch it again
        try:
            await self._disk_writes.acquire()
        except BaseException:
            del self._flights[ckey]
            raise
        self._nursery.start_soon(self._store, obj, ckey, data)
        return data

    async def _store(self, obj: ObjectVersion, ckey: bytes, data: bytes) -> None:
        try:
            await self.cache.fill(obj, ckey, data)
        finally:
            self._flights.pop(ckey, None)
            self._disk_writes.release()

    async def read_through(self, obj: ObjectVersion, index: int) -> bytes | memoryview:
        """A whole chunk, from the cache if it has it, else from the backend."""
        length = self.chunk_length(obj, index)
        hit = await self.cache.read(obj.chunk_key(index), 0, self.cache.blocks_of(length) - 1,
                                    touch=False)
        return hit[0] if hit is not None else await self.chunk(obj, index)
