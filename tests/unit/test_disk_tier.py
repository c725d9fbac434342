"""DiskTier: chunk files verified per block; any damage is CacheCorrupt, never bad bytes."""

import os

import google_crc32c
import pytest

from tierfs.cache import disk as disk_mod
from tierfs.cache.disk import DiskTier, block_crcs
from tierfs.cache.keys import ObjectVersion, chunk_index, chunk_name
from tierfs.errors import CacheCorrupt

BS = 4096
OBJ = ObjectVersion("bucket", "dir/file.bin", "etag-1", 10 * BS)


@pytest.fixture
def disk(tmp_path):
    return DiskTier(str(tmp_path), BS)


def written(disk, index=0, length=3 * BS + 100):
    data = os.urandom(length)
    ckey = OBJ.chunk_key(index)
    crcs = disk.write(ckey, data)
    return ckey, data, crcs


def test_chunk_keys_are_versioned():
    other_etag = ObjectVersion("bucket", "dir/file.bin", "etag-2", 10 * BS)
    assert OBJ.chunk_key(0) != other_etag.chunk_key(0)
    assert OBJ.chunk_key(0) != OBJ.chunk_key(1)
    assert chunk_index(OBJ.chunk_key(7)) == 7
    assert chunk_name(OBJ.chunk_key(7)) == OBJ.oid.hex() + ".7"


def test_write_then_read_every_block_range(disk):
    ckey, data, crcs = written(disk)
    assert len(crcs) == 4
    blocks = [data[i:i + BS] for i in range(0, len(data), BS)]
    for first in range(4):
        for last in range(first, 4):
            got = disk.read_blocks(ckey, len(data), crcs, first, last)
            assert got == b"".join(blocks[first:last + 1])


def test_single_block_chunk(disk):
    ckey, data, crcs = written(disk, length=100)
    assert disk.read_blocks(ckey, len(data), crcs, 0, 0) == data


def test_write_leaves_nothing_in_tmp(disk):
    written(disk)
    assert os.listdir(disk.tmp_dir) == []
    assert os.path.getsize(disk.path(OBJ.chunk_key(0))) == 3 * BS + 100


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("offset", [0, BS - 1, BS, 3 * BS + 99])
def test_flipped_byte_is_cache_corrupt(disk, offset):
    ckey, data, crcs = written(disk)
    flip_byte(disk.path(ckey), offset)
    with pytest.raises(CacheCorrupt):
        disk.read_blocks(ckey, len(data), crcs, 0, 3)
    bad = offset // BS
    with pytest.raises(CacheCorrupt, match=f"block {bad}"):
        disk.read_blocks(ckey, len(data), crcs, bad, bad)


def test_blocks_not_read_are_not_judged(disk):
    ckey, data, crcs = written(disk)
    flip_byte(disk.path(ckey), 3 * BS + 5)
    assert disk.read_blocks(ckey, len(data), crcs, 0, 1) == data[:2 * BS]


@pytest.mark.parametrize("keep", [0, 1, BS, 3 * BS + 99])
def test_truncated_file_is_cache_corrupt(disk, keep):
    ckey, data, crcs = written(disk)
    os.truncate(disk.path(ckey), keep)
    with pytest.raises(CacheCorrupt):
        disk.read_blocks(ckey, len(data), crcs, 0, 3)


def test_missing_file_is_cache_corrupt(disk):
    ckey, data, crcs = written(disk)
    os.unlink(disk.path(ckey))
    with pytest.raises(CacheCorrupt, match="missing"):
        disk.read_blocks(ckey, len(data), crcs, 0, 0)


def test_file_swapped_for_another_chunk_is_cache_corrupt(disk):
    ckey, data, crcs = written(disk, index=0)
    other, _, _ = written(disk, index=1)
    os.replace(disk.path(other), disk.path(ckey))
    with pytest.raises(CacheCorrupt):
        disk.read_blocks(ckey, len(data), crcs, 0, 3)


def test_delete_and_scan(disk):
    keys = [written(disk, index=i, length=BS + i)[0] for i in range(3)]
    with open(os.path.join(disk.tmp_dir, "leftover"), "wb") as f:
        f.write(b"half a chunk")
    disk.delete(keys[1])
    disk.delete(keys[1])  # deleting twice is fine
    assert disk.scan() == {chunk_name(keys[0]): BS, chunk_name(keys[2]): BS + 2}
    assert os.listdir(disk.tmp_dir) == []
    disk.delete_name(chunk_name(keys[0]))
    assert disk.scan() == {chunk_name(keys[2]): BS + 2}


