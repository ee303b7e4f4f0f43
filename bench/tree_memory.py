"""The block index's resident memory per block, in bench/scale.py's shape, without a replica.

Run: .venv/bin/python -m bench.tree_memory [--sizes 1000000,3000000] [--pure]

Each size is built in a fresh child process (`BlockTree.store`, chains of 8 blocks of 16
tokens on 64 ranks, one chain in four stored by a second rank too under its own engine hashes:
1.25 (rank, block) pairs a block) and reports VmRSS after the build minus VmRSS before it, per
block, with the build's CPU per block and its longest store of one chain (wall clock: the
stall a table's growth puts on a replica's event loop). `--pure` sets KVROUTER_NO_EXTENSIONS=1
in the child (the pure-Python layout). Prints figures; asserts nothing. RSS, not tracemalloc:
the allocator's rounding and the tables' spare slots are part of what a pod pays.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fresh_process import full_gc_pass_ms, per_size_main, rss_bytes
from cachetree.accel import IMPLEMENTATION
from cachetree.ranks import RankId
from cachetree.tree import BlockTree

BLOCK = 16
CHAIN = 8
RANKS = 64


def build_tree(n_blocks: int) -> BlockTree:
    """The scale benchmark's fill (bench/scale.py fill_batches), applied to a bare tree."""
    return timed_build(n_blocks)[0]


def timed_build(n_blocks: int) -> tuple[BlockTree, float, float]:
    """build_tree, and the longest store of one chain in it in seconds, of wall clock and of
    this thread's CPU (what was the store's own, not another process's turn on the core): the
    index's tables grow on the way (cachetree/_tables.c, "Growth without a stall")."""
    ranks = [RankId(f"http://10.0.{i // 16}.1:8000", i % 16) for i in range(RANKS)]
    filler = [3 + (i * 7919) % 50_000 for i in range(BLOCK * CHAIN)]
    engine_hash = [1] * RANKS
    tree = BlockTree(BLOCK)
    wall, cpu = time.perf_counter, time.thread_time
    longest = longest_cpu = 0.0
    for c in range(n_blocks // CHAIN):
        tokens = [3 + (c & 0xFFFF), 3 + (c >> 16), *filler[2:]]
        for r in (c % RANKS, (c + 1) % RANKS) if c % 4 == 0 else (c % RANKS,):
            first = engine_hash[r]
            engine_hash[r] += CHAIN
            start, start_cpu = wall(), cpu()
            tree.store(ranks[r], None, range(first, first + CHAIN), tokens, BLOCK)
            longest_cpu = max(longest_cpu, cpu() - start_cpu)
            longest = max(longest, wall() - start)
    return tree, longest, longest_cpu


def build(n_blocks: int) -> dict[str, Any]:
    gc.collect()
    before = rss_bytes()
    start = time.process_time()
    tree, longest, longest_cpu = timed_build(n_blocks)
    cpu = time.process_time() - start
    gc.collect()
    after = rss_bytes()
    return {
        "implementation": IMPLEMENTATION,
        "blocks": len(tree),
        "pairs": tree.carried_blocks,
        "rss_mib": (after - before) / 2**20,
        "bytes_per_block": (after - before) / len(tree),
        "build_us_per_block": cpu / len(tree) * 1e6,
        "longest_store_ms": longest * 1e3,
        "longest_store_cpu_ms": longest_cpu * 1e3,
        # The replica's GC strategy (index objects untracked, start-up frozen,
        # cli._tune_gc) keeps a full pass near empty with the index alive.
        "full_gc_ms": full_gc_pass_ms(),
    }


def describe(row: dict[str, Any]) -> str:
    return (
        f"{row['implementation']:>8} {row['blocks']:>10,} blocks {row['pairs']:>10,} pairs"
        f"  RSS +{row['rss_mib']:,.0f} MiB = {row['bytes_per_block']:.0f} B/block"
        f"  build {row['build_us_per_block']:.2f} us/block"
        f" (longest store of a chain {row['longest_store_ms']:.1f} ms,"
        f" CPU {row['longest_store_cpu_ms']:.1f} ms)"
        f"  full GC pass {row['full_gc_ms']:.1f} ms"
    )


def main() -> None:
    per_size_main("bench.tree_memory", __doc__ or "", "1000000,3000000", build, describe)


if __name__ == "__main__":
    main()
