#!/usr/bin/env python3
"""The daemon's own cost per small read, in-process: no FUSE, no kernel round trip.

    .venv/bin/python bench/readpath.py [--reads N] [--size-mib M] [--ref GIT_REF]

Builds the core as the daemon does (tierfs.mount.core.build_core, through the unit tests'
`unitkit.core`) over a FileBackend in a temporary folder, caches one file of M MiB
(default 64) in the disk tier, and times N (default 20,000) random 4 KiB `FileIO.read`
calls of one open handle in three states of the caches:

- memory: every block in the memory tier (a tier bigger than the file);
- page cache: no memory tier, the chunk files in the kernel's page cache (read whole
  before the pass: the disk tier writes them with O_DIRECT);
- disk: no memory tier, the chunk files' pages dropped (posix_fadvise DONTNEED) before
  the pass, so a read goes to the device (unless the read before brought its pages in).

It prints microseconds of wall time and of this process's CPU per read: the Python the
daemon runs for a read before pyfuse3 replies. The same-run ceiling is a bare `os.pread`
of 4 KiB from the chunk files (the page cache state as in the pass). Every byte read is
compared with the file's. A figure moves 10-20% between runs on a shared machine: compare
runs side by side (`--ref` runs the same passes on a snapshot of another commit).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 8 * MiB
BLOCK = 64 * KiB


def passes(size: int, reads: int) -> list[tuple[str, float, float, float]]:
    """(pass, wall us per read, CPU us per read, bare pread us per read) of each pass."""
    import trio

    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    from unitkit import core, resolve  # noqa: E402

    data = os.urandom(size)
    rnd = random.Random(2)
    offsets = [rnd.randrange(0, size // 4096) * 4096 for _ in range(reads)]
    out = []

    async def one(name: str, memory: int, drop: bool) -> None:
        with tempfile.TemporaryDirectory(prefix="tierfs-readpath.") as tmp:
            async with core(tmp, chunk_size=CHUNK, block_size=BLOCK, memory_bytes=memory,
                            cache_size=4 * size, readahead=1) as c:
                with open(os.path.join(c.src, "f.bin"), "wb") as f:
                    f.write(data)
                node = await resolve(c.ns, "f.bin")
                h, _ = await c.io.open(node.ino)
                for off in range(0, size, CHUNK):  # cache it whole (memory and disk)
                    await c.io.read(h.fh, off, CHUNK)
                await trio.sleep(0.5)  # the disk fills land
                chunks = os.path.join(c.cache_rig.root, "chunks")
                files = [os.path.join(d, f) for d, _, fs in os.walk(chunks) for f in fs]

                def dropped() -> None:
                    for p in files:
                        fd = os.open(p, os.O_RDONLY)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        os.close(fd)

                def paged() -> None:  # chunk files are written with O_DIRECT: read them
                    for p in files:
                        with open(p, "rb") as f:
                            while f.read(1 << 20):
                                pass

                settle = dropped if drop else paged
                settle()
                c0, t0 = time.process_time(), time.perf_counter()
                for off in offsets:
                    got = await c.io.read(h.fh, off, 4096)
                    if bytes(got) != data[off:off + 4096]:
                        raise SystemExit(f"wrong bytes at {off} ({name})")
                wall = time.perf_counter() - t0
                cpu = time.process_time() - c0
                await c.io.release(h.fh)
                # the ceiling: a bare pread of the same offsets from the chunk files
                fds = {}
                by_index = sorted(files)  # which chunk file holds an offset does not matter
                settle()
                b0 = time.perf_counter()
                for off in offsets:
                    p = by_index[(off // CHUNK) % len(by_index)]
                    fd = fds.get(p) or fds.setdefault(p, os.open(p, os.O_RDONLY))
                    os.pread(fd, 4096, off % CHUNK)
                bare = time.perf_counter() - b0
                for fd in fds.values():
                    os.close(fd)
        out.append((name, wall / reads * 1e6, cpu / reads * 1e6, bare / reads * 1e6))

    async def main() -> None:
        await one("memory", 2 * size, False)
        await one("page cache", 0, False)
        await one("disk", 0, True)

    trio.run(main)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=20_000)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--ref", metavar="GIT_REF", help="also run a snapshot of this commit")
    args = ap.parse_args()
    trees = [("working tree", ROOT)]
    tmp = None
    if args.ref:
        tmp = tempfile.mkdtemp(prefix="tierfs-readpath-ref.")
        subprocess.run(f"git -C {ROOT} archive {args.ref} | tar -x -C {tmp}", shell=True,
                       check=True)
        trees.insert(0, (args.ref, tmp))
    try:
        print(f"{args.reads} random 4 KiB reads of a {args.size_mib} MiB file, one handle "
              f"(us per read)")
        print(f"{'tree':<14} {'pass':<11} {'wall':>7} {'cpu':>7} {'bare pread':>11}")
        for label, tree in trees:
            code = (f"import sys; sys.path.insert(0, {tree!r}); sys.path.insert(0, {HERE!r});"
                    f"import readpath; readpath.ROOT = {tree!r};"
                    f"print(repr(readpath.passes({args.size_mib * MiB}, {args.reads})))")
            env = dict(os.environ, PYTHONPATH=tree)
            res = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                 capture_output=True, text=True, cwd=tree)
            for name, wall, cpu, bare in eval(res.stdout.strip().splitlines()[-1]):
                print(f"{label:<14} {name:<11} {wall:7.1f} {cpu:7.1f} {bare:11.1f}")
    finally:
        if tmp:
            subprocess.run(["rm", "-rf", tmp], check=False)


if __name__ == "__main__":
    main()
