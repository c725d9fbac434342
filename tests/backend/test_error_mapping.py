"""The backend boundary: whatever boto3, botocore, urllib3, socket or ssl raise - from a
request, from a body being read, inside an exception group - leaves S3Backend as a
tierfs error; a backend's own bug leaves AsyncBackend as BackendError, counted. These
tests replace ONE boto3 call (get_object) of a client that never reaches a network."""

import http.client
import io
import logging
import socket
import ssl

import botocore.exceptions as bex
import pytest
import trio
import urllib3.exceptions
from botocore.response import StreamingBody

from tierfs.backend.base import BackendEvents
from tierfs.backend.runner import AsyncBackend
from tierfs.backend.s3 import S3Backend
from tierfs.errors import BackendError, BackendUnavailable, NotFound, TierfsError
from tierfs.metrics import Metrics

DATA = bytes(range(256)) * 64  # 16 KiB
ETAG = "0123456789abcdef0123456789abcdef-2"  # multipart: no MD5 to check


@pytest.fixture(scope="module")
def shared():
    # one client for the module: creating a boto3 client costs about a second under load
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, "test")
        return S3Backend("bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1",
                         max_connections=2, timeout_s=1, max_attempts=2)


@pytest.fixture
def b(shared):
    shared.events = BackendEvents()
    return shared


class Raw(io.RawIOBase):
    """A urllib3-response stand-in: gives `data`, then raises `fail` after `cut` bytes."""

    def __init__(self, data: bytes, cut: int | None = None, fail: BaseException | None = None):
        self.data, self.pos, self.cut, self.fail = data, 0, cut, fail

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # noqa: ANN001
        end = len(self.data) if self.cut is None else self.cut
        if self.pos >= end:
            if self.fail is not None:
                raise self.fail
            return 0
        n = min(len(b), end - self.pos, 1000)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def response(first: int, body: Raw, total: int = len(DATA)) -> dict:
    n = len(body.data)
    return {"Body": StreamingBody(body, n), "ContentLength": n, "ETag": f'"{ETAG}"',
            "ContentRange": f"bytes {first}-{first + n - 1}/{total}", "Metadata": {}}


NETWORK = [
    urllib3.exceptions.ProtocolError("Connection broken", ConnectionResetError(104, "reset")),
    urllib3.exceptions.ReadTimeoutError(None, "/k", "Read timed out."),
    urllib3.exceptions.IncompleteRead(10, 20),
    urllib3.exceptions.NewConnectionError(None, "refused"),
    http.client.IncompleteRead(b"abc", 10),
    ConnectionResetError(104, "Connection reset by peer"),
    ConnectionRefusedError(111, "Connection refused"),
    socket.timeout("timed out"),
    bex.ResponseStreamingError(error="Connection broken"),
    bex.ReadTimeoutError(endpoint_url="http://x"),
    bex.ConnectionClosedError(endpoint_url="http://x"),
    bex.EndpointConnectionError(endpoint_url="http://x"),
    ExceptionGroup("parts", [ConnectionResetError(104, "reset")]),
]
OTHER = [
    ssl.SSLError(1, "bad record mac"),
    urllib3.exceptions.SSLError("handshake"),
    urllib3.exceptions.DecodeError("bad gzip"),
    http.client.BadStatusLine("garbage"),
    bex.NoRegionError(),
    OSError(5, "Input/output error"),
    ValueError("a bug in a library"),
    ExceptionGroup("two", [ValueError("a"), KeyError("b")]),
]


@pytest.mark.parametrize("exc", NETWORK + OTHER, ids=lambda e: type(e).__name__)
def test_every_exception_from_a_request_is_a_tierfs_error(b, monkeypatch, exc):

    def fail(**kw):
        raise exc

    monkeypatch.setattr(b, "_get_call", fail)
    with pytest.raises(TierfsError) as e:
        b.get("k", 0, 100, None)
    assert "'k' at 0" in str(e.value)
    if exc in NETWORK:
        assert isinstance(e.value, BackendUnavailable)
    else:
        assert isinstance(e.value, BackendError)


