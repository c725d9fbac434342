"""MetaStore: the one LMDB environment of a cache directory.

Named databases (keys are ordered binary, big-endian integers first):
  info      schema version, inode counter, the source this cache dir belongs to
  inodes    ino -> Inode record (kind, size, mtime, etag, key, parent, validated_at)
  dentries  parent ino + name (utf-8) -> child ino; a cursor over one parent gives a
            directory's children in stable byte order
  dirs      dir ino -> time its complete listing was stored
  chunks    object id (16 bytes) + chunk index (u32) -> length, heat, last access, crc32s
  objects   object id -> bucket, key, etag, size (for reports and evict-by-path)
  attrs     ino -> JSON of what S3 listings do not carry: mode, uid, gid, mtime, symlink
            target (set through this mount, or read from object metadata by HEAD)
  uploads   multipart upload id -> key, while the upload runs: after a crash, recovery
            aborts the ones nobody will complete (their parts cost storage)
  dirty     ino -> JSON journal of a closed, not yet uploaded file (write-back); written
            with a full sync, because this is the only copy of acknowledged data
  pins      owner ("job:42", "manual") -> JSON {expires, objects: {oid hex: size}}:
            what `tierfs warm --pin` keeps from eviction, kept across restarts

Every method is one short synchronous transaction; callers never await inside one.
Inode numbers are allocated once per (parent, name, kind) and persist, so they are
stable across daemon restarts.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import lmdb

from .errors import StartupError

SCHEMA_VERSION = 1
ROOT_INO = 1
DIR, FILE, SYMLINK = 1, 2, 3

_U64 = struct.Struct(">Q")
_INODE = struct.Struct("<BQQddH")  # kind, parent, size, mtime, validated_at, len(etag)
_CHUNK = struct.Struct("<Idd")  # length, heat, last access; then one crc32 per block


@dataclass
class Inode:
    ino: int
    parent: int
    kind: int  # DIR or FILE
    size: int
    mtime: float
    etag: str  # "" for directories
    key: str  # full object key (directories: the prefix, ending with "/"; root: "")
    validated_at: float  # last time a LIST/HEAD confirmed this entry
    attrs: dict = field(default_factory=dict)  # from the attrs DB, not packed here

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    def pack(self) -> bytes:
        etag = self.etag.encode()
        return (_INODE.pack(self.kind, self.parent, self.size, self.mtime, self.validated_at,
                            len(etag)) + etag + self.key.encode())

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> "Inode":
        kind, parent, size, mtime, validated_at, elen = _INODE.unpack_from(raw)
        off = _INODE.size
        etag = bytes(raw[off:off + elen]).decode()
        key = bytes(raw[off + elen:]).decode()
        return cls(ino, parent, kind, size, mtime, etag, key, validated_at)


@dataclass
class ChunkRecord:
    length: int
    heat: float
    last_access: float
    crcs: tuple[int, ...]  # crc32 of each checksum block of the chunk file

    def pack(self) -> bytes:
        return (_CHUNK.pack(self.length, self.heat, self.last_access)
                + struct.pack(f"<{len(self.crcs)}I", *self.crcs))

    @classmethod
    def unpack(cls, raw: bytes) -> "ChunkRecord":
        length, heat, last = _CHUNK.unpack_from(raw)
        n = (len(raw) - _CHUNK.size) // 4
        return cls(length, heat, last, struct.unpack_from(f"<{n}I", raw, _CHUNK.size))


def _u64(n: int) -> bytes:
    return _U64.pack(n)


class MetaStore:
    def __init__(self, path: str, source: str, *, map_size: int = 16 << 30) -> None:
        os.makedirs(path, exist_ok=True)
        try:
            # metasync off: a system crash may undo the last transaction but never corrupts;
            # everything stored here is either re-derivable or re-verified by checksum.
            self.env = lmdb.open(path, map_size=map_size, max_dbs=16, metasync=False,
                                 readahead=False)
            self._open_dbs()
        except lmdb.Error as exc:
            raise StartupError(f"cannot open the cache index in {path}: {exc}") from None
        self._check_identity(source)

    def _open_dbs(self) -> None:
        self._info = self.env.open_db(b"info")
        self._inodes = self.env.open_db(b"inodes")
        self._dentries = self.env.open_db(b"dentries")
        self._dirs = self.env.open_db(b"dirs")
        self._chunks = self.env.open_db(b"chunks")
        self._objects = self.env.open_db(b"objects")
        self._attrs = self.env.open_db(b"attrs")
        self._dirty = self.env.open_db(b"dirty")
        self._uploads = self.env.open_db(b"uploads")
        self._pins = self.env.open_db(b"pins")

    def _check_identity(self, source: str) -> None:
        with self.env.begin(write=True) as txn:
            version = txn.get(b"schema", db=self._info)
            owner = txn.get(b"source", db=self._info)
            if version is None:
                txn.put(b"schema", str(SCHEMA_VERSION).encode(), db=self._info)
                txn.put(b"source", source.encode(), db=self._info)
                txn.put(b"next_ino", _u64(ROOT_INO + 1), db=self._info)
                root = Inode(ROOT_INO, ROOT_INO, DIR, 0, 0.0, "", "", 0.0)
                txn.put(_u64(ROOT_INO), root.pack(), db=self._inodes)
                return
            if int(version) != SCHEMA_VERSION:
                raise StartupError(f"cache index schema {int(version)} is not {SCHEMA_VERSION}: "
                                   "use a new --cache-dir")
            if owner is not None and owner.decode() != source:
                raise StartupError(f"cache dir belongs to {owner.decode()}, not {source}: "
                                   "use another --cache-dir")

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    # ---- namespace -------------------------------------------------------------------

    def _load(self, txn: lmdb.Transaction, ino: int) -> Inode | None:
        raw = txn.get(_u64(ino), db=self._inodes)
        if raw is None:
            return None
        node = Inode.unpack(ino, raw)
        attrs = txn.get(_u64(ino), db=self._attrs)
        if attrs is not None:
            node.attrs = json.loads(attrs)
        return node

    def inode(self, ino: int) -> Inode | None:
        with self.env.begin() as txn:
            return self._load(txn, ino)

    def child(self, parent: int, name: bytes) -> Inode | None:
        with self.env.begin() as txn:
            ino = txn.get(_u64(parent) + name, db=self._dentries)
            return self._load(txn, _U64.unpack(ino)[0]) if ino is not None else None

    def children(self, parent: int) -> list[tuple[bytes, Inode]]:
        """All children in stable (byte) order."""
        prefix = _u64(parent)
        out = []
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._dentries)
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    node = self._load(txn, _U64.unpack(v)[0])
                    if node is not None:
                        out.append((bytes(k[8:]), node))
        return out

    def dir_listed_at(self, ino: int) -> float | None:
        with self.env.begin(db=self._dirs) as txn:
            raw = txn.get(_u64(ino))
        return struct.unpack("<d", raw)[0] if raw is not None else None

    def _upsert(self, txn: lmdb.Transaction, parent: int, name: bytes, kind: int, size: int,
                mtime: float, etag: str, key: str, now: float) -> Inode:
        dkey = _u64(parent) + name
        raw_ino = txn.get(dkey, db=self._dentries)
        ino = None
        if raw_ino is not None:
            ino = _U64.unpack(raw_ino)[0]
            raw_old = txn.get(raw_ino, db=self._inodes)
            old = Inode.unpack(ino, raw_old) if raw_old is not None else None
            # a listing shows a symlink as a plain object: the same version stays a symlink
            if old is not None and old.kind == SYMLINK and kind == FILE and old.etag == etag:
                kind = SYMLINK
            # a name that changed kind gets a new inode: the kernel caches an inode's type
            if old is None or old.kind != kind:
                ino = None
        if ino is None:
            ino = _U64.unpack(txn.get(b"next_ino", db=self._info))[0]
            txn.put(b"next_ino", _u64(ino + 1), db=self._info)
            txn.put(dkey, _u64(ino), db=self._dentries)
        node = Inode(ino, parent, kind, size, mtime, etag, key, now)
        txn.put(_u64(ino), node.pack(), db=self._inodes)
        attrs = txn.get(_u64(ino), db=self._attrs)
        if attrs is not None:
            node.attrs = json.loads(attrs)
        return node

    def upsert(self, parent: int, name: bytes, kind: int, size: int, mtime: float, etag: str,
               key: str, now: float) -> Inode:
        with self.env.begin(write=True) as txn:
            return self._upsert(txn, parent, name, kind, size, mtime, etag, key, now)

    def remove(self, parent: int, name: bytes) -> None:
        with self.env.begin(write=True, db=self._dentries) as txn:
            txn.delete(_u64(parent) + name)

    def store_listing(self, parent: int, entries: Iterable[tuple[bytes, int, int, float, str, str]],
                      now: float, keep: Callable[[int], bool] = lambda ino: False,
                      since: float | None = None) -> None:
        """Replace a directory's children with a complete listing, in one transaction.

        entries: (name, kind, size, mtime, etag, key). Names no longer listed lose their
        dentry; their inode records stay so open handles and the kernel keep working.
        Entries for which keep(ino) is true (files with unsaved writes) are left alone:
        local writes win over what the bucket still shows. So are entries validated after
        `since` (when the LIST began): a listing never undoes what was learned after it
        started, such as an upload that finished while its pages were being read.
        """
        prefix = _u64(parent)
        with self.env.begin(write=True) as txn:
            if since is not None:
                base_keep = keep

                def keep(ino: int) -> bool:  # noqa: F811 - widened on purpose
                    raw = txn.get(_u64(ino), db=self._inodes)
                    return base_keep(ino) or (
                        raw is not None and Inode.unpack(ino, raw).validated_at > since)
            seen = set()
            for name, kind, size, mtime, etag, key in entries:
                seen.add(name)
                cur = txn.get(prefix + name, db=self._dentries)
                if cur is not None and keep(_U64.unpack(cur)[0]):
                    continue
                self._upsert(txn, parent, name, kind, size, mtime, etag, key, now)
            cur = txn.cursor(db=self._dentries)
            stale = []
            if cur.set_range(prefix):
                for k in cur.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    if bytes(k[8:]) not in seen and not keep(_U64.unpack(cur.value())[0]):
                        stale.append(bytes(k))
            for k in stale:
                txn.delete(k, db=self._dentries)
            txn.put(_u64(parent), struct.pack("<d", now), db=self._dirs)

    def set_validated(self, node: Inode) -> None:
        with self.env.begin(write=True, db=self._inodes) as txn:
            txn.put(_u64(node.ino), node.pack())

    def set_attrs(self, ino: int, attrs: dict) -> None:
        with self.env.begin(write=True, db=self._attrs) as txn:
            if attrs:
                txn.put(_u64(ino), json.dumps(attrs).encode())
            else:
                txn.delete(_u64(ino))

    def move(self, node: Inode, new_parent: int, new_name: bytes, new_key: str) -> Inode:
        """Rename: the inode keeps its number under its new name (replacing any entry)."""
        old_name = node.key.rstrip("/").rpartition("/")[2].encode()
        with self.env.begin(write=True) as txn:
            txn.delete(_u64(node.parent) + old_name, db=self._dentries)
            txn.put(_u64(new_parent) + new_name, _u64(node.ino), db=self._dentries)
            node.parent, node.key = new_parent, new_key
            txn.put(_u64(node.ino), node.pack(), db=self._inodes)
            if node.kind == DIR:
                self._rekey_children(txn, node.ino, new_key)
                txn.delete(_u64(node.ino), db=self._dirs)
        return node

    def _rekey_children(self, txn: lmdb.Transaction, parent: int, prefix: str) -> None:
        """Give every descendant of a renamed directory its key under the new prefix."""
        start = _u64(parent)
        cur = txn.cursor(db=self._dentries)
        kids = []
        if cur.set_range(start):
            for k, v in cur:
                if not k.startswith(start):
                    break
                kids.append((bytes(k[8:]), _U64.unpack(v)[0]))
        for name, ino in kids:
            raw = txn.get(_u64(ino), db=self._inodes)
            if raw is None:
                continue
            child = Inode.unpack(ino, raw)
            child.key = prefix + name.decode() + ("/" if child.kind == DIR else "")
            child.validated_at = 0.0  # copies have new ETags: ask the bucket again
            txn.put(_u64(ino), child.pack(), db=self._inodes)
            if child.kind == DIR:
                self._rekey_children(txn, ino, child.key)
                txn.delete(_u64(ino), db=self._dirs)

    def forget_listing(self, ino: int) -> None:
        with self.env.begin(write=True, db=self._dirs) as txn:
            txn.delete(_u64(ino))

    # ---- write-back journal ----------------------------------------------------------

    def put_dirty(self, ino: int, record: dict) -> None:
        with self.env.begin(write=True, db=self._dirty) as txn:
            txn.put(_u64(ino), json.dumps(record).encode())
        self.env.sync(True)  # acknowledged data: durable before we answer

    def delete_dirty(self, ino: int) -> None:
        with self.env.begin(write=True, db=self._dirty) as txn:
            txn.delete(_u64(ino))

    def put_upload(self, upload_id: str, key: str) -> None:
        with self.env.begin(write=True, db=self._uploads) as txn:
            txn.put(upload_id.encode(), key.encode())

    def delete_upload(self, upload_id: str) -> None:
        with self.env.begin(write=True, db=self._uploads) as txn:
            txn.delete(upload_id.encode())

    def uploads(self) -> list[tuple[str, str]]:
        with self.env.begin(db=self._uploads) as txn:
            return [(bytes(k).decode(), bytes(v).decode()) for k, v in txn.cursor()]

    def dirty_records(self) -> list[tuple[int, dict]]:
        with self.env.begin(db=self._dirty) as txn:
            return [(_U64.unpack(k)[0], json.loads(v)) for k, v in txn.cursor()]

    # ---- pins ------------------------------------------------------------------------

    def put_pin(self, owner: str, record: dict | None) -> None:
        """Store (or with None delete) one owner's pins."""
        with self.env.begin(write=True, db=self._pins) as txn:
            if record is None:
                txn.delete(owner.encode())
            else:
                txn.put(owner.encode(), json.dumps(record).encode())

    def pins(self) -> list[tuple[str, dict]]:
        with self.env.begin(db=self._pins) as txn:
            return [(bytes(k).decode(), json.loads(v)) for k, v in txn.cursor()]

    # ---- chunk index -----------------------------------------------------------------

    def chunks(self) -> Iterator[tuple[bytes, ChunkRecord]]:
        with self.env.begin(db=self._chunks) as txn:
            for k, v in txn.cursor():
                yield bytes(k), ChunkRecord.unpack(v)

    def chunk(self, key: bytes) -> ChunkRecord | None:
        with self.env.begin(db=self._chunks) as txn:
            raw = txn.get(key)
        return ChunkRecord.unpack(raw) if raw is not None else None

    def apply_chunks(self, puts: dict[bytes, ChunkRecord], deletes: Iterable[bytes],
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
