#!/usr/bin/env python3
"""Eviction quality: tierfs's placement policy beside plain LRU and Belady's OPT.

    .venv/bin/python bench/evict.py [--cache-chunks N] [--fill-time S]... [--trace NAME]...

Replays chunk-granular access traces (defined in bench/README.md, "Eviction quality")
through tierfs's placement policy itself (tierfs/cache/policy.py, `Placement`: the object
ChunkCache asks), told the events ChunkCache tells it: a read of a cached chunk is a hit
and touches it; a miss is a fill (`fill_started`, `room_for_fill`, then `stored`); a
write reserves room for its unsaved staging copy (`room_for_dirty`), and when its
object's writes end (the file is uploaded) its chunks move into the cache, last first,
each into the room its staging copy held (`hold`, `release_held`, a fill with `held`), as
the write path does; a new Slurm job's first open is told (`opened_by`) as FileIO.open
tells it. The evictions the policy names are carried out without I/O (`carry_out`); the
budget comes from a statvfs stub with plenty of free space, so it is the cache size.
An injected clock advances by fill_time / cache chunks per access.
Prints each trace's read hit ratio beside plain LRU and offline OPT with the same capacity, and
whether tierfs reaches the issue's goal (>= 0.9x OPT, never below LRU); where OPT owes much to
knowing the future, also beside a policy told the trace's structure but not its future
(`Informed`: what an online policy can expect there).

Capacities: tierfs never holds more than floor(high * cache_size / chunk) chunks (it
evicts when a fill would pass `high`, down to `low`); LRU and OPT hold exactly that many,
evicting one chunk at a time, so they never have less room than tierfs. OPT may decline
to cache a chunk (bypass) whose next use is the farthest: an upper bound for any policy.
No I/O, no timing: the figures are counts, the same on every run with the same seed.
Exit status 1 when a trace misses the goal, 2 for bad options.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tierfs.cache.admission import Admission, Fill  # noqa: E402
from tierfs.cache.evictor import Evictor  # noqa: E402
from tierfs.cache.heat import PER_CACHE  # noqa: E402
from tierfs.cache.keys import ObjectVersion  # noqa: E402
from tierfs.cache.policy import Outcome, Placement, carry_out  # noqa: E402
from tierfs.config import MountConfig  # noqa: E402
from tierfs.tenants import DEFAULT  # noqa: E402

_DEFAULTS = MountConfig.model_fields
GOAL = 0.9  # of OPT (issue 15, item 5)
OBJECT_CHUNKS = 64  # chunk ids map to objects of this many chunks (keys as tierfs makes them)
START = 1_700_000_000.0  # the injected clock's epoch


# ---- traces --------------------------------------------------------------------------

@dataclass(frozen=True)
class Informed:
    """What a policy told a trace's structure, not its future, keeps (replay_informed): the
    newest `written` written chunks (the checkpoint a restore reads), and read chunks
    among the first of `keep` that fit beside them (the ones it knows are worth most: the
    most popular; for a shuffled data set any subset is worth the same)."""

    told: str
    keep: tuple[int, ...]
    written: int = 0


@dataclass(frozen=True)
class Trace:
    """Chunk ids in access order; writes[i]: access i writes a new chunk (a fill that is
    not a read: it counts in neither hits nor reads). `informed`: the reference policy
    for a trace whose OPT owes much to knowing the future (None: OPT is the reference)."""

    name: str
    what: str
    chunks: list[int]
    writes: list[bool]
    informed: Informed | None = None
    # accesses before which a Slurm job not seen before opens its first file
    # (Admission.job_opened, as FileIO.open tells it): every trace starts with one
    jobs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.chunks) != len(self.writes):
            raise ValueError("chunks and writes differ in length")
        seen: set[int] = set()
        for c, w in zip(self.chunks, self.writes):
            if w and c in seen:  # a write is a new object version: new chunk keys
                raise ValueError(f"trace {self.name}: chunk {c} written after it was seen")
            seen.add(c)

    @property
    def reads(self) -> int:
        return len(self.writes) - sum(self.writes)


class _Builder:
    """Appends accesses and hands out fresh chunk ids."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.writes: list[bool] = []
        self.jobs: list[int] = [0]  # the job that reads the trace
        self._next = 0

    def job(self) -> None:
        """A new Slurm job opens its first file before the next access."""
        if self.jobs[-1] != len(self.chunks):
            self.jobs.append(len(self.chunks))

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        return ids

    def read(self, ids: list[int] | range) -> None:
        self.chunks.extend(ids)
        self.writes.extend([False] * len(ids))

    def read_shuffled(self, ids: list[int], rng: random.Random) -> list[int]:
        """Read `ids` in a new random order (a shuffled copy); that order."""
        order = ids[:]
        rng.shuffle(order)
        self.read(order)
        return order

    def write(self, ids: list[int]) -> None:
        self.chunks.extend(ids)
        self.writes.extend([True] * len(ids))

    def trace(self, name: str, what: str, informed: Informed | None = None) -> Trace:
        return Trace(name, what, self.chunks, self.writes, informed, tuple(self.jobs))


