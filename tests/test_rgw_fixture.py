"""The Ceph RGW fixtures themselves: a real S3 round trip and a conditional ranged GET."""

import os

import pytest
from botocore.exceptions import ClientError


def test_put_get_round_trip(rgw, bucket):
    s3 = rgw.client()
    data = os.urandom(256 * 1024 + 7)
    s3.put_object(Bucket=bucket, Key="dir/obj.bin", Body=data)
    got = s3.get_object(Bucket=bucket, Key="dir/obj.bin")
    assert got["Body"].read() == data
    assert got["ContentLength"] == len(data)
    listed = s3.list_objects_v2(Bucket=bucket)
    assert [o["Key"] for o in listed["Contents"]] == ["dir/obj.bin"]


def test_ranged_get_if_match_wrong_etag_is_412(rgw, bucket):
    s3 = rgw.client()
    data = bytes(range(256)) * 1024
    etag = s3.put_object(Bucket=bucket, Key="k", Body=data)["ETag"]
    part = s3.get_object(Bucket=bucket, Key="k", Range="bytes=1000-1999", IfMatch=etag)
    assert part["Body"].read() == data[1000:2000]
    with pytest.raises(ClientError) as exc:
        s3.get_object(Bucket=bucket, Key="k", Range="bytes=1000-1999",
                      IfMatch='"0123456789abcdef0123456789abcdef"')
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
