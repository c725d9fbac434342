"""Write-back under object-store faults, in process (tests/writes/wbkit.py): WriteBack with
its upload workers and orphan cleanup, over a FileBackend or the real RGW behind a fault
switchboard. Retry delays are shrunk to tens of milliseconds; nothing asserts timing.

  part failures       retried, then the object is exact (D2: a failed part no longer takes
                      the daemon down as an ExceptionGroup)
  store down / back   acknowledged files reach the bucket without a remount; a file that
                      keeps failing does not hold up the others
  unmount while down  the D3 scenario: recovery + orphan cleanup never abort a recovered
                      upload; every acknowledged file lands, no multipart upload is left
  NoSuchUpload        an upload that vanished is started again from scratch
  failed write (N1)   ENOSPC in write() fails fsync() and close(); nothing is uploaded over
                      the existing object unless the application then writes successfully
  CRC metadata        uploads carry the CRC32C of each chunk, as tierfs/integrity.py reads it
"""

from __future__ import annotations

import errno
import os

import pytest
import trio
from wbkit import MiB, FaultyBackend, file_backend, payload, wb_rig

from tierfs.backend.file import FileBackend
from tierfs.cache import ObjectVersion
from tierfs.errors import BackendError, BackendUnavailable, EarlierWriteFailed, NoSpace
from tierfs.integrity import crc32c, parse_chunk_crcs

CHUNK = MiB
BIG = 20 * MiB + 12345  # three 8 MiB parts, the last one short




def stored(inner: FileBackend, key: str) -> bytes | None:
    try:
        meta = inner.head(key)
    except Exception:  # noqa: BLE001 - NotFound
        return None
    return inner.get(key, 0, meta.size, None) if meta.size else b""


async def test_failed_parts_are_retried_and_the_object_is_exact(tmp_path):
    fb, inner = file_backend(tmp_path)
    data = payload("parts", BIG)
    # two failures of the same kind botocore gives up on, and one the part's retries run
    # out on (three in a row): the file is then retried as a whole
    fb.fail("upload_part", 2, BackendUnavailable("injected: connection refused"))
    async with wb_rig(tmp_path, fb) as r:
        await r.write_file(2, "big.bin", data)
        await r.settled()
        assert stored(inner, "big.bin") == data
        assert r.failures() == 0, "part retries should have absorbed two failures"
        fb.fail("upload_part", 3, BackendError("injected: 500"), part=2)
        data2 = payload("parts2", BIG)
        await r.write_file(3, "big2.bin", data2)
        await r.settled()
        assert stored(inner, "big2.bin") == data2
        assert r.failures() >= 1
        assert not inner.mpu_list("big.bin") and not inner.mpu_list("big2.bin")
        await r.wait_for(lambda: not r.meta.journal.uploads())  # no upload left recorded


async def test_a_bug_during_an_upload_loses_no_file_and_no_worker(tmp_path):
    """An exception tierfs does not expect (a bug) in the middle of an upload: reported,
    the file is retried, the workers live on (the backend boundary turns library errors
    into BackendError, so the bug is injected past it)."""
    fb, inner = file_backend(tmp_path)
    data = payload("bug", BIG)
    async with wb_rig(tmp_path, fb, workers=1) as r:
        real = r.wb.settler.uploaded
        calls = []

        async def buggy(d, new, *rest):
            calls.append(new)
            if len(calls) == 1:
                raise ExceptionGroup("injected bug", [RuntimeError("boom")])
            await real(d, new, *rest)

        r.wb.settler.uploaded = buggy
        await r.write_file(2, "bug.bin", data)
        await r.settled()
        assert stored(inner, "bug.bin") == data
        assert r.sample("tierfs_internal_errors_total", {"task": "upload"}) == 1
        await r.write_file(3, "after.bin", b"after")  # the one worker is still there
        await r.settled()
        assert stored(inner, "after.bin") == b"after"


async def test_store_down_then_back_uploads_without_remount_and_nothing_waits(tmp_path):
    fb, inner = file_backend(tmp_path)
    files = {f"f{i}.bin": payload(f"f{i}", size)
             for i, size in enumerate([0, 100, 3 * MiB, BIG])}
    async with wb_rig(tmp_path, fb) as r:
        fb.down = True
        for ino, (key, data) in enumerate(files.items(), start=10):
            await r.write_file(ino, key, data)  # write-back: close answers, uploads fail
        await r.wait_for(lambda: r.failures() >= 2 * len(files))  # each failed, then again
        assert all(stored(inner, k) is None for k in files)
        # one file that can never be uploaded must not hold up the others
        fb.poisoned.add("f0.bin")
        fb.down = False
        await r.wait_for(lambda: set(r.wb.files) == {10})
        for key, data in list(files.items())[1:]:
            assert stored(inner, key) == data, key
        # the poisoned file keeps its own backoff; once allowed it is uploaded too
        failed = r.failures()
        await r.wait_for(lambda: r.failures() >= failed + 2)
        fb.poisoned.clear()
        await r.settled()
        assert stored(inner, "f0.bin") == b""
        await r.wait_for(lambda: not r.meta.journal.uploads())
    assert not inner.mpu_list(list(files)[-1])


