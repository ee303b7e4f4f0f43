"""A long prompt is rendered and encoded in a worker thread, not on the event loop.

A replica with a model directory (`--tokenizer DIR`, a 32k byte-level vocabulary as fast per
token as a real model's) and a worker that records what reaches it, in order. The router runs
in the test's own loop, so what the test observes meanwhile (a ticker, its other requests)
is what the router's loop does while a long prompt encodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the hf extra")

from router.dataplane.encodes import EncodeQueue
from router.dataplane.routing import EncodeFirst
from router.policy import Decision
from router.tokenize.chat_rules import MAX_CHAT_CHARS
from router.tokenize.params import MAX_ENCODED_CHARS
from tests.component.test_router_tokenizer import recording_worker
from tests.support.chat_shapes import SYSTEM, WEATHER_TOOL
from tests.support.fake_worker import fake_worker_in_process
from tests.support.model_dirs import build_model_dir, corpus, fixture_template
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, gate_fleet, router_in_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

SHORT = {"prompt": "hello world " * 8, "max_tokens": 1}


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("offload") / "llama3"
    template = fixture_template("llama3.1_instruct.jinja")
    return str(build_model_dir(root, "llama3", template, big=True))


@pytest.fixture(scope="module")
def raising_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model whose template raises whatever it is given: a chat it counts as `render` was
    rendered, one it counts otherwise was not."""
    root = tmp_path_factory.mktemp("offload") / "raising"
    template = "{{ raise_exception('rendered') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    return str(build_model_dir(root, "qwen", template))


