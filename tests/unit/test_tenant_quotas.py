"""Tenants in the chunk cache (docs/tenants.md, "Quotas" and "Lifecycle"): who owns each
cached, pinned and dirty byte; soft and hard shares in eviction; max_idle; pin TTLs.

Real MetaStore (LMDB) and DiskTier in a tmp dir; the clock is a FakeClock and statvfs a
fake (unitkit), so time and free space move only when a test says so.
"""

from __future__ import annotations

import pytest
import trio

from tierfs.cache import ChunkCache, Fill, TenantBytes
from tierfs.cache.keys import ObjectVersion
from tierfs.config import parse_tenants
from tierfs.errors import NoSpace
from tierfs.tenants import TenantMap

from unitkit import core, make_cache, sample, write

CHUNK = 4096
N = 16  # cache_size in chunks


def tenants(**tables: dict) -> TenantMap:
    return parse_tenants(tables)


def tenant_cache(root, tmap: TenantMap, *, cache_size: int = N * CHUNK):
    """unitkit's cache rig with a ChunkCache that knows `tmap` (as build_core wires it)."""
    rig = make_cache(str(root), cache_size=cache_size)
    rig.cache = ChunkCache(rig.meta, rig.disk, rig.memory, rig.evictor, rig.metrics,
                           admission=rig.cache.admission,
                           clock=rig.clock, tenants=tmap)
    rig.cache.recover()
    return rig


def obj(key: str, chunks: int) -> ObjectVersion:
    return ObjectVersion("bucket", key, "etag", chunks * CHUNK)


