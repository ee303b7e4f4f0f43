"""The subscriber's decisions without sockets: frames, sequencing, replay filtering, gap items.

The last tests drive `RankSubscriber` against a scripted ZMTP publisher on 127.0.0.1
(`tests.support.zmtp_publisher`), for what only the shell does (connecting again, closing the
connection on exit, the handshake, decode errors surfacing as gaps).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import pytest

from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from router.events import EventBatch, RemovedRun
from router.subscriber import (
    MAX_SEQ_JUMP,
    FrameError,
    LiveBatch,
    LiveFrame,
    PublisherReset,
    RankEndpoint,
    RankSubscriber,
    ReplayCollector,
    SequenceTracker,
    Step,
    SubscriberItem,
    UnrepairedGap,
    Verdict,
    connect_backoff_s,
    fill_gap,
    parse_live_frames,
    replay_outcome,
    replay_request,
)
from tests.support.clock import ManualClock
from tests.support.waiting import eventually
from tests.support.zmtp_publisher import (
    CLOSE,
    GREETING,
    READY_PUB,
    Raw,
    Script,
    ScriptedPublisher,
    message,
)

pytestmark = pytest.mark.timeout(10)

RANK = RankId("http://w0:8000", 1)
END = b"\xff" * 8
PAYLOAD = msgspec.msgpack.encode([1.5, [], 1])


def seq_b(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def batch(ts: float = 0.0) -> EventBatch:
    return EventBatch(ts=ts, events=[], dp_rank=1)


# --- frames ---------------------------------------------------------------------------------


def test_a_well_formed_message_parses_to_topic_seq_and_payload() -> None:
    assert parse_live_frames([b"kv", seq_b(7), b"p"]) == LiveFrame(b"kv", 7, b"p")
    assert parse_live_frames([b"", seq_b(2**62), b""]).seq == 2**62


def test_a_batchs_frame_and_item_are_frozen_and_left_out_of_the_cyclic_collector() -> None:
    """One of each is built per batch on the ingest path: built in C and never tracked by the
    cyclic GC (a slots dataclass was both a Python __init__ and a tracked object a batch)."""
    frame = parse_live_frames([b"kv", seq_b(7), b"p"])
    item = LiveBatch(RANK, 7, batch())
    assert not gc.is_tracked(frame) and not gc.is_tracked(item)
    assert item == LiveBatch(RANK, 7, batch()) and item.seq == 7
    with pytest.raises(AttributeError):
        item.seq = 8  # type: ignore[misc]


def test_eight_ff_bytes_are_the_end_marker() -> None:
    assert parse_live_frames([b"", END, b""]).seq == -1


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", seq_b(1)], "2 frames, not 3"),
        ([b"", seq_b(1), PAYLOAD, b"x"], "4 frames, not 3"),
        ([], "0 frames, not 3"),
        ([b"", b"\x00" * 7, PAYLOAD], "seq frame is 7 bytes, not 8"),
        ([b"", b"\x00" * 9, PAYLOAD], "seq frame is 9 bytes, not 8"),
        ([b"", seq_b(-2), PAYLOAD], "negative seq -2"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(FrameError) as info:
        parse_live_frames(frames)
    assert info.value.reason == reason


# --- sequencing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seqs", "verdicts"),
    [
        # The first batch seen is never a gap, wherever the stream is.
        ([0], [Verdict(Step.FIRST)]),
        ([41], [Verdict(Step.FIRST)]),
        ([5, 6, 7], [Verdict(Step.FIRST), Verdict(Step.NEXT), Verdict(Step.NEXT)]),
        # A jump names exactly the seqs that were not seen.
        ([5, 6, 9], [Verdict(Step.FIRST), Verdict(Step.NEXT), Verdict(Step.GAP, 7, 8)]),
        ([5, 7], [Verdict(Step.FIRST), Verdict(Step.GAP, 6, 6)]),
        # Back to 0: a restart the pump resolves itself, not a reset.
        ([5, 0, 1], [Verdict(Step.FIRST), Verdict(Step.RESTART_AT_ZERO), Verdict(Step.NEXT)]),
        ([0, 0], [Verdict(Step.FIRST), Verdict(Step.RESTART_AT_ZERO)]),
        # Back to a non-zero seq: the publisher restarted, and its new stream's batches before
        # this one were not seen.
        ([5, 3, 4], [Verdict(Step.FIRST), Verdict(Step.RESET, 0, 2), Verdict(Step.NEXT)]),
        # The same seq again is the last batch sent again, not a restart at that seq (it was
        # a RESET [0, 4]: a rank cleared and 5 batches lost a copy).
        ([5, 5, 6], [Verdict(Step.FIRST), Verdict(Step.DUPLICATE), Verdict(Step.NEXT)]),
        ([5, 3, 3], [Verdict(Step.FIRST), Verdict(Step.RESET, 0, 2), Verdict(Step.DUPLICATE)]),
        ([2**63 - 1, 2**63 - 1], [Verdict(Step.FIRST), Verdict(Step.DUPLICATE)]),
        ([5, 1, 3], [Verdict(Step.FIRST), Verdict(Step.RESET, 0, 0), Verdict(Step.GAP, 2, 2)]),
        # ... unless that is more than MAX_SEQ_JUMP batches: too far back to replay.
        (
            [2**63 - 1, MAX_SEQ_JUMP],
            [Verdict(Step.FIRST), Verdict(Step.RESET, 0, MAX_SEQ_JUMP - 1)],
        ),
        ([2**63 - 1, MAX_SEQ_JUMP + 1], [Verdict(Step.FIRST), Verdict(Step.JUMP)]),
        # Up to MAX_SEQ_JUMP missing batches is a gap; one more is a new stream.
        ([5, 6 + MAX_SEQ_JUMP], [Verdict(Step.FIRST), Verdict(Step.GAP, 6, 5 + MAX_SEQ_JUMP)]),
        (
            [5, 7 + MAX_SEQ_JUMP, 8 + MAX_SEQ_JUMP],
            [Verdict(Step.FIRST), Verdict(Step.JUMP), Verdict(Step.NEXT)],
        ),
        ([0, 2**63 - 1], [Verdict(Step.FIRST), Verdict(Step.JUMP)]),
    ],
)
def test_the_tracker_classifies_each_seq_against_the_last_one_seen(
    seqs: list[int], verdicts: list[Verdict]
) -> None:
    tracker = SequenceTracker()
    assert [tracker.advance(s) for s in seqs] == verdicts
    assert tracker.last == seqs[-1]


@pytest.mark.parametrize(
    ("seq", "verdict"),
    [
        (0, Verdict(Step.FIRST)),  # the new stream seen from its start
        (3, Verdict(Step.RESUMED, 0, 2)),  # its batches 0..2 went out before we reconnected
        (MAX_SEQ_JUMP, Verdict(Step.RESUMED, 0, MAX_SEQ_JUMP - 1)),
        (MAX_SEQ_JUMP + 1, Verdict(Step.JUMP)),  # too far back to replay: a new stream
    ],
)
def test_after_end_seq_the_next_stream_is_taken_from_seq_0(seq: int, verdict: Verdict) -> None:
    tracker = SequenceTracker()
    tracker.advance(10)
    tracker.end()
    assert tracker.last is None
    assert tracker.advance(seq) == verdict
    assert tracker.advance(seq + 1) == Verdict(Step.NEXT)


def test_a_first_batch_anywhere_before_end_seq_is_joining_mid_stream() -> None:
    assert SequenceTracker().advance(3) == Verdict(Step.FIRST)


def test_a_gap_verdict_counts_its_missing_batches() -> None:
    assert Verdict(Step.GAP, 7, 9).missing == 3
    assert Verdict(Step.NEXT).missing == 0


def test_the_tracker_refuses_a_negative_seq() -> None:
    with pytest.raises(ValueError):
        SequenceTracker().advance(-1)


# --- replay ---------------------------------------------------------------------------------


def reply(seq: int, payload: bytes = b"p", topic: bytes | None = b"") -> list[bytes]:
    return [b"", seq_b(seq), payload] if topic is None else [b"", topic, seq_b(seq), payload]


def collect(first: int, stop: int, replies: Sequence[list[bytes]], topic: bytes = b"") -> Any:
    c = ReplayCollector(first, stop, topic)
    for r in replies:
        c.feed(r)
    return c


def test_replay_request_is_an_empty_delimiter_and_the_first_seq_big_endian() -> None:
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]


def test_replay_keeps_the_missing_range_and_stops_at_the_current_seq() -> None:
    c = collect(3, 6, [reply(3, b"a"), reply(4, b"b"), reply(5, b"c"), reply(6), reply(7)])
    assert (c.kept, c.done, c.ignored) == ([(3, b"a"), (4, b"b"), (5, b"c")], True, 0)


def test_replay_is_done_once_the_last_missing_seq_arrives() -> None:
    c = collect(3, 5, [reply(3), reply(4)])
    assert c.done
    c.feed(reply(4))  # anything after is not read
    assert [s for s, _ in c.kept] == [3, 4]


def test_replay_ends_at_the_end_marker_in_both_shapes() -> None:
    four = collect(3, 9, [reply(3), [b"", b"", END, b""]])
    three = collect(3, 9, [reply(3, topic=None), [b"", END, b""]])
    assert four.done and three.done
    assert [s for s, _ in four.kept] == [s for s, _ in three.kept] == [3]


def test_replay_stops_at_a_seq_past_the_range_even_if_the_range_was_not_filled() -> None:
    c = collect(3, 5, [reply(5)])  # a hole replay cannot fill: the buffer skips past it
    assert (c.kept, c.done) == ([], True)


def test_replay_keeps_only_strictly_increasing_seqs_inside_the_range() -> None:
    replies = [reply(1), reply(4), reply(3), reply(4), reply(6), reply(5), reply(7)]
    c = collect(3, 8, replies)
    assert [s for s, _ in c.kept] == [4, 6, 7]
    assert (c.ignored, c.done) == (4, True)


@pytest.mark.parametrize(
    "bad",
    [
        [b"x", b"", seq_b(3), b"p"],  # no empty delimiter first
        [b"", seq_b(3)],  # too few frames
        [b"", b"", seq_b(3), b"p", b"q"],  # too many
        [b"", b"", b"\x00" * 7, b"p"],  # short seq
    ],
)
def test_malformed_replay_replies_are_ignored(bad: list[bytes]) -> None:
    c = collect(3, 5, [bad, reply(3)])
    assert ([s for s, _ in c.kept], c.ignored, c.done) == ([3], 1, False)


def test_replay_replies_on_a_foreign_topic_are_ignored() -> None:
    c = collect(3, 5, [reply(3, topic=b"other"), reply(4, topic=b"kv@a")], topic=b"kv@")
    assert [s for s, _ in c.kept] == [4]
    assert c.ignored == 1


def test_an_empty_replay_range_is_refused() -> None:
    with pytest.raises(ValueError):
        ReplayCollector(5, 5)


# --- what a gap delivers --------------------------------------------------------------------


def test_a_fully_recovered_gap_is_the_missing_batches_in_order() -> None:
    b3, b4 = batch(3), batch(4)
    assert fill_gap(RANK, 3, 5, [(3, b3), (4, b4)]) == [
        LiveBatch(RANK, 3, b3),
        LiveBatch(RANK, 4, b4),
    ]


def test_an_unrecovered_gap_is_one_unrepaired_gap_with_the_exact_range() -> None:
    assert fill_gap(RANK, 3, 7, []) == [UnrepairedGap(RANK, 3, 6)]


def test_holes_become_unrepaired_gaps_where_they_are_in_the_stream() -> None:
    b4, b6 = batch(4), batch(6)
    assert fill_gap(RANK, 3, 9, [(4, b4), (6, b6)]) == [
        UnrepairedGap(RANK, 3, 3),
        LiveBatch(RANK, 4, b4),
        UnrepairedGap(RANK, 5, 5),
        LiveBatch(RANK, 6, b6),
        UnrepairedGap(RANK, 7, 8),
    ]


def test_fill_gap_refuses_a_seq_outside_the_range_or_out_of_order() -> None:
    with pytest.raises(ValueError):
        fill_gap(RANK, 3, 5, [(5, batch())])
    with pytest.raises(ValueError):
        fill_gap(RANK, 3, 6, [(4, batch()), (4, batch())])


@pytest.mark.parametrize(
    ("missing", "recovered", "outcome"),
    [(3, 3, "repaired"), (3, 1, "incomplete"), (3, 0, "failed"), (1, 0, "failed")],
)
def test_replay_outcome(missing: int, recovered: int, outcome: str) -> None:
    assert replay_outcome(missing, recovered) == outcome


def test_connect_backoff_doubles_from_50_ms_to_a_2_s_cap() -> None:
    assert [connect_backoff_s(n) for n in range(1, 9)] == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.8,
        1.6,
        2.0,
        2.0,
    ]


# --- the shell, on a scripted fake context --------------------------------------------------


async def subscribe_until(sub: RankSubscriber, done: Callable[[], Awaitable[object]]) -> None:
    """Run `sub` until `done()` returns (5 s at most), then cancel it."""
    task = asyncio.create_task(sub.run())
    try:
        async with asyncio.timeout(5):
            await done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def run_until(
    publisher: ScriptedPublisher,
    n_items: int,
    then: Callable[[], object] | None = None,
    **options: Any,
) -> tuple[list[SubscriberItem], RankSubscriber]:
    """Run a subscriber to `publisher` (`options`: RankSubscriber's) until it delivered
    `n_items` (and `then()` holds)."""
    items: list[SubscriberItem] = []
    delivered = asyncio.Event()

    async def deliver(item: SubscriberItem) -> None:
        items.append(item)
        if len(items) >= n_items:
            delivered.set()

    async def done() -> None:
        await delivered.wait()
        if then is not None:
            await eventually(then)

    async with publisher.running():
        endpoint = RankEndpoint(RANK, publisher.url, topic=b"kv")
        sub = RankSubscriber(endpoint, deliver, context=None, **options)  # type: ignore[arg-type]
        await subscribe_until(sub, done)
    return items, sub


def frames(seq: int, payload: bytes = PAYLOAD) -> list[bytes]:
    return [b"kv", seq_b(seq), payload]


async def test_a_closed_connection_is_counted_and_the_subscriber_subscribes_again() -> None:
    publisher = ScriptedPublisher(Script([frames(4), CLOSE]), Script([frames(5)]))
    items, sub = await run_until(publisher, 2)
    assert [(type(i), getattr(i, "seq", None)) for i in items] == [(LiveBatch, 4), (LiveBatch, 5)]
    assert (sub.stats.disconnects, sub.stats.socket_rebuilds) == (1, 1)
    assert len(publisher.seen) == 2
    for seen in publisher.seen:
        # A ZMTP 3.0 NULL greeting, a READY naming a SUB, then the subscription to the topic.
        assert seen.greeting[:1] == b"\xff" and seen.greeting[9:12] == b"\x7f\x03\x00"
        assert seen.greeting[12:32].rstrip(b"\x00") == b"NULL"
        assert seen.commands == [b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB"]
        assert seen.subscriptions == [b"kv"]


async def test_a_long_burst_then_a_close_is_handled_whole_before_connecting_again() -> None:
    burst = Raw(b"".join(message(frames(seq)) for seq in range(200)))  # > DRAIN_BATCH
    publisher = ScriptedPublisher(Script([burst, CLOSE]), Script([frames(200)]))
    items, sub = await run_until(publisher, 201)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == list(range(201))
    assert (sub.stats.disconnects, sub.stats.gaps, sub.stats.lost_batches) == (1, 0, 0)


async def test_a_message_of_another_topic_is_dropped_as_a_sub_socket_would() -> None:
    """Publishers filter by subscription themselves; one that does not is filtered here."""
    other = [b"kx", seq_b(5), PAYLOAD]
    prefixed = [b"kv-longer", seq_b(5), PAYLOAD]  # a topic is a prefix match, as in ZeroMQ
    publisher = ScriptedPublisher(Script([frames(4), other, prefixed, frames(6)]))
    items, sub = await run_until(publisher, 3)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == [4, 5, 6]
    assert (sub.stats.frames, sub.stats.gaps) == (3, 0)


async def test_a_burst_of_ready_messages_is_handled_in_order_in_one_go() -> None:
    burst = Raw(b"".join(message(frames(seq)) for seq in range(10, 200)))
    items, sub = await run_until(ScriptedPublisher(Script([burst])), 190)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == list(range(10, 200))
    assert (sub.stats.frames, sub.stats.gaps, sub.stats.socket_rebuilds) == (190, 0, 0)


async def test_a_payload_over_255_bytes_and_a_ping_between_messages_are_read() -> None:
    """A long frame (8-byte size) and a heartbeat PING (answered with a PONG carrying its
    context) between two messages."""
    big = msgspec.msgpack.encode([1.5, [], 1, b"x" * 1000])
    ping = Raw(b"\x04\x0b\x04PING\x00\x0actx1")
    publisher = ScriptedPublisher(Script([frames(4, big), ping, frames(5)]))
    items, _ = await run_until(publisher, 2, then=lambda: publisher.seen[0].after)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == [4, 5]
    assert bytes(publisher.seen[0].after) == b"\x04\x09\x04PONGctx1"


@pytest.mark.parametrize(
    ("handshake", "reason"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n" + bytes(64), "no ZMTP signature"),
        (GREETING.replace(b"NULL", b"PLAI", 1) + READY_PUB, "'PLAI' mechanism"),
        (GREETING + READY_PUB.replace(b"\x03PUB", b"\x03REP"), "b'REP' socket"),
    ],
)
async def test_a_peer_that_is_not_a_null_pub_is_dropped_with_the_reason(
    handshake: bytes, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = ScriptedPublisher(Script([], handshake=handshake), Script([frames(5)]))
    items, sub = await run_until(publisher, 1)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == [5]  # from the second peer
    assert (sub.stats.disconnects, sub.stats.socket_rebuilds, sub.stats.frames) == (1, 1, 1)
    assert reason in caplog.text


async def test_a_peer_silent_after_connecting_is_dropped_at_the_handshake_timeout() -> None:
    """A TCP listener that never greets (not a publisher, or a hung one) holds the subscriber
    for `handshake_timeout_s` at most; then it connects again."""
    publisher = ScriptedPublisher(Script([], handshake=b""), Script([frames(5)]))
    items, sub = await run_until(publisher, 1, handshake_timeout_s=0.2)
    assert [i.seq for i in items if isinstance(i, LiveBatch)] == [5]
    assert (sub.stats.disconnects, sub.stats.socket_rebuilds) == (1, 1)
    assert len(publisher.seen) == 2 and publisher.seen[0].subscriptions == []


async def test_a_batch_of_one_block_removals_is_delivered_as_one_folded_run() -> None:
    evicting = [{"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"} for h in range(9)]
    publisher = ScriptedPublisher(Script([frames(4, msgspec.msgpack.encode([1.5, evicting, 1]))]))
    items, _ = await run_until(publisher, 1)
    assert isinstance(items[0], LiveBatch)
    assert items[0].batch.events == [RemovedRun(list(range(9)), DEVICE, "GPU")]


async def test_a_payload_that_does_not_decode_surfaces_as_a_gap_at_the_next_batch() -> None:
    publisher = ScriptedPublisher(Script([frames(4), frames(5, b"\xc1garbage"), frames(6)]))
    items, sub = await run_until(publisher, 3)
    assert items[1] == UnrepairedGap(RANK, 5, 5)
    assert isinstance(items[2], LiveBatch) and items[2].seq == 6
    assert sub.stats.decode_errors == {"malformed_msgpack": 1}
    assert (sub.stats.gaps, sub.stats.lost_batches, sub.stats.batches) == (1, 1, 2)


async def test_gaps_without_replay_warn_once_a_period_with_the_batches_lost_since(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A publisher dropping every other batch, with no replay endpoint, wrote a warning per
    gap (1,500 lines a second, and as many again from the pump)."""
    clock = ManualClock()
    seqs = range(0, 400, 2)  # 199 gaps of one batch
    publisher = ScriptedPublisher(Script([frames(seq) for seq in seqs]))
    with caplog.at_level(logging.WARNING, logger="router.subscriber"):
        _, sub = await run_until(publisher, len(seqs) + 199, clock=clock)
    assert sub.stats.lost_batches == 199
    said = [r.getMessage() for r in caplog.records if "replay unavailable" in r.getMessage()]
    assert said == [
        f"rank {RANK}: 1 batch(es) lost since the last such warning (the latest seq 1), "
        "replay unavailable: give the engine a replay endpoint to recover them"
    ]


async def test_a_regression_to_a_non_zero_seq_is_a_reset_then_the_new_streams_first_batches() -> (
    None
):
    """Seq 3 after 9: the engine restarted and sent 0..2 before we heard it. Without replay
    they are an UnrepairedGap (the worker's snapshot is pulled), between the reset and 3."""
    items, sub = await run_until(ScriptedPublisher(Script([frames(9), frames(3), frames(4)])), 5)
    assert items == [
        LiveBatch(RANK, 9, items[0].batch),  # type: ignore[union-attr]
        PublisherReset(RANK),
        UnrepairedGap(RANK, 0, 2),
        LiveBatch(RANK, 3, items[3].batch),  # type: ignore[union-attr]
        LiveBatch(RANK, 4, items[4].batch),  # type: ignore[union-attr]
    ]
    assert (sub.stats.resets, sub.stats.gaps, sub.stats.lost_batches) == (1, 1, 3)


async def test_the_last_seq_again_is_dropped_and_counted_never_a_reset_nor_a_loss() -> None:
    """Seq 1,000,001 a hundred times: each copy was a reset and an UnrepairedGap of the
    1,000,001 batches 0..1,000,000, so the pump cleared the rank and counted 1.0e8 lost."""
    copies = [frames(1_000_001)] * 100
    script = Script([frames(1_000_000), frames(1_000_001), *copies, frames(1_000_002)])
    items, sub = await run_until(ScriptedPublisher(script), 3)
    assert [(type(i), i.seq) for i in items] == [  # type: ignore[union-attr]
        (LiveBatch, 1_000_000),
        (LiveBatch, 1_000_001),
        (LiveBatch, 1_000_002),
    ]
    assert (sub.stats.duplicates, sub.stats.resets, sub.stats.gaps) == (100, 0, 0)
    assert (sub.stats.lost_batches, sub.stats.frames) == (0, 103)


async def test_end_seq_then_a_new_stream_at_3_asks_for_its_batches_0_to_2() -> None:
    publisher = ScriptedPublisher(Script([frames(9), [b"kv", b"\xff" * 8, b""], frames(3)]))
    items, sub = await run_until(publisher, 4)
    assert items[1:3] == [PublisherReset(RANK), UnrepairedGap(RANK, 0, 2)]
    assert isinstance(items[3], LiveBatch) and items[3].seq == 3
    assert (sub.stats.resets, sub.stats.gaps, sub.stats.frames) == (1, 1, 3)


async def test_a_seq_jump_past_the_bound_is_a_reset_and_counts_no_lost_batch() -> None:
    publisher = ScriptedPublisher(Script([frames(4), frames(2**63 - 1), frames(5)]))
    items, sub = await run_until(publisher, 6)
    assert [type(i).__name__ for i in items] == [
        "LiveBatch",
        "PublisherReset",
        "LiveBatch",
        "PublisherReset",  # 5 after 2**63-1 is a regression: the rogue stream ended ...
        "UnrepairedGap",  # ... and a new one sent 0..4 unheard
        "LiveBatch",
    ]
    assert items[1] == PublisherReset(RANK, jumped=True)  # the pump asks for the snapshot
    assert items[3] == PublisherReset(RANK) and items[4] == UnrepairedGap(RANK, 0, 4)
    assert (sub.stats.seq_jumps, sub.stats.lost_batches, sub.stats.gaps) == (1, 5, 1)
    assert sub.stats.replay.total() == 0  # no replay asked for 9.2e18 batches


async def test_a_jump_of_exactly_the_bound_is_still_a_gap_reported_with_its_range() -> None:
    items, sub = await run_until(
        ScriptedPublisher(Script([frames(4), frames(5 + MAX_SEQ_JUMP)])), 3
    )
    assert items[1] == UnrepairedGap(RANK, 5, 4 + MAX_SEQ_JUMP)
    assert (sub.stats.seq_jumps, sub.stats.lost_batches) == (0, MAX_SEQ_JUMP)


async def test_items_go_through_offer_while_it_takes_them_and_deliver_from_one_it_refuses() -> None:
    """A refused item and the items behind it wait for `deliver`, in order; then offers resume."""
    # One write: the four messages arrive in one read, so the order is the subscriber's doing.
    jump = 2**62  # a new stream: the reset and its first batch are handed over together
    burst = Raw(b"".join(message(frames(seq)) for seq in (4, jump, jump + 1, jump + 2)))
    channel: list[tuple[str, object]] = []
    done = asyncio.Event()
    refused: list[SubscriberItem] = []

    def note(how: str, item: SubscriberItem) -> None:
        channel.append((how, getattr(item, "seq", "reset")))
        if len(channel) == 5:
            done.set()

    def offer(item: SubscriberItem) -> bool:
        if type(item) is PublisherReset and not refused:
            refused.append(item)
            return False  # a full pump queue
        note("offer", item)
        return True

    async def deliver(item: SubscriberItem) -> None:
        await asyncio.sleep(0)  # really waits: the messages behind it must wait too
        note("deliver", item)

    async with ScriptedPublisher(Script([burst])).running() as publisher:
        ep = RankEndpoint(RANK, publisher.url, topic=b"kv")
        sub = RankSubscriber(ep, deliver, context=None, offer=offer)  # type: ignore[arg-type]
        await subscribe_until(sub, done.wait)
    assert channel == [
        ("offer", 4),
        ("deliver", "reset"),  # refused by offer, then delivered
        ("deliver", jump),  # behind it: never offered ahead of it
        ("offer", jump + 1),
        ("offer", jump + 2),
    ]
    assert (sub.stats.batches, sub.stats.resets, sub.stats.frames) == (4, 1, 4)


async def test_an_exception_from_offer_ends_run_and_closes_the_connection() -> None:
    def offer(item: SubscriberItem) -> bool:
        raise RuntimeError("the taker broke")

    async def deliver(item: SubscriberItem) -> None:
        raise AssertionError("not reached")

    burst = Raw(message(frames(4)) + message(frames(5)))
    async with ScriptedPublisher(Script([burst])).running() as publisher:
        ep = RankEndpoint(RANK, publisher.url, topic=b"kv")
        sub = RankSubscriber(ep, deliver, context=None, offer=offer)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="the taker broke"):
            async with asyncio.timeout(5):
                await sub.run()
        await eventually(lambda: publisher.seen[0].hung_up, within_s=5)
    assert sub.stats.frames == 1  # nothing read after the failure
