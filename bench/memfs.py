"""The ceiling for tierfs's warm reads: the most trivial pyfuse3 + trio filesystem.

One read-only file held in memory; `read` returns a slice of it and does nothing else.
Whatever tierfs adds on top of pyfuse3's per-request cost (cache lookups, metrics,
read-ahead bookkeeping) shows up as the gap between the two. Same kernel settings as a
tierfs mount: 1 MiB bdi read-ahead, default pyfuse3 options plus `ro`.

    python bench/memfs.py MOUNTPOINT --size BYTES --seed N [--name big.bin]

The content is bench/datagen.make(size, seed), byte for byte what run.py uploaded, so
the same verifying reader works on both. Prints READY on stdout once a stat through the
kernel has answered; stops on SIGTERM/SIGINT or `fusermount3 -u MOUNTPOINT`.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402

FILE_INO = pyfuse3.ROOT_INODE + 1
TIMEOUT = 300.0


class MemFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, name: bytes, data: bytearray) -> None:
        super().__init__()
        self.name = name
        self.view = memoryview(data)  # bytes(view[a:b]) is the one copy a reply needs
        self.size = len(data)
        self.t = time.time_ns()

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = TIMEOUT
        if ino == pyfuse3.ROOT_INODE:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFDIR | 0o755, 2, 0
        else:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o644, 1, self.size
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.t
        a.st_blksize = 256 << 10
        a.st_blocks = -(-a.st_size // 512)
        return a

    async def getattr(self, inode, ctx=None):
        if inode not in (pyfuse3.ROOT_INODE, FILE_INO):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name != self.name:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(FILE_INO)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, self.name, self._attrs(FILE_INO), 1)

    async def open(self, inode, flags, ctx):
        if inode != FILE_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode)

    async def read(self, fh, off, size):
        return bytes(self.view[off:off + size])

    async def release(self, fh):
        return None

    async def releasedir(self, fh):
        return None


def _raise_read_ahead(mountpoint: str, kib: int = 1024) -> None:
    dev = os.stat(mountpoint).st_dev
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(kib))
    except OSError as exc:
        print(f"memfs: could not raise read_ahead_kb: {exc}", file=sys.stderr)


async def _main(mountpoint: str) -> None:
    async def ready() -> None:
        await trio.to_thread.run_sync(_raise_read_ahead, mountpoint)
        print("READY", flush=True)

    async def stop_on_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                pyfuse3.terminate()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ready)
        nursery.start_soon(stop_on_signal)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mountpoint")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--name", default="big.bin")
    args = p.parse_args()
    data = datagen.make(args.size, args.seed)
    fs = MemFS(args.name.encode(), data)
    options = set(pyfuse3.default_options) | {"fsname=benchmemfs", "ro"}
    pyfuse3.init(fs, os.path.abspath(args.mountpoint), options)
    try:
        trio.run(_main, os.path.abspath(args.mountpoint))
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
