"""Checking the index without risking a signal, and salvaging a damaged one.

A damaged LMDB file can kill the process that reads it (SIGBUS on a truncated file,
SIGABRT on a garbage page), so before the index is opened (tierfs.index.meta) its meta
pages are checked here and a child process (`python -m tierfs.index.probe --probe DIR`)
walks every database; the daemon starts that child early, beside its bucket check, with
`start_probe`. A damaged index is moved aside (`set_aside`) and a second child
(`--salvage`) streams back what it can still read, database by database (_SALVAGE_ORDER).
"""

from __future__ import annotations

import os
import resource
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

import lmdb

from .env import CHUNKS, INFO, LEGACY, OBJECTS, PINS

PROBE_TIMEOUT_S = 120.0  # a walk of millions of records takes seconds; a loop in garbage, forever
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_VERSION = 1  # MDB_DATA_VERSION of LMDB 0.9 (py-lmdb bundles it)
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_PAGE_HDR = struct.Struct("<QHHI")  # pgno, pad, flags, lower/upper
_META = struct.Struct("<IIQQ")  # magic, version, address, map size
_DB = struct.Struct("<IHHQQQQQ")  # pad (page size in FREE_DBI), flags, depth, pages.., root
_TAIL = struct.Struct("<QQ")  # last page used, txn id
_SALVAGE_ORDER = (INFO, *LEGACY, PINS, OBJECTS, CHUNKS)
_FRAME = struct.Struct(">HII")  # len(db name), len(key), len(value); value len ~0: db complete
_DB_DONE = 0xFFFFFFFF


def _meta_page(head: bytes, off: int) -> tuple[int, int, int, int, int, int] | str:
    """(page size, version, txn id, last page, main root, free root) of the meta page at
    off, or what is wrong with it."""
    if len(head) < off + _PAGE_HDR.size + _META.size + 2 * _DB.size + _TAIL.size:
        return "shorter than its meta pages"
    _, _, flags, _ = _PAGE_HDR.unpack_from(head, off)
    magic, version, _, _ = _META.unpack_from(head, off + _PAGE_HDR.size)
    if magic != _LMDB_MAGIC or not flags & _P_META:
        return "not an LMDB file (no meta page)"
    if version != _LMDB_VERSION:
        return f"LMDB data format version {version}, not {_LMDB_VERSION}"
    dbs = off + _PAGE_HDR.size + _META.size
    free, main = _DB.unpack_from(head, dbs), _DB.unpack_from(head, dbs + _DB.size)
    last, txnid = _TAIL.unpack_from(head, dbs + 2 * _DB.size)
    return free[0], version, txnid, last, main[7], free[7]


def check_meta_pages(data_path: str) -> str | None:
    """What is wrong with data.mdb's two meta pages, or None. Reads the head of the file
    (never maps it): catches a truncated file, a foreign file and another LMDB format."""
    try:
        with open(data_path, "rb") as f:
            head = f.read(2 << 16)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    first = _meta_page(head, 0)
    if isinstance(first, str):
        return first
    psize = first[0]
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return f"meta page gives a page size of {psize}"
    second = _meta_page(head, psize)
    if isinstance(second, str):
        return f"second meta page: {second}"
    _, _, _, last, main_root, free_root = max(first, second, key=lambda m: m[2])
    # the file may end before `last`: pages freed in the transaction that allocated them
    # are never written. The roots are, and the child's walk finds any other page cut off.
    for root in (main_root, free_root):
        if root == _P_INVALID:
            continue
        if root > last:
            return f"a root page ({root}) lies past the last page ({last})"
        if (root + 1) * psize > size:
            return f"truncated: {size} bytes, a root page ends at byte {(root + 1) * psize}"
    return None


def _start_child(args: list[str]) -> subprocess.Popen[bytes]:
    """Start `python -m tierfs.index.probe ARGS` (stdout and stderr piped)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "tierfs.index.probe", *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _finish_child(proc: subprocess.Popen[bytes],
                  timeout_s: float) -> tuple[int | None, bytes, str]:
    """Wait up to `timeout_s` for a child of _start_child: (exit status or None on timeout,
    stdout, last stderr line). A child out of time is killed."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return None, out or b"", ""
    lines = err.decode(errors="replace").strip().splitlines()
    return proc.returncode, out, (lines[-1][:300] if lines else "")


def _child(args: list[str], timeout_s: float) -> tuple[int | None, bytes, str]:
    """Run `python -m tierfs.index.probe ARGS`: (exit status or None on timeout, stdout, last
    stderr line)."""
    return _finish_child(_start_child(args), timeout_s)


@dataclass
class _EarlyProbe:
    proc: subprocess.Popen[bytes]
    file: tuple[int, int, int, int]  # data.mdb's (dev, ino, size, mtime_ns) when it started
    deadline: float  # time.monotonic()


_early: dict[str, _EarlyProbe] = {}  # index dir -> its probe started by start_probe


