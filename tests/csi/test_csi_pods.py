"""Pods declare their data (issue 30): warm before NodePublishVolume returns, pins held by
pod UID until NodeUnpublishVolume, inline ephemeral volumes, reads counted per namespace,
the end-of-pod line; through the plugin's real socket, real mounts and the suite's RGW.

A "pod" reads from its own mount namespace, in a cgroup named as kubelet names a pod's
(cgroup v1 `kubepods/pod<UID>`), so the daemon attributes its reads to `pod:<UID>`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import csikit
import grpc
import pytest
from csikit import Plugin, pb, put_dataset

pytestmark = pytest.mark.mount

CGROUP = Path("/sys/fs/cgroup/pids/kubepods")


class FakePod:
    def __init__(self, name: str, namespace: str = "research", uid: str | None = None):
        self.name, self.namespace = name, namespace
        self.uid = uid or str(uuid.uuid4())

    def context(self) -> dict[str, str]:
        return {"csi.storage.k8s.io/pod.uid": self.uid,
                "csi.storage.k8s.io/pod.namespace": self.namespace,
                "csi.storage.k8s.io/pod.name": self.name,
                "csi.storage.k8s.io/serviceAccount.name": "default"}

    def read(self, path: str) -> bytes:
        """cat `path` from the pod's cgroup and a mount namespace of its own."""
        group = CGROUP / f"pod{self.uid}"
        group.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(["unshare", "--mount", "--propagation", "slave", "sh", "-c",
                                'echo $$ > "$1" && exec cat "$2"', "sh",
                                str(group / "cgroup.procs"), path],
                               capture_output=True, timeout=120)
        finally:
            group.rmdir()
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        return r.stdout


def publish_request(kubelet, vol: str, pod: FakePod, **declared: str):
    req = kubelet.publish_request(vol, pod.uid)
    req.volume_context.update({**pod.context(), **declared})
    return req


def unpublish(plugin, kubelet, vol: str, pod: FakePod) -> None:
    plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
        volume_id=vol, target_path=kubelet.target_path(pod.uid)), timeout=120)


def tierfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True,
                          text=True, timeout=120)


def pin_owners(mountpoint: str) -> dict[str, int]:
    r = tierfs("status", mountpoint, "--json")
    assert r.returncode == 0, r.stderr
    return {o["owner"]: o["files"] for o in json.loads(r.stdout)["pinned"]["owners"]}


@pytest.fixture(scope="module", autouse=True)
def _kubepods_cgroup():
    CGROUP.mkdir(parents=True, exist_ok=True)
    yield
    try:
        CGROUP.rmdir()
    except OSError:
        pass


@pytest.fixture
def staged(plugin, kubelet, rgw, bucket):
    files = put_dataset(rgw, bucket)
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    return vol, files


def test_declared_data_is_warm_before_publish_returns(plugin, kubelet, staged, capsys):
    vol, files = staged
    staging = kubelet.staging_path(vol)
    # the pod without warm reads through a volume of its own (its own daemon, cache and
    # page cache) on the same bucket and prefix
    cold_vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(cold_vol))
    cold, warm = FakePod("cold-abcde"), FakePod("warm-fghij")

    # without warm: the pod's first epoch goes to the store
    plugin.node.NodePublishVolume(publish_request(kubelet, cold_vol, cold))
    before = kubelet.gets(cold_vol)
    for name, data in files.items():
        assert cold.read(f"{kubelet.target_path(cold.uid)}/{name}") == data
    cold_gets = kubelet.gets(cold_vol) - before
    unpublish(plugin, kubelet, cold_vol, cold)

    # with warm (a file and a glob): publish returns once they are cached and pinned
    before = kubelet.gets(vol)
    plugin.node.NodePublishVolume(publish_request(
        kubelet, vol, warm, warm="big.bin, small.txt,nested/**", pin="true"))
    warm_fetch = kubelet.gets(vol) - before
    assert pin_owners(staging) == {f"pod:{warm.uid}": 3}
    before = kubelet.gets(vol)
    for name, data in files.items():
        assert warm.read(f"{kubelet.target_path(warm.uid)}/{name}") == data
    warm_gets = kubelet.gets(vol) - before
    with capsys.disabled():
        print(f"\nfirst-epoch GETs of a pod: {cold_gets:.0f} without warm, {warm_gets:.0f} "
              f"with warm ({warm_fetch:.0f} GETs made by the warm inside NodePublishVolume)")
    assert cold_gets >= 4 and warm_gets == 0
    assert f"pod research/warm-fghij: volume {vol}: warmed and pinned 3 files" \
        in plugin.log_text()
    unpublish(plugin, kubelet, vol, warm)
    assert pin_owners(staging) == {}
    log = plugin.log_text()
    assert re.search(r"pod research/warm-fghij: read 3\.\d MiB, 100% from cache, 0 s "
                     r"stalled on the store", log)
    m = re.search(r"pod research/cold-abcde: read 3\.\d MiB, (\d+)% from cache", log)
    assert m and int(m.group(1)) < 50  # read-ahead within a chunk is all the cache gave


