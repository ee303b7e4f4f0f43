"""The pressure ledger: recent demand per rank (decayed, distinct blocks) and bookings.

The clock is a ManualClock; the index a booking is confirmed against is a real BlockTree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import router.pressure as pressure_module
from cachetree.keys import block_keys
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.pressure import PressureLedger, PressureSettings
from tests.support.clock import ManualClock

T = TypeVar("T")
BS = 16
A, B, C = (RankId(f"http://{h}:8000", 0) for h in "abc")


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 104_729) % 50_000 + 3 for i in range(blocks * BS)]


def keys(seed: int, blocks: int) -> list[int]:
    return block_keys(tokens(seed, blocks), BS)


def ledger(clock: ManualClock, **settings: float) -> PressureLedger:
    return PressureLedger(PressureSettings(**settings), clock)  # type: ignore[arg-type]


class Index:
    """A real BlockTree, and a way to store a prompt on a rank as its engine would."""

    def __init__(self) -> None:
        self.tree = BlockTree(BS)
        self._hash = 1

    def store(self, rank: RankId, seed: int, blocks: int) -> list[int]:
        return self.store_tokens(rank, tokens(seed, blocks))

    def store_tokens(self, rank: RankId, ids: list[int]) -> list[int]:
        blocks = len(ids) // BS
        hashes = list(range(self._hash, self._hash + blocks))
        self._hash += blocks
        self.tree.store(rank, None, hashes, ids, BS)
        return hashes

    def holds(self, rank: RankId, key: int) -> bool:
        return self.tree.engine_hash(rank, key) is not None


# --- demand ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after_s", "demand"),
    [(0.0, 40.0), (10.0, 20.0), (20.0, 10.0), (40.0, 2.5)],
)
def test_demand_counts_routed_blocks_and_halves_every_half_life(
    after_s: float, demand: float
) -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=10.0)
    led.record(A, keys(1, 40))
    clock.advance(after_s)
    assert led.demand(A) == pytest.approx(demand)
    assert led.demands([A, B]) == [pytest.approx(demand), 0.0]


def test_demand_counts_distinct_blocks_where_they_were_last_routed() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=10.0)
    shared = keys(1, 30)
    led.record(A, shared + keys(2, 10))  # 40 blocks
    clock.advance(10.0)  # all of them weigh 1/2 now: 20
    led.record(A, shared + keys(3, 10))  # 30 refreshed to 1, 10 new at 1, 10 old at 1/2
    assert led.demand(A) == pytest.approx(30 + 10 + 5)
    assert led.tracked_blocks == 50
    # Routed to another rank, the blocks' demand moves with this replica's traffic: a copy
    # left behind on A is no longer something A must keep for it.
    led.record(B, shared)
    assert (led.demand(A), led.demand(B)) == (pytest.approx(10 + 5), pytest.approx(30))
    assert led.tracked_blocks == 50
    led.record(A, keys(2, 10))  # routed again where they are: refreshed, nothing moves
    assert (led.demand(A), led.demand(B)) == (pytest.approx(10 + 10), pytest.approx(30))


def test_blocks_nobody_routed_for_sixteen_half_lives_are_forgotten() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    led.record(A, keys(1, 20))
    clock.advance(16.5)
    led.record(A, keys(2, 5))  # recording a rank prunes its old pairs
    assert led.tracked_blocks == 5
    assert led.demand(A) == pytest.approx(5)


def test_a_block_counts_as_routed_to_the_rank_it_went_to_last_until_it_is_forgotten() -> None:
    """`routed` tells a new prefix's blocks (never routed lately) from the rest of one an
    engine evicted (cache_aware's shared-preamble charge with one holder reads it), and
    `last_routed` names the rank a prefix gone from every cache was last sent to."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    a, b = keys(1, 4), keys(2, 4)
    led.record(A, a)
    led.record(B, b[:2])
    assert [led.routed(k) for k in a + b] == [True] * 6 + [False] * 2
    assert [led.last_routed(k) for k in a + b] == [A] * 4 + [B] * 2 + [None] * 2
    clock.advance(0.5)  # past the refresh window: weighed again where it goes now
    led.record(C, a[:2])
    assert [led.last_routed(k) for k in a] == [C, C, A, A]
    clock.advance(16.5)
    led.record(A, keys(3, 1))
    led.record(B, keys(4, 1))
    led.record(C, keys(5, 1))
    assert not any(led.routed(k) for k in a + b)
    assert {led.last_routed(k) for k in a + b} == {None}


def test_a_rank_no_longer_routed_to_is_swept_and_forgotten() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    led.record(A, keys(1, 20))
    clock.advance(20.0)
    for seed in range(4):  # each record sweeps one more rank, in turn
        led.record(B, keys(10 + seed, 1))
    assert led.ranks() == [B]
    assert led.tracked_blocks == 4


def test_a_record_whose_sweep_lands_on_its_own_rank_prunes_that_rank_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a two-rank fleet every other record's sweep lands on the rank it recorded: pruned
    again at the same time it would drop nothing, so it is not (the property test of the
    bounds pins that nothing changes)."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    led.record(A, keys(1, 4))
    led.record(B, keys(2, 4))
    pruned: list[RankId] = []
    prune = led._prune

    def counted(state: object, now: float) -> None:
        pruned.append(state.rank)  # type: ignore[attr-defined]
        prune(state, now)  # type: ignore[arg-type]

    monkeypatch.setattr(led, "_prune", counted)
    for seed in range(4):
        pruned.clear()
        led.record(A, keys(10 + seed, 2))
        # The sweep visits A and B in turn: A is pruned by the record alone, B by the sweep.
        assert pruned == ([A] if seed % 2 == 0 else [A, B])


def test_memory_is_bounded_each_rank_keeping_its_share_of_the_newest() -> None:
    clock = ManualClock()
    led = ledger(clock, max_tracked_blocks=100, booking_ttl_s=0.0)
    led.record(A, keys(1, 80))
    assert led.tracked_blocks == 80
    led.record(B, keys(2, 80))  # two ranks now: 50 each, the oldest pairs go first
    led.record(A, keys(3, 10))
    assert led.tracked_blocks <= 100
    assert led.demand(B) == pytest.approx(50)
    assert led.demand(A) == pytest.approx(50)


def test_a_forgotten_rank_goes_at_once_with_its_pairs_and_bookings_its_share_to_the_rest() -> None:
    """A worker that left the registry: its ranks' pairs held their share of the bound for 16
    half-lives, halving a live rank's demand after a rollout to new addresses."""
    clock = ManualClock()
    led = ledger(clock, max_tracked_blocks=100, booking_ttl_s=5.0)
    gone = keys(1, 80)
    led.record(A, gone, held=70)  # its last 10 blocks booked
    led.record(B, keys(2, 80), held=80)  # two ranks: 50 pairs each
    assert led.demand(B) == pytest.approx(50) and led.booked_blocks == 10
    led.forget_ranks([A, C])  # C: never recorded, nothing to forget
    assert led.ranks() == [B]
    assert led.tracked_blocks == 50 and not any(map(led.routed, gone))
    assert led.bookings.departed == 1 and led.booked_blocks == 0 and led.pending(A) == 0
    assert led.booked_depths(gone, {}) == {}
    led.record(B, keys(3, 80), held=80)  # B's share is the whole bound now
    assert led.demand(B) == pytest.approx(100)
    clock.advance(5.0)
    led.settle(None)  # nothing of A's is left to expire
    assert (led.bookings.expired, led.bookings.departed) == (0, 1)


def test_demand_stays_exact_across_a_rebase_of_the_weights_origin() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    led.record(A, keys(1, 8))
    for step in range(300):  # far past 256 half-lives: the origin moves at least once
        clock.advance(1.0)
        led.record(A, keys(1, 8))
        led.record(B, keys(2 + step % 3, 4))
    assert led.demand(A) == pytest.approx(8)
    # B's three prompts were routed one, two and three seconds ago: 4 * (1 + 1/2 + 1/4).
    assert led.demand(B) == pytest.approx(4 * 1.75)


# --- bookings -------------------------------------------------------------------------------


def test_a_booking_extends_the_index_depth_until_the_index_shows_the_blocks() -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 40)
    index.store(A, 1, 10)  # the index already shows the first ten blocks on A
    led.record(A, prompt, held=10, holds=index.holds)
    assert led.live_bookings(A) == 1 and led.pending(A) == 30
    assert led.booked_depths(prompt, {A: 10}) == {A: 40}
    assert led.booked_depths(prompt, {}) == {}  # a booking starts where the index ends
    assert led.booked_depths(keys(1, 20) + keys(9, 5), {A: 10}) == {A: 20}
    # The store event arrives: the booking is confirmed and stops counting at once, so a
    # later eviction is seen as it is, not hidden behind the booking.
    hashes = index.store(A, 1, 40)
    led.settle(index.holds)
    assert (led.bookings.made, led.bookings.confirmed, led.bookings.expired) == (1, 1, 0)
    assert led.live_bookings(A) == 0 and led.pending(A) == 0
    index.tree.remove(A, hashes[20:])
    assert led.booked_depths(prompt, {A: 20}) == {}


