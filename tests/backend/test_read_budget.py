"""The worst-case time to EIO (tierfs/backend/budget.py): its figures for the defaults
and for the options of issue 9's D8 run, that the S3 backend enforces the same budget,
and that `tierfs mount --help` prints it."""

import pytest

from tierfs.cli import main as cli
from tierfs.backend import budget
from tierfs.backend.budget import default_read_budget, get_budget, read_budget
from tierfs.backend.s3 import S3Backend
from tierfs.config import build_config


def test_the_defaults():
    b = default_read_budget()
    assert (b.timeout_s, b.attempts) == (30.0, 4)
    # 4 attempts of (10 s connect + 30 s read) + backoff (1+5, 2+5, 4+5) + a stalled body
    assert get_budget(30, 4) == 4 * 40 + 22 + 30 == 212
    assert b.worst == 424
    assert b.hang == pytest.approx(5 * 30, abs=0.5)  # the backoff is 50 ms based there
    assert b.unreachable == pytest.approx(4 * 10, abs=0.5)


def test_the_options_of_the_d8_run():
    # backend_timeout=5s, backend_retries=2: the application waited 60 s for EIO before
    # (the kernel's re-asks each started over); a hang now costs 3 read timeouts
    b = read_budget(5, 2)
    assert b.hang == pytest.approx(15, abs=0.1)
    assert b.unreachable == pytest.approx(10, abs=0.1)
    assert b.worst == 2 * (2 * (5 + 5) + 6 + 5) == 62


def test_budget_grows_with_each_option_and_uses_the_mount_config():
    assert read_budget(10, 3).worst < read_budget(20, 3).worst < read_budget(20, 4).worst
    assert budget.connect_timeout(60) == 10 and budget.connect_timeout(3) == 3
    # botocore's backoff is capped at 20 s a retry (+5 s x-amz-retry-after)
    assert budget.backoff_total(20) == sum(min(2 ** i, 20) + 5 for i in range(19))
    cfg = build_config("s3://bucket", "/mnt/x", {"backend_timeout": "12s",
                                                 "backend_retries": "3"})
    assert budget.mount_read_budget(cfg) == read_budget(12, 3)


def test_the_s3_backend_stops_resuming_after_one_get_budget(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "test")
    b = S3Backend("bucket", endpoint_url="http://127.0.0.1:9", region=None, max_connections=1,
                  timeout_s=7, max_attempts=3)
    assert b.get_budget_s == get_budget(7, 3)
    assert b.resume_attempts == 3 and b.integrity_retries == budget.INTEGRITY_RETRIES


def test_mount_help_prints_it(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["mount", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Worst-case time to EIO" in out
    assert "424 s" in out and "150 s" in out
