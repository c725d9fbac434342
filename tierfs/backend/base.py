"""The object-store interface the core is written against.

Backends are synchronous and blocking (boto3 is); the core only calls them through
tierfs.backend.runner.AsyncBackend, which runs them in worker threads behind limiters and
counts every request in the metrics. A backend raises only tierfs.errors types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str  # without quotes; identifies one version of the object's bytes
    mtime: float  # seconds since the epoch


@dataclass(frozen=True)
class ListPage:
    objects: list[ObjectMeta]
    prefixes: list[str]  # common prefixes, each ending with the delimiter
    next_token: str | None  # None on the last page


class Backend(Protocol):
    name: str  # "s3" or "file": for logs only

    def check(self) -> None:
        """Fail with NoSuchBucket / AccessDenied / BackendUnavailable if unusable."""

    def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
             max_keys: int = 1000) -> ListPage: ...

    def head(self, key: str) -> ObjectMeta: ...

    def get(self, key: str, start: int, length: int, etag: str | None) -> bytes:
        """Bytes [start, start+length) (fewer only at the end of the object).

        With etag set, raises PreconditionFailed if the object's ETag differs.
        """

    def put(self, key: str, data: bytes) -> ObjectMeta: ...

    def delete(self, key: str) -> None: ...
