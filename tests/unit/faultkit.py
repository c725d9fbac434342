"""FaultBackend: a failure-injecting wrapper around any Backend, for in-process tests.

Modelled on mountpoint-s3's failure_client: the wrapped backend does the real work; rules
decide, per call, whether to fail it or damage what it returns. Used through
`unitkit.core(tmp, backend=FaultBackend(FileBackend(src)), bucket=src)`, which builds the
core exactly as the daemon does (tierfs.mount.core.build_core) - no FUSE, no network.

A rule is one `inject(ops, action, ...)`:
- ops: backend method names ("get", "get_into", "put", "upload_part", "mpu_abort", ...),
  a set of them, or "*" (every call);
- when: `probability` (drawn from the backend's seeded Random, so a run repeats), `count`
  (fire at most this often), `after` (let this many matching calls through first),
  `when` (a predicate on the `Call`: its key, range...);
- action: one of the factories below - `error`, `unavailable`, `precondition_failed`,
  `unexpected` (an exception tierfs does not expect: RuntimeError, a urllib3-like error,
  an ExceptionGroup), `Hang` (until released), `delay`, `truncate`, `flip_bits`.

Backend calls run in worker threads (AsyncBackend); rules and counters are guarded by a
lock, and `Hang` blocks on a threading.Event, so a test on the trio thread releases it.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import trio

from tierfs.backend.base import Backend, ListPage, ObjectMeta
from tierfs.errors import BackendError, BackendUnavailable, PreconditionFailed

OPS = frozenset({"check", "list", "head", "get", "get_into", "put", "copy", "delete",
                 "mpu_create", "upload_part", "upload_part_copy", "mpu_complete", "mpu_abort",
                 "mpu_list"})
READS = frozenset({"get", "get_into"})
UPLOADS = frozenset({"put", "mpu_create", "upload_part", "upload_part_copy", "mpu_complete"})


@dataclass(frozen=True)
class Call:
    """One backend call as a rule's predicate sees it."""

    op: str
    key: str | None
    start: int | None = None  # reads: the range asked for
    length: int | None = None


class Action:
    """What a rule does to a call: `before` runs instead of/before the real call (raise,
    hang, delay); `after` may damage the data a read returns."""

    def before(self, call: Call) -> None:
        return None

    def damage(self, data: bytearray | memoryview, rnd: random.Random) -> int:
        """Damage data in place; returns how many bytes remain valid (a truncation)."""
        return len(data)


class _Raise(Action):
    def __init__(self, make: Callable[[Call], BaseException]) -> None:
        self.make = make

    def before(self, call: Call) -> None:
        raise self.make(call)


def error(message: str = "injected backend error") -> Action:
    """A BackendError, as the backend raises after botocore's retries."""
    return _Raise(lambda c: BackendError(f"{message} ({c.op} {c.key})"))


def unavailable(message: str = "injected: endpoint unreachable") -> Action:
    return _Raise(lambda c: BackendUnavailable(f"{message} ({c.op} {c.key})"))


def precondition_failed() -> Action:
    return _Raise(lambda c: PreconditionFailed(f"injected: {c.key} changed (If-Match)"))


class InjectedBug(RuntimeError):
    """The default unexpected exception: what a backend should never let escape."""


def unexpected(exc_type: type[BaseException] = InjectedBug, *, group: bool = False) -> Action:
    """An exception the backend contract does not allow (a raw library error, a bug); with
    group=True wrapped in an ExceptionGroup, as a nested nursery delivers it."""

    def make(c: Call) -> BaseException:
        exc = exc_type(f"injected unexpected {exc_type.__name__} in {c.op} {c.key}")
        if group and isinstance(exc, Exception):
            return ExceptionGroup("injected group", [exc])
        return exc

    return _Raise(make)


class Hang(Action):
    """Block the call until `release()` (or `max_s`, then BackendUnavailable, so a test that
    forgets to release cannot hang the suite)."""

    def __init__(self, max_s: float = 60.0) -> None:
        self.max_s = max_s
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0  # calls that have started hanging

    def before(self, call: Call) -> None:
        with self._lock:
            self.entered += 1
        if not self._released.wait(self.max_s):
            raise BackendUnavailable(f"injected hang of {call.op} {call.key} timed out")

    def release(self) -> None:
        self._released.set()

    async def wait_entered(self, n: int = 1, timeout_s: float = 30.0) -> None:
        """Wait (on the trio thread) until n calls are hanging."""
        with trio.fail_after(timeout_s):
            while self.entered < n:
                await trio.sleep(0.01)


class _Delay(Action):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def before(self, call: Call) -> None:
        time.sleep(self.seconds)


def delay(seconds: float) -> Action:
    return _Delay(seconds)


class _Truncate(Action):
    def __init__(self, keep: float) -> None:
        self.keep = keep

    def damage(self, data: bytearray | memoryview, rnd: random.Random) -> int:
        if not data:
            return 0
        keep = int(self.keep) if self.keep >= 1 else int(len(data) * self.keep)
        return max(0, min(len(data) - 1, keep))  # always shorter than what came


def truncate(keep: float = 0.5) -> Action:
    """A read body cut short: `keep` bytes (>= 1) or that fraction of them (< 1)."""
    return _Truncate(keep)


class _FlipBits(Action):
    def __init__(self, bits: int) -> None:
        self.bits = bits

    def damage(self, data: bytearray | memoryview, rnd: random.Random) -> int:
        for _ in range(self.bits if data else 0):
            pos = rnd.randrange(len(data))
            data[pos] ^= 1 << rnd.randrange(8)
        return len(data)


def flip_bits(bits: int = 1) -> Action:
    """Flip `bits` random bits of a read's body (the length stays right)."""
    return _FlipBits(bits)


