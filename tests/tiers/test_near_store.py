"""A near object store before the source, through real mounts over two real Ceph RGWs
(docs/tiers.md): what one node reads from the source is copied to the near store, and
the next node reads the copy instead of the source; a copy is served only while it is a
copy of the source's current version and its bytes check out; a near store that does not
answer is skipped."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

from rgw import s3_env

MiB = 1 << 20


def _wait(pred, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or pred}")
        time.sleep(0.1)


def _mount(mounts, near, *extra: str, cache: str, mnt: str):
    m = mounts.mount(*near.args, *extra, cache=cache, mnt=mnt)
    m.env = near.env(m.env)
    return m.start()


def _copied(near, key: str, etag: str) -> bool:
    try:
        head = near.s3.head_object(Bucket=near.bucket, Key=near.key(key))
    except near.s3.exceptions.ClientError:
        return False
    return head["Metadata"].get("tierfs-origin-etag") == etag


def _read(m, key: str) -> bytes:
    with open(os.path.join(m.mountpoint, key), "rb") as f:
        return f.read()


def _etag(s3, bucket: str, key: str) -> str:
    return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def test_a_second_node_reads_what_the_first_read_from_the_near_copy(rgw, bucket, mounts, near):
    s3 = mounts.s3
    files = {"data/small.bin": os.urandom(300_000), "data/big.bin": os.urandom(13 * MiB + 5)}
    for key, data in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    a = _mount(mounts, near, cache="cache-a", mnt="mnt-a")
    for key, data in files.items():
        assert _read(a, key) == data
    for key in files:  # promoted in the background: the big one in two parts + a copy
        _wait(lambda k=key: _copied(near, k, _etag(s3, bucket, k)), what=f"copy of {key}")
    assert a.counter("tierfs_tier_promotions_total", tier="near", outcome="copied") == 2
    got_a = a.counter("tierfs_backend_requests_total", op="get")
    assert got_a == 3  # each chunk (8 MiB) once from the source, copies included
    meta = near.s3.head_object(Bucket=near.bucket, Key=near.key("data/big.bin"))["Metadata"]
    assert "tierfs-crc32c" in meta and meta["tierfs-origin-size"] == str(13 * MiB + 5)

    b = _mount(mounts, near, cache="cache-b", mnt="mnt-b")
    for key, data in files.items():
        assert hashlib.sha256(_read(b, key)).digest() == hashlib.sha256(data).digest()
    assert b.counter("tierfs_backend_requests_total", op="get") == 0  # nothing from the source
    assert b.counter("tierfs_tier_bytes_total", tier="near", direction="read") == \
        sum(len(d) for d in files.values())
    # bytes returned to readers by source: none from the source (a chunk read ahead and
    # read after the kernel's own read-ahead may count under memory)
    assert b.counter("tierfs_read_bytes_total", source="backend") == 0
    assert b.counter("tierfs_read_bytes_total", source="near") > 12 * MiB
    assert b.counter("tierfs_tier_up", tier="near") == 1
    status = subprocess.run([sys.executable, "-m", "tierfs", "status", b.mountpoint],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"s3://{near.bucket}/{near.prefix}: answering" in status.stdout
    assert "chunks: 3 read, 0 missing, 0 failed" in status.stdout


def test_a_copy_of_an_older_version_is_not_served(rgw, bucket, mounts, near):
    s3 = mounts.s3
    old, new = os.urandom(2 * MiB), os.urandom(2 * MiB)
    s3.put_object(Bucket=bucket, Key="f.bin", Body=old)
    a = _mount(mounts, near, cache="cache-a", mnt="mnt-a")
    assert _read(a, "f.bin") == old
    _wait(lambda: _copied(near, "f.bin", _etag(s3, bucket, "f.bin")), what="the copy")
    s3.put_object(Bucket=bucket, Key="f.bin", Body=new)  # same size, new version
    b = _mount(mounts, near, cache="cache-b", mnt="mnt-b")
    assert _read(b, "f.bin") == new
    assert b.counter("tierfs_read_bytes_total", source="near") == 0
    assert b.counter("tierfs_backend_requests_total", op="get") == 1


def test_a_near_copy_with_wrong_bytes_is_refused_and_the_source_read(rgw, bucket, mounts, near):
    """An attacker (or bit rot) on the near store: a copy with the right version in its
    metadata and the right chunk CRCs, but other bytes. The CRCs catch it; the read is
    served from the source, right."""
    s3 = mounts.s3
    data = os.urandom(3 * MiB)
    s3.put_object(Bucket=bucket, Key="g.bin", Body=data)
    a = _mount(mounts, near, cache="cache-a", mnt="mnt-a")
    assert _read(a, "g.bin") == data
    _wait(lambda: _copied(near, "g.bin", _etag(s3, bucket, "g.bin")), what="the copy")
    meta = near.s3.head_object(Bucket=near.bucket, Key=near.key("g.bin"))["Metadata"]
    bad = bytearray(data)
    bad[MiB] ^= 0x01
    near.s3.put_object(Bucket=near.bucket, Key=near.key("g.bin"), Body=bytes(bad), Metadata=meta)
    b = _mount(mounts, near, cache="cache-b", mnt="mnt-b")
    assert _read(b, "g.bin") == data
    assert b.counter("tierfs_integrity_failures_total") >= 1
    assert b.counter("tierfs_read_bytes_total", source="near") == 0
    assert "near store" in b.log_text()


def test_a_near_store_that_does_not_answer_is_skipped(rgw, bucket, mounts, near, tmp_path):
    s3 = mounts.s3
    data = os.urandom(MiB)
    s3.put_object(Bucket=bucket, Key="h.bin", Body=data)
    import socket
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    m = mounts.mount("--tier", "s3://nowhere/", "--tier-endpoint-url",
                     f"http://127.0.0.1:{port}", "--tier-profile", "near",
                     cache="cache-c", mnt="mnt-c")
    m.env = near.env(m.env)
    m.start()  # the mount does not wait for the near store
    assert _read(m, "h.bin") == data
    assert m.counter("tierfs_tier_up", tier="near") == 0
    assert "near store unreachable" in m.log_text()


def test_tier_options_are_checked_with_one_line(rgw, bucket, tmp_path):
    env = s3_env(rgw)
    for args, why in (
        (["--tier-endpoint-url", "http://127.0.0.1:1"], "only with --tier"),
        (["--tier", f"s3://{bucket}/", "--tier-endpoint-url", rgw.endpoint],
         "overlaps the source"),
        (["--tier", "s3://x"], "invalid bucket name"),
        (["--tier", "s3://near-b/", "--promote", "sometimes"], "invalid promote"),
    ):
        (tmp_path / "mnt").mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "tierfs", "mount", f"s3://{bucket}",
                            str(tmp_path / "mnt"), "--endpoint-url", rgw.endpoint, *args],
                           env=env, capture_output=True, text=True, timeout=60)
        if r.returncode == 0:  # mounted in the background after all: do not leave it
            subprocess.run([sys.executable, "-m", "tierfs", "unmount", str(tmp_path / "mnt")],
                           timeout=60)
        assert r.returncode != 0, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and why in lines[0], r.stderr
        assert "Traceback" not in r.stderr


def _tierfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True, timeout=120)


def test_warm_near_fills_the_near_store_not_this_nodes_cache(rgw, bucket, mounts, near):
    s3 = mounts.s3
    files = {f"set/{i}.bin": os.urandom(700_000 * (i + 1)) for i in range(4)}
    files["set/big.bin"] = os.urandom(9 * MiB)
    for key, data in files.items():
        s3.put_object(Bucket=bucket, Key=key, Body=data)
    total = sum(len(d) for d in files.values())
    a = _mount(mounts, near, cache="cache-a", mnt="mnt-a")
    setdir = os.path.join(a.mountpoint, "set")
    r = _tierfs("warm", "--check", "--tier", "near", setdir)
    assert r.returncode == 3, r.stderr  # as a local check: not all of the set is there
    assert "0 B in the near store already" in r.stdout, r.stdout
    r = _tierfs("warm", "--tier", "near", setdir)
    assert r.returncode == 0, r.stderr
    assert "copied" in r.stdout, r.stdout
    for key in files:
        assert _copied(near, key, _etag(s3, bucket, key)), key
    # nothing of it in this node's cache: the copy went from the source to the near store
    local = _tierfs("warm", "--check", setdir)
    assert local.returncode == 3 and "0 B cached" in local.stdout, local.stdout
    assert a.counter("tierfs_backend_bytes_total") == total  # each byte once from the source
    assert _tierfs("warm", "--check", "--tier", "near", setdir).returncode == 0
    again = _tierfs("warm", "--tier", "near", setdir)  # a rerun copies nothing
    assert again.returncode == 0 and "0 B copied" in again.stdout, again.stdout
    assert a.counter("tierfs_backend_bytes_total") == total
    refused = _tierfs("warm", "--tier", "near", "--pin", setdir)
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1

    b = _mount(mounts, near, cache="cache-b", mnt="mnt-b")
    # a job's prolog on another node: its cache filled from the near store, not the WAN
    warm_b = _tierfs("warm", os.path.join(b.mountpoint, "set"))
    assert warm_b.returncode == 0, warm_b.stderr
    assert b.counter("tierfs_tier_bytes_total", tier="near", direction="read") == total
    for key, data in files.items():
        assert _read(b, key) == data
    assert b.counter("tierfs_backend_requests_total", op="get") == 0


def test_gc_and_evict_of_the_near_store(rgw, bucket, mounts, near):
    s3 = mounts.s3
    for name in ("a", "b", "c"):
        s3.put_object(Bucket=bucket, Key=f"g/{name}.bin", Body=os.urandom(MiB))
    m = _mount(mounts, near, "--metadata-ttl", "0", cache="cache-a", mnt="mnt-a")
    gdir = os.path.join(m.mountpoint, "g")
    assert _tierfs("warm", "--tier", "near", gdir).returncode == 0
    s3.put_object(Bucket=bucket, Key="g/a.bin", Body=os.urandom(MiB))  # a's copy goes stale
    dry = _tierfs("gc", "--tier", "near", m.mountpoint, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "3 copies; 1 stale (1.0 MiB)" in dry.stdout and "would go" in dry.stdout, dry.stdout
    assert _copied(near, "g/b.bin", _etag(s3, bucket, "g/b.bin"))
    r = _tierfs("gc", "--tier", "near", m.mountpoint, "--json")
    assert r.returncode == 0, r.stderr
    import json
    got = json.loads(r.stdout)
    assert (got["stale"], got["kept"], got["removed_bytes"]) == (1, 2, MiB)
    listed = near.s3.list_objects_v2(Bucket=near.bucket, Prefix=near.prefix).get("Contents", [])
    assert sorted(o["Key"] for o in listed) == [near.key("g/b.bin"), near.key("g/c.bin")]
    ev = _tierfs("evict", "--tier", "near", os.path.join(gdir, "b.bin"))
    assert ev.returncode == 0, ev.stderr
    listed = near.s3.list_objects_v2(Bucket=near.bucket, Prefix=near.prefix).get("Contents", [])
    assert [o["Key"] for o in listed] == [near.key("g/c.bin")]
    assert _read(m, "g/b.bin")  # the source keeps the file
    bad = _tierfs("gc", "--tier", "near")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
