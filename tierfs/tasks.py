"""Background tasks that never take the mount down.

Every task the daemon runs beside the FUSE loop (uploaders, orphan cleanup, read-ahead,
fills, pin expiry, the health probe...) is started through a `Tasks`. An exception that
escapes such a task is a bug or an unforeseen failure of a dependency: it is logged once
with its traceback, counted in `tierfs_internal_errors_total{task}`, and then
- `spawn`: the one-shot task is over (its caller already got its answer or will retry);
- `supervise`: the long-running task starts again after a backoff (1 s doubling to 60 s,
  reset after a minute of healthy running).
Only cancellation (a signal, an unmount) ends them. trio raises a task's failures as
ExceptionGroups when they come from a nested nursery: `sole_exception` unwraps a group of
one so callers can catch the TierfsError inside it.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

import trio

from .errors import TierfsError
from .metrics import Metrics

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_S = 60.0  # a task that ran this long before failing starts again at once


def sole_exception(exc: BaseException) -> BaseException:
    """The exception inside (nested) groups of exactly one, else `exc` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def leaves(exc: BaseException) -> list[BaseException]:
    """Every exception inside `exc`, groups flattened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in leaves(e)]
    return [exc]


def expected_error(exc: BaseException) -> TierfsError | None:
    """The TierfsError that `exc` is, or that every leaf of the group `exc` is (the first
    one answers for them all); None when anything in it is not a TierfsError: a bug."""
    found = leaves(exc)
    errors = [e for e in found if isinstance(e, TierfsError)]
    return errors[0] if len(errors) == len(found) else None


def is_cancellation(exc: BaseException) -> bool:
    return all(isinstance(e, (trio.Cancelled, KeyboardInterrupt, SystemExit))
               for e in leaves(exc))


class Tasks:
    def __init__(self, nursery: trio.Nursery, metrics: Metrics) -> None:
        self.nursery = nursery
        self.metrics = metrics

    def report(self, name: str, exc: BaseException) -> None:
        """One unexpected failure of task `name`: logged with its traceback and counted."""
        self.metrics.internal_errors.labels(name).inc()
        log.error("internal error in %s (the mount stays up): %r", name, sole_exception(exc),
                  exc_info=exc)

    def spawn(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run fn(*args) once in the background; a failure is reported, never raised."""
        self.nursery.start_soon(self._once, name, fn, args, name=name)

    async def _once(self, name: str, fn: Callable[..., Awaitable[Any]], args: tuple) -> None:
        try:
            await fn(*args)
        except BaseException as exc:  # the point of this module
            if is_cancellation(exc):
                raise
            self.report(name, exc)

    def supervise(self, name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run fn(*args) for the life of the mount, restarting it after a failure (or an
        unexpected return) with backoff."""
        self.nursery.start_soon(self._forever, name, fn, args, name=name)

    async def _forever(self, name: str, fn: Callable[..., Awaitable[Any]], args: tuple) -> None:
        delay = BACKOFF_MIN_S
        while True:
            started = trio.current_time()
            try:
                await fn(*args)
                log.error("task %s returned; starting it again", name)
                self.metrics.internal_errors.labels(name).inc()
            except BaseException as exc:  # reported; the task starts again
                if is_cancellation(exc):
                    raise
                self.report(name, exc)
            if trio.current_time() - started >= HEALTHY_S:
                delay = BACKOFF_MIN_S
            await trio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
