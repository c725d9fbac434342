"""Object-store backends: the Backend protocol, S3 and local-directory implementations."""

from __future__ import annotations

from ..config import MountConfig
from .base import Backend, ListPage, ObjectMeta

__all__ = ["Backend", "ListPage", "ObjectMeta", "open_backend"]


def open_backend(cfg: MountConfig) -> Backend:
    if cfg.source.scheme == "file":
        from .file import FileBackend

        return FileBackend(cfg.source.bucket)
    from .s3 import S3Backend

    return S3Backend(cfg.source.bucket, endpoint_url=cfg.endpoint_url, region=cfg.region,
                     # every thread of both lanes (readers, warm) may hold a connection
                     max_connections=cfg.backend_concurrency + cfg.warm_concurrency + 4,
                     timeout_s=cfg.backend_timeout, max_attempts=cfg.backend_retries)
