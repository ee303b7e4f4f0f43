"""The block index's resident memory per block, in bench/scale.py's shape, without a replica.

Run: .venv/bin/python -m bench.tree_memory [--sizes 1000000,3000000] [--pure]

Each size is built in a fresh child process (`BlockTree.store`, chains of 8 blocks of 16
tokens on 64 ranks, one chain in four stored by a second rank too under its own engine hashes:
1.25 (rank, block) pairs a block) and reports VmRSS after the build minus VmRSS before it, per
block, with the build's CPU per block and its longest store of one chain (wall clock: the
stall a table's growth puts on a replica's event loop). Then the index churns at its size, as a
replica's does once its workers' caches are full: as many new blocks again are stored, each
chain's store followed by the removal of the oldest chain stored, and the longest store and
removal of that churn are reported too (the stall of a table rebuilt at a steady size, its
dead entries dropped). `--pure` sets KVROUTER_NO_EXTENSIONS=1 in the child (the pure-Python
layout). Prints figures; asserts nothing. RSS, not tracemalloc: the allocator's rounding and
the tables' spare slots are part of what a pod pays.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
    return Fill(n_blocks).tree


@dataclass
class Longest:
    """The longest of the calls timed, in seconds of wall clock and of this thread's CPU (what
    was the call's own, not another process's turn on the core)."""

    wall: float = 0.0
    cpu: float = 0.0

    def timed(self, call: Callable[..., object], *args: Any) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        call(*args)
        self.cpu = max(self.cpu, time.thread_time() - start_cpu)
        self.wall = max(self.wall, time.perf_counter() - start)


class Fill:
    """A tree filled with `n_blocks`, timing each store of one chain (the index's tables are
    rebuilt larger on the way: cachetree/_tables.c); `churn` goes on at that size."""

    def __init__(self, n_blocks: int) -> None:
        self.ranks = [RankId(f"http://10.0.{i // 16}.1:8000", i % 16) for i in range(RANKS)]
        self.filler = [3 + (i * 7919) % 50_000 for i in range(BLOCK * CHAIN)]
        self.engine_hash = [1] * RANKS
        self.tree = BlockTree(BLOCK)
        self.stored: deque[tuple[int, int]] = deque()  # (rank, first engine hash), oldest first
        self.chains = 0
        self.store = Longest()
        for _ in range(n_blocks // CHAIN):
            self._store_chain(self.store)

    def _store_chain(self, longest: Longest) -> None:
        c = self.chains
        self.chains += 1
        tokens = [3 + (c & 0xFFFF), 3 + (c >> 16), *self.filler[2:]]
        for r in (c % RANKS, (c + 1) % RANKS) if c % 4 == 0 else (c % RANKS,):
            first = self.engine_hash[r]
            self.engine_hash[r] += CHAIN
            longest.timed(
                self.tree.store, self.ranks[r], None, range(first, first + CHAIN), tokens, BLOCK
            )
            self.stored.append((r, first))

    def churn(self, n_blocks: int) -> tuple[Longest, Longest]:
        """Store `n_blocks` more, removing the oldest chain stored after each store so the tree
        stays at its size: the longest store and the longest removal."""
        store, remove = Longest(), Longest()
        held = len(self.stored)
        for _ in range(n_blocks // CHAIN):
            self._store_chain(store)
            while len(self.stored) > held:
                r, first = self.stored.popleft()
                remove.timed(self.tree.remove, self.ranks[r], range(first, first + CHAIN))
        return store, remove


def build(n_blocks: int) -> dict[str, Any]:
    gc.collect()
    before = rss_bytes()
    start = time.process_time()
    fill = Fill(n_blocks)
    tree = fill.tree
    cpu = time.process_time() - start
    gc.collect()
    after = rss_bytes()
    churn_store, churn_remove = fill.churn(n_blocks)
    return {
        "implementation": IMPLEMENTATION,
        "blocks": len(tree),
        "pairs": tree.carried_blocks,
        "rss_mib": (after - before) / 2**20,
        "bytes_per_block": (after - before) / len(tree),
        "build_us_per_block": cpu / len(tree) * 1e6,
        "longest_store_ms": fill.store.wall * 1e3,
        "longest_store_cpu_ms": fill.store.cpu * 1e3,
        "churn_store_ms": churn_store.wall * 1e3,
        "churn_store_cpu_ms": churn_store.cpu * 1e3,
        "churn_remove_ms": churn_remove.wall * 1e3,
        "churn_remove_cpu_ms": churn_remove.cpu * 1e3,
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
        f"  churn: longest store {row['churn_store_ms']:.1f} ms"
        f" (CPU {row['churn_store_cpu_ms']:.1f}), remove {row['churn_remove_ms']:.1f} ms"
        f" (CPU {row['churn_remove_cpu_ms']:.1f})"
        f"  full GC pass {row['full_gc_ms']:.1f} ms"
    )


def main() -> None:
    per_size_main("bench.tree_memory", __doc__ or "", "1000000,3000000", build, describe)


if __name__ == "__main__":
    main()
