"""What a POSIX inode has and an S3 listing does not: type, mode, owner, times, rdev.

`Attrs` is the one record of them: kept in the index (JSON in the `attrs` database), and
carried with the object as user metadata, so another node or a remount of another cache
dir sees the same file (docs/semantics.md, "POSIX behaviour"):

    x-amz-meta-tierfs-mode    full st_mode in octal, type bits included ("100644", "10600")
    x-amz-meta-tierfs-uid     decimal          x-amz-meta-tierfs-gid    decimal
    x-amz-meta-tierfs-atime   "SECONDS.NANOSECONDS" (also -mtime, -ctime)
    x-amz-meta-tierfs-rdev    decimal, devices only
    x-amz-meta-tierfs-symlink "1": the object's content is the link's target

s3fs's names (mode, uid, gid, atime, mtime, ctime, rdev; mode in decimal) are read when
tierfs's are absent, so a bucket written through s3fs keeps its owners and modes here.
A field that is None is unknown: the mount's defaults (or the LIST's mtime) stand in.

The rules POSIX gives for owners and special bits live here too, as pure functions: the
kernel (mounted with default_permissions) checks who may do what; these say what the
inode looks like afterwards.
"""

from __future__ import annotations

import json
import logging
import stat
from dataclasses import asdict, dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

# inode kinds (meta.Inode.kind); a kind never changes for an inode number: the kernel
# caches an inode's type, so a name that changes kind gets a new number
DIR, FILE, SYMLINK, FIFO, SOCK, CHR, BLK = 1, 2, 3, 4, 5, 6, 7
_TYPE_BITS = {DIR: stat.S_IFDIR, FILE: stat.S_IFREG, SYMLINK: stat.S_IFLNK,
              FIFO: stat.S_IFIFO, SOCK: stat.S_IFSOCK, CHR: stat.S_IFCHR, BLK: stat.S_IFBLK}
_KIND_OF = {bits: kind for kind, bits in _TYPE_BITS.items()}
# kinds stored as an empty object whose type is in its metadata
SPECIAL = frozenset({FIFO, SOCK, CHR, BLK})

MAX_NAME = 255  # bytes of one path component (NAME_MAX)
MAX_KEY = 1024  # bytes of an S3 key
MAX_FILE_SIZE = 5 << 40  # S3's largest object: the file size limit
PERM = 0o7777


def type_bits(kind: int) -> int:
    return _TYPE_BITS[kind]


def kind_of(mode: int) -> int | None:
    """The kind of a full st_mode, or None for a type tierfs does not store."""
    return _KIND_OF.get(stat.S_IFMT(mode))


@dataclass
class Attrs:
    mode: int | None = None  # permission bits (07777)
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None
    rdev: int = 0
    symlink: str | None = None  # a symlink's target, once known
    # the object version (ETag) whose metadata was read into these; None: never read
    seen: str | None = None

    def to_json(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items()
                           if v is not None and not (k == "rdev" and v == 0)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Attrs":
        d = json.loads(raw)
        if "mtime" in d:  # written by a tierfs that kept float seconds
            d.setdefault("mtime_ns", int(d.pop("mtime") * 1e9))
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})

    def changed(self, **fields: Any) -> "Attrs":  # replace() rejects an unknown name
        return replace(self, **fields)

    def to_metadata(self, kind: int) -> dict[str, str]:
        """Object user metadata for an object of this kind (directories: their marker)."""
        out: dict[str, str] = {}
        if self.mode is not None or kind in SPECIAL:
            perm = self.mode if self.mode is not None else 0o644
            out["tierfs-mode"] = format(type_bits(kind) | perm, "o")
        for name in ("uid", "gid"):
            value = getattr(self, name)
            if value is not None:
                out[f"tierfs-{name}"] = str(value)
        for name in ("atime", "mtime", "ctime"):
            value = getattr(self, name + "_ns")
            if value is not None:
                out[f"tierfs-{name}"] = format_ns(value)
        if kind in (CHR, BLK):
            out["tierfs-rdev"] = str(self.rdev)
        if kind == SYMLINK:
            out["tierfs-symlink"] = "1"  # the target is the object's content
        return out


_FIELDS = set(Attrs.__dataclass_fields__)


def format_ns(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def parse_ns(text: str) -> int:
    """ "SECONDS[.FRACTION]" -> nanoseconds, exactly (no float on the way)."""
    sec, _, frac = text.strip().partition(".")
    if not sec.lstrip("-").isdigit() or (frac and not frac.isdigit()):
        raise ValueError(text)
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def from_metadata(metadata: dict[str, str], etag: str) -> tuple[int | None, Attrs]:
    """(kind, attrs) from an object's user metadata: kind None when it does not say.
    A malformed field is left out with one WARNING; the rest still counts."""
    md = {k.lower(): v for k, v in metadata.items()}
    out = Attrs(seen=etag)
    kind: int | None = None

    def field(name: str) -> str | None:
        return md.get(f"tierfs-{name}", md.get(name))

    try:
        raw = md.get("tierfs-mode")
        if raw is not None:
            mode = int(raw, 8)
        elif "mode" in md:  # s3fs: decimal
            mode = int(md["mode"])
        else:
            mode = None
        if mode is not None:
            out.mode = mode & PERM
            kind = kind_of(mode) if stat.S_IFMT(mode) else None
        for name in ("uid", "gid", "rdev"):
            value = field(name)
            if value is not None:
                setattr(out, name, int(value))
        for name in ("atime", "mtime", "ctime"):
            value = field(name)
            if value is not None:
                setattr(out, name + "_ns", parse_ns(value))
    except ValueError:
        log.warning("ignoring malformed metadata %r", metadata)
    if md.get("tierfs-symlink") == "1":
        kind = SYMLINK
    return kind, out


# ---- what an inode looks like after a change (the kernel has checked permission) ----------

def for_new(kind: int, perm: int, uid: int, gid: int, parent: Attrs | None,
            now_ns: int, rdev: int = 0) -> Attrs:
    """A new node's attributes: the caller's uid; the caller's gid, or the parent's when
    the parent directory has S_ISGID (and a new directory inherits S_ISGID there)."""
    if parent is not None and parent.mode is not None and parent.mode & stat.S_ISGID:
        if parent.gid is not None:
            gid = parent.gid
        if kind == DIR:
            perm |= stat.S_ISGID
    if kind == SYMLINK:
        perm = 0o777
    return Attrs(mode=perm & PERM, uid=uid, gid=gid, atime_ns=now_ns, mtime_ns=now_ns,
                 ctime_ns=now_ns, rdev=rdev)


def without_privs(mode: int) -> int:
    """S_ISUID always, S_ISGID when group-executable (otherwise it marks mandatory locking
    and stays): what a chown, and a write or truncate, clears (Linux)."""
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode
