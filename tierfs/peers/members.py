"""Who the peers are, and which one owns a chunk (docs/peers.md).

Membership comes from systems that already know the nodes, never from a consensus of our
own. A source is one of:

- `file:PATH`: one `HOST:PORT` per line (`[IPv6]:PORT` too), `#` comments, blank lines.
  Polled every 2 s and read again when its mtime, size or inode changes. A bad file at
  start is a one-line error naming the line; later, a missing, unreadable or bad file
  keeps the last good list and logs one WARNING until it is good again.
- `dns:NAME:PORT`: every A/AAAA address of NAME, resolved again every 30 s. A Kubernetes
  headless Service answers one address per ready pod, so the peers of a DaemonSet are its
  pods. A name that does not resolve (yet: a headless Service has no address before its
  first pod runs) is an empty list and one WARNING, not a refused mount.
- `slurm`: the nodes Slurm knows, read again every 60 s, each at this node's advertised
  port. Inside a job (the daemon's environment has `SLURM_JOB_NODELIST`, e.g. a mount
  started by the job's own `srun`) the peers are the job's nodes (`scontrol show hostnames
  NODELIST`): a job's mounts share with each other only. Otherwise (a node-wide daemon
  started by systemd, which is how docs/slurm.md runs tierfs) the peers are the cluster's
  responding nodes (`sinfo -h -N -r -o %N`): a job's nodes are not known to a daemon that
  outlives jobs, and a node that runs no tierfs only costs a refused connection and a
  `down_s` pause. Peers are reached by Slurm node name, which must resolve. A command
  that is missing is a one-line error at start; one that fails or times out keeps the
  last good list with one WARNING.

This node (`me`, its advertised address) is never its own peer. An entry is this node
when it equals `me`, or when its host is this machine's hostname (short or full) and its
port is `me`'s: a shared list names nodes by hostname while a node may advertise an IP.
The entry's name is then the one hashed for this node, so every node computes the same
owner for a chunk.

The owner of a chunk is chosen by rendezvous hashing: the highest
`blake2b(name + b"\\0" + ckey, digest_size=8)` over the live peers and this node. Removing
a peer moves only the chunks it owned; adding one moves only the chunks it now owns. A
peer marked down (`mark_down`, after a failed fetch) leaves `live()` for `down_s` and is
tried again after. Nodes may disagree on the list for a while (one reloaded, the other
not yet): that costs a fetch from the store, never a wrong byte, as every reply is
verified against the reader's own version of the object.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
import socket
import stat
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import trio

from ..errors import UsageError

log = logging.getLogger(__name__)

FILE_POLL_S = 2.0
DNS_EVERY_S = 30.0
SLURM_EVERY_S = 60.0
COMMAND_TIMEOUT_S = 10.0
MAX_PEERS = 4096  # a bigger list is a mistake (or not ours to hash per chunk miss)
MAX_FILE_BYTES = 1 << 20

_HOSTNAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})", re.ASCII)


class SourceError(Exception):
    """A source could not give a list; the message is one line for the log or the user."""


@dataclass(frozen=True, order=True)
class Peer:
    host: str  # a hostname, an IPv4 address or an IPv6 address (without brackets)
    port: int

    @property
    def name(self) -> str:
        """`host:port` (`[v6]:port`): the identity hashed for rendezvous, as others see it."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> "Peer":
        """`HOST:PORT` or `[V6]:PORT`; ValueError with the reason otherwise."""
        text = text.strip()
        host, sep, port = text.rpartition(":")
        if not sep or not re.fullmatch(r"\d{1,5}", port, re.ASCII) or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT, got {text[:80]!r}")
        if host.startswith("[") and host.endswith("]"):
            try:
                host = str(ipaddress.IPv6Address(host[1:-1]))
            except ValueError:
                raise ValueError(f"not an IPv6 address: {host[:80]!r}") from None
        elif not _HOSTNAME_RE.fullmatch(host) or ".." in host:
            raise ValueError(f"expected HOST:PORT, got {text[:80]!r}")
        return cls(host, int(port))


