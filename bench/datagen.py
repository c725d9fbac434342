"""Deterministic, cheap test data shared by bench/run.py and bench/memfs.py.

A 16 MiB pseudo-random pattern (rotated per seed) repeated, with the first 16 bytes of
every 4 KiB page overwritten by (seed, offset): a read that returns the bytes of a wrong
offset or of another object never compares equal, and 1 GiB is built in about a second
(random.randbytes needs ~9 s/GiB here). Nothing in tierfs compresses or deduplicates, so
the repetition every 16 MiB does not flatter it.
"""

from __future__ import annotations

import hashlib
import struct

PAGE = 4096
_PATTERN = 16 << 20
_HEAD = struct.Struct("<QQ")


def make(size: int, seed: int) -> bytearray:
    """`size` bytes for object number `seed` (a bytearray: no second 1 GiB copy)."""
    pool = hashlib.shake_256(f"tierfs-bench-{seed}".encode()).digest(min(_PATTERN, max(size, 1)))
    buf = bytearray(size)
    step = len(pool)
    for off in range(0, size, step):
        n = min(step, size - off)
        buf[off:off + n] = pool[:n] if n != step else pool
    for off in range(0, size - _HEAD.size + 1, PAGE):
        _HEAD.pack_into(buf, off, seed, off)
    return buf
