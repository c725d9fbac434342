"""The control protocol (tierfs/protocol.py) on both ends, without a mount: the daemon's
request parsing and line reading (V4: NaN, Infinity and absurd TTLs refused; size and
idle limits), and the client's reply handling (V7: a non-object line, an oversize or
endless reply, a malformed result are one ControlError line, never a crash)."""

from __future__ import annotations

import json
import socket
import threading

import pytest
import trio
import trio.testing

from tierfs.mount import control

from tierfs.cli import ctl

from tierfs import protocol
from tierfs.errors import UsageError
from tierfs.protocol import (MAX_REPLY, MAX_REQUEST, UnpinRequest, WarmRequest,
                             parse_reply, parse_request)


def req(**fields) -> bytes:
    return json.dumps({"v": 1, **fields}).encode()


@pytest.mark.parametrize("line, text", [
    (b'{"v": 1, "op": "warm", "paths": ["a"], "pin_ttl": NaN}', "NaN"),
    (b'{"v": 1, "op": "warm", "paths": ["a"], "pin_ttl": Infinity}', "Infinity"),
    (b'{"v": 1, "op": "warm", "paths": ["a"], "pin_ttl": -Infinity}', "Infinity"),
    (req(op="warm", paths=["a"], pin_ttl=99999999999999 * 86400), "pin-ttl"),
    (req(op="warm", paths=["a"], pin_ttl=0), "pin-ttl"),
    (req(op="warm", paths=["a"], concurrency=0), "concurrency"),
    (req(op="warm", paths=["a"], concurrency=2.0), "concurrency"),
    (req(op="warm", paths=["a"], check="yes"), "check"),
    (req(op="warm", paths=["a"], job="1\nforged line"), "control character"),
    (req(op="warm", paths=["a"], job="9" * 100_000), "job"),
    (req(op="warm", paths=["a\0b"]), "NUL"),
    (req(op="warm", paths=[]), "paths must be"),
    (req(op="warm", paths="a"), "paths must be"),
    (req(op="unpin", job="1", all=True), "one of them"),
    (req(op="unpin"), "one of them"),
    (req(op="fly"), "unknown request"),
    (json.dumps({"v": 2, "op": "status"}).encode(), "protocol version 2"),
    (b"[1, 2]", "JSON object"),
    (b"\"status\"", "JSON object"),
    (b"\xff\xfe", "UTF-8"),
    (b"[" * 100_000, "nests too deeply"),
    (b"hello", "not JSON"),
])
def test_bad_requests_are_one_usage_error(line, text):
    with pytest.raises(UsageError) as info:
        parse_request(line)
    message = str(info.value)
    assert text in message and "\n" not in message and len(message) < 400


def test_good_requests_are_typed():
    r = parse_request(req(op="warm", paths=["a", "b/*"], job="42", pin_ttl=3600,
                          concurrency=4, future_field={"x": 1}))
    assert isinstance(r, WarmRequest) and r.pin_owner == "job:42" and r.pin_ttl == 3600.0
    assert parse_request(req(op="warm", paths=["a"], check=True, pin=True)).pin_owner is None
    assert parse_request(req(op="unpin", all=True)) == UnpinRequest(all=True)
    # the client encodes with the same model, so what it sends parses back as it was
    w = WarmRequest(paths=["x"], job="7", pin_ttl=60.0)
    assert parse_request(w.encode().rstrip(b"\n")) == w
    with pytest.raises(UsageError, match="larger than"):
        WarmRequest(paths=["p" * 4000] * 600).encode()


@pytest.mark.parametrize("line", [b"[]", b"42", b"null", b'{"v": 1}', b'{"v": 2, "ok": true}',
                                  b'{"v": 1, "ok": "yes"}', b'{"v": 1, "ok": true, "x": NaN}',
                                  b'{"v": 1, "event": 5}', b"\xff"])
def test_bad_reply_lines_are_protocol_errors(line):
    with pytest.raises(protocol.ProtocolError):
        parse_reply(line)


