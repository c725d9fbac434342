"""Fixtures of the write tests (real mounts on the session's Ceph RGW).

  s3       a boto3 client of the `rgw` fixture
  mounts   the harness of tests/conftest.py (mounting.Mounts) on the test's `bucket`:
             m = mounts.start("--writeback", cache="cache", mnt="mnt")
             m = mounts.remount(m)            # clean unmount, mount again, same dirs + args
             m = mounts.restart_after_crash(m)  # kill -9, then mount again on the same cache
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import wkit`


@pytest.fixture
def s3(rgw):
    return rgw.client()
