"""Exclusive create across nodes: O_CREAT|O_EXCL as a conditional PUT, and whether the
store honours one.

A node checks an exclusive create against its own view of the bucket (the kernel's
lookup), which another node may have changed since, or within this node's
--metadata-ttl. So an exclusive create also claims the key in the store: a PUT of the
empty object, carrying the file's metadata, with If-None-Match: *. The store lets exactly
one such PUT of a key succeed and answers the others 412, which is EEXIST from open().
The file's bytes are uploaded later as usual, over its own placeholder.

A store that refuses conditional writes (501) or ignores them (a second conditional PUT
of one key succeeds) cannot do this: `ConditionalWrites` probes for it once per mount, in
the background (a probe key PUT twice, then deleted), logs one WARNING if so, and
exclusive creates then fall back to this node's own check (docs/semantics.md, "Exclusive
create (O_EXCL) across nodes").

A claim whose answer was lost (the store wrote it, the answer timed out, botocore sent it
again and the repeat got 412) must not pass for another client's object: each claim
carries a random token in its metadata, and a 412 is checked with one HEAD.
"""

from __future__ import annotations

import logging
import uuid

import trio

from ..backend.base import ObjectMeta
from ..backend.runner import AsyncBackend
from ..errors import AccessDenied, Exists, TierfsError, Unsupported

log = logging.getLogger(__name__)

PROBE_NAME = ".tierfs-probe-"  # + a random hex: the probe's key, under the mount's prefix
CLAIM_META = "tierfs-claim"  # the claim's token, in the placeholder's metadata
RETRY_MIN_S, RETRY_MAX_S = 1.0, 60.0  # the mount's probe, while the store does not answer


class Taken(Exists):
    """An exclusive create lost: another client has the key. `found`: its object, from
    the HEAD that told it apart from our own lost answer (None if that HEAD failed)."""

    def __init__(self, message: str, found: ObjectMeta | None) -> None:
        super().__init__(message)
        self.found = found


class ConditionalWrites:
    def __init__(self, backend: AsyncBackend, root_prefix: str) -> None:
        self.backend = backend
        self.root_prefix = root_prefix
        self.supported: bool | None = None  # None: not probed yet
        self.reason = ""  # why not, for the log
        self._lock = trio.Lock()  # one probe at a time; creates wait for its answer

    async def run(self) -> None:
        """The mount's probe, in the background (the mount does not wait for it), again
        with backoff while the store does not answer; then nothing. An exclusive create
        before the answer probes itself (`known`)."""
        delay = RETRY_MIN_S
        while self.supported is None:
            try:
                await self.known()
            except AccessDenied as exc:
                log.warning("cannot probe the object store for conditional writes: %s", exc)
                break  # a create would be refused the same: it probes again itself
            except TierfsError as exc:
                log.info("conditional writes not probed yet (%s); again in %.0f s", exc, delay)
                await trio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        await trio.sleep_forever()

    async def known(self) -> bool:
        """Whether the store honours If-None-Match: * on PUT, probing first if that is not
        known yet. Raises what the probe met when the store did not answer."""
        async with self._lock:
            if self.supported is None:
                self.supported = await self._probe()
                self._report()
            return self.supported

    async def _probe(self) -> bool:
        sync = self.backend.sync
        if not callable(getattr(sync, "put_new", None)):
            self.reason = "has no conditional PUT in this backend"  # a test's stand-in
            return False
        if getattr(sync, "exclusive_by_design", False):
            return True  # a local directory: link(2) is exclusive, nothing to ask
        key = f"{self.root_prefix}{PROBE_NAME}{uuid.uuid4().hex}"
        try:
            await self.backend.put_new(key, b"")
        except Unsupported as exc:
            self.reason = f"refuses conditional writes (If-None-Match: * on PUT; {exc})"
            return False
        except Exists:  # a random key: our own PUT, sent again after its answer was lost
            await self._delete_probe(key)
            return True
        try:
            try:
                await self.backend.put_new(key, b"")
            except Exists:
                return True
            except Unsupported as exc:
                self.reason = f"refuses conditional writes (If-None-Match: * on PUT; {exc})"
                return False
            self.reason = ("ignores conditional writes (a second PUT of one key with "
                           "If-None-Match: * succeeded)")
            return False
        finally:
            await self._delete_probe(key)

    async def _delete_probe(self, key: str) -> None:
        try:
            await self.backend.delete(key)
        except TierfsError as exc:  # an empty object left behind: say where
            log.warning("the conditional-write probe %r was not deleted: %s", key, exc)

    def _report(self) -> None:
        if self.supported:
            log.info("the object store honours conditional writes: O_CREAT|O_EXCL is "
                     "exclusive across nodes")
        else:
            log.warning("the object store %s: O_CREAT|O_EXCL is exclusive on this node only, "
                        "another node can create the same name at the same time "
                        "(docs/semantics.md, \"Exclusive create (O_EXCL) across nodes\")",
                        self.reason)

    async def claim(self, key: str, metadata: dict[str, str]) -> ObjectMeta | None:
        """Take `key` for a new file: its empty object with `metadata`, PUT only if the key
        is free. None when the store cannot do that (the create goes on as a local one);
        Taken when another client has the key."""
        if not await self.known():
            return None
        token = uuid.uuid4().hex
        try:
            return await self.backend.put_new(key, b"", {**metadata, CLAIM_META: token})
        except Unsupported as exc:  # it did before: a proxy or an upgrade in between
            self.supported = False
            self.reason = f"now refuses conditional writes (If-None-Match: * on PUT; {exc})"
            self._report()
            return None
        except Exists:
            pass
        try:
            found: ObjectMeta | None = await self.backend.head(key)
        except TierfsError as exc:
            log.debug("create %r: 412, and the HEAD after it failed: %s", key, exc)
            found = None
        if found is not None and (found.metadata or {}).get(CLAIM_META) == token:
            log.info("create %r: the store took our claim and its answer was lost", key)
            return found
        raise Taken(f"create {key!r}: another client has created it", found)
