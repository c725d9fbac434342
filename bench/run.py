#!/usr/bin/env python3
"""tierfs benchmark: every tierfs figure beside a ceiling measured in the same run.

    .venv/bin/python bench/run.py [--size-mib N] [--quick] [--json FILE] [--keep]

One command: starts its own throw-away Ceph RGW (scripts/ceph-rgw/start.sh), uploads the
test data, mounts tierfs (and bench/memfs.py, the trivial pyfuse3 ceiling), measures, and
prints a table; everything it started is stopped in `finally` blocks. Needs root (drop
caches, /run/tierfs), /dev/fuse, fusermount3 and the ceph packages. See bench/README.md
for what each row means.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import random
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import boto3
from botocore.config import Config
from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import datagen  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BUCKET = "tierfs-bench"
LARGE_KEY = "big.bin"
LARGE_SEED = 1
CHUNK = 8 * MiB  # tierfs's default --chunk-size; the LRU simulation uses the same
RUN_DIR = "/run/tierfs"
DEFAULT_TTL = 60.0  # tierfs's default --metadata-ttl, which the bench does not change


class BenchError(Exception):
    pass


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------
# plan: what data, how much


@dataclass
class Plan:
    large: int
    small_count: int
    small_dirs: int
    random_reads: int
    rss_memory_cache: int
    hot_files: int
    hot_size: int
    hot_passes: int
    scan_files: int
    scan_size: int
    scan_cache_size: int
    scan_memory_cache: int
    memory_cache: int = 256 * MiB
    cache_size: str = "4G"
    threads: int = 8
    small_min: int = 4 * KiB
    small_max: int = 64 * KiB

    @classmethod
    def make(cls, size_mib: int | None, quick: bool) -> "Plan":
        if quick:
            large = (size_mib or 256) * MiB
            p = cls(large=large, small_count=400, small_dirs=4, random_reads=1000,
                    rss_memory_cache=0, hot_files=4, hot_size=8 * MiB, hot_passes=3,
                    scan_files=8, scan_size=16 * MiB, scan_cache_size=64 * MiB,
                    scan_memory_cache=16 * MiB)
        else:
            large = (size_mib or 1024) * MiB
            p = cls(large=large, small_count=2000, small_dirs=8, random_reads=2000,
                    rss_memory_cache=0, hot_files=4, hot_size=16 * MiB, hot_passes=3,
                    scan_files=8, scan_size=64 * MiB, scan_cache_size=256 * MiB,
                    scan_memory_cache=64 * MiB)
        if large < 16 * MiB:
            raise BenchError("--size-mib must be at least 16")
        # the RSS row reads the large file through a memory tier a quarter of its size or
        # less (128M as asked, smaller only when the large file is under 512 MiB)
        p.rss_memory_cache = max(MiB, min(128 * MiB, (large // 4) // MiB * MiB))
        return p

    @property
    def hot_total(self) -> int:
        return self.hot_files * self.hot_size

    @property
    def scan_total(self) -> int:
        return self.scan_files * self.scan_size


# ---------------------------------------------------------------------------------------
# helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_caches() -> None:
    """Write back dirty pages (the disk tier's fresh chunk files) and drop page,
    dentry and inode caches, so the next read goes through FUSE and through the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def proc_status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise BenchError(f"no {field_name} in /proc/{pid}/status")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def git_info() -> dict:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"git_sha": git("rev-parse", "HEAD") or "unknown",
            # others edit tierfs/ while this runs: say whether it differed from HEAD
            "tierfs_dirty": bool(git("status", "--porcelain", "--", "tierfs"))}


