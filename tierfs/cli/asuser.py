"""Acting as another user: what a job's user can read, asked of the kernel as that user.

Root (slurmd's prolog) must not read, list, warm or pin for a job what the job's user could
not. Re-implementing the kernel's rules (modes, groups, ACLs, symlinks, `..` after a
symlink, FUSE's default_permissions, root-squashing network file systems) in root's process
is how such checks get bypassed, so every question is asked by a child that *is* the user:
forked while the parent has no other thread, it sets its groups, gid and uid (no way back:
checked), does the work and writes one JSON answer to a pipe. The parent waits until one
deadline and then kills it: nothing the user names (a FIFO, a hung FUSE mount of their own,
a huge tree, a symlink loop) keeps the parent past it. The child is not dumpable once its
uid changed (the kernel resets it), so the user cannot ptrace it to forge the answer; the
parent validates the answer's shape anyway (`Readable.from_json`).

`resolve` is the work itself: the paths and globs a job declared (on its comment and in its
manifests) turned into real paths under the allowed mount points that the user can read.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import json
import os
import select
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import read_manifest_fd
from ..errors import TierfsError, UsageError

MAX_MANIFESTS = 16  # per job
MAX_ITEMS = 100_000  # paths handed to the warm (a folder readable as a whole counts once)
MAX_REPLY = 64 << 20  # bytes of the child's answer
MAX_DEPTH = 256  # folders below a declared one; deeper is a loop or a mistake
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class AsUserError(TierfsError):
    """The work as the user could not be done (cannot drop privileges, the child died)."""


class DeadlineExceeded(AsUserError):
    """The child was still working at the deadline and was killed."""


@dataclass(frozen=True)
class Identity:
    """Who to act as: uid, primary gid and every supplementary group, and a name for
    messages."""

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def of(cls, user: str, uid: int, gid: int) -> "Identity":
        """The user's groups as the system lists them (initgroups' view); a uid without a
        passwd entry gets its primary group only."""
        try:
            groups = os.getgrouplist(user, gid)
        except (KeyError, OSError):
            groups = [gid]
        return cls(user, uid, gid, tuple(sorted(set(groups))))


def _become(who: Identity) -> None:
    """In the child: take the user's groups, gid and uid for good, then prove it."""
    if (os.getuid(), os.geteuid()) == (who.uid, who.uid) and who.uid != 0:
        return  # already the user (tests, or a hook run by hand as that user)
    if os.geteuid() != 0:
        raise AsUserError(f"cannot act as {who.user} (uid {who.uid}) without root")
    os.setgroups(list(who.groups) or [who.gid])
    os.setgid(who.gid)  # as root: real, effective and saved
    os.setuid(who.uid)
    if who.uid != 0:
        if os.getuid() != who.uid or os.geteuid() != who.uid or os.getegid() != who.gid:
            raise AsUserError(f"could not become {who.user}")
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise AsUserError(f"acting as {who.user}, root could be regained")


