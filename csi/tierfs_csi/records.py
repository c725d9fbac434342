"""What the plugin knows about its volumes, kept on the node (not in the process), so a
restarted plugin carries on where the last one stopped:

  STATE_DIR/VOLUME/cache/          the daemon's cache dir (kept after unstage: the point)
  STATE_DIR/VOLUME/stage.json      the staging path and the spec it was staged with
  STATE_DIR/VOLUME/credentials     the node-stage secret, 0600 (removed at unstage)
  STATE_DIR/VOLUME/targets/*.json  one per published target: its path and arguments,
                                   and the pod it was published for (podInfoOnMount)
  STATE_DIR/VOLUME/workloads.json  workload -> the last pod of it that read here (warm_auto)
  STATE_DIR/VOLUME/mount/          an inline (ephemeral) volume's staging mount point
  STATE_DIR/ephemeral/*.json       kubelet's id of an inline volume -> the shared volume
                                   that serves it (pods declaring the same source share)

Files are replaced atomically (write, rename), so a crash leaves the old or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass

from .options import StageSpec

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_WORKLOADS = 1000  # per volume


@dataclass(frozen=True)
class StageRecord:
    volume_id: str
    staging_path: str
    source: str
    options: dict[str, str]
    read_only: bool

    @property
    def spec(self) -> StageSpec:
        return StageSpec(self.source, dict(self.options), self.read_only)


@dataclass(frozen=True)
class TargetRecord:
    volume_id: str
    target_path: str
    staging_path: str
    readonly: bool
    capability: str  # access mode and mount flags, as service.py summarizes them
    pod_uid: str = ""  # the pod it was published for (podInfoOnMount), "" if not told
    pod: str = ""  # "namespace/name"
    workload: str = ""  # "namespace/workload" for warm_auto
    declared: str = ""  # digest of the declared data (declared.py)
    ephemeral_id: str = ""  # kubelet's volume id, for an inline volume


class Records:
    def __init__(self, state_dir: str):
        self.state_dir = os.path.abspath(state_dir)

    def volume_dir(self, volume_id: str) -> str:
        # the volume id names the cache dir an admin looks for; odd ids get a hash
        safe = _SAFE_ID.fullmatch(volume_id) and volume_id not in (".", "..")
        name = volume_id if safe else "id-" + hashlib.sha256(volume_id.encode()).hexdigest()[:32]
        return os.path.join(self.state_dir, name)

    def cache_dir(self, volume_id: str) -> str:
        return os.path.join(self.volume_dir(volume_id), "cache")

    def credentials_file(self, volume_id: str) -> str:
        return os.path.join(self.volume_dir(volume_id), "credentials")

    def _stage_file(self, volume_id: str) -> str:
        return os.path.join(self.volume_dir(volume_id), "stage.json")

    def _target_file(self, volume_id: str, target: str) -> str:
        name = hashlib.sha256(target.encode()).hexdigest()[:32] + ".json"
        return os.path.join(self.volume_dir(volume_id), "targets", name)

    # ------------------------------------------------------------------ stage
    def stage(self, volume_id: str) -> StageRecord | None:
        data = _load(self._stage_file(volume_id))
        return StageRecord(**data) if data else None

    def save_stage(self, rec: StageRecord) -> None:
        _save(self._stage_file(rec.volume_id), asdict(rec))

    def drop_stage(self, volume_id: str) -> None:
        """Forget the staging and its secret; the cache dir stays."""
        remove(self._stage_file(volume_id))
        remove(self.credentials_file(volume_id))

    def all_stages(self) -> list[StageRecord]:
        if not os.path.isdir(self.state_dir):
            return []
        found = (_load(os.path.join(self.state_dir, n, "stage.json"))
                 for n in sorted(os.listdir(self.state_dir)))
        return [StageRecord(**d) for d in found if d]

    # ------------------------------------------------------------------ targets
    def target(self, volume_id: str, target: str) -> TargetRecord | None:
        data = _load(self._target_file(volume_id, target))
        return TargetRecord(**data) if data else None

    def targets(self, volume_id: str) -> list[TargetRecord]:
        d = os.path.join(self.volume_dir(volume_id), "targets")
        names = sorted(os.listdir(d)) if os.path.isdir(d) else []
        return [TargetRecord(**r) for r in (_load(os.path.join(d, n)) for n in names) if r]

    def save_target(self, rec: TargetRecord) -> None:
        _save(self._target_file(rec.volume_id, rec.target_path), asdict(rec))

    def drop_target(self, volume_id: str, target: str) -> None:
        remove(self._target_file(volume_id, target))

    # ------------------------------------------------------------------ warm_auto
    def last_pod(self, volume_id: str, workload: str) -> str | None:
        data = _load(os.path.join(self.volume_dir(volume_id), "workloads.json")) or {}
        uid = data.get(workload)
        return uid if isinstance(uid, str) else None

    def save_last_pod(self, volume_id: str, workload: str, pod_uid: str) -> None:
        path = os.path.join(self.volume_dir(volume_id), "workloads.json")
        data = _load(path) or {}
        data.pop(workload, None)
        data[workload] = pod_uid  # the newest last: the oldest go first past the bound
        _save(path, dict(list(data.items())[-MAX_WORKLOADS:]))

    # ------------------------------------------------------------------ inline volumes
    def ephemeral_staging(self, shared_id: str) -> str:
        return os.path.join(self.volume_dir(shared_id), "mount")

    def _alias_file(self, ephemeral_id: str) -> str:
        name = hashlib.sha256(ephemeral_id.encode()).hexdigest()[:32] + ".json"
        return os.path.join(self.state_dir, "ephemeral", name)

    def shared_of(self, ephemeral_id: str) -> str | None:
        data = _load(self._alias_file(ephemeral_id))
        shared = data.get("shared") if data else None
        return shared if isinstance(shared, str) else None

    def save_alias(self, ephemeral_id: str, shared_id: str) -> None:
        _save(self._alias_file(ephemeral_id), {"volume_id": ephemeral_id, "shared": shared_id})

    def drop_alias(self, ephemeral_id: str) -> None:
        remove(self._alias_file(ephemeral_id))


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _save(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
    os.replace(tmp, path)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
