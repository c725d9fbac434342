"""Exclusive create (O_CREAT|O_EXCL) when the store cannot do conditional writes, or is
down: the fault proxy answers conditional PUTs 501, or refuses connections.
docs/semantics.md, "Exclusive create (O_EXCL) across nodes".
"""

from __future__ import annotations

import errno
import os
import time

import botocore.exceptions as bex
import fkit
import pytest

EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL


def _write_excl(path, data: bytes) -> None:
    fd = os.open(path, EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_the_proxy_refuses_only_conditional_puts(rgw, proxy, bucket, s3):
    c = fkit.ThroughProxy(rgw, proxy).client(retries={"mode": "standard",
                                                      "total_max_attempts": 1})
    proxy.inject("501", "PUT", header="If-None-Match")
    c.put_object(Bucket=bucket, Key="plain", Body=b"x")
    with pytest.raises(bex.ClientError) as ei:
        c.put_object(Bucket=bucket, Key="cond", Body=b"x", IfNoneMatch="*")
    assert ei.value.response["Error"]["Code"] == "NotImplemented"
    assert proxy.injected("501", op="PUT") == 1
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount") == 1


def test_a_store_without_conditional_writes_is_named_at_mount_and_excl_falls_back(
        mounts, proxy, s3, bucket):
    """One WARNING at start-up, from a probe that does not hold the mount up; O_EXCL then
    works as before (this node's own check), so two nodes can both win: documented."""
    proxy.inject("501", "PUT", header="If-None-Match")
    t0 = time.monotonic()
    a = mounts.start(cache="ca", mnt="ma")
    b = mounts.start(cache="cb", mnt="mb")
    fkit.eventually(lambda: "refuses conditional writes" in a.log_text(), timeout=30)
    warnings = [ln for ln in a.log_text().splitlines() if "conditional" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0], warnings
    assert "O_CREAT|O_EXCL is exclusive on this node only" in warnings[0]
    # the fallback: each node's exclusive create succeeds as a local create did, so a
    # node that saw the name missing (kept for the TTL) creates it over the other's
    assert not (b.path / "x.lock").exists()
    _write_excl(a.path / "x.lock", b"A")
    _write_excl(b.path / "x.lock", b"B")
    fkit.eventually(lambda: s3.get_object(Bucket=bucket, Key="x.lock")["Body"].read()
                    in (b"A", b"B"), timeout=30)
    # on one node the check still holds
    with pytest.raises(FileExistsError):
        os.open(a.path / "x.lock", EXCL, 0o644)
    assert proxy.injected("501") >= 2  # each mount's probe; no create asked again
    assert proxy.injected("501") <= 2
    print(f"two mounts with the probe in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("mode", [[], ["--writeback"]], ids=["default", "writeback"])
def test_exclusive_create_needs_the_store_even_with_writeback(mounts, proxy, mode):
    """O_EXCL asks the store at open, so with the store down it fails with EIO, in both
    modes; a plain create does not ask it (with --writeback it succeeds)."""
    m = mounts.start(*mode)
    fkit.eventually(lambda: "honours conditional writes" in m.log_text(), timeout=30)
    os.listdir(m.path)  # the root listed: the creates below need no lookup from the store
    proxy.down()
    with pytest.raises(OSError) as ei:
        os.open(m.path / "down.lock", EXCL, 0o644)
    assert ei.value.errno == errno.EIO
    if mode:
        fd = os.open(m.path / "plain.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        os.close(fd)
    proxy.up()
    fkit.eventually(lambda: _try_excl(m.path / "down.lock"), timeout=60)


def _try_excl(path) -> bool:
    try:
        fd = os.open(path, EXCL, 0o644)
    except OSError as e:
        if e.errno == errno.EIO:
            return False
        raise
    os.close(fd)
    return True