def long_text(tag: str, chars: int = MAX_ENCODED_CHARS) -> str:
    """`chars` characters of prose, starting with `tag` (so no two requests share blocks)."""
    words = " ".join(corpus(2000))
    text = f"{tag} " + words * (chars // len(words) + 1)
    return text[:chars]


@contextlib.asynccontextmanager
async def recorded_router(
    model: str, **config: Any
) -> AsyncIterator[tuple[RouterHandle, list[tuple[str, bytes]]]]:
    async with (
        recording_worker() as (url, seen),
        router_in_process(
            workers=[url], tokenizer=model, kv_events_port_base=free_tcp_port(), **config
        ) as rt,
    ):
        await eventually(lambda: rt.plane.router.rules.tree is not None)
        yield rt, seen


def prompts_seen(seen: list[tuple[str, bytes]]) -> list[str]:
    """The first word of each prompt the worker received, in order."""
    return [json.loads(raw)["prompt"].split(" ", 1)[0] for _, raw in seen]


async def raw_post(path: str, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


async def leave_while_held(rt: RouterHandle, tag: str) -> None:
    """A client sends a long prompt and leaves while the replica holds its encode: its slot
    is free again once this returns."""
    held = rt.plane.encodes.held
    before = held.count
    host, port = rt.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(await raw_post("/v1/completions", {"prompt": long_text(tag)}))
    await eventually(lambda: held.count == before + 1, within_s=10)
    writer.close()
    await eventually(lambda: held.count == before, within_s=10)


def cache_misses(rt: RouterHandle) -> float | None:
    """The replica's cache_aware decisions that found no cached prefix (routed by load)."""
    labels = {"policy": "cache_aware", "outcome": "cache_miss"}
    return rt.replica.metrics.registry.get_sample_value("kvrouter_routing_decisions_total", labels)


async def test_short_requests_are_answered_while_a_long_prompt_encodes(big_model: str) -> None:
    async with recorded_router(big_model) as (rt, seen):
        encodes = rt.plane.encodes
        long = asyncio.create_task(rt.post("/v1/completions", {"prompt": long_text("LONG")}))
        await eventually(lambda: encodes.started == 1, within_s=10)
        # Other connections, while the long prompt is in its worker thread.
        for tag in ("ONE", "TWO"):
            status, _, _ = await rt.post("/v1/completions", {**SHORT, "prompt": f"{tag} hi"})
            assert status == 200
        assert prompts_seen(seen) == ["ONE", "TWO"]  # the long one is still encoding
        status, _, _ = await long
        assert status == 200
        assert prompts_seen(seen) == ["ONE", "TWO", "LONG"]
        assert (encodes.started, encodes.busy, encodes.held.count) == (1, 0, 0)


async def ticks_while_encoding(rt: RouterHandle, body: dict[str, Any]) -> int:
    """How many times a 1 ms ticker ran while `body`'s encode was held off the loop (queued
    or in its thread): none when it is encoded on the loop, which runs nothing meanwhile."""
    loop = asyncio.get_running_loop()
    held = rt.plane.encodes.held
    ticks = 0

    def tick() -> None:
        nonlocal ticks, handle
        ticks += held.count > 0
        handle = loop.call_later(0.001, tick)

    handle = loop.call_later(0.001, tick)
    try:
        status, _, _ = await rt.post("/v1/completions", body)
    finally:
        handle.cancel()
    assert status == 200
    return ticks


async def test_the_loop_keeps_turning_while_a_long_prompt_encodes(big_model: str) -> None:
    # Counted turns, not timed gaps: on a busy machine a gap measures the scheduler. The
    # encode of a prompt this long takes ~100 ms or more, the ticker's period 1 ms.
    async with recorded_router(big_model) as (rt, _):
        router = rt.plane.router
        router.offload_chars = 0  # on the loop, as before: the yardstick
        assert await ticks_while_encoding(rt, {"prompt": long_text("SYNC")}) == 0
        router.offload_chars = 8192
        assert await ticks_while_encoding(rt, {"prompt": long_text("OFFLOADED")}) >= 10
        assert rt.plane.encodes.started == 1


CHAT_WITH_TOOLS = {
    "messages": [
        {**SYSTEM, "content": "You are a helpful assistant. " * 400},
        {"role": "user", "content": "What is the weather in Paris today? " * 300},
    ],
    "tools": [WEATHER_TOOL],
}
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": long_text("plain", 20_000)}),
    ("/v1/completions", {"prompt": long_text("nospecial", 20_000), "add_special_tokens": False}),
    ("/v1/completions", {"prompt": long_text("cut", 20_000), "truncate_prompt_tokens": 1000}),
    ("/v1/completions", {"prompt": long_text("past", MAX_ENCODED_CHARS + 5000)}),
    ("/v1/completions", {"prompt": [long_text("batch", 20_000), "second"]}),
    ("/generate", {"text": long_text("sglang", 20_000)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text("chat")}]}),
    ("/v1/chat/completions", CHAT_WITH_TOOLS),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": long_text("cont", 20_000)},
                {"role": "assistant", "content": "The answer"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ),
]


async def test_a_prompt_encoded_off_the_loop_has_the_keys_of_the_synchronous_path(
    big_model: str,
) -> None:
    async with recorded_router(big_model) as (rt, _):
        router = rt.plane.router
        for path, body in BODIES:
            raw = json.dumps(body).encode()
            router.offload_chars = 0
            synchronous = router.route(path.encode(), raw)
            router.offload_chars = 8192
            first = router.route(path.encode(), raw)
            assert isinstance(first, EncodeFirst), path
            ids = await asyncio.to_thread(first.work.run)
            offloaded = first.work.then(lambda ids=ids: ids)
            assert isinstance(synchronous, Decision) and isinstance(offloaded, Decision)
            assert synchronous.prompt is not None and offloaded.prompt is not None
            assert len(synchronous.prompt.keys) >= 10, path
            assert list(offloaded.prompt.keys) == list(synchronous.prompt.keys), path
            assert offloaded.prompt.tokens == synchronous.prompt.tokens, path
        assert rt.replica.metrics.tokenize_failures.total() == 0


