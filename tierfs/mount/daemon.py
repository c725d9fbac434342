"""The composition root: checks, builds the object graph, mounts, runs, unmounts.

Start-up order matters: everything that can fail because of the user's input (mount
point, cache dir, bucket, credentials) is checked before the mount exists, so a failure
is one message and nothing to clean up. The mount is reported ready only once a stat of
the mount point has gone through the kernel and back.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import subprocess
from typing import Callable

import pyfuse3
import trio

from ..backend import open_backend, open_tier_backend
from ..backend.budget import mount_read_budget
from ..backend.health import PROBE_TIMEOUT_S, BackendHealth
from ..backend.runner import AsyncBackend
from ..cachedir import Layout, lock_cache_dir
from ..config import MountConfig
from ..errors import BackendError, StartupError
from ..index.probe import start_probe, stop_probes
from ..metrics import Metrics
from ..runpaths import control_socket
from ..tasks import Tasks
from ..writeback.files import WriteBack
from . import sdnotify
from .control import ControlServer, prepare_socket_dir
from .core import async_backend, build_core
from .fs import FuseOps
from .metricsserve import MetricsServer
from .mountinfo import Mount as MountEntry
from .mountinfo import answers, mount_at

log = logging.getLogger(__name__)

NEAR_START_S = 5.0  # the near store's bucket check at mount: longer, and it starts skipped


def check_mountpoint(path: str) -> None:
    mounted = mount_at(os.path.realpath(path))  # as the kernel records it
    if mounted is not None:
        _clear_dead_mount(mounted.mountpoint, mounted)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise StartupError(f"mount point {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise StartupError(f"mount point {path} is a stale FUSE mount: run "
                               f"'fusermount3 -u {path}' first") from None
        raise StartupError(f"mount point {path}: {exc.strerror}") from None
    if not os.path.isdir(path):
        raise StartupError(f"mount point {path} is not a directory")
    if mount_at(os.path.realpath(path)) is not None:
        raise StartupError(f"mount point {path} is already mounted")
    if os.listdir(path):
        raise StartupError(f"mount point {path} is not empty")


def _clear_dead_mount(path: str, mounted: MountEntry) -> None:
    """A mount on the mount point: a live one is an error; the dead FUSE mount a killed
    tierfs daemon left behind (kill -9, OOM) is removed, since nothing can use it and it
    would block every remount; another file system's is left to its owner, with the
    exact command. A stat() cannot tell: the kernel answers it from its cache."""
    alive = answers(path, timeout_s=10.0)
    if alive:
        raise StartupError(f"mount point {path} is already mounted")
    if alive is None:
        raise StartupError(f"mount point {path} is already mounted, and its daemon does not "
                           f"answer; if it is hung: 'fusermount3 -u -z {path}'")
    if mounted.fstype != "fuse.tierfs":
        raise StartupError(f"mount point {path} is a stale FUSE mount ({mounted.fstype}): "
                           f"run 'fusermount3 -u -z {path}' first")
    done = subprocess.run(["fusermount3", "-u", "-z", path], capture_output=True, text=True)
    if done.returncode != 0 or mount_at(path) is not None:
        raise StartupError(f"mount point {path} is a dead tierfs mount that could not be "
                           f"removed ({done.stderr.strip() or 'still mounted'}): run "
                           f"'fusermount3 -u -z {path}' as its owner or root")
    log.warning("removed the dead tierfs mount at %s (its daemon was killed)", path)


def _bound_malloc() -> None:
    """Serve allocations of 1 MiB and more from mmap, always.

    glibc raises its mmap threshold after the first large free, so later 8 MiB chunk
    buffers come from per-thread heaps that are never given back: RSS then grows far past
    the memory tier. A fixed threshold turns that dynamic behaviour off.
    """
    try:
        # the symbols the interpreter is linked with (libc among them): find_library
        # would run `ldconfig -p` in a child process at every mount
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError) as exc:
        log.info("could not bound malloc (%s): memory may grow past the memory tier", exc)


def _raise_read_ahead(mountpoint: str, kib: int = 1024) -> None:
    """Ask the kernel for 1 MiB read-ahead on this mount (default 128 KiB): root only."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.info("could not raise read_ahead_kb (%s): reads stay at the kernel default", exc)


