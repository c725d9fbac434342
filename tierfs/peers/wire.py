"""What peers say to each other: chunk requests and replies, their signatures, the errors.

A request is one GET whose target names an object version's chunk
(`/v1/chunk?b=BUCKET&k=KEY&e=ETAG&s=SIZE&i=INDEX&c=CHUNK_SIZE`) and whose `authorization`
header is an HMAC-SHA256, under the fleet's shared secret, of the method, the target, the
asking node's name and the time: a node without the secret gets nothing, and a captured
request is refused a minute later. A reply carries the chunk's bytes and, in its headers,
the ETag it answers for, the CRC32C of each block and a signature over those and the
request's own signature: the reader knows the CRCs came from a node holding the secret,
for this request, and checks every block against them.

The signature covers the CRCs, not the bytes (an HMAC over every byte would cost more
than the copy it saves): bytes damaged on the way or by a confused owner are caught, but
CRC32C is no MAC, so on a network where someone could rewrite traffic in flight, use TLS.

Everything parsed here comes from the network: every field is checked (type, range,
length) and anything malformed raises a PeerError, never another exception.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote

import google_crc32c

PATH = "/v1/chunk"

# status codes of a reply (docs/peers.md)
OK = 200
BAD_REQUEST = 400
UNAUTHORIZED = 401
NOT_MINE = 404  # this node does not mount the bucket
METHOD_NOT_ALLOWED = 405
STALE = 409  # the owner knows another ETag for the key
CHANGED = 412  # the store said the object changed
INTERNAL = 500
OVERLOADED = 503  # the concurrency limit is reached, or the store is down

MAX_CHUNK = 64 << 20  # the largest body a reader accepts (and chunk size it asks for)
MAX_KEY_BYTES = 1024  # S3's key limit
MAX_BUCKET = 255
MAX_ETAG = 256
MIN_BLOCK = 4096  # a reply's blocks: at most MAX_CHUNK / MIN_BLOCK CRCs to check
MAX_NODE = 255
SKEW_S = 60.0

_FIELDS = ("b", "k", "e", "s", "i", "c")
_DIGITS = re.compile(r"[0-9]{1,20}")
_ETAG = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_ETAG)  # printable ASCII, as in a header
_NODE = re.compile(r"[A-Za-z0-9._:\[\]-]{1,%d}" % MAX_NODE)
_AUTH = re.compile(r"tierfs-hmac node=([^,]{1,%d}),ts=([0-9]{1,12}),sig=([0-9a-f]{64})"
                   % MAX_NODE)
_CRC = re.compile(r"[0-9a-f]{8}")


class PeerError(Exception):
    """A chunk could not be had from a peer; `result` is the metrics label."""

    result = "error"


class PeerProtocolError(PeerError):
    """Malformed or oversized: a request target, a head, a header of a reply."""

    result = "bad_request"


class PeerAuthError(PeerError):
    """No, malformed, old or wrong signature (or a 401 from the peer)."""

    result = "unauthorized"


class PeerUnavailable(PeerError):
    """No connection, refused, reset, closed early, TLS failure."""

    result = "unavailable"


class PeerTimeout(PeerError):
    result = "timeout"


_REFUSAL_RESULTS = {NOT_MINE: "refused", STALE: "stale", CHANGED: "changed",
                    OVERLOADED: "overloaded"}


class PeerRefused(PeerError):
    """The peer answered and will not give the chunk (404, 409, 412, 503 and the like)."""

    result = "refused"

    def __init__(self, status: int, detail: str = "") -> None:
        super().__init__(f"HTTP {status}" + (f": {detail}" if detail else ""))
        self.status = status
        self.result = _REFUSAL_RESULTS.get(status, "refused")


class PeerCorrupt(PeerError):
    """A reply that does not check out: signature, length, ETag or a block's CRC."""

    result = "corrupt"


