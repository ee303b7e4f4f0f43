"""Scale: memory, export stall, bootstrap time and ingest rate of one replica at millions of blocks.

Run: .venv/bin/python -m bench.scale [--sizes 1000000,3000000,6000000] [--baseline REV]
     [--ingest-processes 0,1,2] [--rounds 1]
     (or `kvrouter bench --only scale`)

Prints the table of issue 17 per code (`--baseline REV` runs another commit's code the same
way first, in the same session, size by size), and asserts nothing. Progress goes to stderr.

What runs, per size and code (a fresh replica each time, real processes, loopback):

- 4 fake workers in this process, dp 16 each: 64 ranks, each its own real ZMQ PUB.
- Replica A, a `kvrouter serve` child, subscribes to them. It is filled through ZMQ with
  vLLM-format batches: chains of 8 blocks x 16 tokens, 16 chains (events) per batch, one chain
  in four stored by a second rank too (its own engine hashes), so (rank, block) pairs are
  1.25 x blocks. A window of `FILL_WINDOW` batches per rank (read from `/workers` cursors) keeps
  the ZMQ queues short, so the replica's memory is its index, not queued frames. `fill
  blocks/s` is that ingest rate (8-block stores).
- RSS steady: VmRSS of A `SETTLE_S` after the fill. Per block = (RSS - RSS at start, before
  any worker) / blocks.
- Cold export: `GET /internal/kv_snapshot` (columns, as a sibling asks) from a thread here,
  while another thread polls A's `/healthz` every `HEALTHZ_MS`: the wall time of that request,
  and the `/healthz` p99 / max during it. RSS after: VmRSS right after the answer (the export
  cached) and again `max_age` + 1 s later (where the code drops the cached export then).
- Bootstrap: replica B, `kvrouter serve --peer A` with the same workers, from its first
  "worker ... registered" log line to its first `/readyz` 200 (both wall clock); B's own
  `/healthz` p99 during it (a poller from the moment it listens), B's peak RSS (VmHWM) and its
  RSS steady after. B holds the same view: its `kvrouter_tree_nodes` is compared with A's.
- Ingest: vLLM-shaped churn on A (each batch 8 one-block `BlockStored`, decode steps of 8
  requests, and 8 one-block `BlockRemoved` of finished requests, leaf first), published with
  the same window on all 64 ranks; blocks/s = stored + removed blocks applied / time until
  every cursor reached the last batch. With `--ingest-processes` the new code's replica runs
  once per count (`--kv-ingest-processes N`, its own fill skipped: a small index) and the
  replica's CPU (its process and its children) is printed with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_proxy
from bench.bench_bootstrap import read_child_log
from bench.bench_proxy import checkout
from bench.ingest_churn import ROOT, Code, loop_cpu, start_router
from bench.ingest_flood import metric
from bench.report import table
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process

BLOCK: Final = 16
CHAIN: Final = 8
CHAINS_PER_BATCH: Final = 16
WORKERS: Final = 4
DP: Final = 16
FILL_WINDOW: Final = 16  # batches a rank may be published ahead of its cursor (fill)
CHURN_WINDOW: Final = 64  # the same for the churn (small batches)
SETTLE_S: Final = 3.0
HEALTHZ_MS: Final = 10.0
EXPORT_MAX_AGE_S: Final = 2.0  # the producer's default max_age
CHURN_BATCHES: Final = 300  # per rank
CHURN_LANES: Final = 8  # requests decoding at once per rank
CHURN_LEN: Final = 16  # blocks per request
DEFAULT_SIZES: Final = "1000000,3000000,6000000"
QUICK_SIZES: Final = "200000"
SNAPSHOT: Final = "/internal/kv_snapshot"
COLUMNS: Final = "application/vnd.kvrouter.columns"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- what the workers publish ----------------------------------------------------------------


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def _batch(events: list[dict[str, Any]], dp_rank: int) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, dp_rank])


def fill_batches(n_blocks: int, n_ranks: int) -> Iterator[tuple[int, bytes]]:
    """(rank, payload): chains of CHAIN blocks, chain c on rank c % R, one in four also on
    the next rank; CHAINS_PER_BATCH chains per batch."""
    filler = [3 + (i * 7919) % 50_000 for i in range(BLOCK * CHAIN)]
    pending: list[list[dict[str, Any]]] = [[] for _ in range(n_ranks)]
    engine_hash = [1] * n_ranks
    for c in range(n_blocks // CHAIN):
        tokens = [3 + (c & 0xFFFF), 3 + (c >> 16), *filler[2:]]
        for r in (c % n_ranks, (c + 1) % n_ranks) if c % 4 == 0 else (c % n_ranks,):
            first = engine_hash[r]
            engine_hash[r] += CHAIN
            pending[r].append(_stored(list(range(first, first + CHAIN)), None, tokens))
            if len(pending[r]) == CHAINS_PER_BATCH:
                yield r, _batch(pending[r], r % DP)
                pending[r] = []
    for r, events in enumerate(pending):
        if events:
            yield r, _batch(events, r % DP)


def churn_batches(n_ranks: int, batches: int) -> Iterator[tuple[int, bytes]]:
    """(rank, payload), rank by rank in turn: per batch CHURN_LANES one-block stores (the next
    decode step of each running request) and as many one-block removals (the blocks of
    finished requests, leaf first). Engine hashes start far above the fill's."""
    base = 1 << 40
    lanes = [[(0, 0, None)] * CHURN_LANES for _ in range(n_ranks)]  # (request, step, last hash)
    finished: list[list[int]] = [[] for _ in range(n_ranks)]
    next_request = [0] * n_ranks
    serial = [0] * n_ranks
    for _ in range(batches):
        for r in range(n_ranks):
            events = []
            for lane in range(CHURN_LANES):
                request, step, parent = lanes[r][lane]
                if step == 0:
                    request = next_request[r]
                    next_request[r] += 1
                serial[r] += 1
                h = base + r * (1 << 32) + serial[r]
                tokens = [3 + (request & 0xFFFF), 3 + (request >> 16) + r * 7, *range(5, 19)]
                if step:
                    tokens = [3 + (step * 31 + i) % 50_000 for i in range(BLOCK)]
                events.append(_stored([h], parent, tokens))
                step += 1
                if step == CHURN_LEN:
                    finished[r].append(h)  # its chain, leaf first, is known by hash order
                    step, h = 0, None
                lanes[r][lane] = (request, step, h)
            evict = finished[r]
            removals = []
            while evict and len(removals) < CHURN_LANES:
                removals.append(evict.pop(0))
            events += [_removed([h]) for h in removals]
            yield r, _batch(events, r % DP)


