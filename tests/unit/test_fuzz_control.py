"""Property-based fuzz of the control socket against a live daemon (hypothesis, ~100
connections): random bytes, random JSON lines and near-valid requests each get typed
reply lines (parsed by the client's own models) ending in one final answer, or the
connection closed; the daemon never stops and keeps serving reads byte-exact. Plus the
V4/V7 rows on the real socket: NaN/Infinity/absurd TTLs refused, status still answers.

The daemon serves a local directory (file:// source), so no object store is needed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierfs.cli import ctl

from tierfs import protocol
from tierfs.mount.mountinfo import is_mountpoint
from tierfs.runpaths import control_socket

pytestmark = pytest.mark.mount
DATA = {"a.bin": os.urandom(300_000), "dir/b.txt": b"hello\n" * 1000}


class Daemon:
    def __init__(self, root):
        self.src, self.mnt, self.cache = root / "src", root / "mnt", root / "cache"
        for name, data in DATA.items():
            (self.src / name).parent.mkdir(parents=True, exist_ok=True)
            (self.src / name).write_bytes(data)
        self.mnt.mkdir()
        self.log = open(root / "tierfs.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierfs", "mount", f"file://{self.src}", str(self.mnt),
             "--foreground", "--cache-dir", str(self.cache), "--chunk-size", "64K",
             "--cache-size", "16M", "--memory-cache-size", "1M"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not is_mountpoint(str(self.mnt)) or not os.path.exists(self.socket):
            assert self.proc.poll() is None, (root / "tierfs.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not mount in 60 s"
            time.sleep(0.05)

    @property
    def socket(self) -> str:
        return control_socket(str(self.mnt), os.getuid())

    def reads_exact(self) -> None:
        assert self.proc.poll() is None, "the daemon stopped"
        for name, data in DATA.items():
            assert (self.mnt / name).read_bytes() == data

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)
        self.log.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("fuzz-control"))
    try:
        yield d
    finally:
        d.stop()


def exchange(path: str, raw: bytes, close_write: bool = False) -> list[dict] | None:
    """Send raw bytes; return the reply lines (each checked by the client's models), or
    None if the daemon closed without answering."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(path)
        try:
            s.sendall(raw)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            return None  # the daemon refused the rest of an oversize request
        data = b""
        while True:
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            if data.endswith(b"\n") and b'"ok"' in data.rsplit(b"\n", 2)[-2]:
                break  # the final line
    if not data:
        return None
    assert data.endswith(b"\n"), data[-200:]
    lines = data.rstrip(b"\n").split(b"\n")
    replies = [protocol.parse_reply(line) for line in lines]
    assert all(isinstance(r, protocol.Event) for r in replies[:-1])
    if not isinstance(replies[-1], protocol.Final):
        # closing our end cancels the request (docs/control.md): progress, then nothing
        assert close_write, lines[-1]
        return [json.loads(line) for line in lines]
    if not replies[-1].ok:
        error = replies[-1].error or ""
        assert error and "\n" not in error and "Traceback" not in error
    return [json.loads(line) for line in lines]


_FIELDS = ["v", "op", "paths", "job", "pin", "pin_ttl", "concurrency", "check", "all"]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30),
              st.sampled_from([1, 2, "status", "warm", "evict", "unpin", "a.bin", "dir/*",
                               ["a.bin"], ["nope/**"], "42", "4\n2", 1e308])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
