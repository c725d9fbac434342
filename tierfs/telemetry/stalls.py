"""Stalls: reads that waited on a fetch longer than `stall_threshold` (default 50 ms).

A read waits on a fetch when the chunk it needs is in no cache tier: it waits for its own
GET (or for the flight of another reader that asked first), for a peer, or for the fetch
queue (a read-ahead of that chunk already under way, or the read walk holding new GETs back
while the disk tier catches up). FileIO measures that wait per read (tierfs/files/fileio.py);
past the threshold the read is a stall, and this module keeps what the report needs:

- `tierfs_read_stall_seconds{tenant}`: a histogram of the stalls' waits (tenants are the
  mount's configured ones and "default": bounded);
- the slowest recent stalls: at most `keep` (100) records of the last `window_s` (24 h),
  the longest waits first, each with key, offset, wait, the source of the delay (backend,
  peer, queue), when, tenant and reader. Keys and readers go to the control socket
  (`tierfs status --json`: `stalls`), never into label values;
- totals since start, per source of the delay.

Cheap: a read that waited on nothing never reaches this module; a stall costs a histogram
observation and at most one heap operation over `keep` records (a purge of expired ones
only when the log is full).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from ..metrics import Metrics

DELAY_SOURCES = ("backend", "near", "peer", "queue")
KEEP = 100
WINDOW_S = 86400.0


@dataclass(frozen=True)
class Stall:
    key: str  # the object's key in the bucket
    offset: int  # where the read started
    wait_s: float  # how long it waited on fetches
    source: str  # what it waited on longest: backend, peer or queue
    at: float  # epoch seconds when the read ended
    tenant: str
    reader: str  # job:N, pod:UID or uid:N (tierfs/telemetry/callers.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StallReport:
    """What `tierfs status --json` shows as `stalls` (and `tierfs report` reads)."""

    threshold_s: float
    window_s: float
    total: int  # stalls since the mount started
    total_s: float  # their waits, summed
    by_source: dict[str, int]
    slowest: list[Stall]  # of the window, the longest wait first

    def to_json(self) -> dict[str, Any]:
        return {"threshold_s": self.threshold_s, "window_s": self.window_s,
                "total": self.total, "total_s": round(self.total_s, 6),
                "by_source": dict(self.by_source),
                "slowest": [s.to_json() for s in self.slowest]}


class StallLog:
    def __init__(self, metrics: Metrics, *, threshold_s: float, tenants: Iterable[str],
                 clock: Callable[[], float] = time.time, keep: int = KEEP,
                 window_s: float = WINDOW_S) -> None:
        self.metrics = metrics
        self.threshold_s = threshold_s
        self.clock = clock
        self.keep = keep
        self.window_s = window_s
        # labelled children looked up once (the hot path makes no label lookup)
        self._hist = {t: metrics.read_stall_seconds.labels(t) for t in tenants}
        self._heap: list[tuple[float, int, Stall]] = []  # the shortest kept wait on top
        self._seq = itertools.count()
        self.total = 0
        self.total_s = 0.0
        self.by_source = dict.fromkeys(DELAY_SOURCES, 0)

    def observe(self, key: str, offset: int, wait_s: float, source: str, tenant: str,
                reader: str) -> bool:
        """A read waited `wait_s` on fetches; True if that is a stall (then it is counted
        and kept if it is among the slowest recent ones)."""
        if wait_s <= self.threshold_s:
            return False
        hist = self._hist.get(tenant)
        if hist is None:  # a tenant the log was not told of: still one series per tenant
            hist = self._hist[tenant] = self.metrics.read_stall_seconds.labels(tenant)
        hist.observe(wait_s)
        self.total += 1
        self.total_s += wait_s
        self.by_source[source] = self.by_source.get(source, 0) + 1
        now = self.clock()
        entry = (wait_s, next(self._seq), Stall(key, offset, wait_s, source, now, tenant, reader))
        if len(self._heap) >= self.keep:
            self._purge(now)
        if len(self._heap) < self.keep:
            heapq.heappush(self._heap, entry)
        elif wait_s > self._heap[0][0]:
            heapq.heapreplace(self._heap, entry)
        return True

    def _purge(self, now: float) -> None:
        """Forget stalls older than the window (a long one must not hold its place for
        ever and keep newer ones out)."""
        horizon = now - self.window_s
        kept = [e for e in self._heap if e[2].at >= horizon]
        if len(kept) != len(self._heap):
            heapq.heapify(kept)
            self._heap = kept

    def slowest(self) -> list[Stall]:
        """The kept stalls of the window, the longest wait first."""
        self._purge(self.clock())
        return [e[2] for e in sorted(self._heap, reverse=True)]

    def report(self) -> StallReport:
        return StallReport(self.threshold_s, self.window_s, self.total, self.total_s,
                           dict(self.by_source), self.slowest())
