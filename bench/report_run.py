#!/usr/bin/env python3
"""tierfs report of a loader-style run: `tierfs report --json/--html` and a PNG of the page.

    .venv/bin/python bench/report_run.py            # ~5.5 min: 6 epochs, waits for a 2nd capacity sample
    .venv/bin/python bench/report_run.py --quick    # ~1.5 min: 2 epochs, one capacity sample

One command, like bench/run.py (whose RGW, mount and helper code it imports): starts its own
throw-away Ceph RGW, uploads a small training set (~260 MiB), mounts tierfs with a cache
smaller than the data set, runs a PyTorch-DataLoader-like workload through the mount, then
writes `tierfs report --json`, the text report, `--html` and a full-page screenshot of the
page (headless Chromium) to bench/results/report-<date>.{json,txt,html,png}; a full run (not
--quick) also copies the PNG to docs/images/report-loader.png. Every byte read is compared with
what was uploaded (a mismatch aborts the run). Everything it started is stopped in
`finally` blocks, by PID. Needs root, /dev/fuse, fusermount3, the ceph packages and
chromium. See bench/README.md ("Report of a loader-style run").

The workload, per epoch: worker threads read the training records (512 KiB each, 16 per
8 MiB shard) in a new shuffled order every epoch, batches handed to the "trainer" in order
with a bounded prefetch (DataLoader's workers x prefetch_factor), the trainer spending
--step-ms per batch; the small label/metadata files re-read every few batches; the
validation shards read once, whole; a checkpoint written and the previous one read back;
an os.walk + stat of the tree. Before the first epoch a reference set is warmed and pinned
(`tierfs warm --pin`) and never read (cold cached data), and an archive is read once.
Reads drop their pages from the kernel's page cache (posix_fadvise DONTNEED), as a loader
over a data set larger than RAM would see, so every read reaches tierfs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import datagen  # noqa: E402
import run  # noqa: E402  (bench/run.py: the read benchmark and the shared helpers)
from peers_restore import PeersBench  # noqa: E402
from run import (BUCKET, GiB, KiB, MiB, BenchError, Source, TierfsMount, log,  # noqa: E402
                 mem_available)

CHROMIUM = "/usr/bin/chromium"
RESULTS = os.path.join(run.HERE, "results")
PNG = os.path.join(run.REPO, "docs", "images", "report-loader.png")
# tierfs/telemetry/capacity.py samples every 5 minutes (SAMPLE_INTERVAL_S) and keeps one sample per
# 5-minute slot; the mount has no option to sample faster, so a run that wants a second
# sample in the history waits for it (restated: the bench never imports tierfs)
CAPACITY_INTERVAL_S = 300.0


@dataclass(frozen=True)
class Plan:
    epochs: int = 6
    step_s: float = 0.8            # the trainer's time per batch
    workers: int = 4
    prefetch: int = 2              # batches in flight per worker (DataLoader's prefetch_factor)
    batch: int = 8                 # records per batch
    record: int = 512 * KiB
    train_shards: int = 24
    val_shards: int = 4
    shard: int = 8 * MiB
    meta_files: int = 200          # labels / metadata, 4-16 KiB each
    meta_every: int = 6            # batches between two re-reads of a few metadata files
    archive_files: int = 4
    archive: int = 4 * MiB
    ref_files: int = 2             # warmed and pinned, never read
    ckpt: int = 16 * MiB
    cache: int = 128 * MiB         # smaller than the training set: evictions every epoch
    memory: int = 32 * MiB
    wait_for_sample: bool = True   # hold the report until the sampler's second sample

    @property
    def records_per_shard(self) -> int:
        return self.shard // self.record


@dataclass
class Data:
    """What was uploaded (or written), by key: the bytes every read is compared with."""
    objects: dict[str, bytes] = field(default_factory=dict)

    def add(self, key: str, data: bytes) -> None:
        self.objects[key] = data

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.objects if k.startswith(prefix))


@dataclass
class Tally:
    """What the workload did, for the log and the README."""
    train_bytes: int = 0
    val_bytes: int = 0
    meta_reads: int = 0
    ckpt_written: int = 0
    ckpt_read: int = 0
    walk_entries: int = 0
    trainer_wait_s: list[float] = field(default_factory=list)  # per epoch


def pread_uncached(path: str, off: int, n: int) -> bytes:
    """n bytes at off, the pages dropped from the page cache first and after (the next
    read of them reaches tierfs again)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        out = os.pread(fd, n, off)
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        return out
    finally:
        os.close(fd)


