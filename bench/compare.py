#!/usr/bin/env python3
"""tierfs beside s3fs and rclone: the same phases, the same RGW, the same data, one run.

    .venv/bin/python bench/compare.py [--quick] [--rounds N] [--systems tierfs,s3fs,rclone]
                                      [--ref GIT_REF] [--keep]

Starts its own throw-away Ceph RGW (bench/run.py's helpers), uploads one dataset, and for each
system in turn mounts it fresh on an empty cache dir, runs every phase, and stops it; the RGW's
HTTP access log gives the requests of each phase. Ceilings (boto3, bench/memfs.py) are measured
in the same run. A peer that is not installed (apt-get install s3fs rclone) is skipped with a
note. Every byte read through a mount is compared with the generated data; what a mount wrote
is fetched back with boto3 and its sha256 compared. See bench/README.md ("Comparison with s3fs
and rclone").
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import mmap
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the RGW, mount and measuring helpers)
from run import (BUCKET, CHUNK, LARGE_KEY, LARGE_SEED, GiB, KiB, MiB, BenchError,  # noqa: E402
                 MemFS, Pieces, Rgw, Source, TierfsMount, drop_caches, log, proc_cpu,
                 proc_status_kib, seq_read)

SYSTEMS = ("tierfs", "s3fs", "rclone")
BENCH_UA = "tierfs-compare-bench"  # the bench's own requests, left out of every count
READERS = 8
PAR_FILES = 32
RAND_JOBS = 4
SMALL = 4 * KiB


@dataclass
class Plan:
    large: int
    small_count: int
    write: int
    random_reads: int
    small_dirs: int = 8

    @classmethod
    def make(cls, quick: bool, size_mib: int | None) -> "Plan":
        if quick:
            return cls(large=(size_mib or 256) * MiB, small_count=500, write=64 * MiB,
                       random_reads=4000)
        return cls(large=(size_mib or 1024) * MiB, small_count=2000, write=256 * MiB,
                   random_reads=16000)

    @property
    def par_size(self) -> int:
        return max(MiB, self.large // PAR_FILES // MiB * MiB)


# ---------------------------------------------------------------------------------------
# the RGW's access log: requests per phase


LINE = re.compile(r' beast: \S+: \S+ - \S+ \[[^\]]*\] "([A-Z]+) (\S+) HTTP/[\d.]+" (\d+) .*?"([^"]*)"')


def classify(method: str, target: str) -> str:
    path, _, query = target.partition("?")
    key = path[len(BUCKET) + 2:] if path.startswith(f"/{BUCKET}/") else ""
    if method == "GET":
        return "GET" if key else "LIST"
    if method == "PUT" and "partNumber=" in query:
        return "PUT part"
    if method == "POST":
        return "POST multipart"
    return method


class AccessLog:
    """Counts the requests the RGW logged between two marks. A mark is a HEAD of a missing key
    sent by the bench: once its line is in the log, every request completed before it is too
    (one logging thread writes the lines in order)."""

    def __init__(self, rgw: Rgw, s3) -> None:
        self.path = os.path.join(rgw.dir, "log", "client.rgw.gw.log")
        self.s3 = s3
        self.n = 0
        self.pos = 0

    def mark(self) -> None:
        self.pos = self._mark()[1]

    def _mark(self) -> tuple[int, int]:
        """Sends a mark, returns (offset where the last scan ended, offset after the mark)."""
        self.n += 1
        key = f"compare-mark-{os.getpid()}-{self.n}"
        try:
            self.s3.head_object(Bucket=BUCKET, Key=key)
        except ClientError:
            pass
        needle = f'"HEAD /{BUCKET}/{key} HTTP'.encode()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
            i = data.find(needle)
            if i >= 0:
                end = data.find(b"\n", i)
                return self.pos, self.pos + (len(data) if end < 0 else end + 1)
            time.sleep(0.05)
        raise BenchError(f"mark {key} never reached {self.path}")

    def since_mark(self) -> collections.Counter:
        start, end = self._mark()
        with open(self.path, "rb") as f:
            f.seek(start)
            text = f.read(end - start).decode(errors="replace")
        self.pos = end
        ops: collections.Counter = collections.Counter()
        for line in text.splitlines():
            m = LINE.search(line)
            if m and BENCH_UA not in m.group(4) and m.group(2).startswith(f"/{BUCKET}"):
                ops[classify(m.group(1), m.group(2))] += 1
        return ops


def s3_client(rgw: Rgw, pool: int = 32):
    e = rgw.env
    cfg = Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                 response_checksum_validation="when_required", max_pool_connections=pool,
                 retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10,
                 read_timeout=120, user_agent_extra=BENCH_UA)
    return boto3.session.Session().client(
        "s3", endpoint_url=e["S3_ENDPOINT"], aws_access_key_id=e["S3_ACCESS_KEY"],
        aws_secret_access_key=e["S3_SECRET_KEY"], region_name=e.get("S3_REGION", "us-east-1"),
        config=cfg)


# ---------------------------------------------------------------------------------------
# the systems: one interface over tierfs (run.TierfsMount), s3fs and rclone


class System:
    name = ""

    def __init__(self, root: str, rgw: Rgw, tag: str) -> None:
        self.root, self.rgw = root, rgw
        self.mnt = os.path.join(root, f"mnt-{self.name}-{tag}")
        self.cache_dir = os.path.join(root, f"cache-{self.name}-{tag}")
        os.makedirs(self.mnt, exist_ok=True)
        self.pid: int | None = None

    def mount(self) -> float:
        """Mounts (on the same cache dir every time); returns seconds until mounted."""
        raise NotImplementedError

    def unmount(self) -> None:
        raise NotImplementedError


class Tierfs(System):
    name = "tierfs"

    def __init__(self, root: str, rgw: Rgw, tag: str) -> None:
        super().__init__(root, rgw, tag)
        self.m = TierfsMount(rgw, root, f"{self.name}-{tag}", cache_size="4G",
                             memory_cache_size=256 * MiB, cache_dir=self.cache_dir)
        self.mnt = self.m.mnt

    def mount(self) -> float:
        t0 = time.perf_counter()
        self.m.mount()  # returns once the daemon serves the mount
        self.pid = self.m.pid
        return time.perf_counter() - t0

    def unmount(self) -> None:
        self.m.unmount()
        self.pid = None

    def log_tail(self) -> str:
        return self.m.log_tail(10)


class Peer(System):
    """A FUSE daemon run in the foreground as our child: its PID is the daemon's."""

    exe = ""

    def __init__(self, root: str, rgw: Rgw, tag: str) -> None:
        super().__init__(root, rgw, tag)
        self.proc: subprocess.Popen | None = None
        self.errlog = os.path.join(root, f"{self.name}-{tag}.log")

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        # no AWS_* of ours reaches a peer (rclone fails on an AWS_CA_BUNDLE with plain http)
        return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def mount(self) -> float:
        t0 = time.perf_counter()
        with open(self.errlog, "ab") as err:
            self.proc = subprocess.Popen(self.argv(), env=self.env(), stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=err, cwd=self.root)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 60
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{self.name} did not mount: {self.log_tail()}")
            time.sleep(0.005)
        return time.perf_counter() - t0

    def unmount(self) -> None:
        if self.proc is not None:
            run.unmount_and_wait(self.proc, self.mnt, 60)
        elif os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True)
        self.proc, self.pid = None, None

    def log_tail(self) -> str:
        try:
            with open(self.errlog, errors="replace") as f:
                return "".join(f.readlines()[-10:])
        except OSError:
            return ""


