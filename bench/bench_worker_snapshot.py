"""What a worker's own `/v1/kv-snapshot` costs the event loop: the decode, and the rank's rebuild.

Run: .venv/bin/python bench/bench_worker_snapshot.py [--prompts 2000] [--repeats 5]
Prints figures; asserts nothing. One process, one core: every figure is time the event loop
would be held (the decode is one C call, the rebuild is not sliced).

The body is a rank's cache as the fake worker lists it: 20 system prompts of 40 blocks, each
with `--prompts / 20` conversations of 30 blocks below it, depth first (a prompt's blocks one
after the other), 16 tokens a block. Timed, median [min-max] of `--repeats`: decoding it
(`decode_worker_snapshot`), rebuilding the rank from it into an empty index, and rebuilding it
again over itself (the rank cleared first, as when a worker re-registers).
To compare with another commit, run the same command with that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.worker_snapshot import decode_worker_snapshot, rebuild_rank

BLOCK_SIZE = 16
SYSTEM_PROMPTS = 20
SYSTEM_BLOCKS = 40
PROMPT_BLOCKS = 30


def body(prompts: int) -> bytes:
    rng = random.Random(1)
    blocks: list[dict[str, object]] = []

    def add(parent: int | None) -> int:
        engine_hash = len(blocks) + 1
        tokens = [rng.randrange(50_000) for _ in range(BLOCK_SIZE)]
        blocks.append(
            {"engine_hash": engine_hash, "parent_engine_hash": parent, "token_ids": tokens}
        )
        return engine_hash

    for _ in range(SYSTEM_PROMPTS):
        parent = None
        for _ in range(SYSTEM_BLOCKS):
            parent = add(parent)
        top = parent
        for _ in range(prompts // SYSTEM_PROMPTS):
            parent = top
            for _ in range(PROMPT_BLOCKS):
                parent = add(parent)
    ranks = [{"dp_rank": 0, "last_seq": 1, "blocks": blocks}]
    return msgspec.json.encode({"block_size": BLOCK_SIZE, "ranks": ranks})


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.1f} ms [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    raw = body(args.prompts)
    rank = RankId("http://worker:8000", 0)
    decode, fresh, again = [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        snap = decode_worker_snapshot(raw, limit=len(raw))
        decode.append(time.perf_counter() - started)
        tree = BlockTree(BLOCK_SIZE)
        started = time.perf_counter()
        placed = rebuild_rank(tree, rank, snap.ranks[0], BLOCK_SIZE)
        fresh.append(time.perf_counter() - started)
        started = time.perf_counter()
        rebuild_rank(tree, rank, snap.ranks[0], BLOCK_SIZE)
        again.append(time.perf_counter() - started)
    print(f"body: {len(raw) / 2**20:.1f} MiB, {placed:,} blocks")
    print(f"decode                   {spread(decode)}")
    print(f"rebuild, an empty index  {spread(fresh)}")
    print(f"rebuild over itself      {spread(again)}")


if __name__ == "__main__":
    main()