@dataclass
class Rule:
    ops: frozenset[str]
    action: Action
    probability: float = 1.0
    count: int | None = None
    after: int = 0
    when: Callable[[Call], bool] | None = None
    seen: int = 0  # matching calls so far
    fired: int = 0
    _owner: "FaultBackend | None" = field(default=None, repr=False)

    def matches(self, call: Call) -> bool:
        return call.op in self.ops and (self.when is None or self.when(call))

    def remove(self) -> None:
        if self._owner is not None:
            self._owner.remove(self)
        if isinstance(self.action, Hang):
            self.action.release()


class FaultBackend:
    """Any Backend, with injected faults. `calls` and `injected` count by op."""

    def __init__(self, inner: Backend, *, seed: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.rnd = random.Random(seed)
        self.rules: list[Rule] = []
        self.calls: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def inject(self, ops: str | Iterable[str], action: Action, *, probability: float = 1.0,
               count: int | None = None, after: int = 0,
               when: Callable[[Call], bool] | None = None) -> Rule:
        names = frozenset(OPS if ops == "*" else [ops] if isinstance(ops, str) else ops)
        unknown = names - OPS
        if unknown:
            raise ValueError(f"not backend operations: {sorted(unknown)}")
        rule = Rule(names, action, probability, count, after, when, _owner=self)
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self.rules:
                self.rules.remove(rule)

    def clear(self) -> None:
        """Stop injecting (hung calls are released)."""
        with self._lock:
            rules, self.rules = self.rules, []
        for rule in rules:
            if isinstance(rule.action, Hang):
                rule.action.release()

    def _pick(self, call: Call) -> list[Rule]:
        """The rules that fire for this call (each draws from the seeded Random)."""
        out = []
        with self._lock:
            self.calls[call.op] += 1
            for rule in self.rules:
                if not rule.matches(call):
                    continue
                rule.seen += 1
                if rule.seen <= rule.after or (rule.count is not None and rule.fired >= rule.count):
                    continue
                if rule.probability < 1.0 and self.rnd.random() >= rule.probability:
                    continue
                rule.fired += 1
                self.injected[call.op] += 1
                out.append(rule)
        return out

    def _before(self, call: Call) -> list[Rule]:
        fired = self._pick(call)
        for rule in fired:
            rule.action.before(call)
        return fired

    def _damage(self, fired: list[Rule], data: bytearray | memoryview) -> int:
        view, n = memoryview(data), len(data)  # a view: slices of it damage `data` itself
        for rule in fired:
            with self._lock:
                n = rule.action.damage(view[:n], self.rnd) if n else 0
        return n

    # ---- the Backend protocol -----------------------------------------------------------

    def check(self) -> None:
        self._before(Call("check", None))
        self.inner.check()

    def list(self, prefix: str, delimiter: str | None = "/", token: str | None = None,
             max_keys: int = 1000) -> ListPage:
        self._before(Call("list", prefix))
        return self.inner.list(prefix, delimiter, token, max_keys)

    def head(self, key: str) -> ObjectMeta:
        self._before(Call("head", key))
        return self.inner.head(key)

    def get(self, key: str, start: int, length: int, etag: str | None, *,
            size: int | None = None) -> bytes:
        fired = self._before(Call("get", key, start, length))
        data = self.inner.get(key, start, length, etag, size=size)
        if not fired:
            return data
        buf = bytearray(data)
        return bytes(buf[:self._damage(fired, buf)])

    def get_into(self, key: str, start: int, buf: memoryview, etag: str | None, *,
                 size: int | None = None, metadata: dict[str, str] | None = None) -> int:
        fired = self._before(Call("get_into", key, start, len(buf)))
        extra = {} if metadata is None else {"metadata": metadata}
        n = self.inner.get_into(key, start, buf, etag, size=size, **extra)
        return self._damage(fired, buf[:n]) if fired else n

    def put(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> ObjectMeta:
        self._before(Call("put", key))
        return self.inner.put(key, data, metadata)

    def copy(self, src: str, dst: str, src_etag: str | None,
             metadata: dict[str, str] | None = None) -> str:
        self._before(Call("copy", dst))
        return self.inner.copy(src, dst, src_etag, metadata)

    def delete(self, key: str) -> None:
        self._before(Call("delete", key))
        self.inner.delete(key)

    def mpu_create(self, key: str, metadata: dict[str, str] | None = None) -> str:
        self._before(Call("mpu_create", key))
        return self.inner.mpu_create(key, metadata)

    def upload_part(self, key: str, upload_id: str, part: int, data: bytes) -> str:
        self._before(Call("upload_part", key))
        return self.inner.upload_part(key, upload_id, part, data)

    def upload_part_copy(self, key: str, upload_id: str, part: int, src: str, src_etag: str,
                         start: int, length: int) -> str:
        self._before(Call("upload_part_copy", key, start, length))
        return self.inner.upload_part_copy(key, upload_id, part, src, src_etag, start, length)

    def mpu_complete(self, key: str, upload_id: str, parts: list[tuple[int, str]]) -> str:
        self._before(Call("mpu_complete", key))
        return self.inner.mpu_complete(key, upload_id, parts)

    def mpu_abort(self, key: str, upload_id: str) -> None:
        self._before(Call("mpu_abort", key))
        self.inner.mpu_abort(key, upload_id)

    def mpu_list(self, key: str) -> list[Any]:  # ids, or MultipartUpload records
        self._before(Call("mpu_list", key))
        return self.inner.mpu_list(key)

    def __getattr__(self, name: str) -> Any:
        # whatever else a backend offers (added to the protocol later) passes through
        return getattr(self.inner, name)
