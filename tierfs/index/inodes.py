"""The namespace the index remembers: inodes, directory entries, listings, attributes.

Owns the `inodes` (ino -> Inode record: kind, size, mtime, etag, key, parent, validated_at),
`dentries` (parent ino + name -> child ino; a cursor over one parent gives a directory's
children in stable byte order), `dirs` (dir ino -> when its complete listing was stored) and
`attrs` (ino -> tierfs.index.attrs.Attrs as JSON: what S3 listings do not carry) databases,
and the inode counter in `info`. Inode numbers are allocated once per (parent, name, kind)
and persist, so they are stable across daemon restarts.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .attrs import DIR, FILE, SPECIAL, SYMLINK, Attrs
from .env import ATTRS, DENTRIES, DIRS, INODES, NEXT_INO, U64, IndexEnv, Txn, u64

ROOT_INO = 1

_INODE = struct.Struct("<BQQddH")  # kind, parent, size, mtime, validated_at, len(etag)


@dataclass
class Inode:
    ino: int
    parent: int
    kind: int  # DIR, FILE, SYMLINK or a special file (tierfs.index.attrs)
    size: int
    mtime: float
    etag: str  # "" for directories
    key: str  # full object key (directories: the prefix, ending with "/"; root: "")
    validated_at: float  # last time a LIST/HEAD confirmed this entry
    attrs: Attrs = field(default_factory=Attrs)  # from the attrs DB, not packed here
    linked: bool = True  # False once its name is gone (unlinked, replaced): nlink 0

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    def pack(self) -> bytes:
        etag = self.etag.encode()
        return (_INODE.pack(self.kind, self.parent, self.size, self.mtime, self.validated_at,
                            len(etag)) + etag + self.key.encode())

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> Inode:
        kind, parent, size, mtime, validated_at, elen = _INODE.unpack_from(raw)
        off = _INODE.size
        etag = bytes(raw[off:off + elen]).decode()
        key = bytes(raw[off + elen:]).decode()
        return cls(ino, parent, kind, size, mtime, etag, key, validated_at)


def _name(key: str) -> bytes:
    return key.rstrip("/").rpartition("/")[2].encode()


class InodeTable:
    """Every method is one short synchronous transaction."""

    def __init__(self, env: IndexEnv) -> None:
        self.env = env
        self._inodes = env.db(INODES)
        self._dentries = env.db(DENTRIES)
        self._dirs = env.db(DIRS)
        self._attrs = env.db(ATTRS)
        self._subdirs: dict[int, int] = {}  # dir ino -> subdirectories in the index

    def start(self, txn: Txn, first_ino: int) -> None:
        """A new index: the root, and the counter from `first_ino` on."""
        self.env.set_info(txn, NEXT_INO, u64(max(ROOT_INO + 1, first_ino)))
        root = Inode(ROOT_INO, ROOT_INO, DIR, 0, 0.0, "", "", 0.0)
        txn.put(u64(ROOT_INO), root.pack(), db=self._inodes)

    def _load(self, txn: Txn, ino: int) -> Inode | None:
        raw = txn.get(u64(ino), db=self._inodes)
        if raw is None:
            return None
        node = Inode.unpack(ino, raw)
        attrs = txn.get(u64(ino), db=self._attrs)
        if attrs is not None:
            node.attrs = Attrs.from_json(attrs)
        if ino != ROOT_INO:
            node.linked = txn.get(u64(node.parent) + _name(node.key),
                                  db=self._dentries) == u64(ino)
        return node

    def inode(self, ino: int) -> Inode | None:
        with self.env.begin() as txn:
            return self._load(txn, ino)

    def child(self, parent: int, name: bytes) -> Inode | None:
        with self.env.begin() as txn:
            ino = txn.get(u64(parent) + name, db=self._dentries)
            return self._load(txn, U64.unpack(ino)[0]) if ino is not None else None

    def children(self, parent: int) -> list[tuple[bytes, Inode]]:
        """All children in stable (byte) order."""
        return self._children_from(parent, b"", None)

    def children_after(self, parent: int, name: bytes, limit: int) -> list[tuple[bytes, Inode]]:
        """Up to `limit` children that follow `name` in the listing's (byte) order."""
        return self._children_from(parent, name + b"\0", limit)  # no name holds a NUL

    def _children_from(self, parent: int, start: bytes,
                       limit: int | None) -> list[tuple[bytes, Inode]]:
        prefix = u64(parent)
        out: list[tuple[bytes, Inode]] = []
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._dentries)
            if cur.set_range(prefix + start):
                for k, v in cur:
                    if not k.startswith(prefix) or (limit is not None and len(out) >= limit):
                        break
                    node = self._load(txn, U64.unpack(v)[0])
                    if node is not None:
                        out.append((bytes(k[8:]), node))
        return out

    def dir_listed_at(self, ino: int) -> float | None:
        with self.env.begin(db=self._dirs) as txn:
            raw = txn.get(u64(ino))
        return struct.unpack("<d", raw)[0] if raw is not None else None

    def subdirs(self, ino: int) -> int:
        """How many subdirectories the index holds for a directory (its nlink - 2),
        remembered until one of its entries changes."""
        count = self._subdirs.get(ino)
        if count is None:
            count = sum(1 for _, node in self.children(ino) if node.kind == DIR)
            self._subdirs[ino] = count
        return count

    def _upsert(self, txn: Txn, parent: int, name: bytes, kind: int, size: int,
                mtime: float, etag: str, key: str, now: float,
                attrs: Attrs | None = None) -> Inode:
        self._subdirs.pop(parent, None)
        dkey = u64(parent) + name
        raw_ino = txn.get(dkey, db=self._dentries)
        ino = None
        if raw_ino is not None:
            ino = U64.unpack(raw_ino)[0]
            raw_old = txn.get(raw_ino, db=self._inodes)
            old = Inode.unpack(ino, raw_old) if raw_old is not None else None
            # a listing shows a symlink or a special file as a plain object: the same
            # version keeps the kind its metadata gave it
            if (old is not None and (old.kind == SYMLINK or old.kind in SPECIAL)
                    and kind == FILE and old.etag == etag):
                kind = old.kind
            # a name that changed kind gets a new inode: the kernel caches an inode's type
            if old is None or old.kind != kind:
                ino = None
            elif kind == DIR:
                mtime = old.mtime  # a prefix's time is when it was first seen, not listed
        if ino is None:
            counter = self.env.info(NEXT_INO, txn)
            assert counter is not None, "start() set the inode counter when the index was bound"
            ino = U64.unpack(counter)[0]
            self.env.set_info(txn, NEXT_INO, u64(ino + 1))
            txn.put(dkey, u64(ino), db=self._dentries)
        node = Inode(ino, parent, kind, size, mtime, etag, key, now)
        txn.put(u64(ino), node.pack(), db=self._inodes)
        if attrs is not None:
            txn.put(u64(ino), attrs.to_json(), db=self._attrs)
            node.attrs = attrs
        else:
            raw = txn.get(u64(ino), db=self._attrs)
            if raw is not None:
                node.attrs = Attrs.from_json(raw)
        return node

    def upsert(self, parent: int, name: bytes, kind: int, size: int, mtime: float, etag: str,
               key: str, now: float, attrs: Attrs | None = None,
               parent_attrs: Attrs | None = None) -> Inode:
        """Create or update the entry `name` of `parent`; attrs, when given, replace the
        node's, parent_attrs the parent's (its times: one transaction for both)."""
        with self.env.begin(write=True) as txn:
            if parent_attrs is not None:
                txn.put(u64(parent), parent_attrs.to_json(), db=self._attrs)
            return self._upsert(txn, parent, name, kind, size, mtime, etag, key, now, attrs)

    def remove(self, parent: int, name: bytes) -> None:
        self._subdirs.pop(parent, None)
        with self.env.begin(write=True, db=self._dentries) as txn:
            txn.delete(u64(parent) + name)

    def store_listing(self, parent: int, entries: Iterable[tuple[bytes, int, int, float, str, str]],
                      now: float, keep: Callable[[int], bool] = lambda ino: False,
                      since: float | None = None) -> None:
        """Replace a directory's children with a complete listing, in one transaction.

        entries: (name, kind, size, mtime, etag, key[, attrs]). Names no longer listed lose their
        dentry; their inode records stay so open handles and the kernel keep working.
        Entries for which keep(ino) is true (files with unsaved writes) are left alone:
        local writes win over what the bucket still shows. So are entries validated after
        `since` (when the LIST began): a listing never undoes what was learned after it
        started, such as an upload that finished while its pages were being read.
        """
        prefix = u64(parent)
        self._subdirs.pop(parent, None)
        with self.env.begin(write=True) as txn:
            def kept(ino: int) -> bool:
                if keep(ino):
                    return True
                if since is None:
                    return False
                raw = txn.get(u64(ino), db=self._inodes)
                return raw is not None and Inode.unpack(ino, raw).validated_at > since

            seen = set()
            for entry in entries:
                name, kind, size, mtime, etag, key = entry[:6]
                seen.add(name)
                cur = txn.get(prefix + name, db=self._dentries)
                if cur is not None and kept(U64.unpack(cur)[0]):
                    continue
                self._upsert(txn, parent, name, kind, size, mtime, etag, key, now,
                             entry[6] if len(entry) > 6 else None)
            dents = txn.cursor(db=self._dentries)
            stale = []
            if dents.set_range(prefix):
                for k in dents.iternext(values=False):
                    if not k.startswith(prefix):
                        break
                    if bytes(k[8:]) not in seen and not kept(U64.unpack(dents.value())[0]):
                        stale.append(bytes(k))
            for k in stale:
                txn.delete(k, db=self._dentries)
            txn.put(u64(parent), struct.pack("<d", now), db=self._dirs)

    def set_validated(self, node: Inode, attrs: Attrs | None = None) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(u64(node.ino), node.pack(), db=self._inodes)
            if attrs is not None:
                txn.put(u64(node.ino), attrs.to_json(), db=self._attrs)

    def set_attrs(self, ino: int, attrs: Attrs) -> None:
        with self.env.begin(write=True, db=self._attrs) as txn:
            txn.put(u64(ino), attrs.to_json())

    def move(self, node: Inode, new_parent: int, new_name: bytes, new_key: str) -> Inode:
        """Rename: the inode keeps its number under its new name (replacing any entry)."""
        old_name = _name(node.key)
        self._subdirs.pop(node.parent, None)
        self._subdirs.pop(new_parent, None)
        with self.env.begin(write=True) as txn:
            txn.delete(u64(node.parent) + old_name, db=self._dentries)
            txn.put(u64(new_parent) + new_name, u64(node.ino), db=self._dentries)
            node.parent, node.key = new_parent, new_key
            txn.put(u64(node.ino), node.pack(), db=self._inodes)
            if node.kind == DIR:
                self._rekey_children(txn, node.ino, new_key)
                txn.delete(u64(node.ino), db=self._dirs)
        return node

    def _rekey_children(self, txn: Txn, parent: int, prefix: str) -> None:
        """Give every descendant of a renamed directory its key under the new prefix."""
        start = u64(parent)
        cur = txn.cursor(db=self._dentries)
        kids = []
        if cur.set_range(start):
            for k, v in cur:
                if not k.startswith(start):
                    break
                kids.append((bytes(k[8:]), U64.unpack(v)[0]))
        for name, ino in kids:
            raw = txn.get(u64(ino), db=self._inodes)
            if raw is None:
                continue
            child = Inode.unpack(ino, raw)
            child.key = prefix + name.decode() + ("/" if child.kind == DIR else "")
            child.validated_at = 0.0  # copies have new ETags: ask the bucket again
            txn.put(u64(ino), child.pack(), db=self._inodes)
            if child.kind == DIR:
                self._rekey_children(txn, ino, child.key)
                txn.delete(u64(ino), db=self._dirs)

    def forget_listing(self, ino: int) -> None:
        with self.env.begin(write=True, db=self._dirs) as txn:
            txn.delete(u64(ino))

    def files(self) -> Iterator[tuple[str, int]]:
        """(key, size) of every file the index knows (from listings; the report's
        "total size" per prefix)."""
        with self.env.begin(db=self._inodes) as txn:
            for _, v in txn.cursor():
                node = Inode.unpack(0, v)
                if node.kind == FILE:
                    yield node.key, node.size

    # ---- what the write-back journal keeps of a file's place (tierfs.index.journal) ----------

    def chain(self, ino: int) -> list[list]:
        """[ino, parent, kind, key] of a file and the directories above it, root first."""
        out = []
        seen = set()
        with self.env.begin() as txn:
            cur = ino
            while cur != ROOT_INO and cur not in seen:
                raw = txn.get(u64(cur), db=self._inodes)
                if raw is None:
                    break
                node = Inode.unpack(cur, raw)
                out.append([cur, node.parent, node.kind, node.key])
                seen.add(cur)
                cur = node.parent
        return out[::-1]

    def restore(self, chains: dict[int, list[list]], sizes: dict[int, int]) -> None:
        """Give a new index the inodes of journaled files back (file ino -> its chain),
        with their numbers and the directories above them: the name still leads to the
        unsaved bytes, and no other file can be given their numbers."""
        with self.env.begin(write=True) as txn:
            for ino, chain in chains.items():
                for cino, parent, kind, key in chain:
                    cino, parent = int(cino), int(parent)
                    if txn.get(u64(cino), db=self._inodes) is None:
                        size = sizes.get(ino, 0) if cino == ino else 0
                        node = Inode(cino, parent, int(kind), size, time.time(), "", key, 0.0)
                        txn.put(u64(cino), node.pack(), db=self._inodes)
                    txn.put(u64(parent) + _name(key), u64(cino), db=self._dentries,
                            overwrite=False)
