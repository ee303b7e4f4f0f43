"""The pressure simulator's diagnosis: where lost prefix blocks went, and how evenly the
first placements spread them (bench/pressure_sim.py, `--diagnose`); and the prototype
prefix home table (`cache_aware_home`)."""

from __future__ import annotations

import random

import pytest

from bench.pressure_sim import (
    CACHE_AWARE_HOME,
    IDEAL,
    ONLINE_GREEDY,
    CacheAwareHome,
    HomeSettings,
    HomeTable,
    Losses,
    Request,
    Workload,
    build_requests,
    holdouts,
    play,
    shared_blocks,
    workloads,
)
from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.policy import CacheAware, Candidate, Prompt
from router.pressure import PressureLedger


@pytest.mark.parametrize(
    ("first", "shared", "hit", "elsewhere", "expected"),
    [
        (True, 20, 1, 0, (19, 0, 0)),  # a prefix's first admission: all of it is cold
        (False, 20, 20, 20, (0, 0, 0)),  # found whole: nothing lost
        (False, 20, 5, 20, (0, 15, 0)),  # another worker held all of it: a copy
        (False, 20, 5, 12, (0, 7, 8)),  # another held 12: 7 are the copy's, 8 are gone
        (False, 20, 5, 3, (0, 0, 15)),  # nobody held more: evicted
        (False, 20, 24, 30, (0, 0, 0)),  # tail blocks beyond the prefix are not counted
    ],
)
def test_a_lost_block_is_counted_once_by_why_it_was_lost(
    first: bool, shared: int, hit: int, elsewhere: int, expected: tuple[int, int, int]
) -> None:
    losses = Losses()
    losses.count(first, shared, hit, elsewhere)
    assert (losses.cold, losses.copy, losses.evicted) == expected


def test_shared_blocks_are_the_full_blocks_every_request_of_a_prefix_starts_with() -> None:
    w = Workload("t", 2, 3, (4, 6), 0.85, 4, shuffled=True)
    requests, lengths = build_requests(w, seed=3)
    shared = shared_blocks(requests)
    assert set(shared) == {0, 1, 2}
    for prefix, n in shared.items():
        mine = [r.tokens for r in requests if r.prefix == prefix]
        assert all(t[: n * 16] == mine[0][: n * 16] for t in mine)
        # one more block would differ in some request (the tails are each request's own)
        assert any(t[: (n + 1) * 16] != mine[0][: (n + 1) * 16] for t in mine)
        # the chat rendering adds tokens around the prefix's text: within a block of it
        assert lengths[prefix] - 1 <= n <= lengths[prefix] + 1