async def test_pipelined_requests_behind_a_long_prompt_are_answered_in_order(
    big_model: str,
) -> None:
    async with recorded_router(big_model) as (rt, seen):
        host, port = rt.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            pipelined = [
                await raw_post("/v1/completions", {"prompt": long_text("FIRST")}),
                await raw_post("/v1/completions", {**SHORT, "prompt": "SECOND hi"}),
                await raw_post("/v1/completions", {**SHORT, "prompt": "THIRD hi"}),
            ]
            writer.write(b"".join(pipelined))
            await eventually(lambda: rt.plane.encodes.started == 1, within_s=10)
            # Another connection goes ahead; this one's requests wait for the first.
            status, _, _ = await rt.post("/v1/completions", {**SHORT, "prompt": "OTHER hi"})
            assert status == 200
            assert prompts_seen(seen) == ["OTHER"]
            for _ in pipelined:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
        finally:
            writer.close()
        assert prompts_seen(seen) == ["OTHER", "FIRST", "SECOND", "THIRD"]


async def test_past_the_bound_a_long_prompt_is_routed_by_load_and_counted(big_model: str) -> None:
    async with recorded_router(big_model) as (rt, seen):
        encodes = rt.plane.encodes
        encodes.most = 1
        first = asyncio.create_task(rt.post("/v1/completions", {"prompt": long_text("FIRST")}))
        await eventually(lambda: encodes.held.count == 1, within_s=10)
        status, _, _ = await rt.post("/v1/completions", {"prompt": long_text("SECOND")})
        assert status == 200
        assert prompts_seen(seen) == ["SECOND"]  # not encoded at all: no wait for a slot
        assert (await first)[0] == 200
        assert (encodes.started, encodes.busy) == (1, 1)
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_tokenize_offloads_total", outcome="busy") == 1
        assert scrape.value("kvrouter_tokenize_offloads_total", outcome="started") == 1
        assert cache_misses(rt) == 2


async def test_a_client_that_leaves_while_its_prompt_encodes_frees_its_slot_and_counts_gone(
    big_model: str,
) -> None:
    """It was counted nowhere: only `tokenize_offloads{started}` moved, where a client that
    leaves after routing counts in `answers_broken{outcome="gone"}`."""
    async with recorded_router(big_model) as (rt, seen):
        encodes = rt.plane.encodes
        encodes.most = 1
        await leave_while_held(rt, "GONE")
        status, _, _ = await rt.post("/v1/completions", {"prompt": long_text("STAYED")})
        assert status == 200
        assert (encodes.started, encodes.busy) == (2, 0)
        assert prompts_seen(seen) == ["STAYED"]  # the one whose client left was never sent
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_answers_broken_total", outcome="gone") == 1
        assert sum(scrape.series("kvrouter_requests_total").values()) == 1  # STAYED's


async def test_the_bytes_tokenizer_never_offloads() -> None:
    async with recorded_router("bytes") as (rt, seen):
        status, _, _ = await rt.post("/v1/completions", {"prompt": long_text("BYTES")})
        assert status == 200
        assert prompts_seen(seen) == ["BYTES"]
        assert rt.plane.encodes.started == 0


async def test_a_drain_waits_for_a_prompt_being_encoded(big_model: str) -> None:
    async with recorded_router(big_model) as (rt, seen):
        long = asyncio.create_task(rt.post("/v1/completions", {"prompt": long_text("LONG")}))
        await eventually(lambda: rt.plane.encodes.started == 1, within_s=10)
        assert await rt.serving.drain(30.0)
        # Drained means answered: the request was not left to be cut by the shutdown.
        assert prompts_seen(seen) == ["LONG"]
        assert (await long)[0] == 200


async def test_a_long_prompt_encoded_off_the_loop_goes_to_a_worker_serving_its_model(
    big_model: str,
) -> None:
    """The decision after the encode reads the ranks healthy then, of the workers serving the
    model the request names (`router.model_servers`): read afresh from every rank, half the
    m2 prompts went to the m1 worker, a 404."""
    async with (
        fake_worker_in_process(model="m1") as a,
        fake_worker_in_process(model="m2") as b,
        router_in_process(workers=[a.url, b.url], tokenizer=big_model) as rt,
    ):
        await gate_fleet([rt], [a, b])
        for i in range(6):
            body = {"model": "m2", "prompt": long_text(f"M2-{i}", 20_000), "max_tokens": 1}
            status, answer, _ = await rt.post("/v1/completions", body)
            assert status == 200, answer
        assert rt.plane.encodes.started == 6
        served = [(await fw.state())["requests"] for fw in (a, b)]
        assert served == [0, 6]


