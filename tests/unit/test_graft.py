"""The pump's bootstrap rules: holding, grafting, the watermark, gaps, proofs, outcomes."""

from __future__ import annotations

import logging

import pytest

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from peer.sweep import Gapped
from peer.tracker import BootstrapState, BootstrapTracker, Obligation
from router.events import BlockRemoved, BlockStored, EventBatch
from router.graft import BootstrapRules, LocalGraft
from router.index import IndexRules
from router.subscriber import LiveBatch, PublisherReset
from router.worker_snapshot import SnapshotBlock, SnapshotRank, WorkerSnapshot

BS = 4
R = RankId("http://w", 0)
Q = RankId("http://q", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(start: int) -> list[int]:
    return list(range(start, start + BS))


def stored(h: int, start: int, parent: int | None = None) -> EventBatch:
    return EventBatch(0.0, [BlockStored([h], parent, tokens(start), BS, DEVICE, "GPU", None)], 0)


def removed(h: int) -> EventBatch:
    return EventBatch(0.0, [BlockRemoved([h], None, None)], 0)


class Rig:
    """An IndexRules with bootstrap on, a real tracker, and a record of retries queued."""

    def __init__(self, *ranks: RankId, retry_accepts: bool = True) -> None:
        self.clock = Clock()
        self.tracker = BootstrapTracker(60.0, clock=self.clock)
        self.index = IndexRules(BlockTree(BS))
        self.retries: list[Obligation] = []
        self.notes: list[Gapped] = []
        self.retry_accepts = retry_accepts
        self.rules = BootstrapRules(self.index, self.tracker, self._enqueue, self.clock)
        self.index.bootstrap = self.rules
        ranks = ranks or (R,)
        self.index.add_ranks(ranks)
        self.obligations = self.tracker.register(ranks)

    def _enqueue(self, ob: Obligation, note: Gapped) -> bool:
        self.retries.append(ob)
        self.notes.append(note)
        return self.retry_accepts

    def live(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        self.index.handle(LiveBatch(rank, seq, batch))

    def outcome(self, rank: RankId = R) -> str | None:
        out = self.tracker.recorded_outcome(rank)
        return None if out is None else out.value

    def blocks(self, rank: RankId = R) -> int:
        return self.index.tree.block_count(rank)


def sibling_graft(cursor: int, *blocks: tuple[int, int], rank: RankId = R) -> LocalGraft:
    """What a warm sibling holds for `rank`: blocks (hash, token start) at `cursor`."""
    tree = BlockTree(BS)
    for h, start in blocks:
        tree.store(rank, None, [h], tokens(start), BS)
    return LocalGraft(tree, {rank: cursor})


def holds(rig: Rig, start: int, rank: RankId = R) -> bool:
    return rank in rig.index.tree.carriers(block_keys(tokens(start), BS)[0])


def test_held_batches_are_not_applied_while_pending() -> None:
    rig = Rig()
    rig.live(R, 4, stored(1, 100))
    assert rig.blocks() == 0
    assert [h.seq for h in rig.rules.held[R]] == [4]


def test_seeded_cursor_filters_already_reflected_batches() -> None:
    rig = Rig()
    rig.live(R, 4, stored(1, 100))  # in the snapshot already
    rig.live(R, 5, removed(1))  # in the snapshot already
    rig.live(R, 6, stored(2, 200))  # after the watermark: applied on top
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert holds(rig, 300) and holds(rig, 200) and not holds(rig, 100)
    assert rig.index.cursors[R] == 6
    assert rig.outcome() == "warm"
    assert rig.tracker.state(R) is BootstrapState.RECOVERED


def test_watermark_5_seq_6_splices_on_the_held_path() -> None:
    rig = Rig()
    rig.live(R, 6, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.outcome() == "warm"
    assert holds(rig, 300) and holds(rig, 200)


def test_watermark_5_seq_7_gaps_on_the_held_path_and_the_retry_keeps_the_queue() -> None:
    rig = Rig()
    rig.live(R, 7, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.retries == [Obligation(R, rig.obligations[0].epoch)]
    assert rig.tracker.is_pending(R)
    assert rig.outcome() is None  # a granted retry records nothing
    assert rig.blocks() == 0  # the graft was discarded
    assert [h.seq for h in rig.rules.held[R]] == [7]  # kept unapplied for the retry
    rig.rules.apply_snapshot(rig.retries, sibling_graft(6, (7, 300)))
    assert rig.outcome() == "warm"
    assert holds(rig, 300) and holds(rig, 200)


def test_a_second_gap_runs_the_rank_cold_with_the_held_batches() -> None:
    rig = Rig()
    rig.live(R, 7, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    rig.rules.apply_snapshot(rig.retries, sibling_graft(5, (7, 300)))
    assert rig.outcome() == "gap"
    assert rig.tracker.state(R) is BootstrapState.FAILED
    assert holds(rig, 200) and not holds(rig, 300)


def test_a_refused_retry_queue_settles_gap_at_once() -> None:
    rig = Rig(retry_accepts=False)
    rig.live(R, 7, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.outcome() == "gap"
    assert holds(rig, 200)


def test_watermark_5_seq_6_splices_on_the_deferred_path() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.outcome() is None and R in rig.rules.proofs
    rig.live(R, 6, stored(2, 200))
    assert rig.outcome() == "warm"
    assert holds(rig, 300) and holds(rig, 200)


def test_watermark_5_seq_7_gaps_on_the_deferred_path() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    rig.live(R, 7, stored(2, 200))
    assert rig.retries and rig.tracker.is_pending(R)
    assert not holds(rig, 300)
    assert [h.seq for h in rig.rules.held[R]] == [7]


def test_a_cursor_far_past_the_held_stream_gaps_instead_of_freezing_the_rank() -> None:
    """A sibling's cursor of 2**63 grafted as `warm` marked every later batch of the stream
    already reflected: the rank froze on the snapshot's blocks, removals never applied."""
    rig = Rig(retry_accepts=False)
    rig.live(R, 35, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(2**63, (7, 300)))
    assert rig.outcome() == "gap"
    assert not holds(rig, 300) and holds(rig, 200)
    rig.live(R, 36, removed(2))  # the stream goes on being applied
    assert not holds(rig, 200)


def test_a_cursor_far_past_the_first_live_batch_gaps_on_the_deferred_path() -> None:
    rig = Rig(retry_accepts=False)
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(2**63, (7, 300)))
    assert R in rig.rules.proofs
    rig.live(R, 36, stored(2, 200))
    assert rig.outcome() == "gap"
    assert not holds(rig, 300) and holds(rig, 200)


def test_a_cursor_a_few_batches_ahead_of_the_held_stream_waits_for_the_stream_to_reach_it() -> None:
    """A sibling may have seen a few batches this replica has not received yet: the graft is
    kept, but only the batch after its cursor proves the splice (was `warm` at once)."""
    rig = Rig()
    rig.live(R, 4, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(9, (7, 300)))
    assert rig.outcome() is None and R in rig.rules.proofs
    assert holds(rig, 300) and rig.index.cursors[R] == 9
    for seq in range(5, 10):  # in flight: reflected in the snapshot, filtered
        rig.live(R, seq, stored(seq, seq * 100))
    assert rig.outcome() is None and R not in rig.rules.held
    assert not holds(rig, 500) and rig.index.stats.batches_skipped == 6
    rig.clock.now = 100.0  # idle long after: the stream reached the watermark, no gap
    rig.rules.expire_behind()
    assert rig.outcome() is None and R in rig.rules.proofs
    rig.live(R, 10, stored(10, 1000))
    assert rig.outcome() == "warm" and holds(rig, 1000) and rig.index.cursors[R] == 10


@pytest.mark.parametrize("behind", [0, 3])
def test_a_batch_at_or_below_the_watermark_never_proves_the_splice(behind: int) -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    rig.live(R, 5 - behind, stored(2, 200))
    assert rig.outcome() is None and R in rig.rules.proofs
    assert not holds(rig, 200)  # reflected in the snapshot (or still to be judged)
    assert rig.index.cursors[R] == 5


def test_held_batches_all_below_the_watermark_leave_the_proof_pending() -> None:
    rig = Rig(retry_accepts=False)
    rig.live(R, 1, stored(2, 200))
    rig.live(R, 2, stored(3, 400))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(40, (7, 300)))
    assert rig.outcome() is None and R in rig.rules.proofs
    assert [h.seq for h in rig.rules.held[R]] == [1, 2]  # kept: not yet known to be reflected
    rig.clock.now = 6.0  # the stream never reached 40: not batches in flight
    rig.rules.expire_behind()
    assert rig.outcome() == "gap" and rig.rules.gaps == {"a sibling": 1}
    assert not holds(rig, 300) and holds(rig, 200) and holds(rig, 400)  # cold, not wrong


def test_an_engine_restart_whose_batch_0_was_lost_under_a_grafted_idle_rank_is_a_gap() -> None:
    """Grafted with cursor 40 while idle; the engine restarts, its batch 0 is lost, and its
    new stream (seq 1, 2, ...) sits under the old cursor. It was counted `warm`, kept the old
    blocks as ghosts and filtered every new batch until seq 41."""
    rig = Rig(retry_accepts=False)
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(40, (7, 300)))
    rig.clock.now = 1.0
    rig.live(R, 1, stored(2, 200))
    assert rig.outcome() is None  # could still be in flight
    rig.clock.now = 6.0
    rig.live(R, 2, stored(3, 400))
    assert rig.outcome() == "gap"
    assert not holds(rig, 300) and holds(rig, 200) and holds(rig, 400)
    assert R in rig.index.cold and rig.index.cursors[R] == 2


def test_a_cursor_more_than_behind_max_ahead_of_the_stream_gaps_at_its_first_batch() -> None:
    """A sibling whose cursors are shifted 1,000 ahead (well under MAX_SEQ_JUMP) was grafted
    `warm` and froze the rank: every batch up to its cursor was filtered."""
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(1035, (7, 300)), "http://ahead")
    rig.live(R, 35, removed(7))
    assert rig.retries and rig.rules.gaps == {"http://ahead": 1}
    assert rig.tracker.is_pending(R) and not holds(rig, 300)
    assert [h.seq for h in rig.rules.held[R]] == [35]  # kept for the retry's graft
    rig.rules.apply_snapshot(rig.retries, sibling_graft(34, (7, 300)))
    assert rig.outcome() == "warm" and not holds(rig, 300)  # the removal applied


def test_a_held_queue_more_than_behind_max_below_the_cursor_gaps_at_the_graft() -> None:
    rig = Rig(retry_accepts=False)
    rig.live(R, 35, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(35 + 65, (7, 300)))
    assert rig.outcome() == "gap" and holds(rig, 200) and not holds(rig, 300)


def test_a_held_loss_past_the_watermark_is_a_gap_not_a_proof() -> None:
    """Held 4 and 8 with watermark 5: batch 6 never came, so nothing joined the snapshot."""
    rig = Rig(retry_accepts=False)
    rig.live(R, 4, stored(1, 100))
    rig.live(R, 8, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.outcome() == "gap"


def test_a_publisher_reset_under_a_pending_proof_drops_what_it_held() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(40, (7, 300)))
    rig.live(R, 38, stored(2, 200))
    rig.index.handle(PublisherReset(R))
    assert rig.outcome() == "publisher_reset" and R not in rig.rules.held
    rig.live(R, 1, stored(3, 400))
    assert holds(rig, 400) and not holds(rig, 200)


def test_a_stream_that_starts_at_seq_0_needs_no_snapshot() -> None:
    rig = Rig()
    rig.live(R, 0, stored(1, 100))
    assert rig.outcome() == "from_origin"
    assert holds(rig, 100)
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))  # late: no-op
    assert not holds(rig, 300)


