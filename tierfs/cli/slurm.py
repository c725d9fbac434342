"""`tierfs slurm prolog|epilog`: warm and pin what a Slurm job declares, unpin at its end.

A job declares its data in its --comment, as whitespace-separated tokens that live beside
any other text of the comment (docs/slurm.md):

    tierfs:warm=/data/imagenet,/ckpt/run42     paths or globs, comma-separated, absolute
    tierfs:manifest=/home/alice/run42.warm     a manifest: one path or glob a line, # comments
    tierfs:warm=auto                           what the last run of this job name read here

The prolog runs as root, the job as its user: the hook is a privilege boundary. Root reads
the comment from its stdin (`--comment-stdin`: the wrapper in systemd/slurm/ moves
SLURM_JOB_COMMENT there), else from SLURM_JOB_COMMENT, else asks `scontrol show job` where
slurmd does not export it. The comment never goes to a child's environment (a long one
would not fit: "Argument list too long"), and only its first MAX_COMMENT_BYTES are read
for tokens: a longer comment that holds tierfs: tokens is one clear error, nothing warmed
(a long list belongs in a manifest). Everything the comment names - manifests, paths, globs,
symlinks and `..` on the way - is resolved in a child running as the job's uid and groups
(tierfs.cli.asuser), which answers
with the real paths that user can read; root then warms only those, and only on tierfs
mounts that root (or the site's `daemon_user`) mounted, through `tierfs warm` in a
subprocess (this module knows nothing of the control protocol). One deadline, the
`timeout` setting, covers every step: the child and the warm are killed at it. The epilog
runs `tierfs unpin --job ID` against each trusted mount on its own, in parallel, under the
same kind of deadline, so one bad mount does not keep the others' pins; then it asks each
(`tierfs usage --reader job:ID`) what the job read, ends its one line with it ("job 1234:
read 812.0 GiB, 97% from cache, 14 s stalled on the store") and may append it to an
accounting file as a JSON line.

Best-effort by default: a prolog that exits non-zero drains the node, so a failed warm is
logged and the prolog exits 0 (the job then reads from the bucket); `strict = true` in the
site settings makes it exit 1. One line per job outcome goes to the log file (0600) and to
stderr, control characters escaped, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pwd
import re
import stat
import subprocess
import sys
import syslog
import tempfile
import time
import tomllib
from dataclasses import dataclass

from ..config import SlurmSettings, check_job_id, format_size, slurm_settings
from ..errors import UsageError
from ..mount.mountinfo import Mount
from ..mount.mountinfo import mounts as all_mounts
from . import asuser, slurmruns
from .asuser import (  # noqa: F401 - part of this module's API
    AsUserError,
    DeadlineExceeded,
    Identity,
    Lookup,
    Readable,
    parse_manifest,
    search_root,
)
from .slurmruns import job_name_from_scontrol

CONFIG_ENV = "TIERFS_SLURM_CONFIG"
CONFIG_NAME = "tierfs-slurm.toml"  # beside slurm.conf, as Slurm's own cgroup.conf, gres.conf
# the Prolog runs with no PATH at all (slurmd sets none): our children get this one
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIERFS_FSTYPE = "fuse.tierfs"
MAX_UID = (1 << 32) - 2  # (uid_t)-1 means "no change" to the kernel
_TOKEN_RE = re.compile(r"(?<!\S)tierfs:([A-Za-z_-]+)=(\S*)")
# a comment names a few paths; thousands go in a manifest (tierfs:manifest=FILE)
MAX_COMMENT_BYTES = 64 << 10
# what the hook's children must not inherit: a 10 MB comment in the environment makes
# every exec fail with E2BIG ("Argument list too long"), and none of them reads it
_NOT_INHERITED = ("SLURM_JOB_COMMENT",)

Settings = SlurmSettings  # the site settings, one schema with the mount options (config.py)


class DeclarationError(UsageError):
    """What a job declared cannot be used as it is (the job's input, not the site's)."""


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Declared:
    paths: tuple[str, ...] = ()
    manifests: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()  # unusable tokens, reported but not fatal to the rest
    auto: bool = False  # tierfs:warm=auto: what the last run of this job read (slurmruns)

    def __bool__(self) -> bool:
        return bool(self.paths or self.manifests or self.errors or self.auto)


def parse_comment(comment: str) -> Declared:
    """The tierfs tokens of a job comment; all other text is ignored. A `tierfs:` token with
    an unknown key or a relative path is an error (a typo must not silently warm nothing)."""
    paths: list[str] = []
    manifests: list[str] = []
    errors: list[str] = []
    auto = False
    for key, value in _TOKEN_RE.findall(comment or ""):
        items = [v for v in value.split(",") if v] if key == "warm" else [value] if value else []
        if key not in ("warm", "manifest"):
            errors.append(f"unknown token tierfs:{key}= "
                          "(expected tierfs:warm= or tierfs:manifest=)")
        elif not items:
            errors.append(f"empty tierfs:{key}=")
        else:
            for item in items:
                if key == "warm" and item == "auto":
                    auto = True
                elif not item.startswith("/"):
                    errors.append(f"tierfs:{key}= takes absolute paths, not {item!r}")
                else:
                    (paths if key == "warm" else manifests).append(item)
    return Declared(tuple(paths), tuple(manifests), tuple(errors), auto)


def declared_in(comment: str) -> Declared:
    """parse_comment of a comment up to MAX_COMMENT_BYTES. A longer one declares nothing
    if it has no tierfs: token, else it is one error: its tokens are not used (a cut
    comment could cut a path in two)."""
    size = len(comment.encode(errors="replace"))
    if size <= MAX_COMMENT_BYTES:
        return parse_comment(comment)
    if not _TOKEN_RE.search(comment):
        return Declared()
    why = (f"the job comment is {format_size(size)}, more than the "
           f"{format_size(MAX_COMMENT_BYTES)} tierfs reads: its tierfs: tokens are ignored, "
           "nothing warmed (name a long list in a manifest: tierfs:manifest=FILE)")
    return Declared(errors=(why,))


def comment_from_scontrol(text: str) -> str:
    """The Comment= value of `scontrol show job ID` (multi-line form: Comment is on its own
    line there, so a comment with spaces or '=' is not confused with the next field)."""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("Comment="):
            value = stripped[len("Comment="):].rstrip()
            return "" if value == "(null)" else value
    return ""


# ----------------------------------------------------------------------------- settings
def config_path(explicit: str | None) -> str:
    """--config, else $TIERFS_SLURM_CONFIG, else tierfs-slurm.toml in the folder of the
    slurm.conf slurmd uses (it passes SLURM_CONF to its hooks)."""
    if explicit or os.environ.get(CONFIG_ENV):
        return explicit or os.environ[CONFIG_ENV]
    slurm_conf = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    return os.path.join(os.path.dirname(slurm_conf), CONFIG_NAME)


def load_settings(path: str, must_exist: bool = False) -> Settings:
    """Settings from a TOML file; a missing default file means the defaults."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if must_exist:
            raise UsageError(f"{path}: no such settings file") from None
        return Settings()
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: {exc}") from None
    settings = slurm_settings(data, f"{path}: ")
    trusted_uids(settings, path)  # an unknown daemon_user is the file's error, found now
    return settings