class S3fs(Peer):
    name = "s3fs"
    exe = "s3fs"

    def argv(self) -> list[str]:
        # the credentials in a 0600 file in a 0700 dir of our own, never on argv
        secrets = os.path.join(self.root, "secrets")
        os.makedirs(secrets, mode=0o700, exist_ok=True)
        pw = os.path.join(secrets, "s3fs-passwd")
        if not os.path.exists(pw):
            fd = os.open(pw, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.rgw.env['S3_ACCESS_KEY']}:{self.rgw.env['S3_SECRET_KEY']}\n")
        # defaults otherwise; use_cache is the disk cache (else a warm read is a GET again)
        return ["s3fs", BUCKET, self.mnt, "-f", "-o", f"passwd_file={pw}",
                "-o", f"url={self.rgw.env['S3_ENDPOINT']}", "-o", "use_path_request_style",
                "-o", f"endpoint={self.rgw.env.get('S3_REGION', 'us-east-1')}",
                "-o", f"use_cache={self.cache_dir}"]


class Rclone(Peer):
    name = "rclone"
    exe = "rclone"

    def env(self) -> dict[str, str]:
        e = self.rgw.env
        return dict(super().env(), RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Ceph",
                    RCLONE_CONFIG_BENCH_ENDPOINT=e["S3_ENDPOINT"],
                    RCLONE_CONFIG_BENCH_REGION=e.get("S3_REGION", "us-east-1"),
                    RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=e["S3_ACCESS_KEY"],
                    RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=e["S3_SECRET_KEY"])

    def argv(self) -> list[str]:
        # vfs full: reads and writes through the disk cache; write-back 0 s uploads at close
        # (the default waits 5 s), the phase still waits until the object is in the RGW
        return ["rclone", "mount", f"bench:{BUCKET}", self.mnt, "--config", "/dev/null",
                "--vfs-cache-mode", "full", "--vfs-write-back", "0s",
                "--cache-dir", self.cache_dir]


