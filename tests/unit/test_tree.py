import dataclasses

import pytest

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE, DISK, HOST
from cachetree.tree import BlockTree

BS = 4
A = RankId("http://a:8000", 0)
B = RankId("http://b:8000", 0)
A1 = RankId("http://a:8000", 1)


def toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def keys_of(tokens: list[int]) -> list[int]:
    return block_keys(tokens, BS)


def store_chain(tree: BlockTree, rank: RankId, tokens: list[int], first_hash: int, **kw) -> list:
    hashes = list(range(first_hash, first_hash + len(tokens) // BS))
    tree.store(rank, None, hashes, tokens, BS, **kw)
    return hashes


def test_store_places_each_block_under_the_root_chain() -> None:
    tree = BlockTree(BS)
    assert tree.store(A, None, [10, 11, 12], toks(3), BS) == 3
    assert len(tree) == 3
    assert tree.match(keys_of(toks(3))).blocks == 3
    assert tree.carriers(keys_of(toks(3))[2]) == {A: DEVICE}
    assert tree.block_count(A) == 3


def test_store_under_a_known_parent_extends_that_chain() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], toks(2), BS)
    tree.store(A, 11, [12], toks(1, start=9), BS)
    assert tree.match(keys_of(toks(3))).blocks == 3
    assert tree.stats.unknown_parent == 0


def test_store_with_an_unknown_parent_is_dropped_and_counted() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    assert tree.store(A, 999, [12], toks(1, start=5), BS) == 0
    assert tree.stats.unknown_parent == 1
    assert len(tree) == 1


def test_a_parent_carried_only_by_another_rank_is_unknown_for_this_rank() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    assert tree.store(B, 10, [11], toks(1, start=5), BS) == 0
    assert tree.stats.unknown_parent == 1


def test_store_without_medium_is_device_and_unknown_medium_is_dropped() -> None:
    tree = BlockTree(BS)
    assert tree.store(A, None, [10], toks(1), BS, tier=0) == 0
    assert tree.stats.unknown_tier == 1
    assert len(tree) == 0
    assert tree.store(A, None, [10], toks(1), BS, tier=1 << 7) == 0
    assert tree.stats.unknown_tier == 2


def test_store_with_another_block_size_is_dropped_and_counted() -> None:
    tree = BlockTree(BS)
    assert tree.store(A, None, [10], list(range(8)), 8) == 0
    assert tree.stats.wrong_block_size == 1


def test_store_whose_tokens_do_not_fill_its_hashes_is_dropped() -> None:
    tree = BlockTree(BS)
    assert tree.store(A, None, [10, 11], toks(1), BS) == 0
    assert tree.stats.malformed_store == 1
    assert len(tree) == 0


def test_tiers_are_or_ed_in_per_carrier() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(A, None, [10], toks(1), BS, tier=HOST)
    tree.store(B, None, [20], toks(1), BS, tier=DISK)
    key = keys_of(toks(1))[0]
    assert tree.carriers(key) == {A: DEVICE | HOST, B: DISK}
    assert tree.block_count(A, DEVICE) == 1
    assert tree.block_count(A, HOST) == 1
    assert tree.block_count(B, DISK) == 1
    assert tree.block_count(B, DEVICE) == 0


def test_remove_with_a_known_tier_clears_only_that_bit() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(A, None, [10], toks(1), BS, tier=HOST)
    assert tree.remove(A, [10], HOST) == 1
    assert tree.carriers(keys_of(toks(1))[0]) == {A: DEVICE}
    assert tree.block_count(A, HOST) == 0


def test_remove_without_tier_clears_every_tier_and_prunes() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS, tier=HOST | DISK)
    tree.remove(A, [10], None)
    assert len(tree) == 0
    assert tree.block_counts() == {}


def test_remove_of_a_tier_the_carrier_lacks_changes_nothing() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.remove(A, [10], DISK)
    assert tree.carriers(keys_of(toks(1))[0]) == {A: DEVICE}


