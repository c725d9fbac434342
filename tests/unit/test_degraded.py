"""Degraded mode in the core (no FUSE): the store goes away, what is cached stays served.

The core is the daemon's (unitkit.core -> tierfs.mount.core.build_core) over a FileBackend
behind faultkit's FaultBackend: the store is "down" while every call fails as an
unreachable endpoint does (BackendUnavailable, its bucket checks too). The namespace's
clock is fake ("past the TTL" is a clock advance); the health's probe interval and the
failed-range memo are shortened so an outage takes a fraction of a second of real time.
"""

import errno
import logging
import os

import pytest
import trio

from tierfs.backend.file import FileBackend
from tierfs.errors import (AccessDenied, BackendError, NotFound, RecentFailure, StoreDown,
                           TierfsError)
from tierfs.index.inodes import ROOT_INO

from faultkit import Action, FaultBackend, Hang, error, unavailable
from unitkit import chunk, core, resolve, write

KIB = 1 << 10
CS = 64 * KIB  # unitkit's chunk size
TTL = 60.0


class _Denied(Action):
    def before(self, call) -> None:
        raise AccessDenied(f"{call.op} {call.key!r}: access denied (injected)")


def requests(store: FaultBackend) -> int:
    """Calls other than the health's bucket checks."""
    return sum(n for op, n in store.calls.items() if op != "check")


