"""The pump's rules, driven by messages: cursors, losses, restarts, worker snapshots."""

import logging
import random

import pytest

from cachetree.keys import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_NAMES, block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from cachetree.tiers import DEVICE, HOST
from cachetree.tree import BlockTree
from router.dataplane.routing import model_asked, namespace_for
from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    fold_removal_runs,
)
from router.index import IndexRules
from router.subscriber import (
    LOSS_WARN_EVERY_S,
    MAX_SEQ_JUMP,
    LiveBatch,
    PublisherReset,
    UnrepairedGap,
)
from router.tokenize.chat_rules import Engine
from router.worker_snapshot import SnapshotBlock, SnapshotRank, WorkerSnapshot
from tests.support.clock import ManualClock

BS = 4
COMPLETIONS = b"/v1/completions"
R = RankId("http://w:1", 0)
OTHER = RankId("http://w:2", 0)


def stored(h: int, start: int, parent: int | None = None) -> EventBatch:
    tokens = list(range(start, start + BS))
    return EventBatch(0.0, [BlockStored([h], parent, tokens, BS, DEVICE, "GPU", None)], 0)


def removed(h: int) -> EventBatch:
    return EventBatch(0.0, [BlockRemoved([h], None, None)], 0)


def rules_with(*ranks: RankId) -> tuple[IndexRules, list[RankId]]:
    rules = IndexRules(BlockTree(BS))
    losses: list[RankId] = []
    rules.set_loss_handler(losses.append)
    rules.add_ranks(ranks or [R])
    return rules, losses


def test_seeded_cursor_filters_already_reflected_batches() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 5, stored(1, 1))
    rules.apply_batch(R, 5, removed(1))  # a duplicate of seq 5: must not apply
    rules.apply_batch(R, 3, removed(1))  # older: already reflected
    assert rules.stats.batches_skipped == 2
    assert rules.tree.block_count(R) == 1
    assert rules.cursors[R] == 5


def test_a_forward_jump_counts_exactly_the_missing_batches_and_asks_for_repair() -> None:
    rules, losses = rules_with()
    rules.apply_batch(R, 0, stored(1, 1))
    rules.apply_batch(R, 4, stored(2, 100))
    assert rules.stats.lost_batches[R] == 3
    assert losses == [R]
    assert rules.cursors[R] == 4
    assert rules.tree.block_count(R) == 2


def test_batch_zero_behind_a_cursor_is_a_restart_that_clears_the_rank_first() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 0, stored(1, 1))
    rules.apply_batch(R, 1, stored(2, 100))
    rules.apply_batch(R, 0, stored(3, 200))
    assert rules.stats.restarts_at_zero == 1
    assert rules.tree.block_count(R) == 1
    assert rules.tree.match(block_keys(list(range(200, 204)), BS)).blocks == 1
    assert rules.cursors[R] == 0


def test_publisher_reset_clears_the_rank_and_the_next_batch_starts_fresh() -> None:
    rules, losses = rules_with()
    rules.handle(LiveBatch(R, 7, stored(1, 1)))
    rules.handle(PublisherReset(R))
    assert R not in rules.cursors
    assert rules.tree.block_count(R) == 0
    rules.handle(LiveBatch(R, 3, stored(2, 100)))
    assert rules.cursors[R] == 3
    assert rules.stats.lost_batches[R] == 0
    assert losses == []


def test_a_seq_jump_reset_clears_the_rank_and_asks_for_its_snapshot_counting_no_loss() -> None:
    rules, losses = rules_with()
    rules.handle(LiveBatch(R, 7, stored(1, 1)))
    rules.handle(PublisherReset(R, jumped=True))
    assert R not in rules.cursors
    assert rules.tree.block_count(R) == 0
    assert losses == [R]
    assert (rules.stats.publisher_resets, rules.stats.lost_batches[R]) == (0, 0)


def test_an_unrepaired_gap_on_a_rank_without_a_cursor_is_counted_lost_there() -> None:
    """After a reset no cursor jump will count the new stream's unheard first batches."""
    rules, losses = rules_with()
    rules.handle(LiveBatch(R, 7, stored(1, 1)))
    rules.handle(PublisherReset(R))
    rules.handle(UnrepairedGap(R, 0, 2))
    rules.handle(LiveBatch(R, 3, stored(2, 100)))
    assert rules.stats.lost_batches[R] == 3
    assert losses == [R]
    # With a cursor, the next batch's jump counts the gap, once.
    rules.handle(UnrepairedGap(R, 4, 5))
    rules.handle(LiveBatch(R, 6, stored(3, 200)))
    assert rules.stats.lost_batches[R] == 5
    assert losses == [R, R, R]


