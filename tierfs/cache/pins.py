"""Pins: object versions that eviction must leave alone, grouped by owner.

An owner is a Slurm job ("job:42"), a manual pin ("manual") or a warm in progress
("warm:N", never stored: a warm protects what it already fetched from its own later
fills, and a crash simply ends that protection). Pins are per object version (object
id), not per chunk: a file pinned while half cached keeps every chunk it gets later,
and an overwritten file's new version is not pinned by the old one's pin.

Owners with a TTL expire by themselves (`expire`), so a job whose epilog never ran
does not hold the cache forever. An object pinned without a TTL whose tenant has a
`pin_ttl` (docs/tenants.md) gets a deadline of its own (`Pin.until`): one owner (a job)
may pin files of several tenants, each with its tenant's TTL. Persistent owners are
written to LMDB at every change (a short transaction; pins change per warm, not per read).

`on_change(oid, pinned)` is told when an object becomes pinned (its first owner) or
unpinned (its last owner gone): the cache keeps its pinned bytes per tenant with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..index.meta import MetaStore

log = logging.getLogger(__name__)

TRANSIENT_PREFIX = "warm:"


def _later(a: float | None, b: float | None) -> float | None:
    """The later of two deadlines, None being never."""
    return None if a is None or b is None else max(a, b)


@dataclass
class Pin:
    expires: float | None  # epoch seconds; None = until unpinned
    objects: dict[bytes, int] = field(default_factory=dict)  # oid -> object size
    # oid -> epoch seconds: objects whose deadline is not the owner's (their tenant's pin_ttl)
    until: dict[bytes, float] = field(default_factory=dict)

    def deadline(self, oid: bytes) -> float | None:
        return self.until.get(oid, self.expires)

    def record(self) -> dict:
        rec: dict[str, object] = {"expires": self.expires,
                                  "objects": {o.hex(): s for o, s in self.objects.items()}}
        if self.until:
            rec["until"] = {o.hex(): t for o, t in self.until.items()}
        return rec


class Pins:
    def __init__(self, meta: MetaStore, *, clock: Callable[[], float] = time.time,
                 on_change: Callable[[bytes, bool], None] | None = None) -> None:
        self._meta = meta
        self._clock = clock
        self.on_change = on_change
        self.owners: dict[str, Pin] = {}
        self._count: dict[bytes, int] = {}  # oid -> number of owners pinning it
        for owner, rec in meta.pins.all():
            self._merge(owner, {bytes.fromhex(o): s for o, s in rec["objects"].items()},
                        rec.get("expires"),
                        {bytes.fromhex(o): t for o, t in (rec.get("until") or {}).items()})
        self.expire()

    def __contains__(self, oid: bytes) -> bool:
        return oid in self._count

    def _merge(self, owner: str, objects: dict[bytes, int], expires: float | None,
               until: dict[bytes, float]) -> Pin:
        pin = self.owners.get(owner)
        old = {oid: pin.deadline(oid) for oid in objects if oid in pin.objects} if pin else {}
        if pin is None:
            pin = self.owners[owner] = Pin(expires)
        else:  # pinning again never shortens a pin
            pin.expires = _later(pin.expires, expires)
        for oid, size in objects.items():
            if oid not in pin.objects:
                self._count[oid] = self._count.get(oid, 0) + 1
                if self._count[oid] == 1 and self.on_change is not None:
                    self.on_change(oid, True)
            pin.objects[oid] = size
            deadline = until.get(oid, expires)
            if oid in old:
                deadline = _later(old[oid], deadline)
            if deadline is None or deadline == pin.expires:  # None: the owner's is None too
                pin.until.pop(oid, None)
            else:
                pin.until[oid] = deadline
        return pin

    def add(self, owner: str, objects: dict[bytes, int], expires: float | None = None,
            ttls: dict[bytes, float] | None = None) -> None:
        """Pin `objects` (oid -> size) for `owner` until `expires` (None: until unpinned);
        `ttls` (oid -> seconds) gives objects a deadline of their own instead (a tenant's
        pin_ttl for a pin without a TTL)."""
        now = self._clock()
        pin = self._merge(owner, objects, expires,
                          {oid: now + ttl for oid, ttl in (ttls or {}).items()})
        if not owner.startswith(TRANSIENT_PREFIX):
            self._meta.pins.set(owner, pin.record())

    def release(self, owner: str) -> int:
        """Drop an owner's pins; returns how many objects it pinned."""
        pin = self.owners.pop(owner, None)
        if pin is None:
            return 0
        for oid in pin.objects:
            self._uncount(oid)
        if not owner.startswith(TRANSIENT_PREFIX):
            self._meta.pins.set(owner, None)
        return len(pin.objects)

    def release_objects(self, oids: set[bytes]) -> int:
        """Unpin these objects from every owner; returns how many (owner, object) pins went."""
        dropped = 0
        for owner, pin in list(self.owners.items()):
            mine = oids & pin.objects.keys()
            if not mine:
                continue
            for oid in mine:
                del pin.objects[oid]
                pin.until.pop(oid, None)
                self._uncount(oid)
            dropped += len(mine)
            if not pin.objects:
                self.release(owner)
            elif not owner.startswith(TRANSIENT_PREFIX):
                self._meta.pins.set(owner, pin.record())
        return dropped

    def expire(self) -> list[str]:
        """Drop what passed its deadline; returns the owners that are gone entirely (an
        owner some of whose objects expired by their tenant's pin_ttl is logged here)."""
        now = self._clock()
        gone = []
        for owner, pin in list(self.owners.items()):
            late = {o for o in pin.objects if (d := pin.deadline(o)) is not None and d <= now}
            if not late:
                continue
            if len(late) == len(pin.objects):
                self.release(owner)
                gone.append(owner)
                continue
            for oid in late:
                del pin.objects[oid]
                pin.until.pop(oid, None)
                self._uncount(oid)
            log.info("pin of %s: %d objects expired (their tenant's pin_ttl)", owner, len(late))
            if not owner.startswith(TRANSIENT_PREFIX):
                self._meta.pins.set(owner, pin.record())
        return gone

    def _uncount(self, oid: bytes) -> None:
        n = self._count[oid] - 1
        if n:
            self._count[oid] = n
        else:
            del self._count[oid]
            if self.on_change is not None:
                self.on_change(oid, False)

    def objects(self) -> dict[bytes, int]:
        """Every pinned object version with its size."""
        out: dict[bytes, int] = {}
        for pin in self.owners.values():
            out.update(pin.objects)
        return out
