"""Revalidations: a metadata request that answers in time, or goes on in the background.

Past --metadata-ttl a lookup, stat, open or readdir of something the index already holds
asks the store again. A store that hangs (no refusal, no answer) would hold that call
for the whole request timeout and its retries (two minutes with the defaults), while the
same file's cached bytes are served at once. So a revalidation of a known entry waits at
most `timeout` (--revalidate-timeout): past it the caller serves what the index holds
(stale-while-revalidate, as HTTP caches do) and the request goes on in the background; its
answer, when it comes, lands in the index for the next call. One request per entry at a
time: later callers join the one under way.

An answer that comes in time is the caller's, errors included (a 404 is never
overridden by what is cached). Without a task nursery (some unit tests) it just waits.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Hashable, TypeVar

import trio

from ..tasks import Tasks

log = logging.getLogger(__name__)

T = TypeVar("T")


class Late(Exception):
    """The revalidation did not answer within the timeout; it goes on in the background."""


class _Flight:
    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class Revalidations:
    def __init__(self, tasks: Tasks | None, timeout_s: float) -> None:
        self.tasks = tasks
        self.timeout_s = timeout_s
        self._flights: dict[Hashable, _Flight] = {}

    async def within(self, key: Hashable, fn: Callable[[], Awaitable[T]]) -> T:
        """fn()'s answer (or its error) if it comes within the timeout, else Late."""
        if self.tasks is None:
            return await fn()
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = _Flight()
            self.tasks.spawn("revalidation", self._run, key, flight, fn)
        with trio.move_on_after(self.timeout_s):
            await flight.done.wait()
        if not flight.done.is_set():
            raise Late()
        if flight.error is not None:
            raise flight.error
        return flight.result

    async def _run(self, key: Hashable, flight: _Flight, fn: Callable[[], Awaitable[Any]]) -> None:
        try:
            flight.result = await fn()
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits, or logged
            flight.error = exc
            log.debug("revalidation of %r ended with %s", key, exc)
        finally:
            self._flights.pop(key, None)
            flight.done.set()
