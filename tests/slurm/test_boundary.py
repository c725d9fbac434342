"""The hooks as a privilege boundary (issue 10, V2, V3, V7), on the real Slurm and real mounts:
one deadline that nothing a job names can stretch, nothing warmed or pinned that the job's
user could not read (symlinks, `..`, `**` into a closed folder), log lines that cannot be
forged and a log only root reads, and an epilog that talks only to trusted mounts."""

import contextlib
import os
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest
from test_jobs import (  # noqa: F401 - dataset and mount are fixtures
    DATA,
    dataset,
    gets_now,
    hook_lines,
    job_owners,
    mount,
    run_hook,
    tierfs,
)

from tierfs.runpaths import control_socket, run_dir

pytestmark = pytest.mark.mount
MiB = 1 << 20


@contextlib.contextmanager
def replaced_settings(slurm, old: str, new: str):
    """The cluster's tierfs-slurm.toml with one line replaced while the block runs."""
    before = slurm.settings.read_text()
    assert old in before
    slurm.settings.write_text(before.replace(old, new))
    try:
        yield
    finally:
        slurm.settings.write_text(before)


def took(line: str) -> float:
    """The hook's own measure of itself: the line ends `in 1.2s`."""
    return float(line.rsplit(" in ", 1)[1].rstrip("s"))


def test_fifo_manifests_cannot_hold_the_prolog(slurm, mount, public_dir, job_out):
    # V2: three FIFOs named as manifests took 3 x 30 s with timeout = "20s", and Slurm
    # drained the node
    fifos = [public_dir / f"m{i}.warm" for i in range(3)]
    for f in fifos:
        os.mkfifo(f)
        f.chmod(0o666)
    comment = " ".join(f"tierfs:manifest={f}" for f in fifos)
    with replaced_settings(slurm, 'timeout = "90s"', 'timeout = "20s"'):
        job_id = slurm.sbatch("#!/bin/sh\necho the job ran\n", output=job_out / "job.out",
                              comment=f"{comment} tierfs:warm={mount.mountpoint}/data/a.bin")
        info = slurm.wait_job(job_id)
    assert info["JobState"] == "COMPLETED", info
    assert slurm.node_state() == "idle" and slurm.node().get("Reason") is None
    [line] = hook_lines(slurm, job_id, "prolog")
    assert " warm FAILED (best-effort: the job starts): " + "; ".join(
        f"manifest {f} is not a regular file" for f in fifos) in line
    assert " mounts=1 files=1 " in line  # what could be warmed still was
    assert took(line) < 20  # the hook's own clock: within the deadline (it waits on no FIFO)


