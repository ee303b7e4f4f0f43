"""`kvrouter` command line.

Every `serve` flag also reads an environment variable, `KVROUTER_` plus the flag name in upper
case with dashes as underscores (`--block-size` <- `KVROUTER_BLOCK_SIZE`); a flag on the
command line wins. Repeatable flags take a comma-separated list from the environment.
Invalid values stop the command at start with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, NoReturn

from aiohttp import web

from router.app import REPLICA, ServeConfig, build_app
from router.policy import POLICY_NAMES

log = logging.getLogger("kvrouter")


def _env(name: str) -> str:
    return "KVROUTER_" + name.upper().replace("-", "_")


class _Flags:
    """Adds flags whose defaults come from the environment, remembering how to parse them."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(
        self,
        name: str,
        kind: Callable[[str], Any],
        default: Any,
        help: str,
        *,
        repeat: bool = False,
        choices: Sequence[str] | None = None,
    ) -> None:
        env = _env(name)
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = [kind(v) for v in raw.split(",") if v] if repeat else kind(raw)
            except ValueError:
                _fail(f"{env}={raw!r} is not a valid value for --{name}")
        self.parser.add_argument(
            f"--{name}",
            type=kind,
            default=default,
            action="append" if repeat else "store",
            choices=choices,
            help=f"{help} [env {env}; default {default!r}]",
        )


def _flag_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run one router replica")
    f = _Flags(p)
    f.add("host", str, "0.0.0.0", "listen address")
    f.add("port", int, 8080, "listen port")
    f.add("worker", str, [], "a worker base URL (repeatable)", repeat=True)
    f.add("policy", str, "cache_aware", "routing policy", choices=POLICY_NAMES)
    f.add("block-size", int, 0, "KV block size of the fleet; 0 learns it from the first worker")
    f.add("tokenizer", str, "bytes", "'bytes', or a tokenizer.json / model directory (hf extra)")
    f.add(
        "kv-events-port-base", int, 5557, "KV-event PUB port of rank 0 when /server_info has none"
    )
    f.add("kv-events-replay-port-base", int, 0, "replay ROUTER port of rank 0; 0 = no replay")
    f.add("dp-size", int, 1, "data-parallel ranks per worker when /server_info has none")
    f.add("load-interval-ms", int, 500, "how often engine load is polled")
    f.add("health-interval-s", float, 2.0, "how often each worker's /health is polled")
    f.add("max-request-bytes", int, 32 * 1024 * 1024, "largest request body accepted")
    f.add("max-attempts", int, 3, "upstream attempts per request, failovers included")
    f.add("breaker-failure-threshold", int, 3, "consecutive failures that open a breaker; 0 = off")
    f.add("breaker-cooldown-s", float, 5.0, "first open period of a breaker")
    f.add("breaker-max-cooldown-s", float, 60.0, "longest open period (cooldown doubles)")
    f.add("expose-route-headers", _flag_bool, False, "add X-Kvrouter-Worker/-Dp-Rank to responses")
    f.add("internal-token", str, "", "bearer token required by /workers and /internal/*")
    f.add("drain-timeout-s", float, 30.0, "after SIGTERM, how long in-flight requests may run")
    f.add("log-level", str, "info", "debug, info, warning or error")


def _config(args: argparse.Namespace) -> ServeConfig:
    checks = [
        (1 <= args.port <= 65535, "--port must be 1..65535"),
        (args.block_size >= 0, "--block-size must be >= 1, or 0 to learn it"),
        (args.dp_size >= 1, "--dp-size must be >= 1"),
        (args.max_attempts >= 1, "--max-attempts must be >= 1"),
        (args.breaker_failure_threshold >= 0, "--breaker-failure-threshold must be >= 0"),
        (
            0 < args.breaker_cooldown_s <= args.breaker_max_cooldown_s,
            "--breaker-cooldown-s must be > 0 and <= --breaker-max-cooldown-s",
        ),
        (args.load_interval_ms > 0, "--load-interval-ms must be > 0"),
        (args.max_request_bytes > 0, "--max-request-bytes must be > 0"),
        (args.drain_timeout_s >= 0, "--drain-timeout-s must be >= 0"),
        (args.kv_events_port_base + args.dp_size - 1 <= 65535, "--kv-events-port-base too high"),
    ]
    for ok, message in checks:
        if not ok:
            _fail(message)
    for url in args.worker:
        if not url.startswith(("http://", "https://")):
            _fail(f"--worker {url!r} is not an http(s) URL")
    known = {f.name for f in fields(ServeConfig)}
    values = {k: v for k, v in vars(args).items() if k in known}
    values["workers"] = list(args.worker)
    values["block_size"] = args.block_size or None
    values["internal_token"] = args.internal_token or None
    return ServeConfig(**values)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"kvrouter: error: {message}\n")
    raise SystemExit(2)


async def serve(config: ServeConfig, ready: Callable[[str], None] | None = None) -> None:
    app = build_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    replica = app[REPLICA]
    port = runner.addresses[0][1] if runner.addresses else config.port
    url = f"http://{config.host}:{port}"
    log.info("kvrouter listening on %s (policy %s)", url, config.policy)
    print(f"kvrouter listening on {url}", flush=True)
    if ready is not None:
        ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    replica.draining = True
    log.info(
        "draining: /readyz is 503; waiting up to %.0fs for in-flight requests",
        config.drain_timeout_s,
    )
    if not await replica.inflight.wait_idle(config.drain_timeout_s):
        log.warning("drain timeout: %d request(s) still in flight are cut", replica.inflight.total)
    await runner.cleanup()
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvrouter", description="cache-aware LLM router")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        config = _config(args)
        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        try:
            asyncio.run(serve(config))
        except ValueError as exc:  # e.g. a tokenizer that cannot load
            _fail(str(exc))


if __name__ == "__main__":
    main()
