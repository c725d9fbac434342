"""Usage: bytes served and time stalled, per tenant and per reader (docs/tenants.md).

Every read adds the bytes it returned, by where they came from (memory, disk, peer,
backend), to its tenant's Tally and its reader's ("job:1234", "pod:<uid>", "uid:1000";
tierfs/callers.py); a read that had to wait for the store or a peer adds that time as
stall. The hot path is a few dict and set updates and a counter: no I/O, no label lookup.

Bounded: tenants come from the mount's config (few); readers are kept for `window_s`
after their last read and at most `max_readers` of them (the least recently active is
dropped first). Prometheus sees tenants only; readers (job ids, uids) never become label
values - they go to the control socket and the Slurm epilog's accounting.

Kept across restarts: `run_flusher` writes what changed to the index's `usage` database
every FLUSH_INTERVAL_S, the core flushes at close, and a new Usage starts from what was
stored. A crash loses at most the last interval.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from .meta import MetaStore
from .metrics import Metrics

log = logging.getLogger(__name__)

SOURCES = ("memory", "disk", "peer", "backend")
CACHED = ("memory", "disk")
FLUSH_INTERVAL_S = 30.0
READER_KINDS = ("job", "pod", "uid")
_TENANT, _READER = "tenant/", "reader/"  # key prefixes in the usage database


@dataclass
class Tally:
    read: dict[str, int] = field(default_factory=dict)  # source -> bytes returned to readers
    stall_s: float = 0.0  # seconds readers waited on the store or a peer
    first: float = 0.0  # epoch seconds of the first and last read counted
    last: float = 0.0

    def total(self) -> int:
        return sum(self.read.values())

    def hit_ratio(self) -> float | None:
        """(memory + disk) / all bytes read; None when nothing was read."""
        total = self.total()
        return None if total == 0 else sum(self.read.get(s, 0) for s in CACHED) / total

    def _seen(self, now: float) -> None:
        if not self.first:
            self.first = now
        self.last = now

    def to_json(self) -> dict[str, Any]:
        return {"read": dict(self.read), "stall_s": self.stall_s, "first": self.first,
                "last": self.last}

    @classmethod
    def from_json(cls, raw: Any) -> "Tally | None":
        """A stored record, or None if it is not one (the index is a cache: skip it)."""
        try:
            read = {str(k): int(v) for k, v in raw["read"].items() if int(v) >= 0}
            return cls(read, float(raw["stall_s"]), float(raw["first"]), float(raw["last"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def copy(self) -> "Tally":
        return Tally(dict(self.read), self.stall_s, self.first, self.last)


class Usage:
    def __init__(self, meta: MetaStore, metrics: Metrics, *,
                 clock: Callable[[], float] = time.time, max_readers: int = 1000,
                 window_s: float = 7 * 86400) -> None:
        self.meta = meta
        self.metrics = metrics
        self.clock = clock
        self.max_readers = max_readers
        self.window_s = window_s
        self._tenants: dict[str, Tally] = {}
        self._readers: OrderedDict[str, Tally] = OrderedDict()  # least recently active first
        # tallies to write at the next flush, by tenant and by reader name
        self._changed_tenants: set[str] = set()
        self._changed_readers: set[str] = set()
        self._dropped: set[str] = set()  # reader keys to delete at the next flush
        self._read_counters: dict[tuple[str, str], Any] = {}
        self._stall_counters: dict[str, Any] = {}
        self._restore()

    # ---- the hot path ------------------------------------------------------------------
    # per read: a clock read, two dict lookups, an LRU move, two set adds, a counter; no
    # string is built (changed tallies are kept by name, their database keys made at flush)

    def read(self, tenant: str, reader: str, source: str, n: int) -> None:
        now = self.clock()
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenant(tenant)
        r = self._readers.get(reader)
        if r is None:
            r = self._reader(reader)
        else:
            self._readers.move_to_end(reader)
        t.read[source] = t.read.get(source, 0) + n
        r.read[source] = r.read.get(source, 0) + n
        if not t.first:
            t.first = now
        if not r.first:
            r.first = now
        t.last = r.last = now
        self._changed_tenants.add(tenant)
        self._changed_readers.add(reader)
        c = self._read_counters.get((tenant, source))
        if c is None:
            c = self._read_counters[tenant, source] = \
                self.metrics.tenant_read_bytes.labels(tenant, source)
        c.inc(n)

    def stalled(self, tenant: str, reader: str, seconds: float) -> None:
        if seconds <= 0:
            return
        now = self.clock()
        for t in (self._tenant(tenant), self._reader(reader)):
            t.stall_s += seconds
            t._seen(now)
        self._changed_tenants.add(tenant)
        self._changed_readers.add(reader)
        c = self._stall_counters.get(tenant)
        if c is None:
            c = self._stall_counters[tenant] = self.metrics.tenant_stall_seconds.labels(tenant)
        c.inc(seconds)

    def _tenant(self, name: str) -> Tally:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = Tally()
        return t

    def _reader(self, name: str) -> Tally:
        t = self._readers.get(name)
        if t is None:
            t = self._readers[name] = Tally()
            self._dropped.discard(_READER + name)
            if len(self._readers) > self.max_readers:
                old, _ = self._readers.popitem(last=False)
                self._drop(old)
        else:
            self._readers.move_to_end(name)
        return t

    def _drop(self, reader: str) -> None:
        self._changed_readers.discard(reader)
        self._dropped.add(_READER + reader)

    # ---- queries -----------------------------------------------------------------------

    def _expire(self) -> None:
        """Forget readers idle past the window (oldest first, so stop at the first kept)."""
        horizon = self.clock() - self.window_s
        while self._readers:
            name, t = next(iter(self._readers.items()))
            if t.last >= horizon:
                break
            del self._readers[name]
            self._drop(name)

    def by_tenant(self) -> dict[str, Tally]:
        return {name: t.copy() for name, t in self._tenants.items()}

    def by_reader(self, kind: str | None = None) -> dict[str, Tally]:
        """Readers' tallies, keyed like "job:1234"; `kind` ("job", "pod", "uid") filters."""
        self._expire()
        prefix = None if kind is None else kind + ":"
        return {name: t.copy() for name, t in self._readers.items()
                if prefix is None or name.startswith(prefix)}

    def reader(self, name: str) -> Tally | None:
        self._expire()
        t = self._readers.get(name)
        return None if t is None else t.copy()

    # ---- persistence -------------------------------------------------------------------

    def _restore(self) -> None:
        try:
            records = self.meta.usage()
        except Exception as exc:  # noqa: BLE001 - usage is a report: a bad record costs it only
            log.warning("usage kept in the index could not be read (%s); counting from zero",
                        exc)
            return
        readers = []
        for key, raw in records:
            t = Tally.from_json(raw)
            if t is None:
                self._dropped.add(key)
            elif key.startswith(_TENANT):
                self._tenants[key[len(_TENANT):]] = t
            elif key.startswith(_READER):
                readers.append((t.last, key[len(_READER):], t))
            else:
                self._dropped.add(key)
        readers.sort()  # least recently active first, as the LRU keeps them
        for _, name, t in readers[-self.max_readers:] if self.max_readers > 0 else ():
            self._readers[name] = t
        for _, name, _t in readers[:max(0, len(readers) - self.max_readers)]:
            self._drop(name)
        self._expire()

    def _take_changes(self) -> tuple[dict[str, dict[str, Any]], set[str]]:
        self._expire()
        puts: dict[str, dict[str, Any]] = {}
        for prefix, names, tallies in ((_TENANT, self._changed_tenants, self._tenants),
                                       (_READER, self._changed_readers, self._readers)):
            for name in names:
                t = tallies.get(name)
                if t is not None:
                    # a copy: later reads do not race the writer thread
                    puts[prefix + name] = t.to_json()
        deletes = self._dropped - puts.keys()
        self._changed_tenants, self._changed_readers, self._dropped = set(), set(), set()
        return puts, deletes

    async def flush(self) -> None:
        """Write what changed since the last flush (one LMDB transaction, in a thread)."""
        puts, deletes = self._take_changes()
        if not puts and not deletes:
            return
        try:
            await trio.to_thread.run_sync(self.meta.put_usage, puts, deletes)
        except BaseException:
            # not written: write it with the next flush (newer values win there)
            for key in puts:
                if key.startswith(_TENANT):
                    self._changed_tenants.add(key[len(_TENANT):])
                elif key[len(_READER):] in self._readers:
                    self._changed_readers.add(key[len(_READER):])
            self._dropped |= deletes
            raise

    async def run_flusher(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        while True:
            await trio.sleep(interval_s)
            await self.flush()
