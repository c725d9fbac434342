"""Promotion: copying to the near store (near.py) what a read fetched from the source.

The near source offers each object version whose chunk the source had to answer to the
Promoter, whose one task has a Copier copy them, one at a time, oldest offer first
(`tierfs warm --tier near` uses a Copier of its own). Each chunk is read
through the read walk (`read`: the local tiers first, so what this node has just read
crosses the WAN once; what it has not is fetched at read-ahead priority) and written to
the near store. The copy becomes visible as a copy of its version only whole, with the
source's ETag and size in its metadata (near.NEAR_ETAG) and the CRC32C of each chunk
(tierfs/integrity.py) so later reads of it are verified:
- an object of one part: one PUT with all of it;
- a bigger one: a multipart upload marked NEAR_MAKING (not NEAR_ETAG), completed, then
  copied onto itself with the metadata (one request, metadata-only on Ceph RGW); when its
  CRCs do not fit in S3's 2 KB of metadata (> 2.3 GiB with 8 MiB chunks), NEAR_ETAG from
  the start. A crash between the two leaves a NEAR_MAKING object: never served, and
  removed by `tierfs gc --tier near` once it is an hour old.
A half-written copy is therefore never a copy of anything. A failure costs the copy,
never a read: it is logged once per minute and counted in tierfs_tier_promotions_total.

Bounded: at most `max_queued` offers wait (more are dropped and counted), and versions
copied recently are remembered so a second reader does not copy them again (a version
whose copy failed is tried again at an offer a minute later at the earliest). Concurrent
first reads of one object on two nodes may both copy it (the later copy replaces the
earlier with the same bytes).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Awaitable, Callable

import trio

from ..backend.runner import AsyncBackend
from ..cache import ObjectVersion
from ..cache.tier import Bytes, chunk_length
from ..errors import NotFound, PreconditionFailed, TierfsError
from ..integrity import chunk_crcs_metadata, crc32c
from ..metrics import Metrics
from .near import NEAR_ETAG, NEAR_MAKING, near_metadata

log = logging.getLogger(__name__)

MIN_PART = 5 << 20  # S3's smallest part but the last
MAX_QUEUED = 256
REMEMBERED = 4096  # versions copied (or found copied) lately, not copied again
RETRY_AFTER_S = 60.0  # a version whose copy failed is not tried again sooner
LOG_EVERY_S = 60.0


class Copier:
    """Copies object versions to the near store, each chunk got by `read`, and says which
    it holds: the promoter's (through the read walk) and `tierfs warm --tier near`'s
    (straight from the source)."""

    def __init__(self, near: AsyncBackend, prefix: str,
                 read: Callable[[ObjectVersion, int], Awaitable[Bytes]], chunk_size: int) -> None:
        self.near = near
        self.prefix = prefix
        self._read = read
        self.chunk_size = chunk_size
        self.copied = 0
        self.copied_bytes = 0

    async def present(self, obj: ObjectVersion) -> bool:
        """Whether the near store holds a copy of this version (one HEAD)."""
        try:
            meta = await self.near.head(self.prefix + obj.key)
        except NotFound:
            return False
        return (meta.metadata or {}).get(NEAR_ETAG) == obj.etag

    async def delete(self, obj: ObjectVersion) -> bool:
        """Remove the near store's copy of `obj` if it holds one; whether it did."""
        if not await self.present(obj):
            return False
        await self.near.delete(self.prefix + obj.key)
        return True

    async def copy(self, obj: ObjectVersion) -> str:
        """Copy `obj` to the near store unless it holds it: "copied", "present" or
        "changed" (the source's object changed meanwhile); a failure raises."""
        if await self.present(obj):
            return "present"  # another node (or an earlier warm) copied it
        key = self.prefix + obj.key
        n = -(-obj.size // self.chunk_size)
        per_part = max(1, -(-MIN_PART // self.chunk_size))  # chunks per part
        try:
            if n <= per_part:
                return await self._put_whole(obj, key, n)
            return await self._put_parts(obj, key, n, per_part)
        except PreconditionFailed:
            return "changed"  # the source's object changed while we copied it

    async def _chunk(self, obj: ObjectVersion, index: int) -> Bytes:
        data = await self._read(obj, index)
        if len(data) != chunk_length(self.chunk_size, obj.size, index):
            raise PreconditionFailed(f"promote {obj.key!r}: chunk {index} has another size")
        return data

    async def _put_whole(self, obj: ObjectVersion, key: str, n: int) -> str:
        chunks = [bytes(await self._chunk(obj, i)) for i in range(n)]
        meta = {**near_metadata(obj),
                **chunk_crcs_metadata(self.chunk_size, [crc32c(c) for c in chunks])}
        await self.near.put(key, b"".join(chunks), meta)
        self._copied(obj)
        return "copied"

    async def _put_parts(self, obj: ObjectVersion, key: str, n: int, per_part: int) -> str:
        # the CRCs are known only at the end: if they will fit, the version's metadata
        # comes with them in the final copy, so the upload is no copy of anything before
        fits = bool(chunk_crcs_metadata(self.chunk_size, [0] * n))
        upload = await self.near.mpu_create(
            key, {NEAR_MAKING: obj.etag} if fits else near_metadata(obj))
        crcs: list[int] = []
        parts: list[tuple[int, str]] = []
        try:
            for number, first in enumerate(range(0, n, per_part), 1):
                pieces = [await self._chunk(obj, i)
                          for i in range(first, min(n, first + per_part))]
                crcs.extend(crc32c(memoryview(p)) for p in pieces)
                body = b"".join(bytes(p) for p in pieces)
                parts.append((number, await self.near.upload_part(key, upload, number, body)))
            etag = await self.near.mpu_complete(key, upload, parts)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await self.near.mpu_abort(key, upload)
                except TierfsError:
                    pass  # an abandoned upload: the store's lifecycle rule removes it
            raise
        if fits:
            await self.near.copy(key, key, etag,
                                 {**near_metadata(obj),
                                  **chunk_crcs_metadata(self.chunk_size, crcs)})
        self._copied(obj)
        return "copied"

    def _copied(self, obj: ObjectVersion) -> None:
        self.copied += 1
        self.copied_bytes += obj.size


class Promoter:
    """The queue of versions a read had to fetch from the source, copied one at a time by
    a Copier."""

    def __init__(self, copier: Copier, metrics: Metrics, *, max_queued: int = MAX_QUEUED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.copier = copier
        self._metrics = metrics
        self._max_queued = max_queued
        self._queued: OrderedDict[tuple[str, str], ObjectVersion] = OrderedDict()
        # version -> when it may be copied again (never: inf): copied, found copied, or
        # failed lately
        self._done: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._busy: tuple[str, str] | None = None
        self._wake = trio.Event()
        self._clock = clock
        self._logged = -LOG_EVERY_S

    @property
    def copied(self) -> int:
        return self.copier.copied

    @property
    def copied_bytes(self) -> int:
        return self.copier.copied_bytes
    def _count(self, outcome: str) -> None:
        self._metrics.tier_promotions.labels("near", outcome).inc()

    def offer(self, obj: ObjectVersion) -> None:
        """A read fetched a chunk of `obj` from the source (non-blocking, trio thread)."""
        ident = (obj.key, obj.etag)
        if ident in self._queued or ident == self._busy or obj.size == 0:
            return
        until = self._done.get(ident)
        if until is not None and self._clock() < until:
            return
        if len(self._queued) >= self._max_queued:
            self._count("dropped")
            return
        self._queued[ident] = obj
        self._wake.set()

    def pending(self) -> int:
        return len(self._queued) + (self._busy is not None)

    async def run(self) -> None:
        """Copy what is offered, for the life of the mount (Tasks.supervise)."""
        while True:
            if not self._queued:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            ident, obj = self._queued.popitem(last=False)
            self._busy = ident
            try:
                outcome = await self.copier.copy(obj)
            except TierfsError as exc:
                outcome = "failed"
                self._failed(obj, exc)
            finally:
                self._busy = None
            self._count(outcome)
            self._done.pop(ident, None)
            self._done[ident] = (self._clock() + RETRY_AFTER_S if outcome == "failed"
                                 else float("inf"))
            while len(self._done) > REMEMBERED:
                self._done.popitem(last=False)

    def _failed(self, obj: ObjectVersion, exc: TierfsError) -> None:
        now = self._clock()
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning("near store: not copied %r: %s (reads are not affected; one such "
                        "line a minute)", obj.key, exc)

