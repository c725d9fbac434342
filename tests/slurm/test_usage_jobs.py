"""Reads attributed to a Slurm job (docs/tenants.md, "Readers"), on the suite's real Slurm:
a job step (srun, as nobody) reads a file of a tierfs mount; the mount counts those bytes
to job:N - the test cluster has no cgroup plugins, so the job is found from the reader's
slurmstepd ancestor - `tierfs usage --by job` shows it, and the epilog's line says what the
job read."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from mounting import Mount

pytestmark = pytest.mark.mount

SIZE = 2 * (1 << 20) + 4321


def usage_rows(m: Mount, *args: str) -> dict[str, dict]:
    r = subprocess.run([sys.executable, "-m", "tierfs", "usage", m.mountpoint, "--json", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {row["name"]: row for row in json.loads(r.stdout)["rows"]}


def test_a_job_s_reads_are_counted_to_the_job(slurm, rgw, bucket, public_dir, mounts):
    data = hashlib.shake_256(b"usage").digest(SIZE)
    rgw.client().put_object(Bucket=bucket, Key="data/job.bin", Body=data)
    with mounts.start("--allow-other", "--chunk-size", "1M") as m:
        path = m.path / "data/job.bin"
        r = slurm.run("srun", "--chdir=/", "sh", "-c",
                      f'echo "$SLURM_JOB_ID"; sha256sum {path}', user="nobody")
        job_id, digest = r.stdout.split()[0], r.stdout.split()[1]
        assert digest == hashlib.sha256(data).hexdigest()
        slurm.wait_job(job_id)  # and its epilog

        rows = usage_rows(m, "--by", "job")
        row = rows[f"job:{job_id}"]
        assert sum(row["read"].values()) == SIZE and row["read"]["backend"] > 0
        assert [n for n in rows if n.startswith("job:")] == [f"job:{job_id}"]
        assert "uid:65534" not in usage_rows(m, "--by", "uid")  # the job, not its user

        # the epilog asked the mount for the job's usage and logged it on its line
        log = slurm.hook_log.read_text()
        [line] = [ln for ln in log.splitlines() if f" tierfs-slurm epilog job={job_id} " in ln]
        assert f"job {job_id}: read 2.0 MiB, " in line, line
