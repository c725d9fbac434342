"""The near store failing in every way an object store fails, with the fault proxy
(tests/faults/proxy.py) in front of it: a read never fails and never serves a wrong byte
because of it; it reads from the source instead (docs/tiers.md, "Failure modes")."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "faults"))
from proxy import FaultProxy  # noqa: E402
from test_near_store import MiB, _copied, _etag, _read, _wait  # noqa: E402


@pytest.fixture
def near_proxy(near_rgw):
    p = FaultProxy(near_rgw.endpoint).start()
    try:
        yield p
    finally:
        p.stop()


def _mount(mounts, near, near_proxy, *, cache: str, mnt: str, extra=()):
    args = [*near.args]
    args[args.index("--tier-endpoint-url") + 1] = near_proxy.endpoint
    m = mounts.mount(*args, "--tier-timeout", "2s", *extra, cache=cache, mnt=mnt)
    m.env = near.env(m.env)
    return m.start()


def _copy(mounts, near, near_proxy, bucket, files):
    """The files in the source, then copied to the near store by a first node."""
    for key, data in files.items():
        mounts.s3.put_object(Bucket=bucket, Key=key, Body=data)
    a = _mount(mounts, near, near_proxy, cache="cache-a", mnt="mnt-a")
    for key, data in files.items():
        assert _read(a, key) == data
        _wait(lambda k=key: _copied(near, k, _etag(mounts.s3, bucket, k)), what=f"copy of {key}")
    a.stop()


FAULTS = [("503", {}), ("500", {}), ("reset", {}), ("close", {}), ("flip", {"bits": 3}),
          ("hang", {"seconds": 30, "then": "close"})]


def test_a_failing_near_get_is_read_from_the_source(rgw, bucket, mounts, near, near_proxy):
    """Each fault on a node of its own (a fresh cache), over copies made once."""
    files = {f"f/{kind}/{i}.bin": os.urandom(MiB + 1000 * i)
             for kind, _ in FAULTS for i in range(2)}
    _copy(mounts, near, near_proxy, bucket, files)
    for kind, options in FAULTS:
        b = _mount(mounts, near, near_proxy, cache=f"cache-{kind}", mnt=f"mnt-{kind}")
        rule = near_proxy.inject(kind, ops="GET", **options)
        mine = {k: v for k, v in files.items() if k.startswith(f"f/{kind}/")}
        for key, data in mine.items():  # every byte right, from the source
            assert _read(b, key) == data, kind
        near_proxy.remove(rule)
        near_proxy.release()
        assert near_proxy.injected(kind, op="GET") >= 1, kind
        assert b.counter("tierfs_read_bytes_total", source="near") == 0, kind
        # after the first failure the near store is skipped for a while: one read (or two
        # started together by the read-ahead) paid for it, each with its retries and resumes
        assert 1 <= b.counter("tierfs_tier_errors_total", tier="near", op="get") <= 2, kind
        assert b.counter("tierfs_backend_requests_total", op="get") == len(mine), kind
        if kind == "flip":
            assert b.counter("tierfs_integrity_failures_total") >= 1
        assert "near store" in b.log_text(), kind
        assert b.counter("tierfs_internal_errors_total") == 0, kind
        b.stop()


def test_a_near_store_that_goes_down_and_comes_back(rgw, bucket, mounts, near, near_proxy):
    files = {f"d/{i}.bin": os.urandom(MiB // 4) for i in range(30)}
    _copy(mounts, near, near_proxy, bucket, files)
    b = _mount(mounts, near, near_proxy, cache="cache-b", mnt="mnt-b",
               extra=("--memory-cache-size", "0"))
    near_proxy.down()
    assert _read(b, "d/0.bin") == files["d/0.bin"]
    _wait(lambda: b.counter("tierfs_tier_up", tier="near") == 0, what="near store marked down")
    assert _read(b, "d/1.bin") == files["d/1.bin"]
    near_proxy.up()
    _wait(lambda: b.counter("tierfs_tier_up", tier="near") == 1, what="near store back")
    # files not read before, one a second, until the first failure's cool-down runs out
    for i in range(2, 30):
        assert _read(b, f"d/{i}.bin") == files[f"d/{i}.bin"]
        if b.counter("tierfs_read_bytes_total", source="near") > 0:
            break
        time.sleep(1)
    else:
        raise AssertionError("reads never went back to the near store")
    assert "near store unreachable" in b.log_text()
    assert "near store answers again" in b.log_text()
