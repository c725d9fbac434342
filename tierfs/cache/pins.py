"""Pins: object versions that eviction must leave alone, grouped by owner.

An owner is a Slurm job ("job:42"), a manual pin ("manual") or a warm in progress
("warm:N", never stored: a warm protects what it already fetched from its own later
fills, and a crash simply ends that protection). Pins are per object version (object
id), not per chunk: a file pinned while half cached keeps every chunk it gets later,
and an overwritten file's new version is not pinned by the old one's pin.

Owners with a TTL expire by themselves (`expire`), so a job whose epilog never ran
does not hold the cache forever. Persistent owners are written to LMDB at every
change (a short transaction; pins change per warm, not per read).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..meta import MetaStore

TRANSIENT_PREFIX = "warm:"


@dataclass
class Pin:
    expires: float | None  # epoch seconds; None = until unpinned
    objects: dict[bytes, int] = field(default_factory=dict)  # oid -> object size

    def record(self) -> dict:
        return {"expires": self.expires, "objects": {o.hex(): s for o, s in self.objects.items()}}


class Pins:
    def __init__(self, meta: MetaStore, *, clock: Callable[[], float] = time.time) -> None:
        self._meta = meta
        self._clock = clock
        self.owners: dict[str, Pin] = {}
        self._count: dict[bytes, int] = {}  # oid -> number of owners pinning it
        for owner, rec in meta.pins():
            self._merge(owner, {bytes.fromhex(o): s for o, s in rec["objects"].items()},
                        rec.get("expires"))
        self.expire()

    def __contains__(self, oid: bytes) -> bool:
        return oid in self._count

    def _merge(self, owner: str, objects: dict[bytes, int], expires: float | None) -> Pin:
        pin = self.owners.get(owner)
        if pin is None:
            pin = self.owners[owner] = Pin(expires)
        elif pin.expires is not None:  # pinning again never shortens a pin
            pin.expires = None if expires is None else max(pin.expires, expires)
        for oid, size in objects.items():
            if oid not in pin.objects:
                self._count[oid] = self._count.get(oid, 0) + 1
            pin.objects[oid] = size
        return pin

    def add(self, owner: str, objects: dict[bytes, int], expires: float | None = None) -> None:
        pin = self._merge(owner, objects, expires)
        if not owner.startswith(TRANSIENT_PREFIX):
            self._meta.put_pin(owner, pin.record())

    def release(self, owner: str) -> int:
        """Drop an owner's pins; returns how many objects it pinned."""
        pin = self.owners.pop(owner, None)
        if pin is None:
            return 0
        for oid in pin.objects:
            self._uncount(oid)
        if not owner.startswith(TRANSIENT_PREFIX):
            self._meta.put_pin(owner, None)
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
                self._uncount(oid)
            dropped += len(mine)
            if not pin.objects:
                self.release(owner)
            elif not owner.startswith(TRANSIENT_PREFIX):
                self._meta.put_pin(owner, pin.record())
        return dropped

    def expire(self) -> list[str]:
        now = self._clock()
        gone = [o for o, p in self.owners.items() if p.expires is not None and p.expires <= now]
        for owner in gone:
            self.release(owner)
        return gone

    def _uncount(self, oid: bytes) -> None:
        n = self._count[oid] - 1
        if n:
            self._count[oid] = n
        else:
            del self._count[oid]

    def objects(self) -> dict[bytes, int]:
        """Every pinned object version with its size."""
        out: dict[bytes, int] = {}
        for pin in self.owners.values():
            out.update(pin.objects)
        return out
