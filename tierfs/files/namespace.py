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
from typing import Callable, NamedTuple

import trio
from cachetools import TTLCache

from ..backend.base import ObjectMeta
from ..backend.runner import AsyncBackend
from ..errors import (
    AccessDenied,
    BackendError,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoSuchBucket,
    NotADirectory,
    NotEmpty,
    NotFound,
    PreconditionFailed,
    StoreDown,
    TierfsError,
)
from ..index.attrs import (
    DIR,
    FILE,
    MAX_KEY,
    MAX_NAME,
    SPECIAL,
    SYMLINK,
    Attrs,
    for_new,
    from_metadata,
)
from ..index.inodes import ROOT_INO, Inode
from ..index.meta import MetaStore
from ..metrics import Metrics
from ..tasks import Tasks, leaves
from ..telemetry.analytics import Analytics
from .exclusive import PROBE_NAME, ConditionalWrites, Taken
from .revalidation import Late, Revalidations

log = logging.getLogger(__name__)

HEAD_CONCURRENCY = 16  # metadata HEADs of one listing in flight at once
_UNSEEN = Inode(0, 0, DIR, 0, 0.0, "", "", 0.0)  # stands in for a name not in the index


class Caller(NamedTuple):
    """Who asks (the FUSE request's context): new nodes belong to them."""
    uid: int = 0
    gid: int = 0


def _no_answer(exc: BaseException) -> bool:
    """The store failed to answer (unreachable, timing out, 5xx after retries, known down):
    what stale-on-error covers. Answers such as 404 or 403 are not."""
    return (isinstance(exc, (BackendError, StoreDown))
            and not isinstance(exc, (AccessDenied, NoSuchBucket, PreconditionFailed)))


