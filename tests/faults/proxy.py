"""A fault-injecting HTTP proxy between tierfs and the test's Ceph RGW.

    from proxy import FaultProxy
    with FaultProxy(rgw.endpoint) as p:                  # 127.0.0.1, ephemeral port
        mount with --endpoint-url p.endpoint
        p.inject("reset", ops="GET", probability=0.3, seed=1)   # RST mid-body
        p.inject("503", ops={"PUT", "UploadPart"}, count=5)
        p.inject("501", ops="PUT", header="If-None-Match")  # a store without conditional PUTs
        p.inject("hang", ops="GET")                      # until p.release() / p.heal()
        p.down(); ...; p.up()                            # store unreachable (ECONNREFUSED)
        p.injected("reset", op="GET")                    # counters
        p.heal()                                         # store healthy again

Forwarding. tierfs talks path-style S3 over plain HTTP/1.1 with keep-alive, so each client
connection gets one upstream connection and requests are relayed one at a time, bytes
unchanged: SigV4 signs the Host header as the client sent it (127.0.0.1:PROXY_PORT) and RGW
verifies the signature against the Host it receives, so nothing needs re-signing. The one
header touched is `Expect: 100-continue`, which the proxy answers itself (it reads the whole
request before deciding on a fault) and does not pass on; botocore never signs it. A
keep-alive connection the store closed while idle is reopened and the request sent again,
as a client would, so the proxy injects nothing it was not asked to.

Faults. A rule (inject()) names a kind, the op kinds it applies to, a probability, a count
(most injections; None: no limit), a seed (each rule draws from its own random.Random, so a
given sequence of requests gets the same faults) and optionally a key: a substring of the
object key, or a predicate on it. For each request the rules are tried in the order they
were added; the first that fires is applied, at most one per request. A rule with a
`header` applies only to requests that carry that header (any value). Kinds:

  hang     the request is held, not forwarded, until release()/heal() or `seconds`
           (then: `then="forward"` relays it late, `then="close"` drops the connection)
  delay    forwarded after `seconds`
  refuse   the connection is reset (RST) at once, the request is not forwarded
  500      answered "500 InternalError" without forwarding
  503      answered "503 SlowDown" with Retry-After (`retry_after`, seconds) without forwarding
  501      answered "501 NotImplemented" without forwarding: with header="If-None-Match", a
           store that refuses conditional writes (a header cannot be stripped instead: SigV4
           signs it, and the store would refuse the request as tampered)
  reset    forwarded; the response is cut after `after` body bytes (None: a random point in
           the body) with an RST (SO_LINGER 0). A response without a body is cut before its
           headers. Applied to 2xx responses only.
  close    the same with a clean FIN
  flip     forwarded; `bits` random bits of the response body are flipped (2xx responses
           with a body only)

down()/up() stop and resume listening (connects get ECONNREFUSED; open connections are
reset). heal() removes every rule, releases every hang and listens again.

WAN. wan(rtt_s, bandwidth) makes the proxy a far link (the cloud bucket behind a WAN,
bench/tiers.py): every request is forwarded `rtt_s` late, and request bodies (up) and
response bodies (down) each go through a bandwidth cap of `bandwidth` bytes/s shared by
every connection (a token bucket per direction). wan(0, None) ends it. `bytes_up` and
`bytes_down` count the body bytes relayed, with or without WAN mode: what crossed the link.

Op kinds (classify()): GET, HEAD, LIST (ListObjects/V2), PUT, CreateMultipart, UploadPart,
Complete, Abort, Delete (also DeleteObjects), Copy (CopyObject and UploadPartCopy),
HeadBucket, ListUploads (ListMultipartUploads), Other.

The proxy runs trio in a daemon thread; the control methods may be called from any other
thread (not from inside a trio run).
"""

from __future__ import annotations

import collections
import fcntl
import math
import random
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import parse_qs, unquote, urlsplit

import trio

OPS = ("GET", "HEAD", "LIST", "PUT", "CreateMultipart", "UploadPart", "Complete", "Abort",
       "Delete", "Copy", "HeadBucket", "ListUploads", "Other")
