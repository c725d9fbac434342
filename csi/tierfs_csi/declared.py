"""What a pod declares in its volume's attributes, and who the pod is (podInfoOnMount).

Declared data (docs/kubernetes.md, "Declared data"):

    warm           paths or globs relative to the volume, comma-separated
    warm_manifest  a manifest file inside the volume: one path or glob a line, # comments
    warm_auto      "true": what the last pod of the same workload read on this node
    warm_timeout   one deadline for all of the warm (default 100s, below kubelet's 2 min
                   call timeout)
    warm_strict    "true": a failed or partial warm fails the mount (FailedMount event)
    pin            "true": what was warmed stays pinned until NodeUnpublishVolume
    tenant_from    "namespace": the pod's reads count for a tenant named as its namespace
    tenant         a fixed tenant for the pods' reads of this volume
    workload       the workload warm_auto keys on (default: the pod's name without the
                   suffix a Job, ReplicaSet or DaemonSet controller adds)

Paths are the volume's, never the node's: a leading "/" is the volume's root, and `..`,
NUL and control characters are refused here, before anything is asked of the daemon,
which then resolves them from its own listings without following symlinks. These keys
are taken out before the rest become `tierfs mount` options (options.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re

from tierfs.config import check_text, parse_bool, parse_duration
from tierfs.errors import UsageError

from .options import OptionError

KEYS = ("warm", "warm_manifest", "warm_auto", "warm_timeout", "warm_strict", "pin",
        "tenant_from", "tenant", "workload")
DEFAULT_TIMEOUT_S = 100.0
MAX_TIMEOUT_S = 3600.0
MAX_WARM_PATHS = 256  # in the attribute; a manifest names more
_POD_KEYS = {
    "csi.storage.k8s.io/pod.uid": "uid",
    "csi.storage.k8s.io/pod.namespace": "namespace",
    "csi.storage.k8s.io/pod.name": "name",
    "csi.storage.k8s.io/serviceAccount.name": "service_account",
}
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
_DNS = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
_UID = re.compile(r"[A-Za-z0-9-]{1,64}")
# what controllers append to a pod's name: Job / DaemonSet "-x7k2p", ReplicaSet
# "-5d4f8c7b9-x7k2p"; a StatefulSet's "-0" is the pod itself and is kept
_GENERATED = re.compile(r"(-[a-z0-9]{6,10})?-[a-z0-9]{5}$")


def strip(context: dict[str, str]) -> dict[str, str]:
    """The attributes without the declared-data keys (dashes or underscores)."""
    return {k: v for k, v in context.items() if k.replace("-", "_") not in KEYS}


@dataclasses.dataclass(frozen=True)
class Pod:
    uid: str
    namespace: str
    name: str
    service_account: str

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_of(context: dict[str, str]) -> Pod | None:
    """The pod kubelet names in a publish's context (podInfoOnMount), or None; a pod UID
    or a name that is not one is INVALID_ARGUMENT (they reach logs and label values)."""
    found = {field: context.get(key, "") for key, field in _POD_KEYS.items()}
    if not found["uid"]:
        return None
    if not _UID.fullmatch(found["uid"]):
        raise OptionError("csi.storage.k8s.io/pod.uid is not a Kubernetes UID")
    for field in ("namespace", "name", "service_account"):
        if found[field] and not _DNS.fullmatch(found[field]):
            raise OptionError(f"csi.storage.k8s.io/ pod {field} {found[field][:80]!r} is not a "
                              "Kubernetes name")
    if not found["namespace"]:
        raise OptionError("csi.storage.k8s.io/pod.namespace is missing beside pod.uid")
    return Pod(found["uid"], found["namespace"], found["name"] or found["uid"],
               found["service_account"])


def is_ephemeral(context: dict[str, str]) -> bool:
    return context.get(EPHEMERAL_KEY, "").lower() == "true"


@dataclasses.dataclass(frozen=True)
class Declared:
    paths: tuple[str, ...] = ()
    manifest: str | None = None
    auto: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    strict: bool = False
    pin: bool = False
    tenant_from: str | None = None
    tenant: str | None = None
    workload: str | None = None

    @property
    def warms(self) -> bool:
        return bool(self.paths or self.manifest or self.auto)

    def digest(self) -> str:
        """Compared when a publish is repeated: the same target with other declared data
        is another publish (ALREADY_EXISTS)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def tenant_for(self, pod: Pod) -> str | None:
        return pod.namespace if self.tenant_from == "namespace" else self.tenant

    def workload_of(self, pod: Pod) -> str:
        return self.workload or _GENERATED.sub("", pod.name) or pod.name


