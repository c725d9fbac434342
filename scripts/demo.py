#!/usr/bin/env python3
"""tierfs demo: a bucket on a throw-away local Ceph RGW, mounted through tierfs, read three times.

  1. starts a real Ceph RGW on 127.0.0.1 (scripts/ceph-rgw/start.sh, about 1 s)
  2. uploads a sample dataset to bucket "tierfs-demo": 4 shards of 32 MiB, 500 small
     "images" of 4-64 KiB and a 16 MiB checkpoint (deterministic pseudo-random bytes)
  3. `tierfs mount`s it and reads every file: cold, warm (after dropping the page cache) and
     after an unmount + mount with the same cache directory; then, on a fresh cache dir,
     `tierfs warm --job demo` (what a Slurm prolog runs) followed by the "job" reading it all;
     each file's sha256 must match what was uploaded
  4. prints, per pass, the throughput and where the bytes came from (tierfs's /metrics)
  5. cleans up everything it started, also on failure or Ctrl-C (unless --keep)

Run it with scripts/quickstart.sh (installs what is missing first) or .venv/bin/python.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_SH = ROOT / "scripts" / "ceph-rgw" / "start.sh"
STOP_SH = ROOT / "scripts" / "ceph-rgw" / "stop.sh"
BUCKET = "tierfs-demo"
MiB = 1 << 20
PART = 8 * MiB            # multipart part size and generation chunk
SMALL_FILES = 500

# Watchdog (not with --keep): its stdin is a pipe whose only writer is this process. When this
# process dies in any way, even SIGKILL, read gets EOF and the watchdog undoes what the demo
# started. A normal exit kills the watchdog first and cleans up itself.
_WATCHDOG = r"""
read -r _ || true
fusermount3 -u -z "$3" >/dev/null 2>&1 || true
[ -f "$2/pids" ] && bash "$4" "$2" >/dev/null 2>&1
rm -rf "$1"
"""


class DemoError(Exception):
    pass


def say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"demo: warning: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_mounted(path: str) -> bool:
    """From /proc/self/mountinfo: never stat()s into a possibly hung FUSE mount."""
    path = os.path.abspath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4].replace("\\040", " ") == path for line in f)
    except OSError:
        return os.path.ismount(path)


def run_parallel(fn, items, jobs: int) -> list:
    """[fn(item) for item in items] on `jobs` threads; on the first exception (or Ctrl-C)
    the items not started yet are dropped instead of run to completion."""
    pool = ThreadPoolExecutor(jobs)
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------ dataset
def dataset(size_mib: int) -> list[tuple[str, int]]:
    """[(key, size)], deterministic."""
    objs = [(f"datasets/sample/shard-{i:04d}.bin", size_mib * MiB) for i in range(4)]
    sizes = random.Random("tierfs-demo:sizes")
    objs += [(f"datasets/sample/small/img-{i:05d}.jpg", sizes.randint(4 * 1024, 64 * 1024))
             for i in range(SMALL_FILES)]
    objs.append(("checkpoints/run1/model.pt", 16 * MiB))
    return objs


def content(key: str, size: int):
    """The object's bytes, in chunks of at most PART, from a PRNG seeded by the key."""
    rng = random.Random(f"tierfs-demo:{key}")
    left = size
    while left > 0:
        n = min(PART, left)
        yield rng.randbytes(n)
        left -= n


def upload(client, key: str, size: int) -> str:
    """Upload one object (multipart above PART bytes); returns its sha256 hex."""
    h = hashlib.sha256()
    if size <= PART:
        body = b"".join(content(key, size))
        h.update(body)
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
        return h.hexdigest()
    up = client.create_multipart_upload(Bucket=BUCKET, Key=key)
    try:
        parts = []
        for n, chunk in enumerate(content(key, size), start=1):
            h.update(chunk)
            r = client.upload_part(Bucket=BUCKET, Key=key, UploadId=up["UploadId"],
                                   PartNumber=n, Body=chunk)
            parts.append({"PartNumber": n, "ETag": r["ETag"]})
        client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up["UploadId"],
                                         MultipartUpload={"Parts": parts})
    except BaseException:
        client.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=up["UploadId"])
        raise
    return h.hexdigest()


