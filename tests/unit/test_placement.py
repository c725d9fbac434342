"""The placement policy (tierfs/cache/policy.py) as a pure object: events in, decisions out.

No LMDB, no chunk files, no trio: a Placement over a fixed budget, its evictions carried
out by hand (`Rig.run`), time given with each event.
"""

from __future__ import annotations

from tierfs.cache.admission import Admission, Fill
from tierfs.cache.keys import ObjectVersion
from tierfs.cache.policy import Outcome, Placement, carry_out
from tierfs.config import parse_tenants
from tierfs.tenants import DEFAULT, TenantMap

CHUNK = 4096
N = 10  # the budget in chunks: high mark 9.5 chunks, low 9


def key(name: str, index: int = 0) -> bytes:
    return ObjectVersion("bucket", name, "etag", 64 * CHUNK).chunk_key(index)


class Rig:
    def __init__(self, tenants: TenantMap | None = None, budget: int = N * CHUNK) -> None:
        self.budget = budget
        self.policy = Placement(Admission(1800.0, N, int(0.95 * N * CHUNK)),
                                budget=lambda used: self.budget, high=0.95, low=0.9,
                                half_life=1800.0, tenants=tenants, pinned=set())
        self.now = 0.0
        self.evicted: list[bytes] = []

    def run(self, plan) -> Outcome:
        """Carry out a decision: each chunk it names is dropped (as ChunkCache.drop does)."""
        def drop(k: bytes, why: str | None) -> None:
            self.evicted.append(k)
            self.policy.dropped(k, evicted=True)
        return carry_out(plan, drop)

    def fill(self, k: bytes, kind: Fill = Fill.WARM, tenant: str = DEFAULT) -> Outcome | None:
        """One fill as ChunkCache.filling makes it (the file written at once); None: the
        chunk is cached or being written already."""
        self.now += 1.0
        if not self.policy.fill_started(k, CHUNK, kind, tenant, self.now):
            return None
        outcome = self.run(self.policy.room_for_fill(k, self.now))
        if outcome is Outcome.STORED:
            self.policy.stored(k, (), self.now)
        self.policy.fill_ended(k)
        return outcome

    def read(self, k: bytes) -> bool:
        self.now += 1.0
        return self.policy.touch(k, self.now) is not None


def test_fills_take_the_free_room_and_are_counted():
    rig = Rig()
    assert [rig.fill(key("a", i)) for i in range(9)] == [Outcome.STORED] * 9
    p = rig.policy
    assert (p.used, p.reserved, len(p.chunks), rig.evicted) == (9 * CHUNK, 0, 9, [])
    assert p.chunks[key("a", 0)].heat == 1.0  # warmed: there to be read
    assert rig.fill(key("a", 0)) is None  # cached already: nothing to decide


def test_a_fill_past_the_high_mark_evicts_the_coldest_down_to_the_low_mark():
    rig = Rig()
    for i in range(9):
        rig.fill(key("a", i))
    for i in range(1, 9):  # chunk 0 is the only one never read
        rig.read(key("a", i))
    assert rig.fill(key("b")) is Outcome.STORED  # a warm: always admitted
    # 10 chunks would pass 9.5: down to 9 - 1 incoming = 8 chunks, the coldest first
    assert rig.evicted == [key("a", 0)]
    assert rig.policy.used == 9 * CHUNK


def test_a_readers_chunk_with_no_reads_to_show_is_refused_then_remembered():
    rig = Rig()
    for i in range(9):
        rig.fill(key("a", i))
        rig.read(key("a", i))
    assert rig.fill(key("scan"), Fill.READ) is Outcome.REFUSED
    assert rig.evicted == [] and key("scan") not in rig.policy.chunks
    assert rig.policy.reserved == 0 and not rig.policy.being_written  # nothing left held
    assert rig.policy.admission.history.last(key("scan")) is not None  # its read remembered


def test_a_written_chunk_enters_unread_and_is_the_room_the_next_write_takes():
    rig = Rig()
    for i in range(6):
        rig.fill(key("data", i))
        rig.read(key("data", i))
    for i in range(3):  # a checkpoint of 3 chunks, at heat 0 (heat counts reads)
        assert rig.fill(key("ckpt1", i), Fill.WRITTEN) is Outcome.STORED
    assert rig.policy.chunks[key("ckpt1", 0)].heat == 0.0
    assert list(rig.policy.written) == [key("ckpt1", i) for i in range(3)]
    rig.read(key("data", 0))  # a read after the save: the checkpoint is an earlier write
    # the next save's unsaved bytes: room from the last checkpoint, oldest first, one for one
    assert rig.run(rig.policy.room_for_dirty(DEFAULT, CHUNK)) is Outcome.STORED
    assert rig.evicted == [key("ckpt1", 0)] and rig.policy.dirty == CHUNK
    rig.policy.release_dirty(DEFAULT, CHUNK)
    assert rig.policy.dirty == 0


