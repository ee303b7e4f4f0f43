"""Issue 13, rows 3, 4 and 10: a hostile KV-event publisher against a real replica.

Before: one 1 GiB frame took the replica to 2.16 GB (no maximum message size, row 3); events
for 8.2 M distinct blocks grew memory without a cap and stalled `/healthz` up to 1.2 s while
they were applied (row 4); a seq jump to 2^63-1 added 9.2e18 to the lost-batches counter, and
each copy of the last seq sent again added that seq (row 10). The fixes are in
`router/subscriber.py` and `router/index.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from tests.support.adversary import (
    HealthWatch,
    MiB,
    RawPublisher,
    batch,
    peak_rss,
    stored_chain,
    stub_server,
    stub_worker_routes,
)
from tests.support.cluster import Cluster, RouterProcess

pytestmark = pytest.mark.timeout(90)


async def heard(rt: RouterProcess, publisher: RawPublisher, worker: str, seq: int) -> int:
    """Send probe batches from `seq` on until the replica applied one; the next seq.

    A SUB misses what is sent before it (re)subscribed, so one probe may not be enough."""
    for _ in range(200):
        publisher.send(seq, batch())
        seq += 1
        try:
            await rt.wait_cursor(worker, 0, seq - 1, within_s=0.2)
            return seq
        except TimeoutError:
            continue
    raise AssertionError("the replica never received a probe batch")


@contextlib.asynccontextmanager
async def hostile_publisher(
    cluster: Cluster, *flags: str
) -> AsyncIterator[tuple[RouterProcess, RawPublisher, str, int]]:
    """A replica subscribed to a publisher the test controls; yields (replica, publisher,
    worker URL, the next seq) once a probe batch has provably arrived."""
    publisher = RawPublisher()
    try:
        async with stub_server(stub_worker_routes(kv_port=publisher.port)) as worker:
            rt = await cluster.router("a", *flags, workers=[worker])
            await rt.wait_ready()
            yield rt, publisher, worker, await heard(rt, publisher, worker, 0)
    finally:
        publisher.close()


async def test_a_huge_frame_costs_no_more_than_the_maximum_message_size(
    cluster: Cluster,
) -> None:
    async with hostile_publisher(cluster) as (rt, publisher, worker, seq):
        base = peak_rss(rt.child.pid)
        async with HealthWatch(rt.url).running() as health:
            publisher.send(seq, bytes(256 * MiB))
            # what follows is still heard (on a fresh connection, if it was dropped)
            await heard(rt, publisher, worker, seq + 1)
        grown = peak_rss(rt.child.pid) - base
    assert grown < 64 * MiB, f"peak RSS grew {grown / MiB:.0f} MiB for a 256 MiB frame"
    assert health.failures == [] and health.worst_s < 1.0


async def test_a_flood_of_distinct_blocks_stays_under_the_index_cap_and_healthz_under_50_ms(
    cluster: Cluster,
) -> None:
    """Row 4 at a reduced scale: 400k distinct blocks against a 300k cap. The index never
    holds more than the cap plus the one batch that crossed it (the largest rank is cleared,
    counted), and /healthz keeps answering while the applies run in slices."""
    cap, per_batch = 300_000, 20_000
    async with hostile_publisher(cluster, "--kv-index-max-blocks", str(cap)) as (
        rt,
        publisher,
        worker,
        seq,
    ):
        async with HealthWatch(rt.url, every_s=0.005).running() as health:
            for i in range(20):  # 20 batches of 20,000 new blocks each
                publisher.send(seq + i, batch([stored_chain(1 + i * per_batch, per_batch)]))
            await rt.wait_cursor(worker, 0, seq + 19, within_s=60)
        scrape = await rt.scrape()
    assert health.failures == []
    assert health.p99_s() < 0.050, f"/healthz p99 {health.p99_s() * 1000:.0f} ms"
    assert scrape.value("kvrouter_index_max_blocks") == cap
    assert scrape.value("kvrouter_index_carried_blocks") <= cap + per_batch
    clears = scrape.get("kvrouter_index_cap_clears_total", worker_url=worker, dp_rank="0")
    assert clears is not None and clears >= 1


async def test_a_seq_jump_to_the_end_of_the_range_is_a_reset_not_9e18_lost_batches(
    cluster: Cluster,
) -> None:
    async with hostile_publisher(cluster) as (rt, publisher, worker, seq):
        before = await rt.scrape()
        publisher.send(2**63 - 1, batch())
        publisher.send(seq, batch())  # and back
        await rt.wait_cursor(worker, 0, seq, within_s=10)
        after = await rt.scrape()
    lost = after.get("kvrouter_kv_event_batches_lost_total", worker_url=worker, dp_rank="0")
    assert (lost or 0) < 1000, lost
    resets = after.value("kvrouter_kv_publisher_resets_total")
    assert resets >= before.value("kvrouter_kv_publisher_resets_total") + 1


async def test_the_last_seq_sent_again_is_dropped_not_a_restart_whose_batches_were_all_lost(
    cluster: Cluster,
) -> None:
    """Row 10's promise, for a seq that does not move: each copy of the last seq was read as
    an engine restart whose batches 0..seq-1 went unseen, the rank cleared and all of them
    counted lost (100 copies of seq 1,000,002: 1.0e8 lost batches, 100 resets)."""
    async with hostile_publisher(cluster) as (rt, publisher, worker, seq):
        publisher.send(seq, batch([stored_chain(1, 3)]))
        await rt.wait_cursor(worker, 0, seq)
        before = await rt.scrape()
        for copy in range(100):  # new blocks in each copy: none of them is applied
            publisher.send(seq, batch([stored_chain(1_000 + 10 * copy, 2)]))
        publisher.send(seq + 1, batch([stored_chain(5_000, 1)]))
        view = await rt.wait_cursor(worker, 0, seq + 1)
        after = await rt.scrape()

    def counted(name: str, **labels: str) -> float:
        return (after.get(name, **labels) or 0) - (before.get(name, **labels) or 0)

    assert view["blocks"] == 4, view  # the first batch's 3 and the next one's: nothing cleared
    assert counted("kvrouter_kv_duplicate_batches_total") == 100
    assert counted("kvrouter_kv_publisher_resets_total") == 0
    assert counted("kvrouter_kv_event_batches_lost_total", worker_url=worker, dp_rank="0") == 0
