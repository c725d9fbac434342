"""Real tierfs mounts in subprocesses for integration tests: the suite's one mount harness.

    def test_reads(rgw, bucket, mounts):     # `mounts`: a Mounts of tests/conftest.py
        with mounts.start("--chunk-size", "1M") as m:
            data = (m.path / "a/b.bin").read_bytes()
            assert m.counter("tierfs_backend_requests_total", op="get") == 1
        # leaving the block unmounts (fusermount3 -u) and waits for the daemon to exit

`Mounts` runs N daemons of a bucket under one folder, with options, through a fault proxy,
as a second user; every daemon is stopped at the end, and when the test failed the tail of
each daemon's log and the proxy's counters are printed. Each daemon is a `Mount`: `python
-m tierfs mount SOURCE MOUNTPOINT --foreground ...` with env=s3_env(rgw) (credentials never
on argv), its stdout+stderr in a log file next to the mountpoint (log_text()).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from rgw import s3_env


class MountError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0), and never one
    this process was given before: ports handed out are often bound only later (a cluster's
    nodes start together), so the kernel may offer one again (in CI a node got its own peer
    port as its metrics port: "Address already in use")."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def _unescape_mountinfo(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \040 \011 \012 \134
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def is_mounted(path: str | os.PathLike) -> bool:
    """True if `path` is a mount point. Reads /proc/self/mountinfo, so unlike
    os.path.ismount it never stat()s into a FUSE file system (which blocks while the
    daemon is not answering)."""
    path = os.path.abspath(os.fspath(path))
    try:
        with open("/proc/self/mountinfo") as f:
            return any(_unescape_mountinfo(line.split()[4]) == path for line in f)
    except OSError:
        return os.path.ismount(path)


def mounts_under(root: str | os.PathLike) -> list[str]:
    """Every mount point at or under `root` (from /proc/self/mountinfo)."""
    root = os.path.abspath(os.fspath(root))
    with open("/proc/self/mountinfo") as f:
        points = [_unescape_mountinfo(line.split()[4]) for line in f]
    return [p for p in points if p == root or p.startswith(root + "/")]


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def stop_pid(pid: int, timeout: float = 10.0) -> bool:
    """End a process that is not our child (a daemon that detached): SIGTERM by PID, wait
    up to `timeout` s, then SIGKILL and wait as long. True if it is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not pid_alive(pid):
            return True
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return not pid_alive(pid)


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(sample_name, frozenset(labels.items())): value}.
    Sample names keep their suffix (tierfs_read_bytes_total, ..._bucket, ..._count), unlike
    the family names of prometheus_client's parser (which drop _total)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sum_samples(metrics: dict[tuple[str, frozenset], float], name: str, **labels) -> float:
    """Sum of the samples called `name` (for a name without the _total suffix, NAME_total
    matches too) whose labels include all of `labels`."""
    names = {name} if name.endswith("_total") else {name, name + "_total"}
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, lbl), v in metrics.items() if n in names and want <= lbl)


def tail(text: str, n: int = 40) -> str:
    """The last `n` lines of `text`."""
    return "\n".join(text.splitlines()[-n:])


def failed(request) -> bool:
    """True if the test of this fixture `request` failed in its call (tests/conftest.py
    records the reports on the item)."""
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.failed


class ThroughProxy:
    """The `rgw` fixture object as a Mount sees it, with the endpoint of a proxy in front of
    it (tests/faults/proxy.py, or anything with .endpoint): tierfs gets --endpoint-url of
    the proxy and the RGW's credentials."""

    def __init__(self, rgw, proxy) -> None:
        self._rgw = rgw
        self._proxy = proxy

    @property
    def endpoint(self) -> str:
        return self._proxy.endpoint

    def client(self, **config):
        """A boto3 client of the RGW that talks through the proxy."""
        from rgw import RGW

        return RGW.client(self, **config)

    def __getattr__(self, name: str):
        return getattr(self._rgw, name)


