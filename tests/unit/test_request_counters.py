"""The request path's series, kept as plain ints and exported at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest

from router.metrics import PlainHistogram, RouterMetrics


def test_a_value_on_a_bucket_bound_counts_in_that_bucket_and_the_export_is_cumulative() -> None:
    counts = PlainHistogram((0, 1, 4))
    for value in (0, 1, 2, 4, 5, 5):
        counts.observe(value)
    family = counts.family("h", "a histogram")
    buckets = [(s.labels["le"], s.value) for s in family.samples if s.name == "h_bucket"]
    assert buckets == [("0.0", 1), ("1.0", 2), ("4.0", 4), ("+Inf", 6)]
    assert counts.total == 17


def test_the_series_read_as_prometheus_client_instruments_would_write_them() -> None:
    metrics = RouterMetrics()
    metrics.requests["/v1/completions", "http://w:1", "200"] += 2
    metrics.decisions["cache_aware", "cache_hit"] += 1
    metrics.matched_blocks.observe(62)
    metrics.upstream_failures["http://w:1", "connect"] += 1
    metrics.tokenize_failures[("render",)] += 3
    get = metrics.registry.get_sample_value
    assert (
        get(
            "kvrouter_requests_total",
            {"route": "/v1/completions", "worker": "http://w:1", "status": "200"},
        )
        == 2
    )
    assert (
        get("kvrouter_routing_decisions_total", {"policy": "cache_aware", "outcome": "cache_hit"})
        == 1
    )
    assert get("kvrouter_matched_blocks_bucket", {"le": "32.0"}) == 0
    assert get("kvrouter_matched_blocks_bucket", {"le": "64.0"}) == 1
    assert get("kvrouter_matched_blocks_count") == 1 and get("kvrouter_matched_blocks_sum") == 62
    assert (
        get("kvrouter_upstream_failures_total", {"worker": "http://w:1", "reason": "connect"}) == 1
    )
    assert get("kvrouter_tokenize_failures_total", {"reason": "render"}) == 3
    text = generate_latest(metrics.registry).decode()
    assert "# TYPE kvrouter_requests_total counter" in text
    assert "# TYPE kvrouter_matched_blocks histogram" in text
