"""One fetch per chunk however many readers want it, and the memory of failed ones.

Singleflight: the first caller for a chunk starts a `Flight`; later callers wait on it and
take its bytes. If the flight fails or is cancelled, each waiter tries for itself, so a
cancelled FUSE request never strands the others. The flight lives until the disk tier
has the chunk (or will not), so that a reader arriving meanwhile does not fetch it again.

A reader's fetch that failed is remembered for FAILED_MEMO_S (`FailureMemo`): the kernel
asks again for a read that failed (about three times per read() call, and each page of a
read-ahead window), and those re-asks get the same errno at once instead of each waiting
out the backend's timeouts and retries again. A success clears it; a read after the memo
has expired tries the store again.
"""

from __future__ import annotations

import trio

from ..errors import BackendError, RecentFailure

# long enough to cover the kernel's immediate re-asks of a failed read, short enough that
# an application that retries by itself a little later meets the store again
FAILED_MEMO_S = 3.0
MEMO_MAX = 1024  # failed chunks remembered; an outage over more keeps only the live ones


class Flight:
    def __init__(self) -> None:
        self.done = trio.Event()  # the fetch ended (data is set if it succeeded)
        self.stored = trio.Event()  # ...and the disk tier has the chunk (or will not)
        self.data: bytes | bytearray | memoryview | None = None
        self.source = "backend"  # or "peer": where the bytes came from
        self.joined = 0  # readers' first accesses that joined this flight: heat for the fill
        # a reader waits on this (read-ahead) flight: if it fails, the failure is the
        # reader's too and is remembered, so the reader does not wait out a second GET
        self.reader_waiting = False


class Flights:
    """The flights under way, by chunk key."""

    def __init__(self) -> None:
        self._flights: dict[bytes, Flight] = {}

    def get(self, ckey: bytes) -> Flight | None:
        return self._flights.get(ckey)

    def start(self, ckey: bytes) -> Flight:
        flight = self._flights[ckey] = Flight()
        return flight

    def end(self, ckey: bytes, flight: Flight) -> None:
        """The flight is over (failed, or its chunk stored): waiters wake."""
        if self._flights.get(ckey) is flight:
            del self._flights[ckey]
        flight.done.set()
        flight.stored.set()

    def __contains__(self, ckey: bytes) -> bool:
        return ckey in self._flights

    def __len__(self) -> int:
        return len(self._flights)


class FailureMemo:
    def __init__(self, memo_s: float = FAILED_MEMO_S) -> None:
        self.memo_s = memo_s
        self._failed: dict[bytes, tuple[float, BackendError]] = {}

    def remember(self, ckey: bytes, exc: BackendError) -> None:
        now = trio.current_time()
        if len(self._failed) >= MEMO_MAX:
            self._failed = {k: v for k, v in self._failed.items() if now - v[0] < self.memo_s}
        self._failed[ckey] = (now, exc)

    def clear(self, ckey: bytes) -> None:
        self._failed.pop(ckey, None)

    def check(self, ckey: bytes, what: str) -> None:
        """Raise RecentFailure if a reader's fetch of this chunk failed within the memo."""
        entry = self._failed.get(ckey)
        if entry is None:
            return
        age = trio.current_time() - entry[0]
        if age >= self.memo_s:
            del self._failed[ckey]
            return
        err = RecentFailure(f"{what} failed {age:.1f}s ago ({entry[1]}); not asked again "
                            f"before {self.memo_s:g}s")
        err.errno = entry[1].errno  # the re-ask gets what the first ask got
        raise err
