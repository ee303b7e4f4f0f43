"""A replica's view of worker streams: gaps, replay, holes, restarts, worker snapshots."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from cachetree.tree import BlockTree
from router.subscriber import MAX_SEQ_JUMP
from router.worker_snapshot import decode_worker_snapshot, rebuild_rank
from tests.support.adversary import front
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

BS = 16


def chain(start: int, blocks: int = 2) -> list[int]:
    return list(range(start, start + blocks * BS))


async def worker_view(fw: FakeWorkerHandle) -> frozenset:
    async with fw.session.get(f"{fw.url}/v1/kv-snapshot") as resp:
        snap = decode_worker_snapshot(await resp.read())
    tree = BlockTree(BS)
    rank = RankId(fw.url, 0)
    rebuild_rank(tree, rank, snap.ranks[0], snap.block_size)
    return canonical_view(tree)


def replica_view(rt: RouterHandle) -> frozenset:
    tree = rt.replica.pump.rules.tree
    assert tree is not None
    return canonical_view(tree)


async def assert_whole_and_repaired_by_replay(rt: RouterHandle, fw: FakeWorkerHandle) -> None:
    """The replica holds what the worker does, nothing was counted lost, and one gap was
    repaired by replay."""
    assert replica_view(rt) == await worker_view(fw)
    assert rt.replica.pump.rules.stats.lost_batches[RankId(fw.url, 0)] == 0
    (sub,) = rt.replica.workers.get(fw.url).subscriber_stats.values()
    assert sub.replay["repaired"] == 1


async def test_a_dropped_delivery_is_repaired_by_replay() -> None:
    async with (
        fake_worker_in_process(replay=True, serve_kv_snapshot=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        await rt.gate(fw)
        await fw.post("/control/drop-next", {"count": 2})
        await fw.store([chain(100), chain(200)])  # never sent live
        last = await fw.store([chain(300)])
        await rt.wait_cursor(fw.url, 0, last)
        await assert_whole_and_repaired_by_replay(rt, fw)


async def test_a_hole_no_replay_can_fill_is_counted_as_lost() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        await rt.gate(fw)
        await fw.post("/control/skip-seq", {"dp_rank": 0})
        last = await fw.store([chain(100)])
        await rt.wait_cursor(fw.url, 0, last)
        assert rt.replica.pump.rules.stats.lost_batches[RankId(fw.url, 0)] == 1


async def test_a_gap_without_replay_is_counted_as_lost() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        await rt.gate(fw)
        await fw.post("/control/drop-next", {"count": 3})
        await fw.store([chain(100), chain(200), chain(300)])
        last = await fw.store([chain(400)])
        await rt.wait_cursor(fw.url, 0, last)
        assert rt.replica.pump.rules.stats.lost_batches[RankId(fw.url, 0)] == 3


async def test_a_publisher_restart_clears_the_rank_and_relearns_it() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        await rt.gate(fw)
        last = await fw.store([chain(100, 4)])
        view = await rt.wait_cursor(fw.url, 0, last)
        assert view["blocks"] >= 4
        await fw.post("/control/restart-publisher", {"dp_rank": 0})
        seq = await fw.store([chain(900, 1)])
        assert seq == 0

        async def restarted() -> dict | None:
            view = await rt.rank_view(fw.url, 0)
            return view if view["cursor"] == 0 else None

        view = await eventually(restarted)
        assert view["blocks"] == 1
        assert rt.replica.pump.rules.stats.restarts_at_zero == 1


def rank_cursor(rt: RouterHandle, fw: FakeWorkerHandle) -> int | None:
    return rt.replica.pump.rules.cursors.get(RankId(fw.url, 0))


async def restart_with_its_first_batches_unheard(
    fw: FakeWorkerHandle, rt: RouterHandle, unheard: int
) -> int:
    """Five batches, then the engine restarts and its first `unheard` batches never go out
    live (sent before the router reconnected); then one that does. Returns its seq."""
    for start in range(100, 600, 100):
        last = await fw.store([chain(start)])
    await rt.wait_cursor(fw.url, 0, last)
    await fw.post("/control/restart-publisher", {"dp_rank": 0})
    await fw.post("/control/drop-next", {"count": unheard})
    for start in range(600, 600 + 100 * unheard, 100):
        await fw.store([chain(start)])
    seq = await fw.store([chain(900)])
    assert 0 < seq == unheard <= last  # back below the old stream's seq: a restart
    return seq


async def test_a_restarted_publishers_unheard_first_batches_are_replayed() -> None:
    async with (
        fake_worker_in_process(replay=True, serve_kv_snapshot=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        await rt.gate(fw)
        seq = await restart_with_its_first_batches_unheard(fw, rt, 2)
        # Exactly `seq`: the old stream's cursor (4) is past it already, so "at least" held
        # before the restart was seen, and the view was read with the old blocks in it.
        await eventually(lambda: rank_cursor(rt, fw) == seq, 10)
        await assert_whole_and_repaired_by_replay(rt, fw)


async def test_a_restarted_publishers_unreplayable_first_batches_count_lost_and_re_pull() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        pulls = rt.replica.workers.stats.snapshot_pulls
        await eventually(lambda: pulls["applied"], 5)
        await rt.gate(fw)
        seq = await restart_with_its_first_batches_unheard(fw, rt, 2)
        await eventually(lambda: pulls["applied"] >= 2, 5)  # the loss re-pulled the snapshot
        await rt.wait_cursor(fw.url, 0, seq)
        assert replica_view(rt) == await worker_view(fw)
        assert rt.replica.pump.rules.stats.lost_batches[RankId(fw.url, 0)] == 2


async def test_a_seq_jump_past_the_bound_clears_the_rank_and_re_pulls_its_snapshot() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        pulls = rt.replica.workers.stats.snapshot_pulls
        await eventually(lambda: pulls["applied"], 5)
        await rt.gate(fw)
        await fw.store([chain(100, 3)])
        await fw.post("/control/skip-seq", {"dp_rank": 0, "count": MAX_SEQ_JUMP + 5})
        seq = await fw.store([chain(100, 4)])  # one block more, under the three: needs them
        await eventually(lambda: pulls["applied"] >= 2, 5)
        await rt.wait_cursor(fw.url, 0, seq)
        assert replica_view(rt) == await worker_view(fw)
        assert rt.replica.pump.rules.stats.lost_batches[RankId(fw.url, 0)] == 0


async def test_a_worker_registered_while_running_is_pulled_at_once() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True) as fw,
        router_in_process() as rt,
    ):
        await fw.store([chain(100, 3), chain(500, 2)])  # cached before any router listened
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _, _ = await rt.post("/workers", {"url": fw.url})
        assert status == 200
        await eventually(lambda: rt.replica.workers.stats.snapshot_pulls["applied"], 0.3)
        assert loop.time() - started < 0.3
        assert (await rt.rank_view(fw.url, 0))["blocks"] == 5


async def test_re_registering_a_known_worker_pulls_nothing() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        pulls = rt.replica.workers.stats.snapshot_pulls
        await eventually(lambda: sum(pulls.values()), 2)
        for _ in range(5):
            status, _, _ = await rt.post("/workers", {"url": fw.url})
            assert status == 200
        await rt.replica.pump.wait_idle()
        assert sum(pulls.values()) == 1


async def test_a_worker_without_a_snapshot_route_is_asked_once() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        pulls = rt.replica.workers.stats.snapshot_pulls
        await eventually(lambda: pulls["not_served"], 2)
        await rt.gate(fw)
        await fw.post("/control/drop-next", {"count": 1})
        await fw.store([chain(100)])
        last = await fw.store([chain(200)])
        await rt.wait_cursor(fw.url, 0, last)
        assert rt.replica.workers.get(fw.url).snapshot_served is False
        assert sum(pulls.values()) == 1


async def test_removing_a_worker_clears_its_ranks_before_the_call_returns() -> None:
    async with (
        fake_worker_in_process() as fw,
        fake_worker_in_process() as other,
        router_in_process(workers=[fw.url, other.url]) as rt,
    ):
        await rt.gate(fw)
        last = await fw.store([chain(100, 3)])
        await rt.wait_cursor(fw.url, 0, last)
        status, _ = await rt.delete(f"/workers?url={fw.url}")
        assert status == 200
        tree = rt.replica.pump.rules.tree
        assert tree.block_count(RankId(fw.url, 0)) == 0
        assert RankId(fw.url, 0) not in rt.replica.pump.rules.cursors


async def test_a_worker_with_another_block_size_is_refused_and_listed() -> None:
    async with (
        fake_worker_in_process(block_size=32) as fw,
        router_in_process(workers=[fw.url], block_size=16) as rt,
    ):
        status, body = await rt.get("/workers")
        (worker,) = body["workers"]
        assert worker["state"] == "refused"
        assert "block size 32" in worker["reason"]
        assert rt.replica.workers.stats.refused["block_size"] == 1
        status, _ = await rt.get("/readyz")
        assert status == 503
        # Refused, not unhealthy: it is not health-checked, so no worker_healthy 0 for it
        # (an unhealthy-worker alert would fire on a worker nobody sends traffic to).
        scrape = await rt.scrape()
        assert scrape.names("kvrouter_worker_healthy") == []
        assert scrape.value("kvrouter_workers_refused_total", reason="block_size") == 1


@pytest.mark.parametrize("ingest_processes", [0, 1])
async def test_a_worker_stating_no_block_size_is_refused_at_its_first_store_of_another(
    ingest_processes: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM worker (no /server_info) started with --block-size 32 in a 16 fleet: its stores
    were dropped by the index, counted unlabelled, and it stayed ready with nothing indexed,
    taking its share of the traffic (repeats booked to it). Now it is refused as one whose
    /server_info states 32 is, its ranks out of the index, logged once."""
    async with (
        fake_worker_in_process() as honest,
        fake_worker_in_process(block_size=32) as other,
        # Its /metrics hidden too (they state its block size): what the events show.
        front(other, {"/server_info": (404, b""), "/metrics": (404, b"")}) as other_url,
        router_in_process(
            workers=[honest.url, other_url],
            block_size=16,
            kv_events_port_base=other.config.kv_port_base,
            expose_route_headers=True,
            health_interval_s=600,  # no look again at it in the test's time
            kv_ingest_processes=ingest_processes,
        ) as rt,
    ):
        registry = rt.replica.workers
        worker = registry.get(other_url)
        assert worker is not None and worker.state == "ready"
        with caplog.at_level(logging.ERROR, logger="router.workers"):
            async with asyncio.timeout(10):
                # Published again until the subscription has one: a SUB misses what comes
                # before it joined.
                while worker.state == "ready":
                    await other.store([list(range(32))])
                    with contextlib.suppress(TimeoutError):
                        await eventually(lambda: worker.state != "ready", within_s=0.2)
        assert worker.state == "refused"
        assert "blocks of 32 tokens, not the fleet's 16" in worker.reason
        assert registry.stats.refused["block_size"] == 1
        assert RankId(other_url, 0) not in rt.replica.pump.rules.live
        assert [w.url for w in registry.routable()] == [honest.url]
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1, refusals
        for i in range(4):
            status, body, headers = await rt.post(
                "/v1/completions",
                {"model": "fake-model", "prompt": f"prompt {i} " + "x" * 64, "max_tokens": 1},
            )
            assert status == 200 and headers["X-Kvrouter-Worker"] == honest.url, body
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_workers_refused_total", reason="block_size") == 1


