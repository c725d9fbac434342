"""tierfs:warm=auto's pieces (tierfs/cli/slurmruns.py, tierfs/cli/slurm.py): the token, the record
of each job name's last run (real files in a tmp dir), the job name from scontrol."""

from __future__ import annotations

import json
import os

from tierfs.cli import slurmruns
from tierfs.cli.slurm import parse_comment


def test_warm_auto_is_a_token_of_its_own_beside_paths():
    d = parse_comment("sweep tierfs:warm=auto,/mnt/x/data tierfs:warm=auto")
    assert d.auto and d.paths == ("/mnt/x/data",) and not d.errors
    assert bool(parse_comment("tierfs:warm=auto"))
    assert not parse_comment("tierfs:warm=/a").auto
    assert parse_comment("tierfs:manifest=auto").errors  # auto is warm's only


def test_last_run_per_user_and_name_bounded_and_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "state" / "runs.json")
    assert slurmruns.last_run(1000, "train", path) is None  # no file: no last run
    slurmruns.record_run(1000, "train", "41", 100.0, path)
    slurmruns.record_run(1000, "train", "42", 200.0, path)
    slurmruns.record_run(1001, "train", "43", 300.0, path)
    assert slurmruns.last_run(1000, "train", path) == slurmruns.Run("42", 200.0)
    assert slurmruns.last_run(1001, "train", path).job == "43"
    assert slurmruns.last_run(1000, "eval", path) is None
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [n for n in os.listdir(tmp_path / "state")] == ["runs.json"]  # no temp left
    monkeypatch.setattr(slurmruns, "MAX_RUNS", 2)
    slurmruns.record_run(7, "new", "44", 400.0, path)  # the oldest name goes
    assert set(json.loads((tmp_path / "state" / "runs.json").read_text())) == {"1001\ttrain", "7\tnew"}
    with open(path, "w") as f:
        f.write("{not json")
    assert slurmruns.load(path) == {}  # a damaged file is no last run, not a failure


def test_job_name_from_scontrol_keeps_blanks():
    text = ("JobId=12 JobName=my train run\n   UserId=nobody(65534) GroupId=nogroup(65534)\n"
            "   Comment=JobName=fake\n")
    assert slurmruns.job_name_from_scontrol(text) == "my train run"
    assert slurmruns.job_name_from_scontrol("JobId=1\n") == ""
