"""Journal: the write-back journal of a cache dir, an fsynced append-only file.

It holds what exists nowhere else until an upload succeeds: which staging files in
CACHE_DIR/dirty/ are acknowledged writes (closed in --writeback mode, or a failed upload
kept for retry), and which multipart uploads are under way. It lives apart from the LMDB
chunk index on purpose: the index is a re-derivable hint that may be thrown away when it
is damaged (tierfs.index.meta), the journal never is.

File format (CACHE_DIR/journal): an 8-byte header, then records

    b"TJR1"  u32 length  u32 crc32(body)  body (JSON, utf-8)        (big-endian)

one per change: {"op": "dirty", "ino", "record", "path"} | {"op": "clean", "ino"} |
{"op": "upload", "id", "key"} | {"op": "upload_done", "id"}. Replaying them in order gives
the live state. Every append is fsynced before the caller returns: a record is durable
when put_dirty returns, which is when close() may acknowledge.

Damage: a crash can only tear the last append (each one waits for its fsync), so a last
record cut short, or with zeros where its blocks never landed, is a torn tail: dropped
and logged (it was never acknowledged). A bad record with more bytes after it is damage
in the middle: opening fails with a StartupError naming the file and offset, never
silently dropping unsaved writes;
`tierfs fsck --repair` keeps every record that still verifies (records carry a marker,
so the ones after a damaged stretch are found again). Compaction rewrites the live state
into a new file (fsync, rename, fsync of the directory) when dead records dominate.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field

from ..errors import NoSpace, StartupError, TierfsError

log = logging.getLogger(__name__)

HEADER = b"TIERFSJ\x01"
MARK = b"TJR1"
_REC = struct.Struct(">4sII")  # mark, body length, crc32 of the body
MAX_BODY = 64 << 20  # a record is a few KiB; a larger length is damage, not data
COMPACT_MIN = 1 << 20  # compaction is considered past this size ...
COMPACT_RATIO = 4  # ... when the file is this many times the size of its live state

RECOVERY_HINT = ("run 'tierfs fsck --cache-dir {dir} --repair' (see docs/operations.md, "
                 "\"A damaged cache dir\")")


class JournalDamaged(StartupError):
    """The journal cannot be read back whole: it may hold unsaved writes."""


class JournalWriteFailed(TierfsError):
    """An append could not be made durable: the write is not acknowledged."""


@dataclass
class Damage:
    start: int  # byte offsets of a stretch that holds no valid record
    end: int


@dataclass
class Scan:
    """What is in a journal file: valid ops in order, damaged stretches, a torn tail."""

    ops: list[tuple[int, dict]] = field(default_factory=list)  # (offset, op)
    damage: list[Damage] = field(default_factory=list)
    torn_at: int | None = None  # offset where a torn last record begins
    bad_header: bool = False
    size: int = 0

    @property
    def clean(self) -> bool:
        return not self.damage and not self.bad_header


def _encode(op: dict) -> bytes:
    body = json.dumps(op, separators=(",", ":")).encode()
    return _REC.pack(MARK, len(body), zlib.crc32(body)) + body


def _record_at(data: bytes, pos: int) -> tuple[dict, int] | None:
    """(op, end offset) if a valid record starts at pos, else None."""
    if pos + _REC.size > len(data):
        return None
    mark, length, crc = _REC.unpack_from(data, pos)
    end = pos + _REC.size + length
    if mark != MARK or length == 0 or length > MAX_BODY or end > len(data):
        return None
    body = data[pos + _REC.size:end]
    if zlib.crc32(body) != crc:
        return None
    try:
        op = json.loads(body)
    except ValueError:
        return None
    return (op, end) if isinstance(op, dict) and "op" in op else None


def _runs_past_end(data: bytes, pos: int) -> bool:
    """Whether a bad record at pos can only be a torn append: it claims bytes past the
    end of the file, or what a crash leaves where data never landed follows - zeros to
    the end, or a whole-length last record with NULs in it (JSON never has any). A last
    record that is whole, NUL-free and still fails its CRC was damaged after it was
    acknowledged: that is not torn."""
    if not data[pos:].strip(b"\0"):
        return True
    if pos + _REC.size > len(data):  # not even a whole record header
        return True
    mark, length, _ = _REC.unpack_from(data, pos)
    if mark != MARK or not 0 < length <= MAX_BODY:
        return False
    end = pos + _REC.size + length
    return end > len(data) or (end == len(data) and b"\0" in data[pos + _REC.size:end])


def scan_bytes(data: bytes) -> Scan:
    s = Scan(size=len(data))
    if data[:len(HEADER)] != HEADER:
        s.bad_header = True
        s.damage.append(Damage(0, min(len(data), len(HEADER))))
    pos = len(HEADER)
    while pos < len(data):
        got = _record_at(data, pos)
        if got is not None:
            s.ops.append((pos, got[0]))
            pos = got[1]
            continue
        if _runs_past_end(data, pos):
            s.torn_at = pos
            break
        # damage: find the next position where a valid record starts again
        nxt = data.find(MARK, pos + 1)
        while nxt != -1 and _record_at(data, nxt) is None:
            nxt = data.find(MARK, nxt + 1)
        end = nxt if nxt != -1 else len(data)
        s.damage.append(Damage(pos, end))
        pos = end
    return s


def scan_file(path: str) -> Scan:
    with open(path, "rb") as f:
        return scan_bytes(f.read())


class JournalState:
    """The live state the ops of a journal replay to."""

    def __init__(self) -> None:
        self.dirty: dict[int, dict] = {}  # ino -> {"record": ..., "path": [...]}
        self.uploads: dict[str, str] = {}  # upload id -> key

    def apply(self, op: dict) -> None:
        kind = op.get("op")
        if kind == "dirty":
            self.dirty[int(op["ino"])] = {"record": op["record"], "path": op.get("path", [])}
        elif kind == "clean":
            self.dirty.pop(int(op["ino"]), None)
        elif kind == "upload":
            self.uploads[str(op["id"])] = str(op["key"])
        elif kind == "upload_done":
            self.uploads.pop(str(op["id"]), None)
        else:
            raise ValueError(f"unknown journal op {kind!r}")

    def ops(self) -> list[dict]:
        """The live state as the fewest ops (what compaction writes)."""
        out: list[dict] = [{"op": "dirty", "ino": ino, **entry}
                           for ino, entry in sorted(self.dirty.items())]
        out += [{"op": "upload", "id": uid, "key": key} for uid, key in self.uploads.items()]
        return out


def replay(scan: Scan) -> JournalState:
    state = JournalState()
    for _, op in scan.ops:
        state.apply(op)
    return state


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, ops: list[dict]) -> int:
    """Atomically replace PATH with a journal of these ops; returns its size."""
    tmp = path + ".tmp"
    data = HEADER + b"".join(_encode(op) for op in ops)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path)
    return len(data)


def damage_message(path: str, scan: Scan) -> str:
    where = ("its header is not a tierfs journal's" if scan.bad_header else
             f"bytes {scan.damage[0].start}-{scan.damage[0].end} fail their checksum")
    hint = RECOVERY_HINT.format(dir=os.path.dirname(os.path.abspath(path)))
    return (f"the write-back journal {path} is damaged ({where}); it may hold unsaved "
            f"writes, so the cache dir is not used until it is repaired: {hint}")


class Journal:
    """The open journal of one cache dir. Thread-safe: appends come from worker threads
    (put_dirty, put_upload) and from the trio thread (delete_dirty)."""

    def __init__(self, path: str, state: JournalState, size: int) -> None:
        self.path = path
        self._state = state
        self._size = size
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._next_check = max(COMPACT_MIN, size)  # size at which compaction is weighed
        self._broken = False

    @classmethod
    def open(cls, path: str) -> "Journal":
        """Open (or create) the journal; a torn tail is dropped, other damage is a
        JournalDamaged error naming the file."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            write_file(path, [])
            return cls(path, JournalState(), len(HEADER))
        except OSError as exc:
            raise JournalDamaged(f"cannot read the write-back journal {path}: "
                                 f"{exc.strerror}") from None
        scan = scan_bytes(data)
        if not scan.clean:
            raise JournalDamaged(damage_message(path, scan))
        try:
            state = replay(scan)
        except (ValueError, KeyError, TypeError) as exc:
            raise JournalDamaged(f"the write-back journal {path} holds a record this tierfs "
                                 f"cannot read ({exc}): "
                                 + RECOVERY_HINT.format(dir=os.path.dirname(path))) from None
        size = len(data)
        if scan.torn_at is not None:
            log.warning("write-back journal %s: dropped a torn last record at byte %d "
                        "(an append a crash interrupted; it was never acknowledged)",
                        path, scan.torn_at)
            size = write_file(path, state.ops())
        elif size > COMPACT_MIN and len(scan.ops) > len(state.dirty) + len(state.uploads):
            size = write_file(path, state.ops())
        return cls(path, state, size)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # ---- reads ---------------------------------------------------------------------

    def dirty_records(self) -> list[tuple[int, dict]]:
        with self._lock:
            return [(ino, e["record"]) for ino, e in sorted(self._state.dirty.items())]

    def dirty_paths(self) -> dict[int, list]:
        """ino -> the inode chain from the root recorded with each journaled file."""
        with self._lock:
            return {ino: e["path"] for ino, e in self._state.dirty.items()}

    def uploads(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._state.uploads.items())

    def max_ino(self) -> int:
        with self._lock:
            inos = list(self._state.dirty)
            for e in self._state.dirty.values():
                inos += [int(p[0]) for p in e["path"]]
            return max(inos, default=0)

    # ---- changes -------------------------------------------------------------------

    def put_dirty(self, ino: int, record: dict, path: list | None = None) -> None:
        self._append({"op": "dirty", "ino": ino, "record": record, "path": path or []})

    def delete_dirty(self, ino: int) -> None:
        with self._lock:
            if ino not in self._state.dirty:
                return
        self._append({"op": "clean", "ino": ino})

    def put_upload(self, upload_id: str, key: str) -> None:
        self._append({"op": "upload", "id": upload_id, "key": key})

    def delete_upload(self, upload_id: str) -> None:
        with self._lock:
            if upload_id not in self._state.uploads:
                return
        self._append({"op": "upload_done", "id": upload_id})

    def _append(self, op: dict) -> None:
        raw = _encode(op)
        with self._lock:
            if self._fd < 0:
                raise JournalWriteFailed(f"the write-back journal {self.path} is closed")
            if self._broken:
                raise JournalWriteFailed(f"the write-back journal {self.path} ends in a failed "
                                         "append that could not be cut back")
            try:
                n = os.write(self._fd, raw)
                if n != len(raw):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fdatasync(self._fd)
            except OSError as exc:
                self._undo(exc)
            self._size += len(raw)
            self._state.apply(op)
            self._maybe_compact()

    def _undo(self, exc: OSError) -> None:
        """A failed append must not leave a partial record for the next one to follow
        (that would read as damage in the middle): cut the file back, then fail."""
        try:
            os.ftruncate(self._fd, self._size)
            os.fdatasync(self._fd)
        except OSError:
            # appending after it would turn a torn tail into damage in the middle: nothing
            # more is acknowledged until a restart (which drops the torn tail)
            self._broken = True
            log.error("write-back journal %s: a failed append could not be cut back; no "
                      "more writes are journaled until the next start", self.path)
        if exc.errno == errno.ENOSPC:
            raise NoSpace(f"no space for the write-back journal {self.path}") from None
        raise JournalWriteFailed(f"cannot write the write-back journal {self.path}: "
                                 f"{exc.strerror}") from None

    def _maybe_compact(self) -> None:
        if self._size < self._next_check:
            return
        live = len(HEADER) + sum(len(_encode(op)) for op in self._state.ops())
        if self._size < COMPACT_RATIO * live:
            self._next_check = COMPACT_RATIO * live  # weighed again only once it can pay
            return
        try:
            size = write_file(self.path, self._state.ops())
        except OSError as exc:  # the old file is intact: keep appending to it
            log.warning("write-back journal %s: compaction failed (%s)", self.path, exc.strerror)
            return
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._size = size
        self._next_check = max(COMPACT_MIN, COMPACT_RATIO * size)
