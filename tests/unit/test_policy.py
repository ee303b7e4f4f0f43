"""Routing policies: who comes first, at what cost, and with which outcome label.

The prefix depths come from a real BlockTree. The prompt is 2,048 tokens = 128 blocks of 16;
with the default weights a full cache hit is worth 2048 / 256 = 8 queued requests.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE, HOST
from cachetree.tree import BlockTree
from router.loads import EngineLoad
from router.policy import (
    POLICY_NAMES,
    CacheAware,
    CacheAwareWeights,
    Candidate,
    Prompt,
    RoundRobin,
    assumed_capacities,
    load_of,
    make_policy,
)
from router.pressure import PressureLedger, PressureSettings
from tests.support.clock import ManualClock

BS = 16
A, B, C, D = (RankId(f"http://{h}:8000", 0) for h in "abcd")
PROMPT = [(i * 7919) % 50_000 + 3 for i in range(2048)]
KEYS = block_keys(PROMPT, BS)
assert len(KEYS) == 128


class Fleet:
    """A block tree plus the candidates built from it."""

    def __init__(self) -> None:
        self.tree = BlockTree(BS)
        self._next_hash = 1

    def hold(
        self, rank: RankId, blocks: int, tier: int = DEVICE, tokens: list[int] = PROMPT
    ) -> list[int]:
        hashes = list(range(self._next_hash, self._next_hash + blocks))
        self._next_hash += blocks
        self.tree.store(rank, None, hashes, tokens[: blocks * BS], BS, tier=tier)
        return hashes

    def prompt(self, tokens: list[int] = PROMPT) -> Prompt:
        return Prompt(len(tokens), BS, self.tree.prefix_depths(block_keys(tokens, BS)))


def cand(rank: RankId, inflight: int = 0, waiting: int | None = None) -> Candidate:
    engine = None if waiting is None else EngineLoad(running=0, waiting=waiting, kv_usage=0.1)
    return Candidate(rank, inflight, engine)


def heads(ranked: list[Candidate]) -> list[RankId]:
    return [c.rank for c in ranked]


# --- cache_aware ----------------------------------------------------------------------------


def test_requests_sharing_a_long_prefix_go_to_the_rank_holding_it() -> None:
    fleet = Fleet()
    fleet.hold(C, 128)
    fleet.hold(A, 2)  # a short shared system prompt elsewhere
    policy = CacheAware(rng=random.Random(1))
    candidates = [cand(A), cand(B), cand(C), cand(D)]
    for suffix in ([1, 2, 3] * 40, [9] * 100):  # two requests, same 2,048-token prefix
        tokens = PROMPT + suffix
        decision = policy.decide(candidates, fleet.prompt(tokens))
        assert heads(decision.ranked)[:2] == [C, A]
        assert (decision.outcome, decision.matched_blocks) == ("cache_hit", 128)
    costs = policy.costs(candidates, fleet.prompt())
    assert costs == [2048 - 32, 2048, 0, 2048]


@pytest.mark.parametrize(
    ("queued", "first", "holder_cost"),
    [
        (7, A, 1792.0),  # 7 x 256 < 2048: the cache is worth the wait
        (8, B, 2048.0),  # equal cost: the lower load wins
        (9, B, 2304.0),  # 9 x 256 > 2048: the idle rank prefills faster than A's queue drains
    ],
)
def test_a_holder_with_a_long_queue_loses_to_an_idle_rank_when_the_cost_says_so(
    queued: int, first: RankId, holder_cost: float
) -> None:
    fleet = Fleet()
    fleet.hold(A, 128)
    policy = CacheAware(rng=random.Random(1))
    # The queue is router in-flight plus engine waiting: 3 + (queued - 3).
    candidates = [cand(A, inflight=3, waiting=queued - 3), cand(B)]
    assert policy.costs(candidates, fleet.prompt()) == [holder_cost, 2048.0]
    decision = policy.decide(candidates, fleet.prompt())
    assert decision.ranked[0].rank == first
    assert decision.outcome == ("cache_hit" if first == A else "cache_miss")
    assert decision.matched_blocks == (128 if first == A else 0)


@pytest.mark.parametrize(
    ("inflight", "waiting", "slots", "priced"),
    [
        (1, 0, None, 1.0),  # the engine states no slots (vLLM): the whole load is priced
        (1, 0, 1, 1.0),  # one slot: the request running holds the next one back
        (1, 0, 2, 0.25),  # a free slot: the one running is beside it, a quarter
        (2, 0, 2, 1.25),  # slots full: it waits behind one, the other runs beside it
        (3, 1, 2, 3.25),  # a load of 4 on 2 slots: behind 3
        (5, 0, 8, 1.25),  # 5 running of 8 slots: a quarter each
        (0, 0, 2, 0.0),
    ],
)
def test_the_queue_term_prices_whole_only_the_requests_a_new_one_would_wait_behind(
    inflight: int, waiting: int, slots: int | None, priced: float
) -> None:
    fleet = Fleet()
    fleet.hold(A, 128)
    policy = CacheAware()
    engine = EngineLoad(running=min(inflight, slots or 1), waiting=waiting, slots=slots)
    candidates = [Candidate(A, inflight, engine), cand(B)]
    assert policy.costs(candidates, fleet.prompt()) == [256.0 * priced, 2048.0]


@pytest.mark.parametrize(("slots", "first"), [(None, B), (2, A)])
def test_a_holder_running_one_request_with_a_slot_free_keeps_a_short_prefix(
    slots: int | None, first: RankId
) -> None:
    # An 8-block prefix saves 128 tokens of prefill: less than a queued request's 256, more
    # than a quarter of it. Stated slots tell which one the holder's request is.
    fleet = Fleet()
    fleet.hold(A, 8)
    policy = CacheAware(rng=random.Random(1))
    engine = EngineLoad(running=1, waiting=0, slots=slots)
    candidates = [Candidate(A, 1, engine), Candidate(B, 0, EngineLoad(0, 0, slots=slots))]
    decision = policy.decide(candidates, fleet.prompt())
    assert decision.ranked[0].rank == first
    assert decision.matched_blocks == (8 if first == A else 0)


@pytest.mark.parametrize(
    ("loads", "replicas", "holder_first", "costs"),
    [
        # Every rank idle but A (c=1): the plain cost. B would prefill 2048, A's queue is
        # 3 x 256.
        ((3, 0, 0, 0), 1, True, [768.0, 2048.0, 2048.0, 2048.0]),
        # The fleet busy, A 9 ahead of the rest: without this rule B wins (2048 + 3 x 256 <
        # 12 x 256); with the others at 3, a queued request counts 256 / (1 + 3) = 64.
        ((12, 3, 3, 3), 1, True, [768.0, 2240.0, 2240.0, 2240.0]),
        # One hot rank does not make the fleet busy (the busiest rank is left out of the
        # mean): A's queue of 9 loses to an idle rank's prefill as it did without the rule.
        ((9, 0, 0, 0), 1, False, [2304.0, 2048.0, 2048.0, 2048.0]),
        # With k replicas each sees 1/k of a rank's in-flight: a mean of 1 stands for 3.
        ((4, 1, 1, 1), 3, True, [256.0, 2112.0, 2112.0, 2112.0]),
        # Two busy ranks of four: the mean without the busiest is (9 + 0 + 0) / 3 = 3.
        ((9, 9, 0, 0), 1, True, [576.0, 2624.0, 2048.0, 2048.0]),
    ],
)
def test_a_queued_request_counts_for_less_when_the_typical_rank_is_busy(
    loads: tuple[int, ...], replicas: int, holder_first: bool, costs: list[float]
) -> None:
    fleet = Fleet()
    fleet.hold(A, 128)
    policy = CacheAware(rng=random.Random(1), replicas=lambda: replicas)
    candidates = [cand(r, inflight=q) for r, q in zip((A, B, C, D), loads, strict=True)]
    assert policy.costs(candidates, fleet.prompt()) == costs
    assert (policy.decide(candidates, fleet.prompt()).ranked[0].rank == A) is holder_first
    # backlog=0 is the plain cost, where the busy fleet's holder loses.
    plain = CacheAware(rng=random.Random(1), weights=CacheAwareWeights(backlog=0.0))
    if loads == (12, 3, 3, 3):
        assert plain.decide(candidates, fleet.prompt()).ranked[0].rank != A


def test_the_device_tier_beats_the_host_tier_which_beats_nothing() -> None:
    fleet = Fleet()
    fleet.hold(A, 128, tier=HOST)
    fleet.hold(B, 128, tier=DEVICE)
    policy = CacheAware(rng=random.Random(1))
    candidates = [cand(A), cand(B), cand(C)]
    # Host blocks are credited half (lower_tier_discount 0.5): 2048 - 128 * 16 * 0.5.
    assert policy.costs(candidates, fleet.prompt()) == [1024.0, 0.0, 2048.0]
    decision = policy.decide(candidates, fleet.prompt())
    assert heads(decision.ranked) == [B, A, C]
    assert (decision.outcome, decision.matched_blocks) == ("cache_hit", 128)


def test_a_prefix_partly_evicted_to_the_host_is_credited_per_tier() -> None:
    fleet = Fleet()
    hashes = fleet.hold(A, 128)
    fleet.tree.store(A, None, hashes, PROMPT, BS, tier=HOST)
    fleet.tree.remove(A, hashes[64:], tier=DEVICE)  # blocks 64.. now only on the host
    policy = CacheAware(weights=CacheAwareWeights(lower_tier_discount=0.25))
    # 64 device blocks save 1024 tokens, 64 host blocks 64 * 16 * 0.25 = 256.
    assert policy.costs([cand(A)], fleet.prompt()) == [2048 - 1024 - 256]


@pytest.mark.parametrize(
    ("loads", "ranked", "matched"),
    [
        # C is past both thresholds: last; among A and B the cost picks the holder A
        # (5 x 256 = 1280 < 2048), as it would with C away.
        ((5, 0, 40), [A, B, C], 128),
        # The holder itself is the outlier: it goes last, the cost orders the rest.
        ((40, 5, 0), [C, B, A], 0),
        # Two outliers, last by load; C and D are within 32 of each other.
        ((40, 50, 0, 1), [C, D, A, B], 0),
        # 30 is within 32 of the lightest: only D is set aside, and A's cache wins.
        ((6, 0, 30, 60), [A, B, C, D], 128),
    ],
)
def test_a_strongly_imbalanced_fleet_sets_its_outliers_last_and_the_cost_orders_the_rest(
    loads: tuple[int, ...], ranked: list[RankId], matched: int
) -> None:
    fleet = Fleet()
    fleet.hold(A, 128)
    candidates = [cand(r, inflight=q) for r, q in zip((A, B, C, D), loads, strict=False)]
    decision = CacheAware(rng=random.Random(1)).decide(candidates, fleet.prompt())
    assert heads(decision.ranked) == ranked
    assert (decision.outcome, decision.matched_blocks) == ("imbalance_fallback", matched)


def test_one_rank_stating_a_huge_queue_leaves_the_others_their_prefix_affinity() -> None:
    """A rank stuck (or lying) at 1,000 waiting made every decision the fallback, which spread
    the same prompt over the healthy ranks by load (12/8 of 20); set aside, it leaves them the
    cost, and the prompt stays where it was booked."""
    fleet = Fleet()
    p = Pressured(fleet, {**even(), D: 256})
    candidates = [cand(A), cand(B), cand(C), cand(D, waiting=1000)]
    served = Counter(p.policy.decide(candidates, p.prompt()).ranked[0].rank for _ in range(20))
    assert sorted(served.values()) == [20] and D not in served


@pytest.mark.parametrize(
    ("low", "high", "imbalanced"),
    [
        (0, 32, False),  # a spread of exactly 32 is not over the absolute threshold
        (0, 33, True),
        (68, 101, False),  # over 32 apart, but 101 is not above 68 x 1.5 = 102
        (68, 103, True),
    ],
)
def test_imbalance_needs_both_the_absolute_and_the_relative_threshold(
    low: int, high: int, imbalanced: bool
) -> None:
    assert CacheAware().imbalanced([low, (low + high) // 2, high]) is imbalanced


def test_without_any_cached_prefix_cache_aware_orders_by_load_and_reports_a_miss() -> None:
    fleet = Fleet()
    candidates = [cand(A, inflight=3), cand(B, inflight=1, waiting=1), cand(C, inflight=1)]
    policy = CacheAware(rng=random.Random(1))
    for prompt in (fleet.prompt(), Prompt(2048, BS, None)):
        decision = policy.decide(candidates, prompt)
        assert heads(decision.ranked) == [C, B, A]
        assert (decision.outcome, decision.matched_blocks) == ("cache_miss", 0)


def test_equal_cost_load_and_room_are_broken_alike_by_every_replica() -> None:
    candidates = [cand(A, inflight=1), cand(B, inflight=1), cand(C, inflight=1)]
    firsts: Counter[RankId] = Counter()
    for i in range(300):
        tokens = [i + 3] * BS + PROMPT[BS:]  # a new prompt each time, held by nobody
        keys = block_keys(tokens, BS)
        # Two replicas (fresh policies, other seeds) agree: rendezvous, not their rngs.
        picks = {
            CacheAware(rng=random.Random(seed))
            .decide(candidates, Prompt(2048, BS, None, keys))
            .ranked[0]
            .rank
            for seed in (1, 2)
        }
        assert len(picks) == 1
        firsts[picks.pop()] += 1
    # Each prompt has its own order, so new prefixes still spread over the ranks.
    assert set(firsts) == {A, B, C} and min(firsts.values()) > 70


def test_an_unknown_engine_load_counts_as_no_waiting() -> None:
    assert load_of(Candidate(A, 2, None)) == 2
    assert load_of(Candidate(A, 2, EngineLoad(running=9, waiting=None))) == 2
    assert load_of(Candidate(A, 2, EngineLoad(running=9, waiting=4))) == 6


def test_no_candidates_is_an_empty_decision_for_every_policy() -> None:
    for name in POLICY_NAMES:
        decision = make_policy(name, rng=random.Random(1)).decide([], Prompt(10, BS))
        assert (decision.ranked, decision.outcome, decision.matched_blocks) == (
            [],
            "no_candidates",
            0,
        )


# --- baselines ------------------------------------------------------------------------------


def test_round_robin_cycles_through_the_candidates() -> None:
    policy = make_policy("round_robin")
    candidates = [cand(A), cand(B), cand(C)]
    rankings = [heads(policy.decide(candidates, Prompt(10, BS)).ranked) for _ in range(4)]
    assert rankings == [[A, B, C], [B, C, A], [C, A, B], [A, B, C]]


def test_least_load_puts_the_least_loaded_first() -> None:
    policy = make_policy("least_load", rng=random.Random(1))
    candidates = [cand(A, 4), cand(B, 1, waiting=2), cand(C, 0, waiting=1), cand(D, 9)]
    assert heads(policy.decide(candidates, Prompt(10, BS)).ranked) == [C, B, A, D]


def test_power_of_two_puts_the_less_loaded_of_its_two_picks_first() -> None:
    candidates = [cand(A, 0), cand(B, 5), cand(C, 10), cand(D, 20)]
    policy = make_policy("power_of_two", rng=random.Random(3))
    firsts: Counter[RankId] = Counter()
    for _ in range(600):
        ranked = policy.decide(candidates, Prompt(10, BS)).ranked
        loads = [load_of(c) for c in ranked]
        assert loads[0] < loads[1]  # the pair, less loaded first
        assert loads[2:] == sorted(loads[2:])  # then everyone else by load
        firsts[ranked[0].rank] += 1
    # A is first whenever it is drawn (1/2 of pairs), B when drawn without A (1/3),
    # C only with D (1/6), D never: the least loaded overall does not always win.
    assert D not in firsts
    assert 250 < firsts[A] < 350 and 150 < firsts[B] < 250 and 60 < firsts[C] < 140


def test_seeded_policies_decide_identically() -> None:
    candidates = [cand(r, inflight=i % 2) for i, r in enumerate((A, B, C, D))]
    fleet = Fleet()
    fleet.hold(A, 5)
    fleet.hold(C, 5)
    for name in POLICY_NAMES:
        runs = []
        for _ in range(2):
            policy = make_policy(name, rng=random.Random(42))
            runs.append(
                [heads(policy.decide(candidates, fleet.prompt()).ranked) for _ in range(30)]
            )
        assert runs[0] == runs[1], name
        # cache_aware breaks its ties by rendezvous, which every replica computes alike.
        if name not in ("round_robin", "cache_aware"):
            assert len({tuple(r) for r in runs[0]}) > 1, name  # and it does use the rng


def test_baselines_report_hit_or_miss_of_their_choice() -> None:
    fleet = Fleet()
    fleet.hold(B, 10)
    policy = make_policy("round_robin")
    candidates = [cand(A), cand(B)]
    first = policy.decide(candidates, fleet.prompt())
    second = policy.decide(candidates, fleet.prompt())
    assert (first.outcome, first.matched_blocks) == ("cache_miss", 0)
    assert (second.outcome, second.matched_blocks) == ("cache_hit", 10)


# --- factory and settings -------------------------------------------------------------------


def test_make_policy_knows_every_name_and_refuses_others() -> None:
    assert {make_policy(name).name for name in POLICY_NAMES} == set(POLICY_NAMES)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="weights"):
        make_policy("round_robin", weights=CacheAwareWeights())
    with pytest.raises(ValueError, match="ledger"):
        make_policy("least_load", ledger=PressureLedger())
    custom = make_policy("cache_aware", weights=CacheAwareWeights(queued_request_tokens=64))
    assert isinstance(custom, CacheAware) and custom.weights.queued_request_tokens == 64


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": -1.0},
        {"queued_request_tokens": -5.0},
        {"lower_tier_discount": 1.5},
        {"imbalance_rel": 0.5},
        {"imbalance_abs": -1},
        {"evict": -0.5},
        {"fill": -1.0},
        {"backlog": -0.1},
        {"running_share": -0.25},
        {"running_share": 1.5},
    ],
)
def test_invalid_weights_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CacheAwareWeights(**bad)  # type: ignore[arg-type]


# --- cache_aware under cache pressure -------------------------------------------------------
#
# Capacities are 256 blocks per rank unless a test says otherwise; demand comes from the
# policy's own ledger (its decisions), on a ManualClock. The prompt is 128 blocks.


def other_keys(seed: int, blocks: int) -> list[int]:
    """Keys of `blocks` blocks that share nothing with PROMPT or with another seed's."""
    return block_keys([(seed * 131 + i) % 50_000 + 60_000 for i in range(blocks * BS)], BS)


