"""WriteBack: unsaved writes, their upload to the object store, and the journal.

A file opened for writing gets a DirtyFile: a sparse staging file in CACHE_DIR/dirty/
holding every chunk a writer touched ("materialized"), over a base version (the object
as it was when opened) for the chunks nobody touched. Partial writes into a base chunk
read it first (through the chunk cache) and write it into the staging file.

Upload: a file up to one part (max(chunk, 8 MiB)) is one PUT; a larger one is a multipart
upload whose untouched parts are copied server-side (UploadPartCopy with If-Match on the
base ETag) and the others uploaded from the staging file, several in parallel. The
object appears under its name only when the PUT or CompleteMultipartUpload succeeds:
never partially. Once it has, the written chunks move out of the staging file into the
disk tier under the new ETag, each into the room its unsaved copy held (the file is cut
behind them), so reading back what was just written costs no GET and a file never holds
its size in the cache twice (`_settle`: in the background when the file is still open,
so close() does not wait for it).
Every upload whose bytes all come from this node carries the CRC32C of each chunk in its
user metadata (tierfs/integrity.py), which later reads check; one with server-side-copied
parts does not (its base bytes would have to be downloaded first).

Streaming (default mode, a new or O_TRUNC file): once a full part is written and the file
extends past it, an upload worker sends it in the background (a Stream: the multipart
upload is created then, with the metadata the file has then), so close() only sends the
rest and completes. A part whose bytes change after it was read (overwrite, truncate, a
failed write) is sent again by close(); the final metadata (write times, chmods since,
the chunk CRCs) is given by copying the object onto itself after completion (S3 cannot
edit metadata; on RGW a metadata-only change for a multipart object). Not streamed,
uploaded whole at close as before: --writeback files, files with a base version (their
untouched parts are copied), writers scattering more than COVER_MAX ranges. A streamed
file larger than COPY_MAX cannot be copied onto itself: it keeps the metadata its upload
was created with. An unlinked file's stream is abandoned: orphan cleanup aborts it.

Durability (the only copy of acknowledged data lives here until uploaded):
- default mode: flush (close) and fsync upload and return only when S3 has the object;
- write-back mode: flush fsyncs the staging file and appends the file's record to the
  journal (tierfs/journal.py, its own fsynced file, apart from the chunk index) before
  returning; a worker uploads it. fsync always uploads.
- A file being written when the daemon dies was never acknowledged: recovery deletes its
  staging file. Journaled files are uploaded again after a restart.
Dirty bytes count against the cache budget and are never evicted; writers wait up to
--dirty-wait for uploads to release budget, then get ENOSPC.

Failures:
- a write() or truncate that fails (ENOSPC, EIO) marks the file failed: its fsync() and
  close() fail with the same errno and its bytes are not uploaded (they are not what the
  application meant), until a later write or truncate succeeds. Acknowledged bytes are
  never dropped: a journaled file is still uploaded as it stands.
- a part that fails is retried (PART_ATTEMPTS, with backoff); a multipart upload that
  vanished (NoSuchUpload: aborted elsewhere, expired) is started again from scratch;
- a file whose upload still fails waits its own backoff (RETRY_MIN_S doubling to
  RETRY_MAX_S) and is tried again, forever, while the other files go on: what was
  acknowledged reaches the bucket once the store answers again, without a remount.

Multipart uploads are owned: each one this daemon creates or runs is in `_owned` (id or
the pending marker recorded before CreateMultipartUpload answers) from before it exists
until it is completed or given up. Orphan cleanup aborts only recorded uploads that no
one owns: those of an earlier daemon, of an attempt that failed, and those created on the
server whose answer was lost (found by listing the key's uploads initiated while the
marker was live). It never touches a key while an upload of it is being created here.
It runs at start and after any upload that leaves unowned records, again with backoff
while the store fails it.

Concurrency: one trio.Lock per DirtyFile serializes writes, truncates and uploads of that
file (an upload sees one consistent generation); background parts take no lock (each
part's change count tells close() which copies are stale). Staging I/O is page-cache
pwrite/pread on the trio thread, except background parts, read in a worker thread
through a dup of the fd; fsync, CRCs, chunk-cache fills and the moves into the cache go
to worker threads. While an uploaded file's chunks move, it reads as its base the version
just uploaded, so a reader never sees a chunk that has left the staging file as a hole.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import trio

from .backend.runner import AsyncBackend
from .cache import ChunkCache, Fill, ObjectVersion
from .errors import (AccessDenied, BaseChanged, CacheUnwritable, EarlierWriteFailed, NoSpace,
                     NoSuchBucket, NotFound, PreconditionFailed, TierfsError)
from .integrity import chunk_crcs_metadata, crc32c
from .meta import MetaStore
from .metrics import Metrics
from .tasks import is_cancellation, leaves

log = logging.getLogger(__name__)

T = TypeVar("T")

PART_MIN = 8 << 20  # S3 wants parts >= 5 MiB; 8 MiB keeps part counts low
RETRY_MIN_S = 1.0  # a file whose upload failed waits this long, doubling up to RETRY_MAX_S
RETRY_MAX_S = 60.0
PART_ATTEMPTS = 3  # tries of one part (each with botocore's own retries) before the file fails
PART_RETRY_S = 0.5  # first pause between tries of a part, doubling
RESTARTS = 2  # times one upload attempt starts over after its multipart upload vanished
CLOCK_SKEW_S = 300.0  # between this node and the store, when comparing Initiated times
COPY_MAX = 5 << 30  # S3's largest CopyObject: a larger streamed file keeps its first metadata
_PENDING = "pending-"  # an uploads record made before CreateMultipartUpload answered
_WAKE = -1  # queue items that are not inodes: re-check the retry schedule,
_SWEEP = -2  # abort orphaned uploads
# failures a retry cannot fix: the upload is gone, the base changed, or we may not write
_FINAL = (NotFound, PreconditionFailed, AccessDenied, NoSuchBucket)

ReadBase = Callable[[ObjectVersion, int], Awaitable[bytes | memoryview]]
COVER_MAX = 64  # written ranges tracked per file; a writer scattering more is not streamed
MOVES = 2  # chunks moved into the cache at once after an upload (the disk tier writes direct)


@dataclass
class Sent:
    """One part uploaded into a Stream: valid while its range has not changed since."""
    changes: int  # DirtyFile.part_changes[n] when its bytes were read
    etag: str
    length: int
    crcs: list[int] | None  # CRC32C of each chunk in it (None: copied server-side)


@dataclass
class Stream:
    """A multipart upload of one file and the parts sent into it so far. Streamed (default
    mode, a new file): created while the file is still being written, full parts sent as
    soon as they are written, with the metadata the file had then; close() sends the rest,
    completes it, and fixes the metadata (mtime, chunk CRCs) by copying the object onto
    itself. Otherwise created at upload time with the final metadata. Its chunks are
    cached once the object is complete, out of the staging file (`_settle`)."""
    key: str
    metadata: dict[str, str]
    upload_id: str | None = None
    sent: dict[int, Sent] = field(default_factory=dict)
    queued: set[int] = field(default_factory=set)  # parts streamed (or being) in the background
    dead: bool = False  # abandoned: its upload is orphan cleanup's (unowned)
    closing: bool = False  # an upload of the file uses it now: no more background parts
    inflight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    create_lock: trio.Lock = field(default_factory=trio.Lock)

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        if self.inflight == 0:
            self.idle = trio.Event()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


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
    upload_id: str | None = None  # the multipart upload under way (owned by this daemon)
    # the last write or truncate failed (its TierfsError): fsync/close report it and the
    # bytes are not saved until a later write or truncate succeeds
    failed: TierfsError | None = None
    failures: int = 0  # uploads failed in a row, for this file's retry backoff
    # when its data last changed (write, truncate): the file's mtime and ctime until
    # FileIO moves it into the inode's attributes and the upload's metadata
    changed_ns: int | None = None
    # streaming (default mode, new files): the written ranges [start, end) merged (None
    # once too scattered to track), a change count per part (a part sent before its range
    # changed is sent again), the multipart upload parts are sent into
    covered: list[list[int]] | None = field(default_factory=list)
    part_changes: dict[int, int] = field(default_factory=dict)
    stream: Stream | None = None
    # uploaded (clean), its written chunks still in the staging file: WriteBack._settle
    uploaded: ObjectVersion | None = None
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

    def sticky_error(self, what: str) -> EarlierWriteFailed:
        assert self.failed is not None
        return EarlierWriteFailed(f"{what} of {self.key!r}: an earlier write failed "
                                  f"({self.failed}); nothing was saved", self.failed.errno)


class WriteBack:
    def __init__(self, meta: MetaStore, cache: ChunkCache, backend: AsyncBackend,
                 metrics: Metrics, *, bucket: str, cache_dir: str, chunk_size: int,
                 writeback: bool, dirty_wait_s: float, read_base: ReadBase,
                 clock: Callable[[], float] = time.time, retry_min_s: float = RETRY_MIN_S,
                 retry_max_s: float = RETRY_MAX_S, part_retry_s: float = PART_RETRY_S) -> None:
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
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.part_retry_s = part_retry_s
        self._clock = clock
        self.dir = os.path.join(cache_dir, "dirty")
        os.makedirs(self.dir, exist_ok=True)
        self.files: dict[int, DirtyFile] = {}
        self._queue_send, self._queue_recv = trio.open_memory_channel[int](math.inf)
        # ino (or _SWEEP) -> trio time of its next attempt
        self._retry_at: dict[int, float] = {}
        self._parts = trio.CapacityLimiter(4)  # parts in memory at once, per daemon
        # multipart uploads (ids and pending markers) this daemon runs -> key
        self._owned: dict[str, str] = {}
        # pending markers of this daemon no longer owned -> latest wall time an upload
        # created under them can have been initiated (before the store's answer was lost)
        self._marker_until: dict[str, float] = {}
        self._started = time.time()  # markers of an earlier daemon ended before this
        # (wall time, not `clock`: it is compared with the store's Initiated times)
        self._given_up: set[str] = set()  # ids this daemon stopped owning (for the log)
        self._sweeping = False
        self._sweep_again = False
        self._sweep_failures = 0
        # background work of streamed uploads: (file, stream, part) to send
        self._stream_send, self._stream_recv = trio.open_memory_channel[
            tuple[DirtyFile, Stream, int]](math.inf)
        # uploaded files still open whose written chunks are to move into the cache
        self._settle_send, self._settle_recv = trio.open_memory_channel[DirtyFile](math.inf)

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
            await self._settle(d)
            try:
                for index in range(offset // cs, (end - 1) // cs + 1):
                    if index not in d.materialized:
                        await self._materialize(d, index, offset, end)
                self._changing(d, offset, end)  # before: a failed pwrite may leave some bytes
                _staging_io(os.pwrite, d.fd, data, offset)
            except TierfsError as exc:
                d.failed = exc
                raise
            d.size = max(d.size, end)
            d.generation += 1
            d.changed_ns = time.time_ns()
            d.failed = None  # the application wrote again after the failure: its call
            self._stream_parts(d, offset, end)
        return len(data)

    def _changing(self, d: DirtyFile, start: int, end: int) -> None:
        """Bytes [start, end) are about to change: parts sent with the old ones are stale."""
        ps = self.part_size
        for n in range(start // ps, (end - 1) // ps + 1):
            d.part_changes[n] = d.part_changes.get(n, 0) + 1

    def _stream_parts(self, d: DirtyFile, start: int, end: int) -> None:
        """After a write of [start, end): queue the background upload of every part it
        completed. A part goes once it is fully written and the file already extends past
        it (a file that ends within its first part is one PUT at close, never multipart)."""
        if (d.covered is None or self.writeback or d.base is not None or d.journaled
                or d.unlinked):
            return
        if not _cover(d.covered, start, end):
            d.covered = None  # a scattered writer: its file is uploaded whole at close
            return
        ps = self.part_size
        s = d.stream
        for n in range(max(0, start // ps - 1), (end - 1) // ps + 1):
            if (n + 1) * ps >= d.size:
                break
            if s is not None and (n in s.queued or s.dead or s.closing or s.key != d.key):
                continue
            if not _covers(d.covered, n * ps, (n + 1) * ps):
                continue
            if s is None:
                s = d.stream = Stream(d.key, dict(d.metadata))
            s.queued.add(n)
            self._stream_send.send_nowait((d, s, n))

    async def _materialize(self, d: DirtyFile, index: int, wstart: int, wend: int) -> None:
        cs = self.chunk_size
        if not await self.cache.reserve_dirty(cs, self.dirty_wait_s, key=d.key):
            log.error("write to %r refused (ENOSPC): unsaved writes would exceed the cache "
                      "budget and no upload freed space within %.0fs", d.key, self.dirty_wait_s)
            raise NoSpace(f"cache budget full of unsaved writes ({self.cache.dirty_bytes} bytes)")
        start = index * cs
        base_end = min(start + cs, d.base_valid)
        try:
            # bytes of the base in this chunk that the write does not cover must be kept
            if d.base is not None and base_end > start and not (wstart <= start and wend >= base_end):
                data = await self.read_base(d.base, index)
                _staging_io(os.pwrite, d.fd, data[:base_end - start], start)
        except BaseException:
            self.cache.release_dirty(cs, key=d.key)  # the chunk never became dirty
            raise
        d.materialized.add(index)

    async def truncate(self, d: DirtyFile, size: int) -> None:
        cs = self.chunk_size
        async with d.lock:
            await self._settle(d)
            try:
                # past the new size the staging file reads zeros, and base_valid keeps the
                # base from showing through: a later extension reads zeros, as POSIX wants
                _staging_io(os.ftruncate, d.fd, size)
            except TierfsError as exc:
                d.failed = exc
                raise
            if size < d.size:
                self._changing(d, size, d.size)
                if d.covered:
                    _uncover(d.covered, size)
                d.base_valid = min(d.base_valid, size)
                gone = {i for i in d.materialized if i * cs >= size}
                d.materialized -= gone
                self.cache.release_dirty(len(gone) * cs, key=d.key)
            d.size = size
            d.generation += 1
            d.changed_ns = time.time_ns()
            d.failed = None

    async def read(self, d: DirtyFile, offset: int, size: int) -> bytes:
        end = min(offset + size, d.size)
        cs = self.chunk_size
        out = []
        for index in range(offset // cs, (max(end, offset + 1) - 1) // cs + 1):
            lo, hi = max(offset, index * cs), min(end, (index + 1) * cs)
            if lo >= hi:
                break
            if index in d.materialized:
                piece = _staging_io(os.pread, d.fd, hi - lo, lo)
                out.append(piece + bytes(hi - lo - len(piece)))  # a hole past EOF reads zeros
                continue
            based = max(lo, min(hi, d.base_valid))  # [lo, based) comes from the base
            if d.base is not None and based > lo:
                chunk = await self.read_base(d.base, index)
                out.append(chunk[lo - index * cs:based - index * cs])
            out.append(bytes(hi - based))
        return b"".join(out)

    async def set_metadata(self, d: DirtyFile, metadata: dict[str, str]) -> bool:
        """The metadata d's upload carries (mode, owner, times: tierfs.attrs). False when d
        was uploaded and forgotten meanwhile: then the caller changes the object itself."""
        if metadata == d.metadata:
            return self.files.get(d.ino) is d
        async with d.lock:  # not in the middle of an upload of the old metadata
            if self.files.get(d.ino) is not d or d.unlinked:
                return False
            await self._settle(d)
            d.metadata = dict(metadata)
            d.generation += 1  # the object must be written again
            if d.journaled:  # what a crash leaves must carry it too
                await self._journal(d)
            if d.writers == 0:  # waiting for its background upload: one more
                self._queue_send.send_nowait(d.ino)
        return True

    # ---- making it durable ------------------------------------------------------------

    async def flush(self, d: DirtyFile) -> None:
        """close(): durable in S3 (default) or durable in the local journal (write-back)."""
        if d.unlinked:
            return
        if d.failed is not None:
            raise d.sticky_error("close")
        if d.clean:
            return
        if self.writeback:
            async with d.lock:
                try:
                    await self._own_base(d)
                except TierfsError as exc:
                    d.failed = exc  # not acknowledged: the release drops it, logged
                    raise
                await self._journal(d)
            return
        await self.commit(d)

    async def _own_base(self, d: DirtyFile) -> None:
        """Take into the staging file every chunk of the base version the writes left
        alone, so that what is uploaded is the version the writer saw, whatever another
        client does to the object meanwhile (its copy server-side needs that version on
        the store). Write-back does it before close() acknowledges; an upload whose
        server-side copy found the base replaced does it then. BaseChanged when the base
        is gone and this node does not hold its bytes."""
        if d.base is None:
            return
        cs = self.chunk_size
        for index in range(-(-min(d.base_valid, d.size) // cs)):
            if index not in d.materialized:
                try:
                    await self._materialize(d, index, 0, 0)
                except PreconditionFailed:
                    raise BaseChanged(
                        f"{d.key!r} was replaced on the store since it was opened, and the "
                        f"part of it the writes left alone is not on this node: the "
                        f"writes cannot be saved; reopen the file") from None

    async def commit(self, d: DirtyFile) -> None:
        """Upload now and return once the object store has this generation (fsync)."""
        async with d.lock:
            await self._commit_locked(d)
        if self._unowned_records():
            self._queue_send.send_nowait(_SWEEP)  # e.g. the upload of a failed attempt

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
        nowhere to go: it is superseded (forgotten once no writer holds it). If it fails,
        d stays as it was, its upload still pending: an unlink or rename that failed
        changed nothing."""
        async with d.lock:
            yield
            d.unlinked = True
            if d.stream is not None:
                self._abandon(d, d.stream)
            if d.writers == 0:
                self._forget(d)

    async def _commit_locked(self, d: DirtyFile) -> None:
        if d.unlinked or self.files.get(d.ino) is not d:
            return  # uploaded and forgotten while we waited
        await self._settle(d)  # a rename's copy is linked to what is cached
        if d.failed is not None:
            raise d.sticky_error("fsync")
        if d.clean:
            return
        try:
            await self._upload(d)
        except BaseException as exc:
            if is_cancellation(exc):  # unmount: a journaled file is tried next mount
                raise
            if isinstance(exc, BaseChanged):  # no retry can help: the failed state
                d.failed = exc
                log.error("%s", exc)
                if d.writers == 0:
                    self._forget(d)
                raise
            self.metrics.uploads.labels("failure").inc()
            with trio.CancelScope(shield=True):
                try:
                    await self._journal(d)
                except Exception as jexc:  # noqa: BLE001 - the retry must still happen
                    log.error("could not journal %r (%s): it is retried while this "
                              "daemon runs, but a crash would lose it", d.key, jexc)
            delay = self._retry_later(d)
            if isinstance(exc, TierfsError):
                log.error("upload of %r failed: %s; trying again in %.0fs (failed %d "
                          "times in a row)", d.key, exc, delay, d.failures)
            else:  # a bug: still never lose the file
                self.metrics.internal_errors.labels("upload").inc()
                log.error("upload of %r failed unexpectedly; trying again in %.0fs",
                          d.key, delay, exc_info=exc)
            raise
        d.failures = 0
        self._retry_at.pop(d.ino, None)
        await self._after_upload(d)

    async def release(self, d: DirtyFile) -> bool:
        """The last close of a writer: schedule the upload (write-back) or forget the file.
        True when the file's unsaved changes were dropped (its last write failed)."""
        d.writers -= 1
        if d.writers > 0:
            return False
        async with d.lock:  # an upload in progress still reads the staging file
            if d.writers > 0:
                return False
            if d.failed is not None and not d.unlinked:
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
                await self._journal(d)  # the record must describe what will be uploaded
            if d.unlinked or d.clean:
                if not d.unlinked:
                    await self._settle(d)
                    if d.writers > 0:  # opened again meanwhile: it stays, rebased
                        return False
                self._forget(d)
            elif d.journaled:
                self._queue_send.send_nowait(d.ino)
        return False

    async def _journal(self, d: DirtyFile) -> None:
        await trio.to_thread.run_sync(os.fsync, d.fd)
        await trio.to_thread.run_sync(self.meta.put_dirty, d.ino, d.record())
        d.journaled = True

    def _forget(self, d: DirtyFile) -> None:
        if self.files.get(d.ino) is not d:
            return
        if d.stream is not None:
            self._abandon(d, d.stream)
        if d.upload_id is not None and self._owned.pop(d.upload_id, None) is not None:
            self._given_up.add(d.upload_id)
            self._queue_send.send_nowait(_SWEEP)  # a failed attempt's: cleanup's now
        del self.files[d.ino]
        self._retry_at.pop(d.ino, None)
        unsaved = len(d.materialized) * self.chunk_size
        if d.uploaded is None:
            self.cache.release_dirty(unsaved, key=d.key)
        else:  # unlinked before its chunks moved: nothing to keep
            self.cache.release_held(unsaved, key=d.key)
            d.uploaded = None
        os.close(d.fd)
        os.unlink(d.staging)
        if d.journaled:
            self.meta.delete_dirty(d.ino)

    async def _after_upload(self, d: DirtyFile) -> None:
        if d.writers == 0:
            await self._settle(d)
            if d.writers == 0:  # else opened again meanwhile: it stays, rebased
                self._forget(d)
            return
        # still open (close's flush, fsync): its chunks move into the cache in the
        # background; the next writes build on the version just uploaded (no more
        # streaming: the file has a base now)
        d.covered, d.part_changes = [], {}
        self._settle_send.send_nowait(d)

    # ---- uploading ----------------------------------------------------------------------

    async def _upload(self, d: DirtyFile) -> None:
        t0 = time.perf_counter()
        gen, size = d.generation, d.size
        if size <= self.part_size:
            if d.stream is not None:  # streamed, then cut back to one part: a PUT after all
                self._abandon(d, d.stream)
            try:
                data = await self.read(d, 0, size)
            except PreconditionFailed:  # a base chunk not cached and replaced on the store
                await self._own_base(d)
                data = await self.read(d, 0, size)
            cs = self.chunk_size
            crcs = await trio.to_thread.run_sync(_chunk_crcs_of, data, cs)
            metadata = self._with_crcs(d, crcs)
            etag = (await self.backend.put(d.key, data, metadata)).etag
        else:
            try:
                etag = await self._multipart(d, size)
            except PreconditionFailed:
                # a part copied server-side: the base was replaced on the store. Upload
                # the version the writer saw whole, if this node holds its bytes
                await self._own_base(d)
                etag = await self._multipart(d, size)
            d.stream = None
        new = ObjectVersion(self.bucket, d.key, etag, size)
        await self._uploaded(d, new)
        self._set_inode(d, new)
        d.base, d.base_valid, d.saved_generation = new, size, gen
        self.metrics.uploads.labels("success").inc()
        self.metrics.upload_seconds.observe(time.perf_counter() - t0)
        log.info("uploaded %r (%d bytes)", d.key, size)

    def _with_crcs(self, d: DirtyFile, crcs: list[int] | None) -> dict[str, str]:
        if crcs is None:
            return dict(d.metadata)
        return {**d.metadata, **chunk_crcs_metadata(self.chunk_size, crcs)}

    def _copied(self, d: DirtyFile, start: int, length: int) -> bool:
        """Whether the part at [start, start+length) is copied server-side from the base."""
        cs = self.chunk_size
        touched = any(i in d.materialized for i in range(start // cs, (start + length - 1) // cs + 1))
        return d.base is not None and not touched and start + length <= d.base_valid

    async def _chunk_crcs(self, d: DirtyFile, size: int) -> list[int] | None:
        """CRC32C of each chunk of the file as it will be uploaded, or None if some part is
        copied server-side (its bytes are not here; downloading them only to checksum
        them would cost what the copy saves)."""
        ps, cs = self.part_size, self.chunk_size
        if any(self._copied(d, s, min(ps, size - s)) for s in range(0, size, ps)):
            return None
        if not chunk_crcs_metadata(cs, [0] * -(-size // cs)):
            return None  # too many chunks for S3's 2 KB of metadata: not worth reading
        crcs = []
        for start in range(0, size, cs):
            length = min(cs, size - start)
            if start // cs in d.materialized or d.base is None or start >= d.base_valid:
                crcs.append(await trio.to_thread.run_sync(_staging_crc, d.fd, start, length))
            else:  # base bytes (cached: the part upload reads them next)
                crcs.append(crc32c(await self.read(d, start, length)))
        return crcs

    async def _stream_for(self, d: DirtyFile, size: int) -> Stream:
        """The multipart upload this upload completes: the file's stream if it can be used
        (its background parts done), else a new one with the final metadata."""
        s = d.stream
        if s is not None:
            s.closing = True  # parts still queued are sent by this upload instead
            await s.idle.wait()
            if not s.dead and s.upload_id is not None and s.key == d.key:
                d.upload_id = s.upload_id
                return s
            # not created, failed or renamed
            self._abandon(d, s)
        if d.upload_id is not None:  # an earlier attempt's: parts cost storage until aborted
            old, d.upload_id = d.upload_id, None
            key = self._owned.pop(old, d.key)  # its key: the file may be renamed since
            try:
                await self.backend.mpu_abort(key, old)
                await trio.to_thread.run_sync(self.meta.delete_upload, old)
            except TierfsError as exc:  # recorded, owned by nobody: orphan cleanup's now
                log.info("could not abort the earlier upload of %r yet: %s", d.key, exc)
        metadata = self._with_crcs(d, await self._chunk_crcs(d, size))
        s = d.stream = Stream(d.key, metadata, closing=True)
        try:
            s.upload_id = d.upload_id = await self._create_upload(d.key, metadata)
        except BaseException:
            self._abandon(d, s)
            raise
        return s

    async def _create_upload(self, key: str, metadata: dict[str, str]) -> str:
        """CreateMultipartUpload, recorded in the journal before it exists and owned (in
        `_owned`) from before it exists until its stream completes or is abandoned."""
        marker = f"{_PENDING}{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
        self._owned[marker] = key
        answered = False
        try:
            # recorded before it exists: if the answer is lost (or we crash), the marker
            # leads orphan cleanup to this key's uploads initiated while it was live.
            # journal appends fsync: off the trio thread
            await trio.to_thread.run_sync(self.meta.put_upload, marker, key)
            try:
                upload_id = await self.backend.mpu_create(key, metadata)
            except _FINAL:
                answered = True  # the store said no: it created nothing
                raise
            self._owned[upload_id] = key
            await trio.to_thread.run_sync(self.meta.put_upload, upload_id, key)
            return upload_id
        finally:
            del self._owned[marker]
            if answered:
                await trio.to_thread.run_sync(self.meta.delete_upload, marker)
            else:
                # stays recorded even on success: botocore may have retried a create whose
                # first answer was lost, leaving an upload we do not know; cleanup finds it
                self._marker_until[marker] = time.time()

    async def _multipart(self, d: DirtyFile, size: int) -> str:
        """Send the parts the file's stream lacks (or holds stale), complete it, give the
        object its final metadata: its ETag. NotFound (the upload vanished:
        aborted elsewhere, expired, a Complete whose answer was lost) starts again with a
        new upload, bounded: NotFound can also mean the base object of a copied part is
        gone. A failed attempt's upload stays the file's: the next attempt aborts it."""
        restarts = 0
        s = await self._stream_for(d, size)
        while True:
            try:
                return await self._multipart_once(d, s, size)
            except NotFound as exc:
                self._abandon(d, s, keep=True)
                if restarts >= RESTARTS:
                    raise
                restarts += 1
                log.warning("multipart upload of %r vanished (%s): starting it again",
                            d.key, exc)
                s = await self._stream_for(d, size)
            except BaseException:
                self._abandon(d, s, keep=True)
                raise

    async def _multipart_once(self, d: DirtyFile, s: Stream, size: int) -> str:
        assert s.upload_id is not None
        upload_id = s.upload_id
        ps = self.part_size
        count = -(-size // ps)

        async def part(n: int) -> None:
            start = n * ps
            length = min(ps, size - start)
            changes = d.part_changes.get(n, 0)
            sent = s.sent.get(n)
            if sent is not None and sent.length == length and sent.changes == changes:
                return  # streamed while the file was written, unchanged since
            async with self._part_in_memory():
                if self._copied(d, start, length):
                    assert d.base is not None
                    etag = await self._retrying(
                        f"copy of part {n + 1} of {d.key!r}", self.backend.upload_part_copy,
                        d.key, upload_id, n + 1, d.base.key, d.base.etag, start, length)
                    s.sent[n] = Sent(changes, etag, length, None)
                else:
                    await self._send(s, n, await self.read(d, start, length), changes)

        try:
            async with trio.open_nursery() as nursery:
                for n in range(count):
                    nursery.start_soon(part, n)
        except BaseExceptionGroup as group:
            raise _as_tierfs_error(group) from None
        parts = [s.sent[n] for n in range(count)]
        etag = await self._retrying(f"completion of {d.key!r}", self.backend.mpu_complete,
                                    d.key, upload_id, [(n + 1, p.etag) for n, p in enumerate(parts)])
        d.upload_id = s.upload_id = None
        self._owned.pop(upload_id, None)
        await trio.to_thread.run_sync(self.meta.delete_upload, upload_id)
        crcs: list[int] | None = []
        for p in parts:
            crcs = None if crcs is None or p.crcs is None else crcs + p.crcs
        final = self._with_crcs(d, crcs)
        if final != s.metadata and size > COPY_MAX:
            # too large to copy onto itself: sending it all again would cost more than the
            # metadata is worth. It keeps what it was created with (mode, owner; the times
            # then; no chunk CRCs: reads are verified by the S3 checksums or not at all)
            log.info("%r (%d bytes) keeps the metadata its upload began with", d.key, size)
        elif final != s.metadata:
            # created while the file was still written (its mtime, chmods since, no CRCs
            # yet): S3 cannot edit metadata, an object copied onto itself gets new
            # metadata (for a multipart object a metadata-only change on RGW)
            etag = await self._retrying(f"metadata of {d.key!r}", self.backend.copy,
                                        d.key, d.key, etag, final)
        return etag

    @asynccontextmanager
    async def _part_in_memory(self) -> AsyncIterator[None]:
        """Room for one of the parts held in memory at once, reserved in the memory tier:
        the tier's size bounds parts in flight as it bounds reads in flight (the daemon's
        peak RSS; bench/README.md)."""
        async with self._parts:
            memory = self.cache.memory
            reserved = memory.reserve(self.part_size)
            try:
                yield
            finally:
                if reserved:
                    memory.unreserve(self.part_size)

    async def _send(self, s: Stream, n: int, data: bytes, changes: int) -> None:
        """Upload part n of s (its bytes `data`); meanwhile take its chunks' CRCs."""
        assert s.upload_id is not None
        upload_id = s.upload_id
        out: dict[str, object] = {}

        async def upload() -> None:
            out["etag"] = await self._retrying(f"part {n + 1} of {s.key!r}",
                                               self.backend.upload_part, s.key, upload_id,
                                               n + 1, data)

        async def crcs() -> None:
            out["crcs"] = await trio.to_thread.run_sync(_chunk_crcs_of, data, self.chunk_size)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload)
            nursery.start_soon(crcs)
        s.sent[n] = Sent(changes, out["etag"], len(data), out["crcs"])  # type: ignore[arg-type]

    # ---- streaming parts while the file is written -------------------------------------

    def _streaming(self, d: DirtyFile, s: Stream) -> bool:
        return (not s.dead and not s.closing and d.stream is s and not d.unlinked
                and self.files.get(d.ino) is d)

    async def run_streamer(self) -> None:
        """Background parts of streamed uploads (started by each upload worker). A part
        that fails here is simply sent again by close()."""
        while True:
            d, s, n = await self._stream_recv.receive()
            try:
                await self._stream_part(d, s, n)
            except Exception as exc:  # noqa: BLE001 - close() sends what failed here
                error = _as_tierfs_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
                if isinstance(error, TierfsError):
                    log.info("background upload of part %d of %r failed (%s): close() "
                             "sends it", n + 1, s.key, error)
                else:
                    self.metrics.internal_errors.labels("upload").inc()
                    log.error("background upload of part %d of %r failed unexpectedly",
                              n + 1, s.key, exc_info=exc)

    async def _stream_part(self, d: DirtyFile, s: Stream, n: int) -> None:
        if not self._streaming(d, s):
            return
        s.begin()
        try:
            if s.upload_id is None:
                async with s.create_lock:
                    if s.upload_id is None and self._streaming(d, s):
                        try:
                            s.upload_id = await self._create_upload(s.key, s.metadata)
                        except BaseException:
                            self._abandon(d, s)
                            raise
                        if s.dead:  # abandoned while it was created: cleanup's now
                            self._disown(s)
                        else:
                            d.upload_id = s.upload_id
            ps = self.part_size
            start = n * ps
            async with self._part_in_memory():
                if (not self._streaming(d, s) or s.upload_id is None or d.covered is None
                        or d.size <= start + ps or not _covers(d.covered, start, start + ps)):
                    return
                # read in a worker thread, through a duplicate of the staging fd (the file
                # may be forgotten meanwhile); a write racing the read changes the part's
                # count first, so close() sees this copy is stale and sends it again
                changes = d.part_changes.get(n, 0)
                data = await trio.to_thread.run_sync(_read_closing, os.dup(d.fd), ps, start)
                if len(data) == ps and self._streaming(d, s):
                    await self._send(s, n, data, changes)
        finally:
            s.end()

    def _disown(self, s: Stream) -> None:
        """s's upload is no longer ours: orphan cleanup aborts it (it stays recorded)."""
        if s.upload_id is not None and self._owned.pop(s.upload_id, None) is not None:
            self._given_up.add(s.upload_id)
            self._queue_send.send_nowait(_SWEEP)

    def _abandon(self, d: DirtyFile, s: Stream, *, keep: bool = False) -> None:
        """Stop using s: the file is uploaded otherwise (or not at all). keep: its upload
        stays the file's (d.upload_id, owned) and the next attempt aborts it, else it is
        orphan cleanup's at once."""
        if s.dead:
            return
        s.dead = True
        if d.stream is s:
            d.stream = None
        if keep:
            d.upload_id = s.upload_id
        else:
            if d.upload_id is not None and d.upload_id == s.upload_id:
                d.upload_id = None
            self._disown(s)

    async def _retrying(self, what: str, fn: Callable[..., Awaitable[T]], *args) -> T:
        """fn(*args), tried PART_ATTEMPTS times with backoff while the failure is one a
        retry can fix (botocore has already retried each request)."""
        delay = self.part_retry_s
        for attempt in range(1, PART_ATTEMPTS + 1):
            try:
                return await fn(*args)
            except TierfsError as exc:
                if isinstance(exc, _FINAL) or attempt == PART_ATTEMPTS:
                    raise
                log.warning("%s failed (%s): trying again in %.1fs", what, exc, delay)
            await trio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    # ---- orphaned multipart uploads -------------------------------------------------------

    def _unowned_records(self) -> bool:
        return any(rid not in self._owned for rid, _ in self.meta.uploads())

    async def abort_orphaned_uploads(self) -> None:
        """Abort the recorded multipart uploads no live file owns (an earlier daemon's, a
        failed attempt's, a create whose answer was lost), retrying with backoff while the
        store does not answer. Records skipped because an upload of their key is being
        created right now are left to the sweep after the next upload."""
        delay = self.retry_min_s
        while not await self._sweep():
            log.info("orphaned multipart uploads remain; trying again in %.0fs", delay)
            await trio.sleep(delay)
            delay = min(delay * 2, self.retry_max_s)

    async def _sweep(self) -> bool:
        """Orphan cleanup; False if the store failed some of it. A sweep asked for while
        one runs (an upload just ended, a stream was abandoned) makes it pass again: the
        running pass may have read the records before the new ones were left unowned."""
        if self._sweeping:
            self._sweep_again = True
            return True
        self._sweeping = True
        try:
            ok = True
            self._sweep_again = True
            while self._sweep_again:
                self._sweep_again = False
                ok = await self._sweep_pass() and ok
            return ok
        finally:
            self._sweeping = False

    async def _sweep_pass(self) -> bool:
        """One pass over the recorded uploads."""
        ok = True
        markers: dict[str, list[str]] = {}
        for rid, key in self.meta.uploads():
            if rid.startswith(_PENDING):
                markers.setdefault(key, []).append(rid)
                continue
            try:
                await self._abort_orphan(rid, key)
            except TierfsError as exc:
                ok = False
                log.warning("could not abort an unfinished upload of %r: %s", key, exc)
        for key, rids in markers.items():
            try:
                await self._abort_lost(key, rids)
            except TierfsError as exc:
                ok = False
                log.warning("could not look for lost uploads of %r: %s", key, exc)
        return ok

    async def _abort_orphan(self, rid: str, key: str) -> None:
        """A recorded upload id that no live file owns (an earlier daemon's, or an attempt
        whose abort failed)."""
        if rid in self._owned:
            return
        await self.backend.mpu_abort(key, rid)  # NoSuchUpload counts as done
        await trio.to_thread.run_sync(self.meta.delete_upload, rid)
        if rid in self._given_up:  # an abandoned stream, a failed attempt of a file gone
            self._given_up.discard(rid)
            log.debug("aborted the upload of %r (id %s) this daemon gave up", key, rid)
        else:
            log.info("aborted an unfinished upload of %r (id %s) that no file owns", key, rid)

    async def _abort_lost(self, key: str, markers: list[str]) -> None:
        """Uploads of `key` created under these pending markers whose ids we never learned:
        the key's uploads initiated while one of the markers was live, not owned here."""
        markers = [m for m in markers if m not in self._owned]
        if not markers or key in self._owned.values():
            # an upload of this key is being created or runs here: one listed now could be
            # ours before its answer arrives. The sweep after that upload takes these.
            return
        windows = [self._marker_window(m) for m in markers]
        for u in await self.backend.mpu_list(key):
            if key in self._owned.values():
                return  # an upload of the key started while we listed: as above
            if u.upload_id in self._owned:
                continue
            if not any(lo <= u.initiated <= hi for lo, hi in windows):
                continue  # another writer's: initiated while no marker of ours was live
            await self.backend.mpu_abort(key, u.upload_id)
            log.info("aborted an upload of %r (id %s) whose creation was never answered",
                     key, u.upload_id)
        for m in markers:
            await trio.to_thread.run_sync(self.meta.delete_upload, m)
            self._marker_until.pop(m, None)

    def _marker_window(self, marker: str) -> tuple[float, float]:
        """Wall times between which an upload created under this marker was initiated,
        widened by the clock skew allowed between this node and the store."""
        try:
            made = int(marker[len(_PENDING):].split("-", 1)[0]) / 1000
        except ValueError:  # a marker of an older tierfs: no time in it
            made = -math.inf
        until = self._marker_until.get(marker, self._started)
        return made - CLOCK_SKEW_S, until + CLOCK_SKEW_S

    # ---- caching what was uploaded ------------------------------------------------------

    async def _uploaded(self, d: DirtyFile, new: ObjectVersion) -> None:
        """The store has `new`: what was written is to stay cached under it, so restore on
        this node is free. Chunks of the base the writes left alone keep the base's cached
        chunks (hard links, now); the written ones move out of the staging file later
        (`_settle`). Its journal record goes now: the staging file is no longer the only
        copy, and a crash must not upload it again once it is being cut."""
        cs, base = self.chunk_size, d.base
        untouched = []
        for index in range(-(-new.size // cs)):
            start = index * cs
            length = min(cs, new.size - start)
            if (index not in d.materialized and base is not None
                    and start + length <= d.base_valid and base.key == new.key):
                untouched.append(index)
        if untouched and base is not None:
            await self.cache.rekey(base, new, untouched)
        if d.journaled:
            await trio.to_thread.run_sync(self.meta.delete_dirty, d.ino)
            d.journaled = False
        self.cache.hold(len(d.materialized) * cs, key=d.key)  # saved: no longer dirty
        d.uploaded = new

    async def _settle(self, d: DirtyFile) -> None:
        """With d.lock held: move the chunks of the version just uploaded out of the staging
        file into the disk tier, last first, each into the room its unsaved copy held
        (`filling(held=)`), the staging file cut behind each batch; a file holds its size
        in the cache once, never twice (decision 3d). Then the file is rebased on that
        version (nothing materialized, the staging file empty). Done in the background
        after an upload of a file still open (close() does not wait for it), or first
        thing by whatever changes or forgets the file next. Meanwhile the file reads as
        that version where a chunk has moved (d.base)."""
        new = d.uploaded
        if new is None or self.files.get(d.ino) is not d:
            return
        cs = self.chunk_size
        try:
            order = sorted(d.materialized, reverse=True)
            for at in range(0, len(order), MOVES):
                batch = order[at:at + MOVES]
                async with trio.open_nursery() as nursery:
                    for index in batch:
                        nursery.start_soon(self._move, d, new, index)
                # the staging copies of the batch go: at most MOVES chunks held twice
                await trio.to_thread.run_sync(os.ftruncate, d.fd, batch[-1] * cs)
        except Exception as exc:  # noqa: BLE001 - saved: only the cached copy is lost
            if isinstance(exc, OSError):  # the staging file's truncation
                log.warning("%r is saved, but its staging file: %s", d.key, exc)
            else:
                self.metrics.internal_errors.labels("upload").inc()
                log.error("%r is saved, but what was written cannot all be cached",
                          d.key, exc_info=exc)
        self.cache.release_held(len(d.materialized) * cs, key=d.key)  # what did not move
        d.materialized.clear()
        d.uploaded = None
        try:
            os.ftruncate(d.fd, 0)
        except OSError as exc:
            log.warning("%r is saved, but its staging file: %s", d.key, exc)

    async def run_settler(self) -> None:
        """Background moves of uploaded files still open (`_settle`); never dies."""
        while True:
            d = await self._settle_recv.receive()
            try:
                async with d.lock:
                    await self._settle(d)
            except Exception as exc:  # noqa: BLE001 - keep the worker
                self.metrics.internal_errors.labels("upload").inc()
                log.error("caching what was written to %r failed unexpectedly", d.key,
                          exc_info=exc)

    async def _move(self, d: DirtyFile, new: ObjectVersion, index: int) -> None:
        """Chunk `index` of the staging file into the disk tier as `new`'s, into the room its
        unsaved copy held; read straight into the tier's write buffer (no copy)."""
        cs = self.chunk_size
        start = index * cs
        length = min(cs, new.size - start)
        ckey = new.chunk_key(index)

        def fill(view: memoryview) -> None:  # in the worker thread
            got = os.preadv(d.fd, [view], start)
            view[got:] = bytes(length - got)  # a hole past the staging file's end

        async with self.cache.filling(new, ckey, length, Fill.WRITTEN, held=cs) as stored:
            try:  # its held bytes are the fill's now (released as the block began)
                if stored is not None:
                    stored(await trio.to_thread.run_sync(self.cache.disk.write_via, ckey,
                                                         length, fill))
            except OSError as exc:  # a full or failing cache disk: the object is saved
                log.warning("cannot write chunk to the cache dir: %s", exc)
            finally:
                # readers read the staging file until the chunk is indexed (a read of
                # `new` before would miss and GET it)
                d.materialized.discard(index)

    def _set_inode(self, d: DirtyFile, new: ObjectVersion) -> None:
        node = self.meta.inode(d.ino)
        if node is not None:
            node.size, node.etag, node.mtime = new.size, new.etag, self._clock()
            node.validated_at = self._clock()
            # the metadata it was uploaded with came from these attributes: no HEAD needed
            self.meta.set_validated(node, node.attrs.changed(seen=new.etag))

    # ---- background uploads and recovery -----------------------------------------------

    def _retry_later(self, d: DirtyFile) -> float:
        """This file's next attempt after its own backoff; the others are not held up."""
        d.failures += 1
        delay = min(self.retry_max_s, self.retry_min_s * 2 ** min(d.failures - 1, 30))
        self._retry_at[d.ino] = trio.current_time() + delay
        self._queue_send.send_nowait(_WAKE)  # an idle worker re-reads the schedule
        return delay

    async def _next(self) -> int:
        """The next file to upload: one whose retry is due, else the next queued item."""
        while True:
            now = trio.current_time()
            due = min(self._retry_at.items(), key=lambda kv: kv[1], default=None)
            if due is not None and due[1] <= now:
                del self._retry_at[due[0]]
                if self._retry_at:
                    self._queue_send.send_nowait(_WAKE)  # another worker times the next one
                return due[0]
            with trio.move_on_after(math.inf if due is None else due[1] - now):
                item = await self._queue_recv.receive()
                if item != _WAKE:
                    return item

    async def run_uploader(self) -> None:
        """One upload worker (the daemon runs several): uploads journaled files whose
        writers are gone. It never dies of a failed upload and never drops a file: the
        file goes back to the schedule with its own backoff. Beside it runs a streamer
        (background parts of files still being written)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run_streamer)
            nursery.start_soon(self.run_settler)
            await self._upload_files()

    async def _upload_files(self) -> None:
        while True:
            ino = await self._next()
            if ino == _SWEEP:
                await self._background_sweep()
                continue
            d = self.files.get(ino)
            if d is None or d.writers > 0 or d.unlinked or d.clean:
                continue
            try:
                await self.commit(d)
            except Exception:  # noqa: BLE001 - commit logged it and scheduled the retry
                pass

    async def _background_sweep(self) -> None:
        """Orphan cleanup after an upload; while the store fails it, tried again with
        backoff (through the retry schedule), so lost uploads do not wait for a remount."""
        try:
            ok = await self._sweep()
        except Exception as exc:  # noqa: BLE001 - keep the worker
            self.metrics.internal_errors.labels("orphan-cleanup").inc()
            log.error("orphan cleanup failed unexpectedly", exc_info=exc)
            ok = False
        if ok:
            self._sweep_failures = 0
            return
        self._sweep_failures += 1
        delay = min(self.retry_max_s, self.retry_min_s * 2 ** min(self._sweep_failures - 1, 30))
        self._retry_at[_SWEEP] = trio.current_time() + delay
        self._queue_send.send_nowait(_WAKE)

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
            # a recorded upload id belongs to the dead daemon: orphan cleanup aborts it,
            # this file starts a new upload
            d = DirtyFile(ino, rec["key"], base, rec["base_valid"], rec["size"], path, fd,
                          rec["metadata"], set(rec["materialized"]), journaled=True)
            self.files[ino] = d
            self.cache.force_dirty(len(d.materialized) * self.chunk_size, key=d.key)
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
            limit = trio.CapacityLimiter(4)

            async def one(d: DirtyFile) -> None:
                async with limit:
                    try:
                        await self.commit(d)
                    except Exception:  # noqa: BLE001 - logged by commit; stays journaled
                        pass

            async with trio.open_nursery() as nursery:
                for d in list(self.files.values()):
                    if not d.clean and not d.unlinked and d.writers == 0 and d.failed is None:
                        nursery.start_soon(one, d)
        return all(d.clean or d.unlinked for d in self.files.values())


def _as_tierfs_error(group: BaseExceptionGroup) -> BaseException:
    """The failure of a group of part uploads as the one TierfsError the caller handles
    (NotFound first: the upload is gone, which the caller answers by starting again), or
    the group itself if it holds anything else (a bug, reported with its traceback)."""
    errors = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
    if errors and all(isinstance(e, TierfsError) for e in errors):
        return next((e for e in errors if isinstance(e, NotFound)), errors[0])
    return group


def _cover(ranges: list[list[int]], start: int, end: int) -> bool:
    """Add [start, end) to sorted, merged ranges; False once they pass COVER_MAX."""
    if ranges and ranges[-1][0] <= start <= ranges[-1][1]:  # appending: the usual case
        ranges[-1][1] = max(ranges[-1][1], end)
        return True
    merged: list[list[int]] = []
    placed = False
    for lo, hi in ranges:
        if hi < start:
            merged.append([lo, hi])
        elif end < lo:
            if not placed:
                merged.append([start, end])
                placed = True
            merged.append([lo, hi])
        else:
            start, end = min(lo, start), max(hi, end)
    if not placed:
        merged.append([start, end])
    merged.sort()
    ranges[:] = merged
    return len(ranges) <= COVER_MAX


def _covers(ranges: list[list[int]], start: int, end: int) -> bool:
    return any(lo <= start and end <= hi for lo, hi in ranges)


def _uncover(ranges: list[list[int]], size: int) -> None:
    """A truncation to size: nothing past it was written."""
    ranges[:] = [[lo, min(hi, size)] for lo, hi in ranges if lo < size]


def _chunk_crcs_of(data: bytes, chunk_size: int) -> list[int]:
    if len(data) <= chunk_size:
        return [crc32c(data)] if data else []
    return [crc32c(data[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]


def _read_closing(fd: int, length: int, offset: int) -> bytes:
    """pread of a staging file through fd, which it closes (a worker thread's own dup)."""
    try:
        return _staging_io(os.pread, fd, length, offset)
    finally:
        os.close(fd)


def _staging_crc(fd: int, start: int, length: int) -> int:
    data = os.pread(fd, length, start)
    return crc32c(data + bytes(length - len(data)))  # a hole past the staging file's end


def _staging_io(fn: Callable[..., T], *args) -> T:
    """A pread/pwrite/ftruncate of a staging file, its OSError as the TierfsError the
    application gets (the staging file lives on the cache disk)."""
    try:
        return fn(*args)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"cache disk full: {exc.strerror}") from None
        raise CacheUnwritable(f"cache disk error on a staging file: {exc.strerror}") from None
