"""Peer bootstrap end to end: how soon a new replica is ready, and how much of the warm view
it holds then, against tree size; plus the snapshot's wire size per block.

Run: .venv/bin/python bench/bench_bootstrap.py [--sizes 10000,100000,1000000] [--quick]
     [--log-dir DIR] [--profile-dir DIR]

Prints figures and the budget. Exits 1, naming the size, when a new replica did not accept
the warm snapshot (`kvrouter_kv_peer_snapshot_total` with another outcome than `accepted`, or
none): its figures would be those of a cold start, not of the bootstrap. Progress goes to
stderr.

What runs, per size (a fresh fleet each time):

- Three fake workers in this process (`fake_kv_worker`, real HTTP and ZMQ on loopback), the
  second with dp 2: four ranks, each with a KV cache of the size's blocks. The new replica
  vets the snapshot against the capacity the workers report (`peer/capacity.py`): a rank
  carrying more blocks than its engine holds is made up, and the snapshot is rejected.
- A warm replica in this process (the real replica, `router.serving.start_serving`, through
  `tests.support.router.router_in_process`) registered with them. Its tree is filled through
  its own pump, `rules.apply_batch(rank, seq, batch)`, with synthetic `EventBatch`es of
  `BlockStored` events: chains of 8 blocks x 16 tokens, 16 chains per batch, engine hashes
  unique, each rank's seq dense from 0. One chain in four is also stored by the next rank, so
  (key, carrier) pairs are 1.25 x blocks. So the warm replica holds exactly what it would have
  learned from those events (cursors included), without sending 1M blocks through ZMQ, which
  is slow. Each fake worker's publisher then burns the same number of seqs
  (`/control/skip-seq`), so its `last_seq` equals the warm cursor: the stream would continue
  exactly past the watermark. The workers publish nothing during the run, so the new
  replica's grafts end with deferred splice proofs; that is the realistic idle fleet, and it
  counts as settled (ready).
- The NEW replica is a separate real process: `kvrouter serve --peer <warm> --worker ...`
  (`--log-level info`, so its phases can be read from its log timestamps). This process polls
  its `/readyz` every 10 ms and otherwise leaves its own event loop free, because that loop
  also serves the warm replica's `/internal/kv_snapshot` (export, gzip) to it.
- Times: from the process start (spawn) and from its first worker registration (its log
  line `worker ... registered`, millisecond stamps) to the first `/readyz` 200.
- Share of the warm view held at that moment: per rank, min(new, warm) / warm summed over
  the ranks, from block counts (`GET /workers` `blocks` = the rank's (key, carrier) pairs),
  with the node count (`kvrouter_tree_nodes`) and the cursors
  (`/internal/kv_snapshot?cursors_only=true`) compared alongside. Counts suffice here: the new
  replica's only source of blocks is the vetted graft of this warm replica's snapshot (no
  events flow), so what it holds is a subset of the warm view and equal counts mean equal
  views. (Checked exactly by the component tests; `canonical_view` at 1M would itself cost
  seconds on each side.)
- Phases: the warm side stamps the snapshot request's arrival, the export (walk, carrier
  table) and the body (its encoding, made on first demand) by wrapping its producer; the
  new replica's log stamps its registrations, the fetch (read and decode times, in its
  fetch client's log line), the end of its sweep (vetting done) and its readiness. For
  scale, the fetched columnar body is then decoded, vetted and grafted into an empty tree
  in this process (idle loop, same chunk sizes as the replica).
- Wire size: `/internal/kv_snapshot` fetched from the warm replica as columns,
  gzip(columns), JSON, gzip(JSON), msgpack and gzip(msgpack) (Accept / Accept-Encoding),
  body bytes as sent / nodes; and what gzip of the columnar body costs against what it
  saves on loopback.

`--profile-dir DIR` runs the new replica under `bench/profiled_router.py` (cProfile, wall
clock), profiling from its "listening" line to its first `/readyz` 200, and prints its top
functions; its times are then inflated by the profiler.

Budget on this machine: 1M blocks grafted and ready within 5 s of the first worker
registration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import platform
import pstats
import re
import shlex
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from cachetree.ranks import RankId
from cachetree.snapshot import SnapshotRestore
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from peer.sweep import FETCHED_ACCEPTED
from peer.vet import Vetting
from peer.wire import COLUMNS, JSON, MSGPACK, decode_columns
from router.bootstrap import GRAFT_CHUNK, VET_CHUNK
from router.events import BlockStored, EventBatch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BLOCK = 16
CHAIN = 8  # blocks per chain (one BlockStored event)
CHAINS_PER_BATCH = 16
BATCHES_PER_CALL = 64  # batches applied per pump call while filling
DP_SIZES = (1, 2, 1)  # three fake workers, four ranks
DEFAULT_SIZES = "10000,100000,1000000"
QUICK_SIZES = "10000,100000"
BUDGET_BLOCKS = 1_000_000
BUDGET_S = 5.0
READY_BOUND_S = 180.0
POLL_S = 0.01
SNAPSHOT = "/internal/kv_snapshot"
ANY_AGE = "?max_age_ms=3600000"  # reuse the export the new replica caused
PEER_SNAPSHOT = re.compile(r'^kvrouter_kv_peer_snapshot_total\{outcome="([^"]+)"\} (\S+)$', re.M)
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+): (.*)$")
WIRE_VARIANTS = (  # (label, Accept, Accept-Encoding)
    ("columns", COLUMNS, None),
    ("gzip(columns)", COLUMNS, "gzip"),
    ("json", JSON, None),
    ("gzip(json)", JSON, "gzip"),
    ("msgpack", MSGPACK, None),
    ("gzip(msgpack)", MSGPACK, "gzip"),
)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the warm replica's tree ---------------------------------------------------------------


def synthetic_batches(n_blocks: int, ranks: list[RankId]) -> Iterator[tuple[RankId, int, Any]]:
    """(rank, seq, EventBatch) in stream order: chains of CHAIN blocks, CHAINS_PER_BATCH per
    batch, each rank's seq dense from 0. Chain c goes to rank c % R; one in four also to the
    next rank (same tokens, so the same keys; its own engine hashes)."""
    n_ranks = len(ranks)
    filler = [3 + (i * 7919) % 50_000 for i in range(BLOCK * CHAIN)]
    pending: list[list[BlockStored]] = [[] for _ in ranks]
    next_seq = [0] * n_ranks
    engine_hash = 1
    for c in range(n_blocks // CHAIN):
        tokens = [3 + (c & 0xFFFF), 3 + (c >> 16), *filler[2:]]
        holders = [c % n_ranks] + ([(c + 1) % n_ranks] if c % 4 == 0 else [])
        for r in holders:
            hashes = list(range(engine_hash, engine_hash + CHAIN))
            engine_hash += CHAIN
            pending[r].append(BlockStored(hashes, None, tokens, BLOCK, DEVICE, "GPU", None))
            if len(pending[r]) == CHAINS_PER_BATCH:
                yield ranks[r], next_seq[r], EventBatch(time.time(), pending[r], ranks[r].dp_rank)
                next_seq[r] += 1
                pending[r] = []
    for r, events in enumerate(pending):
        if events:
            yield ranks[r], next_seq[r], EventBatch(time.time(), events, ranks[r].dp_rank)
            next_seq[r] += 1


async def fill(replica: Any, ranks: list[RankId], n_blocks: int) -> float:
    """Apply the synthetic stream through the warm replica's pump; returns seconds taken."""
    started = time.perf_counter()
    items: list[tuple[RankId, int, Any]] = []

    def apply(rules: Any, chunk: list[tuple[RankId, int, Any]]) -> int:
        for rank, seq, batch in chunk:
            rules.apply_batch(rank, seq, batch)
        return len(rules.tree)

    last_report = started
    for item in synthetic_batches(n_blocks, ranks):
        items.append(item)
        if len(items) == BATCHES_PER_CALL:
            nodes = await replica.pump.call(lambda rules, chunk=items: apply(rules, chunk))
            items = []
            if time.perf_counter() - last_report > 2:
                last_report = time.perf_counter()
                progress(f"  filling: {nodes:,} / {n_blocks:,} blocks")
    if items:
        await replica.pump.call(lambda rules, chunk=items: apply(rules, chunk))
    return time.perf_counter() - started


