#!/usr/bin/env python3
"""Download ratio: bytes fetched from the store per byte read, on a cold cache.

    .venv/bin/python bench/download_ratio.py [--shards N | --quick] [--ref GIT_REF] [--keep]

One command, like bench/run.py (whose RGW, mount and helper code it imports): starts its
own throw-away Ceph RGW, uploads shards of 32 MiB (default 8; the issue's loader read 32,
1 GiB), then for each case mounts
tierfs on a fresh cache dir with the default 8 MiB chunks and read-ahead 8 and reads every
shard once (a cold epoch), each byte checked by sha256:
- `sequential`: one reader, the shards one after another, 1 MiB reads;
- `loader`: 4 threads, each reading its share of the shards in a shuffled order, 256 KiB
  reads (a DataLoader over shards);
- `mmap`: 4 threads, each mapping its shards and reading them through the mapping.
Cases: disk tiers larger than the data, half and a quarter of it, with the default 256 MiB
memory tier; a 64 MiB memory tier (smaller than chunk x read-ahead x readers: issue 26,
M1) with a disk tier of half the data; and a memory tier of one chunk per reader (32 MiB)
with a disk tier of a quarter of the data (`--memory 32` runs only those).

Prints per case the bytes downloaded (tierfs_backend_bytes_total) over the bytes read, the
GETs, the reads that failed (EIO: there must be none), the daemon's peak RSS (VmHWM) and
the run's seconds. Goal (issue 26, M3): a ratio of at most 1.05 in every case. Exit
status 1 when a case misses it or a read failed. Needs root, /dev/fuse, fusermount3 and
the ceph packages. See bench/README.md ("Download ratio").
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import mmap
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the RGW, the mount and the shared helpers)
from peers_restore import PeersBench  # noqa: E402
from run import BUCKET, GiB, MiB, BenchError, TierfsMount, log  # noqa: E402
from tenants import TenantsBench  # noqa: E402

SEED = 26
GOAL = 1.05
READERS = 4


@dataclass
class Case:
    pattern: str  # sequential | loader | mmap
    cache: int  # disk tier
    memory: int  # memory tier


@dataclass
class Result:
    case: Case
    read: int
    downloaded: float
    gets: float
    failed: int
    rss: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.downloaded / self.read if self.read else 0.0


def vm_hwm(pid: int | None) -> int:
    """The daemon's peak resident set (VmHWM), bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, TypeError):
        pass
    return 0


