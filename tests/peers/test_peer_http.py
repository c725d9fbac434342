"""PeerServer and PeerClient over real sockets on 127.0.0.1 (and TLS), no object store.

The server's `serve` callback is backed by a dict of chunks; "raw" servers are a trio
listener speaking bytes, for what a real PeerServer never sends (hangs, cut bodies,
garbage, a wrong ETag header).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import trio

from tierfs.metrics import Metrics
from tierfs.peers import wire
from tierfs.peers.client import PeerClient
from tierfs.peers.members import Peer
from tierfs.peers.server import PeerServer, TokenBucket
from tierfs.peers.wire import (ChunkReply, ChunkRequest, PeerAuthError, PeerCorrupt, PeerError,
                               PeerProtocolError, PeerRefused, PeerTimeout, PeerUnavailable)

SECRET = b"the fleet's secret, 32 bytes long"
BLOCK = 64 << 10
CS = 1 << 20  # chunk size
ETAG = '"etag-v1"'
BIG = 10


def payload(size: int, seed: int = 7) -> bytes:
    return bytes((i * 131 + seed) % 251 for i in range(size))


OBJ = payload(2 * CS + 123_456)  # three chunks, the last short


def request(index: int, *, bucket: str = "ckpt", key: str = "run 1/ckpt é.pt",
            etag: str = ETAG) -> ChunkRequest:
    return ChunkRequest(bucket, key, etag, len(OBJ), index, CS)


class Store:
    """The serving node's chunks, by (bucket, key); a refusal for what it does not have."""

    def __init__(self) -> None:
        self.objects = {("ckpt", "run 1/ckpt é.pt"): (ETAG, OBJ)}
        self.corrupt = False
        self.broken = ""  # "raise": the callback fails; "short": its reply misses bytes
        self.gate: trio.Event | None = None
        self.served = 0

    async def serve(self, req: ChunkRequest) -> ChunkReply:
        if self.gate is not None:
            await self.gate.wait()
        if req.bucket != "ckpt":
            raise PeerRefused(wire.NOT_MINE)
        etag, data = self.objects[(req.bucket, req.key)]
        if req.etag != etag:
            raise PeerRefused(wire.STALE)
        if self.broken == "raise":
            raise RuntimeError("a bug in the serving core")
        chunk = data[req.index * CS:req.index * CS + req.length]
        if self.broken == "short":
            chunk = chunk[:-1]
        crcs = wire.block_crcs(chunk, BLOCK)
        if self.corrupt:  # damaged after its CRCs were computed (a bad disk, a bad copy)
            chunk = bytearray(chunk)
            chunk[BLOCK + 5] ^= 0x10
        self.served += 1
        return ChunkReply(chunk, crcs, BLOCK)


def count(metrics: Metrics, role: str, result: str) -> float:
    return metrics.value("tierfs_peer_requests_total", role=role, result=result)


def sent(metrics: Metrics, direction: str) -> float:
    return metrics.value("tierfs_peer_bytes_total", direction=direction)


@contextlib.asynccontextmanager
async def serving(store: Store, **kw) -> AsyncIterator[tuple[PeerServer, Peer]]:
    server = PeerServer(("127.0.0.1", 0), kw.pop("secret", SECRET), store.serve,
                        kw.pop("metrics", Metrics()), **kw)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(server.run)
        yield server, Peer(host, port)
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def raw_server(behave: Callable[[trio.SocketStream, str, str], Awaitable[None]]
                     ) -> AsyncIterator[Peer]:
    """A listener that reads one request head and hands (stream, target, authorization)
    to `behave`."""

    async def handler(stream: trio.SocketStream) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                return
            head += data
        lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        target = lines[0].split(" ")[1]
        auth = next(v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])
                    if k.lower() == "authorization")
        await behave(stream, target, auth)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0, )
        port = listeners[0].socket.getsockname()[1]
        yield Peer("127.0.0.1", port)
        nursery.cancel_scope.cancel()


def signed_head(target: str, auth: str, data: bytes, *, etag: str = ETAG,
                length: int | None = None) -> bytes:
    req = ChunkRequest.parse(target)
    crcs = wire.block_crcs(data, BLOCK)
    n = req.length if length is None else length
    sig = wire.sign_reply(SECRET, auth, etag, crcs, BLOCK, n)
    return (f"HTTP/1.1 200 OK\r\ncontent-length: {n}\r\nx-tierfs-etag: {etag}\r\n"
            f"x-tierfs-block-size: {BLOCK}\r\nx-tierfs-crc32c: {wire.format_crcs(crcs)}\r\n"
            f"x-tierfs-sig: {sig}\r\n\r\n").encode()


