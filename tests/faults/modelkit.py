"""Helpers of the write-path model test (test_model_writes.py).

    data = modelkit.stamped(vid=7, off=0, size=600 * KiB)  # every 4 KiB block names its version
    modelkit.blocks(got, {"v1": old, "v2": new})           # "[0,2) v1 [2,150) v2" when mixed
    modelkit.status(m)                                    # the daemon's `tierfs status` as a dict
    modelkit.drain(m)                                     # wait until no upload is pending

Payloads are stamped so that a read which mixes two versions says so: each 4 KiB block of
the file (by absolute offset) repeats a 16-byte header naming the write that made it and the
block's number, so the diff of a wrong read names the versions its blocks came from.
"""

from __future__ import annotations

import os
import time

from tierfs.cli.ctl import TierfsMount, request

BLOCK = 4096


def _block(vid: int, no: int) -> bytes:
    head = b"<v%06d b%06d> " % (vid % 1_000_000, no % 1_000_000)
    return (head * (BLOCK // len(head) + 1))[:BLOCK]


def stamped(vid: int, off: int, size: int) -> bytes:
    """The bytes write number `vid` puts at [off, off+size): block by block of the file."""
    if size <= 0:
        return b""
    first, last = off // BLOCK, (off + size - 1) // BLOCK
    raw = b"".join(_block(vid, n) for n in range(first, last + 1))
    start = off - first * BLOCK
    return raw[start:start + size]


def short(data: bytes | None) -> str:
    if data is None:
        return "<absent>"
    return f"<{len(data)} bytes, first block {data[:16]!r}>"


def blocks(got: bytes | None, candidates: dict[str, bytes | None]) -> str:
    """Which candidate each 4 KiB block of `got` equals, as runs: "[0,3) old [3,9) ?"."""
    if got is None:
        return "<absent>"
    runs: list[list] = []
    for no in range((len(got) + BLOCK - 1) // BLOCK):
        piece = got[no * BLOCK:(no + 1) * BLOCK]
        label = next((name for name, c in candidates.items()
                      if c is not None and c[no * BLOCK:(no + 1) * BLOCK] == piece), "?")
        if runs and runs[-1][2] == label:
            runs[-1][1] = no + 1
        else:
            runs.append([no, no + 1, label])
    body = " ".join(f"[{a},{b}) {lbl}" for a, b, lbl in runs) or "(empty)"
    return f"{len(got)} bytes, blocks: {body}"


# ------------------------------------------------------------------ the daemon
def _mount(m) -> TierfsMount:
    return TierfsMount(m.mountpoint, 0)


def status(m) -> dict:
    """`tierfs status --json` of mount m (through its control socket)."""
    return request(_mount(m), "status")


def evict(m, rel: str) -> dict:
    """`tierfs evict` of one path relative to the mount's root."""
    return request(_mount(m), "evict", paths=[rel])


def drain(m, timeout: float, open_files: int = 0) -> None:
    """Wait until m has no upload pending (write-back, or a default-mode close that failed)
    but those of the `open_files` files still open for writing (the daemon may count them)."""
    deadline = time.monotonic() + timeout
    while True:
        st = status(m)
        if st["uploads_pending"] <= open_files:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{m.mountpoint}: {st['uploads_pending']} uploads still pending "
                                 f"after {timeout:.0f}s (the store answers)")
        time.sleep(0.1)


def wait_up(m, timeout: float) -> None:
    """Wait until m left degraded mode (its HeadBucket every 3 s saw the store again)."""
    deadline = time.monotonic() + timeout
    while not status(m)["backend_up"]:
        if time.monotonic() > deadline:
            raise AssertionError(f"{m.mountpoint}: still degraded {timeout:.0f}s after the "
                                 f"store answers again")
        time.sleep(0.1)


def log_size(m) -> int:
    try:
        return os.path.getsize(m.log_path)
    except FileNotFoundError:
        return 0


def log_since(m, offset: int) -> str:
    try:
        with open(m.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