def test_removing_a_leaf_prunes_bare_ancestors_in_a_cascade() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11, 12], toks(3), BS)
    tree.remove(A, [10, 11], None)  # ancestors lose their carrier but keep a child
    assert len(tree) == 3
    tree.remove(A, [12], None)
    assert len(tree) == 0


def test_a_node_another_rank_still_carries_survives_removal() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], toks(2), BS)
    tree.store(B, None, [20, 21], toks(2), BS)
    tree.remove(A, [10, 11], None)
    assert len(tree) == 2
    assert tree.carriers(keys_of(toks(2))[1]) == {B: DEVICE}


def test_removal_of_unknown_hashes_is_counted_and_harmless() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    assert tree.remove(A, [77, 78], None) == 0
    assert tree.remove(B, [10], None) == 0
    assert tree.stats.unknown_removal == 3
    assert len(tree) == 1


def test_clear_rank_forgets_only_that_rank_and_prunes() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], toks(2), BS)
    tree.store(B, None, [20], toks(1), BS)
    tree.store(A, None, [30], toks(1, start=100), BS)
    assert tree.clear_rank(A) == 3
    assert tree.ranks() == [B]
    assert len(tree) == 1
    assert tree.clear_rank(A) == 0


def test_rank_indices_are_reused_after_clear_without_mixing_carriers() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(B, None, [20], toks(1, start=50), BS)
    tree.clear_rank(A)
    tree.store(A1, None, [30], toks(1, start=90), BS)
    assert tree.carriers(keys_of(toks(1, start=50))[0]) == {B: DEVICE}
    assert tree.carriers(keys_of(toks(1, start=90))[0]) == {A1: DEVICE}


def test_match_returns_depth_and_the_deepest_nodes_carriers() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11, 12], toks(3), BS)
    tree.store(B, None, [20, 21], toks(2), BS, tier=HOST)
    m = tree.match(keys_of(toks(4)))
    assert m.blocks == 3
    assert m.carriers == ((A, DEVICE),)
    assert tree.match(keys_of(toks(2, start=500))).blocks == 0
    assert tree.match(keys_of(toks(2, start=500))).carriers == ()


def test_prefix_depths_counts_contiguous_blocks_from_block_zero_per_rank() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11, 12, 13], toks(4), BS)
    tree.store(B, None, [20, 21], toks(2), BS)
    tree.remove(A, [11], None)  # A keeps blocks 2 and 3 but loses block 1
    depths = tree.prefix_depths(keys_of(toks(5)))
    assert depths.any_tier == {A: 1, B: 2}
    assert depths.device == {A: 1, B: 2}


def test_prefix_depths_separates_device_from_lower_tiers() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11, 12], toks(3), BS)
    tree.store(A, 11, [12], toks(1, start=9), BS, tier=HOST)
    tree.remove(A, [12], DEVICE)  # block 2 now only on host
    tree.store(B, None, [20, 21, 22], toks(3), BS, tier=DISK)
    depths = tree.prefix_depths(keys_of(toks(3)))
    assert depths.any_tier == {A: 3, B: 3}
    assert depths.device == {A: 2}


def test_prefix_depths_of_an_unknown_prompt_is_empty() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    assert tree.prefix_depths(keys_of(toks(2, start=300))).any_tier == {}
    assert tree.prefix_depths([]).any_tier == {}


def test_prefix_depths_over_many_ranks() -> None:
    tree = BlockTree(BS)
    ranks = [RankId(f"http://w{i}", 0) for i in range(70)]
    for i, rank in enumerate(ranks):
        n = i % 5 + 1
        tree.store(rank, None, list(range(1000 * i, 1000 * i + n)), toks(n), BS)
    depths = tree.prefix_depths(keys_of(toks(6)))
    assert depths.any_tier == {rank: i % 5 + 1 for i, rank in enumerate(ranks)}


