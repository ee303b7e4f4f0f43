"""What timing a request's added latency costs the request path, against prometheus_client.

Run: .venv/bin/python bench/bench_added_latency.py [--rounds 7] [--number 200000]

Per request the data plane takes one `time.perf_counter()` when the request gets its turn
(router/dataplane/server.py) and, when its head is written to the first worker, another one
and `PlainHistogram.observe` of the difference (router/dataplane/relay.py). Timed here, in
interleaved rounds on the same clock so machine noise hits every variant alike:
- `loop`: the empty timing loop (subtracted from the others);
- `ours`: both stamps and `PlainHistogram.observe` (`RouterMetrics.added_seconds`);
- `prometheus_client`: both stamps and `prometheus_client.Histogram.observe` with the same
  buckets, the instrument a first draft would use (it takes a lock and walks the buckets).
Prints nanoseconds per request, median and range over the rounds; asserts nothing.
Target (observe2 brief): well under 1 us per request.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from prometheus_client import CollectorRegistry, Histogram

from router.metrics import ADDED_SECONDS_BUCKETS, PlainHistogram

SETUP = "from time import perf_counter"
VARIANTS = {
    "loop": "pass",
    "ours": "t = perf_counter(); ours.observe(perf_counter() - t)",
    "prometheus_client": "t = perf_counter(); theirs.observe(perf_counter() - t)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args()
    names = {
        "ours": PlainHistogram(ADDED_SECONDS_BUCKETS),
        "theirs": Histogram(
            "h", "doc", buckets=ADDED_SECONDS_BUCKETS, registry=CollectorRegistry()
        ),
    }
    per_call: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, stmt in VARIANTS.items():
            seconds = timeit.timeit(stmt, SETUP, number=args.number, globals=names)
            per_call[name].append(seconds / args.number * 1e9)
    loop = statistics.median(per_call["loop"])
    print(
        f"ns per request over the empty loop ({args.rounds} interleaved rounds of {args.number:,}):"
    )
    for name in ("ours", "prometheus_client"):
        ns = [v - loop for v in per_call[name]]
        print(
            f"  {name:18} median {statistics.median(ns):6.0f}  range {min(ns):6.0f}..{max(ns):6.0f}"
        )


if __name__ == "__main__":
    main()