KINDS = {"tierfs": Tierfs, "s3fs": S3fs, "rclone": Rclone}


# ---------------------------------------------------------------------------------------
# readers (every byte compared)


def read_many(items: list[tuple[str, Pieces]], threads: int) -> int:
    with ThreadPoolExecutor(threads) as ex:
        return sum(n for n, _ in ex.map(lambda it: seq_read(it[0], it[1]), items))


def slices(total: int, parts: int) -> list[tuple[int, int]]:
    step = total // parts // MiB * MiB
    return [(i * step, total if i == parts - 1 else (i + 1) * step) for i in range(parts)]


def read_range(path: str, lo: int, hi: int, expect: Pieces) -> int:
    """MiB reads of [lo, hi) on one fd (8 readers of one file: the memfs ceiling)."""
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(MiB)
    try:
        for off in range(lo, hi, MiB):
            n = os.preadv(fd, [buf], off)
            if n != min(MiB, hi - off) or buf[:n] != expect.slice(off, n):
                raise BenchError(f"{path}: wrong bytes at {off}")
        return hi - lo
    finally:
        os.close(fd)


def odirect_random(path: str, offsets: list[int], expect: Pieces, jobs: int = RAND_JOBS) -> float:
    """4 KiB preadv of an O_DIRECT fd per job (a page-aligned buffer each), jobs in threads;
    returns the wall seconds from the first read to the last job's end."""
    go = threading.Barrier(jobs + 1)

    def job(offs: list[int]) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)
        try:
            go.wait()
            for off in offs:
                if os.preadv(fd, [buf], off) != 4096 or buf[:] != expect.slice(off, 4096):
                    raise BenchError(f"{path}: wrong 4 KiB at {off} (O_DIRECT)")
        finally:
            os.close(fd)
            buf.close()

    with ThreadPoolExecutor(jobs) as ex:
        futs = [ex.submit(job, offsets[i::jobs]) for i in range(jobs)]
        go.wait()
        t0 = time.perf_counter()
        for f in futs:
            f.result()
        return time.perf_counter() - t0


def find_stat(top: str, want: dict[str, bytes]) -> int:
    n = 0
    for dirpath, dirs, files in os.walk(top):
        for name in dirs:
            os.lstat(os.path.join(dirpath, name))
            n += 1
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_size != SMALL:
                raise BenchError(f"{dirpath}/{name}: size {st.st_size}")
            n += 1
    return n


