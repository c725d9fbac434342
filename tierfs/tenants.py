"""Tenants: who owns a key of the bucket (docs/tenants.md).

A tenant is a name and the key prefixes it owns (none: a tenant only readers name, e.g. a
Kubernetes namespace with tenant_from), with optional shares of the cache
(`soft`, `hard`), an idle limit (`max_idle`) and a default pin TTL (`pin_ttl`). A key
belongs to the tenant with the longest matching prefix; a key no prefix matches belongs to
"default", which always exists (it may be declared to give it shares, never prefixes).

The records here check themselves (names, prefixes, hard >= soft, fractions in (0, 1]) and
raise ValueError with one line naming the tenant and the field. What users write (sizes
like "200G", durations like "7d", TOML tables) is read by `tierfs.config.parse_tenants`:
the size and duration parsers live in config.py, and config.py imports this module, so
this one imports nothing of ours (its layer is below config in pyproject.toml).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

DEFAULT = "default"
NAME_RE = re.compile(r"[a-z0-9_-]{1,32}", re.ASCII)
MAX_TENANTS = 64  # each one is a Prometheus series per source: keep the cardinality bounded
MAX_PREFIXES = 1000  # per tenant
MAX_PREFIX_LEN = 1024  # an S3 key's limit
MEMO_SIZE = 1 << 16  # keys remembered by TenantMap.of


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bytes_text(n: int) -> str:
    for unit, shift in (("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Share:
    """A part of the cache budget: a fraction of it (40% -> 0.4) or a number of bytes."""

    fraction: float | None = None
    bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.bytes is None):
            raise ValueError("a share is a fraction or a number of bytes, not both or none")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"{self.fraction * 100:g}%: must be more than 0% and at most "
                             f"100%")
        if self.bytes is not None and self.bytes <= 0:
            raise ValueError("must be more than 0 bytes")

    def of(self, budget: int) -> int:
        """Bytes of this share of `budget`; a size larger than the budget is the budget."""
        if self.fraction is not None:
            return int(budget * self.fraction)
        assert self.bytes is not None
        return min(self.bytes, budget)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction * 100:g}%"
        assert self.bytes is not None
        return _bytes_text(self.bytes)


@dataclass(frozen=True)
class Tenant:
    """One tenant, checked: ValueError names it and the bad field."""

    name: str
    prefixes: tuple[str, ...] = ()
    soft: Share | None = None  # evicted first when the cache must evict and it is above
    hard: Share | None = None  # never more than this: it evicts its own chunks to admit more
    max_idle: float | None = None  # seconds: its chunks not read for this long are evicted
    pin_ttl: float | None = None  # seconds: the default TTL of pins of its files

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            raise ValueError(f"tenant {_show(self.name)}: bad name: expected 1 - 32 of "
                             f"a-z 0-9 _ -")
        where = f"tenant {self.name}"
        if not isinstance(self.prefixes, tuple):
            raise ValueError(f"{where}: prefixes: expected a list of key prefixes")
        if self.name == DEFAULT:
            if self.prefixes:
                raise ValueError(f"{where}: prefixes: the default tenant owns every key no "
                                 f"other tenant's prefix matches; it has no prefixes")
        if len(self.prefixes) > MAX_PREFIXES:
            raise ValueError(f"{where}: prefixes: more than {MAX_PREFIXES}")
        seen: set[str] = set()
        for p in self.prefixes:
            _check_prefix(where, p)
            if p in seen:
                raise ValueError(f"{where}: prefixes: {_show(p)} is given twice")
            seen.add(p)
        for field in ("max_idle", "pin_ttl"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and value > 0
                                          and value == value and value != float("inf")):
                raise ValueError(f"{where}: {field}: must be a finite duration more than 0")
        soft, hard = self.soft, self.hard
        if soft is None or hard is None or (soft.fraction is None) != (hard.fraction is None):
            return  # a size against a fraction: only a budget compares them (check_budget)
        if soft.of(1 << 62) > hard.of(1 << 62):
            raise ValueError(f"{where}: hard: {hard} is less than soft {soft}")

    def check_budget(self, budget: int) -> None:
        """hard >= soft when one is a size and the other a fraction of `budget`."""
        if self.soft is not None and self.hard is not None \
                and self.soft.of(budget) > self.hard.of(budget):
            raise ValueError(f"tenant {self.name}: hard: {self.hard} "
                             f"({_bytes_text(self.hard.of(budget))} of {_bytes_text(budget)}) "
                             f"is less than soft {self.soft} "
                             f"({_bytes_text(self.soft.of(budget))})")


def _check_prefix(where: str, p: object) -> None:
    if not isinstance(p, str):
        raise ValueError(f"{where}: prefixes: expected strings, got {_show(p)}")
    if not p:
        raise ValueError(f"{where}: prefixes: an empty prefix would own every key "
                         f"(that is the default tenant)")
    if len(p) > MAX_PREFIX_LEN:
        raise ValueError(f"{where}: prefixes: {_show(p)} is longer than {MAX_PREFIX_LEN} "
                         f"characters")
    if any(not c.isprintable() for c in p):
        raise ValueError(f"{where}: prefixes: {_show(p)} contains a control character")
    if p.startswith("/"):
        raise ValueError(f"{where}: prefixes: {_show(p)} starts with '/': prefixes are bucket "
                         f"keys (like \"datasets/imagenet/\"), not paths")


class TenantMap:
    """The tenants of a mount: key -> tenant name by the longest matching prefix.

    Immutable; equal and hashed by its tenants (it is part of the frozen MountConfig).
    `of` is on the read path: it looks up one slice of the key per distinct prefix
    length (longest first), and remembers up to `memo_size` keys (the memo is emptied when
    full: bounded, and cheaper than an LRU for a lookup this small)."""

    __slots__ = ("_tenants", "_owner", "_lengths", "_memo", "_memo_size")

    def __init__(self, tenants: Iterable[Tenant] = (), *, memo_size: int = MEMO_SIZE) -> None:
        by_name: dict[str, Tenant] = {}
        owner: dict[str, str] = {}
        for t in tenants:
            if not isinstance(t, Tenant):
                raise TypeError(f"expected a Tenant, got {type(t).__name__}")
            if t.name in by_name:
                raise ValueError(f"tenant {t.name}: declared twice")
            for p in t.prefixes:
                if p in owner:
                    raise ValueError(f"tenant {t.name}: prefixes: {_show(p)} is also tenant "
                                     f"{owner[p]}'s (a prefix has one owner)")
                owner[p] = t.name
            by_name[t.name] = t
        if len(by_name) > MAX_TENANTS:
            raise ValueError(f"more than {MAX_TENANTS} tenants")
        by_name.setdefault(DEFAULT, Tenant(DEFAULT))
        self._tenants = by_name
        self._owner = owner
        self._lengths = sorted({len(p) for p in owner}, reverse=True)
        self._memo: dict[str, str] = {}
        self._memo_size = max(0, memo_size)

    def of(self, key: str) -> str:
        """The tenant owning `key` (a bucket key, the mount's prefix included)."""
        if not self._lengths:
            return DEFAULT
        name = self._memo.get(key)
        if name is not None:
            return name
        name = DEFAULT
        owner = self._owner
        for n in self._lengths:
            if n <= len(key):
                found = owner.get(key[:n])
                if found is not None:
                    name = found
                    break
        if self._memo_size:
            if len(self._memo) >= self._memo_size:
                self._memo.clear()
            self._memo[key] = name
        return name

    def names(self) -> tuple[str, ...]:
        """Every tenant's name, "default" included (it always exists), sorted."""
        return tuple(sorted(self._tenants))

    def get(self, name: str) -> Tenant:
        """The tenant called `name`; KeyError for a name that is not one."""
        return self._tenants[name]

    @property
    def declared(self) -> bool:
        """Whether any tenant but an undeclared default exists (quotas or prefixes to honour)."""
        return len(self._tenants) > 1 or self._tenants[DEFAULT] != Tenant(DEFAULT)

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._tenants)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TenantMap) and self._tenants == other._tenants

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"TenantMap({list(self)!r})"
