"""csi/deploy/ validated offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields are errors), plus what the schemas cannot know: the settings the
node plugin depends on, and that every name the objects share agrees."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "csi" / "deploy"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests are meant for
DRIVER = "csi.tierfs.io"


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


DOCS = _docs()


def _one(kind: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


@pytest.mark.parametrize("doc", [d for _, d in DOCS], ids=[n for n, _ in DOCS])
def test_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_csidriver_is_node_only():
    spec = _one("CSIDriver")["spec"]
    assert _one("CSIDriver")["metadata"]["name"] == DRIVER
    assert spec["attachRequired"] is False  # no controller: no VolumeAttachment to wait on
    assert spec["volumeLifecycleModes"] == ["Persistent", "Ephemeral"]
    assert spec["podInfoOnMount"] is True  # pins per pod, reads per namespace


def test_daemonset_has_what_the_plugin_needs():
    pod = _one("DaemonSet")["spec"]["template"]["spec"]
    plugin = next(c for c in pod["containers"] if c["name"] == "tierfs-csi")
    registrar = next(c for c in pod["containers"] if c["name"] == "node-driver-registrar")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}

    assert plugin["securityContext"]["privileged"] is True
    assert mounts["kubelet-dir"]["mountPath"] == "/var/lib/kubelet"
    assert mounts["kubelet-dir"]["mountPropagation"] == "Bidirectional"
    assert volumes["kubelet-dir"]["hostPath"]["path"] == "/var/lib/kubelet"
    # the plugin mounts only under kubelet's directory, as the container sees it
    assert f"--kubelet-dir={mounts['kubelet-dir']['mountPath']}" in plugin["args"]
    assert volumes["fuse-device"]["hostPath"]["type"] == "CharDevice"
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    # daemons in systemd scopes of the host: its systemd's socket and the same PIDs
    assert "--systemd-scopes" in plugin["args"]
    assert mounts["run-systemd"]["mountPath"] == "/run/systemd"
    assert volumes["run-systemd"]["hostPath"]["path"] == "/run/systemd"

    # the cache is a hostPath, and the plugin is told to keep its volumes there
    assert volumes["cache-dir"]["hostPath"]["path"] == mounts["cache-dir"]["mountPath"]
    assert f"--state-dir={mounts['cache-dir']['mountPath']}" in plugin["args"]

    # the plugin's socket is where the registrar looks and tells kubelet to look
    sock_dir = mounts["plugin-dir"]["mountPath"]
    assert f"--endpoint=unix://{sock_dir}/csi.sock" in plugin["args"]
    assert f"--csi-address={sock_dir}/csi.sock" in registrar["args"]
    host_dir = volumes["plugin-dir"]["hostPath"]["path"]
    assert host_dir == f"/var/lib/kubelet/plugins/{DRIVER}"
    assert f"--kubelet-registration-path={host_dir}/csi.sock" in registrar["args"]
    reg_mount = next(m for m in registrar["volumeMounts"] if m["name"] == "registration-dir")
    assert reg_mount["mountPath"] == "/registration"
    assert volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"


def test_example_volume_uses_the_driver_and_only_known_attributes():
    from tierfs_csi.options import stage_spec

    from tierfs_csi import declared

    pv = _one("PersistentVolume")["spec"]
    assert pv["csi"]["driver"] == DRIVER
    attrs = pv["csi"]["volumeAttributes"]
    assert declared.parse(attrs).warms
    spec = stage_spec(declared.strip(attrs), [], False, "/staging")
    assert spec.source.startswith("s3://")
    secret = _one("Secret")
    ref = pv["csi"]["nodeStageSecretRef"]
    assert (ref["name"], ref["namespace"]) == (secret["metadata"]["name"],
                                              secret["metadata"]["namespace"])
    assert set(secret["stringData"]) == {"aws_access_key_id", "aws_secret_access_key"}
    claim = _one("PersistentVolumeClaim")
    assert claim["spec"]["volumeName"] == _one("PersistentVolume")["metadata"]["name"]
    pod = _one("Pod")["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # lets a running pod recover when its volume's daemon is restarted
    assert pod["containers"][0]["volumeMounts"][0]["mountPropagation"] == "HostToContainer"


def test_inline_job_declares_its_data_with_known_attributes():
    from tierfs_csi import declared
    from tierfs_csi.options import stage_spec

    pod = _one("Job")["spec"]["template"]["spec"]
    vol = pod["volumes"][0]["csi"]
    assert vol["driver"] == DRIVER
    secret = _one("Secret")["metadata"]
    assert vol["nodePublishSecretRef"]["name"] == secret["name"]
    assert _one("Job")["metadata"]["namespace"] == secret["namespace"]
    wanted = declared.parse(vol["volumeAttributes"])
    assert wanted.paths and wanted.manifest and wanted.auto and wanted.strict and wanted.pin
    assert wanted.timeout_s < 120  # within kubelet's 2 min for the call
    stage_spec(declared.strip(vol["volumeAttributes"]), [], True, "/staging")


def test_admission_policy_is_bound_and_checks_inline_tierfs_volumes():
    policy = _one("ValidatingAdmissionPolicy")
    binding = _one("ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert DRIVER in policy["spec"]["variables"][0]["expression"]
