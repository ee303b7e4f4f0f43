"""The pump's asyncio shell: items applied at once when it is idle, queued behind anything
else, long items finished in slices with the loop running between them, backpressure."""

from __future__ import annotations

import asyncio
from collections.abc import Generator

import pytest

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from router.events import BlockStored, EventBatch
from router.index import IndexRules, Pump
from router.subscriber import LiveBatch
from router.worker_snapshot import SnapshotBlock, SnapshotRank, WorkerSnapshot
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(10)

BS = 4
R = RankId("http://w:1", 0)


def chain(seq: int, first_hash: int, n_blocks: int, start_token: int) -> LiveBatch:
    hashes = list(range(first_hash, first_hash + n_blocks))
    tokens = list(range(start_token, start_token + n_blocks * BS))
    event = BlockStored(hashes, None, tokens, BS, DEVICE, "GPU", None)
    return LiveBatch(R, seq, EventBatch(0.0, [event], 0))


async def started(slice_blocks: int = 4096, queue_size: int = 8) -> Pump:
    rules = IndexRules(BlockTree(BS), slice_blocks=slice_blocks)
    rules.add_ranks([R])
    pump = Pump(rules, queue_size=queue_size)
    pump.start()
    await pump.wait_idle()  # the task has run once and parked
    return pump


async def test_an_item_delivered_to_an_idle_pump_is_applied_before_deliver_returns() -> None:
    pump = await started()
    try:
        await pump.deliver(chain(0, 1, 3, 1))
        # No other await in between: the pump task never ran for it.
        assert pump.rules.cursors[R] == 0
        assert pump.rules.tree is not None and pump.rules.tree.block_count(R) == 3
        assert pump.backlog == 0
    finally:
        await pump.stop()


async def test_items_queue_behind_a_pending_control_call_and_keep_their_order() -> None:
    pump = await started()
    order: list[str] = []
    try:
        control = asyncio.create_task(pump.call(lambda rules: order.append("control")))
        await asyncio.sleep(0)  # the call is queued, the pump woken but not yet run
        await pump.deliver(chain(0, 1, 1, 1))
        await pump.deliver(chain(1, 2, 1, 100))
        assert pump.rules.cursors.get(R) is None  # not applied inline: the pump was busy
        await control
        await pump.wait_idle()
        assert order == ["control"]
        assert pump.rules.cursors[R] == 1
        assert pump.rules.stats.batches_applied == 2
    finally:
        await pump.stop()


async def test_a_long_item_is_finished_in_slices_with_the_loop_running_between_them() -> None:
    pump = await started(slice_blocks=10)
    tree = pump.rules.tree
    assert tree is not None
    seen: list[int] = []

    async def reader() -> None:  # a /healthz or a routing decision, between slices
        while tree.block_count(R) < 45:
            seen.append(tree.block_count(R))
            await asyncio.sleep(0)

    try:
        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        await pump.deliver(chain(0, 1, 45, 1))  # begun inline, its first slice applied
        assert tree.block_count(R) == 10
        assert pump.backlog == 1
        await pump.deliver(chain(1, 100, 1, 5000))  # queued behind the long one
        await pump.wait_idle()
        await task
        assert pump.rules.cursors[R] == 1
        assert {10, 20, 30, 40} <= set(seen)  # the reader ran between the slices
        keys = block_keys(list(range(1, 1 + 45 * BS)), BS)
        assert tree.prefix_depths(keys).any_tier == {R: 45}
    finally:
        await pump.stop()


async def test_a_full_queue_holds_the_deliverer_until_the_pump_makes_room() -> None:
    rules = IndexRules(BlockTree(BS))
    rules.add_ranks([R])
    pump = Pump(rules, queue_size=2)  # not started yet: nothing drains the queue
    await pump.deliver(chain(0, 1, 1, 1))
    await pump.deliver(chain(1, 2, 1, 100))
    third = asyncio.create_task(pump.deliver(chain(2, 3, 1, 200)))
    await asyncio.sleep(0.01)
    assert not third.done() and pump.backlog == 2
    pump.start()
    try:
        await asyncio.wait_for(third, 5)
        await pump.wait_idle()
        assert rules.cursors[R] == 2
        assert rules.stats.batches_applied == 3
    finally:
        await pump.stop()