async def serve(cfg: MountConfig, on_ready: Callable[[], None]) -> None:
    if cfg.bounded_memory:
        _bound_malloc()
    check_mountpoint(cfg.mountpoint)
    cache_dir = cfg.effective_cache_dir
    lock_fd = lock_cache_dir(cache_dir)
    try:
        # the index walk in a child process (~0.1-0.4 s) runs while this one imports boto3
        # and checks the bucket; MetaStore takes its answer (tierfs/index/meta.py)
        start_probe(Layout(cache_dir).index)
        await _serve_locked(cfg, cache_dir, on_ready)
    finally:
        stop_probes()
        os.close(lock_fd)


async def _serve_locked(cfg: MountConfig, cache_dir: str, on_ready: Callable[[], None]) -> None:
    prepare_socket_dir(control_socket(cfg.mountpoint))
    metrics = Metrics()
    backend = async_backend(cfg, open_backend(cfg), metrics)
    health = backend.health = BackendHealth(metrics, _probe_check(cfg))
    await _check_store(cfg, cache_dir, backend, health)
    near = await _open_near(cfg, metrics) if cfg.tier is not None else None
    budget = mount_read_budget(cfg)
    log.info("worst-case time to EIO for a read of uncached data: %.0f s (store hangs: "
             "%.0f s, unreachable: %.0f s; see docs/operations.md)", budget.worst,
             budget.hang, budget.unreachable)
    async with build_core(cfg, backend, metrics=metrics, near=near) as core:
        if cfg.metrics_addr:  # from this trio loop: never a thread per connection
            metrics_server = MetricsServer(metrics)
            await metrics_server.bind(cfg.metrics_addr)
            core.tasks.supervise("metrics-server", metrics_server.serve)
        wb = core.writeback
        control = ControlServer(
            control_socket(cfg.mountpoint), core.warmer, core.cache, metrics,
            info={"mountpoint": cfg.mountpoint, "source": str(cfg.source),
                  "cache_dir": cache_dir},
            uploads_pending=wb.pending, warm_concurrency=cfg.warm_concurrency,
            peers=core.peers, usage=core.usage, capacity=core.capacity, stalls=core.stalls,
            near=core.near_status, near_gc=core.near_gc if core.near is not None else None)
        ops = FuseOps(cfg, core.namespace, core.fileio, core.cache, metrics)
        options = set(pyfuse3.default_options)
        options |= {"fsname=tierfs", "subtype=tierfs", "default_permissions"}
        if cfg.read_only:
            options.add("ro")
        if cfg.allow_other:
            options.add("allow_other")
        why = "stopping on an error (logged next)"  # the log says why the daemon stopped
        mounted = False
        try:
            async with trio.open_nursery() as nursery:
                # the control socket before the mount: whoever sees the mount in
                # /proc/mounts (tierfs_mounts) can reach it (CI saw FileNotFoundError on
                # the socket of a mount just up, test_control_socket_is_private...)
                await nursery.start(_serve_control, control, core.tasks)
                pyfuse3.init(ops, cfg.mountpoint, options)
                mounted = True
                nursery.start_soon(_stop_on_signal)
                nursery.start_soon(_announce_ready, cfg.mountpoint, on_ready)
                await pyfuse3.main()
                why = _stop_reason or "unmounted from outside (tierfs unmount, fusermount -u)"
                # systemd: stopping; give the stop timeout room for the bounded drain
                sdnotify.notify("STOPPING=1", f"STATUS=stopping: uploading pending files "
                                f"(up to {cfg.drain_timeout:g}s)",
                                sdnotify.extend_timeout(stop_bound(cfg)))
                await _drain(wb, cfg.drain_timeout)
                nursery.cancel_scope.cancel()
        finally:
            if mounted:
                pyfuse3.close(unmount=True)
                log.info("unmounted %s: %s", cfg.mountpoint, why)
        core.cancel()
        stopping = trio.current_time()
    # U3 of issue 26: an unmount that waited half a minute said nothing; say what it took
    log.info("stopped: background tasks ended, index and usage flushed in %.1fs",
             trio.current_time() - stopping)


