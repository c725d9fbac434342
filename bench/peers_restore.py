#!/usr/bin/env python3
"""tierfs peer-restore benchmark: N nodes restoring one checkpoint at once, with and without peers.

    .venv/bin/python bench/peers_restore.py               # 512 MiB checkpoint (4 files), N = 1, 2, 4, 8
    .venv/bin/python bench/peers_restore.py --quick       # 128 MiB
    .venv/bin/python bench/peers_restore.py --nodes 1,8 --size-mib 256

One command, like bench/run.py (whose RGW, mount and helper code it imports): starts its own
throw-away Ceph RGW, uploads the checkpoint, then for each N and each mode mounts N fresh
tierfs daemons (new cache dirs; started at once) on 127.0.0.1 and has every node read every
file of the checkpoint whole, 1 MiB reads, all nodes at the same time; every byte read is
checked by sha256. With peers, the N daemons share one peers file and one 0600 secret file.
Prints one line per (mode, N): wall time per node (median, max), bytes from the store
(tierfs_backend_bytes_total, all nodes), bytes between peers (tierfs_peer_bytes_total
{direction="in"}), daemon CPU (utime+stime from /proc/PID/stat, all daemons) per GiB read by
the nodes. Everything it started is stopped in `finally` blocks. Needs root, /dev/fuse,
fusermount3 and the ceph packages. See bench/README.md ("Peer restore benchmark").
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen
import run
from run import (
    BUCKET,
    BenchError,
    GiB,
    MiB,
    TierfsMount,
    drop_caches,
    free_port,
    log,
    mem_available,
    proc_cpu,
)

SEED = 900
READ = MiB  # the nodes' read() size


@dataclass
class Plan:
    size: int          # the whole checkpoint
    files: int
    nodes: list[int]
    memory_cache: int = 128 * MiB

    @property
    def per_file(self) -> int:
        return self.size // self.files


@dataclass
class Line:
    peers: bool
    n: int
    wall_median: float
    wall_max: float
    store_bytes: float
    store_gets: float
    peer_bytes: float
    cpu_s: float
    read_bytes: int
    peer_results: dict

    def cells(self, ckpt: int) -> list[str]:
        gib = self.read_bytes / GiB
        return ["yes" if self.peers else "no", str(self.n), f"{self.wall_median:.2f}",
                f"{self.wall_max:.2f}",
                f"{self.read_bytes / self.n / MiB / self.wall_median:.0f}",
                f"{self.store_bytes / MiB:.0f}", f"{self.store_bytes / ckpt:.2f}x",
                f"{self.store_gets:.0f}", f"{self.peer_bytes / MiB:.0f}",
                f"{self.cpu_s / gib:.2f}"]


HEAD = ["peers", "N", "wall median s", "wall max s", "MiB/s per node", "store MiB",
        "store/ckpt", "store GETs", "peer MiB", "daemon CPU s/GiB"]


def read_all(mnt: str, keys: list[str]) -> tuple[float, dict[str, str], int]:
    """One node's restore: every file in order, whole, 1 MiB reads. (seconds, sha256 by
    key, bytes); the hashing is outside the timed reads."""
    buf = bytearray(READ)
    view = memoryview(buf)
    shas, total, spent = {}, 0, 0.0
    for key in keys:
        h = hashlib.sha256()
        fd = os.open(os.path.join(mnt, key), os.O_RDONLY)
        try:
            while True:
                t = time.perf_counter()
                n = os.readv(fd, [buf])
                spent += time.perf_counter() - t
                if n == 0:
                    break
                h.update(view[:n])
                total += n
        finally:
            os.close(fd)
        shas[key] = h.hexdigest()
    return spent, shas, total


class PeersBench:
    def __init__(self, plan: Plan, root: str, keep: bool = False) -> None:
        self.plan = plan
        self.root = root
        self.keep = keep
        self.rgw = run.Rgw(root, max(4 * GiB, 3 * plan.size + GiB))
        self.mounts: list[TierfsMount] = []  # what run.finish() cleans up
        self.keys = [f"ckpt/shard-{i:02d}.pt" for i in range(plan.files)]
        self.shas: dict[str, str] = {}
        self.lines: list[Line] = []
        self.secret_file = os.path.join(root, "peer.secret")
        self.passes = 0

    def check_host(self) -> None:
        run.require_root_and_fuse()
        need = self.rgw.memstore_bytes + 2 * GiB
        if mem_available() < need:
            raise BenchError(f"needs {need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} available")

    def upload(self) -> None:
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        for i, key in enumerate(self.keys):
            data = datagen.make(self.plan.per_file, SEED + i)
            self.shas[key] = hashlib.sha256(data).hexdigest()
            run.Bench._upload_multipart(s3, key, _Bytes(data))
            del data
        log(f"uploaded {self.plan.files} x {self.plan.per_file / MiB:.0f} MiB")

    def write_secret(self) -> None:
        fd = os.open(self.secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
        finally:
            os.close(fd)

    def fleet(self, n: int, peers: bool) -> list[TierfsMount]:
        self.passes += 1
        ports = []
        while len(ports) < n:
            p = free_port()
            if p not in ports:
                ports.append(p)
        peers_file = os.path.join(self.root, f"peers-{self.passes}.txt")
        with open(peers_file, "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
        fleet = []
        for i, port in enumerate(ports):
            args = (("--peers", f"file:{peers_file}", "--peer-listen", f"127.0.0.1:{port}",
                     "--peer-secret-file", self.secret_file) if peers else ())
            fleet.append(TierfsMount(self.rgw, self.root, f"p{self.passes}n{i}",
                                     cache_size="8G", memory_cache_size=self.plan.memory_cache,
                                     extra_args=args))
        self.mounts.extend(fleet)
        errors: list[BaseException] = []

        def mount(m: TierfsMount) -> None:
            try:
                m.mount()
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

        threads = [threading.Thread(target=mount, args=(m,)) for m in fleet]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0] if isinstance(errors[0], BenchError) else BenchError(repr(errors[0]))
        return fleet

    def one(self, n: int, peers: bool) -> Line:
        fleet = self.fleet(n, peers)
        try:
            drop_caches()
            cpu0 = [proc_cpu(m.pid) for m in fleet]
            with ThreadPoolExecutor(n) as ex:
                results = list(ex.map(lambda m: read_all(m.mnt, self.keys), fleet))
            cpu = sum(proc_cpu(m.pid) - c for m, c in zip(fleet, cpu0))
            for m, (_, shas, _) in zip(fleet, results):
                bad = [k for k in self.keys if shas[k] != self.shas[k]]
                if bad:
                    raise BenchError(f"{m.mnt}: wrong bytes in {bad}")
            walls = [r[0] for r in results]
            results_by = {}
            for m in fleet:
                for (name, labels), v in m.metrics().items():
                    lbl = dict(labels)
                    if name == "tierfs_peer_requests_total" and lbl.get("role") == "client":
                        results_by[lbl["result"]] = results_by.get(lbl["result"], 0) + v
            line = Line(peers, n, statistics.median(walls), max(walls),
                        sum(m.counter("tierfs_backend_bytes_total") for m in fleet),
                        sum(m.requests().get("get", 0) for m in fleet),
                        sum(m.metrics().get(("tierfs_peer_bytes_total",
                                             (("direction", "in"),)), 0) for m in fleet),
                        cpu, sum(r[2] for r in results), results_by)
        finally:
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda m: m.unmount(), fleet))
            if not self.keep:
                for m in fleet:
                    shutil.rmtree(m.cache_dir, ignore_errors=True)
        log(f"peers={'yes' if peers else 'no'} N={n}: median {line.wall_median:.2f}s max "
            f"{line.wall_max:.2f}s, store {line.store_bytes / MiB:.0f} MiB, peers "
            f"{line.peer_bytes / MiB:.0f} MiB, peer requests {line.peer_results}")
        return line

    def run(self) -> None:
        self.check_host()
        self.rgw.start()
        self.upload()
        self.write_secret()
        for peers in (False, True):
            for n in self.plan.nodes:
                self.lines.append(self.one(n, peers))

    def cleanup(self) -> None:
        run.run_all([*(m.unmount for m in self.mounts), self.rgw.stop])


class _Bytes:
    """run.Bench._upload_multipart's data source (its `part(off, n)`) over one bytearray."""

    def __init__(self, data: bytearray) -> None:
        self.data = data
        self.size = len(data)

    def part(self, off: int, n: int) -> bytes:
        return bytes(self.data[off:off + n])