@pytest.mark.parametrize("cursor", [2**64 - 1, 2**63, 8 + MAX_SEQ_JUMP + 1])
def test_a_batch_far_behind_an_impossible_cursor_is_a_new_stream_not_skipped(cursor: int) -> None:
    """A cursor no stream could have reached (a lying sibling's graft) must not freeze the
    rank: the batch clears it, asks for the worker's snapshot, and is applied."""
    rules, losses = rules_with()
    rules.apply_batch(R, 7, stored(1, 1))
    rules.cursors[R] = cursor  # as a graft sets it
    rules.handle(LiveBatch(R, 8, stored(2, 100)))
    assert rules.cursors[R] == 8
    assert rules.tree.block_count(R) == 1
    assert rules.tree.match(block_keys(list(range(100, 104)), BS)).blocks == 1
    assert (rules.stats.seq_jumps, rules.stats.batches_skipped) == (1, 0)
    assert losses == [R]


def test_a_batch_just_within_the_bound_behind_the_cursor_is_skipped_as_reflected() -> None:
    rules, losses = rules_with()
    rules.apply_batch(R, 7, stored(1, 1))
    rules.cursors[R] = 8 + MAX_SEQ_JUMP
    rules.handle(LiveBatch(R, 8, stored(2, 100)))
    assert rules.cursors[R] == 8 + MAX_SEQ_JUMP
    assert (rules.stats.seq_jumps, rules.stats.batches_skipped) == (0, 1)
    assert losses == []


def test_items_for_ranks_that_are_not_live_are_dropped() -> None:
    rules, _ = rules_with()
    rules.handle(LiveBatch(OTHER, 0, stored(1, 1)))
    assert rules.tree.block_count(OTHER) == 0
    assert rules.stats.batches_dropped_not_live == 1


def test_forget_ranks_clears_tree_and_cursor_and_stops_later_items() -> None:
    rules, _ = rules_with(R, OTHER)
    rules.apply_batch(R, 0, stored(1, 1))
    rules.apply_batch(OTHER, 0, stored(9, 1))
    rules.forget_ranks([R])
    rules.handle(LiveBatch(R, 1, stored(2, 50)))
    assert rules.tree.ranks() == [OTHER]
    assert R not in rules.cursors


def test_unrepaired_gap_asks_for_repair_without_touching_the_tree() -> None:
    rules, losses = rules_with()
    rules.apply_batch(R, 0, stored(1, 1))
    rules.handle(UnrepairedGap(R, 1, 2))
    assert losses == [R]
    assert rules.tree.block_count(R) == 1


def test_clear_event_empties_only_that_rank() -> None:
    rules, _ = rules_with(R, OTHER)
    rules.apply_batch(R, 0, stored(1, 1))
    rules.apply_batch(OTHER, 0, stored(9, 1))
    rules.apply_batch(R, 1, EventBatch(0.0, [AllBlocksCleared()], 0))
    assert rules.tree.ranks() == [OTHER]
    assert rules.stats.events["cleared", "none"] == 1


def snapshot(last_seq: int, *hashes: int) -> SnapshotRank:
    blocks = []
    parent = None
    for i, h in enumerate(hashes):
        blocks.append(SnapshotBlock(h, parent, list(range(1 + i * BS, 1 + (i + 1) * BS))))
        parent = h
    return SnapshotRank(0, last_seq, blocks)


def test_worker_snapshot_replaces_the_rank_and_seeds_the_cursor() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 2, stored(50, 500))
    assert rules.replace_rank(R, snapshot(4, 1, 2), BS) == "applied"
    assert rules.tree.block_count(R) == 2
    assert rules.tree.match(block_keys(list(range(500, 504)), BS)).blocks == 0
    assert rules.cursors[R] == 4
    rules.apply_batch(R, 4, removed(2))  # already reflected by the snapshot
    assert rules.tree.block_count(R) == 2