def run_as(who: Identity, work: Callable[[Any], Any], arg: Any, deadline: float) -> Any:
    """work(arg) in a forked child running as `who`; its JSON-able return value. The child
    is killed at `deadline` (time.monotonic()): DeadlineExceeded. An exception in the work
    comes back as AsUserError with its message (never a traceback)."""
    # fork() copies only the calling thread: a lock another thread held would stay locked
    # in the child forever. The hooks start no thread; say so loudly if that changes.
    if threading.active_count() != 1:
        raise AsUserError("internal: run_as needs a process without other threads")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller's code
        status = 0
        try:
            os.close(r)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.chdir("/")
            _become(who)
            reply: dict = {"ok": True, "result": work(arg)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
            reply = {"ok": False, "error": _one_line(exc)}
        try:
            data = json.dumps(reply).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:  # noqa: BLE001 - the parent sees a short answer
            status = 1
        os._exit(status)
    os.close(w)
    try:
        data = _read_until(r, deadline, pid)
    finally:
        os.close(r)
        _reap(pid)
    try:
        reply = json.loads(data)
    except ValueError:
        raise AsUserError(f"the check as {who.user} ended without an answer") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise AsUserError(f"the check as {who.user} gave a malformed answer")
    if not reply["ok"]:
        raise AsUserError(str(reply.get("error"))[:500])
    return reply.get("result")


def _read_until(fd: int, deadline: float, pid: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], left)[0] if left > 0 else []
        if not ready:
            _kill(pid)
            raise DeadlineExceeded("deadline")
        data = os.read(fd, 1 << 16)
        if not data:
            return b"".join(chunks)
        size += len(data)
        if size > MAX_REPLY:
            _kill(pid)
            raise AsUserError(f"the answer was larger than {MAX_REPLY} bytes")
        chunks.append(data)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int, wait_s: float = 1.0) -> None:
    """Collect the child. A child stuck in a hung file system may take a moment to die
    even after SIGKILL: wait briefly, then leave it (init reaps it once we exit)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > end:
            return
        time.sleep(0.01)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# ----------------------------------------------------------------------------- the work
@dataclass(frozen=True)
class Lookup:
    """What to resolve as the user: declared paths/globs, manifests naming more, and the
    mount points the results must lie under."""

    user: str
    paths: tuple[str, ...]
    manifests: tuple[str, ...]
    mounts: tuple[str, ...]
    max_items: int = MAX_ITEMS

    def to_json(self) -> dict:
        return {"user": self.user, "paths": list(self.paths), "manifests": list(self.manifests),
                "mounts": list(self.mounts), "max_items": self.max_items}


@dataclass(frozen=True)
class Readable:
    """The answer: real paths the user can read (files, or folders readable as a whole,
    which the warm then takes whole), and what was left out and why (one line each,
    naming only what the user could see)."""

    items: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    declared: int = 0  # paths named, on the comment and in manifests

    def to_json(self) -> dict:
        return {"type": "readable", "items": list(self.items), "problems": list(self.problems),
                "declared": self.declared}

    @classmethod
    def from_json(cls, data: Any) -> "Readable":
        """The child's answer, checked: a malformed one is an AsUserError, never trusted."""
        ok = (isinstance(data, dict) and data.get("type") == "readable"
              and isinstance(data.get("items"), list) and isinstance(data.get("problems"), list)
              and isinstance(data.get("declared"), int)
              and all(isinstance(x, str) for x in data["items"])
              and all(isinstance(x, str) for x in data["problems"]))
        if not ok:
            raise AsUserError("the check gave a malformed answer")
        return cls(tuple(data["items"]), tuple(data["problems"]), data["declared"])


def parse_manifest(text: str, origin: str) -> tuple[list[str], list[str]]:
    """(paths, errors) of a manifest: one absolute path or glob a line; lines starting with
    '#' and blank lines are skipped."""
    paths, errors = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("/"):
            paths.append(line)
        else:
            errors.append(f"{origin}:{number}: not an absolute path: {line!r}")
    return paths, errors


def search_root(path: str) -> str:
    """The part of a path or glob before its first pattern segment (the glob's parent
    folder: /data/in/train-*.tar -> /data/in); the path itself when it has no pattern."""
    parts = path.split("/")
    for i, seg in enumerate(parts):
        if glob.has_magic(seg):
            return "/".join(parts[:i]) or "/"
    return path


def resolve(request: dict) -> dict:
    """The work of the child (JSON in, JSON out): see Lookup and Readable."""
    look = Lookup(request["user"], tuple(request["paths"]), tuple(request["manifests"]),
                  tuple(request["mounts"]), int(request["max_items"]))
    return _Resolver(look).run().to_json()