def test_a_first_held_batch_of_1_keeps_waiting() -> None:
    rig = Rig()
    rig.live(R, 1, stored(1, 100))
    assert rig.tracker.is_pending(R)


def test_a_regression_to_a_non_zero_seq_fails_publisher_reset_and_discards_held() -> None:
    rig = Rig()
    rig.live(R, 8, stored(1, 100))
    rig.live(R, 3, stored(2, 200))
    assert rig.outcome() == "publisher_reset"
    assert not holds(rig, 100) and holds(rig, 200)


def test_a_regression_to_0_resolves_from_origin() -> None:
    rig = Rig()
    rig.live(R, 8, stored(1, 100))
    rig.live(R, 0, stored(2, 200))
    assert rig.outcome() == "from_origin"
    assert not holds(rig, 100) and holds(rig, 200)


def test_a_full_held_queue_fails_overflow_and_replays_what_it_held() -> None:
    rig = Rig()
    rig.rules._held_cap = 3
    for seq in range(5, 8):
        rig.live(R, seq, stored(seq, seq * 100))
    rig.live(R, 8, stored(8, 800))
    assert rig.outcome() == "overflow"
    assert all(holds(rig, s * 100) for s in range(5, 9))
    assert rig.index.cursors[R] == 8


def test_publisher_reset_mid_bootstrap_fails_the_rank_once() -> None:
    rig = Rig()
    rig.live(R, 4, stored(1, 100))
    rig.index.handle(PublisherReset(R))
    rig.index.handle(PublisherReset(R))
    assert rig.outcome() == "publisher_reset"
    assert rig.tracker.rank_outcomes["publisher_reset"] == 1
    assert R not in rig.rules.held


