"""MetaStore: the index of a cache directory, opened, and its tables.

One LMDB environment (CACHE_DIR/index, env.py) holds one table object per owner, created
here once (tierfs.mount.core's build_core opens the store):
  meta.inodes     inodes.py     inodes, directory entries, listings, attributes
  meta.chunks     chunks.py     chunk records and the objects they belong to
  meta.pins       pins.py       what `tierfs warm --pin` keeps from eviction
  meta.usage      usage.py      bytes read and stalls by tenant and reader
  meta.analytics  analytics.py  per-prefix and per-job reads, the report's totals
  meta.capacity   capacity.py   the history behind `tierfs usage --forecast`
  meta.journal    journal.py    the write-back journal (CACHE_DIR/journal, not in LMDB)
Callers use the table that owns what they need; no table reaches another's databases.
Every table method is one short synchronous transaction; callers never await inside one.

What this module owns is the opening: the journal is kept apart so that everything in the
index stays a re-derivable cache that may be thrown away. A damaged index (probe.py) is
moved aside to index.damaged-<time> with one WARNING and a new one starts empty, given what
the old one still yields (chunk records, object info, pins); an index of another schema is
moved aside too. A new index gets the inodes of journaled files back; an old cache dir's
`dirty` and `uploads` databases are moved into the journal.
"""

from __future__ import annotations

import json
import logging
import os
import struct

from ..cachedir import Layout
from .analytics import AnalyticsTable
from .capacity import CapacityTable
from .chunks import ChunkTable, chunk_format
from .env import (
    CHUNK_FORMAT_KEY,
    CHUNKS,
    INFO,
    JOURNAL,
    LEGACY,
    OBJECTS,
    PINS,
    SCHEMA_VERSION,
    U64,
    IndexEnv,
)
from .inodes import InodeTable
from .journal import RECOVERY_HINT, Journal, JournalDamaged
from .pins import PinTable
from .probe import PROBE_TIMEOUT_S, Salvage, probe_index, salvage_index, set_aside
from .usage import UsageTable

log = logging.getLogger(__name__)

_DIRTY, _UPLOADS = LEGACY


def _staging_files(cache_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(Layout(cache_dir).dirty))
    except FileNotFoundError:
        return []


