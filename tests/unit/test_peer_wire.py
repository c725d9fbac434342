"""tierfs/peers/wire.py: request targets, signatures and block CRCs (no sockets)."""

from __future__ import annotations

import google_crc32c
import pytest

from tierfs.peers import wire
from tierfs.peers.wire import (ChunkRequest, PeerAuthError, PeerCorrupt, PeerProtocolError,
                               PeerRefused)

SECRET = b"s3cret-of-the-fleet"
NOW = 1_800_000_000.0
ETAG = '"9b2cf535f27731c974343645a3985328"'


def req(**kw: object) -> ChunkRequest:
    fields: dict[str, object] = dict(bucket="ckpt", key="run 1/step=10/shard 0.pt", etag=ETAG,
                                     size=20 << 20, index=2, chunk_size=8 << 20)
    fields.update(kw)
    return ChunkRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [
    "plain", "with space", "a+b&c=d?e#f%20g", "über/東京/🙂", "trailing/", " lead",
    "x" * 1024, "é" * 512, "/slash/first", "semi;colon,comma",
])
def test_target_round_trip(key):
    r = req(key=key)
    target = r.target()
    assert target.startswith("/v1/chunk?")
    assert " " not in target and all(0x21 <= ord(c) < 0x7f for c in target)
    assert ChunkRequest.parse(target) == r


def test_length_of_the_last_chunk():
    assert req(index=0).length == 8 << 20
    assert req(index=2).length == 4 << 20  # 20 MiB in 8 MiB chunks
    assert req(size=1, index=0).length == 1


@pytest.mark.parametrize("target", [
    "/v1/chunk",
    "/v2/chunk?b=x&k=y&e=z&s=1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=1&i=0",  # a field missing
    "/v1/chunk?b=x&k=y&e=z&s=1&i=0&c=1&x=1",  # one too many
    "/v1/chunk?b=x&b=x&e=z&s=1&i=0&c=1",  # a field twice
    "/v1/chunk?b=x&k=y&e=z&s=-1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=+1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=1_0&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=%201&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=١&i=0&c=1",  # a non-ASCII digit
    "/v1/chunk?b=x&k=y&e=z&s=10&i=1&c=10",  # past the end
    "/v1/chunk?b=x&k=y&e=z&s=0&i=0&c=1",  # an empty object has no chunk
    "/v1/chunk?b=x&k=y&e=z&s=10&i=0&c=0",
    "/v1/chunk?b=x&k=y&e=z&s=10&i=0&c=" + str((64 << 20) + 1),
    "/v1/chunk?b=x&k=y&e=z&s=" + "9" * 30 + "&i=0&c=1",
    "/v1/chunk?b=&k=y&e=z&s=1&i=0&c=1",
    "/v1/chunk?b=x&k=&e=z&s=1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=&s=1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=a%20b&s=1&i=0&c=1",  # a space in an ETag
    "/v1/chunk?b=x&k=y&e=a%0d%0ab&s=1&i=0&c=1",  # a header injection attempt
    "/v1/chunk?b=x&k=%ff&e=z&s=1&i=0&c=1",  # not UTF-8
    "/v1/chunk?b=x&k=%ed%a0%80&e=z&s=1&i=0&c=1",  # a surrogate
    "/v1/chunk?b=x&k=" + "x" * 1025 + "&e=z&s=1&i=0&c=1",
    "/v1/chunk?b=x&k=y&e=z&s=1&i=0&c=1&",
    "/v1/chunk?b=x&k=y&e=z&s=1&i=0&c",
])
def test_malformed_targets_are_protocol_errors(target):
    with pytest.raises(PeerProtocolError):
        ChunkRequest.parse(target)


def test_a_request_is_checked_where_it_is_made():
    with pytest.raises(PeerProtocolError):
        req(index=3)
    with pytest.raises(PeerProtocolError):
        req(size=True)
    with pytest.raises(PeerProtocolError):
        req(key="\udcff")


def test_sign_and_verify_a_request():
    target = req().target()
    auth = wire.sign_request(SECRET, "node-1:7480", "GET", target, NOW)
    assert SECRET.decode() not in auth
    assert wire.verify_request(SECRET, "GET", target, auth, NOW + 59) == "node-1:7480"
    assert wire.verify_request(SECRET, "GET", target, auth, NOW - 59) == "node-1:7480"


