"""A fleet of real tierfs mounts over one RGW, for the peer-tier tests (tests/peers/).

    from cluster import Fleet, Checkpoint, restore
    ckpt = Checkpoint.upload(s3, bucket, "ckpt", files=4, size=128 * MiB)
    c = Fleet(mounts, 8)                                   # 8 mounts started at once
    results = restore(c.nodes, ckpt)                       # every node reads every file
    assert all(r.ok for r in results)                      # sha256 of each file checked
    assert c.store_bytes() <= 1.1 * ckpt.size              # from the daemons' metrics
    log = c.access_log.since_start()                       # from the RGW's HTTP access log

Each node is a `Mount` of the mount harness (`tests/mounting.py`'s `Mounts`, the `mounts`
fixture: it stops the daemons and prints their logs when the test failed) with its own
cache dir, mount point, metrics port and peer port (`free_port()`); all of them list the
same peers file (one `127.0.0.1:PORT` a line, every node's peer port, plus any
`extra_peers` such as an in-test fake peer) and share one secret file (mode 0600). `peers=False` mounts the same fleet without any peer option
(a plain fleet: what the store pays without the peer tier).

What left the store is counted twice, independently:
  - the daemons' own metrics (tierfs_backend_bytes_total, tierfs_backend_requests_total{op=
    "get"}), scraped per node; a node that was killed keeps the last value scraped before
    the kill (`Fleet.kill`), so after a kill prefer the access log;
  - the RGW's HTTP access log (tests/rgw.py: dir/log/client.rgw.gw.log), whose `beast:` lines
    give method, path, status and the body bytes sent: `AccessLog` counts the GETs of the
    test's bucket between a start mark and an end mark (a HEAD of a missing key sent by the
    test: once its line is logged every earlier request's line is too).

TIERFS_LONG=1 selects the issue's full sizes (a 512 MiB checkpoint, 10,000 small files);
without it the sizes keep tests/peers under a few minutes on 2 cores (`LONG`, `sizes()`).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from mounting import Mount, Mounts, free_port, sum_samples  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# the sizes with TIERFS_LONG=1 (a long run, as TIERFS_SOAK_SECONDS lengthens the soak)
LONG = os.environ.get("TIERFS_LONG", "") == "1"
HANG_S = 1800.0 if LONG else 600.0  # see restore()


@dataclass(frozen=True)
class Sizes:
    checkpoint: int      # bytes of the checkpoint, split evenly over `files`
    files: int
    small_files: int     # the RL fan-out's file count


def sizes() -> Sizes:
    if LONG:
        return Sizes(checkpoint=512 * MiB, files=4, small_files=10_000)
    return Sizes(checkpoint=128 * MiB, files=4, small_files=1_000)


# ------------------------------------------------------------------ data
def payload(seed: int | str, size: int) -> bytes:
    """Deterministic incompressible bytes, distinct per seed."""
    return random.Random(seed).randbytes(size)


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Obj:
    key: str
    size: int
    sha: str


@dataclass
class Checkpoint:
    """Objects uploaded to the bucket with boto3 (as another tool would write them); only
    their sizes and sha256 are kept, so a 512 MiB checkpoint costs no memory afterwards."""

    bucket: str
    prefix: str
    objects: list[Obj]

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @classmethod
    def upload(cls, s3, bucket: str, prefix: str, *, files: int, size: int, seed: str = "ckpt",
               threads: int = 4) -> "Checkpoint":
        per = size // files

        def put(i: int) -> Obj:
            key = f"{prefix}/shard-{i:02d}.pt"
            data = payload(f"{seed}-{i}", per)
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            return Obj(key, per, sha256(data))

        with ThreadPoolExecutor(threads) as ex:
            objects = list(ex.map(put, range(files)))
        return cls(bucket, prefix, objects)

    @classmethod
    def small_files(cls, s3, bucket: str, prefix: str, *, count: int, seed: str = "rl",
                    min_size: int = 4 * KiB, max_size: int = 64 * KiB, dirs: int = 8,
                    threads: int = 16) -> "Checkpoint":
        """`count` small objects (sandbox images, environment snapshots) over `dirs` dirs."""
        rnd = random.Random(seed)
        plan = [(f"{prefix}/d{i % dirs}/f{i:05d}.bin", rnd.randrange(min_size, max_size + 1))
                for i in range(count)]

        def put(item: tuple[str, int]) -> Obj:
            key, n = item
            data = payload(key, n)
            s3.put_object(Bucket=bucket, Key=key, Body=data)
            return Obj(key, n, sha256(data))

        with ThreadPoolExecutor(threads) as ex:
            objects = list(ex.map(put, plan))
        return cls(bucket, prefix, objects)


# ------------------------------------------------------------------ the RGW's access log
# 2026-..  1 beast: 0x..: 127.0.0.1 - test [03/Dec/2026:21:01:07.077 +0000]
#   "GET /bkt1/k HTTP/1.1" 206 1000 - "Boto3/..." bytes=0-999 latency=...
_BEAST = re.compile(r' beast: \S+: \S+ - \S+ \[[^\]]*\] "([A-Z]+) (\S+) HTTP/[\d.]+" '
                    r'(\d+) (\d+|-) ')


@dataclass
class StoreTraffic:
    gets: int = 0              # GETs of an object of the bucket (any status)
    get_bytes: int = 0         # body bytes those GETs sent
    by_key: dict[str, int] = field(default_factory=dict)   # GETs per key


class AccessLog:
    """GETs of one bucket that the RGW logged between `start()` and `since_start()`."""

    def __init__(self, rgw, s3, bucket: str) -> None:
        self.path = os.path.join(rgw.dir, "log", "client.rgw.gw.log")
        self.s3 = s3
        self.bucket = bucket
        self.pos = 0

    def start(self) -> None:
        self.pos = self._mark()

    def _mark(self) -> int:
        """Send a mark; return the offset just after its log line."""
        from botocore.exceptions import ClientError

        key = f"tierfs-test-mark-{uuid.uuid4().hex}"
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
        except ClientError:
            pass
        needle = f'"HEAD /{self.bucket}/{key} HTTP'.encode()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
            i = data.find(needle)
            if i >= 0:
                end = data.find(b"\n", i)
                return self.pos + (len(data) if end < 0 else end + 1)
            time.sleep(0.05)
        raise AssertionError(f"mark {key} never reached {self.path}")

    def since_start(self) -> StoreTraffic:
        start = self.pos
        end = self._mark()
        with open(self.path, "rb") as f:
            f.seek(start)
            text = f.read(end - start).decode(errors="replace")
        out = StoreTraffic()
        prefix = f"/{self.bucket}/"
        for line in text.splitlines():
            m = _BEAST.search(line)
            if not m or m.group(1) != "GET":
                continue
            path = m.group(2).partition("?")[0]
            if not path.startswith(prefix) or len(path) == len(prefix):
                continue  # a listing (GET /bucket?list-type=2...) is not an object GET
            out.gets += 1
            out.get_bytes += 0 if m.group(4) == "-" else int(m.group(4))
            key = path[len(prefix):]
            out.by_key[key] = out.by_key.get(key, 0) + 1
        return out


# ------------------------------------------------------------------ the fleet
def write_secret(path: Path, secret: bytes | None = None) -> bytes:
    """A shared secret file, mode 0600 from its creation (never readable by others)."""
    secret = secret if secret is not None else secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret + b"\n")
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
    return secret


@dataclass
class Node:
    index: int
    mount: Mount
    peer_port: int
    killed: bool = False
    last: dict = field(default_factory=dict)   # metrics scraped just before a kill

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.peer_port}"

    @property
    def path(self) -> Path:
        return self.mount.path

    def metrics(self) -> dict:
        return self.last if self.killed else self.mount.metrics()

    def counter(self, name: str, **labels) -> float:
        return sum_samples(self.metrics(), name, **labels)


class Fleet:
    """N tierfs mounts of one bucket, each listing the others as peers, started at once by
    the mount harness (mounting.Mounts: it stops them and prints their logs). The fleet
    keeps the peer setup (peers file, secret) and the counting over its nodes.

    name          folder under the harness's root: NAME/mnt{i}, NAME/cache{i}, NAME/peers.txt
    bucket        default: the harness's
    extra_args    more `tierfs mount` arguments for every node (e.g. a short --metadata-ttl)
    peers         False: no peer option at all (a plain fleet)
    peer_args     peer options added with peers=True (default: a 2 s --peer-timeout as the
                  daemon's default would be; tests of deadlines pass a short one)
    extra_peers   more `HOST:PORT` lines for the peers file (fake peers run by the test)
    prefix        mount s3://BUCKET/PREFIX instead of the whole bucket
    """

    def __init__(self, mounts: Mounts, n: int, *, name: str = "fleet", bucket: str | None = None,
                 extra_args=(), peers: bool = True, peer_args=(), extra_peers=(),
                 secret: bytes | None = None, start: bool = True, prefix: str = "") -> None:
        self.mounts = mounts
        self.bucket = bucket = bucket or mounts.bucket
        self.root = mounts.root / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.peers = peers
        self.peers_file = self.root / "peers.txt"
        self.secret_file = self.root / "peer.secret"
        self.secret = write_secret(self.secret_file, secret)
        self.nodes: list[Node] = []
        for i in range(n):
            port = free_port()  # never one handed out before: peer and metrics ports differ
            args = [str(a) for a in extra_args]
            if peers:
                args += ["--peers", f"file:{self.peers_file}",
                         "--peer-listen", f"127.0.0.1:{port}",
                         "--peer-secret-file", str(self.secret_file), *map(str, peer_args)]
            m = mounts.mount(*args, mnt=f"{name}/mnt{i}", cache=f"{name}/cache{i}",
                             source=f"s3://{bucket}/{prefix}", timeout=60.0,
                             label=f"node {i} (127.0.0.1:{port})")
            self.nodes.append(Node(i, m, port))
        self.write_peers([n.addr for n in self.nodes] + list(extra_peers))
        self.access_log = AccessLog(mounts.rgw, mounts.rgw.client(), bucket)
        if start:
            self.start()

    def write_peers(self, addrs: list[str]) -> None:
        """(Re)write the peers file atomically (a rename, as a config manager would)."""
        tmp = self.peers_file.with_suffix(".tmp")
        tmp.write_text("".join(a + "\n" for a in addrs))
        os.replace(tmp, self.peers_file)

    def start(self) -> "Fleet":
        """Start every node at once; on any failure stop those that started."""
        self.mounts.start_all([n.mount for n in self.nodes])
        return self

    def stop(self) -> None:
        """Unmount every node (concurrently: each waits for its daemon)."""
        self.mounts.stop_all([n.mount for n in self.nodes])

    def remount(self, node: Node) -> Node:
        """Stop one node and mount its cache dir again (memory tier empty, disk tier kept)."""
        node.mount = self.mounts.remount(node.mount)
        return node

    def kill(self, node: Node) -> None:
        """SIGKILL the daemon by PID and detach its mount (`fusermount3 -u -z`); its last
        metrics are kept for the sums below."""
        try:
            node.last = node.mount.metrics()
        except OSError:
            node.last = {}
        node.killed = True
        node.mount.kill9()

    @property
    def live(self) -> list[Node]:
        return [n for n in self.nodes if not n.killed]

    # ---------------------------------------------------------------- counting
    def sum(self, name: str, nodes: list[Node] | None = None, **labels) -> float:
        return sum(n.counter(name, **labels) for n in (self.nodes if nodes is None else nodes))

    def store_bytes(self) -> float:
        return self.sum("tierfs_backend_bytes_total")

    def store_gets(self) -> float:
        return self.sum("tierfs_backend_requests_total", op="get")

    def peer_results(self, role: str = "client") -> dict[str, float]:
        out: dict[str, float] = {}
        for n in self.nodes:
            for (name, labels), v in n.metrics().items():
                lbl = dict(labels)
                if name == "tierfs_peer_requests_total" and lbl.get("role") == role:
                    out[lbl["result"]] = out.get(lbl["result"], 0) + v
        return out


# ------------------------------------------------------------------ reading
@dataclass
class ReadResult:
    node: int
    key: str
    sha: str | None = None          # of the bytes read (None: the read failed)
    error: str | None = None
    nbytes: int = 0


def read_sha(path: Path, *, piece: int = MiB, progress: Callable[[int], None] | None = None
             ) -> tuple[str, int]:
    """Sequential `piece`-sized reads to EOF (as torch.load of a shard does): sha256, bytes."""
    h = hashlib.sha256()
    buf = bytearray(piece)
    view = memoryview(buf)
    total = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            n = os.readv(fd, [buf])
            if n == 0:
                break
            h.update(view[:n])
            total += n
            if progress is not None:
                progress(n)
    finally:
        os.close(fd)
    return h.hexdigest(), total


def restore(nodes: list[Node], ckpt: Checkpoint, *, threads_per_node: int = 1,
            progress: Callable[[int], None] | None = None) -> list[ReadResult]:
    """Every node reads every object of `ckpt` at once: `threads_per_node` threads per node,
    each reading its share of the objects in order, whole and sequentially. Failures are
    returned (a killed node's reads fail), never raised."""
    jobs: list[tuple[Node, list[Obj]]] = []
    for node in nodes:
        for t in range(threads_per_node):
            jobs.append((node, ckpt.objects[t::threads_per_node]))

    def run(job: tuple[Node, list[Obj]]) -> list[ReadResult]:
        node, objs = job
        out = []
        for o in objs:
            try:
                digest, n = read_sha(node.path / o.key, progress=progress)
                out.append(ReadResult(node.index, o.key, digest, nbytes=n))
            except OSError as e:
                out.append(ReadResult(node.index, o.key, error=f"{type(e).__name__}: {e}"))
        return out

    # a guard against a hang, not a timing assertion: a read that never returns is a bug
    # the daemons' deadlines should make impossible; the fleet's teardown then unmounts
    # and the blocked reads fail
    ex = ThreadPoolExecutor(len(jobs))
    try:
        futures = [ex.submit(run, job) for job in jobs]
        return [r for f in futures for r in f.result(timeout=HANG_S)]
    except TimeoutError:
        raise AssertionError(f"reads still blocked after {HANG_S} s") from None
    finally:
        ex.shutdown(wait=False)


def wrong(results: list[ReadResult], ckpt: Checkpoint) -> list[str]:
    """Descriptions of the reads whose bytes differ from the source, or that failed."""
    want = {o.key: o.sha for o in ckpt.objects}
    return [f"node {r.node} {r.key}: {r.error or 'sha256 ' + (r.sha or '')[:12]}"
            f" != {want[r.key][:12]}" for r in results if r.sha != want[r.key]]


def drop_page_cache(path: Path) -> None:
    """Evict one file's pages from the kernel page cache, so the next read reaches tierfs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ peers run by the test
# A fake owner of chunks, listed in the peers file like any node. It knows the true bytes
# (`data`: key -> bytes) and answers as the test tells it (`Misbehave`).
BLOCK = 64 * KiB   # the daemons' checksum block (tierfs.mount.core.BLOCK_SIZE)


def flip_bit(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


@dataclass(frozen=True)
class Misbehave:
    """How a fake peer answers a chunk request.

    "crc_before_flip"  the CRCs of the true bytes in the (validly signed) header, one bit
                       of the body flipped: the reader's CRC of the body differs
    "crc_after_flip"   a bit flipped, then CRCs computed over the wrong bytes and signed:
                       a peer holding the secret that lies consistently
    "stale"            409: the owner knows another ETag for the key
    "honest"           the true bytes (a control: the fake is asked, and its bytes used)
    """

    kind: str
    bit: int = 12345


class FakePeer:
    """A real tierfs.peers.server.PeerServer (the shared secret, 127.0.0.1) in a thread of
    the test process, serving `data` the way `misbehave` says. `asked` lists every
    ChunkRequest its callback got."""

    def __init__(self, secret: bytes, data: dict[str, bytes], misbehave: Misbehave) -> None:
        self.secret = secret
        self.data = data
        self.misbehave = misbehave
        self.port = free_port()
        self.asked: list = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token = None
        self._scope = None
        self._thread: threading.Thread | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, req):
        from tierfs.peers.wire import ChunkReply, PeerRefused, block_crcs

        self.asked.append(req)
        if self.misbehave.kind == "stale":
            raise PeerRefused(409, "stale")
        whole = self.data[req.key]
        chunk = whole[req.index * req.chunk_size:req.index * req.chunk_size + req.length]
        if self.misbehave.kind == "honest":
            return ChunkReply(chunk, block_crcs(chunk, BLOCK), BLOCK)
        bit = self.misbehave.bit % (len(chunk) * 8)
        if self.misbehave.kind == "crc_before_flip":
            crcs = block_crcs(chunk, BLOCK)
            return ChunkReply(flip_bit(chunk, bit), crcs, BLOCK)
        if self.misbehave.kind == "crc_after_flip":
            bad = flip_bit(chunk, bit)
            return ChunkReply(bad, block_crcs(bad, BLOCK), BLOCK)
        raise AssertionError(f"unknown misbehaviour {self.misbehave.kind}")

    async def _main(self) -> None:
        import trio
        from tierfs.metrics import Metrics
        from tierfs.peers.server import PeerServer

        self._token = trio.lowlevel.current_trio_token()
        server = PeerServer(("127.0.0.1", self.port), self.secret, self._serve, Metrics())
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                self._ready.set()

    def _run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
        finally:
            self._ready.set()

    def start(self) -> "FakePeer":
        self._thread = threading.Thread(target=self._run, name=f"fakepeer-{self.port}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise AssertionError(f"fake peer on {self.addr} did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        import trio

        if self._thread is None:
            return
        if self._thread.is_alive() and self._scope is not None:
            try:
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)
        self._thread = None

    def __enter__(self) -> "FakePeer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class HangingPeer:
    """A peer that accepts connections and never answers (nor reads): a node that hangs."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._conns: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="hangingpeer", daemon=True)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            self.accepted += 1

    def __enter__(self) -> "HangingPeer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self._conns:
            c.close()
        self.sock.close()


class WrongEtagPeer:
    """A raw HTTP peer holding the secret that answers every request 200 with the true
    bytes but another version's ETag in x-tierfs-etag (signed for that ETag, CRCs right):
    a node whose cache holds another version of the key."""

    def __init__(self, secret: bytes, data: dict[str, bytes], other_etag: str) -> None:
        import socket

        self.secret = secret
        self.data = data
        self.other_etag = other_etag
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.asked = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list = []
        self._thread = threading.Thread(target=self._accept, name="wrongetag", daemon=True)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._conn, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _conn(self, conn) -> None:
        from tierfs.peers.wire import ChunkRequest, block_crcs, format_crcs, sign_reply

        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    more = conn.recv(65536)
                    if not more:
                        return
                    buf += more
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                target = lines[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in
                           (ln.partition(":") for ln in lines[1:])}
                req = ChunkRequest.parse(target)
                whole = self.data[req.key]
                chunk = whole[req.index * req.chunk_size:
                              req.index * req.chunk_size + req.length]
                crcs = block_crcs(chunk, BLOCK)
                sig = sign_reply(self.secret, headers.get("authorization", ""),
                                 self.other_etag, crcs, BLOCK, len(chunk))
                reply = (f"HTTP/1.1 200 OK\r\ncontent-length: {len(chunk)}\r\n"
                         f"x-tierfs-etag: {self.other_etag}\r\n"
                         f"x-tierfs-block-size: {BLOCK}\r\n"
                         f"x-tierfs-crc32c: {format_crcs(crcs)}\r\n"
                         f"x-tierfs-sig: {sig}\r\n\r\n").encode()
                self.asked += 1  # before sending: a reader may hang up after the head
                conn.sendall(reply + chunk)
        except OSError:
            return
        finally:
            conn.close()

    def __enter__(self) -> "WrongEtagPeer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for c in self._conns:
            try:
                c.shutdown(2)
            except OSError:
                pass
        for t in self._threads:
            t.join(10)
        self.sock.close()
