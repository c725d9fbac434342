"""UploadQueue: which file to upload next, and when a failed one is tried again.

The queue knows inode numbers and one callback, `upload(ino) -> bool` (True: the file is
saved or gone; False: it failed and waits its own backoff, RETRY_MIN_S doubling up to
RETRY_MAX_S, while the other files go on). It knows nothing of staging files, S3 or the
journal (rclone's vfscache/writeback is the model). Several workers may run it at once.
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable

import trio

RETRY_MIN_S = 1.0  # a file whose upload failed waits this long, doubling up to RETRY_MAX_S
RETRY_MAX_S = 60.0
_WAKE = -1  # not an inode: an idle worker re-reads the retry schedule


class UploadQueue:
    def __init__(self, *, retry_min_s: float = RETRY_MIN_S,
                 retry_max_s: float = RETRY_MAX_S) -> None:
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._send, self._recv = trio.open_memory_channel[int](math.inf)
        self._retry_at: dict[int, float] = {}  # ino -> trio time of its next attempt
        self._failures: dict[int, int] = {}  # ino -> uploads failed in a row

    def put(self, ino: int) -> None:
        """Upload this file soon (it was acknowledged, or changed while waiting)."""
        self._send.send_nowait(ino)

    def failed(self, ino: int) -> float:
        """Its upload failed: the next attempt after its own backoff (the delay)."""
        n = self._failures[ino] = self._failures.get(ino, 0) + 1
        delay = min(self.retry_max_s, self.retry_min_s * 2 ** min(n - 1, 30))
        self._retry_at[ino] = trio.current_time() + delay
        self._send.send_nowait(_WAKE)  # an idle worker re-reads the schedule
        return delay

    def failures(self, ino: int) -> int:
        return self._failures.get(ino, 0)

    def done(self, ino: int) -> None:
        """Saved or gone: no retry, its count starts over."""
        self._retry_at.pop(ino, None)
        self._failures.pop(ino, None)

    async def run(self, upload: Callable[[int], Awaitable[object]]) -> None:
        """One worker: forever, the next due file to `upload` (which handles its own
        failures: it calls failed() or done())."""
        while True:
            await upload(await self._next())

    async def _next(self) -> int:
        """The next file to upload: one whose retry is due, else the next queued item."""
        while True:
            now = trio.current_time()
            due = min(self._retry_at.items(), key=lambda kv: kv[1], default=None)
            if due is not None and due[1] <= now:
                del self._retry_at[due[0]]
                if self._retry_at:
                    self._send.send_nowait(_WAKE)  # another worker times the next one
                return due[0]
            with trio.move_on_after(math.inf if due is None else due[1] - now):
                item = await self._recv.receive()
                if item != _WAKE:
                    return item
