"""The cache dir is private (V1): 0700, files 0600, tightened at mount with one WARNING,
refused when another non-root user owns it; and a second local user - created here, removed
afterwards - cannot read a cached byte of a mount that does not let it in."""

import hashlib
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tierfs.cachedir import lock_cache_dir, prepare_cache_dir, tighten
from tierfs.errors import StartupError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root")


@pytest.fixture(autouse=True)
def keep_umask():
    """prepare_cache_dir sets the process umask (as the daemon wants): give it back."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


@pytest.fixture
def second_user():
    """A local user of its own (no home, no shell), removed after the test."""
    name = f"tierfs-t{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    name], check=True, capture_output=True, timeout=60)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


@pytest.fixture
def public_tmp():
    """A 0755 folder (pytest's tmp_path is under a 0700 one: a second user would be kept
    out by that, not by what is tested)."""
    d = Path(tempfile.mkdtemp(prefix="tierfs-cachedir-test."))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def modes(top: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(top.stat().st_mode)}
    for p in top.rglob("*"):
        out[str(p.relative_to(top))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def as_user(user, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user.pw_name, "--", "sh", "-c", script],
                          capture_output=True, timeout=60, cwd="/")


def test_a_new_cache_dir_is_private_and_so_is_what_is_created_in_it(public_tmp, caplog):
    cache = public_tmp / "cache"
    with caplog.at_level(logging.WARNING):
        fd = lock_cache_dir(str(cache))
    try:
        (cache / "chunks").mkdir()
        (cache / "chunks" / "c1").write_bytes(b"data")  # as the disk tier would, under the umask
        assert modes(cache) == {".": 0o700, "lock": 0o600, "chunks": 0o700, "chunks/c1": 0o600}
    finally:
        os.close(fd)
    assert caplog.records == []  # nothing had to be tightened


def test_an_open_cache_dir_is_tightened_with_one_warning(public_tmp, caplog):
    cache = public_tmp / "cache"  # as an older tierfs left it: 0755 folders, 0644 files
    (cache / "chunks" / "ab").mkdir(parents=True)
    for f in ("index/data.mdb", "chunks/ab/c1", "tierfs.log", "dirty/7.staging"):
        (cache / f).parent.mkdir(exist_ok=True)
        (cache / f).write_bytes(b"x")
    for p in [cache, *cache.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    with caplog.at_level(logging.WARNING):
        prepare_cache_dir(str(cache))
    assert set(modes(cache).values()) == {0o700, 0o600}
    assert all(m == 0o600 for k, m in modes(cache).items() if (cache / k).is_file())
    [record] = caplog.records
    assert record.levelname == "WARNING" and "made it private" in record.getMessage()
    caplog.clear()
    prepare_cache_dir(str(cache))  # private now: no second warning
    assert caplog.records == []


def test_tighten_leaves_symlinks_and_other_owners_alone(public_tmp, second_user):
    cache = public_tmp / "cache"
    cache.mkdir(mode=0o755)
    outside = public_tmp / "outside"
    outside.write_text("x")
    outside.chmod(0o644)
    (cache / "link").symlink_to(outside)
    theirs = cache / "theirs"
    theirs.write_text("x")
    theirs.chmod(0o644)
    os.chown(theirs, second_user.pw_uid, second_user.pw_gid)
    tighten(str(cache))
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644  # not followed
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o644
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_cache_dir_owned_by_another_user_is_refused(public_tmp, second_user):
    cache = public_tmp / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, second_user.pw_uid, second_user.pw_gid)
    with pytest.raises(StartupError) as err:
        prepare_cache_dir(str(cache))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"cache dir {cache} belongs to uid {second_user.pw_uid}, not to "
                              "this user (uid 0)")
    assert not (cache / "lock").exists()


def test_a_cache_dir_that_is_a_file_is_one_error(public_tmp):
    (public_tmp / "f").write_text("x")
    with pytest.raises(StartupError, match="is not a directory"):
        prepare_cache_dir(str(public_tmp / "f"))


# ------------------------------------------------------------------ a real mount
@pytest.mark.mount
def test_a_user_the_mount_refuses_reads_no_cached_byte(rgw, bucket, public_tmp, second_user):
    from mounting import Mount

    secret = hashlib.shake_256(b"secret").digest(300_000)
    rgw.client().put_object(Bucket=bucket, Key="secret.bin", Body=secret)
    cache, mnt = public_tmp / "cache", public_tmp / "mnt"
    log = cache / "tierfs.log"
    cat_all = (f"cat {cache}/chunks/*/* {cache}/*/* {cache}/* {log}; "
               f"find {cache} -type f -exec cat {{}} +")

    def check_private():
        assert all(m == 0o700 for k, m in modes(cache).items() if (cache / k).is_dir())
        assert all(m == 0o600 for k, m in modes(cache).items() if (cache / k).is_file())
        r = as_user(second_user, cat_all)  # what V1 found: cat CACHE_DIR/chunks/*/*
        assert r.returncode != 0 and secret[:4096] not in r.stdout and r.stdout == b""
        assert b"Permission denied" in r.stderr
        r = as_user(second_user, f"cat {mnt}/secret.bin")  # no allow_other: the mount says no
        assert r.returncode != 0 and r.stdout == b""

    with Mount(rgw, f"s3://{bucket}", mnt, cache, ["--log-file", str(log)]) as m:
        assert (m.path / "secret.bin").read_bytes() == secret
        deadline = time.monotonic() + 30  # the disk tier is filled in the background
        while not any(p.is_file() and p.stat().st_size == len(secret)
                      for p in cache.rglob("*")):
            assert time.monotonic() < deadline, "the chunk never reached the disk tier"
            time.sleep(0.05)
    check_private()

    # an older tierfs (or a chmod by hand) left the cache open: tightened at the next mount
    subprocess.run(["chmod", "-R", "go+rX", str(cache)], check=True)
    assert as_user(second_user, f"cat {log}").returncode == 0  # open indeed
    with Mount(rgw, f"s3://{bucket}", mnt, cache, ["--log-file", str(log)]) as m:
        assert (m.path / "secret.bin").read_bytes() == secret
        assert m.counter("tierfs_backend_requests_total", op="get") == 0  # served from cache
    warnings = [ln for ln in log.read_text().splitlines() if "made it private" in ln]
    assert len(warnings) == 1 and " WARNING " in warnings[0]
    check_private()

    # a cache dir of another (non-root) user: one line, no mount
    os.chown(cache, second_user.pw_uid, second_user.pw_gid)
    r = subprocess.run([sys.executable, "-m", "tierfs", "mount", f"s3://{bucket}", str(mnt),
                        "--endpoint-url", rgw.endpoint, "--cache-dir", str(cache)],
                       capture_output=True, text=True, timeout=60, env=m.env)
    assert r.returncode != 0
    assert r.stderr.splitlines() == [f"tierfs: error: cache dir {cache} belongs to uid "
                                     f"{second_user.pw_uid}, not to this user (uid 0): another "
                                     "user could read and change the cache; use a cache dir "
                                     "of your own"]
