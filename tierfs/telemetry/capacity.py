"""Capacity history and forecast: `tierfs usage --forecast` (docs/tenants.md).

A supervised service (`CapacityHistory.run`) samples the cache every 5 minutes: bytes
used, pinned, dirty, hot (touched in the last day, outside pins), the budget, per-tenant
cached bytes (the cache's own count), and the fill and eviction counters. Samples are
kept in the index's `capacity` db, downsampled so the history stays bounded whatever the
uptime: every sample of the last 24 h, the last sample of each hour for 30 days
(TIERS; at most 288 + 720 records).

The forecast is a pure function of a list of samples: the least-squares slope of
pinned + dirty + hot bytes over the last week, and from it "full in N days at this rate"
or "not growing". Hot bytes, and the working set per tenant over a day and a week, come
from a bounded hash sample of the chunk index's last-access times (`WorkingSet`): every
chunk key whose hash falls in the sampled 1/2^shift of the key space is remembered with
its length and last access, the shift grows when the sample passes its bound, and a
window's working set is the sampled bytes accessed in it times 2^shift. A sampled chunk
evicted after it was seen stays counted for its window; one filled and evicted between
two samples is missed (an under-estimate for scans shorter than the interval).
"""

from __future__ import annotations

import builtins
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import trio

from ..index.meta import MetaStore

if TYPE_CHECKING:
    from ..cache import ChunkCache
    from ..metrics import Metrics

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 300.0
DAY = 86400.0
WEEK = 7 * DAY


@dataclass(frozen=True)
class Tier:
    name: str
    step_s: float  # one sample kept per step (the last one in it)
    keep_s: float  # samples older than this are dropped