async def test_stopping_a_replica_terminates_its_zmq_context_with_every_socket_closed() -> None:
    async with fake_worker_in_process(replay=True) as fw:
        async with router_in_process(workers=[fw.url]) as rt:
            await rt.gate(fw)
            ctx = rt.replica.zmq_context
            assert not ctx.closed
        # Term only ends once every subscriber socket (live SUB and replay DEALER) is closed;
        # a leaked one would leave the context open, and the collector would term it later
        # on whatever thread collects it.
        assert ctx.closed


async def test_a_worker_not_up_at_registration_waits_down_and_gets_its_own_dp_size() -> None:
    """A router that starts before its worker must not guess the worker's ranks from the
    flags (dp 1 here) for good: it waits, down, and registers it from its /server_info (dp 2)
    once /health answers."""
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    async with router_in_process(workers=[url], health_interval_s=0.05) as rt:
        status, body = await rt.get("/workers")
        assert status == 200
        (worker,) = body["workers"]
        assert worker["state"] == "down" and "/server_info unreachable" in worker["reason"]
        assert not rt.replica.pump.rules.live  # no rank subscribed on a guess
        async with fake_worker_in_process(port=port, dp_size=2) as fw:

            async def registered() -> dict | None:
                _, listing = await rt.get("/workers")
                (w,) = listing["workers"]
                return w if w["state"] == "ready" else None

            ready = await eventually(registered, 10.0)
            assert [r["dp_rank"] for r in ready["ranks"]] == [0, 1]
            await rt.gate(fw, dp_rank=1)
