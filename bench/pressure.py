"""Routing under cache pressure: fleet cached-token ratio against an ideal static partition.

The regime (the workload family is `bench.pressure_sim.Workload`): shared prefixes whose
working set is larger than one worker's prefix cache but within the fleet's combined cache
(the prefixes fill `fill` of it, on average), each request a prefix plus a tail of its own,
in cyclic or shuffled order (or a popularity of the workload's: zipf, bursty, mixed; see
`Workload`), sent by `concurrency` closed-loop clients, into caches that are empty (cold) or
full of unrelated blocks (pre-filled: a fleet that has been running), through one router
replica or several behind a round-robin front. Fake workers as real processes, one
rank each: a paged LRU prefix cache of `cache_blocks` blocks, 50 us of prefill per uncached
token, 1 ms per generated token (8 per request), at most 2 requests running per worker (the
rest queue). A workload's workers are started once; before every run their caches are
cleared (and pre-filled again), and every router is a fresh process.

Rows, per workload:
- ideal partition: each prefix always sent to one worker, the prefixes spread over the
  workers by a greedy partition of their blocks (largest first onto the least filled worker),
  straight to the workers (no router hop, so its TTFT is lower by the hop): only each
  prefix's first request misses, when every worker's share fits its cache;
- kvrouter cache_aware, kvrouter round_robin: one replica, or several that know each other
  (`--peer`, so cache_aware's replicas share their decisions: `router.siblings`), the client
  sending requests to them in turn; kvrouter cache_aware+homes: cache_aware with
  `--prefix-homes` (`router.homes`), its homes shared like the decisions;
- smg cache_aware (smg's approximate tree of routed request text; over HTTP workers it sees
  no KV events), one instance or several in turn.

Each row runs `runs` times, with a different fixed seed per run (the rows of a run share it),
the rows in turns so drift hits every row alike. A row shows its median ratio with the range;
`x ideal` is that median over the ideal row's median. The target: cache_aware at least 0.97x
the ideal's in every workload, and above smg's.

To study a few workloads at a time (their tables are partial: pass `--no-markdown`):
`BENCH_PRESSURE_WORKLOADS` names them (commas; any shape of `bench.pressure_sim`, holdouts,
round 19's judged hold-outs (`judged_holdouts`) and header shapes included),
`BENCH_PRESSURE_RUNS` sets the runs per row (seeds 0..N-1), and `BENCH_PRESSURE_ROWS` the rows
(their labels, commas: "ideal partition,kvrouter cache_aware"); the rows left out show as
skipped. `BENCH_PRESSURE_UNSEEN=N` (or `N:SEED`) runs N shapes of
the regime drawn at random (`bench.pressure_sim.unseen_shapes`, after the named ones): a
fresh seed is a set of hold-outs no weight was chosen on; `BENCH_PRESSURE_TAILED=N` (or
`N:SEED`) the same draw with longer tails of the requests' own (`tailed_shapes`: 64-500
tokens where the others have 8-40). Naming drawn shapes in
`BENCH_PRESSURE_WORKLOADS` too runs those alone of the draw (a shape below the bar again,
with more runs). The runs' seeds are 0..N-1, so `bench/pressure_sim.py --seeds N` plays the
same requests and predicts a row's figures (exactly at c=1, where timing decides nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench import plots
from bench.pressure_sim import (
    BURST,
    IDEAL,
    UNSEEN_SEED,
    Request,
    Workload,
    build_requests,
    holdouts,
    ideal_partition,
    judged_holdouts,
    long_headers,
    nested_headers,
    tailed_shapes,
    unseen_shapes,
    workloads,
)
from bench.report import table
from bench.routing_quality import start_fleet
from bench.smg import smg_router
from router.dataplane.routing import INDEX_POLICIES
from router.tools import demo

PREFILL_US_PER_TOKEN: Final = 50.0
DECODE_MS_PER_TOKEN: Final = 1.0
MAX_TOKENS: Final = 8
TARGET: Final = 0.97  # cache_aware's median over the ideal's, in every workload
PREFILL_CHAIN_BLOCKS: Final = 16
ROWS: Final = (
    ("ideal", "partition"),
    ("kvrouter", "cache_aware"),
    ("kvrouter", "cache_aware+homes"),
    ("kvrouter", "round_robin"),
    ("smg", "cache_aware"),
)
MAX_RUNS: Final = 100
FULL: Final = (
    "3w-9p-cyclic",
    "3w-9p-shuffled-prefilled",
    "3w-9p-shuffled-c8",
    "3w-9p-shuffled-c8-prefilled",
    "8w-40p-shuffled-c8",
    "4w-14p-mixed-c4-prefilled",
    "5w-12p-header-c2",
    "3w-9p-shuffled-c8-2rep",
    "8w-40p-shuffled-c8-prefilled-2rep",
    "4w-20p-cyclic-3rep",
    "6w-30p-shuffled-c16-2rep",
    "6w-60p-short-c8-prefilled-2rep",
    "3w-12p-long-c2-prefilled",
    "6w-24p-shuffled-c12-prefilled-3rep",
    "4w-16p-header-c6-3rep",
)
MAX_UNSEEN: Final = 100
QUICK: Final = ("3w-9p-shuffled-c8-prefilled", "3w-9p-shuffled-c8-2rep")


def selected(quick: bool, env: Mapping[str, str] = os.environ) -> tuple[list[Workload], int]:
    """The workloads and the runs per row at this scale, or as the environment narrows them:
    `BENCH_PRESSURE_WORKLOADS` (names, commas; any shape of `bench.pressure_sim`, its
    holdouts, round 19's judged hold-outs and header shapes included), `BENCH_PRESSURE_UNSEEN` and
    `BENCH_PRESSURE_TAILED` (shapes drawn at random, after the named ones; only those named
    when some are) and `BENCH_PRESSURE_RUNS`
    (1-100). ValueError naming the problem when they are malformed. A narrowed run is for
    `--no-markdown`: its tables would replace the full ones."""
    names: Sequence[str] = QUICK if quick else FULL
    runs = 1 if quick else 3
    wanted = env.get("BENCH_PRESSURE_WORKLOADS", "").strip()
    family = workloads() + holdouts() + judged_holdouts() + long_headers() + nested_headers()
    unseen = _drawn(env, "BENCH_PRESSURE_UNSEEN", unseen_shapes)
    unseen += _drawn(env, "BENCH_PRESSURE_TAILED", tailed_shapes)
    by_name = {w.name: w for w in family + unseen}
    drawn = [w.name for w in unseen]
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        if not set(names) & set(drawn):  # naming a drawn shape runs it alone of its draw
            names += drawn
        unknown = [n for n in names if n not in by_name]
        if unknown or len(set(names)) != len(names):
            raise ValueError(
                f"BENCH_PRESSURE_WORKLOADS: {', '.join(unknown) or 'a name twice'}; "
                f"choose distinct names among {', '.join(by_name)}"
            )
    elif drawn:
        names = drawn
    count = env.get("BENCH_PRESSURE_RUNS", "").strip()
    if count:
        if not count.isdigit() or not 1 <= int(count) <= MAX_RUNS:
            raise ValueError(f"BENCH_PRESSURE_RUNS: {count!r}; need a whole number 1-{MAX_RUNS}")
        runs = int(count)
    return [by_name[n] for n in names], runs


def _drawn(
    env: Mapping[str, str], variable: str, draw: Callable[[int, int], list[Workload]]
) -> list[Workload]:
    """`BENCH_PRESSURE_UNSEEN` or `BENCH_PRESSURE_TAILED`: "N" or "N:SEED", N shapes of
    `draw` (SEED `UNSEEN_SEED` by default); ValueError naming the problem when malformed."""
    spec = env.get(variable, "").strip()
    if not spec:
        return []
    count, _, seed = spec.partition(":")
    if not count.isdigit() or not 1 <= int(count) <= MAX_UNSEEN or (seed and not seed.isdigit()):
        raise ValueError(
            f"{variable}: {spec!r}; need N or N:SEED, N a whole number "
            f"1-{MAX_UNSEEN} and SEED a whole number"
        )
    return draw(int(count), int(seed) if seed else UNSEEN_SEED)


def selected_rows(env: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """The rows to run: all of `ROWS`, or those `BENCH_PRESSURE_ROWS` names (labels as the
    table prints them, commas: "ideal partition,kvrouter cache_aware"); ValueError naming
    the problem when it is malformed."""
    wanted = env.get("BENCH_PRESSURE_ROWS", "").strip()
    if not wanted:
        return list(ROWS)
    labels = {f"{router} {policy}": (router, policy) for router, policy in ROWS}
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in labels]
    if unknown:
        raise ValueError(
            f"BENCH_PRESSURE_ROWS: {', '.join(unknown)}; choose among {', '.join(labels)}"
        )
    return [row for label, row in labels.items() if label in names]


LEFT_OUT: Final = "left out by BENCH_PRESSURE_ROWS"


@dataclass
class Row:
    router: str
    policy: str
    runs: list[demo.PhaseResult] = field(default_factory=list)
    skipped: str | None = None
    # New prefixes and the placer (`router.placement`), summed over the replicas and runs.
    placements: Counter[str] = field(default_factory=Counter)

    @property
    def label(self) -> str:
        return f"{self.router} {self.policy}"

    def figures(self) -> dict[str, Any]:
        ratios = [p.ratio for p in self.runs if p.prompt_tokens]
        pooled = demo.PhaseResult(self.policy, ttfts=[t for p in self.runs for t in p.ttfts])
        measured = bool(pooled.ttfts)
        return {
            "router": self.router,
            "policy": self.policy,
            "ratio": statistics.median(ratios) if ratios else None,
            "ratios": ratios,
            "requests": sum(p.requests for p in self.runs),
            "failed": sum(p.failed for p in self.runs),
            "ttft_p50_ms": pooled.ttft_pct_ms(0.5) if measured else None,
            "ttft_p99_ms": pooled.ttft_pct_ms(0.99) if measured else None,
            "per_worker_requests": [n for p in self.runs for n in p.per_rank.values()],
            "placements": dict(self.placements),
            "skipped": self.skipped,
        }


# -- one run ----------------------------------------------------------------------------------


async def prefill(session: aiohttp.ClientSession, cluster: demo.Cluster, w: Workload) -> None:
    """Fill every worker's cache with blocks no request shares (a fleet that has been
    running): chains of random tokens, each stored as one batch, until the cache is full."""
    rng = random.Random(0xF111)
    chains = -(-w.cache_blocks // PREFILL_CHAIN_BLOCKS)

    async def one(worker: demo.Worker) -> None:
        for _ in range(chains):
            chain = [rng.randrange(3, 250) for _ in range(PREFILL_CHAIN_BLOCKS * demo.BLOCK_SIZE)]
            body = {"token_chains": [chain], "dp_rank": 0}
            async with session.post(worker.url + "/control/store", json=body) as resp:
                if resp.status != 200:
                    raise demo.DemoError(f"/control/store on {worker.label}: {resp.status}")

    await asyncio.gather(*(one(worker) for worker in cluster.workers))


async def drive(
    session: aiohttp.ClientSession,
    cluster: demo.Cluster,
    requests: Sequence[Request],
    urls: Sequence[str],
    w: Workload,
    label: str,
) -> demo.PhaseResult:
    """The requests in order through `concurrency` closed-loop slots; request i goes to
    `urls[i]` when there is one URL per request, else to the URLs in turn."""
    phase = demo.PhaseResult(label)
    before = await demo.worker_counters(session, cluster.workers)
    pending = iter(enumerate(requests))
    progress = demo.Progress(label, len(requests))

    async def slot() -> None:
        for i, req in pending:
            url = urls[i] if len(urls) == len(requests) else urls[i % len(urls)]
            reply = await demo.chat(session, url, req.messages, MAX_TOKENS)
            phase.requests += 1
            progress.advance()
            if reply.status != 200:
                phase.failed += 1
            else:
                phase.ttfts.append(reply.ttft_s)

    started = asyncio.get_running_loop().time()
    try:
        await asyncio.gather(*(slot() for _ in range(w.concurrency)))
    finally:
        progress.close()
    phase.wall_s = asyncio.get_running_loop().time() - started
    after = await demo.worker_counters(session, cluster.workers)
    for rank, now in after.items():
        then = before[rank]
        phase.prompt_tokens += now.prompt_tokens - then.prompt_tokens
        phase.cached_tokens += now.cached_tokens - then.cached_tokens
        phase.per_rank[rank] = now.requests - then.requests
    return phase


async def kvrouter_run(
    session: aiohttp.ClientSession,
    cluster: demo.Cluster,
    row: Row,
    w: Workload,
    requests: Sequence[Request],
    name: str,
) -> None:
    ports = [demo.free_ports(1) for _ in range(w.replicas)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    routers = [
        cluster.router(
            f"{name}-{k}", row.policy, peers=[u for u in urls if u != urls[k]], port=ports[k]
        )
        for k in range(w.replicas)
    ]
    await cluster.start_routers(routers)
    try:
        await demo.wait_ready(session, routers)
        # Policies that keep no index (--kv-events auto) have no cursors to wait for.
        indexed = demo.base_policy(row.policy) in INDEX_POLICIES
        await demo.probe_every_rank(session, cluster)
        if indexed:
            await demo.quiesce(session, cluster, routers)
        if w.prefilled:
            await prefill(session, cluster, w)
            if indexed:
                await demo.quiesce(session, cluster, routers)
        row.runs.append(await drive(session, cluster, requests, urls, w, row.label))
        for url in urls:
            row.placements.update(await placements_of(session, url))
    finally:
        await asyncio.gather(*(r.child.stop() for r in routers))


async def placements_of(session: aiohttp.ClientSession, url: str) -> Counter[str]:
    """A replica's `kvrouter_placements_total` by outcome (none when it has no siblings)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return Counter(
        {
            sample.labels["outcome"]: int(sample.value)
            for family in text_string_to_metric_families(text)
            if family.name == "kvrouter_placements"
            for sample in family.samples
            if sample.name == "kvrouter_placements_total"
        }
    )


