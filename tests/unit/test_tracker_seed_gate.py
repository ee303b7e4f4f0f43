"""BootstrapTracker's seed gate (`--kv-bootstrap-seed-required`) and `admit_ready`.

Reference-bootstrap.md 5.3 (seed gate, admit_ready) and 7.1; the seed-gate half of the Tracker
inventory in section 11.
"""

from __future__ import annotations

import pytest

from cachetree.ranks import RankId
from peer.tracker import (
    BootstrapState,
    BootstrapTracker,
    NoticeKind,
    SweepOutcome,
    TrackerError,
    seed_gate_timeout,
)
from tests.support.clock import ManualClock

A = RankId("http://a:8000", 0)
B = RankId("http://b:8000", 0)
RECOVERED, FAILED = BootstrapState.RECOVERED, BootstrapState.FAILED


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def gated(clock: ManualClock, timeout_s: float = 20.0) -> BootstrapTracker:
    """A seed-required tracker with A registered and already terminal, so only the gate waits."""
    t = BootstrapTracker(timeout_s, seed_required=True, clock=clock)
    t.register([A])
    t.set(A, RECOVERED)
    assert t.settled()
    return t


@pytest.mark.parametrize("verdict", [SweepOutcome.NO_PEERS, SweepOutcome.FLEET_COLD])
@pytest.mark.parametrize("peers_tried", [0, 3])
def test_seed_gate_never_closes_on_a_nothing_to_inherit_verdict(
    clock: ManualClock, verdict: SweepOutcome, peers_tried: int
) -> None:
    t = gated(clock)
    t.record_sweep_result(verdict, peers_tried)
    assert not t.seed_failed
    assert t.seed_gate_open(), "an unready sibling leaves the slice: gating would deadlock"
    assert t.admit_ready()


def test_seed_gate_closes_only_on_timed_out_over_a_non_empty_candidate_set(
    clock: ManualClock,
) -> None:
    t = gated(clock)
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 0)
    assert not t.seed_failed, "no candidates: a discovery race, not a failed seed"
    assert t.seed_gate_open()

    t = gated(clock)
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 2)
    assert t.seed_failed
    assert not t.seed_gate_open()
    assert not t.admit_ready()


def test_seed_gate_reopens_when_a_later_sweep_finds_a_snapshot(clock: ManualClock) -> None:
    t = gated(clock)
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 2)
    t.record_sweep_result(SweepOutcome.RANKS_RESOLVED, 0)
    assert not t.seed_gate_open(), "only `found` clears a failed seed"
    t.record_sweep_result(SweepOutcome.FOUND, 1)
    assert not t.seed_failed
    assert t.seed_gate_open()
    assert t.admit_ready()


def test_seed_gate_is_inert_unless_required(clock: ManualClock) -> None:
    t = BootstrapTracker(20.0, clock=clock)
    t.register([A])
    assert t.seed_gate_open(), "no verdict is needed either"
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 3)
    assert t.seed_failed, "the gauge still reports it"
    assert t.seed_gate_open()
    t.set(A, FAILED)
    assert t.admit_ready()


def test_seed_gate_latches_open_once_readiness_has_passed(clock: ManualClock) -> None:
    t = gated(clock)
    t.record_sweep_result(SweepOutcome.FOUND, 1)
    assert t.admit_ready()
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 4)  # a late sweep for a scaled-up worker
    assert t.seed_failed
    assert t.seed_gate_open()
    assert t.admit_ready(), "a serving replica is never un-readied"


def test_seed_gate_opens_when_the_hard_bound_expires(clock: ManualClock) -> None:
    t = gated(clock, timeout_s=20.0)  # bound: max(3 x 20 s, 60 s) = 60 s from registration
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 1)
    clock.advance(59.999)
    assert not t.seed_gate_open()
    assert t.take_notices() == []
    clock.advance(0.001)
    assert t.seed_gate_open()
    [notice] = t.take_notices()
    assert notice.kind is NoticeKind.SEED_GATE_EXPIRED
    assert "60 s" in notice.message
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 1)
    assert t.seed_gate_open(), "the expiry latches"
    assert t.take_notices() == [], "and warns once"