async def _drain(wb: WriteBack, timeout_s: float) -> None:
    """The unmount's wait for pending uploads, said in the log: how many it waits for
    (none: no wait at all), how long it took, what is left."""
    pending = wb.pending()
    if not pending:
        log.info("unmount: no pending uploads, nothing to wait for")
        return
    log.info("unmount: waiting up to %gs for %d pending uploads", timeout_s, pending)
    started = trio.current_time()
    if await wb.drain(timeout_s):
        log.info("unmount: %d pending uploads done in %.1fs", pending,
                 trio.current_time() - started)
    else:
        log.warning("unsaved files remain (%d of %d after %.1fs); they are journaled and "
                    "will be uploaded at the next mount of this cache dir", wb.pending(),
                    pending, trio.current_time() - started)


def _probe_check(cfg: MountConfig) -> Callable[[], None]:
    """The health probe's bucket check: one attempt and short timeouts, on a client of its
    own, made at the first probe (most mounts never need one; a boto3 client costs ~0.2 s
    of CPU at start)."""
    probe = cfg.model_copy(update={"backend_timeout": PROBE_TIMEOUT_S, "backend_retries": 1,
                                   "backend_concurrency": 1, "warm_concurrency": 1})
    client: list = []  # the probes run one at a time (health.py), so no lock

    def check() -> None:
        if not client:
            client.append(open_backend(probe))
        client[0].check()

    return check


async def _open_near(cfg: MountConfig, metrics: Metrics) -> AsyncBackend:
    """The near store of --tier, checked like the source but never waited for: a near
    store that does not answer within NEAR_START_S starts skipped (reads go to the source)
    and probed until it answers; one that answers no (no such bucket, access denied) is a
    start-up error, because a wrong setting should not pass for an outage."""
    near = async_backend(cfg, open_tier_backend(cfg), metrics, "near")
    assert near.health is not None
    try:
        await near.health.start(near.sync.check, min(cfg.startup_timeout, NEAR_START_S))
    except BackendError as exc:
        raise StartupError(f"near store {cfg.tier}: {exc}") from None
    return near


async def _check_store(cfg: MountConfig, cache_dir: str, backend: AsyncBackend,
                       health: BackendHealth) -> None:
    """The bucket check before mounting. A cache dir with an index from an earlier mount has
    something to serve: if the store does not answer within --startup-timeout, the mount
    starts degraded (tierfs/backend/health.py: the cache is served, the store probed until it
    answers). Without an index there is nothing to serve, and any failure is the one
    start-up error line."""
    try:
        if os.path.exists(os.path.join(cache_dir, "index", "data.mdb")):
            await health.start(backend.sync.check, cfg.startup_timeout)
        else:
            await backend.check()
    except BackendError as exc:
        raise StartupError(str(exc)) from None


async def _serve_control(control: ControlServer, tasks: Tasks,
                         task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
    """The control socket. Failing to open it is a start-up error; failing later (a bug)
    must not end the mount: it is reported and the server runs again under the supervisor."""
    opened = False

    class _Opened:
        def started(self, value: None = None) -> None:
            nonlocal opened
            opened = True
            task_status.started(value)

    try:
        await control.serve(_Opened())
    except Exception as exc:  # after start, the supervisor's business
        if not opened:
            raise
        tasks.report("control", exc)
        tasks.supervise("control", control.serve)


async def _announce_ready(mountpoint: str, on_ready: Callable[[], None]) -> None:
    await trio.to_thread.run_sync(_raise_read_ahead, mountpoint)
    on_ready()


def stop_bound(cfg: MountConfig) -> float:
    """The longest a stop can take, for systemd's stop timeout: the drain, then backend
    calls already under way when it ends - a worker thread cannot be cancelled, so each
    runs out its whole retry budget (backend/budget.py) - then the unmount and the index
    flush (30 s of slack)."""
    return cfg.drain_timeout + mount_read_budget(cfg).worst + 30.0


_stop_reason: str | None = None  # set when the daemon ends the mount itself


async def _stop_on_signal() -> None:
    global _stop_reason
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for sig in signals:
            log.info("signal %s: unmounting", signal.Signals(sig).name)
            _stop_reason = f"stopped by signal {signal.Signals(sig).name}"
            pyfuse3.terminate()
            return
