"""The load views an engine offers a router: smg's `/v1/loads` JSON and Prometheus `/metrics`.

Both are computed from the ranks' live counters on each call; nothing is sampled on a timer.
What is not simulated reads as 0.0 (`gen_throughput`), which a router must treat as "no
signal", exactly as with an idle real engine.

The KV pool's size is stated as the engines state it: SGLang's `max_total_num_tokens` (in
`/v1/loads` and as the `sglang:max_total_num_tokens` gauge), and vLLM's info gauge
`vllm:cache_config_info`, whose labels carry `num_gpu_blocks` and `block_size` (value 1).
Its usage (`token_usage`, `num_used_tokens`, `vllm:kv_cache_usage_perc`) counts the blocks
running requests hold, not the cache: see `RankEngine.used_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from fake_kv_worker.engine import RankEngine


def _token_usage(rank: RankEngine) -> float:
    return rank.used_blocks / rank.cache.capacity


def _hit_rate(rank: RankEngine) -> float:
    return rank.cached_tokens / rank.prompt_tokens if rank.prompt_tokens else 0.0


def _utilization(rank: RankEngine) -> float:
    # Busy slots over slots; an unlimited rank has no slot budget to be busy against.
    return rank.running / rank.max_running if rank.max_running else 0.0


def loads_body(ranks: Sequence[RankEngine]) -> dict[str, Any]:
    """smg's `WorkerLoadResponse`, one `SchedulerLoadSnapshot` per dp rank."""
    loads = []
    for rank in ranks:
        block_size = rank.cache.block_size
        loads.append(
            {
                "dp_rank": rank.dp_rank,
                "num_running_reqs": rank.running,
                "num_waiting_reqs": rank.waiting,
                "num_waiting_uncached_tokens": rank.waiting_uncached_tokens,
                "num_total_reqs": rank.running + rank.waiting,
                "num_used_tokens": rank.used_blocks * block_size,
                "max_total_num_tokens": rank.cache.capacity * block_size,
                "token_usage": _token_usage(rank),
                "gen_throughput": 0.0,
                "cache_hit_rate": _hit_rate(rank),
                "utilization": _utilization(rank),
                "max_running_requests": rank.max_running,
            }
        )
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "dp_rank_count": len(ranks),
        "loads": loads,
    }


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(
    lines: list[str],
    name: str,
    kind: Literal["gauge", "counter"],
    help_text: str,
    samples: list[tuple[dict[str, str], float]],
) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    # prometheus-client exposes a counter family `x` as samples named `x_total`; real vLLM's
    # /metrics therefore shows `vllm:prefix_cache_queries_total`, and so do we.
    sample_name = f"{name}_total" if kind == "counter" else name
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        lines.append(f"{sample_name}{{{label_text}}} {float(value)!r}")


def prometheus_text(
    ranks: Sequence[RankEngine], engine: Literal["vllm", "sglang"], model: str
) -> str:
    lines: list[str] = []
    if engine == "vllm":
        # vLLM labels each engine core (one per dp rank) with `engine`.
        def labels(r: RankEngine) -> dict[str, str]:
            return {"engine": str(r.dp_rank), "model_name": model}

        _family(
            lines,
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [(labels(r), r.running) for r in ranks],
        )
        _family(
            lines,
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [(labels(r), r.waiting) for r in ranks],
        )
        _family(
            lines,
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [(labels(r), _token_usage(r)) for r in ranks],
        )
        # vLLM's `log_metrics_info`: one sample per engine core, the CacheConfig fields as
        # label values (None as "None"), the engine index last, and the value 1.
        _family(
            lines,
            "vllm:cache_config_info",
            "gauge",
            "Information of the LLMEngine's cache_config",
            [
                (
                    {
                        "block_size": str(r.cache.block_size),
                        "cache_dtype": "auto",
                        "enable_prefix_caching": "True",
                        "num_cpu_blocks": "None",
                        "num_gpu_blocks": str(r.cache.capacity),
                        "num_gpu_blocks_override": "None",
                        "engine": str(r.dp_rank),
                    },
                    1.0,
                )
                for r in ranks
            ],
        )
        _family(
            lines,
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            [(labels(r), r.prompt_tokens) for r in ranks],
        )
        _family(
            lines,
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            [(labels(r), r.cached_tokens) for r in ranks],
        )
    else:

        def labels(r: RankEngine) -> dict[str, str]:
            return {"model_name": model, "dp_rank": str(r.dp_rank)}

        gauges: list[tuple[str, str, Any]] = [
            ("sglang:num_running_reqs", "The number of running requests.", lambda r: r.running),
            (
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                lambda r: r.waiting,
            ),
            ("sglang:token_usage", "The token usage.", _token_usage),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", _hit_rate),
            ("sglang:gen_throughput", "The generation throughput (token/s).", lambda r: 0.0),
            ("sglang:utilization", "The utilization.", _utilization),
            (
                "sglang:num_used_tokens",
                "The number of used tokens.",
                lambda r: r.used_blocks * r.cache.block_size,
            ),
            (
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV pool.",
                lambda r: r.cache.capacity * r.cache.block_size,
            ),
        ]
        for name, help_text, value in gauges:
            _family(lines, name, "gauge", help_text, [(labels(r), value(r)) for r in ranks])
    return "\n".join(lines) + "\n"
