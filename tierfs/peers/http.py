"""The little HTTP/1.1 peers speak, over a trio stream (TCP, or TLS around it); the
metrics endpoint (tierfs/mount/metricsserve.py) serves its scrapes with the same server side.

The only module importing h11, which parses and frames heads; every h11, socket and TLS
exception leaves here as a PeerError. Server side: one request head at a time (bounded;
a request body is never read), a response with a body sent from a buffer in paced
pieces, keep-alive. Client side: one GET, its response head, then the body read from the
socket into the caller's buffer (a bytearray of content-length), not through h11, whose
events would copy it twice more.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import h11
import trio

from .wire import PeerProtocolError, PeerUnavailable

MAX_HEAD = 8 << 10  # a request head (one GET: target, host, authorization)
MAX_REPLY_HEAD = 192 << 10  # up to 16,384 CRCs of 9 characters (64 MiB in 4 KiB blocks)
MAX_ERROR_BODY = 1024  # an error reply's text; longer ones are not read, the connection goes
_RECEIVE = 64 << 10
_SEND_PIECE = 256 << 10  # the unit of pacing (bandwidth limit) and of the send timeout

# what a broken, reset or closed connection or a failed TLS handshake raises in trio
_BROKEN = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError)


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    authorization: str | None
    has_body: bool  # a content-length other than 0 or a transfer-encoding
    # lower-case names; a repeated header keeps its last value
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    keep_alive: bool


def _text(value: bytes) -> str:
    return value.decode("latin-1")  # what HTTP allows in a header: never a decode error


async def tls_server_stream(stream: trio.abc.Stream, ctx: ssl.SSLContext) -> trio.SSLStream:
    tls = trio.SSLStream(stream, ctx, server_side=True, https_compatible=True)
    try:
        await tls.do_handshake()
    except _BROKEN as exc:
        raise PeerUnavailable(f"TLS handshake failed: {exc.__class__.__name__}") from None
    return tls


class ServerConnection:
    """Requests read from one accepted connection, one at a time."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self._can_reuse = True
        self.error_status: int | None = None
        self._head_bytes = 0  # bytes received towards the current request's head

    async def read_head(self) -> RequestHead | None:
        """The next request's head; None when the client closed between requests.
        PeerProtocolError for a malformed or oversized head (then `error_status` is the
        answer to give, if any), PeerUnavailable for a broken connection."""
        self.error_status = None
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self.error_status = exc.error_status_hint
                raise PeerProtocolError("malformed request head") from None
            if event is h11.NEED_DATA:
                if self._head_bytes > MAX_HEAD:
                    self.error_status = 431
                    raise PeerProtocolError("request head too large")
                try:
                    data = await self.stream.receive_some(MAX_HEAD + 1)
                except _BROKEN as exc:
                    raise PeerUnavailable(f"connection broken: {exc.__class__.__name__}") \
                        from None
                self._head_bytes += len(data)
                try:
                    self._h11.receive_data(bytes(data))  # SocketStream's: bytes, no copy
                except h11.RemoteProtocolError:
                    raise PeerProtocolError("data after the connection closed") from None
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                # h11 bounds only a head still incomplete: one that came whole in one
                # read is measured here
                if self._head_bytes - len(self._h11.trailing_data[0]) > MAX_HEAD:
                    self.error_status = 431
                    raise PeerProtocolError("request head too large")
                headers = {_text(k): _text(v) for k, v in event.headers}
                has_body = ("transfer-encoding" in headers
                            or headers.get("content-length", "0") != "0")
                if has_body:
                    self._can_reuse = False  # its body is never read
                else:  # the end of a body-less message: h11 needs no more bytes for it
                    end = self._h11.next_event()
                    if not isinstance(end, h11.EndOfMessage):
                        raise PeerProtocolError("no end of the request")
                return RequestHead(_text(event.method), _text(event.target),
                                   headers.get("authorization"), has_body, headers)
            raise PeerProtocolError(f"unexpected {type(event).__name__}")

    @property
    def can_send_error(self) -> bool:
        return self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    async def respond(self, status: int, headers: list[tuple[str, str]],
                      body: bytes | bytearray | memoryview = b"", *, keep_alive: bool = True,
                      pace: Callable[[int], Awaitable[None]] | None = None,
                      piece_timeout_s: float = 10.0) -> bool:
        """Send one response; True if the connection can take another request. `pace(n)`
        is awaited before each piece of the body (the bandwidth limit); each piece must be
        accepted by the socket within piece_timeout_s (a reader that stopped reading does
        not hold the request slot forever)."""
        view = memoryview(body).cast("B")
        keep_alive = keep_alive and self._can_reuse
        hdrs = [("content-length", str(len(view)))] + headers
        if not keep_alive:
            hdrs.append(("connection", "close"))
        try:
            await self._send(self._h11.send(h11.Response(status_code=status, headers=hdrs)),
                             piece_timeout_s)
            for i in range(0, len(view), _SEND_PIECE):
                piece = view[i:i + _SEND_PIECE]
                if pace is not None:
                    await pace(len(piece))
                # h11 passes a Data's bytes through untouched: a memoryview is no copy
                sent = self._h11.send_with_data_passthrough(
                    h11.Data(data=piece))  # type: ignore[arg-type]  # passed through as is
                for out in sent or ():  # None only for ConnectionClosed
                    await self._send(out, piece_timeout_s)
            await self._send(self._h11.send(h11.EndOfMessage()), piece_timeout_s)
        except h11.LocalProtocolError as exc:  # a header value h11 refuses: our bug
            raise PeerProtocolError(f"cannot send the response: {exc}") from None
        if not keep_alive or self._h11.our_state is not h11.DONE \
                or self._h11.their_state is not h11.DONE:
            return False
        self._h11.start_next_cycle()
        self._head_bytes = len(self._h11.trailing_data[0])  # a pipelined request's start
        return True

    async def linger_close(self, timeout_s: float) -> None:
        """Close after an answer that ends the connection: our side first, then what the
        client still sends is read and dropped for a moment (closing a socket with unread
        bytes resets it, and the reset can destroy the answer before the client reads it)."""
        try:
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()
            with trio.move_on_after(timeout_s):
                for _ in range(16):
                    if not await self.stream.receive_some(_RECEIVE):
                        break
        except _BROKEN:
            pass
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _send(self, data: bytes | memoryview | None, timeout_s: float) -> None:
        if not data:
            return
        try:
            with trio.fail_after(timeout_s):
                await self.stream.send_all(data)
        except trio.TooSlowError:
            raise PeerUnavailable("the client stopped reading") from None
        except _BROKEN as exc:
            raise PeerUnavailable(f"connection broken: {exc.__class__.__name__}") from None


