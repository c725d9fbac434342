"""Read stalls on a real mount (tierfs/telemetry/stalls.py, issue 15): the store is slowed for one key
by the fault proxy (a delay before each GET of it is forwarded); the read of that key is a
stall of its tenant, with the right key and source, in tierfs_read_stall_seconds, in the
stall log of `tierfs status --json`, and in `tierfs usage`'s stall seconds.

The delay is a lower bound of the wait, so the assertions hold however slow the box is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tierfs.telemetry.callers import Callers

pytestmark = pytest.mark.mount

DELAY_S = 1.0
SIZE = 300_000  # one chunk


def tierfs(*argv: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "tierfs", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_slow_store_makes_a_stall_with_its_key_source_and_tenant(s3, bucket, proxy, mounts):
    slow, fast = os.urandom(SIZE), os.urandom(5000)
    s3.put_object(Bucket=bucket, Key="slow/model.bin", Body=slow)
    s3.put_object(Bucket=bucket, Key="fast.bin", Body=fast)
    m = mounts.start("-o", 'tenants={slow = {prefixes = ["slow/"]}}')
    proxy.inject("delay", "GET", key="slow/model.bin", seconds=DELAY_S)

    assert (m.path / "slow/model.bin").read_bytes() == slow
    assert (m.path / "fast.bin").read_bytes() == fast
    assert proxy.injected("delay", op="GET") >= 1
    me = Callers().reader(os.getpid(), os.getuid())

    st = tierfs("status", m.mountpoint, "--json")["stalls"]
    assert st["threshold_s"] == 0.05  # the default
    mine = [s for s in st["slowest"] if s["key"] == "slow/model.bin"]
    assert mine and st["slowest"][0]["key"] == "slow/model.bin"
    assert {(s["source"], s["tenant"], s["reader"]) for s in mine} == {("backend", "slow", me)}
    assert mine[0]["wait_s"] >= DELAY_S and mine[0]["offset"] == 0
    assert st["total"] >= len(mine) and st["by_source"]["backend"] >= len(mine)

    metrics = m.metrics()
    count = metrics[("tierfs_read_stall_seconds_count", frozenset({("tenant", "slow")}))]
    total = metrics[("tierfs_read_stall_seconds_sum", frozenset({("tenant", "slow")}))]
    assert count == len(mine) and total >= DELAY_S
    assert m.counter("tierfs_read_seconds_count", source="backend") >= 1

    rows = {r["name"]: r for r in tierfs("usage", m.mountpoint, "--json")["rows"]}
    assert abs(rows["slow"]["stall_s"] - total) < 0.01  # rounded to ms in the answer
    assert sum(rows["slow"]["read"].values()) == SIZE
    assert sum(rows["default"]["read"].values()) == len(fast)
