"""Data and page-cache helpers for the real-mount tests."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor


def payload(seed: int | str, size: int) -> bytes:
    """Deterministic pseudo-random bytes (incompressible, distinct per seed)."""
    return random.Random(seed).randbytes(size)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_many(client, bucket: str, objects: dict[str, bytes], threads: int = 16) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]),
                      objects.items()))


def drop_page_cache(path: os.PathLike | str) -> None:
    """Evict one file's pages from the kernel page cache, so the next read reaches tierfs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_uncached(path: os.PathLike | str) -> bytes:
    drop_page_cache(path)
    with open(path, "rb") as f:
        return f.read()