@pytest.mark.parametrize(
    ("stored", "live", "confirmed"),
    [
        ((), 1, 0),
        (("other",), 1, 0),  # another prompt stored the shared preamble: not this one's store
        (("other", "mine"), 0, 1),
        (("mine",), 0, 1),
    ],
)
def test_a_booking_below_a_shared_preamble_is_confirmed_by_its_own_blocks(
    stored: tuple[str, ...], live: int, confirmed: int
) -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    preamble = tokens(1, 2)  # a system prompt no rank holds yet, two new prefixes below it
    prompts = {"mine": preamble + tokens(2, 6), "other": preamble + tokens(3, 6)}
    mine = block_keys(prompts["mine"], BS)
    led.record(A, mine, held=0, holds=index.holds)
    for name in stored:
        index.store_tokens(A, prompts[name])
    led.settle(index.holds)
    assert (led.live_bookings(A), led.bookings.confirmed) == (live, confirmed)
    depth = 8 if "mine" in stored else 2 if stored else 0  # what the index shows of it on A
    assert led.booked_depths(mine, {A: depth}) == ({A: 8} if live else {})


@pytest.mark.parametrize(
    ("after_s", "booked_depth", "expired"),
    [(4.999, 40, 0), (5.0, None, 1), (60.0, None, 1)],
)
def test_a_booking_the_index_never_confirms_expires_at_its_ttl(
    after_s: float, booked_depth: int | None, expired: int
) -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 40)
    led.record(A, prompt, holds=index.holds)
    clock.advance(after_s)
    led.settle(index.holds)
    expected = {} if booked_depth is None else {A: booked_depth}
    assert led.booked_depths(prompt, {}) == expected
    assert (led.bookings.expired, led.bookings.confirmed) == (expired, 0)
    assert led.live_bookings(A) == 1 - expired
    assert led.demand(A) > 0  # an expired booking is still recent demand


