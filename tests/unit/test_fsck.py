"""`tierfs fsck --cache-dir DIR [--repair] [--json]`, run as the command a user runs.

Every run is a child process (`python -m tierfs fsck`): exit status, stdout lines and the
one-line errors are what is checked, and a damaged index cannot take pytest down with it.
"""

import fcntl
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tierfs.cache.disk import DiskTier
from tierfs.cache.keys import ObjectVersion, chunk_name
from tierfs.index.journal import HEADER
from tierfs.index.attrs import FILE
from tierfs.index.chunks import ChunkRecord
from tierfs.index.inodes import ROOT_INO
from tierfs.index.meta import MetaStore

SRC = "s3://bucket/"
BLOCK = 4096
OBJ = ObjectVersion("bucket", "data.bin", "etag1", 10 * 9000)


def chunk_bytes(i: int) -> bytes:
    return random.Random(i).randbytes(9000)


def build(root: Path) -> dict:
    """A healthy cache dir: 6 chunks, one journaled file with its staging file."""
    meta = MetaStore(str(root / "index"), SRC, map_size=64 << 20)
    disk = DiskTier(str(root), BLOCK)
    puts = {}
    for i in range(6):
        crcs = disk.write(OBJ.chunk_key(i), chunk_bytes(i))
        puts[OBJ.chunk_key(i)] = ChunkRecord(9000, 1.0, 1.0, crcs)
    meta.chunks.apply(puts, [])
    f = meta.inodes.upsert(ROOT_INO, b"ckpt.pt", FILE, 0, 1.0, "", "ckpt.pt", 1.0)
    os.makedirs(root / "dirty", exist_ok=True)
    staging = root / "dirty" / f"{f.ino}-abc"
    staging.write_bytes(b"unsaved")
    meta.put_dirty(f.ino, {"key": "ckpt.pt", "base": None, "base_valid": 0, "size": 7,
                           "staging": str(staging), "materialized": [0], "metadata": {},
                           "upload_id": None})
    meta.close()
    return {"staging": staging, "ino": f.ino}


def chunk_path(root: Path, i: int) -> Path:
    name = chunk_name(OBJ.chunk_key(i))
    return root / "chunks" / name[:2] / name


def fsck(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", "fsck", "--cache-dir", str(root),
                           *args], capture_output=True, text=True, timeout=120)


def test_a_clean_cache_dir_is_clean(tmp_path):
    root = tmp_path / "cache"
    build(root)
    r = fsck(root)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and "6 chunk files" in lines[0] and "1 journaled files" in lines[0]
    assert "0 problems" in lines[0] and r.stderr == ""


def damage(root: Path) -> None:
    """One of each problem fsck knows about chunks and staging files."""
    p = chunk_path(root, 0)  # a flipped byte in block 1
    data = bytearray(p.read_bytes())
    data[BLOCK + 7] ^= 0x10
    p.write_bytes(data)
    os.truncate(chunk_path(root, 1), 100)  # wrong size
    os.unlink(chunk_path(root, 2))  # missing
    orphan = chunk_path(root, 2).parent / "00ff.3"  # a file the index does not know
    orphan.write_bytes(b"x")
    (root / "tmp" / "half-written").write_bytes(b"y")
    (root / "dirty" / "77-unjournaled").write_bytes(b"never acknowledged")


def test_damage_is_reported_one_line_per_problem(tmp_path):
    root = tmp_path / "cache"
    build(root)
    damage(root)
    r = fsck(root)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    problems, summary = lines[:-1], lines[-1]
    assert "6 problems" in summary
    text = "\n".join(problems)
    assert len(problems) == 6
    assert f"{chunk_path(root, 0)}: block 1 fails its CRC" in text
    assert f"{chunk_path(root, 1)}: 100 bytes, the index says 9000" in text
    assert f"{chunk_name(OBJ.chunk_key(2))}: indexed, but its file is missing" in text
    assert "00ff.3: chunk file the index does not know" in text
    assert "half-written: left in tmp/" in text
    assert "77-unjournaled: not journaled" in text
    # nothing was changed without --repair
    assert (root / "dirty" / "77-unjournaled").exists() and chunk_path(root, 0).exists()


