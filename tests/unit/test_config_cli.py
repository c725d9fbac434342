"""V8 on the real command line: every bad input is one line naming the option and the
reason, a non-zero exit and no traceback; an unwritable log file and a /dev/fuse the user
cannot open (as a second user, `nobody`) are named as such; `-o bounded_memory` works."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tierfs.cli import main as cli
from tierfs.config import build_config, parse_o_options

NOBODY = 65534


def tierfs(*args: str, user: int | None = None, namespace_setup: str | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tierfs", *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    if namespace_setup is not None:  # a private mount namespace: changes there stay there
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'{namespace_setup} && exec "$@"', "sh", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd="/")


def main_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """cli.main() as the command runs it, its stderr captured; the umask it sets for the
    daemon (private files) is given back, so later tests in this process are unaffected."""
    err = io.StringIO()
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            cli.main(argv)
    finally:
        os.umask(umask)
    return subprocess.CompletedProcess(argv, exit_.value.code, "", err.getvalue())


def one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.splitlines()
    assert r.returncode != 0, r
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("args, option, reason", [
    (["-o", "uid=4294967296"], "uid", "at most 4294967294"),
    (["-o", "gid=-1"], "gid", "at least 0"),
    (["--memory-cache-size", "99999P"], "memory-cache-size", "RAM"),
    (["--cache-size", "99999P"], "cache-size", "at most"),
    (["--endpoint-url", "http://[::1"], "endpoint-url", "IPv6"),
    (["--endpoint-url", "http://rgw :7480"], "endpoint-url", "space"),
    (["--region", "us-east-1\nforged: line"], "region", "control character"),
    (["--metadata-ttl", "nan"], "metadata-ttl", "duration"),
    (["--stall-warn", "99999999999999d"], "stall-warn", "365d"),
    (["-o", "min_free_ratio=inf"], "min-free-ratio", "number"),
    (["-o", "cache_size"], "cache-size", "needs a value"),
])
def test_bad_values_are_one_line_naming_the_option(tmp_path, args, option, reason):
    # in-process (the same main() as the command): one subprocess below proves the wiring
    line = one_line(main_in_process(["mount", "s3://bucket", str(tmp_path), *args]), option,
                    reason)
    assert "\\n" in line or "\n" not in args[-1]  # a newline is shown escaped, never sent


def test_a_region_with_a_newline_is_one_line_from_the_command(tmp_path):
    one_line(tierfs("mount", "s3://bucket", str(tmp_path), "--region", "us\nforged: x"),
             "region", "control character", "'us\\nforged: x'")


def test_no_value_options_are_the_booleans_everywhere():
    cfg = build_config("s3://bucket", "/mnt", parse_o_options(["bounded_memory,writeback,ro"]))
    assert cfg.bounded_memory and cfg.writeback and cfg.read_only
    r = tierfs("mount", "s3://bucket", "/nonexistent/tierfs-test", "-o", "bounded_memory")
    one_line(r, "mount point /nonexistent/tierfs-test does not exist")  # past the options


@pytest.mark.parametrize("args, hint", [
    (["mount", "--cache-size"], "(see 'tierfs mount --help')"),
    (["warm", "--concurrency", "0"], "(see 'tierfs warm --help')"),
    (["frobnicate"], "(see 'tierfs --help')"),
])
def test_usage_errors_name_the_real_command(args, hint):
    line = one_line(main_in_process(args))
    assert line.endswith(hint) and "tierfs tierfs" not in line


@pytest.fixture
def shared_dir():
    """A directory the second user can reach (pytest's tmp_path is root's alone)."""
    d = tempfile.mkdtemp(prefix="tierfs-v8-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_an_unwritable_log_file_is_named_as_the_problem(shared_dir):
    private = os.path.join(shared_dir, "root-only")
    os.mkdir(private, 0o700)
    log_file = os.path.join(private, "tierfs.log")
    mnt, cache = os.path.join(shared_dir, "mnt"), os.path.join(shared_dir, "cache")
    for d in (mnt, cache):
        os.mkdir(d, 0o700)  # private, as tierfs wants its cache dir (no warning about it)
        os.chown(d, NOBODY, NOBODY)
    # /dev/fuse may be root's alone (0600): the second user gets a node of its own, in a
    # private mount namespace, so the log file is the only thing in the way
    dev = os.path.join(shared_dir, "fuse")
    setup = f"rm -f {dev} && mknod -m 0666 {dev} c 10 229 && mount --bind {dev} /dev/fuse"
    for mode in ([], ["--foreground"]):  # the background parent checks before forking
        r = tierfs("mount", f"file://{shared_dir}", mnt, "--cache-dir", cache,
                   "--log-file", log_file, *mode, user=NOBODY, namespace_setup=setup)
        line = one_line(r, "log-file", log_file, "Permission denied")
        assert "see " not in line  # not "see LOG_FILE" for a file nobody can write
    assert not os.path.exists(log_file)


def test_no_access_to_dev_fuse_is_one_line(shared_dir):
    # in a private mount namespace /dev/fuse is replaced by a file only root may open
    fake = os.path.join(shared_dir, "fuse")
    open(fake, "w").close()
    os.chmod(fake, 0o600)
    mnt = os.path.join(shared_dir, "mnt")
    os.mkdir(mnt)
    os.chown(mnt, NOBODY, NOBODY)
    for mode in ([], ["--foreground"]):
        r = tierfs("mount", f"file://{shared_dir}", mnt, *mode, user=NOBODY,
                   namespace_setup=f"mount --bind {fake} /dev/fuse")
        one_line(r, "/dev/fuse", "Permission denied")
