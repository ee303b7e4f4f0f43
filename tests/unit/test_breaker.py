"""CircuitBreaker: failures open it, one probe per cooldown, backoff on failed probes."""

from __future__ import annotations

import pytest

from router.breaker import CircuitBreaker
from tests.support.clock import ManualClock


def tripped(
    clock: ManualClock, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0
) -> CircuitBreaker:
    """A breaker with threshold 3 that just opened."""
    b = CircuitBreaker(3, cooldown_s, max_cooldown_s, clock=clock)
    for _ in range(b.failure_threshold):
        b.record_failure()
    assert b.state == "open"
    return b


def test_it_opens_after_exactly_threshold_consecutive_failures() -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(failure_threshold=3, clock=clock)
    b.record_failure()
    b.record_failure()
    assert (b.state, b.allow(), b.trips) == ("closed", True, 0)
    b.record_failure()
    assert (b.state, b.allow(), b.is_open(), b.trips) == ("open", False, True, 1)


def test_a_success_resets_the_consecutive_failure_count() -> None:
    b = CircuitBreaker(failure_threshold=3, clock=ManualClock(100.0))
    for _ in range(2):
        b.record_failure()
    b.record_success()
    for _ in range(2):
        b.record_failure()
    assert (b.state, b.consecutive_failures, b.trips) == ("closed", 2, 0)


def test_an_open_breaker_refuses_until_the_cooldown_passes() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 4.999
    assert (b.allow(), b.is_open()) == (False, True)
    clock.now += 0.001
    assert b.is_open() is False  # cooldown passed: not open, though no probe is claimed yet
    assert b.state == "open"


def test_after_the_cooldown_exactly_one_caller_gets_the_probe() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 5.0
    answers = [b.allow() for _ in range(5)]
    assert answers == [True, False, False, False, False]
    assert b.state == "half_open"
    assert b.is_open() is True  # the probe is out: everyone else is refused


def test_a_successful_probe_closes_and_resets_the_cooldown_to_base() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 5.0
    assert b.allow()
    b.record_failure()  # the first probe fails: cooldown doubles to 10
    clock.now += 10.0
    assert b.allow()
    b.record_success()
    assert (b.state, b.cooldown_s, b.trips) == ("closed", 5.0, 2)
    assert all(b.allow() for _ in range(3))
    for _ in range(3):  # next trip waits the base cooldown again
        b.record_failure()
    clock.now += 5.0
    assert b.allow()


def test_a_failed_probe_reopens_with_the_cooldown_doubled_up_to_the_max() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock, cooldown_s=5.0, max_cooldown_s=30.0)
    waited = []
    for _ in range(5):
        cooldown = b.cooldown_s
        clock.now += cooldown - 0.01
        assert b.allow() is False
        clock.now += 0.01
        assert b.allow() is True
        waited.append(cooldown)
        b.record_failure()
        assert b.state == "open"
    assert waited == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert b.trips == 6


def test_release_frees_the_probe_slot_without_a_verdict() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 5.0
    assert b.allow()
    b.release(b.probe)  # e.g. the probe request was a 400, or the client went away
    assert (b.state, b.cooldown_s, b.trips, b.probe) == ("open", 5.0, 1, 0)
    assert b.allow() is True  # no new cooldown: the next caller probes at once
    assert b.allow() is False


def test_release_outside_half_open_changes_nothing() -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(clock=clock)
    assert b.allow() and b.probe == 0  # closed: nothing claimed
    b.record_failure()
    b.release(b.probe)
    assert (b.state, b.consecutive_failures) == ("closed", 1)
    b = tripped(clock)
    b.release(b.probe)
    assert (b.state, b.allow()) == ("open", False)


def test_only_the_probes_holder_frees_its_slot() -> None:
    # A request sent while the breaker was closed (or anyway, every breaker open) ends without
    # a verdict while the probe is out: its wait for a busy connection ran out, or a 4xx.
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 5.0
    assert b.allow()
    holder = b.probe
    b.release(0)  # the ticket of a request that claimed nothing
    assert (b.state, b.allow()) == ("half_open", False)  # no second probe
    b.release(holder)
    assert b.allow() is True
    second = b.probe
    b.release(holder)  # the first probe's ticket is spent: the second probe stays out
    assert (b.state, b.probe, b.allow()) == ("half_open", second, False)
    b.record_success()
    assert (b.state, b.probe) == ("closed", 0)


def test_a_probe_ticket_is_spent_once_a_verdict_reopens_the_breaker() -> None:
    # The probe's holder outlives a verdict brought by an older request, and the next probe.
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 5.0
    assert b.allow()
    first = b.probe
    b.record_failure()  # an older request's failure, taken as the probe's: open again, x2
    clock.now += 10.0
    assert b.allow()
    b.release(first)
    assert (b.state, b.allow()) == ("half_open", False)


def test_verdicts_while_open_are_ignored() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    clock.now += 4.0
    b.record_failure()  # a late failure must not push the probe further away
    b.record_success()  # a late success from before the trip does not close it
    assert (b.state, b.trips, b.cooldown_s) == ("open", 1, 5.0)
    clock.now += 1.0
    assert b.allow() is True


def test_threshold_zero_disables_the_breaker() -> None:
    b = CircuitBreaker(failure_threshold=0, clock=ManualClock(100.0))
    for _ in range(100):
        b.record_failure()
    assert (b.state, b.allow(), b.is_open(), b.trips) == ("closed", True, False, 0)


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=-1)
    with pytest.raises(ValueError):
        CircuitBreaker(cooldown_s=10.0, max_cooldown_s=5.0)


def test_an_open_breaker_shows_its_probe_due_once_the_cooldown_passed_until_one_claims_it() -> None:
    clock = ManualClock(100.0)
    b = tripped(clock)
    assert b.status == "open"
    clock.advance(5.0)
    assert (b.state, b.status) == ("open", "probe_due")  # refuses nothing, claims nothing
    assert b.allow()
    assert b.status == "half_open"
    b.record_failure()  # the probe failed: open again, for twice the cooldown
    clock.advance(5.0)
    assert b.status == "open"
    clock.advance(5.0)
    assert b.status == "probe_due"


def test_each_opening_and_closing_is_one_line_naming_the_worker_and_the_cooldown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(2, 5.0, 60.0, clock=clock, name="http://w:8000")
    with caplog.at_level("WARNING", logger="router.breaker"):
        for _ in range(4):  # failures past the opening are ignored, and said nothing
            b.record_failure()
        clock.advance(5.0)
        assert b.allow()
        b.record_failure()  # the probe failed: open again, the cooldown doubled
        clock.advance(10.0)
        assert b.allow()
        b.record_success()
        b.record_success()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert said[0].startswith("circuit breaker of http://w:8000 opened (2 failed requests in a ")
    assert "no requests for 5 s" in said[0]
    assert "(its probe request failed)" in said[1] and "no requests for 10 s" in said[1]
    assert said[2] == "circuit breaker of http://w:8000 closed: its probe request succeeded"