class Pressured:
    """A cache_aware over `fleet`'s index, with stated capacities and a manual clock."""

    def __init__(
        self,
        fleet: Fleet,
        capacity: dict[RankId, int],
        ttl_s: float = 5.0,
        replicas: int = 1,
        **weights: float,
    ) -> None:
        self.clock = ManualClock()
        self.fleet = fleet
        self.policy = CacheAware(
            CacheAwareWeights(**weights),  # type: ignore[arg-type]
            random.Random(1),
            PressureLedger(PressureSettings(booking_ttl_s=ttl_s), self.clock),
            lambda: fleet.tree,
            capacity.get,
            lambda: replicas,
        )

    def demand(self, rank: RankId, blocks: int, seed: int) -> None:
        """Make `blocks` of unrelated recent demand on `rank` (routed, and stored by it)."""
        keys = other_keys(seed, blocks)
        self.policy.ledger.record(rank, keys, held=len(keys))

    def prompt(self, tokens: list[int] = PROMPT) -> Prompt:
        keys = block_keys(tokens, BS)
        return Prompt(len(tokens), BS, self.fleet.tree.prefix_depths(keys), keys)


def even(capacity: int = 256) -> dict[RankId, int]:
    return {A: capacity, B: capacity, C: capacity}


@pytest.mark.parametrize(
    ("demands", "first"),
    [
        ((120, 40, 80), B),
        ((0, 200, 10), A),
        ((250, 240, 200), C),  # all over their room for a 128-block prompt: the least spill
        ((300, 300, 299), C),  # over capacity everywhere: still the least demanded
    ],
)
def test_a_miss_goes_to_the_least_demanded_rank(demands: tuple[int, ...], first: RankId) -> None:
    for capacity in (even(), {}):  # capacities stated, or unknown (then demand breaks ties)
        p = Pressured(Fleet(), capacity)
        for seed, (rank, blocks) in enumerate(zip((A, B, C), demands, strict=True)):
            p.demand(rank, blocks, seed)
        decision = p.policy.decide([cand(A), cand(B), cand(C)], p.prompt())
        assert decision.ranked[0].rank == first, capacity
        assert decision.outcome == "cache_miss"