def epochs(cache: int, rng: random.Random, *, shuffled: bool = False, size: float = 1.5,
           count: int = 8) -> Trace:
    """(a) `count` epochs over a data set of `size` x the cache, in order (or shuffled)."""
    b = _Builder()
    data = b.fresh(int(size * cache))
    for _ in range(count):
        if shuffled:
            data = b.read_shuffled(data, rng)
        else:
            b.read(data)
    order = "each in a new random order" if shuffled else "sequential"
    return b.trace("epochs-shuffled" if shuffled else "epochs",
                   f"{count} epochs over {size}x the cache, {order}")


def jobs(cache: int, rng: random.Random, *, size: float = 0.8, count: int = 3,
         epochs: int = 4) -> Trace:
    """(e) `count` jobs one after another on the node, each `epochs` shuffled epochs over
    a data set of its own of `size` x the cache."""
    b = _Builder()
    for _ in range(count):
        b.job()
        data = b.fresh(int(size * cache))
        for _ in range(epochs):
            data = b.read_shuffled(data, rng)
    return b.trace("jobs", f"{count} jobs in a row, each {epochs} shuffled epochs over a data "
                   f"set of its own of {size}x the cache, each job's first open told to "
                   "admission (untold, a new job's first epoch reads as epochs+pass's pass)")


def epochs_and_pass(cache: int, rng: random.Random, *, size: float = 0.8, before: int = 4,
                    after: int = 4) -> Trace:
    """(f) a job's shuffled epochs over `size` x the cache, with a one-shot pass over as many
    new chunks after the `before`th (an evaluation or preprocessing read). Up to the end
    of the pass, the same accesses as `jobs` up to the end of its second job's first epoch
    (same seed, same ids): an online policy decides the same on both."""
    b = _Builder()
    data = b.fresh(int(size * cache))
    for epoch in range(before + after):
        if epoch == before:
            b.read_shuffled(b.fresh(int(size * cache)), rng)
        data = b.read_shuffled(data, rng)
    return b.trace("epochs+pass", f"{before + after} shuffled epochs over {size}x the cache, "
                   f"a one-shot pass over {size}x new chunks after the {before}th: to the "
                   "pass's end the same accesses as jobs")


def hot_and_scans(cache: int, rng: random.Random, *, readers: int, hot: float = 0.25,
                  scan: float = 2.0, rounds: int = 8) -> Trace:
    """(b) rounds of: the hot set read by `readers` readers in turn, then a one-shot scan
    of new chunks."""
    b = _Builder()
    hot_ids = b.fresh(int(hot * cache))
    for _ in range(rounds):
        for _ in range(readers):
            b.read(hot_ids)
        b.read(b.fresh(int(scan * cache)))
    return b.trace(f"hot+scans x{readers}",
                   f"{rounds} rounds: a hot set of {hot}x the cache read {readers}x, then a "
                   f"one-shot scan of {scan}x")


