"""The proxy benchmarks' added latency: the percentile of each pair's routed - direct time."""

from __future__ import annotations

import pytest

from bench.bench_proxy import added_percentile, percentile


def test_a_slow_direct_request_does_not_make_the_added_latency_negative() -> None:
    # Every routed request 0.5 ms slower than its direct pair, but two direct requests met
    # noise: routed p99 - direct p99 said -18.5 ms.
    direct = [1.0] * 100
    direct[3] = direct[40] = 20.0
    routed = [d + 0.5 for d in direct]
    routed[3] = routed[40] = 1.5
    assert percentile(routed, 99) - percentile(direct, 99) == -18.5
    assert added_percentile(routed, direct, 50) == 0.5
    assert added_percentile(routed, direct, 99) == 0.5


def test_the_added_latency_is_read_from_requests_paired_by_their_place() -> None:
    direct = [1.0, 2.0, 3.0, 4.0]
    assert added_percentile([1.1, 2.2, 3.3, 4.4], direct, 100) == pytest.approx(0.4)
    assert added_percentile([4.4, 3.3, 2.2, 1.1], direct, 100) == pytest.approx(3.4)


def test_legs_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError):
        added_percentile([1.0, 2.0], [1.0], 50)
