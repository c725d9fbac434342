"""`tierfs slurm prolog|epilog`: warm and pin what a Slurm job declares, unpin at its end.

A job declares its data in its --comment, as whitespace-separated tokens that live beside
any other text of the comment (docs/slurm.md):

    tierfs:warm=/data/imagenet,/ckpt/run42     paths or globs, comma-separated, absolute
    tierfs:manifest=/home/alice/run42.warm     a manifest: one path or glob a line, # comments

The prolog (run by slurmd as root) reads the comment from SLURM_JOB_COMMENT, or asks
`scontrol show job` where slurmd does not export it, reads each manifest *as the job's user*
and keeps only the paths that user can read (root must not read or warm for a job what its
user cannot), then runs `tierfs warm --manifest ... --job ID` in a subprocess (this module
knows nothing of the control protocol). The epilog runs `tierfs unpin --job ID`.

Best-effort by default: a prolog that exits non-zero drains the node, so a failed warm is
logged and the prolog exits 0 (the job then reads from the bucket); `strict = true` in the
site settings makes it exit 1. One line per job outcome goes to the log file and to stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import subprocess
import sys
import syslog
import tempfile
import time
import tomllib
from dataclasses import dataclass, field

from .config import format_size, parse_bool, parse_duration, parse_size
from .ctl import locate, tierfs_mounts  # where the mounts are; the protocol stays in ctl
from .errors import UsageError

CONFIG_ENV = "TIERFS_SLURM_CONFIG"
CONFIG_NAME = "tierfs-slurm.toml"  # beside slurm.conf, as Slurm's own cgroup.conf, gres.conf
MANIFEST_MAX_BYTES = 1 << 20  # a manifest is a list of paths; more is a mistake (or /dev/zero)
# the Prolog runs with no PATH at all (slurmd sets none): our children get this one
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_TOKEN_RE = re.compile(r"(?<!\S)tierfs:([A-Za-z_-]+)=(\S*)")
_GLOB_CHARS = "*?["


class DeclarationError(UsageError):
    """What a job declared cannot be used as it is (the job's input, not the site's)."""


# ----------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Declared:
    paths: tuple[str, ...] = ()
    manifests: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()  # unusable tokens, reported but not fatal to the rest

    def __bool__(self) -> bool:
        return bool(self.paths or self.manifests or self.errors)


def parse_comment(comment: str) -> Declared:
    """The tierfs tokens of a job comment; all other text is ignored. A `tierfs:` token with
    an unknown key or a relative path is an error (a typo must not silently warm nothing)."""
    paths: list[str] = []
    manifests: list[str] = []
    errors: list[str] = []
    for key, value in _TOKEN_RE.findall(comment or ""):
        items = [v for v in value.split(",") if v] if key == "warm" else [value] if value else []
        if key not in ("warm", "manifest"):
            errors.append(f"unknown token tierfs:{key}= "
                          "(expected tierfs:warm= or tierfs:manifest=)")
        elif not items:
            errors.append(f"empty tierfs:{key}=")
        else:
            for item in items:
                if not item.startswith("/"):
                    errors.append(f"tierfs:{key}= takes absolute paths, not {item!r}")
                else:
                    (paths if key == "warm" else manifests).append(item)
    return Declared(tuple(paths), tuple(manifests), tuple(errors))


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


def comment_from_scontrol(text: str) -> str:
    """The Comment= value of `scontrol show job ID` (multi-line form: Comment is on its own
    line there, so a comment with spaces or '=' is not confused with the next field)."""
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("Comment="):
            value = stripped[len("Comment="):].rstrip()
            return "" if value == "(null)" else value
    return ""


def search_root(path: str) -> str:
    """The part of a path or glob that exists before any pattern: the glob's parent folder
    (/data/in/train-*.tar -> /data/in), the path itself when it has no pattern."""
    cut = min((path.find(c) for c in _GLOB_CHARS if c in path), default=-1)
    if cut < 0:
        return path
    return path[:cut].rsplit("/", 1)[0] or "/"


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    strict: bool = False  # True: a failed warm exits 1 and Slurm drains the node
    pin_ttl: float | None = 7 * 86400.0  # pins end by themselves if an epilog never runs
    timeout: float = 300.0  # for the whole prolog; keep it under PrologEpilogTimeout
    max_bytes: int = 0  # a job may warm and pin at most this much per node (0: no limit)
    log_file: str | None = "/var/log/tierfs/slurm.log"
    scontrol: str = "scontrol"
    source: str = field(default="defaults", compare=False)


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
    known = {"strict", "pin_ttl", "timeout", "max_bytes", "log_file", "scontrol"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{path}: unknown setting {unknown[0]!r} "
                         f"(known: {', '.join(sorted(known))})")
    try:
        return _settings_from(data, path)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None


def _settings_from(data: dict, path: str) -> Settings:
    kw: dict[str, object] = {"source": path}
    if "strict" in data:
        kw["strict"] = parse_bool(data["strict"], "strict")
    if "pin_ttl" in data:
        ttl = data["pin_ttl"]
        kw["pin_ttl"] = None if ttl in ("", 0, "0", False) else parse_duration(ttl, "pin_ttl")
    if "timeout" in data:
        kw["timeout"] = parse_duration(data["timeout"], "timeout")
        if kw["timeout"] <= 0:
            raise UsageError("timeout must be more than 0")
    if "max_bytes" in data:
        kw["max_bytes"] = parse_size(data["max_bytes"], "max_bytes")
    for name in ("log_file", "scontrol"):
        if name in data:
            if not isinstance(data[name], str):
                raise UsageError(f"{name} must be a string")
            kw[name] = data[name]
    if kw.get("log_file") == "":  # log_file = "": stderr only
        kw["log_file"] = None
    return Settings(**kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the job
@dataclass(frozen=True)
class Job:
    id: str
    user: str
    uid: int
    gid: int

    @classmethod
    def from_env(cls, env: os._Environ[str] | dict[str, str]) -> "Job":
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id.isdigit():
            raise UsageError("SLURM_JOB_ID is not set: run this as slurmd's Prolog=/Epilog=")
        try:
            uid = int(env["SLURM_JOB_UID"])
            gid = int(env.get("SLURM_JOB_GID") or pwd.getpwuid(uid).pw_gid)
        except (KeyError, ValueError):
            raise UsageError("SLURM_JOB_UID is not set or not a number") from None
        user = env.get("SLURM_JOB_USER") or str(uid)
        return cls(job_id, user, uid, gid)


def _as_user(job: Job, argv: list[str], stdin: str = "", timeout: float = 30.0):
    """Run argv with the job user's uid, gid and groups (when we are root), so what it
    reads is what the job itself could read. A hung file system is a DeclarationError."""
    drop: dict[str, object] = {}
    if os.geteuid() == 0 and job.uid != 0:
        try:
            groups = os.getgrouplist(job.user, job.gid)
        except (KeyError, OSError):  # a uid without a passwd entry: its primary group only
            groups = [job.gid]
        drop = {"user": job.uid, "group": job.gid, "extra_groups": groups}
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                              errors="replace", timeout=timeout, cwd="/",
                              env={"PATH": SAFE_PATH, "LC_ALL": "C"},
                              **drop)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        raise DeclarationError(f"{argv[0]} as {job.user} did not finish in {timeout:g}s "
                               "(a hung file system?)") from None


def read_manifest(job: Job, path: str) -> str:
    r = _as_user(job, ["head", "-c", str(MANIFEST_MAX_BYTES + 1), "--", path])
    if r.returncode != 0:
        why = r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"]
        raise DeclarationError(f"cannot read manifest {path} as {job.user}: "
                               f"{why[0].split(': ')[-1]}")
    if len(r.stdout.encode()) > MANIFEST_MAX_BYTES:
        raise DeclarationError(f"manifest {path} is larger than {MANIFEST_MAX_BYTES} bytes")
    return r.stdout


# prints "missing P" / "unreadable P" for each path on stdin the user cannot read
_ACCESS_SH = ('while IFS= read -r p; do if [ -r "$p" ]; then :; '
              'elif [ -e "$p" ]; then printf "unreadable %s\\n" "$p"; '
              'else printf "missing %s\\n" "$p"; fi; done')


def user_cannot_read(job: Job, paths: list[str]) -> dict[str, str]:
    """{path: "missing" | "unreadable"} for the paths whose search root the job's user
    cannot read. Missing as seen by the user: a folder it may not enter hides the rest."""
    roots = sorted({search_root(p) for p in paths})
    r = _as_user(job, ["sh", "-c", _ACCESS_SH], stdin="".join(f"{p}\n" for p in roots))
    if r.returncode != 0:
        raise DeclarationError(f"cannot check access as {job.user}: {r.stderr.strip()[:200]}")
    bad_roots = {}
    for line in r.stdout.splitlines():
        why, _, root = line.partition(" ")
        bad_roots[root] = why
    return {p: bad_roots[search_root(p)] for p in paths if search_root(p) in bad_roots}


# ----------------------------------------------------------------------------- logging
class Log:
    """One line per job outcome: to the log file (with a timestamp) and to stderr."""

    def __init__(self, settings: Settings, hook: str, job_id: str):
        self.file = settings.log_file
        self.prefix = f"tierfs-slurm {hook} job={job_id}"

    def line(self, message: str) -> None:
        text = f"{self.prefix} {message}".replace("\n", " ")
        sys.stderr.write(text + "\n")
        if not self.file:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            os.makedirs(os.path.dirname(self.file) or ".", mode=0o755, exist_ok=True)
            with open(self.file, "a") as f:
                f.write(f"{stamp} {text}\n")
        except OSError as exc:
            sys.stderr.write(f"tierfs-slurm: cannot write {self.file}: {exc.strerror}\n")


# ----------------------------------------------------------------------------- running tierfs
def _tierfs(args: list[str], timeout: float) -> tuple[int, str, str]:
    """Run a tierfs subcommand in a child (the same interpreter); (rc, stdout, its error
    lines joined). A child that outlives `timeout` is killed: rc 124 like timeout(1)."""
    env = dict(os.environ)
    env.setdefault("PATH", SAFE_PATH)
    proc = subprocess.Popen([sys.executable, "-m", "tierfs", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", env=env, cwd="/")
    try:
        out, err = proc.communicate(timeout=timeout)
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


def _added(stdout: str, key: str) -> int:
    return sum(int(d.get(key) or 0) for d in _summaries(stdout))


def _summary(stdout: str) -> str:
    """The summaries of `tierfs warm --json` added up, as key=value words."""
    n = len(_summaries(stdout))
    return " ".join([f"mounts={n}"] + [f"{k}={_added(stdout, k)}" for k in _SUMMED]) if n else ""


# ----------------------------------------------------------------------------- the hooks
def collect(job: Job, declared: Declared,
            mounts: list | None = None) -> tuple[list[str], list[str]]:
    """(paths to warm, problems): the comment's paths plus the manifests' lines, less what
    is not under a tierfs mount (`mounts`, default: this node's) or the job's user could
    not read."""
    problems = list(declared.errors)
    paths = list(declared.paths)
    for manifest in declared.manifests:
        try:
            more, errors = parse_manifest(read_manifest(job, manifest), manifest)
        except DeclarationError as exc:
            problems.append(str(exc))
            continue
        paths += more
        problems += errors
    paths = list(dict.fromkeys(paths))  # keep the order, drop repeats
    # `tierfs warm` refuses the whole set for one path outside a mount: leave those out here
    mounts = tierfs_mounts() if mounts is None else mounts
    outside = [p for p in paths if not _under_mount(p, mounts)]
    problems += [f"not under a tierfs mount: {p}" for p in outside]
    paths = [p for p in paths if p not in outside]
    if paths and job.uid != 0:  # root's jobs read anything; warm reports what is missing
        try:
            denied = user_cannot_read(job, paths)
        except DeclarationError as exc:  # nothing could be checked: warm nothing
            return [], problems + [str(exc)]
        problems += [f"{why} for {job.user}: {p}" for p, why in denied.items()]
        paths = [p for p in paths if p not in denied]
    return paths, problems


def _under_mount(path: str, mounts: list) -> bool:
    try:
        locate(path, mounts)
    except UsageError:
        return False
    return True


def _job_comment(job: Job, settings: Settings) -> str:
    # slurmd exports the comment to the Prolog (Slurm >= 21.08, seen on 22.05) and asking
    # slurmctld from every prolog of a big job is the load Slurm's docs warn about
    if "SLURM_JOB_COMMENT" in os.environ or "SLURM_SCRIPT_CONTEXT" in os.environ:
        return os.environ.get("SLURM_JOB_COMMENT", "")
    wait = min(30.0, settings.timeout)
    try:
        r = subprocess.run([settings.scontrol, "show", "job", job.id], capture_output=True,
                           text=True, errors="replace", timeout=wait,
                           env={**os.environ, "PATH": os.environ.get("PATH", SAFE_PATH)})
    except subprocess.TimeoutExpired:
        raise DeclarationError(f"scontrol show job {job.id}: no answer in {wait:g}s") from None
    except OSError as exc:
        raise DeclarationError(f"{settings.scontrol}: {exc.strerror}") from None
    if r.returncode != 0:
        raise DeclarationError(f"scontrol show job {job.id}: {r.stderr.strip()[:200]}")
    return comment_from_scontrol(r.stdout)


def _warm(settings: Settings, job: Job, paths: list[str], deadline: float) -> tuple[str, list[str]]:
    """`tierfs warm` of the paths for the job: (summary words, problems)."""
    with tempfile.NamedTemporaryFile("w", prefix="tierfs-slurm.", suffix=".warm") as f:
        f.write("".join(f"{p}\n" for p in paths))  # mkstemp: 0600, only we read it
        f.flush()
        if settings.max_bytes:  # size the set first: nothing is fetched or pinned beyond it
            rc, out, err = _tierfs(["warm", "--check", "--manifest", f.name, "--json"],
                                   max(deadline - time.monotonic(), 0.001))
            size = _added(out, "bytes")
            if rc == 124:
                return "", [f"timed out after {settings.timeout:g}s (the timeout setting) "
                            "while sizing the set, nothing pinned"]
            if size > settings.max_bytes:
                return "", [f"the set is {format_size(size)}, more than max_bytes "
                            f"({format_size(settings.max_bytes)}): nothing warmed"]
        argv = ["warm", "--manifest", f.name, "--job", job.id, "--json"]
        if settings.pin_ttl:
            argv += ["--pin-ttl", f"{settings.pin_ttl:g}s"]
        rc, out, err = _tierfs(argv, max(deadline - time.monotonic(), 0.001))
    if rc == 124:  # the daemon drops a warm whose client went away: nothing is pinned
        err = f"timed out after {settings.timeout:g}s (the timeout setting), nothing pinned"
    return _summary(out), ([err or f"tierfs warm exited {rc}"] if rc != 0 else [])


def prolog(settings: Settings, job: Job, log: Log) -> int:
    started = time.monotonic()  # `timeout` is for all of it, not only the warm
    try:
        declared = parse_comment(_job_comment(job, settings))
    except DeclarationError as exc:  # scontrol failed: a failed warm like any other
        declared = Declared(errors=(str(exc),))
    if not declared:
        return 0  # the job asked for nothing: nothing to log either
    paths, problems = collect(job, declared)
    outcome = ""
    if paths:
        outcome, failed = _warm(settings, job, paths, deadline=started + settings.timeout)
        problems += failed
    took = f"in {time.monotonic() - started:.1f}s"
    if problems:
        policy = "strict: failing the prolog" if settings.strict else "best-effort: the job starts"
        log.line(f"user={job.user} warm FAILED ({policy}): {_shorten('; '.join(problems))}"
                 f"{' ' + outcome if outcome else ''} {took}")
        return 1 if settings.strict else 0
    log.line(f"user={job.user} warmed and pinned {len(paths)} paths {outcome} {took}")
    return 0


def epilog(settings: Settings, job: Job, log: Log) -> int:
    # always: cheap when nothing is pinned, and the comment may have changed since the prolog
    rc, out, err = _tierfs(["unpin", "--job", job.id, "--json"], settings.timeout)
    released = sum(int(d.get("objects") or 0) for d in _json_lines(out))  # mounts that answered
    if rc != 0:
        # e.g. one dead mount on the node: the others are released all the same, pins left
        # behind end with pin_ttl, and draining a node for that is not worth it
        log.line(f"user={job.user} unpinned {released} files; unpin FAILED (pins expire "
                 f"after pin_ttl): {_shorten(err or f'exit {rc}')}")
    elif released:
        log.line(f"user={job.user} unpinned {released} files")
    return 0


def _settings(args: argparse.Namespace) -> Settings:
    path = config_path(args.config)
    return load_settings(path, must_exist=bool(args.config or os.environ.get(CONFIG_ENV)))


def _run(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
    except UsageError as exc:
        message = f"tierfs-slurm {args.hook}: error: {exc}"
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
        sys.stderr.write(f"tierfs-slurm {args.hook}: error: {exc}\n")
        return 2
    log = Log(settings, args.hook, job.id)
    strict = settings.strict and args.hook == "prolog"
    try:
        return (prolog if args.hook == "prolog" else epilog)(settings, job, log)
    except Exception as exc:  # a hook must not leave a traceback, nor drain a node by accident
        log.line(f"user={job.user} FAILED ({'strict' if strict else 'best-effort'}), "
                 f"unexpected {type(exc).__name__}: {exc}")
        return 1 if strict else 0


def _check(args: argparse.Namespace) -> int:
    """Validate the site settings and show what the hooks will use."""
    try:
        settings = _settings(args)
    except UsageError as exc:
        sys.stderr.write(f"tierfs-slurm check: error: {exc}\n")
        return 2
    where = settings.source
    if where == "defaults":
        where = f"defaults (there is no {config_path(args.config)})"
    print(f"settings: {where}")
    ttl = "none" if settings.pin_ttl is None else f"{settings.pin_ttl:g}s"
    print(f"strict = {str(settings.strict).lower()}\npin_ttl = {ttl}\n"
          f"timeout = {settings.timeout:g}s\nmax_bytes = {settings.max_bytes or 'no limit'}\n"
          f"log_file = {settings.log_file or '(stderr only)'}\n"
          f"scontrol = {settings.scontrol}")
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
        h.set_defaults(run=run)