def print_lines(lines: list[Line], ckpt: int, header: str) -> None:
    rows = [HEAD] + [ln.cells(ckpt) for ln in lines]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    print(header)
    for j, r in enumerate(rows):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    print("store/ckpt: bytes all nodes fetched from the store over the checkpoint's size; "
          "daemon CPU: all daemons, per GiB the nodes read")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, help="checkpoint size (default 512; --quick 128)")
    ap.add_argument("--files", type=int, default=4, help="checkpoint files (default 4)")
    ap.add_argument("--nodes", default="1,2,4,8", help="node counts (default 1,2,4,8)")
    ap.add_argument("--quick", action="store_true", help="a 128 MiB checkpoint")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons from a snapshot of this commit instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    args = ap.parse_args()
    run.stop_on_signals()
    try:
        nodes = [int(x) for x in args.nodes.split(",")]
        if not nodes or min(nodes) < 1 or args.files < 1:
            raise ValueError
    except ValueError:
        print("error: --nodes wants counts like 1,2,4,8 and --files a positive number",
              file=sys.stderr)
        return 2
    size = (args.size_mib or (128 if args.quick else 512)) * MiB
    plan = Plan(size // args.files * args.files, args.files, nodes)
    root = tempfile.mkdtemp(prefix="tierfs-pbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    bench = PeersBench(plan, root, args.keep)
    ok = run.drive(bench, root, args.ref, args.keep,
                   f"work dir {root}; checkpoint {plan.files} x {plan.per_file / MiB:.0f} MiB; "
                   f"nodes {nodes}")
    _, code = run.code_label(args.ref)
    header = (f"tierfs peer restore bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  "
              f"checkpoint {plan.size // MiB} MiB in {plan.files} files  load {load0:.1f} at "
              f"start, {os.getloadavg()[0]:.1f} at end  {time.perf_counter() - t0:.0f}s")
    if bench.lines:
        print_lines(bench.lines, plan.size, header)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
