"""POSIX calls on the mount, each checked through the mount and in the bucket."""

from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import subprocess
import time

import pytest
import wkit
from wkit import KiB, MiB

LAG = wkit.BUCKET_LAG  # renames, unlinks, mkdirs: the bucket may follow a moment later


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_checkpoint_tmp_fsync_rename_replaces_the_destination(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    os.mkdir(m.path / "ckpt")
    old, new = wkit.payload("old", 3 * MiB), wkit.payload("new", 2 * MiB + 99)
    wkit.write_file(m.path / "ckpt/model.pt", old, fsync=True)
    tmp = m.path / "ckpt/model.pt.tmp"
    wkit.write_file(tmp, new, fsync=True)
    os.replace(tmp, m.path / "ckpt/model.pt")
    assert wkit.read_uncached(m.path / "ckpt/model.pt") == new
    assert not tmp.exists()
    assert sorted(os.listdir(m.path / "ckpt")) == ["model.pt"]
    wkit.assert_bucket_has(s3, bucket, {"ckpt/model.pt": new, "ckpt/model.pt.tmp": None},
                           timeout=LAG)


def test_overwrite_with_o_trunc(mounts, s3, bucket):
    s3.put_object(Bucket=bucket, Key="ow.bin", Body=wkit.payload("long", 5 * MiB))
    m = mounts.start()
    assert os.stat(m.path / "ow.bin").st_size == 5 * MiB
    new = wkit.payload("short", 100 * KiB)
    wkit.write_file(m.path / "ow.bin", new, flags=os.O_WRONLY | os.O_TRUNC)
    assert os.stat(m.path / "ow.bin").st_size == len(new)
    assert wkit.read_uncached(m.path / "ow.bin") == new
    assert wkit.s3_get(s3, bucket, "ow.bin") == new


def test_o_append_adds_at_the_end(mounts, s3, bucket):
    m = mounts.start()
    first = wkit.payload("first", 300 * KiB)
    wkit.write_file(m.path / "log.txt", first)
    parts = [first]
    for i in range(3):
        more = wkit.payload(f"more{i}", 1000 + i)
        fd = os.open(m.path / "log.txt", os.O_WRONLY | os.O_APPEND)
        try:
            os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND writes at the end whatever the offset
            os.write(fd, more)
        finally:
            os.close(fd)
        parts.append(more)
    want = b"".join(parts)
    assert wkit.read_uncached(m.path / "log.txt") == want
    assert wkit.s3_get(s3, bucket, "log.txt") == want


def test_pwrite_at_random_offsets_into_a_new_file(mounts, s3, bucket):
    m = mounts.start()
    rnd = random.Random(11)
    model = bytearray()
    fd = os.open(m.path / "sparse.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for i in range(40):
            off = rnd.choice([rnd.randrange(64 * KiB), rnd.randrange(12 * MiB)])
            data = wkit.payload(f"pw{i}", rnd.choice([1, 100, 4096, 70_000, 300 * KiB]))
            assert os.pwrite(fd, data, off) == len(data)
            wkit.apply_write(model, off, data)
        # read back through the still-open handle, holes as zeros
        assert os.pread(fd, len(model) + 10, 0) == bytes(model)
    finally:
        os.close(fd)
    assert wkit.read_uncached(m.path / "sparse.bin") == bytes(model)
    assert wkit.s3_get(s3, bucket, "sparse.bin") == bytes(model)


def test_pwrite_into_the_middle_of_a_large_object_copies_untouched_ranges(mounts, s3, bucket):
    original = wkit.payload("orig", 24 * MiB)
    s3.put_object(Bucket=bucket, Key="big.bin", Body=original)
    m = mounts.start()
    copies = m.counter("tierfs_backend_requests_total", op="upload_part_copy")
    patch = wkit.payload("patch", 64 * KiB)
    off = 12 * MiB + 100
    fd = os.open(m.path / "big.bin", os.O_WRONLY)
    try:
        assert os.pwrite(fd, patch, off) == len(patch)
    finally:
        os.close(fd)
    want = bytearray(original)
    wkit.apply_write(want, off, patch)
    assert wkit.s3_get(s3, bucket, "big.bin") == bytes(want)
    assert wkit.read_uncached(m.path / "big.bin") == bytes(want)
    # the untouched first and last 8 MiB were copied inside S3, not uploaded again
    assert m.counter("tierfs_backend_requests_total", op="upload_part_copy") - copies > 0


def test_truncate_shrinks_and_extends_with_zeros(mounts, s3, bucket):
    m = mounts.start()
    data = wkit.payload("trunc", 2 * MiB + 3)
    wkit.write_file(m.path / "t.bin", data)
    # truncate(2) by path has no close(): the bucket may follow a moment later
    os.truncate(m.path / "t.bin", 1000)
    assert wkit.read_uncached(m.path / "t.bin") == data[:1000]
    wkit.assert_bucket_has(s3, bucket, {"t.bin": data[:1000]}, timeout=LAG)
    os.truncate(m.path / "t.bin", 3 * MiB)
    want = data[:1000] + b"\0" * (3 * MiB - 1000)
    assert os.stat(m.path / "t.bin").st_size == 3 * MiB
    assert wkit.read_uncached(m.path / "t.bin") == want
    wkit.assert_bucket_has(s3, bucket, {"t.bin": want}, timeout=LAG)
    # ftruncate on an open handle, then write past the new end; close() uploads
    fd = os.open(m.path / "t.bin", os.O_RDWR)
    try:
        os.ftruncate(fd, 10)
        os.pwrite(fd, b"tail", 20)
    finally:
        os.close(fd)
    want = data[:10] + b"\0" * 10 + b"tail"
    assert wkit.read_uncached(m.path / "t.bin") == want
    assert wkit.s3_get(s3, bucket, "t.bin") == want


def test_unlink_removes_the_file_and_the_object(mounts, s3, bucket):
    s3.put_object(Bucket=bucket, Key="d/old.bin", Body=b"old object")
    m = mounts.start()
    wkit.write_file(m.path / "d/new.bin", b"new file")
    os.unlink(m.path / "d/old.bin")
    os.unlink(m.path / "d/new.bin")
    assert not (m.path / "d/old.bin").exists() and not (m.path / "d/new.bin").exists()
    with pytest.raises(FileNotFoundError):
        os.unlink(m.path / "d/new.bin")
    wkit.assert_bucket_has(s3, bucket, {"d/old.bin": None, "d/new.bin": None}, timeout=LAG)


def test_mkdir_creates_a_marker_and_rmdir_removes_it(mounts, s3, bucket):
    m = mounts.start()
    os.mkdir(m.path / "newdir")
    os.mkdir(m.path / "newdir/inner")
    assert os.path.isdir(m.path / "newdir/inner")
    assert os.listdir(m.path / "newdir") == ["inner"]
    with pytest.raises(FileExistsError):
        os.mkdir(m.path / "newdir")
    wkit.eventually(lambda: {"newdir/", "newdir/inner/"} <= set(wkit.s3_keys(s3, bucket)))
    assert wkit.s3_get(s3, bucket, "newdir/inner/") == b""
    os.rmdir(m.path / "newdir/inner")
    assert os.listdir(m.path / "newdir") == []
    wkit.eventually(lambda: "newdir/inner/" not in wkit.s3_keys(s3, bucket))
    # the empty directory is still there after a remount (its marker is in the bucket)
    m = mounts.remount(m, cache="cache2")
    assert os.listdir(m.path) == ["newdir"] and os.listdir(m.path / "newdir") == []


def test_rmdir_of_a_non_empty_directory_fails_with_enotempty(mounts, s3, bucket):
    s3.put_object(Bucket=bucket, Key="full/s3-made.bin", Body=b"x")  # no marker object
    m = mounts.start()
    os.mkdir(m.path / "full2")
    wkit.write_file(m.path / "full2/f", b"y")
    for d in ("full", "full2"):
        with pytest.raises(OSError) as e:
            os.rmdir(m.path / d)
        assert e.value.errno == errno.ENOTEMPTY, d
        assert os.path.isdir(m.path / d)
    assert wkit.s3_get(s3, bucket, "full/s3-made.bin") == b"x"
    assert wkit.s3_get(s3, bucket, "full2/f") == b"y"


def test_rename_of_a_directory_moves_every_object(mounts, s3, bucket):
    inside = {f"src/{n}": wkit.payload(n, 1000 * i) for i, n in
              enumerate(["a.bin", "b.bin", "sub/c.bin", "sub/deeper/d.bin"])}
    for k, v in inside.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    m = mounts.start()
    wkit.write_file(m.path / "src/written.bin", b"written here")
    inside["src/written.bin"] = b"written here"
    os.rename(m.path / "src", m.path / "dst")
    assert not (m.path / "src").exists()
    for k, v in inside.items():
        assert wkit.read_uncached(m.path / ("dst" + k[3:])) == v, k
    expected = {k: None for k in inside} | {"dst" + k[3:]: v for k, v in inside.items()}
    wkit.assert_bucket_has(s3, bucket, expected, timeout=LAG)


def test_rename_of_a_directory_over_the_limit_is_exdev_and_mv_copies(mounts, s3, bucket):
    m = mounts.start("--rename-max-objects", "3")
    os.mkdir(m.path / "many")
    want = {f"f{i}.bin": wkit.payload(f"many{i}", 5000 + i) for i in range(5)}
    for n, v in want.items():
        wkit.write_file(m.path / "many" / n, v)
    with pytest.raises(OSError) as e:
        os.rename(m.path / "many", m.path / "moved")
    assert e.value.errno == errno.EXDEV
    assert sorted(os.listdir(m.path / "many")) == sorted(want)  # nothing moved
    # a directory within the limit still renames
    os.mkdir(m.path / "few")
    wkit.write_file(m.path / "few/only.bin", b"only")
    os.rename(m.path / "few", m.path / "few2")
    assert (m.path / "few2/only.bin").read_bytes() == b"only"
    # mv falls back to copy + delete
    r = subprocess.run(["mv", str(m.path / "many"), str(m.path / "moved")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (m.path / "many").exists()
    assert sorted(os.listdir(m.path / "moved")) == sorted(want)
    for n, v in want.items():
        assert wkit.read_uncached(m.path / "moved" / n) == v, n
    expected = {f"many/{n}": None for n in want} | {f"moved/{n}": v for n, v in want.items()}
    wkit.assert_bucket_has(s3, bucket, expected, timeout=LAG)


MTIME_NS = 1_600_000_000_250_000_000
ATIME_NS = 1_500_000_000_000_000_000


def set_attrs(p) -> None:
    os.chmod(p, 0o600)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(ATIME_NS, MTIME_NS))


def assert_attrs(p, when: str) -> None:
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600, when
    assert (st.st_uid, st.st_gid) == (1234, 5678), when
    assert abs(st.st_mtime_ns - MTIME_NS) < 1_000_000, when  # to the millisecond at least


def test_chmod_chown_and_utime_are_visible_through_stat(mounts):
    m = mounts.start()
    p = m.path / "attrs.bin"
    wkit.write_file(p, b"attrs")
    set_attrs(p)
    assert_attrs(p, "right after the calls")
    assert p.read_bytes() == b"attrs"


def test_chmod_chown_and_utime_are_kept_after_the_attribute_cache_expires(mounts):
    m = mounts.start("--metadata-ttl", "1")
    p = m.path / "attrs.bin"
    wkit.write_file(p, b"attrs")
    set_attrs(p)
    time.sleep(2.5)  # past the kernel's attribute timeout and the daemon's metadata TTL
    assert_attrs(p, "after the 1 s metadata TTL expired (kernel asks tierfs again)")
    assert p.read_bytes() == b"attrs"


def test_symlink_and_readlink(mounts):
    m = mounts.start()
    wkit.write_file(m.path / "target.bin", b"pointed at")
    os.symlink("target.bin", m.path / "link")
    os.symlink("../no/such/thing", m.path / "dangling")
    assert os.readlink(m.path / "link") == "target.bin"
    assert os.readlink(m.path / "dangling") == "../no/such/thing"
    assert stat.S_ISLNK(os.lstat(m.path / "link").st_mode)
    assert (m.path / "link").read_bytes() == b"pointed at"
    assert sorted(os.listdir(m.path)) == ["dangling", "link", "target.bin"]


def test_statfs_reports_sizes(mounts):
    m = mounts.start()
    st = os.statvfs(m.path)
    assert st.f_bsize > 0 and st.f_frsize > 0
    assert st.f_blocks > 0 and st.f_bavail > 0
    assert shutil.disk_usage(m.path).total > 0


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_fsync_and_fdatasync_make_the_data_durable_in_s3(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    a = wkit.payload("sync-a", 2 * MiB + 1)
    b = wkit.payload("sync-b", 10 * MiB + 3)  # grows past one part: multipart on the 2nd sync
    fd = os.open(m.path / "synced.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, a)
        os.fsync(fd)
        assert wkit.s3_get(s3, bucket, "synced.bin") == a  # while still open
        os.write(fd, b)
        os.fdatasync(fd)
        assert wkit.s3_get(s3, bucket, "synced.bin") == a + b
    finally:
        os.close(fd)
    assert wkit.read_uncached(m.path / "synced.bin") == a + b


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_unlink_right_after_close_never_brings_the_file_back(mounts, s3, bucket, mode):
    """An unlink that races the upload of the file just closed (write-back: the upload
    runs in the background) wins: once uploads have drained, the file is gone everywhere."""
    m = mounts.start(*wkit.MODES[mode])
    os.mkdir(m.path / "race")
    names = [f"f{i}.bin" for i in range(12)]
    for i, n in enumerate(names):
        wkit.write_file(m.path / "race" / n, wkit.payload(n, [100, 300 * KiB, 9 * MiB][i % 3]))
        os.unlink(m.path / "race" / n)
    if mode == "writeback":
        wkit.eventually(lambda: m.counter("tierfs_writeback_dirty_bytes") == 0)
    assert os.listdir(m.path / "race") == []
    wkit.assert_bucket_has(s3, bucket, {f"race/{n}": None for n in names}, timeout=LAG)
    # and still so when the listing comes from the bucket again
    m = mounts.remount(m, cache="cache2")
    assert os.listdir(m.path / "race") == []
