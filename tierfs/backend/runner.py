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

Stalls are visible: every request is registered while it runs (op, key, offset, start),
and `watch_stalls`, a task the core supervises for the life of the mount, logs ONE
WARNING for each request that runs longer than --stall-warn and counts it in
tierfs_backend_stalls_total{op} (and one INFO when such a request ends). Time spent
waiting for a thread is not a stall: the clock starts when the request does.

This is also the last line of the backend boundary: an exception that is not a tierfs
error (a bug in a backend) becomes BackendError here, logged with its traceback and
counted in tierfs_internal_errors_total{task="backend"}.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import trio

from ..errors import BackendError, TierfsError
from ..metrics import Metrics
from .base import Backend, BackendEvents, ListPage, MultipartUpload, ObjectMeta
from .health import BackendHealth

log = logging.getLogger(__name__)

T = TypeVar("T")

WARM_QUIET_S = 2.0


@dataclass
class _Request:
    """A backend request in flight, for the stall watchdog."""

    op: str
    key: str  # "" when the request is about no one object (head_bucket)
    offset: int | None
    started: float | None = None  # time.monotonic() once a worker thread runs it
    warned: bool = False

    def __str__(self) -> str:
        if not self.key:
            return self.op
        at = "" if self.offset is None else f" at offset {self.offset}"
        return f"{self.op} of {self.key!r}{at}"


