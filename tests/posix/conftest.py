"""Fixtures of the POSIX metadata suite (issue 11): real mounts with --allow-other on the
session's Ceph RGW, one per write mode per module.

  pmount  (module, parametrized over posixkit.MODES) a posixkit.Mounts with one started
          mount `pmount.m`; a module's PRELOAD = {key: (body, metadata)} is put in the
          bucket before the mount starts
  d       (function) a fresh directory of the test on `pmount` (mode 0755, umask 022 while
          the test runs); when the test failed, the daemon's log lines written meanwhile
          are printed
  ms      (function) posixkit.Mounts of the test's own bucket, for tests that mount more
          than once (remount); parametrize `mode` yourself
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import posixkit`

import posixkit  # noqa: E402


@pytest.fixture(scope="module", params=list(posixkit.MODES))
def pmount(request, rgw):
    ms = posixkit.Mounts(rgw, request.param)
    try:
        for key, (body, meta) in getattr(request.module, "PRELOAD", {}).items():
            ms.s3.put_object(Bucket=ms.bucket, Key=key, Body=body, Metadata=meta)
        ms.m = ms.start()
        yield ms
    finally:
        ms.close()


@pytest.fixture
def d(pmount, request):
    # short (a unix socket's path is at most 107 bytes) and unique within the mount
    pmount.seq = getattr(pmount, "seq", 0) + 1
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name.removeprefix("test_"))
    path = pmount.m.path / f"{pmount.seq:03d}_{name.strip('_')[-40:]}"
    offset = pmount.test_log_offset = pmount.log_size()
    old = os.umask(0o022)
    try:
        os.mkdir(path, 0o755)
        yield path
    finally:
        os.umask(old)
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            pmount.print_log(offset)


@pytest.fixture
def ms(rgw, request):
    mounts = posixkit.Mounts(rgw, request.node.callspec.params["mode"])
    old = os.umask(0o022)
    try:
        yield mounts
    finally:
        os.umask(old)
        try:
            rep = getattr(request.node, "rep_call", None)
            if rep is not None and rep.failed:
                mounts.print_log()
        finally:
            mounts.close()
