"""The fake worker's HTTP surface, in process with real sockets: what each endpoint reports."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from fake_kv_worker.app import CACHED_TOKENS_HEADER
from fake_kv_worker.hashing import engine_block_hashes
from tests.support.clock import GatedSleep, ManualClock
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process

pytestmark = pytest.mark.timeout(20)

PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 bytes: 2 full blocks of 16
PROMPT_IDS = [b + 3 for b in PROMPT.encode()]


async def loads_when(
    fw: FakeWorkerHandle, condition: Callable[[dict[str, Any]], bool], within_s: float = 5.0
) -> dict[str, Any]:
    """Rank 0's `/v1/loads` entry, once it satisfies `condition`."""
    async with asyncio.timeout(within_s):
        while True:
            loads = (await fw.get("/v1/loads"))["loads"][0]
            if condition(loads):
                return loads


async def post(
    fw: FakeWorkerHandle, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    async with fw.session.post(fw.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def sse_events(fw: FakeWorkerHandle, path: str, body: Any) -> list[Any]:
    """The `data:` payloads of a stream, `[DONE]` kept as the string."""
    async with fw.session.post(fw.url + path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for block in raw.strip().split("\n\n"):
        assert block.startswith("data: ")
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return out


# --- generation -------------------------------------------------------------------------------


async def test_a_repeated_completion_reports_its_full_blocks_as_cached() -> None:
    async with fake_worker_in_process() as fw:
        body = {"prompt": PROMPT, "max_tokens": 3}
        status, first, _ = await post(fw, "/v1/completions", body)
        assert status == 200
        assert first["usage"] == {
            "prompt_tokens": 44,
            "completion_tokens": 3,
            "total_tokens": 47,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert first["choices"][0]["text"] == " lorem ipsum dolor"
        assert first["choices"][0]["finish_reason"] == "length"
        status, second, headers = await post(fw, "/v1/completions", body)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert headers["X-Fake-Worker-Cached-Tokens"] == "32"
        # Token ids are used as given and hash the same as the text they encode.
        _, third, _ = await post(fw, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1})
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        state = await fw.state()
        assert (state["requests"], state["hits"], state["misses"]) == (3, 4, 2)
        assert (state["prompt_tokens"], state["cached_tokens"], state["blocks"]) == (132, 64, 2)


async def test_chat_and_generate_hit_the_cache_like_completions() -> None:
    async with fake_worker_in_process() as fw:
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        _, first, _ = await post(fw, "/v1/chat/completions", chat)
        assert first["object"] == "chat.completion"
        assert first["choices"][0]["message"] == {"role": "assistant", "content": " lorem ipsum"}
        # "<|user|>" + PROMPT + "\n<|assistant|>" = 66 tokens: 4 full blocks.
        assert first["usage"]["prompt_tokens"] == 66
        _, again, _ = await post(fw, "/v1/chat/completions", chat)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64

        gen = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        _, g1, _ = await post(fw, "/generate", gen)
        _, g2, _ = await post(fw, "/generate", {"input_ids": PROMPT_IDS})
        assert g1["text"] == " lorem ipsum"
        assert g1["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert (g1["meta_info"]["cached_tokens"], g2["meta_info"]["cached_tokens"]) == (0, 32)
        assert g2["meta_info"]["completion_tokens"] == 16  # the default max_tokens


async def test_completion_stream_ends_with_done_and_carries_usage_on_request() -> None:
    async with fake_worker_in_process() as fw:
        body = {
            "prompt": PROMPT,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = await sse_events(fw, "/v1/completions", body)
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:3]]
        assert texts == [" lorem", " ipsum", " dolor"]
        assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "length"]
        assert events[3]["choices"] == []
        assert events[3]["usage"]["completion_tokens"] == 3
        again = await sse_events(fw, "/v1/completions", body)
        assert again[3]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_chat_and_generate_streams() -> None:
    async with fake_worker_in_process() as fw:
        chat = await sse_events(
            fw,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        )
        assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["delta"]["content"] for c in chat[1:3]] == [" lorem", " ipsum"]
        assert chat[2]["choices"][0]["finish_reason"] == "length"
        assert chat[-1] == "[DONE]" and len(chat) == 4

        gen_body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 2}}
        gen = await sse_events(fw, "/generate", gen_body)
        assert [g["text"] for g in gen[:2]] == [" lorem", " lorem ipsum"]  # cumulative
        assert gen[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
        assert gen[-1] == "[DONE]"


async def test_zero_max_tokens_streams_one_empty_final_chunk() -> None:
    async with fake_worker_in_process() as fw:
        events = await sse_events(
            fw, "/v1/completions", {"prompt": "hi", "max_tokens": 0, "stream": True}
        )
        assert len(events) == 2
        assert events[0]["choices"][0] == {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "length",
        }


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "headers", "param"),
    [
        ("/v1/completions", {"prompt": 1}, None, "prompt"),
        ("/v1/completions", {"prompt": ""}, None, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, "max_tokens"),
        ("/v1/completions", {"prompt": "x"}, {"X-Data-Parallel-Rank": "1"}, "X-Data-Parallel-Rank"),
        ("/v1/completions", {"prompt": "x"}, {"X-Data-Parallel-Rank": "a"}, "X-Data-Parallel-Rank"),
        ("/v1/chat/completions", {"messages": "hi"}, None, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": 1}]}, None, "messages[0].role"),
        ("/generate", {"text": ""}, None, "text"),
        ("/generate", {"input_ids": [1, "2"]}, None, "input_ids"),
        ("/control/store", {"token_chains": [[1, 2]]}, None, "token_chains"),
        ("/control/store", {"token_chains": "x"}, None, "token_chains"),
        ("/control/store", {"token_chains": [], "dp_rank": 5}, None, "dp_rank"),
        ("/control/store", {"token_chains": [], "medium": 3}, None, "medium"),
        ("/control/evict", {}, None, "token_chains"),
        ("/control/evict", {"count": -1}, None, "count"),
        ("/control/fail", {"status": 200}, None, "status"),
        ("/control/drop-next", {"count": "2"}, None, "count"),
    ],
)
async def test_malformed_requests_are_400_naming_the_field(
    path: str, body: Any, headers: dict[str, str] | None, param: str
) -> None:
    async with fake_worker_in_process() as fw:
        status, error, _ = await post(fw, path, body, headers)
        assert status == 400
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"] == param
        assert (await fw.state())["last_seq"] == -1  # nothing was published


