"""Instructions per block on the event-apply hot path, counted by callgrind: repeatable figures.

Run: .venv/bin/python bench/bench_instructions.py [--workload NAME ...]
Needs valgrind. Prints figures; asserts nothing. Takes about a minute.

Wall-clock figures on a shared 2-core VM move by a third between runs, more than most changes
to the hot path are worth. Callgrind counts the instructions a workload executes instead,
which (with string hashing seeded) is the same run after run whatever else the machine is
doing, so a before/after pair can be told apart at the percent level. Each workload runs twice
under callgrind, once set up only and once set up and measured; the difference, divided by the
blocks it handled, is the figure.

Workloads:
- `tree-remove`: `BlockTree.remove` of 400 chains of 63 device-only blocks, leaf first, one
  call per chain (as `apply_events` groups a run of removals).
- `decode-removals`: `decode_batch` of a vLLM batch of 63 one-block BlockRemoved events (how
  an engine reports eviction under cache pressure), 2,000 times, folded into a run as a
  replica's subscriber decodes (`fold_removals=True`; before round 10 this and `ingest-churn`
  decoded unfolded, so their older figures are not comparable).
- `ingest-mixed`: `bench_ingest.py`'s store + evict stream (8-block events), decode + key +
  apply, 1,500 batches.
- `ingest-churn`: `ingest_churn.py`'s full-cache requests (per batch ~63 one-block
  BlockRemoved and one ~63-block BlockStored, from the fake worker's engine), decode + key +
  apply, 400 batches; per stored block (each also evicts one).
- `replica-churn`: the same batches through a replica's whole ingest path: a real
  `RankSubscriber` reading a libzmq PUB over TCP loopback (the router speaks ZMTP itself)
  offering to a running `Pump`, as a replica wires them. One batch is published at a time
  and the loop runs until the pump applied it, as a replica at 400 batches/s sees them (one
  wake-up per message).
  The count includes the publisher's send, its libzmq I/O thread and the wait (the same for
  any version of the router), not the kernel's work.

To compare with older code, run this script with that code first on PYTHONPATH (e.g. a
`git archive` of the old commit): the index and decoder come from there, the workloads from
here.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.events import decode_batch

RANK = RankId("http://10.0.0.1:8000", 0)


def tree_remove() -> tuple[Callable[[], None], int]:
    tree = BlockTree(16)
    rng = random.Random(1)
    chains = []
    for c in range(400):
        tokens = [rng.randrange(3, 50_000) for _ in range(16 * 63)]
        hashes = list(range(1 + 63 * c, 1 + 63 * (c + 1)))
        tree.store(RANK, None, hashes, tokens, 16, 1, None)
        chains.append(hashes)

    def measured() -> None:
        for hashes in chains:
            tree.remove(RANK, hashes[::-1], None)

    return measured, 400 * 63


def decode_removals() -> tuple[Callable[[], None], int]:
    events = [
        {"type": "BlockRemoved", "block_hashes": [1000 + i], "medium": "GPU"} for i in range(63)
    ]
    payload = msgspec.msgpack.encode([1.5, events, 0])

    def measured() -> None:
        for _ in range(2000):
            decode_batch(payload, fold_removals=True)

    return measured, 2000 * 63


def ingest_mixed() -> tuple[Callable[[], None], int]:
    from bench import bench_ingest  # the repo root is on sys.path once main() runs

    payloads, blocks = bench_ingest.stream(True, batches=1500)

    def measured() -> None:
        bench_ingest.run(payloads)

    return measured, blocks


def ingest_churn() -> tuple[Callable[[], None], int]:
    from bench.ingest_churn import workload
    from router.index import apply_events

    load = workload(1, 2048, 400)
    tree = BlockTree(16)
    for payload in load.warm:
        apply_events(tree, RANK, decode_batch(payload, fold_removals=True).events)

    def measured() -> None:
        for payload in load.measured:
            apply_events(tree, RANK, decode_batch(payload, fold_removals=True).events)

    return measured, load.stored_blocks


def replica_churn() -> tuple[Callable[[], None], int]:
    import asyncio

    import zmq
    import zmq.asyncio

    from bench.ingest_churn import workload
    from router.index import IndexRules, Pump
    from router.subscriber import RankEndpoint, RankSubscriber

    load = workload(1, 2048, 400)
    loop = asyncio.new_event_loop()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB, socket_class=zmq.Socket)
    pub.sndhwm = 0
    pub.bind("tcp://127.0.0.1:*")
    rules = IndexRules(BlockTree(16))
    rules.add_ranks([RANK])
    pump = Pump(rules)
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    # As a replica wires them (router/workers.py): a batch is offered to the parked pump from
    # the socket's callback, not awaited through `deliver` with reading paused meanwhile.
    sub = RankSubscriber(RankEndpoint(RANK, endpoint), pump.deliver, context=ctx, offer=pump.offer)
    seq = 0
    tasks = []

    async def push(payloads: list[bytes]) -> None:
        nonlocal seq
        for payload in payloads:
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            # Polled, one loop turn a check: no hook in the measured code, and no timing.
            while rules.cursors.get(RANK) != seq:  # noqa: ASYNC110
                await asyncio.sleep(0)
            seq += 1

    async def start() -> None:
        nonlocal seq
        pump.start()
        tasks.append(loop.create_task(sub.run()))
        probe = msgspec.msgpack.encode([1.0, [], 0])
        while rules.cursors.get(RANK) is None:  # until the subscription is live
            pub.send_multipart([b"", seq.to_bytes(8, "big"), probe])
            seq += 1
            await asyncio.sleep(0.01)
        while rules.cursors[RANK] != seq - 1:  # noqa: ASYNC110 - the probes sent since
            await asyncio.sleep(0.01)
        await push(load.warm)

    loop.run_until_complete(start())

    def measured() -> None:
        loop.run_until_complete(push(load.measured))

    return measured, load.stored_blocks


WORKLOADS: dict[str, Callable[[], tuple[Callable[[], None], int]]] = {
    "tree-remove": tree_remove,
    "decode-removals": decode_removals,
    "ingest-mixed": ingest_mixed,
    "ingest-churn": ingest_churn,
    "replica-churn": replica_churn,
}


def instructions(name: str, measure: bool) -> tuple[int, int]:
    """Instructions callgrind counted for one run of this script's child mode, and the blocks
    the workload handles (the child reports them, so the parent never builds the workload)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        argv += [sys.executable, __file__, "--child", name]
        if measure:
            argv.append("--measure")
        # A fixed string-hash seed: with it, the count is the same run after run.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
        found = re.search(r"Collected : (\d+)", done.stderr)
        blocks = re.search(r"^blocks (\d+)$", done.stdout, re.M)
        if found is None or blocks is None:
            raise RuntimeError(f"callgrind printed no total for {name}:\n{done.stderr[-2000:]}")
        return int(found.group(1)), int(blocks.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measured, blocks = WORKLOADS[args.child]()
        if args.measure:
            measured()
        print(f"blocks {blocks}")
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions: valgrind is not installed (apt install valgrind)")
    for name in args.workload or list(WORKLOADS):
        print(f"{name}: running under callgrind (set-up only, then set-up + workload)...")
        (base, blocks), (total, _) = instructions(name, False), instructions(name, True)
        print(f"{name}: {(total - base) / blocks:,.0f} instructions per block ({blocks:,} blocks)")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `bench`
    main()
