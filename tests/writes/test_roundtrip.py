"""Files written through the mount come back byte-exact: through the mount, from the
bucket (boto3), after an unmount + remount, and - read back on the node that wrote them -
without a single GET."""

from __future__ import annotations

import os

import pytest
import wkit
from wkit import MiB, KiB

# name -> size: small single-PUT files and large multipart ones (parts are >= 8 MiB)
SIZES = {
    "rt/empty": 0,
    "rt/one": 1,
    "rt/page.bin": 4 * KiB,
    "rt/mib.bin": MiB,
    "rt/sub/dir/odd.bin": 3 * MiB + 17,
    "rt/large-20m.bin": 20 * MiB + 12345,
    "rt/large-33m.bin": 33 * MiB,
}

GETS = ("tierfs_backend_requests_total", {"op": "get"})


def files(tag: str = "") -> dict[str, bytes]:
    return {k: wkit.payload(k + tag, n) for k, n in SIZES.items()}


def write_all(m, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        (m.path / key).parent.mkdir(parents=True, exist_ok=True)
        wkit.write_file(m.path / key, data)


def lag(mode: str) -> float:
    """How long the bucket may lag a close(): not at all in default mode."""
    return wkit.BUCKET_LAG if mode == "writeback" else 0.0


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_written_files_read_back_byte_exact_through_the_mount(mounts, mode):
    m = mounts.start(*wkit.MODES[mode])
    objects = files()
    write_all(m, objects)
    for key, data in objects.items():
        assert os.stat(m.path / key).st_size == len(data), key
        got = wkit.read_uncached(m.path / key)
        assert got == data, f"{key}: mount returns {wkit.short(got)}, wrote {wkit.short(data)}"


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_written_files_are_byte_exact_in_the_bucket(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    objects = files()
    write_all(m, objects)
    wkit.assert_bucket_has(s3, bucket, objects, timeout=lag(mode))
    # nothing else under the written names' directory (no temporary or part objects)
    keys = {k for k in wkit.s3_keys(s3, bucket) if not k.endswith("/")}
    assert keys == set(objects)


def test_default_mode_object_is_in_the_bucket_when_close_returns(mounts, s3, bucket):
    m = mounts.start()
    for key, data in files("close").items():
        (m.path / key).parent.mkdir(parents=True, exist_ok=True)
        wkit.write_file(m.path / key, data)
        # no wait at all: close() returned, so the object must be there, complete
        got = wkit.s3_get(s3, bucket, key)
        assert got == data, f"{key}: right after close the bucket has {wkit.short(got)}"


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_written_files_survive_unmount_and_remount(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    objects = files("remount")
    write_all(m, objects)
    m = mounts.remount(m)  # same cache dir
    for key, data in objects.items():
        assert wkit.read_uncached(m.path / key) == data, f"{key} after remount (same cache)"
    # a new cache dir: whatever the mount shows must come from the bucket now
    m = mounts.remount(m, cache="cache2")
    wkit.assert_bucket_has(s3, bucket, objects, timeout=lag(mode))
    for key, data in objects.items():
        assert wkit.read_uncached(m.path / key) == data, f"{key} after remount (fresh cache)"


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_reading_back_what_this_node_wrote_issues_zero_gets(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    objects = files("zero")
    write_all(m, objects)
    # after the upload (immediate in default mode): the bytes stay cached under the new ETag
    wkit.assert_bucket_has(s3, bucket, objects, timeout=lag(mode))
    if mode == "writeback":
        wkit.eventually(lambda: m.counter("tierfs_writeback_dirty_bytes") == 0)
    before = m.counter(GETS[0], **GETS[1])
    for key, data in objects.items():
        assert wkit.read_uncached(m.path / key) == data, key
    assert m.counter(GETS[0], **GETS[1]) - before == 0


def test_written_bytes_stay_cached_across_a_remount(mounts, s3, bucket):
    m = mounts.start()
    objects = files("persist")
    write_all(m, objects)
    # metadata TTL 0: every open revalidates against S3; the ETags are the uploaded ones
    m = mounts.remount(m, "--metadata-ttl", "0")
    before = m.counter(GETS[0], **GETS[1])
    for key, data in objects.items():
        assert wkit.read_uncached(m.path / key) == data, key
    assert m.counter(GETS[0], **GETS[1]) - before == 0


def test_large_file_is_uploaded_as_multipart(mounts, s3, bucket):
    m = mounts.start()
    data = wkit.payload("mpu", 24 * MiB + 5)
    before = {op: m.counter("tierfs_backend_requests_total", op=op)
              for op in ("mpu_create", "upload_part", "mpu_complete", "put")}
    wkit.write_file(m.path / "mpu.bin", data)
    after = {op: m.counter("tierfs_backend_requests_total", op=op) for op in before}
    delta = {op: after[op] - before[op] for op in before}
    assert delta["mpu_create"] >= 1 and delta["mpu_complete"] >= 1, delta
    assert delta["upload_part"] >= 3, delta  # 24 MiB + 5 in parts of at most 8 MiB... or more
    assert wkit.s3_get(s3, bucket, "mpu.bin") == data
    assert wkit.open_uploads(s3, bucket) == []


def test_writeback_uploads_are_counted_and_dirty_bytes_drain(mounts, s3, bucket):
    m = mounts.start("--writeback")
    objects = {f"wb/{i}.bin": wkit.payload(f"wb{i}", 100 * KiB + i) for i in range(5)}
    write_all(m, objects)
    wkit.assert_bucket_has(s3, bucket, objects, timeout=wkit.BUCKET_LAG)
    wkit.eventually(lambda: m.counter("tierfs_writeback_dirty_bytes") == 0)
    assert m.counter("tierfs_writeback_uploads_total", outcome="success") >= len(objects)
    assert m.counter("tierfs_writeback_uploads_total", outcome="failure") == 0
    assert m.counter("tierfs_writeback_upload_seconds_count") >= len(objects)


def test_a_reader_opened_before_the_background_upload_ends_reads_the_new_content(mounts):
    """Write-back: a file is opened for reading while its upload is still running and read
    only after the upload has finished. It must read what was written (not the version
    before it, nor an empty file)."""
    m = mounts.start("--writeback")
    p = m.path / "fresh.bin"
    for i in range(4):  # i = 0: a new file; then overwrites of an uploaded version
        data = wkit.payload(f"fresh{i}", 6 * MiB + i * 1000)
        wkit.write_file(p, data)
        with open(p, "rb") as f:  # close() returned at once: the upload is under way
            wkit.eventually(lambda: m.counter("tierfs_writeback_dirty_bytes") == 0)
            got = f.read()
        assert got == data, f"round {i}: the reader got {wkit.short(got)}, wrote {wkit.short(data)}"
        assert os.stat(p).st_size == len(data), f"round {i}: size after the read"
