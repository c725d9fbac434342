"""Reads through a real FUSE mount against the real Ceph RGW."""

from __future__ import annotations

import errno
import os
import random
import signal
import threading
import time

import pytest
from helpers import drop_page_cache, payload, put_many, read_uncached, sha

MiB = 1 << 20


def test_large_and_small_objects_read_byte_exact(rgw, bucket, mounts):
    objects = {
        "data/big.bin": payload("big", 21 * MiB + 12345),  # 3 chunks at 8 MiB, ragged tail
        "data/exact.bin": payload("exact", 8 * MiB),  # exactly one chunk
        "data/small.txt": b"hello tierfs\n",
        "data/empty": b"",
        "top.bin": payload("top", 70_000),
    }
    put_many(rgw.client(), bucket, objects)
    with mounts.start() as m:
        for key, data in objects.items():
            got = (m.path / key).read_bytes()
            assert sha(got) == sha(data), key
        assert os.stat(m.path / "data/big.bin").st_size == len(objects["data/big.bin"])
        # a small object takes exactly one GET
        before = m.counter("tierfs_backend_requests_total", op="get")
        read_uncached(m.path / "top.bin")
        assert m.counter("tierfs_backend_requests_total", op="get") == before
        with open(m.path / "data/big.bin", "rb") as f:
            rnd = random.Random(7)
            big = objects["data/big.bin"]
            for _ in range(200):
                off = rnd.randrange(len(big))
                n = rnd.choice([1, 4096, 100_000, 3 * MiB])
                assert os.pread(f.fileno(), n, off) == big[off:off + n]


def test_prefix_source_mounts_a_subtree(rgw, bucket, mounts):
    put_many(rgw.client(), bucket, {"team/a/x.bin": b"x" * 10, "other/y.bin": b"y"})
    with mounts.start(source=f"s3://{bucket}/team") as m:
        assert sorted(os.listdir(m.path)) == ["a"]
        assert (m.path / "a/x.bin").read_bytes() == b"x" * 10


def test_concurrent_readers_get_exact_bytes_and_one_fetch_per_chunk(rgw, bucket, mounts):
    files = {f"c/f{i}.bin": payload(f"c{i}", 9 * MiB + i) for i in range(4)}
    put_many(rgw.client(), bucket, files)
    errors: list[str] = []

    def reader(n: int) -> None:
        rnd = random.Random(n)
        for _ in range(40):
            key = rnd.choice(list(files))
            data = files[key]
            off = rnd.randrange(len(data))
            size = rnd.choice([4096, 128 * 1024, 2 * MiB])
            with open(m.path / key, "rb") as f:
                got = os.pread(f.fileno(), size, off)
            if got != data[off:off + size]:
                errors.append(f"{key} at {off}+{size}")

    with mounts.start("--memory-cache-size", "512M") as m:
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # 4 files x 2 chunks: however many readers raced, each chunk came from S3 once
        assert m.counter("tierfs_backend_requests_total", op="get") <= 8


def test_restart_serves_cached_data_with_zero_gets(rgw, bucket, tmp_path, mounts):
    objects = {f"ds/shard{i}.bin": payload(f"s{i}", 5 * MiB + i) for i in range(3)}
    objects.update({f"ds/small/{i:03}.txt": payload(i, 3000 + i) for i in range(50)})
    put_many(rgw.client(), bucket, objects)
    with mounts.start() as m:
        for key, data in objects.items():
            assert (m.path / key).read_bytes() == data
        assert m.counter("tierfs_backend_requests_total", op="get") == len(objects)
    inode_before = os.stat(tmp_path / "mnt").st_ino  # not mounted now: the bare directory
    # metadata TTL 0: the restarted daemon revalidates every entry (LIST/HEAD), yet the
    # ETags are unchanged, so every byte still comes from the disk tier
    with mounts.start("--metadata-ttl", "0") as m:
        for key, data in objects.items():
            assert (m.path / key).read_bytes() == data
        assert m.counter("tierfs_backend_requests_total", op="get") == 0
        assert m.counter("tierfs_read_bytes_total", source="backend") == 0
        assert m.counter("tierfs_read_bytes_total", source="disk") == sum(map(len, objects.values()))
        ino1 = os.stat(m.path / "ds/shard1.bin").st_ino
    with mounts.start() as m:
        assert os.stat(m.path / "ds/shard1.bin").st_ino == ino1  # stable inode numbers
    assert inode_before