def test_reannouncing_a_block_under_a_new_engine_hash_repoints_removal() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(A, None, [99], toks(1), BS)
    assert tree.remove(A, [10], None) == 0  # the old hash no longer names the block
    assert tree.block_count(A) == 1
    assert tree.remove(A, [99], None) == 1
    assert len(tree) == 0


def test_an_engine_hash_reused_for_another_block_moves_the_carrier() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(A, None, [10], toks(1, start=40), BS)
    assert len(tree) == 1
    assert tree.carriers(keys_of(toks(1, start=40))[0]) == {A: DEVICE}
    assert tree.block_count(A, DEVICE) == 1


def test_carriers_with_different_engine_hashes_keep_their_own() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS)
    tree.store(B, None, [20], toks(1), BS)
    key = keys_of(toks(1))[0]
    assert tree.engine_hash(A, key) == 10
    assert tree.engine_hash(B, key) == 20
    tree.remove(B, [20], None)
    assert tree.engine_hash(A, key) == 10
    assert tree.engine_hash(B, key) is None


def test_holds_is_whether_the_rank_carries_the_block_on_any_tier() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS, tier=HOST)
    tree.store(B, None, [20], toks(1), BS)
    key, other = keys_of(toks(1))[0], keys_of(toks(1, start=40))[0]
    unknown = RankId("http://w:9", 0)
    assert [tree.holds(r, key) for r in (A, B, unknown)] == [True, True, False]
    assert not tree.holds(A, other)
    tree.remove(B, [20], None)
    assert [tree.holds(r, key) for r in (A, B)] == [True, False]
    for rank in (A, B, unknown):  # the same answer as the engine hash gives
        assert tree.holds(rank, key) == (tree.engine_hash(rank, key) is not None)


def test_namespaced_stores_match_only_namespaced_prompts() -> None:
    from cachetree.keys import namespace_seed

    tree = BlockTree(BS)
    tree.store(A, None, [10], toks(1), BS, namespace="lora-x")
    assert tree.match(keys_of(toks(1))).blocks == 0
    assert tree.match(block_keys(toks(1), BS, namespace_seed("lora-x"))).blocks == 1


def test_block_counts_report_each_rank_and_tier() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], toks(2), BS, tier=DEVICE | HOST)
    tree.store(B, None, [20], toks(1), BS)
    assert tree.block_counts() == {(A, "device"): 2, (A, "host"): 2, (B, "device"): 1}


def test_device_blocks_are_each_ranks_device_count_in_order() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], toks(2), BS, tier=DEVICE | HOST)
    tree.store(A, None, [12], toks(1, start=50), BS, tier=HOST)
    tree.store(B, None, [20], toks(1), BS)
    unknown = RankId("http://w:9", 3)
    assert tree.device_blocks([B, unknown, A]) == [1, 0, 2]
    assert tree.device_blocks([B, unknown, A]) == [
        tree.block_count(r, DEVICE) for r in (B, unknown, A)
    ]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BlockTree(0)


def seen_by_readers(tree: BlockTree, *prompts: list[int]) -> tuple:
    """What routing, metrics and a sibling's graft read of the tree: depths per prompt (any
    tier and device), each prompt block's carriers, the ranks and their counts, and the tree an
    export of it restores."""
    from cachetree.snapshot import canonical_view, export, restore

    copy = BlockTree(BS)
    restore(copy, export(tree))
    depths = [tree.prefix_depths(keys_of(p)) for p in prompts]
    return (
        [(d.any_tier, d.device) for d in depths],
        [tree.carriers(k) for p in prompts for k in keys_of(p)],
        sorted(tree.ranks()),
        tree.block_counts(),
        tree.carried_blocks,
        canonical_view(copy),
    )


