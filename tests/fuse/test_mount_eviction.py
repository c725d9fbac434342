"""The disk budget on a real mount: never exceeded, a one-pass scan keeps the hot set, and
epochs over more than the cache keep what fits (the admission policy)."""

from __future__ import annotations

from helpers import payload, put_many, read_uncached

MiB = 1 << 20


def test_hot_set_survives_a_scan_larger_than_the_cache(rgw, bucket, mounts):
    hot = {f"hot/{i}.bin": payload(f"hot{i}", MiB) for i in range(4)}
    scan = {f"scan/{i:02}.bin": payload(f"scan{i}", MiB) for i in range(40)}
    put_many(rgw.client(), bucket, {**hot, **scan})
    budget = 16 * MiB
    args = ["--cache-size", "16M", "--chunk-size", "1M", "--memory-cache-size", "0"]
    with mounts.start(*args) as m:
        for _ in range(3):  # the working set, read every epoch
            for key, data in hot.items():
                assert read_uncached(m.path / key) == data
        peak = 0
        for key, data in scan.items():  # one pass over 2.5x the cache
            assert read_uncached(m.path / key) == data
            peak = max(peak, m.counter("tierfs_cache_bytes", tier="disk"))
        # the scan past the free room is refused: none of its chunks was read before
        assert m.counter("tierfs_cache_refused_chunks_total") >= 24
        # at most one chunk in flight above the budget, ever
        assert peak <= budget + MiB
        gets = m.counter("tierfs_backend_requests_total", op="get")
        for key, data in hot.items():
            assert read_uncached(m.path / key) == data
        assert m.counter("tierfs_backend_requests_total", op="get") == gets
        assert m.counter("tierfs_read_bytes_total", source="backend") == 4 * MiB + 40 * MiB


def test_epochs_over_more_than_the_cache_keep_what_fits(rgw, bucket, mounts):
    # LRU (or heat alone) evicts every chunk of a loop just before its next read: each
    # epoch fetches everything again. Admission keeps what the first epoch cached.
    data = {f"train/{i:02}.bin": payload(f"train{i}", MiB) for i in range(24)}
    put_many(rgw.client(), bucket, data)
    args = ["--cache-size", "16M", "--chunk-size", "1M", "--memory-cache-size", "0"]
    with mounts.start(*args) as m:
        per_epoch = []
        for _ in range(3):
            before = m.counter("tierfs_backend_requests_total", op="get")
            for key, want in data.items():
                assert read_uncached(m.path / key) == want
            per_epoch.append(m.counter("tierfs_backend_requests_total", op="get") - before)
        cached = m.counter("tierfs_cache_bytes", tier="disk") // MiB
        assert per_epoch[0] == 24 and cached >= 14  # the free room below the high watermark
        assert per_epoch[1:] == [24 - cached, 24 - cached]
        assert m.counter("tierfs_cache_evictions_total") == 0
