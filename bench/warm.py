#!/usr/bin/env python3
"""tierfs warm benchmark: `tierfs warm` beside boto3 doing the same GETs, in the same run.

    .venv/bin/python bench/warm.py [--quick] [--concurrency N] [--json FILE] [--ref REF]

One command, like bench/run.py (whose RGW, mount, metrics, table and JSON helpers it
imports): starts its own throw-away Ceph RGW, uploads the data, mounts tierfs (a fresh
cache dir for every pass), runs `tierfs warm ... --json` against it, reads everything it
warmed back through the mount and compares every byte, prints a table; everything it
started is stopped in `finally` blocks. Needs root (drop caches, /run/tierfs), /dev/fuse,
fusermount3 and the ceph packages. See bench/README.md ("Warm benchmark") for the rows.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the read benchmark and the shared helpers)
from run import (BUCKET, CHUNK, GiB, KiB, MiB, BenchError, Pass, Profiler, Row,  # noqa: E402
                 Source, TierfsMount, drop_caches, log, mem_available, print_table,
                 req_delta, seq_read, write_json)

LARGE_KEY = "large/big.bin"
FG_KEY = "fg/reader.bin"
LARGE_SEED, FG_SEED, BULK_SEED, SMALL_SEED = 700, 800, 900, 10_000
DEFAULT_WARM_CONCURRENCY = 16  # tierfs's -o warm_concurrency default (config.py)
UPLOAD_THREADS = 32
READ_BS = MiB  # the foreground reader's read size (see README: why 1 MiB)
PAUSE_S = 0.3  # row 3's pausing reader: shorter than the warm lane's WARM_QUIET_S (2 s)
PAUSED_READS = 32  # ...and how many reads it makes (the first of row 3's offsets)
BULK_SRC = "bulk/src.bin"  # row 3's warm set: this object and server-side copies of it


# ---------------------------------------------------------------------------------------
# data: datagen.make's bytes, any slice computed on demand (nothing large held in memory)


class _Pieces:
    def __init__(self, lazy: "Lazy") -> None:
        self.lazy = lazy

    def __getitem__(self, i: int) -> bytearray:
        return self.lazy.slice(i * MiB, MiB)


class Lazy:
    """The bytes datagen.make(size, seed) returns, without building them: a slice is the
    16 MiB pattern rotated, then the (seed, offset) header of every 4 KiB page. Offers what
    run.seq_read and run.Bench._upload_multipart use of run.Pieces (.size, .pieces[i],
    .slice, .part); checked against datagen.make at start (self_test)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.pool = hashlib.shake_256(f"tierfs-bench-{seed}".encode()).digest(
            min(datagen._PATTERN, max(size, 1)))
        self.pieces = _Pieces(self)

    def slice(self, off: int, n: int) -> bytearray:
        n = max(0, min(n, self.size - off))
        out = bytearray(n)
        step = len(self.pool)
        pos = 0
        while pos < n:
            o = (off + pos) % step
            take = min(step - o, n - pos)
            out[pos:pos + take] = self.pool[o:o + take]
            pos += take
        hs = datagen._HEAD.size
        page = off // datagen.PAGE * datagen.PAGE
        while page < off + n:
            if page <= self.size - hs:
                head = datagen._HEAD.pack(self.seed, page)
                lo, hi = max(page, off), min(page + hs, off + n)
                if lo < hi:
                    out[lo - off:hi - off] = head[lo - page:hi - page]
            page += datagen.PAGE
        return out

    def part(self, off: int, n: int) -> bytes:
        return bytes(self.slice(off, n))

    @staticmethod
    def self_test() -> None:
        rng = random.Random(5)
        for size, seed in ((3 * MiB + 12345, 4), (17 * MiB + 7, 9)):
            want = datagen.make(size, seed)
            lz = Lazy(size, seed)
            cuts = [(0, size), (size - 5, 10)] + [
                (rng.randrange(size), rng.choice((1, 7, 4096, MiB + 3))) for _ in range(40)]
            for off, n in cuts:
                if lz.slice(off, n) != want[off:off + n]:
                    raise BenchError(f"bench bug: Lazy({size}, {seed}).slice({off}, {n}) "
                                     "differs from datagen.make")


# ---------------------------------------------------------------------------------------
# plan


