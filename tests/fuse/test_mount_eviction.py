"""The disk budget on a real mount: never exceeded, and a one-pass scan keeps the hot set."""

from __future__ import annotations

from helpers import payload, put_many, read_uncached
from mounting import Mount

MiB = 1 << 20


def test_hot_set_survives_a_scan_larger_than_the_cache(rgw, bucket, tmp_path):
    hot = {f"hot/{i}.bin": payload(f"hot{i}", MiB) for i in range(4)}
    scan = {f"scan/{i:02}.bin": payload(f"scan{i}", MiB) for i in range(40)}
    put_many(rgw.client(), bucket, {**hot, **scan})
    budget = 16 * MiB
    args = ["--cache-size", "16M", "--chunk-size", "1M", "--memory-cache-size", "0"]
    with Mount(rgw, f"s3://{bucket}", tmp_path / "mnt", tmp_path / "cache", args) as m:
        for _ in range(3):  # the working set, read every epoch
            for key, data in hot.items():
                assert read_uncached(m.path / key) == data
        peak = 0
        for key, data in scan.items():  # one pass over 2.5x the cache
            assert read_uncached(m.path / key) == data
            peak = max(peak, m.counter("tierfs_cache_bytes", tier="disk"))
        assert m.counter("tierfs_cache_evictions_total") >= 24
        # at most one chunk in flight above the budget, ever
        assert peak <= budget + MiB
        gets = m.counter("tierfs_backend_requests_total", op="get")
        for key, data in hot.items():
            assert read_uncached(m.path / key) == data
        assert m.counter("tierfs_backend_requests_total", op="get") == gets
        assert m.counter("tierfs_read_bytes_total", source="backend") == 4 * MiB + 40 * MiB