def client(metrics: Metrics | None = None, **kw) -> PeerClient:
    return PeerClient(kw.pop("secret", SECRET), "reader-1", metrics or Metrics(), **kw)


async def test_chunks_round_trip_on_one_kept_connection():
    store, sm, cm = Store(), Metrics(), Metrics()
    async with serving(store, metrics=sm) as (_, peer):
        c = client(cm)
        got = [await c.fetch(peer, request(i), timeout_s=BIG) for i in (0, 1, 2, 0)]
        await c.aclose()
    assert b"".join(bytes(r.data) for r in got[:3]) == OBJ
    assert bytes(got[3].data) == OBJ[:CS]
    assert [len(r.crcs) for r in got] == [16, 16, 2, 16] and got[2].block_size == BLOCK
    assert c.connects == 1  # keep-alive: one connection for four requests
    assert count(sm, "server", "ok") == count(cm, "client", "ok") == 4
    assert sent(sm, "out") == sent(cm, "in") == len(OBJ) + CS


async def test_refusals_keep_the_connection():
    store, sm, cm = Store(), Metrics(), Metrics()
    async with serving(store, metrics=sm) as (_, peer):
        c = client(cm)
        with pytest.raises(PeerRefused) as err:
            await c.fetch(peer, request(0, etag='"etag-v0"'), timeout_s=BIG)
        assert (err.value.status, err.value.result) == (409, "stale")
        with pytest.raises(PeerRefused) as err:
            await c.fetch(peer, request(0, bucket="other"), timeout_s=BIG)
        assert (err.value.status, err.value.result) == (404, "refused")
        assert bytes((await c.fetch(peer, request(1), timeout_s=BIG)).data) == OBJ[CS:2 * CS]
        await c.aclose()
    assert c.connects == 1
    assert count(sm, "server", "stale") == count(cm, "client", "stale") == 1
    assert count(sm, "server", "refused") == count(cm, "client", "refused") == 1


async def test_wrong_secret_is_refused_and_warned_once(caplog):
    caplog.set_level(logging.WARNING, logger="tierfs.peers.server")
    store, sm, cm = Store(), Metrics(), Metrics()
    async with serving(store, metrics=sm) as (_, peer):
        c = client(cm, secret=b"not the fleet's secret")
        for _ in range(3):
            with pytest.raises(PeerAuthError):
                await c.fetch(peer, request(0), timeout_s=BIG)
        await c.aclose()
    assert store.served == 0
    assert count(sm, "server", "unauthorized") == count(cm, "client", "unauthorized") == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "127.0.0.1" in warnings[0].getMessage()
    assert "bad signature" in warnings[0].getMessage()
    assert "secret" not in caplog.text.replace("same secret", "")
    assert SECRET.decode() not in caplog.text and "sig=" not in caplog.text


async def raw_exchange(peer: Peer, data: bytes) -> bytes:
    """Send bytes on a new connection, read until the server closes it (or resets it:
    a connection the server closed before our bytes came)."""
    stream = await trio.open_tcp_stream(peer.host, peer.port)
    got = b""
    try:
        await stream.send_all(data)
        with trio.fail_after(BIG):
            while chunk := await stream.receive_some(65536):
                got += chunk
    except trio.BrokenResourceError:
        pass
    finally:
        await stream.aclose()
    return got


async def test_no_auth_header_and_bad_heads():
    store, sm = Store(), Metrics()
    target = request(0).target()
    auth = wire.sign_request(SECRET, "n1", "POST", target, __import__("time").time())
    async with serving(store, metrics=sm) as (_, peer):
        # no authorization: 401, empty body, and the server closes the connection
        got = await raw_exchange(peer, f"GET {target} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 401 ") and got.endswith(b"\r\n\r\n")
        assert b"content-length: 0" in got.lower()
        # an unsigned POST with a body: 401 too (auth comes first), its body never read
        got = await raw_exchange(peer, f"POST {target} HTTP/1.1\r\nhost: x\r\n"
                                       f"content-length: 5\r\n\r\nhello".encode())
        assert got.startswith(b"HTTP/1.1 401 ")
        # a signed POST: 405
        got = await raw_exchange(peer, f"POST {target} HTTP/1.1\r\nhost: x\r\n"
                                       f"authorization: {auth}\r\ncontent-length: 5\r\n\r\n"
                                       f"hello".encode())
        assert got.startswith(b"HTTP/1.1 405 ")
        # a head over 8 KiB: refused whole, never parsed
        got = await raw_exchange(peer, f"GET {target} HTTP/1.1\r\nhost: x\r\nx-pad: "
                                       f"{'a' * 9000}\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 431 ")
        # not HTTP at all
        got = await raw_exchange(peer, b"\x16\x03\x01 hello\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 400 ")
    assert store.served == 0
    assert count(sm, "server", "unauthorized") == 2
    assert count(sm, "server", "bad_request") == 3


