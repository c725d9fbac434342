"""The pod behind a publish: named to the daemon, its declared data warmed (and pinned)
before NodePublishVolume returns, and at NodeUnpublishVolume its pins released, what it
read logged as one line and, with --accounting-file, appended there as JSON.

The work with the daemon is done by podctl's child under one deadline (warm_timeout);
this module decides what to ask and what an answer means:

- a failed or partial warm is one WARNING line in the plugin's log; with warm_strict it
  is also the gRPC error kubelet shows as the pod's FailedMount event (FAILED_PRECONDITION),
  and what the warm pinned is released (the pod does not start);
- pins are held by `pod:<UID>`, so unpublishing one pod releases its pins and never
  another's, on the same volume or not;
- the end-of-pod line is the Slurm epilog's, per pod:
  "pod NS/NAME: read 2.0 GiB, 97% from cache, 1 s stalled on the store".
"""

from __future__ import annotations

import logging
import time

import grpc

from tierfs.config import format_size
from tierfs.cli.slurm import append_json_line, escape

from . import podctl
from .declared import Declared, Pod
from .errors import CsiError
from .records import Records, TargetRecord

log = logging.getLogger("tierfs_csi")
RELEASE_TIMEOUT_S = 30.0


class Pods:
    def __init__(self, records: Records, accounting_file: str | None = None):
        self.records = records
        self.accounting_file = accounting_file

    def publish(self, volume_id: str, staging: str, pod: Pod | None,
                declared: Declared) -> None:
        """Name the pod and warm what it declared, before its bind exists."""
        if pod is None:
            if declared.warms:
                log.warning("volume %s: warm attributes ignored: kubelet did not say which "
                            "pod this is (podInfoOnMount: true in the CSIDriver)", volume_id)
            return
        started = time.monotonic()
        req: dict = {"op": "publish", "mount": staging,
                     "pod": {"uid": pod.uid, "namespace": pod.namespace, "name": pod.name,
                             "service_account": pod.service_account or None,
                             "tenant": declared.tenant_for(pod)},
                     "paths": list(declared.paths), "manifest": declared.manifest,
                     "auto": declared.auto, "strict": declared.strict,
                     "pin_for": pod.uid if declared.pin else None}
        req["pod"] = {k: v for k, v in req["pod"].items() if v is not None}
        if declared.auto:
            req["auto_pod"] = self.records.last_pod(volume_id, _workload_key(pod, declared))
        answer = podctl.run(req, started + declared.timeout_s)
        problems = answer.get("problems") or []
        took = time.monotonic() - started
        if not declared.warms:
            if problems:
                log.warning("pod %s: volume %s: the daemon was not told about the pod: %s",
                            pod.label, volume_id, escape("; ".join(problems))[:500])
            return
        s = answer.get("summary") or {}
        what = (f"{s.get('files', 0)} files, {format_size(s.get('bytes', 0))}, "
                f"{format_size(s.get('bytes_fetched', 0))} fetched" if s else "nothing")
        note = f"; {answer['note']}" if answer.get("note") else ""
        if not problems:
            log.info("pod %s: volume %s: warmed%s %s in %.1fs%s", pod.label, volume_id,
                     " and pinned" if declared.pin else "", what, took, note)
            return
        count = answer.get("problem_count") or len(problems)
        why = escape("; ".join(problems))[:1000] + (f" (and {count - len(problems)} more)"
                                                    if count > len(problems) else "")
        policy = "warm_strict: the mount fails" if declared.strict \
            else "best-effort: the pod starts"
        log.warning("pod %s: volume %s: warm FAILED (%s): %s; %s in %.1fs%s", pod.label,
                    volume_id, policy, why, what, took, note)
        if declared.strict:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"tierfs warm for pod {pod.label} failed (warm_strict): {why}")

    def unpublished(self, rec: TargetRecord, staging: str) -> None:
        """The pod's bind is gone: release its pins, log what it read, forget it."""
        if not rec.pod_uid:
            return
        answer = podctl.run({"op": "release", "mount": staging, "pod_uid": rec.pod_uid},
                            time.monotonic() + RELEASE_TIMEOUT_S)
        problems = answer.get("problems") or []
        row = answer.get("usage") or {}
        read = {k: int(v) for k, v in (row.get("read") or {}).items()
                if isinstance(v, int) and v >= 0}
        total = sum(read.values())
        parts = []
        if answer.get("unpinned"):
            parts.append(f"unpinned {answer['unpinned']} files")
        if problems:
            parts.append(f"release FAILED (pins end with the daemon or pin_ttl): "
                         f"{escape('; '.join(problems))[:500]}")
        if total:
            cached = read.get("memory", 0) + read.get("disk", 0)
            stall = float(row.get("stall_s") or 0.0)
            # the Slurm epilog's line, on a line of its own
            log.info("pod %s: read %s, %d%% from cache, %.0f s stalled on the store "
                     "(volume %s)", rec.pod, format_size(total), 100 * cached // total,
                     stall, rec.volume_id)
            if rec.workload:
                self.records.save_last_pod(rec.volume_id, rec.workload, rec.pod_uid)
            if self.accounting_file:
                append_json_line(self.accounting_file, {
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "pod_uid": rec.pod_uid, "pod": rec.pod,
                    "namespace": rec.pod.partition("/")[0], "volume": rec.volume_id,
                    "read_bytes": total, "read": read, "cached_bytes": cached,
                    "hit_ratio": round(cached / total, 4), "stall_s": round(stall, 3)})
        if parts:
            log.info("volume %s: %s", rec.volume_id, "; ".join(parts))


def _workload_key(pod: Pod, declared: Declared) -> str:
    return f"{pod.namespace}/{declared.workload_of(pod)}"


def target_fields(pod: Pod | None, declared: Declared) -> dict[str, str]:
    """The TargetRecord fields that say whose target it is."""
    if pod is None:
        return {"declared": declared.digest()}
    return {"pod_uid": pod.uid, "pod": pod.label, "workload": _workload_key(pod, declared),
            "declared": declared.digest()}
