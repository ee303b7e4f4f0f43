"""POST /workers over real HTTP: only origins, only inside --worker-allow-cidr, and a refused
worker is never contacted."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from cachetree.ranks import RankId
from router.workers import subscriber_name
from tests.support.adversary import Handler, stub_server, stub_worker_routes
from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.router import router_in_process
from tests.support.scripted_worker import Request, respond, scripted_worker
from tests.support.waiting import eventually


def block(engine_hash: int, parent: int | None) -> dict[str, Any]:
    """A block of a worker's /v1/kv-snapshot body, 16 tokens."""
    return {
        "engine_hash": engine_hash,
        "parent_engine_hash": parent,
        "token_ids": [engine_hash] * 16,
    }


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server on loopback that records every path asked of it (the SSRF target)."""
    asked: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        asked.append(request.path_qs)
        return web.json_response({"secret": "instance credentials"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


async def test_a_url_with_a_path_query_fragment_or_credentials_is_a_400_and_never_fetched() -> None:
    async with listener() as (origin, asked), router_in_process() as rt:
        for url in (
            f"{origin}/latest/meta-data/iam#",
            f"{origin}/latest/meta-data/iam",
            f"{origin}?x=",
            f"{origin}#",
            origin.replace("http://", "http://user:pw@"),
        ):
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 400, (url, body)
            assert body["error"]["param"] == "url" and "origin" in body["error"]["message"]
        assert asked == []
        assert rt.replica.workers.workers() == []


async def test_a_legacy_ipv4_spelling_is_a_400_naming_the_dotted_quad_and_never_fetched() -> None:
    # The health checks reached such a host while aiohttp refused it: the worker was listed,
    # stayed down and was "registered anew" at every health pass, forever.
    async with listener() as (origin, asked), router_in_process() as rt:
        port = origin.rpartition(":")[2]
        for host in ("127.1", "2130706433", "127.000.000.001", "0x7f.1"):
            status, body, _ = await rt.post("/workers", {"url": f"http://{host}:{port}"})
            assert status == 400, (host, body)
            assert "write it as 127.0.0.1" in body["error"]["message"], body
        assert asked == []
        assert rt.replica.workers.workers() == []


async def test_outside_the_allow_list_a_worker_is_refused_with_403_and_never_fetched() -> None:
    async with (
        listener() as (origin, asked),
        router_in_process(worker_allow_cidr=["10.0.0.0/8"]) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": origin})
        assert status == 403, body
        assert "--worker-allow-cidr" in body["error"]["message"]
        status, body, _ = await rt.post("/workers", {"url": "http://localhost:9"})
        assert status == 403 and "outside" in body["error"]["message"], body
        assert asked == [] and rt.replica.workers.workers() == []


async def test_inside_the_allow_list_a_worker_is_added() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(worker_allow_cidr=["127.0.0.0/8"]) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": fw.url + "/"})
        assert status == 200, body
        assert body["url"] == fw.url and body["state"] == "ready"
        assert [w.url for w in rt.replica.workers.routable()] == [fw.url]


async def test_flags_are_not_subject_to_the_allow_list() -> None:
    """The list guards the admin API; the operator's own --worker flags are trusted."""
    async with (
        fake_worker_in_process() as fw,
        router_in_process(workers=[fw.url], worker_allow_cidr=["10.0.0.0/8"]) as rt,
    ):
        assert [w.url for w in rt.replica.workers.routable()] == [fw.url]


async def test_a_removed_worker_leaves_no_pool_and_no_series_behind() -> None:
    """A fleet that rolls its pods sees every worker address once: a removed worker's
    connection pool and its per-worker series must go with it, or they grow forever."""
    async with fake_worker_in_process() as fw, router_in_process() as rt:
        status, _, _ = await rt.post("/workers", {"url": fw.url})
        assert status == 200
        status, _, _ = await rt.post("/v1/completions", {"prompt": "hello", "max_tokens": 1})
        assert status == 200
        assert fw.url in rt.plane.pools
        _, before = await rt.text("/metrics")
        assert f'worker="{fw.url}"' in before
        status, _ = await rt.delete(f"/workers?url={fw.url}")
        assert status == 200
        assert fw.url not in rt.plane.pools
        _, after = await rt.text("/metrics")
        assert f'worker="{fw.url}"' not in after, [
            line for line in after.splitlines() if fw.url in line
        ]


