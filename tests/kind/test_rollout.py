"""kind e2e: manifests/ deployed on a real cluster keep one index across scale-ups and rollouts.

Opt-in (see tests/kind/cluster.py): `RUN_KIND_E2E=1` with kind, kubectl and a Docker daemon;
elsewhere every test here skips with the reason. One cluster serves the module; every test
starts from 3 router replicas, live streams (a gate) and empty worker caches, so the tests
are independent of their order. Budget: cluster creation 2-4 min, then about a minute per
test on 2 cores (the rollout restart is the longest: three surges of bootstrap + drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from router.tools.view import CanonicalView, collect
from tests.kind.cluster import CALL_FAILED, KindCluster, port_forwards, skip_reason
from tests.kind.fleet import Fleet, Placed, Replica

SKIP_REASON = skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindCluster]:
    running = asyncio.run(KindCluster.up(tmp_path_factory.mktemp("kind")))
    try:
        yield running
    finally:
        asyncio.run(running.down())


@pytest.fixture
async def fleet(cluster: KindCluster, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    async with port_forwards(cluster) as forwards, aiohttp.ClientSession() as session:
        yield await Fleet.reach(cluster, forwards, session)
        if request.node.stash.get(CALL_FAILED, False):
            print(await cluster.diagnostics())


async def warm_start(fleet: Fleet, tag: int, count: int) -> tuple[list[Replica], Placed]:
    """3 replicas with live streams, worker caches cleared, `count` chains stored, quiesced."""
    replicas = await fleet.replicas(3)
    await fleet.gate(replicas)
    await fleet.clear()
    placed = await fleet.spread(fleet.chains(tag, count))
    await fleet.quiesce(replicas)
    return replicas, placed


async def tracks_new_events(
    fleet: Fleet, replicas: list[Replica], before: CanonicalView, tag: int
) -> None:
    """Past a live gate, new chains reach every replica: the views agree, grow, hold them."""
    await fleet.gate(replicas)
    fresh = await fleet.spread(fleet.chains(tag, 8))
    await fleet.quiesce(replicas)
    tracked = await fleet.agreed_view(replicas)
    assert before < tracked
    assert fleet.holds(tracked, fresh)


def names(replicas: list[Replica]) -> frozenset[str]:
    return frozenset(r.pod.name for r in replicas)


async def test_the_router_account_may_read_endpointslices_and_nothing_else(
    cluster: KindCluster,
) -> None:
    account = f"system:serviceaccount:{cluster.namespace}:{cluster.router_account}"

    async def can_i(verb: str, resource: str) -> str:
        # `auth can-i` answers "no" with exit status 1.
        answer = await cluster.kubectl("auth", "can-i", verb, resource, "--as", account, ok=(0, 1))
        return answer.strip()

    for verb in ("get", "list", "watch"):
        assert await can_i(verb, "endpointslices.discovery.k8s.io") == "yes"
    assert await can_i("create", "endpointslices.discovery.k8s.io") == "no"
    assert await can_i("list", "pods") == "no"
    assert await can_i("get", "secrets") == "no"


async def test_new_replicas_match_the_warm_fleet_and_track_new_events(fleet: Fleet) -> None:
    warm_fleet, placed = await warm_start(fleet, tag=1, count=24)
    warm = await fleet.agreed_view(warm_fleet)
    assert fleet.holds(warm, placed)

    grown = await fleet.replicas(5)
    joined = [r for r in grown if r.pod.name not in names(warm_fleet)]
    assert len(joined) == 2
    # Ready means bootstrapped: each newcomer serves an inherited index before any new event.
    for view in await collect([r.url for r in joined], token=fleet.cluster.token):
        assert view.error is None and view.producer_ready, view
        assert view.nodes == len(warm), view.url
    await fleet.quiesce(grown)
    assert await fleet.agreed_view(grown) == warm

    await tracks_new_events(fleet, grown, warm, tag=2)


async def test_the_view_survives_a_full_rolling_update(fleet: Fleet) -> None:
    old_fleet, placed = await warm_start(fleet, tag=3, count=16)
    before = await fleet.agreed_view(old_fleet)

    deployment = f"deployment/{fleet.cluster.router_deployment}"
    await fleet.cluster.kubectl("rollout", "restart", deployment)
    await fleet.cluster.rollout_status(fleet.cluster.router_deployment)
    new_fleet = await fleet.replicas(3, excluding=names(old_fleet))

    # Every replica was replaced, each bootstrapping from siblings that had bootstrapped in
    # turn: a replica that copied a cold sibling would show a short or empty view here.
    await fleet.quiesce(new_fleet)
    after = await fleet.agreed_view(new_fleet)
    assert after == before
    assert fleet.holds(after, placed)

    await tracks_new_events(fleet, new_fleet, before, tag=4)


async def test_a_scaled_up_replica_shows_a_grafted_snapshot_not_merely_settled(
    fleet: Fleet,
) -> None:
    warm_fleet, _ = await warm_start(fleet, tag=5, count=8)
    warm = await fleet.agreed_view(warm_fleet)

    grown = await fleet.replicas(4)
    [joined] = [r for r in grown if r.pod.name not in names(warm_fleet)]
    metrics = await fleet.metrics(joined)

    def value(name: str, **labels: str) -> float:
        return sum(v for lbls, v in metrics.get(name, []) if labels.items() <= lbls.items())

    assert value("kvrouter_kv_peer_snapshot_total", outcome="accepted") >= 1
    assert value("kvrouter_kv_bootstrap_settled") == 1
    assert value("kvrouter_tree_nodes") == len(warm)
    # Recovered is 1; failed renders as 2, so "not pending" would not be enough.
    states = {
        (lbls["worker_url"], lbls["dp_rank"]): v
        for lbls, v in metrics["kvrouter_kv_bootstrap_state"]
    }
    assert states == {(w.in_cluster, "0"): 1.0 for w in fleet.workers}
