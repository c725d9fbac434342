"""Read-ahead: detects sequential readers and brings the next chunks in ahead of them.

A handle whose reads continue where the last one ended is sequential: from offset 0 at
once, elsewhere after two reads in a row that continue the one before (one lucky
continuation of a random reader - 1 in 250 of 4 KiB reads of a 64 MiB file - must not
load 32 MiB into memory). A read at offset 0 reads one chunk ahead (a program that looks
at a file's header costs one chunk more); once the next read continues it, the window is
SEQUENTIAL_WINDOW chunks at once, then doubles with each read up to readahead_chunks: a
sequential reader has that many GETs in flight from its second read, not its fourth.
Upcoming chunks that are on disk are loaded into the memory tier, the others fetched from
the backend at background priority.
`on_read` never blocks a reader: when more than `max_queued` chunks are already being
read ahead, new requests are dropped (and counted), not queued.

A read-ahead is a guess: its failure is the reader's business only if the reader asks
for that chunk, and then the reader's own request meets (and reports) the error. So an
expected failure (a TierfsError, also inside a group) is a debug line; anything else is
a bug, reported by the Tasks supervisor (tierfs_internal_errors_total{task="read-ahead"})
and never raised into the daemon's nursery.

A chunk read ahead is held in the memory tier until its reader has read past it or closes
(`MemoryTier.hold`): nothing else pushes it out before it is read, neither another
read-ahead nor a GET in flight, so a cold pass downloads each chunk once (issue 26, M3:
with LRU order the next chunk a reader wanted was the oldest entry and went first;
figures in bench/README.md, "Download ratio"). The chunk a sequential
reader is in is held too. Read-ahead holds at most AHEAD_SHARE of the tier (the rest is
for readers' own chunks), each chunk's room reserved from its start (so no other GET
takes it before the bytes arrive), and a handle at most its window plus the chunk it is in: where
the next chunk does not fit, read-ahead stops there until the reader frees some, instead
of fetching what it would evict. A tier too small for one chunk there holds nothing:
read-ahead then goes to the disk tier only (the flight keeps the bytes until written).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from ..cache import ChunkCache, ObjectVersion
from ..cache.memory import WHOLE
from ..cache.tier import Want
from ..metrics import Metrics
from ..tasks import Tasks, expected_error
from .walk import TierWalk

log = logging.getLogger(__name__)

# the read-ahead window (in chunks) of a reader as soon as it is seen to be sequential
SEQUENTIAL_WINDOW = 4
# the share of the memory tier read-ahead may hold (chunks fetched, not yet read past);
# the rest is for what readers fetch on their own misses and for re-reads
AHEAD_SHARE = 0.5


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
    # chunks this handle holds in the memory tier (read ahead, or the one it is in):
    # chunk index -> chunk key, released once it reads past them or closes
    held: dict[int, bytes] = field(default_factory=dict)
    pending: int = 0  # read-aheads of this handle under way
    tenant: str | None = None  # the handle's reader's tenant: owns what read-ahead caches
    closed: bool = False


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


class Prefetcher:
    def __init__(self, walk: TierWalk, cache: ChunkCache, metrics: Metrics,
                 tasks: Tasks, *, max_window: int, max_queued: int) -> None:
        self.walk = walk
        self.cache = cache
        self.metrics = metrics
        self._tasks = tasks
        self.max_window = max_window
        self.max_queued = max_queued
        self._active: dict[bytes, trio.Event] = {}  # chunks being read ahead
        self.memory = cache.memory
        # what read-ahead may hold in the memory tier; chunks under way count already
        self.ahead_bytes = int(self.memory.capacity * AHEAD_SHARE)
        self._claimed = 0
        cs = walk.chunk_size
        self._holds = cs <= self.ahead_bytes  # else read-ahead goes to the disk tier only
        fits = self.ahead_bytes // cs
        if fits < max_window:  # issue 26, M1: say so at start, not as reads that wait
            log.warning(
                "the memory tier (%s) holds %d of --readahead-chunks %d chunks of %s read "
                "ahead (read-ahead may use %d%% of it)%s; a sequential reader's full window "
                "needs --memory-cache-size %s, more for several readers",
                _mib(self.memory.capacity), fits, max_window, _mib(cs), AHEAD_SHARE * 100,
                ": read-ahead goes to the disk tier only" if not fits else "",
                _mib(int((max_window + 1) * cs / AHEAD_SHARE)))

    def on_read(self, obj: ObjectVersion, pat: ReadPattern, offset: int, end: int) -> None:
        cs = self.walk.chunk_size
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
        current = offset // cs
        if pat.held:
            self._passed(pat, current)
        if pat.window == 0:
            return
        last = (obj.size - 1) // cs
        ckey = obj.chunk_key(current)
        if ckey not in self._active and self.cache.in_memory(ckey, 0, 0) is None:
            if self.cache.has(ckey):
                # a sequential reader will want all of this chunk: one whole-chunk disk
                # read (the reader waits for it) beats a disk read per kernel request
                self._start(obj, current, ckey, pat)
        elif self._holds and pat.held.get(current) != ckey:
            # the chunk the reader is in (fetched on its own miss, or shared): another
            # reader's GET must not push it out between two of its reads. Outside the
            # read-ahead share: its room is the one the chunk it passed left
            self._hold(pat, current, ckey)
        start = max(current + 1, pat.ahead_to)
        stop = min(last, current + pat.window)
        for index in range(start, stop + 1):
            ckey = obj.chunk_key(index)
            if ckey in self._active or self.walk.in_flight(ckey):
                continue
            if len(self._active) >= self.max_queued:
                self.metrics.prefetch_dropped.inc()
                return
            in_memory = self.cache.in_memory(ckey, 0, 0) is not None
            if not self._room(pat, self.walk.chunk_length(obj, index), in_memory):
                return  # it would push out what was read ahead: go on once the reader frees some
            pat.ahead_to = index + 1
            if in_memory:
                if self._holds and pat.held.get(index) != ckey:
                    self._hold(pat, index, ckey)
                continue
            self._start(obj, index, ckey, pat, reserved=self._holds)

    def closed(self, pat: ReadPattern) -> None:
        """The handle closed: what it held is the LRU's again; read-aheads still under way
        for it hold nothing."""
        pat.closed = True
        for ckey in pat.held.values():
            self.memory.unhold((ckey, WHOLE))
        pat.held.clear()

    def _passed(self, pat: ReadPattern, current: int) -> None:
        """Release the chunks the reader has read past (or jumped over)."""
        for index in [i for i in pat.held if i < current]:
            self.memory.unhold((pat.held.pop(index), WHOLE))

    def _room(self, pat: ReadPattern, length: int, in_memory: bool) -> bool:
        """Whether one more chunk of `length` bytes may be read ahead for `pat` without
        pushing out anything read ahead (or in flight) before it is read; if it is to be
        fetched or loaded (not `in_memory`), its room is reserved in the tier now, so
        nothing else takes it before its bytes arrive (they are held in it then)."""
        if not self._holds:
            return True
        if len(pat.held) + pat.pending > self.max_window:
            return False
        if self.memory.held_bytes + self._claimed + length > self.ahead_bytes:
            return False
        return in_memory or self.memory.reserve(length)

    def _hold(self, pat: ReadPattern, index: int, ckey: bytes,
              data: bytes | bytearray | memoryview | None = None) -> None:
        """Hold chunk `index` for `pat` (the tier's entry, else `data`) if the tier keeps it."""
        if pat.closed:
            return
        old = pat.held.pop(index, None)
        if old is not None:  # another version's chunk at this index (the handle moved)
            self.memory.unhold((old, WHOLE))
        key = (ckey, WHOLE)
        if self.memory.hold(key) or (data is not None and self.memory.put(key, data, hold=True)):
            pat.held[index] = ckey

    def _start(self, obj: ObjectVersion, index: int, ckey: bytes, pat: ReadPattern, *,
               reserved: bool = False) -> None:
        """Bring chunk `index` in; `reserved`: its room in the tier is reserved (`_room`)."""
        self._active[ckey] = trio.Event()
        if reserved:
            self._claimed += self.walk.chunk_length(obj, index)
        pat.pending += 1
        self._tasks.spawn("read-ahead", self._bring, obj, index, ckey, pat, reserved)

    async def settled(self, ckey: bytes) -> None:
        """Wait for a read-ahead of this chunk already under way (never starts one)."""
        event = self._active.get(ckey)
        if event is not None:
            await event.wait()

    async def _bring(self, obj: ObjectVersion, index: int, ckey: bytes, pat: ReadPattern,
                     reserved: bool) -> None:
        length = self.walk.chunk_length(obj, index)

        def arrived(data: bytes | bytearray | memoryview) -> None:
            """Its reserved room becomes its held entry (no await in between)."""
            nonlocal reserved
            if reserved:
                self.memory.unreserve(length)
                self._claimed -= length
                reserved = False
            if self._holds:
                self._hold(pat, index, ckey, data)

        try:
            if not self.cache.has(ckey):
                pat.fetched[index] = "backend"  # the reader's bytes count where they come from
            got = await self.walk.read(Want(obj, index, background=True, tenant=pat.tenant))
            if index in pat.fetched:
                pat.fetched[index] = got.source
            elif got.source == "disk":
                pat.loaded.add(index)
            arrived(got.data)
        except Exception as exc:
            err = expected_error(exc)
            if err is None:
                raise  # a bug: Tasks logs it with its traceback and counts it (read-ahead)
            # the reader will meet the same error on its own request and report it
            log.debug("read-ahead of %s chunk %d failed: %s", obj.key, index, err)
        finally:
            if reserved:  # failed or cancelled: its room is free again
                self.memory.unreserve(length)
                self._claimed -= length
            pat.pending -= 1
            self._active.pop(ckey).set()
