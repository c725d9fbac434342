"""Limits (issue 11 causes 3, 4 and 7): name components (255 bytes), object keys (S3's
1,024 bytes; a directory's marker `path/` counts), nlink of every type, and the 5 TiB file
size limit (EFBIG)."""

from __future__ import annotations

import errno
import os
import stat

import posixkit as px
import pytest

NAME_OK = "n" * px.MAX_NAME
NAME_LONG = "n" * (px.MAX_NAME + 1)
UTF8_OK = "\u00e9" * 127 + "a"      # 255 bytes in 128 characters
UTF8_LONG = "\u00e9" * 128           # 256 bytes in 128 characters

# objects another client put before the mount started (a directory that is only a prefix)
PRELOAD = {
    "pfx/sub1/a": (b"a", {}),
    "pfx/sub2/deeper/b": (b"b", {}),
    "pfx/c": (b"c", {}),
}


def _rename_file_to(d, p):
    px.creat(d / "src")
    os.rename(d / "src", p)


def _rename_dir_to(d, p):
    os.mkdir(d / "src")
    os.rename(d / "src", p)


# calls that create a name: (d, path) -> None
CREATE = {
    "creat": lambda d, p: px.creat(p),
    "open_creat_rdwr": lambda d, p: os.close(os.open(p, os.O_RDWR | os.O_CREAT, 0o600)),
    "mkdir": lambda d, p: os.mkdir(p),
    "mkfifo": lambda d, p: os.mkfifo(p),
    "mknod_chr": lambda d, p: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 2)),
    "mknod_reg": lambda d, p: os.mknod(p, stat.S_IFREG | 0o600),
    "symlink": lambda d, p: os.symlink("target", p),
    "rename_file": _rename_file_to,
    "rename_dir": _rename_dir_to,
}


@pytest.mark.parametrize("name", ["ascii", "utf8"])
@pytest.mark.parametrize("call", list(CREATE))
def test_255_byte_name_works(d, call, name):
    n = NAME_OK if name == "ascii" else UTF8_OK
    assert len(os.fsencode(n)) == 255
    p = d / n
    CREATE[call](d, p)
    assert os.listdir(d) == [n]
    st = os.lstat(p)
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(p)
    else:
        os.unlink(p)
    assert os.listdir(d) == []


@pytest.mark.parametrize("name", ["ascii", "utf8"])
@pytest.mark.parametrize("call", list(CREATE))
def test_256_byte_name_is_enametoolong(d, call, name):
    n = NAME_LONG if name == "ascii" else UTF8_LONG
    px.expect_err(lambda: CREATE[call](d, d / n), errno.ENAMETOOLONG, call)
    left = {"rename_file": ["src"], "rename_dir": ["src"]}.get(call, [])
    assert os.listdir(d) == left, "the call must leave nothing behind (and keep the source)"


# calls that look a name up
LOOKUP = {
    "stat": os.stat,
    "lstat": os.lstat,
    "open": lambda p: os.close(os.open(p, os.O_RDONLY)),
    "unlink": os.unlink,
    "rmdir": os.rmdir,
    "chmod": lambda p: os.chmod(p, 0o600),
    "chown": lambda p: os.chown(p, 1, 1),
    "utime": os.utime,
    "truncate": lambda p: os.truncate(p, 0),
    "readlink": os.readlink,
    "listdir": os.listdir,
    "rename_from": lambda p: os.rename(p, p.parent / "x"),
    "below_it": lambda p: os.stat(p / "x"),
}


@pytest.mark.parametrize("call", list(LOOKUP))
def test_lookup_of_a_256_byte_name_is_enametoolong(d, call):
    px.creat(d / NAME_OK)  # a 255-byte neighbour changes nothing
    px.expect_err(lambda: LOOKUP[call](d / NAME_LONG), errno.ENAMETOOLONG, call)
    assert os.listdir(d) == [NAME_OK]


# ------------------------------------------------------------------ keys
KEY_CREATE = {k: CREATE[k] for k in ("creat", "mkfifo", "mknod_chr", "symlink", "rename_file")}


@pytest.mark.parametrize("call", list(KEY_CREATE))
def test_object_key_of_1024_bytes_works_and_1025_is_enametoolong(d, pmount, call):
    root = pmount.m.path
    base = px.deep_dir(d, root, px.MAX_KEY - 100)
    ok = base / ("k" * 99)
    assert len(px.key_of(ok, root).encode()) == 1024
    KEY_CREATE[call](base, ok)
    assert os.lstat(ok)
    long = base / ("l" * 100)
    px.expect_err(lambda: KEY_CREATE[call](base, long), errno.ENAMETOOLONG, call)
    left = ["src"] if call == "rename_file" else []
    assert sorted(os.listdir(base)) == sorted(["k" * 99, *left])


