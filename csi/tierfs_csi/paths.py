"""Where the plugin may mount: under kubelet's directory, and nowhere else.

The CSI caller is trusted to name volumes, not to pick arbitrary host paths: a staging or
target path must lie under --kubelet-dir (default /var/lib/kubelet) once its symlinks are
resolved, so a request cannot bind a volume over /etc or stage one in /root.

A path is resolved the way the kernel walks it: component by component, a symlink
replaced by its target before a later `..` applies (realpath), never `..` cancelled in
the text first (`pods/lnk/../x` is the parent of lnk's target, not `pods/x`). The
resolved path is the one the plugin checks, creates, mounts and records, so what was
checked is what is mounted. Only the parent directory is resolved: the last component
may be a mount already, and a stat of a FUSE mount whose daemon hangs would block the
call. The last component itself must not be a symlink (mount(2) would follow it).

What unpublish and unstage may undo is what the records (records.py) say this plugin did
for that volume id, checked in volumes.py; this module only judges paths.
"""

from __future__ import annotations

import os

from . import mounts
from .errors import invalid

MAX_PATH = 4096


def resolve(path: str) -> str | None:
    """`path` (absolute) with its parent's symlinks and `..` resolved as the kernel
    would, the last component kept as named; None if it names no directory entry."""
    parent, name = os.path.split(path.rstrip("/"))
    if name in ("", ".", ".."):
        return None
    return os.path.join(os.path.realpath(parent), name)


class KubeletDir:
    def __init__(self, path: str):
        self.given = path
        self.root = os.path.realpath(path)

    def contains(self, resolved: str) -> bool:
        """True if `resolved` (from resolve()) lies strictly under kubelet's directory."""
        return resolved.startswith(self.root.rstrip("/") + "/")

    def check(self, field: str, path: str) -> str:
        """The resolved path, if the plugin may mount there; INVALID_ARGUMENT naming the
        field otherwise."""
        if len(path) > MAX_PATH or "\0" in path:
            raise invalid(f"{field} is not a usable path")
        if not os.path.isabs(path):
            raise invalid(f"{field} must be an absolute path")
        real = resolve(path)
        if real is None or not self.contains(real):
            shown = "" if real is None or real == path else f" (resolved: {real!r})"
            raise invalid(f"{field} {path!r}{shown} is not under kubelet's directory "
                          f"{self.given} (--kubelet-dir)")
        # not lstat on a mount: a hung daemon's mount point would block it
        if mounts.find(real) is None and os.path.islink(real):
            raise invalid(f"{field} {path!r} is a symbolic link")
        return real

    def lookup(self, path: str) -> str:
        """The path under which a request to undo (unpublish, unstage, stats) finds what
        publish or stage recorded: the resolved one; the path as given if it cannot be
        resolved (then no record matches it and nothing is undone)."""
        if len(path) > MAX_PATH or "\0" in path or not os.path.isabs(path):
            return path
        return resolve(path) or path