def test_worker_snapshot_older_than_the_stream_is_ignored() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 9, stored(50, 500))
    assert rules.replace_rank(R, snapshot(4, 1, 2), BS) == "stale"
    assert rules.stats.worker_snapshots_stale == 1
    assert rules.tree.block_count(R) == 1


def test_worker_snapshot_with_the_wrong_block_size_is_refused_and_changes_nothing() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 1, stored(50, 500))
    assert rules.replace_rank(R, snapshot(4, 1), BS * 2) == "rejected"
    assert rules.stats.worker_snapshots_rejected == 1
    assert rules.tree.block_count(R) == 1
    assert rules.cursors[R] == 1


def test_worker_snapshot_far_past_the_live_stream_is_refused_and_changes_nothing() -> None:
    """Installed, a last_seq of 2**63-1 made every later batch of the rank's stream look
    already reflected: the rank froze on blocks its engine had removed (false hits)."""
    rules, _ = rules_with()
    rules.apply_batch(R, 20, stored(50, 500))
    assert rules.replace_rank(R, snapshot(2**63 - 1, 1, 2), BS) == "rejected"
    assert rules.replace_rank(R, snapshot(20 + MAX_SEQ_JUMP + 1, 1, 2), BS) == "rejected"
    assert rules.tree.block_count(R) == 1 and rules.cursors[R] == 20
    assert rules.replace_rank(R, snapshot(20 + MAX_SEQ_JUMP, 1, 2), BS) == "applied"


def test_worker_snapshot_of_a_rank_the_worker_does_not_have_is_refused_and_counted() -> None:
    rules, _ = rules_with()
    stranger = SnapshotRank(7, 4, snapshot(4, 1).blocks)
    assert rules.replace_rank(RankId(R.worker_url, 7), stranger, BS) == "rejected"
    assert rules.stats.worker_snapshots_rejected == 1


@pytest.mark.parametrize(
    "bad",
    [
        SnapshotRank(1, 4, [SnapshotBlock(9, 8, [1, 2, 3, 4])]),  # a parent it does not list
        SnapshotRank(7, 4, [SnapshotBlock(9, None, [1, 2, 3, 4])]),  # a rank it does not have
        SnapshotRank(0, 5, [SnapshotBlock(9, None, [1, 2, 3, 4])]),  # rank 0 listed twice
    ],
    ids=["missing_parent", "unknown_rank", "twice"],
)
def test_a_worker_snapshot_with_one_refused_rank_is_refused_whole(bad: SnapshotRank) -> None:
    """Rank by rank, the good rank went in next to the refused one, and the pull counted
    `applied`: the body is refused whole now, nothing of it installed."""
    r1 = RankId(R.worker_url, 1)
    rules, _ = rules_with(R, r1)
    rules.apply_batch(R, 1, stored(50, 500))
    body = WorkerSnapshot([snapshot(4, 1, 2), bad], BS)
    assert rules.replace_ranks(R.worker_url, body) == "rejected"
    assert rules.stats.worker_snapshots_rejected == 1 and rules.stats.worker_snapshots_applied == 0
    assert rules.tree.block_count(R) == 1 and rules.cursors[R] == 1  # as the stream left it
    assert rules.tree.block_count(r1) == 0 and r1 not in rules.cursors


def read_rank(rules: IndexRules, *prompts: list[int]) -> tuple:
    """What routing reads of the rank R: its depth along each prompt, its blocks, its cursor."""
    depths = tuple(rules.tree.prefix_depths(block_keys(p, BS)).any_tier.get(R) for p in prompts)
    return depths, rules.tree.block_count(R), rules.cursors.get(R)


def test_routing_reads_a_ranks_old_state_until_one_step_of_its_install_swaps_in_the_new() -> None:
    rules, _ = rules_with()
    rules.slice_blocks = 2
    old_prompt = list(range(500, 500 + 5 * BS))
    chain = BlockStored(list(range(50, 55)), None, old_prompt, BS, DEVICE, "GPU", None)
    rules.apply_batch(R, 3, EventBatch(0.0, [chain], 0))
    new_prompt = list(range(1, 1 + 9 * BS))
    old = read_rank(rules, old_prompt, new_prompt)
    assert old == ((5, None), 5, 3)
    body = WorkerSnapshot([snapshot(4, *range(1, 10))], BS)
    seen = [old] + [
        read_rank(rules, old_prompt, new_prompt)
        for _ in rules.replace_ranks_steps(R.worker_url, body)
    ]
    new = ((None, 9), 9, 4)
    assert read_rank(rules, old_prompt, new_prompt) == new
    # 9 blocks checked in 5 slices of 2, built in 5; then the swap, one step, and the old
    # state's 5 blocks dropped out of sight in 3 slices: never a half-built or half-cleared rank
    assert seen == [old] * 9 + [new] * 2


