"""Owners and modes (issue 11 causes 2 and 6): what create, mkdir, mknod, mkfifo, bind and
symlink record for root and for `nobody`, and the kernel's permission checks
(default_permissions) acting on those owners and modes: chown/chmod rules, EACCES/EPERM,
set-id bits cleared after chown, chmod, write and truncate, set-group-ID directories.

Every call of the second user runs in one child process per test (posixkit.as_user)."""

from __future__ import annotations

import os
import stat

import posixkit as px
import pytest

N = px.NOBODY
G = 5678  # a group neither root's nor nobody's primary one
DEV = os.makedev(12, 34)

# kind -> (as_user operation on path P, umask, expected S_IFMT, expected permission bits)
# (nobody may not mknod a device: EPERM, the kernel's CAP_MKNOD check)
CREATES = {
    "creat_0640": (lambda p: ["creat", p, 0o640], 0o022, stat.S_IFREG, 0o640),
    "creat_0666_umask022": (lambda p: ["creat", p, 0o666], 0o022, stat.S_IFREG, 0o644),
    "creat_0": (lambda p: ["creat", p, 0], 0o022, stat.S_IFREG, 0),
    "creat_0777_umask0": (lambda p: ["creat", p, 0o777], 0, stat.S_IFREG, 0o777),
    "creat_06755": (lambda p: ["creat", p, 0o6755], 0o022, stat.S_IFREG, 0o6755),
    "mkdir_0700_umask0": (lambda p: ["mkdir", p, 0o700], 0, stat.S_IFDIR, 0o700),
    "mkdir_0777_umask022": (lambda p: ["mkdir", p, 0o777], 0o022, stat.S_IFDIR, 0o755),
    "mkdir_01777_umask0": (lambda p: ["mkdir", p, 0o1777], 0, stat.S_IFDIR, 0o1777),
    "mkdir_0": (lambda p: ["mkdir", p, 0], 0o022, stat.S_IFDIR, 0),
    "mkfifo_0640": (lambda p: ["mkfifo", p, 0o640], 0o022, stat.S_IFIFO, 0o640),
    "mknod_fifo_0604": (lambda p: ["mknod", p, stat.S_IFIFO | 0o604], 0o022, stat.S_IFIFO, 0o604),
    "mknod_reg_0600": (lambda p: ["mknod", p, stat.S_IFREG | 0o600], 0o022, stat.S_IFREG, 0o600),
    "mknod_sock": (lambda p: ["mknod", p, stat.S_IFSOCK | 0o666], 0o022, stat.S_IFSOCK, 0o644),
    "mknod_chr": (lambda p: ["mknod", p, stat.S_IFCHR | 0o640, DEV], 0o022, stat.S_IFCHR, 0o640),
    "mknod_blk": (lambda p: ["mknod", p, stat.S_IFBLK | 0o660, DEV], 0o022, stat.S_IFBLK, 0o640),
    "bind": (lambda p: ["bind", p], 0o022, stat.S_IFSOCK, 0o755),
    "symlink": (lambda p: ["symlink", "some/target", p], 0o022, stat.S_IFLNK, 0o777),
}
CREATORS = {"root": (0, 0), "nobody": (N, N)}


@pytest.mark.parametrize("creator", list(CREATORS))
@pytest.mark.parametrize("kind", list(CREATES))
def test_new_node_belongs_to_its_creator_with_the_mode_asked(d, kind, creator):
    make, umask, fmt, perm = CREATES[kind]
    uid, gid = CREATORS[creator]
    os.chmod(d, 0o777)
    p = d / "node"
    r = px.as_user([make(p), ["lstat", p], ["listdir", d]], uid=uid, gid=gid, umask=umask)
    if creator == "nobody" and fmt in (stat.S_IFCHR, stat.S_IFBLK):
        assert r[0] == {"err": "EPERM"}, r  # the kernel: no CAP_MKNOD
        return
    assert r[0] == px.OK, r
    st = r[1]["ok"]
    assert stat.S_IFMT(st["mode"]) == fmt, px.fmt_mode(st["mode"])
    assert stat.S_IMODE(st["mode"]) == perm, px.fmt_mode(st["mode"])
    assert (st["uid"], st["gid"]) == (uid, gid)
    assert r[2] == {"ok": ["node"]}
    # the test process (root) sees the same through its own lookup
    mine = os.lstat(p)
    assert (mine.st_mode, mine.st_uid, mine.st_gid) == (st["mode"], uid, gid)


def _root_file(p, mode, data=b""):
    px.creat(p, 0o600, data)
    os.chmod(p, mode)


def test_nobody_gets_eacces_from_a_0000_file_and_root_does_not(d):
    os.chmod(d, 0o777)
    _root_file(d / "root0", 0)
    r = px.as_user([["open", d / "root0"], ["open", d / "root0", os.O_WRONLY],
                    ["creat", d / "mine", 0], ["open", d / "mine"],
                    ["open", d / "mine", os.O_WRONLY], ["read", d / "root0"]])
    assert [x.get("err") for x in r] == ["EACCES", "EACCES", None, "EACCES", "EACCES", "EACCES"], r
    os.close(os.open(d / "mine", os.O_RDWR))  # root: no DAC check
    os.close(os.open(d / "root0", os.O_RDWR))


