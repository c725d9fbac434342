"""Eviction: the disk tier stays within its budget, and heat protects the working set.

A fake statvfs stands for the cache filesystem and a fake clock for time; no timing is
measured. The scan-resistance test is paired with a plain-LRU simulation of the same
access sequence, which documents why the disk tier orders by heat and not by recency.
"""

import os
from collections import OrderedDict

import pytest
import trio

from tierfs.cache import Fill, admission
from tierfs.cache.admission import (ABANDONED, MARGIN, MIN_GAP, SKIPPED_MAX,
                                    TRAILING, Admission, LruShadow)
from tierfs.cache.heat import RESTORED, UNREAD_WRITTEN
from tierfs.cache.keys import ObjectVersion
from tierfs.telemetry.callers import Callers
from tierfs.index.chunks import ChunkRecord

from unitkit import chunk_files, core, make_cache, resolve, sample, statvfs_result, write

CHUNK = 4096  # one checksum block per chunk keeps the arithmetic obvious
N = 16  # cache_size in chunks


def obj(name: str, chunks: int) -> ObjectVersion:
    return ObjectVersion("bucket", name, "etag", chunks * CHUNK)


def payload(tag: int) -> bytes:
    return tag.to_bytes(4, "big") * (CHUNK // 4)


async def test_budget_is_cache_size_when_space_is_plenty(tmp_path):
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    try:
        assert rig.cache.budget() == N * CHUNK
        assert sample(rig.metrics, "tierfs_cache_budget_bytes") == N * CHUNK
    finally:
        rig.close()


@pytest.mark.parametrize("kind", [Fill.READ, Fill.WARM])
async def test_filling_past_cache_size_never_exceeds_it(tmp_path, kind):
    root = str(tmp_path)
    rig = make_cache(root, cache_size=N * CHUNK)
    o = obj("big", 5 * N)
    try:
        for i in range(5 * N):
            rig.clock.advance(1)
            await rig.cache.fill(o, o.chunk_key(i), payload(i), kind)
            assert rig.cache.used_bytes <= N * CHUNK
            assert sum(chunk_files(root).values()) == rig.cache.used_bytes
        # usage ends between the low and high watermarks, not emptied
        assert rig.cache.used_bytes >= int(0.90 * N * CHUNK) - CHUNK
        survivors = [i for i in range(5 * N) if rig.cache.has(o.chunk_key(i))]
        refused = sample(rig.metrics, "tierfs_cache_refused_chunks_total")
        evicted = sample(rig.metrics, "tierfs_cache_evictions_total")
        if kind is Fill.READ:
            # a one-shot scan: the free room takes its first chunks; then no chunk of it
            # has more reads than what is cached, so the rest is refused, not swapped in
            assert survivors == list(range(len(survivors)))
            assert (refused, evicted) == (5 * N - len(survivors), 0)
        else:
            # warmed chunks are always admitted: the newest stay (all equally cold)
            assert survivors == list(range(5 * N - len(survivors), 5 * N))
            assert refused == 0 and evicted > 0
        for i in survivors:
            got, _ = await rig.cache.read(o.chunk_key(i), 0, 0, touch=False)
            assert got == payload(i)
    finally:
        rig.close()


async def test_concurrent_fills_never_exceed_cache_size(tmp_path):
    # The read walk runs up to 4 fills at once (disk_writers). Each fill decides whether it
    # fits before its write, but the bytes of the other fills in flight are not counted,
    # so together they can overshoot the budget.
    root = str(tmp_path)
    rig = make_cache(root, cache_size=N * CHUNK)
    o = obj("big", 8 * N)
    worst = 0
    try:
        for batch in range(0, 8 * N, 4):
            async with trio.open_nursery() as n:
                for i in range(batch, batch + 4):
                    n.start_soon(rig.cache.fill, o, o.chunk_key(i), payload(i))
            worst = max(worst, rig.cache.used_bytes)
        assert sum(chunk_files(root).values()) == rig.cache.used_bytes
        assert worst <= N * CHUNK, f"used {worst // CHUNK} chunks of a {N}-chunk cache"
    finally:
        rig.close()


def test_free_space_guard_formula(tmp_path):
    mib = 1 << 20
    # 100 MiB filesystem, 30 MiB available, 10% (10 MiB) must stay free
    rig = make_cache(str(tmp_path), cache_size=1 << 30,
                     statvfs=lambda p: statvfs_result(100 * mib, 30 * mib))
    try:
        assert rig.evictor.budget(0) == 20 * mib
        assert rig.evictor.budget(5 * mib) == 25 * mib  # our own bytes may be reused
        assert rig.evictor.budget(2000 * mib) == 1 << 30  # never above cache_size
    finally:
        rig.close()


def test_full_filesystem_gives_a_zero_budget(tmp_path):
    rig = make_cache(str(tmp_path), cache_size=1 << 30,
                     statvfs=lambda p: statvfs_result(100 << 20, 1 << 20))
    try:
        assert rig.evictor.budget(0) == 0
    finally:
        rig.close()


class SharedFilesystem:
    """A small filesystem shared by the cache and other users: free space is what the
    others and the chunk files actually occupy, as a real statvfs would report."""

    def __init__(self, root: str, total: int, others: int) -> None:
        self.root, self.total, self.others = root, total, others

    def __call__(self, path: str) -> os.statvfs_result:
        used = self.others + sum(chunk_files(self.root).values())
        return statvfs_result(self.total, self.total - used, frsize=CHUNK)


async def test_nearly_full_filesystem_caps_the_budget_below_cache_size(tmp_path):
    root = str(tmp_path)
    total = 100 * CHUNK
    fs = SharedFilesystem(root, total, others=80 * CHUNK)  # 20 chunks free, 10 reserved
    guard = total - fs.others - total // 10
    rig = make_cache(root, cache_size=64 * CHUNK, statvfs=fs)
    o = obj("big", 100)
    try:
        assert rig.cache.budget() == guard == 10 * CHUNK
        for i in range(100):
            rig.clock.advance(1)
            await rig.cache.fill(o, o.chunk_key(i), payload(i))
            assert rig.cache.used_bytes <= guard
        assert rig.cache.used_bytes > 0  # the cache still works inside the guard
        assert rig.cache.budget() == guard
        assert sample(rig.metrics, "tierfs_cache_budget_bytes") == guard
        # someone else takes more space: the budget shrinks and the next fill evicts
        fs.others += 5 * CHUNK
        await rig.cache.fill(o, o.chunk_key(100), payload(100))
        assert rig.cache.used_bytes <= guard - 5 * CHUNK
    finally:
        rig.close()


async def test_no_space_at_all_serves_without_the_disk_tier(tmp_path):
    root = str(tmp_path)
    rig = make_cache(root, cache_size=64 * CHUNK,
                     statvfs=lambda p: statvfs_result(100 * CHUNK, 0, frsize=CHUNK))
    o = obj("x", 1)
    try:
        await rig.cache.fill(o, o.chunk_key(0), payload(0))
        assert not rig.cache.has(o.chunk_key(0))
        assert chunk_files(root) == {}
    finally:
        rig.close()


HOT = 4


async def run_hot_then_scan(rig):
    """The access sequence of both scan-resistance tests; returns (hot keys, scan keys)."""
    hot = obj("hot", HOT)
    scan = obj("scan", 5 * N)
    hot_keys = [hot.chunk_key(i) for i in range(HOT)]
    scan_keys = [scan.chunk_key(i) for i in range(5 * N)]
    sequence = []
    for i, k in enumerate(hot_keys):
        rig.clock.advance(1)
        await rig.cache.fill(hot, k, payload(1000 + i))
        sequence.append(k)
    for _ in range(3):  # the working set is re-read a few times
        for k in hot_keys:
            rig.clock.advance(1)
            assert await rig.cache.read(k, 0, 0, touch=True) is not None
            sequence.append(k)
    for i, k in enumerate(scan_keys):  # one pass over 5x the cache, each chunk read once
        rig.clock.advance(1)
        await rig.cache.fill(scan, k, payload(i))
        sequence.append(k)
    return hot_keys, scan_keys, sequence


def lru_survivors(sequence, capacity):
    lru: OrderedDict = OrderedDict()
    for k in sequence:
        lru.pop(k, None)
        lru[k] = True
        while len(lru) > capacity:
            lru.popitem(last=False)
    return set(lru)


async def test_scan_does_not_evict_the_hot_set(tmp_path):
    root = str(tmp_path)
    rig = make_cache(root, cache_size=N * CHUNK, memory_bytes=0)
    try:
        hot_keys, scan_keys, _ = await run_hot_then_scan(rig)
        assert rig.cache.used_bytes <= N * CHUNK
        # the scan's chunks past the free room were refused: none has reads to show
        assert sample(rig.metrics, "tierfs_cache_refused_chunks_total") >= 4 * N
        for i, k in enumerate(hot_keys):
            assert rig.cache.has(k), f"hot chunk {i} was evicted by the scan"
            got, source = await rig.cache.read(k, 0, 0, touch=True)
            assert (got, source) == (payload(1000 + i), "disk")
        # the scan itself was cached as far as the budget allowed
        assert any(rig.cache.has(k) for k in scan_keys)
    finally:
        rig.close()


async def test_plain_lru_would_have_lost_the_hot_set(tmp_path):
    """Not a failure of tierfs: the same sequence under plain LRU with the same capacity
    keeps none of the hot chunks. This is why the disk tier evicts by heat."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, memory_bytes=0)
    try:
        hot_keys, _, sequence = await run_hot_then_scan(rig)
        assert all(rig.cache.has(k) for k in hot_keys)  # heat kept them
    finally:
        rig.close()
    kept_by_lru = lru_survivors(sequence, N)
    assert not kept_by_lru & set(hot_keys)


@pytest.mark.parametrize("half_lives", [1, 6, 13])
async def test_heat_fades_so_a_new_working_set_takes_over(tmp_path, half_lives):
    # heat is not forever: chunks of old hot data unread for long enough (their heat
    # below admission.STALE) give way to any new chunk; before that, to a new chunk read
    # again whose heat, counting the time between the two chunks' last reads beyond
    # LAG_IGNORED, is above MARGIN x theirs; not to a chunk read once
    half_life = 100.0
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, memory_bytes=0,
                     half_life=half_life)
    old = obj("old", HOT)
    new = obj("new", 5 * N)
    try:
        for i in range(HOT):
            await rig.cache.fill(old, old.chunk_key(i), payload(i))
            for _ in range(3):
                await rig.cache.read(old.chunk_key(i), 0, 0, touch=True)
        # heat 4 at t0, 1/2048 (< STALE) after 13 half-lives
        rig.clock.advance(half_lives * half_life + 1)
        for i in range(5 * N):
            await rig.cache.fill(new, new.chunk_key(i), payload(i))
        survived = sum(rig.cache.has(old.chunk_key(i)) for i in range(HOT))
        assert survived == (0 if half_lives == 13 else HOT)
        # the last 2 N chunks of the new data read again, right away (remembered: the
        # history holds 4 N chunks): their heat 1, read 6 half-lives after the old chunks
        # were, counts 2^(6 - 2) = 16 > 2 x 4. Read 1 half-life after, 1 < 2 x 4, but the
        # old chunks are abandoned by then: read in one burst (gaps counted as MIN_GAP
        # cache-fulls of accesses), then not for 5 cache-fulls (admission.ABANDONED)
        for i in range(3 * N, 5 * N):
            await rig.cache.fill(new, new.chunk_key(i), payload(i))
        survived = sum(rig.cache.has(old.chunk_key(i)) for i in range(HOT))
        assert survived == 0
    finally:
        rig.close()


async def test_a_data_set_no_longer_read_gives_way_to_chunks_read_again(tmp_path):
    """The last job's data set, read three times, then not at all while other chunks are
    read: once not read for ABANDONED (3) x its longest gap between reads (15 accesses,
    counted as at least MIN_GAP cache-fulls: 24), 72 accesses, a chunk read before takes
    its place, though the old chunks were read more (heat 3; a new one read at most 5 times
    by then: with no decay, its comparison alone admits it only from its 8th read, heat 7 >
    2 x 3). Counted in accesses, not time: a day without reads in between changes
    nothing."""
    assert (ABANDONED, MIN_GAP) == (3.0, 1.5)
    firsts = []
    for idle in (0.0, 86400.0):
        rig = make_cache(str(tmp_path / str(idle)), cache_size=N * CHUNK, memory_bytes=0,
                         half_life=1e9)  # no decay: heats alone would keep the old set
        old = obj("old", N - 1)  # up to the high watermark: the next chunk must evict
        new = obj("new", N)
        try:
            for i in range(N - 1):  # accesses 1-15
                await rig.cache.fill(old, old.chunk_key(i), payload(i))
            for _ in range(2):  # 16-45
                for i in range(N - 1):
                    assert await rig.cache.read(old.chunk_key(i), 0, 0, touch=True)
            rig.clock.advance(idle)
            access = 45
            while not any(rig.cache.has(new.chunk_key(i)) for i in range(N)):
                access += 1
                assert access < 300
                i = access % N
                await rig.cache.fill(new, new.chunk_key(i), payload(100 + i))
            firsts.append(access)
        finally:
            rig.close()
    # the first old chunk the new ones meet was last read at access 31-45: 72 more
    assert firsts[0] == firsts[1] and 31 + 72 - 2 <= firsts[0] <= 45 + 72 + 1


def test_the_least_recently_read_abandoned_chunk_is_offered_to_a_chunk_read_before():
    """Where the coldest chunk is not abandoned (heat hardly decays: it is the new data
    set's own), a refused chunk read before takes the room of the least recently read
    abandoned one (Placement._room_of_refused); one that cannot go (pinned, being written)
    moves to the back."""
    # a gap counts as at least MIN_GAP x 10 = 15 accesses: 3 x 15
    adm = Admission(1e9, 10, 10 * CHUNK)
    rec = ChunkRecord(CHUNK, 1.0, 0.0, ())
    a, b, c, x = (bytes([n]) * 20 for n in b"abcx")
    for key in (a, b, c):  # stored at accesses 1-3
        adm.accessed()
        adm.entry_heat(key, Fill.READ, 0.0, CHUNK)
    for key in (a, b, c, a):  # read at 4-7: gaps of 3
        adm.read(key, rec)
        adm.accessed()
    anything = lambda key: True  # noqa: E731
    assert adm.replaceable(x, anything, False) is None  # x was never read: no claim
    adm.refused(x, 0.0)
    for _ in range(50 - 7):
        adm.accessed()
    assert adm.replaceable(x, anything, False) is None  # b, the least recently read: 45 ago
    adm.accessed()
    assert adm.replaceable(x, anything, False) == (b, "abandoned")  # 46 > 3 x 15
    adm.accessed()
    # b cannot go: to the back
    assert adm.replaceable(x, lambda key: key != b, False) == (c, "abandoned")
    adm.dropped(c)
    assert adm.replaceable(x, anything, False) is None  # a, read at 7, is next: 45 ago


def test_lru_shadow_holds_the_keys_plain_lru_would_in_bytes():
    lru = LruShadow(2 * CHUNK)
    a, b, c = (bytes([n]) * 20 for n in b"abc")
    assert [lru.access(k, CHUNK) for k in (a, b, a, c)] == [False, False, True, False]
    assert a in lru and c in lru and b not in lru  # b, the least recently used, went
    assert lru.access(b, CHUNK) is False and a not in lru
    # small files take their bytes' worth: 8 of CHUNK // 8 fit beside b, c goes
    small = [bytes([n]) * 20 for n in range(8)]
    for key in small:
        lru.access(key, CHUNK // 8)
    assert all(key in lru for key in small) and b in lru and c not in lru
    lru.access(c, 2 * CHUNK)  # as big as the whole: only it stays
    assert c in lru and not any(key in lru for key in small + [b])


def test_the_cache_trails_lru_by_misses_lru_would_hit_less_hits_it_would_miss(monkeypatch):
    """+1 for a miss LRU would have hit, -1 for a hit it would have missed, fading by
    1/chunks per access; trailing above TRAILING x chunks (and TRAILING_MIN: 0 here)."""
    monkeypatch.setattr(admission, "TRAILING_MIN", 0.0)
    adm = Admission(1e9, 50, 50 * CHUNK)  # trailing above 1 (TRAILING 0.02 x 50 chunks)
    assert TRAILING == 0.02
    rec = ChunkRecord(CHUNK, 1.0, 0.0, ())
    a, b, c = (bytes([n]) * 20 for n in b"abc")
    assert adm.missed(a, CHUNK) is False and adm.trail == 0  # new to LRU too
    adm.accessed()
    assert adm.missed(a, CHUNK) is True and adm.trail == 1  # LRU would have hit
    adm.accessed()
    assert adm.trail == pytest.approx(0.98) and not adm.behind_lru
    assert adm.missed(a, CHUNK) and adm.behind_lru
    adm.read(c, rec)  # a hit on a chunk LRU would not hold
    assert adm.trail == pytest.approx(0.98) and not adm.behind_lru
    adm.entry_heat(b, Fill.WRITTEN, 0.0, CHUNK)  # LRU stores written (and warmed) chunks
    adm.read(b, rec)  # so LRU would hit it as well: no change
    assert adm.trail == pytest.approx(0.98)
    monkeypatch.undo()  # fewer than TRAILING_MIN (16) hits ahead is noise
    adm.trail = 16.0
    assert not adm.behind_lru
    adm.trail = 16.5
    assert adm.behind_lru


def test_a_small_cache_never_trails_lru():
    """The count fades by 1/chunks per access, so it never passes the cache's chunk count:
    a cache of at most TRAILING_MIN (16) chunks never trails, however its misses go."""
    adm = Admission(1e9, 16, 16 * CHUNK)
    key = b"k" * 20
    adm.missed(key, CHUNK)
    for _ in range(10_000):
        adm.missed(key, CHUNK)  # LRU hits every time, the cache never
        adm.accessed()
    assert 14.9 < adm.trail < 16.0 and not adm.behind_lru  # its limit: 15


def test_while_the_cache_trails_lru_a_refused_chunk_takes_the_room_lru_let_go(monkeypatch):
    """The least recently read cached chunk, only once LRU no longer holds it, only for a
    chunk LRU would hit or never read before, and only while trailing."""
    monkeypatch.setattr(admission, "TRAILING_MIN", 0.0)  # a cache of 4 chunks
    adm = Admission(1e9, 4, 3 * CHUNK)  # LRU's shadow holds 3 chunks
    rec = ChunkRecord(CHUNK, 1.0, 0.0, ())
    a, b, x, y, z = (bytes([n]) * 20 for n in b"abxyz")
    anything = lambda key: True  # noqa: E731
    for key in (a, b):  # cached: stored, then read once each
        adm.entry_heat(key, Fill.READ, 0.0, CHUNK)
        adm.lru.access(key, CHUNK)
    for key in (b, a):
        adm.read(key, rec)
        adm.accessed()
    adm.refused(x, 0.0)  # x was read before (its history), not LRU-hit yet
    assert adm.replaceable(x, anything, False) is None  # not trailing
    adm.trail = 1.0  # trailing (TRAILING x 4 = 0.08)
    assert adm.replaceable(x, anything, False) is None  # read before, LRU would not hit it
    assert adm.replaceable(x, anything, True) is None  # b, least recently read: LRU holds it
    adm.missed(y, CHUNK)
    adm.missed(z, CHUNK)  # LRU holds a (read last), y and z: b went
    assert b not in adm.lru and a in adm.lru
    assert adm.replaceable(x, anything, True) == (b, "lru")
    assert adm.replaceable(bytes(20), anything, False) == (b, "lru")  # never read before: new data
    assert adm.replaceable(x, lambda key: key != b, True) is None  # b cannot go; a is in LRU
    adm.trail = 0.0
    assert adm.replaceable(x, anything, True) is None


@pytest.mark.parametrize("told", [False, True])
async def test_the_next_job_is_cached_as_lru_caches_it(tmp_path, monkeypatch, told):
    """Job 1 reads its 14 chunks 3 times; job 2 reads 14 others 4 times, no time passing
    (heat does not fade, no chunk is abandoned yet). Heat alone keeps job 1's set (read 3
    times against 1-2): job 2 gets the free room only. LRU would hit job 2's 2nd epoch,
    which the cache misses: trailing LRU, job 2's chunks take the room of job 1's, which
    LRU let go, and its 3rd and 4th epochs hit in full. Told that job 2 started (its first
    open, FileIO -> Admission.job_opened), the cache takes its 1st epoch in as LRU does."""
    per_epoch, yielded = {}, {}
    monkeypatch.setattr(admission, "TRAILING_MIN", 0.0)  # a cache of 16 chunks
    for trailing in (TRAILING, float("inf")):
        monkeypatch.setattr(admission, "TRAILING", trailing)
        rig = make_cache(str(tmp_path / str(trailing)), cache_size=N * CHUNK, memory_bytes=0,
                         half_life=1e9)
        hits = []
        try:
            for job in ("one", "two"):
                if told:
                    rig.cache.admission.job_opened(f"job:{job}")
                o = obj(job, N - 2)
                for _ in range(3 if job == "one" else 4):
                    n = 0
                    for i in range(N - 2):
                        if await rig.cache.read(o.chunk_key(i), 0, 0, touch=True):
                            n += 1
                        else:
                            await rig.cache.fill(o, o.chunk_key(i), payload(i))
                    hits.append(n)
            per_epoch[trailing] = hits
            yielded[trailing] = {why: sample(rig.metrics, "tierfs_cache_yielded_chunks_total",
                                             {"reason": why})
                                 for why in ("abandoned", "lru", "new_job")}
        finally:
            rig.close()
    assert per_epoch[TRAILING][:3] == per_epoch[float("inf")][:3] == [0, 14, 14]
    if told:  # as LRU, whatever the count says: 13 of job 1's chunks gave way (1 free)
        assert per_epoch[TRAILING][3:] == per_epoch[float("inf")][3:] == [0, 14, 14, 14]
        assert yielded[TRAILING] == yielded[float("inf")] == {
            "abandoned": 0, "lru": 0, "new_job": 13}
        return
    assert yielded[float("inf")] == {"abandoned": 0, "lru": 0, "new_job": 0}
    assert yielded[TRAILING] == {"abandoned": 0, "lru": 13, "new_job": 0}
    assert per_epoch[float("inf")][3:] == [0, 1, 1, 1]  # the free room (15 - 14) only
    assert per_epoch[TRAILING][3:5] == [0, 1] and per_epoch[TRAILING][5:] == [14, 14]


def test_a_restored_checkpoints_room_is_kept_from_readers_for_the_next_save():
    """For a cache-full of accesses after its restore, a written chunk read once is not
    the room of a reader's chunk however often that one was read; after, the comparison
    decides (a restored chunk ranks below one read)."""
    adm = Admission(1e9, 10, 10 * CHUNK)  # kept for 10 accesses
    w, x = bytes(20), b"x" * 20
    adm.entry_heat(w, Fill.WRITTEN, 0.0, CHUNK)
    adm.read(w, ChunkRecord(CHUNK, 0.0, 0.0, ()))  # the restore, at access 1
    adm.accessed()
    restored = ChunkRecord(CHUNK, RESTORED, 0.0, ())
    for _ in range(9):  # x read 9 times while out of the cache: heat 9
        adm.refused(x, 0.0)
        assert not adm.admits(x, CHUNK, w, restored, 0.0)
        adm.accessed()
    assert adm.accesses == 10 and not adm.admits(x, CHUNK, w, restored, 0.0)
    adm.accessed()  # 10 accesses after the restore
    assert adm.admits(x, CHUNK, w, restored, 0.0)
    # a chunk read twice since it was written is data like any other: no room kept
    adm.read(w, restored)
    assert adm.admits(x, CHUNK, w, ChunkRecord(CHUNK, RESTORED + 1, 0.0, ()), 0.0)


def test_a_new_jobs_data_takes_the_room_lru_let_go_of_chunks_not_read_since_it_started():
    """For a cache-full of accesses after a Slurm job or pod not seen before opens its first
    file, a chunk never read before takes the room of the least recently read chunk, if
    LRU no longer holds it and it was not read since the job started. A chunk read before
    does not (its claim is the count's), nor do users' reads, nor a job seen already."""
    adm = Admission(1e9, 4, 3 * CHUNK)  # LRU's shadow holds 3 chunks
    rec = ChunkRecord(CHUNK, 1.0, 0.0, ())
    a, b, c, new, old = (bytes([n]) * 20 for n in b"abcno")
    anything = lambda key: True  # noqa: E731
    for key in (a, b, c):  # cached at accesses 0, 1, 2
        adm.entry_heat(key, Fill.READ, 0.0, CHUNK)
        adm.lru.access(key, CHUNK)
        adm.accessed()
    adm.refused(old, 0.0)  # read before
    for key in (b"x" * 20, b"y" * 20, b"z" * 20):
        adm.missed(key, CHUNK)  # LRU now holds x, y, z only
    assert not adm.behind_lru and adm.replaceable(new, anything, False) is None
    adm.job_opened("uid:1000")
    assert adm.new_job_at == -1 and adm.replaceable(new, anything, False) is None
    adm.job_opened("job:7")
    assert adm.new_job_at == 3
    assert adm.replaceable(old, anything, False) is None  # read before: not the new job's data
    assert adm.replaceable(new, anything, False) == (a, "new_job")
    adm.read(a, rec)  # read since the job started (access 4): stays
    adm.accessed()
    assert adm.replaceable(new, anything, False) == (b, "new_job")
    for _ in range(3):  # accesses 7: the window (a cache-full, 4) is over
        adm.accessed()
    assert adm.replaceable(new, anything, False) is None  # b and c would qualify in it
    adm.job_opened("job:7")  # seen: no new window
    assert adm.new_job_at == 3
    adm.job_opened("pod:0b6b9c3e-5c1a-4f0e-9d2b-1a2b3c4d5e6f")
    assert adm.new_job_at == adm.accesses == 7
    assert adm.replaceable(new, anything, False) == (b, "new_job")


async def test_a_big_chunk_never_takes_the_room_of_small_files(tmp_path):
    """The room a refused chunk may take (abandoned, or let go by LRU: here a new job's
    window) is one chunk at least its size: 20 label files of 512 bytes, the least recently
    read, stay; the job's new 4 KiB chunks take the room of older 4 KiB ones (decision 3c:
    a miss costs as much per file, whatever its size)."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, memory_bytes=0, half_life=1e9)
    labels, old, new = obj("labels", 20), obj("old", 12), obj("new", 8)
    try:
        for i in range(20):
            await rig.cache.fill(labels, labels.chunk_key(i), bytes(512))
        for i in range(12):
            await rig.cache.fill(old, old.chunk_key(i), payload(i))
        rig.cache.opened_by("job:2")
        for i in range(8):
            await rig.cache.fill(new, new.chunk_key(i), payload(100 + i))
        assert all(rig.cache.has(labels.chunk_key(i)) for i in range(20))
        cached_new = sum(rig.cache.has(new.chunk_key(i)) for i in range(8))
        cached_old = sum(rig.cache.has(old.chunk_key(i)) for i in range(12))
        assert cached_new > 0 and cached_old == 12 - cached_new
    finally:
        rig.close()


def test_a_refused_read_passes_over_at_most_skipped_max_chunks():
    """Chunks that cannot give their room (smaller than the incoming one, pinned) go to the
    back of the order, at most SKIPPED_MAX + 1 looked at a call: a refused read does not
    walk every label file in the cache."""
    assert SKIPPED_MAX == 64
    adm = Admission(1e9, 100, CHUNK)  # LRU's shadow: one chunk
    keys = [i.to_bytes(20, "big") for i in range(100)]
    for key in keys:
        adm.entry_heat(key, Fill.READ, 0.0, CHUNK)
        adm.accessed()
    adm.job_opened("job:1")
    big = keys[-1]
    looked = []

    def only_the_last(key):
        looked.append(key)
        return key == big
    new = b"n" * 20
    assert adm.replaceable(new, only_the_last, False) is None and len(looked) == 65
    assert adm.replaceable(new, only_the_last, False) == (big, "new_job")  # 35 more, then it


async def test_a_slurm_jobs_first_open_is_told_to_admission(tmp_path):
    """FileIO.open: the caller as a reader (tierfs/telemetry/callers.py, here a fake /proc)."""
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_42/step_0\n")
    async with core(str(tmp_path)) as rig:
        write(rig.src, "a", b"x" * 100)
        rig.io.callers = Callers(proc=str(proc))
        node = await resolve(rig.ns, "a")
        adm = rig.cache_rig.cache.admission
        h, _ = await rig.io.open(node.ino, pid=78, uid=1000)  # no such process: uid:1000
        await rig.io.release(h.fh)
        assert adm.new_job_at == -1
        h, _ = await rig.io.open(node.ino, pid=77, uid=1000)
        assert h.reader == "job:42" and adm.new_job_at == adm.accesses
        await rig.io.release(h.fh)


async def test_refused_fills_do_not_sort_the_index_each_time(tmp_path):
    # a scan refused chunk after chunk compares each with the coldest chunk the last sort
    # found (nothing changed since): one sort of the index, not one per chunk. A read of
    # that chunk makes it hotter: the next fill sorts again and sees the new coldest.
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, memory_bytes=0)
    sorts = 0
    coldest = rig.cache.policy.coldest

    def counting(*args, **kwargs):
        nonlocal sorts
        sorts += 1
        return coldest(*args, **kwargs)
    rig.cache.policy.coldest = counting
    hot, scan = obj("hot", N), obj("scan", 4 * N)
    try:
        for i in range(N - 1):  # 15 chunks: just below the high watermark
            rig.clock.advance(1)
            await rig.cache.fill(hot, hot.chunk_key(i), payload(i))
        assert sorts == 0  # the free room: nothing to evict, no admission test
        for i in range(4 * N):
            rig.clock.advance(1)
            await rig.cache.fill(scan, scan.chunk_key(i), payload(i))
        assert sample(rig.metrics, "tierfs_cache_refused_chunks_total") == 4 * N
        assert sorts == 1
        # the coldest cached chunk is read (and so are the others but one): the next
        # refusal is against the one left cold
        cached = [i for i in range(N) if rig.cache.has(hot.chunk_key(i))]
        assert cached == list(range(N - 1))
        for i in cached[:-1]:
            rig.clock.advance(1)
            assert await rig.cache.read(hot.chunk_key(i), 0, 0, touch=True) is not None
        refused = sample(rig.metrics, "tierfs_cache_refused_chunks_total")
        rig.clock.advance(1)
        await rig.cache.fill(scan, scan.chunk_key(0), payload(0))
        assert sorts == 2
        assert sample(rig.metrics, "tierfs_cache_refused_chunks_total") == refused + 1
    finally:
        rig.close()