async def test_a_worker_removed_with_requests_in_flight_leaves_no_series_once_they_end() -> None:
    """Its in-flight requests end after its series went: counted under its URL, each brought
    them back for good (one stale series a deleted worker, in a soak). They count under
    `worker="removed"`: an answer, and a 503 whose failed attempt counts there too."""
    release = asyncio.Event()

    async def held(request: Request, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        status = 503 if b"fail" in request.body else 200
        writer.write(respond(status, b"{}", b"Content-Type: application/json"))

    async with scripted_worker(held) as w, router_in_process() as rt:
        assert (await rt.post("/workers", {"url": w.url}))[0] == 200
        answers = [
            asyncio.create_task(rt.post("/v1/completions", {"prompt": p, "max_tokens": 1}))
            for p in ("served", "fail")
        ]
        await eventually(lambda: len(w.posts()) == 2)
        assert (await rt.delete(f"/workers?url={w.url}"))[0] == 200
        release.set()
        assert sorted(status for status, _, _ in await asyncio.gather(*answers)) == [200, 503]
        _, text = await rt.text("/metrics")
        assert [line for line in text.splitlines() if w.url in line] == []
        scrape = await rt.scrape()
        route = {"route": "/v1/completions", "worker": "removed"}
        assert scrape.by("kvrouter_requests_total", "status") == {"200": 1, "503": 1}
        assert scrape.value("kvrouter_requests_total", **route, status="200") == 1
        assert scrape.value("kvrouter_requests_total", **route, status="503") == 1
        failures = scrape.series("kvrouter_upstream_failures_total")
        assert failures == {frozenset({("worker", "removed"), ("reason", "status")}): 1}


async def test_a_non_ascii_or_overlong_host_or_port_0_is_a_400_and_registers_nothing() -> None:
    """`①②⑦.0.0.1` was registered and broke every health pass (its pool cannot encode it):
    no worker was checked any more and /readyz went 503. Nothing is registered now, and the
    health loop goes on checking the good worker."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        port = fw.url.rsplit(":", 1)[1]
        for url, word in (
            (f"http://①②⑦.0.0.1:{port}", "IDNA (xn--) form"),
            (f"http://пример.invalid:{port}", "IDNA (xn--) form"),
            (f"http://{'a' * 64}.example:{port}", "1 to 63"),
            ("http://127.0.0.1:0", "port 0"),
        ):
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 400, (url, body)
            assert body["error"]["param"] == "url" and word in body["error"]["message"], body
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
        assert (await rt.readyz())[0] == 200
        # The health loop still checks the good worker: its crash is noticed.
        assert fw.worker is not None
        await fw.worker.stop(send_end=False)
        await eventually(lambda: not rt.replica.workers.routable(), 10)
        assert rt.replica.supervisor.failures["health"] == 0


async def test_a_post_whose_client_leaves_mid_registration_leaves_no_worker_behind() -> None:
    """The client's leaving cancels the POST (handler cancellation): the worker it was
    registering used to stay listed, `discovering` for good, with nothing checking it."""
    asked = asyncio.Event()
    release = asyncio.Event()

    async def server_info(request: web.Request) -> web.Response:
        asked.set()
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with router_in_process() as rt:
            post = asyncio.create_task(rt.post("/workers", {"url": url}))
            await asyncio.wait_for(asked.wait(), 5)
            assert [w.url for w in rt.replica.workers.workers()] == [url]
            post.cancel()  # the client leaves
            await asyncio.gather(post, return_exceptions=True)
            await eventually(lambda: rt.replica.workers.workers() == [])
            assert rt.replica.workers.subscribed_ranks == 0
    finally:
        release.set()
        await runner.cleanup()


async def test_a_workers_redirects_are_never_followed_and_count_as_failed_answers() -> None:
    """A worker answering 302 to another origin had the router fetch it: an unauthenticated
    `GET /v1/models` relayed a metadata service's credentials, and the redirect target's
    snapshot was installed for the worker's rank. Every request the router makes to a worker
    (its own client's and the polling client's) takes a 3xx as the answer: a failed one."""
    async with listener() as (target, asked):
        worker_asked: list[str] = []
        redirect_health = False

        async def redirect(request: web.Request) -> web.Response:
            worker_asked.append(request.path)
            raise web.HTTPFound(f"{target}/latest/meta-data/iam")

        async def health(request: web.Request) -> web.Response:
            worker_asked.append(request.path)
            if redirect_health:
                raise web.HTTPFound(f"{target}/health")
            return web.json_response({"status": "ok"})

        routes = {
            ("GET", path): redirect
            for path in ("/server_info", "/v1/models", "/v1/kv-snapshot", "/v1/loads", "/metrics")
        }
        async with (
            stub_server({**routes, ("GET", "/health"): health}) as worker,
            router_in_process() as rt,
        ):
            status, body, _ = await rt.post("/workers", {"url": worker})
            assert status == 200 and body["state"] == "ready", body
            status, models = await rt.get("/v1/models")
            assert status == 200 and models["data"] == [], models
            registry = rt.replica.workers
            await eventually(lambda: registry.stats.snapshot_pulls["error"] >= 1)
            await eventually(lambda: rt.replica.loads.poll_errors["http_302"] >= 2)
            assert registry.stats.snapshot_pulls["applied"] == 0
            assert registry.get(worker).healthy  # type: ignore[union-attr]
            redirect_health = True
            await eventually(lambda: not registry.routable())
            assert {
                "/server_info",
                "/v1/models",
                "/v1/kv-snapshot",
                "/v1/loads",
                "/health",
            } <= set(worker_asked)
        assert asked == []  # the redirect target was never asked a thing


async def test_a_delete_during_the_posts_registration_leaves_nothing_of_the_worker_running() -> (
    None
):
    """DELETE answered `removed` while the POST was still registering; the POST then finished
    `ready` and the worker's subscriber ran on outside the registry (its rank live in the
    index, `kvrouter_rank_subscriptions{kind="in_use"}` counting it). Now the registration
    stops at its next step: the POST is a 409 and nothing of the worker is left."""
    asked = asyncio.Event()
    release = asyncio.Event()
    routes = stub_worker_routes()
    server_info = routes[("GET", "/server_info")]

    async def slow_server_info(request: web.Request) -> web.StreamResponse:
        asked.set()
        await release.wait()
        return await server_info(request)

    routes[("GET", "/server_info")] = slow_server_info
    async with stub_server(routes) as worker, router_in_process() as rt:
        registry = rt.replica.workers
        post = asyncio.create_task(rt.post("/workers", {"url": worker}))
        await asyncio.wait_for(asked.wait(), 5)
        delete = asyncio.create_task(rt.delete(f"/workers?url={worker}"))
        await eventually(lambda: registry.get(worker) is None)  # gone at once
        release.set()
        status, body = await delete
        assert status == 200 and body == {"removed": worker}, body
        status, body, _ = await post
        assert status == 409 and "removed" in body["error"]["message"], body
        assert registry.workers() == [] and registry.subscribed_ranks == 0
        rank = RankId(worker, 0)
        assert rank not in rt.replica.pump.rules.live
        assert rt.replica.supervisor.state(subscriber_name(rank)) is None
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_rank_subscriptions", kind="in_use") == 0
        assert registry._locks == {}  # no lock kept for a URL nobody is adding


async def test_a_down_worker_removed_while_its_ranks_go_live_leaves_no_rank_live() -> None:
    """A worker down after its first try is registered anew (here by a second POST); a
    DELETE landing while the new registration put its ranks in the index's live set found
    the worker still `down`, and the teardown skipped the detach a down worker needs no more:
    its rank stayed live in the index for good, with nobody subscribed to it."""
    answers = [503]  # the first /server_info: up, not serving yet
    routes = stub_worker_routes()
    server_info = routes[("GET", "/server_info")]

    async def unready_once(request: web.Request) -> web.StreamResponse:
        if answers:
            return web.Response(status=answers.pop())
        return await server_info(request)

    routes[("GET", "/server_info")] = unready_once
    async with stub_server(routes) as worker, router_in_process() as rt:
        registry, pump = rt.replica.workers, rt.replica.pump
        status, body, _ = await rt.post("/workers", {"url": worker})
        assert status == 200 and body["state"] == "down", body
        removals: list[asyncio.Task[bool]] = []
        call = pump.call

        async def call_then_remove(fn: Any) -> Any:
            result = await call(fn)
            if not removals and RankId(worker, 0) in pump.rules.live:  # just added
                removals.append(asyncio.create_task(registry.remove(worker)))
                await asyncio.sleep(0)  # one turn: the removal takes it out of the registry
            return result

        pump.call = call_then_remove  # type: ignore[method-assign]
        status, body, _ = await rt.post("/workers", {"url": worker})
        assert status == 409 and "removed" in body["error"]["message"], body
        assert removals and await removals[0]
        assert RankId(worker, 0) not in pump.rules.live
        assert registry.workers() == [] and registry.subscribed_ranks == 0


async def test_adding_and_removing_many_urls_keeps_no_lock_behind() -> None:
    async with router_in_process() as rt:
        for port in range(1, 51):
            status, _, _ = await rt.post("/workers", {"url": f"http://127.0.0.1:{port}"})
            assert status == 200
            status, _ = await rt.delete(f"/workers?url=http://127.0.0.1:{port}")
            assert status == 200
        assert rt.replica.workers.workers() == [] and rt.replica.workers._locks == {}


async def test_past_max_workers_a_registration_is_a_409_naming_the_flag_and_never_fetched() -> None:
    async with listener() as (origin, asked), router_in_process(max_workers=3) as rt:
        unreachable = [f"http://127.0.0.1:{port}" for port in (1, 2, 3)]
        for url in unreachable:
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 200 and body["state"] == "down", body
        status, body, _ = await rt.post("/workers", {"url": origin})
        assert status == 409 and "--max-workers" in body["error"]["message"], body
        assert body["error"]["param"] == "url"
        assert asked == []
        assert sorted(w.url for w in rt.replica.workers.workers()) == unreachable
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_workers_refused_total", reason="max_workers") == 1
        status, _, _ = await rt.post("/workers", {"url": unreachable[0]})
        assert status == 200  # a known one is no new registration
        assert (await rt.delete(f"/workers?url={unreachable[0]}"))[0] == 200
        status, body, _ = await rt.post("/workers", {"url": origin})
        assert status == 200, body


async def test_a_deeply_nested_body_is_a_400_and_registers_nothing() -> None:
    """msgspec raises RecursionError past Python's nesting limit: it was a 500 with its
    traceback in the log."""
    async with router_in_process() as rt:
        for body in (b"[" * 5000 + b"]" * 5000, b'{"url":' * 5000 + b'"x"' + b"}" * 5000):
            status, answer, _ = await rt.post(
                "/workers", None, data=body, headers={"Content-Type": "application/json"}
            )
            assert status == 400, answer
            assert answer["error"]["type"] == "invalid_request_error"
            assert "nested too deep" in answer["error"]["message"], answer
        assert rt.replica.workers.workers() == []


@pytest.mark.parametrize(
    "bad",
    [
        {"dp_rank": 1, "last_seq": 3, "blocks": [block(9, 8)]},  # a parent it does not list
        {"dp_rank": 5, "last_seq": 3, "blocks": [block(9, None)]},  # a rank it does not have
    ],
    ids=["missing_parent", "unknown_rank"],
)
async def test_a_worker_snapshot_with_one_refused_rank_installs_nothing(
    bad: dict[str, Any],
) -> None:
    """Its good rank was installed and the pull counted `applied`, though a body with a
    refused rank is refused whole: now nothing of it goes in and it counts `rejected`."""
    good = {"dp_rank": 0, "last_seq": 3, "blocks": [block(1, None), block(2, 1)]}

    async def snapshot(request: web.Request) -> web.Response:
        return web.json_response({"block_size": 16, "ranks": [good, bad]})

    async def two_ranks(request: web.Request) -> web.Response:
        kv = {"endpoint_host": "127.0.0.1", "endpoint_port_base": free_tcp_port()}
        return web.json_response({"kv_events": {**kv, "block_size": 16, "dp_size": 2}})

    routes = stub_worker_routes(
        {("GET", "/v1/kv-snapshot"): snapshot, ("GET", "/server_info"): two_ranks}
    )
    async with stub_server(routes) as worker, router_in_process() as rt:
        status, body, _ = await rt.post("/workers", {"url": worker})
        assert status == 200 and len(body["ranks"]) == 2, body
        registry = rt.replica.workers
        await eventually(lambda: registry.stats.snapshot_pulls["rejected"] == 1)
        assert registry.stats.snapshot_pulls["applied"] == 0
        for dp_rank in (0, 1):
            view = await rt.rank_view(worker, dp_rank)
            assert view is not None and view["blocks"] == 0 and view["cursor"] is None, view
        scrape = await rt.scrape()
        pulls = scrape.by("kvrouter_worker_snapshot_pulls_total", "outcome")
        assert pulls == {"rejected": 1}, pulls


async def test_a_bad_block_late_in_a_large_worker_snapshot_refuses_it_whole() -> None:
    """The body is decoded in slices with the loop turning between them: the slices before the
    bad block decode, and still nothing of the body goes in."""
    blocks = [block(1, None)] + [block(i, i - 1) for i in range(2, 5001)]
    blocks[4990]["token_ids"][3] = 1 << 32  # past a token id's range, in the fifth slice

    async def snapshot(request: web.Request) -> web.Response:
        body = {"block_size": 16, "ranks": [{"dp_rank": 0, "last_seq": 3, "blocks": blocks}]}
        return web.json_response(body)

    routes = stub_worker_routes({("GET", "/v1/kv-snapshot"): snapshot})
    async with stub_server(routes) as worker, router_in_process() as rt:
        status, body, _ = await rt.post("/workers", {"url": worker})
        assert status == 200, body
        registry = rt.replica.workers
        await eventually(lambda: registry.stats.snapshot_pulls["rejected"] == 1)
        assert registry.stats.snapshot_pulls["applied"] == 0
        view = await rt.rank_view(worker, 0)
        assert view is not None and view["blocks"] == 0 and view["cursor"] is None, view


async def test_a_refused_registration_is_a_409_with_the_reason_and_stays_listed_refused() -> None:
    """It answered 200 with `state: refused`: automation checking the status saw success."""
    async with (
        fake_worker_in_process(block_size=32) as fw,
        router_in_process(block_size=16) as rt,
    ):
        for _ in range(2):  # and again: a known refused worker is no success either
            status, body, _ = await rt.post("/workers", {"url": fw.url})
            assert status == 409, body
            assert "block size 32" in body["error"]["message"] and body["error"]["param"] == "url"
            assert body["worker"]["state"] == "refused" and body["worker"]["url"] == fw.url
        assert rt.replica.workers.stats.refused["block_size"] == 1
        assert [(w.url, w.state) for w in rt.replica.workers.workers()] == [(fw.url, "refused")]
        assert rt.replica.workers.routable() == []


@contextlib.asynccontextmanager
async def worker_of_block_size(size: int) -> AsyncIterator[tuple[str, dict[str, int], list[float]]]:
    """A stub worker whose /server_info states `state["block_size"]`, which the test changes
    (the engine restarted at the same address): (url, state, the clock times it was read)."""
    state = {"block_size": size}
    reads: list[float] = []
    kv_port = free_tcp_port()

    async def server_info(request: web.Request) -> web.Response:
        reads.append(time.monotonic())
        kv = {"endpoint_host": "127.0.0.1", "endpoint_port_base": kv_port, "dp_size": 1}
        return web.json_response({"kv_events": {**kv, "block_size": state["block_size"]}})

    routes = stub_worker_routes({("GET", "/server_info"): server_info})
    async with stub_server(routes) as url:
        yield url, state, reads


async def test_a_refused_worker_posted_again_is_read_again_and_admitted_once_fixed() -> None:
    """Its 409 came from what it stated when first refused, its /server_info never read again:
    an engine restarted with the fleet's block size was refused until DELETE and POST."""
    async with (
        worker_of_block_size(32) as (url, state, reads),
        router_in_process(block_size=16, health_interval_s=600) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": url})
        assert status == 409 and "block size 32" in body["error"]["message"], body
        state["block_size"] = 16
        status, body, _ = await rt.post("/workers", {"url": url})
        assert status == 200 and body["state"] == "ready", body
        assert len(reads) == 2
        registry = rt.replica.workers
        assert [w.url for w in registry.routable()] == [url]
        assert registry.stats.refused["block_size"] == 1


async def test_the_health_loop_looks_at_a_refused_worker_again_doubling_and_admits_it_fixed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A `--worker` or EndpointSlice worker keeps its address across a restart: nothing but
    the replica looks at it again. Each look waits twice the one before (from one health
    interval); refused again for the same reason, it is counted and logged as an error once."""
    interval = 0.05
    async with (
        worker_of_block_size(32) as (url, state, reads),
        router_in_process(block_size=16, health_interval_s=interval) as rt,
    ):
        with caplog.at_level(logging.INFO, logger="router.workers"):
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 409, body
            await eventually(lambda: len(reads) >= 4)
            gaps = [b - a for a, b in itertools.pairwise(reads)]
            for n, gap in enumerate(gaps[:3]):
                assert gap >= interval * 2**n, gaps
            registry = rt.replica.workers
            worker = registry.get(url)
            assert worker is not None and worker.state == "refused"
            assert registry.stats.refused["block_size"] == 1
            errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert len(errors) == 1 and "block size 32" in errors[0].getMessage(), errors
            state["block_size"] = 16
            await eventually(lambda: worker.routable, within_s=10)
        assert [w.url for w in registry.routable()] == [url]
        assert registry.stats.refused["block_size"] == 1
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_workers_refused_total", reason="block_size") == 1


async def test_deleting_an_unknown_worker_is_a_404_in_the_error_shape() -> None:
    async with router_in_process() as rt:
        status, body = await rt.delete("/workers?url=http://127.0.0.1:1")
        assert status == 404
        assert body["error"]["type"] == "invalid_request_error"
        assert "unknown worker" in body["error"]["message"]


@pytest.mark.parametrize(
    "odd", [b"[]", b'{"data": 5}', b'{"data": [{"id": ["x"]}, {"id": 7}]}', b"[" * 100_000]
)
async def test_one_workers_odd_model_list_leaves_the_replicas_own_listing_whole(odd: bytes) -> None:
    """A worker's /v1/models of `[]`, or with `data` not a list, or ids that are not strings,
    raised in the replica's own /v1/models: a 500 for every client."""

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=odd, content_type="application/json")

    async with (
        stub_server(stub_worker_routes()) as good,
        stub_server(stub_worker_routes({("GET", "/v1/models"): models})) as bad,
        router_in_process() as rt,
    ):
        for url in (good, bad):
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 200 and body["state"] == "ready", body
        status, listing = await rt.get("/v1/models")
        assert status == 200 and [m["id"] for m in listing["data"]] == ["stub"]


