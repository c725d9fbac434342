"""FuseOps: the pyfuse3 adapter. Translation and errno mapping only.

Each handler turns its arguments into one core call and the result into pyfuse3 types.
TierfsError subclasses carry their errno, also when they arrive inside an ExceptionGroup
(a nested nursery in the core). Anything else is a bug or an unforeseen failure of a
library: it is answered with EIO, counted in tierfs_internal_errors_total{task=<op>}, and
logged with its traceback the first time it happens at that place (later repeats are one
line each, so a bug hit by every read does not bury the log). It never ends the mount.
A --read-only mount answers every change with EROFS.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import time
from typing import Any, Callable

import pyfuse3
import trio

from ..cache import ChunkCache
from ..config import MountConfig
from ..errors import InvalidArgument, ReadOnly
from ..files.fileio import FileIO
from ..files.namespace import Caller, Namespace
from ..index.attrs import BLK, CHR, DIR, FILE, SYMLINK, kind_of, type_bits
from ..index.inodes import Inode
from ..metrics import Metrics
from ..tasks import expected_error, sole_exception

log = logging.getLogger(__name__)


def _op(name: str) -> Callable:
    """Count and time a handler; map errors to FUSEError at this one boundary."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def handler(self: "FuseOps", *args: Any) -> Any:
            m = self.metrics
            t0 = time.perf_counter()
            requests, seconds = self._counted(name)
            requests.inc()
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError as exc:
                m.fuse_errors.labels(name, errno.errorcode.get(exc.errno, str(exc.errno))).inc()
                raise
            except Exception as exc:  # noqa: BLE001 - TierfsError, a group of them, or a bug
                err = expected_error(exc)
                code = err.errno if err is not None else errno.EIO
                m.fuse_errors.labels(name, errno.errorcode.get(code, "EIO")).inc()
                if err is None:
                    _internal_error(m, name, exc)
                elif code not in (errno.ENOENT, errno.EROFS, errno.EEXIST, errno.ENOTEMPTY):
                    log.debug("%s: %s", name, err)
                raise pyfuse3.FUSEError(code) from None
            finally:
                seconds.observe(time.perf_counter() - t0)

        return handler

    return wrap


_reported: dict[tuple[str, str, str, int], int] = {}  # (op, type, file, line) -> times seen


def _internal_error(m: Metrics, name: str, exc: BaseException) -> None:
    m.internal_errors.labels(name).inc()
    first = sole_exception(exc)
    tb = first.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # where it was raised: the same bug keeps the same place
    code = tb.tb_frame.f_code if tb is not None else None
    site = (name, type(first).__name__, code.co_filename if code else "?",
            tb.tb_lineno if tb is not None else 0)
    seen = _reported[site] = _reported.get(site, 0) + 1
    if seen == 1:
        log.error("internal error in %s (answered EIO, the mount stays up): %r", name, first,
                  exc_info=exc)
    else:
        log.error("internal error in %s again (%d times; traceback logged the first time): %r",
                  name, seen, first)


def _unsupported(name: str, err: int) -> Callable:
    @_op(name)
    async def refuse(self: "FuseOps", *args: Any) -> Any:
        raise pyfuse3.FUSEError(err)

    return refuse


