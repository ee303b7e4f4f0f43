"""`rebuild_rank`: a worker's own snapshot replayed into the index, a chain per run of blocks,
each chain root keyed in the namespace (LoRA adapter, cache salt) it names.

The rebuild gathers each run of blocks that continue one another on one tier into one store;
the tree it leaves must be the one a store per block leaves (every node, parent, carrier, tier
and engine hash), whatever the snapshot's shape: forests listed depth first or breadth first,
tiers changing inside a chain, blocks of an unknown tier (skipped with their descendants), a
rank that held other blocks before.
"""

from __future__ import annotations

import gc
import random

import msgspec
import pytest

from cachetree.keys import block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from cachetree.tiers import TIER_NAMES
from cachetree.tree import BlockTree
from router.events import namespace_of
from router.worker_snapshot import (
    SnapshotBlock,
    SnapshotDecode,
    SnapshotRank,
    WorkerSnapshot,
    WorkerSnapshotError,
    adapter_names,
    decode_worker_snapshot,
    rebuild_rank,
)
from tests.support.steps import counted_steps

BS = 4
R = RankId("http://w:8000", 0)
OTHER = RankId("http://w:8000", 1)
TIERS = [*TIER_NAMES.values(), "tape"]  # the last one no index knows


def random_snapshot(rng: random.Random, blocks: int) -> SnapshotRank:
    """A forest of `blocks` blocks, parents listed before children, in an order that keeps
    long runs (a prompt's blocks one after the other) or breaks them up at random."""
    listed: list[SnapshotBlock] = []
    hashes: list[int] = []
    chained = rng.random() < 0.7
    for i in range(blocks):
        if not hashes or rng.random() < 0.1:
            parent = None
        elif chained and rng.random() < 0.85:
            parent = hashes[-1]
        else:
            parent = rng.choice(hashes)
        engine_hash = rng.choice([i + 1, -(i + 1), (1 << 64) - 1 - i])  # SGLang's are signed
        tier = rng.choice(TIERS) if rng.random() < 0.2 else (TIERS[0] if chained else None)
        tokens = [rng.randrange(1 << 32) for _ in range(BS)]
        listed.append(SnapshotBlock(engine_hash, parent, tokens, tier))
        hashes.append(engine_hash)
    return SnapshotRank(0, 7, listed)


def rebuilt_block_by_block(tree: BlockTree, rank: RankId, snap: SnapshotRank) -> int:
    """The reference: a store per block, a block of an unknown tier and its descendants left
    out."""
    tree.clear_rank(rank)
    names = {name: bit for bit, name in TIER_NAMES.items()}
    left_out: set[int] = set()
    placed = 0
    mask = (1 << 64) - 1
    for block in snap.blocks:
        engine_hash = block.engine_hash & mask
        parent = None if block.parent_engine_hash is None else block.parent_engine_hash & mask
        tier = names.get(block.tier) if block.tier is not None else None
        if tier is None or parent in left_out:
            left_out.add(engine_hash)
            continue
        placed += tree.store(rank, parent, (engine_hash,), block.token_ids, BS, tier)
    return placed


def tree_with_other_blocks(rng: random.Random) -> BlockTree:
    tree = BlockTree(BS)
    for rank in (R, OTHER):
        before = random_snapshot(rng, 30)
        rebuilt_block_by_block(tree, rank, before)
    return tree


@pytest.mark.parametrize("seed", range(40))
def test_a_rebuild_by_chains_leaves_the_tree_a_store_per_block_leaves(seed: int) -> None:
    rng = random.Random(seed)
    snap = random_snapshot(rng, rng.randrange(1, 120))
    by_chains = tree_with_other_blocks(random.Random(seed + 1000))
    by_blocks = tree_with_other_blocks(random.Random(seed + 1000))
    placed = rebuild_rank(by_chains, R, snap, BS)
    assert placed == rebuilt_block_by_block(by_blocks, R, snap)
    assert canonical_view(by_chains) == canonical_view(by_blocks)
    assert by_chains.block_count(R) == by_blocks.block_count(R)
    assert by_chains.stats == by_blocks.stats  # nothing counted refused: a skip is no error


def test_a_prompt_listed_block_after_block_is_stored_as_one_chain() -> None:
    """Fewer stores, not other blocks: ten blocks that continue one another are one call."""
    blocks, parent = [], None
    for i in range(10):
        blocks.append(SnapshotBlock(i + 1, parent, [i] * BS))
        parent = i + 1
    tree = BlockTree(BS)
    calls: list[int] = []
    store = tree.store

    def counted(*args: object, **kwargs: object) -> int:
        calls.append(len(args[2]))  # type: ignore[arg-type]
        return store(*args, **kwargs)  # type: ignore[arg-type]

    tree.store = counted  # type: ignore[method-assign]
    assert rebuild_rank(tree, R, SnapshotRank(0, 3, blocks), BS) == 10
    assert calls == [10]
    assert tree.block_count(R) == 10


