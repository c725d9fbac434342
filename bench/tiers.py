#!/usr/bin/env python3
"""tierfs near-store benchmark: a data set read by N nodes, the source behind a WAN.

    .venv/bin/python bench/tiers.py                # 512 MiB in 16 files, 3 nodes, 50 ms, 100 MiB/s
    .venv/bin/python bench/tiers.py --quick        # 128 MiB
    .venv/bin/python bench/tiers.py --nodes 4 --rtt-ms 80 --wan-mib 50

Two throw-away Ceph RGWs on 127.0.0.1: the source (the "cloud bucket"), reached only through
tests/faults/proxy.py in WAN mode (every request `--rtt-ms` late, bodies capped at
`--wan-mib` MiB/s each way, the bytes crossing it counted), and the near store (on-prem, no
shaping). The data set is uploaded to the source directly. Three passes, each on N fresh
tierfs daemons (new cache dirs) and, with a near store, a fresh near bucket:

- origin only: the N nodes read the whole set at once (the fleet without a near store);
- near, promoted: node 1 reads the set (it comes over the WAN and is copied to the near
  store in the background); once the copies are done, the other N-1 nodes read it at once;
- near, warmed: `tierfs warm --tier near` of the set on node 1 (a job's prolog), then the N
  nodes read it at once.

Each read is 1 MiB reads of every file, checked by sha256. Printed per pass: WAN bytes
down (what the source sent: egress) as a multiple of the set, the time to fill the near
store, and the fleet's read time (median and slowest node). The goal of issue 29: each
byte crosses the WAN at most once for the fleet (egress <= 1.0x the set with a near store,
N x without). The checkpoint half of the issue's bench (durable close on the near store) is
not measured: --writeback-to near is not built yet. Needs root, /dev/fuse and the ceph
packages; everything it started is stopped in `finally` blocks (bench/README.md, "Near
store benchmark").
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "faults"))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the RGW, mounts and shared helpers)
from peers_restore import _Bytes, read_all  # noqa: E402
from proxy import FaultProxy  # noqa: E402  (tests/faults/proxy.py, with its WAN mode)
from run import BUCKET, BenchError, GiB, MiB, TierfsMount, drop_caches, log  # noqa: E402

SEED = 2900


@dataclass
class Pass:
    name: str
    nodes: int
    egress: int  # bytes the source sent over the WAN during the pass
    fill_s: float | None  # the near store filled (promotion or warm), seconds
    read_median_s: float
    read_max_s: float
    near_bytes: float  # bytes the nodes read from the near store


class TiersBench:
    def __init__(self, size: int, files: int, nodes: int, rtt_s: float, wan: float,
                 root: str) -> None:
        self.size, self.files, self.nodes = size, files, nodes
        self.rtt_s, self.wan = rtt_s, wan
        self.root = root
        room = max(2 * GiB, 2 * size + GiB)
        self.origin = run.Rgw(os.path.join(root, "origin"), room)
        self.near = run.Rgw(os.path.join(root, "near"), room)
        os.makedirs(os.path.join(root, "origin"))
        os.makedirs(os.path.join(root, "near"))
        self.proxy: FaultProxy | None = None
        self.keys = [f"set/part-{i:03d}.bin" for i in range(files)]
        self.shas: dict[str, str] = {}
        self.mounts: list[TierfsMount] = []
        self.passes: list[Pass] = []
        self._near_buckets = 0

    # ------------------------------------------------------------------ setup
    def run(self) -> None:
        run.require_root_and_fuse()
        self.origin.start()
        self.near.start()
        self.proxy = FaultProxy(self.origin.env["S3_ENDPOINT"]).start()
        self._credentials()
        s3 = self.origin.client()
        s3.create_bucket(Bucket=BUCKET)
        per = self.size // self.files
        for i, key in enumerate(self.keys):
            data = datagen.make(per, SEED + i)
            self.shas[key] = hashlib.sha256(data).hexdigest()
            run.Bench._upload_multipart(s3, key, _Bytes(data))
        log(f"uploaded {self.files} x {per / MiB:.0f} MiB to the source")
        self.proxy.wan(self.rtt_s, self.wan)
        self.passes.append(self.origin_only())
        self.passes.append(self.promoted())
        self.passes.append(self.warmed())

    def _credentials(self) -> None:
        """The near store's keys in a profile of their own; the source keeps the
        environment's (TierfsMount sets those). Mode 0600 in the work dir."""
        e = self.near.env
        path = os.path.join(self.root, "aws-credentials")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"[near]\naws_access_key_id = {e['S3_ACCESS_KEY']}\n"
                    f"aws_secret_access_key = {e['S3_SECRET_KEY']}\n")
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = path

    def _near_args(self) -> tuple[str, ...]:
        self._near_buckets += 1
        name = f"near-{self._near_buckets}"
        self.near.client().create_bucket(Bucket=name)
        return ("--tier", f"s3://{name}/", "--tier-endpoint-url", self.near.env["S3_ENDPOINT"],
                "--tier-profile", "near")

    def fleet(self, tag: str, n: int, extra: tuple[str, ...] = ()) -> list[TierfsMount]:
        assert self.proxy is not None
        fleet = [TierfsMount(self.origin, self.root, f"{tag}{i}", cache_size="8G",
                             memory_cache_size=128 * MiB,
                             extra_args=("--endpoint-url", self.proxy.endpoint, *extra))
                 for i in range(n)]
        self.mounts.extend(fleet)
        for m in fleet:
            m.mount()
        return fleet

    # ------------------------------------------------------------------ passes
    def _read(self, fleet: list[TierfsMount]) -> list[float]:
        drop_caches()
        with ThreadPoolExecutor(len(fleet)) as ex:
            results = list(ex.map(lambda m: read_all(m.mnt, self.keys), fleet))
        for m, (_, shas, _) in zip(fleet, results, strict=True):
            bad = [k for k in self.keys if shas[k] != self.shas[k]]
            if bad:
                raise BenchError(f"{m.mnt}: wrong bytes in {bad}")
        return [r[0] for r in results]

    def _egress(self) -> int:
        assert self.proxy is not None
        return self.proxy.bytes_down

    @staticmethod
    def _near_read(fleet: list[TierfsMount]) -> float:
        return sum(m.metrics().get(("tierfs_tier_bytes_total",
                                    (("direction", "read"), ("tier", "near"))), 0)
                   for m in fleet)

    def _done(self, fleet: list[TierfsMount]) -> None:
        for m in fleet:
            m.unmount()

    def origin_only(self) -> Pass:
        fleet = self.fleet("o", self.nodes)
        e0 = self._egress()
        walls = self._read(fleet)
        p = Pass("origin only", self.nodes, self._egress() - e0, None,
                 statistics.median(walls), max(walls), 0)
        self._done(fleet)
        self._log(p)
        return p

    def promoted(self) -> Pass:
        fleet = self.fleet("p", self.nodes, self._near_args())
        e0 = self._egress()
        t0 = time.perf_counter()
        first = self._read(fleet[:1])
        self._wait_copied(fleet[0])
        fill = time.perf_counter() - t0
        walls = self._read(fleet[1:]) if len(fleet) > 1 else first
        p = Pass("near, promoted by node 1", self.nodes, self._egress() - e0, fill,
                 statistics.median(walls), max(walls), self._near_read(fleet[1:]))
        self._done(fleet)
        self._log(p)
        return p

    def _wait_copied(self, m: TierfsMount, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        key = ("tierfs_tier_promotions_total", (("outcome", "copied"), ("tier", "near")))
        while m.metrics().get(key, 0) < self.files:
            if time.monotonic() > deadline:
                raise BenchError(f"promotion of {self.files} files not done in {timeout:.0f}s")
            time.sleep(0.2)

    def warmed(self) -> Pass:
        fleet = self.fleet("w", self.nodes, self._near_args())
        e0 = self._egress()
        t0 = time.perf_counter()
        r = subprocess.run([*run._tierfs_cmd(), "warm", "--tier", "near",
                            os.path.join(fleet[0].mnt, "set")], capture_output=True, text=True,
                           timeout=1800, env=run.Source.env(dict(os.environ)), cwd=self.root)
        if r.returncode != 0:
            raise BenchError(f"tierfs warm --tier near failed: {r.stderr.strip()}")
        fill = time.perf_counter() - t0
        walls = self._read(fleet)
        p = Pass("near, warmed (warm --tier near)", self.nodes, self._egress() - e0, fill,
                 statistics.median(walls), max(walls), self._near_read(fleet))
        self._done(fleet)
        self._log(p)
        return p

    def _log(self, p: Pass) -> None:
        fill = "" if p.fill_s is None else f", near store filled in {p.fill_s:.1f}s"
        log(f"{p.name}: WAN egress {p.egress / MiB:.0f} MiB ({p.egress / self.size:.2f}x the "
            f"set){fill}, fleet read median {p.read_median_s:.1f}s, slowest "
            f"{p.read_max_s:.1f}s")

    def cleanup(self) -> None:
        run.run_all([*(m.unmount for m in self.mounts),
                     *([self.proxy.stop] if self.proxy is not None else []),
                     self.origin.stop, self.near.stop])


def print_table(bench: TiersBench, header: str) -> None:
    base = bench.passes[0] if bench.passes else None
    print(f"\n{header}\n")
    print("| pass | nodes | WAN egress (MiB) | egress / set | near store filled (s) | "
          "fleet read median / slowest (s) | read time / origin only |")
    print("|---|---|---|---|---|---|---|")
    for p in bench.passes:
        fill = "-" if p.fill_s is None else f"{p.fill_s:.1f}"
        ratio = f"{p.read_median_s / base.read_median_s:.2f}" if base else "-"
        print(f"| {p.name} | {p.nodes} | {p.egress / MiB:.0f} | {p.egress / bench.size:.2f} "
              f"| {fill} | {p.read_median_s:.1f} / {p.read_max_s:.1f} | {ratio} |")
    print("\n(promoted: node 1's own read is part of the fill time; the read columns are "
          "nodes 2..N. The checkpoint rows of issue 29 are not measured: --writeback-to "
          "near is not built.)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, help="the data set (default 512; --quick 128)")
    ap.add_argument("--files", type=int, default=16, help="files in the set (default 16)")
    ap.add_argument("--nodes", type=int, default=3, help="nodes reading it (default 3)")
    ap.add_argument("--rtt-ms", type=float, default=50.0, help="WAN delay per request (50)")
    ap.add_argument("--wan-mib", type=float, default=100.0, help="WAN cap, MiB/s each way (100)")
    ap.add_argument("--quick", action="store_true", help="a 128 MiB set")
    ap.add_argument("--ref", metavar="GIT_REF", help="run the daemons from a snapshot of a commit")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    args = ap.parse_args()
    if args.files < 1 or args.nodes < 2 or args.rtt_ms < 0 or args.wan_mib <= 0:
        print("error: --files >= 1, --nodes >= 2, --rtt-ms >= 0 and --wan-mib > 0",
              file=sys.stderr)
        return 2
    run.stop_on_signals()
    size = (args.size_mib or (128 if args.quick else 512)) * MiB
    size = size // args.files * args.files
    root = tempfile.mkdtemp(prefix="tierfs-tbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    bench = TiersBench(size, args.files, args.nodes, args.rtt_ms / 1000,
                       args.wan_mib * MiB, root)
    ok = run.drive(bench, root, args.ref, args.keep,
                   f"work dir {root}; set {size // MiB} MiB in {args.files} files; "
                   f"{args.nodes} nodes; WAN {args.rtt_ms:g} ms, {args.wan_mib:g} MiB/s")
    _, code = run.code_label(args.ref)
    print_table(bench, f"tierfs near-store bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  "
                       f"set {size // MiB} MiB / {args.files} files  {args.nodes} nodes  WAN "
                       f"{args.rtt_ms:g} ms {args.wan_mib:g} MiB/s  "
                       f"{time.perf_counter() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
