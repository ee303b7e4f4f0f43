"""Decode + key + apply throughput: engine payloads in, index mutations out, on one core.

The stream is what one rank publishes under load, encoded as vLLM >= 0.24 sends it: one batch
per scheduler step holding 4 events, each a BlockStored of 8 blocks x 16 tokens (vocabulary
150k). Half of the stores extend an
earlier chain through `parent_block_hash`, half start at the root. The `mixed` stream also
evicts: every other event removes the 8 blocks of an old chain leaf-first, so the tree stays
bounded as a real engine's cache does. Figures count blocks stored (and removed) per second
through `decode_batch` + `apply_events`, best of 3 runs over 5,000 batches.

Run: .venv/bin/python bench/bench_ingest.py
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import msgspec

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.events import decode_batch
from router.index import apply_events

BLOCKS = 8
BLOCK_SIZE = 16
VOCAB = 150_000
EVENTS_PER_BATCH = 4
BATCHES = 5_000


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def stream(mixed: bool, seed: int = 1, batches: int = BATCHES) -> tuple[list[bytes], int]:
    rng = random.Random(seed)
    payloads: list[bytes] = []
    live: list[list[int]] = []  # chains whose blocks are all still cached
    next_hash = 1
    blocks = 0
    for i in range(batches):
        events = []
        for j in range(EVENTS_PER_BATCH):
            if mixed and j % 2 and len(live) > 64:
                events.append(removed(list(reversed(live.pop(0)))))
            else:
                hashes = list(range(next_hash, next_hash + BLOCKS))
                next_hash += BLOCKS
                parent = rng.choice(live)[-1] if live and rng.random() < 0.5 else None
                tokens = [rng.randrange(VOCAB) for _ in range(BLOCKS * BLOCK_SIZE)]
                events.append(stored(hashes, parent, tokens))
                # Only fresh roots are evicted later, so a removal never strands a child.
                if parent is None:
                    live.append(hashes)
            blocks += BLOCKS
        payloads.append(msgspec.msgpack.encode([1767225600.0 + i, events, 0]))
    return payloads, blocks


def run(payloads: list[bytes]) -> float:
    tree = BlockTree(BLOCK_SIZE)
    rank = RankId("http://10.0.0.1:8000", 0)
    gc.collect()
    t0 = time.perf_counter()
    for payload in payloads:
        apply_events(tree, rank, decode_batch(payload).events)
    elapsed = time.perf_counter() - t0
    assert tree.stats.unknown_parent == 0
    return elapsed


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # --help, and no argument the figures would silently ignore
    for name, mixed in (("store only", False), ("store + evict", True)):
        payloads, blocks = stream(mixed)
        best = min(run(payloads) for _ in range(3))
        print(
            f"decode+key+apply, {name:13}: {blocks / best:>10,.0f} blocks/s "
            f"({len(payloads) / best:,.0f} batches/s, {EVENTS_PER_BATCH} events x {BLOCKS} blocks "
            f"x {BLOCK_SIZE} tokens)"
        )


if __name__ == "__main__":
    main()
