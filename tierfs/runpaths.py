"""Where a mount's pid file and control socket live, for the daemon and every client.

Both are derived from the mount point and the uid that owns the mount (the kernel shows
it as `user_id=` in /proc/self/mountinfo), so a client that knows only a path under the
mount finds them without asking anyone: root's mounts use /run/tierfs, other users'
$XDG_RUNTIME_DIR-style /run/user/UID/tierfs, which no other user can create.

Where /run/user/UID is missing (no login session) the dir is /tmp/tierfs-UID, a name any
user can take first. A /tmp/tierfs-UID that is not this uid's own private dir is never
used: the daemon makes a dir of its own beside it, /tmp/tierfs-UID.XXXXXXXX (mkdtemp:
a fresh name, made 0700 by the uid itself), and everyone looks in this uid's own dirs of
that name only (`run_dir`). This module only looks (lstat, listdir of /tmp); the daemon
makes the dirs (tierfs/mount/control.py, prepare_socket_dir).
"""

from __future__ import annotations

import hashlib
import os
import stat

TMP = "/tmp"


def home_dir(uid: int) -> str:
    """The run dir no other user can create first: /run/tierfs for root, else
    /run/user/UID/tierfs, or "" when /run/user/UID does not exist."""
    if uid == 0:
        return "/run/tierfs"
    if os.path.isdir(f"/run/user/{uid}"):
        return f"/run/user/{uid}/tierfs"
    return ""


def tmp_dir(uid: int) -> str:
    """The /tmp fallback's fixed name (what a squatter can take)."""
    return os.path.join(TMP, f"tierfs-{uid}")


def owned_by(path: str, uid: int) -> bool:
    """A real directory (not a symlink) of uid's (the daemon makes it 0700)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def aside_dirs(uid: int) -> list[str]:
    """uid's own /tmp/tierfs-UID.* dirs, in name order (another user's are ignored)."""
    prefix = f"tierfs-{uid}."
    try:
        names = sorted(n for n in os.listdir(TMP) if n.startswith(prefix))
    except OSError:
        return []
    return [p for p in (os.path.join(TMP, n) for n in names) if owned_by(p, uid)]


def run_dir(uid: int | None = None) -> str:
    """Where uid's daemons keep their sockets and pid files: home_dir, else
    /tmp/tierfs-UID unless another user took that name, else uid's first own dir beside
    it (and the fixed name when there is none yet: prepare_socket_dir makes one)."""
    uid = os.getuid() if uid is None else uid
    home = home_dir(uid)
    if home:
        return home
    fixed = tmp_dir(uid)
    if not os.path.lexists(fixed) or owned_by(fixed, uid):
        return fixed
    aside = aside_dirs(uid)
    return aside[0] if aside else fixed


def _stem(mountpoint: str) -> str:
    return hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]


def _find(name: str, uid: int | None) -> str:
    """name in run_dir, or in another of uid's own dirs that holds it (two daemons that
    made their dirs aside at the same moment)."""
    uid = os.getuid() if uid is None else uid
    first = os.path.join(run_dir(uid), name)
    if home_dir(uid) or os.path.lexists(first):
        return first
    for d in aside_dirs(uid):
        if os.path.lexists(os.path.join(d, name)):
            return os.path.join(d, name)
    return first


def pid_file(mountpoint: str, uid: int | None = None) -> str:
    return _find(_stem(mountpoint) + ".pid", uid)


def control_socket(mountpoint: str, uid: int | None = None) -> str:
    return _find(_stem(mountpoint) + ".sock", uid)