@pytest.mark.parametrize("length", [0, 1, BS, 3 * BS + 100])
@pytest.mark.parametrize("c_path", [True, False])
def test_block_crcs_are_crc32c_of_each_block(monkeypatch, length, c_path):
    if not c_path:
        monkeypatch.setattr(disk_mod, "_CRC", None)
    data = os.urandom(length)
    want = [google_crc32c.value(data[i:i + BS]) for i in range(0, max(length, 1), BS)]
    for form in (data, bytearray(data), memoryview(bytearray(data))):
        assert block_crcs(form, BS) == want


def test_reads_from_the_page_cache_without_blocking_verify_too(disk):
    ckey, data, crcs = written(disk)
    assert disk.read_cached(ckey, len(data), crcs, 0, 0) is None  # no open fd yet
    assert disk.read_blocks(ckey, len(data), crcs, 0, 3) == data  # opens and keeps it
    assert disk_mod._RWF_NOWAIT, "Linux >= 4.14 with Python >= 3.7 has RWF_NOWAIT"
    got = disk.read_cached(ckey, len(data), crcs, 1, 2)
    assert got is not None and got.readonly and got == data[BS:3 * BS]
    flip_byte(disk.path(ckey), 2 * BS + 1)  # in place: the kept fd sees it
    with pytest.raises(CacheCorrupt, match="block 2"):
        disk.read_cached(ckey, len(data), crcs, 1, 2)


def test_open_files_are_bounded_and_closed_when_chunks_go(tmp_path):
    disk = DiskTier(str(tmp_path), BS, open_files=2)
    chunks = [written(disk, index=i) for i in range(3)]
    for ckey, data, crcs in chunks:
        assert disk.read_blocks(ckey, len(data), crcs, 0, 0) == data[:BS]
    assert len(disk._fds) == 2
    disk.delete(chunks[2][0])  # evicted: its fd must not keep the file's space
    assert len(disk._fds) == 1
    ckey, data, crcs = chunks[1]
    new = disk.write(ckey, data)  # the chunk written again replaces the file
    assert len(disk._fds) == 0 and new == crcs
    assert disk.read_blocks(ckey, len(data), crcs, 0, 3) == data
    disk.close()
    assert len(disk._fds) == 0


# ---- big reads into reused buffers ------------------------------------------------------


@pytest.fixture
def reusing(monkeypatch):
    monkeypatch.setattr(disk_mod, "REUSE_MIN", BS)  # every read goes into a reused buffer


def test_a_read_buffer_is_reused_only_once_no_view_of_it_is_left(disk, reusing):
    a, data_a, crcs_a = written(disk, 0)
    b, data_b, crcs_b = written(disk, 1)
    got = disk.read_blocks(a, len(data_a), crcs_a, 0, 3)
    assert got == data_a and got.readonly
    owner, piece = got.obj, got[BS:2 * BS]  # a reader still holds part of it
    del got
    disk.reuse(owner)
    other = disk.read_blocks(b, len(data_b), crcs_b, 0, 3)
    assert other.obj is not owner and other == data_b
    assert piece == data_a[BS:2 * BS]
    del piece  # the last view: now it may serve another read
    disk.reuse(owner)
    again = disk.read_blocks(b, len(data_b), crcs_b, 0, 3)  # a read of the same size
    assert again.obj is owner and again == data_b


def test_a_reused_buffer_never_serves_a_damaged_block(disk, reusing):
    a, data_a, crcs_a = written(disk, 0)
    b, data_b, crcs_b = written(disk, 1)
    got = disk.read_blocks(a, len(data_a), crcs_a, 0, 3)
    owner = got.obj
    del got
    disk.reuse(owner)
    flip_byte(disk.path(b), 2 * BS + 1)
    with pytest.raises(CacheCorrupt, match="block 2"):
        disk.read_blocks(b, len(data_b), crcs_b, 0, 3)  # into owner, over a's bytes
    os.truncate(disk.path(b), BS)
    with pytest.raises(CacheCorrupt, match="short"):
        disk.read_blocks(b, len(data_b), crcs_b, 0, 3)
    again = disk.read_blocks(a, len(data_a), crcs_a, 0, 3)
    assert again.obj is owner and again == data_a
