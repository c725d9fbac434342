"""What this node answers when a peer asks it for a chunk it owns (docs/peers.md).

The owner serves from its memory or disk tier, or fetches the chunk from the store once
(the fetcher's singleflight: however many peers ask, one GET) and keeps it, so the next
asker is served from memory. It serves only what it could serve its own readers:

- chunks of the bucket it mounts (404 otherwise), with its own chunk size (400);
- chunk keys are made from (bucket, key, ETag), so a chunk is bytes of that version; a
  request for a version this node knows to be replaced (its index has another ETag for
  the key) is refused (409), and the store's If-Match refuses a version that changed
  there (412) — the asker goes to the store, which tells it what changed;
- never unsaved writes: those live in write-back staging files, not in the chunk cache,
  until their upload made them an object version.
"""

from __future__ import annotations

from .cache import ObjectVersion
from .errors import PreconditionFailed, TierfsError
from .fetch import Fetcher
from .namespace import Namespace
from .peers.wire import ChunkReply, ChunkRequest, PeerRefused, block_crcs


class PeerServe:
    def __init__(self, ns: Namespace, fetcher: Fetcher, *, bucket: str, block_size: int) -> None:
        self.ns = ns
        self.fetcher = fetcher
        self.bucket = bucket
        self.block_size = block_size

    async def __call__(self, req: ChunkRequest) -> ChunkReply:
        if req.bucket != self.bucket:
            raise PeerRefused(404, "bucket not mounted here")
        if req.chunk_size != self.fetcher.chunk_size:
            raise PeerRefused(400, "chunk size differs")
        if not 0 <= req.index * req.chunk_size < max(req.size, 1):
            raise PeerRefused(400, "chunk index past the object's end")
        node = self.ns.known(req.key)
        if node is not None and not node.is_dir and node.etag and node.etag != req.etag:
            raise PeerRefused(409, "this node knows another version")
        obj = ObjectVersion(req.bucket, req.key, req.etag, req.size)
        try:
            data = await self.fetcher.for_peer(obj, req.index)
        except PreconditionFailed:
            raise PeerRefused(412, "the object changed in the store") from None
        except TierfsError:
            # the asker has its own way to the store and its own view of its health
            raise PeerRefused(503, "cannot fetch it from the store now") from None
        return ChunkReply(data, block_crcs(data, self.block_size), self.block_size)
