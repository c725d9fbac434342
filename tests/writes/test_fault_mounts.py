"""Write faults through a real mount on the real RGW (the in-process cases are in
test_upload_faults.py):

  N1  a write() that fails with ENOSPC makes close() fail too, and the existing object in
      the bucket is left as it was (default and --writeback)
  D3  --writeback, uploads refused, unmount, uploads allowed again, mount: the recovered
      files are uploaded (orphan cleanup does not abort them under recovery), the daemon
      stays up and no multipart upload is left
"""

from __future__ import annotations

import errno
import os

import pytest
import wkit
from wkit import MiB

TIGHT = ("--cache-size", "16M", "--dirty-wait", "1s")


@pytest.mark.parametrize("mode", ["default", "writeback"])
def test_enospc_in_write_fails_close_and_keeps_the_object(mounts, s3, bucket, mode):
    old = wkit.payload("old", 2 * MiB)
    s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=old)
    m = mounts.start(*wkit.MODES[mode], *TIGHT)
    fd = os.open(m.path / "ckpt.bin", os.O_WRONLY | os.O_TRUNC)
    error = None
    try:
        for i in range(40):
            os.write(fd, wkit.payload(f"new{i}", MiB))
    except OSError as e:
        error = e
    finally:
        with pytest.raises(OSError) as closed:
            os.close(fd)
    assert error is not None and error.errno == errno.ENOSPC, error
    assert closed.value.errno == errno.ENOSPC
    assert wkit.s3_get(s3, bucket, "ckpt.bin") == old
    assert wkit.read_uncached(m.path / "ckpt.bin") == old
    # nothing left to upload later either: the failed file's changes were dropped
    assert m.counter("tierfs_writeback_dirty_bytes") == 0
    assert m.counter("tierfs_writeback_uploads_total") == 0
    assert m.alive()


def test_uploads_refused_unmount_then_mount_again_uploads_everything(mounts, s3, bucket):
    files = {"big.bin": wkit.payload("big", 20 * MiB + 5), "mid.bin": wkit.payload("mid", 9 * MiB),
             "small.bin": wkit.payload("small", 4096)}
    m = mounts.start("--writeback", "--drain-timeout", "2s")
    with wkit.puts_denied(s3, bucket):
        for key, data in files.items():
            wkit.write_file(m.path / key, data)  # acknowledged: journaled
        wkit.eventually(lambda: m.counter("tierfs_writeback_uploads_total",
                                          outcome="failure") >= len(files))
        m.stop()
    m = mounts.start_again(m)
    wkit.assert_bucket_has(s3, bucket, files, timeout=wkit.BUCKET_LAG)
    wkit.eventually(lambda: not wkit.open_uploads(s3, bucket))
    assert m.alive()
    for key, data in files.items():
        assert wkit.read_uncached(m.path / key) == data, key
    assert not [ln for ln in m.log_text().splitlines() if "vanished" in ln]
