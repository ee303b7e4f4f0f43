"""In-flight counts: the drain waits on `wait_idle`, which must be true exactly at zero."""

from __future__ import annotations

from cachetree.ranks import RankId
from router.dataplane.inflight import InflightTracker

A, B = RankId("http://a:8000", 0), RankId("http://b:8000", 1)


async def test_idle_exactly_while_nothing_is_in_flight() -> None:
    tracker = InflightTracker()
    assert await tracker.wait_idle(0)
    tracker.begin(A)
    tracker.begin(B)
    tracker.begin(A)
    assert (tracker[A], tracker[B], tracker.total) == (2, 1, 3)
    assert not await tracker.wait_idle(0.01)
    tracker.end(A)
    tracker.end(B)
    assert not await tracker.wait_idle(0.01)  # one left
    tracker.end(A)
    assert (tracker[A], tracker[B], tracker.total) == (0, 0, 0)
    assert await tracker.wait_idle(0)
    tracker.begin(B)  # busy again after an idle spell
    assert not await tracker.wait_idle(0.01)
    tracker.end(B)
    assert await tracker.wait_idle(0)