@pytest.mark.parametrize(
    ("loads", "first"),
    [
        ((0, 2, 0), {A, C}),  # an idle fleet: two requests ahead outweigh B's room
        ((3, 5, 3), {B}),  # a busy one: the queue difference is brief, the room lasts
        ((3, 6, 3), {B}),
    ],
)
def test_in_a_busy_fleet_a_new_prefix_goes_where_it_fits_not_where_the_queue_is_shorter(
    loads: tuple[int, ...], first: set[RankId]
) -> None:
    p = Pressured(Fleet(), even())
    for seed, (rank, blocks) in enumerate(zip((A, B, C), (128, 64, 128), strict=True)):
        p.demand(rank, blocks, seed)
    candidates = [cand(r, q) for r, q in zip((A, B, C), loads, strict=True)]
    decision = p.policy.decide(candidates, p.prompt())
    assert decision.ranked[0].rank in first
    assert decision.outcome == "cache_miss"


def test_a_rank_full_of_blocks_nobody_asked_for_is_as_good_as_an_empty_one() -> None:
    fleet = Fleet()
    fleet.hold(A, 256, tokens=[7] * BS + PROMPT[BS:] + PROMPT)  # a pre-filled cache
    p = Pressured(fleet, even())
    p.demand(B, 40, seed=1)  # B has a little recent demand; A's blocks have none
    costs = p.policy.costs([cand(A), cand(C), cand(B)], p.prompt())
    assert costs[0] == costs[1] == 2048.0  # neither evicts anything in demand
    # B's fill surcharge: 128 new blocks, x2, x the fleet's fullness (40 of 768), x B's (40/256).
    assert costs[2] == pytest.approx(2048.0 + 16 * 128 * 2 * (40 / 768) * (40 / 256))
    decision = p.policy.decide([cand(A), cand(B), cand(C)], p.prompt())
    # A and C tie on cost and load; C has more room (nothing held), so C comes first.
    assert [c.rank for c in decision.ranked] == [C, A, B]


