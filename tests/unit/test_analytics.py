"""Access analytics (tierfs/telemetry/analytics.py): per-prefix reads, re-reads and re-fetches,
LIST/HEAD counts, files per job, the bounds, and what survives a restart - on a real
MetaStore (LMDB), and through the real read path of an in-process core."""

from __future__ import annotations

import os

import trio

from tierfs.telemetry import analytics as an
from tierfs.telemetry.analytics import Analytics, prefix_of
from tierfs.index.meta import MetaStore

from unitkit import FakeClock, core, resolve, write


def _meta(tmp) -> MetaStore:
    return MetaStore(os.path.join(str(tmp), "index"), "file:///src", map_size=64 << 20)


def test_prefix_is_the_first_levels_or_the_files_directory():
    assert prefix_of("data/train/a/b.bin", 2) == "data/train/"
    assert prefix_of("data/train/b.bin", 2) == "data/train/"
    assert prefix_of("data/b.bin", 2) == "data/"
    assert prefix_of("b.bin", 2) == ""
    assert prefix_of("data/train/", 2) == "data/train/"  # a listed directory
    assert prefix_of("data/train/a/b.bin", 1) == "data/"


def test_reads_rereads_refetches_and_metadata_per_prefix(tmp_path):
    clock = FakeClock()
    meta = _meta(tmp_path)
    try:
        a = Analytics(meta, root_prefix="root/", clock=clock)
        ck = [bytes([i]) * 20 for i in range(3)]
        a.read("root/ds/x/f1", "e1", 300, ck[0], "backend", 100, True)  # first fetch
        a.read("root/ds/x/f1", "e1", 300, ck[0], "backend", 100, False)  # same handle again
        a.read("root/ds/x/f1", "e1", 300, ck[0], "disk", 100, True)  # another handle: cached
        clock.advance(60)
        a.read("root/ds/x/f1", "e1", 300, ck[0], "backend", 100, True)  # evicted, fetched again
        a.read("root/ds/y/f2", "e2", 50, ck[1], "backend", 50, True)
        a.read("root/ds/y/f2", "e2", 50, ck[1], "peer", 50, True)  # joined the same flight
        a.meta_request("list", "root/ds/x/")
        a.meta_request("list", "root/ds/x/")
        a.meta_request("head", "root/ds/x/f1")
        p = a.prefixes()
        x, y = p["ds/x/"], p["ds/y/"]
        assert x.read == {"backend": 300, "disk": 100}
        assert (x.accesses, x.rereads, x.fetches, x.refetches) == (3, 2, 2, 1)
        assert (y.accesses, y.rereads, y.fetches, y.refetches) == (2, 0, 2, 0)
        assert (x.lists, x.heads, y.lists) == (2, 1, 0)
        assert x.hit_ratio() == 0.25 and x.reread_ratio() == 2 / 3
        t = a.totals
        assert t.bytes_read() == 500 and (t.accesses, t.refetches, t.lists, t.heads) == (5, 1, 2, 1)
        assert [name for name, _ in a.hot(10)] == ["ds/x/", "ds/y/"]
    finally:
        meta.close()


def test_prefixes_jobs_and_files_are_bounded(tmp_path):
    clock = FakeClock()
    meta = _meta(tmp_path)
    try:
        a = Analytics(meta, max_prefixes=3, max_jobs=2, max_job_files=2, job_window_s=3600,
                      clock=clock)
        a.read("hot/a/f", "e", 10, b"h" * 20, "disk", 1000, True)
        for i in range(5):  # each new prefix evicts the least read one; "hot/a/" stays
            a.read(f"p{i}/f", "e", 10, bytes([i]) * 20, "disk", 1, True)
        assert len(a.prefixes()) == 3 and "hot/a/" in a.prefixes()
        for f in ("d/1", "d/2", "d/3"):
            a.read(f, "e", 10, b"j" * 20, "disk", 1, True, "job:7")
        j = a.job("7")
        assert sorted(j.files) == ["d/1", "d/2"] and j.truncated
        a.read("d/1", "e", 10, b"j" * 20, "disk", 1, True, "job:8")
        clock.advance(10)
        a.read("d/1", "e", 10, b"j" * 20, "disk", 1, True, "job:9")  # job 7 is dropped
        assert a.job("7") is None and a.job("8") is not None
        assert sorted(a.job("9", since=clock.now).files) == ["d/1"]
        assert a.job("8", since=clock.now).files == {}
        clock.advance(3600 - 5)  # job 8 past the window, job 9 just inside
        assert a.job("8") is None and a.job("9") is not None
        assert a.read("x", "e", 1, b"u" * 20, "disk", 1, True, "uid:1000") is None
        assert a.job("uid:1000") is None  # only jobs keep file lists
    finally:
        meta.close()