# -- the new replica (a child process) -----------------------------------------------------


@dataclass
class Child:
    proc: asyncio.subprocess.Process
    log_path: Path
    spawned: float  # time.time()
    listening: float | None = None
    url: str | None = None
    reader: asyncio.Task[None] | None = None
    listening_seen: asyncio.Event = field(default_factory=asyncio.Event)

    async def read_stdout(self) -> None:
        stdout = self.proc.stdout
        while stdout is not None and (line := await stdout.readline()):
            text = line.decode(errors="replace").strip()
            if text.startswith("kvrouter listening on ") and self.listening is None:
                self.listening = time.time()
                self.url = text.split()[-1]
                self.listening_seen.set()

    async def stop(self, within_s: float = 15.0) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), within_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


@contextlib.asynccontextmanager
async def new_replica(argv: list[str], log_path: Path) -> AsyncIterator[Child]:
    with log_path.open("wb") as log_file:
        spawned = time.time()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=log_file, cwd=ROOT
        )
        child = Child(proc, log_path, spawned)
        child.reader = asyncio.create_task(child.read_stdout())
        try:
            yield child
        finally:
            await child.stop()


def replica_argv(
    port: int, warm_url: str, workers: list[str], profile: Path | None, token: str
) -> list[str]:
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK)]
    args += ["--peer", warm_url]
    for url in workers:
        args += ["--worker", url]
    args += ["--kv-bootstrap-timeout-ms", "120000", "--log-level", "info"]
    # The warm replica's token (router_in_process gives it tests.support.router's), and
    # a body bound above the 1M-block columnar body (~37 MB): the default is sized for the
    # manifest's 512 Mi memory limit (README, "Memory"), not for this bench's largest size.
    args += ["--internal-token", token, "--kv-bootstrap-max-body-mb", "256"]
    if profile is not None:
        profiled = [sys.executable, str(ROOT / "bench" / "profiled_router.py")]
        return [*profiled, str(profile), "wall", *args]
    return [str(BIN / "kvrouter"), *args]


