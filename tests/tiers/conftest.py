"""Fixtures of the object-store tier tests (docs/tiers.md): two real Ceph RGWs, the
session's as the source (the "cloud bucket") and one of these tests' own as the near store.

  near_rgw  (session) the second RGW
  near      (function) a fresh bucket on it, and what a mount needs to use it:
            near.args (the --tier options), near.env(mount_env) (the mount's environment
            with an AWS credentials file whose profile `near` holds the near RGW's keys:
            the source keeps its own, from the environment), near.s3 (a boto3 client)
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest

from rgw import delete_bucket, start_rgw


@pytest.fixture(scope="session")
def near_rgw():
    server = start_rgw(memstore_bytes=1 << 30)
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Near:
    bucket: str
    prefix: str
    endpoint: str
    s3: object
    credentials: str  # a credentials file with the profile `near`

    @property
    def args(self) -> list[str]:
        return ["--tier", f"s3://{self.bucket}/{self.prefix}", "--tier-endpoint-url",
                self.endpoint, "--tier-profile", "near"]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**base, "AWS_SHARED_CREDENTIALS_FILE": self.credentials}

    def key(self, source_key: str) -> str:
        return self.prefix + source_key


@pytest.fixture
def near(near_rgw, tmp_path):
    if not near_rgw.answers():
        near_rgw.restart()
    s3 = near_rgw.client()
    name = f"near-{uuid.uuid4().hex[:20]}"
    s3.create_bucket(Bucket=name)
    creds = tmp_path / "aws-credentials"
    creds.write_text(f"[near]\naws_access_key_id = {near_rgw.access_key}\n"
                     f"aws_secret_access_key = {near_rgw.secret_key}\n")
    os.chmod(creds, 0o600)
    try:
        yield Near(name, "copies/", near_rgw.endpoint, s3, str(creds))
    finally:
        delete_bucket(s3, name)
