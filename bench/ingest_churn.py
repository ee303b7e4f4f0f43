"""Replica CPU per stored block with eviction churn: full-cache requests' events over real ZMQ.

What one replica spends to ingest what a busy fleet publishes once its caches are full. 4 fake
workers (in this process, real ZMQ PUB sockets on loopback) publish the batches their engines
produce for 2,000-token prompts (one of 8 shared 1,000-token system prompts + 1,000 unique
tokens) into full caches: per prompt one batch of ~63 one-block `BlockRemoved` events (the
evictions that make room) and one ~63-block `BlockStored`, exactly as `fake_kv_worker`'s engine
emits them. The batches are produced by the fake worker's own `RankEngine` before the
measurement (so this process's cost per batch is a ZMQ send) and published at a steady rate
(default 400 batches/s over all workers, the request rate of the proxy benchmark) into a real
`kvrouter serve` child process. First each worker's cache is filled (not measured), then the
measured phase; the replica's CPU (all its threads, from /proc) over the measured phase and its
catch-up, divided by the blocks stored, is the figure. The replica runs with its load and health
polls slowed down, and its CPU while idle is measured and printed beside it, so the figure is
ingest's.

`--baseline REV` runs the same rounds against the code of another commit (extracted with
`git archive` into a temporary directory and put first on the child's PYTHONPATH; its
`cachetree/_speedups.c`, if it has one, is compiled there with the flags this Python was built
with, so a compiled baseline is compared with compiled code), and `--pure` against this
checkout with `KVROUTER_NO_EXTENSIONS=1` (its pure-Python path); all interleaved round by
round; the medians and ranges of each are printed, with the accelerator each replica reported
in `kvrouter_accelerator_info`.

Run: .venv/bin/python bench/ingest_churn.py [--baseline HEAD~1] [--pure] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_proxy
from bench.bench_proxy import checkout
from bench.ingest_zmq import gate
from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.engine import RankEngine
from router.tools import demo
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_tcp_port

ROOT: Final = Path(__file__).resolve().parents[1]
BLOCK_SIZE: Final = 16
SYSTEM_PROMPTS: Final = 8
SYSTEM_TOKENS: Final = 1000
PROMPT_TOKENS: Final = 2000
TICK_S: Final = 0.005


class _Capture:
    """An `EventSink` that keeps the payloads instead of sending them."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    @property
    def last_seq(self) -> int:
        return len(self.payloads) - 1

    def publish(self, payload: bytes) -> int:
        self.payloads.append(payload)
        return self.last_seq

    def restart(self) -> None:
        self.payloads.clear()


@dataclass
class Workload:
    warm: list[bytes]  # fills the cache; not measured
    measured: list[bytes]
    stored_blocks: int  # blocks stored by `measured`
    removed_blocks: int