def read_whole_uncached(path: str, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts = []
        while True:
            b = os.read(fd, MiB)
            if not b:
                break
            parts.append(b)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return b"".join(parts)


class LoaderRun:
    def __init__(self, plan: Plan, root: str, stamp: str) -> None:
        self.plan = plan
        self.root = root
        self.stamp = stamp
        self.rgw = run.Rgw(root, 2 * GiB)  # memstore: RAM; ~0.6 GiB stored at most
        self.mounts: list[TierfsMount] = []  # what run.finish() cleans up
        self.data = Data()
        self.tally = Tally()
        self.rng = random.Random(15)
        self.mounted_at = 0.0
        self.outputs: dict[str, str] = {}

    # ---- setup -----------------------------------------------------------------------

    def check_host(self) -> None:
        run.require_root_and_fuse()
        if not os.path.exists(CHROMIUM):
            raise BenchError(f"needs {CHROMIUM} (apt-get install chromium)")
        need = self.rgw.memstore_bytes + GiB
        if mem_available() < need:
            raise BenchError(f"needs {need / GiB:.1f} GiB of free RAM, "
                             f"{mem_available() / GiB:.1f} available")

    def make_data(self) -> None:
        p, seed = self.plan, 1500
        for i in range(p.train_shards):
            self.data.add(f"data/train/shard-{i:03d}.bin", bytes(datagen.make(p.shard, seed + i)))
        for i in range(p.val_shards):
            self.data.add(f"data/val/shard-{i:03d}.bin", bytes(datagen.make(p.shard, seed + 100 + i)))
        for i in range(p.archive_files):
            self.data.add(f"data/archive/part-{i:02d}.bin",
                          bytes(datagen.make(p.archive, seed + 200 + i)))
        for i in range(p.ref_files):
            self.data.add(f"ref/vocab/table-{i}.bin", bytes(datagen.make(p.shard, seed + 300 + i)))
        for i in range(p.meta_files):
            size = self.rng.choice((4, 8, 12, 16)) * KiB
            self.data.add(f"data/meta/labels-{i:04d}.json", bytes(datagen.make(size, seed + 400 + i)))

    def upload(self) -> None:
        s3 = self.rgw.client()
        s3.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as ex:
            for f in [ex.submit(s3.put_object, Bucket=BUCKET, Key=k, Body=v)
                      for k, v in self.data.objects.items()]:
                f.result()
        total = sum(map(len, self.data.objects.values()))
        log(f"uploaded {len(self.data.objects)} objects, {total / MiB:.0f} MiB in "
            f"{time.perf_counter() - t0:.1f}s")

    def tierfs(self, *args: str) -> str:
        r = subprocess.run([*run._tierfs_cmd(), *args], capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL, cwd=self.root,
                           env=Source.env(dict(os.environ)))
        if r.returncode != 0:
            raise BenchError(f"tierfs {args[0]}: {r.stderr.strip()[-1000:]}")
        return r.stdout

    # ---- the workload ----------------------------------------------------------------

    def check(self, key: str, off: int, got: bytes, n: int) -> None:
        if got != self.data.objects[key][off:off + n]:
            raise BenchError(f"wrong bytes read from {key} at {off} ({len(got)} bytes)")

    def read_record(self, mnt: str, item: tuple[str, int]) -> int:
        key, off = item
        got = pread_uncached(os.path.join(mnt, key), off, self.plan.record)
        self.check(key, off, got, self.plan.record)
        return len(got)

    def read_file(self, mnt: str, key: str) -> int:
        got = read_whole_uncached(os.path.join(mnt, key), len(self.data.objects[key]))
        self.check(key, 0, got, len(self.data.objects[key]))
        return len(got)

    def epoch(self, mnt: str, e: int, ex: ThreadPoolExecutor) -> None:
        p = self.plan
        items = [(k, r * p.record) for k in self.data.keys("data/train/")
                 for r in range(p.records_per_shard)]
        self.rng.shuffle(items)  # the sampler: a new order every epoch
        batches = [items[i:i + p.batch] for i in range(0, len(items), p.batch)]
        meta = self.data.keys("data/meta/")

        def load(batch: list[tuple[str, int]]) -> int:  # one worker's batch
            return sum(self.read_record(mnt, it) for it in batch)

        t0, waited = time.perf_counter(), 0.0
        pending: list[Future] = []
        nxt = 0
        for b in range(len(batches)):
            while nxt < len(batches) and len(pending) < p.workers * p.prefetch:
                pending.append(ex.submit(load, batches[nxt]))
                nxt += 1
            t = time.perf_counter()
            self.tally.train_bytes += pending.pop(0).result()  # in order, as DataLoader
            waited += time.perf_counter() - t
            if b % p.meta_every == 0:  # labels and metadata of the batch
                for key in self.rng.sample(meta, 10):
                    self.read_file(mnt, key)
                    self.tally.meta_reads += 1
            time.sleep(p.step_s)  # the training step
        self.tally.trainer_wait_s.append(waited)
        for key in self.data.keys("data/val/"):  # validation: once per epoch, whole
            self.tally.val_bytes += self.read_file(mnt, key)
        for key in meta:  # the epoch's label pass
            self.read_file(mnt, key)
            self.tally.meta_reads += 1
        self.checkpoint(mnt, e)
        self.walk(mnt)
        log(f"epoch {e}: {len(batches)} batches in {time.perf_counter() - t0:.0f}s, the "
            f"trainer waited {waited:.1f}s on the loader")

    def checkpoint(self, mnt: str, e: int) -> None:
        """Save this epoch's checkpoint, then read the previous one back (a restore test)."""
        key = f"ckpt/run1/epoch-{e:02d}.pt"
        data = bytes(datagen.make(self.plan.ckpt, 1900 + e))
        path = os.path.join(mnt, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            for off in range(0, len(data), MiB):
                f.write(data[off:off + MiB])
        self.data.add(key, data)
        self.tally.ckpt_written += len(data)
        if e > 0:
            self.tally.ckpt_read += self.read_file(mnt, f"ckpt/run1/epoch-{e - 1:02d}.pt")

    def walk(self, mnt: str) -> None:
        n = 0
        for top, dirs, files in os.walk(mnt):
            for name in dirs + files:
                os.stat(os.path.join(top, name))
                n += 1
        self.tally.walk_entries += n

    # ---- the report ------------------------------------------------------------------

    def report(self, m: TierfsMount) -> None:
        os.makedirs(RESULTS, exist_ok=True)
        base = os.path.join(RESULTS, f"report-{self.stamp}")
        common = ("--top", "8", "--cold-after", "2m")
        with open(base + ".json", "w") as f:
            f.write(self.tierfs("report", m.mnt, "--json", *common))
        self.tierfs("report", m.mnt, "--html", base + ".html", *common)
        with open(base + ".txt", "w") as f:
            f.write(self.tierfs("report", m.mnt, *common))
        self.outputs = {"json": base + ".json", "html": base + ".html", "text": base + ".txt"}

    def screenshot(self) -> None:
        html = self.outputs["html"]
        dom = chromium("--dump-dom", "file://" + html)
        check = "plots decoded: 4, failed: 0, errors: 0"
        if check not in dom:
            raise BenchError(f"the page's self-check did not say {check!r}")
        shot = os.path.join(self.root, "page.png")
        chromium(f"--screenshot={shot}", "--window-size=1200,3000", "file://" + html)
        self.outputs["png"] = crop(shot, html[:-len(".html")] + ".png")
        if self.plan.wait_for_sample:  # a full run refreshes the page shown in the docs
            shutil.copyfile(self.outputs["png"], PNG)
            self.outputs["docs png"] = PNG
        log(f"page self-check: {check}")

    # ---- the run ---------------------------------------------------------------------

    def run(self) -> None:
        self.check_host()
        self.make_data()
        self.rgw.start()
        self.upload()
        m = TierfsMount(self.rgw, self.root, "loader", cache_size=self.plan.cache,
                        memory_cache_size=self.plan.memory)
        self.mounts.append(m)
        m.mount()
        self.mounted_at = time.monotonic()
        self.tierfs("warm", "--pin", os.path.join(m.mnt, "ref"))
        for key in self.data.keys("data/archive/"):  # a one-off statistics pass
            self.read_file(m.mnt, key)
        with ThreadPoolExecutor(self.plan.workers) as ex:
            for e in range(self.plan.epochs):
                self.epoch(m.mnt, e, ex)
        if self.plan.wait_for_sample:
            left = CAPACITY_INTERVAL_S + 5 - (time.monotonic() - self.mounted_at)
            if left > 0:
                log(f"waiting {left:.0f}s for the capacity sampler's second sample "
                    f"(every {CAPACITY_INTERVAL_S:.0f}s; tierfs has no option to sample faster)")
                time.sleep(left)
        self.report(m)
        t = self.tally
        log(f"read: train {t.train_bytes / MiB:.0f} MiB, val {t.val_bytes / MiB:.0f} MiB, "
            f"{t.meta_reads} metadata files, checkpoints {t.ckpt_written / MiB:.0f} MiB "
            f"written / {t.ckpt_read / MiB:.0f} MiB read back, {t.walk_entries} entries "
            f"stat'ed; trainer waits per epoch {[round(w, 1) for w in t.trainer_wait_s]} s")
        m.unmount()
        self.screenshot()

    cleanup = PeersBench.cleanup  # the same: every mount, then the RGW (run.finish calls it)


def chromium(*args: str) -> str:
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--hide-scrollbars", "--virtual-time-budget=5000", *args],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise BenchError(f"chromium: {r.stderr.strip()[-1000:]}")
    return r.stdout


def crop(shot: str, dest: str) -> str:
    """The screenshot without the blank bottom of the window, as a palette PNG (the page is
    a few flat colours and text: a fraction of the RGB file's size)."""
    from PIL import Image, ImageChops

    with Image.open(shot) as im:
        rgb = im.convert("RGB")
    bg = Image.new("RGB", rgb.size, (255, 255, 255))
    box = ImageChops.difference(rgb, bg).getbbox()
    if box is None:
        raise BenchError("the screenshot is blank")
    out = rgb.crop((0, 0, rgb.width, min(rgb.height, box[3] + 20)))
    out = out.quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    out.save(dest, optimize=True)
    return dest


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        sys.stderr.write(f"report_run.py: error: {message} (see --help)\n")
        sys.exit(2)


def main() -> int:
    ap = _Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 epochs, no wait for the capacity sampler's second sample")
    ap.add_argument("--epochs", type=int, help="epochs (default 6; --quick 2)")
    ap.add_argument("--step-ms", type=int, default=800,
                    help="the trainer's time per batch (default 800)")
    ap.add_argument("--ref", metavar="GIT_REF",
                    help="run the daemon from a snapshot of this commit instead of the working tree")
    ap.add_argument("--keep", action="store_true", help="keep the work dir after the run")
    args = ap.parse_args()
    epochs = args.epochs if args.epochs is not None else (2 if args.quick else 6)
    if not 1 <= epochs <= 50:
        ap.error("--epochs must be 1 - 50")
    if not 0 <= args.step_ms <= 10_000:
        ap.error("--step-ms must be 0 - 10000")
    run.stop_on_signals()
    plan = Plan(epochs=epochs, step_s=args.step_ms / 1000, wait_for_sample=not args.quick)
    root = tempfile.mkdtemp(prefix="tierfs-rbench.", dir="/tmp")
    started = datetime.datetime.now(datetime.timezone.utc)
    bench = LoaderRun(plan, root, started.strftime("%Y%m%dT%H%MZ"))
    t0 = time.perf_counter()
    ok = run.drive(bench, root, args.ref, args.keep, f"work dir {root}")
    if ok:
        rep = json.load(open(bench.outputs["json"]))
        summary = {"hit_ratio": rep.get("hit_ratio"), "read": rep.get("read"),
                   "stalls": {k: rep["stalls"].get(k) for k in ("total", "by_source")},
                   "evictions": rep["eviction"]["evictions"],
                   "hot": [h["prefix"] for h in rep["hot"]]}
        log(f"summary: {json.dumps(summary)}")
        for kind, path in bench.outputs.items():
            log(f"{kind}: {path}")
        log(f"done in {time.perf_counter() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
