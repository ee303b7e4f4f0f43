"""`GET /metrics` after real traffic: every series counts what the workers and the index saw.

Each test reads the exposition with prometheus_client's own parser and compares it with the
fake workers' `/control/state` (what they served, what they cache) or with exactly what the
test made happen, never with "non-zero". Counters are compared as deltas over the test's own
actions where earlier traffic (gate probes) is not part of the claim.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from router.events import DECODE_ERROR_REASONS
from router.tokenize import BytesTokenizer
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

TOK = BytesTokenizer()
BS = 16


async def scrape(rt: RouterHandle) -> Scrape:
    async with rt.session.get(rt.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain;")
        return Scrape.parse(await resp.text())


async def settle(rt: RouterHandle, *workers: FakeWorkerHandle) -> None:
    """Until the replica applied every batch each worker has published."""
    for fw in workers:
        last = (await fw.state())["last_seq"]
        if last >= 0:
            await rt.wait_cursor(fw.url, 0, last)


def chain(text: str, blocks: int) -> list[int]:
    """`blocks` whole blocks of tokens: `text`, repeated as needed and cut to length."""
    return TOK.encode((text * blocks * BS)[: blocks * BS])


# --- request path ---------------------------------------------------------------------------

PREFIX = "a shared system prompt of exactly forty-eight b."  # 48 bytes: 3 blocks


async def test_request_and_decision_series_count_exactly_what_the_workers_served() -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        await rt.gate(a)
        await rt.gate(b)
        await rt.wait_cursor(a.url, 0, await a.store([TOK.encode(PREFIX)]))
        served_before = {fw.url: (await fw.state())["requests"] for fw in (a, b)}
        requests: list[tuple[str, dict[str, Any]]] = [
            # Hits: the 3 stored blocks, plus a tail shorter than a block (no new blocks).
            ("/v1/completions", {"prompt": PREFIX + " q1?", "max_tokens": 1}),
            ("/v1/completions", {"prompt": PREFIX + " q2?", "max_tokens": 1}),
            # Misses: nothing cached shares their first block.
            ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x1"}]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y2"}]}),
            ("/generate", {"text": "zz", "sampling_params": {"max_new_tokens": 1}}),
        ]
        expected: dict[tuple[str, str], int] = {}
        for route, body in requests:
            status, payload, headers = await rt.post(route, body)
            assert status == 200, payload
            key = (route, headers["X-Kvrouter-Worker"])
            expected[key] = expected.get(key, 0) + 1
        # Refused by the router itself: no worker, no decision; counted with worker "none".
        status, _, _ = await rt.post("/v1/completions", {"max_tokens": 1})
        assert status == 400
        m = await scrape(rt)

        for (route, worker), n in expected.items():
            assert m.value("kvrouter_requests_total", route=route, worker=worker, status="200") == n
        none_400 = m.value(
            "kvrouter_requests_total", route="/v1/completions", worker="none", status="400"
        )
        assert none_400 == 1
        assert sum(m.series("kvrouter_requests_total").values()) == len(requests) + 1
        for fw in (a, b):
            served = (await fw.state())["requests"] - served_before[fw.url]
            assert served == sum(n for (_, w), n in expected.items() if w == fw.url)
        assert expected[("/v1/completions", a.url)] >= 2  # both hits went to the holder

        hits = m.value(
            "kvrouter_routing_decisions_total", policy="cache_aware", outcome="cache_hit"
        )
        misses = m.value(
            "kvrouter_routing_decisions_total", policy="cache_aware", outcome="cache_miss"
        )
        assert (hits, misses) == (2, 4)
        assert m.value("kvrouter_matched_blocks_count") == 6
        assert m.value("kvrouter_matched_blocks_sum") == 2 * 3
        assert m.value("kvrouter_matched_blocks_bucket", le="0.0") == 4
        assert m.value("kvrouter_matched_blocks_bucket", le="2.0") == 4
        assert m.value("kvrouter_matched_blocks_bucket", le="4.0") == 6


async def test_no_healthy_worker_is_a_no_candidates_decision() -> None:
    async with router_in_process() as rt:
        status, _, _ = await rt.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503
        m = await scrape(rt)
        assert (
            m.value(
                "kvrouter_routing_decisions_total", policy="cache_aware", outcome="no_candidates"
            )
            == 1
        )
        assert m.get("kvrouter_matched_blocks_count") == 0


async def test_the_block_size_given_by_its_flag_is_exported_before_any_worker_registers() -> None:
    """`--block-size 32` and no worker yet: `kvrouter_block_size` read 0 (the index, which
    holds it, is made at the first registration), though the fleet's block size was known."""
    async with router_in_process(block_size=32) as rt:
        m = await scrape(rt)
        assert m.value("kvrouter_block_size") == 32