@pytest.mark.parametrize("steps_taken", [6, 10])  # closed while building, while dropping
def test_an_install_closed_mid_way_leaves_no_state_out_of_sight(steps_taken: int) -> None:
    """The pump stopped inside it: the rank is read whole (old before the swap, new after),
    nothing is left aside, and the next install goes in."""
    rules, _ = rules_with()
    rules.slice_blocks = 2
    old_prompt = list(range(500, 500 + 5 * BS))
    chain = BlockStored(list(range(50, 55)), None, old_prompt, BS, DEVICE, "GPU", None)
    rules.apply_batch(R, 3, EventBatch(0.0, [chain], 0))
    old_nodes = len(rules.tree)
    new_prompt = list(range(1, 1 + 9 * BS))
    body = WorkerSnapshot([snapshot(4, *range(1, 10))], BS)
    steps = rules.replace_ranks_steps(R.worker_url, body)
    for _ in range(steps_taken):
        next(steps)
    steps.close()
    expected = ((5, None), 5, 3) if steps_taken < 9 else ((None, 9), 9, 4)
    assert read_rank(rules, old_prompt, new_prompt) == expected
    assert rules.tree._hidden == 0 and rules.tree._staged == {}
    assert len(rules.tree) == (old_nodes if steps_taken < 9 else 9)
    assert rules.tree.carried_blocks == expected[1]
    assert rules.replace_ranks(R.worker_url, body) == "applied"


def test_a_bad_block_late_in_a_worker_snapshot_refuses_it_whole_with_nothing_installed() -> None:
    """The body is checked in slices before anything is built: the rank keeps its state."""
    r1 = RankId(R.worker_url, 1)
    rules, _ = rules_with(R, r1)
    rules.slice_blocks = 2
    rules.apply_batch(R, 1, stored(50, 500))
    before = canonical_view(rules.tree)
    late = SnapshotRank(
        1, 4, [*snapshot(4, *range(100, 110)).blocks, SnapshotBlock(9, 8, [1] * BS)]
    )
    body = WorkerSnapshot([snapshot(4, *range(1, 10)), late], BS)
    steps = rules.replace_ranks_steps(R.worker_url, body)
    assert sum(1 for _ in steps) == 9  # rank 0's 9 blocks and rank 1's first 10 checked
    assert rules.stats.worker_snapshots_rejected == 1 and rules.stats.worker_snapshots_applied == 0
    assert canonical_view(rules.tree) == before and rules.tree._hidden == 0
    assert rules.cursors == {R: 1}


# --- seq jumps past the bound -----------------------------------------------------------------


def test_a_jump_past_the_bound_is_a_new_stream_counting_nothing_lost() -> None:
    rules, losses = rules_with()
    rules.apply_batch(R, 3, stored(1, 1))
    rules.apply_batch(R, 2**63 - 1, stored(2, 100))
    assert rules.stats.lost_batches[R] == 0
    assert rules.stats.seq_jumps == 1
    assert losses == [R]  # the worker's snapshot is asked for, the rank starts over
    assert rules.tree.block_count(R) == 1  # block 1 went with the old stream
    assert rules.tree.match(block_keys(list(range(100, 104)), BS)).blocks == 1
    assert rules.cursors[R] == 2**63 - 1


def test_a_jump_of_exactly_the_bound_is_still_counted_as_lost_batches() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 3, stored(1, 1))
    rules.apply_batch(R, 4 + MAX_SEQ_JUMP, stored(2, 100))
    assert rules.stats.lost_batches[R] == MAX_SEQ_JUMP
    assert rules.stats.seq_jumps == 0
    assert rules.tree.block_count(R) == 2


# --- slicing ------------------------------------------------------------------------------------


