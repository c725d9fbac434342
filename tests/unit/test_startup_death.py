"""No silent death (issue 9 item 6): a background daemon that dies says why, in tierfs.log
and on the stderr of `tierfs mount`; a daemon that stops normally says why in the log.

The deaths are injected with a sitecustomize module on PYTHONPATH (tests only: tierfs has
no hook for it) that replaces trio.run, which the daemon calls once logging and
faulthandler are set up: a native crash (SIGSEGV, SIGABRT) or text written straight to
stderr followed by an exit. faulthandler's dump is best effort, so of it only the header
line "Fatal Python error" is asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tierfs.mount.mountinfo import is_mountpoint
from tierfs.runpaths import pid_file

HOOK = textwrap.dedent('''
    import os
    mode = os.environ.get("TIERFS_TEST_DEATH")
    if mode:
        import faulthandler, resource, sys
        import trio

        def die(*args, **kwargs):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
            if mode == "segv":
                faulthandler._sigsegv()
            elif mode == "abort":
                faulthandler._sigabrt()
            sys.stderr.write("injected: the daemon's last words, on stderr only\\n")
            sys.stderr.flush()
            os._exit(3)

        trio.run = die
''')


@pytest.fixture
def setup(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    src, mnt, cache = tmp_path / "src", tmp_path / "mnt", tmp_path / "cache"
    for d in (src, mnt):
        d.mkdir()
    (src / "hello").write_bytes(b"hello")
    return hooks, src, mnt, cache


def hooked(hooks, mode: str) -> dict[str, str]:
    """The environment that makes the daemon die in `mode` (PYTHONPATH kept, hooks first)."""
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "TIERFS_TEST_DEATH": mode}


def tierfs(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode,signame", [("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_native_crash_at_start_is_in_the_log_and_on_the_parents_stderr(setup, mode, signame):
    hooks, src, mnt, cache = setup
    r = tierfs("mount", f"file://{src}", str(mnt), "--cache-dir", str(cache),
               env=hooked(hooks, mode))
    assert r.returncode != 0
    assert f"killed by {signame}" in r.stderr
    assert "Fatal Python error" in r.stderr, r.stderr
    log = (cache / "tierfs.log").read_text(errors="replace")
    assert "Fatal Python error" in log
    assert [t for t in r.stderr.splitlines() if t.startswith("tierfs: error:")]
    assert not is_mountpoint(str(mnt))


def test_words_on_stderr_at_start_are_in_the_log_and_on_the_parents_stderr(setup):
    hooks, src, mnt, cache = setup
    cache.mkdir(mode=0o700)
    (cache / "tierfs.log").write_text("an old line from an earlier mount\n")
    (cache / "tierfs.log").chmod(0o600)
    r = tierfs("mount", f"file://{src}", str(mnt), "--cache-dir", str(cache),
               env=hooked(hooks, "exit"))
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    errors = [t for t in lines if t.startswith("tierfs: error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("tierfs: error: the tierfs daemon exited with status 3 before "
                               "the mount was ready; the last lines of ")
    assert "  | injected: the daemon's last words, on stderr only" in lines
    assert not any("an old line" in t for t in lines), "only this start's lines"
    assert "injected: the daemon's last words" in (cache / "tierfs.log").read_text()


def _wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon {pid} still running")


def test_the_log_says_why_the_daemon_stopped(setup):
    _, src, mnt, cache = setup
    log = cache / "tierfs.log"
    args = ("mount", f"file://{src}", str(mnt), "--cache-dir", str(cache))
    r = tierfs(*args)
    assert r.returncode == 0, r.stderr
    try:
        assert (mnt / "hello").read_bytes() == b"hello"
        r = tierfs("unmount", str(mnt))
        assert r.returncode == 0, r.stderr
        assert f"unmounted {mnt}: unmounted from outside" in log.read_text()

        r = tierfs(*args)
        assert r.returncode == 0, r.stderr
        with open(pid_file(str(mnt))) as f:
            pid = int(f.read())
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
        assert f"unmounted {mnt}: stopped by signal SIGTERM" in log.read_text()
    finally:
        if is_mountpoint(str(mnt)):
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