KINDS = ("hang", "delay", "refuse", "500", "501", "503", "reset", "close", "flip")
# faults applied to the response as it passes (decided before forwarding, counted when applied)
_BODY_KINDS = {"reset", "close", "flip"}

_MAX_HEAD = 64 << 10
_PIECE = 64 << 10


# ------------------------------------------------------------------ classification
def classify(method: str, target: str, headers: dict[str, str]) -> tuple[str, str, str]:
    """(op kind, bucket, key) of a path-style S3 request."""
    path, _, query = target.partition("?")
    q = parse_qs(query, keep_blank_values=True)
    bucket, _, key = path.lstrip("/").partition("/")
    bucket, key = unquote(bucket), unquote(key)
    if not key:
        if method == "HEAD":
            return "HeadBucket", bucket, key
        if method == "GET":
            if "uploads" in q:
                return "ListUploads", bucket, key
            if q.keys() & {"location", "versioning", "policy", "acl", "lifecycle", "cors"}:
                return "Other", bucket, key
            return "LIST", bucket, key
        if method == "POST" and "delete" in q:
            return "Delete", bucket, key
        return "Other", bucket, key
    if method == "GET":
        return ("Other" if "uploadId" in q else "GET"), bucket, key
    if method == "HEAD":
        return "HEAD", bucket, key
    if method == "PUT":
        if "x-amz-copy-source" in headers:
            return "Copy", bucket, key
        if "partNumber" in q and "uploadId" in q:
            return "UploadPart", bucket, key
        return "PUT", bucket, key
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipart", bucket, key
        if "uploadId" in q:
            return "Complete", bucket, key
        return "Other", bucket, key
    if method == "DELETE":
        return ("Abort" if "uploadId" in q else "Delete"), bucket, key
    return "Other", bucket, key


# ------------------------------------------------------------------ rules
@dataclass
class Rule:
    kind: str
    ops: frozenset[str] | None  # None: every op kind
    probability: float = 1.0
    count: int | None = None  # most injections; None: no limit
    seed: int = 0
    key: str | Callable[[str], bool] | None = None  # substring of the key, or a predicate
    seconds: float | None = None  # hang: longest hold (None: until released); delay: delay
    then: str = "forward"  # after a hang times out: "forward" or "close"
    after: int | None = None  # reset/close: body bytes passed first (None: random)
    bits: int = 1  # flip
    retry_after: int = 1  # 503
    header: str | None = None  # only requests carrying this header (its name, any case)
    injected: int = 0
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.ops is not None:
            unknown = self.ops - set(OPS)
            if unknown:
                raise ValueError(f"unknown op kinds {sorted(unknown)} (one of {', '.join(OPS)})")
        if self.then not in ("forward", "close"):
            raise ValueError("then must be 'forward' or 'close'")
        self.rng = random.Random(self.seed)
        if self.header is not None:
            self.header = self.header.lower()

    def matches(self, op: str, key: str, headers: dict[str, str] | None = None) -> bool:
        return ((self.ops is None or op in self.ops)
                and (self.header is None or self.header in (headers or {}))
                and (self.key is None
                     or (self.key(key) if callable(self.key) else self.key in key))
                and (self.count is None or self.injected < self.count))


@dataclass
class Injection:
    """One injected fault, for the test's report."""
    t: float
    op: str
    kind: str
    key: str


