"""The write-back journal (tierfs/index/journal.py): an fsynced append-only file beside the index.

It must give back every acknowledged record after a crash, tolerate only what a crash can
do (a torn last append), refuse anything else with an error naming the file, stay small
(compaction), and take over an older cache dir's journal from the LMDB index.
"""

import errno
import json
import os
from pathlib import Path

import lmdb
import pytest

from tierfs.index import journal as journal_mod
from tierfs.errors import NoSpace, StartupError
from tierfs.index.journal import HEADER, Journal, JournalDamaged, scan_file
from tierfs.index.attrs import FILE
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore

SRC = "s3://bucket/"


def record(key: str, staging: str = "/nonexistent", size: int = 10) -> dict:
    return {"key": key, "base": None, "base_valid": 0, "size": size, "staging": staging,
            "materialized": [0], "metadata": {}, "upload_id": None}


@pytest.fixture
def jpath(tmp_path):
    return str(tmp_path / "journal")


def test_records_survive_reopen_in_their_last_state(jpath):
    j = Journal.open(jpath)
    j.put_dirty(7, record("a"))
    j.put_dirty(8, record("b"))
    j.put_dirty(7, record("a", size=99))  # a later generation replaces the earlier
    j.delete_dirty(8)
    j.put_upload("u1", "a")
    j.put_upload("u2", "b")
    j.delete_upload("u2")
    j.close()

    j = Journal.open(jpath)
    try:
        assert j.dirty_records() == [(7, record("a", size=99))]
        assert j.uploads() == [("u1", "a")]
    finally:
        j.close()


def test_a_new_journal_is_created_durable_and_empty(jpath):
    j = Journal.open(jpath)
    j.close()
    assert Path(jpath).read_bytes() == HEADER
    assert Journal.open(jpath).dirty_records() == []


def test_a_torn_last_record_is_dropped_and_the_rest_kept(jpath, caplog):
    j = Journal.open(jpath)
    j.put_dirty(1, record("kept"))
    j.put_dirty(2, record("torn"))
    j.close()
    size = os.path.getsize(jpath)
    with open(jpath, "r+b") as f:
        f.truncate(size - 5)  # the crash came before the last append was whole

    j = Journal.open(jpath)
    try:
        assert j.dirty_records() == [(1, record("kept"))]
        assert "torn last record" in caplog.text
        j.put_dirty(3, record("next"))  # appends after the cut are readable
    finally:
        j.close()
    assert scan_file(jpath).clean and scan_file(jpath).torn_at is None
    assert [i for i, _ in Journal.open(jpath).dirty_records()] == [1, 3]


def test_zeros_at_the_end_are_a_torn_tail_too(jpath):
    j = Journal.open(jpath)
    j.put_dirty(1, record("kept"))
    j.close()
    with open(jpath, "ab") as f:
        f.write(bytes(4096))  # a filesystem extended the file before the data landed
    assert Journal.open(jpath).dirty_records() == [(1, record("kept"))]


def test_a_corrupt_record_in_the_middle_is_an_error_naming_the_file(jpath):
    j = Journal.open(jpath)
    for ino in (1, 2, 3):
        j.put_dirty(ino, record(f"f{ino}"))
    j.close()
    data = bytearray(Path(jpath).read_bytes())
    data[len(HEADER) + 20] ^= 0x40  # inside the first record's body
    Path(jpath).write_bytes(data)

    with pytest.raises(JournalDamaged) as err:
        Journal.open(jpath)
    msg = str(err.value)
    assert jpath in msg and "fsck" in msg and "operations.md" in msg
    assert isinstance(err.value, StartupError)
    # nothing was rewritten: the damaged bytes are still there for fsck to salvage
    assert Path(jpath).read_bytes() == bytes(data)
    scan = scan_file(jpath)
    assert [op["ino"] for _, op in scan.ops] == [2, 3]  # the records after it are found


def test_a_whole_last_record_that_fails_its_crc_is_damage_not_a_torn_tail(jpath):
    j = Journal.open(jpath)
    j.put_dirty(1, record("a"))
    j.put_dirty(2, record("acknowledged"))
    j.close()
    data = bytearray(Path(jpath).read_bytes())
    data[-3] ^= 0x01  # bit rot in an fsynced record: its writer was told it was saved
    Path(jpath).write_bytes(data)
    with pytest.raises(JournalDamaged, match="fail their checksum"):
        Journal.open(jpath)


def test_a_last_record_whose_blocks_never_landed_is_torn(jpath):
    j = Journal.open(jpath)
    j.put_dirty(1, record("a"))
    j.put_dirty(2, record("b"))
    j.close()
    data = bytearray(Path(jpath).read_bytes())
    data[-40:] = bytes(40)  # the size was extended, the last block is zeros
    Path(jpath).write_bytes(data)
    assert [i for i, _ in Journal.open(jpath).dirty_records()] == [1]


def test_a_foreign_file_is_damage_not_an_empty_journal(jpath):
    with open(jpath, "wb") as f:
        f.write(b"this is not a journal\n" * 10)
    with pytest.raises(JournalDamaged, match="journal"):
        Journal.open(jpath)


