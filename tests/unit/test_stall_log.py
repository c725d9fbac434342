"""The stall log (tierfs/telemetry/stalls.py): the threshold, the slowest recent stalls kept (top N by
wait within the window), totals per source, the per-tenant histogram. Pure: a fake clock,
waits given as numbers."""

from __future__ import annotations

from tierfs.metrics import Metrics
from tierfs.telemetry.stalls import StallLog

from unitkit import FakeClock, sample


def _log(**kw) -> tuple[StallLog, Metrics, FakeClock]:
    m, clock = Metrics(), FakeClock()
    kw.setdefault("threshold_s", 0.05)
    return StallLog(m, tenants=("default", "vision"), clock=clock, **kw), m, clock


def test_a_wait_at_or_under_the_threshold_is_no_stall():
    log, m, _ = _log()
    assert log.observe("a", 0, 0.05, "backend", "default", "uid:0") is False
    assert log.observe("a", 0, 0.0, "queue", "default", "uid:0") is False
    r = log.report()
    assert (r.total, r.slowest) == (0, [])
    assert sample(m, "tierfs_read_stall_seconds_count", {"tenant": "default"}) == 0


def test_stalls_are_counted_per_tenant_and_source_and_kept_slowest_first():
    log, m, clock = _log()
    assert log.observe("ds/a", 4096, 0.2, "backend", "vision", "job:7")
    clock.advance(1)
    assert log.observe("ds/b", 0, 1.5, "peer", "default", "uid:1000")
    assert log.observe("ds/c", 8 << 20, 0.06, "queue", "vision", "pod:x")
    r = log.report()
    assert r.total == 3 and abs(r.total_s - 1.76) < 1e-9
    assert r.by_source == {"backend": 1, "near": 0, "peer": 1, "queue": 1}
    assert [(s.key, s.offset, s.wait_s, s.source, s.tenant, s.reader) for s in r.slowest] == [
        ("ds/b", 0, 1.5, "peer", "default", "uid:1000"),
        ("ds/a", 4096, 0.2, "backend", "vision", "job:7"),
        ("ds/c", 8 << 20, 0.06, "queue", "vision", "pod:x")]
    assert r.slowest[1].at == 1_700_000_000.0 and r.slowest[0].at == 1_700_000_001.0
    assert sample(m, "tierfs_read_stall_seconds_count", {"tenant": "vision"}) == 2
    assert abs(sample(m, "tierfs_read_stall_seconds_sum", {"tenant": "vision"}) - 0.26) < 1e-9
    assert sample(m, "tierfs_read_stall_seconds_count", {"tenant": "default"}) == 1
    js = r.to_json()
    assert js["slowest"][0] == {"key": "ds/b", "offset": 0, "wait_s": 1.5, "source": "peer",
                                "at": 1_700_000_001.0, "tenant": "default", "reader": "uid:1000"}


def test_only_the_slowest_n_are_kept_and_the_total_counts_them_all():
    log, _, _ = _log(keep=5)
    for i in range(50):
        log.observe(f"k{i}", i, 0.1 + (i * 7 % 50) / 100, "backend", "default", "uid:0")
    slowest = log.slowest()
    assert len(slowest) == 5 and log.total == 50
    waits = sorted((0.1 + (i * 7 % 50) / 100 for i in range(50)), reverse=True)[:5]
    assert [s.wait_s for s in slowest] == waits


def test_old_stalls_leave_the_window_and_make_room_for_new_ones():
    log, _, clock = _log(keep=2, window_s=3600)
    log.observe("old-long", 0, 30.0, "backend", "default", "uid:0")
    log.observe("old-short", 0, 20.0, "backend", "default", "uid:0")
    clock.advance(3601)
    # the log is full of longer, older stalls: a new short one still gets in
    log.observe("new", 0, 0.1, "queue", "default", "uid:0")
    assert [s.key for s in log.slowest()] == ["new"]
    clock.advance(3601)
    assert log.slowest() == [] and log.total == 3


def test_a_tenant_not_named_at_start_gets_its_own_series():
    log, m, _ = _log()
    log.observe("x", 0, 0.5, "backend", "other", "uid:0")
    assert sample(m, "tierfs_read_stall_seconds_count", {"tenant": "other"}) == 1
