#!/usr/bin/env python3
"""tierfs tenants benchmark: two tenants competing for one cache, with and without quotas.

    .venv/bin/python bench/tenants.py            # ~1 min: 64 MiB cache, 24 MiB working set, 240 MiB scan
    .venv/bin/python bench/tenants.py --quick    # ~30 s: half of each

One command, like bench/run.py (whose RGW, mount and helper code it imports): starts its own
throw-away Ceph RGW, uploads two tenants' data, then for each mode mounts tierfs on a fresh
cache dir (`--chunk-size 1M --memory-cache-size 0`: the disk tier alone decides what is a hit)
with two tenants (`work`: prefix work/, `scan`: prefix scan/) and runs rounds: in each round
the scanner reads the next 1.25 cache sizes of its data (cycling over 3.75 cache sizes), then
the working-set tenant reads its whole set again. Between its reads the scan passes more than
the cache, so without quotas the working set, read once per round and refetched each time
(heat 1 again, older than the scan), is always pushed out: heat alone cannot keep it. Modes:
no quotas, `soft = "50%"` on the scanner, `hard = "50%"` on the scanner.

Prints per mode the cached MiB of each tenant after the scanner's pass and after the working
set's re-read in every round (tierfs_tenant_cache_bytes{kind="cached"}) and each tenant's hit
ratio in that round (the bytes readers got from the
disk tier over all they read: tierfs_read_bytes_total by source, per pass, the two tenants'
passes being one after the other), then a summary: each tenant's hit ratio over the rounds
after the first (cold) one, and the working set's GETs in them. Every byte read is checked
(sha256). Everything it started is stopped in `finally` blocks. Needs root, /dev/fuse,
fusermount3 and the ceph packages. See bench/README.md ("Tenants: two tenants competing").
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the read benchmark and the shared helpers)
from peers_restore import PeersBench  # noqa: E402
from run import BUCKET, GiB, MiB, BenchError, TierfsMount, log, mem_available  # noqa: E402

FILE = 4 * MiB  # every object: 4 chunks of 1 MiB
SEED = 1200
MODES = {"none": None, "soft 50%": "soft", "hard 50%": "hard"}


@dataclass
class Plan:
    cache: int          # --cache-size
    work: int           # the working set (bytes)
    scan: int           # the scanner's data, read in a cycle
    per_round: int      # scan bytes read per round
    rounds: int

    @classmethod
    def make(cls, quick: bool, rounds: int) -> "Plan":
        cache = (32 if quick else 64) * MiB
        return cls(cache, cache * 3 // 8, cache * 15 // 4, cache * 5 // 4, rounds)


@dataclass
class Round:
    after_scan: dict[str, float]  # tenant -> cached bytes after the scanner's pass
    cached: dict[str, float]  # tenant -> cached bytes after the round
    hits: dict[str, float]    # tenant -> hit ratio of its pass in this round
    gets: dict[str, float]    # tenant -> GETs of its pass


@dataclass
class Mode:
    name: str
    rounds: list[Round] = field(default_factory=list)

    def steady(self, tenant: str) -> tuple[float, float]:
        """(hit ratio, GETs) of the tenant over the rounds after the first."""
        later = self.rounds[1:]
        return (sum(r.hits[tenant] for r in later) / max(1, len(later)),
                sum(r.gets[tenant] for r in later))


def tenants_option(quota: str | None) -> str:
    scan = '{prefixes = ["scan/"]' + (f', {quota} = "50%"' if quota else "") + "}"
    return f'tenants={{work = {{prefixes = ["work/"]}}, scan = {scan}}}'


def cached_by_tenant(m: TierfsMount) -> dict[str, float]:
    """tenant -> its cached bytes now (tierfs_tenant_cache_bytes{kind="cached"})."""
    return {t: v for (n, labels), v in m.metrics().items()
            if n == "tierfs_tenant_cache_bytes" and ("kind", "cached") in labels
            for k, t in labels if k == "tenant"}


def read_checked(path: str, sha: str) -> int:
    """Read a file whole through the mount (its page-cache pages dropped first, so the read
    reaches tierfs) and check its sha256."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        h, n = hashlib.sha256(), 0
        while chunk := os.read(fd, MiB):
            h.update(chunk)
            n += len(chunk)
    finally:
        os.close(fd)
    if h.hexdigest() != sha:
        raise BenchError(f"{path}: wrong bytes")
    return n


