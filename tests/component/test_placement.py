"""The placement authority end to end (`router.placement`): in-process replicas over real
HTTP and ZMQ in front of fake workers; the placer real, or a stub that is slow or gone.

Each test asserts the cost: which worker served the new prefix, what each replica's ledger
booked, and what the placement counts say."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web

from cachetree.ranks import RankId
from router import placement, siblings
from router.placement import PlaceQuestion, decode_answer, encode_answer, placer_of
from router.policy import CacheAware
from router.serving import serve_until
from tests.component.test_pressure_routing import (
    CACHE_BLOCKS,
    PREFIX_CHARS,
    capacities_known,
    complete,
    prefix,
    two_sharing_replicas,
)
from tests.support.adversary import stub_server
from tests.support.clock import ManualClock
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_port_range, free_tcp_port
from tests.support.router import (
    TEST_TOKEN,
    RouterHandle,
    gate_fleet,
    quiesce,
    router_in_process,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

BLOCKS = PREFIX_CHARS // 16


def policy_of(rt: RouterHandle) -> CacheAware:
    policy = rt.replica.policy
    assert isinstance(policy, CacheAware)
    return policy


def counts(rt: RouterHandle) -> dict[str, int]:
    assert rt.replica.placement is not None
    return dict(rt.replica.placement.counts)


def demand_on(rt: RouterHandle, worker: str, blocks: int, seed: int) -> None:
    """`blocks` of unrelated recent demand on `worker` in this replica's ledger alone."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(63) for _ in range(blocks)]
    policy_of(rt).ledger.record(RankId(worker, 0), keys, held=len(keys))


async def test_a_new_prefix_at_another_replica_goes_where_the_placer_puts_it_both_booking_it() -> (
    None
):
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        # The longest wait: on a loaded host an answer must not come too late for this test.
        one, two = await two_sharing_replicas(stack, [w1, w2], placement_timeout_ms=1000)
        placer, asker = (one, two) if placer_of(one.url, [two.url]) is None else (two, one)
        for rt in (one, two):
            await capacities_known(rt, [w1, w2])
        # Their views differ: the placer sees w1 full of demand, the asker sees w2 so. Alone,
        # the asker would put a new prefix on w1; the placer puts it on w2.
        demand_on(placer, w1.url, 30, seed=1)
        demand_on(asker, w2.url, 30, seed=2)
        r2 = RankId(w2.url, 0)
        before = policy_of(asker).ledger.demand(r2), policy_of(placer).ledger.demand(r2)
        text = prefix(random.Random(7))
        served, cached = await complete(asker, text)
        assert (served, cached) == (w2.url, 0)
        after = policy_of(asker).ledger.demand(r2), policy_of(placer).ledger.demand(r2)
        # Both ledgers count the prefix's blocks on w2: the asker's own booking on the answer,
        # the placer's by its own decision.
        assert after[0] - before[0] == pytest.approx(BLOCKS, abs=1.5)
        assert after[1] - before[1] == pytest.approx(BLOCKS, abs=1.5)
        assert policy_of(placer).ledger.bookings.made == 1
        assert counts(asker)["asked"] == counts(asker)["answered"] == 1
        assert counts(placer)["placed"] == 1
        # A prefix some rank holds is decided where it arrives, without a question.
        await quiesce([one, two], [w1, w2])
        assert await complete(asker, text + " again") == (w2.url, PREFIX_CHARS)
        assert counts(asker)["asked"] == 1
        scrape = await asker.scrape()
        assert scrape.value("kvrouter_placements_total", outcome="answered") == 1
        # The placer decides its own new prefixes: counted local, nothing asked.
        await complete(placer, prefix(random.Random(8)))
        assert counts(placer)["local"] == 1 and counts(placer)["asked"] == 0