requests = st.one_of(
    st.binary(max_size=400),  # anything at all
    st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6).map(
        lambda d: json.dumps(d).encode() + b"\n"),
    st.fixed_dictionaries(  # near-valid: the right version and a real op
        {"v": st.just(1), "op": st.sampled_from(["status", "warm", "evict", "unpin"])},
        optional={k: json_values for k in _FIELDS[2:]}).map(
        lambda d: json.dumps(d).encode() + b"\n"),
    st.sampled_from([b'{"v":1,"op":"warm","paths":["a.bin"],"pin_ttl":NaN}\n',
                     b'{"v":1,"op":"warm","paths":["a.bin"],"pin_ttl":Infinity}\n',
                     b'{"v":1,"op":"warm","paths":["a.bin"],"pin_ttl":1e300}\n',
                     b'{"v":1,"op":"status"}', b"\n", b"\xff\xfe\n", b"[" * 5000 + b"\n"]),
)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(raw=requests, close_write=st.booleans())
def test_random_requests_get_typed_answers_and_the_daemon_keeps_serving(daemon, raw,
                                                                       close_write):
    exchange(daemon.socket, raw, close_write=close_write or not raw.endswith(b"\n"))
    assert daemon.proc.poll() is None


def test_after_the_fuzz_reads_and_status_still_work(daemon):
    daemon.reads_exact()
    (mount,) = [m for m in ctl.tierfs_mounts() if m.mountpoint == str(daemon.mnt)]
    st = ctl.request(mount, "status")
    # whatever the fuzz pinned (a NaN or endless TTL cannot have been among it) shows
    for owner in st["pinned"]["owners"]:
        assert owner["expires"] is None or owner["expires"] < time.time() + 366 * 86400


def test_nan_infinity_and_absurd_ttls_are_refused_on_the_socket(daemon):
    for ttl in (b"NaN", b"Infinity", b"-Infinity", b"1e300", b"0", b"-5"):
        (reply,) = exchange(daemon.socket, b'{"v":1,"op":"warm","paths":["a.bin"],"pin_ttl":'
                            + ttl + b"}\n")
        why = reply["error"]
        assert reply["ok"] is False and ("pin" in why or ttl.decode().lstrip("-") in why), why
    (reply,) = exchange(daemon.socket, json.dumps(
        {"v": 1, "op": "warm", "paths": ["a.bin"], "job": "1\nforged"}).encode() + b"\n")
    assert reply["ok"] is False and "job" in reply["error"]
    big = json.dumps({"v": 1, "op": "warm", "paths": ["x" * 4000] * 700}).encode() + b"\n"
    answer = exchange(daemon.socket, big)
    assert answer is None or ("larger than" in answer[-1]["error"])
    # a client that connects and says nothing does not stop others
    with socket.socket(socket.AF_UNIX) as silent:
        silent.connect(daemon.socket)
        assert exchange(daemon.socket, b'{"v":1,"op":"status"}\n')[-1]["ok"] is True
    daemon.reads_exact()


def test_the_cli_refuses_bad_values_before_asking(daemon, tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)

    target = str(daemon.mnt / "a.bin")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args, text in [
        (("warm", target, "--pin-ttl", "99999999999999d"), "pin-ttl"),
        (("warm", target, "--concurrency", "0"), "--concurrency"),
        (("warm", target, "--job", "9" * 100_000), "--job"),
        (("warm", target, "--job", "12\nforged: line"), "--job"),
        (("unpin", "--job", "12\nforged"), "--job"),
        (("warm", "--manifest", "/dev/zero", target), "not a regular file"),
        (("warm", "--manifest", str(fifo), target), "not a regular file"),
    ]:
        r = run(*args)
        lines = r.stderr.splitlines()
        assert r.returncode != 0 and len(lines) == 1 and text in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr and len(lines[0]) < 400
    big = tmp_path / "big.txt"
    big.write_text(f"{target}\n" * 40_000)  # > 1 MiB
    r = run("warm", "--manifest", str(big))
    assert r.returncode != 0 and "larger than 1.0 MiB" in r.stderr
    r = run("warm", target, "--pin-ttl", "365d", "--job", "1234_5", "--concurrency", "2")
    assert r.returncode == 0, r.stderr
    r = run("status", str(daemon.mnt))
    assert r.returncode == 0 and "job:1234_5" in r.stdout, r.stdout + r.stderr
    # (every tierfs mount of the node is asked: other tests' mounts may answer otherwise)
    r = run("unpin", "--job", "1234_5")
    assert f"{daemon.mnt}: released job:1234_5" in r.stdout, r.stdout + r.stderr