async def test_bodies_that_are_not_json_objects_or_too_large_are_refused() -> None:
    async with fake_worker_in_process(max_body_bytes=2048) as fw:
        async with fw.session.post(fw.url + "/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] is None
        async with fw.session.post(fw.url + "/v1/completions", json=[1]) as resp:
            assert resp.status == 400
        big = {"prompt": "x" * 4096}
        async with fw.session.post(fw.url + "/v1/completions", json=big) as resp:
            assert resp.status == 413
            assert "error" in await resp.json()
        async with fw.session.get(fw.url + "/nowhere") as resp:
            assert resp.status == 404
            assert "error" in await resp.json()


# --- failures, health, concurrency ----------------------------------------------------------


async def test_injected_failures_fail_exactly_the_next_n_requests() -> None:
    async with fake_worker_in_process(fail_first=2) as fw:
        body = {"prompt": PROMPT, "max_tokens": 1}
        statuses = [(await post(fw, "/v1/completions", body))[0] for _ in range(3)]
        assert statuses == [503, 503, 200]
        await fw.post("/control/fail", {"count": 1, "status": 429})
        statuses = [(await post(fw, "/generate", {"text": "x"}))[0] for _ in range(2)]
        assert statuses == [429, 200]
        state = await fw.get("/control/state")
        assert (state["failed_requests"], state["pending_failures"]) == (3, 0)
        assert state["ranks"][0]["requests"] == 2  # failed requests never reached the cache


async def test_an_api_key_guards_v1_routes_as_vllms_does_and_leaves_health_open() -> None:
    async with fake_worker_in_process(api_key="sk-1") as fw:
        body = {"prompt": PROMPT, "max_tokens": 2}
        status, refusal, _ = await post(fw, "/v1/completions", body)
        assert status == 401 and refusal["error"]["type"] == "authentication_error"
        status, _, _ = await post(fw, "/v1/completions", body, {"Authorization": "Bearer sk-2"})
        assert status == 401
        status, answer, _ = await post(
            fw, "/v1/completions", body, {"Authorization": "Bearer sk-1"}
        )
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        async with fw.session.get(fw.url + "/v1/models") as resp:
            assert resp.status == 401
        async with fw.session.get(fw.url + "/health") as resp:
            assert resp.status == 200


async def test_health_is_503_until_the_startup_delay_has_passed() -> None:
    clock = ManualClock(1000.0)
    async with fake_worker_in_process(startup_delay_s=5.0, clock=clock) as fw:
        async with fw.session.get(fw.url + "/health") as resp:
            assert resp.status == 503
        clock.now += 4.9
        async with fw.session.get(fw.url + "/health") as resp:
            assert resp.status == 503
        clock.now += 0.1
        async with fw.session.get(fw.url + "/health") as resp:
            assert resp.status == 200


async def test_requests_beyond_max_concurrency_wait_and_are_reported_as_waiting() -> None:
    sleep = GatedSleep()
    async with fake_worker_in_process(
        max_concurrency=1, prefill_us_per_token=1.0, sleep=sleep
    ) as fw:
        body = {"prompt": PROMPT, "max_tokens": 0}
        first = asyncio.create_task(post(fw, "/v1/completions", body))
        await asyncio.wait_for(sleep.entered.wait(), 5)  # in prefill, holding the only slot
        second = asyncio.create_task(post(fw, "/v1/completions", body))
        loads = await loads_when(fw, lambda entry: entry["num_waiting_reqs"] == 1)
        assert loads["num_running_reqs"] == 1
        assert loads["num_total_reqs"] == 2
        # The waiting prompt's blocks are already cached by the first: 12 tokens left over.
        assert loads["num_waiting_uncached_tokens"] == 44 - 32
        assert loads["utilization"] == 1.0
        sleep.release.set()
        (s1, _, _), (s2, b2, _) = await asyncio.gather(first, second)
        assert (s1, s2) == (200, 200)
        assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        idle = (await fw.get("/v1/loads"))["loads"][0]
        assert (idle["num_total_reqs"], idle["num_waiting_uncached_tokens"]) == (0, 0)


# --- discovery, loads, metrics, snapshot ----------------------------------------------------


async def test_server_info_advertises_the_kv_event_endpoints() -> None:
    async with fake_worker_in_process(dp_size=2, topic="kv@t", model="m1") as fw:
        info = await fw.get("/server_info")
        assert info == {
            "served_model_name": "m1",
            "speculative_algorithm": None,
            "kv_events": {
                "publisher": "zmq",
                "endpoint_host": "127.0.0.1",
                "endpoint_port_base": fw.config.kv_port_base,
                "topic": "kv@t",
                "block_size": 16,
                "dp_size": 2,
            },
        }
        assert [m["id"] for m in (await fw.get("/v1/models"))["data"]] == ["m1"]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_v1_models_lists_each_adapter_with_the_served_model_as_its_parent(
    engine: str,
) -> None:
    """As vLLM's and SGLang's ModelCards list loaded LoRA adapters (`parent`)."""
    async with fake_worker_in_process(wire=engine, model="m1", lora_modules=("sql", "chat")) as fw:
        cards = (await fw.get("/v1/models"))["data"]
        assert [(c["id"], c["parent"], c["owned_by"]) for c in cards] == [
            ("m1", None, engine),
            ("sql", "m1", engine),
            ("chat", "m1", engine),
        ]
    async with fake_worker_in_process(replay=True) as fw:
        kv_events = (await fw.get("/server_info"))["kv_events"]
        assert kv_events["replay_endpoint_port_base"] == fw.config.replay_port_base


async def test_loads_follow_the_smg_schema_per_rank() -> None:
    async with fake_worker_in_process(dp_size=2, cache_blocks=8) as fw:
        await post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        await post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        body = await fw.get("/v1/loads")
        assert body["dp_rank_count"] == 2
        assert isinstance(body["timestamp"], str)
        rank0, rank1 = body["loads"]
        assert set(rank0) == {
            "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
            "num_total_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage",
            "gen_throughput", "cache_hit_rate", "utilization", "max_running_requests",
        }  # fmt: skip
        assert (rank0["dp_rank"], rank1["dp_rank"]) == (0, 1)
        assert (rank0["num_used_tokens"], rank0["max_total_num_tokens"]) == (0, 128)
        assert rank0["token_usage"] == 0.0
        assert rank0["cache_hit_rate"] == 32 / 88
        assert rank1["num_used_tokens"] == 0


def metric_value(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics:\n{text}")


async def test_metrics_use_vllm_or_sglang_names() -> None:
    async with fake_worker_in_process(cache_blocks=8) as fw:
        await post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        await post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        async with fw.session.get(fw.url + "/metrics") as resp:
            text = await resp.text()
        labels = '{engine="0",model_name="fake-model"}'
        assert metric_value(text, f"vllm:num_requests_running{labels}") == 0
        assert metric_value(text, f"vllm:num_requests_waiting{labels}") == 0
        assert metric_value(text, f"vllm:kv_cache_usage_perc{labels}") == 0.0
        assert metric_value(text, f"vllm:prefix_cache_queries_total{labels}") == 88
        assert metric_value(text, f"vllm:prefix_cache_hits_total{labels}") == 32
        # vLLM states its KV pool in the labels of an info gauge, one sample per engine core.
        info = (
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",'
            'enable_prefix_caching="True",num_cpu_blocks="None",num_gpu_blocks="8",'
            'num_gpu_blocks_override="None",engine="0"}'
        )
        assert metric_value(text, info) == 1
    async with fake_worker_in_process(wire="sglang", dp_size=2, cache_blocks=8) as fw:
        async with fw.session.get(fw.url + "/metrics") as resp:
            text = await resp.text()
        for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate"):
            for rank in (0, 1):
                sample = f'sglang:{name}{{model_name="fake-model",dp_rank="{rank}"}}'
                assert metric_value(text, sample) == 0
        for rank in (0, 1):
            sample = f'sglang:max_total_num_tokens{{model_name="fake-model",dp_rank="{rank}"}}'
            assert metric_value(text, sample) == 8 * 16


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_kv_usage_counts_the_blocks_running_requests_hold_not_the_idle_cache(
    engine: str,
) -> None:
    """SGLang counts evictable tokens as free, vLLM v1 blocks no request references: a warm,
    idle engine reports usage 0, however full its cache."""
    sleep = GatedSleep()
    async with fake_worker_in_process(
        wire=engine, cache_blocks=8, prefill_us_per_token=1.0, sleep=sleep
    ) as fw:
        await fw.post("/control/store", {"token_chains": [list(range(3, 3 + 8 * 16))]})

        async def usage() -> tuple[float, int, float]:
            loads = (await fw.get("/v1/loads"))["loads"][0]
            async with fw.session.get(fw.url + "/metrics") as resp:
                text = await resp.text()
            if engine == "vllm":
                metric = metric_value(
                    text, 'vllm:kv_cache_usage_perc{engine="0",model_name="fake-model"}'
                )
            else:
                labels = '{model_name="fake-model",dp_rank="0"}'
                metric = metric_value(text, f"sglang:token_usage{labels}")
                used = metric_value(text, f"sglang:num_used_tokens{labels}")
                assert used == loads["num_used_tokens"]
            return loads["token_usage"], loads["num_used_tokens"], metric

        assert (await fw.state())["blocks"] == 8
        assert await usage() == (0.0, 0, 0.0)
        held = asyncio.create_task(post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0}))
        await asyncio.wait_for(sleep.entered.wait(), 5)  # in prefill, holding its blocks
        # 44 tokens: 2 full blocks and the partial one the engine allocates for the rest.
        assert await usage() == (3 / 8, 3 * 16, 3 / 8)
        sleep.release.set()
        assert (await held)[0] == 200
        assert (await fw.state())["blocks"] == 8  # still full, of idle blocks
        assert await usage() == (0.0, 0, 0.0)


