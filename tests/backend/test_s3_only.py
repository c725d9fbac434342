"""What only the S3 backend can show: credential and network failures, and key shapes a
directory cannot hold (invalid path names, a name that is both an object and a prefix),
seen through the Namespace and FileIO of the core on the real Ceph RGW."""

import os

import pytest

from tierfs.errors import AccessDenied, BackendUnavailable, StaleObject
from tierfs.index.inodes import ROOT_INO

from backends import closed_port, s3_backend, use_rgw_credentials
from unit.unitkit import core, sample  # tests/unit/unitkit.py


@pytest.fixture
def s3(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    return s3_backend(rgw, bucket)


@pytest.mark.parametrize("override", [
    {"AWS_SECRET_ACCESS_KEY": "wrong-secret-0000000000000000000000000000"},
    {"AWS_ACCESS_KEY_ID": "NOSUCHKEY00000000000"},
])
def test_bad_credentials_are_access_denied(rgw, bucket, monkeypatch, override):
    rgw.client().put_object(Bucket=bucket, Key="k", Body=b"data")
    use_rgw_credentials(monkeypatch, rgw, **override)
    b = s3_backend(rgw, bucket)
    with pytest.raises(AccessDenied):
        b.check()
    with pytest.raises(AccessDenied):
        b.list("", "/")
    with pytest.raises(AccessDenied):
        b.head("k")
    with pytest.raises(AccessDenied):
        b.get("k", 0, 4, None)


def test_no_credentials_at_all_are_access_denied(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AccessDenied):
        s3_backend(rgw, bucket).check()


def test_endpoint_where_nothing_listens_is_unavailable(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    b = s3_backend(rgw, bucket, endpoint_url=f"http://127.0.0.1:{closed_port()}",
                   max_attempts=1, timeout_s=5)
    with pytest.raises(BackendUnavailable):
        b.check()
    with pytest.raises(BackendUnavailable):
        b.get("k", 0, 10, None)
    with pytest.raises(BackendUnavailable):
        b.list("", "/")


def test_unreachable_backend_errors_are_counted(rgw, bucket, monkeypatch):
    use_rgw_credentials(monkeypatch, rgw)
    # through the AsyncBackend runner: a failed request is counted as a request and an error
    import trio

    from tierfs.backend.runner import AsyncBackend
    from tierfs.metrics import Metrics

    b = s3_backend(rgw, bucket, endpoint_url=f"http://127.0.0.1:{closed_port()}",
                   max_attempts=1, timeout_s=5)
    m = Metrics()

    async def go():
        ab = AsyncBackend(b, m, concurrency=2, background=1)
        with pytest.raises(BackendUnavailable):
            await ab.check()

    trio.run(go)
    assert sample(m, "tierfs_backend_requests_total", {"op": "head_bucket"}) == 1
    assert sample(m, "tierfs_backend_errors_total", {"op": "head_bucket"}) == 1


def put(rgw, bucket, keys, data=b"x"):
    c = rgw.client()
    for k in keys:
        c.put_object(Bucket=bucket, Key=k, Body=data)


async def test_invalid_keys_are_hidden_and_counted(rgw, bucket, s3, tmp_path):
    long = "n" * 256
    put(rgw, bucket, ["ok", "d//double", "./dot", "../dotdot", "x/./y", "x/../z", long,
                      "x/fine", "x/" + long])
    async with core(str(tmp_path), backend=s3, bucket=bucket) as c:
        root = await c.ns.listdir(ROOT_INO)
        assert [n for n, _ in root] == [b"d", b"ok", b"x"]
        d = dict(root)[b"d"]
        assert await c.ns.listdir(d.ino) == []  # "d//double" has an empty segment
        x = dict(root)[b"x"]
        assert [n for n, _ in await c.ns.listdir(x.ino)] == [b"fine"]
        hidden = sample(c.metrics, "tierfs_invalid_keys_total")
        assert hidden >= 5
        c.clock.advance(3600)  # listed again: hidden again, but counted once per key
        await c.ns.listdir(ROOT_INO)
        await c.ns.listdir(x.ino)
        assert sample(c.metrics, "tierfs_invalid_keys_total") == hidden


async def test_name_that_is_both_file_and_prefix_shows_the_directory(rgw, bucket, s3,
                                                                     tmp_path):
    put(rgw, bucket, ["both", "both/inner", "plain"])
    async with core(str(tmp_path), backend=s3, bucket=bucket) as c:
        via_lookup = await c.ns.lookup(ROOT_INO, b"both")  # before any listing
        assert via_lookup.is_dir
        root = dict(await c.ns.listdir(ROOT_INO))
        assert sorted(root) == [b"both", b"plain"]
        assert root[b"both"].is_dir and root[b"both"].ino == via_lookup.ino
        assert [n for n, _ in await c.ns.listdir(root[b"both"].ino)] == [b"inner"]


async def test_byte_exact_reads_and_a_rewrite_before_the_first_read(rgw, bucket, s3, tmp_path):
    cs = 64 << 10
    old, new = os.urandom(3 * cs + 17), os.urandom(2 * cs + 3)
    client = rgw.client()
    client.put_object(Bucket=bucket, Key="dir/f.bin", Body=old)
    async with core(str(tmp_path), backend=s3, bucket=bucket, chunk_size=cs) as c:
        d = await c.ns.lookup(ROOT_INO, b"dir")
        node = await c.ns.lookup(d.ino, b"f.bin")
        h1, _ = await c.io.open(node.ino)
        h2, _ = await c.io.open(node.ino)  # before anything is read: no pages to keep
        assert await c.io.read(h1.fh, cs - 5, cs + 4) == old[cs - 5:2 * cs - 1]  # chunks 0, 1
        assert await c.io.read(h1.fh, 3 * cs, 100) == old[3 * cs:]  # chunk 3
        h3, keep = await c.io.open(node.ino)
        assert keep  # the kernel's pages of `old` (h1's reads) serve it unseen
        client.put_object(Bucket=bucket, Key="dir/f.bin", Body=new)
        # chunks 0, 1 and 3 of `old` are cached and h1 keeps reading them (one version
        # per handle); chunk 2 is not, so h1 must fetch it and the real server's If-Match
        # refuses: h1 served bytes already, so it is stale
        assert await c.io.read(h1.fh, 0, 10) == old[:10]
        with pytest.raises(StaleObject):
            await c.io.read(h1.fh, 2 * cs, 10)
        # so is h3: the kernel may have answered it from old pages (one read() would mix)
        with pytest.raises(StaleObject):
            await c.io.read(h3.fh, 2 * cs, 10)
        # and h2, though it served nothing: the pages it would read through hold `old`
        with pytest.raises(StaleObject):
            await c.io.read(h2.fh, 2 * cs, 10)
        # a new handle while they are open goes around their pages
        h4, _ = await c.io.open(node.ino)
        assert h4.direct and await c.io.read(h4.fh, 0, 2 * cs + 3) == new
        for h in (h1, h2, h3, h4):
            await c.io.release(h.fh)
        # once they are closed the next open drops `old`'s pages and reads through them;
        # replaced again, it keeps reading its version where cached, as one version
        h5, keep = await c.io.open(node.ino)
        assert not keep and not h5.direct
        client.put_object(Bucket=bucket, Key="dir/f.bin", Body=old)
        assert await c.io.read(h5.fh, 0, 2 * cs + 3) == new


def test_bodies_are_read_from_the_socket_and_their_connection_reused(s3, rgw, bucket,
                                                                    monkeypatch):
    # S3Backend reads a body through http.client, under botocore's and urllib3's copies
    # (backend/s3.py _body_reader); it must then hand the connection back to the pool
    import http.client

    data = os.urandom(3 << 20)
    rgw.client().put_object(Bucket=bucket, Key="big", Body=data)
    calls = []
    real = http.client.HTTPResponse.readinto
    monkeypatch.setattr(http.client.HTTPResponse, "readinto",
                        lambda self, b: calls.append(len(b)) or real(self, b))
    connects = []
    real_connect = http.client.HTTPConnection.connect
    monkeypatch.setattr(http.client.HTTPConnection, "connect",
                        lambda self: connects.append(1) or real_connect(self))
    for start in (0, 1 << 20, 5):
        assert s3.get("big", start, 2 << 20, None) == data[start:start + (2 << 20)]
    assert s3.get("big", 0, len(data), None, size=len(data)) == data
    assert calls and max(calls) == 1 << 20  # straight into the buffer, 1 MiB at a time
    assert len(connects) <= 1  # one connection served every GET
