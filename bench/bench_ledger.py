"""What the pressure ledger costs a routed request: `settle` + `record`, per request.

Run: .venv/bin/python bench/bench_ledger.py [--requests 4000] [--repeats 5] [--against REV]
Prints figures; asserts nothing. One core, one process, an injected clock (1 ms a request).

Prompts of 125 blocks (2,000 tokens) alternate between two ranks, each recorded with what its
rank holds of it, the rest booked, and confirmed by the index 32 requests later (its store
event arriving: the index holds its blocks on the rank from then on), as in a replica:
- `distinct`: every prompt is new (the proxy benchmark's shape): every block is weighed and
  booked, and later its booking ends;
- `shared prefix`: a 62-block prefix common to all prompts (moving between the two ranks
  with every prompt) and a new 63-block tail;
- `system prompts` (with `--shape`): the proxy benchmark's workload, one of 8 62-block system
  prompts, each routed to one rank always (kept fresh there), and a new 63-block tail;
- `conversations` (with `--shape`): 600 multi-turn chats taking turns, each on one rank: a
  32-block system prompt (kept fresh), the conversation's previous prompt after it (weighed
  600 requests ago: past the refresh window) and a new 16-block turn; past 125 blocks a
  conversation starts over.
Each request also reads what a decision reads (`booked_depths`, `pendings`, `demands`), timed
apart and printed as `reads`; `longest request` is the one request that took longest (with
`--requests` in the hundreds of thousands, a rank's compaction of its stale entries). Best of
`--repeats` runs, so that other processes on the machine inflate it less.

`--shape NAME` (repeatable) picks the shapes; the first two by default.
`--against REV` loads `router/pressure.py` as it was at git revision REV next to this tree's
and runs the two in alternating rounds (`--repeats` rounds each, the order swapped every
round): medians and ranges of each, and the ratio of the medians, new over old.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import random  # noqa: E402

import router.pressure  # noqa: E402
from cachetree.ranks import RankId  # noqa: E402
from router.cli import _tune_gc as tune_gc  # noqa: E402

BLOCKS = 125
CONFIRM_AFTER = 32
SYSTEM_PROMPTS = 8
SHAPES = {"distinct": (0, 1), "shared prefix": (62, 1), "system prompts": (62, SYSTEM_PROMPTS)}
CONVERSATIONS = 600  # with one request a ms, a turn comes back 0.6 s later: past 30 s / 64
SYSTEM_BLOCKS = 32
TURN_BLOCKS = 16
DEFAULT_SHAPES = ("distinct", "shared prefix")
RANKS = [RankId("http://w0:8000", 0), RankId("http://w1:8000", 0)]


def prompts(requests: int, shared: int, heads: int = 1) -> list[list[int]]:
    """Prompt i: head i % `heads` (of `shared` blocks) and a new tail."""
    rng = random.Random(1)
    prefixes = [[rng.getrandbits(63) for _ in range(shared)] for _ in range(heads)]
    return [
        prefixes[i % heads] + [rng.getrandbits(63) for _ in range(BLOCKS - shared)]
        for i in range(requests)
    ]


def conversations(requests: int) -> list[list[int]]:
    """Prompt i: the next turn of conversation i % CONVERSATIONS (see the module docstring)."""
    rng = random.Random(1)
    system = [rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)]
    history = [system] * CONVERSATIONS
    out = []
    for i in range(requests):
        c = i % CONVERSATIONS
        if len(history[c]) + TURN_BLOCKS > BLOCKS:
            history[c] = system
        history[c] = history[c] + [rng.getrandbits(63) for _ in range(TURN_BLOCKS)]
        out.append(history[c])
    return out


def shape_prompts(name: str, requests: int) -> tuple[list[list[int]], int]:
    """The shape's prompts and its `heads` (how `rank_of` sends them: a conversation, an even
    count of them taking turns, stays on one rank as a head does)."""
    if name == "conversations":
        return conversations(requests), 2
    shared, heads = SHAPES[name]
    return prompts(requests, shared, heads), heads


def rank_of(i: int, heads: int) -> RankId:
    """One head, prompts alternate between the ranks; several, each head keeps to one."""
    return RANKS[i % 2] if heads == 1 else RANKS[i % heads % 2]


def per_request_us(
    batch: list[list[int]], heads: int = 1, module: ModuleType = router.pressure
) -> tuple[float, float, float]:
    """(settle + record, reads) in us per request, and the longest request's settle + record
    and reads in ms (a compaction lands on one request), with the ledger of `module`.

    As in a replica: the index holds a prompt's blocks on its rank `CONFIRM_AFTER` requests
    after it was routed (its store event), which confirms its booking (the last block held);
    each prompt is recorded with what its rank held of it then, and the reads are given each
    rank's held depth. Working out those depths is not timed."""
    now = [0.0]
    ledger = module.PressureLedger(clock=lambda: now[0])
    ranks = RANKS
    stored: dict[RankId, set[int]] = {rank: set() for rank in ranks}
    clock = time.perf_counter

    def holds(rank: RankId, key: int) -> bool:
        return key in stored[rank]

    def depth(rank: RankId, keys: list[int]) -> int:
        held = stored[rank]
        d = 0
        while d < len(keys) and keys[d] in held:
            d += 1
        return d

    tune_gc()  # as a replica is tuned: the prompts made here are not walked by every collection
    timed = reads = longest = 0.0
    for i, keys in enumerate(batch):
        rank = rank_of(i, heads)
        device = {r: d for r in ranks if (d := depth(r, keys))}
        now[0] += 0.001
        t = clock()
        ledger.settle(holds)
        r = clock()
        ledger.booked_depths(keys, device)
        ledger.pendings(ranks)
        ledger.demands(ranks)
        reads += clock() - r
        ledger.record(rank, keys, device.get(rank, 0), holds)
        spent = clock() - t
        timed += spent
        longest = max(longest, spent)
        if i >= CONFIRM_AFTER:
            j = i - CONFIRM_AFTER
            stored[rank_of(j, heads)].update(batch[j])
    return (timed - reads) / len(batch) * 1e6, reads / len(batch) * 1e6, longest * 1e3


