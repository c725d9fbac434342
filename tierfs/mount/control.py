"""The control socket of a running mount: `tierfs status`, `warm`, `evict`, `unpin`, `usage`,
`report` (and its `job_files`), and `pod` (tierfs-csi naming the pod behind `pod:UID`).

Transport: a unix stream socket (tierfs.runpaths.control_socket), mode 0600 in a 0700
directory, and each connection's peer uid is checked (SO_PEERCRED): only root and the
user who mounted may talk to it. Protocol (docs/control.md; the messages are typed in
tierfs/protocol.py, shared with the clients): one JSON request line per connection, at
most protocol.MAX_REQUEST bytes and sent within protocol.IDLE_TIMEOUT_S, answered by zero
or more event lines and one final line:

    -> {"v": 1, "op": "warm", "paths": ["data/train"], "pin": true, "job": "42"}
    <- {"v": 1, "event": "progress", "bytes_done": ..., ...}      (warm only)
    <- {"v": 1, "ok": true, "result": {...}}  |  {"v": 1, "ok": false, "error": "..."}

A client that disconnects cancels its request (a warm stops; running it again resumes).
"v" is the protocol's major version: a request of another version gets an error naming
both; within a version, fields are only ever added and readers ignore unknown ones.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
import struct
import tempfile
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from .. import protocol, runpaths
from ..cache import ChunkCache
from ..errors import InvalidArgument, StartupError, TierfsError, UsageError
from ..metrics import Metrics
from ..peers import PeerTier
from ..protocol import (
    IDLE_TIMEOUT_S,
    MAX_REQUEST,
    PROTOCOL,
    EvictRequest,
    JobFilesRequest,
    NearGcRequest,
    PodRequest,
    ReportRequest,
    Request,
    StatusRequest,
    UnpinRequest,
    UsageRequest,
    WarmRequest,
)
from ..telemetry.capacity import CapacityHistory, forecast
from ..telemetry.report import build_report, job_files
from .warm import Warmer

if TYPE_CHECKING:
    from ..telemetry.stalls import StallLog
    from ..telemetry.usage import Tally, Usage

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class ControlServer:
    def __init__(self, path: str, warmer: Warmer, cache: ChunkCache, metrics: Metrics, *,
                 info: dict, uploads_pending: Callable[[], int], warm_concurrency: int,
                 peers: PeerTier | None = None, usage: "Usage | None" = None,
                 capacity: CapacityHistory | None = None,
                 stalls: "StallLog | None" = None,
                 near: Callable[[], dict | None] | None = None,
                 near_gc: Callable[[int | None, bool], Awaitable[dict]] | None = None,
                 ) -> None:
        self.path = path
        self.warmer = warmer
        self.cache = cache
        self.metrics = metrics
        self.info = info  # source, mountpoint, cache_dir: fixed for the daemon's life
        self._uploads_pending = uploads_pending
        self.warm_concurrency = warm_concurrency
        self.peers = peers
        self._near = near  # the near store's state (docs/tiers.md), None without --tier
        self._near_gc = near_gc
        # bytes read and stalls per tenant and reader (tierfs/telemetry/usage.py)
        self.usage = usage
        self.capacity = capacity  # the sampled history behind `usage --forecast`
        self.stalls = stalls  # the slowest recent stalled reads (tierfs/telemetry/stalls.py)
        self._started = time.time()

    async def serve(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Listen (started with nursery.start: the socket exists before the mount is
        announced ready, so `tierfs mount && tierfs warm` works) until cancelled."""
        try:
            os.unlink(self.path)  # left by a daemon that died; the mount point was free
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await sock.bind(self.path)
            os.chmod(self.path, 0o600)
            sock.listen(16)
            task_status.started()
            await trio.serve_listeners(self._handle, [trio.SocketListener(sock)])
        finally:
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await self._answer(stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; whatever it asked was cancelled
            except Exception:  # a bug: log it, answer, and keep the mount serving
                log.exception("control request failed")
                with trio.move_on_after(1):
                    try:
                        await stream.send_all(protocol.dumps(
                            {"v": PROTOCOL, "ok": False,
                             "error": "internal error (the daemon's log has details)"}))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass

    async def _answer(self, stream: trio.SocketStream) -> None:
        async def send(msg: dict) -> None:
            await stream.send_all(protocol.dumps({"v": PROTOCOL, **msg}))

        _, uid, _ = _PEERCRED.unpack(stream.socket.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        if uid not in (0, os.getuid()):
            await send({"ok": False, "error": "permission denied: only root and the user "
                                              "who mounted may control this mount"})
            return
        try:
            request = protocol.parse_request(await _read_line(stream))
            handler = _OPS[type(request)]
            result = await self._until_hangup(stream, handler(self, request, send))
        except TierfsError as exc:
            await send({"ok": False, "error": str(exc)})
            return
        if result is not None:
            await send({"ok": True, "result": result})

    async def _until_hangup(self, stream: trio.SocketStream, work: Any) -> Any:
        """Run a request; cancel it if the client closes its end (Ctrl-C on a warm)."""
        result, error = None, None

        async def run(cancel: trio.CancelScope) -> None:
            nonlocal result, error
            try:
                result = await work
            except TierfsError as exc:  # raised outside the nursery, not in a group
                error = exc
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, nursery.cancel_scope)
            while await stream.receive_some(1 << 10):
                pass  # clients send nothing after the request; EOF means they left
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    # ---- operations ------------------------------------------------------------------

    async def status(self, req: StatusRequest, send: Any) -> dict:
        c, m = self.cache, self.metrics
        read = {src: m.value("tierfs_read_bytes_total", source=src)
                for src in ("memory", "disk", "peer", "near", "backend")}
        hits = {t: m.value("tierfs_cache_hits_total", tier=t) for t in ("memory", "disk")}
        misses = m.value("tierfs_cache_misses_total")
        total_read, lookups = sum(read.values()), sum(hits.values()) + misses
        owners = []
        for owner, pin in sorted(c.pins.owners.items()):
            # a pin set before TTLs were checked may carry NaN/inf: shown as "no expiry"
            expires = pin.expires if pin.expires is None or math.isfinite(pin.expires) else None
            owners.append({"owner": owner, "files": len(pin.objects), "expires": expires,
                           "bytes": c.bytes_of(pin.objects)})
        pinned = c.pins.objects()
        return {**self.info, "pid": os.getpid(), "uptime_s": round(time.time() - self._started),
                "disk": {"used": c.used_bytes, "budget": c.budget(), "chunks": c.chunk_count},
                "memory": {"used": c.memory.bytes, "capacity": c.memory.capacity},
                "read_bytes": read,
                "hit_ratio": {"bytes": _ratio(read["memory"] + read["disk"], total_read),
                              "lookups": _ratio(lookups - misses, lookups)},
                "pinned": {"files": len(pinned), "bytes": c.bytes_of(pinned), "owners": owners},
                "dirty_bytes": c.dirty_bytes, "uploads_pending": self._uploads_pending(),
                # degraded mode (tierfs/backend/health.py): False while the object store does
                # not answer
                "backend_up": m.value("tierfs_backend_up") == 1,
                # every op the backends count, not a fixed few: a multipart upload is
                # mpu_create + upload_part + mpu_complete, never a put
                "backend_requests": _per_op(m, "tierfs_backend_requests_total"),
                "backend_errors": _per_op(m, "tierfs_backend_errors_total"),
                "peers": None if self.peers is None else self.peers.status(),
                "near": None if self._near is None else self._near(),
                # reads that waited on a fetch past stall_threshold: totals, the slowest
                "stalls": None if self.stalls is None else self.stalls.report().to_json()}

    async def warm(self, req: WarmRequest, send: Any) -> dict:
        paths, check, ttl = req.paths, req.check, req.pin_ttl  # typed and ranged (protocol.py)
        owner = req.pin_owner
        concurrency = req.concurrency or self.warm_concurrency
        log.info("warm of %d paths requested%s%s", len(paths), " (check only)" if check else "",
                 f", pinned for {owner}" if owner else "")

        async def progress(event: dict) -> None:
            await send(event)

        result = await self.warmer.warm(paths, check=check, pin_owner=owner,
                                        pin_expires=time.time() + ttl if ttl else None,
                                        concurrency=concurrency, progress=progress,
                                        tier=req.tier)
        log.info("warm done: %d files, %d bytes, %d already cached, %d fetched, %d errors",
                 result["files"], result["bytes"], result["bytes_cached_before"],
                 result["bytes_fetched"], result["error_count"])
        return result

    async def evict(self, req: EvictRequest, send: Any) -> dict:
        return await self.warmer.evict(req.paths, tier=req.tier)

    async def near_gc(self, req: NearGcRequest, send: Any) -> dict:
        if self._near_gc is None:
            raise InvalidArgument("this mount has no near store (--tier)")
        return await self._near_gc(req.budget, req.dry_run)

    async def unpin(self, req: UnpinRequest, send: Any) -> dict:
        pins = self.cache.pins
        job = req.job
        if req.all:
            owners = [o for o in pins.owners if not o.startswith("warm:")]
            return {"owners_released": owners, "objects": sum(pins.release(o) for o in owners)}
        if job:
            return {"owners_released": [f"job:{job}"], "objects": pins.release(f"job:{job}")}
        if req.pod:  # that pod's pins only, never another pod's on the same volume
            return {"owners_released": [f"pod:{req.pod}"],
                    "objects": pins.release(f"pod:{req.pod}")}
        return await self.warmer.unpin(req.paths)


    async def report(self, req: ReportRequest, send: Any) -> dict:
        # the namespace holds the mount's Analytics (it feeds it the LIST/HEAD counts)
        return await build_report(req, info=self.info, analytics=self.warmer.ns.analytics,
                                  cache=self.cache, metrics=self.metrics,
                                  capacity=self.capacity, stalls=self.stalls)

    async def job_files(self, req: JobFilesRequest, send: Any) -> dict:
        return job_files(req, self.warmer.ns.analytics)

    async def pod(self, req: PodRequest, send: Any) -> dict:
        if self.usage is None:
            raise UsageError("this daemon keeps no usage accounting (a tierfs from before it)")
        if req.forget:
            known = self.usage.forget_pod(req.uid)
            await self._keep_pods()
            return {"uid": req.uid, "known": known}
        self.usage.label_pod(req.uid, req.namespace or "", name=req.name,
                             service_account=req.service_account, tenant=req.tenant)
        await self._keep_pods()
        return {"uid": req.uid, "namespace": req.namespace, "known": True}

    async def _keep_pods(self) -> None:
        """Write who a pod is to the index now, not at the next periodic flush: a daemon
        that dies right after a publish still counts the pod's reads for its namespace
        when it comes back (once per pod: a publish is rare)."""
        assert self.usage is not None
        try:
            await self.usage.flush()
        except Exception as exc:  # noqa: BLE001 - kept in memory; the flusher tries again
            log.warning("who pods are could not be written to the index now (%s); the "
                        "periodic flush will try again", exc)

    async def usage_of(self, req: UsageRequest, send: Any) -> dict:
        if self.usage is None:
            raise UsageError("this daemon keeps no usage accounting (a tierfs from before it)")
        c = self.cache
        pins = c.pins.objects()
        result: dict[str, Any] = {
            "by": req.by, "cached_from": "none",
            "cache": {"used": c.used_bytes, "budget": c.budget(), "pinned": c.bytes_of(pins),
                      "dirty": c.dirty_bytes}}
        if req.reader is not None:  # one reader (the Slurm epilog): no index walk
            tally = self.usage.reader(req.reader)
            result["rows"] = [] if tally is None else [_row(req.reader, tally)]
        elif req.by == "namespace":  # pods' reads, by the namespace tierfs-csi named
            result["rows"] = [_row(name, t) for name, t in
                              sorted(self.usage.by_namespace().items())]
        elif req.by == "tenant":
            # the cache's own per-tenant count: exact, no walk of the index
            shares = c.tenant_bytes()
            cached = {t: b.cached for t, b in shares.items()}
            pinned = {t: b.pinned for t, b in shares.items()}
            result["cached_from"] = "cache"
            tallies = self.usage.by_tenant()
            result["rows"] = [
                {**_row(name, tallies.get(name)), "cached": cached.get(name, 0),
                 "pinned": pinned.get(name, 0)}
                for name in sorted(tallies.keys() | cached.keys() | pinned.keys())]
        else:
            result["rows"] = [_row(name, t) for name, t in
                              sorted(self.usage.by_reader(req.by).items())]
        if req.forecast:
            if self.capacity is None:
                raise UsageError("this daemon keeps no capacity history")
            history = await trio.to_thread.run_sync(self.capacity.history)
            f = forecast(history)
            result["forecast"] = {
                "verdict": f.verdict, "text": f.text(), "samples": f.samples,
                "span_s": f.span_s, "level": f.level, "budget": f.budget,
                "slope_per_day": f.slope_per_day, "days_to_full": f.days_to_full,
                "working_set": [{"tenant": t, "day": d, "week": w} for t, (d, w)
                                in self.capacity.working_sets().items()]}
        return result


def _row(name: str, t: "Tally | None") -> dict:
    if t is None:
        return {"name": name, "read": {}, "hit_ratio": None, "stall_s": 0.0}
    ratio = t.hit_ratio()
    return {"name": name, "read": dict(t.read), "stall_s": round(t.stall_s, 3),
            "hit_ratio": None if ratio is None else round(ratio, 4),
            "first": t.first, "last": t.last}


_OPS: dict[type[Request], Callable[..., Any]] = {
    StatusRequest: ControlServer.status, WarmRequest: ControlServer.warm,
    EvictRequest: ControlServer.evict, UnpinRequest: ControlServer.unpin,
    UsageRequest: ControlServer.usage_of, ReportRequest: ControlServer.report,
    JobFilesRequest: ControlServer.job_files, PodRequest: ControlServer.pod,
    NearGcRequest: ControlServer.near_gc}


def prepare_socket_dir(path: str) -> str:
    """Make the socket's directory ours and private; before the mount exists, so a
    problem is one start-up error. Returns the directory used.

    A directory someone else owns is never used. The /tmp fallback's fixed name
    (tierfs/runpaths.py), which any user can take first, is then left where it is (in
    sticky /tmp only its owner or root can move it) and a dir of our own is made beside
    it, with one WARNING; anywhere else it is refused."""
    run_dir = os.path.dirname(path)
    uid = os.getuid()
    try:
        made = _make_dir(run_dir)
        st = os.lstat(run_dir)
        if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):
            if run_dir != runpaths.tmp_dir(uid):
                raise StartupError(f"{run_dir} (for the control socket) belongs to uid "
                                   f"{st.st_uid}, not to this user: remove it")
            squatted, run_dir = run_dir, tempfile.mkdtemp(prefix=f"tierfs-{uid}.",
                                                         dir=runpaths.TMP)
            made = True
            log.warning("%s is not this user's (%s of uid %d; another user made it first?): "
                        "the control socket is in %s instead; root can remove %s",
                        squatted, "a directory" if stat.S_ISDIR(st.st_mode) else "a file",
                        st.st_uid, run_dir, squatted)
        if made and os.geteuid() != uid:
            # a daemon started as root with a user's real uid (setpriv --ruid) mounts for
            # that user (user_id= in mountinfo): its dir is that user's, where clients look
            os.chown(run_dir, uid, os.getgid())
        os.chmod(run_dir, 0o700)
    except OSError as exc:
        raise StartupError(f"cannot create {run_dir} for the control socket: "
                           f"{exc.strerror}") from None
    return run_dir