@pytest.mark.parametrize(
    ("held_on_a", "first", "spilled"),
    [
        (128, A, 0),  # a full hit: nothing to store, nothing spills
        (112, A, 16),  # 16 blocks to store: A spills 16 demanded blocks, still the cheapest
        (64, B, 0),  # half of it: storing 64 on A would evict 64 in demand; B has room
        (0, B, 0),
    ],
)
def test_a_full_rank_pays_for_the_demanded_blocks_a_spill_evicts(
    held_on_a: int, first: RankId, spilled: int
) -> None:
    fleet = Fleet()
    p = Pressured(fleet, even())
    fleet.hold(A, 256 - held_on_a, tokens=[9] * BS + PROMPT[BS:] + PROMPT)
    p.demand(A, 256 - held_on_a, seed=6)  # A's other blocks are all recent demand
    if held_on_a:
        fleet.hold(A, held_on_a)
        p.policy.ledger.record(A, KEYS[:held_on_a], held=held_on_a)
    p.demand(B, 100, seed=7)  # B: room for 156 more
    candidates = [cand(A), cand(B)]
    new = 128 - held_on_a
    costs = p.policy.costs(candidates, p.prompt())
    # A: prefill what it lacks (x1), evict that many demanded blocks (x1), and fill (x2)
    # scaled by the fleet's fullness, 356 blocks of demand over 512, and A's, which is 1.
    # Held in part, the rest routed nowhere yet, it is also a new prefix below what A holds,
    # and A would end full: the saving of as many blocks as it stores is charged back.
    fleet = (256 + 100) / 512
    charge = 16 * min(held_on_a, new) if 0 < held_on_a < 128 else 0
    assert costs[0] == pytest.approx(16 * new * (1 + 1 + 2 * fleet) + charge)
    assert costs[1] == pytest.approx(2048 + 16 * 128 * 2 * fleet * 100 / 256)  # B: no spill
    decision = p.policy.decide(candidates, p.prompt())
    assert decision.ranked[0].rank == first
    assert p.policy.spill_stats.spilled_blocks == spilled
    assert p.policy.spill_stats.spills == (1 if spilled else 0)


def test_a_booked_prompt_follows_its_first_request_until_the_booking_expires() -> None:
    fleet = Fleet()
    p = Pressured(fleet, even(), ttl_s=5.0)
    candidates = [cand(A), cand(B), cand(C)]
    first = p.policy.decide(candidates, p.prompt()).ranked[0].rank
    # The store event has not arrived: the index shows nothing, the booking holds it all.
    costs = p.policy.costs(candidates, p.prompt())
    assert costs[candidates.index(cand(first))] == 0.0
    second = p.policy.decide(candidates, p.prompt())
    assert second.ranked[0].rank == first
    assert (second.outcome, second.matched_blocks) == ("cache_miss", 0)  # the index's view
    p.clock.advance(5.0)  # no store event within the TTL: both bookings expire
    later = p.policy.costs(candidates, p.prompt())
    assert later[candidates.index(cand(first))] > 2048.0  # a miss now, and its demand is high
    p.policy.decide(candidates, p.prompt())
    assert (p.policy.ledger.bookings.expired, p.policy.ledger.bookings.confirmed) == (2, 0)


def test_a_booking_ends_when_the_store_arrives_so_a_later_eviction_shows() -> None:
    fleet = Fleet()
    p = Pressured(fleet, even())
    candidates = [cand(A), cand(B), cand(C)]
    first = p.policy.decide(candidates, p.prompt()).ranked[0].rank
    hashes = fleet.hold(first, 128)  # the engine stored it: the store event arrived
    p.policy.decide(candidates, p.prompt())  # settles: the booking is confirmed
    assert (p.policy.ledger.bookings.confirmed, p.policy.ledger.bookings.expired) == (1, 0)
    fleet.tree.remove(first, hashes[32:])  # the engine evicts all but 32 blocks
    index = candidates.index(cand(first))
    # 96 blocks to prefill and store again: no booking hides the eviction.
    assert p.policy.costs(candidates, p.prompt())[index] >= 16 * 96


def test_without_capacities_or_a_ledger_history_the_cost_is_the_plain_one() -> None:
    fleet = Fleet()
    fleet.hold(C, 128)
    fleet.hold(A, 2)
    p = Pressured(fleet, {}, ttl_s=0.0)
    assert p.policy.costs([cand(A), cand(B), cand(C)], p.prompt()) == [2048 - 32, 2048, 0]


