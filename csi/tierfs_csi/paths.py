"""Where the plugin may mount: under kubelet's directory, and nowhere else.

The CSI caller is trusted to name volumes, not to pick arbitrary host paths: a staging or
target path must lie under --kubelet-dir (default /var/lib/kubelet) once its symlinks are
resolved, so a request cannot bind a volume over /etc or stage one in /root. Only the
parent directory is resolved (realpath): the last component may be a mount already, and a
stat of a FUSE mount whose daemon hangs would block the call. The last component itself
must not be a symlink (mount(2) would follow it).

What unpublish and unstage may undo is what the records (records.py) say this plugin did
for that volume id, checked in volumes.py; this module only judges paths.
"""

from __future__ import annotations

import os

from . import mounts
from .errors import invalid

MAX_PATH = 4096


class KubeletDir:
    def __init__(self, path: str):
        self.given = path
        self.root = os.path.realpath(path)

    def contains(self, path: str) -> bool:
        """True if `path` (absolute) lies strictly under kubelet's directory."""
        parent, name = os.path.split(os.path.normpath(path))
        if name in ("", ".", ".."):
            return False
        real = os.path.join(os.path.realpath(parent), name)
        return real.startswith(self.root.rstrip("/") + "/")

    def check(self, field: str, path: str) -> str:
        """The path, if the plugin may mount there; INVALID_ARGUMENT naming the field."""
        if len(path) > MAX_PATH or "\0" in path:
            raise invalid(f"{field} is not a usable path")
        if not os.path.isabs(path):
            raise invalid(f"{field} must be an absolute path")
        if not self.contains(path):
            raise invalid(f"{field} {path!r} is not under kubelet's directory {self.given} "
                          f"(--kubelet-dir)")
        # not lstat on a mount: a hung daemon's mount point would block it
        if mounts.find(path) is None and os.path.islink(path):
            raise invalid(f"{field} {path!r} is a symbolic link")
        return path
