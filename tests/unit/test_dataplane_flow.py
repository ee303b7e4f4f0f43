"""Flow control and timers of the data plane, driven by a fake clock and transport."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from router.dataplane.flow import (
    PEER_BACKPRESSURE,
    PIPELINED,
    STALL_CHECKS,
    Deadline,
    ReadGate,
    WriteStall,
)
from router.log_tally import LogTally


@dataclass(order=True)
class _Handle:
    when_: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def when(self) -> float:
        return self.when_

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """`time`, `call_at` and a clock that advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[_Handle] = []
        self.scheduled = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        self.scheduled += 1
        handle = _Handle(when, self.scheduled, callback)
        heapq.heappush(self.handles, handle)
        return handle

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self.handles and self.handles[0].when_ <= self.now:
            handle = heapq.heappop(self.handles)
            if not handle.cancelled:
                handle.callback()


def deadline() -> tuple[FakeLoop, Deadline, list[float]]:
    loop = FakeLoop()
    fired: list[float] = []
    return loop, Deadline(loop, lambda: fired.append(loop.now)), fired  # type: ignore[arg-type]


def test_a_deadline_fires_once_when_it_passes() -> None:
    loop, d, fired = deadline()
    assert not d.pending
    d.set(1.0)
    loop.advance(0.9)
    assert fired == [] and d.pending
    loop.advance(0.2)
    loop.advance(5)
    assert fired == [1.1] and not d.pending


def test_moving_a_deadline_later_makes_no_new_timer_until_the_old_one_fires() -> None:
    loop, d, fired = deadline()
    d.set(1.0)
    for _ in range(100):  # every chunk of a stream moves the idle deadline
        loop.advance(0.005)
        d.set(1.0)
    assert loop.scheduled == 1
    loop.advance(0.6)  # t=1.1: the first handle fired early and re-armed for t=1.5
    assert fired == [] and loop.scheduled == 2
    loop.advance(0.5)
    assert len(fired) == 1 and 1.5 <= fired[0] < 1.7


def test_moving_a_deadline_earlier_replaces_its_timer() -> None:
    loop, d, fired = deadline()
    d.set(10.0)
    d.set(1.0)
    loop.advance(1.0)
    assert fired == [1.0]
    loop.advance(20)
    assert fired == [1.0]


def test_a_cancelled_deadline_never_fires_and_a_later_one_still_does() -> None:
    loop, d, fired = deadline()
    d.set(1.0)
    d.cancel()
    assert not d.pending
    loop.advance(2.0)
    assert fired == []
    d.set(1.0)
    loop.advance(1.0)
    assert fired == [3.0]
    d.set(1.0)
    d.cancel()
    loop.advance(5.0)
    assert fired == [3.0]


class FakeTransport:
    def __init__(self) -> None:
        self.reading = True
        self.calls: list[str] = []

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        self.reading = False
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.reading = True
        self.calls.append("resume")


def test_reading_resumes_only_when_every_reason_to_pause_is_gone() -> None:
    transport = FakeTransport()
    gate = ReadGate(transport)  # type: ignore[arg-type]
    gate.pause(PEER_BACKPRESSURE)
    gate.pause(PIPELINED)
    gate.pause(PIPELINED)
    gate.resume(PEER_BACKPRESSURE)
    assert not transport.reading and gate.paused
    gate.resume(PEER_BACKPRESSURE)  # not paused for it any more: nothing
    gate.resume(PIPELINED)
    assert transport.reading and not gate.paused
    assert transport.calls == ["pause", "resume"]


def test_a_tally_says_the_first_event_then_the_rest_at_most_once_an_interval() -> None:
    tally = LogTally(10.0)
    assert tally.count(100.0) == 1  # the first is said at once
    assert [tally.count(t) for t in (101.0, 105.0, 109.9)] == [0, 0, 0]
    assert tally.count(110.0) == 4  # the three held back and this one
    assert tally.count(111.0, events=5) == 0
    assert tally.count(125.0, events=2) == 7  # a pass's crowd counts whole


def run_stall(timeout_s: float, sent_at: Callable[[float], int], until: float) -> float | None:
    """When `WriteStall` calls a client stalled (None: not by `until`), checked as the
    connection checks it: first at its pause, at t=0, then at each delay it gives."""
    rule = WriteStall(timeout_s)
    now = 0.0
    delay: float | None = rule.start(now, sent_at(now))
    while delay is not None:
        now += delay
        if now > until:
            return None
        delay = rule.check(now, sent_at(now))
    return now


def test_a_paused_client_that_takes_nothing_is_stalled_at_the_timeout() -> None:
    assert run_stall(60.0, lambda t: 1000, until=600) == 60.0


def test_a_slow_client_that_keeps_taking_bytes_is_never_stalled() -> None:
    # 16 B/s, seen a byte count at a time: every check finds more gone.
    assert run_stall(60.0, lambda t: int(16 * t), until=3600) is None
    # Its window opens in steps (a small receive buffer): each under a timeout apart.
    assert run_stall(60.0, lambda t: 2048 * int(t // 50), until=3600) is None


def test_a_client_that_stops_reading_is_stalled_within_a_check_of_the_timeout() -> None:
    stopped = 100.0
    at = run_stall(60.0, lambda t: int(16 * min(t, stopped)), until=3600)
    assert at is not None
    assert stopped + 60.0 <= at <= stopped + 60.0 * (1 + 1 / STALL_CHECKS)