@dataclass
class WarmPlan:
    large: int  # row 1's file
    small_count: int  # row 2's files
    small_dirs: int
    fg: int  # row 3's foreground file (read cold, one read per chunk)
    bulk: int  # row 3's warm set: bulk/src.bin and copies of it, this many bytes in all
    bulk_part: int  # the size of bulk/src.bin (what the RGW stores of the set)
    concurrency: int  # the warm's --concurrency and the ceilings' threads
    alone_s: float  # row 3: warm-only windows before and after the foreground reads
    cache_size: str = "24G"
    memory_cache: int = 256 * MiB
    read_threads: int = 8  # threads reading the small files back
    small_min: int = 4 * KiB
    small_max: int = 64 * KiB

    @classmethod
    def make(cls, args: argparse.Namespace) -> "WarmPlan":
        q = args.quick
        p = cls(large=(args.size_mib or (256 if q else 1024)) * MiB,
                small_count=args.small_files or (2000 if q else 10_000),
                small_dirs=4 if q else 8,
                fg=(args.fg_mib or (512 if q else 1024)) * MiB,
                bulk=(args.bulk_mib or (8192 if q else 12288)) * MiB,
                bulk_part=(256 if q else 512) * MiB,
                concurrency=args.concurrency, alone_s=1.5 if q else 2.0)
        if p.large < 16 * MiB or p.fg < 8 * CHUNK or p.small_count < 1 or p.bulk < p.bulk_part:
            raise BenchError("--size-mib must be at least 16, --fg-mib at least 64, "
                             f"--bulk-mib at least {p.bulk_part // MiB}, --small-files at least 1")
        if not 1 <= p.concurrency <= 256:
            raise BenchError("--concurrency must be between 1 and 256")
        return p

    @property
    def small_avg(self) -> int:
        return (self.small_min + self.small_max) // 2

    @property
    def stored(self) -> int:
        return self.large + self.small_count * self.small_avg + self.fg + self.bulk_part

    @property
    def bulk_files(self) -> list[tuple[str, int]]:
        """bulk/src.bin, then the keys of its copies (the RGW copies a large object by
        reference: its tail stays stored once, so the set costs the memstore one part)."""
        n = self.bulk // self.bulk_part
        return [(BULK_SRC, self.bulk_part)] + [(f"bulk/c{i:03d}.bin", self.bulk_part)
                                               for i in range(1, n)]


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]


# ---------------------------------------------------------------------------------------
# `tierfs warm` as a subprocess, its JSON lines read as they come


class WarmProc:
    def __init__(self, root: str, paths: list[str], concurrency: int) -> None:
        self.cmd = [*run._tierfs_cmd(), "warm", *paths, "--json",
                    "--concurrency", str(concurrency)]
        self.root = root
        self.errfile = os.path.join(root, f"warm-{time.monotonic_ns()}.err")
        self.proc: subprocess.Popen | None = None
        self.events: list[tuple[float, dict]] = []  # (perf_counter when read, event)
        self.summary: dict | None = None
        self.t_start = self.t_end = 0.0
        self.t_fetching: float | None = None  # first progress event with bytes fetched
        self.started_fetching = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> "WarmProc":
        self.t_start = time.perf_counter()
        with open(self.errfile, "wb") as err:
            # cwd outside the repo: `python -m tierfs` puts the cwd first on sys.path
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL, text=True, cwd=self.root,
                                         env=Source.env(dict(os.environ)))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.perf_counter()
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.events.append((now, ev))
            if ev.get("event") == "summary":
                self.summary = ev
                self.t_end = now
            if self.t_fetching is None and ev.get("bytes_fetched", 0) > 0:
                self.t_fetching = now
                self.started_fetching.set()
        self.started_fetching.set()  # ended (perhaps without fetching): waiters wake

    @property
    def done_frac(self) -> float:
        """bytes_done / bytes of the last progress event (0 while listing)."""
        for _, ev in reversed(self.events):
            if ev.get("bytes"):
                return ev.get("bytes_done", 0) / ev["bytes"]
        return 0.0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.summary is None

    def stderr(self) -> str:
        try:
            with open(self.errfile, errors="replace") as f:
                return f.read().strip()[-2000:]
        except OSError:
            return ""

    def wait(self, timeout: float = 1800) -> dict:
        assert self.proc is not None and self._reader is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise BenchError(f"tierfs warm did not finish in {timeout:.0f} s") from None
        self._reader.join(30)
        if not self.t_end:
            self.t_end = time.perf_counter()
        if rc != 0 or self.summary is None:
            raise BenchError(f"tierfs warm exited {rc}: {self.stderr()}")
        return self.summary

    @property
    def wall(self) -> float:
        return self.t_end - self.t_start

    def stop(self) -> None:
        """Ctrl-C the client (the daemon cancels the warm when the client leaves)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


LOAD_SCRIPT = r"""
import os, sys, threading
import boto3
from botocore.config import Config
threads, chunk = int(sys.argv[1]), int(sys.argv[2])
jobs = [(k, off, min(chunk, int(n) - off)) for k, n in (a.rsplit(":", 1) for a in sys.argv[3:])
        for off in range(0, int(n), chunk)]
cfg = Config(s3={"addressing_style": "path"}, max_pool_connections=threads + 4,
             request_checksum_calculation="when_required",
             response_checksum_validation="when_required")
