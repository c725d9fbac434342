"""LeanGet (tierfs/backend/s3get.py): S3Backend's GETs signed without botocore.

Its signature is botocore's, header for header (checked against botocore's own signer at
one fixed instant), keys that need encoding reach the right object on the real RGW, an
error answer keeps its S3 code, a 503 is retried as botocore's standard mode would, and
with a proxy set for the endpoint the GETs stay with botocore."""

from __future__ import annotations

import datetime
import http.server
import os
import threading
from unittest import mock

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tierfs.backend import s3get
from tierfs.errors import NotFound, PreconditionFailed

from backends import s3_backend, use_rgw_credentials

NOW = datetime.datetime(2026, 12, 6, 17, 11, 22, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("key", ["plain/key.bin", "a b/c+d=e&f", "ü/ñ~x", "p%20q", "x;y,z"])
@pytest.mark.parametrize("token", [None, "session-token"])
def test_the_signature_is_botocores(rgw, bucket, monkeypatch, key, token):
    use_rgw_credentials(monkeypatch, rgw, **({"AWS_SESSION_TOKEN": token} if token else {}))
    b = s3_backend(rgw, bucket)
    lean = b._get_call.__self__
    assert isinstance(lean, s3get.LeanGet)
    path = f"/{bucket}/{s3get.quote(key, safe='/~')}"
    headers = {"range": "bytes=0-99", "if-match": '"abc"'}
    with mock.patch.object(s3get.datetime, "datetime", wraps=datetime.datetime) as dt:
        dt.now.return_value = NOW
        ours = lean._signed(path, headers)

    request = AWSRequest(method="GET", url=rgw.endpoint + path,
                         headers={"Range": "bytes=0-99", "If-Match": '"abc"'})
    creds = Credentials(rgw.access_key, rgw.secret_key, token)
    with mock.patch("botocore.auth.get_current_datetime",
                    return_value=NOW.replace(tzinfo=None)):
        S3SigV4Auth(creds, "s3", rgw.region).add_auth(request)
    theirs = {k.lower(): v for k, v in request.headers.items()}
    assert ours["authorization"] == theirs["authorization"]
    for name in ("x-amz-date", "x-amz-content-sha256", "x-amz-security-token"):
        assert ours.get(name) == theirs.get(name)


def test_keys_that_need_encoding_reach_their_object(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    b = s3_backend(rgw, bucket)
    s3 = rgw.client()
    for i, key in enumerate(["a b/c+d=e&f", "ü/ñ~x", "p%20q", "x;y,z", "dir/sub/f.bin"]):
        data = os.urandom(1000 + i)
        etag = s3.put_object(Bucket=bucket, Key=key, Body=data)["ETag"].strip('"')
        assert bytes(b.get(key, 0, len(data), etag)) == data, key
        assert bytes(b.get(key, 100, 50, etag)) == data[100:150], key
        with pytest.raises(PreconditionFailed):
            b.get(key, 0, 10, "0" * 32)
    with pytest.raises(NotFound):
        b.get("no such key", 0, 10, None)


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 SlowDown `fails` times, then 404 NoSuchKey (both with S3's XML)."""

    fails = 0
    seen = 0

    def do_GET(self):  # http.server's name
        cls = type(self)
        cls.seen += 1
        status, code = (503, "SlowDown") if cls.seen <= cls.fails else (404, "NoSuchKey")
        body = f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_503_is_retried_then_the_answer_keeps_its_code(rgw, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _Flaky.fails, _Flaky.seen = 2, 0
        monkeypatch.setattr(s3get, "MAX_BACKOFF_S", 0.05)
        b = s3_backend(rgw, "bucket", endpoint_url=f"http://127.0.0.1:{server.server_port}",
                       max_attempts=3)
        with pytest.raises(NotFound):
            b.get("k", 0, 10, None)
        assert _Flaky.seen == 3  # two 503s retried, the third answer final
    finally:
        server.shutdown()
        server.server_close()


def test_with_a_proxy_for_the_endpoint_gets_stay_with_botocore(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    b = s3_backend(rgw, bucket)
    assert not isinstance(getattr(b._get_call, "__self__", None), s3get.LeanGet)
