"""DirtyFile: one file's unsaved writes and where its upload stands (its state).

A file opened for writing gets a DirtyFile: a sparse staging file in CACHE_DIR/dirty/
holding every chunk a writer touched ("materialized"), over a base version (the object
as it was when opened) for the chunks nobody touched. Each DirtyFile is in one State;
the WriteBack that holds it is the only one to move it, along TRANSITIONS (the table is
docs/architecture.md, "File states"):

    staged      changes only in the staging file, not acknowledged yet
    journaled   acknowledged (a write-back close) or kept after a failed upload: its
                record is in the journal, its upload queued
    uploading   an upload attempt holds the file's lock (`upload_id`: its multipart upload)
    uploaded    the store has it; the written chunks move into the cache ("settling")
    clean       the store has what the file holds; forgotten when its last writer closes
    superseded  unlinked or renamed over: its unsaved data has nowhere to go
    forgotten   out of WriteBack.files, its staging file and journal record gone

Also here: the streamed upload of a file (Stream, Sent), the written-range bookkeeping
that decides what can be streamed, and the staging-file I/O helpers.
"""

from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import trio

from ..cache import ObjectVersion
from ..errors import CacheUnwritable, EarlierWriteFailed, NoSpace, TierfsError
from ..integrity import crc32c

T = TypeVar("T")

COVER_MAX = 64  # written ranges tracked per file; a writer scattering more is not streamed


class State(enum.Enum):
    STAGED = "staged"
    JOURNALED = "journaled"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    CLEAN = "clean"
    SUPERSEDED = "superseded"
    FORGOTTEN = "forgotten"


S = State
# the moves WriteBack may make; anything else is a bug (IllegalTransition)
TRANSITIONS: dict[State, set[State]] = {
    S.STAGED: {S.JOURNALED, S.UPLOADING, S.CLEAN, S.SUPERSEDED, S.FORGOTTEN},
    S.JOURNALED: {S.UPLOADING, S.SUPERSEDED, S.FORGOTTEN},
    # an attempt ends uploaded, journaled for a retry, or failed for good (BaseChanged)
    S.UPLOADING: {S.UPLOADED, S.JOURNALED, S.STAGED, S.FORGOTTEN},
    S.UPLOADED: {S.CLEAN, S.SUPERSEDED, S.FORGOTTEN},
    # written again (staged, or journaled when its acknowledged record is still there)
    S.CLEAN: {S.STAGED, S.JOURNALED, S.SUPERSEDED, S.FORGOTTEN},
    S.SUPERSEDED: {S.FORGOTTEN},
    S.FORGOTTEN: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class Sent:
    """One part uploaded into a Stream: valid while its range has not changed since."""
    changes: int  # DirtyFile.part_changes[n] when its bytes were read
    etag: str
    length: int
    crcs: list[int] | None  # CRC32C of each chunk in it (None: copied server-side)


@dataclass
class Stream:
    """A multipart upload of one file and the parts sent into it so far. Streamed (default
    mode, a new file): created while the file is still being written, full parts sent as
    soon as they are written, with the metadata the file had then; close() sends the rest,
    completes it, and fixes the metadata (mtime, chunk CRCs) by copying the object onto
    itself. Otherwise created at upload time with the final metadata."""
    key: str
    metadata: dict[str, str]
    upload_id: str | None = None
    sent: dict[int, Sent] = field(default_factory=dict)
    queued: set[int] = field(default_factory=set)  # parts streamed (or being) in the background
    dead: bool = False  # abandoned: its upload is orphan cleanup's (unowned)
    closing: bool = False  # an upload of the file uses it now: no more background parts
    inflight: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    create_lock: trio.Lock = field(default_factory=trio.Lock)

    def __post_init__(self) -> None:
        self.idle.set()

    def begin(self) -> None:
        if self.inflight == 0:
            self.idle = trio.Event()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.set()


@dataclass
class DirtyFile:
    ino: int
    key: str
    base: ObjectVersion | None
    base_valid: int  # bytes of the base still part of the file (truncation lowers it)
    size: int
    staging: str
    fd: int
    metadata: dict[str, str]
    materialized: set[int] = field(default_factory=set)
    writers: int = 0
    generation: int = 1  # bumps on every change
    saved_generation: int = 0  # the generation the object store holds
    journaled: bool = False  # its record is in the journal
    upload_id: str | None = None  # the multipart upload under way (owned by this daemon)
    # the last write or truncate failed (its TierfsError): fsync/close report it and the
    # bytes are not saved until a later write or truncate succeeds
    failed: TierfsError | None = None
    # when its data last changed (write, truncate): the file's mtime and ctime until
    # FileIO moves it into the inode's attributes and the upload's metadata
    changed_ns: int | None = None
    # streaming (default mode, new files): the written ranges [start, end) merged (None
    # once too scattered to track), a change count per part (a part sent before its range
    # changed is sent again), the multipart upload parts are sent into
    covered: list[list[int]] | None = field(default_factory=list)
    part_changes: dict[int, int] = field(default_factory=dict)
    stream: Stream | None = None
    # uploaded (clean), its written chunks still in the staging file: Settler.settle
    uploaded: ObjectVersion | None = None
    lock: trio.Lock = field(default_factory=trio.Lock)
    state: State = State.STAGED

    @property
    def clean(self) -> bool:
        return self.generation == self.saved_generation

    @property
    def superseded(self) -> bool:
        return self.state in (State.SUPERSEDED, State.FORGOTTEN)

    def to(self, state: State) -> None:
        """Move to `state`, if TRANSITIONS allows it (staying put is always allowed)."""
        if state is not self.state and state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.key!r}: {self.state.value} -> {state.value}")
        self.state = state

    def changed(self) -> None:
        """A write, truncate or new metadata: the store no longer has what it holds."""
        self.generation += 1
        if self.state is State.CLEAN:
            self.to(State.JOURNALED if self.journaled else State.STAGED)

    def record(self) -> dict:
        base = None if self.base is None else [self.base.bucket, self.base.key, self.base.etag,
                                               self.base.size]
        return {"key": self.key, "base": base, "base_valid": self.base_valid, "size": self.size,
                "staging": self.staging, "materialized": sorted(self.materialized),
                "metadata": self.metadata, "upload_id": self.upload_id}

    def sticky_error(self, what: str) -> EarlierWriteFailed:
        assert self.failed is not None
        return EarlierWriteFailed(f"{what} of {self.key!r}: an earlier write failed "
                                  f"({self.failed}); nothing was saved", self.failed.errno)


