"""The index's one LMDB environment (CACHE_DIR/index) and its `info` table.

Owns: opening the environment with every named database, the names themselves (DATABASES,
shared with `tierfs fsck`, which reads them directly), the `info` table (which schema, which
source, whether the cache dir has a journal; the table objects keep one key each there,
INFO_KEYS), and the databases an older tierfs kept its journal in. Each table object
(inodes.py, chunks.py, pins.py, ...) begins its own transactions here, on its own databases.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import TypeAlias

import lmdb

from ..errors import StartupError

SCHEMA_VERSION = 1

# every named database of the index (keys are ordered binary, big-endian integers first)
INFO = b"info"  # this module: schema, source, journal marker, and the keys below
INODES = b"inodes"  # inodes.py: ino -> Inode record
DENTRIES = b"dentries"  # inodes.py: parent ino + name -> child ino
DIRS = b"dirs"  # inodes.py: dir ino -> time its complete listing was stored
ATTRS = b"attrs"  # inodes.py: ino -> tierfs.index.attrs.Attrs as JSON
CHUNKS = b"chunks"  # chunks.py: object id + chunk index -> ChunkRecord
OBJECTS = b"objects"  # chunks.py: object id -> bucket, key, etag, size (JSON)
PINS = b"pins"  # pins.py: owner -> JSON pin record
USAGE = b"usage"  # usage.py: tenant/reader -> JSON tally
CAPACITY = b"capacity"  # capacity.py: tier + "/" + u64 step -> JSON sample
ANALYTICS = b"analytics"  # analytics.py: prefix/job/series/totals -> JSON
DATABASES = (INFO, INODES, DENTRIES, DIRS, CHUNKS, OBJECTS, ATTRS, PINS, USAGE, CAPACITY,
             ANALYTICS)
LEGACY = (b"dirty", b"uploads")  # an older tierfs's journal: moved out at open (meta.py)

# keys of `info` and their owners
SCHEMA, SOURCE, JOURNAL = b"schema", b"source", b"journal"  # this module
NEXT_INO = b"next_ino"  # inodes.py: the next inode number to hand out
CHUNK_FORMAT_KEY = b"chunk_format"  # chunks.py: what the chunk records' CRCs are
INFO_KEYS = (SCHEMA, SOURCE, JOURNAL, NEXT_INO, CHUNK_FORMAT_KEY)

U64 = struct.Struct(">Q")
# values come back as bytes: no transaction here is begun with buffers=True
Txn: TypeAlias = "lmdb.Transaction[bytes]"
Db: TypeAlias = lmdb._Database  # what open_db returns


def u64(n: int) -> bytes:
    return U64.pack(n)


class IndexEnv:
    """The open environment: `begin` a transaction on a database of `db(name)`."""

    def __init__(self, path: str, map_size: int) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        try:
            # metasync off: a system crash may undo the last transaction but never corrupts;
            # everything stored here is either re-derivable or re-verified by checksum.
            self._env = lmdb.open(path, map_size=map_size, max_dbs=16, metasync=False,
                                  readahead=False)
            self._dbs = {name: self._env.open_db(name) for name in DATABASES}
        except lmdb.Error as exc:
            raise StartupError(f"cannot open the cache index in {path}: {exc}") from None

    def db(self, name: bytes) -> Db:
        return self._dbs[name]

    def begin(self, *, write: bool = False, db: Db | None = None) -> Txn:
        return self._env.begin(write=write, db=db)

    def info(self, key: bytes, txn: Txn | None = None) -> bytes | None:
        if txn is not None:
            return txn.get(key, db=self._dbs[INFO])
        with self._env.begin(db=self._dbs[INFO]) as own:
            return own.get(key)

    def set_info(self, txn: Txn, key: bytes, value: bytes) -> None:
        txn.put(key, value, db=self._dbs[INFO])

    def schema(self) -> int | None:
        raw = self.info(SCHEMA)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return -1

    def bind(self, source: str, start: Callable[[Txn], None]) -> bool:
        """Bind a new index to its source, `start` giving the tables their first records in
        the same transaction (True); or check an existing one's source (False)."""
        with self._env.begin(write=True) as txn:
            owner = self.info(SOURCE, txn)
            if self.info(SCHEMA, txn) is None:
                self.set_info(txn, SCHEMA, str(SCHEMA_VERSION).encode())
                self.set_info(txn, SOURCE, source.encode())
                start(txn)
                return True
        if owner is not None and owner.decode() != source:
            raise StartupError(f"cache dir belongs to {owner.decode()}, not {source}: "
                               "use another --cache-dir")
        return False

    def journal_marked(self) -> bool:
        return self.info(JOURNAL) is not None

    def mark_journal(self) -> None:
        """From now on a missing journal is a loss, not old age."""
        with self._env.begin(write=True) as txn:
            self.set_info(txn, JOURNAL, b"1")

    def legacy_records(self) -> dict[bytes, list[tuple[bytes, bytes]]]:
        """The records of an older tierfs's journal databases (LEGACY) that are still here
        (by name; one that is gone is left out)."""
        out: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for name in LEGACY:
            try:
                db = self._env.open_db(name, create=False)
            except lmdb.NotFoundError:
                continue
            with self._env.begin(db=db) as txn:
                out[name] = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
        return out

    def drop_legacy(self) -> None:
        with self._env.begin(write=True) as txn:
            for name in LEGACY:
                txn.drop(self._env.open_db(name, txn=txn), delete=True)

    def close(self, *, sync: bool = True) -> None:
        if sync:
            self._env.sync(True)
        self._env.close()