# --- the index ------------------------------------------------------------------------------


async def test_index_series_equal_the_workers_caches_and_the_events_applied() -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        router_in_process(workers=[a.url, b.url]) as rt,
    ):
        await rt.gate(a)
        await rt.gate(b)
        before = await scrape(rt)
        one = chain("first chain, on the GPU. ", 3)
        two = chain("second chain, also on the GPU. ", 2)
        await a.store([one, two])  # two batches, one BlockStored each
        await b.store([chain("a chain on the host tier. ", 2)], medium="CPU")
        await settle(rt, a, b)
        m = await scrape(rt)

        def stored(scrape: Scrape, medium: str) -> float:
            return scrape.get("kvrouter_kv_events_total", event="stored", medium=medium) or 0

        assert stored(m, "GPU") - stored(before, "GPU") == 2
        assert stored(m, "CPU") - stored(before, "CPU") == 1
        a_state, b_state = await a.state(), await b.state()
        assert (
            m.value("kvrouter_tree_blocks", worker_url=a.url, dp_rank="0", tier="device")
            == (a_state["blocks"])
        )
        assert a_state["blocks"] == 1 + 3 + 2  # the gate's probe block and the two chains
        assert m.value("kvrouter_tree_blocks", worker_url=b.url, dp_rank="0", tier="host") == 2
        assert m.value("kvrouter_tree_blocks", worker_url=b.url, dp_rank="0", tier="device") == 1
        assert b_state["blocks"] == 2 + 1
        # One node per distinct block: both workers' probe blocks are the same key.
        assert m.value("kvrouter_tree_nodes") == 1 + 3 + 2 + 2
        assert m.value("kvrouter_block_size") == BS

        removed_before = m.get("kvrouter_kv_events_total", event="removed", medium="GPU") or 0
        evicted = (await a.post("/control/evict", {"token_chains": [two]}))["evicted"]
        assert evicted == 2
        await settle(rt, a)
        m = await scrape(rt)
        removed = m.value("kvrouter_kv_events_total", event="removed", medium="GPU")
        assert removed - removed_before == 2  # one BlockRemoved per block, as vLLM sends them
        assert (
            m.value("kvrouter_tree_blocks", worker_url=a.url, dp_rank="0", tier="device")
            == ((await a.state())["blocks"])
        )
        assert m.value("kvrouter_tree_nodes") == 1 + 3 + 2