def test_nobody_reads_a_0644_file_but_cannot_write_it(d):
    _root_file(d / "f", 0o644, b"content")
    r = px.as_user([["read", d / "f"], ["write", d / "f", "x"], ["truncate", d / "f", 0]])
    assert r == [{"ok": "content"}, {"err": "EACCES"}, {"err": "EACCES"}]
    assert (d / "f").read_bytes() == b"content"


def test_nobody_cannot_change_a_root_0755_dir(d):
    _root_file(d / "f", 0o666)
    os.mkdir(d / "sub")
    p = d / "new"
    r = px.as_user([["creat", p, 0o644], ["mkdir", p], ["mkfifo", p], ["symlink", "t", p],
                    ["bind", p], ["mknod", p, stat.S_IFREG | 0o644], ["unlink", d / "f"],
                    ["rename", d / "f", p], ["rmdir", d / "sub"], ["write", d / "f", "ok"]])
    assert [x.get("err") for x in r] == ["EACCES"] * 9 + [None], r
    assert sorted(os.listdir(d)) == ["f", "sub"]


def test_sticky_dir_keeps_root_files_from_nobody(d):
    os.chmod(d, 0o1777)
    _root_file(d / "f", 0o666)
    r = px.as_user([["unlink", d / "f"], ["rename", d / "f", d / "g"],
                    ["creat", d / "own"], ["rename", d / "own", d / "own2"],
                    ["unlink", d / "own2"]])
    assert [x.get("err") for x in r] == ["EPERM", "EPERM", None, None, None], r
    assert os.listdir(d) == ["f"]


def test_chmod_by_owner_or_root_only(d):
    os.chmod(d, 0o777)
    _root_file(d / "root", 0o644)
    r = px.as_user([["chmod", d / "root", 0o777], ["creat", d / "own", 0o644],
                    ["chmod", d / "own", 0o600], ["lstat", d / "own"],
                    ["chmod", d / "own", 0o4750], ["lstat", d / "own"]])
    assert r[0] == {"err": "EPERM"} and r[1] == r[2] == px.OK, r
    assert stat.S_IMODE(r[3]["ok"]["mode"]) == 0o600
    assert r[4] == px.OK and stat.S_IMODE(r[5]["ok"]["mode"]) == 0o4750, r
    assert stat.S_IMODE(os.stat(d / "root").st_mode) == 0o644
    os.chmod(d / "own", 0o7777)  # root chmods anyone's file, every bit kept
    assert stat.S_IMODE(os.stat(d / "own").st_mode) == 0o7777


def test_chmod_sgid_by_owner_outside_the_group_drops_sgid(d):
    os.chmod(d, 0o777)
    _root_file(d / "f", 0o644)
    os.chown(d / "f", N, G)
    r = px.as_user([["chmod", d / "f", 0o2755], ["lstat", d / "f"]])
    assert r[0] == px.OK, r
    assert stat.S_IMODE(r[1]["ok"]["mode"]) == 0o755, px.fmt_mode(r[1]["ok"]["mode"])
    r = px.as_user([["chmod", d / "f", 0o2755], ["lstat", d / "f"]], groups=[G])
    assert stat.S_IMODE(r[1]["ok"]["mode"]) == 0o2755, px.fmt_mode(r[1]["ok"]["mode"])


def test_chown_rules(d):
    os.chmod(d, 0o777)
    _root_file(d / "root", 0o666)
    f = d / "own"
    r = px.as_user([["chown", d / "root", N, N], ["chown", d / "root", -1, N],
                    ["creat", f, 0o644],
                    ["chown", f, 0, -1],      # give it away: only root
                    ["chown", f, -1, 0],      # a group it is not in
                    ["chown", f, -1, G],      # ... until it is (second call below)
                    ["chown", f, N, N],       # no change: allowed
                    ["lstat", f]])
    assert [x.get("err") for x in r] == ["EPERM", "EPERM", None, "EPERM", "EPERM", "EPERM",
                                         None, None], r
    assert (r[7]["ok"]["uid"], r[7]["ok"]["gid"]) == (N, N)
    r = px.as_user([["chown", f, -1, G], ["lstat", f]], groups=[G])
    assert r[0] == px.OK, r
    assert (r[1]["ok"]["uid"], r[1]["ok"]["gid"]) == (N, G)
    # root gives any file to anyone
    os.chown(d / "root", 1234, G)
    os.chown(f, 0, 0)
    assert [(os.stat(p).st_uid, os.stat(p).st_gid) for p in (d / "root", f)] == [(1234, G), (0, 0)]
    os.symlink("own", d / "link")
    os.chown(d / "link", 4321, 8765, follow_symlinks=False)
    st = os.lstat(d / "link")
    assert (st.st_uid, st.st_gid) == (4321, 8765)
    assert (os.stat(f).st_uid, os.stat(f).st_gid) == (0, 0)  # not followed