async def test_a_workers_answer_inflating_past_the_bound_is_unreadable_not_read_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """/server_info and /v1/models were read whole, decompressed: 0.5 MB of gzip per worker
    inflated to 512 MB in the replica. An answer past `MAX_WORKER_JSON_BYTES` (1 MiB) decoded
    is unreadable: the worker registers by the --kv-events-* flags, its models left out."""
    bound = 1024 * 1024
    inflated = b'{"pad": "' + b" " * (4 * bound) + b'"}'
    bomb = gzip.compress(inflated)
    assert len(bomb) < bound // 64

    async def gzipped(request: web.Request) -> web.Response:
        return web.Response(
            body=bomb, content_type="application/json", headers={"Content-Encoding": "gzip"}
        )

    extra = {("GET", "/server_info"): gzipped, ("GET", "/v1/models"): gzipped}
    async with stub_server(stub_worker_routes(extra)) as worker, router_in_process() as rt:
        status, body, _ = await rt.post("/workers", {"url": worker})
        assert status == 200 and body["state"] == "ready", body
        status, listing = await rt.get("/v1/models")
        assert status == 200 and listing["data"] == []
    assert any(f"over {bound} bytes" in r.getMessage() for r in caplog.records)


async def test_the_workers_a_replica_starts_with_register_at_once_not_in_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """They registered one after another, each waiting out a stalled worker's timeouts, and
    the replica listened only after all: a dozen slow workers kept /healthz from answering
    for 13 s. Here each /server_info answers only once all three are asked; in turn, each
    timed out and the workers came up `down`."""
    everyone = asyncio.Barrier(3)

    def slow() -> dict[tuple[str, str], Handler]:
        """A worker's routes (KV events on a port of its own) whose /server_info waits."""
        routes = stub_worker_routes()

        async def server_info(request: web.Request) -> web.Response:
            await everyone.wait()
            return await routes[("GET", "/server_info")](request)

        return {**routes, ("GET", "/server_info"): server_info}

    async with (
        stub_server(slow()) as a,
        stub_server(slow()) as b,
        stub_server(slow()) as c,
        router_in_process(workers=[a, b, c]) as rt,
    ):
        assert {w.url: w.state for w in rt.replica.workers.workers()} == {
            a: "ready",
            b: "ready",
            c: "ready",
        }
    # None waited out its timeout first (in turn, two did, and came up only at a later check).
    assert not [r for r in caplog.records if "/server_info unreachable" in r.getMessage()]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/completions/", "/V1/Completions"])
