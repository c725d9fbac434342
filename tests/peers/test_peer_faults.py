"""Peers that fail, lie or are not peers: a reader never serves or caches their bytes, and
goes to the store within the deadline (issue 13, "Tests").

The misbehaving peers run in the test process and are listed in the peers file like any
node (tests/peers/cluster.py): a real `tierfs.peers.server.PeerServer` holding the shared
secret whose serve callback damages the chunk (`FakePeer`), a raw socket that accepts and
never answers (`HangingPeer`), a raw HTTP server that signs another ETag (`WrongEtagPeer`).
The reader mounts with 1 MiB chunks and reads a 32 MiB file: the fake owns about half of
its 32 chunks (rendezvous over two peers), so it owns at least one but with odds of 2^-32.

What a damaged reply can be caught by:
  - CRCs of the true bytes with a flipped body (`crc_before_flip`): the reader's CRC32C of
    each block differs from the signed header -> "corrupt";
  - CRCs computed over the flipped bytes and signed with the secret (`crc_after_flip`): the
    reply is self-consistent; only a checksum from the store can tell, and the reader checks
    a peer's chunk against one where the object has it (tierfs/read/storecheck.py): tierfs's
    per-chunk CRC32Cs in the metadata of the objects it writes (one HEAD per object
    version), or the MD5 ETag of a one-chunk object. An object with neither (a multipart
    object another client wrote) is taken on the owner's CRCs (docs/peers.md).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from tierfs import integrity
from tierfs.cache.keys import ObjectVersion
from tierfs.peers.members import _score

from cluster import (Checkpoint, FakePeer, HangingPeer, Misbehave, MiB, Obj, WrongEtagPeer,
                     payload, read_sha, sha256)

pytestmark = pytest.mark.mount

CHUNK_ARGS = ["--chunk-size", "1M"]
SIZE = 32 * MiB
KEY = "ckpt/model.pt"


def _one(s3, bucket: str, key: str = KEY, size: int = SIZE, *, metadata=None,
         seed: str = "faults") -> tuple[bytes, Checkpoint]:
    data = payload(seed, size)
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata=metadata or {})
    return data, Checkpoint(bucket, "ckpt", [Obj(key, size, sha256(data))])


def _assert_served_only_store_bytes(c, node, data: bytes, fake_asked: int, *,
                                    key: str = KEY) -> None:
    """The reader's cache holds the store's bytes for every chunk: after a remount (memory
    tier gone) the whole file reads back exact with no request to the store or a peer."""
    gets = node.counter("tierfs_backend_requests_total", op="get")
    assert gets >= 1
    c.remount(node)
    assert read_sha(node.path / key)[0] == sha256(data)
    assert node.counter("tierfs_backend_requests_total", op="get") == 0
    assert node.counter("tierfs_peer_requests_total", role="client") == 0
    assert fake_asked >= 1


def test_a_peer_serving_damaged_bytes_is_caught_and_never_cached(fleet, s3, bucket):
    # a real PeerServer with the secret, whose body has a bit flipped after its CRCs
    secret = secrets.token_hex(32).encode()
    data, _ = _one(s3, bucket)
    with FakePeer(secret, {KEY: data}, Misbehave("crc_before_flip")) as fake:
        c = fleet(1, secret=secret, extra_args=CHUNK_ARGS, extra_peers=[fake.addr])
        node = c.nodes[0]
        c.access_log.start()
        assert read_sha(node.path / KEY)[0] == sha256(data)
        assert len(fake.asked) >= 1
        assert node.counter("tierfs_peer_requests_total", role="client", result="corrupt") >= 1
        assert node.counter("tierfs_read_bytes_total", source="peer") == 0
        # every chunk came from the store, the fake's included
        assert c.access_log.since_start().get_bytes >= SIZE
        # a peer that lied is marked down: no longer counted as up
        assert node.counter("tierfs_peers_up") == 0
        asked = len(fake.asked)
    _assert_served_only_store_bytes(c, node, data, asked)


def _lying_secret_holder(fleet, s3, bucket, key: str, size: int, *, crc_metadata: bool):
    """A peer with the secret signs flipped bytes; the store's checksum catches it."""
    secret = secrets.token_hex(32).encode()
    data = payload("liar", size)
    meta = {}
    if crc_metadata:  # what tierfs puts on the objects it writes (1 MiB chunks, as read)
        meta = integrity.chunk_crcs_metadata(
            MiB, [integrity.crc32c(data[i:i + MiB]) for i in range(0, size, MiB)])
        assert meta
    with FakePeer(secret, {key: data}, Misbehave("crc_after_flip")) as fake:
        c = fleet(1, secret=secret, extra_args=CHUNK_ARGS, extra_peers=[fake.addr])
        node = c.nodes[0]
        # put only once both peer addresses are known, at a key whose chunks the fake owns
        # at least one of (a one-chunk object has even odds otherwise)
        key = _owned_key(key, bucket, data, node.addr, fake.addr)
        fake.data = {key: data}
        s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata=meta)
        assert read_sha(node.path / key)[0] == sha256(data)
        assert len(fake.asked) >= 1
        # the reply passed the signature and block CRCs; the store's checksum refuted it,
        # the store's bytes confirmed: counted corrupt, marked down, nothing from the peer
        assert node.counter("tierfs_peer_requests_total", role="client", result="corrupt") >= 1
        assert node.counter("tierfs_read_bytes_total", source="peer") == 0
        assert node.counter("tierfs_peers_up") == 0
        heads = node.counter("tierfs_backend_requests_total", op="head")
        asked = len(fake.asked)
    return c, node, data, asked, heads, key


