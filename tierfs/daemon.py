"""The composition root: checks, builds the object graph, mounts, runs, unmounts.

Start-up order matters: everything that can fail because of the user's input (mount
point, cache dir, bucket, credentials) is checked before the mount exists, so a failure
is one message and nothing to clean up. The mount is reported ready only once a stat of
the mount point has gone through the kernel and back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import signal
from typing import Callable

import pyfuse3
import trio

from . import sdnotify
from .backend import open_backend
from .backend.runner import AsyncBackend
from .cache import ChunkCache
from .cache.disk import DiskTier
from .cache.evictor import Evictor
from .cache.memory import MemoryTier
from .config import MountConfig
from .control import ControlServer, prepare_socket_dir
from .errors import BackendError, StartupError
from .fetch import Fetcher
from .fileio import FileIO
from .fs import FuseOps
from .meta import MetaStore
from .metrics import Metrics
from .namespace import Namespace
from .prefetch import Prefetcher
from .runpaths import control_socket
from .tasks import Tasks
from .warm import Warmer
from .writeback import WriteBack

log = logging.getLogger(__name__)

BLOCK_SIZE = 64 << 10  # checksum unit: a 4 KiB read verifies 64 KiB; 512 B of CRCs per 8 MiB


def check_mountpoint(path: str) -> None:
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
    if os.path.ismount(path):
        raise StartupError(f"mount point {path} is already mounted")
    if os.listdir(path):
        raise StartupError(f"mount point {path} is not empty")


def prepare_cache_dir(path: str) -> None:
    """Create the cache dir and prove it is writable."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".write-test")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(f"cache dir {path} is not writable: {exc.strerror}") from None


