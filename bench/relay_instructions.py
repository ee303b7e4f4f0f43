"""Instructions per request in the data plane, counted by callgrind: repeatable figures.

Run: .venv/bin/python -m bench.relay_instructions [--target round_robin|floor ...]
     [--baseline REV] [--requests 1500] [--concurrency 32] [--event-loop auto|asyncio|uvloop]
     [--workload same|proxy]
Needs valgrind. Prints figures; asserts nothing. Takes a few minutes per target.

Router CPU per request at c=32 (`bench/proxy_ab.py`) moves by 10-20% between rounds on a
shared machine, more than most changes to the data plane are worth. Here the router runs in
this process under callgrind, which counts the instructions it executes instead: with string
hashing seeded, the count barely moves run to run, whatever else the machine does.

What runs, per target: two `fake-kv-worker` processes (not traced: valgrind follows only this
process), then in this process a replica (`router.serving.start_serving`, the target's policy,
the `bytes` tokenizer, block size 16, load and health polls slowed to once an hour so they do
not run during the count, the garbage collector tuned as `kvrouter serve` tunes it), or the
bare relay (`bench/relay_floor.py`: the data plane with no routing work), either with its
routing slice never spent (see `child`), and a small client on `--concurrency` keep-alive
connections sending the proxy benchmark's request (a non-streaming `/v1/completions` with a
2,000-byte prompt, `max_tokens: 1`) back to back. Each target runs twice, with `--requests`
and with twice as many; the difference divided by `--requests` is the figure, so start-up,
warm-up and shutdown cancel out. The client and the event loop are in the count (the same for
any version of the data plane); the workers and the kernel are not.

`--workload proxy` sends the proxy benchmark's prompts instead of one request over and over:
each a new 1,000-token tail below one of 8 shared 1,000-token system prompts
(`bench_proxy.Prompts`), so every request stores 63 new blocks on its worker, whose KV events
the replica ingests in this process: the count is then routing, relay and ingest together,
as `bench/proxy_compare.py` measures a cache_aware replica (caches not full). The bodies are
made by the parent and read from a file, so making them is not counted.

`--baseline REV` also counts another commit's router (extracted with `git archive`, its C
extensions compiled, as `bench/proxy_ab.py` does), each target old and new in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httptools

from bench.bench_proxy import free_port
from router.cli import _tune_gc as tune_gc
from router.tools.demo import pdeathsig_preexec

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
BLOCK_SIZE = 16
WARMUP = 200  # requests before the count


def request_bytes(
    # The fake workers' served model: any other name is keyed as an adapter's (a miss).
    body: bytes = b'{"model":"fake-model","max_tokens":1,"prompt":"' + b"a" * 2000 + b'"}',
) -> bytes:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return head + body


def proxy_requests(n: int) -> list[bytes]:
    """The proxy benchmark's first `n` requests (`--workload proxy`)."""
    from bench.bench_proxy import Prompts

    return [request_bytes(body) for body in Prompts().bodies(n)]


class Load:
    """`requests` requests over keep-alive connections, each sent when the one before it on
    its connection is answered; `done` once every one is answered. The requests are taken in
    turn from `REQUESTS` (one, or the proxy workload's)."""

    def __init__(self, requests: int, done: asyncio.Future[None]) -> None:
        self.unsent = requests
        self.unanswered = requests
        self.done = done

    def fail(self, why: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(why))


class Client(asyncio.Protocol):
    def __init__(self, load: Load) -> None:
        self.load = load
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._next()

    def _next(self) -> None:
        load = self.load
        if load.unsent > 0:
            load.unsent -= 1
            assert self.transport is not None
            self.transport.write(next(REQUESTS))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_message_complete(self) -> None:
        load = self.load
        if self.status != 200:
            load.fail(f"status {self.status}")
        load.unanswered -= 1
        if load.unanswered == 0 and not load.done.done():
            load.done.set_result(None)
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.load.unanswered:
            self.load.fail(f"connection lost: {exc}")


