"""Run a kvrouter replica for tests: in-process on a free loopback port, with a client.

    async with router_in_process(workers=[fw.url]) as rt:
        await rt.wait_cursor(fw.url, 0, last_seq)
        resp = await rt.post("/v1/completions", {...})

`wait_cursor` is how a test knows the replica has applied a batch: it polls the replica's
observable `/workers` view (never a sleep) with a bounded timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from router.app import REPLICA, Replica, ServeConfig, build_app
from tests.support.waiting import eventually


@dataclass
class RouterHandle:
    url: str
    session: aiohttp.ClientSession
    app: web.Application

    @property
    def replica(self) -> Replica:
        return self.app[REPLICA]

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any, dict[str, str]]:
        async with self.session.post(self.url + path, json=body, **kw) as resp:
            raw = await resp.read()
            try:
                payload: Any = await resp.json(content_type=None)
            except ValueError:
                payload = raw
            return resp.status, payload, dict(resp.headers)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def text(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.text()

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

    async def gate(self, fw: Any, dp_rank: int = 0, within_s: float = 10.0) -> int:
        """Probe a worker until the replica's subscription is live; returns the applied seq."""
        probe = fw.probe_for(dp_rank)
        async with asyncio.timeout(within_s):
            while True:
                seq = await probe()
                try:
                    await self.wait_cursor(fw.url, dp_rank, seq, within_s=0.2)
                    return seq
                except TimeoutError:
                    continue


@contextlib.asynccontextmanager
async def router_in_process(**config: Any) -> AsyncIterator[RouterHandle]:
    config.setdefault("host", "127.0.0.1")
    config.setdefault("port", 0)
    config.setdefault("block_size", 16)
    config.setdefault("health_interval_s", 0.2)
    config.setdefault("load_interval_ms", 100)
    config.setdefault("seed", 1)
    app = build_app(ServeConfig(**config))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            yield RouterHandle(f"http://127.0.0.1:{port}", session, app)
    finally:
        await runner.cleanup()
