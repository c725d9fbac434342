"""The disk tier: chunk files on node-local NVMe, verified by per-block CRC32.

Layout under the cache dir: chunks/<2 hex>/<object id>.<index> and tmp/. A chunk is
written to tmp/ and renamed into place, so a visible file is never half-written by us; it
is not fsynced, because every read verifies the blocks it returns against the index and a
torn or bit-rotted file is simply dropped and fetched again. All methods block: callers
run them in worker threads.
"""

from __future__ import annotations

import mmap
import os
import queue
import zlib
from typing import Callable

from ..errors import CacheCorrupt
from .keys import chunk_name

_ALIGN = 4096
_DIRECT_MIN = 1 << 20  # small chunks: buffered writes are cheaper than the copy
_POOLED = 4  # aligned buffers kept for reuse (the Fetcher runs 4 disk writes at once)


class DiskTier:
    def __init__(self, root: str, block_size: int) -> None:
        self.root = root
        self.block_size = block_size
        self.chunk_dir = os.path.join(root, "chunks")
        self.tmp_dir = os.path.join(root, "tmp")
        os.makedirs(self.chunk_dir, exist_ok=True)
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._direct_ok = hasattr(os, "O_DIRECT")
        self._buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()

    def path(self, ckey: bytes) -> str:
        name = chunk_name(ckey)
        return os.path.join(self.chunk_dir, name[:2], name)

    def checksums(self, data: bytes | memoryview) -> tuple[int, ...]:
        bs = self.block_size
        view = memoryview(data)
        return tuple(zlib.crc32(view[i:i + bs]) for i in range(0, max(len(data), 1), bs))

    def write(self, ckey: bytes, data: bytes) -> tuple[int, ...]:
        def copy(view: memoryview) -> None:
            view[:] = data

        return self.write_via(ckey, len(data), copy)

    def write_via(self, ckey: bytes, length: int,
                  fill: Callable[[memoryview], None]) -> tuple[int, ...]:
        """Write a chunk whose bytes `fill` puts into the buffer it is given (a GET can read
        its body straight into it: no chunk-sized allocation, no copy). Returns the CRCs."""
        path = self.path(ckey)
        tmp = os.path.join(self.tmp_dir, os.path.basename(path))
        padded = -(-length // _ALIGN) * _ALIGN
        direct = self._direct_ok and length >= _DIRECT_MIN
        buf = self._buffer(padded) if direct else bytearray(length)
        view = memoryview(buf)
        try:
            fill(view[:length])
            if not (direct and self._write_direct(tmp, view, length, padded)):
                with open(tmp, "wb") as f:
                    f.write(view[:length])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
            return self.checksums(view[:length])
        finally:
            view.release()
            # a few buffers serve every writer thread: as many as write at once, not one
            # per worker thread (trio keeps dozens of threads)
            if direct and self._buffers.qsize() < _POOLED:
                self._buffers.put(buf)  # type: ignore[arg-type]

    def _buffer(self, size: int) -> mmap.mmap:
        try:
            buf = self._buffers.get_nowait()
        except queue.Empty:
            buf = None
        if buf is None or len(buf) < size:
            buf = mmap.mmap(-1, size)  # page-aligned by construction
        return buf

    def _write_direct(self, tmp: str, view: memoryview, length: int, padded: int) -> bool:
        """O_DIRECT from the aligned buffer: cold reads fill the cache at network speed, and
        buffered writes cost the reader 2-3x more kernel CPU (bench/README.md). False
        where the filesystem refuses O_DIRECT (tmpfs): the caller writes buffered."""
        view[length:padded] = bytes(padded - length)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            self._direct_ok = False
            return False
        try:
            os.write(fd, view[:padded])
            os.ftruncate(fd, length)  # drop the alignment padding
        except OSError:
            self._direct_ok = False
            return False
        finally:
            os.close(fd)
        return True

    def read_blocks(self, ckey: bytes, length: int, crcs: tuple[int, ...], first: int,
                    last: int) -> bytes:
        """Bytes of blocks first..last (inclusive) of a chunk, each block verified."""
        bs = self.block_size
        start = first * bs
        want = min(length, (last + 1) * bs) - start
        try:
            fd = os.open(self.path(ckey), os.O_RDONLY)
        except FileNotFoundError:
            raise CacheCorrupt(f"chunk file {chunk_name(ckey)} is missing") from None
        try:
            buf = os.pread(fd, want, start)
        finally:
            os.close(fd)
        if len(buf) != want:
            raise CacheCorrupt(f"chunk file {chunk_name(ckey)} is short")
        view = memoryview(buf)
        for i, b in enumerate(range(first, last + 1)):
            if zlib.crc32(view[i * bs:(i + 1) * bs]) != crcs[b]:
                raise CacheCorrupt(f"chunk file {chunk_name(ckey)} block {b} fails its checksum")
        return buf

    def delete(self, ckey: bytes) -> None:
        try:
            os.unlink(self.path(ckey))
        except FileNotFoundError:
            pass

    def scan(self) -> dict[str, int]:
        """Clear tmp/ and return {chunk file name: size} of every chunk file present."""
        for name in os.listdir(self.tmp_dir):
            os.unlink(os.path.join(self.tmp_dir, name))
        present = {}
        for sub in os.listdir(self.chunk_dir):
            d = os.path.join(self.chunk_dir, sub)
            for e in os.scandir(d):
                present[e.name] = e.stat().st_size
        return present

    def delete_name(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.chunk_dir, name[:2], name))
        except FileNotFoundError:
            pass
