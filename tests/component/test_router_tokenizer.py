"""A replica with a real model tokenizer (`--tokenizer DIR`): routing keys, passthrough, 400s.

The model directories are small tokenizers of each family saved as the hub ships them
(tests/support/model_dirs.py). The engine's ids are computed by the fake worker's own model
path (fake_kv_worker/model_chat.py, transformers driven as vLLM drives it), never by the router.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

pytest.importorskip("transformers", reason="needs the hf extra")

from fake_kv_worker.model_chat import ModelChat
from tests.support.chat_shapes import SEARCH_TOOL, SYSTEM, WEATHER_TOOL
from tests.support.fake_worker import fake_worker_in_process
from tests.support.model_dirs import build_fixture_model, build_model_dir, fixture_template
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process

BS = 16
CONTENT = " ".join(["hello world"] * 20)


@pytest.fixture
def model(tmp_path: Path) -> str:
    return str(build_fixture_model(tmp_path / "model", "qwen3.jinja"))


async def served(*workers: Any) -> list[int]:
    return [(await fw.state())["requests"] for fw in workers]


async def matched_blocks_sum(rt: RouterHandle) -> float:
    registry = rt.replica.metrics.registry
    return registry.get_sample_value("kvrouter_matched_blocks_sum") or 0.0


async def test_chat_text_and_token_id_prompts_route_by_the_engines_tokens(model: str) -> None:
    engine = ModelChat(model, "vllm")
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": CONTENT}]}
    chat_ids = engine.chat_ids(chat)
    text = "the quick brown fox jumps over the lazy dog " * 4
    text_ids = engine.encode(text)
    prompt_ids = engine.encode("you are a helpful assistant " * 8)
    assert min(len(chat_ids), len(text_ids), len(prompt_ids)) >= 2 * BS
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        fake_worker_in_process() as c,
        router_in_process(
            workers=[a.url, b.url, c.url], tokenizer=model, expose_route_headers=True
        ) as rt,
    ):
        for fw in (a, b, c):
            await rt.gate(fw)
        # Two whole blocks of each prompt, each on its own worker (the workers tokenize with
        # bytes: the stored chains are what make the router's keys land).
        await rt.wait_cursor(a.url, 0, await a.store([chat_ids[: 2 * BS]]))
        await rt.wait_cursor(b.url, 0, await b.store([text_ids[: 2 * BS]]))
        await rt.wait_cursor(c.url, 0, await c.store([prompt_ids[: 2 * BS]]))
        before = await served(a, b, c)

        status, body, headers = await rt.post("/v1/chat/completions", chat)
        assert status == 200, body
        assert headers["X-Kvrouter-Worker"] == a.url

        status, body, headers = await rt.post("/v1/completions", {"prompt": text, "max_tokens": 1})
        assert status == 200, body
        assert headers["X-Kvrouter-Worker"] == b.url

        status, body, headers = await rt.post(
            "/v1/completions", {"prompt": prompt_ids, "max_tokens": 1}
        )
        assert status == 200, body
        assert headers["X-Kvrouter-Worker"] == c.url
        # The ids reached the engine as ids: its own cache served the two stored blocks.
        assert body["usage"]["prompt_tokens"] == len(prompt_ids)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS

        after = await served(a, b, c)
        assert [x - y for x, y in zip(after, before, strict=True)] == [1, 1, 1]
        registry = rt.replica.metrics.registry
        labels = {"policy": "cache_aware", "outcome": "cache_hit"}
        assert registry.get_sample_value("kvrouter_routing_decisions_total", labels) == 3


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_repeated_chat_with_tools_matches_every_block_the_engine_cached(
    tmp_path: Path, engine: str
) -> None:
    # The case: Qwen3 puts the tool list in its system block, so a router that drops
    # `tools` matches nothing. Here both sides run the same model directory; the engine (fake
    # worker) renders it its own way and reports how many prompt tokens it found cached.
    model = str(build_fixture_model(tmp_path / "qwen3", "qwen3.jinja"))
    chat = {
        "model": "fake-model",
        "messages": [
            {**SYSTEM, "content": "You are a helpful assistant. " * 6},
            {"role": "user", "content": "What is the weather in Paris today? " * 4},
        ],
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "max_tokens": 1,
    }
    async with (
        fake_worker_in_process(tokenizer=model, engine=engine) as a,
        fake_worker_in_process(tokenizer=model, engine=engine) as b,
        router_in_process(
            workers=[a.url, b.url], tokenizer=model, chat_rules=engine, expose_route_headers=True
        ) as rt,
    ):
        for fw in (a, b):
            await rt.gate(fw)
        status, first, headers = await rt.post("/v1/chat/completions", chat)
        assert status == 200, first
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        worker = a if headers["X-Kvrouter-Worker"] == a.url else b
        await rt.wait_cursor(worker.url, 0, (await worker.state())["last_seq"])
        matched_before = await matched_blocks_sum(rt)

        status, second, headers = await rt.post("/v1/chat/completions", chat)
        assert status == 200, second
        assert headers["X-Kvrouter-Worker"] == worker.url
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt_tokens = second["usage"]["prompt_tokens"]
        assert cached == prompt_tokens // BS * BS > 10 * BS  # every full block, tools included
        assert await matched_blocks_sum(rt) - matched_before == cached // BS
        failures = rt.replica.metrics.registry.get_sample_value(
            "kvrouter_tokenize_failures_total", {"reason": "render"}
        )
        assert failures == 0  # every reason is exported from the start, at 0


@pytest.mark.parametrize(
    ("engine", "fields", "by_ids"),
    [
        ("sglang", {"input_ids": list(range(100, 100 + 5 * BS))}, True),
        (
            "vllm",
            {"kv_transfer_params": {"prompt_token_ids": list(range(100, 100 + 5 * BS))}},
            True,
        ),
        ("vllm", {"input_ids": list(range(100, 100 + 5 * BS))}, False),  # not vLLM's field
    ],
)
async def test_a_chat_bringing_its_token_ids_matches_every_block_the_engine_cached_of_them(
    tmp_path: Path, engine: str, fields: dict[str, Any], by_ids: bool
) -> None:
    # SGLang 0.5.23 takes a chat's `input_ids` and vLLM 0.32+ a disaggregated decode's reused
    # `kv_transfer_params.prompt_token_ids` as the prompt, skipping the template: a router
    # keying the rendered messages matched none of the blocks the engine cached of the ids.
    model = str(build_fixture_model(tmp_path / "qwen3", "qwen3.jinja"))
    chat = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": 1,
        **fields,
    }
    rendered = len(ModelChat(model, engine).chat_ids({"messages": chat["messages"]}))
    second = await ask_twice(model, engine, "/v1/chat/completions", chat)
    assert second.same_worker
    prompt_tokens = second.answer["usage"]["prompt_tokens"]
    assert prompt_tokens == (5 * BS if by_ids else rendered)
    cached = second.answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == prompt_tokens // BS * BS >= 2 * BS
    assert second.matched_blocks == cached // BS


@dataclass
class SecondAsk:
    """A completion asked twice of two vLLM-like workers behind a replica, the second time
    once the first's blocks are in the index: what the second's answer and routing said."""

    answer: dict[str, Any]
    same_worker: bool
    matched_blocks: float  # the replica's matched-blocks sum over the second request


async def ask_twice(
    model: str,
    engine: str,
    path: str,
    body: dict[str, Any],
    refused: tuple[str, Any] | None = None,
) -> SecondAsk:
    """`body` to `path`, twice (see `SecondAsk`); then, with `refused` (a field and a value the
    engine refuses) set in it, a 400 naming that field."""
    async with (
        fake_worker_in_process(tokenizer=model, engine=engine) as a,
        fake_worker_in_process(tokenizer=model, engine=engine) as b,
        router_in_process(
            workers=[a.url, b.url], tokenizer=model, chat_rules=engine, expose_route_headers=True
        ) as rt,
    ):
        for fw in (a, b):
            await rt.gate(fw)
        status, first, headers = await rt.post(path, body)
        assert status == 200, first
        worker = a if headers["X-Kvrouter-Worker"] == a.url else b
        await rt.wait_cursor(worker.url, 0, (await worker.state())["last_seq"])
        matched_before = await matched_blocks_sum(rt)
        status, second, headers = await rt.post(path, body)
        assert status == 200, second
        matched = await matched_blocks_sum(rt) - matched_before
        same = headers["X-Kvrouter-Worker"] == worker.url
        if refused is not None:
            param, value = refused
            status, answer, _ = await rt.post(path, {**body, param: value})
            assert status == 400 and answer["error"]["param"] == param
    return SecondAsk(second, same, matched)


async def asked_twice(tmp_path: Path, body: dict[str, Any]) -> tuple[SecondAsk, str]:
    """`body` as a completion, twice (see `SecondAsk`); and the fixture model's path."""
    model = str(build_fixture_model(tmp_path / "llama3", "llama3.1_instruct.jinja"))
    refused = ("add_special_tokens", "x")
    return await ask_twice(model, "vllm", "/v1/completions", body, refused), model