async def wait_ready(session: aiohttp.ClientSession, child: Child, port: int) -> float | None:
    """Poll /readyz every POLL_S until 200; the time.time() of that answer, or None."""
    url = f"http://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + READY_BOUND_S
    timeout = aiohttp.ClientTimeout(total=2)
    while time.monotonic() < deadline:
        if child.proc.returncode is not None:
            return None
        try:
            async with session.get(url, timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return time.time()
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(POLL_S)
    return None


FETCH_LINE = re.compile(
    r"kv snapshot from \S+: (\d+) nodes, (\d+) B as sent \((.*)\) in ([\d.]+) s, "
    r"decoded in ([\d.]+) s"
)


@dataclass
class ChildLog:
    fetched: float | None = None  # log stamp of the first full snapshot fetched and decoded
    fetch: tuple[str, float, float] | None = None  # (encoding, seconds to read, to decode)
    registered: list[float] = field(default_factory=list)
    sweeps: list[tuple[float, str]] = field(default_factory=list)
    settled: float | None = None
    settled_after_s: float | None = None
    warnings: list[str] = field(default_factory=list)


def read_child_log(path: Path) -> ChildLog:
    out = ChildLog()
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if m is None:
            continue
        stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        level, message = m.group(2), m.group(4)
        if re.match(r"worker \S+ registered:", message):
            out.registered.append(stamp)
        elif (f := FETCH_LINE.match(message)) and int(f.group(1)) and out.fetched is None:
            out.fetched = stamp
            out.fetch = (f.group(3), float(f.group(4)), float(f.group(5)))
        elif s := re.match(r"bootstrap sweep for (\d+) rank\(s\): (.*)", message):
            out.sweeps.append((stamp, f"{s.group(1)} rank(s): {s.group(2)}"))
        elif s := re.match(r"bootstrap settled after ([\d.]+) s", message):
            out.settled = stamp
            out.settled_after_s = float(s.group(1))
        if level in ("WARNING", "ERROR", "CRITICAL"):
            out.warnings.append(message)
    return out


def metric_lines(text: str, prefixes: tuple[str, ...]) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefixes) and not ln.startswith("#")]


