"""V5: the plugin acts only under --kubelet-dir and only on what it recorded for a volume.

Before: publish bind-mounted over any non-empty directory, stage mounted anywhere, and
unpublish/unstage with an unrelated volume id unmounted mounts the plugin had not made
and removed their directories. One volume is staged and published on the real RGW; every
probe around it must leave it, and the test's own mounts, as they were."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import pytest
from csikit import code_of as _code
from csikit import is_mounted, pb, put_dataset

pytestmark = pytest.mark.mount
C = grpc.StatusCode


def test_paths_are_confined_and_only_recorded_mounts_are_undone(plugin, kubelet, rgw, bucket,
                                                                 tmp_path):
    files = put_dataset(rgw, bucket)
    node, k = plugin.node, kubelet
    vol = "pv-confined"
    node.NodeStageVolume(k.stage_request(vol))
    node.NodePublishVolume(k.publish_request(vol, "pod"))
    target = Path(k.target_path("pod"))
    assert (target / "small.txt").read_bytes() == files["small.txt"]

    # stage and publish outside kubelet's directory: refused, nothing mounted or made
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    req = k.stage_request("pv-out")
    req.staging_target_path = str(outside / "staging")
    code, text = _code(node.NodeStageVolume, req)
    assert code == C.INVALID_ARGUMENT and "--kubelet-dir" in text
    pub = k.publish_request(vol, "pod-out")
    pub.target_path = str(outside)
    code, text = _code(node.NodePublishVolume, pub)
    assert code == C.INVALID_ARGUMENT and "target_path" in text
    # ... also through a symlink under kubelet's directory, or a `..` out of it
    link = k.root / "pods" / "evil"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)
    for path in (link / "mount", k.root / "pods" / ".." / ".." / "outside" / "x"):
        pub.target_path = str(path)
        code, text = _code(node.NodePublishVolume, pub)
        assert code == C.INVALID_ARGUMENT and "kubelet" in text, (path, text)
    pub.target_path = str(link)  # the last component a symlink
    assert _code(node.NodePublishVolume, pub)[0] == C.INVALID_ARGUMENT
    assert not is_mounted(outside) and os.listdir(outside) == ["keep.txt"]

    # a non-empty directory under kubelet's directory is not mounted over
    full = Path(k.target_path("pod-full"))
    full.mkdir(parents=True)
    (full / "data.txt").write_text("kept")
    code, text = _code(node.NodePublishVolume, k.publish_request(vol, "pod-full"))
    assert code == C.FAILED_PRECONDITION and "non-empty" in text
    assert not is_mounted(full) and (full / "data.txt").read_text() == "kept"

    # unpublish / unstage naming another volume: OK (nothing of its), nothing undone
    assert _code(node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(
        volume_id="pv-other", target_path=str(target)))[0] == C.OK
    assert _code(node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(
        volume_id="pv-other", staging_target_path=k.staging_path(vol)))[0] == C.OK
    assert is_mounted(target) and is_mounted(k.staging_path(vol))
    assert (target / "small.txt").read_bytes() == files["small.txt"]

    # a mount the plugin did not make, even at a kubelet-style path: left alone
    foreign = Path(k.target_path("pod-foreign"))
    foreign.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(foreign)], check=True)
    try:
        (foreign / "mine.txt").write_text("mine")
        assert _code(node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=str(foreign)))[0] == C.OK
        assert is_mounted(foreign) and (foreign / "mine.txt").read_text() == "mine"
    finally:
        subprocess.run(["umount", str(foreign)], check=True)

    # stats: NOT_FOUND for anything but the volume's own paths, relative ones too
    for path in ("kubelet/pods", str(outside), str(foreign), "/etc", "."):
        code, _ = _code(node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(
            volume_id=vol, volume_path=path))
        assert code == C.NOT_FOUND, path
    assert _code(node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(
        volume_id="pv-other", volume_path=str(target)))[0] == C.NOT_FOUND
    assert _code(node.NodeGetVolumeStats, pb.NodeGetVolumeStatsRequest(
        volume_id=vol, volume_path=str(target)))[0] == C.OK

    # the volume's own unpublish and unstage still work
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vol,
                                                           target_path=str(target)))
    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=k.staging_path(vol)))
    assert not is_mounted(target) and not is_mounted(k.staging_path(vol))


@pytest.mark.parametrize("attrs, text", [
    ({"memory_cache_size": "99999P"}, "memory-cache-size"),
    ({"region": "us-east-1\nforged"}, "control character"),
    ({"endpoint_url": "http://[::1"}, "endpoint-url"),
    ({"uid": "4294967296"}, "uid"),
    ({"metadata_ttl": "nan"}, "metadata-ttl"),
    ({"cache_size": "1" * 5000}, "cache_size"),
])
def test_volume_attributes_are_bounded_by_the_schema(attrs, text):
    from tierfs_csi.options import OptionError, stage_spec

    with pytest.raises(OptionError) as info:
        stage_spec({"bucket": "data", **attrs}, [], False, "/staging")
    message = str(info.value)
    assert text in message and "\n" not in message and len(message) < 400
