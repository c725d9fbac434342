"""Object-store backends: the Backend protocol, S3 and local-directory implementations."""

from __future__ import annotations

from ..config import MountConfig, Source
from .base import Backend, ListPage, ObjectMeta

__all__ = ["Backend", "ListPage", "ObjectMeta", "open_backend", "open_tier_backend"]


def open_backend(cfg: MountConfig) -> Backend:
    """The source's backend."""
    return _open(cfg, cfg.source, cfg.endpoint_url, cfg.region, None)


def open_tier_backend(cfg: MountConfig) -> Backend:
    """The near store's backend (--tier, docs/tiers.md), with its own endpoint, region and
    credentials profile, and the source's timeouts and retries."""
    assert cfg.tier is not None
    # a read asks the source once the near store has not answered in tier_timeout, so a
    # hanging near store costs a read seconds, not the source's minutes of retries
    return _open(cfg, cfg.tier, cfg.tier_endpoint_url, cfg.tier_region, cfg.tier_profile,
                 timeout_s=cfg.tier_timeout, max_attempts=NEAR_ATTEMPTS)


NEAR_ATTEMPTS = 2  # botocore attempts of a near store request


def _open(cfg: MountConfig, where: Source, endpoint_url: str | None, region: str | None,
          profile: str | None, *, timeout_s: float | None = None,
          max_attempts: int | None = None) -> Backend:
    if where.scheme == "file":
        from .file import FileBackend

        return FileBackend(where.bucket)
    from .s3 import S3Backend

    return S3Backend(where.bucket, endpoint_url=endpoint_url, region=region, profile=profile,
                     # every thread of both lanes (readers, warm) may hold a connection
                     max_connections=cfg.backend_concurrency + cfg.warm_concurrency + 4,
                     timeout_s=cfg.backend_timeout if timeout_s is None else timeout_s,
                     max_attempts=cfg.backend_retries if max_attempts is None else max_attempts)
