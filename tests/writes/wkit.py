"""Helpers for the write tests on a real mount (tests/writes/).

    import wkit
    data = wkit.payload("seed", 3 * wkit.MiB)
    wkit.write_file(m.path / "a.bin", data, fsync=True)
    assert wkit.s3_get(s3, bucket, "a.bin") == data
    wkit.eventually(lambda: wkit.s3_get(s3, bucket, "a.bin") == data)   # poll, 30 s

Also the crash-test writer, run as a separate process so that a SIGKILLed daemon cannot
take the test process down with it:

    python wkit.py crash-writer PLAN.json ACKLOG     (the mount's root open as PLAN's root_fd)

It writes the files of the plan in order and appends one line per acknowledgement to
ACKLOG (each line fsynced on the local disk): "FSYNC <key> <sha>" after fsync() returned,
"CLOSE <key> <sha>" after close() returned, "ERR <key> <errno>" when a call failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import stat
import sys
import time
from pathlib import Path
from typing import Callable

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:  # also when run as a script (the crash writer)
    sys.path.append(_TESTS)

sys.path.append(os.path.join(_TESTS, "fuse"))
from helpers import drop_page_cache, read_uncached  # noqa: E402,F401 - shared page-cache helpers

MiB = 1 << 20
KiB = 1 << 10

# the two write modes of `tierfs mount`, as extra CLI arguments
MODES: dict[str, list[str]] = {"default": [], "writeback": ["--writeback"]}

# how long the bucket may lag behind the mount where the spec allows it (write-back uploads,
# recovery after a remount)
BUCKET_LAG = 30.0


# ------------------------------------------------------------------ data
def payload(seed: int | str, size: int) -> bytes:
    """Deterministic pseudo-random bytes (incompressible, distinct per seed)."""
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def short(data: bytes | None) -> str:
    """A readable description of a content for assertion messages."""
    if data is None:
        return "<absent>"
    return f"<{len(data)} bytes sha256={sha(data)[:12]}>"


def write_file(path: os.PathLike | str, data: bytes, *, fsync: bool = False,
               flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC, piece: int = MiB) -> None:
    """Write `data` to `path` in `piece`-sized write() calls, optionally fsync, then close."""
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        off = 0
        while off < len(data):
            off += os.write(fd, view[off:off + piece])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def apply_write(model: bytearray, offset: int, data: bytes) -> None:
    """What pwrite(fd, data, offset) does to a file's bytes (a hole reads as zeros; an
    empty write changes nothing)."""
    if not data:
        return
    if offset > len(model):
        model.extend(b"\0" * (offset - len(model)))
    model[offset:offset + len(data)] = data


def apply_truncate(model: bytearray, size: int) -> None:
    if size < len(model):
        del model[size:]
    else:
        model.extend(b"\0" * (size - len(model)))


# ------------------------------------------------------------------ the bucket
def s3_get(client, bucket: str, key: str) -> bytes | None:
    """The object's bytes, or None if there is no such key."""
    from botocore.exceptions import ClientError

    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise


def s3_keys(client, bucket: str, prefix: str = "") -> dict[str, int]:
    """{key: size} of every object under `prefix`."""
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


def s3_files(client, bucket: str, prefix: str = "") -> dict[str, bytes]:
    """{key: bytes} of every object under `prefix` that is not a directory marker."""
    return {k: s3_get(client, bucket, k) for k in s3_keys(client, bucket, prefix)
            if not k.endswith("/")}


def open_uploads(client, bucket: str) -> list[str]:
    """Keys of unfinished multipart uploads."""
    keys = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        keys += [u["Key"] for u in page.get("Uploads", [])]
    return keys


@contextlib.contextmanager
def puts_denied(client, bucket: str):
    """A bucket policy that denies every upload (PutObject covers CopyObject and the
    multipart calls) while reads keep working: a backend that cannot drain dirty data."""
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": ["s3:PutObject"],
        "Resource": [f"arn:aws:s3:::{bucket}/*"]}]}
    client.put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))
    try:
        yield
    finally:
        client.delete_bucket_policy(Bucket=bucket)


