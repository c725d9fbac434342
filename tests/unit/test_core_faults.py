"""Every background task of the core under injected faults; the core is the daemon's
(tierfs.mount.core.build_core through unitkit.core), over a FileBackend, no FUSE.

What is asserted is the daemon-level property of issue 9 item 2: an unexpected exception
in read-ahead, warm, an uploader, recovery or orphan cleanup is logged with its
traceback, counted in tierfs_internal_errors_total, the task goes on (or is started
again), and the core keeps serving reads and writes. Expected failures (a TierfsError)
are not internal errors. Two ways in:
- through the backend (tests/unit/faultkit.py's FaultBackend): a raw exception where the
  backend contract allows only TierfsError. The backend boundary (AsyncBackend) may turn
  it into a BackendError and count it as task "backend", or the task meets it itself:
  either way it is logged and counted, which is what these tests check;
- bugs in the tasks themselves (a core method replaced by one that raises): the
  supervisor's part, checked strictly per task name.
"""

from __future__ import annotations

import logging
import os

import pytest
import trio

from tierfs.backend.file import FileBackend
from tierfs.errors import BackendError
from tierfs.index.inodes import ROOT_INO
from tierfs.tasks import leaves

from faultkit import FaultBackend, Hang, InjectedBug, error, unavailable, unexpected
from unitkit import core, write

KIB = 1 << 10
CS = 64 * KIB


def pattern(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


def fault_core(tmp_path, fb: FaultBackend | None = None, **kw):
    """unitkit.core over FaultBackend(FileBackend(TMP/src))."""
    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src, exist_ok=True)
    fb = fb or FaultBackend(FileBackend(src), seed=9)
    return src, fb, core(str(tmp_path), backend=fb, bucket=src, **kw)


async def eventually(pred, timeout_s: float = 30.0) -> None:
    """Wait (bounded) for a background effect; counters and log lines of a backend call
    come from its worker thread, one after the other, so wait for each one checked."""
    with trio.fail_after(timeout_s):
        while not pred():
            await trio.sleep(0.02)


async def read_file(c, name: str, size: int = 16 * KIB) -> bytes:
    node = await c.ns.lookup(ROOT_INO, name.encode())
    h, _ = await c.io.open(node.ino)
    out, off = bytearray(), 0
    try:
        while True:
            b = await c.io.read(h.fh, off, size)
            if not b:
                return bytes(out)
            out += b
            off += len(b)
    finally:
        await c.io.release(h.fh)


async def write_file(c, name: str, data: bytes) -> None:
    h, _ = await c.io.create(ROOT_INO, name.encode(), 0o644)
    try:
        await c.io.write(h.fh, 0, data)
        await c.io.flush(h.fh)
    finally:
        await c.io.release(h.fh)


def internal(c, *tasks: str) -> float:
    return sum(c.internal_errors(t) for t in tasks)


def tracebacks(caplog, exc_type: type[BaseException]) -> list[logging.LogRecord]:
    """ERROR records that carry a traceback of exc_type (also inside a group)."""
    return [r for r in caplog.records
            if r.levelno >= logging.ERROR and r.exc_info and r.exc_info[1] is not None
            and any(isinstance(e, exc_type) for e in leaves(r.exc_info[1]))]


