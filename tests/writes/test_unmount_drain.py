"""U3: the unmount of a --writeback mount says what it waits for, and with nothing pending
waits for nothing.

Before: after a workload (pjdfstest) with nothing pending the unmount took 28.6 s and
logged nothing of it. The drain is now skipped when no upload is pending, and the log
says what the unmount waited for (pending uploads, and how long) and how long the
shutdown after it took."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import trio
import trio.testing

from tierfs.mount import daemon
class _WriteBack:
    def __init__(self, pending: list[int], drained: bool):
        self._pending = pending
        self.drained = drained
        self.drain_calls = 0

    def pending(self) -> int:
        return self._pending.pop(0) if len(self._pending) > 1 else self._pending[0]

    async def drain(self, timeout_s: float) -> bool:
        self.drain_calls += 1
        await trio.sleep(timeout_s if not self.drained else 1.0)
        return self.drained


def test_nothing_pending_is_no_wait_and_a_wait_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="tierfs.mount.daemon")

    async def run(wb):
        await daemon._drain(wb, 60.0)
        return trio.current_time()

    idle = _WriteBack([0], drained=True)
    assert trio.run(run, idle, clock=trio.testing.MockClock(autojump_threshold=0)) == 0
    assert idle.drain_calls == 0
    assert "unmount: no pending uploads, nothing to wait for" in caplog.text

    busy = _WriteBack([3], drained=True)
    trio.run(run, busy, clock=trio.testing.MockClock(autojump_threshold=0))
    assert busy.drain_calls == 1
    assert "unmount: waiting up to 60s for 3 pending uploads" in caplog.text
    assert "unmount: 3 pending uploads done in 1.0s" in caplog.text

    stuck = _WriteBack([3, 2], drained=False)
    trio.run(run, stuck, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "unsaved files remain (2 of 3 after 60.0s)" in caplog.text


def _pending(mountpoint: str) -> int:
    r = subprocess.run([sys.executable, "-m", "tierfs", "status", mountpoint, "--json"],
                       capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout)["uploads_pending"]


def test_unmount_after_small_file_churn_logs_what_it_waited_for(mounts):
    m = mounts.start("--writeback", cache="cache", mnt="mnt")
    d = m.path / "d"
    d.mkdir()
    for i in range(60):
        p = d / f"f{i}"
        p.write_bytes(os.urandom(1000))
        p.rename(d / f"r{i}")
        if i % 2 == 0:
            (d / f"r{i}").unlink()
    deadline = time.monotonic() + 120
    while _pending(m.mountpoint) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pending(m.mountpoint) == 0
    assert m.stop() == 0
    log = m.log_text()
    assert "unmount: no pending uploads, nothing to wait for" in log
    assert "stopped: background tasks ended, index and usage flushed in " in log
