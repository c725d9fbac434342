"""Helpers of the CSI tests: the plugin as a real process driven over its unix socket the
way kubelet drives it, kubelet-style paths, and reads from another mount namespace.

  Plugin    a running `python -m tierfs_csi`: .identity .node .controller stubs,
            .start() / .stop() (SIGTERM) / .kill9(), .log_text()
  Kubelet   staging and pod target paths, request builders, the daemon's GET count, and
            a clean-up that unmounts whatever a test left (daemons stopped by PID)
  code_of   the status code and details of one call (OK when it succeeds)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
from mounting import (  # noqa: F401 - is_mounted: for the tests
    Daemon,
    free_port,
    is_mounted,
    mounts_under,
    parse_metrics,
    pid_alive,
    stop_pid,
    sum_samples,
)
from tierfs_csi import csi_pb2 as pb  # generated at install time (scripts/install.sh)
from tierfs_csi import csi_pb2_grpc as pb_grpc

DRIVER = "csi.tierfs.io"
MODE = pb.VolumeCapability.AccessMode


class Plugin(Daemon):
    def __init__(self, root: Path, env: dict[str, str] | None = None, extra_args=()):
        self.root = root
        self.extra_args = list(extra_args)
        self.socket = root / "plugin" / "csi.sock"
        self.state_dir = root / "state"
        self.kubelet_dir = root / "kubelet"  # Kubelet's root: the plugin mounts only under it
        self.log_path = root / "plugin.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.channel = None

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "tierfs_csi", "--endpoint", f"unix://{self.socket}",
                "--node-id", "node-1", "--state-dir", str(self.state_dir),
                "--kubelet-dir", str(self.kubelet_dir), *self.extra_args]

    def start(self, timeout: float = 30.0) -> "Plugin":
        self.kubelet_dir.mkdir(parents=True, exist_ok=True)
        self.spawn(self.argv, self.env)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.identity = pb_grpc.IdentityStub(self.channel)
        self.node = pb_grpc.NodeStub(self.channel)
        self.controller = pb_grpc.ControllerStub(self.channel)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tierfs-csi exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()}")
            try:
                self.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=2)
                return self
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> int | None:
        """SIGTERM by PID (the plugin's own shutdown), then SIGKILL."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None:
            return None
        rc = self.end(20)
        self.proc = None
        return rc

    def kill9(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.proc.kill()
        self.proc.wait()
        self.proc = None


def daemon_pid(state_dir: Path, volume_id: str) -> int | None:
    """The volume's tierfs daemon, from the pid tierfs writes into CACHE_DIR/lock, if alive."""
    try:
        pid = int((state_dir / volume_id / "cache" / "lock").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if pid_alive(pid) and b"tierfs" in cmdline else None


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


class Kubelet:
    """Paths and requests as kubelet makes them for one node."""

    def __init__(self, root: Path, rgw, bucket: str | None, shared_root: bool = True):
        self.root = root / "kubelet"
        self.root.mkdir(parents=True, exist_ok=True)
        # as on a node: kubelet's root is a shared mount, so mounts made under it reach
        # the pods' namespaces that are its slaves (mountPropagation HostToContainer)
        root_dir = str(self.root)
        for args in (["--bind", root_dir, root_dir], ["--make-rshared", root_dir]):
            if shared_root:
                subprocess.run(["mount", *args], check=True, capture_output=True)
        self.rgw = rgw
        self.bucket = bucket
        self.metrics_ports: dict[str, int] = {}

    def staging_path(self, volume_id: str) -> str:
        digest = hashlib.sha256(volume_id.encode()).hexdigest()
        return str(self.root / "plugins/kubernetes.io/csi" / DRIVER / digest / "globalmount")

    def target_path(self, pod: str, pv: str = "pv-data") -> str:
        return str(self.root / "pods" / pod / "volumes/kubernetes.io~csi" / pv / "mount")

    def attributes(self, volume_id: str, **extra: str) -> dict[str, str]:
        port = self.metrics_ports.setdefault(volume_id, free_port())
        attrs = {"bucket": self.bucket, "prefix": "data", "endpoint_url": self.rgw.endpoint,
                 "region": self.rgw.region, "chunk_size": "1M",
                 "metrics_addr": f"127.0.0.1:{port}"}
        attrs.update(extra)
        return {k: v for k, v in attrs.items() if v is not None}

    def secrets(self) -> dict[str, str]:
        return {"aws_access_key_id": self.rgw.access_key,
                "aws_secret_access_key": self.rgw.secret_key}

    @staticmethod
    def capability(mode: int = MODE.MULTI_NODE_MULTI_WRITER, block: bool = False,
                   mount_flags: tuple[str, ...] = ()) -> pb.VolumeCapability:
        cap = pb.VolumeCapability(access_mode=pb.VolumeCapability.AccessMode(mode=mode))
        if block:
            cap.block.SetInParent()
        else:
            cap.mount.mount_flags.extend(mount_flags)
        return cap

    def stage_request(self, volume_id: str, **attrs: str) -> pb.NodeStageVolumeRequest:
        Path(self.staging_path(volume_id)).parent.mkdir(parents=True, exist_ok=True)
        return pb.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=self.staging_path(volume_id),
            volume_capability=self.capability(), secrets=self.secrets(),
            volume_context=self.attributes(volume_id, **attrs))

    def publish_request(self, volume_id: str, pod: str, readonly: bool = False,
                        ) -> pb.NodePublishVolumeRequest:
        # kubelet creates the pod's volume dir, the plugin the mount point in it
        Path(self.target_path(pod)).parent.mkdir(parents=True, exist_ok=True)
        return pb.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=self.staging_path(volume_id),
            target_path=self.target_path(pod), volume_capability=self.capability(),
            readonly=readonly, volume_context=self.attributes(volume_id))

    def gets(self, volume_id: str) -> float:
        """GETs the volume's daemon has sent to the bucket so far (its metrics)."""
        url = f"http://127.0.0.1:{self.metrics_ports[volume_id]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return sum_samples(parse_metrics(text), "tierfs_backend_requests_total", op="get")

    def cleanup(self, state_dir: Path) -> None:
        """Unmount what a failed test left (binds first), then end the daemons by PID."""
        for point in sorted(mounts_under(self.root), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        if state_dir.is_dir():
            for vol in state_dir.iterdir():
                pid = daemon_pid(state_dir, vol.name)
                if pid is not None:
                    stop_pid(pid, 20)


def put_dataset(rgw, bucket: str, prefix: str = "data/") -> dict[str, bytes]:
    """A few files (one spanning several 1 MiB chunks), uploaded; {relative path: bytes}."""
    files = {
        "big.bin": os.urandom((3 << 20) + 12345),
        "small.txt": b"hello from the bucket\n",
        "nested/dir/part-0001.bin": os.urandom(200_000),
    }
    client = rgw.client()
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=prefix + name, Body=data)
    return files


def read_in_other_namespace(path: str) -> bytes:
    """cat `path` from a new mount namespace (as a container sees its volume)."""
    r = subprocess.run(["unshare", "--mount", "--propagation", "slave", "cat", path],
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout


def run_in_other_namespace(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--mount", "--propagation", "slave", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120)


def code_of(call, request) -> tuple[grpc.StatusCode, str]:
    """The status code and details a call answers (OK and "" when it succeeds)."""
    try:
        call(request, timeout=120)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def unique_volume() -> str:
    return f"pv-{uuid.uuid4().hex[:12]}"

