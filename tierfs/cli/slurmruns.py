"""The last run of each Slurm job name on this node, for `tierfs:warm=auto` (docs/slurm.md).

The rule: a job's "last run" is the most recent job of the same user (uid) and the same
job name that ended on this node having read through a trusted tierfs mount. The epilog
records it (`record_run`), the prolog of a job that asks for `tierfs:warm=auto` looks it
up (`last_run`) and warms what that job read (`tierfs report --manifest --job ID` of each
trusted mount). Per node, because what a job read is known only to the mounts it read
through: a run on another node has nothing to say about this node's mounts.

One small JSON file, root's alone (0600 in a 0755 dir), replaced atomically; at most
MAX_RUNS names (the oldest dropped). A missing or unreadable file is "no last run", never
a failed hook.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

RUNS_FILE = "/var/lib/tierfs/slurm-runs.json"
MAX_RUNS = 1000


@dataclass(frozen=True)
class Run:
    job: str
    ended: float  # epoch seconds


def _key(uid: int, name: str) -> str:
    return f"{uid}\t{name}"


def load(path: str = RUNS_FILE) -> dict[str, Run]:
    """The recorded runs by "uid<TAB>name"; {} when there is no usable file."""
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(4 << 20))
        return {str(k): Run(str(v["job"]), float(v["ended"])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def last_run(uid: int, name: str, path: str = RUNS_FILE) -> Run | None:
    return load(path).get(_key(uid, name))


def record_run(uid: int, name: str, job: str, now: float, path: str = RUNS_FILE) -> None:
    """Make `job` the last run of (uid, name); OSError if the file cannot be written."""
    runs = load(path)
    runs.pop(_key(uid, name), None)
    runs[_key(uid, name)] = Run(job, now)
    kept = sorted(runs.items(), key=lambda kv: kv[1].ended)[-MAX_RUNS:]
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".slurm-runs.", dir=folder)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({k: {"job": r.job, "ended": r.ended} for k, r in kept}, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def job_name_from_scontrol(text: str) -> str:
    """The JobName= of `scontrol show job ID` (the rest of its line: a name may hold
    blanks; the multi-line form puts JobName last on the first line)."""
    for line in text.splitlines():
        at = line.find("JobName=")
        if at >= 0 and (at == 0 or line[at - 1].isspace()):
            return line[at + len("JobName="):].rstrip()
    return ""
