"""Usage per tenant and reader (tierfs/telemetry/usage.py): counting, bounds, the Prometheus series,
persistence in the index (a real MetaStore on LMDB)."""

from __future__ import annotations

import pytest
import trio

from tierfs.index.env import USAGE
from tierfs.index.meta import MetaStore
from tierfs.metrics import Metrics
from tierfs.telemetry.usage import Tally, Usage

from unitkit import FakeClock, sample

SRC = "file:///src"


@pytest.fixture
def meta(tmp_path):
    m = MetaStore(str(tmp_path / "index"), SRC, map_size=64 << 20)
    yield m
    m.close()


def tenant_bytes(metrics: Metrics, tenant: str, source: str) -> float:
    return sample(metrics, "tierfs_tenant_read_bytes_total", {"tenant": tenant, "source": source})


def test_reads_and_stalls_count_per_tenant_and_reader(meta):
    clock, metrics = FakeClock(), Metrics()
    u = Usage(meta, metrics, clock=clock)
    u.read("vision", "job:1", "backend", 100)
    clock.advance(5)
    u.read("vision", "job:1", "disk", 300)
    u.read("nlp", "uid:1000", "memory", 50)
    u.stalled("vision", "job:1", 1.5)
    u.stalled("vision", "job:1", 0.0)  # a read that did not wait
    v = u.by_tenant()["vision"]
    assert (v.read, v.stall_s, v.first, v.last) == (
        {"backend": 100, "disk": 300}, 1.5, clock.now - 5, clock.now)
    assert v.hit_ratio() == 0.75
    assert u.reader("job:1") == Tally({"backend": 100, "disk": 300}, 1.5, clock.now - 5,
                                      clock.now)
    assert u.reader("uid:1000").hit_ratio() == 1.0
    assert u.reader("job:2") is None
    assert Tally().hit_ratio() is None
    assert set(u.by_reader()) == {"job:1", "uid:1000"}
    assert set(u.by_reader("job")) == {"job:1"}
    assert set(u.by_reader("uid")) == {"uid:1000"}
    assert u.by_reader("pod") == {}
    # answers are copies: a caller changing one changes nothing kept
    u.by_tenant()["vision"].read["disk"] = 0
    assert u.by_tenant()["vision"].read["disk"] == 300
    # Prometheus: per tenant and source, stall seconds per tenant; never a reader
    assert tenant_bytes(metrics, "vision", "disk") == 300
    assert tenant_bytes(metrics, "nlp", "memory") == 50
    assert sample(metrics, "tierfs_tenant_stall_seconds_total", {"tenant": "vision"}) == 1.5
    text = metrics.registry.collect()
    labels = {v for fam in text for s in fam.samples for v in s.labels.values()}
    assert not any(v.startswith(("job:", "uid:", "pod:")) or v in ("1", "1000") for v in labels)


def test_readers_are_bounded_least_recently_active_dropped_first(meta):
    clock = FakeClock()
    u = Usage(meta, Metrics(), clock=clock, max_readers=3)
    for r in ("job:1", "job:2", "job:3"):
        u.read("t", r, "disk", 1)
        clock.advance(1)
    u.read("t", "job:1", "disk", 1)  # job:1 active again: job:2 is now the oldest
    u.read("t", "job:4", "disk", 1)
    assert set(u.by_reader()) == {"job:1", "job:3", "job:4"}
    assert u.by_tenant()["t"].read == {"disk": 5}  # tenants keep everything


def test_readers_idle_past_the_window_are_forgotten(meta):
    clock = FakeClock()
    u = Usage(meta, Metrics(), clock=clock, window_s=100)
    u.read("t", "job:1", "disk", 1)
    clock.advance(60)
    u.read("t", "job:2", "disk", 1)
    clock.advance(50)
    assert set(u.by_reader()) == {"job:2"}
    assert u.reader("job:1") is None
    clock.advance(51)
    assert u.by_reader() == {}
    assert u.by_tenant()["t"].read == {"disk": 2}


async def test_usage_survives_a_restart(tmp_path):
    clock = FakeClock()
    meta = MetaStore(str(tmp_path / "index"), SRC, map_size=64 << 20)
    u = Usage(meta, Metrics(), clock=clock, max_readers=2)
    u.read("vision", "job:7", "backend", 10)
    u.stalled("vision", "job:7", 2.0)
    u.read("default", "uid:0", "memory", 5)
    await u.flush()
    u.read("vision", "job:7", "disk", 20)
    u.read("vision", "job:8", "peer", 1)  # drops uid:0 (least recently active)
    await u.flush()
    await u.flush()  # nothing changed: nothing written
    meta.close()

    meta = MetaStore(str(tmp_path / "index"), SRC, map_size=64 << 20)
    try:
        again = Usage(meta, Metrics(), clock=clock, max_readers=2)
        assert again.by_tenant() == {
            "vision": Tally({"backend": 10, "disk": 20, "peer": 1}, 2.0, clock.now, clock.now),
            "default": Tally({"memory": 5}, 0.0, clock.now, clock.now)}
        assert set(again.by_reader()) == {"job:7", "job:8"}
        assert again.reader("job:7").read == {"backend": 10, "disk": 20}
        assert {k for k, _ in meta.usage.records()} == {"tenant/vision", "tenant/default",
                                                "reader/job:7", "reader/job:8"}
    finally:
        meta.close()


async def test_bad_stored_records_are_skipped_and_removed(meta):
    meta.usage.put({"tenant/ok": {"read": {"disk": 4}, "stall_s": 0, "first": 1, "last": 2},
                    "tenant/bad": {"read": "nope"}, "reader/job:1": {"stall_s": 1},
                    "other/x": {"read": {}, "stall_s": 0, "first": 0, "last": 0}})
    with meta.env.begin(write=True, db=meta.env.db(USAGE)) as txn:
        txn.put(b"reader/job:2", b"\xff not json")
    u = Usage(meta, Metrics(), clock=FakeClock())
    assert u.by_tenant() == {"ok": Tally({"disk": 4}, 0.0, 1.0, 2.0)}
    assert u.by_reader() == {}
    await u.flush()
    assert [k for k, _ in meta.usage.records()] == ["tenant/ok"]


async def test_the_flusher_writes_every_interval(meta):
    u = Usage(meta, Metrics(), clock=FakeClock())
    u.read("t", "uid:5", "disk", 9)
    async with trio.open_nursery() as n:
        n.start_soon(u.run_flusher, 0.01)
        with trio.fail_after(10):
            while not meta.usage.records():
                await trio.sleep(0.01)
        n.cancel_scope.cancel()
    assert dict(meta.usage.records())["reader/uid:5"]["read"] == {"disk": 9}
