"""bench/evict.py, the eviction-quality benchmark: its OPT and LRU are right on hand-checked
cases, and OPT bounds every policy it is compared with. Its tierfs column is the placement
policy itself (tierfs/cache/policy.py), the object ChunkCache asks: no copy to keep equal.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace

import pytest

from tierfs.cache.heat import RESTORED, UNREAD_WRITTEN, eviction_order, touched

# loaded by path: putting bench/ on sys.path would let its run.py, write.py... shadow names
_SPEC = importlib.util.spec_from_file_location("evict", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "evict.py"))
assert _SPEC is not None and _SPEC.loader is not None
evict = importlib.util.module_from_spec(_SPEC)
sys.modules["evict"] = evict  # dataclasses look their module up
_SPEC.loader.exec_module(evict)

# the textbook reference string (Silberschatz, "Operating System Concepts"): with 3 frames
# LRU faults 12 times of 20, Belady's OPT (always caching the page) 9 times
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def reads(chunks: list[int]) -> evict.Trace:
    return evict.Trace("hand", "hand-checked", chunks, [False] * len(chunks))


def test_next_use_of_each_access():
    assert evict.next_uses([1, 2, 3, 1, 2]) == [3, 4, 5, 5, 5]  # 5: never again


def test_opt_bypasses_a_chunk_needed_after_everything_cached():
    # capacity 2: 3 is never read again, so OPT keeps 1 and 2 and hits both; LRU evicts
    # each just before its reuse
    opt = evict.replay_opt(reads([1, 2, 3, 1, 2]), 2)
    assert (opt.hits, opt.reads, list(opt.hit)) == (2, 5, [0, 0, 0, 1, 1])
    assert evict.replay_lru(reads([1, 2, 3, 1, 2]), 2).hits == 0


def test_opt_and_lru_on_the_textbook_string():
    lru = evict.replay_lru(reads(TEXTBOOK), 3)
    assert lru.reads - lru.hits == 12
    opt = evict.replay_opt(reads(TEXTBOOK), 3)
    # by hand: misses 7 0 1 2 (7 out: next at 17) 3 (1 out: at 13) 4 (bypassed: never
    # again, where the textbook's OPT evicts 0 and faults on it later) 1 (3 out: never
    # again) 7 (bypassed): 8, one fewer than the textbook's 9 which must cache every page
    assert [i for i, h in enumerate(opt.hit) if not h] == [0, 1, 2, 3, 5, 7, 13, 17]
    assert opt.cached == {0, 1, 2}


def test_writes_are_fills_not_reads():
    t = evict.Trace("w", "a write then two reads", [1, 2, 1], [True, False, False])
    for r in (evict.replay_opt(t, 2), evict.replay_lru(t, 2)):
        assert (r.hits, r.reads) == (1, 2)
    with pytest.raises(ValueError):  # a write is a new version: never of a chunk seen before
        evict.Trace("w", "rewrite", [1, 1], [False, True])


def test_lru_with_watermarks_evicts_down_to_keep():
    r = evict.replay_lru(reads([1, 2, 3, 4, 3]), 3, keep=1)
    # 4 finds 1 2 3 cached: 1 and 2 go, 3 stays and is hit
    assert r.cached == {3, 4} and r.hits == 1


def test_the_informed_policy_keeps_the_newest_write_and_the_chunks_it_is_told():
    # capacity 3, one written chunk kept: room for the first 2 of `keep` (9 and 1), never 2
    told = evict.Informed("hand", keep=(9, 1, 2), written=1)
    t = evict.Trace("i", "hand-checked", [1, 2, 10, 1, 2, 10, 11, 10, 11, 9, 9],
                    [False, False, True, False, False, False, True, False, False, False, False],
                    told)
    r = evict.replay_informed(t, 3)
    assert r is not None
    # hits: 1 (kept), 10 (the newest write), 11 (replaced 10), 9's second read
    assert [i for i, h in enumerate(r.hit) if h] == [3, 5, 8, 10]
    assert (r.reads, r.cached) == (9, {1, 9, 11})
    assert evict.replay_informed(reads([1, 1]), 3) is None  # OPT is the reference


def test_an_unread_written_chunk_ranks_as_read_four_times_and_its_restore_below_once():
    # written chunks are stored at heat 0 (admission.entry_heat): heat counts reads only
    hl, size = 1800.0, 8 << 20
    assert eviction_order(0.0, 100.0, hl, size) == eviction_order(UNREAD_WRITTEN, 100.0, hl, size)
    assert eviction_order(1.0, 100.0, hl, size) < eviction_order(0.0, 100.0, hl, size)
    restored = touched(0.0, 100.0, 200.0, hl)
    assert restored == RESTORED < 1.0  # read at most once: the room writes take first
    assert touched(restored, 200.0, 200.0, hl) == RESTORED + 1.0  # read twice: data


def test_restored_checkpoints_hit_and_the_data_set_is_kept():
    """Restores of the last checkpoint hit (LRU's and OPT's 100%): an unread written chunk
    ranks as UNREAD_WRITTEN reads at its write, and a checkpoint takes the room of the
    one before (read at most once: decision 3e), not the data set's, nor its own (here all
    180; at C = 1000 all 1800). The data set's reads hit 31% here (LRU 5%; before decision
    3e, each save pushed out a batch of it and 7% hit at C = 1000)."""
    t = evict.make_trace("checkpoints", 100, seed=15)
    restores = [i for i, c in enumerate(t.chunks) if c >= 200 and not t.writes[i]]
    replay = evict.replay_tierfs(t, evict.Shape(100))
    hits = sum(replay.hit[i] for i in restores)
    assert restores and hits >= 0.9 * len(restores)
    data = [i for i, c in enumerate(t.chunks) if c < 200]
    assert sum(replay.hit[i] for i in data) >= 0.3 * len(data)


def test_admission_keeps_a_loop_where_lru_keeps_nothing():
    """The sequential-epochs trace: LRU evicts each chunk just before its next read; the
    admission policy keeps what the first epoch cached, as OPT does."""
    shape = evict.Shape(100)
    row = evict.measure(evict.make_trace("epochs", 100, seed=15), shape)
    assert row.lru.hits == 0
    assert row.tierfs.hits == row.opt.hits > 0


def test_a_new_jobs_first_epoch_is_a_one_shot_pass_unless_the_job_is_known():
    """jobs and epochs+pass are the same accesses up to the end of the second job's first
    epoch, the pass (same seed); only the second job's first open tells them apart. Not
    told, tierfs decides the same on both, and caching that epoch as LRU does would cost
    epochs+pass's job its set, as it costs LRU: so tierfs stays below LRU on jobs. Told
    (Admission.job_opened), it caches the new job as LRU does and keeps the pass out."""
    shape = evict.Shape(100)
    jobs, other = (evict.make_trace(name, 100, seed=3) for name in ("jobs", "epochs+pass"))
    end = 5 * 80  # 4 epochs over 80 chunks, then 80 new chunks once
    assert jobs.chunks[:end] == other.chunks[:end] and jobs.chunks[end:] != other.chunks[end:]
    assert other.jobs == (0,) and jobs.jobs == (0, 320, 640)
    untold = replace(jobs, jobs=(0,))
    a, b = evict.replay_tierfs(untold, shape), evict.replay_tierfs(other, shape)
    assert a.hit[:end] == b.hit[:end]
    assert evict.replay_tierfs(untold, shape).hits < evict.measure(untold, shape).lru.hits
    for told in (jobs, other):
        row = evict.measure(told, shape)
        assert row.tierfs.hits >= row.lru.hits and row.tierfs.hits >= 0.9 * row.opt.hits


@pytest.mark.parametrize("fill_time", [20.0, 8192.0])
@pytest.mark.parametrize("name", list(evict.TRACES))
def test_opt_bounds_tierfs_and_lru_on_every_trace(name, fill_time):
    shape = evict.Shape(40, fill_time=fill_time)
    row = evict.measure(evict.make_trace(name, shape.chunks, seed=3), shape)
    assert row.trace.reads > 0 and row.opt.hits > 0
    for other in (row.tierfs, row.lru, row.lru_watermarks, row.informed or row.lru):
        assert other.reads == row.opt.reads
        assert other.hits <= row.opt.hits
    assert (row.informed is None) == (name not in ("checkpoints", "zipf"))
    assert len(row.tierfs.cached) <= shape.capacity
    assert row.informed is None or len(row.informed.cached) <= shape.capacity
    assert row.passed == (row.tierfs.hits >= 0.9 * row.opt.hits
                          and row.tierfs.hits >= row.lru.hits)


def test_traces_are_deterministic_for_a_seed():
    for name in evict.TRACES:
        assert evict.make_trace(name, 40, 7) == evict.make_trace(name, 40, 7)


@pytest.mark.parametrize("argv", [["--cache-chunks", "3"], ["--fill-time", "nan"],
                                  ["--pin", "-1"], ["--trace", "nope"]])
def test_bad_options_are_one_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        evict.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("evict.py: error: ")