async def load(port: int, requests: int, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    work = Load(requests, done)
    conns = [
        await loop.create_connection(lambda: Client(work), "127.0.0.1", port)
        for _ in range(concurrency)
    ]
    try:
        await done
    finally:
        for transport, _ in conns:
            transport.close()


def start_workers(
    count: int, cache_blocks: int = 200_000
) -> tuple[list[subprocess.Popen[str]], list[str]]:
    procs, urls = [], []
    for _ in range(count):
        argv = [
            str(BIN / "fake-kv-worker"),
            *("--host", "127.0.0.1", "--port", "0", "--kv-port-base", str(free_port())),
            *("--block-size", str(BLOCK_SIZE), "--cache-blocks", str(cache_blocks)),
            *("--prefill-us-per-token", "0", "--decode-ms-per-token", "0"),
            *("--log-level", "WARNING"),
        ]
        # valgrind must not follow the workers: they start from a clean environment. They
        # stop with this process however it ends: killed, it runs no `finally`.
        env = {k: v for k, v in os.environ.items() if not k.startswith("LD_PRELOAD")}
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=pdeathsig_preexec()
        )
        procs.append(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            if "listening on " in line:
                urls.append(line.split("listening on ", 1)[1].strip())
                break
        else:
            raise RuntimeError("a fake worker exited before it listened")
    return procs, urls


async def run_target(target: str, urls: list[str], requests: int, concurrency: int) -> None:
    """The target's server in this process, warmed, then `requests` counted requests. It is
    left running: shut down, a replica clears each departing worker's rank node by node,
    which grows with the index, and the proxy workload's index grows with the count (a
    doubled count would count a doubled teardown). The process exits instead (`child`)."""
    if target == "floor":
        from bench.relay_floor import start

        plane, _control = await start("127.0.0.1", 0, urls)  # bound: both serve until exit
        port = plane.addresses[0][1]
    else:
        from router.cli import parse_args, serve_config
        from router.serving import start_serving

        argv = ["serve", "--host", "127.0.0.1", "--port", str(free_port()), "--policy", target]
        argv += ["--block-size", str(BLOCK_SIZE), "--log-level", "warning"]
        argv += ["--load-interval-ms", "3600000", "--health-interval-s", "3600"]
        for url in urls:
            argv += ["--worker", url]
        serving = await start_serving(serve_config(parse_args(argv)))
        port = serving.plane.addresses[0][1]
        # Polled: the registry has no hook for "registered", and start-up is not counted.
        while len(serving.replica.workers.routable()) < len(urls):  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    # The collector tuned as `kvrouter serve` tunes it (start-up objects frozen, a larger
    # young generation). Untuned, a full collection walks the whole replica once every few
    # thousand requests, tens of millions of instructions that land in one count or not.
    tune_gc()
    await load(port, WARMUP, concurrency)  # warm-up: connections, pools, caches
    await load(port, requests, concurrency)


REQUESTS: Iterator[bytes] = itertools.repeat(request_bytes())


def child(
    target: str, requests: int, concurrency: int, event_loop: str, bodies: str | None
) -> None:
    import router.dataplane.server as server
    from router.cli import loop_factory

    # Under valgrind a request runs ~50 times slower, so the routing slice (the routing time
    # one loop turn may spend) held a few requests and deferred the rest to later turns, a
    # share that followed the wall clock: the same code counted 2-5% apart from run to run.
    # Live, a turn at c=32 routes its requests well inside the slice; here it is never spent.
    server.ROUTING_SLICE_S = float("inf")
    global REQUESTS
    if bodies:
        REQUESTS = iter(Path(bodies).read_bytes().split(SEPARATOR))

    procs, urls = start_workers(2)
    try:
        with asyncio.Runner(loop_factory=loop_factory(event_loop)) as runner:
            runner.run(run_target(target, urls, requests, concurrency))
            for proc in procs:
                proc.terminate()
                proc.wait(10)
            os._exit(0)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


SEPARATOR = b"\0"  # between the requests of a bodies file: never in a JSON body


def instructions(
    target: str, requests: int, concurrency: int, event_loop: str, code: Path, workload: str
) -> int:
    """Instructions callgrind counted for one child run of this script, on `code`'s router."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        argv += [sys.executable, __file__, "--child", target]
        argv += ["--requests", str(requests), "--concurrency", str(concurrency)]
        argv += ["--event-loop", event_loop]
        if workload == "proxy":
            bodies = Path(tmp) / "bodies"
            # The warm-up's and the count's, with concurrency to spare at the end.
            bodies.write_bytes(SEPARATOR.join(proxy_requests(WARMUP + requests + concurrency)))
            argv += ["--bodies", str(bodies)]
        # The script runs by its path, so `code` on PYTHONPATH is where `router` and
        # `bench.relay_floor` come from. A fixed string-hash seed: the same count each run.
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(code)}
        # Ctrl-C here kills the child (subprocess.run), which then takes its workers along.
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=True,
            env=env,
            preexec_fn=pdeathsig_preexec(),
        )
        found = re.search(r"Collected : (\d+)", done.stderr)
        if found is None:
            raise RuntimeError(f"callgrind printed no total for {target}:\n{done.stderr[-2000:]}")
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", help="round_robin (a policy) or floor")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--baseline", help="also count this git revision's code")
    parser.add_argument(
        "--workload",
        choices=("same", "proxy"),
        default="same",
        help="one request over and over, or the proxy benchmark's prompts (ingest included)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bodies", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.requests, args.concurrency, args.event_loop, args.bodies)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("relay_instructions: valgrind is not installed (apt install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"new" if args.baseline else "": HERE.parent}
        if args.baseline:
            from bench.bench_proxy import checkout

            codes[f"@{args.baseline}"] = checkout(args.baseline, Path(tmp) / "old")
        for target in args.target or ["round_robin", "floor"]:
            for tag, code in codes.items():
                n = args.requests
                run = (args.concurrency, args.event_loop, code, args.workload)
                once = instructions(target, n, *run)
                twice = instructions(target, 2 * n, *run)
                label = f"{target} {tag}".strip()
                print(f"{label}: {(twice - once) / n:,.0f} instructions per request", flush=True)


if __name__ == "__main__":
    main()
