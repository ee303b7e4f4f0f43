"""`router.control.ModelListings` over real sockets: what the replica's own `/v1/models` says in
its log of the workers' reads that fail."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from router.control import MODELS_LOG_EVERY_S, ModelListings
from tests.support.adversary import stub_server
from tests.support.clock import ManualClock


async def refusing(request: web.Request) -> web.Response:
    """An engine run with `--api-key`: every key but its own is refused."""
    return web.json_response({"error": {"message": "wrong key"}}, status=401)


async def failing_with_a_key(request: web.Request) -> web.Response:
    """Refuses a read without a key, fails one with any (a key over its head limit)."""
    return web.json_response({}, status=500 if "Authorization" in request.headers else 401)


async def test_refusals_are_said_at_debug_other_failures_once_a_minute_per_worker_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line per worker per read, at info: 300 calls with made-up keys were 301 lines, and a
    fleet run with `--api-key` logged a line per worker a second in normal use."""
    clock = ManualClock()
    listings = ModelListings(clock=clock)
    async with (
        stub_server({("GET", "/v1/models"): refusing}) as keyed,
        stub_server({("GET", "/v1/models"): failing_with_a_key}) as failing,
        aiohttp.ClientSession() as session,
    ):
        urls = (keyed, failing)
        with caplog.at_level(logging.DEBUG, logger="router.control"):
            for k in range(20):
                status, _ = await listings.answer(session, urls, f"Bearer made-up-{k}")
                assert status == 401  # a failed keyed read keeps the worker's refusal
            clock.advance(MODELS_LOG_EVERY_S)
            status, _ = await listings.answer(session, urls, "Bearer one-more")
            assert status == 401
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 2
    assert f"worker {failing}: /v1/models unreadable 1 time(s)" in said[0]
    assert f"worker {failing}: /v1/models unreadable 20 time(s)" in said[1]
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) >= 2 + 21  # without a key, both; with each key, the first
    assert {r.levelno for r in refusals} == {logging.DEBUG}


async def unreadable(request: web.Request) -> web.Response:
    """An engine whose listing cannot be read (an error, a timeout: the same to the router)."""
    return web.json_response({}, status=500)


async def test_a_refusal_beside_unreadable_workers_is_answered_not_an_empty_list() -> None:
    """With one worker refusing and the other unreadable, the answer was a 200 with an empty
    list, which a client reads as "no model served", where a key would have listed some."""
    listings = ModelListings(clock=ManualClock())
    async with (
        stub_server({("GET", "/v1/models"): refusing}) as keyed,
        stub_server({("GET", "/v1/models"): unreadable}) as broken,
        aiohttp.ClientSession() as session,
    ):
        status, body = await listings.answer(session, (keyed, broken), None)
        assert status == 401
        assert (
            "refused to list its models (401) or could not be read (1)" in body["error"]["message"]
        )
        # None refusing: the unreadable are left out, as always (README).
        status, body = await listings.answer(session, (broken,), None)
        assert (status, body["data"]) == (200, [])
