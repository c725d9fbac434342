"""A pod's business with its volume's daemon, done in a child process under one deadline.

The plugin serves gRPC from a pool of threads: a hung FUSE mount or daemon must not hold
one of them past the call's deadline, and fork() in a threaded process is unsafe. So the
plugin runs `python -m tierfs_csi.podctl` with one JSON request on stdin and kills it at
the deadline (`run`); the child talks to the daemon's control socket (tierfs.cli.ctl) and
prints one JSON answer. A killed child's warm is cancelled by the daemon (its client went
away) and pins nothing; run again, it resumes where it stopped (cached chunks cost
nothing).

  publish  name the pod to the daemon (namespace, name, service account, tenant), then
           warm what it declared (declared.py): the paths, the manifest's lines, and with
           warm_auto the files the workload's last pod read (job_files of pod:UID), pinned
           for pod:UID with `pin`; with `strict`, a failed warm releases what it pinned
  release  what the pod read (usage of reader pod:UID), unpin pod:UID, forget the pod
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tierfs.config import MANIFEST_MAX_PATHS, read_manifest_fd
from tierfs.cli.ctl import TierfsMount, request
from tierfs.errors import TierfsError
from tierfs.cli.slurm import batches

from .declared import rel_path
from .options import OptionError

_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_SUMMED = ("files", "bytes", "bytes_cached_before", "bytes_fetched", "error_count")
MAX_PROBLEMS = 20


def run(req: dict, deadline: float) -> dict:
    """The child's answer to `req`, or {"problems": [why]} if it failed or was killed at
    `deadline` (time.monotonic())."""
    left = max(deadline - time.monotonic(), 0.001)
    proc = subprocess.Popen([sys.executable, "-m", "tierfs_csi.podctl"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", cwd="/")
    try:
        out, err = proc.communicate(json.dumps(req), timeout=left)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"problems": [f"timed out after {left:.0f}s"], "timed_out": True}
    try:
        answer = json.loads(out)
    except ValueError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict):
        last = (err.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"problems": [last[:500]]}
    return answer


# ----------------------------------------------------------------------------- the child
def _mount(req: dict) -> TierfsMount:
    return TierfsMount(req["mount"], 0)  # the plugin's daemons run as root


def read_manifest(root: str, rel: str) -> tuple[list[str], list[str]]:
    """(paths, problems) of a manifest inside the volume: resolved, it must still lie
    inside it (a symlink out of the volume is refused), be a regular file (not a FIFO or
    a device) of at most 1 MiB; each line is a path of the volume like `warm`'s."""
    full = os.path.realpath(os.path.join(root, rel))
    if full != root and not full.startswith(root.rstrip("/") + "/"):
        return [], [f"warm_manifest {rel}: resolves outside the volume"]
    try:
        fd = os.open(full, _OPEN)
    except OSError as exc:
        return [], [f"warm_manifest {rel}: {exc.strerror}"]
    try:
        text = read_manifest_fd(fd, rel)
    except (TierfsError, OSError) as exc:
        return [], [f"warm_manifest {rel}: {getattr(exc, 'strerror', None) or exc}"]
    finally:
        os.close(fd)
    paths, problems = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            paths.append(rel_path(line, f"{rel}:{number}"))
        except OptionError as exc:
            problems.append(str(exc))
    if len(paths) > MANIFEST_MAX_PATHS:
        return [], [f"warm_manifest {rel} names more than {MANIFEST_MAX_PATHS} paths"]
    return paths, problems


def _publish(req: dict) -> dict:
    mount = _mount(req)
    pod = req.get("pod")
    if pod:
        request(mount, "pod", **pod)
    paths = [p or "." for p in req.get("paths", [])]
    problems: list[str] = []
    note = ""
    if req.get("manifest"):
        more, bad = read_manifest(req["mount"], req["manifest"])
        paths += [p or "." for p in more]
        problems += bad
    if req.get("auto_pod"):
        files = request(mount, "job_files", pod=req["auto_pod"])
        found = [f["path"] for f in files.get("files", [])]
        paths += found
        note = f"warm_auto: {len(found)} files read by the workload's last pod"
    elif req.get("auto"):
        note = "warm_auto: no earlier pod of this workload read through this volume here"
    summary = dict.fromkeys(_SUMMED, 0)
    paths = list(dict.fromkeys(paths))
    if paths:
        fields = {"pod": req["pin_for"]} if req.get("pin_for") else {}
        for batch in batches(paths):
            r = request(mount, "warm", paths=batch, **fields)
            for k in _SUMMED:
                summary[k] += int(r.get(k) or 0)
            problems += [f"{e.get('path')}: {e.get('error')}" for e in r.get("errors", [])]
    if problems and req.get("strict") and req.get("pin_for"):
        request(mount, "unpin", pod=req["pin_for"])  # the pod does not start: pin nothing
    return {"summary": summary, "problems": problems[:MAX_PROBLEMS],
            "problem_count": len(problems), "note": note}


def _release(req: dict) -> dict:
    mount, uid = _mount(req), req["pod_uid"]
    problems, row, unpinned = [], None, 0
    try:
        rows = request(mount, "usage", reader=f"pod:{uid}").get("rows", [])
        row = rows[0] if rows else None
    except TierfsError as exc:
        problems.append(f"usage: {exc}")
    try:
        unpinned = int(request(mount, "unpin", pod=uid).get("objects") or 0)
    except TierfsError as exc:
        problems.append(f"unpin: {exc}")
    try:
        request(mount, "pod", uid=uid, forget=True)
    except TierfsError as exc:
        problems.append(f"forget: {exc}")
    return {"usage": row, "unpinned": unpinned, "problems": problems}


def main() -> None:
    try:
        req = json.loads(sys.stdin.read())
        answer = (_publish if req["op"] == "publish" else _release)(req)
    except TierfsError as exc:
        answer = {"problems": [str(exc)]}
    except (ValueError, KeyError, TypeError) as exc:
        sys.stderr.write(f"tierfs-csi podctl: bad request: {exc}\n")
        sys.exit(2)
    sys.stdout.write(json.dumps(answer))


if __name__ == "__main__":
    main()
