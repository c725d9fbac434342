"""The one error taxonomy of tierfs.

Every error the core raises on purpose is a TierfsError carrying the errno the FUSE
adapter should answer with. Only tierfs.mount.fs turns these into pyfuse3.FUSEError; the CLI
turns UsageError / StartupError into one line on stderr. Anything else that escapes is
a bug: the adapter logs it with its traceback and answers EIO.
"""

from __future__ import annotations

import errno


class TierfsError(Exception):
    errno: int = errno.EIO


class UsageError(TierfsError):
    """Bad command line, option value or configuration: the user must fix the input."""

    errno = errno.EINVAL


class StartupError(TierfsError):
    """The mount cannot start (bucket missing, mount point busy, cache dir unwritable...)."""


class NotFound(TierfsError):
    errno = errno.ENOENT


class ReadOnly(TierfsError):
    errno = errno.EROFS


class NoSpace(TierfsError):
    """Unsaved writes would exceed the cache budget and nothing drained in time."""

    errno = errno.ENOSPC


class NotEmpty(TierfsError):
    errno = errno.ENOTEMPTY


class CrossDevice(TierfsError):
    """A rename too large to do object by object; mv falls back to copying."""

    errno = errno.EXDEV


class Exists(TierfsError):
    errno = errno.EEXIST


class InvalidArgument(TierfsError):
    errno = errno.EINVAL


class IsADirectory(TierfsError):
    errno = errno.EISDIR


class NotADirectory(TierfsError):
    errno = errno.ENOTDIR


class NameTooLong(TierfsError):
    """A name over 255 bytes, or a path whose key would pass S3's 1,024 bytes."""

    errno = errno.ENAMETOOLONG


class FileTooBig(TierfsError):
    """A size past S3's largest object (5 TiB)."""

    errno = errno.EFBIG


class BackendError(TierfsError):
    """The object store failed after botocore's own retries."""

    errno = errno.EIO


class BackendUnavailable(BackendError):
    """Endpoint unreachable or timing out."""


class AccessDenied(BackendError):
    errno = errno.EACCES


class NoSuchBucket(BackendError):
    errno = errno.ENOENT


class PreconditionFailed(BackendError):
    """If-Match failed: the object changed since its ETag was cached."""


class Unsupported(BackendError):
    """The store does not implement what the request asked (501 NotImplemented): a
    conditional PUT (If-None-Match: *) on a store without conditional writes."""


class IntegrityError(BackendError):
    """Bytes from the store failed a checksum (tierfs/integrity.py) on every try: never
    served, never cached. `check` names the check (a label of tierfs_integrity_failures)."""

    def __init__(self, message: str, *, check: str = "", offset: int = 0) -> None:
        super().__init__(message)
        self.check = check
        self.offset = offset


class StoreDown(TierfsError):
    """Refused without sending a request: the object store is known to be unreachable
    (tierfs/backend/health.py probes it until it answers). Not a BackendError: nothing was asked,
    so there is nothing new to log or count per request."""


class RecentFailure(TierfsError):
    """The same chunk failed a moment ago (tierfs/read/singleflight.py): the kernel's immediate
    re-asks of a failed read get EIO at once instead of waiting out the retries again."""


class StaleObject(TierfsError):
    """An open file's object was replaced after bytes of the old version were served."""

    errno = errno.ESTALE


class BaseChanged(StaleObject):
    """A file written here over an object's version (a partial write) cannot be saved as
    written: the store no longer has that version and this node does not hold all of its
    bytes, so the untouched parts cannot be copied nor sent (writeback/staging.py)."""


class CacheCorrupt(TierfsError):
    """A disk-tier chunk failed its checksum or is missing; the caller refetches it."""


class CacheUnwritable(TierfsError):
    """The disk tier cannot take a chunk (cache disk full or failing): `tierfs warm` says so."""


class EarlierWriteFailed(TierfsError):
    """fsync()/close() of a file whose last write() or truncate failed (ENOSPC, EIO): the
    file does not hold what the application meant, so it is not saved (NFS reports a
    failed write again at close the same way). Carries the errno of that failure."""

    def __init__(self, message: str, errno_: int) -> None:
        super().__init__(message)
        self.errno = errno_
