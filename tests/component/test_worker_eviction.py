"""A worker that dies leaves the index, and comes back as a new registration.

A crashed engine sends no END_SEQ, and a static `--worker` list never removes it: without
eviction its ranks would keep their blocks for good. Real fake workers and a real replica on
loopback; the crash is `stop(send_end=False)`, the restart a new worker on the same ports.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from urllib.parse import urlsplit

from aiohttp import web

from router.workers import (
    REREGISTER_BACKOFF_MAX_S,
    evict_due,
    fails_over_in_flight,
    reregister_after_s,
)
from tests.support.adversary import stub_server, stub_worker_routes
from tests.support.fake_worker import fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

BS = 16


def chain(byte: int, blocks: int) -> list[int]:
    return [byte] * (BS * blocks)


async def worker_entry(rt: RouterHandle, url: str) -> dict:
    _, body = await rt.get("/workers")
    return next(w for w in body["workers"] if w["url"] == url)


def test_eviction_is_due_only_after_the_whole_window_and_never_when_off() -> None:
    assert not evict_due(None, 100.0, 30.0)
    assert not evict_due(80.0, 109.9, 30.0)
    assert evict_due(80.0, 110.0, 30.0)
    assert not evict_due(0.0, 1e9, 0.0)


def test_requests_in_flight_fail_over_once_a_spell_at_the_second_failed_check() -> None:
    assert [fails_over_in_flight(n) for n in (0, 1, 2, 3, 10)] == [False, False, True] + [False] * 2


def test_registration_anew_backs_off_from_one_health_interval_doubling_to_a_minute() -> None:
    assert [reregister_after_s(n, 2.0) for n in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert reregister_after_s(6, 2.0) == REREGISTER_BACKOFF_MAX_S
    assert reregister_after_s(10_000, 2.0) == REREGISTER_BACKOFF_MAX_S


async def test_a_worker_answering_health_but_never_registering_is_tried_ever_less_often() -> None:
    # /health 200, /server_info 503: it was registered anew at every health pass, forever.
    asked: Counter[str] = Counter()

    async def health(_: web.Request) -> web.Response:
        asked["/health"] += 1
        return web.json_response({"status": "ok"})

    async def server_info(_: web.Request) -> web.Response:
        asked["/server_info"] += 1
        return web.Response(status=503, text="loading")

    routes = stub_worker_routes({("GET", "/health"): health, ("GET", "/server_info"): server_info})
    interval_s = 0.02
    async with stub_server(routes) as url:
        started = time.monotonic()
        async with router_in_process(workers=[url], health_interval_s=interval_s) as rt:
            await eventually(lambda: asked["/health"] >= 60, within_s=20)
            elapsed = time.monotonic() - started
            # Health checks go on at every pass; the tries (the first registration, then
            # after waits of 1, 2, 4, ... intervals) fit in the time, never one per pass.
            tries = asked["/server_info"]
            assert 3 <= tries <= 2 + math.log2(elapsed / interval_s + 1), (asked, elapsed)
            worker = rt.replica.workers.get(url)
            assert worker is not None and worker.state == "down"
            # Every try after the first failed and was counted (one may still be under way).
            assert tries - 1 - worker.reregister_failures in (0, 1), worker
            assert "/server_info" in worker.reason  # a try under way keeps the last one's


async def test_a_down_workers_reason_stays_while_its_next_registration_try_runs() -> None:
    """A try cleared the reason as it began: `GET /workers` showed a down worker with no
    reason for as long as the try took (its /server_info, its /v1/models)."""
    asked: Counter[str] = Counter()
    gate = asyncio.Event()

    async def server_info(_: web.Request) -> web.Response:
        asked["/server_info"] += 1
        if asked["/server_info"] > 1:
            await gate.wait()  # the second try hangs here
        return web.Response(status=503, text="loading")

    routes = stub_worker_routes({("GET", "/server_info"): server_info})
    async with (
        stub_server(routes) as url,
        router_in_process(workers=[url], health_interval_s=0.02) as rt,
    ):
        await eventually(lambda: asked["/server_info"] >= 2, within_s=10)
        worker = rt.replica.workers.get(url)
        assert worker is not None and worker.state == "down"
        assert "/server_info unreachable" in worker.reason
        gate.set()


async def test_a_dead_worker_leaves_the_index_and_a_restarted_one_is_learned_anew() -> None:
    async with (
        fake_worker_in_process() as survivor,
        fake_worker_in_process() as doomed,
        router_in_process(
            workers=[survivor.url, doomed.url], health_interval_s=0.05, worker_evict_after_s=0.3
        ) as rt,
    ):
        await rt.gate(doomed)
        await rt.gate(survivor)
        await rt.wait_cursor(doomed.url, 0, await doomed.store([chain(7, 3)]))
        await rt.wait_cursor(survivor.url, 0, await survivor.store([chain(9, 2)]))
        held = (await worker_entry(rt, doomed.url))["ranks"][0]["blocks"]
        assert held == (await doomed.state())["blocks"] == 3 + 1  # the chain and the gate's probe

        assert doomed.worker is not None
        await doomed.worker.stop(send_end=False)  # a crash: no END_SEQ

        async def evicted() -> dict | None:
            entry = await worker_entry(rt, doomed.url)
            return entry if entry["state"] == "down" else None

        entry = await eventually(evicted, within_s=10)
        assert entry["ranks"][0]["blocks"] == 0 and "ranks left the index" in entry["reason"]
        scrape = Scrape.parse((await rt.text("/metrics"))[1])
        assert scrape.value("kvrouter_worker_evictions_total") == 1
        assert scrape.get(
            "kvrouter_tree_blocks", dp_rank="0", tier="device", worker_url=doomed.url
        ) in (
            None,
            0,
        )
        # Every request now goes to the survivor.
        for i in range(4):
            status, _, _ = await rt.post(
                "/v1/completions", {"prompt": f"request {i} " * 4, "max_tokens": 1}
            )
            assert status == 200
        assert (await survivor.state())["requests"] >= 4

        # The engine comes back on the same ports, with a new publisher starting at seq 0.
        port = urlsplit(doomed.url).port
        async with fake_worker_in_process(
            port=port, kv_port_base=doomed.config.kv_port_base
        ) as reborn:

            async def registered() -> dict | None:
                entry = await worker_entry(rt, reborn.url)
                return entry if entry["state"] == "ready" and entry["healthy"] else None

            await eventually(registered, within_s=10)
            await rt.gate(reborn)
            seq = await reborn.store([chain(5, 2)])
            view = await rt.wait_cursor(reborn.url, 0, seq)
            # The gate's probe and the new chain; nothing of the dead incarnation's blocks.
            assert view["blocks"] == (await reborn.state())["blocks"] == 1 + 2
            assert rt.replica.workers.stats.evictions == 1