def trusted_uids(settings: Settings, origin: str = "daemon_user") -> frozenset[int]:
    """The owners of the mounts the hooks talk to: root, and the site's daemon_user (for
    mounts a systemd unit runs as a user of their own). A user's own tierfs mount is
    never one of them: its socket, and so its answers, are that user's."""
    name = settings.daemon_user
    if not name:
        return frozenset({0})
    try:
        uid = int(name) if name.isdigit() else pwd.getpwnam(name).pw_uid
    except KeyError:
        raise UsageError(f"{origin}: daemon_user {name!r}: no such user") from None
    if uid > MAX_UID:
        raise UsageError(f"{origin}: daemon_user {name!r} is not a uid")
    return frozenset({0, uid})


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Job:
    id: str
    user: str
    uid: int
    gid: int

    @classmethod
    def from_env(cls, env: os._Environ[str] | dict[str, str]) -> "Job":
        raw = env.get("SLURM_JOB_ID", "")
        if not raw:
            raise UsageError("SLURM_JOB_ID is not set: run this as slurmd's Prolog=/Epilog=")
        try:
            job_id = check_job_id(raw)
        except ValueError as exc:
            raise UsageError(f"SLURM_JOB_ID {escape(raw[:40])!r}: {exc}") from None
        try:
            uid = int(env["SLURM_JOB_UID"])
            gid = int(env.get("SLURM_JOB_GID") or pwd.getpwuid(uid).pw_gid)
        except (KeyError, ValueError):
            raise UsageError("SLURM_JOB_UID is not set or not a number") from None
        if not (0 <= uid <= MAX_UID and 0 <= gid <= MAX_UID):
            raise UsageError("SLURM_JOB_UID or SLURM_JOB_GID is out of range")
        user = env.get("SLURM_JOB_USER") or str(uid)
        return cls(job_id, user, uid, gid)

    @property
    def identity(self) -> Identity:
        return Identity.of(self.user, self.uid, self.gid)


