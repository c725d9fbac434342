"""A volume's life on a node as kubelet drives it: stage, publish into pods, read from the
pods' mount namespaces, share one daemon and cache, unpublish, unstage; against the real
Ceph RGW and real FUSE."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import csikit
from csikit import pb, put_dataset, read_in_other_namespace, run_in_other_namespace

pytestmark = __import__("pytest").mark.mount


def _tierfs_mounts(root: Path) -> list[tuple[str, str]]:
    """(mount point, device) of every tierfs mount under root."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a = left.split()
            point = a[4].encode().decode("unicode_escape")
            if right.split()[0] == "fuse.tierfs" and point.startswith(str(root) + "/"):
                out.append((point, a[2]))
    return out


def test_stage_publish_two_pods_share_one_daemon_then_unpublish_unstage(
        plugin, kubelet, rgw, bucket, csi_root):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    staging = kubelet.staging_path(vol)
    daemon = csikit.daemon_pid(plugin.state_dir, vol)
    assert daemon is not None

    # pod A reads everything byte-exact from its own mount namespace
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod-a"))
    a = kubelet.target_path("pod-a")
    for name, data in files.items():
        assert read_in_other_namespace(f"{a}/{name}") == data, name
    gets_after_a = kubelet.gets(vol)
    assert gets_after_a >= 4  # 3 MiB + in 1 MiB chunks, and the small files

    # pod B on the same volume: the same daemon, the same cache, zero GETs
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod-b", readonly=True))
    b = kubelet.target_path("pod-b")
    for name, data in files.items():
        assert read_in_other_namespace(f"{b}/{name}") == data, name
    assert kubelet.gets(vol) == gets_after_a
    assert csikit.daemon_pid(plugin.state_dir, vol) == daemon
    mounts = _tierfs_mounts(csi_root)
    assert sorted(p for p, _ in mounts) == sorted([staging, a, b])
    assert len({dev for _, dev in mounts}) == 1  # binds of one FUSE mount

    stats = plugin.node.NodeGetVolumeStats(pb.NodeGetVolumeStatsRequest(
        volume_id=vol, volume_path=a))
    units = {u.unit: u for u in stats.usage}
    assert units[pb.VolumeUsage.BYTES].total > 0
    assert units[pb.VolumeUsage.BYTES].used > 0  # the chunks just read are cached
    assert units[pb.VolumeUsage.INODES].total > 0

    for pod, target in (("pod-a", a), ("pod-b", b)):
        plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=target))
        assert not os.path.exists(target)  # the plugin removes the mount point it made
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=staging))
    assert _tierfs_mounts(csi_root) == []
    assert csikit.wait_gone(daemon)
    vol_dir = plugin.state_dir / vol
    assert not (vol_dir / "credentials").exists()
    assert any((vol_dir / "cache" / "chunks").rglob("*"))  # the cache outlives the volume

    # staged again (a new pod after all were gone): served from the node's cache
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod-c"))
    c = kubelet.target_path("pod-c")
    for name, data in files.items():
        assert read_in_other_namespace(f"{c}/{name}") == data, name
    assert kubelet.gets(vol) == 0
    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vol,
                                                                  target_path=c))
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=staging))


def test_read_only_publish_refuses_writes_and_a_writable_one_uploads(
        plugin, kubelet, rgw, bucket):
    put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "reader", readonly=True))
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "writer"))
    ro, rw = kubelet.target_path("reader"), kubelet.target_path("writer")

    r = run_in_other_namespace(f"echo nope > {ro}/new.txt")
    assert r.returncode != 0 and "Read-only file system" in r.stderr
    r = run_in_other_namespace(f"rm {ro}/small.txt")
    assert r.returncode != 0 and "Read-only file system" in r.stderr

    r = run_in_other_namespace(f"echo checkpoint > {rw}/out.txt")
    assert r.returncode == 0, r.stderr
    body = rgw.client().get_object(Bucket=bucket, Key="data/out.txt")["Body"].read()
    assert body == b"checkpoint\n"
    assert read_in_other_namespace(f"{ro}/out.txt") == b"checkpoint\n"


def test_secrets_stay_out_of_logs_argv_and_environment(plugin, kubelet, rgw, bucket):
    put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    plugin.node.NodePublishVolume(kubelet.publish_request(vol, "pod"))
    assert read_in_other_namespace(f"{kubelet.target_path('pod')}/small.txt")
    secret = rgw.secret_key.encode()

    creds = plugin.state_dir / vol / "credentials"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert secret in creds.read_bytes()  # the one place it is written
    pid = csikit.daemon_pid(plugin.state_dir, vol)
    assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(secret in e for e in environ)
    assert f"AWS_SHARED_CREDENTIALS_FILE={creds}".encode() in environ

    # errors that concern the secret name it, never its value
    bad = kubelet.stage_request(csikit.unique_volume())
    bad.secrets["password"] = rgw.secret_key
    try:
        plugin.node.NodeStageVolume(bad)
    except csikit.grpc.RpcError as exc:
        assert "password" in exc.details() and rgw.secret_key not in exc.details()
    else:
        raise AssertionError("an unknown secret key was accepted")

    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=vol, target_path=kubelet.target_path("pod")))
    plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=kubelet.staging_path(vol)))
    assert not creds.exists()
    logs = [plugin.log_path, *plugin.state_dir.rglob("*.log")]
    assert len(logs) >= 2  # the plugin's and the daemon's
    for log in logs:
        assert secret not in log.read_bytes(), log
        assert rgw.access_key.encode() not in log.read_bytes(), log


def test_concurrent_calls_on_two_volumes_and_many_pods(plugin, kubelet, rgw, bucket):
    # kubelet calls in parallel: per-volume locks keep each volume's calls in order
    from concurrent.futures import ThreadPoolExecutor

    files = put_dataset(rgw, bucket)
    vols = [csikit.unique_volume() for _ in range(2)]
    pods = [(v, f"pod-{i}-{v}") for v in vols for i in range(3)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda v: plugin.node.NodeStageVolume(kubelet.stage_request(v)), vols))
        list(pool.map(lambda vp: plugin.node.NodePublishVolume(
            kubelet.publish_request(vp[0], vp[1])), pods * 2))  # each twice: idempotent
    for _, pod in pods:
        assert read_in_other_namespace(f"{kubelet.target_path(pod)}/small.txt") == \
            files["small.txt"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda vp: plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=vp[0], target_path=kubelet.target_path(vp[1]))), pods))
        list(pool.map(lambda v: plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=v, staging_target_path=kubelet.staging_path(v))), vols))
    for v in vols:
        assert not csikit.is_mounted(kubelet.staging_path(v))
