"""TOML mount configuration (`tierfs mount --config FILE`, used by the systemd unit):
same option names as the command line, typed values or the command line's strings, the
command line wins, and every mistake is one UsageError naming the file."""

import subprocess
import sys

import pytest

from tierfs.config import build_config_with_file, read_config_file
from tierfs.errors import UsageError

GOOD = '''
source = "s3://datasets/imagenet"
mountpoint = "/mnt/datasets"
endpoint_url = "http://rgw:7480"
cache-dir = "/nvme/tierfs/datasets"
cache_size = "500G"
memory_cache_size = 1073741824
chunk_size = "16M"
metadata_ttl = 90
dirty_wait = "2m"
drain_timeout = "45s"
min_free_ratio = 0.2
readahead_chunks = 4
allow_other = true
writeback = false
metrics_addr = "0.0.0.0:9100"
file_mode = "0640"
log_level = "warning"
'''


def write(tmp_path, text: str) -> str:
    path = tmp_path / "mount.toml"
    path.write_text(text)
    return str(path)


def test_every_kind_of_value(tmp_path):
    cfg = build_config_with_file(write(tmp_path, GOOD), None, None, {})
    assert str(cfg.source) == "s3://datasets/imagenet/"
    assert cfg.mountpoint == "/mnt/datasets"
    assert cfg.endpoint_url == "http://rgw:7480"
    assert cfg.cache_dir == "/nvme/tierfs/datasets"
    assert (cfg.cache_size, cfg.memory_cache_size, cfg.chunk_size) == (500 << 30, 1 << 30, 16 << 20)
    assert (cfg.metadata_ttl, cfg.dirty_wait, cfg.drain_timeout) == (90.0, 120.0, 45.0)
    assert cfg.min_free_ratio == 0.2 and cfg.readahead_chunks == 4
    assert cfg.allow_other is True and cfg.writeback is False
    assert cfg.metrics_addr == ("0.0.0.0", 9100)
    assert cfg.file_mode == 0o640 and cfg.log_level == "warning"


def test_the_command_line_wins(tmp_path):
    path = write(tmp_path, GOOD)
    cfg = build_config_with_file(path, "s3://other", "/mnt/other",
                                 {"cache_size": "1T", "writeback": True})
    assert str(cfg.source) == "s3://other/" and cfg.mountpoint == "/mnt/other"
    assert cfg.cache_size == 1 << 40 and cfg.writeback is True
    assert cfg.chunk_size == 16 << 20  # what the command line does not give stays


def test_source_and_mountpoint_may_come_from_the_command_line(tmp_path):
    cfg = build_config_with_file(write(tmp_path, 'cache_size = "2G"\n'), "s3://bkt", "/mnt/b", {})
    assert cfg.mountpoint == "/mnt/b" and cfg.cache_size == 2 << 30


def test_missing_source_or_mountpoint_names_the_file(tmp_path):
    path = write(tmp_path, 'mountpoint = "/mnt/x"\n')
    with pytest.raises(UsageError, match=f"source.*{path}"):
        build_config_with_file(path, None, None, {})
    path = write(tmp_path, 'source = "s3://bkt"\n')
    with pytest.raises(UsageError, match=f"mount point.*{path}"):
        build_config_with_file(path, None, None, {})


@pytest.mark.parametrize("text, needle", [
    ('cache_sise = "1G"', "unknown option 'cache_sise'"),
    ('foreground = true', "unknown option 'foreground'"),
    ('aws_secret_access_key = "hunter2"', "unknown option 'aws_secret_access_key'"),
    ('cache_size = "lots"', "cache-size"),
    ('chunk_size = "3M"', "chunk-size"),
    ('readahead_chunks = true', "readahead_chunks: expected a value, not true/false"),
    ('readahead_chunks = 2.5', "readahead_chunks: expected a whole number"),
    ('file_mode = 644', 'file_mode: write the mode as a string'),
    ('allow_other = "perhaps"', "allow-other"),
    ('endpoint_url = 7480', "endpoint_url: expected a string"),
    ('cache_dir = "relative/cache"', "cache_dir: 'relative/cache' is not an absolute path"),
    ('log_level = ["info"]', "log_level: expected a string, number or boolean"),
    ('[options]\ncache_size = "1G"', "unknown option 'options'"),
    ('metadata_ttl = 1979-05-27', "metadata_ttl: expected a string, number or boolean"),
    ('cache_size = "1G"\ncache-size = "2G"', "given twice"),
    ('cache_size = ', "invalid TOML"),
    ('cache_size = "1G"\ncache_size = "2G"', "invalid TOML"),
])
def test_mistakes_are_one_usage_error_naming_the_file(tmp_path, text, needle):
    path = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/b"\n' + text + "\n")
    with pytest.raises(UsageError) as exc:
        build_config_with_file(path, None, None, {})
    message = str(exc.value)
    assert path in message and needle in message
    assert "hunter2" not in message and "\n" not in message


def test_relative_mountpoint_in_the_file_is_refused(tmp_path):
    path = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "mnt"\n')
    with pytest.raises(UsageError, match="mountpoint: 'mnt' is not an absolute path"):
        build_config_with_file(path, None, None, {})


def test_a_bad_command_line_value_is_not_blamed_on_the_file(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(UsageError) as exc:
        build_config_with_file(path, None, None, {"cache_size": "huge"})
    assert "cache-size" in str(exc.value) and path not in str(exc.value)


def test_unreadable_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read config file .*missing.toml"):
        read_config_file(str(tmp_path / "missing.toml"))


def test_cli_prints_one_line_and_fails(tmp_path):
    path = write(tmp_path, 'source = "s3://bkt"\nmountpoint = "/mnt/b"\ncache_size = "x"\n')
    r = subprocess.run([sys.executable, "-m", "tierfs", "mount", "--config", path],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"tierfs: error: {path}: invalid cache-size 'x'")


def test_cli_without_source_or_config_fails_with_one_line():
    r = subprocess.run([sys.executable, "-m", "tierfs", "mount"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr == "tierfs: error: mount needs SOURCE and MOUNTPOINT (or --config FILE)\n"


def test_unmount_takes_the_mount_point_from_the_file(tmp_path):
    # what the unit's ExecStopPost= runs: quiet success when nothing is mounted
    path = write(tmp_path, f'source = "s3://bkt"\nmountpoint = "{tmp_path}/mnt"\n')
    cmd = [sys.executable, "-m", "tierfs", "unmount", "--config", path]
    r = subprocess.run([*cmd, "--if-mounted"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == f"tierfs: error: {tmp_path}/mnt is not mounted\n"
    bad = write(tmp_path, 'cache_size = "1G"\n')
    r = subprocess.run(cmd[:-1] + [bad], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no mount point" in r.stderr and r.stderr.count("\n") == 1
