"""cache_aware under cache pressure, end to end: an in-process replica over real HTTP and ZMQ,
in front of fake workers with small caches that state their capacity as engines do.

Each test asserts the cost: which worker served which prefix, how many prompt tokens each
request found cached, and what the replica's /metrics and `kvrouter view` say per rank.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence

import msgspec
import pytest

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from router import siblings
from router.homes import CacheAwareHome, HomeSettings
from router.policy import CacheAware
from router.tokenize import BytesTokenizer
from router.tools import view
from tests.component.test_view import run_view
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_port_range
from tests.support.router import (
    TEST_TOKEN,
    RouterHandle,
    gate_fleet,
    quiesce,
    router_in_process,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

TOK = BytesTokenizer()
CACHE_BLOCKS = 32  # per worker: one 20-block prefix fits, two do not
PREFIX_CHARS = 20 * 16


def prefix(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PREFIX_CHARS))


async def complete(rt: RouterHandle, text: str) -> tuple[str, int]:
    """(the worker that served it, its cached prompt tokens)."""
    status, body, headers = await rt.post(
        "/v1/completions", {"model": "fake-model", "prompt": text, "max_tokens": 1}
    )
    assert status == 200, body
    return headers["X-Kvrouter-Worker"], int(headers["X-Fake-Worker-Cached-Tokens"])


async def capacities_known(rt: RouterHandle, workers: Sequence[FakeWorkerHandle]) -> None:
    """Until the load monitor has read every worker's stated pool."""

    def known() -> bool:
        loads = rt.replica.loads
        return all(loads.capacity_blocks(fw.url, 0, 16) == CACHE_BLOCKS for fw in workers)

    await eventually(known, within_s=10.0)


async def test_a_second_new_prefix_goes_where_it_evicts_nothing_and_both_stay_cached() -> None:
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w1,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w2,
        router_in_process(workers=[w1.url, w2.url], expose_route_headers=True) as rt,
    ):
        workers = [w1, w2]
        await gate_fleet([rt], workers)
        await capacities_known(rt, workers)
        rng = random.Random(5)
        for pair in range(6):  # fresh prefixes each time; without pressure, ties split at random
            first, second = prefix(rng), prefix(rng)
            home_first, _ = await complete(rt, first + f" one {pair}")
            await quiesce([rt], workers)
            home_second, _ = await complete(rt, second + f" two {pair}")
            await quiesce([rt], workers)
            # The worker holding `first` has no room for `second` without evicting it.
            assert home_second != home_first, pair
            for text, home in ((first, home_first), (second, home_second)):
                served, cached = await complete(rt, text + f" again {pair}")
                assert (served, cached) == (home, PREFIX_CHARS), pair
                await quiesce([rt], workers)
        scrape = await rt.scrape()
        for fw in workers:
            labels = {"worker_url": fw.url, "dp_rank": "0"}
            assert scrape.value("kvrouter_rank_capacity_blocks", **labels) == CACHE_BLOCKS
            # Unlimited concurrency (max_concurrency 0) states no slots: no series.
            assert scrape.get("kvrouter_rank_slots", **labels) is None
            # Recent demand: every prefix routed there, 20 blocks each, barely decayed.
            assert scrape.value("kvrouter_rank_demand_blocks", **labels) > 6 * 20 * 0.9
            assert scrape.value("kvrouter_rank_booked_blocks", **labels) == 0
        # Each new prefix's booking was confirmed by its store event, none expired (a repeat
        # stores no new full block, so it books nothing).
        assert scrape.value("kvrouter_bookings_total", outcome="confirmed") == 6 * 2
        assert scrape.value("kvrouter_bookings_total", outcome="expired") == 0
        assert scrape.value("kvrouter_bookings_held") == 0
        # From the third pair on, each new prefix evicts an older pair's recent demand.
        assert scrape.value("kvrouter_pressure_spills_total") >= 4 * 2


