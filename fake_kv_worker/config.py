"""The fake worker's settings, shared by the command line and in-process test harnesses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from fake_kv_worker.wire import WIRE_FLAVOURS, WireFlavour

ENGINES: Final = ("vllm", "sglang")
DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024  # a 1M-token prompt as JSON ids fits


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 8001  # 0: let the OS choose; the bound port is logged and printed
    kv_port_base: int = 5557  # rank r publishes on kv_port_base + r; must be explicit
    dp_size: int = 1
    block_size: int = 16
    cache_blocks: int = 4096  # per rank
    wire: str = "vllm"
    # Which engine's /metrics names to serve; None follows the wire flavour. The block hash
    # chain always follows the wire flavour, since hash and wire ship together in an engine.
    engine: Literal["vllm", "sglang"] | None = None
    replay_port_base: int = 0  # 0: no replay sockets
    prefill_us_per_token: float = 0.0  # charged per uncached prompt token
    decode_ms_per_token: float = 0.0  # charged per generated token
    tokenizer: str = "bytes"  # or a model directory (needs transformers)
    startup_delay_s: float = 0.0  # /health answers 503 until this has passed
    serve_kv_snapshot: bool = False
    fail_first: int = 0  # the first N generation requests fail with 503
    max_concurrency: int = 0  # per rank; 0 = unlimited, otherwise the rest queue
    topic: str = ""
    model: str = "fake-model"
    # LoRA adapters it serves from its start (the vLLM flavour loads and unloads adapters at
    # run time: `app.load_lora_adapter`): a request naming one (`app.adapter_of`) is cached
    # under it and its blocks published under its `lora_name`, as vLLM's `--lora-modules`
    # and SGLang's `--lora-paths` make an engine do.
    lora_modules: tuple[str, ...] = ()
    max_tokens_default: int = 16
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    replay_buffer_steps: int = 10_000
    # As vLLM's `--api-key`: every /v1/* request must carry `Authorization: Bearer <key>`.
    api_key: str | None = None

    def __post_init__(self) -> None:
        problems: list[str] = []
        if not 0 <= self.port <= 65535:
            problems.append(f"port {self.port} is out of range")
        if self.dp_size < 1:
            problems.append("dp_size must be >= 1")
        if self.kv_port_base < 1:
            problems.append(f"kv_port_base {self.kv_port_base} must be an explicit port 1..65535")
        elif problem := _last_rank_problem("kv_port_base", self.kv_port_base, self.dp_size):
            problems.append(problem)
        if self.replay_port_base < 0:
            problems.append(f"replay_port_base {self.replay_port_base} must be 1..65535, or 0")
        elif self.replay_port_base and (
            problem := _last_rank_problem("replay_port_base", self.replay_port_base, self.dp_size)
        ):
            problems.append(problem)
        if self.replay_port_base and _overlap(
            self.kv_port_base, self.replay_port_base, self.dp_size
        ):
            problems.append("kv and replay port ranges overlap")
        if self.block_size < 1:
            problems.append("block_size must be >= 1")
        if self.cache_blocks < 1:
            problems.append("cache_blocks must be >= 1")
        if self.wire not in WIRE_FLAVOURS:
            problems.append(f"wire must be one of {sorted(WIRE_FLAVOURS)}")
        if self.engine is not None and self.engine not in ENGINES:
            problems.append(f"engine must be one of {list(ENGINES)}")
        if self.tokenizer != "bytes" and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            problems.append("tokenizer must be 'bytes' or a model directory with a tokenizer.json")
        for name in ("prefill_us_per_token", "decode_ms_per_token", "startup_delay_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        for name in ("fail_first", "max_concurrency", "max_tokens_default"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if self.max_body_bytes < 1024:
            problems.append("max_body_bytes must be >= 1024")
        if self.replay_buffer_steps < 1:
            problems.append("replay_buffer_steps must be >= 1")
        if self.api_key == "":
            problems.append("api_key must not be empty")
        if any(not name or ":" in name for name in self.lora_modules):
            # SGLang reads `model` "base:adapter": a name with a colon could not be named so.
            problems.append("lora_modules must be non-empty names without ':'")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def flavour(self) -> WireFlavour:
        return WIRE_FLAVOURS[self.wire]

    @property
    def metrics_engine(self) -> Literal["vllm", "sglang"]:
        return self.engine if self.engine is not None else self.flavour.engine


def _last_rank_problem(name: str, base: int, dp_size: int) -> str | None:
    """A base in range whose last rank's port is not (65535 with 2 ranks: rank 1 on 65536)."""
    last = dp_size - 1
    if base + last <= 65535:
        return None
    if last == 0:
        return f"{name} {base} must be a port 1..65535"
    return f"{name} {base} puts rank {last} of dp_size {dp_size} on port {base + last}, past 65535"


def _overlap(a: int, b: int, n: int) -> bool:
    return a < b + n and b < a + n
