"""A damaged chunk index is survived: moved aside with one WARNING, the cache starts over
(chunk files re-adopted from what can be salvaged, or dropped), and the write-back
journal - kept apart from the index - loses nothing.

Opening a damaged LMDB file can kill the process (SIGBUS, SIGABRT): every open of a
damaged index here runs in a child process, so a failure of the probe shows up as that
child's exit status instead of killing pytest.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import trio

from tierfs.index import probe as probemod
from tierfs.backend.file import FileBackend
from tierfs.cache.disk import DiskTier
from tierfs.cache.keys import ObjectVersion
from tierfs.errors import BackendError
from tierfs.index.attrs import DIR, FILE
from tierfs.index.chunks import ChunkRecord
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore
from tierfs.index.probe import check_meta_pages

from unitkit import core

SRC = "s3://bucket/"
BLOCK = 4096
CHUNKS = 24
MARK = b"inode-file-"


def chunk_bytes(i: int) -> bytes:
    return random.Random(i).randbytes(3 * BLOCK + 100)


def build(root: Path) -> dict:
    """A healthy cache dir: chunk files and their records, a few thousand inodes, and one
    journaled file with unsaved writes (its staging file in dirty/)."""
    meta = MetaStore(str(root / "index"), SRC, map_size=64 << 20)
    disk = DiskTier(str(root), BLOCK)
    obj = ObjectVersion("bucket", "data.bin", "etag1", CHUNKS * len(chunk_bytes(0)))
    puts = {}
    for i in range(CHUNKS):
        key = obj.chunk_key(i)
        crcs = disk.write(key, chunk_bytes(i))
        puts[key] = ChunkRecord(len(chunk_bytes(i)), 1.0, 1.0, crcs)
    meta.chunks.apply(puts, [], {obj.oid: {"bucket": "bucket", "key": "data.bin",
                                           "etag": "etag1", "size": obj.size}})
    meta.inodes.store_listing(ROOT_INO, [(MARK + b"%05d" % n, FILE, 1, 1.0, "e", f"x{n}")
                                  for n in range(3000)], now=1.0)
    d = meta.inodes.upsert(ROOT_INO, b"ckpt", DIR, 0, 1.0, "", "ckpt/", 1.0)
    f = meta.inodes.upsert(d.ino, b"step9.pt", FILE, 0, 1.0, "", "ckpt/step9.pt", 1.0)
    os.makedirs(root / "dirty", exist_ok=True)
    staging = root / "dirty" / f"{f.ino}-abc"
    staging.write_bytes(b"unsaved")
    rec = {"key": "ckpt/step9.pt", "base": None, "base_valid": 0, "size": 7,
           "staging": str(staging), "materialized": [0], "metadata": {}, "upload_id": None}
    meta.put_dirty(f.ino, rec)
    meta.close()
    return {"dir_ino": d.ino, "file_ino": f.ino, "record": rec}


# the side of the test that opens a (maybe damaged) index: a child process
CHECK = r"""
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                    format="%(levelname)s %(name)s: %(message)s")
from tierfs.cache import ChunkCache
from tierfs.cache.disk import DiskTier
from tierfs.cache.admission import Admission
from tierfs.cache.evictor import Evictor
from tierfs.cache.memory import MemoryTier
from tierfs.errors import CacheCorrupt
from tierfs.index.attrs import FILE
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore
from tierfs.metrics import Metrics
root = sys.argv[1]
meta = MetaStore(root + "/index", "s3://bucket/", map_size=64 << 20)
disk = DiskTier(root, 4096)
ev = Evictor(root, cache_size=1 << 30, min_free_ratio=0.0, high=0.95, low=0.9, half_life=60.0)
cache = ChunkCache(meta, disk, MemoryTier(0), ev, Metrics(),
                   admission=Admission(60.0, 1024, 1 << 30))
kept, dropped = cache.recover()
chunks = {}
for key, rec in meta.chunks.all():
    try:
        data = disk.read_blocks(key, rec.length, rec.crcs, 0, cache.blocks_of(rec.length) - 1)
        chunks[key.hex()] = data.hex()
    except CacheCorrupt:
        chunks[key.hex()] = None
