"""Export figures: a 1M-block `/internal/kv_snapshot` from the real app, and what it costs the
replica's event loop meanwhile.

Run: .venv/bin/python bench/bench_export.py [--blocks 1000000] [--ranks 8]

This process runs a real replica (`router.serving.start_serving`) with its tree filled directly
through the pump's state (tree, live set, cursors) before serving. Two child processes do the
asking, so their own work never delays the server's loop: a poller hits `/healthz` every
~5 ms for the whole run, and a requester fetches the snapshot in every variant, one after the
other. Both stamp with CLOCK_MONOTONIC, which all processes share, and this process slices
the poller's samples by the requester's phases. The requester then measures the fetch side:
how long decoding a 1M-node body stalls its own loop, on the loop, in `asyncio.to_thread`,
and sliced (`peer.fetch.decode_sliced`).

Prints figures; asserts nothing. Target: /healthz p99 < 50 ms during a 1M-block export.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from peer.fetch import SnapshotFetcher, decode_sliced
from peer.wire import COLUMNS, JSON, MSGPACK, decode
from router.replica import ServeConfig
from router.serving import start_serving, stop_serving

BLOCK = 16
CHAIN = 8
PATH = "/internal/kv_snapshot"
TOKEN = "bench-export-token-0123456789abcdef"  # the app's bearer token for /internal/*
ME = str(Path(__file__).resolve())


def build_tree(n_blocks: int, n_ranks: int, seed: int = 1) -> tuple[BlockTree, list[RankId]]:
    """`n_blocks` nodes in chains of 8; 2% of them are shared prefixes held by 3 ranks."""
    rng = random.Random(seed)
    tree = BlockTree(BLOCK)
    ranks = [RankId(f"http://10.0.{i // 2}.1:8000", i % 2) for i in range(n_ranks)]
    filler = [rng.randrange(1, 50_000) for _ in range(BLOCK * CHAIN)]
    next_hash = [1] * n_ranks
    shared = n_blocks // 50 // CHAIN
    for c in range(n_blocks // CHAIN):
        tokens = [c & 0xFFFF, c >> 16, *filler[2:]]
        holders = [c % n_ranks]
        if c < shared:
            holders += [(c + 1) % n_ranks, (c + 2) % n_ranks]
        for r in holders:
            tree.store(ranks[r], None, range(next_hash[r], next_hash[r] + CHAIN), tokens, BLOCK)
            next_hash[r] += CHAIN
    return tree, ranks


def stats_ms(samples: list[float]) -> str:
    if not samples:
        return "no samples"
    s = sorted(samples)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))] * 1000  # noqa: E731
    return f"p50 {p(0.5):5.1f} ms, p99 {p(0.99):5.1f} ms, max {s[-1] * 1000:6.1f} ms (n={len(s)})"


# -- child: the /healthz poller --------------------------------------------------------------


async def poll(url: str, interval_s: float) -> None:
    samples: list[tuple[float, float]] = []
    stop = asyncio.Event()
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), stop.set)  # parent closes stdin
    async with aiohttp.ClientSession() as session:
        print("ready", flush=True)
        while not stop.is_set():
            t0 = time.monotonic()
            async with session.get(url + "/healthz") as resp:
                await resp.read()
            t1 = time.monotonic()
            samples.append((t0, t1 - t0))
            await asyncio.sleep(max(0.0, interval_s - (t1 - t0)))
    print(json.dumps(samples))


# -- child: the requester ----------------------------------------------------------------------


ANY_AGE = "?max_age_ms=3600000"
PHASES = [
    # (name, query, Accept, Accept-Encoding). An export is built on a request that finds
    # none fresh enough; each encoding and its gzip on the first request that asks for it.
    ("cold build, columns", "?max_age_ms=0", COLUMNS, None),
    ("cached, columns", ANY_AGE, COLUMNS, None),
    ("cached, msgpack (first: encode)", ANY_AGE, MSGPACK, None),
    ("cached, msgpack", ANY_AGE, MSGPACK, None),
    ("cached, msgpack+gzip (first: gzip)", ANY_AGE, MSGPACK, "gzip"),
    ("cached, json (first: encode)", ANY_AGE, JSON, None),
    ("cached, json+gzip (first: gzip)", ANY_AGE, JSON, "gzip"),
    ("cold build, columns+gzip", "?max_age_ms=0", COLUMNS, "gzip"),
    ("cold build, msgpack", "?max_age_ms=0", MSGPACK, None),
]
# Phases whose work runs on the server's event loop (the walk, format-1 encoding in slices)
LOOP_WORK = ("cold build", "(first: encode)")


async def request(url: str) -> None:
    phases: list[dict[str, Any]] = []
    bodies: dict[str, bytes] = {}
    async with aiohttp.ClientSession(
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding",),
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as session:
        for name, query, accept, coding in PHASES:
            headers = {"Accept": accept}
            if coding:
                headers["Accept-Encoding"] = coding
            t0 = time.monotonic()
            async with session.get(url + PATH + query, headers=headers) as resp:
                body = await resp.read()
            t1 = time.monotonic()
            phases.append({"name": name, "t0": t0, "t1": t1, "bytes": len(body)})
            if not coding:
                bodies[accept] = body
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        # A bound above the 1M-block body (the default is sized for a 512 Mi pod).
        async with SnapshotFetcher(
            per_fetch_s=120, token=TOKEN, max_body_bytes=512 * 1024 * 1024
        ) as fetcher:
            result = await fetcher.fetch_snapshot(url, 0)
        phases.append(
            {"name": "peer.fetch client (cold build+decode)", "t0": t0, "t1": time.monotonic()}
        )
        assert hasattr(result, "snapshot"), result
        del result
    decoding = [await decode_costs(ct, body) for ct, body in bodies.items()]
    print(json.dumps({"phases": phases, "decoding": decoding}))


async def decode_costs(content_type: str, body: bytes) -> dict[str, Any]:
    """Wall time and the longest loop stall of three ways to decode one body."""

    async def on_loop() -> None:
        decode(body, content_type)

    async def in_thread() -> None:
        await asyncio.to_thread(decode, body, content_type)

    async def sliced() -> None:
        await decode_sliced(body, content_type)

    out: dict[str, Any] = {"content_type": content_type, "bytes": len(body)}
    for name, fn in (("on the loop", on_loop), ("to_thread", in_thread), ("sliced", sliced)):
        stop = asyncio.Event()
        gaps: list[float] = []

        async def ticker(stop: asyncio.Event = stop, gaps: list[float] = gaps) -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                gaps.append(time.perf_counter() - t0 - 0.001)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await fn()
        wall = time.perf_counter() - t0
        stop.set()
        await tick
        out[name] = {"wall_s": wall, "max_stall_s": max(gaps)}
    return out


# -- parent: the server --------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    tree, ranks = build_tree(args.blocks, args.ranks)
    built = time.perf_counter() - t0
    print(f"tree: {len(tree):,} nodes over {len(ranks)} ranks, built in {built:.1f} s")
    serving = await start_serving(
        ServeConfig(host="127.0.0.1", port=0, block_size=BLOCK, internal_token=TOKEN)
    )
    url = serving.url
    replica = serving.replica
    rules = replica.pump.rules
    rules.tree = tree
    rules.add_ranks(ranks)
    rules.cursors.update({rank: 1000 + i for i, rank in enumerate(ranks)})
    assert replica.producer is not None
    if args.slice_ms is not None:
        replica.producer.slice_s = args.slice_ms / 1000
    try:
        poller = await asyncio.create_subprocess_exec(
            sys.executable,
            ME,
            "--poll",
            url,
            "--poll-ms",
            str(args.poll_ms),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert poller.stdout is not None
        await poller.stdout.readline()  # "ready"
        await asyncio.sleep(1.0)  # an idle baseline
        idle_end = time.monotonic()
        requester = await asyncio.create_subprocess_exec(
            sys.executable, ME, "--request", url, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await requester.communicate()
        assert poller.stdin is not None
        poller.stdin.close()
        polled, _ = await poller.communicate()
    finally:
        producer = replica.producer
        last = producer.cached if producer is not None else None
        await stop_serving(serving)
    samples = [tuple(s) for s in json.loads(polled)]
    report = json.loads(out)
    idle = [d for t, d in samples if t < idle_end]
    print(f"/healthz idle (1 s before the first request): {stats_ms(idle)}")
    print()
    print(f"{'request':42} {'wall':>8} {'body':>12}   /healthz latency during it")
    export_lat: list[float] = []
    for ph in report["phases"]:
        during = [d for t, d in samples if ph["t0"] <= t <= ph["t1"]]
        if any(marker in ph["name"] for marker in LOOP_WORK):
            export_lat += during
        size = f"{ph['bytes'] / 1e6:9.1f} MB" if "bytes" in ph else " " * 12
        print(f"{ph['name']:42} {ph['t1'] - ph['t0']:6.2f} s {size}   {stats_ms(during)}")
    print()
    print(
        f"/healthz during the cold builds and first encodings: {stats_ms(export_lat)}  "
        "(target p99 < 50 ms)"
    )
    if last is not None:
        t = last.timings
        encodes = ", ".join(
            f"encode {name.split()[1]} {seconds:.2f} s"
            for name, seconds in t.items()
            if name.startswith("encode ")
        )
        print(
            f"last build on the server: walk {t['walk']:.2f} s, carrier table "
            f"{t['table']:.2f} s, export {t['export']:.2f} s; {encodes}"
        )
    print()
    print(
        "fetch side, decoding one 1M-node body (wall time / longest stall of the decoder's loop):"
    )
    for d in report["decoding"]:
        cells = ", ".join(
            f"{way} {d[way]['wall_s']:.2f} s / {d[way]['max_stall_s'] * 1000:.0f} ms"
            for way in ("on the loop", "to_thread", "sliced")
        )
        print(f"  {d['content_type']:20} {d['bytes'] / 1e6:6.1f} MB: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--poll-ms", type=float, default=5.0)
    parser.add_argument("--slice-ms", type=float, help="override the producer's slice")
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--request", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        asyncio.run(poll(args.poll, args.poll_ms / 1000))
    elif args.request:
        asyncio.run(request(args.request))
    else:
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