# ----------------------------------------------------------------------------- logging
def escape(text: str) -> str:
    """Text for one log line: control and other unprintable characters (a newline that
    would start a forged line, a terminal escape) as \\xNN / \\uNNNN; backslash doubled
    so an escape cannot be faked either."""
    out = []
    for c in text.replace("\\", "\\\\"):
        if c.isprintable():
            out.append(c)
        elif ord(c) < 0x100:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "".join(out)


class Log:
    """One line per job outcome: to the log file (with a timestamp; 0600, root's alone:
    it names users' paths) and to stderr."""

    def __init__(self, settings: Settings, hook: str, job_id: str):
        self.file = settings.log_file
        self.prefix = f"tierfs-slurm {hook} job={job_id}"

    def line(self, message: str) -> None:
        text = escape(f"{self.prefix} {message}")
        sys.stderr.write(text + "\n")
        if not self.file:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            os.makedirs(os.path.dirname(self.file) or ".", mode=0o755, exist_ok=True)
            fd = os.open(self.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
            try:
                st = os.fstat(fd)
                if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
                    os.fchmod(fd, 0o600)  # made by an older version, or by hand
                os.write(fd, f"{stamp} {text}\n".encode())
            finally:
                os.close(fd)
        except OSError as exc:
            sys.stderr.write(f"tierfs-slurm: cannot write {escape(self.file)}: "
                             f"{exc.strerror}\n")


# ----------------------------------------------------------------------------- mounts
def trusted_mounts(table: list[Mount], trusted: frozenset[int]) -> list[Mount]:
    """The tierfs mounts of the node that root or the daemon user made."""
    return [m for m in table
            if m.fstype == TIERFS_FSTYPE and _owner(m) in trusted]


def _owner(m: Mount) -> int:
    try:
        return int(m.super_options.get("user_id", ""))
    except ValueError:
        return -1


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount a path lies on: the deepest mount point above it (any file system)."""
    best = None
    for m in table:
        if path == m.mountpoint or path.startswith(m.mountpoint.rstrip("/") + "/"):
            if best is None or len(m.mountpoint) >= len(best.mountpoint):
                best = m  # the later of two mounts on one point is the visible one
    return best


def _warmable(item: str, table: list[Mount], trusted: frozenset[int]) -> str | None:
    """Why root will not warm a path the check answered with (None: it will). The child
    is trusted to have checked access; what it returns is checked for shape and place
    all the same."""
    if not item.startswith("/") or os.path.normpath(item) != item:
        return f"not a real path: {item}"
    if any(not c.isprintable() for c in item) or item != item.strip():
        return f"a name with control characters or blanks at its end: {item}"
    m = mount_of(item, table)
    if m is None or m.fstype != TIERFS_FSTYPE:
        return f"not under a tierfs mount: {item}"
    if _owner(m) not in trusted:
        return f"on a tierfs mount not made by root: {item}"
    return None


# ----------------------------------------------------------------------------- running tierfs
def _tierfs(args: list[str], deadline: float) -> tuple[int, str, str]:
    """Run a tierfs subcommand in a child (the same interpreter) until `deadline`; (rc,
    stdout, its error lines joined). A child still running then is killed: rc 124 like
    timeout(1)."""
    proc = _spawn(args)
    return _finish(proc, deadline)


def child_env() -> dict[str, str]:
    """The hook's environment for its children: PATH set, the job comment left out."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.setdefault("PATH", SAFE_PATH)
    return env


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierfs", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", env=child_env(), cwd="/")