def chain_batch(first_hash: int, n_blocks: int, start_token: int) -> EventBatch:
    hashes = list(range(first_hash, first_hash + n_blocks))
    tokens = list(range(start_token, start_token + n_blocks * BS))
    return EventBatch(0.0, [BlockStored(hashes, None, tokens, BS, DEVICE, "GPU", None)], 0)


def test_a_long_store_is_applied_in_slices_and_ends_as_one_chain() -> None:
    rules = IndexRules(BlockTree(BS), slice_blocks=10)
    rules.add_ranks([R])
    steps = rules.steps(LiveBatch(R, 0, chain_batch(1, 35, 1)))
    seen = []
    for _ in steps:
        seen.append((rules.tree.block_count(R), rules.cursors.get(R)))
    # Every slice places a prefix of the chain; the cursor moves only at the end.
    assert seen == [(10, None), (20, None), (30, None)]
    assert rules.cursors[R] == 0
    keys = block_keys(list(range(1, 1 + 35 * BS)), BS)
    assert rules.tree.prefix_depths(keys).any_tier == {R: 35}
    assert rules.stats.events["stored", "GPU"] == 1


def test_a_sliced_store_under_an_unknown_parent_is_refused_once() -> None:
    rules = IndexRules(BlockTree(BS), slice_blocks=10)
    rules.add_ranks([R])
    hashes = list(range(1, 36))
    event = BlockStored(hashes, 999, list(range(1, 1 + 35 * BS)), BS, DEVICE, "GPU", None)
    rules.handle(LiveBatch(R, 0, EventBatch(0.0, [event], 0)))
    assert rules.tree.stats.unknown_parent == 1
    assert rules.tree.block_count(R) == 0


def test_a_long_removal_and_a_clear_are_sliced_too() -> None:
    rules = IndexRules(BlockTree(BS), slice_blocks=10)
    rules.add_ranks([R])
    rules.handle(LiveBatch(R, 0, chain_batch(1, 35, 1)))
    removal = EventBatch(0.0, [BlockRemoved([h], None, "GPU") for h in range(35, 10, -1)], 0)
    counts = [rules.tree.block_count(R) for _ in rules.steps(LiveBatch(R, 1, removal))]
    assert counts == [25, 15]
    assert rules.tree.block_count(R) == 10
    assert rules.stats.events["removed", "GPU"] == 25
    clear = EventBatch(0.0, [AllBlocksCleared()], 0)
    assert [rules.tree.block_count(R) for _ in rules.steps(LiveBatch(R, 2, clear))] == []
    rules.handle(LiveBatch(R, 3, chain_batch(100, 25, 1000)))
    counts = [rules.tree.block_count(R) for _ in rules.steps(PublisherReset(R))]
    assert counts == [15, 5]
    assert rules.tree.ranks() == [] and len(rules.tree) == 0
    assert rules.tree.carried_blocks == 0


def test_folded_removal_runs_change_the_index_and_the_counts_as_the_events_they_fold() -> None:
    """Random churn on two tiers, applied as decoded and as the subscriber folds it (slices of
    6 blocks, so runs longer than a slice are cut too): the same tree, the same event counts."""
    rng = random.Random(23)
    plain_rules = IndexRules(BlockTree(BS), slice_blocks=6)
    folded_rules = IndexRules(BlockTree(BS), slice_blocks=6)
    for rules in (plain_rules, folded_rules):
        rules.add_ranks([R])
    held: list[int] = []
    for seq in range(300):
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 12)):
            roll = rng.random()
            if roll < 0.35 or not held:
                h = rng.randrange(1 << 40)
                parent = held[-1] if held and rng.random() < 0.5 else None
                tier, medium = (DEVICE, "GPU") if rng.random() < 0.8 else (HOST, "CPU")
                tokens = [rng.randrange(50) for _ in range(BS)]
                events.append(BlockStored([h], parent, tokens, BS, tier, medium, None))
                held.append(h)
            elif roll < 0.9:
                h = held.pop(rng.randrange(len(held)))
                medium = rng.choice([("GPU", DEVICE), ("CPU", HOST), (None, None)])
                events.append(BlockRemoved([h], medium[1], medium[0]))
            elif roll < 0.98:
                pair = [held.pop() for _ in range(min(2, len(held)))]
                events.append(BlockRemoved(pair, None, None))
            else:
                events.append(AllBlocksCleared())
                held.clear()
        plain_rules.handle(LiveBatch(R, seq, EventBatch(0.0, events, 0)))
        folded = EventBatch(0.0, fold_removal_runs(list(events)), 0)
        folded_rules.handle(LiveBatch(R, seq, folded))
    assert canonical_view(folded_rules.tree) == canonical_view(plain_rules.tree)
    assert folded_rules.stats.events == plain_rules.stats.events
    assert plain_rules.stats.events["removed", "GPU"] > 200


