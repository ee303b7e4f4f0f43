"""Where a cache_aware request's time goes, in place: the event loop thread's CPU by stage.

Run: .venv/bin/python -m bench.request_stages [--baseline REV] [--rounds 3] [--requests 3000]
     [--stub record|weigh|book|prune] [--cache-blocks N] [--policy cache_aware]
Prints figures; asserts nothing. About 15 s a run. `--policy` serves another policy (a
policy that reads no index subscribes to no KV events: its ingest is 0).

Instruction counts (`bench/relay_instructions.py`) say what a change takes off, not what it
saves in time: a request that waits on memory runs few instructions a nanosecond. This runs
`relay_instructions`' child without valgrind, on the proxy benchmark's prompts (two fake
workers, a cache_aware replica and the load client in one process and thread, so every
request's KV events are ingested here), and reads `time.thread_time_ns` around
`RequestRouter.route` and around the live streams' `data_received` (the ingest) during the
counted requests: per request, the loop thread's CPU, the routing, the ingest and the rest
(the relay and the client). Then it calls `route` alone over the same prompts, back to back
(`route hot`: its working set in the caches), so the two figures show how much of routing is
memory. The replay ingests no events, so its bookings are never confirmed and each prompt's
tail stays booked: `route hot` also walks those bookings (~60 blocks a request in the full
regime, against ~0.2 live), so it is no floor for the live figure, and a profile of the replay
overstates `booked_depths`. The wrappers cost ~1 us a call of their own.

`--baseline REV` also runs another commit's router (its C extensions compiled, as
`bench/proxy_ab.py` does), the runs alternated. `--stub` replaces a part of the pressure
ledger's `record` with nothing, to size it: the decisions change too, so a stubbed figure is a
size, not an option. `--cache-blocks` sizes each worker's cache (blocks): small enough (a few
thousand) and the caches are full within the warm-up, so every request's blocks evict as many
(the proxy benchmark's "full" regime), each eviction one `BlockRemoved` event to ingest.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from router.tools.demo import pdeathsig_preexec

HERE = Path(__file__).resolve().parent
STUBS = ("record", "weigh", "book", "prune")
FIGURES = ("loop thread", "route", "ingest", "rest", "route hot")


def relay_instructions() -> ModuleType:
    """This tree's `relay_instructions` (the child and the load), whichever router is on
    `sys.path`: an older commit's may not have the proxy workload."""
    spec = importlib.util.spec_from_file_location(
        "relay_instructions", HERE / "relay_instructions.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub(part: str) -> None:
    from router.pressure import PressureLedger

    nothing: dict[str, tuple[str, Any]] = {
        "record": ("record", lambda self, rank, keys, held=0, holds=None: (len(keys),) * 2),
        "weigh": ("_weigh", lambda self, st, keys, w: (len(keys), 0)),
        "book": ("_book", lambda self, now, rank, st, keys, held, batches: None),
    }
    names = [nothing[part]] if part in nothing else []
    if part == "prune":
        names = [("_prune", lambda self, st, now: None), ("_sweep", lambda self, now, pruned: None)]
    for name, replacement in names:
        assert hasattr(PressureLedger, name), f"PressureLedger.{name} is gone: update --stub"
        setattr(PressureLedger, name, replacement)


def child(requests: int, part: str | None, cache_blocks: int, policy: str) -> None:
    """One run: prints one line of figures, us a request."""
    import router.dataplane.routing as routing
    import router.serving as serving_module
    import router.subscriber as subscriber
    from router.cli import loop_factory

    ri = relay_instructions()
    bodies = ri.proxy_requests(ri.WARMUP + requests + 64)
    ri.REQUESTS = iter(bodies)
    if part:
        stub(part)
    spent = {"route": 0, "ingest": 0}
    counting = [False]

    def timed(cls: type, name: str, stage: str) -> None:
        inner = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not counting[0]:
                return inner(*args, **kwargs)
            started = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[stage] += time.thread_time_ns() - started

        setattr(cls, name, wrapper)

    timed(routing.RequestRouter, "route", "route")
    timed(subscriber._LiveStream, "data_received", "ingest")
    servings: list[Any] = []
    start = serving_module.start_serving

    async def start_and_keep(config: Any) -> Any:
        servings.append(await start(config))
        return servings[-1]

    serving_module.start_serving = start_and_keep
    load = ri.load
    loads = [0]

    async def counted_load(port: int, n: int, concurrency: int) -> None:
        loads[0] += 1
        if loads[0] == 1:  # the warm-up
            await load(port, n, concurrency)
            return
        counting[0] = True
        started = time.thread_time_ns()
        await load(port, n, concurrency)
        total = time.thread_time_ns() - started
        counting[0] = False
        router = servings[0].plane.router
        prompts = [b.split(b"\r\n\r\n", 1)[1] for b in bodies[ri.WARMUP : ri.WARMUP + n]]
        hot = time.thread_time_ns()
        for body in prompts:
            router.route(b"/v1/completions", body)
        hot = time.thread_time_ns() - hot
        figures = [total, spent["route"], spent["ingest"], total - sum(spent.values()), hot]
        print("figures", " ".join(f"{f / n / 1000:.1f}" for f in figures), flush=True)
        tree = router.rules.tree  # None: a policy that keeps no index
        print("blocks held", 0 if tree is None else len(tree), flush=True)  # caches full or not

    ri.load = counted_load
    procs, urls = ri.start_workers(2, cache_blocks)
    try:
        with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:
            runner.run(ri.run_target(policy, urls, requests, 32))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    os._exit(0)  # no shutdown: see relay_instructions.run_target


def run(
    code: Path, requests: int, part: str | None, cache_blocks: int, policy: str = "cache_aware"
) -> tuple[list[float], int]:
    """One child: its figures and how many blocks its index held at the end."""
    argv = [sys.executable, __file__, "--child", "--requests", str(requests), "--policy", policy]
    argv += ["--cache-blocks", str(cache_blocks)]
    argv += ["--stub", part] if part else []
    env = {**os.environ, "PYTHONPATH": str(code)}
    # Ctrl-C here kills the child (subprocess.run) without its `finally`; its workers stop
    # with it (`relay_instructions.start_workers`), and it with this process.
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        preexec_fn=pdeathsig_preexec(),
    )
    found = re.search(r"^figures (.*)$", done.stdout, re.M)
    held = re.search(r"^blocks held (\d+)$", done.stdout, re.M)
    if done.returncode or found is None or held is None:
        raise RuntimeError(f"request_stages child failed:\n{done.stderr[-2000:]}")
    return [float(x) for x in found.group(1).split()], int(held.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also run this git revision's router")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--stub", choices=STUBS, help="a part of the ledger's record left out")
    parser.add_argument("--cache-blocks", type=int, default=200_000, help="each worker's cache")
    parser.add_argument("--policy", default="cache_aware", help="the replica's routing policy")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.requests, args.stub, args.cache_blocks, args.policy)
        return
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"new" if args.baseline else "this tree": HERE.parent}
        if args.baseline:
            from bench.bench_proxy import checkout

            codes[f"@{args.baseline}"] = checkout(args.baseline, Path(tmp) / "old")
        results: dict[str, list[list[float]]] = {tag: [] for tag in codes}
        for i in range(args.rounds):
            for tag, code in codes.items():
                figures, held = run(code, args.requests, args.stub, args.cache_blocks, args.policy)
                results[tag].append(figures)
                print(
                    f"round {i + 1}/{args.rounds} {tag}: {figures} ({held} blocks held)", flush=True
                )
    title = (
        "us a request, median [min-max] of the rounds"
        + (f", --stub {args.stub}" if args.stub else "")
        + (f", --cache-blocks {args.cache_blocks}" if args.cache_blocks != 200_000 else "")
    )
    print(f"\n{title}\n| code | " + " | ".join(FIGURES) + " |")
    print("|---|" + "---:|" * len(FIGURES))
    for tag, rounds in results.items():
        cells = []
        for column in zip(*rounds, strict=True):
            cells.append(f"{statistics.median(column):.1f} [{min(column):.1f}-{max(column):.1f}]")
        print(f"| {tag} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
