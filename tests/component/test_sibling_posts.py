"""What this replica's posts to its siblings do when a sibling misbehaves: a 3xx is a failed
answer, never followed (the decision posts and the placement questions went, body and all,
wherever a sibling's redirect pointed; aiohttp drops the token across origins, not the
request), and a stalled or garbled sibling holds no other sibling's decisions back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from cachetree.ranks import RankId
from router import siblings
from router.placement import Placement, PlacementAsker
from router.policy import CacheAware, make_policy
from router.siblings import DecisionSharing
from tests.support.adversary import stub_server
from tests.support.waiting import eventually

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


@contextlib.asynccontextmanager
async def siblings_answering(
    **answers: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[dict[str, str]]:
    """A sibling per keyword, answering decision posts as its handler does: name -> URL."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {
            name: await stack.enter_async_context(stub_server({("POST", siblings.PATH): answer}))
            for name, answer in answers.items()
        }
        yield urls


async def test_every_decision_reaches_a_sibling_slower_than_they_come_and_garbage_harms_none() -> (
    None
):
    """Decisions that come while a post is out go in the next batch, to every sibling: none is
    lost to a sibling that takes 20 ms a post (posting to each apart lost 42% of them). A
    sibling answering 200 with a binary body raised in the sharing task, which the supervisor
    restarted with a growing backoff, and a 64 MiB body was read whole to log 200 characters."""
    got: list[int] = []
    decode = DecisionSharing(None, list, TOKEN, lambda *a: None, lambda r: True).decode  # type: ignore[arg-type]

    async def slow(request: web.Request) -> web.Response:
        got.append(len(decode(await request.read()).decisions))
        await asyncio.sleep(0.02)
        return web.Response(status=204)

    async def binary(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(status=200)
        await answer.prepare(request)
        for _ in range(64):  # 64 MiB of bytes that are no UTF-8
            await answer.write(b"\xff\xfe" * (512 * 1024))
        return answer

    async with (
        siblings_answering(slow=slow, binary=binary) as urls,
        aiohttp.ClientSession() as session,
    ):
        sharing = DecisionSharing(
            session, lambda: list(urls.values()), TOKEN, lambda *a: None, lambda rank: True
        )
        sharing.timeout_s = 10.0
        running = asyncio.create_task(sharing.run())
        try:
            for n in range(50):
                sharing.share(RankId("http://w:1", 0), [3 * n + 1, 3 * n + 2], 0)
                await asyncio.sleep(0.002)  # faster than the sibling takes them
            await eventually(lambda: sum(got) == 50, 10)
            assert len(got) < 50  # batched, not one post each
            assert not running.done()  # the binary body raised nothing
            assert sharing.stats.failed >= 1
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_stalled_sibling_holds_back_no_other_siblings_decisions() -> None:
    """A sibling that takes a post and never answers (a stopped process still accepts) holds
    back its own decisions for the post timeout, not another sibling's: each sibling's posts
    go out in a lane of their own. (All siblings' posts were awaited together, so every
    decision after the first waited for the stalled one's timeout.)"""
    got: list[int] = []
    stalled_posts = 0
    release = asyncio.Event()
    decode = DecisionSharing(None, list, TOKEN, lambda *a: None, lambda r: True).decode  # type: ignore[arg-type]

    async def healthy(request: web.Request) -> web.Response:
        got.extend(k for d in decode(await request.read()).decisions for k in d.keys)
        return web.Response(status=204)

    async def stalled(request: web.Request) -> web.Response:
        nonlocal stalled_posts
        stalled_posts += 1
        await release.wait()
        return web.Response(status=204)

    async with (
        siblings_answering(healthy=healthy, stalled=stalled) as urls,
        aiohttp.ClientSession() as session,
    ):
        sharing = DecisionSharing(
            session, lambda: list(urls.values()), TOKEN, lambda *a: None, lambda rank: True
        )
        sharing.timeout_s = 60.0  # far past the test's waits: the stalled post stays out
        running = asyncio.create_task(sharing.run())
        try:
            sharing.share(RankId("http://w:1", 0), [1], 0)
            await eventually(lambda: got == [1] and stalled_posts == 1, 5)
            for key in range(2, 12):
                sharing.share(RankId("http://w:1", 0), [key], 0)
                await eventually(lambda key=key: got[-1:] == [key], 5)
            assert got == list(range(1, 12))
            assert stalled_posts == 1  # its next batch waits for its one post out
            assert sharing.stats.sent == 11 and sharing.stats.failed == 0
            release.set()  # the stalled sibling answers: what gathered for it goes in one post
            await eventually(lambda: stalled_posts == 2 and sharing.stats.sent == 22, 5)
        finally:
            release.set()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_sibling_gone_from_the_registry_gets_no_more_posts_a_new_one_the_next() -> None:
    got: dict[str, list[int]] = {"one": [], "two": []}
    decode = DecisionSharing(None, list, TOKEN, lambda *a: None, lambda r: True).decode  # type: ignore[arg-type]

    def taking(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def take(request: web.Request) -> web.Response:
            got[name].extend(k for d in decode(await request.read()).decisions for k in d.keys)
            return web.Response(status=204)

        return take

    async with (
        siblings_answering(one=taking("one"), two=taking("two")) as urls,
        aiohttp.ClientSession() as session,
    ):
        peers = [urls["one"]]
        sharing = DecisionSharing(session, lambda: peers, TOKEN, lambda *a: None, lambda r: True)
        running = asyncio.create_task(sharing.run())
        try:
            sharing.share(RankId("http://w:1", 0), [1], 0)
            await eventually(lambda: got["one"] == [1], 5)
            peers[:] = [urls["two"]]  # one left the registry, two joined
            sharing.share(RankId("http://w:1", 0), [2], 0)
            # `sent` counts a post once its answer is read, which may be a turn after the
            # sibling's handler took it.
            await eventually(lambda: got["two"] == [2] and sharing.stats.sent == 2, 5)
            assert got["one"] == [1]
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_sibling_gone_from_the_registry_leaves_no_failure_or_log_time_behind() -> None:
    """A rollout replaces every pod, each at a new address: the times kept per failing
    sibling (its backoff, its last warning) stayed for good, a few more each rollout."""
    got: list[int] = []
    decode = DecisionSharing(None, list, TOKEN, lambda *a: None, lambda r: True).decode  # type: ignore[arg-type]

    async def refusing(request: web.Request) -> web.Response:
        return web.Response(status=503, text="going away")

    async def taking(request: web.Request) -> web.Response:
        got.extend(k for d in decode(await request.read()).decisions for k in d.keys)
        return web.Response(status=204)

    async with (
        siblings_answering(old=refusing, new=taking) as urls,
        aiohttp.ClientSession() as session,
    ):
        peers = [urls["old"]]
        sharing = DecisionSharing(session, lambda: peers, TOKEN, lambda *a: None, lambda r: True)
        running = asyncio.create_task(sharing.run())
        try:
            sharing.share(RankId("http://w:1", 0), [1], 0)
            await eventually(lambda: sharing.stats.failed == 1, 5)
            assert set(sharing._failing) == set(sharing._warned) == {urls["old"]}
            peers[:] = [urls["new"]]  # rolled: the old pod left, its successor joined
            sharing.share(RankId("http://w:1", 0), [2], 0)
            await eventually(lambda: got == [2], 5)
            assert sharing._failing == {} and sharing._warned == {}
            assert sharing.stats.failed == 1 and sharing.stats.sent == 1
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


async def test_a_stalled_siblings_lane_drops_its_oldest_past_the_bound_and_counts_them() -> None:
    release = asyncio.Event()
    posts = 0

    async def stalled(request: web.Request) -> web.Response:
        nonlocal posts
        posts += 1
        await release.wait()
        return web.Response(status=204)

    async with siblings_answering(stalled=stalled) as urls, aiohttp.ClientSession() as session:
        sharing = DecisionSharing(
            session,
            lambda: list(urls.values()),
            TOKEN,
            lambda *a: None,
            lambda rank: True,
            outbox=siblings.Outbox(max_pending_keys=3),
        )
        sharing.timeout_s = 60.0
        running = asyncio.create_task(sharing.run())
        try:
            sharing.share(RankId("http://w:1", 0), [1], 0)
            await eventually(lambda: posts == 1, 5)  # out, and stalled
            for key in range(2, 12):  # ten more while it stalls: its lane holds three
                sharing.share(RankId("http://w:1", 0), [key], 0)
                await eventually(lambda key=key: sharing.stats.dropped == max(key - 4, 0), 5)
            assert sharing.stats.dropped == 7
        finally:
            release.set()
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
