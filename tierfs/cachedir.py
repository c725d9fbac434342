"""The cache directory: private to the daemon's user, and held by one daemon at a time.

Everything in it - chunk files, the LMDB index, the write-back journal and staging files,
tierfs.log, the lock - is bucket data or tells about it, and the mount's own permission
checks (no allow_other, default_permissions) mean nothing if another local user can read
it here. So: the directory is 0700 and every file 0600. New files get that from the
process umask (`private_umask`, set by `prepare_cache_dir` before anything is created,
and `UMask=0077` in the systemd units) instead of a mode argument at each of the places
that create files; at every mount `prepare_cache_dir` makes the directory private again
and, when it was not (a cache made by an older tierfs, or chmod'ed by hand), tightens
everything below it with one WARNING. A cache dir that another non-root user owns is
refused: that user could read, replace or plant anything in it.

`Layout` is the one place that spells the names inside a cache dir: the daemon, fsck and
gc all find things through it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from .errors import StartupError

log = logging.getLogger(__name__)

# the entries of a cache dir (the chunk files' format is versioned in the index itself:
# tierfs/index/chunks.py, CHUNK_FORMAT)
CHUNKS = "chunks"  # chunk files, CHUNKS/<first 2 hex digits>/<chunk name>
TMP = "tmp"  # chunk files being written, renamed into CHUNKS when complete
DIRTY = "dirty"  # staging files of files written through the mount (tierfs/writeback)
INDEX = "index"  # the LMDB index (tierfs/index)
JOURNAL = "journal"  # the write-back journal (tierfs/index/journal.py)
LOCK = "lock"  # held by the one daemon (or fsck) using the dir
LOG = "tierfs.log"  # the daemon's log when it runs in the background
LOST_FOUND = "lost+found"  # what fsck --repair moved out of the way
ENTRIES = (LOCK, INDEX, JOURNAL, CHUNKS, DIRTY)  # a folder with one of these is a cache dir


class Layout:
    """The paths inside one cache dir."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.chunks = os.path.join(root, CHUNKS)
        self.tmp = os.path.join(root, TMP)
        self.dirty = os.path.join(root, DIRTY)
        self.index = os.path.join(root, INDEX)
        self.journal = os.path.join(root, JOURNAL)
        self.lock = os.path.join(root, LOCK)
        self.log = os.path.join(root, LOG)
        self.lost_found = os.path.join(root, LOST_FOUND)

    def chunk_file(self, name: str) -> str:
        return os.path.join(self.chunks, name[:2], name)

    def tmp_file(self, name: str) -> str:
        return os.path.join(self.tmp, name)

UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_umask() -> None:
    """Files and folders this process creates are its user's alone (0600 / 0700)."""
    os.umask(UMASK)


def prepare_cache_dir(path: str) -> None:
    """Create the cache dir (0700) or check and tighten an existing one, and prove it is
    writable. StartupError (one line) if it cannot be used. Sets the umask first: every
    path to a mount (the background parent, whose daemon child inherits it, and the
    daemon itself) passes here before it creates a cache or log file."""
    private_umask()
    try:
        st = os.stat(path)  # a symlink to the real place (/var/cache/tierfs -> /nvme) is fine
    except FileNotFoundError:
        try:
            os.makedirs(path, mode=DIR_MODE)
            st = os.stat(path)
        except OSError as exc:
            raise StartupError(f"cache dir {path} cannot be created: {exc.strerror}") from None
    except OSError as exc:
        raise StartupError(f"cache dir {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"cache dir {path} is not a directory")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise StartupError(f"cache dir {path} belongs to uid {st.st_uid}, not to this user "
                           f"(uid {me}): another user could read and change the cache; "
                           "use a cache dir of your own")
    if st.st_uid == me and stat.S_IMODE(st.st_mode) & ~DIR_MODE & 0o777:
        fixed = tighten(path)
        log.warning("cache dir %s was open to other users (mode %04o); made it private: "
                    "%d entries set to 0700 (folders) / 0600 (files)", path,
                    stat.S_IMODE(st.st_mode), fixed)
    try:
        probe = os.path.join(path, ".write-test")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(f"cache dir {path} is not writable: {exc.strerror}") from None


def tighten(path: str) -> int:
    """Make the cache dir and everything below it that this user owns private; the number
    of entries changed. Symlinks are not followed (nothing in a cache dir is one). Only
    needed when the top was open: below a 0700 folder no other user reaches anything, so
    a private cache dir is not walked at every mount (it may hold millions of chunks)."""
    me = os.geteuid()
    changed = _private(path, DIR_MODE, me)
    for top, dirs, files in os.walk(path, followlinks=False):
        for name in dirs:
            changed += _private(os.path.join(top, name), DIR_MODE, me)
        for name in files:
            changed += _private(os.path.join(top, name), FILE_MODE, me)
    return changed


def _private(path: str, mode: int, me: int) -> int:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != me or not stat.S_IMODE(st.st_mode) & 0o077:
            return 0
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode, follow_symlinks=False)
    except (FileNotFoundError, NotImplementedError):
        return 0
    except OSError as exc:
        raise StartupError(f"cache dir: cannot make {path} private: {exc.strerror}") from None
    return 1


def lock_cache_dir(path: str) -> int:
    """Prepare and lock the cache dir for this daemon; returns the lock fd (held for
    life). A second daemon on the same dir is one error line naming the first one's pid."""
    prepare_cache_dir(path)
    try:
        fd = os.open(Layout(path).lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        raise StartupError(f"cache dir {path}: cannot open its lock file: "
                           f"{exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartupError(f"cache dir {path} is in use by another tierfs (pid {owner})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
