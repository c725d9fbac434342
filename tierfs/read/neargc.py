"""What the near store may let go (`tierfs gc --tier near`, docs/tiers.md "Sizing").

A copy in the near store is worth keeping while it is a copy of the source's current
version. The collection, run on a mount that has the near store (it knows both stores):
1. lists the near store's prefix (one LIST page per 1,000 objects) and the source's
   objects those copies are of (one LIST page per 1,000 keys of the source's prefix);
2. removes the copies whose source object is gone or is another version now: the ETag
   the copy names (its metadata, one HEAD per copy) is not the source's;
3. if a budget is given, removes the least recently written copies (the promotion or warm
   that made them) until the rest fit in it.
A copy left half-made by a crash (near.NEAR_MAKING, no version: promote.py) is removed
once it is MAKING_MAX_AGE_S old. Anything else under the near prefix that is not a copy
(a foreign object) is left alone and counted: only what is provably on the source, or
provably an abandoned copy of it, is ever removed. `dry_run` says what would go.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..backend.base import ObjectMeta
from ..backend.runner import AsyncBackend
from ..errors import NotFound, TierfsError
from .near import NEAR_ETAG, NEAR_MAKING

log = logging.getLogger(__name__)

MAKING_MAX_AGE_S = 3600.0  # a copy still being made after this long was abandoned


@dataclass
class _Copy:
    near: ObjectMeta  # the near store's object (key, size, mtime)
    key: str  # the source key it is a copy of
    version: str | None  # the source ETag it names; None: not a copy
    making: bool = False  # a copy being made (or abandoned half-made)


async def _list_all(store: AsyncBackend, prefix: str) -> list[ObjectMeta]:
    out: list[ObjectMeta] = []
    token = None
    while True:
        page = await store.list(prefix, delimiter=None, token=token)
        out.extend(page.objects)
        token = page.next_token
        if token is None:
            return out


async def collect(near: AsyncBackend, near_prefix: str, source: AsyncBackend,
                  source_prefix: str, *, budget: int | None = None,
                  dry_run: bool = False, now: float | None = None) -> dict:
    """Remove stale copies, then the oldest until `budget` bytes remain; a summary."""
    copies: list[_Copy] = []
    for obj in await _list_all(near, near_prefix):
        key = obj.key[len(near_prefix):]
        try:
            meta = await near.head(obj.key)
        except NotFound:
            continue  # removed meanwhile
        md = meta.metadata or {}
        copies.append(_Copy(obj, key, md.get(NEAR_ETAG), NEAR_MAKING in md))
    current = {o.key: o.etag for o in await _list_all(source, source_prefix)}
    stale = [c for c in copies if c.version is not None and current.get(c.key) != c.version]
    kept = [c for c in copies if c.version is not None and current.get(c.key) == c.version]
    now = time.time() if now is None else now
    abandoned = [c for c in copies if c.version is None and c.making
                 and now - c.near.mtime > MAKING_MAX_AGE_S]
    stale += abandoned
    gone = {id(c) for c in abandoned}
    foreign = [c for c in copies if c.version is None and id(c) not in gone]
    over: list[_Copy] = []
    if budget is not None:
        total = sum(c.near.size for c in kept) + sum(c.near.size for c in foreign)
        for c in sorted(kept, key=lambda c: c.near.mtime):  # least recently written first
            if total <= budget:
                break
            over.append(c)
            total -= c.near.size
    removed = 0
    errors: list[dict] = []
    for c in (*stale, *over):
        if dry_run:
            continue
        try:
            # a promotion may have written a current copy at this key since the HEAD:
            # removing it costs a miss (the source answers), never a wrong byte
            await near.delete(c.near.key)
            removed += c.near.size
        except TierfsError as exc:  # one entry per copy; the rest goes on
            errors.append({"path": c.near.key, "error": str(exc)})
    if not dry_run:
        log.info("near store gc: %d stale copies and %d over the budget removed (%d bytes), "
                 "%d errors", len(stale), len(over), removed, len(errors))
    going = {id(c) for c in over}
    kept_bytes = sum(c.near.size for c in kept if id(c) not in going)
    return {"copies": len(copies), "stale": len(stale),
            "stale_bytes": sum(c.near.size for c in stale),
            "over_budget": len(over), "over_budget_bytes": sum(c.near.size for c in over),
            "kept": len(kept) - len(over), "kept_bytes": kept_bytes,
            "not_copies": len(foreign), "not_copies_bytes": sum(c.near.size for c in foreign),
            "removed_bytes": removed, "dry_run": dry_run,
            "errors": errors[:50], "error_count": len(errors)}
