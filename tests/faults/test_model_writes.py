"""Reference-model test of the write path (issue 25 item 1, issue 31 item 2).

What it owns: hypothesis generates sequences of file operations on a real mount (node A,
through the fault proxy), a second node B of the same bucket (default mode, its own cache
dir, --metadata-ttl 1s, straight to the RGW) and another S3 client (boto3), with store
outages and daemon restarts in between, and compares what they see with a model of
docs/semantics.md:

- node A: create, write at offsets, ftruncate, fsync, close (handles stay open across
  steps), whole-file writes (O_TRUNC), rename over existing files and over files whose
  write-back upload is still pending (the proxy delays that key's uploads, so "pending" is
  a state, not a race), directory renames, unlink, chmod, utime, `tierfs evict`, one-read
  reads and read handles kept open; clean unmount + remount; kill -9 + remount.
- store outages through the proxy (connections refused, listener down, requests hung,
  503 SlowDown), as long as hypothesis keeps them: every request is stopped before the
  store, so a call that failed with EIO did not happen (docs: "changes ... EIO"), except
  close()/fsync() of data, which are journaled and uploaded once the store answers.
- the kernel dropping part of a file's pages (posix_fadvise), as memory pressure does.
- external overwrites and deletes (boto3, or a whole-file write through node B), read on
  both nodes with handles opened before and after: one read() returns one whole version,
  or on A the start of the old one and then ESTALE at the next read (payloads are stamped
  per 4 KiB block, so mixing shows), an old handle serves the version
  it first served or ESTALE, an open after the TTL sees the new version.

The key property: what close() (--writeback) or close()/fsync() (default) acknowledged
reaches the bucket exactly once at its final name, whatever follows. After each sequence,
with the store answering again, node A, a fresh mount on a new cache dir and the bucket
(boto3 list + get, polled up to fkit.BUCKET_LAG) must equal the model; A's log must not
show an upload of its own that vanished or that it aborted while a file owned it.

Runs: per mode, 5 sequences of a fixed seed and 3 of a random seed (printed;
TIERFS_MODEL_SEED replays it), about 3-4 minutes for both modes. Besides, fixed sequences
(FIXED: given steps of the same machine, test_fixed_sequence) hold the bugs of issue 25 that
random steps reach only now and then (W1, W3, V1), about 25 s.
Longer runs: TIERFS_MODEL_EXAMPLES=200 (examples per seed), TIERFS_MODEL_STEPS (steps per
sequence, default 15), e.g.
    TIERFS_MODEL_EXAMPLES=200 .venv/bin/python -m pytest tests/faults/test_model_writes.py
TIERFS_MODEL_SKIP=rule1,rule2 leaves rules out, to look past a known failure;
TIERFS_MODEL_SHRINK_SECONDS bounds shrinking (default 60 s; hypothesis: 300). Shrinking is on: a
failure prints the shortest sequence hypothesis found (the steps, then
the model's trace of what each call returned).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time

import fkit
import modelkit
import pytest
from fkit import KiB, MiB
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RULE_MARKER,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from modelkit import stamped

from tierfs.cli.ctl import ControlError

CHUNK = 256 * KiB
TTL_A = 2.0  # node A's --metadata-ttl
TTL_B = 1.0  # node B's
MARGIN = 1.0  # the kernel's entry timeout starts at its lookup, a little after ours
FILES = ["a", "b", "c", "d/x", "d/y", "e/x"]
TOP = ["a", "b", "c"]  # the names other clients touch (no directories to keep in step)
DIRS = ["d", "e"]
MAX_HANDLES = 4
UPLOAD_OPS = {"PUT", "CreateMultipart", "UploadPart", "Complete"}

EXAMPLES = int(os.environ.get("TIERFS_MODEL_EXAMPLES", "0"))
STEPS = int(os.environ.get("TIERFS_MODEL_STEPS", "15"))
# a failing sequence shrinks for up to 2 x 60 s on top of its runs; a run made longer
# with TIERFS_MODEL_EXAMPLES is not cut
pytestmark = pytest.mark.timeout(0 if EXAMPLES else 1800)
FIXED_SEEDS = {"default": 20250125, "writeback": 20250131}


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck),
                    report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))


small = st.integers(0, 64)
medium = st.integers(1, 3 * CHUNK + 5)
big = st.integers(8 * MiB + 1, 8 * MiB + 2 * CHUNK)  # a multipart upload (part = 8 MiB)
sizes = st.one_of(small, medium, medium, medium, small, big)
offsets = st.one_of(st.integers(0, 8 * KiB), st.integers(0, 3 * CHUNK + 7))
OUTAGES = ["refuse", "down", "hang", "503"]


def read_once(path, want: list[bytes | None]) -> bytes:
    """open + ONE read() of the whole file (more than the largest version it may have)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, max((len(w) for w in want if w is not None), default=0) + 4096, 0)
    finally:
        os.close(fd)


