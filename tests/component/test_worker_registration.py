"""A worker's registration over real HTTP: one engine is one worker however its address is
spelt."""

from __future__ import annotations

import pytest

from cachetree.ranks import RankId
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process


async def test_one_engine_under_other_spellings_is_one_worker() -> None:
    """`http://[::ffff:127.0.0.1]:P` and `http://[::ffff:7f00:1]:P` each registered as a
    worker of their own beside `http://127.0.0.1:P`: one stream subscribed three times, its
    ranks counted three times in the index and the loads. Each is now a re-registration."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        registry = rt.replica.workers
        port = fw.url.rpartition(":")[2]
        for spelt in (
            f"http://[::ffff:127.0.0.1]:{port}",
            f"http://[::FFFF:7f00:1]:{port}/",
            f"http://[0:0:0:0:0:ffff:127.0.0.1]:{port}",
        ):
            status, body, _ = await rt.post("/workers", {"url": spelt})
            assert status == 200, (spelt, body)
            assert body["url"] == fw.url and body["state"] == "ready", body
        assert [w.url for w in registry.workers()] == [fw.url]
        assert registry.subscribed_ranks == 1
        assert rt.replica.pump.rules.live == {RankId(fw.url, 0)}
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_rank_subscriptions", kind="in_use") == 1
        status, body = await rt.delete(f"/workers?url=http://[::ffff:127.0.0.1]:{port}")
        assert status == 200 and body == {"removed": fw.url}, body
        assert registry.workers() == []


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "[::ffff:0.0.0.0]"])
async def test_a_worker_on_the_unspecified_address_is_a_400_and_registers_nothing(
    host: str,
) -> None:
    """`http://0.0.0.0:P` (what an engine's log says it listens on) registered as one more
    worker beside `http://127.0.0.1:P`: the replica connects to its own machine there."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        port = fw.url.rpartition(":")[2]
        status, body, _ = await rt.post("/workers", {"url": f"http://{host}:{port}"})
        assert status == 400, body
        assert "unspecified address" in body["error"]["message"], body
        assert body["error"]["param"] == "url"
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
        assert rt.replica.workers.subscribed_ranks == 1


async def test_an_ipv4_mapped_address_cannot_pass_an_ipv4_allow_list_it_is_outside() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(worker_allow_cidr=["127.0.0.1/32"]) as rt,
    ):
        port = fw.url.rpartition(":")[2]
        status, body, _ = await rt.post("/workers", {"url": f"http://[::ffff:127.0.0.2]:{port}"})
        assert status == 403 and "outside --worker-allow-cidr" in body["error"]["message"], body
        status, body, _ = await rt.post("/workers", {"url": f"http://[::ffff:7f00:1]:{port}"})
        assert status == 200 and body["url"] == fw.url, body
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
