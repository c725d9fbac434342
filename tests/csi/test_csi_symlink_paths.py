"""S2: a `..` after a symlink is walked as the kernel walks it, and what is checked is what
is mounted and recorded.

Before: `KUBELET/pods/lnk/../escaped`, with `lnk` a symlink out of kubelet's directory,
passed the check (`..` was cancelled in the text, giving `pods/escaped`) and the raw path
was bind-mounted: the kernel put the mount beside lnk's target, outside --kubelet-dir;
unpublish answered OK and left it; a staging path of the same shape created a directory
outside. One volume is staged on the real RGW and driven through the real plugin."""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest
from csikit import code_of as _code
from csikit import is_mounted, pb, put_dataset

pytestmark = pytest.mark.mount
C = grpc.StatusCode


def test_resolve_walks_symlinks_before_dotdot(tmp_path):
    from tierfs_csi.errors import CsiError
    from tierfs_csi.paths import KubeletDir, resolve

    (tmp_path / "k" / "pods").mkdir(parents=True)
    (tmp_path / "out" / "deep").mkdir(parents=True)
    (tmp_path / "k" / "pods" / "lnk").symlink_to(tmp_path / "out" / "deep")
    raw = str(tmp_path / "k" / "pods" / "lnk" / ".." / "escaped")
    assert resolve(raw) == str(tmp_path / "out" / "escaped")
    k = KubeletDir(str(tmp_path / "k"))
    with pytest.raises(CsiError) as info:
        k.check("target_path", raw)
    assert "resolved" in info.value.message and "--kubelet-dir" in info.value.message
    inside = str(tmp_path / "k" / "pods" / "a" / ".." / "b")
    assert k.check("target_path", inside) == str(tmp_path / "k" / "pods" / "b")
    for bad in ("/", str(tmp_path / "k" / "pods" / ".."), str(tmp_path / "k" / ".")):
        with pytest.raises(CsiError):
            k.check("target_path", bad)


def test_symlink_then_dotdot_cannot_escape_and_resolved_path_is_recorded(
        plugin, kubelet, rgw, bucket, tmp_path):
    files = put_dataset(rgw, bucket)
    node, k = plugin.node, kubelet
    vol = "pv-symlink"
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    pods = k.root / "pods"
    pods.mkdir(parents=True, exist_ok=True)
    (pods / "lnk").symlink_to(outside / "deep")
    escaped = str(pods / "lnk" / ".." / "escaped")  # the kernel: outside/escaped

    # staging of that shape: refused, no directory made outside
    req = k.stage_request("pv-out")
    req.staging_target_path = escaped
    code, text = _code(node.NodeStageVolume, req)
    assert code == C.INVALID_ARGUMENT and "--kubelet-dir" in text, text
    assert os.listdir(outside) == ["deep"]

    node.NodeStageVolume(k.stage_request(vol))
    # publish of that shape: refused, nothing bound or made outside
    pub = k.publish_request(vol, "pod")
    pub.target_path = escaped
    code, text = _code(node.NodePublishVolume, pub)
    assert code == C.INVALID_ARGUMENT and str(outside / "escaped") in text, text
    assert os.listdir(outside) == ["deep"] and not is_mounted(outside / "escaped")

    # a `..` that stays inside: the resolved path is mounted and recorded, and the same
    # request path unpublishes it
    (pods / "real").mkdir()
    pub.target_path = str(pods / "real" / ".." / "pod-b")
    node.NodePublishVolume(pub)
    resolved = pods / "pod-b"
    assert is_mounted(resolved) and (resolved / "small.txt").read_bytes() == files["small.txt"]
    records = list((plugin.state_dir / vol / "targets").iterdir())
    assert len(records) == 1 and str(resolved) in records[0].read_text()
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=vol,
                                                           target_path=pub.target_path))
    assert not is_mounted(resolved) and not resolved.exists()

    # a record written by an older plugin under the raw path (its bind landed outside):
    # unpublish by that path now undoes it instead of answering OK and leaving it
    from tierfs_csi.records import Records, TargetRecord

    target = outside / "escaped"
    target.mkdir()
    subprocess.run(["mount", "--bind", k.staging_path(vol), str(target)], check=True)
    try:
        Records(str(plugin.state_dir)).save_target(TargetRecord(
            vol, escaped, k.staging_path(vol), False, "MULTI_NODE_MULTI_WRITER|"))
        assert _code(node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(
            volume_id=vol, target_path=escaped))[0] == C.OK
        assert not is_mounted(target) and not target.exists()
        assert not list((plugin.state_dir / vol / "targets").iterdir())
    finally:
        if is_mounted(target):
            subprocess.run(["umount", "-l", str(target)], check=False)

    node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
        volume_id=vol, staging_target_path=k.staging_path(vol)))
    assert not is_mounted(k.staging_path(vol))