def metric_value(text: str, name: str) -> float | None:
    for ln in text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[-1])
    return None


# -- one size --------------------------------------------------------------------------------


@dataclass
class Result:
    blocks: int
    pairs: int = 0
    fill_s: float = 0.0
    start_to_listen: float | None = None
    start_to_ready: float | None = None
    reg_to_ready: float | None = None
    share: float | None = None
    lines: list[str] = field(default_factory=list)  # details, printed after the table
    wire: dict[str, int] = field(default_factory=dict)  # variant -> body bytes
    snapshot_outcomes: dict[str, int] = field(default_factory=dict)  # the new replica's

    def not_bootstrapped(self) -> str | None:
        """Why the new replica's figures are not a bootstrap's, or None: it fetched the warm
        snapshot and accepted it, and nothing else."""
        if self.snapshot_outcomes.keys() == {FETCHED_ACCEPTED}:
            return None
        seen = ", ".join(f"{k} {v}" for k, v in sorted(self.snapshot_outcomes.items()))
        return (
            f"{self.blocks:,} blocks: the new replica's peer snapshot outcomes were "
            f"{seen or 'none read'}, not accepted (its warnings are in the details)"
        )


class WarmStamps:
    """Wraps the warm producer's `export` and `body` to stamp the first snapshot request."""

    def __init__(self, producer: Any) -> None:
        self.asked: float | None = None
        self.exported: float | None = None
        self.body: float | None = None
        self.requests = 0
        export, body = producer.export, producer.body

        async def timed_export(max_age_ms: int | None = None) -> Any:
            self.requests += 1
            if self.asked is None:
                self.asked = time.time()
            entry = await export(max_age_ms)
            if self.exported is None:
                self.exported = time.time()
            return entry

        async def timed_body(entry: Any, content_type: str, gzip: bool) -> bytes:
            out = await body(entry, content_type, gzip)
            if self.body is None:
                self.body = time.time()
            return out

        producer.export = timed_export
        producer.body = timed_body