@pytest.mark.parametrize(
    ("again_after_s", "held", "told"),
    [
        (None, 0, (0, 40)),  # a new prompt: everything changed, from the first key
        (0.1, 40, (40, 40)),  # the same prompt, all held, refreshed a moment ago: nothing
        (0.1, 30, (30, 40)),  # the same prompt, 30 held: the booking of the last 10 is news
        (1.0, 40, (0, 40)),  # past 1/64 of the half-life: every weight is refreshed
    ],
)
def test_record_returns_the_keys_whose_change_siblings_need_to_hear(
    again_after_s: float | None, held: int, told: tuple[int, int]
) -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    prompt = keys(1, 40)
    if again_after_s is not None:
        led.record(A, prompt, held=40)
        clock.advance(again_after_s)
    assert led.record(A, prompt, held=held) == told


@pytest.mark.parametrize(
    ("more", "held", "told"),
    [
        (4, 30, (30, 30)),  # an own tail after a fresh prefix, the prefix held: no news
        (4, 26, (26, 30)),  # ... the prefix's last 4 blocks booked: those are news, not the tail
        (40, 30, (30, 70)),  # longer than what it shares: another prefix below it, news
    ],
)
def test_record_tells_no_prompts_own_tail(more: int, held: int, told: tuple[int, int]) -> None:
    clock = ManualClock()
    led = ledger(clock)
    head = keys(1, 30)
    led.record(A, head, held=30)
    longer = block_keys(tokens(1, 30) + tokens(7, more), BS)
    assert longer[:30] == head
    assert led.record(A, longer, held=held) == told


# A 20-block prefix, then tails of its requests' own (block_keys chain: a tail's keys depend
# on the prefix before it).
PREFIX = tokens(1, 20)


def request(tail_seed: int, tail_blocks: int) -> list[int]:
    return block_keys(PREFIX + tokens(tail_seed, tail_blocks), BS)


@pytest.mark.parametrize(
    ("first", "then", "after_s", "demand", "fresh", "kept"),
    [
        # A request's own 2-block tail, superseded by the next request's, whose own tail
        # leaves the working set at once: only the prefix stays.
        (request(7, 2), request(8, 2), 1.0, 24.0, 20.0, 0.0),
        (request(7, 2), request(8, 3), 1.0, 25.0, 20.0, 0.0),
        # The next one extends the whole earlier prompt (a conversation's next turn): the
        # earlier turn kept, the new one left out until a next turn takes it up.
        (request(7, 2), block_keys(PREFIX + tokens(7, 2) + tokens(8, 2), BS), 1.0, 24.0, 22, 0),
        # What the earlier prompt keeps is longer than what is shared: another prefix below a
        # shared preamble, still in use; and so is the new one.
        (request(7, 30), request(8, 30), 1.0, 80.0, 50.0, 30.0),
        # Routed again within a 64th of a half-life: the prefix keeps its place, the first
        # request's tail with it (one batch: its end was not known yet); the new tail is out.
        (request(7, 2), request(8, 2), 0.1, 24.0, 0.0, 22.0),
    ],
)
def test_a_rank_working_set_leaves_out_the_requests_own_tails(
    first: list[int], then: list[int], after_s: float, demand: float, fresh: float, kept: float
) -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    led.record(A, first, held=len(first))
    clock.advance(after_s)
    led.record(A, then, held=len(then))
    now = 2.0 ** (-after_s / 30.0)  # the first record's weight now; the second's is 1
    assert led.demand(A) == pytest.approx(demand - (len(first) - 20) * (1 - now), rel=0.01)
    assert led.working_sets([A, B]) == pytest.approx([fresh + kept * now, 0.0], rel=0.01)
    assert_stale_entries_counted(led)


