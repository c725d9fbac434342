"""The disk tier: chunk files on node-local NVMe, verified by per-block CRC32C.

Layout under the cache dir: chunks/<2 hex>/<object id>.<index> and tmp/. A chunk is
written to tmp/ and renamed into place, so a visible file is never half-written by us; it
is not fsynced, because every read verifies the blocks it returns against the index and a
torn or bit-rotted file is simply dropped and fetched again.

Reads: `read_cached` runs on the trio thread and answers only from the page cache
(`preadv` with RWF_NOWAIT on a chunk file already open), so a warm read costs no thread
hand-off; it returns None when the data is not there (EAGAIN, a short read, no open fd)
and the caller runs `read_blocks` in a worker thread. A big read (>= 1 MiB: whole chunks
the Prefetcher loads) goes into a buffer reused from an earlier one that the memory tier
let go (`_ReadBuffers`; `reuse` is non-blocking and called on the trio thread). Every
other method blocks and runs in worker threads. Chunk files stay open in a bounded LRU
of fds (`_Fds`), closed when the chunk is deleted or replaced, when it falls out of the
LRU, and at `close()`.

The CRCs are CRC32C (hardware, google_crc32c): meta.CHUNK_FORMAT 2. meta.py keeps the
format in the index and drops the chunk records of any other (format 1 was zlib's CRC32)
at mount; their files are then orphans that ChunkCache.recover deletes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import google_crc32c

from ..cachedir import Layout
from ..errors import CacheCorrupt
from .keys import chunk_name

_ALIGN = 4096
_DIRECT_MIN = 1 << 20  # small chunks: buffered writes are cheaper than the copy
_POOLED = 4  # aligned buffers kept for reuse (the read walk runs 4 disk writes at once)
_NOWAIT_MAX = 256 << 10  # bigger reads go to a worker thread: they would stall the trio
#                          thread for milliseconds, and one hand-off per 8 MiB is cheap
_FDS_MAX = 256  # chunk files kept open (a 2 GiB working set of 8 MiB chunks)
REUSE_MIN = 1 << 20  # reads this big go into reused buffers (sizes: multiples of this)
_REUSE_KEEP = 4  # idle read buffers kept (the Prefetcher loads a few chunks at once)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _c_crc32c() -> Callable[[int, int, int], int] | None:
    """crc32c_extend(crc, address, length) of the C library google_crc32c wraps: its
    Python entry points take read-only bytes only, which would cost a copy of every block
    of a buffer we read into; this one takes any address and releases the GIL."""
    if google_crc32c.implementation != "c":
        return None
    try:
        from google_crc32c import _crc32c
        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    probe = b"123456789"  # the CRC32C check value
    if fn(0, ctypes.cast(ctypes.c_char_p(probe), ctypes.c_void_p), len(probe)) != 0xE3069283:
        return None
    return fn


_CRC = _c_crc32c()


def block_crcs(data: bytes | bytearray | memoryview | mmap.mmap, block_size: int) -> list[int]:
    """CRC32C of each block_size block of data (one CRC of nothing for empty data)."""
    view = memoryview(data)
    n = len(view)
    if _CRC is not None and n and (isinstance(data, bytes) or not view.readonly):
        # bytes: the address of their own buffer (c_char_p does not copy), valid while
        # `data` lives; a writable buffer: a ctypes array over it
        base = (ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
                if isinstance(data, bytes)
                else ctypes.addressof((ctypes.c_char * n).from_buffer(view)))
        assert base is not None
        return [_CRC(0, base + i, min(block_size, n - i)) for i in range(0, n, block_size)]
    if isinstance(data, bytes) and n <= block_size:
        return [google_crc32c.value(data)]
    return [google_crc32c.value(bytes(view[i:i + block_size]))
            for i in range(0, max(n, 1), block_size)]


class _Fd:
    __slots__ = ("fd", "users", "dead")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.dead = False


class _Fds:
    """Open chunk files, LRU-bounded, shared by the trio thread and worker threads.

    An fd is closed only once no read is using it (`users`): closing it under a reader
    could hand its number to another file mid-read. `forget` (a chunk deleted or replaced)
    bumps an epoch, so an open that raced it is used once and not kept: an fd of a deleted
    file would pin its disk space.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[bytes, _Fd] = OrderedDict()
        self._limit = limit
        self._epoch = 0

    def acquire(self, ckey: bytes) -> _Fd | None:
        with self._lock:
            h = self._open.get(ckey)
            if h is not None:
                self._open.move_to_end(ckey)
                h.users += 1
            return h

    def open(self, ckey: bytes, path: str) -> _Fd:
        """An fd for the chunk (blocking: opens the file unless one is kept), in use."""
        h = self.acquire(ckey)
        if h is not None:
            return h
        epoch = self._epoch
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        h = _Fd(fd)
        h.users = 1
        closing = []
        with self._lock:
            if epoch != self._epoch or ckey in self._open:
                h.dead = True  # used for this read only
                return h
            self._open[ckey] = h
            while len(self._open) > self._limit:
                closing.append(self._retire(self._open.popitem(last=False)[1]))
        _close(closing)
        return h

    def release(self, h: _Fd) -> None:
        with self._lock:
            h.users -= 1
            last = h.dead and h.users == 0
        if last:
            os.close(h.fd)

    def forget(self, ckey: bytes) -> None:
        with self._lock:
            self._epoch += 1
            h = self._open.pop(ckey, None)
            closing = [self._retire(h)] if h is not None else []
        _close(closing)

    def close_all(self) -> None:
        with self._lock:
            self._epoch += 1
            closing = [self._retire(h) for h in self._open.values()]
            self._open.clear()
        _close(closing)

    def _retire(self, h: _Fd) -> int | None:
        """Mark a kept fd gone (under the lock); the fd to close now, unless a read still
        uses it (its release closes it). Closed outside the lock: the last close of a
        deleted file frees its blocks, which the trio thread must not wait for."""
        h.dead = True
        return h.fd if h.users == 0 else None

    def __len__(self) -> int:
        return len(self._open)