async def test_a_path_the_router_does_not_serve_is_a_404_an_openai_client_reads(
    path: str,
) -> None:
    """It was aiohttp's plain-text `404: Not Found` under /v1/ (JSON only where the path
    looks like the API; other paths keep the plain answer)."""
    async with (
        router_in_process() as rt,
        rt.session.post(rt.url + path, json={"input": "x"}) as resp,
    ):
        assert resp.status == 404
        if path.startswith("/v1/"):
            error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error" and path in error["message"]
        else:
            assert resp.content_type == "text/plain"


async def test_a_worker_stating_a_block_size_past_belief_sets_nothing_and_the_fleet_serves() -> (
    None
):
    """The first worker to register set the fleet's block size: one stating 10**30 had the
    honest ones refused for differing, and every request a 500 (the key loop overflowed)."""

    async def server_info(request: web.Request) -> web.Response:
        kv = {"endpoint_host": "127.0.0.1", "endpoint_port_base": free_tcp_port(), "topic": ""}
        return web.json_response({"kv_events": {**kv, "block_size": 10**30, "dp_size": 1}})

    liar = stub_worker_routes({("GET", "/server_info"): server_info})
    async with (
        stub_server(liar) as bad,
        stub_server(stub_worker_routes()) as good,
        router_in_process(block_size=None) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": bad})
        assert status == 409 and body["worker"]["state"] == "refused", body  # none known
        assert rt.replica.workers.block_size is None
        status, body, _ = await rt.post("/workers", {"url": good})
        assert status == 200 and body["state"] == "ready", body
        assert rt.replica.workers.block_size == 16


async def test_a_burst_of_model_listings_asks_each_worker_once() -> None:
    """`/v1/models` needs no token and asked every worker on every call: a flood of them was
    one request to each worker per call. Callers while a listing is fetched or fresh share it;
    a change of workers fetches anew."""
    asked: list[str] = []

    def counted(name: str) -> Any:
        async def models(request: web.Request) -> web.Response:
            asked.append(name)
            await asyncio.sleep(0)  # callers arriving meanwhile share this fetch
            return web.json_response({"object": "list", "data": [{"id": name}]})

        return models

    async with (
        stub_server(stub_worker_routes({("GET", "/v1/models"): counted("a")})) as a,
        stub_server(stub_worker_routes({("GET", "/v1/models"): counted("b")})) as b,
        router_in_process() as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": a})
        assert status == 200 and body["state"] == "ready", body
        asked.clear()  # what registration read
        answers = await asyncio.gather(*(rt.get("/v1/models") for _ in range(20)))
        assert [[m["id"] for m in listing["data"]] for _, listing in answers] == [["a"]] * 20
        assert asked == ["a"]
        status, body, _ = await rt.post("/workers", {"url": b})
        assert status == 200 and body["state"] == "ready", body
        asked.clear()
        status, listing = await rt.get("/v1/models")
        assert status == 200 and sorted(m["id"] for m in listing["data"]) == ["a", "b"]
        assert sorted(asked) == ["a", "b"]