@pytest.mark.parametrize(
    ("replicas", "agree"),
    [(1, False), (2, True)],
)
def test_siblings_treat_costs_within_the_tie_margin_as_a_tie_so_they_agree(
    replicas: int, agree: bool
) -> None:
    """Two replicas whose ledgers differ a little (each saw other requests) place the same new
    prefixes alike when they know of each other; a lone replica follows its own ledger."""
    disagreements = 0
    for i in range(40):
        tokens = [i + 3] * BS + PROMPT[BS:]  # a new prefix each time
        picks = set()
        for view in ((3, 0, 0), (0, 3, 0)):  # three blocks of demand on A, or on B
            p = Pressured(Fleet(), even(), replicas=replicas)
            for seed, (rank, blocks) in enumerate(zip((A, B, C), view, strict=True)):
                if blocks:
                    p.demand(rank, blocks, seed=seed)
            picks.add(p.policy.decide([cand(A), cand(B), cand(C)], p.prompt(tokens)).ranked[0].rank)
        disagreements += len(picks) > 1
    # 3 blocks of demand are a few tokens of fill apart: well within the margin of 128.
    assert (disagreements == 0) is agree
    if not agree:  # alone: each follows its own ledger (C, or whichever of A/B is idle)
        assert disagreements > 0


class Siblings:
    """Two replicas' cache_aware over one index (the engines' events reach both), each
    sharing its decisions with the other when `shared`: delivered at once, or kept in
    `in_flight` until `deliver()` (the post has not arrived yet)."""

    def __init__(self, fleet: Fleet, shared: bool, deliver_at_once: bool = True) -> None:
        self.fleet = fleet
        self.in_flight: list[tuple[int, RankId, list[int], int]] = []
        self.sides = [Pressured(fleet, even(), replicas=2) for _ in range(2)]
        for k, side in enumerate(self.sides):
            if shared:
                side.policy.share = self._sharer(k, deliver_at_once)

    def _sharer(self, k: int, at_once: bool) -> Callable[[RankId, Sequence[int], int], None]:
        def share(rank: RankId, keys: Sequence[int], held: int) -> None:
            self.in_flight.append((1 - k, rank, list(keys), held))
            if at_once:
                self.deliver()

        return share

    def deliver(self) -> None:
        flights, self.in_flight = self.in_flight, []
        for to, rank, keys, held in flights:
            self.sides[to].policy.adopt(rank, keys, held)

    def decide(self, k: int, tokens: list[int], loads: tuple[int, ...] = (0, 0, 0)) -> RankId:
        side = self.sides[k]
        candidates = [cand(r, inflight=n) for r, n in zip((A, B, C), loads, strict=True)]
        return side.policy.decide(candidates, side.prompt(tokens)).ranked[0].rank


@pytest.mark.parametrize(
    ("shared", "same_rank"),
    [(True, True), (False, False)],
)
def test_a_sibling_follows_a_new_prefix_its_sibling_placed_before_the_index_shows_it(
    shared: bool, same_rank: bool
) -> None:
    """Replica 0 places a new prefix; before any store event, replica 1 gets the same prefix
    while its own in-flight count makes the first rank look busy. With decisions shared it
    finds the sibling's booking (a hit's cost) and follows; without, it sees a miss."""
    s = Siblings(Fleet(), shared)
    first = s.decide(0, PROMPT + [1] * 40)  # 130 blocks
    assert s.sides[1].policy.ledger.pending(first) == (130 if shared else 0)
    loads = tuple(1 if r == first else 0 for r in (A, B, C))
    second = s.decide(1, PROMPT + [2] * 40, loads)
    assert (second == first) is same_rank


def test_shared_decisions_carry_only_what_changed_and_count_as_the_siblings_demand() -> None:
    fleet = Fleet()
    s = Siblings(fleet, shared=True, deliver_at_once=False)
    first = s.decide(0, PROMPT)
    assert [(to, r, len(keys), held) for to, r, keys, held in s.in_flight] == [(1, first, 128, 0)]
    s.deliver()
    sibling = s.sides[1].policy
    assert sibling.ledger.demand(first) == pytest.approx(128.0)
    assert sibling.ledger.booked_depths(KEYS, {}) == {first: 128}
    fleet.hold(first, 128)  # the store event arrives
    s.decide(0, PROMPT)  # the same prompt again at once: held, and its weights are fresh
    assert s.in_flight == []
    s.decide(0, PROMPT + [4] * 48)  # a tail of three blocks of its own: no news either
    assert s.in_flight == []
    # Another prompt going on from the prefix's first 10 blocks for 20 more: a new prefix
    # below a shared preamble, not a tail (it is longer than what it shares).
    longer = PROMPT[: 10 * BS] + [6] * (20 * BS)
    s.decide(0, longer)
    new_keys = s.sides[0].prompt(longer).keys[10:]
    assert [keys[-20:] for _, _, keys, _ in s.in_flight] == [new_keys]


def test_a_prompts_own_tail_leaves_the_siblings_working_sets_as_it_leaves_its_own() -> None:
    """A request's own tail is superseded in the ledger that routed it; told to a sibling, it
    was recorded there as blocks new to it and stayed in that sibling's working set, so every
    replica's working sets grew past the caches by the tails alone (the rules that read them,
    an outgrown holder's relief and a gone prefix's re-placement, then found no rank with
    room). Not told, the two replicas' working sets agree."""
    fleet = Fleet()
    s = Siblings(fleet, shared=True)
    rank = s.decide(0, PROMPT)
    fleet.hold(rank, 128)  # its store event: the prefix's next requests book only their tails
    for i in range(6):
        s.decide(i % 2, PROMPT + [20 + i] * (2 * BS))  # the prefix again, two blocks of its own
    own, sibling = (side.policy.ledger.working_sets([rank])[0] for side in s.sides)
    assert own == pytest.approx(sibling, abs=1e-6) and own == pytest.approx(128.0, abs=1e-6)


def test_sharing_replicas_count_no_unseen_share_of_what_a_rank_holds() -> None:
    """Without sharing, a replica guesses that half of what a rank holds beyond its own demand
    is its sibling's (pre-filled blocks included); sharing, it knows the sibling's demand."""
    fleet = Fleet()
    fleet.hold(A, 200, tokens=[7] * BS * 200)  # blocks nobody asked for
    guessing = Siblings(fleet, shared=False).sides[0]
    knowing = Siblings(fleet, shared=True).sides[0]
    tokens = [5] * BS + PROMPT[BS:]
    guessed = guessing.policy.costs([cand(A), cand(B)], guessing.prompt(tokens))
    known = knowing.policy.costs([cand(A), cand(B)], knowing.prompt(tokens))
    assert known == [2048.0, 2048.0]  # nothing in demand anywhere: no pressure terms
    assert guessed[0] > 2048.0 and guessed[1] == 2048.0  # A: 100 guessed blocks of demand


