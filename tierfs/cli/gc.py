"""`tierfs gc [--dry-run] [--cache-root DIR] [--min-age DAYS] [--json]`: retire cache dirs.

(`tierfs gc --tier near MOUNTPOINT` is another collection: the near store of a running
mount, done by its daemon: tierfs/read/neargc.py. This module hands it over to ctl.py.)

Under the cache root (default /var/cache/tierfs, where a mount's cache dir is
`<root>/<id of source>`, config.MountConfig.effective_cache_dir) each cache dir is judged
on its own, holding its lock (`CACHE_DIR/lock`, taken non-blocking the way a daemon takes
it) so that no mount can start on it meanwhile:

- locked by a daemon: its source is mounted. Never touched.
- its write-back journal holds unsaved writes (journaled files) or multipart uploads a
  mount still has to abort, or cannot be read (damaged; or missing while staging files
  exist): kept whatever its age - dirty data is sacred. Staging files no journal record
  owns and tmp/ files are still removed when the journal is readable.
- not used for --min-age days (default 7): removed whole. "Used" is the newest mtime of
  the dir, its lock, index (data.mdb, lock.mdb), journal and tierfs.log: a mount writes
  the lock (its pid) and the dir (a write probe) at start, the index as reads change heat,
  the journal on writes, the log at start and stop. Not atime: NVMe file systems are
  often noatime/relatime, and backups or scans read without using the cache.
- otherwise: leftovers with nothing to upload are removed (staging files of writes never
  acknowledged, chunk files a crash left in tmp/; a mount deletes both at start too).

A dir is removed by renaming it to `<root>/.tierfs-gc-<name>` (atomic: a mount starting a
moment later makes a fresh dir) and then deleting that; one an interrupted gc left is
deleted by the next. Symlinks are never followed: a symlink in the root is skipped and
nothing below is walked through one. Entries that do not look like a cache dir, and
other users' dirs (unless gc runs as root), are skipped.

A root that does not exist (a node that never mounted with the default cache dir) has
nothing to collect: one line saying so, exit 0, so the daily timer
(systemd/tierfs-gc.timer) does not fail on such nodes.

One line per dir, then a total (--json: one object). Exit status: 0 (dirs kept for
unsaved writes included, and a missing root); 1 a dir could not be judged or removed; 2
bad usage or a root that is not a directory, or belongs to neither root nor the caller.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass, field

from ..cachedir import ENTRIES, INDEX, JOURNAL, LOCK, LOG, Layout
from ..config import format_size, parse_size, printable
from ..errors import TierfsError, UsageError
from ..index.journal import JournalState, scan_bytes
from ..mount.mountinfo import mounts

DEFAULT_ROOT = "/var/cache/tierfs"  # the folder of config's default cache dirs
DEFAULT_MIN_AGE_DAYS = 7.0
TRASH_PREFIX = ".tierfs-gc-"
DONE, FAILED, USAGE = 0, 1, 2
# what a mount writes as it is used (see the module doc); the dir itself counts too
_USE_MARKS = (LOCK, f"{INDEX}/data.mdb", f"{INDEX}/lock.mdb", JOURNAL, LOG)
# what makes a folder a tierfs cache dir: a daemon creates the lock before anything else
_CACHE_MARKS = ENTRIES


class GcRefused(TierfsError):
    """The cache root cannot be collected (missing, not a directory, someone else's)."""


@dataclass
class Verdict:
    """What gc did (or, in a dry run, would do) with one entry of the root."""

    path: str
    action: str  # remove, clean (leftovers only), keep, skip, error
    reason: str
    bytes: int = 0  # freed (in a dry run: would be freed)
    idle_days: float | None = None
    # kept whatever its age: its journal holds (or, unreadable, may hold) unsaved writes
    # or multipart uploads a mount still has to abort
    journal_kept: bool = False
    unsaved_files: int = 0
    unsaved_bytes: int = 0
    uploads: int = 0
    leftovers: list[str] = field(default_factory=list)

    def line(self, dry_run: bool) -> str:
        verb = self.action
        if self.action in _DONE_VERBS:
            verb = f"would {self.action}" if dry_run else _DONE_VERBS[self.action]
            verb += f" {format_size(self.bytes)}"
        return printable(f"{verb}: {self.path}: {self.reason}")


_DONE_VERBS = {"remove": "removed", "clean": "cleaned"}


@dataclass
class Report:
    root: str
    dry_run: bool
    min_age_days: float
    dirs: list[Verdict] = field(default_factory=list)
    missing: bool = False  # the root does not exist: nothing to collect

    def count(self, action: str) -> int:
        return sum(1 for v in self.dirs if v.action == action)

    @property
    def freed(self) -> int:
        return sum(v.bytes for v in self.dirs if v.action in ("remove", "clean"))

    @property
    def kept_unsaved(self) -> int:
        return sum(1 for v in self.dirs if v.journal_kept)

    def status(self) -> int:
        return FAILED if self.count("error") else DONE

    def summary(self) -> str:
        if self.missing:
            return printable(f"nothing to collect: cache root {self.root} does not exist "
                             "(no mount has made a cache dir there)")
        would = "would free" if self.dry_run else "freed"
        kept = self.count("keep") + self.count("clean")  # a cleaned dir stays
        return (f"total: {would} {format_size(self.freed)} ({self.freed} bytes) in "
                f"{self.count('remove')} dirs removed and {self.count('clean')} cleaned of "
                f"leftovers; {kept} kept ({self.kept_unsaved} for what their journal "
                f"holds), {self.count('skip')} skipped, {self.count('error')} errors"
                + (" (dry run: nothing changed)" if self.dry_run else ""))

    def as_json(self) -> dict:
        return {"root": self.root, "missing": self.missing, "dry_run": self.dry_run,
                "min_age_days": self.min_age_days,
                "dirs": [asdict(v) for v in self.dirs], "bytes_freed": self.freed,
                "removed": self.count("remove"), "cleaned": self.count("clean"),
                "kept": self.count("keep") + self.count("clean"),
                "kept_unsaved": self.kept_unsaved,
                "skipped": self.count("skip"), "errors": self.count("error")}


# ---- reading a cache dir -------------------------------------------------------------


def check_root(root: str) -> str:
    """The root, symlinks resolved (a root may be a link to the NVMe); GcRefused unless
    it is a directory owned by root or the caller."""
    real = os.path.realpath(root)
    try:
        st = os.stat(real)
    except OSError as exc:
        raise GcRefused(f"cache root {root}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise GcRefused(f"cache root {root} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise GcRefused(f"cache root {root} belongs to uid {st.st_uid}, neither root nor "
                        f"this user (uid {os.geteuid()}): not collected")
    return real


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def last_used(path: str) -> float:
    """The newest mtime of the dir and of what a mount writes in it (module doc)."""
    marks = [_lstat(os.path.join(path, m)) for m in _USE_MARKS]
    return max([os.lstat(path).st_mtime] + [st.st_mtime for st in marks if st is not None])


def tree_bytes(path: str) -> int:
    """Bytes allocated below path (sparse staging files count what they hold), without
    following symlinks."""
    st = os.lstat(path)
    total = st.st_blocks * 512
    if not stat.S_ISDIR(st.st_mode):
        return total
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def _entries(path: str) -> list[str]:
    """Names in a sub-folder of a cache dir (dirty/, tmp/); none if it is not a real one."""
    st = _lstat(path)
    return sorted(os.listdir(path)) if st is not None and stat.S_ISDIR(st.st_mode) else []


@dataclass
class JournalView:
    readable: bool  # False: damaged, or missing while staging files exist
    why: str = ""
    unsaved: int = 0  # journaled files
    owned: set[str] = field(default_factory=set)  # the staging file names they own
    uploads: int = 0


def read_journal(cache_dir: str, staged: list[str]) -> JournalView:
    path = Layout(cache_dir).journal
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if staged:  # an older tierfs kept the journal in the index: they may be unsaved
            return JournalView(False, f"no journal, and dirty/ holds {len(staged)} staging "
                                      "files that may be unsaved writes")
        return JournalView(True)
    with os.fdopen(fd, "rb") as f:
        scan = scan_bytes(f.read())
    state = JournalState()
    try:
        for _, op in scan.ops:
            state.apply(op)
    except (ValueError, KeyError, TypeError):
        return JournalView(False, "the write-back journal holds a record this tierfs cannot read")
    if not scan.clean:
        return JournalView(False, "the write-back journal is damaged and may hold unsaved writes")
    # every journaled file counts, even one whose record names no staging file we can read
    owned = {os.path.basename(str(e["record"].get("staging", "")))
             for e in state.dirty.values() if isinstance(e.get("record"), dict)}
    return JournalView(True, unsaved=len(state.dirty), owned=owned, uploads=len(state.uploads))


# ---- judging and removing --------------------------------------------------------------


def _lock(cache_dir: str, create: bool) -> int | None:
    """The cache dir's lock, taken non-blocking as a daemon takes it (cachedir.lock_cache_dir)
    but without writing our pid (that would mark the dir used). None: no lock file (and
    create is False). BlockingIOError: a daemon holds it."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(Layout(cache_dir).lock, flags, 0o600)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(cache_dir: str) -> str:
    try:
        with open(Layout(cache_dir).lock, "rb") as f:
            return f.read(32).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def judge(cache_dir: str, min_age_s: float, now: float, dry_run: bool, trash: str) -> Verdict:
    """Judge one cache dir under its lock and, unless dry_run, act on it."""
    try:
        fd = _lock(cache_dir, create=False)
        # under the lock no mount can use the dir any more; and before a lock file gc
        # creates (for a dir no daemon ever locked) changes the dir's mtime
        idle_s = now - last_used(cache_dir)
        if fd is None and not dry_run:
            fd = _lock(cache_dir, create=True)
    except BlockingIOError:
        return Verdict(cache_dir, "keep", f"in use by a running tierfs (pid {_holder(cache_dir)})"
                       ": its source is mounted")
    idle_days = round(idle_s / 86400, 2)
    try:
        return _judge_locked(cache_dir, idle_s, idle_days, min_age_s, dry_run, trash)
    finally:
        if fd is not None:
            os.close(fd)


def _judge_locked(cache_dir: str, idle_s: float, idle_days: float, min_age_s: float,
                  dry_run: bool, trash: str) -> Verdict:
    dirty_dir, tmp_dir = Layout(cache_dir).dirty, Layout(cache_dir).tmp
    staged = _entries(dirty_dir)
    journal = read_journal(cache_dir, staged)
    v = Verdict(cache_dir, "keep", "", idle_days=idle_days)
    if not journal.readable:
        v.journal_kept = True
        v.reason = (f"{journal.why}: never collected; check it with "
                    f"'tierfs fsck --cache-dir {cache_dir}'")
        return v
    v.unsaved_files, v.uploads = journal.unsaved, journal.uploads
    if not v.unsaved_files and not v.uploads and idle_s >= min_age_s:
        v.action, v.bytes = "remove", tree_bytes(cache_dir)
        v.reason = f"not mounted, last used {idle_days:g} days ago"
        if not dry_run:
            os.rename(cache_dir, trash)  # atomic: a mount starting now makes a fresh dir
            shutil.rmtree(trash)
        return v
    v.leftovers = ([os.path.join(dirty_dir, n) for n in staged if n not in journal.owned]
                   + [os.path.join(tmp_dir, n) for n in _entries(tmp_dir)])
    freed = sum(tree_bytes(p) for p in v.leftovers)
    if not dry_run:
        for p in v.leftovers:
            shutil.rmtree(p) if stat.S_ISDIR(os.lstat(p).st_mode) else os.unlink(p)
    if v.unsaved_files or v.uploads:
        v.journal_kept = True
        v.unsaved_bytes = sum(tree_bytes(os.path.join(dirty_dir, n)) for n in staged
                              if n in journal.owned)
        held = ([f"{v.unsaved_files} files with unsaved writes "
                 f"({format_size(v.unsaved_bytes)})"] if v.unsaved_files else []) \
            + ([f"{v.uploads} multipart uploads a mount must abort"] if v.uploads else [])
        v.reason = (f"its journal holds {' and '.join(held)}: never collected, whatever its "
                    "age (dirty data is sacred); mount it again to finish them")
    else:
        v.reason = f"not mounted, used {idle_days:g} days ago (< {min_age_s / 86400:g})"
    if v.leftovers:
        v.action, v.bytes = "clean", freed
        v.reason = (f"{len(v.leftovers)} staging/tmp leftovers with nothing to upload; "
                    f"the dir is kept: {v.reason}")
    return v


def _looks_like_cache_dir(path: str) -> bool:
    return any(_lstat(os.path.join(path, m)) is not None for m in _CACHE_MARKS)


def _entry(root: str, name: str, min_age_s: float, now: float, dry_run: bool,
           mounted: set[str]) -> Verdict | None:
    path = os.path.join(root, name)
    if any(m == path or m.startswith(path + "/") for m in mounted):
        # walking or deleting it would go into another file system (and even an lstat of
        # a hung FUSE mount point blocks): asked before anything touches it
        return Verdict(path, "skip", "a mount point is there or below it: not collected")
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return Verdict(path, "skip", "a symlink: not followed")
    if not stat.S_ISDIR(st.st_mode):
        return None  # a file in the root is nobody's cache dir: not a line of its own
    me = os.geteuid()
    if me != 0 and st.st_uid != me:
        return Verdict(path, "skip", f"belongs to uid {st.st_uid}, not to this user")
    if name.startswith(TRASH_PREFIX):  # renamed away by a gc that was interrupted
        v = Verdict(path, "remove", "left by an interrupted tierfs gc", tree_bytes(path))
        if not dry_run:
            shutil.rmtree(path)
        return v
    if not _looks_like_cache_dir(path):
        return Verdict(path, "skip", "not a tierfs cache dir")
    return judge(path, min_age_s, now, dry_run, os.path.join(root, TRASH_PREFIX + name))


def collect(root: str, min_age_days: float = DEFAULT_MIN_AGE_DAYS, dry_run: bool = False,
            now: float | None = None) -> Report:
    """Judge (and unless dry_run, collect) every entry of the cache root."""
    try:
        os.lstat(root)
    except FileNotFoundError:  # not ENOTDIR, EACCES...: those are check_root's errors
        return Report(root, dry_run, min_age_days, missing=True)
    except OSError:
        pass
    real = check_root(root)
    now = time.time() if now is None else now
    report = Report(real, dry_run, min_age_days)
    mounted = {m.mountpoint for m in mounts()}
    for name in sorted(os.listdir(real)):
        try:
            v = _entry(real, name, min_age_days * 86400, now, dry_run, mounted)
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            v = Verdict(os.path.join(real, name), "error",
                        f"cannot collect: {exc.strerror or exc}{where}")
        if v is not None:
            report.dirs.append(v)
    return report


# ---- the command -------------------------------------------------------------------------


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days") from None
    if not math.isfinite(days) or days < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of days >= 0")
    return days


def _run(args: argparse.Namespace) -> int:
    if args.tier == "near":
        if not args.mountpoint:
            raise UsageError("gc --tier near needs the MOUNTPOINT of a mount with --tier")
        from .ctl import near_gc

        budget = None if args.near_size is None else parse_size(args.near_size, "near-size")
        return near_gc(args.mountpoint, budget, args.dry_run, args.json)
    if args.mountpoint or args.near_size:
        raise UsageError("MOUNTPOINT and --near-size go with --tier near")
    try:
        report = collect(args.cache_root, args.min_age, args.dry_run)
    except GcRefused as exc:
        sys.stderr.write(f"tierfs: error: {printable(str(exc))}\n")
        return USAGE
    except OSError as exc:  # the root itself cannot be listed
        sys.stderr.write(printable(f"tierfs: error: cannot collect {args.cache_root}: "
                                   f"{exc.strerror or exc}") + "\n")
        return USAGE
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        for v in report.dirs:
            print(v.line(report.dry_run))
        print(report.summary())
    return report.status()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gc", help="remove cache dirs no mount uses any more, and leftovers",
                       description="Remove cache dirs under the cache root whose source is "
                                   "not mounted (no daemon holds their lock) and that were "
                                   "not used for --min-age days, and staging/tmp leftovers "
                                   "with nothing to upload. A dir whose journal holds unsaved "
                                   "writes is never removed. One line per dir, then a total "
                                   "(see docs/tenants.md).")
    g.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    g.add_argument("--cache-root", default=DEFAULT_ROOT, metavar="DIR",
                   help=f"the folder of the cache dirs (default {DEFAULT_ROOT})")
    g.add_argument("--min-age", type=_days, default=DEFAULT_MIN_AGE_DAYS, metavar="DAYS",
                   help="remove a dir only if not used for this many days (default 7)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--tier", choices=("local", "near"), default="local",
                   help="near: the near store of the mount at MOUNTPOINT: stale copies, then "
                        "the oldest over its near_size (docs/tiers.md)")
    g.add_argument("mountpoint", nargs="?", metavar="MOUNTPOINT", help="with --tier near")
    g.add_argument("--near-size", metavar="SIZE",
                   help="with --tier near: the budget (default the mount's near_size)")
    g.set_defaults(run=_run)
