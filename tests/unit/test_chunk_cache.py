"""ChunkCache: memory tier over disk tier, corruption handling, recovery, persistence.

Built exactly as tierfs/mount/daemon.py builds it (MetaStore + DiskTier + MemoryTier + Evictor),
with a fake clock and a statvfs that always reports plenty of space.
"""

import logging
import os

import pytest

from tierfs.cache.heat import touched
from tierfs.cache.keys import ObjectVersion, chunk_name
from tierfs.index.env import CHUNK_FORMAT_KEY, INFO
from tierfs.index.meta import MetaStore

from unitkit import SOURCE, chunk_files, make_cache, sample

BS = 4096
CHUNK = 4 * BS
OBJ = ObjectVersion("bucket", "data.bin", "etag-1", 16 * CHUNK)


def chunk_data(index: int, length: int = CHUNK) -> bytes:
    return bytes([index % 251]) * 7 + os.urandom(length - 7)


def blocks(data: bytes, first: int, last: int) -> bytes:
    return data[first * BS:(last + 1) * BS]


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "cache")


async def test_fill_then_read_hits_memory(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=16 * CHUNK)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        assert await rig.cache.read(ckey, 0, 3, touch=True) is None
        rig.cache.keep(ckey, 0, -1, data, whole=True)  # what the walk does with fetched bytes
        await rig.cache.fill(OBJ, ckey, data)
        got, source = await rig.cache.read(ckey, 1, 2, touch=True)
        assert (got, source) == (blocks(data, 1, 2), "memory")
        assert sample(rig.metrics, "tierfs_cache_hits_total", {"tier": "memory"}) == 1
        assert sample(rig.metrics, "tierfs_cache_misses_total") == 1
        assert rig.cache.used_bytes == CHUNK
        assert chunk_files(root) == {chunk_name(ckey): CHUNK}
    finally:
        rig.close()


