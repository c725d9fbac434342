"""Staging and publishing on the node: one tierfs daemon per volume, bind mounts per pod.

Two sources of truth, both on the node: the records (records.py) say what was asked,
the mount table says what is. A record whose mount is live is adopted as it is; a mount
whose daemon is gone (ENOTCONN) is detached and mounted again from its record. Callers
hold the volume's lock (`lock`) around every call.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from . import mounts
from .credentials import credentials_ini, daemon_env, write_private
from .errors import CsiError
from .options import StageSpec
from .records import Records, StageRecord, TargetRecord, remove

log = logging.getLogger("tierfs_csi")


class Volumes:
    def __init__(self, state_dir: str, *, mount_timeout: float = 120.0,
                 fs_timeout: float = 10.0, systemd_scopes: bool = False):
        self.records = Records(state_dir)
        self.state_dir = self.records.state_dir
        self.tierfs = [sys.executable, "-m", "tierfs"]
        self.systemd_scopes = systemd_scopes
        self.mount_timeout = mount_timeout
        self.fs_timeout = fs_timeout  # how long a mount may take to answer a statfs
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def lock(self, volume_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(volume_id, threading.Lock())

    def daemon_pid(self, volume_id: str) -> int | None:
        """The pid of the volume's running daemon, or None.

        tierfs holds an flock on CACHE_DIR/lock for its life and writes its pid into it;
        the pid is believed only while the lock is held, so a pid reused by another
        process after the daemon died is never taken for it (nor signalled)."""
        try:
            fd = os.open(os.path.join(self.records.cache_dir(volume_id), "lock"), os.O_RDONLY)
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

    def _stale(self, path: str) -> bool:
        return mounts.is_stale(path, self.fs_timeout)

    def statvfs(self, path: str) -> os.statvfs_result:
        return mounts.statvfs(path, self.fs_timeout)

    # ------------------------------------------------------------------ stage
    def stage(self, volume_id: str, staging: str, spec: StageSpec,
              secrets: dict[str, str]) -> None:
        creds = credentials_ini(secrets) if secrets else None
        cred_file = self.records.credentials_file(volume_id)
        rec = self.records.stage(volume_id)
        if rec and rec.staging_path != staging and mounts.find(rec.staging_path):
            if not self._stale(rec.staging_path):
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"volume {volume_id} is already staged at {rec.staging_path}")
            self._clear_stale(volume_id, rec.staging_path)  # a dead one is not kept
        stale = False
        if mounts.find(staging):
            if self._stale(staging):
                log.warning("staging path %s: stale mount (daemon gone), remounting", staging)
                self._clear_stale(volume_id, staging)
                stale = True
            elif rec and rec.staging_path == staging and rec.spec == spec:
                log.info("volume %s already staged at %s (daemon pid %s)", volume_id,
                         staging, self.daemon_pid(volume_id))
                if creds:  # a rotated secret is used by the next start of the daemon
                    write_private(cred_file, creds)
                return
            else:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"staging path {staging} is already mounted with other "
                               f"volume attributes or by another volume")
        _refuse_non_empty(staging)
        os.makedirs(self.records.volume_dir(volume_id), mode=0o700, exist_ok=True)
        if creds:
            write_private(cred_file, creds)
        else:
            remove(cred_file)
        # recorded before mounting: a plugin that dies mid-mount leaves a record to adopt
        record = StageRecord(volume_id, staging, spec.source, spec.options, spec.read_only)
        self.records.save_stage(record)
        try:
            self._mount(record)
        except CsiError as exc:
            # a mount that failed left nothing; one that timed out may still come up,
            # and the kept record lets kubelet's retry adopt it
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                self.records.drop_stage(volume_id)
            raise
        if stale:
            self._rebind_stale_targets(volume_id)

    def _mount(self, rec: StageRecord) -> None:
        os.makedirs(rec.staging_path, exist_ok=True)
        cache = self.records.cache_dir(rec.volume_id)
        cred = self.records.credentials_file(rec.volume_id)
        cmd = [*self.tierfs, "mount", rec.source, rec.staging_path, "--cache-dir", cache,
               *rec.spec.mount_args()]
        if self.systemd_scopes:
            # the host's systemd moves the command (and the daemon it leaves behind) into
            # a scope of its own: out of the plugin container's cgroup, which the container
            # runtime kills whole when it stops the container. The command still runs here,
            # in this container's namespaces and with this environment.
            cmd = ["systemd-run", "--scope", "--quiet", "--collect",
                   f"--description=tierfs-csi volume {rec.volume_id}", "--", *cmd]
        try:
            r = subprocess.run(cmd, env=daemon_env(cred if os.path.exists(cred) else None),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=self.mount_timeout)
        except subprocess.TimeoutExpired:
            raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"tierfs mount of {rec.source} on {rec.staging_path} did not "
                           f"answer within {self.mount_timeout:g}s") from None
        if r.returncode != 0:
            message = _last_line(r.stderr)
            raise CsiError(_mount_error_code(message),
                           f"tierfs mount {rec.source} failed: {message}")
        log.info("staged volume %s: %s on %s (daemon pid %s, cache %s)", rec.volume_id,
                 rec.source, rec.staging_path, self.daemon_pid(rec.volume_id), cache)

    def _clear_stale(self, volume_id: str, path: str) -> None:
        """Detach a dead mount; a daemon still holding the cache dir is ended (by PID)."""
        mounts.unmount_all(path, self.fs_timeout)
        pid = self.daemon_pid(volume_id)
        if pid is not None:
            log.warning("ending tierfs daemon pid %d of the stale mount %s", pid, path)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0  # its lock goes with its last fd
            while self.daemon_pid(volume_id) is not None and time.monotonic() < deadline:
                time.sleep(0.05)

    def heal(self, volume_id: str) -> str | None:
        """Remount a recorded volume whose staging mount went stale.

        Returns "live" (its daemon answers), "remounted", or None (not mounted)."""
        rec = self.records.stage(volume_id)
        if rec is None or not mounts.find(rec.staging_path):
            return None
        if not self._stale(rec.staging_path):
            return "live"
        log.warning("volume %s: stale staging mount %s, remounting", volume_id,
                    rec.staging_path)
        self._clear_stale(volume_id, rec.staging_path)
        self._mount(rec)
        self._rebind_stale_targets(volume_id)
        return "remounted"

    def _rebind_stale_targets(self, volume_id: str) -> None:
        """Replace the dead binds of a remounted volume with live ones, at the same paths.

        A pod whose volumeMount has mountPropagation HostToContainer sees the new bind
        (its view is a slave of the host's), so it reads again without a restart; other
        pods keep the dead view until they are restarted."""
        for t in self.records.targets(volume_id):
            if mounts.find(t.target_path) and self._stale(t.target_path):
                mounts.unmount_all(t.target_path, self.fs_timeout)
                mounts.bind(t.staging_path, t.target_path, t.readonly)
                log.info("volume %s: bound %s again", volume_id, t.target_path)

    # ------------------------------------------------------------------ unstage
    def unstage(self, volume_id: str, staging: str, given: str | None = None) -> None:
        """`staging` is the resolved path (paths.py); `given` the path as the request
        named it, which a record made before paths were resolved may hold."""
        rec = self.records.stage(volume_id)
        if rec is None or rec.staging_path not in (staging, given):
            # not what this plugin staged for this volume: nothing to undo (the call is
            # idempotent), and another volume's or anybody's mount there is left alone
            log.info("unstage of volume %s at %r: not staged there by this plugin, nothing "
                     "to do", volume_id, staging)
            return
        busy = [t.target_path for t in self.records.targets(volume_id)
                if mounts.find(t.target_path)]
        if busy and mounts.find(staging):
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {volume_id} is still published at {', '.join(busy)}")
        if mounts.find(staging):
            if self._stale(staging):
                self._clear_stale(volume_id, staging)
            else:
                # tierfs unmount waits for the daemon, which finishes its uploads first
                r = subprocess.run([*self.tierfs, "unmount", staging, "--timeout",
                                    f"{self.mount_timeout:g}"], stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, env=daemon_env(None))
                if r.returncode != 0 and mounts.find(staging):
                    raise CsiError(grpc.StatusCode.INTERNAL,
                                   f"tierfs unmount {staging} failed: {_last_line(r.stderr)}")
        _rmdir(staging)
        self.records.drop_stage(volume_id)
        log.info("unstaged volume %s from %s (cache kept)", volume_id, staging)

    # ------------------------------------------------------------------ publish
    def publish(self, want: TargetRecord, before_bind=None) -> bool:
        """Bind the staging path at the target; `before_bind()` (the pod's warm) runs
        once the checks passed and before anything is recorded or bound, so a failure in
        it leaves nothing. False if it was published so already (nothing done)."""
        rec = self.records.stage(want.volume_id)
        if rec is None or rec.staging_path != want.staging_path \
                or not mounts.find(want.staging_path):
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {want.volume_id} is not staged at {want.staging_path}")
        self.heal(want.volume_id)
        target = want.target_path
        if mounts.find(target):
            if self._stale(target):
                log.warning("target %s: stale mount, binding again", target)
                mounts.unmount_all(target, self.fs_timeout)
            elif self.records.target(want.volume_id, target) == want \
                    and _same_fs(target, want.staging_path):
                return False
            else:
                raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                               f"target path {target} is already published with other "
                               "arguments or another volume")
        _refuse_non_empty(target)
        if before_bind is not None:
            before_bind()
        created = not os.path.lexists(target)
        os.makedirs(target, exist_ok=True)
        # recorded before binding: a plugin that dies in between leaves a record, so the
        # unpublish that follows still undoes the bind (it acts on recorded targets only)
        self.records.save_target(want)
        try:
            mounts.bind(want.staging_path, target, want.readonly)
        except BaseException:
            self.records.drop_target(want.volume_id, target)
            if created:
                _rmdir(target)
            raise
        log.info("published volume %s at %s%s", want.volume_id, target,
                 " (read-only)" if want.readonly else "")
        return True

    def unpublish(self, volume_id: str, target: str,
                  given: str | None = None) -> TargetRecord | None:
        """`target` is the resolved path (paths.py), where the bind is; `given` the path
        as the request named it, which a record made before paths were resolved may hold
        (its bind is at the resolved path all the same: the kernel resolved it)."""
        recorded = target
        if self.records.target(volume_id, target) is None and given is not None \
                and self.records.target(volume_id, given) is not None:
            recorded = given
        rec = self.records.target(volume_id, recorded)
        if rec is None:
            # not published there by this plugin for this volume: nothing to undo, and a
            # mount or directory someone else made is left alone
            log.info("unpublish of volume %s at %r: not published there by this plugin, "
                     "nothing to do", volume_id, target)
            return None
        if mounts.find(target):
            mounts.unmount_all(target, self.fs_timeout)
            log.info("unpublished volume %s from %s", volume_id, target)
        _rmdir(target)
        self.records.drop_target(volume_id, recorded)
        return rec

    def owns_path(self, volume_id: str, path: str) -> bool:
        """True if `path` is this volume's staging path or one of its targets, mounted."""
        rec = self.records.stage(volume_id)
        paths = {t.target_path for t in self.records.targets(volume_id)}
        if rec:
            paths.add(rec.staging_path)
        entry = mounts.find(path)
        return path in paths and entry is not None and entry.fstype == mounts.TIERFS_FSTYPE

    # ------------------------------------------------------------------ restart
    def adopt_all(self) -> None:
        """At start-up: report the daemons this plugin takes over, remount stale ones."""
        for rec in self.records.all_stages():
            with self.lock(rec.volume_id):
                try:
                    state = self.heal(rec.volume_id)
                    if state == "live":
                        log.info("adopted volume %s at %s (daemon pid %s)", rec.volume_id,
                                 rec.staging_path, self.daemon_pid(rec.volume_id))
                    elif state == "remounted":
                        log.info("remounted volume %s at %s: its daemon had died",
                                 rec.volume_id, rec.staging_path)
                    else:
                        log.info("volume %s is recorded but not mounted at %s; it is "
                                 "mounted again by the next NodeStageVolume", rec.volume_id,
                                 rec.staging_path)
                except (CsiError, OSError) as exc:
                    log.error("volume %s: cannot remount %s: %s", rec.volume_id,
                              rec.staging_path, getattr(exc, "message", exc))


def _same_fs(a: str, b: str) -> bool:
    ea, eb = mounts.find(a), mounts.find(b)
    return ea is not None and eb is not None and ea.dev == eb.dev


def _refuse_non_empty(path: str) -> None:
    """A mount over a directory with files would hide them (and whatever put them there
    did not expect a volume): kubelet hands the plugin missing or empty directories."""
    if mounts.find(path):
        return
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if names:
        raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                       f"{path} is a non-empty directory: refusing to mount over it")


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


# tierfs's one-line start-up errors (tierfs/backend/s3.py) -> the code that tells kubelet
# and the user what kind of problem it is; anything else is INTERNAL
_MOUNT_ERRORS = [
    (re.compile(r"^bucket '.*' does not exist"), grpc.StatusCode.NOT_FOUND),
    (re.compile(r"access denied|no S3 credentials"), grpc.StatusCode.PERMISSION_DENIED),
    (re.compile(r"endpoint unreachable"), grpc.StatusCode.UNAVAILABLE),
]


def _mount_error_code(message: str) -> grpc.StatusCode:
    for pattern, code in _MOUNT_ERRORS:
        if pattern.search(message):
            return code
    return grpc.StatusCode.INTERNAL


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no message"
    return line.removeprefix("tierfs: error: ")
