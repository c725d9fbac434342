"""PeerClient: a chunk from another node, verified, within a deadline.

A reply is used only if it checks out, in this order: status 200, a content-length equal
to the chunk's length (and at most 64 MiB), the ETag header equal to the request's, a
well-formed block CRC list of the right count, the reply signature (under the shared
secret, bound to this request), and only then is the body read (from the socket straight
into one bytearray of that length) and each block's CRC32C compared with the header's.
Any mismatch is PeerCorrupt and the connection is closed; every socket, TLS and HTTP
failure is a PeerError subclass, the deadline PeerTimeout. Idle keep-alive connections
are kept per peer (at most connections_per_peer, each for a few seconds: the server
closes idle ones after its header timeout); a request on a kept connection that the
server had closed meanwhile is sent again once on a new one.
"""

from __future__ import annotations

import math
import ssl
import time
from typing import TYPE_CHECKING, Callable

import trio

from ..metrics import Metrics
from . import wire
from .http import MAX_ERROR_BODY, ClientConnection, ResponseHead
from .wire import (
    ChunkReply,
    ChunkRequest,
    PeerAuthError,
    PeerCorrupt,
    PeerError,
    PeerProtocolError,
    PeerRefused,
    PeerTimeout,
    PeerUnavailable,
)

if TYPE_CHECKING:
    from .members import Peer

IDLE_S = 4.0  # an idle connection is reused this long (the server's header timeout: 10 s)


class PeerClient:
    def __init__(self, secret: bytes, node: str, metrics: Metrics, *,
                 ssl_context: ssl.SSLContext | None = None, connections_per_peer: int = 4,
                 clock: Callable[[], float] = time.time) -> None:
        if not secret:
            raise ValueError("an empty peer secret")
        self._secret = secret
        self.node = node
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.connections_per_peer = connections_per_peer
        self.clock = clock
        # (host, port) -> idle connections with the trio time they became idle, oldest first
        self._idle: dict[tuple[str, int], list[tuple[ClientConnection, float]]] = {}
        self.connects = 0  # connections opened (keep-alive reuse shows as fewer)

    def __repr__(self) -> str:  # never the secret
        return f"PeerClient(node={self.node!r})"

    async def fetch(self, peer: Peer, req: ChunkRequest, *, timeout_s: float) -> ChunkReply:
        """The chunk `req` names from `peer`, verified; a PeerError subclass otherwise."""
        try:
            with trio.fail_after(timeout_s):
                reply = await self._fetch(peer, req)
        except trio.TooSlowError:
            self._count(PeerTimeout.result)
            raise PeerTimeout(f"no reply within {timeout_s:g} s") from None
        except PeerError as exc:
            self._count(exc.result)
            raise
        self._count("ok")
        return reply

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                await conn.aclose()

    async def _fetch(self, peer: Peer, req: ChunkRequest) -> ChunkReply:
        target = req.target()
        while True:
            conn = await self._connection(peer)
            keep = False
            try:
                auth = wire.sign_request(self._secret, self.node, "GET", target, self.clock())
                head = await conn.request(target, [("host", peer.name),
                                                   ("authorization", auth)])
                if head.status != wire.OK:
                    await self._read_error_body(conn, head)
                    keep = conn.usable
                    raise _refusal(head.status)
                reply = await self._read_reply(conn, head, req, auth)
                keep = conn.usable
                return reply
            except PeerUnavailable:
                if conn.used and not conn.answered:
                    continue  # the server closed a kept connection meanwhile: a new one
                raise
            finally:
                if keep:
                    await self._release(peer, conn)
                else:
                    await conn.aclose()

    async def _read_reply(self, conn: ClientConnection, head: ResponseHead, req: ChunkRequest,
                          auth: str) -> ChunkReply:
        length = _header_int(head, "content-length")
        if length > wire.MAX_CHUNK or length != req.length:
            raise PeerCorrupt(f"reply of {length} bytes for a chunk of {req.length}")
        if head.headers.get("x-tierfs-etag") != req.etag:
            raise PeerCorrupt("the reply is for another ETag")
        block_size = _header_int(head, "x-tierfs-block-size")
        if not wire.MIN_BLOCK <= block_size <= wire.MAX_CHUNK:
            raise PeerCorrupt(f"block size {block_size} out of range")
        crcs = wire.parse_crcs(head.headers.get("x-tierfs-crc32c", ""))
        if len(crcs) != math.ceil(length / block_size):
            raise PeerCorrupt(f"{len(crcs)} CRCs for {length} bytes in {block_size}-byte blocks")
        wire.verify_reply(self._secret, auth, req.etag, crcs, block_size, length,
                          head.headers.get("x-tierfs-sig"))
        buf = bytearray(length)
        await conn.read_body(memoryview(buf), head)
        self.metrics.peer_bytes.labels(direction="in").inc(length)
        got = wire.block_crcs(buf, block_size)
        if got != crcs:
            bad = next(i for i, (a, b) in enumerate(zip(got, crcs, strict=True)) if a != b)
            raise PeerCorrupt(f"block {bad} of {req.bucket}/{req.key} chunk {req.index} "
                              f"fails its CRC32C")
        return ChunkReply(buf, crcs, block_size)

    async def _read_error_body(self, conn: ClientConnection, head: ResponseHead) -> None:
        """Read a short error text so the connection can be kept; a long one is not read
        (the connection is closed instead)."""
        try:
            n = _header_int(head, "content-length")
        except PeerCorrupt:
            conn.usable = False
            return
        if n > MAX_ERROR_BODY:
            conn.usable = False
            return
        await conn.read_body(memoryview(bytearray(n)), head)

    async def _connection(self, peer: Peer) -> ClientConnection:
        idle = self._idle.get((peer.host, peer.port))
        now = trio.current_time()
        while idle:
            conn, since = idle.pop()  # the most recently used: the least likely closed
            if now - since <= IDLE_S:
                return conn
            await conn.aclose()
        self.connects += 1
        return await ClientConnection.connect(peer.host, peer.port, self.ssl_context)

    async def _release(self, peer: Peer, conn: ClientConnection) -> None:
        idle = self._idle.setdefault((peer.host, peer.port), [])
        idle.append((conn, trio.current_time()))
        if len(idle) > self.connections_per_peer:
            old, _ = idle.pop(0)
            await old.aclose()

    def _count(self, result: str) -> None:
        self.metrics.peer_requests.labels(role="client", result=result).inc()


def _refusal(status: int) -> PeerError:
    if status == wire.UNAUTHORIZED:
        return PeerAuthError("the peer refused our signature (the same secret on every "
                             "node? clocks in step?)")
    if status in (wire.BAD_REQUEST, wire.METHOD_NOT_ALLOWED, 431):
        return PeerProtocolError(f"the peer answered {status}")
    return PeerRefused(status)


def _header_int(head: ResponseHead, name: str) -> int:
    value = head.headers.get(name, "")
    if not value.isascii() or not value.isdigit() or len(value) > 20:
        raise PeerCorrupt(f"bad {name} header")
    return int(value)
