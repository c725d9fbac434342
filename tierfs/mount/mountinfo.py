"""Reading /proc/self/mountinfo: what is mounted where, without stat()ing into it.

A stat of a FUSE mount whose daemon died fails (ENOTCONN) and one of a hung daemon
blocks, so every "is this mounted?" question in tierfs is answered from this table.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    fstype: str  # "fuse.tierfs" for ours (subtype=tierfs)
    super_options: dict[str, str]  # e.g. user_id, group_id: who owns a FUSE mount


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal \\040 \\011 \\012 \\134;
    other bytes (UTF-8 names) stand as they are."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="replace")


def mounts() -> Iterator[Mount]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if len(fields) < 5 or len(rest) < 3:
                continue
            opts = dict(o.partition("=")[::2] for o in rest[2].split(","))
            yield Mount(unescape(fields[4]), rest[0], opts)


def is_mountpoint(path: str) -> bool:
    return any(m.mountpoint == path for m in mounts())


def mount_at(path: str) -> Mount | None:
    """The mount whose mount point is `path` (the last one: mounts stack), or None."""
    found = None
    for m in mounts():
        if m.mountpoint == path:
            found = m
    return found


def answers(path: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the file system mounted at `path` answers: True, False when its daemon is
    gone (ENOTCONN, ECONNABORTED: the kernel aborted the connection), None when it does
    not answer within timeout_s (hung, or busy). statvfs() always reaches the daemon,
    unlike a stat() the kernel may answer from its attribute cache. The probe runs in a
    daemon thread: a hung FUSE call cannot be interrupted, so it is left behind."""
    out: dict[str, bool] = {}

    def probe() -> None:
        try:
            os.statvfs(path)
            out["ok"] = True
        except OSError as exc:
            out["ok"] = exc.errno not in (errno.ENOTCONN, errno.ECONNABORTED)

    t = threading.Thread(target=probe, name="mount-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    return out.get("ok")
