"""The daemon's own process (issue 26, S7): no core dump, not dumpable, cwd `/`.

Before, a daemon started from a directory kept it as its cwd, with core dumps as the shell
allowed: SIGABRT left an 88 MB core there, holding the S3 secret and cached bytes. Here a
real background `tierfs mount` (of a file:// source: no store needed) is started from a
directory of the test with RLIMIT_CORE unlimited, and the kernel's core_pattern in the
test machine is `core` (a file in the dying process's cwd).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

from tierfs.mount.mountinfo import is_mountpoint
from tierfs.runpaths import pid_file


def _core_unlimited() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _core_limit(pid: int) -> str:
    with open(f"/proc/{pid}/limits") as f:
        [line] = [ln for ln in f if ln.startswith("Max core file size")]
    return " ".join(line.split()[4:6])  # soft hard


def _cores(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("core"))


def test_a_background_daemon_dumps_no_core_and_leaves_its_start_directory(tmp_path):
    src, mnt, start = tmp_path / "src", tmp_path / "mnt", tmp_path / "start"
    for d in (src, mnt, start):
        d.mkdir()
    (src / "hello").write_bytes(b"hello")
    cores_at_root = _cores("/")
    r = subprocess.run([sys.executable, "-m", "tierfs", "mount", f"file://{src}", str(mnt),
                        "--cache-dir", str(tmp_path / "cache")], cwd=start,
                       preexec_fn=_core_unlimited, capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    try:
        with open(pid_file(str(mnt))) as f:
            pid = int(f.read())
        assert (mnt / "hello").read_bytes() == b"hello"
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        assert _core_limit(pid) == "0 0"
        os.kill(pid, signal.SIGABRT)  # a native crash: faulthandler, then the default action
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{pid}"):
            assert time.monotonic() < deadline, "the daemon did not die"
            time.sleep(0.05)
        time.sleep(0.5)
        assert _cores(str(start)) == [] and _cores("/") == cores_at_root
        assert "Fatal Python error: Aborted" in (tmp_path / "cache" / "tierfs.log").read_text()
    finally:
        if is_mountpoint(str(mnt)):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, check=False)


def test_protect_process_in_a_process_of_its_own(tmp_path):
    code = ("import os, resource\n"
            "from tierfs.mount.hardening import dumpable, protect_process\n"
            "before = dumpable()\n"
            "protect_process()\n"
            "print(before, dumpable(), os.getcwd(), resource.getrlimit(resource.RLIMIT_CORE),"
            " os.environ['AWS_SHARED_CREDENTIALS_FILE'])\n")
    env = {**os.environ, "AWS_SHARED_CREDENTIALS_FILE": "creds/file"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       preexec_fn=_core_unlimited, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # a relative credentials file still names the same file after the chdir
    assert r.stdout.split() == ["True", "False", "/", "(0,", "0)", f"{tmp_path}/creds/file"]
