"""What a worker's own `/v1/kv-snapshot` costs the event loop: the decode, and the rank's install.

Run: .venv/bin/python bench/bench_worker_snapshot.py [--prompts 2000] [--repeats 5]
Prints figures; asserts nothing. One process, one core, one event loop, the path a replica
takes (`router.workers`): the body decoded on the loop in slices, then installed by the pump
(`IndexRules.replace_ranks_steps`). Each stage prints its total time and the longest the event loop
was held in one go meanwhile (a task that only yields notes the longest gap between its turns):
the stall a request or `/healthz` answered meanwhile would have met.

The body is a rank's cache as the fake worker lists it: 20 system prompts of 40 blocks, each
with `--prompts / 20` conversations of 30 blocks below it, depth first (a prompt's blocks one
after the other), 16 tokens a block. Timed, median [min-max] of `--repeats`: decoding it,
installing it into an empty index, and installing it again over itself (the rank's old state
replaced, as when a worker's snapshot is pulled again after a gap).
To compare with another commit, run the same command with that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.bootstrap import run_in_slices
from router.index import SLICE_BLOCKS, IndexRules, Pump
from router.worker_snapshot import SnapshotDecode, WorkerSnapshot

BLOCK_SIZE = 16
SYSTEM_PROMPTS = 20
SYSTEM_BLOCKS = 40
PROMPT_BLOCKS = 30
WORKER = "http://worker:8000"
T = TypeVar("T")


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


async def held(work: Callable[[], Awaitable[T]]) -> tuple[T, float, float]:
    """`work`'s result, its total time, and the longest the loop went without a turn."""
    longest = 0.0
    done = False

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is running before the work begins
    started = time.perf_counter()
    result = await work()
    total = time.perf_counter() - started
    done = True
    await tick
    return result, total, longest


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.1f} ms [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


async def install(pump: Pump, snap: WorkerSnapshot) -> str:
    return await pump.call_steps(lambda rules: rules.replace_ranks_steps(WORKER, snap))


async def run(raw: bytes, repeats: int) -> None:
    rank = RankId(WORKER, 0)
    stages = ("decode", "install, an empty index", "install over itself")
    totals: dict[str, list[float]] = {stage: [] for stage in stages}
    longest: dict[str, list[float]] = {stage: [] for stage in stages}

    async def decode() -> WorkerSnapshot:
        job = SnapshotDecode(raw, limit=len(raw))
        await run_in_slices(job.step, SLICE_BLOCKS)
        return job.result()

    for _ in range(repeats):
        snap, total, hold = await held(decode)
        totals["decode"].append(total)
        longest["decode"].append(hold)
        rules = IndexRules(BlockTree(BLOCK_SIZE))
        rules.add_ranks([rank])
        pump = Pump(rules)
        pump.start()

        for stage in stages[1:]:
            verdict, total, hold = await held(partial(install, pump, snap))
            assert verdict == "applied", verdict
            totals[stage].append(total)
            longest[stage].append(hold)
        await pump.stop()
    print(f"body: {len(raw) / 2**20:.1f} MiB, {rules.tree.block_count(rank):,} blocks")
    print(f"{'stage':<26}{'total':<28}longest loop hold")
    for stage in stages:
        print(f"{stage:<26}{spread(totals[stage]):<28}{spread(longest[stage])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(run(body(args.prompts), args.repeats))


if __name__ == "__main__":
    main()