def test_a_failed_over_request_moves_its_booking_to_the_rank_that_served_it() -> None:
    s = Siblings(Fleet(), shared=True, deliver_at_once=False)
    side = s.sides[0].policy
    decision = side.decide([cand(A), cand(B), cand(C)], s.sides[0].prompt())
    chosen = decision.ranked[0].rank
    served = decision.ranked[1].rank
    s.in_flight.clear()
    decision.served(chosen)  # the first choice answered: nothing happens
    assert side.ledger.bookings.moved == 0 and s.in_flight == []
    decision.served(served)
    assert side.ledger.bookings.moved == 1
    assert side.ledger.pending(chosen) == 0 and side.ledger.pending(served) == 128
    assert side.ledger.booked_depths(KEYS, {}) == {served: 128}
    assert [(r, len(k)) for _, r, k, _ in s.in_flight] == [(served, 128)]  # siblings told
    # The next request of the prefix follows it to where it was served.
    assert s.decide(0, PROMPT + [3] * 20) == served


def test_baseline_decisions_ignore_where_they_were_served() -> None:
    decision = RoundRobin().decide([cand(A), cand(B)], Prompt(2048, BS))
    decision.served(B)  # no policy hook: nothing to do, nothing raised
    assert decision.on_failover is None


@settings(max_examples=300, deadline=None)
@given(
    ranks=st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300)),  # (blocks held, demand)
        min_size=2,
        max_size=6,
    ),
    prompt_blocks=st.integers(1, 200),
    load=st.integers(0, 5),
)
def test_no_rank_gets_a_new_prefix_while_another_has_more_room_and_less_demand(
    ranks: list[tuple[int, int]], prompt_blocks: int, load: int
) -> None:
    fleet = Fleet()
    rank_ids = [RankId(f"http://r{i}:8000", 0) for i in range(len(ranks))]
    p = Pressured(fleet, dict.fromkeys(rank_ids, 256))
    for i, (rank, (held, demand)) in enumerate(zip(rank_ids, ranks, strict=True)):
        if held:
            fleet.hold(rank, held, tokens=[i + 100] * BS * 300)  # unrelated to the prompt
        if demand:
            p.demand(rank, demand, seed=1000 + i)
    tokens = [4] * BS + PROMPT[BS : prompt_blocks * BS]  # a new prefix: nobody holds block 0
    candidates = [cand(r, inflight=load) for r in rank_ids]
    demand = dict(zip(rank_ids, p.policy.ledger.demands(rank_ids), strict=True))
    free = {r: 256 - fleet.tree.block_count(r) for r in rank_ids}
    chosen = p.policy.decide(candidates, p.prompt(tokens)).ranked[0].rank
    for other in rank_ids:
        dominates = (free[other], -demand[other]) > (free[chosen], -demand[chosen]) and (
            free[other] >= free[chosen] and demand[other] <= demand[chosen]
        )
        assert not dominates, (chosen, other, free, demand)


# A 48-block preamble and a 96-block prompt below it (48 blocks of its own), capacity 256.
PREAMBLE = 48
BELOW = PROMPT[: 96 * BS]


@pytest.mark.parametrize(
    ("holders", "demands", "first", "charged"),
    [
        # The preamble on A and B, both near full of demand, C empty: the prefix would push
        # A (or B) past its share of a fleet that is half full; C takes it, preamble and all.
        ((A, B), (200, 200, 0), {C}, {A, B}),
        # Only A is full: A is charged; B would end no fuller than C, and keeps the credit.
        ((A, B), (200, 0, 0), {B}, {A}),
        # On one rank only, below it blocks routed nowhere lately (a new prefix): A is
        # charged as a sharer would be, and C, the rank with room, takes the prefix.
        ((A,), (200, 200, 0), {C}, {A}),
        # ... as a fleet's first placements see it: the other ranks empty, the fleet a fifth
        # full. Charged by how full A would end, not by the fleet's fullness.
        ((A,), (160, 0, 0), {B, C}, {A}),
        # Every rank holds it (a system prompt cached fleet-wide): nobody to compare with.
        ((A, B, C), (200, 200, 60), {C}, set()),
        # Holders with room: the charge is scaled by how full they would end, they stay cheaper.
        ((A, B), (80, 80, 0), {A, B}, {A, B}),
        # The rank without the preamble would end fuller than the holders: no charge.
        ((A, B), (200, 200, 230), {A, B}, set()),
    ],
)
def test_a_new_prefix_below_a_shared_preamble_is_placed_by_where_its_blocks_will_live(
    holders: tuple[RankId, ...],
    demands: tuple[int, int, int],
    first: set[RankId],
    charged: set[RankId],
) -> None:
    fleet = Fleet()
    p = Pressured(fleet, even())
    for seed, (rank, blocks) in enumerate(zip((A, B, C), demands, strict=True)):
        if rank in holders:
            fleet.hold(rank, PREAMBLE)
        p.demand(rank, blocks, seed=seed)
    candidates = [cand(A), cand(B), cand(C)]
    prompt = p.prompt(BELOW)
    costs = p.policy.costs(candidates, prompt)
    # The plain cost, by hand: what each rank lacks, plus fill at the fleet's fullness and
    # the rank's (its demand, or at least the preamble it keeps for this prompt).
    fleet_now = sum(demands) / 768
    for rank, demand, cost in zip((A, B, C), demands, costs, strict=True):
        held = PREAMBLE if rank in holders else 0
        expected = 16 * (96 - held) * (1 + 2 * fleet_now * max(demand, held) / 256)
        if rank in charged:  # the preamble's saving withdrawn, times how full it would end
            expected += 16 * PREAMBLE * min((max(demand, held) + 96 - PREAMBLE) / 256, 1)
        assert cost == pytest.approx(expected), rank
    assert p.policy.decide(candidates, prompt).ranked[0].rank in first


def test_the_rest_of_a_prefix_its_one_holder_evicted_stays_with_it() -> None:
    """A holds the first 48 blocks of a 96-block prefix routed to it before (its engine
    evicted the rest): the block past the match was routed, so this is no new prefix below a
    preamble, and A keeps the whole saving though it is nearly full."""
    fleet = Fleet()
    p = Pressured(fleet, even())
    fleet.hold(A, PREAMBLE)
    prompt = p.prompt(BELOW)
    p.policy.ledger.record(A, prompt.keys, held=96)
    p.demand(A, 200 - 96, seed=1)
    candidates = [cand(A), cand(B), cand(C)]
    costs = p.policy.costs(candidates, prompt)
    assert costs[0] == pytest.approx(16 * 48 * (1 + 2 * (200 / 768) * (200 / 256)))
    assert p.policy.decide(candidates, prompt).ranked[0].rank == A


