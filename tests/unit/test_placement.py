"""The placement authority's rules (`router.placement`): who places, what is a new prefix,
the bounds on questions, the wire (all or nothing) and what the asker books on an answer."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
from aiohttp.base_protocol import BaseProtocol

from cachetree.ranks import RankId
from router import bounded, placement
from router.placement import (
    PlaceAnswer,
    Placement,
    PlaceQuestion,
    decode_answer,
    decode_question,
    election_url,
    encode_answer,
    encode_question,
    new_prefix,
    own_url,
    placer_of,
    refusal_advice,
)
from router.policy import Prompt
from tests.unit.test_policy import BS, KEYS, PROMPT, A, B, C, Fleet, Pressured, cand, even

ME = "http://10.0.0.5:8080"
LOW, HIGH = "http://10.0.0.1:8080", "http://10.0.0.9:8080"


@pytest.mark.parametrize(
    ("own", "peers", "placer"),
    [
        (ME, [LOW, HIGH], LOW),  # a sibling sorts first: it places
        (ME, [HIGH], None),  # this replica sorts first: it places itself
        (ME + "/", [HIGH], None),  # a trailing slash changes nothing
        (ME, [], None),  # no siblings
        (None, [LOW], None),  # its own URL unknown: it cannot tell, never asks
    ],
)
def test_the_placer_is_the_lowest_url_of_self_and_siblings(
    own: str | None, peers: list[str], placer: str | None
) -> None:
    assert placer_of(own, peers) == placer


def test_every_replica_names_the_same_placer() -> None:
    fleet = [LOW, ME, HIGH]
    named = {placer_of(own, [u for u in fleet if u != own]) or own for own in fleet}
    assert named == {LOW}


@pytest.mark.parametrize(
    "spellings",
    [
        # (how the replica spells itself, how its siblings spell it), per replica
        [("http://LOCALHOST:9001", "http://localhost:9001"),
         ("http://LOCALHOST:9002", "http://localhost:9002"),
         ("http://LOCALHOST:9003", "http://localhost:9003")],
        [("http://router", "http://router:80"), ("http://router-2", "http://router-2:80")],
        [("http://Router-A:8080", "http://router-a:8080"),
         ("http://Router-B:8080", "http://router-b:8080")],
        [("http://[fd00:0:0:0::1]:8080", "http://[fd00::1]:8080"),
         ("http://[fd00::2]:8080", "http://[fd00::2]:8080")],
        [("http://127.0.0.1:9001", "http://localhost:9001"),
         ("http://localhost:9002", "http://127.0.0.1:9002")],
    ],
)  # fmt: skip
def test_one_placer_however_a_replica_and_its_siblings_spell_its_url(
    spellings: list[tuple[str, str]],
) -> None:
    """Each replica compares its own URL as it spells it with its siblings' as its list spells
    them (a static list comes out of `peer.spellings` rewritten): compared as written, two or
    three replicas took themselves for the placer and each placed alone."""
    placers = 0
    for i, (own, _) in enumerate(spellings):
        siblings = [listed for j, (_, listed) in enumerate(spellings) if j != i]
        placers += placer_of(own, siblings) is None
    assert placers == 1


@pytest.mark.parametrize(
    ("self_url", "host", "pod_ip", "url"),
    [
        ("http://r0:8080/", "0.0.0.0", "10.1.1.1", "http://r0:8080"),  # --self-url wins
        (None, "127.0.0.1", "10.1.1.1", "http://127.0.0.1:9000"),  # a concrete --host
        (None, "0.0.0.0", "10.1.1.1", "http://10.1.1.1:9000"),  # else the pod's IP
        (None, "::", "fd00::7", "http://[fd00::7]:9000"),
        (None, "0.0.0.0", None, None),  # nothing says who it is
    ],
)
def test_own_url_is_as_siblings_list_it(
    self_url: str | None, host: str, pod_ip: str | None, url: str | None
) -> None:
    assert own_url(self_url, host, 9000, pod_ip) == url


@pytest.mark.parametrize(
    ("self_url", "host", "listed", "url"),
    [
        # A shared list naming every replica by its control port: elected on that port.
        (
            None,
            "127.0.0.1",
            ["http://127.0.0.1:9001", "http://127.0.0.1:9011"],
            "http://127.0.0.1:9001",
        ),
        # ... by its main port, or spelled another way (loopback names are one machine).
        (
            None,
            "127.0.0.1",
            ["http://localhost:9000", "http://127.0.0.1:9010"],
            "http://127.0.0.1:9000",
        ),
        # A list naming only the others: the main port.
        (None, "127.0.0.1", ["http://127.0.0.1:9011"], "http://127.0.0.1:9000"),
        (None, "0.0.0.0", ["http://10.0.0.5:9001"], None),  # it does not know its own URL
        # --self-url is what the siblings list it by, whatever the ports.
        ("http://r0.example:9001", "0.0.0.0", ["http://r0.example:9001"], "http://r0.example:9001"),
    ],
)
def test_the_election_url_is_on_the_port_the_shared_list_names_this_replica_on(
    self_url: str | None, host: str, listed: list[str], url: str | None
) -> None:
    assert election_url(self_url, host, [9000, 9001], None, listed) == url


@pytest.mark.parametrize(
    ("device", "booked", "routed", "new"),
    [
        ({}, {}, 0, True),  # nobody holds it
        ({A: 4, B: 4, C: 4}, {}, 0, True),  # a preamble every rank holds, nothing more
        ({A: 4, B: 4, C: 4}, {A: 4}, 0, True),  # a booking that adds nothing
        ({A: 4, B: 4}, {C: 4}, 0, True),  # a booking that evens the depths
        # Below a preamble some ranks hold, the rest routed nowhere lately: a new prefix.
        ({A: 4}, {}, 0, True),
        ({A: 64, B: 4}, {}, 0, True),  # as many blocks again past the deepest match
        ({}, {B: 20}, 20, True),  # a booked preamble (routed, no store event yet)
        # The block past the match routed before: the rest of a prefix its holder evicted.
        ({A: 4}, {}, 5, False),
        ({A: 65}, {}, 0, False),  # fewer blocks past the match than it: a repeat's new tail
        ({}, {B: 128}, 128, False),  # booked whole on one rank
    ],
)
def test_a_new_prefix_is_every_rank_at_one_depth_or_a_new_prefix_below_a_preamble(
    device: dict[RankId, int], booked: dict[RankId, int], routed: int, new: bool
) -> None:
    """`routed`: how many of the prompt's leading blocks were routed lately."""
    was_routed = set(KEYS[:routed]).__contains__
    assert new_prefix([A, B, C], KEYS, device, booked, was_routed) is new


