"""`tierfs fsck --cache-dir DIR [--repair] [--json]`: check (and repair) a cache dir offline.

What it checks, with the daemon stopped (a dir locked by a running tierfs is refused):
- the write-back journal: records that fail their checksum, a torn last record, a missing
  journal; each journaled file against its staging file in dirty/; staging files no
  journal record owns;
- the chunk index: damage (probed in a child process, as a mount does), and each chunk
  record against its file in chunks/ (missing, wrong size, CRC of every block); chunk
  files and tmp/ files the index does not know.

--repair fixes what it can, the same way a mount would but saying what it did: bad chunk
records are dropped with their files, orphan files deleted, a damaged index moved aside
(index.damaged-<time>) and rebuilt from what can be salvaged, a damaged journal rewritten
from the records that still verify (the old file kept as journal.damaged-<time>). It never
deletes the staging file of a journaled file; a staging file the journal cannot vouch for
because the journal itself was damaged or missing is moved to lost+found/, not deleted.

One line per problem, then a summary; --json prints one JSON object instead. Exit status:
0 clean (or, with --repair, every problem repaired); 1 problems found (that remain);
2 bad usage or a dir that cannot be checked (missing, not a cache dir, in use, unreadable).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import lmdb

from ..cachedir import ENTRIES, Layout
from ..errors import TierfsError
from ..index.chunks import ChunkRecord, chunk_format
from ..index.env import CHUNK_FORMAT_KEY, CHUNKS, INFO, JOURNAL, SOURCE
from ..index.journal import JournalState, scan_file, write_file
from ..index.meta import MetaStore
from ..index.probe import probe_index, salvage_index, set_aside

CLEAN, PROBLEMS, USAGE = 0, 1, 2
_BLOCK_SIZES = [1 << n for n in range(12, 27)]  # 4 KiB .. 64 MiB: what --chunk-size allows


class FsckRefused(TierfsError):
    """The cache dir cannot be checked (missing, not a cache dir, in use)."""


@dataclass
class Problem:
    kind: str  # journal, staging, index, chunk, orphan
    path: str
    detail: str
    repaired: bool = False

    def line(self) -> str:
        return f"{self.kind}: {self.path}: {self.detail}" + (" [repaired]" if self.repaired else "")


@dataclass
class Report:
    cache_dir: str
    repair: bool
    problems: list[Problem] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    journaled_files: int = 0

    def add(self, kind: str, path: str, detail: str, repaired: bool = False) -> Problem:
        p = Problem(kind, path, detail, repaired)
        self.problems.append(p)
        return p

    @property
    def unrepaired(self) -> int:
        return sum(1 for p in self.problems if not p.repaired)

    def status(self) -> int:
        return PROBLEMS if self.unrepaired else CLEAN

    def summary(self) -> str:
        fixed = len(self.problems) - self.unrepaired
        return (f"fsck {self.cache_dir}: {self.chunks_checked} chunk files "
                f"({self.bytes_checked} bytes) and {self.journaled_files} journaled files "
                f"checked; {len(self.problems)} problems"
                + (f", {fixed} repaired" if self.repair else ""))

    def as_json(self) -> dict:
        return {"cache_dir": self.cache_dir, "repair": self.repair,
                "clean": not self.problems, "problems": [asdict(p) for p in self.problems],
                "chunks_checked": self.chunks_checked, "bytes_checked": self.bytes_checked,
                "journaled_files": self.journaled_files, "unrepaired": self.unrepaired}


# ---- the lock ----------------------------------------------------------------------------


def lock(cache_dir: str) -> int:
    """Take the cache dir's lock as a daemon would (tierfs.mount.daemon.lock_cache_dir): a
    running daemon makes this fail, and no daemon can start while fsck runs."""
    path = Layout(cache_dir).lock
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise FsckRefused(f"cannot open {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise FsckRefused(f"cache dir {cache_dir} is in use by a running tierfs (pid {owner}): "
                          "unmount it first") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# ---- the journal ------------------------------------------------------------------------


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime())


def _to_lost_found(cache_dir: str, path: str) -> str:
    dest_dir = Layout(cache_dir).lost_found
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, os.path.basename(path))
    os.rename(path, dest)
    return dest


def check_journal(cache_dir: str, report: Report, index_marked: bool) -> None:
    jpath, staging_dir = Layout(cache_dir).journal, Layout(cache_dir).dirty
    staged = sorted(os.listdir(staging_dir)) if os.path.isdir(staging_dir) else []
    trusted = True  # whether the journal can say which staging files matter
    state = JournalState()
    if not os.path.exists(jpath):
        if index_marked or staged:
            trusted = False
            p = report.add("journal", jpath, "missing" + (
                f"; {len(staged)} staging files may be unsaved writes" if staged else ""))
            if report.repair:
                write_file(jpath, [])
                p.repaired = True
    else:
        scan = scan_file(jpath)
        problems = []
        if scan.bad_header:
            problems.append(report.add("journal", jpath, "not a tierfs journal (bad header)"))
        for d in scan.damage[1 if scan.bad_header else 0:]:
            problems.append(report.add("journal", jpath,
                                       f"bytes {d.start}-{d.end} fail their checksum"))
        for off, op in scan.ops:
            try:
                state.apply(op)
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(report.add("journal", jpath,
                                           f"record at byte {off} cannot be read ({exc})"))
        if problems:
            trusted = False
        if scan.torn_at is not None:
            problems.append(report.add(
                "journal", jpath, f"torn last record at byte {scan.torn_at} (an append a "
                "crash interrupted: never acknowledged)"))
        if problems and report.repair:
            if not trusted:
                shutil.copy2(jpath, f"{jpath}.damaged-{_stamp()}")
            write_file(jpath, state.ops())
            for p in problems:
                p.repaired = True
    # journaled files against their staging files
    live = dict(state.dirty)
    report.journaled_files = len(live)
    owned = set()
    for ino, entry in sorted(live.items()):
        rec = entry["record"] if isinstance(entry["record"], dict) else {}
        staging = str(rec.get("staging", ""))
        owned.add(os.path.basename(staging))
        if not os.path.isfile(staging):
            p = report.add("staging", staging or f"ino {ino}",
                           f"journaled file {rec.get('key')!r} has no staging file: its "
                           "unsaved writes are lost")
            if report.repair:
                _rewrite_without(jpath, ino)
                p.repaired = True
    for name in staged:
        if name in owned:
            continue
        path = os.path.join(staging_dir, name)
        if trusted:
            p = report.add("staging", path, "not journaled (a write never acknowledged; "
                           "a mount deletes it)")
            if report.repair:
                os.unlink(path)
                p.repaired = True
        else:
            p = report.add("staging", path, "not in the journal, which was damaged or "
                           "missing: may be unsaved writes")
            if report.repair:
                dest = _to_lost_found(cache_dir, path)
                p.detail += f"; moved to {dest}"
                p.repaired = True


def _rewrite_without(jpath: str, ino: int) -> None:
    scan = scan_file(jpath)
    state = JournalState()
    for _, op in scan.ops:
        try:
            state.apply(op)
        except (ValueError, KeyError, TypeError):
            continue
    state.dirty.pop(ino, None)
    write_file(jpath, state.ops())


# ---- the chunk index --------------------------------------------------------------------


def _crcs_of(fmt: int) -> Callable[[bytes, int], Sequence[int]]:
    """The block checksum of an index's chunk format (tierfs.index.chunks.CHUNK_FORMAT: 2 is CRC32C,
    1 zlib's CRC32, which a mount of this tierfs drops but fsck still checks)."""
    if fmt == 1:
        return lambda data, bs: [zlib.crc32(data[i:i + bs])
                                 for i in range(0, max(len(data), 1), bs)]
    from ..cache.disk import block_crcs
    return block_crcs