def adapter_body() -> bytes:
    """A worker's body as the fake worker (an engine plugin) writes it: one prompt cached under
    the adapter "sql" (its root names it) and the same prompt under the base model."""
    tokens = list(range(1, 1 + 2 * BS))
    blocks = [
        {"engine_hash": 1, "parent_engine_hash": None, "token_ids": tokens[:BS], "tier": "device"},
        {"engine_hash": 2, "parent_engine_hash": 1, "token_ids": tokens[BS:], "tier": "device"},
        {
            "engine_hash": 11,
            "parent_engine_hash": None,
            "token_ids": tokens[:BS],
            "tier": "device",
            "lora_name": "sql",
        },
        {
            "engine_hash": 12,
            "parent_engine_hash": 11,
            "token_ids": tokens[BS:],
            "tier": "device",
            "lora_name": "sql",
        },
    ]
    return msgspec.json.encode(
        {"ranks": [{"dp_rank": 0, "last_seq": 5, "blocks": blocks}], "block_size": BS}
    )


def test_a_root_naming_an_adapter_keys_its_chain_in_the_adapters_namespace() -> None:
    snap = decode_worker_snapshot(adapter_body())
    tree = BlockTree(BS)
    assert rebuild_rank(tree, R, snap.ranks[0], BS) == 4
    tokens = list(range(1, 1 + 2 * BS))
    base = tree.prefix_depths(block_keys(tokens, BS)).any_tier
    sql = tree.prefix_depths(block_keys(tokens, BS, namespace_seed("sql"))).any_tier
    assert base == {R: 2} and sql == {R: 2}
    # The same blocks a live store under the adapter places (`events.namespace_of`).
    live = BlockTree(BS)
    live.store(R, None, [1, 2], tokens, BS)
    live.store(R, None, [11, 12], tokens, BS, namespace="sql")
    assert canonical_view(tree) == canonical_view(live)
    assert adapter_names(snap.ranks) == {"sql"}


def test_a_cache_salt_joins_the_roots_namespace_and_a_childs_fields_are_not_read() -> None:
    tokens = list(range(1, 1 + 2 * BS))
    blocks = [
        SnapshotBlock(1, None, tokens[:BS], lora_name="sql", cache_salt="s"),
        # A child's fields do not count: its key chains from its parent's, as a live store's.
        SnapshotBlock(2, 1, tokens[BS:], lora_name="chat"),
    ]
    tree = BlockTree(BS)
    rebuild_rank(tree, R, SnapshotRank(0, 1, blocks), BS)
    keys = block_keys(tokens, BS, namespace_seed(namespace_of("sql", "s")))
    assert tree.prefix_depths(keys).any_tier == {R: 2}
    assert adapter_names([SnapshotRank(0, 1, blocks)]) == {"sql"}


def test_a_body_without_adapters_keys_every_block_as_the_base_models() -> None:
    body = msgspec.json.decode(adapter_body())
    for block in body["ranks"][0]["blocks"]:
        block.pop("lora_name", None)
    snap = decode_worker_snapshot(msgspec.json.encode(body))
    tree = BlockTree(BS)
    rebuild_rank(tree, R, snap.ranks[0], BS)
    tokens = list(range(1, 1 + 2 * BS))
    assert tree.prefix_depths(block_keys(tokens, BS)).any_tier == {R: 2}
    assert tree.prefix_depths(block_keys(tokens, BS, namespace_seed("sql"))).any_tier == {}
    assert adapter_names(snap.ranks) == set()


def body_of(*ranks: SnapshotRank) -> bytes:
    return msgspec.json.encode(WorkerSnapshot(list(ranks), BS))