def _finish(proc: subprocess.Popen, deadline: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return 124, out, "timed out"
    lines = [ln.strip().removeprefix("tierfs: error: ") for ln in err.splitlines() if ln.strip()]
    return proc.returncode, out, "; ".join(lines)


def _shorten(text: str, limit: int = 1000) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _json_lines(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append(data)
    return out


_SUMMED = ("files", "bytes", "bytes_cached_before", "bytes_fetched", "error_count")


def _summaries(stdout: str) -> list[dict]:
    return [d for d in _json_lines(stdout) if d.get("event") == "summary"]  # one per mount


def _number(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _added(stdout: str, key: str) -> int:
    return sum(_number(d.get(key)) for d in _summaries(stdout))


def _summary(stdout: str) -> str:
    """The summaries of `tierfs warm --json` added up, as key=value words (mounts: how
    many mounts answered; a set in several batches has several summaries per mount)."""
    n = len({str(d.get("mountpoint")) for d in _summaries(stdout)})
    return " ".join([f"mounts={n}"] + [f"{k}={_added(stdout, k)}" for k in _SUMMED]) if n else ""


# ----------------------------------------------------------------------------- the hooks
def collect(job: Job, declared: Declared, table: list[Mount] | None = None, *,
            trusted: frozenset[int] = frozenset({0}),
            deadline: float | None = None) -> tuple[list[str], list[str]]:
    """(paths to warm, problems): the comment's paths plus the manifests' lines, resolved
    as the job's user, left out what that user could not read or what is not on a trusted
    tierfs mount of the node (`table`: the node's mounts by default)."""
    problems = list(declared.errors)
    if not declared.paths and not declared.manifests:
        return [], problems
    table = list(all_mounts()) if table is None else table
    roots = tuple(m.mountpoint for m in trusted_mounts(table, trusted))
    if not roots:
        return [], problems + ["no tierfs mount on this node"]
    look = Lookup(job.user, declared.paths, declared.manifests, roots)
    end = time.monotonic() + 300.0 if deadline is None else deadline
    try:
        answer = Readable.from_json(asuser.run_as(job.identity, asuser.resolve,
                                                  look.to_json(), end))
    except DeadlineExceeded:
        return [], problems + [f"timed out while checking the paths as {job.user}: "
                               "nothing warmed"]
    except AsUserError as exc:  # nothing could be checked: warm nothing
        return [], problems + [f"cannot check the paths as {job.user}: {exc}"]
    problems += answer.problems
    paths = []
    for item in answer.items:
        why = _warmable(item, table, trusted)
        if why:
            problems.append(why)
        else:
            paths.append(item)
    return paths, problems


def _job_comment(job: Job, settings: Settings, deadline: float) -> str:
    # slurmd exports the comment to the Prolog (Slurm >= 21.08, seen on 22.05) and asking
    # slurmctld from every prolog of a big job is the load Slurm's docs warn about
    if "SLURM_JOB_COMMENT" in os.environ or "SLURM_SCRIPT_CONTEXT" in os.environ:
        return os.environ.get("SLURM_JOB_COMMENT", "")
    return comment_from_scontrol(_show_job(job, settings, deadline))


def _job_name(job: Job, settings: Settings, deadline: float) -> str:
    """The job's name (warm=auto's key, with its user): from the hook's environment where
    slurmd exports it, else from `scontrol show job`."""
    if "SLURM_JOB_NAME" in os.environ:
        return os.environ["SLURM_JOB_NAME"]
    return job_name_from_scontrol(_show_job(job, settings, deadline))


def _show_job(job: Job, settings: Settings, deadline: float) -> str:
    wait = max(min(30.0, deadline - time.monotonic()), 0.001)
    try:
        r = subprocess.run([settings.scontrol, "show", "job", job.id], capture_output=True,
                           text=True, errors="replace", timeout=wait, stdin=subprocess.DEVNULL,
                           env=child_env())
    except subprocess.TimeoutExpired:
        raise DeclarationError(f"scontrol show job {job.id}: no answer in {wait:g}s") from None
    except OSError as exc:
        raise DeclarationError(f"{settings.scontrol}: {exc.strerror}") from None
    if r.returncode != 0:
        raise DeclarationError(f"scontrol show job {job.id}: {r.stderr.strip()[:200]}")
    return r.stdout


def _last_run_paths(settings: Settings, job: Job, deadline: float
                    ) -> tuple[list[str], list[str], str]:
    """tierfs:warm=auto: (the files the job's last run read on this node's trusted mounts,
    problems, a note for the log line). The last run is the latest job of the same user
    and job name that ended here having read through tierfs (slurmruns); no such run (a
    first run) is a note, not a failure."""
    try:
        name = _job_name(job, settings, deadline)
    except DeclarationError as exc:
        return [], [f"warm=auto: {exc}"], ""
    run = slurmruns.last_run(job.uid, name) if name else None
    if run is None:
        return [], [], f"warm=auto: no earlier run of {name!r} by {job.user} on this node"
    paths, unasked = [], []
    for m in trusted_mounts(list(all_mounts()), trusted_uids(settings)):
        rc, out, err = _tierfs(["report", m.mountpoint, "--manifest", "--job", run.job],
                               deadline)
        if rc == 0:
            paths += [ln for ln in out.splitlines() if ln.startswith("/")]
        elif "read nothing through" not in err:  # a mount that did not see the job: none
            # a mount that cannot answer (a stray one left dead) costs its files only; not
            # a failed prolog (strict would drain the node for a mount the job may not use)
            unasked.append(f"{m.mountpoint}: {err or f'exit {rc}'}")
    note = f"warm=auto: {len(paths)} files read by job {run.job}, the last run of {name!r}"
    if unasked:
        note += f" (mounts not asked: {_shorten('; '.join(unasked), 300)})"
    return paths, [], note


WARM_BATCH_BYTES = 256 << 10  # of manifest text per `tierfs warm`: well inside a control request


def batches(paths: list[str], limit: int = WARM_BATCH_BYTES) -> list[list[str]]:
    """The warm set cut into manifests of at most `limit` bytes each (a manifest and a
    control request are bounded; a set of many separate files needs several)."""
    out: list[list[str]] = [[]]
    size = 0
    for p in paths:
        n = len(p.encode()) + 1
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _warm(settings: Settings, job: Job, paths: list[str], deadline: float) -> tuple[str, list[str]]:
    """`tierfs warm` of the paths for the job: (summary words, problems). The manifest
    lines are the checked real paths with glob characters escaped: a file named `a*`
    must not become a pattern that matches its neighbours."""
    timed_out = (f"timed out after {settings.timeout:g}s (the timeout setting), "
                 "nothing pinned")
    lines = [glob.escape(p) for p in paths]
    with tempfile.TemporaryDirectory(prefix="tierfs-slurm.") as tmp:  # 0700: only we read it
        manifests = []
        for i, batch in enumerate(batches(lines)):
            manifests.append(os.path.join(tmp, f"{i}.warm"))
            with open(manifests[-1], "w") as f:
                f.write("".join(f"{p}\n" for p in batch))
        if settings.max_bytes:  # size the set first: nothing is fetched or pinned beyond it
            size = 0
            for manifest in manifests:
                rc, out, err = _tierfs(["warm", "--check", "--manifest", manifest, "--json"],
                                       deadline)
                if rc == 124:
                    return "", [f"{timed_out} while sizing the set"]
                size += _added(out, "bytes")
            if size > settings.max_bytes:
                return "", [f"the set is {format_size(size)}, more than max_bytes "
                            f"({format_size(settings.max_bytes)}): nothing warmed"]
        outs, problems = [], []
        for manifest in manifests:
            argv = ["warm", "--manifest", manifest, "--job", job.id, "--json"]
            if settings.pin_ttl:
                argv += ["--pin-ttl", f"{settings.pin_ttl:g}s"]
            rc, out, err = _tierfs(argv, deadline)
            outs.append(out)
            if rc == 124:  # the daemon drops a warm whose client went away: nothing pinned
                problems.append(timed_out if len(manifests) == 1 else
                                f"timed out after {settings.timeout:g}s (the timeout "
                                "setting): part of the set not pinned")
                break
            if rc != 0:
                problems.append(err or f"tierfs warm exited {rc}")
    return _summary("".join(outs)), problems


def prolog(settings: Settings, job: Job, log: Log, comment: str | None = None) -> int:
    """`comment`: the job comment as handed over on stdin; None: from the environment or
    scontrol."""
    started = time.monotonic()
    deadline = started + settings.timeout  # one deadline for all of it
    try:
        if comment is None:
            comment = _job_comment(job, settings, deadline)
        declared = declared_in(comment)
    except DeclarationError as exc:  # scontrol failed: a failed warm like any other
        declared = Declared(errors=(str(exc),))
    if not declared:
        return 0  # the job asked for nothing: nothing to log either
    note = ""
    auto_problems: list[str] = []
    if declared.auto:
        auto, auto_problems, note = _last_run_paths(settings, job, deadline)
        declared = dataclasses.replace(declared, paths=declared.paths + tuple(auto))
    paths, problems = collect(job, declared, trusted=trusted_uids(settings),
                              deadline=deadline)
    problems = auto_problems + problems
    outcome = ""
    if paths and time.monotonic() < deadline:
        outcome, failed = _warm(settings, job, paths, deadline)
        problems += failed
    elif paths:
        problems.append(f"timed out after {settings.timeout:g}s (the timeout setting), "
                        "nothing pinned")
    took = f"in {time.monotonic() - started:.1f}s"
    if problems:
        policy = "strict: failing the prolog" if settings.strict else "best-effort: the job starts"
        log.line(f"user={job.user} warm FAILED ({policy}): {_shorten('; '.join(problems))}"
                 f"{' ' + outcome if outcome else ''} {took}")
        return 1 if settings.strict else 0
    log.line(f"user={job.user} warmed and pinned {len(paths)} paths {outcome} {took}"
             f"{'; ' + note if note else ''}")
    return 0


def epilog(settings: Settings, job: Job, log: Log) -> int:
    """Release the job's pins on every trusted tierfs mount, each by its own `tierfs unpin`
    run in parallel: a mount that fails, hangs or answers nonsense costs only its own pins
    (they end with pin_ttl). Always run: cheap when nothing is pinned, and the comment may
    have changed since the prolog."""
    deadline = time.monotonic() + settings.timeout
    targets = trusted_mounts(list(all_mounts()), trusted_uids(settings))
    procs = [(m, _spawn(["unpin", "--job", job.id, "--json", "--mount", m.mountpoint]))
             for m in targets]
    released, failed = 0, []
    for m, proc in procs:
        rc, out, err = _finish(proc, deadline)
        released += sum(_number(d.get("objects")) for d in _json_lines(out))
        if rc != 0:
            failed.append(f"{m.mountpoint}: {err or f'exit {rc}'}")
    parts = []
    if failed:
        # a node is not worth draining for this: the pins left end with pin_ttl
        parts.append(f"unpinned {released} files; unpin FAILED on {len(failed)} of "
                     f"{len(procs)} mounts (pins expire after pin_ttl): "
                     f"{_shorten('; '.join(failed))}")
    elif released:
        parts.append(f"unpinned {released} files")
    usage = report_usage(settings, job, targets, deadline)
    if usage:
        parts.append(usage)
        parts += _record_run(settings, job, deadline)
    if parts:  # one line per job, the usage summary last
        log.line(f"user={job.user} " + "; ".join(parts))
    return 0


def _record_run(settings: Settings, job: Job, deadline: float) -> list[str]:
    """The job read through tierfs: it is now the last run of its name for warm=auto
    (slurmruns); a failure is a part of the epilog's line, never its failure."""
    try:
        name = _job_name(job, settings, deadline)
        if name:
            slurmruns.record_run(job.uid, name, job.id, time.time())
    except (DeclarationError, OSError) as exc:
        return [f"last run not recorded for warm=auto: {exc}"]
    return []


@dataclass(frozen=True)
class JobUsage:
    """What one job read through the node's trusted tierfs mounts (summed over them)."""
    job: str
    read: dict[str, int]  # source -> bytes
    stall_s: float
    mounts: tuple[str, ...]  # the mounts it read through

    @property
    def total(self) -> int:
        return sum(self.read.values())

    @property
    def cached(self) -> int:
        return self.read.get("memory", 0) + self.read.get("disk", 0)

    def line(self) -> str:
        """e.g. `job 1234: read 812.0 GiB, 97% from cache, 14 s stalled on the store`."""
        pct = 100 * self.cached // self.total if self.total else 0
        return (f"job {self.job}: read {format_size(self.total)}, {pct}% from cache, "
                f"{self.stall_s:.0f} s stalled on the store")

    def record(self, user: str, now: float) -> dict:
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                "job": self.job, "user": user, "read_bytes": self.total,
                "read": dict(self.read), "cached_bytes": self.cached,
                "hit_ratio": round(self.cached / self.total, 4) if self.total else None,
                "stall_s": round(self.stall_s, 3), "mounts": list(self.mounts)}


def job_usage(job_id: str, answers: list[tuple[str, str]]) -> JobUsage:
    """The `tierfs usage --reader job:ID --json` answers of the mounts, (mountpoint,
    stdout) each, summed; an answer that is not one counts nothing."""
    read: dict[str, int] = {}
    stall, used = 0.0, []
    for mountpoint, out in answers:
        for d in _json_lines(out):
            rows = d.get("rows")
            for row in rows if isinstance(rows, list) else ():
                if not isinstance(row, dict) or row.get("name") != f"job:{job_id}":
                    continue
                got = row.get("read")
                if not isinstance(got, dict):
                    got = {}
                for src in ("memory", "disk", "peer", "near", "backend"):
                    read[src] = read.get(src, 0) + _number(got.get(src))
                value = row.get("stall_s")
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and 0 <= value < float("inf"):
                    stall += value
                used.append(mountpoint)
    return JobUsage(job_id, read, stall, tuple(used))


def report_usage(settings: Settings, job: Job, targets: list[Mount], deadline: float) -> str:
    """What the job read, for the epilog's line ("" if nothing), appended to the
    accounting file too: asked of each mount in parallel, after the unpins; a mount that
    fails (or keeps no usage) is left out of the sum."""
    procs = [(m, _spawn(["usage", m.mountpoint, "--reader", f"job:{job.id}", "--json"]))
             for m in targets]
    answers = []
    for m, proc in procs:
        rc, out, _ = _finish(proc, deadline)
        if rc == 0:
            answers.append((m.mountpoint, out))
    usage = job_usage(job.id, answers)
    if not usage.total:
        return ""  # the job read nothing through tierfs: nothing to account
    if settings.accounting_file:
        append_json_line(settings.accounting_file, usage.record(job.user, time.time()))
    return usage.line()


def append_json_line(path: str, record: dict) -> None:
    """One JSON line at the end of the accounting file (0600, like the log: it names
    users and jobs); a failure is one stderr line, never the epilog's failure."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
        try:
            os.write(fd, (json.dumps(record, allow_nan=False) + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        sys.stderr.write(f"tierfs-slurm: cannot write {escape(path)}: {why}\n")


def _settings(args: argparse.Namespace) -> tuple[Settings, str]:
    path = config_path(args.config)
    must = bool(args.config or os.environ.get(CONFIG_ENV))
    settings = load_settings(path, must_exist=must)
    return settings, path if must or os.path.exists(path) else "defaults"


def _run(args: argparse.Namespace) -> int:
    try:
        settings, _ = _settings(args)
    except UsageError as exc:
        message = escape(f"tierfs-slurm {args.hook}: error: {exc}")
        sys.stderr.write(message + "\n")
        if "SLURM_JOB_ID" not in os.environ:
            return 2
        # under slurmd: a typo in the site's file must not drain every node it reaches;
        # there is no log file to trust, so syslog as well
        syslog.openlog("tierfs-slurm")
        syslog.syslog(syslog.LOG_ERR, message)
        return 0
    try:
        job = Job.from_env(os.environ)
    except UsageError as exc:
        sys.stderr.write(escape(f"tierfs-slurm {args.hook}: error: {exc}") + "\n")
        return 2
    log = Log(settings, args.hook, job.id)
    strict = settings.strict and args.hook == "prolog"
    try:
        if args.hook == "epilog":
            return epilog(settings, job, log)
        comment = None
        if args.comment_stdin:  # bytes as Slurm has them; not UTF-8 is replaced, not fatal
            comment = sys.stdin.buffer.read().decode(errors="replace")
        return prolog(settings, job, log, comment)
    except Exception as exc:  # noqa: BLE001 - no traceback, no node drained by accident
        log.line(f"user={job.user} FAILED ({'strict' if strict else 'best-effort'}), "
                 f"unexpected {type(exc).__name__}: {exc}")
        return 1 if strict else 0


def _check(args: argparse.Namespace) -> int:
    """Validate the site settings and show what the hooks will use."""
    try:
        settings, where = _settings(args)
    except UsageError as exc:
        sys.stderr.write(escape(f"tierfs-slurm check: error: {exc}") + "\n")
        return 2
    if where == "defaults":
        where = f"defaults (there is no {config_path(args.config)})"
    print(f"settings: {where}")
    ttl = "none" if settings.pin_ttl is None else f"{settings.pin_ttl:g}s"
    owners = ", ".join(str(u) for u in sorted(trusted_uids(settings)))
    print(f"strict = {str(settings.strict).lower()}\npin_ttl = {ttl}\n"
          f"timeout = {settings.timeout:g}s\nmax_bytes = {settings.max_bytes or 'no limit'}\n"
          f"log_file = {settings.log_file or '(stderr only)'}\n"
          f"accounting_file = {settings.accounting_file or '(none)'}\n"
          f"scontrol = {settings.scontrol}\n"
          f"daemon_user = {settings.daemon_user or '(root only)'} "
          f"(mounts of uid {owners} are used)")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("slurm", help="Slurm prolog/epilog: warm and pin a job's data")
    hooks = s.add_subparsers(dest="hook", required=True, parser_class=type(s))
    for hook, text, run in (
            ("prolog", "warm and pin what the job declares (slurmd's Prolog=)", _run),
            ("epilog", "release the job's pins (slurmd's Epilog=)", _run),
            ("check", "validate the site settings and print them", _check)):
        h = hooks.add_parser(hook, help=text, description=text)
        h.add_argument("--config", help=f"site settings (default ${CONFIG_ENV}, else "
                       f"{CONFIG_NAME} beside slurm.conf)")
        if hook == "prolog":
            h.add_argument("--comment-stdin", action="store_true",
                           help="read the job comment from stdin, not from "
                                "SLURM_JOB_COMMENT or scontrol (systemd/slurm/tierfs-slurm)")
        h.set_defaults(run=run)
