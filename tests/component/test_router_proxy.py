"""The proxy path: streaming passthrough, failover, the breaker, client errors, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

from router.control import MODELS, MODELS_FETCHES
from tests.support.adversary import stub_server, stub_worker_routes
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process
from tests.support.waiting import eventually

COMPLETION = {"prompt": "tell me a story about caches", "max_tokens": 8}


async def test_streaming_passthrough_is_byte_identical_to_a_direct_request() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        body = {**COMPLETION, "stream": True}
        async with rt.session.post(f"{fw.url}/v1/completions", json=body) as direct:
            direct_bytes = await direct.read()
        async with rt.session.post(f"{rt.url}/v1/completions", json=body) as routed:
            assert routed.headers["Content-Type"].startswith("text/event-stream")
            routed_bytes = await routed.read()
        assert routed_bytes.endswith(b"data: [DONE]\n\n")
        # Equal except the per-request id and timestamp the engine stamps into each event.
        assert _without_ids(routed_bytes) == _without_ids(direct_bytes)
        assert len(routed_bytes.split(b"\n\n")) == len(direct_bytes.split(b"\n\n"))


def _without_ids(raw: bytes) -> list[bytes]:
    import re

    return [re.sub(rb'"(id|created)":\s*("[^"]*"|\d+)', b"", line) for line in raw.split(b"\n")]


async def test_proxy_client_never_advertises_gzip_upstream() -> None:
    seen: list[str | None] = []

    async def record(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.headers.get("Accept-Encoding"))
        return aiohttp.web.json_response({"ok": True})

    from aiohttp import web

    from tests.support.ports import free_tcp_port

    async def healthy(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", record)
    app.router.add_get("/health", healthy)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with router_in_process(workers=[f"http://127.0.0.1:{port}"]) as rt:
            status, _, _ = await rt.post(
                "/v1/completions", COMPLETION, headers={"Accept-Encoding": "gzip"}
            )
            assert status == 200
    finally:
        await runner.cleanup()
    assert seen == [None]


async def test_failover_around_a_worker_that_always_503s_and_the_breaker_caps_its_tries() -> None:
    async with (
        fake_worker_in_process() as bad,
        fake_worker_in_process() as good,
        router_in_process(workers=[bad.url, good.url], policy="round_robin") as rt,
    ):
        await bad.post("/control/fail", {"count": 1000, "status": 503})
        for _ in range(20):
            status, body, _ = await rt.post("/v1/completions", COMPLETION)
            assert status == 200, body
        assert (await good.state(0))["requests"] == 20
        assert (await bad.get("/control/state"))["failed_requests"] <= 3
        worker = rt.replica.workers.get(bad.url)
        assert worker is not None and worker.breaker.trips == 1


async def test_without_the_breaker_the_failing_worker_is_tried_far_more_often() -> None:
    async with (
        fake_worker_in_process() as bad,
        fake_worker_in_process() as good,
        router_in_process(
            workers=[bad.url, good.url], policy="round_robin", breaker_failure_threshold=0
        ) as rt,
    ):
        await bad.post("/control/fail", {"count": 1000, "status": 503})
        for _ in range(20):
            status, _, _ = await rt.post("/v1/completions", COMPLETION)
            assert status == 200
        assert (await bad.get("/control/state"))["failed_requests"] >= 10


async def test_a_4xx_is_passed_through_not_failed_over_and_not_counted() -> None:
    async with (
        fake_worker_in_process() as picky,
        fake_worker_in_process() as other,
        router_in_process(workers=[picky.url, other.url], policy="round_robin") as rt,
    ):
        await picky.post("/control/fail", {"count": 1000, "status": 400})
        statuses = [(await rt.post("/v1/completions", COMPLETION))[0] for _ in range(10)]
        assert statuses.count(400) == 5
        assert statuses.count(200) == 5
        assert (await other.state(0))["requests"] == 5
        worker = rt.replica.workers.get(picky.url)
        assert worker is not None
        assert worker.breaker.trips == 0 and worker.breaker.consecutive_failures == 0


async def test_all_workers_failing_gives_the_last_ones_5xx_after_bounded_attempts() -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        router_in_process(workers=[a.url, b.url], policy="round_robin") as rt,
    ):
        for fw in (a, b):
            await fw.post("/control/fail", {"count": 1000, "status": 500})
        status, body, _ = await rt.post("/v1/completions", COMPLETION)
        assert status == 500
        assert body["error"]["message"] == "injected failure"  # the worker's, not the router's
        failed = sum([(await fw.get("/control/state"))["failed_requests"] for fw in (a, b)])
        assert failed == 2  # one attempt per worker, no more


async def test_malformed_requests_are_400s_that_name_the_field() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        cases = [
            ("/v1/completions", {"max_tokens": 3}, "prompt"),
            ("/v1/completions", {"prompt": 5}, "prompt"),
            ("/v1/chat/completions", {"messages": []}, "messages"),
            ("/generate", {"sampling_params": {}}, "text"),
        ]
        for path, body, param in cases:
            status, payload, _ = await rt.post(path, body)
            assert status == 400, (path, payload)
            assert payload["error"]["param"] == param
        async with rt.session.post(f"{rt.url}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
        assert (await fw.state(0))["requests"] == 0


async def test_a_client_disconnect_cancels_the_upstream_request() -> None:
    async with (
        fake_worker_in_process(decode_ms_per_token=50) as fw,
        router_in_process(workers=[fw.url]) as rt,
    ):
        body = {"prompt": "long answer please", "max_tokens": 400, "stream": True}
        async with rt.session.post(f"{rt.url}/v1/completions", json=body) as resp:
            await resp.content.readline()  # the stream has started

        async def upstream_idle() -> bool:
            return (await fw.state(0))["running"] == 0

        await eventually(upstream_idle)
        assert rt.replica.inflight.total == 0


async def test_v1_models_is_the_union_of_the_workers_models() -> None:
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(fake_worker_in_process(model="model-a"))
        b = await stack.enter_async_context(fake_worker_in_process(model="model-b"))
        rt = await stack.enter_async_context(router_in_process(workers=[a.url, b.url]))
        status, body = await rt.get("/v1/models")
        assert status == 200
        assert sorted(m["id"] for m in body["data"]) == ["model-a", "model-b"]


async def test_v1_models_of_workers_listing_to_anyone_is_one_fetch_whatever_each_caller_sends() -> (
    None
):
    """Callers varying their `Authorization` each had the workers asked anew (one answer was
    kept, and each pushed the last out): a flood of made-up keys was a request to every worker
    each. Workers that list their models to anyone are asked once for all of them."""
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(fake_worker_in_process(model="model-a"))
        b = await stack.enter_async_context(fake_worker_in_process(model="model-b"))
        rt = await stack.enter_async_context(router_in_process(workers=[a.url, b.url]))
        listing = rt.serving.control.app[MODELS]

        async def models(k: int) -> list[str]:
            headers = {"Authorization": f"Bearer made-up-{k}"}
            async with rt.session.get(f"{rt.url}/v1/models", headers=headers) as resp:
                assert resp.status == 200
                return sorted(m["id"] for m in (await resp.json())["data"])

        answers = await asyncio.gather(*(models(k) for k in range(50)))
        assert answers == [["model-a", "model-b"]] * 50
        assert (listing.anonymous.fetches, listing.keyed.fetches) == (1, 0)


async def test_v1_models_without_a_key_is_answered_while_made_up_keys_hold_every_keyed_fetch() -> (
    None
):
    """Callers varying their `Authorization` queued the listing asked without one behind their
    fetches (4 at a time, each as slow as the slowest keyed worker): 40 made-up keys against
    a worker answering keyed listings in 1.9 s kept an anonymous caller waiting 18 s. That
    listing has a slot of its own."""
    held: list[str] = []  # the keys the keyed worker holds unanswered
    release = asyncio.Event()

    async def keyed_models(request: web.Request) -> web.Response:
        key = request.headers.get("Authorization")
        if key is None:
            return web.json_response({"error": {"message": "no key"}}, status=401)
        held.append(key)
        await release.wait()
        return web.json_response({"object": "list", "data": [{"id": "keyed"}]})

    async with contextlib.AsyncExitStack() as stack:
        keyed = await stack.enter_async_context(
            stub_server(stub_worker_routes({("GET", "/v1/models"): keyed_models}))
        )
        a = await stack.enter_async_context(fake_worker_in_process(model="model-a"))
        b = await stack.enter_async_context(fake_worker_in_process(model="model-b"))
        rt = await stack.enter_async_context(router_in_process(workers=[keyed, a.url]))

        async def models(headers: dict[str, str]) -> tuple[int, list[str]]:
            async with rt.session.get(f"{rt.url}/v1/models", headers=headers) as resp:
                return resp.status, sorted(m["id"] for m in (await resp.json())["data"])

        # Ten turns of keyed fetches, each held until the replica gives up on it (2 s).
        flood = [
            asyncio.ensure_future(models({"Authorization": f"Bearer made-up-{k}"}))
            for k in range(10 * MODELS_FETCHES)
        ]
        await eventually(lambda: len(held) == MODELS_FETCHES)
        # Another worker: the listing without a credential is fetched anew, none kept for it.
        status, body, _ = await rt.post("/workers", {"url": b.url})
        assert status == 200 and body["state"] == "ready", body
        async with asyncio.timeout(10):  # the flood's turns took 20 s
            assert await models({}) == (200, ["model-a", "model-b"])
        # Answered before the last made-up keys were even asked (it waited for all of them).
        assert len(held) < len(flood) and not all(caller.done() for caller in flood)
        release.set()
        assert [status for status, _ in await asyncio.gather(*flood)] == [200] * len(flood)
        assert sorted(held) == sorted(f"Bearer made-up-{k}" for k in range(len(flood)))


async def test_v1_models_asks_workers_with_the_callers_key_and_relays_their_401_without_one() -> (
    None
):
    """Engines run with `--api-key` guard /v1/models as their completions: the replica asked
    without the caller's credential and answered an empty 200 list, while completions through
    it worked. A listing read with one caller's key is never served to a caller without it."""
    key = {"Authorization": "Bearer sk-fleet"}
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(
            fake_worker_in_process(model="model-a", api_key="sk-fleet")
        )
        b = await stack.enter_async_context(
            fake_worker_in_process(model="model-b", api_key="sk-fleet")
        )
        rt = await stack.enter_async_context(router_in_process(workers=[a.url, b.url]))
        listing = rt.serving.control.app[MODELS]

        async def models(headers: dict[str, str]) -> tuple[int, Any, str | None]:
            async with rt.session.get(f"{rt.url}/v1/models", headers=headers) as resp:
                body = await resp.json(content_type=None)
                return resp.status, body, resp.headers.get("WWW-Authenticate")

        status, body, challenge = await models({})
        assert (status, body["error"]["type"], challenge) == (401, "authentication_error", "Bearer")
        status, body, _ = await models(key)
        assert status == 200
        assert sorted(m["id"] for m in body["data"]) == ["model-a", "model-b"]
        status, body, _ = await models({})  # within the keyed answer's second: not served it
        assert status == 401 and "data" not in body
        status, body, _ = await models({"Authorization": "Bearer wrong"})
        assert status == 401 and "check the API key" in body["error"]["message"]
        # Without a credential once (every worker refused it), then once per other credential.
        assert (listing.anonymous.fetches, listing.keyed.fetches) == (1, 2)
        # A key over the workers' head limit (a 400 each, not a refusal) keeps their refusal.
        status, body, _ = await models({"Authorization": "Bearer " + "A" * 9000})
        assert status == 401 and "check the API key" in body["error"]["message"]
        status, answer, _ = await rt.post("/v1/completions", COMPLETION, headers=key)
        assert status == 200 and answer["choices"][0]["text"]


