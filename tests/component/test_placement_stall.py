"""An asker whose own process stalls while its question is answered (`router.placement`,
`Deadline`): the answer that came meanwhile is read, not dropped as a timeout.

The placer is a stub on real HTTP in a thread of its own (its own event loop), so it answers
while the asker's loop is held: on each question it first holds the asker's loop for 150 ms
(a blocking call scheduled there, as a process the OS does not run for a while, or a long
callback, would), then answers 10 ms later, inside the stall. The asker's timeout is 50 ms."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest
from aiohttp import web

from cachetree.ranks import RankId
from router import placement
from router.placement import Placement, PlacementAsker, encode_answer
from router.policy import CacheAware, make_policy

pytestmark = pytest.mark.timeout(20)

RANK = RankId("http://127.0.0.1:9", 0)
STALL_S = 0.15
TIMEOUT_S = 0.05


@contextlib.contextmanager
def placer_that_stalls(asker_loop: asyncio.AbstractEventLoop) -> Iterator[str]:
    """A placer in its own thread; yields its URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []

    async def place(request: web.Request) -> web.Response:
        await request.read()
        asker_loop.call_soon_threadsafe(time.sleep, STALL_S)
        await asyncio.sleep(0.01)  # answered while the asker is held
        return web.Response(body=encode_answer(RANK), content_type=placement.CONTENT_TYPE)

    async def serve() -> web.AppRunner:
        app = web.Application()
        app.router.add_post(placement.PATH, place)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner = loop.run_until_complete(serve())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10), "the stub placer did not start"
    try:
        yield url[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextlib.asynccontextmanager
async def stub_placer(
    answer: Callable[[web.Request], Awaitable[web.Response]],
) -> AsyncIterator[str]:
    """A placer on this loop answering every question as `answer` does: its URL."""
    app = web.Application()
    app.router.add_post(placement.PATH, answer)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_an_answer_that_came_while_the_asker_stalled_is_used_not_timed_out() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    with placer_that_stalls(asyncio.get_running_loop()) as placer:
        rules = Placement(policy, "http://127.0.0.1:65535", lambda: [placer])
        async with aiohttp.ClientSession() as session:
            asker = PlacementAsker(session, "token", rules, TIMEOUT_S)
            for _ in range(3):  # each question stalls the asker past its deadline
                rules.asking += 1  # as `Placement.question` counts a question it sends
                started = time.monotonic()
                rank = await asker.ask(placer, b"\x93\x20\x10\x91\x0b")
                waited = time.monotonic() - started
                assert rank == RANK
                assert waited >= STALL_S > TIMEOUT_S  # the deadline passed while stalled
    # Each was read past its timeout: counted `late`, none a timeout.
    assert (rules.counts["late"], rules.counts["timeout"], rules.counts["error"]) == (3, 0, 0)
    assert rules.asking == 0


async def test_a_placer_that_never_answers_still_times_out_within_the_bound() -> None:
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        raise AssertionError("unreachable")

    async with stub_placer(hang) as placer:
        rules = Placement(policy, "http://127.0.0.1:65535", lambda: [placer])
        async with aiohttp.ClientSession() as session:
            asker = PlacementAsker(session, "token", rules, TIMEOUT_S)
            rules.asking += 1
            loop = asyncio.get_running_loop()
            started = loop.time()
            # A stall of this loop in mid-wait lengthens it, to at most 4 timeouts in all.
            loop.call_later(0.01, time.sleep, 0.5)
            assert await asker.ask(placer, b"\x93\x20\x10\x91\x0b") is None
            waited = loop.time() - started
    assert waited < 0.5 + placement.MAX_WAIT_FACTOR * TIMEOUT_S
    assert (rules.counts["timeout"], rules.counts["late"], rules.asking) == (1, 0, 0)


async def test_a_placer_silent_past_the_timeout_is_waited_for_until_a_question_fails() -> None:
    """A placer that answered the latest question and is silent now is stalled, not gone:
    the asker waits on past its timeout (to 4 timeouts) and reads the answer. Once one
    question failed, the next gives up at its timeout, so a placer gone costs one long wait."""
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    delays = [0.1, 0.1, 1.0, 1.0]  # the placer's silence on each question, in turn

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delays.pop(0))
        return web.Response(body=encode_answer(RANK), content_type=placement.CONTENT_TYPE)

    loop = asyncio.get_running_loop()
    waits: list[float] = []
    ranks: list[RankId | None] = []
    async with stub_placer(slow) as placer:
        rules = Placement(policy, "http://127.0.0.1:65535", lambda: [placer])
        async with aiohttp.ClientSession() as session:
            asker = PlacementAsker(session, "token", rules, TIMEOUT_S)
            for _ in range(4):
                rules.asking += 1
                started = loop.time()
                ranks.append(await asker.ask(placer, b"\x93\x20\x10\x91\x0b"))
                waits.append(loop.time() - started)
    bound = placement.MAX_WAIT_FACTOR * TIMEOUT_S
    # Silent 100 ms, past the 50 ms timeout, after an answer (or before any): waited for.
    assert ranks[:2] == [RANK, RANK] and all(0.1 <= w < bound for w in waits[:2])
    # Silent for a second: waited to the bound, then a failure; the next one gave up at its
    # timeout.
    assert ranks[2:] == [None, None]
    assert bound <= waits[2] < bound + 0.1 and TIMEOUT_S <= waits[3] < bound
    assert (rules.counts["late"], rules.counts["timeout"], rules.asking) == (2, 2, 0)


async def test_an_answer_sent_in_two_parts_is_read_whole() -> None:
    """A placer (or the network) that sends its answer in two segments: the asker reads to
    the body's end, not what the first segment brought."""
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    raw = encode_answer(RANK)

    async def in_two_parts(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": placement.CONTENT_TYPE})
        response.content_length = len(raw)
        await response.prepare(request)
        await response.write(raw[:5])
        await asyncio.sleep(0.005)  # a slow link: the rest comes in a segment of its own
        await response.write(raw[5:])
        return response

    async with stub_placer(in_two_parts) as placer:
        rules = Placement(policy, "http://127.0.0.1:65535", lambda: [placer])
        async with aiohttp.ClientSession() as session:
            asker = PlacementAsker(session, "token", rules, 1.0)
            rules.asking += 1
            assert await asker.ask(placer, b"\x93\x20\x10\x91\x0b") == RANK
    assert rules.counts["error"] == 0, rules.counts
