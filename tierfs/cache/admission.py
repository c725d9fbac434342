"""Admission: which chunk a full disk tier takes in, and which it serves from memory only.

Eviction by heat alone keeps nothing of a loop over a data set larger than the cache (each
chunk is the coldest just before its next read: LRU gets 0 too), and a one-shot scan
pushes out a hot set read once a round. Both are the common shapes of training I/O. So,
as TinyLFU does, a chunk fetched for a reader when the cache must evict to store it is
stored only if it has clearly more reads than the chunk it would push out (the coldest
victim): its heat, remembered from its reads while it was out of the cache (`History`),
must be above MARGIN times the victim's, each weighed by what a miss on it costs per byte
(heat.value: the same for chunks of one size). A chunk that loses is served from memory and its
read is remembered: read again, it gets in over victims read less.

The two heats are compared as of each chunk's last read, plus the time between those
reads minus LAG_IGNORED half-lives (decay counts only beyond that). A loop over the data
reads equally hot chunks in some order: compared decayed to now, the one read later
looks up to 2^(loop time / half-life) hotter and the cached set churns (a loop over 3x the
cache kept 0.36x of what OPT keeps at the bench's default clock, 1.00x this way). Beyond
the lag ignored, decay counts: yesterday's hot data gives way to today's data read twice.

Stale data does not hold the cache for ever: a victim whose heat decayed to now is below
STALE (10 half-lives for a chunk read once, 5 h at the default) gives way to any chunk.
STALE is small because it must not fire inside a loop: an epoch that takes 4 half-lives
(bench/evict.py at 8192 s per cache of reads) kept nothing with 1/16. Room is never
refused while the cache has it (no eviction needed), nor to explicit fills: `tierfs
warm`, and written data (the write path stores it anyway; a checkpoint read back after a
restart is the point).

A chunk's heat when stored (`entry_heat`): a reader's chunk enters with its remembered
heat plus this read; a warmed one with 1 (it is there to be read); a written one with 0
(heat counts reads), which eviction and admission rank as UNREAD_WRITTEN reads at its
write (heat.py): the last checkpoint is kept for its restore, and the room of written
chunks read at most once is what the next writes take first (ChunkCache.reserve_dirty).
So a restored checkpoint's room is kept from readers for RESTORED_KEPT cache-fulls of
accesses after its restore, for the job's next save: taken by readers, it made each save
push out a batch of the data set, which readers then refilled (bench/evict.py
checkpoints at 20 s: 0.80x OPT, 0.87x with it).

Reads that stopped: comparing heats keeps the last job's data set, read many times, against
the next job's, read a few times so far, for about 3 half-lives (bench/evict.py `jobs`). So
a chunk not read for ABANDONED times the longest gap seen between two of its reads while
cached (a gap counting as at least MIN_GAP cache-fulls of chunk accesses) is abandoned: it
gives way to any chunk read before, as the victim the comparison would have, or, when the
comparison refuses, as the least recently read chunk with a gap (`abandoned`; where heat
hardly decays, the coldest chunks are the new data set's own, never the old set's). Gaps are
counted in chunk accesses, not seconds (`accessed`): an idle night or a job waiting in the
queue abandons nothing, and reads a moment apart by several handles are no period. A
loop's chunk is read every epoch, so it is never that late; a chunk not read twice since
it was stored (or since a restart) has no gap and is not judged this way.

Where recency does better: heat keeps what was read most, which loses to plain LRU when the
workload moves on before the old reads stop counting: the next job's data set, read a few
times, against the last job's, read many (bench/evict.py `jobs`, 0.62x LRU with abandonment
alone: the new set was cached from its 3rd epoch at best). So Admission keeps a shadow of
plain LRU, the keys only, as many bytes as the cache holds (`LruShadow`), and counts how far the
cache trails it (`trail`): +1 for a reader's miss LRU would have hit (`missed`), -1 for a
hit LRU would have missed (`read`), the count fading by 1/chunks per chunk access (about
a cache-full of accesses). While the cache trails LRU by more than TRAILING of its chunks
(and TRAILING_MIN hits), a reader's chunk the comparison refused takes the room LRU would
have taken for it, if
LRU would hit it or it is new data (never read before, where LRU starts to cache): the
least recently read cached chunk that LRU no longer holds (`yielding`). Loops over more
than the cache, scans and checkpoint cycles are where the cache leads LRU (the trail
stays below 0), so they keep their heat rules; a new job is where it trails, and from its
2nd epoch it is cached as LRU caches it (`jobs`: 0.91x LRU).

A new job's first epoch reads exactly as a one-shot pass over new data would (bench/evict.py
`epochs+pass`: the same accesses up to the pass's end), and that pass must not push out
the set the running job reads again: no count can tell them apart. The daemon can: it
knows who reads (tierfs/telemetry/callers.py). When a Slurm job or a pod opens its first file here
(`job_opened`: not among the last JOBS_KEPT seen), then for the next cache-full of
accesses new data (never read before) takes the room of the least recently read chunk if
LRU no longer holds it and it was not read since the job started: the last job's data
gives way to the new job's as under LRU, what anyone read since stays (`jobs` 1.00x LRU;
`epochs+pass`, one job, 1.00x OPT). A user's reads (uid:N) start nothing.

History, gaps and the shadow are bounded (HISTORY_FACTOR x the cache's chunk count, at most
HISTORY_MAX entries, oldest forgotten first; a gap per cached chunk; the shadow's capacity;
JOBS_KEPT jobs) and live in memory: after a restart a loop's chunks are new again (read
once, nothing to compare) and every job counts as new.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Callable

from ..index.chunks import ChunkRecord
from .heat import RESTORED, decayed, ranked, value

STALE = 1 / 1024  # a victim's decayed heat below this yields to any chunk
# chunks read equally often must not displace each other on timing: bench/evict.py,
# epochs-shuffled at 1024 s, 1.25 gave 0.52x OPT and 2 gives 1.00x
MARGIN = 2.0
LAG_IGNORED = 2.0  # half-lives between two chunks' last reads that do not count
HISTORY_FACTOR = 4  # chunks remembered: this many cache-fulls
HISTORY_MAX = 1 << 20  # at most (~100 MB of dict at 1 M entries)
# a chunk not read for this many times its longest gap between reads is abandoned (module
# doc), a gap counting as at least MIN_GAP cache-fulls of chunk accesses: bench/evict.py jobs
# 0.40x -> 0.62x OPT at every clock, the rest as they were. ABANDONED 2 gave jobs 0.58x but
# checkpoints 0.85x at 20 s, 2.5 and 4 0.52x; MIN_GAP 1 cost checkpoints 0.76x at 20 s (a
# chunk of a loop over 2 C seen once a short gap apart), 2 gave jobs 0.46x at 20 s
ABANDONED = 3.0
MIN_GAP = 1.5
# a restored checkpoint's room is kept from readers for this many cache-fulls of chunk
# accesses after its restore (module doc): bench/evict.py checkpoints 0.80x -> 0.87x OPT at
# 20 s (0.76x -> 0.87x at every clock with heat.PER_CACHE 12); 1 and 2 the same
RESTORED_KEPT = 1.25
# the cache trails plain LRU (module doc) while LRU's extra hits, fading over a cache-full
# of accesses, pass this share of its chunks: bench/evict.py jobs 0.62x -> 0.91x OPT, the
# rest as they were (seeds 1-5); 0.01 let a shuffled loop's noise trip it (seed 2:
# epochs-shuffled 0.97x), 0 more so (0.95x, checkpoints 0.75x at 20 s), 0.05 jobs 0.89x
TRAILING = 0.02
# and by at least this many hits: fewer is noise. The count never passes its cache's chunk
# count, so caches of up to 800 chunks never trail: bench/report_run.py's 16-chunk cache,
# where 16 record reads touch each chunk an epoch, trailed on single misses and churned its
# training chunks (their hits 59% -> 55%)
TRAILING_MIN = 16.0
JOBS_KEPT = 1024  # Slurm jobs and pods remembered as seen (`job_opened`)
# chunks `yielding` passes over (pinned, being written, smaller than the incoming one: to
# the back of the order) before it gives up: a refused read must not walk a million label
# files
SKIPPED_MAX = 64


class Fill(enum.Enum):
    """Why a chunk is stored: what admission and its starting heat depend on."""

    READ = "read"  # fetched for a reader (or read ahead for one, or for a peer)
    WARM = "warm"  # `tierfs warm`: asked for explicitly, always admitted
    WRITTEN = "written"  # written through the mount: stored anyway, heat 0 until read


class History:
    """Decayed heat of chunks read while not in the cache, bounded, oldest forgotten."""

    def __init__(self, half_life: float, size: int) -> None:
        self.half_life = half_life
        self.size = max(1, min(size, HISTORY_MAX))
        self._seen: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def heat(self, ckey: bytes, now: float) -> float:
        past = self._seen.get(ckey)
        return 0.0 if past is None else decayed(past[0], past[1], now, self.half_life)

    def last(self, ckey: bytes) -> tuple[float, float] | None:
        """(heat as of its last read, the time of that read), if remembered."""
        return self._seen.get(ckey)

    def remember(self, ckey: bytes, heat: float, at: float) -> None:
        self._seen[ckey] = (heat, at)
        self._seen.move_to_end(ckey)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def forget(self, ckey: bytes) -> tuple[float, float] | None:
        return self._seen.pop(ckey, None)


class LruShadow:
    """The chunk keys plain LRU of `size` bytes would hold (and their lengths, no data):
    which reads it would hit. In bytes, not keys: a 4 KiB label file takes 1/2000 of the
    room of an 8 MiB chunk (bench/report_run.py: a shadow of 15 keys for a 128 MiB cache of
    8 MiB chunks let every label file go, and they churned)."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._keys: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0

    def __contains__(self, ckey: bytes) -> bool:
        return ckey in self._keys

    def access(self, ckey: bytes, length: int) -> bool:
        """LRU reads or stores `ckey` (`length` bytes): whether it held it (a hit)."""
        held = self._keys.pop(ckey, None)
        self._bytes += length - (held or 0)
        self._keys[ckey] = length
        while self._bytes > self.size and len(self._keys) > 1 or len(self._keys) > HISTORY_MAX:
            self._bytes -= self._keys.popitem(last=False)[1]
        return held is not None