def parse_peers_text(text: str, where: str) -> list[Peer]:
    """The peers of a peers file's text, in order, duplicates dropped; SourceError naming
    the first bad line."""
    peers: dict[Peer, None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            peers[Peer.parse(line)] = None
        except ValueError as exc:
            raise SourceError(f"{where} line {n}: {exc}") from None
        if len(peers) > MAX_PEERS:
            raise SourceError(f"{where}: more than {MAX_PEERS} peers")
    return list(peers)


def parse_hostnames(text: str) -> list[str]:
    """The output of `scontrol show hostnames` / `sinfo -h -N -o %N`: one name a line
    (sinfo repeats a node once per partition)."""
    names: dict[str, None] = {}
    for line in text.splitlines():
        name = line.strip()
        if not name:
            continue
        if not _HOSTNAME_RE.fullmatch(name):
            raise SourceError(f"unexpected node name {name[:80]!r} from Slurm")
        names[name] = None
    if len(names) > MAX_PEERS:
        raise SourceError(f"more than {MAX_PEERS} nodes from Slurm")
    return list(names)


# ---- sources -------------------------------------------------------------------------------


class _FileSource:
    every_s = FILE_POLL_S

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None

    def describe(self) -> str:
        return f"peers file {self.path}"

    def _stamp(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        try:
            return self._stamp() != self._seen
        except OSError:
            return True  # missing now: the reload says so (once)

    def read(self) -> list[Peer]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise SourceError(f"cannot read {self.describe()}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SourceError(f"{self.describe()} is not a regular file")
            data = os.read(fd, MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SourceError(f"cannot read {self.describe()}: {exc.strerror}") from None
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            raise SourceError(f"{self.describe()} is larger than {MAX_FILE_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError(f"{self.describe()} is not UTF-8 text") from None
        peers = parse_peers_text(text, self.describe())
        self._seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        return peers

    def first(self) -> list[Peer]:
        return self.read()

    async def again(self) -> list[Peer] | None:
        if not self.changed():
            return None
        return await trio.to_thread.run_sync(self.read)


class _DnsSource:
    every_s = DNS_EVERY_S

    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port

    def describe(self) -> str:
        return f"peers name {self.name}"

    def _peers(self, infos: list) -> list[Peer]:
        hosts: dict[str, None] = {}
        for family, _, _, _, sockaddr in infos:
            if family in (socket.AF_INET, socket.AF_INET6):
                hosts[sockaddr[0]] = None
        return [Peer(h, self.port) for h in list(hosts)[:MAX_PEERS]]

    def first(self) -> list[Peer]:
        try:
            infos = socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise SourceError(f"{self.describe()} does not resolve: {exc}") from None
        return self._peers(infos)

    async def again(self) -> list[Peer]:
        try:
            infos = await trio.socket.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise SourceError(f"{self.describe()} does not resolve: {exc}") from None
        return self._peers(infos)


class _SlurmSource:
    every_s = SLURM_EVERY_S

    def __init__(self, port: int, env: Mapping[str, str] | None = None) -> None:
        self.port = port
        env = os.environ if env is None else env
        nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
        if nodelist:
            self.argv = ["scontrol", "show", "hostnames", nodelist]
        else:
            self.argv = ["sinfo", "-h", "-N", "-r", "-o", "%N"]
        self.env = dict(env)

    def describe(self) -> str:
        return f"Slurm nodes (`{' '.join(self.argv)}`)"

    def _peers(self, returncode: int, out: bytes, err: bytes) -> list[Peer]:
        if returncode != 0:
            why = err.decode("utf-8", "replace").strip().splitlines()
            raise SourceError(f"{self.describe()} failed (exit {returncode})"
                              + (f": {why[-1][:200]}" if why else ""))
        try:
            names = parse_hostnames(out.decode("utf-8"))
        except UnicodeDecodeError:
            raise SourceError(f"{self.describe()}: output is not UTF-8") from None
        if not names:  # scontrol exits 0 on a host list it cannot expand, saying so on stderr
            why = err.decode("utf-8", "replace").strip().splitlines()
            raise SourceError(f"{self.describe()} listed no nodes"
                              + (f": {why[-1][:200]}" if why else ""))
        return [Peer(n, self.port) for n in names]

    def first(self) -> list[Peer]:
        try:
            r = subprocess.run(self.argv, capture_output=True, timeout=COMMAND_TIMEOUT_S,
                               env=self.env, stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            # not a transient failure: this node has no Slurm client
            raise UsageError(f"--peers slurm: {self.argv[0]} is not installed") from None
        except subprocess.TimeoutExpired:
            raise SourceError(f"{self.describe()} did not answer in "
                              f"{COMMAND_TIMEOUT_S:g} s") from None
        return self._peers(r.returncode, r.stdout, r.stderr)

    async def again(self) -> list[Peer]:
        with trio.move_on_after(COMMAND_TIMEOUT_S):
            try:
                r = await trio.run_process(self.argv, capture_stdout=True, capture_stderr=True,
                                           check=False, env=self.env,
                                           stdin=subprocess.DEVNULL)
            except OSError as exc:
                raise SourceError(f"{self.describe()}: {exc.strerror or exc}") from None
            return self._peers(r.returncode, r.stdout, r.stderr)
        raise SourceError(f"{self.describe()} did not answer in {COMMAND_TIMEOUT_S:g} s")


_Source = _FileSource | _DnsSource | _SlurmSource


def parse_spec(spec: str, port: int, *, env: dict[str, str] | None = None) -> _Source:
    """`file:PATH` | `dns:NAME:PORT` | `slurm` -> its source; UsageError otherwise.
    `port` is this node's advertised port (Slurm nodes are reached on it)."""
    if spec == "slurm":
        return _SlurmSource(port, env)
    kind, sep, rest = spec.partition(":")
    if sep and kind == "file":
        if not rest.startswith("/"):
            raise UsageError(f"invalid peers {spec[:80]!r}: expected file:/ABSOLUTE/PATH")
        return _FileSource(rest)
    if sep and kind == "dns":
        name, sep, port_text = rest.rpartition(":")
        if (sep and re.fullmatch(r"\d{1,5}", port_text, re.ASCII) and 0 < int(port_text) < 65536
                and _HOSTNAME_RE.fullmatch(name) and ".." not in name):
            return _DnsSource(name, int(port_text))
        raise UsageError(f"invalid peers {spec[:80]!r}: expected dns:NAME:PORT")
    raise UsageError(f"invalid peers {spec[:80]!r}: expected file:PATH, dns:NAME:PORT "
                     f"or slurm")


def _local_names() -> set[str]:
    name = socket.gethostname()
    names = {name, name.split(".", 1)[0]}
    try:
        names.add(socket.getfqdn(name))
    except OSError:
        pass
    return {n.lower() for n in names if n}


# ---- membership ----------------------------------------------------------------------------


class Membership:
    """The peer list of one source, this node excluded, with down marks.

    `clock` is monotonic seconds (time.monotonic unless injected): down marks are compared
    on it, from the trio thread or not."""

    def __init__(self, spec: str, me: Peer, *, down_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 env: dict[str, str] | None = None,
                 local_names: set[str] | None = None) -> None:
        self.spec = spec
        self.me = me
        self.down_s = down_s
        self.clock = clock
        self._source = parse_spec(spec, me.port, env=env)
        self._local = {n.lower() for n in local_names} if local_names is not None \
            else _local_names()
        self._peers: list[Peer] = []
        self._me_name = me.name
        self._down: dict[Peer, float] = {}  # peer -> clock time it is tried again
        self._failing = False  # a WARNING was logged for the current run of failures

    # -- loading

    def load(self) -> None:
        """The first load, at start (blocking). A peers file that cannot be read or has a
        bad line is a UsageError (one line); DNS and Slurm that do not answer yet leave the
        list empty with one WARNING (run() asks again)."""
        try:
            peers = self._source.first()
        except SourceError as exc:
            if isinstance(self._source, _FileSource):
                raise UsageError(str(exc)) from None
            self._warn(exc)
            return
        self._set(peers)

    async def reload(self) -> bool:
        """Ask the source again now; True if the list changed. A failure keeps the last
        good list and logs one WARNING (until a reload succeeds again)."""
        try:
            peers = await self._source.again()
        except SourceError as exc:
            self._warn(exc)
            return False
        if self._failing:
            log.info("%s: answering again", self._source.describe())
            self._failing = False
        if peers is None:  # a file that did not change
            return False
        return self._set(peers)

    async def run(self) -> None:
        """Reload forever: a peers file is polled every 2 s, DNS asked every 30 s, Slurm
        every 60 s."""
        while True:
            await trio.sleep(self._source.every_s)
            await self.reload()

    def _warn(self, exc: SourceError) -> None:
        if not self._failing:
            what = "keeping the last list" if self._peers else "no peers until it answers"
            log.warning("%s; %s (%d peers)", exc, what, len(self._peers))
            self._failing = True

    def _set(self, listed: list[Peer]) -> bool:
        me_name = self.me.name
        peers = []
        for p in listed:
            if p == self.me or (p.port == self.me.port and p.host.lower() in self._local):
                me_name = p.name  # the name the others hash for this node
            else:
                peers.append(p)
        peers.sort()
        self._me_name = me_name
        if peers == self._peers:
            return False
        old = set(self._peers)
        added = [p.name for p in peers if p not in old]
        removed = [p.name for p in self._peers if p not in set(peers)]
        self._peers = peers
        self._down = {p: t for p, t in self._down.items() if p in set(peers)}
        log.info("peers from %s: %d%s%s", self._source.describe(), len(peers),
                 f"; added {_few(added)}" if added else "",
                 f"; removed {_few(removed)}" if removed else "")
        return True

    # -- queries

    def all(self) -> list[Peer]:
        """Every listed peer but this node, up or down."""
        return list(self._peers)

    def live(self) -> list[Peer]:
        """The peers other than this node that are not marked down."""
        if not self._down:
            return list(self._peers)
        now = self.clock()
        for p in [p for p, until in self._down.items() if until <= now]:
            del self._down[p]  # its pause is over: try it again
        return [p for p in self._peers if p not in self._down]

    def mark_down(self, peer: Peer) -> None:
        """Leave `peer` out of live() (and of owner choices) for down_s."""
        if peer in self._peers:
            self._down[peer] = self.clock() + self.down_s

    def owner(self, ckey: bytes) -> Peer | None:
        """The live peer that owns chunk `ckey`, or None if this node does."""
        best = _score(self._me_name, ckey), self._me_name
        owner: Peer | None = None
        for p in self.live():
            s = _score(p.name, ckey), p.name
            if s > best:
                best, owner = s, p
        return owner


def _score(name: str, ckey: bytes) -> int:
    h = hashlib.blake2b(name.encode() + b"\0" + ckey, digest_size=8)
    return int.from_bytes(h.digest(), "big")


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
