"""Mount configuration: one frozen dataclass, parsed and validated in one place.

Every option has the same name on the command line (--cache-size), in `-o cache_size=...`
(as fstab passes them) and in TOML files (read_config_file: `tierfs mount --config`,
used by the systemd unit). Parsing errors raise UsageError with a message naming the
option, so the CLI can print one line and exit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field
from urllib.parse import urlparse

from .errors import UsageError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])i?)?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str | int, name: str = "size") -> int:
    """'500G' -> bytes (binary units: K=1024). Plain numbers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise UsageError(f"invalid {name} {text!r}: expected a size like 512M, 8MiB or 500G")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_size(n: float) -> str:
    """Bytes for people: '512 B', '8.0 MiB', '1.5 TiB' (binary units, like parse_size)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_duration(text: str | float, name: str = "duration") -> float:
    """'60', '60s', '5m', '1h' -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _DURATION_RE.match(str(text))
    if not m:
        raise UsageError(f"invalid {name} {text!r}: expected a duration like 30s, 5m or 1h")
    return float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]


def parse_bool(text: str | bool, name: str) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in ("1", "true", "yes", "on", ""):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"invalid {name} {text!r}: expected true or false")


@dataclass(frozen=True)
class Source:
    """Where the objects live: s3://bucket/prefix or file:///directory."""

    scheme: str  # "s3" | "file"
    bucket: str  # bucket name, or the directory for file://
    prefix: str  # "" or "a/b/" (always ends with "/" when not empty)

    @classmethod
    def parse(cls, url: str) -> "Source":
        u = urlparse(url)
        if u.scheme == "s3":
            if not u.netloc:
                raise UsageError(f"invalid source {url!r}: expected s3://BUCKET[/PREFIX]")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.\-_]{1,254}", u.netloc):
                raise UsageError(f"invalid bucket name {u.netloc!r} in source {url!r}")
            prefix = u.path.lstrip("/")
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            return cls("s3", u.netloc, prefix)
        if u.scheme == "file":
            path = u.netloc + u.path if u.netloc else u.path
            if not path.startswith("/"):
                raise UsageError(f"invalid source {url!r}: expected file:///ABSOLUTE/PATH")
            return cls("file", os.path.normpath(path), "")
        raise UsageError(f"invalid source {url!r}: expected s3://BUCKET[/PREFIX] or file:///DIR")

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.bucket}"
        return f"s3://{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class MountConfig:
    source: Source
    mountpoint: str
    endpoint_url: str | None = None
    region: str | None = None
    cache_dir: str = ""
    cache_size: int = 10 << 30
    memory_cache_size: int = 256 << 20
    chunk_size: int = 8 << 20
    metadata_ttl: float = 60.0
    metrics_addr: tuple[str, int] | None = None
    allow_other: bool = False
    read_only: bool = False
    log_level: str = "info"
    log_file: str | None = None
    # keep at least this fraction of the cache filesystem free, whatever cache_size says
    min_free_ratio: float = 0.10
    # evict when usage passes high * budget, down to low * budget
    evict_high: float = 0.95
    evict_low: float = 0.90
    # heat halves after this long without access; sets how long "hot" is remembered
    heat_half_life: float = 1800.0
    readahead_chunks: int = 8
    backend_concurrency: int = 16
    # parallel GETs of `tierfs warm`, on threads of their own (see backend/runner.py)
    warm_concurrency: int = 16
    backend_timeout: float = 30.0
    backend_retries: int = 4
    # keep glibc from hoarding freed 8 MiB chunk buffers (RSS stays near the memory tier);
    # costs cold-read throughput, as every chunk buffer is a fresh mmap (bench/README.md)
    bounded_memory: bool = True
    # write-back: close() returns before the upload (fsync still waits for S3)
    writeback: bool = False
    # how long writers wait for uploads to free budget before ENOSPC
    dirty_wait: float = 60.0
    # directories with more objects than this are not renamed (EXDEV: mv copies instead)
    rename_max_objects: int = 1000
    # at unmount, pending uploads get this long; what is left stays journaled for the next mount
    drain_timeout: float = 60.0
    # a backend request running longer than this logs one WARNING and counts a stall
    stall_warn: float = 10.0
    # a mount of a cache dir with an index waits this long for the store, then mounts
    # degraded (serving what is cached) instead of failing
    startup_timeout: float = 10.0
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    file_mode: int = 0o644
    dir_mode: int = 0o755

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> UsageError:
            return UsageError(f"invalid {name.replace('_', '-')}: {why}")

        if self.chunk_size < 64 << 10 or self.chunk_size > 256 << 20:
            raise bad("chunk_size", "must be between 64K and 256M")
        if self.chunk_size & (self.chunk_size - 1):
            raise bad("chunk_size", "must be a power of two (e.g. 4M, 8M, 16M)")
        if self.cache_size < 2 * self.chunk_size:
            raise bad("cache_size", "must hold at least two chunks")
        if self.memory_cache_size < 0:
            raise bad("memory_cache_size", "must not be negative")
        if self.metadata_ttl < 0:
            raise bad("metadata_ttl", "must not be negative")
        if not 0 <= self.min_free_ratio < 1:
            raise bad("min_free_ratio", "must be in [0, 1)")
        if not 0 < self.evict_low < self.evict_high <= 1:
            raise bad("evict_low/evict_high", "need 0 < low < high <= 1")
        if self.heat_half_life <= 0:
            raise bad("heat_half_life", "must be positive")
        if not 1 <= self.readahead_chunks <= 64:
            raise bad("readahead_chunks", "must be between 1 and 64")
        if not 1 <= self.backend_concurrency <= 256:
            raise bad("backend_concurrency", "must be between 1 and 256")
        if not 1 <= self.warm_concurrency <= 256:
            raise bad("warm_concurrency", "must be between 1 and 256")
        if self.dirty_wait < 0:
            raise bad("dirty_wait", "must not be negative")
        if self.rename_max_objects < 0:
            raise bad("rename_max_objects", "must not be negative")
        if self.drain_timeout < 0:
            raise bad("drain_timeout", "must not be negative")
        if self.stall_warn <= 0:
            raise bad("stall_warn", "must be positive")
        if self.startup_timeout <= 0:
            raise bad("startup_timeout", "must be positive")
        if self.backend_timeout <= 0:
            raise bad("backend_timeout", "must be positive")
        if not 1 <= self.backend_retries <= 20:
            raise bad("backend_retries", "must be between 1 and 20")
        if self.uid < 0 or self.gid < 0:
            raise bad("uid/gid", "must not be negative")
        if not (0 <= self.file_mode <= 0o7777 and 0 <= self.dir_mode <= 0o7777):
            raise bad("file_mode/dir_mode", "must be octal permissions like 0644")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise bad("log_level", "one of debug, info, warning, error")
        if self.endpoint_url is not None:
            u = urlparse(self.endpoint_url)
            if u.scheme not in ("http", "https") or not u.netloc:
                raise bad("endpoint_url", f"{self.endpoint_url!r} is not an http(s) URL")

    @property
    def effective_cache_dir(self) -> str:
        if self.cache_dir:
            return os.path.abspath(self.cache_dir)
        ident = f"{self.source}|{self.endpoint_url or ''}".encode()
        return f"/var/cache/tierfs/{hashlib.sha256(ident).hexdigest()[:16]}"