class Admission:
    """The policy (module doc). `chunks`: the cache's size in chunks (sizes the history);
    `lru_bytes`: the most the cache holds (its budget's high watermark share: plain LRU's
    shadow holds as much)."""

    def __init__(self, half_life: float, chunks: int, lru_bytes: int) -> None:
        self.half_life = half_life
        self.chunks = max(1, chunks)
        self.history = History(half_life, HISTORY_FACTOR * self.chunks)
        self.lru = LruShadow(lru_bytes)
        # LRU's hits beyond the cache's (module doc), fading by 1/chunks per access
        self.trail = 0.0
        self._fade = 1.0 - 1.0 / self.chunks
        self._jobs: OrderedDict[str, None] = OrderedDict()  # seen, least recently first
        self.new_job_at = -1  # accesses when a new job last opened its first file
        self.accesses = 0  # chunk accesses counted (`accessed`): the clock of read gaps
        # cached chunks not read twice since stored: accesses at the store or the one read
        self._once: dict[bytes, int] = {}
        # the others: (longest gap between two reads, accesses at the last), least recently
        # read first
        self._gaps: OrderedDict[bytes, tuple[int, int]] = OrderedDict()

    def set_half_life(self, half_life: float) -> None:
        """The heat half-life in use changed (heat.HalfLife)."""
        self.half_life = self.history.half_life = half_life

    def admits(self, ckey: bytes, length: int, vkey: bytes, victim: ChunkRecord,
               now: float) -> bool:
        """Whether a chunk of `length` bytes fetched for a reader may push out `victim` (the
        coldest chunk the evictor would drop for it, key `vkey`). Heats are weighed by what a
        miss costs per byte (heat.value): the same for chunks of one size. An unread written
        chunk (heat 0) goes stale as one read at its write would, and ranks as
        UNREAD_WRITTEN reads before that (heat.ranked)."""
        if decayed(max(victim.heat, 1.0), victim.last_access, now, self.half_life) < STALE:
            return True
        if victim.heat == RESTORED and vkey in self._once and \
                self.accesses - self._once[vkey] < RESTORED_KEPT * self.chunks:
            return False  # the next save's room (module doc)
        past = self.history.last(ckey)
        if past is None:
            return False
        if vkey in self._gaps and self._stopped(*self._gaps[vkey]):
            return True  # abandoned (module doc)
        heat, at = past
        lag = (at - victim.last_access) / self.half_life
        counted = max(0.0, abs(lag) - LAG_IGNORED)
        return value(heat, length) * 2.0 ** (counted if lag > 0 else -counted) > \
            MARGIN * value(ranked(victim.heat), victim.length)

    def refused(self, ckey: bytes, now: float) -> None:
        """A chunk served from memory only: its read is history."""
        self.history.remember(ckey, self.history.heat(ckey, now) + 1.0, now)

    def accessed(self) -> None:
        """One chunk access (a reader's touch or a fill), as heat.HalfLife counts them."""
        self.accesses += 1
        self.trail *= self._fade

    def missed(self, ckey: bytes, length: int) -> bool:
        """A reader's chunk of `length` bytes not in the cache is fetched (before
        `accessed`): whether plain LRU would have hit it (`yielding` takes that)."""
        hit = self.lru.access(ckey, length)
        self.trail += hit
        return hit

    @property
    def trailing(self) -> bool:
        """Whether plain LRU has lately hit clearly more than the cache (module doc)."""
        return self.trail > max(TRAILING * self.chunks, TRAILING_MIN)

    def job_opened(self, reader: str) -> None:
        """`reader` (tierfs/telemetry/callers.py) opened a file: a Slurm job or pod not seen before
        opens a cache-full of accesses in which new data takes the room of data not read
        since (module doc, `yielding`). Users (uid:N) do not: what they read by hand is more
        often a pass than a working set."""
        if not reader.startswith(("job:", "pod:")):
            return
        if reader in self._jobs:
            self._jobs.move_to_end(reader)
            return
        self._jobs[reader] = None
        if len(self._jobs) > JOBS_KEPT:
            self._jobs.popitem(last=False)
        self.new_job_at = self.accesses

    def read(self, ckey: bytes, rec: ChunkRecord) -> None:
        """A reader's access to cached chunk `rec`, before its heat changes and before the
        access is counted (`accessed`, next): the gap since its last read (not since a
        written chunk's store, nor since a restart); and LRU's view of it."""
        if not self.lru.access(ckey, rec.length):
            self.trail -= 1.0
        this = self.accesses + 1
        if ckey in self._gaps:
            gap, last = self._gaps.pop(ckey)
            self._gaps[ckey] = (max(gap, this - last), this)
            return
        last = self._once.pop(ckey, None)
        if last is not None and rec.heat > 0.0:
            self._gaps[ckey] = (this - last, this)
        else:
            self._once[ckey] = this

    def _stopped(self, gap: int, last: int) -> bool:
        return self.accesses - last > ABANDONED * max(gap, MIN_GAP * self.chunks)

    def yielding(self, ckey: bytes, evictable: Callable[[bytes], bool],
                 lru_hit: bool) -> tuple[bytes, str] | None:
        """(the cached chunk whose room `ckey` takes, why: "abandoned", "lru" or "new_job"),
        `ckey` a reader's chunk the comparison refused (module doc; `lru_hit`: `missed` said
        plain LRU would hit it), if any: the least
        recently read abandoned chunk, if `ckey` was read before; else the least recently
        read chunk, if LRU no longer holds it, while the cache trails LRU and LRU would hit
        `ckey` or it is new data (never read), or for a cache-full of accesses after a new
        job opened its first file if `ckey` is new data and that chunk was not read since.
        One that `evictable` turns down (pinned, being written, smaller than `ckey`) goes to
        the back of the order, at most SKIPPED_MAX of them a call."""
        known = self.history.last(ckey) is not None
        if known:
            victim = self._abandoned(evictable)
            if victim is not None:
                return victim, "abandoned"
        if self.trailing and (lru_hit or not known):
            before, why = float("inf"), "lru"  # any chunk LRU let go
        elif not known and self.accesses - self.new_job_at < self.chunks:
            before, why = self.new_job_at, "new_job"  # those not read since it started
        else:
            return None
        last, victim = self._least_recently_read(evictable)
        return (victim, why) if victim is not None and victim not in self.lru \
            and last < before else None

    def _abandoned(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        for _ in range(min(len(self._gaps), SKIPPED_MAX + 1)):
            vkey, (gap, last) = next(iter(self._gaps.items()))
            if not self._stopped(gap, last):
                return None
            if evictable(vkey):
                return vkey
            self._gaps.move_to_end(vkey)
        return None

    def _least_recently_read(self, evictable: Callable[[bytes], bool]
                             ) -> tuple[int, bytes | None]:
        """(accesses at its last read, key) of the cached chunks (`_once` and `_gaps`, each
        in read order), or (0, None)."""
        fronts = []
        once = self._evictable_front(self._once, evictable)
        if once is not None:
            fronts.append((self._once[once], once))
        gaps = self._evictable_front(self._gaps, evictable)
        if gaps is not None:
            fronts.append((self._gaps[gaps][1], gaps))
        return min(fronts) if fronts else (0, None)

    @staticmethod
    def _evictable_front(order: dict, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The first key of `order` that `evictable` takes among its first SKIPPED_MAX + 1;
        those before it go to the back."""
        for _ in range(min(len(order), SKIPPED_MAX + 1)):
            vkey = next(iter(order))
            if evictable(vkey):
                return vkey
            order[vkey] = order.pop(vkey)
        return None

    def dropped(self, ckey: bytes) -> None:
        """A chunk left the cache (evicted or not): its gaps go."""
        self._once.pop(ckey, None)
        self._gaps.pop(ckey, None)

    def evicted(self, ckey: bytes, rec: ChunkRecord) -> None:
        self.history.remember(ckey, rec.heat, rec.last_access)

    def entry_heat(self, ckey: bytes, kind: Fill, now: float, length: int) -> float:
        """The heat a chunk of `length` bytes is indexed with (module doc); its history is
        over."""
        past = self.history.forget(ckey)
        if kind is not Fill.READ:  # LRU stores what is written or warmed too (`missed`: read)
            self.lru.access(ckey, length)
        self._gaps.pop(ckey, None)
        self._once[ckey] = self.accesses
        if kind is Fill.WRITTEN:
            return 0.0
        if kind is Fill.WARM or past is None:
            return 1.0
        return 1.0 + decayed(past[0], past[1], now, self.half_life)
