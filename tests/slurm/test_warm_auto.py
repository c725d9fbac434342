"""Job manifests on the suite's real Slurm (docs/report.md, docs/slurm.md): a job step (as
nobody) reads two files of a tierfs mount; `tierfs report --manifest --job N` lists exactly
them, and `tierfs warm --manifest` of that output warms them; the next job of the same name
and user that asks for `tierfs:warm=auto` has its prolog warm them; a job of another name
has no last run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mounting import Mount

from tierfs.cli import slurmruns
pytestmark = pytest.mark.mount

MiB = 1 << 20
READ = {"data/a.bin": MiB + 17, "data/sub/b[1].bin": 5000}  # a glob character in a name
UNREAD = {"data/other.bin": 3000}


def tierfs(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *argv], capture_output=True,
                          text=True, timeout=120)


def hook_lines(slurm, job_id: str, hook: str) -> list[str]:
    text = slurm.hook_log.read_text() if slurm.hook_log.exists() else ""
    return [ln for ln in text.splitlines() if f" tierfs-slurm {hook} job={job_id} " in ln]


def cached(m: Mount) -> int:
    r = tierfs("status", m.mountpoint, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["disk"]["used"]


@pytest.fixture
def runs_file():
    """The node's record of last runs (slurmruns.RUNS_FILE) as it was before the test."""
    path = slurmruns.RUNS_FILE
    saved = Path(path).read_bytes() if os.path.exists(path) else None
    folder_existed = os.path.isdir(os.path.dirname(path))
    yield path
    if saved is not None:
        Path(path).write_bytes(saved)
    elif not folder_existed:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def test_a_job_s_manifest_warms_its_next_run(slurm, rgw, bucket, public_dir, runs_file, mounts):
    client = rgw.client()
    for key, size in {**READ, **UNREAD}.items():
        client.put_object(Bucket=bucket, Key=key, Body=hashlib.shake_256(key.encode()).digest(size))
    name = f"train-{uuid.uuid4().hex[:8]}"
    with mounts.start("--allow-other", "--chunk-size", "1M") as m:
        files = [str(m.path / k) for k in READ]
        # the step names the files after `sh -c '...' sh`: "$@" without the first
        first = slurm.run("srun", f"--job-name={name}", "--chdir=/", "sh", "-c",
                          'echo "$SLURM_JOB_ID"; cat "$@" > /dev/null', "sh", *files,
                          user="nobody").stdout.split()[0]
        slurm.wait_job(first)  # and its epilog, which records the run

        r = tierfs("report", m.mountpoint, "--manifest", "--job", first)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"# tierfs report --manifest --job {first}: 2 files")
        assert lines[1:] == sorted([f"{m.mountpoint}/data/a.bin",
                                    f"{m.mountpoint}/data/sub/b[[]1].bin"])
        none = tierfs("report", m.mountpoint, "--manifest", "--job", first, "--since", "0s")
        assert none.returncode == 0 and none.stdout.splitlines()[1:] == []

        manifest = public_dir / "run.warm"
        manifest.write_text(r.stdout)
        assert tierfs("evict", f"{m.mountpoint}/data").returncode == 0
        assert cached(m) == 0
        w = tierfs("warm", "--manifest", str(manifest), "--json")
        assert w.returncode == 0, w.stderr
        [summary] = [d for d in map(json.loads, w.stdout.splitlines())
                     if d.get("event") == "summary"]
        assert summary["files"] == 2 and summary["bytes"] == sum(READ.values())
        assert cached(m) == sum(READ.values())  # exactly the two files, not other.bin

        # the next run of the same name asks for warm=auto: its prolog warms the same files
        assert tierfs("evict", f"{m.mountpoint}/data").returncode == 0
        second = slurm.run("srun", f"--job-name={name}", "--comment=tierfs:warm=auto",
                           "--chdir=/", "sh", "-c", 'echo "$SLURM_JOB_ID"',
                           user="nobody").stdout.split()[0]
        slurm.wait_job(second)
        [prolog] = hook_lines(slurm, second, "prolog")
        assert "user=nobody warmed and pinned 2 paths mounts=1 files=2 " \
               f"bytes={sum(READ.values())} " in prolog, prolog
        assert f"warm=auto: 2 files read by job {first}, the last run of '{name}'" in prolog
        assert cached(m) == sum(READ.values())

        # another name has no last run: a note, and the job runs
        other = slurm.run("srun", f"--job-name={name}-other", "--comment=tierfs:warm=auto",
                          "--chdir=/", "sh", "-c", 'echo "$SLURM_JOB_ID"',
                          user="nobody").stdout.split()[0]
        slurm.wait_job(other)
        [prolog] = hook_lines(slurm, other, "prolog")
        assert f"warm=auto: no earlier run of '{name}-other' by nobody on this node" in prolog
    assert slurm.node_state() == "idle"