@pytest.mark.parametrize(
    "engine,adapter_body",
    [
        ("vllm", {"model": "sql"}),
        ("sglang", {"lora_path": "sql"}),
        ("sglang", {"lora_path": ["sql", "chat"]}),
        ("sglang", {"model": "fake-model:sql"}),
        ("sglang", {"model": "fake-model: sql ", "lora_path": "chat"}),  # model first
    ],
)
async def test_a_request_naming_a_loaded_adapter_hits_only_that_adapters_blocks(
    engine: str, adapter_body: dict
) -> None:
    async with fake_worker_in_process(
        wire=engine, serve_kv_snapshot=True, lora_modules=("sql", "chat")
    ) as fw:
        ids = list(range(3, 35))  # 2 blocks
        await fw.store([ids], lora_name="sql")
        body = {"prompt": ids, "max_tokens": 1}
        _, _, headers = await post(fw, "/v1/completions", body)
        assert headers[CACHED_TOKENS_HEADER] == "0"  # the base model's: a miss
        _, _, headers = await post(fw, "/v1/completions", {**body, **adapter_body})
        assert headers[CACHED_TOKENS_HEADER] == "32"
        snap = await fw.get("/v1/kv-snapshot")
        names = [b.get("lora_name") for b in snap["ranks"][0]["blocks"]]
        assert sorted(names, key=str) == [None, None, "sql", "sql"]