# -- the replica's side ----------------------------------------------------------------------


def rss_mb(pid: int, field_name: str = "VmRSS:") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name):
                return int(line.split()[1]) / 1024
    return float("nan")


def family_pids(pid: int) -> list[int]:
    """The process and its descendants (ingest processes)."""
    out = [pid]
    for p in out:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    out += [int(c) for c in f.read().split()]
    return out


def family_cpu_s(pid: int) -> float:
    return sum(bench_proxy.cpu_seconds(p) for p in family_pids(pid))


def family_rss_mb(pid: int) -> float:
    return sum(rss_mb(p) for p in family_pids(pid))


class HealthzPoller:
    """GET /healthz every `period_s` from a thread of its own, on one keep-alive connection."""

    def __init__(self, router: str, period_s: float = HEALTHZ_MS / 1000) -> None:
        self._url = urlsplit(router)
        self._period = period_s
        self._stop = threading.Event()
        self.samples: list[tuple[float, float]] = []  # (monotonic start, latency ms)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthzPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self._url.hostname, self._url.port, timeout=60)
        due = time.perf_counter()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
            except OSError:
                conn.close()
                time.sleep(self._period)
                continue
            self.samples.append((time.monotonic(), (time.perf_counter() - t0) * 1000))
            due += self._period
            time.sleep(max(0.0, due - time.perf_counter()))
        conn.close()

    def between(self, start: float, end: float) -> dict[str, float]:
        lat = sorted(ms for t, ms in self.samples if start <= t <= end)
        if not lat:
            return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
        return {
            "n": len(lat),
            "p50": lat[len(lat) // 2],
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max": lat[-1],
        }


async def cursors(session: aiohttp.ClientSession, router: str) -> dict[tuple[str, int], int]:
    async with session.get(router + "/workers") as resp:
        view = await resp.json()
    return {
        (w["url"], r["dp_rank"]): -1 if r["cursor"] is None else r["cursor"]
        for w in view["workers"]
        for r in w["ranks"]
    }


@dataclass
class Fleet:
    handles: list[FakeWorkerHandle]
    ranks: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ranks = [(h.url, dp) for h in self.handles for dp in range(DP)]

    def publish(self, rank: int, payload: bytes) -> int:
        worker = self.handles[rank // DP].worker
        assert worker is not None
        return worker.publishers[rank % DP].publish(payload)


async def publish_windowed(
    session: aiohttp.ClientSession,
    router: str,
    fleet: Fleet,
    batches: Iterator[tuple[int, bytes]],
    window: int,
) -> tuple[int, float]:
    """Publish every batch, at most `window` ahead of its rank's cursor; returns (batches,
    seconds until the replica applied the last of each rank)."""
    published = [-1] * len(fleet.ranks)
    applied = [-1] * len(fleet.ranks)
    index = {rank: i for i, rank in enumerate(fleet.ranks)}
    count = 0
    started = time.perf_counter()

    async def refresh() -> None:
        for rank, seq in (await cursors(session, router)).items():
            if rank in index:
                applied[index[rank]] = seq

    for r, payload in batches:
        while published[r] - applied[r] >= window:
            await asyncio.sleep(0.01)
            await refresh()
        published[r] = fleet.publish(r, payload)
        count += 1
        if count % 64 == 0:
            await asyncio.sleep(0)
    while any(a < p for a, p in zip(applied, published, strict=True)):
        await asyncio.sleep(0.01)
        await refresh()
    return count, time.perf_counter() - started


async def gate(session: aiohttp.ClientSession, router: str, fleet: Fleet) -> None:
    """A probe batch on every rank until the replica applied one of each (subscriptions up)."""
    probe = _batch([_stored([(1 << 60) + 1], None, [2] * BLOCK)], 0)
    async with asyncio.timeout(60):
        while True:
            sent = [fleet.publish(r, probe) for r in range(len(fleet.ranks))]
            await asyncio.sleep(0.2)
            seen = await cursors(session, router)
            if all(seen.get(rank, -1) >= s for rank, s in zip(fleet.ranks, sent, strict=True)):
                return


def fetch_export(router: str) -> tuple[float, int, float, float]:
    """(monotonic start, status, monotonic end, body MB) of one columnar export request."""
    url = urlsplit(router)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    t0 = time.monotonic()
    conn.request("GET", SNAPSHOT + "?max_age_ms=0", headers={"Accept": COLUMNS, **bench_proxy.AUTH})
    resp = conn.getresponse()
    body = resp.read()
    t1 = time.monotonic()
    conn.close()
    return t0, resp.status, t1, len(body) / 1e6


async def wait_ready_or_dead(session: aiohttp.ClientSession, url: str, child: Any) -> float:
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url + "/readyz") as resp:
                if resp.status == 200:
                    return time.time()
        if child.proc.returncode is not None:
            raise RuntimeError(f"replica exited {child.proc.returncode}: {child.log_tail()}")
        await asyncio.sleep(0.01)


async def one_size(
    code: Path, label: str, fleet: Fleet, blocks: int, workdir: Path, extra: Sequence[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {"label": label, "blocks": blocks}
    flags = [*extra, "--kv-index-max-blocks", str(4 * blocks), "--log-level", "info"]
    a, router = await start_router(Code(f"{label}-A", code, {}), fleet.handles, workdir, flags)
    assert a.proc is not None
    pid = a.proc.pid
    b = None
    try:
        async with aiohttp.ClientSession(headers=bench_proxy.AUTH) as session:
            await bench_proxy.wait_ready(session, router)
            await asyncio.sleep(0.5)
            out["rss_start_mb"] = family_rss_mb(pid)
            await gate(session, router, fleet)
            progress(f"{label}: filling {blocks:,} blocks")
            _, seconds = await publish_windowed(
                session, router, fleet, fill_batches(blocks, len(fleet.ranks)), FILL_WINDOW
            )
            out["fill_blocks_per_s"] = blocks * 1.25 / seconds
            out["nodes"] = int(await metric(session, router, "kvrouter_tree_nodes"))
            await asyncio.sleep(SETTLE_S)
            out["rss_steady_mb"] = family_rss_mb(pid)
            progress(f"{label}: {out['nodes']:,} nodes, RSS {out['rss_steady_mb']:,.0f} MB")
            with HealthzPoller(router) as poller:
                await asyncio.sleep(0.5)
                t0, status, t1, mb = await asyncio.to_thread(fetch_export, router)
                out["rss_export_held_mb"] = family_rss_mb(pid)
                await asyncio.sleep(EXPORT_MAX_AGE_S + 1.5)
            out["export_status"] = status
            out["export_s"] = t1 - t0
            out["export_mb"] = mb
            out["export_healthz"] = poller.between(t0, t1)
            out["rss_after_export_mb"] = family_rss_mb(pid)
            out["rss_peak_a_mb"] = rss_mb(pid, "VmHWM:")
            progress(
                f"{label}: export {out['export_s']:.1f} s, healthz {out['export_healthz']}; "
                f"RSS held {out['rss_export_held_mb']:,.0f}, "
                f"after {out['rss_after_export_mb']:,.0f}"
            )
            # Bootstrap: B joins A.
            # The columnar body is ~37 B a block: raise the 24 MB default bound with the index.
            body_mb = str(max(24, blocks // 10_000))
            b_flags = [*flags, "--peer", router, "--kv-bootstrap-max-body-mb", body_mb]
            b, b_url = await start_router(
                Code(f"{label}-B", code, {}), fleet.handles, workdir, b_flags
            )
            assert b.proc is not None
            with HealthzPoller(b_url) as b_poller, HealthzPoller(router) as a_poller:
                b_started = time.monotonic()
                ready_wall = await wait_ready_or_dead(session, b_url, b)
                ready_mono = time.monotonic()
            b_log = read_child_log(b.log_path)
            first = b_log.registered[0] if b_log.registered else float("nan")
            out["bootstrap_s"] = ready_wall - first
            out["bootstrap_healthz_b"] = b_poller.between(b_started, ready_mono)
            out["bootstrap_healthz_a"] = a_poller.between(b_started, ready_mono)
            out["b_nodes"] = int(await metric(session, b_url, "kvrouter_tree_nodes"))
            if out["b_nodes"] != out["nodes"]:  # a cold B would time nothing of a bootstrap
                raise RuntimeError(
                    f"B holds {out['b_nodes']:,} nodes, A {out['nodes']:,}: no graft (B's log "
                    f"{workdir}/router-{label}-B.log says why)"
                )
            out["rss_peak_b_mb"] = rss_mb(b.proc.pid, "VmHWM:")
            await asyncio.sleep(SETTLE_S)
            out["rss_steady_b_mb"] = family_rss_mb(b.proc.pid)
            progress(
                f"{label}: bootstrap {out['bootstrap_s']:.1f} s, B nodes {out['b_nodes']:,}, "
                f"B healthz {out['bootstrap_healthz_b']}, B peak {out['rss_peak_b_mb']:,.0f} MB"
            )
            await b.stop()
            b = None
            out.update(await churn(session, router, pid, fleet))
    finally:
        if b is not None:
            await b.stop()
        await a.stop()
    return out


async def churn(
    session: aiohttp.ClientSession, router: str, pid: int, fleet: Fleet
) -> dict[str, Any]:
    payloads = list(churn_batches(len(fleet.ranks), CHURN_BATCHES))
    cpu0, loop0 = family_cpu_s(pid), loop_cpu(pid)
    n, seconds = await publish_windowed(session, router, fleet, iter(payloads), CHURN_WINDOW)
    cpu, loop = family_cpu_s(pid) - cpu0, loop_cpu(pid) - loop0
    blocks = n * CHURN_LANES * 2
    return {
        "churn_blocks_per_s": blocks / seconds,
        "churn_cores": cpu / seconds,
        # The event loop's thread is the pump's: its CPU per block bounds capacity when the
        # other work (ZMQ threads, ingest processes) has cores of its own.
        "churn_loop_us_per_block": loop / blocks * 1e6,
        "churn_all_us_per_block": cpu / blocks * 1e6,
    }


async def ingest_only(
    code: Path, label: str, fleet: Fleet, workdir: Path, extra: Sequence[str]
) -> dict[str, Any]:
    a, router = await start_router(Code(label, code, {}), fleet.handles, workdir, extra)
    assert a.proc is not None
    try:
        async with aiohttp.ClientSession(headers=bench_proxy.AUTH) as session:
            await bench_proxy.wait_ready(session, router)
            await gate(session, router, fleet)
            return {"label": label, **await churn(session, router, a.proc.pid, fleet)}
    finally:
        await a.stop()


def per_block(row: dict[str, Any], key: str) -> float:
    return (row[key] - row["rss_start_mb"]) * 1024 * 1024 / row["nodes"]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="kvscale-") as tmp:
        workdir = Path(args.workdir or tmp)
        codes: list[tuple[str, Path, list[str]]] = [("new", ROOT, [])]
        if args.baseline:
            old = checkout(args.baseline, Path(tmp) / "old")
            codes.insert(0, ("old", old, []))
        rows: list[dict[str, Any]] = []
        ingest: list[dict[str, Any]] = []
        async with contextlib.AsyncExitStack() as stack:
            handles = [
                await stack.enter_async_context(
                    # caches as big as what the fill stores (the vetting refuses a sibling
                    # claiming more blocks on a rank than its engine holds)
                    fake_worker_in_process(dp_size=DP, cache_blocks=1 << 18)
                )
                for _ in range(WORKERS)
            ]
            fleet = Fleet(handles)
            for _ in range(args.rounds):
                for blocks in sizes:
                    for label, code, extra in codes:
                        try:
                            row = await one_size(code, label, fleet, blocks, workdir, extra)
                        except Exception as exc:  # a failed size must not hide the others
                            where = traceback.extract_tb(exc.__traceback__)[-1]
                            progress(
                                f"{label} at {blocks:,}: FAILED {exc!r} at "
                                f"{where.filename}:{where.lineno} (logs in {workdir})"
                            )
                            continue
                        rows.append(row)
                        print(row_line(row), flush=True)
            if args.ingest_processes:
                for _ in range(args.rounds):
                    for count in [int(c) for c in args.ingest_processes.split(",")]:
                        flags = ["--kv-ingest-processes", str(count)]
                        r = await ingest_only(ROOT, f"new-p{count}", fleet, workdir, flags)
                        r["processes"] = count
                        ingest.append(r)
                        print(f"ingest {r}", flush=True)
                    if args.baseline:
                        r = await ingest_only(codes[0][1], "old", fleet, workdir, [])
                        r["processes"] = None
                        ingest.append(r)
                        print(f"ingest {r}", flush=True)
    return {"sizes": sizes, "rows": rows, "ingest": ingest}


def row_line(r: dict[str, Any]) -> str:
    return (
        f"{r['label']} {r['blocks']:,}: RSS steady {r['rss_steady_mb']:,.0f} MB "
        f"({per_block(r, 'rss_steady_mb'):.0f} B/block), after export "
        f"{r['rss_after_export_mb']:,.0f} MB ({per_block(r, 'rss_after_export_mb'):.0f} B/block, "
        f"held {r['rss_export_held_mb']:,.0f}), export {r['export_s']:.2f} s "
        f"(healthz p99 {r['export_healthz']['p99']:.0f} max {r['export_healthz']['max']:.0f} ms), "
        f"bootstrap {r['bootstrap_s']:.2f} s (B healthz p99 "
        f"{r['bootstrap_healthz_b']['p99']:.0f} max {r['bootstrap_healthz_b']['max']:.0f} ms; "
        f"A p99 {r['bootstrap_healthz_a']['p99']:.0f} ms), B {r['b_nodes']:,} nodes peak "
        f"{r['rss_peak_b_mb']:,.0f} MB steady {r['rss_steady_b_mb']:,.0f} MB; fill "
        f"{r['fill_blocks_per_s']:,.0f}/s, churn {r['churn_blocks_per_s']:,.0f}/s "
        f"({r['churn_cores']:.2f} cores)"
    )


def _median_range(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    s = sorted(values)
    med = format(statistics.median(s), fmt)
    return med if len(s) == 1 else f"{med} ({format(s[0], fmt)}-{format(s[-1], fmt)})"


def tables(result: dict[str, Any]) -> dict[str, str]:
    header = [
        "code, blocks",
        "RSS steady MiB (B/block)",
        "after an export MiB (B/block)",
        "cold export s",
        "/healthz p99 / max during it ms",
        "bootstrap registration -> ready s",
        "joiner /healthz p99 / max ms",
        "joiner peak / steady RSS MiB",
        "ingest blocks/s (vLLM churn)",
    ]
    out_rows = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        groups.setdefault((r["label"], r["blocks"]), []).append(r)
    for (label, blocks), rs in groups.items():

        def col(key: str, fmt: str = ",.0f", rs: list[dict[str, Any]] = rs) -> str:
            return _median_range([r[key] for r in rs], fmt)

        def sub(key: str, part: str, rs: list[dict[str, Any]] = rs) -> str:
            return _median_range([r[key][part] for r in rs], ",.0f")

        steady = _median_range([per_block(r, "rss_steady_mb") for r in rs], ",.0f")
        after = _median_range([per_block(r, "rss_after_export_mb") for r in rs], ",.0f")
        out_rows.append(
            [
                f"{label}, {blocks:,}",
                f"{col('rss_steady_mb')} ({steady})",
                f"{col('rss_after_export_mb')} ({after})",
                col("export_s", ".2f"),
                f"{sub('export_healthz', 'p99')} / {sub('export_healthz', 'max')}",
                col("bootstrap_s", ".2f"),
                f"{sub('bootstrap_healthz_b', 'p99')} / {sub('bootstrap_healthz_b', 'max')}",
                f"{col('rss_peak_b_mb')} / {col('rss_steady_b_mb')}",
                col("churn_blocks_per_s"),
            ]
        )
    note = (
        f"64 ranks (4 fake workers x dp {DP}), chains of {CHAIN} blocks, 1.25 (rank, block) "
        "pairs per block; B/block = (RSS - RSS before any worker) / index nodes. Ingest: "
        f"{CHURN_LANES} one-block stores + {CHURN_LANES} one-block removals per batch, stored + "
        "removed blocks per second on the filled replica."
    )
    tabs = {"scale": table(header, out_rows, note=note)}
    if result.get("ingest"):
        ing = []
        by: dict[Any, list[dict[str, Any]]] = {}
        for r in result["ingest"]:
            by.setdefault(r["processes"], []).append(r)
        for count, rs in by.items():
            ing.append(
                [
                    "old (in the loop)" if count is None else f"new, {count} ingest process(es)",
                    _median_range([r["churn_blocks_per_s"] for r in rs], ",.0f"),
                    _median_range([r["churn_cores"] for r in rs], ".2f"),
                    _median_range([r["churn_loop_us_per_block"] for r in rs], ".2f"),
                    _median_range([r["churn_all_us_per_block"] for r in rs], ".2f"),
                    _median_range([1e6 / r["churn_loop_us_per_block"] for r in rs], ",.0f"),
                ]
            )
        tabs["scale-ingest"] = table(
            [
                "replica",
                "blocks/s (stored + removed)",
                "replica CPU, cores",
                "event-loop thread us/block",
                "all processes us/block",
                "loop-bound capacity blocks/s",
            ],
            ing,
        )
    return tabs


def run(ctx: Any) -> dict[str, Any]:
    args = argparse.Namespace(
        sizes=QUICK_SIZES if ctx.quick else DEFAULT_SIZES,
        baseline=None,
        rounds=1,
        ingest_processes="0,1,2",
        workdir=str(ctx.workdir),
    )
    return asyncio.run(main_async(args))


def plot(result: dict[str, Any], plt: Any, out: Path) -> list[Path]:
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES)
    parser.add_argument("--quick", action="store_true", help=f"--sizes {QUICK_SIZES}")
    parser.add_argument("--baseline", help="also run this git revision's code, size by size")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--ingest-processes", default="", help="comma list of --kv-ingest-processes to measure"
    )
    parser.add_argument("--workdir", help="keep the replicas' logs here")
    args = parser.parse_args()
    if args.quick:
        args.sizes = QUICK_SIZES
    if args.workdir:  # the replicas' logs go there: a missing folder failed every size
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    result = asyncio.run(main_async(args))
    print()  # `kvrouter bench` prints the tables itself (suite.run_one)
    for text in tables(result).values():
        print(text + "\n")


if __name__ == "__main__":
    main()
