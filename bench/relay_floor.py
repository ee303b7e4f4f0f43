"""The floor under kvrouter's request path: its data plane relaying, with no routing work.

Run: .venv/bin/python -m bench.relay_floor --port 0 --worker URL [--worker URL ...]
     [--event-loop auto|asyncio|uvloop]

It serves with kvrouter's own data plane (`router.dataplane`: the client Protocol and
httptools parser, the keep-alive upstream pool, the relay) and does the least a router must
do per request: read the body, send it to the next worker (round-robin), relay the answer as
it arrives. No JSON decode, tokenizing, keys, index or policy, no health checks and no KV
events. Its CPU per request at c=32 is what the HTTP hop costs on this machine before a router
decides anything, so a kvrouter row reads as "floor + routing + ingest", and the difference
between the two is the cost of the routing work alone.

It prints "relay listening on URL" once it serves, and stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import Sequence

from aiohttp import web

from cachetree.ranks import RankId
from router.cli import loop_factory
from router.dataplane.exchange import Refusal
from router.dataplane.inflight import InflightTracker
from router.dataplane.server import DataPlane, Limits
from router.metrics import RouterMetrics
from router.policy import Candidate, Decision
from router.workers import Worker

READY_PREFIX = "relay listening on "


class RoundRobin:
    """A `Router` that only takes turns (and the `WorkerLookup` of its fixed workers)."""

    def __init__(self, workers: Sequence[str]) -> None:
        if not workers:
            raise ValueError("the relay needs at least one --worker")
        self._workers = {url: Worker(url, state="ready", healthy=True) for url in workers}
        ranks = [Candidate(RankId(url, 0)) for url in self._workers]
        # Each decision lists every worker, starting with the next in turn (failover order).
        self._turns = itertools.cycle(
            [Decision(ranks[i:] + ranks[:i], "cache_miss", 0) for i in range(len(ranks))]
        )

    def route(self, route: bytes, raw: bytes) -> Decision | Refusal:
        return next(self._turns)

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)


async def start(host: str, port: int, workers: Sequence[str]) -> tuple[DataPlane, web.AppRunner]:
    """The relay, listening; returns its data plane (`.close()` it) and the empty control app."""
    urls = [w.rstrip("/") for w in workers]
    table = RoundRobin(urls)
    control = web.AppRunner(web.Application(), access_log=None)  # every other path: 404
    await control.setup()
    assert control.server is not None
    plane = DataPlane(table, table, InflightTracker(), RouterMetrics(), control.server, Limits())
    await plane.listen(host, port)
    return plane, control


async def serve(host: str, port: int, workers: Sequence[str]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    plane, control = await start(host, port, workers)
    server_port = plane.addresses[0][1]
    print(f"{READY_PREFIX}http://{host}:{server_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await plane.close()
        await control.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--worker", action="append", default=[], required=True)
    parser.add_argument("--event-loop", default="auto", choices=("auto", "asyncio", "uvloop"))
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        runner.run(serve(args.host, args.port, args.worker))


if __name__ == "__main__":
    main()
