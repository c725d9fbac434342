"""Where a mount's pid file and control socket live, for the daemon and every client.

Both are derived from the mount point and the uid that owns the mount (the kernel shows
it as `user_id=` in /proc/self/mountinfo), so a client that knows only a path under the
mount finds them without asking anyone: root's mounts use /run/tierfs, other users'
$XDG_RUNTIME_DIR-style /run/user/UID/tierfs (or /tmp/tierfs-UID where that is missing).
"""

from __future__ import annotations

import hashlib
import os


def run_dir(uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return "/run/tierfs"
    if os.path.isdir(f"/run/user/{uid}"):
        return f"/run/user/{uid}/tierfs"
    return f"/tmp/tierfs-{uid}"


def _stem(mountpoint: str) -> str:
    return hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]


def pid_file(mountpoint: str, uid: int | None = None) -> str:
    return os.path.join(run_dir(uid), _stem(mountpoint) + ".pid")


def control_socket(mountpoint: str, uid: int | None = None) -> str:
    return os.path.join(run_dir(uid), _stem(mountpoint) + ".sock")