async def test_an_upload_that_vanished_is_started_again(tmp_path):
    fb, inner = file_backend(tmp_path)
    fb.vanish_uploads = 1  # aborted on the server before its first part (NoSuchUpload)
    data = payload("vanish", BIG)
    async with wb_rig(tmp_path, fb, writeback=False) as r:
        await r.write_file(2, "v.bin", data)  # default mode: close uploads
        assert stored(inner, "v.bin") == data
        assert fb.calls["mpu_create"] == 2
        assert r.failures() == 0
    assert not inner.mpu_list("v.bin")


async def test_uploads_carry_the_crc32c_of_each_chunk(tmp_path):
    fb, inner = file_backend(tmp_path)
    files = {"small.bin": payload("s", 2 * MiB + 7), "big.bin": payload("b", BIG)}
    async with wb_rig(tmp_path, fb, writeback=False) as r:
        for ino, (key, data) in enumerate(files.items(), start=2):
            await r.write_file(ino, key, data)
    for key, data in files.items():
        parsed = parse_chunk_crcs(inner.head(key).metadata)
        assert parsed is not None, key
        chunk, crcs = parsed
        assert chunk == CHUNK
        assert crcs == [crc32c(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)], key


@pytest.mark.parametrize("where", ["file", "rgw"])
async def test_unmount_while_the_store_is_down_then_mount_again(tmp_path, where, request):
    """D3: --writeback, the store stops answering, unmount, store back, mount: recovery and
    orphan cleanup run together; cleanup must abort only what no live file owns (here: the
    uploads of the failed attempts and one whose create answer was lost), never the
    uploads recovery starts. Every acknowledged file lands; no multipart upload is left."""
    if where == "rgw":
        rgw = request.getfixturevalue("rgw")
        bucket = request.getfixturevalue("bucket")
        from tierfs.backend.s3 import S3Backend

        os.environ.update(rgw.env())
        inner = S3Backend(bucket, endpoint_url=rgw.endpoint, region=rgw.region,
                          max_connections=16, timeout_s=30, max_attempts=2)
    else:
        src = tmp_path / "src"
        src.mkdir()
        inner = FileBackend(str(src))
        bucket = "bucket"
    files = {"a.bin": payload("a", BIG), "b.bin": payload("b", BIG),
             "c.bin": payload("c", 12 * MiB), "d.bin": payload("d", 5000)}

    fb = FaultyBackend(inner)
    async with wb_rig(tmp_path, fb, bucket=bucket) as r:
        # a.bin: created on the server, then the store goes away during its parts;
        # b.bin: the store created it but the answer was lost
        fb.fail("upload_part", 1000, BackendUnavailable("injected: connection refused"))
        fb.lose_create_answers = 1
        await r.write_file(2, "b.bin", files["b.bin"])
        await r.wait_for(lambda: fb.calls["mpu_create"] >= 1 and r.failures() >= 1)
        await r.write_file(3, "a.bin", files["a.bin"])
        await r.wait_for(lambda: r.failures() >= 3)
        fb.down = True
        for ino, key in enumerate(["c.bin", "d.bin"], start=4):
            await r.write_file(ino, key, files[key])
        await r.wait_for(lambda: r.failures() >= 6)
        assert not await r.wb.drain(0.2)  # unmount: nothing can be uploaded
    left = {u.upload_id for k in files for u in inner.mpu_list(k)}
    assert left, "the first mount should have left unfinished uploads on the server"

    fb2 = FaultyBackend(inner)  # the store answers again
    async with wb_rig(tmp_path, fb2, bucket=bucket) as r:
        assert len(r.wb.files) == len(files)
        await r.settled()
        await r.wait_for(lambda: not r.meta.journal.uploads())
        # no upload this mount started was aborted under it (it would have restarted)
        multipart = sum(len(d) > 8 * MiB for d in files.values())
        assert fb2.calls["mpu_create"] == multipart
        assert r.failures() == 0
    for key, data in files.items():
        got = inner.get(key, 0, len(data), None)
        assert bytes(got) == data, key
    assert not [u for k in files for u in inner.mpu_list(k)], "multipart uploads left"


