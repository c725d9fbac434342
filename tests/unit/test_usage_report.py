"""`tierfs usage`'s request checks (tierfs/protocol.py), and the Slurm epilog's summary
line and accounting record built from the mounts' answers (tierfs/cli/slurm.py), without a
mount."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tierfs.cli import ctl

from tierfs import protocol
from tierfs.config import slurm_settings
from tierfs.errors import UsageError
from tierfs.cli.slurm import append_json_line, job_usage


@pytest.mark.parametrize("reader", ["job:", "job", "user:1", "job:1\nforged", "uid:" + "9" * 90])
def test_a_bad_reader_is_one_usage_error(reader):
    with pytest.raises(UsageError, match="reader"):
        protocol.parse_request(json.dumps({"v": 1, "op": "usage", "reader": reader}).encode())
    with pytest.raises(UsageError, match="reader"):
        ctl.encode("usage", {"reader": reader})


def test_a_bad_by_is_one_usage_error():
    with pytest.raises(UsageError, match="by"):
        protocol.parse_request(b'{"v": 1, "op": "usage", "by": "host"}')


def test_the_epilog_sums_the_mounts_answers_into_one_line_and_one_record(tmp_path):
    row = {"name": "job:1234", "read": {"memory": 600 << 30, "disk": 188 << 30,
                                        "backend": 24 << 30}, "stall_s": 9.5}
    other = {"name": "job:1234", "read": {"backend": 0, "disk": 0}, "stall_s": 4.6}
    answers = [("/mnt/a", json.dumps({"mountpoint": "/mnt/a", "rows": [row]}) + "\n"),
               ("/mnt/b", json.dumps({"mountpoint": "/mnt/b", "rows": [other]}) + "\n"),
               ("/mnt/c", "garbage\n"),
               ("/mnt/d", json.dumps({"rows": [{**row, "name": "job:999"}]}) + "\n")]
    u = job_usage("1234", answers)
    assert u.total == 812 << 30 and u.mounts == ("/mnt/a", "/mnt/b")
    assert u.line() == "job 1234: read 812.0 GiB, 97% from cache, 14 s stalled on the store"
    path = str(tmp_path / "acct" / "jobs.jsonl")
    append_json_line(path, u.record("alice", 1_700_000_000.0))
    append_json_line(path, u.record("alice", 1_700_000_001.0))
    with open(path) as f:
        lines = [json.loads(x) for x in f]
    assert len(lines) == 2
    assert lines[0] == {"time": "2023-11-14T22:13:20Z", "job": "1234", "user": "alice",
                        "read_bytes": 812 << 30,
                        "read": {"memory": 600 << 30, "disk": 188 << 30, "peer": 0,
                                 "near": 0, "backend": 24 << 30},
                        "cached_bytes": 788 << 30, "hit_ratio": 0.9704, "stall_s": 14.1,
                        "mounts": ["/mnt/a", "/mnt/b"]}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_an_unwritable_accounting_file_is_one_stderr_line(tmp_path, capsys):
    target = tmp_path / "real"
    target.write_text("")
    os.symlink(target, tmp_path / "link")
    append_json_line(str(tmp_path / "link"), {"job": "1"})  # O_NOFOLLOW: never through a link
    err = capsys.readouterr().err
    assert err.startswith("tierfs-slurm: cannot write ") and err.count("\n") == 1
    assert target.read_text() == ""


def test_the_accounting_file_setting_is_an_absolute_path():
    assert slurm_settings({"accounting_file": "/var/log/tierfs/jobs.jsonl"}) \
        .accounting_file == "/var/log/tierfs/jobs.jsonl"
    assert slurm_settings({}).accounting_file is None
    with pytest.raises(UsageError, match="accounting-file .*absolute path"):
        slurm_settings({"accounting_file": "jobs.jsonl"})


@pytest.mark.parametrize("argv, rc, text", [
    (["--reader", "job:1\nforged"], 1, "tierfs: error: invalid reader 'job:1\\nforged': "),
    (["--by", "host"], 2, "tierfs: error: argument --by: invalid choice: 'host'"),
    (["/proc/no-such-mount"], 1, "tierfs: error: /proc/no-such-mount is not under a tierfs mount"),
])
def test_tierfs_usage_bad_input_is_one_error_line(argv, rc, text):
    r = subprocess.run([sys.executable, "-m", "tierfs", "usage", *argv], capture_output=True,
                       text=True, cwd="/")
    assert r.returncode == rc and r.stdout == ""
    assert r.stderr.startswith(text) and r.stderr.count("\n") == 1