async def test_a_fresh_replica_prices_pressure_from_its_first_request() -> None:
    """A worker's capacity is read when it registers, not at the next load tick (a minute away
    here): the first placements pay for the room they take. Two prefixes share a 10-block
    header and go on with 14 blocks of their own; one worker cannot hold both (48 > 32
    blocks). Blind to capacity, the header's 160 tokens send the second to the first's
    worker, where it evicts part of it."""
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w1,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w2,
        router_in_process(
            workers=[w1.url, w2.url], expose_route_headers=True, load_interval_ms=60_000
        ) as rt,
    ):
        workers = [w1, w2]
        loads = rt.replica.loads
        assert [loads.capacity_blocks(fw.url, 0, 16) for fw in workers] == [CACHE_BLOCKS] * 2
        await gate_fleet([rt], workers)
        rng = random.Random(7)
        header = prefix(rng)[: 10 * 16]
        first, second = (header + prefix(rng)[: 14 * 16] for _ in range(2))
        home_first, cached = await complete(rt, first + " one")
        assert cached == 0
        await quiesce([rt], workers)
        home_second, cached = await complete(rt, second + " two")
        assert (home_second != home_first, cached) == (True, 0)
        await quiesce([rt], workers)
        for text, home in ((first, home_first), (second, home_second)):
            assert await complete(rt, text + " again") == (home, 24 * 16)
            await quiesce([rt], workers)
        assert (await rt.scrape()).value("kvrouter_pressure_spills_total") == 0


async def test_view_shows_capacity_slots_booked_blocks_and_demand_per_rank() -> None:
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS, max_concurrency=2) as w1,
        router_in_process(workers=[w1.url], expose_route_headers=True) as rt,
    ):
        await gate_fleet([rt], [w1])
        await capacities_known(rt, [w1])
        await complete(rt, prefix(random.Random(1)))
        await quiesce([rt], [w1])
        (replica,) = await view.collect([rt.url])
        figures = replica.pressure[next(iter(replica.pressure))]
        # The slots: the worker's max_concurrency, stated as max_running_requests.
        assert (figures.capacity, figures.slots, figures.booked) == (CACHE_BLOCKS, 2, 0)
        assert figures.demand is not None and 18.0 < figures.demand <= 20.0
        status, out, err = await run_view(rt.url)
        assert status == 0, out + err
        (row,) = [line.split() for line in out.splitlines() if f"{w1.url}#dp0" in line]
        # rank, cursor, blocks (20 and the gate's probe), capacity, slots, booked, demand
        assert row[2:6] == ["21", str(CACHE_BLOCKS), "2", "0"], out
        assert 18.0 < float(row[6]) <= 20.0, out  # 20 blocks, decaying by the wall clock
        assert len(row) == 7 and "homed" not in out, out  # no prefix homes here


async def test_a_request_that_fails_over_moves_its_booking_to_the_worker_that_served_it() -> None:
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w1,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w2,
        router_in_process(workers=[w1.url, w2.url], expose_route_headers=True) as rt,
    ):
        workers = {w1.url: w1, w2.url: w2}
        await gate_fleet([rt], [w1, w2])
        text = prefix(random.Random(3))
        home, _ = await complete(rt, text + " first")
        await quiesce([rt], [w1, w2])
        other = next(url for url in workers if url != home)
        await workers[home].post("/control/fail", {"count": 1, "status": 503})
        # cache_aware sends the prefix to its holder, which fails before the first byte; the
        # other worker serves it, prefilling all of it.
        served, cached = await complete(rt, text + " second, somewhat longer than the first")
        assert (served, cached) == (other, 0)
        policy = rt.replica.policy
        assert isinstance(policy, CacheAware)
        ledger = policy.ledger
        assert ledger.bookings.moved == 1
        keys = block_keys(TOK.encode(text + " second, somewhat longer than the first"), 16)
        # The prompt's demand and booking are on the worker that served it, none left behind.
        assert ledger.booked_depths(keys, {}) in ({RankId(other, 0): len(keys)}, {})
        assert ledger.demand(RankId(other, 0)) >= len(keys) * 0.9
        await quiesce([rt], [w1, w2])
        policy.settle()
        assert ledger.bookings.expired == 0 and ledger.pending(RankId(home, 0)) == 0
        # Both workers hold the prefix now; the next request finds it cached either way.
        assert (await complete(rt, text + " third"))[1] == PREFIX_CHARS


async def two_sharing_replicas(
    stack: contextlib.AsyncExitStack, workers: Sequence[FakeWorkerHandle], **config: object
) -> tuple[RouterHandle, RouterHandle]:
    """Two replicas that know each other (`--peer`), in front of the same workers."""
    base = free_port_range(2)
    urls = [f"http://127.0.0.1:{base + k}" for k in range(2)]
    replicas = []
    for k in range(2):
        replicas.append(
            await stack.enter_async_context(
                router_in_process(
                    port=base + k,
                    self_url=urls[k],
                    peer=[urls[1 - k]],
                    workers=[fw.url for fw in workers],
                    kv_bootstrap_timeout_ms=1000,
                    expose_route_headers=True,
                    **config,
                )
            )
        )
    await gate_fleet(replicas, workers)
    return replicas[0], replicas[1]


