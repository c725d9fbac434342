"""S3 / Ceph RGW backend: the only module that imports boto3.

botocore does the retrying (standard mode, bounded attempts, connect/read timeouts) so no
call can hang; this module adds no retry loop of its own. Credentials come only from
boto3's standard chain (environment, shared files, instance roles).
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from ..errors import (AccessDenied, BackendError, BackendUnavailable, NoSuchBucket, NotFound,
                      PreconditionFailed)
from .base import ListPage, ObjectMeta

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
           "InvalidToken", "ExpiredToken", "AllAccessDisabled"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


def _etag(raw: str) -> str:
    return raw.strip('"')


class S3Backend:
    name = "s3"

    def __init__(self, bucket: str, *, endpoint_url: str | None, region: str | None,
                 max_connections: int, timeout_s: float, max_attempts: int) -> None:
        self.bucket = bucket
        config = Config(
            s3={"addressing_style": "path"},
            # RGW rejects botocore>=1.36 default checksums on uploads; ETags verify GETs
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=min(timeout_s, 10.0),
            read_timeout=timeout_s,
            max_pool_connections=max_connections,
            region_name=region,
        )
        session = boto3.session.Session()
        self._s3 = session.client("s3", endpoint_url=endpoint_url, config=config)

    def _error(self, exc: Exception, what: str) -> Exception:
        if isinstance(exc, bex.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412") or status == 412:
                return PreconditionFailed(f"{what}: object changed (ETag mismatch)")
            if code == "NoSuchBucket":
                return NoSuchBucket(f"bucket {self.bucket!r} does not exist")
            if code in _DENIED or status == 403:
                return AccessDenied(f"{what}: access denied ({code}); check the credentials")
            if code in _MISSING or status == 404:
                return NotFound(f"{what}: not found")
            return BackendError(f"{what}: {code or status} {err.get('Message', '')}".strip())
        if isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError)):
            return AccessDenied("no S3 credentials found: set AWS_ACCESS_KEY_ID/"
                                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role")
        if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError,
                            bex.ReadTimeoutError, bex.ConnectionClosedError)):
            return BackendUnavailable(f"{what}: endpoint unreachable ({exc})")
        if isinstance(exc, bex.BotoCoreError):
            return BackendError(f"{what}: {exc}")
        return exc

    def check(self) -> None:
        try:
            self._s3.head_bucket(Bucket=self.bucket)
        except Exception as exc:  # noqa: BLE001 - mapped below
            err = self._error(exc, f"bucket {self.bucket!r}")
            if isinstance(err, NotFound):
                err = NoSuchBucket(f"bucket {self.bucket!r} does not exist")
            raise err from None

    def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
             max_keys: int = 1000) -> ListPage:
        kw: dict = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            kw["Delimiter"] = delimiter
        if token:
            kw["ContinuationToken"] = token
        try:
            r = self._s3.list_objects_v2(**kw)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"list {prefix!r}") from None
        objects = [ObjectMeta(o["Key"], o["Size"], _etag(o.get("ETag", "")),
                              o["LastModified"].timestamp()) for o in r.get("Contents", ())]
        prefixes = [p["Prefix"] for p in r.get("CommonPrefixes", ())]
        return ListPage(objects, prefixes,
                        r.get("NextContinuationToken") if r.get("IsTruncated") else None)

    def head(self, key: str) -> ObjectMeta:
        try:
            r = self._s3.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"head {key!r}") from None
        return ObjectMeta(key, r["ContentLength"], _etag(r["ETag"]), r["LastModified"].timestamp(),
                          r.get("Metadata") or {})

    def get(self, key: str, start: int, length: int, etag: str | None) -> bytes:
        out: list = []

        def into(r: dict) -> int:
            out.append(_read_body(r["Body"], r.get("ContentLength")))
            return len(out[0])

        self._get(key, start, length, etag, into)
        return out[0]

    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None) -> int:
        def into(r: dict) -> int:
            n = r.get("ContentLength")
            if n is None or n > len(buf):
                raise BackendError(f"get {key!r} at {start}: server sent {n} bytes, "
                                   f"asked for {len(buf)}")
            _read_body_into(r["Body"], buf[:n])
            return n

        return self._get(key, start, len(buf), etag, into)

    def _get(self, key: str, start: int, length: int, etag: str | None,
             read: Callable[[dict], int]) -> int:
        kw: dict = {"Bucket": self.bucket, "Key": key, "Range": f"bytes={start}-{start + length - 1}"}
        if etag:
            kw["IfMatch"] = f'"{etag}"'
        try:
            r = self._s3.get_object(**kw)
            n = read(r)
        except BackendError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"get {key!r} at {start}") from None
        if etag and _etag(r.get("ETag", f'"{etag}"')) != etag:
            raise PreconditionFailed(f"get {key!r}: object changed (ETag mismatch)")
        if n > length:
            raise BackendError(f"get {key!r} at {start}: server sent {n} bytes, "
                               f"asked for {length}")
        return n

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta:
        try:
            r = self._s3.put_object(Bucket=self.bucket, Key=key, Body=data,
                                    Metadata=metadata or {})
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"put {key!r}") from None
        return ObjectMeta(key, len(data), _etag(r["ETag"]), time.time(), metadata or {})

    def copy(self, src: str, dst: str, src_etag: str | None,
             metadata: dict[str, str] | None = None) -> str:
        kw: dict = {"Bucket": self.bucket, "Key": dst,
                    "CopySource": {"Bucket": self.bucket, "Key": src}}
        if src_etag:
            kw["CopySourceIfMatch"] = f'"{src_etag}"'
        if metadata is not None:
            kw["Metadata"] = metadata
            kw["MetadataDirective"] = "REPLACE"
        try:
            r = self._s3.copy_object(**kw)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"copy {src!r} to {dst!r}") from None
        return _etag(r["CopyObjectResult"]["ETag"])

    def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        try:
            r = self._s3.create_multipart_upload(Bucket=self.bucket, Key=key,
                                                 Metadata=metadata or {})
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"start upload of {key!r}") from None
        return r["UploadId"]

    def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str:
        try:
            r = self._s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                     PartNumber=part, Body=data)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"upload part {part} of {key!r}") from None
        return _etag(r["ETag"])

    def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                         start: int, length: int) -> str:
        try:
            r = self._s3.upload_part_copy(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part,
                CopySource={"Bucket": self.bucket, "Key": src},
                CopySourceIfMatch=f'"{src_etag}"',
                CopySourceRange=f"bytes={start}-{start + length - 1}")
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"copy part {part} of {key!r} from {src!r}") from None
        return _etag(r["CopyPartResult"]["ETag"])

    def mpu_complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        try:
            r = self._s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": f'"{e}"'} for n, e in parts]})
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"complete upload of {key!r}") from None
        # Ceph RGW answers with an empty ETag here. Not a HEAD instead: another writer's
        # version could answer it. The multipart ETag is md5(part md5s)-N; if a store
        # computes it otherwise, cached chunks simply miss, never serve wrong bytes.
        return _etag(r.get("ETag") or "") or multipart_etag([e for _, e in parts])

    def mpu_list(self, key: str) -> list[str]:
        try:
            r = self._s3.list_multipart_uploads(Bucket=self.bucket, Prefix=key)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"list uploads of {key!r}") from None
        return [u["UploadId"] for u in r.get("Uploads", ()) if u["Key"] == key]

    def mpu_abort(self, key: str, upload_id: str) -> None:
        try:
            self._s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001
            err = self._error(exc, f"abort upload of {key!r}")
            if not isinstance(err, NotFound):
                raise err from None

    def delete(self, key: str) -> None:
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"delete {key!r}") from None


def multipart_etag(part_etags: list[str]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(e) for e in part_etags)).hexdigest()
    return f"{digest}-{len(part_etags)}"


def _read_body(body, length: int | None) -> bytes | bytearray:  # noqa: ANN001 - StreamingBody
    """The body in ONE buffer: read() would join a list of pieces, briefly holding the
    chunk twice (8 GETs in flight x 2 x 8 MiB is most of the daemon's memory)."""
    if length is None:
        return body.read()
    buf = bytearray(length)
    _read_body_into(body, memoryview(buf))
    return buf


def _read_body_into(body, view: memoryview) -> None:  # noqa: ANN001 - StreamingBody
    got, length = 0, len(view)
    raw = body._raw_stream  # urllib3 response: readinto, no list of pieces to join
    while got < length:
        n = raw.readinto(view[got:])
        if not n:
            raise BackendError(f"connection closed after {got} of {length} bytes")
        got += n