def test_warm_strict_fails_the_mount_with_the_message(plugin, kubelet, staged):
    vol, _ = staged
    staging = kubelet.staging_path(vol)
    pod = FakePod("strict-abcde")
    req = publish_request(kubelet, vol, pod, warm="small.txt,missing.bin", warm_strict="true",
                          pin="true")
    code, details = csikit.code_of(plugin.node.NodePublishVolume, req)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "tierfs warm for pod research/strict-abcde failed (warm_strict)" in details
    assert "missing.bin: no such file or directory" in details
    assert not csikit.is_mounted(kubelet.target_path(pod.uid))
    assert pin_owners(staging) == {}  # the pod does not start: nothing kept pinned
    assert "warm FAILED (warm_strict: the mount fails)" in plugin.log_text()

    # best-effort (the default): one line in the log, and the pod starts
    best = FakePod("best-abcde")
    plugin.node.NodePublishVolume(publish_request(kubelet, vol, best,
                                                  warm="small.txt,missing.bin", pin="true"))
    assert csikit.is_mounted(kubelet.target_path(best.uid))
    assert "warm FAILED (best-effort: the pod starts): missing.bin: no such file" \
        in plugin.log_text()
    assert pin_owners(staging) == {f"pod:{best.uid}": 1}

    # a path out of the volume is refused before anything is asked of the daemon
    out = FakePod("out-abcde")
    code, details = csikit.code_of(plugin.node.NodePublishVolume,
                                   publish_request(kubelet, vol, out, warm="../../etc/passwd"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'..' is not allowed" in details
    unpublish(plugin, kubelet, vol, best)


def test_unpublish_releases_that_pods_pins_only(plugin, kubelet, staged):
    vol, _ = staged
    staging = kubelet.staging_path(vol)
    a, b = FakePod("a-abcde"), FakePod("b-abcde")
    plugin.node.NodePublishVolume(publish_request(kubelet, vol, a, warm="big.bin,small.txt",
                                                  pin="true"))
    plugin.node.NodePublishVolume(publish_request(kubelet, vol, b, warm="big.bin", pin="true"))
    assert pin_owners(staging) == {f"pod:{a.uid}": 2, f"pod:{b.uid}": 1}
    unpublish(plugin, kubelet, vol, a)
    assert pin_owners(staging) == {f"pod:{b.uid}": 1}
    unpublish(plugin, kubelet, vol, a)  # repeated: OK, and B's pins stay
    assert pin_owners(staging) == {f"pod:{b.uid}": 1}
    unpublish(plugin, kubelet, vol, b)
    assert pin_owners(staging) == {}


def test_publish_with_declared_data_is_idempotent(plugin, kubelet, staged):
    vol, _ = staged
    pod = FakePod("idem-abcde")
    req = publish_request(kubelet, vol, pod, warm="small.txt", pin="true")
    plugin.node.NodePublishVolume(req)
    plugin.node.NodePublishVolume(req)  # kubelet repeats a call: OK, not warmed again
    assert plugin.log_text().count("pod research/idem-abcde: volume") == 1
    other = publish_request(kubelet, vol, pod, warm="big.bin", pin="true")
    code, _ = csikit.code_of(plugin.node.NodePublishVolume, other)
    assert code == grpc.StatusCode.ALREADY_EXISTS
    for bad in ({"warm_timeout": "0"}, {"warm_strict": "maybe"}, {"tenant_from": "pod"},
                {"warm_manifest": "/"}):
        code, details = csikit.code_of(plugin.node.NodePublishVolume,
                                       publish_request(kubelet, vol, FakePod("x-abcde"), **bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, details)
    unpublish(plugin, kubelet, vol, pod)
    unpublish(plugin, kubelet, vol, pod)


def test_manifest_and_warm_auto_from_the_last_pod_of_the_workload(
        plugin, kubelet, staged, rgw, bucket):
    vol, files = staged
    staging = kubelet.staging_path(vol)
    rgw.client().put_object(Bucket=bucket, Key="data/lists/train.warm",
                            Body=b"# the training set\nbig.bin\n/nested/dir/*.bin\n")
    first = FakePod("train-x7k2p")
    plugin.node.NodePublishVolume(publish_request(
        kubelet, vol, first, warm_manifest="lists/train.warm", warm_auto="true"))
    assert "warmed 2 files" in plugin.log_text()
    assert "warm_auto: no earlier pod of this workload" in plugin.log_text()
    for name in ("big.bin", "nested/dir/part-0001.bin"):
        assert first.read(f"{kubelet.target_path(first.uid)}/{name}") == files[name]
    unpublish(plugin, kubelet, vol, first)
    r = tierfs("evict", *[f"{staging}/{n}" for n in files])
    assert r.returncode == 0, r.stderr

    # the next pod of the Job "train" on this node: warmed with what the first one read
    second = FakePod("train-q9z4m")
    plugin.node.NodePublishVolume(publish_request(kubelet, vol, second, warm_auto="true"))
    assert "warm_auto: 2 files read by the workload's last pod" in plugin.log_text()
    before = kubelet.gets(vol)
    for name in ("big.bin", "nested/dir/part-0001.bin"):
        assert second.read(f"{kubelet.target_path(second.uid)}/{name}") == files[name]
    assert kubelet.gets(vol) == before
    unpublish(plugin, kubelet, vol, second)


def test_a_manifest_leading_out_of_the_volume_is_refused(plugin, kubelet, staged):
    vol, _ = staged
    staging = kubelet.staging_path(vol)
    os.symlink("/etc/hostname", f"{staging}/escape.warm")
    pod = FakePod("esc-abcde")
    code, details = csikit.code_of(plugin.node.NodePublishVolume, publish_request(
        kubelet, vol, pod, warm_manifest="escape.warm", warm_strict="true"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "resolves outside the volume" in details


def test_usage_by_namespace_metrics_and_accounting(csi_root, kubelet, rgw, bucket, capsys):
    accounting = csi_root / "accounting.jsonl"
    plugin = Plugin(csi_root, extra_args=["--accounting-file", str(accounting)]).start()
    try:
        files = put_dataset(rgw, bucket)
        vol = csikit.unique_volume()
        # team-a is a tenant of the volume (no prefixes: pods name it): its quotas apply
        plugin.node.NodeStageVolume(kubelet.stage_request(vol,
                                                          tenants='{team-a = {hard = "1G"}}'))
        staging = kubelet.staging_path(vol)
        a, b = FakePod("job-a-abcde", "team-a"), FakePod("job-b-abcde", "team-b")
        for pod in (a, b):
            plugin.node.NodePublishVolume(publish_request(kubelet, vol, pod,
                                                          tenant_from="namespace"))
        assert a.read(f"{kubelet.target_path(a.uid)}/big.bin") == files["big.bin"]
        for name in ("small.txt", "nested/dir/part-0001.bin"):
            assert b.read(f"{kubelet.target_path(b.uid)}/{name}") == files[name]
        r = tierfs("usage", staging, "--by", "namespace")
        assert r.returncode == 0, r.stderr
        with capsys.disabled():
            print(f"\n$ tierfs usage {staging} --by namespace\n{r.stdout}")
        rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()[2:]}
        assert set(rows) == {"team-a", "team-b"}
        assert "3.0 MiB" in rows["team-a"]
        j = json.loads(tierfs("usage", staging, "--by", "namespace", "--json").stdout)
        got = {row["name"]: sum(row["read"].values()) for row in j["rows"]}
        b_read = len(files["small.txt"]) + len(files["nested/dir/part-0001.bin"])
        assert got == {"team-a": len(files["big.bin"]), "team-b": b_read}
        tenants = json.loads(tierfs("usage", staging, "--json").stdout)
        assert {"team-a", "team-b"} <= {row["name"] for row in tenants["rows"]}
        deadline = time.monotonic() + 30  # the disk tier writes fetched chunks behind reads
        while True:
            rows = {row["name"]: row for row in
                    json.loads(tierfs("usage", staging, "--json").stdout)["rows"]}
            if rows["team-a"]["cached"] == len(files["big.bin"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # what team-a's pod brought in is team-a's; team-b is no tenant of the volume, so
        # its pod's chunks stay with their keys' tenant (default)
        assert rows["team-a"]["cached"] == len(files["big.bin"])
        assert rows["team-b"]["cached"] == 0 and rows["default"]["cached"] == b_read
        text = _metrics(kubelet, vol)
        assert 'tierfs_namespace_read_bytes_total{namespace="team-a"' in text
        assert f"pod{a.uid}" not in text and a.uid not in text  # pods are never labels
        for pod in (a, b):
            unpublish(plugin, kubelet, vol, pod)
        records = [json.loads(ln) for ln in accounting.read_text().splitlines()]
        assert {(r["namespace"], r["read_bytes"]) for r in records} == {
            ("team-a", len(files["big.bin"])), ("team-b", b_read)}
        assert re.search(r"pod team-b/job-b-abcde: read 195\.\d KiB, \d+% from cache, 0 s "
                         r"stalled on the store", plugin.log_text())
    finally:
        plugin.stop()


def _metrics(kubelet, vol: str) -> str:
    import urllib.request
    url = f"http://127.0.0.1:{kubelet.metrics_ports[vol]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _inline_request(kubelet, pod: FakePod, secrets: dict[str, str], **declared: str):
    target = kubelet.target_path(pod.uid, "data")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    attrs = kubelet.attributes("inline", **declared)
    attrs.pop("metrics_addr")
    return pb.NodePublishVolumeRequest(
        volume_id=f"csi-{uuid.uuid4().hex}", target_path=target,
        volume_capability=kubelet.capability(pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER),
        readonly=True, secrets=secrets,
        volume_context={**attrs, **pod.context(), "csi.storage.k8s.io/ephemeral": "true"})


def test_inline_volumes_share_a_daemon_per_source_and_credentials(
        plugin, kubelet, rgw, bucket):
    files = put_dataset(rgw, bucket)
    a, b = FakePod("inl-a-abcde"), FakePod("inl-b-abcde")
    ra = _inline_request(kubelet, a, kubelet.secrets(), warm="big.bin", pin="true")
    rb = _inline_request(kubelet, b, kubelet.secrets())
    plugin.node.NodePublishVolume(ra)
    plugin.node.NodePublishVolume(rb)
    plugin.node.NodePublishVolume(rb)  # repeated: OK
    shared = [d.name for d in plugin.state_dir.iterdir() if d.name.startswith("inline-")]
    assert len(shared) == 1  # one daemon and cache for both pods
    daemon = csikit.daemon_pid(plugin.state_dir, shared[0])
    assert daemon is not None
    for pod in (a, b):
        assert pod.read(f"{kubelet.target_path(pod.uid, 'data')}/small.txt") == \
            files["small.txt"]
    secrets_text = kubelet.secrets()["aws_secret_access_key"]
    assert secrets_text not in plugin.log_text()

    # other credentials never read through that daemon: another one, refused by the store
    bad = dict(kubelet.secrets(), aws_secret_access_key="not-the-key")
    c = FakePod("inl-c-abcde")
    code, details = csikit.code_of(plugin.node.NodePublishVolume,
                                   _inline_request(kubelet, c, bad))
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert [d.name for d in plugin.state_dir.iterdir()
            if d.name.startswith("inline-") and (d / "stage.json").exists()] == shared

    for pod, req in ((a, ra), (b, rb)):
        plugin.node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id=req.volume_id, target_path=req.target_path))
        assert not csikit.is_mounted(req.target_path)
    assert csikit.wait_gone(daemon)  # the last pod's unpublish ends the daemon
    assert any((plugin.state_dir / shared[0] / "cache" / "chunks").rglob("*"))


def test_plugin_killed_in_the_middle_of_a_warm(csi_root, kubelet, rgw, bucket):
    client = rgw.client()
    big = {f"set/f{i:02d}.bin": os.urandom(4 << 20) for i in range(12)}
    for key, data in big.items():
        client.put_object(Bucket=bucket, Key=f"data/{key}", Body=data)
    plugin = Plugin(csi_root).start()
    vol = csikit.unique_volume()
    plugin.node.NodeStageVolume(kubelet.stage_request(vol))
    pod = FakePod("mid-abcde")
    req = publish_request(kubelet, vol, pod, warm="set", pin="true", warm_strict="true")
    errors: list = []

    def call():
        try:
            plugin.node.NodePublishVolume(req, timeout=120)
        except grpc.RpcError as exc:
            errors.append(exc.code())

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 60
    while "podctl" not in _children(plugin.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    plugin.kill9()
    t.join(60)
    assert errors  # kubelet saw the call fail and retries it
    restarted = Plugin(csi_root).start()
    try:
        restarted.node.NodePublishVolume(req, timeout=120)  # the retry: warm, pin, bind
        assert pin_owners(kubelet.staging_path(vol)) == {f"pod:{pod.uid}": 12}
        before = kubelet.gets(vol)
        target = kubelet.target_path(pod.uid)
        for key, data in big.items():
            assert pod.read(f"{target}/{key}") == data
        assert kubelet.gets(vol) == before
        unpublish(restarted, kubelet, vol, pod)
        assert pin_owners(kubelet.staging_path(vol)) == {}
    finally:
        restarted.stop()


def _children(pid: int) -> str:
    r = subprocess.run(["ps", "-o", "args=", "--ppid", str(pid)], capture_output=True,
                       text=True)
    return r.stdout
