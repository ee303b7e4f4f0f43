"""Bootstrap: a replica joining a warm fleet, kvrouter's peer snapshot against smg's mesh.

kvrouter rows: `bench_bootstrap.run_size` per tree size (see that script: a warm replica
holding N blocks over 4 ranks, a new `kvrouter serve --peer <warm>` process, time from its
first worker registration and from its spawn to `/readyz` 200, and the share of the warm view
it holds at that moment, from per-rank block counts). A new replica that did not accept the
warm snapshot fails the benchmark: its figures would be a cold start's.

smg rows: smg's HA mesh (`--enable-mesh`, gossip between router replicas; it replicates the
cache-aware policy's tree as deltas of new insertions, and asks a peer for a repair only when
a delta names a prefix it does not know). A warm smg replica routes N 2,000-character prompts
that share no prefix to 2 fake workers; then a new smg replica starts with
`--mesh-peer-urls <warm>`. Time to ready: spawn to `/readiness` 200 with every worker healthy;
then the bench waits until the new replica reports its mesh link to the warm one
(`router_mesh_peer_connections`) and gives gossip `settle_s` more. Share of the warm state
held: every warm prompt is sent once more to the new replica and then to the warm one; smg's
own `smg_cache_aware_match_ratio` histogram (matched share of each request's text in its tree)
gives the mean match on each, and the share is new / warm. Nothing else reaches either smg.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import re
import time
from pathlib import Path
from typing import Any, Final

import aiohttp

from bench import bench_bootstrap, bench_proxy, plots
from bench.report import table
from bench.smg import smg_router
from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port

SMG_WORKERS: Final = 2
RATIO = re.compile(r"^smg_cache_aware_match_ratio_(sum|count) (\S+)$", re.M)
PEER = re.compile(r'^router_mesh_peer_connections\{peer="([^"]*)"\} (\S+)$', re.M)


def scale(quick: bool) -> dict[str, Any]:
    if quick:
        return {"kvrouter_blocks": [10_000], "smg_prompts": [32], "settle_s": 2.0}
    return {
        "kvrouter_blocks": [10_000, 100_000, 1_000_000],
        "smg_prompts": [64, 512],
        "settle_s": 10.0,
    }


async def kvrouter_rows(ctx: Any, sizes: list[int]) -> list[dict[str, Any]]:
    args = argparse.Namespace(profile_dir=None, log_dir=None, quick=False)
    workdir = ctx.workdir / "bootstrap"
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        ctx.progress(f"kvrouter: a replica joining a warm one holding {n:,} blocks")
        r = await bench_bootstrap.run_size(n, args, workdir)
        if (why := r.not_bootstrapped()) is not None:
            raise RuntimeError(f"{why}: " + "; ".join(r.lines))
        rows.append(
            {
                "blocks": r.blocks,
                "pairs": r.pairs,
                "registration_to_ready_s": r.reg_to_ready,
                "spawn_to_ready_s": r.start_to_ready,
                "share": r.share,
                "details": r.lines,
            }
        )
    return rows


async def scrape(session: aiohttp.ClientSession, metrics_url: str) -> str:
    async with session.get(metrics_url + "/metrics") as resp:
        return await resp.text()


def match_ratio(text: str) -> tuple[float, float]:
    values = {k: float(v) for k, v in RATIO.findall(text)}
    return values.get("sum", 0.0), values.get("count", 0.0)


async def mean_match(
    session: aiohttp.ClientSession, smg: Any, bodies: list[bytes]
) -> tuple[float | None, int]:
    """Send `bodies` to `smg` one by one; its mean match ratio over them (None when its tree
    was not consulted for any of them), and the errors."""
    before = match_ratio(await scrape(session, smg.metrics_url))
    result = bench_proxy.LoadResult()
    for body in bodies:
        await bench_proxy.one_request(session, smg.url + "/v1/completions", body, result)
    after = match_ratio(await scrape(session, smg.metrics_url))
    count = after[1] - before[1]
    return ((after[0] - before[0]) / count if count else None), result.errors


async def mesh_link(session: aiohttp.ClientSession, new: Any, warm: Any, within_s: float) -> float:
    """Seconds until a live mesh link between the two shows (inf if none does). smg sets its
    `router_mesh_peer_connections` gauge on the side that dialled, labelled with the peer's
    name once gossip told it (empty before), so both sides are read."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        on_new = PEER.findall(await scrape(session, new.metrics_url))
        on_warm = PEER.findall(await scrape(session, warm.metrics_url))
        if any(float(v) >= 1 for _, v in on_new) or any(
            name == "new" and float(v) >= 1 for name, v in on_warm
        ):
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return float("inf")


def unique_prompts(n: int, chars: int = bench_proxy.PROMPT_TOKENS) -> list[bytes]:
    """Completion bodies whose prompts share no prefix, so re-sending them one by one never
    matches what an earlier one of them taught the router: only what it held before."""
    rng = random.Random(n)
    texts = [base64.b64encode(rng.randbytes(chars)).decode()[:chars] for _ in range(n)]
    return [
        json.dumps({"model": bench_proxy.MODEL, "prompt": t, "max_tokens": 1}).encode()
        for t in texts
    ]


