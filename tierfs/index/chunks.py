"""The cached chunks the index remembers, and the objects they belong to.

Owns the `chunks` database (object id (16 bytes) + chunk index (u32) -> ChunkRecord: length,
heat, last access, one CRC per checksum block of the chunk file), the `objects` database
(object id -> bucket, key, etag, size as JSON: for reports and evict-by-path) and the
`chunk_format` key in `info`: what the CRCs are (CHUNK_FORMAT). Records of another format
are dropped at open; their files become orphans that ChunkCache.recover deletes.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .env import CHUNK_FORMAT_KEY, CHUNKS, OBJECTS, IndexEnv

log = logging.getLogger(__name__)

_CHUNK = struct.Struct("<Idd")  # length, heat, last access; then one CRC per block
# what ChunkRecord.crcs are (tierfs.cache.disk computes them): 1 zlib CRC32 (before the
# key existed in info), 2 CRC32C. A chunk record is only ever checked with its own kind.
CHUNK_FORMAT = 2
KEY_LEN = 20  # object id + chunk index


@dataclass
class ChunkRecord:
    length: int
    heat: float
    last_access: float
    crcs: tuple[int, ...]  # CRC32C (CHUNK_FORMAT) of each checksum block of the chunk file

    def pack(self) -> bytes:
        return (_CHUNK.pack(self.length, self.heat, self.last_access)
                + struct.pack(f"<{len(self.crcs)}I", *self.crcs))

    @classmethod
    def unpack(cls, raw: bytes) -> ChunkRecord:
        length, heat, last = _CHUNK.unpack_from(raw)
        n = (len(raw) - _CHUNK.size) // 4
        return cls(length, heat, last, struct.unpack_from(f"<{n}I", raw, _CHUNK.size))


def chunk_format(raw: bytes | None) -> int:
    """CHUNK_FORMAT of an index from its info value (none: an index older than the key)."""
    try:
        return int(raw) if raw is not None else 1
    except ValueError:
        return -1


class ChunkTable:
    def __init__(self, env: IndexEnv) -> None:
        self.env = env
        self._chunks = env.db(CHUNKS)
        self._objects = env.db(OBJECTS)

    def check_format(self) -> None:
        """Drop the chunk records of another CHUNK_FORMAT (their CRCs would fail every read,
        or worse, be read as the wrong kind): the chunks are fetched again. Nothing else
        in the index, and not the journal, is touched."""
        with self.env.begin(write=True) as txn:
            found = chunk_format(self.env.info(CHUNK_FORMAT_KEY, txn))
            if found == CHUNK_FORMAT:
                return
            dropped = txn.stat(self._chunks)["entries"]
            txn.drop(self._chunks, delete=False)
            self.env.set_info(txn, CHUNK_FORMAT_KEY, str(CHUNK_FORMAT).encode())
        if dropped:
            log.info("cache index %s: %d chunk records of cache format %d dropped (this tierfs "
                     "checks format %d); their chunk files are deleted and fetched again",
                     self.env.path, dropped, found, CHUNK_FORMAT)

    def all(self) -> Iterator[tuple[bytes, ChunkRecord]]:
        with self.env.begin(db=self._chunks) as txn:
            for k, v in txn.cursor():
                yield bytes(k), ChunkRecord.unpack(v)

    def get(self, key: bytes) -> ChunkRecord | None:
        with self.env.begin(db=self._chunks) as txn:
            raw = txn.get(key)
        return ChunkRecord.unpack(raw) if raw is not None else None

    def apply(self, puts: dict[bytes, ChunkRecord], deletes: Iterable[bytes],
              objects: dict[bytes, dict] | None = None) -> None:
        """One transaction for a batch of index changes (called from a worker thread)."""
        with self.env.begin(write=True) as txn:
            for k in deletes:
                txn.delete(k, db=self._chunks)
            for k, rec in puts.items():
                txn.put(k, rec.pack(), db=self._chunks)
            for oid, info in (objects or {}).items():
                txn.put(oid, json.dumps(info).encode(), db=self._objects)

    def object_info(self, oid: bytes) -> dict | None:
        with self.env.begin(db=self._objects) as txn:
            raw = txn.get(oid)
        return json.loads(raw) if raw is not None else None

    def restore(self, chunks: Iterable[tuple[bytes, bytes]], fmt: int,
                objects: Iterable[tuple[bytes, bytes]]) -> None:
        """What a damaged index of chunk format `fmt` still yields (tierfs.index.probe):
        chunk records that parse (ChunkCache.recover re-adopts the files whose size
        matches; reads verify every block) and object info that is a JSON object."""
        with self.env.begin(write=True) as txn:
            for k, v in chunks if fmt == CHUNK_FORMAT else ():
                try:
                    rec = ChunkRecord.unpack(v)
                except struct.error:
                    continue
                if len(k) == KEY_LEN and (len(v) - _CHUNK.size) % 4 == 0 and rec.length > 0:
                    txn.put(k, v, db=self._chunks)
            for k, v in objects:
                try:
                    if isinstance(json.loads(v), dict):
                        txn.put(k, v, db=self._objects)
                except ValueError:
                    continue
