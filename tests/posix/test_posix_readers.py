"""Readers on a real mount (docs/tenants.md, "Readers"): reads are counted to the uid of the
process that opened the file (the FUSE request's caller), by source, and `tierfs usage`
says so: a cold read comes from the store, a re-read (kernel page cache dropped) from the
cache tiers, and the sums match the mount's own tierfs_read_bytes_total."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from mounting import Mount

from tierfs.telemetry.callers import Callers

import posixkit

pytestmark = pytest.mark.mount

MiB = 1 << 20
SIZE = 3 * MiB + 17  # four 1 MiB chunks
SOURCES = ("memory", "disk", "peer", "backend")


def usage(m: Mount, *args: str) -> dict[str, dict]:
    """`tierfs usage --json` rows by name, each row's bytes read with every source (0 for
    the sources it has not read from)."""
    r = subprocess.run([sys.executable, "-m", "tierfs", "usage", m.mountpoint, "--json", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)["rows"]}
    for row in rows.values():
        row["read"] = {src: row["read"].get(src, 0) for src in SOURCES}
    return rows


def read_as(path, uid: int) -> str:
    [res] = posixkit.as_user([["read", str(path)]], uid=uid, gid=uid)
    return res["ok"]


def drop_pages(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_cached(m: Mount, chunks: int) -> None:
    """Until the fills of the cold read are on disk (they run in the background)."""
    deadline = time.monotonic() + 60
    while True:
        r = subprocess.run([sys.executable, "-m", "tierfs", "status", m.mountpoint, "--json"],
                           capture_output=True, text=True, timeout=60)
        if json.loads(r.stdout)["disk"]["chunks"] >= chunks:
            return
        assert time.monotonic() < deadline, "the chunks never reached the disk tier"
        time.sleep(0.1)


def test_reads_are_counted_to_the_reading_uid_by_source(ms):
    data = os.urandom(SIZE)
    ms.s3.put_object(Bucket=ms.bucket, Key="data/a.bin", Body=data)
    with ms.start("--chunk-size", "1M") as m:
        f = m.path / "data/a.bin"
        nobody = f"uid:{posixkit.NOBODY}"
        assert read_as(f, posixkit.NOBODY).encode("latin-1") == data  # cold
        cold = usage(m, "--by", "uid")[nobody]["read"]
        assert sum(cold.values()) == SIZE and cold["backend"] > 0
        assert cold["peer"] == 0 and cold["disk"] == 0  # nothing was cached before

        wait_cached(m, 4)
        drop_pages(f)
        assert read_as(f, posixkit.NOBODY).encode("latin-1") == data  # from the cache
        again = usage(m, "--by", "uid")[nobody]["read"]
        assert again["backend"] == cold["backend"]  # not one byte more from the store
        assert (again["memory"] + again["disk"]) - (cold["memory"] + cold["disk"]) == SIZE

        drop_pages(f)
        me = Callers().reader(os.getpid(), os.getuid())  # root here: uid:0
        assert f.read_bytes() == data
        mine = usage(m, "--reader", me)[me]["read"]
        assert sum(mine.values()) == SIZE and mine["backend"] == 0

        # the tenants' rows (one: default) add up to the mount's own counters
        tenant = usage(m)["default"]["read"]
        assert sum(tenant.values()) == 3 * SIZE
        for src in SOURCES:
            assert tenant[src] == m.counter("tierfs_read_bytes_total", source=src), src