async def test_an_unread_written_chunk_gives_way_only_to_a_chunk_read_more(tmp_path,
                                                                          monkeypatch):
    # written chunks are stored at heat 0 (heat counts reads) and rank as UNREAD_WRITTEN
    # reads at their write: a reader's chunk gets their room once it was read more than
    # MARGIN times that while out of the cache (and the oldest written go first). The
    # comparison alone: in a cache of 16 chunks, one miss LRU would hit makes the cache
    # trail LRU, and this chunk would get the room at its 3rd read (tested below)
    monkeypatch.setattr(admission, "TRAILING", float("inf"))
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, memory_bytes=0)
    ckpt, data = obj("ckpt", N - 1), obj("data", 1)
    try:
        for i in range(N - 1):
            rig.clock.advance(1)
            await rig.cache.fill(ckpt, ckpt.chunk_key(i), payload(i), Fill.WRITTEN)
        tries = 0
        while not rig.cache.has(data.chunk_key(0)):
            rig.clock.advance(1)
            await rig.cache.fill(data, data.chunk_key(0), payload(99))
            tries += 1
        assert tries == MARGIN * UNREAD_WRITTEN + 2  # refused with no history, then 1..8
        assert sample(rig.metrics, "tierfs_cache_refused_chunks_total") == tries - 1
        gone = [i for i in range(N - 1) if not rig.cache.has(ckpt.chunk_key(i))]
        assert gone and gone == list(range(len(gone)))  # the oldest written first
    finally:
        rig.close()


