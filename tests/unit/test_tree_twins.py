"""The compiled layout (`cachetree._tables`: native maps and nodes, C runs) against the pure one.

The same random operation streams are applied to a tree of each layout (the compiled one with
`_tables.remove_run` / `place_run`, the pure one with `_remove_run_py` / `_place_run_py`);
every return value and the whole state (nodes in insertion order with every field, each
rank's hash map in its order and counts, the stats) must be equal. The
streams reach every case the runs hand to the general path: other tiers, hashes an engine
reuses for another block, carriers that disagree on a block's engine hash, unknown parents
and hashes, rank clears, and rank indices past one machine word (70 ranks).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest

from cachetree.ranks import RankId
from cachetree.tiers import DEVICE, DISK, HOST
from cachetree.tree import COMPILED_LAYOUT, PURE_LAYOUT, BlockTree, TreeLayout

tables = pytest.importorskip(
    "cachetree._tables", reason="the compiled accelerator is not built (pip install -e .)"
)
if COMPILED_LAYOUT is None:
    pytest.skip("KVROUTER_NO_EXTENSIONS: the tree runs on the pure layout", allow_module_level=True)

BS = 2


def state(tree: BlockTree) -> Any:
    nodes = [(k, n.parent, n.mask, n.children, n.tiers, n.ehash) for k, n in tree._nodes.items()]
    ranks = {
        r: (st.index, list(st.by_engine_hash.items()), list(st.counts))
        for r, st in tree._ranks.items()
    }
    return nodes, ranks, dataclasses.astuple(tree.stats), tree.carried_blocks


def run_stream(seed: int, n_ranks: int, ops: int, layout: TreeLayout) -> tuple[list[Any], Any]:
    """Apply one random stream to a fresh tree; the results of every call and the end state."""
    rng = random.Random(seed)
    tree = BlockTree(BS, layout)
    ranks = [RankId(f"http://w{i}:8000", 0) for i in range(n_ranks)]
    # A small token alphabet and hash pool, so ranks share blocks and hashes get reused.
    vocab = list(range(1, 4))
    results: list[Any] = []
    held: dict[RankId, list[int]] = {r: [] for r in ranks}
    for _ in range(ops):
        rank = rng.choice(ranks)
        roll = rng.random()
        if roll < 0.6:
            n = rng.randint(1, 6)
            hashes = [rng.randrange(40) for _ in range(n)]
            tokens = [rng.choice(vocab) for _ in range(n * BS)]
            parent = None
            if held[rank] and rng.random() < 0.6:
                parent = rng.choice(held[rank])
            elif rng.random() < 0.05:
                parent = 999  # unknown
            tier = rng.choice([DEVICE] * 8 + [HOST, DISK, HOST | DEVICE, 0])
            results.append(tree.store(rank, parent, hashes, tokens, BS, tier))
            held[rank].extend(hashes)
        elif roll < 0.95:
            pool = held[rank] + [rng.randrange(60)]
            hashes = rng.sample(pool, min(len(pool), rng.randint(1, 8)))
            tier = rng.choice([None, None, DEVICE, DEVICE, HOST, DISK])
            results.append(tree.remove(rank, hashes, tier))
        else:
            results.append(tree.clear_rank(rank))
            held[rank].clear()
        results.append(tree.carried_blocks)
    return results, state(tree)


def compiled_with(
    remove_run: Callable[..., Any] = tables.remove_run,
    place_run: Callable[..., Any] = tables.place_run,
) -> TreeLayout:
    assert COMPILED_LAYOUT is not None
    return dataclasses.replace(COMPILED_LAYOUT, remove_run=remove_run, place_run=place_run)


@pytest.mark.parametrize("n_ranks", [1, 3, 70])
@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_layout_leaves_the_tree_exactly_as_the_pure_one(
    seed: int, n_ranks: int
) -> None:
    compiled = run_stream(seed, n_ranks, 400, compiled_with())
    pure = run_stream(seed, n_ranks, 400, PURE_LAYOUT)
    assert compiled[0] == pure[0]
    assert compiled[1] == pure[1]


def test_the_streams_reach_the_general_path_and_the_runs() -> None:
    """The comparison above is only worth something if both paths really run."""
    calls = {"run_stops_early": 0, "run_completes": 0}

    def counting(run: Callable[..., Any], n_of: Callable[[tuple[Any, ...]], int]) -> Any:
        def wrapped(*args: Any) -> Any:
            out = run(*args)
            key = "run_completes" if out[0] == n_of(args) else "run_stops_early"
            calls[key] += 1
            return out

        return wrapped

    layout = compiled_with(
        counting(tables.remove_run, lambda a: len(a[2])),
        counting(tables.place_run, lambda a: len(a[2])),
    )
    for seed in range(3):
        run_stream(seed, 70, 400, layout)
    assert calls["run_stops_early"] > 100
    assert calls["run_completes"] > 100


def test_the_runs_refuse_tables_of_the_other_layout() -> None:
    with pytest.raises(TypeError, match="NodeMap"):
        tables.place_run({}, {}, [1], [2], 0, None, 0)
    with pytest.raises(TypeError, match="NodeMap"):
        tables.remove_run(tables.NodeMap(), {}, [2], 0, 0, True)


def paths(tree: BlockTree, rng: random.Random, n: int) -> list[list[int]]:
    """Root-to-node key paths of `n` random nodes, some with a block the tree lacks after."""
    keys = list(tree._nodes)
    out = []
    for key in rng.sample(keys, min(n, len(keys))):
        path = [key]
        while (parent := tree._nodes[path[-1]].parent) is not None:
            path.append(parent)
        path.reverse()
        if rng.random() < 0.5:
            path.append(2**64 - 1 - rng.randrange(1000))
        out.append(path)
    return out


@pytest.mark.parametrize("n_ranks", [3, 70])
@pytest.mark.parametrize("seed", range(6))
def test_prefix_depths_answer_alike_on_both_layouts(seed: int, n_ranks: int) -> None:
    trees = []
    for layout in (compiled_with(), PURE_LAYOUT):
        rng = random.Random(seed)
        tree = BlockTree(BS, layout)
        ranks = [RankId(f"http://w{i}:8000", 0) for i in range(n_ranks)]
        for c in range(300):
            tokens = [rng.randrange(1, 4) for _ in range(BS * rng.randint(1, 6))]
            tier = rng.choice([DEVICE] * 6 + [HOST, DISK | DEVICE])
            tree.store(
                rng.choice(ranks),
                None,
                [c * 10 + i for i in range(len(tokens) // BS)],
                tokens,
                BS,
                tier,
            )
        trees.append(tree)
    for path in paths(trees[1], random.Random(seed), 60):
        answers = [
            (d.any_tier, d.device, d.depth_runs(), d.depth_runs(device=True))
            for d in (tree.prefix_depths(path) for tree in trees)
        ]
        assert answers[0] == answers[1]
        assert trees[0].match(path) == trees[1].match(path)


STEADY_BLOCKS = 500


@pytest.mark.parametrize("seed", range(3))
def test_the_layouts_answer_alike_while_the_compiled_tables_rebuild(seed: int) -> None:
    """Long chains of new blocks make the compiled maps grow again and again (the tables start
    at 8 slots); then, from empty again, each rank holds at most STEADY_BLOCKS, a chain stored
    evicting its oldest blocks as a full cache does, so the maps keep their size and are
    rebuilt at it. Runs and prefix lookups often meet a rebuild under way: a key in the old
    table or the new one (cachetree/_tables.c, "Rebuilding without a stall")."""
    phase = "growing"
    runs = ("place_run", "remove_run", "prefix_depths")
    mid_rebuild = {(name, p): 0 for name in runs for p in ("growing", "steady")}

    def counting(name: str, run: Callable[..., Any]) -> Any:
        def wrapped(*args: Any) -> Any:
            mid_rebuild[name, phase] += bool(args[0].rehash_left() or args[1].rehash_left())
            return run(*args)

        return wrapped

    layout = compiled_with(
        counting("remove_run", tables.remove_run), counting("place_run", tables.place_run)
    )
    rng = random.Random(seed)
    compiled, pure = BlockTree(BS, layout), BlockTree(BS, PURE_LAYOUT)
    ranks = [RankId(f"http://w{i}:8000", 0) for i in range(3)]
    held: dict[RankId, list[int]] = {r: [] for r in ranks}
    next_hash = 0
    for op in range(20_000):
        if op == 2_000:
            phase = "steady"
            for rank in ranks:
                assert compiled.clear_rank(rank) == pure.clear_rank(rank)
                held[rank].clear()
        rank = rng.choice(ranks)
        roll = rng.random()
        if roll < 0.6:
            # Short chains while steady: a rebuild then spans many runs.
            n = rng.randint(1, 63 if phase == "growing" else 8)
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            # Mostly new tokens; now and then a chain another rank stored (shared nodes).
            tokens = [rng.randrange(1, 10_000) for _ in range(n * BS)]
            parent = rng.choice(held[rank]) if held[rank] and rng.random() < 0.3 else None
            tier = rng.choice([DEVICE] * 8 + [HOST])
            got = [t.store(rank, parent, hashes, tokens, BS, tier) for t in (compiled, pure)]
            assert got[0] == got[1]
            held[rank].extend(hashes)
            if phase == "steady" and len(held[rank]) > STEADY_BLOCKS:
                evicted = held[rank][: len(held[rank]) - STEADY_BLOCKS]
                del held[rank][: len(evicted)]
                got = [t.remove(rank, evicted, None) for t in (compiled, pure)]
                assert got[0] == got[1]
        elif roll < 0.97:
            pool = held[rank]
            hashes = rng.sample(pool, min(len(pool), rng.randint(1, 40)))
            got = [t.remove(rank, hashes, None) for t in (compiled, pure)]
            assert got[0] == got[1]
        else:
            assert compiled.clear_rank(rank) == pure.clear_rank(rank)
            held[rank].clear()
        if compiled._nodes.rehash_left() and op % 3 == 0:
            for path in paths(pure, rng, 5):
                mid_rebuild["prefix_depths", phase] += 1
                answers = [
                    (d.any_tier, d.device, d.depth_runs(), d.depth_runs(device=True))
                    for d in (tree.prefix_depths(path) for tree in (compiled, pure))
                ]
                assert answers[0] == answers[1]
    assert state(compiled) == state(pure)
    assert min(mid_rebuild.values()) > 30, mid_rebuild


@pytest.mark.parametrize("seed", range(3))
def test_long_leaf_first_eviction_runs_leave_the_tree_as_the_pure_one(seed: int) -> None:
    """Evictions as a full cache sends them: runs of up to 600 hashes (past the run's prefetch
    stages and its 256 keys on the stack), each chain leaf first, with a hash unknown now and
    then and a block another rank also carries, so the staged lookups of a run meet removals,
    prunes and misses."""
    rng = random.Random(seed)
    compiled, pure = BlockTree(BS, compiled_with()), BlockTree(BS, PURE_LAYOUT)
    ranks = [RankId(f"http://w{i}:8000", 0) for i in range(3)]
    chains: dict[RankId, list[list[int]]] = {r: [] for r in ranks}
    shared = [rng.randrange(1, 4) for _ in range(BS * 4)]
    next_hash = 0
    for _ in range(300):
        rank = rng.choice(ranks)
        n = rng.randint(1, 150)
        hashes = list(range(next_hash, next_hash + 4 + n))
        next_hash += 4 + n
        tokens = shared + [rng.randrange(1, 10_000) for _ in range(n * BS)]
        got = [t.store(rank, None, hashes, tokens, BS, DEVICE) for t in (compiled, pure)]
        assert got[0] == got[1]
        chains[rank].append(hashes)
        if len(chains[rank]) > 6 and rng.random() < 0.5:
            evicted: list[int] = []
            while len(chains[rank]) > 2:
                evicted.extend(reversed(chains[rank].pop(0)))
                if rng.random() < 0.2:
                    evicted.append(2**64 - 1 - rng.randrange(1000))
            got = [t.remove(rank, evicted, None) for t in (compiled, pure)]
            assert got[0] == got[1]
    assert state(compiled) == state(pure)
