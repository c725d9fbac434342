"""A real systemd (PID 1) in systemd-nspawn, for running tierfs's units.

PID 1 of the test machines is not systemd, so units cannot run on the host. Instead:

    root = rootfs()              # debootstrap --variant=minbase, cached (below)
    with Container(root, binds) as c:
        c.run("systemctl", "start", "tierfs@x.service")

rootfs() builds a Debian tree once per machine and version of the package list, under
/var/tmp/tierfs-nspawn/ (about 40 s; later runs reuse it). The container boots it with
--volatile=overlay, so nothing a test does lands in the cached tree. It shares the host
network (no --private-network): the tests' Ceph RGW on 127.0.0.1 is reachable. Python
and tierfs are not installed in it: the checkout (with its .venv) and the interpreter the
venv links to are bound read-only at their host paths, so the venv works unchanged.

Stop is by PID only: `systemctl poweroff` inside, then SIGKILL of the container's PID 1
(which ends its PID namespace) and of the systemd-nspawn process if they outlive it.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

CACHE = Path("/var/tmp/tierfs-nspawn")
SUITE = "bookworm"
# python3: the venv's interpreter when it is Debian's own (then nothing is bound over /usr);
# libssl3/libffi8: what a pyenv-built interpreter links to; fuse3: fusermount3 + libfuse3
PACKAGES = "systemd,systemd-sysv,dbus,fuse3,procps,python3,libssl3,libffi8"
VERSION = 1  # bump to rebuild every cached tree
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}


class NspawnError(RuntimeError):
    pass


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 .sources or sources.list)."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")) + ["/etc/apt/sources.list"]:
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        for url in re.findall(r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, re.MULTILINE):
            if url.rstrip("/").endswith("/debian"):
                return url
    return "http://deb.debian.org/debian"


def rootfs(log=sys.stderr) -> Path:
    """The cached Debian tree, built first if missing (under a lock: one builder at a time)."""
    key = hashlib.sha256(f"{VERSION} {SUITE} {PACKAGES}".encode()).hexdigest()[:12]
    root = CACHE / f"{SUITE}-{key}"
    if (root / "etc/os-release").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "etc/os-release").exists():
            return root
        for stale in CACHE.glob(".*.partial-*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = CACHE / f".{root.name}.partial-{os.getpid()}"
        cmd = ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE,
               str(partial), debian_mirror()]
        print(f"nspawn: building {root} ({' '.join(cmd)})", file=log, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise NspawnError(f"debootstrap failed ({r.returncode}):\n{r.stdout[-3000:]}"
                              f"{r.stderr[-3000:]}")
        os.rename(partial, root)  # atomic: a tree is either complete or absent
    return root


def python_binds() -> list[str]:
    """Host paths the venv needs at the same place inside: the checkout (.venv, and the
    sources of the editable install) and the base interpreter unless it is /usr's."""
    repo = Path(__file__).resolve().parents[2]
    base = Path(sys.base_prefix).resolve()
    binds = [str(repo)]
    if not str(base).startswith("/usr"):
        binds.append(str(base))
    return binds


class Container:
    """A booted container (context manager). binds: (host, inside, writable) triples."""

    def __init__(self, root: Path, binds: list[tuple[str, str, bool]], log_path: Path,
                 boot_timeout: float = 60.0):
        self.root = root
        self.name = f"tierfs-{uuid.uuid4().hex[:8]}"
        self.log_path = log_path
        args = ["systemd-nspawn", "-D", str(root), "--boot", "--volatile=overlay",
                "--register=no", "--keep-unit", "-M", self.name, "--console=read-only",
                "--bind=/dev/fuse"]
        for path in python_binds():
            args.append(f"--bind-ro={path}")
        for host, inside, writable in binds:
            args.append(f"--bind{'' if writable else '-ro'}={host}:{inside}")
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=CLEAN_ENV)
        self.leader: int | None = None
        try:
            self.leader = self._find_leader(boot_timeout)
            self._wait_booted(boot_timeout)
        except BaseException:
            self.stop()
            raise

    def _find_leader(self, timeout: float) -> int:
        """The container's PID 1 as the host sees it: systemd-nspawn's child."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NspawnError(f"systemd-nspawn exited with {self.proc.returncode}; "
                                  f"log:\n{self.log_text()}")
            try:
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
            except OSError:
                children = ""
            for pid in map(int, children.split()):
                try:  # wait for the exec: until then the child is still systemd-nspawn
                    if os.readlink(f"/proc/{pid}/exe").endswith("/systemd"):
                        return pid
                except OSError:
                    pass
            time.sleep(0.05)
        raise NspawnError(f"no container init after {timeout}s; log:\n{self.log_text()}")

    def _wait_booted(self, timeout: float) -> None:
        # until PID 1 has created /run/systemd/system and its socket, systemctl says
        # "offline" or fails ("Failed to connect to bus"); then --wait blocks until the
        # boot has finished
        deadline = time.monotonic() + timeout
        while True:
            r = self.run("systemctl", "is-system-running", "--wait", timeout=timeout,
                         check=False)
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                return
            if state not in ("", "offline") or time.monotonic() > deadline:
                raise NspawnError(f"container boot ended {state!r} ({r.stderr.strip()}); "
                                  f"log:\n{self.log_text()}")
            time.sleep(0.1)

    def run(self, *cmd: str, input: bytes | str | None = None, timeout: float = 120.0,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a command inside (all of the container's namespaces), with a clean env."""
        if self.leader is None:
            raise NspawnError("container not running")
        r = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *cmd], input=input,
                           capture_output=True, timeout=timeout, env=CLEAN_ENV,
                           text=not isinstance(input, bytes))
        if check and r.returncode != 0:
            raise NspawnError(f"{' '.join(cmd)} exited with {r.returncode}:\n"
                              f"{r.stdout}{r.stderr}")
        return r

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout

    def mounted(self, path: str) -> bool:
        mountinfo = self.run("cat", "/proc/self/mountinfo").stdout
        return any(line.split()[4] == path for line in mountinfo.splitlines())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """Power off; if it does not end in time, SIGKILL its PID 1, then systemd-nspawn."""
        try:
            if self.leader is not None and self.proc.poll() is None:
                self.run("systemctl", "poweroff", check=False, timeout=timeout)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _kill(self.leader)
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
            self.leader = None
            self._log.close()

    def __enter__(self) -> "Container":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