async def test_replicas_on_one_host_listed_by_their_control_ports_elect_one_placer() -> None:
    """One shared `--peer` list naming every replica by its `--control-port`, no `--self-url`:
    elected on their main ports, each took itself for the placer (every new prefix `local`)."""
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        base = free_port_range(4)
        listed = [f"http://127.0.0.1:{base + 2 + k}" for k in range(2)]
        replicas = [
            await stack.enter_async_context(
                router_in_process(
                    port=base + k,
                    control_port=base + 2 + k,
                    peer=listed,
                    workers=[w1.url, w2.url],
                    kv_bootstrap_timeout_ms=1000,
                    placement_timeout_ms=1000,
                    expose_route_headers=True,
                )
            )
            for k in range(2)
        ]
        await gate_fleet(replicas, [w1, w2])
        for k, rt in enumerate(replicas):
            await complete(rt, prefix(random.Random(20 + k)))
        local = [counts(rt)["local"] for rt in replicas]
        asked = [counts(rt)["asked"] for rt in replicas]
        # The lower control URL places: its own new prefix local, the other's asked of it.
        assert (local, asked) == ([1, 0], [0, 1])
        assert counts(replicas[0])["placed"] == 1


async def test_the_place_route_refuses_bad_callers_and_bad_questions_booking_nothing() -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        one, _ = await two_sharing_replicas(stack, [w1])
        ledger = policy_of(one).ledger
        url = one.url + placement.PATH
        bearer = {"Authorization": f"Bearer {TEST_TOKEN}"}
        good = msgspec.msgpack.encode(PlaceQuestion(64, 16, [11, 12, 13, 14]))
        cases = [
            ({}, good, 401),  # no token
            ({"Authorization": "Bearer not-the-token"}, good, 401),
            (bearer, b"\x93not msgpack of a question", 400),
            (bearer, msgspec.msgpack.encode(PlaceQuestion(64, 32, [11, 12])), 400),  # block size
            (bearer, msgspec.msgpack.encode(PlaceQuestion(16, 16, [11, 12])), 400),  # tokens
            (bearer, b"\x00" * (placement.MAX_BODY_BYTES + 1), 413),
        ]
        for headers, body, status in cases:
            async with one.session.post(url, data=body, headers=headers) as resp:
                assert resp.status == status, (headers, await resp.text())
        assert ledger.bookings.made == 0 and ledger.demand(RankId(w1.url, 0)) == 0.0
        assert counts(one)["placed"] == 0
        async with one.session.post(url, data=good, headers=bearer) as resp:
            assert resp.status == 200
            assert decode_answer(await resp.read()) == RankId(w1.url, 0)
        assert ledger.booked_depths([11, 12, 13, 14], {}) == {RankId(w1.url, 0): 4}
        assert counts(one)["placed"] == 1
        # A replica without siblings places nothing for anyone.
        alone = await stack.enter_async_context(router_in_process(workers=[w1.url]))
        async with alone.session.post(alone.url + placement.PATH, data=good, headers=bearer) as r:
            assert r.status == 404


@contextlib.asynccontextmanager
async def asker_of(
    placer: str, workers: list[FakeWorkerHandle], timeout_ms: int
) -> AsyncIterator[RouterHandle]:
    """A replica whose only sibling, at `placer` (on loopback), sorts first: its own URL names
    a host that sorts after every loopback spelling (nothing connects to it)."""
    port = free_tcp_port()
    own = f"http://replica-z:{port}"
    async with router_in_process(
        port=port,
        self_url=own,
        peer=[placer],
        workers=[fw.url for fw in workers],
        kv_bootstrap_timeout_ms=500,
        expose_route_headers=True,
        placement_timeout_ms=timeout_ms,
    ) as rt:
        assert placer_of(own, [placer]) == placer
        assert rt.replica.placement is not None
        rt.replica.placement.clock = ManualClock()  # a backoff lasts until the test moves it
        await gate_fleet([rt], workers)
        yield rt


