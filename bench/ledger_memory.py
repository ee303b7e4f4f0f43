"""The pressure ledger's resident memory per tracked (rank, block) pair, without a replica.

Run: .venv/bin/python -m bench.ledger_memory [--sizes 1000000] [--pure]

Each size is recorded in a fresh child process: `PressureLedger.record` of 125-block prompts
of new random keys on 8 ranks, each prompt held by the index (nothing booked), the clock
moving 1 ms a prompt, until it tracks that many pairs (`--pressure-max-tracked-blocks`' default
is 1,000,000, which a busy replica reaches in minutes). Reports VmRSS after minus before, per
pair, and a full pass of the cyclic collector with the ledger alive. `--pure`: without the
compiled accelerator. Prints figures; asserts nothing.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fresh_process import full_gc_pass_ms, per_size_main, rss_bytes
from cachetree.accel import IMPLEMENTATION
from cachetree.ranks import RankId
from router.pressure import PressureLedger, PressureSettings

PROMPT = 125
RANKS = 8


def build(pairs: int) -> dict[str, Any]:
    rng = random.Random(1)
    ranks = [RankId(f"http://10.0.0.{i}:8000", 0) for i in range(RANKS)]
    now = [0.0]
    gc.collect()
    before = rss_bytes()
    ledger = PressureLedger(PressureSettings(max_tracked_blocks=pairs), clock=lambda: now[0])
    start = time.process_time()
    for i in range(pairs // PROMPT):
        now[0] += 0.001
        ledger.record(ranks[i % RANKS], [rng.getrandbits(64) for _ in range(PROMPT)], PROMPT)
    cpu = time.process_time() - start
    gc.collect()
    after = rss_bytes()
    tracked = ledger.tracked_blocks
    return {
        "implementation": IMPLEMENTATION,
        "pairs": tracked,
        "rss_mib": (after - before) / 2**20,
        "bytes_per_pair": (after - before) / tracked,
        "record_us_per_prompt": cpu / (pairs // PROMPT) * 1e6,
        "full_gc_ms": full_gc_pass_ms(),
    }


def describe(r: dict[str, Any]) -> str:
    return (
        f"{r['implementation']:>8}  {r['pairs']:>10,} pairs  RSS +{r['rss_mib']:.0f} MiB = "
        f"{r['bytes_per_pair']:.0f} B/pair  record {r['record_us_per_prompt']:.1f} us a "
        f"{PROMPT}-block prompt  full GC pass {r['full_gc_ms']:.1f} ms"
    )


if __name__ == "__main__":
    per_size_main("bench.ledger_memory", __doc__, "1000000", build, describe)
