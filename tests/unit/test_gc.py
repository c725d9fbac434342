"""`tierfs gc`: a tree of stale and live cache dirs, run as the command a user runs.

The cache dirs are made by tierfs's own code (the journal module writes the journals,
`cachedir.lock_cache_dir` - what the daemon calls - holds the live one's lock, and one
test runs a real file:// mount whose cache dir is under the root); age is set with
utime, the way a week of no use leaves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tierfs.cachedir import lock_cache_dir
from tierfs.config import build_config
from tierfs.cli.gc import DEFAULT_ROOT, TRASH_PREFIX
from tierfs.index.journal import Journal

DAY = 86400
NOBODY = 65534


def daemon_lock(path: Path) -> int:
    """The cache dir's lock, taken by the daemon's own function; the private umask it
    sets for a daemon is given back, so later tests in this process are unaffected."""
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        return lock_cache_dir(str(path))
    finally:
        os.umask(umask)


def tierfs(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd="/")


def gc(root: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """Run `tierfs gc --json`; the verdicts by entry name."""
    r = tierfs("gc", "--cache-root", str(root), "--json", *args)
    assert r.returncode == 0 and r.stderr == "", r
    report = json.loads(r.stdout)
    return r, {os.path.basename(v["path"]): v for v in report["dirs"]} | {"": report}


def age(cache_dir: Path, days: float) -> None:
    """Make a cache dir look unused for `days`: the dir and what a mount writes in it."""
    t = time.time() - days * DAY
    for rel in ("lock", "index/data.mdb", "index/lock.mdb", "journal", "tierfs.log", "."):
        p = cache_dir / rel
        if p.exists():
            os.utime(p, (t, t), follow_symlinks=False)


def cache_dir(root: Path, name: str, *, chunk: bytes = b"c" * 8192,
              dirty: dict[str, bytes] | None = None, leftovers: dict[str, bytes] | None = None,
              uploads: int = 0) -> Path:
    """A cache dir laid out as a daemon lays it out: lock, index, a chunk file and a
    journal (real journal records) whose journaled files own staging files in dirty/."""
    d = root / name
    (d / "index").mkdir(parents=True)
    (d / "lock").write_text("4242\n")
    (d / "index" / "data.mdb").write_bytes(b"\0" * 4096)
    (d / "chunks" / "ab").mkdir(parents=True)
    (d / "chunks" / "ab" / "ab01.0").write_bytes(chunk)
    (d / "dirty").mkdir()
    (d / "tmp").mkdir()
    j = Journal.open(str(d / "journal"))
    for ino, (fname, data) in enumerate((dirty or {}).items(), start=2):
        staging = d / "dirty" / fname
        staging.write_bytes(data)
        j.put_dirty(ino, {"key": f"ckpt/{fname}", "base": None, "base_valid": 0,
                          "size": len(data), "staging": str(staging), "materialized": [0],
                          "metadata": {}, "upload_id": None})
    for n in range(uploads):
        j.put_upload(f"upload-{n}", f"big/{n}")
    j.close()
    for rel, data in (leftovers or {}).items():
        (d / rel).write_bytes(data)
    return d


def listing(*tops: Path) -> dict[str, tuple]:
    """Everything below the tops, without following symlinks: type, mode, size, mtime,
    content hash or link target. Equal before and after = nothing changed."""
    out: dict[str, tuple] = {}
    for top in tops:
        for where, dirs, files in os.walk(top, followlinks=False):
            for name in [".", *dirs, *files]:
                p = os.path.join(where, name)
                st = os.lstat(p)
                if os.path.islink(p):
                    what = os.readlink(p)
                elif os.path.isfile(p):
                    what = hashlib.sha256(Path(p).read_bytes()).hexdigest()
                else:
                    what = ""
                out[os.path.normpath(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid,
                                            what)
    return out


@pytest.fixture
def tree(tmp_path):
    """stale (10 days), recent, live (a daemon's lock, 10 days), unsaved (journaled writes,
    30 days), busy (journaled writes + leftovers), leftover (recent, only leftovers), a
    dir an interrupted gc left, a folder that is no cache dir, a symlink to an old cache
    dir outside the root."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    age(cache_dir(outside, "elsewhere"), 30)
    (root / "link").symlink_to(outside / "elsewhere")
    age(cache_dir(root, "stale"), 10)
    cache_dir(root, "recent")
    live = cache_dir(root, "live")
    fd = daemon_lock(live)  # exactly as the daemon takes it (and writes its pid)
    age(live, 10)
    age(cache_dir(root, "unsaved", dirty={"7-abc": b"u" * 5000}), 30)
    age(cache_dir(root, "busy", dirty={"3-keep": b"k" * 100}, uploads=1,
                  leftovers={"dirty/9-never-acked": b"x" * 6000, "tmp/ab02.0": b"t" * 3000}), 30)
    cache_dir(root, "leftover", leftovers={"dirty/4-never-acked": b"y" * 4096})
    trash = root / f"{TRASH_PREFIX}gone"
    (trash / "chunks").mkdir(parents=True)
    (trash / "chunks" / "x").write_bytes(b"z" * 4096)
    (root / "notes").mkdir()
    (root / "notes" / "README").write_text("not a cache\n")
    (root / "a-file").write_text("a stray file\n")
    yield root, outside
    os.close(fd)