class Asker:
    """A replica's placement rules over a pressured cache_aware, with siblings `peers`."""

    def __init__(self, peers: list[str], own: str = ME, max_asking: int = 2) -> None:
        self.fleet = Fleet()
        self.p = Pressured(self.fleet, even(), replicas=2)
        self.peers = peers
        self.rules = Placement(self.p.policy, own, lambda: self.peers, max_asking, self.p.clock)

    def ask(self) -> str | None:
        return self.rules.question([cand(A), cand(B), cand(C)], self.p.prompt())


def test_a_new_prefix_asks_the_placer_and_a_held_or_booked_one_does_not() -> None:
    s = Asker([LOW])
    assert s.ask() == LOW
    s.fleet.hold(A, 4)  # a preamble on one rank, the rest new: a new prefix below it
    assert s.ask() == LOW
    s.fleet.hold(A, 65)  # held deeper than half the prompt: decided here
    assert s.ask() is None
    s = Asker([LOW])
    for rank in (A, B, C):  # a preamble every rank holds
        s.fleet.hold(rank, 4)
    assert s.ask() == LOW
    s = Asker([LOW])
    s.fleet.hold(A, 4)
    s.p.policy.ledger.record(A, KEYS, held=4)  # routed whole, held in part: decided here
    assert s.ask() is None
    s = Asker([LOW])
    s.p.policy.ledger.record(B, KEYS)  # routed here, no store event yet
    assert s.ask() is None
    assert s.rules.counts["asked"] == 0 and s.rules.asking == 0


def test_the_placer_itself_places_and_counts_it_local() -> None:
    s = Asker([HIGH])
    assert s.ask() is None
    assert s.rules.counts["local"] == 1 and s.rules.counts["asked"] == 0


def test_a_prompt_shorter_than_a_block_or_a_lone_candidate_is_never_asked_about() -> None:
    s = Asker([LOW])
    assert (
        s.rules.question([cand(A), cand(B)], Prompt(5, BS, s.fleet.tree.prefix_depths([]))) is None
    )
    assert s.rules.question([cand(A)], s.p.prompt()) is None
    assert s.rules.counts["asked"] == 0


