"""Run a real tierfs mount in a subprocess for integration tests.

    from mounting import Mount
    with Mount(rgw, f"s3://{bucket}", tmp_path / "mnt", tmp_path / "cache") as m:
        data = (m.path / "a/b.bin").read_bytes()
        assert m.counter("tierfs_backend_requests_total", op="get") == 1
    # leaving the block unmounts (fusermount3 -u) and waits for the daemon to exit

The daemon runs `python -m tierfs mount SOURCE MOUNTPOINT --foreground ...` with
env=s3_env(rgw) (credentials never on argv); its stdout+stderr go to a log file next to the
mountpoint (log_text()).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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


class Mount:
    """A tierfs mount served by a child process (context manager; stop() on exit).

    rgw         the `rgw` fixture object (endpoint, credentials)
    source      "s3://BUCKET[/PREFIX]" (or "file:///dir")
    mountpoint  created if missing
    cache_dir   created by tierfs if missing; reuse it across Mounts to test persistence
    extra_args  more CLI arguments, e.g. ["--cache-size", "64M"]
    metrics_port  default: a free port
    log_path    default: MOUNTPOINT.tierfs.log next to the mountpoint (a tmp dir in tests)
    timeout     seconds to wait for the mount to appear
    start       False: construct only; call start() yourself
    """

    def __init__(self, rgw, source: str, mountpoint, cache_dir, extra_args=(),
                 *, metrics_port: int | None = None, log_path=None, timeout: float = 30.0,
                 env: dict[str, str] | None = None, start: bool = True):
        self.rgw = rgw
        self.source = source
        self.path = Path(mountpoint).absolute()
        self.mountpoint = str(self.path)
        self.cache_dir = str(Path(cache_dir).absolute())
        self.extra_args = [str(a) for a in extra_args]
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
        return [sys.executable, "-m", "tierfs", "mount", self.source, self.mountpoint,
                "--foreground", "--endpoint-url", self.rgw.endpoint,
                "--cache-dir", self.cache_dir,
                "--metrics-addr", f"127.0.0.1:{self.metrics_port}", *self.extra_args]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> "Mount":
        if self.proc is not None:
            raise MountError("already started")
        self.path.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env)
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

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
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
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

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
