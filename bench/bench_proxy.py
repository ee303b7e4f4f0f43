"""Router hop latency and router CPU per request, with real processes on loopback.

Run: .venv/bin/python bench/bench_proxy.py [--requests 2000] [--latency-requests 1000]
     [--workers 2] [--concurrency 32] [--cache-blocks 200000] [--quick] [--profile] [--smg]
     [--event-loop auto|asyncio|uvloop]
     bench/bench_proxy.py --chat [...]: multi-turn chat on a real tokenizer, tokenization cache
     on and off, against smg (bench/chat_proxy.py has its flags and method).
Prints figures; asserts nothing. Takes ~1.5 minutes (~2 with --profile); --quick ~40 s.

What runs, for each policy in turn (cache_aware, round_robin; with `--smg` also smg's
cache_aware, a Rust router from PyPI, measured the same way): `--workers` fresh fake workers
(`fake-kv-worker`: no simulated prefill or decode time, `--cache-blocks` per rank, LRU) and
one `kvrouter serve` in front of them (block size 16, `bytes` tokenizer, default poll
intervals), so both policies start from the same state. Every request is a non-streaming
`/v1/completions` with `max_tokens: 1` and a 2,000-byte ASCII prompt, which is 2,000 tokens
for the `bytes` tokenizer (125 blocks): one of 8 shared 1,000-token "system prompts", then
1,000 tokens unique to the request. So a request finds ~62 blocks cached and makes its worker
publish the ~63 new ones, which the router ingests as KV events: ingest is part of the
router's cost per request, as it is in production. Once a worker's cache is full, each request
also evicts ~63 blocks, one BlockRemoved event each (as vLLM sends them): production's steady
state. Both regimes are measured and labelled, with the KV events per request the router saw.

Phases per policy:
1. warm-up (c=1, then c=`--concurrency`), then `--requests` requests at c=`--concurrency`
   with caches NOT full (no evictions; the KV events column shows it); then as many 16-token
   SSE streams (`stream: true`), caches still not full (the default `--cache-blocks` holds
   both phases);
2. fill every worker's cache to capacity through `/control/store` (chains of random tokens,
   ingested by the router like any events), wait until the router has applied them;
3. hop latency at concurrency 1: the same kind of request sent directly to a worker (the
   baseline; alternating workers) and through the router, interleaved in rounds so that
   drift hits both alike. Added latency pXX = the pXX of the differences router - direct of
   the requests paired by their place in a round (`added_percentile`). The router's CPU per
   routed request is shown too (the events caused by the direct legs are ingested during the
   direct legs, so they are not in it);
4. the router's idle CPU (background polling, no traffic): shown, NOT subtracted;
5. `--requests` requests at c=`--concurrency` with full caches (evicting).

Router CPU = user+sys CPU of the router process (all threads) over each round of a phase
(a round's window closes once the router applied the KV events of all its requests), divided
by the round's requests; the figure is the median round, [min-max] beside it. CPU is
read to the ns from /proc/<pid>/task/*/schedstat (the run time utime+stime are derived from;
/proc/<pid>/stat counts 10 ms ticks), and each phase is cross-checked against
/proc/<pid>/stat. The machine's other processes (e.g. other people's test runs) are shown as
a CPU share: figures from a busy machine are not comparable with a quiet one.

With --profile: one more cache_aware router, run under cProfile by bench/profiled_router.py,
on fresh workers filled to capacity, profiled only during `--profile-requests` requests at
c=`--concurrency`; prints the top functions by own and by cumulative time per request, own
time grouped by module, and the garbage collector's work in that window.

Last, the router's own per-request steps (decode, tokenize, keys, prefix_depths, decide,
metrics, event ingest in both regimes) are timed in isolation in this process, without a
profiler, to anchor the profile: the rest of the measured CPU is HTTP and the event loop.

The load generator is aiohttp in this process: it shares the machine's cores with the router
and the workers (nothing is pinned), so the c=32 throughput is the whole system's; the CPU
share of each party is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import importlib.metadata
import json
import math
import os
import platform
import pstats
import queue
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.bench_policy import cache_aware_over
from cachetree.keys import block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from fake_kv_worker.wire import Event, Removed, Stored, encode_vllm
from router.events import decode_batch
from router.index import apply_events
from router.loads import EngineLoad
from router.metrics import RouterMetrics
from router.policy import Candidate, Prompt
from router.pressure import PressureLedger, PressureSettings
from router.tokenize import load_tokenizer

BLOCK_SIZE = 16
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 1000
UNIQUE_TOKENS = 1000
PROMPT_TOKENS = SYSTEM_TOKENS + UNIQUE_TOKENS
CACHED_BLOCKS = SYSTEM_TOKENS // BLOCK_SIZE  # full blocks of a system prompt: 62
NEW_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE - CACHED_BLOCKS  # what a request stores: 63
MODEL = "fake-model"
POLICIES = ("cache_aware", "round_robin")
SMG_POLICY = "cache_aware"
RELAY = "bare"  # bench/relay_floor.py: kvrouter's data plane, no routing work
RELAY_POLICY = "relay (floor)"  # round-robin, the only thing it decides
SSE = "not full, SSE"  # 16-token streams, caches not full
SSE_TOKENS = 16
REGIMES = ("not full", SSE, "full")
BUDGET_US = 400
CLK_TCK = os.sysconf("SC_CLK_TCK")
BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent


def log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


# -- processes and CPU clocks ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stat_cpu_seconds(pid: int) -> float:
    """User + system CPU of a whole process (every thread, live or exited), in seconds.

    /proc/<pid>/stat counts in clock ticks (10 ms): too coarse for a round of 100 requests.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process, to the nanosecond: the sum of its threads' scheduler run time
    (/proc/<pid>/task/*/schedstat, the clock utime + stime are derived from). Threads that
    already exited are missing from it, so whole phases are cross-checked against
    `stat_cpu_seconds`. Falls back to /proc/<pid>/stat where schedstat is absent."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            path = f"/proc/{pid}/task/{task}/schedstat"
            with contextlib.suppress(FileNotFoundError), open(path) as f:  # a thread just ended?
                total += int(f.read().split()[0])
    except FileNotFoundError:
        return stat_cpu_seconds(pid)
    return total / 1e9 if total else stat_cpu_seconds(pid)


def machine_busy_seconds() -> float:
    """CPU seconds every core spent busy, all processes (the first line of /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK  # user nice system irq softirq steal


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[str]
    url: str = ""


class Children:
    """The child processes this benchmark started; `stop_all` ends every one still running."""

    def __init__(self) -> None:
        self.items: list[Child] = []

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[Child, queue.Queue[str | None]]:
        """Start a child whose stdout is read into a queue (so a chatty one never blocks);
        `env` is added to this process's environment."""
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **env} if env else None
        )
        child = Child(name, argv, proc)
        self.items.append(child)
        lines: queue.Queue[str | None] = queue.Queue()

        def drain() -> None:  # keeps reading stdout so a chatty child never blocks on a pipe
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=drain, daemon=True).start()
        return child, lines

    def start(
        self,
        name: str,
        argv: list[str],
        ready_prefix: str,
        timeout_s: float = 30,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start a child and wait for its ready line; the rest of that line is its URL."""
        child, lines = self.spawn(name, argv, env)
        proc = child.proc
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{name} did not report ready within {timeout_s}s") from None
            if line is None:
                raise RuntimeError(f"{name} exited before listening (status {proc.wait()})")
            if line.startswith(ready_prefix):
                child.url = line[len(ready_prefix) :].strip()
                return child

    def stop(self, child: Child, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
        if child.proc.poll() is None:
            child.proc.send_signal(sig)
            try:
                child.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log(f"{child.name} did not stop within {timeout_s}s; killing it")
                child.proc.kill()
                child.proc.wait()
        if child in self.items:
            self.items.remove(child)
        return child.proc.returncode

    def stop_all(self) -> None:
        for child in list(self.items):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in list(self.items):
            self.stop(child, signal.SIGTERM, timeout_s=10)


def worker_argv(kv_port: int, cache_blocks: int) -> list[str]:
    return [
        str(BIN / "fake-kv-worker"),
        *("--host", "127.0.0.1", "--port", "0", "--kv-port-base", str(kv_port)),
        *("--block-size", str(BLOCK_SIZE), "--cache-blocks", str(cache_blocks)),
        *("--prefill-us-per-token", "0", "--decode-ms-per-token", "0", "--log-level", "WARNING"),
    ]


# The routers' bearer token for /workers (read by the benches to see how far ingest got).
BENCH_TOKEN = "bench-internal-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {BENCH_TOKEN}"}


def router_args(
    port: int, workers: Sequence[str], policy: str, event_loop: str = "auto"
) -> list[str]:
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--internal-token", BENCH_TOKEN]
    for url in workers:
        args += ["--worker", url]
    args += ["--policy", policy, "--block-size", str(BLOCK_SIZE), "--log-level", "warning"]
    return [*args, "--event-loop", event_loop]


def commit_or_exit(rev: str) -> str:
    """The commit git resolves `rev` to in this repository. A revision git does not know ends
    the benchmark with git's message and exit status 2 (a command-line error), not with a
    traceback of the command that failed on it."""
    argv = ["git", "-C", str(HERE.parent), "rev-parse", "--verify", "--end-of-options"]
    done = subprocess.run([*argv, f"{rev}^{{commit}}"], capture_output=True, text=True)
    if done.returncode:
        said = done.stderr.strip() or f"exit status {done.returncode}"
        where = f"{rev!r} is not a commit of {HERE.parent} (git: {said})"
        sys.stderr.write(f"{Path(sys.argv[0]).name}: error: {where}\n")
        raise SystemExit(2)
    return done.stdout.strip()


def checkout(rev: str, into: Path) -> Path:
    """The repository at `rev`, extracted (not a worktree: nothing to clean up in git), with
    its C extensions (`cachetree/_*.c`: the accelerator, the index's tables) compiled in
    place, so the old code runs compiled as a deployment would, not on its pure path. Called
    before a benchmark's other work, so that a bad `rev` ends it at once (`commit_or_exit`)."""
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", commit_or_exit(rev)],
        capture_output=True,
        check=True,
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    flags = [sysconfig.get_config_var(k) for k in ("CFLAGS", "CCSHARED")]
    include = f"-I{sysconfig.get_config_var('INCLUDEPY')}"
    command = " ".join([sysconfig.get_config_var("LDSHARED"), *flags, include]).split()
    for source in sorted((into / "cachetree").glob("_*.c")):
        built = source.with_name(source.stem + sysconfig.get_config_var("EXT_SUFFIX"))
        subprocess.run([*command, str(source), "-o", str(built)], check=True)
        print(f"built {built.relative_to(into)} for {rev}", file=sys.stderr, flush=True)
    return into


@dataclass(frozen=True)
class Target:
    """A router under test: kvrouter or smg (`smg_binary`) with a routing policy, or the bare
    relay (router `RELAY`, round-robin: kvrouter's data plane without routing) that shows the
    floor under kvrouter's cost. kvrouter runs this tree's code, or the code extracted at
    `code` (labelled `tag`, e.g. the baseline revision)."""

    router: str
    policy: str
    smg_binary: Path | None = None
    code: Path | None = None
    tag: str = ""

    @property
    def label(self) -> str:
        return f"{self.router}{f' {self.tag}' if self.tag else ''} {self.policy}"

    def kvrouter_command(self) -> tuple[list[str], dict[str, str] | None]:
        """The argv prefix and extra environment that run `kvrouter` from this target's code:
        PYTHONPATH comes before the editable install, so the child imports `code`'s modules."""
        if self.code is None:
            return [str(BIN / "kvrouter")], None
        run = "import sys; from router.cli import main; sys.argv[0] = 'kvrouter'; main()"
        return [sys.executable, "-c", run], {"PYTHONPATH": str(self.code)}

    @property
    def ingests(self) -> bool:
        """kvrouter applies the workers' KV events (and shows how far in `/workers`); smg's
        HTTP mode sees none, so there is nothing to wait for."""
        return self.router == "kvrouter"


async def start_router(
    session: aiohttp.ClientSession,
    children: Children,
    target: Target,
    workers: Sequence[Child],
    event_loop: str = "auto",
) -> Child:
    """The router process, ready: kvrouter by its ready line and `/readyz`, smg by its
    `/readiness` naming every worker healthy."""
    urls = [w.url for w in workers]
    port = free_port()
    if target.router == RELAY:
        from bench.relay_floor import READY_PREFIX

        argv = [sys.executable, str(HERE / "relay_floor.py"), "--port", str(port)]
        argv += ["--event-loop", event_loop]
        argv += [arg for url in urls for arg in ("--worker", url)]
        log(f"[{target.label}] starting relay: {shlex.join(argv)}")
        return children.start(target.label, argv, READY_PREFIX)
    if target.smg_binary is None:
        command, env = target.kvrouter_command()
        argv = [*command, *router_args(port, urls, target.policy, event_loop)]
        log(f"[{target.label}] starting router: {shlex.join(argv)}")
        router = children.start(target.label, argv, "kvrouter listening on ", env=env)
        await wait_ready(session, router.url)
        return router
    from bench.smg import launch_argv
    from bench.smg import wait_ready as smg_ready

    argv = launch_argv(target.smg_binary, port, free_port(), urls, target.policy)
    log(f"[{target.label}] starting router: {shlex.join(argv)}")
    router, _ = children.spawn(target.label, argv)
    router.url = f"http://127.0.0.1:{port}"
    await smg_ready(session, router.url, lambda: router.proc.poll() is None, len(urls), 60)
    return router


def start_workers(children: Children, args: argparse.Namespace, label: str) -> list[Child]:
    workers = []
    for i in range(args.workers):
        argv = worker_argv(free_port(), args.cache_blocks)
        log(f"[{label}] starting worker {i}: {shlex.join(argv)}")
        workers.append(children.start(f"worker {i}", argv, "fake-kv-worker listening on "))
    return workers


# -- requests -------------------------------------------------------------------------------


class Prompts:
    """2,000-byte ASCII prompts: one of 8 shared system prompts + 1,000 unique bytes."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._text(SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
        self.count = 0

    def _text(self, n: int) -> str:
        # base64 of random bytes: ASCII, so one byte = one token; 3 bytes -> 4 characters.
        return base64.b64encode(self.rng.randbytes(n * 3 // 4 + 3)).decode()[:n]

    def bodies(self, n: int, stream_tokens: int = 0) -> list[bytes]:
        """Non-streaming 1-token completions, or `stream_tokens`-token SSE streams."""
        out = []
        for _ in range(n):
            system = self.systems[self.count % SYSTEM_PROMPTS]
            unique = f"{self.count:09d} " + self._text(UNIQUE_TOKENS - 10)
            self.count += 1
            prompt = system + unique
            assert len(prompt.encode()) == PROMPT_TOKENS
            if stream_tokens:
                tail = f'"max_tokens": {stream_tokens}, "stream": true'
            else:
                tail = '"max_tokens": 1'
            body = f'{{"model": "{MODEL}", "prompt": "{prompt}", {tail}}}'
            out.append(body.encode())
        return out

    def filler_chains(self, n: int) -> list[list[int]]:
        """Token chains of 125 blocks, unrelated to any prompt, to fill a cache."""
        return [[b % 128 + 3 for b in self.rng.randbytes(PROMPT_TOKENS)] for _ in range(n)]


@dataclass
class LoadResult:
    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    cached_tokens: int = 0

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    def add(self, other: LoadResult) -> None:
        self.latencies_ms += other.latencies_ms
        self.errors += other.errors
        self.cached_tokens += other.cached_tokens


JSON = {"Content-Type": "application/json"}


async def one_request(
    session: aiohttp.ClientSession, url: str, body: bytes, result: LoadResult
) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON) as resp:
            await resp.read()
            ok = resp.status == 200
            cached = resp.headers.get("X-Fake-Worker-Cached-Tokens", "0")
    except aiohttp.ClientError:
        ok, cached = False, "0"
    result.latencies_ms.append((time.perf_counter() - start) * 1000)
    if ok:
        result.cached_tokens += int(cached)
    else:
        result.errors += 1


class Progress:
    """A progress line on stderr: rewritten in place on a terminal, every 25% otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.last = label, total, 0, 0.0
        self.tty = sys.stderr.isatty()

    def step(self, n: int = 1) -> None:
        before, self.done = self.done, self.done + n
        if self.tty:
            now = time.monotonic()
            if now - self.last > 0.25 or self.done == self.total:
                self.last = now
                end = "\n" if self.done == self.total else ""
                sys.stderr.write(f"\r  {self.label}: {self.done}/{self.total}   {end}")
                sys.stderr.flush()
        elif before * 4 // self.total != self.done * 4 // self.total:
            log(f"  {self.label}: {self.done}/{self.total}")


async def run_load(
    session: aiohttp.ClientSession,
    urls: Callable[[int], str],
    bodies: Sequence[bytes],
    concurrency: int,
    progress: Progress | None = None,
) -> LoadResult:
    """Send `bodies` with `concurrency` requests in flight; request i goes to `urls(i)`."""
    result = LoadResult()
    it = iter(enumerate(bodies))

    async def client() -> None:
        for i, body in it:
            await one_request(session, urls(i), body, result)
            if progress is not None:
                progress.step()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return result


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def added_percentile(routed: Sequence[float], direct: Sequence[float], q: float) -> float:
    """The router's added latency at percentile q: the percentile of the per-pair differences
    routed[i] - direct[i], the i-th request of each leg having been sent in the same round,
    next to each other. Routed pXX - direct pXX subtracted two independent samples' tails:
    one slow direct request, noise the routed leg happened to miss, made it negative."""
    return percentile([r - d for r, d in zip(routed, direct, strict=True)], q)


_SERIES = re.compile(
    r"(kvrouter_matched_blocks_(?:sum|count)|kvrouter_routing_decisions_total"
    r"|kvrouter_kv_events_total)(\{[^}]*\})? (\S+)$"
)


async def scrape(session: aiohttp.ClientSession, router: str) -> dict[str, float]:
    """The router's matched-blocks histogram, decisions and KV events, flattened:
    `kvrouter_routing_decisions_total:cache_hit`, `kvrouter_kv_events_total:removed`, ..."""
    async with session.get(router + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m:
            label = re.search(r'(?:outcome|event)="([^"]*)"', m.group(2) or "")
            key = m.group(1) + (":" + label.group(1) if label else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def get_json(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> Any:
    async with session.get(url, headers=headers) as resp:
        return await resp.json(content_type=None)


async def wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)


async def wait_applied(
    session: aiohttp.ClientSession, router: str, workers: Sequence[Child], timeout_s: float = 60
) -> None:
    """Until the router's cursor for every worker reached the worker's last published seq
    (at once for a replica that keeps no index: an index-free policy follows no events)."""
    async with asyncio.timeout(timeout_s):
        while True:
            view = await get_json(session, router + "/workers", AUTH)
            if view.get("keeps_index") is False:
                return
            cursors = {w["url"]: w["ranks"][0]["cursor"] for w in view["workers"]}
            behind = 0
            for w in workers:
                last = (await get_json(session, w.url + "/control/state"))["ranks"][0]["last_seq"]
                cursor = cursors.get(w.url)
                behind += last >= 0 and (cursor is None or cursor < last)
            if not behind:
                return
            await asyncio.sleep(0.1)


async def fill_caches(
    session: aiohttp.ClientSession,
    router: str,
    workers: Sequence[Child],
    prompts: Prompts,
    args: argparse.Namespace,
    ingests: bool = True,
) -> None:
    """Store filler chains on every worker until its cache is full and evicting, and wait
    until the router has applied the events. The system prompts were used last, so LRU
    evicts the oldest request blocks first and the system prompts stay cached."""
    blocks_per_chain = PROMPT_TOKENS // BLOCK_SIZE

    async def fill(worker: Child) -> None:
        state = await get_json(session, worker.url + "/control/state")
        missing = args.cache_blocks - state["ranks"][0]["blocks"]
        chains = max(0, missing) // blocks_per_chain + 2  # a little more: the cache evicts
        for start in range(0, chains, 50):
            body = {"token_chains": prompts.filler_chains(min(50, chains - start))}
            async with session.post(worker.url + "/control/store", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/control/store -> {resp.status}: {await resp.text()}")

    await asyncio.gather(*(fill(w) for w in workers))
    if ingests:
        await wait_applied(session, router, workers)


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Round:
    requests: int
    wall_s: float
    router_cpu_s: float
    workers_cpu_s: float
    client_cpu_s: float
    machine_busy_s: float
    router_stat_cpu_s: float


@dataclass
class Phase:
    """One c=`--concurrency` phase: its rounds, requests and the router's counters."""

    rounds: list[Round]
    loaded: LoadResult
    counters: dict[str, float]  # router metric deltas over the phase

    def per_request(self, key: str) -> float:
        n = self.loaded.requests
        return self.counters.get(key, 0.0) / n if n else math.nan

    @property
    def matched_blocks(self) -> float:
        count = self.counters.get("kvrouter_matched_blocks_count", 0.0)
        return self.counters.get("kvrouter_matched_blocks_sum", 0.0) / count if count else 0.0

    @property
    def outcomes(self) -> dict[str, float]:
        prefix = "kvrouter_routing_decisions_total:"
        return {k[len(prefix) :]: v for k, v in self.counters.items() if k.startswith(prefix) and v}

    @property
    def cpu_us(self) -> list[float]:
        return [r.router_cpu_s / r.requests * 1e6 for r in self.rounds]


@dataclass
class PolicyFigures:
    policy: str
    phases: dict[str, Phase]  # by regime
    direct: LoadResult
    routed: LoadResult
    c1_cpu_us: float
    c1_removed_per_request: float
    idle_cpu_ms_per_s: float
    exit_status: int | None = None


def own_cpu() -> float:
    return cpu_seconds(os.getpid())


async def cpu_phase(
    session: aiohttp.ClientSession,
    router: Child,
    workers: Sequence[Child],
    prompts: Prompts,
    args: argparse.Namespace,
    under_test: Target,
    regime: str,
) -> Phase:
    label = f"[{under_test.label}] c={args.concurrency}, caches {regime}"
    per_round = max(1, args.requests // args.rounds)
    progress = Progress(label, per_round * args.rounds)
    rounds, loaded = [], LoadResult()
    target = router.url + "/v1/completions"

    def sample() -> tuple[float, ...]:
        return (
            cpu_seconds(router.proc.pid),
            sum(cpu_seconds(w.proc.pid) for w in workers),
            own_cpu(),
            machine_busy_seconds(),
            stat_cpu_seconds(router.proc.pid),
        )

    async def settle() -> None:
        if under_test.ingests:
            await wait_applied(session, router.url, workers)

    async def counters() -> dict[str, float]:
        return await scrape(session, router.url) if under_test.ingests else {}

    await settle()
    before_counters = await counters()
    stream_tokens = SSE_TOKENS if regime == SSE else 0
    for _ in range(args.rounds):
        bodies = prompts.bodies(per_round, stream_tokens)
        before = sample()
        t0 = time.perf_counter()
        res = await run_load(session, lambda i: target, bodies, args.concurrency, progress)
        wall = time.perf_counter() - t0
        # The round's CPU includes ingesting the events of all its requests.
        await settle()
        after = sample()
        rounds.append(
            Round(res.requests, wall, *(a - b for a, b in zip(after, before, strict=True)))
        )
        loaded.add(res)
    after_counters = await counters()
    deltas = {k: v - before_counters.get(k, 0.0) for k, v in after_counters.items()}
    return Phase(rounds, loaded, deltas)


async def warm_up(
    session: aiohttp.ClientSession, router: str, prompts: Prompts, args: argparse.Namespace
) -> None:
    target = router + "/v1/completions"
    await run_load(session, lambda i: target, prompts.bodies(args.warmup // 4), 1)
    await run_load(session, lambda i: target, prompts.bodies(args.warmup), args.concurrency)


async def bench_router(
    children: Children, target: Target, prompts: Prompts, args: argparse.Namespace
) -> PolicyFigures:
    policy = target.label
    workers = start_workers(children, args, policy)
    phases: dict[str, Phase] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        router = await start_router(session, children, target, workers, args.event_loop)
        log(f"[{policy}] warm-up")
        await warm_up(session, router.url, prompts, args)

        phase = functools.partial(cpu_phase, session, router, workers, prompts, args, target)
        phases["not full"] = await phase("not full")
        phases[SSE] = await phase(SSE)

        log(f"[{policy}] filling the worker caches to capacity")
        await fill_caches(session, router.url, workers, prompts, args, target.ingests)

        # Hop latency at concurrency 1, direct and routed interleaved round by round.
        direct, routed = LoadResult(), LoadResult()
        routed_cpu_s = 0.0
        per_round = max(1, args.latency_requests // args.rounds)
        progress = Progress(f"[{policy}] c=1 latency, direct + routed", 2 * per_round * args.rounds)
        via_router = router.url + "/v1/completions"
        direct_urls = [w.url + "/v1/completions" for w in workers]
        before = await scrape(session, router.url) if target.ingests else {}
        for r in range(args.rounds):
            legs = [
                (direct, lambda i: direct_urls[i % len(direct_urls)]),
                (routed, lambda i: via_router),
            ]
            for into, urls in legs if r % 2 == 0 else legs[::-1]:
                bodies = prompts.bodies(per_round)
                c0 = cpu_seconds(router.proc.pid)
                res = await run_load(session, urls, bodies, 1, progress)
                if into is routed:
                    routed_cpu_s += cpu_seconds(router.proc.pid) - c0
                into.add(res)
        if target.ingests:
            await wait_applied(session, router.url, workers)
        after = await scrape(session, router.url) if target.ingests else {}
        removed = after.get("kvrouter_kv_events_total:removed", 0.0) - before.get(
            "kvrouter_kv_events_total:removed", 0.0
        )

        # Idle CPU: background polling only (not subtracted from the loaded figures).
        await asyncio.sleep(0.5)
        c0, t0 = cpu_seconds(router.proc.pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle = (cpu_seconds(router.proc.pid) - c0) / (time.perf_counter() - t0) * 1000

        phases["full"] = await phase("full")
    # smg's launcher prints a traceback on SIGINT; SIGTERM is its clean stop.
    status = children.stop(router, signal.SIGTERM if target.smg_binary else signal.SIGINT)
    for w in workers:
        children.stop(w, signal.SIGTERM)
    return PolicyFigures(
        policy,
        phases,
        direct,
        routed,
        routed_cpu_s / routed.requests * 1e6,
        removed / (direct.requests + routed.requests),
        idle,
        status,
    )


@dataclass
class ProfileFigures:
    stats: pstats.Stats
    requests: int
    cpu_s: float
    wall_s: float
    clock: str
    concurrency: int
    gc: dict[str, dict[str, int]]


async def profile_router(
    children: Children, prompts: Prompts, args: argparse.Namespace, out: Path
) -> ProfileFigures:
    workers = start_workers(children, args, "profile")
    argv = [
        sys.executable,
        str(HERE / "profiled_router.py"),
        str(out),
        args.profile_clock,
        *router_args(free_port(), [w.url for w in workers], "cache_aware", args.event_loop),
    ]
    log(f"[profile] starting router: {shlex.join(argv)}")
    router = children.start("kvrouter profiled", argv, "kvrouter listening on ")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, router.url)
        log("[profile] warm-up, filling the worker caches to capacity")
        await warm_up(session, router.url, prompts, args)
        await fill_caches(session, router.url, workers, prompts, args)
        await warm_up(session, router.url, prompts, args)
        bodies = prompts.bodies(args.profile_requests)
        target = router.url + "/v1/completions"
        c0, t0 = cpu_seconds(router.proc.pid), time.perf_counter()
        router.proc.send_signal(signal.SIGUSR1)
        progress = Progress(f"[profile] c={args.concurrency} under cProfile", len(bodies))
        await run_load(session, lambda i: target, bodies, args.concurrency, progress)
        await wait_applied(session, router.url, workers)
        router.proc.send_signal(signal.SIGUSR2)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(router.proc.pid) - c0
        wait_for_file(Path(f"{out}.done"), 60)
    children.stop(router)
    for w in workers:
        children.stop(w, signal.SIGTERM)
    stats, gc_work = read_profile(out)
    return ProfileFigures(
        stats, len(bodies), cpu, wall, args.profile_clock, args.concurrency, gc_work
    )


def read_profile(out: Path) -> tuple[pstats.Stats, dict[str, dict[str, int]]]:
    return pstats.Stats(str(out)), json.loads(Path(f"{out}.gc.json").read_text())


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.05)


# -- the router's own steps, in isolation ---------------------------------------------------


def time_steps(prompts: Prompts, repeats: int, iterations: int) -> list[tuple[str, float]]:
    """Mean us per call of each router-specific step of one request of this benchmark's shape,
    in this process without a profiler: median of `repeats` runs of `iterations` calls.

    The index holds the 8 system prompts on both of 2 ranks, as in the c=32 phases. Each
    decision is of a prompt of its own, so the pressure ledger records and books its 63 new
    blocks (until round 12 the step decided one prompt without its keys: no ledger work, a
    quarter of what a decision costs). Ingest is
    the one batch a worker publishes for such a request, decoded and applied: a BlockStored
    of the 63 uncached blocks (parent = the system prompt's last full block) and, when the
    cache is full, 63 BlockRemoved events of one block each before it (an older request's
    blocks, leaf first). Each call applies a different batch, so every insert is fresh.
    """
    ranks = [RankId(f"http://127.0.0.1:{8000 + i}", 0) for i in range(2)]
    tokenizer = load_tokenizer("bytes")
    bodies = prompts.bodies(iterations)
    old_chains = prompts.filler_chains(iterations)

    def fresh_tree() -> BlockTree:
        tree = BlockTree(BLOCK_SIZE)
        for r, rank in enumerate(ranks):
            for s, text in enumerate(prompts.systems):
                tokens = tokenizer.encode_prompt(text)[: CACHED_BLOCKS * BLOCK_SIZE]
                hashes = [(r << 40) | (s << 20) | b for b in range(CACHED_BLOCKS)]
                tree.store(rank, None, hashes, tokens, BLOCK_SIZE)
        for i, chain in enumerate(old_chains):  # what a full cache evicts, on rank 0
            tokens = chain[: NEW_BLOCKS * BLOCK_SIZE]
            tree.store(ranks[0], None, old_hashes(i), tokens, BLOCK_SIZE)
        return tree

    def old_hashes(i: int) -> list[int]:
        return [(2 << 50) + i * 1000 + b for b in range(NEW_BLOCKS)]

    def texts(n: int) -> list[str]:
        return [msgspec.json.decode(body)["prompt"] for body in prompts.bodies(n)]

    stores, evicting = [], []
    for i, body in enumerate(bodies):
        text = msgspec.json.decode(body)["prompt"]
        s = prompts.systems.index(text[:SYSTEM_TOKENS])
        # An engine's BlockStored carries a list of ids (the bytes tokenizer returns bytes).
        new = list(tokenizer.encode_prompt(text)[CACHED_BLOCKS * BLOCK_SIZE :])
        hashes = [(1 << 50) + i * 1000 + b for b in range(NEW_BLOCKS)]
        stored = Stored(hashes, (s << 20) | (CACHED_BLOCKS - 1), new, BLOCK_SIZE)
        removals: list[Event] = [Removed([h]) for h in reversed(old_hashes(i))]
        stores.append(encode_vllm(time.time(), [stored], 0))
        evicting.append(encode_vllm(time.time(), [*removals, stored], 0))

    body = bodies[0]
    text = msgspec.json.decode(body)["prompt"]
    tokens = tokenizer.encode_prompt(text)
    seed = namespace_seed(None)
    keys = block_keys(tokens, BLOCK_SIZE, seed)
    tree = fresh_tree()
    # Decisions 1 ms apart whose bookings end 32 decisions later, as with 32 in flight (these
    # by their TTL: the prompts' own blocks are never stored here), on ranks of known capacity.
    now = [0.0]
    ledger = PressureLedger(PressureSettings(booking_ttl_s=0.032), clock=lambda: now[0])
    policy = cache_aware_over(tree, ledger)

    def decide() -> None:
        now[0] += 0.001
        policy.decide(candidates, next(decided))

    load = EngineLoad(running=8, waiting=0, kv_usage=0.1)
    candidates = [Candidate(rank, 16, load) for rank in ranks]
    # Each decision a prompt of its own, keys included, as in the replica: the ledger records
    # its blocks (a repeated prompt would find them weighed and booked already).
    decided = iter(
        [
            Prompt(len(t), BLOCK_SIZE, tree.prefix_depths(k), k)
            for t in map(tokenizer.encode_prompt, texts(repeats * iterations))
            for k in [block_keys(t, BLOCK_SIZE, seed)]
        ]
    )
    metrics = RouterMetrics()

    def count() -> None:  # what app.py and proxy.py record per request
        metrics.decisions["cache_aware", "cache_hit"] += 1
        metrics.matched_blocks.observe(CACHED_BLOCKS)
        metrics.requests["/v1/completions", "http://127.0.0.1:8000", "200"] += 1

    steps: list[tuple[str, Callable[[], object]]] = [
        ("JSON body decode (msgspec)", lambda: msgspec.json.decode(body)),
        ("tokenize (bytes tokenizer)", lambda: tokenizer.encode_prompt(text)),
        ("block keys (125 blocks)", lambda: block_keys(tokens, BLOCK_SIZE, seed)),
        ("prefix_depths (2 ranks)", lambda: tree.prefix_depths(keys)),
        (
            "decide, cache_aware (2 candidates, the ledger's record included)",
            decide,
        ),
        ("request counters (3 per request)", count),
    ]
    out = []
    for name, fn in steps:
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iterations):
                fn()
            runs.append((time.perf_counter() - t0) / iterations * 1e6)
        out.append((name, statistics.median(runs)))
    ingest = (
        ("ingest, not full: decode 1 BlockStored(63)", stores, False),
        ("ingest, not full: decode + apply", stores, True),
        ("ingest, full: decode 63 BlockRemoved(1) + 1 BlockStored(63)", evicting, False),
        ("ingest, full: decode + apply", evicting, True),
    )
    for name, payloads, apply in ingest:
        runs = []
        for _ in range(repeats):
            tree = fresh_tree()
            t0 = time.perf_counter()
            for payload in payloads:
                batch = decode_batch(payload)
                if apply:
                    apply_events(tree, ranks[0], batch.events)
            runs.append((time.perf_counter() - t0) / len(payloads) * 1e6)
            if apply and (tree.stats.unknown_parent or tree.block_count(ranks[0]) == 0):
                log(f"warning: ingest step {name!r} did not apply as intended")
        out.append((name, statistics.median(runs)))
    return out


# -- report ---------------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x:.2f}"


def median_range(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def print_latency(figures: Sequence[PolicyFigures], args: argparse.Namespace) -> None:
    n = max(1, args.latency_requests // args.rounds) * args.rounds
    removed = ", ".join(f"{f.policy} {f.c1_removed_per_request:.1f}" for f in figures)
    print(
        f"\n### Hop latency, concurrency 1 ({n} requests per target, direct and routed "
        f"interleaved in {args.rounds} rounds; ms, client-side, body read; caches full: "
        f"BlockRemoved events per request {removed})\n"
    )
    print(
        "| target | p50 | p90 | p99 | mean | added p50 | added p99 | errors | router CPU us/req |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in figures:
        d, r = f.direct.latencies_ms, f.routed.latencies_ms
        print(
            f"| direct to worker (baseline for {f.policy}) | {ms(percentile(d, 50))} | "
            f"{ms(percentile(d, 90))} | {ms(percentile(d, 99))} | {ms(statistics.fmean(d))} "
            f"|  |  | {f.direct.errors} |  |"
        )
        print(
            f"| {f.policy} | {ms(percentile(r, 50))} | {ms(percentile(r, 90))} | "
            f"{ms(percentile(r, 99))} | {ms(statistics.fmean(r))} | "
            f"{ms(added_percentile(r, d, 50))} | "
            f"{ms(added_percentile(r, d, 99))} | {f.routed.errors} | "
            f"{f.c1_cpu_us:.0f} |"
        )


def print_cpu(figures: Sequence[PolicyFigures], args: argparse.Namespace) -> None:
    per_round = max(1, args.requests // args.rounds)
    print(
        f"\n### Router CPU per request, concurrency {args.concurrency} ({args.rounds} rounds "
        f"of {per_round} requests per row; median round [min-max])\n"
    )
    print(
        "| policy | worker caches | router CPU us/req | req/s | latency p50 ms | p99 ms | "
        "errors | KV events/req: stored, removed | matched blocks/req | cached tokens/req |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in figures:
        for regime in REGIMES:
            p = f.phases[regime]
            rps = [r.requests / r.wall_s for r in p.rounds]
            lat = p.loaded.latencies_ms
            ok = p.loaded.requests - p.loaded.errors
            events = (
                f"{p.per_request('kvrouter_kv_events_total:stored'):.2f}, "
                f"{p.per_request('kvrouter_kv_events_total:removed'):.1f}"
            )
            print(
                f"| {f.policy} | {regime} | {median_range(p.cpu_us)} | {median_range(rps)} | "
                f"{ms(percentile(lat, 50))} | {ms(percentile(lat, 99))} | {p.loaded.errors} | "
                f"{events} | {p.matched_blocks:.1f} | "
                f"{p.loaded.cached_tokens / ok if ok else math.nan:.0f} |"
            )
    print(
        f"\nBudget: router CPU per cache_aware request <= {BUDGET_US} us on this machine "
        "(smg, a Rust router, measured ~400-425 us here). Router idle CPU (polling, no "
        "traffic; included above, not subtracted): "
        + ", ".join(f"{f.policy} {f.idle_cpu_ms_per_s:.1f} ms/s" for f in figures)
        + "."
    )
    cores = os.cpu_count() or 1
    print(
        f"\nWho used the cores during those rows (% of one core; {cores} cores = "
        f"{100 * cores}%; 'other' = processes this benchmark did not start):\n"
    )
    print(
        "| policy | worker caches | router | workers (all) | bench client | other | idle | "
        "router us/req, whole phase (/proc/stat) | workers us/req | client us/req |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in figures:
        for regime in REGIMES:
            rounds = f.phases[regime].rounds
            wall = sum(r.wall_s for r in rounds)
            n = sum(r.requests for r in rounds)
            router = sum(r.router_cpu_s for r in rounds)
            workers = sum(r.workers_cpu_s for r in rounds)
            client = sum(r.client_cpu_s for r in rounds)
            busy = sum(r.machine_busy_s for r in rounds)
            other = max(0.0, busy - router - workers - client)
            idle = max(0.0, cores * wall - busy)
            ticks = sum(r.router_stat_cpu_s for r in rounds)
            print(
                f"| {f.policy} | {regime} | {100 * router / wall:.0f}% | "
                f"{100 * workers / wall:.0f}% | {100 * client / wall:.0f}% | "
                f"{100 * other / wall:.0f}% | {100 * idle / wall:.0f}% | "
                f"{router / n * 1e6:.0f} ({ticks / n * 1e6:.0f}) | {workers / n * 1e6:.0f} | "
                f"{client / n * 1e6:.0f} |"
            )
    print()
    for f in figures:
        for regime in REGIMES:
            outcomes = ", ".join(
                f"{k} {v:.0f}" for k, v in sorted(f.phases[regime].outcomes.items())
            )
            print(f"{f.policy}, caches {regime}: decisions {outcomes or 'none'}")
    print(
        "router exit status after SIGINT: "
        + ", ".join(f"{f.policy} {f.exit_status}" for f in figures)
    )


def print_steps(
    steps: Sequence[tuple[str, float]], calibration: float, figures: Sequence[PolicyFigures]
) -> None:
    print(
        "\n### The router's own steps per request, timed in isolation (this process, no "
        f"profiler, no other process of this benchmark running; median of runs; "
        f"calibration: sum(range(1000)) takes {calibration:.1f} us here now)\n"
    )
    print("| step | us/req |")
    print("|---|---:|")
    for name, us in steps:
        print(f"| {name} | {us:.1f} |")
    request_path = sum(us for name, us in steps if not name.startswith("ingest"))
    ingest = {name: us for name, us in steps if name.endswith("decode + apply")}
    totals = {
        "not full": request_path + ingest["ingest, not full: decode + apply"],
        "full": request_path + ingest["ingest, full: decode + apply"],
    }
    print(
        f"| **request path (decode .. counters)** | **{request_path:.1f}** |\n"
        f"| **+ ingest, caches not full** | **{totals['not full']:.1f}** |\n"
        f"| **+ ingest, caches full** | **{totals['full']:.1f}** |"
    )
    for f in figures:
        if f.policy != "kvrouter cache_aware":
            continue
        parts = []
        for regime in ("not full", "full"):
            cpu = statistics.median(f.phases[regime].cpu_us)
            parts.append(
                f"caches {regime}: {cpu:.0f} us/req measured, ~{totals[regime]:.0f} in these "
                f"steps, ~{cpu - totals[regime]:.0f} elsewhere"
            )
        print(
            "\ncache_aware at c=32, "
            + "; ".join(parts)
            + ". 'Elsewhere' is HTTP serving and relaying (the data plane's Protocols and "
            "httptools), the event loop, ZMQ receive and framing, GC, and these steps running "
            "slower on a loaded machine than in a hot loop."
        )


def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a C function
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker != "site-packages/":
                path = path.split("/", 1)[1]
            break
    else:
        with contextlib.suppress(ValueError):
            path = str(Path(path).resolve().relative_to(HERE.parent))
    return f"{path}:{line}({name})"


def _group(func: tuple[str, int, str]) -> str:
    path, _, name = func
    if path == "~":
        m = re.match(r"<(?:built-in )?method (\S+) of (\S+)", name)
        if m:
            return f"C: {m.group(2).strip(chr(39))}"
        return "C: builtins"
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    if "/lib/python3" in path:
        rest = path.split("/lib/python3", 1)[1].split("/", 1)[1]
        return "stdlib " + rest.split("/", 1)[0].removesuffix(".py")
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(HERE.parent))
    return path


def own_time_by_module(stats: pstats.Stats) -> list[tuple[str, float]]:
    """(module or C type, own seconds), largest first."""
    groups: dict[str, float] = {}
    for func, (_, _, tt, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        groups[_group(func)] = groups.get(_group(func), 0.0) + tt
    return sorted(groups.items(), key=lambda kv: kv[1], reverse=True)


def top_own_time(stats: pstats.Stats, top: int) -> list[tuple[str, float, int]]:
    """(function, own seconds, calls) of the `top` functions by own time."""
    entries = stats.stats  # type: ignore[attr-defined]
    ranked = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(_where(func), tt, nc) for func, (_, nc, tt, _, _) in ranked]


def print_profile(p: ProfileFigures, top: int = 15) -> None:
    entries = p.stats.stats  # type: ignore[attr-defined]
    total = sum(tt for _, _, tt, _, _ in entries.values())
    calls = sum(nc for _, nc, _, _, _ in entries.values())
    n = p.requests
    clock = {
        "cpu": "the loop thread's CPU time (a syscall per profiler event, so call-heavy code "
        "is inflated most)",
        "wall": "perf_counter, wall time (preemption is charged to the running function, "
        "mostly socket send(), which wakes the receiving process)",
    }[p.clock]
    print(
        f"\n### Profile: cache_aware router under cProfile, c={p.concurrency}, {n} requests, "
        "worker caches full\n\n"
        f"With the profiler on: {p.cpu_s / n * 1e6:.0f} us process CPU/req, "
        f"{n / p.wall_s:.0f} req/s, {total / n * 1e6:.0f} us/req of profiled time, "
        f"{calls / n:.0f} function calls/req. Clock: {clock}. A coroutine's 'calls' count "
        "its resumptions. Use the shares; absolute costs are the unprofiled figures above.\n"
    )
    for index, title in ((2, "own time"), (3, "cumulative time")):
        ranked = sorted(entries.items(), key=lambda kv: kv[1][index], reverse=True)[:top]
        print(f"Top {top} by {title} (us per request; calls per request):\n")
        print("| own us/req | cum us/req | calls/req | function |")
        print("|---:|---:|---:|---|")
        for func, (_, nc, tt, ct, _) in ranked:
            print(f"| {tt / n * 1e6:.1f} | {ct / n * 1e6:.1f} | {nc / n:.1f} | {_where(func)} |")
        print()
    print("Own time by module (us per request, share of profiled time):\n")
    print("| module | own us/req | share |")
    print("|---|---:|---:|")
    for name, tt in own_time_by_module(p.stats)[:top]:
        print(f"| {name} | {tt / n * 1e6:.1f} | {100 * tt / total:.0f}% |")
    gcs = ", ".join(
        f"gen{g}: {w['collections']} x, {w['cpu_ns'] / 1e6:.1f} ms CPU, longest "
        f"{w['max_ns'] / 1e6:.1f} ms"
        for g, w in p.gc.items()
    )
    spent = sum(w["cpu_ns"] for w in p.gc.values()) / 1e3 / n
    print(
        f"\nGarbage collector in the router during the window (not a profiled function; its "
        f"time lands in whichever function allocated): {gcs or 'no collections'}; "
        f"{spent:.0f} us/req."
    )


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="c=32 requests per phase")
    parser.add_argument("--latency-requests", type=int, default=1000, help="c=1, per target")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=200_000,
        help="per worker; enough for the two not-full phases without an eviction",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=200, help="c=32 warm-up requests")
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="fewer requests (~40 s in all)")
    parser.add_argument(
        "--event-loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="kvrouter's and the bare relay's event loop (auto: uvloop when installed)",
    )
    parser.add_argument(
        "--smg",
        action="store_true",
        help=f"also measure smg {SMG_POLICY} (installed on first use into bench/results/smg-venv)",
    )
    parser.add_argument("--profile", action="store_true", help="also profile cache_aware")
    parser.add_argument("--profile-requests", type=int, default=1000)
    parser.add_argument(
        "--profile-clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the loop thread's CPU time (a syscall per event: ~3x overhead, most on "
        "call-heavy code); wall: perf_counter (cheap, but charges preemption, mostly to "
        "socket send(), which wakes the receiving process)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 500)
        args.latency_requests = min(args.latency_requests, 250)
        args.profile_requests = min(args.profile_requests, 300)
        args.warmup = min(args.warmup, 100)
        args.idle_s = min(args.idle_s, 1.0)
    return args


def targets(smg_binary: Path | None) -> list[Target]:
    """kvrouter with each of POLICIES, then smg when it is installed, then the bare relay."""
    out = [Target("kvrouter", policy) for policy in POLICIES]
    if smg_binary is not None:
        out.append(Target("smg", SMG_POLICY, smg_binary))
    out.append(Target(RELAY, RELAY_POLICY))
    return out


@dataclass
class Measured:
    figures: list[PolicyFigures]
    steps: list[tuple[str, float]]
    calibration_us: float
    profile: ProfileFigures | None


async def measure(
    args: argparse.Namespace, children: Children, routers: Sequence[Target]
) -> Measured:
    prompts = Prompts()
    figures = [await bench_router(children, t, prompts, args) for t in routers]
    profile = None
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            profile = await profile_router(children, prompts, args, Path(tmp) / "router.prof")
    log("timing the router's steps in isolation")
    steps = time_steps(prompts, repeats=5, iterations=200 if args.quick else 500)
    # Python speed differs between machines and moments; this lets figures be compared.
    calibration = statistics.median(timeit.repeat(lambda: sum(range(1000)), number=2000))
    return Measured(figures, steps, calibration / 2000 * 1e6, profile)


async def run(args: argparse.Namespace, children: Children) -> None:
    smg_binary = None
    if args.smg:
        from bench.smg import from_environment

        smg = from_environment()
        if smg.ensure(log):
            smg_binary = smg.binary
        else:
            log(f"no smg row: {smg.reason}")
    m = await measure(args, children, targets(smg_binary))
    print_latency(m.figures, args)
    print_cpu(m.figures, args)
    print_steps(m.steps, m.calibration_us, m.figures)
    if m.profile is not None:
        print_profile(m.profile)


def main() -> None:
    if str(HERE.parent) not in sys.path:
        sys.path.insert(0, str(HERE.parent))  # `bench.smg` and `tests.support`, as a script
    if "--chat" in sys.argv[1:]:  # the chat regime on a real tokenizer: bench/chat_proxy.py
        from bench import chat_proxy

        chat_proxy.main()
        return
    args = parse_args()
    cpu = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    print(f"$ {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"machine: {os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, aiohttp {importlib.metadata.version('aiohttp')}"
    )
    print(
        f"setup: per policy, {args.workers} fresh fake-kv-worker processes (no prefill/decode "
        f"time, block 16, {args.cache_blocks} blocks/rank, LRU) and one kvrouter process "
        "(--block-size 16, bytes tokenizer, default poll intervals), all on 127.0.0.1; "
        f"non-streaming /v1/completions, max_tokens 1, {PROMPT_TOKENS}-token prompts = 1 of "
        f"{SYSTEM_PROMPTS} shared {SYSTEM_TOKENS}-token system prompts + {UNIQUE_TOKENS} unique "
        "tokens; load from aiohttp in this process, which shares the cores (nothing pinned)"
    )
    sys.stdout.flush()
    children = Children()
    started = time.monotonic()
    try:
        asyncio.run(run(args, children))
    except KeyboardInterrupt:
        log("interrupted; stopping child processes")
        raise SystemExit(130) from None
    finally:
        children.stop_all()
    log(f"done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