def test_a_client_error_keeps_its_meaning(b, monkeypatch):

    def missing(**kw):
        raise bex.ClientError({"Error": {"Code": "NoSuchKey"},
                               "ResponseMetadata": {"HTTPStatusCode": 404}}, "GetObject")

    monkeypatch.setattr(b, "_get_call", missing)
    with pytest.raises(NotFound):
        b.get("k", 0, 100, None)


@pytest.mark.parametrize("exc", [
    urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead"),
    urllib3.exceptions.ReadTimeoutError(None, "/k", "Read timed out."),
    urllib3.exceptions.SSLError("bad record mac"),
    http.client.IncompleteRead(b"", 5),
    ConnectionResetError(104, "Connection reset by peer"),
    socket.timeout("timed out"),
    ssl.SSLError(1, "decryption failed"),
    None,  # a clean end of the connection before Content-Length
], ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("how", ["get", "get_into"])
def test_a_body_that_breaks_is_resumed_whatever_it_raised(b, monkeypatch, exc, how):
    resumed: list[int] = []
    b.events = BackendEvents(resumed=lambda: resumed.append(1))
    calls: list[dict] = []

    def get_object(**kw):
        calls.append(kw)
        if len(calls) == 1:
            return response(0, Raw(DATA, cut=5000, fail=exc))
        first = int(kw["Range"][len("bytes="):].split("-")[0])
        return response(first, Raw(DATA[first:]))

    monkeypatch.setattr(b, "_get_call", get_object)
    if how == "get":
        got = bytes(b.get("k", 0, len(DATA), ETAG))
    else:
        buf = bytearray(len(DATA))
        got = bytes(buf[:b.get_into("k", 0, memoryview(buf), ETAG)])
    assert got == DATA
    assert resumed == [1] and len(calls) == 2
    assert calls[1]["Range"] == f"bytes=5000-{len(DATA) - 1}"
    assert calls[1]["IfMatch"] == f'"{ETAG}"'


def test_a_bug_while_reading_a_body_is_eio_not_a_crash(b, monkeypatch, caplog):
    monkeypatch.setattr(b, "_get_call",
                        lambda **kw: response(0, Raw(DATA, cut=10, fail=KeyError("bug"))))
    with caplog.at_level(logging.ERROR, logger="tierfs.backend.s3"):
        with pytest.raises(BackendError) as e:
            b.get("k", 0, len(DATA), ETAG)
    assert "KeyError" in str(e.value)
    assert caplog.records and caplog.records[0].exc_info  # the traceback is logged


def test_a_store_that_ignores_the_range_is_refused(b, monkeypatch):
    whole = response(0, Raw(DATA))
    del whole["ContentRange"]  # a 200 with the whole object, asked for bytes from 100
    monkeypatch.setattr(b, "_get_call", lambda **kw: whole)
    with pytest.raises(BackendError, match="ignored the Range"):
        b.get("k", 100, 50, None)


def test_the_runner_turns_a_backends_bug_into_backend_error(caplog):
    class Buggy:
        name = "buggy"

        def head(self, key):
            return {}["missing"]

    m = Metrics()

    async def go():
        ab = AsyncBackend(Buggy(), m, concurrency=2, background=1)  # type: ignore[arg-type]
        with pytest.raises(BackendError, match="KeyError"):
            await ab.head("some/key")

    with caplog.at_level(logging.ERROR, logger="tierfs.backend.runner"):
        trio.run(go)
    assert m.value("tierfs_internal_errors_total", task="backend") == 1
    assert m.value("tierfs_backend_errors_total", op="head") == 1
    assert "'some/key'" in caplog.records[0].getMessage() and caplog.records[0].exc_info
