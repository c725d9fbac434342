"""Real programs writing on the mount: tar, git, and numpy checkpoints (np.save to a
temporary name, fsync, rename), the torch-free form of what training jobs do."""

from __future__ import annotations

import io
import os
import random
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
import wkit
from wkit import KiB, MiB


def run(*cmd: str, cwd=None, env=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def build_tree(root: Path) -> dict[str, bytes]:
    """A few dirs, 50 files (0 B .. 9 MiB), two symlinks, varied modes and mtimes.
    Returns {relative path: bytes} of the regular files."""
    rnd = random.Random(5)
    dirs = ["", "docs", "src", "src/pkg", "src/pkg/deep", "data", "empty-dir"]
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(50):
        d = rnd.choice(dirs[:-1])
        size = rnd.choice([0, 1, 100, 4 * KiB, 60 * KiB, 300 * KiB])
        if i == 7:
            size = 9 * MiB + 3  # one multipart-sized member
        rel = f"{d}/file{i:02}.bin" if d else f"file{i:02}.bin"
        data = wkit.payload(f"tar{i}", size)
        (root / rel).write_bytes(data)
        os.chmod(root / rel, rnd.choice([0o644, 0o600, 0o755]))
        os.utime(root / rel, (1_600_000_000 + i, 1_600_000_000 + i * 60))
        out[rel] = data
    os.symlink("src/pkg/deep", root / "link-to-deep")
    os.symlink("../file07.bin", root / "docs/link-to-big")
    return out


def tree_snapshot(root: Path) -> dict[str, object]:
    """{relative path: bytes | ("link", target) | "dir"} of everything under root."""
    snap: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = "dir"
            else:
                snap[rel] = p.read_bytes()
    return snap


@pytest.fixture
def archive(tmp_path):
    src = tmp_path / "src"
    files = build_tree(src)
    tar = tmp_path / "tree.tar"
    r = run("tar", "-cf", str(tar), "-C", str(src), ".")
    assert r.returncode == 0, r.stderr
    return src, tar, files


def test_tar_extract_is_byte_exact(mounts, s3, bucket, archive):
    src, tar, files = archive
    m = mounts.start()
    (m.path / "x").mkdir()
    r = run("tar", "-xf", str(tar), "-C", str(m.path / "x"))
    assert r.returncode == 0, r.stderr
    got, want = tree_snapshot(m.path / "x"), tree_snapshot(src)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"differ: {bad}"
    # and the regular files are the objects in the bucket
    wkit.assert_bucket_has(s3, bucket, {f"x/{k}": v for k, v in files.items()})


def test_tar_compare_finds_no_difference(mounts, archive):
    """tar -d also compares modes, owners, mtimes and link targets."""
    src, tar, files = archive
    m = mounts.start()
    (m.path / "x").mkdir()
    r = run("tar", "-xf", str(tar), "-C", str(m.path / "x"))
    assert r.returncode == 0, r.stderr
    r = run("tar", "-df", str(tar), "-C", str(m.path / "x"))
    assert r.returncode == 0, f"tar -d reports:\n{r.stdout}{r.stderr}"


def test_tar_extract_survives_a_remount_with_a_fresh_cache(mounts, archive):
    src, tar, files = archive
    m = mounts.start()
    (m.path / "x").mkdir()
    r = run("tar", "-xf", str(tar), "-C", str(m.path / "x"))
    assert r.returncode == 0, r.stderr
    m = mounts.remount(m, cache="cache2")
    for rel, data in files.items():
        assert wkit.read_uncached(m.path / "x" / rel) == data, rel
    assert (m.path / "x/empty-dir").is_dir()


def git_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home), GIT_CONFIG_NOSYSTEM="1", LC_ALL="C",
                GIT_AUTHOR_DATE="2024-01-01T00:00:00Z", GIT_COMMITTER_DATE="2024-01-01T00:00:00Z")


