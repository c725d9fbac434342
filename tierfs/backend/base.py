"""The object-store interface the core is written against.

Backends are synchronous and blocking (boto3 is); the core only calls them through
tierfs.backend.runner.AsyncBackend, which runs them in worker threads behind limiters and
counts every request in the metrics. A backend raises only tierfs.errors types: whatever
its client library raises (boto3, botocore, urllib3, socket, ssl, exception groups of
those) is mapped at this boundary, so the core never meets a foreign exception.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Callable, Protocol


@dataclass(frozen=True)
class ObjectMeta:
    key: str
    size: int
    etag: str  # without quotes; identifies one version of the object's bytes
    mtime: float  # seconds since the epoch
    # user metadata (x-amz-meta-*), known only from HEAD or our own writes
    metadata: dict[str, str] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MultipartUpload:
    """An unfinished multipart upload, as ListMultipartUploads shows it."""

    upload_id: str
    initiated: float  # seconds since the epoch, by the object store's clock


@dataclass(frozen=True)
class ListPage:
    objects: list[ObjectMeta]
    prefixes: list[str]  # common prefixes, each ending with the delimiter
    next_token: str | None  # None on the last page


def _ignore(*_: object) -> None:
    return None


@dataclass
class BackendEvents:
    """What a backend reports for the metrics, which the runner owns: AsyncBackend sets
    these callbacks on the backend it runs. Called from worker threads."""

    # a GET body cut short was continued from the bytes received
    resumed: Callable[[], None] = _ignore
    # a body failed an integrity check (its label: tierfs/integrity.py) and is refetched
    integrity_failure: Callable[[str], None] = _ignore


class Backend(Protocol):
    name: str  # "s3" or "file": for logs only
    # optional: `events: BackendEvents`, which AsyncBackend then wires to the metrics

    def check(self) -> None:
        """Fail with NoSuchBucket / AccessDenied / BackendUnavailable if unusable."""

    def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
             max_keys: int = 1000) -> ListPage: ...

    def head(self, key: str) -> ObjectMeta: ...

    def get(self, key: str, start: int, length: int, etag: str | None, *,
            size: int | None = None) -> bytes | bytearray:
        """Bytes [start, start+length) (fewer only at the end of the object), verified
        wherever the store gives a way (tierfs/integrity.py): IntegrityError otherwise.

        With etag set, raises PreconditionFailed if the object's ETag differs. `size`, the
        object's size when the caller knows it, lets a GET of the whole object go without
        a Range header, which is when S3 sends the object's checksums.
        """

    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None, *,
                 size: int | None = None, metadata: dict[str, str] | None = None) -> int:
        """Like get of len(buf) bytes, read into buf; returns how many (fewer only at the
        end of the object). For callers that have a buffer the bytes belong in already.
        On an error buf holds unverified bytes: the caller must drop it. `metadata`: user
        metadata the object must carry, else PreconditionFailed (as for `etag`)."""

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta: ...

    def put_new(self, key: str, data: bytes,
                metadata: dict[str, str] | None = None) -> ObjectMeta:
        """put only if no object has the key (S3: If-None-Match: *), atomically against
        every other writer: Exists if one has; Unsupported if the store refuses
        conditional writes. A store that ignores the condition overwrites silently:
        tierfs/files/exclusive.py probes for that at mount."""

    def copy(self, src: str, dst: str, src_etag: str | None,
             metadata: dict[str, str] | None = None) -> str:
        """Server-side copy, returning the new ETag; metadata=None keeps the source's."""

    def delete(self, key: str) -> None: ...

    # multipart upload: parts are numbered from 1; all but the last are >= 5 MiB
    def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str: ...

    def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str: ...

    def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                         start: int, length: int) -> str: ...

    def mpu_complete(self, key: str, upload_id: str,
                     parts: builtins.list[tuple[int, str]]) -> str:
        """Returns the new object's ETag."""

    def mpu_abort(self, key: str, upload_id: str) -> None: ...

    def mpu_list(self, key: str) -> builtins.list[MultipartUpload]:
        """The unfinished multipart uploads of exactly this key."""
