"""What the router reads of a request body on its event loop is bounded, whatever the body.

A 30 MiB chat of 10.5M empty content parts held the loop 4.6 s and turned `/healthz` 503: the
router decoded and walked all of it in the parser callback. A body holding more JSON values or
object keys than any real request is now forwarded unread, routed by load as a miss and
counted (`bodies_unread`; a chat's in `tokenize_failures{reason="too_large"}` too); a chat
past the part count or the JSON a template dumps is too; a text is keyed by its first
`MAX_ENCODED_CHARS` with every tokenizer.
The largest real requests route exactly as before: every block keyed, every block matched.
Real sockets: a replica in process, scripted or fake workers on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from cachetree.keys import block_keys
from router.dataplane.routing import MAX_BODY_VALUES
from router.policy import Decision
from router.tokenize import BytesTokenizer, render_chat_plain
from router.tokenize.chat_rules import MAX_CHAT_MESSAGES, MAX_CHAT_PARTS
from router.tokenize.params import MAX_ENCODED_CHARS
from tests.support.body_shapes import CHAT, COMPLETIONS, HOSTILE, REAL
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import RouterHandle, router_in_process
from tests.support.scripted_worker import ScriptedWorker, scripted_worker
from tests.support.waiting import eventually

BLOCK = 16
CACHE_BLOCKS = 1 << 16  # room for the longest prompt's 32,768 blocks


async def routable(rt: RouterHandle, *workers: ScriptedWorker) -> None:
    urls = {w.url for w in workers}
    await eventually(lambda: {w.url for w in rt.replica.workers.routable()} >= urls, 10)


async def post_raw(rt: RouterHandle, route: str, raw: bytes) -> int:
    headers = {"Content-Type": "application/json"}
    async with rt.session.post(rt.url + route, data=raw, headers=headers) as resp:
        await resp.read()
        return resp.status


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_bodies_past_the_decode_bounds_are_forwarded_unread_by_load_and_counted(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        scripted_worker() as a,
        scripted_worker() as b,
        router_in_process(workers=[a.url, b.url], policy=policy) as rt,
    ):
        await routable(rt, a, b)
        metrics = rt.plane.router.metrics
        with caplog.at_level(logging.WARNING, logger="router.dataplane.routing"):
            for name, (route, raw) in HOSTILE.items():
                assert await post_raw(rt, route, raw) == 200, name
                # Byte for byte to one worker: the engine validates what the router did not.
                sent = [p.body for p in (*a.posts(), *b.posts())]
                assert sent.count(raw) == 1, name
        assert len(sent) == len(HOSTILE)
        by_route = Counter(route for route, _ in HOSTILE.values())
        assert {route: n for (route,), n in metrics.bodies_unread.items() if n} == by_route
        # Only chats are tokenize failures: the alert on them divides by chat requests.
        assert metrics.tokenize_failures[("too_large",)] == by_route[CHAT] < len(HOSTILE)
        assert metrics.decisions[policy, "cache_hit"] == 0
        unread = [r for r in caplog.records if "forwarded unread" in r.getMessage()]
        assert len(unread) == 1  # once, naming the bound and what to look for
        assert "JSON values" in unread[0].getMessage()
        assert "look for the client" in unread[0].getMessage()


async def test_a_body_past_the_bounds_is_not_refused_for_what_the_engine_would_refuse() -> None:
    """Unread, its 400s are the engine's: a body of a million ids with no `prompt` at all."""
    raw = b'{"not_a_prompt":[' + b",".join([b"1"] * (MAX_BODY_VALUES + 1)) + b"]}"
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w)
        assert await post_raw(rt, COMPLETIONS, raw) == 200
        assert [p.body for p in w.posts()] == [raw]


async def test_chats_past_the_counts_are_forwarded_routed_by_load_and_counted() -> None:
    """The tokenizer's bounds (messages, parts and tool calls), under the default `bytes`
    tokenizer too, which rendered a chat of any count."""
    user = {"role": "user", "content": "hi"}
    parts = [{"type": "text", "text": "a"}] * (MAX_CHAT_PARTS + 1)
    bodies = [
        {"messages": [user] * (MAX_CHAT_MESSAGES + 1), "max_tokens": 1},
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
    ]
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w)
        for body in bodies:
            status, _, _ = await rt.post(CHAT, body)
            assert status == 200
        assert len(w.posts()) == len(bodies)
        assert rt.plane.router.metrics.tokenize_failures[("too_large",)] == len(bodies)


def expected_ids(route: str, body: dict[str, Any]) -> bytes | list[int]:
    """The engine's ids by the `bytes` tokenizer's written rule (the fake worker's), the first
    of a batch; text keyed up to `MAX_ENCODED_CHARS`."""
    encode = BytesTokenizer().encode_bytes
    if route == CHAT:
        return encode(render_chat_plain(body["messages"])[:MAX_ENCODED_CHARS])
    prompt = body["prompt"]
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return encode(prompt[:MAX_ENCODED_CHARS]) if isinstance(prompt, str) else prompt


@contextlib.asynccontextmanager
async def second_worker_holding(ids: Any) -> AsyncIterator[tuple[RouterHandle, str]]:
    """A replica over two fake workers, the second holding `ids`' blocks (its cursor there):
    the replica, the second worker's URL."""
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as a,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as b,
        router_in_process(workers=[a.url, b.url]) as rt,
    ):
        for fw in (a, b):
            await rt.gate(fw)
        await rt.wait_cursor(b.url, 0, await b.store([list(ids)]))
        yield rt, b.url


@pytest.mark.parametrize("name", REAL)
async def test_the_largest_real_requests_key_and_match_every_block(name: str) -> None:
    route, body = REAL[name]
    ids = expected_ids(route, body)
    async with second_worker_holding(ids) as (rt, b_url):
        router = rt.plane.router
        decision = router.route(route.encode(), msgspec.json.encode(body))
        assert isinstance(decision, Decision)
        assert decision.prompt is not None
        blocks = len(ids) // BLOCK
        assert decision.prompt.keys == block_keys(ids, BLOCK)
        assert (decision.ranked[0].rank.worker_url, decision.matched_blocks) == (b_url, blocks)
        assert router.metrics.tokenize_failures[("too_large",)] == 0


async def test_a_text_prompt_past_the_encoded_bound_is_keyed_by_its_first_part() -> None:
    """30M characters keyed by the `bytes` tokenizer held the loop 0.9 s: like a model's
    tokenizer, it keys the first `MAX_ENCODED_CHARS`, which are the engine's first blocks."""
    text = "a quick brown fox. " * (30_000_000 // 19)
    ids = BytesTokenizer().encode_bytes(text[:MAX_ENCODED_CHARS])
    async with second_worker_holding(ids) as (rt, b_url):
        raw = msgspec.json.encode({"prompt": text, "max_tokens": 1})
        decision = rt.plane.router.route(COMPLETIONS.encode(), raw)
        assert isinstance(decision, Decision) and decision.prompt is not None
        assert len(decision.prompt.keys) == MAX_ENCODED_CHARS // BLOCK
        assert (decision.ranked[0].rank.worker_url, decision.matched_blocks) == (
            b_url,
            MAX_ENCODED_CHARS // BLOCK,
        )
