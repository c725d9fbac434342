"""Fixtures of the POSIX metadata suite (issue 11): real mounts with --allow-other on the
session's Ceph RGW, one per write mode per module, made by the mount harness
(mounting.Mounts) in a bucket of their own, under a fresh 0755 folder of /tmp (pytest's
tmp_path sits under a 0700 dir that `nobody` cannot traverse), every mount logging to
ROOT/tierfs.log.

  pmount  (module, parametrized over posixkit.MODES) the harness with one started mount
          `pmount.m` (and `pmount.mode`); a module's PRELOAD = {key: (body, metadata)} is
          put in the bucket before the mount starts
  d       (function) a fresh directory of the test on `pmount` (mode 0755, umask 022 while
          the test runs); when the test failed, the daemon's log lines written meanwhile
          are printed
  ms      (function) the harness on a bucket of the test's own, for tests that mount more
          than once (ms.start(), ms.remount(m, ...)); the mode is the test's `mode`
          parameter (default: "default")
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import posixkit`

import posixkit  # noqa: E402
from mounting import Mounts, failed  # noqa: E402
from rgw import delete_bucket  # noqa: E402


@contextlib.contextmanager
def _harness(rgw, mode: str):
    """The harness of the suite's mounts on a fresh bucket; closed and the bucket deleted
    on exit."""
    s3 = rgw.client()
    bucket = f"posix-{uuid.uuid4().hex[:20]}"
    s3.create_bucket(Bucket=bucket)
    ms = Mounts(rgw, bucket, args=["--allow-other", *posixkit.MODES[mode]], log="tierfs.log")
    ms.mode = mode
    try:
        yield ms
    finally:
        try:
            ms.close()
        finally:
            delete_bucket(s3, bucket)


@pytest.fixture(scope="module", params=list(posixkit.MODES))
def pmount(request, rgw):
    with _harness(rgw, request.param) as ms:
        for key, (body, meta) in getattr(request.module, "PRELOAD", {}).items():
            ms.s3.put_object(Bucket=ms.bucket, Key=key, Body=body, Metadata=meta)
        ms.m = ms.start()
        yield ms


@pytest.fixture
def d(pmount, request):
    # short (a unix socket's path is at most 107 bytes) and unique within the mount
    pmount.seq = getattr(pmount, "seq", 0) + 1
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name.removeprefix("test_"))
    path = pmount.m.path / f"{pmount.seq:03d}_{name.strip('_')[-40:]}"
    mark = pmount.test_log_mark = pmount.log_mark()
    old = os.umask(0o022)
    try:
        os.mkdir(path, 0o755)
        yield path
    finally:
        os.umask(old)
        if failed(request):
            print(pmount.report(since=mark))


@pytest.fixture
def ms(rgw, request):
    params = getattr(request.node, "callspec", None)
    old = os.umask(0o022)
    try:
        with _harness(rgw, params.params.get("mode", "default") if params else "default") as h:
            try:
                yield h
            finally:
                if failed(request):
                    print(h.report())
    finally:
        os.umask(old)