def test_compaction_keeps_the_file_small_and_the_state_whole(jpath, monkeypatch):
    monkeypatch.setattr(journal_mod, "COMPACT_MIN", 4 << 10)
    j = Journal.open(jpath)
    j.put_dirty(1, record("stays"))
    grew = 0
    for n in range(100):  # files journaled and uploaded, one after another
        j.put_dirty(100 + n, record(f"tmp{n}"))
        j.delete_dirty(100 + n)
        if n % 10 == 0:
            j.put_upload(f"u{n}", f"tmp{n}")
            j.delete_upload(f"u{n}")
        grew = max(grew, os.path.getsize(jpath))
    j.put_upload("live", "stays")
    j.close()
    assert grew < 4 * (4 << 10) + 1024  # about 40 KiB were appended in all
    j = Journal.open(jpath)
    try:
        assert j.dirty_records() == [(1, record("stays"))]
        assert j.uploads() == [("live", "stays")]
    finally:
        j.close()


def test_a_failed_append_is_not_acknowledged_and_leaves_no_partial_record(jpath, monkeypatch):
    j = Journal.open(jpath)
    j.put_dirty(1, record("a"))
    real = os.fdatasync
    calls = {"n": 0}

    def failing(fd):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(journal_mod.os, "fdatasync", failing)
    with pytest.raises(NoSpace):
        j.put_dirty(2, record("b"))
    monkeypatch.setattr(journal_mod.os, "fdatasync", real)
    assert [i for i, _ in j.dirty_records()] == [1]
    j.put_dirty(3, record("c"))
    j.close()
    scan = scan_file(jpath)
    assert scan.clean and scan.torn_at is None
    assert [i for i, _ in Journal.open(jpath).dirty_records()] == [1, 3]


# ---- through MetaStore --------------------------------------------------------------------


def open_store(tmp_path, source=SRC):
    return MetaStore(str(tmp_path / "index"), source, map_size=64 << 20)


def test_metastore_keeps_the_journal_beside_the_index(tmp_path):
    m = open_store(tmp_path)
    node = m.inodes.upsert(ROOT_INO, b"f", FILE, 1, 1.0, "e", "f", 1.0)
    m.put_dirty(node.ino, record("f"))
    m.journal.put_upload("up", "f")
    m.close()
    assert os.path.exists(tmp_path / "journal")
    m = open_store(tmp_path)
    try:
        assert m.journal.dirty_records() == [(node.ino, record("f"))]
        assert m.journal.uploads() == [("up", "f")]
        m.journal.delete_dirty(node.ino)
        m.journal.delete_upload("up")
        assert m.journal.dirty_records() == [] and m.journal.uploads() == []
    finally:
        m.close()


def test_a_damaged_journal_stops_the_start_and_leaves_the_index_alone(tmp_path):
    m = open_store(tmp_path)
    m.put_dirty(5, record("x"))
    m.put_dirty(6, record("y"))
    m.close()
    path = str(tmp_path / "journal")
    data = bytearray(Path(path).read_bytes())
    data[len(HEADER) + 30] ^= 1
    Path(path).write_bytes(data)
    with pytest.raises(StartupError, match="journal"):
        open_store(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["index", "journal"]


def _old_format_index(tmp_path, dirty: dict[int, dict], uploads: dict[str, str]) -> None:
    """An index as tierfs wrote it before the journal had its own file."""
    m = open_store(tmp_path)
    m.close()
    os.unlink(tmp_path / "journal")
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.delete(b"journal", db=env.open_db(b"info", txn=txn))
        d = env.open_db(b"dirty", txn=txn)
        u = env.open_db(b"uploads", txn=txn)
        for ino, rec in dirty.items():
            txn.put(ino.to_bytes(8, "big"), json.dumps(rec).encode(), db=d)
        for uid, key in uploads.items():
            txn.put(uid.encode(), key.encode(), db=u)
    env.close()


def test_an_old_cache_dirs_journal_moves_out_of_the_index(tmp_path):
    _old_format_index(tmp_path, {9: record("old")}, {"up9": "old"})
    os.makedirs(tmp_path / "dirty")
    open(tmp_path / "dirty" / "9-abc", "wb").close()
    m = open_store(tmp_path)
    try:
        assert m.journal.dirty_records() == [(9, record("old"))]
        assert m.journal.uploads() == [("up9", "old")]
        assert m.env.legacy_records() == {}  # both databases dropped
    finally:
        m.close()
    m = open_store(tmp_path)  # a second open finds it in the journal, once
    try:
        assert m.journal.dirty_records() == [(9, record("old"))]
    finally:
        m.close()


def test_a_journal_lost_while_the_index_expects_one_is_an_error(tmp_path):
    m = open_store(tmp_path)
    m.put_dirty(3, record("z"))
    m.close()
    os.unlink(tmp_path / "journal")
    with pytest.raises(StartupError, match="missing"):
        open_store(tmp_path)
    assert not os.path.exists(tmp_path / "journal")  # not silently recreated


def test_staging_files_with_neither_journal_nor_index_are_not_deleted_silently(tmp_path):
    os.makedirs(tmp_path / "dirty")
    open(tmp_path / "dirty" / "4-abc", "wb").close()
    with pytest.raises(StartupError, match="staging files"):
        open_store(tmp_path)
    assert os.path.exists(tmp_path / "dirty" / "4-abc")