TIERS = (Tier("5m", SAMPLE_INTERVAL_S, DAY), Tier("1h", 3600.0, 30 * DAY))
MAX_SAMPLES = sum(int(t.keep_s // t.step_s) + 1 for t in TIERS)


@dataclass(frozen=True)
class Sample:
    t: float  # epoch seconds
    used: int
    pinned: int
    dirty: int
    hot: int  # estimated bytes accessed in the last day, pinned objects left out
    budget: int
    chunks: int = 0  # in the disk tier
    fills: int = 0  # chunks written to the disk tier since the previous sample (at least)
    evictions: int = 0  # chunks evicted since the previous sample
    tenants: dict[str, int] = field(default_factory=dict)  # cached bytes; {} when unknown

    @property
    def level(self) -> int:
        """What the cache must hold: pinned, unsaved and hot bytes."""
        return self.pinned + self.dirty + self.hot

    def record(self) -> dict:
        return {"t": self.t, "used": self.used, "pinned": self.pinned, "dirty": self.dirty,
                "hot": self.hot, "budget": self.budget, "chunks": self.chunks, "fills": self.fills,
                "evictions": self.evictions, "tenants": dict(self.tenants)}

    @classmethod
    def from_record(cls, r: dict) -> "Sample":
        return cls(float(r["t"]), int(r["used"]), int(r["pinned"]), int(r["dirty"]),
                   int(r.get("hot", 0)), int(r["budget"]), int(r.get("chunks", 0)),
                   int(r.get("fills", 0)), int(r.get("evictions", 0)),
                   {str(k): int(v) for k, v in (r.get("tenants") or {}).items()})


def slot(t: float, tier: Tier) -> int:
    """The step of `tier` a sample at t falls in (its key in the db)."""
    return int(t // tier.step_s)


def downsample(samples: list[Sample], now: float) -> dict[str, list[Sample]]:
    """What each tier keeps of these samples at `now`: the last sample of each step, none
    older than the tier's keep_s. The store does the same thing one sample at a time."""
    kept: dict[str, list[Sample]] = {}
    for tier in TIERS:
        by_slot: dict[int, Sample] = {}
        for s in sorted(samples, key=lambda s: s.t):
            if s.t >= now - tier.keep_s:
                by_slot[slot(s.t, tier)] = s
        kept[tier.name] = [by_slot[k] for k in sorted(by_slot)]
    return kept


def merged(tiers: dict[str, list[Sample]]) -> list[Sample]:
    """One history from the tiers, oldest first: the coarse tier where the fine one has
    nothing, the fine one where it has (no sample twice)."""
    out: dict[float, Sample] = {}
    for name in ("1h", "5m"):
        for s in tiers.get(name, []):
            out[s.t] = s
    return [out[t] for t in sorted(out)]


# ---- the forecast ---------------------------------------------------------------------------


MIN_SAMPLES = 6
MIN_SPAN_S = 3600.0  # an hour of samples before a rate means anything
GROWING = 0.001  # a slope below 0.1% of the budget a day is "not growing"


@dataclass(frozen=True)
class Forecast:
    samples: int
    span_s: float
    level: int  # pinned + dirty + hot bytes in the latest sample
    budget: int
    slope_per_day: float | None  # bytes/day; None: too few samples
    days_to_full: float | None  # None: too few samples or not growing
    verdict: str  # "too few samples" | "not growing" | "full" | "growing"

    def text(self) -> str:
        from ..config import format_size

        if self.verdict == "too few samples":
            return (f"too few samples for a forecast ({self.samples} over "
                    f"{self.span_s / 3600:.1f} h; it needs {MIN_SAMPLES} over an hour)")
        held = f"{format_size(self.level)} pinned, unsaved or hot of {format_size(self.budget)}"
        rate = f"{'+' if (self.slope_per_day or 0) >= 0 else '-'}" \
               f"{format_size(abs(self.slope_per_day or 0))}/day"
        if self.verdict == "full":
            return f"full of pinned, unsaved or hot data now ({held}; {rate})"
        if self.verdict == "not growing":
            return f"not growing ({held}; {rate})"
        return f"full in {self.days_to_full:.1f} days at this rate ({held}; {rate})"


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (x centred: epoch seconds squared lose digits)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def forecast(samples: list[Sample], *, window_s: float = WEEK) -> Forecast:
    """When, at the rate of the last `window_s`, pinned + dirty + hot bytes reach the budget."""
    if not samples:
        return Forecast(0, 0.0, 0, 0, None, None, "too few samples")
    ordered = sorted(samples, key=lambda s: s.t)
    last = ordered[-1]
    recent = [s for s in ordered if s.t >= last.t - window_s]
    span = recent[-1].t - recent[0].t
    if len(recent) < MIN_SAMPLES or span < MIN_SPAN_S:
        return Forecast(len(recent), span, last.level, last.budget, None, None,
                        "too few samples")
    per_day = slope([(s.t, float(s.level)) for s in recent]) * DAY
    if last.level >= last.budget:  # a budget of 0 (no room at all) is full too
        return Forecast(len(recent), span, last.level, last.budget, per_day, 0.0, "full")
    if per_day <= GROWING * max(last.budget, 1):
        return Forecast(len(recent), span, last.level, last.budget, per_day, None,
                        "not growing")
    days = (last.budget - last.level) / per_day
    return Forecast(len(recent), span, last.level, last.budget, per_day, days, "growing")


# ---- the working set ------------------------------------------------------------------------


MAX_TRACKED = 16384  # sampled chunks remembered (each a few dozen bytes)


@dataclass
class _Seen:
    tenant: str
    length: int
    last: float


class WorkingSet:
    """Distinct chunk bytes accessed per tenant in a window, from a bounded hash sample."""

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self.max_tracked = max_tracked
        self.shift = 0  # chunks with hash % 2^shift == 0 are sampled
        self._seen: dict[bytes, _Seen] = {}

    def sampled(self, ckey: bytes) -> bool:
        return zlib.crc32(ckey) & ((1 << self.shift) - 1) == 0

    def saw(self, ckey: bytes, tenant: str, length: int, last_access: float) -> None:
        if not self.sampled(ckey):
            return
        seen = self._seen.get(ckey)
        if seen is None:
            self._seen[ckey] = _Seen(tenant, length, last_access)
            while len(self._seen) > self.max_tracked:
                self.shift += 1  # halve the rate; keep only what the new rate samples
                self._seen = {k: v for k, v in self._seen.items() if self.sampled(k)}
        else:
            seen.last = max(seen.last, last_access)
            seen.tenant, seen.length = tenant, length

    def forget_before(self, t: float) -> None:
        self._seen = {k: v for k, v in self._seen.items() if v.last >= t}

    def bytes(self, since: float, *, skip: Callable[[bytes], bool] = lambda k: False
              ) -> dict[str, int]:
        """Estimated bytes per tenant of chunks accessed at or after `since`."""
        out: dict[str, int] = {}
        for k, v in self._seen.items():
            if v.last >= since and not skip(k):
                out[v.tenant] = out.get(v.tenant, 0) + (v.length << self.shift)
        return out

    def objects(self) -> set[builtins.bytes]:
        return {k[:16] for k in self._seen}

    def __len__(self) -> int:
        return len(self._seen)


# ---- the service ------------------------------------------------------------------------------


class CapacityHistory:
    """Samples the cache into the `capacity` db (run as a supervised service) and answers
    `tierfs usage --forecast`."""

    def __init__(self, meta: MetaStore, cache: "ChunkCache", metrics: "Metrics", *,
                 tenant_of: Callable[[str], str] | None = None,
                 clock: Callable[[], float] = time.time,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.meta = meta
        self.cache = cache
        self.metrics = metrics
        self.tenant_of = tenant_of or (lambda key: "default")
        self.clock = clock
        self.interval_s = interval_s
        self.working_set = WorkingSet()
        self._tenants: dict[bytes, str] = {}  # oid -> tenant, for sampled chunks only
        self._last: tuple[int, float] | None = None  # chunks and the eviction counter then

    async def run(self) -> None:
        while True:
            await self.sample_now()
            await trio.sleep(self.interval_s)

    async def sample_now(self) -> Sample:
        """One sample: the index walk in a worker thread, the rest on the trio thread."""
        now = self.clock()
        seen = await trio.to_thread.run_sync(self._scan_index, self.working_set.shift)
        ws = self.working_set  # changed on the trio thread only: control reads it there
        for ckey, tenant, length, last in seen:
            ws.saw(ckey, tenant, length, last)
        ws.forget_before(now - WEEK)
        live = ws.objects()
        self._tenants = {oid: t for oid, t in self._tenants.items() if oid in live}
        pins = self.cache.pins.objects()
        hot = sum(self.working_set.bytes(now - DAY, skip=lambda k: k[:16] in pins).values())
        chunks = self.cache.chunk_count
        evicted = self.metrics.value("tierfs_cache_evictions_total")
        # no fill counter: the chunk count grew by the fills less what was dropped, so
        # growth plus evictions is a lower bound (evicts on request and corrupt drops aside)
        prev_chunks, prev_evicted = self._last or (chunks, evicted)
        evictions = int(evicted - prev_evicted)
        self._last = (chunks, evicted)
        s = Sample(now, self.cache.used_bytes, self.cache.bytes_of(pins),
                   self.cache.dirty_bytes, hot, self.cache.budget(), chunks=chunks,
                   fills=max(0, chunks - prev_chunks + evictions), evictions=evictions,
                   tenants={t: b.cached for t, b in self.cache.tenant_bytes().items()})
        await trio.to_thread.run_sync(self.store, s)
        return s

    def _scan_index(self, shift: int) -> list[tuple[bytes, str, int, float]]:
        """The sampled chunks of the index (worker thread; the chunk records are at most a
        second behind the cache's)."""
        mask = (1 << shift) - 1
        return [(ckey, self._tenant(ckey[:16]), rec.length, rec.last_access)
                for ckey, rec in self.meta.chunks.all() if zlib.crc32(ckey) & mask == 0]

    def _tenant(self, oid: bytes) -> str:
        tenant = self._tenants.get(oid)
        if tenant is None:
            info = self.meta.chunks.object_info(oid)
            tenant = self.tenant_of(info["key"]) if info and "key" in info else "default"
            self._tenants[oid] = tenant
        return tenant

    def store(self, s: Sample) -> None:
        for tier in TIERS:
            self.meta.capacity.put(tier.name, slot(s.t, tier), s.record(),
                                   drop_before=slot(s.t - tier.keep_s, tier))

    def history(self) -> list[Sample]:
        samples = self.meta.capacity.samples
        tiers = {tier.name: [Sample.from_record(r) for _, r in samples(tier.name)]
                 for tier in TIERS}
        return merged(tiers)

    def working_sets(self) -> dict[str, tuple[int, int]]:
        """tenant -> (bytes accessed in the last day, in the last week), estimated."""
        now = self.clock()
        day, week = self.working_set.bytes(now - DAY), self.working_set.bytes(now - WEEK)
        return {t: (day.get(t, 0), week[t]) for t in sorted(week)}