def test_corrupt_chunk_file_is_refetched_never_served(rgw, bucket, tmp_path, mounts):
    data = payload("corrupt", 3 * MiB)
    put_many(rgw.client(), bucket, {"f.bin": data})
    cache = tmp_path / "cache"
    args = ["--chunk-size", "1M", "--memory-cache-size", "0"]
    with mounts.start(*args) as m:
        assert (m.path / "f.bin").read_bytes() == data
        time.sleep(1.5)  # let the index flush
    chunk_files = sorted(p for p in (cache / "chunks").rglob("*") if p.is_file())
    assert len(chunk_files) == 3
    victim = chunk_files[1]
    raw = bytearray(victim.read_bytes())
    raw[12345] ^= 0xFF
    victim.write_bytes(bytes(raw))
    chunk_files[2].unlink()  # a missing file is handled the same way
    with mounts.start(*args) as m:
        assert (m.path / "f.bin").read_bytes() == data
        assert m.counter("tierfs_cache_corrupt_chunks_total") == 1
        # the corrupt chunk and the missing one were fetched again, the good one was not
        assert m.counter("tierfs_backend_requests_total", op="get") == 2
        # a chunk corrupted while mounted is caught on the next read too
        victim = sorted(p for p in (cache / "chunks").rglob("*") if p.is_file())[0]
        raw = bytearray(victim.read_bytes())
        raw[0] ^= 0x01
        victim.write_bytes(bytes(raw))
        assert read_uncached(m.path / "f.bin") == data
        assert "fails its checksum" in m.log_text()


def test_object_overwritten_behind_the_mount(rgw, bucket, mounts):
    s3 = rgw.client()
    old, new = payload("old", 3 * MiB), payload("new", 3 * MiB + 5)
    s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=old)
    with mounts.start("--metadata-ttl", "1", "--chunk-size", "1M") as m:
        path = m.path / "ckpt.bin"
        assert path.read_bytes() == old
        # a handle opened before the overwrite that has served nothing moves to the new version
        f = open(path, "rb")
        s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=new)
        time.sleep(1.2)
        drop_page_cache(path)
        got = f.read()
        f.close()
        assert got in (old, new)  # never a mix of both
        # once revalidated, the new bytes and only those are served
        deadline = time.monotonic() + 10
        while (got := read_uncached(path)) != new and time.monotonic() < deadline:
            assert got == old
            time.sleep(0.3)
        assert got == new
        # a handle that served old bytes, then meets the new version: ESTALE, not a mix
        s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=old)
        time.sleep(1.2)
        with open(path, "rb") as f:
            first = f.read(4096)
            s3.put_object(Bucket=bucket, Key="ckpt.bin", Body=new)
            try:
                rest = f.read()
                assert first + rest in (old, new)
            except OSError as exc:
                assert exc.errno == errno.ESTALE


def test_read_only_mount_refuses_writes(rgw, bucket, mounts):
    put_many(rgw.client(), bucket, {"a.txt": b"a"})
    with mounts.start("--read-only") as m:
        for action in (lambda: open(m.path / "new.txt", "w"),
                       lambda: open(m.path / "a.txt", "a"),
                       lambda: os.mkdir(m.path / "d"),
                       lambda: os.unlink(m.path / "a.txt")):
            with pytest.raises(OSError) as exc:
                action()
            assert exc.value.errno == errno.EROFS
        assert (m.path / "a.txt").read_bytes() == b"a"


def test_sigterm_unmounts_cleanly_and_keeps_the_cache(rgw, bucket, mounts):
    data = payload("term", 2 * MiB)
    put_many(rgw.client(), bucket, {"t.bin": data})
    m = mounts.start()
    assert (m.path / "t.bin").read_bytes() == data
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=30) == 0
    assert not os.path.ismount(m.path)
    m.stop()
    with mounts.start() as m2:
        assert (m2.path / "t.bin").read_bytes() == data
        assert m2.counter("tierfs_backend_requests_total", op="get") == 0


def test_a_folder_read_in_order_is_fetched_ahead_and_each_file_once(rgw, bucket, mounts):
    # a loader walking an image folder, as `cat img/*` does: once its opens follow the
    # listing, the next small files are fetched before their open (tierfs/read/dirahead.py)
    objects = {f"img/{i:04}.jpg": payload(f"img{i}", 2000 + 37 * i) for i in range(120)}
    put_many(rgw.client(), bucket, objects)
    with mounts.start() as m:
        for key in sorted(objects):
            assert sha((m.path / key).read_bytes()) == sha(objects[key]), key
        ahead = m.counter("tierfs_dir_readahead_files_total")
        assert ahead >= 100  # all but the first few, and what the listing raced
        # every object came from the store once: read ahead or by its own open, not both
        assert m.counter("tierfs_backend_requests_total", op="get") == len(objects)
        # and its bytes count as the store's, not as cache hits of what read-ahead brought
        total = sum(len(v) for v in objects.values())
        assert m.counter("tierfs_read_bytes_total", source="backend") == total
