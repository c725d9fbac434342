"""Uploader: sending one file's bytes to the object store (PUT, multipart, streamed parts).

A file up to one part (max(chunk, 8 MiB)) is one PUT; a larger one is a multipart upload
whose untouched parts are copied server-side (UploadPartCopy with If-Match on the base
ETag) and the others uploaded from the staging file, several in parallel. The object
appears under its name only when the PUT or CompleteMultipartUpload succeeds: never
partially. Every upload whose bytes all come from this node carries the CRC32C of each
chunk in its user metadata (tierfs/integrity.py); one with copied parts does not.

Streaming (default mode, a new or O_TRUNC file): once a full part is written and the file
extends past it, a streamer sends it in the background (a Stream: the multipart upload is
created then, with the metadata the file has then), so close() only sends the rest and
completes. A part whose bytes change after it was read is sent again by close(); the
final metadata (write times, chmods since, the chunk CRCs) is given by copying the object
onto itself after completion (S3 cannot edit metadata). A streamed file larger than
COPY_MAX cannot be copied onto itself: it keeps the metadata its upload was created with.

Failures: a part is tried PART_ATTEMPTS times with backoff; a multipart upload that
vanished (NoSuchUpload) is started again, RESTARTS times at most. Whatever still fails
is the caller's (WriteBack: the file waits its backoff in the UploadQueue).
"""

from __future__ import annotations

import logging
import math
import os
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import trio

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache
from ..errors import NotFound, TierfsError
from ..integrity import chunk_crcs_metadata, crc32c
from ..metrics import Metrics
from ..tasks import leaves
from .dirty import DirtyFile, Sent, Stream, chunk_crcs_of, cover, covers, read_closing, staging_crc
from .orphans import FINAL, Uploads

log = logging.getLogger("tierfs.writeback")

T = TypeVar("T")

PART_MIN = 8 << 20  # S3 wants parts >= 5 MiB; 8 MiB keeps part counts low
PART_ATTEMPTS = 3  # tries of one part (each with botocore's own retries) before the file fails
PART_RETRY_S = 0.5  # first pause between tries of a part, doubling
RESTARTS = 2  # times one upload attempt starts over after its multipart upload vanished
COPY_MAX = 5 << 30  # S3's largest CopyObject: a larger streamed file keeps its first metadata

ReadFile = Callable[[DirtyFile, int, int], Awaitable[bytes]]


def part_size(chunk_size: int) -> int:
    """Parts are whole chunks, at least PART_MIN."""
    return max(chunk_size, math.ceil(PART_MIN / chunk_size) * chunk_size)