async def _write(rig, version: ObjectVersion, chunks: range) -> None:
    """What the write path does: each chunk's unsaved copy reserved, then, the object
    uploaded, the chunks moved into that room (last first)."""
    for _ in chunks:
        rig.clock.advance(1)
        assert await rig.cache.reserve_dirty(CHUNK, 1, key=version.key)
    rig.cache.hold(len(chunks) * CHUNK, key=version.key)
    for i in reversed(chunks):
        rig.clock.advance(1)
        await rig.cache.fill(version, version.chunk_key(i), payload(i), Fill.WRITTEN,
                             held=CHUNK)


async def test_a_checkpoint_takes_the_room_of_the_last_one_restored_not_the_data(tmp_path):
    """Decision 3e: a write's room comes first from written chunks read at most once,
    oldest first, one for one, so the data set read twice stays whole; a written chunk
    read twice is data like any other."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    data, first, second, third = obj("data", 10), obj("ckpt/1", 4), obj("ckpt/2", 4), obj("ckpt/3", 4)
    try:
        for i in range(10):
            rig.clock.advance(1)
            await rig.cache.fill(data, data.chunk_key(i), payload(i))
            rig.cache.touch(data.chunk_key(i))
        await _write(rig, first, range(4))
        for i in range(4):  # its restore
            rig.clock.advance(1)
            rig.cache.touch(first.chunk_key(i))
        rig.cache.touch(first.chunk_key(3))  # read twice: data now
        await _write(rig, second, range(4))
        assert all(rig.cache.has(data.chunk_key(i)) for i in range(10))
        assert all(rig.cache.has(second.chunk_key(i)) for i in range(4))
        assert [rig.cache.has(first.chunk_key(i)) for i in range(4)] == [False] * 3 + [True]
        assert rig.cache.dirty_bytes == 0
        # unread, the second is what the third takes (a read between the saves), oldest
        # first; one more needs room from the data: the coldest read chunk (first's chunk
        # 3 was read after the data)
        rig.clock.advance(1)
        rig.cache.touch(data.chunk_key(9))
        await _write(rig, third, range(4))
        assert not any(rig.cache.has(second.chunk_key(i)) for i in range(4))
        assert all(rig.cache.has(third.chunk_key(i)) for i in range(4))
        assert all(rig.cache.has(data.chunk_key(i)) for i in range(10))
        assert sample(rig.metrics, "tierfs_cache_evictions_total") == 7
    finally:
        rig.close()


async def test_a_checkpoint_does_not_take_its_own_room(tmp_path):
    """The files of one save, written with no read between them: a later file does not
    take an earlier one's room when the save before left less than it needs (the data
    read most long ago goes instead), so the newest checkpoint stays whole."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    data, old = obj("data", 12), obj("ckpt/1/shard", 1)
    shards = [obj(f"ckpt/2/shard-{i}", 2) for i in range(2)]
    try:
        await _write(rig, old, range(1))
        for i in range(12):
            rig.clock.advance(1)
            await rig.cache.fill(data, data.chunk_key(i), payload(i))
            rig.cache.touch(data.chunk_key(i))
        for shard in shards:
            await _write(rig, shard, range(2))
        assert not rig.cache.has(old.chunk_key(0))
        assert all(rig.cache.has(s.chunk_key(i)) for s in shards for i in range(2))
        assert not rig.cache.has(data.chunk_key(0))
    finally:
        rig.close()


