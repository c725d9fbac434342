"""MetaStore: the LMDB index of a cache dir (inodes, dentries, chunk records)."""

import os

import lmdb
import pytest

from tierfs.errors import StartupError
from tierfs.index.attrs import DIR, FILE
from tierfs.index.chunks import ChunkRecord
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore

SRC = "s3://bucket/"


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "index")


def open_store(path, source=SRC):
    return MetaStore(path, source, map_size=64 << 20)


def entry(name: bytes, kind=FILE, size=1, etag="e1"):
    key = name.decode() + ("/" if kind == DIR else "")
    return (name, kind, size if kind == FILE else 0, 1.0, etag if kind == FILE else "", key)


def test_new_store_has_a_root_directory(path):
    m = open_store(path)
    try:
        root = m.inodes.inode(ROOT_INO)
        assert root.is_dir and root.key == "" and root.parent == ROOT_INO
        assert m.inodes.children(ROOT_INO) == []
    finally:
        m.close()


def test_inode_numbers_survive_close_and_reopen(path):
    m = open_store(path)
    a = m.inodes.upsert(ROOT_INO, b"a", DIR, 0, 1.0, "", "a/", 10.0)
    f = m.inodes.upsert(a.ino, b"f.bin", FILE, 42, 2.0, "etag1", "a/f.bin", 10.0)
    m.close()

    m = open_store(path)
    try:
        assert m.inodes.child(ROOT_INO, b"a").ino == a.ino
        again = m.inodes.child(a.ino, b"f.bin")
        assert (again.ino, again.size, again.etag, again.key) == (f.ino, 42, "etag1", "a/f.bin")
        # the counter persisted too: a new name never reuses a number
        g = m.inodes.upsert(ROOT_INO, b"g", FILE, 1, 1.0, "x", "g", 11.0)
        assert g.ino not in (ROOT_INO, a.ino, f.ino)
        assert g.ino > f.ino
    finally:
        m.close()


def test_upsert_of_an_existing_name_keeps_its_inode_and_updates_it(path):
    m = open_store(path)
    try:
        first = m.inodes.upsert(ROOT_INO, b"f", FILE, 1, 1.0, "v1", "f", 1.0)
        second = m.inodes.upsert(ROOT_INO, b"f", FILE, 2, 2.0, "v2", "f", 2.0)
        assert second.ino == first.ino
        assert (m.inodes.inode(first.ino).size, m.inodes.inode(first.ino).etag) == (2, "v2")
    finally:
        m.close()


def test_store_listing_replaces_children_and_keeps_inodes(path):
    m = open_store(path)
    try:
        m.inodes.store_listing(ROOT_INO, [entry(b"a"), entry(b"b"), entry(b"c")], now=1.0)
        before = {name: node.ino for name, node in m.inodes.children(ROOT_INO)}
        m.inodes.store_listing(ROOT_INO, [entry(b"b"), entry(b"c", etag="e2"), entry(b"d")], now=2.0)
        after = {name: node.ino for name, node in m.inodes.children(ROOT_INO)}
        assert list(after) == [b"b", b"c", b"d"]
        assert after[b"b"] == before[b"b"] and after[b"c"] == before[b"c"]
        assert after[b"d"] not in before.values()
        assert m.inodes.child(ROOT_INO, b"a") is None
        # the vanished name's inode record stays for open handles and the kernel
        assert m.inodes.inode(before[b"a"]) is not None
        assert m.inodes.child(ROOT_INO, b"c").etag == "e2"
        assert m.inodes.dir_listed_at(ROOT_INO) == 2.0
    finally:
        m.close()


def test_children_come_in_byte_order_whatever_the_listing_order(path):
    names = [b"z", "\u00e9t\u00e9".encode(), b"B", b"a-b", b"a.b", b"a", b"a b", b"A", b"0",
             b"~", "\u65e5\u672c".encode()]
    m = open_store(path)
    try:
        m.inodes.store_listing(ROOT_INO, [entry(n) for n in names], now=1.0)
        assert [n for n, _ in m.inodes.children(ROOT_INO)] == sorted(names)
        m.inodes.store_listing(ROOT_INO, [entry(n) for n in reversed(names)], now=2.0)
        assert [n for n, _ in m.inodes.children(ROOT_INO)] == sorted(names)
    finally:
        m.close()