def test_a_repeat_of_a_prefix_held_on_one_rank_stays_there_under_a_shared_preamble() -> None:
    """The preamble on A and B, the prompt's own part on A alone (a repeat with a new tail):
    its deepest match is A's alone and its tail new, so A, nearly full, is charged the saving
    of the 2 blocks it would store, as a copy's holder is, and keeps the rest."""
    fleet = Fleet()
    p = Pressured(fleet, even())
    fleet.hold(A, 94)
    fleet.hold(B, PREAMBLE)
    p.demand(A, 200, seed=1)
    p.demand(B, 200, seed=2)
    candidates = [cand(A), cand(B), cand(C)]
    costs = p.policy.costs(candidates, p.prompt(BELOW))
    charge = 16 * 2 * (200 + 2) / 256
    assert costs[0] == pytest.approx(16 * 2 * (1 + 2 * (400 / 768) * (200 / 256)) + charge)
    assert p.policy.decide(candidates, p.prompt(BELOW)).ranked[0].rank == A


def test_a_repeat_of_a_prefix_copied_to_two_ranks_is_charged_only_its_tail() -> None:
    """The whole prefix on A and B (a copy), the prompt a repeat with a 2-block tail: it looks
    like a new prefix below a shared preamble, but stores 2 blocks, so a full holder is
    charged 2 blocks' saving, not 94, and stays cheaper than a rank that would copy it."""
    fleet = Fleet()
    p = Pressured(fleet, even())
    fleet.hold(A, 94)
    fleet.hold(B, 94)
    p.demand(A, 200, seed=1)
    p.demand(B, 200, seed=2)
    candidates = [cand(A, 1), cand(B, 2), cand(C)]
    costs = p.policy.costs(candidates, p.prompt(BELOW))
    plain = 16 * 2 * (1 + 2 * (400 / 768) * (200 / 256))
    charge = 16 * 2 * (200 + 2) / 256
    per_request = 256 / (1 + (1 + 0) / 2)  # the mean load without the busiest rank: 0.5
    assert costs[0] == pytest.approx(plain + charge + per_request)
    assert costs[1] == pytest.approx(plain + charge + 2 * per_request)
    assert p.policy.decide(candidates, p.prompt(BELOW)).ranked[0].rank == A


def test_a_rank_of_unknown_capacity_is_charged_as_one_of_the_median_capacity() -> None:
    """As the first row of the table, with D stating no capacity: D counts as a rank of the
    known ones' median (256) in every term and sum, its demand past it (a spill, a full
    rank), and C, the rank with room, still takes the prefix."""
    fleet = Fleet()
    for rank in (A, B):
        fleet.hold(rank, PREAMBLE)
    sides = [Pressured(fleet, even()), Pressured(fleet, {**even(), D: 256})]
    for p in sides:
        for seed, (rank, blocks) in enumerate(zip((A, B, C, D), (200, 200, 0, 500), strict=True)):
            p.demand(rank, blocks, seed=seed)
    candidates = [cand(A), cand(B), cand(C), cand(D, 3)]
    unknown, stated = (p.policy.costs(candidates, p.prompt(BELOW)) for p in sides)
    assert unknown == stated
    assert unknown[3] > 16 * 96 + 3 * 256  # D pays the pressure terms of a full rank
    assert [p.policy.decide(candidates, p.prompt(BELOW)).ranked[0].rank for p in sides] == [C, C]


@pytest.mark.parametrize(
    ("capacity", "assumed"),
    [
        ([None, 100, 300], [100, 100, 300]),  # two known: the lower middle one
        ([0, 100, 200, 300], [200, 100, 200, 300]),
        ([100, None, 50, 400, 0], [100, 100, 50, 400, 100]),
        ([None, 0], [None, 0]),  # none known: nothing to go on, no pressure terms
        ([64, 64], [64, 64]),
    ],
)
def test_an_unknown_capacity_counts_as_the_median_of_the_known_ones(
    capacity: list[int | None], assumed: list[int | None]
) -> None:
    assert assumed_capacities(capacity) == assumed


def test_a_rank_of_unknown_capacity_draws_new_prefixes_as_a_rank_stating_the_median() -> None:
    """A rank whose loads endpoint never answered (or stated 0) paid no pressure terms and
    drew nearly every new prefix (28 of 30 where an honest fleet gives each its share)."""
    choices = []
    for capacity in (even(64), {B: 64, C: 64}):
        p = Pressured(Fleet(), capacity)
        rng = random.Random(7)
        picks = []
        for _ in range(30):
            tokens = [rng.randrange(1, 50_000) for _ in range(20 * BS)]
            picks.append(
                p.policy.decide([cand(A), cand(B), cand(C)], p.prompt(tokens)).ranked[0].rank
            )
        choices.append(picks)
    assert choices[0] == choices[1]
    assert max(Counter(choices[1]).values()) <= 12


# An outgrown holder: A held the whole prompt (routed there), its engine kept 96 of the 128
# blocks; its working set, 128 + 160 blocks, is past its capacity of 256.
@pytest.mark.parametrize(
    ("looks", "ws_b", "ws_c", "loads", "known", "first"),
    [
        (1, 100, 120, (0, 0, 0), True, A),  # one loss is noise: the cost keeps it on A
        (2, 100, 120, (0, 0, 0), True, B),  # the second in a row: to the least full with room
        (2, 140, 120, (0, 0, 0), True, C),  # B has no room for 128 blocks more
        (2, 140, 140, (0, 0, 0), True, A),  # neither has: the cost keeps it on A
        (2, 100, 120, (0, 1, 0), True, C),  # B is busier than A
        (2, 100, 120, (1, 1, 2), True, B),  # ... no busier than A
        # A's capacity unknown: the median of B's and C's (256), as if it stated it.
        (2, 100, 120, (0, 0, 0), False, B),
    ],
)
def test_a_holder_that_keeps_losing_a_prefix_passes_it_to_a_rank_with_room(
    looks: int,
    ws_b: int,
    ws_c: int,
    loads: tuple[int, int, int],
    known: bool,
    first: RankId,
) -> None:
    fleet = Fleet()
    capacity = even() if known else {B: 256, C: 256}
    p = Pressured(fleet, capacity, ttl_s=0.0)  # no bookings: the index alone shows the depth
    fleet.hold(A, 96)
    p.policy.ledger.record(A, KEYS, held=128)
    for seed, (rank, blocks) in enumerate(zip((A, B, C), (160, ws_b, ws_c), strict=True)):
        p.demand(rank, blocks, seed)
    candidates = [cand(r, q) for r, q in zip((A, B, C), loads, strict=True)]
    costs = p.policy.costs(candidates, p.prompt())
    assert costs[0] == min(costs)  # the cost alone keeps it on A every time
    for _ in range(looks):
        decision = p.policy.decide(candidates, p.prompt())
    assert decision.ranked[0].rank == first
    assert p.policy.outgrown == {A}