def test_dry_run_changes_nothing_and_says_what_would_go(tree):
    root, outside = tree
    before = listing(root, outside)
    r, v = gc(root, "--dry-run")
    assert listing(root, outside) == before
    assert v[""]["dry_run"] is True
    assert {n: x["action"] for n, x in v.items() if n} == {
        "stale": "remove", f"{TRASH_PREFIX}gone": "remove", "recent": "keep", "live": "keep",
        "unsaved": "keep", "busy": "clean", "leftover": "clean", "notes": "skip",
        "link": "skip"}
    assert v["stale"]["bytes"] >= 8192 + 4096  # the chunk file and the index at least
    assert v[""]["bytes_freed"] == sum(x["bytes"] for n, x in v.items()
                                       if n and x["action"] in ("remove", "clean"))
    # the text form: one line per dir, then the total, and still nothing changed
    r = tierfs("gc", "--cache-root", str(root), "--dry-run")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 10, r
    assert any(ln.startswith("would remove ") and ln.endswith("last used 10 days ago")
               and "/stale:" in ln for ln in lines), lines
    assert lines[-1].startswith("total: would free ") and "dry run: nothing changed" in lines[-1]
    assert listing(root, outside) == before


def test_gc_removes_stale_dirs_and_leftovers_and_keeps_the_rest(tree):
    root, outside = tree
    outside_before = listing(outside)
    unsaved_before = listing(root / "unsaved")
    busy_journal = (root / "busy" / "journal").read_bytes()
    _, v = gc(root)
    names = sorted(os.listdir(root))
    assert names == ["a-file", "busy", "leftover", "link", "live", "notes", "recent", "unsaved"]
    assert listing(outside) == outside_before  # the symlink was not followed
    # the live dir: in use, named with the daemon's pid (this process took its lock)
    assert v["live"]["action"] == "keep"
    assert f"in use by a running tierfs (pid {os.getpid()})" in v["live"]["reason"]
    assert (root / "live" / "chunks" / "ab" / "ab01.0").exists()
    # journaled writes: kept whole whatever the age, and said so
    assert listing(root / "unsaved") == unsaved_before
    assert v["unsaved"]["journal_kept"] and v["unsaved"]["unsaved_files"] == 1
    assert "unsaved writes" in v["unsaved"]["reason"]
    assert "dirty data is sacred" in v["unsaved"]["reason"]
    # leftovers with nothing to upload go; the journaled staging file and journal stay
    assert sorted(os.listdir(root / "busy" / "dirty")) == ["3-keep"]
    assert os.listdir(root / "busy" / "tmp") == []
    assert (root / "busy" / "journal").read_bytes() == busy_journal
    assert v["busy"]["uploads"] == 1 and v["busy"]["bytes"] >= 6000 + 3000
    assert os.listdir(root / "leftover" / "dirty") == []
    assert (root / "leftover" / "chunks" / "ab" / "ab01.0").exists()
    assert (root / "notes" / "README").exists()
    assert v[""]["removed"] == 2 and v[""]["cleaned"] == 2 and v[""]["errors"] == 0
    # a second run finds nothing more to do
    _, again = gc(root)
    assert again[""]["bytes_freed"] == 0 and again[""]["removed"] == 0
    # a mount of the removed dir's source starts on a fresh dir
    os.close(daemon_lock(root / "stale"))


