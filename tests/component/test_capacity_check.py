"""The live index against the engines' capacity: a rank holding more device blocks than its
engine can is cleared and pulled again, never trusted (`router.replica.check_capacity_once`,
with an injected capacity rule: the load monitor's is connected at merge)."""

from __future__ import annotations

from cachetree.ranks import RankId
from router.replica import check_capacity_once
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process
from tests.support.waiting import eventually

BS = 16


async def test_an_overfull_rank_is_cleared_and_pulled_again_and_a_fitting_one_is_kept() -> None:
    async with (
        fake_worker_in_process(serve_kv_snapshot=True) as served,
        fake_worker_in_process() as plain,
        router_in_process(workers=[served.url, plain.url]) as rt,
    ):
        for fw in (served, plain):
            await rt.gate(fw)
            await rt.wait_cursor(fw.url, 0, await fw.store([[7] * BS * 6]))
        replica = rt.replica
        tree = replica.pump.rules.tree
        assert tree is not None
        a, b = RankId(served.url, 0), RankId(plain.url, 0)
        assert tree.block_count(a) == tree.block_count(b) == 6 + 1  # the chain and the probe
        pulls_before = replica.workers.stats.snapshot_pulls.total()

        capacity = {a: 3, b: 100}  # a: 7 blocks > 3.3
        over = await check_capacity_once(replica.pump, replica.workers, capacity.get)
        assert over == [(a, 7, 3)]
        assert replica.workers.stats.distrusted == 1
        assert tree.block_count(b) == 7  # untouched

        # a's worker serves its snapshot: it is pulled again and the rank re-learned from it
        async def pulled() -> bool:
            return replica.workers.stats.snapshot_pulls.total() > pulls_before

        await eventually(pulled, 5)
        assert tree.block_count(a) == (await served.state())["blocks"]
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_ranks_distrusted_total") == 1

        # unknown capacity: nothing is checked
        assert await check_capacity_once(replica.pump, replica.workers, lambda rank: None) == []
