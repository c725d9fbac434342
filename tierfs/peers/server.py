"""PeerServer: this node's chunks for the other nodes, to authenticated askers only.

Per request, in this order: the head (at most 8 KiB, read within header_timeout_s), the
signature (401 with an empty body otherwise: nothing else of the request is looked at),
the method (GET only: 405) and no body (400: a body is never read), the target (400),
the concurrency limit (503 at once beyond max_concurrent: a hot node answers "busy"
instead of queueing readers who will give up anyway), then the injected `serve` callback
(the core: memory/disk tier or one store fetch), whose PeerRefused becomes the status.
Bodies are paced by one token bucket over all clients (`bandwidth`, bytes/s).

Connections: at most max_connections. One that has not yet sent a signed request is
"unproven": a source address holds at most PER_SOURCE_UNPROVEN of those, and all sources
together at most max_connections - KEPT_FOR_PEERS, so peers that signed a request always
have that share. A new connection past either bound takes the place of the oldest unproven
one in it (closed), never of a proven one: idle or slow connections without the secret can
delay an honest peer's new connection by the time it takes to send its head, not refuse it.

The 401 WARNING is rate-limited per source address and over all of them (a flood from many
addresses is a few lines); what it leaves out is counted in
tierfs_peer_unauthorized_unlogged_total and summed up in the next line.
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from ..errors import StartupError
from ..metrics import Metrics
from . import wire
from .http import RequestHead, ServerConnection, tls_server_stream
from .wire import ChunkReply, ChunkRequest, PeerAuthError, PeerError, PeerRefused

log = logging.getLogger(__name__)

Serve = Callable[[ChunkRequest], Awaitable[ChunkReply]]  # raises PeerRefused(status) to refuse

_WARN_EVERY_S = 60.0  # one 401 warning per remote address per minute
_WARN_MAX = 10  # and at most this many 401 warnings a minute over all addresses
_WARNED_MAX = 4096  # addresses remembered for that; beyond, the oldest are forgotten
_LINGER_S = 1.0  # how long a closing connection's unread request bytes are drained
_MAX_CONNECTIONS = 256  # per node: a connection costs a task and buffers before auth
PER_SOURCE_UNPROVEN = 8  # connections of one address that have not signed a request yet
KEPT_FOR_PEERS = 64  # of max_connections, never taken by unproven connections


class TokenBucket:
    """Bytes per second over all callers, with a burst of `burst` bytes. A caller takes
    its bytes at once (the balance may go negative) and is told how long to wait: so
    waiters are served in order and the rate holds however many there are."""

    def __init__(self, rate: int, burst: int, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.taken = 0  # bytes paced so far
        self.waited_s = 0.0  # the waits imposed so far
        self._last = clock()

    def take(self, n: int) -> float:
        """Take n bytes' worth; the seconds to wait before sending them."""
        now = self.clock()
        # a clock stepped back gives nothing (never a negative refill)
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self._last) * self.rate)
        self._last = max(self._last, now)
        self.tokens -= n
        self.taken += n
        wait = max(0.0, -self.tokens / self.rate)
        self.waited_s += wait
        return wait

    async def spend(self, n: int) -> None:
        wait = self.take(n)
        if wait > 0:
            await trio.sleep(wait)


@dataclass(eq=False)
class _Conn:
    remote: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    proven: bool = False  # sent a request signed with the secret
    open: bool = True  # counted in PeerServer.connections


class _Unproven:
    """Connections that have not signed a request yet, oldest first, per source address
    and in all."""

    def __init__(self) -> None:
        self.all: OrderedDict[_Conn, None] = OrderedDict()
        self.by_source: dict[str, OrderedDict[_Conn, None]] = {}

    def add(self, conn: _Conn) -> None:
        self.all[conn] = None
        self.by_source.setdefault(conn.remote, OrderedDict())[conn] = None

    def discard(self, conn: _Conn) -> None:
        if conn in self.all:
            del self.all[conn]
            mine = self.by_source[conn.remote]
            del mine[conn]
            if not mine:
                del self.by_source[conn.remote]

    def of(self, remote: str) -> int:
        return len(self.by_source.get(remote, ()))

    def oldest(self, remote: str | None = None) -> _Conn:
        return next(iter(self.all if remote is None else self.by_source[remote]))


