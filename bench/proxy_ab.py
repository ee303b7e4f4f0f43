"""Router CPU per request at c=32 and added latency at c=1, every target interleaved round by round.

Run: .venv/bin/python -m bench.proxy_ab [--baseline REV] [--policies cache_aware,round_robin]
     [--rounds 5] [--requests 2000] [--latency-requests 500] [--no-smg] [--no-floor]
     [--event-loop auto|asyncio|uvloop]
Prints figures; asserts nothing. Takes ~4-6 minutes with the defaults.

`bench_proxy.py` measures its targets one after the other, so a busy spell of the shared
machine lands on whichever target ran then. Here every target runs at once, each with its own
fresh fake workers (the workload of `bench_proxy.py`: 2,000-token prompts, 1 of 8 shared
1,000-token system prompts + 1,000 unique tokens; the same request sequence for every target),
and each round of a phase visits every target in turn (the order rotating each round): this
tree's kvrouter with each of `--policies`, the same policies at `--baseline REV` (the code of
another commit, extracted with `git archive`, its C extensions compiled there), smg
cache_aware, and the bare relay of `relay_floor.py` (kvrouter's data plane before it decides
anything). Phases, as in `bench_proxy.py`: caches not full, 16-token SSE
streams (caches not full), the worker caches filled to capacity, hop latency at c=1 (direct and
routed legs interleaved, added pXX = the pXX of routed - direct over the requests paired by
their place in a round), caches full (evicting). Router CPU is
the router process's CPU (all threads, /proc schedstat) over a round, which closes once a
kvrouter applied the KV events of its requests, divided by its requests; the figure is the
median round, [min-max] beside it. Idle targets poll their workers meanwhile, alike for all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from bench import bench_proxy as bp  # noqa: E402

REGIMES = ("not full", bp.SSE, "full")


@dataclass
class Running:
    target: bp.Target
    workers: list[bp.Child]
    router: bp.Child
    prompts: bp.Prompts
    cpu_us: dict[str, list[float]] = field(default_factory=dict)  # regime -> per round
    errors: dict[str, int] = field(default_factory=dict)
    direct: bp.LoadResult = field(default_factory=bp.LoadResult)
    routed: bp.LoadResult = field(default_factory=bp.LoadResult)

    @property
    def label(self) -> str:
        return self.target.label


def targets(args: argparse.Namespace, old: Path | None, smg_binary: Path | None) -> list[bp.Target]:
    policies = args.policies.split(",")
    out = []
    for policy in policies:
        if old is not None:
            out.append(bp.Target("kvrouter", policy, code=old, tag=f"@{args.baseline}"))
        out.append(bp.Target("kvrouter", policy, tag="new" if old is not None else ""))
    if smg_binary is not None:
        out.append(bp.Target("smg", bp.SMG_POLICY, smg_binary))
    if args.floor:
        out.append(bp.Target(bp.RELAY, bp.RELAY_POLICY))
    return out


async def cpu_round(
    session: aiohttp.ClientSession,
    run: Running,
    regime: str,
    n: int,
    args: argparse.Namespace,
) -> None:
    target = run.router.url + "/v1/completions"
    bodies = run.prompts.bodies(n, bp.SSE_TOKENS if regime == bp.SSE else 0)
    pid = run.router.proc.pid
    before = bp.cpu_seconds(pid)
    res = await bp.run_load(session, lambda i: target, bodies, args.concurrency)
    if run.target.ingests:  # the round's CPU includes ingesting its requests' events
        await bp.wait_applied(session, run.router.url, run.workers)
    spent = bp.cpu_seconds(pid) - before
    run.cpu_us.setdefault(regime, []).append(spent / res.requests * 1e6)
    run.errors[regime] = run.errors.get(regime, 0) + res.errors


async def latency_round(
    session: aiohttp.ClientSession, run: Running, n: int, direct_first: bool
) -> None:
    via_router = run.router.url + "/v1/completions"
    direct_urls = [w.url + "/v1/completions" for w in run.workers]
    legs = [
        (run.direct, lambda i: direct_urls[i % len(direct_urls)]),
        (run.routed, lambda i: via_router),
    ]
    for into, urls in legs if direct_first else legs[::-1]:
        into.add(await bp.run_load(session, urls, run.prompts.bodies(n), 1))


async def measure(
    args: argparse.Namespace, children: bp.Children, ts: Sequence[bp.Target]
) -> list[Running]:
    runs: list[Running] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for t in ts:
            workers = bp.start_workers(children, args, t.label)
            router = await bp.start_router(session, children, t, workers, args.event_loop)
            runs.append(Running(t, workers, router, bp.Prompts()))
        for run in runs:
            bp.log(f"[{run.label}] warm-up")
            await bp.warm_up(session, run.router.url, run.prompts, args)
        per_round = max(1, args.requests // args.rounds)

        async def cpu_phase(regime: str) -> None:
            for r in range(args.rounds):
                order = runs[r % len(runs) :] + runs[: r % len(runs)]
                for run in order:
                    await cpu_round(session, run, regime, per_round, args)
                bp.log(
                    f"caches {regime}, round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{run.label} {run.cpu_us[regime][-1]:.0f}" for run in runs)
                )

        await cpu_phase("not full")
        await cpu_phase(bp.SSE)
        bp.log("filling every target's worker caches to capacity")
        for run in runs:
            await bp.fill_caches(
                session, run.router.url, run.workers, run.prompts, args, run.target.ingests
            )
        per_leg = max(1, args.latency_requests // args.rounds)
        for r in range(args.rounds):
            order = runs[r % len(runs) :] + runs[: r % len(runs)]
            for run in order:
                await latency_round(session, run, per_leg, direct_first=r % 2 == 0)
            bp.log(f"c=1 latency, round {r + 1}/{args.rounds}")
        for run in runs:
            if run.target.ingests:
                await bp.wait_applied(session, run.router.url, run.workers)
        await cpu_phase("full")
    return runs


def paired(values: Sequence[float], peer: Sequence[float]) -> str:
    """The median [min-max] over rounds of `values[i] / peer[i]`: the two targets ran in the
    same round, so a busy spell of the machine slows both and their quotient keeps less of
    it than a quotient of medians does."""
    quotients = [v / p for v, p in zip(values, peer, strict=True) if p]
    if not quotients:
        return ""
    return f"{statistics.median(quotients):.2f}x [{min(quotients):.2f}-{max(quotients):.2f}]"


def report(args: argparse.Namespace, runs: Sequence[Running]) -> None:
    smg = next((r for r in runs if r.target.router == "smg"), None)
    olds = {r.target.policy: r for r in runs if r.target.code is not None}
    print(
        f"\n### Router CPU per request at c={args.concurrency} (us; median round [min-max] of "
        f"{args.rounds} rounds of {max(1, args.requests // args.rounds)} requests, every "
        "target interleaved round by round)\n"
    )
    print("| router | " + " | ".join(REGIMES) + " | vs smg | vs old |")
    print("|---|" + "---:|" * (len(REGIMES) + 2))
    for run in runs:
        cells = [bp.median_range(run.cpu_us[regime]) for regime in REGIMES]
        vs_smg = vs_old = ""
        med = {regime: statistics.median(run.cpu_us[regime]) for regime in REGIMES}
        if smg is not None and run is not smg:
            vs_smg = " / ".join(
                f"{med[regime] / statistics.median(smg.cpu_us[regime]):.2f}x" for regime in REGIMES
            )
        old = olds.get(run.target.policy)
        if old is not None and run is not old and run.target.router == "kvrouter":
            vs_old = " / ".join(
                f"{med[regime] / statistics.median(old.cpu_us[regime]):.2f}x" for regime in REGIMES
            )
        print(f"| {run.label} | " + " | ".join(cells) + f" | {vs_smg} | {vs_old} |")
    errors = {r.label: sum(r.errors.values()) for r in runs if sum(r.errors.values())}
    print(
        f"\nErrors: {errors or 'none'}. Ratios are of medians, in the order {', '.join(REGIMES)}."
    )
    print(
        "\nThe same ratios paired by round (each round's figure over its peer's in that round; "
        "median [min-max] of the rounds):\n"
    )
    print("| router | vs | " + " | ".join(REGIMES) + " |")
    print("|---|---|" + "---:|" * len(REGIMES))
    for run in runs:
        peers = [("smg", smg)] if smg is not None and run is not smg else []
        old = olds.get(run.target.policy)
        if old is not None and run is not old and run.target.router == "kvrouter":
            peers.append(("old", old))
        for name, peer in peers:
            cells = [paired(run.cpu_us[r], peer.cpu_us[r]) for r in REGIMES]
            print(f"| {run.label} | {name} | " + " | ".join(cells) + " |")
    n = max(1, args.latency_requests // args.rounds) * args.rounds
    print(
        f"\n### Added latency at c=1 (ms; {n} routed requests per target, each round's direct "
        "and routed legs back to back; caches full)\n"
    )
    print("| router | routed p50 | direct p50 | added p50 | added p99 | vs smg added p50 |")
    print("|---|---:|---:|---:|---:|---:|")
    pct = bp.percentile

    def added(run: Running, q: float) -> float:
        return bp.added_percentile(run.routed.latencies_ms, run.direct.latencies_ms, q)

    for run in runs:
        delta = f"{added(run, 50) - added(smg, 50):+.2f}" if smg is not None else ""
        print(
            f"| {run.label} | {pct(run.routed.latencies_ms, 50):.2f} | "
            f"{pct(run.direct.latencies_ms, 50):.2f} | {added(run, 50):.2f} | "
            f"{added(run, 99):.2f} | {delta} |"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also run this git revision's kvrouter")
    parser.add_argument("--policies", default="cache_aware,round_robin")
    parser.add_argument("--requests", type=int, default=2000, help="c=32 requests per phase")
    parser.add_argument("--latency-requests", type=int, default=500, help="c=1, per target")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-blocks", type=int, default=200_000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--no-smg", dest="smg", action="store_false")
    parser.add_argument("--no-floor", dest="floor", action="store_false")
    parser.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.baseline:
        bp.commit_or_exit(args.baseline)  # before smg is set up, which can take minutes
    print(f"$ {shlex.join([sys.executable, *sys.argv])}", flush=True)
    smg_binary = None
    if args.smg:
        from bench.smg import from_environment

        smg = from_environment()
        if smg.ensure(bp.log):
            smg_binary = smg.binary
        else:
            bp.log(f"no smg row: {smg.reason}")
    children = bp.Children()
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="proxy-ab-") as tmp:
            old = bp.checkout(args.baseline, Path(tmp) / "old") if args.baseline else None
            runs = asyncio.run(measure(args, children, targets(args, old, smg_binary)))
            for run in runs:
                with contextlib.suppress(Exception):
                    sig = signal.SIGTERM if run.target.smg_binary else signal.SIGINT
                    children.stop(run.router, sig)
    except KeyboardInterrupt:
        bp.log("interrupted; stopping child processes")
        raise SystemExit(130) from None
    finally:
        children.stop_all()
    report(args, runs)
    bp.log(f"done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