async def test_without_memory_tier_reads_hit_disk(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        ckey, data = OBJ.chunk_key(3), chunk_data(3)
        rig.cache.keep(ckey, 0, -1, data, whole=True)  # a no-op without a memory tier
        await rig.cache.fill(OBJ, ckey, data)
        for first, last in [(0, 3), (2, 2), (3, 3)]:
            got, source = await rig.cache.read(ckey, first, last, touch=True)
            assert source == "disk"
            assert got == blocks(data, first, last)
        assert sample(rig.metrics, "tierfs_cache_hits_total", {"tier": "disk"}) == 3
        assert rig.memory.bytes == 0
    finally:
        rig.close()


async def test_disk_hit_is_promoted_to_memory(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=16 * CHUNK)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        await rig.cache.fill(OBJ, ckey, data)  # not remembered: only on disk
        assert (await rig.cache.read(ckey, 0, 1, touch=True))[1] == "disk"
        assert await rig.cache.read(ckey, 0, 1, touch=True) == (blocks(data, 0, 1), "memory")
    finally:
        rig.close()


async def test_short_last_chunk_reads_back_exactly(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        ckey, data = OBJ.chunk_key(15), chunk_data(15, 2 * BS + 17)
        await rig.cache.fill(OBJ, ckey, data)
        got, _ = await rig.cache.read(ckey, 0, 2, touch=True)
        assert bytes(got) == data
        assert got[2 * BS:] == data[2 * BS:]
    finally:
        rig.close()


async def test_evicted_buffers_serve_later_reads_but_never_under_a_reader(root, monkeypatch):
    from tierfs.cache import disk as disk_mod
    monkeypatch.setattr(disk_mod, "_NOWAIT_MAX", 0)  # every read in read_blocks...
    monkeypatch.setattr(disk_mod, "REUSE_MIN", BS)  # ...into a reused buffer
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=2 * CHUNK)
    try:
        chunks = {i: chunk_data(i) for i in range(6)}
        for i, data in chunks.items():
            await rig.cache.fill(OBJ, OBJ.chunk_key(i), data)
        held, _ = await rig.cache.read(OBJ.chunk_key(0), 0, 3, touch=True)
        owners = set()
        for rnd in range(3):
            for i, data in chunks.items():  # each read evicts an older chunk from memory
                got, source = await rig.cache.read(OBJ.chunk_key(i), 0, 3, touch=True)
                assert got == data
                owners.add(id(got.obj))
                del got
        assert held == chunks[0]  # its buffer was never handed to another read
        assert len(owners) < 6 * 3  # evicted buffers were reused
    finally:
        rig.close()


async def test_corrupt_chunk_is_dropped_and_reported_as_a_miss(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        await rig.cache.fill(OBJ, ckey, data)
        await rig.cache.flush_index()
        path = rig.disk.path(ckey)
        with open(path, "r+b") as f:
            f.seek(BS + 10)
            f.write(bytes([data[BS + 10] ^ 0xFF]))

        assert await rig.cache.read(ckey, 0, 3, touch=True) is None
        assert sample(rig.metrics, "tierfs_cache_corrupt_chunks_total") == 1
        assert sample(rig.metrics, "tierfs_cache_misses_total") == 1
        assert not os.path.exists(path)
        assert not rig.cache.has(ckey)
        assert rig.cache.used_bytes == 0
        await rig.cache.flush_index()
        assert rig.meta.chunks.get(ckey) is None
        # the next fill stores the good bytes again
        await rig.cache.fill(OBJ, ckey, data)
        assert bytes((await rig.cache.read(ckey, 0, 3, touch=True))[0]) == data
    finally:
        rig.close()


async def test_missing_chunk_file_is_a_miss(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        await rig.cache.fill(OBJ, ckey, data)
        os.unlink(rig.disk.path(ckey))
        assert await rig.cache.read(ckey, 0, 0, touch=True) is None
        assert sample(rig.metrics, "tierfs_cache_corrupt_chunks_total") == 1
        assert not rig.cache.has(ckey)
    finally:
        rig.close()


async def test_corrupt_chunk_is_also_dropped_from_memory(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=2 * BS)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        await rig.cache.fill(OBJ, ckey, data)
        assert (await rig.cache.read(ckey, 0, 0, touch=True))[1] == "disk"  # block 0 in memory
        os.truncate(rig.disk.path(ckey), BS)
        assert await rig.cache.read(ckey, 1, 3, touch=True) is None
        assert rig.memory.get((ckey, 0)) is None
    finally:
        rig.close()


async def fill_some(rig, n):
    out = {}
    for i in range(n):
        ckey, data = OBJ.chunk_key(i), chunk_data(i, CHUNK - i)  # distinct lengths
        await rig.cache.fill(OBJ, ckey, data)
        out[ckey] = data
    await rig.cache.flush_index()
    return out


async def test_recover_keeps_indexed_chunks_and_drops_the_rest(root):
    rig = make_cache(root, cache_size=64 * CHUNK)
    filled = await fill_some(rig, 6)
    rig.close()
    k = list(filled)
    orphan = ObjectVersion("bucket", "other", "e", CHUNK).chunk_key(0)
    rig.disk.write(orphan, b"never indexed: a crash before the flush")
    os.unlink(rig.disk.path(k[1]))                      # indexed, file missing
    os.truncate(rig.disk.path(k[2]), 10)                # indexed, wrong size
    with open(rig.disk.path(k[3]), "ab") as f:          # indexed, wrong size (longer)
        f.write(b"x")
    with open(os.path.join(rig.disk.tmp_dir, "partial"), "wb") as f:
        f.write(b"torn write")

    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        kept, dropped = rig.cache.recover()
        assert kept == 3
        assert dropped == 4  # three bad entries and one orphan
        survivors = [k[0], k[4], k[5]]
        for key in survivors:
            assert rig.cache.has(key)
            got, source = await rig.cache.read(key, 0, 3, touch=True)
            assert (bytes(got), source) == (filled[key], "disk")
        for key in (k[1], k[2], k[3]):
            assert not rig.cache.has(key)
        assert rig.cache.used_bytes == sum(len(filled[key]) for key in survivors)
        assert not os.path.exists(rig.disk.path(orphan))
        assert os.listdir(rig.disk.tmp_dir) == []
        assert [key for key, _ in rig.meta.chunks.all()] == sorted(survivors)
        assert sample(rig.metrics, "tierfs_cache_bytes", {"tier": "disk"}) == rig.cache.used_bytes
    finally:
        rig.close()


async def test_recover_deletes_the_file_of_an_entry_it_drops(root):
    # A wrong-size file loses its index entry but stays on disk, counted nowhere, until
    # some later restart finds it as an orphan.
    rig = make_cache(root, cache_size=64 * CHUNK)
    filled = await fill_some(rig, 2)
    rig.close()
    bad = list(filled)[0]
    os.truncate(rig.disk.path(bad), 10)

    rig = make_cache(root, cache_size=64 * CHUNK)
    try:
        rig.cache.recover()
        assert not rig.cache.has(bad)
        assert not os.path.exists(rig.disk.path(bad))
        assert sum(chunk_files(root).values()) == rig.cache.used_bytes
    finally:
        rig.close()


async def test_flush_index_persists_heat_and_last_access(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0, half_life=100.0)
    t0 = rig.clock.now
    hot, cold = OBJ.chunk_key(0), OBJ.chunk_key(1)
    await rig.cache.fill(OBJ, hot, chunk_data(0))
    await rig.cache.fill(OBJ, cold, chunk_data(1))
    expected_heat, last = 1.0, t0
    for _ in range(4):
        rig.clock.advance(10)
        await rig.cache.read(hot, 0, 0, touch=True)
        expected_heat, last = touched(expected_heat, last, rig.clock.now, 100.0), rig.clock.now
    await rig.cache.read(cold, 0, 0, touch=False)  # a read-ahead: not an access
    await rig.cache.flush_index()
    rig.close()

    meta = MetaStore(os.path.join(root, "index"), SOURCE, map_size=64 << 20)
    try:
        stored = {k: (r.heat, r.last_access) for k, r in meta.chunks.all()}
    finally:
        meta.close()
    assert stored[hot] == (pytest.approx(expected_heat), t0 + 40)
    assert stored[cold] == (1.0, t0)
    assert expected_heat > 4  # four touches on top of the fill, barely decayed

    rig = make_cache(root, cache_size=64 * CHUNK, clock=rig.clock, half_life=100.0)
    try:
        assert rig.cache.recover() == (2, 0)
        # the recovered heat is what eviction then sorts on: touch once more and flush
        rig.clock.advance(100)
        await rig.cache.read(hot, 0, 0, touch=True)
        await rig.cache.flush_index()
        assert rig.meta.chunks.get(hot).heat == pytest.approx(expected_heat / 2 + 1)
    finally:
        rig.close()


async def test_nothing_persists_without_a_flush(root):
    rig = make_cache(root, cache_size=64 * CHUNK)
    await rig.cache.fill(OBJ, OBJ.chunk_key(0), chunk_data(0))
    rig.close()
    rig = make_cache(root, cache_size=64 * CHUNK)
    try:
        assert rig.cache.recover() == (0, 1)  # the unflushed file is an orphan
        assert chunk_files(root) == {}
    finally:
        rig.close()


async def test_flush_records_the_object_of_each_chunk(root):
    rig = make_cache(root, cache_size=64 * CHUNK)
    try:
        await rig.cache.fill(OBJ, OBJ.chunk_key(0), chunk_data(0))
        await rig.cache.flush_index()
        assert rig.meta.chunks.object_info(OBJ.oid) == {"bucket": "bucket", "key": "data.bin",
                                                 "etag": "etag-1", "size": OBJ.size}
    finally:
        rig.close()


async def test_second_fill_of_a_cached_chunk_is_ignored(root):
    rig = make_cache(root, cache_size=64 * CHUNK, memory_bytes=0)
    try:
        ckey, data = OBJ.chunk_key(0), chunk_data(0)
        await rig.cache.fill(OBJ, ckey, data)
        await rig.cache.fill(OBJ, ckey, data)
        assert rig.cache.used_bytes == CHUNK
    finally:
        rig.close()


async def test_chunk_records_of_an_older_cache_format_are_dropped_at_mount(root, caplog):
    # a cache dir written by a tierfs whose chunk CRCs were zlib's CRC32 (no chunk_format
    # in info): its records are dropped, the files deleted, the chunks fetched again; the
    # journal of unsaved writes is not the index's to drop
    rig = make_cache(root, cache_size=64 * CHUNK)
    filled = await fill_some(rig, 3)
    rig.meta.put_dirty(42, {"size": 5})
    with rig.meta.env.begin(write=True, db=rig.meta.env.db(INFO)) as txn:
        txn.delete(CHUNK_FORMAT_KEY)
    rig.close()

    caplog.set_level(logging.INFO, logger="tierfs.index.chunks")
    rig = make_cache(root, cache_size=64 * CHUNK)
    try:
        said = [r.getMessage() for r in caplog.records if "cache format" in r.getMessage()]
        assert len(said) == 1 and "3 chunk records of cache format 1 dropped" in said[0]
        assert list(rig.meta.chunks.all()) == []
        assert rig.cache.recover() == (0, 3)
        assert chunk_files(root) == {}
        for key in filled:
            assert await rig.cache.read(key, 0, 3, touch=True) is None
        assert [ino for ino, _ in rig.meta.journal.dirty_records()] == [42]
        await fill_some(rig, 1)
    finally:
        rig.close()

    caplog.clear()
    rig = make_cache(root, cache_size=64 * CHUNK)  # the next mount keeps what it filled
    try:
        assert not [r for r in caplog.records if "cache format" in r.getMessage()]
        assert rig.cache.recover() == (1, 0)
    finally:
        rig.close()
