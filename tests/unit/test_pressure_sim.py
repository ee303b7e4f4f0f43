"""The pressure simulator's diagnosis: where lost prefix blocks went, and how evenly the
first placements spread them (bench/pressure_sim.py, `--diagnose`); and the prefix home
table (`cache_aware_home`), anchored past shared preambles."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from bench.pressure_sim import (
    CACHE_AWARE_HOME,
    IDEAL,
    ONLINE_GREEDY,
    CacheAwareHome,
    Home,
    HomeSettings,
    HomeTable,
    Losses,
    Request,
    Workload,
    build_requests,
    holdouts,
    nested_headers,
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


# -- the prefix home table (cache_aware_home) ----------------------------------------------

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


def _tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 50_000) for _ in range(blocks * BLOCK)]


def _prompt(tree: BlockTree, tokens: list[int]) -> Prompt:
    keys = block_keys(tokens, BLOCK)
    return Prompt(len(tokens), BLOCK, tree.prefix_depths(keys), keys)


def _send(
    router: CacheAwareHome,
    tree: BlockTree,
    tokens: list[int],
    inflight: tuple[int, int, int] = (0, 0, 0),
) -> RankId:
    candidates = [Candidate(r, n) for r, n in zip((R0, R1, R2), inflight, strict=True)]
    return router.decide(candidates, _prompt(tree, tokens)).ranked[0].rank


def _hold(tree: BlockTree, rank: RankId, tokens: list[int], blocks: int) -> None:
    """The index shows `rank` holding the first `blocks` blocks of `tokens`."""
    tree.store(rank, None, list(range(blocks)), tokens[: blocks * BLOCK], BLOCK)


def _home(table: HomeTable, rank: RankId, keys: list[int], depth: int = 0) -> Home:
    """A home anchored at `keys[depth]` for a prompt of `keys`, placed in `table`."""
    join = keys[table.join_at(depth, len(keys))]
    home = Home(rank, keys[depth], depth, join, tuple(keys[depth:]), 0, table.clock())
    return table.place(home)


PREAMBLE = _tokens(100, 12)  # a shared system preamble, longer than any fixed anchor depth


def test_a_new_prefix_below_a_shared_preamble_gets_a_home_of_its_own() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prefixes = [PREAMBLE + _tokens(i, 40) for i in range(3)]
    homes = [_send(router, tree, p + _tokens(10 + i, 2)) for i, p in enumerate(prefixes)]
    assert sorted(homes) == sorted((R0, R1, R2))  # one each: not all on the first one's home
    assert len(router.table) == 3
    for i, prefix in enumerate(prefixes[1:], start=1):
        home = router.table.find(block_keys(prefix, BLOCK))
        # anchored at its own first block: the preamble, booked where the first went, is
        # held, so it is nobody's anchor
        assert home is not None and (home.depth, home.rank) == (12, homes[i])
    # their repeats, with tails of their own, go to their homes
    for i, prefix in enumerate(prefixes):
        assert _send(router, tree, prefix + _tokens(20 + i, 2)) == homes[i]
    # three prefixes' homes, and the three repeats' tails, homing no blocks till shared
    assert len(router.table) == 6
    assert [router.table.homed(rank) for rank in homes] == [54, 42, 42]


def test_a_preamble_first_seen_alone_splits_off_the_prefixes_below_it() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    alone = _send(router, tree, PREAMBLE + _tokens(1, 2))  # the preamble and one tail
    first = router.table.find(block_keys(PREAMBLE, BLOCK))
    assert first is not None and first.depth == 0
    below = _send(router, tree, PREAMBLE + _tokens(2, 40) + _tokens(3, 1))
    assert below != alone  # a prefix below the preamble: a home of its own, elsewhere
    home = router.table.find(block_keys(PREAMBLE + _tokens(2, 40), BLOCK))
    assert home is not None and (home.depth, home.rank) == (12, below)
    # a short prompt on the preamble alone is still the preamble's
    assert _send(router, tree, PREAMBLE + _tokens(4, 2)) == alone


def test_the_deepest_registered_key_along_the_chain_wins() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(), clock)
    shallow = PREAMBLE + _tokens(1, 30)
    deep = PREAMBLE + _tokens(2, 30)
    _home(table, R0, block_keys(shallow, BLOCK))
    _home(table, R1, block_keys(deep, BLOCK), depth=12)
    assert table.find(block_keys(deep + _tokens(3, 2), BLOCK)).rank == R1  # type: ignore[union-attr]
    assert table.find(block_keys(shallow + _tokens(4, 2), BLOCK)).rank == R0  # type: ignore[union-attr]
    # a third prefix below the preamble holds only the shallow home's anchor
    other = table.find(block_keys(PREAMBLE + _tokens(5, 30), BLOCK))
    assert other is not None and other.rank == R0
    assert other.shared(block_keys(PREAMBLE + _tokens(5, 30), BLOCK)) == 12  # leaves it there
    assert table.find(block_keys(_tokens(6, 30), BLOCK)) is None


def test_a_repeat_whose_prefix_the_caches_cut_short_stays_home() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prefix = _tokens(1, 40)
    _home(router.table, R1, block_keys(prefix + _tokens(2, 2), BLOCK))
    _hold(tree, R1, prefix, 20)  # its tail half evicted: 20 blocks of its own unheld
    clock.now = 10.0  # long settled
    # R1 has 42 blocks homed, the others none; the prompt holds the home's reach key, so
    # it is that prefix (not a new one at its first unheld block) and goes home
    assert _send(router, tree, prefix + _tokens(3, 2)) == R1
    assert router.table.homed(R1) == 42  # and its tail homes nothing


def test_a_repeat_leaves_its_home_at_its_prefix_end_however_much_the_caches_hold() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prefix = _tokens(1, 40)
    _home(router.table, R0, block_keys(prefix + _tokens(2, 14), BLOCK))  # a long tail
    _hold(tree, R0, prefix, 30)  # the prefix's last 10 blocks evicted
    clock.now = 10.0  # long settled
    # it goes on 10 blocks past the prefix (within tail_blocks, 11), 20 past what R0 holds:
    # a repeat, not a new prefix at its first unheld block (which would go to R1: 30 blocks
    # to store against R0's 54 homed)
    assert _send(router, tree, prefix + _tokens(3, 10)) == R0
    assert router.table.homed(R0) == 54 and router.table.homed(R1) == 0


def test_a_tail_a_second_prompt_shares_is_a_prefix_and_splits_its_parent_there() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    first = _home(router.table, R0, block_keys(PREAMBLE + _tokens(1, 20), BLOCK))
    _hold(tree, R0, PREAMBLE, 12)
    own = PREAMBLE + _tokens(2, 6)  # a prefix whose own part is shorter than tail_blocks
    assert _send(router, tree, own + _tokens(3, 1)) == R0  # taken for a repeat's tail
    assert first.confirmed == 12 and router.table.homed(R0) == 32
    assert _send(router, tree, own + _tokens(4, 1)) == R0  # its repeat shares it: a prefix
    assert first.confirmed == 13 and router.table.homed(R0) == 32 + 7
    # a prompt leaving the first home's chain at the preamble is now a new prefix, placed by
    # homed blocks, though its own part is as short
    assert _send(router, tree, PREAMBLE + _tokens(5, 6) + _tokens(6, 1)) in (R1, R2)


def test_siblings_share_the_depth_their_prompts_confirmed() -> None:
    clock = _Clock()
    a, b = HomeTable(HomeSettings(), clock), HomeTable(HomeSettings(), clock)
    keys = block_keys(PREAMBLE + _tokens(1, 20), BLOCK)
    mine = _home(a, R0, keys)
    b.place(replace(mine), sibling=True)
    news = a.observe(mine, block_keys(PREAMBLE + _tokens(1, 20) + _tokens(2, 3), BLOCK), 32)
    assert mine.confirmed == 32 and news[0] is mine and news[1].tail_of == mine.anchor
    for home in news:
        b.place(replace(home), sibling=True)
    assert b.find(keys).confirmed == 32  # type: ignore[union-attr]


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
            _home(router.table, rank, block_keys(_tokens(50 + i, blocks), BLOCK))
    tokens = _tokens(1, 12)
    assert _send(router, tree, tokens, inflight) == expected
    home = router.table.find(block_keys(tokens, BLOCK))
    assert home is not None and (home.rank, home.blocks) == (expected, 12)
    # the ledger's booking follows the home: cache_aware counts the blocks as held there
    assert router.inner.ledger.demand(expected) == 12


def test_a_new_prefix_pays_for_the_shared_part_a_rank_would_newly_store() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    _hold(tree, R0, PREAMBLE, 12)
    _hold(tree, R1, PREAMBLE, 12)
    _home(router.table, R0, block_keys(_tokens(50, 20), BLOCK))  # R0 given 20 blocks
    _home(router.table, R1, block_keys(_tokens(51, 8), BLOCK))  # R1 8; R2 none but lacks
    # the preamble: 12 blocks to store, more than R1's 8
    assert _send(router, tree, PREAMBLE + _tokens(1, 30)) == R1


def test_a_homed_prefix_stays_through_a_load_difference_up_to_the_keep_bound() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    tokens = _tokens(2, 12)
    _home(router.table, R1, block_keys(tokens, BLOCK))
    assert _send(router, tree, tokens, (0, 1, 0)) == R1  # one request heavier: stays
    assert _send(router, tree, tokens, (0, 8, 0)) == R1  # keep_bound (8) heavier: stays
    assert _send(router, tree, tokens, (0, 9, 0)) != R1  # beyond: cache_aware sends it away ...
    home = router.table.find(block_keys(tokens, BLOCK))
    assert home is not None and home.rank == R1  # ... and the home stays


def test_a_home_that_lost_its_prefix_is_placed_again_once_settled() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    tokens = _tokens(3, 12)  # the index holds nothing: the home does not hold it
    keys = block_keys(tokens, BLOCK)
    _home(router.table, R0, keys)
    _home(router.table, R1, block_keys(_tokens(50, 5), BLOCK))
    clock.now = 0.05  # before settle_s (0.1): the first request may still be queued
    assert _send(router, tree, tokens) == R0
    clock.now = 10.0  # the booking expired (5 s) and the index never showed the blocks
    assert _send(router, tree, tokens) == R2  # re-placed, by the fewest homed blocks
    home = router.table.find(keys)
    assert home is not None and (home.rank, home.generation) == (R2, 1)
    assert len(router.table) == 2


def test_the_home_table_is_bounded_least_recently_used_out_first() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(max_homes=3), clock)
    chains = [block_keys(_tokens(i, 10), BLOCK) for i in range(5)]
    for keys in chains[:3]:
        _home(table, R0, keys)
    assert table.find(chains[0]) is not None  # 0 used again: 1 is now the oldest
    _home(table, R1, chains[3])
    _home(table, R1, chains[4])
    assert len(table) == 3
    assert [table.find(keys) is not None for keys in chains] == [True, False, False, True, True]


def test_homed_blocks_age_like_demand_and_unused_homes_are_forgotten() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(half_life_s=10.0, forget_half_lives=4.0), clock)
    keys = block_keys(_tokens(1, 40), BLOCK)
    _home(table, R0, keys)
    assert table.homed(R0) == 40
    clock.now = 10.0
    assert table.homed(R0) == pytest.approx(20.0)
    clock.now = 39.0
    assert table.find(keys) is not None  # used: its age starts again
    assert table.homed(R0) == 40
    clock.now = 80.0  # 41 s unused, more than 4 half-lives
    assert table.find(keys) is None
    assert len(table) == 0


def test_siblings_that_placed_a_prefix_at_once_converge_on_one_home() -> None:
    clock = _Clock()
    a, b = HomeTable(HomeSettings(), clock), HomeTable(HomeSettings(), clock)
    keys = block_keys(_tokens(7, 30), BLOCK)
    mine, theirs = _home(a, R2, keys), _home(b, R1, keys)  # the same moment, apart
    a.place(replace(theirs), sibling=True)
    b.place(replace(mine), sibling=True)
    assert a.find(keys).rank == b.find(keys).rank == R1  # type: ignore[union-attr]
    # a re-placement (a later generation) replaces the home on the sibling too
    clock.now = 1.0
    moved = a.place(replace(theirs, rank=R0, generation=1, set_at=1.0))
    b.place(replace(moved), sibling=True)
    assert b.find(keys).rank == R0  # type: ignore[union-attr]
    # news of the older home arriving late changes nothing
    b.place(replace(theirs), sibling=True)
    assert b.find(keys).rank == R0  # type: ignore[union-attr]


def test_one_prefix_placed_twice_at_join_keys_apart_keeps_the_earlier_home() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(join_tail_blocks=8), clock)
    prefix = _tokens(8, 37)
    first = _home(table, R0, block_keys(prefix + _tokens(9, 1), BLOCK))  # 38: joined at 15
    clock.now = 0.001  # the sibling's, with a longer tail: 40 blocks, joined at 31
    _home(table, R1, block_keys(prefix + _tokens(10, 3), BLOCK))
    assert len(table) == 2
    assert table.find(block_keys(prefix + _tokens(11, 2), BLOCK)) is first
    assert len(table) == 1


def test_cache_aware_home_keeps_each_prefix_on_about_one_worker_as_online_greedy() -> None:
    w = Workload("t", 4, 16, (10, 30), 0.85, 4, shuffled=True, concurrency=8)
    _, lengths = build_requests(w, seed=2)
    home = play(w, 2, CACHE_AWARE_HOME)
    greedy = play(w, 2, ONLINE_GREEDY)
    assert home.placement_spread <= max(lengths) + 2
    assert home.ranks_per_prefix <= 1.1
    assert home.ratio >= greedy.ratio - 0.01


def test_cache_aware_home_spreads_prefixes_below_a_long_shared_preamble() -> None:
    (w,) = [w for w in nested_headers() if w.name == "4w-12p-header40-c6"]
    home = play(w, 1, CACHE_AWARE_HOME)
    ideal = play(w, 1, IDEAL)
    assert max(home.requests_per_rank.values()) <= 2 * min(home.requests_per_rank.values())
    assert home.ranks_per_prefix <= 1.2
    assert home.ratio >= 0.95 * ideal.ratio


def test_nested_headers_share_a_fleet_preamble_and_a_team_preamble() -> None:
    names = [w.name for w in nested_headers()]
    assert len(set(names)) == len(names)
    assert not set(names) & {w.name for w in workloads() + holdouts()}
    w = Workload("t", 2, 6, (20, 24), 0.85, 2, header_blocks=3, teams=2, team_blocks=5)
    requests, _ = build_requests(w, seed=1)
    firsts = {r.prefix: r.tokens for r in requests}
    fleet = [t[: 8 + 3 * BLOCK] for t in firsts.values()]  # "<|user|>" then the header
    assert all(f == fleet[0] for f in fleet)
    team = {p: t[8 : 8 + 8 * BLOCK] for p, t in firsts.items()}
    assert team[0] == team[2] == team[4] != team[1] == team[3] == team[5]
    assert len({tuple(t[: 8 + 9 * BLOCK]) for t in firsts.values()}) == 6  # then their own