async def test_a_replica_adopts_its_siblings_decisions_as_its_own_demand_and_bookings() -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        w2 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        one, two = await two_sharing_replicas(stack, [w1, w2])
        text = prefix(random.Random(4))
        home, _ = await complete(one, text)
        rank = RankId(home, 0)
        sibling = two.replica.policy
        assert isinstance(sibling, CacheAware)
        # Twenty blocks routed by the other replica count as this one's recent demand.
        await eventually(lambda: sibling.ledger.demand(rank) > 19.0, within_s=10.0)
        assert sibling.ledger.demand(RankId(next(u for u in (w1.url, w2.url) if u != home), 0)) < 2
        scrape_one, scrape_two = await one.scrape(), await two.scrape()
        assert scrape_one.value("kvrouter_shared_decisions_total", outcome="sent") >= 1
        assert scrape_two.value("kvrouter_shared_decisions_total", outcome="received") >= 1
        assert scrape_two.value("kvrouter_shared_decision_failures_total", kind="refused") == 0
        # The sibling sends the prefix's next request to the same worker, which has it cached.
        await quiesce([one, two], [w1, w2])
        assert await complete(two, text + " again") == (home, PREFIX_CHARS)


async def test_the_decisions_route_refuses_bad_callers_and_bad_batches_changing_nothing() -> None:
    async with contextlib.AsyncExitStack() as stack:
        w1 = await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
        _, two = await two_sharing_replicas(stack, [w1])
        policy = two.replica.policy
        assert isinstance(policy, CacheAware)
        good = msgspec.msgpack.encode(
            siblings.DecisionBatch([siblings.SharedDecision(w1.url, 0, 0, [11, 12])])
        )
        url = two.url + siblings.PATH
        bearer = {"Authorization": f"Bearer {TEST_TOKEN}"}
        cases = [
            ({}, good, 401),  # no token
            ({"Authorization": "Bearer not-the-token"}, good, 401),
            (bearer, b"\x93not msgpack of a batch", 400),
            (bearer, b"\x00" * (siblings.MAX_BODY_BYTES + 1), 413),
        ]
        for headers, body, status in cases:
            async with two.session.post(url, data=body, headers=headers) as resp:
                assert resp.status == status, (headers, await resp.text())
        assert policy.ledger.demand(RankId(w1.url, 0)) == 0.0
        assert policy.ledger.pending(RankId(w1.url, 0)) == 0
        stats = two.replica.sharing.stats  # type: ignore[union-attr]
        assert (stats.received, stats.refused) == (0, 2)  # the malformed one, the oversized one
        async with two.session.post(url, data=good, headers=bearer) as resp:
            assert resp.status == 204
        assert policy.ledger.pending(RankId(w1.url, 0)) == 2
        # A replica without siblings has no such route to feed.
        alone = await stack.enter_async_context(router_in_process(workers=[w1.url]))
        async with alone.session.post(alone.url + siblings.PATH, data=good, headers=bearer) as r:
            assert r.status == 404


