"""The metrics endpoint under a flood of idle connections (issue 26, S3), on a real mount.

prometheus_client's server started a thread per connection and held it while the client
did: 2,000 idle connections made 2,000 threads in the daemon, and with a 1,024 fd limit
every read of the mount failed with EIO. The daemon here runs with that limit
(`prlimit --nofile=1024`); its endpoint is served from its trio loop (tierfs/mount/metricsserve.py).
"""

from __future__ import annotations

import gzip
import os
import socket
import time
import urllib.request

import pytest

from helpers import payload

pytestmark = pytest.mark.mount

MiB = 1 << 20
FLOOD = 2000


# a daemon that may hold at most 1,024 file descriptors
LIMITED = ["prlimit", "--nofile=1024:1024", "--"]


def _threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_cost_no_thread_and_never_break_reads(rgw, bucket, mounts):
    data = payload("metrics-flood", 4 * MiB)
    rgw.client().put_object(Bucket=bucket, Key="a.bin", Body=data)
    with mounts.start("--chunk-size", "1M", wrap=LIMITED) as m:
        assert m.counter("tierfs_backend_requests_total", op="get") == 0
        threads0, fds0 = _threads_and_fds(m.pid)
        idle = []
        try:
            for _ in range(FLOOD):  # a local user's connections that never send a byte
                idle.append(socket.create_connection(("127.0.0.1", m.metrics_port), timeout=30))
            time.sleep(1)
            threads, fds = _threads_and_fds(m.pid)
            # the flood costs no thread and at most the 16 connections served at once
            assert threads <= threads0 + 2, (threads0, threads)
            assert fds <= fds0 + 20, (fds0, fds)
            # the mount reads, and a scraper gets its answer, in the middle of the flood
            assert (m.path / "a.bin").read_bytes() == data
            assert m.counter("tierfs_read_bytes_total") >= len(data)
            assert m.counter("tierfs_fuse_errors_total") == 0
        finally:
            for s in idle:
                s.close()
        # a connection that asks nothing is closed by the daemon within its 10 s
        lone = socket.create_connection(("127.0.0.1", m.metrics_port), timeout=30)
        start = time.monotonic()
        assert lone.recv(1) == b""
        assert 8 < time.monotonic() - start < 20
        lone.close()
        # what Prometheus asks for: OpenMetrics, gzip'ed
        req = urllib.request.Request(
            f"http://127.0.0.1:{m.metrics_port}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0",
                     "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["content-type"].startswith("application/openmetrics-text")
            assert r.headers["content-encoding"] == "gzip"
            text = gzip.decompress(r.read()).decode()
        assert "tierfs_read_bytes_total" in text and text.endswith("# EOF\n")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/other", timeout=30)
        assert err.value.code == 404
        err.value.close()
        assert "Traceback" not in m.log_text()
