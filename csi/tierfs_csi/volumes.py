"""Staging and publishing on the node: one tierfs daemon per volume, bind mounts per pod.

Everything the plugin knows lives on the node, not in the process, so a restarted plugin
carries on where the last one stopped (it "adopts" the running daemons):
  STATE_DIR/VOLUME/cache/         the daemon's cache dir (kept after unstage: the point)
  STATE_DIR/VOLUME/stage.json     staging path and the spec it was staged with
  STATE_DIR/VOLUME/credentials    the node-stage secret, 0600 (removed at unstage)
  STATE_DIR/VOLUME/targets/*.json one per published target: path and arguments
The mount table is the other half of the truth: a record without a mount is a volume
to mount again, a mount without a live daemon (ENOTCONN) is cleaned and remounted.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import grpc

from . import mounts
from .credentials import credentials_ini, daemon_env, write_private
from .errors import CsiError
from .options import StageSpec

log = logging.getLogger("tierfs_csi")

_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


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
    capability: str  # access mode and mount flags, as node.py summarizes them


class Volumes:
    def __init__(self, state_dir: str, tierfs: list[str] | None = None,
                 mount_timeout: float = 120.0):
        self.state_dir = os.path.abspath(state_dir)
        self.tierfs = tierfs or [sys.executable, "-m", "tierfs"]
        self.mount_timeout = mount_timeout
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ------------------------------------------------------------------ paths, records
    def volume_dir(self, volume_id: str) -> str:
        # the volume id names the cache dir an admin looks for; odd ids get a hash
        name = volume_id if _SAFE_ID.fullmatch(volume_id) and volume_id not in (".", "..") \
            else "id-" + hashlib.sha256(volume_id.encode()).hexdigest()[:32]
        return os.path.join(self.state_dir, name)

    def lock(self, volume_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(volume_id, threading.Lock())

    def _stage_file(self, volume_id: str) -> str:
        return os.path.join(self.volume_dir(volume_id), "stage.json")

    def _cred_file(self, volume_id: str) -> str:
        return os.path.join(self.volume_dir(volume_id), "credentials")

    def _target_file(self, volume_id: str, target: str) -> str:
        name = hashlib.sha256(target.encode()).hexdigest()[:32] + ".json"
        return os.path.join(self.volume_dir(volume_id), "targets", name)

    def stage_record(self, volume_id: str) -> StageRecord | None:
        data = _load(self._stage_file(volume_id))
        return StageRecord(**data) if data else None

    def _target_records(self, volume_id: str) -> list[TargetRecord]:
        d = os.path.join(self.volume_dir(volume_id), "targets")
        names = sorted(os.listdir(d)) if os.path.isdir(d) else []
        return [TargetRecord(**r) for r in (_load(os.path.join(d, n)) for n in names) if r]

    def daemon_pid(self, volume_id: str) -> int | None:
        """The pid of the volume's running daemon, or None.

        tierfs holds an flock on CACHE_DIR/lock for its life and writes its pid into it;
        the pid is believed only while the lock is held, so a pid reused by another
        process after the daemon died is never taken for it (nor signalled)."""
        path = os.path.join(self.volume_dir(volume_id), "cache", "lock")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else None
            fcntl.flock(fd, fcntl.LOCK_UN)  # nobody holds it: no daemon
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ stage
    def stage(self, volume_id: str, staging: str, spec: StageSpec,
              secrets: dict[str, str]) -> None:
        creds = credentials_ini(secrets) if secrets else None
        rec = self.stage_record(volume_id)
        if rec and rec.staging_path != staging and _live(rec.staging_path):
            raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                           f"volume {volume_id} is already staged at {rec.staging_path}")
        if mounts.find(staging):
            if mounts.is_stale(staging):
                log.warning("staging path %s: stale mount (daemon gone), remounting", staging)
                self._clear_stale(volume_id, staging)
            elif rec and rec.staging_path == staging and rec.spec == spec:
                log.info("volume %s already staged at %s (daemon pid %s)", volume_id,
                         staging, self.daemon_pid(volume_id))
                if creds:  # a rotated secret is used by the next start of the daemon
                    write_private(self._cred_file(volume_id), creds)
                return
            else:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"staging path {staging} is already mounted with other "
                               f"volume attributes or by another volume")
        os.makedirs(self.volume_dir(volume_id), mode=0o700, exist_ok=True)
        if creds:
            write_private(self._cred_file(volume_id), creds)
        else:
            _remove(self._cred_file(volume_id))
        # recorded before mounting: a plugin that dies mid-mount leaves a record to adopt
        record = StageRecord(volume_id, staging, spec.source, spec.options, spec.read_only)
        _save(self._stage_file(volume_id), asdict(record))
        try:
            self._mount(record)
        except CsiError:
            _remove(self._stage_file(volume_id))
            raise

    def _mount(self, rec: StageRecord) -> None:
        os.makedirs(rec.staging_path, exist_ok=True)
        cache = os.path.join(self.volume_dir(rec.volume_id), "cache")
        cred = self._cred_file(rec.volume_id)
        cmd = [*self.tierfs, "mount", rec.source, rec.staging_path, "--cache-dir", cache,
               *rec.spec.mount_args()]
        try:
            r = subprocess.run(cmd, env=daemon_env(cred if os.path.exists(cred) else None),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=self.mount_timeout)
        except subprocess.TimeoutExpired:
            raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"tierfs mount of {rec.source} on {rec.staging_path} did not "
                           f"answer within {self.mount_timeout:.0f}s") from None
        if r.returncode != 0:
            raise CsiError(grpc.StatusCode.INTERNAL,
                           f"tierfs mount {rec.source} failed: {_last_line(r.stderr)}")
        log.info("staged volume %s: %s on %s (daemon pid %s, cache %s)", rec.volume_id,
                 rec.source, rec.staging_path, self.daemon_pid(rec.volume_id), cache)

    def _clear_stale(self, volume_id: str, path: str) -> None:
        """Detach a dead mount; a daemon still holding the cache dir is ended (by PID)."""
        mounts.unmount_all(path)
        pid = self.daemon_pid(volume_id)
        if pid is not None:
            log.warning("ending tierfs daemon pid %d of the stale mount %s", pid, path)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0  # its lock goes with its last fd
            while self.daemon_pid(volume_id) is not None and time.monotonic() < deadline:
                time.sleep(0.05)

    def heal(self, volume_id: str) -> bool:
        """Remount a recorded volume whose staging mount went stale. True if it is live."""
        rec = self.stage_record(volume_id)
        if rec is None:
            return False
        if mounts.find(rec.staging_path) and not mounts.is_stale(rec.staging_path):
            return True
        if mounts.find(rec.staging_path):
            log.warning("volume %s: stale staging mount %s, remounting", volume_id,
                        rec.staging_path)
            self._clear_stale(volume_id, rec.staging_path)
            self._mount(rec)
            return True
        return False

    # ------------------------------------------------------------------ unstage
    def unstage(self, volume_id: str, staging: str) -> None:
        busy = [t.target_path for t in self._target_records(volume_id)
                if mounts.find(t.target_path)]
        if busy and mounts.find(staging):
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {volume_id} is still published at {', '.join(busy)}")
        if mounts.find(staging):
            if mounts.is_stale(staging):
                self._clear_stale(volume_id, staging)
            else:
                r = subprocess.run([*self.tierfs, "unmount", staging, "--timeout",
                                    str(int(self.mount_timeout))], stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, env=daemon_env(None))
                if r.returncode != 0 and mounts.find(staging):
                    raise CsiError(grpc.StatusCode.INTERNAL,
                                   f"tierfs unmount {staging} failed: {_last_line(r.stderr)}")
        _rmdir(staging)
        rec = self.stage_record(volume_id)
        if rec is None or rec.staging_path == staging:
            for path in (self._stage_file(volume_id), self._cred_file(volume_id)):
                _remove(path)
        log.info("unstaged volume %s from %s (cache kept)", volume_id, staging)

    # ------------------------------------------------------------------ publish
    def publish(self, want: TargetRecord) -> None:
        rec = self.stage_record(want.volume_id)
        if rec is None or rec.staging_path != want.staging_path \
                or not mounts.find(want.staging_path):
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {want.volume_id} is not staged at {want.staging_path}")
        self.heal(want.volume_id)
        target = want.target_path
        if mounts.find(target):
            if mounts.is_stale(target):
                log.warning("target %s: stale mount, binding again", target)
                mounts.unmount_all(target)
            elif _load(self._target_file(want.volume_id, target)) == asdict(want) \
                    and _same_fs(target, want.staging_path):
                return
            else:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"target path {target} is already published with other "
                               "arguments or another volume")
        os.makedirs(target, exist_ok=True)
        mounts.bind(want.staging_path, target, want.readonly)
        _save(self._target_file(want.volume_id, target), asdict(want))
        log.info("published volume %s at %s%s", want.volume_id, target,
                 " (read-only)" if want.readonly else "")

    def unpublish(self, volume_id: str, target: str) -> None:
        if mounts.find(target):
            mounts.unmount_all(target)
            log.info("unpublished volume %s from %s", volume_id, target)
        _rmdir(target)
        _remove(self._target_file(volume_id, target))

    # ------------------------------------------------------------------ stats
    def owns_path(self, volume_id: str, path: str) -> bool:
        rec = self.stage_record(volume_id)
        paths = {t.target_path for t in self._target_records(volume_id)}
        if rec:
            paths.add(rec.staging_path)
        entry = mounts.find(path)
        return path in paths and entry is not None and entry.fstype == mounts.TIERFS_FSTYPE

    # ------------------------------------------------------------------ restart
    def adopt_all(self) -> None:
        """At start-up: report the daemons this plugin takes over, remount stale ones."""
        if not os.path.isdir(self.state_dir):
            return
        for name in sorted(os.listdir(self.state_dir)):
            data = _load(os.path.join(self.state_dir, name, "stage.json"))
            if not data:
                continue
            rec = StageRecord(**data)
            with self.lock(rec.volume_id):
                try:
                    if self.heal(rec.volume_id):
                        log.info("adopted volume %s at %s (daemon pid %s)", rec.volume_id,
                                 rec.staging_path, self.daemon_pid(rec.volume_id))
                    else:
                        log.info("volume %s is recorded but not mounted at %s; it is "
                                 "mounted again by the next NodeStageVolume", rec.volume_id,
                                 rec.staging_path)
                except (CsiError, OSError) as exc:
                    log.error("volume %s: cannot remount %s: %s", rec.volume_id,
                              rec.staging_path, getattr(exc, "message", exc))


def _live(path: str) -> bool:
    return mounts.find(path) is not None and not mounts.is_stale(path)


def _same_fs(a: str, b: str) -> bool:
    ea, eb = mounts.find(a), mounts.find(b)
    return ea is not None and eb is not None and ea.dev == eb.dev


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


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir(path: str) -> None:
    """Remove the directory a mount was made on, if it is empty and no longer a mount."""
    if mounts.find(path):
        return
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.ENOTDIR, errno.EBUSY):
            raise


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no message"
    return line.removeprefix("tierfs: error: ")
