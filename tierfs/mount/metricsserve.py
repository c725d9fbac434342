"""The /metrics endpoint (docs/metrics.md), served from the daemon's own trio loop.

Not prometheus_client's server: it starts a thread per connection and keeps it while the
client keeps the connection, so any local user could make the daemon (root, for shared
mounts) hold thousands of threads and file descriptors, and with the fd limit reached
every read of the mount failed (issue 26, S3). Here a connection is a trio task:

- at most MAX_CONNECTIONS are open; a new one beyond that takes the place of the oldest
  connection waiting for a request (closed), or is closed at once if every one is being
  answered. A client that holds connections open without asking delays a scraper by the
  time it takes to send its request, it cannot lock it out;
- a request head (at most 8 KiB, tierfs/peers/http.py) must come whole within
  IDLE_TIMEOUT_S, also between the requests of a kept connection;
- a scrape is rendered in one worker thread at a time, off the loop that answers FUSE;
  its answer must be taken by the client within IDLE_TIMEOUT_S per 256 KiB piece.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import trio

from ..errors import StartupError
from ..metrics import Metrics
from ..peers.http import RequestHead, ServerConnection
from ..peers.wire import PeerError, PeerProtocolError

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16  # a Prometheus pair, a few curls and dashboards
IDLE_TIMEOUT_S = 10.0
_PATHS = ("/metrics", "/")


class _Place:
    """One open connection's place: cancelling its scope closes it."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.open = True


class MetricsServer:
    def __init__(self, metrics: Metrics, *, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.metrics = metrics
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.connections = 0
        self._waiting: OrderedDict[_Place, None] = OrderedDict()  # for a request, oldest first
        self._render = trio.CapacityLimiter(1)
        self._listeners: list[trio.SocketListener] = []

    async def bind(self, addr: tuple[str, int]) -> tuple[str, int]:
        """Listen on addr (a port in use is a start-up error, one line); the bound address."""
        host, port = addr
        try:
            self._listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {host}:{port}: "
                               f"{exc.strerror or exc}") from None
        bound = self._listeners[0].socket.getsockname()
        return str(bound[0]), int(bound[1])

    async def serve(self) -> None:
        """Answer scrapes on the bound listeners until cancelled."""
        await trio.serve_listeners(self._connection, self._listeners)

    def _admit(self) -> _Place | None:
        if self.connections >= self.max_connections:
            if not self._waiting:
                return None
            self._close(next(iter(self._waiting)))
        self.connections += 1
        return _Place()

    def _close(self, place: _Place) -> None:
        if place.open:
            place.open = False
            self.connections -= 1
            self._waiting.pop(place, None)
            place.scope.cancel()

    async def _connection(self, stream: trio.SocketStream) -> None:
        place = self._admit()
        if place is None:
            await trio.aclose_forcefully(stream)
            return
        try:
            with place.scope:
                http = ServerConnection(stream)
                while True:
                    self._waiting[place] = None
                    head = await self._read_head(http)
                    self._waiting.pop(place, None)
                    if head is None or not await self._answer(http, head):
                        return
        except PeerError:
            pass  # the connection broke or the client stopped reading
        except Exception:  # a bug: it ends this connection, not the server
            log.exception("metrics server: a connection failed")
            self.metrics.internal_errors.labels(task="metrics-server").inc()
        finally:
            self._close(place)
            await trio.aclose_forcefully(stream)

    async def _read_head(self, http: ServerConnection) -> RequestHead | None:
        """The next request, or None to close: the client closed or was idle too long, or
        its head was malformed (answered with its 4xx)."""
        with trio.move_on_after(self.idle_timeout_s):
            try:
                return await http.read_head()
            except PeerProtocolError:
                if http.error_status and http.can_send_error:
                    await http.respond(http.error_status, [], keep_alive=False)
        return None

    async def _answer(self, http: ServerConnection, head: RequestHead) -> bool:
        """Answer one request; True if the connection may take another."""
        if head.method != "GET" or head.has_body:
            return await http.respond(405, [("allow", "GET")], b"GET /metrics only\n",
                                      keep_alive=False, piece_timeout_s=self.idle_timeout_s)
        if head.target.split("?", 1)[0] not in _PATHS:
            return await http.respond(404, [], b"metrics are at /metrics\n",
                                      piece_timeout_s=self.idle_timeout_s)
        body, headers = await trio.to_thread.run_sync(
            self.metrics.exposition, head.headers.get("accept", ""),
            head.headers.get("accept-encoding", ""), limiter=self._render)
        return await http.respond(200, headers, body, piece_timeout_s=self.idle_timeout_s)