class AsyncBackend:
    def __init__(self, backend: Backend, metrics: Metrics, *, concurrency: int,
                 background: int, warm: int = 8, stall_warn: float = 10.0,
                 tier: str = "") -> None:
        """`tier`: "" for the source (tierfs_backend_* metrics), else the name of another
        object-store tier (the near store: tierfs_tier_*{tier} metrics, docs/tiers.md)."""
        self.sync = backend
        self.metrics = metrics
        self.tier = tier
        self.stall_warn = stall_warn
        self._inflight: dict[int, _Request] = {}  # changed on the trio thread only
        self._ids = itertools.count()
        if isinstance(getattr(backend, "events", None), BackendEvents):
            # `events` is optional on a Backend, so the Protocol does not declare it
            backend.events = BackendEvents(  # type: ignore[attr-defined]  # checked above
                resumed=metrics.backend_resumed.inc,
                integrity_failure=lambda check: metrics.integrity_failures.labels(check).inc())
        self.foreground = trio.CapacityLimiter(concurrency)
        self.background = trio.CapacityLimiter(max(1, min(background, concurrency)))
        self.warm = trio.CapacityLimiter(warm)
        self._warm_width = warm
        self._busy = 0  # requests in flight on the other lanes
        self._quiet_since = 0.0
        # degraded mode (tierfs/backend/health.py): refuses requests while the store is known down
        # and learns from each outcome; set by the daemon, None in bare unit tests
        self.health: BackendHealth | None = None

    async def _call(self, op: str, fn: Callable[[], T], background: bool,
                    warm: bool = False, key: str = "", offset: int | None = None) -> T:
        if self.health is not None:
            self.health.admit(op)  # StoreDown at once, before taking a thread or queuing
        m = self.metrics
        if self.tier:
            m.tier_requests.labels(self.tier, op).inc()
        else:
            m.backend_requests.labels(op).inc()
        t0 = time.perf_counter()
        failed: BaseException | None = None  # the outcome, for the health
        req = _Request(op, key, offset)
        rid = next(self._ids)
        self._inflight[rid] = req
        # a warm's fn also writes the disk tier: its OSErrors are the caller's to map
        fn = self._in_thread(req, fn, mapped=not warm)
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
            if self.tier:
                m.tier_errors.labels(self.tier, op).inc()
            else:
                m.backend_errors.labels(op).inc()
            raise
        except BaseException as exc:
            failed = exc
            raise
        finally:
            del self._inflight[rid]
            if req.warned and req.started is not None:
                log.info("backend %s %s after %.1f s", req,
                         "failed" if failed is not None else "finished",
                         time.monotonic() - req.started)
            if not self.tier:
                m.backend_seconds.labels(op).observe(time.perf_counter() - t0)
            if self.health is not None:
                self.health.observe(failed)

    def _in_thread(self, req: _Request, fn: Callable[[], T], *, mapped: bool) -> Callable[[], T]:
        """fn as the worker thread runs it: starts the request's stall clock, and turns
        an exception that is not a tierfs error into BackendError (a backend's bug must
        cost one request, not the mount)."""
        def run() -> T:
            req.started = time.monotonic()
            try:
                return fn()
            except TierfsError:
                raise
            except Exception as exc:  # the boundary
                if not mapped:
                    raise
                self.metrics.internal_errors.labels("backend").inc()
                log.error("backend %s: unexpected %s from the %s backend", req,
                          type(exc).__name__, getattr(self.sync, "name", "?"), exc_info=exc)
                raise BackendError(f"{req}: unexpected {type(exc).__name__}: {exc}") from None

        return run

    async def watch_stalls(self) -> None:
        """Log one WARNING per request that runs longer than stall_warn and count it in
        tierfs_backend_stalls_total{op}. Runs for the life of the mount (the core
        supervises it); a warning comes at most a quarter of stall_warn (or 1 s) late."""
        interval = min(1.0, self.stall_warn / 4)
        while True:
            await trio.sleep(interval)
            now = time.monotonic()
            for req in list(self._inflight.values()):
                if req.warned or req.started is None or now - req.started < self.stall_warn:
                    continue
                req.warned = True
                if not self.tier:
                    self.metrics.backend_stalls.labels(req.op).inc()
                log.warning("%s %s has been running for %.1f s (stall-warn %gs): the "
                            "object store is slow or not answering",
                            f"{self.tier} store" if self.tier else "backend", req,
                            now - req.started, self.stall_warn)
                if self.health is not None:  # a hung store goes degraded now, not at the
                    # end of this request's retries: one probe tells slow from gone
                    self.health.suspect(f"{req} running for {now - req.started:.0f}s")

    def in_flight(self) -> list[tuple[str, str, int | None, float]]:
        """(op, key, offset, seconds running) of each request a worker thread runs now."""
        now = time.monotonic()
        return [(r.op, r.key, r.offset, now - r.started)
                for r in list(self._inflight.values()) if r.started is not None]

    def _received(self, nbytes: int) -> None:
        if self.tier:
            self.metrics.tier_bytes.labels(self.tier, "read").inc(nbytes)
        else:
            self.metrics.backend_bytes.inc(nbytes)

    def _maybe_widen_warm(self) -> None:
        # checked as each warm request ends: at least one always runs, so this is reached
        if not self._busy and trio.current_time() - self._quiet_since >= WARM_QUIET_S:
            self.warm.total_tokens = self._warm_width

    async def check(self) -> None:
        await self._call("head_bucket", self.sync.check, False)

    async def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
                   max_keys: int = 1000) -> ListPage:
        fn = functools.partial(self.sync.list, prefix, delimiter, token, max_keys)
        return await self._call("list", fn, False, key=prefix)

    async def head(self, key: str) -> ObjectMeta:
        return await self._call("head", functools.partial(self.sync.head, key), False, key=key)

    async def get(self, key: str, start: int, length: int, etag: str | None, *,
                  background: bool = False, size: int | None = None) -> bytes | bytearray:
        """`size`: the object's size, if known (lets a whole-object GET be verified by the
        object's S3 checksums, see Backend.get)."""
        # passed only when given: a backend written before `size` existed still works
        extra = {} if size is None else {"size": size}
        fn = functools.partial(self.sync.get, key, start, length, etag, **extra)
        data = await self._call("get", fn, background, key=key, offset=start)
        self._received(len(data))
        return data

    async def get_into(self, key: str, start: int, buf: memoryview, etag: str | None, *,
                       background: bool = False, size: int | None = None,
                       metadata: dict[str, str] | None = None) -> int:
        """`get` into a buffer the caller gives (its body's length back): the read walk's
        reused buffers. The worker thread is never abandoned (trio.to_thread's default), so
        nothing writes into `buf` once this returns or raises, cancelled or not.
        `metadata`: see Backend.get_into (passed only when given)."""
        extra = {} if metadata is None else {"metadata": metadata}
        fn = functools.partial(self.sync.get_into, key, start, buf, etag, size=size, **extra)
        n = await self._call("get", fn, background, key=key, offset=start)
        self._received(n)
        return n

    async def warm_get(self, fn: Callable[[], T], nbytes: int, *, key: str = "",
                       offset: int | None = None) -> T:
        """A GET on the warm lane, made inside fn (with self.sync.get_into), so that the
        same worker thread can put the body where it goes: one thread hop, no copy. (Its
        latency in tierfs_backend_request_seconds then includes that disk write.) `key`
        and `offset` name it in a stall warning."""
        result = await self._call("get", fn, False, warm=True, key=key, offset=offset)
        self._received(nbytes)
        return result

    # writes run at foreground priority: a flush or fsync has a caller waiting on it

    async def put(self, key: str, data: bytes,
                  metadata: dict[str, str] | None = None) -> ObjectMeta:
        meta = await self._call("put", functools.partial(self.sync.put, key, data, metadata),
                                False, key=key)
        self._sent(len(data))
        return meta

    async def put_new(self, key: str, data: bytes,
                      metadata: dict[str, str] | None = None) -> ObjectMeta:
        """put only if the key is free (If-None-Match: *): Exists if it is not."""
        fn = functools.partial(self.sync.put_new, key, data, metadata)
        return await self._call("put", fn, False, key=key)

    async def copy(self, src: str, dst: str, src_etag: str | None,
                   metadata: dict[str, str] | None = None) -> str:
        fn = functools.partial(self.sync.copy, src, dst, src_etag, metadata)
        return await self._call("copy", fn, False, key=src)

    async def delete(self, key: str) -> None:
        await self._call("delete", functools.partial(self.sync.delete, key), False, key=key)

    async def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        return await self._call("mpu_create",
                                functools.partial(self.sync.mpu_create, key, metadata),
                                False, key=key)

    async def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str:
        fn = functools.partial(self.sync.upload_part, key, upload_id, part, data)
        etag = await self._call("upload_part", fn, False, key=key)
        self._sent(len(data))
        return etag

    def _sent(self, nbytes: int) -> None:
        if self.tier:
            self.metrics.tier_bytes.labels(self.tier, "written").inc(nbytes)

    async def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                               start: int, length: int) -> str:
        fn = functools.partial(self.sync.upload_part_copy, key, upload_id, part, src, src_etag,
                               start, length)
        return await self._call("upload_part_copy", fn, False, key=src, offset=start)

    async def mpu_complete(self, key: str, upload_id: str,
                           parts: builtins.list[tuple[int, str]]) -> str:
        fn = functools.partial(self.sync.mpu_complete, key, upload_id, parts)
        return await self._call("mpu_complete", fn, False, key=key)

    async def mpu_list(self, key: str) -> builtins.list[MultipartUpload]:
        return await self._call("mpu_list", functools.partial(self.sync.mpu_list, key), False,
                                key=key)

    async def mpu_abort(self, key: str, upload_id: str) -> None:
        await self._call("mpu_abort", functools.partial(self.sync.mpu_abort, key, upload_id), False,
                         key=key)
