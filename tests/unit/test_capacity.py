"""The capacity history and forecast (tierfs/telemetry/capacity.py): the forecast on synthetic
histories, the downsampled history's bounds in a real index, the working-set sample, and
the sampler on an in-process core."""

from __future__ import annotations

import os

import pytest
import trio

from tierfs.telemetry.capacity import (DAY, MAX_SAMPLES, MIN_SAMPLES, TIERS, CapacityHistory, Sample,
                             WorkingSet, downsample, forecast, merged)
from tierfs.index.meta import MetaStore

from unitkit import core, resolve, write

GiB = 1 << 30
T0 = 1_700_000_000.0


def history(levels: list[int], *, step_s: float = 3600.0, budget: int = 100 * GiB,
            pinned_share: float = 0.5) -> list[Sample]:
    """Samples at step_s apart whose pinned + hot bytes are `levels`."""
    out = []
    for i, level in enumerate(levels):
        pinned = int(level * pinned_share)
        out.append(Sample(T0 + i * step_s, used=budget // 2, pinned=pinned, dirty=0,
                          hot=level - pinned, budget=budget))
    return out


def test_a_growing_history_is_full_when_the_line_reaches_the_budget():
    # 10 GiB a day from 40 GiB, sampled hourly for two days: 60 GiB left at 10 GiB/day
    levels = [int(40 * GiB + 10 * GiB * h / 24) for h in range(49)]
    f = forecast(history(levels))
    assert f.verdict == "growing"
    assert f.level == levels[-1] == 60 * GiB
    assert f.slope_per_day == pytest.approx(10 * GiB, rel=1e-6)
    assert f.days_to_full == pytest.approx(4.0, rel=1e-6)
    assert f.text().startswith("full in 4.0 days at this rate")


@pytest.mark.parametrize("levels", [
    [30 * GiB] * 48,  # flat
    [int(80 * GiB - GiB * h) for h in range(48)],  # shrinking
])
def test_a_flat_or_shrinking_history_is_not_growing(levels):
    f = forecast(history(levels))
    assert f.verdict == "not growing"
    assert f.days_to_full is None
    assert f.text().startswith("not growing")