def test_repair_fixes_what_it_found_and_keeps_unsaved_data(tmp_path):
    root = tmp_path / "cache"
    built = build(root)
    damage(root)
    r = fsck(root, "--repair", "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # every problem repaired
    report = json.loads(r.stdout)
    assert len(report["problems"]) == 6 and report["unrepaired"] == 0
    assert all(p["repaired"] for p in report["problems"])
    assert {p["kind"] for p in report["problems"]} == {"chunk", "orphan", "staging"}
    # the journaled file's staging file is untouched; the unjournaled one is gone
    assert built["staging"].read_bytes() == b"unsaved"
    assert not (root / "dirty" / "77-unjournaled").exists()
    assert not chunk_path(root, 0).exists() and chunk_path(root, 3).exists()
    again = fsck(root)
    assert again.returncode == 0 and "0 problems" in again.stdout
    assert "3 chunk files" in again.stdout
    m = MetaStore(str(root / "index"), SRC, map_size=64 << 20)  # and a mount would start
    try:
        assert [ino for ino, _ in m.journal.dirty_records()] == [built["ino"]]
    finally:
        m.close()


def test_json_output_of_a_clean_dir(tmp_path):
    root = tmp_path / "cache"
    build(root)
    r = fsck(root, "--json")
    assert r.returncode == 0
    report = json.loads(r.stdout)
    assert report["clean"] is True and report["problems"] == []
    assert report["chunks_checked"] == 6 and report["bytes_checked"] == 6 * 9000
    assert report["journaled_files"] == 1


def test_a_dir_in_use_by_a_daemon_is_refused(tmp_path):
    root = tmp_path / "cache"
    build(root)
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running daemon holds it
        os.pwrite(fd, b"4242\n", 0)
        r = fsck(root, "--repair")
    finally:
        os.close(fd)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        f"tierfs: error: cache dir {root} is in use by a running tierfs (pid 4242): "
        "unmount it first"]


def test_bad_input_is_one_error_line(tmp_path):
    for args in (["--cache-dir", str(tmp_path / "nope")], ["--cache-dir", str(tmp_path)]):
        r = subprocess.run([sys.executable, "-m", "tierfs", "fsck", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("tierfs: error:")
        assert "Traceback" not in r.stderr


def test_a_damaged_journal_is_reported_and_repaired_without_deleting_staging_files(tmp_path):
    root = tmp_path / "cache"
    built = build(root)
    jpath = root / "journal"
    data = bytearray(jpath.read_bytes())
    data[len(HEADER) + 25] ^= 0x01  # the only record: the journaled file's
    jpath.write_bytes(data)
    r = fsck(root)
    assert r.returncode == 1
    assert f"journal: {jpath}: bytes" in r.stdout and "fail their checksum" in r.stdout
    assert "not in the journal, which was damaged or missing" in r.stdout

    r = fsck(root, "--repair")
    assert r.returncode == 0, r.stdout
    kept = root / "lost+found" / built["staging"].name
    assert kept.read_bytes() == b"unsaved"  # moved aside for a human, never deleted
    assert [n for n in os.listdir(root) if n.startswith("journal.damaged-")]
    m = MetaStore(str(root / "index"), SRC, map_size=64 << 20)  # the mount starts again
    m.close()
    assert fsck(root).returncode == 0


def test_a_damaged_index_is_moved_aside_and_rebuilt(tmp_path):
    root = tmp_path / "cache"
    build(root)
    data = root / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    r = fsck(root)
    assert r.returncode == 1
    assert f"index: {root / 'index'}: damaged: " in r.stdout
    r = fsck(root, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [n for n in os.listdir(root) if n.startswith("index.damaged-")]
    r = fsck(root)
    assert r.returncode == 0, r.stdout
