"""Recovery and drain: journaled files across a crash, pending uploads at shutdown.

At start, every file in the write-back journal (acknowledged, not yet uploaded) gets its
DirtyFile back, journaled, and is queued; staging files the journal does not name were
never acknowledged (a file still open when the daemon died) and are deleted. A multipart
upload the dead daemon recorded is orphan cleanup's (orphans.py): the file starts a new
one. At shutdown, drain() gives pending uploads a bounded time; what is left stays in the
journal for the next mount.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import trio

from ..cache import ObjectVersion
from .dirty import DirtyFile, State

if TYPE_CHECKING:
    from .files import WriteBack

log = logging.getLogger("tierfs.writeback")


def recover(wb: "WriteBack") -> int:
    """Requeue journaled files, delete staging files of unacknowledged ones: how many
    files were recovered."""
    keep = set()
    for ino, rec in wb.meta.journal.dirty_records():
        path = rec["staging"]
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            log.error("journaled file %r lost its staging file %s: cannot upload it",
                      rec["key"], path)
            wb.meta.journal.delete_dirty(ino)
            continue
        base = ObjectVersion(*rec["base"]) if rec["base"] else None
        d = DirtyFile(ino, rec["key"], base, rec["base_valid"], rec["size"], path, fd,
                      rec["metadata"], set(rec["materialized"]), journaled=True,
                      state=State.JOURNALED)
        wb.files[ino] = d
        wb.cache.force_dirty(len(d.materialized) * wb.chunk_size, key=d.key)
        keep.add(os.path.basename(path))
        wb.queue.put(ino)
        log.info("recovered unsaved file %r (%d bytes): uploading", d.key, d.size)
    for name in os.listdir(wb.dir):
        if name not in keep:
            os.unlink(os.path.join(wb.dir, name))
    return len(keep)


async def drain(wb: "WriteBack", timeout_s: float) -> bool:
    """Give pending uploads up to timeout_s; True if nothing is left."""
    with trio.move_on_after(timeout_s):
        limit = trio.CapacityLimiter(4)

        async def one(d: DirtyFile) -> None:
            async with limit:
                try:
                    await wb.commit(d)
                except Exception:  # noqa: BLE001 - logged by commit; stays journaled
                    pass

        async with trio.open_nursery() as nursery:
            for d in list(wb.files.values()):
                if not d.clean and not d.superseded and d.writers == 0 and d.failed is None:
                    nursery.start_soon(one, d)
    return all(d.clean or d.superseded for d in wb.files.values())