@pytest.mark.parametrize("case", ["wrong secret", "old", "future", "tampered target",
                                  "other method", "none", "malformed", "other node"])
def test_a_request_that_does_not_verify(case):
    target = req().target()
    auth = wire.sign_request(SECRET, "node-1", "GET", target, NOW)
    secret, method, now = SECRET, "GET", NOW
    if case == "wrong secret":
        secret = b"another secret"
    elif case == "old":
        now = NOW + 61
    elif case == "future":
        now = NOW - 61
    elif case == "tampered target":
        target = req(index=1).target()
    elif case == "other method":
        method = "HEAD"
    elif case == "none":
        auth = None  # type: ignore[assignment]
    elif case == "malformed":
        auth = auth.replace("sig=", "sig=x")
    elif case == "other node":
        auth = auth.replace("node=node-1", "node=node-2")
    with pytest.raises(PeerAuthError) as err:
        wire.verify_request(secret, method, target, auth, now)
    assert SECRET.decode() not in str(err.value)
    assert auth is None or auth.rsplit("sig=", 1)[1] not in str(err.value)


def test_node_names_are_checked_before_signing():
    with pytest.raises(PeerProtocolError):
        wire.sign_request(SECRET, "a,sig=00", "GET", "/", NOW)


def test_reply_signature_binds_request_etag_crcs_and_length():
    auth = wire.sign_request(SECRET, "n", "GET", req().target(), NOW)
    crcs = (1, 2, 0xFFFFFFFF)
    sig = wire.sign_reply(SECRET, auth, ETAG, crcs, 65536, 150000)
    wire.verify_reply(SECRET, auth, ETAG, crcs, 65536, 150000, sig)
    other_auth = wire.sign_request(SECRET, "n", "GET", req(index=1).target(), NOW)
    for args in [(b"wrong", auth, ETAG, crcs, 65536, 150000),
                 (SECRET, other_auth, ETAG, crcs, 65536, 150000),
                 (SECRET, auth, '"other"', crcs, 65536, 150000),
                 (SECRET, auth, ETAG, (1, 2, 3), 65536, 150000),
                 (SECRET, auth, ETAG, crcs, 32768, 150000),
                 (SECRET, auth, ETAG, crcs, 65536, 150001)]:
        with pytest.raises(PeerCorrupt):
            wire.verify_reply(*args, sig)
    with pytest.raises(PeerCorrupt):
        wire.verify_reply(SECRET, auth, ETAG, crcs, 65536, 150000, None)
    with pytest.raises(PeerCorrupt):
        wire.verify_reply(SECRET, auth, ETAG, crcs, 65536, 150000, "é" + sig[1:])


def test_block_crcs_of_bytes_and_buffers():
    data = bytes(range(256)) * 1000  # 256,000 bytes: 3 whole blocks and a short one
    want = tuple(google_crc32c.value(data[i:i + 65536]) for i in range(0, len(data), 65536))
    assert len(want) == 4
    assert wire.block_crcs(data, 65536) == want
    assert wire.block_crcs(bytearray(data), 65536) == want
    assert wire.block_crcs(memoryview(data), 65536) == want
    assert wire.block_crcs(b"123456789", 65536) == (0xE3069283,)  # the CRC32C check value
    assert wire.block_crcs(b"", 65536) == ()


def test_crc_header_round_trip_and_malformed():
    crcs = (0, 1, 0xDEADBEEF, 0xFFFFFFFF)
    assert wire.parse_crcs(wire.format_crcs(crcs)) == crcs
    assert wire.format_crcs(crcs) == "00000000,00000001,deadbeef,ffffffff"
    for bad in ["1", "0000000g", "00000000,", "00000000 ,00000001", "DEADBEEF",
                ",".join(["00000000"] * 16385)]:
        with pytest.raises(PeerCorrupt):
            wire.parse_crcs(bad)


@pytest.mark.parametrize("status,result", [(404, "refused"), (409, "stale"), (412, "changed"),
                                           (503, "overloaded"), (500, "refused")])
def test_refusal_results(status, result):
    exc = PeerRefused(status)
    assert exc.status == status and exc.result == result
    assert isinstance(exc, wire.PeerError)