async def smg_run(
    session: aiohttp.ClientSession,
    cluster: demo.Cluster,
    ctx: Any,
    row: Row,
    w: Workload,
    requests: Sequence[Request],
) -> None:
    """One run through fresh smg instances (two in turn for a two-replica workload); sets
    `row.skipped` instead when smg is not there."""
    if not ctx.smg.ensure(ctx.progress):
        row.skipped = ctx.smg.reason
        return
    workers = [worker.url for worker in cluster.workers]
    if w.prefilled:
        await prefill(session, cluster, w)
    try:
        async with contextlib.AsyncExitStack() as stack:
            urls = [
                (
                    await stack.enter_async_context(
                        smg_router(
                            ctx.smg.binary, workers, "cache_aware", cluster.log_dir, name=f"smg-{k}"
                        )
                    )
                ).url
                for k in range(w.replicas)
            ]
            row.runs.append(await drive(session, cluster, requests, urls, w, row.label))
    except RuntimeError as exc:
        row.skipped = f"smg did not start: {str(exc).splitlines()[0]}"


async def run_workload(
    ctx: Any,
    session: aiohttp.ClientSession,
    w: Workload,
    runs: int,
    chosen_rows: Sequence[tuple[str, str]] = ROWS,
) -> dict[str, Any]:
    log_dir = ctx.workdir / "pressure" / w.name
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = demo.Cluster(log_dir)
    rows = [
        Row(router, policy, skipped=None if (router, policy) in chosen_rows else LEFT_OUT)
        for router, policy in ROWS
    ]
    try:
        await start_fleet(
            cluster, w.workers, w.cache_blocks, PREFILL_US_PER_TOKEN, DECODE_MS_PER_TOKEN
        )
        for run in range(runs):
            requests, lengths = build_requests(w, seed=run)
            part = ideal_partition(lengths, w.workers)
            direct = [cluster.workers[part[req.prefix]].url for req in requests]
            for row in rows:
                if row.skipped is not None:
                    continue
                ctx.progress(f"{w.name}: {row.label} (run {run + 1} of {runs})")
                await demo.clear_caches(session, cluster)
                if row.router == IDEAL:
                    if w.prefilled:
                        await prefill(session, cluster, w)
                    row.runs.append(await drive(session, cluster, requests, direct, w, row.label))
                elif row.router == "kvrouter":
                    await kvrouter_run(session, cluster, row, w, requests, f"{row.policy}-{run}")
                else:
                    await smg_run(session, cluster, ctx, row, w, requests)
    finally:
        await cluster.stop_all()
    return {
        "workload": {**w.__dict__, "cache_blocks": w.cache_blocks},
        "requests_per_run": w.prefixes * w.requests_per_prefix,
        "rows": [r.figures() for r in rows],
    }


