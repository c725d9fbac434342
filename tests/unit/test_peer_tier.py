"""The peer tier wired into two in-process cores (tierfs/mount/core.py) over one FileBackend.

Real parts: build_core, LMDB, the disk tier, the peer server and client on 127.0.0.1.
The fleet of real daemons over a real RGW is tests/peers/.
"""

from __future__ import annotations

import contextlib
import os
import socket

import trio

from tierfs.backend.file import FileBackend
from tierfs.cache import ObjectVersion
from tierfs.index.inodes import ROOT_INO
from tierfs.peers import TIMEOUT_STRIKES
from unitkit import core, sample, write

CS = 64 << 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern(n: int, seed: int = 7) -> bytes:
    return bytes((i * seed + i // 251) & 0xFF for i in range(n))


@contextlib.asynccontextmanager
async def fleet(tmp_path, ports: list[int], listed: list[int] | None = None, **kw):
    """One core per port over TMP/src, each listing `listed` (default: all) as peers."""
    src = str(tmp_path / "src")
    os.makedirs(src, exist_ok=True)
    peers_file = tmp_path / "peers"
    peers_file.write_text("".join(f"127.0.0.1:{p}\n" for p in (listed or ports)))
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    async with contextlib.AsyncExitStack() as stack:
        rigs = []
        for i, port in enumerate(ports):
            node = tmp_path / f"node{i}"
            node.mkdir()
            rigs.append(await stack.enter_async_context(core(
                str(node), backend=FileBackend(src), bucket=src, chunk_size=CS,
                peers=f"file:{peers_file}", peer_listen=f"127.0.0.1:{port}",
                peer_secret_file=str(secret), **kw)))
        yield src, rigs


async def read_all(c, name: str, size: int) -> bytes:
    node = await c.ns.lookup(ROOT_INO, name.encode())
    h, _ = await c.io.open(node.ino)
    try:
        out = bytearray()
        while len(out) < size:
            out += await c.io.read(h.fh, len(out), 16 << 10)
        return bytes(out)
    finally:
        await c.io.release(h.fh)


def peer_results(c, role: str) -> dict[str, float]:
    return {r: sample(c.metrics, "tierfs_peer_requests_total", {"role": role, "result": r})
            for r in ("ok", "unavailable", "timeout", "corrupt", "refused", "stale")}


async def test_two_nodes_fetch_each_chunk_from_the_store_once(tmp_path):
    async with fleet(tmp_path, [free_port(), free_port()]) as (src, (a, b)):
        data = write(src, "ckpt", pattern(16 * CS))
        assert await read_all(a, "ckpt", len(data)) == data
        assert await read_all(b, "ckpt", len(data)) == data
        # every chunk from the store once, by its owner; the rest between the two nodes
        assert a.gets() + b.gets() == 16
        asked = peer_results(a, "client")["ok"] + peer_results(b, "client")["ok"]
        served = peer_results(a, "server")["ok"] + peer_results(b, "server")["ok"]
        assert asked == served == 16  # each node asked the other for what the other owns
        assert 0 < a.gets() < 16  # rendezvous split the 16 chunks between the two
        peer_in = sum(sample(c.metrics, "tierfs_peer_bytes_total", {"direction": "in"})
                      for c in (a, b))
        assert peer_in == 16 * CS
        assert sample(b.metrics, "tierfs_read_bytes_total", {"source": "peer"}) > 0
        # and B kept what it got from A: a second read asks nobody
        before = peer_results(b, "client")["ok"]
        assert await read_all(b, "ckpt", len(data)) == data
        assert peer_results(b, "client")["ok"] == before


async def test_a_peer_that_is_not_there_costs_a_store_read_and_is_marked_down(tmp_path):
    gone = free_port()  # listed, nothing listens there
    me = free_port()
    async with fleet(tmp_path, [me], listed=[me, gone]) as (src, (a,)):
        data = write(src, "f", pattern(32 * CS, seed=3))
        more = write(src, "g", pattern(32 * CS, seed=4))
        assert await read_all(a, "f", len(data)) == data
        assert a.gets() == 32  # every chunk from the store
        # the requests in flight when the first failed (the reader's and read-ahead's)
        # failed too; then the peer is down and not asked again for a while
        failed = peer_results(a, "client")["unavailable"]
        assert 1 <= failed <= 5
        assert await read_all(a, "g", len(more)) == more
        assert peer_results(a, "client")["unavailable"] == failed
        assert a.core.peers.members.live() == []
        assert sample(a.metrics, "tierfs_peers_up") == 0
        assert a.core.peers.status()["down"] == [f"127.0.0.1:{gone}"]


async def test_an_owner_that_knows_a_newer_version_refuses_and_the_store_decides(tmp_path):
    async with fleet(tmp_path, [free_port(), free_port()]) as (src, (a, b)):
        write(src, "f", pattern(8 * CS))
        old = await a.ns.lookup(ROOT_INO, b"f")
        old_etag = old.etag
        await b.ns.lookup(ROOT_INO, b"f")
        new = write(src, "f", pattern(8 * CS, seed=5))
        os.utime(os.path.join(src, "f"), (1, 1))  # FileBackend's ETag: size + mtime
        a.clock.advance(3600)  # A sees the new version; B still has the old one listed
        assert (await a.ns.revalidate(old)).etag != old_etag
        assert await read_all(a, "f", len(new)) == new
        # B's reads of the old version: A refuses (409) what B asks of it; B's own
        # GETs (If-Match the old ETag) fail, and B re-reads the new version. B starts at
        # a chunk A owns: a first GET of B's own would meet the new ETag before B asked A
        # anything (rendezvous over random ports: A owns one of 8 chunks but at 2^-8)
        stale = ObjectVersion(b.io.bucket, "f", old_etag, len(new))
        owned = [i for i in range(8) if b.walk.sources[0].peers.owner(stale.chunk_key(i)) is not None]
        assert owned
        first = owned[0] * CS
        node = await b.ns.lookup(ROOT_INO, b"f")
        h, _ = await b.io.open(node.ino)
        try:
            with trio.fail_after(30):
                assert await b.io.read(h.fh, first, 16 << 10) == new[first:first + (16 << 10)]
        finally:
            await b.io.release(h.fh)
        assert peer_results(a, "server")["stale"] >= 1
        with trio.fail_after(30):
            assert await read_all(b, "f", len(new)) == new


async def test_a_slow_owner_is_down_only_after_timeouts_in_a_row(tmp_path):
    me, slow = free_port(), free_port()
    listener = trio.socket.socket()
    listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", slow))
    listener.listen()  # accepted by the kernel, never answered: each request times out
    try:
        async with fleet(tmp_path, [me], listed=[me, slow], peer_timeout=0.2) as (src, (a,)):
            tier = a.core.peers
            [peer] = tier.members.all()
            fields = dict(bucket=src, key="k", etag="e", size=64 * CS, chunk_size=CS)
            owned = [i for i in range(64)
                     if tier.owner(b"o" * 16 + i.to_bytes(4, "big")) == peer][:TIMEOUT_STRIKES]
            assert len(owned) == TIMEOUT_STRIKES
            for n, i in enumerate(owned, 1):
                assert await tier.fetch(b"o" * 16 + i.to_bytes(4, "big"), index=i,
                                        **fields) is None
                assert peer_results(a, "client")["timeout"] == n
                # slow is not dead: up until the strikes are spent
                assert tier.members.live() == ([] if n == TIMEOUT_STRIKES else [peer])
    finally:
        listener.close()
