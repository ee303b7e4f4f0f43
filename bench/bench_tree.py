"""Index figures: prefix_depths latency, memory per block, snapshot export/restore.

Run: .venv/bin/python bench/bench_tree.py [--sizes 100000,1000000]
Prints figures; asserts nothing. One core, one process.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc

import msgspec

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.snapshot import export, restore
from cachetree.tree import BlockTree

BLOCK = 16


def build_tree(n_blocks: int, n_ranks: int = 1, chain: int = 8, seed: int = 1) -> BlockTree:
    """`n_blocks` blocks in independent chains of `chain` blocks, spread over ranks."""
    rng = random.Random(seed)
    tree = BlockTree(BLOCK)
    ranks = [RankId(f"http://10.0.0.{i}:8000", 0) for i in range(n_ranks)]
    filler = [rng.randrange(1, 50_000) for _ in range(BLOCK * chain)]
    engine_hash = 1
    for c in range(n_blocks // chain):
        tokens = [c & 0xFFFF, c >> 16, *filler[2:]]
        hashes = range(engine_hash, engine_hash + chain)
        engine_hash += chain
        tree.store(ranks[c % n_ranks], None, hashes, tokens, BLOCK)
    return tree


def bench_prefix_depths(
    n_ranks: int,
    adversarial: bool,
    prompt_tokens: int = 2000,
    tree_blocks: int = 200_000,
    samples_n: int = 5000,
) -> dict:
    """Latency of one `prefix_depths` over a prompt (125 blocks by default) every rank holds
    part of, in an index of `tree_blocks` other blocks.

    Realistic: every rank holds the 1,000-token system prompt, a quarter of them also the
    conversation so far (the whole prompt), so the holder set changes twice along the path.
    Adversarial: half the ranks hold the whole prompt and the others stop at distinct random
    depths, the worst case for the walk (one run per distinct depth).
    """
    rng = random.Random(n_ranks)
    prompt = [rng.randrange(1, 50_000) for _ in range(prompt_tokens)]
    keys = block_keys(prompt, BLOCK)
    tree = build_tree(tree_blocks, n_ranks=n_ranks)
    for i in range(n_ranks):
        rank = RankId(f"http://10.0.0.{i}:8000", 0)
        if adversarial:
            n = len(keys) if i % 2 == 0 else rng.randrange(1, len(keys))
        else:
            n = len(keys) if i % 4 == 0 else len(keys) // 2
        hashes = range(10**9 + i * 1000, 10**9 + i * 1000 + n)
        tree.store(rank, None, hashes, prompt[: n * BLOCK], BLOCK)
    depths = tree.prefix_depths(keys)
    assert len(depths.any_tier) == n_ranks
    samples = []
    for _ in range(samples_n):
        t0 = time.perf_counter_ns()
        tree.prefix_depths(keys)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return {
        "p50_us": samples[len(samples) // 2],
        "p99_us": samples[int(len(samples) * 0.99)],
        "runs": len(depths.depth_runs()),
        "hash_us": statistics.median(
            timed_us(lambda: block_keys(prompt, BLOCK)) for _ in range(500)
        ),
    }


def timed_us(fn) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1000


def bytes_per_block(n_blocks: int) -> float:
    gc.collect()
    tracemalloc.start()
    tree = build_tree(n_blocks)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(tree) == n_blocks
    return size / n_blocks


class WireNode(msgspec.Struct, array_like=True):
    parent: int | None
    key: int
    carriers: list[tuple[int, int, int]]


def bench_snapshot(n_blocks: int) -> dict[str, float]:
    tree = build_tree(n_blocks, n_ranks=4)
    t0 = time.perf_counter()
    snap = export(tree)
    export_s = time.perf_counter() - t0
    nodes = [WireNode(p, k, list(c)) for p, k, c in snap.records()]
    msgpack_bytes = len(msgspec.msgpack.encode(nodes))
    json_bytes = len(msgspec.json.encode(nodes))
    copy = BlockTree(BLOCK)
    t0 = time.perf_counter()
    restore(copy, snap)
    restore_s = time.perf_counter() - t0
    assert len(copy) == len(tree)
    return {
        "export_s": export_s,
        "restore_s": restore_s,
        "msgpack_MB": msgpack_bytes / 1e6,
        "json_MB": json_bytes / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,1000000")
    args = parser.parse_args()
    for adversarial in (False, True):
        for n_ranks in (16, 64):
            r = bench_prefix_depths(n_ranks, adversarial)
            print(
                f"prefix_depths 2000-token prompt (125 blocks), {n_ranks} ranks, "
                f"{'adversarial' if adversarial else 'realistic'} ({r['runs']} depth runs): "
                f"p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us "
                f"(hashing the prompt, not included: p50 {r['hash_us']:.1f} us)"
            )
    print(f"memory: {bytes_per_block(1_000_000):.0f} bytes per block at 1M blocks, one carrier")
    for size in (int(s) for s in args.sizes.split(",")):
        runs = [bench_snapshot(size) for _ in range(3 if size <= 100_000 else 1)]
        best = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"snapshot {size:>9,} blocks: export {best['export_s']:.2f} s, "
            f"restore {best['restore_s']:.2f} s, wire {best['msgpack_MB']:.1f} MB msgpack / "
            f"{best['json_MB']:.1f} MB json (before gzip)"
        )


if __name__ == "__main__":
    main()
