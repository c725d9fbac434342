"""WriteBack: the owner of every file with unsaved writes, and of its state.

It holds one DirtyFile per inode being written (dirty.py) and is the only code that
moves one from state to state (dirty.TRANSITIONS). Writes, truncates and reads of unsaved
data go to the staging file; close() and fsync() make it durable as the mode says; an
unlink or a rename over the file supersedes its pending upload only once the store
change succeeded. The work is split: Uploader (upload.py) sends bytes, UploadQueue
(queue.py) says when, Uploads (orphans.py) owns multipart uploads and cleans up those
nobody owns, Settler (settle.py) caches what was uploaded, recovery.py restarts journaled
files after a crash.

Durability (the only copy of acknowledged data lives here until uploaded):
- default mode: close and fsync upload and return only when S3 has the object;
- write-back mode: close takes the untouched base chunks into the staging file (the
  version the writer saw is what gets uploaded, whatever happens to the object), fsyncs
  the staging file and appends the file's record to the journal (tierfs/index/journal.py)
  before returning; a worker uploads it. fsync always uploads.
- a write() or truncate that fails (ENOSPC, EIO) marks the file failed: its fsync() and
  close() fail with the same errno and its bytes are not uploaded until a later write or
  truncate succeeds. Acknowledged bytes are never dropped.
Dirty bytes count against the cache budget and are never evicted; writers wait up to
--dirty-wait for uploads to release budget, then get ENOSPC.

Concurrency: one trio.Lock per DirtyFile serializes writes, truncates, uploads, and the
store changes of an unlink or rename of the file (committed, superseding); background
parts of a streamed upload take no lock (each part's change count tells close() which
copies are stale). Staging I/O is page-cache pwrite/pread on the trio thread; fsync,
CRCs and the moves into the cache go to worker threads.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import trio

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache, ObjectVersion
from ..errors import BaseChanged, PreconditionFailed, TierfsError
from ..index.meta import MetaStore
from ..metrics import Metrics
from ..tasks import is_cancellation
from .dirty import DirtyFile, State
from .orphans import Uploads
from .queue import RETRY_MAX_S, RETRY_MIN_S, UploadQueue
from .settle import Settler
from .staging import ReadBase, Staging
from .upload import PART_RETRY_S, Uploader, part_size

log = logging.getLogger("tierfs.writeback")


class WriteBack:
    def __init__(self, meta: MetaStore, cache: ChunkCache, backend: AsyncBackend,
                 metrics: Metrics, *, bucket: str, cache_dir: str, chunk_size: int,
                 writeback: bool, dirty_wait_s: float, read_base: ReadBase,
                 clock: Callable[[], float] = time.time, retry_min_s: float = RETRY_MIN_S,
                 retry_max_s: float = RETRY_MAX_S, part_retry_s: float = PART_RETRY_S) -> None:
        self.meta = meta
        self.cache = cache
        self.metrics = metrics
        self.bucket = bucket
        self.chunk_size = chunk_size
        self.writeback = writeback
        self.dirty_wait_s = dirty_wait_s
        self._clock = clock
        self.files: dict[int, DirtyFile] = {}
        self.part_size = part_size(chunk_size)
        self.staging = Staging(meta, cache, cache_dir=cache_dir, chunk_size=chunk_size,
                               part_size=self.part_size, dirty_wait_s=dirty_wait_s,
                               read_base=read_base)
        self.dir = self.staging.dir
        self.queue = UploadQueue(retry_min_s=retry_min_s, retry_max_s=retry_max_s)
        self.uploads = Uploads(meta, backend, metrics, live=self._holds_upload,
                               retry_min_s=retry_min_s, retry_max_s=retry_max_s)
        self.uploader = Uploader(backend, cache, metrics, self.uploads, chunk_size=chunk_size,
                                 read=self.staging.read, streaming=self._may_stream,
                                 part_retry_s=part_retry_s)
        self.settler = Settler(cache, metrics, chunk_size=chunk_size,
                               live=lambda d: self.files.get(d.ino) is d)
        # told when a file leaves the write-back saved: its unsaved bytes, which this
        # node's handles read, are that version now (FileIO moves them to it at once; a
        # lookup later could find another client's newer version under the same name)
        self.on_saved: Callable[[int, ObjectVersion], None] | None = None

    def _holds_upload(self, upload_id: str) -> bool:
        """Whether a live file runs this multipart upload: cleanup never aborts it."""
        return any(d.upload_id == upload_id or (d.stream is not None
                                                and d.stream.upload_id == upload_id)
                   for d in self.files.values() if not d.superseded)

    def _may_stream(self, d: DirtyFile) -> bool:
        return (not self.writeback and not d.journaled and not d.superseded
                and self.files.get(d.ino) is d)

    # ---- the files being written ------------------------------------------------------

    def get(self, ino: int) -> DirtyFile | None:
        return self.files.get(ino)

    def is_dirty(self, ino: int) -> bool:
        return ino in self.files

    def pending(self) -> int:
        """Files with writes the object store does not have yet."""
        return sum(1 for d in self.files.values() if not d.clean and not d.superseded)

    def open(self, ino: int, key: str, base: ObjectVersion | None, *, truncate: bool,
             metadata: dict[str, str]) -> DirtyFile:
        d = self.files.get(ino)
        if d is None:
            d = self.files[ino] = self.staging.create(ino, key, base, metadata)
        d.writers += 1
        return d

    async def write(self, d: DirtyFile, offset: int, data: bytes) -> int:
        async with d.lock:
            await self.settler.settle(d)
            try:
                await self.staging.write(d, offset, data)
            except TierfsError as exc:
                d.failed = exc
                raise
            d.changed()
            d.changed_ns = time.time_ns()
            d.failed = None  # the application wrote again after the failure: its call
            self.uploader.stream_parts(d, offset, offset + len(data))
        return len(data)

    async def truncate(self, d: DirtyFile, size: int) -> None:
        async with d.lock:
            await self.settler.settle(d)
            try:
                self.staging.truncate(d, size)
            except TierfsError as exc:
                d.failed = exc
                raise
            d.changed()
            d.changed_ns = time.time_ns()
            d.failed = None

    async def read(self, d: DirtyFile, offset: int, size: int) -> bytes:
        """The file's bytes as this node sees them (its unsaved writes over its base)."""
        return await self.staging.read(d, offset, size)

    async def set_metadata(self, d: DirtyFile, metadata: dict[str, str]) -> bool:
        """The metadata d's upload carries (mode, owner, times: tierfs.index.attrs). False when d
        was uploaded and forgotten meanwhile: then the caller changes the object itself."""
        if metadata == d.metadata:
            return self.files.get(d.ino) is d
        async with d.lock:  # not in the middle of an upload of the old metadata
            if self.files.get(d.ino) is not d or d.superseded:
                return False
            await self.settler.settle(d)
            d.metadata = dict(metadata)
            d.changed()  # the object must be written again
            if d.journaled:  # what a crash leaves must carry it too
                await self.staging.journal(d)
            if d.writers == 0:  # waiting for its background upload: one more
                self.queue.put(d.ino)
        return True

    # ---- making it durable ------------------------------------------------------------

    async def flush(self, d: DirtyFile) -> None:
        """close(): durable in S3 (default) or durable in the local journal (write-back)."""
        if d.superseded:
            return
        if d.failed is not None:
            raise d.sticky_error("close")
        if d.clean:
            return
        if not self.writeback:
            await self.commit(d)
            return
        async with d.lock:
            try:
                await self.staging.own_base(d)
            except TierfsError as exc:
                d.failed = exc  # not acknowledged: the release drops it, logged
                raise
            await self.staging.journal(d)

    async def commit(self, d: DirtyFile) -> None:
        """Upload now and return once the object store has this generation (fsync)."""
        async with d.lock:
            await self._commit_locked(d)

    @asynccontextmanager
    async def committed(self, d: DirtyFile) -> AsyncIterator[None]:
        """commit(d), then hold d still (no write, no upload) while the caller copies its
        object elsewhere (a rename): the store keeps exactly what was copied."""
        async with d.lock:
            await self._commit_locked(d)
            yield

    @asynccontextmanager
    async def superseding(self, d: DirtyFile) -> AsyncIterator[None]:
        """Hold d's pending upload still while the caller deletes or replaces its name on
        the store (unlink, rename over it): an upload under way ends first (it holds the
        lock) and no other starts. If the caller's block succeeds, d's unsaved data has
        nowhere to go: superseded (forgotten once no writer holds it). If it fails, d
        stays as it was, its upload still pending: an unlink or rename that failed
        changed nothing."""
        async with d.lock:
            yield
            if d.superseded:
                return
            d.to(State.SUPERSEDED)
            if d.stream is not None:
                self.uploader.abandon(d, d.stream)
            if d.writers == 0:
                self._forget(d)

    async def _commit_locked(self, d: DirtyFile) -> None:
        if d.superseded or self.files.get(d.ino) is not d:
            return  # uploaded and forgotten, or superseded, while we waited
        await self.settler.settle(d)  # a rename's copy is linked to what is cached
        if d.failed is not None:
            raise d.sticky_error("fsync")
        if d.clean:
            return
        before = d.state
        d.to(State.UPLOADING)
        try:
            await self._upload(d)
        except BaseException as exc:
            if is_cancellation(exc):  # unmount: a journaled file is tried next mount
                if d.state is State.UPLOADING:
                    d.to(before)
                raise
            if isinstance(exc, BaseChanged):  # no retry can help: the failed state
                d.failed = exc
                d.to(State.STAGED)
                log.error("%s", exc)
                if d.writers == 0:
                    self._forget(d)
                raise
            await self._upload_failed(d, exc)
            raise
        self.queue.done(d.ino)
        await self._after_upload(d)

    async def _upload(self, d: DirtyFile) -> None:
        t0 = time.perf_counter()
        gen, size = d.generation, d.size
        try:
            etag = await self.uploader.upload(d)
        except PreconditionFailed:
            # a base chunk copied server-side or read through the cache: the base was
            # replaced on the store. Send the version the writer saw, if this node has it
            await self.staging.own_base(d)
            etag = await self.uploader.upload(d)
        new = ObjectVersion(self.bucket, d.key, etag, size)
        await self.settler.uploaded(d, new)
        await self.staging.unjournal(d)
        self._set_inode(d, new)
        d.base, d.base_valid, d.saved_generation = new, size, gen
        self.metrics.uploads.labels("success").inc()
        self.metrics.upload_seconds.observe(time.perf_counter() - t0)
        log.info("uploaded %r (%d bytes)", d.key, size)

    async def _upload_failed(self, d: DirtyFile, exc: BaseException) -> None:
        """Kept in the journal and tried again after the file's own backoff."""
        self.metrics.uploads.labels("failure").inc()
        d.to(State.JOURNALED)
        with trio.CancelScope(shield=True):
            try:
                await self.staging.journal(d)
            except Exception as jexc:  # noqa: BLE001 - the retry must still happen
                log.error("could not journal %r (%s): it is retried while this "
                          "daemon runs, but a crash would lose it", d.key, jexc)
        delay = self.queue.failed(d.ino)
        failures = self.queue.failures(d.ino)
        if isinstance(exc, TierfsError):
            log.error("upload of %r failed: %s; trying again in %.0fs (failed %d "
                      "times in a row)", d.key, exc, delay, failures)
        else:  # a bug: still never lose the file
            self.metrics.internal_errors.labels("upload").inc()
            log.error("upload of %r failed unexpectedly; trying again in %.0fs",
                      d.key, delay, exc_info=exc)

    def _set_inode(self, d: DirtyFile, new: ObjectVersion) -> None:
        node = self.meta.inodes.inode(d.ino)
        if node is not None:
            node.size, node.etag, node.mtime = new.size, new.etag, self._clock()
            node.validated_at = self._clock()
            # the metadata it was uploaded with came from these attributes: no HEAD needed
            self.meta.inodes.set_validated(node, node.attrs.changed(seen=new.etag))

    async def _after_upload(self, d: DirtyFile) -> None:
        if d.writers == 0:
            await self.settler.settle(d)
            if d.writers == 0:  # else opened again meanwhile: it stays, rebased
                self._forget(d)
            return
        # still open (close's flush, fsync): its chunks move into the cache in the
        # background; the next writes build on the version just uploaded (no more
        # streaming: the file has a base now)
        d.covered, d.part_changes = [], {}
        self.settler.later(d)

    async def release(self, d: DirtyFile) -> bool:
        """The last close of a writer: schedule the upload (write-back) or forget the file.
        True when the file's unsaved changes were dropped (its last write failed)."""
        d.writers -= 1
        if d.writers > 0:
            return False
        async with d.lock:  # an upload in progress still reads the staging file
            if d.writers > 0:
                return False
            if d.failed is not None and not d.superseded:
                if not d.journaled or isinstance(d.failed, BaseChanged):
                    log.warning("%r: an earlier write failed (%s) and no write succeeded "
                                "after it; its unsaved changes are dropped, the object store "
                                "keeps its previous version", d.key, d.failed)
                    self._forget(d)
                    return True
                # acknowledged bytes (an earlier close) live only in this staging file
                log.warning("%r: an earlier write failed (%s), but the file also holds "
                            "acknowledged changes not uploaded yet: uploading it as it "
                            "stands", d.key, d.failed)
                d.failed = None
                await self.staging.journal(d)  # the record must describe what will be uploaded
            if d.superseded or d.clean:
                if not d.superseded:
                    await self.settler.settle(d)
                    if d.writers > 0:  # opened again meanwhile: it stays, rebased
                        return False
                self._forget(d)
            elif d.journaled:
                self.queue.put(d.ino)
        return False

    def _forget(self, d: DirtyFile) -> None:
        if self.files.get(d.ino) is not d:
            return
        if d.stream is not None:
            self.uploader.abandon(d, d.stream)
        self.uploads.give_up(d.upload_id)  # a failed attempt's: cleanup's now
        del self.files[d.ino]
        self.queue.done(d.ino)
        self.staging.delete(d)
        saved = d.base if d.clean and not d.superseded and d.failed is None else None
        d.to(State.FORGOTTEN)
        if saved is not None and self.on_saved is not None:
            self.on_saved(d.ino, saved)

    # ---- background work ----------------------------------------------------------------

    async def run_uploader(self) -> None:
        """One upload worker (the daemon runs several): uploads journaled files whose
        writers are gone. It never dies of a failed upload and never drops a file: the
        file goes back to the queue with its own backoff. Beside it run a streamer
        (background parts of files still being written) and a settler."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.uploader.run_streamer)
            nursery.start_soon(self.settler.run)
            await self.queue.run(self._upload_queued)

    async def _upload_queued(self, ino: int) -> None:
        d = self.files.get(ino)
        if d is None or d.writers > 0 or d.superseded or d.clean:
            return
        try:
            await self.commit(d)
        except Exception:  # noqa: BLE001 - commit logged it and scheduled the retry
            pass

    async def run_orphan_cleanup(self) -> None:
        await self.uploads.run()

    def recover(self) -> int:
        from .recovery import recover
        return recover(self)

    async def drain(self, timeout_s: float) -> bool:
        from .recovery import drain
        return await drain(self, timeout_s)
