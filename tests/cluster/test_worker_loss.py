"""Workers that die or restart under a running replica: clients never see it, the index does.

Real processes: fake workers and a `kvrouter serve` replica. A SIGKILLed worker sends
nothing (no END_SEQ, no reset): the replica learns of it from failed attempts and its health
check, and evicts its ranks from the index once /health has failed for
`--worker-evict-after-s` (in Kubernetes the EndpointSlice watch usually drops it first). A
worker whose publisher restarts announces nothing either: its next batch, numbered 0 again,
is what tells the replica.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from cachetree.ranks import RankId
from fake_kv_worker.protocol import filler_text
from router.tools.view import rank_blocks
from tests.support.cluster import (
    BLOCK_SIZE,
    SYSTEM_PROMPTS,
    Cluster,
    Ledger,
    agreed_view,
    whole_blocks,
)
from tests.support.metrics import Scrape
from tests.support.router import RouterClient, gate_fleet, quiesce
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(90)

DECODE_MS = 20
MAX_TOKENS = 10  # 200 ms of decoding: a request is in flight long enough to be cut
# About 1,000 tokens of shared prefix: worth ~4 queued requests to cache_aware, so the holder
# keeps getting the traffic while it has up to 3 in flight.
PREFIX = " ".join(SYSTEM_PROMPTS) * 6


async def complete(rt: RouterClient, question: str) -> str:
    """One non-streaming completion through the replica; returns the worker that served it."""
    body = {"prompt": PREFIX + question, "max_tokens": MAX_TOKENS}
    status, payload, headers = await rt.post("/v1/completions", body)
    assert status == 200, payload
    assert payload["choices"][0]["text"] == filler_text(MAX_TOKENS)
    return headers["X-Kvrouter-Worker"]


async def traffic(rt: RouterClient, questions: int, concurrency: int = 4) -> Counter[str]:
    """`questions` completions, `concurrency` at a time; how many each worker served."""
    served: Counter[str] = Counter()
    pending = iter(range(questions))

    async def client() -> None:
        for i in pending:
            served[await complete(rt, f" Question {i}: what changed since yesterday?")] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return served


def worker_series(scrape: Scrape, name: str, worker: str) -> float:
    """A counter's total over the series labelled with that worker."""
    return sum(v for labels, v in scrape.series(name).items() if ("worker", worker) in labels)


async def test_a_worker_killed_mid_traffic_costs_no_client_request_and_its_ranks_leave_with_it(
    cluster: Cluster,
) -> None:
    doomed, survivor = await asyncio.gather(
        cluster.worker("doomed", decode_ms_per_token=DECODE_MS),
        cluster.worker("survivor", decode_ms_per_token=DECODE_MS),
    )
    rt = await cluster.router("r", "--worker-evict-after-s", "1", workers=[doomed, survivor])
    await rt.wait_ready()
    await gate_fleet([rt], [doomed, survivor])
    await doomed.store([whole_blocks(PREFIX)])  # so cache_aware sends the traffic there
    await quiesce([rt], [doomed, survivor])

    async def kill_mid_request() -> None:
        async def busy() -> bool:
            rank = await doomed.state()
            # It has served a few, and one is running right now: the kill cuts a request.
            return rank["running"] >= 1 and rank["requests"] - rank["running"] >= 2

        await eventually(busy, 20, poll_s=0.002)
        assert doomed.child is not None
        await doomed.child.kill()

    served, _ = await asyncio.gather(traffic(rt, 24), kill_mid_request())
    # Every client request succeeded; the ones cut or refused at the dead worker failed over
    # to the survivor before their first byte.
    assert sum(served.values()) == 24
    assert served[doomed.url] >= 2
    scrape = await rt.scrape()
    failed_over = worker_series(scrape, "kvrouter_upstream_failures_total", doomed.url)
    assert failed_over >= 1
    assert worker_series(scrape, "kvrouter_requests_total", doomed.url) == served[doomed.url]
    assert worker_series(scrape, "kvrouter_requests_total", survivor.url) == served[survivor.url]
    assert worker_series(scrape, "kvrouter_requests_total", "none") == 0  # no 502, no 503
    # The survivor saw each request it answered exactly once.
    assert (await survivor.state())["requests"] == served[survivor.url]

    async def marked_unhealthy() -> bool:
        _, body = await rt.get("/workers")
        return any(w["url"] == doomed.url and not w["healthy"] for w in body["workers"])

    await eventually(marked_unhealthy, 10, poll_s=0.02)
    # Once its health check failed, no attempt goes to it at all.
    assert await traffic(rt, 8) == {survivor.url: 8}
    after = await rt.scrape()
    assert worker_series(after, "kvrouter_upstream_failures_total", doomed.url) == failed_over

    # Failing /health for a second evicts the dead worker: its ranks leave the index, the
    # survivor's stay, and nobody had to remove it.
    async def evicted() -> bool:
        _, body = await rt.get("/workers")
        return any(w["url"] == doomed.url and w["state"] == "down" for w in body["workers"])

    await eventually(evicted, 15, poll_s=0.05)
    assert (await rt.scrape()).value("kvrouter_worker_evictions_total") == 1
    await quiesce([rt], [survivor])
    held = rank_blocks((await agreed_view([rt])).canonical or frozenset())
    assert set(held) == {RankId(survivor.url, 0)}
    tree_blocks = (await rt.scrape()).names("kvrouter_tree_blocks")
    assert {labels["worker_url"] for labels in tree_blocks} == {survivor.url}


async def test_a_worker_whose_publisher_restarts_is_cleared_and_relearned(
    cluster: Cluster,
) -> None:
    fw = await cluster.worker("w", dp_size=2)
    rt = await cluster.router("r", workers=[fw])
    await rt.wait_ready()
    await gate_fleet([rt], [fw])
    ledger = Ledger([fw])
    railway, review = SYSTEM_PROMPTS
    await ledger.store(fw, 0, railway + "First incarnation: a question about sleeper cabins.")
    await ledger.store(fw, 1, review + "Second rank: a question about type hints.")
    await quiesce([rt], [fw])
    ledger.assert_held_by(await agreed_view([rt]))

    # The engine on rank 0 restarts: empty cache, seq from 0, and it announces nothing.
    await fw.post("/control/restart-publisher", {"dp_rank": 0})
    ledger.forget(fw, 0)
    [chain] = await ledger.store(fw, 0, railway + "Second incarnation: bicycles on night trains?")

    async def relearned() -> bool:
        rank = await rt.rank_view(fw.url, 0)
        return (
            rank is not None and rank["cursor"] == 0 and rank["blocks"] == len(chain) // BLOCK_SIZE
        )

    await eventually(relearned, 10, poll_s=0.02)
    # Rank 0 holds only what the new incarnation announced; rank 1 is untouched.
    ledger.assert_held_by(await agreed_view([rt]))
    assert (await rt.scrape()).value("kvrouter_kv_publisher_resets_total") == 1