def _file_id(data: str) -> tuple[int, int, int, int]:
    st = os.stat(data)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def start_probe(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Start probe_index's child for the index in PATH now (if there is one), so that the
    walk runs beside the daemon's other start-up work (the bucket check, the imports)
    instead of after it; probe_index(PATH) then takes its answer - only if data.mdb is
    still the same file, same size and mtime, else it probes again. The caller holds the
    cache dir's lock, so nothing else writes the index meanwhile; stop_probes() ends a
    probe nobody collected."""
    data = os.path.join(path, "data.mdb")
    try:
        file = _file_id(data)
    except OSError:
        return  # no index: nothing to probe (probe_index says so itself)
    _drop_early(path)
    _early[path] = _EarlyProbe(_start_child(["--probe", path]), file,
                               time.monotonic() + timeout_s)


def _drop_early(path: str) -> None:
    early = _early.pop(path, None)
    if early is not None:
        early.proc.kill()  # a no-op on one that has exited (not yet reaped)
        early.proc.communicate()


def stop_probes() -> None:
    """Kill and reap the probes start_probe started that probe_index did not collect."""
    for path in list(_early):
        _drop_early(path)


def _early_probe(path: str, data: str) -> tuple[int | None, bytes, str] | None:
    """The answer of the probe start_probe started for PATH, if the file it walked is
    still the one there (None: probe now)."""
    early = _early.pop(path, None)
    if early is None:
        return None
    try:
        same = _file_id(data) == early.file
    except OSError:
        same = False
    if not same:
        _early[path] = early
        _drop_early(path)
        return None
    return _finish_child(early.proc, max(0.0, early.deadline - time.monotonic()))


def probe_index(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """What is wrong with the LMDB index in PATH, or None (also when there is none).

    The meta pages are checked here; then a child process opens the environment and
    reads every record of every database (or one start_probe started earlier has). If
    the file is damaged, the child dies (SIGBUS, SIGABRT), fails or loops, not this
    process."""
    data = os.path.join(path, "data.mdb")
    if not os.path.exists(data):
        _drop_early(path)
        return None
    problem = check_meta_pages(data)
    if problem is not None:
        _drop_early(path)
        return problem
    answer = _early_probe(path, data)
    status, _, err = answer if answer is not None else _child(["--probe", path], timeout_s)
    if status is None:
        return f"reading it did not finish in {timeout_s:g}s"
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.valid_signals() else -status
        return f"reading it killed the checking process ({name}{': ' + err if err else ''})"
    if status != 0:
        return f"reading it failed: {err or f'exit status {status}'}"
    return None


@dataclass
class Salvage:
    """What could still be read from a damaged index: db name -> [(key, value)]."""

    records: dict[bytes, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    complete: set[bytes] = field(default_factory=set)  # databases read to their end


def salvage_index(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> Salvage:
    """Read what a child process can still read from a damaged index (records arrive as
    it reads them, so a child killed half-way still leaves what it got)."""
    out = Salvage()
    _, data, _ = _child(["--salvage", path], timeout_s)
    pos = 0
    while pos + _FRAME.size <= len(data):
        nlen, klen, vlen = _FRAME.unpack_from(data, pos)
        body = pos + _FRAME.size
        name = data[body:body + nlen]
        if vlen == _DB_DONE:
            if body + nlen > len(data):
                break
            out.complete.add(name)
            pos = body + nlen
            continue
        end = body + nlen + klen + vlen
        if end > len(data):
            break
        key = data[body + nlen:body + nlen + klen]
        out.records.setdefault(name, []).append((key, data[body + nlen + klen:end]))
        pos = end
    return out


def _no_core() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a damaged page is no bug report
    except (ValueError, OSError):
        pass


def _probe_main(path: str) -> int:
    _no_core()
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=64, readahead=False)
    with env.begin() as txn:
        names = [bytes(k) for k in txn.cursor().iternext(values=False)]
    for name in names:
        db = env.open_db(name, create=False)
        with env.begin(db=db, buffers=True) as txn:
            for k, v in txn.cursor():
                len(k), bytes(v[-1:])  # touch every leaf and overflow page
    env.close()
    return 0


def _salvage_main(path: str) -> int:
    _no_core()
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=64, readahead=False)
    out = sys.stdout.buffer
    for name in _SALVAGE_ORDER:
        try:
            db = env.open_db(name, create=False)
        except lmdb.Error:
            continue
        with env.begin(db=db) as txn:
            for n, (k, v) in enumerate(txn.cursor()):
                out.write(_FRAME.pack(len(name), len(k), len(v)) + name + k + v)
                if n % 256 == 0:
                    out.flush()
        out.write(_FRAME.pack(len(name), 0, _DB_DONE) + name)
        out.flush()
    env.close()
    return 0


def set_aside(path: str, now: float | None = None) -> str:
    """Move the index dir PATH to PATH.damaged-<time>; returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    aside = f"{path}.damaged-{stamp}"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.damaged-{stamp}.{n}"
    os.rename(path, aside)
    return aside


def _main(argv: list[str]) -> int:
    """`python -m tierfs.index.probe --probe DIR | --salvage DIR`: the child side of probe_index
    and salvage_index (exit 0: read whole; a damaged file kills or fails this process)."""
    if len(argv) != 2 or argv[0] not in ("--probe", "--salvage"):
        sys.stderr.write("usage: python -m tierfs.index.probe --probe|--salvage INDEX_DIR\n")
        return 2
    try:
        return (_probe_main if argv[0] == "--probe" else _salvage_main)(argv[1])
    except lmdb.Error as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        return 3


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

