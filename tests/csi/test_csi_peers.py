"""The peer tier in csi/: its options are volume attributes like every tierfs option
(validated by tierfs's schema), and the manifests agree with each other: the headless
Service selects the node plugin's pods on the port they declare, the shared secret is
mounted 0600 and optional, and POD_IP is the pod's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tierfs_csi.options import OptionError, stage_spec

DEPLOY = Path(__file__).resolve().parents[2] / "csi" / "deploy"
SECRET = b"0123456789abcdef0123456789abcdef"


def _docs(kind: str) -> list[dict]:
    return [d for path in sorted(DEPLOY.glob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind]


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return str(path)


def test_peer_options_are_volume_attributes(secret_file):
    spec = stage_spec({"bucket": "data", "peers": "dns:tierfs-peers.ns.svc.cluster.local:7481",
                       "peer-listen": "10.0.0.5:7481", "peer_secret_file": secret_file,
                       "peer_bandwidth": "500M", "peer_timeout": "3s"}, [], False, "/staging")
    assert spec.options["peers"] == "dns:tierfs-peers.ns.svc.cluster.local:7481"
    assert spec.options["peer_listen"] == "10.0.0.5:7481"
    opts = spec.mount_args()[1].split(",")
    assert f"peer_secret_file={secret_file}" in opts and "peer_timeout=3s" in opts
    assert SECRET.decode() not in " ".join(spec.mount_args())


@pytest.mark.parametrize("attrs, text", [
    ({"peers": "dns:x:7480", "peer_listen": "0.0.0.0:7480"}, "peer-advertise is required"),
    ({"peers": "gossip"}, "invalid peers 'gossip'"),
    ({"peer_timeout": "3s"}, "only with --peers"),
])
def test_bad_peer_attributes_are_refused_with_tierfs_message(secret_file, attrs, text):
    attrs = {"bucket": "data", "peer_secret_file": secret_file, **attrs}
    if "peers" not in attrs:
        attrs.pop("peer_secret_file")
    with pytest.raises(OptionError, match=text):
        stage_spec(attrs, [], False, "/staging")


def test_headless_service_selects_the_node_plugin_on_its_peer_port():
    [svc] = [s for s in _docs("Service") if s["metadata"]["name"] == "tierfs-peers"]
    [ds] = _docs("DaemonSet")
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS answers every pod's address
    assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    plugin = next(c for c in ds["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "tierfs-csi")
    ports = {p["name"]: p["containerPort"] for p in plugin["ports"]}
    [port] = svc["spec"]["ports"]
    assert port["targetPort"] == "peer" and ports["peer"] == port["port"] == 7480


def test_the_secret_is_mounted_private_and_pod_ip_is_the_pods():
    [ds] = _docs("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    plugin = next(c for c in pod["containers"] if c["name"] == "tierfs-csi")
    volume = next(v for v in pod["volumes"] if v["name"] == "peer-secret")
    assert volume["secret"]["secretName"] == "tierfs-peer-secret"
    assert volume["secret"]["defaultMode"] == 0o600  # tierfs refuses a readable secret
    assert volume["secret"]["optional"] is True  # no peer tier, no Secret needed
    mount = next(m for m in plugin["volumeMounts"] if m["name"] == "peer-secret")
    assert mount["readOnly"] is True and mount["mountPath"] == "/etc/tierfs-peer"
    env = {e["name"]: e for e in plugin["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_a_volume_listening_everywhere_is_advertised_at_the_nodes_ip(secret_file):
    attrs = {"bucket": "data", "peers": "dns:tierfs-peers.ns.svc.cluster.local:7481",
             "peer_listen": "0.0.0.0:7481", "peer_secret_file": secret_file}
    assert stage_spec(attrs, [], False, "/staging", node_ip="10.1.2.3").options[
        "peer_advertise"] == "10.1.2.3:7481"
    assert stage_spec(attrs, [], False, "/staging", node_ip="fd00::7").options[
        "peer_advertise"] == "[fd00::7]:7481"
    given = {**attrs, "peer_advertise": "node-a:7481"}  # a volume's own choice stays
    assert stage_spec(given, [], False, "/staging", node_ip="10.1.2.3").options[
        "peer_advertise"] == "node-a:7481"
