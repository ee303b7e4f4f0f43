"""A worker that states figures past belief, end to end: an in-process replica over real HTTP
in front of a fake worker whose `/v1/loads`, `/metrics` or `/server_info` a front on
127.0.0.1 answers with the hostile body, and an honest fake worker beside it.

Each test asserts what the replica did with it: every request served and by whom, the
counters, what its own /metrics exports.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest

from cachetree.ranks import RankId
from router.loads import MAX_DP_SIZE
from router.replica import check_capacity_once, engine_capacity_blocks
from tests.support.adversary import front
from tests.support.fake_worker import fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.router import RouterHandle, gate_fleet, router_in_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

CACHE_BLOCKS = 64


def loads_body(**figures: object) -> tuple[int, bytes]:
    entry = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, **figures}
    return 200, msgspec.json.encode({"loads": [entry]})


async def serve_prompts(rt: RouterHandle, n: int) -> dict[str, int]:
    """Worker URL -> requests it served, of `n` distinct prompts (each a 200)."""
    served: dict[str, int] = {}
    for i in range(n):
        status, body, headers = await rt.post(
            "/v1/completions",
            {"model": "fake-model", "prompt": f"prompt {i} " + "x" * 64 * (i + 1), "max_tokens": 1},
        )
        assert status == 200, body
        served[headers["X-Kvrouter-Worker"]] = served.get(headers["X-Kvrouter-Worker"], 0) + 1
    return served


async def scrape_ok(rt: RouterHandle) -> Scrape:
    status, text = await rt.text("/metrics")
    assert status == 200, text
    return Scrape.parse(text)


BIG = 10**400


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param({"/v1/loads": loads_body(max_total_num_tokens=1e308)}, id="loads-1e308"),
        pytest.param({"/v1/loads": loads_body(max_total_num_tokens=10**40)}, id="loads-40-digits"),
        pytest.param({"/v1/loads": loads_body(max_total_num_tokens=BIG)}, id="loads-400-digits"),
        pytest.param(
            {
                "/v1/loads": (404, b""),
                "/metrics": (
                    200,
                    b'sglang:num_queue_reqs{dp_rank="0"} 0\n'
                    b'sglang:max_total_num_tokens{dp_rank="0"} 1e308\n',
                ),
            },
            id="metrics-1e308",
        ),
        # Half a block (the fleet's is 16 tokens): unknown, and was neither counted nor logged.
        pytest.param({"/v1/loads": loads_body(max_total_num_tokens=8)}, id="loads-below-a-block"),
        pytest.param(
            {
                "/v1/loads": (404, b""),
                "/metrics": (
                    200,
                    b'sglang:num_queue_reqs{dp_rank="0"} 0\n'
                    b'sglang:max_total_num_tokens{dp_rank="0"} 15\n',
                ),
            },
            id="metrics-below-a-block",
        ),
    ],
)
async def test_a_capacity_past_belief_or_below_a_block_is_unknown_counted_and_logged_once(
    answers: Mapping[str, tuple[int, bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as liar,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as honest,
        front(liar, answers) as liar_url,
        router_in_process(workers=[liar_url, honest.url], expose_route_headers=True) as rt,
    ):
        await gate_fleet([rt], [honest])
        loads = rt.replica.loads
        await eventually(lambda: loads.fresh(liar_url))
        served = await serve_prompts(rt, 12)  # each was a 500 (OverflowError in the cost)
        assert sum(served.values()) == 12 and set(served) <= {liar_url, honest.url}
        assert loads.capacity_blocks(liar_url, 0, 16) is None
        assert loads.capacity_blocks(honest.url, 0, 16) == CACHE_BLOCKS
        scrape = await scrape_ok(rt)
        assert scrape.by("kvrouter_rank_capacity_blocks", "worker_url") == {
            honest.url: CACHE_BLOCKS
        }
        assert scrape.value("kvrouter_load_values_out_of_range_total", field="capacity") >= 1
        assert scrape.value("kvrouter_load_poll_errors_total", reason="internal") == 0
        logged = [r for r in caplog.records if "states load figures" in r.getMessage()]
        assert len(logged) == 1 and liar_url in logged[0].getMessage()


async def test_workers_shows_the_capacity_the_policy_prices_beside_the_latest_read() -> None:
    """A read stating the pool past belief or below a block is unknown in `load`, while the
    policy keeps pricing the pool last stated: `capacity_tokens` shows that one."""
    answers = {"/v1/loads": loads_body(max_total_num_tokens=4096)}
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as fw,
        front(fw, answers) as url,
        router_in_process(workers=[url]) as rt,
    ):
        loads = rt.replica.loads
        await eventually(lambda: loads.capacity_tokens(url) == 4096)
        answers["/v1/loads"] = loads_body(max_total_num_tokens=8)
        await eventually(lambda: loads.out_of_range["capacity"] >= 1)
        status, body = await rt.get("/workers")
        assert status == 200, body
        rank = body["workers"][0]["ranks"][0]
        assert rank["load"]["capacity_tokens"] is None and rank["capacity_tokens"] == 4096
        assert engine_capacity_blocks(loads, rt.replica.pump)(RankId(url, 0)) == 4096 // 16


async def test_slots_past_belief_are_unknown_and_the_scrape_stays_whole() -> None:
    answers = {"/v1/loads": loads_body(max_running_requests=BIG, max_total_num_tokens=1024)}
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS, max_concurrency=2) as liar,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS, max_concurrency=2) as honest,
        front(liar, answers) as liar_url,
        router_in_process(workers=[liar_url, honest.url], expose_route_headers=True) as rt,
    ):
        loads = rt.replica.loads
        await eventually(lambda: loads.fresh(liar_url))
        scrape = await scrape_ok(rt)  # was a 500: prometheus_client cannot format the figure
        assert scrape.by("kvrouter_rank_slots", "worker_url") == {honest.url: 2}
        assert scrape.by("kvrouter_rank_capacity_blocks", "worker_url") == {
            liar_url: 1024 // 16,
            honest.url: CACHE_BLOCKS,
        }
        assert scrape.value("kvrouter_load_values_out_of_range_total", field="slots") >= 1


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_a_worker_claiming_more_dp_ranks_than_the_bound_is_refused_and_not_exported(
    policy: str,
) -> None:
    info = {"kv_events": {"endpoint_port_base": 1, "block_size": 16, "dp_size": 10**7}}
    answers = {"/server_info": (200, msgspec.json.encode(info))}
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as liar,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as honest,
        front(liar, answers) as liar_url,
        router_in_process(
            workers=[liar_url, honest.url], expose_route_headers=True, policy=policy
        ) as rt,
    ):
        liar_worker = rt.replica.workers.get(liar_url)
        assert liar_worker is not None and liar_worker.state == "refused"
        assert f"past the {MAX_DP_SIZE} ranks" in liar_worker.reason
        assert len(liar_worker.ranks()) == 1  # its claim was never built
        assert await serve_prompts(rt, 4) == {honest.url: 4}
        scrape = await scrape_ok(rt)
        assert scrape.value("kvrouter_workers_refused_total", reason="dp_size") == 1
        for name in ("kvrouter_rank_demand_blocks", "kvrouter_rank_booked_blocks"):
            assert {s["worker_url"] for s in scrape.names(name)} <= {honest.url}


async def test_a_refused_workers_ranks_are_not_exported() -> None:
    # Refused for its block size after its /server_info was read: it has four ranks on record.
    info = {"kv_events": {"endpoint_port_base": 1, "block_size": 32, "dp_size": 4}}
    answers = {"/server_info": (200, msgspec.json.encode(info))}
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as other,
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as honest,
        front(other, answers) as refused_url,
        router_in_process(workers=[honest.url, refused_url], expose_route_headers=True) as rt,
    ):
        refused = rt.replica.workers.get(refused_url)
        assert refused is not None and refused.state == "refused" and len(refused.ranks()) == 4
        assert await serve_prompts(rt, 3) == {honest.url: 3}
        scrape = await scrape_ok(rt)
        assert scrape.value("kvrouter_workers_refused_total", reason="block_size") == 1
        for name in ("kvrouter_rank_demand_blocks", "kvrouter_rank_booked_blocks"):
            assert [s["worker_url"] for s in scrape.names(name)] == [honest.url]


async def test_a_pool_below_one_block_is_unknown_to_the_capacity_check_as_to_the_policy() -> None:
    answers = {"/v1/loads": loads_body(max_total_num_tokens=8)}  # half a 16-token block
    async with (
        fake_worker_in_process(cache_blocks=CACHE_BLOCKS) as fw,
        front(fw, answers) as url,
        router_in_process(workers=[url]) as rt,
    ):
        replica = rt.replica
        await eventually(lambda: replica.loads.fresh(url))
        probe = fw.probe_for(0)

        async def applied() -> bool:  # a SUB misses what precedes its subscription: probe again
            try:
                await rt.wait_cursor(url, 0, await probe(), within_s=0.2)
            except TimeoutError:
                return False
            return True

        await eventually(applied, within_s=10.0)
        await rt.wait_cursor(url, 0, await fw.store([[7] * 16 * 6]))
        rank = RankId(url, 0)
        tree = replica.pump.rules.tree
        assert tree is not None and tree.block_count(rank) == 6 + 1  # the chain and a probe
        capacity = engine_capacity_blocks(replica.loads, replica.pump)
        assert capacity(rank) is None
        assert await check_capacity_once(replica.pump, replica.workers, capacity) == []
        assert replica.workers.stats.distrusted == 0
        assert tree.block_count(rank) == 7  # kept, not cleared and pulled again
