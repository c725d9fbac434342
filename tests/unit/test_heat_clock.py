"""heat.HalfLife: the half-life heat decays with follows how fast the node reads its cache."""

from tierfs.cache.heat import PER_CACHE, HalfLife

H = 1800.0


def read_cache(clock: HalfLife, start: float, every: float) -> tuple[float, list[bool]]:
    """One cache's worth of accesses, `every` seconds apart; (the time after, changes)."""
    changes = [clock.accessed(start + i * every) for i in range(clock.chunks)]
    return start + clock.chunks * every, changes


def test_a_fast_node_keeps_the_configured_half_life():
    clock = HalfLife(H, 100)
    now, changes = read_cache(clock, 0.0, 1.0)  # a cache read in 100 s
    assert clock.value == H and not any(changes)


def test_a_slow_node_gets_a_longer_one_and_back_when_it_speeds_up():
    clock = HalfLife(H, 100)
    now, changes = read_cache(clock, 0.0, 0.5)
    now, changes = read_cache(clock, now, 60.0)  # 100 x 60 s: 6000 s a cache
    assert changes == [False] * 99 + [True]  # once, at the cache's worth
    # the window's time: the gap from the last access before it (0.5 s) and 99 of 60 s
    assert clock.value == PER_CACHE * (0.5 + 99 * 60.0)
    now, changes = read_cache(clock, now, 0.5)  # (60 + 99 x 0.5 s) x PER_CACHE < H
    assert clock.value == H and changes[-1]
    now, changes = read_cache(clock, now, 0.5)
    assert not any(changes)  # unchanged: not reported


def test_an_idle_night_is_not_a_slow_node():
    clock = HalfLife(H, 100)
    now, _ = read_cache(clock, 0.0, 1.0)
    now, _ = read_cache(clock, now + 12 * 3600, 1.0)  # 12 h without a read, then fast
    # the 12 h count as one configured half-life: (1800 + 99 s of reads) x PER_CACHE, where
    # counting them would have given (12 h + 99 s) x PER_CACHE
    assert clock.value == PER_CACHE * (H + 99.0)
    now, _ = read_cache(clock, now, 1.0)
    assert clock.value == H