async def test_a_completion_without_special_tokens_matches_every_block_the_engine_cached(
    tmp_path: Path,
) -> None:
    # With BOS the router's blocks start one token early: nothing the engine cached matched.
    body = {"prompt": CONTENT, "max_tokens": 1, "add_special_tokens": False}
    second, model = await asked_twice(tmp_path, body)
    assert second.same_worker
    prompt_tokens = second.answer["usage"]["prompt_tokens"]
    assert prompt_tokens == len(ModelChat(model, "vllm").encode(CONTENT, False))
    cached = second.answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == prompt_tokens // BS * BS >= 2 * BS
    assert second.matched_blocks == cached // BS


@pytest.mark.parametrize(
    "fields",
    [
        {"truncate_prompt_tokens": 3 * BS + 5},  # BOS and the text's last tokens
        {"truncate_prompt_tokens": 3 * BS + 5, "truncation_side": "right"},
        {"truncate_prompt_tokens": "53", "truncation_side": "left", "add_special_tokens": 0},
    ],
)
async def test_a_truncated_prompt_matches_every_block_the_engine_cached(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    # Keyed whole, the prompt's blocks are not the engine's (it cached the kept tokens only).
    text = " ".join(f"word{i}" for i in range(200))
    second, _ = await asked_twice(tmp_path, {"prompt": text, "max_tokens": 1, **fields})
    assert second.answer["usage"]["prompt_tokens"] == 3 * BS + 5
    assert second.same_worker
    assert second.answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert second.matched_blocks == 3


@contextlib.asynccontextmanager
async def recording_worker() -> AsyncIterator[tuple[str, list[tuple[str, bytes]]]]:
    """An engine that records every generation request's path and raw body, answers 200."""
    seen: list[tuple[str, bytes]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, await request.read()))
        return web.json_response({"id": "x", "choices": []})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(client_max_size=64 << 20)  # as large as the router forwards
    app.router.add_get("/health", health)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, record)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def router_on_recorder(model: str) -> AsyncIterator[tuple[RouterHandle, list]]:
    async with (
        recording_worker() as (url, seen),
        router_in_process(
            workers=[url], tokenizer=model, kv_events_port_base=free_tcp_port()
        ) as rt,
    ):
        yield rt, seen


