"""Who reads: a FUSE caller (pid, uid) as a Slurm job, a Kubernetes pod, or a uid.

A reader is a string: "job:<id>", "pod:<uid>" or "uid:<n>" (docs/tenants.md, "Readers and
usage"). It is found from the caller's /proc/PID/cgroup:

  Slurm, cgroup v2   0::/system.slice/slurmstepd.scope/job_1234/step_0/user/task_0
                     (slurmstepd_<node>.scope / slurm_<node>.scope with several slurmd)
  Slurm, cgroup v1   4:memory:/slurm/uid_1000/job_1234/step_0/task_0 (/slurm_<node>/...)
  Kubernetes v1      .../kubepods/burstable/pod0b6b9c3e-5c1a-4f0e-9d2b-1a2b3c4d5e6f/<ctr>
  Kubernetes v2      .../kubepods-burstable-pod0b6b9c3e_5c1a_4f0e_9d2b_1a2b3c4d5e6f.slice/
                     cri-containerd-<id>.scope (systemd driver: the UID's dashes are '_')

A Slurm without cgroup plugins (proctrack/linuxproc or pgid, task/none: the test suite's
cluster) leaves job processes in slurmd's cgroup; there the job is the nearest ancestor
process that is a root-owned `slurmstepd` ("slurmstepd: [1234.0]", "[1234.batch]").

What a user can set does not count: a cgroup under a delegated subtree (user.slice,
user@UID.service) can be named anything by its owner, and a process name or command line
anyone's; so only paths outside those, and slurmstepd processes of root, name a job.

`Callers` caches pid -> reader (bounded LRU, short TTL: pids are reused) so that reading
/proc happens once per process, not per request; it never raises.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from typing import Callable

_JOB_SEG = re.compile(r"job_(\d{1,12})")
_SLURM_SEG = re.compile(r"slurm(stepd)?([_-][\w.-]+)?(\.scope)?")
# a pod UID: 8-4-4-4-12 hex digits, '-' in cgroupfs paths, '_' in systemd slice names
_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
                  r"(?:\.slice)?")
_STEPD = re.compile(rb"slurmstepd: \[(\d{1,12})\.[\w-]+\]")
MAX_ANCESTORS = 64  # a walk up the process tree ends at init long before this


def _delegated(seg: str) -> bool:
    """A cgroup its owner may create children in (systemd delegation to a user)."""
    return seg == "user.slice" or seg.startswith("user@") or seg.startswith("user-")


def _path_reader(path: str) -> str | None:
    segs = [s for s in path.split("/") if s]
    slurm = kube = False
    for seg in segs:
        if _delegated(seg):
            return None
        if _SLURM_SEG.fullmatch(seg):
            slurm = True
        elif seg.startswith("kubepods") or "-kubepods" in seg:
            # kubepods, kubepods.slice, kubepods-burstable-pod<UID>.slice; a kubelet in a
            # container (kind) prefixes them: kubelet-kubepods-...
            kube = True
            m = _POD.fullmatch(seg.rpartition("-")[2])
            if m is not None:
                return "pod:" + m.group(1).replace("_", "-")
        elif kube and (m := _POD.fullmatch(seg)) is not None:
            return "pod:" + m.group(1).replace("_", "-")
        elif slurm and (m := _JOB_SEG.fullmatch(seg)) is not None:
            return f"job:{int(m.group(1))}"
    return None


def reader_of(cgroup_text: str, uid: int) -> str:
    """The reader named by a /proc/PID/cgroup text (v1, v2 or both), else "uid:<uid>"."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found = _path_reader(parts[2])
            if found is not None:
                return found
    return f"uid:{uid}"


def stepd_job(cmdline: bytes) -> str | None:
    """The job a slurmstepd's command line names ("slurmstepd: [1234.0]"), or None."""
    m = _STEPD.match(cmdline)
    return f"job:{int(m.group(1))}" if m else None


def _status(proc: str, pid: int) -> tuple[str, int, int] | None:
    """(name, parent pid, real uid) of a process, or None if it is gone."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            text = f.read(4096)
    except OSError:
        return None
    name, ppid, ruid = "", -1, -1
    for line in text.split(b"\n"):
        if line.startswith(b"Name:"):
            name = line[5:].strip().decode(errors="replace")
        elif line.startswith(b"PPid:"):
            ppid = int(line[5:])
        elif line.startswith(b"Uid:"):
            ruid = int(line[4:].split()[0])
            break  # PPid and Name come first
    return name, ppid, ruid


def _read(path: str, limit: int = 65536) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


class Callers:
    """pid -> reader, cached. A pid's answer is kept `ttl_s` seconds (a pid may be reused
    by another process after that) and at most `max_pids` answers (least recently used
    dropped first)."""

    def __init__(self, max_pids: int = 4096, ttl_s: float = 30.0, *,
                 clock: Callable[[], float] = time.monotonic, proc: str = "/proc") -> None:
        self.max_pids = max_pids
        self.ttl_s = ttl_s
        self._clock = clock
        self._proc = proc
        self._cache: OrderedDict[tuple[int, int], tuple[float, str]] = OrderedDict()

    def reader(self, pid: int, uid: int) -> str:
        found = self.cached(pid, uid)
        if found is None:
            found = self.resolve(pid, uid)
            self.store(pid, uid, found)
        return found

    # The daemon splits `reader` in three: `cached` on the trio thread (a dict lookup),
    # `resolve` in a worker thread (it reads /proc, up a process tree), `store` back on the
    # trio thread. The cache is touched on one thread only.

    def cached(self, pid: int, uid: int) -> str | None:
        """The reader remembered for this caller, or None (unknown or too old)."""
        key = (pid, uid)
        hit = self._cache.get(key)
        if hit is None or self._clock() - hit[0] >= self.ttl_s:
            return None
        self._cache.move_to_end(key)
        return hit[1]

    def resolve(self, pid: int, uid: int) -> str:
        """The reader of a caller, from /proc (no cache; safe in any thread); never raises."""
        try:
            return self._resolve(pid, uid)
        except Exception:  # noqa: BLE001 - garbage in /proc must not fail a read
            return f"uid:{uid}"

    def store(self, pid: int, uid: int, reader: str) -> None:
        key = (pid, uid)
        self._cache[key] = (self._clock(), reader)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_pids:
            self._cache.popitem(last=False)

    def _resolve(self, pid: int, uid: int) -> str:
        if pid <= 0:  # a request the kernel made on its own
            return f"uid:{uid}"
        raw = _read(f"{self._proc}/{pid}/cgroup")
        if raw is None:  # gone already
            return f"uid:{uid}"
        found = reader_of(raw.decode(errors="replace"), uid)
        if not found.startswith("uid:"):
            return found
        return self._stepd_ancestor(pid) or found

    def _stepd_ancestor(self, pid: int) -> str | None:
        """The job of the nearest root-owned slurmstepd above pid (Slurm without cgroups)."""
        seen: set[int] = set()
        cur = pid
        for _ in range(MAX_ANCESTORS):
            if cur <= 1 or cur in seen:
                return None
            seen.add(cur)
            st = _status(self._proc, cur)
            if st is None:
                return None
            name, ppid, ruid = st
            if name == "slurmstepd" and ruid == 0:
                cmd = _read(f"{self._proc}/{cur}/cmdline", 256)
                return stepd_job(cmd) if cmd is not None else None
            cur = ppid
        return None
