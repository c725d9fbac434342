"""S3Backend over TLS, on a real Ceph RGW serving https with a self-signed certificate.

Uploads go unsigned (UNSIGNED-PAYLOAD: TLS guards the bytes, as the AWS SDKs do), over
plain HTTP they stay signed; GETs (tierfs/backend/s3get.py) verify the certificate
against the CA bundle botocore would use, and refuse one they cannot verify."""

from __future__ import annotations

import os

import pytest

from tierfs.errors import BackendError

from backends import s3_backend, use_rgw_credentials
from rgw import delete_bucket, start_rgw

MiB = 1 << 20


@pytest.fixture(scope="module")
def rgw_https():
    server = start_rgw(memstore_bytes=1 << 30, https=True)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tls_bucket(rgw_https):
    client = rgw_https.client()
    client.create_bucket(Bucket="tls")
    try:
        yield "tls"
    finally:
        delete_bucket(client, "tls")


def payload_hashes(backend) -> list[tuple[str, str]]:
    """(operation, x-amz-content-sha256) of each request the backend's botocore sends."""
    sent: list[tuple[str, str]] = []

    def before_send(request, **kw):
        value = request.headers.get("X-Amz-Content-SHA256", "")
        sent.append((kw["event_name"].split(".")[-1],
                     value.decode() if isinstance(value, bytes) else value))

    backend._s3.meta.events.register("before-send.s3", before_send)
    return sent


def test_over_tls_uploads_are_unsigned_and_everything_round_trips(rgw_https, tls_bucket,
                                                                 monkeypatch):
    use_rgw_credentials(monkeypatch, rgw_https)
    assert os.environ["AWS_CA_BUNDLE"] == rgw_https.ca_bundle
    b = s3_backend(rgw_https, tls_bucket)
    sent = payload_hashes(b)
    small = os.urandom(100_000)
    put = b.put("dir/small.bin", small)
    big = [os.urandom(5 * MiB), os.urandom(MiB + 7)]
    upload = b.mpu_create("dir/big.bin")
    etags = [b.upload_part("dir/big.bin", upload, n + 1, part) for n, part in enumerate(big)]
    done = b.mpu_complete("dir/big.bin", upload, [(n + 1, e) for n, e in enumerate(etags)])
    uploads = [h for op, h in sent if op in ("PutObject", "UploadPart")]
    assert len(uploads) == 3 and set(uploads) == {"UNSIGNED-PAYLOAD"}, sent
    assert bytes(b.get("dir/small.bin", 0, len(small), put.etag)) == small
    whole = b"".join(big)
    assert bytes(b.get("dir/big.bin", MiB, 5 * MiB, done)) == whole[MiB:6 * MiB]
    assert [o.key for o in b.list("dir/", "/").objects] == ["dir/big.bin", "dir/small.bin"]


def test_over_plain_http_uploads_stay_signed(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    b = s3_backend(rgw, bucket)
    sent = payload_hashes(b)
    b.put("k", b"x" * 1000)
    hashes = [h for op, h in sent if op == "PutObject"]
    assert len(hashes) == 1 and len(hashes[0]) == 64, sent  # the body's SHA-256


def test_a_certificate_that_cannot_be_verified_is_refused(rgw_https, tls_bucket,
                                                          monkeypatch):
    use_rgw_credentials(monkeypatch, rgw_https)
    b = s3_backend(rgw_https, tls_bucket)
    b.put("k", b"secret bytes")
    monkeypatch.delenv("AWS_CA_BUNDLE")  # the public CAs only: the self-signed one fails
    untrusting = s3_backend(rgw_https, tls_bucket, max_attempts=1)
    with pytest.raises(BackendError):
        untrusting.get("k", 0, 12, None)
