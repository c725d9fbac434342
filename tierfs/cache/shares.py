"""Tenant shares: each tenant's bytes in the cache, and its soft and hard shares of it.

docs/tenants.md: every cached chunk, pin and unsaved (dirty) byte counts to the tenant of
its object's key. This module keeps those counts per tenant, in memory, and answers the
quota questions eviction asks: how far each tenant is above its soft share (those tenants'
chunks are evicted first), whether a tenant's hard share has room for more bytes (at its
hard share a tenant evicts its own chunks, never another's), and which tenant's chunks
have gone unread past its max_idle. It does no I/O: the cache tells it what was stored,
dropped, pinned, reserved or written, and publishes the counts (`changed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

from ..tenants import DEFAULT, TenantMap

IDLE_SWEEP_MIN_S, IDLE_SWEEP_MAX_S = 10.0, 600.0


class Pinned(Protocol):
    """Object ids eviction leaves alone (pins.Pins, or a set)."""

    def __contains__(self, oid: bytes, /) -> bool: ...


@dataclass(frozen=True)
class TenantBytes:
    """One tenant's bytes in the cache: chunks on disk, the part of them pinned, and
    unsaved writes (which are not chunks: they live in the staging files)."""

    cached: int = 0
    pinned: int = 0
    dirty: int = 0


@dataclass
class Tally:
    cached: int = 0
    pinned: int = 0
    dirty: int = 0
    reserved: int = 0  # chunks being written, staging copies held: in the shares already

    @property
    def share_used(self) -> int:
        """What counts against the tenant's soft and hard shares (pins are cached chunks)."""
        return self.cached + self.reserved + self.dirty


class Shares:
    """The per-tenant counts (module doc). `pinned`: object ids eviction leaves alone."""

    def __init__(self, tenants: TenantMap, pinned: Pinned = frozenset()) -> None:
        self.tenants = tenants
        self.pinned = pinned
        self.tally = {name: Tally() for name in tenants.names()}
        self.soft = {t.name: t.soft for t in tenants if t.soft is not None}
        self.hard = {t.name: t.hard for t in tenants if t.hard is not None}
        self.max_idle = {t.name: t.max_idle for t in tenants if t.max_idle}
        self.oid_tenant: dict[bytes, str] = {}  # object id -> tenant, objects with chunks here
        self.oid_bytes: dict[bytes, int] = {}  # object id -> bytes of its chunks here
        self.changed: set[str] = set(self.tally)  # tenants whose counts the caller last saw

    def owner(self, ckey: bytes) -> str:
        """The tenant of a cached chunk."""
        return self.oid_tenant.get(ckey[:16], DEFAULT)

    def of(self, key: str | None) -> str:
        """The tenant of an object key (None: the default tenant)."""
        return DEFAULT if key is None else self.tenants.of(key)

    def added(self, ckey: bytes, length: int, tenant: str) -> None:
        oid = ckey[:16]
        self.oid_tenant[oid] = tenant
        self.oid_bytes[oid] = self.oid_bytes.get(oid, 0) + length
        self._count(tenant, oid, length)

    def removed(self, ckey: bytes, length: int) -> None:
        oid = ckey[:16]
        tenant = self.oid_tenant.get(oid, DEFAULT)
        left = self.oid_bytes.pop(oid, 0) - length
        if left > 0:
            self.oid_bytes[oid] = left
        else:
            self.oid_tenant.pop(oid, None)
        self._count(tenant, oid, -length)

    def _count(self, tenant: str, oid: bytes, n: int) -> None:
        tally = self.tally[tenant]
        tally.cached += n
        if oid in self.pinned:
            tally.pinned += n
        self.changed.add(tenant)

    def pin_changed(self, oid: bytes, pinned: bool) -> None:
        n = self.oid_bytes.get(oid)
        if n:
            tenant = self.oid_tenant[oid]
            self.tally[tenant].pinned += n if pinned else -n
            self.changed.add(tenant)

    def dirty(self, tenant: str, n: int) -> None:
        self.tally[tenant].dirty += n
        self.changed.add(tenant)

    def release_dirty(self, first: str, n: int) -> None:
        """n dirty bytes leave: `first`'s, then (a file renamed into another tenant
        meanwhile) the rest from the others, so the tenants' sum stays the total."""
        for name in (first, *self.tally):
            tally = self.tally[name]
            take = min(n, tally.dirty)
            if take:
                tally.dirty -= take
                n -= take
                self.changed.add(name)
            if not n:
                break

    def counts(self) -> dict[str, TenantBytes]:
        return {name: TenantBytes(t.cached, t.pinned, t.dirty) for name, t in self.tally.items()}

    def over_soft(self, budget: int) -> dict[str, int]:
        """Bytes each tenant is above its soft share of `budget`."""
        out = {}
        for name, share in self.soft.items():
            over = self.tally[name].share_used - share.of(budget)
            if over > 0:
                out[name] = over
        return out

    def hard_limit(self, tenant: str, budget: int) -> int | None:
        """The tenant's hard share of `budget` in bytes (None: it has none)."""
        share = self.hard.get(tenant)
        return None if share is None else share.of(budget)

    def pinned_bytes(self, tenant: str, exclude: Iterable[bytes] = ()) -> int:
        skip = set(exclude)
        return sum(n for oid, n in self.oid_bytes.items()
                   if oid in self.pinned and oid not in skip and self.oid_tenant[oid] == tenant)

    def bytes_of(self, oids: Iterable[bytes]) -> int:
        return sum(self.oid_bytes.get(oid, 0) for oid in set(oids))

    def idle_limit(self, ckey: bytes) -> float | None:
        """Seconds unread after which the chunk's tenant evicts it (its max_idle), if any."""
        return self.max_idle.get(self.owner(ckey))

    def idle_sweep_interval(self) -> float | None:
        """How often to look for idle chunks: a tenth of the shortest max_idle, within
        10 s - 10 min; None when no tenant has a max_idle."""
        if not self.max_idle:
            return None
        return min(max(min(self.max_idle.values()) / 10, IDLE_SWEEP_MIN_S), IDLE_SWEEP_MAX_S)
