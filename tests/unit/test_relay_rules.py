"""The relay's plain rules, driven without sockets."""

from __future__ import annotations

import pytest

from cachetree.ranks import RankId
from router.breaker import CircuitBreaker
from router.dataplane.relay import _every_breaker_open
from router.policy import Candidate
from router.workers import Worker


def worker(url: str, *, open_breaker: bool) -> Worker:
    breaker = CircuitBreaker(failure_threshold=1, clock=lambda: 0.0)
    if open_breaker:
        breaker.record_failure()
        assert breaker.is_open()
    return Worker(url, state="ready", healthy=True, breaker=breaker)


@pytest.mark.parametrize(
    ("states", "ranked", "every_open"),
    [
        ({}, [], True),  # nothing to try: all() of nothing
        ({"http://a": True}, ["http://a"], True),
        ({"http://a": True, "http://b": True}, ["http://a", "http://b"], True),
        ({"http://a": True, "http://b": False}, ["http://a", "http://b"], False),
        ({"http://a": False}, ["http://a", "http://gone"], False),
        ({"http://a": True}, ["http://gone", "http://a"], True),  # an unknown worker is skipped
    ],
)
def test_every_breaker_open_is_true_only_when_no_known_candidate_has_a_closed_breaker(
    states: dict[str, bool], ranked: list[str], every_open: bool
) -> None:
    workers = {url: worker(url, open_breaker=o) for url, o in states.items()}
    candidates = [Candidate(RankId(url, 0)) for url in ranked]
    assert _every_breaker_open(workers, candidates) is every_open
