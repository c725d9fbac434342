"""Pins: owners, refcounts, TTLs, persistence, and the evictor leaving pinned chunks alone."""

from __future__ import annotations

from tierfs.cache.admission import Admission
from tierfs.cache.pins import Pins
from tierfs.cache.policy import Placement
from tierfs.index.chunks import ChunkRecord
from tierfs.index.meta import MetaStore
from tierfs.tenants import DEFAULT

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _meta(tmp_path) -> MetaStore:
    return MetaStore(str(tmp_path / "index"), "s3://b/")


def test_owners_share_objects_and_release_independently(tmp_path):
    pins = Pins(_meta(tmp_path))
    pins.add("job:1", {A: 10, B: 20})
    pins.add("job:2", {B: 20})
    assert A in pins and B in pins and C not in pins
    assert pins.release("job:1") == 2
    assert A not in pins and B in pins  # still pinned by job:2
    assert pins.release("job:2") == 1 and B not in pins
    assert pins.release("job:3") == 0


def test_release_objects_drops_them_from_every_owner(tmp_path):
    pins = Pins(_meta(tmp_path))
    pins.add("job:1", {A: 1, B: 1})
    pins.add("manual", {A: 1})
    assert pins.release_objects({A}) == 2
    assert A not in pins and B in pins
    assert set(pins.owners) == {"job:1"}  # "manual" pinned nothing else: gone


def test_pins_persist_except_transient_ones_and_expire(tmp_path):
    now = [1000.0]
    meta = _meta(tmp_path)
    pins = Pins(meta, clock=lambda: now[0])
    pins.add("job:1", {A: 5}, expires=1100.0)
    pins.add("manual", {B: 6})
    pins.add("warm:1", {C: 7})
    pins.add("job:1", {C: 7}, expires=1050.0)  # pinning again never shortens
    meta.close()
    again = Pins(_meta(tmp_path), clock=lambda: now[0])
    assert set(again.owners) == {"job:1", "manual"}
    assert again.owners["job:1"].expires == 1100.0
    assert again.owners["job:1"].objects == {A: 5, C: 7}
    now[0] = 1100.0
    assert again.expire() == ["job:1"]
    assert A not in again and B in again and C not in again


def test_evictor_never_picks_chunks_of_pinned_objects():
    policy = Placement(Admission(60.0, 3, 100), budget=lambda used: 100, high=0.9, low=0.5,
                       half_life=60.0, pinned={A})
    policy.add(A + bytes(4), ChunkRecord(30, 1.0, 0.0, ()), DEFAULT)  # coldest, but pinned
    policy.add(B + bytes(4), ChunkRecord(30, 5.0, 0.0, ()), DEFAULT)
    policy.add(C + bytes(4), ChunkRecord(30, 9.0, 0.0, ()), DEFAULT)
    victims, fits = policy.victims(10)
    assert A + bytes(4) not in victims and victims[0] == B + bytes(4)
    assert fits