async def until(cond, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


async def read_file(io, ino: int, size: int) -> bytes:
    h, _ = await io.open(ino)
    try:
        out = []
        for off in range(0, size, 32 * KIB):
            out.append(await io.read(h.fh, off, 32 * KIB))
        return b"".join(out)
    finally:
        await io.release(h.fh)


def names(entries):
    return [name for name, _ in entries]


def stale_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tierfs.files.namespace" and "cannot revalidate" in r.getMessage()]


def quick(c):
    """The core's health, probing every 50 ms."""
    health = c.core.backend.health
    assert health is not None, "build_core wires a BackendHealth"
    health.interval_s, health.timeout_s = 0.05, 1.0
    return health


@pytest.fixture
def store(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return FaultBackend(FileBackend(str(src)))


async def test_store_down_serves_what_is_cached_and_fails_the_rest_fast(tmp_path, store,
                                                                          caplog):
    caplog.set_level(logging.INFO)
    src = store.inner.root
    a = write(src, "d/a.bin", os.urandom(3 * CS + 100))
    b = write(src, "d/b.bin", os.urandom(CS))
    write(src, "top.txt", b"top")
    write(src, "e/never-listed.txt", b"e")
    async with core(str(tmp_path), backend=store, bucket=src, ttl_s=TTL) as c:
        health = quick(c)
        root = names(await c.ns.listdir(ROOT_INO))
        d = await resolve(c.ns, "d")
        assert names(await c.ns.listdir(d.ino)) == [b"a.bin", b"b.bin"]
        na = await c.ns.lookup(d.ino, b"a.bin")
        assert await read_file(c.io, na.ino, len(a)) == a  # cached now; b.bin only listed
        nb = await c.ns.lookup(d.ino, b"b.bin")
        await trio.sleep(0.1)  # fills land in the disk tier

        down = store.inject("*", unavailable())
        c.clock.advance(TTL + 1)
        # the first request past the TTL finds the store gone; a probe confirms it
        assert names(await c.ns.listdir(ROOT_INO)) == root
        await until(lambda: not health.up)
        assert c.metrics.value("tierfs_backend_up") == 0
        sent = requests(store)

        # listings, lookups, stat, open and reads of what is cached, past the TTL
        assert names(await c.ns.listdir(d.ino)) == [b"a.bin", b"b.bin"]
        for _ in range(5):
            assert (await c.ns.lookup(d.ino, b"a.bin")).ino == na.ino
            assert (await c.ns.lookup(ROOT_INO, b"d")).ino == d.ino
        assert c.ns.inode(na.ino).size == len(a)
        assert await read_file(c.io, na.ino, len(a)) == a
        with pytest.raises(NotFound):  # the last listing of d/ has no such name
            await c.ns.lookup(d.ino, b"never.bin")

        # what is not cached fails at once, with EIO, without a request
        h, _ = await c.io.open(nb.ino)  # its entry is known: the open is served
        with trio.fail_after(1):
            for _ in range(3):
                with pytest.raises(StoreDown) as err:
                    await c.io.read(h.fh, 0, 4 * KIB)
                assert err.value.errno == errno.EIO
            e = await c.ns.lookup(ROOT_INO, b"e")  # seen in the root's listing...
            with pytest.raises(TierfsError) as err:  # ...but never listed itself
                await c.ns.listdir(e.ino)
            assert err.value.errno == errno.EIO
            with pytest.raises(TierfsError) as err:  # a name never seen anywhere
                await c.ns.lookup(e.ino, b"never-listed.txt")
            assert err.value.errno == errno.EIO
        assert requests(store) == sent

        # one line per directory served stale, however many lookups
        lines = stale_lines(caplog)
        assert len(lines) == 2, lines
        assert any(line.startswith("cannot revalidate / ") for line in lines)
        assert any(line.startswith("cannot revalidate /d/ ") for line in lines)

        # the store comes back: the probe notices, uncached data is fetched again
        down.remove()
        await until(lambda: health.up)
        assert c.metrics.value("tierfs_backend_up") == 1
        assert await c.io.read(h.fh, 0, 4 * KIB) == b[:4 * KIB]
        await c.io.release(h.fh)
        write(src, "d/new.bin", b"new")
        assert names(await c.ns.listdir(d.ino)) == [b"a.bin", b"b.bin", b"new.bin"]
        assert names(await c.ns.listdir(e.ino)) == [b"never-listed.txt"]

    warnings = [r.getMessage() for r in caplog.records if r.name == "tierfs.backend.health"
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "degraded" in warnings[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "no ERROR lines"


async def test_a_failed_range_answers_the_kernels_re_asks_at_once(tmp_path, store):
    src = store.inner.root
    data = write(src, "f.bin", os.urandom(CS // 2))  # one chunk: no read-ahead beyond it
    async with core(str(tmp_path), backend=store, bucket=src) as c:
        c.walk.failures.memo_s = 0.5
        f = await resolve(c.ns, "f.bin")
        h, _ = await c.io.open(f.ino)
        failing = store.inject("get", error("500 InternalError"))
        with pytest.raises(BackendError):
            await c.io.read(h.fh, 0, 4 * KIB)
        gets = store.calls["get"]
        with trio.fail_after(0.4):
            for off in (0, 0, 4 * KIB):  # the kernel asks again, page by page
                with pytest.raises(RecentFailure) as err:
                    await c.io.read(h.fh, off, 4 * KIB)
                assert err.value.errno == errno.EIO
        assert store.calls["get"] == gets  # answered from the memo
        assert c.core.backend.health.up  # a 500 is an answer: not degraded

        await trio.sleep(0.5)  # the memo has expired: the store is asked again
        with pytest.raises(BackendError):
            await c.io.read(h.fh, 0, 4 * KIB)
        assert store.calls["get"] > gets
        failing.remove()
        await trio.sleep(0.5)
        assert await c.io.read(h.fh, 0, 4 * KIB) == data[:4 * KIB]  # success clears it

        store.inject("get", _Denied())  # the errno of the first failure is kept
        g = write(src, "g.bin", b"g" * 100)
        c.clock.advance(TTL + 1)
        hg, _ = await c.io.open((await c.ns.lookup(ROOT_INO, b"g.bin")).ino)
        with pytest.raises(AccessDenied):
            await c.io.read(hg.fh, 0, len(g))
        with pytest.raises(RecentFailure) as err:
            await c.io.read(hg.fh, 0, len(g))
        assert err.value.errno == errno.EACCES
        await c.io.release(hg.fh)
        await c.io.release(h.fh)


async def test_lookup_failures_arrive_as_the_backend_error_not_a_group(tmp_path, store):
    async with core(str(tmp_path), backend=store, bucket=store.inner.root) as c:
        failing = store.inject("list", error("500 InternalError"))
        with pytest.raises(BackendError):  # both one-key LISTs failed: one error, no group
            await c.ns.lookup(ROOT_INO, b"x")
        failing.remove()
        store.inject("list", _Denied())
        with pytest.raises(AccessDenied):  # an answer of the store is never served stale
            await c.ns.lookup(ROOT_INO, b"x")


class _HangThenFail(Action):
    """Hold the call until released, then fail it as a 500 does."""

    def __init__(self) -> None:
        self.hang = Hang(max_s=30.0)

    def before(self, call) -> None:
        self.hang.before(call)
        raise BackendError(f"{call.op} {call.key!r}: 500 InternalError (injected)")


async def test_a_reader_that_joined_a_failing_read_ahead_gets_its_error_without_a_second_get(
        tmp_path, store):
    from tierfs.cache import ObjectVersion

    src = store.inner.root
    write(src, "f.bin", os.urandom(CS))
    meta = store.inner.head("f.bin")
    obj = ObjectVersion(src, "f.bin", meta.etag, meta.size)
    async with core(str(tmp_path), backend=store, bucket=src) as c:
        failing = _HangThenFail()
        store.inject("get", failing)

        async def read_ahead() -> None:
            with pytest.raises(BackendError):
                await chunk(c.walk, obj, 0, background=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_ahead)
            await failing.hang.wait_entered()
            reader = trio.Event()

            async def read() -> None:
                with pytest.raises(TierfsError) as err:
                    await chunk(c.walk, obj, 0, access=True)
                assert err.value.errno == errno.EIO
                reader.set()

            nursery.start_soon(read)
            await trio.sleep(0.05)  # the reader is waiting on the read-ahead's flight
            failing.hang.release()
        assert reader.is_set()
        assert store.calls["get"] == 1  # the reader did not start a GET of its own