def test_a_tail_below_a_preamble_weighed_since_is_superseded_by_its_prefixs_next_request() -> None:
    """The prefix's blocks come back from its earlier record, the preamble above them from
    another prompt's record made since (a header every prefix shares): the earlier record's
    own tail is superseded all the same."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    header = tokens(3, 4)
    first = block_keys(header + tokens(1, 16) + tokens(7, 2), BS)
    then = block_keys(header + tokens(1, 16) + tokens(8, 2), BS)
    other = block_keys(header + tokens(5, 10), BS)
    led.record(A, first, held=len(first))
    clock.advance(1.0)
    led.record(A, other, held=len(other))  # the header weighed again, in another record
    led.record(A, then, held=len(then))
    tail = 2.0 ** (-1.0 / 30.0) * 2  # what the first record's tail weighs now
    assert led.demand(A) == pytest.approx(4 + 10 + 16 + 2 + tail)
    # The new request's own tail is out too, in a batch of its own (its record weighed the
    # prefix again).
    assert led.working_sets([A]) == pytest.approx([4 + 10 + 16])
    assert_stale_entries_counted(led)


@pytest.mark.parametrize("preamble_since", [False, True])
@pytest.mark.parametrize(
    ("routed", "superseded"),
    [
        # The first request's own 4 blocks below the header: its tail, superseded when a new
        # prefix takes the header over.
        (1, True),
        # Routed twice: the prefix's own blocks, weighed again by its second record, are no
        # tail of it (4 blocks, shorter than the 12-block header all the same); they stay.
        (2, False),
    ],
)
def test_only_a_records_own_new_blocks_are_superseded_when_a_new_prefix_takes_its_header_over(
    routed: int, superseded: bool, preamble_since: bool
) -> None:
    """A prefix of 4 blocks below a 12-block header every prefix shares, routed `routed`
    times 1 s apart, then a new 14-block prefix below the same header. With a preamble (the
    header's first 4 blocks) weighed since by another prompt's record, the same."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    header = tokens(3, 12)
    prefix = block_keys(header + tokens(1, 4), BS)
    for _ in range(routed):
        led.record(A, prefix, held=len(prefix))
        clock.advance(1.0)
    others = 0
    if preamble_since:
        other = block_keys(header[: 4 * BS] + tokens(5, 10), BS)
        led.record(A, other, held=len(other))
        others = 10
    taking = block_keys(header + tokens(8, 14), BS)
    led.record(A, taking, held=len(taking))
    own = 4 * 2.0 ** (-1.0 / 30.0)  # what the prefix's own blocks weigh now
    assert led.demand(A) == pytest.approx(12 + 14 + others + own)
    kept = 0.0 if superseded else own
    assert led.working_sets([A]) == pytest.approx([12 + 14 + others + kept])
    assert_stale_entries_counted(led)


@pytest.mark.parametrize("preamble_since", [False, True])
def test_a_prefix_routed_again_while_fresh_leaves_its_requests_tails_out(
    preamble_since: bool,
) -> None:
    """Requests of one prefix 0.1 s apart (within a 64th of a half-life: the prefix keeps
    its place): each one's tail leaves the working set as it is recorded, all but the first
    record's own (its batch holds the prefix too). With a preamble above the prefix weighed
    since by another prompt's record, the same."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    header = tokens(3, 4)
    other = block_keys(header + tokens(5, 10), BS)

    def request_of(tail_seed: int) -> list[int]:
        return block_keys(header + tokens(1, 16) + tokens(tail_seed, 2), BS)

    for tail_seed in (7, 8, 9, 10):
        if preamble_since:
            led.record(A, other, held=len(other))
        led.record(A, request_of(tail_seed), held=22)
        clock.advance(0.1)
    others = 10 if preamble_since else 0
    # The prefix (20 blocks with the header), four 2-block tails, the other prompt's own.
    assert led.demand(A) == pytest.approx(20 + 8 + others, rel=0.01)
    # Out: the later three requests' tails; the first's stays with the prefix.
    assert led.working_sets([A]) == pytest.approx([20 + 2 + others], rel=0.01)


def test_a_record_whose_prefix_was_taken_over_never_supersedes_the_record_that_took_it() -> None:
    """Conversation A's first turn below a system prompt, then conversation B's first turn
    taking the system prompt over (A's turn superseded as a tail), then A's second turn
    taking A's turn back: the system prompt, now in B's record, stays in the working set.
    B's turn and A's second are each a conversation's newest turn: out, as tails."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    system = tokens(3, 20)
    a1, b1, a2 = tokens(4, 4), tokens(5, 4), tokens(6, 2)
    led.record(A, block_keys(system + a1, BS), held=24)
    clock.advance(1.0)
    led.record(A, block_keys(system + b1, BS), held=24)
    clock.advance(0.1)
    led.record(A, block_keys(system + a1 + a2, BS), held=26)
    # The system prompt and A's first turn, weighed again.
    assert led.working_sets([A]) == pytest.approx([20 + 4], rel=0.01)
    assert_stale_entries_counted(led)


def test_superseded_blocks_leave_the_working_set_as_they_leave_the_ledger() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0)
    led.record(A, request(7, 2), held=22)
    clock.advance(1.0)
    led.record(A, request(8, 2), held=22)  # both tails out, the first at weight 1/2
    assert led.working_sets([A]) == pytest.approx([20.0])
    led.record(B, request(7, 2), held=22)  # the first request again, on B: its tail moves
    assert led.working_sets([A, B]) == pytest.approx([0.0, 22.0])
    clock.advance(300.0)  # everything forgotten (and the weights' origin moved)
    led.record(C, keys(9, 1), held=1)
    assert led.working_sets([A, B, C]) == pytest.approx([0.0, 0.0, 1.0], abs=1e-9)


class DemandModel:
    """The demand rules written out block by block: each key weighs 2 ** -(age / half-life) on
    the rank it was last routed to, a weight refreshed unless it is within 1/64 of a
    half-life of fresh (then it keeps its weight)."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.routed: dict[int, tuple[RankId, float]] = {}  # key -> (rank, when weighted)

    def record(self, rank: RankId, prompt: list[int], now: float) -> int:
        first = len(prompt)
        for i, key in enumerate(prompt):
            last = self.routed.get(key)
            if last is not None and last[0] == rank and now - last[1] <= self.half_life_s / 64:
                continue
            first = min(first, i)
            self.routed[key] = (rank, now)
        return first

    def demand(self, rank: RankId, now: float) -> float:
        return sum(
            2.0 ** (-(now - t) / self.half_life_s) for r, t in self.routed.values() if r == rank
        )


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([A, B, C]),
            st.integers(0, 5),  # which prompt family
            st.integers(1, 12),  # its length in blocks
            st.sampled_from([0.0, 0.1, 0.5, 3.0]),  # seconds since the previous record
        ),
        max_size=40,
    )
)
def test_record_keeps_demand_block_by_block_as_the_rules_state(
    records: list[tuple[RankId, int, int, float]],
) -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0)
    model = DemandModel(30.0)
    for rank, family, length, wait in records:
        clock.advance(wait)
        prompt = keys(family, length)
        assert led.record(rank, prompt, held=length)[0] == model.record(rank, prompt, clock())
        for r in (A, B, C):
            assert led.demand(r) == pytest.approx(model.demand(r, clock()), rel=1e-9, abs=1e-9)
    assert led.tracked_blocks == len(model.routed)


class BoundedDemandModel:
    """The demand rules with the bounds, written out pair by pair as the module docstring
    states them: each rank's pairs in last-routed order (a pair weighed again goes to the
    end), after each record the recorded rank and then one more rank in turn (by position
    among the ranks, in the order first recorded) lose their pairs older than 16 half-lives
    and their oldest beyond their share of the bound; a rank left with no pair is forgotten
    when swept."""

    def __init__(self, half_life_s: float, bound: int) -> None:
        self.half_life_s = half_life_s
        self.bound = bound
        self.ranks: dict[RankId, dict[int, float]] = {}  # rank -> {key: when}, oldest first
        self.sweep_next = 0

    def record(self, rank: RankId, prompt: list[int], now: float) -> int:
        pairs = self.ranks.setdefault(rank, {})
        first = len(prompt)
        for i, key in enumerate(prompt):
            when = pairs.get(key)
            if when is not None and now - when <= self.half_life_s / 64:
                continue
            first = min(first, i)
            for other in self.ranks.values():
                other.pop(key, None)
            pairs[key] = now
        self.prune(rank, now)
        ranks = list(self.ranks)
        swept = ranks[self.sweep_next % len(ranks)]
        self.sweep_next += 1
        self.prune(swept, now)
        if not self.ranks[swept]:
            del self.ranks[swept]
        return first

    def prune(self, rank: RankId, now: float) -> None:
        pairs = self.ranks[rank]
        share = self.bound // len(self.ranks)
        while pairs:
            key, when = next(iter(pairs.items()))
            if now - when <= 16 * self.half_life_s and len(pairs) <= share:
                break
            del pairs[key]

    def demand(self, rank: RankId, now: float) -> float:
        pairs = self.ranks.get(rank, {})
        return sum(2.0 ** (-(now - when) / self.half_life_s) for when in pairs.values())


@settings(max_examples=200, deadline=None)
@given(
    st.integers(4, 40),  # the bound on tracked pairs
    st.lists(
        st.tuples(
            st.sampled_from([A, B, C]),
            # block keys from a small set, so prompts overlap, repeat a key, move between
            # ranks and get refreshed
            st.lists(st.integers(0, 30), min_size=1, max_size=12),
            st.sampled_from([0.0, 0.1, 0.5, 3.0]),  # seconds since the previous record
        ),
        max_size=60,
    ),
)
def test_record_keeps_the_bounded_demand_pair_by_pair_as_the_rules_state(
    bound: int, records: list[tuple[RankId, list[int], float]]
) -> None:
    clock = ManualClock()
    # 16 half-lives (5.92 s) is no sum of the waits: no pair is exactly at the age limit.
    half_life_s = 0.37
    led = ledger(clock, demand_half_life_s=half_life_s, max_tracked_blocks=bound, booking_ttl_s=0)
    model = BoundedDemandModel(half_life_s, bound)
    for rank, prompt, wait in records:
        clock.advance(wait)
        assert led.record(rank, prompt)[0] == model.record(rank, prompt, clock())
        assert led.ranks() == list(model.ranks)
        assert led.tracked_blocks == sum(len(pairs) for pairs in model.ranks.values())
        for r in (A, B, C):
            assert led.demand(r) == pytest.approx(model.demand(r, clock()), rel=1e-9, abs=1e-9)
        assert_stale_entries_counted(led)


def assert_stale_entries_counted(led: PressureLedger) -> None:
    """Each rank's count of the entries its batches list (live and stale), which decides when
    they are compacted, is exact."""
    for state in led._ranks.values():
        assert state.listed == sum(len(batch.keys) - batch.start for batch in state.batches)


def test_a_conversation_turn_moves_its_history_below_a_fresh_system_prompt_whole() -> None:
    """A system prompt kept fresh on the rank, then the conversation's history from an older
    record, then the new turn: the history is weighed again (in one run), the turn is new,
    and the history leaves the superseded share it was given when the system prompt alone
    was routed since (it looked like a request's own tail then)."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0, booking_ttl_s=0.0)
    prompt = keys(1, 24)
    system, history, turn = prompt[:10], prompt[10:16], prompt[16:]
    led.record(A, system + history)
    clock.advance(1.0)  # past the refresh window (30 s / 64)
    assert led.record(A, system) == (0, 10)  # weighed again; the history behind superseded
    assert led.working_sets([A]) == pytest.approx([10])
    assert led.record(A, system + history + turn) == (10, 24)  # the system prompt kept fresh
    assert led.demand(A) == pytest.approx(24)
    assert led.working_sets([A]) == pytest.approx([24])
    assert led.tracked_blocks == 24
    assert_stale_entries_counted(led)


def test_a_prompt_listing_a_block_twice_weighs_it_once() -> None:
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=10.0)
    assert led.record(A, [1, 2, 1, 3], held=4) == (0, 4)
    assert (led.tracked_blocks, led.demand(A)) == (3, pytest.approx(3.0))
    clock.advance(5.0)  # past the refresh window: [2, 4, 2] is weighed again, 2 once
    assert led.record(B, [2, 4, 2], held=3) == (0, 3)
    assert led.tracked_blocks == 4
    assert led.demand(A) == pytest.approx(2 * 2**-0.5)
    assert led.demand(B) == pytest.approx(2.0)


