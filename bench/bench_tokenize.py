"""Chat tokenization CPU per request on a multi-turn agentic trace: cached vs uncached vs encode.

Run: .venv/bin/python -m bench.bench_tokenize [--sessions 24] [--turns 8] [--rounds 5]
Prints figures; asserts nothing except that every mode yields the same ids. One core.

The model is a Qwen-family byte-level BPE with a 32k vocabulary trained on the standard library
(as fast per token as a real model's) under the real Qwen3 chat template, loaded with
transformers as the engines load it. The trace (bench/chat_trace.py): 3 applications with a
400-word system prompt and 8 tools each, sessions growing one turn per request, every third
assistant turn a tool call and its result, sessions interleaved.

Modes, each the CPU time (thread time) per request:
- `full encode`: `encode(rendered prompt)` with the backend tokenizer, the rendered text given:
  what tokenizing costs with no cache (what transformers, so the engine, calls).
- `full encode, no offsets`: the same text through `encode_batch_fast` (a batch of one), which
  skips tracking character offsets: the router's encode primitive (router/tokenize/segments.py).
- `cached encode`: the segment encoder (router/tokenize/segments.py) on the same texts, its
  cache empty at the start of every round, so first occurrences of a system prompt or a turn
  pay full price as in production. The issue's target: at most 20% of `full encode`.
- `render`: the chat rules and the template render alone (rules + apply_chat_template's work).
- `uncached request`: `encode_chat_request(body)` with the cache off: rules, render, full
  encode; what kvrouter paid per chat request before the cache.
- `cached request`: the same call with the cache (emptied every round).
Rounds interleave the modes; figures are the medians over rounds of the per-request mean, with
the range. Every mode's ids are checked identical to the uncached ones.

`--huge-prompt-mib N` also times one completion prompt of N MiB (the trace's system prompts,
repeated) through `encode_prompt`, which encodes its first `MAX_ENCODED_CHARS` only, beside
the backend's encode of the whole text: the event loop's hold on a prompt near
`--max-request-bytes`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chat_trace import TraceShape, chat_trace
from router.tokenize import Engine, RequestTokenizer, load_tokenizer
from router.tokenize.chat_rules import render_call
from router.tokenize.hf import MAX_ENCODED_CHARS
from router.tokenize.segments import SegmentEncoder
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
    parser.add_argument("--huge-prompt-mib", type=float, default=0.0)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    t0 = time.perf_counter()
    model = build_model_dir(root / "qwen", "qwen", fixture_template("qwen3.jinja"), big=True)
    built = time.perf_counter() - t0
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as the router sets it
    t0 = time.perf_counter()
    import transformers  # noqa: F401 - timed: what a replica pays once at start-up

    imported = time.perf_counter() - t0
    t0 = time.perf_counter()
    uncached = load_tokenizer(str(model), cache_mb=0)
    loaded = time.perf_counter() - t0
    bodies = chat_trace(TraceShape(sessions=args.sessions, turns=args.turns))
    backend = uncached.model._backend  # type: ignore[attr-defined]

    reference = [uncached.encode_chat_request(b) for b in bodies]
    assert all(r.failure is None for r in reference)
    tokens = [len(r.ids) for r in reference]

    cached = load_tokenizer(str(model))
    hf_model = cached.model
    template = hf_model._tokenizer.chat_template  # type: ignore[attr-defined]
    traits = hf_model._traits_of(template)  # type: ignore[attr-defined]
    texts = [hf_model._render(render_call(b, traits, Engine.VLLM), template) for b in bodies]  # type: ignore[attr-defined]
    assert [backend.encode(t, add_special_tokens=False).ids for t in texts] == [
        r.ids for r in reference
    ]
    cache_bytes = 64 << 20

    def fresh_cache() -> None:
        hf_model.segments = SegmentEncoder(backend, cache_bytes)  # type: ignore[attr-defined]

    def run_requests(tok: RequestTokenizer) -> Callable[[], None]:
        def run() -> None:
            for body in bodies:
                tok.encode_chat_request(body)

        return run

    def run_encode() -> None:
        for text in texts:
            backend.encode(text, add_special_tokens=False)

    def run_encode_no_offsets() -> None:
        for text in texts:
            backend.encode_batch_fast([text], add_special_tokens=False)

    def run_cached_encode() -> None:
        encoder = SegmentEncoder(backend, cache_bytes)
        for text in texts:
            encoder.encode(text)

    def run_render() -> None:
        for body in bodies:
            call = render_call(body, traits, Engine.VLLM)
            hf_model._render(call, template)  # type: ignore[attr-defined]

    results: dict[str, list[float]] = {
        name: []
        for name in (
            "full encode",
            "full encode, no offsets",
            "cached encode",
            "render",
            "uncached request",
            "cached request",
        )
    }
    for _ in range(args.rounds):
        results["full encode"].append(per_request_us(run_encode, len(bodies)))
        results["full encode, no offsets"].append(
            per_request_us(run_encode_no_offsets, len(bodies))
        )
        results["cached encode"].append(per_request_us(run_cached_encode, len(bodies)))
        results["render"].append(per_request_us(run_render, len(bodies)))
        results["uncached request"].append(per_request_us(run_requests(uncached), len(bodies)))
        fresh_cache()
        results["cached request"].append(per_request_us(run_requests(cached), len(bodies)))
    hits = cached.segment_cache
    assert hits is not None
    hit_rate = hits.hits / max(1, hits.hits + hits.misses)
    for body, ref in zip(bodies, reference, strict=True):
        assert list(cached.encode_chat_request(body).ids) == ref.ids

    def fmt(values: list[float]) -> str:
        return f"{statistics.median(values):8.1f} us  ({min(values):.1f}-{max(values):.1f})"

    print(f"trace: {len(bodies)} chat requests, {args.sessions} sessions x {args.turns} turns;")
    print(
        f"prompt tokens per request: median {statistics.median(tokens):.0f}, "
        f"max {max(tokens)}; model built in {built:.1f} s; transformers imported in "
        f"{imported:.2f} s, the model loaded in {loaded * 1000:.0f} ms"
    )
    print(f"CPU per request, median of {args.rounds} interleaved rounds (range):")
    for name, values in results.items():
        print(f"  {name:23s} {fmt(values)}")

    def ratio(a: str, b: str) -> str:
        return f"{statistics.median(results[a]) / statistics.median(results[b]):.1%}"

    print(
        f"cached encode / full encode: {ratio('cached encode', 'full encode')}; "
        f"cached request / uncached request: {ratio('cached request', 'uncached request')}; "
        f"cached request / full encode: {ratio('cached request', 'full encode')} "
        f"(/ full encode without offsets: {ratio('cached request', 'full encode, no offsets')}); "
        f"segment hit rate {hit_rate:.1%} (last round); ids identical in every mode"
    )
    if args.huge_prompt_mib > 0:
        huge_prompt(uncached, backend, texts, int(args.huge_prompt_mib * (1 << 20)))


def huge_prompt(tok: RequestTokenizer, backend: Any, texts: list[str], size: int) -> None:
    text = ("\n".join(texts) * (size // sum(map(len, texts)) + 1))[:size]
    started = time.thread_time_ns()
    ids = tok.encode_prompt(text)
    bounded = (time.thread_time_ns() - started) / 1e6
    started = time.thread_time_ns()
    whole = backend.encode(text, add_special_tokens=True).ids
    full = (time.thread_time_ns() - started) / 1e6
    assert list(ids) == whole[: len(ids)]
    print(
        f"a {size / (1 << 20):.0f} MiB prompt: encode_prompt {bounded:.0f} ms ({len(ids):,} ids, "
        f"the first {MAX_ENCODED_CHARS:,} characters); the whole text {full:.0f} ms "
        f"({len(whole):,} ids); the ids agree"
    )


if __name__ == "__main__":
    main()
