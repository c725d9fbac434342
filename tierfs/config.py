"""Mount configuration: one schema, declared once, for every way options arrive.

MountConfig is a frozen pydantic model: each option is declared once with its type, unit,
range and meaning, and that declaration validates the command line (--cache-size), `-o
cache_size=...` (as fstab passes them), TOML files (read_config_file: `tierfs mount
--config`, the systemd unit) and the CSI plugin's volume attributes, and generates the
options table of docs/operations.md (`python -m tierfs.config --doc-table`).

Rules every value obeys, whatever its source: numbers are finite (no NaN, no Infinity),
sizes fit the machine (the memory tier in RAM), durations are at most a year, uid/gid are
32-bit ids, URLs are parsed here (not by botocore in the background daemon), and text has
no control characters and a bounded length. Files that hold secrets (peer_secret_file,
peer_tls_key) are checked here: regular, the daemon's user's, mode 0600 or stricter; the
secret's bytes are read by read_peer_secret only, never kept in the config. Any problem is
one UsageError whose message names the option and the reason, so the CLI prints one line
and exits.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import stat
import sys
import tomllib
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Callable, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from .errors import UsageError
from .tenants import Share, Tenant, TenantMap

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgtp])i?)?b?\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE | re.ASCII)
_SECONDS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600),
            "d": Decimal(86400)}
_INT_RE = re.compile(r"^\s*[+-]?\d{1,30}\s*$", re.ASCII)
_FLOAT_RE = re.compile(r"^\s*[+-]?(?:\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})\s*$", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# bounds shared by every input (mount options, control requests, slurm settings)
MAX_TEXT = 4096  # PATH_MAX: the longest path, URL or name any option takes
MAX_DURATION = 365 * 86400.0  # a year: beyond it, timestamps and timers stop making sense
MAX_CACHE_SIZE = 1 << 50  # 1 PiB: no node's disk tier is larger; keeps byte counts in int64
MAX_ID = (1 << 32) - 2  # uid_t/gid_t are 32-bit; 2^32-1 is (uid_t)-1, "no change"
MAX_JOB_ID = 64
JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+:-]{0,63}", re.ASCII)  # 1234, 1234_7, 1234+0


def physical_memory() -> int:
    """Bytes of RAM of this machine (the memory tier must fit in it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not Linux: no cap rather than a wrong one
        return MAX_CACHE_SIZE


# ---- the value parsers (also used by ctl and slurm) ----------------------------------------


def _size_value(text: object) -> int:
    if isinstance(text, bool):
        raise ValueError("expected a size like 512M, 8MiB or 500G, not true/false")
    if isinstance(text, int):
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text != int(text):
            raise ValueError("expected a whole number of bytes")
        return int(text)
    m = _SIZE_RE.match(str(text)) if isinstance(text, str) and len(text) <= 64 else None
    if not m:
        raise ValueError("expected a size like 512M, 8MiB or 500G")
    # Decimal, not float: a 40-digit number stays a number (float would become inf)
    return int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


HEAD_ALL = 5 << 40  # meta_head_max_size "all": no object is larger


def _head_size_value(text: object) -> int | None:
    word = text.strip().lower() if isinstance(text, str) else ""
    if text is None:  # the default: decided by allow_other (MountConfig._consistent)
        return None
    if word in ("off", "all"):
        return -1 if word == "off" else HEAD_ALL
    return _size_value(text)



def _show_head_size(n: float) -> str:
    return {-1: "off", HEAD_ALL: "all"}.get(int(n)) or _show_size(n)


def _duration_value(text: object) -> float:
    if isinstance(text, bool):
        raise ValueError("expected a duration like 30s, 5m or 1h, not true/false")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION_RE.match(text) if isinstance(text, str) and len(text) <= 64 else None
        if not m:
            raise ValueError("expected a duration like 30s, 5m or 1h")
        value = float(Decimal(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()])
    if not math.isfinite(value):
        raise ValueError("must be a finite number of seconds")
    return value


def parse_size(text: str | int, name: str = "size") -> int:
    """'500G' -> bytes (binary units: K=1024). Plain numbers are bytes."""
    try:
        return _size_value(text)
    except ValueError as exc:
        raise UsageError(f"invalid {name} {_show(text)}: {exc}") from None


def parse_duration(text: str | float, name: str = "duration") -> float:
    """'60', '60s', '5m', '1h' -> seconds (finite; ranges are the caller's schema)."""
    try:
        return _duration_value(text)
    except ValueError as exc:
        raise UsageError(f"invalid {name} {_show(text)}: {exc}") from None


def _bool_value(text: object) -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower() if isinstance(text, str) else None
    if low in ("1", "true", "yes", "on", ""):  # "" is `-o allow_other=`, as fstab writes it
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_bool(text: str | bool, name: str) -> bool:
    try:
        return _bool_value(text)
    except ValueError as exc:
        raise UsageError(f"invalid {name} {_show(text)}: {exc}") from None


def format_size(n: float) -> str:
    """Bytes for people: '512 B', '8.0 MiB', '1.5 TiB' (binary units, like parse_size)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _show(value: object, limit: int = 60) -> str:
    """A value inside an error message: repr (so a newline cannot start a forged line),
    cut to a length a terminal line holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def printable(text: str) -> str:
    """A message for one line of a terminal or log: control characters as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_text(value: object, *, max_len: int = MAX_TEXT, what: str = "text") -> str:
    """A string without control characters (no newline that forges a log line, no escape
    sequence) and at most max_len characters."""
    if not isinstance(value, str):
        raise ValueError(f"expected {what}")
    if len(value) > max_len:
        raise ValueError(f"longer than {max_len} characters")
    if _CONTROL.search(value):
        raise ValueError("contains a control character (newline, tab, escape...)")
    return value


def check_job_id(value: object) -> str:
    """A Slurm job id as the control protocol, the CLI and the hooks take it."""
    text = check_text(value, max_len=MAX_JOB_ID, what="a job id")
    if not JOB_ID_RE.fullmatch(text):
        raise ValueError("expected a job id like 1234 or 1234_7 (letters, digits, . _ + : -)")
    return text


# ---- Source --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where the objects live: s3://bucket/prefix or file:///directory."""

    scheme: str  # "s3" | "file"
    bucket: str  # bucket name, or the directory for file://
    prefix: str  # "" or "a/b/" (always ends with "/" when not empty)

    @classmethod
    def parse(cls, url: str, what: str = "source") -> "Source":
        try:
            check_text(url, what=f"a {what} URL")
            u = urlsplit(url)
        except ValueError as exc:
            raise UsageError(f"invalid {what} {_show(url)}: {exc}") from None
        if u.scheme == "s3":
            if not u.netloc:
                raise UsageError(f"invalid {what} {_show(url)}: expected s3://BUCKET[/PREFIX]")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.\-_]{1,254}", u.netloc, re.ASCII):
                raise UsageError(f"invalid bucket name {_show(u.netloc)} in {what} {_show(url)}")
            prefix = u.path.lstrip("/")
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            return cls("s3", u.netloc, prefix)
        if u.scheme == "file":
            path = u.netloc + u.path if u.netloc else u.path
            if not path.startswith("/"):
                raise UsageError(f"invalid {what} {_show(url)}: expected file:///ABSOLUTE/PATH")
            return cls("file", os.path.normpath(path), "")
        raise UsageError(f"invalid {what} {_show(url)}: expected s3://BUCKET[/PREFIX] "
                         f"or file:///DIR")

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.bucket}"
        return f"s3://{self.bucket}/{self.prefix}"