def test_publisher_reset_after_a_proven_graft_fails_the_rank_without_a_second_outcome() -> None:
    rig = Rig()
    rig.live(R, 6, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.outcome() == "warm" and rig.tracker.state(R) is BootstrapState.RECOVERED
    rig.index.handle(PublisherReset(R))
    assert rig.tracker.state(R) is BootstrapState.FAILED
    assert rig.outcome() == "warm"  # the incarnation's one outcome stands
    assert rig.tracker.rank_outcomes["publisher_reset"] == 0
    assert rig.blocks() == 0 and R not in rig.index.cursors


def test_a_snapshot_without_a_cursor_for_the_rank_is_uncovered() -> None:
    rig = Rig(R, Q)
    rig.live(R, 4, stored(1, 100))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300), rank=Q))
    assert rig.outcome(R) == "uncovered"
    assert holds(rig, 100, R)  # ran cold: the held batch was replayed
    assert rig.outcome(Q) is None  # Q's proof is deferred


def workers_own(last_seq: int, *blocks: SnapshotBlock) -> LocalGraft:
    """What the worker's `/v1/kv-snapshot` says of R, built as the bootstrap builds it."""
    snap = WorkerSnapshot([SnapshotRank(R.dp_rank, last_seq, list(blocks))], BS)
    return LocalGraft.from_worker_snapshot(R.worker_url, snap, BS)


