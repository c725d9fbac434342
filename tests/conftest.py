"""Shared fixtures. Helpers live in tests/rgw.py (Ceph RGW, s3_env) and tests/mounting.py
(Mount: a tierfs mount in a subprocess, with its metrics and log).

  rgw     (session) a running throw-away Ceph RGW: .endpoint .access_key .secret_key .region
          .dir .client() -> boto3 S3 client, .env() -> s3_env(rgw)
  bucket  (function) name of a fresh, empty, uniquely named bucket on `rgw`; emptied and
          deleted afterwards, its data freed at once when the RGW's memstore is 1/4 full
          (it is RAM, and a full one hangs every request of every later test); an RGW that
          does not answer is replaced by a new one, with a line in the output
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
def bucket(rgw, request):
    if not rgw.answers():
        # a full memstore (or a crash) would make every later test wait out its timeouts:
        # say so and go on with a new RGW
        request.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"\nthe RGW does not answer before {request.node.nodeid} "
            f"({_memstore_state(rgw)}); starting a new one", red=True)
        rgw.restart()
    client = rgw.client()
    name = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    try:
        yield name
    finally:
        delete_bucket(client, name)
        used, capacity = rgw.memstore_used()
        if used > capacity // 4:  # a test that wrote a lot: its data must not pile up
            rgw.free_deleted()


def _memstore_state(rgw) -> str:
    try:
        used, capacity = rgw.memstore_used()
    except Exception as e:  # noqa: BLE001 - only for the message
        return f"memstore state unknown: {e}"
    return f"memstore {used >> 20} of {capacity >> 20} MiB used"


@pytest.fixture
def mounts(rgw, bucket, tmp_path, request):
    with Mounts.of_test(request, rgw, bucket, tmp_path) as harness:
        yield harness
