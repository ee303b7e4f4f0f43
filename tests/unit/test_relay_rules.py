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


def relay_over(
    states: dict[str, str], ranked: list[RankId] | None = None
) -> tuple[WorkerRelay, list[str], list[Refusal]]:
    """A `WorkerRelay` over ranks of workers in the given breaker states: `ranked`, else rank 0
    of each, in that order."""
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
        failure_warnings={},
    )
    client = SimpleNamespace(refuse=refused.append, gate=None)  # a client without a socket
    head = read_request_head(b"POST", b"/v1/completions", True, [(b"Host", b"r")], True)
    if ranked is None:
        ranked = [RankId(url, 0) for url in states]
    decision = Decision(list(map(Candidate, ranked)), "cache_miss", 0)
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


class _Conn:
    """The connection an answer head came on (dropped when the relay moves on)."""

    def discard(self) -> None:
        pass


Answer = int | str  # a head's status, or "connect" (refused)


def answer_in_turn(relay: WorkerRelay, refused: list[Refusal], answers: list[Answer]) -> int:
    """Each attempt the relay makes gets the next of `answers`: the status the client gets (a
    worker's relayed head, or the relay's own refusal)."""
    relay.start()
    for answer in answers:
        if answer == "connect":
            relay.upstream_failed("connect", "refused")
        else:
            assert isinstance(answer, int)
            relay.conn = _Conn()  # type: ignore[assignment]
            if relay.accept_head(answer):
                return answer
        if refused:
            return refused[-1].status
    raise AssertionError(f"the relay made more attempts than the {len(answers)} scripted")


def trips(relay: WorkerRelay) -> dict[str, int]:
    return {url: w.breaker.trips for url, w in relay.plane.workers.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("answers", "asked", "status", "counted"),
    [
        # Another worker served the request: the 5xx was its worker's.
        ([500, 200], "ab", 200, "a"),
        # A second worker's 500 to the same request: the request's doing, relayed at once
        # (no third attempt), counted by neither breaker.
        ([500, 500], "ab", 500, ""),
        ([500, 501], "ab", 501, ""),
        ([500, 400], "ab", 400, ""),  # a 4xx says so too
        # 502, 503 and 504 speak of the worker whatever the request: counted at once, and
        # they neither hold nor confirm.
        ([503, 503, 503], "abc", 503, "abc"),
        ([502, 504, 200], "abc", 200, "ab"),
        ([503, 500, 500], "abc", 500, "a"),
        ([500, 503, 200], "abc", 200, "ab"),
        ([500, 503, 500], "abc", 500, "b"),
        # A connection error says nothing of the request: counted as ever.
        ([500, "connect", 500], "abc", 500, "b"),
        ([500, "connect", 200], "abc", 200, "ab"),
    ],
)
def test_a_5xx_counts_against_its_worker_unless_a_second_worker_answers_the_request_5xx_too(
    answers: list[Answer], asked: str, status: int, counted: str
) -> None:
    relay, tried, refused = relay_over(dict.fromkeys("abc", "closed"))
    assert answer_in_turn(relay, refused, answers) == status
    assert tried == list(asked)
    assert trips(relay) == {url: int(url in counted) for url in "abc"}


@pytest.mark.parametrize(
    ("answers", "status", "counted"),
    [
        ([500], 500, "a"),  # the last rank's own answer, relayed
        ([500, "connect"], 502, "ab"),  # no other worker answered
    ],
)
def test_a_held_5xx_counts_against_its_worker_when_no_other_worker_answers(
    answers: list[Answer], status: int, counted: str
) -> None:
    relay, tried, refused = relay_over(dict.fromkeys("ab"[: len(answers)], "closed"))
    assert answer_in_turn(relay, refused, answers) == status
    assert trips(relay) == {url: int(url in counted) for url in tried}


def test_a_workers_other_ranks_are_no_second_opinion_on_its_5xx() -> None:
    """Its other rank is the same engine: a worker failing every request would pass for a
    poison request on its own two ranks, and a poison request cost three attempts."""
    relay, tried, refused = relay_over(
        {"a": "closed", "b": "closed"}, [RankId("a", 0), RankId("a", 1), RankId("b", 0)]
    )
    assert answer_in_turn(relay, refused, [500, 500]) == 500
    assert tried == ["a", "b"] and trips(relay) == {"a": 0, "b": 0}

    relay, tried, refused = relay_over({"a": "closed"}, [RankId("a", 0), RankId("a", 1)])
    assert answer_in_turn(relay, refused, [500]) == 500
    assert tried == ["a"] and trips(relay) == {"a": 1}


@pytest.mark.parametrize(
    ("second", "state", "cooldown_s"),
    [
        (200, "open", 10.0),  # the probe failed: open again, its cooldown doubled
        (500, "open", 5.0),  # no verdict: the slot freed, the next request probes at once
        ("gone", "open", 5.0),  # the client left before the request's outcome: no verdict
    ],
)
def test_a_probe_held_by_a_request_answered_5xx_ends_when_the_requests_outcome_is_known(
    second: Answer, state: str, cooldown_s: float
) -> None:
    relay, tried, _ = relay_over({"a": "cooled", "b": "closed"})
    breaker = relay.plane.workers["a"].breaker  # type: ignore[attr-defined]
    relay.start()
    assert breaker.state == "half_open"
    relay.conn = _Conn()  # type: ignore[assignment]
    assert not relay.accept_head(500)
    assert tried == ["a", "b"] and breaker.state == "half_open"  # held while b answers
    if second == "gone":
        relay.client_gone()
    else:
        assert isinstance(second, int)
        relay.conn = _Conn()  # type: ignore[assignment]
        assert relay.accept_head(second)
    assert (breaker.state, breaker.cooldown_s) == (state, cooldown_s)
    assert breaker.allow() is (cooldown_s == 5.0)  # a freed slot is claimed at once
