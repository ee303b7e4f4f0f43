"""Ingest processes over real ZMQ and real child processes: a fake worker's stores reach the
pump's tree through them, their counters reach the replica, and a process that dies is
started again (counted), or reported unhealthy when it cannot be kept alive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator

import pytest
import zmq.asyncio

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.index import IndexRules, Pump
from router.ingest_pool import UNHEALTHY_AFTER, IngestPool
from router.subscriber import RankEndpoint, SubscriberItem, SubscriberStats
from router.zmq_term import terminate_context
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.router import router_in_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

BS = 16


class Fleet:
    def __init__(self, fw: FakeWorkerHandle, pool: IngestPool, pump: Pump) -> None:
        self.fw = fw
        self.pool = pool
        self.pump = pump
        self.ranks = [RankId(fw.url, dp) for dp in range(fw.config.dp_size)]
        self.stats = {rank: SubscriberStats() for rank in self.ranks}
        self.tasks: list[asyncio.Task[None]] = []
        self.resumed: list[RankId] = []  # ranks the pool said it resumed in a new process

    @property
    def tree(self) -> BlockTree:
        assert self.pump.rules.tree is not None
        return self.pump.rules.tree

    def subscribe(self) -> None:
        for rank in self.ranks:
            endpoint = RankEndpoint(
                rank,
                self.fw.kv_endpoint(rank.dp_rank),
                replay_endpoint=self.fw.replay_endpoint(rank.dp_rank),
            )
            self.tasks.append(
                asyncio.create_task(self.pool.subscription(endpoint, self.stats[rank]))
            )

    async def gate(self) -> None:
        """Probe every rank until its probe block is in the tree (subscriptions are live)."""
        cursors = self.pump.rules.cursors
        for rank in self.ranks:
            probe = self.fw.probe_for(rank.dp_rank)
            async with asyncio.timeout(30):
                while True:  # a connecting SUB misses what was published before it joined
                    seq = await probe()
                    with contextlib.suppress(TimeoutError):
                        await eventually(lambda r=rank, s=seq: cursors.get(r, -1) >= s, 0.3)
                        break


@pytest.fixture
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    """Two ingest processes, a rank each; `indirect` parameters are the pool's keywords."""
    context = zmq.asyncio.Context()
    rules = IndexRules(BlockTree(BS))
    pump = Pump(rules)
    pump.start()
    async with fake_worker_in_process(dp_size=2, replay=True) as fw:
        rules.add_ranks([RankId(fw.url, dp) for dp in range(2)])
        resumed: list[RankId] = []
        pool = IngestPool(
            2,
            pump.deliver,
            context=context,
            applied=rules.cursors.get,
            resumed=resumed.append,
            **getattr(request, "param", {}),
        )
        pool.start()
        f = Fleet(fw, pool, pump)
        f.resumed = resumed
        try:
            yield f
        finally:
            for task in f.tasks:
                task.cancel()
            await asyncio.gather(*f.tasks, return_exceptions=True)
            await pool.close()
            await pump.stop()
    await terminate_context(context, within_s=2.0, what="test")


async def test_stores_reach_the_tree_through_one_process_per_rank(fleet: Fleet) -> None:
    fleet.subscribe()
    await fleet.gate()
    assert fleet.pool.ranks_per_process() == [1, 1]
    pids = fleet.pool.pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids
    before = {rank: fleet.tree.block_count(rank) for rank in fleet.ranks}
    await fleet.fw.store([list(range(100, 100 + 3 * BS))], dp_rank=0)
    last = await fleet.fw.store([list(range(300, 300 + 2 * BS))], dp_rank=1)
    await eventually(lambda: fleet.pump.rules.cursors.get(fleet.ranks[1], -1) >= last)
    await eventually(lambda: fleet.tree.block_count(fleet.ranks[0]) == before[fleet.ranks[0]] + 3)
    assert fleet.tree.block_count(fleet.ranks[1]) == before[fleet.ranks[1]] + 2
    # The subscribers' counters, kept in the processes, reach the replica's stats objects.
    await eventually(lambda: all(s.batches >= 2 for s in fleet.stats.values()), within_s=5)
    assert fleet.pool.stats.bad_messages == 0


async def test_a_killed_process_is_started_again_and_its_rank_resubscribes(fleet: Fleet) -> None:
    fleet.subscribe()
    await fleet.gate()
    victim = fleet.pool.pids()[0]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    await eventually(lambda: fleet.pool.stats.restarts[0] == 1, within_s=10)
    await eventually(lambda: fleet.pool.pids()[0] not in (None, victim), within_s=10)
    assert fleet.pool.stats.restarts[1] == 0
    assert fleet.pool.unhealthy is None
    await fleet.gate()  # both ranks deliver again
    last = await fleet.fw.store([list(range(500, 500 + BS))], dp_rank=0)
    await eventually(lambda: fleet.pump.rules.cursors.get(fleet.ranks[0], -1) >= last)
    assert fleet.tree.block_count(fleet.ranks[0]) >= 2  # a probe block and the new one