def test_unsaved_writes_are_kept_even_at_min_age_zero(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    cache_dir(root, "a", dirty={"5-x": b"w" * 100})
    cache_dir(root, "b", uploads=2)
    damaged = cache_dir(root, "c")
    with open(damaged / "journal", "r+b") as f:  # a bad record with bytes after it
        f.seek(0, os.SEEK_END)
        f.write(b"TJR1" + b"\0\0\0\x05" + b"\0\0\0\0" + b"bogus" + b"garbage after")
    (damaged / "dirty" / "6-y").write_bytes(b"maybe unsaved")
    nojournal = cache_dir(root, "d")
    os.unlink(nojournal / "journal")
    (nojournal / "dirty" / "8-z").write_bytes(b"maybe unsaved")
    odd = cache_dir(root, "e")  # a record this gc cannot read a staging file name from
    j = Journal.open(str(odd / "journal"))
    j.put_dirty(9, "not a record")  # type: ignore[arg-type]
    j.close()
    before = listing(root)
    r = tierfs("gc", "--cache-root", str(root), "--min-age", "0")
    assert r.returncode == 0 and r.stderr == "", r
    assert listing(root) == before
    lines = r.stdout.splitlines()
    assert len(lines) == 6 and all(ln.startswith("keep: ") for ln in lines[:5]), lines
    assert "1 files with unsaved writes" in lines[0]
    assert "2 multipart uploads a mount must abort" in lines[1]
    assert "journal is damaged" in lines[2] and "tierfs fsck --cache-dir" in lines[2]
    assert "no journal" in lines[3]
    assert "1 files with unsaved writes (0 B)" in lines[4]
    assert "5 kept (5 for what their journal holds)" in lines[5]


def test_a_real_mounts_cache_dir_is_live_until_it_is_unmounted(tmp_path):
    root, src = tmp_path / "root", tmp_path / "src"
    root.mkdir(mode=0o700)
    src.mkdir()
    (src / "f.txt").write_text("hello\n")
    mnt, cache = root / "mnt", root / "cache"  # the mount point under the root too
    mnt.mkdir()
    r = tierfs("mount", f"file://{src}", str(mnt), "--cache-dir", str(cache))
    assert r.returncode == 0, r
    try:
        assert (mnt / "f.txt").read_text() == "hello\n"
        pid = (cache / "lock").read_text().strip()
        age(cache, 10)
        _, v = gc(root)
        assert v["cache"]["action"] == "keep"
        assert f"in use by a running tierfs (pid {pid})" in v["cache"]["reason"]
        assert v["mnt"]["action"] == "skip" and "mount point" in v["mnt"]["reason"]
    finally:
        u = tierfs("unmount", str(mnt))
    assert u.returncode == 0, u
    age(cache, 10)
    _, v = gc(root)
    assert v["cache"]["action"] == "remove" and v["cache"]["bytes"] > 0
    assert sorted(os.listdir(root)) == ["mnt"]


def _one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "", r
    assert len(lines) == 1 and lines[0].startswith("tierfs: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_bad_arguments_and_roots_are_one_line(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    _one_line(tierfs("gc", "--cache-root", str(a_file)), "not a directory")
    _one_line(tierfs("gc", "--cache-root", str(tmp_path / "file" / "sub")), "Not a directory")
    dangling = tmp_path / "nvme-link"
    dangling.symlink_to(tmp_path / "unmounted-nvme")  # a root whose disk is not there
    _one_line(tierfs("gc", "--cache-root", str(dangling)), "No such file")
    if os.geteuid() != NOBODY:
        _one_line(tierfs("gc", "--cache-root", str(theirs)), f"belongs to uid {NOBODY}")
    for bad in ("abc", "-1", "nan", "inf"):
        _one_line(tierfs("gc", "--cache-root", str(tmp_path), "--min-age", bad), "--min-age")
    _one_line(tierfs("gc", "--bogus"), "unrecognized arguments")
    assert os.path.exists(theirs)


def test_a_missing_root_is_nothing_to_collect(tmp_path):
    # U2: a node that never mounted has no /var/cache/tierfs; the daily timer runs gc
    # there too. Before: exit 2 "cache root ...: No such file or directory".
    missing = tmp_path / "never-mounted"
    r = tierfs("gc", "--cache-root", str(missing))
    assert r.returncode == 0 and r.stderr == "", r
    line = (f"nothing to collect: cache root {missing} does not exist (no mount has made "
            "a cache dir there)")
    assert r.stdout.splitlines() == [line]
    r, found = gc(missing, "--dry-run")
    assert found[""]["missing"] is True and found[""]["dirs"] == []
    assert not missing.exists()


def test_the_default_root_is_where_mounts_put_their_cache_dirs(tmp_path):
    cfg = build_config("s3://bucket/data", str(tmp_path), {})
    assert os.path.dirname(cfg.effective_cache_dir) == DEFAULT_ROOT


def test_while_gc_holds_a_dir_no_daemon_can_take_it_and_gc_leaves_a_held_dir(tmp_path):
    from tierfs.errors import StartupError
    from tierfs.cli.gc import _lock

    d = cache_dir(tmp_path, "c")
    fd = _lock(str(d), create=False)  # what gc holds while it judges and removes a dir
    assert fd is not None
    try:
        with pytest.raises(StartupError, match="in use by another tierfs"):
            daemon_lock(d)
    finally:
        os.close(fd)
    assert (d / "lock").read_text() == "4242\n"  # gc wrote nothing into it
    held = daemon_lock(d)
    try:
        with pytest.raises(BlockingIOError):
            _lock(str(d), create=False)
    finally:
        os.close(held)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_user_collects_only_dirs_of_their_own():
    top = tempfile.mkdtemp(prefix="tierfs-gc-", dir="/tmp")  # tmp_path is root's alone
    try:
        os.chmod(top, 0o755)
        root = Path(top) / "root"
        root.mkdir(mode=0o700)
        age(cache_dir(root, "roots"), 10)  # root's, in the user's root: not the user's call
        mine = cache_dir(root, "mine")
        for where, dirs, files in os.walk(root):
            for name in [".", *dirs, *files]:
                p = os.path.join(where, name)
                if "roots" not in os.path.relpath(p, root).split(os.sep):
                    os.chown(p, NOBODY, NOBODY)
        age(mine, 10)
        r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", sys.executable, "-m", "tierfs", "gc",
                            "--cache-root", str(root)], capture_output=True, text=True,
                           timeout=60, cwd="/")
        assert r.returncode == 0 and r.stderr == "", r
        assert sorted(os.listdir(root)) == ["roots"]
        assert "skip: " in r.stdout and "belongs to uid 0" in r.stdout, r.stdout
    finally:
        shutil.rmtree(top)
