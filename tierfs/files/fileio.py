"""FileIO: open handles, reads and writes, and the operations that span several parts.

A read-only handle is bound to one object version (key + ETag) when opened. Every read
is served from that version only: chunk keys carry the ETag and ranged GETs carry
If-Match, so one read never mixes bytes of two versions. The kernel's page cache is shared
by an inode's handles: pagecache.py keeps it to one version (newer versions' handles go
direct while older ones read through it). If the object changed before
the handle served anything, the handle moves to the new version; after that, reads fail
with ESTALE. A file with unsaved writes is read from its DirtyFile (writeback/) by
every handle, so readers on this node see what writers wrote.

Operations that touch both the namespace and unsaved data (unlink, rename, truncate,
chmod of a file being written) are composed here, since those two parts do not know
each other.

Who reads (docs/tenants.md, "Readers"): an open resolves its caller (the FUSE request's
pid and uid) to a reader once (tierfs/telemetry/callers.py: cached per pid; a miss reads /proc in
a worker thread) and its key to a tenant once; each read then counts its bytes, by
source, to both (tierfs/telemetry/usage.py) where tierfs_read_bytes_total is counted. A read also
measures how long it waited on fetches (its own GET or another's flight, a peer, the
fetch queue); past `stall_threshold` that is a stall (tierfs/telemetry/stalls.py, usage's stall
seconds). Per read: a few clock reads, no label lookup, no I/O.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import AsyncIterator, Callable, Iterable

import trio

from ..backend.base import ObjectMeta
from ..cache import ChunkCache, ObjectVersion
from ..cache.tier import FETCHED, SOURCES, Want
from ..cache.tiers import OwnChunk
from ..errors import (
    BackendError,
    CrossDevice,
    Exists,
    FileTooBig,
    InvalidArgument,
    IsADirectory,
    NotADirectory,
    NotFound,
    PreconditionFailed,
    StaleObject,
)
from ..index.attrs import MAX_FILE_SIZE, Attrs, without_privs
from ..index.inodes import Inode
from ..metrics import Metrics
from ..read.dirahead import DirReadAhead
from ..read.prefetch import Prefetcher, ReadPattern
from ..read.walk import TierWalk
from ..telemetry.callers import Callers
from ..telemetry.stalls import StallLog
from ..telemetry.usage import Usage
from ..tenants import DEFAULT
from ..writeback import DirtyFile, WriteBack
from .namespace import Caller, Namespace
from .pagecache import UNSAVED, PageCache

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_RANK = {"memory": 0, "disk": 1, "peer": 2, "near": 3, "backend": 4}  # nearest to furthest source
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR

log = logging.getLogger(__name__)


@dataclass
class OpenFile:
    fh: int
    node: Inode
    obj: ObjectVersion
    served: bool = False
    touched: set[int] = field(default_factory=set)
    pattern: ReadPattern = field(default_factory=ReadPattern)
    dirty: DirtyFile | None = None  # set when opened for writing
    wrote: bool = False
    # opened or read while the file had unsaved writes: its version is the DirtyFile's
    read_unsaved: bool = False
    direct: bool = False  # its reads go around the kernel's page cache (pagecache.py)
    tenant: str = DEFAULT  # of the key at open (tierfs/tenants.py)
    reader: str = "uid:0"  # the opener: job:N, pod:UID or uid:N (tierfs/telemetry/callers.py)
    # chunks brought in for this handle (read ahead, or fetched on its own miss): how far
    # into each it has read. Bytes past that are that fetch's first delivery and count
    # where it came from; bytes before it are a re-read, and count where they are now.
    delivered: dict[int, int] = field(default_factory=dict)
    own: OwnChunk | None = None  # the chunk it fetched and is reading (cache/tiers.py)


class FileIO:
    def __init__(self, namespace: Namespace, cache: ChunkCache, walk: TierWalk,
                 prefetcher: Prefetcher, metrics: Metrics, *, bucket: str,
                 writeback: WriteBack | None = None, rename_max_objects: int = 1000,
                 usage: Usage | None = None, callers: Callers | None = None,
                 tenant_of: Callable[[str], str] | None = None,
                 stalls: StallLog | None = None, dirahead: DirReadAhead | None = None) -> None:
        self.ns = namespace
        self.dirahead = dirahead  # small files of a directory read in order: fetched ahead
        self.wb = writeback
        self.rename_max_objects = rename_max_objects
        self.cache = cache
        self.walk = walk
        self.prefetcher = prefetcher
        self.metrics = metrics
        self.bucket = bucket
        self.chunk_size = walk.chunk_size
        self._handles: dict[int, OpenFile] = {}
        self._next_fh = itertools.count(1)
        # which version the kernel's pages of each file hold, and which handles go
        # around them: two versions' bytes never meet in one read
        self.pages = PageCache()
        if writeback is not None:
            writeback.on_saved = self._saved
        self.usage = usage
        self.callers = callers
        self.tenant_of = tenant_of
        self.stalls = stalls
        # a wait this long is a stall; without a stall log, none is
        self._stall_threshold = stalls.threshold_s if stalls is not None else float("inf")
        # labelled children looked up once: a read makes no label lookup
        self._read_bytes = {s: metrics.read_bytes.labels(s) for s in SOURCES}
        self._read_seconds = {s: metrics.read_seconds.labels(s) for s in SOURCES}

    async def open(self, ino: int, flags: int = os.O_RDONLY, pid: int = 0,
                   uid: int = 0) -> tuple[OpenFile, bool]:
        """Open a file for the caller `pid`, `uid` (the FUSE request's): (handle, whether
        the kernel may keep its cached pages)."""
        node = self.ns.inode(ino)
        if node.is_dir:
            raise IsADirectory(node.key)
        node = await self.ns.revalidate(node)
        reader = await self._reader(pid, uid)
        h = OpenFile(next(self._next_fh), node, self._version(node))
        self._attribute(h, reader)
        if self.dirahead is not None and not flags & _WRITE_FLAGS and node.etag:
            brought = self.dirahead.opened(node, h.obj, h.tenant)
            if brought is not None:  # its first reads count where the fetch brought it from
                h.pattern.fetched[0] = brought
        if flags & _WRITE_FLAGS:
            h.dirty = self._open_dirty(node, truncate=bool(flags & os.O_TRUNC))
            if flags & os.O_TRUNC:
                try:
                    await self._wb.truncate(h.dirty, 0)
                except BaseException:
                    await self._release_dirty(h.dirty)  # no handle: no release will come
                    raise
        self._handles[h.fh] = h
        h.read_unsaved = bool(self.wb and self.wb.is_dirty(ino))
        version = UNSAVED if h.read_unsaved else node.etag
        # pages of its version are served by the kernel without asking us: as good as
        # served, so the handle never moves to another version under them
        h.served = self.pages.holds(ino, version)
        keep, h.direct = self.pages.open(ino, h.fh, version)
        return h, keep

    def _open_dirty(self, node: Inode, *, truncate: bool) -> DirtyFile:
        if self.wb is None:
            raise InvalidArgument("this mount has no write support")
        base = self._version(node) if node.etag and not truncate else None
        return self.wb.open(node.ino, node.key, base, truncate=truncate,
                            metadata=node.attrs.to_metadata(node.kind))

    async def _reader(self, pid: int, uid: int) -> str:
        """The caller as a reader: a dict lookup, or /proc read in a worker thread once
        per process (and TTL); a request the kernel made itself (pid 0) is its uid."""
        callers = self.callers
        if callers is None:
            return f"uid:{uid}"
        found = callers.cached(pid, uid)
        if found is None:
            found = (callers.resolve(pid, uid) if pid <= 0
                     else await trio.to_thread.run_sync(callers.resolve, pid, uid))
            callers.store(pid, uid, found)
        return found

    def _attribute(self, h: OpenFile, reader: str) -> None:
        h.reader = reader
        self.cache.opened_by(reader)
        if self.tenant_of is not None:
            h.tenant = self._pod_tenant(reader) or self.tenant_of(h.node.key)
        h.pattern.tenant = h.tenant  # its read-ahead fills the cache for the same tenant

    def _pod_tenant(self, reader: str) -> str | None:
        """The tenant tierfs-csi named for a pod reader (tenant_from: namespace), if this
        mount declares it: what the pod brings into the cache counts for it and its
        quotas (docs/tenants.md, "Readers")."""
        if self.usage is None or not reader.startswith("pod:"):
            return None
        pod = self.usage.pod(reader[len("pod:"):])
        if pod is None or pod.tenant is None or pod.tenant not in self.cache.tenants.names():
            return None
        return pod.tenant

    async def create(self, parent: int, name: bytes, perm: int,
                     caller: Caller = Caller(), pid: int = 0,
                     exclusive: bool = False) -> tuple[OpenFile, Inode]:
        """exclusive (O_EXCL): the key is claimed in the store first, EEXIST if another
        node has it (tierfs/files/exclusive.py)."""
        reader = await self._reader(pid, caller.uid)
        node = (await self.ns.create_file_exclusive(parent, name, perm, caller) if exclusive
                else self.ns.create_file(parent, name, perm, caller))
        h = OpenFile(next(self._next_fh), node, self._version(node))
        self._attribute(h, reader)
        h.dirty = self._open_dirty(node, truncate=True)
        self._handles[h.fh] = h
        h.read_unsaved = True
        self.pages.open(node.ino, h.fh, UNSAVED)
        return h, node

    def _version(self, node: Inode) -> ObjectVersion:
        return ObjectVersion(self.bucket, node.key, node.etag, node.size)

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        self.prefetcher.closed(h.pattern)  # what it read ahead and held is the LRU's again
        self.pages.close(h.node.ino, fh)
        if h.dirty is not None and self.wb is not None:
            await self._release_dirty(h.dirty)

    @property
    def _wb(self) -> WriteBack:
        """The write-back, where a DirtyFile is: a read-only mount has neither."""
        assert self.wb is not None
        return self.wb

    async def _release_dirty(self, d: DirtyFile) -> None:
        await self._save_times(d)
        if await self._wb.release(d):
            # a failed write's changes were dropped: what the kernel cached of them (pages,
            # size) must not outlive them; the next open asks again
            self.pages.forget(d.ino)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        h = self._handles[fh]
        ino = h.node.ino
        d = self.wb.get(ino) if self.wb is not None else None
        if d is not None:
            h.read_unsaved = True
            unsaved = await self._wb.read(d, offset, size)
            self.pages.served(ino, fh, UNSAVED)
            return unsaved
        if h.read_unsaved or self.pages.newest(ino) == UNSAVED:
            self._uploaded(ino)
        newest = self.pages.newest(ino)
        if newest is not None and newest != h.obj.etag and not h.served:
            # nothing of the old version served yet: move to the newest, where its reads
            # cannot meet pages of another version (pagecache.py)
            node = self.ns.inode(ino)
            if node.etag == newest and self._may_move(h, node):
                h.node, h.obj = node, self._version(node)
        try:
            data = await self._read(h, offset, size)
        except PreconditionFailed:
            node = await self.ns.refresh(h.node)
            if h.served or node.etag == h.obj.etag or not self._may_move(h, node):
                raise StaleObject(f"{h.obj.key!r} changed while open; reopen it") from None
            log.info("%r changed before its first read; reading the new version", h.obj.key)
            h.node, h.obj = node, self._version(node)
            data = await self._read(h, offset, size)
        except BackendError as exc:
            log.error("read of %r at offset %d failed: %s", h.obj.key, offset, exc)
            raise
        self.pages.served(ino, fh, h.obj.etag)
        return data

    def _saved(self, ino: int, version: ObjectVersion) -> None:
        """The write-back let go of `ino`, saved as `version`: the handles that read its
        unsaved bytes, and the pages holding them, hold that version (on one node a
        reader sees what writers wrote, as POSIX says). Done at once: a later lookup may
        find another client's newer version under the name, which those bytes are not."""
        try:
            node = self.ns.inode(ino)
        except NotFound:  # unlinked meanwhile: its handles read what they read
            return
        for h in self._handles.values():
            if h.node.ino == ino and h.read_unsaved:
                h.node, h.obj, h.read_unsaved = node, version, False
        self.pages.relabel(ino, version.etag, UNSAVED)

    def _may_move(self, h: OpenFile, node: Inode) -> bool:
        """Whether a handle that served nothing may read `node`'s version instead of its
        own: one of the same size (the kernel keeps the size it was told at the open and
        would cut a read of a longer version there, or read past a shorter one's end)
        whose reads cannot meet pages of another version (pagecache.py)."""
        return node.size == h.obj.size and self.pages.may_move(h.node.ino, h.fh, node.etag)

    def _uploaded(self, ino: int) -> None:
        """The unsaved data this node's handles of `ino` read is gone without a saved
        version (_saved moves them when there is one): they move to the version in the
        index."""
        try:
            node = self.ns.inode(ino)
        except NotFound:  # unlinked meanwhile: its handles read what they read
            return
        new = self._version(node)
        for h in self._handles.values():
            if h.node.ino == ino:
                h.node, h.obj, h.read_unsaved = node, new, False
        self.pages.relabel(ino, new.etag)

    async def _read(self, h: OpenFile, offset: int, size: int) -> bytes | memoryview:
        obj = h.obj
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        t0 = perf_counter()
        self.prefetcher.on_read(obj, h.pattern, offset, end)
        cs, bs = self.chunk_size, self.cache.block_size
        usage = self.usage
        pieces: list[bytes | memoryview] = []
        served = "memory"  # the furthest source the read was served from (its latency's)
        waited = longest = 0.0  # time waited on fetches; the longest single wait...
        delay = "queue"  # ...and what it waited on
        for index in range(offset // cs, (end - 1) // cs + 1):
            base = index * cs
            lo, hi = max(offset, base) - base, min(end, base + cs) - base
            first, last = lo // bs, (hi - 1) // bs
            ckey = obj.chunk_key(index)
            first_access = index not in h.touched and index not in h.pattern.fetched
            t = perf_counter()
            await self.prefetcher.settled(ckey)  # do not read what is being brought in
            w = perf_counter() - t  # a read-ahead of this chunk under way: the fetch queue
            waited += w
            if w > longest:
                longest, delay = w, "queue"
            t = perf_counter()
            if h.own is None:
                h.own = OwnChunk(self.cache, cs)
            got = await self.walk.read(Want(obj, index, first, last, access=first_access,
                                            tenant=h.tenant), h.own)
            source = tier = got.source
            brought = None  # where a fetch for this handle brought the chunk from
            if got.fetched:
                w = perf_counter() - t
                waited += w
                if w > longest:
                    # a cache tier here: the chunk was stored while this read waited for
                    # the walk's backpressure (the queue)
                    longest, delay = w, source if source in FETCHED else "queue"
            if source in FETCHED:
                h.pattern.fetched[index] = source
                h.delivered[index] = hi
            else:
                brought = h.pattern.fetched.get(index)
                if brought is None and index in h.pattern.loaded:
                    brought = "disk"
            skip = first * bs
            pieces.append(memoryview(got.data)[lo - skip:hi - skip])
            # bytes of a chunk brought in for this handle that it had not read yet count
            # where the fetch brought them from; a re-read counts where it is served from
            new = 0
            if brought is not None:
                done = h.delivered.get(index, 0)
                new = max(0, hi - max(lo, done))
                h.delivered[index] = max(done, hi)
            access = index not in h.touched
            h.touched.add(index)
            # (new is 0 unless a fetch for this handle brought the chunk)
            fetched = [(brought, new)] if brought is not None else []
            for src, n in (*fetched, (source, hi - lo - new)):
                if n:
                    # access analytics per prefix and job (tierfs/telemetry/analytics.py): dict
                    # updates only
                    self.ns.analytics.read(obj.key, obj.etag, obj.size, ckey, src, n, access,
                                           h.reader)
                    access = False
                    self._read_bytes[src].inc(n)
                    if usage is not None:
                        usage.read(h.tenant, h.reader, src, n)
            if _RANK[tier] > _RANK[served]:
                served = tier
        h.served = True
        self._read_seconds[served].observe(perf_counter() - t0)
        if waited > self._stall_threshold:
            self._stalled(h, offset, waited, delay)
        # a view, not a copy: pyfuse3 replies from any contiguous buffer, at once (nothing
        # runs between this return and the reply that could change the bytes under it)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _stalled(self, h: OpenFile, offset: int, waited: float, delay: str) -> None:
        assert self.stalls is not None  # the threshold is infinite without a log
        self.stalls.observe(h.obj.key, offset, waited, delay, h.tenant, h.reader)
        if self.usage is not None:
            self.usage.stalled(h.tenant, h.reader, waited)

    # ---- writes ----------------------------------------------------------------------

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        h = self._handles[fh]
        if h.dirty is None:
            raise InvalidArgument("file not opened for writing")
        if offset + len(data) > MAX_FILE_SIZE:
            raise FileTooBig(f"{h.node.key!r} would pass 5 TiB, S3's largest object")
        h.wrote = True
        n = await self._wb.write(h.dirty, offset, data)
        self.pages.written(h.node.ino)
        mode = h.node.attrs.mode  # kept current by _set: no index read per write
        if mode is not None and without_privs(mode) != mode:
            await self._drop_privs(h.node.ino)
        return n

    async def _drop_privs(self, ino: int) -> None:
        """A write or truncate clears S_ISUID and S_ISGID (Linux, for a caller without
        CAP_FSETID: a write does not say who writes, so always)."""
        node = self.ns.inode(ino)
        mode = node.attrs.mode
        if mode is not None and without_privs(mode) != mode:
            await self._set(node, node.attrs.changed(mode=without_privs(mode)))

    async def _save_times(self, d: DirtyFile) -> None:
        """The data's last change becomes the file's mtime and ctime, in the index and in
        the metadata its upload carries."""
        if d.changed_ns is None or self.wb is None:
            return
        node = self.ns.inode(d.ino)
        ctime = max(node.attrs.ctime_ns or 0, d.changed_ns)
        node.attrs = node.attrs.changed(mtime_ns=d.changed_ns, ctime_ns=ctime)
        self.ns.meta.inodes.set_attrs(node.ino, node.attrs)
        d.changed_ns = None
        await self.wb.set_metadata(d, node.attrs.to_metadata(node.kind))

    async def flush(self, fh: int) -> None:
        h = self._handles.get(fh)
        if h is not None and h.dirty is not None and self.wb is not None:
            await self._save_times(h.dirty)
            await self.wb.flush(h.dirty)  # a no-op unless the file has unsaved changes

    async def fsync(self, fh: int) -> None:
        h = self._handles.get(fh)
        d = self.wb.get(h.node.ino) if h is not None and self.wb is not None else None
        if d is not None:
            await self._save_times(d)
            await self._wb.commit(d)

    def size_of(self, node: Inode) -> int:
        """The size the kernel is told. The kernel keeps one size per inode and stops a
        read through the page cache at it, so while a handle of an older version reads
        through the pages (pagecache.py) the size is that version's: a smaller new version
        would otherwise cut the old handle's reads short. Handles of the new version are
        direct and read past it; the next open after the old handles close asks again."""
        d = self.wb.get(node.ino) if self.wb is not None else None
        if d is not None:
            return d.size
        paged = self.pages.paged_version(node.ino)
        if paged is not None and paged != node.etag:
            for h in self._handles.values():
                if h.node.ino == node.ino and h.obj.etag == paged and not h.direct:
                    return h.obj.size
        return node.size

    def attrs_of(self, node: Inode) -> Attrs:
        """A node's attributes, with the time of unsaved data changes."""
        d = self.wb.get(node.ino) if self.wb is not None else None
        if d is None or d.changed_ns is None:
            return node.attrs
        return node.attrs.changed(mtime_ns=d.changed_ns,
                                  ctime_ns=max(node.attrs.ctime_ns or 0, d.changed_ns))

    async def setattr(self, ino: int, fh: int | None, caller: Caller = Caller(), *,
                      size: int | None = None, changes: dict | None = None) -> Inode:
        """truncate, chmod, chown, utimens (changes: Attrs fields). Who may do what the
        kernel has checked (default_permissions); this applies what POSIX says follows."""
        node = self.ns.inode(ino)
        if size is not None:
            if node.is_dir:
                raise IsADirectory(node.key)
            if size > MAX_FILE_SIZE:
                raise FileTooBig(f"{size} bytes: S3's largest object is 5 TiB")
            await self._truncate(node, fh, size)
            if caller.uid != 0:
                await self._drop_privs(ino)
            if not changes:  # its times follow the data (_save_times)
                return self.ns.inode(ino)
        d = self.wb.get(ino) if self.wb is not None else None
        if d is not None:
            await self._save_times(d)  # a utimens now must win over the time of earlier writes
        node = self.ns.inode(ino)
        changes = changes or {}
        attrs = node.attrs.changed(**changes, ctime_ns=time.time_ns())
        if (("uid" in changes or "gid" in changes) and not node.is_dir
                and attrs.mode is not None and "mode" not in changes):
            attrs.mode = without_privs(attrs.mode)
        await self._set(node, attrs)
        return self.ns.inode(ino)

    async def _set(self, node: Inode, attrs: Attrs) -> None:
        """New attributes: a file with unsaved writes carries them in its upload, any
        other node has its object changed (Namespace.set_attrs)."""
        d = self.wb.get(node.ino) if self.wb is not None else None
        if d is not None:
            await self._wb.set_metadata(d, attrs.to_metadata(node.kind))
            node = self.ns.inode(node.ino)  # an upload may have finished meanwhile
        await self.ns.set_attrs(node, attrs)
        for h in self._handles.values():
            if h.node.ino == node.ino:
                h.node.attrs = attrs

    async def _truncate(self, node: Inode, fh: int | None, size: int) -> None:
        h = self._handles.get(fh) if fh is not None else None
        if h is not None and h.dirty is not None:
            h.wrote = True
            await self._wb.truncate(h.dirty, size)
            self.pages.written(node.ino)
            return
        # truncate(path): no close will follow, so the change is saved right here
        node = await self.ns.revalidate(node)
        d = self._open_dirty(node, truncate=size == 0)
        try:
            await self._wb.truncate(d, size)
            self.pages.written(node.ino)
            await self._save_times(d)
            await self._wb.flush(d)
        finally:
            await self._release_dirty(d)

    async def unlink(self, parent: int, name: bytes) -> None:
        node = await self.ns.lookup(parent, name)
        async with self._holding(supersede=[node]):
            await self.ns.unlink(parent, name)

    @asynccontextmanager
    async def _holding(self, commit: Iterable[Inode] = (),
                       supersede: Iterable[Inode] = ()) -> AsyncIterator[None]:
        """Hold still the unsaved files among these nodes while the caller changes their
        names on the store: those in `commit` are uploaded first and copied as uploaded,
        those in `supersede` have their pending uploads superseded if the caller succeeds
        and kept as they were if it fails (WriteBack.superseding). Taken in
        inode order, so two renames in opposite directions cannot wait on each other."""
        wb = self.wb
        held: dict[int, tuple[DirtyFile, bool]] = {}
        if wb is not None:
            for nodes, copied in ((commit, True), (supersede, False)):
                for node in nodes:
                    d = wb.get(node.ino)
                    if d is not None:
                        held[node.ino] = (d, copied)
        async with AsyncExitStack() as stack:
            for ino in sorted(held):  # none without a write-back
                d, copied = held[ino]
                await stack.enter_async_context(
                    self._wb.committed(d) if copied else self._wb.superseding(d))
            yield

    async def rename(self, parent: int, name: bytes, new_parent: int, new_name: bytes,
                     flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            raise InvalidArgument("RENAME_EXCHANGE cannot be done on an object store")
        node = await self.ns.lookup(parent, name)
        try:
            target: Inode | None = await self.ns.lookup(new_parent, new_name)
        except NotFound:
            target = None
        if target is not None and flags & RENAME_NOREPLACE:
            raise Exists(target.key)
        if target is not None and target.ino == node.ino:
            return
        dest_dir = self.ns.inode(new_parent)
        if node.is_dir:
            await self._rename_dir(node, target, dest_dir, new_parent, new_name)
        else:
            await self._rename_file(node, target, dest_dir, new_parent, new_name)

    async def _rename_file(self, node: Inode, target: Inode | None, dest_dir: Inode,
                           new_parent: int, new_name: bytes) -> None:
        if target is not None and target.is_dir:
            raise IsADirectory(target.key)
        # S3 has no rename: the source must exist as an object before it is copied, and
        # no upload of the source or of the target may land between the copy and the end
        async with self._holding(commit=[node], supersede=[target] if target else []):
            node = self.ns.inode(node.ino)
            new_key = self.ns.new_key(dest_dir, new_name)
            old = self._version(node)
            etag = await self.ns.backend.copy(node.key, new_key, node.etag)
            new = ObjectVersion(self.bucket, new_key, etag, node.size)
            await self.cache.rekey(old, new, range(-(-node.size // self.chunk_size)))
            await self.ns.backend.delete(node.key)
            node.etag = etag
            node.attrs.seen = etag  # the copy carries the source's metadata
            self.ns.renamed(node, new_parent, new_name, new_key)
            d = self.wb.get(node.ino) if self.wb is not None else None
            if d is not None:  # still open for writing: its next upload goes to the new name
                d.key, d.base = new_key, new
        # the copy holds the same bytes: handles of the version copied read it on
        node = self.ns.inode(node.ino)
        for h in self._handles.values():
            if h.node.ino == node.ino and h.obj.etag == old.etag:
                h.node, h.obj = node, new
        self.pages.relabel(node.ino, etag, old.etag)

    async def _rename_dir(self, node: Inode, target: Inode | None, dest_dir: Inode,
                          new_parent: int, new_name: bytes) -> None:
        if target is not None:
            if not target.is_dir:
                raise NotADirectory(target.key)
            await self.ns.rmdir(new_parent, new_name)  # raises NotEmpty unless empty
        if dest_dir.key.startswith(node.key):
            raise InvalidArgument("cannot move a directory into itself")
        inside = [self.ns.inode(d.ino) for d in (self.wb.files.values() if self.wb else ())
                  if d.key.startswith(node.key) and not d.superseded]
        # unsaved files inside must exist as objects to be copied, and stay as copied
        async with self._holding(commit=inside):
            await self._move_tree(node, dest_dir, new_parent, new_name)

    async def _move_tree(self, node: Inode, dest_dir: Inode, new_parent: int,
                         new_name: bytes) -> None:
        old_prefix = node.key  # renamed() below moves node itself to the new key
        objects = await self.ns.list_tree(old_prefix, self.rename_max_objects)
        if objects is None:
            raise CrossDevice(f"{old_prefix} holds more than {self.rename_max_objects} objects")
        new_prefix = self.ns.new_key(dest_dir, new_name, "/")
        limiter = trio.CapacityLimiter(8)
        moved: dict[str, ObjectVersion] = {}

        async def move(obj: ObjectMeta) -> None:
            async with limiter:
                key = new_prefix + obj.key[len(old_prefix):]
                etag = await self.ns.backend.copy(obj.key, key, obj.etag)
                new = moved[obj.key] = ObjectVersion(self.bucket, key, etag, obj.size)
                await self.cache.rekey(ObjectVersion(self.bucket, obj.key, obj.etag, obj.size),
                                       new, range(-(-obj.size // self.chunk_size)))
                await self.ns.backend.delete(obj.key)

        async with trio.open_nursery() as nursery:
            for obj in objects:
                nursery.start_soon(move, obj)
        if not objects:
            await self.ns.backend.put(new_prefix, b"")  # keep an empty directory visible
        self.ns.renamed(node, new_parent, new_name, new_prefix)
        # files still open for writing inside follow the directory, as POSIX handles do
        for d in list(self.wb.files.values()) if self.wb is not None else ():
            if d.key.startswith(old_prefix):
                if d.base is not None and d.base.key in moved:
                    d.base = moved[d.base.key]
                d.key = new_prefix + d.key[len(old_prefix):]
        for h in self._handles.values():
            if h.obj.key in moved:  # the copy holds the same bytes
                self.pages.relabel(h.node.ino, moved[h.obj.key].etag, h.obj.etag)
                h.obj = moved[h.obj.key]
            if h.obj.key.startswith(old_prefix) or h.node.key.startswith(old_prefix):
                h.node = self.ns.inode(h.node.ino)