async def test_two_replicas_with_prefix_homes_agree_on_a_new_prefixs_home() -> None:
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(fake_worker_in_process(cache_blocks=CACHE_BLOCKS))
            for _ in range(3)
        ]
        one, two = await two_sharing_replicas(stack, workers, prefix_homes=True)
        mine, theirs = one.replica.policy, two.replica.policy
        assert isinstance(mine, CacheAwareHome) and isinstance(theirs, CacheAwareHome)
        text = prefix(random.Random(5))
        placed_at = time.monotonic()
        home, _ = await complete(one, text)
        keys = block_keys(TOK.encode(text), 16)
        placed = mine.table.find(keys)
        assert placed is not None and placed.rank == RankId(home, 0)
        # The sibling learns the home over HTTP before it sees any request of the prefix.
        await eventually(lambda: theirs.table.find(keys) is not None, within_s=10.0)
        adopted = theirs.table.find(keys)
        assert adopted is not None and (adopted.rank, adopted.anchor) == (placed.rank, keys[0])
        scrape = await two.scrape()
        assert scrape.value("kvrouter_prefix_home_events_total", outcome="adopted") >= 1
        assert scrape.value("kvrouter_shared_decisions_total", outcome="homes_received") >= 1
        assert scrape.value("kvrouter_prefix_homes") >= 1
        # Its next request, through the sibling, goes home and finds the prefix cached; the
        # sibling placed nothing of its own.
        await quiesce([one, two], workers)
        assert await complete(two, text + " again") == (home, PREFIX_CHARS)
        assert theirs.table.stats.placed == 0
        homed = (await one.scrape()).value(
            "kvrouter_rank_homed_blocks", worker_url=home, dp_rank="0"
        )
        status, out, err = await run_view(one.url)
        assert status == 0, out + err
        # Its 20 blocks, decaying by the half-life since they were placed (a busy machine
        # takes seconds to get here): no fewer than that leaves, no more than 20.
        decayed = 20 * 0.5 ** ((time.monotonic() - placed_at) / HomeSettings().half_life_s)
        assert decayed - 0.05 <= homed <= 20.0
        (row,) = [line.split() for line in out.splitlines() if f"{home}#dp0" in line]
        assert "homed" in out and decayed - 0.05 <= float(row[6]) <= 20.0, out
        # A batch whose home is malformed is refused whole: nothing of it adopted.
        bad = siblings.SharedHome(home, 0, 1, 0, 2, [1, 2], 2, 0, float("inf"), 0, None)
        body = msgspec.msgpack.encode(siblings.DecisionBatch([], [bad]))
        bearer = {"Authorization": f"Bearer {TEST_TOKEN}"}
        before = len(theirs.table)
        async with two.session.post(two.url + siblings.PATH, data=body, headers=bearer) as r:
            assert r.status == 400 and "stamp" in await r.text()
        assert len(theirs.table) == before


async def test_a_prompt_the_engine_refuses_ends_its_booking_at_once() -> None:
    """A 4xx from the engine caches nothing: the booking the decision made stops counting as
    held then, not at its TTL (a minute here), so refused requests leave no rank looking full."""
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w1,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w2,
        router_in_process(
            workers=[w1.url, w2.url], booking_ttl_ms=60_000, expose_route_headers=True
        ) as rt,
    ):
        workers = [w1, w2]
        await gate_fleet([rt], workers)
        rng = random.Random(11)
        for i in range(5):
            status, body, _ = await rt.post(
                "/v1/completions",
                {"model": "fake-model", "prompt": prefix(rng) + f" {i}", "max_tokens": -5},
            )
            assert status == 400, body
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_bookings_total", outcome="refused") == 5
        assert scrape.value("kvrouter_bookings_held") == 0
        for fw in workers:
            labels = {"worker_url": fw.url, "dp_rank": "0"}
            assert scrape.value("kvrouter_rank_booked_blocks", **labels) == 0
        # A prompt the engine serves still books, and its store event confirms it.
        _, cached = await complete(rt, prefix(rng))
        assert cached == 0
        await quiesce([rt], workers)
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_bookings_total", outcome="confirmed") == 1
        assert scrape.value("kvrouter_bookings_total", outcome="refused") == 5


async def test_a_removed_workers_ranks_leave_the_ledger_and_their_share_of_its_bound() -> None:
    """After a rollout to new addresses the departed ranks held their share of
    --pressure-max-tracked-blocks for 16 half-lives, halving the live ranks' demand."""
    async with (
        fake_worker_in_process() as w1,
        fake_worker_in_process() as w2,
        router_in_process(
            workers=[w1.url, w2.url],
            pressure_max_tracked_blocks=60,
            booking_ttl_ms=60_000,
            expose_route_headers=True,
        ) as rt,
    ):
        await gate_fleet([rt], [w1, w2])
        policy = rt.replica.policy
        assert isinstance(policy, CacheAware)
        ledger = policy.ledger
        rng = random.Random(13)
        served: set[str] = set()
        while len(served) < 2:  # both ranks hold demand, 30 pairs each at most
            last, _ = await complete(rt, prefix(rng))
            served.add(last)
        gone = RankId(last, 0)
        booked = ledger.live_bookings(gone)  # its last decision's, at least: not settled yet
        assert booked >= 1
        assert (await rt.delete(f"/workers?url={last}"))[0] == 200
        kept = next(url for url in served if url != last)
        assert ledger.ranks() == [RankId(kept, 0)]
        for _ in range(3):
            assert (await complete(rt, prefix(rng)))[0] == kept
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_bookings_total", outcome="departed") == booked
        demand = scrape.value("kvrouter_rank_demand_blocks", worker_url=kept, dp_rank="0")
        assert 55 < demand <= 60  # the whole bound (decaying by the wall clock), not half
