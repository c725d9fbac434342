"""The near store (--tier, docs/tiers.md) in the read walk, on the core the daemon builds:
a copy is served only while it is a copy of the source's current version, what the
source answers is copied to it, and a near store that fails is skipped, never an error.
FileBackends stand for both stores here; tests/tiers runs the same on two Ceph RGWs."""

from __future__ import annotations

import os

import trio

from tierfs.backend.file import FileBackend
from tierfs.cache import ObjectVersion
from tierfs.index.inodes import ROOT_INO
from tierfs.read.near import NEAR_ETAG, NEAR_MAKING, NEAR_SIZE

from faultkit import FaultBackend, error, unavailable
from unitkit import core, sample, write

CS = 64 << 10


def _version(c, key: str) -> ObjectVersion:
    meta = c.backend.head(key)
    return ObjectVersion(c.io.bucket, meta.key, meta.etag, meta.size)


async def _read_all(c, key: str) -> bytes:
    ino = ROOT_INO
    for part in key.split("/"):
        ino = (await c.ns.lookup(ino, part.encode())).ino
    h, _ = await c.io.open(ino)
    out = bytearray()
    try:
        while b := await c.io.read(h.fh, len(out), 1 << 20):
            out += b
        return bytes(out)
    finally:
        await c.io.release(h.fh)


async def _promoted(c) -> None:
    with trio.fail_after(20):
        while c.core.promoter.pending() or len(c.walk.flights):
            await trio.sleep(0.01)


def _near_dir(tmp_path) -> FileBackend:
    d = tmp_path / "near"
    d.mkdir(exist_ok=True)
    return FileBackend(str(d))


def _sources(c) -> list[str]:
    return [t.name for t in c.walk.sources]


