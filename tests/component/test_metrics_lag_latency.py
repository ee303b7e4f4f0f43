"""The series behind the dashboard's cursor-lag and added-latency panels, after real traffic.

`kvrouter_kv_cursor` must be each rank's applied seq as the replica's own `/workers` view and
the worker's publisher say it; `kvrouter_request_added_seconds` must count each routed request
once (not its failed-over attempt again, not a request the router refused itself), each no
longer than the client's whole round trip.
"""

from __future__ import annotations

import time

from router.tokenize import BytesTokenizer
from tests.support.fake_worker import fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.router import router_in_process
from tests.support.waiting import eventually

TOK = BytesTokenizer()


def cursors(m: Scrape) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["worker_url"], dict(labels)["dp_rank"]): v
        for labels, v in m.series("kvrouter_kv_cursor").items()
    }


async def test_the_cursor_gauge_is_each_ranks_applied_seq() -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process(dp_size=2) as b,
        router_in_process(workers=[a.url, b.url]) as rt,
    ):
        for fw, rank in ((a, 0), (b, 0), (b, 1)):
            await rt.gate(fw, rank)
        await a.store([TOK.encode("x" * 16)])
        last_a = await a.store([TOK.encode("y" * 32)])
        last_b1 = await b.store([TOK.encode("z" * 16)], dp_rank=1)
        await rt.wait_cursor(a.url, 0, last_a)
        await rt.wait_cursor(b.url, 1, last_b1)
        got = cursors(await rt.scrape())
        want = {}
        for fw, rank in ((a, 0), (b, 0), (b, 1)):
            seq = (await fw.state(rank))["last_seq"]
            assert (await rt.rank_view(fw.url, rank))["cursor"] == seq  # type: ignore[index]
            want[(fw.url, str(rank))] = seq
        assert got == want
        assert got[(a.url, "0")] == last_a and got[(b.url, "1")] == last_b1
        assert got[(b.url, "1")] != got[(b.url, "0")]  # a rank each, not a worker each


async def test_a_rank_holding_nothing_keeps_its_blocks_at_0_and_its_cursor_at_minus_1() -> None:
    """As GET /workers lists it (a restarted engine's rank, or one that never published):
    per-rank series are every admitted rank's, not only the ranks the index carries."""
    async with (
        fake_worker_in_process() as busy,
        fake_worker_in_process(dp_size=2) as idle,
        router_in_process(workers=[busy.url, idle.url]) as rt,
    ):
        await rt.gate(busy)
        last = await busy.store([TOK.encode("x" * 32)])
        await rt.wait_cursor(busy.url, 0, last)
        for rank in (0, 1):
            view = await eventually(lambda rank=rank: rt.rank_view(idle.url, rank))
            assert (view["cursor"], view["blocks"]) == (None, 0)
        m = await rt.scrape()
        blocks = {
            (dict(labels)["worker_url"], dict(labels)["dp_rank"]): v
            for labels, v in m.series("kvrouter_index_rank_blocks").items()
        }
        busy_blocks = (await rt.rank_view(busy.url, 0))["blocks"]  # type: ignore[index]
        assert busy_blocks > 0
        assert blocks == {(busy.url, "0"): busy_blocks, (idle.url, "0"): 0, (idle.url, "1"): 0}
        assert cursors(m) == {(busy.url, "0"): last, (idle.url, "0"): -1, (idle.url, "1"): -1}


async def test_added_latency_counts_each_routed_request_once_within_its_round_trip() -> None:
    async with (
        fake_worker_in_process() as bad,
        fake_worker_in_process() as good,
        router_in_process(workers=[bad.url, good.url], policy="round_robin") as rt,
    ):
        before = await rt.scrape()
        assert before.value("kvrouter_request_added_seconds_count") == 0
        await bad.post("/control/fail", {"count": 1, "status": 503})
        round_trips = 0.0
        routed = 8
        for i in range(routed):
            started = time.perf_counter()
            status, body, _ = await rt.post(
                "/v1/completions", {"prompt": f"question {i}", "max_tokens": 1}
            )
            round_trips += time.perf_counter() - started
            assert status == 200, body
        status, _, _ = await rt.post("/v1/completions", {"max_tokens": 1})
        assert status == 400  # refused by the router: never sent upstream, not timed
        m = await rt.scrape()
        assert m.value("kvrouter_upstream_failures_total", worker=bad.url, reason="status") == 1
        assert m.value("kvrouter_request_added_seconds_count") == routed
        assert m.value("kvrouter_request_added_seconds_bucket", le="+Inf") == routed
        added = m.value("kvrouter_request_added_seconds_sum")
        assert 0 < added < round_trips
        buckets = [
            v
            for labels, v in sorted(
                m.series("kvrouter_request_added_seconds_bucket").items(),
                key=lambda item: float(dict(item[0])["le"]),
            )
        ]
        assert buckets == sorted(buckets)