def workload(seed: int, cache_blocks: int, prompts: int) -> Workload:
    """One worker's batches, produced by the fake worker's engine with a capturing sink."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 50_000) for _ in range(SYSTEM_TOKENS)] for _ in range(8)]
    sink = _Capture()
    engine = RankEngine(
        0, WorkerConfig(cache_blocks=cache_blocks), sink, wall_clock=lambda: 1767225600.0
    )

    def prompt(i: int) -> list[int]:
        unique = [rng.randrange(3, 50_000) for _ in range(PROMPT_TOKENS - SYSTEM_TOKENS)]
        return systems[i % SYSTEM_PROMPTS] + unique

    i = 0
    while len(engine.cache) < cache_blocks:  # fill: each prompt adds ~63 blocks
        engine.admit_request(prompt(i))
        i += 1
    for _ in range(3):  # and a few evicting ones, so the measured phase starts in the regime
        engine.admit_request(prompt(i))
        i += 1
    warm = list(sink.payloads)
    sink.payloads.clear()
    misses = engine.miss_blocks
    for _ in range(prompts):
        engine.admit_request(prompt(i))
        i += 1
    stored = engine.miss_blocks - misses
    return Workload(warm, list(sink.payloads), stored, stored)


async def publish_paced(
    handles: Sequence[FakeWorkerHandle], streams: Sequence[list[bytes]], rate: float
) -> float:
    """Publish every stream round-robin at `rate` batches/s over all workers; seconds taken."""
    publishers = [h.worker.publishers[0] for h in handles if h.worker is not None]
    total = sum(len(s) for s in streams)
    order = [
        (w, s[i])
        for i in range(max(map(len, streams)))
        for w, s in enumerate(streams)
        if i < len(s)
    ]
    assert len(order) == total
    start = time.perf_counter()
    sent = 0
    while sent < total:
        due = min(total, int((time.perf_counter() - start) * rate) + 1)
        while sent < due:
            w, payload = order[sent]
            publishers[w].publish(payload)
            sent += 1
        await asyncio.sleep(TICK_S)
    return time.perf_counter() - start


async def wait_caught_up(
    session: aiohttp.ClientSession, router: str, handles: Sequence[FakeWorkerHandle]
) -> float:
    start = time.perf_counter()
    want = {h.url: h.worker.publishers[0].last_seq for h in handles if h.worker is not None}
    async with asyncio.timeout(120):
        while True:
            async with session.get(router + "/workers", headers=bench_proxy.AUTH) as resp:
                view = await resp.json()
            cursors = {w["url"]: w["ranks"][0]["cursor"] for w in view["workers"]}
            if all(
                (cursors.get(u) if cursors.get(u) is not None else -1) >= s for u, s in want.items()
            ):
                return time.perf_counter() - start
            await asyncio.sleep(0.02)


async def replica_metrics(session: aiohttp.ClientSession, router: str) -> tuple[float, str]:
    """Batches the replica counted lost, and the accelerator it reports ("-" if none)."""
    async with session.get(router + "/metrics") as resp:
        text = await resp.text()
    lost = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvrouter_kv_event_batches_lost") and not line.startswith("#")
    )
    found = re.search(r'^kvrouter_accelerator_info\{implementation="(\w+)"', text, re.M)
    return lost, found.group(1) if found else "-"


@dataclass(frozen=True)
class Code:
    label: str
    path: Path  # first on the child's PYTHONPATH
    env: dict[str, str]  # KVROUTER_ variables for the child


async def start_router(
    code: Code,
    handles: Sequence[FakeWorkerHandle],
    workdir: Path,
    extra: Sequence[str] = (),
    profile: Path | None = None,
) -> tuple[demo.Child, str]:
    """A `kvrouter serve` child running `code`, and its URL once it listens."""
    port = free_tcp_port()
    runner = ["-m", "router.cli"]
    if profile is not None:  # cProfile over the measured phase only (CPU clock)
        runner = [str(ROOT / "bench" / "profiled_router.py"), str(profile), "cpu"]
    # demo.Child drops KVROUTER_ variables from the environment it passes on: `env` sets them.
    argv = [
        *(["env", *(f"{k}={v}" for k, v in code.env.items())] if code.env else []),
        sys.executable,
        "-P",  # no current directory or script directory first on sys.path: `code` wins
        *runner,
        *bench_proxy.router_args(port, [h.url for h in handles], "cache_aware"),
        # Ingest is what is measured: the worker polls stay out of the way.
        *("--load-interval-ms", "600000", "--health-interval-s", "600"),
        *extra,
    ]
    child = demo.Child(code.label, argv, workdir / f"router-{code.label.split()[0]}.log")
    # The child imports `router` from `code`: PYTHONPATH comes before the editable install,
    # and -P keeps the current directory (this checkout) off the front of sys.path.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(code.path)
    try:
        await child.start()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        return child, await child.wait_line(demo.ROUTER_READY)
    except BaseException:
        await child.stop()
        raise


async def one_round(
    code: Code,
    handles: Sequence[FakeWorkerHandle],
    loads: Sequence[Workload],
    rate: float,
    workdir: Path,
    profile: Path | None = None,
) -> dict[str, Any]:
    child, router = await start_router(code, handles, workdir, profile=profile)
    try:
        assert child.proc is not None
        pid = child.proc.pid
        async with aiohttp.ClientSession() as session:
            await bench_proxy.wait_ready(session, router)
            await gate(session, router, handles)
            await publish_paced(handles, [w.warm for w in loads], rate * 4)
            await wait_caught_up(session, router, handles)
            idle0, t0 = bench_proxy.cpu_seconds(pid), time.perf_counter()
            await asyncio.sleep(1.0)
            idle_rate = (bench_proxy.cpu_seconds(pid) - idle0) / (time.perf_counter() - t0)
            if profile is not None:
                os.kill(pid, signal.SIGUSR1)
            cpu0, loop0, t0 = bench_proxy.cpu_seconds(pid), loop_cpu(pid), time.perf_counter()
            await publish_paced(handles, [w.measured for w in loads], rate)
            lag = await wait_caught_up(session, router, handles)
            cpu = bench_proxy.cpu_seconds(pid) - cpu0
            loop = loop_cpu(pid) - loop0
            elapsed = time.perf_counter() - t0
            if profile is not None:
                os.kill(pid, signal.SIGUSR2)
                bench_proxy.wait_for_file(Path(f"{profile}.done"), 30)
            lost, implementation = await replica_metrics(session, router)
    finally:
        await child.stop()
    stored = sum(w.stored_blocks for w in loads)
    return {
        "label": code.label,
        "accelerator": implementation,
        "cpu_s": cpu,
        "elapsed_s": elapsed,
        "catch_up_s": lag,
        "idle_cores": idle_rate,
        "stored_blocks": stored,
        "batches": sum(len(w.measured) for w in loads),
        "us_per_stored_block": cpu / stored * 1e6,
        "loop_share": loop / cpu if cpu else 0.0,
        "us_per_stored_block_net": max(0.0, cpu - idle_rate * elapsed) / stored * 1e6,
        "lost_batches": lost,
    }


def loop_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread (the event loop; ZMQ's I/O threads excluded)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def summary(rows: list[dict[str, Any]], key: str) -> str:
    values = sorted(r[key] for r in rows)
    return f"{statistics.median(values):,.2f} ({values[0]:,.2f}-{values[-1]:,.2f})"


async def main_async(args: argparse.Namespace) -> None:
    codes = [Code("new", ROOT, {})]
    if args.pure:
        codes.append(Code("new, pure", ROOT, {"KVROUTER_NO_EXTENSIONS": "1"}))
    with tempfile.TemporaryDirectory(prefix="kvchurn-") as tmp:
        if args.baseline:  # first: a bad revision ends the run before any work
            old = checkout(args.baseline, Path(tmp) / "old")
            codes.insert(0, Code(f"old ({args.baseline})", old, {}))
        loads = [
            workload(seed, args.cache_blocks, args.prompts) for seed in range(1, args.workers + 1)
        ]
        stored = sum(w.stored_blocks for w in loads)
        print(
            f"{args.workers} workers x {args.prompts} prompts of {PROMPT_TOKENS} tokens into "
            f"full caches of {args.cache_blocks} blocks: {stored:,} blocks stored (and as many "
            f"evicted) in {sum(len(w.measured) for w in loads):,} batches, published at "
            f"{args.rate:g} batches/s",
            flush=True,
        )
        workdir = Path(tmp)
        rows: dict[str, list[dict[str, Any]]] = {c.label: [] for c in codes}
        async with contextlib.AsyncExitStack() as stack:
            handles = [
                await stack.enter_async_context(
                    fake_worker_in_process(cache_blocks=args.cache_blocks)
                )
                for _ in range(args.workers)
            ]
            for r in range(args.rounds):
                for code in codes:
                    profile = args.profile if code.label == "new" else None
                    row = await one_round(code, handles, loads, args.rate, workdir, profile)
                    rows[code.label].append(row)
                    print(
                        f"round {r + 1} {code.label:>16}: {row['us_per_stored_block']:.2f} us "
                        f"CPU per stored block ({row['us_per_stored_block_net']:.2f} net of idle "
                        f"{row['idle_cores'] * 1000:.1f} ms/s; event loop thread "
                        f"{row['loop_share']:.0%}), catch-up {row['catch_up_s']:.2f} s, "
                        f"lost batches {row['lost_batches']:.0f}, accelerator "
                        f"{row['accelerator']}",
                        flush=True,
                    )
    for code in codes:
        print(
            f"{code.label:>16}: replica CPU per stored block us, median (range) of "
            f"{args.rounds}: {summary(rows[code.label], 'us_per_stored_block')}; net of idle: "
            f"{summary(rows[code.label], 'us_per_stored_block_net')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also run this git revision's code, interleaved")
    parser.add_argument("--pure", action="store_true", help="also run this checkout's pure path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=500, help="measured prompts per worker")
    parser.add_argument("--cache-blocks", type=int, default=2048, help="per worker")
    parser.add_argument("--rate", type=float, default=400.0, help="batches/s over all workers")
    parser.add_argument("--profile", type=Path, help="cProfile the new code's replica into this")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
