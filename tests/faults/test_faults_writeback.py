"""Faults on the write path, through the proxy against the real RGW (issue 9, rows D2, D3,
N1): part uploads refused, the store down across an unmount and a remount, ENOSPC during
write(). The daemon never dies and every acknowledged file reaches the bucket exactly once
the store answers again; a write that failed makes close() fail and never replaces the
object with a partial file."""

from __future__ import annotations

import errno
import os
import time

import fkit
import pytest
from fkit import KiB, MiB

UPLOADS = {"PUT", "CreateMultipart", "UploadPart", "Complete", "Copy"}


def test_d2_refused_part_uploads_do_not_kill_the_daemon(mounts, s3, bucket, proxy):
    """D2: --writeback; every UploadPart of a multipart upload is refused (connection reset
    at once): the daemon lives, retries, and the file reaches the bucket once parts go
    through again; no multipart upload is left behind."""
    m = mounts.start("--writeback")
    proxy.inject("refuse", "UploadPart")
    data = fkit.payload("d2", 20 * MiB + 17)  # three parts
    fkit.write_file(m.path / "d2.bin", data)  # write-back: close() returns once journaled
    # the uploader has failed at least once and tried again
    fkit.eventually(lambda: proxy.injected("refuse", op="UploadPart") >= 7, 60, alive_of=m)
    fkit.assert_alive(m, "after refused part uploads")
    assert fkit.s3_get(s3, bucket, "d2.bin") is None
    proxy.heal()
    fkit.eventually(lambda: not fkit.bucket_differs(s3, bucket, {"d2.bin": data}),
                    fkit.BUCKET_LAG, alive_of=m)
    fkit.eventually(lambda: fkit.open_uploads(s3, bucket) == [], 30, alive_of=m)
    fkit.assert_alive(m)


def test_d3_store_down_across_unmount_and_remount(mounts, s3, bucket, proxy):
    """D3: --writeback while the store refuses every connection (so uploads that were about
    to start a multipart upload leave a record without an upload id), `unmount` with the
    store down, the store comes back, mount again: recovery uploads every acknowledged file
    while orphan cleanup runs (it must not abort the uploads recovery has just started), the
    daemon lives, and no multipart upload is left."""
    m = mounts.start("--writeback", "--drain-timeout", "3s")
    os.mkdir(m.path / "d3")
    proxy.inject("refuse", None)  # every request: connection reset at once
    files = {f"d3/big{i}.bin": fkit.payload(f"d3.big{i}", 12 * MiB + 1000 * i) for i in range(3)}
    files |= {f"d3/small{i}.bin": fkit.payload(f"d3.small{i}", 100 * KiB + i) for i in range(2)}
    for k, v in files.items():
        fkit.write_file(m.path / k, v)  # acknowledged: journaled

    # an upload got as far as CreateMultipart (its record has no upload id); the others try
    # too (or the daemon, having seen the store down, holds them back)
    fkit.eventually(lambda: proxy.injected("refuse", op="CreateMultipart") >= 1, 60,
                    alive_of=m)
    time.sleep(2.0)
    proxy.down()
    m.stop()  # `tierfs unmount`: the drain fails, the journal keeps the files
    assert fkit.bucket_differs(s3, bucket, files) and fkit.open_uploads(s3, bucket) == []
    proxy.heal()
    m = mounts.again(m)
    fkit.eventually(lambda: not fkit.bucket_differs(s3, bucket, files), fkit.BUCKET_LAG,
                    alive_of=m)
    fkit.eventually(lambda: fkit.open_uploads(s3, bucket) == [], 30, alive_of=m)
    time.sleep(1.0)  # orphan cleanup and recovery have both run: still alive
    fkit.assert_alive(m, "after recovery")
    assert sorted(os.listdir(m.path / "d3")) == sorted(k.split("/")[1] for k in files)


@pytest.mark.parametrize("mode", ["default", "writeback"])
def test_n1_enospc_in_write_fails_close_and_keeps_the_object(mounts, s3, bucket, proxy, mode):
    """N1: a checkpoint overwrite whose write() gets ENOSPC (dirty budget full): close()
    fails too, and the object in the bucket stays the old one (not the partial file), also
    after a clean unmount (which uploads whatever is pending). The fault here is the local
    cache budget; the store (through the proxy) is healthy."""
    old = fkit.payload("n1.old", 3 * MiB)
    s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=old)
    extra = ["--writeback"] if mode == "writeback" else []
    m = mounts.start(*extra, "--cache-size", "16M", "--dirty-wait", "1s")
    fd = os.open(m.path / "ckpt.bin", os.O_WRONLY | os.O_TRUNC)
    written, write_error, close_error = 0, None, None
    try:
        while written < 40 * MiB:
            try:
                written += os.write(fd, fkit.payload(f"n1.{written}", MiB))
            except OSError as e:
                write_error = e
                break
    finally:
        try:
            os.close(fd)
        except OSError as e:
            close_error = e
    assert write_error is not None and write_error.errno == errno.ENOSPC, (written, write_error)
    assert close_error is not None, (
        f"close() returned 0 after write() failed with ENOSPC ({written >> 20} MiB written)")
    assert close_error.errno in (errno.ENOSPC, errno.EIO), close_error
    fkit.assert_alive(m)
    m.stop()  # a clean unmount drains pending uploads
    got = fkit.s3_get(s3, bucket, "ckpt.bin")
    assert got == old, f"the bucket's ckpt.bin is now {fkit.short(got)}, was {fkit.short(old)}"
