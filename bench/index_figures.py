"""Index: apply throughput, prefix_depths latency, memory per block, export/restore.

All in this process, on one core, by calling the measuring functions of `bench_ingest.py`
(decode + key + apply of vLLM event batches, store-only and store + evict mixes) and
`bench_tree.py` (`prefix_depths` over a prompt every rank holds part of, in an index of other
blocks; tracemalloc bytes per block; `cachetree.snapshot` export and restore with the wire size
of the exported nodes as msgpack and JSON, before gzip). See those scripts for the method.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

from bench import bench_ingest, bench_tree, plots
from bench.report import table

# Targets from issue 2 (see BENCHMARKS.md "Index and ingest"): the budgets this table judges.
APPLY_TARGET = 400_000  # blocks/s
DEPTHS_TARGET_US = 25.0  # prefix_depths p50, 2,000-token prompt
MEMORY_TARGET = 350  # bytes per block


def scale(quick: bool) -> dict[str, Any]:
    if quick:
        return {
            "batches": 1000,
            "repeats": 1,
            "prompts": [2000],
            "ranks": [16, 64],
            "tree_blocks": 50_000,
            "samples": 1000,
            "memory_blocks": 100_000,
            "snapshot_sizes": [100_000],
        }
    return {
        "batches": bench_ingest.BATCHES,
        "repeats": 3,
        "prompts": [500, 2000, 8000],
        "ranks": [4, 16, 64],
        "tree_blocks": 200_000,
        "samples": 5000,
        "memory_blocks": 1_000_000,
        "snapshot_sizes": [100_000, 1_000_000, 3_000_000],
    }


def run(ctx: Any) -> dict[str, Any]:
    s = scale(ctx.quick)
    out: dict[str, Any] = {"scale": s, "apply": [], "prefix_depths": [], "snapshot": []}
    for label, mixed in (("store only", False), ("store + evict", True)):
        ctx.progress(f"apply throughput, {label}: {s['batches']:,} batches")
        payloads, blocks = bench_ingest.stream(mixed, batches=s["batches"])
        best = min(bench_ingest.run(payloads) for _ in range(s["repeats"]))
        out["apply"].append({"mix": label, "blocks_per_s": blocks / best, "blocks": blocks})
    for tokens in s["prompts"]:
        for ranks in s["ranks"]:
            ctx.progress(f"prefix_depths: {tokens}-token prompt, {ranks} ranks")
            r = bench_tree.bench_prefix_depths(
                ranks, False, tokens, tree_blocks=s["tree_blocks"], samples_n=s["samples"]
            )
            out["prefix_depths"].append({"prompt_tokens": tokens, "ranks": ranks, **r})
    ctx.progress(f"memory per block at {s['memory_blocks']:,} blocks")
    out["bytes_per_block"] = bench_tree.bytes_per_block(s["memory_blocks"])
    out["memory_blocks"] = s["memory_blocks"]
    for size in s["snapshot_sizes"]:
        ctx.progress(f"export / restore at {size:,} blocks")
        gc.collect()
        out["snapshot"].append({"blocks": size, **bench_tree.bench_snapshot(size)})
    return out


def _met(ok: bool, by: str) -> str:
    return "yes" if ok else f"no ({by})"


def tables(result: dict[str, Any]) -> dict[str, str]:
    apply_rows = [
        [
            f"decode + key + apply, {a['mix']}",
            round(a["blocks_per_s"]),
            f">= {APPLY_TARGET:,}",
            _met(a["blocks_per_s"] >= APPLY_TARGET, f"{a['blocks_per_s'] / APPLY_TARGET:.0%}"),
        ]
        for a in result["apply"]
    ]
    apply = table(
        ["events of 8 blocks x 16 tokens, 4 a batch", "blocks/s", "target", "met"], apply_rows
    )
    depth_rows = []
    for d in result["prefix_depths"]:
        target = "-"
        met = "-"
        if d["prompt_tokens"] == 2000:
            target = f"<= {DEPTHS_TARGET_US:g} us"
            met = _met(d["p50_us"] <= DEPTHS_TARGET_US, f"{d['p50_us'] / DEPTHS_TARGET_US:.1f}x")
        depth_rows.append(
            [d["prompt_tokens"], d["ranks"], d["p50_us"], d["p99_us"], d["hash_us"], target, met]
        )
    depths = table(
        ["prompt tokens", "ranks", "p50 us", "p99 us", "hashing the prompt us", "target", "met"],
        depth_rows,
        digits=1,
        note=f"Index of {result['scale']['tree_blocks']:,} other blocks; realistic holders (every "
        "rank holds half the prompt, a quarter of them all of it). Hashing is not included in "
        "prefix_depths.",
    )
    memory = result["bytes_per_block"]
    snap_rows = [
        [s["blocks"], s["export_s"], s["restore_s"], s["msgpack_MB"], s["json_MB"]]
        for s in result["snapshot"]
    ]
    snapshot = table(
        ["blocks (4 ranks)", "export s", "restore s", "msgpack MB", "JSON MB"],
        snap_rows,
        note=f"Memory per block at {result['memory_blocks']:,} blocks, one carrier: "
        f"{memory:.0f} bytes (target <= {MEMORY_TARGET}: "
        f"{_met(memory <= MEMORY_TARGET, f'{memory / MEMORY_TARGET:.0%}')}).",
    )
    return {"index-apply": apply, "index-depths": depths, "index-snapshot": snapshot}


def plot(result: dict[str, Any], plt: Any, out: Path) -> list[Path]:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    depths: list[plots.Line] = []
    for ranks in sorted({d["ranks"] for d in result["prefix_depths"]}):
        rows = [d for d in result["prefix_depths"] if d["ranks"] == ranks]
        xs = [d["prompt_tokens"] for d in rows]
        depths.append((xs, [d["p50_us"] for d in rows], "o-", f"{ranks} ranks"))
    plots.panel(left, "prefix_depths latency", "prompt tokens", "p50 (us)", depths)
    snaps = result["snapshot"]
    blocks = [s["blocks"] for s in snaps]
    snapshot: list[plots.Line] = [
        (blocks, [s["export_s"] for s in snaps], "o-", "export"),
        (blocks, [s["restore_s"] for s in snaps], "s-", "restore"),
    ]
    plots.panel(right, "snapshot export / restore", "blocks", "seconds", snapshot)
    return [plots.save(plt, fig, out / "index.png")]