class _Connection:
    """A client connection: its stream and the scope that ends it."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.scope = trio.CancelScope()
        self.rst = False  # end with an RST instead of a FIN

    def reset(self) -> None:
        """RST now (not when the task gets to it): the peer must see it before the caller
        of down() goes on."""
        self.rst = True
        _close_socket(self.stream.socket, rst=True)
        self.scope.cancel()


def _close_socket(sock, rst: bool) -> None:
    try:
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class _EOF(Exception):
    pass


class _NoResponse(Exception):
    """The store closed the connection before answering (e.g. an idle keep-alive one)."""


class _Reader:
    """Buffered reads of HTTP/1.1 framing from a trio stream."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(_PIECE)
        if not data:
            raise _EOF()
        self.buf += data

    async def head(self) -> bytes | None:
        """Up to and including the blank line; None at a clean EOF before any byte."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                out = bytes(self.buf[:end + 4])
                del self.buf[:end + 4]
                return out
            if len(self.buf) > _MAX_HEAD:
                raise ValueError("HTTP head too large")
            try:
                await self._fill()
            except _EOF:
                if not self.buf:
                    return None
                raise

    async def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                out = bytes(self.buf[:end + 2])
                del self.buf[:end + 2]
                return out
            await self._fill()

    async def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def some(self, limit: int) -> bytes:
        """1..limit bytes; b"" at EOF."""
        if not self.buf:
            try:
                await self._fill()
            except _EOF:
                return b""
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0]
    headers = []
    for ln in lines[1:]:
        if not ln:
            continue
        name, _, value = ln.partition(":")
        headers.append((name.strip(), value.strip()))
    return first, headers


def _hdict(headers: list[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers}


async def _read_chunked_raw(reader: _Reader) -> bytes:
    """A chunked body with its framing, as received."""
    out = bytearray()
    while True:
        line = await reader.line()
        out += line
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while True:  # trailers up to the blank line
                t = await reader.line()
                out += t
                if t == b"\r\n":
                    return bytes(out)
        out += await reader.exact(size + 2)


def _error_body(code: str, message: str, key: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message><Resource>/{key}</Resource>"
            f"<RequestId>fault-proxy</RequestId></Error>").encode()


def _canned(status: int, reason: str, code: str, message: str, key: str,
            extra: tuple[tuple[str, str], ...] = (), close: bool = False) -> bytes:
    body = _error_body(code, message, key)
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/xml",
             f"Content-Length: {len(body)}", "x-amz-request-id: fault-proxy",
             *(f"{k}: {v}" for k, v in extra)]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _BodyFault:
    """What happens to a response body as it passes: bits flipped, or a cut."""

    def __init__(self, rule: Rule, length: int | None) -> None:
        self.rule = rule
        self.offset = 0
        self.flips: set[int] = set()
        self.cut: int | None = None
        span = length if length is not None else _PIECE
        if rule.kind == "flip":
            n = max(1, rule.bits)
            self.flips = {rule.rng.randrange(span) * 8 + rule.rng.randrange(8)
                          for _ in range(n)} if span else set()
        else:
            if rule.after is not None:
                self.cut = rule.after if length is None else min(rule.after, max(length - 1, 0))
            else:
                self.cut = rule.rng.randrange(span) if span else 0

    def apply(self, data: bytes) -> tuple[bytes, bool]:
        """(bytes to send, whether the connection is cut after them)."""
        start, end = self.offset, self.offset + len(data)
        self.offset = end
        if self.cut is not None and end >= self.cut:
            return data[:self.cut - start], True
        mine = [b for b in self.flips if start * 8 <= b < end * 8]
        if mine:
            buf = bytearray(data)
            for b in mine:
                buf[b // 8 - start] ^= 1 << (b % 8)
            return bytes(buf), False
        return data, False


# ------------------------------------------------------------------ the proxy
class FaultProxy:
    """See the module docstring. `upstream`: "http://HOST:PORT" of the real store."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"upstream must be http://HOST:PORT, not {upstream!r}")
        self.upstream = (u.hostname, u.port)
        self.port = 0
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._injected: collections.Counter[tuple[str, str]] = collections.Counter()
        self._requests: collections.Counter[str] = collections.Counter()
        self._events: list[Injection] = []
        self._conns: set[_Connection] = set()
        self._listening = False
        self._is_down = False
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._release: trio.Event | None = None
        self._listener = None
        self._nursery: trio.Nursery | None = None
        self._rtt_s = 0.0
        self._bandwidth: float | None = None
        self._free_at = {"up": 0.0, "down": 0.0}  # trio time each direction's link is free
        self.bytes_up = 0
        self.bytes_down = 0

    # -------------------------------------------------------------- life cycle
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            raise RuntimeError("fault proxy did not start") from self._start_error
        if not self._started.is_set():
            raise RuntimeError("fault proxy did not start within 30 s")
        return self

    def stop(self) -> None:
        if self._thread is None or self._token is None:
            return
        try:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        except trio.RunFinishedError:
            pass
        self._thread.join(30)
        self._thread = None

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - reported to start() or lost at exit
            self._start_error = e
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self._release = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            listener = await self._listen()
            nursery.start_soon(self._accept_loop, listener)
            self._started.set()
            await self._stop.wait()
            self._release.set()
            for c in list(self._conns):
                c.reset()
            nursery.cancel_scope.cancel()

    async def _listen(self) -> trio.socket.SocketType:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind(("127.0.0.1", self.port))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._listening = True
        return sock

    async def _accept_loop(self, listener) -> None:
        self._listener = listener
        try:
            while True:
                sock, _ = await listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._nursery.start_soon(self._serve, _Connection(trio.SocketStream(sock)))
        except (trio.ClosedResourceError, OSError):
            pass  # down(): the listener was closed under us
        finally:
            listener.close()

    # -------------------------------------------------------------- control (any thread)
    def inject(self, kind: str, ops: str | set[str] | frozenset[str] | None = None, *,
               probability: float = 1.0, count: int | None = None, seed: int = 0,
               key: str | Callable[[str], bool] | None = None, seconds: float | None = None,
               then: str = "forward", after: int | None = None, bits: int = 1,
               retry_after: int = 1, header: str | None = None) -> Rule:
        """Add a fault rule (see the module docstring); returns it (remove() takes it)."""
        if isinstance(ops, str):
            ops = {ops}
        rule = Rule(kind, frozenset(ops) if ops is not None else None, probability, count, seed,
                    key, seconds, then, after, bits, retry_after, header)
        if kind == "delay" and seconds is None:
            raise ValueError("a delay needs seconds")
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule (hangs already holding a request stay until release())."""
        with self._lock:
            self._rules.clear()

    def release(self) -> None:
        """Let every held (hung) request go on."""
        self._call(self._release_now)

    def _release_now(self) -> None:
        self._release.set()
        self._release = trio.Event()

    def down(self) -> None:
        """The store is unreachable: stop listening (connects are refused) and reset every
        open connection."""
        self._call(self._down_now)

    def _down_now(self) -> None:
        # synchronously: once down() returns, connects are refused and open connections reset
        self._is_down = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._listening = False
        for c in list(self._conns):
            c.reset()

    def up(self) -> None:
        """Listen again on the same port."""
        trio.from_thread.run(self._up_now, trio_token=self._token)

    async def _up_now(self) -> None:
        if not self._is_down:
            return
        self._is_down = False
        listener = await self._listen()
        self._nursery.start_soon(self._accept_loop, listener)

    def wan(self, rtt_s: float, bandwidth: float | None) -> None:
        """A far link: each request `rtt_s` late, bodies capped at `bandwidth` bytes/s per
        direction (None: no cap)."""
        self._rtt_s = rtt_s
        self._bandwidth = bandwidth

    async def _pace(self, direction: str, n: int) -> None:
        """Count n body bytes; under a bandwidth cap, wait for their turn on the link."""
        if direction == "up":
            self.bytes_up += n
        else:
            self.bytes_down += n
        bw = self._bandwidth
        if not bw or not n:
            return
        now = trio.current_time()
        start = max(now, self._free_at[direction])
        self._free_at[direction] = start + n / bw
        await trio.sleep_until(self._free_at[direction])

    def heal(self) -> None:
        """The store is healthy again: no rules, no held requests, listening."""
        self.clear()
        self.release()
        self.up()

    def _call(self, fn) -> None:
        trio.from_thread.run_sync(fn, trio_token=self._token)

    # -------------------------------------------------------------- counters
    def injected(self, kind: str | None = None, op: str | None = None) -> int:
        """Faults injected so far (of a kind, on an op kind)."""
        with self._lock:
            return sum(n for (o, k), n in self._injected.items()
                       if (kind is None or k == kind) and (op is None or o == op))

    def injected_by_kind(self) -> dict[str, int]:
        with self._lock:
            out: collections.Counter[str] = collections.Counter()
            for (_, k), n in self._injected.items():
                out[k] += n
            return dict(out)

    def requests(self, op: str | None = None) -> int:
        """Requests received (whatever happened to them)."""
        with self._lock:
            return sum(self._requests.values()) if op is None else self._requests[op]

    def requests_by_op(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests)

    def events(self) -> list[Injection]:
        with self._lock:
            return list(self._events)

    # -------------------------------------------------------------- per request
    def _decide(self, op: str, key: str, headers: dict[str, str]) -> Rule | None:
        with self._lock:
            self._requests[op] += 1
            for rule in self._rules:
                if rule.matches(op, key, headers) and rule.rng.random() < rule.probability:
                    rule.injected += 1  # reserved; a body fault that cannot apply gives it back
                    if rule.kind not in _BODY_KINDS:
                        self._count(rule, op, key)
                    return rule
        return None

    def _count(self, rule: Rule, op: str, key: str) -> None:
        self._injected[(op, rule.kind)] += 1
        self._events.append(Injection(time.monotonic(), op, rule.kind, key))

    def _applied(self, rule: Rule, op: str, key: str, applied: bool) -> None:
        with self._lock:
            if applied:
                self._count(rule, op, key)
            else:
                rule.injected -= 1

    async def _serve(self, conn: _Connection) -> None:
        self._conns.add(conn)
        upstream: trio.SocketStream | None = None
        try:
            with conn.scope:
                reader = _Reader(conn.stream)
                up_reader = None
                while True:
                    head = await reader.head()
                    if head is None:
                        return
                    first, headers = _parse_head(head)
                    method, target, _ = first.split(" ", 2)
                    h = _hdict(headers)
                    if h.get("expect", "").lower() == "100-continue":
                        await conn.stream.send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                        headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                    if "chunked" in h.get("transfer-encoding", "").lower():
                        body = await _read_chunked_raw(reader)
                    else:
                        body = await reader.exact(int(h.get("content-length", "0") or 0))
                    op, _, key = classify(method, target, h)
                    rule = self._decide(op, key, h)
                    if rule is not None and not await self._before(conn, rule, key):
                        return
                    if rule is not None and rule.kind not in ("hang", "delay") \
                            and rule.kind not in _BODY_KINDS:
                        continue  # answered by the proxy
                    # forward, on the connection's own upstream connection
                    out = (f"{first}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
                           + "\r\n").encode("latin-1")
                    fault = rule if rule is not None and rule.kind in _BODY_KINDS else None
                    for attempt in (1, 2):
                        reused = upstream is not None
                        if upstream is None:
                            try:
                                upstream = await trio.open_tcp_stream(*self.upstream)
                            except OSError:
                                conn.rst = True
                                return
                            up_reader = _Reader(upstream)
                        try:
                            if self._rtt_s and attempt == 1:
                                await trio.sleep(self._rtt_s)
                            if attempt == 1:
                                await self._pace("up", len(body))
                            try:
                                await upstream.send_all(out + body)
                            except (trio.BrokenResourceError, OSError):
                                raise _NoResponse() from None
                            keep = await self._relay(conn, up_reader, method, op, key, fault)
                            break
                        except _NoResponse:
                            # a keep-alive connection the store had closed while idle: a
                            # client would open a new one and send again, so does the proxy
                            with trio.CancelScope(shield=True):
                                await upstream.aclose()
                            upstream = None
                            if reused and attempt == 1:
                                continue
                            conn.rst = True
                            return
                        except (_EOF, trio.BrokenResourceError, trio.ClosedResourceError,
                                OSError):
                            # the store dropped the connection mid-answer: so does the proxy
                            conn.rst = True
                            return
                    if not keep:
                        return
        except (_EOF, trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError):
            pass
        finally:
            self._conns.discard(conn)
            if upstream is not None:
                with trio.CancelScope(shield=True):
                    await upstream.aclose()
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        _close_socket(conn.stream.socket, conn.rst)

    async def _before(self, conn: _Connection, rule: Rule, key: str) -> bool:
        """Faults applied before forwarding; False: the connection ends now."""
        kind = rule.kind
        if kind == "hang":
            released = self._release
            with trio.move_on_after(rule.seconds if rule.seconds is not None else math.inf):
                await released.wait()
                return True
            if rule.then == "close":
                return False
            return True
        if kind == "delay":
            await trio.sleep(rule.seconds)
            return True
        if kind == "refuse":
            conn.rst = True
            return False
        if kind == "500":
            await conn.stream.send_all(_canned(
                500, "Internal Server Error", "InternalError",
                "We encountered an internal error. Please try again.", key))
            return True
        if kind == "501":
            await conn.stream.send_all(_canned(
                501, "Not Implemented", "NotImplemented",
                "A header you provided implies functionality that is not implemented.", key))
            return True
        if kind == "503":
            await conn.stream.send_all(_canned(
                503, "Slow Down", "SlowDown", "Please reduce your request rate.", key,
                extra=(("Retry-After", str(rule.retry_after)),)))
            return True
        return True  # body faults: applied while relaying

    async def _relay(self, conn: _Connection, up: _Reader, method: str, op: str, key: str,
                     fault: Rule | None) -> bool:
        """Relay one response; True if both connections stay open for the next request."""
        interim = False
        while True:
            try:
                head = await up.head()
            except (trio.BrokenResourceError, OSError):
                head = None
            if head is None:
                raise _EOF() if interim else _NoResponse()
            first, headers = _parse_head(head)
            status = int(first.split(" ", 2)[1])
            if status >= 200:
                break
            await conn.stream.send_all(head)  # an interim response, passed on
            interim = True
        h = _hdict(headers)
        chunked = "chunked" in h.get("transfer-encoding", "").lower()
        if method == "HEAD" or status in (204, 304):
            length: int | None = 0
        elif chunked:
            length = None
        elif "content-length" in h:
            length = int(h["content-length"])
        else:
            length = -1  # until the store closes
        keep = (h.get("connection", "").lower() != "close" and length != -1
                and not first.startswith("HTTP/1.0"))
        body_fault = None
        if fault is not None:
            applies = 200 <= status < 300 and (fault.kind != "flip" or length != 0)
            self._applied(fault, op, key, applies)
            if applies:
                if length == 0:  # nothing to cut into: the response never arrives
                    conn.rst = fault.kind == "reset"
                    return False
                body_fault = _BodyFault(fault, None if length in (None, -1) else length)
        await conn.stream.send_all(head)

        async def send(data: bytes) -> bool:
            """Payload bytes through the fault; False once the connection is cut."""
            await self._pace("down", len(data))
            if body_fault is not None:
                data, cut = body_fault.apply(data)
                if data:
                    await conn.stream.send_all(data)
                if cut:
                    conn.rst = body_fault.rule.kind == "reset"
                    if conn.rst:
                        await _drained(conn.stream.socket)
                    return False
                return True
            await conn.stream.send_all(data)
            return True

        if length == 0:
            return keep
        if length is not None and length > 0:
            left = length
            while left:
                data = await up.some(min(left, _PIECE))
                if not data:
                    raise _EOF()
                left -= len(data)
                if not await send(data):
                    return False
            return keep
        if length == -1:
            while data := await up.some(_PIECE):
                if not await send(data):
                    return False
            return False
        # chunked: framing passed on unchanged, payload through the fault
        while True:
            line = await up.line()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            await conn.stream.send_all(line)
            if size == 0:
                while True:
                    t = await up.line()
                    await conn.stream.send_all(t)
                    if t == b"\r\n":
                        return keep
            left = size
            while left:
                data = await up.some(min(left, _PIECE))
                if not data:
                    raise _EOF()
                left -= len(data)
                if not await send(data):
                    return False
            await conn.stream.send_all(await up.exact(2))


async def _drained(sock, timeout: float = 1.0) -> None:
    """Wait (bounded) until the kernel has sent what we queued, so an RST right after does
    not discard bytes the fault promised the client."""
    deadline = trio.current_time() + timeout
    buf = bytearray(4)
    while trio.current_time() < deadline:
        try:
            fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)  # SIOCOUTQ: unsent bytes
        except OSError:
            return
        if struct.unpack("i", bytes(buf))[0] == 0:
            return
        await trio.sleep(0.005)