def test_a_workers_own_empty_snapshot_before_its_first_batch_covers_the_rank_warm() -> None:
    """An idle engine that never published (`last_seq` -1) was left to the siblings and, none
    holding it, settled `abandoned`: cold until its first batch, though it said it holds
    nothing. No proof is opened (a probe of a sibling holding a restarted engine's old cursor
    would read it as a stream that moved on) and no cursor set (seq 0 is no restart)."""
    rig = Rig()
    assert rig.rules.apply_snapshot(rig.obligations, workers_own(-1), "worker") == [R]
    assert rig.outcome() == "warm" and rig.tracker.settled()
    assert R not in rig.index.cold and rig.blocks() == 0 and R not in rig.index.cursors
    assert rig.rules.proofs == {} and rig.retries == []
    rig.clock.now = 3600.0  # idle for an hour: nothing to probe, nothing expires
    rig.rules.expire_behind()
    assert rig.rules.due_proofs(30.0) == [] and rig.outcome() == "warm"
    rig.live(R, 0, stored(1, 100))
    assert holds(rig, 100) and rig.index.cursors[R] == 0 and R not in rig.index.cold
    assert rig.index.stats.restarts_at_zero == 0


def test_a_workers_empty_rank_whose_first_batch_is_past_0_is_cold() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, workers_own(-1), "worker")
    rig.live(R, 3, stored(1, 100))  # batches 0..2 lost after the snapshot
    assert holds(rig, 100) and R in rig.index.cold


