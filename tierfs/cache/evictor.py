"""Eviction policy: how big the disk tier may be, and which chunks leave first.

The budget is the smaller of --cache-size and what the free-space guard allows (the cache
filesystem keeps min_free_ratio of its size free, whoever else fills it). When usage
would pass high * budget, the coldest chunks go until usage is at low * budget. Coldest:
the lowest decayed value (heat.py: heat times what a miss costs per byte, so a small file
stays before a big chunk read as often). Chunks in `protected` (being written) and chunks
of objects in `pinned` (object ids: `tierfs warm --pin`, a warm in progress) never go.

Tenants (docs/tenants.md, "Quotas"): the caller says which tenant owns a chunk and how far
each tenant is above its soft share; those tenants' coldest chunks go first, each tenant
only down to its soft share, then everyone's by heat as without tenants. A tenant at its
hard share evicts its own coldest chunks (`own_victims`), never another tenant's. Heat is
the order inside a tenant in both cases.
"""

from __future__ import annotations

import os
from typing import Callable, Container, Iterable, Mapping

from ..index.chunks import ChunkRecord
from .heat import eviction_order

Owner = Callable[[bytes], str]  # chunk key -> tenant name


class Evictor:
    def __init__(self, root: str, *, cache_size: int, min_free_ratio: float, high: float,
                 low: float, half_life: float,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> None:
        self.root = root
        self.cache_size = cache_size
        self.min_free_ratio = min_free_ratio
        self.high = high
        self.low = low
        self.half_life = half_life
        self._statvfs = statvfs

    def budget(self, used: int) -> int:
        st = self._statvfs(self.root)
        avail = st.f_bavail * st.f_frsize
        reserve = int(self.min_free_ratio * st.f_blocks * st.f_frsize)
        return max(0, min(self.cache_size, used + avail - reserve))

    def must_evict(self, used: int, incoming: int) -> bool:
        """Whether storing `incoming` more bytes would pass the high watermark."""
        return used + incoming > self.high * self.budget(used)

    def coldest(self, index: dict[bytes, ChunkRecord], protected: Iterable[bytes] = (),
                pinned: Container[bytes] = (), only: Callable[[bytes], bool] | None = None
                ) -> list[bytes]:
        """The evictable chunks (of those `only` accepts), coldest first."""
        keep = set(protected)
        hl = self.half_life
        return [k for _, k in sorted(
            (eviction_order(r.heat, r.last_access, hl, r.length), k) for k, r in index.items()
            if k not in keep and k[:16] not in pinned and (only is None or only(k)))]

    def victims(self, index: dict[bytes, ChunkRecord], used: int, incoming: int,
                protected: Iterable[bytes] = (), pinned: Container[bytes] = (), *,
                over_soft: Callable[[int], Mapping[str, int]] | None = None,
                owner: Owner | None = None) -> tuple[list[bytes], bool]:
        """Chunks to evict so that `incoming` more bytes fit, and whether they then fit.

        `over_soft(budget)`: bytes each tenant is above its soft share (asked only when
        something must go); with `owner`, those tenants' coldest chunks go first."""
        budget = self.budget(used)  # one statvfs
        if used + incoming <= self.high * budget:
            return [], True
        target = self.low * budget - incoming
        order = self.coldest(index, protected, pinned)
        out: list[bytes] = []
        above = dict(over_soft(budget)) if over_soft is not None and owner is not None else {}
        if any(v > 0 for v in above.values()):
            assert owner is not None
            first = []
            for k in order:
                if used <= target:
                    break
                t = owner(k)
                if above.get(t, 0) > 0:  # only down to its soft share: then it is like anyone
                    n = index[k].length
                    first.append(k)
                    used -= n
                    above[t] -= n
            out, gone = first, set(first)
            order = [k for k in order if k not in gone]
        for k in order:
            if used <= target:
                break
            out.append(k)
            used -= index[k].length
        return out, used + incoming <= budget

    def own_victims(self, index: dict[bytes, ChunkRecord], tenant: str, owner: Owner,
                    used: int, incoming: int, share: int, protected: Iterable[bytes] = (),
                    pinned: Container[bytes] = ()) -> tuple[list[bytes], bool]:
        """A tenant using `used` bytes of its hard `share`: its own chunks to evict so that
        `incoming` more bytes fit in the share, and whether they then fit. It frees a
        batch (high - low of the share) at once, as the budget's eviction does, so a
        tenant filling at its share does not sort its chunks for every chunk it admits."""
        if used + incoming <= share:
            return [], True
        target = share - incoming - int((self.high - self.low) * share)
        out = []
        for k in self.coldest(index, protected, pinned, lambda k: owner(k) == tenant):
            if used <= target:
                break
            out.append(k)
            used -= index[k].length
        return out, used + incoming <= share
