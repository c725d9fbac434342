"""The daemon's side of `tierfs report` (docs/report.md): one answer assembled from what
the mount already keeps - the access analytics (tierfs/telemetry/analytics.py), the cache, the
metrics registry (read latency and stall histograms, evictions), the stall log
(tierfs/telemetry/stalls.py) and the capacity history (tierfs/telemetry/capacity.py) - typed by
protocol.ReportResult. Nothing here is kept: a report is computed when asked, the walk
of the chunk index in a worker thread.

The files a job read (`tierfs report --manifest --job`) come from the analytics too
(`job_files`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import trio

from ..cache import ChunkCache
from ..cache.tier import SOURCES
from ..metrics import Metrics
from ..protocol import JobFilesRequest, ReportRequest
from .analytics import HEAT_EDGES, Analytics, CacheView, Point, cached_share

if TYPE_CHECKING:
    from .capacity import CapacityHistory
    from .stalls import StallLog



async def build_report(req: ReportRequest, *, info: dict[str, Any], analytics: Analytics,
                       cache: ChunkCache, metrics: Metrics,
                       capacity: "CapacityHistory | None" = None,
                       stalls: "StallLog | None" = None) -> dict[str, Any]:
    now = analytics.clock()  # the core's clock (a test's fake one too)
    await cache.flush_index()  # the walk below sees what was read up to now
    half_life = cache.half_life.value
    pinned_oids = set(cache.pins.objects())
    prefixes = analytics.prefixes()  # copies, taken on this thread
    view = await trio.to_thread.run_sync(analytics.cache_view, pinned_oids, half_life, now,
                                         set(prefixes))
    history = await trio.to_thread.run_sync(capacity.history) if capacity is not None else []
    now_point = analytics.point()
    series = [p for p in await trio.to_thread.run_sync(analytics.stored_series)
              if p.t < now_point.t] + [now_point]
    t = analytics.totals

    def row(name: str) -> dict[str, Any]:
        p = prefixes.get(name)
        cached = view.cached.get(name, (0, 0.0))[0]
        out: dict[str, Any] = {"prefix": name, "read": {}, "cached": cached,
                               "total": view.total.get(name, 0)}
        if p is not None:
            out.update(heat=round(p.heat(now, analytics.half_life_s), 1), read=dict(p.read),
                       hit_ratio=_round(p.hit_ratio()), reread_ratio=_round(p.reread_ratio()),
                       accesses=p.accesses, refetches=p.refetches, lists=p.lists,
                       heads=p.heads, last_read=p.last_read)
        return out

    meta_top = sorted(prefixes, key=lambda n: -(prefixes[n].lists + prefixes[n].heads))
    cold = sorted(((name, c[0], c[1]) for name, c in view.cached.items()
                   if c[1] < now - req.cold_after), key=lambda x: (x[2], -x[1]))
    read_total = t.bytes_read()
    evictions = int(metrics.value("tierfs_cache_evictions_total"))
    refused = int(metrics.value("tierfs_cache_refused_chunks_total"))
    return {
        **info, "generated": now, "levels": analytics.levels,
        "cache": {"used": cache.used_bytes, "budget": cache.budget(),
                  "pinned": cache.bytes_of(pinned_oids), "dirty": cache.dirty_bytes},
        "read": dict(t.read), "hit_ratio": _round(t.hit_ratio()),
        "tiers": {s: round(t.read.get(s, 0) / read_total, 4) for s in SOURCES} if read_total
        else {},
        "latency": _latency(metrics),
        "hot": [row(name) for name, _ in analytics.hot(req.top)],
        "cold": [{"prefix": n, "cached": b, "last_access": last}
                 for n, b, last in cold[:req.top]],
        "cold_after": req.cold_after,
        "metadata": {"lists": t.lists, "heads": t.heads,
                     "top": [row(n) for n in meta_top[:req.top]
                             if prefixes[n].lists + prefixes[n].heads]},
        "stalls": _stalls(metrics, stalls),
        "composition": view.by_heat,
        "heat": _heat_histogram(view),
        "eviction": {"evictions": evictions, "refused": refused, "fetches": t.fetches,
                     "refetches": t.refetches,
                     "refetch_ratio": _round(t.refetches / t.fetches if t.fetches else None)},
        "usage_series": [{"t": s.t, "used": s.used, "budget": s.budget, "pinned": s.pinned}
                         for s in history]
                        + [{"t": now, "used": cache.used_bytes, "budget": cache.budget(),
                            "pinned": cache.bytes_of(pinned_oids)}],
        "ratio_series": ratio_series(series),
    }


def ratio_series(points: list[Point]) -> list[dict[str, Any]]:
    """The hit ratio of each interval between two points of the series (the first point:
    of everything before it). A restart that lost counts (totals going down) starts over."""
    out, prev = [], None
    for p in points:
        delta = dict(p.read) if prev is None or _fell(prev, p) else \
            {s: p.read.get(s, 0) - prev.read.get(s, 0) for s in p.read}
        out.append({"t": p.t, "hit_ratio": _round(cached_share(delta)),
                    "bytes": sum(delta.values())})
        prev = p
    return out


def _fell(a: Point, b: Point) -> bool:
    return any(b.read.get(s, 0) < n for s, n in a.read.items())


def _heat_histogram(view: CacheView) -> list[dict[str, Any]]:
    edges: tuple[float | None, ...] = (*HEAT_EDGES, None)
    return [{"le": edge, "count": c} for edge, c in zip(edges, view.heat, strict=True)]


def _buckets(metrics: Metrics, name: str, **match: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over the label values
    not matched (e.g. every tenant)."""
    out: dict[float, float] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in match.items()):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return dict(sorted(out.items()))


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket the q-quantile falls in (None: no observation, or it
    is past the last finite bound)."""
    total = max(buckets.values(), default=0.0)
    if total == 0:
        return None
    for le, count in buckets.items():
        if count >= q * total:
            return le if math.isfinite(le) else None
    return None


def _latency(metrics: Metrics) -> list[dict[str, Any]]:
    rows = []
    for source in SOURCES:
        b = _buckets(metrics, "tierfs_read_seconds", source=source)
        if b and max(b.values()) > 0:
            rows.append({"source": source, "reads": int(max(b.values())),
                         "p50": _quantile(b, 0.5), "p99": _quantile(b, 0.99)})
    return rows


def _stalls(metrics: Metrics, stalls: "StallLog | None") -> dict[str, Any]:
    cumulative = _buckets(metrics, "tierfs_read_stall_seconds")
    hist, below = [], 0.0
    for le, count in cumulative.items():  # cumulative -> per bucket
        hist.append({"le": le if math.isfinite(le) else None, "count": count - below})
        below = count
    out: dict[str, Any] = {"histogram": hist,
                           "backend_stalls": int(metrics.value("tierfs_backend_stalls_total"))}
    if stalls is not None:
        r = stalls.report()
        out.update(threshold_s=r.threshold_s, total=r.total, total_s=round(r.total_s, 6),
                   by_source=dict(r.by_source), slowest=[s.to_json() for s in r.slowest[:20]])
    return out


def job_files(req: JobFilesRequest, analytics: Analytics) -> dict[str, Any]:
    since = analytics.clock() - req.since if req.since is not None else None
    j = analytics.job(req.key, since)  # a job's id, or "pod:UID"
    if j is None:
        return {"job": req.key, "known": False, "files": []}
    return {"job": req.key, "known": True, "truncated": j.truncated, "first": j.first,
            "last": j.last,
            "files": [{"path": f.path, "etag": f.etag, "size": f.size, "last": f.last}
                      for f in sorted(j.files.values(), key=lambda f: f.path)]}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
