"""The control socket's messages, typed once for the daemon (control.py) and its clients
(ctl.py, and through them the Slurm hooks and tierfs-csi): docs/control.md.

One JSON request line per connection, answered by event lines and one final line. Both
ends parse with the same rules: a line is at most MAX_REQUEST (requests) or MAX_REPLY
(replies) bytes, it is one JSON object, NaN and Infinity are refused (json.loads would
take them, and a NaN pin TTL once made pins nobody could show), and each request is a
model with types and ranges: a bad field is one error line naming it, never a traceback
on either side. "v" is the major version: within it fields are only ever added, and
readers ignore the ones they do not know.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from .config import MAX_DURATION, MAX_TEXT, check_job_id, usage_error
from .errors import TierfsError, UsageError

PROTOCOL: Literal[1] = 1
# a request carries at most a 1 MiB manifest's paths (config.MANIFEST_MAX_BYTES), which
# JSON escaping can make larger; only root and the mounting user get to send one
MAX_REQUEST = 2 << 20
MAX_REPLY = 4 << 20  # one reply line; a warm's result lists at most 50 errors
MAX_PATHS = 100_000
IDLE_TIMEOUT_S = 30.0  # a connection that sends no complete request in this long is closed


class ProtocolError(TierfsError):
    """A line that is not a message of this protocol (either direction)."""


def loads(line: bytes | str) -> Any:
    """One JSON line -> a value; NaN/Infinity, bad UTF-8 and absurd nesting are errors."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a number this protocol takes")

    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line  # no BOM sniffing
        return json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise ProtocolError("the line nests too deeply") from None
    except UnicodeDecodeError:
        raise ProtocolError("the line is not UTF-8") from None
    except ValueError as exc:
        raise ProtocolError(f"the line is not JSON: {exc}") from None


def dumps(message: dict) -> bytes:
    """A message as one line; a NaN in it is a bug of the sender, not something to send."""
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"


# ---- requests ------------------------------------------------------------------------------