def test_a_hung_file_system_is_cut_at_the_one_deadline(slurm, rgw, bucket, mount, public_dir):
    # V2: whatever the check as the user is stuck on - here a manifest on a mount whose
    # daemon hangs - the whole hook ends at `timeout`
    rgw.client().put_object(Bucket=bucket, Key="m.warm",
                            Body=f"{mount.mountpoint}/data/a.bin\n".encode())
    settings = public_dir / "tierfs-slurm.toml"
    settings.write_text(f'timeout = "3s"\nlog_file = "{public_dir}/hook.log"\n')
    manifest = f"{mount.mountpoint}/m.warm"
    os.kill(mount.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        r = run_hook(slurm, "prolog", "999998", TIERFS_SLURM_CONFIG=str(settings),
                     SLURM_SCRIPT_CONTEXT="prolog_slurmd",
                     SLURM_JOB_COMMENT=f"tierfs:manifest={manifest}")
        elapsed = time.monotonic() - started
    finally:
        os.kill(mount.pid, signal.SIGCONT)
    assert r.returncode == 0
    assert r.stderr.splitlines()[0].startswith(
        "tierfs-slurm prolog job=999998 user=nobody warm FAILED (best-effort: the job starts): "
        "timed out while checking the paths as nobody: nothing warmed in ")
    assert took(r.stderr.splitlines()[0]) < 3 + 5  # the hook's own clock: its deadline is 3 s
    assert elapsed < 3 + 40  # generous (two Python starts under load); a check per manifest
    # with a timeout of its own, as before, took 30 s more for each
    assert (mount.path / "m.warm").read_text() == f"{mount.mountpoint}/data/a.bin\n"  # alive


def test_symlinks_dotdot_and_globs_warm_only_what_the_user_reads(slurm, mount, dataset,
                                                                  public_dir, job_out):
    # V3: `[ -r "$p" ]` followed symlinks but the warm normalised `..` lexically, and `**`
    # pinned files in 0700 folders; the log told file counts and sizes
    mnt = mount.mountpoint
    os.chmod(f"{mnt}/data/sub", 0o700)  # through the mount: root's folder, closed to others
    u = public_dir / "u"
    (u / "deep" / "x" / "y").mkdir(parents=True)
    (u / "l").symlink_to(u / "deep" / "x" / "y")
    for p in (u, u / "deep", u / "deep" / "x", u / "deep" / "x" / "y"):
        p.chmod(0o755)
        os.lchown(p, 65534, 65534)
    os.lchown(u / "l", 65534, 65534)
    escape = f"{u}/l/../../mnt/data/sub"  # lexically {public_dir}/mnt/data/sub
    assert os.path.normpath(escape) == f"{mnt}/data/sub"
    slurm.hook_log.unlink(missing_ok=True)  # made anew: 0600
    job_id = slurm.sbatch("#!/bin/sh\necho the job ran\n", output=job_out / "job.out",
                          comment=f"tierfs:warm={escape},{mnt}/**,{mnt}/data/sub/b.bin")
    assert slurm.wait_job(job_id)["JobState"] == "COMPLETED"
    [line] = hook_lines(slurm, job_id, "prolog")
    warmed = DATA["data/a.bin"] + DATA["ckpt/run42/model.pt"]
    assert line.startswith(
        f"tierfs-slurm prolog job={job_id} user=nobody warm FAILED (best-effort: the job "
        f"starts): missing for nobody: {escape}; "
        f"1 entry below {mnt} that nobody cannot read left out (first: {mnt}/data/sub); "
        f"unreadable for nobody: {mnt}/data/sub/b.bin "
        f"mounts=1 files=2 bytes={warmed} bytes_cached_before=0 bytes_fetched={warmed} "
        "error_count=0 in "), line
    assert "c.bin" not in line  # nothing about what is inside the closed folder
    # nothing of the closed folder was fetched (GETs: a.bin's and model.pt's chunks only)
    assert gets_now(mount) == -(-DATA["data/a.bin"] // MiB) - (-DATA["ckpt/run42/model.pt"] // MiB)
    assert f"job:{job_id}" not in job_owners(mount)  # the epilog released the rest
    assert stat.S_IMODE(slurm.hook_log.stat().st_mode) == 0o600


def test_log_lines_cannot_be_forged_and_the_log_is_root_s(slurm, mount, public_dir):
    log = public_dir / "hook.log"
    log.write_text("")
    log.chmod(0o644)  # as an older tierfs left it
    settings = public_dir / "tierfs-slurm.toml"
    settings.write_text(f'log_file = "{log}"\n')
    forged = f"{mount.mountpoint}/\x1b[2KFORGED\x07\x9b"  # not whitespace: the token goes on
    r = run_hook(slurm, "prolog", "999997", TIERFS_SLURM_CONFIG=str(settings),
                 SLURM_SCRIPT_CONTEXT="prolog_slurmd",
                 SLURM_JOB_COMMENT=f"tierfs:warm={forged}")
    assert r.returncode == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and len(r.stderr.splitlines()) == 1
    assert f"matches nothing for nobody: {mount.mountpoint}/\\x1b[2KFORGED\\x07\\x9b in " in lines[0]
    assert r.stderr.splitlines()[0] in lines[0] and "\x1b" not in r.stderr
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


class GarbledSocket:
    """Stand in for a daemon's control socket: answer every request with a JSON line that
    is not an object (a broken or hostile daemon)."""

    def __init__(self, path: str):
        self.path, self.real = path, path + ".real"
        self.connections = 0
        os.rename(path, self.real)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(1 << 16)
                    conn.sendall(b'[1, 2]\n"nonsense"\n')

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        os.unlink(self.path)
        os.rename(self.real, self.path)


@pytest.fixture
def nobodys_run_dir():
    """Where nobody's own daemon keeps its socket (it must be nobody's); removed after if
    the test made it."""
    made = not os.path.isdir(run_dir(65534))
    if made:
        os.makedirs(run_dir(65534), mode=0o700)
        os.chown(run_dir(65534), 65534, 65534)
    try:
        yield run_dir(65534)
    finally:
        if made:
            subprocess.run(["rm", "-rf", "--", run_dir(65534)], check=False)


def test_hooks_use_only_trusted_mounts_and_one_bad_mount_skips_nothing(
        slurm, rgw, bucket, mount, dataset, public_dir, nobodys_run_dir, mounts):
    # V7: the epilog talked to every tierfs mount, users' own included, and one mount whose
    # daemon answered nonsense could skip the rest; the prolog warmed users' mounts too
    job = "990001"
    with mounts.start("--allow-other", mnt="bad", cache="cache-bad") as bad, \
         mounts.start("--allow-other", mnt="users", cache="cache-u", as_uid=65534) as users:
        # `users`: a mount the kernel records as made by uid 65534 (user_id=65534 in
        # mountinfo), as a user's own `tierfs mount` would be: the daemon runs with real
        # uid 65534 (effective root: a job user cannot run this checkout's Python under /root)
        r = run_hook(slurm, "prolog", "990002", SLURM_SCRIPT_CONTEXT="prolog_slurmd",
                     SLURM_JOB_COMMENT=f"tierfs:warm={users.mountpoint}/data/a.bin")
        assert r.returncode == 0
        assert r.stderr.startswith("tierfs-slurm prolog job=990002 user=nobody warm FAILED "
                                   "(best-effort: the job starts): not under a tierfs mount: "
                                   f"{users.mountpoint}/data/a.bin in "), r.stderr
        r = tierfs("warm", "--job", job, *(f"{m.mountpoint}/data/sub/c.bin"
                                           for m in (mount, bad, users)))
        assert r.returncode == 0, r.stderr
        # a deadline of its own: a hung mount left by another test must not make this slow
        settings = public_dir / "tierfs-slurm.toml"
        settings.write_text(f'timeout = "20s"\nlog_file = "{public_dir}/hook.log"\n')
        garbled = GarbledSocket(control_socket(bad.mountpoint, 0))
        try:
            r = run_hook(slurm, "epilog", job, TIERFS_SLURM_CONFIG=str(settings))
        finally:
            garbled.close()
        assert r.returncode == 0
        assert garbled.connections >= 1  # the bad mount was tried
        assert f"job:{job}" not in job_owners(mount)  # the good one released its pins
        assert f"job:{job}" in job_owners(bad)  # the bad one could not: pin_ttl ends it
        assert f"job:{job}" in job_owners(users)  # a user's own mount was not touched
        [line] = [ln.split(" ", 1)[1] for ln in (public_dir / "hook.log").read_text().splitlines()]
        assert line.startswith(f"tierfs-slurm epilog job={job} user=nobody unpinned 1 "
                               "files; unpin FAILED on "), line
        assert f"{bad.mountpoint}: " in line and users.mountpoint not in line
        assert gets_now(users) == 1  # c.bin, warmed by root above; nothing by the prolog
