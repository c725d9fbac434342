"""Namespace: directories and files over LIST results, kept in LMDB.

Rules (docs/semantics.md): '/'-delimited prefixes are directories; a "dir/" marker object
makes an (empty) directory; a name that is both an object and a prefix shows as the
directory; keys that cannot be paths (empty segments, '.', '..', segments over 255
bytes) are hidden, counted and logged once. Within metadata_ttl every answer comes from
LMDB; a complete listing also answers "no such name" (negative caching) for its
directory, and targeted lookups remember misses in a TTL cache.

Stale-on-error (as HTTP caches do): past the TTL, a revalidation (LIST, HEAD) that fails
because the store does not answer serves what the index holds - the directory's last
listing, the entry last seen - with one WARNING per directory per outage, not one per
lookup. Only what was never seen fails (EIO). An answer of the store (404, 403, 412) is
never overridden.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio
from cachetools import TTLCache

from .backend.base import ObjectMeta
from .backend.runner import AsyncBackend
from .errors import (AccessDenied, BackendError, InvalidArgument, IsADirectory, NoSuchBucket,
                     NotADirectory, NotEmpty, NotFound, PreconditionFailed, StoreDown,
                     TierfsError)
from .meta import DIR, FILE, ROOT_INO, SYMLINK, Inode, MetaStore
from .metrics import Metrics
from .tasks import Tasks, leaves

log = logging.getLogger(__name__)

MAX_NAME = 255


def _no_answer(exc: BaseException) -> bool:
    """The store failed to answer (unreachable, timing out, 5xx after retries, known down):
    what stale-on-error covers. Answers such as 404 or 403 are not."""
    return (isinstance(exc, (BackendError, StoreDown))
            and not isinstance(exc, (AccessDenied, NoSuchBucket, PreconditionFailed)))


class Namespace:
    def __init__(self, meta: MetaStore, backend: AsyncBackend, metrics: Metrics, *,
                 root_prefix: str, ttl_s: float, clock: Callable[[], float] = time.time,
                 has_local_writes: Callable[[int], bool] = lambda ino: False,
                 tasks: Tasks | None = None) -> None:
        self.meta = meta
        # where background listings run; without one, lookups stay targeted only
        self._tasks = tasks
        self._listing_soon: set[int] = set()
        # files with unsaved writes: what the bucket says about them is older than we know
        self._local = has_local_writes
        self.backend = backend
        self.metrics = metrics
        self.root_prefix = root_prefix
        self.ttl_s = ttl_s
        self._clock = clock
        self._negative: TTLCache = TTLCache(maxsize=100_000, ttl=max(ttl_s, 0.001), timer=clock)
        self._logged_invalid: set[str] = set()
        self._listing_locks: dict[int, trio.Lock] = {}
        # the last failed listing of each directory: readers queued behind it serve stale
        # entries instead of each waiting out the retries again
        self._list_failed: dict[int, TierfsError] = {}
        # directory -> the outage in which "serving stale" was logged for it (counted by
        # the health's recoveries, so the failure that makes the store suspect and the
        # refusals once it is known down are one outage)
        self._stale_logged: dict[int, int] = {}

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
        listed_at = self.meta.dir_listed_at(ino)
        if not self._fresh(listed_at):
            lock = self._listing_locks.setdefault(ino, trio.Lock())
            failed_before = self._list_failed.get(ino)
            try:
                async with lock:  # one LIST walk per directory, however many readers
                    failed = self._list_failed.get(ino)
                    if failed is not None and failed is not failed_before:
                        raise failed  # it failed while we waited: do not wait it out again
                    if not self._fresh(self.meta.dir_listed_at(ino)):
                        try:
                            await self._list_into(d)
                        except TierfsError as exc:
                            self._list_failed[ino] = exc
                            raise
                        self._list_failed.pop(ino, None)
            except TierfsError as exc:
                if listed_at is None or not _no_answer(exc):
                    raise  # never listed: nothing to serve
                self._serving_stale(ino, exc)
            finally:
                self._listing_locks.pop(ino, None)
        return self.meta.children(ino)

    def _serving_stale(self, dir_ino: int, exc: BaseException) -> None:
        """Stale-on-error: say so once per directory and outage."""
        health = getattr(self.backend, "health", None)
        outage = health.recoveries if health is not None else 0  # the same until it is back
        if self._stale_logged.get(dir_ino) == outage:
            return
        self._stale_logged[dir_ino] = outage
        d = self.meta.inode(dir_ino)
        where = "/" + (d.key.removeprefix(self.root_prefix) if d and dir_ino != ROOT_INO else "")
        log.warning("cannot revalidate %s (%s): serving its cached entries until the store "
                    "answers", where, exc)

    async def _list_into(self, d: Inode) -> None:
        prefix = d.key
        started = self._clock()
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
        self.meta.store_listing(d.ino, entries, now, keep=self._local, since=started)
        self._stale_logged.pop(d.ino, None)

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
        if node is not None and (self._fresh(node.validated_at) or self._local(node.ino)):
            return node
        if (parent, name) in self._negative:
            raise NotFound(f"{d.key}{sname}")
        self._list_in_background(parent)
        try:
            return await self._lookup_remote(d, sname, name)
        except TierfsError as exc:
            if not _no_answer(exc):
                raise
            if node is None and self.meta.dir_listed_at(parent) is None:
                raise  # never seen: EIO
            self._serving_stale(parent, exc)
            if node is None:  # the directory's last listing has no such name
                raise NotFound(f"{d.key}{sname}") from None
            return node

    def _list_in_background(self, ino: int) -> None:
        """A lookup in an unlisted directory: answer it with two one-key LISTs now, and
        list the whole directory meanwhile, so the next lookups there (a data loader
        opening every file) are answered locally. A huge directory never delays a lookup."""
        if self._tasks is None or ino in self._listing_soon:
            return
        self._listing_soon.add(ino)

        async def run() -> None:
            try:
                await self.listdir(ino)
            except TierfsError as exc:
                log.debug("background listing of inode %d failed: %s", ino, exc)
            finally:
                self._listing_soon.discard(ino)

        self._tasks.spawn("listing", run)

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

        try:
            async with trio.open_nursery() as n:
                n.start_soon(as_dir)
                n.start_soon(as_file)
        except BaseExceptionGroup as group:
            # both LISTs fail alike when the store is down; the caller wants the TierfsError
            errors = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
            if errors and all(isinstance(e, TierfsError) for e in errors):
                raise errors[0] from None
            raise
        self._stale_logged.pop(d.ino, None)
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
        if node.is_dir or self._fresh(node.validated_at) or self._local(node.ino):
            return node
        try:
            meta = await self.backend.head(node.key)
        except NotFound:
            self.meta.remove(node.parent, node.key.rpartition("/")[2].encode())
            raise
        except TierfsError as exc:
            if not _no_answer(exc):
                raise
            self._serving_stale(node.parent, exc)
            return node  # what was last seen: its cached chunks can still be read
        node.size, node.mtime, node.etag = meta.size, meta.mtime, meta.etag
        node.validated_at = self._clock()
        self.meta.set_validated(node)
        attrs = attrs_from_metadata(meta.metadata or {})
        if attrs and attrs != node.attrs:
            node.attrs = attrs
            self.meta.set_attrs(node.ino, attrs)
        return node

    async def refresh(self, node: Inode) -> Inode:
        """Force revalidation (after If-Match failed)."""
        node.validated_at = 0.0
        return await self.revalidate(node)

    # ---- changes (the FUSE layer has checked read-only and permissions) -----------------

    def _name(self, name: bytes) -> str:
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("names must be UTF-8 (S3 keys are)") from None
        if sname in ("", ".", "..") or "/" in sname or len(name) > MAX_NAME:
            raise InvalidArgument(f"{sname!r} cannot be a key segment")
        return sname

    def create_file(self, parent: int, name: bytes, mode: int = 0) -> Inode:
        """A new, empty file known only here until its first upload."""
        d = self._dir(parent)
        key = d.key + self._name(name)
        now = self._clock()
        self._negative.pop((parent, name), None)
        node = self.meta.upsert(parent, name, FILE, 0, now, "", key, now)
        if mode:
            node.attrs = {"mode": mode}
            self.meta.set_attrs(node.ino, node.attrs)
        return node

    async def mkdir(self, parent: int, name: bytes) -> Inode:
        d = self._dir(parent)
        key = d.key + self._name(name) + "/"
        await self.backend.put(key, b"")  # the marker makes an empty directory exist
        now = self._clock()
        self._negative.pop((parent, name), None)
        node = self.meta.upsert(parent, name, DIR, 0, now, "", key, now)
        self.meta.store_listing(node.ino, [], now)  # known empty: no LIST needed
        return node

    async def rmdir(self, parent: int, name: bytes) -> None:
        node = await self.lookup(parent, name)
        if not node.is_dir:
            raise NotADirectory(node.key)
        if any(True for _ in self.meta.children(node.ino) if self._local(_[1].ino)):
            raise NotEmpty(node.key)
        page = await self.backend.list(node.key, "/", None, 2)
        if page.prefixes or any(o.key != node.key for o in page.objects):
            raise NotEmpty(node.key)
        await self.backend.delete(node.key)
        self.meta.remove(parent, name)
        self.meta.forget_listing(node.ino)
        self._negative[(parent, name)] = True

    async def unlink(self, parent: int, name: bytes) -> Inode:
        node = await self.lookup(parent, name)
        if node.is_dir:
            raise IsADirectory(node.key)
        if node.etag:  # it exists in the bucket (a file never uploaded does not)
            await self.backend.delete(node.key)
        self.meta.remove(parent, name)
        self._negative[(parent, name)] = True
        return node

    async def symlink(self, parent: int, name: bytes, target: bytes) -> Inode:
        d = self._dir(parent)
        key = d.key + self._name(name)
        attrs = {"symlink": target.decode(errors="surrogateescape")}
        meta = await self.backend.put(key, target, metadata_from_attrs(attrs))
        now = self._clock()
        self._negative.pop((parent, name), None)
        node = self.meta.upsert(parent, name, SYMLINK, len(target), now, meta.etag, key, now)
        self.meta.set_attrs(node.ino, attrs)
        node.attrs = attrs
        return node

    async def readlink(self, ino: int) -> bytes:
        node = self.inode(ino)
        if "symlink" not in node.attrs:
            target = await self.backend.get(node.key, 0, node.size, node.etag)
            node.attrs["symlink"] = target.decode(errors="surrogateescape")
            self.meta.set_attrs(ino, node.attrs)
        return node.attrs["symlink"].encode(errors="surrogateescape")

    async def set_attrs(self, node: Inode, changes: dict) -> Inode:
        """chmod/chown/utimens: kept in the index and, for uploaded files, in S3 metadata."""
        attrs = {**node.attrs, **changes}
        if node.kind == FILE and node.etag and not self._local(node.ino):
            # S3 cannot edit metadata: copy the object onto itself with the new metadata
            etag = await self.backend.copy(node.key, node.key, node.etag, metadata_from_attrs(attrs))
            node.etag, node.validated_at = etag, self._clock()
            self.meta.set_validated(node)
        node.attrs = attrs
        self.meta.set_attrs(node.ino, attrs)
        return node

    async def list_tree(self, prefix: str, limit: int) -> list[ObjectMeta] | None:
        """Every object under a prefix, or None when there are more than limit."""
        keys: list[ObjectMeta] = []
        token = None
        while True:
            page = await self.backend.list(prefix, None, token)
            keys += page.objects
            if len(keys) > limit:
                return None
            token = page.next_token
            if token is None:
                return keys

    def renamed(self, node: Inode, new_parent: int, new_name: bytes, new_key: str) -> Inode:
        self._negative.pop((new_parent, new_name), None)
        self._negative[(node.parent, node.key.rstrip("/").rpartition("/")[2].encode())] = True
        return self.meta.move(node, new_parent, new_name, new_key)


# chmod/chown/utimens and symlinks travel with the object as user metadata
_META_KEYS = {"mode": "tierfs-mode", "uid": "tierfs-uid", "gid": "tierfs-gid",
              "mtime": "tierfs-mtime", "symlink": "tierfs-symlink"}


def metadata_from_attrs(attrs: dict) -> dict[str, str]:
    out = {}
    for k, v in attrs.items():
        if k == "symlink":
            out[_META_KEYS[k]] = "1"  # the target is the object's content
        elif k in _META_KEYS:
            out[_META_KEYS[k]] = oct(v) if k == "mode" else str(v)
    return out


def attrs_from_metadata(metadata: dict[str, str]) -> dict:
    out: dict = {}
    try:
        if "tierfs-mode" in metadata:
            out["mode"] = int(metadata["tierfs-mode"], 8)
        for k in ("uid", "gid"):
            if f"tierfs-{k}" in metadata:
                out[k] = int(metadata[f"tierfs-{k}"])
        if "tierfs-mtime" in metadata:
            out["mtime"] = float(metadata["tierfs-mtime"])
    except ValueError:
        log.warning("ignoring malformed tierfs metadata %r", metadata)
    return out
