"""The fault proxy itself (tests/faults/proxy.py): requests are classified by op kind,
forwarded unchanged (SigV4 still verifies), and every fault kind does what it says."""

from __future__ import annotations

import threading
import time

import botocore.exceptions as bex
import fkit
import pytest
from proxy import classify

from fkit import KiB


@pytest.mark.parametrize("method,target,headers,op", [
    ("GET", "/b/k/x%20y.bin", {}, "GET"),
    ("GET", "/b/k", {"range": "bytes=0-9"}, "GET"),
    ("HEAD", "/b/k", {}, "HEAD"),
    ("HEAD", "/b", {}, "HeadBucket"),
    ("GET", "/b?list-type=2&prefix=a%2F&delimiter=%2F", {}, "LIST"),
    ("GET", "/b/?list-type=2", {}, "LIST"),
    ("GET", "/b?uploads&prefix=k", {}, "ListUploads"),
    ("PUT", "/b/k", {}, "PUT"),
    ("POST", "/b/k?uploads", {}, "CreateMultipart"),
    ("PUT", "/b/k?partNumber=2&uploadId=u", {}, "UploadPart"),
    ("PUT", "/b/k?partNumber=2&uploadId=u", {"x-amz-copy-source": "b/s"}, "Copy"),
    ("PUT", "/b/k", {"x-amz-copy-source": "b/s"}, "Copy"),
    ("POST", "/b/k?uploadId=u", {}, "Complete"),
    ("DELETE", "/b/k?uploadId=u", {}, "Abort"),
    ("DELETE", "/b/k", {}, "Delete"),
    ("POST", "/b?delete", {}, "Delete"),
    ("PUT", "/b", {}, "Other"),
])
def test_classify(method, target, headers, op):
    assert classify(method, target, headers)[0] == op


def _client(rgw, proxy):
    return fkit.ThroughProxy(rgw, proxy).client(
        retries={"mode": "standard", "total_max_attempts": 1}, read_timeout=5,
        connect_timeout=2)


def test_every_fault_kind(rgw, proxy, bucket, s3):
    c = _client(rgw, proxy)
    data = fkit.payload("proxy", 300 * KiB)
    c.put_object(Bucket=bucket, Key="k/a b.bin", Body=data)  # signed through the proxy
    u = c.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    e = c.upload_part(Bucket=bucket, Key="mp", UploadId=u, PartNumber=1, Body=data)["ETag"]
    c.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=u,
                                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e}]})
    assert s3.get_object(Bucket=bucket, Key="mp")["Body"].read() == data

    def get() -> bytes:
        return c.get_object(Bucket=bucket, Key="k/a b.bin")["Body"].read()

    assert get() == data
    for kind, code in (("503", "SlowDown"), ("500", "InternalError")):
        proxy.inject(kind, "GET", count=1)
        with pytest.raises(bex.ClientError) as ei:
            get()
        assert ei.value.response["Error"]["Code"] == code
        if kind == "503":
            assert ei.value.response["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "1"
    proxy.inject("refuse", "GET", count=1)
    with pytest.raises((bex.ConnectionError, bex.HTTPClientError)):
        get()
    for kind in ("reset", "close"):
        proxy.inject(kind, "GET", count=1, after=1000)
        with pytest.raises(Exception) as ei:
            get()
        assert not isinstance(ei.value, bex.ClientError), ei.value
    proxy.inject("flip", "GET", count=1, seed=3)
    got = get()
    assert len(got) == len(data)
    diff = sum(bin(a ^ b).count("1") for a, b in zip(got, data))
    assert diff == 1, f"{diff} bits differ"
    assert get() == data  # count=1: the next GET is clean
    assert proxy.injected_by_kind() == {"503": 1, "500": 1, "refuse": 1, "reset": 1,
                                        "close": 1, "flip": 1}
    assert proxy.injected(op="GET") == 6

    # a hang holds the request until released
    proxy.inject("hang", "HEAD", count=1)
    out = {}
    t = threading.Thread(target=lambda: out.update(
        r=c.head_object(Bucket=bucket, Key="mp")["ContentLength"]))
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and not out
    proxy.release()
    t.join(10)
    assert out == {"r": len(data)}

    # a delay
    proxy.inject("delay", "HEAD", count=1, seconds=1.0)
    t0 = time.monotonic()
    c.head_object(Bucket=bucket, Key="mp")
    assert time.monotonic() - t0 >= 1.0

    # down: connections refused; up: served again on the same port
    proxy.down()
    with pytest.raises(bex.EndpointConnectionError):
        c.head_object(Bucket=bucket, Key="mp")
    proxy.up()
    assert c.head_object(Bucket=bucket, Key="mp")["ContentLength"] == len(data)

    # probability and seed: the same draws for the same seed
    draws = []
    for _ in range(2):
        proxy.heal()
        rule = proxy.inject("503", "HeadBucket", probability=0.5, seed=42)
        seen = []
        for _ in range(16):
            try:
                c.head_bucket(Bucket=bucket)
                seen.append(0)
            except bex.ClientError:
                seen.append(1)
        assert rule.injected == sum(seen)
        draws.append(seen)
    assert draws[0] == draws[1] and 0 < sum(draws[0]) < 16


def test_wan_mode_delays_caps_and_counts(rgw, proxy, bucket, s3):
    """bench/tiers.py's far link: the bytes each way are counted, and with a cap of
    2 MiB/s a 1 MiB body takes at least half a second (a lower bound only: the machine
    may be slower, never faster)."""
    c = _client(rgw, proxy)
    data = fkit.payload("wan", 1 << 20)
    up0, down0 = proxy.bytes_up, proxy.bytes_down
    c.put_object(Bucket=bucket, Key="w", Body=data)
    assert proxy.bytes_up - up0 == len(data)
    proxy.wan(0.05, 2 << 20)
    try:
        t0 = time.monotonic()
        assert c.get_object(Bucket=bucket, Key="w")["Body"].read() == data
        took = time.monotonic() - t0
    finally:
        proxy.wan(0, None)
    assert proxy.bytes_down - down0 == len(data)
    assert took >= 0.05 + 0.5
