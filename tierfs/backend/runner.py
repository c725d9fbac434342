"""Runs a blocking Backend from trio: worker threads, limiters, metrics.

Every backend call made by the daemon goes through here, so the request counters and
latency histograms cover both backends and no boto3 call ever runs on the trio thread.
Two limiters give foreground reads priority: background work (read-ahead, warm) may use
at most `background` threads, and foreground calls never wait behind more than that.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, TypeVar

import trio

from ..errors import BackendError
from ..metrics import Metrics
from .base import Backend, ListPage, ObjectMeta

T = TypeVar("T")


class AsyncBackend:
    def __init__(self, backend: Backend, metrics: Metrics, *, concurrency: int,
                 background: int) -> None:
        self.sync = backend
        self.metrics = metrics
        self.foreground = trio.CapacityLimiter(concurrency)
        self.background = trio.CapacityLimiter(max(1, min(background, concurrency)))

    async def _call(self, op: str, fn: Callable[[], T], background: bool) -> T:
        m = self.metrics
        m.backend_requests.labels(op).inc()
        t0 = time.perf_counter()
        try:
            if background:
                async with self.background:
                    return await trio.to_thread.run_sync(fn, limiter=self.foreground)
            return await trio.to_thread.run_sync(fn, limiter=self.foreground)
        except BackendError:
            m.backend_errors.labels(op).inc()
            raise
        finally:
            m.backend_seconds.labels(op).observe(time.perf_counter() - t0)

    async def check(self) -> None:
        await self._call("head_bucket", self.sync.check, False)

    async def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
                   max_keys: int = 1000) -> ListPage:
        fn = functools.partial(self.sync.list, prefix, delimiter, token, max_keys)
        return await self._call("list", fn, False)

    async def head(self, key: str) -> ObjectMeta:
        return await self._call("head", functools.partial(self.sync.head, key), False)

    async def get(self, key: str, start: int, length: int, etag: str | None, *,
                  background: bool = False) -> bytes:
        fn = functools.partial(self.sync.get, key, start, length, etag)
        data = await self._call("get", fn, background)
        self.metrics.backend_bytes.inc(len(data))
        return data
