"""`peer.supervise`: the restart rule with an injected clock, and the shell that applies it."""

from __future__ import annotations

import asyncio
import logging

import pytest

from peer.supervise import (
    BACKOFF_MAX_S,
    FAILING_AFTER,
    STABLE_AFTER_S,
    Supervision,
    Supervisor,
    backoff_s,
)
from tests.support.clock import ManualClock


def test_the_backoff_doubles_from_half_a_second_to_a_cap() -> None:
    assert [backoff_s(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff_s(10_000) == BACKOFF_MAX_S


def test_a_task_is_failing_after_failures_in_a_row_and_recovers_after_a_stable_run() -> None:
    clock = ManualClock()
    s = Supervision("health")
    for n in range(1, FAILING_AFTER):
        s.started(clock())
        clock.advance(1)
        assert s.failed(clock(), "boom") == backoff_s(n)
        assert not s.failing(clock())
    s.started(clock())
    s.failed(clock(), "boom")
    assert s.failing(clock()) and s.last_error == "boom" and s.total == FAILING_AFTER
    s.started(clock())  # restarted: still failing until the run proves stable
    assert s.failing(clock())
    clock.advance(STABLE_AFTER_S)
    assert not s.failing(clock())
    # the next failure after a stable run starts the backoff over
    assert s.failed(clock(), "again") == backoff_s(1) and s.in_a_row == 1


def test_runs_shorter_than_stable_never_reset_the_count() -> None:
    clock = ManualClock()
    s = Supervision("loads")
    for _ in range(FAILING_AFTER):
        s.started(clock())
        clock.advance(STABLE_AFTER_S / 2)
        s.failed(clock(), "flaky")
    assert s.in_a_row == FAILING_AFTER and s.failing(clock())


class RecordedSleep:
    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.clock.advance(seconds)
        await asyncio.sleep(0)


async def test_a_failing_loop_is_restarted_with_backoff_and_counted() -> None:
    clock = ManualClock()
    sleep = RecordedSleep(clock)
    sup = Supervisor(clock=clock, sleep=sleep)
    runs = 0
    steady = asyncio.Event()

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise OSError(24, "Too many open files")
        steady.set()
        await asyncio.Event().wait()

    task = sup.spawn("health", "kvrouter-health", loop)
    await asyncio.wait_for(steady.wait(), 5)
    assert runs == 4 and sleep.delays == [0.5, 1.0, 2.0]
    assert sup.failures == {"health": 3}
    state = sup.state("kvrouter-health")
    assert state is not None and "Too many open files" in state.last_error
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sup.state("kvrouter-health") is None and sup.failures == {"health": 3}


async def test_the_same_error_in_a_row_is_logged_once_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    sup = Supervisor(clock=clock, sleep=RecordedSleep(clock))
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise RuntimeError("the same bug")
        if runs == 4:
            raise ValueError("another bug")

    with caplog.at_level(logging.ERROR, logger="peer.supervise"):
        await sup.spawn("loads", "kvrouter-loads", loop)  # the fifth run returns: done
    with_trace = [r for r in caplog.records if r.exc_info]
    assert [str(r.exc_info[1]) for r in with_trace] == ["the same bug", "another bug"]
    assert sum("failed again" in r.getMessage() for r in caplog.records) == 2
    assert runs == 5 and sup.failures == {"loads": 4}


async def test_a_run_that_returns_is_not_restarted() -> None:
    sup = Supervisor()
    runs = 0

    async def once() -> None:
        nonlocal runs
        runs += 1

    await sup.spawn("subscriber", "kv-sub x", once)
    assert runs == 1 and sup.failures == {} and sup.state("kv-sub x") is None


async def test_cancelling_during_the_backoff_is_not_a_failure() -> None:
    clock = ManualClock()
    parked = asyncio.Event()

    async def sleep(seconds: float) -> None:
        parked.set()
        await asyncio.Event().wait()

    sup = Supervisor(clock=clock, sleep=sleep)

    async def boom() -> None:
        raise RuntimeError("once")

    task = sup.spawn("discovery", "endpointslices workers", boom)
    await asyncio.wait_for(parked.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sup.failures == {"discovery": 1}


async def test_failing_lists_tasks_that_cannot_be_kept_alive_with_their_error() -> None:
    clock = ManualClock()
    sup = Supervisor(clock=clock, sleep=RecordedSleep(clock))
    failed_enough = asyncio.Event()
    runs = 0

    async def hopeless() -> None:
        nonlocal runs
        runs += 1
        if runs >= FAILING_AFTER:
            failed_enough.set()
        raise OSError("Too many open files")

    tasks = [
        sup.spawn("health", "kvrouter-health", hopeless),
        sup.spawn("subscriber", "kv-sub w#dp0", hopeless, critical=False),
    ]
    await asyncio.wait_for(failed_enough.wait(), 5)
    for _ in range(FAILING_AFTER * 2):
        await asyncio.sleep(0)
    failing = {t.name: t for t in sup.failing()}
    assert set(failing) == {"kvrouter-health", "kv-sub w#dp0"}
    assert failing["kvrouter-health"].critical and not failing["kv-sub w#dp0"].critical
    assert "Too many open files" in failing["kvrouter-health"].error
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_a_contained_failure_is_counted_without_restarting_anything() -> None:
    sup = Supervisor()
    sup.failed("health", "health verdict for http://w:1", OSError("boom"))
    assert sup.failures == {"health": 1} and sup.failing() == []