def rel_path(value: str, what: str) -> str:
    """A path or glob of the volume: "/" and "" are its root; `..` is refused."""
    try:
        check_text(value, max_len=4096, what="a path")
    except ValueError as exc:
        raise OptionError(f"{what}: {exc}") from None
    parts = [p for p in value.strip().split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OptionError(f"{what}: {value[:200]!r}: '..' is not allowed (paths are the "
                          "volume's)")
    return "/".join(parts)


def parse(context: dict[str, str]) -> Declared:
    attrs = {k.replace("-", "_"): v for k, v in context.items()}
    paths: list[str] = []
    for item in (attrs.get("warm") or "").split(","):
        if item.strip():
            paths.append(rel_path(item, "volume attribute 'warm'"))
    if len(paths) > MAX_WARM_PATHS:
        raise OptionError(f"volume attribute 'warm': more than {MAX_WARM_PATHS} paths (name "
                          "folders or globs, or use warm_manifest)")
    manifest = None
    if (attrs.get("warm_manifest") or "").strip():
        manifest = rel_path(attrs["warm_manifest"], "volume attribute 'warm_manifest'")
        if not manifest:
            raise OptionError("volume attribute 'warm_manifest' names the volume's root, "
                              "not a file")
    timeout = DEFAULT_TIMEOUT_S
    if (attrs.get("warm_timeout") or "").strip():
        try:
            timeout = parse_duration(attrs["warm_timeout"].strip())
        except (UsageError, ValueError) as exc:
            raise OptionError(f"volume attribute 'warm_timeout': {exc}") from None
        if not 0 < timeout <= MAX_TIMEOUT_S:
            raise OptionError(f"volume attribute 'warm_timeout' must be more than 0 and at "
                              f"most {MAX_TIMEOUT_S:g}s")
    tenant_from = (attrs.get("tenant_from") or "").strip() or None
    if tenant_from not in (None, "namespace"):
        raise OptionError("volume attribute 'tenant_from' takes 'namespace'")
    tenant = (attrs.get("tenant") or "").strip() or None
    if tenant is not None and (len(tenant) > 63 or not _DNS.fullmatch(tenant)):
        raise OptionError("volume attribute 'tenant' must be a Kubernetes-style name "
                          "(a-z, 0-9, '-', '.')")
    if tenant and tenant_from:
        raise OptionError("volume attributes 'tenant' and 'tenant_from': give one of them")
    workload = (attrs.get("workload") or "").strip() or None
    if workload is not None and (len(workload) > 253 or not _DNS.fullmatch(workload)):
        raise OptionError("volume attribute 'workload' must be a Kubernetes-style name")
    return Declared(tuple(dict.fromkeys(paths)), manifest, _bool(attrs, "warm_auto"), timeout,
                    _bool(attrs, "warm_strict"), _bool(attrs, "pin"), tenant_from, tenant,
                    workload)


def _bool(attrs: dict[str, str], key: str) -> bool:
    value = (attrs.get(key) or "").strip()
    if not value:
        return False
    try:
        return parse_bool(value, key)
    except UsageError as exc:
        raise OptionError(f"volume attribute {key!r}: {exc}") from None