async def run_size(n_blocks: int, args: argparse.Namespace, workdir: Path) -> Result:
    from tests.support.fake_worker import fake_worker_in_process
    from tests.support.ports import free_tcp_port
    from tests.support.router import router_in_process

    res = Result(n_blocks)
    async with contextlib.AsyncExitStack() as stack:
        progress(f"{n_blocks:,} blocks: starting 3 fake workers and the warm replica")
        # A rank carries each block at most once: engines of n_blocks hold any share of the
        # fill, which the new replica's capacity vetting then takes as real.
        workers = [
            await stack.enter_async_context(
                fake_worker_in_process(dp_size=dp, cache_blocks=n_blocks)
            )
            for dp in DP_SIZES
        ]
        warm = await stack.enter_async_context(
            router_in_process(
                workers=[w.url for w in workers], health_interval_s=2.0, load_interval_ms=500
            )
        )
        replica = warm.replica
        rules = replica.pump.rules
        ranks = [rank for w in replica.workers.workers() for rank in w.ranks()]
        if sorted(rules.live) != sorted(ranks) or len(ranks) != sum(DP_SIZES):
            res.lines.append(f"warm replica has live ranks {sorted(rules.live)}; expected 4")
            return res
        progress(f"{n_blocks:,} blocks: filling the warm tree through its pump")
        res.fill_s = await fill(replica, ranks, n_blocks)
        tree = rules.tree
        warm_counts = {rank: tree.block_count(rank) for rank in ranks}
        warm_cursors = {rank: rules.cursors.get(rank) for rank in ranks}
        res.pairs = sum(warm_counts.values())
        for w in workers:
            for dp in range(w.config.dp_size):
                cursor = warm_cursors[RankId(w.url, dp)]
                if cursor is None:
                    continue  # a rank the synthetic stream never reached (a tiny size)
                await w.post("/control/skip-seq", {"dp_rank": dp, "count": cursor + 1})
                state = await w.state(dp)
                if state["last_seq"] != cursor:
                    res.lines.append(f"worker {w.url} dp {dp}: last_seq {state['last_seq']}")
        gc.collect()
        progress(
            f"{n_blocks:,} blocks: warm tree {len(tree):,} nodes, {res.pairs:,} pairs, "
            f"filled in {res.fill_s:.1f} s; starting the new replica"
        )
        stamps = WarmStamps(replica.producer)
        port = free_tcp_port()
        profile = None
        if args.profile_dir is not None:
            profile = Path(args.profile_dir) / f"new-replica-{n_blocks}.prof"
            for stale in (profile, Path(f"{profile}.done"), Path(f"{profile}.gc.json")):
                stale.unlink(missing_ok=True)
        assert warm.token is not None
        argv = replica_argv(port, warm.url, [w.url for w in workers], profile, warm.token)
        res.lines.append(f"new replica: {shlex.join(argv)}")
        log_path = workdir / f"new-replica-{n_blocks}.log"
        session = await stack.enter_async_context(
            aiohttp.ClientSession(
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
                headers={"Authorization": f"Bearer {warm.token}"},  # /workers, /internal/*
            )
        )
        async with new_replica(argv, log_path) as child:
            starter = asyncio.create_task(start_profile(child)) if profile else None
            ready_at = await wait_ready(session, child, port)
            if starter is not None and profile is not None:
                starter.cancel()
                await stop_profile(child, profile)
            if ready_at is None:
                res.lines.append(
                    f"NOT READY within {READY_BOUND_S:.0f} s (exit code {child.proc.returncode})"
                )
            else:
                progress(f"{n_blocks:,} blocks: new replica ready; reading its view")
                await compare_views(session, port, res, warm_counts, warm_cursors, len(tree))
            await child.stop()
        report_phases(res, child, read_child_log(log_path), ready_at, stamps, replica)
        res.lines.append(f"new replica's log: {log_path}")
        if profile is not None and profile.exists():
            res.lines += top_functions(profile)
        progress(f"{n_blocks:,} blocks: measuring wire sizes")
        columns = await wire_sizes(session, warm.url, res)
        if columns is not None:
            progress(f"{n_blocks:,} blocks: replaying the consumer's work in this process")
            await consumer_costs(columns, set(ranks), res)
    return res


async def compare_views(
    session: aiohttp.ClientSession,
    port: int,
    res: Result,
    warm_counts: dict[RankId, int],
    warm_cursors: dict[RankId, int | None],
    warm_nodes: int,
) -> None:
    base = f"http://127.0.0.1:{port}"
    async with session.get(base + "/workers") as resp:
        body = await resp.json(content_type=None)
    async with session.get(base + SNAPSHOT + "?cursors_only=true") as resp:
        table = await resp.json(content_type=None)
    async with session.get(base + "/metrics") as resp:
        metrics = (await resp.read()).decode()
    new_counts = {
        RankId(w["url"], r["dp_rank"]): r["blocks"] for w in body["workers"] for r in w["ranks"]
    }
    new_cursors = {
        RankId(table["workers"][i]["url"], table["workers"][i]["dp_rank"]): seq
        for i, seq in table["cursors"]
    }
    held = sum(min(new_counts.get(rank, 0), n) for rank, n in warm_counts.items())
    res.share = held / max(1, sum(warm_counts.values()))
    res.snapshot_outcomes = {k: int(float(v)) for k, v in PEER_SNAPSHOT.findall(metrics)}
    nodes = metric_value(metrics, "kvrouter_tree_nodes")
    res.lines.append(
        f"view: nodes new {int(nodes or 0):,} / warm {warm_nodes:,}; (key, carrier) pairs per "
        "rank new/warm, cursor new/warm: "
        + "; ".join(
            f"{rank.worker_url.rsplit(':', 1)[1]}#{rank.dp_rank} {new_counts.get(rank, 0):,}/"
            f"{n:,} @{new_cursors.get(rank)}/{warm_cursors[rank]}"
            for rank, n in warm_counts.items()
        )
    )
    bootstrap = metric_lines(
        metrics,
        (
            "kvrouter_kv_bootstrap_grafts",
            "kvrouter_kv_peer_snapshot",
            "kvrouter_kv_bootstrap_rank",
            "kvrouter_kv_bootstrap_sweep",
        ),
    )
    res.lines.append("new replica's bootstrap series: " + ", ".join(bootstrap))


