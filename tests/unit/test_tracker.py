"""BootstrapTracker: the per-rank machine, the readiness deadline, and the outcome tallies.

Reference-bootstrap.md 5.3 and the Tracker inventory of section 11. The seed gate is in
test_tracker_seed_gate.py; the stateless helpers are in test_tracker_helpers.py.
"""

from __future__ import annotations

import math
import random

import pytest

from cachetree.ranks import RankId
from peer.tracker import (
    DEFAULT_FETCH_CAP_S,
    FOREVER_S,
    FORGOTTEN_MEMORY,
    BootstrapState,
    BootstrapTracker,
    NoticeKind,
    Obligation,
    RankOutcome,
    SweepOutcome,
    TrackerError,
)
from tests.support.clock import ManualClock

A = RankId("http://a:8000", 0)
B = RankId("http://a:8000", 1)
C = RankId("http://c:8000", 0)
HOUR = 3600.0
PENDING, RECOVERED, FAILED = BootstrapState.PENDING, BootstrapState.RECOVERED, BootstrapState.FAILED


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def tracker(clock: ManualClock, timeout_s: float = HOUR) -> BootstrapTracker:
    return BootstrapTracker(timeout_s, clock=clock)


# -- the reference inventory (section 11, Tracker) ---------------------------------------------


def test_reregistration_after_forget_mints_a_new_epoch(clock: ManualClock) -> None:
    t = tracker(clock)
    [first] = t.register([A])
    assert t.register([A]) == [], "a registered rank's obligation is already held"
    assert t.epoch(A) == first.epoch, "a live rank keeps its incarnation"

    t.forget([A])
    assert t.epoch(A) is None
    [second] = t.register([A])
    assert second.epoch != first.epoch
    assert not t.is_owed(A, first.epoch), "the old incarnation is stale"
    assert t.is_owed(A, second.epoch)


def test_a_rank_registered_again_after_forget_rejoins_within_a_bounded_memory(
    clock: ManualClock,
) -> None:
    """A rejoin waits for a sweep of its own (`router.bootstrap.sweep_for`); a first
    registration rides the sweep in flight, and a long-gone rank counts as new again."""
    t = tracker(clock)
    t.register([A, B])
    assert not t.rejoins(A) and not t.rejoins(B)
    t.forget([A, B])
    t.forget([C])  # never registered: nothing to remember
    t.register([A, C])
    assert t.rejoins(A) and not t.rejoins(C)
    t.forget([A])
    assert not t.rejoins(A)
    others = [RankId(f"http://w{i}:8000", 0) for i in range(FORGOTTEN_MEMORY)]
    t.register(others)
    t.forget(others)  # A and B, forgotten before them, leave the memory
    t.register([A, B, others[-1]])
    assert t.rejoins(A) is False and t.rejoins(B) is False and t.rejoins(others[-1])


def test_tracker_settles_when_all_ranks_terminal(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A, B])
    assert not t.settled()
    t.set(A, RECOVERED)
    assert not t.settled(), "B is still pending"
    t.set(B, FAILED)
    assert t.settled(), "Failed is terminal: running cold is a valid end"


def test_fetch_cap_round_trips_through_the_tracker(clock: ManualClock) -> None:
    t = BootstrapTracker(120.0, 90.0, clock=clock)
    assert (t.timeout_s, t.fetch_cap_s) == (120.0, 90.0)
    assert BootstrapTracker(120.0, clock=clock).fetch_cap_s == DEFAULT_FETCH_CAP_S == 300.0


def test_tracker_settles_on_deadline_with_pending_ranks(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=0.0)
    t.register([A])
    assert t.settled(), "a zero timeout settles at once"
    assert t.state(A) is PENDING, "settling does not resolve the rank; the sweep's timeout does"


def test_the_deadline_falls_exactly_one_timeout_after_the_first_registration(
    clock: ManualClock,
) -> None:
    t = tracker(clock, timeout_s=20.0)
    t.register([A])
    clock.advance(19.999)
    assert not t.settled()
    clock.advance(0.001)
    assert t.settled()