def in_bucket(src: str, name: str) -> bytes | None:
    try:
        with open(os.path.join(src, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


# ---- read-ahead -----------------------------------------------------------------------


async def read_first_chunk(c, name: str, data: bytes):
    """Open `name` and read its first chunk sequentially (read-ahead starts); the handle."""
    node = await c.ns.lookup(ROOT_INO, name.encode())
    h, _ = await c.io.open(node.ino)
    for off in range(0, CS, 16 * KIB):
        assert await c.io.read(h.fh, off, 16 * KIB) == data[off:off + 16 * KIB]
    return h


async def read_rest(c, h, data: bytes) -> None:
    rest, off = bytearray(), CS
    while off < len(data):
        b = await c.io.read(h.fh, off, 16 * KIB)
        rest += b
        off += len(b)
    assert bytes(rest) == data[CS:]
    await c.io.release(h.fh)


@pytest.mark.parametrize("action", [unexpected(), unexpected(group=True),
                                    unexpected(ValueError)],
                         ids=["RuntimeError", "ExceptionGroup", "ValueError"])
async def test_read_ahead_meets_a_raw_backend_exception(tmp_path, caplog, action):
    src, fb, rig = fault_core(tmp_path, readahead=4)
    data = write(src, "big", pattern(8 * CS))
    async with rig as c:
        # every GET past the first chunk fails: only read-ahead asks for those
        rule = fb.inject("get", action, when=lambda call: call.start >= CS)
        h = await read_first_chunk(c, "big", data)
        await eventually(lambda: internal(c, "read-ahead", "backend") >= 1)
        assert rule.fired >= 1
        await eventually(lambda: tracebacks(caplog, Exception))  # logged by a worker thread
        rule.remove()
        await read_rest(c, h, data)  # the same handle reads on
        assert await read_file(c, "big") == data


async def test_read_ahead_bug_is_reported_by_the_supervisor(tmp_path, caplog, monkeypatch):
    src, fb, rig = fault_core(tmp_path, readahead=4)
    data = write(src, "big", pattern(8 * CS))
    async with rig as c:
        real = c.core.walk.read

        async def buggy(want, own=None):
            if want.background:
                raise ExceptionGroup("nested", [InjectedBug("read-ahead bug")])
            return await real(want, own)

        monkeypatch.setattr(c.core.walk, "read", buggy)
        h = await read_first_chunk(c, "big", data)
        await eventually(lambda: c.internal_errors("read-ahead") >= 1)
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        monkeypatch.undo()
        await read_rest(c, h, data)


async def test_read_ahead_backend_errors_are_not_internal_errors(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path, readahead=4)
    data = write(src, "big", pattern(6 * CS))
    async with rig as c:
        rule = fb.inject("get", error(), when=lambda call: call.start >= CS)
        h = await read_first_chunk(c, "big", data)
        await eventually(lambda: rule.fired >= 1)
        await eventually(lambda: not c.core.prefetcher._active)
        rule.remove()
        await read_rest(c, h, data)
        assert internal(c, "read-ahead", "backend") == 0
        assert not tracebacks(caplog, Exception)


# ---- warm -----------------------------------------------------------------------------


async def read_warmed(c, files: dict[str, bytes]) -> None:
    """Every file reads back right, from the cache alone."""
    gets = c.gets()
    d = await c.ns.lookup(ROOT_INO, b"d")
    for name, want in files.items():
        node = await c.ns.lookup(d.ino, name.split("/")[1].encode())
        h, _ = await c.io.open(node.ino)
        assert await c.io.read(h.fh, 0, len(want) + 1) == want
        await c.io.release(h.fh)
    assert c.gets() == gets, "the warm cached everything"


async def test_warm_meets_a_raw_backend_exception(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path)
    files = {f"d/f{i}": write(src, f"d/f{i}", pattern(2 * CS + i, seed=i)) for i in range(4)}
    async with rig as c:
        rule = fb.inject("get_into", unexpected(group=True), count=2)
        result = await c.core.warmer.warm(["d"], concurrency=2)  # returns, never raises
        assert rule.fired == 2
        assert result["error_count"] >= 1
        assert internal(c, "warm", "backend") == 2
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        again = await c.core.warmer.warm(["d"], concurrency=2)
        assert again["error_count"] == 0
        assert again["bytes_cached_before"] + again["bytes_fetched"] == again["bytes"]
        await read_warmed(c, files)


async def test_warm_bug_goes_to_the_client_with_one_traceback(tmp_path, caplog, monkeypatch):
    src, fb, rig = fault_core(tmp_path)
    files = {f"d/f{i}": write(src, f"d/f{i}", pattern(2 * CS + i, seed=i)) for i in range(4)}
    async with rig as c:
        real = c.core.walk.warm
        bugs = []

        async def buggy(obj, index):
            if len(bugs) < 3:
                bugs.append(obj.key)
                raise InjectedBug(f"warm bug {obj.key}")
            return await real(obj, index)

        monkeypatch.setattr(c.core.walk, "warm", buggy)
        result = await c.core.warmer.warm(["d"], concurrency=2)
        assert len(bugs) == 3
        assert {e["path"] for e in result["errors"]} == set(bugs)
        assert all("internal error (InjectedBug" in e["error"] for e in result["errors"])
        assert c.internal_errors("warm") == 3
        assert len(tracebacks(caplog, InjectedBug)) == 1, "one traceback per warm"
        again = await c.core.warmer.warm(["d"], concurrency=2)
        assert again["error_count"] == 0
        await read_warmed(c, files)


async def test_warm_listing_failure_is_an_error_entry_not_a_crash(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path)
    write(src, "d/sub/a", b"a" * 100)
    write(src, "d/b", b"b" * 100)
    async with rig as c:
        rule = fb.inject("list", unexpected(), when=lambda call: call.key == "d/sub/", count=1)
        result = await c.core.warmer.warm(["d"])
        assert rule.fired == 1
        assert [e["path"] for e in result["errors"]] == ["d/sub"]
        assert result["files"] == 1  # d/b, the part that could be listed
        assert internal(c, "warm", "backend") == 1
        assert (await c.core.warmer.warm(["d"]))["files"] == 2


async def test_warm_store_errors_are_reported_not_internal(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path)
    write(src, "f", pattern(3 * CS))
    async with rig as c:
        fb.inject("get_into", error())
        result = await c.core.warmer.warm(["f"])
        assert result["error_count"] == 1
        assert "injected backend error" in result["errors"][0]["error"]
        assert internal(c, "warm", "backend") == 0
        assert not tracebacks(caplog, Exception)


# ---- the supervisor's services: uploaders, orphan cleanup, flusher --------------------


def fail_first(n: int, real, calls: list):
    """A replacement for an async method that raises InjectedBug on its first n calls."""

    async def method(self, *args):
        calls.append(1)
        if len(calls) <= n:
            raise InjectedBug(f"bug #{len(calls)}")
        return await real(self, *args)

    return method


async def test_crashed_uploaders_are_started_again(tmp_path, caplog, monkeypatch):
    from tierfs.writeback import WriteBack

    calls: list = []
    monkeypatch.setattr(WriteBack, "run_uploader", fail_first(4, WriteBack.run_uploader, calls))
    src, fb, rig = fault_core(tmp_path, writeback=True)
    async with rig as c:
        await eventually(lambda: c.internal_errors("uploader") == 4)
        assert len(tracebacks(caplog, InjectedBug)) == 4
        data = pattern(5000)
        await write_file(c, "f", data)  # journaled; only a restarted uploader can send it
        await eventually(lambda: in_bucket(src, "f") == data)
        assert await read_file(c, "f") == data


async def test_failed_orphan_cleanup_runs_again(tmp_path, caplog, monkeypatch):
    from tierfs.writeback import WriteBack

    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src, exist_ok=True)
    inner = FileBackend(src)
    # an upload a dead daemon left behind: in the store and recorded, owned by no file
    upload_id = inner.mpu_create("orphan")
    inner.upload_part("orphan", upload_id, 1, b"x" * 1000)
    _, _, rig = fault_core(tmp_path)
    async with rig as c:
        c.core.writeback.meta.journal.put_upload(upload_id, "orphan")
    calls: list = []
    monkeypatch.setattr(WriteBack, "run_orphan_cleanup",
                        fail_first(1, WriteBack.run_orphan_cleanup, calls))
    _, _, rig = fault_core(tmp_path, FaultBackend(inner))
    async with rig as c:
        await eventually(lambda: not c.core.writeback.meta.journal.uploads())
        assert len(calls) == 2 and c.internal_errors("orphan-cleanup") == 1
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        assert inner.mpu_list("orphan") == []


async def test_crashed_flusher_is_started_again(tmp_path, caplog, monkeypatch):
    from tierfs.cache import ChunkCache

    calls: list = []
    monkeypatch.setattr(ChunkCache, "run_flusher", fail_first(2, ChunkCache.run_flusher, calls))
    src, fb, rig = fault_core(tmp_path)
    data = write(src, "f", pattern(3 * CS))
    async with rig as c:
        await eventually(lambda: len(calls) == 3, timeout_s=20)
        assert c.internal_errors("flusher") == 2
        assert await read_file(c, "f") == data


# ---- uploads and recovery under backend faults -----------------------------------------


async def test_uploads_go_on_after_raw_backend_exceptions(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path, writeback=True)
    async with rig as c:
        rule = fb.inject("put", unexpected(), count=4)
        for i in range(4):
            await write_file(c, f"bad{i}", pattern(1000 + i, seed=i))
        await eventually(lambda: rule.fired == 4)
        await eventually(lambda: internal(c, "uploader", "upload", "backend") >= 4)
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        good = pattern(5000, seed=7)
        await write_file(c, "good", good)
        await eventually(lambda: in_bucket(src, "good") == good)
        assert await read_file(c, "good") == good
        write(src, "other", b"x" * 3000)
        assert await read_file(c, "other") == b"x" * 3000


async def test_uploader_store_errors_retry_until_uploaded(tmp_path, caplog):
    src, fb, rig = fault_core(tmp_path, writeback=True)
    async with rig as c:
        rule = fb.inject("put", unavailable(), count=2)
        data = pattern(3000)
        await write_file(c, "f", data)
        await eventually(lambda: in_bucket(src, "f") == data)
        assert rule.fired == 2
        assert internal(c, "uploader", "upload", "backend") == 0
        assert not tracebacks(caplog, Exception)


async def _journal_unsaved(tmp_path, names: dict[str, bytes]) -> None:
    """A core that journals files (write-back) but cannot upload them, then stops: what a
    daemon leaves when the store is down at unmount."""
    src, fb, rig = fault_core(tmp_path, writeback=True)
    fb.inject("put", unavailable())
    async with rig as c:
        for name, data in names.items():
            await write_file(c, name, data)
        assert all(in_bucket(src, n) is None for n in names)


async def test_recovery_uploads_journaled_files_through_store_errors(tmp_path, caplog):
    files = {f"r{i}": pattern(2000 + i, seed=i) for i in range(3)}
    await _journal_unsaved(tmp_path, files)
    src, fb, rig = fault_core(tmp_path, writeback=True)
    rule = fb.inject("put", error(), count=2)
    async with rig as c:
        assert c.core.files_recovered == 3
        await eventually(lambda: all(in_bucket(src, n) == d for n, d in files.items()))
        assert rule.fired == 2
        assert internal(c, "uploader", "upload", "backend") == 0


async def test_recovery_meets_raw_backend_exceptions_and_the_core_serves(tmp_path, caplog):
    files = {f"r{i}": pattern(2000 + i, seed=i) for i in range(2)}
    await _journal_unsaved(tmp_path, files)
    src, fb, rig = fault_core(tmp_path, writeback=True)
    rule = fb.inject("put", unexpected(group=True), count=2)
    async with rig as c:
        assert c.core.files_recovered == 2
        await eventually(lambda: rule.fired == 2)
        await eventually(lambda: internal(c, "uploader", "upload", "backend") >= 2)
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        # the core serves: the recovered files read back (from their staging files), new
        # files are written and uploaded, bucket objects read
        for name, data in files.items():
            assert await read_file(c, name) == data
        await write_file(c, "after", b"after" * 100)
        await eventually(lambda: in_bucket(src, "after") == b"after" * 100)
        write(src, "plain", b"p" * 5000)
        assert await read_file(c, "plain") == b"p" * 5000


async def test_orphan_cleanup_meets_a_raw_backend_exception(tmp_path, caplog):
    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src, exist_ok=True)
    inner = FileBackend(src)
    upload_id = inner.mpu_create("orphan")
    _, _, rig = fault_core(tmp_path)
    async with rig as c:
        c.core.writeback.meta.journal.put_upload(upload_id, "orphan")
    fb = FaultBackend(inner, seed=3)
    rule = fb.inject("mpu_abort", unexpected(), count=1)
    _, _, rig = fault_core(tmp_path, fb)
    async with rig as c:
        await eventually(lambda: rule.fired == 1)
        await eventually(lambda: internal(c, "orphan-cleanup", "backend") >= 1)
        await eventually(lambda: tracebacks(caplog, InjectedBug))
        write(src, "plain", b"p" * 5000)
        assert await read_file(c, "plain") == b"p" * 5000