@dataclass
class _Resolver:
    look: Lookup
    items: dict[str, None] = field(default_factory=dict)  # ordered set
    problems: list[str] = field(default_factory=list)

    def run(self) -> Readable:
        paths = list(self.look.paths)
        manifests = self.look.manifests
        if len(manifests) > MAX_MANIFESTS:
            self.problems.append(f"{len(manifests)} manifests, at most {MAX_MANIFESTS} are "
                                 "read: the rest are left out")
            manifests = manifests[:MAX_MANIFESTS]
        for manifest in manifests:
            try:
                more, errors = parse_manifest(self._read_manifest(manifest), manifest)
            except _Problem as exc:
                self.problems.append(str(exc))
                continue
            paths += more
            self.problems += errors
        paths = list(dict.fromkeys(paths))
        for path in paths:
            try:
                self._resolve(path)
            except _Problem as exc:
                self.problems.append(str(exc))
        items = _outermost(self.items)
        if len(items) > self.look.max_items:
            self.problems.append(f"the paths come to {len(items)} separate files and folders, "
                                 f"more than {self.look.max_items}: nothing warmed (name "
                                 "folders rather than their files)")
            items = []
        return Readable(tuple(items), tuple(dict.fromkeys(self.problems)), len(paths))

    # -- manifests
    def _read_manifest(self, path: str) -> str:
        """A manifest: a regular file (not a FIFO, a device or a socket), read to at most
        MANIFEST_MAX_BYTES. Opened non-blocking, so a FIFO cannot hold the open."""
        who = self.look.user
        try:
            real = os.path.realpath(path, strict=True)
            fd = os.open(real, _OPEN_FLAGS)
        except OSError as exc:
            raise _Problem(f"cannot read manifest {path} as {who}: {_why(exc)}") from None
        try:
            return read_manifest_fd(fd, path)
        except UsageError as exc:
            raise _Problem(str(exc)) from None
        except OSError as exc:
            raise _Problem(f"cannot read manifest {path} as {who}: {_why(exc)}") from None
        finally:
            os.close(fd)

    # -- paths and globs
    def _resolve(self, path: str) -> None:
        who = self.look.user
        root = search_root(path)
        rest = [s for s in path[len(root):].split("/") if s not in ("", ".")]
        if ".." in rest:
            raise _Problem(f"'..' after a pattern is not allowed: {path}")
        try:  # symlinks and `..` as the kernel resolves them for this user
            real_root = os.path.realpath(root, strict=True)
        except OSError as exc:
            raise _Problem(f"{_kind(exc)} for {who}: {path}") from None
        self._mount_of(real_root, path)
        if rest:
            matches = self._match(real_root, rest)
            if not matches:
                raise _Problem(f"matches nothing for {who}: {path}")
        else:
            matches = [real_root]
        walked: set[str] = set()  # `**` names every folder below one already walked: once
        for match in matches:
            try:
                real = os.path.realpath(match, strict=True)
                st = os.lstat(real)
            except OSError as exc:
                self.problems.append(f"{_kind(exc)} for {who}: {match}")
                continue
            if real in walked or _below(real, walked):
                continue
            try:
                self._mount_of(real, match)
            except _Problem as exc:
                self.problems.append(str(exc))
                continue
            if stat.S_ISDIR(st.st_mode):
                if not os.access(real, os.R_OK | os.X_OK):
                    self.problems.append(f"unreadable for {who}: {match}")
                    continue
                whole, below, left_out = self._walk(real, st.st_dev, 0)
                walked.add(real)
                if whole:
                    self.items[real] = None
                else:
                    self.items.update(dict.fromkeys(below))
                    if left_out[0]:
                        n = left_out[0]
                        self.problems.append(f"{n} {'entry' if n == 1 else 'entries'} below "
                                             f"{match} that {who} cannot read left out "
                                             f"(first: {left_out[1]})")
            elif stat.S_ISREG(st.st_mode):
                if os.access(real, os.R_OK):
                    self.items[real] = None
                else:
                    self.problems.append(f"unreadable for {who}: {match}")
            else:
                self.problems.append(f"not a file or folder: {match}")

    def _mount_of(self, real: str, declared: str) -> str:
        best = ""
        for m in self.look.mounts:
            if real == m or real.startswith(m.rstrip("/") + "/"):
                best = max(best, m, key=len)
        if not best:
            also = f" (it resolves to {real})" if real != declared else ""
            raise _Problem(f"not under a tierfs mount: {declared}{also}")
        return best

    def _match(self, base: str, segments: list[str]) -> list[str]:
        """Glob segments below base as the daemon matches them (fnmatch per segment, `*`
        matches dot files, `**` any depth of folders), listing as the user and never
        following a symlink on the way: what the user cannot list matches nothing."""
        frontier = [base]
        for i, seg in enumerate(segments):
            last = i == len(segments) - 1
            found: list[str] = []
            for d in frontier:
                if seg == "**":
                    found += self._dirs_below(d)
                elif glob.has_magic(seg):
                    for entry in _entries(d):
                        if fnmatch.fnmatchcase(entry.name, seg) and (last or _is_dir(entry)):
                            found.append(entry.path)
                else:
                    p = os.path.join(d, seg)
                    try:
                        st = os.lstat(p)
                    except OSError:
                        continue
                    if last or stat.S_ISDIR(st.st_mode):
                        found.append(p)
            frontier = list(dict.fromkeys(found))
        return frontier

    def _dirs_below(self, top: str) -> list[str]:
        out, level = [top], [top]
        for _ in range(MAX_DEPTH):
            level = [e.path for d in level for e in _entries(d) if _is_dir(e)]
            if not level:
                break
            out += level
        return out

    def _walk(self, path: str, dev: int, depth: int) -> tuple[bool, list[str], tuple[int, str]]:
        """(readable as a whole, the readable files and whole folders below, (count, first)
        of entries left out). Left-out entries are named from listings the user can read,
        so nothing is told that the user could not see; a folder it cannot list is one
        entry, whatever it holds."""
        if depth > MAX_DEPTH:
            return False, [], (1, path)
        try:
            entries = _scan(path)
        except OSError:
            return False, [], (1, path)
        whole, items, skipped, first = True, [], 0, ""
        below: list[str]
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    if entry.stat(follow_symlinks=False).st_dev != dev:  # a mount on a mount
                        ok, below, (n, f) = False, [], (1, entry.path)
                    else:
                        ok, below, (n, f) = self._walk(entry.path, dev, depth + 1)
                    whole &= ok
                    items += below
                    skipped, first = skipped + n, first or f
                elif entry.is_file(follow_symlinks=False):
                    if os.access(entry.path, os.R_OK):
                        items.append(entry.path)
                    else:
                        whole, skipped, first = False, skipped + 1, first or entry.path
                elif not entry.is_symlink():  # a link is warmed as the small object it is
                    whole, skipped, first = False, skipped + 1, first or entry.path
            except OSError:
                whole, skipped, first = False, skipped + 1, first or entry.path
        if whole:
            return True, [path], (0, "")
        return False, items, (skipped, first)


def _below(path: str, folders: set[str]) -> bool:
    """Whether path lies below one of the folders (all real paths)."""
    while folders and path != "/":
        path = os.path.dirname(path)
        if path in folders:
            return True
    return False


def _outermost(items: dict[str, None]) -> list[str]:
    """The items without those below another item (a folder taken whole covers them)."""
    folders = set(items)
    return [item for item in items if not _below(item, folders)]


class _Problem(Exception):
    """One line about one declared thing; the others go on."""


def _scan(path: str) -> list[os.DirEntry]:
    """A folder's entries in name order (the same answer, and the same first left-out
    entry, every time)."""
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


def _entries(path: str) -> list[os.DirEntry]:
    try:
        return _scan(path)
    except OSError:
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _kind(exc: OSError) -> str:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return "missing"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "unreadable"
    return exc.strerror or "error"


def _why(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symlink loop"
    return exc.strerror or str(exc)