async def run_async(
    ctx: Any, chosen: Sequence[Workload], runs: int, rows: Sequence[tuple[str, str]] = ROWS
) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return [await run_workload(ctx, session, w, runs, rows) for w in chosen]


def run(ctx: Any) -> dict[str, Any]:
    chosen, runs = selected(ctx.quick)
    rows = selected_rows()
    return {"runs": runs, "workloads": asyncio.run(run_async(ctx, chosen, runs, rows))}


# -- report ----------------------------------------------------------------------------------


def _rows(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{r['router']} {r['policy']}": r for r in result["rows"]}


def judged(result: dict[str, Any]) -> tuple[float | None, bool | None, bool | None]:
    """(cache_aware over ideal, that >= TARGET, cache_aware above smg) of one workload; None
    where a row has no figures, or the ideal partition cached nothing (a tailed shape whose
    tails leave its caches no room: nothing to be a share of)."""
    rows = _rows(result)
    ideal = rows["ideal partition"]["ratio"]
    ours = rows["kvrouter cache_aware"]["ratio"]
    smg = rows["smg cache_aware"]["ratio"]
    if not ideal or ours is None:
        return None, None, None
    rel = ours / ideal
    return rel, rel >= TARGET, None if smg is None else ours > smg


def verdict(results: Sequence[dict[str, Any]]) -> str:
    missed, below_smg, unjudged = [], [], []
    for result in results:
        name = result["workload"]["name"]
        rel, met, above = judged(result)
        if rel is None:
            unjudged.append(name)
            continue
        if not met:
            missed.append(f"{name} ({rel:.3f}x)")
        if above is False:
            below_smg.append(name)
    parts = [
        f"cache_aware >= {TARGET}x the ideal partition in every workload: "
        + ("met" if not missed else "NOT met in " + ", ".join(missed)),
        "above smg in every workload: "
        + ("met" if not below_smg else "NOT met in " + ", ".join(below_smg)),
    ]
    if unjudged:
        parts.append(
            "not judged (a row missing, or an ideal partition that cached nothing): "
            + ", ".join(unjudged)
        )
    return "Target: " + "; ".join(parts) + "."


def _describe(w: dict[str, Any]) -> str:
    order = "shuffled" if w["shuffled"] else "cyclic"
    popularity = w["popularity"]
    if popularity == "zipf":
        order = f"zipf popularity (s={w['zipf_s']:g}), shuffled"
    elif popularity == "bursty":
        order = f"shuffled bursts of {BURST} requests of a prefix"
    elif popularity == "mixed":
        order = "a cyclic pass, then shuffled"
    state = "pre-filled" if w["prefilled"] else "cold"
    replicas = f"{w['replicas']} replica" + ("s" if w["replicas"] > 1 else "")
    low, high = w["tail_tokens"]
    return (
        f"{w['workers']} workers x {w['cache_blocks']} blocks, {w['prefixes']} prefixes of "
        f"{w['prefix_blocks'][0]}-{w['prefix_blocks'][1]} blocks x {w['requests_per_prefix']}, "
        f"each request's own tail {low}-{high} tokens, {order}, c={w['concurrency']}, "
        f"{state}, {replicas}"
    )


def tables(result: dict[str, Any]) -> dict[str, str]:
    rows = []
    for res in result["workloads"]:
        ideal = _rows(res)["ideal partition"]["ratio"]
        for r in res["rows"]:
            label = f"{r['router']} {r['policy']}"
            if r["skipped"]:
                rows.append([res["workload"]["name"], label, r["skipped"], *[None] * 5])
                continue
            ratios = r["ratios"]
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            if len(ratios) > 1:
                ratio += f" ({min(ratios):.3f}-{max(ratios):.3f})"
            rel = r["ratio"] / ideal if ideal and r["ratio"] is not None else None
            spread = r["per_worker_requests"]
            rows.append(
                [
                    res["workload"]["name"],
                    label,
                    ratio,
                    None if rel is None else f"{rel:.3f}",
                    r["ttft_p50_ms"],
                    r["ttft_p99_ms"],
                    f"{min(spread)}-{max(spread)}" if spread else "-",
                    r["failed"],
                ]
            )
    described = "; ".join(
        f"**{res['workload']['name']}**: {_describe(res['workload'])}"
        for res in result["workloads"]
    )
    note = (
        f"{result['runs']} run(s) per row in turns, one fixed seed per run; ratio: median "
        f"(range); x ideal: the median over the ideal partition's. {described}. Every request: "
        f"its prefix plus its own tail; {PREFILL_US_PER_TOKEN:g} us prefill per uncached "
        f"token, {MAX_TOKENS} tokens at {DECODE_MS_PER_TOKEN:g} ms, 2 running per worker. "
        f"The ideal row goes straight to the workers (no router hop). "
        f"{verdict(result['workloads'])}"
    )
    header = [
        "workload",
        "router, policy",
        "cached-token ratio",
        "x ideal",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "requests per worker",
        "failed",
    ]
    return {"pressure": table(header, rows, digits=1, note=note)}


def plot(result: dict[str, Any], plt: Any, out: Path) -> list[Path]:
    names = [res["workload"]["name"] for res in result["workloads"]]
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(names)), 4))
    width = 0.8 / len(ROWS)
    for k, (router, policy) in enumerate(ROWS):
        values = [_rows(res)[f"{router} {policy}"]["ratio"] or 0.0 for res in result["workloads"]]
        ax.bar(
            [i + k * width for i in range(len(names))], values, width, label=f"{router} {policy}"
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("fleet cached-token ratio")
    ax.set_title("routing under cache pressure (higher is better)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return [plots.save(plt, fig, out / "pressure.png")]
