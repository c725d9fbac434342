"""Versioned, immutable cache keys.

A chunk belongs to one version of one object: (bucket, key, ETag) hashes to a 16-byte
object id, and the chunk key is that id plus the chunk index. An overwritten object has a
new ETag and so new keys: stale chunks are never found, only aged out by eviction.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from functools import cached_property

_IDX = struct.Struct(">I")


@dataclass(frozen=True)
class ObjectVersion:
    bucket: str
    key: str
    etag: str
    size: int

    @cached_property  # a hash per read otherwise: computed once per version object
    def oid(self) -> bytes:
        return hashlib.blake2b(f"{self.bucket}\0{self.key}\0{self.etag}".encode(),
                               digest_size=16).digest()

    def chunk_key(self, index: int) -> bytes:
        return self.oid + _IDX.pack(index)


def chunk_index(ckey: bytes) -> int:
    return _IDX.unpack_from(ckey, 16)[0]


def chunk_name(ckey: bytes) -> str:
    """File name of a chunk on disk: objectid-hex.index."""
    return f"{ckey[:16].hex()}.{chunk_index(ckey)}"
