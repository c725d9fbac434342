"""BackendHealth (tierfs/backend/health.py): suspect, confirm with a probe, degrade, recover.

The probe is a plain function here (the daemon's is a bucket check with one attempt and
short timeouts); intervals are shortened so a whole outage takes a fraction of a second.
"""

import logging
import threading

import pytest
import trio

from tierfs.backend.file import FileBackend
from tierfs.backend.runner import AsyncBackend
from tierfs.errors import AccessDenied, BackendError, BackendUnavailable, NotFound, StoreDown
from tierfs.backend.health import BackendHealth
from tierfs.metrics import Metrics

from unitkit import sample


class Probe:
    """A bucket check that answers or not, as the test says; counts calls and overlap."""

    def __init__(self) -> None:
        self.answers = True
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self.hang = threading.Event()  # set: the probe blocks until released
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.hang.is_set():
                self.release.wait(10)
            if not self.answers:
                raise BackendUnavailable("head bucket: endpoint unreachable (test)")
        finally:
            with self._lock:
                self.running -= 1


async def until(cond, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


def up_gauge(metrics: Metrics) -> float:
    return sample(metrics, "tierfs_backend_up")


def health_lines(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tierfs.backend.health" and r.levelno == level]


@pytest.fixture
async def health(nursery, caplog):
    caplog.set_level(logging.INFO, logger="tierfs.backend.health")
    metrics = Metrics()
    probe = Probe()
    h = BackendHealth(metrics, probe, interval_s=0.05, timeout_s=0.3)
    nursery.start_soon(h.run)
    return h, probe, metrics


async def test_up_at_start_and_one_failure_on_a_healthy_store_changes_nothing(health, caplog):
    h, probe, metrics = health
    assert h.up and up_gauge(metrics) == 1
    h.observe(BackendUnavailable("get 'k' at 0: read timeout"))
    await until(lambda: probe.calls == 1)  # the suspicion is checked with one probe
    await trio.sleep(0.2)
    assert h.up and h.outages == 0 and up_gauge(metrics) == 1
    h.admit("get")  # requests go through
    assert health_lines(caplog, logging.WARNING) == []


async def test_outage_is_confirmed_then_refused_fast_then_recovers_by_itself(health, caplog):
    h, probe, metrics = health
    probe.answers = False
    h.observe(BackendUnavailable("get 'k' at 0: endpoint unreachable"))
    await until(lambda: not h.up)
    assert up_gauge(metrics) == 0 and h.outages == 1
    with pytest.raises(StoreDown) as err:
        h.admit("get")
    assert err.value.errno == 5  # EIO
    for _ in range(5):  # more failures while down: no more log lines
        h.observe(BackendUnavailable("list 'd/': endpoint unreachable"))
    await until(lambda: probe.calls >= 4)  # probing goes on every interval
    assert not h.up
    probe.answers = True
    await until(lambda: h.up)
    h.admit("get")
    assert up_gauge(metrics) == 1
    warnings = health_lines(caplog, logging.WARNING)
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    infos = health_lines(caplog, logging.INFO)
    assert len(infos) == 1 and "answers again" in infos[0]
    calls = probe.calls
    await trio.sleep(0.2)
    assert probe.calls == calls  # no probing while the store answers


async def test_a_hanging_probe_counts_as_down_and_probes_never_pile_up(health):
    h, probe, metrics = health
    probe.hang.set()
    h.mark_down("startup: no answer")
    await trio.sleep(1.0)  # ~3 probe timeouts and intervals
    assert not h.up and "no answer" in h.reason
    assert probe.most_at_once == 1  # the abandoned thread holds the probe slot
    probe.hang.clear()
    probe.release.set()
    await until(lambda: h.up)


async def test_an_answer_of_the_store_ends_degraded_mode(health):
    h, probe, metrics = health
    probe.answers = False
    h.mark_down("test")
    h.observe(BackendError("503 SlowDown"))  # an error that is not an answer: still down
    assert not h.up
    h.observe(NotFound("head 'k': not found"))  # a request in flight got an answer
    assert h.up and up_gauge(metrics) == 1


async def test_async_backend_refuses_before_queuing_and_learns_from_outcomes(tmp_path):
    class Store(FileBackend):
        gets = 0
        fail = False

        def get(self, key, start, length, etag, *, size=None):
            Store.gets += 1
            if Store.fail:
                raise BackendUnavailable(f"get {key!r}: endpoint unreachable (test)")
            return super().get(key, start, length, etag)

    (tmp_path / "k").write_bytes(b"hello")
    metrics = Metrics()
    backend = AsyncBackend(Store(str(tmp_path)), metrics, concurrency=2, background=1)
    backend.health = h = BackendHealth(metrics, lambda: None)
    assert await backend.get("k", 0, 5, None) == b"hello"
    h.mark_down("test")
    requests = sample(metrics, "tierfs_backend_requests_total", {"op": "get"})
    with pytest.raises(StoreDown):
        await backend.get("k", 0, 5, None)
    assert Store.gets == 1  # never reached the store...
    assert sample(metrics, "tierfs_backend_requests_total", {"op": "get"}) == requests  # ...nor counted
    h.mark_up()
    Store.fail = True
    with pytest.raises(BackendUnavailable):
        await backend.get("k", 0, 5, None)
    assert h._suspect.is_set()  # the failure made the store suspect (run() would probe)


async def test_start_up_check_is_bounded_and_only_an_unreachable_store_degrades(health):
    h, probe, metrics = health

    def denied() -> None:
        raise AccessDenied("bucket 'b': access denied")

    def refused() -> None:
        raise BackendUnavailable("bucket 'b': endpoint unreachable (refused)")

    assert await h.start(lambda: None, 1.0) and h.up
    with pytest.raises(AccessDenied):  # an answer: the mount fails with it
        await h.start(denied, 1.0)
    assert h.up
    release = threading.Event()
    with trio.fail_after(2):  # a hanging store: degraded once the timeout passes
        assert not await h.start(lambda: release.wait(10), 0.3)
    release.set()
    assert not h.up and "within 0.3s" in h.reason
    h.mark_up()
    assert not await h.start(refused, 1.0)
    assert not h.up and "refused" in h.reason


async def test_a_stalled_request_makes_a_hung_store_degraded_before_it_ends(tmp_path, nursery):
    """The store hangs: the first GET waits out its timeouts, but from stall_warn on the
    probe has confirmed the outage and every other request fails at once."""
    release = threading.Event()

    class Hung(FileBackend):
        def get(self, key, start, length, etag, *, size=None):
            release.wait(10)
            raise BackendUnavailable(f"get {key!r}: read timeout (test)")

    (tmp_path / "k").write_bytes(b"hello")
    metrics = Metrics()
    probe = Probe()
    probe.answers = False
    backend = AsyncBackend(Hung(str(tmp_path)), metrics, concurrency=4, background=1,
                           stall_warn=0.2)
    backend.health = h = BackendHealth(metrics, probe, interval_s=0.05, timeout_s=0.3)
    nursery.start_soon(h.run)
    nursery.start_soon(backend.watch_stalls)
    try:
        async with trio.open_nursery() as n:
            async def first_get() -> None:
                with pytest.raises(BackendUnavailable):
                    await backend.get("k", 0, 5, None)

            n.start_soon(first_get)
            await until(lambda: not h.up, 3)  # while the first GET still hangs
            with pytest.raises(StoreDown):
                await backend.get("k", 0, 5, None)
            release.set()
    finally:
        release.set()
