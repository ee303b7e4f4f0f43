"""`kvrouter demo --pools N`: a fleet partitioned into pools, each with its own router replicas.

What it runs, as real processes on free loopback ports (docs/scaling.md says why and how this
maps onto Kubernetes):

- per pool `p` (model `pool-p-model`): two fake workers serving that model, and two
  `kvrouter serve` replicas that know only those workers and each other (`--peer`): the
  pool's own router Deployment, with its own index;
- in this process, a stand-in for the cluster's gateway: it reads the request body's `model`
  and forwards to one of that model's pool replicas in turn, as a Gateway API `HTTPRoute`
  matching the model name (the Inference Extension's body-based routing puts it in the
  `X-Gateway-Model-Name` header) sends traffic to that pool's `InferencePool`. A model no
  pool serves is answered 404, as a Gateway with no matching route does. It is a test double
  of what Kubernetes users already run, not a layer to deploy.

What it checks, with the costs: every request for a pool's model was answered by a worker of
that pool (`X-Kvrouter-Worker`) and no worker served another pool's model; each replica's
index holds blocks of its own pool's ranks only; the conversations' later turns found their
prefix cached (the workers' `X-Fake-Worker-Cached-Tokens`) in every pool; an unknown model
reached no worker. Exit 0 when every check held, 1 when one did not, 2 when the cluster could
not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from aiohttp import web

from router.auth import TOKEN_ENV
from router.tools.demo import (
    BLOCK_SIZE,
    ROUTER_READY,
    WORKER_READY,
    Cluster,
    DemoError,
    Router,
    Worker,
    _flags,
    free_ports,
    make_log_dir,
    probe_every_rank,
    quiesce,
)

REPLICAS_PER_POOL: Final = 2
CONVERSATIONS: Final = 4
TURNS: Final = 3
UNKNOWN_MODEL: Final = "no-such-model"
LIVE_GATE_ATTEMPTS: Final = 5


def model_of(pool: int) -> str:
    return f"pool-{pool}-model"


@dataclass
class Pool:
    index: int
    workers: list[Worker] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)  # URLs
    routers: list[Router] = field(default_factory=list)  # the replicas' processes

    @property
    def model(self) -> str:
        return model_of(self.index)

    @property
    def worker_urls(self) -> set[str]:
        return {w.url for w in self.workers}


class Gateway:
    """The stand-in for a Gateway + HTTPRoute per model: `model` in the body picks the pool."""

    def __init__(self, pools: list[Pool]) -> None:
        self._pools = {p.model: p for p in pools}
        self._turns = {p.model: itertools.cycle(p.replicas) for p in pools}
        self.unrouted = 0
        self._session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            model = (await request.json()).get("model")
        except ValueError:
            model = None
        if not isinstance(model, str):
            return web.json_response({"error": "a JSON body with a string model"}, status=400)
        if model not in self._pools:
            self.unrouted += 1
            return web.json_response({"error": f"no route for model {model!r}"}, status=404)
        assert self._session is not None
        replica = next(self._turns[model])
        async with self._session.post(
            replica + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            headers = {k: v for k, v in resp.headers.items() if k.lower().startswith("x-")}
            headers["X-Pool"] = str(self._pools[model].index)
            return web.Response(body=await resp.read(), status=resp.status, headers=headers)

    async def start(self) -> tuple[web.AppRunner, str]:
        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/v1/{tail:.*}", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_ports(1)
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, f"http://127.0.0.1:{port}"

    async def close(self, runner: web.AppRunner) -> None:
        await runner.cleanup()
        if self._session is not None:
            await self._session.close()


async def start_pool(cluster: Cluster, index: int, workers: int) -> Pool:
    pool = Pool(index)
    for i in range(workers):
        flags = _flags(
            host="127.0.0.1",
            port=0,
            kv_port_base=free_ports(1),
            block_size=BLOCK_SIZE,
            model=model_of(index),
            log_level="WARNING",
        )
        label = f"p{index}w{i + 1}"
        argv = [sys.executable, "-m", "fake_kv_worker", *flags]
        pool.workers.append(Worker(label, 1, cluster.child(f"worker-{label}", argv)))
    await asyncio.gather(*(w.child.start() for w in pool.workers))
    urls = await asyncio.gather(*(w.child.wait_line(WORKER_READY) for w in pool.workers))
    for worker, url in zip(pool.workers, urls, strict=True):
        worker.url = url
        cluster.workers.append(worker)
    ports = [free_ports(1) for _ in range(REPLICAS_PER_POOL)]
    pool.replicas = urls = [f"http://127.0.0.1:{port}" for port in ports]
    for r, (port, url) in enumerate(zip(ports, urls, strict=True)):
        argv = [
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            *_flags(host="127.0.0.1", port=port, block_size=BLOCK_SIZE, log_level="info"),
            "--expose-route-headers",
            *(arg for w in pool.workers for arg in ("--worker", w.url)),
            *(arg for peer in urls if peer != url for arg in ("--peer", peer)),
        ]
        name = f"router-p{index}r{r + 1}"
        child = cluster.child(name, argv, {TOKEN_ENV: cluster.token})
        pool.routers.append(Router(name, "cache_aware", url, child))
    await asyncio.gather(*(r.child.start() for r in pool.routers))
    await asyncio.gather(*(r.child.wait_line(ROUTER_READY) for r in pool.routers))
    return pool


async def wait_ready(session: aiohttp.ClientSession, urls: list[str]) -> None:
    async with asyncio.timeout(60):
        for url in urls:
            while True:
                try:
                    async with session.get(url + "/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)


async def live_gate(session: aiohttp.ClientSession, cluster: Cluster, pool: Pool) -> None:
    """Until the pool's replicas follow its workers' streams: one probe batch per rank, and
    every replica's cursor at each rank's last seq. A probe published before a replica's SUB
    socket joined is lost to it, so the probe is sent again until the cursors catch up (the
    next batch reveals the gap, which the replica replays)."""
    for attempt in range(1, LIVE_GATE_ATTEMPTS + 1):
        await probe_every_rank(session, cluster, pool.workers)
        try:
            await quiesce(session, cluster, pool.routers, pool.workers, timeout_s=2.0)
            return
        except DemoError:
            if attempt == LIVE_GATE_ATTEMPTS:
                raise


@dataclass
class Tally:
    requests: Counter[tuple[int, str]] = field(default_factory=Counter)  # (pool, worker)
    crossed: int = 0  # answered by a worker of another pool
    prompt_tokens: Counter[int] = field(default_factory=Counter)
    cached_tokens: Counter[int] = field(default_factory=Counter)
    failed: int = 0


async def drive(
    session: aiohttp.ClientSession, gateway: str, pools: list[Pool], tally: Tally
) -> None:
    """Conversations per pool, turn by turn: each turn resends the whole conversation."""
    for turn in range(TURNS):
        for pool in pools:
            for c in range(CONVERSATIONS):
                system = f"You answer questions about pool {pool.index}'s product line {c}. " * 8
                prompt = system + " ".join(f"Question {t}: tell me more." for t in range(turn + 1))
                body = {"model": pool.model, "prompt": prompt, "max_tokens": 2}
                async with session.post(gateway + "/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        tally.failed += 1
                        continue
                    worker = resp.headers.get("X-Kvrouter-Worker", "")
                    tally.requests[(pool.index, worker)] += 1
                    if worker not in pool.worker_urls:
                        tally.crossed += 1
                    tally.prompt_tokens[pool.index] += len(prompt.encode())
                    tally.cached_tokens[pool.index] += int(
                        resp.headers.get("X-Fake-Worker-Cached-Tokens", "0")
                    )


async def ranks_indexed(session: aiohttp.ClientSession, replica: str, token: str) -> set[str]:
    """Worker URLs whose ranks hold blocks in this replica's index."""
    headers = {"Authorization": f"Bearer {token}"}
    async with session.get(replica + "/workers", headers=headers) as resp:
        view: dict[str, Any] = await resp.json()
    return {w["url"] for w in view["workers"] if any(r["blocks"] for r in w["ranks"])}


