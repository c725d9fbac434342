#!/usr/bin/env python3
"""Unmount time of a --writeback mount after a metadata-heavy workload (issue 26, U3).

    .venv/bin/python bench/unmount.py [--dirs N]

Starts its own throw-away Ceph RGW (bench/run.py's helpers), mounts tierfs with
--writeback, runs a pjdfstest-like mix in N directories of 25 files (create and write,
chmod, chown, utime, truncate, symlink, mkfifo, rename, link - refused: EPERM - and
unlink, a quarter of the directories emptied and removed), waits until nothing is pending,
and prints how long `tierfs unmount` took and the daemon's unmount log lines (what it
waited for). U3 reported 28.6 s with nothing pending after pjdfstest itself, which is not
packaged for Debian.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import BUCKET, Rgw, TierfsMount, log  # noqa: E402  (bench/run.py's helpers)


def workload(mnt: str, dirs: int, rnd: random.Random) -> tuple[int, int]:
    ops = errors = 0
    for d in range(dirs):
        dp = os.path.join(mnt, f"d{d}")
        os.mkdir(dp)
        for i in range(25):
            p = os.path.join(dp, f"f{i}")
            steps = [
                (lambda p=p: open(p, "wb").write(os.urandom(rnd.randint(0, 20000))), ()),
                (os.chmod, (p, 0o640)), (os.chown, (p, 1000 + i, 1000)), (os.utime, (p, (1, 2))),
                (os.truncate, (p, rnd.randint(0, 5000))), (os.symlink, (p, p + ".ln")),
                (os.mkfifo, (p + ".fifo",)), (os.rename, (p, p + ".r")),
                (os.link, (p + ".r", p + ".hard"))]
            if i % 3 == 0:
                steps += [(os.unlink, (p + ".r",)), (os.unlink, (p + ".ln",)),
                          (os.unlink, (p + ".fifo",))]
            for fn, args in steps:
                ops += 1
                try:
                    fn(*args)
                except OSError:
                    errors += 1
        if d % 4 == 0:
            for n in os.listdir(dp):
                os.unlink(os.path.join(dp, n))
            os.rmdir(dp)
    return ops, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dirs", type=int, default=40, help="directories of 25 files (default 40)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="tierfs-unmount.", dir="/tmp")
    rgw = Rgw(root, 1 << 30)
    m = None
    try:
        rgw.start()
        rgw.client().create_bucket(Bucket=BUCKET)
        m = TierfsMount(rgw, root, "a", cache_size="1G", memory_cache_size=64 << 20,
                        extra_args=("--writeback",))
        m.mount()
        t0 = time.perf_counter()
        ops, errors = workload(m.mnt, args.dirs, random.Random(3))
        log(f"workload: {ops} operations ({errors} refused) in {time.perf_counter() - t0:.1f}s")
        while "0 uploads pending" not in subprocess.run(
                [sys.executable, "-m", "tierfs", "status", m.mnt], capture_output=True,
                text=True, cwd=root).stdout:
            time.sleep(0.5)
        t0 = time.perf_counter()
        m.unmount()
        took = time.perf_counter() - t0
        lines = [ln for ln in m.log_tail(200).splitlines() if "unmount" in ln or "stopped" in ln]
        print(f"unmount of a --writeback mount after {ops} operations, nothing pending: "
              f"{took:.1f}s")
        print("\n".join(lines[-4:]))
        return 0
    finally:
        if m is not None:
            m.unmount()
        rgw.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