# ---- the harness itself ---------------------------------------------------------------


async def test_fault_backend_damages_reads_and_hangs_until_released(tmp_path):
    from faultkit import flip_bits, truncate

    src = os.path.join(str(tmp_path), "src")
    os.makedirs(src)
    data = write(src, "k", pattern(4096))
    fb = FaultBackend(FileBackend(src), seed=5)
    cut = fb.inject("get", truncate(100), count=1)
    assert fb.get("k", 0, 4096, None) == data[:100]
    assert fb.get("k", 0, 4096, None) == data and cut.fired == 1
    fb.inject("get_into", flip_bits(3), count=1)
    buf = bytearray(4096)
    assert fb.get_into("k", 0, memoryview(buf), None) == 4096
    assert sum(bin(a ^ b).count("1") for a, b in zip(buf, data)) in (1, 3)  # 2 may cancel
    assert buf != data
    hang = Hang()
    fb.inject("head", hang, count=1)
    result = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: trio.to_thread.run_sync(lambda: result.append(fb.head("k"))))
        await hang.wait_entered()
        assert result == []
        hang.release()
    assert result[0].size == 4096
    fb.inject("head", error(), probability=0.5)
    outcomes = []
    for _ in range(40):
        try:
            fb.head("k")
            outcomes.append(True)
        except BackendError:
            outcomes.append(False)
    assert 5 < outcomes.count(False) < 35  # seeded: the same split every run
    assert fb.injected["head"] == outcomes.count(False) + 1  # + the hang
