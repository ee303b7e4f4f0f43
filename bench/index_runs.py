"""The index's runs on an index larger than the CPU caches: a stored chain, a removed chain,
a prompt's path, and the pressure ledger's record of a prompt, each per call.

Run: .venv/bin/python -m bench.index_runs [--blocks 600000] [--rounds 5] [--baseline REV]
     [--pure] [--cold]

On a small index every table is in the CPU caches and a lookup costs a few instructions; a
replica's index holds hundreds of thousands of blocks, and there the runs are cache misses,
which instruction counts (bench/bench_instructions.py) do not see and a whole-request
benchmark's noise hides. Each round builds, in a fresh interpreter, an index of `--blocks`
blocks (63-block chains of random keys, alternating over two ranks) and a ledger of as many
tracked blocks, then times, best of three passes of 300 calls each:
- `store 63`: `store_keyed` of a new 63-block chain (a request's stored event, caches not
  full: every block new);
- `remove 63`: `remove` of an old chain, leaf first (a full cache evicting a request's tail);
- `prefix_depths 125`: a 125-block prompt whose first 62 blocks the index holds on one rank
  (a cached system prompt), the rest new;
- `ledger record 125`: `PressureLedger.settle` + `record` of such a prompt (62 blocks weighed
  recently on the rank, 63 new and booked; the previous call's booking confirmed, as a
  replica's index shows a stored chain within milliseconds), the clock moving 1 ms a call, on
  a ledger at its cap (`max_tracked_blocks` = `--blocks`, where a replica's ledger is after
  minutes of traffic): each record prunes as many pairs as it adds;
- `ledger record 125, ranks in turn`: the same, the prompts sent to the two ranks in turn (a
  system prompt both ranks hold, routed by load: each record moves its 62 blocks' demand
  from the other rank).
With `--baseline REV`, the same in a checkout of REV (its C extensions compiled), the two
alternating round by round; medians and ranges of the rounds, and new / old. `--cold` times
each call alone after copying 4 MiB (a core's L2 then holds other data, as in a replica,
where requests and events run between the index's calls) and takes the median call. Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHAIN = 63
PROMPT = 125
CALLS = 300
COLD_BYTES = 4 << 20  # twice a core's L2: what other work leaves of the index there
STEPS = (
    "store 63",
    "remove 63",
    "prefix_depths 125",
    "ledger record 125",
    "ledger record 125, ranks in turn",
)


def measure(blocks: int, seed: int, cold: bool = False) -> dict[str, Any]:
    """One round, in this interpreter (whose `sys.path` picks the code measured)."""
    from cachetree.accel import IMPLEMENTATION
    from cachetree.ranks import RankId
    from cachetree.tree import BlockTree
    from router.pressure import PressureLedger, PressureSettings

    rng = random.Random(seed)
    ranks = [RankId(f"http://10.0.0.{i}:8000", 0) for i in range(2)]
    tree = BlockTree(16)
    engine_hash = 1
    chains: list[tuple[RankId, list[int], list[int]]] = []

    def new_chain(rank: RankId) -> tuple[RankId, list[int], list[int]]:
        nonlocal engine_hash
        hashes = list(range(engine_hash, engine_hash + CHAIN))
        engine_hash += CHAIN
        return rank, hashes, [rng.getrandbits(64) for _ in range(CHAIN)]

    for c in range(blocks // CHAIN):
        chain = new_chain(ranks[c % 2])
        tree.store_keyed(chain[0], None, chain[1], chain[2])
        chains.append(chain)
    now = [0.0]
    ledger = PressureLedger(PressureSettings(max_tracked_blocks=blocks), clock=lambda: now[0])
    system = chains[0]
    for c in range(blocks // PROMPT):
        now[0] += 0.001
        ledger.record(ranks[c % 2], [rng.getrandbits(64) for _ in range(PROMPT)], PROMPT)

    calls = max(1, min(CALLS, len(chains) // 4))  # a small index (a test) has fewer chains

    scratch, filler = bytearray(COLD_BYTES), bytes(COLD_BYTES)

    def best(call: Callable[[int], object]) -> float:
        if cold:  # each call timed alone, the CPU caches refilled with other data before it
            times = []
            for i in range(calls):
                scratch[:] = filler
                t0 = time.perf_counter()
                call(i)
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e6
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(calls):
                call(i)
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        return min(runs)

    fresh = [new_chain(ranks[i % 2]) for i in range(3 * calls)]
    old = rng.sample(chains[1:], 3 * calls)

    def system_prompts(count: int) -> list[list[int]]:
        """Prompts of the cached system prompt's 62 blocks and 63 new ones."""
        return [system[2][:62] + [rng.getrandbits(64) for _ in range(63)] for _ in range(count)]

    prompts = system_prompts(calls)
    ledger.record(system[0], system[2][:62], 62)
    fresh_prompts = system_prompts(3 * calls)

    def confirmed(rank: RankId, key: int) -> bool:
        return True

    def store(i: int) -> None:
        rank, hashes, keys = fresh.pop()
        tree.store_keyed(rank, None, hashes, keys)

    def remove(i: int) -> None:
        rank, hashes, _ = old.pop()
        tree.remove(rank, hashes[::-1])

    def record(i: int) -> None:
        now[0] += 0.001
        ledger.settle(confirmed)
        ledger.record(system[0], fresh_prompts.pop(), 62)

    turn_prompts = system_prompts(3 * calls)

    def record_in_turn(i: int) -> None:
        now[0] += 0.001
        ledger.settle(confirmed)
        ledger.record(ranks[i % 2], turn_prompts.pop(), 62)

    figures = {
        "store 63": best(store),
        "remove 63": best(remove),
        "prefix_depths 125": best(lambda i: tree.prefix_depths(prompts[i])),
    }
    figures["ledger record 125"] = best(record)
    figures["ledger record 125, ranks in turn"] = best(record_in_turn)
    return {"implementation": IMPLEMENTATION, "blocks": len(tree), "calls": calls, **figures}


