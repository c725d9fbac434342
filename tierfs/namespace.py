"""Namespace: directories and files over LIST results, kept in LMDB.

Rules (docs/semantics.md): '/'-delimited prefixes are directories; a "dir/" marker object
makes an (empty) directory; a name that is both an object and a prefix shows as the
directory; keys that cannot be paths (empty segments, '.', '..', segments over 255
bytes) are hidden, counted and logged once. Within metadata_ttl every answer comes from
LMDB; a complete listing also answers "no such name" (negative caching) for its
directory, and targeted lookups remember misses in a TTL cache.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio
from cachetools import TTLCache

from .backend.runner import AsyncBackend
from .errors import NotADirectory, NotFound
from .meta import DIR, FILE, ROOT_INO, Inode, MetaStore
from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_NAME = 255


class Namespace:
    def __init__(self, meta: MetaStore, backend: AsyncBackend, metrics: Metrics, *,
                 root_prefix: str, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.meta = meta
        self.backend = backend
        self.metrics = metrics
        self.root_prefix = root_prefix
        self.ttl_s = ttl_s
        self._clock = clock
        self._negative: TTLCache = TTLCache(maxsize=100_000, ttl=max(ttl_s, 0.001), timer=clock)
        self._logged_invalid: set[str] = set()
        self._listing_locks: dict[int, trio.Lock] = {}

    def _fresh(self, stamp: float | None) -> bool:
        return stamp is not None and self._clock() - stamp < self.ttl_s

    def _valid_name(self, name: str, key: str) -> bool:
        if name in ("", ".", "..") or len(name.encode()) > MAX_NAME or "\0" in name:
            if key not in self._logged_invalid:
                self._logged_invalid.add(key)
                self.metrics.invalid_keys.inc()
                log.warning("hiding key %r: it cannot be a path (empty, '.', '..' or a "
                            "segment over 255 bytes)", key)
            return False
        return True

    def inode(self, ino: int) -> Inode:
        node = self.meta.inode(ino)
        if node is None:
            raise NotFound(f"inode {ino} is unknown")
        if ino == ROOT_INO and node.key != self.root_prefix:
            node.key = self.root_prefix
        return node

    def _dir(self, ino: int) -> Inode:
        node = self.inode(ino)
        if not node.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        return node

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """All children of a directory in stable order, listing the backend if stale."""
        d = self._dir(ino)
        if not self._fresh(self.meta.dir_listed_at(ino)):
            lock = self._listing_locks.setdefault(ino, trio.Lock())
            async with lock:  # one LIST walk per directory, however many readers
                if not self._fresh(self.meta.dir_listed_at(ino)):
                    await self._list_into(d)
            self._listing_locks.pop(ino, None)
        return self.meta.children(ino)

    async def _list_into(self, d: Inode) -> None:
        prefix = d.key
        files: dict[str, tuple] = {}
        dirs: set[str] = set()
        token = None
        while True:
            page = await self.backend.list(prefix, "/", token)
            for o in page.objects:
                name = o.key[len(prefix):]
                if name == "":
                    continue  # the directory's own marker object
                if self._valid_name(name, o.key):
                    files[name] = (o.size, o.mtime, o.etag, o.key)
            for p in page.prefixes:
                name = p[len(prefix):-1]
                if self._valid_name(name, p):
                    dirs.add(name)
            token = page.next_token
            if token is None:
                break
        now = self._clock()
        entries = [(n.encode(), DIR, 0, now, "", prefix + n + "/") for n in dirs]
        entries += [(n.encode(), FILE, s, m, e, k) for n, (s, m, e, k) in files.items()
                    if n not in dirs]  # a name that is both: the directory wins
        self.meta.store_listing(d.ino, entries, now)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        d = self._dir(parent)
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise NotFound("name is not UTF-8") from None
        if sname in ("", ".", "..") or len(name) > MAX_NAME or "/" in sname:
            raise NotFound(f"{sname!r}")
        if self._fresh(self.meta.dir_listed_at(parent)):
            node = self.meta.child(parent, name)
            if node is None:
                raise NotFound(f"{d.key}{sname}")
            return node
        node = self.meta.child(parent, name)
        if node is not None and self._fresh(node.validated_at):
            return node
        if (parent, name) in self._negative:
            raise NotFound(f"{d.key}{sname}")
        return await self._lookup_remote(d, sname, name)

    async def _lookup_remote(self, d: Inode, sname: str, name: bytes) -> Inode:
        key = d.key + sname
        found: dict[str, object] = {}

        async def as_dir() -> None:
            page = await self.backend.list(key + "/", "/", None, 1)
            found["dir"] = bool(page.objects or page.prefixes)

        async def as_file() -> None:
            page = await self.backend.list(key, "/", None, 1)
            if page.objects and page.objects[0].key == key:
                found["file"] = page.objects[0]

        async with trio.open_nursery() as n:
            n.start_soon(as_dir)
            n.start_soon(as_file)
        now = self._clock()
        if found.get("dir"):
            return self.meta.upsert(d.ino, name, DIR, 0, now, "", key + "/", now)
        obj = found.get("file")
        if obj is not None:
            return self.meta.upsert(d.ino, name, FILE, obj.size, obj.mtime, obj.etag,  # type: ignore[attr-defined]
                                    key, now)
        self.meta.remove(d.ino, name)
        self._negative[(d.ino, name)] = True
        raise NotFound(key)

    async def revalidate(self, node: Inode) -> Inode:
        """A file's current size and ETag, asking the backend only when past the TTL."""
        if node.is_dir or self._fresh(node.validated_at):
            return node
        try:
            meta = await self.backend.head(node.key)
        except NotFound:
            self.meta.remove(node.parent, node.key.rpartition("/")[2].encode())
            raise
        node.size, node.mtime, node.etag = meta.size, meta.mtime, meta.etag
        node.validated_at = self._clock()
        self.meta.set_validated(node)
        return node

    async def refresh(self, node: Inode) -> Inode:
        """Force revalidation (after If-Match failed)."""
        node.validated_at = 0.0
        return await self.revalidate(node)
