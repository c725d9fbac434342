"""U4: a job comment of any length. Before: a 10 MB SLURM_JOB_COMMENT in the hook's
environment was inherited by its `tierfs warm` child, whose exec failed with "Argument
list too long": logged, nothing warmed, and no word of why. Now the comment goes to the
prolog on stdin (systemd/slurm/tierfs-slurm), never into a child's environment, and a
comment over MAX_COMMENT_BYTES that holds tierfs: tokens is one clear line (no Slurm)."""

import os
import subprocess
import sys
import time

from slurmkit import HOOKS

from tierfs.cli import slurm
from tierfs.cli.slurm import MAX_COMMENT_BYTES, Job, Log, declared_in, load_settings

TEN_MB = "x" * (10 << 20)
CAPPED = ("the job comment is {size}, more than the 64.0 KiB tierfs reads: its tierfs: "
          "tokens are ignored, nothing warmed (name a long list in a manifest: "
          "tierfs:manifest=FILE)")


def test_the_cap_is_one_clear_error_only_for_a_comment_with_tokens():
    assert declared_in(("y" * (MAX_COMMENT_BYTES - 20)) + " tierfs:warm=/d").paths == ("/d",)
    assert not declared_in(TEN_MB + " just text")
    d = declared_in(TEN_MB + " tierfs:warm=/mnt/data")
    assert d.errors == (CAPPED.format(size="10.0 MiB"),) and not d.paths


def test_children_never_inherit_the_comment(monkeypatch, tmp_path):
    # in-process, as the issue tried it: the comment is in the hook's own environment
    monkeypatch.setenv("SLURM_JOB_COMMENT", TEN_MB)
    assert "SLURM_JOB_COMMENT" not in slurm.child_env()
    rc, _, err = slurm._tierfs(["slurm", "check", "--config", str(tmp_path / "none")],
                                 time.monotonic() + 60)
    assert "Argument list too long" not in err and rc == 2 and "no such settings file" in err

    settings = tmp_path / "s.toml"
    settings.write_text(f'log_file = "{tmp_path}/hook.log"\n')
    monkeypatch.setenv("SLURM_SCRIPT_CONTEXT", "prolog_slurmd")
    monkeypatch.setenv("SLURM_JOB_COMMENT", TEN_MB + " tierfs:warm=/mnt/data")
    job = Job.from_env({"SLURM_JOB_ID": "31", "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root"})
    cfg = load_settings(str(settings))
    assert slurm.prolog(cfg, job, Log(cfg, "prolog", job.id)) == 0
    [line] = (tmp_path / "hook.log").read_text().splitlines()
    assert ("tierfs-slurm prolog job=31 user=root warm FAILED (best-effort: the job starts): "
            + CAPPED.format(size="10.0 MiB")) in line


def _hook(args, tmp_path, stdin: str, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    settings = tmp_path / "s.toml"
    settings.write_text(f'log_file = "{tmp_path}/hook.log"\n')
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=60,
                          cwd="/", env={**base, "TIERFS_SLURM_CONFIG": str(settings),
                                        "SLURM_JOB_ID": "32", "SLURM_JOB_UID": "0",
                                        "SLURM_JOB_USER": "root", **env})


def test_the_comment_on_stdin(tmp_path):
    argv = [sys.executable, "-m", "tierfs", "slurm", "prolog", "--comment-stdin"]
    r = _hook(argv, tmp_path, TEN_MB + " tierfs:warm=/mnt/data")
    assert r.returncode == 0 and len(r.stderr.splitlines()) == 1, r.stderr
    assert CAPPED.format(size="10.0 MiB") in r.stderr
    r = _hook(argv, tmp_path, "tierfs:warm=relative", SLURM_JOB_COMMENT="tierfs:warm=/ignored")
    assert "takes absolute paths, not 'relative'" in r.stderr  # stdin wins
    r = _hook(argv, tmp_path, TEN_MB)  # long, but nothing for tierfs: nothing to say
    assert (r.returncode, r.stderr) == (0, "")


def test_the_wrapper_hands_the_comment_over_on_stdin(tmp_path):
    # what slurmd can pass in the environment (an exec takes at most 128 KiB a string):
    # past the cap, so the line shows the comment reached the prolog whole
    comment = "z" * (100 << 10) + " tierfs:warm=/mnt/data"
    r = _hook([str(HOOKS / "prolog")], tmp_path, "", TIERFS_PYTHON=sys.executable,
              SLURM_SCRIPT_CONTEXT="prolog_slurmd", SLURM_JOB_COMMENT=comment)
    assert r.returncode == 0 and len(r.stderr.splitlines()) == 1, r.stderr
    assert CAPPED.format(size="100.0 KiB") in r.stderr
    r = _hook([str(HOOKS / "prolog")], tmp_path, "", TIERFS_PYTHON=sys.executable,
              SLURM_SCRIPT_CONTEXT="prolog_slurmd", SLURM_JOB_COMMENT="tierfs:warm=rel")
    assert "takes absolute paths, not 'rel'" in r.stderr
