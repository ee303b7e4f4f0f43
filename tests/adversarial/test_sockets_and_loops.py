"""Issue 13, row 1: more worker ranks than the replica has sockets for.

Before: the subscribers past the limit died with "Too many open files" without a word; when
that worker then failed /health, its eviction re-raised the error and the health loop died
with it: a SIGKILLed worker stayed "healthy", /readyz said 200 while completions got 502, and
DELETE /workers answered 500. Here the replica runs under a small RLIMIT_NOFILE (prlimit), so
the limit is reached with one 40-rank fake worker instead of a thousand.
"""

from __future__ import annotations

import shutil

import pytest

from tests.support.cluster import Cluster
from tests.support.waiting import eventually

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit"),
]

NOFILE = 128  # the socket budget: (128 - 64 kept back) / 4 descriptors per rank = 16 ranks


async def test_a_worker_past_the_socket_budget_is_refused_and_the_health_loop_lives_on(
    cluster: Cluster,
) -> None:
    big = await cluster.worker("big", dp_size=40, replay=False)
    small = await cluster.worker("small")
    rt = await cluster.router(
        "a",
        "--worker-evict-after-s",
        "0.5",
        workers=[small],
        under=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"],
    )
    await rt.wait_ready()
    assert (await rt.readyz())[0] == 200

    status, body, _ = await rt.post("/workers", {"url": big.url})
    assert status == 409 and "RLIMIT_NOFILE" in body["error"]["message"], body
    worker = body["worker"]
    assert worker["state"] == "refused" and "RLIMIT_NOFILE" in worker["reason"], body
    assert worker["ranks"] == [] or all(r["cursor"] is None for r in worker["ranks"])
    scrape = await rt.scrape()
    assert scrape.value("kvrouter_workers_refused_total", reason="socket_limit") == 1
    _, listing = await rt.get("/workers")
    states = {w["url"]: w["state"] for w in listing["workers"]}
    assert states == {small.url: "ready", big.url: "refused"}

    # The refused worker dies: nothing was subscribed, nothing to evict, nothing raised.
    await big.child.kill()
    # The health loop is alive: a SIGKILLed worker is noticed and /readyz turns 503.
    await small.child.kill()

    async def noticed() -> bool:
        status, reason = await rt.readyz()
        return status == 503 and reason == "no healthy worker"

    await eventually(noticed, 10)
    assert (await rt.get("/healthz"))[0] == 200
    status, body = await rt.delete(f"/workers?url={big.url}")
    assert status == 200 and body == {"removed": big.url}
    status, body = await rt.delete(f"/workers?url={small.url}")
    assert status == 200, body
    scrape = await rt.scrape()
    assert scrape.get("kvrouter_task_failures_total", task="health") in (None, 0)
