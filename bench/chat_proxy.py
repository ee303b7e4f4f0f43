"""Multi-turn chat through the proxy on a real tokenizer: router CPU, added latency, tokenize share.

Run: .venv/bin/python bench/bench_proxy.py --chat [--requests 1200] [--latency-requests 240]
     [--rounds 6] [--concurrency 32] [--model DIR] [--quick]
     (or `python -m bench.chat_proxy` with the same flags). Prints figures; asserts nothing.
     ~3 minutes (--quick ~1). With BENCH_SMG_VENV (or bench/results/smg-venv) smg is measured
     too.

What runs: a model directory (by default a Qwen-family byte-level BPE with a 32k vocabulary
trained on the standard library, as fast per token as a real model's, under the real Qwen3
chat template: tests/support/model_dirs.py; `--model DIR` takes a real checkpoint's tokenizer
files instead), and one fleet per target, all up at once: two fake workers loading the same
directory (`fake-kv-worker --tokenizer DIR`: they render each chat request with transformers
as vLLM does, and cache and publish the blocks of its token ids) behind one router:

- `kvrouter cache_aware, tokenize cache on`: `--tokenizer DIR` (the segment cache, 64 MB);
- `kvrouter cache_aware, tokenize cache off`: the same with `--tokenize-cache-mb 0`;
- `smg cache_aware`: smg in HTTP mode, `--tokenizer-path DIR`;
- `relay (floor)`: kvrouter's data plane relaying round-robin, no decode, no tokenization.

The requests are bench/chat_trace.py's agentic trace: 3 applications, each a 400-word system
prompt and 8 tools; sessions that grow by a user turn and an assistant reply per request (every
third turn a tool call and its result), interleaved turn by turn. Every target gets the same
bodies as `/v1/chat/completions` (non-streaming, `max_tokens` 16).

Phases, each in rounds that interleave the targets (the order rotates every round), so that the
machine's noise (other people's processes) hits every target alike:
1. warm-up on another trace (other system prompts: the measured trace starts cold);
2. c=`--concurrency`: the router process's CPU per request (every thread, /proc schedstat;
   kvrouter's window closes once it applied the KV events of the round's requests), req/s,
   latency, and the cached prompt tokens per request the workers report (routing quality);
3. c=1: each chat request is sent straight to a worker (the baseline) and through the router,
   one right after the other, alternating which goes first; added latency pXX = the pXX of
   the pairs' differences, routed - direct (`bench_proxy.added_percentile`).
Last, with the fleets stopped, this process times the tokenizer the routers run on the same
bodies in the same order (cache emptied first): `encode_chat_request` with the cache and
without, and a bare encode of the rendered prompts (no rules, no template), per request; the
tokenization share = that time / the router's measured CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import bench_proxy as bp
from bench.chat_trace import TraceShape, chat_trace

CACHE_ON = "kvrouter cache_aware, tokenize cache on"
CACHE_OFF = "kvrouter cache_aware, tokenize cache off"
SMG = "smg cache_aware"
FLOOR = "relay (floor)"
TURNS = 8
WARMUP_SEED, MEASURE_SEED, LATENCY_SEED = 101, 11, 202


@dataclass(frozen=True)
class ChatTarget:
    label: str
    router: str  # "kvrouter", "smg" or bp.RELAY
    cache_mb: float = 64.0
    smg_binary: Path | None = None

    @property
    def ingests(self) -> bool:
        return self.router == "kvrouter"


def chat_targets(smg_binary: Path | None) -> list[ChatTarget]:
    out = [ChatTarget(CACHE_ON, "kvrouter"), ChatTarget(CACHE_OFF, "kvrouter", 0.0)]
    if smg_binary is not None:
        out.append(ChatTarget(SMG, "smg", smg_binary=smg_binary))
    return [*out, ChatTarget(FLOOR, bp.RELAY)]


@dataclass
class Fleet:
    target: ChatTarget
    router: bp.Child
    workers: list[bp.Child]


@dataclass
class ChatRound:
    requests: int
    wall_s: float
    router_cpu_s: float
    workers_cpu_s: float


@dataclass
class FleetFigures:
    """Per target: c=32 rounds and their load, c=1 direct and routed, router counter deltas."""

    label: str
    rounds: list[ChatRound] = field(default_factory=list)
    loaded: bp.LoadResult = field(default_factory=bp.LoadResult)
    direct: bp.LoadResult = field(default_factory=bp.LoadResult)
    routed: bp.LoadResult = field(default_factory=bp.LoadResult)
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_us(self) -> list[float]:
        return [r.router_cpu_s / r.requests * 1e6 for r in self.rounds]

    @property
    def workers_cpu_us(self) -> float:
        n = sum(r.requests for r in self.rounds)
        return sum(r.workers_cpu_s for r in self.rounds) / n * 1e6 if n else float("nan")


def encoded(bodies: Sequence[dict[str, Any]]) -> list[bytes]:
    return [json.dumps(b, separators=(",", ":")).encode() for b in bodies]


def trace(sessions: int, seed: int) -> list[dict[str, Any]]:
    return chat_trace(TraceShape(sessions=sessions, turns=TURNS, seed=seed))


def chunks(items: Sequence[bytes], n: int) -> list[list[bytes]]:
    size = len(items) // n
    return [list(items[i * size : (i + 1) * size]) for i in range(n)]


# -- fleets ---------------------------------------------------------------------------------


async def start_fleet(
    session: aiohttp.ClientSession,
    children: bp.Children,
    target: ChatTarget,
    model: Path,
    args: argparse.Namespace,
) -> Fleet:
    workers = []
    for i in range(args.workers):
        argv = [*bp.worker_argv(bp.free_port(), args.cache_blocks), "--tokenizer", str(model)]
        bp.log(f"[{target.label}] starting worker {i}: {shlex.join(argv)}")
        workers.append(
            children.start(f"{target.label} worker {i}", argv, "fake-kv-worker listening on ", 90)
        )
    urls = [w.url for w in workers]
    port = bp.free_port()
    if target.router == "kvrouter":
        argv = [str(bp.BIN / "kvrouter"), *bp.router_args(port, urls, "cache_aware")]
        argv += ["--tokenizer", str(model), "--tokenize-cache-mb", f"{target.cache_mb:g}"]
        bp.log(f"[{target.label}] starting router: {shlex.join(argv)}")
        router = children.start(target.label, argv, "kvrouter listening on ", 90)
        await bp.wait_ready(session, router.url, 90)
    elif target.smg_binary is not None:
        from bench.smg import launch_argv, wait_ready

        argv = launch_argv(target.smg_binary, port, bp.free_port(), urls, "cache_aware")
        argv += ["--tokenizer-path", str(model)]
        bp.log(f"[{target.label}] starting router: {shlex.join(argv)}")
        router, _ = children.spawn(target.label, argv)
        router.url = f"http://127.0.0.1:{port}"
        await wait_ready(session, router.url, lambda: router.proc.poll() is None, len(urls), 90)
    else:
        from bench.relay_floor import READY_PREFIX

        argv = [sys.executable, str(bp.HERE / "relay_floor.py"), "--port", str(port)]
        argv += [arg for url in urls for arg in ("--worker", url)]
        bp.log(f"[{target.label}] starting relay: {shlex.join(argv)}")
        router = children.start(target.label, argv, READY_PREFIX)
    return Fleet(target, router, workers)


_TOKENIZE_SERIES = re.compile(
    r"(kvrouter_tokenize_failures_total|kvrouter_tokenize_cache_lookups_total"
    r"|kvrouter_matched_blocks_sum|kvrouter_matched_blocks_count)(?:\{[^}]*=\"([^\"]*)\"\})? (\S+)$"
)


async def counters(session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, float]:
    """kvrouter's tokenize failures and cache lookups (by label) and matched-block totals."""
    if not fleet.target.ingests:
        return {}
    async with session.get(fleet.router.url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _TOKENIZE_SERIES.match(line)
        if m:
            key = m.group(1) + (":" + m.group(2) if m.group(2) else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def settle(session: aiohttp.ClientSession, fleet: Fleet) -> None:
    if fleet.target.ingests:
        await bp.wait_applied(session, fleet.router.url, fleet.workers)


def chat_url(child: bp.Child) -> str:
    return child.url + "/v1/chat/completions"


def taking_turns(children: Sequence[bp.Child]) -> Callable[[int], str]:
    """Request i goes to children[i % n]'s chat endpoint."""
    urls = [chat_url(c) for c in children]
    return lambda i: urls[i % len(urls)]


# -- phases ---------------------------------------------------------------------------------


def rotated(fleets: Sequence[Fleet], r: int) -> list[Fleet]:
    r %= len(fleets)
    return [*fleets[r:], *fleets[:r]]


async def warm_up(
    session: aiohttp.ClientSession, fleets: Sequence[Fleet], bodies: list[bytes], c: int
) -> None:
    for fleet in fleets:
        bp.log(f"[{fleet.target.label}] warm-up")
        to_router = taking_turns([fleet.router])
        await bp.run_load(session, to_router, bodies[: len(bodies) // 4], 1)
        await bp.run_load(session, to_router, bodies[len(bodies) // 4 :], c)
        await settle(session, fleet)


async def loaded_phase(
    session: aiohttp.ClientSession,
    fleets: Sequence[Fleet],
    figures: dict[str, FleetFigures],
    rounds: list[list[bytes]],
    concurrency: int,
) -> None:
    before = {f.target.label: await counters(session, f) for f in fleets}
    for r, bodies in enumerate(rounds):
        for fleet in rotated(fleets, r):
            label = fleet.target.label
            progress = bp.Progress(f"[{label}] c={concurrency} round {r + 1}", len(bodies))
            await settle(session, fleet)
            pids = [w.proc.pid for w in fleet.workers]
            c0 = bp.cpu_seconds(fleet.router.proc.pid)
            w0 = sum(map(bp.cpu_seconds, pids))
            t0 = time.perf_counter()
            to_router = taking_turns([fleet.router])
            res = await bp.run_load(session, to_router, bodies, concurrency, progress)
            wall = time.perf_counter() - t0
            await settle(session, fleet)  # the round's CPU includes ingesting its events
            cpu = bp.cpu_seconds(fleet.router.proc.pid) - c0
            workers = sum(map(bp.cpu_seconds, pids)) - w0
            figures[label].rounds.append(ChatRound(res.requests, wall, cpu, workers))
            figures[label].loaded.add(res)
    for fleet in fleets:
        after = await counters(session, fleet)
        label = fleet.target.label
        figures[label].counters = {k: v - before[label].get(k, 0.0) for k, v in after.items()}


async def latency_phase(
    session: aiohttp.ClientSession,
    fleets: Sequence[Fleet],
    figures: dict[str, FleetFigures],
    rounds: list[list[bytes]],
) -> None:
    """c=1: every body is sent twice, straight to a worker (taking turns) and through the
    router, one right after the other (which goes first alternates), so both legs see the
    same request sizes, worker work and moment of the machine's noise. The workers simulate
    no prefill time, so the copy that finds the other's blocks cached is not faster."""
    for r, bodies in enumerate(rounds):
        for fleet in rotated(fleets, r):
            fig = figures[fleet.target.label]
            routed = chat_url(fleet.router)
            for i, body in enumerate(bodies):
                direct = chat_url(fleet.workers[i % len(fleet.workers)])
                legs = [(fig.direct, direct), (fig.routed, routed)]
                for into, url in legs if i % 2 == 0 else legs[::-1]:
                    await bp.one_request(session, url, body, into)
            await settle(session, fleet)


# -- the tokenizer in isolation -------------------------------------------------------------


def time_tokenizer(
    model: Path, bodies: Sequence[dict[str, Any]], repeats: int
) -> dict[str, list[float]]:
    """CPU us per request of what the routers run, on the c=32 bodies in their order."""
    from router.tokenize import load_tokenizer
    from router.tokenize.chat_rules import render_call

    uncached = load_tokenizer(str(model), cache_mb=0)
    hf = uncached.model
    reference = [uncached.encode_chat_request(b).ids for b in bodies]
    template = hf._tokenizer.chat_template  # type: ignore[attr-defined]
    traits = hf._traits_of(template)  # type: ignore[attr-defined]
    texts = [hf._render(render_call(b, traits, hf.engine), template) for b in bodies]  # type: ignore[attr-defined]
    backend = hf._backend  # type: ignore[attr-defined]
    out: dict[str, list[float]] = {"cache on": [], "cache off": [], "bare encode": []}
    for _ in range(repeats):
        fresh = load_tokenizer(str(model))
        start = time.thread_time_ns()
        got = [fresh.encode_chat_request(b).ids for b in bodies]
        out["cache on"].append((time.thread_time_ns() - start) / len(bodies) / 1000)
        assert list(map(list, got)) == reference, "cached ids differ from uncached ones"
        start = time.thread_time_ns()
        for b in bodies:
            uncached.encode_chat_request(b)
        out["cache off"].append((time.thread_time_ns() - start) / len(bodies) / 1000)
        start = time.thread_time_ns()
        for text in texts:
            backend.encode(text, add_special_tokens=False)
        out["bare encode"].append((time.thread_time_ns() - start) / len(bodies) / 1000)
    return out


# -- run and print --------------------------------------------------------------------------


@dataclass
class ChatMeasured:
    model: str
    figures: list[FleetFigures]
    tokenizer_us: dict[str, list[float]]
    prompt_tokens: list[int]
    requests: int
    concurrency: int
    rounds: int


def default_model(root: Path) -> Path:
    from tests.support.model_dirs import build_model_dir, fixture_template

    return build_model_dir(root / "qwen", "qwen", fixture_template("qwen3.jinja"), big=True)


async def measure_chat(
    args: argparse.Namespace, children: bp.Children, smg_binary: Path | None
) -> ChatMeasured:
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as tmp:
        model = Path(args.model) if args.model else default_model(Path(tmp))
        targets = chat_targets(smg_binary)
        # An odd number of sessions: with an even one, round-robin over two workers would
        # send every turn of a session to the same worker (a session recurs every `sessions`
        # requests), an affinity it does not have in production.
        sessions = max(1, args.requests // TURNS) | 1
        measured = trace(sessions, MEASURE_SEED)
        bodies = encoded(measured)
        warm = encoded(trace(max(4, args.warmup // TURNS), WARMUP_SEED))
        latency = encoded(trace(max(1, args.latency_requests // TURNS) | 1, LATENCY_SEED))
        figures = {t.label: FleetFigures(t.label) for t in targets}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            fleets = [await start_fleet(session, children, t, model, args) for t in targets]
            await warm_up(session, fleets, warm, args.concurrency)
            bp.log(f"c={args.concurrency}: {len(bodies)} chat requests per target")
            await loaded_phase(
                session, fleets, figures, chunks(bodies, args.rounds), args.concurrency
            )
            bp.log(f"c=1: {len(latency)} chat requests per target, half direct")
            await latency_phase(session, fleets, figures, chunks(latency, args.rounds))
        for fleet in fleets:
            sig = signal.SIGTERM if fleet.target.router == "smg" else signal.SIGINT
            children.stop(fleet.router, sig)
            for w in fleet.workers:
                children.stop(w, signal.SIGTERM)
        bp.log("timing the tokenizer in isolation (fleets stopped)")
        tokenizer_us = time_tokenizer(model, measured, repeats=3)
        from router.tokenize import load_tokenizer

        tok = load_tokenizer(str(model), cache_mb=0)
        tokens = [len(tok.encode_chat_request(b).ids) for b in measured]
        name = args.model or "qwen-family BPE, 32k vocabulary, Qwen3 template (built)"
    return ChatMeasured(
        name,
        list(figures.values()),
        tokenizer_us,
        tokens,
        len(bodies),
        args.concurrency,
        args.rounds,
    )


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_range(values: Sequence[float], digits: int = 0) -> str:
    if not values:
        return "n/a"
    return f"{med(values):,.{digits}f} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]"


def figures_json(m: ChatMeasured) -> dict[str, Any]:
    """The chat rows as JSON (the suite's proxy result keeps them under `chat`)."""
    pct = bp.percentile
    tokenize = {k: med(v) for k, v in m.tokenizer_us.items()}
    rows = []
    for f in m.figures:
        lat = f.loaded.latencies_ms
        d, r = f.direct.latencies_ms, f.routed.latencies_ms
        ok = f.loaded.requests - f.loaded.errors
        cpu = med(f.cpu_us)
        row: dict[str, Any] = {
            "target": f.label,
            "router_cpu_us": cpu,
            "router_cpu_us_rounds": f.cpu_us,
            "req_per_s": med([x.requests / x.wall_s for x in f.rounds]),
            "latency_p50_ms": pct(lat, 50),
            "latency_p99_ms": pct(lat, 99),
            "errors": f.loaded.errors + f.direct.errors + f.routed.errors,
            "cached_tokens_per_req": f.loaded.cached_tokens / ok if ok else float("nan"),
            "workers_cpu_us": f.workers_cpu_us,
            "added_p50_ms": bp.added_percentile(r, d, 50),
            "added_p99_ms": bp.added_percentile(r, d, 99),
            "direct_p50_ms": pct(d, 50),
        }
        if f.label in (CACHE_ON, CACHE_OFF):
            c = f.counters
            mode = "cache on" if f.label == CACHE_ON else "cache off"
            row["tokenize_us"] = tokenize[mode]
            row["tokenize_share"] = tokenize[mode] / cpu
            row["tokenize_failures"] = sum(
                v for k, v in c.items() if k.startswith("kvrouter_tokenize_failures_total")
            )
            count = c.get("kvrouter_matched_blocks_count", 0.0)
            row["matched_blocks_per_req"] = (
                c.get("kvrouter_matched_blocks_sum", 0.0) / count if count else 0.0
            )
            hits = c.get("kvrouter_tokenize_cache_lookups_total:hit", 0.0)
            misses = c.get("kvrouter_tokenize_cache_lookups_total:miss", 0.0)
            row["segment_hit_rate"] = hits / (hits + misses) if hits + misses else None
        rows.append(row)
    return {
        "model": m.model,
        "requests": m.requests,
        "concurrency": m.concurrency,
        "rounds": m.rounds,
        "prompt_tokens_median": med(m.prompt_tokens),
        "prompt_tokens_max": max(m.prompt_tokens),
        "tokenizer_us": tokenize,
        "tokenizer_us_runs": m.tokenizer_us,
        "rows": rows,
    }


def chat_table(j: dict[str, Any]) -> str:
    """The chat rows as a Markdown table, with the setup and the tokenizer in isolation."""
    from bench.report import table

    rows = []
    for row in j["rows"]:
        share = "-"
        if "tokenize_us" in row:
            share = f"{row['tokenize_us']:,.0f} ({row['tokenize_share']:.0%})"
        rows.append(
            [
                row["target"],
                median_range(row["router_cpu_us_rounds"]),
                f"{row['req_per_s']:,.0f}",
                f"{row['latency_p50_ms']:.1f}",
                f"{row['added_p50_ms']:.2f}",
                f"{row['added_p99_ms']:.2f}",
                f"{row['cached_tokens_per_req']:,.0f}",
                share,
                str(row["errors"]),
            ]
        )
    t = j["tokenizer_us_runs"]
    kv = {r["target"]: r for r in j["rows"]}
    notes = [
        f"{j['requests']} multi-turn /v1/chat/completions requests per router at "
        f"c={j['concurrency']} in {j['rounds']} rounds interleaving the routers (median round "
        f"[range]); prompts median {j['prompt_tokens_median']:.0f} tokens, max "
        f"{j['prompt_tokens_max']}; model: {j['model']}; two fake workers per router render "
        "and tokenize with the same model directory. Added latency: c=1, the percentile of "
        "each request's routed minus direct time (same fleet, alternating). Cached "
        "tokens/req: what the workers found cached.",
        "Tokenize us/req: the routers' tokenizer timed alone on the same bodies in the same "
        "order (fleets stopped), and its share of that router's CPU per request; "
        f"encode_chat_request with the cache {median_range(t['cache on'])} us, without "
        f"{median_range(t['cache off'])}, a bare encode of the rendered prompts "
        f"{median_range(t['bare encode'])}: with the cache "
        f"{med(t['cache on']) / med(t['bare encode']):.1%} of a bare encode.",
    ]
    for label in (CACHE_ON, CACHE_OFF):
        row = kv.get(label)
        if row is not None:
            rate = row["segment_hit_rate"]
            notes.append(
                f"{label}: tokenize failures {row['tokenize_failures']:.0f}, matched blocks/req "
                f"{row['matched_blocks_per_req']:.1f}, segment cache hit rate "
                + (f"{rate:.1%}." if rate is not None else "n/a (off).")
            )
    return table(
        [
            "router (chat, real tokenizer)",
            "router CPU us/req",
            "req/s",
            "p50 ms",
            "added p50 ms",
            "added p99 ms",
            "cached tokens/req",
            "tokenize us/req (share)",
            "errors",
        ],
        rows,
        note=" ".join(notes),
    )


def print_chat(m: ChatMeasured) -> None:
    print(f"\n### Multi-turn chat on a real tokenizer\n\n{chat_table(figures_json(m))}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model directory (default: a built Qwen-family one)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=1200, help="c=32 requests per target")
    parser.add_argument(
        "--latency-requests", type=int, default=240, help="c=1 bodies per target, each sent twice"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-blocks", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=96, help="warm-up requests per target")
    parser.add_argument("--no-smg", action="store_true", help="no smg row")
    parser.add_argument("--quick", action="store_true", help="fewer requests (~1 minute)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 320)
        args.latency_requests = min(args.latency_requests, 96)
        args.rounds = min(args.rounds, 4)
        args.warmup = min(args.warmup, 48)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    smg_binary = None
    if not args.no_smg:
        from bench.smg import from_environment

        found = from_environment()
        if found.ensure(bp.log):
            smg_binary = found.binary
        else:
            bp.log(f"no smg row: {found.reason}")
    print(f"$ {shlex.join([sys.executable, *sys.argv])}")
    children = bp.Children()
    started = time.monotonic()
    try:
        print_chat(asyncio.run(measure_chat(args, children, smg_binary)))
    except KeyboardInterrupt:
        bp.log("interrupted; stopping child processes")
        raise SystemExit(130) from None
    finally:
        children.stop_all()
    bp.log(f"done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