def test_one_request_shares_all_of_its_full_blocks() -> None:
    req = Request(0, "x" * 70)
    assert shared_blocks([req]) == {0: len(req.tokens) // 16}


def test_the_losses_of_a_run_add_up_to_the_prefix_blocks_it_did_not_find() -> None:
    w = Workload("t", 3, 9, (10, 14), 0.85, 4, shuffled=True, concurrency=4)
    requests, _ = build_requests(w, seed=1)
    shared = shared_blocks(requests)
    total = sum(shared[r.prefix] for r in requests)
    for policy in (IDEAL, "round_robin", "cache_aware"):
        out = play(w, 1, policy)
        lost = out.losses.cold + out.losses.copy + out.losses.evicted
        # every prefix misses once (cold; its first block, the chat preamble, may hit) ...
        assert out.losses.cold >= sum(shared.values()) - len(shared)
        # ... and what was not lost was found: the tails' own blocks never hit
        assert total - lost == out.cached_tokens // 16
    # the ideal partition never sends a prefix where another worker holds more of it
    assert play(w, 1, IDEAL).losses.copy == 0
    # round robin spreads every prefix over the workers: it loses to copies
    assert play(w, 1, "round_robin").losses.copy > 0


def test_online_greedy_keeps_each_prefix_on_one_worker_and_balances_their_blocks() -> None:
    w = Workload("t", 4, 16, (10, 30), 0.85, 4, shuffled=True, concurrency=8)
    _, lengths = build_requests(w, seed=2)
    out = play(w, 2, ONLINE_GREEDY)
    assert out.ranks_per_prefix == 1.0
    assert out.losses.copy == 0
    # each prefix onto the least-given worker: no worker ends more than one prefix ahead
    assert out.placement_spread <= max(lengths) + 2


def test_holdouts_are_new_shapes_with_unique_names() -> None:
    family = {w.name for w in workloads()}
    names = [w.name for w in holdouts()]
    assert len(set(names)) == len(names)
    assert not family & set(names)
    assert {w.replicas for w in holdouts()} == {1, 2, 3}
    assert max(w.concurrency for w in holdouts()) == 16


# -- the prototype home table -------------------------------------------------------------

R0, R1, R2 = (RankId(f"http://w{i}:8000", 0) for i in range(3))
BLOCK = 16


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _router(clock: _Clock, tree: BlockTree, settings: HomeSettings | None = None) -> CacheAwareHome:
    inner = CacheAware(
        rng=random.Random(0),
        ledger=PressureLedger(None, clock),
        index=lambda: tree,
        capacity=lambda rank: 200,
    )
    return CacheAwareHome(inner, HomeTable(settings or HomeSettings(), clock))


def _prompt(tree: BlockTree, seed: int, blocks: int = 12) -> Prompt:
    tokens = [random.Random(seed).randrange(3, 50_000) for _ in range(blocks * BLOCK + 5)]
    keys = block_keys(tokens, BLOCK)
    return Prompt(len(tokens), BLOCK, tree.prefix_depths(keys), keys)


def _first(router: CacheAwareHome, prompt: Prompt, inflight: tuple[int, int, int]) -> RankId:
    candidates = [Candidate(r, n) for r, n in zip((R0, R1, R2), inflight, strict=True)]
    return router.decide(candidates, prompt).ranked[0].rank


@pytest.mark.parametrize(
    ("homed", "inflight", "expected"),
    [
        ((40, 10, 0), (0, 0, 0), R2),  # equal loads: the fewest homed blocks
        ((40, 10, 50), (0, 0, 0), R1),
        ((0, 10, 20), (3, 0, 0), R0),  # within the load bound (4): blocks decide, not load
        ((0, 10, 20), (5, 0, 0), R1),  # beyond it: the fewest among the rest
    ],
)
def test_a_new_prefix_goes_to_the_rank_with_the_fewest_homed_blocks(
    homed: tuple[int, int, int], inflight: tuple[int, int, int], expected: RankId
) -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    for i, (rank, blocks) in enumerate(zip((R0, R1, R2), homed, strict=True)):
        if blocks:
            router.table.place(-1 - i, rank, blocks)
    prompt = _prompt(tree, seed=1)
    assert _first(router, prompt, inflight) == expected
    home = router.table.lookup(router.table.anchor(prompt.keys))
    assert home is not None and home.rank == expected
    assert home.blocks == 12
    # the ledger's booking follows the home: cache_aware counts the blocks as held there
    assert router.inner.ledger.demand(expected) == 12


def test_a_homed_prefix_stays_through_a_load_difference_up_to_the_keep_bound() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prompt = _prompt(tree, seed=2)
    router.table.place(router.table.anchor(prompt.keys), R1, 12)
    assert _first(router, prompt, (0, 1, 0)) == R1  # one request heavier: stays
    assert _first(router, prompt, (0, 8, 0)) == R1  # keep_bound (8) heavier: stays
    assert _first(router, prompt, (0, 9, 0)) != R1  # beyond: cache_aware sends it away ...
    home = router.table.lookup(router.table.anchor(prompt.keys))
    assert home is not None and home.rank == R1  # ... and the home stays


def test_a_home_that_lost_its_prefix_is_placed_again_once_settled() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prompt = _prompt(tree, seed=3)  # the index holds nothing: the home does not hold it
    anchor = router.table.anchor(prompt.keys)
    router.table.place(anchor, R0, 12)
    router.table.place(-1, R1, 5)
    clock.now = 0.05  # before settle_s (0.1): the first request may still be queued
    assert _first(router, prompt, (0, 0, 0)) == R0
    clock.now = 0.2
    assert _first(router, prompt, (0, 0, 0)) == R2  # re-placed, by the fewest homed blocks
    home = router.table.lookup(anchor)
    assert home is not None and (home.rank, home.generation) == (R2, 1)


def test_the_home_table_is_bounded_least_recently_used_out_first() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(max_homes=3), clock)
    for anchor in range(3):
        table.place(anchor, R0, 10)
    assert table.lookup(0) is not None  # 0 used again: 1 is now the oldest
    table.place(3, R1, 10)
    table.place(4, R1, 10)
    assert len(table) == 3
    assert [table.lookup(a) is not None for a in range(5)] == [True, False, False, True, True]


def test_homed_blocks_age_like_demand_and_unused_homes_are_forgotten() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(half_life_s=10.0, forget_half_lives=4.0), clock)
    table.place(1, R0, 40)
    assert table.homed(R0) == 40
    clock.now = 10.0
    assert table.homed(R0) == pytest.approx(20.0)
    clock.now = 39.0
    assert table.lookup(1) is not None  # used: its age starts again
    assert table.homed(R0) == 40
    clock.now = 80.0  # 41 s unused, more than 4 half-lives
    assert table.lookup(1) is None
    assert len(table) == 0


def test_siblings_that_placed_a_prefix_at_once_converge_on_one_home() -> None:
    clock = _Clock()
    a, b = HomeTable(HomeSettings(), clock), HomeTable(HomeSettings(), clock)
    mine, theirs = a.place(7, R2, 10), b.place(7, R1, 10)  # the same moment, apart
    a.place(7, theirs.rank, theirs.blocks, theirs.generation, theirs.set_at)
    b.place(7, mine.rank, mine.blocks, mine.generation, mine.set_at)
    assert a.lookup(7).rank == b.lookup(7).rank == R1  # type: ignore[union-attr]
    # a re-placement (a later generation) replaces the home on the sibling too
    clock.now = 1.0
    moved = a.place(7, R0, 10, generation=1)
    b.place(7, moved.rank, moved.blocks, moved.generation, moved.set_at)
    assert b.lookup(7).rank == R0  # type: ignore[union-attr]
    # news of the older home arriving late changes nothing
    b.place(7, theirs.rank, theirs.blocks, theirs.generation, theirs.set_at)
    assert b.lookup(7).rank == R0  # type: ignore[union-attr]


def test_cache_aware_home_keeps_each_prefix_on_about_one_worker_as_online_greedy() -> None:
    w = Workload("t", 4, 16, (10, 30), 0.85, 4, shuffled=True, concurrency=8)
    _, lengths = build_requests(w, seed=2)
    home = play(w, 2, CACHE_AWARE_HOME)
    greedy = play(w, 2, ONLINE_GREEDY)
    assert home.placement_spread <= max(lengths) + 2
    assert home.ranks_per_prefix <= 1.1
    assert home.ratio >= greedy.ratio - 0.01
