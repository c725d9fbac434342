"""Volume attributes and mount flags -> the arguments of `tierfs mount`.

Attributes use the CLI's option names (README.md; dashes or underscores), validated by
tierfs.config's schema itself (the same types, units and ranges as the command line: a
memory tier larger than the node's RAM, a NaN, a newline in a region are refused), so an
unknown name or a bad value is refused at NodeStageVolume with tierfs's own message,
instead of a daemon that fails to start. `bucket` and
`prefix` make the source. What the plugin must decide itself (cache dir, log file,
allow_other) cannot be set by a volume.
"""

from __future__ import annotations

import dataclasses

from tierfs.config import OPTIONS, build_config, check_text, parse_bool, parse_o_options
from tierfs.errors import UsageError

# Kubernetes adds these itself (podInfoOnMount, provisioner identity): not ours to judge
_K8S_PREFIXES = ("csi.storage.k8s.io/", "storage.kubernetes.io/")
_PLUGIN_OWNED = {
    "cache_dir": "the plugin keeps one cache dir per volume under its --state-dir",
    "log_file": "the daemon logs to its cache dir",
}
_SOURCE_KEYS = ("bucket", "prefix")


class OptionError(ValueError):
    """Bad volume attribute or mount flag; the message names it."""


MAX_ATTRIBUTES = 64  # more than there are options: a bigger map is not a volume's


def tierfs_option_names() -> list[str]:
    return sorted(n for n in OPTIONS if n not in _PLUGIN_OWNED)


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """What a volume is staged with: compared when NodeStageVolume is repeated."""

    source: str
    options: dict[str, str]  # tierfs option name -> value as given (validated)
    read_only: bool

    def mount_args(self) -> list[str]:
        """The options of `tierfs mount` after SOURCE MOUNTPOINT (the cache dir aside)."""
        args: list[str] = []
        if self.options:
            args += ["-o", ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))]
        if self.read_only:
            args.append("--read-only")
        # pods run as arbitrary uids; the bind mounts carry the daemon's allow_other
        return args + ["--allow-other"]


def stage_spec(context: dict[str, str], mount_flags: list[str], read_only: bool,
               staging_path: str, *, node_ip: str | None = None) -> StageSpec:
    """`node_ip`: this node's address (the DaemonSet's POD_IP; the node's IP with
    hostNetwork). A volume with `peers` that listens on every address (`peer-listen:
    0.0.0.0:PORT`) and says no `peer-advertise` is advertised at NODE_IP:PORT: one volume
    spec serves every node, each node advertising its own address."""
    attrs = {k.replace("-", "_"): v for k, v in context.items()
             if not k.startswith(_K8S_PREFIXES)}
    if len(attrs) > MAX_ATTRIBUTES or len(mount_flags) > MAX_ATTRIBUTES:
        raise OptionError(f"more than {MAX_ATTRIBUTES} volume attributes or mount flags")
    for key, value in attrs.items():
        try:
            check_text(key, max_len=64, what="a name")
            check_text(value, what="a value")
        except ValueError as exc:
            raise OptionError(f"volume attribute {_short(key)}: {exc}") from None
    bucket = attrs.pop("bucket", "").strip()
    if not bucket:
        raise OptionError("volume attribute 'bucket' is required (volumeAttributes.bucket)")
    prefix = attrs.pop("prefix", "").strip().strip("/")
    source = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    options: dict[str, str] = {}
    for key, value in attrs.items():
        _check_name(key, "volume attribute")
        options[key] = str(value)
    try:
        flags = parse_o_options(mount_flags)
    except UsageError as exc:
        raise OptionError(f"mount flags: {exc}") from None
    for key, value in flags.items():
        _check_name(key, "mount flag")
        options[key] = "true" if value is True else str(value)
    if _as_bool(options.pop("read_only", "false")):
        read_only = True
    options.pop("allow_other", None)  # always on (mount_args)
    _advertise_node(options, node_ip)
    for key, value in options.items():
        if "," in value or "\n" in value:
            raise OptionError(f"volume attribute {key!r}: value must not contain ',' or newlines")
    try:
        build_config(source, staging_path, {**options, "read_only": read_only})
    except UsageError as exc:
        raise OptionError(f"volume attributes: {exc}") from None
    return StageSpec(source, options, read_only)


def _advertise_node(options: dict[str, str], node_ip: str | None) -> None:
    listen = options.get("peer_listen", "")
    host, _, port = listen.rpartition(":")
    if ("peers" in options and "peer_advertise" not in options and node_ip
            and host.strip("[]") in ("0.0.0.0", "::") and port):
        options["peer_advertise"] = f"[{node_ip}]:{port}" if ":" in node_ip \
            else f"{node_ip}:{port}"


def _check_name(key: str, what: str) -> None:
    if key in _PLUGIN_OWNED:
        raise OptionError(f"{what} {key!r} cannot be set: {_PLUGIN_OWNED[key]}")
    if key not in tierfs_option_names():
        raise OptionError(f"unknown {what} {_short(key)}; known: "
                          f"{', '.join([*_SOURCE_KEYS, *tierfs_option_names()])}")


def _short(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57]) + "..."


def _as_bool(value: str) -> bool:
    try:
        return parse_bool(value, "read-only")
    except UsageError as exc:
        raise OptionError(f"volume attribute 'read_only': {exc}") from None
