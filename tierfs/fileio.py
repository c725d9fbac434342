"""FileIO: open handles and reads, split per chunk, over the cache and the fetcher.

A handle is bound to one object version (key + ETag) when opened. Every read is served
from that version only: chunk keys carry the ETag and ranged GETs carry If-Match, so one
read never mixes bytes of two versions. If the object changed before the handle served
anything, the handle moves to the new version; after that, reads fail with ESTALE.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from .cache import ChunkCache, ObjectVersion
from .errors import BackendError, IsADirectory, PreconditionFailed, StaleObject
from .fetch import Fetcher
from .meta import Inode
from .metrics import Metrics
from .namespace import Namespace
from .prefetch import Prefetcher, ReadPattern

log = logging.getLogger(__name__)


@dataclass
class OpenFile:
    fh: int
    node: Inode
    obj: ObjectVersion
    served: bool = False
    touched: set[int] = field(default_factory=set)
    pattern: ReadPattern = field(default_factory=ReadPattern)


class FileIO:
    def __init__(self, namespace: Namespace, cache: ChunkCache, fetcher: Fetcher,
                 prefetcher: Prefetcher, metrics: Metrics, *, bucket: str) -> None:
        self.ns = namespace
        self.cache = cache
        self.fetcher = fetcher
        self.prefetcher = prefetcher
        self.metrics = metrics
        self.bucket = bucket
        self.chunk_size = fetcher.chunk_size
        self._handles: dict[int, OpenFile] = {}
        self._next_fh = itertools.count(1)
        # ETag of each inode's newest open: a handle on another ETag is an older version
        self._opened_etag: dict[int, str] = {}
        # inodes whose kernel-cached size or pages may belong to another version: an old
        # handle's short read at its EOF makes the kernel shrink the file's size
        self._kernel_stale: set[int] = set()

    async def open(self, ino: int) -> tuple[OpenFile, bool]:
        """Open a file: (handle, whether the kernel may keep its cached pages)."""
        node = self.ns.inode(ino)
        if node.is_dir:
            raise IsADirectory(node.key)
        node = await self.ns.revalidate(node)
        h = OpenFile(next(self._next_fh), node, self._version(node))
        self._handles[h.fh] = h
        keep = self._opened_etag.get(ino) == node.etag and ino not in self._kernel_stale
        self._opened_etag[ino] = node.etag
        self._kernel_stale.discard(ino)
        return h, keep

    def _version(self, node: Inode) -> ObjectVersion:
        return ObjectVersion(self.bucket, node.key, node.etag, node.size)

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)

    def handle(self, fh: int) -> OpenFile:
        return self._handles[fh]

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        h = self._handles[fh]
        newest = self._opened_etag.get(h.node.ino)
        if newest != h.obj.etag:
            self._kernel_stale.add(h.node.ino)
            if not h.served:  # nothing of the old version served yet: move to the newest
                node = self.ns.inode(h.node.ino)
                h.node, h.obj = node, self._version(node)
        try:
            return await self._read(h, offset, size)
        except PreconditionFailed:
            node = await self.ns.refresh(h.node)
            if h.served or node.etag == h.obj.etag:
                raise StaleObject(f"{h.obj.key!r} changed while open; reopen it") from None
            log.info("%r changed before its first read; reading the new version", h.obj.key)
            h.node, h.obj = node, self._version(node)
            return await self._read(h, offset, size)
        except BackendError as exc:
            log.error("read of %r at offset %d failed: %s", h.obj.key, offset, exc)
            raise

    async def _read(self, h: OpenFile, offset: int, size: int) -> bytes:
        obj = h.obj
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        self.prefetcher.on_read(obj, h.pattern, offset, end)
        cs, bs = self.chunk_size, self.cache.block_size
        pieces: list[bytes] = []
        for index in range(offset // cs, (end - 1) // cs + 1):
            base = index * cs
            lo, hi = max(offset, base) - base, min(end, base + cs) - base
            first, last = lo // bs, (hi - 1) // bs
            ckey = obj.chunk_key(index)
            hit = await self.cache.read(ckey, first, last, touch=index not in h.touched)
            if hit is not None:
                data, source = hit
                skip = first * bs
                pieces.append(data[lo - skip:hi - skip])
            else:
                data = await self.fetcher.chunk(obj, index)
                source = "backend"
                pieces.append(data[lo:hi])
            h.touched.add(index)
            self.metrics.read_bytes.labels(source).inc(hi - lo)
        h.served = True
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)