async def test_a_head_that_does_not_come_in_time_is_closed():
    async with serving(Store(), header_timeout_s=0.3) as (server, peer):
        got = await raw_exchange(peer, b"GET /v1/chunk?b=ckpt HTTP/1.1\r\nhost: x\r\n")
        assert got == b""  # closed without an answer
        assert server.connections == 0


async def closed_by_server(stream: trio.SocketStream) -> bool:
    """The server closed this connection (end of stream or a reset), without a byte."""
    try:
        with trio.fail_after(BIG):
            return await stream.receive_some(1) == b""
    except trio.BrokenResourceError:
        return True


async def idle_connections(peer: Peer, n: int, sources: list[str]) -> list[trio.SocketStream]:
    """n connections that never send a byte, from the given 127.x source addresses in
    turn (an attacker without the secret: issue 26, S4)."""
    out = []
    for i in range(n):
        out.append(await trio.open_tcp_stream(peer.host, peer.port,
                                              local_address=sources[i % len(sources)]))
    return out


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(BIG):
        while not predicate():
            await trio.sleep(0.01)


async def test_idle_connections_of_one_source_displace_only_each_other():
    # S4: one address holds at most per_source_unproven connections without a signed
    # request; its 50 idle ones leave the server 3, the oldest closed; an honest
    # peer from the same address still gets its chunk
    async with serving(Store(), per_source_unproven=3) as (server, peer):
        idle = await idle_connections(peer, 50, ["127.0.0.1"])
        await until(lambda: server.connections == 3)
        assert all([await closed_by_server(s) for s in idle[:47]])
        c = client()
        assert bytes((await c.fetch(peer, request(0), timeout_s=BIG)).data) == OBJ[:CS]
        await c.aclose()
        for s in idle:
            await s.aclose()


async def test_a_share_of_connections_is_kept_for_peers_that_sign():
    # S4: 40 idle connections from 20 addresses fill the unproven share (max 8 - 4 kept);
    # 3 proven connections stay open whatever comes after, and a new honest connection
    # takes the place of the oldest unproven one, never of a proven one
    async with serving(Store(), max_connections=8, kept_for_peers=4,
                       per_source_unproven=2) as (server, peer):
        clients = [client() for _ in range(3)]
        for c in clients:  # each keeps its connection (keep-alive): proven
            assert bytes((await c.fetch(peer, request(1), timeout_s=BIG)).data) \
                == OBJ[CS:2 * CS]
        sources = [f"127.0.0.{i}" for i in range(2, 22)]
        idle = await idle_connections(peer, 40, sources)
        await until(lambda: server.connections == 3 + 4)
        for c in clients:  # still on their first connection
            assert bytes((await c.fetch(peer, request(0), timeout_s=BIG)).data) == OBJ[:CS]
            assert c.connects == 1
        fresh = client()
        assert bytes((await fresh.fetch(peer, request(2), timeout_s=BIG)).data) == OBJ[2 * CS:]
        more = await idle_connections(peer, 40, sources)  # the fresh one is proven now
        await until(lambda: server.connections == 4 + 4)
        assert bytes((await fresh.fetch(peer, request(0), timeout_s=BIG)).data) == OBJ[:CS]
        assert fresh.connects == 1
        # every place is proven: a ninth connection is closed at once
        full = [client() for _ in range(4)]
        for c in full:
            await c.fetch(peer, request(0), timeout_s=BIG)
        assert server.connections == 8
        [late] = await idle_connections(peer, 1, ["127.0.0.99"])
        assert await closed_by_server(late)
        for c in clients + full + [fresh]:
            await c.aclose()
        for s in idle + more + [late]:
            await s.aclose()


