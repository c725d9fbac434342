"""Jobs on a real Slurm whose Prolog/Epilog are the project's wrappers, reading a real tierfs
mount of the real Ceph RGW. Jobs run as `nobody`, so the mount is --allow-other and lives in
a 0755 folder; job output goes to a folder owned by nobody.

What the job itself prints is the evidence: the backend GET counter scraped at its first
line already holds every GET of the data set (the prolog warmed it before), and is the same
after the job has read everything (the reads came from the cache).
"""

import contextlib
import hashlib
import json
import subprocess
import sys
import time

import pytest
from mounting import Mount
from slurmkit import HOOKS

pytestmark = pytest.mark.mount

MiB = 1 << 20
DATA = {"data/a.bin": 3 * MiB + 17, "data/sub/b.bin": 2 * MiB, "data/sub/c.bin": 5000,
        "ckpt/run42/model.pt": 1 * MiB + 1}
GET = 'tierfs_backend_requests_total{op="get"}'

# bash: sh (dash) would do, but bash keeps the awk quoting readable
JOB = """#!/bin/bash
gets() {{ curl -s http://127.0.0.1:{port}/metrics | awk -v k='{get}' '$1 == k {{print $2}}'; }}
echo "gets-at-start $(gets)"
cd {mnt} && sha256sum {files}
echo "gets-at-end $(gets)"
"""


def payload(key: str, size: int) -> bytes:
    return hashlib.shake_256(key.encode()).digest(size)


@pytest.fixture
def dataset(rgw, bucket):
    client = rgw.client()
    for key, size in DATA.items():
        client.put_object(Bucket=bucket, Key=key, Body=payload(key, size))
    return {key: hashlib.sha256(payload(key, size)).hexdigest() for key, size in DATA.items()}


@pytest.fixture
def mount(dataset, mounts):
    with mounts.start("--allow-other", "--chunk-size", "1M") as m:
        yield m


def tierfs(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *argv], capture_output=True,
                          text=True, timeout=120)


def job_owners(m: Mount) -> list[str]:
    r = tierfs("status", m.mountpoint, "--json")
    assert r.returncode == 0, r.stderr
    return [o["owner"] for o in json.loads(r.stdout)["pinned"]["owners"]]


def hook_lines(slurm, job_id: str, hook: str) -> list[str]:
    """The hook's log lines for the job, without their timestamps. (The epilog may log a
    line for every job: unpin fails on stray mounts that other test runs left dead.)"""
    text = slurm.hook_log.read_text() if slurm.hook_log.exists() else ""
    want = f" tierfs-slurm {hook} job={job_id} "
    return [ln.split(" ", 1)[1] for ln in text.splitlines() if want in ln]


def gets_now(m: Mount) -> float:
    return m.counter("tierfs_backend_requests_total", op="get")


def job_script(m: Mount, files: list[str]) -> str:
    return JOB.format(port=m.metrics_port, get=GET, mnt=m.mountpoint, files=" ".join(files))