s3 = boto3.session.Session().client("s3", endpoint_url=os.environ["S3_ENDPOINT"], config=cfg)
bucket, stop, got = os.environ["BENCH_BUCKET"], threading.Event(), [0] * threads
def work(i):
    j = i
    while not stop.is_set():
        k, off, n = jobs[j % len(jobs)]
        r = s3.get_object(Bucket=bucket, Key=k, Range=f"bytes={off}-{off + n - 1}")
        got[i] += len(r["Body"].read())
        j += threads
ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
[t.start() for t in ts]
print("READY", flush=True)
sys.stdin.read()
stop.set()
[t.join() for t in ts]
print(sum(got), flush=True)
"""


class LoadProc:
    """Another process doing CHUNK-sized ranged GETs of bulk/ with `threads` boto3 threads
    in a loop, until its stdin closes: load on the RGW and the CPUs that is not tierfs's."""

    def __init__(self, rgw: run.Rgw, objects: list[tuple[str, int]], threads: int) -> None:
        e = rgw.env
        self.env = dict(os.environ, S3_ENDPOINT=e["S3_ENDPOINT"], BENCH_BUCKET=BUCKET,
                        AWS_ACCESS_KEY_ID=e["S3_ACCESS_KEY"],
                        AWS_SECRET_ACCESS_KEY=e["S3_SECRET_KEY"],
                        AWS_DEFAULT_REGION=e.get("S3_REGION", "us-east-1"))
        self.cmd = [sys.executable, "-c", LOAD_SCRIPT, str(threads), str(CHUNK),
                    *[f"{k}:{n}" for k, n in objects]]
        self.proc: subprocess.Popen | None = None
        self.t_ready = 0.0

    def start(self) -> "LoadProc":
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "READY":
            self.stop()
            raise BenchError("the boto3 load process did not start")
        self.t_ready = time.perf_counter()
        return self

    def finish(self) -> tuple[int, float]:
        """Stop it: (bytes it fetched, seconds since it was ready)."""
        assert self.proc is not None
        out, _ = self.proc.communicate(timeout=120)
        dt = time.perf_counter() - self.t_ready
        self.proc = None
        return int(out.strip() or 0), dt

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


# ---------------------------------------------------------------------------------------
# the benchmark


