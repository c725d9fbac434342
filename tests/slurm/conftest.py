"""Fixtures of the Slurm tests (tests/slurm/slurmkit.py has the cluster itself).

  slurm       (session) a real single-node Slurm whose Prolog/Epilog are the project's
              wrappers (systemd/slurm/), node idle; stopped by PID at the end
  public_dir  (function) a fresh 0755 folder under /tmp: job users (nobody) cannot enter
              pytest's tmp_path (/tmp/pytest-of-root is 0700); removed afterwards
  job_out     (function) a folder in public_dir owned by nobody, for job output
  mounts      (function) the mount harness (mounting.Mounts) of `bucket` in public_dir, so
              that job users reach the mount points
"""

import os
import pwd
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import slurmkit`

from mounting import Mounts  # noqa: E402
from slurmkit import start_slurm  # noqa: E402

SETTINGS = """\
# tierfs-slurm.toml of the test cluster (docs/slurm.md); strict is left at its default
# (false), so that a test may append `strict = true` (a TOML key may appear only once)
pin_ttl = "1h"
timeout = "90s"
log_file = "{log}"
"""


@pytest.fixture(scope="session")
def slurm():
    if os.geteuid() != 0:
        pytest.fail("a real Slurm needs root: run the suite as root, as CI does")
    cluster = start_slurm(SETTINGS)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def public_dir():
    d = Path(tempfile.mkdtemp(prefix="tierfs-slurm-test."))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def job_out(public_dir):
    out = public_dir / "out"
    out.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(out, nobody.pw_uid, nobody.pw_gid)
    return out


@pytest.fixture
def mounts(rgw, bucket, public_dir, request):
    with Mounts.of_test(request, rgw, bucket, public_dir) as harness:
        yield harness
