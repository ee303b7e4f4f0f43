"""A worker's removal takes its ranks out of the index in slices, the loop turning between
them, as a publisher reset's clear does: in one step, a rank of 800k blocks held /healthz
891 ms. A real fake worker, a real pump, real HTTP and ZMQ on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import zmq.asyncio

from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from router.dataplane.polling import PollClient
from router.index import IndexRules, Pump
from router.loads import LoadMonitor
from router.workers import WorkerRegistry
from router.zmq_term import terminate_context
from tests.support.fake_worker import fake_worker_in_process
from tests.support.waiting import eventually

BS = 16
SLICE = 64
HELD = SLICE * 40  # blocks the removed rank holds: 40 slices


@contextlib.asynccontextmanager
async def registry() -> AsyncIterator[WorkerRegistry]:
    context = zmq.asyncio.Context()
    pump = Pump(IndexRules(BlockTree(BS), slice_blocks=SLICE))
    pump.start()
    try:
        async with aiohttp.ClientSession() as session:
            workers = WorkerRegistry(
                pump,
                session,
                LoadMonitor(PollClient(), interval_s=10),
                block_size=BS,
                zmq_context=context,
            )
            try:
                yield workers
            finally:
                await workers.close()
                await pump.stop()
    finally:
        await terminate_context(context, within_s=2.0, what="test")


async def fill(pump: Pump, rank: RankId, first_hash: int, n_blocks: int) -> None:
    """`n_blocks` blocks stored for `rank` as one chain, as its engine's stores would be."""
    hashes = list(range(first_hash, first_hash + n_blocks))
    tokens = [(first_hash + i) % 50_000 for i in range(n_blocks * BS)]
    stored = await pump.call(
        lambda rules: rules._tree.store(rank, None, hashes, tokens, BS, DEVICE)
    )
    assert stored and pump.rules._tree.block_count(rank) >= n_blocks


async def filled_worker(workers: WorkerRegistry, url: str) -> RankId:
    """`url` registered, its one rank holding HELD blocks."""
    await workers.add(url)
    (rank,) = workers.get(url).ranks()  # type: ignore[union-attr]
    await fill(workers.pump, rank, 1, HELD)
    return rank


async def test_a_removal_lets_the_loop_run_between_slices_of_its_ranks_clear() -> None:
    async with fake_worker_in_process() as worker, registry() as workers:
        rank = await filled_worker(workers, worker.url)
        pump = workers.pump
        tree = pump.rules._tree
        loop = asyncio.get_running_loop()
        seen: list[int] = []  # the rank's blocks at each turn of the loop during the removal

        def tick() -> None:
            nonlocal handle
            seen.append(tree.block_count(rank))
            handle = loop.call_soon(tick)

        handle = loop.call_soon(tick)
        try:
            assert await workers.remove(worker.url)
        finally:
            handle.cancel()
        assert tree.block_count(rank) == 0 and rank not in pump.rules.live
        # Turns saw the rank half cleared: in one step, none would (only HELD, then 0).
        partial = {n for n in seen if 0 < n < HELD}
        assert len(partial) >= HELD // SLICE // 2


async def test_a_worker_registered_again_right_after_its_removal_keeps_its_new_ranks() -> None:
    # Its ranks are the same ids (URL, dp rank): the old clear's tail must not reach the new.
    async with fake_worker_in_process() as worker, registry() as workers:
        rank = await filled_worker(workers, worker.url)
        pump = workers.pump
        removal = asyncio.create_task(workers.remove(worker.url))
        await eventually(lambda: workers.get(worker.url) is None)  # out, its clear queued
        again = await workers.add(worker.url)
        assert await removal
        assert again.state == "ready" and again.ranks() == (rank,)
        assert rank in pump.rules.live
        tree = pump.rules._tree
        assert tree.block_count(rank) == 0  # nothing of the old incarnation
        await fill(pump, rank, 1_000_000, 10)
        await pump.wait_idle()
        assert tree.block_count(rank) == 10
        assert tree.key_of(rank, 1) is None and tree.key_of(rank, 1_000_000) is not None