async def test_an_item_that_fails_inline_is_logged_and_dropped_and_the_pump_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pump = await started()
    bad = LiveBatch(R, 0, EventBatch(0.0, [object()], 0))  # type: ignore[list-item]
    try:
        await pump.deliver(chain(0, 1, 1, 1))
        pump.rules.tree = None  # any exception from the rules will do
        await pump.deliver(bad)
        assert "could not be applied" in caplog.text
        pump.rules.tree = BlockTree(BS)
        await pump.deliver(chain(1, 5, 1, 300))
        assert pump.rules.cursors[R] == 1
    finally:
        await pump.stop()


async def test_offer_applies_at_once_to_an_idle_pump_queues_while_busy_and_refuses_when_full() -> (
    None
):
    pump = await started(queue_size=2)
    try:
        assert pump.offer(chain(0, 1, 1, 1)) is True
        assert pump.rules.cursors[R] == 0  # applied inside the call, no await
        control = asyncio.create_task(pump.call(lambda rules: None))
        await asyncio.sleep(0)  # the pump is busy with the call: no longer parked
        assert pump.offer(chain(1, 2, 1, 100)) is True
        assert pump.offer(chain(2, 3, 1, 200)) is True
        assert pump.offer(chain(3, 4, 1, 300)) is False  # full: the caller must await
        assert pump.backlog == 2 and pump.rules.cursors[R] == 0  # the refused one not queued
        await control
        await pump.deliver(chain(3, 4, 1, 300))  # waits for room, then in order
        await pump.wait_idle()
        assert pump.rules.cursors[R] == 3
        assert pump.rules.stats.batches_applied == 4
    finally:
        await pump.stop()


async def test_the_queue_is_bounded_by_the_blocks_it_holds_as_well_as_by_its_items() -> None:
    """1,024 one-megabyte batches (20,000 blocks each) held 1.5 GB: a count of items bounds
    no memory. Past `queue_blocks` an offer is refused (the deliverer waits), but an empty
    queue takes any one item, however large, so that nothing is stuck for good."""
    pump = await started(queue_size=100)
    pump._queue_blocks = 12  # type: ignore[attr-defined]
    try:
        control = asyncio.create_task(pump.call(lambda rules: None))
        await asyncio.sleep(0)  # the pump is busy: offers queue
        assert pump.offer(chain(0, 1, 6, 1)) is True  # 6 hashes, 24 tokens: weighs 7
        assert pump.offer(chain(1, 100, 4, 100)) is True  # 4 and 16: 5, so 12 queued
        assert pump.offer(chain(2, 200, 1, 200)) is False  # one more is past the bound
        assert pump.backlog == 2
        await control
        await pump.wait_idle()
        assert pump.offer(chain(2, 200, 50, 200)) is True  # parked: applied at once
        control = asyncio.create_task(pump.call(lambda rules: None))
        await asyncio.sleep(0)
        assert pump.offer(chain(3, 300, 50, 400)) is True  # an empty queue takes it whole
        assert pump.offer(chain(4, 400, 1, 700)) is False
        await control
        await pump.deliver(chain(4, 400, 1, 700))
        await pump.wait_idle()
        assert pump.rules.cursors[R] == 4 and pump.rules.stats.batches_applied == 5
    finally:
        await pump.stop()


