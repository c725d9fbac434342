"""In-process write-back rig: WriteBack over a real chunk cache, index and backend, with a
small fault switchboard in front of the backend. No FUSE, no daemon: the upload workers and
the orphan cleanup run in the test's trio nursery, as the daemon runs them.

    async with wb_rig(tmp_path, FaultyBackend(FileBackend(src))) as r:
        await r.write_file(7, "a.bin", data)           # open, write, close (journaled)
        await r.settled()                              # every file uploaded

FaultyBackend: `down` (every upload/multipart call raises BackendUnavailable), `fail(op,
n, exc[, part=])` (the next n calls of op - of that part - raise exc), `poisoned` (keys
whose uploads raise AccessDenied), `lose_create_answers` (CreateMultipartUpload happens on the server, then
BackendUnavailable: the answer was lost), `vanish_uploads` (the next n multipart uploads
are aborted on the server before their first part, as another client or an expiry rule
would); `calls` counts every call by op.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import threading
from dataclasses import dataclass
from typing import AsyncIterator

import trio

from tierfs.backend.base import Backend
from tierfs.backend.file import FileBackend
from tierfs.backend.runner import AsyncBackend
from tierfs.cache import Admission, ChunkCache, ObjectVersion
from tierfs.cache.disk import DiskTier
from tierfs.cache.evictor import Evictor
from tierfs.cache.memory import MemoryTier
from tierfs.errors import AccessDenied, BackendUnavailable
from tierfs.index.meta import MetaStore
from tierfs.metrics import Metrics
from tierfs.writeback import DirtyFile, WriteBack

MiB = 1 << 20
UPLOAD_OPS = {"put", "copy", "mpu_create", "upload_part", "upload_part_copy", "mpu_complete",
              "mpu_abort", "mpu_list"}


class FaultyBackend:
    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        self.down = False
        self.poisoned: set[str] = set()
        self.lose_create_answers = 0
        self.vanish_uploads = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self._fail: dict[str, list] = {}
        self._lock = threading.Lock()
        self._vanishing: set[str] = set()

    def fail(self, op: str, n: int, exc: BaseException, *, part: int | None = None) -> None:
        """The next n calls of op (of that part number only, if given) raise exc."""
        with self._lock:
            self._fail.setdefault(op, []).extend([(exc, part)] * n)

    def _gate(self, op: str, key: str | None = None, part: int | None = None) -> None:
        with self._lock:
            self.calls[op] += 1
            if self.down and op in UPLOAD_OPS:
                raise BackendUnavailable(f"injected: store down ({op} {key})")
            if key in self.poisoned and op in UPLOAD_OPS - {"mpu_abort", "mpu_list"}:
                raise AccessDenied(f"injected: {key} may not be written")
            queue = self._fail.get(op, [])
            for i, (exc, only) in enumerate(queue):
                if only is None or only == part:
                    del queue[i]
                    raise exc

    def __getattr__(self, op: str):  # reads and anything not intercepted below
        fn = getattr(self.inner, op)

        def call(*args, **kw):
            self._gate(op, args[0] if args and isinstance(args[0], str) else None)
            return fn(*args, **kw)

        return call

    def put(self, key, data, metadata=None):
        self._gate("put", key)
        return self.inner.put(key, data, metadata)

    def mpu_create(self, key, metadata=None):
        self._gate("mpu_create", key)
        upload_id = self.inner.mpu_create(key, metadata)
        with self._lock:
            if self.vanish_uploads:
                self.vanish_uploads -= 1
                self._vanishing.add(upload_id)
            if self.lose_create_answers:
                self.lose_create_answers -= 1
                raise BackendUnavailable(f"injected: the answer to creating {upload_id} was lost")
        return upload_id

    def upload_part(self, key, upload_id, part, data):
        self._gate("upload_part", key, part)
        with self._lock:
            vanish = upload_id in self._vanishing
            self._vanishing.discard(upload_id)
        if vanish:
            self.inner.mpu_abort(key, upload_id)
        return self.inner.upload_part(key, upload_id, part, data)

    def mpu_complete(self, key, upload_id, parts):
        self._gate("mpu_complete", key)
        return self.inner.mpu_complete(key, upload_id, parts)

    def mpu_abort(self, key, upload_id):
        self._gate("mpu_abort", key)
        return self.inner.mpu_abort(key, upload_id)

    def mpu_list(self, key):
        self._gate("mpu_list", key)
        return self.inner.mpu_list(key)


def file_backend(tmp_path) -> tuple[FaultyBackend, FileBackend]:
    """A FaultyBackend over a FileBackend on TMP/src, and that FileBackend (to look at what
    the store holds without going through the faults)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    inner = FileBackend(str(src))
    return FaultyBackend(inner), inner