def report_phases(
    res: Result,
    child: Child,
    log: ChildLog,
    ready_at: float | None,
    stamps: WarmStamps,
    replica: Any,
) -> None:
    t0 = child.spawned

    def at(t: float | None) -> str:
        return "-" if t is None else f"+{t - t0:.2f} s"

    if child.listening is not None:
        res.start_to_listen = child.listening - t0
    if ready_at is not None:
        res.start_to_ready = ready_at - t0
        if log.registered:
            res.reg_to_ready = ready_at - log.registered[0]
    export = replica.producer.cached if replica.producer is not None else None
    timings = export.timings if export is not None else {}
    encodes = ", ".join(
        f"{name.split()[1]} {seconds:.2f} s"
        for name, seconds in timings.items()
        if name.startswith("encode ")
    )
    res.lines.append(
        "phases (from spawn; the new replica's log has ms stamps): "
        f"first worker registered {at(log.registered[0] if log.registered else None)}, "
        f"last {at(log.registered[-1] if log.registered else None)}; "
        f"listening {at(child.listening)}; "
        f"warm asked for a snapshot {at(stamps.asked)} ({stamps.requests} request(s)), "
        f"export built {at(stamps.exported)} (walk {timings.get('walk', 0):.2f} s, carrier "
        f"table {timings.get('table', 0):.2f} s), body ready {at(stamps.body)} (encoded: "
        f"{encodes or '-'}); fetched and decoded {at(log.fetched)}; "
        + "".join(f"sweep {text} {at(t)}; " for t, text in log.sweeps)
        + f"/readyz 200 {at(ready_at)}"
    )
    if log.settled_after_s is not None:
        res.lines[-1] += f" (its own bootstrap clock: {log.settled_after_s:.2f} s)"
    found = next((t for t, text in log.sweeps if ": found" in text), None)
    marks = [log.registered[0] if log.registered else None]
    marks += [stamps.asked, stamps.exported, stamps.body, log.fetched, found, ready_at]
    if all(m is not None for m in marks) and log.fetch is not None:
        names = (
            "registration -> snapshot asked",
            "warm export (walk)",
            "encode",
            f"send + read ({log.fetch[0]}) + decode",
            "vet",
            "graft + readiness",
        )
        spans = zip(names, marks[:-1], marks[1:], strict=True)
        steps = [f"{name} {b - a:.2f} s" for name, a, b in spans]
        steps[3] += f" (of which decode {log.fetch[2]:.2f} s)"
        res.lines.append("durations: " + ", ".join(steps))
    if log.warnings:
        shown = "; ".join(log.warnings[:3])
        res.lines.append(f"new replica warnings ({len(log.warnings)}): {shown}")


async def start_profile(child: Child) -> None:
    """SIGUSR1 to `profiled_router.py` once the replica listens (its handler is set by then)."""
    await child.listening_seen.wait()
    if child.proc.returncode is None:
        child.proc.send_signal(signal.SIGUSR1)


