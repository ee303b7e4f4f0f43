"""The pressure ledger's resident memory per tracked (rank, block) pair, without a replica.

Run: .venv/bin/python -m bench.ledger_memory [--sizes 1000000] [--pure]

Each size is recorded in a fresh child process: `PressureLedger.record` of 125-block prompts
of new random keys on 8 ranks, each prompt held by the index (nothing booked), the clock
moving 1 ms a prompt, until it tracks that many pairs (`--pressure-max-tracked-blocks`' default
is 1,000,000, which a busy replica reaches in minutes). Reports VmRSS after minus before, per
pair, and a full pass of the cyclic collector with the ledger alive. Then as many blocks booked
(125-block prompts of new keys the index does not hold, within `--booking-ttl-ms`: bookings
have a bound of their own, the same figure) and VmRSS again, per booked pair; and once every
booking expired. `--pure`: without the compiled accelerator. Prints figures; asserts nothing.
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
    full_gc_ms = full_gc_pass_ms()
    # Then as many new blocks booked (nothing held: their store events not in yet), within
    # the TTL: the bookings' bound is the same figure, and the demand stays at it.
    for i in range(pairs // PROMPT):
        ledger.record(ranks[i % RANKS], [rng.getrandbits(64) for _ in range(PROMPT)], 0)
    gc.collect()
    booked = rss_bytes()
    booked_pairs = sum(ledger.pending(rank) for rank in ranks)
    now[0] += ledger.settings.booking_ttl_s
    ledger.settle(None)  # every booking expired
    gc.collect()
    return {
        "implementation": IMPLEMENTATION,
        "pairs": tracked,
        "rss_mib": (after - before) / 2**20,
        "bytes_per_pair": (after - before) / tracked,
        "record_us_per_prompt": cpu / (pairs // PROMPT) * 1e6,
        "full_gc_ms": full_gc_ms,
        "booked_pairs": booked_pairs,
        "booked_mib": (booked - after) / 2**20,
        "bytes_per_booked_pair": (booked - after) / booked_pairs,
        "expired_mib": (rss_bytes() - before) / 2**20,
    }


def describe(r: dict[str, Any]) -> str:
    return (
        f"{r['implementation']:>8}  {r['pairs']:>10,} pairs  RSS +{r['rss_mib']:.0f} MiB = "
        f"{r['bytes_per_pair']:.0f} B/pair  record {r['record_us_per_prompt']:.1f} us a "
        f"{PROMPT}-block prompt  full GC pass {r['full_gc_ms']:.1f} ms\n"
        f"{'':>8}  + {r['booked_pairs']:>8,} booked  RSS +{r['booked_mib']:.0f} MiB = "
        f"{r['bytes_per_booked_pair']:.0f} B/pair; after they expired, RSS +"
        f"{r['expired_mib']:.0f} MiB over the empty ledger"
    )


if __name__ == "__main__":
    per_size_main("bench.ledger_memory", __doc__, "1000000", build, describe)