GIT = ("git", "-c", "user.name=Tier Test", "-c", "user.email=tier@example.com",
       "-c", "init.defaultBranch=main")


def make_repo(repo: Path, env) -> None:
    def git(*args: str) -> str:
        r = run(*GIT, *args, cwd=repo, env=env)
        assert r.returncode == 0, f"git {' '.join(args)} failed:\n{r.stdout}{r.stderr}"
        return r.stdout

    repo.mkdir()
    git("init", "-q")
    (repo / "src").mkdir()
    for i in range(20):
        (repo / "src" / f"mod{i}.py").write_text(f"value = {i}\n" * (i + 1))
    (repo / "blob.bin").write_bytes(wkit.payload("gitblob", 2 * MiB))
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    (repo / "src/mod3.py").write_text("changed\n")
    (repo / "src/mod4.py").unlink()
    (repo / "new.txt").write_text("new\n")
    git("add", "-A")
    git("commit", "-q", "-m", "second")


def test_git_init_add_commit_log_fsck(mounts, tmp_path):
    m = mounts.start()
    env = git_env(tmp_path)
    repo = m.path / "repo"
    make_repo(repo, env)
    r = run(*GIT, "log", "--format=%s", cwd=repo, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["second", "first"]
    r = run(*GIT, "fsck", "--full", "--strict", cwd=repo, env=env)
    assert r.returncode == 0, f"git fsck:\n{r.stdout}{r.stderr}"
    r = run(*GIT, "status", "--porcelain", cwd=repo, env=env)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_git_repository_is_intact_after_a_remount_with_a_fresh_cache(mounts, tmp_path):
    m = mounts.start()
    env = git_env(tmp_path)
    make_repo(m.path / "repo", env)
    m = mounts.remount(m, cache="cache2")
    repo = m.path / "repo"
    r = run(*GIT, "fsck", "--full", "--strict", cwd=repo, env=env)
    assert r.returncode == 0, f"git fsck after remount:\n{r.stdout}{r.stderr}"
    r = run(*GIT, "log", "--format=%s", cwd=repo, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["second", "first"], r.stdout + r.stderr
    # a clone reads every object back
    r = run(*GIT, "clone", "-q", str(repo), str(tmp_path / "clone"), env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "clone/blob.bin").read_bytes() == wkit.payload("gitblob", 2 * MiB)


# ---------------------------------------------------------------- numpy checkpoints
def save_array(path: Path, arr: np.ndarray) -> None:
    """np.save to a temporary name, fsync, then atomically replace the final name."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


@pytest.mark.parametrize("mode", list(wkit.MODES))
def test_numpy_checkpoints_written_by_tmp_and_rename(mounts, s3, bucket, mode):
    m = mounts.start(*wkit.MODES[mode])
    ck = m.path / "ckpt"
    ck.mkdir()
    rng = np.random.default_rng(3)
    latest: dict[str, np.ndarray] = {}
    for step in range(3):
        arrays = {
            "weights.npy": rng.standard_normal(300_000),  # 2.3 MB
            "bias.npy": rng.standard_normal(1000).astype(np.float32),
            "steps.npy": np.full(10, step, dtype=np.int64),
            "huge.npy": rng.integers(0, 255, 12 * MiB, dtype=np.uint8),  # multipart
        }
        for name, arr in arrays.items():
            save_array(ck / name, arr)
        latest = arrays
    assert sorted(os.listdir(ck)) == sorted(latest)  # no .tmp left behind
    for name, arr in latest.items():
        loaded = np.load(ck / name)
        assert loaded.dtype == arr.dtype and np.array_equal(loaded, arr), name
    # in the bucket: exactly the final arrays, no temporaries
    want = {f"ckpt/{n}": npy_bytes(a) for n, a in latest.items()}
    wkit.assert_bucket_has(s3, bucket, want, timeout=wkit.BUCKET_LAG)
    wkit.eventually(lambda: set(wkit.s3_files(s3, bucket, "ckpt/")) == set(want))