def lock_cache_dir(path: str) -> int:
    """Lock the cache dir for this daemon; returns the lock fd (held for life)."""
    prepare_cache_dir(path)
    fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartupError(f"cache dir {path} is in use by another tierfs (pid {owner})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _bound_malloc() -> None:
    """Serve allocations of 1 MiB and more from mmap, always.

    glibc raises its mmap threshold after the first large free, so later 8 MiB chunk
    buffers come from per-thread heaps that are never given back: RSS then grows far past
    the memory tier. A fixed threshold turns that dynamic behaviour off.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
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
    prepare_socket_dir(control_socket(cfg.mountpoint))
    metrics = Metrics()
    backend = AsyncBackend(open_backend(cfg), metrics, concurrency=cfg.backend_concurrency,
                           background=cfg.readahead_chunks, warm=cfg.warm_concurrency)
    try:
        await backend.check()
    except BackendError as exc:
        raise StartupError(str(exc)) from None
    meta = MetaStore(os.path.join(cache_dir, "index"), str(cfg.source))
    disk = DiskTier(cache_dir, BLOCK_SIZE)
    evictor = Evictor(cache_dir, cache_size=cfg.cache_size, min_free_ratio=cfg.min_free_ratio,
                      high=cfg.evict_high, low=cfg.evict_low, half_life=cfg.heat_half_life)
    cache = ChunkCache(meta, disk, MemoryTier(cfg.memory_cache_size), evictor, metrics)
    kept, dropped = await trio.to_thread.run_sync(cache.recover)
    log.info("cache dir %s: %d chunks (%d bytes) kept, %d dropped", cache_dir, kept,
             cache.used_bytes, dropped)
    if cfg.metrics_addr:
        try:
            metrics.serve(cfg.metrics_addr)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {cfg.metrics_addr[0]}:"
                               f"{cfg.metrics_addr[1]}: {exc.strerror}") from None
    try:
        async with trio.open_nursery() as nursery:
            tasks = Tasks(nursery, metrics)
            fetcher = Fetcher(backend, cache, cfg.chunk_size, tasks)
            prefetcher = Prefetcher(fetcher, cache, metrics, tasks,
                                    max_window=cfg.readahead_chunks,
                                    max_queued=2 * cfg.readahead_chunks)
            wb = WriteBack(meta, cache, backend, metrics, bucket=cfg.source.bucket,
                           cache_dir=cache_dir, chunk_size=cfg.chunk_size,
                           writeback=cfg.writeback, dirty_wait_s=cfg.dirty_wait,
                           read_base=fetcher.read_through)
            recovered = wb.recover()
            if recovered:
                log.info("%d files with unsaved writes recovered from the journal", recovered)
            ns = Namespace(meta, backend, metrics, root_prefix=cfg.source.prefix,
                           ttl_s=cfg.metadata_ttl, has_local_writes=wb.is_dirty,
                           tasks=tasks)
            fileio = FileIO(ns, cache, fetcher, prefetcher, metrics, bucket=cfg.source.bucket,
                            writeback=wb, rename_max_objects=cfg.rename_max_objects)
            ops = FuseOps(cfg, ns, fileio, cache, metrics)
            warmer = Warmer(ns, cache, fetcher, metrics, bucket=cfg.source.bucket,
                            has_local_writes=wb.is_dirty)
            control = ControlServer(
                control_socket(cfg.mountpoint), warmer, cache, metrics,
                info={"mountpoint": cfg.mountpoint, "source": str(cfg.source),
                      "cache_dir": cache_dir},
                uploads_pending=wb.pending, warm_concurrency=cfg.warm_concurrency)
            options = set(pyfuse3.default_options)
            options |= {"fsname=tierfs", "subtype=tierfs", "default_permissions"}
            if cfg.read_only:
                options.add("ro")
            if cfg.allow_other:
                options.add("allow_other")
            pyfuse3.init(ops, cfg.mountpoint, options)
            try:
                nursery.start_soon(cache.run_flusher)
                for _ in range(4):
                    nursery.start_soon(wb.run_uploader)
                nursery.start_soon(wb.abort_orphaned_uploads)
                nursery.start_soon(_expire_pins, cache)
                await nursery.start(control.serve)
                nursery.start_soon(_stop_on_signal)
                nursery.start_soon(_announce_ready, cfg.mountpoint, on_ready)
                await pyfuse3.main()
                # systemd: stopping; give the stop timeout room for the bounded drain
                sdnotify.notify("STOPPING=1", f"STATUS=stopping: uploading pending files "
                                f"(up to {cfg.drain_timeout:g}s)",
                                sdnotify.extend_timeout(stop_bound(cfg)))
                if not await wb.drain(cfg.drain_timeout):
                    log.warning("unsaved files remain; they are journaled and will be "
                                "uploaded at the next mount of this cache dir")
                nursery.cancel_scope.cancel()
            finally:
                pyfuse3.close(unmount=True)
    finally:
        with trio.CancelScope(shield=True):
            await cache.flush_index()
        meta.close()
        os.close(lock_fd)
        log.info("unmounted %s", cfg.mountpoint)


async def _expire_pins(cache: ChunkCache, interval_s: float = 30.0) -> None:
    while True:
        for owner in cache.pins.expire():
            log.info("pin of %s expired", owner)
        await trio.sleep(interval_s)


async def _announce_ready(mountpoint: str, on_ready: Callable[[], None]) -> None:
    await trio.to_thread.run_sync(_raise_read_ahead, mountpoint)
    on_ready()


def stop_bound(cfg: MountConfig) -> float:
    """The longest a stop can take, for systemd's stop timeout: the drain, then backend
    calls already under way when it ends - a worker thread cannot be cancelled, so each
    runs out botocore's attempts (connect + read timeout each, backoff of up to 20 s
    between them) - then the unmount and the index flush (30 s of slack)."""
    attempt = min(cfg.backend_timeout, 10.0) + cfg.backend_timeout  # as backend/s3.py sets them
    return (cfg.drain_timeout + cfg.backend_retries * attempt
            + (cfg.backend_retries - 1) * 20.0 + 30.0)


async def _stop_on_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for sig in signals:
            log.info("signal %s: unmounting", signal.Signals(sig).name)
            pyfuse3.terminate()
            return
