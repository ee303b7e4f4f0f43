"""Ingest: KV events from N fake workers over real ZMQ into one replica, until it falls behind.

The replica is a real `kvrouter serve` process in front of N fake workers that run in this
process (real HTTP and ZMQ PUB sockets on loopback). Each worker's publisher sends pre-encoded
vLLM batches (`bench_ingest.stream`: 4 events a batch, 8 blocks x 16 tokens an event, stores
and evictions mixed so the index stays bounded; a different seed per worker); when a worker's
stream is used up it publishes an `AllBlocksCleared` and starts it again, so every batch stays
coherent with what the replica holds. Pre-encoding keeps this process's cost per batch to a
ZMQ send, so the replica, not the load generator, is what runs out of CPU first.

Ramp: the offered rate (blocks/s over all workers) doubles step by step; each step publishes
for `step_s`, paced every 5 ms, then waits until the replica's cursor for every rank reached
the publisher's `last_seq` (`GET /workers`). A step is kept up with when that catch-up takes
at most 0.5 s (or 20% of the step: the machine is shared, and polling `/workers` takes
time too); the first step that is not ends the ramp. The replica's
capacity is the best applied rate seen (blocks published / (step + catch-up)).

On one core: with `taskset` and at least two CPUs, the replica (all its threads, ZMQ's I/O
thread included) is pinned to the last CPU and this process (the publishers) to the others,
so the capacity is what one core gives it at most. On a machine shared with other work that
core is not the replica's alone, so each step also reports the blocks applied per CPU-second
the replica used (from /proc): what a whole core would give it.

Then the routing latency: non-streaming 2,000-token completions at concurrency 1 through the
replica (the prompts of `bench_proxy.py`), while the workers publish at 0%, 50% and 90% of
that capacity. A stale gap (a seq the replica never received) would show in its
`kvrouter_kv_event_batches_lost` series, which is read after each phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench import bench_ingest, bench_proxy, plots
from bench.report import table
from cachetree import accel
from fake_kv_worker.wire import Cleared, encode_vllm
from router.tools import demo
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_tcp_port

BLOCKS_PER_BATCH: Final = bench_ingest.EVENTS_PER_BATCH * bench_ingest.BLOCKS
EVENTS_PER_BATCH: Final = bench_ingest.EVENTS_PER_BATCH
TICK_S: Final = 0.005
CATCH_UP_BOUND_S: Final = 30.0
FRACTIONS: Final = (0.0, 0.5, 0.9)


@dataclass(frozen=True)
class Scale:
    workers: int
    batches_per_worker: int  # the pre-encoded stream, reused after a clear
    first_rate: int  # blocks/s
    steps: int
    step_s: float
    latency_s: float


def scale(quick: bool) -> Scale:
    if quick:
        return Scale(4, 800, 25_000, 4, 1.5, 2.0)
    return Scale(8, 2500, 25_000, 8, 3.0, 8.0)


class Feed:
    """One worker's endless, coherent stream of pre-encoded batches."""

    def __init__(self, handle: FakeWorkerHandle, payloads: list[bytes]) -> None:
        assert handle.worker is not None
        self.publisher = handle.worker.publishers[0]
        self.payloads = payloads
        self.clear = encode_vllm(time.time(), [Cleared()], 0)
        self.next = 0
        self.blocks = 0

    def publish(self) -> None:
        if self.next == len(self.payloads):
            self.publisher.publish(self.clear)
            self.next = 0
        self.publisher.publish(self.payloads[self.next])
        self.next += 1
        self.blocks += BLOCKS_PER_BATCH


async def pace(feeds: Sequence[Feed], rate: float, seconds: float) -> float:
    """Publish at `rate` blocks/s over all feeds for `seconds`; the rate actually offered."""
    if rate <= 0:
        await asyncio.sleep(seconds)
        return 0.0
    start = time.perf_counter()
    sent = 0
    blocks_before = sum(f.blocks for f in feeds)
    while (now := time.perf_counter() - start) < seconds:
        due = int(now * rate / BLOCKS_PER_BATCH) - sent
        for _ in range(due):
            feeds[sent % len(feeds)].publish()
            sent += 1
        await asyncio.sleep(TICK_S)
    return (sum(f.blocks for f in feeds) - blocks_before) / (time.perf_counter() - start)


async def caught_up(
    session: aiohttp.ClientSession, router: str, feeds: Sequence[Feed], handles: Sequence[Any]
) -> float:
    """Seconds until the replica's cursor for every rank reached its publisher's last_seq."""
    start = time.perf_counter()
    want = {h.url: f.publisher.last_seq for h, f in zip(handles, feeds, strict=True)}
    while time.perf_counter() - start < CATCH_UP_BOUND_S:
        async with session.get(router + "/workers", headers=bench_proxy.AUTH) as resp:
            view = await resp.json()
        cursors = {w["url"]: w["ranks"][0]["cursor"] for w in view["workers"]}
        if all((cursors.get(url) or -1) >= seq for url, seq in want.items()):
            return time.perf_counter() - start
        await asyncio.sleep(0.01)
    return float("inf")


