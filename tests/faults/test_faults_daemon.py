"""No silent death (issue 9, row D4): a daemon started without --foreground logs to
CACHE_DIR/tierfs.log; whatever ends it - a backend fault in any path, a native crash - the
log says why."""

from __future__ import annotations

import os
import signal
import time

import fkit
from fkit import MiB


def _bg(rgw, proxy, bucket, tmp_path, *extra):
    bg = fkit.BackgroundMount(fkit.ThroughProxy(rgw, proxy), f"s3://{bucket}", tmp_path / "mnt",
                              tmp_path / "cache", extra)
    assert bg.result.returncode == 0, f"tierfs mount failed: {bg.result.stderr}"
    return bg


def test_d4_backend_faults_in_the_background_are_never_silent(rgw, proxy, bucket, s3, tmp_path):
    """D4 with D1's fault: every GET reset mid-body, daemon in the background. It must live;
    had it died, tierfs.log must hold the reason (a traceback or a fatal error)."""
    s3.put_object(Bucket=bucket, Key="d4/a.bin", Body=fkit.payload("d4", 3 * MiB))
    bg = _bg(rgw, proxy, bucket, tmp_path, "--chunk-size", "1M")  # read-ahead GETs fail too
    try:
        proxy.inject("reset", "GET")
        fkit.read_errno(bg.path / "d4/a.bin")
        time.sleep(1.0)
        if not (bg.alive() and fkit.is_mounted(bg.mountpoint)):
            deadline = time.monotonic() + 30  # it is ending: let it finish its log
            while bg.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            log = bg.log_text()
            assert "Traceback" in log or "Fatal Python error" in log or " CRITICAL " in log, (
                "the background daemon died and tierfs.log does not say why:\n" + fkit.tail(log))
        log = bg.log_text()
        assert bg.alive(), "the background daemon died of a reset GET; log:\n" + fkit.tail(log)
        assert fkit.is_mounted(bg.mountpoint), "the mount is gone; log:\n" + fkit.tail(log)
    finally:
        proxy.heal()
        bg.stop()


def test_d4_a_native_crash_is_in_tierfs_log(rgw, proxy, bucket, tmp_path):
    """D4: a native crash of the background daemon (SIGBUS, as a damaged LMDB file causes)
    leaves faulthandler's report in tierfs.log, not on a /dev/null stderr."""
    bg = _bg(rgw, proxy, bucket, tmp_path)
    try:
        assert bg.alive()
        os.kill(bg.pid, signal.SIGBUS)
        deadline = time.monotonic() + 30
        while bg.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not bg.alive(), "SIGBUS did not end the daemon"
        log = bg.log_text()
        assert "Fatal Python error" in log and "Bus error" in log, (
            "no faulthandler report in tierfs.log:\n" + fkit.tail(log))
    finally:
        bg.stop()


def test_m5_a_mount_after_kill_9_removes_the_dead_mount_and_serves_the_cache(
        rgw, proxy, bucket, s3, tmp_path):
    """Issue 26, M5: after kill -9 the kernel keeps a dead FUSE mount on the mount point
    (a stat() may still succeed from its cache). `tierfs mount` there removes it, says
    so, and serves the cache dir again; a mount point that holds a live mount is refused."""
    data = fkit.payload("m5", 2 * MiB)
    s3.put_object(Bucket=bucket, Key="m5/a.bin", Body=data)
    bg = _bg(rgw, proxy, bucket, tmp_path)
    try:
        assert fkit.read(bg.path / "m5/a.bin") == data
        again = fkit.BackgroundMount(fkit.ThroughProxy(rgw, proxy), f"s3://{bucket}",
                                     tmp_path / "mnt", tmp_path / "cache2")
        assert again.result.returncode != 0 and "already mounted" in again.result.stderr
        # the chunk index is written at most a second behind the reads (architecture.md,
        # decision 4): a kill within that second would cost the cached chunk, not the test's
        time.sleep(2.5)
        os.kill(bg.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while bg.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fkit.is_mounted(bg.mountpoint), "kill -9 left no dead mount to test with"
        proxy.inject("refuse", None)  # served from the cache dir alone
        bg2 = _bg(rgw, proxy, bucket, tmp_path, "-o", "startup_timeout=2s")
        try:
            assert bg2.result.returncode == 0, bg2.result.stderr
            assert "removed the dead tierfs mount" in bg2.log_text() + bg2.result.stderr
            assert fkit.read(bg2.path / "m5/a.bin") == data
        finally:
            proxy.heal()
            bg2.stop()
    finally:
        bg.stop()