def cat_all(mnt: str, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        if run.read_whole(os.path.join(mnt, key)) != data:
            raise BenchError(f"{mnt}/{key}: wrong bytes")


# ---------------------------------------------------------------------------------------
# results


@dataclass
class Sample:
    value: float
    cpu: float | None = None  # daemon utime+stime, s
    nbytes: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)
    count: float = 0  # what the rate is of: MiB, reads or files
    close_s: float | None = None  # write: when close() returned


# phase -> (label, unit, ceiling key, bytes for CPU s/GiB?)
PHASES = [
    ("seq_cold", "{L} sequential, cold", "MiB/s", "ranged8"),
    ("par_cold", "8 readers x 32 files, cold", "MiB/s", "par8"),
    ("seq_warm", "{L} sequential, warm (page cache dropped)", "MiB/s", "memfs_seq"),
    ("par_warm", "8 readers x 32 files, warm", "MiB/s", "memfs_par"),
    ("rand", "random 4 KiB O_DIRECT, 4 jobs, warm", "IOPS", "memfs_rand"),
    ("find_cold", "find+stat {N} files, cold", "files/s", "list"),
    ("find_warm", "find+stat {N} files, warm", "files/s", "list"),
    ("cat_cold", "cat {N} x 4 KiB, cold", "files/s", "get1"),
    ("cat_warm", "cat {N} x 4 KiB, warm", "files/s", "get1"),
    ("write", "write {W}, close durable", "MiB/s", "multipart8"),
    ("reread", "{L} re-read after remount", "MiB/s", "memfs_seq"),
    ("cpu_cold", "daemon CPU for the cold {L}", "s", ""),
    ("rss", "peak RSS (VmHWM)", "MiB", ""),
    ("mount", "mount time", "s", ""),
]
# the CPU table's unit where s/GiB says little: (unit, multiplier per counted item)
CPU_UNITS = {"rand": ("us/read", 1e6), "find_cold": ("ms/file", 1e3),
             "find_warm": ("ms/file", 1e3), "cat_cold": ("ms/file", 1e3),
             "cat_warm": ("ms/file", 1e3)}
CEILINGS = {
    "ranged8": "boto3 8x ranged GETs", "par8": "boto3 8 threads, whole files",
    "memfs_seq": "memfs", "memfs_par": "memfs 8 readers", "memfs_rand": "memfs",
    "list": "LIST (entries/s)", "get1": "boto3 GETs, 1 thread", "get16": "boto3 GETs, 16 threads",
    "multipart8": "boto3 multipart 8x", "rss": "tierfs memory tier + 150 MiB",
}


def size_label(n: int) -> str:
    return f"{n // GiB} GiB" if n % GiB == 0 else f"{n // MiB} MiB"


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v: float | None) -> str:
    return run.fmt(v)


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


# ---------------------------------------------------------------------------------------
# the comparison