class Daemon:
    """A child process whose stdout and stderr go to the file `log_path`: the base of Mount
    and of the CSI plugin (tests/csi/csikit.py)."""

    log_path: Path
    proc: subprocess.Popen | None = None
    returncode: int | None = None

    def spawn(self, argv: list[str], env: dict[str, str] | None) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env)
        return self.proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def end(self, timeout: float = 10.0) -> int:
        """SIGTERM by PID, up to `timeout` s to exit, then SIGKILL; reaped. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.returncode = self.proc.wait()
        return self.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        return tail(self.log_text(), n)


class Mount(Daemon):
    """A tierfs mount served by a child process (context manager; stop() on exit).

    rgw         the `rgw` fixture object (endpoint, credentials)
    source      "s3://BUCKET[/PREFIX]" (or "file:///dir")
    mountpoint  created if missing
    cache_dir   created by tierfs if missing; reuse it across Mounts to test persistence
    extra_args  more CLI arguments, e.g. ["--cache-size", "64M"]
    metrics_port  default: a free port
    log_path    default: MOUNTPOINT.tierfs.log next to the mountpoint (a tmp dir in tests)
    timeout     seconds to wait for the mount to appear
    wrap        a command the daemon's argv is run under, e.g. ["prlimit", "--nofile=1024",
                "--"] or ["setpriv", "--ruid", "65534", "--"] (a mount made by that user)
    label       how the harness's report names this daemon (default: its mount point)
    start       False: construct only; call start() yourself
    """

    def __init__(self, rgw, source: str, mountpoint, cache_dir, extra_args=(),
                 *, metrics_port: int | None = None, log_path=None, timeout: float = 30.0,
                 env: dict[str, str] | None = None, wrap=(), label: str = "",
                 start: bool = True):
        self.rgw = rgw
        self.wrap = [str(a) for a in wrap]
        self.label = label
        self.source = source
        self.path = Path(mountpoint).absolute()
        self.mountpoint = str(self.path)
        self.cache_dir = str(Path(cache_dir).absolute())
        self.extra_args = [str(a) for a in extra_args]
        self.own_args = list(self.extra_args)  # those not the harness's (Mounts.again)
        self.metrics_port = metrics_port or free_port()
        self.log_path = Path(log_path) if log_path else self.path.with_name(
            self.path.name + ".tierfs.log")
        self.timeout = timeout
        self.env = env if env is not None else s3_env(rgw)
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        if start:
            self.start()

    # -------------------------------------------------------------- life cycle
    @property
    def argv(self) -> list[str]:
        return [*self.wrap, sys.executable, "-m", "tierfs", "mount", self.source, self.mountpoint,
                "--foreground", "--endpoint-url", self.rgw.endpoint,
                "--cache-dir", self.cache_dir,
                "--metrics-addr", f"127.0.0.1:{self.metrics_port}", *self.extra_args]

    def start(self) -> "Mount":
        if self.proc is not None:
            raise MountError("already started")
        self.path.mkdir(parents=True, exist_ok=True)
        self.spawn(self.argv, self.env)
        deadline = time.monotonic() + self.timeout
        while not is_mounted(self.mountpoint):
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise MountError(f"tierfs mount exited with {self.returncode} before "
                                 f"{self.mountpoint} was mounted; log:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise MountError(f"{self.mountpoint} not mounted after {self.timeout}s; "
                                 f"log:\n{self.log_text()}")
            time.sleep(0.05)
        return self

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> int | None:
        """Unmount with `fusermount3 -u`, wait up to `timeout` s for the daemon to exit, then
        SIGTERM (10 s), then SIGKILL - always by PID. A mount left behind (daemon killed) is
        detached with `fusermount3 -u -z`. Returns the daemon's exit code. Idempotent."""
        if self.proc is None:
            return self.returncode
        try:
            if self.proc.poll() is None and is_mounted(self.mountpoint):
                subprocess.run(["fusermount3", "-u", self.mountpoint], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=timeout)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.end(10)
        finally:
            if self.proc.poll() is None:  # only on an exception above (e.g. Ctrl-C)
                self.proc.kill()
                self.proc.wait()
            self.returncode = self.proc.returncode
            self._detach()
        return self.returncode

    def kill9(self) -> int:
        """Crash the daemon: SIGKILL by PID, reap it, then detach the dead mount
        (fusermount3 -u -z) so the mountpoint can be mounted again. Returns -9."""
        if self.proc is None:
            raise MountError("not started")
        if self.proc.poll() is None:
            self.proc.kill()
        self.returncode = self.proc.wait()
        self._detach()
        return self.returncode

    def _detach(self) -> None:
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", self.mountpoint],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=30)

    # -------------------------------------------------------------- observation
    def metrics_text(self, timeout: float = 10.0) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """{(sample_name, frozenset(labels.items())): value} scraped from the daemon now."""
        return parse_metrics(self.metrics_text())

    def counter(self, name: str, **labels) -> float:
        """Sum of the samples `name` (or `name`_total) whose labels include `labels`,
        e.g. counter("tierfs_read_bytes_total", source="backend")."""
        return sum_samples(self.metrics(), name, **labels)