async def test_v1_models_sends_a_callers_key_only_to_the_workers_that_refused_without_one() -> None:
    """The caller's key went to every worker, those that list their models to anyone (another
    team's engine) too; and a key every worker failed on otherwise than by refusing it (9 KB,
    over their head limit) made the listing an empty 200, the open worker's model gone."""
    seen: list[str | None] = []  # the open worker's: each /v1/models read's Authorization

    async def open_models(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": [{"id": "model-of-team-b"}]})

    async with contextlib.AsyncExitStack() as stack:
        team_b = await stack.enter_async_context(
            stub_server(stub_worker_routes({("GET", "/v1/models"): open_models}))
        )
        team_a = await stack.enter_async_context(
            fake_worker_in_process(model="model-of-team-a", api_key="TEAM-A-SECRET")
        )
        rt = await stack.enter_async_context(router_in_process(workers=[team_b, team_a.url]))

        async def models(key: str) -> tuple[int, list[str]]:
            headers = {"Authorization": f"Bearer {key}"}
            async with rt.session.get(f"{rt.url}/v1/models", headers=headers) as resp:
                return resp.status, sorted(m["id"] for m in (await resp.json())["data"])

        assert await models("TEAM-A-SECRET") == (200, ["model-of-team-a", "model-of-team-b"])
        assert await models("A" * 9000) == (200, ["model-of-team-b"])
        assert await models("wrong") == (200, ["model-of-team-b"])
        assert seen and set(seen) == {None}