async def test_a_store_is_weighed_by_its_tokens_too_whatever_block_size_it_states() -> None:
    """Seven one-hash stores stating a block size of 2**20 (7.3 MB a batch) weighed 7
    blocks: 49 such batches held 1.2 GB under a bound of a million blocks."""
    pump = await started(queue_size=100)
    pump._queue_blocks = 1000  # type: ignore[attr-defined]
    wide = BlockStored([1], None, list(range(64 * 16)), 64 * 16, DEVICE, "GPU", None)
    try:
        control = asyncio.create_task(pump.call(lambda rules: None))
        await asyncio.sleep(0)
        assert pump.offer(LiveBatch(R, 0, EventBatch(0.0, [wide] * 10, 0))) is True
        assert pump.offer(LiveBatch(R, 1, EventBatch(0.0, [wide] * 10, 0))) is False
        await control
    finally:
        await pump.stop()


def one_block(seq: int, engine_hash: int, start_token: int) -> LiveBatch:
    tokens = list(range(start_token, start_token + BS))
    event = BlockStored([engine_hash], None, tokens, BS, DEVICE, "GPU", None)
    return LiveBatch(R, seq, EventBatch(0.0, [event], 0))


async def test_batches_arriving_during_a_worker_snapshots_install_apply_once_after_it() -> None:
    """The install runs in steps with the loop turning; the rank's batches queue meanwhile,
    and its cursor then skips those the snapshot reflects and applies the rest, once each."""
    pump = await started(slice_blocks=4, queue_size=64)
    rules, tree = pump.rules, pump.rules.tree
    assert tree is not None
    blocks = [SnapshotBlock(1, None, list(range(1, 1 + BS)))]
    blocks += [SnapshotBlock(h, h - 1, list(range(h * BS, (h + 1) * BS))) for h in range(2, 41)]
    body = WorkerSnapshot([SnapshotRank(0, 5, blocks)], BS)
    try:
        await pump.deliver(chain(2, 100, 3, 1000))  # the rank's old state, at seq 2
        install = asyncio.create_task(
            pump.call_steps(lambda rules: rules.replace_ranks_steps(R.worker_url, body))
        )
        await eventually(lambda: R in tree._staged, poll_s=0)  # built, a slice a turn
        for seq, engine_hash in ((3, 200), (5, 201), (6, 202), (7, 203)):
            assert pump.offer(one_block(seq, engine_hash, 100 * engine_hash))
        assert not install.done() and pump.backlog == 4  # queued behind the install
        assert rules.cursors[R] == 2 and tree.block_count(R) == 3  # the old state is read
        assert await install == "applied"
        await pump.wait_idle()
        assert rules.cursors[R] == 7
        assert rules.stats.batches_skipped == 2  # seq 3 and 5: in the snapshot already
        assert rules.stats.batches_applied == 3  # seq 2 before it, 6 and 7 after it
        assert rules.stats.events["stored", "GPU"] == 3
        assert tree.block_count(R) == 42  # the snapshot's 40, and seq 6's and 7's
        for gone in (100, 200, 201):  # the old state's, and the skipped batches'
            assert tree.key_of(R, gone) is None
    finally:
        await pump.stop()


async def test_a_caller_cancelled_while_its_job_in_steps_runs_leaves_the_pump_running() -> None:
    # A removal cancelled mid-clear (the health loop's eviction at shutdown), a snapshot pull
    # cancelled by its worker's removal: the pump ran the job to its end, then set the result
    # of the cancelled call, and died of the InvalidStateError.
    pump = await started()
    cancelled = False
    steps_after_cancel = 0

    def job(rules: IndexRules) -> Generator[None, None, None]:
        nonlocal steps_after_cancel
        while steps_after_cancel < 3:  # runs until its caller is gone, then a few steps more
            steps_after_cancel += cancelled
            yield

    try:
        caller = asyncio.create_task(pump.call_steps(job))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the pump is inside the job, between two steps
        caller.cancel()
        cancelled = True
        await pump.deliver(chain(0, 1, 3, 1))
        await eventually(lambda: pump.rules.cursors.get(R) == 0, 5)  # a live pump applied it
        assert steps_after_cancel == 3  # the job ran to its end: the writer is never cut
    finally:
        await pump.stop()
