"""`kvrouter demo`: a whole local cluster on 127.0.0.1, driven and checked in under a minute.

What it runs, as real processes on free loopback ports and with no model files:

- a fleet of `fake-kv-worker`s (default 4, the last with 2 dp ranks), each simulating prefill
  time per uncached prompt token (`--prefill-us-per-token`), a bounded prefix cache per rank
  (`--cache-blocks`) and a bounded number of running requests per rank (the rest queue),
  publishing real KV events with replay;
- two router pairs, each replica `kvrouter serve --peer <its sibling>`: a `round_robin` pair
  and a `cache_aware` pair (two pairs rather than a restart, so the second policy costs no
  start-up time; the round-robin pair is stopped once its phase is over).

What it does:

1. The same shared-prefix chat workload through each pair, one after the other: several long
   system prompts, multi-turn conversations where each turn resends the whole conversation
   (the bytes tokenizer's chat template keeps earlier turns as a prefix), several
   conversations at a time, each request to one replica of the pair in turn (as a load
   balancer would). Per phase: the fleet's cached-token ratio (the workers' own
   `cached_tokens / prompt_tokens`, as deltas of `/control/state`) and the time to first
   token measured by the client (first SSE chunk of a `stream: true` request). The workers'
   caches are cleared between the phases (`/control/clear`), so both policies start cold.
2. A third `cache_aware` replica joins with `--peer` both warm ones while traffic continues
   through them; its bootstrap is shown as it happens (`/readyz`, and from `/metrics` the
   per-rank `kvrouter_kv_bootstrap_state`, `kvrouter_kv_peer_snapshot_total`, the grafts
   and the per-rank outcomes), with its time to ready.
3. Traffic stops; one probe batch per rank (`/control/store`) is the live gate, and the
   quiesce waits until every replica's cursor for every rank reached the worker's `last_seq`
   (`/control/state`). Then `kvrouter view`'s logic compares the three canonical views.
4. The next turn of a few conversations is sent to each replica, the new one first, with
   `--expose-route-headers`: every replica must choose the same rank (`X-Kvrouter-Worker`,
   `X-Kvrouter-Dp-Rank`). The rank the view says holds the longest prefix is shown beside
   it: cache_aware picks it unless that rank's cache is under pressure.

Then a summary table, and exit 0 when every check held (1 when one did not, 2 when the
cluster could not be started, 130 on Ctrl-C). `--keep-running` leaves the cluster up and
prints URLs to try. Every child process is stopped on every way out: normal exit, an error,
Ctrl-C or SIGTERM (and, on Linux, the children get SIGTERM if this process dies).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import itertools
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, TextIO

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from peer.fetch import SnapshotFetcher
from router.auth import TOKEN_ENV
from router.tokenize import BytesTokenizer, render_chat_plain
from router.tools import view as viewer

BLOCK_SIZE: Final = 16
PROBE_TOKEN: Final = 2  # the bytes tokenizer never produces it: probe blocks collide with nothing
WORKER_READY: Final = "fake-kv-worker listening on "
ROUTER_READY: Final = "kvrouter listening on "
START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 5.0
QUIESCE_TIMEOUT_S: Final = 15.0
POLL_S: Final = 0.05
BOOT_POLL_S: Final = 0.02  # a bootstrap lasts a fraction of a second: watch it closely
ROUTE_CHECKS: Final = 6
# Requests a rank runs at once; more wait in its queue (which the router sees as load), so a
# policy that piles requests onto a few ranks pays for it in time to first token.
WORKER_MAX_CONCURRENCY: Final = 2

_TOKENIZER = BytesTokenizer()


class DemoError(Exception):
    """The cluster could not be started or driven; the message is one line."""


@dataclass(slots=True)
class Options:
    workers: int = 4
    conversations: int = 24
    turns: int = 4
    system_prompts: int = 6
    concurrency: int = 6
    prefill_us_per_token: float = 50.0
    cache_blocks: int = 512
    max_tokens: int = 12
    seed: int = 7
    keep_running: bool = False
    log_dir: str | None = None


# -- child processes -----------------------------------------------------------------------


@functools.cache
def pdeathsig_preexec() -> Callable[[], None] | None:
    """Linux: a preexec_fn that has the child get SIGTERM when its parent dies, however it dies.

    prctl is looked up here, in the parent: between fork and exec the child may only call it
    (a dlopen there could deadlock on a lock another thread of the parent held at the fork).
    """
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    set_pdeathsig, sigterm = ctypes.c_int(1), ctypes.c_ulong(signal.SIGTERM)  # PR_SET_PDEATHSIG

    def preexec() -> None:  # pragma: no cover - runs in the child
        prctl(set_pdeathsig, sigterm)

    return preexec


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    # The demo configures its children itself: a KVROUTER_ variable in the caller's
    # environment (a token, a policy) must not change what it measures.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    return {**env, **extra}


def _open_log(path: Path) -> BinaryIO:
    return open(path, "wb")  # the caller's `with` closes it


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # on top of the demo's own, cleaned
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0

    async def start(self) -> None:
        with _open_log(self.log_path) as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=_child_env(self.env),
                start_new_session=True,  # Ctrl-C reaches the demo only; it stops the children
                preexec_fn=pdeathsig_preexec(),
            )
        self.started_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {line}" for line in text[-lines:])

    async def wait_line(self, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The rest of the first log line starting with `prefix` (the ready line)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError):
                for line in self.log_path.read_text(errors="replace").splitlines():
                    if line.startswith(prefix):
                        return line[len(prefix) :].strip()
            if self.proc.returncode is not None:
                raise DemoError(
                    f"{self.name} exited with status {self.proc.returncode} before it listened; "
                    f"its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise DemoError(f"{self.name} did not listen within {timeout_s:g} s")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


_handed_out: set[int] = set()


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports (each handed out once)."""
    for _ in range(200):
        held: list[socket.socket] = []
        try:
            first = socket.socket()
            held.append(first)
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            if base + count > 65536 or _handed_out.intersection(range(base, base + count)):
                continue
            for port in range(base + 1, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        _handed_out.update(range(base, base + count))
        return base
    raise DemoError(f"no {count} consecutive free ports on 127.0.0.1")


# Rows of the benchmarks that run a policy with a feature on: label -> (policy, extra flags).
POLICY_VARIANTS: Final = {"cache_aware+homes": ("cache_aware", {"prefix_homes": "true"})}


def base_policy(label: str) -> str:
    """The `--policy` a row label (a policy name or a `POLICY_VARIANTS` label) runs."""
    return POLICY_VARIANTS.get(label, (label, {}))[0]


def _flags(**values: object) -> list[str]:
    """`--flag-name value` pairs, in order."""
    out: list[str] = []
    for name, value in values.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


@dataclass(slots=True)
class Worker:
    label: str
    dp_size: int
    child: Child
    url: str = ""

    def rank_label(self, dp_rank: int) -> str:
        return f"{self.label}#{dp_rank}" if self.dp_size > 1 else self.label


@dataclass(slots=True)
class Router:
    name: str
    policy: str
    url: str
    child: Child
    peers: list[str] = field(default_factory=list)


class Cluster:
    """Every child the demo started; `stop_all` is safe to call any number of times."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.workers: list[Worker] = []
        # The routers' bearer token for /workers and /internal/*, new for every run; handed
        # over in the environment, not on a command line every local user can read.
        self.token = secrets.token_hex(16)

    def child(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        c = Child(name, argv, self.log_dir / f"{name}.log", env=env or {})
        self.children.append(c)
        return c

    async def stop_all(self) -> None:
        """Routers first (so their logs do not fill with workers going away), then workers."""
        workers = {id(w.child) for w in self.workers}
        for group in (
            [c for c in self.children if id(c) not in workers],
            [c for c in self.children if id(c) in workers],
        ):
            await asyncio.gather(*(c.stop() for c in group), return_exceptions=True)

    def rank_labels(self) -> dict[RankId, str]:
        return {RankId(w.url, r): w.rank_label(r) for w in self.workers for r in range(w.dp_size)}

    async def start_workers(self, opts: Options) -> None:
        for i in range(opts.workers):
            dp_size = 2 if i == opts.workers - 1 else 1
            flags = _flags(
                host="127.0.0.1",
                port=0,
                kv_port_base=free_ports(dp_size),
                replay_port_base=free_ports(dp_size),
                dp_size=dp_size,
                block_size=BLOCK_SIZE,
                cache_blocks=opts.cache_blocks,
                prefill_us_per_token=f"{opts.prefill_us_per_token:g}",
                max_concurrency=WORKER_MAX_CONCURRENCY,
                log_level="WARNING",
            )
            argv = [sys.executable, "-m", "fake_kv_worker", *flags]
            label = f"w{i + 1}"
            self.workers.append(Worker(label, dp_size, self.child(f"worker-{label}", argv)))
        await asyncio.gather(*(w.child.start() for w in self.workers))
        urls = await asyncio.gather(*(w.child.wait_line(WORKER_READY) for w in self.workers))
        for worker, url in zip(self.workers, urls, strict=True):
            worker.url = url

    def router(
        self, name: str, policy: str, peers: Sequence[str] = (), port: int | None = None
    ) -> Router:
        """A router child (not started yet); `port` when its siblings already know it.
        `policy` may name a `POLICY_VARIANTS` row."""
        port = free_ports(1) if port is None else port
        url = f"http://127.0.0.1:{port}"
        base, extra = POLICY_VARIANTS.get(policy, (policy, {}))
        flags = _flags(
            host="127.0.0.1",
            port=port,
            block_size=BLOCK_SIZE,
            policy=base,
            expose_route_headers="true",
            health_interval_s=0.5,
            load_interval_ms=250,
            drain_timeout_s=1,
            log_level="info",
            **extra,
        )
        argv = [sys.executable, "-m", "router.launch", "serve", *flags]
        for w in self.workers:
            argv += ["--worker", w.url]
        for peer in peers:
            argv += ["--peer", peer]
        child = self.child(f"router-{name}", argv, {TOKEN_ENV: self.token})
        return Router(name, policy, url, child, list(peers))

    async def start_routers(self, routers: Sequence[Router]) -> None:
        await asyncio.gather(*(r.child.start() for r in routers))
        await asyncio.gather(*(r.child.wait_line(ROUTER_READY) for r in routers))


# -- the workload --------------------------------------------------------------------------

_VOCABULARY: Final = (
    "account answer assistant billing careful customer data detail document escalate "
    "explain feature follow guideline helpful honest invoice issue knowledge limit "
    "manual order policy polite precise product question refund release request review "
    "safety service shipping step summary support system team technical ticket tone "
    "update user verify warranty workflow always never clearly briefly politely first "
    "then finally include avoid confirm describe mention provide check compare list "
    "offer"
)
_WORDS: Final = _VOCABULARY.split()
_ROLES: Final = (
    "a support agent for an online bookshop",
    "a coding assistant for a team that writes Python services",
    "a travel planner for a railway company",
    "a billing assistant for a mobile network",
    "a tutor for secondary-school physics",
    "a legal-intake assistant for a tenants' association",
    "an IT helpdesk agent for a hospital",
    "a product expert for a camera maker",
)


def _sentence(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _paragraph(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < chars:
        s = _sentence(rng, rng.randint(8, 18))
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


@dataclass(slots=True)
class Conversation:
    index: int
    system: str
    users: list[str]  # every user turn, the next ones included
    replies: list[str] = field(default_factory=list)  # what the fleet answered, so far
    busy: bool = False  # a request of this conversation is in flight

    def messages(self, turn: int) -> list[dict[str, str]]:
        """The request for `turn` (0-based): the system prompt and every earlier exchange."""
        out = [{"role": "system", "content": self.system}]
        for i in range(turn):
            out.append({"role": "user", "content": self.users[i]})
            out.append({"role": "assistant", "content": self.replies[i]})
        out.append({"role": "user", "content": self.users[turn]})
        return out


def make_workload(opts: Options, extra_turns: int) -> list[Conversation]:
    """Deterministic for a seed: the same conversations for every phase."""
    rng = random.Random(opts.seed)
    systems = []
    for i in range(opts.system_prompts):
        role = _ROLES[i % len(_ROLES)]
        systems.append(
            f"You are {role}. Follow these instructions in every answer.\n"
            + _paragraph(rng, rng.randint(1400, 2600))
        )
    conversations = []
    for c in range(opts.conversations):
        users = [
            _paragraph(rng, rng.randint(120, 420)) for _ in range(opts.turns + extra_turns + 1)
        ]
        conversations.append(Conversation(c, systems[c % len(systems)], users))
    return conversations


def prompt_tokens(messages: list[dict[str, str]]) -> list[int]:
    """What the router and the fake worker tokenize for a chat request (bytes tokenizer)."""
    return _TOKENIZER.encode(render_chat_plain(messages))  # type: ignore[arg-type]


# -- requests ------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    status: int
    ttft_s: float = 0.0
    text: str = ""
    worker: str = ""
    dp_rank: str = ""
    error: str = ""


async def chat(
    session: aiohttp.ClientSession,
    router_url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    stream: bool = True,
) -> Reply:
    """One chat completion; with `stream`, the time to the first SSE chunk is the TTFT."""
    body = {"model": "fake-model", "messages": messages, "max_tokens": max_tokens, "stream": stream}
    started = time.perf_counter()
    try:
        async with session.post(router_url + "/v1/chat/completions", json=body) as resp:
            reply = Reply(
                resp.status,
                worker=resp.headers.get("X-Kvrouter-Worker", ""),
                dp_rank=resp.headers.get("X-Kvrouter-Dp-Rank", ""),
            )
            if resp.status != 200:
                reply.error = (await resp.text())[:200]
                return reply
            if not stream:
                payload = await resp.json()
                reply.ttft_s = time.perf_counter() - started
                reply.text = payload["choices"][0]["message"]["content"]
                return reply
            pieces: list[str] = []
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                if not reply.ttft_s:
                    reply.ttft_s = time.perf_counter() - started
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = msgspec.json.decode(data)
                for choice in chunk.get("choices") or ():
                    pieces.append((choice.get("delta") or {}).get("content") or "")
            reply.text = "".join(pieces)
            return reply
    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        return Reply(0, error=f"{type(exc).__name__}: {exc}")


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self._last_draw = 0.0
        self._quarter = 0

    def advance(self) -> None:
        self.done += 1
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw >= 0.05 or self.done >= self.total:
                self._last_draw = now
                self._draw("\r")
        elif self.done * 4 >= (self._quarter + 1) * self.total:
            self._quarter = self.done * 4 // self.total
            self._draw("")
            self.stream.write("\n")
        self.stream.flush()

    def _draw(self, prefix: str) -> None:
        width = 30
        filled = width * self.done // self.total
        self.stream.write(
            f"{prefix}  {self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{self.done}/{self.total} requests"
        )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass(slots=True)
class PhaseResult:
    policy: str
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    per_rank: dict[RankId, int] = field(default_factory=dict)  # requests each rank served

    @property
    def ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft_ms(self) -> float:
        return 1000 * statistics.fmean(self.ttfts) if self.ttfts else 0.0

    def ttft_pct_ms(self, q: float) -> float:
        if not self.ttfts:
            return 0.0
        ordered = sorted(self.ttfts)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, slots=True)
class RankCounters:
    """One rank's counters in its worker's /control/state."""

    last_seq: int
    requests: int
    prompt_tokens: int
    cached_tokens: int


async def worker_counters(
    session: aiohttp.ClientSession, workers: Sequence[Worker]
) -> dict[RankId, RankCounters]:
    out: dict[RankId, RankCounters] = {}

    async def one(w: Worker) -> None:
        async with session.get(w.url + "/control/state") as resp:
            body = await resp.json()
        for rank in body["ranks"]:
            out[RankId(w.url, rank["dp_rank"])] = RankCounters(
                rank["last_seq"], rank["requests"], rank["prompt_tokens"], rank["cached_tokens"]
            )

    await asyncio.gather(*(one(w) for w in workers))
    return out


async def run_phase(
    session: aiohttp.ClientSession,
    cluster: Cluster,
    policy: str,
    routers: Sequence[Router],
    conversations: Sequence[Conversation],
    opts: Options,
) -> PhaseResult:
    """Every conversation, turn by turn, `concurrency` conversations at a time."""
    result = PhaseResult(policy)
    before = await worker_counters(session, cluster.workers)
    progress = Progress(policy, len(conversations) * opts.turns)
    slots = asyncio.Semaphore(opts.concurrency)
    started = time.monotonic()

    async def converse(conv: Conversation) -> None:
        async with slots:
            conv.replies.clear()
            for turn in range(opts.turns):
                # Each request to one replica of the pair in turn, as a load balancer would.
                router = routers[(conv.index + turn) % len(routers)]
                reply = await chat(session, router.url, conv.messages(turn), opts.max_tokens)
                result.requests += 1
                progress.advance()
                if reply.status != 200:
                    result.failed += 1
                    conv.replies.append("")
                    continue
                result.ttfts.append(reply.ttft_s)
                conv.replies.append(reply.text)

    try:
        await asyncio.gather(*(converse(c) for c in conversations))
    finally:
        progress.close()
    result.wall_s = time.monotonic() - started
    after = await worker_counters(session, cluster.workers)
    for rank, now in after.items():
        then = before.get(rank, RankCounters(0, 0, 0, 0))
        result.prompt_tokens += now.prompt_tokens - then.prompt_tokens
        result.cached_tokens += now.cached_tokens - then.cached_tokens
        result.per_rank[rank] = now.requests - then.requests
    return result


# -- observing replicas --------------------------------------------------------------------


async def readyz(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    """(/readyz status, reason); status 0 when it does not answer."""
    try:
        async with session.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            body = await resp.json(content_type=None)
            reason = body.get("reason", "") if isinstance(body, dict) else ""
            return resp.status, reason
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return 0, "not listening yet"


async def wait_ready(session: aiohttp.ClientSession, routers: Sequence[Router]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(routers)
    while pending:
        statuses = await asyncio.gather(*(readyz(session, r.url) for r in pending))
        pending = [r for r, (status, _) in zip(pending, statuses, strict=True) if status != 200]
        for r in pending:
            if not r.child.running:
                raise DemoError(f"router {r.name} exited; its log ends:\n{r.child.log_tail()}")
        if pending and time.monotonic() > deadline:
            raise DemoError(f"not ready within {START_TIMEOUT_S:g} s: {[r.name for r in pending]}")
        await asyncio.sleep(POLL_S)


async def metrics_of(session: aiohttp.ClientSession, url: str) -> dict[str, list[tuple]] | None:
    """name -> [(labels, value)] of the replica's kvrouter_kv_* series; None if unreachable."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    out: dict[str, list[tuple]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvrouter_kv_"):
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


_STATE_NAMES: Final = {0: "pending", 1: "recovered", 2: "failed"}


@dataclass(slots=True)
class BootstrapView:
    """What a joining replica's /readyz and /metrics say about its bootstrap."""

    ready_status: int = 0
    ready_reason: str = ""
    states: dict[str, str] = field(default_factory=dict)  # rank label -> state
    snapshots: dict[str, int] = field(default_factory=dict)  # fetch outcome -> count
    grafts: dict[str, int] = field(default_factory=dict)  # source -> ranks
    outcomes: dict[str, int] = field(default_factory=dict)  # rank outcome -> count
    duration_s: float | None = None

    def key(self) -> tuple:
        return (
            self.ready_status,
            self.ready_reason,
            tuple(sorted(self.states.items())),
            tuple(sorted(self.snapshots.items())),
            tuple(sorted(self.grafts.items())),
            tuple(sorted(self.outcomes.items())),
        )

    def describe(self) -> str:
        if self.ready_status == 0:
            return "starting (not listening yet)"
        ready = "200 ready" if self.ready_status == 200 else f"{self.ready_status}"
        if self.ready_reason:
            ready += f" ({self.ready_reason})"
        parts = [f"/readyz {ready}"]
        if self.states:
            by_state: dict[str, list[str]] = {}
            for label, state in sorted(self.states.items()):
                by_state.setdefault(state, []).append(label)
            parts.append(
                "ranks " + ", ".join(f"{s}: {' '.join(ls)}" for s, ls in sorted(by_state.items()))
            )
        if self.snapshots:
            parts.append("peer snapshots " + _counts(self.snapshots))
        if self.grafts:
            parts.append("grafted from " + _counts(self.grafts))
        if self.outcomes:
            parts.append("outcomes " + _counts(self.outcomes))
        return "; ".join(parts)


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


async def bootstrap_view(
    session: aiohttp.ClientSession, url: str, labels: dict[RankId, str]
) -> BootstrapView:
    out = BootstrapView()
    out.ready_status, out.ready_reason = await readyz(session, url)
    if out.ready_status == 0:
        return out
    metrics = await metrics_of(session, url) or {}
    for lbl, value in metrics.get("kvrouter_kv_bootstrap_state", []):
        rank = RankId(lbl.get("worker_url", ""), int(lbl.get("dp_rank", "0")))
        out.states[labels.get(rank, str(rank))] = _STATE_NAMES.get(int(value), str(value))
    for name, label, target in (
        ("kvrouter_kv_peer_snapshot_total", "outcome", out.snapshots),
        ("kvrouter_kv_bootstrap_grafts_total", "source", out.grafts),
        ("kvrouter_kv_bootstrap_rank_total", "outcome", out.outcomes),
    ):
        for lbl, value in metrics.get(name, []):
            if value:
                target[lbl.get(label, "?")] = int(value)
    for _, value in metrics.get("kvrouter_kv_bootstrap_duration_seconds", []):
        out.duration_s = value
    return out


async def quiesce(
    session: aiohttp.ClientSession,
    cluster: Cluster,
    replicas: Sequence[Router],
    workers: Sequence[Worker] | None = None,
    timeout_s: float = QUIESCE_TIMEOUT_S,
) -> dict[RankId, int]:
    """Wait until every replica's cursor for every rank of `workers` (the cluster's, unless
    given) reached the worker's last_seq."""
    counters = await worker_counters(session, cluster.workers if workers is None else workers)
    last = {rank: c.last_seq for rank, c in counters.items()}
    deadline = time.monotonic() + timeout_s
    async with SnapshotFetcher(token=cluster.token) as fetcher:
        while True:
            tables = await asyncio.gather(
                *(viewer.fetch_view(fetcher, session, r.url, cursors_only=True) for r in replicas)
            )
            behind = [
                f"{r.name} {rank}: {table.cursors.get(rank)} < {seq}"
                for r, table in zip(replicas, tables, strict=True)
                for rank, seq in last.items()
                if table.cursors.get(rank, -1) < seq
            ]
            if not behind:
                return last
            if time.monotonic() > deadline:
                raise DemoError(f"quiesce: cursors behind after {timeout_s:g} s: {behind}")
            await asyncio.sleep(POLL_S)


async def probe_every_rank(
    session: aiohttp.ClientSession, cluster: Cluster, workers: Sequence[Worker] | None = None
) -> None:
    """One BlockStored batch per rank of `workers` (the cluster's, unless given), a one-block
    chain of PROBE_TOKEN: the live gate."""
    chain = [PROBE_TOKEN] * BLOCK_SIZE

    async def one(w: Worker, dp_rank: int) -> None:
        body = {"token_chains": [chain], "dp_rank": dp_rank}
        async with session.post(w.url + "/control/store", json=body) as resp:
            if resp.status != 200:
                raise DemoError(f"/control/store on {w.rank_label(dp_rank)}: HTTP {resp.status}")

    targets = cluster.workers if workers is None else workers
    await asyncio.gather(*(one(w, r) for w in targets for r in range(w.dp_size)))


async def clear_caches(session: aiohttp.ClientSession, cluster: Cluster) -> None:
    async def one(w: Worker, dp_rank: int) -> None:
        async with session.post(w.url + "/control/clear", json={"dp_rank": dp_rank}) as resp:
            if resp.status != 200:
                raise DemoError(f"/control/clear on {w.rank_label(dp_rank)}: HTTP {resp.status}")

    await asyncio.gather(*(one(w, r) for w in cluster.workers for r in range(w.dp_size)))


def deepest_holder(tree: BlockTree, tokens: list[int]) -> tuple[RankId, int] | None:
    """The one rank holding the longest device-tier prefix of `tokens`, if exactly one does."""
    depths = tree.prefix_depths(block_keys(tokens, tree.block_size)).device
    if not depths:
        return None
    best = max(depths.values())
    holders = [rank for rank, depth in depths.items() if depth == best]
    return (holders[0], best) if len(holders) == 1 and best > 0 else None


# -- the demo ------------------------------------------------------------------------------


class Out:
    """Lines on stdout, flushed at once (the demo is watched as it runs)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.t0 = time.monotonic()

    def __call__(self, line: str = "") -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


@dataclass(slots=True)
class Checks:
    failed: list[str] = field(default_factory=list)

    def expect(self, ok: object, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return bool(ok)


@dataclass(slots=True)
class Joined:
    """How the third replica's bootstrap went."""

    router: Router
    ready_after_s: float
    boot: BootstrapView


class Demo:
    """The demo's steps, in the order `run` takes them; each prints what it did."""

    def __init__(self, opts: Options, out: Out, cluster: Cluster, hold: Hold) -> None:
        self.opts = opts
        self.out = out
        self.cluster = cluster
        self.hold = hold
        self.checks = Checks()
        self.conversations = make_workload(opts, extra_turns=8)
        self.labels: dict[RankId, str] = {}
        self.pairs: dict[str, list[Router]] = {}
        self.views: list[viewer.ReplicaView] = []

    async def run(self) -> int:
        started = time.monotonic()
        await self.start()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_ready(session, [*self.pairs["round_robin"], *self.pairs["cache_aware"]])
            self.show_cluster(started)
            results = await self.compare_policies(session)
            joined = await self.join_third(session)
            replicas = [*self.pairs["cache_aware"], joined.router]
            views_agree = await self.compare_views(session, replicas, joined)
            routed, same = await self.routing_check(session, replicas)
        self.summary(results, joined, views_agree, routed, same, time.monotonic() - started)
        if self.opts.keep_running:
            _print_try_it(self.out, self.cluster, replicas)
            await self.hold.wait()
        return 1 if self.checks.failed else 0

    async def start(self) -> None:
        opts, out, cluster = self.opts, self.out, self.cluster
        out(
            f"kvrouter demo: {opts.workers} fake workers ({opts.workers + 1} dp ranks, "
            f"{opts.cache_blocks} cache blocks each, {opts.prefill_us_per_token:g} us prefill "
            f"per uncached token), router replicas on 127.0.0.1; logs in {cluster.log_dir}"
        )
        await cluster.start_workers(opts)
        self.labels = cluster.rank_labels()
        for policy, prefix in (("round_robin", "rr"), ("cache_aware", "ca")):
            # A pair's ports are chosen together: each replica names the other as its peer.
            ports = free_ports(1), free_ports(1)
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            self.pairs[policy] = [
                cluster.router(f"{prefix}-a", policy, [urls[1]], ports[0]),
                cluster.router(f"{prefix}-b", policy, [urls[0]], ports[1]),
            ]
        await cluster.start_routers([*self.pairs["round_robin"], *self.pairs["cache_aware"]])

    def show_cluster(self, started: float) -> None:
        out = self.out
        for w in self.cluster.workers:
            out(f"  worker {w.label:<3} {w.url}  dp ranks {w.dp_size}")
        for pair in self.pairs.values():
            for r in pair:
                out(f"  router {r.name:<5} {r.url}  --policy {r.policy} --peer {r.peers[0]}")
        out(f"cluster ready in {time.monotonic() - started:.1f} s")

    async def compare_policies(self, session: aiohttp.ClientSession) -> list[PhaseResult]:
        opts, out = self.opts, self.out
        out()
        out(
            f"workload: {opts.conversations} conversations x {opts.turns} turns over "
            f"{opts.system_prompts} system prompts, {opts.concurrency} conversations at a time, "
            f"streamed chat completions ({opts.conversations * opts.turns} requests per policy)"
        )
        results: list[PhaseResult] = []
        for policy in ("round_robin", "cache_aware"):
            if results:
                await clear_caches(session, self.cluster)
                # The cache_aware pair applied the clear (and is live on every rank).
                await quiesce(session, self.cluster, self.pairs["cache_aware"])
                await asyncio.gather(*(r.child.stop() for r in self.pairs["round_robin"]))
                out("  worker caches cleared; round_robin pair stopped")
            result = await run_phase(
                session, self.cluster, policy, self.pairs[policy], self.conversations, opts
            )
            results.append(result)
            out(
                f"  {policy:<12} cached-token ratio {result.ratio:.3f} "
                f"({result.cached_tokens} of {result.prompt_tokens} prompt tokens), "
                f"mean TTFT {result.mean_ttft_ms:.1f} ms (p90 {result.ttft_pct_ms(0.9):.1f} ms), "
                f"{result.failed} failed, {result.wall_s:.1f} s"
            )
            spread = " ".join(
                f"{self.labels[r]}={n}" for r, n in _by_label(result.per_rank, self.labels)
            )
            out(f"  {'':<12} requests per rank: {spread}")
            self.checks.expect(result.failed == 0, f"{policy}: {result.failed} requests failed")
        rr, ca = results
        self.checks.expect(ca.ratio > rr.ratio, "cache_aware's cached-token ratio is not higher")
        return results

    async def join_third(self, session: aiohttp.ClientSession) -> Joined:
        """Start ca-c with both warm replicas as peers; show its bootstrap until it is ready."""
        out = self.out
        warm = self.pairs["cache_aware"]
        joining = self.cluster.router("ca-c", "cache_aware", [r.url for r in warm])
        out()
        out(
            f"third replica ca-c {joining.url}: kvrouter serve --policy cache_aware --peer "
            f"{warm[0].url} --peer {warm[1].url}, joining while traffic continues through "
            "ca-a and ca-b"
        )
        traffic_stop = asyncio.Event()
        traffic = asyncio.create_task(
            _background_traffic(session, warm, self.conversations, self.opts, traffic_stop)
        )
        try:
            await joining.child.start()
            ready_after, boot = await self._watch_bootstrap(session, joining)
        finally:
            traffic_stop.set()
            sent = await traffic
        duration = f"{boot.duration_s:.2f} s" if boot.duration_s is not None else "?"
        out(
            f"  ca-c ready {ready_after:.2f} s after it was started "
            f"(its own bootstrap gauge: {duration}); {sent} requests went to ca-a/ca-b meanwhile"
        )
        return Joined(joining, ready_after, boot)

    async def _watch_bootstrap(
        self, session: aiohttp.ClientSession, joining: Router
    ) -> tuple[float, BootstrapView]:
        """A line each time what /readyz and /metrics say changes, until /readyz is 200."""
        spawned = joining.child.started_at
        last_key: tuple | None = None
        while time.monotonic() < spawned + START_TIMEOUT_S:
            if not joining.child.running:
                raise DemoError(f"ca-c exited; its log ends:\n{joining.child.log_tail()}")
            boot = await bootstrap_view(session, joining.url, self.labels)
            if boot.key() != last_key:
                last_key = boot.key()
                self.out(f"  +{time.monotonic() - spawned:5.2f}s  {boot.describe()}")
            if boot.ready_status == 200:
                return time.monotonic() - spawned, boot
            await asyncio.sleep(BOOT_POLL_S)
        raise DemoError(f"ca-c was not ready within {START_TIMEOUT_S:g} s")

    async def compare_views(
        self, session: aiohttp.ClientSession, replicas: Sequence[Router], joined: Joined
    ) -> bool:
        """Live gate and quiesce, then `kvrouter view` over the three replicas."""
        out = self.out
        out()
        await probe_every_rank(session, self.cluster)
        last = await quiesce(session, self.cluster, replicas)
        seqs = ", ".join(f"{self.labels[r]}={s}" for r, s in _by_label(last, self.labels))
        out(
            "quiesce: one probe batch per rank, then every replica's cursor reached the "
            f"workers' last_seq ({seqs})"
        )
        joined.boot = await bootstrap_view(session, joined.router.url, self.labels)
        out(f"  ca-c bootstrap: {joined.boot.describe()}")
        if joined.boot.outcomes.keys() & {"abandoned", "uncovered"}:
            out(
                "  (abandoned/uncovered: the siblings held no block of that rank when asked, "
                "so it starts from the live stream, as they did)"
            )
        views = await viewer.collect([r.url for r in replicas], token=self.cluster.token)
        comparison = viewer.compare(views)
        status = viewer.exit_status(views, comparison)
        out(f"kvrouter view {' '.join(r.url for r in replicas)}  (exit {status})")
        for line in viewer.render(views, comparison):
            out(f"  {line}")
        self.views = views
        return self.checks.expect(status == 0, "the replicas' views differ")

    async def routing_check(
        self, session: aiohttp.ClientSession, replicas: Sequence[Router]
    ) -> tuple[int, int]:
        """The next turn of a few conversations, to every replica (the new one first).

        Before each request every replica has applied every batch (a quiesce), and the longest
        prefix is read from a fresh view of the first warm replica: each request caches its
        new turn, and on a full cache that evicts blocks, which can change which rank holds
        another prompt's longest prefix. A prompt whose longest prefix more than one rank
        holds is skipped, since the policy breaks such a tie at random.
        """
        out = self.out
        out()
        order = [replicas[-1], *replicas[:-1]]
        names = [r.name for r in order]
        out(
            f"routing: the next turn of up to {ROUTE_CHECKS} conversations, sent to every "
            f"replica ({', '.join(names)}; the new one first)"
        )
        out(
            f"  {'conv':<5} {'prompt':>7} {'longest prefix':<27} "
            + " ".join(f"{n:<8}" for n in names)
        )
        checked = same = 0
        for conv in self.conversations:
            if checked >= ROUTE_CHECKS:
                break
            messages = conv.messages(len(conv.replies))
            tokens = prompt_tokens(messages)
            await quiesce(session, self.cluster, replicas)
            [ref] = await viewer.collect([replicas[0].url], token=self.cluster.token)
            if ref.error is not None or ref.tree is None:
                raise DemoError(f"{replicas[0].name}: no view: {ref.error}")
            holder = deepest_holder(ref.tree, tokens)
            if holder is None:
                continue
            rank, depth = holder
            picks: list[RankId | None] = []
            for r in order:
                await quiesce(session, self.cluster, replicas)
                reply = await chat(session, r.url, messages, 1, stream=False)
                ok = reply.status == 200 and reply.dp_rank.isdigit()
                picks.append(RankId(reply.worker, int(reply.dp_rank)) if ok else None)
            checked += 1
            # The replicas must agree with each other. The longest prefix is shown for
            # reference only: under cache pressure cache_aware may send a prompt elsewhere
            # on purpose (its holder is full of blocks in demand), and says so here.
            all_same = None not in picks and len(set(picks)) == 1
            same += all_same
            expected = f"{self.labels.get(rank, str(rank))} ({depth} blocks)"
            shown = [self.labels.get(p, str(p)) if p is not None else "error" for p in picks]
            note = ""
            if not all_same:
                note = "  <- differs"
            elif picks[0] != rank:
                note = "  (not the longest prefix: its holder is under pressure)"
            out(
                f"  c{conv.index:<4} {len(tokens):>7} {expected:<27} "
                + " ".join(f"{s:<8}" for s in shown)
                + note
            )
        self.checks.expect(checked and same == checked, "the replicas routed differently")
        return checked, same

    def summary(
        self,
        results: list[PhaseResult],
        joined: Joined,
        views_agree: bool,
        routed: int,
        same: int,
        wall_s: float,
    ) -> None:
        out = self.out
        rr, ca = results
        out()
        out("summary")
        out(
            f"  {'policy':<12} {'requests':>8} {'cached-token ratio':>19} {'mean TTFT':>10} "
            f"{'p90 TTFT':>10}"
        )
        for r in results:
            out(
                f"  {r.policy:<12} {r.requests:>8} {r.ratio:>19.3f} "
                f"{r.mean_ttft_ms:>7.1f} ms {r.ttft_pct_ms(0.9):>7.1f} ms"
            )
        if rr.ratio and ca.mean_ttft_ms:
            out(
                f"  cache_aware: {ca.ratio / rr.ratio:.2f}x the cached tokens, "
                f"{rr.mean_ttft_ms / ca.mean_ttft_ms:.2f}x faster first tokens"
            )
        outcomes = _counts(joined.boot.outcomes) or "none yet"
        out(f"  third replica: ready in {joined.ready_after_s:.2f} s; rank outcomes {outcomes}")
        if joined.boot.outcomes.get("abandoned"):
            # A rank no sibling holds a block of (idle since the caches were cleared) has nothing
            # to inherit: it starts from its live stream, which is the right state, not a loss.
            out("  (abandoned: ranks no sibling held a block of; they start from the live stream)")
        n = len(self.pairs["cache_aware"]) + 1
        out(f"  views: {'equal' if views_agree else 'DIFFER'} across {n} replicas")
        out(f"  routing: {same}/{routed} prompts routed to the same rank by all {n} replicas")
        out(f"  wall time {wall_s:.1f} s")
        if self.checks.failed:
            out("FAILED: " + "; ".join(self.checks.failed))
        else:
            out("all checks passed")


async def _background_traffic(
    session: aiohttp.ClientSession,
    routers: Sequence[Router],
    conversations: Sequence[Conversation],
    opts: Options,
    stop: asyncio.Event,
) -> int:
    """Further turns of the conversations through the warm replicas, two at a time.

    Each conversation keeps its last user turn for the routing check; when every one has
    used up its turns the traffic ends early.
    """
    sent = 0
    order = itertools.cycle(conversations)

    def next_conversation() -> Conversation | None:
        for _ in range(len(conversations)):
            conv = next(order)
            if len(conv.replies) < len(conv.users) - 1 and not conv.busy:
                return conv
        return None

    async def lane() -> None:
        nonlocal sent
        while not stop.is_set():
            conv = next_conversation()
            if conv is None:
                return
            conv.busy = True
            try:
                router = routers[sent % len(routers)]
                messages = conv.messages(len(conv.replies))
                reply = await chat(session, router.url, messages, opts.max_tokens)
            finally:
                conv.busy = False
            conv.replies.append(reply.text if reply.status == 200 else "")
            sent += 1

    await asyncio.gather(lane(), lane())
    return sent


def _by_label(values: dict[RankId, int], labels: dict[RankId, str]) -> list[tuple[RankId, int]]:
    return sorted(values.items(), key=lambda item: labels.get(item[0], str(item[0])))


def _kvrouter_command() -> str:
    """How to run `kvrouter` from a shell: the script beside this interpreter (the venv's,
    which need not be on PATH), else the bare name."""
    script = Path(sys.executable).parent / "kvrouter"
    return str(script) if script.is_file() else "kvrouter"


def _print_try_it(out: Out, cluster: Cluster, replicas: Sequence[Router]) -> None:
    url = replicas[0].url
    out()
    out("the cluster keeps running; Ctrl-C stops it. Try:")
    body = (
        '{"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, '
        '"stream": false}'
    )
    out(f"  curl -si {url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'")
    out(f"  export {TOKEN_ENV}={cluster.token}    # this run's token for the admin and peer API")
    auth = f'-H "Authorization: Bearer ${TOKEN_ENV}"'
    out(f"  curl -s {auth} {url}/workers")
    out(f"  curl -s {url}/metrics | grep ^kvrouter_kv_bootstrap")
    out(f"  curl -s {auth} '{url}/internal/kv_snapshot?cursors_only=true'")
    out(f"  {_kvrouter_command()} view {' '.join(r.url for r in replicas)}")
    for w in cluster.workers:
        out(f"  curl -s {w.url}/control/state    # worker {w.label}")


# -- command line --------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = Options()
    p = sub.add_parser(
        "demo",
        help="run a local cluster: fake workers, router replicas, a bootstrapping replica",
        description="Start fake workers and router replicas on 127.0.0.1, compare round_robin "
        "with cache_aware on a shared-prefix chat workload, add a third replica that bootstraps "
        "from its siblings, and check that its view and its routing equal theirs.",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="fake workers (>= 2)")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument("--system-prompts", type=int, default=d.system_prompts)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="conversations at a time")
    p.add_argument("--prefill-us-per-token", type=float, default=d.prefill_us_per_token)
    p.add_argument(
        "--cache-blocks", type=int, default=d.cache_blocks, help="prefix cache per rank, in blocks"
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per reply")
    p.add_argument("--seed", type=int, default=d.seed, help="the workload's random seed")
    p.add_argument("--keep-running", action="store_true", help="leave the cluster up until Ctrl-C")
    p.add_argument(
        "--pools",
        type=int,
        default=1,
        help="2..8: instead, a fleet split into pools by model, each with its own router "
        "replicas behind a model-name route (router/tools/pools.py, docs/scaling.md)",
    )
    p.add_argument("--log-dir", default=None, help="keep the children's logs here")
    return p


def _options(args: argparse.Namespace) -> Options:
    opts = Options(
        workers=args.workers,
        conversations=args.conversations,
        turns=args.turns,
        system_prompts=args.system_prompts,
        concurrency=args.concurrency,
        prefill_us_per_token=args.prefill_us_per_token,
        cache_blocks=args.cache_blocks,
        max_tokens=args.max_tokens,
        seed=args.seed,
        keep_running=args.keep_running,
        log_dir=args.log_dir,
    )
    checks: list[tuple[bool, str]] = [
        (opts.workers >= 2, "--workers must be >= 2"),
        (opts.conversations >= 1, "--conversations must be >= 1"),
        (opts.turns >= 1, "--turns must be >= 1"),
        (opts.system_prompts >= 1, "--system-prompts must be >= 1"),
        (opts.concurrency >= 1, "--concurrency must be >= 1"),
        (opts.prefill_us_per_token >= 0, "--prefill-us-per-token must be >= 0"),
        (opts.cache_blocks >= 1, "--cache-blocks must be >= 1"),
        (opts.max_tokens >= 1, "--max-tokens must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise DemoError(message)
    return opts


@dataclass(slots=True)
class Hold:
    """`--keep-running`: the demo waits here, after its checks, until a signal ends it."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: bool = False

    async def wait(self) -> None:
        self.waiting = True
        await self.event.wait()


async def _main(opts: Options, log_dir: Path) -> int:
    """Run the demo; whatever happens, stop every child before returning."""
    cluster = Cluster(log_dir)
    hold = Hold()
    task = asyncio.current_task()
    assert task is not None
    interrupted = False
    shutting_down = False

    def on_signal() -> None:
        nonlocal interrupted
        if shutting_down:
            return  # the children are being stopped already; a second Ctrl-C changes nothing
        if hold.waiting:
            hold.event.set()  # --keep-running: a signal is the normal end
        else:
            interrupted = True
            task.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    status = 2
    try:
        status = await Demo(opts, Out(), cluster, hold).run()
    except asyncio.CancelledError:
        if not interrupted:
            raise
        status = 130
    except (DemoError, aiohttp.ClientError, OSError) as exc:
        sys.stderr.write(f"kvrouter demo: error: {exc}\n")
        status = 2
    finally:
        shutting_down = True
        await cluster.stop_all()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if interrupted:
            sys.stderr.write("kvrouter demo: interrupted; every child process is stopped\n")
        if status == 0 and not opts.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not opts.log_dir:
            sys.stderr.write(f"kvrouter demo: the children's logs are kept in {log_dir}\n")
    return status


def make_log_dir(given: str | None, prefix: str) -> Path | None:
    """`--log-dir` made (or a new temporary directory named `prefix`...); None, the error
    said in one line, when it cannot be made."""
    if not given:
        return Path(tempfile.mkdtemp(prefix=prefix))
    try:
        Path(given).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        sys.stderr.write(f"kvrouter: error: --log-dir {given}: {exc.strerror or exc}\n")
        return None
    return Path(given)


def run(args: argparse.Namespace) -> int:
    """`kvrouter demo`: returns the exit status."""
    try:
        opts = _options(args)
    except DemoError as exc:
        sys.stderr.write(f"kvrouter: error: {exc}\n")
        return 2
    log_dir = make_log_dir(opts.log_dir, "kvrouter-demo-")
    if log_dir is None:
        return 2
    return asyncio.run(_main(opts, log_dir))