# ------------------------------------------------------------------------------ metrics
def scrape(port: int):
    """(samples, families) or None if /metrics does not answer. samples maps
    (sample_name, frozenset(labels)) -> value; families is the set of family names.
    prometheus_client's parser drops _total from FAMILY names; SAMPLE names keep it."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError as e:
        warn(f"cannot scrape http://127.0.0.1:{port}/metrics: {e}")
        return None
    samples, families = {}, set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, families


def total(metrics, name: str, **labels) -> float | None:
    """Sum of the samples NAME or NAME_total with these labels (0 for a label value not seen
    yet); None if not scraped or the daemon does not export NAME at all."""
    if metrics is None:
        return None
    samples, families = metrics
    base = name[:-len("_total")] if name.endswith("_total") else name
    names = (base, base + "_total")
    if base not in families and not any(n in names for n, _ in samples):
        return None
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n in names and want <= lbl)


def delta(before, after, name: str, **labels) -> float | None:
    a = total(after, name, **labels)
    if a is None:
        return None
    return a - (total(before, name, **labels) or 0.0)


# ------------------------------------------------------------------------------ the demo
class Demo:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = tempfile.mkdtemp(prefix="tierfs-demo.")
        self.rgw_dir = os.path.join(self.work, "rgw")
        self.mnt = os.path.join(self.work, "mnt")
        self.cache = os.path.join(self.work, "cache")
        self.rgw: dict[str, str] = {}
        self.port = 0
        self.watchdog: subprocess.Popen | None = None
        self.expected: dict[str, tuple[int, str]] = {}
        self.rows: list[tuple] = []
        self.tierfs = self._tierfs_cmd()

    @staticmethod
    def _tierfs_cmd() -> list[str]:
        venv = ROOT / ".venv" / "bin" / "tierfs"
        if venv.exists():
            return [str(venv)]
        found = shutil.which("tierfs")
        return [found] if found else [sys.executable, "-m", "tierfs"]

    # -------------------------------------------------------------- RGW + data
    def start_rgw(self, data_bytes: int) -> None:
        memstore = max(2 << 30, 3 * data_bytes + (512 << 20))  # RAM ~2x stored bytes
        say(f"starting a throw-away Ceph RGW in {self.rgw_dir} "
            f"(memstore {memstore / (1 << 30):.1f} GiB)")
        t0 = time.monotonic()
        env = dict(os.environ, MEMSTORE_BYTES=str(memstore))
        # own session: survives the terminal with --keep; a Ctrl-C reaches only this
        # process, whose finally stops the cluster
        proc = subprocess.Popen(["bash", str(START_SH), self.rgw_dir], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        if not self.args.keep:
            self.watchdog = subprocess.Popen(
                ["bash", "-c", _WATCHDOG, "demo-watchdog", self.work, self.rgw_dir, self.mnt,
                 str(STOP_SH)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=180)
        except BaseException:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # its EXIT trap kills what it started
                try:
                    proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.communicate()
            raise
        if proc.returncode != 0:
            tail = "\n".join("    " + ln for ln in err.strip().splitlines()[-10:])
            raise DemoError(f"scripts/ceph-rgw/start.sh failed (rc={proc.returncode}):\n{tail}")
        with open(os.path.join(self.rgw_dir, "env")) as f:
            for line in f:
                k, _, v = line.strip().removeprefix("export ").partition("=")
                self.rgw[k] = v
        say(f"Ceph RGW ready at {self.rgw['S3_ENDPOINT']} ({time.monotonic() - t0:.1f} s)")

    def s3_client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.rgw["S3_ENDPOINT"], region_name=self.rgw["S3_REGION"],
            aws_access_key_id=self.rgw["S3_ACCESS_KEY"],
            aws_secret_access_key=self.rgw["S3_SECRET_KEY"],
            config=Config(s3={"addressing_style": "path"},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required",
                          max_pool_connections=16))

    def upload_dataset(self, objs: list[tuple[str, int]]) -> None:
        nbytes = sum(s for _, s in objs)
        say(f"uploading {len(objs)} objects ({nbytes / MiB:.1f} MiB) to s3://{BUCKET}")
        t0 = time.monotonic()
        client = self.s3_client()
        try:
            client.create_bucket(Bucket=BUCKET)
            big_first = sorted(objs, key=lambda o: -o[1])
            digests = run_parallel(lambda o: upload(client, o[0], o[1]), big_first, 8)
            for (key, size), digest in zip(big_first, digests):
                self.expected[key] = (size, digest)
        finally:
            client.close()
        dt = time.monotonic() - t0
        say(f"uploaded in {dt:.1f} s ({nbytes / MiB / dt:.0f} MiB/s)")

    # -------------------------------------------------------------- tierfs
    def child_env(self) -> dict[str, str]:
        """Credentials for tierfs via the standard AWS variables only (never argv); the
        caller's other AWS_* settings and ~/.aws are kept out."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.rgw["S3_ACCESS_KEY"],
                   AWS_SECRET_ACCESS_KEY=self.rgw["S3_SECRET_KEY"],
                   AWS_DEFAULT_REGION=self.rgw["S3_REGION"],
                   AWS_EC2_METADATA_DISABLED="true",
                   AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        return env

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(os.path.join(self.cache, "tierfs.log"), errors="replace") as f:
                lines = f.read().splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join("    " + ln for ln in lines)

    def mount(self) -> None:
        os.makedirs(self.mnt, exist_ok=True)
        self.port = free_port()
        cmd = [*self.tierfs, "mount", f"s3://{BUCKET}", self.mnt,
               "--endpoint-url", self.rgw["S3_ENDPOINT"], "--cache-dir", self.cache,
               "--cache-size", "1G", "--memory-cache-size", "128M",
               "--metrics-addr", f"127.0.0.1:{self.port}"]
        say("$ " + " ".join(["tierfs", *cmd[len(self.tierfs):]]))
        t0 = time.monotonic()
        r = subprocess.run(cmd, env=self.child_env(), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            msg = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            tail = self.log_tail()
            raise DemoError(f"tierfs mount failed (rc={r.returncode}): {msg}"
                            + (f"\n  {self.cache}/tierfs.log:\n{tail}" if tail else ""))
        if not is_mounted(self.mnt):
            raise DemoError(f"tierfs mount returned 0 but {self.mnt} is not mounted")
        say(f"mounted in {time.monotonic() - t0:.1f} s; metrics on "
            f"http://127.0.0.1:{self.port}/metrics")

    def unmount(self, timeout: float = 60) -> None:
        cmd = [*self.tierfs, "unmount", self.mnt, "--timeout", str(timeout)]
        say(f"$ tierfs unmount {self.mnt}")
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout + 30)
        if r.returncode != 0:
            msg = (r.stderr.strip() or "no output").splitlines()[-1]
            raise DemoError(f"tierfs unmount failed (rc={r.returncode}): {msg}")
        if is_mounted(self.mnt):
            raise DemoError(f"tierfs unmount returned 0 but {self.mnt} is still mounted")

    # -------------------------------------------------------------- reading
    def read_pass(self, name: str) -> None:
        before = scrape(self.port)
        t0 = time.monotonic()
        listed = set()
        for d, _, files in os.walk(self.mnt):
            rel = os.path.relpath(d, self.mnt)
            listed.update(f if rel == "." else f"{rel}/{f}" for f in files)
        if listed != set(self.expected):
            missing = sorted(set(self.expected) - listed)
            extra = sorted(listed - set(self.expected))
            raise DemoError(f"{name}: the mount lists {len(listed)} files, expected "
                            f"{len(self.expected)}; missing {missing[:5]}, unexpected {extra[:5]}")

        def read(key: str) -> tuple[str, int, str]:
            h = hashlib.sha256()
            buf = bytearray(MiB)
            view = memoryview(buf)
            n = 0
            try:
                with open(os.path.join(self.mnt, key), "rb", buffering=0) as f:
                    while k := f.readinto(buf):
                        h.update(view[:k])
                        n += k
            except OSError as e:
                raise DemoError(f"{name}: reading {key} after {n} bytes: {e}") from None
            size, want = self.expected[key]
            if n != size or h.hexdigest() != want:
                raise DemoError(f"{name}: {key}: read {n} bytes sha256 {h.hexdigest()[:16]}..., "
                                f"uploaded {size} bytes sha256 {want[:16]}...")
            return n

        keys = sorted(self.expected, key=lambda k: -self.expected[k][0])  # big ones first
        nbytes = sum(run_parallel(read, keys, self.args.jobs))
        dt = time.monotonic() - t0
        after = scrape(self.port)
        cache = [delta(before, after, "tierfs_read_bytes", source=s) for s in ("memory", "disk")]
        row = (name, len(keys), nbytes, dt,
               delta(before, after, "tierfs_read_bytes", source="backend"),
               None if None in cache else sum(cache),
               delta(before, after, "tierfs_backend_requests", op="get"),
               delta(before, after, "tierfs_backend_bytes"))
        self.rows.append(row)
        print(self._format_row(row), flush=True)

    # "from backend/cache": where tierfs_read_bytes_total says the bytes given to readers came
    # from (chunks fetched by read-ahead count as cache hits); "downloaded": all bytes that
    # tierfs fetched from the object store (tierfs_backend_bytes_total), read-ahead included
    HEADER = (f"{'pass':<14}{'files':>6}{'MiB read':>10}{'seconds':>9}{'MiB/s':>7}"
              f"{'MiB from backend':>18}{'MiB from cache':>16}{'backend GETs':>14}"
              f"{'MiB downloaded':>16}")

    @staticmethod
    def _format_row(row) -> str:
        name, files, nbytes, dt, backend, cache, gets, downloaded = row

        def mib(v):
            return "n/a" if v is None else f"{v / MiB:.1f}"

        return (f"{name:<14}{files:>6}{nbytes / MiB:>10.1f}{dt:>9.2f}"
                f"{nbytes / MiB / max(dt, 1e-9):>7.0f}{mib(backend):>18}{mib(cache):>16}"
                f"{'n/a' if gets is None else f'{gets:.0f}':>14}{mib(downloaded):>16}")

    def drop_page_cache(self) -> None:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            say("dropped the kernel page cache (echo 3 > /proc/sys/vm/drop_caches)")
        except OSError as e:
            warn(f"could not drop the page cache ({e.strerror}); the warm pass may be served "
                 "by the kernel page cache instead of tierfs")

    # -------------------------------------------------------------- run / clean up
    def run(self) -> None:
        for need in ("fusermount3", "bash", "curl"):
            if not shutil.which(need):
                raise DemoError(f"{need} not found: run scripts/install.sh (or quickstart.sh)")
        if not os.path.exists("/dev/fuse"):
            raise DemoError("/dev/fuse is missing: run scripts/install.sh as root")
        objs = dataset(self.args.size_mib)
        self.start_rgw(sum(s for _, s in objs))
        self.upload_dataset(objs)
        self.mount()
        print(self.HEADER, flush=True)
        self.read_pass("cold")
        self.drop_page_cache()
        self.read_pass("warm")
        self.unmount()
        self.mount()
        self.drop_page_cache()
        self.read_pass("after restart")
        self.warm_then_read()
        print()
        print(self.HEADER)
        for row in self.rows:
            print(self._format_row(row))
        print()
        say(f"all {len(self.expected)} files matched their sha256 in all {len(self.rows)} passes")
        cold, restart = self.rows[0], self.rows[2]
        if restart[7] is not None and cold[7]:
            say(f"after the restart tierfs downloaded {restart[7] / MiB:.1f} MiB from the "
                f"bucket (cold pass: {cold[7] / MiB:.1f} MiB); all else was served by the "
                f"persistent cache in {os.path.join(self.work, 'cache')}")
        job = self.rows[3]
        if job[6] is not None:
            say(f"the job that read after `tierfs warm` sent {job[6]:.0f} GETs to the bucket")

    def warm_then_read(self) -> None:
        """A job's life on a node with an empty cache: prolog warms and pins, job reads, epilog
        unpins."""
        self.unmount()
        self.cache = os.path.join(self.work, "cache-job")
        self.mount()
        for cmd in (["warm", self.mnt, "--job", "demo"], ["status", self.mnt]):
            say("$ tierfs " + " ".join(cmd))
            r = subprocess.run([*self.tierfs, *cmd], stdin=subprocess.DEVNULL, text=True,
                               capture_output=True, timeout=600)
            print(r.stdout.rstrip(), flush=True)
            if r.returncode != 0:
                raise DemoError(f"tierfs {cmd[0]} failed (rc={r.returncode}): "
                                f"{(r.stderr.strip() or 'no output').splitlines()[-1]}")
        self.drop_page_cache()
        print(self.HEADER, flush=True)
        self.read_pass("job, warmed")
        say("$ tierfs unpin --job demo")
        subprocess.run([*self.tierfs, "unpin", "--job", "demo"], stdin=subprocess.DEVNULL,
                       check=True, timeout=60)

    def print_keep_help(self) -> None:
        e = self.rgw
        print(f"""
demo: --keep: everything is still running.
  mount        {self.mnt}    (ls -R it, read it)
  metrics      curl -s http://127.0.0.1:{self.port}/metrics | grep ^tierfs_
  tierfs log   {self.cache}/tierfs.log
  S3 (RGW)     {e['S3_ENDPOINT']}  bucket {BUCKET}
               export AWS_ACCESS_KEY_ID={e['S3_ACCESS_KEY']} AWS_SECRET_ACCESS_KEY={e['S3_SECRET_KEY']} AWS_DEFAULT_REGION={e['S3_REGION']}
  stop it all:
    {' '.join(self.tierfs)} unmount {self.mnt}
    bash {STOP_SH} {self.rgw_dir}
    rm -rf {self.work}
""")

    def cleanup(self) -> None:
        if self.watchdog is not None:  # first, so it cannot race the steps below
            self.watchdog.kill()
            self.watchdog.wait()
            self.watchdog.stdin.close()
            self.watchdog = None
        if is_mounted(self.mnt):
            try:
                self.unmount(timeout=30)
            except (DemoError, subprocess.SubprocessError, OSError) as e:
                warn(f"{e}; detaching the mount with fusermount3 -u -z")
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True)
        if os.path.exists(os.path.join(self.rgw_dir, "pids")):
            r = subprocess.run(["bash", str(STOP_SH), self.rgw_dir], stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                warn(f"scripts/ceph-rgw/stop.sh failed: {r.stderr.strip()}")
        if is_mounted(self.mnt):
            warn(f"{self.mnt} is still mounted; not removing {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", action="store_true",
                   help="leave the mount and the Ceph RGW running, print how to use and stop them")
    p.add_argument("--size-mib", type=int, default=32, metavar="N",
                   help="size of each of the 4 big shards in MiB (default 32)")
    p.add_argument("--jobs", type=int, default=4, metavar="N",
                   help="files read in parallel (default 4)")
    args = p.parse_args()
    if args.size_mib < 1 or args.jobs < 1:
        p.error("--size-mib and --jobs must be >= 1")

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)

    demo = Demo(args)
    ok = False
    try:
        demo.run()
        ok = True
    except DemoError as e:
        print(f"demo: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("demo: interrupted, cleaning up", file=sys.stderr)
        return 130
    finally:
        if ok and args.keep:
            demo.print_keep_help()
        else:
            # a second Ctrl-C must not abort the cleanup half-way
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            demo.cleanup()
            if ok:
                say("cleaned up: unmounted, Ceph RGW stopped, temporary files removed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