def _rel_path(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path must not contain NUL")
    return value


RelPath = Annotated[str, Field(max_length=MAX_TEXT), AfterValidator(_rel_path)]
Paths = Annotated[list[RelPath], Field(min_length=1, max_length=MAX_PATHS)]
JobId = Annotated[str, BeforeValidator(check_job_id)]


def _pod_uid(value: str) -> str:
    if not value or not all(c.isascii() and (c.isalnum() or c == "-") for c in value):
        raise ValueError("a pod UID is letters, digits and '-' (a Kubernetes UID)")
    return value


def _k8s_name(value: str) -> str:
    # DNS-1123 names (namespaces, pods, service accounts): they become label values and
    # log words, so nothing else gets through
    if not value or not all(c.isascii() and (c.isalnum() or c in "-.") for c in value):
        raise ValueError("a Kubernetes name is letters, digits, '-' and '.'")
    return value


PodUid = Annotated[str, Field(max_length=64), AfterValidator(_pod_uid)]
K8sName = Annotated[str, Field(max_length=253), AfterValidator(_k8s_name)]


class _Request(BaseModel):
    # strict: "true" is not true and 5.0 is not 5 on the wire; unknown fields are ignored
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore", allow_inf_nan=False)

    v: Literal[1] = PROTOCOL

    def encode(self) -> bytes:
        if len(line := dumps(self.model_dump(exclude_none=True))) > MAX_REQUEST:
            raise UsageError(f"the request is larger than {MAX_REQUEST >> 20} MiB: "
                             f"give fewer paths per call")
        return line


class StatusRequest(_Request):
    op: Literal["status"] = "status"


class WarmRequest(_Request):
    op: Literal["warm"] = "warm"
    paths: Paths
    check: bool = False  # only report how much is cached
    pin: bool = False
    job: JobId | None = None  # pin for this job (implies pin)
    pod: PodUid | None = None  # pin for this Kubernetes pod (implies pin; tierfs-csi)
    pin_ttl: Annotated[float, Field(gt=0, le=MAX_DURATION)] | None = None  # seconds
    concurrency: Annotated[int, Field(ge=1, le=256)] | None = None  # default: the mount's
    tier: Literal["local", "near"] = "local"  # near: fill the near store (docs/tiers.md)

    @property
    def pin_owner(self) -> str | None:
        if self.check:
            return None
        if self.pod:
            return f"pod:{self.pod}"
        return f"job:{self.job}" if self.job else ("manual" if self.pin or self.pin_ttl
                                                   else None)


class EvictRequest(_Request):
    op: Literal["evict"] = "evict"
    paths: Paths
    tier: Literal["local", "near"] = "local"  # near: remove the near store's copies


class NearGcRequest(_Request):
    """Stale copies out of the near store, then the oldest over `budget` (docs/tiers.md)."""

    op: Literal["near_gc"] = "near_gc"
    budget: Annotated[int, Field(ge=0)] | None = None  # bytes; default: the mount's near_size
    dry_run: bool = False


class UnpinRequest(_Request):
    op: Literal["unpin"] = "unpin"
    paths: Annotated[list[RelPath], Field(max_length=MAX_PATHS)] = []
    job: JobId | None = None
    pod: PodUid | None = None  # a pod's pins (NodeUnpublishVolume)
    all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> "UnpinRequest":
        if sum((bool(self.paths), self.job is not None, self.pod is not None,
                self.all)) != 1:
            raise ValueError("unpin takes paths, job, pod or all (one of them)")
        return self


def _reader_name(value: str) -> str:
    kind, _, ident = value.partition(":")
    if kind not in ("job", "pod", "uid") or not ident or not all(
            c.isalnum() or c in "-_." for c in ident):
        raise ValueError("a reader is job:ID, pod:UID or uid:N")
    return value


ReaderName = Annotated[str, Field(max_length=80), AfterValidator(_reader_name)]


class UsageRequest(_Request):
    op: Literal["usage"] = "usage"
    by: Literal["tenant", "job", "pod", "uid", "namespace"] = "tenant"
    reader: ReaderName | None = None  # only this reader ("job:1234"): the Slurm epilog
    forecast: bool = False  # with the capacity history's forecast and working sets


class ReportRequest(_Request):
    """`tierfs report`: hot and cold prefixes, hit ratios, stalls, metadata pressure, the
    cache by heat, eviction quality and the series behind the plots (docs/report.md)."""
    op: Literal["report"] = "report"
    top: Annotated[int, Field(ge=1, le=1000)] = 20  # rows per list
    # a cached prefix not read for this long is cold
    cold_after: Annotated[float, Field(gt=0, le=MAX_DURATION)] = 86400.0


class JobFilesRequest(_Request):
    """`tierfs report --manifest --job ID`: the files a Slurm job read through the mount;
    with `pod` instead, the files a Kubernetes pod read (tierfs-csi's warm_auto)."""
    op: Literal["job_files"] = "job_files"
    job: JobId | None = None
    pod: PodUid | None = None
    since: Annotated[float, Field(ge=0, le=MAX_DURATION)] | None = None  # seconds back

    @model_validator(mode="after")
    def _one_reader(self) -> "JobFilesRequest":
        if (self.job is None) == (self.pod is None):
            raise ValueError("job_files takes a job or a pod (one of them)")
        return self

    @property
    def key(self) -> str:
        """The analytics' key: a job's id, or "pod:UID"."""
        return self.job if self.job is not None else f"pod:{self.pod}"


class PodRequest(_Request):
    """tierfs-csi, at each NodePublishVolume: who the pod behind `pod:UID` reads is, so
    its reads count for its namespace (and its tenant, with tenant_from); `forget` at
    NodeUnpublishVolume."""
    op: Literal["pod"] = "pod"
    uid: PodUid
    namespace: K8sName | None = None
    name: K8sName | None = None
    service_account: K8sName | None = None
    tenant: Annotated[str, Field(max_length=63), AfterValidator(_k8s_name)] | None = None
    forget: bool = False

    @model_validator(mode="after")
    def _named(self) -> "PodRequest":
        if not self.forget and self.namespace is None:
            raise ValueError("a pod is registered with its namespace")
        return self


Request = (StatusRequest | WarmRequest | EvictRequest | UnpinRequest | UsageRequest
           | ReportRequest | JobFilesRequest | PodRequest | NearGcRequest)
REQUESTS: dict[str, type[_Request]] = {"status": StatusRequest, "warm": WarmRequest,
                                       "evict": EvictRequest, "unpin": UnpinRequest,
                                       "usage": UsageRequest, "report": ReportRequest,
                                       "job_files": JobFilesRequest, "pod": PodRequest,
                                       "near_gc": NearGcRequest}


def parse_request(line: bytes) -> Request:
    """The daemon's side: one request line -> a typed request, or UsageError (one line)."""
    try:
        data = loads(line)
    except ProtocolError as exc:
        raise UsageError(f"bad request: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError("bad request: it must be a JSON object")
    if data.get("v") != PROTOCOL:
        raise UsageError(f"protocol version {_short(data.get('v'))} is not supported "
                         f"(this daemon speaks {PROTOCOL}): use a matching tierfs")
    op = data.get("op")
    model = REQUESTS.get(op) if isinstance(op, str) else None
    if model is None:
        raise UsageError(f"unknown request {_short(op)}")
    try:
        return model.model_validate(data)  # type: ignore[return-value]  # one of Request
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["loc"][:1] == ("paths",) and err["type"] in ("list_type", "too_short",
                                                             "string_type"):
            raise UsageError(f"{op} request: paths must be a non-empty list of paths "
                             f"relative to the mount") from None
        raise usage_error(exc, f"{op} request: ") from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- replies -------------------------------------------------------------------------------


class _Reply(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    v: Literal[1]


class Event(_Reply):
    event: Annotated[str, Field(max_length=64)]


class Final(_Reply):
    ok: bool
    result: dict[str, Any] | None = None
    error: Annotated[str, Field(max_length=MAX_TEXT * 4)] | None = None


def parse_reply(line: bytes) -> Event | Final:
    """The client's side: one reply line -> an event or the final answer (ProtocolError)."""
    data = loads(line)
    if not isinstance(data, dict):
        raise ProtocolError("a reply line is not a JSON object")
    try:
        return Event.model_validate(data) if "event" in data else Final.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(f"a malformed reply ({usage_error(exc)})") from None


# the results the clients print from: validated, so a field they index is there and typed
class _Result(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


Count = Annotated[int, Field(ge=0)]


class Usage(_Result):
    used: Count
    budget: Count = 0
    chunks: Count = 0
    capacity: Count = 0


class PinOwner(_Result):
    owner: str
    files: Count
    bytes: Count
    expires: float | None = None


class Pinned(_Result):
    files: Count
    bytes: Count
    owners: list[PinOwner]


class HitRatio(_Result):
    bytes: float | None = None


class StatusResult(_Result):
    mountpoint: str
    source: str
    cache_dir: str
    pid: int
    uptime_s: Annotated[float, Field(ge=0)]
    disk: Usage
    memory: Usage
    hit_ratio: HitRatio
    pinned: Pinned
    dirty_bytes: Count
    uploads_pending: Count


class PathError(_Result):
    path: str
    error: str


class _PerPath(_Result):
    files: Count = 0
    errors: Annotated[list[PathError], Field(max_length=10_000)] = []
    error_count: Count = 0


class WarmResult(_PerPath):
    bytes: Count
    bytes_cached_before: Count
    bytes_fetched: Count = 0
    seconds: Annotated[float, Field(ge=0)] = 0.0
    fits: bool = True
    pinned: str | None = None
    unsaved_files: Count = 0


class EvictResult(_PerPath):
    bytes_evicted: Count
    pinned_kept: Count = 0


class NearGcResult(_PerPath):
    copies: Count
    stale: Count
    stale_bytes: Count
    over_budget: Count
    over_budget_bytes: Count
    kept: Count
    kept_bytes: Count
    not_copies: Count
    not_copies_bytes: Count
    removed_bytes: Count
    dry_run: bool


class UnpinResult(_PerPath):
    pins_released: Count | None = None  # by paths
    owners_released: list[str] = []  # by job or all
    objects: Count = 0


class ReadBytes(_Result):
    memory: Count = 0
    disk: Count = 0
    peer: Count = 0
    near: Count = 0  # the near store (docs/tiers.md); absent from older daemons: 0
    backend: Count = 0

    def total(self) -> int:
        return self.memory + self.disk + self.peer + self.near + self.backend


class UsageRow(_Result):
    """One tenant's or reader's usage; cached/pinned for tenants only (None: not known)."""
    name: str
    read: ReadBytes
    hit_ratio: Annotated[float, Field(ge=0, le=1)] | None = None
    stall_s: Annotated[float, Field(ge=0)] = 0.0
    first: float = 0.0  # epoch seconds of the first and last read counted
    last: float = 0.0
    cached: Count | None = None
    pinned: Count | None = None


class CacheShare(_Result):
    used: Count
    budget: Count
    pinned: Count
    dirty: Count


class WorkingSetRow(_Result):
    tenant: str
    day: Count  # estimated bytes accessed in the last day, week
    week: Count


class ForecastResult(_Result):
    verdict: Literal["too few samples", "not growing", "full", "growing"]
    text: str
    samples: Count
    span_s: Annotated[float, Field(ge=0)]
    level: Count  # pinned + dirty + hot bytes now
    budget: Count
    slope_per_day: float | None = None
    days_to_full: Annotated[float, Field(ge=0)] | None = None
    working_set: list[WorkingSetRow] = []


class UsageResult(_Result):
    by: Literal["tenant", "job", "pod", "uid", "namespace"]
    rows: list[UsageRow]
    cache: CacheShare
    cached_from: Literal["cache", "index", "none"]  # where per-tenant cached bytes came from
    forecast: ForecastResult | None = None


Ratio = Annotated[float, Field(ge=0, le=1)]
Seconds = Annotated[float, Field(ge=0)]


class PrefixRow(_Result):
    """One prefix (the first path levels under the mount, "" its root) in a report."""
    prefix: str
    heat: Annotated[float, Field(ge=0)] = 0.0  # decayed bytes read
    read: ReadBytes
    hit_ratio: Ratio | None = None
    reread_ratio: Ratio | None = None  # chunk accesses of data read before
    accesses: Count = 0
    refetches: Count = 0
    lists: Count = 0
    heads: Count = 0
    last_read: float = 0.0  # epoch seconds; 0: never
    cached: Count = 0  # bytes in the disk tier
    total: Count = 0  # bytes of the files the namespace knows under it


class ColdRow(_Result):
    prefix: str
    cached: Count
    last_access: float  # the newest access of any of its cached chunks (epoch seconds)


class LatencyRow(_Result):
    source: str
    reads: Count
    p50: Seconds | None = None  # upper bounds of the histogram buckets they fall in
    p99: Seconds | None = None


class Bucket(_Result):
    le: float | None  # upper bound (seconds, or heat); None: the +inf bucket
    count: Annotated[float, Field(ge=0)]  # observations (stalls) or bytes (heat)


class StallsPart(_Result):
    threshold_s: Seconds | None = None
    total: Count = 0
    total_s: Seconds = 0.0
    by_source: dict[str, Count] = {}
    slowest: list[dict[str, Any]] = []
    histogram: list[Bucket] = []  # tierfs_read_stall_seconds, all tenants
    backend_stalls: Count = 0  # backend requests past --stall-warn


class MetadataPart(_Result):
    lists: Count
    heads: Count
    top: list[PrefixRow]  # the prefixes with the most LIST + HEAD requests


class EvictionPart(_Result):
    evictions: Count  # chunks evicted since the mount started
    refused: Count = 0  # chunks fetched for readers and not stored (cache/admission.py)
    fetches: Count  # chunk accesses the store (or a peer) served
    refetches: Count  # of those, chunks fetched before: evicted, then wanted again
    refetch_ratio: Ratio | None = None


class UsagePoint(_Result):
    t: float
    used: Count
    budget: Count
    pinned: Count = 0


class RatioPoint(_Result):
    t: float
    hit_ratio: Ratio | None  # of the bytes read since the point before (the first: ever)
    bytes: Count  # read in that interval


class ReportResult(_Result):
    mountpoint: str
    source: str
    generated: float  # epoch seconds
    levels: Annotated[int, Field(ge=1)]  # path levels of a prefix
    cache: CacheShare
    read: ReadBytes
    hit_ratio: Ratio | None = None
    tiers: dict[str, Ratio]  # share of bytes read per source
    latency: list[LatencyRow] = []
    hot: list[PrefixRow]
    cold: list[ColdRow]
    cold_after: Seconds
    metadata: MetadataPart
    stalls: StallsPart
    composition: dict[str, Count]  # cached bytes by heat band (and pinned)
    heat: list[Bucket]  # cached bytes by decayed heat
    eviction: EvictionPart
    usage_series: list[UsagePoint]
    ratio_series: list[RatioPoint]


class JobFile(_Result):
    path: str  # relative to the mount
    etag: str
    size: Count
    last: float


class PodResult(_Result):
    uid: str
    namespace: str | None = None
    known: bool  # registered now, or (forget) it was


class JobFilesResult(_Result):
    job: str
    known: bool  # False: this mount saw no read of that job (or it is past the window)
    files: list[JobFile]
    truncated: bool = False  # the job read more files than the mount keeps per job
    first: float = 0.0
    last: float = 0.0


RESULTS: dict[str, type[_Result]] = {"status": StatusResult, "warm": WarmResult,
                                     "evict": EvictResult, "unpin": UnpinResult,
                                     "usage": UsageResult, "report": ReportResult,
                                     "job_files": JobFilesResult, "pod": PodResult,
                                     "near_gc": NearGcResult}


def check_result(op: str, result: dict[str, Any]) -> dict[str, Any]:
    """A final result, checked against its op's model; returned as the daemon sent it
    (fields this client does not know pass through, e.g. to --json)."""
    model = RESULTS.get(op)
    if model is not None:
        try:
            model.model_validate(result)
        except ValidationError as exc:
            raise ProtocolError(f"a malformed {op} result ({usage_error(exc)})") from None
    return result