class PeerServer:
    def __init__(self, listen: tuple[str, int], secret: bytes, serve: Serve, metrics: Metrics,
                 *, ssl_context: ssl.SSLContext | None = None, max_concurrent: int = 32,
                 bandwidth: int | None = None, header_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time,
                 max_connections: int = _MAX_CONNECTIONS,
                 kept_for_peers: int = KEPT_FOR_PEERS,
                 per_source_unproven: int = PER_SOURCE_UNPROVEN) -> None:
        if not secret:
            raise ValueError("an empty peer secret")
        self.listen = listen
        self._secret = secret
        self.serve = serve
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.max_concurrent = max_concurrent
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.clock = clock
        # the burst: an eighth of a second's worth, at least one send piece
        self.bandwidth_bucket = (TokenBucket(bandwidth, max(256 << 10, bandwidth // 8), clock)
                                 if bandwidth else None)
        self.active = 0  # requests being served (serve callback and body)
        self.connections = 0
        self.max_unproven = max(1, max_connections - kept_for_peers)
        self.per_source_unproven = per_source_unproven
        self._unproven = _Unproven()
        self._warned: dict[str, float] = {}
        self._warn_times: list[float] = []  # the global 401 warnings of the last minute
        self._unlogged = 0  # 401s not logged since the last warning

    def __repr__(self) -> str:  # never the secret
        return f"PeerServer(listen={self.listen!r})"

    async def run(self, *, task_status: trio.TaskStatus[tuple[str, int]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound (host, port) through task_status, serve forever."""
        host, port = self.listen
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise StartupError(f"cannot listen for peers on {host}:{port}: "
                               f"{exc.strerror or exc}") from None
        bound = listeners[0].socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._connection, listeners)
            task_status.started((bound[0], bound[1]))

    def _admit(self, remote: str) -> _Conn | None:
        """Count a new connection in, closing the oldest unproven one it displaces; None
        when every place is held by proven connections."""
        unproven = self._unproven
        if unproven.of(remote) >= self.per_source_unproven:
            self._close(unproven.oldest(remote))
        elif len(unproven.all) >= self.max_unproven or self.connections >= self.max_connections:
            if not unproven.all:
                return None
            self._close(unproven.oldest())
        conn = _Conn(remote)
        unproven.add(conn)
        self.connections += 1
        return conn

    def _close(self, conn: _Conn) -> None:
        """Give up a connection's place now (its task closes the socket when it runs)."""
        if conn.open:
            conn.open = False
            self.connections -= 1
            self._unproven.discard(conn)
            conn.scope.cancel()

    def _proven(self, conn: _Conn) -> None:
        if not conn.proven:
            conn.proven = True
            self._unproven.discard(conn)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            remote = str(stream.socket.getpeername()[0])
        except OSError:
            remote = "?"
        place = self._admit(remote)
        if place is None:
            await trio.aclose_forcefully(stream)
            return
        try:
            with place.scope:
                conn: trio.abc.Stream = stream
                if self.ssl_context is not None:
                    with trio.move_on_after(self.header_timeout_s):
                        conn = await tls_server_stream(stream, self.ssl_context)
                    if conn is stream:
                        return
                http = ServerConnection(conn)
                while True:
                    head = await self._read_head(http)
                    if head is None:
                        return
                    if not await self._answer(http, head, place):
                        await http.linger_close(_LINGER_S)
                        return
        except PeerError:
            pass  # the connection broke or the client stopped reading: nothing to answer
        except Exception:  # a bug: it ends this connection, not the server and the others
            log.exception("peer server: a connection from %s failed", remote)
            self.metrics.internal_errors.labels(task="peer-server").inc()
        finally:
            self._close(place)
            await trio.aclose_forcefully(stream)

    async def _read_head(self, http: ServerConnection) -> RequestHead | None:
        """The next request's head, or None to close (the client closed, the head was
        malformed or oversized and got its 4xx, or it did not come whole in time: an idle
        keep-alive connection is closed the same way)."""
        with trio.move_on_after(self.header_timeout_s):
            try:
                return await http.read_head()
            except wire.PeerProtocolError:
                self._count("bad_request")
                if http.error_status and http.can_send_error:
                    await http.respond(http.error_status, [], keep_alive=False)
                    await http.linger_close(_LINGER_S)
        return None

    async def _answer(self, http: ServerConnection, head: RequestHead, place: _Conn) -> bool:
        """Answer one request; True if the connection may take another."""
        try:
            wire.verify_request(self._secret, head.method, head.target, head.authorization,
                                self.clock())
        except PeerAuthError as exc:
            self._count("unauthorized")
            self._warn(place.remote, str(exc))
            return await http.respond(wire.UNAUTHORIZED, [], keep_alive=False)
        self._proven(place)
        if head.method != "GET":
            self._count("bad_request")
            return await http.respond(wire.METHOD_NOT_ALLOWED, [("allow", "GET")],
                                      keep_alive=False)
        if head.has_body:
            self._count("bad_request")
            return await http.respond(wire.BAD_REQUEST, [], b"a GET has no body",
                                      keep_alive=False)
        try:
            req = ChunkRequest.parse(head.target)
        except wire.PeerProtocolError as exc:
            self._count("bad_request")
            return await http.respond(wire.BAD_REQUEST, [], str(exc).encode())
        if self.active >= self.max_concurrent:
            self._count("overloaded")
            return await http.respond(wire.OVERLOADED, [], b"busy")
        self.active += 1
        try:
            return await self._serve(http, head, req)
        finally:
            self.active -= 1

    async def _serve(self, http: ServerConnection, head: RequestHead, req: ChunkRequest) -> bool:
        try:
            reply = await self.serve(req)
        except PeerRefused as exc:
            status = exc.status if 400 <= exc.status <= 599 else wire.INTERNAL
            self._count(exc.result)
            return await http.respond(status, [], exc.result.encode())
        except Exception:  # a bug of the callback: this request fails, the server goes on
            log.exception("peer server: serving %s/%s chunk %d failed", req.bucket, req.key,
                          req.index)
            self._count("refused")
            return await http.respond(wire.INTERNAL, [], b"internal error")
        length = len(memoryview(reply.data).cast("B"))
        if (length != req.length or reply.block_size < wire.MIN_BLOCK
                or len(reply.crcs) != math.ceil(length / reply.block_size)):
            # a wrong byte is never sent: the reader would catch it, but it is our bug
            log.error("peer server: the reply for %s/%s chunk %d does not fit the request "
                      "(%d bytes, %d CRCs of %d-byte blocks; %d bytes asked)", req.bucket,
                      req.key, req.index, length, len(reply.crcs), reply.block_size,
                      req.length)
            self._count("refused")
            return await http.respond(wire.INTERNAL, [], b"internal error")
        assert head.authorization is not None  # verified above
        sig = wire.sign_reply(self._secret, head.authorization, req.etag, reply.crcs,
                              reply.block_size, length)
        headers = [("x-tierfs-etag", req.etag),
                   ("x-tierfs-block-size", str(reply.block_size)),
                   ("x-tierfs-crc32c", wire.format_crcs(reply.crcs)),
                   ("x-tierfs-sig", sig)]
        pace = self.bandwidth_bucket.spend if self.bandwidth_bucket is not None else None
        try:
            again = await http.respond(wire.OK, headers, reply.data, pace=pace,
                                       piece_timeout_s=self.header_timeout_s)
        except PeerError as exc:  # the reader went away or stopped reading
            self._count(exc.result)
            raise
        self._count("ok")
        self.metrics.peer_bytes.labels(direction="out").inc(length)
        return again

    def _count(self, result: str) -> None:
        self.metrics.peer_requests.labels(role="server", result=result).inc()

    def _warn(self, remote: str, reason: str) -> None:
        """One WARNING per remote address per minute and _WARN_MAX a minute in all: a
        misconfigured node is seen, a flood of bad requests from however many addresses
        does not flood the log. What is left out is counted, and told in the next line."""
        now = time.monotonic()
        self._warn_times = [t for t in self._warn_times if now - t < _WARN_EVERY_S]
        if (now - self._warned.get(remote, -_WARN_EVERY_S) < _WARN_EVERY_S
                or len(self._warn_times) >= _WARN_MAX):
            self._unlogged += 1
            self.metrics.peer_unauthorized_unlogged.inc()
            return
        if len(self._warned) >= _WARNED_MAX:
            for addr in sorted(self._warned, key=self._warned.__getitem__)[:_WARNED_MAX // 2]:
                del self._warned[addr]
        self._warned[remote] = now
        self._warn_times.append(now)
        more = (f"; {self._unlogged} more refused since the last such line, not logged"
                if self._unlogged else "")
        self._unlogged = 0
        log.warning("peer server: refused a request from %s: %s (same secret on every "
                    "node? clocks in step?)%s", remote, reason, more)