# ------------------------------------------------------------------ waiting
def eventually(check: Callable[[], object], timeout: float = BUCKET_LAG,
               interval: float = 0.25) -> object:
    """Call `check` until it neither raises AssertionError nor returns a false value, for
    up to `timeout` seconds; then raise the last AssertionError (or assert the value).
    Used only where the spec lets the bucket lag (write-back, recovery): never a timing
    assertion, just a bounded wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value or value is None:
                return value
            last: AssertionError = AssertionError(f"{check} still false after {timeout}s")
        except AssertionError as e:
            last = e
        if time.monotonic() > deadline:
            raise last
        time.sleep(interval)


def assert_bucket_has(client, bucket: str, expected: dict[str, bytes | None],
                      timeout: float = 0.0) -> None:
    """Every key of `expected` holds exactly those bytes (None: the key is absent);
    with timeout > 0, polled for that long."""

    def check() -> None:
        bad = []
        for key, want in expected.items():
            got = s3_get(client, bucket, key)
            if got != want:
                bad.append(f"{key}: bucket has {short(got)}, expected {short(want)}")
        assert not bad, "bucket differs:\n  " + "\n  ".join(bad)

    if timeout > 0:
        eventually(check, timeout)
    else:
        check()


# ------------------------------------------------------------------ the cache dir
def disk_usage(path: os.PathLike | str, skip: tuple[str, ...] = ("index",)) -> int:
    """Allocated bytes (st_blocks) of the files under `path`, except the top-level entries
    named in `skip` and log files."""
    total = 0
    root = Path(path)
    if not root.exists():
        return 0
    for entry in root.iterdir():
        if entry.name in skip or entry.name.endswith(".log"):
            continue
        paths = [entry] if not entry.is_dir() else [p for p in entry.rglob("*")]
        for p in paths:
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def log_lines(m, *levels: str) -> list[str]:
    return [ln for ln in m.log_text().splitlines() if any(f" {lv} " in ln for lv in levels)]


# ------------------------------------------------------------------ crash writer
def crash_plan(rnd: random.Random, trial: int) -> list[dict]:
    """Files one crash trial writes: a 10-20 MiB file (multipart), three small files and a
    new version of a shared checkpoint that every trial overwrites. fsync on some; for the
    big file sometimes also an fsync half-way ("split"), then more writes to the same fd."""
    big = rnd.randrange(10 * MiB, 20 * MiB)
    files = [{"key": f"t{trial:02}/big.bin", "seed": f"big{trial}", "size": big,
              "fsync": rnd.random() < 0.5,
              "split": rnd.randrange(1, big) if rnd.random() < 0.5 else None}]
    for j in range(3):
        files.append({"key": f"t{trial:02}/s{j}.bin", "seed": f"s{trial}.{j}",
                      "size": rnd.choice([0, 1, 4096, rnd.randrange(200 * KiB)]),
                      "fsync": rnd.random() < 0.5, "split": None})
    files.append({"key": "shared/ckpt.bin", "seed": f"ckpt{trial}",
                  "size": rnd.randrange(1 * MiB, 12 * MiB), "fsync": rnd.random() < 0.5,
                  "split": None})
    rnd.shuffle(files)
    return files


def crash_versions(f: dict) -> list[bytes]:
    """The complete contents a plan entry gives its key, in order: with a split, the first
    part (fsynced, hence acknowledged) and then the whole."""
    data = payload(f["seed"], f["size"])
    return [data[:f["split"]], data] if f.get("split") else [data]


def run_crash_writer(root_fd: int, plan: list[dict], acklog: str) -> None:
    """Write the plan's files under the directory open as `root_fd` (the mount's root,
    opened by the test before the daemon can be killed: once the dead mount is detached,
    calls through this fd fail instead of landing in the bare mountpoint directory)."""
    ack = os.open(acklog, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(*words: object) -> None:
        os.write(ack, (" ".join(map(str, words)) + "\n").encode())
        os.fsync(ack)

    note("START")
    for f in plan:
        data = payload(f["seed"], f["size"])
        digest = sha(data)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(f["key"]), dir_fd=root_fd)
            fd = os.open(f["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=root_fd)
        except OSError as e:
            note("ERR", f["key"], e.errno)
            return
        try:
            view = memoryview(data)
            off = 0
            split = f.get("split")
            while off < len(data):
                end = min(off + MiB, len(data), split if split and off < split else len(data))
                off += os.write(fd, view[off:end])
                if split and off == split:
                    os.fsync(fd)
                    note("FSYNC", f["key"], sha(data[:split]))
            if f["fsync"]:
                os.fsync(fd)
                note("FSYNC", f["key"], digest)
        except OSError as e:
            note("ERR", f["key"], e.errno)
            with contextlib.suppress(OSError):
                os.close(fd)
            return
        try:
            os.close(fd)
        except OSError as e:
            note("ERR", f["key"], e.errno)
            return
        note("CLOSE", f["key"], digest)
    note("DONE")


def read_acklog(path: str) -> list[list[str]]:
    try:
        with open(path) as fh:
            return [ln.split() for ln in fh if ln.strip()]
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "crash-writer":
        spec = json.loads(Path(sys.argv[2]).read_text())
        run_crash_writer(spec["root_fd"], spec["plan"], sys.argv[3])
    else:
        sys.exit(f"usage: {sys.argv[0]} crash-writer PLAN.json ACKLOG")

