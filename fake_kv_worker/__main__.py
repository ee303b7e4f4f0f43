"""`fake-kv-worker`: run a GPU-free engine that serves requests and publishes real KV events.

Once HTTP is bound it prints one line to stdout, `fake-kv-worker listening on <url>`, which
test harnesses read to learn the port when started with `--port 0`. SIGTERM or SIGINT stop it
cleanly: every rank's stream ends with END_SEQ and the exit status is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import zmq

from fake_kv_worker.config import ENGINES, WorkerConfig
from fake_kv_worker.server import FakeWorker
from fake_kv_worker.wire import WIRE_FLAVOURS

log = logging.getLogger("fake_kv_worker")

READY_LINE_PREFIX = "fake-kv-worker listening on "


def parse_args(argv: list[str] | None = None) -> tuple[WorkerConfig, str]:
    """The worker's config and the log level from a command line (exits on bad input)."""
    defaults = WorkerConfig()
    p = argparse.ArgumentParser(
        prog="fake-kv-worker",
        description="A GPU-free LLM engine with a simulated prefix cache that publishes "
        "vLLM/SGLang KV events over ZMQ.",
    )
    p.add_argument("--host", default=defaults.host, help="HTTP and ZMQ bind address")
    p.add_argument("--port", type=int, default=defaults.port, help="HTTP port (0: any free)")
    p.add_argument(
        "--kv-port-base",
        type=int,
        default=defaults.kv_port_base,
        help="ZMQ PUB port of dp rank 0; rank r uses base + r",
    )
    p.add_argument("--dp-size", type=int, default=defaults.dp_size)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=defaults.cache_blocks,
        help="prefix-cache capacity per rank, in blocks",
    )
    p.add_argument(
        "--wire",
        choices=sorted(WIRE_FLAVOURS),
        default=defaults.wire,
        help="KV-event wire format and block hash scheme",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="whose /metrics names to serve (default: the wire's engine)",
    )
    p.add_argument(
        "--replay-port-base",
        type=int,
        default=defaults.replay_port_base,
        help="ZMQ ROUTER replay port of dp rank 0 (0: no replay)",
    )
    p.add_argument("--prefill-us-per-token", type=float, default=defaults.prefill_us_per_token)
    p.add_argument("--decode-ms-per-token", type=float, default=defaults.decode_ms_per_token)
    p.add_argument(
        "--tokenizer",
        default=defaults.tokenizer,
        help="'bytes', or a model directory rendered and tokenized as --engine's chat server "
        "does (needs transformers)",
    )
    p.add_argument(
        "--startup-delay-s",
        type=float,
        default=defaults.startup_delay_s,
        help="/health answers 503 for this long after start",
    )
    p.add_argument("--serve-kv-snapshot", action="store_true", help="serve GET /v1/kv-snapshot")
    p.add_argument(
        "--fail-first",
        type=int,
        default=defaults.fail_first,
        metavar="N",
        help="fail the first N generation requests with 503",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=defaults.max_concurrency,
        metavar="N",
        help="running requests per rank; more wait in a queue (0: unlimited)",
    )
    p.add_argument("--topic", default=defaults.topic)
    p.add_argument("--model", default=defaults.model, help="served model name")
    p.add_argument(
        "--lora-modules",
        nargs="*",
        default=list(defaults.lora_modules),
        metavar="NAME",
        help="LoRA adapters served from the start (as a vLLM, POST /v1/load_lora_adapter "
        "and /v1/unload_lora_adapter change them): a request naming one (vLLM: model; "
        "SGLang: model as base:NAME, else lora_path) is cached under it, its blocks published "
        "with its lora_name; /v1/models lists each with the served model as its parent",
    )
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    p.add_argument(
        "--api-key",
        default=None,
        help="as vLLM's: /v1/* answers 401 without 'Authorization: Bearer <key>'",
    )
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    try:
        config = WorkerConfig(
            host=args.host,
            port=args.port,
            kv_port_base=args.kv_port_base,
            dp_size=args.dp_size,
            block_size=args.block_size,
            cache_blocks=args.cache_blocks,
            wire=args.wire,
            engine=args.engine,
            replay_port_base=args.replay_port_base,
            prefill_us_per_token=args.prefill_us_per_token,
            decode_ms_per_token=args.decode_ms_per_token,
            tokenizer=args.tokenizer,
            startup_delay_s=args.startup_delay_s,
            serve_kv_snapshot=args.serve_kv_snapshot,
            fail_first=args.fail_first,
            max_concurrency=args.max_concurrency,
            topic=args.topic,
            model=args.model,
            lora_modules=tuple(args.lora_modules),
            max_body_bytes=args.max_body_bytes,
            api_key=args.api_key,
        )
    except ValueError as exc:
        p.error(str(exc))
    return config, args.log_level.upper()


async def run(config: WorkerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = FakeWorker(config)
    await worker.start()
    print(f"{READY_LINE_PREFIX}{worker.url}", flush=True)
    try:
        await stop.wait()
        log.info("signal received: shutting down")
    finally:
        await worker.stop()
    log.info("fake-kv-worker stopped")


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(run(config))
    except (OSError, zmq.ZMQError) as exc:  # a port already taken, most likely
        log.error("cannot start: %s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
