"""A real single-node Slurm (munged + slurmctld + slurmd, Debian's packages) in a temp folder.

Set up as ../shared/integrations/slurm.md measured it: every file under one folder S
(0755, so job users reach munge's socket), free ports, the node `idle` before use. Prolog=
and Epilog= are the project's own wrappers (systemd/slurm/prolog, epilog); the tierfs
settings they read are S/tierfs-slurm.toml, beside S/slurm.conf (the wrappers find them
through SLURM_CONF, which slurmd passes to its hooks).

Stopping: SIGTERM to the PIDs read from the three pid files right after the start (the
daemons delete their pid files as they exit), then SIGKILL to those PIDs only, if alive and
still the same program. A watchdog shell in its own session does the same if this process
dies without calling stop() (its stdin is a pipe from us: EOF means we are gone).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from mounting import free_port

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "systemd" / "slurm"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

# on stdin's EOF: kill each "PID:COMM" of $1 if /proc still shows that program under that
# PID, SIGKILL the ones left, remove the folder $2
_WATCHDOG = r"""
read -r _ || true
for pc in $1; do p=${pc%%:*}; c=${pc#*:}
  [ "$(cat /proc/$p/comm 2>/dev/null)" = "$c" ] && kill "$p"; done
sleep 3
for pc in $1; do p=${pc%%:*}; c=${pc#*:}
  [ "$(cat /proc/$p/comm 2>/dev/null)" = "$c" ] && kill -9 "$p"; done
rm -rf -- "$2"
exit 0
"""


class SlurmError(RuntimeError):
    pass


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _wait_gone(pids: dict[int, str], timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        alive = {p: c for p, c in pids.items() if _comm(p) == c}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def slurm_conf(s: Path, host: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""\
ClusterName=tierfs-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={s}/munge-run/munge.sock
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={s}/state
SlurmdSpoolDir={s}/spool/slurmd-%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd-%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
Prolog={HOOKS}/prolog
Epilog={HOOKS}/epilog
PrologFlags=Alloc
PrologEpilogTimeout=120
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A running single-node cluster. .dir (S), .host, .env (SLURM_CONF for clients),
    .settings (the tierfs-slurm.toml the hooks read), .hook_log (their log file)."""

    def __init__(self, s: Path, host: str):
        self.dir = s
        self.host = host
        self.conf = s / "slurm.conf"
        self.settings = s / "tierfs-slurm.toml"
        self.hook_log = s / "log" / "tierfs-slurm.log"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: dict[int, str] = {}
        self._watchdog: subprocess.Popen | None = None
        self._stopped = False

    # ------------------------------------------------------------------ clients
    def run(self, *argv: str, user: str | None = None, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        cmd = list(argv)
        if user:
            cmd = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", *cmd]
        r = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env,
                           timeout=60, cwd="/")
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: rc={r.returncode}: {r.stderr.strip()}")
        return r

    def sbatch(self, script: str, *, user: str = "nobody", comment: str | None = None,
               output: str | os.PathLike | None = None, workdir: str = "/tmp") -> str:
        """Submit `script` (its text, read by sbatch from stdin) as `user`; the job id."""
        argv = ["sbatch", "--parsable", f"--chdir={workdir}"]
        if comment is not None:
            argv.append(f"--comment={comment}")
        if output is not None:
            argv.append(f"--output={output}")
        r = self.run(*argv, user=user, input=script)
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (values with spaces, such as Comment, are cut
        at the first space: use it for JobState, Reason, ExitCode)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def wait_job(self, job_id: str, timeout: float = 120.0) -> dict[str, str]:
        """Wait until the job ended and its epilog finished (state leaves COMPLETING)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {info.get('JobState')} after {timeout}s "
                                 f"(reason {info.get('Reason')}); node: {self.node()}")
            time.sleep(0.1)

    def node(self) -> dict[str, str]:
        """State and Reason of the node (`scontrol show node -o`; Reason cut at a space)."""
        out = self.run("scontrol", "show", "node", "-o", self.host).stdout
        return dict(w.split("=", 1) for w in out.split() if "=" in w)

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-o", "%t").stdout.strip()

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.node_state()) != "idle":
            if time.monotonic() > deadline:
                raise SlurmError(f"node {state!r}, not idle after {timeout}s; "
                                 f"{self.dir}/log/slurmd-{self.host}.log")
            time.sleep(0.1)

    # ------------------------------------------------------------------ life cycle
    def _daemon(self, argv: list[str], pid_file: Path, comm: str) -> None:
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=60,
                           stdin=subprocess.DEVNULL, cwd=self.dir)
        if r.returncode != 0:
            raise SlurmError(f"{argv[0]} failed (rc={r.returncode}): {r.stderr.strip()}")
        deadline = time.monotonic() + 20
        while True:  # the daemon writes its pid file after forking
            try:
                pid = int(pid_file.read_text().strip())
                if _comm(pid) == comm:
                    self.pids[pid] = comm
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SlurmError(f"{argv[0]}: no live pid in {pid_file}")
            time.sleep(0.05)

    def start(self, settings: str) -> "Slurm":
        s = self.dir
        for sub in ("munge", "munge-run", "state", "spool", "log"):
            (s / sub).mkdir(mode=0o755)
        (s / "munge").chmod(0o700)
        key = s / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld = free_port()
        slurmd = free_port()  # never one handed out before: neither is bound yet
        self.conf.write_text(slurm_conf(s, self.host, ctld, slurmd))
        self.settings.write_text(settings)
        self._daemon(["munged", "--force", f"--key-file={key}",
                      f"--socket={s}/munge-run/munge.sock",
                      f"--pid-file={s}/munge-run/munged.pid",
                      f"--log-file={s}/munge/munged.log", f"--seed-file={s}/munge/munged.seed"],
                     s / "munge-run" / "munged.pid", "munged")
        self._start_watchdog()
        self._daemon(["slurmctld", "-f", str(self.conf)], s / "slurmctld.pid", "slurmctld")
        self._start_watchdog()
        self._daemon(["slurmd", "-f", str(self.conf), "-N", self.host],
                     s / f"slurmd-{self.host}.pid", "slurmd")
        self._start_watchdog()
        self.wait_idle()
        return self

    def _start_watchdog(self) -> None:
        """(Re)start the watchdog with the PIDs known so far."""
        self._end_watchdog()
        pids = " ".join(f"{p}:{c}" for p, c in self.pids.items())
        self._watchdog = subprocess.Popen(["bash", "-c", _WATCHDOG, "slurm-watchdog", pids,
                                           str(self.dir)],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)

    def _end_watchdog(self) -> None:
        w, self._watchdog = self._watchdog, None
        if w is None:
            return
        w.kill()  # SIGKILL first: closing its stdin would make it act
        w.wait(timeout=30)
        if w.stdin:
            w.stdin.close()

    def stop(self) -> None:
        """Stop the daemons by their PIDs (slurmd, slurmctld, munged), SIGKILL only those
        PIDs if they linger, then delete the folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._end_watchdog()
        for pid, comm in reversed(list(self.pids.items())):
            if _comm(pid) == comm:
                os.kill(pid, signal.SIGTERM)
        alive = _wait_gone(self.pids, 20)
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        left = _wait_gone(alive, 10)
        if left:
            raise SlurmError(f"still alive after SIGKILL: {left}")
        shutil.rmtree(self.dir, ignore_errors=True)


def start_slurm(settings: str = "") -> Slurm:
    """Start a cluster in a new folder under /tmp; the caller must call stop(). `settings`:
    the text of the tierfs-slurm.toml the hooks read ({log} is replaced by the log path)."""
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(p)]
    if missing:
        raise SlurmError(f"not installed: {', '.join(missing)} (run scripts/install.sh)")
    s = Path(tempfile.mkdtemp(prefix="tierfs-slurm."))
    s.chmod(0o755)  # job users must reach S/munge-run/munge.sock
    cluster = Slurm(s, socket.gethostname().split(".")[0])
    try:
        cluster.start(settings.replace("{log}", str(cluster.hook_log)))
    except BaseException:
        cluster.stop()
        raise
    atexit.register(cluster.stop)
    return cluster
