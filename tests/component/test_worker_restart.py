"""A worker whose engine restarts within `--worker-evict-after-s` is never evicted: what the
replica keeps of it must follow the new process all the same.

Real fake workers and a real replica on loopback; a crash is `stop(send_end=False)` (no
END_SEQ), the restart a new worker on the same HTTP and KV ports.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_port_range
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

BS = 16


def chain(byte: int, blocks: int) -> list[int]:
    return [byte] * (BS * blocks)


async def worker_entry(rt: RouterHandle, url: str) -> dict[str, Any]:
    _, body = await rt.get("/workers")
    return next(w for w in body["workers"] if w["url"] == url)


async def crash(rt: RouterHandle, fw: FakeWorkerHandle) -> None:
    """Kill the engine with no END_SEQ, until the replica has seen its /health fail."""
    assert fw.worker is not None
    await fw.worker.stop(send_end=False)

    async def unhealthy() -> bool:
        return not (await worker_entry(rt, fw.url))["healthy"]

    await eventually(unhealthy, within_s=10)


async def restarts(rt: RouterHandle, reason: str) -> float | None:
    return (await rt.scrape()).get("kvrouter_worker_restarts_total", reason=reason)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
async def test_a_worker_restarted_with_another_dp_size_is_registered_anew_with_its_new_ranks(
    before: int, after: int
) -> None:
    """Its old rank set stayed: a rank the new engine lacks kept its blocks and was routed to
    (the engine's 400 passed to the client), a rank it gained was never subscribed."""
    kv_port_base = free_port_range(2)
    async with (
        fake_worker_in_process(dp_size=before, kv_port_base=kv_port_base) as old,
        router_in_process(
            workers=[old.url],
            health_interval_s=0.05,
            worker_evict_after_s=600,
            expose_route_headers=True,
        ) as rt,
    ):
        for rank in range(before):
            await rt.gate(old, rank)
        await rt.wait_cursor(old.url, before - 1, await old.store([chain(7, 3)], before - 1))
        await crash(rt, old)

        port = urlsplit(old.url).port
        async with fake_worker_in_process(
            port=port, kv_port_base=kv_port_base, dp_size=after
        ) as new:

            async def registered_anew() -> dict[str, Any] | None:
                entry = await worker_entry(rt, new.url)
                ready = entry["state"] == "ready" and entry["healthy"]
                return entry if ready and len(entry["ranks"]) == after else None

            entry = await eventually(registered_anew, within_s=10)
            assert entry["kv_events"]["dp_size"] == after
            assert await restarts(rt, "kv_events_changed") == 1
            # Every rank of the new engine is subscribed, and the index holds exactly what
            # each caches: nothing of the old process's ranks.
            for rank in range(after):
                await rt.gate(new, rank)
                seq = await new.store([chain(30 + rank, 2)], rank)
                view = await rt.wait_cursor(new.url, rank, seq)
                assert view["blocks"] == (await new.state(rank))["blocks"] == 1 + 2
            scrape = await rt.scrape()
            held = {
                int(dict(labels)["dp_rank"])
                for labels in scrape.series("kvrouter_index_rank_blocks")
                if dict(labels)["worker_url"] == new.url
            }
            assert held == set(range(after))
            assert rt.replica.workers.subscribed_ranks == after

            # Requests go to ranks the engine has, and are served.
            served: set[str] = set()
            for i in range(8):
                status, _, headers = await rt.post(
                    "/v1/completions", {"prompt": f"request {i} " * 8, "max_tokens": 1}
                )
                assert status == 200
                served.add(headers.get("X-Kvrouter-Dp-Rank", "0"))
            assert served <= {str(rank) for rank in range(after)}
