"""Read-ahead: detects sequential readers and brings the next chunks in ahead of them.

A handle whose reads continue where the last one ended is sequential: from offset 0 at
once, elsewhere after two reads in a row that continue the one before (one lucky
continuation of a random reader - 1 in 250 of 4 KiB reads of a 64 MiB file - must not
load 32 MiB into memory). A read at offset 0 reads one chunk ahead (a program that looks
at a file's header costs one chunk more); once the next read continues it, the window is
SEQUENTIAL_WINDOW chunks at once, then doubles with each read up to readahead_chunks: a
sequential reader has that many GETs in flight from its second read, not its fourth. Upcoming chunks that are on disk are
loaded into the memory tier, the others fetched from the backend at background priority.
`on_read` never blocks a reader: when more than `max_queued` chunks are already being
read ahead, new requests are dropped (and counted), not queued.

A read-ahead is a guess: its failure is the reader's business only if the reader asks
for that chunk, and then the reader's own request meets (and reports) the error. So an
expected failure (a TierfsError, also inside a group) is a debug line; anything else is
a bug, reported by the Tasks supervisor (tierfs_internal_errors_total{task="read-ahead"})
and never raised into the daemon's nursery.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from .cache import ChunkCache, ObjectVersion
from .fetch import Fetcher
from .metrics import Metrics
from .tasks import Tasks, expected_error

log = logging.getLogger(__name__)

# the read-ahead window (in chunks) of a reader as soon as it is seen to be sequential
SEQUENTIAL_WINDOW = 4


@dataclass
class ReadPattern:
    next_offset: int = 0
    window: int = 0  # chunks to keep ahead; 0 = not sequential
    streak: int = 0  # reads in a row that continued the one before
    ahead_to: int = 0  # first chunk index not yet requested
    # chunks fetched for this handle from the backend or a peer (read ahead, or on its own
    # miss: fileio.py): chunk index -> "backend" | "peer". Their fill already counted as
    # this handle's access (or an unread read-ahead chunk would be colder than a read one);
    # the handle's first reads of their bytes count as that source (OpenFile.delivered)
    fetched: dict[int, str] = field(default_factory=dict)
    loaded: set[int] = field(default_factory=set)  # read ahead from the disk tier


class Prefetcher:
    def __init__(self, fetcher: Fetcher, cache: ChunkCache, metrics: Metrics,
                 tasks: Tasks, *, max_window: int, max_queued: int) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.metrics = metrics
        self._tasks = tasks
        self.max_window = max_window
        self.max_queued = max_queued
        self._active: dict[bytes, trio.Event] = {}  # chunks being read ahead

    def on_read(self, obj: ObjectVersion, pat: ReadPattern, offset: int, end: int) -> None:
        cs = self.fetcher.chunk_size
        # small slop: the kernel may skip or re-issue a few pages at readahead boundaries
        if pat.next_offset and abs(offset - pat.next_offset) <= 128 << 10:
            pat.streak += 1
            if pat.window or pat.streak >= 2:
                pat.window = min(self.max_window, max(SEQUENTIAL_WINDOW, pat.window * 2))
        elif offset == 0:
            pat.streak = 0
            pat.window = min(self.max_window, max(1, pat.window * 2))
        else:
            pat.window = pat.streak = 0
            pat.ahead_to = 0
        pat.next_offset = end
        if pat.window == 0:
            return
        current = offset // cs
        last = (obj.size - 1) // cs
        ckey = obj.chunk_key(current)
        if (ckey not in self._active and self.cache.has(ckey)
                and self.cache.in_memory(ckey, 0, 0) is None):
            # a sequential reader will want all of this chunk: one whole-chunk disk read
            # (the reader waits for it) beats a disk read per kernel request
            self._start(obj, current, ckey, pat)
        start = max(current + 1, pat.ahead_to)
        stop = min(last, current + pat.window)
        for index in range(start, stop + 1):
            ckey = obj.chunk_key(index)
            if ckey in self._active or self.fetcher.in_flight(ckey):
                continue
            if len(self._active) >= self.max_queued:
                self.metrics.prefetch_dropped.inc()
                return
            pat.ahead_to = index + 1
            if self.cache.in_memory(ckey, 0, 0) is not None:
                continue
            self._start(obj, index, ckey, pat)

    def _start(self, obj: ObjectVersion, index: int, ckey: bytes, pat: ReadPattern) -> None:
        self._active[ckey] = trio.Event()
        self._tasks.spawn("read-ahead", self._bring, obj, index, ckey, pat)

    async def settled(self, ckey: bytes) -> None:
        """Wait for a read-ahead of this chunk already under way (never starts one)."""
        event = self._active.get(ckey)
        if event is not None:
            await event.wait()

    async def _bring(self, obj: ObjectVersion, index: int, ckey: bytes, pat: ReadPattern) -> None:
        try:
            length = self.fetcher.chunk_length(obj, index)
            if self.cache.has(ckey):
                last_block = self.cache.blocks_of(length) - 1
                hit = await self.cache.read(ckey, 0, last_block, touch=False)
                if hit is not None:
                    if hit[1] == "disk":
                        pat.loaded.add(index)
                    return
            pat.fetched[index] = "backend"
            _, pat.fetched[index] = await self.fetcher.fetch(obj, index, background=True)
        except Exception as exc:
            err = expected_error(exc)
            if err is None:
                raise  # a bug: Tasks logs it with its traceback and counts it (read-ahead)
            # the reader will meet the same error on its own request and report it
            log.debug("read-ahead of %s chunk %d failed: %s", obj.key, index, err)
        finally:
            self._active.pop(ckey).set()
