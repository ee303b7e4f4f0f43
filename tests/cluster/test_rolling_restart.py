"""A rolling restart of every replica, one at a time with a surge, as Kubernetes does it with
`maxSurge: 1, maxUnavailable: 0`: start a new replica, wait for its `/readyz`, SIGTERM an old
one; repeat until no replica of the first generation is left.

Events keep arriving between the steps. The fleet must lose no chain, and every new replica
must have inherited a warm sibling's index: a replica that bootstrapped from an empty sibling
(or ran cold) would hold only what was published after it started.
"""

from __future__ import annotations

import pytest

from tests.support.cluster import (
    SYSTEM_PROMPTS,
    Cluster,
    RouterProcess,
    agreed_view,
    warm_fleet,
)
from tests.support.router import gate_fleet, quiesce

pytestmark = pytest.mark.timeout(120)


async def test_a_rolling_restart_with_surge_loses_no_chain_and_every_replica_inherits_a_warm_view(
    cluster: Cluster,
) -> None:
    fleet = await warm_fleet(cluster)
    w1, w2 = fleet.workers
    railway, review = SYSTEM_PROMPTS
    live: list[RouterProcess] = list(fleet.replicas)
    new_generation: list[RouterProcess] = []
    for step, old in enumerate(list(fleet.replicas)):
        fresh = await cluster.router(f"gen1-{step}", workers=fleet.workers, peers=live)
        await fresh.wait_ready()
        # Ready means inherited: on its first /readyz 200 it already holds the fleet's view.
        await quiesce([*live, fresh], fleet.workers)
        inherited = await agreed_view([*live, fresh])
        fleet.ledger.assert_held_by(inherited)
        assert await old.child.terminate() == 0, old.child.tail()
        live = [r for r in live if r is not old] + [fresh]
        new_generation.append(fresh)
        # Traffic goes on between the steps: new turns on every rank.
        await gate_fleet(live, fleet.workers)
        await fleet.ledger.store(w1, 0, railway + f"Step {step}: is the 08:40 to Graz on time?")
        await fleet.ledger.store(w2, 0, railway + f"Step {step}: where is the quiet coach?")
        await fleet.ledger.store(w2, 1, review + f"Step {step}: should this be a dataclass?")
        await quiesce(live, fleet.workers)

    after = await agreed_view(live)
    fleet.ledger.assert_held_by(after)  # every chain, before and during the rollout
    assert fleet.view.canonical is not None and after.canonical is not None
    assert fleet.view.canonical <= after.canonical
    for replica in new_generation:
        scrape = await replica.scrape()
        # Its every snapshot fetch came back usable (never cold, never refused) ...
        fetches = scrape.by("kvrouter_kv_peer_snapshot_total", "outcome")
        assert fetches.keys() == {"accepted"}, (replica.url, fetches)
        # ... and all three ranks were grafted from a sibling, then spliced to their streams.
        assert scrape.by("kvrouter_kv_bootstrap_grafts_total", "source") == {"peer": 3}
        assert scrape.by("kvrouter_kv_bootstrap_rank_total", "outcome") == {"warm": 3}
        assert set(scrape.series("kvrouter_kv_bootstrap_state").values()) == {1.0}