def test_children_of_one_directory_exclude_other_directories(path):
    m = open_store(path)
    try:
        a = m.inodes.upsert(ROOT_INO, b"a", DIR, 0, 1.0, "", "a/", 1.0)
        b = m.inodes.upsert(ROOT_INO, b"b", DIR, 0, 1.0, "", "b/", 1.0)
        m.inodes.store_listing(a.ino, [entry(b"x"), entry(b"y")], now=1.0)
        m.inodes.store_listing(b.ino, [entry(b"p")], now=1.0)
        m.inodes.store_listing(b.ino, [entry(b"q")], now=2.0)  # must not touch a's children
        assert [n for n, _ in m.inodes.children(a.ino)] == [b"x", b"y"]
        assert [n for n, _ in m.inodes.children(b.ino)] == [b"q"]
        assert [n for n, _ in m.inodes.children(ROOT_INO)] == [b"a", b"b"]
    finally:
        m.close()


def test_a_name_that_changes_kind_gets_a_new_inode(path):
    m = open_store(path)
    try:
        m.inodes.store_listing(ROOT_INO, [entry(b"x", FILE)], now=1.0)
        as_file = m.inodes.child(ROOT_INO, b"x")
        m.inodes.store_listing(ROOT_INO, [entry(b"x", DIR)], now=2.0)
        as_dir = m.inodes.child(ROOT_INO, b"x")
        assert as_dir.is_dir and not as_file.is_dir
        assert as_dir.ino != as_file.ino
        # and back again: yet another number, never the stale file's or the dir's
        m.inodes.store_listing(ROOT_INO, [entry(b"x", FILE)], now=3.0)
        assert m.inodes.child(ROOT_INO, b"x").ino not in (as_file.ino, as_dir.ino)
    finally:
        m.close()


def test_remove_drops_only_the_dentry(path):
    m = open_store(path)
    try:
        f = m.inodes.upsert(ROOT_INO, b"f", FILE, 1, 1.0, "e", "f", 1.0)
        m.inodes.remove(ROOT_INO, b"f")
        assert m.inodes.child(ROOT_INO, b"f") is None
        assert m.inodes.inode(f.ino).key == "f"
        m.inodes.remove(ROOT_INO, b"never-existed")  # not an error
    finally:
        m.close()


def test_cache_dir_is_bound_to_its_source(path):
    open_store(path, "s3://one/").close()
    with pytest.raises(StartupError, match="s3://one/"):
        open_store(path, "s3://two/")
    m = open_store(path, "s3://one/")  # the rightful owner still opens it
    m.close()


def test_other_schema_version_is_set_aside_and_the_index_starts_empty(path):
    m = open_store(path)
    m.inodes.upsert(ROOT_INO, b"a", FILE, 1, 1.0, "e", "a", 1.0)
    m.close()
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"schema", b"999", db=env.open_db(b"info", txn=txn))
    env.close()
    m = open_store(path)  # a cache is re-derivable: another schema's is moved aside
    try:
        assert m.inodes.children(ROOT_INO) == []
    finally:
        m.close()
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith("index.damaged-")]


def rec(length, heat=1.0, last=5.0, crcs=(1, 2)):
    return ChunkRecord(length, heat, last, tuple(crcs))


def test_chunk_index_round_trip(path):
    oid = bytes(range(16))
    k0, k1, k2 = (oid + i.to_bytes(4, "big") for i in (0, 1, 2))
    m = open_store(path)
    m.chunks.apply({k1: rec(100, 2.5, 7.25, (0xFFFFFFFF, 0)), k0: rec(4096)}, [],
                   {oid: {"bucket": "b", "key": "k", "etag": "e", "size": 4196}})
    m.close()

    m = open_store(path)
    try:
        got = list(m.chunks.all())
        assert [k for k, _ in got] == [k0, k1]  # key order: object id, then chunk index
        assert got[1][1] == rec(100, 2.5, 7.25, (0xFFFFFFFF, 0))
        assert m.chunks.get(k0) == rec(4096)
        assert m.chunks.get(k2) is None
        assert m.chunks.object_info(oid) == {"bucket": "b", "key": "k", "etag": "e", "size": 4196}
        m.chunks.apply({k2: rec(1, crcs=(9,))}, [k0])
        assert [k for k, _ in m.chunks.all()] == [k1, k2]
        assert m.chunks.get(k2).crcs == (9,)
    finally:
        m.close()