# (mode before, ownership change) -> mode after, for root's chown of a regular file (Linux)
CHOWN_KILLS = {
    "suid_sgid_x": (0o6755, 0o755),
    "suid": (0o4755, 0o755),
    "sgid_without_group_x": (0o2745, 0o2745),  # mandatory-locking bit, not set-group-ID
    "sgid_x": (0o2775, 0o775),
}


@pytest.mark.parametrize("case", list(CHOWN_KILLS))
def test_chown_clears_set_id_bits_of_a_file(d, case):
    before, after = CHOWN_KILLS[case]
    _root_file(d / "f", before)
    os.chown(d / "f", 1234, G)
    st = os.stat(d / "f")
    assert (st.st_uid, st.st_gid) == (1234, G)
    assert stat.S_IMODE(st.st_mode) == after, px.fmt_mode(st.st_mode)


def test_chown_keeps_set_id_bits_of_a_directory(d):
    os.mkdir(d / "s")
    os.chmod(d / "s", 0o2775)
    os.chown(d / "s", 1234, G)
    assert stat.S_IMODE(os.stat(d / "s").st_mode) == 0o2775


def test_nobody_chown_of_own_file_to_its_group_clears_set_id_bits(d):
    os.chmod(d, 0o777)
    r = px.as_user([["creat", d / "f", 0o6755], ["chown", d / "f", -1, G], ["lstat", d / "f"]],
                   groups=[G])
    assert r[:2] == [px.OK, px.OK], r
    assert (r[2]["ok"]["gid"], stat.S_IMODE(r[2]["ok"]["mode"])) == (G, 0o755), r


# mode before -> after a write (Linux: S_ISGID goes only with S_IXGRP; without it the bit
# marks mandatory locking and stays)
WRITE_KILLS = {0o6777: 0o777, 0o4666: 0o666, 0o2777: 0o777, 0o2767: 0o2767}


@pytest.mark.parametrize("before", list(WRITE_KILLS), ids=lambda m: f"{m:o}")
@pytest.mark.parametrize("writer", ["nobody", "root"])
def test_write_clears_set_id_bits(d, writer, before):
    _root_file(d / "f", before, b"old")
    if writer == "nobody":
        assert px.as_user([["write", d / "f", "new"]]) == [{"ok": 3}]
    else:  # the spec: tierfs cannot tell who writes, so it clears for root too
        with open(d / "f", "r+b") as f:
            f.write(b"new")
    assert (d / "f").read_bytes() == b"new"
    mode = os.stat(d / "f").st_mode
    assert stat.S_IMODE(mode) == WRITE_KILLS[before], px.fmt_mode(mode)


def test_truncate_by_nobody_clears_set_id_bits(d):
    _root_file(d / "f", 0o6777, b"old data")
    assert px.as_user([["truncate", d / "f", 3]]) == [px.OK]
    st = os.stat(d / "f")
    assert st.st_size == 3
    assert stat.S_IMODE(st.st_mode) == 0o777, px.fmt_mode(st.st_mode)


def test_sgid_directory_gives_its_group_and_the_bit_to_new_nodes(d):
    sg = d / "sg"
    os.mkdir(sg)
    os.chown(sg, 0, G)
    os.chmod(sg, 0o2777)
    assert stat.S_IMODE(os.stat(sg).st_mode) == 0o2777
    px.creat(sg / "rootfile", 0o644)
    os.mkdir(sg / "rootdir", 0o755)
    r = px.as_user([["creat", sg / "nf", 0o644], ["mkdir", sg / "nd", 0o755],
                    ["mkfifo", sg / "np", 0o644], ["symlink", "nf", sg / "nl"],
                    ["lstat", sg / "nf"], ["lstat", sg / "nd"], ["lstat", sg / "np"],
                    ["lstat", sg / "nl"]])
    assert r[:4] == [px.OK] * 4, r
    got = {"rootfile": os.lstat(sg / "rootfile"), "rootdir": os.lstat(sg / "rootdir")}
    for name, st in got.items():
        assert st.st_gid == G, name
    assert os.lstat(sg / "rootdir").st_mode & stat.S_ISGID, "a new directory inherits S_ISGID"
    assert not os.lstat(sg / "rootfile").st_mode & stat.S_ISGID
    for name, x in zip(["nf", "nd", "np", "nl"], r[4:]):
        st = x["ok"]
        assert (st["uid"], st["gid"]) == (N, G), (name, st)
    assert r[5]["ok"]["mode"] & stat.S_ISGID, "nobody's new directory inherits S_ISGID"
    assert stat.S_IMODE(r[5]["ok"]["mode"]) == 0o2755


def test_utimens_permissions(d):
    _root_file(d / "rw", 0o666)
    _root_file(d / "ro", 0o644)
    t = 1_500_000_000_000_000_000
    r = px.as_user([["utime", d / "rw", t, t],          # explicit times: owner only
                    ["utime", d / "rw"],                # now: write permission is enough
                    ["utime", d / "ro"],
                    ["utime", d / "rw", "now", "omit"]])  # explicit (not both now): owner
    assert [x.get("err") for x in r] == ["EPERM", None, "EACCES", "EPERM"], r
    assert os.stat(d / "rw").st_mtime_ns != t