def _owned_key(base: str, bucket: str, data: bytes, node: str, fake: str) -> str:
    """`base`, or `base` with a suffix, such that rendezvous hashing (the daemon's own
    function) makes `fake` the owner of at least one of the single-part object's chunks."""
    etag = hashlib.md5(data).hexdigest()
    chunks = -(-len(data) // MiB)
    for n in range(64):
        key = base if n == 0 else f"{base}.{n}"
        oid = ObjectVersion(bucket, key, etag, len(data))
        if any(_score(fake, oid.chunk_key(i)) > _score(node, oid.chunk_key(i))
               for i in range(chunks)):
            return key
    raise AssertionError("no key in 64 owned by the fake peer")


def test_a_secret_holder_signing_wrong_bytes_is_caught_by_tierfs_chunk_crcs(fleet, s3, bucket):
    # a 32-chunk object with tierfs's per-chunk CRC32Cs: one HEAD learns them
    c, node, data, asked, heads, key = _lying_secret_holder(fleet, s3, bucket, KEY, SIZE,
                                                            crc_metadata=True)
    assert 1 <= heads <= 2  # one per object version (a second only if the first failed)
    _assert_served_only_store_bytes(c, node, data, asked, key=key)


def test_a_secret_holder_signing_wrong_bytes_is_caught_by_an_md5_etag(fleet, s3, bucket):
    # a one-chunk object: its single-part ETag is the MD5 of its bytes, no HEAD needed
    c, node, data, asked, heads, key = _lying_secret_holder(fleet, s3, bucket, "rl/env-0001.tar",
                                                            MiB // 2, crc_metadata=False)
    assert heads == 0
    _assert_served_only_store_bytes(c, node, data, asked, key=key)


def test_a_peer_that_knows_another_etag_is_not_used(fleet, s3, bucket):
    # 409 from a real PeerServer: the owner's cache has another version of the key
    secret = secrets.token_hex(32).encode()
    data, _ = _one(s3, bucket)
    with FakePeer(secret, {KEY: data}, Misbehave("stale")) as fake:
        c = fleet(1, secret=secret, extra_args=CHUNK_ARGS, extra_peers=[fake.addr])
        node = c.nodes[0]
        assert read_sha(node.path / KEY)[0] == sha256(data)
        assert len(fake.asked) >= 1
        assert node.counter("tierfs_peer_requests_total", role="client", result="stale") >= 1
        assert node.counter("tierfs_read_bytes_total", source="peer") == 0
        # a refusal is an answer: the peer stays up
        assert node.counter("tierfs_peers_up") == 1
        asked = len(fake.asked)
    _assert_served_only_store_bytes(c, node, data, asked)


def test_a_reply_signed_for_another_etag_is_corrupt(fleet, s3, bucket):
    secret = secrets.token_hex(32).encode()
    data, _ = _one(s3, bucket)
    with WrongEtagPeer(secret, {KEY: data}, "0123456789abcdef0123456789abcdef") as peer:
        c = fleet(1, secret=secret, extra_args=CHUNK_ARGS, extra_peers=[peer.addr])
        node = c.nodes[0]
        assert read_sha(node.path / KEY)[0] == sha256(data)
        assert peer.asked >= 1
        assert node.counter("tierfs_peer_requests_total", role="client", result="corrupt") >= 1
        assert node.counter("tierfs_read_bytes_total", source="peer") == 0
        asked = peer.asked
    _assert_served_only_store_bytes(c, node, data, asked)


def test_a_peer_that_hangs_is_given_up_for_the_store(fleet, s3, bucket):
    data, _ = _one(s3, bucket)
    data2, _ = _one(s3, bucket, "ckpt/other.pt", seed="other")
    with HangingPeer() as hang:
        c = fleet(1, extra_args=CHUNK_ARGS, extra_peers=[hang.addr],
                  peer_args=["--peer-timeout", "0.5s"])
        node = c.nodes[0]
        assert read_sha(node.path / KEY)[0] == sha256(data)
        assert hang.accepted >= 1
        assert node.counter("tierfs_peer_requests_total", role="client", result="timeout") >= 1
        assert node.counter("tierfs_read_bytes_total", source="peer") == 0
        assert node.counter("tierfs_peers_up") == 0
        # `tierfs status` names it as down
        st = _status(node)
        assert st["peers"]["down"] == [hang.addr] and st["peers"]["up"] == []
        assert st["peers"]["requests"]["client"].get("timeout", 0) >= 1
        # the rest of the file, and a second file, went to the store without asking it
        before = node.counter("tierfs_peer_requests_total", role="client")
        assert read_sha(node.path / "ckpt/other.pt")[0] == sha256(data2)
        assert node.counter("tierfs_peer_requests_total", role="client") == before


def _status(node) -> dict:
    argv = [sys.executable, "-m", "tierfs", "status", "--json", node.mount.mountpoint]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _get(port: int, target: str, auth: str | None) -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", target, headers={"authorization": auth} if auth else {})
        r = conn.getresponse()
        return r.status, r.read(), {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def test_no_secret_or_a_wrong_one_gets_401_and_no_bytes(fleet, s3, bucket):
    from tierfs.peers.wire import ChunkRequest, sign_request

    data = payload("auth", 3 * MiB)
    etag = s3.put_object(Bucket=bucket, Key=KEY, Body=data)["ETag"].strip('"')
    c = fleet(1)
    node = c.nodes[0]
    target = ChunkRequest(bucket, KEY, etag, len(data), 0, 8 * MiB).target()
    now = time.time()

    refused = {
        "no header": None,
        "wrong secret": sign_request(b"not-the-secret", "127.0.0.1:1", "GET", target, now),
        "an hour old": sign_request(c.secret, "127.0.0.1:1", "GET", target, now - 3600),
        "other target": sign_request(c.secret, "127.0.0.1:1", "GET", target + "x", now),
        "garbage": "Bearer " + c.secret.decode(),
    }
    for what, auth in refused.items():
        status, body, _ = _get(node.peer_port, target, auth)
        assert (status, body) == (401, b""), what
    assert node.counter("tierfs_peer_requests_total", role="server",
                        result="unauthorized") == len(refused)
    assert node.counter("tierfs_peer_bytes_total", direction="out") == 0
    assert node.counter("tierfs_backend_requests_total", op="get") == 0

    # the control: the same request signed with the shared secret gets the bytes
    status, body, headers = _get(node.peer_port, target,
                                 sign_request(c.secret, "127.0.0.1:1", "GET", target, now))
    assert status == 200 and body == data
    assert headers["x-tierfs-etag"] == etag
    # the secret appears in no log line and no metric
    assert c.secret.decode() not in node.mount.log_text()
    assert c.secret.decode() not in node.mount.metrics_text()


def test_a_peer_never_serves_unsaved_writes(fleet, s3, bucket):
    # node A caches v1, then overwrites every byte of it in its --writeback mount and keeps
    # the file open (nothing uploaded); node B reads the key, asking A for the chunks A
    # owns: B gets exactly the bucket's bytes, never A's unsaved ones
    v1 = payload("saved", SIZE)
    s3.put_object(Bucket=bucket, Key=KEY, Body=v1)
    c = fleet(2, extra_args=CHUNK_ARGS + ["--writeback"])
    a, b = c.nodes
    assert read_sha(a.path / KEY)[0] == sha256(v1)
    unsaved = payload("unsaved", SIZE)
    fd = os.open(a.path / KEY, os.O_RDWR)
    try:
        for off in range(0, SIZE, MiB):
            assert os.pwrite(fd, unsaved[off:off + MiB], off) == MiB
        assert s3.get_object(Bucket=bucket, Key=KEY)["Body"].read() == v1  # still unsaved
        served = a.counter("tierfs_peer_requests_total", role="server", result="ok")
        assert read_sha(b.path / KEY)[0] == sha256(v1)
        # A was asked for (and served) its share of the chunks
        assert a.counter("tierfs_peer_requests_total", role="server", result="ok") > served
        assert b.counter("tierfs_read_bytes_total", source="peer") > 0
    finally:
        os.close(fd)


def test_a_peer_serves_only_the_bucket_it_mounts(fleet, mounts, s3, bucket):
    # node A mounts another bucket; node B lists A as a peer: A refuses B's chunks (404,
    # nothing fetched for them), B reads them from the store
    from cluster import Fleet
    from rgw import delete_bucket

    other = f"{bucket[:40]}-other"
    s3.create_bucket(Bucket=other)
    try:
        a = Fleet(mounts, 1, name="a", bucket=other, extra_args=CHUNK_ARGS)
        try:
            data, _ = _one(s3, bucket)
            b = fleet(1, secret=a.secret, extra_args=CHUNK_ARGS, extra_peers=[a.nodes[0].addr])
            node = b.nodes[0]
            assert read_sha(node.path / KEY)[0] == sha256(data)
            assert node.counter("tierfs_peer_requests_total", role="client", result="refused") >= 1
            assert node.counter("tierfs_read_bytes_total", source="peer") == 0
            assert a.nodes[0].counter("tierfs_peer_requests_total", role="server",
                                      result="refused") >= 1
            assert a.nodes[0].counter("tierfs_backend_requests_total", op="get") == 0
            assert a.nodes[0].counter("tierfs_peer_bytes_total", direction="out") == 0
        finally:
            a.stop()
    finally:
        delete_bucket(s3, other)
