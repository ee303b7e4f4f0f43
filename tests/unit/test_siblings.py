"""Decision sharing's plain parts: the outbox's bounds, the batch checks, adopting a batch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import msgspec
import pytest

from cachetree.ranks import RankId
from peer.origin import canonical_origin
from router import siblings
from router.homes import MAX_CHAIN_BLOCKS, Home
from router.siblings import DecisionBatch, Outbox, SharedDecision, SharedHome, decode_batch
from tests.support.clock import ManualClock
from tests.support.ports import free_tcp_port
from tests.support.waiting import eventually

A, B = RankId("http://a:8000", 0), RankId("http://b:8000", 1)


def encoded(*decisions: SharedDecision) -> bytes:
    return msgspec.msgpack.encode(DecisionBatch(list(decisions)))


def test_the_outbox_hands_out_every_pending_decision_once_as_one_batch() -> None:
    box = Outbox()
    assert box.take() is None
    box.add(A, [1, 2, 3], 1)
    box.add(B, [4], 0)
    box.add(B, [], 0)  # nothing to tell: not queued
    batch = box.take()
    assert batch is not None
    body, count = batch
    assert count == 2 and box.take() is None and box.pending_keys == 0
    assert decode_batch(body).decisions == [
        SharedDecision(A.worker_url, 0, 1, [1, 2, 3]),
        SharedDecision(B.worker_url, 1, 0, [4]),
    ]


def test_the_outbox_keeps_a_long_prompts_head_and_drops_the_oldest_past_its_bound() -> None:
    box = Outbox(max_pending_keys=10_000)
    long = list(range(siblings.MAX_KEYS_PER_DECISION + 500))
    box.add(A, long, len(long))
    assert box.pending_keys == siblings.MAX_KEYS_PER_DECISION  # the head, held clamped
    box.add(B, list(range(4000)), 0)  # 12,192 keys pending: the oldest decision goes
    assert (len(box), box.pending_keys, box.dropped) == (1, 4000, 1)
    batch = box.take()
    assert batch is not None
    assert [d.worker_url for d in decode_batch(batch[0]).decisions] == [B.worker_url]


def test_the_outbox_never_holds_more_decisions_than_a_batch_may_carry() -> None:
    box = Outbox()
    for i in range(siblings.MAX_DECISIONS_PER_BATCH + 3):
        box.add(A, [i], 0)
    assert (len(box), box.dropped) == (siblings.MAX_DECISIONS_PER_BATCH, 3)
    batch = box.take()
    assert batch is not None
    assert len(decode_batch(batch[0]).decisions) == siblings.MAX_DECISIONS_PER_BATCH


def receiver(**kw: Any) -> siblings.DecisionSharing:
    """A sharing end that only receives (it posts nothing: no session, no peers)."""
    return siblings.DecisionSharing(session=None, peers=list, token="t", **kw)  # type: ignore[arg-type]


GOOD = SharedDecision("http://a:8000", 0, 1, [5, 6])


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"", "not a decision batch"),
        (b"\xc1garbage", "not a decision batch"),
        (msgspec.msgpack.encode({"decisions": [["http://a:8000", 0, 1]]}), "not a decision"),
        (msgspec.msgpack.encode({"decisions": [], "extra": 1}), "not a decision batch"),
        (msgspec.msgpack.encode({"decisions": [["u", "0", 0, [1]]]}), "not a decision batch"),
        (encoded(GOOD, SharedDecision("", 0, 0, [1])), r"decisions\[1\]: worker_url"),
        (encoded(SharedDecision("u" * 2049, 0, 0, [1])), "worker_url"),
        (encoded(SharedDecision("http://a", -1, 0, [1])), "dp_rank"),
        (encoded(SharedDecision("http://a", 1 << 16, 0, [1])), "dp_rank"),
        (encoded(SharedDecision("http://a", 0, 0, [])), "keys must hold"),
        (encoded(SharedDecision("http://a", 0, 3, [1, 2])), "held"),
        (encoded(SharedDecision("http://a", 0, -1, [1, 2])), "held"),
        (encoded(SharedDecision("http://a", 0, 0, [1, -2])), "unsigned 64-bit"),
        (
            encoded(SharedDecision("http://a", 0, 0, [0] * (siblings.MAX_KEYS_PER_DECISION + 1))),
            "keys must hold",
        ),
        (
            encoded(*[GOOD] * (siblings.MAX_DECISIONS_PER_BATCH + 1)),
            "decisions and 0 homes; at most",
        ),
        (b"\x00" * (siblings.MAX_BODY_BYTES + 1), "bytes; at most"),
    ],
)
def test_a_malformed_batch_is_refused_whole_with_its_reason(body: bytes, reason: str) -> None:
    adopted: list[tuple[RankId, Sequence[int], int]] = []
    sharing = receiver(
        adopt=lambda rank, keys, held: adopted.append((rank, keys, held)),
        known=lambda rank: True,
    )
    with pytest.raises(ValueError, match=reason):
        sharing.receive(body)
    assert adopted == [] and sharing.stats.refused == 1 and sharing.stats.received == 0


def home(rank: RankId = A, **changes: object) -> SharedHome:
    """A well-formed shared home (anchored at 5, 3 blocks deep), with `changes` applied."""
    shared = SharedHome(rank.worker_url, rank.dp_rank, 5, 3, 7, [5, 6, 7], 5, 1, 1700000000.5,
                        4, None)  # fmt: skip
    return msgspec.structs.replace(shared, **changes)


def with_homes(*homes: SharedHome) -> bytes:
    return msgspec.msgpack.encode(DecisionBatch([GOOD], list(homes)))


def test_a_batch_without_homes_encodes_as_before_homes_existed() -> None:
    # a sibling that predates homes (forbid_unknown_fields) still reads this replica's
    # batches while homes are off
    assert encoded(GOOD) == msgspec.msgpack.encode({"decisions": [["http://a:8000", 0, 1, [5, 6]]]})


def test_the_outbox_carries_homes_beside_decisions_and_bounds_them_together() -> None:
    box = Outbox(max_pending_keys=10)
    box.add(A, [1, 2, 3], 0)
    placed = Home(B, 40, 2, 42, [40, 41, 42, 43], 0, 0.0, 123.0, 9)
    box.add_home(placed)
    batch = box.take()
    assert batch is not None and batch[1] == 1  # one decision (homes are not counted sent)
    got = decode_batch(batch[0])
    assert [h.home(5.0) for h in got.homes] == [
        Home(B, 40, 2, 42, [40, 41, 42, 43], 0, 5.0, 123.0, 9)  # set on the receiver's clock
    ]
    box.add_home(placed)
    box.add_home(placed)
    box.add_home(placed)  # 12 keys pending: the oldest home goes
    assert (len(box), box.pending_keys, box.dropped) == (2, 8, 1)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (home(worker_url=""), r"homes\[1\]: worker_url"),
        (home(dp_rank=-1), "dp_rank"),
        (home(chain=[]), "chain must hold"),
        (home(chain=[0] * (MAX_CHAIN_BLOCKS + 1)), "chain must hold"),
        (home(chain=[5, -6, 7]), "unsigned 64-bit"),
        (home(length=MAX_CHAIN_BLOCKS + 1, join=5, chain=[5] * MAX_CHAIN_BLOCKS), None),
        (home(tail_of=-1), "unsigned 64-bit"),
        (home(anchor=6), "anchor must be the chain's first key"),
        (home(join=8), "join one of its keys"),
        (home(depth=-1), "depth <= confirmed"),
        (home(confirmed=2), "depth <= confirmed"),
        (home(confirmed=1 << 21), "depth <= confirmed"),
        (home(length=2), "length must be"),
        (home(generation=-1), "generation"),
        (home(stamp=float("nan")), "stamp must be a finite number"),
    ],
)
def test_a_batch_with_a_malformed_home_is_refused_whole(
    bad: SharedHome, reason: str | None
) -> None:
    adopted: list[object] = []
    sharing = receiver(
        adopt=lambda rank, keys, held: adopted.append(keys),
        known=lambda rank: True,
        adopt_home=adopted.append,
    )
    assert sharing.receive(with_homes(home())) == 1 and len(adopted) == 2  # the good one
    if reason is None:  # the bound itself is well-formed
        assert sharing.receive(with_homes(bad)) == 1 and len(adopted) == 4
        return
    with pytest.raises(ValueError, match=reason):
        sharing.receive(with_homes(home(), bad))  # the decision and the good home: not applied
    assert len(adopted) == 2 and sharing.stats.refused == 1
    assert (sharing.stats.received, sharing.stats.homes_received) == (1, 1)


def knowing_a(
    clock: ManualClock, adopt_home: Callable[[Home], None] | None = None
) -> siblings.DecisionSharing:
    """A receiving end that knows rank A alone and adopts nothing."""
    return siblings.DecisionSharing(
        session=None,  # type: ignore[arg-type]
        peers=list,
        token="t",
        adopt=lambda rank, keys, held: None,
        known=lambda rank: rank == A,
        clock=clock,
        adopt_home=adopt_home,
    )


def test_siblings_homes_are_adopted_for_known_ranks_and_only_with_homes_on() -> None:
    homes: list[Home] = []
    sharing = knowing_a(ManualClock(7.0), homes.append)
    sharing.receive(
        with_homes(home(A), home(B), home(A, anchor=9, join=10, chain=[9, 10], confirmed=5))
    )
    assert [(h.rank, h.anchor, h.set_at, h.stamp, h.confirmed) for h in homes] == [
        (A, 5, 7.0, 1700000000.5, 4),
        (A, 9, 7.0, 1700000000.5, 5),
    ]
    assert (sharing.stats.homes_received, sharing.stats.unknown) == (2, 1)
    sharing.adopt_home = None  # homes off here: a sibling's are ignored, its decisions taken
    assert sharing.receive(with_homes(home(A))) == 1 and len(homes) == 2


def test_a_batch_is_adopted_for_known_ranks_and_the_rest_counted_unknown() -> None:
    adopted: list[tuple[RankId, list[int], int]] = []
    sharing = siblings.DecisionSharing(
        session=None,  # type: ignore[arg-type]
        peers=list,
        token="t",
        adopt=lambda rank, keys, held: adopted.append((rank, list(keys), held)),
        known=lambda rank: rank == A,
    )
    body = encoded(GOOD, SharedDecision(B.worker_url, 1, 0, [7]), GOOD)
    assert sharing.receive(body) == 2
    assert adopted == [(A, [5, 6], 1), (A, [5, 6], 1)]
    assert (sharing.stats.received, sharing.stats.unknown, sharing.stats.refused) == (2, 1, 0)


def test_decisions_on_ranks_this_replica_lacks_are_warned_once_a_minute_naming_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Replicas given different workers: the placer's placements on a worker this replica
    lacks were counted `unknown` and nothing said so."""
    clock = ManualClock()
    sharing = knowing_a(clock)
    stranger = SharedDecision(B.worker_url, 1, 0, [7])
    caplog.set_level("WARNING", logger="router.siblings")
    sharing.receive(encoded(GOOD, stranger, stranger))
    clock.advance(30.0)
    sharing.receive(encoded(stranger))  # within the minute: counted, not said
    clock.advance(30.0)
    sharing.receive(encoded(GOOD))  # nothing unknown: nothing to say
    sharing.receive(encoded(stranger))
    said = [r.getMessage() for r in caplog.records if r.name == "router.siblings"]
    advice = "give every replica the same worker list (--worker, or one --worker-selector)"
    assert len(said) == 2 and all(advice in line for line in said)
    assert said[0].startswith(
        f"decision sharing: siblings shared 2 decision(s) on ranks this replica does not know "
        f"since this was last said ({RankId(B.worker_url, 1)} the last)"
    )
    assert "shared 2 decision(s)" in said[1]  # the one held back, and this one
    assert sharing.stats.unknown == 4


