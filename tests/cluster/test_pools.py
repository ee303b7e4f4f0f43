"""Two pools, each with its own workers and router replicas, behind a model-name route:
`kvrouter demo --pools 2` as real processes. Every request lands in its model's pool, each
replica's index holds only its pool's ranks, later turns hit the cache, an unknown model
reaches no pool; and the gateway stand-in's rules, request by request."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from router.tools.demo import Cluster, quiesce, worker_counters
from router.tools.pools import (
    CONVERSATIONS,
    TURNS,
    Gateway,
    Pool,
    live_gate,
    ranks_indexed,
    start_pool,
    wait_ready,
)
from tests.support.ports import free_tcp_port

pytestmark = pytest.mark.timeout(120)


async def test_the_pools_demo_keeps_every_pool_to_itself() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "demo",
        "--pools",
        "2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 0, text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[1], r[4]) for r in rows] == [
        ("0", "pool-0-model", str(CONVERSATIONS * TURNS)),
        ("1", "pool-1-model", str(CONVERSATIONS * TURNS)),
    ]
    assert all(float(r[5]) > 0.3 for r in rows)  # later turns found their prefix cached
    assert "FAILED" not in text
    assert text.count("indexes its own pool's ranks only") == 4


async def test_the_gateway_routes_by_model_and_refuses_what_it_cannot_route() -> None:
    seen: list[tuple[str, bytes]] = []

    async def replica(request: web.Request) -> web.Response:
        seen.append((request.host, await request.read()))
        return web.json_response({"ok": True}, headers={"X-Kvrouter-Worker": "w"})

    runners, urls = [], []
    for _ in range(3):
        app = web.Application()
        app.router.add_post("/v1/completions", replica)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_tcp_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    pools = [Pool(0, replicas=urls[:2]), Pool(1, replicas=urls[2:])]
    gateway = Gateway(pools)
    front, url = await gateway.start()
    try:
        async with aiohttp.ClientSession() as s:
            for model, n in (("pool-0-model", 4), ("pool-1-model", 2)):
                for _ in range(n):
                    body = {"model": model, "prompt": "x"}
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200 and resp.headers["X-Pool"] == model[5]
            async with s.post(url + "/v1/completions", json={"model": "other"}) as resp:
                assert resp.status == 404
            async with s.post(url + "/v1/completions", data=b"not json") as resp:
                assert resp.status == 400
    finally:
        await gateway.close(front)
        for runner in runners:
            await runner.cleanup()
    hosts = [host for host, _ in seen]
    # Pool 0's four requests alternate between its two replicas; pool 1's go to its one.
    assert hosts.count(urls[0][7:]) == 2 and hosts.count(urls[1][7:]) == 2
    assert hosts.count(urls[2][7:]) == 2
    assert gateway.unrouted == 1 and len(seen) == 6  # the refused ones reached no replica


async def test_the_live_gate_returns_once_every_replica_follows_its_pools_streams(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path)
    try:
        pool = await start_pool(cluster, 0, 2)
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, pool.replicas)
            await live_gate(session, cluster, pool)
            last = await worker_counters(session, pool.workers)
            # every replica's cursor already at each rank's last seq: the probes were applied
            assert last and all(c.last_seq >= 0 for c in last.values())
            await quiesce(session, cluster, pool.routers, pool.workers, timeout_s=0.5)
            for url in pool.replicas:
                assert await ranks_indexed(session, url, cluster.token) == pool.worker_urls
    finally:
        await cluster.stop_all()