async def test_an_adapter_that_is_not_loaded_is_refused_by_name() -> None:
    async with fake_worker_in_process(wire="sglang", lora_modules=("sql",)) as fw:
        for param, named in (("lora_path", "other"), ("model", "fake-model:other")):
            body = {"prompt": "hello there", param: named, "max_tokens": 1}
            async with fw.session.post(fw.url + "/v1/completions", json=body) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] == param
        store = {"token_chains": [list(range(3, 19))], "lora_name": "other"}
        async with fw.session.post(fw.url + "/control/store", json=store) as resp:
            assert resp.status == 400
        assert (await fw.state())["last_seq"] == -1  # nothing cached, nothing published


async def test_a_vllm_request_naming_a_model_it_does_not_serve_is_answered_404_as_vllm_does() -> (
    None
):
    """vLLM's `_check_model`: a `model` that is neither a served name nor a loaded adapter is
    refused before anything is cached; it was served as the base model."""
    async with fake_worker_in_process(wire="vllm", lora_modules=("sql",)) as fw:
        for path, prompt in (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")):
            text = "hello there, a prompt"
            asked = [{"role": "user", "content": text}] if prompt == "messages" else text
            status, answer, _ = await post(fw, path, {prompt: asked, "model": "other"})
            assert status == 404
            assert answer == {
                "error": {
                    "message": "The model `other` does not exist.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        assert (await fw.state())["last_seq"] == -1  # nothing cached, nothing published
        for named in ({}, {"model": ""}, {"model": "fake-model"}, {"model": "sql"}):
            body = {"prompt": "hello there, a prompt", "max_tokens": 1, **named}
            assert (await post(fw, "/v1/completions", body))[0] == 200


async def test_vllms_runtime_lora_routes_change_what_it_serves_and_lists() -> None:
    """vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING): a loaded adapter is listed with its path as its root and
    served; an unloaded one, `--lora-modules`' too, is neither; their 400s and 404 as vLLM's."""
    async with fake_worker_in_process(wire="vllm", model="m1", lora_modules=("sql",)) as fw:
        body = {"prompt": "hello there, a prompt", "max_tokens": 1, "model": "chat"}
        assert (await post(fw, "/v1/completions", body))[0] == 404
        async with fw.session.post(
            fw.url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": "/a/chat"}
        ) as resp:
            assert (resp.status, await resp.text()) == (
                200,
                "Success: LoRA adapter 'chat' added successfully.",
            )
        cards = (await fw.get("/v1/models"))["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            ("m1", "m1", None),
            ("sql", "sql", "m1"),
            ("chat", "/a/chat", "m1"),
        ]
        assert (await post(fw, "/v1/completions", body))[0] == 200
        for refused, status, message in (
            ({"lora_name": "chat", "lora_path": "/a/chat"}, 400, "has already been loaded"),
            ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
            ({"lora_path": "/a/x", "lora_name": ""}, 400, "Both 'lora_name'"),
        ):
            status_got, answer, _ = await post(fw, "/v1/load_lora_adapter", refused)
            assert status_got == status and message in answer["error"]["message"]
        assert await fw.lora_adapter("unload", "sql") == (
            200,
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        assert [c["id"] for c in (await fw.get("/v1/models"))["data"]] == ["m1", "chat"]
        assert (await post(fw, "/v1/completions", {**body, "model": "sql"}))[0] == 404
        status, answer, _ = await post(fw, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert (status, answer["error"]) == (
            404,
            {
                "message": "The lora adapter 'sql' cannot be found.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
        )
        assert (await post(fw, "/v1/unload_lora_adapter", {}))[0] == 400
        # Every /v1/models read is counted: the cost a router's listing reads put on it.
        assert await fw.models_reads() == 2


async def test_an_sglang_fake_serves_no_runtime_lora_route() -> None:
    async with fake_worker_in_process(wire="sglang") as fw:
        assert (await fw.lora_adapter("load", "chat"))[0] == 404
        assert [c["id"] for c in (await fw.get("/v1/models"))["data"]] == ["fake-model"]


async def test_kv_snapshot_is_not_served_without_the_flag() -> None:
    async with fake_worker_in_process() as fw, fw.session.get(fw.url + "/v1/kv-snapshot") as resp:
        assert resp.status == 404


async def test_kv_snapshot_lists_every_rank_parent_first_as_of_its_last_seq() -> None:
    async with fake_worker_in_process(serve_kv_snapshot=True, dp_size=2, wire="sglang") as fw:
        chain = list(range(3, 51))  # 3 blocks
        await fw.store([chain])
        await fw.store([chain[:16] + [7] * 16], medium="CPU")  # a sibling branch on the host
        await post(fw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                   {"X-Data-Parallel-Rank": "1"})  # fmt: skip
        snap = await fw.get("/v1/kv-snapshot")
        assert snap["block_size"] == 16
        rank0, rank1 = snap["ranks"]
        assert (rank0["dp_rank"], rank0["last_seq"]) == (0, 1)
        assert (rank1["dp_rank"], rank1["last_seq"]) == (1, 0)
        h = engine_block_hashes("sglang", chain, 16)
        h_cpu = engine_block_hashes("sglang", chain[:16] + [7] * 16, 16)
        # The shared root was a hit for the CPU chain: not announced again, so it stays on GPU.
        assert [
            (b["engine_hash"], b["parent_engine_hash"], b["tier"]) for b in rank0["blocks"]
        ] == [
            (h[0], None, "device"),
            (h[1], h[0], "device"),
            (h[2], h[1], "device"),
            (h_cpu[1], h_cpu[0], "host"),
        ]
        assert rank0["blocks"][2]["token_ids"] == chain[32:]
        assert [b["token_ids"] for b in rank1["blocks"]] == [PROMPT_IDS[:16], PROMPT_IDS[16:32]]
        assert (await fw.state(0))["last_seq"] == rank0["last_seq"]
