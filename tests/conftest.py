"""Shared fixtures. Helpers live in tests/rgw.py (Ceph RGW, s3_env) and tests/mounting.py
(Mount: a tierfs mount in a subprocess, with its metrics and log).

  rgw     (session) a running throw-away Ceph RGW: .endpoint .access_key .secret_key .region
          .dir .client() -> boto3 S3 client, .env() -> s3_env(rgw)
  bucket  (function) name of a fresh, empty, uniquely named bucket on `rgw`; emptied and
          deleted afterwards
  mounts  (function) the mount harness (mounting.Mounts) of `bucket` under tmp_path:
          m = mounts.start("--writeback"); every daemon is stopped at teardown, and when
          the test failed each daemon's log tail is printed. Families override it with
          their own options (tests/faults: through the proxy; tests/slurm: a 0755 folder).
"""

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import rgw, mounting`

from mounting import Mounts  # noqa: E402
from rgw import delete_bucket, start_rgw  # noqa: E402


# item.rep_setup / rep_call: fixtures print a mount's log tail when their test failed
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(scope="session")
def rgw():
    server = start_rgw(memstore_bytes=3 << 30)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(rgw):
    client = rgw.client()
    name = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        delete_bucket(client, name)


@pytest.fixture
def mounts(rgw, bucket, tmp_path, request):
    with Mounts.of_test(request, rgw, bucket, tmp_path) as harness:
        yield harness