class Compare:
    def __init__(self, plan: Plan, root: str, systems: list[str], rounds: int) -> None:
        self.plan, self.root, self.systems, self.rounds = plan, root, systems, rounds
        p = plan
        self.stored = (p.large * 2 + 2 * p.small_count * SMALL
                       + p.write * (1 + len(systems)) * rounds)
        self.rgw = Rgw(root, max(4 * GiB, 2 * self.stored + 2 * GiB))
        self.memfs: MemFS | None = None
        self.live: list[System] = []
        self.samples: dict[str, dict[str, list[Sample]]] = collections.defaultdict(
            lambda: collections.defaultdict(list))
        self.ceil: dict[str, list[float]] = collections.defaultdict(list)
        self.ceil_cpu: dict[str, list[float]] = collections.defaultdict(list)

    # ---- data ---------------------------------------------------------------------

    def check_host(self) -> None:
        run.require_root_and_fuse()
        p = self.plan
        need = 2 * self.stored + 4 * p.large + p.write + 2 * GiB  # RGW, ours, memfs
        if run.mem_available() < need:
            raise BenchError(f"needs ~{need / GiB:.1f} GiB of free RAM, "
                             f"{run.mem_available() / GiB:.1f} GiB available: use --quick")

    def generate(self) -> None:
        p = self.plan
        t0 = time.perf_counter()
        self.large = Pieces(p.large, LARGE_SEED)
        self.par = [(f"par/p{i:02d}.bin", Pieces(p.par_size, 300 + i)) for i in range(PAR_FILES)]
        self.meta = {f"meta/d{i % p.small_dirs:02d}/f{i:05d}.bin": bytes(datagen.make(SMALL, 5000 + i))
                     for i in range(p.small_count)}
        self.cat = {f"cat/d{i % p.small_dirs:02d}/f{i:05d}.bin": bytes(datagen.make(SMALL, 20000 + i))
                    for i in range(p.small_count)}
        self.wdata = Pieces(p.write, 77)
        self.wsha = hashlib.sha256(b"".join(self.wdata.pieces)).hexdigest()
        log(f"generated the data in {time.perf_counter() - t0:.1f}s")

    def upload(self) -> None:
        s3 = self.s3
        s3.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        run.Bench._upload_multipart(s3, LARGE_KEY, self.large)
        with ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=pc.part(0, pc.size))
                    for k, pc in self.par]
            futs += [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=v)
                     for k, v in {**self.meta, **self.cat}.items()]
            for f in futs:
                f.result()
        log(f"uploaded {1 + len(futs)} objects in {time.perf_counter() - t0:.1f}s")

    # ---- ceilings -------------------------------------------------------------------

    def ceilings(self) -> None:
        p, s3, c = self.plan, self.s3, self.ceil
        size = p.large

        def ranged(off: int) -> int:
            end = min(off + CHUNK, size) - 1
            return len(s3.get_object(Bucket=BUCKET, Key=LARGE_KEY,
                                     Range=f"bytes={off}-{end}")["Body"].read())

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            n = sum(ex.map(ranged, range(0, size, CHUNK)))
        c["ranged8"].append(n / MiB / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            n = sum(ex.map(lambda kp: len(s3.get_object(Bucket=BUCKET, Key=kp[0])["Body"].read()),
                           self.par))
        c["par8"].append(n / MiB / (time.perf_counter() - t0))

        mem = self.memfs
        drop_caches()
        cpu0 = proc_cpu(mem.proc.pid)
        n, dt = seq_read(mem.path, self.large)
        self.ceil_cpu["memfs_seq"].append((proc_cpu(mem.proc.pid) - cpu0) / (n / GiB))
        c["memfs_seq"].append(n / MiB / dt)
        drop_caches()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(READERS) as ex:
            n = sum(ex.map(lambda r: read_range(mem.path, r[0], r[1], self.large),
                           slices(size, READERS)))
        c["memfs_par"].append(n / MiB / (time.perf_counter() - t0))
        c["memfs_rand"].append(p.random_reads / odirect_random(mem.path, self.offsets, self.large))

        t0 = time.perf_counter()
        n = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="meta/"):
            n += len(page.get("Contents", []))
        c["list"].append(n / (time.perf_counter() - t0))
        keys = list(self.cat)

        def get(k: str) -> None:
            if s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() != self.cat[k]:
                raise BenchError(f"boto3 {k}: wrong bytes")

        t0 = time.perf_counter()
        for k in keys:
            get(k)
        c["get1"].append(len(keys) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as ex:
            list(ex.map(get, keys))
        c["get16"].append(len(keys) / (time.perf_counter() - t0))

        key = f"wr/ceiling-{len(c['multipart8'])}.bin"
        t0 = time.perf_counter()
        run.Bench._upload_multipart(s3, key, self.wdata, part=8 * MiB)
        c["multipart8"].append(p.write / MiB / (time.perf_counter() - t0))
        log("  ceilings: " + ", ".join(f"{k} {fmt(v[-1])}" for k, v in c.items()))

    # ---- one system --------------------------------------------------------------------

    def phase(self, sysname: str, name: str, s: System, fn, unit_count: float, nbytes: int = 0,
              drop: bool = True) -> Sample:
        """Runs fn() as one measured phase: caches dropped, daemon CPU and requests counted.
        unit_count is what the rate is of (MiB, reads, files)."""
        if drop:
            drop_caches()
        self.alog.mark()
        cpu0 = proc_cpu(s.pid)
        t0 = time.perf_counter()
        extra = fn()
        dt = extra if isinstance(extra, float) else time.perf_counter() - t0
        cpu = proc_cpu(s.pid) - cpu0
        ops = self.alog.since_mark()
        smp = Sample(unit_count / dt, cpu, nbytes, ops, unit_count)
        self.samples[sysname][name].append(smp)
        cpg = f", CPU {cpu / (nbytes / GiB):.2f} s/GiB" if nbytes else f", CPU {cpu:.2f} s"
        hwm = proc_status_kib(s.pid, "VmHWM") / KiB  # where the peak RSS is reached
        log(f"  {sysname} {name}: {fmt(smp.value)}{cpg}, requests {dict(ops)}, "
            f"VmHWM {hwm:.0f} MiB")
        return smp

    def one_system(self, sysname: str, rnd: int) -> None:
        p = self.plan
        s = KINDS[sysname](self.root, self.rgw, f"r{rnd}")
        self.live.append(s)
        try:
            self.alog.mark()
            t = s.mount()
            self.samples[sysname]["mount"].append(Sample(t, ops=self.alog.since_mark()))
            log(f"  {sysname} mounted in {t:.2f}s (pid {s.pid})")
            big = os.path.join(s.mnt, LARGE_KEY)
            mib = p.large / MiB
            par = [(os.path.join(s.mnt, k), pc) for k, pc in self.par]
            par_mib = PAR_FILES * p.par_size / MiB
            smp = self.phase(sysname, "seq_cold", s, lambda: seq_read(big, self.large)[1] and None,
                             mib, p.large)
            self.samples[sysname]["cpu_cold"].append(Sample(smp.cpu))
            self.phase(sysname, "par_cold", s, lambda: read_many(par, READERS) and None, par_mib,
                       PAR_FILES * p.par_size)
            self.phase(sysname, "seq_warm", s, lambda: seq_read(big, self.large) and None, mib,
                       p.large)
            self.phase(sysname, "par_warm", s, lambda: read_many(par, READERS) and None, par_mib,
                       PAR_FILES * p.par_size)
            self.phase(sysname, "rand", s,
                       lambda: odirect_random(big, self.offsets, self.large), p.random_reads,
                       p.random_reads * 4096)
            nmeta = p.small_count + p.small_dirs
            top = os.path.join(s.mnt, "meta")
            for name in ("find_cold", "find_warm"):
                self.phase(sysname, name, s, lambda: self._find(top, nmeta), p.small_count)
            for name in ("cat_cold", "cat_warm"):
                self.phase(sysname, name, s, lambda: cat_all(s.mnt, self.cat), p.small_count,
                           p.small_count * SMALL)
            self.write(sysname, s, rnd)
            self.samples[sysname]["rss"].append(Sample(proc_status_kib(s.pid, "VmHWM") / KiB))
            s.unmount()
            self.alog.mark()
            s.mount()
            self.alog.since_mark()
            self.phase(sysname, "reread", s, lambda: seq_read(big, self.large) and None, mib,
                       p.large)
        finally:
            s.unmount()
            self.live.remove(s)
            if not os.path.ismount(s.mnt):
                shutil.rmtree(s.cache_dir, ignore_errors=True)

    def _find(self, top: str, want: int) -> None:
        n = find_stat(top, self.meta)
        if n != want:
            raise BenchError(f"find {top}: {n} entries, expected {want}")

    def write(self, sysname: str, s: System, rnd: int) -> None:
        key = f"wr/{sysname}-{rnd}.bin"
        path = os.path.join(s.mnt, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = self.plan.write
        closed: list[float] = []

        def write_durable() -> float:
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for piece in self.wdata.pieces:
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            closed.append(time.perf_counter() - t0)
            deadline = time.monotonic() + 300
            while True:  # rclone uploads after close(): durable is when the RGW has it
                try:
                    if self.s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == size:
                        break
                except ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise BenchError(f"{sysname}: {key} not in the RGW 300 s after close")
                time.sleep(0.05)
            return time.perf_counter() - t0

        smp = self.phase(sysname, "write", s, write_durable, size / MiB, size)
        got = hashlib.sha256(self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()).hexdigest()
        if got != self.wsha:
            raise BenchError(f"{sysname}: {key} in the RGW differs from what was written")
        smp.close_s = closed[0]

    # ---- driver ---------------------------------------------------------------------

    def run(self) -> None:
        self.check_host()
        self.generate()
        self.rgw.start()
        self.s3 = s3_client(self.rgw)
        self.alog = AccessLog(self.rgw, self.s3)
        self.upload()
        rng = random.Random(3)
        self.offsets = [rng.randrange(self.plan.large // 4096) * 4096
                        for _ in range(self.plan.random_reads)]
        self.memfs = MemFS(self.root, self.plan.large, LARGE_SEED)
        self.memfs.start()
        for rnd in range(self.rounds):
            log(f"round {rnd + 1}/{self.rounds}")
            self.ceilings()
            # rotate the order so no system always runs first (the machine's load drifts)
            order = self.systems[rnd % len(self.systems):] + self.systems[:rnd % len(self.systems)]
            for sysname in order:
                self.one_system(sysname, rnd)

    def cleanup(self) -> None:
        steps = [s.unmount for s in list(self.live)]
        steps += [self.memfs.stop] if self.memfs else []
        steps += [self.rgw.stop]
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep cleaning up
                log(f"warning: cleanup step failed: {exc!r}")

    # ---- the table --------------------------------------------------------------------

    def table(self, header: str) -> str:
        p, out = self.plan, []
        labels = {"{L}": size_label(p.large), "{N}": f"{p.small_count:,}",
                  "{W}": size_label(p.write)}
        systems = self.systems
        peers = [x for x in ("s3fs", "rclone") if x in systems]

        def label(t: str) -> str:
            for k, v in labels.items():
                t = t.replace(k, v)
            return t

        out.append(header)
        out.append("")
        cols = ["phase", "unit", *systems]
        if "tierfs" in systems:
            cols += [f"tierfs / {x}" for x in peers]
        cols += ["same-run ceiling", "tierfs / ceiling" if "tierfs" in systems else "ratio"]
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for key, text, unit, ceil in PHASES:
            vals = {x: med([smp.value for smp in self.samples[x][key]]) for x in systems}
            row = [label(text), unit, *(fmt(vals[x]) for x in systems)]
            if "tierfs" in systems:
                row += [ratio(vals["tierfs"], vals[x]) for x in peers]
            cv = med(self.ceil[ceil]) if ceil else None
            if key == "rss" and "tierfs" in systems:
                ceil, cv = "rss", 256 + 150
            row += [f"{CEILINGS[ceil]} {fmt(cv)}" if ceil else "",
                    ratio(vals.get("tierfs"), cv) if ceil and "tierfs" in systems else ""]
            if key == "cat_cold" and self.ceil["get16"]:
                row[-2] += f" (16 threads {fmt(med(self.ceil['get16']))})"
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        out.append("Daemon CPU (utime+stime from /proc/PID/stat) per unit of work, medians, "
                   "lower is better:")
        out.append("")
        out.append("| phase | unit | " + " | ".join(systems) + " |")
        out.append("|" + "---|" * (len(systems) + 2))
        for key, text, unit, _ in PHASES:
            per, scale = CPU_UNITS.get(key, ("s/GiB", None))
            if key in ("cpu_cold", "rss", "mount"):
                continue

            def one(smp: Sample) -> float | None:
                if smp.cpu is None:
                    return None
                return smp.cpu * scale / smp.count if scale else smp.cpu / (smp.nbytes / GiB)
            cells = [fmt(med([one(smp) for smp in self.samples[x][key]])) for x in systems]
            out.append(f"| {label(text)} | {per} | " + " | ".join(cells) + " |")
        if self.ceil_cpu["memfs_seq"]:
            out.append(f"| (memfs, the warm sequential ceiling) | s/GiB | "
                       f"{fmt(med(self.ceil_cpu['memfs_seq']))} |")
        closes = {x: med([smp.close_s for smp in self.samples[x]["write"]]) for x in systems}
        out.append("")
        out.append("write: close() returned after " + ", ".join(
            f"{x} {fmt(v)} s" for x, v in closes.items()) + " (the row's time runs until a "
            "HEAD shows the whole object in the RGW)")
        out.append("")
        out.append("RGW requests per phase (from its access log; last round):")
        out.append("")
        out.append("| phase | " + " | ".join(systems) + " |")
        out.append("|" + "---|" * (len(systems) + 1))
        for key, text, _, _ in PHASES:
            if key in ("cpu_cold", "rss"):
                continue
            cells = []
            for x in systems:
                smps = self.samples[x][key]
                ops = smps[-1].ops if smps else {}
                cells.append(", ".join(f"{k} {fmt(v)}" for k, v in sorted(ops.items())) or "0")
            out.append(f"| {label(text)} | " + " | ".join(cells) + " |")
        return "\n".join(out)


def available(systems: list[str]) -> list[str]:
    out = []
    for x in systems:
        if x != "tierfs" and not shutil.which(KINDS[x].exe):
            log(f"note: {x} is not installed (apt-get install {x}): skipped")
            continue
        out.append(x)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="256 MiB file, 500 small files, 64 MiB write (a few minutes)")
    ap.add_argument("--size-mib", type=int, help="large file size (default 1024; --quick 256)")
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="every system N times (fresh mount, empty cache each); medians")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset of tierfs,s3fs,rclone")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run tierfs from a snapshot of this commit instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    args = ap.parse_args()
    wanted = [x.strip() for x in args.systems.split(",") if x.strip()]
    bad = [x for x in wanted if x not in KINDS]
    if bad or not wanted:
        ap.error(f"--systems: unknown {bad}; choose from {','.join(SYSTEMS)}")
    run.stop_on_signals()
    systems = available(wanted)
    plan = Plan.make(args.quick, args.size_mib)
    root = tempfile.mkdtemp(prefix="tierfs-compare.", dir="/tmp")
    cmp = Compare(plan, root, systems, max(1, args.rounds))
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    ok = False
    try:
        if args.ref:
            Source.export(args.ref, root)
        log(f"tierfs code: {Source.label}; systems {','.join(systems)}; work dir {root}")
        cmp.run()
        ok = True
    except BenchError as exc:
        log(f"error: {exc}")
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        cmp.cleanup()
        still = [s.mnt for s in cmp.live if os.path.ismount(s.mnt)]
        if cmp.memfs and os.path.ismount(cmp.memfs.mnt):
            still.append(cmp.memfs.mnt)
        if not ok:
            for s in cmp.live:
                log(f"{s.name} log tail:\n{s.log_tail()}")
        if still:
            log(f"warning: still mounted, work dir {root} kept: {still}")
        elif args.keep:
            log(f"work dir kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    _, code = run.code_label(args.ref)
    header = (f"tierfs vs peers {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  "
              f"{size_label(plan.large)} file, {plan.small_count} small files, "
              f"{size_label(plan.write)} write  rounds {cmp.rounds}  "
              f"{'quick  ' if args.quick else ''}load {os.getloadavg()[0]:.1f}  "
              f"{time.perf_counter() - t0:.0f}s"
              + ("" if ok else "  INCOMPLETE"))
    if any(cmp.samples.values()):
        print(cmp.table(header))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