def test_chunk_record_with_no_checksums_round_trips(path):
    m = open_store(path)
    try:
        key = b"\x01" * 16 + b"\x00\x00\x00\x00"
        m.chunks.apply({key: rec(0, crcs=())}, [])
        assert m.chunks.get(key) == rec(0, crcs=())
    finally:
        m.close()


def test_an_index_written_in_todays_format_opens_with_everything_in_place(tmp_path):
    # the on-disk format, written byte by byte as a cache dir of today has it (database
    # names, key and value encodings); the tables split by owner must read it unchanged
    # and write the same bytes
    import json
    import struct

    from tierfs.index.journal import Journal

    Journal.open(str(tmp_path / "journal")).close()
    u64 = struct.Struct(">Q").pack
    oid, ckey = b"\x01" * 16, b"\x01" * 16 + struct.pack(">I", 3)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        db = {n: env.open_db(n, txn=txn) for n in (b"info", b"inodes", b"dentries", b"dirs",
                                                      b"chunks", b"objects", b"attrs", b"pins",
                                                      b"usage", b"capacity", b"analytics")}
        for k, v in {b"schema": b"1", b"source": SRC.encode(), b"next_ino": u64(3),
                     b"chunk_format": b"2", b"journal": b"1"}.items():
            txn.put(k, v, db=db[b"info"])
        txn.put(u64(1), struct.pack("<BQQddH", DIR, 1, 0, 0.0, 0.0, 0), db=db[b"inodes"])
        txn.put(u64(2), struct.pack("<BQQddH", FILE, 1, 9, 2.0, 3.0, 2) + b"e9" + b"a.bin",
                db=db[b"inodes"])
        txn.put(u64(1) + b"a.bin", u64(2), db=db[b"dentries"])
        txn.put(u64(1), struct.pack("<d", 4.0), db=db[b"dirs"])
        txn.put(ckey, struct.pack("<Idd", 9, 1.5, 6.0) + struct.pack("<2I", 7, 8),
                db=db[b"chunks"])
        txn.put(oid, b'{"bucket": "b", "key": "a.bin", "etag": "e9", "size": 9}',
                db=db[b"objects"])
        txn.put(b"manual", json.dumps({"expires": None, "objects": {oid.hex(): 9}}).encode(),
                db=db[b"pins"])
        txn.put(b"tenant/t", b'{"stall_s": 1}', db=db[b"usage"])
        txn.put(b"5m/" + u64(7), b'{"used": 1}', db=db[b"capacity"])
        txn.put(b"totals", b'{"read": 2}', db=db[b"analytics"])
    env.close()

    m = open_store(str(tmp_path / "index"))
    try:
        f = m.inodes.child(ROOT_INO, b"a.bin")
        assert (f.ino, f.kind, f.size, f.mtime, f.etag, f.key, f.validated_at) == \
            (2, FILE, 9, 2.0, "e9", "a.bin", 3.0)
        assert m.inodes.dir_listed_at(ROOT_INO) == 4.0
        assert list(m.chunks.all()) == [(ckey, ChunkRecord(9, 1.5, 6.0, (7, 8)))]
        assert m.chunks.object_info(oid)["key"] == "a.bin"
        assert m.pins.all() == [("manual", {"expires": None, "objects": {oid.hex(): 9}})]
        assert m.usage.records() == [("tenant/t", {"stall_s": 1})]
        assert m.capacity.samples("5m") == [(7, {"used": 1})]
        assert m.analytics.records() == [("totals", {"read": 2})]
        assert m.inodes.upsert(ROOT_INO, b"new", FILE, 1, 1.0, "e", "new", 1.0).ino == 3
        m.chunks.apply({ckey: ChunkRecord(9, 2.5, 7.0, (7, 8))}, [])
    finally:
        m.close()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=16, readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.get(ckey, db=env.open_db(b"chunks", txn=txn)) == \
            struct.pack("<Idd", 9, 2.5, 7.0) + struct.pack("<2I", 7, 8)
        assert txn.get(b"next_ino", db=env.open_db(b"info", txn=txn)) == u64(4)
        assert txn.get(u64(1) + b"new", db=env.open_db(b"dentries", txn=txn)) == u64(3)
    env.close()
