"""A damaged cache index (issue 9, row D5): data.mdb truncated or overwritten with garbage
between two mounts. The next mount must not die of it (no SIGBUS / SIGABRT): it moves the
index aside with a log line and serves exact bytes, and the write-back journal (kept apart
from the index) still gets every acknowledged file into the bucket."""

from __future__ import annotations

import os
import random

import fkit
import pytest
from fkit import KiB


def _damage(path: str, how: str) -> None:
    size = os.path.getsize(path)
    assert size >= 64 * KiB, f"{path} is only {size} bytes"
    if how == "truncated":
        os.truncate(path, (size // 2) & ~4095)
    else:  # 16 KiB of garbage in the middle
        with open(path, "r+b") as f:
            f.seek((size // 2) & ~4095)
            f.write(random.Random(how).randbytes(16 * KiB))
            f.flush()
            os.fsync(f.fileno())


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_d5_damaged_index_is_survived(mounts, s3, bucket, proxy, how):
    cached = {f"d5/c{i}.bin": fkit.payload(f"d5.{i}", 300 * KiB + i) for i in range(6)}
    for k, v in cached.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    m = mounts.start("--writeback")
    for k, v in cached.items():
        assert fkit.read(m.path / k) == v, k
    # an acknowledged write-back file whose upload cannot get through yet
    proxy.inject("503", {"PUT", "CreateMultipart", "UploadPart"})
    pending = fkit.payload("d5.pending", 200 * KiB)
    fkit.write_file(m.path / "d5/pending.bin", pending)  # close(): journaled
    fkit.eventually(lambda: proxy.injected("503") >= 1, 30, alive_of=m)
    m.kill9()  # a crash with unsaved data; then the index is damaged
    index = os.path.join(m.cache_dir, "index", "data.mdb")
    assert os.path.exists(index), sorted(os.listdir(m.cache_dir))
    _damage(index, how)
    proxy.heal()
    m = mounts.again(m)
    fkit.assert_alive(m, "after mounting a damaged index")
    for k, v in cached.items():
        got, err = fkit.read_errno(m.path / k)
        assert err is None and got == v, f"{k}: {fkit.short(got)} / errno {err}"
    fkit.eventually(lambda: not fkit.bucket_differs(s3, bucket, {"d5/pending.bin": pending}),
                    fkit.BUCKET_LAG, alive_of=m)
    assert fkit.read(m.path / "d5/pending.bin") == pending
    fkit.assert_alive(m)
