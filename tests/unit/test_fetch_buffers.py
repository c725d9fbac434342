"""Chunks fetched from the store go into the disk tier's reused read buffers
(tierfs/read/sources.py, `StoreSource.get`): a buffer serves another GET only once nothing can see its bytes, so a
reader holding a chunk's bytes never sees them change; small chunks are plain bytes."""

from __future__ import annotations

import os

import trio

from tierfs.cache import ObjectVersion
from tierfs.cache.disk import REUSE_MIN

from unitkit import chunk, core, write

CHUNK = 2 * REUSE_MIN  # big enough to be fetched into a reused buffer


def _objects(src: str, n: int) -> list[bytes]:
    return [write(src, f"f{i}.bin", os.urandom(CHUNK)) for i in range(n)]


def _version(c, i: int) -> ObjectVersion:
    meta = c.backend.head(f"f{i}.bin")
    return ObjectVersion(c.io.bucket, meta.key, meta.etag, meta.size)


async def _settled(c) -> None:
    while len(c.walk.flights):  # the fills hold the bytes until the disk tier has them
        await trio.sleep(0.01)


async def test_a_fetched_chunk_is_a_read_only_view_and_its_buffer_is_reused(tmp_path):
    # a memory tier of one chunk: each fetch pushes the last one out, giving its buffer back
    async with core(str(tmp_path), chunk_size=CHUNK, memory_bytes=CHUNK) as c:
        datas = _objects(c.src, 4)
        first = await chunk(c.walk, _version(c, 0), 0)
        assert isinstance(first, memoryview) and first.readonly and first == datas[0]
        owner = first.obj
        del first
        await _settled(c)
        second = await chunk(c.walk, _version(c, 1), 0)
        await _settled(c)
        assert second == datas[1]
        del second
        third = await chunk(c.walk, _version(c, 2), 0)
        assert third == datas[2]
        assert third.obj is owner  # chunk 0's buffer, free once nothing saw it, reused


async def test_a_buffer_a_reader_still_holds_is_never_reused(tmp_path):
    async with core(str(tmp_path), chunk_size=CHUNK, memory_bytes=CHUNK) as c:
        datas = _objects(c.src, 6)
        held = (await chunk(c.walk, _version(c, 0), 0))[100:200]  # a reply in flight
        seen = {held.obj}
        for i in range(1, 6):  # each evicts the one before from the memory tier
            got = await chunk(c.walk, _version(c, i), 0)
            await _settled(c)
            assert got == datas[i]
            assert got.obj is not held.obj
            seen.add(got.obj)
            del got
        assert held == datas[0][100:200]  # its bytes never changed
        assert len(seen) < 6  # the others' buffers were reused meanwhile


async def test_small_chunks_are_plain_bytes(tmp_path):
    async with core(str(tmp_path), chunk_size=REUSE_MIN // 2) as c:
        data = write(c.src, "small.bin", os.urandom(REUSE_MIN // 2))
        meta = c.backend.head("small.bin")
        got = await chunk(c.walk, ObjectVersion(c.io.bucket, meta.key, meta.etag, meta.size), 0)
        assert not isinstance(got, memoryview) and got == data


def test_bytes_in_flight_are_reserved_in_the_memory_tier():
    from tierfs.cache.memory import WHOLE, MemoryTier

    released = []
    tier = MemoryTier(3 * 100)
    tier.released = released.append
    bufs = [memoryview(bytearray(100)).toreadonly() for _ in range(3)]
    for i, b in enumerate(bufs):
        tier.put((b"c%d" % i, WHOLE), b)
    assert tier.reserve(150)  # two entries leave for it now, oldest first
    assert tier.bytes == 100 + 150 <= tier.capacity
    assert tier.get((b"c0", WHOLE)) is None and tier.get((b"c1", WHOLE)) is None
    assert [r for r in released] == [bufs[0].obj, bufs[1].obj]
    tier.unreserve(150)
    assert tier.bytes == 100
    assert not tier.reserve(301)  # could never be kept: not counted, nothing evicted
    assert tier.bytes == 100 and tier.get((b"c2", WHOLE)) is not None
    assert not MemoryTier(0).reserve(1)