def test_a_staged_state_is_seen_by_no_reader_until_one_step_swaps_it_for_the_old() -> None:
    old, new, shared = toks(5), toks(4, start=500), toks(3)
    tree = BlockTree(BS)
    store_chain(tree, A, old, 1)
    store_chain(tree, B, shared, 1)
    store_chain(tree, B, toks(2, start=900), 90, tier=HOST)
    before = seen_by_readers(tree, old, new)
    tree.stage_rank(A)
    tree.store(A, None, [1, 2, 3], shared, BS, staged=True)  # blocks the old state holds too
    tree.store(A, None, [50, 51, 52, 53], new, BS, DISK, staged=True)
    assert seen_by_readers(tree, old, new) == before
    reference = BlockTree(BS)  # the rank cleared, then the new blocks stored
    store_chain(reference, B, shared, 1)
    store_chain(reference, B, toks(2, start=900), 90, tier=HOST)
    store_chain(reference, A, shared, 1)
    reference.store(A, None, [50, 51, 52, 53], new, BS, DISK)
    after = seen_by_readers(reference, old, new)
    swap = tree.swap_staged_steps(A, 1)  # the old state dropped a block a step
    steps = 0
    for _ in swap:
        steps += 1
        assert seen_by_readers(tree, old, new) == after  # the new state whole from step one
    assert steps == 4  # 5 old blocks, a step between each two
    assert seen_by_readers(tree, old, new) == after
    assert tree._hidden == 0 and len(tree) == len(reference)
    assert tree.block_count(A, DISK) == 4


def test_a_staged_state_s_nodes_count_in_len_and_match_depth_but_not_as_carriers() -> None:
    # Documented: both read the node map, and telling a node only hidden states hold from one
    # on the way to a visible carrier takes a walk of its subtree.
    tree = BlockTree(BS)
    store_chain(tree, A, toks(2), 1)
    tree.stage_rank(A)
    tree.store(A, None, [7, 8, 9], toks(3, start=500), BS, staged=True)
    assert len(tree) == 5
    staged = tree.match(keys_of(toks(3, start=500)))
    assert (staged.blocks, staged.carriers) == (3, ())
    assert tree.prefix_depths(keys_of(toks(3, start=500))).any_tier == {}


def test_a_dropped_stage_leaves_the_tree_as_it_was() -> None:
    tree = BlockTree(BS)
    store_chain(tree, A, toks(3), 1)
    before = seen_by_readers(tree, toks(3), toks(2, start=500))
    nodes = len(tree)
    tree.stage_rank(A)
    tree.store(A, None, [7, 8], toks(2, start=500), BS, staged=True)
    tree.store(A, 7, [9], toks(1, start=600), BS, staged=True)
    assert len(list(tree.drop_staged_steps(A, 1))) == 2
    assert seen_by_readers(tree, toks(3), toks(2, start=500)) == before
    assert tree._hidden == 0 and len(tree) == nodes
    assert tree._by_index == [tree._ranks[A]]  # the stage's index freed


def test_a_removal_hands_the_runs_the_callers_hash_list_itself_not_a_copy() -> None:
    """An evicting engine's batch is a list of dozens of hashes: `remove` reads it as it is
    (it never changes it), where it copied it on every call; any other iterable is listed."""
    seen: list[object] = []
    base = BlockTree(BS)._layout

    def recording(nodes: object, by_hash: object, hashes: list[int], *rest: object) -> object:
        seen.append(hashes)
        return base.remove_run(nodes, by_hash, hashes, *rest)

    tree = BlockTree(BS, dataclasses.replace(base, remove_run=recording))
    hashes = store_chain(tree, A, toks(3), 10)
    evicted = list(reversed(hashes))
    assert tree.remove(A, evicted) == 3
    assert seen and all(h is evicted for h in seen)
    assert evicted == [12, 11, 10]  # untouched
    store_chain(tree, A, toks(3), 10)
    assert tree.remove(A, iter(evicted)) == 3
    assert seen[-1] == evicted and seen[-1] is not evicted
    assert len(tree) == 0