async def gaps(session: aiohttp.ClientSession, router: str) -> float:
    async with session.get(router + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvrouter_kv_event_batches_lost") and not line.startswith("#")
    )


async def latency_phase(
    session: aiohttp.ClientSession,
    router: str,
    feeds: Sequence[Feed],
    rate: float,
    seconds: float,
    prompts: bench_proxy.Prompts,
) -> dict[str, Any]:
    result = bench_proxy.LoadResult()
    stop = asyncio.Event()

    async def requests() -> None:
        target = router + "/v1/completions"
        while not stop.is_set():
            for body in prompts.bodies(4):
                await bench_proxy.one_request(session, target, body, result)

    task = asyncio.create_task(requests())
    try:
        offered = await pace(feeds, rate, seconds)
    finally:
        stop.set()
        await task
    lat = result.latencies_ms
    return {
        "offered_blocks_per_s": offered,
        "requests": result.requests,
        "errors": result.errors,
        "p50_ms": bench_proxy.percentile(lat, 50),
        "p99_ms": bench_proxy.percentile(lat, 99),
    }


async def gate(session: aiohttp.ClientSession, router: str, handles: Sequence[Any]) -> None:
    """Probe every worker until the replica applied a probe of each (its subscriptions live)."""
    async with asyncio.timeout(30):
        for h in handles:
            while True:
                seq = await h.probe()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.3):
                        while True:
                            async with session.get(
                                router + "/workers", headers=bench_proxy.AUTH
                            ) as resp:
                                view = await resp.json()
                            cursor = next(
                                w["ranks"][0]["cursor"]
                                for w in view["workers"]
                                if w["url"] == h.url
                            )
                            if cursor is not None and cursor >= seq:
                                break
                            await asyncio.sleep(0.01)
                    break


async def run_async(ctx: Any, s: Scale) -> dict[str, Any]:
    ctx.progress(f"pre-encoding {s.workers} x {s.batches_per_worker:,} batches")
    streams = [
        bench_ingest.stream(True, seed=i + 1, batches=s.batches_per_worker)[0]
        for i in range(s.workers)
    ]
    async with contextlib.AsyncExitStack() as stack:
        handles = [
            await stack.enter_async_context(fake_worker_in_process(cache_blocks=1 << 20))
            for _ in range(s.workers)
        ]
        port = free_tcp_port()
        # demo.Child drops KVROUTER_ variables; this one (the pure path, to compare) is kept.
        pure = os.environ.get(accel.NO_EXTENSIONS_ENV, "")
        core = pin_core()
        argv = [
            *(["taskset", "-c", str(core)] if core is not None else []),
            *(["env", f"{accel.NO_EXTENSIONS_ENV}={pure}"] if pure else []),
            str(bench_proxy.BIN / "kvrouter"),
            *bench_proxy.router_args(port, [h.url for h in handles], "cache_aware"),
        ]
        if core is not None:  # the publishers keep off the replica's core
            cores = os.sched_getaffinity(0)
            os.sched_setaffinity(0, cores - {core})
            stack.callback(os.sched_setaffinity, 0, cores)
        child = demo.Child("kvrouter", argv, ctx.workdir / "ingest-router.log")
        await child.start()
        stack.push_async_callback(child.stop)
        router = await child.wait_line(demo.ROUTER_READY)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        await bench_proxy.wait_ready(session, router)
        await gate(session, router, handles)
        feeds = [Feed(h, p) for h, p in zip(handles, streams, strict=True)]
        assert child.proc is not None
        pid = child.proc.pid
        steps = []
        rate = float(s.first_rate)
        for _ in range(s.steps):
            ctx.progress(f"offering {rate:,.0f} blocks/s for {s.step_s:g} s")
            blocks0, cpu0 = sum(f.blocks for f in feeds), bench_proxy.cpu_seconds(pid)
            offered = await pace(feeds, rate, s.step_s)
            lag = await caught_up(session, router, feeds, handles)
            blocks = sum(f.blocks for f in feeds) - blocks0
            cpu = bench_proxy.cpu_seconds(pid) - cpu0
            kept = lag <= max(0.5, 0.2 * s.step_s)
            steps.append(
                {
                    "target_blocks_per_s": rate,
                    "offered_blocks_per_s": offered,
                    "catch_up_s": lag,
                    "applied_blocks_per_s": blocks / (s.step_s + lag),
                    "router_cpu_share": cpu / (s.step_s + lag),
                    "blocks_per_cpu_s": blocks / cpu if cpu > 0 else 0.0,
                    "kept_up": kept,
                }
            )
            if not kept:
                break
            rate *= 2
        capacity = max(x["applied_blocks_per_s"] for x in steps)
        prompts = bench_proxy.Prompts()
        latency = []
        for fraction in FRACTIONS:
            ctx.progress(f"routing latency while ingesting at {fraction:.0%} of capacity")
            phase = await latency_phase(
                session, router, feeds, fraction * capacity, s.latency_s, prompts
            )
            phase["catch_up_s"] = await caught_up(session, router, feeds, handles)
            latency.append({"fraction": fraction, **phase})
        stale = await gaps(session, router)
    kept_steps = [x for x in steps if x["kept_up"]] or steps
    busiest = max(kept_steps, key=lambda x: x["applied_blocks_per_s"])
    return {
        "scale": s.__dict__,
        "pinned_core": core,
        "steps": steps,
        "capacity_blocks_per_s": capacity,
        # at the busiest step kept up with (idle steps are dominated by fixed costs)
        "blocks_per_cpu_s": busiest["blocks_per_cpu_s"],
        "capacity_events_per_s": capacity / bench_ingest.BLOCKS,
        "latency": latency,
        "gaps": stale,
    }