def test_questions_in_flight_are_bounded_and_a_failing_placer_is_left_alone_for_a_backoff() -> None:
    s = Asker([LOW], max_asking=2)
    clock = s.p.clock
    assert s.ask() == LOW and s.ask() == LOW
    assert s.ask() is None  # a third while two are in flight: decided here
    assert s.rules.counts["busy"] == 1
    asked = clock()
    s.rules.finished("answered", asked)
    s.rules.finished("timeout", asked)  # one failure: not asked again for 50 ms
    assert s.rules.asking == 0 and s.rules.counts["timeout"] == 1
    assert s.ask() is None and s.rules.counts["busy"] == 2
    clock.advance(0.051)
    assert s.ask() == LOW
    s.rules.finished("error", clock())  # a second in a row: 100 ms
    clock.advance(0.08)
    assert s.ask() is None
    clock.advance(0.03)
    assert s.ask() == LOW
    s.rules.finished("answered", clock())  # an answer ends the backoff
    assert s.ask() == LOW
    s.rules.cancelled()  # a client that left releases its slot too
    assert s.rules.asking == 0


@pytest.mark.parametrize(
    ("asked_ms", "failed_ms", "until_ms"),
    [
        # Questions asked together, in flight when a stall or a gone placer fails them: the
        # first failure counts, the others are that one (50 ms, not 50 * 2 ** 5 = 1.6 s).
        ([0, 0, 1, 2, 3, 4], [50, 50, 51, 52, 53, 54], 100),
        # Failures in a row, each question asked after the one before it failed: each one
        # counts, and the backoff doubles (a placer that stays dead): 50, 100, then 200 ms.
        ([0, 110, 270], [50, 160, 320], 520),
        # One asked before the first failure fails after that backoff ended: the same failure
        # all the same; the next question, asked after it, is the second in the row.
        ([0, 0, 110], [50, 115, 160], 260),
    ],
)
def test_questions_in_flight_together_fail_as_one_for_the_backoff(
    asked_ms: list[int], failed_ms: list[int], until_ms: int
) -> None:
    s = Asker([LOW], max_asking=64)
    clock = s.p.clock
    start = clock()
    for asked, failed in sorted(zip(asked_ms, failed_ms, strict=True), key=lambda p: p[1]):
        clock.advance(start + failed / 1000 - clock())
        s.rules.asking += 1  # in flight since `asked` (the rules count it when it ends)
        s.rules.finished("timeout", start + asked / 1000)
    assert s.rules.counts["timeout"] == len(asked_ms)  # each failure is counted all the same
    assert s.rules.asking == 0
    clock.advance(start + (until_ms - 1) / 1000 - clock())
    assert s.ask() is None  # still backing off ...
    clock.advance(0.002)
    assert s.ask() == LOW  # ... for exactly that long, no longer


@pytest.mark.parametrize(
    ("wakes", "left_ms"),
    [
        ([], 50),  # nothing happened yet: the whole timeout
        ([(50, 50)], 0),  # a wait that ended when due: the timeout has passed
        ([(50, 51)], 0),  # a timer a millisecond late is no stall
        ([(50, 97)], 47),  # stalled past due: that long again, to read what came meanwhile
        ([(20, 90)], 70),  # a wait due before the deadline, stalled: the same
        ([(50, 97), (144, 145)], 0),  # the second wait ended in time: passed
        ([(50, 97), (144, 170)], 26),  # stalled again: again
        ([(50, 130)], 70),  # 80 ms late at 130: at most 4 timeouts from the start (200 ms)
        ([(50, 300)], 0),  # ... past them: passed, whatever the stall
    ],
)
def test_a_questions_deadline_gives_back_the_time_the_asker_stalled(
    wakes: list[tuple[float, float]], left_ms: float
) -> None:
    deadline = placement.Deadline(0.05, placement.MAX_WAIT_FACTOR * 0.05, 1.0)
    now = 1.0
    for due, woke in wakes:
        now = 1.0 + woke / 1000
        deadline.woke(1.0 + due / 1000, now)
    assert deadline.left(now) == pytest.approx(left_ms / 1000)


@pytest.mark.parametrize(
    ("ended", "patient"),
    [
        ([], True),  # nothing asked yet ended: a silence is a stall until shown otherwise
        (["answered"], True),  # the placer answered the latest: silent now, it is stalled
        (["timeout"], False),  # a failure in the row: the placer may be gone, decide alone
        (["error"], False),
        (["timeout", "answered"], True),  # an answer ends the row, and patience is back
        (["answered", "timeout"], False),  # the first failure ends it for the whole burst
        (["answered", "timeout", "timeout"], False),
    ],
)
def test_a_question_past_its_timeout_waits_on_while_the_placer_answered_the_latest(
    ended: list[str], patient: bool
) -> None:
    s = Asker([LOW], max_asking=64)
    clock = s.p.clock
    for outcome in ended:
        s.rules.asking += 1
        asked = clock()
        clock.advance(0.06)
        s.rules.finished(outcome, asked)
    assert s.rules.patient() is patient


