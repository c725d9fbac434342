"""Seams and builders shared by the unit tests (importable as `unitkit`).

Only the constructor seams tierfs offers are faked here: a clock and statvfs. Everything
else is real: MetaStore on LMDB in a tmp dir, DiskTier on a tmp dir, FileBackend on a tmp
dir, trio.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import trio

from tierfs.backend.base import Backend
from tierfs.backend.file import FileBackend
from tierfs.backend.runner import AsyncBackend
from tierfs.cache import ChunkCache
from tierfs.cache.disk import DiskTier
from tierfs.cache.evictor import Evictor
from tierfs.cache.memory import MemoryTier
from tierfs.fetch import Fetcher
from tierfs.fileio import FileIO
from tierfs.meta import MetaStore
from tierfs.metrics import Metrics
from tierfs.namespace import Namespace
from tierfs.prefetch import Prefetcher
from tierfs.tasks import Tasks

SOURCE = "file:///src"


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def statvfs_result(total_bytes: int, avail_bytes: int, frsize: int = 4096) -> os.statvfs_result:
    blocks, avail = total_bytes // frsize, max(0, avail_bytes) // frsize
    return os.statvfs_result((frsize, frsize, blocks, avail, avail, 1 << 20, 1 << 20, 1 << 20,
                              0, 255))


def plenty_of_space(path: str) -> os.statvfs_result:
    """A 1 PiB filesystem that is half empty: the free-space guard never binds."""
    return statvfs_result(1 << 50, 1 << 49)


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def chunk_files(root: str) -> dict[str, int]:
    """{chunk file name: size} of every file under ROOT/chunks."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, "chunks")):
        for f in files:
            out[f] = os.path.getsize(os.path.join(dirpath, f))
    return out


@dataclass
class CacheRig:
    root: str
    meta: MetaStore
    disk: DiskTier
    memory: MemoryTier
    evictor: Evictor
    cache: ChunkCache
    metrics: Metrics
    clock: FakeClock

    def close(self) -> None:
        self.meta.close()


def make_cache(root: str, *, cache_size: int, memory_bytes: int = 0, block_size: int = 4096,
               statvfs: Callable[[str], os.statvfs_result] = plenty_of_space,
               clock: FakeClock | None = None, half_life: float = 1800.0,
               min_free_ratio: float = 0.10, high: float = 0.95, low: float = 0.90,
               source: str = SOURCE) -> CacheRig:
    """A ChunkCache wired as tierfs/daemon.py wires it, with the clock and statvfs seams."""
    clock = clock or FakeClock()
    metrics = Metrics()
    meta = MetaStore(os.path.join(root, "index"), source, map_size=64 << 20)
    disk = DiskTier(root, block_size)
    evictor = Evictor(root, cache_size=cache_size, min_free_ratio=min_free_ratio, high=high,
                      low=low, half_life=half_life, statvfs=statvfs)
    memory = MemoryTier(memory_bytes)
    cache = ChunkCache(meta, disk, memory, evictor, metrics, clock=clock)
    return CacheRig(root, meta, disk, memory, evictor, cache, metrics, clock)


@dataclass
class CoreRig:
    """The read path of the daemon without the FUSE adapter, over a FileBackend."""

    src: str | None  # the FileBackend's directory, when the backend is one
    backend: Backend
    ns: Namespace
    io: FileIO
    fetcher: Fetcher
    cache_rig: CacheRig
    metrics: Metrics
    clock: FakeClock

    def gets(self) -> float:
        return sample(self.metrics, "tierfs_backend_requests_total", {"op": "get"})

    def lists(self) -> float:
        return sample(self.metrics, "tierfs_backend_requests_total", {"op": "list"})


@contextlib.asynccontextmanager
async def core(tmp: str, *, chunk_size: int = 64 << 10, block_size: int = 16 << 10,
               memory_bytes: int = 8 << 20, cache_size: int = 64 << 20, ttl_s: float = 60.0,
               readahead: int = 4, backend: Backend | None = None,
               bucket: str | None = None, root_prefix: str = "") -> AsyncIterator[CoreRig]:
    """Build the core as tierfs/daemon.py does: recover the cache dir, then a nursery with
    the fetcher, prefetcher, namespace and fileio; on exit wait for background fills and
    read-ahead, flush the chunk index and close it (as serve() does on unmount).

    The backend is a FileBackend on TMP/src unless one is given (the backend suite passes
    an S3Backend); `src` is then None."""
    src = None
    if backend is None:
        src = os.path.join(tmp, "src")
        os.makedirs(src, exist_ok=True)
        backend = FileBackend(src)
        bucket = src
    clock = FakeClock()
    rig = make_cache(os.path.join(tmp, "cache"), cache_size=cache_size,
                     memory_bytes=memory_bytes, block_size=block_size, clock=clock)
    metrics = rig.metrics
    abackend = AsyncBackend(backend, metrics, concurrency=8, background=readahead)
    try:
        await trio.to_thread.run_sync(rig.cache.recover)
        async with trio.open_nursery() as nursery:
            tasks = Tasks(nursery, metrics)
            fetcher = Fetcher(abackend, rig.cache, chunk_size, tasks)
            prefetcher = Prefetcher(fetcher, rig.cache, metrics, tasks, max_window=readahead,
                                    max_queued=2 * readahead)
            ns = Namespace(rig.meta, abackend, metrics, root_prefix=root_prefix, ttl_s=ttl_s,
                           clock=clock)
            io = FileIO(ns, rig.cache, fetcher, prefetcher, metrics, bucket=bucket or "")
            yield CoreRig(src, backend, ns, io, fetcher, rig, metrics, clock)
        await rig.cache.flush_index()
    finally:
        rig.close()
