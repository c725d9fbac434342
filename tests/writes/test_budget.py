"""The cache budget with dirty data: writers past it wait --dirty-wait, then get ENOSPC
(and the log says why); the cache dir stays within the budget; the mount keeps working;
and dirty chunks are never evicted to make room for reads."""

from __future__ import annotations

import errno
import os
import threading

import wkit
from wkit import KiB, MiB

BUDGET = 16 * MiB
CHUNK = 8 * MiB
TIGHT = ("--writeback", "--cache-size", "16M", "--dirty-wait", "2s")


class DuSampler(threading.Thread):
    """Largest allocated size of the cache dir (without its LMDB index) seen while running."""

    def __init__(self, cache_dir: str):
        super().__init__(daemon=True)
        self.cache_dir = cache_dir
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, wkit.disk_usage(self.cache_dir))
            self.done.wait(0.02)

    def finish(self) -> int:
        self.done.set()
        self.join()
        self.peak = max(self.peak, wkit.disk_usage(self.cache_dir))
        return self.peak


def fill_until_enospc(m, name: str = "huge.bin", total: int = 40 * MiB):
    """Write `total` bytes in 1 MiB write() calls to a file that stays open (its data
    cannot be uploaded). Returns (fd, bytes written, the OSError that stopped it or None,
    peak disk usage of the cache dir)."""
    du = DuSampler(m.cache_dir)
    du.start()
    fd = os.open(m.path / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written, error = 0, None
    try:
        while written < total:
            piece = wkit.payload(f"fill{written}", MiB)
            try:
                written += os.write(fd, piece)
            except OSError as e:
                error = e
                break
    finally:
        peak = du.finish()
    return fd, written, error, peak


def test_writes_beyond_the_dirty_budget_fail_with_enospc(mounts):
    m = mounts.start(*TIGHT)
    fd, written, error, _ = fill_until_enospc(m)
    try:
        assert error is not None, f"all {written >> 20} MiB written into a 16 MiB budget"
        assert error.errno == errno.ENOSPC, error
        assert written < 40 * MiB
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def test_enospc_is_logged_with_its_reason(mounts):
    m = mounts.start(*TIGHT)
    fd, written, error, _ = fill_until_enospc(m)
    try:
        assert error is not None and error.errno == errno.ENOSPC, (written, error)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    words = ("dirty", "budget", "cache-size", "cache_size", "free space", "min-free", "ENOSPC")
    lines = [ln for ln in wkit.log_lines(m, "WARNING", "ERROR")
             if any(w.lower() in ln.lower() for w in words)]
    assert lines, "no WARNING/ERROR line explains the ENOSPC; log:\n" + m.log_text()[-3000:]


def test_cache_dir_never_exceeds_the_budget_by_more_than_two_chunks(mounts):
    m = mounts.start(*TIGHT)
    fd, written, error, peak = fill_until_enospc(m)
    try:
        os.close(fd)
    except OSError:
        pass
    assert peak <= BUDGET + 2 * CHUNK, (
        f"cache dir reached {peak / MiB:.1f} MiB (budget 16 MiB, chunk 8 MiB); "
        f"{written >> 20} MiB written, stopped by {error!r}")


def test_the_mount_keeps_working_after_enospc(mounts, s3, bucket):
    m = mounts.start(*TIGHT)
    fd, written, error, _ = fill_until_enospc(m)
    assert error is not None and error.errno == errno.ENOSPC, (written, error)
    try:
        os.close(fd)
    except OSError:
        pass  # the close of a file that hit ENOSPC may report it again
    os.unlink(m.path / "huge.bin")
    small = wkit.payload("after", 100 * KiB)
    wkit.write_file(m.path / "after.bin", small)
    assert wkit.read_uncached(m.path / "after.bin") == small
    wkit.assert_bucket_has(s3, bucket, {"after.bin": small}, timeout=wkit.BUCKET_LAG)
    assert sorted(os.listdir(m.path)) == ["after.bin"]


def test_dirty_chunks_are_never_evicted_under_read_pressure(mounts, s3, bucket):
    reads = {f"read/{i:02}.bin": wkit.payload(f"r{i}", MiB) for i in range(30)}
    for k, v in reads.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    m = mounts.start("--writeback", "--cache-size", "24M", "--chunk-size", "1M",
                     "--memory-cache-size", "0")
    os.listdir(m.path / "read")
    written = {f"out/w{i}.bin": wkit.payload(f"w{i}", 3 * MiB + i) for i in range(4)}
    os.mkdir(m.path / "out")
    with wkit.puts_denied(s3, bucket):
        for k, v in written.items():
            wkit.write_file(m.path / k, v)  # write-back: close returns, the upload fails
        assert m.counter("tierfs_writeback_dirty_bytes") > 0, "uploads were not held back"
        def pressure() -> float:  # chunks evicted, or refused for lack of room
            return (m.counter("tierfs_cache_evictions_total")
                    + m.counter("tierfs_cache_refused_chunks_total"))
        before = pressure()
        for _ in range(2):  # 30 MiB of reads through the 12 MiB the dirty data leaves
            for k, v in reads.items():
                assert wkit.read_uncached(m.path / k) == v, k
        assert pressure() > before, "no eviction pressure"
        for k, v in written.items():  # only the dirty data has these bytes now
            got = wkit.read_uncached(m.path / k)
            assert got == v, f"{k} under read pressure reads {wkit.short(got)}"
    # uploads are allowed again: every written byte reaches the bucket
    # (failed uploads are retried with a growing delay; allow for a few retries)
    wkit.assert_bucket_has(s3, bucket, written, timeout=120)
    for k, v in written.items():
        assert wkit.read_uncached(m.path / k) == v, k