def chat_of(tag: str, chars: int, messages: int = 100) -> dict[str, Any]:
    """`messages` user messages of `chars` characters of content in all, the first `tag`."""
    each = chars // messages
    return {
        "prompt_tag": tag,
        "messages": [
            {"role": "user", "content": (f"{tag} " if i == 0 else "") + "x" * each}
            for i in range(messages)
        ],
    }


async def test_a_chat_past_the_text_bound_is_routed_by_load_without_being_rendered(
    raising_model: str,
) -> None:
    """DeepSeek-V3.1's template joins system messages in time quadratic in their count: 8,000
    of 1.5 KB held a tokenize thread 17.9 s, and two such chats every long prompt behind them.
    A chat of more text than MAX_CHAT_CHARS is not rendered at all."""
    async with recorded_router(raising_model, max_request_bytes=8 << 20) as (rt, seen):
        for tag, chars in (("UNDER", MAX_CHAT_CHARS // 2), ("OVER", MAX_CHAT_CHARS + 1000)):
            status, _, _ = await rt.post("/v1/chat/completions", chat_of(tag, chars))
            assert status == 200
        assert [json.loads(raw)["prompt_tag"] for _, raw in seen] == ["UNDER", "OVER"]
        scrape = await rt.scrape()
        failures = scrape.by("kvrouter_tokenize_failures_total", "reason")
        assert {k: v for k, v in failures.items() if v} == {"render": 1, "too_large": 1}
        assert cache_misses(rt) == 2


async def test_a_long_prompt_no_thread_takes_in_time_is_routed_by_load_and_never_encoded(
    big_model: str,
) -> None:
    """Two chats a slow template renders for seconds each held both threads, and the long
    prompts behind them waited for their turn: an ordinary 10 KB chat 205 s. One whose encode
    has not started within MAX_ENCODE_WAIT_S is routed without its ids, and its encode
    dropped; one whose client leaves first is dropped at once."""
    async with recorded_router(big_model) as (rt, seen):
        encodes = rt.plane.encodes
        release = threading.Event()
        for _ in range(2):  # both threads held, as two slow renders hold them
            assert encodes.submit(release.wait, lambda outcome: None, lambda: None) is not None
        try:
            await eventually(lambda: encodes.started == 2)
            await leave_while_held(rt, "GONE")
            waited = time.perf_counter()
            post = rt.post("/v1/completions", {"prompt": long_text("LATE")})
            status, _, _ = await asyncio.wait_for(post, 10)
            waited = time.perf_counter() - waited
            assert status == 200
            assert encodes.wait_s <= waited < encodes.wait_s + 2, waited
            assert prompts_seen(seen) == ["LATE"]
            assert (encodes.started, encodes.busy, encodes.late) == (2, 0, 1)
        finally:
            release.set()
        await eventually(lambda: encodes.held.count == 0, within_s=10)
        assert encodes.started == 2  # neither queued encode ran once the threads were free
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_tokenize_offloads_total", outcome="late") == 1
        assert cache_misses(rt) == 1


async def test_a_closed_queue_runs_nothing_more_and_routes_what_comes_late() -> None:
    """The executor it replaced refused work once shut down; a thread of its own each would
    have started anyway, for a replica that stopped."""
    encodes = EncodeQueue(asyncio.get_running_loop(), wait_s=0.01)
    encodes.close()
    ran: list[str] = []
    encodes.submit(lambda: ran.append("run"), lambda outcome: None, lambda: ran.append("late"))
    await eventually(lambda: ran)
    assert ran == ["late"]
    assert (encodes.started, encodes.late, encodes.held.count) == (0, 1, 0)