class EarlierQuestion(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """`PlaceQuestion` as placers read it before questions named a model."""

    tokens: int
    block_size: int
    keys: list[int]


@contextlib.asynccontextmanager
async def stub_placer(
    answer: str, later: tuple[asyncio.Event, RankId] | None = None
) -> AsyncIterator[str]:
    """A sibling that takes decision batches and answers a placement question: never
    (`hang`), with bytes that are not an answer (`garbage`), with a worker this replica does
    not route to (`stranger`), with a 401 (`refuses`: another token), with a 400 to a question
    naming a model (`older`: a placer of an earlier version), with `later`'s rank once its
    event is set (`later`); or that is not there at all (`gone`)."""
    if answer == "gone":
        yield f"http://127.0.0.1:{free_tcp_port()}"
        return
    older = msgspec.msgpack.Decoder(EarlierQuestion)
    never = asyncio.Event()

    async def place(request: web.Request) -> web.Response:
        if answer == "garbage":
            return web.Response(body=b"\x92\xa3not an answer", content_type=placement.CONTENT_TYPE)
        if answer == "refuses":
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        if answer == "older":  # refused as such a placer's control app refused it
            try:
                older.decode(await request.read())
            except msgspec.DecodeError as exc:
                message = f"placement question refused: not a placement question: {exc}"
                return web.json_response({"error": {"message": message}}, status=400)
            raise AssertionError("asked without naming a model: an earlier placer reads it")
        if answer == "stranger":
            return web.Response(
                body=encode_answer(RankId("http://127.0.0.1:9", 0)),
                content_type=placement.CONTENT_TYPE,
            )
        if answer == "later" and later is not None:
            released, rank = later
            await request.read()
            await released.wait()
            return web.Response(body=encode_answer(rank), content_type=placement.CONTENT_TYPE)
        await never.wait()
        raise AssertionError("unreachable")

    async def take(request: web.Request) -> web.Response:
        return web.Response(status=204)

    routes = {("POST", placement.PATH): place, ("POST", siblings.PATH): take}
    async with stub_server(routes) as url:
        yield url


@pytest.mark.parametrize(
    ("answer", "outcome", "backoff"),
    [
        ("hang", "timeout", True),
        ("gone", "error", True),
        ("garbage", "error", True),
        ("refuses", "error", True),
        ("stranger", "unusable", False),  # a placer that answers is asked again
    ],
)
async def test_a_slow_dead_or_wrong_placer_leaves_the_replica_deciding_alone(
    answer: str, outcome: str, backoff: bool
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        url = await stack.enter_async_context(stub_placer(answer))
        asker = await stack.enter_async_context(asker_of(url, [w1, w2], timeout_ms=50))
        served, _ = await complete(asker, prefix(random.Random(3)))
        c = counts(asker)
        assert (c["asked"], c[outcome], c["answered"]) == (1, 1, 0)
        # Decided here and booked like any decision of its own.
        ledger = policy_of(asker).ledger
        assert ledger.demand(RankId(served, 0)) == pytest.approx(BLOCKS, abs=1.5)
        # Right after a failure the placer is left alone: the next new prefix is not asked.
        await complete(asker, prefix(random.Random(4)))
        asked_again = 1 if backoff else 2
        assert (counts(asker)["asked"], counts(asker)["busy"]) == (asked_again, int(backoff))
        rules = asker.replica.placement
        assert rules is not None and rules.asking == 0
        if backoff:  # once the backoff is over the placer is asked again
            rules.clock.advance(0.05)  # type: ignore[attr-defined]
            await complete(asker, prefix(random.Random(6)))
            assert counts(asker)["asked"] == 2


@pytest.mark.parametrize(
    ("answer", "refusal", "advice"),
    [
        (
            "refuses",
            'status 401: {"error": "missing or wrong bearer token"}',
            "Check that both replicas have the same --internal-token",
        ),
        (
            "older",
            'status 400: {"error": {"message": "placement question refused: not a placement '
            'question: Expected `array` of at most length 3, got 4"}}',
            "A sibling of another version? Finish the rollout: replicas of one version read "
            "each other's questions",
        ),
    ],
)
async def test_a_placer_refusing_the_question_is_warned_with_its_error_text_and_what_to_check(
    answer: str, refusal: str, advice: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        # A worker of another model: the question names the model its prompt asks for.
        other = await stack.enter_async_context(fake_worker_in_process(model="other-model"))
        url = await stack.enter_async_context(stub_placer(answer))
        asker = await stack.enter_async_context(asker_of(url, [w1, w2, other], timeout_ms=50))
        served, _ = await complete(asker, prefix(random.Random(3)))
        assert served in (w1.url, w2.url)
        assert (counts(asker)["asked"], counts(asker)["error"]) == (1, 1)
    said = [r.getMessage() for r in caplog.records if r.name == "router.placement"]
    assert said == [
        f"placement: the placer {url} refused the question ({refusal}); new prefixes are "
        f"placed here meanwhile. {advice}"
    ]


async def test_a_client_leaving_while_its_question_waits_leaves_only_its_gone_count() -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        url = await stack.enter_async_context(stub_placer("hang"))
        asker = await stack.enter_async_context(asker_of(url, [w1, w2], timeout_ms=1000))
        rules = asker.replica.placement
        assert rules is not None
        body = msgspec.json.encode(
            {"model": "fake-model", "prompt": prefix(random.Random(5)), "max_tokens": 1}
        )
        host, port = asker.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await eventually(lambda: rules.asking == 1)
        # The loop is not held up meanwhile: a prompt under one block (never asked) is served.
        served, _ = await complete(asker, "short")
        assert served in (w1.url, w2.url)
        open_before = len(asker.plane.connections)
        writer.close()
        await eventually(lambda: rules.asking == 0)
        await eventually(lambda: len(asker.plane.connections) == open_before - 1)
        ledger = policy_of(asker).ledger
        assert ledger.bookings.made == 0  # the short prompt books nothing; the gone one neither
        assert asker.replica.inflight.total == 0
        assert asker.plane.stats.ended["gone"] == 1  # as a client that leaves after routing
        assert (rules.counts["asked"], rules.counts["timeout"], rules.counts["answered"]) == (
            1,
            0,
            0,
        )


async def test_a_drain_waits_for_a_new_prefix_whose_placer_has_not_answered_yet() -> None:
    """A request waiting for its placer's answer is not in flight yet: a drain that waited
    for in-flight requests alone ended at once, and the shutdown cut it unanswered."""
    gate = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        placer = stub_placer("later", (gate, RankId(w1.url, 0)))
        url = await stack.enter_async_context(placer)
        asker = await stack.enter_async_context(asker_of(url, [w1, w2], timeout_ms=5_000))
        request = asyncio.create_task(complete(asker, prefix(random.Random(8))))
        await eventually(lambda: asker.plane.asking.count == 1)
        drain = asyncio.create_task(asker.serving.drain(30.0))
        await eventually(lambda: asker.replica.draining)
        assert not drain.done()  # the question is still out
        gate.set()
        assert await drain  # drained means answered, not cut
        assert request.done() and (await request)[0] == w1.url
        assert counts(asker)["answered"] == 1 and asker.plane.asking.count == 0


async def test_a_new_prefix_whose_placer_has_not_answered_when_the_drain_ends_gets_a_503() -> None:
    """Never sent, it is safe to send again elsewhere: a 503 with `Retry-After`, as a request
    still queued for a worker's pool gets, where the shutdown cut it with no answer."""
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        url = await stack.enter_async_context(stub_placer("hang"))
        asker = await stack.enter_async_context(asker_of(url, [w1, w2], timeout_ms=5_000))
        text = prefix(random.Random(9))
        body = {"model": "fake-model", "prompt": text, "max_tokens": 1}
        request = asyncio.create_task(asker.post("/v1/completions", body))
        await eventually(lambda: asker.plane.asking.count == 1)
        stop = asyncio.Event()
        stop.set()  # as SIGTERM sets it
        await asyncio.wait_for(serve_until(asker.serving, stop, drain_timeout_s=0.2), 10)
        status, answer, headers = await request
        assert status == 503 and headers["Retry-After"] == "1", answer
        assert "send it again" in answer["error"]["message"]
        assert asker.plane.asking.count == 0
        assert asker.plane.metrics.requests["/v1/completions", "none", "503"] == 1
        sent = {k: n for k, n in asker.plane.metrics.requests.items() if k[1] != "none"}
        assert not any(sent.values()), sent  # nothing reached a worker
