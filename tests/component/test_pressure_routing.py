"""cache_aware under cache pressure, end to end: an in-process replica over real HTTP and ZMQ,
in front of fake workers with small caches that state their capacity as engines do.

Each test asserts the cost: which worker served which prefix, how many prompt tokens each
request found cached, and what the replica's /metrics and `kvrouter view` say per rank.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from router.tokenize import BytesTokenizer
from router.tools import view
from tests.component.test_view import run_view
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.router import RouterHandle, gate_fleet, quiesce, router_in_process
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


async def test_view_shows_capacity_booked_blocks_and_demand_per_rank() -> None:
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as w1,
        router_in_process(workers=[w1.url], expose_route_headers=True) as rt,
    ):
        await gate_fleet([rt], [w1])
        await capacities_known(rt, [w1])
        await complete(rt, prefix(random.Random(1)))
        await quiesce([rt], [w1])
        (replica,) = await view.collect([rt.url])
        figures = replica.pressure[next(iter(replica.pressure))]
        assert (figures.capacity, figures.booked) == (CACHE_BLOCKS, 0)
        assert figures.demand is not None and 18.0 < figures.demand <= 20.0
        status, out, err = await run_view(rt.url)
        assert status == 0, out + err
        (row,) = [line.split() for line in out.splitlines() if f"{w1.url}#dp0" in line]
        # rank, cursor, blocks (20 and the gate's probe), capacity, booked, demand
        assert row[2:5] == ["21", str(CACHE_BLOCKS), "0"], out
        assert 18.0 < float(row[5]) <= 20.0, out  # 20 blocks, decaying by the wall clock
