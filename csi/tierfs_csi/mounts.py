"""The mount table, and the mount operations the plugin does itself (bind, unmount).

Whether a path is mounted is read from /proc/self/mountinfo, never by stat()ing into it:
a FUSE mount whose daemon died answers ENOTCONN ("Transport endpoint is not connected")
and a hung one blocks. Bind and unmount are mount(2) / umount2(2) through libc, so a
failure is an errno, not the parsed stderr of mount(8).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import threading
from dataclasses import dataclass

from tierfs.mount.mountinfo import unescape

MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
MNT_DETACH = 2
TIERFS_FSTYPE = "fuse.tierfs"  # the daemon mounts with subtype=tierfs

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True)
class MountEntry:
    mount_id: int
    dev: str  # "major:minor" of the file system: equal for a mount and its binds
    mountpoint: str
    options: frozenset[str]  # per-mount options: "ro" for a read-only bind
    fstype: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def entries() -> list[MountEntry]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            out.append(MountEntry(int(a[0]), a[2], unescape(a[4]),
                                  frozenset(a[5].split(",")), b[0]))
    return out


def find(path: str) -> MountEntry | None:
    """The mount on top at `path` (the last one listed), or None."""
    path = os.path.abspath(path)
    found = [e for e in entries() if e.mountpoint == path]
    return found[-1] if found else None


def statvfs(path: str, timeout: float) -> os.statvfs_result:
    """os.statvfs that gives up after `timeout` s (TimeoutError): a stopped or wedged
    daemon blocks the call in the kernel, and a plugin thread stuck there for good would
    hold its volume's lock for good. The thread is left to finish when the daemon does."""
    result: list = []

    def run() -> None:
        try:
            result.append(os.statvfs(path))
        except OSError as exc:
            result.append(exc)

    t = threading.Thread(target=run, name=f"statvfs {path}", daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise TimeoutError(errno.ETIMEDOUT, f"no answer within {timeout:g}s "
                           "(is its tierfs daemon stopped or hung?)", path)
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def is_stale(path: str, timeout: float) -> bool:
    """True if `path` is a FUSE mount whose daemon is gone; TimeoutError if it is there
    but does not answer."""
    try:
        statvfs(path, timeout)
    except TimeoutError:
        raise
    except OSError as exc:
        return exc.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def _check(rc: int, what: str, path: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}", path)


def bind(source: str, target: str, read_only: bool) -> None:
    """Bind-mount `source` on `target`; a read-only bind needs a second, remounting call."""
    _check(_libc.mount(source.encode(), target.encode(), None, MS_BIND, None),
           "bind mount", target)
    if read_only:
        rc = _libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        if rc != 0:
            e = ctypes.get_errno()
            _libc.umount2(target.encode(), MNT_DETACH)  # no half-done rw bind left behind
            raise OSError(e, f"read-only remount: {os.strerror(e)}", target)


def unmount(path: str, lazy: bool = False) -> None:
    _check(_libc.umount2(path.encode(), MNT_DETACH if lazy else 0), "unmount", path)


def unmount_all(path: str, timeout: float) -> None:
    """Unmount every mount stacked at `path`; a dead FUSE one lazily (it cannot answer)."""
    while find(path) is not None:
        try:
            unmount(path)
        except OSError:
            if not is_stale(path, timeout):
                raise
            unmount(path, lazy=True)