async def test_the_daemon_reads_one_bounded_line_within_the_idle_timeout(monkeypatch):
    monkeypatch.setattr(control, "IDLE_TIMEOUT_S", 0.2)
    client, server = trio.testing.memory_stream_pair()
    with pytest.raises(UsageError, match="no complete request within"):
        await control._read_line(server)  # connected, silent

    client, server = trio.testing.memory_stream_pair()
    await client.send_all(b'{"v": 1, "op": "status"}\nrest')
    assert await control._read_line(server) == b'{"v": 1, "op": "status"}'

    client, server = trio.testing.memory_stream_pair()
    monkeypatch.setattr(control, "IDLE_TIMEOUT_S", 30)

    async def flood() -> None:
        for _ in range(MAX_REQUEST // (1 << 16) + 2):
            await client.send_all(b"x" * (1 << 16))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flood)
        with pytest.raises(UsageError, match="request larger than"):
            await control._read_line(server)
        nursery.cancel_scope.cancel()


# ---- the client against a fake daemon ------------------------------------------------------


class FakeDaemon:
    """A unix socket that answers every connection with the given bytes, then closes."""

    def __init__(self, path: str, answer: bytes):
        self.answer = answer
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.makefile("rb").readline()
            try:
                conn.sendall(self.answer)
            except OSError:
                pass  # the client gave up on an endless reply

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    path = str(tmp_path / "ctl.sock")
    monkeypatch.setattr(ctl, "control_socket", lambda mountpoint, uid: path)
    daemons = []

    def start(answer: bytes) -> ctl.TierfsMount:
        daemons.append(FakeDaemon(path, answer))
        return ctl.TierfsMount("/mnt/fake", 0)

    yield start
    for d in daemons:
        d.close()


STATUS_OK = {"mountpoint": "/mnt/fake", "source": "s3://b/", "cache_dir": "/c", "pid": 1,
             "uptime_s": 5, "disk": {"used": 0, "budget": 1, "chunks": 0},
             "memory": {"used": 0, "capacity": 1}, "hit_ratio": {"bytes": None},
             "pinned": {"files": 0, "bytes": 0, "owners": []}, "dirty_bytes": 0,
             "uploads_pending": 0, "backend": {"up": True}}


@pytest.mark.parametrize("answer, text", [
    (b"[1, 2, 3]\n", "not a JSON object"),
    (b"\"ok\"\n", "not a JSON object"),
    (b"{not json\n", "not JSON"),
    (b'{"v": 1, "ok": true, "result": {"pid": NaN}}\n', "NaN"),
    (b'{"v": 1, "ok": true, "result": {"mountpoint": 1}}\n', "malformed status result"),
    (b'{"v": 1, "ok": false, "error": "line one\\nline two"}\n', "line one line two"),
    (b"x" * (MAX_REPLY + (1 << 16)), "longer than"),
    (b"", "without an answer"),
])
def test_the_client_turns_any_bad_reply_into_one_error_line(fake, answer, text):
    mount = fake(answer)
    with pytest.raises(ctl.ControlError) as info:
        ctl.request(mount, "status")
    message = str(info.value)
    assert text in message and "\n" not in message and len(message) < 500


def test_the_client_takes_a_good_reply_and_keeps_fields_it_does_not_know(fake):
    mount = fake(protocol.dumps({"v": 1, "event": "progress", "bytes_done": 1})
                 + protocol.dumps({"v": 1, "ok": True, "result": STATUS_OK}))
    assert ctl.request(mount, "status")["backend"] == {"up": True}


def test_status_shows_a_pin_that_never_expires_without_failing():
    assert ctl._when(1e300) == "far in the future"
    assert ctl._when(0).startswith("1970") or ctl._when(0).startswith("1969")


def test_encoding_refuses_what_the_daemon_would_refuse():
    with pytest.raises(UsageError, match="job"):
        ctl.encode("warm", {"paths": ["a"], "job": "a\nb"})
    with pytest.raises(UsageError, match="pin-ttl"):
        ctl.encode("warm", {"paths": ["a"], "pin_ttl": float("inf")})