def test_a_hot_prefix_weighed_again_and_again_keeps_the_ledger_bounded() -> None:
    """Each time a prompt's blocks are weighed again, their older places are left behind
    as stale entries; a rank's entries stay within twice its pairs plus a fixed slack."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=1.0, booking_ttl_s=0.0)
    hot = keys(1, 100)
    for seed in range(300):  # 30,000 weighings of the same 100 blocks, a few new ones each
        clock.advance(0.05)  # past the refresh window (1/64 of a half-life) every time
        led.record(A, hot + keys(1000 + seed, 2))
    assert_stale_entries_counted(led)
    assert led._ranks[A].listed <= 2 * led.tracked_blocks + 4096
    assert led.tracked_blocks == 100 + 2 * 300
    assert led.demand(A) == pytest.approx(100 + sum(2 * 2 ** (-0.05 * k) for k in range(300)))


def test_compaction_lists_each_live_block_once_in_its_first_place() -> None:
    """A batch whose prompt listed a block twice, and some of whose blocks a newer batch
    weighed since, lists its live blocks alone after compaction, each once, where it first
    stood; the newer batches are unchanged."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=10.0, booking_ttl_s=0.0)
    led.record(A, [1, 2, 1, 3, 4])
    clock.advance(5.0)  # past the refresh window: 2 and 4 are weighed again, in a new batch
    led.record(A, [2, 4, 6])  # 6, shorter than what it shares, is its own tail: a batch of its own
    state = led._ranks[A]
    assert state.listed == 8 and state.pairs == 5
    led._compact(state)
    assert [list(b.keys) for b in state.batches] == [[1, 3], [2, 4], [6]]
    assert_stale_entries_counted(led)
    assert led.tracked_blocks == 5


