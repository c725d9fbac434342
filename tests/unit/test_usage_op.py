"""The control socket's `usage` op (tierfs/mount/control.py) on an in-process core, asked by the
real client (tierfs/cli/ctl.py) over a real unix socket, and `tierfs usage`'s table."""

from __future__ import annotations

import os

import pytest
import trio

from tierfs.cli import ctl

from tierfs import protocol
from tierfs.mount.control import ControlServer, prepare_socket_dir
from tierfs.runpaths import control_socket

from unitkit import core, resolve, write


async def _serve(c, mountpoint: str, nursery: trio.Nursery, **kw) -> ctl.TierfsMount:
    path = control_socket(mountpoint, os.getuid())
    prepare_socket_dir(path)
    server = ControlServer(path, c.core.warmer, c.core.cache, c.metrics,
                           info={"mountpoint": mountpoint, "source": "test",
                                 "cache_dir": "test"},
                           uploads_pending=lambda: 0, warm_concurrency=4, **kw)
    await nursery.start(server.serve)
    return ctl.TierfsMount(mountpoint, os.getuid())


async def _ask(mount: ctl.TierfsMount, **fields) -> dict:
    return await trio.to_thread.run_sync(lambda: ctl.request(mount, "usage", **fields))


async def _read_twice(c, key: str, data: bytes) -> str:
    """Read a file twice through one handle (the second time from the cache); its reader."""
    node = await resolve(c.ns, key)
    h, _ = await c.io.open(node.ino, os.O_RDONLY, os.getpid(), os.getuid())
    assert await c.io.read(h.fh, 0, len(data)) == data
    cache = c.cache_rig.cache
    with trio.fail_after(30):
        while cache.chunk_count < -(-len(data) // (64 << 10)):  # background fills
            await trio.sleep(0.01)
    assert await c.io.read(h.fh, 0, len(data)) == data
    await c.io.release(h.fh)
    await cache.flush_index()  # the per-tenant shares are read from the index
    return h.reader


async def test_usage_per_tenant_and_per_reader_matches_the_reads(tmp_path):
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        data = write(c.src, "ds/a.bin", os.urandom(200 << 10))
        reader = await _read_twice(c, "ds/a.bin", data)
        assert reader.startswith(("uid:", "job:", "pod:"))
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery, usage=c.core.usage,
                                 capacity=c.core.capacity)
            res = await _ask(mount, by="tenant")
            r = protocol.UsageResult.model_validate(res)
            assert r.by == "tenant" and [row.name for row in r.rows] == ["default"]
            row = r.rows[0]
            assert row.read.total() == 2 * len(data)
            # by source as the mount's own counters say (read-ahead makes the split vary)
            for src in ("memory", "disk", "peer", "backend"):
                assert getattr(row.read, src) == c.metrics.value("tierfs_read_bytes_total",
                                                                 source=src), src
            assert row.read.backend >= len(data)  # the first pass at least
            cached = row.read.memory + row.read.disk
            assert cached > 0 and row.hit_ratio == round(cached / (2 * len(data)), 4)
            assert row.cached == len(data) == r.cache.used
            assert row.pinned == 0 and r.cache.pinned == 0
            assert r.cached_from in ("index", "cache")
            table = ctl.usage_table(mount.mountpoint, r)
            assert "default" in table and f"{100 * row.hit_ratio:.0f}%" in table
            assert table.splitlines()[0].startswith(f"{mount.mountpoint}: cache ")

            one = protocol.UsageResult.model_validate(await _ask(mount, reader=reader))
            assert [(x.name, x.read.total()) for x in one.rows] == [(reader, 2 * len(data))]
            kind = reader.split(":")[0]
            mine = await _ask(mount, by=kind)
            assert reader in [x["name"] for x in mine["rows"]]
            assert (await _ask(mount, reader="job:999999999"))["rows"] == []

            fc = protocol.UsageResult.model_validate(await _ask(mount, forecast=True)).forecast
            assert fc is not None
            assert fc.verdict == "too few samples"  # one sample: the one at start
            assert "too few samples" in ctl.usage_table(mount.mountpoint, protocol.UsageResult
                                                        .model_validate(await _ask(
                                                            mount, forecast=True)))
            nursery.cancel_scope.cancel()


async def test_a_daemon_without_accounting_says_so_in_one_line(tmp_path):
    async with core(str(tmp_path)) as c:
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery)
            with pytest.raises(ctl.ControlError, match="keeps no usage accounting"):
                await _ask(mount)
            nursery.cancel_scope.cancel()


async def test_who_a_pod_is_is_in_the_index_when_the_publish_returns(tmp_path):
    """tierfs-csi names a pod (uid -> namespace) at publish: that is written at once, so a
    daemon killed right after the publish still knows the pod when it starts again (the
    periodic flush is 30 s)."""
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery, usage=c.core.usage)
            fields = {"uid": "0f0e", "namespace": "team-a", "name": "train-0"}
            await trio.to_thread.run_sync(lambda: ctl.request(mount, "pod", **fields))
            records = dict(c.core.meta.usage.records())
            assert records["pod/pod:0f0e"]["namespace"] == "team-a"
            forget = {"uid": "0f0e", "forget": True}
            await trio.to_thread.run_sync(lambda: ctl.request(mount, "pod", **forget))
            assert "pod/pod:0f0e" not in dict(c.core.meta.usage.records())
            nursery.cancel_scope.cancel()


async def test_a_pod_is_named_even_when_the_index_cannot_be_written_now(tmp_path, caplog,
                                                                         monkeypatch):
    """The immediate write of who a pod is fails (a full or failing cache disk): the publish
    still succeeds, one WARNING says so, and the periodic flush writes it later."""
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        usage = c.core.usage
        real = usage.meta.usage.put

        def failing(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(usage.meta.usage, "put", failing)
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery, usage=usage)
            fields = {"uid": "0f0f", "namespace": "team-b"}
            reply = await trio.to_thread.run_sync(lambda: ctl.request(mount, "pod", **fields))
            assert reply["namespace"] == "team-b"
            assert usage.pod("0f0f").namespace == "team-b"
            assert "could not be written to the index now" in caplog.text
            monkeypatch.setattr(usage.meta.usage, "put", real)
            await usage.flush()  # what the periodic flusher does
            assert dict(usage.meta.usage.records())["pod/pod:0f0f"]["namespace"] == "team-b"
            nursery.cancel_scope.cancel()
