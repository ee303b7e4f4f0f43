"""Chat tokenization CPU per request on a multi-turn agentic trace: cached vs uncached vs encode.

Run: .venv/bin/python -m bench.bench_tokenize [--sessions 24] [--turns 8] [--rounds 5]
Prints figures; asserts nothing except that every mode yields the same ids. One core.

The model is a Qwen-family byte-level BPE with a 32k vocabulary trained on the standard library
(as fast per token as a real model's) under the real Qwen3 chat template, loaded with
transformers as the engines load it. The trace (bench/chat_trace.py): 3 applications with a
400-word system prompt and 8 tools each, sessions growing one turn per request, every third
assistant turn a tool call and its result, sessions interleaved.

Modes, each the CPU time (thread time) of the request path's call, per request:
- `full encode`: `tokenizer.encode(rendered prompt)` alone, the rendered text given: what a
  router pays to tokenize a prompt it has already rendered, with no cache.
- `uncached`: `encode_chat_request(body)` with the cache off: chat rules, template render,
  full encode. What kvrouter paid per chat request before the cache.
- `cached`: the same call with the segment cache, starting empty every round, so first
  occurrences of a system prompt or turn pay full price as they would in production.
- `render`: `uncached` minus `full encode` (rules + apply_chat_template), for reference.
Rounds interleave the modes (uncached, cached, full encode, ...); figures are the medians over
rounds of the per-request mean, with the range. The ratio the issue targets is cached over
full encode (at most 20%).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.chat_trace import TraceShape, chat_trace
from router.tokenize import RequestTokenizer, load_tokenizer
from tests.support.model_dirs import build_model_dir, fixture_template


def per_request_us(run: Callable[[], None], requests: int) -> float:
    start = time.thread_time_ns()
    run()
    return (time.thread_time_ns() - start) / requests / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    t0 = time.perf_counter()
    model = build_model_dir(root / "qwen", "qwen", fixture_template("qwen3.jinja"), big=True)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    uncached = load_tokenizer(str(model), cache_mb=0)
    loaded = time.perf_counter() - t0
    bodies = chat_trace(TraceShape(sessions=args.sessions, turns=args.turns))
    backend = uncached.model._backend  # type: ignore[attr-defined]

    reference = [uncached.encode_chat_request(b) for b in bodies]
    assert all(r.failure is None for r in reference)
    texts = [backend.decode(r.ids, skip_special_tokens=False) for r in reference]
    tokens = [len(r.ids) for r in reference]

    def run_uncached() -> None:
        for body in bodies:
            uncached.encode_chat_request(body)

    def run_cached(tok: RequestTokenizer) -> Callable[[], None]:
        def run() -> None:
            for body in bodies:
                tok.encode_chat_request(body)

        return run

    def run_encode() -> None:
        for text in texts:
            backend.encode(text, add_special_tokens=False)

    results: dict[str, list[float]] = {"uncached": [], "cached": [], "full encode": []}
    hit_rates = []
    for _ in range(args.rounds):
        results["uncached"].append(per_request_us(run_uncached, len(bodies)))
        cached = load_tokenizer(str(model))  # an empty cache every round
        results["cached"].append(per_request_us(run_cached(cached), len(bodies)))
        results["full encode"].append(per_request_us(run_encode, len(bodies)))
        cache = cached.segment_cache
        assert cache is not None
        hit_rates.append(cache.hits / max(1, cache.hits + cache.misses))
        # Identical ids, every request, every round.
        for body, ref in zip(bodies, reference, strict=True):
            assert cached.encode_chat_request(body).ids == ref.ids

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):8.1f} us  ({min(values):.1f}-{max(values):.1f})"

    print(f"trace: {len(bodies)} chat requests, {args.sessions} sessions x {args.turns} turns;")
    print(
        f"prompt tokens per request: median {statistics.median(tokens):.0f}, "
        f"max {max(tokens)}; model built in {built:.1f} s, loaded in {loaded * 1000:.0f} ms"
    )
    print(f"CPU per request, median of {args.rounds} interleaved rounds (range):")
    for name, values in results.items():
        print(f"  {name:12s} {fmt(values)}")
    render = [u - e for u, e in zip(results["uncached"], results["full encode"], strict=True)]
    print(f"  {'render':12s} {fmt(render)}  (uncached - full encode)")
    cached_med = statistics.median(results["cached"])
    print(
        f"cached / full encode: {cached_med / statistics.median(results['full encode']):.1%}; "
        f"cached / uncached: {cached_med / statistics.median(results['uncached']):.1%}; "
        f"segment hit rate {statistics.median(hit_rates):.1%}; ids identical in every mode"
    )


if __name__ == "__main__":
    main()