def test_prolog_warms_what_the_job_declares_before_its_first_line(slurm, mount, dataset,
                                                                   public_dir, job_out):
    mnt = mount.mountpoint
    manifest = public_dir / "run42.warm"  # the job's user must be able to read it
    manifest.write_text(f"# the rest of the set\n{mnt}/data/sub/*.bin\n\n{mnt}/ckpt\n")
    assert gets_now(mount) == 0
    job_id = slurm.sbatch(job_script(mount, sorted(DATA)), output=job_out / "job.out",
                          comment=f"run 42 tierfs:warm={mnt}/data/a.bin "
                                  f"tierfs:manifest={manifest} owner=nobody")
    info = slurm.wait_job(job_id)
    assert info["JobState"] == "COMPLETED", info
    out = (job_out / "job.out").read_text().splitlines()

    # the bytes are right
    assert [ln.split() for ln in out[1:-1]] == [[dataset[k], k] for k in sorted(DATA)]
    # every GET happened before the job's first line, none while it read
    chunks = sum(-(-size // MiB) for size in DATA.values())
    gets = float(out[0].split()[1])
    assert out[0].split()[0] == "gets-at-start" and gets >= chunks
    assert out[-1].split() == ["gets-at-end", out[0].split()[1]]
    assert gets_now(mount) == gets
    assert mount.counter("tierfs_read_bytes_total", source="backend") == 0
    # the prolog pinned the set for the job, the epilog released it
    [prolog] = hook_lines(slurm, job_id, "prolog")
    [epilog] = hook_lines(slurm, job_id, "epilog")
    # a.bin, the two files the glob matched, the ckpt folder (readable whole: one path)
    assert prolog.startswith(f"tierfs-slurm prolog job={job_id} user=nobody warmed and pinned "
                               f"4 paths mounts=1 files=4 bytes={sum(DATA.values())} "
                               f"bytes_cached_before=0 bytes_fetched={sum(DATA.values())} "
                               f"error_count=0 in ")
    assert epilog.startswith(f"tierfs-slurm epilog job={job_id} user=nobody unpinned 4 files")
    assert f"job:{job_id}" not in job_owners(mount)
    assert slurm.node_state() == "idle"


def test_a_job_declaring_data_on_two_mounts(rgw, bucket, slurm, mount, dataset, public_dir,
                                            job_out, mounts):
    # the same bucket mounted a second time, with its own cache: two daemons, two sockets
    with mounts.start("--allow-other", "--chunk-size", "1M", mnt="mnt2",
                      cache="cache2") as other:
        a, b = f"{mount.mountpoint}/data/a.bin", f"{other.mountpoint}/ckpt/run42/model.pt"
        job_id = slurm.sbatch(f"#!/bin/sh\nsha256sum {a} {b}\n", output=job_out / "job.out",
                              comment=f"tierfs:warm={a},{b}")
        assert slurm.wait_job(job_id)["JobState"] == "COMPLETED"
        sums = [ln.split()[0] for ln in (job_out / "job.out").read_text().splitlines()]
        assert sums == [dataset["data/a.bin"], dataset["ckpt/run42/model.pt"]]
        for m in (mount, other):  # each mount fetched its file in the prolog, the job nothing
            assert m.counter("tierfs_read_bytes_total", source="backend") == 0
            assert gets_now(m) > 0
        [prolog] = hook_lines(slurm, job_id, "prolog")
        [epilog] = hook_lines(slurm, job_id, "epilog")
        size = DATA["data/a.bin"] + DATA["ckpt/run42/model.pt"]
        assert f" warmed and pinned 2 paths mounts=2 files=2 bytes={size} " in prolog
        assert epilog.startswith(f"tierfs-slurm epilog job={job_id} user=nobody unpinned 2 files")


def test_a_job_whose_warm_fails_still_runs_and_the_node_stays_idle(slurm, mount, public_dir,
                                                                   job_out):
    mnt = mount.mountpoint
    secret = public_dir / "root-only.warm"  # the prolog is root; the job's user may not read it
    secret.write_text(f"{mnt}/data/a.bin\n")
    secret.chmod(0o600)
    job_id = slurm.sbatch("#!/bin/sh\necho the job ran\n", output=job_out / "job.out",
                          comment=f"tierfs:warm={mnt}/no/such/file.bin,{mnt}/data/*.nomatch "
                                  f"tierfs:manifest={secret}")
    info = slurm.wait_job(job_id)
    assert info["JobState"] == "COMPLETED", info
    assert (job_out / "job.out").read_text() == "the job ran\n"
    assert slurm.node_state() == "idle"
    assert slurm.node().get("Reason") is None
    [line] = hook_lines(slurm, job_id, "prolog")
    assert line.startswith(f"tierfs-slurm prolog job={job_id} user=nobody warm FAILED "
                           f"(best-effort: the job starts): cannot read manifest {secret} as "
                           f"nobody: Permission denied; missing for nobody: "
                           f"{mnt}/no/such/file.bin; matches nothing for nobody: "
                           f"{mnt}/data/*.nomatch in "), line
    assert f"job:{job_id}" not in job_owners(mount)
    assert gets_now(mount) == 0  # a/b.bin, named only in the root-only manifest, was not read


def test_each_job_holds_its_own_pin_while_it_runs(slurm, mount, public_dir, job_out):
    # two jobs at once on the node (2 CPUs) declare the same files; A runs until we let it go
    mnt, flag = mount.mountpoint, public_dir / "let-a-finish"
    comment = f"tierfs:warm={mnt}/data/sub"
    wait_for_flag = f"#!/bin/sh\necho started\nwhile [ ! -e {flag} ]; do sleep 0.1; done\n"
    a = slurm.sbatch(wait_for_flag, output=job_out / "a.out", comment=comment)
    try:
        deadline = time.monotonic() + 60
        while not (job_out / "a.out").exists() or not (job_out / "a.out").read_text():
            assert time.monotonic() < deadline, slurm.job(a)  # A's prolog is done once it prints
            time.sleep(0.05)
        b = slurm.sbatch("#!/bin/sh\ntrue\n", output=job_out / "b.out", comment=comment)
        assert slurm.wait_job(b)["JobState"] == "COMPLETED"
        assert slurm.job(a)["JobState"] == "RUNNING"
        assert f"job:{a}" in job_owners(mount) and f"job:{b}" not in job_owners(mount)
        assert hook_lines(slurm, b, "epilog")[0].startswith(
            f"tierfs-slurm epilog job={b} user=nobody unpinned 2 files")
    finally:
        flag.touch()
    assert slurm.wait_job(a)["JobState"] == "COMPLETED"
    assert f"job:{a}" not in job_owners(mount)




def run_hook(slurm, hook: str, job_id: str, **env: str) -> subprocess.CompletedProcess:
    """Run the project's wrapper as slurmd would: as root, from an empty environment (no
    PATH) - but without the SLURM_JOB_COMMENT and SLURM_SCRIPT_CONTEXT that Slurm >= 21.08
    adds, so the hook has to ask `scontrol show job`."""
    env = {"SLURM_JOB_ID": job_id, "SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534",
           "SLURM_JOB_USER": "nobody", "SLURM_CONF": str(slurm.conf), **env}
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in env.items()), str(HOOKS / hook)],
                          capture_output=True, text=True, timeout=120, cwd="/")


