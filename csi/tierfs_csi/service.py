"""The CSI services: argument checks and answers; the node work is in volumes.py, the
pod's (warm, pins, its end-of-pod line) in pods.py.

Inline (ephemeral) volumes come with NodePublishVolume only: the plugin stages them itself,
at STATE_DIR/<shared>/mount, as a volume whose id is a digest of the source, the mount
options and the secret, so pods declaring the same bucket and prefix with the same
credentials on a node share one daemon and cache (and a pod with other credentials never
reads through another's daemon); the last pod's unpublish unstages it (the cache stays).

Every RPC goes through `_rpc`: it logs the call by its non-secret fields only (never
`secrets`, never attribute values), turns CsiError into the gRPC status the spec asks
for, and anything unforeseen into INTERNAL with its traceback in the plugin's log.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import stat

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from . import __version__, declared
from . import csi_pb2 as pb
from . import csi_pb2_grpc as pb_grpc
from .errors import CsiError, invalid
from .options import OptionError, stage_spec
from .paths import KubeletDir
from .pods import Pods, target_fields
from .records import TargetRecord
from .volumes import Volumes

log = logging.getLogger("tierfs_csi")

_LOGGED_FIELDS = ("volume_id", "staging_target_path", "target_path", "volume_path", "readonly")
_MODE = pb.VolumeCapability.AccessMode
_READER_ONLY = (_MODE.SINGLE_NODE_READER_ONLY, _MODE.MULTI_NODE_READER_ONLY)
_FS_TYPES = ("", "tierfs", "fuse.tierfs")


def _rpc(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
        name = method.__name__
        fields = " ".join(f"{f}={getattr(request, f)!r}" for f in _LOGGED_FIELDS
                          if f in request.DESCRIPTOR.fields_by_name)
        log.debug("%s %s", name, fields)
        try:
            return method(self, request, context)
        except CsiError as exc:
            log.warning("%s %s -> %s: %s", name, fields, exc.code.name, exc.message)
            context.abort(exc.code, exc.message)
        except TimeoutError as exc:  # a mount that does not answer: kubelet retries later
            message = f"{exc.filename}: {exc.strerror}"
            log.warning("%s %s -> UNAVAILABLE: %s", name, fields, message)
            context.abort(grpc.StatusCode.UNAVAILABLE, message)
        except OSError as exc:
            message = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            log.error("%s %s -> INTERNAL: %s", name, fields, message)
            context.abort(grpc.StatusCode.INTERNAL, message)
        except Exception:
            log.exception("%s %s failed", name, fields)
            context.abort(grpc.StatusCode.INTERNAL, f"{name}: internal error (see plugin log)")
    return wrapper


def _required(request, *names: str) -> None:
    for name in names:
        present = request.HasField(name) if name == "volume_capability" \
            else bool(getattr(request, name))
        if not present:
            raise invalid(f"{name} is required")
        if name.endswith("_path") and not os.path.isabs(getattr(request, name)):
            raise invalid(f"{name} must be an absolute path")


def _short(text: str) -> str:
    return repr(text) if len(text) <= 200 else repr(text[:197]) + "..."


def _shared_id(spec, secrets: dict[str, str]) -> str:
    """The id of the daemon an inline volume is served by: the same source, options and
    credentials give the same one (the secret only as part of a digest)."""
    text = json.dumps([spec.source, sorted(spec.options.items()), spec.read_only,
                       sorted(secrets.items())])
    return "inline-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _volume_id(volume_id: str) -> None:
    # ids name records and log lines: bounded, and no control character to forge a line
    if len(volume_id) > 256 or any(ord(c) < 32 or ord(c) == 127 for c in volume_id):
        raise invalid("volume_id must be at most 256 characters, without control characters")


def _capability(cap: pb.VolumeCapability) -> tuple[str, bool]:
    """(a summary to compare publish arguments with, whether the mode is reader-only)"""
    if cap.HasField("block"):
        raise invalid("volume_capability: block access is not supported; tierfs volumes "
                      "are file systems (volumeMode: Filesystem)")
    if not cap.HasField("mount"):
        raise invalid("volume_capability.mount is required (access type mount)")
    if cap.mount.fs_type not in _FS_TYPES:
        raise invalid(f"volume_capability.mount.fs_type {cap.mount.fs_type!r} is not "
                      "supported; leave it empty (or 'tierfs')")
    mode = cap.access_mode.mode
    if mode == _MODE.UNKNOWN:
        raise invalid("volume_capability.access_mode is required")
    summary = f"{_MODE.Mode.Name(mode)}|{','.join(cap.mount.mount_flags)}"
    return summary, mode in _READER_ONLY


class Identity(pb_grpc.IdentityServicer):
    def __init__(self, driver_name: str, volumes: Volumes):
        self.driver_name = driver_name
        self.volumes = volumes
        self._last_problem: str | None = None

    @_rpc
    def GetPluginInfo(self, request, context):
        return pb.GetPluginInfoResponse(name=self.driver_name, vendor_version=__version__)

    @_rpc
    def GetPluginCapabilities(self, request, context):
        return pb.GetPluginCapabilitiesResponse()  # node only: no controller service

    @_rpc
    def Probe(self, request, context):
        problem = tierfs_problem(self.volumes.state_dir, self.volumes.systemd_scopes)
        if problem != self._last_problem:  # Probe is polled: log changes only
            if problem:
                log.warning("not ready: %s", problem)
            elif self._last_problem:
                log.info("ready again")
            self._last_problem = problem
        return pb.ProbeResponse(ready=BoolValue(value=problem is None))


def tierfs_problem(state_dir: str, systemd_scopes: bool = False) -> str | None:
    """Why tierfs cannot run on this node, or None."""
    try:
        if not stat.S_ISCHR(os.stat("/dev/fuse").st_mode):
            return "/dev/fuse is not a character device"
    except OSError:
        return "/dev/fuse is missing (the plugin container must be privileged)"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not on PATH (install fuse3)"
    if importlib.util.find_spec("tierfs") is None:
        return "the tierfs package is not installed"
    if not os.access(state_dir, os.W_OK | os.X_OK):
        return f"state dir {state_dir} is not writable"
    if systemd_scopes:
        if shutil.which("systemd-run") is None:
            return "--systemd-scopes: systemd-run is not on PATH"
        if not os.path.exists("/run/systemd/private"):
            return ("--systemd-scopes: no systemd at /run/systemd/private (mount the "
                    "host's /run/systemd into the plugin container)")
    return None


class Controller(pb_grpc.ControllerServicer):
    """Only ControllerGetCapabilities, so sanity suites can drive a node-only plugin."""

    @_rpc
    def ControllerGetCapabilities(self, request, context):
        rpc = pb.ControllerServiceCapability.RPC(type=pb.ControllerServiceCapability.RPC.UNKNOWN)
        return pb.ControllerGetCapabilitiesResponse(
            capabilities=[pb.ControllerServiceCapability(rpc=rpc)])


class Node(pb_grpc.NodeServicer):
    def __init__(self, node_id: str, volumes: Volumes, kubelet_dir: KubeletDir,
                 pods: Pods | None = None):
        self.node_id = node_id
        self.volumes = volumes
        self.kubelet_dir = kubelet_dir  # staging and target paths must lie under it
        self.pods = pods or Pods(volumes.records)

    @_rpc
    def NodeGetInfo(self, request, context):
        return pb.NodeGetInfoResponse(node_id=self.node_id)

    @_rpc
    def NodeGetCapabilities(self, request, context):
        rpc = pb.NodeServiceCapability.RPC
        return pb.NodeGetCapabilitiesResponse(capabilities=[
            pb.NodeServiceCapability(rpc=rpc(type=t))
            for t in (rpc.STAGE_UNSTAGE_VOLUME, rpc.GET_VOLUME_STATS)])

    @_rpc
    def NodeStageVolume(self, request, context):
        _required(request, "volume_id", "staging_target_path", "volume_capability")
        _volume_id(request.volume_id)
        # the resolved path is what is created, mounted and recorded (paths.py)
        staging = self.kubelet_dir.check("staging_target_path", request.staging_target_path)
        _, reader_only = _capability(request.volume_capability)
        try:
            declared.parse(dict(request.volume_context))  # a bad one fails here too
            spec = stage_spec(declared.strip(dict(request.volume_context)),
                              list(request.volume_capability.mount.mount_flags), reader_only,
                              staging, node_ip=os.environ.get("POD_IP") or None)
            with self.volumes.lock(request.volume_id):
                self.volumes.stage(request.volume_id, staging, spec, dict(request.secrets))
        except OptionError as exc:
            raise invalid(str(exc)) from None
        return pb.NodeStageVolumeResponse()

    @_rpc
    def NodeUnstageVolume(self, request, context):
        _required(request, "volume_id", "staging_target_path")
        with self.volumes.lock(request.volume_id):
            self.volumes.unstage(request.volume_id,
                                 self.kubelet_dir.lookup(request.staging_target_path),
                                 given=request.staging_target_path)
        return pb.NodeUnstageVolumeResponse()

    @_rpc
    def NodePublishVolume(self, request, context):
        ctx = dict(request.volume_context)
        ephemeral = declared.is_ephemeral(ctx)
        _required(request, "volume_id", "target_path", "volume_capability",
                  *(() if ephemeral else ("staging_target_path",)))
        _volume_id(request.volume_id)
        target = self.kubelet_dir.check("target_path", request.target_path)
        summary, reader_only = _capability(request.volume_capability)
        try:
            wanted = declared.parse(ctx)
            pod = declared.pod_of(ctx)
        except OptionError as exc:
            raise invalid(str(exc)) from None
        if ephemeral:
            self._publish_inline(request, ctx, target, summary, reader_only, wanted, pod)
            return pb.NodePublishVolumeResponse()
        want = TargetRecord(request.volume_id, target,
                            self.kubelet_dir.lookup(request.staging_target_path),
                            request.readonly or reader_only, summary,
                            **target_fields(pod, wanted))
        with self.volumes.lock(request.volume_id):
            self.volumes.publish(want, lambda: self.pods.publish(
                want.volume_id, want.staging_path, pod, wanted))
        return pb.NodePublishVolumeResponse()

    def _publish_inline(self, request, ctx: dict[str, str], target: str, summary: str,
                        reader_only: bool, wanted: declared.Declared,
                        pod: declared.Pod | None) -> None:
        secrets = dict(request.secrets)
        try:
            # the staging path is the plugin's own (below); the spec does not depend on it
            spec = stage_spec(declared.strip(ctx), list(request.volume_capability.mount
                                                        .mount_flags), reader_only,
                              "/", node_ip=os.environ.get("POD_IP") or None)
        except OptionError as exc:
            raise invalid(str(exc)) from None
        shared = _shared_id(spec, secrets)
        records = self.volumes.records
        known = records.shared_of(request.volume_id)
        if known is not None and known != shared:
            raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                           f"inline volume {_short(request.volume_id)} is already published "
                           "with other attributes")
        staging = records.ephemeral_staging(shared)
        want = TargetRecord(shared, target, staging, request.readonly or reader_only,
                            summary, **target_fields(pod, wanted),
                            ephemeral_id=request.volume_id)
        with self.volumes.lock(shared):
            try:
                self.volumes.stage(shared, staging, spec, secrets)
            except OptionError as exc:
                raise invalid(str(exc)) from None
            records.save_alias(request.volume_id, shared)
            try:
                self.volumes.publish(want, lambda: self.pods.publish(shared, staging, pod,
                                                                     wanted))
            except BaseException:
                if not records.targets(shared):
                    self.volumes.unstage(shared, staging)  # no pod uses it: nothing kept
                    records.drop_alias(request.volume_id)
                raise

    @_rpc
    def NodeUnpublishVolume(self, request, context):
        _required(request, "volume_id", "target_path")
        shared = self.volumes.records.shared_of(request.volume_id)
        volume_id = shared or request.volume_id
        with self.volumes.lock(volume_id):
            rec = self.volumes.unpublish(volume_id,
                                         self.kubelet_dir.lookup(request.target_path),
                                         given=request.target_path)
            if rec is not None:
                self.pods.unpublished(rec, rec.staging_path)
            if shared is not None:
                if not self.volumes.records.targets(shared):
                    # the last pod of an inline volume: its daemon goes, its cache stays
                    self.volumes.unstage(shared, self.volumes.records.ephemeral_staging(shared))
                self.volumes.records.drop_alias(request.volume_id)
        return pb.NodeUnpublishVolumeResponse()

    @_rpc
    def NodeGetVolumeStats(self, request, context):
        if not request.volume_id:
            raise invalid("volume_id is required")
        if not request.volume_path:
            raise invalid("volume_path is required")
        path = self.kubelet_dir.lookup(request.volume_path)
        # only what this plugin staged or published for the volume, by the records and the
        # mount table (a stat() of a mount whose daemon is stopped would block); anything
        # else, relative paths included, is NOT_FOUND without looking at it, so the call
        # tells nothing about the host's other files
        if not os.path.isabs(path) or not self.volumes.owns_path(request.volume_id, path):
            raise CsiError(grpc.StatusCode.NOT_FOUND,
                           f"volume {_short(request.volume_id)} is not staged or published "
                           f"at {_short(path)}")
        s = self.volumes.statvfs(path)  # tierfs answers with its cache budget and usage
        unit = pb.VolumeUsage
        return pb.NodeGetVolumeStatsResponse(usage=[
            unit(unit=unit.BYTES, total=s.f_blocks * s.f_frsize,
                 available=s.f_bavail * s.f_frsize,
                 used=(s.f_blocks - s.f_bfree) * s.f_frsize),
            unit(unit=unit.INODES, total=s.f_files, available=s.f_favail,
                 used=s.f_files - s.f_ffree),
        ])
