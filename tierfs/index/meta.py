"""MetaStore: the one LMDB environment of a cache directory.

Named databases (keys are ordered binary, big-endian integers first):
  info      schema version, inode counter, the source this cache dir belongs to
  inodes    ino -> Inode record (kind, size, mtime, etag, key, parent, validated_at)
  dentries  parent ino + name (utf-8) -> child ino; a cursor over one parent gives a
            directory's children in stable byte order
  dirs      dir ino -> time its complete listing was stored
  chunks    object id (16 bytes) + chunk index (u32) -> length, heat, last access, CRC32Cs;
            what the CRCs are is CHUNK_FORMAT, kept in info: records of another format are
            dropped at open (their files become orphans that ChunkCache.recover deletes)
  objects   object id -> bucket, key, etag, size (for reports and evict-by-path)
  attrs     ino -> tierfs.index.attrs.Attrs as JSON: what S3 listings do not carry (mode, owner,
            times, rdev, a symlink's target), set through this mount or read from object
            metadata by HEAD
  pins      owner ("job:42", "manual") -> JSON {expires, objects: {oid hex: size}}:
            what `tierfs warm --pin` keeps from eviction, kept across restarts
  usage     "tenant/<name>" or "reader/<job:N|pod:UID|uid:N>" -> JSON Tally (tierfs.telemetry.usage):
            bytes read by source and stall seconds, kept across restarts
  capacity  "5m/" or "1h/" + step (u64) -> JSON sample of the cache (tierfs.telemetry.capacity):
            the downsampled history behind `tierfs usage --forecast`
  analytics "prefix/<prefix>", "job/<id>", "series/<tier>/<step>", "totals" -> JSON
            (tierfs.telemetry.analytics): per-prefix reads and metadata requests, the files each
            Slurm job read, the downsampled totals behind `tierfs report`

Every method is one short synchronous transaction; callers never await inside one.
Inode numbers are allocated once per (parent, name, kind) and persist, so they are
stable across daemon restarts.

The write-back journal (unsaved writes, multipart uploads under way) is not in this
environment: it is CACHE_DIR/journal (tierfs.index.journal), so that everything here stays a
re-derivable cache that may be thrown away. MetaStore keeps the journal's methods
(put_dirty, dirty_records, put_upload, ...) and forwards them; an old cache dir's `dirty`
and `uploads` databases are moved into the journal when it is opened.

Damage: a damaged LMDB file can kill the process that reads it (SIGBUS on a truncated
file, SIGABRT on a garbage page), so before opening an existing index MetaStore checks
its meta pages and walks every database in a child process (`python -m tierfs.index.meta
--probe DIR`; the daemon starts that child early, beside its bucket check, with
`start_probe`). A damaged index (or one of another schema) is moved aside to
index.damaged-<time> with one WARNING, and a new one starts empty; a second child salvages
what it still can from the old one (chunk records, whose files ChunkCache.recover then
re-adopts when their sizes match - every read verifies their CRCs as always - pins).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import lmdb

from .attrs import DIR, FILE, SPECIAL, SYMLINK, Attrs
from ..errors import StartupError
from .journal import JOURNAL_NAME, RECOVERY_HINT, Journal, JournalDamaged

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
ROOT_INO = 1

_U64 = struct.Struct(">Q")
_INODE = struct.Struct("<BQQddH")  # kind, parent, size, mtime, validated_at, len(etag)
_CHUNK = struct.Struct("<Idd")  # length, heat, last access; then one CRC per block
# what ChunkRecord.crcs are (tierfs.cache.disk computes them): 1 zlib CRC32 (before the
# key existed in info), 2 CRC32C. A chunk record is only ever checked with its own kind.
CHUNK_FORMAT = 2


@dataclass
class Inode:
    ino: int
    parent: int
    kind: int  # DIR, FILE, SYMLINK or a special file (tierfs.index.attrs)
    size: int
    mtime: float
    etag: str  # "" for directories
    key: str  # full object key (directories: the prefix, ending with "/"; root: "")
    validated_at: float  # last time a LIST/HEAD confirmed this entry
    attrs: Attrs = field(default_factory=Attrs)  # from the attrs DB, not packed here
    linked: bool = True  # False once its name is gone (unlinked, replaced): nlink 0

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    def pack(self) -> bytes:
        etag = self.etag.encode()
        return (_INODE.pack(self.kind, self.parent, self.size, self.mtime, self.validated_at,
                            len(etag)) + etag + self.key.encode())

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> "Inode":
        kind, parent, size, mtime, validated_at, elen = _INODE.unpack_from(raw)
        off = _INODE.size
        etag = bytes(raw[off:off + elen]).decode()
        key = bytes(raw[off + elen:]).decode()
        return cls(ino, parent, kind, size, mtime, etag, key, validated_at)


@dataclass
class ChunkRecord:
    length: int
    heat: float
    last_access: float
    crcs: tuple[int, ...]  # CRC32C (CHUNK_FORMAT) of each checksum block of the chunk file

    def pack(self) -> bytes:
        return (_CHUNK.pack(self.length, self.heat, self.last_access)
                + struct.pack(f"<{len(self.crcs)}I", *self.crcs))

    @classmethod
    def unpack(cls, raw: bytes) -> "ChunkRecord":
        length, heat, last = _CHUNK.unpack_from(raw)
        n = (len(raw) - _CHUNK.size) // 4
        return cls(length, heat, last, struct.unpack_from(f"<{n}I", raw, _CHUNK.size))


def _u64(n: int) -> bytes:
    return _U64.pack(n)


def chunk_format(raw: bytes | None) -> int:
    """CHUNK_FORMAT of an index from its info value (none: an index older than the key)."""
    try:
        return int(raw) if raw is not None else 1
    except ValueError:
        return -1


# ---- checking an index without risking a signal -------------------------------------------

PROBE_TIMEOUT_S = 120.0  # a walk of millions of records takes seconds; a loop in garbage, forever
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_VERSION = 1  # MDB_DATA_VERSION of LMDB 0.9 (py-lmdb bundles it)
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_PAGE_HDR = struct.Struct("<QHHI")  # pgno, pad, flags, lower/upper
_META = struct.Struct("<IIQQ")  # magic, version, address, map size
_DB = struct.Struct("<IHHQQQQQ")  # pad (page size in FREE_DBI), flags, depth, pages.., root
_TAIL = struct.Struct("<QQ")  # last page used, txn id
_SALVAGE_ORDER = (b"info", b"dirty", b"uploads", b"pins", b"objects", b"chunks")
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
    """Start `python -m tierfs.index.meta ARGS` (stdout and stderr piped)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "tierfs.index.meta", *args], env=env,
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
    """Run `python -m tierfs.index.meta ARGS`: (exit status or None on timeout, stdout, last
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


def _staging_files(cache_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(os.path.join(cache_dir, "dirty")))
    except FileNotFoundError:
        return []


# ---- the store ------------------------------------------------------------------------------


class MetaStore:
    def __init__(self, path: str, source: str, *, map_size: int = 16 << 30,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.path = path
        self._subdirs: dict[int, int] = {}  # dir ino -> subdirectories in the index
        cache_dir = os.path.dirname(os.path.abspath(path))
        jpath = os.path.join(cache_dir, JOURNAL_NAME)
        # a damaged journal is the first thing to know: nothing else is touched then
        self.journal: Journal | None = Journal.open(jpath) if os.path.exists(jpath) else None
        try:
            self._open(path, source, map_size, probe_timeout_s, cache_dir, jpath)
        except BaseException:
            if self.journal is not None:
                self.journal.close()
            raise

    def _open(self, path: str, source: str, map_size: int, probe_timeout_s: float,
              cache_dir: str, jpath: str) -> None:
        existed = os.path.exists(os.path.join(path, "data.mdb"))
        salvage: Salvage | None = None
        problem = probe_index(path, probe_timeout_s) if existed else None
        if problem is not None:
            aside = set_aside(path)
            salvage = salvage_index(aside, probe_timeout_s)
            log.warning("cache index %s is damaged (%s): moved to %s; the cache starts "
                        "empty (%d chunk records salvaged)", path, problem, aside,
                        len(salvage.records.get(b"chunks", ())))
        self._open_env(path, map_size)
        version = self._schema()
        if version is not None and version != SCHEMA_VERSION:
            self.env.close()
            aside = set_aside(path)
            log.warning("cache index %s has schema %d, this tierfs reads %d: moved to %s; "
                        "the cache starts empty", path, version, SCHEMA_VERSION, aside)
            self._open_env(path, map_size)
        fresh = self._check_identity(source)
        self._check_chunk_format()
        if self.journal is None:
            self.journal = self._first_journal(jpath, cache_dir, fresh, salvage)
        else:
            self._migrate_legacy(self.journal, None)
        if fresh:
            self._restore_journaled()
            if salvage is not None:
                self._apply_salvage(salvage)
        with self.env.begin(write=True, db=self._info) as txn:
            txn.put(b"journal", b"1")  # from now on a missing journal is a loss, not old age

    def _open_env(self, path: str, map_size: int) -> None:
        os.makedirs(path, exist_ok=True)
        try:
            # metasync off: a system crash may undo the last transaction but never corrupts;
            # everything stored here is either re-derivable or re-verified by checksum.
            self.env = lmdb.open(path, map_size=map_size, max_dbs=16, metasync=False,
                                 readahead=False)
            self._open_dbs()
        except lmdb.Error as exc:
            raise StartupError(f"cannot open the cache index in {path}: {exc}") from None

    def _open_dbs(self) -> None:
        self._info = self.env.open_db(b"info")
        self._inodes = self.env.open_db(b"inodes")
        self._dentries = self.env.open_db(b"dentries")
        self._dirs = self.env.open_db(b"dirs")
        self._chunks = self.env.open_db(b"chunks")
        self._objects = self.env.open_db(b"objects")
        self._attrs = self.env.open_db(b"attrs")
        self._pins = self.env.open_db(b"pins")
        self._usage = self.env.open_db(b"usage")
        self._capacity = self.env.open_db(b"capacity")
        self._analytics = self.env.open_db(b"analytics")

    def _schema(self) -> int | None:
        with self.env.begin(db=self._info) as txn:
            raw = txn.get(b"schema")
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return -1

    def _check_identity(self, source: str) -> bool:
        """Bind a new index to its source (True), or check an existing one's (False)."""
        with self.env.begin(write=True) as txn:
            version = txn.get(b"schema", db=self._info)
            owner = txn.get(b"source", db=self._info)
            if version is None:
                txn.put(b"schema", str(SCHEMA_VERSION).encode(), db=self._info)
                txn.put(b"source", source.encode(), db=self._info)
                # numbers of journaled files stay theirs: a new index never hands them out
                first = max(ROOT_INO + 1, (self.journal.max_ino() + 1) if self.journal else 0)
                txn.put(b"next_ino", _u64(first), db=self._info)
                root = Inode(ROOT_INO, ROOT_INO, DIR, 0, 0.0, "", "", 0.0)
                txn.put(_u64(ROOT_INO), root.pack(), db=self._inodes)
                return True
            if owner is not None and owner.decode() != source:
                raise StartupError(f"cache dir belongs to {owner.decode()}, not {source}: "
                                   "use another --cache-dir")
            return False

    # ---- the journal's start --------------------------------------------------------------

    def _first_journal(self, jpath: str, cache_dir: str, fresh: bool,
                       salvage: Salvage | None) -> Journal:
        """Create the journal of a cache dir that has none: new, or made by a tierfs that
        kept the journal in the index (its `dirty` and `uploads` databases move over)."""
        hint = RECOVERY_HINT.format(dir=cache_dir)
        if not fresh:
            with self.env.begin(db=self._info) as txn:
                marked = txn.get(b"journal") is not None
            if marked:
                raise JournalDamaged(f"the write-back journal {jpath} is missing; it may have "
                                     f"held unsaved writes: {hint}")
            journal = Journal.open(jpath)
            self._migrate_legacy(journal, None)
            return journal
        staged = _staging_files(cache_dir)
        if salvage is not None:
            marked = any(k == b"journal" for k, _ in salvage.records.get(b"info", ()))
            whole = {b"info", b"dirty", b"uploads"} <= salvage.complete
            if staged and (marked or not whole):
                raise JournalDamaged(
                    f"the write-back journal {jpath} is missing and the damaged index could "
                    f"not tell which of the {len(staged)} staging files in "
                    f"{os.path.join(cache_dir, 'dirty')} are unsaved writes: {hint}")
            journal = Journal.open(jpath)
            self._migrate_legacy(journal, salvage)
            return journal
        if staged:
            raise JournalDamaged(
                f"the write-back journal {jpath} and the cache index are missing, and "
                f"{os.path.join(cache_dir, 'dirty')} holds {len(staged)} staging files that "
                f"may be unsaved writes: {hint}")
        return Journal.open(jpath)

    def _migrate_legacy(self, journal: Journal, salvage: Salvage | None) -> None:
        """Move an older index's journal databases (`dirty`, `uploads`) into the journal:
        written there (fsynced) before they are dropped here, so a crash repeats it."""
        if salvage is not None:
            dirty = salvage.records.get(b"dirty", [])
            uploads = salvage.records.get(b"uploads", [])
        else:
            dirty, uploads = self._legacy_records()
        moved = 0
        for k, v in dirty:
            try:
                ino, record = _U64.unpack(k)[0], json.loads(v)
            except (struct.error, ValueError):
                log.error("write-back journal of the old index: an unreadable record was "
                          "left in %s", self.path)
                continue
            journal.put_dirty(ino, record, self._chain(ino) if salvage is None else [])
            moved += 1
        for k, v in uploads:
            journal.put_upload(bytes(k).decode(errors="replace"), bytes(v).decode(errors="replace"))
        if salvage is None and (dirty or uploads):
            with self.env.begin(write=True) as txn:
                for name in (b"dirty", b"uploads"):
                    txn.drop(self.env.open_db(name, txn=txn), delete=True)
        if moved:
            log.info("moved %d journaled files from the cache index to %s", moved, journal.path)

    def _legacy_records(self) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]]:
        out: list[list[tuple[bytes, bytes]]] = []
        for name in (b"dirty", b"uploads"):
            try:
                db = self.env.open_db(name, create=False)
            except lmdb.NotFoundError:
                out.append([])
                continue
            with self.env.begin(db=db) as txn:
                out.append([(bytes(k), bytes(v)) for k, v in txn.cursor()])
        return out[0], out[1]

    def _restore_journaled(self) -> None:
        """A new index gets the inodes of journaled files back, with their numbers and the
        directories above them: the name still leads to the unsaved bytes, and no other
        file can be given their numbers."""
        assert self.journal is not None
        records = dict(self.journal.dirty_records())
        with self.env.begin(write=True) as txn:
            for ino, chain in self.journal.dirty_paths().items():
                for cino, parent, kind, key in chain:
                    cino, parent = int(cino), int(parent)
                    if txn.get(_u64(cino), db=self._inodes) is None:
                        size = int(records[ino].get("size", 0)) if cino == ino else 0
                        node = Inode(cino, parent, int(kind), size, time.time(), "", key, 0.0)
                        txn.put(_u64(cino), node.pack(), db=self._inodes)
                    name = key.rstrip("/").rpartition("/")[2].encode()
                    txn.put(_u64(parent) + name, _u64(cino), db=self._dentries, overwrite=False)

    def _apply_salvage(self, salvage: Salvage) -> None:
        """What a damaged index still yields: chunk records (ChunkCache.recover re-adopts
        the files whose size matches; reads verify every block), object info, pins."""
        info = dict(salvage.records.get(b"info", ()))
        same_format = chunk_format(info.get(b"chunk_format")) == CHUNK_FORMAT
        with self.env.begin(write=True) as txn:
            for k, v in salvage.records.get(b"chunks", ()) if same_format else ():
                try:
                    rec = ChunkRecord.unpack(v)
                except struct.error:
                    continue
                if len(k) == 20 and (len(v) - _CHUNK.size) % 4 == 0 and rec.length > 0:
                    txn.put(k, v, db=self._chunks)
            for db, name in ((self._objects, b"objects"), (self._pins, b"pins")):
                for k, v in salvage.records.get(name, ()):
                    try:
                        if isinstance(json.loads(v), dict):
                            txn.put(k, v, db=db)
                    except ValueError:
                        continue

    def _chain(self, ino: int) -> list[list]:
        """[ino, parent, kind, key] of a file and the directories above it, root first."""
        out = []
        seen = set()
        with self.env.begin() as txn:
            cur = ino
            while cur != ROOT_INO and cur not in seen:
                raw = txn.get(_u64(cur), db=self._inodes)
                if raw is None:
                    break
                node = Inode.unpack(cur, raw)
                out.append([cur, node.parent, node.kind, node.key])
                seen.add(cur)
                cur = node.parent
        return out[::-1]

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        if self.journal is not None:
            self.journal.close()

    # ---- namespace -------------------------------------------------------------------

    def _load(self, txn: lmdb.Transaction, ino: int) -> Inode | None:
        raw = txn.get(_u64(ino), db=self._inodes)
        if raw is None:
            return None
        node = Inode.unpack(ino, raw)
        attrs = txn.get(_u64(ino), db=self._attrs)
        if attrs is not None:
            node.attrs = Attrs.from_json(attrs)
        if ino != ROOT_INO:
            name = node.key.rstrip("/").rpartition("/")[2].encode()
            node.linked = txn.get(_u64(node.parent) + name, db=self._dentries) == _u64(ino)
        return node

    def inode(self, ino: int) -> Inode | None:
        with self.env.begin() as txn:
            return self._load(txn, ino)

    def child(self, parent: int, name: bytes) -> Inode | None:
        with self.env.begin() as txn:
            ino = txn.get(_u64(parent) + name, db=self._dentries)
            return self._load(txn, _U64.unpack(ino)[0]) if ino is not None else None

    def children(self, parent: int) -> list[tuple[bytes, Inode]]:
        """All children in stable (byte) order."""
        prefix = _u64(parent)
        out = []
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._dentries)
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    node = self._load(txn, _U64.unpack(v)[0])
                    if node is not None:
                        out.append((bytes(k[8:]), node))
        return out

    def dir_listed_at(self, ino: int) -> float | None:
        with self.env.begin(db=self._dirs) as txn:
            raw = txn.get(_u64(ino))
        return struct.unpack("<d", raw)[0] if raw is not None else None

    def subdirs(self, ino: int) -> int:
        """How many subdirectories the index holds for a directory (its nlink - 2),
        remembered until one of its entries changes."""
        count = self._subdirs.get(ino)
        if count is None:
            count = sum(1 for _, node in self.children(ino) if node.kind == DIR)
            self._subdirs[ino] = count
        return count

    def _upsert(self, txn: lmdb.Transaction, parent: int, name: bytes, kind: int, size: int,
                mtime: float, etag: str, key: str, now: float,
                attrs: Attrs | None = None) -> Inode:
        self._subdirs.pop(parent, None)
        dkey = _u64(parent) + name
        raw_ino = txn.get(dkey, db=self._dentries)
        ino = None
        if raw_ino is not None:
            ino = _U64.unpack(raw_ino)[0]
            raw_old = txn.get(raw_ino, db=self._inodes)
            old = Inode.unpack(ino, raw_old) if raw_old is not None else None
            # a listing shows a symlink or a special file as a plain object: the same
            # version keeps the kind its metadata gave it
            if (old is not None and (old.kind == SYMLINK or old.kind in SPECIAL)
                    and kind == FILE and old.etag == etag):
                kind = old.kind
            # a name that changed kind gets a new inode: the kernel caches an inode's type
            if old is None or old.kind != kind:
                ino = None
            elif kind == DIR:
                mtime = old.mtime  # a prefix's time is when it was first seen, not listed
        if ino is None:
            ino = _U64.unpack(txn.get(b"next_ino", db=self._info))[0]
            txn.put(b"next_ino", _u64(ino + 1), db=self._info)
            txn.put(dkey, _u64(ino), db=self._dentries)
        node = Inode(ino, parent, kind, size, mtime, etag, key, now)
        txn.put(_u64(ino), node.pack(), db=self._inodes)
        if attrs is not None:
            txn.put(_u64(ino), attrs.to_json(), db=self._attrs)
            node.attrs = attrs
        else:
            raw = txn.get(_u64(ino), db=self._attrs)
            if raw is not None:
                node.attrs = Attrs.from_json(raw)
        return node

    def upsert(self, parent: int, name: bytes, kind: int, size: int, mtime: float, etag: str,
               key: str, now: float, attrs: Attrs | None = None,
               parent_attrs: Attrs | None = None) -> Inode:
        """Create or update the entry `name` of `parent`; attrs, when given, replace the
        node's, parent_attrs the parent's (its times: one transaction for both)."""
        with self.env.begin(write=True) as txn:
            if parent_attrs is not None:
                txn.put(_u64(parent), parent_attrs.to_json(), db=self._attrs)
            return self._upsert(txn, parent, name, kind, size, mtime, etag, key, now, attrs)

    def remove(self, parent: int, name: bytes) -> None:
        self._subdirs.pop(parent, None)
        with self.env.begin(write=True, db=self._dentries) as txn:
            txn.delete(_u64(parent) + name)

    def store_listing(self, parent: int, entries: Iterable[tuple[bytes, int, int, float, str, str]],
                      now: float, keep: Callable[[int], bool] = lambda ino: False,
                      since: float | None = None) -> None:
        """Replace a directory's children with a complete listing, in one transaction.

        entries: (name, kind, size, mtime, etag, key[, attrs]). Names no longer listed lose their
        dentry; their inode records stay so open handles and the kernel keep working.
        Entries for which keep(ino) is true (files with unsaved writes) are left alone:
        local writes win over what the bucket still shows. So are entries validated after
        `since` (when the LIST began): a listing never undoes what was learned after it
        started, such as an upload that finished while its pages were being read.
        """
        prefix = _u64(parent)
        self._subdirs.pop(parent, None)
        with self.env.begin(write=True) as txn:
            if since is not None:
                base_keep = keep

                def keep(ino: int) -> bool:  # noqa: F811 - widened on purpose
                    raw = txn.get(_u64(ino), db=self._inodes)
                    return base_keep(ino) or (
                        raw is not None and Inode.unpack(ino, raw).validated_at > since)
            seen = set()
            for entry in entries:
                name, kind, size, mtime, etag, key = entry[:6]
                seen.add(name)
                cur = txn.get(prefix + name, db=self._dentries)
                if cur is not None and keep(_U64.unpack(cur)[0]):
                    continue
                self._upsert(txn, parent, name, kind, size, mtime, etag, key, now,
                             entry[6] if len(entry) > 6 else None)
            cur = txn.cursor(db=self._dentries)
            stale = []
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    if bytes(k[8:]) not in seen and not keep(_U64.unpack(cur.value())[0]):
                        stale.append(bytes(k))
            for k in stale:
                txn.delete(k, db=self._dentries)
            txn.put(_u64(parent), struct.pack("<d", now), db=self._dirs)

    def set_validated(self, node: Inode, attrs: Attrs | None = None) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(_u64(node.ino), node.pack(), db=self._inodes)
            if attrs is not None:
                txn.put(_u64(node.ino), attrs.to_json(), db=self._attrs)

    def set_attrs(self, ino: int, attrs: Attrs) -> None:
        with self.env.begin(write=True, db=self._attrs) as txn:
            txn.put(_u64(ino), attrs.to_json())

    def move(self, node: Inode, new_parent: int, new_name: bytes, new_key: str) -> Inode:
        """Rename: the inode keeps its number under its new name (replacing any entry)."""
        old_name = node.key.rstrip("/").rpartition("/")[2].encode()
        self._subdirs.pop(node.parent, None)
        self._subdirs.pop(new_parent, None)
        with self.env.begin(write=True) as txn:
            txn.delete(_u64(node.parent) + old_name, db=self._dentries)
            txn.put(_u64(new_parent) + new_name, _u64(node.ino), db=self._dentries)
            node.parent, node.key = new_parent, new_key
            txn.put(_u64(node.ino), node.pack(), db=self._inodes)
            if node.kind == DIR:
                self._rekey_children(txn, node.ino, new_key)
                txn.delete(_u64(node.ino), db=self._dirs)
        return node

    def _rekey_children(self, txn: lmdb.Transaction, parent: int, prefix: str) -> None:
        """Give every descendant of a renamed directory its key under the new prefix."""
        start = _u64(parent)
        cur = txn.cursor(db=self._dentries)
        kids = []
        if cur.set_range(start):
            for k, v in cur:
                if not k.startswith(start):
                    break
                kids.append((bytes(k[8:]), _U64.unpack(v)[0]))
        for name, ino in kids:
            raw = txn.get(_u64(ino), db=self._inodes)
            if raw is None:
                continue
            child = Inode.unpack(ino, raw)
            child.key = prefix + name.decode() + ("/" if child.kind == DIR else "")
            child.validated_at = 0.0  # copies have new ETags: ask the bucket again
            txn.put(_u64(ino), child.pack(), db=self._inodes)
            if child.kind == DIR:
                self._rekey_children(txn, ino, child.key)
                txn.delete(_u64(ino), db=self._dirs)

    def forget_listing(self, ino: int) -> None:
        with self.env.begin(write=True, db=self._dirs) as txn:
            txn.delete(_u64(ino))

    # ---- write-back journal (kept in CACHE_DIR/journal, see tierfs.index.journal) -------------

    def put_dirty(self, ino: int, record: dict) -> None:
        """Journal a file's unsaved writes; durable (fsynced) when this returns. The inode
        chain above it goes along, for a new index to give the file its number back."""
        assert self.journal is not None
        self.journal.put_dirty(ino, record, self._chain(ino))

    def delete_dirty(self, ino: int) -> None:
        assert self.journal is not None
        self.journal.delete_dirty(ino)

    def put_upload(self, upload_id: str, key: str) -> None:
        assert self.journal is not None
        self.journal.put_upload(upload_id, key)

    def delete_upload(self, upload_id: str) -> None:
        assert self.journal is not None
        self.journal.delete_upload(upload_id)

    def uploads(self) -> list[tuple[str, str]]:
        assert self.journal is not None
        return self.journal.uploads()

    def dirty_records(self) -> list[tuple[int, dict]]:
        assert self.journal is not None
        return self.journal.dirty_records()

    # ---- pins ------------------------------------------------------------------------

    def put_pin(self, owner: str, record: dict | None) -> None:
        """Store (or with None delete) one owner's pins."""
        with self.env.begin(write=True, db=self._pins) as txn:
            if record is None:
                txn.delete(owner.encode())
            else:
                txn.put(owner.encode(), json.dumps(record).encode())

    def pins(self) -> list[tuple[str, dict]]:
        with self.env.begin(db=self._pins) as txn:
            return [(bytes(k).decode(), json.loads(v)) for k, v in txn.cursor()]

    # ---- usage -----------------------------------------------------------------------

    def put_usage(self, puts: dict[str, dict], deletes: Iterable[str] = ()) -> None:
        """Store usage records (tierfs.telemetry.usage) and delete others, in one transaction."""
        self._put_json(self._usage, puts, deletes)

    def usage(self) -> list[tuple[str, object]]:
        """Every stored usage record; a record that is not JSON comes back as None."""
        return self._json_records(self._usage)

    def _put_json(self, db: object, puts: dict[str, object], deletes: Iterable[str]) -> None:
        with self.env.begin(write=True, db=db) as txn:
            for key in deletes:
                txn.delete(key.encode())
            for key, record in puts.items():
                txn.put(key.encode(), json.dumps(record).encode())

    def _json_records(self, db: object, prefix: str = "") -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        start = prefix.encode()
        with self.env.begin(db=db) as txn:
            cur = txn.cursor()
            if not cur.set_range(start):
                return out
            for k, v in cur:
                if not bytes(k).startswith(start):
                    break
                try:
                    out.append((bytes(k).decode(), json.loads(v)))
                except ValueError:
                    out.append((bytes(k).decode(errors="replace"), None))
        return out

    # ---- access analytics (tierfs.telemetry.analytics) -----------------------------------------
    # bounded by the caller, which deletes what it no longer keeps at each put

    def put_analytics(self, puts: dict[str, object], deletes: Iterable[str] = ()) -> None:
        """Store analytics records and delete others, in one transaction."""
        self._put_json(self._analytics, puts, deletes)

    def analytics(self, prefix: str = "") -> list[tuple[str, object]]:
        """The analytics records whose keys start with `prefix`, in key order; a record
        that is not JSON comes back as None."""
        return self._json_records(self._analytics, prefix)

    def files(self) -> Iterator[tuple[str, int]]:
        """(key, size) of every file the index knows (from listings; the report's
        "total size" per prefix)."""
        with self.env.begin(db=self._inodes) as txn:
            for k, v in txn.cursor():
                node = Inode.unpack(0, v)
                if node.kind == FILE:
                    yield node.key, node.size

    # ---- capacity history (tierfs.telemetry.capacity) -----------------------------------------
    # tier name + "/" + u64 step -> JSON sample; bounded by the caller, which drops a
    # tier's steps older than it keeps at each put

    def put_capacity(self, tier: str, step: int, record: dict, *, drop_before: int) -> None:
        """Store one sample at its step of a tier (replacing the step's earlier one) and drop
        the tier's steps before `drop_before`, in one transaction."""
        prefix = tier.encode() + b"/"
        with self.env.begin(write=True, db=self._capacity) as txn:
            txn.put(prefix + _u64(step), json.dumps(record).encode())
            cur = txn.cursor()
            if cur.set_range(prefix):
                while cur.key()[:len(prefix)] == prefix and \
                        _U64.unpack(cur.key()[len(prefix):])[0] < drop_before:
                    if not cur.delete():
                        break

    def capacity(self, tier: str) -> list[tuple[int, dict]]:
        """A tier's samples, oldest first."""
        prefix = tier.encode() + b"/"
        out = []
        with self.env.begin(db=self._capacity) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for k, v in cur:
                    if bytes(k[:len(prefix)]) != prefix:
                        break
                    out.append((_U64.unpack(k[len(prefix):])[0], json.loads(v)))
        return out

    # ---- chunk index -----------------------------------------------------------------

    def _check_chunk_format(self) -> None:
        """Drop the chunk records of another CHUNK_FORMAT (their CRCs would fail every read,
        or worse, be read as the wrong kind): the chunks are fetched again. Nothing else
        in the index, and not the journal, is touched."""
        with self.env.begin(write=True) as txn:
            found = chunk_format(txn.get(b"chunk_format", db=self._info))
            if found == CHUNK_FORMAT:
                return
            dropped = txn.stat(self._chunks)["entries"]
            txn.drop(self._chunks, delete=False)
            txn.put(b"chunk_format", str(CHUNK_FORMAT).encode(), db=self._info)
        if dropped:
            log.info("cache index %s: %d chunk records of cache format %d dropped (this tierfs "
                     "checks format %d); their chunk files are deleted and fetched again",
                     self.path, dropped, found, CHUNK_FORMAT)

    def chunks(self) -> Iterator[tuple[bytes, ChunkRecord]]:
        with self.env.begin(db=self._chunks) as txn:
            for k, v in txn.cursor():
                yield bytes(k), ChunkRecord.unpack(v)

    def chunk(self, key: bytes) -> ChunkRecord | None:
        with self.env.begin(db=self._chunks) as txn:
            raw = txn.get(key)
        return ChunkRecord.unpack(raw) if raw is not None else None

    def apply_chunks(self, puts: dict[bytes, ChunkRecord], deletes: Iterable[bytes],
                     objects: dict[bytes, dict] | None = None) -> None:
        """One transaction for a batch of index changes (called from a worker thread)."""
        with self.env.begin(write=True) as txn:
            for k in deletes:
                txn.delete(k, db=self._chunks)
            for k, rec in puts.items():
                txn.put(k, rec.pack(), db=self._chunks)
            for oid, info in (objects or {}).items():
                txn.put(oid, json.dumps(info).encode(), db=self._objects)

    def object_info(self, oid: bytes) -> dict | None:
        with self.env.begin(db=self._objects) as txn:
            raw = txn.get(oid)
        return json.loads(raw) if raw is not None else None


def _main(argv: list[str]) -> int:
    """`python -m tierfs.index.meta --probe DIR | --salvage DIR`: the child side of probe_index
    and salvage_index (exit 0: read whole; a damaged file kills or fails this process)."""
    if len(argv) != 2 or argv[0] not in ("--probe", "--salvage"):
        sys.stderr.write("usage: python -m tierfs.index.meta --probe|--salvage INDEX_DIR\n")
        return 2
    try:
        return (_probe_main if argv[0] == "--probe" else _salvage_main)(argv[1])
    except lmdb.Error as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        return 3


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
