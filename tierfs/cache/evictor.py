"""The disk tier's budget: how many bytes of chunks it may hold, and its watermarks.

The budget is the smaller of --cache-size and what the free-space guard allows (the cache
filesystem keeps min_free_ratio of its size free, whoever else fills it: a statvfs per
question). Usage may reach high x budget; eviction then goes down to low x budget. Which
chunks go is the placement policy's (policy.py): this only measures the room.
"""

from __future__ import annotations

import os
from typing import Callable


class Evictor:
    def __init__(self, root: str, *, cache_size: int, min_free_ratio: float, high: float,
                 low: float, half_life: float,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs) -> None:
        self.root = root
        self.cache_size = cache_size
        self.min_free_ratio = min_free_ratio
        self.high = high
        self.low = low
        self.half_life = half_life  # configured; the one in use: ChunkCache.half_life
        self._statvfs = statvfs

    def budget(self, used: int) -> int:
        st = self._statvfs(self.root)
        avail = st.f_bavail * st.f_frsize
        reserve = int(self.min_free_ratio * st.f_blocks * st.f_frsize)
        return max(0, min(self.cache_size, used + avail - reserve))
