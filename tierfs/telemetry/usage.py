"""Usage: bytes served and time stalled, per tenant and per reader (docs/tenants.md).

Every read adds the bytes it returned, by where they came from (memory, disk, peer,
backend), to its tenant's Tally and its reader's ("job:1234", "pod:<uid>", "uid:1000";
tierfs/telemetry/callers.py); a read that had to wait for the store or a peer adds that time as
stall. The hot path is a few dict and set updates and a counter: no I/O, no label lookup.

Kubernetes pods: tierfs-csi names the pod behind a `pod:<uid>` reader at each publish
(`label_pod`: its namespace, name, service account and, with tenant_from, its tenant), so
a pod's reads also count for its namespace, and for that tenant instead of the key's.

Bounded: tenants come from the mount's config (few); readers are kept for `window_s`
after their last read and at most `max_readers` of them (the least recently active is
dropped first), and so are named pods; namespaces are at most MAX_NAMESPACES (the rest
count as "(other)"). Prometheus sees tenants and namespaces only; readers (job ids, pod
UIDs, uids) never become label values - they go to the control socket and the Slurm
epilog's and tierfs-csi's accounting.

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

from ..index.meta import MetaStore
from ..metrics import Metrics

log = logging.getLogger(__name__)

CACHED = ("memory", "disk")
FLUSH_INTERVAL_S = 30.0
READER_KINDS = ("job", "pod", "uid")
MAX_NAMESPACES = 256  # label values of tierfs_namespace_*; more count as OTHER
OTHER = "(other)"
# key prefixes in the usage database
_TENANT, _READER, _NAMESPACE, _POD = "tenant/", "reader/", "namespace/", "pod/"


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


@dataclass
class Pod:
    """Who a `pod:<uid>` reader is, as tierfs-csi said at publish."""
    namespace: str
    name: str | None = None
    service_account: str | None = None
    tenant: str | None = None  # its reads count for this tenant (tenant_from)

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name,
                "service_account": self.service_account, "tenant": self.tenant}

    @classmethod
    def from_json(cls, raw: Any) -> "Pod | None":
        try:
            fields = [raw["namespace"], raw.get("name"), raw.get("service_account"),
                      raw.get("tenant")]
        except (KeyError, TypeError, AttributeError):
            return None
        if not isinstance(fields[0], str) or not all(f is None or isinstance(f, str)
                                                     for f in fields[1:]):
            return None
        return cls(*fields)


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
        self._pods: OrderedDict[str, Pod] = OrderedDict()  # "pod:<uid>" -> who it is
        self._namespaces: dict[str, Tally] = {}
        self._changed_namespaces: set[str] = set()
        self._changed_pods: set[str] = set()
        self._ns_read_counters: dict[tuple[str, str], Any] = {}
        self._ns_stall_counters: dict[str, Any] = {}
        self._restore()

    # ---- the hot path ------------------------------------------------------------------
    # per read: a clock read, two dict lookups, an LRU move, two set adds, a counter; no
    # string is built (changed tallies are kept by name, their database keys made at flush)

    def read(self, tenant: str, reader: str, source: str, n: int) -> None:
        now = self.clock()
        p = self._pods.get(reader) if self._pods else None
        if p is not None:
            tenant = p.tenant or tenant
            self._namespace_read(p.namespace, source, n, now)
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
        p = self._pods.get(reader) if self._pods else None
        if p is not None:
            tenant = p.tenant or tenant
            ns = self._namespace(p.namespace)
            ns.stall_s += seconds
            ns._seen(now)
            self._changed_namespaces.add(p.namespace)
            c = self._ns_stall_counters.get(p.namespace)
            if c is None:
                c = self._ns_stall_counters[p.namespace] = \
                    self.metrics.namespace_stall_seconds.labels(p.namespace)
            c.inc(seconds)
        for t in (self._tenant(tenant), self._reader(reader)):
            t.stall_s += seconds
            t._seen(now)
        self._changed_tenants.add(tenant)
        self._changed_readers.add(reader)
        c = self._stall_counters.get(tenant)
        if c is None:
            c = self._stall_counters[tenant] = self.metrics.tenant_stall_seconds.labels(tenant)
        c.inc(seconds)

    def _namespace_read(self, name: str, source: str, n: int, now: float) -> None:
        t = self._namespace(name)
        t.read[source] = t.read.get(source, 0) + n
        t._seen(now)
        self._changed_namespaces.add(name)
        c = self._ns_read_counters.get((name, source))
        if c is None:
            c = self._ns_read_counters[name, source] = \
                self.metrics.namespace_read_bytes.labels(name, source)
        c.inc(n)

    def _namespace(self, name: str) -> Tally:
        t = self._namespaces.get(name)
        if t is None:
            t = self._namespaces[name] = Tally()
        return t

    # ---- pods (tierfs-csi) -------------------------------------------------------------

    def label_pod(self, uid: str, namespace: str, *, name: str | None = None,
                  service_account: str | None = None, tenant: str | None = None) -> None:
        """From now on the reads of `pod:<uid>` count for `namespace` (and `tenant`, if
        given, instead of the key's tenant). Namespaces and pod tenants past
        MAX_NAMESPACES are OTHER: they are label values."""
        known = {p.namespace for p in self._pods.values()} | self._namespaces.keys()
        if namespace not in known and len(known) >= MAX_NAMESPACES:
            namespace = OTHER
        if tenant is not None and tenant not in self._tenants and \
                len(self._tenants) >= MAX_NAMESPACES:
            tenant = OTHER
        key = "pod:" + uid
        self._pods[key] = Pod(namespace, name, service_account, tenant)
        self._pods.move_to_end(key)
        self._dropped.discard(_POD + key)
        self._changed_pods.add(key)
        while len(self._pods) > max(self.max_readers, 1):
            old, _ = self._pods.popitem(last=False)
            self._changed_pods.discard(old)
            self._dropped.add(_POD + old)

    def forget_pod(self, uid: str) -> bool:
        """The pod is gone (NodeUnpublishVolume): its namespace keeps what it read."""
        key = "pod:" + uid
        if self._pods.pop(key, None) is None:
            return False
        self._changed_pods.discard(key)
        self._dropped.add(_POD + key)
        return True

    def pod(self, uid: str) -> Pod | None:
        return self._pods.get("pod:" + uid)

    def by_namespace(self) -> dict[str, Tally]:
        return {name: t.copy() for name, t in self._namespaces.items()}

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
            records = self.meta.usage.records()
        except Exception as exc:  # noqa: BLE001 - usage is a report: a bad record costs it only
            log.warning("usage kept in the index could not be read (%s); counting from zero",
                        exc)
            return
        readers = []
        for key, raw in records:
            if key.startswith(_POD):
                pod = Pod.from_json(raw)
                if pod is None:
                    self._dropped.add(key)
                else:
                    self._pods[key[len(_POD):]] = pod
                continue
            t = Tally.from_json(raw)
            if t is None:
                self._dropped.add(key)
            elif key.startswith(_TENANT):
                self._tenants[key[len(_TENANT):]] = t
            elif key.startswith(_READER):
                readers.append((t.last, key[len(_READER):], t))
            elif key.startswith(_NAMESPACE):
                self._namespaces[key[len(_NAMESPACE):]] = t
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
                                       (_READER, self._changed_readers, self._readers),
                                       (_NAMESPACE, self._changed_namespaces, self._namespaces),
                                       (_POD, self._changed_pods, self._pods)):
            for name in names:
                t = tallies.get(name)
                if t is not None:
                    # a copy: later reads do not race the writer thread
                    puts[prefix + name] = t.to_json()
        deletes = self._dropped - puts.keys()
        self._changed_tenants, self._changed_readers, self._dropped = set(), set(), set()
        self._changed_namespaces, self._changed_pods = set(), set()
        return puts, deletes

    async def flush(self) -> None:
        """Write what changed since the last flush (one LMDB transaction, in a thread)."""
        puts, deletes = self._take_changes()
        if not puts and not deletes:
            return
        try:
            await trio.to_thread.run_sync(self.meta.usage.put, puts, deletes)
        except BaseException:
            # not written: write it with the next flush (newer values win there)
            for key in puts:
                if key.startswith(_TENANT):
                    self._changed_tenants.add(key[len(_TENANT):])
                elif key.startswith(_NAMESPACE):
                    self._changed_namespaces.add(key[len(_NAMESPACE):])
                elif key.startswith(_POD):
                    if key[len(_POD):] in self._pods:
                        self._changed_pods.add(key[len(_POD):])
                elif key[len(_READER):] in self._readers:
                    self._changed_readers.add(key[len(_READER):])
            self._dropped |= deletes
            raise

    async def run_flusher(self, interval_s: float = FLUSH_INTERVAL_S) -> None:
        while True:
            await trio.sleep(interval_s)
            await self.flush()
