"""A flood of stores on one rank: `/healthz` latency while millions of blocks arrive, the cap.

One fake worker (in this process, a real ZMQ PUB on loopback) publishes `--blocks` distinct
blocks on its rank as fast as the replica takes them: batches of one `BlockStored` of
`--event-blocks` blocks each (4,096 by default, a 64k-token prefill step; 65,536 is the
decoder's cap per event, the largest single piece of work one event can ask for), every one
chained under the last, so every block is new. A real `kvrouter serve` child ingests them with
`--kv-index-max-blocks` set below the flood. Meanwhile a client here polls the replica's
`/healthz` at a steady rate (every `--healthz-ms`) and records each answer's latency. Printed:
`/healthz` p50 / p99 / max during the flood, the time the flood took to be applied, the
replica's peak RSS (VmHWM), the blocks its index holds at the end and the cap clears it
counted.

`--baseline REV` runs the same flood against another commit's code first (without the cap
flag when that code has none), as `bench/ingest_churn.py` does.

Run: .venv/bin/python bench/ingest_flood.py [--blocks 8000000] [--cap 2000000] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_proxy
from bench.bench_proxy import checkout
from bench.ingest_churn import ROOT, Code, start_router, summary
from bench.ingest_zmq import gate
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process

BLOCK_SIZE: Final = 16


def payload(first_hash: int, n_blocks: int, parent: int | None) -> bytes:
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + n_blocks)),
        "parent_block_hash": parent,
        # One-byte tokens: the chain makes every key distinct, the wire stays small.
        "token_ids": [7] * (n_blocks * BLOCK_SIZE),
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([1767225600.0, [event], 0])


def poll_healthz(
    router: str, period_s: float, stop: threading.Event, latencies: list[float]
) -> None:
    """GET /healthz every `period_s` until `stop`, on one keep-alive connection."""
    url = urlsplit(router)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    due = time.perf_counter()
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            latencies.append((time.perf_counter() - t0) * 1000)
            due += period_s
            time.sleep(max(0.0, due - time.perf_counter()))
    finally:
        conn.close()


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def metric(session: aiohttp.ClientSession, router: str, name: str) -> float:
    async with session.get(router + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


async def flood(
    code: Path, label: str, fw: FakeWorkerHandle, args: argparse.Namespace, cap: bool
) -> dict[str, Any]:
    extra = ["--kv-index-max-blocks", str(args.cap)] if cap else []
    child, router = await start_router(Code(label, code, {}), [fw], Path(args.workdir), extra)
    assert child.proc is not None and fw.worker is not None
    pid = child.proc.pid
    publisher = fw.worker.publishers[0]
    latencies: list[float] = []
    stop = threading.Event()
    payloads = []
    parent = None
    for first in range(1, args.blocks + 1, args.event_blocks):
        n = min(args.event_blocks, args.blocks + 1 - first)
        payloads.append(payload(first, n, parent))
        parent = first + n - 1
    try:
        async with aiohttp.ClientSession() as session:
            await bench_proxy.wait_ready(session, router)
            await gate(session, router, [fw])
            # Its own thread and a blocking client: the load generator's loop cannot delay it.
            poller = threading.Thread(
                target=poll_healthz, args=(router, args.healthz_ms / 1000, stop, latencies)
            )
            poller.start()
            started = time.perf_counter()
            for p in payloads:
                publisher.publish(p)
                await asyncio.sleep(0.01)
            want = publisher.last_seq
            while True:
                async with session.get(router + "/workers", headers=bench_proxy.AUTH) as resp:
                    cursor = (await resp.json())["workers"][0]["ranks"][0]["cursor"]
                if cursor is not None and cursor >= want:
                    break
                await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - started
            stop.set()
            poller.join()
            tree_blocks = await metric(session, router, "kvrouter_tree_blocks")
            clears = await metric(session, router, "kvrouter_index_cap_clears")
            lost = await metric(session, router, "kvrouter_kv_event_batches_lost")
            rss = peak_rss_mb(pid)
    finally:
        stop.set()
        await child.stop()
    latencies.sort()
    return {
        "label": label,
        "blocks": args.blocks,
        "seconds": elapsed,
        "blocks_per_s": args.blocks / elapsed,
        "healthz_n": len(latencies),
        "healthz_p50_ms": latencies[len(latencies) // 2],
        "healthz_p99_ms": latencies[int(len(latencies) * 0.99)],
        "healthz_max_ms": latencies[-1],
        "peak_rss_mb": rss,
        "index_blocks_at_end": tree_blocks,
        "cap_clears": clears,
        "lost_batches": lost,
    }


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"flood: {args.blocks:,} new blocks on one rank, events of {args.event_blocks:,} "
        f"blocks; /healthz every {args.healthz_ms:g} ms; cap {args.cap:,} blocks",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="kvflood-") as tmp:
        args.workdir = tmp
        runs = [("new", ROOT, True)]
        if args.baseline:
            old = checkout(args.baseline, Path(tmp) / "old")
            runs.insert(0, (f"old ({args.baseline})", old, args.baseline_cap))
        rows: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
        async with fake_worker_in_process(cache_blocks=1 << 20) as fw:
            for label, code, cap in [run for _ in range(args.rounds) for run in runs]:
                r = await flood(code, label, fw, args, cap)
                rows[label].append(r)
                print(
                    f"{r['label']:>16}: {r['blocks']:,} blocks applied in {r['seconds']:.1f} s "
                    f"({r['blocks_per_s']:,.0f}/s); /healthz p50 {r['healthz_p50_ms']:.1f} ms, "
                    f"p99 {r['healthz_p99_ms']:.1f} ms, max {r['healthz_max_ms']:.0f} ms "
                    f"({r['healthz_n']} polls); peak RSS {r['peak_rss_mb']:,.0f} MB; index "
                    f"{r['index_blocks_at_end']:,.0f} blocks at the end, cap clears "
                    f"{r['cap_clears']:.0f}, lost batches {r['lost_batches']:.0f}",
                    flush=True,
                )
        for label, results in rows.items():
            print(
                f"{label:>16}: median (range) of {len(results)}: /healthz p99 "
                f"{summary(results, 'healthz_p99_ms')} ms, p50 "
                f"{summary(results, 'healthz_p50_ms')} ms, max "
                f"{summary(results, 'healthz_max_ms')} ms; blocks/s "
                f"{summary(results, 'blocks_per_s')}; peak RSS {summary(results, 'peak_rss_mb')} MB"
            )
        if args.keep_logs:
            shutil.copytree(tmp, args.keep_logs, dirs_exist_ok=True, ignore=_only_logs)


def _only_logs(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".log")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8_000_000)
    parser.add_argument(
        "--event-blocks", type=int, default=4096, help="blocks per event (decoder cap: 65,536)"
    )
    parser.add_argument("--cap", type=int, default=2_000_000, help="--kv-index-max-blocks")
    parser.add_argument("--healthz-ms", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each code, interleaved")
    parser.add_argument("--baseline", help="first run this git revision's code the same way")
    parser.add_argument("--keep-logs", type=Path, help="copy the replicas' logs into this dir")
    parser.add_argument(
        "--baseline-cap", action="store_true", help="the baseline code has the cap flag too"
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
