"""The pump's rules, driven by messages: cursors, losses, restarts, worker snapshots."""

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.index import IndexRules
from router.subscriber import LiveBatch, PublisherReset, UnrepairedGap
from router.worker_snapshot import SnapshotBlock, SnapshotRank

BS = 4
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
    assert rules.stats.events["cleared", None] == 1


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
    assert rules.replace_rank(R, snapshot(4, 1, 2), BS)
    assert rules.tree.block_count(R) == 2
    assert rules.tree.match(block_keys(list(range(500, 504)), BS)).blocks == 0
    assert rules.cursors[R] == 4
    rules.apply_batch(R, 4, removed(2))  # already reflected by the snapshot
    assert rules.tree.block_count(R) == 2


def test_worker_snapshot_older_than_the_stream_is_ignored() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 9, stored(50, 500))
    assert not rules.replace_rank(R, snapshot(4, 1, 2), BS)
    assert rules.stats.worker_snapshots_stale == 1
    assert rules.tree.block_count(R) == 1


def test_worker_snapshot_with_the_wrong_block_size_is_refused_and_changes_nothing() -> None:
    rules, _ = rules_with()
    rules.apply_batch(R, 1, stored(50, 500))
    assert not rules.replace_rank(R, snapshot(4, 1), BS * 2)
    assert rules.stats.worker_snapshots_rejected == 1
    assert rules.tree.block_count(R) == 1
    assert rules.cursors[R] == 1
