"""Checks that bytes from the object store are the bytes that were stored.

The backend (tierfs/backend/s3.py) calls `verify` on every GET body once it is complete,
before a byte of it is returned, so before anything is served or cached. What can be
checked depends on what the store says about the object (docs/semantics.md "What is
verified"):

- ETag = MD5 of the bytes, for a single-part object read whole (32 hex digits, no "-N"
  suffix) that is not encrypted with SSE-KMS or SSE-C (their ETags are not MD5s);
- S3 additional checksums (x-amz-checksum-crc32/crc32c/sha1/sha256, and crc64nvme when
  awscrt is installed) of the whole object, when the object has a full-object checksum
  (not a COMPOSITE "-N" one) and the GET read it whole: S3 sends them only then;
- the CRC32C of each chunk that tierfs put in the user metadata of the objects it writes
  (`chunk_crcs_metadata`), for every chunk a GET covers whole, ranged GETs included.

Each byte is checked once: a body that one check covers whole is not checked again by
another (they would prove the same thing at a second pass over the bytes). The cheapest
check that covers the body wins: tierfs's chunk CRC32Cs (hardware CRC), then S3's
full-object checksums (CRCs before hashes), then the ETag's MD5 (MD5 costs about ten
times a CRC32C: bench/README.md).

A mismatch raises IntegrityError naming the key, the offset and the check; the backend
fetches again (bounded) and never returns the bad bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable

import google_crc32c

from .errors import IntegrityError

# user-metadata key of the chunk CRC list (S3 sends it as x-amz-meta-tierfs-crc32c)
CRC_META_KEY = "tierfs-crc32c"
# S3 allows 2 KB of user metadata (names and values together); the rest is left to what
# else tierfs stores there (mode, uid, gid, mtime)
CRC_META_BUDGET = 1600

# labels of tierfs_integrity_failures{check}: a fixed vocabulary
CHECK_MD5 = "etag_md5"
CHECK_CHUNK_CRC = "chunk_crc32c"

_MD5_ETAG = re.compile(r"[0-9a-fA-F]{32}")
_PIECE = 1 << 20  # google_crc32c takes read-only bytes only: CRC a big view piece by piece


def crc32c(view: memoryview | bytes) -> int:
    """CRC32C (Castagnoli) of a bytes-like object, hardware-accelerated. A writable view
    (a bytearray or the disk tier's mmap) is copied 1 MiB at a time, never whole."""
    if isinstance(view, bytes):
        return google_crc32c.value(view)
    view = memoryview(view)
    crc = 0
    for i in range(0, len(view), _PIECE):
        crc = google_crc32c.extend(crc, bytes(view[i:i + _PIECE]))
    return crc


def chunk_crcs_metadata(chunk_size: int, crcs: list[int]) -> dict[str, str]:
    """User metadata that lets later reads verify an object tierfs writes, chunk by chunk.

    `crcs[i]` is the CRC32C (`crc32c` above) of the object's bytes
    [i * chunk_size, (i + 1) * chunk_size) (the last chunk may be shorter); the list must
    cover the whole object: ceil(size / chunk_size) values, none for an empty object.
    Returns {CRC_META_KEY: "<chunk_size>:<base64 of the big-endian u32 CRCs>"} to merge
    into the object's metadata on PUT / CreateMultipartUpload, or {} when the list would
    not fit in CRC_META_BUDGET bytes (S3 caps user metadata at 2 KB): 295 chunks, i.e.
    objects up to 2.3 GiB with 8 MiB chunks (295 x chunk size in general). Larger objects
    are simply not verified this way. A reader whose chunk size differs verifies the
    chunks of the writer's size that each of its GETs covers whole.
    """
    if chunk_size <= 0 or not crcs:
        return {}
    value = f"{chunk_size}:" + base64.b64encode(struct.pack(f">{len(crcs)}I", *crcs)).decode()
    if len(CRC_META_KEY) + len(value) > CRC_META_BUDGET:
        return {}
    return {CRC_META_KEY: value}


def parse_chunk_crcs(metadata: dict[str, str] | None) -> tuple[int, list[int]] | None:
    """(chunk_size, crcs) from an object's user metadata, None if absent or malformed
    (metadata is whatever the object's writer put there: malformed means "not ours")."""
    raw = (metadata or {}).get(CRC_META_KEY)
    if not raw:
        return None
    size_text, sep, b64 = raw.partition(":")
    try:
        chunk_size = int(size_text)
        packed = base64.b64decode(b64, validate=True)
    except (ValueError, binascii.Error):
        return None
    if not sep or chunk_size <= 0 or not packed or len(packed) % 4:
        return None
    return chunk_size, list(struct.unpack(f">{len(packed) // 4}I", packed))


def _crc32(view: memoryview) -> bytes:
    return struct.pack(">I", zlib.crc32(view))


def _crc32c(view: memoryview) -> bytes:
    return struct.pack(">I", crc32c(view))


def _hashlib(name: str) -> Callable[[memoryview], bytes]:
    return lambda view: hashlib.new(name, view).digest()


# algorithm (as in x-amz-checksum-<algorithm>) -> the digest S3 sends, base64-decoded
CHECKSUMS: dict[str, Callable[[memoryview], bytes]] = {
    "crc32": _crc32, "crc32c": _crc32c, "sha1": _hashlib("sha1"), "sha256": _hashlib("sha256"),
}
# crc64nvme is added by backend/s3.py when botocore can compute it (awscrt installed)
# the order full-object checksums are tried in: cheapest first (one is enough)
_CHEAPEST_FIRST = ("crc32c", "crc64nvme", "crc32", "sha1", "sha256")


@dataclass(frozen=True)
class Received:
    """What one GET response says about the body it carried (all from its headers)."""

    key: str
    start: int  # offset of the body's first byte in the object
    total: int | None  # the object's size (Content-Range, or Content-Length of a 200)
    etag: str  # without quotes
    # SSE-KMS or SSE-C: the ETag is not an MD5 of the bytes
    encrypted: bool = False
    # algorithm -> base64 value, only full-object checksums (not COMPOSITE "-N" ones)
    checksums: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def whole(self, length: int) -> bool:
        return self.start == 0 and self.total is not None and length == self.total


def verify(got: Received, body: memoryview) -> list[str]:
    """Check `body` against everything `got` allows; raise IntegrityError on a mismatch.
    Returns the checks that were made (none: nothing could be checked)."""
    body = memoryview(body)
    covered, done = _verify_chunks(got, body)
    if (covered and covered == len(body)) or not got.whole(len(body)):
        return done  # checked whole by the chunk CRCs, or no whole-object check applies
    for algorithm in sorted(got.checksums, key=_cost):
        expected = got.checksums[algorithm]
        digest = CHECKSUMS.get(algorithm)
        if digest is None or "-" in expected:
            continue
        try:
            want = base64.b64decode(expected, validate=True)
        except binascii.Error:
            continue
        if digest(body) != want:
            raise _mismatch(got, f"checksum_{algorithm}", got.start, len(body))
        return done + [f"checksum_{algorithm}"]
    if not got.encrypted and _MD5_ETAG.fullmatch(got.etag):
        if hashlib.md5(body).hexdigest() != got.etag.lower():
            raise _mismatch(got, CHECK_MD5, got.start, len(body))
        done.append(CHECK_MD5)
    return done


def _cost(algorithm: str) -> int:
    return (_CHEAPEST_FIRST.index(algorithm) if algorithm in _CHEAPEST_FIRST
            else len(_CHEAPEST_FIRST))


def _verify_chunks(got: Received, body: memoryview) -> tuple[int, list[str]]:
    """Check every writer's chunk the body covers whole: (bytes checked, checks made)."""
    parsed = parse_chunk_crcs(got.metadata)
    if parsed is None or got.total is None:
        return 0, []
    chunk_size, crcs = parsed
    if len(crcs) != -(-got.total // chunk_size):
        # not a list for this object's size: metadata copied from another object by some
        # other client. Checking against it would refuse good bytes; not checking is safe.
        return 0, []
    end = got.start + len(body)
    first = -(-got.start // chunk_size)  # the first chunk that starts inside the body
    checked = 0
    for i in range(first, len(crcs)):
        lo, hi = i * chunk_size, min((i + 1) * chunk_size, got.total)
        if hi > end:
            break
        if crc32c(body[lo - got.start:hi - got.start]) != crcs[i]:
            raise _mismatch(got, CHECK_CHUNK_CRC, lo, hi - lo)
        checked += hi - lo
    return checked, [CHECK_CHUNK_CRC] if checked else []


def _mismatch(got: Received, check: str, offset: int, length: int) -> IntegrityError:
    return IntegrityError(f"get {got.key!r} at {offset}: {length} bytes failed the {check} "
                          f"check", check=check, offset=offset)