class MetaStore:
    def __init__(self, path: str, source: str, *, map_size: int = 16 << 30,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.path = path
        cache_dir = os.path.dirname(os.path.abspath(path))
        jpath = Layout(cache_dir).journal
        # a damaged journal is the first thing to know: nothing else is touched then
        journal = Journal.open(jpath) if os.path.exists(jpath) else None
        try:
            self._open(source, map_size, probe_timeout_s, journal, cache_dir, jpath)
        except BaseException:
            if getattr(self, "env", None) is not None:
                self.env.close(sync=False)
            if journal is not None:
                journal.close()
            raise

    def _open(self, source: str, map_size: int, probe_timeout_s: float,
              journal: Journal | None, cache_dir: str, jpath: str) -> None:
        path = self.path
        existed = os.path.exists(os.path.join(path, "data.mdb"))
        salvage: Salvage | None = None
        problem = probe_index(path, probe_timeout_s) if existed else None
        if problem is not None:
            aside = set_aside(path)
            salvage = salvage_index(aside, probe_timeout_s)
            log.warning("cache index %s is damaged (%s): moved to %s; the cache starts "
                        "empty (%d chunk records salvaged)", path, problem, aside,
                        len(salvage.records.get(CHUNKS, ())))
        self.env = IndexEnv(path, map_size)
        version = self.env.schema()
        if version is not None and version != SCHEMA_VERSION:
            self.env.close(sync=False)
            aside = set_aside(path)
            log.warning("cache index %s has schema %d, this tierfs reads %d: moved to %s; "
                        "the cache starts empty", path, version, SCHEMA_VERSION, aside)
            self.env = IndexEnv(path, map_size)
        self.inodes = InodeTable(self.env)
        self.chunks = ChunkTable(self.env)
        self.pins = PinTable(self.env)
        self.usage = UsageTable(self.env)
        self.analytics = AnalyticsTable(self.env)
        self.capacity = CapacityTable(self.env)
        # numbers of journaled files stay theirs: a new index never hands them out
        first = journal.max_ino() + 1 if journal is not None else 0
        fresh = self.env.bind(source, lambda txn: self.inodes.start(txn, first))
        self.chunks.check_format()
        if journal is None:
            journal = self._first_journal(jpath, cache_dir, fresh, salvage)
        else:
            self._migrate_legacy(journal, None)
        self.journal = journal
        if fresh:
            records = dict(journal.dirty_records())
            self.inodes.restore(journal.dirty_paths(),
                                {ino: int(rec.get("size", 0)) for ino, rec in records.items()})
            if salvage is not None:
                info = dict(salvage.records.get(INFO, ()))
                self.chunks.restore(salvage.records.get(CHUNKS, ()),
                                    chunk_format(info.get(CHUNK_FORMAT_KEY)),
                                    salvage.records.get(OBJECTS, ()))
                self.pins.restore(salvage.records.get(PINS, ()))
        self.env.mark_journal()

    # ---- the journal's start --------------------------------------------------------------

    def _first_journal(self, jpath: str, cache_dir: str, fresh: bool,
                       salvage: Salvage | None) -> Journal:
        """Create the journal of a cache dir that has none: new, or made by a tierfs that
        kept the journal in the index (its `dirty` and `uploads` databases move over)."""
        hint = RECOVERY_HINT.format(dir=cache_dir)
        if not fresh:
            if self.env.journal_marked():
                raise JournalDamaged(f"the write-back journal {jpath} is missing; it may have "
                                     f"held unsaved writes: {hint}")
            journal = Journal.open(jpath)
            self._migrate_legacy(journal, None)
            return journal
        staged = _staging_files(cache_dir)
        if salvage is not None:
            marked = any(k == JOURNAL for k, _ in salvage.records.get(INFO, ()))
            whole = {INFO, *LEGACY} <= salvage.complete
            if staged and (marked or not whole):
                raise JournalDamaged(
                    f"the write-back journal {jpath} is missing and the damaged index could "
                    f"not tell which of the {len(staged)} staging files in "
                    f"{os.path.join(cache_dir, 'dirty')} are unsaved writes: {hint}")
            journal = Journal.open(jpath)
            self._migrate_legacy(journal, salvage)
            return journal
        if staged:
            raise JournalDamaged(
                f"the write-back journal {jpath} and the cache index are missing, and "
                f"{os.path.join(cache_dir, 'dirty')} holds {len(staged)} staging files that "
                f"may be unsaved writes: {hint}")
        return Journal.open(jpath)

    def _migrate_legacy(self, journal: Journal, salvage: Salvage | None) -> None:
        """Move an older index's journal databases (`dirty`, `uploads`) into the journal:
        written there (fsynced) before they are dropped here, so a crash repeats it."""
        legacy = salvage.records if salvage is not None else self.env.legacy_records()
        dirty, uploads = legacy.get(_DIRTY, []), legacy.get(_UPLOADS, [])
        moved = 0
        for k, v in dirty:
            try:
                ino, record = U64.unpack(k)[0], json.loads(v)
            except (struct.error, ValueError):
                log.error("write-back journal of the old index: an unreadable record was "
                          "left in %s", self.path)
                continue
            journal.put_dirty(ino, record, self.inodes.chain(ino) if salvage is None else [])
            moved += 1
        for k, v in uploads:
            journal.put_upload(bytes(k).decode(errors="replace"), bytes(v).decode(errors="replace"))
        if salvage is None and (dirty or uploads):
            self.env.drop_legacy()
        if moved:
            log.info("moved %d journaled files from the cache index to %s", moved, journal.path)

    # ---- across owners ---------------------------------------------------------------------

    def put_dirty(self, ino: int, record: dict) -> None:
        """Journal a file's unsaved writes; durable (fsynced) when this returns. The inode
        chain above it goes along, for a new index to give the file its number back."""
        self.journal.put_dirty(ino, record, self.inodes.chain(ino))

    def close(self) -> None:
        self.env.close()
        self.journal.close()