def _verify(path: str, rec: ChunkRecord,
            crcs_of: Callable[[bytes, int], Sequence[int]]) -> str | None:
    """What is wrong with a chunk file against its record, or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    if len(data) != rec.length:
        return f"{len(data)} bytes, the index says {rec.length}"
    n = len(rec.crcs)
    for bs in _BLOCK_SIZES:
        if max(1, -(-rec.length // bs)) != n:
            continue
        crcs = crcs_of(data, bs)
        if crcs[0] != rec.crcs[0] and n > 1:
            continue  # not this block size
        bad = [b for b, (a, e) in enumerate(zip(crcs, rec.crcs, strict=True)) if a != e]
        return None if not bad else f"block {bad[0]} fails its CRC ({len(bad)} of {n} blocks)"
    return f"fails its CRC ({n} checksums fit no block size)"


def _chunk_files(cache_dir: str) -> dict[str, str]:
    out = {}
    root = Layout(cache_dir).chunks
    if os.path.isdir(root):
        for sub in sorted(os.listdir(root)):
            d = os.path.join(root, sub)
            if os.path.isdir(d):
                for name in os.listdir(d):
                    out[name] = os.path.join(d, name)
    return out


def check_index(cache_dir: str, report: Report, problem: str | None) -> None:
    """Check index (`problem`: what probe_index found) and chunk files."""
    # imported here: tierfs.cache brings trio, and every `tierfs` command (Slurm hooks
    # included) imports this module to register its parser
    from ..cache.keys import chunk_name

    index = Layout(cache_dir).index
    if problem is not None:
        p = report.add("index", index, f"damaged: {problem}")
        if not report.repair:
            return  # its chunk records cannot be trusted to check files against
        source = _salvaged_source(index)
        if source is not None:  # a mount's own way: aside, salvage, rebuild
            MetaStore(index, source).close()
            p.detail += "; moved aside and rebuilt from what could be salvaged"
        else:
            p.detail += f"; moved to {set_aside(index)} (the next mount starts empty)"
        p.repaired = True
        # then the chunk files against the new index: those it did not re-adopt go
    files = _chunk_files(cache_dir)
    tmp = Layout(cache_dir).tmp
    if os.path.exists(os.path.join(index, "data.mdb")):
        env = lmdb.open(index, max_dbs=16, readonly=not report.repair, lock=report.repair,
                        readahead=False)
        try:
            try:
                chunks_db = env.open_db(CHUNKS, create=False)
            except lmdb.NotFoundError:
                chunks_db = None
            bad: list[bytes] = []
            crcs_of = _crcs_of(_index_chunk_format(env))
            if chunks_db is not None:
                with env.begin(db=chunks_db) as txn:
                    records = [(bytes(k), ChunkRecord.unpack(v)) for k, v in txn.cursor()]
                for key, rec in records:
                    name = chunk_name(key)
                    path = files.pop(name, None)
                    if path is None:
                        report.add("chunk", name, "indexed, but its file is missing")
                        bad.append(key)
                        continue
                    report.chunks_checked += 1
                    report.bytes_checked += rec.length
                    why = _verify(path, rec, crcs_of)
                    if why is not None:
                        report.add("chunk", path, why)
                        bad.append(key)
                if bad and report.repair:
                    with env.begin(write=True, db=chunks_db) as txn:
                        for key in bad:
                            txn.delete(key)
                    for key in bad:
                        try:
                            os.unlink(Layout(cache_dir).chunk_file(chunk_name(key)))
                        except FileNotFoundError:
                            pass
                    for p in report.problems:
                        if p.kind == "chunk":
                            p.repaired = True
        finally:
            env.close()
    for _name, path in sorted(files.items()):
        p = report.add("orphan", path, "chunk file the index does not know")
        if report.repair:
            os.unlink(path)
            p.repaired = True
    if os.path.isdir(tmp):
        for name in sorted(os.listdir(tmp)):
            p = report.add("orphan", os.path.join(tmp, name), "left in tmp/ by a crash")
            if report.repair:
                os.unlink(os.path.join(tmp, name))
                p.repaired = True


def _salvaged_source(index: str) -> str | None:
    for k, v in salvage_index(index).records.get(INFO, ()):
        if k == SOURCE:
            return v.decode(errors="replace")
    return None


# ---- the command ------------------------------------------------------------------------


def fsck(cache_dir: str, *, repair: bool) -> Report:
    cache_dir = os.path.abspath(cache_dir)
    if not os.path.isdir(cache_dir):
        raise FsckRefused(f"cache dir {cache_dir} does not exist")
    if not set(ENTRIES) & set(os.listdir(cache_dir)):
        raise FsckRefused(f"{cache_dir} is not a tierfs cache dir (no index, journal or chunks)")
    report = Report(cache_dir, repair)
    fd = lock(cache_dir)
    try:
        # the journal first: a damaged one makes a mount refuse, and the index repair
        # (which opens the store as a mount does) needs a readable journal
        index = Layout(cache_dir).index
        problem = probe_index(index)
        check_journal(cache_dir, report, problem is None and _marked(index))
        check_index(cache_dir, report, problem)
    finally:
        os.close(fd)
    return report


def _index_chunk_format(env: lmdb.Environment) -> int:
    try:
        info = env.open_db(INFO, create=False)
    except lmdb.NotFoundError:
        return 1
    with env.begin(db=info) as txn:
        return chunk_format(txn.get(CHUNK_FORMAT_KEY))


def _marked(index: str) -> bool:
    """Whether a healthy index says this cache dir has a journal."""
    if not os.path.exists(os.path.join(index, "data.mdb")):
        return False
    env = lmdb.open(index, max_dbs=16, readonly=True, lock=False, readahead=False)
    try:
        try:
            info = env.open_db(INFO, create=False)
        except lmdb.NotFoundError:
            return False
        with env.begin(db=info) as txn:
            return txn.get(JOURNAL) is not None
    finally:
        env.close()


def _run(args: argparse.Namespace) -> int:
    logging.getLogger("tierfs").addHandler(logging.NullHandler())  # the report says it all
    try:
        report = fsck(args.cache_dir, repair=args.repair)
    except FsckRefused as exc:
        sys.stderr.write(f"tierfs: error: {exc}\n")
        return USAGE
    except TierfsError as exc:  # a repair that could not be done (the store would not open)
        sys.stderr.write(f"tierfs: error: {exc}\n")
        return PROBLEMS
    except (OSError, lmdb.Error) as exc:  # the dir cannot be read (or written, for --repair)
        where = f": {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        sys.stderr.write(f"tierfs: error: cannot check {args.cache_dir}: {text}{where}\n")
        return USAGE
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        for p in report.problems:
            print(p.line())
        print(report.summary())
    return report.status()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fsck", help="check (and with --repair fix) a cache dir; the mount "
                                    "must be stopped",
                       description="Check a stopped mount's cache dir: the write-back journal "
                                   "against the staging files, the chunk index against the "
                                   "chunk files (sizes, CRCs). One line per problem, then a "
                                   "summary. Exit 0 clean, 1 problems remain, 2 bad usage or "
                                   "a dir that cannot be checked (see docs/operations.md).")
    f.add_argument("--cache-dir", required=True, metavar="DIR", help="the cache dir to check")
    f.add_argument("--repair", action="store_true",
                   help="fix what can be fixed (never deletes unsaved writes)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.set_defaults(run=_run)

