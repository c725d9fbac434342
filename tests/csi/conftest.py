"""Fixtures of the CSI tests (helpers in csikit.py).

  csi_root  (function) a temporary folder: plugin socket, state dir, kubelet root
  plugin    (function) a running tierfs-csi process (csikit.Plugin, a mounting.Daemon);
            when the test failed, the tail of its log is printed
  kubelet   (function) csikit.Kubelet on the test's `bucket`; cleans up after the test
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import csikit`

from csikit import Kubelet, Plugin  # noqa: E402
from mounting import failed  # noqa: E402


@pytest.fixture
def csi_root(tmp_path):
    root = tmp_path / "csi"
    root.mkdir()
    return root


@pytest.fixture
def plugin(csi_root, request):
    p = Plugin(csi_root).start()
    try:
        yield p
    finally:
        p.stop()
        if failed(request):
            print(f"----- tail of {p.log_path}\n{p.log_tail(80)}")


@pytest.fixture
def kubelet(csi_root, rgw, bucket):
    k = Kubelet(csi_root, rgw, bucket)
    try:
        yield k
    finally:
        k.cleanup(csi_root / "state")
