"""Run file-system calls as another user (tests/posix/): JSON in on stdin, JSON out on stdout.

    echo '{"uid": 65534, "gid": 65534, "groups": [], "umask": 18,
           "ops": [["creat", "/mnt/d/f", 420], ["lstat", "/mnt/d/f"], ["chmod", "/mnt/d/f", 0]]}' \
        | python as_user.py
    -> [{"ok": null}, {"ok": {"mode": 33188, "uid": 65534, ...}}, {"ok": null}]

The process drops to uid/gid (setgroups first, so it keeps no group of root's), sets the
umask, then runs every operation in order and answers one result per operation: {"ok": value}
or {"err": "EACCES"} (the errno's name). A failed operation does not stop the next ones.
posixkit.as_user() is the caller; the operations are the OPS table below.
"""

from __future__ import annotations

import ctypes  # every import before the drop of privileges: nobody may not read the stdlib
import errno
import json
import os
import socket
import sys

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2


def _ts(value) -> tuple[int, int]:
    if value == "now":
        return (0, UTIME_NOW)
    if value == "omit":
        return (0, UTIME_OMIT)
    return (value // 1_000_000_000, value % 1_000_000_000)


def utimensat(path, atime, mtime, follow: bool = True) -> None:
    """utimensat(2) through libc: atime/mtime are nanoseconds, "now" (UTIME_NOW) or "omit"
    (UTIME_OMIT), which os.utime cannot pass."""
    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    libc = ctypes.CDLL(None, use_errno=True)
    times = (Timespec * 2)(Timespec(*_ts(atime)), Timespec(*_ts(mtime)))
    flags = 0 if follow else AT_SYMLINK_NOFOLLOW
    if libc.utimensat(AT_FDCWD, os.fsencode(path), times, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


def stat_dict(st: os.stat_result) -> dict:
    return {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "size": st.st_size,
            "nlink": st.st_nlink, "rdev": st.st_rdev, "atime_ns": st.st_atime_ns,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _creat(path, mode=0o644, flags=os.O_WRONLY | os.O_CREAT | os.O_EXCL):
    os.close(os.open(path, flags, mode))


def _open(path, flags=os.O_RDONLY):
    os.close(os.open(path, flags))


def _read(path):
    with open(path, "rb") as f:
        return f.read().decode("latin-1")


def _write(path, data, flags=os.O_WRONLY):
    fd = os.open(path, flags)
    try:
        return os.write(fd, data.encode("latin-1"))
    finally:
        os.close(fd)


def _bind(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
    finally:
        s.close()


def _utime(path, atime=None, mtime=None, follow=True):
    if atime is None and mtime is None:
        os.utime(path, follow_symlinks=follow)  # both UTIME_NOW
    else:
        utimensat(path, atime, mtime, follow)


OPS = {
    "creat": _creat,                                     # path, mode=0o644, flags=...
    "open": _open,                                       # path, flags=O_RDONLY
    "read": _read,                                       # path -> text (latin-1)
    "write": _write,                                     # path, text, flags=O_WRONLY
    "mkdir": lambda path, mode=0o777: os.mkdir(path, mode),
    "rmdir": os.rmdir,
    "unlink": os.unlink,
    "rename": os.rename,                                 # src, dst
    "symlink": os.symlink,                               # target, path
    "mknod": lambda path, mode, rdev=0: os.mknod(path, mode, rdev),
    "mkfifo": lambda path, mode=0o666: os.mkfifo(path, mode),
    "bind": _bind,                                       # path: a unix socket
    "chmod": os.chmod,                                   # path, mode
    "chown": os.chown,                                   # path, uid, gid
    "lchown": os.lchown,
    "utime": _utime,                                     # path, atime, mtime ("now"/"omit"/ns)
    "truncate": os.truncate,                             # path, size
    "stat": lambda path: stat_dict(os.stat(path)),
    "lstat": lambda path: stat_dict(os.lstat(path)),
    "listdir": lambda path: sorted(os.listdir(path)),
}


def run(ops: list) -> list[dict]:
    out = []
    for name, *args in ops:
        try:
            out.append({"ok": OPS[name](*args)})
        except OSError as e:
            out.append({"err": errno.errorcode.get(e.errno, str(e.errno))})
    return out


def main() -> None:
    req = json.load(sys.stdin)
    os.setgroups(req.get("groups", []))
    os.setgid(req.get("gid", 65534))
    os.setuid(req.get("uid", 65534))
    os.umask(req.get("umask", 0o022))
    json.dump(run(req["ops"]), sys.stdout)


if __name__ == "__main__":
    main()