class RatioBench:
    def __init__(self, files: int, size: int, root: str) -> None:
        self.root = root
        self.size = size
        self.keys = [f"shards/{i:03d}.tar" for i in range(files)]
        self.data = files * size
        self.rgw = run.Rgw(root, max(GiB, 3 * self.data))
        self.mounts: list[TierfsMount] = []  # what run.finish() cleans up
        self.shas: dict[str, str] = {}
        half, quarter = self.data // 2, self.data // 4
        self.cases = [Case(p, c, 256 * MiB) for c in (2 * self.data, half, quarter)
                      for p in ("sequential", "loader")]
        self.cases += [Case(p, half, 64 * MiB) for p in ("sequential", "loader", "mmap")]
        # about one chunk per reader in the memory tier and a disk tier smaller than the
        # data: a reader's own chunk has nowhere to stay but with its reader
        self.cases += [Case(p, quarter, READERS * 8 * MiB) for p in ("loader", "mmap")]
        self.results: list[Result] = []

    check_host = TenantsBench.check_host  # root, fuse, the memstore's RAM and a GiB

    def upload(self) -> None:
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        for i, key in enumerate(self.keys):
            data = bytes(datagen.make(self.size, SEED + i))
            self.shas[key] = hashlib.sha256(data).hexdigest()
            s3.put_object(Bucket=BUCKET, Key=key, Body=data)
        log(f"uploaded {len(self.keys)} shards of {self.size // MiB} MiB")

    def run(self) -> None:
        self.check_host()
        self.rgw.start()
        self.upload()
        for case in self.cases:
            self.results.append(self.one(case))

    def one(self, case: Case) -> Result:
        n = len(self.mounts)
        m = TierfsMount(self.rgw, self.root, f"r{n}", cache_size=case.cache,
                        memory_cache_size=case.memory)
        self.mounts.append(m)
        m.mount()
        try:
            before = m.counter("tierfs_backend_bytes_total")
            gets0 = m.requests().get("get", 0.0)
            t0 = time.perf_counter()
            read, failed = self.epoch(m.mnt, case.pattern, random.Random(SEED + n))
            seconds = time.perf_counter() - t0
            r = Result(case, read, m.counter("tierfs_backend_bytes_total") - before,
                       m.requests().get("get", 0.0) - gets0, failed, vm_hwm(m.pid), seconds)
        finally:
            m.unmount()
        log(f"{case.pattern}, disk {case.cache // MiB} MiB, memory {case.memory // MiB} MiB: "
            f"{r.ratio:.3f} downloaded per byte read, {r.failed} reads failed")
        return r

    def epoch(self, mnt: str, pattern: str, rnd: random.Random) -> tuple[int, int]:
        """Read every shard once: (bytes read, reads that failed)."""
        keys = list(self.keys)
        if pattern == "sequential":
            return self.read_files(mnt, keys, 1 * MiB, use_mmap=False)
        rnd.shuffle(keys)
        shares = [keys[i::READERS] for i in range(READERS)]
        out = [(0, 0)] * READERS

        def worker(i: int) -> None:
            out[i] = self.read_files(mnt, shares[i], 256 * 1024, use_mmap=pattern == "mmap")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(READERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(r for r, _ in out), sum(f for _, f in out)

    def read_files(self, mnt: str, keys: list[str], step: int,
                   use_mmap: bool) -> tuple[int, int]:
        read = failed = 0
        for key in keys:
            h = hashlib.sha256()
            try:
                with open(os.path.join(mnt, key), "rb") as f:
                    if use_mmap:
                        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                            for off in range(0, len(mm), step):
                                h.update(mm[off:off + step])
                    else:
                        while chunk := f.read(step):
                            h.update(chunk)
            except OSError as exc:  # an mmap reader's SIGBUS is not catchable: it ends the run
                log(f"read of {key} failed: {exc}")
                failed += 1
                continue
            if h.hexdigest() != self.shas[key]:
                raise BenchError(f"{key}: wrong bytes")
            read += self.size
        return read, failed

    cleanup = PeersBench.cleanup  # unmount every mount it made, stop the RGW


def report(bench: RatioBench, header: str) -> bool:
    print(header)
    head = ["pattern", "disk MiB", "memory MiB", "read MiB", "downloaded MiB", "ratio",
            "GETs", "failed", "peak RSS MiB", "s"]
    rows = [[r.case.pattern, str(r.case.cache // MiB), str(r.case.memory // MiB),
             f"{r.read / MiB:.0f}", f"{r.downloaded / MiB:.0f}", f"{r.ratio:.3f}",
             f"{r.gets:.0f}", str(r.failed), f"{r.rss / MiB:.0f}", f"{r.seconds:.1f}"]
            for r in bench.results]
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    for j, row in enumerate([head] + rows):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    met = all(r.ratio <= GOAL and not r.failed for r in bench.results)
    print(f"goal: ratio <= {GOAL} and no failed read in every case: "
          f"{'met' if met else 'NOT met'}")
    return met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8, help="shards of 32 MiB (default 8)")
    ap.add_argument("--quick", action="store_true", help="4 shards")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons from a snapshot of this commit instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    ap.add_argument("--memory", type=int, metavar="MIB",
                    help="only the cases with this memory tier size")
    args = ap.parse_args()
    run.stop_on_signals()
    root = tempfile.mkdtemp(prefix="tierfs-ratio.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    bench = RatioBench(4 if args.quick else args.shards, 32 * MiB, root)
    if args.memory is not None:
        bench.cases = [c for c in bench.cases if c.memory == args.memory * MiB]
    ok = run.drive(bench, root, args.ref, args.keep, f"work dir {root}")
    _, code = run.code_label(args.ref)
    header = (f"tierfs download-ratio bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  "
              f"{len(bench.keys)} shards of {bench.size // MiB} MiB, 8 MiB chunks, read-ahead 8"
              f"  {time.perf_counter() - t0:.0f}s")
    met = report(bench, header) if bench.results else False
    return 0 if ok and met else 1


if __name__ == "__main__":
    sys.exit(main())