class _ReadBuffer(mmap.mmap):
    """A buffer of `_ReadBuffers` (the type tells ours from any other buffer)."""


class _ReadBuffers:
    """Buffers for big disk-tier reads, reused once no view of them is left.

    A read into fresh memory page-faults every 4 KiB of it in (and unmaps it when freed):
    a third of the daemon's CPU on a warm sequential read (bench/README.md). The memory
    tier keeps what was read, so a buffer is free again only when its last view is gone:
    `give` checks that with mmap's own count of exported views (a resize is refused while
    one lives), so bytes a reader, a reply or another entry still sees are never
    overwritten. Shared by worker threads (take) and the trio thread (give).
    """

    def __init__(self, keep: int) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[_ReadBuffer]] = {}
        self._keep = keep
        self._count = 0

    def take(self, size: int) -> _ReadBuffer:
        cap = -(-size // REUSE_MIN) * REUSE_MIN
        with self._lock:
            free = self._free.get(cap)
            if free:
                self._count -= 1
                return free.pop()
        # no MADV_HUGEPAGE: on the bench VM, zeroing fresh huge pages cost more than the
        # 4 KiB faults it saves (bench/README.md)
        return _ReadBuffer(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def give(self, buf: object) -> None:
        if not isinstance(buf, _ReadBuffer) or buf.closed:
            return
        try:
            buf.resize(len(buf))  # same size: no change, but BufferError while a view lives
        except (BufferError, OSError, ValueError, SystemError):
            return  # in use (or not resizable here): freed when its last view goes
        with self._lock:
            if self._count < self._keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._count += 1

    def __len__(self) -> int:
        return self._count


def _close(fds: list[int | None]) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


class DiskTier:
    def __init__(self, root: str, block_size: int, *, open_files: int = _FDS_MAX) -> None:
        self.root = root
        self.block_size = block_size
        self.layout = Layout(root)
        self.chunk_dir = self.layout.chunks
        self.tmp_dir = self.layout.tmp
        os.makedirs(self.chunk_dir, exist_ok=True)
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._direct_ok = hasattr(os, "O_DIRECT")
        self._buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._fds = _Fds(open_files)
        self._reads = _ReadBuffers(_REUSE_KEEP)
        # a tier dropped without close() (a test's core) still closes its files
        self._finalizer = weakref.finalize(self, self._fds.close_all)

    def path(self, ckey: bytes) -> str:
        return self.layout.chunk_file(chunk_name(ckey))

    def checksums(self, data: bytes | bytearray | memoryview) -> tuple[int, ...]:
        return tuple(block_crcs(data, self.block_size))

    def write(self, ckey: bytes, data: bytes | bytearray | memoryview) -> tuple[int, ...]:
        def copy(view: memoryview) -> None:
            view[:] = data

        return self.write_via(ckey, len(data), copy)

    def write_via(self, ckey: bytes, length: int,
                  fill: Callable[[memoryview], None]) -> tuple[int, ...]:
        """Write a chunk whose bytes `fill` puts into the buffer it is given (a GET can read
        its body straight into it: no chunk-sized allocation, no copy). Returns the CRCs."""
        path = self.path(ckey)
        tmp = self.layout.tmp_file(os.path.basename(path))
        padded = -(-length // _ALIGN) * _ALIGN
        direct = self._direct_ok and length >= _DIRECT_MIN
        pooled = self._buffer(padded) if direct else None
        buf = pooled if pooled is not None else bytearray(length)
        view = memoryview(buf)
        try:
            fill(view[:length])
            if not (direct and self._write_direct(tmp, view, length, padded)):
                with open(tmp, "wb") as f:
                    f.write(view[:length])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
            self._fds.forget(ckey)  # an fd kept for a file this one replaced
            return self.checksums(view[:length])
        finally:
            view.release()
            # a few buffers serve every writer thread: as many as write at once, not one
            # per worker thread (trio keeps dozens of threads)
            if pooled is not None and self._buffers.qsize() < _POOLED:
                self._buffers.put(pooled)

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

    # ---- reads -----------------------------------------------------------------------

    def read_cached(self, ckey: bytes, length: int, crcs: tuple[int, ...], first: int,
                    last: int) -> memoryview | None:
        """`read_blocks` without blocking (for the trio thread): None unless the chunk's
        file is open already and the blocks are all in the page cache."""
        if not _RWF_NOWAIT:
            return None
        start, want = self._span(length, first, last)
        if want > _NOWAIT_MAX:
            return None
        h = self._fds.acquire(ckey)
        if h is None:
            return None
        try:
            buf = bytearray(want)
            try:
                got = os.preadv(h.fd, [buf], start, _RWF_NOWAIT)
            except OSError:  # EAGAIN: not cached; EOPNOTSUPP; an error the blocking read meets
                return None
        finally:
            self._fds.release(h)
        if got != want:  # part not cached, or the file is short: a blocking read says which
            return None
        self._verify(ckey, buf, crcs, first)
        return memoryview(buf).toreadonly()  # nobody writes to buf again

    def read_blocks(self, ckey: bytes, length: int, crcs: tuple[int, ...], first: int,
                    last: int) -> bytes | memoryview:
        """Bytes of blocks first..last (inclusive) of a chunk, each block verified: bytes,
        or for a big read a read-only view of a reused buffer (see `reuse`)."""
        start, want = self._span(length, first, last)
        try:
            h = self._fds.open(ckey, self.path(ckey))
        except FileNotFoundError:
            raise CacheCorrupt(f"chunk file {chunk_name(ckey)} is missing") from None
        if want < REUSE_MIN:
            try:
                # a pread into new bytes costs half a preadv into a bytearray (zeroed first)
                buf = os.pread(h.fd, want, start)
            finally:
                self._fds.release(h)
            if len(buf) != want:
                raise CacheCorrupt(f"chunk file {chunk_name(ckey)} is short")
            self._verify(ckey, buf, crcs, first)
            return buf
        reused = self._reads.take(want)
        view = memoryview(reused)[:want]
        try:
            try:
                got = os.preadv(h.fd, [view], start)
            finally:
                self._fds.release(h)
            if got != want:
                raise CacheCorrupt(f"chunk file {chunk_name(ckey)} is short")
            self._verify(ckey, view, crcs, first)
        except BaseException:
            view.release()
            self._reads.give(reused)  # nothing of it was handed out
            raise
        out = view.toreadonly()
        view.release()
        return out

    def read_buffer(self, size: int) -> memoryview:
        """A writable view of `size` bytes of a reused read buffer (size >= REUSE_MIN), for a
        GET's body (tierfs/read/sources.py): a memory-tier entry of it comes back through `reuse`
        like a disk read's, so a cold pass does not page-fault fresh memory in per chunk
        either. Release the writable view once filled; hand out read-only views only."""
        return memoryview(self._reads.take(size))[:size]

    def reuse(self, owner: object) -> None:
        """`owner` (the object a released memory-tier view was of) may serve another read,
        if it is one of our read buffers and no view of it is left."""
        self._reads.give(owner)

    def _span(self, length: int, first: int, last: int) -> tuple[int, int]:
        start = first * self.block_size
        return start, min(length, (last + 1) * self.block_size) - start

    def _verify(self, ckey: bytes, buf: bytes | bytearray | memoryview, crcs: tuple[int, ...],
                first: int) -> None:
        for b, crc in enumerate(block_crcs(buf, self.block_size), first):
            if crc != crcs[b]:
                raise CacheCorrupt(f"chunk file {chunk_name(ckey)} block {b} fails its checksum")

    # ---- removal ---------------------------------------------------------------------

    def delete(self, ckey: bytes) -> None:
        self._fds.forget(ckey)
        try:
            os.unlink(self.path(ckey))
        except FileNotFoundError:
            pass

    def forget(self, ckey: bytes) -> None:
        """Close the chunk's kept fd, if any (its file is replaced or about to go)."""
        self._fds.forget(ckey)

    def close(self) -> None:
        self._fds.close_all()

    def scan(self) -> dict[str, int]:
        """Clear tmp/ and return {chunk file name: size} of every chunk file present."""
        for name in os.listdir(self.tmp_dir):
            os.unlink(self.layout.tmp_file(name))
        present = {}
        for sub in os.listdir(self.chunk_dir):
            d = os.path.join(self.chunk_dir, sub)
            for e in os.scandir(d):
                present[e.name] = e.stat().st_size
        return present

    def delete_name(self, name: str) -> None:
        try:
            os.unlink(self.layout.chunk_file(name))
        except FileNotFoundError:
            pass
