"""Bad input and failing backends: one clear line, a non-zero exit, no traceback, no hang."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from helpers import payload, put_many
from mounting import Mounts, free_port, is_mounted
from rgw import s3_env, start_rgw

MiB = 1 << 20


def run_mount(rgw, *args: str, env=None, timeout: float = 60):
    cmd = [sys.executable, "-m", "tierfs", "mount", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else s3_env(rgw), stdin=subprocess.DEVNULL)


def assert_one_line_error(r, *needles: str) -> None:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "mnt").mkdir()
    return tmp_path / "mnt", tmp_path / "cache"


@pytest.mark.parametrize("args, needle", [
    (["--cache-size", "banana"], "cache-size"),
    (["--chunk-size", "3M"], "chunk-size"),
    (["--chunk-size", "-1"], "chunk-size"),
    (["--metadata-ttl", "soon"], "metadata-ttl"),
    (["--metrics-addr", "nowhere"], "metrics-addr"),
    (["--log-level", "loud"], "log-level"),
    (["--readahead-chunks", "0"], "readahead-chunks"),
    (["-o", "no_such_option=1"], "no_such_option"),
    (["--endpoint-url", "ftp://x"], "endpoint-url"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_nonsense_options(rgw, bucket, dirs, args, needle):
    mnt, cache = dirs
    r = run_mount(rgw, f"s3://{bucket}", str(mnt), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(cache), *args)
    assert_one_line_error(r, needle)
    assert not os.path.ismount(mnt)


def test_bad_source_url(rgw, dirs):
    mnt, cache = dirs
    assert_one_line_error(run_mount(rgw, "http://bucket", str(mnt)), "source")


def test_missing_bucket(rgw, dirs):
    mnt, cache = dirs
    r = run_mount(rgw, "s3://no-such-bucket-here", str(mnt), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(cache))
    assert_one_line_error(r, "no-such-bucket-here", "does not exist")


def test_bad_credentials_never_echo_the_secret(rgw, bucket, dirs):
    mnt, cache = dirs
    env = s3_env(rgw)
    env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret-0123456789"
    r = run_mount(rgw, f"s3://{bucket}", str(mnt), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(cache), env=env)
    assert_one_line_error(r, "access denied")
    assert "wrong-secret" not in r.stderr


def test_no_credentials(rgw, bucket, dirs):
    mnt, cache = dirs
    env = s3_env(rgw)
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    r = run_mount(rgw, f"s3://{bucket}", str(mnt), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(cache), env=env)
    assert_one_line_error(r, "credentials")


def test_unreachable_endpoint(rgw, bucket, dirs):
    mnt, cache = dirs
    port = free_port()  # nothing listens there
    r = run_mount(rgw, f"s3://{bucket}", str(mnt), "--endpoint-url", f"http://127.0.0.1:{port}",
                  "--cache-dir", str(cache), "-o", "backend_retries=2")
    assert_one_line_error(r, "unreachable")


def test_mount_point_problems(rgw, bucket, tmp_path, mounts):
    base = ["--endpoint-url", rgw.endpoint, "--cache-dir", str(tmp_path / "cache")]
    r = run_mount(rgw, f"s3://{bucket}", str(tmp_path / "absent"), *base)
    assert_one_line_error(r, "does not exist")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert_one_line_error(run_mount(rgw, f"s3://{bucket}", str(tmp_path / "full"), *base),
                          "not empty")
    (tmp_path / "file").write_text("x")
    assert_one_line_error(run_mount(rgw, f"s3://{bucket}", str(tmp_path / "file"), *base),
                          "not a directory")
    with mounts.start(cache="cache1"):
        r = run_mount(rgw, f"s3://{bucket}", str(tmp_path / "mnt"), "--endpoint-url",
                      rgw.endpoint, "--cache-dir", str(tmp_path / "cache2"))
        assert_one_line_error(r, "already mounted")
        (tmp_path / "mnt2").mkdir()
        r = run_mount(rgw, f"s3://{bucket}", str(tmp_path / "mnt2"), "--endpoint-url",
                      rgw.endpoint, "--cache-dir", str(tmp_path / "cache1"))
        assert_one_line_error(r, "in use by another tierfs")


def test_unusable_cache_dir(rgw, bucket, tmp_path):
    (tmp_path / "mnt").mkdir()
    (tmp_path / "afile").write_text("x")
    r = run_mount(rgw, f"s3://{bucket}", str(tmp_path / "mnt"), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(tmp_path / "afile" / "cache"))
    assert_one_line_error(r, f"cache dir {tmp_path}/afile/cache", "Not a directory")


def test_background_mount_and_unmount(rgw, bucket, tmp_path):
    put_many(rgw.client(), bucket, {"hello.txt": b"hi"})
    (tmp_path / "mnt").mkdir()
    r = run_mount(rgw, f"s3://{bucket}", str(tmp_path / "mnt"), "--endpoint-url", rgw.endpoint,
                  "--cache-dir", str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    try:
        assert (tmp_path / "mnt" / "hello.txt").read_bytes() == b"hi"
    finally:
        u = subprocess.run([sys.executable, "-m", "tierfs", "unmount", str(tmp_path / "mnt")],
                           capture_output=True, text=True, timeout=60)
    assert u.returncode == 0, u.stderr
    assert not os.path.ismount(tmp_path / "mnt")
    again = subprocess.run([sys.executable, "-m", "tierfs", "unmount", str(tmp_path / "mnt")],
                           capture_output=True, text=True, timeout=60)
    assert_one_line_error(again, "not mounted")


def test_backend_failure_during_read_is_eio_with_one_log_line(tmp_path):
    own = start_rgw(memstore_bytes=1 << 30)  # this test kills its own RGW
    try:
        s3 = own.client()
        s3.create_bucket(Bucket="fail")
        data = payload("fail", 4 * MiB)
        s3.put_object(Bucket="fail", Key="obj.bin", Body=data)
        args = ["--chunk-size", "1M", "--readahead-chunks", "1", "-o",
                "backend_retries=2,backend_timeout=3s"]
        with Mounts(own, "fail", tmp_path).start(*args) as m:
            with open(m.path / "obj.bin", "rb") as f:
                assert os.pread(f.fileno(), 4096, 0) == data[:4096]
            own.stop()  # the object store goes away mid-job
            with pytest.raises(OSError) as exc:
                with open(m.path / "obj.bin", "rb") as f:
                    os.pread(f.fileno(), 4096, 3 * MiB + 100)
            assert exc.value.errno == errno.EIO
            # cached data is still served while the backend is down
            with open(m.path / "obj.bin", "rb") as f:
                assert os.pread(f.fileno(), 4096, 0) == data[:4096]
            log = m.log_text()
            assert "read of 'obj.bin' at offset 3145728 failed" in log
            assert m.counter("tierfs_backend_errors_total", op="get") >= 1
    finally:
        own.stop()


def test_unmount_after_the_daemon_was_killed(rgw, bucket, tmp_path, mounts):
    m = mounts.start()
    m.proc.kill()
    m.proc.wait(timeout=30)
    u = subprocess.run([sys.executable, "-m", "tierfs", "unmount", str(tmp_path / "mnt")],
                       capture_output=True, text=True, timeout=60)
    assert u.returncode == 0, u.stderr
    assert not is_mounted(tmp_path / "mnt")
    m.stop()
    # and the cache dir is usable again: the lock died with the daemon
    with mounts.start():
        pass
