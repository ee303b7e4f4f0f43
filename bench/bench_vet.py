"""Vetting figures: `VettedSnapshot.from_wire` and `retain_workers` on real exported trees,
for both encodings of the body, and the graft of the vetted result.

Run: .venv/bin/python bench/bench_vet.py [--sizes 100000,1000000]
Prints figures; asserts only that the vetted snapshot restores to the exported tree.

The wire object is what a consumer really holds: a tree built through `BlockTree.store`,
exported with `cachetree.snapshot.export`, converted to format-1 wire nodes, encoded as
msgpack (or as the columnar body) and decoded by `peer.wire.decode`. Four ranks (three
workers, the first with two dp ranks); one chain in four is also stored by a second rank, so
some nodes have two carriers. The last rank is a worker of its own, so "one rank of four
unknown" is a worker this replica does not know, whose carriers are dropped: a dp rank of a
known worker that the worker does not have refuses the body (`unknown_rank`).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from cachetree.keys import KEY_SCHEME
from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, SnapshotRestore, canonical_view, export, restore
from cachetree.tree import BlockTree
from peer import wire
from peer.vet import DEFAULT_BUDGET, VettedSnapshot, Vetting
from peer.wire import PeerSnapshot, WireNode, WireWorker

BLOCK = 16
RANKS = [RankId(f"http://10.0.0.{w}:8000", dp) for w, dp in ((1, 0), (1, 1), (2, 0), (3, 0))]


def build_tree(n_blocks: int, chain: int = 8, seed: int = 1) -> BlockTree:
    rng = random.Random(seed)
    tree = BlockTree(BLOCK)
    filler = [rng.randrange(1, 50_000) for _ in range(BLOCK * chain)]
    engine_hash = 1
    for c in range(n_blocks // chain):
        tokens = [c & 0xFFFF, c >> 16, *filler[2:]]
        holders = [RANKS[c % 4]] + ([RANKS[(c + 1) % 4]] if c % 4 == 0 else [])
        for rank in holders:
            tree.store(rank, None, range(engine_hash, engine_hash + chain), tokens, BLOCK)
            engine_hash += chain
    return tree


def to_wire(snap: Snapshot) -> PeerSnapshot:
    return PeerSnapshot(
        format=wire.FORMAT,
        block_size=BLOCK,
        key_scheme=KEY_SCHEME,
        producer_ready=True,
        workers=[WireWorker(r.worker_url, r.dp_rank) for r in snap.workers],
        cursors=[(i, 1000 + i) for i in range(len(snap.workers))],
        nodes=[WireNode(p, k, list(c)) for p, k, c in snap.records()],
    )


def timed(fn):
    """(wall seconds, CPU seconds of this process, result). On a shared machine the CPU
    figure is the steadier one: it leaves out time other processes held the core."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def step_times_ms(job: Vetting, budget: int) -> list[float]:
    """CPU milliseconds of each step, the time a caller's event loop would wait."""
    times, done = [], False
    while not done:
        c0 = time.process_time()
        done = job.step(budget)
        times.append((time.process_time() - c0) * 1000)
    return sorted(times)


def bench(n_blocks: int, repeats: int) -> None:
    tree = build_tree(n_blocks)
    snap = export(tree)
    body = wire.encode(to_wire(snap), wire.MSGPACK)
    gc.collect()
    decode_s, _, decoded = timed(lambda: wire.decode(body, wire.MSGPACK))
    carriers = len(snap.carrier_workers)
    print(
        f"{len(snap):>9,} nodes, {carriers:,} carriers, {len(body) / 1e6:.1f} MB msgpack "
        f"(decode, for scale: {decode_s:.2f} s)"
    )

    def best(fn) -> tuple[str, object]:
        runs = [timed(fn) for _ in range(repeats)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        return f"{wall:5.2f} s wall, {cpu:5.2f} s CPU", runs[-1][2]

    all_live, vetted = best(lambda: VettedSnapshot.from_wire(decoded, RANKS, BLOCK))
    copy = BlockTree(BLOCK)
    restore(copy, vetted.snapshot)
    assert canonical_view(copy) == canonical_view(tree)
    print(f"  vet, every worker live:                    {all_live}")
    columnar = wire.encode(wire.as_format1(decoded), wire.COLUMNS)
    columns_s, _, columns = timed(lambda: wire.decode(columnar, wire.COLUMNS))
    print(f"  columnar body {len(columnar) / 1e6:.1f} MB, decode {columns_s:.2f} s")
    col_live, col_vetted = best(lambda: VettedSnapshot.from_wire(columns, RANKS, BLOCK))
    assert col_vetted == vetted
    print(f"  vet columns, every worker live:            {col_live}")
    col_three, _ = best(lambda: VettedSnapshot.from_wire(columns, RANKS[:3], BLOCK))
    print(f"  vet columns, one rank of four unknown:     {col_three}")

    def graft() -> BlockTree:
        target = BlockTree(BLOCK)
        job = SnapshotRestore(target, vetted.snapshot, prevalidated=True)
        while not job.step(DEFAULT_BUDGET):
            pass
        return target

    grafted, grafted_tree = best(graft)
    assert canonical_view(grafted_tree) == canonical_view(tree)
    print(f"  graft of the vetted snapshot (empty tree): {grafted}")

    three, partial = best(lambda: VettedSnapshot.from_wire(decoded, RANKS[:3], BLOCK))
    carried, structure = partial.carrier_counts()
    print(
        f"  vet, one rank of four unknown (prunes):    {three} "
        f"-> {carried:,} carried + {structure:,} structure nodes"
    )
    one, _ = best(lambda: vetted.retain_workers(RANKS[:1]))
    print(f"  retain_workers, one rank of four:          {one}")
    for label, live in (("every worker live", RANKS), ("one rank unknown", RANKS[:3])):
        steps = step_times_ms(Vetting(decoded, live, BLOCK), DEFAULT_BUDGET)
        print(
            f"  steps of {DEFAULT_BUDGET} nodes, {label}: {len(steps)} steps, CPU ms per step "
            f"median {steps[len(steps) // 2]:.1f}, p99 {steps[int(len(steps) * 0.99)]:.1f}, "
            f"max {steps[-1]:.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100000,1000000")
    args = parser.parse_args()
    for size in (int(s) for s in args.sizes.split(",")):
        bench(size, repeats=3 if size <= 100_000 else 1)


if __name__ == "__main__":
    main()