def test_without_the_comment_in_its_environment_the_prolog_asks_scontrol(slurm, mount, job_out):
    mnt = mount.mountpoint
    job_id = slurm.sbatch("#!/bin/sh\ncat " + mnt + "/data/sub/c.bin > /dev/null\n",
                          output=job_out / "job.out", comment=f"tierfs:warm={mnt}/data")
    assert slurm.wait_job(job_id)["JobState"] == "COMPLETED"
    size = sum(v for k, v in DATA.items() if k.startswith("data/"))
    gets = gets_now(mount)

    r = run_hook(slurm, "prolog", job_id)  # the job is still known to slurmctld
    assert (r.returncode, r.stdout) == (0, "")
    line = hook_lines(slurm, job_id, "prolog")[-1]
    assert line.startswith(f"tierfs-slurm prolog job={job_id} user=nobody warmed and pinned 1 "
                           f"paths mounts=1 files=3 bytes={size} bytes_cached_before={size} "
                           f"bytes_fetched=0 error_count=0 in "), line
    assert gets_now(mount) == gets
    # pinned for the job, with the site's pin_ttl (1h) as a safety net
    st = json.loads(tierfs("status", mount.mountpoint, "--json").stdout)
    [owner] = [o for o in st["pinned"]["owners"] if o["owner"] == f"job:{job_id}"]
    assert owner["files"] == 3 and 0 < owner["expires"] - time.time() <= 3600

    r = run_hook(slurm, "epilog", job_id)
    assert (r.returncode, r.stdout) == (0, "")
    assert hook_lines(slurm, job_id, "epilog")[-1].startswith(
        f"tierfs-slurm epilog job={job_id} user=nobody unpinned 3 files")
    assert f"job:{job_id}" not in job_owners(mount)


