#!/usr/bin/env python3
"""tierfs write benchmark: every tierfs write figure beside a ceiling measured in the same run.

    .venv/bin/python bench/write.py [--size-mib N] [--quick] [--repeat N] [--json FILE]
                                    [--https]

One command, like bench/run.py (whose RGW, mount, metrics, table and JSON helpers it
imports): starts its own throw-away Ceph RGW, mounts tierfs (default mode and
--writeback), writes through the mounts, reads everything back and compares sha256 with
what was written, prints a table; everything it started is stopped in `finally` blocks.
Needs root (drop caches, /run/tierfs), /dev/fuse, fusermount3 and the ceph packages. See
bench/README.md ("Write benchmark") for what each row means.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the read benchmark and the shared helpers)
from run import (BUCKET, GiB, MiB, BenchError, Pass, Profiler, Row, Source,  # noqa: E402
                 TierfsMount, drop_caches, log, mem_available, print_table,
                 req_delta, write_json)

PART = 8 * MiB  # the ceiling's multipart part size (tierfs's own part size is 8 MiB too)
CEIL_THREADS = 8  # the ceiling's upload threads
SEQ_SEED = 500
SHARD_SEED = 600
POLL_S = 0.05  # how often the write-back drain is polled


@dataclass
class WritePlan:
    seq: int  # bytes of the sequential-write file
    shards: int
    shard_size: int
    ckpt_threads: int  # shards saved / restored at once (1: one after the other)
    cache_size: str = "4G"
    memory_cache: int = 256 * MiB
    bs: int = MiB  # write() and read() size

    @classmethod
    def make(cls, args: argparse.Namespace) -> "WritePlan":
        seq = (args.size_mib or (128 if args.quick else 512)) * MiB
        shards = args.shards or (4 if args.quick else 8)
        shard = (args.shard_mib or (16 if args.quick else 32)) * MiB
        if seq < 16 * MiB or shard < MiB:
            raise BenchError("--size-mib must be at least 16 and --shard-mib at least 1")
        return cls(seq, shards, shard, max(1, args.ckpt_threads))

    @property
    def ckpt_total(self) -> int:
        return self.shards * self.shard_size


# ---------------------------------------------------------------------------------------
# I/O helpers: the bench's own writes and reads (sha256 outside the timed part)


def write_file(path: str, data: bytearray, bs: int, *, fsync: bool = False) -> dict[str, float]:
    """create/truncate, bs-sized write()s, [fsync], close: perf_counter stamps of each step."""
    view = memoryview(data)
    t = {"start": time.perf_counter()}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(data):
            off += os.write(fd, view[off:off + bs])
        t["written"] = time.perf_counter()
        if fsync:
            os.fsync(fd)
            t["fsynced"] = time.perf_counter()
    finally:
        os.close(fd)
    t["closed"] = time.perf_counter()
    return t


def read_into(path: str, size: int, bs: int) -> tuple[bytearray, float]:
    """Read a whole file with bs-sized reads into one buffer: (bytes, seconds)."""
    buf = bytearray(size + 1)  # one byte more: a file longer than expected shows
    view = memoryview(buf)
    got = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while True:
            n = os.readv(fd, [view[got:got + bs]])
            if n == 0:
                break
            got += n
            if got > size:
                raise BenchError(f"{path}: longer than the {size} bytes written")
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    del view
    if got != size:
        raise BenchError(f"{path}: read {got} bytes, wrote {size}")
    del buf[size:]
    return buf, dt


def sha(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def s3_upload(s3, key: str, data: bytearray, threads: int = CEIL_THREADS,  # noqa: ANN001
              part: int = PART) -> None:
    """The ceiling: multipart upload, `part`-sized parts, `threads` parts at once."""
    view = memoryview(data)
    up = s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    try:
        def one(n: int) -> dict:
            r = s3.upload_part(Bucket=BUCKET, Key=key, UploadId=up, PartNumber=n + 1,
                               Body=bytes(view[n * part:(n + 1) * part]))
            return {"PartNumber": n + 1, "ETag": r["ETag"]}

        with ThreadPoolExecutor(threads) as ex:
            parts = list(ex.map(one, range(-(-len(data) // part))))
        s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up,
                                     MultipartUpload={"Parts": parts})
    except BaseException:
        s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up)
        raise


def s3_sha256(s3, key: str, size: int) -> str:  # noqa: ANN001
    """sha256 of an object as the RGW serves it (8 MiB ranged GETs, 8 threads)."""
    head = s3.head_object(Bucket=BUCKET, Key=key)
    if head["ContentLength"] != size:
        raise BenchError(f"s3://{BUCKET}/{key} holds {head['ContentLength']} bytes, "
                         f"{size} were written")
    buf = bytearray(size)

    def get(off: int) -> None:
        end = min(off + PART, size) - 1
        body = s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={off}-{end}")["Body"].read()
        buf[off:off + len(body)] = body

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(get, range(0, size, PART)))
    return sha(buf)


def cat_chunk_files(cache_dir: str) -> tuple[int, float]:
    """Read every chunk file of a cache dir once (hard links once), page cache dropped:
    what the disk under the disk tier delivers. (bytes, seconds)"""
    drop_caches()
    seen: set[int] = set()
    total = 0
    t0 = time.perf_counter()
    for dirpath, _, files in os.walk(os.path.join(cache_dir, "chunks")):
        for fn in files:
            path = os.path.join(dirpath, fn)
            ino = os.stat(path).st_ino
            if ino not in seen:
                seen.add(ino)
                total += len(run.read_whole(path))
    return total, time.perf_counter() - t0


def s3_get_all(s3, keys: list[str], size: int, threads: int = 8) -> float:  # noqa: ANN001
    """8 MiB ranged GETs of whole objects, `threads` at once (no hashing): seconds."""
    jobs = [(k, off) for k in keys for off in range(0, size, PART)]

    def get(job: tuple[str, int]) -> int:
        k, off = job
        end = min(off + PART, size) - 1
        return len(s3.get_object(Bucket=BUCKET, Key=k, Range=f"bytes={off}-{end}")["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(get, jobs))
    if n != size * len(keys):
        raise BenchError(f"boto3 GETs returned {n} bytes, expected {size * len(keys)}")
    return time.perf_counter() - t0


def summarise_profile(path: str, top: int = 15) -> str:
    """py-spy raw (collapsed) stacks -> the top frames by own and by inclusive samples,
    and the share of the trio thread versus worker threads."""
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    roots: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            own[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
            # worker threads (trio.to_thread, the metrics server) start in threading.py
            roots["worker threads" if frames[0].startswith("Thread._bootstrap ")
                  else "main (trio) thread"] += n
    if not total:
        return f"{path}: no samples"
    pct = lambda n: f"{100 * n / total:5.1f}%"  # noqa: E731
    out = [f"{path}: {total} samples; " + ", ".join(f"{k} {pct(v).strip()}"
                                                    for k, v in roots.most_common())]
    out.append("  own time (leaf frames):")
    out += [f"    {pct(n)}  {fr}" for fr, n in own.most_common(top)]
    out.append("  inclusive, tierfs frames:")
    out += [f"    {pct(n)}  {fr}" for fr, n in incl.most_common()
            if "tierfs/" in fr][:top]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# the benchmark


class WriteBench(run.Bench):
    """Reuses run.Bench's rows, mounts, add() and cleanup(); its own data and passes."""

    def __init__(self, plan: WritePlan, root: str, repeat: int) -> None:  # noqa: D107
        self.plan = plan  # type: ignore[assignment]
        self.repeat = repeat
        self.root = root
        self.rows: list[Row] = []
        p = plan
        # what the RGW stores, deleted objects included (its GC frees them a minute or
        # more later): per repeat the file 3 times (boto3, default, --writeback), the
        # checkpoint as boto3, tierfs's tmp objects and their renamed copies
        self.stored = repeat * (3 * p.seq + 3 * p.ckpt_total)
        self.memstore = max(6 * GiB, 2 * self.stored + 2 * GiB)
        self.rgw = run.Rgw(root, self.memstore)
        self.mounts: list[TierfsMount] = []
        self.memfs = None
        self.seq_data = bytearray()
        self.shards: list[bytearray] = []
        self.s: dict[str, list[float]] = collections.defaultdict(list)  # samples per measure
        self.last: dict[str, object] = {}  # notes from the last repeat

    def add(self, row: Row) -> Row:
        if row.target == ">0" and row.tierfs is not None:  # run.judge knows no ">0"
            row.status = "PASS" if row.tierfs > 0 else "MISS"
        return super().add(row)

    def check_host(self) -> None:
        run.require_root_and_fuse()
        p = self.plan
        # the RGW's memstore ~2x what it stores; the bench holds the data and one copy
        # read back; the page cache holds the staging files for a while
        need = 2 * self.stored + 3 * (p.seq + p.ckpt_total) + 2 * GiB
        if mem_available() < need:
            raise BenchError(f"needs ~{need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} GiB available: use a smaller "
                             "--size-mib or --repeat")

    def generate(self) -> None:
        p = self.plan
        self.seq_data = datagen.make(p.seq, SEQ_SEED)
        self.seq_sha = sha(self.seq_data)
        self.shards = [datagen.make(p.shard_size, SHARD_SEED + i) for i in range(p.shards)]
        self.shard_sha = [sha(d) for d in self.shards]

    def mount(self, name: str, *extra: str, cache_dir: str | None = None) -> TierfsMount:
        m = self.new_mount(name, cache_size=self.plan.cache_size,
                           memory_cache_size=self.plan.memory_cache, cache_dir=cache_dir,
                           extra_args=extra)
        m.mount()
        return m

    # ---- metrics helpers ----------------------------------------------------------

    @staticmethod
    def snapshot(m: TierfsMount) -> dict:
        met = m.metrics()

        def total(name: str, **labels: str) -> float:
            return sum(v for (n, lab), v in met.items() if n == name
                       and all(dict(lab).get(k) == want for k, want in labels.items()))

        return {"req": m.by_label("tierfs_backend_requests_total", "op"),
                "fuse_writes": total("tierfs_fuse_requests_total", op="write"),
                "upload_s": total("tierfs_writeback_upload_seconds_sum"),
                "uploads_ok": total("tierfs_writeback_uploads_total", outcome="success"),
                "uploads_failed": total("tierfs_writeback_uploads_total", outcome="failure"),
                "src": m.by_label("tierfs_read_bytes_total", "source"),
                "dirty": total("tierfs_writeback_dirty_bytes")}

    def read_back(self, m: TierfsMount, rel: str, expect_sha: str, size: int) -> dict:
        """Page cache dropped, read the file back through the mount: sha256, GETs, MiB/s."""
        drop_caches()
        r0 = m.requests()
        data, dt = read_into(os.path.join(m.mnt, rel), size, self.plan.bs)
        req = req_delta(r0, m.requests())
        if sha(data) != expect_sha:
            raise BenchError(f"{rel}: sha256 read back through tierfs differs from what was "
                             "written")
        return {"req": req, "gets": req.get("get", 0), "mibs": size / MiB / dt}

    def check_s3(self, s3, key: str, expect_sha: str, size: int) -> None:  # noqa: ANN001
        if s3_sha256(s3, key, size) != expect_sha:
            raise BenchError(f"s3://{BUCKET}/{key}: sha256 differs from what was written")

    # ---- row a: one sequential file ----------------------------------------------

    def row_a(self, rep: int, s3) -> None:  # noqa: ANN001
        p, s = self.plan, self.s
        size_mib = p.seq / MiB
        tag = f" (repeat {rep + 1}/{self.repeat})" if self.repeat > 1 else ""

        log(f"row a: local disk ceiling: write {size_mib:.0f} MiB + fsync to the cache dir's "
            f"filesystem{tag}")
        drop_caches()
        local = os.path.join(self.root, f"local-{rep}.bin")
        t = write_file(local, self.seq_data, p.bs, fsync=True)
        s["local"].append(size_mib / (t["closed"] - t["start"]))
        with open(local, "rb") as f:
            if sha(f.read()) != self.seq_sha:
                raise BenchError("local file: sha256 differs")
        os.unlink(local)

        log(f"row a: boto3 multipart upload of {size_mib:.0f} MiB ({PART // MiB} MiB parts, "
            f"{CEIL_THREADS} threads){tag}")
        key = f"ceil/seq-{rep}.bin"
        drop_caches()
        c0 = time.process_time()
        t0 = time.perf_counter()
        s3_upload(s3, key, self.seq_data)
        dt = time.perf_counter() - t0
        s["boto3"].append(size_mib / dt)
        s["boto3_cpu"].append((time.process_time() - c0) / (p.seq / GiB))
        self.check_s3(s3, key, self.seq_sha, p.seq)

        # default mode: close() returns once S3 has the object
        log(f"row a: sequential write through tierfs, default mode (close() uploads){tag}")
        m = self.mount(f"wr{rep}")
        rel = f"seq/default-{rep}.bin"
        os.makedirs(os.path.join(m.mnt, "seq"), exist_ok=True)
        with Pass(m.pid) as ps:
            m0 = self.snapshot(m)
            t = write_file(os.path.join(m.mnt, rel), self.seq_data, p.bs)
        m1 = self.snapshot(m)
        total = t["closed"] - t["start"]
        s["default"].append(size_mib / total)
        s["default_write_s"].append(t["written"] - t["start"])
        s["default_close_s"].append(t["closed"] - t["written"])
        s["default_cpu"].append(ps.cpu / (p.seq / GiB))
        fuse_writes = m1["fuse_writes"] - m0["fuse_writes"]
        self.last["default"] = {
            "req": req_delta(m0["req"], m1["req"]),
            "upload_s": m1["upload_s"] - m0["upload_s"],
            "write_kib": p.seq / max(1, fuse_writes) / 1024, "fuse_writes": int(fuse_writes)}
        if m1["uploads_ok"] - m0["uploads_ok"] != 1 or m1["dirty"] != 0:
            done = m1["uploads_ok"] - m0["uploads_ok"]
            raise BenchError(f"default mode: after close(), {done:.0f} uploads (want 1), "
                             f"dirty bytes {m1['dirty']:.0f}")
        rb = self.read_back(m, rel, self.seq_sha, p.seq)
        s["readback"].append(rb["mibs"])
        s["readback_gets"].append(rb["gets"])
        self.last["readback_req"] = rb["req"]
        self.check_s3(s3, rel, self.seq_sha, p.seq)

        # row b uses this mount (the checkpoint is saved where the file was written)
        self.row_b_save(rep, m, s3)

        # write-back: close() returns once the staging file is fsynced and journaled
        log(f"row a: sequential write through tierfs --writeback{tag}")
        w = self.mount(f"wb{rep}", "--writeback")
        rel = f"seq/writeback-{rep}.bin"
        os.makedirs(os.path.join(w.mnt, "seq"), exist_ok=True)
        with Pass(w.pid) as ps:
            m0 = self.snapshot(w)
            t = write_file(os.path.join(w.mnt, rel), self.seq_data, p.bs)
            deadline = time.monotonic() + 600
            while True:
                cur = self.snapshot(w)
                if cur["dirty"] == 0 and cur["uploads_ok"] > m0["uploads_ok"]:
                    break
                if cur["uploads_failed"] > m0["uploads_failed"] or time.monotonic() > deadline:
                    raise BenchError(f"--writeback: the upload failed or did not finish "
                                     f"(dirty bytes {cur['dirty']:.0f})\n{w.log_tail()}")
                time.sleep(POLL_S)
            t_clean = time.perf_counter()
        m1 = self.snapshot(w)
        s["wb_close"].append(size_mib / (t["closed"] - t["start"]))
        s["wb_clean"].append(size_mib / (t_clean - t["start"]))
        s["wb_close_s"].append(t["closed"] - t["written"])
        s["wb_drain_s"].append(t_clean - t["closed"])
        s["wb_cpu"].append(ps.cpu / (p.seq / GiB))
        self.last["wb"] = {"req": req_delta(m0["req"], m1["req"]),
                           "upload_s": m1["upload_s"] - m0["upload_s"]}
        rb = self.read_back(w, rel, self.seq_sha, p.seq)
        s["wb_readback_gets"].append(rb["gets"])
        self.check_s3(s3, rel, self.seq_sha, p.seq)
        w.unmount()

    # ---- row b: checkpoint save + restore -----------------------------------------

    def save_shards(self, dirpath: str) -> dict[str, float]:
        """torch.save-style: each shard to NAME.tmp, write, fsync, close, rename to NAME."""
        os.makedirs(dirpath, exist_ok=True)
        steps: dict[str, float] = collections.defaultdict(float)

        def save(i: int) -> None:
            final = os.path.join(dirpath, f"shard-{i:02d}.pt")
            t = write_file(final + ".tmp", self.shards[i], self.plan.bs, fsync=True)
            os.rename(final + ".tmp", final)
            t_renamed = time.perf_counter()
            steps["write"] += t["written"] - t["start"]
            steps["fsync"] += t["fsynced"] - t["written"]
            steps["close"] += t["closed"] - t["fsynced"]
            steps["rename"] += t_renamed - t["closed"]

        with ThreadPoolExecutor(self.plan.ckpt_threads) as ex:
            list(ex.map(save, range(self.plan.shards)))
        return steps

    def restore(self, m: TierfsMount, name: str) -> dict:
        """Page cache dropped, read every shard whole; sha256 of each checked afterwards."""
        dirpath = os.path.join(m.mnt, name)
        with Pass(m.pid) as ps:
            m0 = self.snapshot(m)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(self.plan.ckpt_threads) as ex:
                got = list(ex.map(lambda i: read_into(
                    os.path.join(dirpath, f"shard-{i:02d}.pt"), self.plan.shard_size,
                    self.plan.bs)[0], range(self.plan.shards)))
            dt = time.perf_counter() - t0
        m1 = self.snapshot(m)
        for i, data in enumerate(got):
            if sha(data) != self.shard_sha[i]:
                raise BenchError(f"{name}/shard-{i:02d}.pt: sha256 read back differs")
        req = req_delta(m0["req"], m1["req"])
        return {"mibs": self.plan.ckpt_total / MiB / dt, "req": req, "gets": req.get("get", 0),
                "src": req_delta(m0["src"], m1["src"]), "cpu": ps.cpu}

    def row_b_save(self, rep: int, m: TierfsMount, s3) -> None:  # noqa: ANN001
        p, s = self.plan, self.s
        tag = f" (repeat {rep + 1}/{self.repeat})" if self.repeat > 1 else ""
        total_mib = p.ckpt_total / MiB
        log(f"row b: boto3 multipart upload of the {p.shards} shards, {p.ckpt_threads} "
            f"at a time{tag}")
        drop_caches()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(p.ckpt_threads) as ex:
            list(ex.map(lambda i: s3_upload(s3, f"ceil/ckpt-{rep}/shard-{i:02d}.pt",
                                            self.shards[i]), range(p.shards)))
        s["ckpt_boto3"].append(total_mib / (time.perf_counter() - t0))
        for i in range(p.shards):
            self.check_s3(s3, f"ceil/ckpt-{rep}/shard-{i:02d}.pt", self.shard_sha[i],
                          p.shard_size)

        name = f"ckpt-{rep}"
        log(f"row b: checkpoint save through tierfs ({p.shards} x {p.shard_size // MiB} MiB, "
            f"tmp + fsync + rename, {p.ckpt_threads} at a time){tag}")
        with Pass(m.pid) as ps:
            m0 = self.snapshot(m)
            t0 = time.perf_counter()
            steps = self.save_shards(os.path.join(m.mnt, name))
            dt = time.perf_counter() - t0
        m1 = self.snapshot(m)
        s["save"].append(total_mib / dt)
        s["save_cpu"].append(ps.cpu / (p.ckpt_total / GiB))
        self.last["save"] = {"req": req_delta(m0["req"], m1["req"]), "steps": dict(steps),
                             "upload_s": m1["upload_s"] - m0["upload_s"]}
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=name + "/").get("Contents", [])
        keys = sorted(o["Key"] for o in listed)
        want = sorted(f"{name}/shard-{i:02d}.pt" for i in range(p.shards))
        if [k for k in keys if k != name + "/"] != want:
            raise BenchError(f"after the save, s3://{BUCKET}/{name}/ holds {keys}")
        for i in range(p.shards):
            self.check_s3(s3, f"{name}/shard-{i:02d}.pt", self.shard_sha[i], p.shard_size)
        # what the RGW can deliver to a cold restore: the bound of the cold figure
        dt = s3_get_all(s3, [f"{name}/shard-{i:02d}.pt" for i in range(p.shards)], p.shard_size)
        s["ckpt_boto3_get"].append(total_mib / dt)

        log(f"row b: local-first restore on the same mount (page cache dropped){tag}")
        r = self.restore(m, name)
        s["local_restore"].append(r["mibs"])
        s["local_gets"].append(r["gets"])
        self.last["local_restore"] = r
        # what the disk under the cache dir delivers: the bound of the local-first figure
        n, dt = cat_chunk_files(m.cache_dir)
        s["disk"].append(n / MiB / dt)
        m.unmount()

        log(f"row b: cold restore on a fresh mount, empty cache dir{tag}")
        c = self.mount(f"cold{rep}")
        r = self.restore(c, name)
        s["cold_restore"].append(r["mibs"])
        s["cold_gets"].append(r["gets"])
        self.last["cold_restore"] = r
        c.unmount()

    # ---- profile (not part of the table) -------------------------------------------

    def profile_pass(self) -> None:
        p = self.plan
        log(f"profile: py-spy of the daemon during one more {p.seq // MiB} MiB default-mode "
            f"write (not measured) into {Profiler.out_dir}")
        m = self.mount("profile")
        os.makedirs(os.path.join(m.mnt, "seq"), exist_ok=True)
        drop_caches()
        with Profiler(m.pid, "seq-write-default"):
            t = write_file(os.path.join(m.mnt, "seq/profile.bin"), self.seq_data, p.bs)
        log(f"profile: {p.seq / MiB / (t['closed'] - t['start']):.0f} MiB/s under py-spy "
            f"(write() {t['written'] - t['start']:.1f}s, close() "
            f"{t['closed'] - t['written']:.1f}s)")
        m.unmount()
        path = os.path.join(Profiler.out_dir or "", "seq-write-default.txt")
        if os.path.exists(path):
            text = summarise_profile(path)
            with open(os.path.join(Profiler.out_dir or "", "summary.txt"), "w") as f:
                f.write(text + "\n")
            log("profile summary:\n" + text)
        else:
            log(f"profile: no {path} (is py-spy installed in the venv?)")

    # ---- rows ----------------------------------------------------------------------

    def report(self) -> None:
        p, s = self.plan, self.s
        med = lambda k: statistics.median(s[k])  # noqa: E731

        def spread(*keys: str) -> str:
            if self.repeat == 1:
                return ""
            return "; " + ", ".join(f"{k} {min(s[k]):,.0f}-{max(s[k]):,.0f}" for k in keys) + \
                f" over {self.repeat} runs (medians shown)"

        size = f"{p.seq // MiB} MiB"
        d, wb = self.last["default"], self.last["wb"]
        self.add(Row("a", f"seq write {size}, 1 MiB writes, default mode (until close() "
                          "returns = in S3)", "MiB/s", med("default"),
                     f"boto3 multipart {PART // MiB} MiB x {CEIL_THREADS} threads",
                     med("boto3"), target=">=0.7x",
                     note=f"write() calls {med('default_write_s'):.1f} s, close() "
                          f"{med('default_close_s'):.1f} s (the upload: "
                          f"{d['upload_s']:.1f} s by tierfs_writeback_upload_seconds); backend "
                          f"requests {d['req']}; {d['fuse_writes']} FUSE writes of "
                          f"{d['write_kib']:.0f} KiB on average; daemon CPU "
                          f"{med('default_cpu'):.2f} s/GiB, boto3 (bench process) "
                          f"{med('boto3_cpu'):.2f} s/GiB" + spread("default", "boto3"),
                     extra={k: s[k] for k in ("default", "boto3", "default_write_s",
                                              "default_close_s", "default_cpu", "boto3_cpu")}))
        self.add(Row("a", "read-back of the written file (same mount, page cache dropped)",
                     "GETs", max(s["readback_gets"]), target="=0",
                     note=f"{med('readback'):,.0f} MiB/s; backend requests "
                          f"{self.last['readback_req'] or 0}; sha256 matched through the mount "
                          "and through boto3 GETs"))
        self.add(Row("a", f"seq write {size} --writeback, until close() returns", "MiB/s",
                     med("wb_close"), "local write + fsync, cache dir's fs", med("local"),
                     note=f"close() itself {med('wb_close_s'):.1f} s (fsync of the staging file "
                          "+ journal); the local ceiling is the same bytes written to a file "
                          "beside the cache dir and fsynced" + spread("wb_close", "local"),
                     extra={k: s[k] for k in ("wb_close", "local", "wb_close_s")}))
        self.add(Row("a", f"seq write {size} --writeback, until dirty bytes = 0", "MiB/s",
                     med("wb_clean"), f"boto3 multipart {PART // MiB} MiB x {CEIL_THREADS} "
                     "threads", med("boto3"),
                     note=f"upload drained {med('wb_drain_s'):.1f} s after close() returned "
                          f"(tierfs_writeback_dirty_bytes polled every {POLL_S * 1e3:.0f} ms); "
                          f"upload {wb['upload_s']:.1f} s; backend requests {wb['req']}; daemon "
                          f"CPU {med('wb_cpu'):.2f} s/GiB; read-back GETs "
                          f"{max(s['wb_readback_gets']):.0f}; sha256 matched"
                          + spread("wb_clean", "wb_drain_s"),
                     extra={k: s[k] for k in ("wb_clean", "wb_drain_s", "wb_cpu",
                                              "wb_readback_gets")}))

        sv, lr, cr = self.last["save"], self.last["local_restore"], self.last["cold_restore"]
        ck = f"{p.shards} x {p.shard_size // MiB} MiB"
        steps = ", ".join(f"{k} {v:.1f} s" for k, v in sv["steps"].items())
        self.add(Row("b", f"checkpoint save {ck} (tmp + fsync + rename each, "
                          f"{p.ckpt_threads} at a time)", "MiB/s", med("save"),
                     f"boto3 multipart per shard, {p.ckpt_threads} at a time", med("ckpt_boto3"),
                     note=f"time per step, summed over shards: {steps}; uploads "
                          f"{sv['upload_s']:.1f} s; backend requests {sv['req']}; daemon CPU "
                          f"{med('save_cpu'):.2f} s/GiB; sha256 of every shard matched through "
                          "boto3, no .tmp object left" + spread("save", "ckpt_boto3"),
                     extra={k: s[k] for k in ("save", "ckpt_boto3", "save_cpu")}))
        self.add(Row("b", "restore, local-first (same mount, page cache dropped)", "MiB/s",
                     med("local_restore"), "cold restore (fresh mount, empty cache dir)",
                     med("cold_restore"), target=">=3x",
                     note=f"served by source: local {lr['src']}, cold {cr['src']}; daemon CPU "
                          f"local {lr['cpu']:.2f} s, cold {cr['cpu']:.2f} s; sha256 of every "
                          "shard matched" + spread("local_restore", "cold_restore"),
                     extra={k: s[k] for k in ("local_restore", "cold_restore")}))
        self.add(Row("b", "(info) cat of the save mount's cache dir chunk files", "MiB/s",
                     med("disk"), note="page cache dropped, each file once: what the disk "
                     "under the disk tier gives, the bound of the local-first restore",
                     extra={"disk": s["disk"]}))
        self.add(Row("b", f"(info) boto3 GETs of the {p.shards} shards, 8 MiB ranges x 8 "
                          "threads", "MiB/s", med("ckpt_boto3_get"),
                     note="what this RGW gives a reader, the bound of the cold restore. Were "
                          "both restores at their bounds, the ratio would be disk / RGW = "
                          f"{med('disk') / med('ckpt_boto3_get'):.1f}x here: the 3x target "
                          "assumes a backend much slower than the local disk",
                     extra={"ckpt_boto3_get": s["ckpt_boto3_get"]}))
        self.add(Row("b", "local-first restore: backend GETs", "GETs", max(s["local_gets"]),
                     target="=0", note=f"all backend requests: {lr['req'] or 0}"))
        self.add(Row("b", "cold restore: backend GETs (expected > 0)", "GETs",
                     min(s["cold_gets"]), target=">0",
                     note=f"all backend requests: {cr['req'] or 0}"))

    def run(self, profile: bool) -> None:
        self.check_host()
        t0 = time.perf_counter()
        self.generate()
        log(f"generated {(self.plan.seq + self.plan.ckpt_total) / MiB:,.0f} MiB of test data in "
            f"{time.perf_counter() - t0:.1f}s")
        self.rgw.start()
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        s3.head_bucket(Bucket=BUCKET)  # connections warm
        for rep in range(self.repeat):
            self.row_a(rep, s3)
            # free what this repeat stored (the RGW's GC reclaims it a minute or so later)
            keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
                Bucket=BUCKET) for o in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in
                                                                     keys[i:i + 1000]]})
        self.report()
        if profile:
            self.profile_pass()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, help="sequential file size (default 512; --quick 128)")
    ap.add_argument("--shards", type=int, help="checkpoint shards (default 8; --quick 4)")
    ap.add_argument("--shard-mib", type=int, help="shard size (default 32; --quick 16)")
    ap.add_argument("--ckpt-threads", type=int, default=1, metavar="N",
                    help="shards saved and restored at once (default 1: one after the other)")
    ap.add_argument("--quick", action="store_true", help="smaller data; noisier figures")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run every pass N times (fresh mounts each) and show medians")
    ap.add_argument("--json", metavar="FILE",
                    help="append one JSON line per row to FILE (a bare name goes to bench/results/)")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemons from a snapshot of this commit instead of the working tree")
    ap.add_argument("--profile", metavar="DIR",
                    help="after the measured passes, py-spy the daemon during one more "
                         "default-mode write (raw collapsed stacks + summary.txt into DIR)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    ap.add_argument("--https", action="store_true",
                    help="the RGW serves TLS (a self-signed certificate): uploads go unsigned")
    args = ap.parse_args()
    run.stop_on_signals()
    run.Rgw.https = args.https
    if args.profile:
        Profiler.out_dir = os.path.abspath(args.profile)
    root = tempfile.mkdtemp(prefix="tierfs-wbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    ok = False
    bench: WriteBench | None = None
    try:
        plan = WritePlan.make(args)
        bench = WriteBench(plan, root, max(1, args.repeat))
        if args.ref:
            Source.export(args.ref, root)
        log(f"tierfs code: {Source.label}")
        log(f"work dir {root}; sequential file {plan.seq / MiB:.0f} MiB, checkpoint "
            f"{plan.shards} x {plan.shard_size / MiB:.0f} MiB, {bench.repeat} repeat(s); "
            f"load {load0[0]:.1f}")
        bench.run(profile=bool(args.profile))
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
    header = (f"tierfs write bench {started:%Y-%m-%d %H:%M}Z  tierfs code: {code}  file "
              f"{p.seq // MiB} MiB, checkpoint {p.shards}x{p.shard_size // MiB} MiB  "
              f"{'quick  ' if args.quick else ''}repeat {bench.repeat}  load {load0[0]:.1f} at "
              f"start, {load1[0]:.1f} at end  {time.perf_counter() - t0:.0f}s")
    if bench.rows:
        print_table(bench.rows, header)
    if args.json and bench.rows:
        meta = dict(info, ts=started.isoformat(), tierfs_code=code, bench="write",
                    size_mib=p.seq // MiB, shards=p.shards, shard_mib=p.shard_size // MiB,
                    ckpt_threads=p.ckpt_threads, quick=args.quick, repeat=bench.repeat,
                    complete=ok, nproc=os.cpu_count(), load=[load0[0], load1[0]])
        log(f"appended {len(bench.rows)} JSON lines to {write_json(args.json, bench.rows, meta)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
