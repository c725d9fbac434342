"""FuseOps: the pyfuse3 adapter. Translation and errno mapping only.

Each handler turns its arguments into one core call and the result into pyfuse3 types.
TierfsError subclasses carry their errno; anything else is a bug, logged with its
traceback and answered with EIO. Writes are not implemented yet: they answer EROFS.
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

from .cache import ChunkCache
from .config import MountConfig
from .errors import ReadOnly, TierfsError
from .fileio import FileIO
from .meta import Inode
from .metrics import Metrics
from .namespace import Namespace

log = logging.getLogger(__name__)


def _op(name: str) -> Callable:
    """Count and time a handler; map errors to FUSEError at this one boundary."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        async def handler(self: "FuseOps", *args: Any) -> Any:
            m = self.metrics
            t0 = time.perf_counter()
            m.fuse_requests.labels(name).inc()
            try:
                return await fn(self, *args)
            except pyfuse3.FUSEError as exc:
                m.fuse_errors.labels(name, errno.errorcode.get(exc.errno, str(exc.errno))).inc()
                raise
            except TierfsError as exc:
                m.fuse_errors.labels(name, errno.errorcode.get(exc.errno, "EIO")).inc()
                if exc.errno not in (errno.ENOENT, errno.EROFS):
                    log.debug("%s: %s", name, exc)
                raise pyfuse3.FUSEError(exc.errno) from None
            except Exception:
                m.fuse_errors.labels(name, "EIO").inc()
                log.exception("unexpected error in %s", name)
                raise pyfuse3.FUSEError(errno.EIO) from None
            finally:
                m.fuse_seconds.labels(name).observe(time.perf_counter() - t0)

        return handler

    return wrap


def _rofs(name: str) -> Callable:
    @_op(name)
    async def refuse(self: "FuseOps", *args: Any) -> Any:
        raise ReadOnly("writes are not supported yet")

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
        self._next_dir = 1
        self._started = time.time()

    def _attrs(self, node: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = self.cfg.metadata_ttl
        a.attr_timeout = self.cfg.metadata_ttl
        if node.is_dir:
            a.st_mode = stat.S_IFDIR | self.cfg.dir_mode
            a.st_nlink = 2
            mtime = node.mtime or self._started
        else:
            a.st_mode = stat.S_IFREG | self.cfg.file_mode
            a.st_nlink = 1
            mtime = node.mtime
        a.st_size = node.size
        a.st_uid, a.st_gid = self.cfg.uid, self.cfg.gid
        ns = int(mtime * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        a.st_blksize = self.cache.block_size
        a.st_blocks = -(-node.size // 512)
        return a

    @_op("lookup")
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
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
            if not pyfuse3.readdir_reply(token, name, self._attrs(node), i + 1):
                break

    @_op("releasedir")
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_op("open")
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise ReadOnly("writes are not supported yet")
        h, keep = await self.io.open(inode)
        if not keep:
            # the kernel may hold the size of an older version from its last lookup; make it
            # ask again, or reads would stop at the old size. Attribute-only invalidation
            # takes no lock that this open holds, so it is safe before we reply.
            try:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, True)
            except OSError:
                pass  # the kernel forgot the inode: nothing cached to correct
        return pyfuse3.FileInfo(fh=h.fh, keep_cache=keep)

    @_op("read")
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.io.read(fh, off, size)

    @_op("release")
    async def release(self, fh: int) -> None:
        self.io.release(fh)

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

    setattr = _rofs("setattr")
    write = _rofs("write")
    create = _rofs("create")
    mkdir = _rofs("mkdir")
    mknod = _rofs("mknod")
    unlink = _rofs("unlink")
    rmdir = _rofs("rmdir")
    rename = _rofs("rename")
    symlink = _rofs("symlink")
    link = _rofs("link")
    setxattr = _rofs("setxattr")
    removexattr = _rofs("removexattr")
