"""Whether a range of a file is in the kernel's page cache, asked without reading it.

The disk tier answers reads of cached pages on the trio thread with a non-blocking
`preadv(RWF_NOWAIT)` and hands the rest to a worker thread. A NOWAIT read of pages that
are not cached is not free: before it fails with EAGAIN the kernel allocates the pages
and submits their reads (readahead), on the trio thread - a quarter of that thread's time
in a py-spy of random 4 KiB reads after the page cache was dropped (bench/README.md).
`cachestat(2)` (Linux 6.5) counts the cached pages of a range without touching them, in
about a microsecond, so such a read goes straight to the worker thread. Where the kernel
lacks the call (ENOSYS: Debian 12's 6.1), `Residency.cached` answers None and the disk
tier tries the NOWAIT read as before.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_PAGE = os.sysconf("SC_PAGE_SIZE")
# the generic syscall table: x86_64 and aarch64 alike
_NR_CACHESTAT = 451 if platform.machine() in ("x86_64", "aarch64") else None


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


class Residency:
    """`cached(fd, start, length)`: True if every page of the range is in the page cache,
    False if one is not, None if the kernel cannot say. One instance per thread: the
    argument structures are reused."""

    def __init__(self) -> None:
        self._call = None
        if _NR_CACHESTAT is not None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                self._call = libc.syscall
            except OSError:
                self._call = None
        self._range = _Range()
        self._stat = _Stat()
        self._args = (ctypes.byref(self._range), ctypes.byref(self._stat))

    @property
    def supported(self) -> bool:
        return self._call is not None

    def cached(self, fd: int, start: int, length: int) -> bool | None:
        call = self._call
        if call is None or length <= 0:
            return None
        first = start - start % _PAGE
        self._range.off = first
        self._range.len = start + length - first
        if call(_NR_CACHESTAT, fd, self._args[0], self._args[1], 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter
                self._call = None
            return None
        pages = (self._range.len + _PAGE - 1) // _PAGE
        return self._stat.nr_cache >= pages
