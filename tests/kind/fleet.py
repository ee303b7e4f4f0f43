"""The deployed fleet as the e2e scenarios drive it: store events, quiesce, gate, compare.

Rules (reference-bootstrap.md section 10): events are driven by `POST /control/store` on a
fake worker pod, never timed; views are compared only after every replica's cursor for every
worker rank reached that worker's `last_seq` (a quiesce); new events are asserted only after
a live gate (a probe batch that every replica's cursor is seen to pass), because a ZeroMQ
PUB drops what it sends before a subscription has propagated.

A worker is named by the URL the routers register it under, `http://<pod IP>:<port>`: the
address and port its EndpointSlice lists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from peer.fetch import SnapshotFetcher
from router.tools.view import CanonicalView, collect, compare, fetch_view, rank_blocks
from tests.kind.cluster import KindCluster, Pod, PortForwards
from tests.support.fake_worker import PROBE_TOKEN
from tests.support.manifests import ROUTER_PROGRAM, WORKER_PROGRAM
from tests.support.waiting import eventually

QUIESCE_S = 90.0
GATE_ROUND_S = 3.0
GATE_ROUNDS = 20


@dataclass(frozen=True)
class Replica:
    pod: Pod
    url: str  # through its own port-forward


@dataclass(frozen=True)
class Worker:
    pod: Pod
    url: str  # through its own port-forward
    port: int  # its HTTP port in the cluster

    @property
    def in_cluster(self) -> str:
        return f"http://{self.pod.ip}:{self.port}"

    @property
    def rank(self) -> RankId:
        return RankId(self.in_cluster, 0)


Placed = dict[Worker, list[list[int]]]  # which worker stored which token chains


@dataclass
class Fleet:
    cluster: KindCluster
    forwards: PortForwards
    session: aiohttp.ClientSession
    workers: list[Worker]
    block_size: int

    @classmethod
    async def reach(
        cls, cluster: KindCluster, forwards: PortForwards, session: aiohttp.ClientSession
    ) -> Fleet:
        config = cluster.worker_config
        replicas = cluster.workload(WORKER_PROGRAM).deployment["spec"]["replicas"]
        pods = await cluster.wait_pods(WORKER_PROGRAM, replicas)
        workers = [Worker(p, await forwards.url(p, config.port), config.port) for p in pods]
        return cls(cluster, forwards, session, workers, config.block_size)

    async def replicas(
        self, count: int, *, excluding: frozenset[str] = frozenset()
    ) -> list[Replica]:
        """Scale the routers to `count` and reach each ready pod once exactly `count` are."""
        await self.cluster.scale(count)
        pods = await self.cluster.wait_pods(ROUTER_PROGRAM, count, excluding=excluding)
        port = self.cluster.router_port
        return [Replica(p, await self.forwards.url(p, port)) for p in pods]

    # -- chains -----------------------------------------------------------------------------

    def chains(self, tag: int, count: int, blocks: int = 3) -> list[list[int]]:
        """`count` token chains of `blocks` full blocks, distinct across tags and from probes."""
        length = blocks * self.block_size
        return [[tag * 1_000_000 + i * 1_000 + t + 3 for t in range(length)] for i in range(count)]

    def holds(self, view: CanonicalView, placed: Placed) -> bool:
        """Whether the view carries every placed chain on its worker's rank, parent by parent."""
        per_rank = rank_blocks(view)
        for worker, mine in placed.items():
            carried = per_rank.get(worker.rank, {})
            for tokens in mine:
                keys = block_keys(tokens, self.block_size)
                for key, parent in zip(keys, [None, *keys[:-1]], strict=True):
                    if key not in carried or carried[key][0] != parent:
                        return False
        return True

    # -- events -----------------------------------------------------------------------------

    async def store(self, worker: Worker, token_chains: list[list[int]]) -> int:
        body = {"token_chains": token_chains, "dp_rank": 0}
        async with self.session.post(worker.url + "/control/store", json=body) as resp:
            payload = await resp.json()
            assert resp.status == 200, f"/control/store on {worker.pod.name}: {payload}"
            return payload["last_seq"]

    async def spread(self, token_chains: list[list[int]]) -> Placed:
        """Store the chains round-robin over the workers; which worker got which."""
        placed: Placed = {w: [] for w in self.workers}
        for i, chain in enumerate(token_chains):
            placed[self.workers[i % len(self.workers)]].append(chain)
        for worker, mine in placed.items():
            if mine:
                await self.store(worker, mine)
        return placed

    async def clear(self) -> None:
        """Empty every worker's cache (one AllBlocksCleared batch each): a test starts bare."""
        for worker in self.workers:
            body = {"dp_rank": 0}
            async with self.session.post(worker.url + "/control/clear", json=body) as resp:
                assert resp.status == 200, f"/control/clear on {worker.pod.name}: {resp.status}"

    async def last_seqs(self) -> dict[RankId, int]:
        out = {}
        for worker in self.workers:
            async with self.session.get(worker.url + "/control/state") as resp:
                out[worker.rank] = (await resp.json())["ranks"][0]["last_seq"]
        return out

    # -- waiting ----------------------------------------------------------------------------

    async def _behind(self, replicas: Sequence[Replica], seqs: dict[RankId, int]) -> list[str]:
        """Each replica rank whose cursor has not reached `seqs` (what it reports instead)."""
        async with SnapshotFetcher(token=self.cluster.token) as fetcher:
            tables = await asyncio.gather(
                *(fetch_view(fetcher, self.session, r.url, cursors_only=True) for r in replicas)
            )
        behind = []
        for replica, table in zip(replicas, tables, strict=True):
            for rank, seq in seqs.items():
                if table.error is not None or table.cursors.get(rank, -1) < seq:
                    behind.append(
                        f"{replica.pod.name} {rank}: {table.error or table.cursors.get(rank)} "
                        f"< {seq} (it names {sorted(map(str, table.cursors))})"
                    )
        return behind

    async def _reach(
        self, replicas: Sequence[Replica], seqs: dict[RankId, int], within_s: float
    ) -> None:
        behind: list[str] = []

        async def caught_up() -> bool:
            nonlocal behind
            behind = await self._behind(replicas, seqs)
            return not behind

        try:
            await eventually(caught_up, within_s, poll_s=0.25)
        except TimeoutError:
            raise AssertionError(f"cursors behind after {within_s:g} s: {behind}") from None

    async def quiesce(self, replicas: Sequence[Replica], within_s: float = QUIESCE_S) -> None:
        """Until every replica's cursor for every worker rank reached the worker's last_seq."""
        await self._reach(replicas, await self.last_seqs(), within_s)

    async def gate(self, replicas: Sequence[Replica], rounds: int = GATE_ROUNDS) -> None:
        """Probe every worker until every replica's cursor passes the probe: streams are live.

        A probe sent before a subscription was live is lost to that replica; the next round's
        probe is not.
        """
        probe = [[PROBE_TOKEN] * self.block_size]
        missed = AssertionError("no round ran")
        for _ in range(rounds):
            seqs = {w.rank: await self.store(w, probe) for w in self.workers}
            try:
                await self._reach(replicas, seqs, GATE_ROUND_S)
                return
            except AssertionError as exc:
                missed = exc
        raise AssertionError(f"no live gate in {rounds} rounds: {missed}")

    # -- views and metrics ------------------------------------------------------------------

    async def agreed_view(self, replicas: Sequence[Replica]) -> CanonicalView:
        """Every replica's canonical view, asserted equal; the view."""
        views = await collect([r.url for r in replicas], token=self.cluster.token)
        errors = [f"{v.url}: {v.error}" for v in views if v.error is not None]
        assert not errors, errors
        comparison = compare(views)
        assert comparison.agree, [
            (d.other, [(str(rd.rank), len(rd.only_ref), len(rd.only_other)) for rd in d.ranks])
            for d in comparison.diffs
        ]
        canonical = views[0].canonical
        assert canonical is not None
        return canonical

    async def metrics(self, replica: Replica) -> dict[str, list[tuple[dict[str, str], float]]]:
        """name -> [(labels, value)] of every kvrouter_ sample the replica exports."""
        async with self.session.get(replica.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvrouter_"):
                    out.setdefault(sample.name, []).append((sample.labels, sample.value))
        return out
