"""Fixtures of the peer-tier tests (real mounts over the session's RGW; tests/peers/cluster.py).

  s3      a boto3 client of the RGW itself: uploads the data, overwrites objects
  fleet   (function) a factory of Clusters of the test's `bucket`, each stopped at teardown:
            c = fleet(8)                                   # 8 mounts with peers, at once
            c = fleet(2, peers=False)                      # a plain fleet
            c = fleet(1, extra_peers=[fake.addr], peer_args=["--peer-timeout", "0.5s"])
          when the test failed, the tail of every daemon's log is printed.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import cluster, fakepeer`

from cluster import Cluster  # noqa: E402


@pytest.fixture
def s3(rgw):
    return rgw.client()


@pytest.fixture
def fleet(rgw, bucket, tmp_path, request):
    made: list[Cluster] = []

    def make(n: int, **kw) -> Cluster:
        c = Cluster(rgw, bucket, tmp_path / f"fleet{len(made)}", n, start=False, **kw)
        made.append(c)
        return c.start()

    try:
        yield make
    finally:
        for c in made:
            c.stop()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for c in made:
                print(c.logs(80))