# --- the index cap ------------------------------------------------------------------------------


def test_over_the_cap_the_rank_carrying_the_most_is_cleared_and_counted() -> None:
    rules = IndexRules(BlockTree(BS), max_blocks=30)
    losses: list[RankId] = []
    rules.set_loss_handler(losses.append)
    rules.add_ranks([R, OTHER])
    rules.handle(LiveBatch(OTHER, 0, chain_batch(1, 8, 1)))
    rules.handle(LiveBatch(R, 0, chain_batch(1, 20, 5000)))
    assert rules.tree.carried_blocks == 28  # under the cap: nothing happens
    rules.handle(LiveBatch(R, 1, chain_batch(100, 5, 9000)))
    # 33 > 30: R (25 blocks) goes, OTHER keeps all of its own.
    assert rules.stats.cap_clears == {R: 1}
    assert rules.stats.cap_cleared_blocks == 25
    assert rules.tree.block_count(R) == 0 and rules.tree.block_count(OTHER) == 8
    assert rules.tree.carried_blocks == 8
    assert rules.cursors[R] == 1  # the stream goes on: R re-warms from its next stores
    assert losses == []  # no re-pull: it would only overflow again
    rules.handle(LiveBatch(R, 2, chain_batch(200, 3, 12000)))
    assert rules.tree.block_count(R) == 3


def test_the_carried_count_follows_stores_removals_clears_and_snapshot_restores() -> None:
    rules, _ = rules_with(R, OTHER)
    tree = rules.tree
    rules.apply_batch(R, 0, chain_batch(1, 6, 1))
    rules.apply_batch(OTHER, 0, chain_batch(1, 6, 1))  # the same blocks, another carrier
    rules.apply_batch(R, 1, removed(6))
    assert tree.carried_blocks == 11 == tree.recount()
    assert rules.replace_rank(OTHER, snapshot(4, 1, 2, 3), BS) == "applied"
    rules.after_control()  # what the pump does after every control call
    assert tree.carried_blocks == 8 == sum(tree.block_count(r) for r in (R, OTHER))


def test_the_lora_adapters_the_stores_carry_are_learned_for_the_request_path() -> None:
    rules, _ = rules_with(R)
    tokens = list(range(1, 1 + BS))
    events = [
        BlockStored([1], None, tokens, BS, DEVICE, "GPU", "sql"),
        BlockStored([2], None, tokens, BS, DEVICE, "GPU", "chat\x00salt"),  # adapter and salt
        BlockStored([3], None, tokens, BS, DEVICE, "GPU", "\x00salt"),  # a salt alone
        BlockStored([4], None, tokens, BS, DEVICE, "GPU", None),
    ]
    rules.apply_batch(R, 0, EventBatch(0.0, events, 0))
    assert rules.adapters == {"sql", "chat"}
    # Keyed in the adapter's namespace, as the request path keys a request naming it.
    assert rules.tree is not None
    keys = block_keys(tokens, BS, namespace_seed("sql"))
    assert rules.tree.prefix_depths(keys).any_tier == {R: 1}