def test_a_warm_over_its_timeout_is_killed_and_logged(slurm, mount, public_dir):
    settings = public_dir / "tierfs-slurm.toml"
    settings.write_text(f'timeout = "1ms"\nlog_file = "{public_dir}/hook.log"\n')
    r = run_hook(slurm, "prolog", "999999", TIERFS_SLURM_CONFIG=str(settings),
                 SLURM_SCRIPT_CONTEXT="prolog_slurmd",
                 SLURM_JOB_COMMENT=f"tierfs:warm={mount.mountpoint}/data")
    assert r.returncode == 0
    line = "tierfs-slurm prolog job=999999 user=nobody warm FAILED (best-effort: the job " \
           "starts): timed out while checking the paths as nobody: nothing warmed"
    assert r.stderr.startswith(line) and len(r.stderr.splitlines()) == 1
    assert line in (public_dir / "hook.log").read_text()
    assert run_hook(slurm, "epilog", "999999", TIERFS_SLURM_CONFIG=str(settings)).returncode == 0


@contextlib.contextmanager
def site_settings(slurm, more: str):
    """The cluster's tierfs-slurm.toml with `more` lines appended (read by every hook run;
    keys it already has cannot be given again)."""
    before = slurm.settings.read_text()
    slurm.settings.write_text(before + more)
    try:
        yield
    finally:
        slurm.settings.write_text(before)


def test_a_set_over_max_bytes_is_not_warmed(slurm, mount, job_out):
    with site_settings(slurm, 'max_bytes = "4M"\n'):
        job_id = slurm.sbatch("#!/bin/sh\necho the job ran\n", output=job_out / "job.out",
                              comment=f"tierfs:warm={mount.mountpoint}/data")
        assert slurm.wait_job(job_id)["JobState"] == "COMPLETED"
    assert (job_out / "job.out").read_text() == "the job ran\n"
    [line] = hook_lines(slurm, job_id, "prolog")
    assert line.startswith(f"tierfs-slurm prolog job={job_id} user=nobody warm FAILED "
                           "(best-effort: the job starts): the set is 5.0 MiB, more than "
                           "max_bytes (4.0 MiB): nothing warmed in "), line
    assert gets_now(mount) == 0 and f"job:{job_id}" not in job_owners(mount)


def test_strict_mode_fails_the_prolog_and_slurm_drains_the_node(slurm, mount, job_out):
    mnt = mount.mountpoint
    job_id = None
    try:
        with site_settings(slurm, "strict = true\n"):
            job_id = slurm.sbatch("#!/bin/sh\necho the job ran\n", output=job_out / "job.out",
                                  comment=f"tierfs:warm={mnt}/no/such/file.bin")
            deadline = time.monotonic() + 60
            while slurm.node_state() not in ("drain", "drng"):
                assert time.monotonic() < deadline, slurm.node()
                time.sleep(0.1)
        assert slurm.node()["Reason"] == "Prolog"  # "Prolog error", cut at the space
        assert not (job_out / "job.out").exists()  # the job did not run here
        while (info := slurm.job(job_id))["JobState"] == "COMPLETING":  # its epilog
            assert time.monotonic() < deadline, info
            time.sleep(0.1)
        # requeued and held (Priority 0), as Slurm does without nohold_on_prolog_fail
        assert (info["JobState"], info["Priority"]) == ("PENDING", "0"), info
        [line] = hook_lines(slurm, job_id, "prolog")
        assert line.startswith(f"tierfs-slurm prolog job={job_id} user=nobody warm FAILED "
                               f"(strict: failing the prolog): missing for nobody: ")
    finally:
        if job_id:
            slurm.run("scancel", job_id, check=False)
        slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=resume", check=False)
    slurm.wait_idle()
