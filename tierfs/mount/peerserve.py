"""What this node answers when a peer asks it for a chunk it owns (docs/peers.md).

The owner serves from its memory or disk tier, or fetches the chunk from the store once
(the read walk's singleflight, tierfs/read/walk.py: however many peers ask, one GET) and
keeps it, so the next asker is served from memory. It serves only what it could serve its
own readers:

- chunks of keys under the prefix it mounts, in the bucket it mounts, with its own chunk
  size (400). Everything else is one answer, 404 "refused", the same as for a key the store
  does not have: a peer holding the secret learns nothing of the bucket beyond this node's
  prefix (not even which keys exist there), and never makes it fetch or cache such a key;
- chunk keys are made from (bucket, key, ETag), so a chunk is bytes of that version; a
  request for a version this node knows to be replaced (its index has another ETag for
  the key) is refused (409), and the store's If-Match refuses a version that changed
  there (412) — the asker goes to the store, which tells it what changed;
- never unsaved writes: those live in write-back staging files, not in the chunk cache,
  until their upload made them an object version.
"""

from __future__ import annotations

from ..cache import ObjectVersion
from ..cache.tier import Want
from ..errors import NotFound, PreconditionFailed, TierfsError
from ..files.namespace import Namespace
from ..peers.wire import NOT_MINE, ChunkReply, ChunkRequest, PeerRefused, block_crcs
from ..read.walk import TierWalk


def _not_served() -> PeerRefused:
    # one status and one body for every key this node will not or cannot serve
    return PeerRefused(NOT_MINE, "not served here")


class PeerServe:
    def __init__(self, ns: Namespace, walk: TierWalk, *, bucket: str, block_size: int) -> None:
        self.ns = ns
        self.walk = walk
        self.bucket = bucket
        self.prefix = ns.root_prefix  # "" or "a/b/": what this node mounts
        self.block_size = block_size

    def serves(self, bucket: str, key: str) -> bool:
        """A key this node mounts: in its bucket, under its prefix, and one the mount can
        show as a path (no empty, `.` or `..` part: a store may read `p/../x` as `x`)."""
        if bucket != self.bucket or not key.startswith(self.prefix):
            return False
        rest = key[len(self.prefix):]
        return bool(rest) and all(part not in ("", ".", "..") for part in rest.split("/"))

    async def __call__(self, req: ChunkRequest) -> ChunkReply:
        if not self.serves(req.bucket, req.key):
            raise _not_served()
        if req.chunk_size != self.walk.chunk_size:
            raise PeerRefused(400, "chunk size differs")
        if not 0 <= req.index * req.chunk_size < max(req.size, 1):
            raise PeerRefused(400, "chunk index past the object's end")
        node = self.ns.known(req.key)
        if node is not None and not node.is_dir and node.etag and node.etag != req.etag:
            raise PeerRefused(409, "this node knows another version")
        obj = ObjectVersion(req.bucket, req.key, req.etag, req.size)
        try:
            # a peer's read is heat, as a reader's; the store only: never round in circles
            data = (await self.walk.read(Want(obj, req.index, access=True,
                                              ask_peers=False))).data
        except PreconditionFailed:
            raise PeerRefused(412, "the object changed in the store") from None
        except NotFound:  # as a key outside the prefix: no way to tell the two apart
            raise _not_served() from None
        except TierfsError:
            # the asker has its own way to the store and its own view of its health
            raise PeerRefused(503, "cannot fetch it from the store now") from None
        return ChunkReply(data, block_crcs(data, self.block_size), self.block_size)