class Namespace:
    def __init__(self, meta: MetaStore, backend: AsyncBackend, metrics: Metrics, *,
                 root_prefix: str, ttl_s: float, clock: Callable[[], float] = time.time,
                 has_local_writes: Callable[[int], bool] = lambda ino: False,
                 tasks: Tasks | None = None, head_max_size: int = -1,
                 head_dirs: bool = False, analytics: Analytics | None = None,
                 revalidate_timeout_s: float = 3.0) -> None:
        self.meta = meta
        # past this, a revalidation of a known entry serves it and goes on in the background
        self._revalidations = Revalidations(tasks, revalidate_timeout_s)
        self._started = clock()  # entries validated before were seen by an earlier daemon
        # LIST and HEAD requests per prefix (metadata pressure, `tierfs report`)
        self.analytics = analytics or Analytics(meta, root_prefix=root_prefix)
        # objects up to this size (directory markers included) get one HEAD per version
        # for their metadata: type, owner, mode, times (-1: none); head_dirs: every new
        # subdirectory too (its marker, or learning it has none), before it is shown
        self.head_max_size = head_max_size
        self.head_dirs = head_dirs
        # where background listings run; without one, lookups stay targeted only
        self._tasks = tasks
        self._listing_soon: set[int] = set()
        # files with unsaved writes: what the bucket says about them is older than we know
        self._local = has_local_writes
        # claims the key of an O_EXCL create in the store (None: a local create only)
        self.exclusive: ConditionalWrites | None = None
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
        """Confirmed by the store within the TTL, by this daemon: what an earlier one saw
        may have changed while no daemon watched (its own last upload may even have
        completed after it was killed), so after a restart every entry is asked once."""
        return (stamp is not None and stamp >= self._started
                and self._clock() - stamp < self.ttl_s)

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
        node = self.meta.inodes.inode(ino)
        if node is None:
            raise NotFound(f"inode {ino} is unknown")
        if ino == ROOT_INO and node.key != self.root_prefix:
            node.key = self.root_prefix
        return node

    def known(self, key: str) -> Inode | None:
        """What the index says about an object key, without asking the store (None: not
        in the index, or outside this mount's prefix)."""
        if not key.startswith(self.root_prefix):
            return None
        node: Inode | None = self.inode(ROOT_INO)
        for part in key[len(self.root_prefix):].split("/"):
            if node is None or not part:
                return None
            node = self.meta.inodes.child(node.ino, part.encode())
        return node

    def nlink(self, node: Inode) -> int:
        """A directory: 2 + its subdirectories once listed, 1 ("unknown", as btrfs) before,
        so tools that count on nlink do not skip what the index has not seen yet. Anything
        else: 1, or 0 once its name is gone (an open file after unlink)."""
        if not node.is_dir:
            return 1 if node.linked else 0
        if self.meta.inodes.dir_listed_at(node.ino) is None:
            return 1
        return 2 + self.meta.inodes.subdirs(node.ino)

    def _dir(self, ino: int) -> Inode:
        node = self.inode(ino)
        if not node.is_dir:
            raise NotADirectory(f"inode {ino} is not a directory")
        return node

    async def listdir(self, ino: int) -> list[tuple[bytes, Inode]]:
        """All children of a directory in stable order, listing the backend if stale."""
        d = self._dir(ino)
        listed_at = self.meta.inodes.dir_listed_at(ino)
        if self._fresh(listed_at):
            return self._children(ino)
        if listed_at is None:  # never listed: nothing to serve, wait for the store
            await self._relist(d)
            return self._children(ino)
        try:
            await self._revalidations.within(("list", ino), lambda: self._relist(d))
        except Late:
            self._serving_stale(ino, self._late())
        except TierfsError as exc:
            if not _no_answer(exc):
                raise
            self._serving_stale(ino, exc)
        return self._children(ino)

    def _children(self, ino: int) -> list[tuple[bytes, Inode]]:
        return [(name, node) for name, node in self.meta.inodes.children(ino)
                if not self._ghost(parent=ino, name=name, node=node)]

    def _ghost(self, *, parent: int, name: bytes, node: Inode) -> bool:
        """A file an earlier daemon created whose name never reached the store and that
        has no unsaved writes: it was open when that daemon died (never acknowledged:
        recovery dropped its data), so its name goes too. Forgotten as it is met. (A file
        of this daemon whose failed writes were dropped keeps its name until the next
        listing, as a created file does.)"""
        if (node.kind != FILE or node.etag or node.validated_at >= self._started
                or self._local(node.ino)):
            return False
        self.meta.inodes.remove(parent, name)
        return True

    def _late(self) -> str:
        return f"no answer within --revalidate-timeout {self._revalidations.timeout_s:g}s"

    async def _relist(self, d: Inode) -> None:
        """List the directory into the index, one LIST walk however many readers."""
        ino = d.ino
        lock = self._listing_locks.setdefault(ino, trio.Lock())
        failed_before = self._list_failed.get(ino)
        try:
            async with lock:  # one LIST walk per directory, however many readers
                failed = self._list_failed.get(ino)
                if failed is not None and failed is not failed_before:
                    raise failed  # it failed while we waited: do not wait it out again
                if not self._fresh(self.meta.inodes.dir_listed_at(ino)):
                    try:
                        await self._list_into(d)
                    except TierfsError as exc:
                        self._list_failed[ino] = exc
                        raise
                    self._list_failed.pop(ino, None)
        finally:
            self._listing_locks.pop(ino, None)

    def _serving_stale(self, dir_ino: int, exc: BaseException | str) -> None:
        """Stale-on-error: say so once per directory and outage."""
        health = getattr(self.backend, "health", None)
        outage = health.recoveries if health is not None else 0  # the same until it is back
        if self._stale_logged.get(dir_ino) == outage:
            return
        self._stale_logged[dir_ino] = outage
        d = self.meta.inodes.inode(dir_ino)
        where = "/" + (d.key.removeprefix(self.root_prefix) if d and dir_ino != ROOT_INO else "")
        log.warning("cannot revalidate %s (%s): serving its cached entries until the store "
                    "answers", where, exc)

    async def _list_into(self, d: Inode) -> None:
        prefix = d.key
        started = self._clock()
        files: dict[str, ObjectMeta] = {}
        dirs: set[str] = set()
        marker: ObjectMeta | None = None
        token = None
        while True:
            self.analytics.meta_request("list", prefix)
            page = await self.backend.list(prefix, "/", token)
            for o in page.objects:
                name = o.key[len(prefix):]
                if name == "":
                    marker = o  # the directory's own marker object
                elif self._valid_name(name, o.key) and not name.startswith(PROBE_NAME):
                    files[name] = o  # (a mount's probe lives for a moment: not shown)
            for p in page.prefixes:
                name = p[len(prefix):-1]
                if self._valid_name(name, p):
                    dirs.add(name)
            token = page.next_token
            if token is None:
                break
        for n in dirs:
            files.pop(n, None)  # a name that is both: the directory wins
        found = await self._read_metadata(d.ino, files)
        if self.head_dirs:
            found.update(await self._read_dir_markers(d, dirs))
        if marker is not None and d.ino != ROOT_INO:
            own = d.key.rstrip("/").rpartition("/")[2]
            _, attrs = (await self._read_metadata(d.parent, {own: marker})).get(own, (DIR, None))
            if attrs is not None:
                d.attrs = attrs
                self.meta.inodes.set_attrs(d.ino, attrs)
        now = self._clock()
        entries: list[tuple] = [(n.encode(), DIR, 0, now, "", prefix + n + "/",
                                 found.get(n, (DIR, None))[1]) for n in dirs]
        for n, o in files.items():
            kind, attrs = found.get(n, (FILE, None))
            entries.append((n.encode(), kind, o.size, o.mtime, o.etag, o.key, attrs))
        self.meta.inodes.store_listing(d.ino, entries, now, keep=self._local, since=started)
        self._stale_logged.pop(d.ino, None)

    def _wants_head(self, parent: int, name: str, obj: ObjectMeta) -> bool:
        """Is an entry's metadata worth a HEAD? Only objects of at most head_max_size
        bytes (by default the empty ones: special files, empty files, directory markers),
        whose type and owner a LIST cannot tell, once per version: what the index already
        read is not asked again."""
        if self.head_max_size < 0 or obj.size > self.head_max_size:
            return False
        node = self.meta.inodes.child(parent, name.encode())
        if node is None:
            return True
        return node.attrs.seen != obj.etag and not self._local(node.ino)

    async def _read_metadata(self, parent: int,
                             objs: dict[str, ObjectMeta]) -> dict[str, tuple[int, Attrs]]:
        """{name: (kind, attrs)} from a HEAD of each object _wants_head picks,
        HEAD_CONCURRENCY at a time (a key ending in "/" is a directory's marker). A failed
        HEAD leaves its entry out: it is asked again at the next listing."""
        found: dict[str, tuple[int, Attrs]] = {}
        limiter = trio.CapacityLimiter(HEAD_CONCURRENCY)

        async def head(name: str, obj: ObjectMeta) -> None:
            async with limiter:
                try:
                    self.analytics.meta_request("head", obj.key)
                    meta = await self.backend.head(obj.key)
                except TierfsError as exc:  # metadata is not worth failing a listing for
                    log.debug("HEAD %r for its metadata failed: %s", obj.key, exc)
                    return
            if meta.etag != obj.etag:
                return  # replaced since the LIST: the next listing asks again
            kind, attrs = from_metadata(meta.metadata or {}, meta.etag)
            if obj.key.endswith("/"):
                kind = DIR
                if attrs.mtime_ns is None:  # a marker made by another tool
                    attrs.mtime_ns = int(meta.mtime * 1e9)
            elif kind not in (FILE, SYMLINK) and kind not in SPECIAL:
                kind = FILE
            found[name] = (kind, attrs)

        async with trio.open_nursery() as n:
            for name, obj in objs.items():
                if self._wants_head(parent, name, obj):
                    n.start_soon(head, name, obj)
        return found

    async def _read_dir_markers(self, d: Inode, names: set[str]) -> dict[str, tuple[int, Attrs]]:
        """The attributes of subdirectories never seen before, from their markers: a
        multi-user mount must not show a directory another node made 0700 as 0755 until it
        is listed. A prefix without a marker is remembered as such (no second HEAD)."""
        known = {n: self.meta.inodes.child(d.ino, n.encode()) or _UNSEEN for n in names}
        new = {n for n, node in known.items() if node.attrs.seen is None}
        if not new:
            return {}
        markers: dict[str, ObjectMeta] = {}
        limiter = trio.CapacityLimiter(HEAD_CONCURRENCY)

        async def head(name: str) -> None:
            async with limiter:
                try:
                    self.analytics.meta_request("head", d.key + name + "/")
                    markers[name] = await self.backend.head(d.key + name + "/")
                except NotFound:
                    markers[name] = ObjectMeta(d.key + name + "/", 0, "", self._clock())
                except TierfsError as exc:
                    log.debug("HEAD of the marker of %r failed: %s", d.key + name, exc)

        async with trio.open_nursery() as n:
            for name in new:
                n.start_soon(head, name)
        out = {}
        for name, meta in markers.items():
            if not meta.etag:  # only a prefix: what this node knows stays (its times)
                mine = known[name].attrs
                out[name] = (DIR, mine.changed(seen="", mtime_ns=mine.mtime_ns or self._now_ns()))
            else:
                _, attrs = from_metadata(meta.metadata or {}, meta.etag)
                if attrs.mtime_ns is None:
                    attrs.mtime_ns = int(meta.mtime * 1e9)
                out[name] = (DIR, attrs)
        return out

    async def lookup(self, parent: int, name: bytes) -> Inode:
        d = self._dir(parent)
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise NotFound("name is not UTF-8") from None
        self._check_length(d, name)
        if sname in ("", ".", "..") or "/" in sname:
            raise NotFound(f"{sname!r}")
        node = self.meta.inodes.child(parent, name)
        if node is not None and self._ghost(parent=parent, name=name, node=node):
            node = None
        if self._fresh(self.meta.inodes.dir_listed_at(parent)):
            if node is None:
                raise NotFound(f"{d.key}{sname}")
            return node
        if node is not None and (self._fresh(node.validated_at) or self._local(node.ino)):
            return node
        if (parent, name) in self._negative:
            raise NotFound(f"{d.key}{sname}")
        self._list_in_background(parent)
        if node is None and self.meta.inodes.dir_listed_at(parent) is None:
            return await self._lookup_remote(d, sname, name)  # never seen: wait, or EIO
        try:
            return await self._revalidations.within(
                ("lookup", parent, name), lambda: self._lookup_remote(d, sname, name))
        except (TierfsError, Late) as exc:
            if isinstance(exc, TierfsError) and not _no_answer(exc):
                raise
            self._serving_stale(parent, exc if isinstance(exc, TierfsError) else self._late())
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
            self.analytics.meta_request("list", key + "/")
            page = await self.backend.list(key + "/", "/", None, 1)
            found["dir"] = bool(page.objects or page.prefixes)
            if page.objects and page.objects[0].key == key + "/":
                found["marker"] = page.objects[0]

        async def as_file() -> None:
            self.analytics.meta_request("list", key)
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
        if found.get("dir"):
            marker = found.get("marker")
            attrs = None
            if isinstance(marker, ObjectMeta):
                found_attrs = await self._read_metadata(d.ino, {sname: marker})
                attrs = found_attrs.get(sname, (DIR, None))[1]
            now = self._clock()
            return self.meta.inodes.upsert(d.ino, name, DIR, 0, now, "", key + "/", now, attrs)
        obj = found.get("file")
        if isinstance(obj, ObjectMeta):
            kind, attrs = (await self._read_metadata(d.ino, {sname: obj})).get(sname, (FILE, None))
            now = self._clock()
            return self.meta.inodes.upsert(d.ino, name, kind, obj.size, obj.mtime, obj.etag,
                                           key, now, attrs)
        self.meta.inodes.remove(d.ino, name)
        self._negative[(d.ino, name)] = True
        raise NotFound(key)

    async def revalidate(self, node: Inode) -> Inode:
        """A file's current size and ETag, asking the backend only when past the TTL."""
        if node.is_dir or self._fresh(node.validated_at) or self._local(node.ino):
            return node
        try:
            return await self._revalidations.within(("head", node.ino),
                                                    lambda: self._head_into(node))
        except (TierfsError, Late) as exc:
            if isinstance(exc, TierfsError) and not _no_answer(exc):
                raise
            self._serving_stale(node.parent, exc if isinstance(exc, TierfsError) else self._late())
            return node  # what was last seen: its cached chunks can still be read

    async def _head_into(self, node: Inode) -> Inode:
        """A HEAD of the file, its answer into the index."""
        try:
            self.analytics.meta_request("head", node.key)
            meta = await self.backend.head(node.key)
        except NotFound:
            self.meta.inodes.remove(node.parent, node.key.rpartition("/")[2].encode())
            raise
        node.size, node.mtime, node.etag = meta.size, meta.mtime, meta.etag
        node.validated_at = self._clock()
        self.meta.inodes.set_validated(node)
        if node.attrs.seen != meta.etag:  # another version: its metadata is the truth
            _, attrs = from_metadata(meta.metadata or {}, meta.etag)
            node.attrs = attrs
            self.meta.inodes.set_attrs(node.ino, attrs)
        return node

    async def refresh(self, node: Inode) -> Inode:
        """Force revalidation (after If-Match failed)."""
        node.validated_at = 0.0
        return await self.revalidate(node)

    # ---- changes (the FUSE layer has checked read-only and permissions) -----------------

    def _check_length(self, d: Inode, name: bytes, suffix: str = "") -> None:
        if len(name) > MAX_NAME:
            raise NameTooLong(f"a name of {len(name)} bytes (at most {MAX_NAME})")
        if len(d.key.encode()) + len(name) + len(suffix) > MAX_KEY:
            raise NameTooLong(f"the key {d.key!r} + {len(name)} bytes would pass S3's "
                              f"{MAX_KEY} bytes")

    def new_key(self, d: Inode, name: bytes, suffix: str = "") -> str:
        """The key of a new entry `name` of directory d (+ suffix: "/" for a directory)."""
        self._check_length(d, name, suffix)
        try:
            sname = name.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("names must be UTF-8 (S3 keys are)") from None
        if sname in ("", ".", "..") or "/" in sname:
            raise InvalidArgument(f"{sname!r} cannot be a key segment")
        return d.key + sname + suffix

    def _now_ns(self) -> int:
        return int(self._clock() * 1e9)

    def touch(self, node: Inode, *, data: bool = False, now_ns: int | None = None,
              store: bool = True) -> Inode:
        """ctime (and with data=True mtime) to now: a directory whose entries changed, a
        node whose attributes changed. Kept in the index only (docs/semantics.md)."""
        now_ns = self._now_ns() if now_ns is None else now_ns
        node.attrs = node.attrs.changed(ctime_ns=now_ns,
                                        mtime_ns=now_ns if data else node.attrs.mtime_ns)
        if node.attrs.mtime_ns is None:  # keep what stat showed: the LIST's time
            node.attrs.mtime_ns = int(node.mtime * 1e9)
        if store:
            self.meta.inodes.set_attrs(node.ino, node.attrs)
        return node

    def _new_attrs(self, d: Inode, kind: int, perm: int, caller: Caller,
                   rdev: int = 0) -> Attrs:
        return for_new(kind, perm, caller.uid, caller.gid, d.attrs, self._now_ns(), rdev)

    def _created(self, d: Inode, name: bytes, kind: int, size: int, etag: str, key: str,
                 attrs: Attrs) -> Inode:
        now = self._clock()
        self._negative.pop((d.ino, name), None)
        self.touch(d, data=True, now_ns=attrs.ctime_ns, store=False)
        return self.meta.inodes.upsert(d.ino, name, kind, size, now, etag, key, now, attrs, d.attrs)

    def create_file(self, parent: int, name: bytes, perm: int, caller: Caller = Caller()) -> Inode:
        """A new, empty file known only here until its first upload."""
        d = self._dir(parent)
        key = self.new_key(d, name)
        return self._created(d, name, FILE, 0, "", key, self._new_attrs(d, FILE, perm, caller))

    async def create_file_exclusive(self, parent: int, name: bytes, perm: int,
                                    caller: Caller = Caller()) -> Inode:
        """create_file for O_CREAT|O_EXCL: the key is claimed in the store first
        (tierfs/files/exclusive.py), so that of two nodes creating one name exactly one
        succeeds. The other gets Taken (EEXIST) and knows the name from then on. Where the
        store cannot claim, as create_file."""
        d = self._dir(parent)
        key = self.new_key(d, name)
        attrs = self._new_attrs(d, FILE, perm, caller)
        try:
            meta = (None if self.exclusive is None
                    else await self.exclusive.claim(key, attrs.to_metadata(FILE)))
        except Taken as exc:
            # the loser's negative entry and listing said "missing": the winner's object
            # replaces them, so stat and the next O_EXCL see it now, not after the TTL
            self._negative.pop((d.ino, name), None)
            found = exc.found
            if found is not None:
                kind, seen = from_metadata(found.metadata or {}, found.etag)
                self.meta.inodes.upsert(d.ino, name, kind or FILE, found.size, found.mtime,
                                        found.etag, key, self._clock(), seen)
            raise
        if meta is None:
            return self._created(d, name, FILE, 0, "", key, attrs)
        attrs.seen = meta.etag
        return self._created(d, name, FILE, 0, meta.etag, key, attrs)

    async def mkdir(self, parent: int, name: bytes, perm: int, caller: Caller = Caller()) -> Inode:
        d = self._dir(parent)
        key = self.new_key(d, name, "/")
        attrs = self._new_attrs(d, DIR, perm, caller)
        # the marker makes an empty directory exist and carries its attributes
        meta = await self.backend.put(key, b"", attrs.to_metadata(DIR))
        attrs.seen = meta.etag
        node = self._created(d, name, DIR, 0, "", key, attrs)
        self.meta.inodes.store_listing(node.ino, [], self._clock())  # known empty: no LIST needed
        return node

    async def mknod(self, parent: int, name: bytes, kind: int, perm: int, rdev: int,
                    caller: Caller = Caller()) -> Inode:
        """A fifo, socket or device node (or an empty regular file): an empty object whose
        metadata says what it is (the mount is nodev: a device is a name and a number)."""
        d = self._dir(parent)
        key = self.new_key(d, name)
        attrs = self._new_attrs(d, kind, perm, caller, rdev)
        meta = await self.backend.put(key, b"", attrs.to_metadata(kind))
        attrs.seen = meta.etag
        return self._created(d, name, kind, 0, meta.etag, key, attrs)

    async def symlink(self, parent: int, name: bytes, target: bytes,
                      caller: Caller = Caller()) -> Inode:
        d = self._dir(parent)
        key = self.new_key(d, name)
        attrs = self._new_attrs(d, SYMLINK, 0o777, caller)
        meta = await self.backend.put(key, target, attrs.to_metadata(SYMLINK))
        attrs.symlink = target.decode(errors="surrogateescape")
        attrs.seen = meta.etag
        return self._created(d, name, SYMLINK, len(target), meta.etag, key, attrs)

    async def rmdir(self, parent: int, name: bytes) -> None:
        node = await self.lookup(parent, name)
        if not node.is_dir:
            raise NotADirectory(node.key)
        if any(True for _ in self.meta.inodes.children(node.ino) if self._local(_[1].ino)):
            raise NotEmpty(node.key)
        self.analytics.meta_request("list", node.key)
        page = await self.backend.list(node.key, "/", None, 2)
        if page.prefixes or any(o.key != node.key for o in page.objects):
            raise NotEmpty(node.key)
        await self.backend.delete(node.key)
        self.meta.inodes.remove(parent, name)
        self.meta.inodes.forget_listing(node.ino)
        self._negative[(parent, name)] = True
        self.touch(self.inode(parent), data=True)

    async def unlink(self, parent: int, name: bytes) -> Inode:
        node = await self.lookup(parent, name)
        if node.is_dir:
            raise IsADirectory(node.key)
        if node.etag:  # it exists in the bucket (a file never uploaded does not)
            await self.backend.delete(node.key)
        self.meta.inodes.remove(parent, name)
        self._negative[(parent, name)] = True
        now_ns = self._now_ns()
        self.touch(self.inode(parent), data=True, now_ns=now_ns)
        return self.touch(node, now_ns=now_ns)  # an open file's ctime moves too

    async def readlink(self, ino: int) -> bytes:
        node = self.inode(ino)
        if node.attrs.symlink is None:
            target = await self.backend.get(node.key, 0, node.size, node.etag)
            node.attrs.symlink = target.decode(errors="surrogateescape")
            self.meta.inodes.set_attrs(ino, node.attrs)
        return node.attrs.symlink.encode(errors="surrogateescape")

    async def set_attrs(self, node: Inode, attrs: Attrs) -> Inode:
        """chmod/chown/utimens: kept in the index and in S3 metadata: an uploaded object is
        copied onto itself with the new metadata (S3 cannot edit it), a directory's marker
        is written again (made, if the directory was only a prefix). A file with unsaved
        writes carries them in its next upload (the caller gives them to its DirtyFile)."""
        if node.is_dir and node.ino != ROOT_INO:
            meta = await self.backend.put(node.key, b"", attrs.to_metadata(DIR))
            attrs.seen = meta.etag
        elif not node.is_dir and node.etag and not self._local(node.ino):
            etag = await self.backend.copy(node.key, node.key, node.etag,
                                           attrs.to_metadata(node.kind))
            node.etag, node.validated_at = etag, self._clock()
            attrs.seen = etag
            self.meta.inodes.set_validated(node)
        node.attrs = attrs
        self.meta.inodes.set_attrs(node.ino, attrs)
        return node

    async def list_tree(self, prefix: str, limit: int) -> list[ObjectMeta] | None:
        """Every object under a prefix, or None when there are more than limit."""
        keys: list[ObjectMeta] = []
        token = None
        while True:
            self.analytics.meta_request("list", prefix)
            page = await self.backend.list(prefix, None, token)
            keys += page.objects
            if len(keys) > limit:
                return None
            token = page.next_token
            if token is None:
                return keys

    def renamed(self, node: Inode, new_parent: int, new_name: bytes, new_key: str) -> Inode:
        self._negative.pop((new_parent, new_name), None)
        old_parent = node.parent
        self._negative[(old_parent, node.key.rstrip("/").rpartition("/")[2].encode())] = True
        node = self.meta.inodes.move(node, new_parent, new_name, new_key)
        now_ns = self._now_ns()
        for ino in {old_parent, new_parent}:
            self.touch(self.inode(ino), data=True, now_ns=now_ns)
        return self.touch(node, now_ns=now_ns)