async def smg_row(ctx: Any, prompts_n: int, settle_s: float) -> dict[str, Any]:
    binary = ctx.smg.binary
    log_dir = ctx.workdir / "bootstrap-smg"
    log_dir.mkdir(parents=True, exist_ok=True)
    bodies = unique_prompts(prompts_n)
    warm_mesh, new_mesh = free_tcp_port(), free_tcp_port()

    def mesh(name: str, port: int, peer: int | None) -> list[str]:
        flags = ["--enable-mesh", "--mesh-server-name", name, "--mesh-host", "127.0.0.1"]
        flags += ["--mesh-port", str(port)]
        return flags + (["--mesh-peer-urls", f"127.0.0.1:{peer}"] if peer else [])

    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(fake_worker_in_process()) for _ in range(SMG_WORKERS)
        ]
        urls = [w.url for w in workers]
        session = await stack.enter_async_context(aiohttp.ClientSession())
        warm = await stack.enter_async_context(
            smg_router(
                binary, urls, "cache_aware", log_dir, mesh("warm", warm_mesh, None), "smg-warm"
            )
        )
        ctx.progress(f"smg: warming a mesh replica with {prompts_n} prompts")
        warmed = bench_proxy.LoadResult()
        for body in bodies:
            await bench_proxy.one_request(session, warm.url + "/v1/completions", body, warmed)
        ctx.progress("smg: a new replica joins the warm one's mesh")
        spawned = time.monotonic()
        new = await stack.enter_async_context(
            smg_router(
                binary, urls, "cache_aware", log_dir, mesh("new", new_mesh, warm_mesh), "smg-new"
            )
        )
        ready_s = time.monotonic() - spawned
        link_s = await mesh_link(session, new, warm, 30.0)
        await asyncio.sleep(settle_s)  # gossip's own pace: the state is given time to arrive
        new_ratio, new_errors = await mean_match(session, new, bodies)
        warm_ratio, warm_errors = await mean_match(session, warm, bodies)
    return {
        "prompts": prompts_n,
        "prompt_chars": bench_proxy.PROMPT_TOKENS,
        "spawn_to_ready_s": ready_s,
        "ready_to_mesh_link_s": link_s,
        "settle_s": settle_s,
        "new_match": new_ratio,
        "warm_match": warm_ratio,
        "share": new_ratio / warm_ratio if new_ratio is not None and warm_ratio else None,
        "errors": warmed.errors + new_errors + warm_errors,
    }


async def run_async(ctx: Any) -> dict[str, Any]:
    s = scale(ctx.quick)
    out: dict[str, Any] = {"scale": s, "kvrouter": await kvrouter_rows(ctx, s["kvrouter_blocks"])}
    out["smg"] = []
    out["smg_skipped"] = None
    if not ctx.smg.ensure(ctx.progress):
        out["smg_skipped"] = ctx.smg.reason
        return out
    for n in s["smg_prompts"]:
        try:
            out["smg"].append(await smg_row(ctx, n, s["settle_s"]))
        except RuntimeError as exc:
            out["smg_skipped"] = f"smg mesh did not start: {str(exc).splitlines()[0]}"
            break
    return out


def run(ctx: Any) -> dict[str, Any]:
    return asyncio.run(run_async(ctx))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def tables(result: dict[str, Any]) -> dict[str, str]:
    rows = []
    for r in result["kvrouter"]:
        rows.append(
            [
                "kvrouter --peer (snapshot)",
                f"{r['blocks']:,} blocks",
                r["spawn_to_ready_s"],
                r["registration_to_ready_s"],
                _pct(r["share"]),
            ]
        )
    for r in result["smg"]:
        rows.append(
            [
                "smg --enable-mesh",
                f"{r['prompts']} prompts x {r['prompt_chars']:,} chars",
                r["spawn_to_ready_s"],
                None,
                _pct(r["share"]),
            ]
        )
    kv = [r for r in result["kvrouter"] if r["share"] is not None]
    full = all(r["share"] >= 1.0 for r in kv) if kv else False
    smg_note = (
        f"smg rows: {result['smg_skipped']}."
        if result["smg_skipped"]
        else "smg: share = its mean `smg_cache_aware_match_ratio` on the warm prompts, new "
        f"replica / warm replica, measured {result['scale']['settle_s']:g} s after the new "
        "replica's mesh link came up."
    )
    note = (
        "kvrouter: share = the new replica's (key, carrier) pairs per rank / the warm "
        f"replica's, at its first `/readyz` 200. {smg_note} Target (a joining replica holds "
        f"100% of the warm view at ready): {'met' if full else 'NOT met'} by kvrouter."
    )
    header = ["router", "warm state", "spawn -> ready s", "1st registration -> ready s", "share"]
    return {"bootstrap": table(header, rows, note=note)}


def plot(result: dict[str, Any], plt: Any, out: Path) -> list[Path]:
    kv = [r for r in result["kvrouter"] if r["spawn_to_ready_s"] is not None]
    if not kv:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    blocks = [r["blocks"] for r in kv]
    lines: list[plots.Line] = [
        (blocks, [r["spawn_to_ready_s"] for r in kv], "o-", "from spawn"),
        (blocks, [r["registration_to_ready_s"] for r in kv], "s-", "from first registration"),
    ]
    ax.set_xscale("log")
    plots.panel(ax, "kvrouter: joining a warm replica", "warm view, blocks", "s to ready", lines)
    return [plots.save(plt, fig, out / "bootstrap.png")]
