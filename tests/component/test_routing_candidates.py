"""The candidates a routing decision starts from, with the routable ranks kept between
requests (`WorkerRegistry.routable_ranks`, remade only when `ROUTING_EPOCH` moves).

After every change a decision must see (a worker joining, going unhealthy, draining and back,
leaving, its engine's dp size changing, a request in flight, a load read or gone stale),
`RequestRouter.candidates()` is exactly what reading the registry afresh gives, and
`ranks_alone()` (kept between requests for the policies that read no load) the same ranks.
Real fake workers over HTTP, a real registry, load monitor and in-flight tracker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest

from router.dataplane.inflight import InflightTracker
from router.dataplane.polling import PollClient
from router.dataplane.routing import RequestRouter
from router.index import IndexRules, Pump
from router.loads import LoadMonitor
from router.metrics import RouterMetrics
from router.policy import Candidate, make_policy
from router.tokenize import load_tokenizer
from router.workers import WorkerRegistry
from tests.support.clock import ManualClock
from tests.support.fake_worker import fake_worker_in_process

pytestmark = pytest.mark.timeout(30)


def afresh(workers: WorkerRegistry, loads: LoadMonitor, inflight: InflightTracker) -> list:
    """The candidates as read from scratch, with nothing kept from an earlier request."""
    return [
        Candidate(r, inflight.counts[r], loads.fresh(w.url).get(r.dp_rank))
        for w in workers.routable()
        for r in w.ranks()
    ]


@pytest.fixture
async def parts() -> AsyncIterator[tuple[WorkerRegistry, LoadMonitor, ManualClock]]:
    pump = Pump(IndexRules())
    pump.start()
    clock = ManualClock()
    async with aiohttp.ClientSession() as session:
        loads = LoadMonitor(PollClient(), interval_s=10, clock=clock)
        workers = WorkerRegistry(
            pump, session, loads, block_size=16, health_interval_s=3600, keeps_index=False
        )
        try:
            yield workers, loads, clock
        finally:
            await workers.close()
            await pump.stop()


async def test_candidates_follow_every_change_of_workers_loads_and_inflight(
    parts: tuple[WorkerRegistry, LoadMonitor, ManualClock],
) -> None:
    workers, loads, clock = parts
    inflight = InflightTracker()
    router = RequestRouter(
        load_tokenizer("bytes"),
        make_policy("round_robin"),
        workers,
        loads,
        inflight,
        IndexRules(),
        RouterMetrics(),
    )

    def check(expected_ranks: list[tuple[str, int]]) -> list[Candidate]:
        got = router.candidates()
        assert got == afresh(workers, loads, inflight)
        assert [(c.rank.worker_url, c.rank.dp_rank) for c in got] == expected_ranks
        # What a policy that reads no load is given: the same ranks, and nothing else.
        assert router.ranks_alone() == [Candidate(c.rank) for c in got]
        return got

    async with (
        fake_worker_in_process(dp_size=2) as wide,
        fake_worker_in_process() as narrow,
    ):
        a, b = wide.url, narrow.url
        assert check([]) == []
        await workers.add(a)
        check([(a, 0), (a, 1)])
        await workers.add(b)
        both = [(a, 0), (a, 1), (b, 0)]
        check(both)

        wa, wb = workers.get(a), workers.get(b)
        assert wa is not None and wb is not None
        # A request in flight, then its end: the counts are read on every decision.
        rank = check(both)[2].rank
        inflight.begin(rank)
        assert check(both)[2].inflight == 1
        inflight.end(rank)
        assert check(both)[2].inflight == 0

        # Loads: read once polled, gone once stale; never kept from an earlier decision.
        await loads.poll_once()
        assert all(c.engine is not None for c in check(both))
        clock.advance(loads.stale_after_s + 1)
        assert all(c.engine is None for c in check(both))

        wb.draining = True  # as the EndpointSlice watch drains a departed worker
        check([(a, 0), (a, 1)])
        wb.draining = False
        check(both)

        # The engine's dp size changed (read again from its server info).
        assert wa.kv is not None
        wa.kv = dataclasses.replace(wa.kv, dp_size=3)
        check([(a, 0), (a, 1), (a, 2), (b, 0)])

        # Health finds a worker gone (the health check's own path).
        await wide.worker.stop()
        await workers.check_health_once()
        assert not wa.healthy
        check([(b, 0)])

        await workers.remove(a)
        check([(b, 0)])
        await workers.remove(b)
        check([])
