"""Reads with a memory tier smaller than chunk size x read-ahead x readers (issue 26, M1-M3).

Before: GETs and disk reads in flight reserved more than the tier's capacity, `put` then
evicted until the LRU was empty and raised StopIteration: EIO to readers, SIGBUS to mmap
readers, short buffered reads, and a fetched chunk left in its flight for good (RSS grew
to 10x the tier). And read-ahead chunks left the tier (LRU: the next chunk a reader wanted
was the oldest entry) before their reader got to them: with a disk tier smaller than the
data, 1.2-1.4x the data was downloaded per cold epoch.

Here every byte is checked, no read may fail, the daemon must log no internal error, and
a cold pass over more than the disk tier downloads each chunk about once (GET bytes from
the daemon's own counter). 1 MiB chunks keep the data small; the accounting does not
depend on the chunk size (the download bound uses 4 MiB chunks).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading

import pytest
from helpers import payload, put_many, sha
from mounting import Mount

MiB = 1 << 20
FILES = {f"shards/{i:02d}.tar": payload(f"shard{i}", 6 * MiB + 4096 * i + 17) for i in range(8)}
DATA = sum(len(v) for v in FILES.values())
SHAS = {k: sha(v) for k, v in FILES.items()}


def _read(path, how: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if how == "mmap":
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                for off in range(0, len(mm), 64 << 10):
                    h.update(mm[off:off + (64 << 10)])
        elif how == "pread":
            off = 0
            while True:
                got = os.pread(f.fileno(), 300_000, off)  # not page aligned
                if not got:
                    break
                h.update(got)
                off += len(got)
        else:
            while chunk := f.read(128 << 10):
                h.update(chunk)
    return h.hexdigest()


def _epoch(m: Mount, keys: list[str], readers: int, hows: list[str]) -> list[str]:
    """Read every key once with `readers` threads (reader i reads keys[i::readers] its
    way, hows[i]); the keys read wrong or that failed."""
    bad: list[str] = []

    def worker(i: int) -> None:
        for key in keys[i::readers]:
            try:
                if _read(m.path / key, hows[i % len(hows)]) != SHAS[key]:
                    bad.append(f"{key}: wrong bytes")
            except OSError as exc:
                bad.append(f"{key}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bad


def _internal_errors(m: Mount) -> float:
    return m.counter("tierfs_internal_errors_total")


@pytest.mark.parametrize("memory", ["1M", "4M"])
def test_readers_of_every_kind_get_every_byte_with_a_tiny_memory_tier(rgw, bucket, memory,
                                                                       mounts):
    """4 readers x read-ahead 8 x 1 MiB chunks = 32 MiB against a 4 MiB tier (and a 1 MiB
    one: smaller than one chunk of read-ahead), mmap, buffered and unaligned pread readers
    at once, twice (the second pass partly from the disk tier)."""
    put_many(rgw.client(), bucket, FILES)
    keys = sorted(FILES)
    with mounts.start("--chunk-size", "1M", "--memory-cache-size", memory,
                      "--readahead-chunks", "8", "--cache-size", "16M") as m:
        for _ in range(2):
            bad = _epoch(m, keys, 4, ["mmap", "buffered", "pread", "mmap"])
            assert bad == []
        assert _internal_errors(m) == 0, m.log_text()[-3000:]
        # the tier never holds more than its size, reservations included
        assert m.counter("tierfs_cache_bytes", tier="memory") <= int(memory[:-1]) * MiB
        log = m.log_text()
        assert "StopIteration" not in log and "internal error" not in log
        # said at start: the tier cannot hold the read-ahead window
        assert "read ahead" in log and "--memory-cache-size" in log


LONG = {f"long/{i}.tar": payload(f"long{i}", 24 * MiB + 100 * i) for i in range(4)}
SHAS.update({k: sha(v) for k, v in LONG.items()})


@pytest.mark.parametrize("readers", [1, 4])
def test_a_cold_pass_over_more_than_the_disk_tier_downloads_each_chunk_once(
        rgw, bucket, readers, mounts):
    """4 shards of 24 MiB, 4 MiB chunks, a 16 MiB disk tier and a 64 MiB memory tier
    (read-ahead may hold 8 chunks; 4 readers x (8 + 1) chunks would be 144 MiB): a cold
    pass downloads each chunk about once. Read-ahead holds what it fetched until read."""
    put_many(rgw.client(), bucket, LONG)
    keys = sorted(LONG)
    with mounts.start("--chunk-size", "4M", "--memory-cache-size", "64M",
                      "--readahead-chunks", "8", "--cache-size", "16M") as m:
        before = m.counter("tierfs_backend_bytes_total")
        assert _epoch(m, keys, readers, ["buffered", "mmap"]) == []
        downloaded = m.counter("tierfs_backend_bytes_total") - before
        data = sum(len(v) for v in LONG.values())
        assert downloaded <= 1.05 * data, f"{downloaded / data:.3f} x the data downloaded"
        assert _internal_errors(m) == 0