# ---- written ranges (what may be streamed) -------------------------------------------

def cover(ranges: list[list[int]], start: int, end: int) -> bool:
    """Add [start, end) to sorted, merged ranges; False once they pass COVER_MAX."""
    if ranges and ranges[-1][0] <= start <= ranges[-1][1]:  # appending: the usual case
        ranges[-1][1] = max(ranges[-1][1], end)
        return True
    merged: list[list[int]] = []
    placed = False
    for lo, hi in ranges:
        if hi < start:
            merged.append([lo, hi])
        elif end < lo:
            if not placed:
                merged.append([start, end])
                placed = True
            merged.append([lo, hi])
        else:
            start, end = min(lo, start), max(hi, end)
    if not placed:
        merged.append([start, end])
    merged.sort()
    ranges[:] = merged
    return len(ranges) <= COVER_MAX


def covers(ranges: list[list[int]], start: int, end: int) -> bool:
    return any(lo <= start and end <= hi for lo, hi in ranges)


def uncover(ranges: list[list[int]], size: int) -> None:
    """A truncation to size: nothing past it was written."""
    ranges[:] = [[lo, min(hi, size)] for lo, hi in ranges if lo < size]


# ---- the staging file ------------------------------------------------------------------

def chunk_crcs_of(data: bytes, chunk_size: int) -> list[int]:
    if len(data) <= chunk_size:
        return [crc32c(data)] if data else []
    return [crc32c(data[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]


def read_closing(fd: int, length: int, offset: int) -> bytes:
    """pread of a staging file through fd, which it closes (a worker thread's own dup)."""
    try:
        return staging_io(os.pread, fd, length, offset)
    finally:
        os.close(fd)


def staging_crc(fd: int, start: int, length: int) -> int:
    data = os.pread(fd, length, start)
    return crc32c(data + bytes(length - len(data)))  # a hole past the staging file's end


def staging_io(fn: Callable[..., T], *args: object) -> T:
    """A pread/pwrite/ftruncate of a staging file, its OSError as the TierfsError the
    application gets (the staging file lives on the cache disk)."""
    try:
        return fn(*args)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpace(f"cache disk full: {exc.strerror}") from None
        raise CacheUnwritable(f"cache disk error on a staging file: {exc.strerror}") from None
