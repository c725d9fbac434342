"""The `tierfs` command. Each subcommand is thin; errors are one line and a non-zero exit.

`tierfs mount` without --foreground checks its input, then forks (before any thread or
trio has started) a child in a new session that goes on as the foreground daemon, and
waits on a pipe until the child says the mount answers (or why it failed), so the
parent's exit status tells whether the mount is usable. Forking instead of re-running
`python -m tierfs` spares the child a second interpreter start and the option schema's
imports (~0.3 s of a 1 s mount). The child's stderr is its log file, so nothing it says
is lost (a Python traceback from before logging starts, a C library's assertion,
faulthandler's dump of a native crash); a child that dies before answering has the last
lines of that log printed by the parent.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import TracebackType
from typing import IO, NoReturn

from ..cachedir import Layout, private_umask
from ..config import (
    FLAG_OPTIONS,
    MountConfig,
    build_config,
    build_config_with_file,
    parse_o_options,
    printable,
    read_config_file,
)
from ..errors import StartupError, TierfsError, UsageError
from ..mount import sdnotify
from ..mount.hardening import protect_process
from ..mount.mountinfo import is_mountpoint
from ..runpaths import pid_file

# (flag, dest, help); every value is validated in config.build_config
_MOUNT_OPTIONS = [
    ("--endpoint-url", "endpoint_url", "S3 endpoint, e.g. http://127.0.0.1:7480 (Ceph RGW)"),
    ("--region", "region", "S3 region"),
    ("--cache-dir", "cache_dir", "cache directory on local NVMe (default /var/cache/tierfs/ID)"),
    ("--cache-size", "cache_size", "disk cache budget, e.g. 500G (default 10G)"),
    ("--memory-cache-size", "memory_cache_size", "memory tier size (default 256M)"),
    ("--chunk-size", "chunk_size", "chunk size, a power of two (default 8M)"),
    ("--metadata-ttl", "metadata_ttl",
     "how long listings and attributes are trusted (default 60s)"),
    ("--revalidate-timeout", "revalidate_timeout",
     "past the TTL, serve a known entry if the store has not answered in this long (3s)"),
    ("--metrics-addr", "metrics_addr", "serve Prometheus metrics on HOST:PORT"),
    ("--min-free-ratio", "min_free_ratio",
     "keep this fraction of the cache filesystem free (0.10)"),
    ("--readahead-chunks", "readahead_chunks", "chunks read ahead of a sequential reader (8)"),
    ("--backend-concurrency", "backend_concurrency", "parallel requests to the backend (16)"),
    ("--dirty-wait", "dirty_wait", "wait this long for uploads before writes fail ENOSPC (60s)"),
    ("--rename-max-objects", "rename_max_objects",
     "rename directories of up to this many objects; larger ones EXDEV (1000)"),
    ("--drain-timeout", "drain_timeout",
     "at unmount, wait this long for pending uploads; the rest stays journaled (60s)"),
    ("--stall-warn", "stall_warn",
     "log a WARNING for a backend request running longer than this (10s)"),
    ("--startup-timeout", "startup_timeout",
     "with a cache index, mount degraded if the store does not answer in this long (10s)"),
    ("--meta-head-max-size", "meta_head_max_size",
     "objects this small get one HEAD for type/owner/mode/times: 0 (default) the empty "
     "ones, 4K also symlinks, all (default with --allow-other) everything, off none"),
    ("--tier", "tier", "a near object store read before the source: s3://BUCKET[/PREFIX] "
     "(docs/tiers.md)"),
    ("--tier-endpoint-url", "tier_endpoint_url", "the near store's S3 endpoint"),
    ("--tier-region", "tier_region", "the near store's S3 region"),
    ("--tier-profile", "tier_profile", "AWS profile with the near store's credentials"),
    ("--tier-timeout", "tier_timeout", "a near store slower than this: read from the source "
     "(5s)"),
    ("--near-size", "near_size", "the near store's budget for `tierfs gc --tier near`"),
    ("--promote", "promote", "copy what the source answered to the near store: all "
     "(default) or none"),
    ("--peers", "peers", "peer tier: file:PATH, dns:NAME:PORT or slurm (docs/peers.md)"),
    ("--peer-listen", "peer_listen", "the peer server binds HOST:PORT (required with --peers)"),
    ("--peer-advertise", "peer_advertise",
     "HOST:PORT the other nodes reach this one at (default --peer-listen)"),
    ("--peer-secret-file", "peer_secret_file",
     "the secret all peers share, mode 0600 (required with --peers)"),
    ("--peer-bandwidth", "peer_bandwidth", "bytes/s sent to peers, e.g. 500M (default unlimited)"),
    ("--peer-timeout", "peer_timeout", "a peer slower than this: read from the store (2s)"),
    ("--peer-max-concurrent", "peer_max_concurrent", "peer requests served at once (32)"),
    ("--peer-tls-cert", "peer_tls_cert", "TLS certificate (with --peer-tls-key and --peer-tls-ca)"),
    ("--peer-tls-key", "peer_tls_key", "TLS private key, mode 0600"),
    ("--peer-tls-ca", "peer_tls_ca", "CA that signs the peers' certificates"),
    ("--log-level", "log_level", "debug, info, warning or error (default info)"),
    ("--log-file", "log_file",
     "log here (default: stderr; in the background CACHE_DIR/tierfs.log)"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # self.prog is "tierfs" or "tierfs mount": the command to ask for help is exactly it
        sys.stderr.write(f"tierfs: error: {printable(message)} (see '{self.prog} --help')\n")
        sys.exit(2)


def _fail(message: str, code: int = 1) -> NoReturn:
    sys.stderr.write(f"tierfs: error: {printable(message)}\n")  # one line, whatever it quotes
    sys.exit(code)


def _mount_epilog() -> str:
    """The worst-case time to EIO of the default options (tierfs/backend/budget.py)."""
    from ..backend.budget import default_read_budget

    return default_read_budget().explain()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tierfs", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    m = sub.add_parser("mount", help="mount a bucket", epilog=_mount_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("source", nargs="?", help="s3://BUCKET[/PREFIX] or file:///DIR")
    m.add_argument("mountpoint", nargs="?")
    m.add_argument("--config", metavar="FILE",
                   help="TOML file with source, mountpoint and options; the command line wins")
    for flag, dest, help_ in _MOUNT_OPTIONS:
        m.add_argument(flag, dest=dest, help=help_)
    m.add_argument("--allow-other", dest="allow_other", action="store_true", default=None,
                   help="let other users access the mount")
    m.add_argument("--read-only", dest="read_only", action="store_true", default=None,
                   help="refuse every change (EROFS)")
    m.add_argument("--writeback", dest="writeback", action="store_true", default=None,
                   help="close() returns before the upload; fsync() still waits for S3")
    m.add_argument("-o", dest="o", action="append", default=[], metavar="KEY=VALUE,...",
                   help="options as fstab passes them (same names, underscores or dashes)")
    m.add_argument("-f", "--foreground", action="store_true", help="do not daemonize")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    u = sub.add_parser("unmount", help="unmount and wait for the daemon to finish")
    u.add_argument("mountpoint", nargs="?")
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    u.add_argument("--config", metavar="FILE", help="the mount point of this TOML file")
    u.add_argument("--if-mounted", action="store_true",
                   help="succeed quietly when nothing is mounted (systemd's ExecStopPost=)")
    # the other subcommands live with what they drive; each registers its parsers and
    # sets `run` (a function of the parsed args that returns the exit status)
    from . import ctl, fsck, gc, slurm

    for module in (ctl, slurm, fsck, gc):
        module.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mount":
            _mount(args)
        elif args.command == "unmount":
            _unmount(_unmount_target(args), args.timeout, args.if_mounted)
        else:
            sys.exit(args.run(args))
    except TierfsError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except OSError as exc:  # an environment problem we did not foresee: still one line
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}")


def _config(args: argparse.Namespace) -> MountConfig:
    options: dict[str, object] = parse_o_options(args.o)
    for _, dest, _ in _MOUNT_OPTIONS:
        if getattr(args, dest) is not None:
            options[dest] = getattr(args, dest)
    for flag in sorted(FLAG_OPTIONS):  # the boolean options that have a --flag
        if getattr(args, flag, None):
            options[flag] = True
    if args.config:
        return build_config_with_file(args.config, args.source, args.mountpoint, options)
    if not args.source or not args.mountpoint:
        raise UsageError("mount needs SOURCE and MOUNTPOINT (or --config FILE)")
    return build_config(args.source, args.mountpoint, options)


def _default_log_file(cfg: MountConfig) -> str:
    return Layout(cfg.effective_cache_dir).log


def _setup_logging(cfg: MountConfig, background: bool) -> str | None:
    """Log to the log file (--log-file, or CACHE_DIR/tierfs.log in the background) or
    stderr; returns the log file, if any."""
    handler: logging.Handler
    log_file = cfg.log_file or (_default_log_file(cfg) if background else None)
    if log_file:
        handler = _log_file_handler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    if not log_file and sdnotify.stderr_is_journal():  # under systemd
        handler.setFormatter(sdnotify.JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log_level.upper())
    # botocore logs request details (never credentials) at DEBUG; keep it quiet otherwise
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return log_file


_fatal_log: IO[str] | None = None  # open for the life of the daemon: faulthandler writes to its fd


def _report_fatal_errors(log_file: str | None) -> None:
    """Make every way the daemon can die leave its reason where the log is.

    - a native crash (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL: a C extension, LMDB on a
      damaged file) dumps the Python stack of every thread: faulthandler, into the log
      file when there is one, else stderr (the terminal, or systemd's journal);
    - an exception nothing caught, in the main thread or any other, is logged with its
      traceback (in the background, the process's stderr is the log file as well, so even
      output that bypasses logging lands there).
    """
    global _fatal_log
    log = logging.getLogger("tierfs")
    try:
        if log_file:
            _fatal_log = open(log_file, "a")  # held until the process exits
            faulthandler.enable(file=_fatal_log, all_threads=True)
        else:
            faulthandler.enable(all_threads=True)
    except (OSError, RuntimeError, ValueError, AttributeError) as exc:  # e.g. no stderr at all
        log.warning("native crashes will not be logged (faulthandler: %s)", exc)

    def uncaught(exc_type: type[BaseException], exc: BaseException,
                 tb: TracebackType | None) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
            return
        log.critical("the daemon stopped: uncaught %s", exc_type.__name__,
                     exc_info=(exc_type, exc, tb))

    def uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        exc = args.exc_value
        log.error("uncaught %s in thread %s", args.exc_type.__name__, name,
                  exc_info=(args.exc_type, exc, args.exc_traceback) if exc is not None else None)

    sys.excepthook = uncaught
    threading.excepthook = uncaught_in_thread


def _log_file_handler(path: str) -> logging.FileHandler:
    """The log file opened for appending; a problem with it is named as such (it cannot be
    the place to look for why the mount failed)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        return logging.FileHandler(path)
    except OSError as exc:
        raise UsageError(f"invalid log-file {path}: cannot write it: "
                         f"{exc.strerror or exc}") from None


def check_fuse_device(path: str = "/dev/fuse") -> None:
    """FUSE needs read-write access to /dev/fuse; without it libfuse prints its own lines
    and pyfuse3 raises a bare RuntimeError, so check first and say it in one line."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        hint = ("load the fuse module (modprobe fuse)" if exc.errno == errno.ENOENT else
                "FUSE mounts need read-write access to it (a container needs the device)")
        raise StartupError(f"cannot use {path}: {exc.strerror}: {hint}") from None


def _mount(args: argparse.Namespace) -> None:
    cfg = _config(args)
    private_umask()  # cache, index, journal, log: the mounting user's alone (tierfs/cachedir.py)
    check_fuse_device()
    # --ready-fd: a daemon started by an older `tierfs mount` (re-exec) or by hand
    ready_fd = args.ready_fd if args.foreground else _spawn_background(cfg)
    _report_fatal_errors(_setup_logging(cfg, background=ready_fd is not None))
    protect_process()  # no core dumps, not dumpable, cwd / (tierfs/mount/hardening.py)
    import trio

    from ..mount.daemon import serve

    told = False  # whether the parent (tierfs mount in the background) was answered

    def on_ready() -> None:
        nonlocal told
        _write_pid(pid_file(cfg.mountpoint))
        logging.getLogger("tierfs").info("mounted %s on %s", cfg.source, cfg.mountpoint)
        # under a Type=notify unit: active only now that the mount answers
        sdnotify.notify("READY=1", f"STATUS=mounted {cfg.source} on {cfg.mountpoint}")
        if ready_fd is not None:
            os.write(ready_fd, b"READY\n")
            os.close(ready_fd)
            told = True

    try:
        trio.run(serve, cfg, on_ready)
    except TierfsError as exc:
        logging.getLogger("tierfs").error("%s", exc)
        if ready_fd is not None and not told:
            os.write(ready_fd, f"ERROR {exc}\n".encode())
            sys.exit(1)
        raise
    except Exception as exc:  # a bug: the log says why the daemon stopped, with its traceback
        logging.getLogger("tierfs").critical("the daemon stopped: internal error", exc_info=True)
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if ready_fd is not None and not told:
            os.write(ready_fd, f"ERROR internal error: {why} (see the log)\n".encode())
        sys.exit(1)
    finally:
        try:
            os.unlink(pid_file(cfg.mountpoint))
        except OSError:
            pass


def _write_pid(path: str) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n")


def _spawn_background(cfg: MountConfig) -> int:
    """Fork the daemon. Returns only in the child (the new daemon, in a new session, its
    stdin and stdout /dev/null, its stderr the log file): the write end of the readiness
    pipe. The parent waits for the child's answer and exits with it."""
    from ..cachedir import prepare_cache_dir
    from ..mount.daemon import check_mountpoint

    # the child checks again, but input errors are reported fastest from here
    check_mountpoint(cfg.mountpoint)
    prepare_cache_dir(cfg.effective_cache_dir)
    if cfg.log_file:  # the child's log: a file it cannot write is reported here, not there
        _log_file_handler(cfg.log_file).close()
    log_file = cfg.log_file or _default_log_file(cfg)
    # the child's stderr is its log: what it prints before logging is set up, or outside
    # it (tracebacks, C libraries, faulthandler), is kept, never sent to /dev/null
    try:
        log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        null_fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise StartupError(f"cannot write the log file {log_file}: {exc.strerror}") from None
    log_start = os.fstat(log_fd).st_size  # what this start adds to the log comes after
    r, w = os.pipe()
    # no thread has started in this process (nor trio, boto3, LMDB): fork is safe here
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(r)
        os.setsid()
        os.dup2(null_fd, 0)
        os.dup2(null_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null_fd)
        os.close(log_fd)
        return w
    os.close(w)
    os.close(log_fd)
    os.close(null_fd)
    with os.fdopen(r, "rb") as pipe:
        line = pipe.readline().decode(errors="replace").strip()
    if line == "READY":
        # nothing is left to do here: skip the interpreter's teardown of every module
        # the checks imported (pydantic, trio, ...: ~0.05-0.1 s of the mount's time)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if line.startswith("ERROR "):
        _fail(line[len("ERROR "):])
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    how = (f"was killed by {_signal_name(-rc)}" if rc < 0 else f"exited with status {rc}")
    tail = _log_tail(log_file, log_start)
    if not tail:
        _fail(f"the tierfs daemon {how} before the mount was ready; {log_file} says nothing")
    # the error line, then the log's own lines (each escaped) so the reason is on screen
    head = f"the tierfs daemon {how} before the mount was ready; the last lines of {log_file}:"
    sys.stderr.write(f"tierfs: error: {printable(head)}\n" + "".join(f"  | {t}\n" for t in tail))
    sys.exit(1)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _log_tail(path: str, start: int, lines: int = 20, max_bytes: int = 64 << 10) -> list[str]:
    """The last `lines` lines written to the log after offset `start` (this start's)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            f.seek(max(start, end - max_bytes))
            data = f.read()
    except OSError:
        return []
    text = data.decode(errors="replace")
    return [printable(t) for t in text.splitlines() if t.strip()][-lines:]


def _unmount_target(args: argparse.Namespace) -> str:
    if args.mountpoint:
        return args.mountpoint
    if args.config:
        mountpoint = read_config_file(args.config).get("mountpoint")
        if mountpoint:
            return str(mountpoint)
        raise UsageError(f"no mount point: give MOUNTPOINT or `mountpoint = ...` in {args.config}")
    raise UsageError("unmount needs MOUNTPOINT (or --config FILE)")


def _unmount(mountpoint: str, timeout: float, if_mounted: bool = False) -> None:
    mp = os.path.abspath(mountpoint)
    # not os.path.ismount: it stats, and a dead daemon's mount hangs or fails
    if not is_mountpoint(mp):
        if if_mounted:  # after a clean stop the daemon has unmounted itself already
            return
        _fail(f"{mp} is not mounted")
    pid = None
    try:
        with open(pid_file(mp)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        pass
    r = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if r.returncode != 0 and (pid is None or not _alive(pid)):
        # the daemon is gone (crashed or killed): detach the dead mount lazily
        r = subprocess.run(["fusermount3", "-uz", mp], capture_output=True, text=True)
    if r.returncode != 0:
        _fail(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"cannot unmount {mp}")
    deadline = time.monotonic() + timeout
    while pid is not None and _alive(pid):
        if time.monotonic() > deadline:
            _fail(f"unmounted {mp}, but the daemon (pid {pid}) is still finishing")
        time.sleep(0.05)



def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