def test_directory_marker_key_counts_its_slash(d, pmount):
    root = pmount.m.path
    base = px.deep_dir(d, root, px.MAX_KEY - 100)
    ok = base / ("k" * 98)             # marker key: 1023 + "/" = 1024 bytes
    os.mkdir(ok)
    assert stat.S_ISDIR(os.stat(ok).st_mode)
    long = base / ("l" * 99)           # marker key 1025 bytes
    px.expect_err(lambda: os.mkdir(long), errno.ENAMETOOLONG, "mkdir")
    os.mkdir(base / "s")
    px.expect_err(lambda: os.rename(base / "s", long), errno.ENAMETOOLONG, "rename dir")
    assert sorted(os.listdir(base)) == ["k" * 98, "s"]


# ------------------------------------------------------------------ nlink
def test_nlink_of_files_symlinks_and_special_files_is_1(d):
    px.creat(d / "f")
    os.symlink("f", d / "l")
    os.mkfifo(d / "p")
    os.mknod(d / "c", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    px.bind_socket(d / "s")
    assert {n: os.lstat(d / n).st_nlink for n in os.listdir(d)} == dict.fromkeys("flpcs", 1)


def _subdirs(p) -> int:
    return sum(1 for e in os.scandir(p) if e.is_dir(follow_symlinks=False))


def test_nlink_of_a_directory_counts_its_subdirectories(d):
    os.mkdir(d / "a")
    assert os.stat(d / "a").st_nlink == 2
    seq = []
    for step in (lambda: os.mkdir(d / "a/x"), lambda: os.mkdir(d / "a/y"),
                 lambda: px.creat(d / "a/f"), lambda: os.mkfifo(d / "a/p"),
                 lambda: os.symlink("x", d / "a/l"),
                 lambda: os.mkdir(d / "b"),
                 lambda: os.rename(d / "a/y", d / "b/y"),
                 lambda: os.rmdir(d / "a/x"),
                 lambda: os.rename(d / "b/y", d / "a/z"),
                 lambda: os.rename(d / "a/f", d / "b/f")):
        step()
        seq.append((os.stat(d / "a").st_nlink, os.stat(d / "b").st_nlink
                    if os.path.exists(d / "b") else None))
    assert seq == [(3, None), (4, None), (4, None), (4, None), (4, None), (4, 2), (3, 3),
                   (2, 3), (3, 2), (3, 2)]
    assert os.stat(d).st_nlink == 2 + _subdirs(d) == 4


def test_fstat_of_an_open_unlinked_file_says_nlink_0(d):
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"still readable")
        assert os.fstat(fd).st_nlink == 1
        os.unlink(d / "f")
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 100, 0) == b"still readable"
    finally:
        os.close(fd)
    assert os.listdir(d) == []


def test_nlink_of_a_prefix_directory_after_its_listing(pmount):
    p = pmount.m.path / "pfx"
    assert sorted(os.listdir(p)) == ["c", "sub1", "sub2"]
    assert os.stat(p).st_nlink == 4
    # sub2 was seen in pfx's listing but never listed itself: 1 ("unknown", as btrfs)
    assert os.stat(p / "sub2").st_nlink == 1
    assert os.listdir(p / "sub2") == ["deeper"]
    assert os.stat(p / "sub2").st_nlink == 3


# ------------------------------------------------------------------ EFBIG
TIB = 1 << 40
TOO_BIG = [999_999_999_999_999, 5 * TIB + 1]


def _no_traceback(pmount):
    log = pmount.log_since(pmount.test_log_mark)
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("size", TOO_BIG)
def test_truncate_beyond_5_tib_is_efbig(d, pmount, size):
    px.creat(d / "f", 0o644, b"keep me")
    try:
        px.expect_err(lambda: os.truncate(d / "f", size), errno.EFBIG, "truncate")
    finally:
        if os.stat(d / "f").st_size != 7:
            os.truncate(d / "f", 0)  # never leave a huge file to upload
    assert (d / "f").read_bytes() == b"keep me"
    _no_traceback(pmount)


# growing an open file past S3's largest object, by ftruncate and by a write
_BEYOND = [(f"ftruncate-{size}", lambda fd, size=size: os.ftruncate(fd, size))
           for size in TOO_BIG] + [("pwrite", lambda fd: os.pwrite(fd, b"x", 5 * TIB))]


@pytest.mark.parametrize("what,grow", _BEYOND, ids=[what for what, _ in _BEYOND])
def test_growing_an_open_file_beyond_5_tib_is_efbig(d, pmount, what, grow):
    fd = os.open(d / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"keep me")
        px.expect_err(lambda: grow(fd), errno.EFBIG, what)
        assert os.fstat(fd).st_size == 7
    finally:
        if os.fstat(fd).st_size != 7:
            os.ftruncate(fd, 0)
        os.close(fd)
    assert (d / "f").read_bytes() == b"keep me"
    _no_traceback(pmount)
