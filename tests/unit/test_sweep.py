"""The sweep's book and loop, with injected fetch, vet, clock and sleep."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from cachetree.ranks import RankId
from peer.sweep import (
    BODY_REFUSED,
    CONNECTION_REFUSED,
    FETCHED_ACCEPTED,
    FLEET_COLD,
    FOUND,
    NO_PEERS,
    NOT_A_SIBLING,
    RANKS_RESOLVED,
    STALE,
    TIMED_OUT,
    FetchOutcome,
    Gapped,
    SweepBook,
    SweepDeps,
    VetFailure,
    asked_last,
    sit_out_passes,
    stale_ranks,
    sweep,
)
from tests.support.waiting import eventually

R1 = RankId("http://w1", 0)
R2 = RankId("http://w2", 0)


@dataclass(frozen=True)
class Ob:
    rank: RankId
    epoch: int


@dataclass
class Body:
    nodes: list
    covers: frozenset = frozenset()
    empty_ranks: list = field(default_factory=list)
    rejected: str = ""
    cold: frozenset = frozenset()  # covered ranks the producer holds as cold
    seqs: dict = field(default_factory=dict)  # cursors of covered ranks not at 0

    @property
    def node_count(self) -> int:
        return len(self.nodes)


@dataclass
class W:
    url: str
    dp_rank: int


class Vetted:
    def __init__(self, covers: frozenset, cold: frozenset = frozenset(), seqs: Any = None) -> None:
        self.covers = covers
        self.cold = cold
        self.cursors = {rank: (seqs or {}).get(rank, 0) for rank in covers}

    def covers_any(self, ranks: Any) -> bool:
        return bool(self.covers & set(ranks))

    def covers_warm(self, ranks: Any) -> bool:
        return bool((self.covers - self.cold) & set(ranks))


async def vet(body: Body) -> Vetted:
    if body.rejected:
        raise VetFailure("rejected", body.rejected)
    if not body.nodes:
        raise VetFailure("cold_peer", "producer_cold")
    return Vetted(body.covers, body.cold, body.seqs)


@dataclass
class Registry:
    peers: list[str]
    version: int = 0
    synced: bool = True
    ever: bool = True

    def candidates(self) -> list[str]:
        return list(self.peers)

    def known_to_have_no_peers(self) -> bool:
        return self.synced and not self.peers and not self.ever


class Fleet:
    """Scripted peers: each peer answers with the next body in its list (the last repeats)."""

    def __init__(self, answers: dict[str, list[Body | None]]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, float]] = []
        self.now = 100.0
        self.tallies: list[str] = []
        self.abandoned: list[Any] = []

    async def fetch(self, peer: str, max_age_s: float) -> FetchOutcome:
        self.asked.append((peer, max_age_s))
        script = self.answers[peer]
        body = script.pop(0) if len(script) > 1 else script[0]
        return FetchOutcome(body, self.now, "" if body else "connection refused")

    async def sleep(self, s: float) -> None:
        self.now += s
        await asyncio.sleep(0)

    async def abandon(self, obs: list) -> None:
        self.abandoned.extend(obs)

    def deps(self, registry: Registry, owed: set | None = None) -> SweepDeps:
        def still_owed(obs: list) -> list:
            return [o for o in obs if owed is None or o in owed]

        return SweepDeps(
            registry=registry,
            fetch=self.fetch,
            vet=vet,
            still_owed=still_owed,
            abandon=self.abandon,
            clock=lambda: self.now,
            sleep=self.sleep,
            tally=self.tallies.append,
        )


def test_cooldown_sits_a_peer_out_4_8_16_32_64_then_120_passes() -> None:
    assert [sit_out_passes(n) for n in range(1, 8)] == [4, 8, 16, 32, 64, 120, 120]


def test_a_peer_that_never_answered_vetoes_fleet_cold() -> None:
    book = SweepBook(0.0)
    book.answered("a", 1.0, has_nodes=False, empty_ranks=[])
    assert not book.fleet_is_cold(["a", "b"])
    book.answered("b", 1.0, has_nodes=False, empty_ranks=[])
    assert book.fleet_is_cold(["a", "b"])
    assert not book.fleet_is_cold([])


def test_unreachable_clears_what_the_peer_last_said() -> None:
    book = SweepBook(0.0)
    book.answered("a", 1.0, has_nodes=False, empty_ranks=[R1])
    book.unreachable("a")
    assert not book.fleet_is_cold(["a"])
    assert not book.nothing_to_recover(R1, ["a"])


def test_nothing_to_recover_needs_every_peer_to_name_the_rank_or_be_cold() -> None:
    book = SweepBook(0.0)
    book.answered("a", 1.0, has_nodes=True, empty_ranks=[R1])
    book.answered("b", 1.0, has_nodes=False, empty_ranks=[])
    assert book.nothing_to_recover(R1, ["a", "b"])
    assert not book.nothing_to_recover(R2, ["a", "b"])
    assert not book.nothing_to_recover(R1, ["a", "b", "c"])  # c never answered


def test_freshness_ratchet_demands_an_export_newer_than_the_last_answer() -> None:
    book = SweepBook(freshness_floor=10.0)
    assert book.max_age_s("a", now=15.0) == 5.0
    book.answered("a", 13.0, has_nodes=True, empty_ranks=[])
    assert book.max_age_s("a", now=15.0) == 2.0


def test_sit_out_skips_exactly_that_many_passes() -> None:
    book = SweepBook(0.0)
    book.miss("a")
    skipped = 0
    while book.should_skip("a"):
        skipped += 1
    assert skipped == 4


async def test_sweep_returns_the_first_body_that_covers_an_owed_rank() -> None:
    fleet = Fleet({"a": [Body([1], covers=frozenset({R2}))], "b": [Body([1], frozenset({R1}))]})
    result, cold = await sweep([Ob(R1, 1)], fleet.deps(Registry(["a", "b"])), 5.0, 99.0)
    assert result.outcome == FOUND and result.peer == "b"
    assert fleet.tallies == ["cold_peer", FETCHED_ACCEPTED]
    assert cold == []
    assert fleet.asked[0] == ("a", 1.0)  # max age from the freshness floor


async def test_sweep_is_fleet_cold_when_every_peer_is_cold_or_rejected() -> None:
    fleet = Fleet({"a": [Body([])], "b": [Body([1], rejected="block size 32")]})
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["a", "b"])), 5.0, 100.0)
    assert result.outcome == FLEET_COLD and result.peers_tried == 2


async def test_a_membership_swap_of_the_same_size_discards_the_cold_verdict() -> None:
    registry = Registry(["a"])
    fleet = Fleet({"a": [Body([])], "b": [Body([1], frozenset({R1}))]})
    original_fetch = fleet.fetch

    async def fetch_and_swap(peer: str, max_age_s: float) -> FetchOutcome:
        out = await original_fetch(peer, max_age_s)
        if peer == "a" and registry.version == 0:
            registry.peers, registry.version = ["b"], 1  # same size, another member
        return out

    fleet.fetch = fetch_and_swap  # type: ignore[method-assign]
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(registry), 5.0, 100.0)
    assert result.outcome == FOUND and result.peer == "b"


@pytest.mark.parametrize("written", ["http://w1", "HTTP://W1:80/"])  # as the registry spells it
async def test_ranks_every_peer_holds_nothing_of_are_abandoned_mid_sweep(written: str) -> None:
    fleet = Fleet(
        {
            "a": [Body([1], covers=frozenset(), empty_ranks=[W(written, 0)])],
        }
    )
    owed = {Ob(R1, 1), Ob(R2, 1)}
    result, cold = await asyncio.wait_for(
        sweep([Ob(R1, 1), Ob(R2, 1)], fleet.deps(Registry(["a"]), owed), 0.2, 100.0), 2
    )
    assert cold == [Ob(R1, 1)]
    assert fleet.abandoned == [Ob(R1, 1)]
    assert result.outcome == TIMED_OUT and result.peers_tried == 1


async def test_no_peers_when_synced_empty_and_never_had_any() -> None:
    fleet = Fleet({})
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry([], ever=False)), 5.0, 100.0)
    assert result.outcome == NO_PEERS


async def test_an_empty_set_after_having_peers_is_a_dip_not_no_peers() -> None:
    fleet = Fleet({})
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry([], ever=True)), 0.1, 100.0)
    assert result.outcome == TIMED_OUT and result.peers_tried == 0


async def test_nothing_owed_any_more_resolves_the_sweep() -> None:
    fleet = Fleet({"a": [None]})
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["a"]), owed=set()), 5.0, 100.0)
    assert result.outcome == RANKS_RESOLVED
    assert fleet.asked == []


async def test_unreachable_peers_time_out_with_the_last_reason() -> None:
    fleet = Fleet({"a": [None]})
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["a"])), 0.1, 100.0)
    assert result.outcome == TIMED_OUT
    assert "connection refused" in result.last_reason
    assert fleet.tallies.count("unreachable") == len(fleet.asked) >= 1


# -- hardening: bodies refused, addresses refused, hedged passes (issue 13 rows 6, 7) -------


@pytest.mark.parametrize(
    ("kind", "why"),
    [(BODY_REFUSED, "inflated body exceeds the bound"), (NOT_A_SIBLING, "HTTP 401 Unauthorized")],
)
async def test_a_refused_body_or_a_refusing_sibling_is_left_out_for_good_fetched_once(
    kind: str, why: str
) -> None:
    fleet = Fleet({"bomb": [None], "cold": [Body([])]})
    refused = {"bomb"}
    plain_fetch = fleet.fetch

    async def fetch(peer: str, max_age_s: float) -> FetchOutcome:
        out = await plain_fetch(peer, max_age_s)
        if peer in refused:
            return FetchOutcome(None, fleet.now, why, kind)
        return out

    fleet.fetch = fetch  # type: ignore[method-assign]
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["bomb", "cold"])), 60.0, 100.0)
    assert result.outcome == FLEET_COLD  # the refusal counts as an answer: it holds nothing
    assert [peer for peer, _ in fleet.asked].count("bomb") == 1
    assert fleet.tallies.count(kind) == 1 and fleet.now < 110  # no deadline waited


async def test_a_refused_connection_is_a_cold_witness_at_once() -> None:
    fleet = Fleet({"gone": [None]})
    plain_fetch = fleet.fetch

    async def fetch(peer: str, max_age_s: float) -> FetchOutcome:
        await plain_fetch(peer, max_age_s)
        return FetchOutcome(None, fleet.now, "connection refused", CONNECTION_REFUSED)

    fleet.fetch = fetch  # type: ignore[method-assign]
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["gone"])), 120.0, 100.0)
    assert result.outcome == FLEET_COLD and len(fleet.asked) == 1
    assert fleet.tallies == [CONNECTION_REFUSED] and fleet.now == 100.0  # first pass


async def test_a_fleet_cold_sweep_names_each_sibling_that_gave_nothing_and_why() -> None:
    fleet = Fleet({"gone": [None], "typo": [None], "cold": [Body([])]})
    plain_fetch = fleet.fetch

    async def fetch(peer: str, max_age_s: float) -> FetchOutcome:
        out = await plain_fetch(peer, max_age_s)
        if out.body is None:
            return FetchOutcome(None, fleet.now, "connection refused", CONNECTION_REFUSED)
        return out

    fleet.fetch = fetch  # type: ignore[method-assign]
    registry = Registry(["gone", "typo", "cold"])
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(registry), 120.0, 100.0)
    assert result.outcome == FLEET_COLD and len(fleet.asked) == 3
    assert sorted(result.last_reason.split("; ")) == [
        "cold: producer_cold",
        "gone: connection refused",
        "typo: connection refused",
    ]


class Hanging:
    """A fetch per peer that never returns until cancelled (a sibling trickling 1 B / 20 s)."""

    def __init__(self, fleet: Fleet, slow: set[str]) -> None:
        self.fleet, self.slow = fleet, slow
        self.plain = fleet.fetch
        self.cancelled: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self, peer: str, max_age_s: float) -> FetchOutcome:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if peer in self.slow:
                self.fleet.asked.append((peer, max_age_s))
                await asyncio.Event().wait()
            return await self.plain(peer, max_age_s)
        except asyncio.CancelledError:
            self.cancelled.append(peer)
            raise
        finally:
            self.in_flight -= 1


async def test_a_slow_sibling_first_in_line_does_not_hold_up_a_good_one() -> None:
    fleet = Fleet({"slow": [None], "good": [Body([1], frozenset({R1}))]})
    fleet.fetch = hanging = Hanging(fleet, {"slow"})  # type: ignore[method-assign]
    deps = fleet.deps(Registry(["slow", "good"]))
    deps.hedge_after_s = 0.0  # the hedge is due at once: what matters is that it happens
    result, _ = await asyncio.wait_for(sweep([Ob(R1, 1)], deps, 120.0, 100.0), 5)
    assert result.outcome == FOUND and result.peer == "good"
    assert [p for p, _ in fleet.asked] == ["slow", "good"]
    assert hanging.cancelled == ["slow"]  # the straggler is dropped with its partial body


async def test_no_more_than_max_in_flight_fetches_run_at_once() -> None:
    fleet = Fleet({p: [None] for p in ("s1", "s2", "s3")} | {"good": [Body([1], frozenset({R1}))]})
    fleet.fetch = hanging = Hanging(fleet, {"s1", "s2", "s3"})  # type: ignore[method-assign]
    deps = fleet.deps(Registry(["s1", "s2", "s3", "good"]))
    deps.hedge_after_s = 0.0
    task = asyncio.create_task(sweep([Ob(R1, 1)], deps, 120.0, 100.0))
    await eventually(lambda: hanging.in_flight == 2, 5)
    for _ in range(50):  # the pass has every chance to start another one; it must not
        await asyncio.sleep(0)
    assert hanging.most_in_flight == deps.max_in_flight == 2
    assert [p for p, _ in fleet.asked] == ["s1", "s2"]  # s3 and good wait for a free slot
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(hanging.cancelled) == ["s1", "s2"]


# -- cold covers: a sibling cold for a rank is a fallback, not a winner ----------------------


@pytest.mark.parametrize("order", [["cold", "warm"], ["warm", "cold"]])
async def test_a_sibling_warm_for_the_rank_wins_over_a_cold_one_in_either_order(
    order: list[str],
) -> None:
    fleet = Fleet(
        {
            "cold": [Body([1], frozenset({R1}), cold=frozenset({R1}))],
            "warm": [Body([1], frozenset({R1}))],
        }
    )
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(order)), 5.0, 100.0)
    assert result.outcome == FOUND and result.peer == "warm"
    assert result.vetted.cold == frozenset()
    # The cold body, met first, is passed over, not accepted; met second, never asked for.
    expected = ["cold_peer", FETCHED_ACCEPTED] if order[0] == "cold" else [FETCHED_ACCEPTED]
    assert fleet.tallies == expected


async def test_a_cold_cover_is_taken_at_the_end_of_a_pass_with_no_warm_one() -> None:
    fleet = Fleet(
        {
            "cold": [Body([1], frozenset({R1}), cold=frozenset({R1}))],
            "down": [None],
            "other": [Body([1], frozenset({R2}))],  # warm, but not for an owed rank
        }
    )
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["cold", "down", "other"])), 5, 100)
    assert result.outcome == FOUND and result.peer == "cold"
    assert [p for p, _ in fleet.asked] == ["cold", "down", "other"]  # one pass, every peer
    assert sorted(fleet.tallies) == sorted([FETCHED_ACCEPTED, "unreachable", "cold_peer"])


async def test_a_body_warm_for_one_owed_rank_wins_though_cold_for_another() -> None:
    fleet = Fleet(
        {
            "mixed": [Body([1], frozenset({R1, R2}), cold=frozenset({R2}))],
            "warm": [Body([1], frozenset({R1, R2}))],
        }
    )
    result, _ = await sweep([Ob(R1, 1), Ob(R2, 1)], fleet.deps(Registry(["mixed", "warm"])), 5, 1)
    assert result.outcome == FOUND and result.peer == "mixed"
    assert [p for p, _ in fleet.asked] == ["mixed"]


async def test_a_cold_cover_is_taken_when_the_budget_runs_out_mid_pass() -> None:
    fleet = Fleet({"cold": [Body([1], frozenset({R1}), cold=frozenset({R1}))], "slow": [None]})
    fleet.fetch = hanging = Hanging(fleet, {"slow"})  # type: ignore[method-assign]
    deps = fleet.deps(Registry(["cold", "slow"]))
    deps.hedge_after_s = 0.0
    result, _ = await asyncio.wait_for(sweep([Ob(R1, 1)], deps, 0.2, 100.0), 5)
    assert result.outcome == FOUND and result.peer == "cold"
    assert hanging.cancelled == ["slow"]
    assert fleet.tallies == [FETCHED_ACCEPTED]


# -- gap retries: the sibling whose snapshot gapped, and bodies as old as it ---------------


def test_a_retry_asks_the_sibling_whose_snapshot_gapped_last_keeping_the_rest_in_order() -> None:
    assert asked_last(["f", "a", "g", "b"], {"f", "g"}) == ["a", "b", "f", "g"]
    assert asked_last(["f"], {"f"}) == ["f"]  # the only sibling is still asked
    assert asked_last(["a", "b"], set()) == ["a", "b"]


def test_a_cursor_below_what_the_held_stream_needs_is_stale_for_that_rank_only() -> None:
    gaps = {R1: Gapped("f", 6)}
    assert stale_ranks({R1: 5, R2: 0}, gaps) == {R1}
    assert stale_ranks({R1: 6}, gaps) == frozenset()  # joins the queue's head at 7
    assert stale_ranks({R2: 0}, gaps) == frozenset()  # silent on R1: not stale, uncovering


FROZEN = Body([1], frozenset({R1}), seqs={R1: 5})  # the export that gapped, served again
WARM = Body([1], frozenset({R1}), seqs={R1: 9})


@pytest.mark.parametrize("order", [["frozen", "warm"], ["warm", "frozen"]])
async def test_a_gap_retry_takes_the_current_sibling_not_the_one_whose_snapshot_gapped(
    order: list[str],
) -> None:
    fleet = Fleet({"frozen": [FROZEN], "warm": [WARM]})
    gaps = {R1: Gapped("frozen", 6)}
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(order)), 5.0, 100.0, gaps)
    assert result.outcome == FOUND and result.peer == "warm"
    assert [peer for peer, _ in fleet.asked] == ["warm"]  # the gapped one is asked last
    assert fleet.tallies == [FETCHED_ACCEPTED]


async def test_a_stale_body_is_never_taken_even_when_its_sibling_answers_first() -> None:
    # The warm sibling is unreachable in the first pass: the frozen one is asked then, and
    # its body (as old as the one that gapped) is counted stale, not accepted.
    fleet = Fleet({"frozen": [FROZEN], "warm": [None, WARM]})
    deps = fleet.deps(Registry(["warm", "frozen"]))
    deps.hedge_after_s = 0.0
    result, _ = await sweep([Ob(R1, 1)], deps, 60.0, 100.0, {R1: Gapped("frozen", 6)})
    assert result.outcome == FOUND and result.peer == "warm"
    assert fleet.tallies.count(STALE) >= 1
    assert fleet.tallies.count(FETCHED_ACCEPTED) == 1


async def test_a_sibling_that_caught_up_since_its_snapshot_gapped_is_taken() -> None:
    fleet = Fleet({"frozen": [Body([1], frozenset({R1}), seqs={R1: 6})]})
    gaps = {R1: Gapped("frozen", 6)}
    result, _ = await sweep([Ob(R1, 1)], fleet.deps(Registry(["frozen"])), 5.0, 100.0, gaps)
    assert result.outcome == FOUND and result.peer == "frozen"


async def test_a_retried_rank_every_sibling_is_stale_for_settles_cold_after_one_pass() -> None:
    fleet = Fleet({"f1": [FROZEN], "f2": [FROZEN]})
    gaps = {R1: Gapped("f1", 6)}
    start = fleet.now
    result, cold = await sweep([Ob(R1, 1)], fleet.deps(Registry(["f1", "f2"])), 60.0, 100.0, gaps)
    assert cold == [Ob(R1, 1)] and fleet.abandoned == [Ob(R1, 1)]
    assert result.outcome == RANKS_RESOLVED
    assert fleet.now - start <= 0.25  # one pass, not the 60 s budget
    assert fleet.tallies == [STALE, STALE]
