"""Eviction policy: how big the disk tier may be, and which chunks leave first.

The budget is the smaller of --cache-size and what the free-space guard allows (the cache
filesystem keeps min_free_ratio of its size free, whoever else fills it). When usage
would pass high * budget, the coldest chunks by decayed heat go until usage is at
low * budget. Chunks in `protected` (being written) and chunks of objects in `pinned`
(object ids: `tierfs warm --pin`, a warm in progress) never go.
"""

from __future__ import annotations

import heapq
import os
from typing import Callable, Container, Iterable

from ..meta import ChunkRecord
from .heat import eviction_order


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

    def victims(self, index: dict[bytes, ChunkRecord], used: int, incoming: int,
                protected: Iterable[bytes] = (),
                pinned: Container[bytes] = ()) -> tuple[list[bytes], bool]:
        """Chunks to evict so that `incoming` more bytes fit, and whether they then fit."""
        budget = self.budget(used)
        if used + incoming <= self.high * budget:
            return [], True
        target = self.low * budget - incoming
        keep = set(protected)
        hl = self.half_life
        order = heapq.nsmallest(
            len(index), ((eviction_order(r.heat, r.last_access, hl), k) for k, r in index.items()
                         if k not in keep and k[:16] not in pinned))
        out = []
        for _, k in order:
            if used <= target:
                break
            out.append(k)
            used -= index[k].length
        return out, used + incoming <= budget
