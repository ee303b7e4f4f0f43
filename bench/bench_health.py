"""`/healthz` and `/readyz` latency while the data plane is saturated, against idle.

Run: .venv/bin/python bench/bench_health.py [--requests 4000] [--concurrency 64]
     [--targets kvrouter-asyncio,kvrouter-uvloop,smg] [--rounds 3]
     [--baseline REV --targets old-uvloop,kvrouter-uvloop,...]

What runs, per target in turn (fresh workers each): 2 fake workers and one router in front
(`kvrouter serve` cache_aware on the given event loop, as `bench_proxy.py` starts it, or smg
cache_aware, whose probes are `/health` and `/readiness`), and two load sources, each its own
process so neither one's work delays the other's stamps: a prober that opens a NEW connection
for every probe (as a kubelet does), alternating the liveness and the readiness path, one
every 10 ms, and this process, which saturates the router with `bench_proxy.py`'s 2,000-token
completions at `--concurrency`. Rounds alternate idle (probes only) and saturated (probes +
load), so drift hits both. Probe latency is from connect to the last byte of the answer,
stamped with CLOCK_MONOTONIC in the prober.

Target (issue 11): `/healthz` and `/readyz` p99 under 50 ms while the data plane is saturated.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import bench_proxy as bp  # noqa: E402

TARGET_P99_MS = 50.0


# -- the prober (a child process) ------------------------------------------------------------


def probe_forever(url: str, every_ms: float, paths: tuple[bytes, bytes]) -> None:
    """Probe until stdin closes; then print [[t, path, ms, status], ...] as JSON."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    samples = []
    stop = False

    def watch_stdin() -> None:
        nonlocal stop
        sys.stdin.read()
        stop = True

    threading.Thread(target=watch_stdin, daemon=True).start()
    print("ready", flush=True)
    n = 0
    while not stop:
        path = paths[n % 2]
        n += 1
        t0 = time.monotonic()
        status = 0
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(b"GET %s HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n" % path)
                answer = b""
                while data := sock.recv(65536):
                    answer += data
                status = int(answer[9:12])
        except (OSError, ValueError):
            status = -1
        t1 = time.monotonic()
        samples.append([t0, ("live", "ready")[n % 2 == 0], (t1 - t0) * 1000, status])
        time.sleep(max(0.0, every_ms / 1000 - (t1 - t0)))
    print(json.dumps(samples), flush=True)


# -- the parent ------------------------------------------------------------------------------


def stats(values: Sequence[float]) -> str:
    if not values:
        return "no samples"
    return (
        f"n={len(values)} p50 {bp.percentile(values, 50):.2f} p99 {bp.percentile(values, 99):.2f} "
        f"max {max(values):.2f} ms"
    )