def read_once_then(path, want: list[bytes | None]) -> tuple[bytes, int | None]:
    """read_once, and a second read() where it stopped: its errno (None: no error). A read
    that meets a newer version part way returns the old version's bytes it has and the
    next read fails with ESTALE (docs/semantics.md, "Consistency"): the second read tells
    that short read from a wrong one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = max((len(w) for w in want if w is not None), default=0) + 4096
        got = os.pread(fd, size, 0)
        try:
            os.pread(fd, size, len(got))
        except OSError as e:
            return got, e.errno
        return got, None
    finally:
        os.close(fd)


class File:
    """An inode of node A: its bytes now, what a crash leaves of them, its mode."""

    def __init__(self, content: bytes, acked: bytes | None, mode: int | None = 0o644,
                 vid: int = 0) -> None:
        self.content = bytearray(content)
        self.acked = acked  # survives kill -9 (None: the file would be gone)
        self.mode = mode  # None: not known (another client's, or a chmod a crash may undo)
        self.mtime_ns: int | None = None  # set by utime until the next write
        self.writers = 0
        self.vid = vid


class Handle:
    def __init__(self, hid: int, node: str, fd: int, file: File | None, name: str,
                 write: bool, has_base: bool = False) -> None:
        self.hid = hid
        self.node = node  # "A" or "B"
        self.fd = fd
        self.file = file
        self.name = name
        self.write = write
        self.has_base = has_base  # writes need the old object's bytes
        self.cands: list[bytes | None] = []  # read handles: what the first read may return
        self.first: bytes | None = None  # read handles: what it served first
        self.changes = 0  # changes of its name seen when it was opened


class Machine(RuleBasedStateMachine):
    # set by the test before run_state_machine_as_test
    ctx: Context = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        c = self.ctx
        c.examples += 1
        self.c = c
        self.rel = f"ex{c.examples:04}"
        self.trace: list[str] = []
        self.ns: dict[str, File] = {}
        self.dirs: set[str] = set()
        self.handles: dict[int, Handle] = {}
        self.hid = 0
        self.vid = 0
        self.outage: str | None = None
        self.outage_rule = None
        self.holds: dict[str, object] = {}  # name -> proxy rule holding its uploads
        self.restarted = False
        # another client's changes: A may see the old state until the window passes
        self.window: dict[str, float] = {}
        self.alt: dict[str, bytes | None] = {}
        # what node B may see: every version each name had in the bucket (None: absent)
        self.history: dict[str, list[bytes | None]] = {n: [None] for n in TOP}
        self.settled: dict[str, tuple[bytes | None, float]] = {}  # known bucket state, since
        self.changes: dict[str, int] = {n: 0 for n in TOP}
        self.log_from = modelkit.log_size(c.a)
        self.t0 = time.monotonic()
        os.mkdir(self.pa(""))

    # ------------------------------------------------------------ helpers
    def note(self, what: str) -> None:
        self.trace.append(f"{time.monotonic() - self.t0:5.1f}s {what}")
        self.c.steps_total += 1

    def why(self, what: str) -> str:
        return (f"{what}\n  mode {self.c.mode}, seed {self.c.seed}; after the operations of "
                f"{self.rel}:\n    " + "\n    ".join(self.trace))

    def pa(self, name: str):
        return self.c.a.path / self.rel / name if name else self.c.a.path / self.rel

    def pb(self, name: str):
        return self.c.b.path / self.rel / name

    def key(self, name: str) -> str:
        return f"{self.rel}/{name}"

    def next_vid(self) -> int:
        self.vid += 1
        return self.c.examples * 1000 + self.vid

    def parent_ok(self, name: str) -> bool:
        return "/" not in name or name.split("/")[0] in self.dirs

    def names_of(self, f: File) -> list[str]:
        return [n for n, g in self.ns.items() if g is f]

    def a_handles(self, f: File | None = None, write: bool | None = None) -> list[Handle]:
        return [h for h in self.handles.values() if h.node == "A"
                and (f is None or h.file is f) and (write is None or h.write == write)]

    def store_ok(self, err: int | None, what: str, store: bool = True) -> bool:
        """True if the call succeeded; an EIO is allowed while the store is down (the call
        did not happen); anything else fails the test."""
        if err is None:
            return True
        if err == errno.EIO and self.outage is not None and store:
            return False
        raise AssertionError(self.why(f"{what}: {errno.errorcode.get(err, err)} "
                                      f"(outage: {self.outage})"))

    def call(self, fn, *a):
        try:
            return fn(*a), None
        except OSError as e:
            return None, e.errno

    def settle(self, *names: str) -> bool:
        """Wait until A sees other clients' changes of these names (all if none given).
        False, without waiting, while the store is down and one of them changed: A serves
        its last view of such a name (stale-on-error) until the store answers again, so
        the caller skips its operation on it."""
        keys = names or tuple(self.window)
        if self.outage is not None and any(n in self.window for n in keys):
            return False
        until = max((self.window.get(n, 0.0) for n in keys), default=0.0)
        if until > time.monotonic():
            time.sleep(until - time.monotonic())
        for n in keys:
            self.window.pop(n, None)
            self.alt.pop(n, None)
        return True

    def a_view(self, name: str) -> list[bytes | None]:
        """What A may read at `name` now."""
        f = self.ns.get(name)
        now = bytes(f.content) if f is not None else None
        if name in self.window and (self.window[name] > time.monotonic()
                                    or self.outage is not None):
            return [now, self.alt[name]]
        return [now]

    def close_readers(self, f: File | None) -> None:
        """A's read handles of a file A is about to change are closed first: they exist to
        see other clients' changes (issue 31), not A's own."""
        if f is None:
            return
        for h in [h for h in self.a_handles(f, write=False)]:
            self.close_handle(h)

    def close_b_readers(self, name: str) -> None:
        for h in [h for h in self.handles.values() if h.node == "B" and h.name == name]:
            self.close_handle(h)

    def close_handle(self, h: Handle) -> int | None:
        del self.handles[h.hid]
        _, err = self.call(os.close, h.fd)
        if h.write:
            h.file.writers -= 1
        return err

    def acked_now(self, f: File) -> None:
        """close()/fsync() acknowledged f's bytes (or journaled them, when they failed
        with EIO: docs "When uploads fail"); where its names are in the bucket later."""
        f.acked = bytes(f.content)
        for n in self.names_of(f):
            self.bucket_changed(n, bytes(f.content), known=self.c.mode == "default"
                                and self.outage is None)

    def bucket_changed(self, name: str, content: bytes | None, known: bool) -> None:
        """The bucket's `name` becomes (or will become) `content`."""
        if name not in self.history:
            return
        if content not in self.history[name]:
            self.history[name].append(content)
        self.changes[name] += 1
        if known:
            self.settled[name] = (content, time.monotonic())
        else:
            self.settled.pop(name, None)
        for h in self.handles.values():
            if h.node == "B" and h.name == name and h.first is None:
                # not served yet: it may move to any version (docs: "Consistency")
                h.cands = [c for c in self.history[name] if c is not None]

    def new_file(self, name: str, content: bytes) -> File:
        f = File(content, None, vid=self.vid)
        self.ns[name] = f
        return f

    def drain(self) -> None:
        """Wait until A uploaded everything (the store answers, nothing held); then the
        bucket's names are what A shows, except files open for writing."""
        writing = {id(h.file) for h in self.a_handles(write=True)}
        modelkit.drain(self.c.a, fkit.BUCKET_LAG, len(writing))
        for n in TOP:
            f = self.ns.get(n)
            if f is not None and f.writers:
                continue
            want = bytes(f.content) if f is not None else None
            if self.settled.get(n, (object(),))[0] != want:
                self.settled[n] = (want, time.monotonic())

    # ------------------------------------------------------------ setup
    @initialize(sa=sizes, sb=sizes)
    def some_files(self, sa, sb):
        """Two uploaded files to overwrite, rename over and unlink."""
        for name, size in (("a", sa), ("b", sb)):
            vid = self.next_vid()
            data = stamped(vid, 0, size)
            fkit.write_file(self.pa(name), data)
            f = self.new_file(name, data)
            self.acked_now(f)
        self.note(f"(setup) a {sa} bytes, b {sb} bytes, uploaded")
        self.drain()

    # ------------------------------------------------------------ node A: data
    @precondition(lambda self: len(self.handles) < MAX_HANDLES)
    @rule(name=st.sampled_from(FILES), trunc=st.booleans())
    def open_for_writing(self, name, trunc):
        if not self.parent_ok(name):
            return
        if not self.settle(name):
            return
        f = self.ns.get(name)
        self.close_readers(f)
        flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0)
        fd, err = self.call(os.open, self.pa(name), flags, 0o644)
        self.note(f"A open {name} O_RDWR|O_CREAT{'|O_TRUNC' if trunc else ''}"
                  f"{'' if f else ' (new)'}: {self.res(err)}")
        if not self.store_ok(err, "open"):
            return
        if f is None:
            f = self.new_file(name, b"")
        has_base = not trunc and f.acked is not None and len(f.content) > 0
        if trunc and len(f.content):
            del f.content[:]
            f.mtime_ns = None
        f.writers += 1
        self.hid += 1
        self.handles[self.hid] = Handle(self.hid, "A", fd, f, name, True, has_base)

    def res(self, err: int | None) -> str:
        return "ok" if err is None else errno.errorcode.get(err, str(err))

    def pick(self, data, pred) -> Handle | None:
        ids = sorted(h.hid for h in self.handles.values() if pred(h))
        if not ids:
            return None
        return self.handles[data.draw(st.sampled_from(ids), label="handle")]

    def writable(self, h: Handle) -> bool:
        # a partial write into an existing object needs its bytes: not while the store is
        # down (docs: such a write may fail with EIO and the file is then in a failed state)
        return h.write and (self.outage is None or not h.has_base)

    @precondition(lambda self: any(h.write for h in self.handles.values()))
    @rule(data=st.data(), off=offsets, size=sizes)
    def pwrite(self, data, off, size):
        h = self.pick(data, self.writable)
        if h is None:
            return
        buf = stamped(self.next_vid(), off, size)
        n, err = self.call(os.pwrite, h.fd, buf, off)
        self.note(f"A pwrite #{h.hid} ({h.name}) at {off}: {size} bytes: {self.res(err)}")
        if err is not None or n != size:
            raise AssertionError(self.why(f"pwrite returned {n}, errno {err}"))
        if size:
            c = h.file.content
            if off > len(c):
                c.extend(b"\0" * (off - len(c)))
            c[off:off + size] = buf
        h.file.mtime_ns = None

    @precondition(lambda self: any(h.write for h in self.handles.values()))
    @rule(data=st.data(), size=st.one_of(st.integers(0, 100), offsets))
    def ftruncate(self, data, size):
        h = self.pick(data, self.writable)
        if h is None:
            return
        _, err = self.call(os.ftruncate, h.fd, size)
        self.note(f"A ftruncate #{h.hid} ({h.name}) to {size}: {self.res(err)}")
        if err is not None:
            raise AssertionError(self.why(f"ftruncate: errno {err}"))
        c = h.file.content
        if size < len(c):
            del c[size:]
        else:
            c.extend(b"\0" * (size - len(c)))
        h.file.mtime_ns = None

    @precondition(lambda self: any(h.write for h in self.handles.values()))
    @rule(data=st.data())
    def fsync(self, data):
        h = self.pick(data, lambda h: h.write)
        _, err = self.call(os.fsync, h.fd)
        self.note(f"A fsync #{h.hid} ({h.name}): {self.res(err)}")
        self.store_ok(err, "fsync")
        self.acked_now(h.file)  # in S3, or journaled and retried (EIO)

    @precondition(lambda self: any(h.node == "A" for h in self.handles.values()))
    @rule(data=st.data())
    def close(self, data):
        h = self.pick(data, lambda h: h.node == "A")
        err = self.close_handle(h)
        self.note(f"A close #{h.hid} ({h.name}{'' if h.write else ', read'}): {self.res(err)}")
        if h.write:
            # write-back: close succeeds even while the store is down; default: EIO then,
            # and the file is journaled and uploaded later
            self.store_ok(err, "close", store=self.c.mode == "default")
            self.acked_now(h.file)
        elif err is not None:
            raise AssertionError(self.why(f"close of a read handle: errno {err}"))

    @rule(name=st.sampled_from(FILES), size=sizes, fsync=st.booleans(), held=st.booleans())
    def write_whole(self, name, size, fsync, held):
        """The checkpoint writer: open(O_TRUNC), write, [fsync], close. held (write-back):
        the proxy delays this key's uploads from now on, so the upload is still pending."""
        if not self.parent_ok(name) or len(self.handles) >= MAX_HANDLES:
            return
        if not self.settle(name):
            return
        f = self.ns.get(name)
        self.close_readers(f)
        held = held and self.c.mode == "writeback"
        if held:
            self.hold(name)
        buf = stamped(self.next_vid(), 0, size)
        fd, err = self.call(os.open, self.pa(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        what = f"A write {name} whole: {size} bytes{', fsync' if fsync else ''}"
        if err is not None:
            self.note(f"{what}: open {self.res(err)}")
            self.store_ok(err, "open(O_TRUNC)")
            return
        if f is None:
            f = self.new_file(name, b"")
        f.writers += 1
        del f.content[:]
        f.mtime_ns = None
        view, off = memoryview(buf), 0
        while off < size:
            n = os.write(fd, view[off:off + MiB])
            assert n > 0, self.why(f"write of {name} returned {n}")
            off += n
        f.content[:] = buf
        ferr = None
        if fsync:
            _, ferr = self.call(os.fsync, fd)
        _, cerr = self.call(os.close, fd)
        f.writers -= 1
        self.note(f"{what}{' (upload held)' if held else ''}: "
                  f"{'fsync ' + self.res(ferr) + ', ' if fsync else ''}close {self.res(cerr)}")
        self.store_ok(ferr, "fsync")
        self.store_ok(cerr, "close", store=self.c.mode == "default")
        self.acked_now(f)

    def hold(self, name: str) -> None:
        if name in self.holds:
            return
        key = f"{self.rel}/{name}"
        # each upload request of the key reaches the store 1.5 s late (within the daemon's
        # 2 s timeout, so it succeeds): the upload is in flight, pending, when the next
        # calls come, as a large file's upload would be
        self.holds[name] = self.c.proxy.inject("delay", UPLOAD_OPS, key=lambda k: k == key,
                                               seconds=1.5)

    @precondition(lambda self: self.holds)
    @rule()
    def release_uploads(self):
        self.note(f"(proxy) uploads of {', '.join(sorted(self.holds))} are no longer delayed")
        for r in self.holds.values():
            self.c.proxy.remove(r)
        self.holds.clear()

    # ------------------------------------------------------------ node A: names
    @rule(src=st.sampled_from(FILES), dst=st.sampled_from(FILES))
    def rename(self, src, dst):
        if src == dst or not self.parent_ok(src) or not self.parent_ok(dst):
            return
        if not self.settle(src, dst):
            return
        f, g = self.ns.get(src), self.ns.get(dst)
        self.close_readers(f)
        self.close_readers(g)
        _, err = self.call(os.rename, self.pa(src), self.pa(dst))
        self.note(f"A rename {src} -> {dst}{' (replaces)' if g else ''}"
                  f"{' (pending upload of ' + dst + ')' if dst in self.holds else ''}: "
                  f"{self.res(err)}")
        if f is None:
            if err != errno.ENOENT:
                raise AssertionError(self.why(f"rename of a missing file: {self.res(err)}"))
            return
        if not self.store_ok(err, "rename"):
            return
        self.ns[dst] = self.ns.pop(src)
        known = self.c.mode == "default" and f.acked is not None and not f.writers
        self.bucket_changed(dst, f.acked, known)
        self.bucket_changed(src, None, known)

    @rule(name=st.sampled_from(FILES))
    def unlink(self, name):
        if not self.parent_ok(name):
            return
        if not self.settle(name):
            return
        f = self.ns.get(name)
        self.close_readers(f)
        _, err = self.call(os.unlink, self.pa(name))
        self.note(f"A unlink {name}{'' if f else ' (missing)'}: {self.res(err)}")
        if f is None:
            if err != errno.ENOENT:
                raise AssertionError(self.why(f"unlink of a missing file: {self.res(err)}"))
            return
        if not self.store_ok(err, "unlink"):
            return  # nothing happened: the file and its pending data stay as they were
        del self.ns[name]
        self.bucket_changed(name, None, self.c.mode == "default")

    @rule(name=st.sampled_from(FILES), mode=st.sampled_from([0o600, 0o640, 0o755, 0o444]))
    def chmod(self, name, mode):
        f = self.ns.get(name)
        if f is None:
            return
        if not self.settle(name):
            return
        _, err = self.call(os.chmod, self.pa(name), mode)
        self.note(f"A chmod {name} {mode:o}: {self.res(err)}")
        if self.store_ok(err, "chmod"):
            f.mode = mode if not f.writers else None  # a crash may undo it with the writes

    @rule(name=st.sampled_from(FILES), sec=st.integers(1_000_000_000, 1_700_000_000))
    def utime(self, name, sec):
        f = self.ns.get(name)
        if f is None:
            return
        if not self.settle(name):
            return
        ns = sec * 10**9 + 123456789
        _, err = self.call(lambda: os.utime(self.pa(name), ns=(ns, ns)))
        self.note(f"A utime {name} {sec}.123456789: {self.res(err)}")
        if self.store_ok(err, "utime"):
            f.mtime_ns = ns if not f.writers else None

    @rule(d=st.sampled_from(DIRS))
    def mkdir(self, d):
        _, err = self.call(os.mkdir, self.pa(d))
        self.note(f"A mkdir {d}: {self.res(err)}")
        if d in self.dirs:
            if err != errno.EEXIST:
                raise AssertionError(self.why(f"mkdir of an existing dir: {self.res(err)}"))
        elif self.store_ok(err, "mkdir"):
            self.dirs.add(d)

    @rule(d=st.sampled_from(DIRS))
    def rmdir(self, d):
        if d not in self.dirs:
            return
        _, err = self.call(os.rmdir, self.pa(d))
        full = any(n.startswith(d + "/") for n in self.ns)
        self.note(f"A rmdir {d}{' (not empty)' if full else ''}: {self.res(err)}")
        if full:
            if err != errno.ENOTEMPTY:
                raise AssertionError(self.why(f"rmdir of a full dir: {self.res(err)}"))
        elif self.store_ok(err, "rmdir"):
            self.dirs.discard(d)

    @rule(src=st.sampled_from(DIRS), dst=st.sampled_from(DIRS))
    def rename_dir(self, src, dst):
        if src not in self.dirs or dst in self.dirs:
            return
        _, err = self.call(os.rename, self.pa(src), self.pa(dst))
        inside = sorted(n for n in self.ns if n.startswith(src + "/"))
        self.note(f"A rename dir {src} -> {dst} ({', '.join(inside) or 'empty'}"
                  f"{'; held: ' + ', '.join(sorted(self.holds)) if self.holds else ''}): "
                  f"{self.res(err)}")
        if not self.store_ok(err, "rename dir"):
            return
        self.dirs.discard(src)
        self.dirs.add(dst)
        for n in inside:
            self.ns[dst + n[len(src):]] = self.ns.pop(n)
        for h in self.handles.values():
            if h.name.startswith(src + "/"):
                h.name = dst + h.name[len(src):]

    # ------------------------------------------------------------ node A: reads
    @rule(name=st.sampled_from(FILES))
    def read(self, name):
        """open + one read() of the whole file (the kernel's page cache is left as it is)."""
        if not self.parent_ok(name):
            return
        want = self.a_view(name)
        r, err = self.call(read_once_then, self.pa(name), want)
        got, then = r if r is not None else (None, None)
        self.note(f"A read {name}: {self.res(err)}{'' if got is None else f' {len(got)} bytes'}"
                  f"{'' if then is None else f', the next read {self.res(then)}'}")
        if err == errno.ENOENT and None in want:
            return
        if err == errno.EIO and self.outage is not None:
            return  # not cached, and the store is down
        old = self.alt.get(name) if len(want) > 1 else None
        if old is not None and err == errno.ESTALE:
            return  # another client replaced it within A's TTL: reopen (docs, the old
            # version's bytes the kernel had - none here - then ESTALE)
        if got and got not in want and old is not None and len(got) < len(old) \
                and old.startswith(got) and then == errno.ESTALE:
            return  # the old version's bytes the kernel had, then ESTALE (docs)
        self.expect_one(got, err, want, f"A read {name}")
        # A saw the new version: it never goes back
        if name in self.window and got is not None \
                and got == (bytes(self.ns[name].content) if name in self.ns else None):
            self.window.pop(name)
            self.alt.pop(name)

    @rule(name=st.sampled_from(TOP), keep=st.sampled_from([0, CHUNK, 8 * MiB]))
    def drop_pages(self, name, keep):
        """The kernel drops A's cached pages of the file past `keep`, as memory pressure
        does: the next read gets its start from the page cache and the rest from tierfs,
        which must be the same version (issue 25 V1). Nothing the model sees changes."""
        if name not in self.ns:
            return
        fd, err = self.call(os.open, self.pa(name), os.O_RDONLY)
        if fd is not None:
            _, err = self.call(os.posix_fadvise, fd, keep, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        self.note(f"A drops the pages of {name} past {keep}: {self.res(err)}")
        if err == errno.ENOENT and None in self.a_view(name):
            return  # another client deleted it
        self.store_ok(err, "open for fadvise")

    def expect_one(self, got, err, want: list[bytes | None], what: str) -> None:
        if err is None and got in want:
            return
        cands = {f"v{i}": w for i, w in enumerate(want)}
        raise AssertionError(self.why(
            f"{what} returned {self.res(err) if err else modelkit.blocks(got, cands)}; "
            f"expected one whole version of: "
            + "; ".join(f"v{i} {modelkit.short(w)}" for i, w in enumerate(want))))

    @precondition(lambda self: len(self.handles) < MAX_HANDLES and self.outage is None)
    @rule(node=st.sampled_from("AB"), name=st.sampled_from(TOP))
    def open_for_reading(self, node, name):
        path = self.pa(name) if node == "A" else self.pb(name)
        if node == "B":
            self.close_b_readers(name)  # one old handle per name is enough
        fd, err = self.call(os.open, path, os.O_RDONLY)
        self.note(f"{node} open {name} O_RDONLY: {self.res(err)}")
        cands = self.a_view(name) if node == "A" else self.b_view(name)
        if err == errno.ENOENT and None in cands:
            return
        if err is not None:
            raise AssertionError(self.why(f"{node} open {name}: {self.res(err)}"))
        self.hid += 1
        h = Handle(self.hid, node, fd, self.ns.get(name) if node == "A" else None, name, False)
        h.cands = [c for c in cands if c is not None]
        h.changes = self.changes[name]
        self.handles[self.hid] = h

    @precondition(lambda self: any(not h.write for h in self.handles.values()))
    @rule(data=st.data())
    def read_handle(self, data):
        """One pread() of the whole file through a handle kept open: the version it first
        served, whole, or ESTALE once its name changed (docs: "Consistency")."""
        self.read_one(self.pick(data, lambda h: not h.write))

    def read_one(self, h: Handle) -> None:
        if h.node == "A" and self.outage is not None:
            return
        size = max((len(c) for c in h.cands), default=0)
        got, err = self.call(os.pread, h.fd, size + 4096, 0)
        self.note(f"{h.node} pread #{h.hid} ({h.name}, open): {self.res(err)}"
                  f"{'' if got is None else f' {len(got)} bytes'}")
        changed = self.changes[h.name] != h.changes
        if err == errno.ESTALE and changed:
            return
        want = [h.first] if h.first is not None else h.cands
        if changed and err is None and got and got not in want and any(
                w and len(got) < len(w) and w.startswith(got) for w in want):
            # the old version's bytes the kernel still had: the next read must say ESTALE
            _, then = self.call(os.pread, h.fd, size + 4096, len(got))
            self.note(f"{h.node} pread #{h.hid} at {len(got)}: {self.res(then)}")
            if then == errno.ESTALE:
                return
        self.expect_one(got, err, want, f"{h.node} pread of the handle of {h.name}")
        if got:  # an empty read served no byte: the handle may still move (docs)
            h.first = got

    # ------------------------------------------------------------ node B, other clients
    def b_view(self, name: str) -> list[bytes | None]:
        """What B may see: the settled bucket state once B's TTL passed, else any version
        the name had in the bucket."""
        s = self.settled.get(name)
        if s is not None and time.monotonic() > s[1] + TTL_B + MARGIN:
            return [s[0]]
        return list(self.history[name])

    @precondition(lambda self: self.outage is None)
    @rule(name=st.sampled_from(TOP))
    def b_read(self, name):
        want = self.b_view(name)
        got, err = self.call(read_once, self.pb(name), want)
        self.note(f"B read {name}: {self.res(err)}{'' if got is None else f' {len(got)} bytes'}")
        if err == errno.ENOENT and None in want:
            return
        self.expect_one(got, err, want, f"B read {name}")

    def other_client_ok(self, name: str) -> bool:
        f = self.ns.get(name)
        return self.outage is None and not self.holds and not (f and f.writers)

    @precondition(lambda self: self.outage is None and not self.holds)
    @rule(name=st.sampled_from(TOP), size=sizes, via=st.sampled_from(["boto3", "B"]),
          delete=st.booleans())
    def other_client(self, name, size, via, delete):
        """Another client overwrites (or deletes) the key, once A uploaded what it had."""
        if not self.other_client_ok(name):
            return
        if not self.settle(name):
            return
        self.drain()
        old = self.ns.get(name)
        before = self.a_view(name)
        vid = self.next_vid()
        buf = None if delete else stamped(vid, 0, size)
        if via == "B":
            self.close_b_readers(name)
            if delete:
                _, err = self.call(os.unlink, self.pb(name))
                if err == errno.ENOENT and old is None:
                    err = None
            else:
                _, err = self.call(fkit.write_file, self.pb(name), buf)
            if err is not None:
                raise AssertionError(self.why(f"B {'unlink' if delete else 'write'} {name}: "
                                              f"{self.res(err)}"))
        elif delete:
            self.c.s3.delete_object(Bucket=self.c.bucket, Key=self.key(name))
        else:
            self.c.s3.put_object(Bucket=self.c.bucket, Key=self.key(name), Body=buf)
        self.note(f"{via} {'deletes' if delete else f'overwrites ({size} bytes)'} {name}")
        if delete:
            self.ns.pop(name, None)
        else:
            f = File(buf, buf, mode=None, vid=vid)
            self.ns[name] = f
        self.bucket_changed(name, buf, known=True)
        # A: the old state until its TTL passed (kernel entry + index)
        self.window[name] = time.monotonic() + TTL_A + MARGIN
        self.alt[name] = before[0]
        for h in self.a_handles(old, write=False) if old is not None else []:
            if h.first is None and buf is not None:
                h.cands.append(buf)  # not served yet: it may move to the new version

    @precondition(lambda self: self.outage is None)
    @rule()
    def wait_ttl(self):
        """Let every node's TTL pass (the next open sees the new version)."""
        self.note(f"(sleep {TTL_A + MARGIN:.0f} s: the TTLs pass)")
        time.sleep(TTL_A + MARGIN)

    @precondition(lambda self: self.outage is None and not self.holds)
    @rule()
    def wait_uploads(self):
        self.note("(wait until A has no upload pending)")
        self.drain()

    @rule(name=st.sampled_from(TOP))
    def evict(self, name):
        """`tierfs evict`: A's cached chunks go (the kernel's page cache stays)."""
        if name not in self.ns:
            return
        try:
            modelkit.evict(self.c.a, self.key(name))
            self.note(f"A tierfs evict {name}")
        except (OSError, ControlError) as e:  # unsaved writes, or the path gone: nothing to do
            self.note(f"A tierfs evict {name}: {e}")

    # ------------------------------------------------------------ patterns
    # The bugs live in short patterns that uniform random steps rarely line up; these rules
    # run a pattern's steps as one (each still checked by the model), so hypothesis finds
    # and shrinks them in a few dozen sequences.
    @rule(tmp=st.sampled_from(FILES), dst=st.sampled_from(FILES[1:] + FILES[:1]), size=sizes,
          last=sizes, fsync=st.booleans(), held=st.booleans().map(lambda b: not b))
    def checkpoint(self, tmp, dst, size, last, fsync, held):
        """Save to tmp, rename over the last checkpoint. held: the last checkpoint is written
        just before and its upload held (write-back: still pending at the rename, W1). The
        simplest draw (tmp a, dst b, held) is the pattern itself."""
        if tmp == dst or not self.parent_ok(tmp) or not self.parent_ok(dst):
            return
        if held and self.c.mode == "writeback":
            self.write_whole(dst, last, False, True)
        self.write_whole(tmp, size, fsync, False)
        self.rename(tmp, dst)

    @rule(name=st.sampled_from(FILES), size=sizes)
    def write_then_unlink(self, name, size):
        """A whole-file write, then unlink (a scratch file, or a failed job cleaning up)."""
        self.write_whole(name, size, False, False)
        self.unlink(name)

    @precondition(lambda self: self.outage is None and not self.holds)
    @rule(name=st.sampled_from(TOP), size=sizes, evict=st.booleans(),
          via=st.sampled_from(["boto3", "B"]), keep=st.sampled_from([None, 0, CHUNK]))
    def reread_after_other_writer(self, name, size, evict, via, keep=None):
        """A's page cache warm [past `keep` dropped], [A's chunks evicted,] another client
        overwrites, A reads within the TTL: one whole version (issue 25 V1)."""
        self.read(name)
        if keep is not None:
            self.drop_pages(name, keep)
        if evict:
            self.evict(name)
        self.other_client(name, size, via, False)
        self.read(name)

    @precondition(lambda self: self.outage is None and not self.holds
                  and len(self.handles) < MAX_HANDLES - 1)
    @rule(name=st.sampled_from(TOP), size=sizes, node=st.sampled_from("AB"),
          wait=st.booleans())
    def old_handle_and_new_version(self, name, size, node, wait):
        """issue 31: a handle opened and read before another client overwrote the file
        keeps reading; a new open (after the TTL if wait) reads one whole version."""
        self.open_for_reading(node, name)
        old = max(self.handles) if self.handles else None
        if old is None or self.handles[old].name != name or self.handles[old].write:
            return
        self.read_one(self.handles[old])
        self.other_client(name, size, "boto3", False)
        if wait:
            self.wait_ttl()
        (self.read if node == "A" else self.b_read)(name)
        if old in self.handles:
            self.read_one(self.handles[old])

    # ------------------------------------------------------------ faults, restarts
    @precondition(lambda self: self.outage is None)
    @rule(kind=st.sampled_from(OUTAGES))
    def outage_starts(self, kind):
        p = self.c.proxy
        self.outage_rule = None
        if kind == "down":
            p.down()
        elif kind == "refuse":
            self.outage_rule = p.inject("refuse", None)
        elif kind == "hang":  # dropped, never forwarded late
            self.outage_rule = p.inject("hang", None, seconds=1.0, then="close")
        else:
            self.outage_rule = p.inject("503", None, retry_after=1)
        self.outage = kind
        self.note(f"(proxy) outage starts: {kind}")

    @precondition(lambda self: self.outage is not None)
    @rule()
    def outage_ends(self):
        self.heal()
        self.note("(proxy) the store answers again")

    def heal(self) -> None:
        p = self.c.proxy
        p.up()
        if self.outage_rule is not None:
            p.remove(self.outage_rule)
        p.release()
        self.outage = None
        # A may have served its old view of names other clients changed (stale-on-error),
        # and the kernel keeps such an answer for a TTL
        for n in self.window:
            self.window[n] = max(self.window[n], time.monotonic() + TTL_A + MARGIN)
        modelkit.wait_up(self.c.a, 15)

    def drop_handles(self, crashed: bool) -> None:
        for h in list(self.handles.values()):
            if h.node != "A":
                continue
            err = self.close_handle(h)
            if h.write and not crashed:
                self.store_ok(err, "close at unmount", store=self.c.mode == "default")
                self.acked_now(h.file)

    @precondition(lambda self: self.outage != "503")
    @rule()
    def unmount_remount(self):
        """`tierfs unmount` (files closed first), then mount the same cache dir again."""
        self.drop_handles(crashed=False)
        c = self.c
        c.a.stop()
        c.a = c.mounts.again(c.a)
        self.restarted = True
        self.note(f"A unmount + mount{' (store down)' if self.outage else ''}")

    @precondition(lambda self: self.outage != "503")
    @rule()
    def kill9_remount(self):
        """kill -9 of A's daemon, then mount the same cache dir again: acknowledged data
        survives, writes of files still open are discarded (docs: "When is written data
        durable?")."""
        c = self.c
        c.a.kill9()
        open_files = {id(h.file): h.file for h in self.a_handles(write=True)}
        self.drop_handles(crashed=True)
        for f in open_files.values():
            if f.acked is None:  # never acknowledged: gone
                for n in self.names_of(f):
                    del self.ns[n]
            else:
                f.content[:] = f.acked
                f.mtime_ns = None
        self.note(f"A kill -9 + mount{' (store down)' if self.outage else ''}")
        c.a = c.mounts.again(c.a)
        self.restarted = True

    # ------------------------------------------------------------ checks
    @invariant()
    def listing(self):
        if self.outage is not None:
            return  # the listing may be stale-on-error; checked again when it answers
        try:
            got = set(os.listdir(self.pa("")))
        except OSError as e:
            raise AssertionError(self.why(f"listdir: {e}")) from None
        want = {n.split("/")[0] for n in self.ns} | self.dirs
        loose = {n for n in self.window if self.window[n] > time.monotonic()}
        if (got ^ want) - loose:
            raise AssertionError(self.why(f"A lists {sorted(got)}, model {sorted(want)}"))

    def teardown(self) -> None:
        c = self.c
        try:
            self.finish()
        finally:
            if self.outage is not None or self.holds:
                c.proxy.heal()

    def finish(self) -> None:
        c = self.c
        for h in list(self.handles.values()):
            err = self.close_handle(h)
            if h.node == "A" and h.write:
                self.store_ok(err, "close", store=self.c.mode == "default")
                self.acked_now(h.file)
        if self.outage is not None:
            self.heal()
        if self.holds:
            self.release_uploads()
        self.settle()
        files = {self.key(n): bytes(f.content) for n, f in self.ns.items()}
        markers = {self.key(d) + "/" for d in self.dirs} | {self.rel + "/"}

        def bucket_matches():
            got = fkit.s3_sizes(c.s3, c.bucket, self.rel + "/")
            keys = set(got) - markers
            bad = [f"{k}: bucket {got.get(k, '<absent>')} bytes, model "
                   f"{len(files[k]) if k in files else '<absent>'}"
                   for k in sorted(keys | set(files))
                   if k not in files or k not in got or got[k] != len(files[k])]
            bad += [f"{k}: bucket has "
                    f"{modelkit.blocks(fkit.s3_get(c.s3, c.bucket, k), {'model': v})}"
                    for k, v in files.items() if k in got and got[k] == len(v)
                    and fkit.s3_get(c.s3, c.bucket, k) != v]
            assert not bad, self.why("the bucket differs from the model:\n      "
                                     + "\n      ".join(bad))

        fkit.eventually(bucket_matches, fkit.BUCKET_LAG, interval=0.5, alive_of=c.a)
        for n, f in self.ns.items():
            if f.mode is None and f.mtime_ns is None:
                continue
            md = c.s3.head_object(Bucket=c.bucket, Key=self.key(n))["Metadata"]
            if f.mode is not None:
                mode = int(md.get("tierfs-mode", "0"), 8) & 0o7777
                assert mode == f.mode, self.why(f"{n}: bucket mode {mode:o}, model {f.mode:o}")
            if f.mtime_ns is not None:
                s, _, frac = md.get("tierfs-mtime", "0").partition(".")
                got = int(s) * 10**9 + int((frac + "000000000")[:9])
                assert got == f.mtime_ns, self.why(f"{n}: bucket mtime {got}, model {f.mtime_ns}")
        self.compare_mount(c.a, "A")
        c.fresh += 1
        fresh = c.mounts.start("--chunk-size", "256K", "--meta-head-max-size", "all",
                               cache=f"fresh{c.fresh}-cache", mnt=f"fresh{c.fresh}", direct=True)
        try:
            self.compare_mount(fresh, "a fresh mount")
        finally:
            fresh.stop()
            shutil.rmtree(fresh.cache_dir, ignore_errors=True)
        self.check_log()

    def compare_mount(self, m, who: str) -> None:
        root = m.path / self.rel
        want = {n.split("/")[0] for n in self.ns} | self.dirs
        got = set(os.listdir(root))
        assert got == want, self.why(f"{who} lists {sorted(got)}, model {sorted(want)}")
        for d in self.dirs:
            inside = {n.split("/", 1)[1] for n in self.ns if n.startswith(d + "/")}
            got = set(os.listdir(root / d))
            assert got == inside, self.why(
                f"{who} lists {d}: {sorted(got)}, model {sorted(inside)}")
        for n, f in self.ns.items():
            data, err = fkit.read_errno(root / n)
            assert data == bytes(f.content), self.why(
                f"{who} reads {n}: "
                f"{self.res(err) if err else modelkit.blocks(data, {'model': bytes(f.content)})}"
                f", model {modelkit.short(bytes(f.content))}")
            if f.mode is not None:
                mode = os.stat(root / n).st_mode & 0o7777
                assert mode == f.mode, self.why(f"{who}: {n} mode {mode:o}, model {f.mode:o}")

    def check_log(self) -> None:
        """The daemon never aborts an upload a live file owns (docs "When uploads fail":
        "Uploads this daemon has started or is starting are never aborted"); nobody else
        aborts uploads here, so a vanished upload is one tierfs aborted itself."""
        text = modelkit.log_since(self.c.a, self.log_from)
        bad = [ln for ln in text.splitlines() if f"'{self.rel}/" in ln and (
            "vanished" in ln or ("aborted an unfinished upload" in ln and not self.restarted))]
        assert not bad, self.why("A's log: its own uploads aborted:\n      " + "\n      ".join(bad))


# TIERFS_MODEL_SKIP=rule,rule: leave rules out (to look past a known failure for the next)
for _name in filter(None, os.environ.get("TIERFS_MODEL_SKIP", "").split(",")):
    setattr(Machine, _name, precondition(lambda self: False)(getattr(Machine, _name)))


class Context:
    """What outlives one sequence: the mounts, the proxy, the bucket, the figures."""

    def __init__(self, mode, mounts, proxy, s3, bucket) -> None:
        self.mode = mode
        self.mounts = mounts
        self.proxy = proxy
        self.s3 = s3
        self.bucket = bucket
        self.examples = 0
        self.steps_total = 0
        self.fresh = 0
        self.seed = None
        extra = ["--writeback"] if mode == "writeback" else []
        self.a = mounts.start(*extra, "--chunk-size", "256K", "--metadata-ttl", f"{TTL_A:g}s",
                              "--drain-timeout", "3s", "--startup-timeout", "3s",
                              cache="cache-a", mnt="mnt-a")
        self.b = mounts.start("--chunk-size", "256K", "--metadata-ttl", f"{TTL_B:g}s",
                              cache="cache-b", mnt="mnt-b", direct=True)


def _shrink_limit() -> None:
    """TIERFS_MODEL_SHRINK_SECONDS (60): stop shrinking sooner than hypothesis's 300 s (each
    shrink step here is a sequence on a real mount, seconds long)."""
    limit = os.environ.get("TIERFS_MODEL_SHRINK_SECONDS", "60")
    if limit:
        from hypothesis.internal.conjecture import engine

        engine.MAX_SHRINKING_SECONDS = int(limit)


def _run(ctx: Context, seed_value: int, examples: int) -> None:
    _shrink_limit()
    ctx.seed = seed_value

    def factory():
        return Machine()

    factory._hypothesis_internal_use_seed = seed_value  # what @seed sets
    Machine.ctx = ctx
    t0 = time.monotonic()
    before = (ctx.examples, ctx.steps_total)
    try:
        run_state_machine_as_test(factory, settings=_settings(examples))
    finally:
        print(f"model test, mode {ctx.mode}, seed {seed_value}: {ctx.examples - before[0]} "
              f"sequences, {ctx.steps_total - before[1]} operations, "
              f"{time.monotonic() - t0:.0f} s")


@pytest.mark.parametrize("mode", ["default", "writeback"])
def test_write_path_matches_the_model(mode, mounts, proxy, s3, bucket):
    ctx = Context(mode, mounts, proxy, s3, bucket)
    fixed = FIXED_SEEDS[mode]
    random_seed = int(os.environ.get("TIERFS_MODEL_SEED") or random.randrange(1 << 31))
    print(f"model test, mode {mode}: fixed seed {fixed}, random seed {random_seed} "
          f"(TIERFS_MODEL_SEED={random_seed} replays it)")
    _run(ctx, fixed, EXAMPLES or 4)
    _run(ctx, random_seed, EXAMPLES or 3)


# ------------------------------------------------------------------ fixed sequences
# Known bugs of issue 25 that random steps reach only now and then, as given steps of the
# same machine and model: they run in every CI run, whatever the seeds draw.
FIXED = {
    # W1: the checkpoint pattern, the last checkpoint's upload still in flight at the rename
    "W1": [("some_files", {"sa": 1 * KiB, "sb": 1 * KiB}),
           ("checkpoint", {"tmp": "a", "dst": "b", "size": 1 * MiB, "last": 2 * MiB,
                           "fsync": False, "held": True})],
    # W3: v2 of an uploaded file journaled while the store refuses, then unlink (EIO)
    "W3": [("some_files", {"sa": 1 * MiB, "sb": 1 * KiB}),
           ("outage_starts", {"kind": "refuse"}),
           ("write_then_unlink", {"name": "a", "size": 1 * MiB + 4 * KiB})],
    # V1: A's page cache holds the first half, tierfs's chunks evicted, boto3 overwrites,
    # one read() within the TTL
    "V1": [("some_files", {"sa": 16 * MiB, "sb": 1 * KiB}),
           ("reread_after_other_writer", {"name": "a", "size": 16 * MiB, "evict": True,
                                          "via": "boto3", "keep": 8 * MiB})],
}


def run_fixed(ctx: Context, steps: list[tuple[str, dict]]) -> None:
    """One sequence of given steps through Machine, as hypothesis runs one: the invariant
    after each step, the final checks at the end."""
    Machine.ctx = ctx
    m = Machine()
    try:
        for name, args in steps:
            rule_ = getattr(getattr(Machine, name), RULE_MARKER, None)
            # a step hypothesis could not draw here would test nothing the model promises
            assert rule_ is None or all(p(m) for p in rule_.preconditions), \
                f"fixed sequence: {name} is not allowed at this point"
            getattr(m, name)(**args)
            m.listing()
    except BaseException:
        # the step's failure is the report: no final checks on top of it
        ctx.proxy.heal()
        raise
    m.teardown()
    print("\n  ".join(["the sequence:", *m.trace]))


@pytest.mark.parametrize("mode,seq", [("writeback", "W1"), ("writeback", "W3"),
                                      ("default", "W3"),
                                      ("default", "V1"), ("writeback", "V1")])
def test_fixed_sequence(mode, seq, mounts, proxy, s3, bucket):
    t0 = time.monotonic()
    ctx = Context(mode, mounts, proxy, s3, bucket)
    ctx.seed = f"none (fixed sequence {seq})"
    run_fixed(ctx, FIXED[seq])
    print(f"fixed sequence {seq}, mode {mode}: {time.monotonic() - t0:.0f} s")
