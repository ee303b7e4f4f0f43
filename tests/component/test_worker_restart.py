"""A worker whose engine restarts within `--worker-evict-after-s` is never evicted: what the
replica keeps of it must follow the new process all the same.

Real fake workers and a real replica on loopback; a crash is `stop(send_end=False)` (no
END_SEQ) or a worker process SIGKILLed, the restart a new worker on the same HTTP and KV ports.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.cluster import Cluster
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_port_range
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

BS = 16


def chain(byte: int, blocks: int) -> list[int]:
    return [byte] * (BS * blocks)


async def worker_entry(rt: RouterHandle, url: str) -> dict[str, Any]:
    _, body = await rt.get("/workers")
    return next(w for w in body["workers"] if w["url"] == url)


async def crash(rt: RouterHandle, fw: FakeWorkerHandle) -> None:
    """Kill the engine with no END_SEQ, until the replica has seen its /health fail."""
    assert fw.worker is not None
    await fw.worker.stop(send_end=False)

    async def unhealthy() -> bool:
        return not (await worker_entry(rt, fw.url))["healthy"]

    await eventually(unhealthy, within_s=10)


async def restarts(rt: RouterHandle, reason: str) -> float | None:
    return (await rt.scrape()).get("kvrouter_worker_restarts_total", reason=reason)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
async def test_a_worker_restarted_with_another_dp_size_is_registered_anew_with_its_new_ranks(
    before: int, after: int
) -> None:
    """Its old rank set stayed: a rank the new engine lacks kept its blocks and was routed to
    (the engine's 400 passed to the client), a rank it gained was never subscribed."""
    kv_port_base = free_port_range(2)
    async with (
        fake_worker_in_process(dp_size=before, kv_port_base=kv_port_base) as old,
        router_in_process(
            workers=[old.url],
            health_interval_s=0.05,
            worker_evict_after_s=600,
            expose_route_headers=True,
        ) as rt,
    ):
        for rank in range(before):
            await rt.gate(old, rank)
        await rt.wait_cursor(old.url, before - 1, await old.store([chain(7, 3)], before - 1))
        await crash(rt, old)

        port = urlsplit(old.url).port
        async with fake_worker_in_process(
            port=port, kv_port_base=kv_port_base, dp_size=after
        ) as new:

            async def registered_anew() -> dict[str, Any] | None:
                entry = await worker_entry(rt, new.url)
                ready = entry["state"] == "ready" and entry["healthy"]
                return entry if ready and len(entry["ranks"]) == after else None

            entry = await eventually(registered_anew, within_s=10)
            assert entry["kv_events"]["dp_size"] == after
            assert await restarts(rt, "kv_events_changed") == 1
            assert await restarts(rt, "suspected") == 0
            # Every rank of the new engine is subscribed, and the index holds exactly what
            # each caches: nothing of the old process's ranks.
            for rank in range(after):
                await rt.gate(new, rank)
                seq = await new.store([chain(30 + rank, 2)], rank)
                view = await rt.wait_cursor(new.url, rank, seq)
                assert view["blocks"] == (await new.state(rank))["blocks"] == 1 + 2
            scrape = await rt.scrape()
            held = {
                int(dict(labels)["dp_rank"])
                for labels in scrape.series("kvrouter_index_rank_blocks")
                if dict(labels)["worker_url"] == new.url
            }
            assert held == set(range(after))
            assert rt.replica.workers.subscribed_ranks == after

            # Requests go to ranks the engine has, and are served.
            served: set[str] = set()
            for i in range(8):
                status, _, headers = await rt.post(
                    "/v1/completions", {"prompt": f"request {i} " * 8, "max_tokens": 1}
                )
                assert status == 200
                served.add(headers.get("X-Kvrouter-Dp-Rank", "0"))
            assert served <= {str(rank) for rank in range(after)}


@pytest.mark.parametrize("serve_snapshot", [False, True], ids=["no_snapshot", "snapshot"])
async def test_a_restarted_worker_whose_new_stream_reads_as_a_continuation_keeps_no_ghosts(
    serve_snapshot: bool,
) -> None:
    """The old process published seq 0..n and was killed; /health failed; the new one
    published 0..n before the replica subscribed again (ZeroMQ dropped them), so its next
    batch, n + 1, read as the old stream's next: the old process's blocks stayed for good."""
    kv_port_base = free_port_range(1)
    async with (
        fake_worker_in_process(kv_port_base=kv_port_base, serve_kv_snapshot=serve_snapshot) as old,
        router_in_process(
            workers=[old.url], health_interval_s=0.05, worker_evict_after_s=600
        ) as rt,
    ):
        await rt.gate(old)
        last_old = await old.store([chain(7, 3)])
        view = await rt.wait_cursor(old.url, 0, last_old)
        assert view["blocks"] == 1 + 3  # the gate's probe and the old chain
        await crash(rt, old)

        # /health fails while the new engine starts, as a real engine's does while it loads.
        port = urlsplit(old.url).port
        async with fake_worker_in_process(
            port=port,
            kv_port_base=kv_port_base,
            serve_kv_snapshot=serve_snapshot,
            startup_delay_s=1.5,
        ) as new:
            await new.post("/control/drop-next", {"count": last_old + 1})
            for i in range(last_old + 1):  # seq 0..n, lost to the replica
                await new.store([chain(40 + i, 1)])

            # The old process's blocks leave; with a snapshot, the new one's come in.
            held_now = last_old + 1 if serve_snapshot else 0

            async def old_blocks_gone() -> bool:
                view = await rt.rank_view(new.url, 0)
                return view is not None and view["blocks"] == held_now

            await eventually(old_blocks_gone, within_s=10)
            assert await restarts(rt, "suspected") == 1
            assert await restarts(rt, "kv_events_changed") == 0
            probe = await rt.gate(new)
            assert probe > last_old  # reads as the old stream's next (or a gap past it)
            engine = await new.state()
            if serve_snapshot:
                # Re-pulled: the index holds exactly what the engine caches.
                view = await rt.wait_cursor(new.url, 0, probe)
                assert view["blocks"] == engine["blocks"] == (last_old + 1) + 1
            else:
                # Nothing of the old process; the new one's lost batches are missing (a miss,
                # never a false hit) and the rank says so.
                view = await rt.wait_cursor(new.url, 0, probe)
                assert view["blocks"] == 1
                scrape = await rt.scrape()
                assert scrape.get("kvrouter_index_rank_cold", worker_url=new.url, dp_rank="0") == 1
            assert rt.replica.workers.stats.restarts["suspected"] == 1
            assert rt.replica.workers.stats.evictions == 0


async def test_a_dropped_event_connection_with_health_passing_clears_nothing() -> None:
    """The rule's other side: a drop the replica made itself (a message over
    --kv-events-max-message-bytes) is no restart, and the engine's blocks stay."""
    async with (
        fake_worker_in_process() as fw,
        router_in_process(
            workers=[fw.url],
            health_interval_s=0.05,
            worker_evict_after_s=600,
            kv_events_max_message_bytes=4096,
        ) as rt,
    ):
        await rt.gate(fw)
        await rt.wait_cursor(fw.url, 0, await fw.store([chain(7, 3)]))
        worker = rt.replica.workers.get(fw.url)
        assert worker is not None
        await fw.store([chain(1000, 128)])  # ~6 KiB of tokens: the connection is dropped

        # Looked at again: its /server_info read at a healthy check, as it was registered.
        await eventually(lambda: worker.drops_seen == 1, within_s=10)
        seq = await rt.gate(fw)
        view = await rt.wait_cursor(fw.url, 0, seq)
        assert view["blocks"] == 1 + 3  # the probe and the first chain: nothing cleared
        assert await restarts(rt, "suspected") == 0
        assert await restarts(rt, "listener_gone") == 0
        assert await restarts(rt, "kv_events_changed") == 0
        assert worker.subscriber_stats[0].listener_gone == 0  # the reconnect was answered
        assert worker.healthy and worker.state == "ready"


@pytest.mark.parametrize("ingest_processes", [0, 1], ids=["in_loop", "ingest_process"])
async def test_a_worker_killed_and_restarted_between_two_health_checks_keeps_no_ghosts(
    cluster: Cluster, ingest_processes: int
) -> None:
    """SIGKILLed and started again on the same ports before a health check could fail: /health
    passed at every check and its description is the same, but the reconnect after the drop
    was refused (nothing listened on the port), which an engine that lived on never shows.
    Its new stream read as the old one's continuation: the old process's blocks stayed."""
    kv_port_base = free_port_range(1)
    old = await cluster.worker(
        "old", replay=False, kv_port_base=kv_port_base, serve_kv_snapshot=False
    )
    # The replica's own health loop never runs: the test makes each pass, none in the restart.
    async with router_in_process(
        workers=[old.url],
        health_interval_s=3600,
        worker_evict_after_s=600,
        kv_ingest_processes=ingest_processes,
    ) as rt:
        workers = rt.replica.workers
        worker = workers.get(old.url)
        assert worker is not None and old.child is not None
        await rt.gate(old)
        last_old = await old.store([chain(7, 3)])
        assert (await rt.wait_cursor(old.url, 0, last_old))["blocks"] == 1 + 3
        await old.child.kill()
        await eventually(lambda: worker.subscriber_stats[0].listener_gone == 1, within_s=10)

        new = await cluster.worker(
            "new",
            replay=False,
            port=old.config.port,
            kv_port_base=kv_port_base,
            serve_kv_snapshot=False,
        )
        await new.post("/control/drop-next", {"count": last_old + 1})
        for i in range(last_old + 1):  # seq 0..n, lost to the replica
            await new.store([chain(40 + i, 1)])
        probe = await rt.gate(new)
        assert probe > last_old  # reads as the old stream's next (or a gap past it)
        assert (await rt.rank_view(new.url, 0) or {})["blocks"] == 1 + 3  # the ghosts

        await workers.check_health_once()
        assert (await rt.rank_view(new.url, 0) or {})["blocks"] == 0
        assert await restarts(rt, "listener_gone") == 1
        assert await restarts(rt, "suspected") == 0
        assert await restarts(rt, "kv_events_changed") == 0
        assert workers.stats.health_checks_failed == 0
        assert workers.stats.evictions == 0
        # The new engine's batches are learned again; the rank says it missed some.
        view = await rt.wait_cursor(new.url, 0, await rt.gate(new))
        assert view["blocks"] == 1
        scrape = await rt.scrape()
        assert scrape.get("kvrouter_index_rank_cold", worker_url=new.url, dp_rank="0") == 1
        # The drop was looked at once: the next pass clears nothing.
        await workers.check_health_once()
        assert (await rt.rank_view(new.url, 0) or {})["blocks"] == 1
        assert await restarts(rt, "listener_gone") == 1


async def test_a_worker_restarted_serving_another_model_has_its_new_listing_read_at_once() -> None:
    """Its old listing was kept (only a restart that changed its KV-event description read
    it again): requests for the new model went anywhere, those for the old one to it."""
    kv_port_base = free_port_range(1)
    async with (
        fake_worker_in_process(kv_port_base=kv_port_base, model="m-old") as old,
        router_in_process(
            workers=[old.url],
            health_interval_s=0.05,
            worker_evict_after_s=600,
            worker_models_refresh_s=0,  # no refresh: the restart alone reads it
        ) as rt,
    ):
        await rt.gate(old)
        await crash(rt, old)
        port = urlsplit(old.url).port
        async with fake_worker_in_process(
            port=port, kv_port_base=kv_port_base, model="m-new", startup_delay_s=1.5
        ) as new:
            worker = rt.replica.workers.get(new.url)
            assert worker is not None
            await eventually(lambda: worker.models.bases == ("m-new",), within_s=10)
            assert rt.replica.workers.stats.restarts["suspected"] == 1
