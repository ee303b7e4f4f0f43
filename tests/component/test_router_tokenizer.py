"""A replica with a real HF tokenizer (`--tokenizer DIR`): routing keys, passthrough, 400s.

The tokenizer is built here, offline (a WordLevel vocabulary trained on a few sentences, and a
`tokenizer_config.json` with a chat template), by the helpers of `tests/unit/test_tokenize.py`.
The fake workers tokenize with the bytes tokenizer, so a request's own blocks never match what
the router hashes; instead each test *stores* the HF token ids on one worker and checks that
the request goes there: the router must have keyed it with the HF tokenizer and the template.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

pytest.importorskip("tokenizers", reason="needs the hf extra")
pytest.importorskip("jinja2", reason="needs the hf extra")

from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.unit.test_tokenize import build_tokenizer, model_dir, standard_config

BS = 16
CONTENT = " ".join(["hello world"] * 20)  # 40 words of the vocabulary


def hf_ids(text: str, *, special: bool) -> list[int]:
    return build_tokenizer().encode(text, add_special_tokens=special).ids


@pytest.fixture
def model(tmp_path: Path) -> str:
    return str(model_dir(tmp_path / "model", standard_config()))


async def served(*workers: Any) -> list[int]:
    return [(await fw.state())["requests"] for fw in workers]


async def test_chat_text_and_token_id_prompts_route_by_the_hf_tokens(model: str) -> None:
    # What the engine would see for the chat: the template rendered, tokenized without
    # special tokens (the template writes <s> itself). Written out here, not by the router.
    chat_ids = hf_ids(f"<s><|user|> {CONTENT}</s><|assistant|>", special=False)
    assert len(chat_ids) == 44 and chat_ids[0] == build_tokenizer().token_to_id("<s>")
    text = "the quick brown fox jumps over the lazy dog " * 4
    text_ids = hf_ids(text, special=True)  # a completion prompt gets BOS from the tokenizer
    prompt_ids = hf_ids("you are a helpful assistant " * 8, special=False)
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
        # Two whole blocks of each prompt, each on its own worker.
        await rt.wait_cursor(a.url, 0, await a.store([chat_ids[: 2 * BS]]))
        await rt.wait_cursor(b.url, 0, await b.store([text_ids[: 2 * BS]]))
        await rt.wait_cursor(c.url, 0, await c.store([prompt_ids[: 2 * BS]]))
        before = await served(a, b, c)

        status, body, headers = await rt.post(
            "/v1/chat/completions",
            {"model": "fake-model", "messages": [{"role": "user", "content": CONTENT}]},
        )
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


@contextlib.asynccontextmanager
async def recording_worker() -> AsyncIterator[tuple[str, list[tuple[str, bytes]]]]:
    """An engine that records every generation request's path and raw body, answers 200."""
    seen: list[tuple[str, bytes]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, await request.read()))
        return web.json_response({"id": "x", "choices": []})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
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
    # A template that refuses the conversation is the client's error too, not a 500.
    strict = dict(standard_config())
    strict["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('the first turn must be the user') }}{% endif %}"
        + strict["chat_template"]
    )
    refusing = str(model_dir(tmp_path / "strict", strict))
    async with router_on_recorder(refusing) as (rt, seen):
        status, payload, _ = await rt.post(
            "/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]}
        )
        assert status == 400
        assert payload["error"]["param"] == "messages"
        assert "the first turn must be the user" in payload["error"]["message"]
        status, _, _ = await rt.post(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200
        assert len(seen) == 1