async def fill(rig, o: ObjectVersion, chunks: range, step: float = 1.0,
               kind: Fill = Fill.WARM) -> None:
    """Store chunks, by default as a warm does: always admitted, so the order of eviction
    is all that decides what stays (a reader's fill also passes the admission policy)."""
    for i in chunks:
        rig.clock.advance(step)
        await rig.cache.fill(o, o.chunk_key(i), i.to_bytes(4, "big") * (CHUNK // 4), kind)


def cached(rig, o: ObjectVersion, chunks: int) -> list[int]:
    return [i for i in range(chunks) if rig.cache.has(o.chunk_key(i))]


TWO = {"a": {"prefixes": ["a/"]}, "b": {"prefixes": ["b/"]}}


async def test_bytes_are_counted_per_tenant_and_survive_a_restart(tmp_path):
    tmap = tenants(**TWO)
    rig = tenant_cache(tmp_path, tmap)
    oa, ob, od = obj("a/x", 3), obj("b/y", 2), obj("other", 1)
    await fill(rig, oa, range(3))
    await fill(rig, ob, range(2))
    await fill(rig, od, range(1))
    rig.cache.pins.add("job:1", {ob.oid: ob.size})
    assert await rig.cache.reserve_dirty(CHUNK, 0, key="a/new")
    rig.cache.force_dirty(2 * CHUNK)  # no key: the default tenant's
    want = {"a": TenantBytes(3 * CHUNK, 0, CHUNK), "b": TenantBytes(2 * CHUNK, 2 * CHUNK, 0),
            "default": TenantBytes(CHUNK, 0, 2 * CHUNK)}
    assert rig.cache.tenant_bytes() == want
    for t, b in want.items():
        for kind in ("cached", "pinned", "dirty"):
            assert sample(rig.metrics, "tierfs_tenant_cache_bytes",
                          {"tenant": t, "kind": kind}) == getattr(b, kind)
    # a file renamed into another tenant before its upload: the tenants still sum up
    rig.cache.release_dirty(CHUNK, key="b/renamed")
    rig.cache.release_dirty(2 * CHUNK)
    assert sum(b.dirty for b in rig.cache.tenant_bytes().values()) == rig.cache.dirty_bytes == 0
    # pinning and unpinning moves an object's cached bytes in and out of "pinned"
    rig.cache.pins.release("job:1")
    rig.cache.pins.add("manual", {oa.oid: oa.size})
    assert rig.cache.tenant_bytes()["a"].pinned == 3 * CHUNK
    assert rig.cache.tenant_bytes()["b"].pinned == 0
    await rig.cache.drop(oa.chunk_key(0))
    assert rig.cache.tenant_bytes()["a"] == TenantBytes(2 * CHUNK, 2 * CHUNK, 0)
    await rig.cache.flush_index()

    # a restart: the counts come back from the chunk index and the objects db
    again = ChunkCache(rig.meta, rig.disk, rig.memory, rig.evictor, rig.metrics,
                           admission=rig.cache.admission,
                       clock=rig.clock, tenants=tmap)
    again.recover()
    assert again.tenant_bytes() == {"a": TenantBytes(2 * CHUNK, 2 * CHUNK, 0),
                                    "b": TenantBytes(2 * CHUNK, 0, 0),
                                    "default": TenantBytes(CHUNK, 0, 0)}
    # a changed tenants option re-attributes what is cached
    moved = ChunkCache(rig.meta, rig.disk, rig.memory, rig.evictor, rig.metrics,
                           admission=rig.cache.admission,
                       clock=rig.clock, tenants=tenants(a={"prefixes": ["a/", "b/"]}))
    moved.recover()
    assert moved.tenant_bytes()["a"].cached == 4 * CHUNK
    rig.close()


@pytest.mark.parametrize("kind", [Fill.WARM, Fill.READ])
@pytest.mark.parametrize("quota", [None, "soft", "hard"])
async def test_a_scan_past_its_share_leaves_the_other_tenants_working_set(tmp_path, quota,
                                                                          kind):
    # b's working set was read once, before the scan: equally hot and older, so plain heat
    # order evicts it first. A warm past the cache (always admitted) needs a soft or hard
    # share on the scanner to keep it; a reader's one-shot scan is refused past the free
    # room by the admission policy with or without a share.
    tables = {"a": {"prefixes": ["a/"]}, "b": {"prefixes": ["b/"]}}
    if quota:
        tables["a"][quota] = "50%"
    rig = tenant_cache(tmp_path, tenants(**tables))
    work, scan = obj("b/work", 4), obj("a/scan", 5 * N)
    await fill(rig, work, range(4))
    peak_a = 0
    for i in range(5 * N):
        await fill(rig, scan, range(i, i + 1), kind=kind)
        peak_a = max(peak_a, rig.cache.tenant_bytes()["a"].cached)
        assert rig.cache.used_bytes <= N * CHUNK
    if quota is None and kind is Fill.WARM:
        assert cached(rig, work, 4) == []
        return
    assert cached(rig, work, 4) == [0, 1, 2, 3]
    if quota == "hard":
        assert peak_a <= N * CHUNK // 2
    kept = cached(rig, scan, 5 * N)
    assert kept
    if kind is Fill.WARM:  # inside the scanner, the newest (hottest) chunks are kept
        assert kept == list(range(5 * N - len(kept), 5 * N))
    else:  # the first ones, in the room there was; the rest refused
        assert kept == list(range(len(kept)))
        assert sample(rig.metrics, "tierfs_cache_refused_chunks_total") == 5 * N - len(kept)
    rig.close()


async def test_soft_share_goes_first_then_heat_over_everyone(tmp_path):
    rig = tenant_cache(tmp_path, tenants(a={"prefixes": ["a/"], "soft": "25%"},
                                         b={"prefixes": ["b/"]}))
    oa, ob = obj("a/x", 10), obj("b/y", 6)
    await fill(rig, ob, range(6))  # b's chunks are the oldest
    await fill(rig, oa, range(10))
    for i in range(5, 10):  # a's newest half is read again: hotter than the rest of a
        rig.cache.touch(oa.chunk_key(i))
    # the cache is full; 8 more chunks of b must come in
    ob2 = obj("b/z", 8)
    await fill(rig, ob2, range(8))
    # a (soft 4 chunks) lost its coldest first, only down to its soft share, keeping the
    # read-again ones; then b's old chunks were the coldest of all and went, by heat
    assert cached(rig, oa, 10) == [6, 7, 8, 9]
    assert cached(rig, ob, 6) == [4, 5]
    assert cached(rig, ob2, 8) == list(range(8))
    rig.close()


async def test_a_tenant_at_its_hard_share_evicts_only_its_own(tmp_path):
    rig = tenant_cache(tmp_path, tenants(a={"prefixes": ["a/"], "hard": "25%"},
                                         b={"prefixes": ["b/"]}))
    ob, oa = obj("b/y", 8), obj("a/x", 20)
    await fill(rig, ob, range(8))
    await fill(rig, oa, range(20), step=0.001)  # a's chunks are newer, b's are colder
    # the cache never filled up (8 + 4 of 16): a's fills evicted only a's chunks
    assert cached(rig, ob, 8) == list(range(8))
    assert rig.cache.tenant_bytes()["a"].cached <= N * CHUNK // 4
    assert cached(rig, oa, 20)[-1] == 19  # the newest of a's is in
    # everything a has cached is pinned: its next chunk is served without the disk tier
    rig.cache.pins.add("manual", {oa.oid: oa.size})
    more = obj("a/more", 1)
    await fill(rig, more, range(1))
    assert not rig.cache.has(more.chunk_key(0))
    assert cached(rig, ob, 8) == list(range(8))
    rig.close()


async def test_hard_share_holds_dirty_bytes_of_a_tenants_files(tmp_path):
    rig = tenant_cache(tmp_path, tenants(a={"prefixes": ["a/"], "hard": "25%"}))
    oa = obj("a/x", 4)
    await fill(rig, oa, range(4))  # a at its share (4 of 16)
    # a new write of a's evicts a's own clean chunks to make room
    assert await rig.cache.reserve_dirty(2 * CHUNK, 5, key="a/new")
    assert len(cached(rig, oa, 4)) <= 2
    assert rig.cache.tenant_bytes()["a"].dirty == 2 * CHUNK
    # nothing of a's left to evict: past its share, the write waits (0 s), then is refused
    rig.cache.pins.add("manual", {oa.oid: oa.size})
    assert not await rig.cache.reserve_dirty(2 * CHUNK, 0, key="a/other")
    # the default tenant has no share: its writes fit as before
    assert await rig.cache.reserve_dirty(2 * CHUNK, 5, key="elsewhere")
    rig.close()


async def test_max_idle_evicts_what_nobody_read_pins_excepted(tmp_path, autojump_clock):
    rig = tenant_cache(tmp_path, tenants(a={"prefixes": ["a/"], "max_idle": "1h"},
                                         b={"prefixes": ["b/"]}))
    oa, op, ob = obj("a/x", 3), obj("a/pinned", 1), obj("b/y", 2)
    await fill(rig, oa, range(3))
    await fill(rig, op, range(1))
    await fill(rig, ob, range(2))
    rig.cache.pins.add("job:7", {op.oid: op.size})
    rig.clock.advance(1800)
    rig.cache.touch(oa.chunk_key(2))  # read half an hour in
    assert await rig.cache.sweep_idle() == 0  # nothing idle for an hour yet
    rig.clock.advance(1900)  # an hour and a bit since the fills, 32 min since the read
    assert await rig.cache.sweep_idle() == 2 * CHUNK
    assert cached(rig, oa, 3) == [2]
    assert cached(rig, op, 1) == [0]  # pinned
    assert cached(rig, ob, 2) == [0, 1]  # b has no max_idle
    assert sample(rig.metrics, "tierfs_cache_evictions_total") == 2
    assert rig.cache.tenant_bytes()["a"].cached == 2 * CHUNK

    # the periodic service does the same on its own (trio's clock jumps; the cache's
    # FakeClock says how idle the chunks are)
    interval = rig.cache.idle_sweep_interval()
    assert interval == 360.0  # a tenth of the shortest max_idle
    rig.clock.advance(3600)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.cache.run_idle_sweeper)
        for _ in range(10):  # sweeps, not seconds: one is enough, its drops take a while
            await trio.sleep(interval)
            if not rig.cache.has(oa.chunk_key(2)):
                break
        nursery.cancel_scope.cancel()
    assert cached(rig, oa, 3) == [] and cached(rig, op, 1) == [0] and cached(rig, ob, 2) == [0, 1]
    assert ChunkCache(rig.meta, rig.disk, rig.memory, rig.evictor, rig.metrics,
                           admission=rig.cache.admission,
                      tenants=tenants(**TWO)).idle_sweep_interval() is None
    rig.close()


async def test_pin_without_ttl_gets_its_tenants_pin_ttl(tmp_path):
    tmap = {"a": {"prefixes": ["a/"], "pin_ttl": "2h"}, "b": {"prefixes": ["b/"]}}
    async with core(str(tmp_path), tenants=tenants(**tmap)) as c:
        write(c.src, "a/one.bin", b"1" * 1000)
        write(c.src, "b/two.bin", b"2" * 1000)
        w, pins = c.core.warmer, c.core.cache.pins
        await w.warm(["a", "b"], pin_owner="job:5")
        oids = {p: o.oid for p, o in (await w.resolve(["a", "b"])).files}
        pin = pins.owners["job:5"]
        assert pin.expires is None
        assert pin.deadline(oids["a/one.bin"]) == c.clock() + 7200
        assert pin.deadline(oids["b/two.bin"]) is None
        # an explicit TTL is the pin's, whatever the tenant says
        await w.warm(["b"], pin_owner="job:6", pin_expires=c.clock() + 60)
        assert pins.owners["job:6"].deadline(oids["b/two.bin"]) == c.clock() + 60
        c.clock.advance(3600)
        assert pins.expire() == ["job:6"]
        assert oids["a/one.bin"] in pins
        # job:5's file of a goes after its 2 h; the rest of job:5 stays
        c.clock.advance(3601)
        assert pins.expire() == []
        assert oids["a/one.bin"] not in pins and oids["b/two.bin"] in pins
        assert pins.owners["job:5"].objects.keys() == {oids["b/two.bin"]}


async def test_pin_ttl_deadlines_survive_a_restart(tmp_path):
    tmap = tenants(a={"prefixes": ["a/"], "pin_ttl": "1h"})
    async with core(str(tmp_path), tenants=tmap) as c:
        write(c.src, "a/one.bin", b"1" * 1000)
        await c.core.warmer.warm(["a"], pin_owner="manual")
        deadline = c.clock() + 3600
    async with core(str(tmp_path), tenants=tmap) as c:
        (pin,) = c.core.cache.pins.owners.values()
        assert list(pin.until.values()) == [deadline]


async def test_a_warm_over_the_hard_share_is_refused_with_the_numbers(tmp_path):
    tmap = tenants(a={"prefixes": ["a/"], "hard": "1M"})
    async with core(str(tmp_path), tenants=tmap) as c:
        for i in range(3):
            write(c.src, f"a/{i}.bin", bytes(512 << 10))
        write(c.src, "b.bin", bytes(512 << 10))
        check = await c.core.warmer.warm(["a"], check=True)
        assert check["fits"] is False
        with pytest.raises(NoSpace) as err:
            await c.core.warmer.warm(["a"], pin_owner="job:1")
        assert str(err.value) == (
            "the warm set's files of tenant a are 1.5 MiB (3 files) but its hard share is "
            "1.0 MiB = 1.0 MiB of the 64.0 MiB budget, less 0 B it pins otherwise and 0 B "
            "of its unsaved writes: warm less, unpin something of a, or raise its hard share")
        assert c.gets() == 0
        assert "job:1" not in c.core.cache.pins.owners
        # within the share, and another tenant's files beside: fine
        r = await c.core.warmer.warm(["a/0.bin", "a/1.bin", "b.bin"], pin_owner="job:1")
        assert r["error_count"] == 0 and r["bytes_fetched"] == 3 * (512 << 10)
        # now a pins 1 MiB: one more file of a is refused, naming what a pins
        with pytest.raises(NoSpace, match="less 1.0 MiB it pins otherwise"):
            await c.core.warmer.warm(["a/2.bin"], pin_owner="job:2")


async def test_pinning_again_never_shortens_an_objects_deadline(tmp_path):
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    pins, x = rig.cache.pins, b"x" * 16
    t0 = rig.clock()
    pins.add("o", {x: 1}, ttls={x: 100})
    rig.clock.advance(50)
    pins.add("o", {x: 1}, ttls={x: 10})  # would end at t0 + 60: keeps t0 + 100
    assert pins.owners["o"].deadline(x) == t0 + 100
    pins.add("o", {x: 1})  # no TTL at all: pinned until unpinned
    assert pins.owners["o"].deadline(x) is None and not pins.owners["o"].until
    rig.clock.advance(1000)
    assert pins.expire() == [] and x in pins
    rig.close()


async def test_unsaved_writes_count_to_the_tenant_of_their_file(tmp_path):
    # the write path names the file: its dirty bytes are its tenant's, until uploaded
    from tierfs.index.inodes import ROOT_INO

    async with core(str(tmp_path), tenants=tenants(**TWO)) as c:
        a = await c.ns.mkdir(ROOT_INO, b"a", 0o755)
        h, _ = await c.io.create(a.ino, b"ckpt.pt", 0o644)
        await c.io.write(h.fh, 0, b"x" * 100_000)
        counts = c.core.cache.tenant_bytes()
        assert counts["a"].dirty == c.core.cache.dirty_bytes > 0
        assert sum(t.dirty for n, t in counts.items() if n != "a") == 0
        await c.io.flush(h.fh)
        await c.io.release(h.fh)
        assert c.core.cache.dirty_bytes == 0
        assert sum(t.dirty for t in c.core.cache.tenant_bytes().values()) == 0


async def test_a_reader_under_its_share_is_admitted_over_a_tenant_above_its_soft_share(
        tmp_path):
    # shares come before heat: b's chunks, read once (no history for the admission policy
    # to go on), still take the room a holds above its soft share
    rig = tenant_cache(tmp_path, tenants(a={"prefixes": ["a/"], "soft": "25%"},
                                         b={"prefixes": ["b/"]}))
    oa, ob = obj("a/x", N), obj("b/y", N)
    await fill(rig, oa, range(N), kind=Fill.READ)  # a takes the free room
    assert len(cached(rig, oa, N)) > N // 2
    await fill(rig, ob, range(N), kind=Fill.READ)
    assert rig.cache.tenant_bytes()["a"].cached <= N // 4 * CHUNK  # its share, or below
    assert len(cached(rig, ob, N)) >= N // 2
    rig.close()