def _check_int(name: str, value: int, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise PeerProtocolError(f"{name} out of range")


@dataclass(frozen=True)
class ChunkRequest:
    bucket: str
    key: str  # object key (<= 1024 bytes UTF-8)
    etag: str  # the version the reader's chunk key was made from
    size: int  # object size from the reader's listing
    index: int  # chunk index
    chunk_size: int  # the reader's chunk size (the owner refuses 400 if it differs)

    def __post_init__(self) -> None:
        # a request is checked where it is made, so a bad one never goes on the wire and
        # the parsed one is checked by the same lines
        if not isinstance(self.bucket, str) or not 0 < len(self.bucket) <= MAX_BUCKET:
            raise PeerProtocolError("bad bucket")
        if not isinstance(self.key, str) or not self.key:
            raise PeerProtocolError("bad key")
        try:
            key_bytes = len(self.key.encode())
        except UnicodeEncodeError:  # a lone surrogate is no S3 key
            raise PeerProtocolError("key is not UTF-8") from None
        if key_bytes > MAX_KEY_BYTES:
            raise PeerProtocolError("key too long")
        if not isinstance(self.etag, str) or not _ETAG.fullmatch(self.etag):
            raise PeerProtocolError("bad etag")
        _check_int("chunk size", self.chunk_size, 1, MAX_CHUNK)
        _check_int("size", self.size, 1, 1 << 62)
        _check_int("index", self.index, 0, (self.size - 1) // self.chunk_size)

    @property
    def length(self) -> int:
        """The chunk's length: chunk_size but for the object's last chunk."""
        return min(self.chunk_size, self.size - self.index * self.chunk_size)

    def target(self) -> str:
        values = (self.bucket, self.key, self.etag, str(self.size), str(self.index),
                  str(self.chunk_size))
        return PATH + "?" + "&".join(f"{f}={quote(v, safe='')}"
                                     for f, v in zip(_FIELDS, values, strict=True))

    @classmethod
    def parse(cls, target: str) -> ChunkRequest:
        path, sep, query = target.partition("?")
        if path != PATH or not sep:
            raise PeerProtocolError("unknown path")
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True,
                              errors="strict", max_num_fields=len(_FIELDS))
        except (ValueError, UnicodeDecodeError):
            raise PeerProtocolError("malformed query") from None
        fields = dict(pairs)
        if len(pairs) != len(_FIELDS) or set(fields) != set(_FIELDS):
            raise PeerProtocolError("wrong query fields")
        ints = []
        for name in ("s", "i", "c"):
            if not _DIGITS.fullmatch(fields[name]):
                raise PeerProtocolError("bad number")
            ints.append(int(fields[name]))
        return cls(fields["b"], fields["k"], fields["e"], *ints)


@dataclass(frozen=True)
class ChunkReply:
    data: bytes | bytearray | memoryview  # the chunk's bytes (whole chunk)
    crcs: tuple[int, ...]  # CRC32C (google_crc32c.value) of each block_size block
    block_size: int


def block_crcs(data: bytes | bytearray | memoryview, block_size: int) -> tuple[int, ...]:
    """CRC32C of each block_size block of data (the last may be shorter; none for empty
    data). google_crc32c takes bytes only, so a block of a writable buffer is copied."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if isinstance(data, bytes):
        if len(data) <= block_size:
            return (google_crc32c.value(data),) if data else ()
        return tuple(google_crc32c.value(data[i:i + block_size])
                     for i in range(0, len(data), block_size))
    view = memoryview(data)
    return tuple(google_crc32c.value(bytes(view[i:i + block_size]))
                 for i in range(0, len(view), block_size))


def format_crcs(crcs: tuple[int, ...] | list[int]) -> str:
    return ",".join(f"{c:08x}" for c in crcs)


def parse_crcs(text: str) -> tuple[int, ...]:
    """The `x-tierfs-crc32c` header's CRCs; PeerCorrupt if malformed (a reply's header)."""
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_CHUNK // MIN_BLOCK or not all(_CRC.fullmatch(p) for p in parts):
        raise PeerCorrupt("malformed CRC list")
    return tuple(int(p, 16) for p in parts)


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def _request_mac(secret: bytes, node: str, method: str, target: str, ts: int) -> str:
    return _mac(secret, "tierfs-peer-request-v1", method, target, node, str(ts))


def sign_request(secret: bytes, node: str, method: str, target: str, now: float) -> str:
    """The `authorization` header: "tierfs-hmac node=<node>,ts=<int>,sig=<hex>"."""
    if not _NODE.fullmatch(node):
        raise PeerProtocolError("bad node name")
    ts = int(now)
    return f"tierfs-hmac node={node},ts={ts},sig={_request_mac(secret, node, method, target, ts)}"


def verify_request(secret: bytes, method: str, target: str, header: str | None, now: float,
                   *, skew_s: float = SKEW_S) -> str:
    """The asking node's name, if `header` signs this method and target under `secret`
    within skew_s of now; else PeerAuthError (whose message names no secret or signature)."""
    if not header:
        raise PeerAuthError("no authorization header")
    m = _AUTH.fullmatch(header)
    if m is None or not _NODE.fullmatch(m[1]):
        raise PeerAuthError("malformed authorization header")
    node, ts, sig = m[1], int(m[2]), m[3]
    if abs(now - ts) > skew_s:
        raise PeerAuthError(f"timestamp more than {skew_s:g} s from this node's clock")
    if not hmac.compare_digest(sig, _request_mac(secret, node, method, target, ts)):
        raise PeerAuthError("bad signature")
    return node


def sign_reply(secret: bytes, request_auth: str, etag: str, crcs: tuple[int, ...] | list[int],
               block_size: int, length: int) -> str:
    """The `x-tierfs-sig` header: binds the ETag, length and block CRCs to the request
    (its authorization header, which signs the target) under the shared secret."""
    return _mac(secret, "tierfs-peer-reply-v1", request_auth, etag, str(block_size),
                str(length), format_crcs(crcs))


def verify_reply(secret: bytes, request_auth: str, etag: str, crcs: tuple[int, ...],
                 block_size: int, length: int, header: str | None) -> None:
    """PeerCorrupt unless `header` is the reply signature of these values."""
    want = sign_reply(secret, request_auth, etag, crcs, block_size, length)
    if not header or not hmac.compare_digest(header.encode(), want.encode()):
        raise PeerCorrupt("bad reply signature")