def checkpoints(cache: int, rng: random.Random, *, data: float = 2.0, ckpt: float = 0.2,
                interval: float = 0.4, saves: int = 3, jobs: int = 10) -> Trace:
    """(c) jobs in a row: restore (read the last checkpoint once), then dataset reads
    (shuffled epochs) with a checkpoint written every `interval` x the cache of reads;
    the job is preempted a random part of an interval after its last save."""
    b = _Builder()
    dataset = b.fresh(int(data * cache))
    per_save = int(interval * cache)
    stream: list[int] = []

    def reads(n: int) -> None:
        nonlocal stream
        while len(stream) < n:
            epoch = dataset[:]
            rng.shuffle(epoch)
            stream += epoch
        b.read(stream[:n])
        stream = stream[n:]

    last: list[int] = []
    for _ in range(jobs):
        b.read(last)
        for _ in range(saves):
            reads(per_save)
            last = b.fresh(int(ckpt * cache))
            b.write(last)
        reads(rng.randrange(per_save))
    return b.trace("checkpoints",
                   f"{jobs} jobs: restore the last checkpoint ({ckpt}x the cache), read a data "
                   f"set of {data}x shuffled, save every {interval}x of reads, {saves} saves, "
                   f"preempted at random",
                   Informed("a restore reads the newest checkpoint; the data set is read in "
                            "random order", tuple(dataset), len(last)))


def zipf(cache: int, rng: random.Random, *, keys: float = 10.0, alpha: float = 1.0,
         length: float = 50.0) -> Trace:
    """(d) independent random reads, P(rank k) ~ 1/k**alpha, ranks shuffled over the ids."""
    b = _Builder()
    ids = b.fresh(int(keys * cache))
    rng.shuffle(ids)
    cum, total = [], 0.0
    for k in range(1, len(ids) + 1):
        total += k ** -alpha
        cum.append(total)
    b.read(rng.choices(ids, cum_weights=cum, k=int(length * cache)))
    return b.trace(f"zipf {alpha}", f"{int(length * cache)} random reads over {keys}x the "
                   f"cache, zipf alpha {alpha}",
                   Informed("the popularity of every chunk", tuple(ids)))


TRACES: dict[str, Callable[[int, random.Random], Trace]] = {
    "epochs": epochs,
    "epochs-shuffled": lambda c, r: epochs(c, r, shuffled=True),
    "epochs-shuffled-5x": lambda c, r: epochs(c, r, shuffled=True, size=5.0),
    "hot+scans": lambda c, r: hot_and_scans(c, r, readers=2),
    "hot+scans-once": lambda c, r: hot_and_scans(c, r, readers=1),
    "checkpoints": checkpoints,
    "zipf": zipf,
    "jobs": jobs,
    "epochs+pass": epochs_and_pass,
}


# ---- the cache being measured and the two references ---------------------------------