def test_a_workers_empty_snapshot_under_held_batches_past_0_is_a_gap() -> None:
    rig = Rig()
    rig.live(R, 2, stored(1, 100))  # held: batch 0 and 1 never seen
    rig.rules.apply_snapshot(rig.obligations, workers_own(-1), "worker")
    assert rig.retries == rig.obligations and rig.notes == [Gapped("worker", 1)]
    assert rig.tracker.is_pending(R) and R not in rig.index.cursors


def test_a_workers_blocks_without_a_seq_are_left_to_the_siblings() -> None:
    """A body holding blocks at `last_seq` -1 cannot be spliced to any stream."""
    graft = workers_own(-1, SnapshotBlock(7, None, tuple(tokens(300))))
    assert graft.cursors == {}


def test_abandon_fails_only_ranks_still_owed() -> None:
    rig = Rig(R, Q)
    rig.live(Q, 0, stored(1, 100))  # Q resolved from origin already
    rig.live(R, 4, stored(2, 200))
    rig.rules.abandon(rig.obligations)
    assert rig.outcome(R) == "abandoned" and holds(rig, 200, R)
    assert rig.outcome(Q) == "from_origin"


def test_a_gap_retry_that_finds_every_sibling_behind_settles_as_the_gap_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The retry's sweep refuses every body too old to join the stream and abandons the rank:
    that is a gap (a lagging sibling, warned of by name), not a fleet with nothing to give,
    which `abandoned` says and the alert table calls expected at a fleet's start."""
    rig = Rig()
    rig.live(R, 7, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)), "http://frozen")
    assert rig.retries and rig.outcome() is None
    with caplog.at_level(logging.WARNING):
        rig.rules.abandon(rig.retries)
    assert rig.outcome() == "gap" and holds(rig, 200)  # ran cold: the held batch replayed
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "http://frozen" in warned[0] and "cold" in warned[0], warned


def test_a_gap_retry_that_grafts_settles_warm_and_forgets_the_gap() -> None:
    rig = Rig()
    rig.live(R, 7, stored(2, 200))
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)), "http://frozen")
    rig.rules.apply_snapshot(rig.retries, sibling_graft(6, (7, 300)))  # the retry grafted
    assert rig.outcome() == "warm" and not rig.rules.retried


def test_a_graft_for_a_stale_epoch_is_a_no_op() -> None:
    rig = Rig()
    stale = rig.obligations
    rig.index.forget_ranks([R])
    rig.tracker.forget([R])
    rig.index.add_ranks([R])
    rig.tracker.register([R])
    rig.rules.apply_snapshot(stale, sibling_graft(5, (7, 300)))
    assert rig.blocks() == 0 and rig.tracker.is_pending(R)


def test_probe_advanced_demotes_an_unproven_graft() -> None:
    rig = Rig(retry_accepts=False)
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    epoch = rig.obligations[0].epoch
    rig.rules.probe_verdict(R, epoch, 4, "advanced")  # wrong watermark: ignored
    assert holds(rig, 300)
    rig.rules.probe_verdict(R, epoch, 5, "advanced")
    assert rig.outcome() == "gap" and not holds(rig, 300)


def test_probe_no_advance_proves_the_splice() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    rig.rules.probe_verdict(R, rig.obligations[0].epoch, 5, "no_advance")
    assert rig.outcome() == "warm" and holds(rig, 300)