class FuseOps(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, cfg: MountConfig, namespace: Namespace, fileio: FileIO,
                 cache: ChunkCache, metrics: Metrics) -> None:
        super().__init__()
        self.cfg = cfg
        self.ns = namespace
        self.io = fileio
        self.cache = cache
        self.metrics = metrics
        self._dirs: dict[int, list[tuple[bytes, Inode]]] = {}
        self._ops: dict[str, tuple[Any, Any]] = {}  # op -> its request counter and timer
        self._next_dir = 1
        self._started = time.time()

    def _counted(self, op: str) -> tuple[Any, Any]:
        """The request counter and the timer of `op` (a labels() lookup per request costs
        as much as the rest of a small cached read's bookkeeping)."""
        got = self._ops.get(op)
        if got is None:
            m = self.metrics
            got = self._ops[op] = (m.fuse_requests.labels(op), m.fuse_seconds.labels(op))
        return got

    def _attrs(self, node: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = self.cfg.metadata_ttl
        a.attr_timeout = self.cfg.metadata_ttl
        attrs = self.io.attrs_of(node)
        if node.is_dir:
            perm = self.cfg.dir_mode if attrs.mode is None else attrs.mode
        elif node.kind == SYMLINK:
            perm = 0o777
        else:
            perm = self.cfg.file_mode if attrs.mode is None else attrs.mode
        a.st_mode = type_bits(node.kind) | perm
        a.st_nlink = self.ns.nlink(node)
        a.st_rdev = attrs.rdev
        a.st_size = self.io.size_of(node)
        a.st_uid = self.cfg.uid if attrs.uid is None else attrs.uid
        a.st_gid = self.cfg.gid if attrs.gid is None else attrs.gid
        # no times of our own: the LIST's mtime (a directory's: when this mount started)
        base = int((node.mtime or self._started) * 1e9)
        a.st_mtime_ns = base if attrs.mtime_ns is None else attrs.mtime_ns
        a.st_atime_ns = a.st_mtime_ns if attrs.atime_ns is None else attrs.atime_ns
        a.st_ctime_ns = a.st_mtime_ns if attrs.ctime_ns is None else attrs.ctime_ns
        a.st_blksize = self.cache.block_size
        a.st_blocks = -(-a.st_size // 512)
        return a

    @staticmethod
    def _caller(ctx: Any) -> Caller:
        return Caller(ctx.uid, ctx.gid)

    @staticmethod
    def _perm(mode: int, ctx: Any) -> int:
        # the kernel applies the umask unless the filesystem asked to (FUSE_DONT_MASK);
        # applying it again changes nothing
        return mode & 0o7777 & ~ctx.umask

    def _writable(self) -> None:
        if self.cfg.read_only:
            raise ReadOnly("mounted --read-only")

    @_op("lookup")
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(await self.ns.lookup(parent_inode, name))

    @_op("getattr")
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(self.ns.inode(inode))

    @_op("opendir")
    async def opendir(self, inode: int, ctx: Any) -> int:
        entries = await self.ns.listdir(inode)
        fh = self._next_dir
        self._next_dir += 1
        self._dirs[fh] = entries  # a snapshot: paging stays stable while it is read
        return fh

    @_op("readdir")
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entries = self._dirs[fh]
        for i in range(start_id, len(entries)):
            name, node = entries[i]
            # the names are a snapshot, the attributes must not be: the kernel takes these
            # (readdirplus) over what it knows, and an upload may have finished meanwhile
            node = self.ns.inode(node.ino)
            if not pyfuse3.readdir_reply(token, name, self._attrs(node), i + 1):
                break

    @_op("releasedir")
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_op("open")
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            self._writable()
        # the caller is who reads through this handle (usage: docs/tenants.md, "Readers")
        h, keep = await self.io.open(inode, flags, ctx.pid, ctx.uid)
        if not keep or h.direct:
            # the kernel may hold the size of an older version from its last lookup; make it
            # ask again, or reads would stop at the old size. Attribute-only invalidation
            # takes no lock that this open holds, so it is safe before we reply.
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, True)
            except OSError:
                pass  # the kernel forgot the inode: nothing cached to correct
        # direct: an older version's handles read through the page cache (pagecache.py)
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=keep, direct_io=h.direct)

    @_op("read")
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await self.io.read(fh, off, size)

    @_op("release")
    async def release(self, fh: int) -> None:
        await self.io.release(fh)

    @_op("statfs")
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        # df on the mount shows the cache: its budget as the size, cached bytes as used
        s = pyfuse3.StatvfsData()
        bs = self.cache.block_size
        budget = self.cache.budget()
        s.f_bsize = s.f_frsize = bs
        s.f_blocks = budget // bs
        s.f_bfree = s.f_bavail = max(0, budget - self.cache.used_bytes) // bs
        s.f_files = s.f_ffree = s.f_favail = 1 << 30
        s.f_namemax = 255
        return s

    async def forget(self, inode_list: Any) -> None:
        return None  # inode records live in LMDB; nothing is held per kernel reference

    @_op("create")
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        self._writable()
        # the kernel passes the open flags: O_EXCL makes the create exclusive across nodes
        h, node = await self.io.create(parent_inode, name, self._perm(mode, ctx),
                                       self._caller(ctx), ctx.pid,
                                       exclusive=bool(flags & os.O_EXCL))
        return pyfuse3.FileInfo(fh=h.fh), self._attrs(node)

    @_op("write")
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.io.write(fh, off, buf)

    @_op("flush")
    async def flush(self, fh: int) -> None:
        await self.io.flush(fh)

    @_op("fsync")
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.io.fsync(fh)

    @_op("fsyncdir")
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are synchronous with the object store

    @_op("setattr")
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: Any,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        changes: dict = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode & 0o7777
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        size = attr.st_size if fields.update_size else None
        self._writable()
        node = await self.io.setattr(inode, fh, self._caller(ctx), size=size, changes=changes)
        return self._attrs(node)

    @_op("mkdir")
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        self._writable()
        node = await self.ns.mkdir(parent_inode, name, self._perm(mode, ctx), self._caller(ctx))
        return self._attrs(node)

    @_op("mknod")
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        self._writable()
        kind = FILE if stat.S_IFMT(mode) == 0 else kind_of(mode)
        if kind is None or kind == DIR:
            raise InvalidArgument(f"mknod of type {stat.S_IFMT(mode):o}")
        node = await self.ns.mknod(parent_inode, name, kind, self._perm(mode, ctx),
                                   rdev if kind in (CHR, BLK) else 0, self._caller(ctx))
        return self._attrs(node)

    @_op("rmdir")
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._writable()
        await self.ns.rmdir(parent_inode, name)

    @_op("unlink")
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._writable()
        await self.io.unlink(parent_inode, name)

    @_op("rename")
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        self._writable()
        await self.io.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_op("symlink")
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        self._writable()
        return self._attrs(await self.ns.symlink(parent_inode, name, target, self._caller(ctx)))

    @_op("readlink")
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.ns.readlink(inode)

    # no hard links on an object store (POSIX allows EPERM); no extended attributes (yet)
    link = _unsupported("link", errno.EPERM)
    setxattr = _unsupported("setxattr", errno.ENOTSUP)
    getxattr = _unsupported("getxattr", errno.ENODATA)
    listxattr = _unsupported("listxattr", errno.ENOTSUP)
    removexattr = _unsupported("removexattr", errno.ENOTSUP)