def test_a_worker_snapshot_teaches_the_adapter_names_its_roots_carry_within_the_bound() -> None:
    rules, _ = rules_with(R)
    tokens = list(range(1, 1 + BS))
    blocks = [
        SnapshotBlock(1, None, tokens, lora_name="sql"),
        SnapshotBlock(2, None, tokens),  # the base model's
        SnapshotBlock(3, None, tokens, cache_salt="s"),  # a salt alone names no adapter
    ]
    body = WorkerSnapshot([SnapshotRank(0, 4, blocks)], BS)
    assert rules.replace_ranks(R.worker_url, body) == "applied"
    assert rules.adapters == {"sql"}
    assert rules.tree is not None
    assert rules.tree.prefix_depths(block_keys(tokens, BS, namespace_seed("sql"))).any_tier == {
        R: 1
    }
    # Learned as the stores' names are: never past MAX_ADAPTER_NAMES, the least recently
    # learned making room.
    rules.learn_adapters(f"a{i:04d}" for i in range(MAX_ADAPTER_NAMES - 2))  # one place left
    names = [SnapshotBlock(10 + i, None, tokens, lora_name=f"b{i}") for i in range(2)]
    assert rules.replace_ranks(R.worker_url, WorkerSnapshot([SnapshotRank(0, 5, names)], BS))
    assert len(rules.adapters) == MAX_ADAPTER_NAMES
    assert {"b0", "b1"} <= rules.adapters and "sql" not in rules.adapters


def test_a_worker_snapshot_with_more_names_than_the_bound_teaches_the_first_in_sorted_order() -> (
    None
):
    """The names were learned in a set's order: which 4,096 of them a replica knew (and keyed
    requests by) changed from one process to the next."""
    rules, _ = rules_with(R)
    tokens = list(range(1, 1 + BS))
    names = [f"n{i:05d}" for i in range(MAX_ADAPTER_NAMES + 904)]
    blocks = [SnapshotBlock(i, None, tokens, lora_name=name) for i, name in enumerate(names)]
    body = WorkerSnapshot([SnapshotRank(0, 4, blocks)], BS)
    assert rules.replace_ranks(R.worker_url, body) == "applied"
    assert rules.adapters == set(names[:MAX_ADAPTER_NAMES])


def adapter_store(h: int, name: str) -> BlockStored:
    return BlockStored([h], None, list(range(1, 1 + BS)), BS, DEVICE, "GPU", name)


def test_a_new_adapter_past_the_bound_is_learned_in_place_of_the_least_recently_used() -> None:
    """Names were only ever added: once MAX_ADAPTER_NAMES were learned, a fleet's newer
    adapters were never learned, and a vLLM request naming one (no /v1/models readable) was
    keyed as the base model's, a false hit on the base model's blocks."""
    rules, _ = rules_with(R)
    old = [f"old{i:04d}" for i in range(MAX_ADAPTER_NAMES)]
    rules.apply_batch(R, 0, EventBatch(0.0, [adapter_store(i, n) for i, n in enumerate(old)], 0))
    assert set(rules.adapters) == set(old)
    rules.apply_batch(R, 1, EventBatch(0.0, [adapter_store(1 << 20, "new")], 0))
    assert len(rules.adapters) == MAX_ADAPTER_NAMES
    assert "new" in rules.adapters and old[0] not in rules.adapters  # the first stored went
    assert set(old[1:]) <= rules.adapters
    body = {"model": "new"}
    ask = model_asked(COMPLETIONS, body, frozenset(), Engine.VLLM)
    assert namespace_for(COMPLETIONS, body, ask, rules.adapters, frozenset(), Engine.VLLM) == "new"
    # A graft or a worker's /v1/models past the bound is learned the same way.
    rules.learn_adapters(["graft-a", "graft-b"])
    assert {"graft-a", "graft-b", "new"} <= rules.adapters
    assert not {old[1], old[2]} & rules.adapters


