"""Staging: the bytes of files being written (CACHE_DIR/dirty/) and their journal records.

A DirtyFile's staging file is sparse: it holds every chunk a writer touched
("materialized"); the chunks nobody touched are read from the base version (the object
as it was when opened) through the chunk cache. A partial write into a base chunk reads
that chunk first. Every materialized chunk counts against the cache budget as unsaved
(never evicted); a writer waits up to --dirty-wait for room, then gets ENOSPC.

The journal record of a file (tierfs/index/journal.py through MetaStore) says what a restart
must upload: key, base, size, which chunks are in the staging file, metadata. It is
written after the staging file is fsynced, so a record never names bytes not on disk.
No locking here: WriteBack calls in with the file's lock held.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Awaitable, Callable

import trio

from ..cache import ChunkCache, ObjectVersion
from ..cachedir import Layout
from ..errors import BaseChanged, NoSpace, PreconditionFailed
from ..index.meta import MetaStore
from .dirty import DirtyFile, State, staging_io, uncover

log = logging.getLogger("tierfs.writeback")

ReadBase = Callable[[ObjectVersion, int], Awaitable[bytes | bytearray | memoryview]]


class Staging:
    def __init__(self, meta: MetaStore, cache: ChunkCache, *, cache_dir: str,
                 chunk_size: int, part_size: int, dirty_wait_s: float,
                 read_base: ReadBase) -> None:
        self.meta = meta
        self.cache = cache
        self.chunk_size = chunk_size
        self.part_size = part_size
        self.dirty_wait_s = dirty_wait_s
        self.read_base = read_base
        self.dir = Layout(cache_dir).dirty
        os.makedirs(self.dir, exist_ok=True)

    def create(self, ino: int, key: str, base: ObjectVersion | None,
               metadata: dict[str, str]) -> DirtyFile:
        path = os.path.join(self.dir, f"{ino}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        size = 0 if base is None else base.size
        d = DirtyFile(ino, key, base, size, size, path, fd, dict(metadata))
        if base is not None:
            d.generation = d.saved_generation = 1  # nothing written yet
            d.state = State.CLEAN
        return d

    async def write(self, d: DirtyFile, offset: int, data: bytes) -> None:
        """Bytes into the staging file; the chunks they partly cover are read first."""
        end = offset + len(data)
        cs = self.chunk_size
        for index in range(offset // cs, (end - 1) // cs + 1):
            if index not in d.materialized:
                await self._materialize(d, index, offset, end)
        self._changing(d, offset, end)  # before: a failed pwrite may leave some bytes
        staging_io(os.pwrite, d.fd, data, offset)
        d.size = max(d.size, end)

    def truncate(self, d: DirtyFile, size: int) -> None:
        # past the new size the staging file reads zeros, and base_valid keeps the base
        # from showing through: a later extension reads zeros, as POSIX wants
        staging_io(os.ftruncate, d.fd, size)
        if size < d.size:
            cs = self.chunk_size
            self._changing(d, size, d.size)
            if d.covered:
                uncover(d.covered, size)
            d.base_valid = min(d.base_valid, size)
            gone = {i for i in d.materialized if i * cs >= size}
            d.materialized -= gone
            self.cache.release_dirty(len(gone) * cs, key=d.key)
        d.size = size

    def _changing(self, d: DirtyFile, start: int, end: int) -> None:
        """Bytes [start, end) are about to change: parts sent with the old ones are stale."""
        ps = self.part_size
        for n in range(start // ps, (end - 1) // ps + 1):
            d.part_changes[n] = d.part_changes.get(n, 0) + 1

    async def _materialize(self, d: DirtyFile, index: int, wstart: int, wend: int) -> None:
        cs = self.chunk_size
        if not await self.cache.reserve_dirty(cs, self.dirty_wait_s, key=d.key):
            log.error("write to %r refused (ENOSPC): unsaved writes would exceed the cache "
                      "budget and no upload freed space within %.0fs", d.key, self.dirty_wait_s)
            raise NoSpace(f"cache budget full of unsaved writes ({self.cache.dirty_bytes} bytes)")
        start = index * cs
        base_end = min(start + cs, d.base_valid)
        try:
            # bytes of the base in this chunk that the write does not cover must be kept
            if (d.base is not None and base_end > start
                    and not (wstart <= start and wend >= base_end)):
                data = await self.read_base(d.base, index)
                staging_io(os.pwrite, d.fd, data[:base_end - start], start)
        except BaseException:
            self.cache.release_dirty(cs, key=d.key)  # the chunk never became dirty
            raise
        d.materialized.add(index)

    async def own_base(self, d: DirtyFile) -> None:
        """Take into the staging file every chunk of the base version the writes left
        alone, so that what is uploaded is the version the writer saw, whatever another
        client does to the object meanwhile (a server-side copy needs that version on the
        store). BaseChanged when the base is gone and this node does not hold its bytes."""
        if d.base is None:
            return
        cs = self.chunk_size
        for index in range(-(-min(d.base_valid, d.size) // cs)):
            if index not in d.materialized:
                try:
                    await self._materialize(d, index, 0, 0)
                except PreconditionFailed:
                    raise BaseChanged(
                        f"{d.key!r} was replaced on the store since it was opened, and the "
                        f"part of it the writes left alone is not on this node: the "
                        f"writes cannot be saved; reopen the file") from None

    async def read(self, d: DirtyFile, offset: int, size: int) -> bytes:
        end = min(offset + size, d.size)
        cs = self.chunk_size
        out: list[bytes | bytearray | memoryview] = []
        for index in range(offset // cs, (max(end, offset + 1) - 1) // cs + 1):
            lo, hi = max(offset, index * cs), min(end, (index + 1) * cs)
            if lo >= hi:
                break
            if index in d.materialized:
                piece = staging_io(os.pread, d.fd, hi - lo, lo)
                out.append(piece + bytes(hi - lo - len(piece)))  # a hole past EOF reads zeros
                continue
            based = max(lo, min(hi, d.base_valid))  # [lo, based) comes from the base
            if d.base is not None and based > lo:
                chunk = await self.read_base(d.base, index)
                out.append(chunk[lo - index * cs:based - index * cs])
            out.append(bytes(hi - based))
        return b"".join(out)

    async def journal(self, d: DirtyFile) -> None:
        """The file as it stands is what a restart uploads: staging file fsynced first."""
        await trio.to_thread.run_sync(os.fsync, d.fd)
        await trio.to_thread.run_sync(self.meta.put_dirty, d.ino, d.record())
        d.journaled = True
        if d.state is State.STAGED:
            d.to(State.JOURNALED)

    async def unjournal(self, d: DirtyFile) -> None:
        """Uploaded: the staging file is no longer the only copy."""
        if d.journaled:
            await trio.to_thread.run_sync(self.meta.journal.delete_dirty, d.ino)
            d.journaled = False

    def delete(self, d: DirtyFile) -> None:
        """The staging file, its budget and its journal record go."""
        unsaved = len(d.materialized) * self.chunk_size
        if d.uploaded is None:
            self.cache.release_dirty(unsaved, key=d.key)
        else:  # superseded before its chunks moved: nothing to keep
            self.cache.release_held(unsaved, key=d.key)
            d.uploaded = None
        os.close(d.fd)
        os.unlink(d.staging)
        if d.journaled:
            self.meta.journal.delete_dirty(d.ino)