def test_three_unknown_probes_keep_the_graft_unwitnessed() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    epoch = rig.obligations[0].epoch
    for _ in range(2):
        rig.rules.probe_verdict(R, epoch, 5, "unknown")
        assert rig.outcome() is None
    rig.rules.probe_verdict(R, epoch, 5, "unknown")
    assert rig.outcome() == "warm_unwitnessed" and holds(rig, 300)


def test_due_proofs_wait_for_the_timeout_and_restart_their_clock() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    assert rig.rules.due_proofs(30.0) == []
    rig.clock.now = 31.0
    assert rig.rules.due_proofs(30.0) == [(R, 5, rig.obligations[0].epoch)]
    assert rig.rules.due_proofs(30.0) == []


def test_a_restart_at_zero_drops_the_proof_as_from_origin() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)))
    rig.live(R, 6, stored(2, 200))  # proves the splice: warm
    assert rig.outcome() == "warm"
    rig2 = Rig()
    rig2.rules.apply_snapshot(rig2.obligations, sibling_graft(5, (7, 300)))
    rig2.index.apply_batch(R, 0, stored(3, 400))
    assert rig2.outcome() == "from_origin"
    assert holds(rig2, 400) and not holds(rig2, 300)


def test_forgetting_a_rank_drops_its_held_queue_and_proof() -> None:
    rig = Rig(R, Q)
    rig.live(R, 4, stored(1, 100))
    rig.rules.apply_snapshot(rig.obligations[1:], sibling_graft(5, (7, 300), rank=Q))
    rig.index.forget_ranks([R, Q])
    assert rig.rules.held == {} and rig.rules.proofs == {}


def test_the_tree_refusing_the_graft_fails_every_owed_rank() -> None:
    rig = Rig()
    rig.index.tree.store(Q, None, [50], tokens(300), BS)  # block 300 sits under the root here
    rig.live(R, 6, stored(2, 200))
    # A snapshot that puts the same key under a parent: the tree must refuse all of it.
    key = block_keys(tokens(300), BS)[0]
    bad = Snapshot.from_records([R], [(None, 1, ((0, DEVICE, 6),)), (0, key, ((0, DEVICE, 7),))])
    rig.rules.apply_snapshot(rig.obligations, _Unfiltered(bad, {R: 5}))
    assert rig.outcome() == "tree_rejected"
    assert holds(rig, 200) and rig.index.tree.carriers(key) == {Q: DEVICE}


class _Unfiltered:
    """A graft source whose snapshot conflicts with the tree (vetting cannot see the tree)."""

    def __init__(self, snapshot: Snapshot, cursors: dict) -> None:
        self.snapshot = snapshot
        self.cursors = cursors

    def retain_workers(self, keep: object) -> _Unfiltered:
        return self


def test_a_gap_on_the_held_path_names_its_sibling_and_asks_for_a_cursor_joining_the_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig()
    rig.live(R, 7, stored(2, 200))
    rig.live(R, 8, stored(3, 400))
    with caplog.at_level(logging.INFO, logger="router.graft"):
        rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)), "http://frozen")
    assert rig.notes == [Gapped("http://frozen", 6)]  # the held queue starts at 7
    assert rig.rules.gaps == {"http://frozen": 1}
    assert "http://frozen" in caplog.text and "cursor 5" in caplog.text
    rig.rules.apply_snapshot(rig.retries, sibling_graft(5, (7, 300)), "http://frozen")
    assert rig.outcome() == "gap"
    assert rig.rules.gaps == {"http://frozen": 2}  # the second gap is counted too


def test_a_gap_on_the_deferred_path_asks_for_a_cursor_joining_the_batch_that_gapped() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)), "http://frozen")
    rig.live(R, 9, stored(2, 200))
    assert rig.notes == [Gapped("http://frozen", 8)]


def test_a_probe_that_saw_the_stream_move_on_asks_for_a_later_cursor() -> None:
    rig = Rig()
    rig.rules.apply_snapshot(rig.obligations, sibling_graft(5, (7, 300)), "http://frozen")
    rig.rules.probe_verdict(R, rig.obligations[0].epoch, 5, "advanced")
    assert rig.notes == [Gapped("http://frozen", 6)]
