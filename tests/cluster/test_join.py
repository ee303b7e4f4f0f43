"""A replica that joins a warm fleet: it inherits the siblings' index, then follows the streams.

Real processes: two fake workers (three ranks) and three `kvrouter serve` replicas. The
workers serve no `/v1/kv-snapshot`, so the only way the newcomer can hold blocks cached
before it started is a sibling's snapshot.
"""

from __future__ import annotations

import pytest

from tests.support.cluster import SYSTEM_PROMPTS, Cluster, agreed_view, warm_fleet
from tests.support.router import gate_fleet, quiesce

pytestmark = pytest.mark.timeout(90)


async def test_a_replica_joining_a_warm_fleet_holds_the_identical_view_then_tracks_new_events(
    cluster: Cluster,
) -> None:
    fleet = await warm_fleet(cluster)
    joiner = await cluster.router("joiner", workers=fleet.workers, peers=fleet.replicas)
    await joiner.wait_ready()
    everyone = [*fleet.replicas, joiner]
    await quiesce(everyone, fleet.workers)
    joined = await agreed_view(everyone)
    assert joined.canonical == fleet.view.canonical

    # It got them from a sibling for all three ranks, and every fetch was usable: one sweep
    # per worker registration at most (the second worker may register during the first).
    scrape = await joiner.scrape()
    fetches = scrape.by("kvrouter_kv_peer_snapshot_total", "outcome")
    assert fetches.keys() == {"accepted"} and 1 <= fetches["accepted"] <= 2, fetches
    assert scrape.by("kvrouter_kv_bootstrap_grafts_total", "source") == {"peer": 3}
    assert set(scrape.series("kvrouter_kv_bootstrap_state").values()) == {1.0}  # recovered
    assert scrape.value("kvrouter_tree_nodes") == fleet.ledger.nodes

    # It tracks what happens after: the live gate proves its subscriptions, then new turns on
    # every rank reach all three replicas alike.
    await gate_fleet(everyone, fleet.workers)
    railway, review = SYSTEM_PROMPTS
    w1, w2 = fleet.workers
    await fleet.ledger.store(w1, 0, railway + "Which platform does the 07:12 to Linz leave from?")
    await fleet.ledger.store(w2, 0, railway + "Can I change my seat after booking it online?")
    await fleet.ledger.store(w2, 1, review + "Does this migration need a lock on the table?")
    await quiesce(everyone, fleet.workers)
    fleet.ledger.assert_held_by(await agreed_view(everyone))
    # The splice of each grafted rank with its live stream was proven by the first batch.
    assert (await joiner.scrape()).by("kvrouter_kv_bootstrap_rank_total", "outcome") == {"warm": 3}