def _make_dir(path: str) -> bool:
    """mkdir -p path (0700); True if path itself was made now."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    return True


async def _read_line(stream: trio.SocketStream) -> bytes:
    """The request line: at most MAX_REQUEST bytes, complete within IDLE_TIMEOUT_S (a
    client that connects and says nothing does not hold a connection for ever)."""
    buf = bytearray()
    with trio.move_on_after(IDLE_TIMEOUT_S) as idle:
        while b"\n" not in buf:
            data = await stream.receive_some(1 << 16)
            if not data:
                raise UsageError("the request ended before its newline")
            buf += data
            if buf.find(b"\n") > MAX_REQUEST or (b"\n" not in buf and len(buf) > MAX_REQUEST):
                raise UsageError(f"request larger than {MAX_REQUEST} bytes")
    if idle.cancelled_caught:
        raise UsageError(f"no complete request within {IDLE_TIMEOUT_S:g}s")
    return bytes(buf[:buf.index(b"\n")])


# ops a status reader has always found, counted or not (the rest appear once they happen)
_STATUS_OPS = ("get", "list", "head", "put")


def _per_op(m: Metrics, name: str) -> dict[str, float]:
    """{op: count} of a backend counter: the ops above plus every op label it has a
    sample for (the runner labels each request with its op: tierfs/backend/runner.py)."""
    counts = dict.fromkeys(_STATUS_OPS, 0.0)
    for family in m.registry.collect():
        for s in family.samples:
            if s.name == name:
                counts[s.labels["op"]] = s.value
    return counts


def _ratio(part: float, whole: float) -> float | None:
    return None if whole == 0 or math.isnan(whole) else round(part / whole, 4)