_CONVERTERS = {
    "cache_size": parse_size,
    "memory_cache_size": parse_size,
    "chunk_size": parse_size,
    "metadata_ttl": parse_duration,
    "heat_half_life": parse_duration,
    "backend_timeout": parse_duration,
    "dirty_wait": parse_duration,
    "drain_timeout": parse_duration,
    "stall_warn": parse_duration,
    "startup_timeout": parse_duration,
    "writeback": parse_bool,
    "bounded_memory": parse_bool,
    "allow_other": parse_bool,
    "read_only": parse_bool,
}
# generic mount(8) options fstab passes along; they mean nothing to tierfs
_IGNORED_MOUNT_OPTIONS = {"rw", "defaults", "auto", "noauto", "nofail", "_netdev", "user",
                          "nouser", "users", "noatime", "relatime", "nodev", "nosuid", "noexec",
                          "dev", "suid", "exec", "atime"}


def _convert(name: str, value: object) -> object:
    if name in _CONVERTERS:
        return _CONVERTERS[name](value, name.replace("_", "-"))  # type: ignore[operator]
    if name == "metrics_addr":
        return parse_addr(str(value))
    ftype = {f.name: f.type for f in dataclasses.fields(MountConfig)}[name]
    try:
        if ftype == "int" and name.endswith("_mode"):
            return int(str(value), 8)
        if ftype == "int":
            return int(value)  # type: ignore[arg-type]
        if ftype == "float":
            return float(value)  # type: ignore[arg-type]
    except ValueError:
        raise UsageError(f"invalid {name.replace('_', '-')} {value!r}: expected a number") from None
    return value


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"invalid metrics-addr {text!r}: expected HOST:PORT")
    return (host or "127.0.0.1", int(port))


