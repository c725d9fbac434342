"""Fixtures of the fault tests: tierfs through a fault-injecting proxy in front of the
session's Ceph RGW (tests/faults/proxy.py; docs/testing.md, "fault proxy").

  proxy    (function) a FaultProxy in front of `rgw`: inject(), down()/up(), heal(), counters
  s3       a boto3 client of the RGW itself (not through the proxy): what the bucket holds
  mounts   (function) the mount harness (mounting.Mounts) of `bucket` through `proxy`,
           with short backend timeouts (fkit.FAST):  m = mounts.start("--writeback")
           m2 = mounts.again(m)  (same dirs and arguments, once m is stopped)
           At teardown the proxy is healed first, then every mount is stopped; when the test
           failed, the tail of each daemon log and the proxy's counters are printed.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import proxy, fkit`

import fkit  # noqa: E402
from mounting import Mounts  # noqa: E402
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
    with Mounts.of_test(request, rgw, bucket, tmp_path, proxy=proxy, args=fkit.FAST,
                        timeout=60.0) as harness:
        yield harness