async def stop_profile(child: Child, profile: Path, within_s: float = 30.0) -> None:
    """SIGUSR2, then wait for `profiled_router.py` to write the stats (`.done` appears)."""
    if child.proc.returncode is not None or not child.listening_seen.is_set():
        return
    child.proc.send_signal(signal.SIGUSR2)
    done = Path(f"{profile}.done")
    deadline = time.monotonic() + within_s
    # A file, not an event: the child process writes it.
    while not await asyncio.to_thread(done.exists) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)


def top_functions(profile: Path, n: int = 15) -> list[str]:
    stats = pstats.Stats(str(profile))
    table = stats.stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    out = [
        f"cProfile of the new replica, listening -> ready, wall clock ({profile}), "
        f"top {n} by own time:"
    ]
    for (file, line, name), (_, calls, tottime, cumtime, _) in rows:
        where = f"{Path(file).name}:{line}" if line else file
        out.append(f"  {tottime:7.3f} s own {cumtime:7.3f} s cum {calls:>9,} calls  {where} {name}")
    return out


async def wire_sizes(session: aiohttp.ClientSession, warm_url: str, res: Result) -> bytes | None:
    """Fetch the warm export in each encoding; returns the columnar body (identity). Also
    weighs gzip for the columnar body on loopback: what it costs the producer (its first
    gzip request, against the cached identity one) and the consumer (inflating) against the
    bytes it saves."""
    kept = None
    times: dict[str, float] = {}
    for label, accept, coding in WIRE_VARIANTS:
        headers = {"Accept": accept}
        if coding:
            headers["Accept-Encoding"] = coding
        started = time.perf_counter()
        async with session.get(warm_url + SNAPSHOT + ANY_AGE, headers=headers) as resp:
            body = await resp.read()
            if resp.status != 200 or resp.headers.get("Content-Encoding") != coding:
                res.lines.append(
                    f"wire {label}: HTTP {resp.status}, Content-Encoding "
                    f"{resp.headers.get('Content-Encoding')!r}"
                )
                continue
        times[label] = time.perf_counter() - started
        res.wire[label] = len(body)
        if label == "columns":
            kept = body
        elif label == "gzip(columns)":
            started = time.perf_counter()
            zlib.decompress(body, 31)
            times["inflate"] = time.perf_counter() - started
    if {"columns", "gzip(columns)", "inflate"} <= times.keys():
        saved = res.wire["columns"] - res.wire["gzip(columns)"]
        res.lines.append(
            "gzip of the columnar body on loopback: first gzip request "
            f"{times['gzip(columns)']:.2f} s against {times['columns']:.2f} s for the cached "
            "identity body (compressing on the producer), inflating "
            f"{times['inflate']:.2f} s on the consumer, to save "
            f"{saved / 1e6:.1f} MB ({saved * 8 / 10e9:.3f} s at 10 Gbit/s)"
        )
    return kept


async def consumer_costs(body: bytes, live: set[RankId], res: Result) -> None:
    """What the new replica does with the body, replayed here with nothing else running.

    The decoded body is dropped before the graft, as in the replica."""
    gc.collect()
    t0 = time.perf_counter()
    snap = decode_columns(body)
    t1 = time.perf_counter()
    vetting = Vetting(snap, live, BLOCK)
    while not vetting.step(VET_CHUNK):
        pass
    vetted = vetting.result()
    del vetting, snap
    t2 = time.perf_counter()
    tree = BlockTree(BLOCK)
    job = SnapshotRestore(tree, vetted.snapshot, prevalidated=True)
    while not job.step(GRAFT_CHUNK):
        pass
    t3 = time.perf_counter()
    res.lines.append(
        f"consumer work replayed in this process on the columnar body (idle loop): "
        f"decode {t1 - t0:.2f} s, vet {t2 - t1:.2f} s, graft {t3 - t2:.2f} s "
        f"({len(tree):,} nodes); total {t3 - t0:.2f} s"
    )
    del vetted, tree, job
    gc.collect()


# -- output ----------------------------------------------------------------------------------


def fmt_s(value: float | None) -> str:
    return "   -   " if value is None else f"{value:6.2f} s"