def test_an_adapter_in_use_is_never_forgotten_however_many_names_come_after_it() -> None:
    """In use: its blocks keep being stored, as every request an engine serves for it stores
    the blocks it fills. Three bounds' worth of new names pass; it stays, and a name learned
    once and never stored again goes."""
    rules, _ = rules_with(R)
    seq, h = 0, 0
    rules.apply_batch(
        R, seq, EventBatch(0.0, [adapter_store(h, "hot"), adapter_store(1, "once")], 0)
    )
    for round_ in range(3 * MAX_ADAPTER_NAMES // 1000):
        names = [f"n{round_}-{i}" for i in range(999)]  # fewer than the bound between uses
        events = [adapter_store(2 + i, n) for i, n in enumerate(names)]
        events.append(adapter_store(h, "hot"))  # the adapter serves another request
        seq += 1
        rules.apply_batch(R, seq, EventBatch(0.0, events, 0))
        assert "hot" in rules.adapters
    assert "once" not in rules.adapters
    assert len(rules.adapters) == MAX_ADAPTER_NAMES


@pytest.mark.parametrize("name", ["sql\x00salt", "", "a" * (MAX_ADAPTER_NAME_CHARS + 1)])
def test_a_worker_snapshot_naming_no_adapters_name_is_refused_whole(name: str) -> None:
    """Taken as is, "sql\\x00salt" taught the adapter "sql" and keyed its blocks in the
    namespace of adapter "sql" with cache salt "salt" (`namespace_of`), a sibling's export
    with that name being refused all the while (`peer.vet`)."""
    rules, _ = rules_with(R)
    rules.apply_batch(R, 1, stored(50, 500))
    tokens = list(range(1, 1 + BS))
    blocks = [SnapshotBlock(1, None, tokens, lora_name="chat"), SnapshotBlock(2, 1, tokens)]
    blocks.append(SnapshotBlock(3, None, tokens, lora_name=name))
    body = WorkerSnapshot([SnapshotRank(0, 4, blocks)], BS)
    assert rules.replace_ranks(R.worker_url, body) == "rejected"
    assert rules.stats.worker_snapshots_rejected == 1
    assert rules.adapters == set()
    assert rules.tree is not None
    assert rules.tree.block_count(R) == 1 and rules.cursors[R] == 1  # as the stream left it


def test_a_refused_worker_snapshot_teaches_no_adapter_name() -> None:
    rules, _ = rules_with(R)
    blocks = [SnapshotBlock(1, None, [1] * (BS - 1), lora_name="sql")]  # a block too short
    body = WorkerSnapshot([SnapshotRank(0, 4, blocks)], BS)
    assert rules.replace_ranks(R.worker_url, body) == "rejected"
    assert rules.adapters == set()


def test_the_medium_label_is_an_engines_tier_name_or_other_whatever_the_publisher_sends() -> None:
    """3,000 made-up media were 3,000 kvrouter_kv_events_total series and tally keys for the
    process's life: a publisher's string is a label only when it names a tier."""
    rules, _ = rules_with()
    media = [f"medium-{i}" for i in range(3000)] + ["GPU", "gpu", "CPU_PINNED", None]
    for seq, medium in enumerate(media):
        rules.apply_batch(R, seq, EventBatch(0.0, [BlockRemoved([seq + 1], None, medium)], 0))
    assert dict(rules.stats.events) == {
        ("removed", "other"): 3000,
        ("removed", "GPU"): 2,
        ("removed", "CPU_PINNED"): 1,
        ("removed", "none"): 1,
    }


@pytest.mark.parametrize("serves_snapshot", [True, False])
def test_lost_batches_warn_once_a_period_per_rank_with_the_count_since(
    serves_snapshot: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A publisher dropping every other batch wrote a warning per batch (1,500 lines a second
    here, twice with the subscriber's), and told of a snapshot re-pull for a worker known to
    serve no /v1/kv-snapshot."""
    clock = ManualClock()
    rules = IndexRules(BlockTree(BS), clock=clock)
    asked: list[RankId] = []
    rules.set_loss_handler(lambda rank: asked.append(rank) or serves_snapshot)
    rules.add_ranks([R, OTHER])

    def lost_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "lost since" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="router.index"):
        for seq in range(0, 3000, 2):  # 1,499 gaps of one batch
            rules.apply_batch(R, seq, stored(seq + 1, seq))
        rules.apply_batch(OTHER, 0, stored(1, 0))
        rules.apply_batch(OTHER, 5, stored(2, 10))  # another rank warns on its own
        assert len(lost_lines()) == 2
        clock.advance(LOSS_WARN_EVERY_S)
        rules.apply_batch(R, 3000, stored(9999, 3000))
    assert rules.stats.lost_batches == {R: 1500, OTHER: 4}
    assert len(asked) == 1499 + 1 + 1  # every loss asks for its repair, warned or not
    first, other, summary = lost_lines()
    assert first.startswith(f"{R}: 1 batch(es) lost since the last such warning")
    assert other.startswith(f"{OTHER}: 4 batch(es) lost")
    assert summary.startswith(f"{R}: 1499 batch(es) lost since the last such warning")
    assert "(the latest seq 2999..2999)" in summary
    assert ("snapshot is re-pulled" in summary) is serves_snapshot
    assert ("serves no /v1/kv-snapshot" in summary) is not serves_snapshot