@pytest.mark.parametrize(
    ("wakes", "left_ms"),
    [
        ([], 150),  # held at its timeout (50 ms): on to 4 timeouts from the start
        ([(120, 120)], 80),
        ([(120, 260)], 0),  # a stall past the bound ends it all the same
    ],
)
def test_a_held_deadline_waits_to_its_bound_and_no_further(
    wakes: list[tuple[float, float]], left_ms: float
) -> None:
    deadline = placement.Deadline(0.05, placement.MAX_WAIT_FACTOR * 0.05, 1.0)
    now = 1.05
    assert deadline.left(now) == 0
    deadline.hold()
    for due, woke in wakes:
        now = 1.0 + woke / 1000
        deadline.woke(1.0 + due / 1000, now)
    assert deadline.left(now) == pytest.approx(left_ms / 1000)


def test_a_deadline_waits_at_least_its_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        placement.Deadline(0.3, 0.2, 0.0)


def test_on_an_answer_the_asker_books_the_placers_rank_first_without_sharing_it() -> None:
    s = Asker([LOW])
    shared: list[RankId] = []
    s.p.policy.share = lambda rank, keys, held: shared.append(rank)
    candidates = [cand(A), cand(B, inflight=2), cand(C)]
    decision = s.rules.resolved(candidates, s.p.prompt(), B)
    assert decision is not None
    assert [c.rank for c in decision.ranked] == [B, A, C] or [c.rank for c in decision.ranked] == [
        B,
        C,
        A,
    ]
    assert decision.outcome == "cache_miss"
    ledger = s.p.policy.ledger
    assert ledger.booked_depths(KEYS, {}) == {B: len(KEYS)}
    assert ledger.demand(B) == pytest.approx(len(KEYS)) and ledger.demand(A) == 0.0
    assert shared == []  # the placer shares it
    assert s.rules.counts["answered"] == 1