def test_pinned_chunks_and_chunks_being_written_never_go():
    rig = Rig()
    for i in range(9):
        rig.fill(key(f"o{i}"))
    rig.policy.pinned = {key("o0")[:16]}
    rig.policy.pin_changed(key("o0")[:16], True)
    assert rig.policy.fill_started(key("new"), CHUNK, Fill.WARM, DEFAULT, 100.0)
    assert key("o0") not in rig.policy.coldest() and key("new") not in rig.policy.coldest()
    assert rig.run(rig.policy.room_for_fill(key("new"), 100.0)) is Outcome.STORED
    assert rig.evicted == [key("o1")]  # the coldest that may go
    assert rig.policy.reserved == CHUNK  # reserved until the fill ends
    rig.policy.fill_ended(key("new"))
    assert rig.policy.reserved == 0


def test_a_tenant_above_its_soft_share_loses_its_chunks_first():
    tmap = parse_tenants({"a": {"prefixes": ["a/"]}, "b": {"prefixes": ["b/"], "soft": "30%"}})
    rig = Rig(tmap)
    for i in range(5):  # b's chunks are the hottest, but b is above 30%
        rig.fill(key(f"b/{i}"), tenant="b")
        rig.read(key(f"b/{i}"))
    for i in range(4):
        rig.fill(key(f"a/{i}"), tenant="a")
    assert rig.policy.shares.over_soft(N * CHUNK) == {"b": 2 * CHUNK}
    rig.fill(key("a/new"), tenant="a")
    assert rig.evicted == [key("b/0")]
    assert rig.policy.shares.counts()["b"].cached == 4 * CHUNK


class Everything:
    def __contains__(self, oid: object) -> bool:
        return True


def test_a_tenant_at_its_hard_share_evicts_only_its_own_or_gets_no_room():
    tmap = parse_tenants({"a": {"prefixes": ["a/"]}, "b": {"prefixes": ["b/"], "hard": "30%"}})
    rig = Rig(tmap)
    for i in range(3):
        rig.fill(key(f"a/{i}"), tenant="a")
        rig.fill(key(f"b/{i}"), tenant="b")
    assert rig.fill(key("b/new"), tenant="b") is Outcome.STORED
    assert rig.evicted and all(k in {key(f"b/{i}") for i in range(3)} for k in rig.evicted)
    assert rig.policy.shares.tally["b"].share_used <= 3 * CHUNK
    rig.policy.pinned = Everything()  # nothing of b's may go now
    assert [rig.fill(key(f"b/more{i}"), tenant="b") for i in range(2)] == [
        Outcome.STORED, Outcome.OVER_HARD]  # the share's last chunk, then no room
    assert rig.fill(key("a/more"), tenant="a") is Outcome.STORED  # a has no hard share


def test_a_budget_the_free_space_guard_shrank_is_kept_even_when_refusing():
    rig = Rig()
    for i in range(9):
        rig.fill(key("a", i))
        rig.read(key("a", i))
    rig.budget = 6 * CHUNK  # someone else filled the cache's filesystem
    assert rig.fill(key("scan"), Fill.READ) is Outcome.REFUSED
    assert rig.policy.used <= 0.95 * 6 * CHUNK and len(rig.evicted) >= 3


def test_chunks_unread_past_their_tenants_max_idle_are_evicted():
    tmap = parse_tenants({"tmp": {"prefixes": ["tmp/"], "max_idle": "1h"}})
    rig = Rig(tmap)
    rig.fill(key("tmp/x"), tenant="tmp")
    rig.fill(key("keep"))
    assert list(rig.policy.idle(rig.now + 100.0)) == []
    assert list(rig.policy.idle(rig.now + 3600.0)) == [(key("tmp/x"), None)]
    assert rig.policy.shares.idle_sweep_interval() == 360.0


def test_unsaved_bytes_held_then_released_leave_the_counts_as_they_were():
    rig = Rig()
    assert rig.run(rig.policy.room_for_dirty(DEFAULT, 3 * CHUNK, shared=False)) \
        is Outcome.STORED
    rig.policy.hold(DEFAULT, 3 * CHUNK)  # uploaded; the staging copy still on disk
    assert (rig.policy.dirty, rig.policy.reserved) == (0, 3 * CHUNK)
    rig.policy.release_held(DEFAULT, CHUNK)
    assert rig.policy.fill_started(key("w"), CHUNK, Fill.WRITTEN, DEFAULT, 5.0, held=True)
    assert rig.run(rig.policy.room_for_fill(key("w"), 5.0)) is Outcome.STORED
    rig.policy.stored(key("w"), (), 5.0)
    rig.policy.fill_ended(key("w"))
    rig.policy.release_held(DEFAULT, 2 * CHUNK)
    assert (rig.policy.used, rig.policy.reserved, rig.policy.dirty) == (CHUNK, 0, 0)
    assert rig.policy.shares.tally[DEFAULT].share_used == CHUNK


def test_the_half_life_follows_a_slow_node_and_admission_follows_it():
    rig = Rig()
    for i in range(N):  # a cache-full of fills, 1000 s apart: PER_CACHE x that is longer
        rig.now += 999.0
        rig.fill(key("slow", i))
    p = rig.policy
    assert p.half_life.value > 1800.0
    assert p.admission.half_life == p.admission.history.half_life == p.half_life.value