def a_holder_that_lost_its_tail() -> tuple[Fleet, Pressured]:
    """A holds 96 of the prompt's 128 routed blocks (it lost the rest); demand on A, B and C
    of 160, 100 and 120 blocks."""
    fleet = Fleet()
    p = Pressured(fleet, even(), ttl_s=0.0)
    fleet.hold(A, 96)
    p.policy.ledger.record(A, KEYS, held=128)
    for seed, (rank, blocks) in enumerate(zip((A, B, C), (160, 100, 120), strict=True)):
        p.demand(rank, blocks, seed)
    return fleet, p


def test_a_rank_that_lost_at_its_latest_look_takes_no_outgrown_holders_prefix() -> None:
    _, p = a_holder_that_lost_its_tail()
    p.policy.outgrown.add(B)  # B's own latest look showed a loss
    candidates = [cand(A), cand(B), cand(C)]
    assert [p.policy.decide(candidates, p.prompt()).ranked[0].rank for _ in "ab"] == [A, C]


def test_a_prefix_passed_on_stays_where_it_went() -> None:
    """Once, not back and forth: the receiver then holds it whole, and the holder's loss is
    no longer the deepest match; seen whole, a rank leaves the outgrown ones."""
    fleet, p = a_holder_that_lost_its_tail()
    candidates = [cand(A), cand(B), cand(C)]
    assert [p.policy.decide(candidates, p.prompt()).ranked[0].rank for _ in "ab"] == [A, B]
    fleet.hold(B, 128)  # B's engine stored it
    longer = PROMPT + [5] * 4 * BS  # a repeat with a tail of its own
    assert p.policy.decide(candidates, p.prompt(longer)).ranked[0].rank == B
    assert p.policy.outgrown == {A}
    fleet.hold(A, 132, tokens=longer)  # A holds more than was routed to it: whole
    p.policy.decide(candidates, p.prompt(longer + [6] * 4 * BS))
    assert p.policy.outgrown == set()


# A prefix gone from every cache: an 8-block header on every rank, the prompt's own blocks
# routed to A last and evicted since; every rank's demand past its capacity (256), so the
# pressure terms tie and the cost alone would go by load. A's working set counts the prompt
# already (408 where its demand is 400: the header's 8 blocks were routed there too); another
# rank's would count the 120 blocks it would store on top.
@pytest.mark.parametrize(
    ("routed", "loads", "demands", "known", "first"),
    [
        (True, (0, 0, 1), (400, 300, 250), True, C),  # C ends less full, a request busier
        (True, (0, 1, 2), (400, 300, 250), True, A),  # ... two busier: home, B ends fuller
        (True, (3, 0, 0), (380, 300, 280), True, A),  # home at any load, the least full
        (True, (3, 0, 0), (400, 250, 300), True, B),  # ... unless a lighter rank ends less full
        (True, (1, 0, 0), (400, 288, 288), True, A),  # home on a tie (B, C end as full)
        (True, (0, 0, 1), (400, 300, 280), False, B),  # no capacity known: the cost (by load)
        (False, (0, 0, 1), (400, 300, 280), True, B),  # routed nowhere: a new prefix, the cost
    ],
)
def test_a_prefix_gone_from_every_cache_goes_where_it_ends_least_full_home_at_any_load(
    routed: bool,
    loads: tuple[int, int, int],
    demands: tuple[int, int, int],
    known: bool,
    first: RankId,
) -> None:
    fleet = Fleet()
    p = Pressured(fleet, even() if known else {}, ttl_s=0.0)  # no bookings: the index alone
    for rank in (A, B, C):
        fleet.hold(rank, 8)
    if routed:
        p.policy.ledger.record(A, KEYS, held=8)
    for seed, (rank, blocks) in enumerate(zip((A, B, C), demands, strict=True)):
        # The prompt's own 120 blocks count in A's demand when it was routed there.
        p.demand(rank, blocks - 120 if routed and rank == A else blocks, seed)
    candidates = [cand(r, q) for r, q in zip((A, B, C), loads, strict=True)]
    assert p.policy.decide(candidates, p.prompt()).ranked[0].rank == first


# A repeat sent away from its holder: a 96-block header on B and C, A holding the prompt
# deeper (its prefix, routed there), 3 requests in flight on A and none elsewhere, so the
# queue term outweighs A's few blocks of saving and the cost alone sends the prompt to B or
# C. A's working set is 176 blocks of its 256; B's and C's `ws_b` and `ws_c`, to which the
# prompt would add the 32 blocks below the header.
@pytest.mark.parametrize(
    ("held", "routed", "header", "load", "ws_b", "ws_c", "known", "first"),
    [
        # A tail below the prefix A holds (20 blocks of it beyond the header, 12 new): B or
        # C would end fuller (150 + 32) than A is (176): A keeps it.
        (116, 116, 96, 3, 150, 150, True, {A}),
        (116, 116, 96, 4, 150, 150, True, {A}),  # ... with up to 4 more in flight than B
        (116, 116, 96, 5, 150, 150, True, {B, C}),  # ... not 5: the cost's choice
        (116, 116, 96, 3, 50, 150, True, {B}),  # B would end less full: the cost's choice
        # The rest of the prefix A's engine evicted (the block past its match routed there):
        # A holds 100 of 128 routed blocks, fewer of the prompt than it lacks, and keeps it.
        (100, 128, 96, 3, 150, 150, True, {A}),
        # A 32-block preamble on A alone and 96 blocks below it routed nowhere: a new prefix,
        # which the cost places.
        (32, 32, 0, 3, 150, 150, True, {B, C}),
        (116, 116, 96, 3, 150, 150, False, {B, C}),  # no capacity known: the cost's choice
    ],
)
def test_a_repeat_stays_with_its_holder_unless_the_cost_choice_ends_less_full(
    held: int,
    routed: int,
    header: int,
    load: int,
    ws_b: int,
    ws_c: int,
    known: bool,
    first: set[RankId],
) -> None:
    fleet = Fleet()
    p = Pressured(fleet, even() if known else {}, ttl_s=0.0)  # no bookings: the index alone
    fleet.hold(A, held)
    for rank in (B, C):
        if header:
            fleet.hold(rank, header)
    p.policy.ledger.record(A, KEYS[:routed], held=routed)
    for seed, (rank, blocks) in enumerate(zip((A, B, C), (176 - routed, ws_b, ws_c), strict=True)):
        p.demand(rank, blocks, seed)
    candidates = [cand(A, load), cand(B), cand(C)]
    costs = p.policy.costs(candidates, p.prompt())
    assert costs[0] > min(costs)  # the cost alone sends it away from A every time
    assert p.policy.decide(candidates, p.prompt()).ranked[0].rank in first
