"""LoRA adapter requests routed by a real replica over real fake workers on loopback.

A request naming an adapter is keyed in that adapter's namespace as its engine reads the name
(`routing.namespace_for`), whether or not a store has named the adapter yet: keyed as the base
model's, it matched the base model's blocks (the router counting a hit the engine could not
use). Each test asserts what the router matched against what the worker found cached.
"""

from __future__ import annotations

from fake_kv_worker.app import CACHED_TOKENS_HEADER
from tests.component.test_lora_snapshots import BLOCKS, BS, IDS, PROMPT, matched_blocks, routed
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.router import RouterHandle, router_in_process


async def completion(rt: RouterHandle, **body: object) -> tuple[int, int]:
    """(the dp rank a completion went to, the prompt tokens its worker found cached)."""
    headers, cached = await routed(rt, **body)
    return int(headers["X-Kvrouter-Dp-Rank"]), cached


async def settled(rt: RouterHandle, fw: FakeWorkerHandle, dp_rank: int) -> None:
    """Until the replica has applied every batch the rank has published."""
    await rt.wait_cursor(fw.url, dp_rank, (await fw.state(dp_rank))["last_seq"])


async def test_a_vllm_request_naming_an_adapter_no_store_named_is_no_hit_on_base_blocks() -> None:
    async with (
        fake_worker_in_process(dp_size=2, lora_modules=("sql",)) as fw,
        router_in_process(workers=[fw.url], expose_route_headers=True) as rt,
    ):
        for dp_rank in (0, 1):
            await rt.gate(fw, dp_rank)
        # Learned from the worker's /v1/models at registration, before any store names it.
        assert rt.replica.pump.rules.adapters == {"sql"}
        assert rt.replica.workers.served_models == {"fake-model"}
        await fw.store([IDS], dp_rank=1)  # the base model's blocks of the prompt
        await settled(rt, fw, 1)
        # The adapter's request: no block of it anywhere, for the router as for the engine
        # (the router matched the base model's five on rank 1 and sent it there).
        rank, cached = await completion(rt, model="sql", prompt=f"{PROMPT}sql?")
        assert (matched_blocks(rt), cached) == (0, 0)
        await settled(rt, fw, rank)
        # Its blocks are now the adapter's on that rank: found there, as many as the router
        # matched; the base model's request still finds its own on rank 1.
        assert await completion(rt, model="sql", prompt=f"{PROMPT}sql again?") == (
            rank,
            BLOCKS * BS,
        )
        assert matched_blocks(rt) == BLOCKS
        assert await completion(rt, model="fake-model", prompt=f"{PROMPT}base?") == (
            1,
            BLOCKS * BS,
        )
        assert matched_blocks(rt) == 2 * BLOCKS


async def test_an_sglang_request_naming_an_adapter_in_model_and_lora_path_is_keyed_by_model() -> (
    None
):
    """SGLang serves `model` "base:adapter" over `lora_path` when both name one; keyed by
    `lora_path`, the request matched the other adapter's blocks."""
    async with (
        fake_worker_in_process(wire="sglang", dp_size=2, lora_modules=("sql", "chat")) as fw,
        router_in_process(workers=[fw.url], expose_route_headers=True) as rt,
    ):
        for dp_rank in (0, 1):
            await rt.gate(fw, dp_rank)
        await fw.store([IDS], dp_rank=1, lora_name="chat")
        await settled(rt, fw, 1)
        body = {"model": "fake-model:sql", "lora_path": "chat", "prompt": f"{PROMPT}sql?"}
        rank, cached = await completion(rt, **body)
        assert (matched_blocks(rt), cached) == (0, 0)
        await settled(rt, fw, rank)
        body["prompt"] = f"{PROMPT}sql again?"
        assert await completion(rt, **body) == (rank, BLOCKS * BS)
        assert matched_blocks(rt) == BLOCKS
        # `lora_path` alone names "chat": its blocks on rank 1.
        body = {"model": "fake-model", "lora_path": "chat", "prompt": f"{PROMPT}chat?"}
        assert await completion(rt, **body) == (1, BLOCKS * BS)
        assert matched_blocks(rt) == 2 * BLOCKS


async def test_an_sglang_generate_request_names_its_adapter_by_lora_path_never_by_model() -> None:
    """SGLang's `/generate` takes no `model` (its GenerateReqInput has none): "base:adapter"
    there is served as the base model. Read as on the OpenAI routes, the router matched the
    adapter's blocks on one rank and sent the request there, where the engine found none."""
    async with (
        fake_worker_in_process(wire="sglang", dp_size=2, lora_modules=("sql",)) as fw,
        router_in_process(workers=[fw.url], expose_route_headers=True) as rt,
    ):
        for dp_rank in (0, 1):
            await rt.gate(fw, dp_rank)
        await fw.store([IDS], dp_rank=0, lora_name="sql")
        await fw.store([IDS], dp_rank=1)  # the base model's
        for dp_rank in (0, 1):
            await settled(rt, fw, dp_rank)
        one_token = {"sampling_params": {"max_new_tokens": 1}}
        for named, rank, matched in (
            ({"model": "fake-model:sql"}, "1", BLOCKS),  # the base model's blocks
            ({"model": "fake-model", "lora_path": "sql"}, "0", 2 * BLOCKS),
        ):
            body = {"text": f"{PROMPT}{rank}?", **named, **one_token}
            status, answer, headers = await rt.post("/generate", body)
            assert status == 200, answer
            cached = headers[CACHED_TOKENS_HEADER]
            assert (headers["X-Kvrouter-Dp-Rank"], cached) == (rank, str(BLOCKS * BS))
            assert matched_blocks(rt) == matched
