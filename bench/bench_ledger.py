"""What the pressure ledger costs a routed request: `settle` + `record`, per request.

Run: .venv/bin/python bench/bench_ledger.py [--requests 4000] [--repeats 5]
Prints figures; asserts nothing. One core, one process, an injected clock (1 ms a request).

Prompts of 125 blocks (2,000 tokens) alternate between two ranks, each booked on its rank
and confirmed by the index 32 requests later (its store event arriving), as in a replica:
- `distinct`: every prompt is new (the proxy benchmark's shape): every block is weighed,
  homed and booked, and later released and pruned;
- `shared prefix`: a 62-block prefix common to all prompts (fresh on one rank, moving on the
  other) and a new 63-block tail.
Best of `--repeats` runs, so that other processes on the machine inflate it less.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachetree.ranks import RankId
from router.pressure import PressureLedger

BLOCKS = 125
CONFIRM_AFTER = 32


def prompts(requests: int, shared: int) -> list[list[int]]:
    rng = random.Random(1)
    head = [rng.getrandbits(63) for _ in range(shared)]
    return [head + [rng.getrandbits(63) for _ in range(BLOCKS - shared)] for _ in range(requests)]


def per_request_us(batch: list[list[int]]) -> float:
    now = [0.0]
    ledger = PressureLedger(clock=lambda: now[0])
    ranks = [RankId("http://w0:8000", 0), RankId("http://w1:8000", 0)]
    stored: set[tuple[RankId, int]] = set()

    def holds(rank: RankId, key: int) -> bool:
        return (rank, key) in stored

    start = time.perf_counter()
    for i, keys in enumerate(batch):
        now[0] += 0.001
        ledger.settle(holds)
        ledger.record(ranks[i % 2], keys, held=0, holds=holds)
        if i >= CONFIRM_AFTER:
            stored.add((ranks[(i - CONFIRM_AFTER) % 2], batch[i - CONFIRM_AFTER][0]))
    return (time.perf_counter() - start) / len(batch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, shared in (("distinct", 0), ("shared prefix", 62)):
        batch = prompts(args.requests, shared)
        runs = [per_request_us(batch) for _ in range(args.repeats)]
        print(
            f"{name:>14}: settle + record {min(runs):6.1f} us per request "
            f"(runs {min(runs):.1f}-{max(runs):.1f}; {BLOCKS} blocks, booked)",
            flush=True,
        )


if __name__ == "__main__":
    main()