async def test_a_read_from_the_source_is_copied_and_the_next_node_reads_the_copy(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        data = write(str(src), "d/f.bin", os.urandom(3 * CS + 100))
        assert _sources(a) == ["near", "backend"]
        assert await _read_all(a, "d/f.bin") == data
        await _promoted(a)
        obj = _version(a, "d/f.bin")
        copy = near.head("d/f.bin")
        assert (copy.size, copy.metadata[NEAR_ETAG], copy.metadata[NEAR_SIZE]) == \
            (len(data), obj.etag, str(len(data)))
        assert a.core.promoter.copied == 1
        assert sample(a.metrics, "tierfs_tier_promotions_total",
                      {"tier": "near", "outcome": "copied"}) == 1
        gets_a = a.gets()
    # a second node (another cache dir) over the same source and near store
    async with core(str(tmp_path / "b"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as b:
        assert await _read_all(b, "d/f.bin") == data
        assert b.gets() == 0  # every chunk from the near copy
        assert b.core.near.hits == 4
        assert sample(b.metrics, "tierfs_tier_bytes_total",
                      {"tier": "near", "direction": "read"}) == len(data)
    assert gets_a == 4  # node a read each chunk from the source once, the copy included


async def test_a_copy_of_another_version_is_never_served(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    old = write(str(src), "f", os.urandom(2 * CS))
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        assert await _read_all(a, "f") == old
        await _promoted(a)
    assert near.head("f").size == len(old)
    new = write(str(src), "f", os.urandom(2 * CS))  # the source changes, same size
    async with core(str(tmp_path / "b"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as b:
        assert await _read_all(b, "f") == new
        assert b.core.near.hits == 0 and b.gets() == 2
        await _promoted(b)
    assert near.head("f").metadata[NEAR_ETAG] == FileBackend(str(src)).head("f").etag


async def test_a_failing_near_store_is_skipped_and_the_read_succeeds(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = write(str(src), "f", os.urandom(2 * CS))
    near = FaultBackend(_near_dir(tmp_path))
    near.inject("*", error("injected 503"))
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        assert await _read_all(a, "f") == data
        await _promoted(a)
        assert a.core.near.failures >= 1 and a.core.near.hits == 0
        assert sample(a.metrics, "tierfs_tier_promotions_total",
                      {"tier": "near", "outcome": "failed"}) == 1
        assert a.internal_errors("promoter") == 0


async def test_an_unreachable_near_store_is_not_asked_until_it_answers(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write(str(src), "f", os.urandom(CS))
    write(str(src), "g", os.urandom(CS))
    near = FaultBackend(_near_dir(tmp_path))
    down = near.inject("*", unavailable())
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src), promote="none") as a:
        health = a.core.near.backend.health
        await _read_all(a, "f")
        with trio.fail_after(20):  # the probe confirms it: the near store is down
            while health.up:
                await trio.sleep(0.01)
        assert sample(a.metrics, "tierfs_tier_up", {"tier": "near"}) == 0
        asked = near.calls["get_into"]
        await _read_all(a, "g")  # read from the source without asking the near store
        assert near.calls["get_into"] == asked
        near.remove(down)
        with trio.fail_after(30):  # probed every few seconds until it answers
            while not health.up:
                await trio.sleep(0.05)
        assert sample(a.metrics, "tierfs_tier_up", {"tier": "near"}) == 1
        assert a.core.promoter is None  # promote = none


async def test_a_big_object_is_copied_in_parts_and_gets_its_version_last(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    data = write(str(src), "big", os.urandom((6 << 20) + 1234))  # 2 parts of 5 MiB+
    seen: list[dict] = []
    real_copy = near.copy

    def copy(s, d, etag, metadata=None):
        # until the final copy the upload is no copy of any version
        seen.append(dict(near.head(s).metadata))
        return real_copy(s, d, etag, metadata)

    near.copy = copy  # type: ignore[method-assign]
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src), memory_bytes=1 << 20) as a:
        assert await _read_all(a, "big") == data
        await _promoted(a)
    assert len(seen) == 1 and NEAR_ETAG not in seen[0]
    copy_meta = near.head("big").metadata
    assert copy_meta[NEAR_SIZE] == str(len(data)) and "tierfs-crc32c" in copy_meta
    with open(os.path.join(near.root, "big"), "rb") as f:
        assert f.read() == data


async def test_warm_near_copies_from_the_source_and_keeps_nothing_locally(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"w/{i}": write(str(src), f"w/{i}", os.urandom(CS * i + 7)) for i in range(1, 4)}
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        check = await a.core.warmer.warm(["w"], check=True, tier="near")
        assert (check["bytes_cached_before"], check["error_count"]) == (0, 0)
        r = await a.core.warmer.warm(["w"], tier="near", concurrency=2)
        assert (r["bytes_fetched"], r["error_count"]) == (sum(map(len, files.values())), 0)
        assert a.core.cache.used_bytes == 0  # this node's disk tier untouched
        for key, data in files.items():
            with open(os.path.join(near.root, key), "rb") as f:
                assert f.read() == data
        again = await a.core.warmer.warm(["w"], tier="near")
        assert again["bytes_fetched"] == 0
        assert again["bytes_cached_before"] == r["bytes_fetched"]


async def test_gc_removes_stale_copies_then_the_oldest_over_the_budget(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "b", "c", "d"):
        write(str(src), f"g/{name}", os.urandom(CS))
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        await a.core.warmer.warm(["g"], tier="near")
        write(str(src), "g/a", os.urandom(CS + 1))  # a's copy is of an older version now
        os.unlink(os.path.join(src, "g", "b"))  # b is gone from the source
        write(str(near.root), "foreign", b"not a copy")  # no version in its metadata
        for age, name in ((300, "c"), (100, "d")):  # c was copied before d
            t = os.path.getmtime(os.path.join(near.root, "g", name)) - age
            os.utime(os.path.join(near.root, "g", name), (t, t))
        dry = await a.core.near_gc(None, True)
        assert (dry["stale"], dry["kept"], dry["not_copies"]) == (2, 2, 1)
        assert os.path.exists(os.path.join(near.root, "g", "a"))  # a dry run removes nothing
        r = await a.core.near_gc(CS + 10 + 5, False)  # room for one copy and the foreign
        assert (r["stale"], r["over_budget"], r["kept"], r["error_count"]) == (2, 1, 1, 0)
    left = sorted(os.path.relpath(os.path.join(d, f), near.root)
                  for d, _, fs in os.walk(near.root) for f in fs)
    assert left == ["foreign", "g/d"]  # the oldest copy (c) went for the budget


async def test_gc_removes_a_copy_a_crash_left_half_made_once_it_is_old(tmp_path):
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    write(str(src), "h/x", os.urandom(CS))
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        etag = FileBackend(str(src)).head("h/x").etag
        for name, age in (("h/x", 7200), ("h/y", 60)):  # completed, final metadata not set
            near.put(name, b"half", {NEAR_MAKING: etag})
            t = os.path.getmtime(os.path.join(near.root, name)) - age
            os.utime(os.path.join(near.root, name), (t, t))
        r = await a.core.near_gc(None, False)
        assert (r["stale"], r["not_copies"]) == (1, 1)
    assert not os.path.exists(os.path.join(near.root, "h", "x"))
    assert os.path.exists(os.path.join(near.root, "h", "y"))  # may still be being made


async def test_a_local_warm_fills_the_cache_from_the_near_store(tmp_path):
    """A job's prolog (`tierfs warm`) on a node of a fleet with a near store: the chunks
    come from the near store, not over the WAN; what it lacks comes from the source."""
    near = _near_dir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    files = {f"p/{i}": write(str(src), f"p/{i}", os.urandom(2 * CS + i)) for i in range(3)}
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src)) as a:
        await a.core.warmer.warm(["p/0", "p/1"], tier="near")
    async with core(str(tmp_path / "b"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src), promote="none") as b:
        r = await b.core.warmer.warm(["p"])
        assert (r["error_count"], r["bytes_fetched"]) == (0, sum(map(len, files.values())))
        assert b.core.near.hits == 5  # p/0 (two chunks) and p/1 (three)
        assert b.gets() == 3  # p/2 from the source
        for key, data in files.items():
            assert await _read_all(b, key) == data
        assert b.gets() == 3  # all of it read from this node's cache


async def test_near_store_failures_in_warm_and_gc_are_entries_not_crashes(tmp_path):
    near = FaultBackend(_near_dir(tmp_path))
    src = tmp_path / "src"
    src.mkdir()
    files = {f"e/{i}": write(str(src), f"e/{i}", os.urandom(CS + i)) for i in range(2)}
    async with core(str(tmp_path / "a"), near=near, backend=FileBackend(str(src)),
                    bucket=str(src), promote="none") as a:
        near.inject({"put", "head", "get_into"}, error("injected 503"))
        r = await a.core.warmer.warm(["e"], tier="near")  # every copy fails: one entry each
        assert (r["error_count"], r["bytes_fetched"]) == (2, 0)
        # a local warm goes around the failing near store to the source
        r = await a.core.warmer.warm(["e"])
        assert (r["error_count"], r["bytes_fetched"]) == (0, sum(map(len, files.values())))
        assert a.gets() == 3 and a.core.near.failures >= 1  # e/0: one chunk, e/1: two
        near.clear()
        await a.core.warmer.warm(["e"], tier="near")
        write(str(src), "e/0", os.urandom(CS))  # e/0's copy is stale now
        near.inject("delete", error("injected 503"))
        r = await a.core.near_gc(None, False)
        assert (r["stale"], r["removed_bytes"], r["error_count"]) == (1, 0, 1)
        assert a.internal_errors("warm") == 0
