"""The read path's accounting on an in-process core (tierfs/files/fileio.py): each open's reader
and tenant, bytes counted by source to both, the time a read waited on fetches, and stalls
(tierfs/telemetry/stalls.py) with the right key, offset and source of the delay.

The store is a FileBackend whose GETs of chosen ranges wait for the test to open a gate, so
a read waits as long as the test says, and no assertion depends on how fast the box is: a
wait is asserted to be at least the time the test held the gate after the reader blocked.
"""

from __future__ import annotations

import os
import threading

import trio
import trio.testing

from tierfs.backend.file import FileBackend
from tierfs.telemetry.callers import Callers

from unitkit import core, resolve, sample, write

CHUNK = 64 << 10
HELD_S = 0.2  # how long the test holds a gated GET once the reader is blocked on it


class Gated(FileBackend):
    """GETs at (key, offset) in `gates` wait for their gate (threading.Event)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.gates: dict[tuple[str, int], threading.Event] = {}

    def get(self, key, start, length, etag, *, size=None):  # noqa: ANN001
        gate = self.gates.get((key, start))
        if gate is not None and not gate.wait(30):
            raise AssertionError(f"gate of {key} at {start} never opened")
        return super().get(key, start, length, etag)


def _stalls_of(c, key: str) -> list:
    return [s for s in c.core.stalls.slowest() if s.key == key]


async def _read_held(c, gate: threading.Event, fh: int, offset: int, size: int) -> bytes:
    """A read that blocks on `gate`: opened HELD_S after every task is blocked."""
    out: list[bytes] = []

    async def read() -> None:
        out.append(bytes(await c.io.read(fh, offset, size)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()  # the reader waits on its fetch now
        await trio.sleep(HELD_S)
        gate.set()
    return out[0]


async def test_a_read_waiting_on_the_store_is_a_backend_stall_of_its_tenant(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    store = Gated(str(src))
    data = write(str(src), "slow/a.bin", os.urandom(CHUNK + 1000))
    fast = write(str(src), "fast.bin", os.urandom(3000))
    store.gates["slow/a.bin", 0] = gate = threading.Event()
    async with core(str(tmp_path), chunk_size=CHUNK, backend=store, stall_threshold=0.001,
                    tenants='{vision = {prefixes = ["slow/"]}}') as c:
        node = await resolve(c.ns, "slow/a.bin")
        h, _ = await c.io.open(node.ino, os.O_RDONLY, os.getpid(), os.getuid())
        expected_reader = Callers().reader(os.getpid(), os.getuid())
        assert (h.tenant, h.reader) == ("vision", expected_reader)

        assert await _read_held(c, gate, h.fh, 0, CHUNK) == data[:CHUNK]
        [stall] = [s for s in _stalls_of(c, "slow/a.bin") if s.offset == 0]
        assert stall.source == "backend" and stall.wait_s >= HELD_S
        assert (stall.tenant, stall.reader) == ("vision", expected_reader)
        assert bytes(await c.io.read(h.fh, CHUNK, CHUNK)) == data[CHUNK:]
        assert bytes(await c.io.read(h.fh, 0, len(data))) == data  # now from the cache
        await c.io.release(h.fh)

        g, _ = await c.io.open((await resolve(c.ns, "fast.bin")).ino, os.O_RDONLY, 0, 4321)
        assert (g.tenant, g.reader) == ("default", "uid:4321")  # pid 0: the kernel's own
        assert bytes(await c.io.read(g.fh, 0, 4096)) == fast
        await c.io.release(g.fh)

        usage = c.core.usage
        vision = usage.by_tenant()["vision"]
        assert vision.total() == 2 * len(data)
        assert vision.read["backend"] >= CHUNK and vision.read.get("memory", 0) > 0
        assert usage.by_tenant()["default"].total() == len(fast)
        assert usage.reader("uid:4321").total() == len(fast)
        assert usage.reader(expected_reader).read == vision.read  # the only other reader
        for src_ in ("memory", "disk", "peer", "backend"):  # as the mount's counters say
            assert (vision.read.get(src_, 0) + usage.by_tenant()["default"].read.get(src_, 0)
                    == sample(c.metrics, "tierfs_read_bytes_total", {"source": src_})), src_

        # stall seconds: usage's, the histogram's and the log's are the same waits
        waits = sum(s.wait_s for s in c.core.stalls.slowest() if s.tenant == "vision")
        assert abs(vision.stall_s - waits) < 1e-6
        assert abs(sample(c.metrics, "tierfs_read_stall_seconds_sum", {"tenant": "vision"})
                   - waits) < 1e-6
        assert abs(sample(c.metrics, "tierfs_tenant_stall_seconds_total", {"tenant": "vision"})
                   - waits) < 1e-6
        # every read observed its latency under one source
        reads = sum(sample(c.metrics, "tierfs_read_seconds_count", {"source": s})
                    for s in ("memory", "disk", "peer", "backend"))
        assert reads == 4
        assert sample(c.metrics, "tierfs_read_seconds_count", {"source": "backend"}) >= 1


async def test_a_read_waiting_for_a_read_ahead_is_a_queue_stall(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    store = Gated(str(src))
    data = write(str(src), "q.bin", os.urandom(2 * CHUNK))
    store.gates["q.bin", CHUNK] = gate = threading.Event()
    async with core(str(tmp_path), chunk_size=CHUNK, backend=store,
                    stall_threshold=0.001) as c:
        h, _ = await c.io.open((await resolve(c.ns, "q.bin")).ino, os.O_RDONLY, 0, 0)
        # a read at offset 0 reads the next chunk ahead: its GET waits at the gate
        assert bytes(await c.io.read(h.fh, 0, CHUNK)) == data[:CHUNK]
        assert await _read_held(c, gate, h.fh, CHUNK, CHUNK) == data[CHUNK:]
        [stall] = [s for s in _stalls_of(c, "q.bin") if s.offset == CHUNK]
        assert stall.source == "queue" and stall.wait_s >= HELD_S
        # the bytes count where they came from (read ahead from the store)...
        assert c.core.usage.reader("uid:0").read["backend"] == 2 * CHUNK
        # ...the latency where the read found them (the memory tier, after the wait)
        assert sample(c.metrics, "tierfs_read_seconds_count", {"source": "memory"}) == 1
        await c.io.release(h.fh)


async def test_usage_is_kept_across_a_restart_of_the_core(tmp_path):
    data = write(str(tmp_path / "src"), "a.bin", os.urandom(5000))
    for run in (1, 2):
        async with core(str(tmp_path), chunk_size=CHUNK) as c:
            h, _ = await c.io.open((await resolve(c.ns, "a.bin")).ino, os.O_RDONLY, 0, 7)
            assert bytes(await c.io.read(h.fh, 0, 5000)) == data
            await c.io.release(h.fh)
            assert c.core.usage.reader("uid:7").total() == run * len(data)
