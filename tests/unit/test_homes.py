"""The prefix home table and its decisions (`router.homes`): each rule as a table or a
scenario over a real `BlockTree` and a real `PressureLedger`, an injected clock."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.homes import MAX_CHAIN_BLOCKS, CacheAwareHome, Home, HomeSettings, HomeTable
from router.policy import CacheAware, Candidate, Prompt
from router.pressure import PressureLedger

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
    return table.place(table.home(rank, keys, depth))


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
    moved = a.place(replace(theirs, rank=R0, generation=1, set_at=1.0, stamp=1.0))
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


def test_unused_homes_are_swept_from_the_table_without_being_looked_up() -> None:
    clock = _Clock()
    table = HomeTable(HomeSettings(half_life_s=10.0, forget_half_lives=4.0), clock)
    chains = [block_keys(_tokens(i, 10), BLOCK) for i in range(3)]
    for i, keys in enumerate(chains):
        clock.now = 10.0 * i
        _home(table, R0, keys)
    clock.now = 45.0  # the first (used at 0) is 45 s old, past 40: swept; the rest stay
    table.forget()
    assert len(table) == 2 and table.stats.forgotten == 1
    assert table.homed(R0) == pytest.approx(10 * (0.5**3.5 + 0.5**2.5))
    clock.now = 100.0
    table.forget()
    assert len(table) == 0 and table.homed(R0) == 0 and table.ranks() == []


def test_homed_blocks_kept_as_running_sums_match_the_sum_over_the_homes() -> None:
    clock = _Clock()
    settings = HomeSettings(half_life_s=5.0, forget_half_lives=3.0, max_homes=40)
    table = HomeTable(settings, clock)
    rng = random.Random(3)
    chains = [block_keys(_tokens(i, rng.randrange(1, 30)), BLOCK) for i in range(60)]
    for _ in range(2000):  # places, uses, evictions, forgetting and rebases, in any order
        clock.now += rng.uniform(0.0, 0.5)
        keys = rng.choice(chains)
        if table.find(keys) is None:
            _home(table, rng.choice((R0, R1, R2)), keys)
        table.forget()
        homes = list(table._homes.values())
        for rank in (R0, R1, R2):
            want = sum(
                h.blocks * 0.5 ** ((clock.now - h.used_at) / settings.half_life_s)
                for h in homes
                if h.rank == rank
            )
            assert table.homed(rank) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert table.stats.evicted > 0 and table.stats.forgotten > 0


def test_a_long_prompt_matching_a_capped_chain_to_its_end_is_a_repeat() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    prefix = _tokens(1, MAX_CHAIN_BLOCKS + 40)
    home = _home(router.table, R1, block_keys(prefix + _tokens(2, 2), BLOCK))
    assert len(home.chain) == MAX_CHAIN_BLOCKS and home.blocks == MAX_CHAIN_BLOCKS + 42
    _hold(tree, R1, prefix, MAX_CHAIN_BLOCKS + 40)
    clock.now = 1.0
    keys = block_keys(prefix + _tokens(3, 2), BLOCK)
    assert home.shared(keys) == len(keys)  # past the chain's end: held whole
    assert _send(router, tree, prefix + _tokens(3, 2)) == R1
    assert len(router.table) == 1  # a repeat: no new home


def test_a_siblings_home_is_adopted_and_its_prefix_goes_there() -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    mine, theirs = _router(clock, tree), _router(clock, tree)
    shared: list[Home] = []
    theirs.share = shared.append
    tokens = _tokens(4, 20)
    placed = _send(theirs, tree, tokens)
    assert [h.rank for h in shared] == [placed]
    for home in shared:
        mine.adopt(replace(home))
    assert mine.table.stats.adopted == 1
    # this replica has seen no store event and no booking of it: without the sibling's home
    # it would place the prefix by its own view, on the lightest rank (inflight 0)
    others = [r for r in (R0, R1, R2) if r != placed]
    inflight = tuple(0 if r in others else 2 for r in (R0, R1, R2))
    assert _send(mine, tree, tokens + _tokens(5, 1), inflight) == placed  # type: ignore[arg-type]
    assert mine.table.stats.placed == 0


def test_siblings_compare_homes_by_their_wall_clock_stamp_not_their_arrival() -> None:
    clock = _Clock()
    a = HomeTable(HomeSettings(), clock, wall=lambda: 100.0)
    keys = block_keys(_tokens(7, 30), BLOCK)
    mine = _home(a, R2, keys)  # stamped 100.0
    # the sibling's, placed earlier by the wall clock but arriving later: it wins
    a.place(replace(mine, rank=R1, stamp=99.9, set_at=5.0), sibling=True)
    assert a.find(keys).rank == R1  # type: ignore[union-attr]
    a.place(replace(mine, rank=R0, stamp=100.1), sibling=True)  # placed later: ignored
    assert a.find(keys).rank == R1  # type: ignore[union-attr]


@pytest.mark.parametrize(("over", "kept_away"), [(8, 0), (9, 1)])
def test_the_tables_counters_say_what_each_decision_did(over: int, kept_away: int) -> None:
    clock, tree = _Clock(), BlockTree(BLOCK)
    router = _router(clock, tree)
    tokens = _tokens(2, 12)
    home = _send(router, tree, tokens)  # placed
    inflight = tuple(over if r == home else 0 for r in (R0, R1, R2))
    went = _send(router, tree, tokens, inflight)  # type: ignore[arg-type]
    assert (went != home) == bool(kept_away)  # homed: stays, or kept away over the bound
    clock.now = 10.0  # the booking expired and the index never showed it: lost
    assert _send(router, tree, tokens) != home
    stats = router.table.stats
    assert (stats.placed, stats.replaced, stats.kept_away) == (1, 1, kept_away)
