"""systemd/slurm/: the programs slurm.conf's Prolog=/Epilog= point at, run as slurmd does
(from an empty environment: no PATH), from a copy outside the checkout."""

import os
import shutil
import subprocess
import sys

import pytest

from slurmkit import HOOKS

pytestmark = pytest.mark.skipif(os.path.exists("/etc/default/tierfs-slurm")
                                or os.path.exists("/opt/tierfs"),
                                reason="this machine has a site install that the wrapper would use")


@pytest.fixture
def installed(public_dir):
    """The three files installed as docs/slurm.md says, away from the checkout's .venv."""
    d = public_dir / "lib" / "tierfs" / "slurm"
    d.mkdir(parents=True)
    for name in ("tierfs-slurm", "prolog", "epilog"):
        shutil.copy2(HOOKS / name, d / name)
    return d


def run(program, **env):
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), str(program)],
                          capture_output=True, text=True, timeout=60, cwd="/")


def test_without_tierfs_the_hook_says_so_and_exits_0(installed):
    for hook in ("prolog", "epilog"):
        r = run(installed / hook, SLURM_JOB_ID="5")
        assert (r.returncode, r.stdout) == (0, "")
        assert r.stderr.splitlines() == [f"tierfs-slurm {hook} job=5: no Python with tierfs "
                                         "found (set TIERFS_PYTHON in /etc/default/tierfs-slurm)"]


def test_tierfs_python_through_a_symlinked_prolog(installed, public_dir):
    # a site keeping its own prologs: Prolog=/etc/slurm/prolog.d/* with ours linked in
    prolog_d = public_dir / "prolog.d"
    prolog_d.mkdir()
    (prolog_d / "50-tierfs").symlink_to(installed / "prolog")
    settings = public_dir / "tierfs-slurm.toml"
    settings.write_text('log_file = ""\n')
    r = run(prolog_d / "50-tierfs", TIERFS_PYTHON=sys.executable, SLURM_JOB_ID="6",
            SLURM_JOB_UID="0", SLURM_JOB_USER="root", TIERFS_SLURM_CONFIG=str(settings),
            SLURM_SCRIPT_CONTEXT="prolog_slurmd", SLURM_JOB_COMMENT="tierfs:warm=relative")
    assert (r.returncode, r.stdout) == (0, "")
    [line] = r.stderr.splitlines()
    assert line.startswith("tierfs-slurm prolog job=6 user=root warm FAILED (best-effort: the "
                           "job starts): tierfs:warm= takes absolute paths, not 'relative' in ")


def test_the_wrapper_wants_prolog_or_epilog():
    r = run(HOOKS / "tierfs-slurm")
    assert (r.returncode, r.stderr) == (2, f"usage: {HOOKS}/tierfs-slurm prolog|epilog\n")
