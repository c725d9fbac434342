"""Warm: bring a set of paths into the disk tier ahead of a job, optionally pinned.

A set is paths relative to the mount's root: files, directories (everything below
them) and glob patterns (fnmatch per path segment; `**` is any depth of directories).
It is resolved through the Namespace, so its listings land in the index and the job's
own lookups and stats are answered locally afterwards: one LIST walk per directory,
never a HEAD per file.

Then, in order:
1. the set's size is checked against what the cache can hold (the budget at the low
   watermark, less what others pin and unsaved writes), and the part of each tenant
   against that tenant's hard share (less what others pin of it and its unsaved writes):
   a set that cannot fit is refused before anything is fetched, instead of evicting its
   own head while fetching its tail;
2. the set is pinned for the duration of the warm (a transient owner), so the warm's
   later fills never evict its earlier ones;
3. every chunk not already on disk is fetched on the backend's warm lane by
   `concurrency` workers; chunks already cached cost nothing, which is what makes a
   rerun resume where the last one stopped;
4. with a pin owner the set stays pinned afterwards (without a TTL, each file gets its
   tenant's pin_ttl, if it has one); the chunk index is flushed so a daemon restart keeps
   what was warmed.

Failures are the client's to read, never the daemon's to die of: a path that cannot be
listed or fetched is an entry in the result's `errors` and the warm goes on with the
rest. An unexpected exception (a bug, a library error the backend did not translate) is
logged with its traceback (once per warm), counted in
tierfs_internal_errors_total{task="warm"}, and reported to the client the same way.
"""

from __future__ import annotations

import fnmatch
import glob
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from ..cache import ChunkCache, ObjectVersion
from ..config import format_size
from ..errors import InvalidArgument, NoSpace, NotFound, PreconditionFailed, TierfsError
from ..files.namespace import Namespace
from ..index.attrs import FILE
from ..index.inodes import ROOT_INO, Inode
from ..metrics import Metrics
from ..read.promote import Copier
from ..read.walk import TierWalk
from ..tasks import expected_error, sole_exception

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5
LISTING_CONCURRENCY = 8
MAX_REPORTED_ERRORS = 50

Progress = Callable[[dict], Awaitable[None]]


@dataclass
class WarmSet:
    files: list[tuple[str, ObjectVersion]] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    unsaved: int = 0  # files with writes not uploaded yet: their data is local already
    _seen: set[int] = field(default_factory=set)

    @property
    def objects(self) -> dict[bytes, int]:
        return {obj.oid: obj.size for _, obj in self.files}