async def test_a_process_started_again_replays_what_the_dead_one_missed_and_counts_on(
    fleet: Fleet,
) -> None:
    """A new process knew nothing of its ranks: its subscriber took its first batch as the
    first of the stream, so what was published while no process listened was lost for good
    (the index kept evicted blocks and lacked stored ones) though the worker could replay it;
    and the rank's counters started again from 0. It now resumes from the index's cursor."""
    fleet.subscribe()
    await fleet.gate()
    rank = fleet.ranks[0]
    for i in range(20):  # counters well above what the new process will count
        await fleet.fw.store([list(range(1000 + i * BS, 1000 + (i + 1) * BS))], dp_rank=0)
    await eventually(lambda: fleet.stats[rank].batches >= 21, within_s=10)
    counted = fleet.stats[rank].batches
    held = fleet.tree.block_count(rank)
    victim = fleet.pool.pids()[0]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    await eventually(lambda: fleet.pool.stats.restarts[0] == 1, within_s=10)
    # Published while no process listens to the rank (the new one starts after a backoff).
    missed = await fleet.fw.store([list(range(5000, 5000 + 3 * BS))], dp_rank=0)
    await fleet.gate()
    await eventually(lambda: fleet.pump.rules.cursors.get(rank, -1) >= missed, within_s=10)
    assert fleet.tree.block_count(rank) == held + 3
    assert not fleet.pump.rules.stats.lost_batches
    await eventually(lambda: fleet.stats[rank].replayed >= 1, within_s=10)
    assert fleet.stats[rank].batches > counted  # counted on, not from 0
    # The seqs cannot show an engine restarted while no process listened: the rank's worker
    # snapshot is pulled again (an engine restarted meanwhile spliced its new stream's
    # batches onto the old one's blocks, silently).
    assert fleet.resumed == [rank]
    # The dead process's channel went with it: one ipc path per live process, no more.
    assert len(os.listdir(fleet.pool._dir)) == 2


