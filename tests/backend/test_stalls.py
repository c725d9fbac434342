"""Stalls are visible and bounded: a backend request that runs past --stall-warn logs ONE
WARNING naming op, key, offset and elapsed time, and is counted in
tierfs_backend_stalls_total{op}; a store that never answers fails the request within
the budget tierfs/backend/budget.py computes."""

import logging
import time

import pytest
import trio

from tierfs.backend.budget import read_budget
from tierfs.backend.file import FileBackend
from tierfs.backend.runner import AsyncBackend
from tierfs.backend.s3 import S3Backend
from tierfs.errors import BackendUnavailable
from tierfs.metrics import Metrics

from bodyproxy import HangingServer

TIMEOUT_S, ATTEMPTS = 1.0, 2


@pytest.fixture
def hanging(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    with HangingServer() as server:
        yield server, S3Backend("bucket", endpoint_url=server.endpoint, region="us-east-1",
                                max_connections=4, timeout_s=TIMEOUT_S,
                                max_attempts=ATTEMPTS)


def stall_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tierfs.backend.runner" and r.levelno == logging.WARNING]


def test_a_hanging_store_logs_one_warning_per_request_and_counts_it(hanging, caplog):
    server, s3 = hanging
    m = Metrics()
    elapsed: list[float] = []

    async def go():
        ab = AsyncBackend(s3, m, concurrency=4, background=1, stall_warn=0.3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ab.watch_stalls)
            t0 = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await ab.get("data/shard-0007.tar", 8 << 20, 8 << 20, None)
            elapsed.append(time.monotonic() - t0)
            with pytest.raises(BackendUnavailable):
                await ab.head("data/other")
            assert ab.in_flight() == []
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.INFO, logger="tierfs.backend.runner"):
        trio.run(go)
    warnings = stall_warnings(caplog)
    # one per request, however long it ran past the threshold (both ran > 2 s)
    assert len(warnings) == 2
    assert "get of 'data/shard-0007.tar' at offset 8388608 has been running for" in warnings[0]
    assert "head of 'data/other' has been running for" in warnings[1]
    assert m.value("tierfs_backend_stalls_total", op="get") == 1
    assert m.value("tierfs_backend_stalls_total", op="head") == 1
    ended = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("get of 'data/shard-0007.tar' at offset 8388608 failed after" in e
               for e in ended)
    # botocore tried ATTEMPTS times, and the wait was within the computed bound
    assert server.requests >= ATTEMPTS
    assert elapsed[0] < read_budget(TIMEOUT_S, ATTEMPTS).hang + 10  # generous: a loaded CI


def test_fast_requests_are_no_stalls_and_queueing_is_not_a_stall(tmp_path, caplog):
    (tmp_path / "f").write_bytes(b"x" * 100)
    m = Metrics()

    class Slow(FileBackend):
        def get(self, *args, **kw):
            time.sleep(0.1)
            return super().get(*args, **kw)

    async def go():
        # one thread, 30 requests of 0.1 s: the last ones wait ~3 s for the thread, but
        # none runs anywhere near 1.5 s
        ab = AsyncBackend(Slow(str(tmp_path)), m, concurrency=1, background=1, stall_warn=1.5)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ab.watch_stalls)
            async with trio.open_nursery() as readers:
                for _ in range(30):
                    readers.start_soon(ab.get, "f", 0, 100, None)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="tierfs.backend.runner"):
        trio.run(go)
    assert stall_warnings(caplog) == []
    assert m.value("tierfs_backend_stalls_total", op="get") == 0
