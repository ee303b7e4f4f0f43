"""Several models in one fleet: a replica in process over real fake workers on loopback, each
serving its own model (`--model`), some with adapters (`--lora-modules`).

A request goes only to a worker whose `/v1/models` lists the model it names
(`router.model_servers`): before, the router never looked, and half the requests for one
model went to the other model's worker (vLLM's 404 passed through, SGLang's answer from the
wrong model), and a prompt warmed under one model drew the other model's requests to its
rank. A model no listing holds goes to any worker, whose engine answers, and has the listings
read again (an adapter loaded at run time); the health loop reads them every
`--worker-models-refresh-s` (one unloaded). Each test asserts which worker got how many
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from cachetree.ranks import RankId
from router.placement import placer_of
from tests.component.test_placement import asker_of, counts, demand_on, policy_of, stub_placer
from tests.component.test_pressure_routing import CACHE_BLOCKS, prefix, two_sharing_replicas
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.router import RouterHandle, gate_fleet, quiesce, router_in_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

PER_MODEL = 8


async def served_by(rt: RouterHandle, path: str = "/v1/completions", **body: Any) -> str:
    """The worker that answered a request, asserting a 200."""
    body.setdefault("max_tokens", 1)
    status, answer, headers = await rt.post(path, body)
    assert status == 200, answer
    return headers["X-Kvrouter-Worker"]


async def worker_requests(rt: RouterHandle) -> dict[str, float]:
    """kvrouter_requests_total by worker ("none": the router's own answers)."""
    scrape = await rt.scrape()
    totals: Counter[str] = Counter()
    for labels in scrape.names("kvrouter_requests_total"):
        totals[labels["worker"]] += scrape.value("kvrouter_requests_total", **labels)
    return dict(totals)


async def routable(rt: RouterHandle, workers: list[FakeWorkerHandle]) -> None:
    """Until every worker takes requests (their subscriptions live, where the policy reads
    the index: `gate_fleet`)."""
    if rt.replica.workers.keeps_index:
        await gate_fleet([rt], workers)
    await eventually(lambda: len(rt.replica.workers.routable()) == len(workers), within_s=10.0)


async def admitted(fw: FakeWorkerHandle) -> int:
    """The generation requests the worker served."""
    return int((await fw.state())["requests"])


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_each_model_and_adapter_goes_only_to_the_workers_serving_it(policy: str) -> None:
    async with (
        fake_worker_in_process(model="m1", lora_modules=("ad1",)) as a,
        fake_worker_in_process(model="m2") as b,
        router_in_process(workers=[a.url, b.url], policy=policy, expose_route_headers=True) as rt,
    ):
        await routable(rt, [a, b])
        got: Counter[tuple[str, str]] = Counter()
        for model in ("m1", "m2", "ad1"):
            for i in range(PER_MODEL):
                prompt = f"question {i} for {model}, with some words to fill a block or two"
                got[model, await served_by(rt, model=model, prompt=prompt)] += 1
        assert got == {
            ("m1", a.url): PER_MODEL,
            ("m2", b.url): PER_MODEL,
            ("ad1", a.url): PER_MODEL,
        }
        # A request naming no model may go to either.
        unnamed = Counter([await served_by(rt, prompt=f"no model {i}") for i in range(8)])
        assert set(unnamed) <= {a.url, b.url} and sum(unnamed.values()) == 8
        assert (await admitted(a), await admitted(b)) == (
            2 * PER_MODEL + unnamed[a.url],
            PER_MODEL + unnamed[b.url],
        )


async def test_a_model_no_worker_lists_reaches_a_worker_whose_404_is_relayed() -> None:
    """Not the router's own 404: the name may be an adapter loaded since the listings were
    read, or one a LoRA resolver loads on its first request. vLLM answers 404 for the rest."""
    async with (
        fake_worker_in_process(model="m1") as a,
        fake_worker_in_process(model="m2") as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        await routable(rt, [a, b])
        answered: Counter[str] = Counter()
        for path, body in (
            ("/v1/completions", {"model": "m3", "prompt": "hello there"}),
            (
                "/v1/chat/completions",
                {"model": "m3", "messages": [{"role": "user", "content": "hi"}]},
            ),
        ):
            status, answer, headers = await rt.post(path, body)
            assert status == 404
            answered[headers["X-Kvrouter-Worker"]] += 1
            assert answer["error"]["message"] == "The model `m3` does not exist."
        # Each went to a worker, counted under it, none as the router's own answer.
        assert set(answered) <= {a.url, b.url}
        assert await worker_requests(rt) == dict(answered)


async def listings_read(workers: list[FakeWorkerHandle]) -> list[int]:
    """Each worker's `/v1/models` reads so far."""
    return [await fw.models_reads() for fw in workers]


async def read_again_once(workers: list[FakeWorkerHandle], before: list[int]) -> None:
    """Until each worker's listing was read again since `before`; then, that it was once."""

    async def read_again() -> bool:
        return all(n > b for n, b in zip(await listings_read(workers), before, strict=True))

    await eventually(read_again, within_s=10.0)
    assert await listings_read(workers) == [b + 1 for b in before]


def listing_of(rt: RouterHandle, fw: FakeWorkerHandle) -> tuple[str, ...]:
    """The names the replica's listing of the worker holds (`Worker.models`)."""
    worker = rt.replica.workers.get(fw.url)
    assert worker is not None
    return (*worker.models.bases, *worker.models.adapters)


@contextlib.asynccontextmanager
async def adapter_loaded_on_one() -> AsyncIterator[
    tuple[FakeWorkerHandle, FakeWorkerHandle, RouterHandle, list[int]]
]:
    """Two workers serving m1, registered; then vLLM's /v1/load_lora_adapter loads ad2 on the
    first, which no listing the replica read holds. Yields them, the replica and how often
    each worker's /v1/models was read by then."""
    async with (
        fake_worker_in_process(model="m1") as a,
        fake_worker_in_process(model="m1") as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        await routable(rt, [a, b])
        reads = await listings_read([a, b])
        assert (await a.lora_adapter("load", "ad2"))[0] == 200
        yield a, b, rt, reads


async def test_an_adapter_loaded_at_run_time_goes_to_its_worker_alone_after_one_read() -> None:
    """vLLM's /v1/load_lora_adapter on a, after both registered: the first request naming it
    may go to either (b answers 404) and has the listings read again; then every one goes to
    a. Before, the router's own 404 refused it until a registered again."""
    async with adapter_loaded_on_one() as (a, b, rt, reads):
        status, _, headers = await rt.post(
            "/v1/completions", {"model": "ad2", "prompt": "first", "max_tokens": 1}
        )
        first = headers["X-Kvrouter-Worker"]
        assert (first, status) in {(a.url, 200), (b.url, 404)}
        await eventually(lambda: "ad2" in listing_of(rt, a), within_s=10.0)
        assert listing_of(rt, b) == ("m1",)
        got = Counter(
            [await served_by(rt, model="ad2", prompt=f"question {i}") for i in range(PER_MODEL)]
        )
        assert got == {a.url: PER_MODEL}
        assert (await admitted(a), await admitted(b)) == (PER_MODEL + (first == a.url), 0)
        await read_again_once([a, b], reads)  # one read of each listing did it


async def listing_reads(rt: RouterHandle, reason: str) -> float:
    """kvrouter_worker_listing_reads_total: reads again begun, counted as each begins."""
    return (await rt.scrape()).value("kvrouter_worker_listing_reads_total", reason=reason)


async def test_bursts_of_requests_naming_unlisted_models_read_each_listing_once() -> None:
    """20 requests at once naming an adapter no listing holds, then 20 naming a model served
    nowhere: one read of each worker's /v1/models (`MODELS_REREAD_S`), not one per request."""
    async with adapter_loaded_on_one() as (a, b, rt, reads):

        async def burst(model: str) -> Counter[int]:
            answers = await asyncio.gather(
                *(
                    rt.post("/v1/completions", {"model": model, "prompt": f"q {i}"})
                    for i in range(20)
                )
            )
            assert all(headers["X-Kvrouter-Worker"] for _, _, headers in answers)
            return Counter(status for status, _, _ in answers)

        statuses = await burst("ad2")
        assert set(statuses) <= {200, 404}  # a's, b's
        await eventually(lambda: "ad2" in listing_of(rt, a), within_s=10.0)
        await read_again_once([a, b], reads)
        assert await burst("served-nowhere") == {404: 20}  # the workers' 404s, relayed
        # Counted as each read begins, on the request path: every one the bursts began.
        assert await listing_reads(rt, "unlisted_model") == 1
        assert await listings_read([a, b]) == [n + 1 for n in reads]


async def test_an_adapter_unloaded_at_run_time_stops_drawing_requests_after_a_refresh() -> None:
    """ad1 on both; unloaded from b (vLLM's /v1/unload_lora_adapter), it goes to a alone once
    the health loop has read the listings again (`--worker-models-refresh-s`, short here)."""
    async with (
        fake_worker_in_process(model="m1", lora_modules=("ad1",)) as a,
        fake_worker_in_process(model="m1", lora_modules=("ad1",)) as b,
        router_in_process(
            workers=[a.url, b.url],
            policy="round_robin",
            expose_route_headers=True,
            worker_models_refresh_s=0.3,
        ) as rt,
    ):
        await routable(rt, [a, b])
        before = Counter([await served_by(rt, model="ad1", prompt=f"q {i}") for i in range(4)])
        assert before == {a.url: 2, b.url: 2}  # round robin over both
        assert (await b.lora_adapter("unload", "ad1"))[0] == 200
        await eventually(lambda: "ad1" not in listing_of(rt, b), within_s=10.0)
        assert await listing_reads(rt, "refresh") >= 1
        after = Counter([await served_by(rt, model="ad1", prompt=f"r {i}") for i in range(6)])
        assert after == {a.url: 6}
        assert (await admitted(a), await admitted(b)) == (2 + 6, 2)


async def test_a_prompt_warmed_under_one_model_draws_no_request_of_another() -> None:
    """The m1 worker holds the prompt's blocks: the m2 requests for it go to the m2 worker,
    where nothing of it is cached (the router matched none: no false hit)."""
    async with (
        fake_worker_in_process(model="m1") as a,
        fake_worker_in_process(model="m2") as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        await routable(rt, [a, b])
        prompt = "You are a helpful assistant for ACME. Answer politely and in detail. " * 2
        assert await served_by(rt, model="m1", prompt=prompt) == a.url
        await quiesce([rt], [a, b])
        assert await served_by(rt, model="m1", prompt=prompt) == a.url  # warm there
        for _ in range(4):
            assert await served_by(rt, model="m2", prompt=prompt) == b.url
        assert (await admitted(a), await admitted(b)) == (2, 4)


async def test_sglang_workers_answer_each_model_from_its_own_worker() -> None:
    """SGLang does not check `model`: sent to the m1 worker, an m2 request was answered 200 by
    m1. A name no SGLang worker lists goes to any (SGLang serves it), not a 404."""
    async with (
        fake_worker_in_process(model="m1", wire="sglang", lora_modules=("ad1",)) as a,
        fake_worker_in_process(model="m2", wire="sglang") as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        await routable(rt, [a, b])
        for i in range(PER_MODEL):
            status, answer, headers = await rt.post(
                "/v1/completions", {"model": "m2", "prompt": f"question {i}", "max_tokens": 1}
            )
            assert (status, answer["model"], headers["X-Kvrouter-Worker"]) == (200, "m2", b.url)
        for i in range(PER_MODEL // 2):  # the adapter, by `lora_path` on /generate
            body = {"text": f"adapter {i}", "lora_path": "ad1"}
            assert await served_by(rt, "/generate", **body) == a.url
        unlisted = Counter(
            [await served_by(rt, model="default", prompt=f"x {i}") for i in range(6)]
        )
        assert sum(unlisted.values()) == 6
        assert (await admitted(a), await admitted(b)) == (
            PER_MODEL // 2 + unlisted[a.url],
            PER_MODEL + unlisted[b.url],
        )


async def test_a_failed_worker_fails_over_only_to_another_serving_the_model() -> None:
    """m1 on a and c, m2 on b: the m1 requests a refuses with a 503 go on to c, never b."""
    async with (
        fake_worker_in_process(model="m1") as a,
        fake_worker_in_process(model="m2") as b,
        fake_worker_in_process(model="m1") as c,
        router_in_process(
            workers=[a.url, b.url, c.url], policy="round_robin", expose_route_headers=True
        ) as rt,
    ):
        await routable(rt, [a, b, c])
        await a.post("/control/fail", {"count": 1000, "status": 503})
        got = Counter([await served_by(rt, model="m1", prompt=f"q {i}") for i in range(6)])
        assert got == {c.url: 6}
        assert await admitted(b) == 0
        # Alone with its model, a failing worker's 503 is relayed: b is never tried.
        await c.post("/control/fail", {"count": 1000, "status": 503})
        status, _, _ = await rt.post("/v1/completions", {"model": "m1", "prompt": "q"})
        assert status == 503
        assert await admitted(b) == 0


async def test_the_placer_places_a_new_prefix_among_the_workers_serving_its_model() -> None:
    """m1 on w1, m2 on w2 and w3. The placer's view: w1 idle, w2 busy, w3 less so; among every
    rank it would answer w1, which the asker cannot use for m2; among m2's, w3. The asker alone
    would pick w2 (its view: w3 busy)."""
    async with contextlib.AsyncExitStack() as stack:
        w1, w2, w3 = [
            await stack.enter_async_context(
                fake_worker_in_process(model=model, cache_blocks=CACHE_BLOCKS)
            )
            for model in ("m1", "m2", "m2")
        ]
        one, two = await two_sharing_replicas(stack, [w1, w2, w3], placement_timeout_ms=1000)
        placer, asker = (one, two) if placer_of(one.url, [two.url]) is None else (two, one)
        demand_on(placer, w2.url, 30, seed=1)
        demand_on(placer, w3.url, 10, seed=2)
        demand_on(asker, w3.url, 30, seed=3)
        status, answer, headers = await asker.post(
            "/v1/completions",
            {"model": "m2", "prompt": prefix(random.Random(7)), "max_tokens": 1},
        )
        assert status == 200, answer
        assert headers["X-Kvrouter-Worker"] == w3.url
        assert counts(asker)["asked"] == counts(asker)["answered"] == 1
        assert counts(asker).get("unusable", 0) == 0
        assert policy_of(placer).ledger.demand(RankId(w1.url, 0)) == 0


async def test_a_placers_answer_naming_a_worker_of_another_model_is_not_used() -> None:
    """A placer that answers a rank the model is not served on (one of an earlier version,
    which reads no model in the question): the asker decides among the model's ranks."""
    async with contextlib.AsyncExitStack() as stack:
        w1, w2, w3 = [
            await stack.enter_async_context(
                fake_worker_in_process(model=model, cache_blocks=CACHE_BLOCKS)
            )
            for model in ("m1", "m2", "m2")
        ]
        answered = asyncio.Event()
        answered.set()
        url = await stack.enter_async_context(stub_placer("later", (answered, RankId(w1.url, 0))))
        asker = await stack.enter_async_context(asker_of(url, [w1, w2, w3], timeout_ms=1000))
        status, answer, headers = await asker.post(
            "/v1/completions",
            {"model": "m2", "prompt": prefix(random.Random(3)), "max_tokens": 1},
        )
        assert status == 200, answer
        assert headers["X-Kvrouter-Worker"] in {w2.url, w3.url}
        assert (counts(asker)["asked"], counts(asker)["unusable"]) == (1, 1)
        assert await admitted(w1) == 0
