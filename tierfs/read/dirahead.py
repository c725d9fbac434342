"""Directory read-ahead: files of one directory opened in listing order get the next small
files fetched before they are opened.

A loader walking an image folder, `tar`, `cp -r` or an RL environment restoring a
snapshot opens many small files one after another; each cold open then waits for its own
GET. Once two opens in a row in one directory follow its listing (the next entry, or one
of the next few), the files that come next in the listing are fetched at read-ahead
priority: 4 files ahead, doubling with each open that keeps to the order, at most 32 and
at most `max_bytes` fetched and not yet opened over all directories, 8 fetches at once.
What it fetched is held in the memory tier until its file is opened (or the order
breaks), so nothing evicts it first and it is never fetched twice; hence `max_bytes` is
at most a quarter of the memory tier (AHEAD_SHARE), and without one nothing is fetched.
An open that breaks the order stops it: what was not started yet is dropped (fetches
under way finish, their bytes are cached). Only files of one chunk at most are fetched;
a bigger one gets the sequential read-ahead of prefetch.py once it is read.

DirPattern is the policy (pure: opens in, how many files to keep ahead out), DirReadAhead
the mechanism: the index's listing (the directory must have been listed), the read walk.
Opens are counted per directory, not per reader: the workers of a loader that open a
folder's files in turn look like one reader in order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import trio

from ..cache import ChunkCache, ObjectVersion
from ..cache.memory import WHOLE
from ..cache.tier import FETCHED, Want
from ..index.attrs import FILE
from ..index.inodes import Inode, InodeTable
from ..metrics import Metrics
from ..tasks import Tasks, expected_error
from .walk import TierWalk

log = logging.getLogger(__name__)

START = 4  # files kept ahead once two opens in a row followed the listing
MAX_FILES = 32  # files kept ahead at most, per directory
GAP = 2  # an open may skip this many entries (a file a loader filtered out) and follow
MAX_DIRS = 64  # directories whose opens are followed at once (least recent forgotten)
AHEAD_SHARE = 0.25  # of the memory tier (the chunk read-ahead may hold half)
FETCHES = 8  # fetches under way at once; the others wait, and go when the order breaks


class DirPattern:
    """The opens of one directory: whether they follow its listing, and how many files
    to keep ahead of them."""

    __slots__ = ("last", "streak", "window")

    def __init__(self) -> None:
        self.last: bytes | None = None  # the name opened last
        self.streak = 0  # opens in a row that followed the listing
        self.window = 0  # files to keep ahead; 0: none

    def opened(self, name: bytes, follows: bool) -> int:
        """`name` was opened; `follows`: it is one of the entries right after the last
        one opened. How many files should be ahead of it now."""
        if name == self.last:
            return self.window  # the same file again (another handle): no news
        if follows:
            self.streak += 1
            if self.streak >= 2:
                self.window = min(MAX_FILES, max(START, self.window * 2))
        else:
            self.streak = self.window = 0
        self.last = name
        return self.window


class _Dir:
    __slots__ = ("pattern", "ahead", "ahead_to")

    def __init__(self) -> None:
        self.pattern = DirPattern()
        self.ahead: deque[tuple[bytes, bytes, int]] = deque()  # (name, ckey, bytes), in order
        self.ahead_to: bytes | None = None  # the last entry looked at for read-ahead


class DirReadAhead:
    def __init__(self, inodes: InodeTable, cache: ChunkCache, walk: TierWalk, tasks: Tasks,
                 metrics: Metrics, *, max_bytes: int) -> None:
        self.inodes = inodes
        self.cache = cache
        self.walk = walk
        self.metrics = metrics
        self._tasks = tasks
        self.memory = cache.memory
        self.max_bytes = min(max_bytes, int(self.memory.capacity * AHEAD_SHARE))
        self._dirs: OrderedDict[int, _Dir] = OrderedDict()
        self._bytes = 0  # fetched ahead (or being fetched) and not opened yet
        # chunk key -> where its fetch brought it from ("backend", "near", "peer"): the opener's
        # first reads of it count there (tierfs/files/fileio.py), not as cache hits
        self._brought: dict[bytes, str] = {}
        self._fetches = trio.CapacityLimiter(FETCHES)
        self._held: set[bytes] = set()  # chunk keys held in the memory tier for their open

    def opened(self, node: Inode, obj: ObjectVersion, tenant: str | None) -> str | None:
        """A file was opened for reading: follow its directory's opens and keep files
        ahead. Returns where its first chunk was fetched from if read-ahead brought it."""
        name = node.key.rsplit("/", 1)[-1].encode()
        d = self._dirs.get(node.parent)
        if d is None:
            d = self._dirs[node.parent] = _Dir()
            while len(self._dirs) > MAX_DIRS:
                self._drop(self._dirs.popitem(last=False)[1])
        else:
            self._dirs.move_to_end(node.parent)
        # a listing only: before it, the index holds just the names looked up so far
        listed = self.inodes.dir_listed_at(node.parent) is not None
        follows = listed and self._follows(node.parent, d, name)
        window = d.pattern.opened(name, follows)
        if not follows or window == 0:
            self._drop(d)
            d.ahead_to = name
        else:
            self._passed(d, name)
            self._fill(node.parent, d, window, obj.bucket, tenant)
        return self._brought.pop(obj.chunk_key(0), None)

    def _follows(self, parent: int, d: _Dir, name: bytes) -> bool:
        last = d.pattern.last
        if last is None or name <= last:
            return False
        if _ahead(d, name):
            return True
        return any(n == name for n, _ in self.inodes.children_after(parent, last, GAP + 1))

    def _passed(self, d: _Dir, name: bytes) -> None:
        """The files up to `name` are opened or skipped: no longer ahead."""
        while d.ahead and d.ahead[0][0] <= name:
            passed, ckey, n = d.ahead.popleft()
            self._let_go(ckey, n)
            if passed != name:  # skipped: never opened (the opened one's is popped next)
                self._brought.pop(ckey, None)
        if d.ahead_to is None or d.ahead_to < name:
            d.ahead_to = name

    def _drop(self, d: _Dir) -> None:
        """Forget what was kept ahead (fetches under way finish: their bytes are cached)."""
        for _, ckey, n in d.ahead:
            self._let_go(ckey, n)
            self._brought.pop(ckey, None)
        d.ahead.clear()

    def _let_go(self, ckey: bytes, n: int) -> None:
        """A file is no longer ahead: its bytes are the memory tier's LRU's again."""
        self._bytes -= n
        if ckey in self._held:
            self._held.remove(ckey)
            self.memory.unhold((ckey, WHOLE))

    def _fill(self, parent: int, d: _Dir, window: int, bucket: str,
              tenant: str | None) -> None:
        assert d.ahead_to is not None
        cs = self.walk.chunk_size
        while len(d.ahead) < window:
            nxt = self.inodes.children_after(parent, d.ahead_to, window - len(d.ahead))
            if not nxt:
                return
            for name, node in nxt:
                if len(d.ahead) >= window or self._bytes + node.size > self.max_bytes:
                    return
                d.ahead_to = name
                if node.kind != FILE or not node.etag or not 0 < node.size <= cs:
                    continue  # a directory, a file not yet saved, an empty or a big file
                obj = ObjectVersion(bucket, node.key, node.etag, node.size)
                ckey = obj.chunk_key(0)
                if self.cache.has(ckey) or self.walk.in_flight(ckey):
                    continue
                d.ahead.append((name, ckey, node.size))
                self._bytes += node.size
                self._tasks.spawn("read-ahead", self._fetch, d, name, obj, ckey, tenant)

    async def _fetch(self, d: _Dir, name: bytes, obj: ObjectVersion, ckey: bytes,
                     tenant: str | None) -> None:
        async with self._fetches:
            if not _ahead(d, name):
                return  # the reader went elsewhere (or opened it) before it started
            try:
                got = await self.walk.read(Want(obj, 0, background=True, tenant=tenant))
            except Exception as exc:
                err = expected_error(exc)
                if err is None:
                    raise  # a bug: Tasks logs it with its traceback and counts it
                # an open of it meets the same error on its own request and reports it
                log.debug("read-ahead of %s failed: %s", obj.key, err)
                return
        fetched = got.fetched and got.source in FETCHED
        if fetched:
            self.metrics.dir_readahead_files.inc()
        if not _ahead(d, name) or ckey in self._held:
            # opened, or the order broke, while it was fetched; or held already: a fetch
            # queued for it before the order broke and another after it came back
            return
        if fetched:
            self._brought[ckey] = got.source
        key = (ckey, WHOLE)
        if self.memory.hold(key) or self.memory.put(key, got.data, hold=True):
            self._held.add(ckey)


def _ahead(d: _Dir, name: bytes) -> bool:
    """Whether `name` is among the files kept ahead in `d`."""
    return any(n == name for n, _, _ in d.ahead)