def parse_o_options(items: list[str]) -> dict[str, object]:
    """['cache_size=5G,ro', ...] -> {'cache_size': '5G', 'read_only': True}."""
    out: dict[str, object] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part or part in _IGNORED_MOUNT_OPTIONS:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if key == "ro":
                key, value, sep = "read_only", "true", "="
            out[key] = value if sep else True
    return out


def build_config(source: str, mountpoint: str, options: dict[str, object]) -> MountConfig:
    """Validate raw option values (strings from argv, -o or TOML) into a MountConfig."""
    names = {f.name for f in dataclasses.fields(MountConfig)} - {"source", "mountpoint"}
    kwargs: dict[str, object] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key not in names:
            raise UsageError(f"unknown option {key!r}")
        if value is True and key not in ("allow_other", "read_only", "writeback"):
            raise UsageError(f"option {key.replace('_', '-')} needs a value")
        kwargs[key] = _convert(key, value)
    if not mountpoint:
        raise UsageError("missing MOUNTPOINT")
    return MountConfig(source=Source.parse(source), mountpoint=os.path.abspath(mountpoint),
                       **kwargs)  # type: ignore[arg-type]


# keys whose values are paths: a config file is read by a daemon whose working directory
# is / under systemd, so a relative path there would silently mean something else
_PATH_KEYS = ("mountpoint", "cache_dir", "log_file")


def read_config_file(path: str) -> dict[str, object]:
    """Read a TOML mount configuration: top-level keys `source`, `mountpoint` and the mount
    options under their names (dashes or underscores), typed TOML values or the strings
    the command line takes ("500G", "30s"). Returns raw values for build_config; every
    problem is a UsageError naming the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None
    types = {f.name: f.type for f in dataclasses.fields(MountConfig)}
    out: dict[str, object] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key in out:
            raise UsageError(f"{path}: {raw_key!r} is given twice (dashes and underscores "
                             f"name the same option)")
        if key not in types:
            raise UsageError(f"{path}: unknown option {raw_key!r}")
        out[key] = _check_toml_value(path, key, types[key], value)
    return out


def _check_toml_value(path: str, key: str, ftype: str, value: object) -> object:
    """Reject the TOML types that build_config would misread (it was written for strings)."""
    def bad(why: str) -> UsageError:
        return UsageError(f"{path}: {key}: {why}")

    if isinstance(value, (dict, list)) or not isinstance(value, (str, int, float)):
        raise bad("expected a string, number or boolean")
    if isinstance(value, bool):
        if ftype != "bool":
            raise bad("expected a value, not true/false")
        return value
    if key in ("source", "mountpoint") or ftype.startswith("str"):
        if not isinstance(value, str):
            raise bad("expected a string")
        if key in _PATH_KEYS and not os.path.isabs(value):
            raise bad(f"{value!r} is not an absolute path")
        return value
    if key.endswith("_mode") and not isinstance(value, str):
        # TOML 644 is decimal 644, not octal: only a string says what is meant
        raise bad('write the mode as a string, e.g. "0644"')
    if ftype == "int" and isinstance(value, float):
        raise bad(f"expected a whole number, not {value}")
    return value


def build_config_with_file(path: str, source: str | None, mountpoint: str | None,
                           overrides: dict[str, object]) -> MountConfig:
    """The config file's values, then the command line's on top (the command line wins).

    The file is validated on its own first, so a bad value in it is reported with the
    file's name; what the command line gives is reported as before."""
    options = read_config_file(path)
    file_source, file_mountpoint = options.pop("source", None), options.pop("mountpoint", None)
    source = source or file_source  # type: ignore[assignment]
    mountpoint = mountpoint or file_mountpoint  # type: ignore[assignment]
    if not source:
        raise UsageError(f"no source: give SOURCE on the command line or `source = ...` in {path}")
    if not mountpoint:
        raise UsageError(f"no mount point: give MOUNTPOINT on the command line or "
                         f"`mountpoint = ...` in {path}")
    try:
        build_config(str(source), str(mountpoint), options)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return build_config(str(source), str(mountpoint), {**options, **overrides})
