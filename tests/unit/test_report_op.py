"""`tierfs report`'s control ops (tierfs/telemetry/report.py via tierfs/mount/control.py) on an in-process
core, asked by the real client (tierfs/cli/ctl.py) over a real unix socket: the typed result
against the reads made, the text report, the job manifest; and the pure pieces (the hit
ratio series, bucket quantiles)."""

from __future__ import annotations

import os

import trio

from tierfs.cli import ctl, reportpage

from tierfs import protocol
from tierfs.telemetry.analytics import Point
from tierfs.mount.control import ControlServer, prepare_socket_dir
from tierfs.telemetry.report import _quantile, ratio_series
from tierfs.runpaths import control_socket

from unitkit import core, resolve, write


async def _serve(c, mountpoint: str, nursery: trio.Nursery) -> ctl.TierfsMount:
    path = control_socket(mountpoint, os.getuid())
    prepare_socket_dir(path)
    server = ControlServer(path, c.core.warmer, c.core.cache, c.metrics,
                           info={"mountpoint": mountpoint, "source": "test",
                                 "cache_dir": "test"},
                           uploads_pending=lambda: 0, warm_concurrency=4,
                           capacity=c.core.capacity, stalls=c.core.stalls)
    await nursery.start(server.serve)
    return ctl.TierfsMount(mountpoint, os.getuid())


async def _ask(mount: ctl.TierfsMount, op: str, **fields) -> dict:
    return await trio.to_thread.run_sync(lambda: ctl.request(mount, op, **fields))


async def _read(c, key: str, size: int) -> None:
    node = await resolve(c.ns, key)
    h, _ = await c.io.open(node.ino, os.O_RDONLY, os.getpid(), os.getuid())
    assert len(await c.io.read(h.fh, 0, size)) == size
    await c.io.release(h.fh)


async def test_report_matches_the_reads_and_renders(tmp_path):
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        write(c.src, "ds/train/a.bin", os.urandom(256 << 10))
        write(c.src, "ds/val/b.bin", os.urandom(64 << 10))
        for _ in range(3):
            await _read(c, "ds/train/a.bin", 256 << 10)
        await _read(c, "ds/val/b.bin", 64 << 10)
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery)
            with trio.fail_after(30):  # the background fills of the first read
                while c.cache_rig.cache.chunk_count < 5:
                    await trio.sleep(0.01)
            res = await _ask(mount, "report", top=5)
            nursery.cancel_scope.cancel()
    r = protocol.ReportResult.model_validate(res)
    assert r.read.total() == 3 * (256 << 10) + (64 << 10)
    assert [h.prefix for h in r.hot] == ["ds/train/", "ds/val/"]
    train = r.hot[0]
    assert train.read.total() == 3 * (256 << 10) and train.cached == train.total == 256 << 10
    assert train.accesses == 12 and train.reread_ratio == round(8 / 12, 4)
    assert r.metadata.lists == sum(p.lists for p in r.metadata.top) > 0
    assert sum(r.composition.values()) == r.cache.used == sum(b.count for b in r.heat)
    assert r.cold == []  # everything was read just now
    assert r.eviction.fetches == 5 and r.eviction.refetches == 0
    assert r.eviction.evictions == r.eviction.refused == 0  # the cache had room
    assert r.usage_series[-1].used == r.cache.used
    assert r.ratio_series[-1].bytes == r.read.total()
    text = reportpage.text(r)
    assert "ds/train/" in text and "Eviction quality" in text


async def test_job_files_and_the_manifest_lines(tmp_path):
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        write(c.src, "ds/a[1].bin", b"x" * 1000)
        write(c.src, "ds/b.bin", b"y" * 1000)
        a = c.core.analytics
        for key in ("ds/a[1].bin", "ds/b.bin"):  # what the read path records for job:77
            node = await resolve(c.ns, key)
            a.read(node.key, node.etag, node.size, b"k" * 20, "backend", node.size, True,
                   "job:77")
        async with trio.open_nursery() as nursery:
            mount = await _serve(c, str(tmp_path / "mnt"), nursery)
            got = await _ask(mount, "job_files", job="77")
            unknown = await _ask(mount, "job_files", job="78")
            c.clock.advance(60)
            recent = await _ask(mount, "job_files", job="77", since=30.0)
            within = await _ask(mount, "job_files", job="77", since=120.0)
            nursery.cancel_scope.cancel()
    r = protocol.JobFilesResult.model_validate(got)
    assert r.known and [f.path for f in r.files] == ["ds/a[1].bin", "ds/b.bin"]
    assert all(f.size == 1000 and f.etag for f in r.files)
    assert not protocol.JobFilesResult.model_validate(unknown).known
    assert protocol.JobFilesResult.model_validate(recent).files == []  # read 60 s ago
    assert len(protocol.JobFilesResult.model_validate(within).files) == 2


def test_ratio_series_is_per_interval_and_survives_a_reset():
    pts = [Point(1.0, {"backend": 100}), Point(2.0, {"backend": 100, "disk": 300}),
           Point(3.0, {"memory": 50})]  # counts went down: a restart lost them
    assert ratio_series(pts) == [{"t": 1.0, "hit_ratio": 0.0, "bytes": 100},
                                 {"t": 2.0, "hit_ratio": 1.0, "bytes": 300},
                                 {"t": 3.0, "hit_ratio": 1.0, "bytes": 50}]


def test_quantile_is_the_bucket_bound():
    b = {0.01: 5.0, 0.1: 9.0, 1.0: 10.0, float("inf"): 10.0}
    assert _quantile(b, 0.5) == 0.01 and _quantile(b, 0.9) == 0.1 and _quantile(b, 0.99) == 1.0
    assert _quantile({float("inf"): 0.0}, 0.5) is None
