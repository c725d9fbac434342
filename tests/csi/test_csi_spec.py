"""The CSI spec's rules for the node service, one row each: idempotent repeats, the
error codes, and messages that name the offending field. One volume is staged and
published once for the whole table (on the real RGW); every row leaves it as it was."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from csikit import Kubelet, Plugin, pb, put_dataset
from mounting import free_port

from rgw import delete_bucket

pytestmark = pytest.mark.mount
C = grpc.StatusCode
VOL = "pv-table"


@pytest.fixture(scope="module")
def env(rgw, tmp_path_factory):
    root = tmp_path_factory.mktemp("csi-table")
    client = rgw.client()
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=bucket)
    plugin = Plugin(root).start()
    kubelet = Kubelet(root, rgw, bucket)
    try:
        put_dataset(rgw, bucket)
        plugin.node.NodeStageVolume(kubelet.stage_request(VOL))
        plugin.node.NodePublishVolume(kubelet.publish_request(VOL, "pod"))
        yield SimpleNamespace(plugin=plugin, k=kubelet, root=root)
        plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=VOL, target_path=kubelet.target_path("pod")))
        plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=VOL, staging_target_path=kubelet.staging_path(VOL)))
    finally:
        plugin.stop()
        kubelet.cleanup(root / "state")
        delete_bucket(client, bucket)


def without(msg, *fields):
    for f in fields:
        msg.ClearField(f)
    return msg


def attrs(req, **changes):
    for k, v in changes.items():
        if v is None:
            del req.volume_context[k]
        else:
            req.volume_context[k] = v
    return req


def block(req):
    req.volume_capability.block.SetInParent()
    return req


def stage(e, vol=VOL, **a):
    return "NodeStageVolume", attrs(e.k.stage_request(vol), **a)


def publish(e, pod="pod", readonly=False, vol=VOL):
    return "NodePublishVolume", e.k.publish_request(vol, pod, readonly)


def unpublish(e, target):
    return "NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id=VOL,
                                                                target_path=target)


def unstage(e, path, vol=VOL):
    return "NodeUnstageVolume", pb.NodeUnstageVolumeRequest(volume_id=vol,
                                                            staging_target_path=path)


def stats(e, path):
    return "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id=VOL, volume_path=path)


def plain_dir(e, name):
    d = e.root / "kubelet" / "pods" / name / "volumes/kubernetes.io~csi/pv/mount"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


def secret(e, key):
    name, req = stage(e, vol="pv-secret")
    req.secrets[key] = "value-must-not-show"
    return name, req


def fresh(e):
    return f"pv-new-{uuid.uuid4().hex[:8]}"


# (id, request builder, expected code, text the message must contain)
ROWS = [
    # missing required fields: INVALID_ARGUMENT naming the field
    ("stage/no volume_id", lambda e: (stage(e)[0], without(stage(e)[1], "volume_id")),
     C.INVALID_ARGUMENT, "volume_id"),
    ("stage/no staging_target_path",
     lambda e: (stage(e)[0], without(stage(e)[1], "staging_target_path")),
     C.INVALID_ARGUMENT, "staging_target_path"),
    ("stage/no volume_capability",
     lambda e: (stage(e)[0], without(stage(e)[1], "volume_capability")),
     C.INVALID_ARGUMENT, "volume_capability"),
    ("unstage/no volume_id", lambda e: unstage(e, e.k.staging_path(VOL), vol=""),
     C.INVALID_ARGUMENT, "volume_id"),
    ("unstage/no staging_target_path", lambda e: unstage(e, ""),
     C.INVALID_ARGUMENT, "staging_target_path"),
    ("publish/no volume_id", lambda e: (publish(e)[0], without(publish(e)[1], "volume_id")),
     C.INVALID_ARGUMENT, "volume_id"),
    ("publish/no staging_target_path",
     lambda e: (publish(e)[0], without(publish(e)[1], "staging_target_path")),
     C.INVALID_ARGUMENT, "staging_target_path"),
    ("publish/no target_path",
     lambda e: (publish(e)[0], without(publish(e)[1], "target_path")),
     C.INVALID_ARGUMENT, "target_path"),
    ("publish/no volume_capability",
     lambda e: (publish(e)[0], without(publish(e)[1], "volume_capability")),
     C.INVALID_ARGUMENT, "volume_capability"),
    ("unpublish/no volume_id",
     lambda e: ("NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(target_path="/x")),
     C.INVALID_ARGUMENT, "volume_id"),
    ("unpublish/no target_path", lambda e: unpublish(e, ""),
     C.INVALID_ARGUMENT, "target_path"),
    ("stats/no volume_id",
     lambda e: ("NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_path="/x")),
     C.INVALID_ARGUMENT, "volume_id"),
    ("stats/no volume_path", lambda e: stats(e, ""), C.INVALID_ARGUMENT, "volume_path"),
    ("stage/relative staging path",
     lambda e: (stage(e)[0], _set(stage(e)[1], staging_target_path="rel/path")),
     C.INVALID_ARGUMENT, "absolute"),
    # bad volume attributes, capabilities and secrets: INVALID_ARGUMENT, clear message
    ("stage/unknown attribute", lambda e: stage(e, vol=fresh(e), colour="blue"),
     C.INVALID_ARGUMENT, "unknown volume attribute 'colour'"),
    ("stage/bad value", lambda e: stage(e, vol=fresh(e), cache_size="lots"),
     C.INVALID_ARGUMENT, "cache-size"),
    ("stage/plugin-owned attribute", lambda e: stage(e, vol=fresh(e), cache_dir="/tmp/x"),
     C.INVALID_ARGUMENT, "cache_dir"),
    ("stage/no bucket", lambda e: stage(e, vol=fresh(e), bucket=None),
     C.INVALID_ARGUMENT, "bucket"),
    ("stage/unknown mount flag",
     lambda e: (stage(e)[0], _flags(stage(e, vol=fresh(e))[1], "turbo=1")),
     C.INVALID_ARGUMENT, "turbo"),
    ("stage/block access", lambda e: (stage(e)[0], block(stage(e, vol=fresh(e))[1])),
     C.INVALID_ARGUMENT, "block"),
    ("publish/block access", lambda e: (publish(e)[0], block(publish(e, "pod-blk")[1])),
     C.INVALID_ARGUMENT, "block"),
    ("stage/unknown secret key", lambda e: secret(e, "password"),
     C.INVALID_ARGUMENT, "'password'"),
    # the bucket or endpoint is wrong: the code says which, tierfs's message says what
    ("stage/bucket does not exist",
     lambda e: stage(e, vol=fresh(e), bucket=f"missing-{uuid.uuid4().hex[:8]}"),
     C.NOT_FOUND, "does not exist"),
    ("stage/wrong secret", lambda e: _wrong_secret(stage(e, vol=fresh(e))),
     C.PERMISSION_DENIED, "access denied"),
    ("stage/endpoint unreachable",
     lambda e: stage(e, vol=fresh(e), endpoint_url=f"http://127.0.0.1:{free_port()}",
                     backend_retries="1"),
     C.UNAVAILABLE, "unreachable"),
    # idempotency: the same call again is OK
    ("stage/again, same arguments", lambda e: stage(e), C.OK, None),
    ("publish/again, same arguments", lambda e: publish(e), C.OK, None),
    ("unpublish/missing path", lambda e: unpublish(e, "/nonexistent/csi/target"), C.OK, None),
    ("unpublish/a directory, not mounted", lambda e: unpublish(e, plain_dir(e, "plain")),
     C.OK, None),
    ("unstage/missing path", lambda e: unstage(e, "/nonexistent/csi/staging", vol="pv-gone"),
     C.OK, None),
    # the same path with other arguments: ALREADY_EXISTS
    ("publish/same target, other readonly", lambda e: publish(e, readonly=True),
     C.ALREADY_EXISTS, "already published"),
    ("stage/same staging path, other attributes", lambda e: stage(e, metadata_ttl="5s"),
     C.ALREADY_EXISTS, "already mounted"),
    ("stage/same volume, other staging path",
     lambda e: (stage(e)[0], _set(stage(e)[1],
                                  staging_target_path=str(e.root / "kubelet" / "other"))),
     C.ALREADY_EXISTS, "already staged"),
    # state the call needs is missing
    ("publish/volume not staged", lambda e: publish(e, "pod-x", vol="pv-unstaged"),
     C.FAILED_PRECONDITION, "not staged"),
    ("unstage/still published", lambda e: unstage(e, e.k.staging_path(VOL)),
     C.FAILED_PRECONDITION, "still published"),
    ("stats/missing path", lambda e: stats(e, "/nonexistent/csi/path"),
     C.NOT_FOUND, "not staged or published"),
    ("stats/not this volume's mount", lambda e: stats(e, plain_dir(e, "other")),
     C.NOT_FOUND, "not staged or published"),
    ("stats/relative path", lambda e: stats(e, "kubelet/pods"),
     C.NOT_FOUND, "not staged or published"),
    ("stats/published target", lambda e: stats(e, e.k.target_path("pod")), C.OK, None),
]


def _wrong_secret(call):
    call[1].secrets["aws_secret_access_key"] = "value-must-not-show"
    return call


def _set(msg, **fields):
    for k, v in fields.items():
        setattr(msg, k, v)
    return msg


def _flags(req, *flags):
    req.volume_capability.mount.mount_flags.extend(flags)
    return req


@pytest.mark.parametrize("build,code,text", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_node_rpc(env, build, code, text):
    name, request = build(env)
    call = getattr(env.plugin.node, name)
    if code == C.OK:
        call(request, timeout=120)
    else:
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=120)
        assert info.value.code() == code, info.value.details()
        assert text in info.value.details()
        assert "value-must-not-show" not in info.value.details()
    # the shared volume is still staged and published, and readable
    assert Path(env.k.target_path("pod"), "small.txt").read_bytes()
    for path in ("/nonexistent/csi/target", "/nonexistent/csi/staging"):
        assert not os.path.exists(path)


def test_unpublish_leaves_a_directory_it_did_not_make(env):
    # only targets recorded for the volume are undone; kubelet's own dirs are kubelet's
    d = plain_dir(env, "not-ours")
    env.plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id=VOL,
                                                                      target_path=d))
    assert os.path.isdir(d)


def test_unpublish_and_unstage_twice_are_ok(env):
    vol = fresh(env)
    env.plugin.node.NodeStageVolume(env.k.stage_request(vol))
    env.plugin.node.NodePublishVolume(env.k.publish_request(vol, "twice"))
    unpub = pb.NodeUnpublishVolumeRequest(volume_id=vol, target_path=env.k.target_path("twice"))
    unst = pb.NodeUnstageVolumeRequest(volume_id=vol, staging_target_path=env.k.staging_path(vol))
    for _ in range(2):
        env.plugin.node.NodeUnpublishVolume(unpub)
    for _ in range(2):
        env.plugin.node.NodeUnstageVolume(unst)
    assert not os.path.exists(env.k.staging_path(vol))


def test_unknown_rpc_is_unimplemented(env):
    # node-only: the controller's other RPCs are not served
    call = env.plugin.channel.unary_unary("/csi.v1.Controller/CreateVolume",
                                          request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        call(b"", timeout=10)
    assert info.value.code() == C.UNIMPLEMENTED


def test_attributes_take_cli_spellings_and_mount_flags_like_fstab(env):
    # `metadata-ttl` as on the command line, `ro` and `noatime` as fstab passes them
    vol = fresh(env)
    req = env.k.stage_request(vol)
    req.volume_context["metadata-ttl"] = "30s"
    req.volume_capability.mount.mount_flags.extend(["ro", "noatime"])
    env.plugin.node.NodeStageVolume(req)
    staging = env.k.staging_path(vol)
    try:
        record = (env.plugin.state_dir / vol / "stage.json").read_text()
        assert '"metadata_ttl": "30s"' in record and '"read_only": true' in record
        with open("/proc/self/mountinfo") as f:
            opts = next(line.split()[5] for line in f if line.split()[4] == staging)
        assert "ro" in opts.split(",")  # the daemon itself is read-only
    finally:
        env.plugin.node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(
            volume_id=vol, staging_target_path=staging))