def test_an_unusable_answer_is_warned_once_a_minute_naming_the_rank_and_what_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas given different workers: 9 of 10 placements were `unusable`, said nowhere."""
    s = Asker([LOW])
    stranger = RankId("http://not-given-here:8000", 0)
    s.rules.known = lambda rank: rank != stranger
    caplog.set_level("WARNING", logger="router.placement")
    for _ in range(3):
        assert s.rules.resolved([cand(A), cand(B)], s.p.prompt(), stranger) is None
    s.p.clock.advance(60.0)
    assert s.rules.resolved([cand(A), cand(B)], s.p.prompt(), C) is None  # known, unhealthy
    said = [r.getMessage() for r in caplog.records if r.name == "router.placement"]
    assert said == [
        f"placement: 1 answer(s) of the placer since this was last said named no healthy "
        f"candidate here, the last {stranger}, a worker this replica was not given: give every "
        "replica the same worker list (--worker, or one --worker-selector); this replica "
        "decided those new prefixes alone, and the placer booked them there",
        f"placement: 3 answer(s) of the placer since this was last said named no healthy "
        f"candidate here, the last {C}, a worker this replica finds unhealthy: replicas see "
        "its health differently; this replica decided those new prefixes alone, and the "
        "placer booked them there",
    ]
    assert s.rules.counts["unusable"] == 4


def test_an_answer_naming_no_healthy_candidate_is_unusable_and_books_nothing() -> None:
    s = Asker([LOW])
    gone = RankId("http://gone:8000", 0)
    assert s.rules.resolved([cand(A), cand(B)], s.p.prompt(), gone) is None
    assert s.rules.resolved([cand(A), cand(B)], s.p.prompt(), None) is None
    assert s.p.policy.ledger.booked_depths(KEYS, {}) == {}
    assert s.rules.counts["unusable"] == 1 and s.rules.counts["answered"] == 0


def test_a_question_round_trips_and_carries_at_most_the_prompts_head() -> None:
    prompt = Prompt(len(PROMPT), BS, None, KEYS)
    q = decode_question(encode_question(prompt))
    assert (q.tokens, q.block_size, q.keys) == (len(PROMPT), BS, KEYS)
    long_keys = list(range(1, placement.MAX_KEYS + 50))
    q = decode_question(encode_question(Prompt(len(long_keys) * BS, BS, None, long_keys)))
    assert q.keys == long_keys[: placement.MAX_KEYS]
    huge = decode_question(encode_question(Prompt(1 << 30, BS, None, KEYS)))
    assert huge.tokens == placement.MAX_TOKENS
    assert len(encode_question(Prompt(1 << 24, BS, None, [(1 << 64) - 1] * 8192))) <= (
        placement.MAX_BODY_BYTES
    )


def _question(tokens: int, block_size: int, keys: list[int]) -> bytes:
    return msgspec.msgpack.encode(PlaceQuestion(tokens, block_size, keys))


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\x93not a question", "not a placement question"),
        (msgspec.msgpack.encode([64, 16, [1, 2], "m", "extra"]), "not a placement question"),
        (msgspec.msgpack.encode([64, 16, [1, 2], 7]), "not a placement question"),  # a model
        (msgspec.msgpack.encode([64, 16, [1, "two"]]), "not a placement question"),
        (_question(64, 16, []), "keys must hold"),
        (_question(64, 0, [1]), "block_size"),
        (_question(64, 16, [1, -2]), "unsigned 64-bit"),
        (_question(31, 16, [1, 2]), "tokens must be"),  # fewer tokens than its full blocks
        (_question(1 << 25, 16, [1]), "tokens must be"),
        (_question(64, 1, list(range(1, placement.MAX_KEYS + 2))), "keys must hold"),
        (b"\x93" + b"\x00" * placement.MAX_BODY_BYTES, "bytes"),
    ],
)
def test_a_malformed_question_is_refused_whole(body: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        decode_question(body)


@pytest.mark.parametrize(
    ("status", "text", "check"),
    [
        (401, "missing or wrong bearer token", "--internal-token"),
        (400, "placement question refused: block_size 32; this replica's is 16", "--block-size"),
        (400, "not a placement question: Expected `array` of at most length 3", "another version"),
        (413, "a placement question is at most 4624 bytes", "another version"),  # a longer one
        (404, "placement is off on this replica: it runs with --policy cache_aware", "is off"),
        (503, "no healthy worker to place on", "the same worker list"),
        (500, "Internal Server Error", "Its log"),
    ],
)
def test_a_refusal_is_told_what_to_check_by_its_status_and_reason(
    status: int, text: str, check: str
) -> None:
    assert check in refusal_advice(status, text)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        msgspec.msgpack.encode(["", 0]),
        msgspec.msgpack.encode(["http://w:1", -1]),
        msgspec.msgpack.encode(["http://w:1", 1 << 16]),
        msgspec.msgpack.encode(["x" * 5000, 0]),
    ],
)
def test_a_malformed_answer_is_an_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_answer(body)


def test_an_answer_round_trips() -> None:
    assert decode_answer(encode_answer(B)) == B


@pytest.mark.parametrize(
    ("written", "registered"),
    [
        ("http://localhost:27001", "http://127.0.0.1:27001"),
        ("http://w:80", "http://w"),
        ("HTTP://W/", "http://w"),
    ],
)
def test_an_answer_naming_a_worker_as_written_is_booked_on_the_registrys_rank(
    written: str, registered: str
) -> None:
    """A placer of another version answers with its --worker flag as written: before, the
    rank matched no candidate here and the answer was counted `unusable`."""
    rank = RankId(registered, 1)
    s = Asker([LOW])
    answer = decode_answer(msgspec.msgpack.encode(PlaceAnswer(written, 1)))
    assert answer == rank
    decision = s.rules.resolved([cand(A), cand(rank), cand(C)], s.p.prompt(), answer)
    assert decision is not None and decision.ranked[0].rank == rank
    assert s.p.policy.ledger.booked_depths(KEYS, {}) == {rank: len(KEYS)}
    assert (s.rules.counts["answered"], s.rules.counts["unusable"]) == (1, 0)


def answer_stream(loop: asyncio.AbstractEventLoop) -> aiohttp.StreamReader:
    """A response body stream as aiohttp's client has it, fed by the test."""
    protocol = BaseProtocol(loop)
    protocol.connection_made(asyncio.Transport())  # open: a read waits for more
    return aiohttp.StreamReader(protocol, 1 << 16, loop=loop)


async def test_an_answer_that_arrives_in_two_parts_is_read_whole() -> None:
    loop = asyncio.get_running_loop()
    content = answer_stream(loop)
    raw = placement.encode_answer(A)
    reading = asyncio.create_task(bounded.read_up_to(content, placement.MAX_ANSWER_BYTES))
    content.feed_data(raw[:5])
    await asyncio.sleep(0)  # the reader takes the first part, then waits for more
    assert not reading.done()
    content.feed_data(raw[5:])
    content.feed_eof()
    assert placement.decode_answer(await reading) == A


async def test_an_answer_past_the_bound_is_read_only_one_byte_past_it() -> None:
    content = answer_stream(asyncio.get_running_loop())
    content.feed_data(b"x" * 100)
    content.feed_eof()
    assert await bounded.read_up_to(content, 10) == b"x" * 11
