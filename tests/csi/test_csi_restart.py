"""The plugin and the daemons fail independently: a killed plugin leaves the volumes
serving and the next plugin adopts them; a killed daemon leaves a stale mount
("Transport endpoint is not connected") that the plugin cleans and remounts."""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import csikit
import pytest
from csikit import Plugin, pb, put_dataset, read_in_other_namespace

pytestmark = pytest.mark.mount


@pytest.mark.parametrize("end", ["kill9", "stop"])  # SIGKILL, or SIGTERM (its own shutdown)
def test_ended_plugin_leaves_pods_reading_and_the_next_one_adopts(
        plugin, kubelet, rgw, bucket, csi_root, end):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    stage = kubelet.stage_request(vol)
    publish = kubelet.publish_request(vol, "pod")
    plugin.node.NodeStageVolume(stage)
    plugin.node.NodePublishVolume(publish)
    target = kubelet.target_path("pod")
    daemon = csikit.daemon_pid(plugin.state_dir, vol)

    getattr(plugin, end)()
    for name, data in files.items():  # no plugin at all: the pod still reads
        assert read_in_other_namespace(f"{target}/{name}") == data, name

    restarted = Plugin(csi_root).start()
    try:
        assert f"adopted volume {vol}" in restarted.log_text()
        # kubelet repeats calls it is unsure of: all answered from the adopted state
        restarted.node.NodeStageVolume(stage)
        restarted.node.NodePublishVolume(publish)
        assert csikit.daemon_pid(restarted.state_dir, vol) == daemon
        restarted.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=target))
        assert not os.path.exists(target)
        restarted.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
        assert csikit.wait_gone(daemon)
        assert not csikit.is_mounted(kubelet.staging_path(vol))
    finally:
        restarted.stop()


def test_stale_mounts_are_cleaned_and_remounted(plugin, kubelet, rgw, bucket):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    stage = kubelet.stage_request(vol)
    publish = kubelet.publish_request(vol, "pod")
    staging, target = kubelet.staging_path(vol), kubelet.target_path("pod")
    plugin.node.NodeStageVolume(stage)
    plugin.node.NodePublishVolume(publish)

    _crash_daemon(plugin, vol)
    assert _errno_of(staging) == "ENOTCONN" and _errno_of(target) == "ENOTCONN"
    plugin.node.NodeStageVolume(stage)  # cleaned and mounted again
    plugin.node.NodePublishVolume(publish)  # the dead bind is replaced by a live one
    for name, data in files.items():
        assert read_in_other_namespace(f"{target}/{name}") == data, name

    # unpublish and unstage of dead mounts are plain successes, and leave nothing behind
    _crash_daemon(plugin, vol)
    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vol,
                                                                  target_path=target))
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id=vol,
                                                              staging_target_path=staging))
    assert not csikit.is_mounted(target) and not csikit.is_mounted(staging)
    assert not os.path.exists(target) and not os.path.exists(staging)


def test_restarted_plugin_remounts_a_volume_whose_daemon_died(
        plugin, kubelet, rgw, bucket, csi_root):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    plugin.kill9()
    _crash_daemon(plugin, vol)

    restarted = Plugin(csi_root).start()  # heals before it serves: new pods just publish
    try:
        restarted.node.NodePublishVolume(kubelet.publish_request(vol, "pod"))
        target = kubelet.target_path("pod")
        assert read_in_other_namespace(f"{target}/small.txt") == files["small.txt"]
        restarted.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=target))
        restarted.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
    finally:
        restarted.stop()


def test_a_daemon_that_does_not_answer_fails_calls_unavailable_not_forever(
        kubelet, rgw, bucket, csi_root):
    put_dataset(rgw, bucket)
    plugin = Plugin(csi_root, extra_args=["--fs-timeout", "1"]).start()
    vol = csikit.unique_volume()
    try:
        plugin.node.NodeStageVolume(kubelet.stage_request(vol))
        plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod"))
        pid = csikit.daemon_pid(plugin.state_dir, vol)
        os.kill(pid, signal.SIGSTOP)  # alive, holding its mount, answering nothing
        try:
            for call, request in (
                    ("NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(
                        volume_id=vol, volume_path=kubelet.target_path("pod"))),
                    ("NodePublishVolume", kubelet.publish_request(vol, "pod-2")),
                    ("NodeStageVolume", kubelet.stage_request(vol))):
                with pytest.raises(csikit.grpc.RpcError) as info:
                    getattr(plugin.node, call)(request, timeout=60)
                assert info.value.code() == csikit.grpc.StatusCode.UNAVAILABLE, call
                assert "no answer" in info.value.details()
        finally:
            os.kill(pid, signal.SIGCONT)
        # answering again: the same calls go through, the volume's lock was not kept
        plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod-2"))
        for pod in ("pod", "pod-2"):
            plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                volume_id=vol, target_path=kubelet.target_path(pod)))
        plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
        assert csikit.wait_gone(pid)
    finally:
        plugin.stop()


def test_a_pod_with_host_to_container_propagation_reads_again_after_a_crash(
        plugin, kubelet, rgw, bucket, csi_root):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod"))
    target = kubelet.target_path("pod")
    # a long-lived "container": its own mount namespace, a slave of the host's
    pod = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "slave", "sh", "-c",
         'while read _; do head -c 100 "$1" 2>/dev/null || echo "not readable"; done',
         "pod", f"{target}/small.txt"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def pod_reads() -> str:
        pod.stdin.write("\n")
        pod.stdin.flush()
        return pod.stdout.readline()

    try:
        assert pod_reads() == files["small.txt"].decode()
        plugin.kill9()
        _crash_daemon(plugin, vol)  # e.g. the plugin container replaced, daemons with it
        assert pod_reads() == "not readable\n"
        restarted = Plugin(csi_root).start()  # remounts, binds the pod's path again
        try:
            assert pod_reads() == files["small.txt"].decode()
            restarted.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
                volume_id=vol, target_path=target))
            restarted.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
                volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
        finally:
            restarted.stop()
    finally:
        pod.stdin.close()
        pod.wait(timeout=30)
        pod.stdout.close()


def _crash_daemon(plugin: Plugin, vol: str) -> None:
    pid = csikit.daemon_pid(plugin.state_dir, vol)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert csikit.wait_gone(pid)


def _errno_of(path: str) -> str | None:
    try:
        os.statvfs(path)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return None