class WarmBench(run.Bench):
    """Reuses run.Bench's mounts, add() and cleanup(); its own data and passes."""

    def __init__(self, plan: WarmPlan, root: str) -> None:  # noqa: D107
        self.plan = plan  # type: ignore[assignment]
        self.repeat = 1
        self.root = root
        self.rows: list[Row] = []
        self.stored = plan.stored
        self.memstore = max(6 * GiB, 2 * self.stored + 2 * GiB)
        self.rgw = run.Rgw(root, self.memstore)
        self.mounts: list[TierfsMount] = []
        self.memfs = None
        self.warms: list[WarmProc] = []
        self.loads: list[LoadProc] = []
        self.small: dict[str, bytes] = {}
        self.large_data = Lazy(plan.large, LARGE_SEED)
        self.fg_data = Lazy(plan.fg, FG_SEED)
        self.bulk = Lazy(plan.bulk_part, BULK_SEED)
        self.profile_out: dict[str, str] = {}

    def add(self, row: Row) -> Row:
        t = row.target
        if t.startswith("<=") and t.endswith("x") and row.ratio is not None:  # lower is better
            row.status = "PASS" if row.ratio <= float(t[2:-1]) else "MISS"
        elif t == "=ceiling" and row.tierfs is not None:  # run.judge knows neither
            row.status = "PASS" if row.tierfs == row.ceiling else "MISS"
        return super().add(row)

    # ---- setup ----------------------------------------------------------------------

    def check_host(self) -> None:
        run.require_root_and_fuse()
        p = self.plan
        # the RGW's memstore ~2x what it stores; the bench holds the small files (the
        # large ones are generated slice by slice); the daemons' memory tiers
        need = 2 * p.stored + p.small_count * p.small_avg + 2 * GiB
        if mem_available() < need:
            raise BenchError(f"needs ~{need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} GiB available: use --quick or "
                             "smaller --size-mib / --bulk-mib / --fg-mib / --small-files")
        # the cache dirs (each removed after its pass, unless --keep): row 3's warm may fetch
        # all of bulk/ and must fit --cache-size and the disk's min-free reserve
        disk = shutil.disk_usage(self.root)
        want = p.stored + p.bulk + 0.1 * disk.total
        if disk.free < want:
            raise BenchError(f"needs ~{want / GiB:.1f} GiB free under {self.root} for the "
                             f"cache dirs, {disk.free / GiB:.1f} GiB free: use --quick or a "
                             "smaller --bulk-mib")

    def generate(self) -> None:
        p = self.plan
        Lazy.self_test()
        rng = random.Random(11)
        for i in range(p.small_count):
            size = rng.randrange(p.small_min, p.small_max + 1)
            self.small[f"small/d{i % p.small_dirs:02d}/f{i:05d}.bin"] = bytes(
                datagen.make(size, SMALL_SEED + i))

    def upload(self, s3) -> None:  # noqa: ANN001
        p = self.plan
        t0 = time.perf_counter()
        for key, lz in [(LARGE_KEY, self.large_data), (FG_KEY, self.fg_data), (BULK_SRC, self.bulk)]:
            self._upload_multipart(s3, key, lz)  # type: ignore[arg-type]
        copies = [k for k, _ in p.bulk_files if k != BULK_SRC]
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda k: s3.copy_object(Bucket=BUCKET, Key=k, CopySource={
                "Bucket": BUCKET, "Key": BULK_SRC}), copies))
        for k in copies[:1] + copies[-1:]:  # a copy is the same bytes
            off = p.bulk_part - MiB - 12345
            got = s3.get_object(Bucket=BUCKET, Key=k, Range=f"bytes={off}-{off + MiB - 1}")
            if got["Body"].read() != self.bulk.slice(off, MiB):
                raise BenchError(f"s3://{BUCKET}/{k}: a copy of {BULK_SRC} with other bytes")
        t1 = time.perf_counter()
        with ThreadPoolExecutor(UPLOAD_THREADS) as ex:
            for f in [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=v)
                      for k, v in self.small.items()]:
                f.result()
        t2 = time.perf_counter()
        log(f"uploaded {p.stored / MiB:,.0f} MiB: 3 large objects and {len(copies)} copies "
            f"in {t1 - t0:.1f}s, {len(self.small):,} small ones ({UPLOAD_THREADS} threads) in "
            f"{t2 - t1:.1f}s")

    def mount(self, name: str) -> TierfsMount:
        p = self.plan
        extra: tuple[str, ...] = ()
        if p.concurrency != DEFAULT_WARM_CONCURRENCY:  # the warm lane as wide as --concurrency
            extra = ("-o", f"warm_concurrency={p.concurrency}")
        m = self.new_mount(name, cache_size=p.cache_size, memory_cache_size=p.memory_cache,
                           extra_args=extra)
        m.mount()
        return m

    def done_with(self, m: TierfsMount, keep: bool) -> None:
        m.unmount()
        if not keep:  # the cache dirs add up to more than the data: free the disk as we go
            shutil.rmtree(m.cache_dir, ignore_errors=True)

    def warm(self, m: TierfsMount, rels: list[str]) -> WarmProc:
        w = WarmProc(self.root, [os.path.join(m.mnt, r) for r in rels], self.plan.concurrency)
        self.warms.append(w)
        return w.start()

    @staticmethod
    def check_summary(what: str, s: dict, files: int, size: int) -> None:
        want = {"files": files, "bytes": size, "bytes_cached_before": 0, "bytes_fetched": size,
                "error_count": 0}
        got = {k: s.get(k) for k in want}
        if got != want:
            raise BenchError(f"{what}: warm summary {got}, expected {want}: {s.get('errors')}")

    @staticmethod
    def metric(m: TierfsMount, name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in m.metrics().items() if n == name
                   and all(dict(lab).get(k) == want for k, want in labels.items()))

    # ---- row 1: one large file ------------------------------------------------------

    def boto3_ranged(self, s3, key: str, size: int) -> tuple[float, float]:  # noqa: ANN001
        """CHUNK-sized ranged GETs, `concurrency` threads, one client: (seconds, CPU s)."""
        def get(off: int) -> int:
            end = min(off + CHUNK, size) - 1
            return len(s3.get_object(Bucket=BUCKET, Key=key,
                                     Range=f"bytes={off}-{end}")["Body"].read())

        drop_caches()
        c0 = time.process_time()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.plan.concurrency) as ex:
            n = sum(ex.map(get, range(0, size, CHUNK)))
        dt = time.perf_counter() - t0
        if n != size:
            raise BenchError(f"boto3 ranged GETs of {key} returned {n} bytes, expected {size}")
        return dt, time.process_time() - c0

    def row_1(self, s3, keep: bool) -> None:  # noqa: ANN001
        p = self.plan
        c = p.concurrency
        mib = p.large / MiB
        log(f"row 1: boto3 {CHUNK // MiB} MiB ranged GETs of {mib:.0f} MiB, {c} threads")
        b3_s, b3_cpu = self.boto3_ranged(s3, LARGE_KEY, p.large)

        log(f"row 1: tierfs warm of the {mib:.0f} MiB file on a fresh mount, --concurrency {c}")
        m = self.mount("large")
        with Pass(m.pid) as ps:
            r0 = m.requests()
            w = self.warm(m, [LARGE_KEY])
            s = w.wait()
        req = req_delta(r0, m.requests())
        self.check_summary("row 1", s, 1, p.large)
        chunks = -(-p.large // CHUNK)
        if req.get("get", 0) != chunks:
            raise BenchError(f"row 1: the warm sent {req.get('get', 0)} GETs for {chunks} chunks")

        log("row 1: read of the warmed file through the mount (page cache dropped)")
        drop_caches()
        r1 = m.requests()
        n, dt = seq_read(os.path.join(m.mnt, LARGE_KEY), self.large_data)  # type: ignore[arg-type]
        rreq = req_delta(r1, m.requests())
        self.done_with(m, keep)

        self.add(Row("1", f"warm {mib:.0f} MiB file, fresh mount (summary seconds)", "MiB/s",
                     mib / s["seconds"], f"boto3 {CHUNK // MiB} MiB ranged GETs x {c} threads",
                     mib / b3_s, target=">=0.8x",
                     note=f"warm {s['seconds']:.2f} s by its summary, {w.wall:.2f} s wall "
                          f"(`tierfs warm` client start-up and listing included); backend "
                          f"requests {req}; daemon CPU {ps.cpu / (p.large / GiB):.2f} s/GiB, "
                          f"boto3 (bench process) {b3_cpu / (p.large / GiB):.2f} s/GiB",
                     extra={"warm_s": s["seconds"], "wall_s": w.wall, "boto3_s": b3_s,
                            "daemon_cpu_s": ps.cpu, "boto3_cpu_s": b3_cpu}))
        self.add(Row("1", "same warm, wall time of the `tierfs warm` command", "MiB/s",
                     mib / w.wall, f"boto3 {CHUNK // MiB} MiB ranged GETs x {c} threads",
                     mib / b3_s))
        self.add(Row("1", "read of the warmed file through the mount: backend GETs", "GETs",
                     rreq.get("get", 0), target="=0",
                     note=f"{n / MiB / dt:,.0f} MiB/s (1 MiB reads, page cache dropped, every "
                          f"byte compared); all backend requests {rreq or 0}"))

    # ---- row 2: many small files ----------------------------------------------------

    def row_2(self, s3, keep: bool) -> None:  # noqa: ANN001
        p = self.plan
        c = p.concurrency
        keys = list(self.small)
        total = sum(len(v) for v in self.small.values())
        per_dir = collections.Counter(k.rsplit("/", 1)[0] for k in keys)
        pages = sum(-(-n // 1000) for n in per_dir.values())
        label = f"{len(keys):,} files {p.small_min // KiB}-{p.small_max // KiB} KiB in " \
                f"{len(per_dir)} dirs"

        log(f"row 2: boto3 GETs of the {len(keys):,} small objects, {c} threads, one client")

        def get(k: str) -> int:
            return len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read())

        drop_caches()
        c0 = time.process_time()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as ex:
            n = sum(ex.map(get, keys))
        b3_s = time.perf_counter() - t0
        b3_cpu = time.process_time() - c0
        if n != total:
            raise BenchError(f"boto3 read {n} bytes of small objects, expected {total}")

        log(f"row 2: tierfs warm of small/ ({label}) on a fresh mount, --concurrency {c}")
        m = self.mount("small")
        with Pass(m.pid) as ps:
            r0 = m.requests()
            w = self.warm(m, ["small"])
            s = w.wait()
        req = req_delta(r0, m.requests())
        self.check_summary("row 2", s, len(keys), total)

        log(f"row 2: read of the {len(keys):,} warmed files through the mount, "
            f"{p.read_threads} threads (page cache dropped)")

        def through(k: str) -> int:
            data = run.read_whole(os.path.join(m.mnt, k))
            if data != self.small[k]:
                raise BenchError(f"{k}: wrong bytes through tierfs")
            return len(data)

        drop_caches()
        r1 = m.requests()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(p.read_threads) as ex:
            sum(ex.map(through, keys))
        read_s = time.perf_counter() - t0
        rreq = req_delta(r1, m.requests())
        since = time.perf_counter() - w.t_start
        self.done_with(m, keep)

        self.add(Row("2", f"warm {label}, fresh mount (summary seconds)", "files/s",
                     len(keys) / s["seconds"], f"boto3 GET x {c} threads, one client",
                     len(keys) / b3_s, target=">=0.7x",
                     note=f"warm {s['seconds']:.2f} s by its summary (listing included), "
                          f"{w.wall:.2f} s wall, {total / MiB / s['seconds']:,.1f} MiB/s; "
                          f"daemon CPU {ps.cpu / len(keys) * 1e3:.2f} ms/file, boto3 (bench "
                          f"process) {b3_cpu / len(keys) * 1e3:.2f} ms/file",
                     extra={"warm_s": s["seconds"], "wall_s": w.wall, "boto3_s": b3_s,
                            "daemon_cpu_s": ps.cpu, "boto3_cpu_s": b3_cpu, "req": req}))
        self.add(Row("2", "same warm, wall time of the `tierfs warm` command", "files/s",
                     len(keys) / w.wall, f"boto3 GET x {c} threads, one client",
                     len(keys) / b3_s))
        self.add(Row("2", "warm: GET requests", "GETs", req.get("get", 0), "one per file",
                     len(keys), target="=ceiling", note=f"all backend requests {req}"))
        self.add(Row("2", "warm: HEAD requests", "HEADs", req.get("head", 0), target="=0"))
        self.add(Row("2", "warm: LIST requests", "LISTs", req.get("list", 0),
                     "1 per 1,000 keys per dir + 4", pages + 4, target="<=ceiling",
                     note=f"{len(per_dir)} directories of {min(per_dir.values()):,}-"
                          f"{max(per_dir.values()):,} keys = {pages} LIST pages; the +4 is the "
                          "root, small/ itself and the lookup of small (two)"))
        self.add(Row("2", "read of the warmed files through the mount: backend GETs", "GETs",
                     rreq.get("get", 0), target="=0",
                     note=f"{len(keys) / read_s:,.0f} files/s, {p.read_threads} threads, every "
                          f"byte compared; all backend requests {rreq or 0} (the metadata TTL, "
                          f"{run.DEFAULT_TTL:.0f} s, had run {since:.0f} s since the warm began)"))

    # ---- row 3: foreground reads while a warm runs -----------------------------------

    def fg_offsets(self) -> list[int]:
        """One READ_BS read per chunk of the foreground file, in random order: every read
        is cold, each costs one chunk GET. The read sits in the chunk's first 6 MiB, so the
        kernel's read-ahead (read_ahead_kb 1024 on a tierfs mount) stays in the chunk."""
        rng = random.Random(13)
        chunks = list(range(self.plan.fg // CHUNK))
        rng.shuffle(chunks)
        per = (CHUNK - 2 * MiB) // READ_BS
        return [c * CHUNK + rng.randrange(per) * READ_BS for c in chunks]

    def fg_read(self, m: TierfsMount, offsets: list[int],
                pause: float = 0.0) -> list[tuple[float, float]]:
        """pread READ_BS at each offset on one fd, `pause` s before each (not timed):
        (start, end) perf_counter of each read."""
        path = os.path.join(m.mnt, FG_KEY)
        out = []
        fd = os.open(path, os.O_RDONLY)
        try:
            for off in offsets:
                if pause:
                    time.sleep(pause)
                t0 = time.perf_counter()
                data = os.pread(fd, READ_BS, off)
                t1 = time.perf_counter()
                if data != self.fg_data.slice(off, READ_BS):
                    raise BenchError(f"{FG_KEY}: wrong bytes at offset {off}")
                out.append((t0, t1))
        finally:
            os.close(fd)
        return out

    def fg_mount(self, name: str) -> TierfsMount:
        """A fresh mount for a reader pass: the file looked up, then the caches dropped."""
        m = self.mount(name)
        os.stat(os.path.join(m.mnt, FG_KEY))  # the lookup outside the timed reads
        drop_caches()
        return m

    def latency_rows(self, label: str, ms: list[float], base_name: str, base: list[float],
                     note: str, targets: tuple[str, str] = ("", ""), key: str = "") -> None:
        """Two rows, p50 and p99 of `ms` beside the same percentile of `base`."""
        for q, target in zip((50, 99), targets):
            self.add(Row("3", f"{label} p{q}", "ms", pct(ms, q), f"{base_name} p{q}",
                         pct(base, q), target=target, note=note if q == 50 else "",
                         extra={key: [round(x, 2) for x in ms]} if key and q == 50 else {}))

    def shared_reads(self, m: TierfsMount, offsets: list[int],
                     profile: str | None = None, pause: float = 0.0) -> dict:
        """The reads on `m` while one `tierfs warm` of bulk/ fetches: a window with the warm
        alone, the reads, another window with the warm alone; then the warm is stopped."""
        p = self.plan
        wb = "tierfs_warm_bytes_total"
        w = self.warm(m, ["bulk"])
        try:
            w.started_fetching.wait(600)
            if not w.running:
                raise BenchError(f"row 3: the warm of bulk/ ended before the reads began: "
                                 f"{w.summary or w.stderr()}")
            t0, b0 = time.perf_counter(), self.metric(m, wb)
            time.sleep(p.alone_s)
            t1, b1 = time.perf_counter(), self.metric(m, wb)
            r0 = m.requests()
            if profile:
                with Profiler(m.pid, profile):
                    reads = self.fg_read(m, offsets, pause)
            else:
                reads = self.fg_read(m, offsets, pause)
            t2, b2 = time.perf_counter(), self.metric(m, wb)
            req = req_delta(r0, m.requests())
            overlapped = w.running
            time.sleep(p.alone_s)
            t3, b3 = time.perf_counter(), self.metric(m, wb)
            after = w.running
        finally:
            w.stop()
        if not overlapped or not after:
            raise BenchError(f"row 3: the warm of {p.bulk / MiB:,.0f} MiB ended before the "
                             "reads (and the window after them) did: give a larger --bulk-mib")
        return {"reads": reads, "req": req, "t": [t0, t1, t2, t3], "b": [b0, b1, b2, b3]}

    def row_3(self, keep: bool) -> None:
        p = self.plan
        offsets = self.fg_offsets()
        n = len(offsets)

        log(f"row 3: foreground reader alone: {n} cold {READ_BS // MiB} MiB preads of a "
            f"{p.fg // MiB} MiB file, fresh mount")
        a = self.fg_mount("fg-alone")
        r0 = a.requests()
        alone = self.fg_read(a, offsets)
        areq = req_delta(r0, a.requests())
        self.done_with(a, keep)
        alone_ms = [(t1 - t0) * 1e3 for t0, t1 in alone]

        copies = len(p.bulk_files)
        log(f"row 3: the same reads on a fresh mount while `tierfs warm` fetches bulk/ "
            f"({copies} objects of {p.bulk_part / MiB:,.0f} MiB, {p.bulk / GiB:.0f} GiB)")
        b = self.fg_mount("fg-shared")
        r = self.shared_reads(b, offsets)
        self.done_with(b, keep)
        shared_ms = [(e - s) * 1e3 for s, e in r["reads"]]
        (t0, t1, t2, t3), (b0, b1, b2, b3) = r["t"], r["b"]
        warm_alone = ((b1 - b0) + (b3 - b2)) / MiB / ((t1 - t0) + (t3 - t2))
        warm_shared = (b2 - b1) / MiB / (t2 - t1)

        self.latency_rows(
            f"foreground cold {READ_BS // MiB} MiB pread (x{n}), warm running", shared_ms,
            "same reads, no warm", alone_ms, targets=("<=2x", "<=3x"), key="shared_ms",
            note=f"one read per {CHUNK // MiB} MiB chunk, random order, each a chunk GET; "
                 f"every byte compared; mean {statistics.mean(shared_ms):.0f} ms shared vs "
                 f"{statistics.mean(alone_ms):.0f} ms alone, max {max(shared_ms):.0f} vs "
                 f"{max(alone_ms):.0f} ms; the reader alone sent {areq}; ratio = shared / "
                 "alone (lower is better)")
        self.rows[-1].extra["alone_ms"] = [round(x, 2) for x in alone_ms]
        self.add(Row("3", "warm of bulk/ while the reader ran", "MiB/s", warm_shared,
                     "the same warm, reader idle", warm_alone,
                     note=f"tierfs_warm_bytes over the {t2 - t1:.1f} s of reads vs "
                          f"{(t1 - t0) + (t3 - t2):.1f} s of warm alone (windows of "
                          f"{p.alone_s:.1f} s before and after the reads); the warm lane "
                          f"narrows to 1 of {p.concurrency} threads "
                          "while a foreground request is in flight; backend requests during "
                          f"the reads (the warm's and the reader's) {r['req']}; the warm was "
                          "stopped (Ctrl-C) after the second window",
                     extra={"t": r["t"], "bytes": r["b"]}))

        log(f"row 3: (info) the same reads with {PAUSE_S} s pauses, on a fresh mount, while "
            "`tierfs warm` fetches bulk/")
        d = self.fg_mount("fg-pause")
        r = self.shared_reads(d, offsets[:PAUSED_READS], pause=PAUSE_S)
        self.done_with(d, keep)
        paused_ms = [(e - s) * 1e3 for s, e in r["reads"]]
        self.latency_rows(
            f"(info) {len(paused_ms)} of the reads, {PAUSE_S} s pause before each, warm running",
            paused_ms, "no warm", alone_ms, key="paused_ms",
            note="a reader that computes between reads: the warm lane stays narrowed to one "
                 "GET for 2 s after the last foreground request (backend/runner.py "
                 "WARM_QUIET_S), so pauses shorter than that keep the warm narrow; compared "
                 "with the reads alone (no pause: a cold read alone does not depend on it); "
                 f"backend requests during the reads {r['req']}")

        lt = 1
        log(f"row 3: (info) the same reads on a fresh mount while another process GETs bulk/ "
            f"with {lt} boto3 threads (the warm lane's narrowed width)")
        c = self.fg_mount("fg-load")
        load = LoadProc(self.rgw, self.plan.bulk_files, lt)
        self.loads.append(load)
        load.start()
        time.sleep(p.alone_s)
        loaded = self.fg_read(c, offsets)
        nbytes, load_s = load.finish()
        self.done_with(c, keep)
        loaded_ms = [(e - s) * 1e3 for s, e in loaded]
        self.latency_rows(
            f"(info) same reads, {lt} boto3 GET thread{'s' if lt > 1 else ''} in another "
            "process", loaded_ms, "no load", alone_ms, key="loaded_ms",
            note=f"the load: {CHUNK // MiB} MiB ranged GETs of bulk/ in a loop, "
                 f"{nbytes / MiB / load_s:,.0f} MiB/s over its {load_s:.1f} s; what the RGW "
                 "and the 2 shared CPUs alone do to the reader when something else fetches as "
                 "wide as the narrowed warm lane (no tierfs warm)")

    # ---- profile (not part of the table) -------------------------------------------

    def profile_pass(self, keep: bool) -> None:
        import write  # noqa: PLC0415  (bench/write.py: summarise_profile)

        log(f"profile: py-spy of the daemon during one more large and one more small-file "
            f"warm, and one more shared reader pass (not measured) into {Profiler.out_dir}")
        for name, rels in (("profile-large", [LARGE_KEY]), ("profile-small", ["small"]),
                           ("profile-shared", [])):
            m = self.mount(name)
            drop_caches()
            if rels:
                with Profiler(m.pid, name):
                    w = self.warm(m, rels)
                    s = w.wait()
                log(f"profile: {name}: {s['bytes'] / MiB / s['seconds']:,.0f} MiB/s, "
                    f"{s['files'] / s['seconds']:,.0f} files/s under py-spy")
            else:  # row 3's shared pass: the foreground reads while bulk/ is warmed
                os.stat(os.path.join(m.mnt, FG_KEY))
                drop_caches()
                r = self.shared_reads(m, self.fg_offsets(), profile=name)
                ms = [(e - s) * 1e3 for s, e in r["reads"]]
                log(f"profile: {name}: foreground p50 {pct(ms, 50):.0f} ms, p99 "
                    f"{pct(ms, 99):.0f} ms under py-spy")
            self.done_with(m, keep)
            path = os.path.join(Profiler.out_dir or "", f"{name}.txt")
            if os.path.exists(path):
                text = write.summarise_profile(path)
                with open(os.path.join(Profiler.out_dir or "", f"{name}-summary.txt"), "w") as f:
                    f.write(text + "\n")
                log("profile summary:\n" + text)
            else:
                log(f"profile: no {path} (is py-spy installed in the venv?)")

    # ---- driver ---------------------------------------------------------------------

    def run(self, keep: bool, profile: bool) -> None:  # type: ignore[override]
        self.check_host()
        t0 = time.perf_counter()
        self.generate()
        log(f"generated {len(self.small):,} small files in {time.perf_counter() - t0:.1f}s")
        self.rgw.start()
        s3 = self.rgw.client(pool=max(UPLOAD_THREADS, self.plan.concurrency) + 4)
        s3.create_bucket(Bucket=BUCKET)
        self.upload(s3)
        s3.head_object(Bucket=BUCKET, Key=LARGE_KEY)  # connections warm
        self.row_1(s3, keep)
        self.row_2(s3, keep)
        self.row_3(keep)
        if profile:
            self.profile_pass(keep)

    def cleanup(self) -> None:
        for w in [*self.warms, *self.loads]:
            try:
                w.stop()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                log(f"warning: stopping tierfs warm failed: {exc!r}")
        super().cleanup()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, help="row 1's file (default 1024; --quick 256)")
    ap.add_argument("--small-files", type=int, help="row 2's files (default 10000; --quick 2000)")
    ap.add_argument("--fg-mib", type=int,
                    help="row 3's foreground file, one read per 8 MiB chunk (default 1024; "
                         "--quick 512)")
    ap.add_argument("--bulk-mib", type=int,
                    help="row 3's warm set, bulk/: one object and server-side copies of it "
                         "(default 12288; --quick 8192)")
    ap.add_argument("--concurrency", type=int, default=DEFAULT_WARM_CONCURRENCY, metavar="N",
                    help="the warm's --concurrency and the boto3 ceilings' threads (default 16; "
                         "other values also mount with -o warm_concurrency=N)")
    ap.add_argument("--quick", action="store_true", help="smaller data; noisier figures")
    ap.add_argument("--json", metavar="FILE",
                    help="append one JSON line per row to FILE (a bare name goes to bench/results/)")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons and `tierfs warm` from a snapshot of this commit "
                         "instead of the working tree")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the measured passes, py-spy the daemon during one more large "
                         "and one more small-file warm (raw collapsed stacks + summaries in DIR)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work dir (cache dirs, tierfs logs) after the run")
    args = ap.parse_args()
    run.stop_on_signals()
    if args.profile:
        Profiler.out_dir = os.path.abspath(args.profile)
    root = tempfile.mkdtemp(prefix="tierfs-warmbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    ok = False
    bench: WarmBench | None = None
    try:
        plan = WarmPlan.make(args)
        bench = WarmBench(plan, root)
        if args.ref:
            Source.export(args.ref, root)
        log(f"tierfs code: {Source.label}")
        log(f"work dir {root}; large file {plan.large / MiB:.0f} MiB, {plan.small_count:,} "
            f"small files, foreground file {plan.fg / MiB:.0f} MiB, bulk {plan.bulk / MiB:.0f} "
            f"MiB, concurrency {plan.concurrency}; {plan.stored / MiB:,.0f} MiB stored; "
            f"load {load0[0]:.1f}")
        bench.run(keep=args.keep, profile=bool(args.profile))
        ok = True
    except BenchError as exc:
        log(f"error: {exc}")
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        run.finish(bench, root, ok, args.keep)

    if bench is None:
        return 1
    info, code = run.code_label(args.ref)
    p = bench.plan
    load1 = os.getloadavg()
    header = (f"tierfs warm bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  file "
              f"{p.large // MiB} MiB, {p.small_count:,} small files, reader {p.fg // MiB} MiB "
              f"+ warm of {p.bulk // MiB:,} MiB  concurrency {p.concurrency}  "
              f"{'quick  ' if args.quick else ''}load {load0[0]:.1f} at start, "
              f"{load1[0]:.1f} at end  {time.perf_counter() - t0:.0f}s")
    if bench.rows:
        print_table(bench.rows, header)
    if args.json and bench.rows:
        meta = dict(info, ts=started.isoformat(), tierfs_code=code, bench="warm",
                    size_mib=p.large // MiB, small_files=p.small_count, fg_mib=p.fg // MiB,
                    bulk_mib=p.bulk // MiB, concurrency=p.concurrency, quick=args.quick,
                    complete=ok, nproc=os.cpu_count(), load=[load0[0], load1[0]])
        log(f"appended {len(bench.rows)} JSON lines to {write_json(args.json, bench.rows, meta)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