async def test_stores_the_index_cannot_apply_are_counted_by_reason() -> None:
    """A store in a medium with no tier, then one below it (its parent never indexed):
    both dropped, and shown, where before they counted as stored and nowhere else."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        await rt.gate(fw)
        before = await scrape(rt)
        head = chain("stored in a medium the router has no tier for. ", 2)
        await fw.store([head], medium="MARS")
        await fw.store([head + chain("and a block below it, on the GPU. ", 1)])
        await settle(rt, fw)
        m = await scrape(rt)

        def refused(scrape: Scrape, reason: str) -> float:
            return scrape.get("kvrouter_kv_events_refused_total", reason=reason) or 0

        assert refused(m, "unknown_tier") - refused(before, "unknown_tier") == 1
        assert refused(m, "unknown_parent") - refused(before, "unknown_parent") == 1
        assert m.value("kvrouter_tree_blocks", worker_url=fw.url, dp_rank="0", tier="device") == 1


async def test_a_gap_without_replay_shows_as_lost_batches_of_that_rank() -> None:
    async with (
        fake_worker_in_process() as fw,
        fake_worker_in_process() as other,
        router_in_process(workers=[fw.url, other.url]) as rt,
    ):
        await rt.gate(fw)
        await rt.gate(other)
        assert (await scrape(rt)).series("kvrouter_kv_event_batches_lost_total") == {}
        await fw.post("/control/drop-next", {"count": 3})
        await fw.store([chain("w", 1), chain("x", 1), chain("y", 2)])  # never sent live
        await rt.wait_cursor(fw.url, 0, await fw.store([chain("z", 1)]))
        m = await scrape(rt)
        assert m.series("kvrouter_kv_event_batches_lost_total") == {
            frozenset({("worker_url", fw.url), ("dp_rank", "0")}): 3
        }


async def test_every_decode_error_reason_is_exported_at_0_before_the_first() -> None:
    """A reason's series appeared with its first error, so increase() in KvrouterBadFrames and
    rate() in the stream-faults panel never saw a first burst of undecodable batches."""
    async with router_in_process() as rt:
        m = await scrape(rt)
        exported = m.series("kvrouter_kv_decode_errors_total")
        assert {dict(labels)["reason"]: n for labels, n in exported.items()} == dict.fromkeys(
            DECODE_ERROR_REASONS, 0
        )


# --- breakers and load probes ---------------------------------------------------------------


async def test_a_worker_that_503s_trips_its_breaker_and_the_metrics_say_so() -> None:
    async with (
        fake_worker_in_process() as bad,
        fake_worker_in_process() as good,
        router_in_process(workers=[bad.url, good.url], policy="round_robin") as rt,
    ):
        await bad.post("/control/fail", {"count": 1000, "status": 503})
        for _ in range(10):
            status, body, _ = await rt.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert status == 200, body
        m = await scrape(rt)
        failed = (await bad.get("/control/state"))["failed_requests"]
        assert failed == 3  # the breaker's threshold; the cooldown (5 s) outlasts the test
        assert m.value("kvrouter_breaker_state", worker=bad.url) == 1  # open
        assert m.value("kvrouter_breaker_trips_total", worker=bad.url) == 1
        assert m.value("kvrouter_breaker_state", worker=good.url) == 0
        assert m.value("kvrouter_breaker_trips_total", worker=good.url) == 0
        assert m.value("kvrouter_upstream_failures_total", worker=bad.url, reason="status") == (
            failed
        )
        assert m.series("kvrouter_requests_total") == {
            frozenset({("route", "/v1/completions"), ("worker", good.url), ("status", "200")}): 10
        }
        assert (await good.state())["requests"] == 10


async def test_a_breaker_whose_cooldown_passed_shows_its_probe_due_not_open() -> None:
    """cache_aware may never route to a tripped worker again (its prefixes are warm
    elsewhere), and only a request claims the probe: the breaker of a worker healthy for
    minutes showed 1 (open) all that time and fired KvrouterBreakerOpen."""
    async with (
        fake_worker_in_process() as bad,
        fake_worker_in_process() as good,
        router_in_process(
            workers=[bad.url, good.url], policy="round_robin", breaker_cooldown_s=0.5
        ) as rt,
    ):
        await bad.post("/control/fail", {"count": 3, "status": 503})
        for _ in range(6):
            status, body, _ = await rt.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
            assert status == 200, body
        assert (await scrape(rt)).value("kvrouter_breaker_trips_total", worker=bad.url) == 1

        async def probe_due() -> bool:
            return (await scrape(rt)).value("kvrouter_breaker_state", worker=bad.url) == 3

        await eventually(probe_due, 10)  # with no request routed there since
        status, listing = await rt.get("/workers")
        assert status == 200
        assert {w["url"]: w["breaker"] for w in listing["workers"]} == {
            bad.url: "probe_due",
            good.url: "closed",
        }
        assert (await bad.get("/control/state"))["failed_requests"] == 3


@contextlib.asynccontextmanager
async def worker_without_loads() -> AsyncIterator[str]:
    """An engine with /health only: no /server_info, no /v1/loads, no /metrics."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_load_probes_count_each_outcome_and_absent_is_asked_once() -> None:
    async with (
        fake_worker_in_process() as fw,
        worker_without_loads() as bare,
        router_in_process(
            workers=[fw.url, bare], load_interval_ms=20, kv_events_port_base=free_tcp_port()
        ) as rt,
    ):

        async def several_polls() -> Scrape | None:
            m = await scrape(rt)
            return (
                m if (m.get("kvrouter_load_probe_total", outcome="available") or 0) >= 5 else None
            )

        m = await eventually(several_polls, 5, poll_s=0.02)
        # /v1/loads is asked again on every tick where it answers; a 404 is remembered.
        assert m.value("kvrouter_load_probe_total", outcome="absent") == 1
        assert m.get("kvrouter_load_probe_total", outcome="inconclusive") in (None, 0)


async def test_process_and_python_runtime_series_are_exported() -> None:
    async with router_in_process(workers=[]) as rt:
        first = await scrape(rt)
        for _ in range(200):  # some work, so the process's CPU counter can move
            await rt.get("/workers")
        second = await scrape(rt)
    assert first.value("process_resident_memory_bytes") > 10 * 2**20
    assert first.value("process_open_fds") > 0
    assert second.value("process_cpu_seconds_total") >= first.value("process_cpu_seconds_total")
    assert second.value("python_gc_collections_total", generation="0") >= 0
    (info,) = first.names("python_info")
    assert info["implementation"] == "CPython"
