"""The Tasks supervisor (tierfs/tasks.py) and the exception helpers, on trio's virtual
clock: backoff is asserted in virtual seconds, so nothing here sleeps for real."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from tierfs.errors import BackendError, NotFound, TierfsError
from tierfs.metrics import Metrics
from tierfs.tasks import (BACKOFF_MAX_S, BACKOFF_MIN_S, HEALTHY_S, Tasks, expected_error,
                          is_cancellation, leaves, sole_exception)

from unitkit import sample


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def errors(metrics: Metrics, task: str) -> float:
    return sample(metrics, "tierfs_internal_errors_total", {"task": task})


def logged(caplog, exc_type) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], exc_type)
            or r.exc_info and any(isinstance(e, exc_type) for e in leaves(r.exc_info[1]))]


async def test_a_spawned_failure_is_reported_and_the_nursery_lives(caplog):
    metrics = Metrics()
    done = []

    async def boom():
        raise ExceptionGroup("nested", [RuntimeError("bug")])

    async def fine():
        await trio.sleep(0)
        done.append(1)

    async with trio.open_nursery() as nursery:
        tasks = Tasks(nursery, metrics)
        tasks.spawn("job", boom)
        tasks.spawn("job", fine)
    assert done == [1]
    assert errors(metrics, "job") == 1
    assert len(logged(caplog, RuntimeError)) == 1


async def test_cancellation_is_not_an_error(caplog):
    metrics = Metrics()
    async with trio.open_nursery() as nursery:
        tasks = Tasks(nursery, metrics)
        tasks.spawn("sleeper", trio.sleep_forever)
        tasks.supervise("service", trio.sleep_forever)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert errors(metrics, "sleeper") == errors(metrics, "service") == 0
    assert not caplog.records


async def test_a_failing_service_restarts_with_doubling_backoff(autojump_clock, caplog):
    metrics = Metrics()
    starts: list[float] = []

    async def service():
        starts.append(trio.current_time())
        if len(starts) <= 4:
            raise RuntimeError(f"failure {len(starts)}")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        Tasks(nursery, metrics).supervise("svc", service)
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == [BACKOFF_MIN_S, 2 * BACKOFF_MIN_S, 4 * BACKOFF_MIN_S, 8 * BACKOFF_MIN_S]
    assert errors(metrics, "svc") == 4
    assert len(logged(caplog, RuntimeError)) == 4


async def test_backoff_is_capped_and_resets_after_a_healthy_run(autojump_clock):
    metrics = Metrics()
    starts: list[float] = []

    async def service():
        starts.append(trio.current_time())
        if len(starts) == 12:
            await trio.sleep(HEALTHY_S)  # ran long enough: the next failure is a fresh one
        if len(starts) <= 12:
            raise RuntimeError("again")
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        Tasks(nursery, metrics).supervise("svc", service)
        await trio.sleep(10_000)
        nursery.cancel_scope.cancel()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert max(gaps[:10]) == BACKOFF_MAX_S
    assert gaps[11] == HEALTHY_S + BACKOFF_MIN_S
    assert len(starts) == 13


async def test_a_service_that_returns_is_restarted_and_counted(autojump_clock, caplog):
    metrics = Metrics()
    runs = []

    async def service():
        runs.append(1)
        if len(runs) >= 3:
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        Tasks(nursery, metrics).supervise("svc", service)
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert len(runs) == 3
    assert errors(metrics, "svc") == 2
    assert sum("returned" in r.getMessage() for r in caplog.records) == 2


def test_exception_helpers():
    nf = NotFound("x")
    be = BackendError("y")
    bug = RuntimeError("z")
    assert sole_exception(ExceptionGroup("a", [ExceptionGroup("b", [nf])])) is nf
    two = ExceptionGroup("a", [nf, be])
    assert sole_exception(two) is two
    assert leaves(ExceptionGroup("a", [nf, ExceptionGroup("b", [be, bug])])) == [nf, be, bug]
    assert expected_error(nf) is nf
    assert expected_error(ExceptionGroup("a", [ExceptionGroup("b", [nf])])) is nf
    assert expected_error(two) is nf  # the first answers for all
    assert expected_error(ExceptionGroup("a", [nf, bug])) is None  # a bug among them
    assert expected_error(bug) is None
    assert isinstance(expected_error(be), TierfsError)
    assert is_cancellation(BaseExceptionGroup("c", [KeyboardInterrupt()]))
    assert not is_cancellation(BaseExceptionGroup("c", [KeyboardInterrupt(), bug]))


async def test_the_control_server_fails_the_start_or_is_supervised_after_it(autojump_clock):
    from tierfs.mount.daemon import _serve_control
    from tierfs.errors import StartupError

    class Control:
        def __init__(self, fail_at_start: bool) -> None:
            self.fail_at_start = fail_at_start
            self.runs = 0

        async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
            self.runs += 1
            if self.fail_at_start:
                raise StartupError("cannot listen")
            task_status.started()
            if self.runs < 3:
                raise RuntimeError("a bug after start")
            await trio.sleep_forever()

    metrics = Metrics()
    async with trio.open_nursery() as nursery:
        tasks = Tasks(nursery, metrics)
        with pytest.raises(BaseException) as info:  # the start-up error, as start() gives it
            await nursery.start(_serve_control, Control(True), tasks)
        assert isinstance(sole_exception(info.value), StartupError)
        control = Control(False)
        await nursery.start(_serve_control, control, tasks)
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    assert control.runs == 3
    assert errors(metrics, "control") == 2
