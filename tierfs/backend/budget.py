"""How long a read can take to fail: the worst-case time to EIO, from the mount options.

One read of a chunk that is not cached is one GET (tierfs/backend/s3.py), and these
layers can each add time before the application gets EIO (docs/operations.md "Worst-case
time to EIO"):

1. botocore's standard retry mode: `backend_retries` attempts in all. An attempt may take
   the connect timeout (backend_timeout, at most 10 s) to connect, then backend_timeout
   waiting for the response. Between attempts botocore sleeps a jittered backoff of at
   most min(2^(i-1), 20) s after attempt i when throttled (SlowDown; 50 ms base
   otherwise), raised by up to 5 s when the store sends x-amz-retry-after.
2. the body: a body that stops arriving fails after backend_timeout; a body cut short
   (FIN, RST, timeout) is resumed from the bytes received, up to `backend_retries` times;
   a body that fails an integrity check is fetched again, up to INTEGRITY_RETRIES times.
3. S3Backend's deadline: no resume or refetch starts later than one GET's budget (1 plus
   the body stalling once) after the GET began, so 2 adds at most one more GET budget
   however often it happens: the worst case is two GET budgets.
4. the kernel asks again for a read that failed (about 3 times); the read walk's memo of
   failed chunks (tierfs/read/fetch.py, FAILED_MEMO_S) answers those re-asks with EIO at once.

Not bounded by any of this: a store that keeps sending a few bytes at least once per
backend_timeout (no stall is ever seen), and the wait for a free backend thread while
`backend_concurrency` other requests run (each of them is bounded as above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import MountConfig

CONNECT_TIMEOUT_MAX_S = 10.0
# botocore standard mode (botocore/retries/standard.py ExponentialBackoff)
BACKOFF_CAP_S = 20.0
BACKOFF_THROTTLED_BASE_S = 1.0
BACKOFF_BASE_S = 0.05
RETRY_AFTER_EXTRA_S = 5.0
# refetches of a body that failed an integrity check (after the first fetch)
INTEGRITY_RETRIES = 2
# the kernel's re-asks of a failed read, answered at once by the fetcher's memo
KERNEL_REASKS = 3


def connect_timeout(timeout_s: float) -> float:
    """The connect timeout S3Backend gives botocore for a backend_timeout."""
    return min(timeout_s, CONNECT_TIMEOUT_MAX_S)


def backoff_total(attempts: int, *, throttled: bool = True) -> float:
    """The most botocore sleeps between `attempts` attempts of one request."""
    base = BACKOFF_THROTTLED_BASE_S if throttled else BACKOFF_BASE_S
    extra = RETRY_AFTER_EXTRA_S if throttled else 0.0
    return sum(min(base * 2 ** (i - 1), BACKOFF_CAP_S) + extra for i in range(1, attempts))


def get_budget(timeout_s: float, attempts: int) -> float:
    """The longest one GET request may take to fail: every attempt connects slowly and
    waits out the read timeout, the backoffs are the longest, and when the last attempt
    does answer its body stalls (one more read timeout). S3Backend starts no resume or
    refetch later than this after a GET began."""
    return (attempts * (connect_timeout(timeout_s) + timeout_s)
            + backoff_total(attempts) + timeout_s)


@dataclass(frozen=True)
class ReadBudget:
    """Seconds until a read of uncached data gets EIO, for the ways a store fails."""

    worst: float  # any failure, every retry layer at its longest
    hang: float  # the store accepts connections but stops answering (also mid-body)
    unreachable: float  # connections time out (host down, packets dropped)
    timeout_s: float
    attempts: int

    def explain(self) -> str:
        """The figures and where they come from, for `tierfs mount --help` and the docs."""
        t, a, c = self.timeout_s, self.attempts, connect_timeout(self.timeout_s)
        get = self.worst / 2
        pad = " " * 36
        return "\n".join([
            "Worst-case time to EIO for a read of uncached data",
            f"(backend-timeout {t:g}s, backend-retries {a}):",
            f"  store stops answering   {self.hang:6.0f} s  {a + 1} x {t:g} s read timeout "
            f"({a} attempts, then a stalled body)",
            f"  store unreachable       {self.unreachable:6.0f} s  {a} x {c:g} s connect timeout",
            f"  any failure, worst case {self.worst:6.0f} s  2 x {get:.0f} s GET budget = "
            f"{a} x ({c:g} + {t:g}) s attempts",
            f"{pad}+ {backoff_total(a):g} s backoff + {t:g} s stalled body; resumes and",
            f"{pad}refetches start only within the first GET budget",
            "The kernel's re-asks of a failed read get EIO at once; a refused connection",
            "fails in under a second. See docs/operations.md \"Worst-case time to EIO\".",
        ])


def read_budget(timeout_s: float, attempts: int) -> ReadBudget:
    """The ReadBudget of backend_timeout `timeout_s` and backend_retries `attempts`."""
    hang = (attempts + 1) * timeout_s + backoff_total(attempts, throttled=False)
    unreachable = attempts * connect_timeout(timeout_s) + backoff_total(attempts,
                                                                        throttled=False)
    return ReadBudget(worst=2 * get_budget(timeout_s, attempts), hang=hang,
                      unreachable=unreachable, timeout_s=timeout_s, attempts=attempts)


def mount_read_budget(cfg: MountConfig) -> ReadBudget:
    """The ReadBudget of a mount (its backend_timeout and backend_retries)."""
    return read_budget(cfg.backend_timeout, cfg.backend_retries)


def default_read_budget() -> ReadBudget:
    """The ReadBudget of the default options (for `tierfs mount --help`)."""
    from ..config import MountConfig

    fields = MountConfig.model_fields
    return read_budget(fields["backend_timeout"].default, fields["backend_retries"].default)