async def test_the_room_writes_take_first_survives_a_restart(tmp_path):
    """The written chunks read at most once are found again after a restart (heat below 1
    in the index), oldest stored first (a file's chunks move last first)."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    old, new, data = obj("old", 4), obj("new", 4), obj("data", 7)
    try:
        await _write(rig, old, range(4))
        await _write(rig, new, range(4))
        for i in range(7):
            rig.clock.advance(1)
            await rig.cache.fill(data, data.chunk_key(i), payload(i))
        await rig.cache.flush_index()
    finally:
        rig.close()
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK, clock=rig.clock)
    try:
        assert rig.cache.recover() == (15, 0)
        await _write(rig, obj("next", 2), range(2))
        assert [rig.cache.has(old.chunk_key(i)) for i in range(4)] == [True, True, False, False]
        assert all(rig.cache.has(new.chunk_key(i)) for i in range(4))
        assert all(rig.cache.has(data.chunk_key(i)) for i in range(7))
    finally:
        rig.close()


async def test_a_small_file_outlasts_big_chunks_read_as_often(tmp_path):
    """heat.value: a miss costs a GET's first-byte latency whatever the chunk's size, so
    per byte of room a small file is worth more: filled (read once) as early as a big chunk
    that goes, it stays while a cache's worth of later big chunks passes through."""
    rig = make_cache(str(tmp_path), cache_size=N * CHUNK)
    labels = [ObjectVersion("bucket", f"labels/{i}", "etag", 256) for i in range(4)]
    early = obj("early", 4)
    later = obj("later", 3 * N)
    try:
        for i, label in enumerate(labels):
            rig.clock.advance(1)
            await rig.cache.fill(label, label.chunk_key(0), payload(i)[:256], Fill.WARM)
            await rig.cache.fill(early, early.chunk_key(i), payload(i), Fill.WARM)
        for i in range(3 * N):
            rig.clock.advance(1)
            await rig.cache.fill(later, later.chunk_key(i), payload(i), Fill.WARM)
        assert sample(rig.metrics, "tierfs_cache_evictions_total") > 4
        assert all(rig.cache.has(label.chunk_key(0)) for label in labels)
        assert not any(rig.cache.has(early.chunk_key(i)) for i in range(4))
    finally:
        rig.close()
