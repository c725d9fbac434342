"""WriteBack: unsaved writes, their upload to the object store, and the journal.

A file opened for writing gets a DirtyFile: a sparse staging file in CACHE_DIR/dirty/
holding every chunk a writer touched ("materialized"), over a base version (the object
as it was when opened) for the chunks nobody touched. Partial writes into a base chunk
read it first (through the chunk cache) and write it into the staging file.

Upload: a file up to one part (max(chunk, 8 MiB)) is one PUT; a larger one is a multipart
upload whose untouched parts are copied server-side (UploadPartCopy with If-Match on the
base ETag) and the others uploaded from the staging file, several in parallel. The
object appears under its name only when the PUT or CompleteMultipartUpload succeeds:
never partially. The written chunks then enter the disk tier under the new ETag, so
reading back what was just written costs no GET.

Durability (the only copy of acknowledged data lives here until uploaded):
- default mode: flush (close) and fsync upload and return only when S3 has the object;
- write-back mode: flush fsyncs the staging file and journals the file in LMDB with a full
  sync before returning; a worker uploads it. fsync always uploads.
- A file being written when the daemon dies was never acknowledged: recovery deletes its
  staging file. Journaled files are uploaded again after a restart.
Dirty bytes count against the cache budget and are never evicted; writers wait up to
--dirty-wait for uploads to release budget, then get ENOSPC.

Concurrency: one trio.Lock per DirtyFile serializes writes, truncates and uploads of that
file (an upload sees one consistent generation). Staging I/O is page-cache pwrite/pread
on the trio thread; fsync and chunk-cache fills go to worker threads.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from .backend.runner import AsyncBackend
from .cache import ChunkCache, ObjectVersion
from .errors import NoSpace, TierfsError
from .meta import MetaStore
from .metrics import Metrics

log = logging.getLogger(__name__)

PART_MIN = 8 << 20  # S3 wants parts >= 5 MiB; 8 MiB keeps part counts low
RETRY_MAX_S = 60.0
_PENDING = "pending-"  # an uploads record made before CreateMultipartUpload answered

ReadBase = Callable[[ObjectVersion, int], Awaitable[bytes | memoryview]]


@dataclass
class DirtyFile:
    ino: int
    key: str
    base: ObjectVersion | None
    base_valid: int  # bytes of the base still part of the file (truncation lowers it)
    size: int
    staging: str
    fd: int
    metadata: dict[str, str]
    materialized: set[int] = field(default_factory=set)
    writers: int = 0
    generation: int = 1  # bumps on every change
    saved_generation: int = 0  # the generation the object store holds
    journaled: bool = False
    unlinked: bool = False
    upload_id: str | None = None
    lock: trio.Lock = field(default_factory=trio.Lock)

    @property
    def clean(self) -> bool:
        return self.generation == self.saved_generation

    def record(self) -> dict:
        base = None if self.base is None else [self.base.bucket, self.base.key, self.base.etag,
                                               self.base.size]
        return {"key": self.key, "base": base, "base_valid": self.base_valid, "size": self.size,
                "staging": self.staging, "materialized": sorted(self.materialized),
                "metadata": self.metadata, "upload_id": self.upload_id}


class WriteBack:
    def __init__(self, meta: MetaStore, cache: ChunkCache, backend: AsyncBackend,
                 metrics: Metrics, *, bucket: str, cache_dir: str, chunk_size: int,
                 writeback: bool, dirty_wait_s: float, read_base: ReadBase,
                 clock: Callable[[], float] = time.time) -> None:
        self.meta = meta
        self.cache = cache
        self.backend = backend
        self.metrics = metrics
        self.bucket = bucket
        self.chunk_size = chunk_size
        self.part_size = max(chunk_size, math.ceil(PART_MIN / chunk_size) * chunk_size)
        self.writeback = writeback
        self.dirty_wait_s = dirty_wait_s
        self.read_base = read_base
        self._clock = clock
        self.dir = os.path.join(cache_dir, "dirty")
        os.makedirs(self.dir, exist_ok=True)
        self.files: dict[int, DirtyFile] = {}
        self._queue_send, self._queue_recv = trio.open_memory_channel[int](math.inf)
        self._parts = trio.CapacityLimiter(4)  # parts in memory at once, per daemon

    # ---- lifecycle of a dirty file ----------------------------------------------------

    def get(self, ino: int) -> DirtyFile | None:
        return self.files.get(ino)

    def is_dirty(self, ino: int) -> bool:
        return ino in self.files

    def pending(self) -> int:
        """Files with writes the object store does not have yet."""
        return sum(1 for d in self.files.values() if not d.clean and not d.unlinked)

    def open(self, ino: int, key: str, base: ObjectVersion | None, *, truncate: bool,
             metadata: dict[str, str]) -> DirtyFile:
        d = self.files.get(ino)
        if d is None:
            path = os.path.join(self.dir, f"{ino}-{uuid.uuid4().hex[:12]}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            size = 0 if base is None else base.size
            d = DirtyFile(ino, key, base, size, size, path, fd, dict(metadata))
            if base is not None:
                d.generation = d.saved_generation = 1  # nothing written yet
            self.files[ino] = d
        d.writers += 1
        return d

    async def write(self, d: DirtyFile, offset: int, data: bytes) -> int:
        end = offset + len(data)
        cs = self.chunk_size
        async with d.lock:
            for index in range(offset // cs, (end - 1) // cs + 1):
                if index not in d.materialized:
                    await self._materialize(d, index, offset, end)
            os.pwrite(d.fd, data, offset)
            d.size = max(d.size, end)
            d.generation += 1
        return len(data)

    async def _materialize(self, d: DirtyFile, index: int, wstart: int, wend: int) -> None:
        cs = self.chunk_size
        if not await self.cache.reserve_dirty(cs, self.dirty_wait_s):
            log.error("write to %r refused (ENOSPC): unsaved writes would exceed the cache "
                      "budget and no upload freed space within %.0fs", d.key, self.dirty_wait_s)
            raise NoSpace(f"cache budget full of unsaved writes ({self.cache.dirty_bytes} bytes)")
        start = index * cs
        base_end = min(start + cs, d.base_valid)
        # bytes of the base in this chunk that the write does not cover must be kept
        if d.base is not None and base_end > start and not (wstart <= start and wend >= base_end):
            data = await self.read_base(d.base, index)
            os.pwrite(d.fd, data[:base_end - start], start)
        d.materialized.add(index)

    async def truncate(self, d: DirtyFile, size: int) -> None:
        cs = self.chunk_size
        async with d.lock:
            if size < d.size:
                d.base_valid = min(d.base_valid, size)
                gone = {i for i in d.materialized if i * cs >= size}
                d.materialized -= gone
                self.cache.release_dirty(len(gone) * cs)
            # past the new size the staging file reads zeros, and base_valid keeps the base
            # from showing through: a later extension reads zeros, as POSIX wants
            os.ftruncate(d.fd, size)
            d.size = size
            d.generation += 1

    async def read(self, d: DirtyFile, offset: int, size: int) -> bytes:
        end = min(offset + size, d.size)
        cs = self.chunk_size
        out = []
        for index in range(offset // cs, (max(end, offset + 1) - 1) // cs + 1):
            lo, hi = max(offset, index * cs), min(end, (index + 1) * cs)
            if lo >= hi:
                break
            if index in d.materialized:
                piece = os.pread(d.fd, hi - lo, lo)
                out.append(piece + bytes(hi - lo - len(piece)))  # a hole past EOF reads zeros
                continue
            based = max(lo, min(hi, d.base_valid))  # [lo, based) comes from the base
            if d.base is not None and based > lo:
                chunk = await self.read_base(d.base, index)
                out.append(chunk[lo - index * cs:based - index * cs])
            out.append(bytes(hi - based))
        return b"".join(out)

    def set_metadata(self, d: DirtyFile, metadata: dict[str, str]) -> None:
        d.metadata = dict(metadata)
        d.generation += 1

    # ---- making it durable ------------------------------------------------------------

    async def flush(self, d: DirtyFile) -> None:
        """close(): durable in S3 (default) or durable in the local journal (write-back)."""
        if d.unlinked or d.clean:
            return
        if self.writeback:
            async with d.lock:
                await self._journal(d)
            return
        await self.commit(d)

    async def commit(self, d: DirtyFile) -> None:
        """Upload now and return once the object store has this generation (fsync)."""
        async with d.lock:
            if d.unlinked or d.clean:
                return
            try:
                await self._upload(d)
            except TierfsError as exc:
                self.metrics.uploads.labels("failure").inc()
                log.error("upload of %r failed: %s; kept for retry", d.key, exc)
                with trio.CancelScope(shield=True):
                    await self._journal(d)
                self._queue_send.send_nowait(d.ino)
                raise
            self._after_upload(d)

    async def release(self, d: DirtyFile) -> None:
        """The last close of a writer: schedule the upload (write-back) or forget the file."""
        d.writers -= 1
        if d.writers > 0:
            return
        async with d.lock:  # an upload in progress still reads the staging file
            if d.writers > 0:
                return
            if d.unlinked or d.clean:
                self._forget(d)
            elif d.journaled:
                self._queue_send.send_nowait(d.ino)

    async def _journal(self, d: DirtyFile) -> None:
        await trio.to_thread.run_sync(os.fsync, d.fd)
        await trio.to_thread.run_sync(self.meta.put_dirty, d.ino, d.record())
        d.journaled = True

    async def discard(self, d: DirtyFile) -> None:
        """The file was unlinked: its unsaved data has nowhere to go."""
        d.unlinked = True
        async with d.lock:
            if d.writers == 0:
                self._forget(d)

    def _forget(self, d: DirtyFile) -> None:
        if self.files.get(d.ino) is not d:
            return
        del self.files[d.ino]
        self.cache.release_dirty(len(d.materialized) * self.chunk_size)
        os.close(d.fd)
        os.unlink(d.staging)
        if d.journaled:
            self.meta.delete_dirty(d.ino)

    def _after_upload(self, d: DirtyFile) -> None:
        if d.writers == 0:
            self._forget(d)
            return
        # still open (fsync): the next writes build on the version just uploaded
        self.cache.release_dirty(len(d.materialized) * self.chunk_size)
        d.materialized.clear()
        os.ftruncate(d.fd, 0)
        if d.journaled:
            self.meta.delete_dirty(d.ino)
            d.journaled = False

    async def _upload(self, d: DirtyFile) -> None:
        t0 = time.perf_counter()
        gen, size = d.generation, d.size
        if size <= self.part_size:
            data = await self.read(d, 0, size)
            etag = (await self.backend.put(d.key, data, d.metadata)).etag
        else:
            etag = await self._multipart(d, size)
        new = ObjectVersion(self.bucket, d.key, etag, size)
        await self._keep_in_cache(d, new)
        self._set_inode(d, new)
        d.base, d.base_valid, d.saved_generation = new, size, gen
        self.metrics.uploads.labels("success").inc()
        self.metrics.upload_seconds.observe(time.perf_counter() - t0)
        log.info("uploaded %r (%d bytes)", d.key, size)

    async def _multipart(self, d: DirtyFile, size: int) -> str:
        if d.upload_id is not None:  # left over from a failed attempt or a crash
            await self._abort(d.key, d.upload_id)
        # recorded before it exists: a crash before the id is known still leaves the key,
        # and recovery aborts that key's uploads (LMDB commits fsync: off the trio thread)
        pending = _PENDING + uuid.uuid4().hex
        await trio.to_thread.run_sync(self.meta.put_upload, pending, d.key)
        d.upload_id = await self.backend.mpu_create(d.key, d.metadata)
        await trio.to_thread.run_sync(self.meta.put_upload, d.upload_id, d.key)
        await trio.to_thread.run_sync(self.meta.delete_upload, pending)
        ps, cs = self.part_size, self.chunk_size
        count = -(-size // ps)
        etags: list[str] = [""] * count

        async def part(n: int) -> None:
            start = n * ps
            length = min(ps, size - start)
            touched = any(i in d.materialized for i in range(start // cs, (start + length - 1) // cs + 1))
            async with self._parts:
                if d.base is not None and not touched and start + length <= d.base_valid:
                    etags[n] = await self.backend.upload_part_copy(
                        d.key, d.upload_id, n + 1, d.base.key, d.base.etag, start, length)
                else:
                    data = await self.read(d, start, length)
                    etags[n] = await self.backend.upload_part(d.key, d.upload_id, n + 1, data)

        async with trio.open_nursery() as nursery:
            for n in range(count):
                nursery.start_soon(part, n)
        etag = await self.backend.mpu_complete(d.key, d.upload_id,
                                               [(n + 1, e) for n, e in enumerate(etags)])
        await trio.to_thread.run_sync(self.meta.delete_upload, d.upload_id)
        d.upload_id = None
        return etag

    async def _abort(self, key: str, upload_id: str) -> None:
        await self.backend.mpu_abort(key, upload_id)
        await trio.to_thread.run_sync(self.meta.delete_upload, upload_id)

    async def abort_orphaned_uploads(self) -> None:
        """Multipart uploads a crash left behind with no journaled file to finish them."""
        owned = {d.upload_id for d in self.files.values()}
        for upload_id, key in self.meta.uploads():
            if upload_id not in owned:
                try:
                    if upload_id.startswith(_PENDING):  # the id never reached us
                        for found in await self.backend.mpu_list(key):
                            if found not in owned:
                                await self.backend.mpu_abort(key, found)
                        await trio.to_thread.run_sync(self.meta.delete_upload, upload_id)
                        continue
                    await self._abort(key, upload_id)
                    log.info("aborted the unfinished upload of %r left by a crash", key)
                except TierfsError as exc:
                    log.warning("could not abort the unfinished upload of %r: %s", key, exc)

    async def _keep_in_cache(self, d: DirtyFile, new: ObjectVersion) -> None:
        """The uploaded bytes stay cached under the new ETag: restore on this node is free."""
        cs = self.chunk_size
        untouched = []
        for index in range(-(-new.size // cs)):
            start = index * cs
            length = min(cs, new.size - start)
            if index in d.materialized:
                data = os.pread(d.fd, length, start)
                data += bytes(length - len(data))
                await self.cache.fill(new, new.chunk_key(index), data)
            elif d.base is not None and start + length <= d.base_valid and d.base.key == new.key:
                untouched.append(index)
        if untouched and d.base is not None:
            await self.cache.rekey(d.base, new, untouched)

    def _set_inode(self, d: DirtyFile, new: ObjectVersion) -> None:
        node = self.meta.inode(d.ino)
        if node is not None:
            node.size, node.etag, node.mtime = new.size, new.etag, self._clock()
            node.validated_at = self._clock()
            self.meta.set_validated(node)

    # ---- background uploads and recovery -----------------------------------------------

    async def run_uploader(self) -> None:
        """Upload journaled files whose writers are gone; retry failures with backoff."""
        backoff: dict[int, float] = {}
        async for ino in self._queue_recv:
            d = self.files.get(ino)
            if d is None or d.writers > 0 or d.unlinked or d.clean:
                continue
            try:
                await self.commit(d)
                backoff.pop(ino, None)
            except TierfsError:
                delay = backoff[ino] = min(RETRY_MAX_S, backoff.get(ino, 0.5) * 2)
                log.warning("retrying upload of %r in %.0fs", d.key, delay)
                # commit() re-queued it; wait before taking the next item
                await trio.sleep(delay)

    def recover(self) -> int:
        """At start: requeue journaled files, delete staging files of unacknowledged ones."""
        keep = set()
        for ino, rec in self.meta.dirty_records():
            path = rec["staging"]
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                log.error("journaled file %r lost its staging file %s: cannot upload it",
                          rec["key"], path)
                self.meta.delete_dirty(ino)
                continue
            base = ObjectVersion(*rec["base"]) if rec["base"] else None
            d = DirtyFile(ino, rec["key"], base, rec["base_valid"], rec["size"], path, fd,
                          rec["metadata"], set(rec["materialized"]), journaled=True,
                          upload_id=rec.get("upload_id"))
            self.files[ino] = d
            self.cache.force_dirty(len(d.materialized) * self.chunk_size)
            keep.add(os.path.basename(path))
            self._queue_send.send_nowait(ino)
            log.info("recovered unsaved file %r (%d bytes): uploading", d.key, d.size)
        for name in os.listdir(self.dir):
            if name not in keep:
                os.unlink(os.path.join(self.dir, name))
        return len(keep)

    async def drain(self, timeout_s: float) -> bool:
        """At shutdown: give pending uploads up to timeout_s; True if nothing is left."""
        with trio.move_on_after(timeout_s):
            for d in list(self.files.values()):
                if not d.clean and not d.unlinked and d.writers == 0:
                    try:
                        await self.commit(d)
                    except TierfsError:
                        pass
        return all(d.clean or d.unlinked for d in self.files.values())
