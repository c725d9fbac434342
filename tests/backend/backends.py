"""Backends under test for the contract suite (importable as `backends`).

"file" is a FileBackend on a tmp dir; "s3" an S3Backend on a fresh bucket of the real Ceph
RGW started by the session fixture `rgw` (tests/conftest.py). S3 credentials come only
from the environment, as in production: the test sets them with monkeypatch.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Callable

import pytest

from tierfs.backend.base import Backend
from tierfs.backend.file import FileBackend
from tierfs.backend.s3 import S3Backend


def use_rgw_credentials(monkeypatch: pytest.MonkeyPatch, rgw, **override: str) -> None:
    """Point boto3's default credential chain at the RGW test user (and nothing else)."""
    from rgw import s3_env  # tests/rgw.py, on sys.path through tests/conftest.py

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_env(rgw, base={}).items():
        monkeypatch.setenv(name, value)
    for name, value in override.items():
        monkeypatch.setenv(name, value)


def s3_backend(rgw, bucket: str, *, endpoint_url: str | None = None,
               max_attempts: int = 2, timeout_s: float = 10) -> S3Backend:
    return S3Backend(bucket, endpoint_url=endpoint_url or rgw.endpoint, region=rgw.region,
                     max_connections=8, timeout_s=timeout_s, max_attempts=max_attempts)


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then closed, just now)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@dataclass
class Store:
    kind: str  # "file" | "s3"
    backend: Backend
    missing: Callable[[], Backend]  # the same kind of backend, on a bucket that is not there
    bucket: str


def make_store(kind: str, request: pytest.FixtureRequest, tmp_path, monkeypatch) -> Store:
    if kind == "file":
        root = tmp_path / "bucket"
        root.mkdir()
        return Store("file", FileBackend(str(root)),
                     lambda: FileBackend(str(tmp_path / "no-such-dir")), str(root))
    rgw = request.getfixturevalue("rgw")
    bucket = request.getfixturevalue("bucket")
    use_rgw_credentials(monkeypatch, rgw)
    return Store("s3", s3_backend(rgw, bucket),
                 lambda: s3_backend(rgw, f"missing-{uuid.uuid4().hex[:16]}"), bucket)
