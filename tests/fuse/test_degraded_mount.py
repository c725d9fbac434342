"""Degraded mode on a real mount: the object store goes away, the cache stays served.

The mount talks to the RGW through `Forwarder`, a TCP relay on 127.0.0.1 that the test
switches between relaying bytes unchanged (SigV4 signs the Host the client sent, which
the relay does not touch), refusing connections (the store's host is down) and
accepting them without ever answering (the store hangs).
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest
from helpers import payload, put_many, read_uncached, sha
from mounting import Mount, free_port, is_mounted
from rgw import s3_env

MiB = 1 << 20
TTL_S = 1.0  # --metadata-ttl: revalidations start right away
STARTUP_TIMEOUT_S = 3.0


class Forwarder:
    """127.0.0.1:port -> the RGW. forward() relays; refuse() stops listening and drops
    open connections (ECONNREFUSED from then on); hang() accepts and never answers."""

    def __init__(self, endpoint: str) -> None:
        u = urllib.parse.urlsplit(endpoint)
        self.target = (u.hostname, u.port)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.mode = "forward"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._reserved: socket.socket | None = None
        self._listen()

    # ---- switching -------------------------------------------------------------------
    def forward(self) -> None:
        self._switch("forward")

    def hang(self) -> None:
        self._switch("hang")

    def refuse(self) -> None:
        self.mode = "refuse"
        listener, self._listener = self._listener, None
        if listener is not None:
            self._shut(listener)  # wakes the accept() of the listening thread
            # keep the port: bound but not listening, connects are refused, and no other
            # socket can take it before the store "comes back"
            self._reserved = self._bind()
        self._drop_all()

    def close(self) -> None:
        self.refuse()
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def _switch(self, mode: str) -> None:
        self.mode = mode
        self._drop_all()
        if self._listener is None:
            self._listen()

    # ---- relaying --------------------------------------------------------------------
    def _bind(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        return s

    def _listen(self) -> None:
        s, self._reserved = self._reserved or self._bind(), None
        s.listen(128)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # shut by refuse()
            if self.mode == "hang":
                self._track(client)  # held open, never answered, until the next switch
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self._track(client)
            self._track(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._untrack(s)

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._open.add(s)

    def _untrack(self, s: socket.socket) -> None:
        with self._lock:
            if s not in self._open:
                return
            self._open.discard(s)
        self._shut(s)

    def _drop_all(self) -> None:
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in socks:
            self._shut(s)

    @staticmethod
    def _shut(s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def mount(mounts, fwd: Forwarder, **kw) -> Mount:
    return mounts.start("--metadata-ttl", f"{TTL_S:g}s",
                        "--startup-timeout", f"{STARTUP_TIMEOUT_S:g}s",
                        "-o", "backend_timeout=2s,backend_retries=2", proxy=fwd, **kw)


def expect_eio(fn, bound_s: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(OSError) as err:
        fn()
    assert err.value.errno == errno.EIO
    assert time.monotonic() - t0 < bound_s


def status(m: Mount) -> str:
    r = subprocess.run([sys.executable, "-m", "tierfs", "status", m.mountpoint],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return r.stdout


def until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture
def fwd(rgw):
    f = Forwarder(rgw.endpoint)
    try:
        yield f
    finally:
        f.close()


def test_store_down_cache_served_uncached_eio_remount_degraded_then_recovers(
        rgw, bucket, fwd, mounts):
    objects = {f"d/cached-{i}.bin": payload(f"c{i}", MiB + i) for i in range(3)}
    # listed first: after the cached files in listing order, the directory read-ahead
    # would fetch it before the outage
    objects["d/0-uncached.bin"] = payload("u", 2 * MiB)
    objects["other/never-listed.bin"] = b"x"
    put_many(rgw.client(), bucket, objects)
    cached = [k for k in objects if "cached-" in k]

    m = mount(mounts, fwd)
    try:
        assert sorted(os.listdir(m.path)) == ["d", "other"]
        assert sorted(os.listdir(m.path / "d")) == ["0-uncached.bin", "cached-0.bin",
                                                    "cached-1.bin", "cached-2.bin"]
        for k in cached:
            assert sha((m.path / k).read_bytes()) == sha(objects[k])
        time.sleep(0.5)  # fills reach the disk tier

        fwd.refuse()
        time.sleep(TTL_S + 0.5)  # past the TTL: every lookup revalidates, and fails
        # what is cached keeps being served: listings, stat, open and read
        assert sorted(os.listdir(m.path / "d")) == ["0-uncached.bin", "cached-0.bin",
                                                    "cached-1.bin", "cached-2.bin"]
        for k in cached:
            assert os.stat(m.path / k).st_size == len(objects[k])
            assert sha(read_uncached(m.path / k)) == sha(objects[k])
        assert os.stat(m.path / "d/0-uncached.bin").st_size == 2 * MiB
        # what is not: EIO, and fast once the store is known down
        until(lambda: m.counter("tierfs_backend_up") == 0, 30, "never noticed the outage")
        expect_eio(lambda: (m.path / "d/0-uncached.bin").read_bytes(), 5)
        expect_eio(lambda: os.listdir(m.path / "other"), 5)
        assert "NOT ANSWERING" in status(m)
        assert m.alive()
    finally:
        m.stop()
    log = m.log_text()
    assert log.count("degraded mode") == 1, log
    assert "cannot revalidate /d/" in log
    assert "Traceback" not in log and "unexpected error" not in log, log

    # a restart while the store hangs: mounted within the start-up timeout, cache served
    fwd.hang()
    t0 = time.monotonic()
    m = mount(mounts, fwd, timeout=STARTUP_TIMEOUT_S + 40)
    try:
        # bounded (interpreter start-up on a loaded machine is most of the slack), where
        # the bucket check alone used to wait out every retry: minutes
        assert time.monotonic() - t0 < STARTUP_TIMEOUT_S + 25
        assert m.counter("tierfs_backend_up") == 0
        assert sorted(os.listdir(m.path / "d"))[1] == "cached-0.bin"
        for k in cached:
            assert sha(read_uncached(m.path / k)) == sha(objects[k])
        expect_eio(lambda: (m.path / "d/0-uncached.bin").read_bytes(), 5)

        # the store is back: the mount notices by itself
        fwd.forward()
        until(lambda: m.counter("tierfs_backend_up") == 1, 30, "never recovered")
        assert sha((m.path / "d/0-uncached.bin").read_bytes()) == sha(objects["d/0-uncached.bin"])
        assert os.listdir(m.path / "other") == ["never-listed.bin"]
        assert "answering" in status(m)
    finally:
        m.stop()
    log = m.log_text()
    assert "at start-up" in log and "answers again" in log, log
    assert "Traceback" not in log, log


def test_no_index_and_no_store_fails_the_mount_with_one_line(rgw, bucket, tmp_path, fwd):
    fwd.refuse()
    (tmp_path / "mnt").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "tierfs", "mount", f"s3://{bucket}", str(tmp_path / "mnt"),
         "--endpoint-url", fwd.endpoint, "--cache-dir", str(tmp_path / "cache"),
         "-o", "backend_timeout=2s,backend_retries=2"],
        capture_output=True, text=True, timeout=120, env=s3_env(rgw), stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unreachable" in lines[0], r.stderr
    assert not is_mounted(tmp_path / "mnt")
