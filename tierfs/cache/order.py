"""Eviction order: which cached chunks leave first, given what must be freed.

Coldest first: the lowest decayed value (heat.eviction_order: heat times what a miss
costs per byte, so a small file stays before a big chunk read as often). Tenants above
their soft share lose their coldest chunks first, each only down to its share, then
everyone's go by heat as without tenants. Pure functions over the chunk records the
placement policy (policy.py) keeps; which chunks may go at all is the caller's filter.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from ..index.chunks import ChunkRecord
from .heat import eviction_order


def coldest(chunks: Mapping[bytes, ChunkRecord], half_life: float,
            evictable: Callable[[bytes], bool]) -> list[bytes]:
    """The chunks `evictable` accepts, coldest first."""
    return [k for _, k in sorted(
        (eviction_order(r.heat, r.last_access, half_life, r.length), k)
        for k, r in chunks.items() if evictable(k))]


def take(order: Iterable[bytes], chunks: Mapping[bytes, ChunkRecord], used: int,
         target: float, out: list[bytes]) -> int:
    """Append chunks of `order` to `out` until `used` is down to `target`; `used` then."""
    for k in order:
        if used <= target:
            break
        out.append(k)
        used -= chunks[k].length
    return used


def victims(order: list[bytes], chunks: Mapping[bytes, ChunkRecord], used: int,
            target: float, over_soft: Mapping[str, int], owner: Callable[[bytes], str]
            ) -> tuple[list[bytes], int]:
    """Chunks of `order` (coldest first) to evict until `used` is down to `target`, those
    of tenants `over_soft` (bytes above their soft share) first; (them, `used` then)."""
    out: list[bytes] = []
    if over_soft:
        above = dict(over_soft)
        for k in order:
            if used <= target:
                break
            t = owner(k)
            if above.get(t, 0) > 0:  # only down to its soft share: then it is like anyone
                n = chunks[k].length
                out.append(k)
                used -= n
                above[t] -= n
        gone = set(out)
        order = [k for k in order if k not in gone]
    return out, take(order, chunks, used, target, out)
