"""Where a bootstrap's CPU goes, stage by stage, in bench/scale.py's shape, in one process.

Run: .venv/bin/python -m bench.bootstrap_stages [--sizes 1000000] [--pure]

A tree is built as bench/tree_memory.py builds it (64 ranks, chains of 8, 1.25 carriers a
block), then each stage of a sibling's bootstrap runs on it in turn, as the replicas run them
(each in its steps): the producer's walk (`SnapshotExport`), the columnar body
(`peer.wire.encode_columns`), the joiner's decode (`decode_columns_steps`), vetting
(`peer.vet.Vetting`, every rank live) and the graft into an empty tree (`SnapshotRestore`,
prevalidated). Prints the CPU seconds of each (this process only, so other processes on a
shared machine do not count) and checks the grafted tree holds as many nodes and carriers.
`--pure` runs it with KVROUTER_NO_EXTENSIONS=1 (the pure layout). Asserts nothing else.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fresh_process import per_size_main

STEP = 1 << 16


def _cpu(fn: Any) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def stages(n_blocks: int) -> dict[str, Any]:
    from bench.tree_memory import BLOCK, build_tree
    from cachetree.accel import IMPLEMENTATION
    from cachetree.keys import KEY_SCHEME
    from cachetree.snapshot import SnapshotExport, SnapshotRestore
    from cachetree.tree import BlockTree
    from peer import wire
    from peer.vet import Vetting
    from peer.wire import ColumnsHead

    tree = build_tree(n_blocks)
    gc.collect()
    out: dict[str, Any] = {"implementation": IMPLEMENTATION, "blocks": len(tree)}

    def walk() -> Any:
        job = SnapshotExport(tree)
        while not job.list_step(STEP):
            pass
        while not job.step(STEP):
            pass
        return job.result()

    out["export walk"], snap = _cpu(walk)
    workers = [wire.WireWorker(r.worker_url, r.dp_rank) for r in snap.workers]

    def encode(snap: Any = snap) -> bytes:
        head = ColumnsHead(
            format=wire.FORMAT,
            block_size=BLOCK,
            key_scheme=KEY_SCHEME,
            producer_ready=True,
            workers=workers,
            cursors=[(i, 5) for i in range(len(workers))],
            nodes=len(snap),
            carriers=len(snap.carrier_workers),
        )
        return b"".join(bytes(p) for p in wire.encode_columns(head, wire.node_columns(snap)))

    out["encode columns"], body = _cpu(encode)
    live = list(snap.workers)
    del snap

    def decode(body: bytes = body) -> Any:
        steps = wire.decode_columns_steps(body)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    out["decode columns"], decoded = _cpu(decode)
    del body
    out["vet"], vetted = _cpu(lambda decoded=decoded: Vetting(decoded, live, BLOCK).run(STEP))
    del decoded
    target = BlockTree(BLOCK)

    def graft() -> None:
        job = SnapshotRestore(target, vetted.snapshot, prevalidated=True)
        while not job.step(STEP):
            pass

    out["graft"], _ = _cpu(graft)
    if len(target) != len(tree) or target.recount() != tree.carried_blocks:
        raise AssertionError("the graft does not hold the exported tree")
    return out


def describe(row: dict[str, Any]) -> str:
    parts = [f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)]
    total = sum(v for v in row.values() if isinstance(v, float))
    return (
        f"{row['implementation']:>8} {row['blocks']:>10,} blocks, CPU s: "
        + ", ".join(parts)
        + f"; total {total:.2f}"
    )


def main() -> None:
    per_size_main("bench.bootstrap_stages", __doc__ or "", "1000000", stages, describe)


if __name__ == "__main__":
    main()
