"""FuseOps' one error boundary (tierfs/mount/fs.py): a TierfsError answers its errno, also from
inside an ExceptionGroup; anything else is EIO, an internal error of that op, and one
traceback in the log (repeats of the same bug are one line each)."""

from __future__ import annotations

import errno
import logging

import pyfuse3
import pytest

from tierfs.config import MountConfig, Source
from tierfs.errors import NoSpace, NotFound
from tierfs.mount.fs import FuseOps
from tierfs.metrics import Metrics

from unitkit import sample


class Namespace:
    """Only what lookup touches: raises what the test sets."""

    def __init__(self) -> None:
        self.raise_: BaseException | None = None

    async def lookup(self, parent: int, name: bytes):
        raise self.raise_


@pytest.fixture
def ops(tmp_path):
    cfg = MountConfig(source=Source("file", str(tmp_path), ""), mountpoint=str(tmp_path / "m"),
                      cache_dir=str(tmp_path / "c"))
    return FuseOps(cfg, Namespace(), None, None, Metrics())  # type: ignore[arg-type]


async def answer(ops: FuseOps, exc: BaseException) -> int:
    ops.ns.raise_ = exc
    with pytest.raises(pyfuse3.FUSEError) as info:
        await ops.lookup(1, b"x")
    return info.value.errno


def sample_of(ops: FuseOps, name: str, labels: dict[str, str]) -> float:
    return sample(ops.metrics, name, labels)


async def test_tierfs_errors_answer_their_errno_also_inside_groups(ops, caplog):
    assert await answer(ops, NotFound("x")) == errno.ENOENT
    assert await answer(ops, ExceptionGroup("g", [ExceptionGroup("h", [NoSpace("full")])])) \
        == errno.ENOSPC
    assert await answer(ops, ExceptionGroup("g", [NotFound("a"), NotFound("b")])) == errno.ENOENT
    assert sample_of(ops, "tierfs_fuse_errors_total", {"op": "lookup", "errno": "ENOENT"}) == 2
    assert sample_of(ops, "tierfs_internal_errors_total", {"task": "lookup"}) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_bug_is_eio_counted_and_its_traceback_logged_once(ops, caplog):
    def bug() -> BaseException:
        try:
            raise RuntimeError("the same bug")  # one place: the same site every time
        except RuntimeError as exc:
            return exc

    for _ in range(3):
        assert await answer(ops, bug()) == errno.EIO
    # a group with a bug in it is a bug, even beside an expected error
    assert await answer(ops, ExceptionGroup("g", [NotFound("a"), ValueError("v")])) == errno.EIO
    assert sample_of(ops, "tierfs_internal_errors_total", {"task": "lookup"}) == 4
    assert sample_of(ops, "tierfs_fuse_errors_total", {"op": "lookup", "errno": "EIO"}) == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 4
    with_traceback = [r for r in errors if r.exc_info]
    assert len(with_traceback) == 2  # the RuntimeError's first time, the group's
    assert "again (2 times" in errors[1].getMessage()
    assert "again (3 times" in errors[2].getMessage()
