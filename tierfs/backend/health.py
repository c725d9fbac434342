"""Does the object store answer? The switch into and out of degraded mode.

docs/semantics.md "When the object store is down". AsyncBackend (backend/runner.py) asks
`admit` before every request and tells `observe` how it ended, so the health is learnt
from real traffic and costs nothing while the store answers. A request that fails as
unreachable (BackendUnavailable: connection refused or reset, timeouts, after botocore's
own retries) only makes the store *suspect*: one cheap probe (HeadBucket through the
backend's `check`, one attempt, short timeout) confirms it before the mount goes degraded,
so one slow GET on a healthy store does not fail everyone else's requests.

While degraded:
- `admit` refuses every request at once with StoreDown (EIO), before it takes a worker
  thread or queues behind requests that are waiting out their timeouts: what is cached is
  served (namespace.py serves stale entries on error), what is not fails fast;
- the probe runs every PROBE_INTERVAL_S, and the first answer (or any request already in
  flight that succeeds) ends degraded mode: the mount recovers by itself, no remount.
One WARNING when the store goes down, one INFO when it is back; `tierfs_backend_up` and
`tierfs status` show the state.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from ..errors import (
    AccessDenied,
    BackendError,
    BackendUnavailable,
    Exists,
    NoSuchBucket,
    NotFound,
    PreconditionFailed,
    StoreDown,
    Unsupported,
)
from ..metrics import Metrics

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 3.0  # while degraded, one HeadBucket this often
PROBE_TIMEOUT_S = 5.0  # a probe not answered in this long counts as "still down": short, but
# long enough that an overloaded store answering slowly is not taken for a dead one

# answers that prove the store is reachable, even though the request failed
_ANSWERED = (NotFound, PreconditionFailed, AccessDenied, NoSuchBucket, Exists, Unsupported)


class BackendHealth:
    def __init__(self, metrics: Metrics, probe: Callable[[], None], *,
                 interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S,
                 tier: str = "") -> None:
        """`probe` is a blocking bucket check (Backend.check), run in a thread of its own;
        it should give up quickly by itself (the daemon passes one of a backend opened
        with one attempt and short timeouts): a probe past `timeout_s` is abandoned.
        `tier`: "" for the source, else the object-store tier's name (docs/tiers.md): its
        state goes to tierfs_tier_up{tier}, and while it is down reads skip it."""
        self.metrics = metrics
        self.tier = tier
        self._gauge = metrics.tier_up.labels(tier) if tier else metrics.backend_up
        self._what = f"{tier} store" if tier else "object store"
        self._probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.up = True
        self.outages = 0  # times the store went down
        self.recoveries = 0  # times it came back: "once per outage" log lines key on it
        self.reason = ""  # why it is down, for StoreDown messages
        self._down_since = 0.0
        self._suspect = trio.Event()
        # one probe thread at a time: a probe abandoned at its timeout still holds this
        # until its thread ends, so probes of a hanging store never pile up
        self._probe_threads = trio.CapacityLimiter(1)
        self._gauge.set(1)

    # ---- called by AsyncBackend around every request ---------------------------------

    def admit(self, op: str) -> None:
        """Refuse a request while the store is known down (before it is queued)."""
        if not self.up:
            raise StoreDown(f"{op}: the {self._what} is unreachable ({self.reason})")

    def observe(self, exc: BaseException | None) -> None:
        """The outcome of one request: None for success, else what it raised."""
        if exc is None or isinstance(exc, _ANSWERED):
            self.mark_up()
        elif isinstance(exc, BackendUnavailable):
            self.suspect(str(exc))
        # anything else (a 5xx, a cancelled request, StoreDown itself) says nothing new

    def suspect(self, reason: str) -> None:
        """Something suggests the store is gone (a request failed as unreachable, or has
        been running far too long): run() checks with one probe, and only a failed probe
        makes the mount degraded."""
        if self.up:
            self.reason = reason
            self._suspect.set()

    # ---- state changes ---------------------------------------------------------------

    def mark_down(self, reason: str) -> None:
        self.reason = reason
        if not self.up:
            return
        self.up = False
        self.outages += 1
        self._down_since = trio.current_time()
        self._gauge.set(0)
        if self.tier:
            log.warning("%s unreachable (%s): reads go to the source until it answers; "
                        "probing every %gs", self._what, reason, self.interval_s)
        else:
            log.warning("object store unreachable (%s): degraded mode, serving what is "
                        "cached; uncached data fails with EIO at once; probing every %gs",
                        reason, self.interval_s)
        self._suspect.set()  # make sure run() probes until it answers

    def mark_up(self) -> None:
        if self.up:
            return
        self.up = True
        self.recoveries += 1
        self._gauge.set(1)
        log.info("%s answers again after %.0fs: leaving degraded mode", self._what,
                 trio.current_time() - self._down_since)

    # ---- probing ---------------------------------------------------------------------

    async def probe(self, timeout_s: float | None = None) -> BaseException | None:
        """One bucket check: None if the store answered, else why not (never raises)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with trio.move_on_after(timeout_s):
            try:
                await trio.to_thread.run_sync(self._probe, abandon_on_cancel=True,
                                              limiter=self._probe_threads)
                return None
            except _ANSWERED:
                return None
            except Exception as exc:  # noqa: BLE001 - any failure of the probe means "not answering"
                return exc
        return BackendUnavailable(f"no answer to a bucket check within {timeout_s:g}s")

    async def start(self, check: Callable[[], None], timeout_s: float) -> bool:
        """The bucket check at mount time, bounded by timeout_s (--startup-timeout): True if
        the store answered. If it did not answer (unreachable, timing out, failing with a
        5xx), the mount goes degraded and False is returned; an answer that no retry will
        change (no such bucket, access denied) is raised for the start-up error."""
        reason = f"no answer to a bucket check within {timeout_s:g}s"
        with trio.move_on_after(timeout_s):
            try:
                await trio.to_thread.run_sync(check, abandon_on_cancel=True)
                return True
            except (AccessDenied, NoSuchBucket):
                raise
            except BackendError as exc:
                reason = str(exc)
        self.mark_down(f"at start-up: {reason}")
        return False

    async def run(self) -> None:
        """Probe when a request found the store unreachable, and every interval_s while
        degraded, until it answers. Runs for the life of the mount (Tasks.supervise)."""
        while True:
            await self._suspect.wait()
            self._suspect = trio.Event()
            while True:
                failed = await self.probe()
                if failed is None:
                    self.mark_up()
                    break
                self.mark_down(str(failed) or repr(failed))
                await trio.sleep(self.interval_s)
                if self.up:  # a request in flight succeeded meanwhile
                    break
            self._suspect = trio.Event()  # suspicions raised during the probing are answered
