"""Fixtures of the write tests (real mounts on the session's Ceph RGW).

  s3       a boto3 client of the `rgw` fixture
  mounts   (function) a factory of tierfs mounts of the test's `bucket`:
             m = mounts.start("--writeback", cache="cache", mnt="mnt")
             m = mounts.remount(m)            # clean unmount, mount again, same dirs + args
             m = mounts.restart_after_crash(m)  # kill -9, then mount again on the same cache
           every mount is stopped at teardown; when the test failed, the tail of each
           daemon log is printed (it shows under "Captured stdout teardown").
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import wkit`

from wkit import Mounter  # noqa: E402


@pytest.fixture
def s3(rgw):
    return rgw.client()


@pytest.fixture
def mounts(rgw, bucket, tmp_path, request):
    mounter = Mounter(rgw, bucket, tmp_path)
    try:
        yield mounter
    finally:
        mounter.stop_all()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            seen = set()
            for m in mounter.all:
                if m.log_path in seen:
                    continue
                seen.add(m.log_path)
                lines = m.log_text().splitlines()
                print(f"----- tail of {m.log_path} ({len(lines)} lines)")
                print("\n".join(lines[-80:]))
