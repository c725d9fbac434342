"""Write faults through a real mount on the real RGW (the in-process cases are in
test_upload_faults.py; tests/faults/test_faults_writeback.py drives D2, D3 and N1 through
the fault proxy):

  D3  --writeback, uploads refused (AccessDenied, so no upload exists and no record is
      left behind), unmount, uploads allowed again, mount: the recovered files are
      uploaded without any upload restarted under them (orphan cleanup does not abort
      them), the daemon stays up and no multipart upload is left
"""

from __future__ import annotations

import wkit
from wkit import MiB


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
    m = mounts.again(m)
    wkit.assert_bucket_has(s3, bucket, files, timeout=wkit.BUCKET_LAG)
    wkit.eventually(lambda: not wkit.open_uploads(s3, bucket))
    assert m.alive()
    for key, data in files.items():
        assert wkit.read_uncached(m.path / key) == data, key
    assert not [ln for ln in m.log_text().splitlines() if "vanished" in ln]
