"""The read walk over the tiers (tierfs/read/walk.py), as a tier's author sees it: a new
tier is one implementation of the Tier interface (tierfs/cache/tier.py) put in the list,
and the walk does the rest - asks it in order, keeps what it answered in the cache tiers,
fetches once however many readers want a chunk."""

from __future__ import annotations

import os

import pytest
import trio

from tierfs.cache import ObjectVersion
from tierfs.cache.tier import Want
from tierfs.errors import BackendUnavailable, RecentFailure

from unitkit import core, write

CS = 64 << 10  # unitkit's chunk size


class NearStore:
    """A tier a new deployment might add: an on-prem copy of some objects in front of the
    cloud bucket. Here a dict; it counts what it was asked and told."""

    name = "near"

    def __init__(self, chunks: dict[bytes, bytes] | None = None, fail: bool = False) -> None:
        self.chunks = chunks or {}
        self.fail = fail
        self.gets: list[int] = []
        self.puts: list[int] = []

    async def get(self, want: Want):
        self.gets.append(want.index)
        await trio.sleep(0.01)  # a network hop: concurrent readers overlap here
        if self.fail:
            raise BackendUnavailable("near store down")
        return self.chunks.get(want.ckey)

    async def put(self, want: Want, data) -> None:
        self.puts.append(want.index)


def _version(c, key: str) -> ObjectVersion:
    meta = c.backend.head(key)
    return ObjectVersion(c.io.bucket, meta.key, meta.etag, meta.size)


async def _stored(c) -> None:
    while len(c.walk.flights):
        await trio.sleep(0.01)


async def test_a_read_walks_memory_disk_then_the_store_and_fills_the_tiers_above(tmp_path):
    async with core(str(tmp_path), memory_bytes=4 * CS) as c:
        data = write(c.src, "f", os.urandom(2 * CS))
        obj = _version(c, "f")
        got = await c.walk.read(Want(obj, 1, access=True))
        assert (got.source, got.fetched, bytes(got.data)) == ("backend", True, data[CS:])
        await _stored(c)
        assert (await c.walk.read(Want(obj, 1))).source == "memory"
        c.core.cache.memory.drop_chunk(obj.chunk_key(1), c.core.cache.blocks_of(CS))
        got = await c.walk.read(Want(obj, 1, first=1, last=2))  # blocks 1..2 of 16 KiB
        assert (got.source, got.fetched) == ("disk", False)
        assert bytes(got.data) == data[CS + 16384:CS + 3 * 16384]
        # the disk tier's answer went up to the memory tier
        assert (await c.walk.read(Want(obj, 1, first=1, last=2))).source == "memory"
        assert c.gets() == 1


async def test_a_new_tier_is_one_implementation_in_the_list(tmp_path):
    async with core(str(tmp_path), memory_bytes=4 * CS) as c:
        data = write(c.src, "f", os.urandom(3 * CS))
        obj = _version(c, "f")
        near = NearStore({obj.chunk_key(0): data[:CS], obj.chunk_key(2): data[2 * CS:]})
        c.walk.sources.insert(0, near)  # before the store
        got = [await c.walk.read(Want(obj, i)) for i in range(3)]
        assert [g.source for g in got] == ["near", "backend", "near"]
        assert b"".join(bytes(g.data) for g in got) == data
        assert c.gets() == 1  # only the chunk the near store lacks came from the cloud
        assert near.puts == [1]  # it was told what the store answered for its miss
        await _stored(c)
        for i in range(3):  # all three kept by the cache tiers
            assert c.core.cache.has(obj.chunk_key(i))


async def test_one_fetch_however_many_readers_want_a_chunk(tmp_path):
    async with core(str(tmp_path), memory_bytes=4 * CS) as c:
        data = write(c.src, "f", os.urandom(CS))
        obj = _version(c, "f")
        near = NearStore({obj.chunk_key(0): data})
        c.walk.sources.insert(0, near)
        results = []

        async def reader() -> None:
            results.append(await c.walk.read(Want(obj, 0, access=True)))

        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(reader)
        assert near.gets == [0]
        assert all(bytes(r.data) == data for r in results)


async def test_a_failed_source_fails_the_read_and_is_remembered_briefly(tmp_path):
    async with core(str(tmp_path), memory_bytes=4 * CS) as c:
        write(c.src, "f", os.urandom(CS))
        obj = _version(c, "f")
        near = NearStore(fail=True)
        c.walk.sources.insert(0, near)
        with pytest.raises(BackendUnavailable):
            await c.walk.read(Want(obj, 0))
        with pytest.raises(RecentFailure):  # the kernel's re-ask: answered at once
            await c.walk.read(Want(obj, 0))
        assert near.gets == [0]
        assert not c.core.cache.has(obj.chunk_key(0))


async def test_a_reader_keeps_the_chunk_it_fetched_while_it_reads_it(tmp_path, monkeypatch):
    """Issue 26, M3: no memory tier to keep a fetched chunk and a disk tier that refuses it
    (as admission does when the cache is full of hotter data): a handle reading the chunk
    in pieces fetches it once, not once per piece (OwnChunk); elsewhere it lets it go."""
    async with core(str(tmp_path), memory_bytes=0, readahead=1) as c:
        data = write(c.src, "f", os.urandom(2 * CS))

        async def refused(*args, **kwargs) -> None:
            return None

        monkeypatch.setattr(c.core.cache, "fill", refused)
        node = await c.ns.lookup(1, b"f")
        h, _ = await c.io.open(node.ino)
        piece = CS // 4
        for off in (3 * piece, 2 * piece, piece):  # backwards: no read-ahead starts
            assert bytes(await c.io.read(h.fh, off, piece)) == data[off:off + piece]
            await _stored(c)
        assert c.gets() == 1
        for off in (CS + 3 * piece, CS + piece):
            assert bytes(await c.io.read(h.fh, off, piece)) == data[off:off + piece]
            await _stored(c)
        assert c.gets() == 2
        await c.io.release(h.fh)
