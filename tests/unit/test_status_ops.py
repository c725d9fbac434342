"""`tierfs status --json` counts every backend op (issue 15 item 7): a multipart upload is
mpu_create + upload_part + mpu_complete and never a put, so a status that counted only
get/list/head/put said "put: 0" after 124 uploaded parts. An in-process core writes a file
of three parts through FileIO and a real control socket answers the status."""

from __future__ import annotations

import os

import trio

from tierfs.cli import ctl
from tierfs.mount.control import ControlServer, prepare_socket_dir
from tierfs.index.inodes import ROOT_INO
from tierfs.runpaths import control_socket

from unitkit import core


def _registry_counts(metrics, name: str) -> dict[str, float]:
    """{op: value} of every sample the registry holds for a backend counter."""
    return {s.labels["op"]: s.value for family in metrics.registry.collect()
            for s in family.samples if s.name == name}


async def test_status_counts_the_parts_of_a_multipart_upload(tmp_path):
    chunk = 1 << 20
    async with core(str(tmp_path), chunk_size=chunk) as c:
        part = c.core.writeback.part_size
        data = os.urandom(2 * part + chunk)  # three parts: a multipart upload, not a PUT
        h, _ = await c.io.create(ROOT_INO, b"big.bin", 0o644)
        await c.io.write(h.fh, 0, data)
        await c.io.flush(h.fh)
        await c.io.release(h.fh)
        with open(os.path.join(c.src, "big.bin"), "rb") as f:
            assert f.read() == data

        mountpoint = str(tmp_path / "mnt")
        path = control_socket(mountpoint, os.getuid())
        prepare_socket_dir(path)
        server = ControlServer(path, c.core.warmer, c.core.cache, c.metrics,
                               info={"mountpoint": mountpoint, "source": "test",
                                     "cache_dir": "test"},
                               uploads_pending=lambda: 0, warm_concurrency=4)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            mount = ctl.TierfsMount(mountpoint, os.getuid())
            st = await trio.to_thread.run_sync(lambda: ctl.request(mount, "status"))
            nursery.cancel_scope.cancel()

    counted = _registry_counts(c.metrics, "tierfs_backend_requests_total")
    # every op the runner counted is in the status, with its count
    assert {op: n for op, n in st["backend_requests"].items() if n} == counted
    assert counted["mpu_create"] == 1 and counted["mpu_complete"] == 1
    assert counted["upload_part"] == 3
    assert st["backend_requests"]["put"] == 0  # the old fixed keys are still there
    assert set(st["backend_requests"]) >= {"get", "list", "head", "put"}
    assert st["backend_errors"] == {op: 0.0 for op in ("get", "list", "head", "put")}