def payload(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _plenty(path: str) -> os.statvfs_result:
    f = 4096
    return os.statvfs_result((f, f, (1 << 50) // f, (1 << 49) // f, (1 << 49) // f,
                              1 << 20, 1 << 20, 1 << 20, 0, 255))


@dataclass
class Rig:
    wb: WriteBack
    backend: FaultyBackend
    meta: MetaStore
    cache: ChunkCache
    metrics: Metrics
    nursery: trio.Nursery

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def failures(self) -> float:
        return self.sample("tierfs_writeback_uploads_total", {"outcome": "failure"})

    async def open(self, ino: int, key: str, base: ObjectVersion | None = None) -> DirtyFile:
        return self.wb.open(ino, key, base, truncate=base is None, metadata={})

    async def write_file(self, ino: int, key: str, data: bytes, *, piece: int = MiB) -> None:
        """open, write in pieces, close: journaled (write-back) or uploaded (default)."""
        d = await self.open(ino, key)
        try:
            for off in range(0, len(data), piece):
                await self.wb.write(d, off, data[off:off + piece])
            await self.wb.flush(d)
        finally:
            await self.wb.release(d)

    async def settled(self, timeout_s: float = 60.0) -> None:
        """Wait until every file is uploaded (nothing dirty left)."""
        with trio.fail_after(timeout_s):
            while self.wb.files:
                await trio.sleep(0.02)

    async def wait_for(self, check, timeout_s: float = 30.0) -> None:
        with trio.fail_after(timeout_s):
            while not check():
                await trio.sleep(0.02)


@contextlib.asynccontextmanager
async def wb_rig(root, backend: FaultyBackend, *, bucket: str = "bucket",
                 writeback: bool = True, chunk_size: int = MiB, cache_size: int = 256 * MiB,
                 dirty_wait_s: float = 0.5, workers: int = 4) -> AsyncIterator[Rig]:
    """WriteBack wired as the daemon wires it (journal recovered, `workers` uploaders and
    the orphan cleanup running), on ROOT/cache; retry delays shrunk to tens of ms.
    Leaving the block is an unmount without drain: what is not uploaded stays journaled."""
    cache_dir = os.path.join(str(root), "cache")
    os.makedirs(cache_dir, exist_ok=True)
    metrics = Metrics()
    meta = MetaStore(os.path.join(cache_dir, "index"), f"test://{bucket}", map_size=64 << 20)
    try:
        disk = DiskTier(cache_dir, 4096)
        evictor = Evictor(cache_dir, cache_size=cache_size, min_free_ratio=0.1, high=0.95,
                          low=0.9, half_life=1800.0, statvfs=_plenty)
        cache = ChunkCache(meta, disk, MemoryTier(0), evictor, metrics,
                           admission=Admission(1800.0, cache_size // 4096,
                                               int(0.95 * cache_size)))
        await trio.to_thread.run_sync(cache.recover)
        abackend = AsyncBackend(backend, metrics, concurrency=8, background=4)

        async def read_base(base: ObjectVersion, index: int) -> bytes:
            return await abackend.get(base.key, index * chunk_size, chunk_size, base.etag)

        wb = WriteBack(meta, cache, abackend, metrics, bucket=bucket, cache_dir=cache_dir,
                       chunk_size=chunk_size, writeback=writeback, dirty_wait_s=dirty_wait_s,
                       read_base=read_base, retry_min_s=0.05, retry_max_s=0.4,
                       part_retry_s=0.01)
        wb.recover()
        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(wb.run_uploader)
            nursery.start_soon(wb.run_orphan_cleanup)
            yield Rig(wb, backend, meta, cache, metrics, nursery)
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await cache.flush_index()
    finally:
        meta.close()
