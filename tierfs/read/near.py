"""The near store: an object store close to this node (an on-prem Ceph) that holds copies
of the source's objects (a cloud bucket), asked after the peers and before the source.

A copy is the object under the near store's prefix + the source key, with the source
version it is of in its user metadata (NEAR_ETAG, NEAR_SIZE). A read asks for the chunk
with that metadata as its precondition, checked on the response as If-Match checks an
ETag: a copy of another version (the source changed since) is a miss, never served. The
source's listing stays the authority on which version is current.

A failure of the near store is a miss, not an error: the read goes on to the source.
While the near store is known down (its BackendHealth) it is not asked at all, and after
a failed GET (a timeout after --tier-timeout, a 5xx, bytes that fail their CRCs) reads
skip it for a cool-down (COOL_MIN_S, doubling up to COOL_MAX_S while it keeps failing):
a near store that hangs on GETs while answering its bucket check costs one read one
timeout, not every read. What the source answered is offered to the promoter
(promote.py), which copies the object here. Bytes are checked where they are received
(tierfs/integrity.py): a copy carries the chunk CRC32Cs the promoter computed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ..backend.runner import AsyncBackend
from ..cache import ChunkCache, ObjectVersion
from ..cache.tier import Bytes, Want
from ..errors import BackendError, NotFound, PreconditionFailed, StoreDown
from .sources import StoreSource

log = logging.getLogger(__name__)

NEAR_ETAG = "tierfs-origin-etag"  # user metadata of a near copy: the source's ETag
NEAR_SIZE = "tierfs-origin-size"  # and its size
# the metadata of a copy being made (completed, its final metadata not set yet): never
# served; `tierfs gc --tier near` removes one left behind by a crash (neargc.py)
NEAR_MAKING = "tierfs-copy-of"
LOG_EVERY_S = 60.0  # one log line per this long for failures the health does not log
COOL_MIN_S = 10.0  # reads skip the near store this long after a failed GET...
COOL_MAX_S = 300.0  # ...doubling while it keeps failing, up to this


def near_metadata(obj: ObjectVersion) -> dict[str, str]:
    """The user metadata that makes an object of the near store a copy of `obj`."""
    return {NEAR_ETAG: obj.etag, NEAR_SIZE: str(obj.size)}


class NearSource:
    """The near store as a source of the read walk (tierfs/cache/tier.py)."""

    name = "near"

    def __init__(self, backend: AsyncBackend, prefix: str, cache: ChunkCache,
                 chunk_size: int, *, offer: Callable[[ObjectVersion], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`prefix`: the near store's prefix ("" or ending in "/"); `offer`: where the
        source's answers go to be copied here (the promoter), None: never copied."""
        self.backend = backend
        self.prefix = prefix
        self._store = StoreSource(backend, cache, chunk_size)
        self._offer = offer
        self._clock = clock
        self._logged = -LOG_EVERY_S
        self._cool_s = 0.0  # the current cool-down (0: the last GET did not fail)
        self._skip_until = 0.0
        self.hits = 0
        self.misses = 0
        self.failures = 0

    def key(self, obj: ObjectVersion) -> str:
        return self.prefix + obj.key

    async def get(self, want: Want) -> Bytes | None:
        obj = want.obj
        health = self.backend.health
        if (health is not None and not health.up) or self._clock() < self._skip_until:
            self.misses += 1
            return None
        try:
            data = await self._store.fetch(want, self.key(obj), None, near_metadata(obj))
        except (NotFound, PreconditionFailed):
            self.misses += 1  # no copy, or a copy of another version
            self._cool_s = 0.0  # an answer: the near store works
            return None
        except (StoreDown, BackendError) as exc:
            # unreachable stores are logged by the health; a 5xx, an integrity failure
            # after the refetches, or a refusal once a minute here
            self.failures += 1
            now = self._clock()
            self._cool_s = min(COOL_MAX_S, max(COOL_MIN_S, 2 * self._cool_s))
            self._skip_until = now + self._cool_s
            if now - self._logged >= LOG_EVERY_S:
                self._logged = now
                log.warning("near store: %s; reading from the source instead, and for the "
                            "next %.0f s (%d such failures so far)", exc, self._cool_s,
                            self.failures)
            return None
        self._cool_s = 0.0
        self.hits += 1
        return data

    async def put(self, want: Want, data: Bytes) -> None:
        """A source below (the cloud bucket) answered a chunk the near store lacked."""
        if self._offer is not None:
            self._offer(want.obj)