def _reaped(pid: int) -> bool:
    """Gone for good: a zombie (killed, not yet waited for) still takes signal 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


SILENCE_S = 1.0


@pytest.mark.parametrize("fleet", [{"silence_s": SILENCE_S}], indirect=True)
async def test_a_stopped_process_is_killed_within_the_bound_and_its_rank_resumes_in_a_new_one(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """A process alive but stuck never exits: its rank silently stopped updating the index.
    Its silence now gets it SIGKILLed (a stopped process takes no SIGTERM) and reaped, and
    the restart path resumes its rank from the last seq applied."""
    fleet.subscribe()
    await fleet.gate()
    rank = fleet.ranks[0]
    held = fleet.tree.block_count(rank)
    victim = fleet.pool.pids()[0]
    assert victim is not None
    os.kill(victim, signal.SIGSTOP)
    # Published while the process is stopped: it never hands this over.
    missed = await fleet.fw.store([list(range(700, 700 + 2 * BS))], dp_rank=0)
    # Noticed within the bound (plus a tick of the check, and room for a busy host).
    await eventually(lambda: fleet.pool.stats.hung[0] == 1, within_s=2 * SILENCE_S + 1)
    warned = [r for r in caplog.records if "taken as hung" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"] and f"pid {victim}" in warned[
        0
    ].getMessage()
    await eventually(lambda: _reaped(victim), within_s=5)
    await eventually(lambda: fleet.pool.pids()[0] not in (None, victim), within_s=10)
    assert fleet.pool.stats.restarts[0] == 1
    # The other process had no events all along: its heartbeats alone kept it.
    assert fleet.pool.stats.hung[1] == 0 and fleet.pool.stats.restarts[1] == 0
    await fleet.gate()
    await eventually(lambda: fleet.pump.rules.cursors.get(rank, -1) >= missed, within_s=10)
    last = await fleet.fw.store([list(range(900, 900 + 3 * BS))], dp_rank=0)
    await eventually(lambda: fleet.pump.rules.cursors.get(rank, -1) >= last, within_s=10)
    # The blocks stored while it was stopped (replayed) and after (a probe is one block, the
    # same every time).
    assert fleet.tree.block_count(rank) == held + 2 + 3
    assert not fleet.pump.rules.stats.lost_batches
    assert fleet.resumed == [rank]  # its worker snapshot pulled again, as after an exit


@pytest.mark.parametrize("fleet", [{"silence_s": SILENCE_S}], indirect=True)
async def test_a_process_frozen_with_the_replica_is_not_taken_as_hung(fleet: Fleet) -> None:
    """The whole pod frozen past the bound (a CPU quota, a VM pause): the replica did not run
    either, so the process's silence is no hang. Its tick came first after the thaw, before
    any beat, and every process was killed and every rank re-pulled."""
    fleet.subscribe()
    await fleet.gate()
    child = fleet.pool.pids()[0]
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    # The fault itself, not a wait: the replica's loop frozen too, past the bound.
    time.sleep(1.5 * SILENCE_S)  # noqa: ASYNC251
    # The process thaws a moment after the replica's loop runs again: its tick comes first.
    asyncio.get_running_loop().call_later(0.05, os.kill, child, signal.SIGCONT)
    with pytest.raises(TimeoutError):
        await eventually(lambda: fleet.pool.stats.hung[0], within_s=3 * SILENCE_S)
    assert fleet.pool.pids()[0] == child and fleet.pool.stats.restarts[0] == 0


async def test_a_process_whose_batches_wait_on_a_slow_pump_is_not_taken_as_hung() -> None:
    """Its beats queue behind its batches while the replica is held up delivering them: the
    process is not the one behind, and killing it would only lose what it holds."""
    silence_s = 1.0
    context = zmq.asyncio.Context()
    rules = IndexRules(BlockTree(BS))
    pump = Pump(rules)
    pump.start()
    flowing = asyncio.Event()
    flowing.set()

    async def behind(item: SubscriberItem) -> None:
        await flowing.wait()
        await pump.deliver(item)

    async with fake_worker_in_process(dp_size=1, replay=True) as fw:
        rank = RankId(fw.url, 0)
        rules.add_ranks([rank])
        pool = IngestPool(1, behind, context=context, silence_s=silence_s)
        pool.start()
        endpoint = RankEndpoint(rank, fw.kv_endpoint(0), replay_endpoint=fw.replay_endpoint(0))
        task = asyncio.create_task(pool.subscription(endpoint, SubscriberStats()))
        try:
            fleet = Fleet(fw, pool, pump)
            fleet.ranks = [rank]
            await fleet.gate()
            flowing.clear()  # the pump is behind from here
            delivered = pool.stats.items
            seq = await fw.store([list(range(100, 100 + BS))], dp_rank=0)
            await eventually(lambda: pool.stats.items > delivered)  # the reader waits on it
            with pytest.raises(TimeoutError):
                await eventually(lambda: pool.stats.hung[0], within_s=4 * silence_s)
            flowing.set()
            await eventually(lambda: rules.cursors.get(rank, -1) >= seq)
            assert pool.stats.hung[0] == 0 and pool.stats.restarts[0] == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await pool.close()
            await pump.stop()
    await terminate_context(context, within_s=2.0, what="test")


async def test_a_process_that_cannot_be_started_is_retried_and_reported_never_dropped() -> None:
    """Starting one raised (out of file descriptors; an ipc path the system refuses), which
    ended its supervision for good without a word: its ranks were never ingested again,
    /readyz stayed 200, and the error came out of `close` at shutdown."""
    context = zmq.asyncio.Context()
    pump = Pump(IndexRules(BlockTree(BS)))
    missing = ("/nonexistent/kvrouter-ingest-child",)
    pool = IngestPool(1, pump.deliver, context=context, command=missing)
    pool.start()
    try:
        await eventually(lambda: pool.unhealthy is not None, within_s=20)
        assert pool.stats.restarts[0] >= UNHEALTHY_AFTER
        assert not pool._tasks[0].done()  # still supervising
    finally:
        await pool.close()
        await terminate_context(context, within_s=2.0, what="test")


async def test_a_process_that_keeps_dying_makes_the_pool_unhealthy() -> None:
    context = zmq.asyncio.Context()
    pump = Pump(IndexRules(BlockTree(BS)))
    dies = (sys.executable, "-c", "import sys; sys.exit(3)")
    pool = IngestPool(1, pump.deliver, context=context, command=dies)
    pool.start()
    try:
        await eventually(lambda: pool.unhealthy is not None, within_s=20)
        assert pool.stats.restarts[0] >= UNHEALTHY_AFTER
        assert "ingest process 0" in pool.unhealthy and "exit status 3" in pool.unhealthy
    finally:
        await pool.close()
        await terminate_context(context, within_s=2.0, what="test")


async def test_ingest_processes_asked_of_a_policy_without_an_index_are_said_to_be_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with router_in_process(policy="round_robin", kv_ingest_processes=2) as rt:
        assert rt.replica.config.kv_ingest_processes == 2
    assert any("--kv-ingest-processes 2 is ignored" in r.getMessage() for r in caplog.records)


async def test_readyz_waits_for_an_ingest_processs_subscription_so_a_first_batch_is_indexed() -> (
    None
):
    """`/readyz` went 200 ~0.1 s before the ingest process subscribed, and the batch of the
    first request after it was never seen."""
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], kv_ingest_processes=1) as rt,
    ):
        reasons = set()

        async def ready() -> bool:
            status, reason = await rt.readyz()
            reasons.add(reason)
            return status == 200

        await eventually(ready, within_s=15, poll_s=0.01)
        assert reasons <= {"subscribing to 1 rank(s)", ""}, reasons
        seq = await fw.store([list(range(100, 132))])  # the rank's first batch
        cursors = rt.replica.pump.rules.cursors
        await eventually(lambda: cursors.get(RankId(fw.url, 0), -1) >= seq)
