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

from tierfs.backend.base import Backend
from tierfs.backend.file import FileBackend
from tierfs.cache import Admission, ChunkCache
from tierfs.cache.disk import DiskTier
from tierfs.cache.evictor import Evictor
from tierfs.cache.memory import MemoryTier
from tierfs.config import MountConfig, Source
from tierfs.mount.core import Core, build_core
from tierfs.cache.tier import Want
from tierfs.read.walk import TierWalk
from tierfs.files.fileio import FileIO
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore
from tierfs.metrics import Metrics
from tierfs.files.namespace import Namespace

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


def write(src: str, key: str, data: bytes) -> bytes:
    """Put `data` under `key` in a FileBackend's source dir; returns it."""
    path = os.path.join(src, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return data


async def resolve(ns: Namespace, path: str):
    """The inode of `path` ("a/b.bin"), looked up name by name from the root."""
    node = ns.inode(ROOT_INO)
    for part in path.split("/"):
        node = await ns.lookup(node.ino, part.encode())
    return node


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
    """A ChunkCache wired as tierfs/mount/daemon.py wires it, with the clock and statvfs seams."""
    clock = clock or FakeClock()
    metrics = Metrics()
    meta = MetaStore(os.path.join(root, "index"), source, map_size=64 << 20)
    disk = DiskTier(root, block_size)
    evictor = Evictor(root, cache_size=cache_size, min_free_ratio=min_free_ratio, high=high,
                      low=low, half_life=half_life, statvfs=statvfs)
    memory = MemoryTier(memory_bytes)
    # history and LRU's shadow sized as the daemon sizes them, for chunks of one block
    admission = Admission(half_life, cache_size // block_size, int(high * cache_size))
    cache = ChunkCache(meta, disk, memory, evictor, metrics, admission=admission, clock=clock)
    return CacheRig(root, meta, disk, memory, evictor, cache, metrics, clock)


@dataclass
class CoreRig:
    """The daemon's core without the FUSE adapter (tierfs/mount/core.py), over a FileBackend
    unless a backend was given."""

    src: str | None  # the FileBackend's directory, when the backend is one
    backend: Backend
    ns: Namespace
    io: FileIO
    walk: TierWalk
    cache_rig: CacheRig
    metrics: Metrics
    clock: FakeClock
    core: Core  # everything else build_core wired: writeback, warmer, tasks...

    def gets(self) -> float:
        return sample(self.metrics, "tierfs_backend_requests_total", {"op": "get"})

    def lists(self) -> float:
        return sample(self.metrics, "tierfs_backend_requests_total", {"op": "list"})

    def internal_errors(self, task: str) -> float:
        return sample(self.metrics, "tierfs_internal_errors_total", {"task": task})


def core_config(tmp: str, *, source: Source, chunk_size: int = 64 << 10,
                memory_bytes: int = 8 << 20, cache_size: int = 64 << 20, ttl_s: float = 60.0,
                readahead: int = 4, **options: object) -> MountConfig:
    """The MountConfig of an in-process core: cache dir TMP/cache, no mount point."""
    return MountConfig(source=source, mountpoint=os.path.join(tmp, "mnt"),
                       cache_dir=os.path.join(tmp, "cache"), chunk_size=chunk_size,
                       memory_cache_size=memory_bytes, cache_size=cache_size,
                       metadata_ttl=ttl_s, readahead_chunks=readahead, backend_concurrency=8,
                       **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def core(tmp: str, *, chunk_size: int = 64 << 10, block_size: int = 16 << 10,
               memory_bytes: int = 8 << 20, cache_size: int = 64 << 20, ttl_s: float = 60.0,
               readahead: int = 4, backend: Backend | None = None,
               bucket: str | None = None, root_prefix: str = "",
               statvfs: Callable[[str], os.statvfs_result] = plenty_of_space,
               clock: FakeClock | None = None, near: Backend | None = None,
               **options: object) -> AsyncIterator[CoreRig]:
    """The core as the daemon builds it (tierfs.mount.core.build_core), with a fake clock and
    statvfs: the cache dir recovered, the journal recovered, background services running;
    on exit the services stop, background fills and read-ahead finish, and the chunk
    index is flushed and closed (as at unmount).

    The backend is a FileBackend on TMP/src unless one is given (the backend suite passes
    an S3Backend, the fault tests a FaultBackend); `src` is then None. `near`: a near
    store (--tier, docs/tiers.md), the `tier` option naming it unless given. `options`
    are further MountConfig fields (writeback=True, dirty_wait=...)."""
    src = None
    if backend is None:
        src = os.path.join(tmp, "src")
        os.makedirs(src, exist_ok=True)
        backend = FileBackend(src)
        source = Source("file", src, "")
    elif bucket is None or os.path.isabs(bucket):
        source = Source("file", bucket or "/", "")
    else:
        source = Source("s3", bucket, root_prefix)
    if near is not None and "tier" not in options:
        options["tier"] = Source("file", getattr(near, "root", "/near"), "")
    cfg = core_config(tmp, source=source, chunk_size=chunk_size, memory_bytes=memory_bytes,
                      cache_size=cache_size, ttl_s=ttl_s, readahead=readahead, **options)
    clock = clock or FakeClock()
    async with build_core(cfg, backend, clock=clock, statvfs=statvfs, block_size=block_size,
                          index_map_size=64 << 20, near=near) as c:
        rig = CacheRig(cfg.effective_cache_dir, c.meta, c.disk, c.memory, c.evictor, c.cache,
                       c.metrics, clock)
        yield CoreRig(src, backend, c.namespace, c.fileio, c.walk, rig, c.metrics, clock, c)


async def chunk(walk: TierWalk, obj, index: int, **want) -> bytes | memoryview:
    """A whole chunk through the read walk (Want's options: background, access...)."""
    return (await walk.read(Want(obj, index, **want))).data
