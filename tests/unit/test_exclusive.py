"""Exclusive create's store side (tierfs/files/exclusive.py, Backend.put_new): the boto3 call
(botocore's Stubber: no network), the local-directory backend's link(2), the probe that
tells a store that honours, refuses or ignores If-None-Match: *, and a claim whose answer
was lost. The two-node races on real mounts: tests/writes/test_exclusive_create.py."""

from __future__ import annotations

import logging
import os

import pytest
from botocore.stub import ANY, Stubber

from tierfs.backend.file import FileBackend
from tierfs.backend.runner import AsyncBackend
from tierfs.backend.s3 import S3Backend
from tierfs.errors import BackendUnavailable, Exists, Unsupported
from tierfs.files.exclusive import CLAIM_META, ConditionalWrites, Taken
from tierfs.metrics import Metrics


@pytest.fixture(scope="module")
def s3b():
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(name, "test")
        return S3Backend("bucket", endpoint_url="http://127.0.0.1:9", region="us-east-1",
                         max_connections=2, timeout_s=1, max_attempts=1)


EXPECTED = {"Bucket": "bucket", "Key": "a/lock", "Body": b"", "IfNoneMatch": "*",
            "Metadata": {"tierfs-mode": "100644"}}


def test_put_new_is_a_put_with_if_none_match(s3b):
    with Stubber(s3b._s3) as stub:
        stub.add_response("put_object", {"ETag": '"d41d8cd98f00b204e9800998ecf8427e"'},
                          EXPECTED)
        meta = s3b.put_new("a/lock", b"", {"tierfs-mode": "100644"})
        stub.assert_no_pending_responses()
    assert (meta.key, meta.size, meta.etag) == ("a/lock", 0, "d41d8cd98f00b204e9800998ecf8427e")


@pytest.mark.parametrize("status,code,error", [(412, "PreconditionFailed", Exists),
                                               (501, "NotImplemented", Unsupported)])
def test_put_new_maps_412_to_exists_and_501_to_unsupported(s3b, status, code, error):
    with Stubber(s3b._s3) as stub:
        stub.add_client_error("put_object", code, "no", status, expected_params=EXPECTED)
        with pytest.raises(error) as ei:
            s3b.put_new("a/lock", b"", {"tierfs-mode": "100644"})
    assert "a/lock" in str(ei.value)


def test_put_new_sends_again_after_a_conditional_conflict(s3b):
    with Stubber(s3b._s3) as stub:
        stub.add_client_error("put_object", "ConditionalRequestConflict", "busy", 409,
                              expected_params={**EXPECTED, "Metadata": ANY})
        stub.add_response("put_object", {"ETag": '"e"'}, {**EXPECTED, "Metadata": ANY})
        assert s3b.put_new("a/lock", b"", {}).etag == "e"


def test_file_backend_put_new_is_exclusive(tmp_path):
    fb = FileBackend(str(tmp_path))
    meta = fb.put_new("d/x", b"first", {"tierfs-mode": "100600"})
    with pytest.raises(Exists):
        fb.put_new("d/x", b"second")
    assert (tmp_path / "d/x").read_bytes() == b"first"
    assert fb.head("d/x").metadata == {"tierfs-mode": "100600"}
    assert fb.head("d/x").etag == meta.etag
    assert os.listdir(tmp_path / ".tierfs-staging") == []  # no temporary left behind
    fb.put("d/x", b"overwrite")  # the content upload replaces its own placeholder
    assert (tmp_path / "d/x").read_bytes() == b"overwrite"


class Probed(FileBackend):
    """A store that honours If-None-Match, and is probed like S3 (not a local directory)."""

    exclusive_by_design = False


class Ignoring(Probed):
    """A store that ignores If-None-Match: a conditional PUT overwrites."""

    def put_new(self, key, data, metadata=None):
        return self.put(key, data, metadata)


class Refusing(Probed):
    def put_new(self, key, data, metadata=None):
        raise Unsupported(f"create {key!r}: not implemented by the store (NotImplemented)")


class Down(Probed):
    up = False

    def put_new(self, key, data, metadata=None):
        if not Down.up:
            raise BackendUnavailable(f"create {key!r}: endpoint unreachable (test)")
        return super().put_new(key, data, metadata)


def _writes(backend) -> ConditionalWrites:
    return ConditionalWrites(AsyncBackend(backend, Metrics(), concurrency=2, background=1),
                             "pre/")


@pytest.mark.parametrize("store,supported,says", [
    (Probed, True, "honours conditional writes"),
    (FileBackend, True, "honours conditional writes"),  # not probed: link(2) is exclusive
    (Ignoring, False, "ignores conditional writes"),
    (Refusing, False, "refuses conditional writes"),
])
async def test_the_probe_tells_honoured_ignored_and_refused(tmp_path, caplog, store, supported,
                                                            says):
    caplog.set_level(logging.INFO, logger="tierfs.files.exclusive")
    cw = _writes(store(str(tmp_path)))
    assert await cw.known() is supported
    assert await cw.known() is supported  # asked once
    lines = [r for r in caplog.records if r.name == "tierfs.files.exclusive"]
    assert len(lines) == 1 and says in lines[0].getMessage()
    assert lines[0].levelno == (logging.INFO if supported else logging.WARNING)
    assert not (tmp_path / "pre").exists() or os.listdir(tmp_path / "pre") == []  # deleted
    if not supported:  # the create goes on as a local one
        assert await cw.claim("pre/a", {}) is None
        assert not (tmp_path / "pre/a").exists()


async def test_a_store_down_leaves_it_unknown_and_the_create_fails(tmp_path):
    Down.up = False
    cw = _writes(Down(str(tmp_path)))
    with pytest.raises(BackendUnavailable):
        await cw.claim("pre/a", {})
    assert cw.supported is None
    Down.up = True
    assert await cw.claim("pre/a", {}) is not None
    assert cw.supported is True


async def test_claim_wins_once_and_tells_a_lost_answer_from_another_node(tmp_path):
    fb = FileBackend(str(tmp_path))
    cw = _writes(fb)
    mine = await cw.claim("pre/a", {"tierfs-mode": "100644"})
    assert mine is not None and fb.head("pre/a").metadata[CLAIM_META]
    with pytest.raises(Taken) as ei:
        await cw.claim("pre/a", {"tierfs-mode": "100644"})
    assert isinstance(ei.value, Exists) and ei.value.found.etag == mine.etag

    class LostAnswer(Probed):
        """The store wrote the claim, its answer was lost, the retry got 412."""

        def put_new(self, key, data, metadata=None):
            super().put_new(key, data, metadata)
            raise Exists(f"create {key!r}: an object has that key already")

    lost = _writes(LostAnswer(str(tmp_path)))
    got = await lost.claim("pre/b", {})
    assert got is not None and got.key == "pre/b"
