"""Helpers of the fault tests (tests/faults/): tierfs mounts through the fault proxy.

    m = mounts.start("--writeback")             # foreground mount via the proxy (conftest)
    assert fkit.read(m.path / "a.bin") == data   # page cache dropped first
    fkit.assert_alive(m)                         # the daemon runs and the mount answers
    bg = fkit.BackgroundMount(...)               # `tierfs mount` without --foreground

Every mount gets short backend timeouts (FAST) so a fault costs seconds, not minutes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for _p in (_TESTS, os.path.join(_TESTS, "fuse")):
    if _p not in sys.path:
        sys.path.append(_p)

from helpers import drop_page_cache  # noqa: E402
from mounting import (  # noqa: E402,F401 - ThroughProxy, tail: for the tests
    ThroughProxy, free_port, is_mounted, pid_alive, stop_pid, tail)
from rgw import s3_env  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20

# a failed backend request costs at most ~2 attempts x 2 s (+ botocore's backoff)
FAST = ["-o", "backend_timeout=2s,backend_retries=2"]

# how long the bucket may lag behind the mount where the spec allows it (write-back uploads
# after the store came back: the uploader's backoff, recovery after a remount)
BUCKET_LAG = 60.0


def payload(seed: int | str, size: int) -> bytes:
    """Deterministic pseudo-random bytes (incompressible, distinct per seed)."""
    return random.Random(seed).randbytes(size)


def sha(data: bytes | None) -> str:
    return "<absent>" if data is None else hashlib.sha256(data).hexdigest()


def short(data: bytes | None) -> str:
    return "<absent>" if data is None else f"<{len(data)} bytes sha256={sha(data)[:12]}>"


def read(path: os.PathLike | str) -> bytes:
    """The file's bytes as tierfs serves them now (its pages dropped from the page cache)."""
    drop_page_cache(path)
    with open(path, "rb") as f:
        return f.read()


def read_errno(path: os.PathLike | str) -> tuple[bytes | None, int | None]:
    """(bytes, None) or (None, errno) of reading the whole file."""
    try:
        return read(path), None
    except OSError as e:
        return None, e.errno


def write_file(path: os.PathLike | str, data: bytes, *, fsync: bool = False,
               piece: int = MiB) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        off = 0
        while off < len(data):
            off += os.write(fd, view[off:off + piece])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def alive(m) -> bool:
    return m.alive() and is_mounted(m.mountpoint)


def assert_alive(m, what: str = "") -> None:
    assert m.alive(), (f"the daemon died{' ' + what if what else ''} (exit "
                       f"{m.proc.poll()}); log tail:\n{tail(m.log_text())}")
    assert is_mounted(m.mountpoint), f"{m.mountpoint} is no longer mounted"
    os.stat(m.mountpoint)  # the mount answers (not ENOTCONN)


def log_lines(text: str, *levels: str) -> list[str]:
    return [ln for ln in text.splitlines() if any(f" {lv} " in ln for lv in levels)]


def eventually(check, timeout: float, interval: float = 0.25, alive_of=None):
    """Call `check` until it returns a true value (or None) without AssertionError, for up
    to `timeout` s; with alive_of=m, fail at once if that daemon died meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        if alive_of is not None:
            assert_alive(alive_of, "while waiting")
        try:
            value = check()
            if value or value is None:
                return value
            last = AssertionError(f"{check} still false after {timeout:.0f}s")
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            raise last
        time.sleep(interval)


# ------------------------------------------------------------------ the bucket
def s3_get(client, bucket: str, key: str) -> bytes | None:
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise


def bucket_differs(client, bucket: str, expected: dict[str, bytes | None]) -> list[str]:
    out = []
    for key, want in expected.items():
        got = s3_get(client, bucket, key)
        if got != want:
            out.append(f"{key}: bucket has {short(got)}, expected {short(want)}")
    return out


def s3_sizes(client, bucket: str, prefix: str = "") -> dict[str, int]:
    """{key: size} of every object under `prefix`."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


def open_uploads(client, bucket: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        keys += [u["Key"] for u in page.get("Uploads", [])]
    return keys


# ------------------------------------------------------------------ mounts
class BackgroundMount:
    """`tierfs mount` as a user runs it: no --foreground, the daemon detaches and logs to
    CACHE_DIR/tierfs.log. Stopped by PID (read from the cache dir's lock file)."""

    def __init__(self, rgw_like, source: str, mountpoint: Path, cache_dir: Path,
                 extra=()) -> None:
        self.path = Path(mountpoint).absolute()
        self.mountpoint = str(self.path)
        self.cache_dir = str(Path(cache_dir).absolute())
        self.path.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(self.cache_dir) / "tierfs.log"
        argv = [sys.executable, "-m", "tierfs", "mount", source, self.mountpoint,
                "--endpoint-url", rgw_like.endpoint, "--cache-dir", self.cache_dir,
                "--metrics-addr", f"127.0.0.1:{free_port()}", *FAST, *extra]
        self.result = subprocess.run(argv, env=s3_env(rgw_like), stdin=subprocess.DEVNULL,
                                     capture_output=True, text=True, timeout=120)
        self.pid: int | None = None
        if self.result.returncode == 0:
            with open(os.path.join(self.cache_dir, "lock")) as f:
                self.pid = int(f.read().strip())

    def alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        if self.alive() and is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", self.mountpoint], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.pid is not None:
            stop_pid(self.pid, 10)
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=30)


def is_eio(err: int | None) -> bool:
    return err == errno.EIO
