"""A store that hangs or is down (issue 9, rows D8, D9): stalls are logged and counted, a
read of uncached data fails with EIO in bounded time, and what is cached keeps being served
- stat, listing, open, read, and a remount of the warm cache dir - until the store answers
again, which the mount notices by itself."""

from __future__ import annotations

import errno
import os
import threading
import time

import fkit
from fkit import KiB, MiB

# backend_timeout=2s, backend_retries=2 (fkit.FAST): a failed GET is ~2 x 2 s plus
# botocore's backoff; the kernel asks again for a failed read (~3 times). The bound is far
# above one failed request and far below what retrying each re-ask from scratch costs.
EIO_BOUND_S = 15.0


def test_d8_a_hung_store_is_logged_and_reads_fail_in_bounded_time(mounts, s3, bucket, proxy):
    data = fkit.payload("d8", 1 * MiB)
    s3.put_object(Bucket=bucket, Key="d8/cold.bin", Body=data)
    m = mounts.start("-o", "stall_warn=1s")
    assert os.stat(m.path / "d8/cold.bin").st_size == len(data)  # looked up while healthy
    proxy.inject("hang", "GET")  # the store stops answering GETs
    t0 = time.monotonic()
    got, err = fkit.read_errno(m.path / "d8/cold.bin")
    elapsed = time.monotonic() - t0
    fkit.assert_alive(m, "during the hang")
    assert err == errno.EIO, f"expected EIO, got {fkit.short(got) if err is None else err}"
    assert elapsed < EIO_BOUND_S, f"EIO after {elapsed:.1f}s (bound {EIO_BOUND_S}s)"
    stalls = [ln for ln in fkit.log_lines(m.log_text(), "WARNING")
              if "d8/cold.bin" in ln and "stall" in ln.lower()]
    assert stalls, "no stall WARNING names the key; log:\n" + fkit.tail(m.log_text())
    assert m.counter("tierfs_backend_stalls_total") >= 1
    proxy.heal()
    fkit.eventually(lambda: fkit.read_errno(m.path / "d8/cold.bin") == (data, None), 30,
                    interval=0.5, alive_of=m)


def _timed(fn, bound: float):
    """fn() in a thread; its result, or AssertionError if it takes longer than `bound`
    (a hung FUSE call cannot be interrupted, so the test must not block on it)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"{fn} still blocked after {bound:.0f}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_d9_cached_data_is_served_while_the_store_is_down(mounts, s3, bucket, proxy):
    cached = {f"d9/c{i}.bin": fkit.payload(f"d9.{i}", 256 * KiB + i) for i in range(3)}
    # listed first: after the cached files in listing order, the directory read-ahead
    # would fetch it before the outage
    cold = fkit.payload("d9.cold", 100 * KiB)
    for k, v in {**cached, "d9/0cold.bin": cold}.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    names = sorted(["0cold.bin", *(k.split("/")[1] for k in cached)])
    m = mounts.start("--metadata-ttl", "1s", "-o", "startup_timeout=3s")
    assert sorted(os.listdir(m.path / "d9")) == names
    for k, v in cached.items():
        assert fkit.read(m.path / k) == v, k
    proxy.down()  # connections refused
    time.sleep(1.5)  # past --metadata-ttl: every lookup wants to revalidate
    bound = 30.0
    assert _timed(lambda: sorted(os.listdir(m.path / "d9")), bound) == names
    for k, v in cached.items():
        assert _timed(lambda: os.stat(m.path / k).st_size, bound) == len(v), k
        got = _timed(lambda: fkit.read_errno(m.path / k), bound)
        assert got == (v, None), f"{k}: {fkit.short(got[0])} errno {got[1]}"
    got, err = _timed(lambda: fkit.read_errno(m.path / "d9/0cold.bin"), bound)
    assert err == errno.EIO, f"uncached data: expected EIO, got {fkit.short(got)} / {err}"
    fkit.assert_alive(m, "with the store down")

    # a remount of the warm cache dir while the store does not answer at all
    m.stop()
    proxy.up()
    proxy.inject("hang", None, seconds=None)
    m = mounts.again(m, timeout=60)
    for k, v in cached.items():
        got = _timed(lambda: fkit.read_errno(m.path / k), bound)
        assert got == (v, None), f"{k} after a remount: {fkit.short(got[0])} errno {got[1]}"
    assert _timed(lambda: sorted(os.listdir(m.path / "d9")), bound) == names
    fkit.assert_alive(m, "remounted with the store hung")

    # the store answers again: the mount recovers by itself
    proxy.heal()
    fkit.eventually(lambda: fkit.read_errno(m.path / "d9/0cold.bin") == (cold, None), 60,
                    interval=0.5, alive_of=m)


def test_m4_a_hanging_store_does_not_hold_stat_of_a_cached_file(mounts, s3, bucket, proxy):
    """Issue 26, M4: past the TTL, stat/open/readdir of known entries wait at most
    --revalidate-timeout for a store that hangs (no refusal, no answer), then serve the
    cached entry while the revalidation goes on in the background. The backend timeout
    here is far longer than the test's bound: an answer before it is the deadline's."""
    data = fkit.payload("m4", 300 * KiB)
    s3.put_object(Bucket=bucket, Key="m4/f.bin", Body=data)
    m = mounts.start("--metadata-ttl", "1s", "--revalidate-timeout", "1s",
                     "-o", "backend_timeout=120s,stall_warn=120s")
    assert fkit.read(m.path / "m4/f.bin") == data
    assert os.listdir(m.path / "m4") == ["f.bin"]
    proxy.inject("hang", {"LIST", "HEAD"})  # metadata requests never answered
    time.sleep(1.5)  # past --metadata-ttl
    bound = 30.0  # far below the 120 s a hung request takes to fail
    assert _timed(lambda: os.stat(m.path / "m4/f.bin").st_size, bound) == len(data)
    assert _timed(lambda: os.listdir(m.path / "m4"), bound) == ["f.bin"]
    assert _timed(lambda: fkit.read_errno(m.path / "m4/f.bin"), bound) == (data, None)
    time.sleep(1.5)
    assert _timed(lambda: os.stat(m.path / "m4/f.bin").st_size, bound) == len(data)
    assert "no answer within --revalidate-timeout" in m.log_text()
    fkit.assert_alive(m, "with metadata requests hung")
    # a new version while the store hangs is seen once it answers again
    proxy.heal()
    new = fkit.payload("m4.new", 100 * KiB)
    s3.put_object(Bucket=bucket, Key="m4/f.bin", Body=new)
    fkit.eventually(lambda: fkit.read_errno(m.path / "m4/f.bin") == (new, None), 60,
                    interval=0.5, alive_of=m)