class Pieces:
    """An object's expected bytes as 1 MiB `bytes` pieces: comparing an aligned 1 MiB
    read is one memcmp (slicing a 1 GiB buffer copies, ~1 ms/MiB on this machine)."""

    def __init__(self, size: int, seed: int) -> None:
        data = datagen.make(size, seed)
        view = memoryview(data)
        self.size = size
        self.pieces = [bytes(view[o:o + MiB]) for o in range(0, size, MiB)]
        del view, data

    def slice(self, off: int, n: int) -> bytes:
        out = []
        while n > 0 and off < self.size:
            p = self.pieces[off // MiB]
            take = p[off % MiB:off % MiB + n]
            out.append(take)
            off += len(take)
            n -= len(take)
        return b"".join(out)

    def part(self, off: int, n: int) -> bytes:
        return self.slice(off, n)


def seq_read(path: str, expect: Pieces | None, bs: int = MiB) -> tuple[int, float]:
    """dd-like: one open, bs-sized reads to EOF; every byte compared. (bytes, seconds)"""
    buf = bytearray(bs)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            if expect is not None:
                if n == MiB and total % MiB == 0:
                    ok = buf == expect.pieces[total // MiB]
                else:
                    ok = buf[:n] == expect.slice(total, n)
                if not ok:
                    raise BenchError(f"{path}: wrong bytes at offset {total}")
            total += n
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    if expect is not None and total != expect.size:
        raise BenchError(f"{path}: read {total} bytes, expected {expect.size}")
    return total, dt


def random_reads(path: str, offsets: list[int], expect: Pieces) -> float:
    """os.pread of 4 KiB at each offset on one open fd; returns seconds."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off in offsets:
            data = os.pread(fd, 4096, off)
            if data != expect.slice(off, 4096):
                raise BenchError(f"{path}: wrong 4 KiB at offset {off}")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def large_chunk_files(cache_dir: str, size: int) -> dict[int, str]:
    """index -> chunk file of the large object in a tierfs cache dir, read from the layout
    chunks/XX/<object id>.<index> (tierfs internals: {} if that layout changed)."""
    groups: dict[str, dict[int, str]] = collections.defaultdict(dict)
    for dirpath, _, files in os.walk(os.path.join(cache_dir, "chunks")):
        for fn in files:
            oid, _, idx = fn.rpartition(".")
            if idx.isdigit():
                groups[oid][int(idx)] = os.path.join(dirpath, fn)
    want = -(-size // CHUNK)
    return next((g for g in groups.values() if len(g) == want), {})


def block_reads(files: dict[int, str], offsets: list[int], block: int = 64 * KiB) -> float:
    """The disk part of a random read: one aligned `block` pread per offset."""
    fds = {i: os.open(p, os.O_RDONLY) for i, p in files.items()}
    try:
        t0 = time.perf_counter()
        for off in offsets:
            within = off % CHUNK
            os.pread(fds[off // CHUNK], block, within - within % block)
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def read_whole(path: str) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def simulate_lru(passes: list[list[tuple]], capacity: int) -> list[int]:
    """Misses per pass of a plain LRU holding `capacity` chunks (a simulation)."""
    lru: collections.OrderedDict = collections.OrderedDict()
    out = []
    for trace in passes:
        misses = 0
        for c in trace:
            if c in lru:
                lru.move_to_end(c)
            else:
                misses += 1
                lru[c] = True
                if len(lru) > capacity:
                    lru.popitem(last=False)
        out.append(misses)
    return out


def chunk_trace(keys_sizes: list[tuple[str, int]]) -> list[tuple]:
    return [(k, i) for k, size in keys_sizes for i in range(-(-size // CHUNK))]


# ---------------------------------------------------------------------------------------
# the Ceph RGW


class Rgw:
    https = False  # serve TLS with a self-signed certificate (bench/write.py --https)

    def __init__(self, root: str, memstore_bytes: int) -> None:
        self.dir = os.path.join(root, "rgw")
        self.memstore_bytes = memstore_bytes
        self.env: dict[str, str] = {}
        self.started = False

    def start(self) -> None:
        script = os.path.join(REPO, "scripts", "ceph-rgw", "start.sh")
        env = dict(os.environ, MEMSTORE_BYTES=str(self.memstore_bytes),
                   RGW_HTTPS=str(int(self.https)))
        t0 = time.perf_counter()
        self.started = True  # start.sh kills its own daemons on failure; stop is safe
        r = subprocess.run(["bash", script, self.dir], env=env, capture_output=True, text=True,
                           timeout=180, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise BenchError(f"Ceph RGW did not start (rc {r.returncode}): "
                             f"{r.stderr.strip()[-2000:]}")
        with open(os.path.join(self.dir, "env")) as f:
            for line in f:
                line = line.strip()
                if line.startswith("export ") and "=" in line:
                    k, _, v = line[len("export "):].partition("=")
                    self.env[k] = v
        log(f"Ceph RGW up on {self.env['S3_ENDPOINT']} in {time.perf_counter() - t0:.1f}s "
            f"(memstore {self.memstore_bytes / GiB:.1f} GiB)")

    def stop(self) -> None:
        if not self.started or not os.path.exists(os.path.join(self.dir, "pids")):
            return
        script = os.path.join(REPO, "scripts", "ceph-rgw", "stop.sh")
        r = subprocess.run(["bash", script, self.dir], capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            log(f"warning: stop.sh: {r.stderr.strip()}")
        self.started = False

    def client(self, pool: int = 32):
        e = self.env
        cfg = Config(s3={"addressing_style": "path"},
                     request_checksum_calculation="when_required",
                     response_checksum_validation="when_required",
                     max_pool_connections=pool,
                     retries={"mode": "standard", "max_attempts": 3},
                     connect_timeout=10, read_timeout=120)
        return boto3.session.Session().client(
            "s3", endpoint_url=e["S3_ENDPOINT"], aws_access_key_id=e["S3_ACCESS_KEY"],
            aws_secret_access_key=e["S3_SECRET_KEY"], region_name=e.get("S3_REGION", "us-east-1"),
            config=cfg, verify=e.get("S3_CA_BUNDLE") or None)


# ---------------------------------------------------------------------------------------
# mounts


def _pid_file(mountpoint: str) -> str:
    """tierfs.mount.daemon.pid_file, restated so the bench never imports tierfs itself."""
    return os.path.join(RUN_DIR, hashlib.sha256(mountpoint.encode()).hexdigest()[:16] + ".pid")


def _tierfs_cmd() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "tierfs")
    if Source.pythonpath or not os.path.exists(exe):
        # a --ref snapshot: the console script's import path is the installed tree's
        return [sys.executable, "-m", "tierfs"]
    return [exe]


class Source:
    """Which tierfs code the daemons run: the working tree (default), or a snapshot of a git
    ref (--ref) exported into the work dir and put first on the daemon's PYTHONPATH, so a
    run is not a mix of versions while others edit tierfs/."""

    pythonpath: str | None = None
    label = "working tree"

    @classmethod
    def export(cls, ref: str, root: str) -> None:
        sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", f"{ref}^{{commit}}"],
                             capture_output=True, text=True)
        if sha.returncode != 0:
            raise BenchError(f"--ref {ref!r}: {sha.stderr.strip()}")
        dest = os.path.join(root, "src")
        os.makedirs(dest)
        archive = subprocess.Popen(["git", "-C", REPO, "archive", sha.stdout.strip(), "tierfs"],
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise BenchError(f"git archive {ref} failed")
        cls.pythonpath = dest
        cls.label = f"{ref} ({sha.stdout.strip()[:12]})"

    @classmethod
    def env(cls, base: dict[str, str]) -> dict[str, str]:
        if cls.pythonpath:
            base = dict(base, PYTHONPATH=cls.pythonpath)
        return base


class TierfsMount:
    def __init__(self, rgw: Rgw, root: str, name: str, *, cache_size: str | int,
                 memory_cache_size: int, cache_dir: str | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.rgw = rgw
        self.extra_args = tuple(extra_args)  # more `tierfs mount` flags (bench/write.py)
        self.root = root
        self.mnt = os.path.join(root, f"mnt-{name}")
        self.cache_dir = cache_dir or os.path.join(root, f"cache-{name}")
        self.cache_size = cache_size if isinstance(cache_size, str) else f"{cache_size // MiB}M"
        self.memory_cache_size = f"{memory_cache_size // MiB}M"
        self.port = 0
        self.pid: int | None = None
        os.makedirs(self.mnt, exist_ok=True)

    def mount(self) -> None:
        self.port = free_port()
        e = self.rgw.env
        env = Source.env(dict(os.environ, AWS_ACCESS_KEY_ID=e["S3_ACCESS_KEY"],
                              AWS_SECRET_ACCESS_KEY=e["S3_SECRET_KEY"],
                              AWS_DEFAULT_REGION=e.get("S3_REGION", "us-east-1")))
        if e.get("S3_CA_BUNDLE"):  # an https RGW's self-signed certificate
            env["AWS_CA_BUNDLE"] = e["S3_CA_BUNDLE"]
        cmd = [*_tierfs_cmd(), "mount", f"s3://{BUCKET}", self.mnt,
               "--endpoint-url", e["S3_ENDPOINT"], "--cache-dir", self.cache_dir,
               "--cache-size", self.cache_size, "--memory-cache-size", self.memory_cache_size,
               "--metrics-addr", f"127.0.0.1:{self.port}", *self.extra_args]
        t0 = time.perf_counter()
        # cwd outside the repo: `python -m tierfs` puts the cwd first on sys.path
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, cwd=self.root)
        if r.returncode != 0:
            raise BenchError(f"tierfs mount failed: {r.stderr.strip()}\n{self.log_tail()}")
        with open(_pid_file(self.mnt)) as f:
            self.pid = int(f.read().strip())
        log(f"tierfs mounted on {self.mnt} (pid {self.pid}, cache {self.cache_dir}, "
            f"--cache-size {self.cache_size} --memory-cache-size {self.memory_cache_size}"
            f"{''.join(' ' + a for a in self.extra_args)}) "
            f"in {time.perf_counter() - t0:.1f}s")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(os.path.join(self.cache_dir, "tierfs.log")) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def unmount(self) -> None:
        if os.path.ismount(self.mnt) or (self.pid and alive(self.pid)):
            r = subprocess.run([*_tierfs_cmd(), "unmount", self.mnt], capture_output=True,
                               text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=self.root,
                               env=Source.env(dict(os.environ)))
            if r.returncode != 0:
                log(f"warning: tierfs unmount {self.mnt}: {r.stderr.strip()}")
                if os.path.ismount(self.mnt):
                    subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True)
        if self.pid and alive(self.pid):
            self._kill(self.pid)
        self.pid = None

    @staticmethod
    def _kill(pid: int) -> None:
        # only the daemon this bench started, by its PID
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not alive(pid):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)

    def metrics(self) -> dict:
        url = f"http://127.0.0.1:{self.port}/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        out: dict = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def by_label(self, sample: str, label: str) -> dict[str, float]:
        out: dict[str, float] = collections.Counter()
        for (name, labels), v in self.metrics().items():
            if name == sample:
                out[dict(labels).get(label, "?")] += v
        return dict(out)

    def requests(self) -> dict[str, float]:
        """tierfs_backend_requests_total by op."""
        return self.by_label("tierfs_backend_requests_total", "op")

    def counter(self, name: str) -> float:
        return sum(v for (n, _), v in self.metrics().items() if n == name)


def req_delta(before: dict, after: dict) -> dict[str, int]:
    ops = set(before) | set(after)
    return {op: int(after.get(op, 0) - before.get(op, 0)) for op in sorted(ops)
            if after.get(op, 0) - before.get(op, 0)}


class MemFS:
    def __init__(self, root: str, size: int, seed: int) -> None:
        self.mnt = os.path.join(root, "mnt-memfs")
        self.size, self.seed = size, seed
        self.proc: subprocess.Popen | None = None
        self.errlog = os.path.join(root, "memfs.err")
        os.makedirs(self.mnt, exist_ok=True)

    @property
    def path(self) -> str:
        return os.path.join(self.mnt, LARGE_KEY)

    def start(self) -> None:
        with open(self.errlog, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "memfs.py"), self.mnt, "--size",
                 str(self.size), "--seed", str(self.seed), "--name", LARGE_KEY],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        line = b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if r:
                line = self.proc.stdout.readline()
                break
        if line.strip() != b"READY":
            with open(self.errlog, errors="replace") as f:
                raise BenchError(f"memfs did not start: {f.read()[-2000:]}")
        log(f"memfs mounted on {self.mnt} (pid {self.proc.pid})")

    def stop(self) -> None:
        if self.proc is not None:
            unmount_and_wait(self.proc, self.mnt, 30)
        self.proc = None


def require_root_and_fuse() -> None:
    """What every bench here needs of the machine (each then checks its own RAM and disk)."""
    if os.geteuid() != 0:
        raise BenchError("run as root (drop_caches, /run/tierfs, bdi read-ahead)")
    if not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"):
        raise BenchError("needs /dev/fuse and fusermount3 (apt-get install fuse3)")


def unmount_and_wait(proc: subprocess.Popen, mnt: str, wait_s: float) -> None:
    """Unmount a FUSE server we started and wait for it (terminate, then kill, if it
    hangs); a mount still there after that is detached lazily."""
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
    elif proc.poll() is None:
        proc.terminate()  # started but never mounted: nothing to unmount
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if os.path.ismount(mnt):
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


class Profiler:
    """py-spy record of one process for one phase (only with --profile DIR)."""

    out_dir: str | None = None

    def __init__(self, pid: int, name: str) -> None:
        self.pid, self.name = pid, name
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Profiler":
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if self.out_dir and os.path.exists(exe):
            os.makedirs(self.out_dir, exist_ok=True)
            out = os.path.join(self.out_dir, f"{self.name}.txt")
            self.proc = subprocess.Popen([exe, "record", "-p", str(self.pid), "-r", "200",
                                          "--format", "raw", "-o", out, "--nonblocking"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # let it attach
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Pass:
    """One measured pass: drops caches first, then counts the server process's CPU."""

    def __init__(self, pid: int, drop: bool = True) -> None:
        self.pid, self.drop = pid, drop
        self.cpu = 0.0

    def __enter__(self) -> "Pass":
        if self.drop:
            drop_caches()
        self._c0 = proc_cpu(self.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = proc_cpu(self.pid) - self._c0


class RssSampler:
    """Polls VmRSS every 20 ms (VmHWM is the kernel's exact peak; this shows the curve)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak_kib = max(self.peak_kib, proc_status_kib(self.pid, "VmRSS"))
            except (OSError, BenchError):
                return

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


# ---------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    row: str
    measure: str
    unit: str
    tierfs: float | None
    ceiling_name: str = ""
    ceiling: float | None = None
    target: str = ""  # e.g. ">=0.8x", "=0", "<=ceiling"
    status: str = ""  # PASS / MISS / ""
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.tierfs is None or not self.ceiling:
            return None
        return self.tierfs / self.ceiling


def judge(row: Row) -> Row:
    t = row.target
    if not t or row.tierfs is None:
        return row
    if t.startswith(">=") and t.endswith("x"):
        r = row.ratio
        row.status = "PASS" if r is not None and r >= float(t[2:-1]) else "MISS"
    elif t == "=0":
        row.status = "PASS" if row.tierfs == 0 else "MISS"
    elif t == "<=ceiling":
        row.status = "PASS" if row.ceiling is not None and row.tierfs <= row.ceiling else "MISS"
    return row


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def print_table(rows: list[Row], header: str) -> None:
    cols = ["#", "measure", "unit", "tierfs", "ceiling", "ceiling value", "ratio", "target",
            "result"]
    rows = sorted(rows, key=lambda r: r.row)  # stable: each row's lines keep their order
    data = [[r.row, r.measure, r.unit, fmt(r.tierfs), r.ceiling_name, fmt(r.ceiling),
             "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target or "-", r.status or "-"]
            for r in rows]
    widths = [max(len(c), *(len(d[i]) for d in data)) for i, c in enumerate(cols)]
    right = {3, 5, 6}
    line = lambda cells: "| " + " | ".join(  # noqa: E731
        c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    print()
    print(header)
    print(line(cols))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for d in data:
        print(line(d))
    notes = [(r.row, r.measure, r.note) for r in rows if r.note]
    if notes:
        print()
        for row, measure, note in notes:
            print(f"  [{row}] {measure}: {note}")
    sys.stdout.flush()


def write_json(path: str, rows: list[Row], meta: dict) -> str:
    if os.sep not in path:
        path = os.path.join(HERE, "results", path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            rec = dict(meta, row=r.row, measure=r.measure, unit=r.unit, tierfs=r.tierfs,
                       ceiling_name=r.ceiling_name or None, ceiling=r.ceiling, ratio=r.ratio,
                       target=r.target or None, status=r.status or None, note=r.note or None,
                       **({"extra": r.extra} if r.extra else {}))
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, plan: Plan, root: str, repeat: int = 1) -> None:
        self.plan = plan
        self.repeat = repeat
        self.root = root
        self.rows: list[Row] = []
        stored = plan.large + plan.small_count * (plan.small_min + plan.small_max) // 2 \
            + plan.hot_total + plan.scan_total
        self.stored = stored
        self.memstore = max(6 * GiB, 2 * stored + 2 * GiB)
        self.rgw = Rgw(root, self.memstore)
        self.mounts: list[TierfsMount] = []
        self.memfs: MemFS | None = None
        self.large: Pieces | None = None
        self.small: dict[str, bytes] = {}
        self.hot: list[tuple[str, Pieces]] = []
        self.scan: list[tuple[str, Pieces]] = []

    def add(self, row: Row) -> Row:
        self.rows.append(judge(row))
        r = self.rows[-1]
        ratio = "" if r.ratio is None else f" = {r.ratio:.2f}x"
        ceil = f" vs {r.ceiling_name} {fmt(r.ceiling)}{ratio}" if r.ceiling_name else ""
        log(f"  [{r.row}] {r.measure}: {fmt(r.tierfs)} {r.unit}{ceil} {r.status}")
        return r

    # ---- setup ----------------------------------------------------------------------

    def check_host(self) -> None:
        require_root_and_fuse()
        p = self.plan
        # memstore ~2x the stored bytes, this process and memfs each hold the large file
        need = 2 * self.stored + 2 * p.large + p.hot_total + p.scan_total + 2 * GiB
        if mem_available() < need:
            raise BenchError(f"needs ~{need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} GiB available: use a smaller --size-mib")

    def generate(self) -> None:
        p = self.plan
        t0 = time.perf_counter()
        self.large = Pieces(p.large, LARGE_SEED)
        rng = random.Random(7)
        for i in range(p.small_count):
            size = rng.randrange(p.small_min, p.small_max + 1)
            key = f"small/d{i % p.small_dirs:02d}/f{i:05d}.bin"
            self.small[key] = bytes(datagen.make(size, 1000 + i))
        self.hot = [(f"hot/h{i}.bin", Pieces(p.hot_size, 100 + i)) for i in range(p.hot_files)]
        self.scan = [(f"scan/s{i}.bin", Pieces(p.scan_size, 200 + i))
                     for i in range(p.scan_files)]
        log(f"generated {self.stored / MiB:,.0f} MiB of test data in {time.perf_counter() - t0:.1f}s")

    def upload(self) -> None:
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        self._upload_multipart(s3, LARGE_KEY, self.large)
        with ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=pc.part(0, pc.size))
                    for k, pc in self.hot + self.scan]
            futs += [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=v)
                     for k, v in self.small.items()]
            for f in futs:
                f.result()
        log(f"uploaded {self.stored / MiB:,.0f} MiB ({2 + len(futs)} objects) "
            f"in {time.perf_counter() - t0:.1f}s")

    @staticmethod
    def _upload_multipart(s3, key: str, pc: Pieces, part: int = 64 * MiB) -> None:
        up = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        try:
            def one(n: int) -> dict:
                off = n * part
                r = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=up, PartNumber=n + 1,
                                   Body=pc.part(off, min(part, pc.size - off)))
                return {"PartNumber": n + 1, "ETag": r["ETag"]}

            with ThreadPoolExecutor(4) as ex:
                parts = list(ex.map(one, range(-(-pc.size // part))))
            s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up,
                                         MultipartUpload={"Parts": parts})
        except BaseException:
            s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up)
            raise

    def new_mount(self, name: str, **kw) -> TierfsMount:
        m = TierfsMount(self.rgw, self.root, name, **kw)
        self.mounts.append(m)
        return m

    # ---- rows 1-5: one mount with the default tiers --------------------------------

    def boto3_ceilings(self) -> tuple[float, float]:
        p = self.plan
        s3 = self.rgw.client(pool=16)
        s3.head_object(Bucket=BUCKET, Key=LARGE_KEY)  # connection warm, like tierfs's check
        t0 = time.perf_counter()
        body = s3.get_object(Bucket=BUCKET, Key=LARGE_KEY)["Body"]
        n = sum(len(c) for c in body.iter_chunks(MiB))
        one = n / MiB / (time.perf_counter() - t0)
        if n != p.large:
            raise BenchError(f"boto3 GET returned {n} bytes")

        def ranged(off: int) -> int:
            end = min(off + CHUNK, p.large) - 1
            return len(s3.get_object(Bucket=BUCKET, Key=LARGE_KEY,
                                     Range=f"bytes={off}-{end}")["Body"].read())

        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            n = sum(ex.map(ranged, range(0, p.large, CHUNK)))
        eight = n / MiB / (time.perf_counter() - t0)
        return one, eight

    def rows_1_to_5(self) -> None:
        p = self.plan
        size_mib = p.large / MiB
        self.memfs = MemFS(self.root, p.large, LARGE_SEED)
        self.memfs.start()
        s: dict[str, list[float]] = collections.defaultdict(list)  # samples per measure
        req: dict[str, dict] = {}
        rng = random.Random(3)
        offsets = [rng.randrange(p.large // 4096) * 4096 for _ in range(p.random_reads)]
        a: TierfsMount | None = None
        for rep in range(self.repeat):
            tag = f" (repeat {rep + 1}/{self.repeat})" if self.repeat > 1 else ""
            if a is not None:  # every repetition starts from a new, empty cache dir
                a.unmount()
                shutil.rmtree(a.cache_dir, ignore_errors=True)
            log(f"row 1: boto3 ceilings for the large file{tag}")
            c0 = time.process_time()
            one, eight = self.boto3_ceilings()
            s["boto_cpu"].append((time.process_time() - c0) / (2 * p.large / GiB))
            s["boto1"].append(one)
            s["boto8"].append(eight)
            a = self.new_mount(f"main{rep}", cache_size=p.cache_size,
                               memory_cache_size=p.memory_cache)
            a.mount()
            path = os.path.join(a.mnt, LARGE_KEY)

            log(f"row 1: cold sequential read through a fresh mount{tag}")
            with Pass(a.pid) as ps, Profiler(a.pid, f"cold-seq{rep}"):
                r0 = a.requests()
                n, dt = seq_read(path, self.large)
            s["cold"].append(n / MiB / dt)
            s["cold_cpu"].append(ps.cpu / (n / GiB))
            req["cold"] = req_delta(r0, a.requests())

            log(f"row 2: warm re-read, same mount, page cache dropped{tag}")
            with Pass(a.pid) as ps, Profiler(a.pid, f"warm-seq{rep}"):
                r0 = a.requests()
                s0 = a.by_label("tierfs_read_bytes_total", "source")
                n, dt = seq_read(path, self.large)
            s["warm"].append(n / MiB / dt)
            s["warm_cpu"].append(ps.cpu / (n / GiB))
            req["warm"] = req_delta(r0, a.requests())
            req["warm_src"] = req_delta(s0, a.by_label("tierfs_read_bytes_total", "source"))

            with Pass(self.memfs.proc.pid) as ps:
                n, dt = seq_read(self.memfs.path, self.large)
            s["memfs"].append(n / MiB / dt)
            s["memfs_cpu"].append(ps.cpu / (n / GiB))

            # what the disk under the cache dir gives, to attribute a warm-read gap
            drop_caches()
            t0 = time.perf_counter()
            nbytes = 0
            for dirpath, _, files in os.walk(os.path.join(a.cache_dir, "chunks")):
                for fn in files:
                    nbytes += len(read_whole(os.path.join(dirpath, fn)))
            s["disk"].append(nbytes / MiB / (time.perf_counter() - t0))

            log(f"row 2: restart (unmount + remount, same cache dir), page cache dropped{tag}")
            a.unmount()
            a.mount()
            with Pass(a.pid) as ps, Profiler(a.pid, f"restart-seq{rep}"):
                r0 = a.requests()
                n, dt = seq_read(path, self.large)
            s["restart"].append(n / MiB / dt)
            s["restart_cpu"].append(ps.cpu / (n / GiB))
            req["restart"] = req_delta(r0, a.requests())

            log(f"row 3: random 4 KiB reads on the warm file{tag}")
            with Pass(a.pid) as ps:
                r0 = a.requests()
                dt = random_reads(path, offsets, self.large)
            s["rnd"].append(len(offsets) / dt)
            req["rnd"] = req_delta(r0, a.requests())
            with Pass(self.memfs.proc.pid):
                dt = random_reads(self.memfs.path, offsets, self.large)
            s["memfs_rnd"].append(len(offsets) / dt)
            files = large_chunk_files(a.cache_dir, p.large)
            if files:
                with Pass(os.getpid()):
                    dt = block_reads(files, offsets)
                s["disk_rnd"].append(len(offsets) / dt)
        self.memfs.stop()
        assert a is not None

        def med(k: str) -> float:
            return statistics.median(s[k])

        def spread(*keys: str) -> str:
            if self.repeat == 1:
                return ""
            return "; " + ", ".join(f"{k} {min(s[k]):,.0f}-{max(s[k]):,.0f}" for k in keys) + \
                f" over {self.repeat} runs (medians shown)"

        cpu_note = (f"daemon CPU {med('cold_cpu'):.2f} s/GiB cold, {med('warm_cpu'):.2f} warm, "
                    f"{med('restart_cpu'):.2f} after restart; memfs {med('memfs_cpu'):.2f} s/GiB")
        self.add(Row("1", f"cold seq read {size_mib:.0f} MiB, 1 MiB reads", "MiB/s", med("cold"),
                     "boto3 1-stream GET", med("boto1"),
                     note=f"backend requests {req['cold']}; daemon CPU {med('cold_cpu'):.2f} s/GiB, "
                          f"boto3 (bench process, both ceilings) {med('boto_cpu'):.2f} s/GiB"
                          + spread("cold", "boto1", "boto8"),
                     extra={k: s[k] for k in ("cold", "boto1", "cold_cpu")}))
        self.add(Row("1", "cold seq read (same figure)", "MiB/s", med("cold"),
                     "boto3 8x8MiB ranged GETs", med("boto8"), target=">=0.8x",
                     extra={k: s[k] for k in ("cold", "boto8")}))
        self.add(Row("2", "warm seq re-read (same mount)", "MiB/s", med("warm"), "memfs seq read",
                     med("memfs"), target=">=0.8x",
                     note="served by source: " + ", ".join(
                         f"{k} {v / MiB:,.0f} MiB" for k, v in sorted(req["warm_src"].items()))
                     + "; " + cpu_note + spread("warm", "memfs"),
                     extra={k: s[k] for k in ("warm", "memfs", "warm_cpu", "memfs_cpu")}))
        self.add(Row("2", "warm re-read: backend GETs", "GETs", req["warm"].get("get", 0),
                     target="=0", note=f"all backend requests: {req['warm'] or 0}"))
        self.add(Row("2", "re-read after restart", "MiB/s", med("restart"), "memfs seq read",
                     med("memfs"), target=">=0.8x", note=spread("restart").lstrip("; "),
                     extra={k: s[k] for k in ("restart", "restart_cpu")}))
        self.add(Row("2", "after restart: backend GETs", "GETs", req["restart"].get("get", 0),
                     target="=0", note=f"all backend requests: {req['restart'] or 0}"))
        self.add(Row("2", "(info) cat of the cache dir's chunk files", "MiB/s", med("disk"),
                     note="page cache dropped: what the disk under the disk tier gives here",
                     extra={"disk": s["disk"]}))
        self.add(Row("3", f"random 4 KiB preads x{len(offsets)} (warm)", "reads/s", med("rnd"),
                     "memfs same reads", med("memfs_rnd"),
                     note=f"backend requests {req['rnd'] or 0}" + spread("rnd", "memfs_rnd"),
                     extra={k: s[k] for k in ("rnd", "memfs_rnd")}))

        if s["disk_rnd"]:
            self.add(Row("3", "(info) same offsets as 64 KiB preads of the chunk files",
                         "reads/s", med("disk_rnd"),
                         note="page cache dropped; 64 KiB is tierfs's checksum block, the least "
                              "a disk-tier read can fetch: the disk's share of row 3",
                         extra={"disk_rnd": s["disk_rnd"]}))
        self.small_files(a)
        a.unmount()

    def small_files(self, a: TierfsMount) -> None:
        p = self.plan
        keys = list(self.small)
        total = sum(len(v) for v in self.small.values())
        label = f"{len(keys)} files {p.small_min // KiB}-{p.small_max // KiB} KiB"

        log(f"row 4: boto3 GETs of the {len(keys)} small objects, {p.threads} threads")
        s3 = self.rgw.client(pool=16)

        def get(k: str) -> int:
            return len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read())

        t0 = time.perf_counter()
        with ThreadPoolExecutor(p.threads) as ex:
            n = sum(ex.map(get, keys))
        b3 = time.perf_counter() - t0
        if n != total:
            raise BenchError(f"boto3 read {n} bytes of small objects, expected {total}")

        def read_all(m: TierfsMount, name: str) -> tuple[float, dict, float]:
            def through(k: str) -> int:
                data = read_whole(os.path.join(m.mnt, k))
                if data != self.small[k]:
                    raise BenchError(f"{k}: wrong bytes through tierfs")
                return len(data)

            with Pass(m.pid) as ps, Profiler(m.pid, name):
                r0 = m.requests()
                t0 = time.perf_counter()
                with ThreadPoolExecutor(p.threads) as ex:
                    sum(ex.map(through, keys))
                dt = time.perf_counter() - t0
            return dt, req_delta(r0, m.requests()), ps.cpu

        results = {}
        for phase in ("cold", "warm"):
            log(f"row 4: {phase} read of the small files through tierfs, {p.threads} threads, "
                "opened by path (no listing first)")
            results[phase] = read_all(a, f"small-{phase}")
        for phase, (dt, req, cpu) in results.items():
            self.add(Row("4", f"{phase} {label}, {p.threads} threads", "files/s", len(keys) / dt,
                         f"boto3 GET {p.threads} threads", len(keys) / b3,
                         note=f"backend requests {req or 0}; daemon CPU "
                              f"{cpu / len(keys) * 1e3:.2f} ms/file"))
            self.add(Row("4", f"{phase} small files (same run)", "MiB/s", total / MiB / dt,
                         f"boto3 GET {p.threads} threads", total / MiB / b3))
        self.add(Row("4", "warm small files: backend requests", "requests",
                     sum(results["warm"][1].values()), target="=0",
                     note=f"metadata TTL is tierfs's default ({DEFAULT_TTL:.0f} s): the warm "
                          f"pass began {results['cold'][0]:.0f} s after the cold pass's first lookups"))

        for walk in ("first", "repeat"):
            log(f"row 5: find + stat of the tree ({walk} walk, dentry/inode caches dropped)")
            with Pass(a.pid):
                r0 = a.requests()
                t0 = time.perf_counter()
                entries = 0
                for dirpath, dirs, files in os.walk(a.mnt):
                    for name in dirs + files:
                        os.stat(os.path.join(dirpath, name))
                        entries += 1
                dt = time.perf_counter() - t0
            req = req_delta(r0, a.requests())
            want = len(keys) + p.small_dirs + len(self.hot) + len(self.scan) + 4
            if entries != want:
                raise BenchError(f"find saw {entries} entries, expected {want}")
            first = walk == "first"
            self.add(Row("5", f"find+stat {walk} walk ({entries} entries)", "entries/s",
                         entries / dt, note=f"backend requests {req or 0}"
                         + ("; directories so far only looked up by path are listed once here"
                            if first else "")))
            self.add(Row("5", f"find+stat {walk} walk: backend requests", "requests",
                         sum(req.values()), target="" if first else "=0"))

        log("row 4: (info) cold read on a fresh mount after a find of the tree")
        d = self.new_mount("listed", cache_size=p.cache_size, memory_cache_size=p.memory_cache)
        d.mount()
        drop_caches()
        r0 = d.requests()
        t0 = time.perf_counter()
        for _ in os.walk(d.mnt):
            pass
        walk_s = time.perf_counter() - t0
        walk_req = req_delta(r0, d.requests())
        dt, req, cpu = read_all(d, "small-cold-listed")
        self.add(Row("4", f"(info) cold {label} after a find", "files/s", len(keys) / dt,
                     f"boto3 GET {p.threads} threads", len(keys) / b3,
                     note=f"fresh cache dir; the find took {walk_s:.1f} s with {walk_req}; the "
                          f"reads then sent {req or 0}; daemon CPU "
                          f"{cpu / len(keys) * 1e3:.2f} ms/file"))
        d.unmount()

    # ---- row 6: memory ceiling ----------------------------------------------------

    def row_6(self) -> None:
        p = self.plan
        mem = p.rss_memory_cache
        log(f"row 6: RSS while reading {p.large / MiB:.0f} MiB through --memory-cache-size "
            f"{mem // MiB}M")
        b = self.new_mount("rss", cache_size=p.cache_size, memory_cache_size=mem)
        b.mount()
        path = os.path.join(b.mnt, LARGE_KEY)
        start_kib = proc_status_kib(b.pid, "VmRSS")
        with RssSampler(b.pid) as s:
            drop_caches()
            n, dt_cold = seq_read(path, self.large)
            hwm_cold = proc_status_kib(b.pid, "VmHWM")
            drop_caches()
            n, dt_warm = seq_read(path, self.large)
        hwm = proc_status_kib(b.pid, "VmHWM")
        end_kib = proc_status_kib(b.pid, "VmRSS")
        ceiling = mem / MiB + 150
        self.add(Row("6", f"daemon peak RSS (VmHWM), {p.large // MiB} MiB file, "
                          f"mem tier {mem // MiB}M", "MiB", round(hwm / 1024, 1),
                     "mem tier + 150 MiB", ceiling, target="<=ceiling",
                     note=f"RSS at mount {start_kib / 1024:.0f} MiB; VmHWM after the cold pass "
                          f"{hwm_cold / 1024:.0f} MiB ({n / MiB / dt_cold:.0f} MiB/s), after the "
                          f"warm pass {hwm / 1024:.0f} MiB ({n / MiB / dt_warm:.0f} MiB/s); RSS "
                          f"at the end {end_kib / 1024:.0f} MiB; sampled peak "
                          f"{s.peak_kib / 1024:.0f} MiB"))
        b.unmount()

    # ---- row 7: scan resistance ---------------------------------------------------

    def row_7(self) -> None:
        p = self.plan
        log(f"row 7: scan resistance, --cache-size {p.scan_cache_size // MiB}M "
            f"--memory-cache-size {p.scan_memory_cache // MiB}M")
        c = self.new_mount("scan", cache_size=p.scan_cache_size,
                           memory_cache_size=p.scan_memory_cache)
        c.mount()

        def read_set(files: list[tuple[str, Pieces]]) -> dict[str, int]:
            drop_caches()
            r0 = c.requests()
            for k, pc in files:
                seq_read(os.path.join(c.mnt, k), pc)
            return req_delta(r0, c.requests())

        passes = []
        for i in range(p.hot_passes):
            passes.append(("hot", read_set(self.hot)))
        ev0 = c.counter("tierfs_cache_evictions_total")
        passes.append(("scan", read_set(self.scan)))
        evicted = c.counter("tierfs_cache_evictions_total") - ev0
        passes.append(("hot", read_set(self.hot)))
        gets = [d.get("get", 0) for _, d in passes]

        hot_trace = chunk_trace([(k, pc.size) for k, pc in self.hot])
        scan_trace = chunk_trace([(k, pc.size) for k, pc in self.scan])
        capacity = p.scan_cache_size // CHUNK
        sim = simulate_lru([hot_trace] * p.hot_passes + [scan_trace, hot_trace], capacity)
        self.add(Row("7", f"final hot-set pass GETs ({p.hot_files}x{p.hot_size // MiB} MiB hot x"
                          f"{p.hot_passes}, then {p.scan_total // MiB} MiB scan)", "GETs",
                     gets[-1], "plain LRU (SIMULATED)", sim[-1], target="=0",
                     note=f"tierfs GETs per pass {gets} (hot x{p.hot_passes}, scan, hot); the scan "
                          f"has {len(scan_trace)} distinct chunks, GETs beyond that fetched a chunk "
                          f"twice; chunks evicted during the scan {evicted:.0f}. LRU is a Python simulation of "
                          f"a {capacity}-chunk ({p.scan_cache_size // MiB} MiB) LRU over the same "
                          f"{CHUNK // MiB} MiB chunk trace, misses per pass {sim}"))
        c.unmount()

    # ---- driver ---------------------------------------------------------------------

    def run(self) -> None:
        self.check_host()
        self.generate()
        self.rgw.start()
        self.upload()
        self.rows_1_to_5()
        self.row_6()
        self.row_7()

    def cleanup(self) -> None:
        run_all(([self.memfs.stop] if self.memfs else []) + [m.unmount for m in self.mounts]
                + [self.rgw.stop])


def run_all(steps) -> None:
    """A bench's cleanup: every step, whatever the others did (one warning line each)."""
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - keep cleaning up
            log(f"warning: cleanup step failed: {exc!r}")


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end a run through its finally blocks, which stop what it started
    (SIGINT too when the run was started with it ignored, as a script's background job)."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def finish(bench, root: str, ok: bool, keep: bool, also_mounted: tuple[str, ...] = ()) -> None:
    """The end of each bench's main(), also on failure: stop what the bench started, show
    the daemons' last log lines if it failed, and remove the work dir unless something is
    still mounted there or --keep asked to keep it."""
    still = []
    if bench is not None:
        bench.cleanup()
        still = [m.mnt for m in bench.mounts if os.path.ismount(m.mnt)]
        still += [mnt for mnt in also_mounted if os.path.ismount(mnt)]
        if not ok:
            for m in bench.mounts:
                tail = m.log_tail(10)
                if tail:
                    log(f"last lines of {m.cache_dir}/tierfs.log:\n{tail.rstrip()}")
    if still:
        log(f"warning: still mounted, work dir {root} kept: {still}")
    elif keep:
        log(f"work dir kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


def drive(bench, root: str, ref: str | None, keep: bool, describe: str = "",
          also_mounted=lambda: ()) -> bool:
    """The middle of each bench's main(): the tierfs code of `ref` exported, one log line of
    what runs, `bench.run()`, a BenchError or ^C as one line, and `finish` whatever happened
    (`also_mounted()`: mounts the bench made besides its tierfs ones). Returns whether the
    run completed."""
    ok = False
    try:
        if ref:
            Source.export(ref, root)
        log(f"tierfs code: {Source.label}")
        if describe:
            log(describe)
        bench.run()
        ok = True
    except BenchError as exc:
        log(f"error: {exc}")
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        finish(bench, root, ok, keep, also_mounted())
    return ok


HISTORY = os.path.join(HERE, "history.tsv")
HISTORY_COLS = ("date", "git_sha", "tierfs_code", "row", "measure", "unit", "tierfs",
                "ceiling_name", "ceiling", "ratio", "status", "load")


def append_history(rows: list[Row], info: dict, code: str, started: datetime.datetime,
                   path: str = HISTORY) -> str:
    """The regression guard: a complete `--quick` run appends one line per row (its ratio to
    the same-run ceiling, the commit) to bench/history.tsv; the header is written once."""
    clean = lambda v: str(v).replace("\t", " ").replace("\n", " ")  # noqa: E731
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    load = f"{os.getloadavg()[0]:.1f}"
    with open(path, "a") as f:
        if new:
            f.write("\t".join(HISTORY_COLS) + "\n")
        for r in sorted(rows, key=lambda r: r.row):
            cells = (started.strftime("%Y-%m-%dT%H:%MZ"), info["git_sha"][:12], code, r.row,
                     r.measure, r.unit, "" if r.tierfs is None else f"{r.tierfs:.4g}",
                     r.ceiling_name, "" if r.ceiling is None else f"{r.ceiling:.4g}",
                     "" if r.ratio is None else f"{r.ratio:.3f}", r.status, load)
            f.write("\t".join(clean(c) for c in cells) + "\n")
    return path


def code_label(ref: str | None) -> tuple[dict, str]:
    """(git facts, which tierfs code ran) for the table header and the JSON lines."""
    info = git_info()
    code = (Source.label if ref else f"git {info['git_sha'][:12]}"
            f"{' + uncommitted tierfs/ changes' if info['tierfs_dirty'] else ''}")
    return info, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, help="large file size (default 1024; --quick 256)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller data everywhere (about a minute); figures are noisier")
    ap.add_argument("--json", metavar="FILE",
                    help="append one JSON line per row (with the git sha) to FILE "
                         "(a bare name goes to bench/results/)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run rows 1-3 N times (fresh cache dir each) and show medians")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons from a snapshot of this commit (e.g. HEAD) instead "
                         "of the working tree")
    ap.add_argument("--profile", metavar="DIR",
                    help="py-spy record the daemon (raw collapsed stacks) during the seq and "
                         "small-file passes into DIR; slows those passes down")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work dir (cache dirs, tierfs logs) after the run")
    args = ap.parse_args()
    stop_on_signals()
    if args.profile:
        Profiler.out_dir = os.path.abspath(args.profile)
    plan = Plan.make(args.size_mib, args.quick)
    root = tempfile.mkdtemp(prefix="tierfs-bench.", dir="/tmp")
    bench = Bench(plan, root, max(1, args.repeat))
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    ok = drive(bench, root, args.ref, args.keep,
               f"work dir {root}; large file {plan.large / MiB:.0f} MiB, {plan.small_count} "
               f"small files, {bench.stored / MiB:,.0f} MiB stored in total",
               lambda: (bench.memfs.mnt,) if bench.memfs else ())

    info, code = code_label(args.ref)
    header = (f"tierfs bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  large file "
              f"{plan.large // MiB} MiB  {'quick  ' if args.quick else ''}"
              f"load {os.getloadavg()[0]:.1f}  {time.perf_counter() - t0:.0f}s")
    if bench.rows:
        print_table(bench.rows, header)
    if args.quick and ok and bench.rows:
        log(f"appended {len(bench.rows)} rows to {append_history(bench.rows, info, code, started)}")
    if args.json and bench.rows:
        meta = dict(info, ts=started.isoformat(), tierfs_code=code, size_mib=plan.large // MiB, quick=args.quick,
                    complete=ok, nproc=os.cpu_count())
        log(f"appended {len(bench.rows)} JSON lines to {write_json(args.json, bench.rows, meta)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
