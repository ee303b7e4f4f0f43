"""LoRA adapters through snapshots, with real replicas and real fake workers on loopback.

A worker's `/v1/kv-snapshot` names the adapter of each chain root (`lora_name`): a replica that
learns a worker's cache from it keys those blocks in the adapter's namespace and learns the
name. A sibling's export lists the adapter names it learned (`adapters`): a replica that joins
from it keys a request naming one as the engine does before any store names it again.
"""

from __future__ import annotations

import contextlib

from router.tokenize import BytesTokenizer
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

BS = 16
TOK = BytesTokenizer()
PROMPT = "SELECT the orders of every customer who bought twice; explain the plan step by step. "
IDS = TOK.encode(PROMPT)
BLOCKS = len(IDS) // BS  # 5


def matched_blocks(rt: RouterHandle) -> float:
    """The replica's sum of leading blocks the chosen rank held, over every routed request."""
    registry = rt.replica.metrics.registry
    return registry.get_sample_value("kvrouter_matched_blocks_sum") or 0.0


async def routed(rt: RouterHandle, **body: object) -> tuple[dict[str, str], int]:
    """(the route headers of a completion's answer, the prompt tokens its worker found cached)."""
    status, answer, headers = await rt.post("/v1/completions", {"max_tokens": 1, **body})
    assert status == 200, answer
    return headers, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def completion(rt: RouterHandle, **body: object) -> tuple[str, int]:
    """(the worker a completion went to, the prompt tokens it found cached)."""
    headers, cached = await routed(rt, **body)
    return headers["X-Kvrouter-Worker"], cached


async def test_a_workers_snapshot_keys_an_adapters_blocks_apart_from_the_base_models() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True, lora_modules=("sql",)) as tuned,
        fake_worker_in_process(serve_kv_snapshot=True) as base,
    ):
        # Cached before the replica starts: it learns both caches from the snapshots alone.
        await tuned.store([IDS], lora_name="sql")
        await base.store([IDS[: 2 * BS]])  # the base model's first two blocks
        async with router_in_process(
            workers=[tuned.url, base.url], expose_route_headers=True
        ) as rt:
            rules = rt.replica.pump.rules
            await eventually(lambda: rules.stats.worker_snapshots_applied == 2, 10)
            for fw in (tuned, base):
                await rt.gate(fw)
            assert rules.adapters == {"sql"}
            before = [(await fw.state())["requests"] for fw in (tuned, base)]
            for i in range(3):
                # The base model's request is the base worker's two blocks, not the adapter's
                # five (a false hit there: the tuned worker holds no base-model block of it).
                worker, cached = await completion(rt, prompt=f"{PROMPT}base {i}?")
                assert (worker, cached) == (base.url, 2 * BS if i == 0 else BLOCKS * BS)
                await rt.wait_cursor(base.url, 0, (await base.state())["last_seq"])
                # The adapter's request finds its five blocks where they are.
                worker, cached = await completion(rt, model="sql", prompt=f"{PROMPT}sql {i}?")
                assert (worker, cached) == (tuned.url, BLOCKS * BS)
            after = [(await fw.state())["requests"] for fw in (tuned, base)]
            assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3]


async def ready(rt: RouterHandle, within_s: float = 15.0) -> None:
    async def is_ready() -> bool:
        status, _ = await rt.get("/readyz")
        return status == 200

    await eventually(is_ready, within_s)


async def test_a_replica_joining_from_a_sibling_finds_an_adapters_blocks_at_once() -> None:
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process(lora_modules=("sql",)))
        warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        await warm.gate(fw)
        await warm.wait_cursor(fw.url, 0, await fw.store([IDS], lora_name="sql"))
        assert warm.replica.pump.rules.adapters == {"sql"}
        new = await stack.enter_async_context(
            router_in_process(
                peer=[warm.url],
                workers=[fw.url],
                kv_bootstrap_timeout_ms=20_000,
                expose_route_headers=True,
            )
        )
        await ready(new)
        assert new.replica.bootstrap is not None
        assert new.replica.bootstrap.sources["peer"] == 1  # grafted, not learned live
        assert new.replica.pump.rules.adapters == {"sql"}
        matched = matched_blocks(new)
        worker, cached = await completion(new, model="sql", prompt=f"{PROMPT}sql?")
        assert (worker, cached) == (fw.url, BLOCKS * BS)
        assert matched_blocks(new) - matched == BLOCKS  # the replica knew where they were
