"""The tracker module's stateless helpers: one fetch's timeout, the below-floor warning, and
the log-level decision for failed peer attempts (reference-bootstrap.md 5.7 and 5.3)."""

from __future__ import annotations

import logging

import pytest

from peer.tracker import (
    ATTEMPT_LOG_EVERY,
    DEFAULT_FETCH_CAP_S,
    PER_FETCH_FLOOR_S,
    SUGGESTED_MIN_TIMEOUT_S,
    BootstrapTracker,
    PeerAttemptLog,
    TrackerError,
    below_floor_warning,
    per_fetch_timeout,
)

INFO, DEBUG = logging.INFO, logging.DEBUG

# -- per_fetch_timeout ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout_s", "cap_s", "per_fetch_s"),
    [
        (600.0, 300.0, 150.0),  # the defaults
        (20.0, 300.0, 10.0),  # the e2e manifest's 20 s: half the deadline
        (0.0, 300.0, 30.0),  # a zero deadline gets the floor
    ],
)
def test_defaults_give_150_s_a_20_s_deadline_10_s_and_zero_the_floor(
    timeout_s: float, cap_s: float, per_fetch_s: float
) -> None:
    assert per_fetch_timeout(timeout_s, cap_s) == per_fetch_s


@pytest.mark.parametrize("timeout_s", [0.001, 1.0, 20.0, 59.0, 60.0, 119.0, 600.0, 5000.0])
@pytest.mark.parametrize("cap_s", [30.0, 90.0, 300.0])
def test_snapshot_fetch_timeout_is_a_strict_fraction_of_every_nonzero_deadline(
    timeout_s: float, cap_s: float
) -> None:
    assert 0 < per_fetch_timeout(timeout_s, cap_s) < timeout_s


def test_snapshot_fetch_timeout_honours_the_configured_cap() -> None:
    assert per_fetch_timeout(600.0, 90.0) == 90.0
    assert per_fetch_timeout(5000.0, DEFAULT_FETCH_CAP_S) == 300.0
    assert per_fetch_timeout(5000.0) == 300.0, "the default cap applies without one"
    for timeout_s in (0.0, 1.0, 60.0, 600.0, 5000.0):
        assert per_fetch_timeout(timeout_s, 45.0) <= 45.0


def test_snapshot_fetch_timeout_floor_matches_the_config_minimum_cap() -> None:
    assert PER_FETCH_FLOOR_S == 30.0
    assert per_fetch_timeout(600.0, PER_FETCH_FLOOR_S) == 30.0
    assert per_fetch_timeout(0.0, PER_FETCH_FLOOR_S) == 30.0


@pytest.mark.parametrize("timeout_s", [60.0, 100.0, 119.0, 120.0])
def test_a_deadline_of_a_minute_or_more_affords_the_floor(timeout_s: float) -> None:
    assert per_fetch_timeout(timeout_s, 300.0) == 30.0


def test_a_cap_below_the_floor_still_caps_a_zero_deadline() -> None:
    assert per_fetch_timeout(0.0, 10.0) == 10.0


@pytest.mark.parametrize(("timeout_s", "cap_s"), [(-1.0, 300.0), (60.0, 0.0), (float("nan"), 1.0)])
def test_per_fetch_timeout_refuses_nonsense(timeout_s: float, cap_s: float) -> None:
    with pytest.raises(TrackerError):
        per_fetch_timeout(timeout_s, cap_s)


def test_the_tracker_reports_its_per_fetch_timeout() -> None:
    assert BootstrapTracker(600.0, clock=lambda: 0.0).fetch_timeout_s == 150.0
    assert BootstrapTracker(20.0, 300.0, clock=lambda: 0.0).fetch_timeout_s == 10.0


# -- below_floor_warning -------------------------------------------------------------------------


def test_below_floor_warning_fires_when_one_fetch_gets_less_than_the_floor() -> None:
    assert below_floor_warning(20.0, 300.0)
    assert not below_floor_warning(600.0, 300.0)
    assert not below_floor_warning(0.0, 300.0), "a zero deadline gets the floor"


def test_below_floor_warning_is_silent_when_bootstrap_is_off() -> None:
    assert not below_floor_warning(20.0, 300.0, enabled=False)


def test_raising_the_cap_cannot_lift_a_short_deadline_but_raising_the_timeout_does() -> None:
    assert below_floor_warning(20.0, 3000.0)
    assert not below_floor_warning(SUGGESTED_MIN_TIMEOUT_S, 300.0)
    assert per_fetch_timeout(SUGGESTED_MIN_TIMEOUT_S, 300.0) == PER_FETCH_FLOOR_S


# -- PeerAttemptLog ------------------------------------------------------------------------------


def levels(log: PeerAttemptLog, n: int, peer: str = "p", detail: str = "refused") -> list[int]:
    return [log.attempt(peer, "unreachable", detail).level for _ in range(n)]


def test_a_peers_first_failure_is_info_and_its_repeats_are_debug() -> None:
    log = PeerAttemptLog()
    assert levels(log, 5) == [INFO, DEBUG, DEBUG, DEBUG, DEBUG]


def test_every_hundredth_repeat_is_logged_at_info() -> None:
    log = PeerAttemptLog()
    seen = levels(log, 2 * ATTEMPT_LOG_EVERY)
    assert [i + 1 for i, level in enumerate(seen) if level == INFO] == [1, 100, 200]
    assert log.attempt("p", "unreachable", "refused").attempts == 201


def test_a_changed_error_detail_is_logged_at_info() -> None:
    log = PeerAttemptLog()
    levels(log, 3, detail="connection refused")
    assert log.attempt("p", "unreachable", "name not resolved") == (INFO, 4)
    assert log.attempt("p", "unreachable", "name not resolved") == (DEBUG, 5)
    assert log.attempt("p", "unreachable", "connection refused") == (INFO, 6)


def test_attempts_are_counted_per_peer_and_outcome() -> None:
    log = PeerAttemptLog()
    levels(log, 3, peer="p")
    assert log.attempt("q", "unreachable", "refused") == (INFO, 1)
    assert log.attempt("p", "rejected", "refused") == (INFO, 1)
    assert log.attempt("p", "unreachable", "refused") == (DEBUG, 4)


def test_forgetting_a_peer_starts_its_count_again() -> None:
    log = PeerAttemptLog()
    levels(log, 3, peer="p")
    log.attempt("p", "cold_peer")
    log.attempt("q", "unreachable", "refused")
    log.forget_peer("p")
    assert log.attempt("p", "unreachable", "refused") == (INFO, 1)
    assert log.attempt("p", "cold_peer") == (INFO, 1)
    assert log.attempt("q", "unreachable", "refused") == (DEBUG, 2)