def runqueue_wait_s(pid: int) -> float:
    """Time the process's threads spent runnable but not running (waiting for a core)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with (
            contextlib.suppress(FileNotFoundError),
            open(f"/proc/{pid}/task/{task}/schedstat") as f,
        ):
            total += int(f.read().split()[1])
    return total / 1e9


async def load(
    args: argparse.Namespace, url: str, ready_path: str, pid: int
) -> tuple[list[tuple[str, float, float]], list[float], list[float]]:
    """Idle and saturated windows in turn; returns them, each round's req/s, and the share of
    each saturated window the router spent waiting for a core."""
    prompts = bp.Prompts()
    windows: list[tuple[str, float, float]] = []
    throughput: list[float] = []
    waiting: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async with asyncio.timeout(60):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + ready_path) as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.05)
        await bp.warm_up(session, url, prompts, args)
        target = url + "/v1/completions"
        per_round = args.requests // args.rounds
        for r in range(args.rounds):
            t0 = time.monotonic()
            await asyncio.sleep(args.idle_s)
            windows.append(("idle", t0, time.monotonic()))
            t0, w0 = time.monotonic(), runqueue_wait_s(pid)
            res = await bp.run_load(
                session, lambda i: target, prompts.bodies(per_round), args.concurrency
            )
            t1 = time.monotonic()
            waiting.append((runqueue_wait_s(pid) - w0) / (t1 - t0))
            windows.append(("saturated", t0, t1))
            throughput.append(res.requests / (t1 - t0))
            bp.log(f"round {r + 1}: {res.requests / (t1 - t0):.0f} req/s, {res.errors} errors")
    return windows, throughput, waiting


PROBES = {"kvrouter": (b"/healthz", b"/readyz"), "smg": (b"/health", b"/readiness")}


def measure(args: argparse.Namespace, children: bp.Children, target: str) -> None:
    workers = bp.start_workers(children, args, target)
    port = bp.free_port()
    urls = [w.url for w in workers]
    router_kind, _, event_loop = target.partition("-")
    if router_kind == "smg":
        from bench.smg import from_environment, launch_argv

        smg = from_environment()
        if not smg.ensure(bp.log):
            bp.log(f"smg left out: {smg.reason}")
            return
        assert smg.binary is not None
        argv = launch_argv(smg.binary, port, bp.free_port(), urls, "cache_aware")
        router, _ = children.spawn(target, argv)
        router.url = f"http://127.0.0.1:{port}"
    else:
        code = args.old if router_kind == "old" else None
        command, env = bp.Target("kvrouter", "cache_aware", code=code).kvrouter_command()
        argv = [*command, *bp.router_args(port, urls, "cache_aware", event_loop)]
        router = children.start(target, argv, "kvrouter listening on ", env=env)
    bp.log(f"[{target}] started: {' '.join(argv)}")
    paths = PROBES["smg" if router_kind == "smg" else "kvrouter"]
    prober = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--probe",
            router.url,
            "--every-ms",
            str(args.every_ms),
            "--paths",
            ",".join(p.decode() for p in paths),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert prober.stdin is not None and prober.stdout is not None
    prober.stdout.readline()  # "ready"
    try:
        windows, throughput, waiting = asyncio.run(
            load(args, router.url, paths[1].decode(), router.proc.pid)
        )
    finally:
        prober.stdin.close()
        samples = json.loads(prober.stdout.read() or "[]")
        prober.wait()
    children.stop(router, signal.SIGTERM)
    for w in workers:
        children.stop(w, signal.SIGTERM)
    report(args, target, paths, samples, windows, throughput, waiting)


def report(
    args: argparse.Namespace,
    target: str,
    paths: tuple[bytes, bytes],
    samples: list[list],
    windows: list[tuple[str, float, float]],
    throughput: list[float],
    waiting: list[float],
) -> None:
    print(
        f"\n{target}: a new connection per probe every {args.every_ms:g} ms; saturated = "
        f"{args.concurrency} clients sending 2,000-token completions back to back (median "
        f"{statistics.median(throughput):.0f} req/s over {args.rounds} rounds; the router's "
        f"threads waited for a core {statistics.median(waiting):.0%} of that time, machine "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\n"
    )
    print("| router | path | state | probes | p50 ms | p99 ms | max ms | failed |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    verdicts = []
    for kind, path in zip(("live", "ready"), paths, strict=True):
        for state in ("idle", "saturated"):
            inside = [
                (ms, status)
                for t, k, ms, status in samples
                if k == kind and any(s == state and a <= t < b for s, a, b in windows)
            ]
            lat = [ms for ms, _ in inside]
            failed = sum(1 for _, status in inside if status != 200)
            p99 = bp.percentile(lat, 99)
            print(
                f"| {target} | {path.decode()} | {state} | {len(lat)} | "
                f"{bp.percentile(lat, 50):.2f} | {p99:.2f} | "
                f"{max(lat) if lat else float('nan'):.2f} | {failed} |"
            )
            if state == "saturated":
                verdict = "met" if p99 < TARGET_P99_MS else "NOT met"
                verdicts.append(f"{path.decode()} p99 {p99:.1f} ms ({verdict})")
    print(f"\n{target}: p99 under {TARGET_P99_MS:g} ms while saturated: " + "; ".join(verdicts))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--every-ms", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cache-blocks", type=int, default=100_000)
    parser.add_argument("--paths", default="/healthz,/readyz", help=argparse.SUPPRESS)
    parser.add_argument(
        "--targets",
        default="kvrouter-asyncio,kvrouter-uvloop,smg",
        help="comma-separated: kvrouter-asyncio, kvrouter-uvloop, smg, and with --baseline "
        "old-asyncio, old-uvloop (kvrouter at that revision)",
    )
    parser.add_argument("--baseline", help="the git revision the old-* targets run")
    args = parser.parse_args(argv)
    if args.probe:
        live, ready = args.paths.encode().split(b",")
        probe_forever(args.probe, args.every_ms, (live, ready))
        return
    children = bp.Children()
    try:
        with tempfile.TemporaryDirectory(prefix="health-") as tmp:
            args.old = bp.checkout(args.baseline, Path(tmp) / "old") if args.baseline else None
            for target in args.targets.split(","):
                if target.startswith("old") and args.old is None:
                    parser.error(f"target {target} needs --baseline REV")
                measure(args, children, target)
    finally:
        children.stop_all()


if __name__ == "__main__":
    main()
