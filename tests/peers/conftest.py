"""Fixtures of the peer-tier tests (real mounts over the session's RGW; tests/peers/cluster.py).

  rgw     the session's RGW, or with TIERFS_LONG=1 a bigger one of tests/peers' own
  s3      a boto3 client of the RGW itself: uploads the data, overwrites objects
  fleet   (function) a factory of Fleets of the test's `bucket` on the `mounts` harness
          (which stops every daemon at teardown and, when the test failed, prints the tail
          of every daemon's log):
            c = fleet(8)                                   # 8 mounts with peers, at once
            c = fleet(2, peers=False)                      # a plain fleet
            c = fleet(1, extra_peers=[fake.addr], peer_args=["--peer-timeout", "0.5s"])
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import cluster, fakepeer`

from cluster import LONG, Fleet  # noqa: E402
from rgw import start_rgw  # noqa: E402


@pytest.fixture(scope="session")
def rgw(rgw):
    """The session's RGW; with TIERFS_LONG=1 one of these tests' own with room for the
    long sizes (the session's 3 GiB memstore holds ~1.5 GiB, and deleted objects are freed
    only a minute or two later: a 512 MiB checkpoint per test would fill it)."""
    if not LONG:
        yield rgw
        return
    server = start_rgw(memstore_bytes=8 << 30)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(rgw):
    return rgw.client()


@pytest.fixture
def fleet(mounts):
    made: list[Fleet] = []

    def make(n: int, **kw) -> Fleet:
        made.append(Fleet(mounts, n, name=f"fleet{len(made)}", **kw))
        return made[-1]

    return make