# ---- field types ---------------------------------------------------------------------------
# Each is an Annotated type: a parser from what users write (strings from argv and -o, TOML
# values, Python values from tests and the CSI plugin), then a range check whose message
# speaks the option's unit. `kind` and `allowed` feed read_config_file's TOML checks and
# the generated docs table.


def _ranged(lo: float | None, hi: float | None, show: Callable[[Any], str], *,
            lo_open: bool = False, hi_open: bool = False,
            hi_why: str = "") -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if lo is not None and (value <= lo if lo_open else value < lo):
            raise ValueError(f"must be {'more than' if lo_open else 'at least'} {show(lo)}")
        if hi is not None and (value >= hi if hi_open else value > hi):
            raise ValueError(f"must be {'less than' if hi_open else 'at most'} {show(hi)}"
                             f"{hi_why}")
        return value
    return check


def _show_size(n: float) -> str:
    for unit, shift in (("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0 and (shift > 10 or n < 1 << 20):
            return f"{int(n) >> shift}{unit}"
    return format_size(n) if n >= 1024 else f"{int(n)}"


def _head_size_check(value: int | None) -> int | None:
    return value if value is None else _ranged(-1, HEAD_ALL, _show_head_size)(value)


def _show_duration(s: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n and s % n == 0:
            return f"{int(s // n)}{unit}"
    return f"{s:g}s"


def _int_value(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a whole number, not true/false")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str) and _INT_RE.match(value):
        return int(value)
    raise ValueError("expected a whole number")


def _float_value(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a number, not true/false")
    if isinstance(value, (int, float)):
        value = float(value)
    elif isinstance(value, str) and _FLOAT_RE.match(value):
        value = float(value)
    else:
        raise ValueError("expected a number like 0.1")
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _mode_value(value: object) -> int:
    if isinstance(value, str) and re.fullmatch(r"\s*0?[0-7]{1,4}\s*", value, re.ASCII):
        return int(value, 8)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o7777:
        return value
    raise ValueError("expected octal permissions like 0644")


def _url_value(value: object) -> str:
    text = check_text(value, what="a URL")
    if " " in text:
        raise ValueError("contains a space")
    u = urlsplit(text)  # raises ValueError on an unclosed [IPv6 bracket
    if u.scheme not in ("http", "https") or not u.netloc or not u.hostname:
        raise ValueError("expected an http(s) URL like http://rgw:7480")
    u.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    return text


def _addr_value(value: object) -> tuple[str, int]:
    if isinstance(value, tuple) and len(value) == 2:
        host, port = value
        value = f"{host}:{port}"
    text = check_text(value, max_len=300, what="HOST:PORT")
    host, sep, port = text.rpartition(":")
    if not sep or not re.fullmatch(r"\d{1,5}", port, re.ASCII) or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT")
    if " " in host:
        raise ValueError("expected HOST:PORT (the host contains a space)")
    return (host.strip("[]") or "127.0.0.1", int(port))


def _region_value(value: object) -> str:
    text = check_text(value, max_len=64, what="a region name")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text, re.ASCII):
        raise ValueError("expected a region name like us-east-1 (letters, digits, . _ -)")
    return text


def _profile_value(value: object) -> str:
    text = check_text(value, max_len=64, what="a profile name")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text, re.ASCII):
        raise ValueError("expected an AWS profile name (letters, digits, . _ -)")
    return text


def _path_value(value: object) -> str:
    text = check_text(value, what="a path")
    if not text:
        raise ValueError("expected a path")
    return text


def _source_value(value: object) -> object:
    return Source.parse(value) if isinstance(value, str) else value


_PEER_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})", re.ASCII)


def _peers_value(value: object) -> str:
    """The syntax of a peers source (tierfs/peers/members.py reads it)."""
    text = check_text(value, what="a peers source").strip()
    kind, sep, rest = text.partition(":")
    if text == "slurm":
        return text
    if sep and kind == "file":
        if not rest.startswith("/"):
            raise ValueError("expected file:/ABSOLUTE/PATH")
        return text
    if sep and kind == "dns":
        name, sep, port = rest.rpartition(":")
        if not (sep and _PEER_HOST_RE.fullmatch(name) and ".." not in name
                and re.fullmatch(r"\d{1,5}", port, re.ASCII) and 0 < int(port) < 65536):
            raise ValueError("expected dns:NAME:PORT")
        return text
    raise ValueError("expected file:PATH, dns:NAME:PORT or slurm")


def _bandwidth_value(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("unlimited", "")):
        return None
    if isinstance(value, str):
        value = re.sub(r"(?i)\s*/\s*s\s*$", "", value)  # "500M/s" as the docs write it
    return _size_value(value)


def _bandwidth_check(value: int | None) -> int | None:
    return value if value is None else _ranged(64 << 10, MAX_CACHE_SIZE, _show_size)(value)


def _abs_file_value(value: object) -> str | None:
    if value is None:
        return None
    text = _path_value(value)
    if not os.path.isabs(text):
        raise ValueError("expected an absolute path")
    return text


_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$", re.ASCII)
_TENANT_KEYS = ("prefixes", "soft", "hard", "max_idle", "pin_ttl")


def _share_value(value: object) -> Share:
    """"40%" -> a fraction of the budget; a size ("200G", or bytes) -> bytes."""
    m = _PERCENT_RE.match(value) if isinstance(value, str) and len(value) <= 64 else None
    if m:
        return Share(fraction=float(Decimal(m.group(1)) / 100))
    try:
        n = _size_value(value)
    except ValueError:
        raise ValueError("expected a share of the cache like \"40%\" or a size like "
                         "\"200G\"") from None
    if n > MAX_CACHE_SIZE:
        raise ValueError(f"must be at most {_show_size(MAX_CACHE_SIZE)}")
    return Share(bytes=n)


def _tenant_duration(value: object) -> float:
    seconds = _duration_value(value)
    return _ranged(0, MAX_DURATION, _show_duration, lo_open=True)(seconds)


def _tenant(name: object, table: object) -> Tenant:
    where = f"tenant {_show(name)}" if not isinstance(name, str) or _CONTROL.search(name) \
        else f"tenant {name}"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table like {{prefixes = [\"KEY/PREFIX/\"]}}")
    fields: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = str(raw_key).replace("-", "_")
        if key not in _TENANT_KEYS or key in fields:
            why = ("given twice" if key in fields
                   else f"unknown key (known: {', '.join(_TENANT_KEYS)})")
            raise ValueError(f"{where}: {_show(raw_key)}: {why}")
        try:
            if key == "prefixes":
                if isinstance(value, str) or not isinstance(value, (list, tuple)):
                    raise ValueError("expected a list of key prefixes like [\"ckpt/vision/\"]")
                if not value:  # likely a slip: say how to write what it may have meant
                    raise ValueError("expected at least one key prefix (leave `prefixes` out "
                                     "for a tenant only readers name, e.g. a Kubernetes "
                                     "namespace: docs/tenants.md)")
                fields[key] = tuple(value)
            elif key in ("soft", "hard"):
                fields[key] = _share_value(value)
            else:
                fields[key] = _tenant_duration(value)
        except ValueError as exc:
            raise ValueError(f"{where}: {key}: {exc}") from None
    return Tenant(name=name, **fields)  # type: ignore[arg-type]  # Tenant checks the name


def _tenants_value(value: object) -> TenantMap:
    """A TOML table of tables ([tenants.NAME] in a mount's file) or the same as one inline
    TOML string (`-o tenants={vision = {prefixes = ["ckpt/vision/"]}}`, CSI attributes)."""
    if isinstance(value, TenantMap):
        return value
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 64 * 1024:
            raise ValueError("longer than 64 KiB")
        like = 'an inline TOML table like {vision = {prefixes = ["ckpt/vision/"], soft = "40%"}}'
        try:
            doc = tomllib.loads(f"tenants = {text}") if text else {"tenants": {}}
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"expected {like}: {exc}") from None
        if set(doc) != {"tenants"}:  # more than one value: "{...}\nother = 1"
            raise ValueError(f"expected {like}, and nothing after it")
        value = doc["tenants"]
    if not isinstance(value, dict):
        raise ValueError("expected a table of tenants like {vision = {prefixes = "
                         "[\"ckpt/vision/\"]}}")
    return TenantMap(_tenant(name, table) for name, table in value.items())


def parse_tenants(value: object) -> TenantMap:
    """The `tenants` option's value (a dict from TOML, or an inline TOML string) ->
    TenantMap; UsageError, one line naming the tenant and the field."""
    try:
        return _tenants_value(value)
    except ValueError as exc:
        raise UsageError(f"invalid tenants: {exc}") from None


def _field(default: Any, kind: str, allowed: str, help: str, **kw: Any) -> Any:
    if "default_factory" not in kw:
        kw["default"] = default
    return Field(description=help, json_schema_extra={"kind": kind, "allowed": allowed},
                 **kw)


# A ranged field is Annotated[Size, _size_range(lo, hi)]: Annotated flattens, so the parse
# (BeforeValidator) runs first, then the range check (AfterValidator)
Size = Annotated[int, BeforeValidator(_size_value)]
Duration = Annotated[float, BeforeValidator(_duration_value)]
Count = Annotated[int, BeforeValidator(_int_value)]
Ratio = Annotated[float, BeforeValidator(_float_value)]


def _size_range(lo: int, hi: int, hi_why: str = "") -> AfterValidator:
    return AfterValidator(_ranged(lo, hi, _show_size, hi_why=hi_why))


def _duration_range(lo: float = 0.0, lo_open: bool = False,
                    hi: float = MAX_DURATION) -> AfterValidator:
    return AfterValidator(_ranged(lo, hi, _show_duration, lo_open=lo_open))


def _count_range(lo: int, hi: int) -> AfterValidator:
    return AfterValidator(_ranged(lo, hi, str))


def _ratio_range(lo: float, hi: float, *, lo_open: bool = False,
                 hi_open: bool = False) -> AfterValidator:
    return AfterValidator(_ranged(lo, hi, lambda x: f"{x:g}", lo_open=lo_open,
                                  hi_open=hi_open))


Bool = Annotated[bool, BeforeValidator(_bool_value)]
Path = Annotated[str, BeforeValidator(_path_value)]
_RAM = physical_memory()
_RAM_WHY = " (this machine's RAM)"


class MountConfig(BaseModel):
    """A mount's options, validated; immutable (compare, hash, never change)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False,
                              arbitrary_types_allowed=True)

    source: Annotated[Source, BeforeValidator(_source_value)]
    mountpoint: Path
    endpoint_url: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _url_value(v))] = _field(
        None, "url", "http(s) URL", "S3 endpoint, e.g. a Ceph RGW `http://rgw:7480`")
    region: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _region_value(v))] = _field(
        None, "text", "letters, digits, `.` `_` `-`", "S3 region")
    cache_dir: Annotated[str, BeforeValidator(
        lambda v: "" if v == "" else _path_value(v))] = _field(
        "", "path", "absolute path", "chunk files + LMDB index; one daemon per cache dir")
    cache_size: Annotated[Size, _size_range(0, MAX_CACHE_SIZE)] = _field(
        10 << 30, "size", "2 chunks - 1P", "disk-tier budget")
    memory_cache_size: Annotated[Size, _size_range(0, _RAM, _RAM_WHY)] = _field(
        256 << 20, "size", "0 - the machine's RAM", "memory tier in front of the disk (0: none)")
    chunk_size: Annotated[Size, _size_range(64 << 10, 256 << 20)] = _field(
        8 << 20, "size", "64K - 256M, a power of two", "unit of GETs and cache files")
    metadata_ttl: Annotated[Duration, _duration_range()] = _field(
        60.0, "duration", "0 - 365d", "how long listings/attributes are trusted")
    # past the TTL, how long a stat/open/readdir of a known entry waits for the store before
    # it serves the cached entry (the revalidation goes on in the background)
    revalidate_timeout: Annotated[Duration, _duration_range()] = _field(
        3.0, "duration", "0 - 365d", "wait this long to revalidate a known entry, then serve it")
    metrics_addr: Annotated[tuple[str, int] | None, BeforeValidator(
        lambda v: None if v is None else _addr_value(v))] = _field(
        None, "addr", "`\"HOST:PORT\"`", "serve Prometheus metrics here")
    allow_other: Bool = _field(False, "bool", "", "let other users read the mount")
    read_only: Bool = _field(False, "bool", "", "refuse every change (EROFS)")
    log_level: Annotated[Literal["debug", "info", "warning", "error"], BeforeValidator(
        lambda v: v.strip().lower() if isinstance(v, str) else v)] = _field(
        "info", "choice", "`debug` `info` `warning` `error`", "log level")
    log_file: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _path_value(v))] = _field(
        None, "path", "absolute path", "log here (default: stderr / the journal)")
    # keep at least this fraction of the cache filesystem free, whatever cache_size says
    min_free_ratio: Annotated[Ratio, _ratio_range(0.0, 1.0, hi_open=True)] = _field(
        0.10, "float", "0 - <1", "share of the cache filesystem kept free")
    # evict when usage passes high * budget, down to low * budget
    evict_high: Annotated[Ratio, _ratio_range(0.0, 1.0, lo_open=True)] = _field(
        0.95, "float", ">0 - 1, above evict_low", "eviction starts at this share of the budget")
    evict_low: Annotated[Ratio, _ratio_range(0.0, 1.0, lo_open=True)] = _field(
        0.90, "float", ">0 - <evict_high", "eviction stops at this share of the budget")
    # heat halves after this long without access (at least: cache/heat.py, HalfLife)
    heat_half_life: Annotated[Duration, _duration_range(lo_open=True)] = _field(
        1800.0, "duration", ">0 - 365d",
        "how long \"hot\" is remembered by eviction and admission, at least: 12 x the time "
        "the node takes to read its cache's worth if longer")
    readahead_chunks: Annotated[Count, _count_range(1, 64)] = _field(
        8, "int", "1 - 64", "chunks fetched ahead of a sequential reader; also the bytes "
        "of small files fetched ahead of a reader that opens a directory's files in "
        "listing order")
    backend_concurrency: Annotated[Count, _count_range(1, 256)] = _field(
        16, "int", "1 - 256", "parallel requests to the object store")
    # parallel GETs of `tierfs warm`, on threads of their own (see backend/runner.py)
    warm_concurrency: Annotated[Count, _count_range(1, 256)] = _field(
        16, "int", "1 - 256", "parallel GETs of `tierfs warm`")
    backend_timeout: Annotated[Duration, _duration_range(lo_open=True)] = _field(
        30.0, "duration", ">0 - 365d", "botocore read timeout")
    backend_retries: Annotated[Count, _count_range(1, 20)] = _field(
        4, "int", "1 - 20", "botocore attempts (standard retry mode)")
    # keep glibc from hoarding freed 8 MiB chunk buffers (RSS stays near the memory tier);
    # costs cold-read throughput, as every chunk buffer is a fresh mmap (bench/README.md)
    bounded_memory: Bool = _field(True, "bool", "", "give freed chunk buffers back to the OS")
    # write-back: close() returns before the upload (fsync still waits for S3)
    writeback: Bool = _field(False, "bool", "", "`close()` returns before the upload")
    # how long writers wait for uploads to free budget before ENOSPC
    dirty_wait: Annotated[Duration, _duration_range()] = _field(
        60.0, "duration", "0 - 365d", "writers wait this long for budget, then ENOSPC")
    # directories with more objects than this are not renamed (EXDEV: mv copies instead)
    rename_max_objects: Annotated[Count, _count_range(0, 10_000_000)] = _field(
        1000, "int", "0 - 10000000", "larger directory renames answer EXDEV")
    # at unmount, pending uploads get this long; what is left stays journaled for the next mount
    drain_timeout: Annotated[Duration, _duration_range()] = _field(
        60.0, "duration", "0 - 365d", "how long a stop waits for pending uploads")
    # a backend request running longer than this logs one WARNING and counts a stall
    stall_warn: Annotated[Duration, _duration_range(lo_open=True)] = _field(
        10.0, "duration", ">0 - 365d", "a backend request this slow logs a WARNING")
    # a read that waits on the store, a peer or the fetch queue longer than this is a stall:
    # tierfs_read_stall_seconds, the stall log of `tierfs status`, usage's stall seconds
    stall_threshold: Annotated[Duration, _duration_range()] = _field(
        0.05, "duration", "0 - 365d", "a read waiting this long on a fetch is a stall")
    # a mount of a cache dir with an index waits this long for the store, then mounts
    # degraded (serving what is cached) instead of failing
    startup_timeout: Annotated[Duration, _duration_range(lo_open=True)] = _field(
        10.0, "duration", ">0 - 365d", "with an index, mount degraded after this long")
    uid: Annotated[Count, _count_range(0, MAX_ID)] = _field(
        None, "int", "0 - 4294967294", "owner shown for files and directories",
        default_factory=os.getuid)
    gid: Annotated[Count, _count_range(0, MAX_ID)] = _field(
        None, "int", "0 - 4294967294", "group shown for files and directories",
        default_factory=os.getgid)
    # LIST entries this small get one HEAD per version, for the type, owner, mode and
    # times a LIST does not carry: "all" (every object, and every directory's marker: a
    # multi-user mount's permissions must be the real ones) is the default with
    # allow_other, else 0 (the empty objects: special files); 4K takes in symlinks and
    # small files. "off": none (docs/semantics.md, Attributes)
    meta_head_max_size: Annotated[int | None, BeforeValidator(_head_size_value),
                                  AfterValidator(_head_size_check)] = _field(
        None, "size", "0 - 5T, `all` or `off`",
        "objects this small get one HEAD for their metadata")
    file_mode: Annotated[int, BeforeValidator(_mode_value)] = _field(
        0o644, "mode", "octal, up to 07777", "mode shown for files")
    dir_mode: Annotated[int, BeforeValidator(_mode_value)] = _field(
        0o755, "mode", "octal, up to 07777", "mode shown for directories")
    # a near object store before the source (docs/tiers.md)
    tier: Annotated[Source | None, BeforeValidator(
        lambda v: Source.parse(v, "tier") if isinstance(v, str) else v)] = _field(
        None, "url", "`s3://BUCKET[/PREFIX]` or `file:///DIR`",
        "a near object store read before the source (off: none)")
    tier_endpoint_url: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _url_value(v))] = _field(
        None, "url", "http(s) URL", "the near store's S3 endpoint")
    tier_region: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _region_value(v))] = _field(
        None, "text", "letters, digits, `.` `_` `-`", "the near store's S3 region")
    tier_profile: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _profile_value(v))] = _field(
        None, "text", "letters, digits, `.` `_` `-`",
        "AWS profile of the near store's credentials")
    tier_timeout: Annotated[Duration, _duration_range(lo_open=True, hi=600.0)] = _field(
        5.0, "duration", ">0 - 10m", "a near store slower than this: read from the source")
    near_size: Annotated[int | None, BeforeValidator(
        lambda v: None if v is None else _size_value(v)), AfterValidator(
        lambda v: v if v is None else _ranged(0, MAX_CACHE_SIZE, _show_size)(v))] = _field(
        None, "size", "0 - 1P", "the near store's budget for `tierfs gc --tier near`")
    promote: Annotated[Literal["all", "none"], BeforeValidator(
        lambda v: v.strip().lower() if isinstance(v, str) else v)] = _field(
        "all", "choice", "`all` `none`",
        "copy what a read fetched from the source to the near store")
    # the peer tier (docs/peers.md): other nodes' caches before the object store
    peers: Annotated[str | None, BeforeValidator(
        lambda v: None if v is None else _peers_value(v))] = _field(
        None, "text", "`file:PATH`, `dns:NAME:PORT`, `slurm`",
        "where the list of peer nodes comes from (off: no peer tier)")
    peer_listen: Annotated[tuple[str, int] | None, BeforeValidator(
        lambda v: None if v is None else _addr_value(v))] = _field(
        None, "addr", "`\"HOST:PORT\"`", "the peer server binds here")
    # how the others reach this node; the listen address unless it is 0.0.0.0
    peer_advertise: Annotated[tuple[str, int] | None, BeforeValidator(
        lambda v: None if v is None else _addr_value(v))] = _field(
        None, "addr", "`\"HOST:PORT\"`, not 0.0.0.0",
        "this node's address in the peer list")
    peer_secret_file: Annotated[str | None, BeforeValidator(_abs_file_value)] = _field(
        None, "path", "a file of 16 - 4096 bytes, mode 0600 or stricter, owned by the "
        "daemon's user",
        "the secret every peer shares (HMAC of each request)")
    peer_bandwidth: Annotated[int | None, BeforeValidator(_bandwidth_value),
                              AfterValidator(_bandwidth_check)] = _field(
        None, "size", "64K - 1P (per second), `unlimited`",
        "bytes per second this node sends to peers")
    peer_timeout: Annotated[Duration, _duration_range(lo_open=True, hi=600.0)] = _field(
        2.0, "duration", ">0 - 10m", "a peer slower than this: fetch from the store")
    peer_max_concurrent: Annotated[Count, _count_range(1, 1024)] = _field(
        32, "int", "1 - 1024", "peer requests this node serves at once (more: 503)")
    peer_tls_cert: Annotated[str | None, BeforeValidator(_abs_file_value)] = _field(
        None, "path", "absolute path; all three TLS files or none", "TLS certificate (PEM)")
    peer_tls_key: Annotated[str | None, BeforeValidator(_abs_file_value)] = _field(
        None, "path", "absolute path, mode 0600 or stricter", "TLS private key (PEM)")
    peer_tls_ca: Annotated[str | None, BeforeValidator(_abs_file_value)] = _field(
        None, "path", "absolute path", "CA certificates that sign the peers' certificates")
    # who owns which keys, and their shares of the cache (docs/tenants.md)
    tenants: Annotated[TenantMap, BeforeValidator(_tenants_value)] = _field(
        TenantMap(), "tenants", "names `a-z 0-9 _ -`; keys `prefixes` `soft` `hard` "
        "`max_idle` `pin_ttl`", "who owns which keys ([tenants.md](tenants.md)): prefixes, "
        "cache shares, idle limit, pin TTL")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise usage_error(exc) from None

    @model_validator(mode="after")
    def _consistent(self) -> "MountConfig":
        if self.chunk_size & (self.chunk_size - 1):
            raise ValueError("invalid chunk-size: must be a power of two (e.g. 4M, 8M, 16M)")
        if self.cache_size < 2 * self.chunk_size:
            raise ValueError("invalid cache-size: must hold at least two chunks")
        if not self.evict_low < self.evict_high:
            raise ValueError("invalid evict-low/evict-high: need 0 < low < high <= 1")
        if self.meta_head_max_size is None:  # frozen: set once, here
            object.__setattr__(self, "meta_head_max_size", HEAD_ALL if self.allow_other else 0)
        self._check_peers()
        self._check_tenants()
        self._check_tier()
        return self

    def _only_with(self, anchor: str, prefix: str) -> bool:
        """Whether option `anchor` is on; raises if it is off and an option of its family
        (names starting with `prefix`) is set."""
        if getattr(self, anchor) is not None:
            return True
        for n in sorted(self.model_fields_set):
            if n.startswith(prefix) and getattr(self, n) is not None:
                raise ValueError(f"invalid {option_name(n)}: only with --{option_name(anchor)}")
        return False

    def _check_tier(self) -> None:
        if self.tier is None and self.near_size is not None:
            raise ValueError("invalid near-size: only with --tier")
        if not self._only_with("tier", "tier_"):
            return
        assert self.tier is not None
        if (self.tier.scheme, self.tier.bucket) == (self.source.scheme, self.source.bucket) \
                and self.tier_endpoint_url == self.endpoint_url \
                and (self.tier.prefix.startswith(self.source.prefix)
                     or self.source.prefix.startswith(self.tier.prefix)):
            raise ValueError(f"invalid tier {self.tier}: it overlaps the source {self.source} "
                             "(the near store needs a bucket or prefix of its own)")

    @property
    def head_max_size(self) -> int:
        """meta_head_max_size, never None once validated (_consistent sets the default)."""
        assert self.meta_head_max_size is not None
        return self.meta_head_max_size

    def _check_tenants(self) -> None:
        for tenant in self.tenants:
            try:
                tenant.check_budget(self.cache_size)
            except ValueError as exc:
                raise ValueError(f"invalid tenants: {exc}") from None
            for p in tenant.prefixes:
                # keys are bucket keys: a prefix beside the source's can never match
                if not (p.startswith(self.source.prefix) or self.source.prefix.startswith(p)):
                    raise ValueError(
                        f"invalid tenants: tenant {tenant.name}: prefixes: {_show(p)} is "
                        f"outside the source's prefix {self.source.prefix!r} (prefixes are "
                        f"bucket keys, the source's prefix included)")

    def _check_peers(self) -> None:
        if not self._only_with("peers", "peer_"):
            return
        for need in ("peer_listen", "peer_secret_file"):
            if getattr(self, need) is None:
                raise ValueError(f"{option_name(need)} is required with --peers")
        if self.peer_advertise is None:  # frozen: set once, here
            object.__setattr__(self, "peer_advertise", self.peer_listen)
        assert self.peer_advertise is not None
        host = self.peer_advertise[0]
        if _unspecified(host):
            why = "the other nodes need an address that reaches this one (e.g. its IP)"
            if "peer_advertise" in self.model_fields_set:
                raise ValueError(f"invalid peer-advertise {host!r}: {why}")
            raise ValueError(f"peer-advertise is required when peer-listen is {host!r} "
                             f"(every address): {why}")
        tls = (self.peer_tls_cert, self.peer_tls_key, self.peer_tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("invalid peer-tls-cert/peer-tls-key/peer-tls-ca: give all three "
                             "or none")
        assert self.peer_secret_file is not None
        _read_secret(self.peer_secret_file)  # the bytes are read again when needed
        if self.peer_tls_key:
            _check_private_file(self.peer_tls_key, "peer-tls-key", 1, 1 << 20)
        for path, name in ((self.peer_tls_cert, "peer-tls-cert"),
                           (self.peer_tls_ca, "peer-tls-ca")):
            if path:
                _check_regular_file(path, name)

    @property
    def effective_cache_dir(self) -> str:
        if self.cache_dir:
            return os.path.abspath(self.cache_dir)
        ident = f"{self.source}|{self.endpoint_url or ''}".encode()
        return f"/var/cache/tierfs/{hashlib.sha256(ident).hexdigest()[:16]}"


PEER_SECRET_MIN, PEER_SECRET_MAX = 16, 4096  # bytes of the shared secret


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a hostname
        return False


def _check_regular_file(path: str, name: str) -> os.stat_result:
    try:
        st = os.stat(path)  # follows symlinks: a Kubernetes Secret volume is made of them
    except OSError as exc:
        raise ValueError(f"invalid {name} {_show(path)}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"invalid {name} {_show(path)}: not a regular file")
    return st


def _check_private_file(path: str | None, name: str, lo: int, hi: int,
                        st: os.stat_result | None = None) -> None:
    """A file only its owner (the daemon's user) can read: what holds a secret."""
    assert path is not None
    st = st or _check_regular_file(path, name)
    if st.st_uid != os.geteuid():
        raise ValueError(f"invalid {name} {_show(path)}: owned by uid {st.st_uid}, not by "
                         f"the daemon's user (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise ValueError(f"invalid {name} {_show(path)}: mode {stat.S_IMODE(st.st_mode):04o} "
                         f"lets others read it; chmod 600")
    if not lo <= st.st_size <= hi:
        raise ValueError(f"invalid {name} {_show(path)}: {st.st_size} bytes, expected "
                         f"{lo} - {hi}")


def _read_secret(path: str) -> bytes:
    """The secret's bytes, checked on the open file (so a file swapped after a check is
    too); ValueError naming the file, never its content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"invalid peer-secret-file {_show(path)}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"invalid peer-secret-file {_show(path)}: not a regular file")
        _check_private_file(path, "peer-secret-file", PEER_SECRET_MIN, PEER_SECRET_MAX, st)
        data = os.read(fd, PEER_SECRET_MAX + 1)
    except OSError as exc:
        raise ValueError(f"invalid peer-secret-file {_show(path)}: {exc.strerror}") from None
    finally:
        os.close(fd)
    secret = data.rstrip(b"\r\n")
    if not PEER_SECRET_MIN <= len(secret) <= PEER_SECRET_MAX:
        raise ValueError(f"invalid peer-secret-file {_show(path)}: {len(secret)} bytes "
                         f"(without a trailing newline), expected {PEER_SECRET_MIN} - "
                         f"{PEER_SECRET_MAX}")
    return secret


def read_peer_secret(cfg: "MountConfig") -> bytes:
    """The shared secret of the peer tier: the bytes of --peer-secret-file (a regular file
    of the daemon's user, mode 0600 or stricter, 16 - 4096 bytes), a trailing newline
    dropped (`echo` writes one; every node reads its file the same way). Kept out of the
    config (which is logged and compared): read when the peer tier starts. UsageError
    naming the file, never its content."""
    if cfg.peer_secret_file is None:
        raise UsageError("peer-secret-file is required with --peers")
    try:
        return _read_secret(cfg.peer_secret_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# every option but the two positional arguments; the ones that take no value (`-o
# allow_other`, `--writeback`, `-o bounded_memory`) are the booleans, derived here once
OPTIONS = tuple(n for n in MountConfig.model_fields if n not in ("source", "mountpoint"))
def _kind(name: str) -> str:
    extra = MountConfig.model_fields[name].json_schema_extra
    return str(extra.get("kind", "")) if isinstance(extra, dict) else ""


FLAG_OPTIONS = frozenset(n for n in OPTIONS if _kind(n) == "bool")


def option_name(field: str) -> str:
    """cache_size -> cache-size, as the command line and error messages spell it."""
    return field.replace("_", "-")


_TYPE_MESSAGES = {
    "missing": "is required", "extra_forbidden": "unknown option",
    "literal_error": "expected one of {expected}", "string_type": "expected a string",
    "finite_number": "must be a finite number", "frozen_instance": "cannot be changed",
}


def usage_error(exc: ValidationError, prefix: str = "") -> UsageError:
    """A pydantic ValidationError -> one line naming the first bad option and why."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    kind = err.get("type", "")
    template = _TYPE_MESSAGES.get(kind)
    if template is not None:
        why = template.format(**{k: v for k, v in (err.get("ctx") or {}).items()})
    else:
        why = err.get("msg", "invalid").removeprefix("Value error, ").removeprefix(
            "Assertion failed, ")
    if not loc:  # a check across options: its message names them
        return UsageError(f"{prefix}{why}")
    if kind == "extra_forbidden":
        return UsageError(f"{prefix}unknown option {_show(loc)}")
    if kind == "missing":
        return UsageError(f"{prefix}{option_name(loc)} is required")
    return UsageError(f"{prefix}invalid {option_name(loc)} {_show(err.get('input'))}: {why}")


# generic mount(8) options fstab passes along; they mean nothing to tierfs
_IGNORED_MOUNT_OPTIONS = {"rw", "defaults", "auto", "noauto", "nofail", "_netdev", "user",
                          "nouser", "users", "noatime", "relatime", "nodev", "nosuid", "noexec",
                          "dev", "suid", "exec", "atime"}


def parse_addr(text: str) -> tuple[str, int]:
    try:
        return _addr_value(text)
    except ValueError as exc:
        raise UsageError(f"invalid metrics-addr {_show(text)}: {exc}") from None


_INLINE_TABLE_RE = re.compile(r"\s*tenants\s*=\s*\{", re.ASCII)


def _split_o(item: str) -> list[str]:
    """Split one -o argument at its commas, except inside the inline TOML table of
    `tenants={...}` (its lists and tables have commas of their own)."""
    parts: list[str] = []
    i = 0
    while i <= len(item):
        m = _INLINE_TABLE_RE.match(item, i)
        end = _table_end(item, m.end() - 1) if m else item.find(",", i)
        if end < 0:
            end = len(item)
        parts.append(item[i:end])
        i = end + 1
    return parts


def _table_end(text: str, start: int) -> int:
    """Index just past the inline table opening at `start` (brackets counted outside TOML
    strings); -1 when it does not close: the rest is the value, and TOML says what is
    wrong with it."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text.find(",", i + 1)
        i += 1
    return -1


def parse_o_options(items: list[str]) -> dict[str, object]:
    """['cache_size=5G,ro', ...] -> {'cache_size': '5G', 'read_only': True}.

    A name without a value is True; build_config accepts that for the boolean options only
    (FLAG_OPTIONS) and tells the others they need a value. `tenants={...}` is one value,
    its commas included."""
    out: dict[str, object] = {}
    for item in items:
        for part in _split_o(item):
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
    kwargs: dict[str, object] = {}
    for key, value in options.items():
        if value is None:
            continue
        if key not in OPTIONS:
            raise UsageError(f"unknown option {_show(key)}")
        if value is True and key not in FLAG_OPTIONS:
            raise UsageError(f"option {option_name(key)} needs a value")
        kwargs[key] = value
    if not mountpoint:
        raise UsageError("missing MOUNTPOINT")
    try:
        check_text(mountpoint, what="a path")
    except ValueError as exc:
        raise UsageError(f"invalid mount point {_show(mountpoint)}: {exc}") from None
    return MountConfig(source=source, mountpoint=os.path.abspath(mountpoint), **kwargs)


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
    except UnicodeDecodeError:
        raise UsageError(f"{path}: invalid TOML: not UTF-8 text") from None
    out: dict[str, object] = {}
    if "tiers" in data:  # [[tiers]]: the object-store tiers before the source
        data = {**data}
        for key, value in _tiers_table(path, data.pop("tiers")).items():
            if key in data or key.replace("_", "-") in data:
                raise UsageError(f"{path}: {key!r} is given both at the top and in [[tiers]]")
            data[key] = value
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key in out:
            raise UsageError(f"{path}: {raw_key!r} is given twice (dashes and underscores "
                             f"name the same option)")
        if key not in OPTIONS and key not in ("source", "mountpoint"):
            raise UsageError(f"{path}: unknown option {_show(raw_key)}")
        out[key] = _check_toml_value(path, key, value)
    return out


_TIER_KEYS = {"url": "tier", "endpoint_url": "tier_endpoint_url", "region": "tier_region",
              "profile": "tier_profile", "timeout": "tier_timeout", "promote": "promote",
              "size": "near_size"}


def _tiers_table(path: str, tiers: object) -> dict[str, object]:
    """`[[tiers]]` (docs/tiers.md): a list of tables of one near store each, as the
    options they stand for. One near store is supported for now."""
    if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
        raise UsageError(f"{path}: tiers: expected [[tiers]] tables with url = \"s3://...\"")
    if len(tiers) != 1:
        raise UsageError(f"{path}: tiers: {len(tiers)} tiers given; one near store is "
                         f"supported (the source is the last tier)")
    out: dict[str, object] = {}
    for raw, value in tiers[0].items():
        key = raw.replace("-", "_")
        if key not in _TIER_KEYS:
            raise UsageError(f"{path}: tiers: unknown key {_show(raw)} (known: "
                             f"{', '.join(sorted(_TIER_KEYS))})")
        out[_TIER_KEYS[key]] = value
    if "tier" not in out:
        raise UsageError(f"{path}: tiers: url is required (s3://BUCKET[/PREFIX])")
    return out


def _check_toml_value(path: str, key: str, value: object) -> object:
    """Reject the TOML types the schema would misread (it also takes strings)."""
    kind = "path" if key in ("source", "mountpoint") else _kind(key)

    def bad(why: str) -> UsageError:
        return UsageError(f"{path}: {key}: {why}")

    if kind == "tenants":  # [tenants.NAME] tables, or the inline string the -o form takes
        if not isinstance(value, (dict, str)):
            raise bad("expected tables [tenants.NAME] with prefixes = [...]")
        return value
    if isinstance(value, (dict, list)) or not isinstance(value, (str, int, float)):
        raise bad("expected a string, number or boolean")
    if isinstance(value, bool):
        if kind != "bool":
            raise bad("expected a value, not true/false")
        return value
    if kind in ("path", "text", "url", "choice", "addr"):
        if not isinstance(value, str):
            raise bad("expected a string")
        if key in _PATH_KEYS and not os.path.isabs(value):
            raise bad(f"{_show(value)} is not an absolute path")
        return value
    if kind == "mode" and not isinstance(value, str):
        # TOML 644 is decimal 644, not octal: only a string says what is meant
        raise bad('write the mode as a string, e.g. "0644"')
    if kind == "int" and isinstance(value, float):
        raise bad(f"expected a whole number, not {value}")
    return value


def build_config_with_file(path: str, source: str | None, mountpoint: str | None,
                           overrides: dict[str, object]) -> MountConfig:
    """The config file's values, then the command line's on top (the command line wins).

    The file is validated on its own first, so a bad value in it is reported with the
    file's name; what the command line gives is reported as before."""
    options = read_config_file(path)
    file_source, file_mountpoint = options.pop("source", None), options.pop("mountpoint", None)
    src = source or file_source
    mnt = mountpoint or file_mountpoint
    if not src:
        raise UsageError(f"no source: give SOURCE on the command line or `source = ...` in {path}")
    if not mnt:
        raise UsageError(f"no mount point: give MOUNTPOINT on the command line or "
                         f"`mountpoint = ...` in {path}")
    try:
        build_config(str(src), str(mnt), options)
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    return build_config(str(src), str(mnt), {**options, **overrides})


# ---- Slurm hook settings (tierfs-slurm.toml; read by tierfs/cli/slurm.py) -----------------

# a manifest (tierfs warm --manifest, tierfs:manifest=) is at most 1 MiB
MANIFEST_MAX_BYTES = 1 << 20
MANIFEST_MAX_PATHS = 100_000


def read_manifest_fd(fd: int, path: str) -> str:
    """The text of an open manifest (`tierfs warm --manifest`, `tierfs:manifest=`): a
    regular file of at most MANIFEST_MAX_BYTES of UTF-8, else UsageError naming `path`.
    Checked on the open fd (fstat), so /dev/zero, a FIFO or a file swapped after a check is
    refused, and read to the limit only, so a file that grows while read is too.
    OSError is left to the caller, who knows as whom it read."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise UsageError(f"manifest {path} is not a regular file")
    data = b""
    while len(data) <= MANIFEST_MAX_BYTES:
        part = os.read(fd, MANIFEST_MAX_BYTES + 1 - len(data))
        if not part:
            break
        data += part
    if len(data) > MANIFEST_MAX_BYTES:
        raise UsageError(f"manifest {path} is larger than {format_size(MANIFEST_MAX_BYTES)}: "
                         f"split it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"manifest {path} is not UTF-8 text") from None


class SlurmSettings(BaseModel):
    """The site settings of the Slurm Prolog/Epilog, validated like mount options."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    strict: Bool = False  # True: a failed warm exits 1 and Slurm drains the node
    # pins end by themselves if an epilog never runs; "", 0 or false: no expiry
    pin_ttl: Annotated[float | None, BeforeValidator(
        lambda v: None if v in ("", 0, "0", False, None) else _duration_value(v)),
        AfterValidator(lambda v: v if v is None else _ranged(
            0, MAX_DURATION, _show_duration, lo_open=True)(v))] = 7 * 86400.0
    # for the whole hook
    timeout: Annotated[Duration, _duration_range(lo_open=True, hi=86400.0)] = 300.0
    max_bytes: Annotated[Size, _size_range(0, MAX_CACHE_SIZE)] = 0  # per job and node (0: no limit)
    log_file: Annotated[str | None, BeforeValidator(
        lambda v: None if v in ("", None) else _abs_path(v))] = "/var/log/tierfs/slurm.log"
    # the epilog appends one JSON line per job that read through tierfs (docs/slurm.md)
    accounting_file: Annotated[str | None, BeforeValidator(
        lambda v: None if v in ("", None) else _abs_path(v))] = None
    scontrol: Path = "scontrol"
    # the hooks use tierfs mounts made by root and by this user (name or uid; "": root only)
    daemon_user: Annotated[str, AfterValidator(
        lambda v: check_text(v, max_len=64, what="a user name"))] = ""


def _abs_path(value: object) -> str:
    text = _path_value(value)
    if not os.path.isabs(text):
        raise ValueError("expected an absolute path")
    return text


def slurm_settings(data: dict[str, object], prefix: str = "") -> SlurmSettings:
    """Validate the settings file's table; one UsageError line naming the setting."""
    if not isinstance(data, dict):
        raise UsageError(f"{prefix}expected a table of settings")
    try:
        return SlurmSettings.model_validate({str(k): v for k, v in data.items()})
    except ValidationError as exc:
        err = usage_error(exc, prefix)
        if exc.errors()[0].get("type") == "extra_forbidden":
            known = ", ".join(SlurmSettings.model_fields)
            name = _show(str(exc.errors()[0]["loc"][0]))
            raise UsageError(f"{prefix}unknown setting {name} (known: {known})") from None
        raise err from None


# ---- the docs table ------------------------------------------------------------------------

_KIND_TEXT = {"size": "size: `\"500G\"` or bytes", "duration": "duration: `\"30s\"` or seconds",
              "int": "integer", "float": "number", "bool": "boolean", "path": "absolute path",
              "text": "string", "url": "string", "addr": "string", "choice": "string",
              "mode": "string: octal `\"0644\"`",
              "tenants": "tables `[tenants.NAME]` (or one inline table)"}


def _default_text(name: str) -> str:
    f = MountConfig.model_fields[name]
    kind = _kind(name)
    if f.default_factory is not None:
        return "the mounting user"
    if kind == "tenants":
        return "`default` owns every key"
    d = f.default
    if d is None or d == "":
        return {"endpoint_url": "AWS", "region": "botocore's", "log_file": "the journal (stderr)",
                "metrics_addr": "off", "cache_dir": "`/var/cache/tierfs/<id of source>`",
                "meta_head_max_size": "`\"all\"` with `allow_other`, else `\"0\"`",
                "tier": "off", "tier_endpoint_url": "AWS", "tier_region": "botocore's",
                "tier_profile": "the standard AWS sources", "near_size": "no budget",
                "peers": "off", "peer_listen": "required with `peers`",
                "peer_advertise": "`peer_listen`", "peer_secret_file": "required with `peers`",
                "peer_bandwidth": "unlimited", "peer_tls_cert": "off (plain HTTP)",
                "peer_tls_key": "off", "peer_tls_ca": "off"}[name]
    if kind == "bool":
        return f"`{str(d).lower()}`"
    if kind == "size":
        return f"`\"{_show_size(d)}\"`"
    if kind == "duration":
        return f"`\"{_show_duration(d)}\"`"
    if kind == "mode":
        return f"`\"{d:04o}\"`"
    if kind == "choice":
        return f"`\"{d}\"`"
    return f"`{d:.2f}`" if isinstance(d, float) else f"`{d}`"


def options_table() -> str:
    """The TOML keys table of docs/operations.md, from the schema (tested to match)."""
    rows = ["| key | TOML value | allowed | default | meaning |", "|---|---|---|---|---|",
            "| `source` | `\"s3://BUCKET[/PREFIX]\"` (or `\"file:///DIR\"`) | | required | "
            "what to mount |",
            "| `mountpoint` | absolute path | an existing empty directory | required | "
            "where |"]
    for name in OPTIONS:
        f = MountConfig.model_fields[name]
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        rows.append(f"| `{name}` | {_KIND_TEXT[str(extra['kind'])]} | {extra['allowed']} | "
                    f"{_default_text(name)} | {f.description} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--doc-table"]:
        sys.stdout.write(options_table())
    else:
        sys.exit("usage: python -m tierfs.config --doc-table")
