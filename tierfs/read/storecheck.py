"""What the object store says a chunk from a peer must be, where the object allows it.

A peer's reply is checked by the peer client against the CRCs its owner computed and
signed (tierfs/peers/client.py). That proves the bytes are what the owner meant to send,
not that they are the object's: a node holding the shared secret could sign wrong bytes.
So a chunk from a peer is also checked against the store's own checksums when the object
has one that covers the chunk (issue 13, "where the object allows"):

- an object that is one chunk, read whole: its ETag, when it is an MD5 (a single-part
  object not encrypted with SSE-KMS/SSE-C) - nothing to ask the store for, the LIST gave it;
- an object tierfs wrote: the per-chunk CRC32Cs in its user metadata
  (integrity.chunk_crcs_metadata), learnt by one HEAD per object version, kept in a bounded
  LRU, asked once however many chunks of the object arrive at once.

Anything else (a multipart object another client wrote, an object over 2.3 GiB, a HEAD
that fails while the store is down) is not checkable here and is taken on the owner's CRCs,
which docs/peers.md states. A refuted chunk is not used: the fetcher gets the chunk from the
store and blames the peer only if the store's bytes differ from the peer's (an SSE-KMS
ETag looks like an MD5 and is not one; that must not mark an honest peer down).
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from .. import integrity
from ..backend.runner import AsyncBackend
from ..cache import ObjectVersion
from ..errors import IntegrityError, TierfsError

MAX_OBJECTS = 4096  # object versions whose checksum metadata is remembered


class StoreChecks:
    def __init__(self, backend: AsyncBackend, chunk_size: int, *,
                 max_objects: int = MAX_OBJECTS) -> None:
        self.backend = backend
        self.chunk_size = chunk_size
        self.max_objects = max_objects
        # (key, etag) -> the object's user metadata, {} when it has none we can use
        self._metadata: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()
        self._heads: dict[tuple[str, str], trio.Event] = {}
        self.heads = 0  # HEADs sent (for tests and docs: one per object version)

    async def agree(self, obj: ObjectVersion, index: int,
                    data: bytes | bytearray | memoryview) -> bool:
        """False when a checksum the store keeps for these bytes disagrees with them; True
        when it agrees or nothing the store keeps covers them."""
        start = index * self.chunk_size
        if start == 0 and len(data) == obj.size:
            metadata: dict[str, str] = {}  # one chunk: the ETag's MD5 covers it, if any
        else:
            metadata = await self._metadata_of(obj)
            if integrity.CRC_META_KEY not in metadata:
                return True
        got = integrity.Received(obj.key, start, obj.size, obj.etag, metadata=metadata)
        try:
            integrity.verify(got, memoryview(data))
        except IntegrityError:
            return False
        return True

    async def _metadata_of(self, obj: ObjectVersion) -> dict[str, str]:
        ident = (obj.key, obj.etag)
        while ident not in self._metadata:
            pending = self._heads.get(ident)
            if pending is not None:
                await pending.wait()
                continue
            done = self._heads[ident] = trio.Event()
            try:
                meta = await self.backend.head(obj.key)
            except TierfsError:
                return {}  # not known now (store down, object gone): ask again next time
            finally:
                del self._heads[ident]
                done.set()
                self.heads += 1
            # another version now: its metadata says nothing about the one being read
            self._remember(ident, dict(meta.metadata or {}) if meta.etag == obj.etag else {})
        self._metadata.move_to_end(ident)
        return self._metadata[ident]

    def _remember(self, ident: tuple[str, str], metadata: dict[str, str]) -> None:
        self._metadata[ident] = metadata
        while len(self._metadata) > self.max_objects:
            self._metadata.popitem(last=False)
