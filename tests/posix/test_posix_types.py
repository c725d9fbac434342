"""File types (issue 11 cause 1): regular, directory, symlink, fifo, character and block
device, unix socket; each shows its type, mode and rdev in stat, in listings, and after the
kernel's attribute cache is bypassed by a second user's stat. link() answers EPERM."""

from __future__ import annotations

import errno
import os
import stat

import posixkit as px
import pytest

DEV_C = os.makedev(12, 34)
DEV_B = os.makedev(8, 1)


def _mknod_reg(p):
    os.mknod(p, stat.S_IFREG | 0o640)


def _mknod_zero(p):
    os.mknod(p, 0o640)  # type 0: a regular file


# name -> (make(path), expected S_IFMT, expected permission bits under umask 022, rdev)
TYPES = {
    "regular": (lambda p: px.creat(p, 0o640), stat.S_IFREG, 0o640, 0),
    "directory": (lambda p: os.mkdir(p, 0o750), stat.S_IFDIR, 0o750, 0),
    "symlink": (lambda p: os.symlink("target/of/link", p), stat.S_IFLNK, 0o777, 0),
    "fifo": (lambda p: os.mkfifo(p, 0o640), stat.S_IFIFO, 0o640, 0),
    "chr": (lambda p: os.mknod(p, stat.S_IFCHR | 0o640, DEV_C), stat.S_IFCHR, 0o640, DEV_C),
    "blk": (lambda p: os.mknod(p, stat.S_IFBLK | 0o640, DEV_B), stat.S_IFBLK, 0o640, DEV_B),
    "socket": (px.bind_socket, stat.S_IFSOCK, 0o755, 0),  # bind: 0777 & ~umask
    "mknod_reg": (_mknod_reg, stat.S_IFREG, 0o640, 0),
    "mknod_type0": (_mknod_zero, stat.S_IFREG, 0o640, 0),
}