class Mounts:
    """The mount harness of the tests: tierfs daemons of one bucket under one folder.

        mounts = Mounts(rgw, bucket, tmp_path)     # or the `mounts` fixture (tests/conftest.py)
        m = mounts.start("--writeback")             # ROOT/mnt, cache ROOT/cache,
                                                    # log ROOT/mnt.tierfs.log
        m = mounts.start(mnt="b", cache="cache-b", source=f"s3://{bucket}/team")
        ms = [mounts.mount(mnt=f"n{i}", cache=f"c{i}") for i in range(8)]  # not started
        mounts.start_all(ms)                        # 8 daemons started at once (threads)
        m = mounts.remount(m, "--metadata-ttl", "0")  # clean unmount, mount again: m's args + these
        m = mounts.restart_after_crash(m)           # kill -9, mount again on the same cache dir
        m = mounts.again(m)                         # a new mount like m, once m is gone
        print(mounts.report())                      # each daemon's log tail, the proxy's counters
        mounts.close(failed=True)                   # stop every daemon, then print the report

    A Mount it returns is also a context manager (`with mounts.start() as m:` unmounts at
    the end of the block); whatever is still mounted is stopped by close().

    args     arguments of every mount, before each start's own
    proxy    a fault proxy (tests/faults/proxy.py, or anything with .endpoint) the daemons
             talk to instead of the RGW (start(direct=True) bypasses it); close() heals it
             first, and its counters are part of the report
    timeout  seconds a mount may take to appear (start(timeout=) for one mount)
    log      one log file (its name under ROOT) shared by every mount, instead of
             MNT.tierfs.log each
    root     None: a fresh 0755 folder under /tmp, removed by close(): a second user can
             reach the mount points there (pytest's tmp_path lies under a 0700 folder)
    start(as_uid=65534) runs the daemon with that real uid (a mount the kernel records as
    made by that user); start(wrap=[...]) runs it under a command (prlimit ...).
    """

    def __init__(self, rgw, bucket: str, root=None, *, args=(), proxy=None,
                 timeout: float = 30.0, log: str | None = None) -> None:
        self.rgw = rgw
        self.bucket = bucket
        self.proxy = proxy
        self.via = ThroughProxy(rgw, proxy) if proxy is not None else rgw
        self.args = [str(a) for a in args]
        self.timeout = timeout
        self.own_root = root is None
        if root is None:
            root = tempfile.mkdtemp(prefix="tierfs-", dir="/tmp")
            os.chmod(root, 0o755)
        self.root = Path(root)
        self.log = self.root / log if log else None
        self.all: list[Mount] = []
        self._s3 = None

    @classmethod
    @contextlib.contextmanager
    def of_test(cls, request, *args, **options):
        """Mounts(*args, **options) for a fixture: `with Mounts.of_test(request, rgw, bucket,
        tmp_path) as h: yield h` closes it at the end, with the report if the test failed."""
        harness = cls(*args, **options)
        try:
            yield harness
        finally:
            harness.close(failed(request))

    @property
    def s3(self):
        """A boto3 client of the RGW itself (never through the proxy)."""
        if self._s3 is None:
            self._s3 = self.rgw.client()
        return self._s3

    # -------------------------------------------------------------- starting
    def mount(self, *extra: str, mnt: str = "mnt", cache: str = "cache",
              source: str | None = None, direct: bool = False, proxy=None,
              timeout: float | None = None, as_uid: int | None = None, wrap=(),
              label: str = "") -> Mount:
        """A Mount of the harness, not started yet (start() starts it). direct=True: to the
        RGW itself; proxy=P: through P instead of the harness's proxy."""
        if as_uid is not None:
            wrap = ["setpriv", "--ruid", str(as_uid), "--", *wrap]
        via = self.via if proxy is None else ThroughProxy(self.rgw, proxy)
        m = Mount(self.rgw if direct else via, source or f"s3://{self.bucket}",
                  self.root / mnt, self.root / cache, [*self.args, *extra], start=False,
                  timeout=self.timeout if timeout is None else timeout, log_path=self.log,
                  wrap=wrap, label=label)
        m.own_args = [str(a) for a in extra]
        self.all.append(m)
        return m

    def start(self, *extra: str, **kw) -> Mount:
        """A started mount with the harness's arguments plus `extra`; keywords as mount()."""
        return self.mount(*extra, **kw).start()

    def start_all(self, ms: list[Mount]) -> list[Mount]:
        """Start these mounts (of mount()) at once (threads); on any failure stop those that
        started and raise the first error."""
        errors: list[BaseException] = []

        def one(m: Mount) -> None:
            try:
                m.start()
            except BaseException as e:  # noqa: BLE001 - raised below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(m,)) for m in ms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop_all(ms)
            raise errors[0]
        return ms

    def again(self, m: Mount, *extra: str, cache: str | None = None, keep_args: bool = True,
              timeout: float | None = None) -> Mount:
        """A new mount like `m` (mount point, log, cache dir or ROOT/`cache`, endpoint, wrap)
        once `m` is gone, with m's own arguments plus `extra` (keep_args=False: `extra`
        only), after the harness's."""
        own = [*(m.own_args if keep_args else ()), *extra]
        new = Mount(m.rgw, m.source, m.path, self.root / cache if cache else m.cache_dir,
                    [*self.args, *own], log_path=m.log_path, start=False, wrap=m.wrap,
                    timeout=m.timeout if timeout is None else timeout, label=m.label)
        new.own_args = own
        self.all.append(new)
        return new.start()

    def remount(self, m: Mount, *extra: str, **kw) -> Mount:
        """Clean unmount of `m`, then again(m, *extra, **kw)."""
        m.stop()
        return self.again(m, *extra, **kw)

    def restart_after_crash(self, m: Mount, *extra: str, **kw) -> Mount:
        """kill -9 of `m` (if still alive), then again(m, *extra, **kw)."""
        m.kill9()
        return self.again(m, *extra, **kw)

    # -------------------------------------------------------------- stopping
    def stop_all(self, mounts: list[Mount] | None = None) -> None:
        """Stop every mount (or those given): the mount points at once (threads), the mounts
        of one mount point newest first, so that stopping an old one never detaches a newer
        one. Errors are printed, and the others stopped."""
        groups: dict[str, list[Mount]] = {}
        for m in self.all if mounts is None else mounts:
            groups.setdefault(m.mountpoint, []).append(m)

        def stop(ms: list[Mount]) -> None:
            for m in reversed(ms):
                try:
                    m.stop()
                except Exception as e:  # keep stopping the others
                    print(f"stopping {m.mountpoint}: {e!r}")

        threads = [threading.Thread(target=stop, args=(ms,)) for ms in groups.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self, failed: bool = False, lines: int = 80) -> None:
        """Heal the proxy (a store that answers again lets every mount stop cleanly), stop
        every mount, print the report if the test failed; a folder of its own is removed
        (unless a daemon is left alive)."""
        try:
            if self.proxy is not None and hasattr(self.proxy, "heal"):
                self.proxy.heal()
            self.stop_all()
        finally:
            if failed:
                print(self.report(lines))
            if self.own_root and not any(m.alive() for m in self.all):
                shutil.rmtree(self.root, ignore_errors=True)

    # -------------------------------------------------------------- diagnostics
    def log_mark(self) -> dict[Path, int]:
        """The size of every log file now: report(since=mark) shows only what came after."""
        out = {}
        for m in self.all:
            try:
                out[m.log_path] = m.log_path.stat().st_size
            except FileNotFoundError:
                out[m.log_path] = 0
        if self.log is not None:
            out.setdefault(self.log, self.log.stat().st_size if self.log.exists() else 0)
        return out

    def log_since(self, mark: dict[Path, int]) -> str:
        """What the daemons logged after log_mark() returned `mark` (every log file)."""
        out = []
        for path, offset in mark.items():
            out.append(self._read_log(path, offset))
        return "".join(out)

    @staticmethod
    def _read_log(path: Path, offset: int = 0) -> str:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def report(self, lines: int = 80, since: dict[Path, int] | None = None) -> str:
        """The tail of each daemon's log (each file once; from the `since` mark if given),
        and the proxy's counters."""
        out, seen = [], set()
        for m in self.all:
            if m.log_path in seen:
                continue
            seen.add(m.log_path)
            text = self._read_log(m.log_path, (since or {}).get(m.log_path, 0)).splitlines()
            users = [x for x in self.all if x.log_path == m.log_path]
            who = ", ".join(f"{x.label or x.mountpoint} pid {x.pid} exit {x.returncode}"
                            for x in users)
            out.append(f"----- tail of {m.log_path} ({len(text)} lines"
                       f"{' since the mark' if since else ''}, last {lines}; {who})")
            out.extend(text[-lines:])
        if self.proxy is not None and hasattr(self.proxy, "requests_by_op"):
            out.append(f"----- proxy: requests {self.proxy.requests_by_op()}, "
                       f"faults {self.proxy.injected_by_kind()}")
        return "\n".join(out)