class Warmer:
    def __init__(self, ns: Namespace, cache: ChunkCache, walk: TierWalk, metrics: Metrics, *,
                 bucket: str, has_local_writes: Callable[[int], bool]) -> None:
        self.ns = ns
        self.cache = cache
        self.walk = walk
        self.metrics = metrics
        self.bucket = bucket
        self._local = has_local_writes
        self._ids = itertools.count(1)
        self._bugs_logged: set[int] = set()  # warms that logged a traceback already
        # --tier: copies objects to the near store straight from the source (no local
        # cache on the way); set by the core (build_core), None without a near store
        self.near: Copier | None = None

    def _failure(self, exc: Exception, warm_id: int = 0) -> TierfsError:
        """What a client is told about `exc`: the TierfsError it is (also inside a group),
        or, for anything else, a generic error - after logging the traceback (the first
        time in this warm) and counting an internal error."""
        err = expected_error(exc)
        if err is not None:
            return err
        bug = sole_exception(exc)
        self.metrics.internal_errors.labels("warm").inc()
        if warm_id not in self._bugs_logged:
            self._bugs_logged.add(warm_id)
            log.error("internal error in warm (the mount stays up): %r", bug, exc_info=exc)
        return TierfsError(f"internal error ({type(bug).__name__}: {bug}); the daemon's log "
                           f"has the traceback")

    # ---- resolving a set -------------------------------------------------------------

    async def resolve(self, patterns: list[str], ws: WarmSet | None = None) -> WarmSet:
        ws = WarmSet() if ws is None else ws
        for pattern in patterns:
            try:
                matches = await self._match(pattern)
            except Exception as exc:  # noqa: BLE001 - _failure: one error entry per pattern
                ws.errors.append({"path": pattern, "error": str(self._failure(exc))})
                continue
            if not matches:
                why = "matches nothing" if glob.has_magic(pattern) else "no such file or directory"
                ws.errors.append({"path": pattern, "error": why})
            for path, node in matches:
                if node.is_dir:
                    await self._walk(path, node, ws)
                else:
                    self._add(path, node, ws)
        return ws

    async def _match(self, pattern: str) -> list[tuple[str, Inode]]:
        segments = [s for s in pattern.split("/") if s not in ("", ".")]
        if ".." in segments:
            raise InvalidArgument("'..' is not allowed in a warm path")
        frontier = [("", self.ns.inode(ROOT_INO))]
        for seg in segments:
            found: list[tuple[str, Inode]] = []
            for path, node in frontier:
                if not node.is_dir:
                    continue
                if seg == "**":
                    found += await self._dirs_below(path, node)
                elif glob.has_magic(seg):
                    for name, child in await self.ns.listdir(node.ino):
                        sname = name.decode(errors="surrogateescape")
                        if fnmatch.fnmatchcase(sname, seg):
                            found.append((_join(path, sname), child))
                else:
                    try:
                        found.append((_join(path, seg), await self.ns.lookup(node.ino,
                                                                             seg.encode())))
                    except NotFound:
                        pass
            frontier = found
        return frontier

    async def _dirs_below(self, path: str, node: Inode) -> list[tuple[str, Inode]]:
        out, level = [(path, node)], [(path, node)]
        while level:
            listed = await self._list_level(level, None)
            level = [(p, c) for p, c in listed if c.is_dir]
            out += level
        return out

    async def _walk(self, path: str, node: Inode, ws: WarmSet) -> None:
        """Every file below a directory, a level at a time (listings run in parallel)."""
        level = [(path, node)]
        while level:
            listed = await self._list_level(level, ws)
            level = [(p, c) for p, c in listed if c.is_dir]
            for p, c in listed:
                if not c.is_dir:
                    self._add(p, c, ws)

    async def _list_level(self, dirs: list[tuple[str, Inode]],
                          ws: WarmSet | None) -> list[tuple[str, Inode]]:
        results: dict[int, list[tuple[bytes, Inode]]] = {}
        limiter = trio.CapacityLimiter(LISTING_CONCURRENCY)

        failures: list[TierfsError] = []

        async def ls(i: int, path: str, d: Inode) -> None:
            async with limiter:
                try:
                    results[i] = await self.ns.listdir(d.ino)
                except Exception as exc:  # noqa: BLE001 - never into the nursery: one entry
                    err = self._failure(exc)
                    failures.append(err)
                    if ws is not None:
                        ws.errors.append({"path": path or "/", "error": str(err)})

        async with trio.open_nursery() as nursery:
            for i, (path, d) in enumerate(dirs):
                nursery.start_soon(ls, i, path, d)
        if failures and ws is None:
            raise failures[0]
        return [(_join(path, name.decode(errors="surrogateescape")), child)
                for i, (path, _) in enumerate(dirs) for name, child in results.get(i, ())]

    def _add(self, path: str, node: Inode, ws: WarmSet) -> None:
        if node.kind != FILE or node.ino in ws._seen:
            return  # symlinks are not followed
        ws._seen.add(node.ino)
        if self._local(node.ino) or not node.etag:
            ws.unsaved += 1
            return
        ws.files.append((path, ObjectVersion(self.bucket, node.key, node.etag, node.size)))

    # ---- sizes -----------------------------------------------------------------------

    def _chunks(self, obj: ObjectVersion) -> range:
        return range(-(-obj.size // self.walk.chunk_size))

    def cached_bytes(self, obj: ObjectVersion) -> int:
        return sum(self.walk.chunk_length(obj, i) for i in self._chunks(obj)
                   if self.cache.has(obj.chunk_key(i)))

    def room_for(self, objects: dict[bytes, int]) -> tuple[int, str]:
        """Bytes a set may take, and how that was worked out (for the refusal message)."""
        budget = self.cache.budget()
        others = {oid: size for oid, size in self.cache.pins.objects().items()
                  if oid not in objects}
        pinned = self.cache.bytes_of(others)
        dirty = self.cache.dirty_bytes
        low = self.cache.evictor.low
        room = max(0, int(low * budget) - pinned - dirty)
        why = (f"{format_size(budget)} budget at the {low:.0%} eviction mark, "
               f"less {format_size(pinned)} pinned by others and {format_size(dirty)} "
               f"of unsaved writes")
        return room, why

    def over_hard(self, files: list[ObjectVersion]) -> str | None:
        """Why the set would pass a tenant's hard share, with the numbers; None if none."""
        by_tenant: dict[str, dict[bytes, int]] = {}
        for obj in files:
            by_tenant.setdefault(self.cache.tenant_of(obj), {})[obj.oid] = obj.size
        shares = self.cache.tenant_bytes()
        for tenant, objects in sorted(by_tenant.items()):
            share = self.cache.hard_share(tenant)
            if share is None:
                continue
            size = sum(objects.values())
            pinned = self.cache.pinned_bytes(tenant, exclude=objects)
            dirty = shares[tenant].dirty
            if size + pinned + dirty > share:
                hard = self.cache.tenants.get(tenant).hard
                return (f"the warm set's files of tenant {tenant} are {format_size(size)} "
                        f"({len(objects)} files) but its hard share is {hard} = "
                        f"{format_size(share)} of the {format_size(self.cache.budget())} "
                        f"budget, less {format_size(pinned)} it pins otherwise and "
                        f"{format_size(dirty)} of its unsaved writes: warm less, unpin "
                        f"something of {tenant}, or raise its hard share")
        return None

    def pin_ttls(self, files: list[ObjectVersion]) -> dict[bytes, float]:
        """oid -> its tenant's pin_ttl, for the files whose tenant has one."""
        out = {}
        for obj in files:
            ttl = self.cache.tenants.get(self.cache.tenant_of(obj)).pin_ttl
            if ttl:
                out[obj.oid] = ttl
        return out

    # ---- commands --------------------------------------------------------------------

    async def warm(self, patterns: list[str], *, check: bool = False, pin_owner: str | None = None,
                   pin_expires: float | None = None, concurrency: int = 16,
                   progress: Progress | None = None, tier: str = "local") -> dict:
        """`tier` "near": fill the near store (docs/tiers.md) instead of this node's cache."""
        if tier == "near" and self.near is None:
            raise InvalidArgument("this mount has no near store (--tier)")
        if tier == "near" and pin_owner:
            raise InvalidArgument("pins keep files in this node's cache: not with --tier near")
        t0 = time.monotonic()
        ws = WarmSet()
        state = {"phase": "listing", "files": 0, "bytes": 0, "bytes_cached_before": 0,
                 "bytes_done": 0, "bytes_fetched": 0, "error_count": 0}

        async def report() -> None:
            if progress is not None:
                if state["phase"] == "listing":
                    state["files"] = len(ws.files)
                await progress({"event": "progress", **state,
                                "seconds": round(time.monotonic() - t0, 3)})

        async def reporter() -> None:
            while True:  # also while listing: a client sees the daemon is working
                await trio.sleep(PROGRESS_INTERVAL_S)
                await report()

        error: TierfsError | None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reporter)
            try:
                if tier == "near":
                    result = await self._warm_near(patterns, ws, state, check, concurrency)
                else:
                    result = await self._warm(patterns, ws, state, check, pin_owner,
                                              pin_expires, concurrency)
            except Exception as exc:  # noqa: BLE001 - raised below, as a TierfsError
                error = self._failure(exc)
            else:
                error = None
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        if not check:
            state["phase"] = "done"
            await report()
        return {**result, "seconds": round(time.monotonic() - t0, 3)}

    async def _warm(self, patterns: list[str], ws: WarmSet, state: dict, check: bool,
                    pin_owner: str | None, pin_expires: float | None, concurrency: int) -> dict:
        await self.resolve(patterns, ws)
        total = sum(obj.size for _, obj in ws.files)
        before = sum(self.cached_bytes(obj) for _, obj in ws.files)
        room, why = self.room_for(ws.objects)
        over = self.over_hard([obj for _, obj in ws.files])
        errors = list(ws.errors)
        state.update(phase="fetching", files=len(ws.files), bytes=total,
                     bytes_cached_before=before, bytes_done=before, error_count=len(errors))
        summary = {"files": len(ws.files), "bytes": total, "bytes_cached_before": before,
                   "unsaved_files": ws.unsaved, "fits": total <= room and over is None}
        if check:
            return {**summary, "bytes_fetched": 0, "errors": errors[:MAX_REPORTED_ERRORS],
                    "error_count": len(errors)}
        if total > room:
            raise NoSpace(f"the warm set is {format_size(total)} ({len(ws.files)} files) "
                          f"but the cache can hold {format_size(room)} of it ({why}): "
                          f"warm less, unpin something, or raise --cache-size")
        if over is not None:
            raise NoSpace(over)
        warm_id = next(self._ids)
        transient = f"warm:{warm_id}"
        self.cache.pins.add(transient, ws.objects)
        failed: set[str] = set()

        def fail(path: str, why: str) -> None:
            if path not in failed:
                failed.add(path)
                errors.append({"path": path, "error": why})
                state["error_count"] = len(errors)
                log.warning("warm: %s: %s", path, why)

        work = ((path, obj, i) for path, obj in ws.files for i in self._chunks(obj)
                if not self.cache.has(obj.chunk_key(i)))

        async def worker() -> None:
            for path, obj, index in work:
                if path in failed:
                    continue
                try:
                    fetched, cached = await self.walk.warm(obj, index)
                except Exception as exc:  # noqa: BLE001 - _failure: the file's error entry
                    err = self._failure(exc, warm_id)
                    fail(path, "changed in the bucket while warming: run the warm again"
                         if isinstance(err, PreconditionFailed) else str(err))
                    continue
                state["bytes_fetched"] += fetched
                state["bytes_done"] += self.walk.chunk_length(obj, index)
                self.metrics.warm_bytes.inc(fetched)
                if not cached:
                    fail(path, "no room in the cache (or in its tenant's hard share): "
                               "everything else is pinned or unsaved")

        try:
            async with trio.open_nursery() as workers:
                for _ in range(max(1, concurrency)):
                    workers.start_soon(worker)
            if pin_owner:
                ttls = self.pin_ttls([o for _, o in ws.files]) if pin_expires is None else None
                self.cache.pins.add(pin_owner, ws.objects, pin_expires, ttls)
        finally:
            self._bugs_logged.discard(warm_id)
            self.cache.pins.release(transient)
            with trio.CancelScope(shield=True):
                await self.cache.flush_index()
        return {**summary, "bytes_fetched": state["bytes_fetched"],
                "errors": errors[:MAX_REPORTED_ERRORS], "error_count": len(errors),
                "pinned": pin_owner, "pin_expires": pin_expires if pin_owner else None}

    async def _warm_near(self, patterns: list[str], ws: WarmSet, state: dict, check: bool,
                         concurrency: int) -> dict:
        """Copy the set to the near store, `concurrency` files at once, each chunk read
        from the source and written to the near store (this node's tiers left alone);
        files the near store holds already cost one HEAD. The set is not checked
        against a budget: the near store's size is its operator's (docs/tiers.md)."""
        near = self.near
        assert near is not None
        await self.resolve(patterns, ws)
        total = sum(obj.size for _, obj in ws.files)
        errors = list(ws.errors)
        state.update(phase="checking" if check else "copying", files=len(ws.files),
                     bytes=total, bytes_cached_before=0, bytes_done=0,
                     error_count=len(errors))
        copied = 0
        warm_id = next(self._ids)
        files = iter(ws.files)

        async def worker() -> None:
            nonlocal copied
            for path, obj in files:
                try:
                    if check:
                        outcome = "present" if await near.present(obj) else "missing"
                    else:
                        outcome = await near.copy(obj)  # "present" after its HEAD
                except Exception as exc:  # noqa: BLE001 - _failure: the file's error entry
                    why = str(self._failure(exc, warm_id))
                    errors.append({"path": path, "error": why})
                    state["error_count"] = len(errors)
                    log.warning("warm --tier near: %s: %s", path, why)
                    continue
                if outcome == "present":
                    state["bytes_cached_before"] += obj.size
                elif outcome == "copied":
                    copied += obj.size
                    state["bytes_fetched"] = copied
                elif outcome == "changed":
                    errors.append({"path": path, "error": "changed in the bucket while "
                                   "copying: run the warm again"})
                    state["error_count"] = len(errors)
                state["bytes_done"] += obj.size

        try:
            async with trio.open_nursery() as workers:
                for _ in range(max(1, concurrency)):
                    workers.start_soon(worker)
        finally:
            self._bugs_logged.discard(warm_id)
        return {"files": len(ws.files), "bytes": total, "tier": "near",
                "bytes_cached_before": state["bytes_cached_before"], "bytes_fetched": copied,
                "unsaved_files": ws.unsaved, "fits": True,
                "errors": errors[:MAX_REPORTED_ERRORS], "error_count": len(errors)}

    async def evict(self, patterns: list[str], tier: str = "local") -> dict:
        """Drop the set's cached chunks (pinned files are kept and counted); `tier` near:
        remove the near store's copies of the set instead (the source keeps the files)."""
        ws = await self.resolve(patterns)
        if tier == "near":
            return await self._evict_near(ws)
        freed = kept = 0
        for _, obj in ws.files:
            if obj.oid in self.cache.pins:
                kept += 1
                continue
            for i in self._chunks(obj):
                freed += await self.cache.evict(obj.chunk_key(i),
                                                self.walk.chunk_length(obj, i))
        await self.cache.flush_index()
        return {"files": len(ws.files), "bytes_evicted": freed, "pinned_kept": kept,
                "errors": ws.errors[:MAX_REPORTED_ERRORS], "error_count": len(ws.errors)}

    async def _evict_near(self, ws: WarmSet) -> dict:
        near = self.near
        if near is None:
            raise InvalidArgument("this mount has no near store (--tier)")
        freed = 0
        errors = list(ws.errors)
        for path, obj in ws.files:
            try:
                if await near.delete(obj):
                    freed += obj.size
            except TierfsError as exc:
                errors.append({"path": path, "error": str(exc)})
        return {"files": len(ws.files), "bytes_evicted": freed, "pinned_kept": 0,
                "tier": "near", "errors": errors[:MAX_REPORTED_ERRORS],
                "error_count": len(errors)}

    async def unpin(self, patterns: list[str]) -> dict:
        ws = await self.resolve(patterns)
        released = self.cache.pins.release_objects(set(ws.objects))
        return {"files": len(ws.files), "pins_released": released,
                "errors": ws.errors[:MAX_REPORTED_ERRORS], "error_count": len(ws.errors)}


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name
