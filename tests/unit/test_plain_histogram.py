"""`PlainHistogram` (router/metrics.py), the request path's histogram: `le` buckets, exported
cumulative with its sum, exactly as prometheus_client's own Histogram exports the same values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from router.metrics import ADDED_SECONDS_BUCKETS, PlainHistogram
from tests.support.metrics import Scrape


class _One(Collector):
    def __init__(self, histogram: PlainHistogram) -> None:
        self._histogram = histogram

    def collect(self) -> Iterator[Metric]:
        yield self._histogram.family("h", "doc")


def scraped(histogram: PlainHistogram) -> Scrape:
    registry = CollectorRegistry()
    registry.register(_One(histogram))
    return Scrape.parse(generate_latest(registry).decode())


def test_a_value_on_a_bound_counts_in_that_bound_and_larger_ones_in_inf() -> None:
    h = PlainHistogram((0.001, 0.01, 0.1))
    for value in (0.0005, 0.001, 0.0011, 0.1, 0.2, 7.0):
        h.observe(value)
    assert h.counts == [2, 1, 1, 2]
    m = scraped(h)
    assert m.value("h_bucket", le="0.001") == 2
    assert m.value("h_bucket", le="0.01") == 3
    assert m.value("h_bucket", le="0.1") == 4
    assert m.value("h_bucket", le="+Inf") == 6
    assert m.value("h_count") == 6
    assert m.value("h_sum") == pytest.approx(0.0005 + 0.001 + 0.0011 + 0.1 + 0.2 + 7.0)


def test_it_exports_what_prometheus_clients_histogram_exports_for_the_same_values() -> None:
    values = [i * 0.00037 for i in range(400)] + [3.0, 9.0, 0.0001, 0.005]
    ours = PlainHistogram(ADDED_SECONDS_BUCKETS)
    registry = CollectorRegistry()
    theirs = Histogram("h", "doc", buckets=ADDED_SECONDS_BUCKETS, registry=registry)
    for value in values:
        ours.observe(value)
        theirs.observe(value)
    reference = Scrape.parse(generate_latest(registry).decode())
    got = scraped(ours)
    for (name, labels), value in reference.samples.items():
        if name == "h_created":
            continue
        assert got.samples[(name, labels)] == pytest.approx(value), (name, dict(labels))
    assert set(got.samples) == {k for k in reference.samples if k[0] != "h_created"}


@pytest.mark.parametrize("bounds", [(0.1, 0.01), (0.1, 0.1)])
def test_bounds_that_do_not_increase_are_refused(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="must increase"):
        PlainHistogram(bounds)
