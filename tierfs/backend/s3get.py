"""A GET without botocore's per-request machinery: the hottest request, signed here.

botocore spends about 1.1 ms of CPU on each GetObject (its event hooks, the model-driven
serializer and response parser, header dicts copied several times), against 0.3 ms for
the HTTP exchange itself through urllib3. A cold small file is one GET, and on a node
where the daemon shares its cores with the job, that CPU is the files per second
(bench/README.md, "Many small files"). So S3Backend's GETs go through `LeanGet`: a SigV4
signature of a GET (the same one botocore would compute: path-style URL, no query, an
empty payload's hash), urllib3's pool, and botocore's own shapes for what comes back
(a StreamingBody, a ClientError carrying the S3 error code and HTTP status), so that
S3Backend reads, resumes, verifies and maps errors as it did. Retries are botocore's
standard mode for a GET: connection failures, timeouts, 500/502/503/504 and throttling,
`max_attempts` tries in all, backoff random(0, 2^n) s capped at 20 s.

Credentials come from the boto3 session's chain, frozen per request (a role's credentials
refresh as they do for boto3); the CA bundle is the one botocore would use.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import random
import re
import time
from typing import Any
from urllib.parse import quote, urlsplit

import boto3
import botocore.exceptions as bex
import urllib3
from botocore.httpsession import get_cert_path
from botocore.response import StreamingBody

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_RETRY_STATUS = {500, 502, 503, 504}
_THROTTLED = {"Throttling", "ThrottlingException", "SlowDown", "RequestTimeout",
              "RequestTimeoutException", "RequestLimitExceeded", "TooManyRequestsException",
              "ProvisionedThroughputExceededException", "BandwidthLimitExceeded"}
_RETRY_EXC = (urllib3.exceptions.ProtocolError, urllib3.exceptions.NewConnectionError,
              urllib3.exceptions.ConnectTimeoutError, urllib3.exceptions.ReadTimeoutError,
              ConnectionError, TimeoutError)
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")
# x-amz-checksum-* response headers as botocore names them
_CHECKSUMS = {"x-amz-checksum-crc32": "ChecksumCRC32", "x-amz-checksum-crc32c": "ChecksumCRC32C",
              "x-amz-checksum-crc64nvme": "ChecksumCRC64NVME",
              "x-amz-checksum-sha1": "ChecksumSHA1", "x-amz-checksum-sha256": "ChecksumSHA256"}
_META = "x-amz-meta-"
MAX_BACKOFF_S = 20.0


class LeanGet:
    def __init__(self, session: boto3.session.Session, client: Any, *, max_connections: int,
                 connect_timeout_s: float, read_timeout_s: float, max_attempts: int) -> None:
        self.endpoint = client.meta.endpoint_url.rstrip("/")
        self.region = client.meta.region_name or "us-east-1"
        self.host = urlsplit(self.endpoint).netloc
        self.max_attempts = max(1, max_attempts)
        self._session = session
        self._credentials: Any = None
        kw: dict[str, Any] = {}
        if self.endpoint.startswith("https"):
            ca = session._session.get_config_variable("ca_bundle")
            kw.update(cert_reqs="CERT_REQUIRED", ca_certs=ca or get_cert_path(True))
        self._pool = urllib3.PoolManager(
            maxsize=max_connections, retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s), **kw)
        self._keys: dict[tuple[str, str], bytes] = {}  # (secret, day) -> signing key

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None,
                   IfMatch: str | None = None, ChecksumMode: str | None = None) -> dict:
        """GetObject as botocore answers it: a dict with Body (a StreamingBody, not read
        yet), ContentLength, ContentRange, ETag, Metadata...; an error answer raises
        botocore's ClientError with the S3 error code and the HTTP status."""
        path = f"/{Bucket}/{quote(Key, safe='/~')}"
        headers = {}
        if Range is not None:
            headers["range"] = Range
        if IfMatch is not None:
            headers["if-match"] = IfMatch
        if ChecksumMode is not None:
            headers["x-amz-checksum-mode"] = ChecksumMode
        attempt = 1
        while True:
            try:
                r = self._pool.request("GET", self.endpoint + path, headers=self._signed(
                    path, headers), preload_content=False, decode_content=False,
                    redirect=False)
            except _RETRY_EXC:
                if attempt >= self.max_attempts:
                    raise
            else:
                if r.status in (200, 206):
                    return _answer(r)
                err = _error(r)
                code = err.response["Error"]["Code"]
                if (r.status not in _RETRY_STATUS and code not in _THROTTLED
                        or attempt >= self.max_attempts):
                    raise err
            time.sleep(random.random() * min(MAX_BACKOFF_S, 2.0 ** (attempt - 1)))
            attempt += 1

    def _signed(self, path: str, headers: dict[str, str]) -> dict[str, str]:
        """`headers` and the SigV4 ones for a GET of `path` (botocore's signature)."""
        if self._credentials is None:
            self._credentials = self._session.get_credentials()
            if self._credentials is None:
                raise bex.NoCredentialsError()
        creds = self._credentials.get_frozen_credentials()
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        out = dict(headers, host=self.host)
        out["x-amz-content-sha256"] = EMPTY_SHA256
        out["x-amz-date"] = stamp
        if creds.token:
            out["x-amz-security-token"] = creds.token
        names = sorted(out)
        canonical = "\n".join(["GET", path, "", *(f"{n}:{' '.join(out[n].split())}"
                                                  for n in names),
                               "", ";".join(names), EMPTY_SHA256])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._key(creds.secret_key, day), to_sign.encode(),
                             hashlib.sha256).hexdigest()
        out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
        del out["host"]  # urllib3 sends it from the URL, as signed
        return out

    def _key(self, secret: str, day: str) -> bytes:
        key = self._keys.get((secret, day))
        if key is None:
            key = ("AWS4" + secret).encode()
            for part in (day, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {(secret, day): key}  # one day's key at a time
        return key


def _answer(r: urllib3.BaseHTTPResponse) -> dict:
    h = r.headers
    length = int(h.get("content-length", "0"))
    out: dict[str, Any] = {
        "Body": StreamingBody(r, length), "ContentLength": length,
        "ETag": h.get("etag", ""), "Metadata": {k[len(_META):].lower(): v for k, v in h.items()
                                                 if k.lower().startswith(_META)}}
    for header, name in (("content-range", "ContentRange"),
                         ("x-amz-server-side-encryption", "ServerSideEncryption"),
                         ("x-amz-server-side-encryption-customer-algorithm",
                          "SSECustomerAlgorithm"),
                         ("x-amz-checksum-type", "ChecksumType"), *_CHECKSUMS.items()):
        value = h.get(header)
        if value is not None:
            out[name] = value
    return out


def _error(r: urllib3.BaseHTTPResponse) -> bex.ClientError:
    """The error answer as botocore raises it (the body is read and the connection given
    back: error bodies are short)."""
    try:
        body = r.read(64 << 10)
    finally:
        r.drain_conn()  # what is left of an unexpectedly long page; the connection goes back
        r.release_conn()
    code = _CODE.search(body)
    message = _MESSAGE.search(body)
    return bex.ClientError({"Error": {"Code": code.group(1).decode() if code else str(r.status),
                                      "Message": message.group(1).decode() if message else ""},
                            "ResponseMetadata": {"HTTPStatusCode": r.status}}, "GetObject")