def module_at(rev: str) -> ModuleType:
    """`router/pressure.py` as it was at `rev`, loaded as a module of its own."""
    from bench.bench_proxy import commit_or_exit

    source = subprocess.run(
        ["git", "show", f"{commit_or_exit(rev)}:router/pressure.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "pressure_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"pressure_at_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", action="append", choices=[*SHAPES, "conversations"])
    parser.add_argument("--against", metavar="REV", help="A/B against router/pressure.py at REV")
    args = parser.parse_args()
    shapes = args.shape or DEFAULT_SHAPES
    if args.against is None:
        for name in shapes:
            batch, heads = shape_prompts(name, args.requests)
            runs = [per_request_us(batch, heads) for _ in range(args.repeats)]
            best = min(runs)
            print(
                f"{name:>14}: settle + record {best[0]:6.1f} us per request "
                f"(runs {best[0]:.1f}-{max(r[0] for r in runs):.1f}; up to {BLOCKS} blocks, "
                f"booked); reads {best[1]:.1f} us; longest request {best[2]:.1f} ms",
                flush=True,
            )
        return
    old = module_at(args.against)
    versions = (("this tree", router.pressure), (args.against, old))
    for name in shapes:
        batch, heads = shape_prompts(name, args.requests)
        runs: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in versions}
        for r in range(args.repeats):
            for label, module in versions if r % 2 == 0 else versions[::-1]:
                runs[label].append(per_request_us(batch, heads, module))
        new_cost, old_cost = (runs[label] for label, _ in versions)
        ratio = statistics.median(c[0] for c in new_cost) / statistics.median(
            c[0] for c in old_cost
        )
        for label, _ in versions:
            costs = runs[label]
            print(
                f"{name:>14}, {label:>12}: settle + record {spread([c[0] for c in costs])} us, "
                f"reads {spread([c[1] for c in costs])} us per request, "
                f"longest request {spread([c[2] for c in costs])} ms",
                flush=True,
            )
        print(f"{name:>14}: settle + record, new / old (medians) {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
