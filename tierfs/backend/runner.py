"""Runs a blocking Backend from trio: worker threads, limiters, metrics.

Every backend call made by the daemon goes through here, so the request counters and
latency histograms cover both backends and no boto3 call ever runs on the trio thread.
Three lanes give foreground reads priority:
- read-ahead may hold at most `background` of the `concurrency` threads, so a reader
  never waits behind more than that;
- warm (`tierfs warm`) has `warm` threads of its own, so it never takes a reader's slot,
  and narrows to one request at a time while any other request is in flight and for
  WARM_QUIET_S after (a reader that computes between reads is still a reader): a job
  reading cold data while a warm runs shares the object store with one warm GET, not
  sixteen. GETs already running are not interrupted, so the first read of a burst may
  still meet a full-width warm; the narrowing holds from then on.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, TypeVar

import trio

from ..errors import BackendError
from ..health import BackendHealth
from ..metrics import Metrics
from .base import Backend, ListPage, ObjectMeta

T = TypeVar("T")

WARM_QUIET_S = 2.0


class AsyncBackend:
    def __init__(self, backend: Backend, metrics: Metrics, *, concurrency: int,
                 background: int, warm: int = 8) -> None:
        self.sync = backend
        self.metrics = metrics
        self.foreground = trio.CapacityLimiter(concurrency)
        self.background = trio.CapacityLimiter(max(1, min(background, concurrency)))
        self.warm = trio.CapacityLimiter(warm)
        self._warm_width = warm
        self._busy = 0  # requests in flight on the other lanes
        self._quiet_since = 0.0
        # degraded mode (tierfs/health.py): refuses requests while the store is known down
        # and learns from each outcome; set by the daemon, None in bare unit tests
        self.health: BackendHealth | None = None

    async def _call(self, op: str, fn: Callable[[], T], background: bool,
                    warm: bool = False) -> T:
        if self.health is not None:
            self.health.admit(op)  # StoreDown at once, before taking a thread or queuing
        m = self.metrics
        m.backend_requests.labels(op).inc()
        t0 = time.perf_counter()
        failed: BaseException | None = None  # the outcome, for the health
        try:
            if warm:
                try:
                    return await trio.to_thread.run_sync(fn, limiter=self.warm)
                finally:
                    self._maybe_widen_warm()
            self._busy += 1
            self.warm.total_tokens = 1
            try:
                if background:
                    async with self.background:
                        return await trio.to_thread.run_sync(fn, limiter=self.foreground)
                return await trio.to_thread.run_sync(fn, limiter=self.foreground)
            finally:
                self._busy -= 1
                self._quiet_since = trio.current_time()
        except BackendError as exc:
            failed = exc
            m.backend_errors.labels(op).inc()
            raise
        except BaseException as exc:
            failed = exc
            raise
        finally:
            m.backend_seconds.labels(op).observe(time.perf_counter() - t0)
            if self.health is not None:
                self.health.observe(failed)

    def _maybe_widen_warm(self) -> None:
        # checked as each warm request ends: at least one always runs, so this is reached
        if not self._busy and trio.current_time() - self._quiet_since >= WARM_QUIET_S:
            self.warm.total_tokens = self._warm_width

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

    async def warm_get(self, fn: Callable[[], T], nbytes: int) -> T:
        """A GET on the warm lane, made inside fn (with self.sync.get_into), so that the
        same worker thread can put the body where it goes: one thread hop, no copy. (Its
        latency in tierfs_backend_request_seconds then includes that disk write.)"""
        result = await self._call("get", fn, False, warm=True)
        self.metrics.backend_bytes.inc(nbytes)
        return result

    # writes run at foreground priority: a flush or fsync has a caller waiting on it

    async def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta:
        return await self._call("put", functools.partial(self.sync.put, key, data, metadata), False)

    async def copy(self, src: str, dst: str, src_etag: str | None,
                   metadata: dict[str, str] | None = None) -> str:
        fn = functools.partial(self.sync.copy, src, dst, src_etag, metadata)
        return await self._call("copy", fn, False)

    async def delete(self, key: str) -> None:
        await self._call("delete", functools.partial(self.sync.delete, key), False)

    async def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        return await self._call("mpu_create", functools.partial(self.sync.mpu_create, key, metadata),
                                False)

    async def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str:
        fn = functools.partial(self.sync.upload_part, key, upload_id, part, data)
        return await self._call("upload_part", fn, False)

    async def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                               start: int, length: int) -> str:
        fn = functools.partial(self.sync.upload_part_copy, key, upload_id, part, src, src_etag,
                               start, length)
        return await self._call("upload_part_copy", fn, False)

    async def mpu_complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        fn = functools.partial(self.sync.mpu_complete, key, upload_id, parts)
        return await self._call("mpu_complete", fn, False)

    async def mpu_list(self, key: str) -> list[str]:
        return await self._call("mpu_list", functools.partial(self.sync.mpu_list, key), False)

    async def mpu_abort(self, key: str, upload_id: str) -> None:
        await self._call("mpu_abort", functools.partial(self.sync.mpu_abort, key, upload_id), False)