@dataclass(frozen=True)
class Shape:
    """One cache: its size in chunks and the policy settings (tierfs's defaults)."""

    chunks: int
    chunk_bytes: int = _DEFAULTS["chunk_size"].default
    high: float = _DEFAULTS["evict_high"].default
    low: float = _DEFAULTS["evict_low"].default
    half_life: float = _DEFAULTS["heat_half_life"].default
    # seconds of the injected clock to read one cache's worth of chunks: what sets recency
    # against the half-life (1024 s: a 1 TiB cache read at 1 GiB/s)
    fill_time: float = 1024.0
    # chunk ids below this are in pinned objects (whole objects of OBJECT_CHUNKS chunks, as
    # `tierfs warm --pin` pins files): never evicted; LRU and OPT pin nothing
    pinned: int = 0

    @property
    def step(self) -> float:
        """Seconds between two accesses."""
        return self.fill_time / self.chunks

    @property
    def budget(self) -> int:
        return self.chunks * self.chunk_bytes

    @property
    def capacity(self) -> int:
        """The most chunks tierfs ever holds: LRU's and OPT's capacity."""
        return int(self.high * self.budget) // self.chunk_bytes

    @property
    def pinned_objects(self) -> int:
        return self.pinned // OBJECT_CHUNKS

    @property
    def keep(self) -> int:
        """Chunks left after a fill past `high` evicts (Evictor: down to low * budget less
        the incoming chunk)."""
        return int((self.low * self.budget - self.chunk_bytes) // self.chunk_bytes)


@dataclass
class Replay:
    hits: int = 0
    reads: int = 0
    cached: set[int] = field(default_factory=set)  # chunk ids cached at the end
    hit: bytearray = field(default_factory=bytearray)  # per access: 1 if a read hit

    def access(self, write: bool, hit: bool) -> None:
        self.reads += not write
        self.hits += hit
        self.hit.append(hit)

    @property
    def ratio(self) -> float:
        return self.hits / self.reads if self.reads else 0.0


def object_chunk(cid: int, chunk_bytes: int) -> tuple[ObjectVersion, int]:
    """The object version and chunk index a chunk id stands for."""
    name = f"bench/{cid // OBJECT_CHUNKS}"
    return ObjectVersion("bench", name, "etag", OBJECT_CHUNKS * chunk_bytes), cid % OBJECT_CHUNKS


def _plenty_of_space(path: str) -> os.statvfs_result:
    """A 1 PiB filesystem, half empty: the free-space guard never binds."""
    frsize, blocks = 4096, (1 << 50) // 4096
    return os.statvfs_result((frsize, frsize, blocks, blocks // 2, blocks // 2, 1 << 20,
                              1 << 20, 1 << 20, 0, 255))


def replay_tierfs(trace: Trace, shape: Shape) -> Replay:
    """The trace through tierfs's placement policy (tierfs/cache/policy.py, `Placement`),
    told the events ChunkCache tells it and carrying out its evictions without I/O."""
    evictor = Evictor("/nonexistent/tierfs-bench", cache_size=shape.budget,
                      min_free_ratio=_DEFAULTS["min_free_ratio"].default, high=shape.high,
                      low=shape.low, half_life=shape.half_life, statvfs=_plenty_of_space)
    length = shape.chunk_bytes
    policy = Placement(Admission(shape.half_life, shape.chunks, shape.capacity * length),
                       budget=evictor.budget, high=shape.high, low=shape.low,
                       half_life=shape.half_life,
                       pinned={object_chunk(n * OBJECT_CHUNKS, length)[0].oid
                               for n in range(shape.pinned_objects)})
    keys: dict[int, bytes] = {}
    ids: dict[bytes, int] = {}
    out = Replay()
    writing, staged = None, []  # the object being written, its chunks' keys (unsaved)

    def drop(key: bytes, why: str | None) -> None:  # ChunkCache.drop(evicted=True)
        policy.dropped(key, evicted=True)

    def fill(key: bytes, kind: Fill, now: float, held: bool = False) -> None:
        # ChunkCache.filling (and the chunk file written at once)
        if policy.fill_started(key, length, kind, DEFAULT, now, held=held):
            if carry_out(policy.room_for_fill(key, now), drop) is Outcome.STORED:
                policy.stored(key, (), now)
            policy.fill_ended(key)

    def uploaded(now: float) -> None:
        # writeback._settle: ChunkCache.hold, then each chunk moves into its staging copy's
        # room (ChunkCache.fill(held=)), last first
        if staged:
            policy.hold(DEFAULT, len(staged) * length)
        for key in reversed(staged):
            policy.release_held(DEFAULT, length)
            fill(key, Fill.WRITTEN, now, held=True)
        staged.clear()

    jobs = set(trace.jobs)
    for i, (cid, write) in enumerate(zip(trace.chunks, trace.writes)):
        now = START + i * shape.step
        if i in jobs:  # FileIO.open -> ChunkCache.opened_by
            policy.opened_by(f"job:{i}")
        if writing is not None and not (write and cid // OBJECT_CHUNKS == writing):
            uploaded(now)  # the file is closed
            writing = None
        key = keys.get(cid)
        if key is None:
            obj, n = object_chunk(cid, length)
            key = keys[cid] = obj.chunk_key(n)
            ids[key] = cid
        hit = not write and key in policy.chunks
        out.access(write, hit)
        if hit:  # ChunkCache.read(touch=True) -> touch()
            policy.touch(key, now)
        elif write:  # writeback._materialize -> ChunkCache.reserve_dirty: its staging copy
            if carry_out(policy.room_for_dirty(DEFAULT, length), drop) is Outcome.STORED:
                staged.append(key)
                writing = cid // OBJECT_CHUNKS
        else:  # a miss: the chunk is fetched and filled
            fill(key, Fill.READ, now)
    uploaded(START + len(trace.chunks) * shape.step)
    out.cached = {ids[k] for k in policy.chunks}
    return out


def replay_lru(trace: Trace, capacity: int, keep: int | None = None) -> Replay:
    """Plain LRU of `capacity` chunks; a write caches the new chunk as most recent. With
    `keep`, a fill that finds it full evicts down to `keep` chunks (tierfs's watermarks)."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = Replay()
    keep = capacity - 1 if keep is None else keep
    for cid, write in zip(trace.chunks, trace.writes):
        out.access(write, cid in lru)
        if cid in lru:
            lru.move_to_end(cid)
            continue
        if capacity <= 0:
            continue
        if len(lru) >= capacity:
            while len(lru) > keep:
                lru.popitem(last=False)
        lru[cid] = None
    out.cached = set(lru)
    return out


def next_uses(chunks: list[int]) -> list[int]:
    """For each access, the position of the next access of the same chunk (len: never)."""
    never = len(chunks)
    nxt, later = [never] * never, {}
    for i in range(never - 1, -1, -1):
        nxt[i] = later.get(chunks[i], never)
        later[chunks[i]] = i
    return nxt


def replay_opt(trace: Trace, capacity: int) -> Replay:
    """Belady's MIN with bypass: on a miss with the cache full, the chunk whose next use
    is farthest goes, the incoming one included (then it is not cached)."""
    nxt = next_uses(trace.chunks)
    never = len(nxt)
    cached: dict[int, int] = {}  # chunk -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, chunk), stale entries skipped lazily
    out = Replay()
    for i, (cid, write) in enumerate(zip(trace.chunks, trace.writes)):
        out.access(write, cid in cached)
        if cid in cached:
            pass
        elif nxt[i] == never or capacity <= 0:
            continue  # never used again: nothing to gain from caching it
        elif len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nxt[i]:
                continue  # every cached chunk is needed before this one: bypass
            del cached[heapq.heappop(heap)[1]]
        cached[cid] = nxt[i]
        heapq.heappush(heap, (-nxt[i], cid))
    out.cached = set(cached)
    return out


def replay_informed(trace: Trace, capacity: int) -> Replay | None:
    """The trace's informed policy (Informed) holding at most `capacity` chunks; None if
    the trace has none. It caches a chunk when it is read or written, never before."""
    told = trace.informed
    if told is None:
        return None
    room = min(told.written, capacity)
    keep = set(told.keep[:capacity - room])
    cached: set[int] = set()
    written: deque[int] = deque()
    out = Replay()
    for cid, write in zip(trace.chunks, trace.writes):
        out.access(write, cid in cached)
        if write and room:
            if len(written) == room:
                cached.discard(written.popleft())
            written.append(cid)
            cached.add(cid)
        elif not write and cid in keep:
            cached.add(cid)
    out.cached = cached
    return out


# ---- the table -----------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    trace: Trace
    shape: Shape
    tierfs: Replay
    lru: Replay
    opt: Replay
    lru_watermarks: Replay
    informed: Replay | None

    @property
    def vs_opt(self) -> float | None:
        return self.tierfs.hits / self.opt.hits if self.opt.hits else None

    @property
    def vs_lru(self) -> float | None:
        return self.tierfs.hits / self.lru.hits if self.lru.hits else None

    @property
    def vs_informed(self) -> float | None:
        return self.tierfs.hits / self.informed.hits if self.informed and self.informed.hits \
            else None

    @property
    def informed_vs_opt(self) -> float | None:
        return self.informed.hits / self.opt.hits if self.informed and self.opt.hits else None

    @property
    def passed(self) -> bool:
        return self.tierfs.hits >= GOAL * self.opt.hits and self.tierfs.hits >= self.lru.hits


def measure(trace: Trace, shape: Shape) -> Row:
    return Row(trace, shape, replay_tierfs(trace, shape), replay_lru(trace, shape.capacity),
               replay_opt(trace, shape.capacity),
               replay_lru(trace, shape.capacity, shape.keep),
               replay_informed(trace, shape.capacity))


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: list[Row]) -> Iterator[str]:
    cols = ["trace", "cache", "accesses", "tierfs", "LRU", "OPT", "tierfs/OPT", "tierfs/LRU",
            "result", "LRU, watermarks", "informed/OPT", "tierfs/informed"]
    data = [[r.trace.name, f"{r.shape.chunks} chunks", f"{len(r.trace.chunks)}",
             f"{r.tierfs.ratio:.3f}", f"{r.lru.ratio:.3f}", f"{r.opt.ratio:.3f}",
             _ratio(r.vs_opt), _ratio(r.vs_lru), "PASS" if r.passed else "MISS",
             f"{r.lru_watermarks.ratio:.3f}", _ratio(r.informed_vs_opt),
             _ratio(r.vs_informed)]
            for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols)]
    right = set(range(1, 8)) | {9, 10, 11}

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    yield line(cols)
    yield "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    yield from (line(d) for d in data)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        sys.stderr.write(f"evict.py: error: {message} (see --help)\n")
        sys.exit(2)


def make_trace(name: str, cache: int, seed: int) -> Trace:
    """The named trace for a cache of `cache` chunks (deterministic for a seed)."""
    return replace(TRACES[name](cache, random.Random(seed)), name=name)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-chunks", type=int, default=1000,
                    help="cache size in chunks (default 1000)")
    ap.add_argument("--fill-time", type=float, action="append",
                    help="seconds the clock takes to read one cache's worth of chunks "
                         "(default 1024: a 1 TiB cache at 1 GiB/s); repeat for one table each")
    ap.add_argument("--pin", type=int, default=0, metavar="CHUNKS",
                    help="tierfs only: pin the objects of the first CHUNKS chunk ids (whole "
                         f"objects of {OBJECT_CHUNKS}), as `tierfs warm --pin` of part of a "
                         "data set would; the data sets are the first ids of their traces")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--trace", action="append", choices=list(TRACES),
                    help="only this trace (repeatable; default: all)")
    args = ap.parse_args(argv)
    if not 40 <= args.cache_chunks <= 10000:
        ap.error("--cache-chunks must be 40 - 10000 (the watermarks are 5% apart; the zipf "
                 "trace is 50x the cache)")
    fill_times = args.fill_time or [Shape(args.cache_chunks).fill_time]
    if not 0 <= args.pin <= args.cache_chunks:
        ap.error("--pin must be 0 - the cache size in chunks")
    if not all(0 < f < float("inf") for f in fill_times):
        ap.error("--fill-time must be a number of seconds > 0")
    start = time.monotonic()
    traces = [make_trace(name, args.cache_chunks, args.seed) for name in args.trace or TRACES]
    passed, informed = True, {}
    for fill_time in fill_times:
        shape = Shape(args.cache_chunks, fill_time=fill_time, pinned=args.pin)
        rows = [measure(trace, shape) for trace in traces]
        passed &= all(r.passed for r in rows)
        informed.update((r.trace.name, r.informed_vs_opt) for r in rows)  # same at any clock
        notes = [f"seed {args.seed}"]
        if shape.pinned_objects:
            notes.append(f"tierfs with chunks 0-{shape.pinned_objects * OBJECT_CHUNKS - 1} "
                         "pinned")
        print(f"\neviction quality, read hit ratio: cache {shape.chunks} chunks, one cache of "
              f"reads every {fill_time:g} s (heat half-life {shape.half_life:g} s, or "
              f"{PER_CACHE:g} x the time a cache of reads takes if longer), watermarks"
              f" {shape.high}/{shape.low}; " + "; ".join(notes))
        print(f"LRU and OPT hold {shape.capacity} chunks (tierfs's most); LRU, watermarks: "
              f"evicts down to {shape.keep} as tierfs; informed: a policy told the trace's "
              f"structure, not its future (below); goal >= {GOAL}x OPT and >= LRU")
        for text in table(rows):
            print(text)
    print()
    for trace in traces:
        writes = len(trace.chunks) - trace.reads
        print(f"  {trace.name}: {trace.what}" + (f"; {writes} of the accesses write" if writes
                                                  else ""))
        share = informed.get(trace.name)
        if trace.informed and share is not None:
            print(f"    informed: told {trace.informed.told}: {share:.3f}x OPT" +
                  (f", so no policy that does not know the future is likely to reach {GOAL}x"
                   if share < GOAL else ""))
    print(f"({time.monotonic() - start:.1f} s)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
