"""A sibling's 3xx is a failed answer, never followed: the decision posts (`router.siblings`)
and the placement questions (`router.placement`) went, body and all, wherever a sibling's
redirect pointed (aiohttp drops the token across origins, not the request)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from router.placement import Placement, PlacementAsker
from router.policy import CacheAware, make_policy
from router.siblings import DecisionSharing
from tests.support.adversary import stub_server

TOKEN = "sibling-token-0123456789"


@contextlib.asynccontextmanager
async def redirecting_sibling() -> AsyncIterator[tuple[str, list[str]]]:
    """A sibling answering every POST with a 307 to another server; yields its URL and the
    Authorization headers that other server got."""
    seen: list[str] = []

    async def target(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.Response(status=204)

    async with stub_server({("*", "/{tail:.*}"): target}) as other:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPTemporaryRedirect(other + request.path)

        async with stub_server({("POST", "/{tail:.*}"): redirect}) as url:
            yield url, seen


async def test_a_siblings_redirect_of_a_decision_post_is_a_failed_post_not_followed() -> None:
    async with redirecting_sibling() as (sibling, seen), aiohttp.ClientSession() as session:
        sharing = DecisionSharing(
            session, lambda: [sibling], TOKEN, lambda *a: None, lambda rank: True
        )
        assert await sharing._post(sibling, b"batch") is False
    assert seen == []


async def test_a_placers_redirect_is_no_answer_and_is_not_followed() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    async with redirecting_sibling() as (placer, seen), aiohttp.ClientSession() as session:
        rules = Placement(policy, "http://127.0.0.1:65535", lambda: [placer])
        asker = PlacementAsker(session, TOKEN, rules, 2.0)
        rules.asking += 1  # as `Placement.question` counts a question it sends
        assert await asker.ask(placer, b"\x93\x20\x10\x91\x0b") is None
    assert seen == []