def print_results(results: list[Result]) -> bool:
    """Prints the tables and details; False when a size did not measure a bootstrap."""
    print()
    print(
        f"{'blocks':>9} {'pairs':>9} {'fill':>7} {'start->listen':>14} {'start->ready':>13} "
        f"{'1st reg->ready':>15} {'share':>7}"
    )
    for r in results:
        share = "   -  " if r.share is None else f"{r.share * 100:5.1f}%"
        print(
            f"{r.blocks:>9,} {r.pairs:>9,} {r.fill_s:6.1f}s {fmt_s(r.start_to_listen):>14} "
            f"{fmt_s(r.start_to_ready):>13} {fmt_s(r.reg_to_ready):>15} {share:>7}"
        )
    print()
    print("wire size of /internal/kv_snapshot, bytes per block (body as sent / nodes):")
    print(f"{'blocks':>9} " + " ".join(f"{label:>15}" for label, _, _ in WIRE_VARIANTS))
    for r in results:
        cells = []
        for label, _, _ in WIRE_VARIANTS:
            n = r.wire.get(label)
            cells.append(f"{'-':>15}" if n is None else f"{n / r.blocks:6.1f} ({n / 1e6:5.1f}MB)")
        print(f"{r.blocks:>9,} " + " ".join(f"{c:>15}" for c in cells))
    for r in results:
        print()
        print(f"{r.blocks:,} blocks:")
        for line in r.lines:
            print(f"  {line}")
    print()
    big = next((r for r in results if r.blocks == BUDGET_BLOCKS), None)
    budget = f"budget: {BUDGET_BLOCKS:,} blocks grafted and ready within {BUDGET_S:g} s of the "
    budget += "first worker registration"
    if big is None or big.reg_to_ready is None:
        print(f"{budget}: not measured in this run")
    else:
        verdict = "within" if big.reg_to_ready <= BUDGET_S else "OVER"
        full = "" if big.share == 1 else f", holding only {100 * (big.share or 0):.1f}%"
        print(f"{budget}: {big.reg_to_ready:.2f} s, {verdict} budget{full}")
    failures = [why for r in results if (why := r.not_bootstrapped()) is not None]
    for why in failures:
        print(f"FAILED: {why}")
    return not failures


async def amain(args: argparse.Namespace) -> bool:
    # SIGTERM (and SIGINT, even where the shell started us with it ignored) cancels the run,
    # so the new replica, the fake workers and the warm replica are all stopped on the way out.
    main_task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        if main_task is not None:
            loop.add_signal_handler(sig, main_task.cancel)
    sizes = [int(s) for s in (QUICK_SIZES if args.quick else args.sizes).split(",") if s]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-bootstrap-") as tmp:
        workdir = Path(args.log_dir) if args.log_dir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for size in sizes:
                results.append(await run_size(size, args, workdir))
                gc.collect()
        except asyncio.CancelledError:
            progress("interrupted: every child process was stopped; partial results follow")
        bootstrapped = print_results(results)
        if not args.log_dir:
            print("(the new replicas' logs were temporary; keep them with --log-dir DIR)")
    return bootstrapped


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="tree sizes in blocks, commas")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK_SIZES}")
    parser.add_argument("--profile-dir", help="run the new replica under cProfile, stats here")
    parser.add_argument("--log-dir", help="keep the new replicas' logs here")
    args = parser.parse_args()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests.support, when run as a script
    print("command:", shlex.join(sys.orig_argv))
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"Python {platform.python_version()} (a shared machine: figures are noisy)"
    )
    print(
        "method: warm replica in this process with 3 real fake workers (dp 1, 2, 1 = 4 ranks), "
        "its tree filled through its pump (rules.apply_batch) with synthetic BlockStored "
        f"batches (chains of {CHAIN} blocks x {BLOCK} tokens, 1 in 4 chains on two ranks), "
        "fake workers' seq advanced to the warm cursors; the new replica a real "
        "`kvrouter serve --peer` process; no events flow during the bootstrap"
    )
    sys.stdout.flush()
    if not asyncio.run(amain(args)):
        sys.exit(1)


if __name__ == "__main__":
    main()
