"""The peer tier: chunks from other nodes' caches before the object store (docs/peers.md).

`PeerTier.fetch` is what the fetcher asks on a miss. The chunk's owner is chosen by
rendezvous hashing over the live peers and this node (`Membership.owner`); when this node
owns the chunk, or the owner cannot give it, the answer is None and the fetcher goes to
the store. Nothing here is ever a source of truth: a reply is used only if its signature,
ETag, length and every block's CRC32C check out (`PeerClient`), and whatever fails falls
back to the store within one deadline (`--peer-timeout`).

A peer that fails (no connection, wrong bytes) is marked down for a while, so readers
stop paying for it; one that does not answer in time is marked down after TIMEOUT_STRIKES
timeouts in a row: an owner that is slow because it is fetching from a slow store for the
whole fleet is not dead, and marking it down at once would send every node to the store
(a checkpoint restored on a loaded fleet takes several times as long from the store
alone). A peer that
refuses (it does not mount the bucket, knows another version, is overloaded) is healthy
and stays up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..metrics import Metrics
from .client import PeerClient
from .members import Membership, Peer
from .server import PeerServer
from .wire import (
    ChunkReply,
    ChunkRequest,
    PeerCorrupt,
    PeerError,
    PeerRefused,
    PeerTimeout,
    PeerUnavailable,
)

log = logging.getLogger(__name__)

__all__ = ["ChunkReply", "ChunkRequest", "Membership", "Peer", "PeerChunk", "PeerClient",
           "PeerServer", "PeerTier"]

# one log line per peer and kind of failure per minute: an outage of a peer is seen, a
# storm of reads through it does not flood the log
_LOG_EVERY_S = 60.0
TIMEOUT_STRIKES = 3  # timeouts in a row, with no answer between, before a peer is down


@dataclass(frozen=True)
class PeerChunk:
    """A verified chunk and the peer that gave it (to blame if the store refutes it)."""

    peer: Peer
    data: bytes | bytearray | memoryview


class PeerTier:
    def __init__(self, members: Membership, client: PeerClient, metrics: Metrics, *,
                 timeout_s: float) -> None:
        self.members = members
        self.client = client
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._logged: dict[tuple[Peer, str], float] = {}
        self._timeouts: dict[Peer, int] = {}  # timeouts in a row per peer (bounded by peers)

    def owner(self, ckey: bytes) -> Peer | None:
        """The live peer that owns a chunk, or None when this node does."""
        return self.members.owner(ckey)

    async def fetch(self, ckey: bytes, *, bucket: str, key: str, etag: str, size: int,
                    index: int, chunk_size: int) -> PeerChunk | None:
        """Chunk `index` of (bucket, key, etag) from its owner, verified; None when this
        node should ask the store."""
        peer = self.members.owner(ckey)
        if peer is None:
            return None
        try:
            req = ChunkRequest(bucket, key, etag, size, index, chunk_size)
            reply = await self.client.fetch(peer, req, timeout_s=self.timeout_s)
            self._timeouts.pop(peer, None)
            return PeerChunk(peer, reply.data)
        except PeerRefused as exc:
            # the owner answered: it is up, it just cannot give this chunk (404 not its
            # bucket, 409 it knows another ETag, 412 the store said changed, 503 busy)
            self._timeouts.pop(peer, None)
            self._log(peer, exc, logging.INFO)
        except PeerTimeout as exc:
            strikes = self._timeouts[peer] = self._timeouts.get(peer, 0) + 1
            if strikes >= TIMEOUT_STRIKES:
                self._timeouts.pop(peer)
                self.members.mark_down(peer)
            self._log(peer, exc, logging.WARNING)
        except (PeerUnavailable, PeerCorrupt) as exc:
            self.members.mark_down(peer)
            self._log(peer, exc, logging.WARNING)
        except PeerError as exc:  # the rest of the taxonomy: our own request was refused
            self._log(peer, exc, logging.WARNING)
        self.metrics.peers_up.set(len(self.members.live()))
        return None

    def refuted(self, peer: Peer, why: str) -> None:
        """A chunk `peer` signed turned out not to be the object's bytes (the store's checksum
        and the store's own bytes say otherwise): the peer holds the secret and lies, or its
        cache is damaged past its own checks. Counted as a corrupt reply, marked down."""
        self.metrics.peer_requests.labels(role="client", result=PeerCorrupt.result).inc()
        self.members.mark_down(peer)
        self.metrics.peers_up.set(len(self.members.live()))
        self._log(peer, PeerCorrupt(why), logging.WARNING)

    def status(self) -> dict:
        """For `tierfs status`: the membership and the requests by role and result."""
        live = set(self.members.live())
        m = self.metrics
        requests: dict[str, dict[str, float]] = {"client": {}, "server": {}}
        for metric in m.peer_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    requests[sample.labels["role"]][sample.labels["result"]] = sample.value
        return {"source": self.members.spec, "me": self.members.me.name,
                "up": sorted(p.name for p in live),
                "down": sorted(p.name for p in self.members.all() if p not in live),
                "requests": requests,
                "bytes": {d: m.value("tierfs_peer_bytes_total", direction=d)
                          for d in ("in", "out")}}

    def _log(self, peer: Peer, exc: PeerError, level: int) -> None:
        now = time.monotonic()
        what = (peer, exc.result)
        if now - self._logged.get(what, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[what] = now
            log.log(level, "peer %s: %s (%s); reading from the object store", peer.name,
                    exc.result, exc)
