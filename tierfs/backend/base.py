"""The object-store interface the core is written against.

Backends are synchronous and blocking (boto3 is); the core only calls them through
tierfs.backend.runner.AsyncBackend, which runs them in worker threads behind limiters and
counts every request in the metrics. A backend raises only tierfs.errors types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str  # without quotes; identifies one version of the object's bytes
    mtime: float  # seconds since the epoch
    # user metadata (x-amz-meta-*), known only from HEAD or our own writes
    metadata: dict[str, str] | None = field(default=None, compare=False)


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

    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None) -> int:
        """Like get of len(buf) bytes, read into buf; returns how many (fewer only at the
        end of the object). For callers that have a buffer the bytes belong in already."""

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta: ...

    def copy(self, src: str, dst: str, src_etag: str | None,
             metadata: dict[str, str] | None = None) -> str:
        """Server-side copy, returning the new ETag; metadata=None keeps the source's."""

    def delete(self, key: str) -> None: ...

    # multipart upload: parts are numbered from 1; all but the last are >= 5 MiB
    def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str: ...

    def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str: ...

    def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                         start: int, length: int) -> str: ...

    def mpu_complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        """Returns the new object's ETag."""

    def mpu_abort(self, key: str, upload_id: str) -> None: ...

    def mpu_list(self, key: str) -> list[str]:
        """Ids of the unfinished multipart uploads of exactly this key."""