d = meta.inodes.child(ROOT_INO, b"ckpt")
f = meta.inodes.child(d.ino, b"step9.pt") if d is not None else None
new = meta.inodes.upsert(ROOT_INO, b"brand-new", FILE, 1, 1.0, "e", "brand-new", 2.0)
print(json.dumps({"kept": kept, "dropped": dropped, "chunks": chunks,
                  "dirty": meta.journal.dirty_records(), "dir_ino": d and d.ino,
                  "file_ino": f and f.ino, "new_ino": new.ino}))
meta.close()
"""


def check(root: Path) -> tuple[dict, list[str]]:
    """Open the cache dir in a child as a mount does; (what it found, its WARNING lines)."""
    r = subprocess.run([sys.executable, "-c", CHECK, str(root)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"the opening process died ({r.returncode}): {r.stderr[-2000:]}"
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("WARNING")]
    return json.loads(r.stdout), warnings


def data_mdb(root: Path) -> Path:
    return root / "index" / "data.mdb"


def truncate(root: Path) -> None:
    p = data_mdb(root)
    os.truncate(p, p.stat().st_size // 2)


def garbage_in_the_middle(root: Path) -> None:
    """16 KiB of garbage over pages in use, in the middle of the file."""
    p = data_mdb(root)
    raw = p.read_bytes()
    hits = []
    pos = raw.find(MARK)
    while pos != -1:
        hits.append(pos)
        pos = raw.find(MARK, pos + 4096)
    where = hits[len(hits) // 2] // 4096 * 4096
    with open(p, "r+b") as f:
        f.seek(where)
        f.write(random.Random(16).randbytes(16 << 10))


def wrong_lmdb_version(root: Path) -> None:
    p = data_mdb(root)
    with open(p, "r+b") as f:
        for page in (0, 4096):
            f.seek(page + 16 + 4)  # page header, then magic, then the format version
            f.write((999).to_bytes(4, "little"))


def not_lmdb(root: Path) -> None:
    data_mdb(root).write_bytes(b"this is not an LMDB file\n" * 1000)


@pytest.mark.parametrize("damage", [truncate, garbage_in_the_middle, wrong_lmdb_version,
                                    not_lmdb], ids=lambda f: f.__name__)
def test_a_damaged_index_is_moved_aside_and_the_journal_keeps_its_files(tmp_path, damage):
    root = tmp_path / "cache"
    built = build(root)
    damage(root)

    got, warnings = check(root)

    # one clear line, naming what was wrong and where the old index went
    assert len(warnings) == 1, warnings
    assert "is damaged" in warnings[0] and "moved to" in warnings[0]
    aside = [n for n in os.listdir(root) if n.startswith("index.damaged-")]
    assert len(aside) == 1 and aside[0] in warnings[0]
    # the unsaved writes: still journaled, their file still found by name, its number kept
    assert got["dirty"] == [[built["file_ino"], built["record"]]]
    assert (root / "dirty" / f"{built['file_ino']}-abc").read_bytes() == b"unsaved"
    assert (got["dir_ino"], got["file_ino"]) == (built["dir_ino"], built["file_ino"])
    assert got["new_ino"] > built["file_ino"]  # never handed out again
    # chunk files: re-adopted ones serve exactly their bytes (or fail their CRC and are
    # refetched), the rest are gone from disk
    obj = ObjectVersion("bucket", "data.bin", "etag1", 0)
    want = {obj.chunk_key(i).hex(): chunk_bytes(i).hex() for i in range(CHUNKS)}
    for key, data in got["chunks"].items():
        assert data is None or data == want[key]
    on_disk = {f for _, _, files in os.walk(root / "chunks") for f in files}
    assert len(on_disk) == got["kept"] == len(got["chunks"])
    assert got["kept"] + got["dropped"] == CHUNKS
    if damage is garbage_in_the_middle:  # over inode pages only: every chunk is salvaged
        assert f"{CHUNKS} chunk records salvaged" in warnings[0]
        assert got["kept"] == CHUNKS and None not in got["chunks"].values()
    # and the next start finds a healthy index: nothing more is moved aside
    again, warnings = check(root)
    assert warnings == [] and again["kept"] == got["kept"]
    assert again["file_ino"] == built["file_ino"]


def test_a_missing_index_starts_empty_and_keeps_the_journal(tmp_path):
    root = tmp_path / "cache"
    built = build(root)
    shutil.rmtree(root / "index")
    got, _ = check(root)
    assert got["dirty"] == [[built["file_ino"], built["record"]]]
    assert got["file_ino"] == built["file_ino"] and got["new_ino"] > built["file_ino"]
    assert got["kept"] == 0 and got["dropped"] == CHUNKS  # no record vouches for them
    assert not list((root / "chunks").rglob("*.*"))


def test_a_probe_started_early_is_used_only_for_the_file_it_walked(tmp_path):
    """The daemon starts the index walk before its bucket check (meta.start_probe): damage
    is still found, and a file that changed after the walk began is walked again."""
    healthy, damaged, changed = (tmp_path / n for n in ("healthy", "damaged", "changed"))
    for root in (healthy, damaged, changed):
        build(root)
    garbage_in_the_middle(damaged)
    for root in (healthy, damaged, changed):
        probemod.start_probe(str(root / "index"))
    garbage_in_the_middle(changed)  # before or after its early walk read it: found either way
    assert probemod.probe_index(str(healthy / "index")) is None
    assert "reading it" in probemod.probe_index(str(damaged / "index"))
    assert "reading it" in probemod.probe_index(str(changed / "index"))
    probemod.start_probe(str(healthy / "index"))
    probemod.stop_probes()  # a start-up that failed before opening the index: reaped
    assert probemod._early == {}


def test_meta_page_check_catches_truncation_without_mapping_the_file(tmp_path):
    root = tmp_path / "cache"
    build(root)
    assert check_meta_pages(str(data_mdb(root))) is None
    truncate(root)
    assert "truncated" in check_meta_pages(str(data_mdb(root)))
    not_lmdb(root)
    assert "not an LMDB file" in check_meta_pages(str(data_mdb(root)))


# ---- unsaved writes survive the loss of the index (in-process core, write-back) ---------


class FlakyPuts(FileBackend):
    """A FileBackend whose uploads fail while `down` is set."""

    down = True

    def put(self, key, data, metadata=None):
        if self.down:
            raise BackendError(f"injected: store down (put {key})")
        return super().put(key, data, metadata)


async def test_unsaved_writes_are_uploaded_after_the_index_is_lost(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    backend = FlakyPuts(str(src))
    payload = random.Random(5).randbytes(150_000)
    async with core(str(tmp_path), backend=backend, bucket=str(src), writeback=True) as rig:
        h, node = await rig.io.create(ROOT_INO, b"model.pt", 0o644)
        await rig.io.write(h.fh, 0, payload)
        await rig.io.flush(h.fh)  # write-back: acknowledged once journaled
        await rig.io.release(h.fh)
        ino = node.ino
    assert not (src / "model.pt").exists()

    cache = tmp_path / "cache"
    truncate(cache)  # the damage the meta-page check catches in this very process

    async with core(str(tmp_path), backend=backend, bucket=str(src), writeback=True) as rig:
        assert [n for n in os.listdir(cache) if n.startswith("index.damaged-")]
        # before the upload: the name leads to the unsaved bytes, under the same inode
        node = await rig.ns.lookup(ROOT_INO, b"model.pt")
        assert node.ino == ino
        h, _ = await rig.io.open(ino, os.O_RDONLY)
        assert await rig.io.read(h.fh, 0, len(payload) + 10) == payload
        await rig.io.release(h.fh)
        backend.down = False  # the store answers again: the uploader's retry gets it in
        with trio.fail_after(90):
            while not (src / "model.pt").exists() or rig.core.meta.journal.dirty_records():
                await trio.sleep(0.1)
    data = (src / "model.pt").read_bytes()
    assert zlib.crc32(data) == zlib.crc32(payload) and data == payload