async def run_pools(pools_n: int, workers: int, log_dir: Path) -> int:
    cluster = Cluster(log_dir)
    gateway = None
    runner = None
    try:
        pools = [await start_pool(cluster, p, workers) for p in range(pools_n)]
        gateway = Gateway(pools)
        runner, gateway_url = await gateway.start()
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, [r for p in pools for r in p.replicas])
            for pool in pools:
                await live_gate(session, cluster, pool)
            tally = Tally()
            await drive(session, gateway_url, pools, tally)
            body = {"model": UNKNOWN_MODEL, "prompt": "hello", "max_tokens": 1}
            async with session.post(gateway_url + "/v1/completions", json=body) as resp:
                unknown_status = resp.status
            indexed = {
                r: await ranks_indexed(session, r, cluster.token) for p in pools for r in p.replicas
            }
        return report(pools, tally, indexed, unknown_status, gateway.unrouted)
    except (DemoError, aiohttp.ClientError, OSError, TimeoutError) as exc:
        sys.stderr.write(f"kvrouter demo --pools: error: {exc!r}\n")
        return 2
    finally:
        if gateway is not None and runner is not None:
            await gateway.close(runner)
        await cluster.stop_all()


def report(
    pools: list[Pool],
    tally: Tally,
    indexed: dict[str, set[str]],
    unknown_status: int,
    unrouted: int,
) -> int:
    print(f"{'pool':<6}{'model':<16}{'workers':>8}{'replicas':>9}{'requests':>9}{'cached':>8}")
    checks: list[tuple[bool, str]] = []
    for p in pools:
        served = sum(n for (pool, _), n in tally.requests.items() if pool == p.index)
        ratio = tally.cached_tokens[p.index] / max(1, tally.prompt_tokens[p.index])
        print(
            f"{p.index:<6}{p.model:<16}{len(p.workers):>8}{len(p.replicas):>9}{served:>9}"
            f"{ratio:>8.2f}"
        )
        checks.append((served == CONVERSATIONS * TURNS, f"pool {p.index}: every request served"))
        checks.append((ratio > 0.3, f"pool {p.index}: later turns found their prefix cached"))
        for replica in p.replicas:
            own = indexed[replica]
            checks.append(
                (
                    bool(own) and own <= p.worker_urls,
                    f"pool {p.index}: replica {replica} indexes its own pool's ranks only",
                )
            )
    checks.append((tally.crossed == 0, "no request was answered by another pool's worker"))
    checks.append((tally.failed == 0, "no request failed"))
    checks.append((unknown_status == 404 and unrouted == 1, "an unknown model reaches no pool"))
    for ok, what in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
    return 0 if all(ok for ok, _ in checks) else 1


def _as_ctrl_c(signum: int, frame: object) -> None:
    signal.raise_signal(signal.SIGINT)


def run(args: argparse.Namespace) -> int:
    if args.pools < 2 or args.pools > 8:
        sys.stderr.write("kvrouter: error: --pools must be 2..8\n")
        return 2
    workers = 2  # per pool
    log_dir = make_log_dir(args.log_dir, "kvpools-")
    if log_dir is None:
        return 2
    # SIGTERM ends it as Ctrl-C does: asyncio.run cancels the run, whose `finally` stops every
    # child, then raises KeyboardInterrupt (a traceback, the logs' directory left unsaid).
    previous = signal.signal(signal.SIGTERM, _as_ctrl_c)
    try:
        status = asyncio.run(run_pools(args.pools, workers, log_dir))
    except KeyboardInterrupt:
        sys.stderr.write("kvrouter demo --pools: interrupted; every child process is stopped\n")
        status = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if status == 0 and not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not args.log_dir:
        sys.stderr.write(f"kvrouter demo --pools: the children's logs are kept in {log_dir}\n")
    return status