@pytest.mark.parametrize("budget", [1, 7, 1024])
@pytest.mark.parametrize("seed", range(10))
def test_a_body_decoded_in_slices_rebuilds_the_index_a_whole_decode_does(
    seed: int, budget: int
) -> None:
    rng = random.Random(seed)
    ranks = [random_snapshot(rng, rng.randrange(0, 120)) for _ in range(3)]
    for dp_rank, rank in enumerate(ranks):
        rank.dp_rank = dp_rank
    body = body_of(*ranks)
    job = SnapshotDecode(body)
    steps = 1
    while not job.step(budget):
        steps += 1
    blocks = sum(len(rank.blocks) for rank in ranks)
    assert steps == max(1, -(-blocks // budget))  # `budget` blocks a step, however ranks split
    sliced, whole = job.result(), msgspec.json.decode(body, type=WorkerSnapshot)
    assert sliced == whole
    by_slices, by_whole = BlockTree(BS), BlockTree(BS)
    for snap, tree in ((sliced, by_slices), (whole, by_whole)):
        for rank_snap in snap.ranks:
            rebuild_rank(tree, RankId(R.worker_url, rank_snap.dp_rank), rank_snap, BS)
    assert canonical_view(by_slices) == canonical_view(by_whole)


def test_a_bad_block_late_in_a_body_is_found_by_its_slice_and_named_as_a_whole_decode_does() -> (
    None
):
    """The slices before it decode; the body is refused whole (no result) at the slice
    holding it, with the block's place in the body."""
    rng = random.Random(5)
    good, last = random_snapshot(rng, 40), random_snapshot(rng, 30)
    last.dp_rank = 1
    raw = msgspec.json.decode(body_of(good, last))
    raw["ranks"][1]["blocks"][27]["token_ids"][2] = 1 << 32
    body = msgspec.json.encode(raw)
    with pytest.raises(msgspec.ValidationError) as whole:
        msgspec.json.decode(body, type=WorkerSnapshot)
    job = SnapshotDecode(body)
    for _ in range(6):  # blocks 0-59: rank 0's 40, rank 1's first 20
        assert not job.step(10)
    with pytest.raises(WorkerSnapshotError) as sliced:
        job.step(10)
    assert str(sliced.value) == f"not a kv-snapshot body: {whole.value}"
    assert "`$.ranks[1].blocks[27].token_ids[2]`" in str(sliced.value)
    with pytest.raises(RuntimeError):
        job.result()


def test_a_body_that_is_not_a_snapshot_is_refused_by_the_first_pass() -> None:
    with pytest.raises(WorkerSnapshotError, match="not a kv-snapshot body"):
        SnapshotDecode(b'{"block_size": 4, "ranks": [{"dp_rank": 0, "blocks": []}]}')
    with pytest.raises(WorkerSnapshotError, match="over 10"):
        SnapshotDecode(b" " * 11, limit=10)


def test_decoded_token_ids_leave_the_collectors_watch() -> None:
    """As lists, 160k decoded blocks stayed tracked and set off full collections of 150-270 ms
    inside a decode slice; tuples of ints are untracked at the first collection."""
    snap = decode_worker_snapshot(body_of(random_snapshot(random.Random(3), 50)))
    gc.collect()
    assert not any(gc.is_tracked(block.token_ids) for block in snap.ranks[0].blocks)


def test_a_worker_graft_is_built_in_slices_into_the_tree_a_rebuild_leaves() -> None:
    """The bootstrap path (a registering worker's own body grafted as a sibling's would be)
    builds its private tree in steps too: it held the loop for the whole rebuild."""
    from router.graft import LocalGraft

    rng = random.Random(11)
    ranks = [random_snapshot(rng, 60), random_snapshot(rng, 45)]
    ranks[1].dp_rank = 1
    turns, graft = counted_steps(
        LocalGraft.build_steps(R.worker_url, WorkerSnapshot(ranks, BS), BS, 8)
    )
    # A rank's checks, then its build, then the tree's export (listed, then walked): 8 a step.
    assert turns == 2 * 7 + 2 * 5 + 22
    expected = BlockTree(BS)
    for rank_snap in ranks:
        rebuild_rank(expected, RankId(R.worker_url, rank_snap.dp_rank), rank_snap, BS)
    assert canonical_view(graft.tree) == canonical_view(expected)
    assert graft.cursors == {R: 7, OTHER: 7}


def test_a_worker_graft_exports_its_tree_once_in_the_build_slices_and_grafts_that_export() -> None:
    """`LocalGraft.snapshot` exported the private tree in one call at every read and
    `begin_graft` read it twice: 30-40 ms each at 140k blocks, on the pump of a replica
    bootstrapping a registering worker from its own /v1/kv-snapshot."""
    from peer.tracker import BootstrapTracker
    from router.graft import BootstrapRules, LocalGraft
    from router.index import IndexRules

    turns, graft = counted_steps(
        LocalGraft.build_steps(
            R.worker_url, WorkerSnapshot([random_snapshot(random.Random(12), 60)], BS), BS, 8
        )
    )
    assert turns > 7 + 8  # the rank's checks and build, then its export: 8 blocks a step
    exported = graft.snapshot
    assert graft.snapshot is exported

    tracker = BootstrapTracker(60.0, clock=lambda: 0.0)
    index = IndexRules(BlockTree(BS))
    rules = BootstrapRules(index, tracker, lambda obligation, note: False, lambda: 0.0)
    index.bootstrap = rules
    index.add_ranks([R])
    job = rules.begin_graft(tracker.register([R]), graft, "worker")
    assert job is not None and job.vetted.snapshot is exported
    while not job.restore.step(16):
        pass
    assert rules.finish_graft(job) == [R]
    assert canonical_view(index.tree) == canonical_view(graft.tree)
