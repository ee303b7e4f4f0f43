"""The relay's plain rules, driven without sockets."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from cachetree.ranks import RankId
from router.breaker import CircuitBreaker
from router.dataplane.exchange import Refusal, read_request_head
from router.dataplane.inflight import InflightTracker
from router.dataplane.relay import WorkerRelay, _every_breaker_open
from router.dataplane.server import Limits
from router.policy import Candidate, Decision
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


class _Pool:
    """Records which worker a relay asked for a connection (and never answers)."""

    def __init__(self, url: str, asked: list[str]) -> None:
        self.url, self._asked = url, asked

    def acquire(self, who: object, fresh: bool = False) -> None:
        self._asked.append(self.url)

    def cancel(self, who: object) -> None:
        pass


def breaker_in(state: str) -> CircuitBreaker:
    """closed; open within its cooldown; cooled (open, its cooldown passed); half_open (its
    probe out)."""
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=lambda: now[0])
    if state != "closed":
        breaker.record_failure()
        now[0] = 1.0 if state == "open" else 10.0
    if state == "half_open":
        assert breaker.allow()
    assert breaker.state == ("open" if state == "cooled" else state)
    return breaker


def relay_over(states: dict[str, str]) -> tuple[WorkerRelay, list[str], list[Refusal]]:
    """A `WorkerRelay` over ranks of workers in the given breaker states, in that order."""
    asked: list[str] = []
    refused: list[Refusal] = []
    workers = {
        url: Worker(url, state="ready", healthy=True, breaker=breaker_in(state))
        for url, state in states.items()
    }
    plane = SimpleNamespace(
        limits=Limits(),
        workers=workers,
        inflight=InflightTracker(),
        pools={},
        pool_for=lambda url: _Pool(url, asked),
        metrics=SimpleNamespace(requests=Counter(), upstream_failures=Counter()),
        stats=SimpleNamespace(safe_retries=0, ended=Counter()),
    )
    client = SimpleNamespace(refuse=refused.append, gate=None)  # a client without a socket
    head = read_request_head(b"POST", b"/v1/completions", True, [(b"Host", b"r")], True)
    decision = Decision([Candidate(RankId(url, 0)) for url in states], "cache_miss", 0)
    relay = WorkerRelay(plane, client, head, b"{}", decision)  # type: ignore[arg-type]
    return relay, asked, refused


@pytest.mark.parametrize(
    ("states", "tried", "after"),
    [
        ({"a": "closed", "b": "closed"}, "a", {"a": "closed", "b": "closed"}),
        ({"a": "open", "b": "closed"}, "b", {"a": "open", "b": "closed"}),
        ({"a": "half_open", "b": "closed"}, "b", {"a": "half_open", "b": "closed"}),
        # a cooled breaker's `allow` claims its one probe
        ({"a": "cooled", "b": "open"}, "a", {"a": "half_open", "b": "open"}),
        ({"a": "open", "b": "cooled"}, "b", {"a": "open", "b": "half_open"}),
        # every breaker open: the first rank anyway, and nothing claimed
        ({"a": "open", "b": "open"}, "a", {"a": "open", "b": "open"}),
        ({"a": "half_open", "b": "open"}, "a", {"a": "half_open", "b": "open"}),
    ],
)
def test_a_request_goes_to_the_first_rank_its_breaker_allows_or_to_the_first_when_all_are_open(
    states: dict[str, str], tried: str, after: dict[str, str]
) -> None:
    relay, asked, refused = relay_over(states)
    relay.start()
    assert asked == [tried] and not refused
    assert {url: w.breaker.state for url, w in relay.plane.workers.items()} == after  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("states", "tried", "status"),
    [
        # Not every breaker was open when the request came: after the failure, an open one is
        # skipped, not tried anyway.
        ({"a": "closed", "b": "open"}, ["a"], 502),
        # Every one was: the failover tries the next anyway.
        ({"a": "open", "b": "open"}, ["a", "b"], None),
    ],
)
def test_a_failover_reads_whether_every_breaker_was_open_as_it_was_before_the_first_attempt(
    states: dict[str, str], tried: list[str], status: int | None
) -> None:
    relay, asked, refused = relay_over(states)
    relay.start()
    relay.upstream_failed("connect", "refused")
    assert asked == tried
    assert [r.status for r in refused] == ([status] if status else [])


def end_without_a_verdict(relay: WorkerRelay, how: str) -> None:
    """The attempt ends telling the breaker nothing of the worker: its wait for one of the
    worker's busy connections ran out, it was answered a 4xx, or its client left."""
    if how == "queue":
        relay.upstream_failed("queue", "all 1 connection(s) to the worker stayed busy")
    elif how == "4xx":
        assert relay.accept_head(404)
    else:
        relay.client_gone()


@pytest.mark.parametrize("how", ["queue", "4xx", "gone"])
def test_a_request_sent_anyway_leaves_the_probe_another_request_holds_out(how: str) -> None:
    relay, asked, _ = relay_over({"a": "half_open"})  # its probe out with another request
    relay.start()  # every breaker open: sent anyway, claiming nothing
    assert asked == ["a"]
    breaker = relay.plane.workers["a"].breaker  # type: ignore[attr-defined]
    end_without_a_verdict(relay, how)
    # Freed, the slot let a second probe out while the first was still out.
    assert (breaker.state, breaker.allow()) == ("half_open", False)


@pytest.mark.parametrize("how", ["queue", "4xx", "gone"])
def test_the_probes_own_request_ending_without_a_verdict_frees_its_slot(how: str) -> None:
    relay, asked, _ = relay_over({"a": "cooled"})
    relay.start()  # claims the probe
    breaker = relay.plane.workers["a"].breaker  # type: ignore[attr-defined]
    assert asked == ["a"] and breaker.state == "half_open"
    end_without_a_verdict(relay, how)
    assert breaker.state == "open"
    assert breaker.allow() is True  # the next request probes at once
