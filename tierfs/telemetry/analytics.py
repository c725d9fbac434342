"""Access analytics: where reads go, per prefix and per Slurm job (docs/report.md).

A prefix is the first `levels` path levels of a file under the mount (2 by default:
"data/train/"); a file above that depth counts for its own directory ("data/", "" for
the mount's root). Per prefix the analytics keep:

- bytes read by where they came from (memory, disk, peer, backend);
- chunk accesses (a handle's first read of a chunk: the unit the cache's heat counts) and
  re-reads among them: accesses of a chunk that was read before, i.e. found in the cache,
  or fetched from the store again (seen in a bounded memory of fetched chunks, which also
  measures eviction quality: a chunk fetched twice was evicted and wanted back);
- LIST and HEAD requests the namespace sent for it (metadata pressure);
- last read, last metadata request, and a decayed score of bytes read (half-life
  `half_life_s`) that ranks the hot prefixes.

Bounded: at most `max_prefixes` prefixes (a new one evicts the lowest decayed score), at
most `max_jobs` jobs for `job_window_s` after their last read, at most `max_job_files`
files per job (then `truncated`), `FETCHED_MEMORY` chunk keys. The running totals are
sampled into a downsampled series (SERIES_TIERS, as tierfs/telemetry/capacity.py keeps its history:
every flush's point kept per 5 minutes for a day, per hour for 30 days).

The hot path (`read`, `meta_request`) is a few dict updates and one pow: no I/O. The
flusher (`run_flusher`, supervised by the core) writes what changed to the index's
`analytics` database every FLUSH_INTERVAL_S; a new Analytics starts from what was stored
(the index is a cache: a record that does not parse is dropped, never fatal).

Cached and total bytes per prefix, the cold list and the cache's composition by heat are
not counted on the hot path: `cache_view` walks the chunk index and the namespace's file
records when a report asks (a worker thread).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import trio

from ..cache.heat import decayed
from ..index.meta import MetaStore

log = logging.getLogger(__name__)

CACHED = ("memory", "disk")
FLUSH_INTERVAL_S = 30.0
FETCHED_MEMORY = 32768  # chunk keys remembered as fetched (about 100 bytes each)
NAMES_MEMORY = 65536  # object keys whose prefix is remembered (cleared when full)
# a second fetch of a chunk this soon after the first is another reader joining the same
# flight (both see "backend"), not an eviction followed by a re-fetch
JOINED_FLIGHT_S = 5.0
DAY = 86400.0
SERIES_TIERS = (("5m", 300.0, DAY), ("1h", 3600.0, 30 * DAY))  # name, step, kept for
_PREFIX, _JOB, _SERIES, _TOTALS = "prefix/", "job/", "series/", "totals"


def cached_share(read: dict[str, int]) -> float | None:
    """The share of bytes read that the memory or disk tier served (None: nothing read)."""
    total = sum(read.values())
    return (read.get("memory", 0) + read.get("disk", 0)) / total if total else None


@dataclass
class Counts:
    """Running totals (per prefix and for the whole mount)."""
    read: dict[str, int] = field(default_factory=dict)  # source -> bytes
    accesses: int = 0
    rereads: int = 0
    fetches: int = 0  # chunk accesses served by the store or a peer
    refetches: int = 0  # of those, chunks fetched before (evicted, then wanted again)
    lists: int = 0
    heads: int = 0

    def bytes_read(self) -> int:
        return sum(self.read.values())

    def hit_ratio(self) -> float | None:
        return cached_share(self.read)

    def reread_ratio(self) -> float | None:
        return None if self.accesses == 0 else self.rereads / self.accesses

    def _fields(self) -> dict[str, Any]:
        return {"read": dict(self.read), "accesses": self.accesses, "rereads": self.rereads,
                "fetches": self.fetches, "refetches": self.refetches, "lists": self.lists,
                "heads": self.heads}

    @staticmethod
    def _parse(raw: Any) -> dict[str, Any]:  # JSON: a wrong shape raises, callers catch it
        return {"read": {str(k): int(v) for k, v in raw["read"].items() if int(v) >= 0},
                **{k: max(0, int(raw.get(k, 0))) for k in
                   ("accesses", "rereads", "fetches", "refetches", "lists", "heads")}}


@dataclass
class PrefixStats(Counts):
    last_read: float = 0.0  # epoch seconds
    last_meta: float = 0.0
    score: float = 0.0  # decayed bytes read, as of `at`
    at: float = 0.0

    def heat(self, now: float, half_life_s: float) -> float:
        return decayed(self.score, self.at, now, half_life_s)

    def to_json(self) -> dict[str, Any]:
        return {**self._fields(), "last_read": self.last_read, "last_meta": self.last_meta,
                "score": self.score, "at": self.at}

    @classmethod
    def from_json(cls, raw: Any) -> "PrefixStats | None":
        try:
            return cls(**cls._parse(raw), last_read=float(raw["last_read"]),
                       last_meta=float(raw["last_meta"]), score=float(raw["score"]),
                       at=float(raw["at"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclass
class FileRead:
    path: str  # relative to the mount
    etag: str  # the version read
    size: int
    last: float  # when the job last read it


@dataclass
class JobFiles:
    """The files one Slurm job read (for `tierfs report --manifest --job`)."""
    job: str
    first: float = 0.0
    last: float = 0.0
    files: dict[str, FileRead] = field(default_factory=dict)  # path -> version read
    truncated: bool = False  # more files were read than the bound keeps

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "first": self.first, "last": self.last,
                "truncated": self.truncated,
                "files": [[f.path, f.etag, f.size, f.last] for f in self.files.values()]}

    @classmethod
    def from_json(cls, raw: Any) -> "JobFiles | None":
        try:
            files = {str(p): FileRead(str(p), str(e), int(s), float(t))
                     for p, e, s, t in raw["files"]}
            return cls(str(raw["job"]), float(raw["first"]), float(raw["last"]), files,
                       bool(raw["truncated"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


@dataclass(frozen=True)
class Point:
    """The mount's running totals at one moment (the series behind the report's plots)."""
    t: float
    read: dict[str, int]
    accesses: int = 0
    rereads: int = 0
    fetches: int = 0
    refetches: int = 0
    lists: int = 0
    heads: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "read": dict(self.read)}

    @classmethod
    def from_json(cls, raw: Any) -> "Point | None":
        try:
            return cls(float(raw["t"]), **Counts._parse(raw))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def prefix_of(path: str, levels: int) -> str:
    """The first `levels` directory levels of a path relative to the mount, with a
    trailing "/" ("" is the mount's root); a file less deep counts for its directory."""
    parts = path.split("/", levels)
    return "/".join(parts[:-1]) + "/" if len(parts) > 1 else ""


class Analytics:
    def __init__(self, meta: MetaStore, *, root_prefix: str = "", levels: int = 2,
                 max_prefixes: int = 1000, half_life_s: float = 3600.0,
                 max_jobs: int = 200, max_job_files: int = 10_000,
                 job_window_s: float = 30 * DAY,
                 clock: Callable[[], float] = time.time) -> None:
        self.meta = meta
        self.root_prefix = root_prefix
        self.levels = levels
        self.max_prefixes = max_prefixes
        self.half_life_s = half_life_s
        self.max_jobs = max_jobs
        self.max_job_files = max_job_files
        self.job_window_s = job_window_s
        self.clock = clock
        self.totals = Counts()
        self._prefixes: dict[str, PrefixStats] = {}
        self._jobs: OrderedDict[str, JobFiles] = OrderedDict()  # least recently active first
        self._fetched: OrderedDict[bytes, float] = OrderedDict()  # chunk key -> first fetch
        self._names: dict[str, tuple[str, str]] = {}  # key -> (path, prefix): no split per read
        self._changed: set[str] = set()  # database keys to write at the next flush
        self._dropped: set[str] = set()  # database keys to delete at the next flush
        self._restore()

    # ---- the hot path ------------------------------------------------------------------

    def _rel(self, key: str) -> str:
        return key[len(self.root_prefix):] if key.startswith(self.root_prefix) else key

    def read(self, key: str, etag: str, size: int, ckey: bytes, source: str, n: int,
             first: bool, reader: str | None = None) -> None:
        """`n` bytes of chunk `ckey` of object `key` (version `etag`, `size` bytes) were
        returned to a reader from `source`; `first`: the handle's first read of the chunk
        (an access); `reader`: "job:N" and the like (tierfs/telemetry/callers.py), or None."""
        now = self.clock()
        names = self._names.get(key)
        if names is None:
            if len(self._names) >= NAMES_MEMORY:
                self._names.clear()
            path = self._rel(key)
            names = self._names[key] = (path, prefix_of(path, self.levels))
        path = names[0]
        p = self._prefix(names[1])
        for c in (p, self.totals):
            c.read[source] = c.read.get(source, 0) + n
        p.last_read = now
        # the decayed score, inline (decayed()): a read of the same instant adds only
        p.score = (p.score if now <= p.at else
                   p.score * 2.0 ** ((p.at - now) / self.half_life_s)) + n
        p.at = now
        if first:
            self._access(p, ckey, source, now)
            if reader is not None and reader.startswith("job:"):
                self._job_read(reader[4:], path, etag, size, now)
            elif reader is not None and reader.startswith("pod:"):
                # kept under "pod:UID" beside the job ids: tierfs-csi's warm_auto asks
                # what the last pod of a workload read
                self._job_read(reader, path, etag, size, now)

    def _access(self, p: PrefixStats, ckey: bytes, source: str, now: float) -> None:
        again = source in CACHED
        if not again:
            seen = self._fetched.get(ckey)
            if seen is None:
                self._fetched[ckey] = now
                if len(self._fetched) > FETCHED_MEMORY:
                    self._fetched.popitem(last=False)
            else:
                self._fetched.move_to_end(ckey)
            refetch = seen is not None and now - seen >= JOINED_FLIGHT_S
            again = refetch
            for c in (p, self.totals):
                c.fetches += 1
                c.refetches += refetch
        for c in (p, self.totals):
            c.accesses += 1
            c.rereads += again

    def meta_request(self, op: str, key: str) -> None:
        """The namespace sent a LIST ("list") or HEAD ("head") for `key` (an object key or
        a listed prefix)."""
        p = self._prefix(prefix_of(self._rel(key), self.levels))
        p.last_meta = self.clock()
        if op == "list":
            p.lists += 1
            self.totals.lists += 1
        else:
            p.heads += 1
            self.totals.heads += 1

    def _prefix(self, name: str) -> PrefixStats:
        p = self._prefixes.get(name)
        if p is None:
            if len(self._prefixes) >= self.max_prefixes:
                self._evict_prefix()
            p = self._prefixes[name] = PrefixStats()
            self._dropped.discard(_PREFIX + name)
        self._changed.add(_PREFIX + name)
        return p

    def _evict_prefix(self) -> None:
        """Forget the prefix with the lowest decayed score (a linear scan: new prefixes
        are rare next to reads of known ones)."""
        now = self.clock()
        name = min(self._prefixes, key=lambda k: (self._prefixes[k].heat(now, self.half_life_s),
                                                  self._prefixes[k].last_meta))
        del self._prefixes[name]
        self._changed.discard(_PREFIX + name)
        self._dropped.add(_PREFIX + name)

    def _job_read(self, job: str, path: str, etag: str, size: int, now: float) -> None:
        j = self._jobs.get(job)
        if j is None:
            j = self._jobs[job] = JobFiles(job, first=now)
            self._dropped.discard(_JOB + job)
            if len(self._jobs) > self.max_jobs:
                self._drop_job(next(iter(self._jobs)))
        else:
            self._jobs.move_to_end(job)
        j.last = now
        f = j.files.get(path)
        if f is not None:
            f.etag, f.size, f.last = etag, size, now
        elif len(j.files) < self.max_job_files:
            j.files[path] = FileRead(path, etag, size, now)
        else:
            j.truncated = True
        self._changed.add(_JOB + job)

    def _drop_job(self, job: str) -> None:
        del self._jobs[job]
        self._changed.discard(_JOB + job)
        self._dropped.add(_JOB + job)

    # ---- queries -----------------------------------------------------------------------

    def _expire_jobs(self) -> None:
        horizon = self.clock() - self.job_window_s
        for job in [k for k, j in self._jobs.items() if j.last < horizon]:  # a few hundred
            self._drop_job(job)

    def job(self, job: str, since: float | None = None) -> JobFiles | None:
        """What job `job` read (at or after `since`, epoch seconds), or None if it is not
        known (never read through this mount, or past the window)."""
        self._expire_jobs()
        j = self._jobs.get(job)
        if j is None:
            return None
        files = {p: FileRead(**asdict(f)) for p, f in j.files.items()
                 if since is None or f.last >= since}
        return JobFiles(j.job, j.first, j.last, files, j.truncated)

    def prefixes(self) -> dict[str, PrefixStats]:
        return {name: PrefixStats(**{**asdict(p), "read": dict(p.read)})
                for name, p in self._prefixes.items()}

    def hot(self, k: int) -> list[tuple[str, float]]:
        """The top `k` prefixes by decayed bytes read: (prefix, score now)."""
        now = self.clock()
        ranked = sorted(((p.heat(now, self.half_life_s), name)
                         for name, p in self._prefixes.items()), reverse=True)
        return [(name, score) for score, name in ranked[:k] if score > 0]

    def point(self) -> Point:
        t = self.totals
        return Point(self.clock(), dict(t.read), t.accesses, t.rereads, t.fetches,
                     t.refetches, t.lists, t.heads)

    def stored_series(self) -> list[Point]:
        """The stored points, oldest first (the hourly tier where the 5-minute one has
        nothing). Reads the index only: a worker thread may run it."""
        out: dict[float, Point] = {}
        for name, _, _ in reversed(SERIES_TIERS):
            for _, raw in self.meta.analytics.records(f"{_SERIES}{name}/"):
                pt = Point.from_json(raw)
                if pt is not None:
                    out[pt.t] = pt
        return [out[t] for t in sorted(out)]

    def series(self) -> list[Point]:
        """The stored points, then the current totals."""
        now = self.point()
        return [p for p in self.stored_series() if p.t < now.t] + [now]

    # ---- the cache's side (a worker thread, when a report asks) --------------------------

    def cache_view(self, pinned: set[bytes], half_life_s: float, now: float,
                   wanted: AbstractSet[str] = frozenset()) -> "CacheView":
        """Cached bytes per prefix (with their newest access), composition by heat, the
        heat histogram (bytes), total bytes per prefix from the namespace's file records:
        one read-only walk of the index (at most a second behind), its result bounded by
        the prefixes, not the chunks. Total bytes are summed for the `wanted` prefixes and
        the cached ones only. Touches no state of this object but its settings: a worker
        thread runs it while reads go on."""
        view = CacheView()
        paths: dict[bytes, str | None] = {}
        for ckey, rec in self.meta.chunks.all():
            oid = ckey[:16]
            if oid not in paths:
                info = self.meta.chunks.object_info(oid)
                paths[oid] = self._rel(info["key"]) if info and "key" in info else None
            path = paths[oid]
            name = prefix_of(path, self.levels) if path is not None else "?"
            c = view.cached.setdefault(name, [0, 0.0])
            c[0] += rec.length
            c[1] = max(c[1], rec.last_access)
            heat = decayed(rec.heat, rec.last_access, now, half_life_s)
            view.heat[bisect.bisect_right(HEAT_EDGES, heat)] += rec.length
            band = "pinned" if oid in pinned else heat_band(heat)
            view.by_heat[band] = view.by_heat.get(band, 0) + rec.length
        wanted = set(wanted) | view.cached.keys()
        for key, size in self.meta.inodes.files():
            if key.startswith(self.root_prefix):
                name = prefix_of(self._rel(key), self.levels)
                if name in wanted:
                    view.total[name] = view.total.get(name, 0) + size
        return view

    # ---- persistence -------------------------------------------------------------------

    def _restore(self) -> None:
        try:
            records = self.meta.analytics.records()
        except Exception as exc:  # noqa: BLE001 - the analytics are a report: losing them is all
            log.warning("analytics kept in the index could not be read (%s); counting from "
                        "zero", exc)
            return
        jobs = []
        for key, raw in records:
            if key.startswith(_PREFIX):
                p = PrefixStats.from_json(raw)
                if p is not None:
                    self._prefixes[key[len(_PREFIX):]] = p
                    continue
            elif key.startswith(_JOB):
                j = JobFiles.from_json(raw)
                if j is not None:
                    jobs.append((j.last, j.job, j))
                    continue
            elif key == _TOTALS:
                try:
                    self.totals = Counts(**Counts._parse(raw))
                    continue
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass
            elif key.startswith(_SERIES) and Point.from_json(raw) is not None:
                continue
            self._dropped.add(key)  # not a record of ours: the index is a cache
        for _, job, j in sorted(jobs):
            self._jobs[job] = j
        while len(self._jobs) > self.max_jobs:
            self._drop_job(next(iter(self._jobs)))
        while len(self._prefixes) > self.max_prefixes:
            self._evict_prefix()
        self._expire_jobs()

    def _take_changes(self) -> tuple[dict[str, Any], set[str]]:
        """What the next flush writes: changed records (copies: the writer thread must not
        race later reads), the totals and a point of the series, and the deletes."""
        self._expire_jobs()
        puts: dict[str, Any] = {}
        for key in self._changed:
            if key.startswith(_PREFIX):
                p = self._prefixes.get(key[len(_PREFIX):])
                if p is not None:
                    puts[key] = p.to_json()
            else:
                j = self._jobs.get(key[len(_JOB):])
                if j is not None:
                    puts[key] = j.to_json()
        point = self.point()
        puts[_TOTALS] = point.to_json()
        for name, step, _ in SERIES_TIERS:  # the step's earlier point is replaced
            puts[f"{_SERIES}{name}/{int(point.t // step):012d}"] = puts[_TOTALS]
        deletes = self._dropped - puts.keys()
        self._changed, self._dropped = set(), set()
        return puts, deletes

    def _write(self, puts: dict[str, Any], deletes: set[str], now: float) -> None:
        """One flush's writes, with the series' points past their tier's keep (a worker
        thread)."""
        for name, step, keep in SERIES_TIERS:
            oldest = int((now - keep) // step)
            deletes |= {k for k, _ in self.meta.analytics.records(f"{_SERIES}{name}/")
                        if int(k.rpartition("/")[2]) < oldest}
        self.meta.analytics.put(puts, deletes)

    async def flush(self) -> None:
        """Write what changed since the last flush (one LMDB transaction, in a thread)."""
        puts, deletes = self._take_changes()
        written = False
        try:
            await trio.to_thread.run_sync(self._write, puts, set(deletes), self.clock())
            written = True
        finally:
            if not written:  # the next flush writes it (with newer values, if any)
                self._changed |= {k for k in puts if k.startswith((_PREFIX, _JOB))}
                self._dropped |= deletes

    async def run_flusher(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        while True:
            await trio.sleep(interval_s)
            await self.flush()


HEAT_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # the heat histogram's bounds
HEAT_BANDS = ("cold (<0.5)", "warm (0.5-2)", "hot (2-8)", "very hot (8+)")


def heat_band(heat: float) -> str:
    """A chunk's decayed heat (reads per handle, decayed) as one of HEAT_BANDS."""
    return HEAT_BANDS[0] if heat < 0.5 else HEAT_BANDS[1] if heat < 2 else \
        HEAT_BANDS[2] if heat < 8 else HEAT_BANDS[3]


@dataclass
class CacheView:
    cached: dict[str, list] = field(default_factory=dict)  # prefix -> [bytes, newest access]
    total: dict[str, int] = field(default_factory=dict)  # prefix -> bytes of known files
    by_heat: dict[str, int] = field(default_factory=dict)  # band (or "pinned") -> bytes
    # cached bytes per heat bucket: [0, HEAT_EDGES[0]), ..., [HEAT_EDGES[-1], inf)
    heat: list[int] = field(default_factory=lambda: [0] * (len(HEAT_EDGES) + 1))