async def test_what_is_flushed_is_what_a_restart_starts_from(tmp_path):
    clock = FakeClock()
    meta = _meta(tmp_path)
    try:
        a = Analytics(meta, clock=clock)
        a.read("ds/x/f1", "e1", 300, b"c" * 20, "backend", 300, True, "job:42")
        a.meta_request("list", "ds/x/")
        await a.flush()
        clock.advance(301)  # the next 5-minute step: a second point of the series
        a.read("ds/x/f1", "e1", 300, b"c" * 20, "memory", 300, True)
        await a.flush()
        b = Analytics(meta, clock=clock)
        assert b.prefixes() == a.prefixes()
        assert b.totals == a.totals
        assert sorted(b.job("42").files) == ["ds/x/f1"]
        points = b.series()
        assert len(points) == 2 and points[0].read == {"backend": 300}
        assert points[-1].read == {"backend": 300, "memory": 300}
        # the series is downsampled: a day later the 5-minute points are gone, the hourly
        # ones stay (one per hour step)
        clock.advance(an.DAY + 10)
        await b.flush()
        assert not [k for k, _ in meta.analytics.records("series/5m/")
                    if int(k.rpartition("/")[2]) < int((clock.now - an.DAY) // 300)]
        assert len(meta.analytics.records("series/1h/")) >= 2
        meta.analytics.put({"prefix/bad": {"read": "no"}, "junk": [1]})
        c = Analytics(meta, clock=clock)  # a record that does not parse is dropped, not fatal
        assert "bad" not in c.prefixes()
        await c.flush()
        assert not [k for k, _ in meta.analytics.records() if k in ("prefix/bad", "junk")]
    finally:
        meta.close()


async def test_the_read_path_and_the_namespace_feed_the_analytics(tmp_path):
    async with core(str(tmp_path), chunk_size=64 << 10) as c:
        data = write(c.src, "ds/train/a.bin", os.urandom(200 << 10))
        write(c.src, "ds/val/b.bin", b"v" * 1000)
        node = await resolve(c.ns, "ds/train/a.bin")
        for _ in range(2):  # two handles: the second reads the cached chunks again
            h, _ = await c.io.open(node.ino, os.O_RDONLY, os.getpid(), os.getuid())
            assert await c.io.read(h.fh, 0, len(data)) == data
            await c.io.release(h.fh)
            with trio.fail_after(30):
                while c.cache_rig.cache.chunk_count < 4:  # background fills
                    await trio.sleep(0.01)
        a = c.core.analytics
        p = a.prefixes()["ds/train/"]
        assert sum(p.read.values()) == 2 * len(data)
        assert p.accesses == 8 and p.rereads == 4 and p.refetches == 0
        assert a.totals.lists == c.lists() > 0  # every LIST the namespace sent, by prefix
        await c.cache_rig.cache.flush_index()  # the view walks the index
        view = await trio.to_thread.run_sync(
            a.cache_view, set(), 1800.0, c.clock())
        assert view.cached["ds/train/"][0] == len(data)
        assert view.total["ds/train/"] == len(data)
        assert sum(view.by_heat.values()) == len(data)