def test_disabled_tracker_never_gates(clock: ManualClock) -> None:
    t = BootstrapTracker.disabled(clock=clock)
    assert t.seed_gate_open()
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 5)
    assert t.seed_gate_open()
    assert t.admit_ready()


@pytest.mark.parametrize(
    ("timeout_s", "bound_s"),
    [(300.0, 900.0), (1.0, 60.0), (600.0, 1800.0), (20.0, 60.0), (0.0, 60.0), (21.0, 63.0)],
)
def test_seed_gate_timeout_scales_and_floors(timeout_s: float, bound_s: float) -> None:
    assert seed_gate_timeout(timeout_s) == bound_s


def test_the_seed_gate_bound_is_re_armed_at_first_registration(clock: ManualClock) -> None:
    t = BootstrapTracker(20.0, seed_required=True, clock=clock)
    clock.advance(50.0)  # discovery is slow; the construction-time bound is nearly spent
    t.register([A])
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 2)
    clock.advance(59.0)
    assert not t.seed_gate_open(), "the bound now runs from the registration"
    clock.advance(1.0)
    assert t.seed_gate_open()


def test_a_seed_bound_that_expires_before_registration_does_not_open_the_gate_early(
    clock: ManualClock,
) -> None:
    t = BootstrapTracker(20.0, seed_required=True, clock=clock)
    clock.advance(100.0)
    assert t.seed_gate_open(), "nothing registered, nothing to wait for"
    t.register([A])
    t.set(A, RECOVERED)
    assert not t.seed_gate_open(), "the registration re-armed the bound; the boot sweep is due"


def test_seed_gate_holds_until_the_boot_sweep_reports(clock: ManualClock) -> None:
    t = gated(clock)
    assert not t.seed_gate_open(), "every rank is terminal, but no sweep verdict yet"
    assert not t.admit_ready()
    t.record_sweep_result(SweepOutcome.FOUND, 1)
    assert t.seed_gate_open()
    assert t.admit_ready()


def test_seed_gate_does_not_wait_for_a_sweep_that_cannot_run(clock: ManualClock) -> None:
    t = gated(clock)
    t.record_sweep_result(SweepOutcome.RANKS_RESOLVED, 0)  # every obligation left first
    assert t.seed_gate_open()
    assert t.admit_ready()


def test_first_registration_after_a_served_200_keeps_the_replica_ready(clock: ManualClock) -> None:
    t = BootstrapTracker(10.0, seed_required=True, clock=clock)
    clock.advance(10.0)
    assert t.admit_ready(), "expired before any worker appeared; /readyz answered 200"
    t.register([A])  # the re-arm comes after the 200
    assert t.is_pending(A)
    assert t.settled()
    assert t.seed_gate_open(), "no sweep verdict yet, but the gate has passed"
    assert t.admit_ready()


def test_admit_ready_waits_for_both_halves(clock: ManualClock) -> None:
    t = BootstrapTracker(20.0, seed_required=True, clock=clock)
    t.register([A, B])
    t.record_sweep_result(SweepOutcome.FOUND, 1)
    assert t.seed_gate_open() and not t.settled()
    assert not t.admit_ready(), "a rank is still pending"
    t.set(A, RECOVERED)
    t.set(B, FAILED)
    assert t.admit_ready()


def test_before_any_registration_the_gate_does_not_wait_for_a_verdict(clock: ManualClock) -> None:
    t = BootstrapTracker(20.0, seed_required=True, clock=clock)
    assert t.seed_gate_open()
    assert not t.settled(), "settled() still holds readiness until the deadline"


def test_sweep_verdicts_are_counted_for_metrics(clock: ManualClock) -> None:
    t = gated(clock)
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 2)
    t.record_sweep_result("found", 1)
    t.record_sweep_result(SweepOutcome.FOUND, 1)
    assert t.sweep_outcomes == {SweepOutcome.TIMED_OUT: 1, SweepOutcome.FOUND: 2}


def test_a_bad_sweep_report_raises_the_typed_error(clock: ManualClock) -> None:
    t = gated(clock)
    with pytest.raises(TrackerError):
        t.record_sweep_result(SweepOutcome.TIMED_OUT, -1)
    with pytest.raises(TrackerError, match="SweepOutcome"):
        t.record_sweep_result("cold", 1)
    assert t.sweep_outcomes == {}