def test_settling_with_pending_ranks_leaves_one_notice(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=20.0)
    t.register([A, B])
    t.set(B, RECOVERED)
    clock.advance(20.0)
    assert t.settled() and t.settled()
    [notice] = t.take_notices()
    assert notice.kind is NoticeKind.SETTLED_WITH_PENDING
    assert "1 rank(s) still pending" in notice.message
    assert t.take_notices() == [], "notices are handed out once"


def test_settling_with_every_rank_terminal_leaves_no_notice(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    assert t.settled()
    assert t.take_notices() == []


def test_tracker_with_no_ranks_is_not_settled_before_deadline(clock: ManualClock) -> None:
    t = tracker(clock)
    assert not t.settled()
    assert t.time_remaining() == HOUR, "the deadline is armed at construction"
    clock.advance(HOUR - 1)
    assert t.time_remaining() == 1.0
    assert not t.settled()


def test_tracker_never_registered_still_settles(clock: ManualClock) -> None:
    assert tracker(clock, timeout_s=0.0).settled()
    t = tracker(clock, timeout_s=10.0)
    clock.advance(10.0)
    assert t.settled(), "an idle replica must not wait forever"


def test_registration_keeps_the_deadline_armed(clock: ManualClock) -> None:
    t = tracker(clock)
    clock.advance(5.0)
    t.register([A])
    assert t.time_remaining() == HOUR
    assert not t.settled(), "a pending rank gates readiness"
    assert not t.admit_ready()


def test_disabled_tracker_is_settled_immediately(clock: ManualClock) -> None:
    t = BootstrapTracker.disabled(clock=clock)
    assert t.settled()
    assert t.admit_ready()
    assert (t.timeout_s, t.time_remaining()) == (0.0, 0.0)


def test_tracker_forget_removes_state(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    t.forget([A])
    assert (t.state(A), t.epoch(A)) == (None, None)
    assert not t.set(A, RECOVERED), "set never creates an entry"
    assert t.state(A) is None
    assert t.retry_after_gap(A) is None
    assert t.states() == {}


def test_a_premature_settle_does_not_disarm_the_gate(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=10.0)
    clock.advance(11.0)
    assert t.settled(), "an expiry before any registration still answers true"
    t.register([A])
    assert not t.settled(), "but it did not latch: the first registration re-armed"
    assert t.time_remaining() == 10.0
    clock.advance(10.0)
    assert t.settled()


def test_a_latched_tracker_stays_settled_across_a_later_registration(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, RECOVERED)
    assert t.settled()
    [late] = t.register([B])
    assert t.is_owed(B, late.epoch), "the late rank still bootstraps"
    assert t.any_pending()
    assert t.settled(), "a scale-up never un-readies"


def test_a_disabled_tracker_stays_settled_after_register(clock: ManualClock) -> None:
    t = BootstrapTracker.disabled(clock=clock)
    assert t.register([A]) == [], "a disabled tracker owes nothing"
    assert t.state(A) is None
    assert not t.any_pending()
    assert t.settled()


@pytest.mark.parametrize("absurd", [10**400, math.inf, 1e308], ids=["10**400", "inf", "1e308"])
def test_an_absurd_timeout_does_not_panic(clock: ManualClock, absurd: float) -> None:
    t = BootstrapTracker(absurd, seed_required=True, clock=clock)
    t.register([A])
    assert not t.settled()
    assert t.timeout_s == FOREVER_S, "clamped to effectively never"
    assert t.time_remaining() == FOREVER_S
    assert t.fetch_timeout_s == DEFAULT_FETCH_CAP_S
    t.record_sweep_result(SweepOutcome.TIMED_OUT, 1)
    clock.advance(2 * FOREVER_S)
    assert not t.seed_gate_open(), "the seed bound is three times 'never'"
    clock.advance(FOREVER_S)
    assert t.seed_gate_open(), "and still finite"


def test_retry_after_gap_is_one_shot_per_incarnation(clock: ManualClock) -> None:
    t = tracker(clock)
    [ob] = t.register([A])
    assert t.retry_after_gap(A) is None, "not from Pending"
    t.set(A, RECOVERED)
    assert t.retry_after_gap(A) is None, "not from Recovered"
    t.set(A, FAILED)
    assert t.retry_after_gap(A) == ob, "from Failed: Pending again, under the same epoch"
    assert t.state(A) is PENDING and t.is_owed(A, ob.epoch)
    t.set(A, FAILED)
    assert t.retry_after_gap(A) is None, "only once per incarnation"
    assert t.state(A) is FAILED

    t.forget([A])
    [again] = t.register([A])
    t.set(A, FAILED)
    assert t.retry_after_gap(A) == again, "forget gives the new incarnation its own retry"


def test_enabled_survives_settling_so_late_workers_still_bootstrap(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=0.0)
    t.register([A])
    assert t.settled()
    assert t.enabled
    assert t.register([B]) == [Obligation(B, t.epoch(B))]


def test_disabled_tracker_is_not_enabled(clock: ManualClock) -> None:
    assert not BootstrapTracker.disabled(clock=clock).enabled
    assert tracker(clock).enabled


def test_time_remaining_saturates_to_zero_once_expired(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=10.0)
    t.register([A])
    clock.advance(4.0)
    assert t.time_remaining() == 6.0
    clock.advance(21.0)
    assert t.time_remaining() == 0.0


# -- the deadline's one-shot re-arm ------------------------------------------------------------


def test_a_remove_and_re_add_flap_does_not_re_arm_the_deadline(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=100.0)
    clock.advance(50.0)
    t.register([A])  # the one re-arm: the deadline is now 100 s away
    clock.advance(60.0)
    t.forget([A])
    t.register([A])  # the map was empty again, but the flag is spent
    assert t.time_remaining() == 40.0
    clock.advance(40.0)
    assert t.settled()


def test_an_empty_registration_does_not_spend_the_re_arm(clock: ManualClock) -> None:
    t = tracker(clock, timeout_s=100.0)
    clock.advance(30.0)
    assert t.register([]) == []
    assert t.time_remaining() == 70.0
    t.register([A])
    assert t.time_remaining() == 100.0


# -- registration, set, ownership --------------------------------------------------------------


def test_register_issues_one_obligation_per_new_rank_with_fresh_epochs(clock: ManualClock) -> None:
    t = tracker(clock)
    first = t.register([A, B])
    assert [o.rank for o in first] == [A, B]
    assert first[0].epoch != first[1].epoch
    second = t.register([A, C, C])
    assert [o.rank for o in second] == [C], "present ranks and repeats yield nothing"
    assert len({o.epoch for o in first + second}) == 3
    assert {r: t.state(r) for r in (A, B, C)} == {A: PENDING, B: PENDING, C: PENDING}


def test_set_never_creates_an_entry(clock: ManualClock) -> None:
    t = tracker(clock)
    assert not t.set(A, RECOVERED)
    assert t.state(A) is None and t.epoch(A) is None
    [ob] = t.register([A])
    assert t.state(A) is PENDING and t.is_owed(A, ob.epoch), "register starts it over"


def test_set_refuses_to_make_a_rank_pending(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    for pending in (PENDING, "pending"):
        with pytest.raises(TrackerError, match="Pending"):
            t.set(A, pending)
    assert t.state(A) is FAILED


def test_set_takes_state_labels_and_refuses_unknown_ones(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    assert t.set(A, "recovered") and t.state(A) is RECOVERED
    assert t.set(A, "failed") and t.state(A) is FAILED
    with pytest.raises(TrackerError, match="BootstrapState"):
        t.set(A, "warm")


def test_a_rank_is_owed_only_while_present_pending_and_under_the_same_epoch(
    clock: ManualClock,
) -> None:
    t = tracker(clock)
    [ob] = t.register([A])
    assert t.is_owed(A, ob.epoch)
    assert not t.is_owed(A, ob.epoch + 1), "another incarnation's message"
    assert not t.is_owed(B, ob.epoch), "a rank never registered"
    t.set(A, RECOVERED)
    assert not t.is_owed(A, ob.epoch), "no longer pending"
    t.forget([A])
    assert not t.is_owed(A, ob.epoch), "forgotten"


def test_still_owed_keeps_each_pending_incarnation_once_in_order(clock: ManualClock) -> None:
    t = tracker(clock)
    a, b, c = t.register([A, B, C])
    t.set(B, RECOVERED)
    stale = Obligation(C, c.epoch + 100)
    assert t.still_owed([c, a, b, c, stale, a]) == [c, a]


def test_any_pending_follows_the_pending_ranks(clock: ManualClock) -> None:
    t = tracker(clock)
    assert not t.any_pending()
    t.register([A, B])
    t.set(A, RECOVERED)
    assert t.any_pending()
    t.set(B, FAILED)
    assert not t.any_pending()
    t.retry_after_gap(B)
    assert t.any_pending()


# -- outcomes ----------------------------------------------------------------------------------


def test_an_outcome_is_counted_once_per_incarnation(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    assert t.record_outcome(A, RankOutcome.ABANDONED)
    assert not t.record_outcome(A, RankOutcome.GAP), "a second verdict is ignored"
    assert not t.record_outcome(A, RankOutcome.ABANDONED)
    assert t.recorded_outcome(A) is RankOutcome.ABANDONED
    assert t.rank_outcomes == {RankOutcome.ABANDONED: 1}


def test_a_new_incarnation_gets_its_own_outcome(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, RECOVERED)
    t.record_outcome(A, RankOutcome.FROM_ORIGIN)
    t.forget([A])
    assert t.recorded_outcome(A) is None
    t.register([A])
    t.set(A, RECOVERED)
    assert t.record_outcome(A, "warm"), "labels are accepted as strings"
    assert t.rank_outcomes == {RankOutcome.FROM_ORIGIN: 1, RankOutcome.WARM: 1}


def test_a_granted_gap_retry_records_nothing_and_its_final_verdict_counts_once(
    clock: ManualClock,
) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, RECOVERED)  # grafted; the splice is not proven yet
    t.set(A, FAILED)  # the stream did not join up
    assert t.retry_after_gap(A) is not None
    assert t.rank_outcomes == {}
    t.set(A, RECOVERED)  # the retry's graft
    assert t.record_outcome(A, RankOutcome.WARM)
    assert t.rank_outcomes == {RankOutcome.WARM: 1}


def test_a_verdict_for_a_pending_rank_is_refused(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    with pytest.raises(TrackerError, match="Pending"):
        t.record_outcome(A, RankOutcome.GAP)
    t.set(A, FAILED)
    t.retry_after_gap(A)  # a granted retry that the caller then fails to queue...
    with pytest.raises(TrackerError, match="Pending"):
        t.record_outcome(A, RankOutcome.GAP)  # ...must set Failed before counting `gap`
    t.set(A, FAILED)
    assert t.record_outcome(A, RankOutcome.GAP)


def test_a_verdict_for_a_forgotten_rank_is_not_counted(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.forget([A])
    assert not t.record_outcome(A, RankOutcome.ABANDONED)
    assert t.rank_outcomes == {}


def test_an_unknown_outcome_label_is_refused(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    with pytest.raises(TrackerError, match="RankOutcome"):
        t.record_outcome(A, "cold")


def test_a_gap_retry_is_refused_once_the_incarnation_has_its_outcome(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    t.record_outcome(A, RankOutcome.ABANDONED)
    assert t.retry_after_gap(A) is None
    assert t.state(A) is FAILED


def test_the_tallies_handed_out_are_copies(clock: ManualClock) -> None:
    t = tracker(clock)
    t.register([A])
    t.set(A, FAILED)
    t.record_outcome(A, RankOutcome.OVERFLOW)
    t.rank_outcomes[RankOutcome.OVERFLOW] += 5
    t.states()[A] = RECOVERED
    assert t.rank_outcomes == {RankOutcome.OVERFLOW: 1}
    assert t.states() == {A: FAILED}


# -- labels, gauge values, settings ------------------------------------------------------------


def test_states_carry_the_gauge_values_of_the_reference() -> None:
    assert [(s.value, s.gauge) for s in BootstrapState] == [
        ("pending", 0),
        ("recovered", 1),
        ("failed", 2),
    ]


def test_outcome_labels_are_the_reference_label_values() -> None:
    assert {o.value for o in RankOutcome} == {
        "warm",
        "gap",
        "warm_unwitnessed",
        "uncovered",
        "abandoned",
        "overflow",
        "publisher_reset",
        "tree_rejected",
        "from_origin",
    }
    assert [o.value for o in SweepOutcome] == [
        "found",
        "no_peers",
        "fleet_cold",
        "timed_out",
        "ranks_resolved",
    ]


@pytest.mark.parametrize(
    ("timeout_s", "cap_s"),
    [(-1.0, 300.0), (math.nan, 300.0), (-math.inf, 300.0), (60.0, 0.0), (60.0, -5.0)],
)
def test_nonsense_settings_raise_the_typed_error(
    clock: ManualClock, timeout_s: float, cap_s: float
) -> None:
    with pytest.raises(TrackerError):
        BootstrapTracker(timeout_s, cap_s, clock=clock)


# -- the whole contract under random interleavings ---------------------------------------------


@pytest.mark.parametrize("seed", range(64))
def test_the_contract_holds_under_random_interleavings(seed: int) -> None:
    """Latches never unlatch; owed means Pending; one counted outcome per incarnation."""
    rng = random.Random(seed)
    clock = ManualClock()
    t = BootstrapTracker(rng.choice([0.0, 5.0, 30.0]), seed_required=True, clock=clock)
    ranks = [RankId(f"http://w{i}", d) for i in range(3) for d in range(2)]
    counted: set[tuple[RankId, int]] = set()
    epochs_seen: list[int] = []
    was_settled = was_admitted = False
    for _ in range(200):
        rank = rng.choice(ranks)
        op = rng.randrange(8)
        if op == 0:
            epochs_seen += [o.epoch for o in t.register(rng.sample(ranks, rng.randint(0, 3)))]
        elif op == 1:
            t.forget([rank])
        elif op == 2:
            t.set(rank, rng.choice([RECOVERED, FAILED]))
        elif op == 3:
            retry = t.retry_after_gap(rank)
            assert retry is None or (retry.epoch == t.epoch(rank) and t.is_pending(rank))
        elif op == 4:
            epoch = t.epoch(rank)
            if not t.is_pending(rank) and t.record_outcome(rank, rng.choice(list(RankOutcome))):
                assert (rank, epoch) not in counted, "a second outcome for one incarnation"
                counted.add((rank, epoch))
        elif op == 5:
            t.record_sweep_result(rng.choice(list(SweepOutcome)), rng.randint(0, 2))
        elif op == 6:
            clock.advance(rng.choice([0.5, 3.0, 20.0]))
        else:
            settled, admitted = t.settled(), t.admit_ready()
            assert settled or not was_settled, "settled() un-latched"
            assert admitted or not was_admitted, "admit_ready() un-latched"
            was_settled |= settled
            was_admitted |= admitted
        for r in ranks:
            epoch = t.epoch(r)
            assert (t.state(r) is None) == (epoch is None)
            if epoch is not None:
                assert t.is_owed(r, epoch) == (t.state(r) is PENDING)
        assert sum(t.rank_outcomes.values()) == len(counted)
    assert epochs_seen == sorted(set(epochs_seen)), "epochs are fresh and increasing"
