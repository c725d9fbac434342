"""Helpers of the POSIX metadata suite (tests/posix/, issue 11, spec in docs/semantics.md).

    import posixkit as px
    r = px.as_user([["creat", str(p), 0o644], ["lstat", str(p)]])   # as nobody, one process
    assert r[0] == px.OK and r[1]["ok"]["uid"] == 65534
    px.expect_err(lambda: os.mkdir(p), errno.ENAMETOOLONG)
    px.utimensat(p, "now", "omit")                                   # UTIME_NOW / UTIME_OMIT

Times: set old times first (px.age), so that a change to "now" shows without sleeping;
ctime cannot be set, so px.after_ctimes() waits (a few ms at most) until the clock is past
every ctime the test will compare against, then returns t0 for "now" checks.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from as_user import stat_dict, utimensat  # noqa: F401 - re-exported for the tests

HERE = Path(__file__).resolve().parent
AS_USER = str(HERE / "as_user.py")

NOBODY = 65534  # uid of `nobody` and gid of `nogroup`
OK = {"ok": None}

# the two write modes of `tierfs mount`, as extra CLI arguments (every mount of this suite
# also gets --allow-other so the second user can reach it)
MODES: dict[str, list[str]] = {"default": [], "writeback": ["--writeback"]}

# times set before an operation, so a change to "now" is visible without a sleep
OLD_ATIME_NS = 1_000_000_000_123_456_789
OLD_MTIME_NS = 1_000_000_100_987_654_321

# how far a "now" time may lie outside [t0, t1] (the daemon and this process read the same
# CLOCK_REALTIME; this covers a daemon that keeps microseconds or rounds through a float)
SLACK_NS = 1_000_000
# UTIME_NOW: FUSE passes the kernel's current_time(), a coarse clock up to one tick (10 ms
# at HZ=100) behind CLOCK_REALTIME; the daemon cannot tell it from an explicit time
COARSE_NS = 20_000_000
# ctimes compared as "unchanged"/"now" are at least this far before t0 (so a ctime that did
# not move cannot pass as "now")
GAP_NS = 3 * SLACK_NS

MAX_NAME = 255
MAX_KEY = 1024


def as_user(ops: list, *, uid: int = NOBODY, gid: int = NOBODY, groups=(), umask: int = 0o022
            ) -> list[dict]:
    """Run `ops` (see as_user.py's OPS) in one child process as uid/gid with only `groups`;
    returns one {"ok": value} / {"err": "ENAME"} per operation."""
    req = {"uid": uid, "gid": gid, "groups": list(groups), "umask": umask,
           "ops": [[str(a) if isinstance(a, Path) else a for a in op] for op in ops]}
    # -S -I: no site-packages, a faster start (the child needs the stdlib only)
    r = subprocess.run([sys.executable, "-S", "-I", AS_USER], input=json.dumps(req),
                       capture_output=True, text=True, timeout=60, cwd="/")
    if r.returncode != 0:
        raise AssertionError(f"as_user failed (rc={r.returncode}): {r.stderr.strip()}")
    out = json.loads(r.stdout)
    assert len(out) == len(ops)
    return out


def err_name(fn: Callable[[], object]) -> str | None:
    """Call fn; None if it returned, else the errno name of the OSError it raised."""
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    return None


def expect_err(fn: Callable[[], object], code: int, what: str = "") -> None:
    got = err_name(fn)
    want = errno.errorcode[code]
    assert got == want, f"{what}: expected {want}, got {got or 'success'}"


# ------------------------------------------------------------------ the bucket
BUCKET_LAG = 30.0  # --writeback: the bucket may follow a moment later


def head(client, bucket: str, key: str) -> dict | None:
    """HEAD of the object (ContentLength, Metadata, ...), or None if there is none."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise


def eventually(check: Callable[[], object], timeout: float = BUCKET_LAG) -> None:
    """Call `check` until it does not raise AssertionError, for up to `timeout` s (only where
    the spec lets the bucket lag; a bounded wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


# ------------------------------------------------------------------ nodes
def creat(path, mode: int = 0o644, data: bytes = b"") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        if data:
            os.write(fd, data)
    finally:
        os.close(fd)


def bind_socket(path) -> None:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(os.fspath(path))
    finally:
        s.close()


def fmt_mode(mode: int) -> str:
    return f"{stat.filemode(mode)} ({mode:o})"


# ------------------------------------------------------------------ times
def age(*paths) -> None:
    """Set atime/mtime of each path (not following symlinks) to the OLD values."""
    for p in paths:
        os.utime(p, ns=(OLD_ATIME_NS, OLD_MTIME_NS), follow_symlinks=False)


def after_ctimes(*paths) -> int:
    """Wait until the clock is GAP_NS past the ctime of every existing path, then return the
    time (t0) an operation starts at. A bounded wait of a few milliseconds, not a timing
    assertion."""
    latest = 0
    for p in paths:
        try:
            latest = max(latest, os.lstat(p).st_ctime_ns)
        except FileNotFoundError:
            pass
    while True:
        now = time.time_ns()
        # a ctime in the future (a daemon bug) is not waited for: the checks will show it
        if now >= latest + GAP_NS or latest - now > 1_000_000_000:
            return now
        time.sleep((latest + GAP_NS - now) / 1e9)


def is_now(ns: int, t0: int, t1: int) -> bool:
    return t0 - SLACK_NS <= ns <= t1 + SLACK_NS


def fmt_ns(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


# ------------------------------------------------------------------ paths
def key_of(path, root) -> str:
    """The object key of `path` on a mount of s3://BUCKET (no prefix) at `root`."""
    return os.path.relpath(path, root)


def deep_dir(base: Path, root: Path, key_len: int) -> Path:
    """mkdir a chain of directories under `base` (components of at most 200 bytes) so that
    the key of the deepest one, without its trailing slash, is exactly `key_len` bytes;
    returns it."""
    need = key_len - len(key_of(base, root))  # bytes of "/name" parts still to add
    if need < 2:
        raise ValueError("base is too long for key_len")
    parts = []
    while need > 201:
        take = 200 if need - 201 != 1 else 199  # never leave a single byte (a bare "/")
        parts.append("d" * take)
        need -= take + 1
    parts.append("e" * (need - 1))
    cur = base
    for name in parts:
        cur = cur / name
        os.mkdir(cur)
    assert len(key_of(cur, root).encode()) == key_len
    return cur
