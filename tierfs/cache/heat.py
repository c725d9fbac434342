"""Heat: an exponentially decayed access count.

heat(t) = heat(t0) * 2 ** (-(t - t0) / half_life), plus 1 per access. Ordering chunks by
decayed heat at any instant is the same as ordering by log2(heat) + last_access/half_life,
a value that does not change with time: eviction sorts on it without recomputing decay.

Heat counts reads. A chunk stored without being read (written data, stored at heat 0:
admission.py) ranks as UNREAD_WRITTEN reads at its store time, so the last checkpoint is
kept for its restore over data read a few times; its first read (the restore) makes it
RESTORED, below one read: a checkpoint restored once is not a working set, and, like an
unread one, it is the room the next writes take first (a written chunk read at most once:
heat below 1; policy.py `_recycle`, docs/architecture.md decision 3e). A second read
makes it an ordinary chunk (RESTORED decayed + 1).

What a chunk is worth keeping is its heat times what a miss on it costs per byte of cache it
holds (`value`, GreedyDual-Size-Frequency's idea): a GET pays a first-byte latency whatever
its size, so a 10 KiB label file costs nearly as much to fetch again as an 8 MiB chunk while
holding 1/800 of the room. Eviction and admission compare values; with chunks of one size
that is comparing heats.
"""

from __future__ import annotations

import math

# Each constant: what it trades (figures for other values: bench/README.md "Eviction quality")
MISS_OVERHEAD = 2 << 20  # bytes a GET's first-byte latency is worth: small files vs big chunks
UNREAD_WRITTEN = 4.0  # reads an unread written chunk ranks as: checkpoints kept vs data kept
RESTORED = 0.5  # heat of a written chunk read once: below any read chunk (a rank, not tuned)


def decayed(heat: float, last_access: float, now: float, half_life: float) -> float:
    return heat * 2.0 ** (-(max(0.0, now - last_access)) / half_life)


def touched(heat: float, last_access: float, now: float, half_life: float) -> float:
    if heat == 0.0:  # an unread written chunk's first read: still read at most once
        return RESTORED
    return decayed(heat, last_access, now, half_life) + 1.0


def ranked(heat: float) -> float:
    """The heat eviction and admission compare: an unread written chunk's is UNREAD_WRITTEN."""
    return heat or UNREAD_WRITTEN


def miss_cost(length: int) -> float:
    """What a miss on a chunk of `length` bytes costs per byte of it, in bytes' worth of
    transfer: (MISS_OVERHEAD + length) / length."""
    length = max(1, length)
    return (MISS_OVERHEAD + length) / length


def value(heat: float, length: int) -> float:
    """What keeping a chunk is worth, per byte (module doc)."""
    return heat * miss_cost(length)


def eviction_order(heat: float, last_access: float, half_life: float, length: int) -> float:
    """Smaller goes first: the decayed value, time-invariant (module doc)."""
    return math.log2(value(ranked(heat), length)) + last_access / half_life


# half-lives at least per cache-full of chunk accesses: rarely read chunks ranked vs adapting
PER_CACHE = 12.0


class HalfLife:
    """The half-life heat decays with: the configured one, or PER_CACHE times the time the
    node took to access its last cache's worth of chunks (`chunks` accesses: reads of
    chunks and fills), whichever is longer.

    Heat must outlast a pass over the cache: a loop over a data set larger than the cache
    reads each chunk once a pass, and once a pass takes several half-lives the chunks it
    read first have decayed to nothing against those it read last, so the admission
    policy's comparisons churn (bench/README.md, "The clock"). Slow nodes get a longer
    half-life; fast ones keep the configured one. It starts at the configured one (it is
    not kept across restarts) and changes once a cache's worth of accesses.
    """

    def __init__(self, configured: float, chunks: int) -> None:
        self.configured = configured
        self.chunks = max(1, chunks)
        self.value = configured
        self._last: float | None = None
        self._busy = 0.0  # time the current cache's worth has taken, idle gaps capped
        self._count = 0

    def accessed(self, now: float) -> bool:
        """Count one chunk access at `now`; True when the half-life in use changed.

        A gap between two accesses counts at most the configured half-life: a night
        without reads is not a slow node (heat decays over it at the half-life in use)."""
        if self._last is not None:
            self._busy += min(max(0.0, now - self._last), self.configured)
        self._last = now
        self._count += 1
        if self._count < self.chunks:
            return False
        value = max(self.configured, PER_CACHE * self._busy)
        self._busy, self._count = 0.0, 0
        changed, self.value = value != self.value, value
        return changed