def test_noise_around_a_flat_level_is_not_growth():
    levels = [30 * GiB + (GiB // 100 if h % 2 else -GiB // 100) for h in range(48)]
    assert forecast(history(levels)).verdict == "not growing"


def test_a_level_at_the_budget_is_full_now():
    f = forecast(history([90 * GiB, 95 * GiB, 98 * GiB, 99 * GiB, 100 * GiB, 100 * GiB,
                          100 * GiB]))
    assert (f.verdict, f.days_to_full) == ("full", 0.0)
    # a cache with no room at all (a budget of 0) is full, not "not growing"
    assert forecast(history([0] * 8, budget=0)).verdict == "full"


@pytest.mark.parametrize("samples", [
    [],
    history([GiB * i for i in range(MIN_SAMPLES - 1)]),  # too few
    history([GiB * i for i in range(20)], step_s=60.0),  # many, but over 19 minutes
])
def test_too_few_samples_give_no_rate(samples):
    f = forecast(samples)
    assert f.verdict == "too few samples"
    assert f.slope_per_day is None and f.days_to_full is None
    assert "too few samples" in f.text()


def test_only_the_last_week_sets_the_rate():
    # a month of fast growth, then a flat week: the recent rate decides
    old = [int(GiB * h) for h in range(0, 24 * 23, 6)]  # 4 a day for 23 days
    flat = [old[-1]] * (24 * 7)
    samples = history(old, step_s=6 * 3600.0) + [
        Sample(T0 + 23 * DAY + i * 3600.0, 0, lvl, 0, 0, 1000 * GiB)
        for i, lvl in enumerate(flat)]
    assert forecast(samples).verdict == "not growing"


def test_downsampling_keeps_a_day_of_5_minute_steps_and_a_month_of_hours():
    five_min = [Sample(T0 + i * 300.0, i, 0, 0, 0, 1) for i in range(40 * 288)]  # 40 days
    now = five_min[-1].t
    kept = downsample(five_min, now)
    assert len(kept["5m"]) == 288 + 1  # the step of `now - 24h` is still whole... and now
    assert all(s.t >= now - DAY for s in kept["5m"])
    assert len(kept["1h"]) == 30 * 24 + 1
    assert all(s.t >= now - 30 * DAY for s in kept["1h"])
    # the last sample of each hour is what the hourly tier keeps
    assert all((s.t + 300) // 3600 > s.t // 3600 or s is five_min[-1] for s in kept["1h"])
    whole = merged(kept)
    assert [s.t for s in whole] == sorted({s.t for s in whole})
    assert len(whole) <= MAX_SAMPLES


def test_the_index_keeps_the_same_bounded_tiers(tmp_path):
    meta = MetaStore(str(tmp_path / "index"), "file:///src")
    try:
        samples = [Sample(T0 + i * 300.0, i, 0, 0, 0, 1) for i in range(int(1.5 * 288))]
        hourly = [Sample(T0 + 1.5 * DAY + i * 3600.0, i, 0, 0, 0, 1) for i in range(31 * 24)]
        for s in samples + hourly:  # a day and a half at 5 min, then a month at 1 h
            for tier in TIERS:
                meta.capacity.put(tier.name, int(s.t // tier.step_s), s.record(),
                                  drop_before=int((s.t - tier.keep_s) // tier.step_s))
        now = hourly[-1].t
        want = downsample(samples + hourly, now)
        for tier in TIERS:
            got = [Sample.from_record(r) for _, r in meta.capacity.samples(tier.name)]
            assert got == want[tier.name], tier.name
        assert len(meta.capacity.samples("5m")) <= 289 and len(meta.capacity.samples("1h")) <= 721
    finally:
        meta.close()


def test_the_working_set_sample_stays_bounded_and_estimates_distinct_bytes():
    ws = WorkingSet(max_tracked=512)
    n, length = 20_000, 1 << 20
    for i in range(n):
        key = i.to_bytes(16, "big") + (0).to_bytes(4, "big")
        tenant = "vision" if i % 4 == 0 else "nlp"
        ws.saw(key, tenant, length, T0 + (i % 10) * DAY)  # accessed over 10 days
        ws.saw(key, tenant, length, T0)  # seen again, older: still one chunk, its last access
    assert len(ws) <= 512 and ws.shift > 0
    week = ws.bytes(T0 + 3 * DAY)  # days 3..9: 7 of the 10 days
    total = sum(week.values())
    assert total == pytest.approx(n * 0.7 * length, rel=0.15)
    assert week["nlp"] == pytest.approx(3 * week["vision"], rel=0.3)
    ws.forget_before(T0 + 9 * DAY)
    assert sum(ws.bytes(0).values()) == pytest.approx(n * 0.1 * length, rel=0.35)


async def test_the_sampler_records_the_cache_and_the_working_set(tmp_path):
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        data = write(c.src, "ds/a.bin", os.urandom(256 << 10))  # 4 chunks
        write(c.src, "ds/b.bin", os.urandom(128 << 10))
        node = await resolve(c.ns, "ds/a.bin")
        h, _ = await c.io.open(node.ino)
        assert await c.io.read(h.fh, 0, len(data)) == data
        await c.io.release(h.fh)
        cache = c.cache_rig.cache
        with trio.fail_after(30):
            while cache.chunk_count < 4:  # the fills of the chunks read run in the background
                await trio.sleep(0.01)
        await cache.flush_index()
        cap: CapacityHistory = c.core.capacity
        assert cap is not None
        first = await cap.sample_now()
        assert (first.used, first.chunks, first.pinned) == (cache.used_bytes, 4, 0)
        assert first.used == len(data)
        assert first.hot == len(data)  # every chunk sampled at this size: exact
        assert cap.working_sets() == {"default": (len(data), len(data))}
        c.clock.advance(2 * DAY)  # the reads are now older than a day, not than a week
        later = await cap.sample_now()
        assert later.hot == 0
        assert cap.working_sets() == {"default": (0, len(data))}
        assert [s.t for s in cap.history()] == [first.t, later.t]