def test_a_prompt_booked_in_two_parts_extends_over_both_bookings() -> None:
    clock = ManualClock()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 30)
    led.record(A, prompt[:10])  # the first request of a prefix books its 10 blocks
    led.record(A, prompt, held=10)  # a longer one books the next 20, before either is stored
    led.record(A, keys(2, 5))  # another prompt's booking, in between in the queue
    assert led.booked_depths(prompt, {}) == {A: 30}
    assert led.booked_depths(prompt, {A: 12}) == {A: 30}
    assert led.booked_depths(prompt[:10] + keys(3, 5), {}) == {A: 10}
    assert led.pending(A) == 35


def test_a_failed_over_prompt_moves_its_booking_and_demand_to_the_rank_that_served() -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 40)
    index.store(A, 1, 10)
    led.record(A, prompt, held=10, holds=index.holds)  # the decision: A, 30 blocks booked
    other = keys(2, 8)
    led.record(A, other, holds=index.holds)  # a later booking on A stays
    assert led.pending(A) == 38
    assert led.move(A, B, prompt, held=0, holds=index.holds) == (0, 40)
    assert (led.bookings.moved, led.bookings.expired) == (1, 0)
    assert led.pending(A) == 8 and led.live_bookings(A) == 1
    assert led.pending(B) == 40 and led.booked_depths(prompt, {}) == {B: 40}
    assert led.demand(A) == pytest.approx(8.0) and led.demand(B) == pytest.approx(40.0)
    # The booking on A is gone, not left to expire.
    clock.advance(10.0)
    led.settle(index.holds)
    assert led.bookings.expired == 2  # the one on B and `other` on A, nothing more


def test_a_failed_over_prompt_leaves_an_earlier_booking_of_its_blocks_in_place() -> None:
    clock = ManualClock()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 20)
    led.record(A, prompt)  # a first request of the prefix
    led.record(A, prompt)  # a second one, before the first's store event
    led.move(A, B, prompt)  # the second failed over to B: the first still books A
    assert led.booked_depths(prompt, {}) == {A: 20, B: 20}
    assert (led.live_bookings(A), led.pending(A)) == (1, 20)
    clock.advance(5.0)
    led.settle(None)
    assert led.booked_depths(prompt, {}) == {}