def pin_core() -> int | None:
    """The CPU the replica is pinned to: the last one this process may use, when there are
    two or more and `taskset` is installed; None runs it unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or shutil.which("taskset") is None:
        return None
    return cores[-1]


def run(ctx: Any) -> dict[str, Any]:
    return asyncio.run(run_async(ctx, scale(ctx.quick)))


def tables(result: dict[str, Any]) -> dict[str, str]:
    s = result["scale"]
    core = result.get("pinned_core")
    pinned = "" if core is None else f" pinned to one core (CPU {core}; the publishers off it)"
    ramp = table(
        [
            "offered blocks/s",
            "events/s",
            "applied blocks/s",
            "catch-up after the step s",
            "replica CPU (cores)",
            "blocks per replica CPU-second",
            "kept up",
        ],
        [
            [
                round(x["offered_blocks_per_s"]),
                round(x["offered_blocks_per_s"] / bench_ingest.BLOCKS),
                round(x["applied_blocks_per_s"]),
                x["catch_up_s"],
                x["router_cpu_share"],
                round(x["blocks_per_cpu_s"]),
                x["kept_up"],
            ]
            for x in result["steps"]
        ],
        note=f"{s['workers']} fake workers, one rank each, over ZMQ into one `kvrouter serve`"
        f"{pinned}; {s['step_s']:g} s per step; an event is a BlockStored or BlockRemoved of 8 "
        f"blocks. Capacity: {result['capacity_blocks_per_s']:,.0f} blocks/s "
        f"({result['capacity_events_per_s']:,.0f} events/s); "
        f"{result['blocks_per_cpu_s']:,.0f} blocks per replica CPU-second at the busiest step "
        f"kept up with. Stale gaps seen by the replica: {result['gaps']:.0f}.",
    )
    lat = table(
        ["ingest load", "blocks/s offered", "requests", "latency p50 ms", "p99 ms", "errors"],
        [
            [
                f"{x['fraction']:.0%} of capacity",
                round(x["offered_blocks_per_s"]),
                x["requests"],
                x["p50_ms"],
                x["p99_ms"],
                x["errors"],
            ]
            for x in result["latency"]
        ],
        note="Non-streaming 2,000-token completions at concurrency 1 through the replica, "
        f"{s['latency_s']:g} s per row; the fake workers answer at once, so the latency is the "
        "router's hop plus loopback HTTP.",
    )
    return {"ingest-ramp": ramp, "ingest-latency": lat}


def plot(result: dict[str, Any], plt: Any, out: Path) -> list[Path]:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = result["steps"]
    offered = [x["offered_blocks_per_s"] for x in steps]
    ramp: list[plots.Line] = [
        (offered, [x["applied_blocks_per_s"] for x in steps], "o-", "applied"),
        (offered, offered, "--", "offered"),
    ]
    plots.panel(left, "one replica's ingest over ZMQ", "offered blocks/s", "blocks/s", ramp)
    lat = result["latency"]
    names = [f"{x['fraction']:.0%}" for x in lat]
    latency: list[plots.Line] = [
        (names, [x["p50_ms"] for x in lat], "o-", "p50"),
        (names, [x["p99_ms"] for x in lat], "s-", "p99"),
    ]
    plots.panel(
        right, "routing latency while ingesting", "ingest load, share of capacity", "ms", latency
    )
    return [plots.save(plt, fig, out / "ingest.png")]