@pytest.mark.parametrize("kind", list(TYPES))
def test_type_mode_and_rdev_in_stat_and_listing(d, kind):
    make, fmt, perm, rdev = TYPES[kind]
    p = d / "node"
    make(p)
    st = os.lstat(p)
    assert stat.S_IFMT(st.st_mode) == fmt, px.fmt_mode(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == perm, px.fmt_mode(st.st_mode)
    if rdev:
        assert st.st_rdev == rdev, (os.major(st.st_rdev), os.minor(st.st_rdev))
    if fmt in (stat.S_IFREG, stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK):
        assert st.st_size == 0
    # the listing has it, with the same type (readdir's d_type via scandir, then lstat)
    entries = {e.name: e for e in os.scandir(d)}
    assert list(entries) == ["node"]
    e = entries["node"]
    assert e.is_symlink() == (fmt == stat.S_IFLNK)
    assert e.is_dir(follow_symlinks=False) == (fmt == stat.S_IFDIR)
    assert e.is_file(follow_symlinks=False) == (fmt == stat.S_IFREG)
    assert stat.S_IFMT(e.stat(follow_symlinks=False).st_mode) == fmt
    # a second process as another user sees the same (the daemon's answer, through lookup)
    r = px.as_user([["lstat", p]])[0]["ok"]
    assert (r["mode"], r["rdev"]) == (st.st_mode, st.st_rdev)


def test_fifo_works_through_the_kernel(d):
    p = d / "pipe"
    os.mkfifo(p, 0o600)
    fd = os.open(p, os.O_RDWR | os.O_NONBLOCK)  # O_RDWR on a fifo never blocks on Linux
    try:
        os.write(fd, b"through the pipe")
        assert os.read(fd, 100) == b"through the pipe"
    finally:
        os.close(fd)
    assert stat.S_ISFIFO(os.stat(p).st_mode)


def test_unix_socket_accepts_a_connection(d):
    import socket

    p = os.fspath(d / "sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(p)
        srv.listen(1)
        assert stat.S_ISSOCK(os.lstat(p).st_mode)
        cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cli.connect(p)
            conn, _ = srv.accept()
            with conn:
                cli.sendall(b"hi")
                assert conn.recv(2) == b"hi"
        finally:
            cli.close()
    finally:
        srv.close()
    os.unlink(p)
    assert os.listdir(d) == []


def test_special_files_are_zero_byte_objects_with_their_mode(d, pmount):
    os.mkfifo(d / "f", 0o640)
    os.mknod(d / "c", stat.S_IFCHR | 0o600, DEV_C)
    base = px.key_of(d, pmount.m.path)

    def check():
        h = {n: px.head(pmount.s3, pmount.bucket, f"{base}/{n}") for n in ("f", "c")}
        assert h["f"] and h["c"], h
        assert h["f"]["ContentLength"] == 0 and h["c"]["ContentLength"] == 0
        assert int(h["f"]["Metadata"]["tierfs-mode"], 8) == stat.S_IFIFO | 0o640, h
        assert int(h["c"]["Metadata"]["tierfs-mode"], 8) == stat.S_IFCHR | 0o600, h
        assert int(h["c"]["Metadata"]["tierfs-rdev"]) == DEV_C, h

    px.eventually(check)  # --writeback: the bucket may lag


@pytest.mark.parametrize("kind", ["regular", "symlink", "fifo"])
def test_link_is_eperm(d, kind):
    make = TYPES[kind][0]
    make(d / "src")
    px.expect_err(lambda: os.link(d / "src", d / "dst", follow_symlinks=False), errno.EPERM,
                  "link")
    assert os.listdir(d) == ["src"]


def test_statfs_namemax_is_255(pmount):
    assert os.statvfs(pmount.m.path).f_namemax == 255


# a directory another client made as a prefix only (no marker object)
PRELOAD = {"prefix_only/a": (b"a", {}), "prefix_only2/b": (b"b", {})}


@pytest.mark.parametrize("change", ["chmod", "chown", "utime"])
def test_changing_a_prefix_directory_writes_its_marker(pmount, change):
    # chmod and chown share prefix_only: whichever runs first makes the marker
    p = pmount.m.path / ("prefix_only" if change != "utime" else "prefix_only2")
    key = os.path.basename(p) + "/"
    before = px.head(pmount.s3, pmount.bucket, key)
    if change == "chmod":
        os.chmod(p, 0o750)
    elif change == "chown":
        os.chown(p, 1234, 5678)
    else:
        os.utime(p, ns=(px.OLD_ATIME_NS, px.OLD_MTIME_NS))
    st = os.stat(p)

    def check():
        h = px.head(pmount.s3, pmount.bucket, key)
        assert h is not None, f"no marker {key} (before the change: {before is not None})"
        md = h["Metadata"]
        # the field changed is in the marker (the others may be unknown: mount defaults)
        if change == "chmod":
            assert int(md.get("tierfs-mode", "-1"), 8) == st.st_mode, md
        elif change == "chown":
            assert (md.get("tierfs-uid"), md.get("tierfs-gid")) == ("1234", "5678"), md
        else:
            assert (md.get("tierfs-atime"), md.get("tierfs-mtime")) == (
                px.fmt_ns(px.OLD_ATIME_NS), px.fmt_ns(px.OLD_MTIME_NS)), md

    px.eventually(check)
    assert sorted(os.listdir(p)) == ["a" if change != "utime" else "b"]


def test_mknod_of_a_regular_file_uploads_an_empty_object(d, pmount):
    os.mknod(d / "r", stat.S_IFREG | 0o640)
    key = px.key_of(d / "r", pmount.m.path)

    def check():
        h = px.head(pmount.s3, pmount.bucket, key)
        assert h is not None and h["ContentLength"] == 0, h
        assert int(h["Metadata"].get("tierfs-mode", "0"), 8) == stat.S_IFREG | 0o640, h

    px.eventually(check)  # --writeback: the bucket may lag