def test_a_refused_prompt_ends_its_booking_and_no_other() -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt, other = keys(1, 40), keys(2, 8)
    index.store(A, 1, 10)
    led.record(A, prompt, held=10, holds=index.holds)  # the decision: A, 30 blocks booked
    led.record(A, other, holds=index.holds)
    led.refuse(A, prompt)  # the engine answered a 4xx
    assert (led.bookings.refused, led.bookings.moved, led.bookings.expired) == (1, 0, 0)
    assert led.pending(A) == 8 and led.live_bookings(A) == 1
    assert led.booked_depths(prompt, {A: 10}) == {}
    assert led.booked_depths(other, {}) == {A: 8}
    led.refuse(A, prompt)  # nothing of it is booked any more: no-op
    led.refuse(B, other)  # nor on a rank it was not routed to
    assert led.bookings.refused == 1 and led.pending(A) == 8
    clock.advance(10.0)
    led.settle(index.holds)
    assert led.bookings.expired == 1  # `other` alone


PROMPT = keys(1, 12)


@pytest.mark.parametrize(
    ("before", "gap_s", "after", "demands", "working"),
    [
        # A new prompt: all its demand goes.
        pytest.param([], 0.0, [], {A: 0, B: 0}, {A: 0}, id="new-prompt"),
        # Below a preamble kept fresh on the rank: the preamble's record keeps it; the
        # refused prompt's own tail, superseded, goes.
        pytest.param([(A, 8)], 0.0, [], {A: 8, B: 0}, {A: 8}, id="tail-below-fresh-preamble"),
        # Its prefix taken from B's older record: it goes, and B's is not restored.
        pytest.param([(B, 8)], 1.0, [], {A: 0, B: 0}, {A: 0}, id="prefix-moved-from-another"),
        # Its prefix weighed again on the same rank and its own tail in a batch of its own:
        # both batches go (the older record, superseded by it, stays so).
        pytest.param([(A, 8)], 1.0, [], {A: 0, B: 0}, {A: 0}, id="reweighed-and-own-tail"),
        # A later record took its first 6 blocks over before the refusal: they stay there.
        pytest.param([], 1.0, [(B, 6)], {A: 0, B: 6}, {A: 0}, id="blocks-taken-over-since"),
    ],
)
def test_a_refused_prompt_takes_back_the_demand_its_record_added_or_moved_and_nothing_older(
    before: list[tuple[RankId, int]],
    gap_s: float,
    after: list[tuple[RankId, int]],
    demands: dict[RankId, float],
    working: dict[RankId, float],
) -> None:
    """60 refused prompts left a rank's demand at 15x its capacity with nothing cached. Each
    row: records of the prompt's first blocks (rank, blocks), `gap_s`, the refused prompt's
    record on A (12 blocks, nothing held), more records, a live unrelated prompt of 5 blocks on
    A, then the refusal; the demands and working sets less that unrelated prompt's 5."""
    clock = ManualClock()
    led = ledger(clock, demand_half_life_s=30.0, booking_ttl_s=5.0)
    for rank, blocks in before:
        led.record(rank, PROMPT[:blocks])
    clock.advance(gap_s)  # 1 s: past the refresh window (30 s / 64), so nothing is kept fresh
    led.record(A, PROMPT)
    clock.advance(gap_s)
    for rank, blocks in after:
        led.record(rank, PROMPT[:blocks])
    led.record(A, keys(2, 5))
    led.refuse(A, PROMPT)
    assert led.bookings.refused == 1
    assert led.demand(A) - 5 == pytest.approx(demands[A], abs=1e-9)
    assert led.demand(B) == pytest.approx(demands[B], abs=1e-9)
    assert led.working_sets([A])[0] - 5 == pytest.approx(working[A], abs=1e-9)
    assert led.tracked_blocks == 5 + round(sum(demands.values()))
    assert_stale_entries_counted(led)
    clock.advance(20 * 30.0)  # every pair forgotten: no residue of the refused one's is left
    led.record(C, keys(3, 1))
    led.record(C, keys(4, 1))
    led.record(C, keys(5, 1))
    assert led.demands([A, B]) == [0.0, 0.0]


def test_ended_bookings_leave_a_bounded_trace_and_none_once_all_have_ended() -> None:
    """A booking ends without a pass over its blocks: their entries stay, ignored, in the
    rank's map until it holds more than twice its booked blocks plus a fixed slack."""
    clock = ManualClock()
    led = ledger(clock, booking_ttl_s=1.0)
    for seed in range(400):  # 20,000 blocks booked, about 10 bookings live at a time
        clock.advance(0.1)
        led.settle(None)
        led.record(A, keys(seed, 50))
        assert len(led._ranks[A].booked) <= 2 * led.pending(A) + 4096
    assert led.booked_depths(keys(399, 50), {}) == {A: 50}
    assert led.booked_depths(keys(380, 50), {}) == {}  # ended two seconds ago
    clock.advance(1.0)
    led.settle(None)
    assert led.pending(A) == 0 and not led._ranks[A].booked


def test_bookings_settle_oldest_first_per_rank_and_stop_at_one_still_pending() -> None:
    clock = ManualClock()
    index = Index()
    led = ledger(clock, booking_ttl_s=5.0)
    led.record(A, keys(1, 4), holds=index.holds)
    led.record(A, keys(2, 4), holds=index.holds)
    led.record(B, keys(3, 4), holds=index.holds)
    index.store(A, 2, 4)  # the engine stored A's second prompt, not yet its first
    index.store(B, 3, 4)
    led.settle(index.holds)
    assert (led.live_bookings(A), led.live_bookings(B)) == (2, 0)
    index.store(A, 1, 4)
    led.settle(index.holds)
    assert led.live_bookings(A) == 0
    assert (led.bookings.confirmed, led.bookings.expired) == (3, 0)