class Uploader:
    def __init__(self, backend: AsyncBackend, cache: ChunkCache, metrics: Metrics,
                 uploads: Uploads, *, chunk_size: int, read: ReadFile,
                 streaming: Callable[[DirtyFile], bool],
                 part_retry_s: float = PART_RETRY_S) -> None:
        self.backend = backend
        self.cache = cache
        self.metrics = metrics
        self.uploads = uploads
        self.chunk_size = chunk_size
        self.part_size = part_size(chunk_size)
        self.read = read  # the file's bytes as they will be uploaded
        self.streaming = streaming  # whether the file may still stream parts
        self.part_retry_s = part_retry_s
        self._parts = trio.CapacityLimiter(4)  # parts in memory at once, per daemon
        # background work of streamed uploads: (file, stream, part) to send
        self._stream_send, self._stream_recv = trio.open_memory_channel[
            tuple[DirtyFile, Stream, int]](math.inf)

    async def upload(self, d: DirtyFile) -> str:
        """Send the file as it stands (size d.size): its new ETag."""
        size = d.size
        if size > self.part_size:
            etag = await self._multipart(d, size)
            d.stream = None
            return etag
        if d.stream is not None:  # streamed, then cut back to one part: a PUT after all
            self.abandon(d, d.stream)
        data = await self.read(d, 0, size)
        crcs = await trio.to_thread.run_sync(chunk_crcs_of, data, self.chunk_size)
        return (await self.backend.put(d.key, data, self._with_crcs(d, crcs))).etag

    def _with_crcs(self, d: DirtyFile, crcs: list[int] | None) -> dict[str, str]:
        if crcs is None:
            return dict(d.metadata)
        return {**d.metadata, **chunk_crcs_metadata(self.chunk_size, crcs)}

    def _copied(self, d: DirtyFile, start: int, length: int) -> bool:
        """Whether the part at [start, start+length) is copied server-side from the base."""
        cs = self.chunk_size
        touched = any(i in d.materialized
                      for i in range(start // cs, (start + length - 1) // cs + 1))
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
                crcs.append(await trio.to_thread.run_sync(staging_crc, d.fd, start, length))
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
            self.abandon(d, s)  # not created, failed or renamed
        if d.upload_id is not None:  # an earlier attempt's: parts cost storage until aborted
            old, d.upload_id = d.upload_id, None
            key = self.uploads.key_of(old, d.key)  # its key: the file may be renamed since
            try:
                await self.backend.mpu_abort(key, old)
                await self.uploads.finished(old)
            except TierfsError as exc:  # recorded, owned by nobody: orphan cleanup's now
                self.uploads.give_up(old)
                log.info("could not abort the earlier upload of %r yet: %s", d.key, exc)
        metadata = self._with_crcs(d, await self._chunk_crcs(d, size))
        s = d.stream = Stream(d.key, metadata, closing=True)
        try:
            s.upload_id = d.upload_id = await self.uploads.create(d.key, metadata)
        except BaseException:
            self.abandon(d, s)
            raise
        return s

    async def _multipart(self, d: DirtyFile, size: int) -> str:
        """Send the parts the file's stream lacks (or holds stale), complete it, give the
        object its final metadata: its ETag. NotFound (the upload vanished: aborted
        elsewhere, expired, a Complete whose answer was lost) starts again with a new
        upload, bounded: NotFound can also mean the base object of a copied part is gone.
        A failed attempt's upload stays the file's: the next attempt aborts it."""
        restarts = 0
        s = await self._stream_for(d, size)
        while True:
            try:
                return await self._multipart_once(d, s, size)
            except NotFound as exc:
                self.abandon(d, s, keep=True)
                if restarts >= RESTARTS:
                    raise
                restarts += 1
                log.warning("multipart upload of %r vanished (%s): starting it again",
                            d.key, exc)
                s = await self._stream_for(d, size)
            except BaseException:
                self.abandon(d, s, keep=True)
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
            raise as_tierfs_error(group) from None
        parts = [s.sent[n] for n in range(count)]
        etag = await self._retrying(f"completion of {d.key!r}", self.backend.mpu_complete,
                                    d.key, upload_id,
                                    [(n + 1, p.etag) for n, p in enumerate(parts)])
        d.upload_id = s.upload_id = None
        await self.uploads.finished(upload_id)
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
        etag = ""
        crcs: list[int] = []

        async def upload() -> None:
            nonlocal etag
            etag = await self._retrying(f"part {n + 1} of {s.key!r}",
                                        self.backend.upload_part, s.key, upload_id, n + 1, data)

        async def take_crcs() -> None:
            nonlocal crcs
            crcs = await trio.to_thread.run_sync(chunk_crcs_of, data, self.chunk_size)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload)
            nursery.start_soon(take_crcs)
        s.sent[n] = Sent(changes, etag, len(data), crcs)

    async def _retrying(self, what: str, fn: Callable[..., Awaitable[T]], *args: object) -> T:
        """fn(*args), tried PART_ATTEMPTS times with backoff while the failure is one a
        retry can fix (botocore has already retried each request)."""
        delay = self.part_retry_s
        for attempt in range(1, PART_ATTEMPTS + 1):
            try:
                return await fn(*args)
            except TierfsError as exc:
                if isinstance(exc, FINAL) or attempt == PART_ATTEMPTS:
                    raise
                log.warning("%s failed (%s): trying again in %.1fs", what, exc, delay)
            await trio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    # ---- streaming parts while the file is written -------------------------------------

    def stream_parts(self, d: DirtyFile, start: int, end: int) -> None:
        """After a write of [start, end): queue the background upload of every part it
        completed. A part goes once it is fully written and the file already extends past
        it (a file that ends within its first part is one PUT at close, never multipart)."""
        if d.covered is None or d.base is not None or not self.streaming(d):
            return
        if not cover(d.covered, start, end):
            d.covered = None  # a scattered writer: its file is uploaded whole at close
            return
        ps = self.part_size
        s = d.stream
        for n in range(max(0, start // ps - 1), (end - 1) // ps + 1):
            if (n + 1) * ps >= d.size:
                break
            if s is not None and (n in s.queued or s.dead or s.closing or s.key != d.key):
                continue
            if not covers(d.covered, n * ps, (n + 1) * ps):
                continue
            if s is None:
                s = d.stream = Stream(d.key, dict(d.metadata))
            s.queued.add(n)
            self._stream_send.send_nowait((d, s, n))

    def _streaming(self, d: DirtyFile, s: Stream) -> bool:
        return not s.dead and not s.closing and d.stream is s and self.streaming(d)

    async def run_streamer(self) -> None:
        """Background parts of streamed uploads (started by each upload worker). A part
        that fails here is simply sent again by close()."""
        while True:
            d, s, n = await self._stream_recv.receive()
            try:
                await self._stream_part(d, s, n)
            except Exception as exc:  # close() sends what failed here
                error = as_tierfs_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
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
                            s.upload_id = await self.uploads.create(s.key, s.metadata)
                        except BaseException:
                            self.abandon(d, s)
                            raise
                        if s.dead:  # abandoned while it was created: cleanup's now
                            self.uploads.give_up(s.upload_id)
                        else:
                            d.upload_id = s.upload_id
            ps = self.part_size
            start = n * ps
            async with self._part_in_memory():
                if (not self._streaming(d, s) or s.upload_id is None or d.covered is None
                        or d.size <= start + ps or not covers(d.covered, start, start + ps)):
                    return
                # read in a worker thread, through a duplicate of the staging fd (the file
                # may be forgotten meanwhile); a write racing the read changes the part's
                # count first, so close() sees this copy is stale and sends it again
                changes = d.part_changes.get(n, 0)
                data = await trio.to_thread.run_sync(read_closing, os.dup(d.fd), ps, start)
                if len(data) == ps and self._streaming(d, s):
                    await self._send(s, n, data, changes)
        finally:
            s.end()

    def abandon(self, d: DirtyFile, s: Stream, *, keep: bool = False) -> None:
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
            self.uploads.give_up(s.upload_id)


def as_tierfs_error(group: BaseExceptionGroup) -> BaseException:
    """The failure of a group of part uploads as the one TierfsError the caller handles
    (NotFound first: the upload is gone, which the caller answers by starting again), or
    the group itself if it holds anything else (a bug, reported with its traceback)."""
    errors = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
    if errors and all(isinstance(e, TierfsError) for e in errors):
        return next((e for e in errors if isinstance(e, NotFound)), errors[0])
    return group
