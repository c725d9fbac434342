"""Uploads: which multipart uploads this daemon owns, and the cleanup of those it does not.

Every multipart upload this daemon creates is recorded in the journal before it exists
(a *pending* marker, even before CreateMultipartUpload answers) and owned from then until
it is completed or given up. Orphan cleanup aborts only recorded uploads nobody owns:
those of an earlier daemon, of an attempt that failed, of a file unlinked while its
stream ran, and uploads created on the server whose answer was lost (found by listing
the key's uploads initiated while the marker was live, ±CLOCK_SKEW_S). Before aborting it
also asks the write-back (`live`) whether a live file holds the id: an upload a live or
journaled file owns is never aborted, whatever the bookkeeping here says.

Cleanup runs at start and whenever an upload is given up, in its own task, with backoff
while the store fails it.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Callable

import trio

from ..backend.runner import AsyncBackend
from ..errors import AccessDenied, NoSuchBucket, NotFound, PreconditionFailed, TierfsError
from ..index.meta import MetaStore
from ..metrics import Metrics

log = logging.getLogger("tierfs.writeback")

CLOCK_SKEW_S = 300.0  # between this node and the store, when comparing Initiated times
_PENDING = "pending-"  # an uploads record made before CreateMultipartUpload answered
# failures a retry cannot fix: the upload is gone, the base changed, or we may not write
FINAL = (NotFound, PreconditionFailed, AccessDenied, NoSuchBucket)


class Uploads:
    def __init__(self, meta: MetaStore, backend: AsyncBackend, metrics: Metrics, *,
                 live: Callable[[str], bool], retry_min_s: float, retry_max_s: float) -> None:
        self.meta = meta
        self.metrics = metrics
        self.backend = backend
        self.live = live  # whether a live file of the write-back holds this upload id
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._owned: dict[str, str] = {}  # ids and pending markers this daemon runs -> key
        # pending markers no longer owned -> latest wall time an upload created under them
        # can have been initiated (before the store's answer was lost)
        self._marker_until: dict[str, float] = {}
        self._started = time.time()  # markers of an earlier daemon ended before this
        self._given_up: set[str] = set()  # ids this daemon stopped owning (for the log)
        self._wake = trio.Event()

    def owns(self, upload_id: str) -> bool:
        return upload_id in self._owned

    def key_of(self, upload_id: str, default: str) -> str:
        return self._owned.get(upload_id, default)

    def give_up(self, upload_id: str | None) -> None:
        """This daemon no longer runs the upload: cleanup aborts it, soon."""
        if upload_id is not None and self._owned.pop(upload_id, None) is not None:
            self._given_up.add(upload_id)
            self.sweep_soon()

    async def finished(self, upload_id: str) -> None:
        """Completed or aborted by its owner: no longer recorded. The markers its creation
        left are cleanup's now."""
        self._owned.pop(upload_id, None)
        await trio.to_thread.run_sync(self.meta.journal.delete_upload, upload_id)
        if self.unowned():
            self.sweep_soon()

    async def create(self, key: str, metadata: dict[str, str]) -> str:
        """CreateMultipartUpload, recorded in the journal before it exists and owned from
        before it exists until completed or given up."""
        marker = f"{_PENDING}{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
        self._owned[marker] = key
        answered = False
        try:
            # recorded before it exists: if the answer is lost (or we crash), the marker
            # leads orphan cleanup to this key's uploads initiated while it was live.
            # journal appends fsync: off the trio thread
            await trio.to_thread.run_sync(self.meta.journal.put_upload, marker, key)
            try:
                upload_id = await self.backend.mpu_create(key, metadata)
            except FINAL:
                answered = True  # the store said no: it created nothing
                raise
            self._owned[upload_id] = key
            await trio.to_thread.run_sync(self.meta.journal.put_upload, upload_id, key)
            return upload_id
        finally:
            del self._owned[marker]
            if answered:
                await trio.to_thread.run_sync(self.meta.journal.delete_upload, marker)
            else:
                # stays recorded even on success: botocore may have retried a create whose
                # first answer was lost, leaving an upload we do not know; cleanup finds it
                self._marker_until[marker] = time.time()

    # ---- cleanup ----------------------------------------------------------------------

    def unowned(self) -> bool:
        return any(rid not in self._owned for rid, _ in self.meta.journal.uploads())

    def sweep_soon(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """The cleanup task: a sweep at start, then one each time an upload is given up
        (or a marker left behind), with backoff while the store fails it. Never dies."""
        self._wake.set()
        failures = 0
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                ok = await self._sweep_pass()
            except Exception as exc:  # keep the task
                self.metrics.internal_errors.labels("orphan-cleanup").inc()
                log.error("orphan cleanup failed unexpectedly", exc_info=exc)
                ok = False
            if ok:
                failures = 0
                continue
            failures += 1
            delay = min(self.retry_max_s, self.retry_min_s * 2 ** min(failures - 1, 30))
            log.info("orphaned multipart uploads remain; trying again in %.0fs", delay)
            await trio.sleep(delay)
            self._wake.set()

    async def sweep(self) -> bool:
        """One pass now (tests, tools); False if the store failed some of it."""
        return await self._sweep_pass()

    async def _sweep_pass(self) -> bool:
        ok = True
        markers: dict[str, list[str]] = {}
        for rid, key in self.meta.journal.uploads():
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
        if rid in self._owned or self.live(rid):
            return
        await self.backend.mpu_abort(key, rid)  # NoSuchUpload counts as done
        await trio.to_thread.run_sync(self.meta.journal.delete_upload, rid)
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
            if u.upload_id in self._owned or self.live(u.upload_id):
                continue
            if not any(lo <= u.initiated <= hi for lo, hi in windows):
                continue  # another writer's: initiated while no marker of ours was live
            await self.backend.mpu_abort(key, u.upload_id)
            log.info("aborted an upload of %r (id %s) whose creation was never answered",
                     key, u.upload_id)
        for m in markers:
            await trio.to_thread.run_sync(self.meta.journal.delete_upload, m)
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
