"""The plugin in a "container" under a real systemd (systemd-nspawn, tests/systemd/nspawn.py):
a transient service stands for the plugin container, and `systemctl kill` of it ends
every process in its cgroup, as a container runtime does when it stops a container.
With --systemd-scopes the daemons live in scopes of their own and keep serving; without,
they die with the container and the next plugin remounts the volume and binds the pod's
path again."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpc
import pytest
from csikit import Kubelet, pb, pb_grpc, put_dataset

pytestmark = pytest.mark.mount
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "systemd"))  # `import nspawn`

from nspawn import Container, rootfs  # noqa: E402


class ContainerPlugin:
    """tierfs-csi as a service unit inside the nspawn machine, driven from the host."""

    def __init__(self, machine: Container, work: Path, scopes: bool):
        self.c = machine
        self.work = work
        self.scopes = scopes
        self.socket = work / "plugin" / "csi.sock"
        self.n = 0

    def start(self) -> pb_grpc.NodeStub:
        self.n += 1
        self.unit = f"tierfs-csi-{self.n}.service"
        self.c.run("systemd-run", f"--unit={self.unit}", "--property=KillMode=control-group",
                   "--", sys.executable, "-m", "tierfs_csi", "--endpoint",
                   f"unix://{self.socket}", "--node-id", "node-1",
                   "--state-dir", str(self.work / "state"),
                   "--kubelet-dir", str(self.work / "kubelet"),
                   *(["--systemd-scopes"] if self.scopes else []))
        channel = grpc.insecure_channel(f"unix://{self.socket}")
        deadline = time.monotonic() + 60
        while True:
            try:
                ready = pb_grpc.IdentityStub(channel).Probe(pb.ProbeRequest(), timeout=5)
                assert ready.ready.value, self.c.journal(self.unit)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, self.c.journal(self.unit)
                time.sleep(0.2)
        self.channel = channel
        return pb_grpc.NodeStub(channel)

    def kill_container(self) -> None:
        """End every process of the plugin's cgroup, as a container runtime does."""
        self.channel.close()
        self.c.run("systemctl", "kill", "--signal=SIGKILL", self.unit)
        deadline = time.monotonic() + 30
        while self.c.show(self.unit, "ActiveState")["ActiveState"] not in ("failed",
                                                                           "inactive"):
            assert time.monotonic() < deadline
            time.sleep(0.1)

    def read(self, path: str) -> str:
        r = self.c.run("cat", path, check=False)
        return r.stdout if r.returncode == 0 else f"error: {r.stderr.strip()}"


@pytest.mark.parametrize("scopes", [True, False], ids=["systemd-scopes", "in-cgroup"])
def test_daemons_and_the_plugin_container(rgw, bucket, tmp_path, scopes):
    files = put_dataset(rgw, bucket)
    work = tmp_path / "node"
    work.mkdir()
    machine = Container(rootfs(), [(str(work), str(work), True)], tmp_path / "console.log")
    with machine:
        plugin = ContainerPlugin(machine, work, scopes)
        kubelet = Kubelet(work, rgw, bucket, shared_root=False)
        node = plugin.start()
        vol = "pv-ctr"
        node.NodeStageVolume(kubelet.stage_request(vol))
        node.NodePublishVolume(kubelet.publish_request(vol, "pod"))
        small = f"{kubelet.target_path('pod')}/small.txt"
        assert plugin.read(small) == files["small.txt"].decode()

        plugin.kill_container()
        if scopes:  # the daemon was not the container's: the pod goes on reading
            assert plugin.read(small) == files["small.txt"].decode()
        else:
            assert "Transport endpoint is not connected" in plugin.read(small)

        node = plugin.start()  # adopts (scopes) or remounts and binds again (in-cgroup)
        assert plugin.read(small) == files["small.txt"].decode()
        journal = machine.journal(plugin.unit)
        assert f"{'adopted' if scopes else 'remounted'} volume {vol}" in journal
        node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=kubelet.target_path("pod")))
        node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
        assert not machine.mounted(kubelet.staging_path(vol))
        assert not os.path.exists(kubelet.target_path("pod"))
        plugin.channel.close()
