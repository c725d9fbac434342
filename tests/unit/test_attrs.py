"""tierfs.index.attrs: the metadata a file carries in S3, and the POSIX rules for new nodes."""

from __future__ import annotations

import stat

import pytest

from tierfs.index.attrs import (BLK, CHR, DIR, FIFO, FILE, SOCK, SYMLINK, Attrs, for_new,
                          format_ns, from_metadata, kind_of, parse_ns, without_privs)


@pytest.mark.parametrize("kind", [FILE, DIR, SYMLINK, FIFO, SOCK, CHR, BLK])
def test_metadata_round_trip_keeps_type_owner_mode_times(kind):
    a = Attrs(mode=0o4751, uid=1001, gid=2002, atime_ns=1_000_000_000_123_456_789,
              mtime_ns=1_700_000_000_000_000_001, ctime_ns=1_800_000_000_999_999_999,
              rdev=0x0801 if kind in (CHR, BLK) else 0)
    md = a.to_metadata(kind)
    assert all(k.startswith("tierfs-") for k in md)
    got_kind, got = from_metadata(md, "etag1")
    assert got_kind == kind
    assert got == a.changed(seen="etag1")


def test_json_round_trip_keeps_mode_zero_and_drops_unknowns():
    a = Attrs(mode=0, uid=0, gid=0, ctime_ns=5, symlink="../x", seen="")
    assert Attrs.from_json(a.to_json()) == a
    assert Attrs.from_json(Attrs().to_json()) == Attrs()


def test_old_index_records_with_float_seconds_are_read():
    old = b'{"mode": 420, "uid": 7, "mtime": 1700000000.5, "symlink": "t"}'
    a = Attrs.from_json(old)
    assert (a.mode, a.uid, a.mtime_ns, a.symlink) == (0o644, 7, 1_700_000_000_500_000_000, "t")


def test_s3fs_metadata_is_read_when_tierfs_metadata_is_absent():
    # s3fs keeps st_mode in decimal and times in seconds
    kind, a = from_metadata({"mode": str(stat.S_IFIFO | 0o640), "uid": "12", "gid": "34",
                             "mtime": "1600000000"}, "e")
    assert kind == FIFO and (a.mode, a.uid, a.gid) == (0o640, 12, 34)
    assert a.mtime_ns == 1_600_000_000 * 10**9
    # tierfs's own names win
    kind, a = from_metadata({"mode": "33188", "tierfs-mode": "100600"}, "e")
    assert (kind, a.mode) == (FILE, 0o600)


def test_malformed_metadata_is_ignored_not_fatal(caplog):
    kind, a = from_metadata({"tierfs-uid": "root", "tierfs-mode": "100644"}, "e")
    assert a.uid is None and "malformed" in caplog.text
    # permission bits only (an older tierfs): the type is not known from the metadata
    kind, a = from_metadata({"tierfs-mode": "755"}, "e")
    assert kind is None and a.mode == 0o755


@pytest.mark.parametrize("text,ns", [("1", 10**9), ("1.5", 1_500_000_000),
                                     ("1.000000001", 1_000_000_001),
                                     ("0.1234567891", 123_456_789)])
def test_times_are_exact_nanoseconds(text, ns):
    assert parse_ns(text) == ns
    assert parse_ns(format_ns(ns)) == ns


@pytest.mark.parametrize("bad", ["", "x", "1.2.3", "1e9", "1.-5"])
def test_bad_times_are_refused(bad):
    with pytest.raises(ValueError):
        parse_ns(bad)


def test_new_nodes_take_the_callers_ids_and_a_setgid_parents_group():
    plain = Attrs(mode=0o755, gid=50)
    a = for_new(FILE, 0o640, 1000, 100, plain, 7)
    assert (a.mode, a.uid, a.gid, a.atime_ns, a.mtime_ns, a.ctime_ns) == (0o640, 1000, 100, 7, 7, 7)
    sgid = Attrs(mode=0o2775, gid=50)
    assert for_new(FILE, 0o640, 1000, 100, sgid, 7).gid == 50
    d = for_new(DIR, 0o755, 1000, 100, sgid, 7)
    assert d.gid == 50 and d.mode == 0o2755  # a new directory inherits S_ISGID
    assert for_new(SYMLINK, 0o600, 1000, 100, plain, 7).mode == 0o777


def test_privileges_dropped_by_chown_and_write():
    assert without_privs(0o6755) == 0o0755
    assert without_privs(0o6745) == 0o2745  # S_ISGID without group-execute stays
    assert without_privs(0o0644) == 0o0644


def test_kind_of_full_modes():
    assert kind_of(stat.S_IFSOCK | 0o700) == SOCK
    assert kind_of(stat.S_IFBLK) == BLK
    assert kind_of(0o644) is None
