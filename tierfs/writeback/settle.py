"""Settler: what was just uploaded stays cached, once (docs/architecture.md, decision 3d).

Once the store has a file, the chunks of the base the writes left alone keep their cached
copies (re-keyed to the new version), and the written chunks move out of the staging file
into the disk tier under the new ETag, each into the room its unsaved copy held, the
staging file cut behind them: restoring a checkpoint on the node that wrote it costs no
GET, and a file never holds its size in the cache twice. The move runs in the background
for a file still open (close() does not wait for it), or first thing by whatever changes
or forgets the file next; meanwhile the file reads as the uploaded version where a chunk
has moved (d.base), so a reader never sees a moved chunk as a hole.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Callable

import trio

from ..cache import ChunkCache, Fill, ObjectVersion
from ..metrics import Metrics
from .dirty import DirtyFile, State

log = logging.getLogger("tierfs.writeback")

MOVES = 2  # chunks moved into the cache at once after an upload (the disk tier writes direct)


class Settler:
    def __init__(self, cache: ChunkCache, metrics: Metrics, *, chunk_size: int,
                 live: Callable[[DirtyFile], bool]) -> None:
        self.cache = cache
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.live = live  # whether the write-back still holds this file
        self._send, self._recv = trio.open_memory_channel[DirtyFile](math.inf)

    async def uploaded(self, d: DirtyFile, new: ObjectVersion) -> None:
        """The store has `new`: the base's untouched chunks are linked to it now, the
        written ones wait in the staging file for settle()."""
        cs, base = self.chunk_size, d.base
        untouched = []
        for index in range(-(-new.size // cs)):
            start = index * cs
            length = min(cs, new.size - start)
            if (index not in d.materialized and base is not None
                    and start + length <= d.base_valid and base.key == new.key):
                untouched.append(index)
        if untouched and base is not None:
            await self.cache.rekey(base, new, untouched)
        self.cache.hold(len(d.materialized) * cs, key=d.key)  # saved: no longer dirty
        d.uploaded = new
        d.to(State.UPLOADED)

    def later(self, d: DirtyFile) -> None:
        """Settle d in the background (it is still open)."""
        self._send.send_nowait(d)

    async def settle(self, d: DirtyFile) -> None:
        """With d.lock held: move the chunks of the version just uploaded into the disk
        tier, last first, the staging file cut behind each batch; then the file is rebased
        on that version (nothing materialized, the staging file empty)."""
        new = d.uploaded
        if new is None or not self.live(d):
            return
        cs = self.chunk_size
        try:
            order = sorted(d.materialized, reverse=True)
            for at in range(0, len(order), MOVES):
                batch = order[at:at + MOVES]
                async with trio.open_nursery() as nursery:
                    for index in batch:
                        nursery.start_soon(self._move, d, new, index)
                # the staging copies of the batch go: at most MOVES chunks held twice
                await trio.to_thread.run_sync(os.ftruncate, d.fd, batch[-1] * cs)
        except Exception as exc:  # saved: only the cached copy is lost
            if isinstance(exc, OSError):  # the staging file's truncation
                log.warning("%r is saved, but its staging file: %s", d.key, exc)
            else:
                self.metrics.internal_errors.labels("upload").inc()
                log.error("%r is saved, but what was written cannot all be cached",
                          d.key, exc_info=exc)
        self.cache.release_held(len(d.materialized) * cs, key=d.key)  # what did not move
        d.materialized.clear()
        d.uploaded = None
        if d.state is State.UPLOADED:
            d.to(State.CLEAN)
        try:
            os.ftruncate(d.fd, 0)
        except OSError as exc:
            log.warning("%r is saved, but its staging file: %s", d.key, exc)

    async def run(self) -> None:
        """Background moves of uploaded files still open; never dies."""
        while True:
            d = await self._recv.receive()
            try:
                async with d.lock:
                    await self.settle(d)
            except Exception as exc:  # keep the worker
                self.metrics.internal_errors.labels("upload").inc()
                log.error("caching what was written to %r failed unexpectedly", d.key,
                          exc_info=exc)

    async def _move(self, d: DirtyFile, new: ObjectVersion, index: int) -> None:
        """Chunk `index` of the staging file into the disk tier as `new`'s, into the room its
        unsaved copy held; read straight into the tier's write buffer (no copy)."""
        cs = self.chunk_size
        start = index * cs
        length = min(cs, new.size - start)
        ckey = new.chunk_key(index)

        def fill(view: memoryview) -> None:  # in the worker thread
            got = os.preadv(d.fd, [view], start)
            view[got:] = bytes(length - got)  # a hole past the staging file's end

        async with self.cache.filling(new, ckey, length, Fill.WRITTEN, held=cs) as stored:
            try:  # its held bytes are the fill's now (released as the block began)
                if stored is not None:
                    stored(await trio.to_thread.run_sync(self.cache.disk.write_via, ckey,
                                                         length, fill))
            except OSError as exc:  # a full or failing cache disk: the object is saved
                log.warning("cannot write chunk to the cache dir: %s", exc)
            finally:
                # readers read the staging file until the chunk is indexed (a read of
                # `new` before would miss and GET it)
                d.materialized.discard(index)