@pytest.mark.parametrize("writeback", [False, True], ids=["default", "writeback"])
async def test_a_failed_write_fails_fsync_and_close_and_keeps_the_object(tmp_path, writeback):
    """N1: ENOSPC in write() makes fsync() and close() fail too, and the partial file is
    not uploaded over the existing object; a successful truncate + write afterwards is the
    application's new content, and that is saved."""
    fb, inner = file_backend(tmp_path)
    old = payload("old", 3 * MiB)
    meta = inner.put("ckpt.bin", old)
    base = ObjectVersion("bucket", "ckpt.bin", meta.etag, meta.size)
    async with wb_rig(tmp_path, fb, writeback=writeback, cache_size=6 * MiB,
                      dirty_wait_s=0.2) as r:
        for retry in (False, True):
            d = r.wb.open(2, "ckpt.bin", base, truncate=False, metadata={})
            with pytest.raises(NoSpace):
                for off in range(0, 64 * MiB, MiB):
                    await r.wb.write(d, off, payload(f"new{off}", MiB))
            for call in (r.wb.commit, r.wb.flush):  # fsync, then close
                with pytest.raises(EarlierWriteFailed) as e:
                    await call(d)
                assert e.value.errno == errno.ENOSPC
            if retry:  # the application starts over and succeeds: that is saved
                await r.wb.truncate(d, 0)
                await r.wb.write(d, 0, b"small and complete")
                await r.wb.flush(d)
                assert not await r.wb.release(d)
                await r.settled()
                assert stored(inner, "ckpt.bin") == b"small and complete"
            else:
                assert await r.wb.release(d)  # dropped
                assert not r.wb.files and r.cache.dirty_bytes == 0
                await trio.sleep(0.2)  # (write-back: nothing was queued to upload either)
                assert stored(inner, "ckpt.bin") == old
    assert fb.calls["put"] == 1 and fb.calls["mpu_create"] == 0


async def test_a_failed_write_never_drops_acknowledged_changes(tmp_path):
    """--writeback: a file closed (acknowledged) but not uploaded yet, then opened again and
    a write fails: that close fails, but the acknowledged bytes are still uploaded."""
    fb, inner = file_backend(tmp_path)
    first = payload("first", 2 * MiB)
    async with wb_rig(tmp_path, fb, cache_size=6 * MiB, dirty_wait_s=0.2) as r:
        fb.down = True
        await r.write_file(2, "log.bin", first)  # acknowledged, upload fails
        d = r.wb.open(2, "log.bin", None, truncate=False, metadata={})
        with pytest.raises(NoSpace):
            for off in range(len(first), 64 * MiB, MiB):
                await r.wb.write(d, off, payload(f"more{off}", MiB))
        grown = d.size
        with pytest.raises(EarlierWriteFailed):
            await r.wb.flush(d)
        assert not await r.wb.release(d)
        fb.down = False
        await r.settled()
        got = stored(inner, "log.bin")
        assert got is not None and len(got) == grown and got[:len(first)] == first


async def test_a_lost_create_answer_is_found_and_aborted_without_a_remount(tmp_path):
    """CreateMultipartUpload created an upload but its answer was lost: the file's next
    attempt succeeds with a new upload; the lost one (found by its Initiated time) is
    aborted by the cleanup task after that upload (woken by it), retried while the store
    fails the listing."""
    fb, inner = file_backend(tmp_path)
    fb.lose_create_answers = 1
    fb.fail("mpu_list", 2, BackendUnavailable("injected: connection refused"))
    data = payload("lost", BIG)
    async with wb_rig(tmp_path, fb) as r:
        await r.write_file(2, "lost.bin", data)
        await r.settled()
        assert stored(inner, "lost.bin") == data
        await r.wait_for(lambda: not inner.mpu_list("lost.bin") and not r.meta.journal.uploads())
        assert fb.calls["mpu_list"] >= 3 and fb.calls["mpu_create"] == 2


@pytest.mark.parametrize("writeback", [False, True], ids=["default", "writeback"])
async def test_a_partial_write_over_a_replaced_base_fails_before_success(tmp_path, writeback):
    """Issue 25 item 4: a partial write into a version another client has replaced, whose
    untouched bytes this node does not hold, fails with ESTALE at close (BaseChanged) and
    is dropped: never "success, then dropped", never retried for ever; the store keeps
    the other client's object."""
    from tierfs.errors import BaseChanged

    fb, inner = file_backend(tmp_path)
    old, theirs = payload("base", BIG), payload("theirs", BIG)
    inner.put("f.bin", old)
    base = inner.head("f.bin")
    async with wb_rig(tmp_path, fb, writeback=writeback) as r:
        d = await r.open(2, "f.bin", ObjectVersion("bucket", "f.bin", base.etag, base.size))
        await r.wb.write(d, 0, b"patch")  # chunk 0 read from the base, the rest untouched
        inner.put("f.bin", theirs)  # replaced before the upload; its old bytes are gone
        with pytest.raises(BaseChanged) as failed:
            await r.wb.flush(d)
        assert failed.value.errno == errno.ESTALE
        assert await r.wb.release(d)  # its changes dropped (logged), not queued
        await r.settled()
        assert stored(inner, "f.bin") == theirs
