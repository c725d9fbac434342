"""Fixtures of the fault tests: tierfs through a fault-injecting proxy in front of the
session's Ceph RGW (tests/faults/proxy.py; docs/testing.md, "fault proxy").

  proxy    (function) a FaultProxy in front of `rgw`: inject(), down()/up(), heal(), counters
  s3       a boto3 client of the RGW itself (not through the proxy): what the bucket holds
  mounts   (function) foreground tierfs mounts of `bucket` through `proxy`, with short
           backend timeouts (fkit.FAST):  m = mounts.start("--writeback")
           m2 = mounts.again(m)  (same dirs and arguments, once m is stopped)
           At teardown the proxy is healed first, then every mount is stopped; when the test
           failed, the tail of each daemon log is printed.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import proxy, fkit`

import fkit  # noqa: E402
from proxy import FaultProxy  # noqa: E402


@pytest.fixture
def proxy(rgw):
    p = FaultProxy(rgw.endpoint).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def s3(rgw):
    return rgw.client()


@pytest.fixture
def mounts(rgw, proxy, bucket, tmp_path, request):
    mounter = fkit.Mounter(rgw, proxy, bucket, tmp_path)
    try:
        yield mounter
    finally:
        proxy.heal()  # a store that answers again lets every mount stop cleanly
        mounter.stop_all()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            seen = set()
            for m in mounter.all:
                if m.log_path in seen:
                    continue
                seen.add(m.log_path)
                print(f"----- tail of {m.log_path}")
                print(fkit.tail(m.log_text(), 80))
            print(f"----- proxy: requests {proxy.requests_by_op()}, "
                  f"faults {proxy.injected_by_kind()}")