async def post_raw(rt: RouterHandle, path: str, raw: bytes) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    async with rt.session.post(rt.url + path, data=raw, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_chat_and_token_id_bodies_reach_the_worker_byte_for_byte(model: str) -> None:
    # Spacing, key order, escapes, numbers and unknown fields a re-encoder would change.
    chat = (
        b'{"model":"m",  "messages":[{"role":"user","content":"hello \\u00e9 world"}],'
        b' "temperature": 0.50, "x_vendor": {"b": 1, "a": [1e2]}}'
    )
    ids = b'{"prompt": [1, 2,3 ,  4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "n": 1}'
    async with router_on_recorder(model) as (rt, seen):
        assert (await post_raw(rt, "/v1/chat/completions", chat))[0] == 200
        assert (await post_raw(rt, "/v1/completions", ids))[0] == 200
    assert seen == [("/v1/chat/completions", chat), ("/v1/completions", ids)]


async def test_malformed_chat_is_a_400_naming_messages_and_reaches_no_worker(
    model: str, tmp_path: Path
) -> None:
    cases = [
        {"messages": "hello world"},  # not a list
        {"messages": {"role": "user", "content": "hello"}},  # an object, not a list
        {"messages": []},
        {"messages": ["hello"]},  # an item that is not an object
        {"messages": [{"content": "hello"}]},  # no role
        {"messages": [{"role": 7, "content": "hello"}]},
    ]
    async with router_on_recorder(model) as (rt, seen):
        for body in cases:
            status, payload, _ = await rt.post("/v1/chat/completions", body)
            assert status == 400, (body, payload)
            assert payload["error"]["param"] == "messages", payload
            assert payload["error"]["type"] == "invalid_request_error"
        assert seen == []
    # A template that refuses the conversation is the engine's call: routed, counted, never a
    # 400 from the router (the engine may serve what the router cannot render).
    strict = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('the first turn must be the user') }}{% endif %}"
        + fixture_template("chatml.jinja")
    )
    refusing = str(build_model_dir(tmp_path / "strict", "llama2", strict))
    async with router_on_recorder(refusing) as (rt, seen):
        status, _, _ = await rt.post(
            "/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]}
        )
        assert status == 200
        status, _, _ = await rt.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200
        assert len(seen) == 2
        registry = rt.replica.metrics.registry
        labels = {"reason": "render"}
        assert registry.get_sample_value("kvrouter_tokenize_failures_total", labels) == 1
