"""A test's client for a kvrouter replica, and a replica run in-process on a free loopback port.

    async with router_in_process(workers=[fw.url]) as rt:
        await rt.wait_cursor(fw.url, 0, last_seq)
        resp = await rt.post("/v1/completions", {...})

`RouterClient` speaks only HTTP and sends the bearer token (`TEST_TOKEN` unless told
otherwise) to the routes that need it (`router.auth.guarded`); `router_in_process` configures
the same token, as the cluster's replicas do. The same calls serve an in-process replica
(`RouterHandle`, which also exposes the replica and its data plane) and a `kvrouter serve`
process (`tests.support.cluster.RouterProcess`). `wait_cursor` is how a test knows the replica
has applied a batch: it polls the replica's observable `/workers` view (never a sleep) with a
bounded timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from router import auth
from router.dataplane.server import DataPlane
from router.replica import Replica, ServeConfig
from router.serving import Serving, start_serving, stop_serving
from tests.support.fake_worker import FakeWorkerHandle
from tests.support.metrics import Scrape
from tests.support.waiting import eventually

# What every test replica is given (in process, and `kvrouter serve` processes through
# KVROUTER_INTERNAL_TOKEN) unless a test says otherwise.
TEST_TOKEN: Final = "test-internal-token-0123456789abcdef"


@dataclass
class RouterClient:
    url: str
    session: aiohttp.ClientSession
    token: str | None = field(default=TEST_TOKEN, kw_only=True)  # None: send none

    def headers(self, path: str) -> dict[str, str]:
        """The Authorization header for a guarded route, when the client has a token."""
        if self.token is None or not auth.guarded(path.split("?", 1)[0]):
            return {}
        return {"Authorization": f"Bearer {self.token}"}

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any, dict[str, str]]:
        kw["headers"] = {**self.headers(path), **kw.get("headers", {})}
        async with self.session.post(self.url + path, json=body, **kw) as resp:
            raw = await resp.read()
            try:
                payload: Any = await resp.json(content_type=None)
            except ValueError:
                payload = raw
            return resp.status, payload, dict(resp.headers)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path, headers=self.headers(path)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def delete(self, path: str) -> tuple[int, Any]:
        async with self.session.delete(self.url + path, headers=self.headers(path)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def text(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.url + path, headers=self.headers(path)) as resp:
            return resp.status, await resp.text()

    async def readyz(self) -> tuple[int, str]:
        """`/readyz`: the status and the reason it gives when not ready."""
        status, body = await self.get("/readyz")
        return status, body.get("reason", "") if isinstance(body, dict) else ""

    async def scrape(self) -> Scrape:
        async with self.session.get(self.url + "/metrics") as resp:
            assert resp.status == 200, resp.status
            return Scrape.parse(await resp.text())

    async def rank_view(self, worker_url: str, dp_rank: int) -> dict[str, Any] | None:
        _, body = await self.get("/workers")
        for worker in body["workers"]:
            if worker["url"] == worker_url.rstrip("/"):
                for rank in worker["ranks"]:
                    if rank["dp_rank"] == dp_rank:
                        return rank
        return None

    async def wait_cursor(
        self, worker_url: str, dp_rank: int, seq: int, within_s: float = 10.0
    ) -> dict[str, Any]:
        """Until the replica has applied `seq` (or later) for that rank."""

        async def reached() -> dict[str, Any] | None:
            view = await self.rank_view(worker_url, dp_rank)
            if view is not None and view["cursor"] is not None and view["cursor"] >= seq:
                return view
            return None

        return await eventually(reached, within_s)

    async def gate(self, fw: FakeWorkerHandle, dp_rank: int = 0, within_s: float = 10.0) -> int:
        """Probe a worker until the replica's subscription is live; returns the applied seq."""
        return await gate([self], fw, dp_rank, within_s)


async def gate(
    replicas: Sequence[RouterClient],
    fw: FakeWorkerHandle,
    dp_rank: int = 0,
    within_s: float = 10.0,
    attempt_s: float = 0.2,
) -> int:
    """Probe one rank until every replica has applied the probe; returns the probe's seq.

    A SUB socket misses what is published before its subscription reaches the publisher, and
    nothing says when that happened: a probe that did not arrive within `attempt_s` is
    followed by another one. Afterwards every replica receives every batch of the rank.
    """
    probe = fw.probe_for(dp_rank)
    async with asyncio.timeout(within_s):
        while True:
            seq = await probe()
            try:
                await asyncio.gather(
                    *(rt.wait_cursor(fw.url, dp_rank, seq, within_s=attempt_s) for rt in replicas)
                )
                return seq
            except TimeoutError:
                continue


def ranks_of(workers: Sequence[FakeWorkerHandle]) -> list[tuple[FakeWorkerHandle, int]]:
    """Every (worker, dp rank) of a fleet."""
    return [(fw, dp_rank) for fw in workers for dp_rank in range(fw.config.dp_size)]


async def gate_fleet(
    replicas: Sequence[RouterClient], workers: Sequence[FakeWorkerHandle], within_s: float = 15.0
) -> None:
    """`gate` every rank of every worker: each replica's subscriptions are all live."""
    for fw, dp_rank in ranks_of(workers):
        await gate(replicas, fw, dp_rank, within_s)


async def quiesce(
    replicas: Sequence[RouterClient], workers: Sequence[FakeWorkerHandle], within_s: float = 15.0
) -> dict[tuple[str, int], int]:
    """Until every replica applied each rank's last published seq; returns those seqs.

    Only after this may views be compared: before, they can differ by batches in flight.
    """
    last: dict[tuple[str, int], int] = {}
    for fw, dp_rank in ranks_of(workers):
        last[(fw.url, dp_rank)] = seq = (await fw.state(dp_rank))["last_seq"]
        if seq >= 0:
            await asyncio.gather(
                *(rt.wait_cursor(fw.url, dp_rank, seq, within_s) for rt in replicas)
            )
    return last


@dataclass
class RouterHandle(RouterClient):
    serving: Serving

    @property
    def replica(self) -> Replica:
        return self.serving.replica

    @property
    def plane(self) -> DataPlane:
        return self.serving.plane


@contextlib.asynccontextmanager
async def router_in_process(**config: Any) -> AsyncIterator[RouterHandle]:
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 0)
    config.setdefault("block_size", 16)
    config.setdefault("health_interval_s", 0.2)
    config.setdefault("load_interval_ms", 100)
    config.setdefault("seed", 1)
    config.setdefault("internal_token", TEST_TOKEN)
    serving = await start_serving(ServeConfig(**config))
    try:
        async with aiohttp.ClientSession() as session:
            yield RouterHandle(serving.url, session, serving, token=config["internal_token"])
    finally:
        await stop_serving(serving)