class TenantsBench:
    def __init__(self, plan: Plan, root: str) -> None:
        self.plan = plan
        self.root = root
        # the memstore holds about twice what is stored
        self.rgw = run.Rgw(root, max(GiB, 3 * (plan.work + plan.scan)))
        self.mounts: list[TierfsMount] = []  # what run.finish() cleans up
        self.work = [f"work/{i:03d}.bin" for i in range(plan.work // FILE)]
        self.scan = [f"scan/{i:03d}.bin" for i in range(plan.scan // FILE)]
        self.shas: dict[str, str] = {}
        self.modes: list[Mode] = []

    def check_host(self) -> None:
        run.require_root_and_fuse()
        need = self.rgw.memstore_bytes + GiB
        if mem_available() < need:
            raise BenchError(f"needs {need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} available")

    def upload(self) -> None:
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        for i, key in enumerate(self.work + self.scan):
            data = bytes(datagen.make(FILE, SEED + i))
            self.shas[key] = hashlib.sha256(data).hexdigest()
            s3.put_object(Bucket=BUCKET, Key=key, Body=data)
        log(f"uploaded {len(self.work)} + {len(self.scan)} files of {FILE // MiB} MiB")

    def run(self) -> None:
        self.check_host()
        self.rgw.start()
        self.upload()
        for name, quota in MODES.items():
            self.modes.append(self.one(name, quota))

    def one(self, name: str, quota: str | None) -> Mode:
        p = self.plan
        m = TierfsMount(self.rgw, self.root, f"t{len(self.modes)}", cache_size=p.cache,
                        memory_cache_size=0,
                        extra_args=("--chunk-size", "1M", "-o", tenants_option(quota)))
        self.mounts.append(m)
        m.mount()
        mode = Mode(name)
        try:
            per_round = p.per_round // FILE
            for r in range(p.rounds):
                start = r * per_round
                scan = [self.scan[(start + i) % len(self.scan)] for i in range(per_round)]
                hits, gets = {}, {}
                hits["scan"], gets["scan"] = self.pass_of(m, scan)
                after_scan = cached_by_tenant(m)
                hits["work"], gets["work"] = self.pass_of(m, self.work)
                cached = cached_by_tenant(m)
                mode.rounds.append(Round(after_scan, cached, hits, gets))
                log(f"{name}: round {r + 1}: cached after the scan: work "
                    f"{after_scan.get('work', 0) / MiB:.0f} MiB, scan "
                    f"{after_scan.get('scan', 0) / MiB:.0f} MiB; hit work {hits['work']:.0%} "
                    f"scan {hits['scan']:.0%}")
        finally:
            m.unmount()
        return mode

    def pass_of(self, m: TierfsMount, keys: list[str]) -> tuple[float, float]:
        """Read `keys` through the mount: (hit ratio, backend GETs) of this pass."""
        before = m.by_label("tierfs_read_bytes_total", "source")
        gets0 = m.requests().get("get", 0.0)
        for key in keys:
            read_checked(os.path.join(m.mnt, key), self.shas[key])
        after = m.by_label("tierfs_read_bytes_total", "source")
        got = {s: after.get(s, 0.0) - before.get(s, 0.0) for s in after}
        total = sum(got.values())
        hit = (got.get("memory", 0.0) + got.get("disk", 0.0)) / total if total else 0.0
        return hit, m.requests().get("get", 0.0) - gets0

    cleanup = PeersBench.cleanup  # unmount every mount it made, stop the RGW


def table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    for j, r in enumerate([head] + rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def report(bench: TenantsBench, header: str) -> None:
    print(header)
    for mode in bench.modes:
        print(f"\nquotas: {mode.name} - cache share of each tenant over time")
        table(["round", "after scan: work MiB", "scan MiB", "after re-read: work MiB",
               "scan MiB", "work hit", "scan hit"],
              [[str(i + 1), *(f"{c.get(t, 0) / MiB:.0f}" for c in (r.after_scan, r.cached)
                              for t in ("work", "scan")),
                f"{r.hits['work']:.0%}", f"{r.hits['scan']:.0%}"]
               for i, r in enumerate(mode.rounds)])
    print("\nsummary (rounds 2..N; round 1 is cold)")
    rows = []
    for mode in bench.modes:
        (wh, wg), (sh, _) = mode.steady("work"), mode.steady("scan")
        rows.append([mode.name, f"{wh:.0%}", f"{wg:.0f}", f"{sh:.0%}"])
    table(["quotas", "work hit ratio", "work GETs", "scan hit ratio"], rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 32 MiB cache and half the data")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per mode (default 6)")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons from a snapshot of this commit instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    args = ap.parse_args()
    if args.rounds < 2:
        print("error: --rounds wants at least 2 (the first one is cold)", file=sys.stderr)
        return 2
    run.stop_on_signals()
    plan = Plan.make(args.quick, args.rounds)
    root = tempfile.mkdtemp(prefix="tierfs-tbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    bench = TenantsBench(plan, root)
    ok = run.drive(bench, root, args.ref, args.keep, f"work dir {root}")
    _, code = run.code_label(args.ref)
    header = (f"tierfs tenants bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  cache "
              f"{plan.cache // MiB} MiB, working set {plan.work // MiB} MiB, scan "
              f"{plan.scan // MiB} MiB ({plan.per_round // MiB} MiB a round), 1 MiB chunks, "
              f"no memory tier  {time.perf_counter() - t0:.0f}s")
    if bench.modes:
        report(bench, header)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
