"""Small in-test servers for body faults (importable as `bodyproxy`).

BodyProxy: an HTTP/1.1 proxy on 127.0.0.1 in front of the real RGW that passes requests
through unchanged (so SigV4 signatures hold) and applies the faults queued in `faults`,
one each, to the next successful GET responses that carry a body: cut the body after
`at` bytes with a FIN or an RST, stall it there, flip a bit at `at`, or add headers.
`requests` records what reached it (method, path, headers) for the tests to check, e.g.
the Range and If-Match of a resume. Threads and blocking sockets: the backend under test
is synchronous.

HangingServer: accepts connections, reads the request and never answers.

The full fault-injection proxy of the suite is tests/faults/proxy.py; these stay minimal
so the backend tests depend on nothing else.
"""

from __future__ import annotations

import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse


@dataclass
class Fault:
    kind: str  # "fin" | "rst" | "stall" | "flip" | "headers"
    at: int = 0  # body offset of the cut, stall or flipped bit
    headers: dict[str, str] = field(default_factory=dict)  # for "headers"
    before: Callable[[], None] | None = None  # run just before the fault is applied


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    return head


def _read_exact(sock: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        data = sock.recv(max(65536, n - len(buf)))
        if not data:
            raise ConnectionError("upstream closed mid-body")
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_chunked(sock: socket.socket, buf: bytearray) -> bytes:
    """A chunked body as raw bytes (sizes, data and trailer), relayed as it came."""
    out = bytearray()
    while True:
        while b"\r\n" not in buf:
            buf += sock.recv(65536)
        line_end = buf.index(b"\r\n") + 2
        size = int(bytes(buf[:line_end]).split(b";")[0].strip(), 16)
        out += _read_exact(sock, buf, line_end)
        if size == 0:
            while not (out.endswith(b"\r\n\r\n") or bytes(buf[:2]) == b"\r\n"):
                while b"\r\n" not in buf:
                    buf += sock.recv(65536)
                line_end = buf.index(b"\r\n") + 2
                out += _read_exact(sock, buf, line_end)
            if bytes(buf[:2]) == b"\r\n":
                out += _read_exact(sock, buf, 2)
            return bytes(out)
        out += _read_exact(sock, buf, size + 2)


def _parse(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


class _Server:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.append(conn)
            threading.Thread(target=self._guarded, args=(conn,), daemon=True).start()

    def _guarded(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close does not)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._thread.join(timeout=5)

    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BodyProxy(_Server):
    def __init__(self, upstream: str) -> None:
        u = urlparse(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.faults: list[Fault] = []
        self.requests: list[Seen] = []
        self.applied: list[Fault] = []
        super().__init__()

    def gets(self) -> list[Seen]:
        return [r for r in self.requests if r.method == "GET"]

    def _next_fault(self) -> Fault | None:
        with self._lock:
            return self.faults.pop(0) if self.faults else None

    def serve(self, conn: socket.socket) -> None:
        up = socket.create_connection(self.upstream)
        self.track(up)
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while True:
                head = _read_head(conn, cbuf)
                if head is None:
                    return
                request_line, headers = _parse(head)
                method, path = request_line.split(" ")[:2]
                body = _read_exact(conn, cbuf, int(headers.get("content-length", 0)))
                self.requests.append(Seen(method, path, headers))
                up.sendall(head + body)
                rhead = _read_head(up, ubuf)
                if rhead is None:
                    return
                status_line, rheaders = _parse(rhead)
                status = int(status_line.split(" ")[1])
                if method == "HEAD" or status in (204, 304) or status < 200:
                    rbody = b""
                elif "content-length" in rheaders:
                    rbody = _read_exact(up, ubuf, int(rheaders["content-length"]))
                elif rheaders.get("transfer-encoding", "").lower() == "chunked":
                    rbody = _read_chunked(up, ubuf)
                else:
                    conn.sendall(rhead)
                    while data := up.recv(65536):
                        conn.sendall(data)
                    return
                fault = None
                if method == "GET" and 200 <= status < 300 and rbody:
                    fault = self._next_fault()
                if fault is None:
                    conn.sendall(rhead + rbody)
                    continue
                self.applied.append(fault)
                if fault.before is not None:
                    fault.before()
                if not self._apply(fault, conn, rhead, rbody):
                    return
        finally:
            up.close()

    def _apply(self, fault: Fault, conn: socket.socket, rhead: bytes, rbody: bytes) -> bool:
        """Send the faulty response; False when the connection is over."""
        at = min(fault.at, len(rbody) - 1)
        if fault.kind == "headers":
            extra = "".join(f"{k}: {v}\r\n" for k, v in fault.headers.items()).encode()
            conn.sendall(rhead[:-2] + extra + b"\r\n" + rbody)
            return True
        if fault.kind == "flip":
            body = bytearray(rbody)
            body[at] ^= 0x10
            conn.sendall(rhead + body)
            return True
        conn.sendall(rhead + rbody[:at])
        if fault.kind == "fin":
            conn.shutdown(socket.SHUT_WR)
        elif fault.kind == "rst":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif fault.kind == "stall":
            self._stopped.wait(60)  # the client's read timeout ends it first
        else:
            raise ValueError(fault.kind)
        return False


class HangingServer(_Server):
    """Reads each request, never answers (until stopped)."""

    def __init__(self) -> None:
        self.requests = 0
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        if _read_head(conn, buf) is not None:
            self.requests += 1
        self._stopped.wait(120)
