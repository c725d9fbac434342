"""Heat: an exponentially decayed access count.

heat(t) = heat(t0) * 2 ** (-(t - t0) / half_life), plus 1 per access. Ordering chunks by
decayed heat at any instant is the same as ordering by log2(heat) + last_access/half_life,
a value that does not change with time: eviction sorts on it without recomputing decay.

Heat counts reads. A record with heat below 1, a chunk stored without being read (written
data, stored at heat 0: admission.py), ranks as heat 1 at its store time: it is kept as
long as data just read, and its first read makes it heat 1, not 2 (a checkpoint restored
once is not a working set: bench/README.md, "Eviction quality").
"""

from __future__ import annotations

import math


def decayed(heat: float, last_access: float, now: float, half_life: float) -> float:
    return heat * 2.0 ** (-(max(0.0, now - last_access)) / half_life)


def touched(heat: float, last_access: float, now: float, half_life: float) -> float:
    return decayed(heat, last_access, now, half_life) + 1.0


def eviction_order(heat: float, last_access: float, half_life: float) -> float:
    """Smaller is colder. Time-invariant (see module doc); heat below 1 ranks as 1."""
    return math.log2(max(heat, 1.0)) + last_access / half_life