class ClientConnection:
    """One keep-alive connection to a peer; a GET at a time. Every failure is a PeerError
    and leaves the connection unusable (`usable` False): the caller closes it."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.usable = True
        self.used = False  # has answered a request before (a pooled connection)
        self._rest = b""  # bytes after the head: the body's beginning
        self.answered = False  # the last request got at least a byte back

    @classmethod
    async def connect(cls, host: str, port: int,
                      ssl_context: ssl.SSLContext | None) -> ClientConnection:
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        except _BROKEN as exc:
            raise PeerUnavailable(f"cannot connect: {exc.__class__.__name__}") from None
        if ssl_context is not None:
            tls = trio.SSLStream(stream, ssl_context, server_hostname=host,
                                 https_compatible=True)
            try:
                await tls.do_handshake()
            except _BROKEN as exc:
                await trio.aclose_forcefully(stream)
                cause = exc.__cause__ or exc
                raise PeerUnavailable(f"TLS handshake failed: {cause.__class__.__name__}") \
                    from None
            stream = tls
        return cls(stream)

    async def request(self, target: str, headers: list[tuple[str, str]]) -> ResponseHead:
        """Send a GET and read the response's head. PeerUnavailable if the connection
        is broken or closed before the head (`answered` then says whether a byte came)."""
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_REPLY_HEAD)
        self.answered = False
        self.usable = False  # until the whole response is read
        try:
            out = conn.send(h11.Request(method="GET", target=target, headers=headers))
            out += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            raise PeerProtocolError(f"cannot send the request: {exc}") from None
        try:
            await self.stream.send_all(out)
        except _BROKEN as exc:
            raise PeerUnavailable(f"connection broken: {exc.__class__.__name__}") from None
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                raise PeerProtocolError("malformed response head") from None
            if event is h11.NEED_DATA:
                data = await self._receive()
                if not data:
                    raise PeerUnavailable("connection closed before the response")
                self.answered = True
                conn.receive_data(data)
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                break
            raise PeerUnavailable("connection closed before the response")
        headers_ = {_text(k): _text(v) for k, v in event.headers}
        self._rest = conn.trailing_data[0]
        keep = (event.http_version == b"1.1"
                and headers_.get("connection", "").lower() != "close")
        if "transfer-encoding" in headers_:
            raise PeerProtocolError("a reply must have a content-length")
        return ResponseHead(event.status_code, headers_, keep)

    async def read_body(self, buf: memoryview, head: ResponseHead) -> None:
        """Read exactly len(buf) body bytes into buf (the head's content-length, checked
        by the caller); the connection is usable again if the reply allows keep-alive."""
        n = len(buf)
        got = min(len(self._rest), n)
        buf[:got] = self._rest[:got]
        if len(self._rest) > n:
            raise PeerProtocolError("bytes after the response body")
        self._rest = b""
        sock = getattr(self.stream, "socket", None)  # plain TCP: recv_into, no copy
        while got < n:
            if sock is not None:
                try:
                    k = await sock.recv_into(buf[got:])
                except _BROKEN as exc:
                    raise PeerUnavailable(f"connection broken: {exc.__class__.__name__}") \
                        from None
            else:
                data = await self._receive(n - got)
                k = len(data)
                buf[got:got + k] = data
            if k == 0:
                raise PeerUnavailable(f"connection closed after {got} of {n} body bytes")
            got += k
        self.usable = head.keep_alive
        self.used = True

    async def _receive(self, max_bytes: int = _RECEIVE) -> bytes:
        try:
            # bytes() of SocketStream's bytes is the same object; a bytearray is copied
            return bytes(await self.stream.receive_some(max_bytes))
        except _BROKEN as exc:
            raise PeerUnavailable(f"connection broken: {exc.__class__.__name__}") from None

    async def aclose(self) -> None:
        self.usable = False
        await trio.aclose_forcefully(self.stream)