def test_two_bookings_of_one_block_hold_it_until_both_end() -> None:
    clock = ManualClock()
    led = ledger(clock, booking_ttl_s=5.0)
    prompt = keys(1, 8)
    led.record(A, prompt)
    clock.advance(3.0)
    led.record(A, prompt)
    clock.advance(2.5)  # the first booking ends, the second holds the blocks still
    led.settle(None)
    assert led.booked_depths(prompt, {}) == {A: 8}
    clock.advance(3.0)
    led.settle(None)
    assert led.booked_depths(prompt, {}) == {}
    assert led.bookings.expired == 2 and led.booked_blocks == 0


def test_a_ttl_of_zero_books_nothing_and_booked_blocks_are_bounded() -> None:
    clock = ManualClock()
    off = ledger(clock, booking_ttl_s=0.0)
    off.record(A, keys(1, 8))
    assert off.booked_depths(keys(1, 8), {}) == {} and off.bookings.made == 0
    bounded = ledger(clock, booking_ttl_s=5.0, max_tracked_blocks=20)
    bounded.record(A, keys(1, 8))
    clock.advance(0.1)
    bounded.record(B, keys(2, 8))
    clock.advance(0.1)
    bounded.record(C, keys(3, 8))  # 24 booked > 20: the oldest booking (A's) ends early
    assert bounded.booked_blocks == 16
    assert bounded.live_bookings(A) == 0 and bounded.bookings.expired == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"booking_ttl_s": -1.0},
        {"demand_half_life_s": 0.0},
        {"demand_half_life_s": float("nan")},
        {"max_tracked_blocks": 0},
    ],
)
def test_invalid_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PressureSettings(**bad)  # type: ignore[arg-type]


# --- the compiled tables and the pure twin ---------------------------------------------------


class _Twins:
    """One ledger on the compiled tables and one on the pure twin, driven alike: the module's
    choice of tables is set to None for each call of the pure one."""

    def __init__(self, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, bound: int) -> None:
        self.monkeypatch = monkeypatch
        self.compiled = ledger(clock, demand_half_life_s=30.0, max_tracked_blocks=bound)
        self.pure = self.on_pure(ledger, clock, demand_half_life_s=30.0, max_tracked_blocks=bound)

    def on_pure(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self.monkeypatch.context() as patch:
            patch.setattr(pressure_module, "tables", None)
            return call(*args, **kwargs)

    def both(self, name: str, *args: object) -> object:
        got = getattr(self.compiled, name)(*args)
        assert got == self.on_pure(getattr(self.pure, name), *args), name
        return got

    def reads(self, prompts: list[list[int]], held: dict[RankId, int]) -> tuple[object, ...]:
        def of(led: PressureLedger) -> tuple[object, ...]:
            ranks = [A, B, C]
            return (
                led.demands(ranks),
                led.working_sets(ranks),
                led.pendings(ranks),
                [led.live_bookings(r) for r in ranks],
                [led.booked_depths(p, held) for p in prompts],
                [[led.last_routed(k) for k in p] for p in prompts],
                led.booked_blocks,
                led.tracked_blocks,
                led.bookings,
            )

        return of(self.compiled), self.on_pure(of, self.pure)


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "move", "refuse", "settle", "forget"]),
        st.sampled_from([A, B, C]),
        st.sampled_from([A, B, C]),
        st.integers(0, 3),  # the prompt's head: one of 4 families
        st.integers(0, 8),  # its length in blocks
        st.lists(st.integers(1, 30), max_size=10),  # its tail: keys shared across prompts
        st.integers(0, 20),  # blocks the rank holds
        st.sampled_from([0.0, 0.1, 0.5, 3.0, 40.0, 3000.0]),  # seconds since the last operation
    ),
    max_size=60,
)


@pytest.mark.skipif(pressure_module.tables is None, reason="the compiled accelerator is not built")
@settings(max_examples=200, deadline=None)
@given(_OPS, st.sampled_from([12, 40, 1000]))
def test_the_compiled_ledger_reads_as_the_pure_one_through_any_sequence_of_operations(
    ops: list[tuple[str, RankId, RankId, int, int, list[int], int, float]],
    bound: int,
) -> None:
    clock = ManualClock()
    with pytest.MonkeyPatch.context() as monkeypatch:
        twins = _Twins(clock, monkeypatch, bound)
        stored: set[tuple[RankId, int]] = set()  # what the index holds: confirms bookings
        prompts: list[list[int]] = []
        for op, rank, other, family, length, tail, held, wait in ops:
            clock.advance(wait)
            prompt = keys(family, length) + tail
            prompts.append(prompt)
            held = min(held, len(prompt))
            if op == "record":
                twins.both("record", rank, prompt, held)
            elif op == "move":
                twins.both("move", rank, other, prompt, held)
            elif op == "refuse":
                twins.both("refuse", rank, prompt)
            elif op == "settle":
                stored.update((rank, k) for k in prompt[:held])
                twins.both("settle", lambda r, k: (r, k) in stored)
            else:
                twins.both("forget_ranks", [rank])
            compiled, pure = twins.reads(prompts[-4:], {rank: held})
            assert compiled == pure