def run_child(code: Path, blocks: int, seed: int, pure: bool, cold: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(code))
    if pure:
        env["KVROUTER_NO_EXTENSIONS"] = "1"
    script = str(Path(__file__).resolve())
    out = subprocess.run(
        [sys.executable, script, "--child", str(blocks), "--seed", str(seed)]
        + (["--cold"] if cold else []),
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=code,
    ).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=600_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="also this git revision's code, rounds alternating")
    parser.add_argument("--pure", action="store_true", help="without the compiled accelerator")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="each call timed alone after refilling the CPU caches with other data (as in a "
        "replica, where requests and events run between the index's calls): median of calls",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        print(json.dumps(measure(args.child, args.seed, args.cold)))
        return
    sys.path.insert(0, str(ROOT))  # this tree's bench package (the children import no more)
    from bench.bench_ledger import spread
    from bench.bench_proxy import checkout

    codes = {"new": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            codes[args.baseline] = checkout(args.baseline, Path(tmp) / "baseline")
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label in codes}
        for r in range(args.rounds):
            order = list(codes) if r % 2 == 0 else list(reversed(codes))
            for label in order:
                got = run_child(codes[label], args.blocks, r + 1, args.pure, args.cold)
                rows[label].append(got)
                figures = ", ".join(f"{s} {got[s]:.1f}" for s in STEPS)
                print(f"round {r + 1} {label:>10}: {figures} us", file=sys.stderr, flush=True)
    first = next(iter(rows.values()))[0]
    print(
        f"\nindex of {first['blocks']:,} blocks, {first['implementation']}; us per call, "
        f"median (range) of {args.rounds} rounds, each "
        + (
            f"the median of {first['calls']} calls, each after refilling the CPU caches"
            if args.cold
            else f"the best of 3 passes of {first['calls']} calls"
        )
        + "\n"
    )
    print("| step | " + " | ".join(codes) + (" | new / old |" if len(codes) > 1 else " |"))
    print("|---|" + "---:|" * (len(codes) + (len(codes) > 1)))
    for step in STEPS:
        cells = [spread([g[step] for g in rows[label]]) for label in codes]
        ratio = ""
        if len(codes) > 1:
            new, old = (statistics.median(g[step] for g in rows[c]) for c in codes)
            ratio = f" {new / old:.2f}x |"
        print(f"| {step} | " + " | ".join(cells) + " |" + ratio)


if __name__ == "__main__":
    main()