async def test_the_401_warning_is_limited_over_all_addresses(caplog):
    # S5: 300 unsigned requests from 30 addresses: 10 WARNING lines a minute in all, the
    # other 290 counted; the next line (a minute later) says how many were left out
    caplog.set_level(logging.WARNING, logger="tierfs.peers.server")
    sm = Metrics()
    async with serving(Store(), metrics=sm) as (server, peer):
        for i in range(300):
            stream = await trio.open_tcp_stream(peer.host, peer.port,
                                                local_address=f"127.0.1.{i % 30 + 1}")
            await stream.send_all(b"GET /v1/chunk HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(BIG):
                assert (await stream.receive_some(12)).startswith(b"HTTP/1.1 401")
            await stream.aclose()
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(lines) == 10, lines
        assert count(sm, "server", "unauthorized") == 300
        assert sm.value("tierfs_peer_unauthorized_unlogged_total") == 290
        server._warn_times.clear()  # a minute later
        server._warned.clear()
        assert await raw_exchange(peer, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n") != b""
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 11 and "290 more refused since the last such line" in lines[-1]


async def test_a_malformed_target_is_400_after_auth():
    store, sm = Store(), Metrics()
    target = "/v1/chunk?b=ckpt&k=x&e=z&s=10&i=10&c=1"  # past the end
    auth = wire.sign_request(SECRET, "n1", "GET", target, __import__("time").time())
    async with serving(store, metrics=sm) as (_, peer):
        stream = await trio.open_tcp_stream(peer.host, peer.port)
        await stream.send_all(f"GET {target} HTTP/1.1\r\nhost: x\r\n"
                              f"authorization: {auth}\r\n\r\n".encode())
        got = b""
        with trio.fail_after(BIG):
            while b"\r\n\r\n" not in got:
                got += await stream.receive_some(65536)
        await stream.aclose()
    assert got.startswith(b"HTTP/1.1 400 ")
    assert count(sm, "server", "bad_request") == 1 and store.served == 0


@pytest.mark.parametrize("broken", ["raise", "short"])
async def test_a_failing_serve_callback_is_500_and_the_server_goes_on(broken, caplog):
    store, sm, cm = Store(), Metrics(), Metrics()
    store.broken = broken
    async with serving(store, metrics=sm) as (_, peer):
        c = client(cm)
        with pytest.raises(PeerRefused) as err:
            await c.fetch(peer, request(0), timeout_s=BIG)
        assert (err.value.status, err.value.result) == (500, "refused")
        store.broken = ""
        assert bytes((await c.fetch(peer, request(0), timeout_s=BIG)).data) == OBJ[:CS]
        await c.aclose()
    assert count(sm, "server", "refused") == 1 and count(sm, "server", "ok") == 1
    assert sent(sm, "out") == CS  # not a byte of the bad reply
    assert [r.levelname for r in caplog.records] == ["ERROR"]


async def test_a_reader_that_stops_reading_frees_its_slot():
    big = bytes(range(256)) * (32 << 12)  # 32 MiB: more than the socket buffers hold
    store, sm = Store(), Metrics()
    store.objects[("ckpt", "big")] = (ETAG, big)
    req = ChunkRequest("ckpt", "big", ETAG, len(big), 0, 32 << 20)
    target = req.target()
    async with serving(store, metrics=sm, header_timeout_s=0.3, max_concurrent=1) as (server,
                                                                                     peer):
        stream = await trio.open_tcp_stream(peer.host, peer.port)
        auth = wire.sign_request(SECRET, "n1", "GET", target, __import__("time").time())
        await stream.send_all(f"GET {target} HTTP/1.1\r\nhost: x\r\n"
                              f"authorization: {auth}\r\n\r\n".encode())
        with trio.fail_after(BIG):  # the server gives up on it: the reader stopped reading
            while count(sm, "server", "unavailable") == 0:
                await trio.sleep(0.01)
        await stream.aclose()
        assert server.active == 0
        c = client()
        assert bytes((await c.fetch(peer, request(2), timeout_s=BIG)).data) == OBJ[2 * CS:]
        await c.aclose()
    assert count(sm, "server", "ok") == 1


async def test_bytes_damaged_after_their_crcs_are_corrupt():
    store, cm = Store(), Metrics()
    store.corrupt = True
    async with serving(store) as (_, peer):
        c = client(cm)
        with pytest.raises(PeerCorrupt, match="block 1 "):
            await c.fetch(peer, request(0), timeout_s=BIG)
        store.corrupt = False
        assert bytes((await c.fetch(peer, request(0), timeout_s=BIG)).data) == OBJ[:CS]
        await c.aclose()
    assert c.connects == 2  # the connection that brought bad bytes was not kept
    assert count(cm, "client", "corrupt") == 1 and count(cm, "client", "ok") == 1


@pytest.mark.parametrize("case", ["etag", "length", "sig", "crc count", "garbage", "chunked"])
async def test_replies_that_do_not_check_out(case):
    data = OBJ[:CS]

    async def behave(stream: trio.SocketStream, target: str, auth: str) -> None:
        if case == "etag":  # the owner answers for another version
            await stream.send_all(signed_head(target, auth, data, etag='"etag-v2"') + data)
        elif case == "length":  # a longer body than the chunk (a signed lie)
            await stream.send_all(signed_head(target, auth, data, length=CS + 1) + data + b"x")
        elif case == "sig":  # signed with another secret
            head = signed_head(target, auth, data).replace(b"sig: ", b"sig: 0")[:-5] + b"\r\n\r\n"
            await stream.send_all(head + data)
        elif case == "crc count":
            head = signed_head(target, auth, data)
            await stream.send_all(head.replace(b"x-tierfs-crc32c: ", b"x-tierfs-crc32c: 00000000,")
                                  + data)
        elif case == "garbage":
            await stream.send_all(b"HELLO THERE\r\n\r\n")
        elif case == "chunked":
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
        await trio.sleep_forever()

    cm = Metrics()
    async with raw_server(behave) as peer:
        c = client(cm)
        with pytest.raises(PeerError) as err:
            await c.fetch(peer, request(0), timeout_s=BIG)
        await c.aclose()
    want = PeerProtocolError if case in ("garbage", "chunked") else PeerCorrupt
    assert type(err.value) is want
    assert count(cm, "client", want.result) == 1
    assert sent(cm, "in") == 0  # nothing read past a head that did not check out


async def test_a_peer_that_hangs_times_out():
    async def behave(stream: trio.SocketStream, target: str, auth: str) -> None:
        await trio.sleep_forever()

    cm = Metrics()
    async with raw_server(behave) as peer:
        c = client(cm)
        with trio.fail_after(BIG):  # an upper bound only: the test asserts the outcome
            with pytest.raises(PeerTimeout):
                await c.fetch(peer, request(0), timeout_s=0.3)
        await c.aclose()
    assert count(cm, "client", "timeout") == 1


async def test_a_peer_that_hangs_mid_body_times_out():
    data = OBJ[:CS]

    async def behave(stream: trio.SocketStream, target: str, auth: str) -> None:
        await stream.send_all(signed_head(target, auth, data) + data[:1000])
        await trio.sleep_forever()

    async with raw_server(behave) as peer:
        c = client()
        with trio.fail_after(BIG):
            with pytest.raises(PeerTimeout):
                await c.fetch(peer, request(0), timeout_s=0.3)
        await c.aclose()


async def test_connection_refused_is_unavailable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    cm = Metrics()
    c = client(cm)
    with pytest.raises(PeerUnavailable):
        await c.fetch(Peer("127.0.0.1", port), request(0), timeout_s=BIG)
    assert count(cm, "client", "unavailable") == 1


@pytest.mark.parametrize("cut", [0, 1000, 3 * BLOCK + 17])
async def test_a_server_closing_mid_body_is_unavailable(cut):
    data = OBJ[:CS]

    async def behave(stream: trio.SocketStream, target: str, auth: str) -> None:
        await stream.send_all(signed_head(target, auth, data) + data[:cut])
        await stream.aclose()

    async with raw_server(behave) as peer:
        c = client()
        with pytest.raises(PeerUnavailable, match=f"after {cut} of {CS}"):
            await c.fetch(peer, request(0), timeout_s=BIG)
        await c.aclose()


async def test_a_server_closing_before_the_reply_is_unavailable():
    async def behave(stream: trio.SocketStream, target: str, auth: str) -> None:
        await stream.aclose()

    async with raw_server(behave) as peer:
        c = client()
        with pytest.raises(PeerUnavailable):
            await c.fetch(peer, request(0), timeout_s=BIG)


async def test_beyond_max_concurrent_is_503_at_once():
    store, sm, cm = Store(), Metrics(), Metrics()
    store.gate = trio.Event()
    async with serving(store, metrics=sm, max_concurrent=2) as (server, peer):
        c = client(cm)
        got: list[ChunkReply] = []

        async def first(i: int) -> None:
            got.append(await c.fetch(peer, request(i), timeout_s=BIG))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first, 0)
            nursery.start_soon(first, 1)
            with trio.fail_after(BIG):
                while server.active < 2:
                    await trio.sleep(0.01)
            with pytest.raises(PeerRefused) as err:  # answered while the others wait
                await c.fetch(peer, request(2), timeout_s=BIG)
            assert (err.value.status, err.value.result) == (503, "overloaded")
            store.gate.set()
        await c.aclose()
    assert sorted(bytes(r.data) for r in got) == sorted([OBJ[:CS], OBJ[CS:2 * CS]])
    assert count(sm, "server", "overloaded") == count(cm, "client", "overloaded") == 1
    assert count(sm, "server", "ok") == 2


def test_token_bucket_with_an_injected_clock():
    now = [100.0]
    b = TokenBucket(rate=1000, burst=500, clock=lambda: now[0])
    assert b.take(500) == 0  # the burst
    assert b.take(250) == pytest.approx(0.25)  # in debt: wait for 250 bytes' worth
    assert b.take(250) == pytest.approx(0.5)  # the next waits behind it
    now[0] += 0.5  # half a second pays 500 of the 500 owed
    assert b.take(100) == pytest.approx(0.1)
    now[0] += 10  # idle: the bucket refills to its burst, no more
    assert b.take(500) == 0 and b.take(1) == pytest.approx(0.001)
    now[0] -= 50  # a clock stepped back gives nothing
    assert b.take(1) == pytest.approx(0.002)
    assert b.taken == 1602
    assert b.waited_s == pytest.approx(0.25 + 0.5 + 0.1 + 0.001 + 0.002)


async def test_bandwidth_is_one_bucket_over_all_clients():
    # the clock is frozen: no refill, so every byte beyond the burst is paid for in wait
    store, sm = Store(), Metrics()
    t0 = __import__("time").time()
    rate = 32 << 20
    async with serving(store, metrics=sm, bandwidth=rate, clock=lambda: t0) as (server, peer):
        bucket = server.bandwidth_bucket
        assert bucket is not None and bucket.burst == 4 << 20
        clients = [client() for _ in range(3)]

        async def read(c: PeerClient) -> None:
            for i in range(3):
                await c.fetch(peer, request(i), timeout_s=BIG)

        async with trio.open_nursery() as nursery:
            for c in clients:
                nursery.start_soon(read, c)
        for c in clients:
            await c.aclose()
    out = 3 * len(OBJ)
    assert sent(sm, "out") == out == bucket.taken  # every body byte went through the bucket
    assert bucket.tokens == pytest.approx(bucket.burst - out)
    # the last piece waited for everything beyond the burst at the configured rate
    assert bucket.waited_s >= (out - bucket.burst) / rate


async def test_an_idle_connection_closed_by_the_server_is_replaced():
    store = Store()
    async with serving(store, header_timeout_s=0.2) as (server, peer):
        c = client()
        await c.fetch(peer, request(0), timeout_s=BIG)
        with trio.fail_after(BIG):
            while server.connections:  # the server closed the idle connection
                await trio.sleep(0.01)
        assert bytes((await c.fetch(peer, request(1), timeout_s=BIG)).data) == OBJ[CS:2 * CS]
        await c.aclose()
    assert c.connects == 2


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=tierfs-peer", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


async def test_tls_round_trip_and_an_unknown_ca_refused(tls_files):
    cert, key = tls_files
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(cert, key)
    store, sm, cm = Store(), Metrics(), Metrics()
    async with serving(store, metrics=sm, ssl_context=sctx) as (_, peer):
        c = client(cm, ssl_context=ssl.create_default_context(cafile=str(cert)))
        got = [bytes((await c.fetch(peer, request(i), timeout_s=BIG)).data) for i in (0, 1, 2)]
        await c.aclose()
        assert b"".join(got) == OBJ and c.connects == 1

        stranger = client(ssl_context=ssl.create_default_context())  # system CAs only
        with pytest.raises(PeerUnavailable, match="TLS"):
            await stranger.fetch(peer, request(0), timeout_s=BIG)
        plain = client()  # no TLS at all: the server never answers in clear
        with pytest.raises(PeerError):
            await plain.fetch(peer, request(0), timeout_s=BIG)
    assert store.served == 3 and count(sm, "server", "ok") == 3
    async with serving(Store()) as (_, peer):  # a TLS client and a server in clear
        c = client(ssl_context=ssl.create_default_context(cafile=str(cert)))
        with pytest.raises(PeerUnavailable, match="TLS"):
            await c.fetch(peer, request(0), timeout_s=BIG)