async def test_a_dead_sibling_is_skipped_for_a_backoff_not_dialled_per_decision() -> None:
    clock = ManualClock()
    dead = f"http://127.0.0.1:{free_tcp_port()}"  # nothing listens there
    async with aiohttp.ClientSession() as session:
        sharing = siblings.DecisionSharing(
            session, lambda: [dead], "t", lambda *a: None, lambda r: True, clock=clock
        )
        task = asyncio.create_task(sharing.run())
        try:
            sharing.share(A, [1, 2], 0)
            await eventually(lambda: sharing.stats.failed == 1, within_s=5.0)
            for i in range(3):  # within the first 50 ms of backoff: not dialled
                sharing.share(A, [3 + i], 0)
                await eventually(lambda i=i: sharing.stats.skipped == i + 1, within_s=5.0)
            assert sharing.stats.failed == 1
            clock.advance(0.05)
            sharing.share(A, [9], 0)
            await eventually(lambda: sharing.stats.failed == 2, within_s=5.0)
            sharing.share(A, [10], 0)  # the backoff doubled: 100 ms now
            clock.advance(0.06)
            sharing.share(A, [11], 0)
            await eventually(lambda: sharing.stats.skipped == 5, within_s=5.0)
            assert (sharing.stats.failed, sharing.stats.sent) == (2, 0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_decisions_and_homes_naming_a_worker_as_written_book_the_registrys_rank() -> None:
    """A sibling of another version sends its --worker flag as written. `known` finds the
    worker by any spelling (the registry's lookup does); the ledger and the homes must get
    the registry's own rank, else a booking no stream of ours confirms."""
    local, named = RankId("http://127.0.0.1:27001", 0), RankId("http://w", 1)
    registered = {local, named}
    adopted: list[RankId] = []
    homes: list[Home] = []
    sharing = siblings.DecisionSharing(
        session=None,  # type: ignore[arg-type]
        peers=list,
        token="t",
        adopt=lambda rank, keys, held: adopted.append(rank),
        known=lambda rank: RankId(canonical_origin(rank.worker_url), rank.dp_rank) in registered,
        adopt_home=homes.append,
    )
    written = [("http://localhost:27001", 0), ("http://W:80/", 1)]
    body = msgspec.msgpack.encode(
        DecisionBatch(
            [SharedDecision(url, dp, 0, [7]) for url, dp in written],
            [home(RankId(url, dp)) for url, dp in written],
        )
    )
    assert sharing.receive(body) == 2
    assert adopted == [local, named]
    assert [h.rank for h in homes] == [local, named]
    assert sharing.stats.unknown == 0


def test_a_large_batch_is_adopted_in_chunks_with_the_loop_let_in_between() -> None:
    adopted: list[RankId] = []
    sharing = receiver(
        adopt=lambda rank, keys, held: adopted.append(rank),
        known=lambda rank: True,
    )
    count = 2 * siblings.ADOPT_CHUNK + 5
    steps = sharing.adopt_steps(sharing.decode(encoded(*[GOOD] * count)))
    taken = []
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
            taken.append(len(adopted))
    assert taken == [siblings.ADOPT_CHUNK, 2 * siblings.ADOPT_CHUNK]  # two turns of the loop
    assert done.value.value == count == len(adopted) == sharing.stats.received
