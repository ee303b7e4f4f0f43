"""Memory figures behind the body bounds (README "Memory"): what a body costs once decoded.

    .venv/bin/python -m bench.bench_memory [--nodes 500000]

Each case runs in a fresh child process (so one case's heap does not flatter the next) and
reports, above the child's resident memory before the body is decoded:
- a sibling snapshot (`peer.fetch.decode_sliced` then `peer.vet`) as columns, msgpack and
  JSON: the peak while decoded and vetted, per body byte;
- a worker's `/v1/kv-snapshot` (`router.worker_snapshot`): decoded, then rebuilt into the
  index, and the index's bytes per block once the decoded body is freed.
The bounds `--kv-bootstrap-max-body-mb` and `--worker-snapshot-max-body-mb` are derived
from these figures and the manifest's memory limit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import subprocess
import sys
from typing import Any

import msgspec

CASES = ("columns", "msgpack", "json", "worker")


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _peer_case(kind: str, n: int) -> dict[str, Any]:
    from cachetree.keys import KEY_SCHEME
    from cachetree.ranks import RankId
    from peer.fetch import decode_sliced
    from peer.vet import VettedSnapshot
    from peer.wire import (
        COLUMNS,
        JSON,
        MSGPACK,
        PeerSnapshot,
        WireNode,
        WireWorker,
        columns_of,
        encode,
        encode_columns,
        head_of,
    )

    rng = random.Random(1)
    nodes = [
        WireNode(
            None if i % 40 == 0 else i - 1,
            rng.getrandbits(64),
            [(i % 4, 1, rng.getrandbits(64))] + ([((i + 1) % 4, 1, 7)] if i % 3 == 0 else []),
        )
        for i in range(n)
    ]
    workers = [WireWorker(f"http://w{i}:1", 0) for i in range(4)]
    snap = PeerSnapshot(
        format=1,
        block_size=16,
        key_scheme=KEY_SCHEME,
        producer_ready=True,
        workers=workers,
        cursors=[(i, 5) for i in range(4)],
        nodes=nodes,
    )
    if kind == "columns":
        body = b"".join(bytes(p) for p in encode_columns(head_of(snap), columns_of(nodes)))
        content_type = COLUMNS
    else:
        content_type = MSGPACK if kind == "msgpack" else JSON
        body = encode(snap, content_type)
    del nodes, snap
    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    decoded = asyncio.run(decode_sliced(body, content_type))
    VettedSnapshot.from_wire(decoded, [RankId(w.url, 0) for w in workers], 16)
    peak = _status("VmHWM") - base
    return {"case": kind, "nodes": n, "body_mb": len(body) / 1e6, "peak_mb": peak / 1e6}


def _worker_case(n: int) -> dict[str, Any]:
    from cachetree.ranks import RankId
    from cachetree.tree import BlockTree
    from router.worker_snapshot import decode_worker_snapshot, rebuild_rank

    rng = random.Random(1)
    blocks, parent = [], None
    for i in range(n):
        engine_hash = rng.getrandbits(63)
        blocks.append(
            {
                "engine_hash": engine_hash,
                "parent_engine_hash": parent if i % 50 else None,
                "token_ids": [rng.randrange(3, 50_000) for _ in range(16)],
                "tier": "device",
            }
        )
        parent = engine_hash
    body = msgspec.json.encode({"ranks": [{"dp_rank": 0, "last_seq": 5, "blocks": blocks}]})
    body = body[:-1] + b', "block_size": 16}'
    del blocks
    gc.collect()
    _reset_peak()
    base = _status("VmRSS")
    snap = decode_worker_snapshot(body, limit=len(body))
    tree = BlockTree(16)
    rebuild_rank(tree, RankId("http://w:1", 0), snap.ranks[0], 16)
    peak = _status("VmHWM") - base
    del snap
    gc.collect()
    indexed = _status("VmRSS") - base
    return {
        "case": "worker",
        "nodes": n,
        "body_mb": len(body) / 1e6,
        "peak_mb": peak / 1e6,
        "index_b_per_block": indexed / n,
    }


def _child(case: str, n: int) -> None:
    out = _worker_case(n) if case == "worker" else _peer_case(case, n)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=500_000)
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.nodes)
        return
    print(f"{'case':<9} {'nodes':>9} {'body MB':>8} {'B/node':>7} {'peak MB':>8} {'x body':>7}")
    for case in CASES:
        n = args.nodes if case != "worker" else args.nodes // 2
        argv = [sys.executable, "-m", "bench.bench_memory", "--child", case, "--nodes", str(n)]
        row = json.loads(subprocess.run(argv, check=True, capture_output=True).stdout)
        extra = (
            f"  index {row['index_b_per_block']:.0f} B/block" if "index_b_per_block" in row else ""
        )
        print(
            f"{row['case']:<9} {row['nodes']:>9,} {row['body_mb']:>8.1f} "
            f"{row['body_mb'] * 1e6 / row['nodes']:>7.1f} {row['peak_mb']:>8.1f} "
            f"{row['peak_mb'] / row['body_mb']:>7.1f}{extra}"
        )


if __name__ == "__main__":
    main()
