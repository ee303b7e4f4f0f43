"""Decision sharing's plain parts: the outbox's bounds, the batch checks, adopting a batch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import aiohttp
import msgspec
import pytest

from cachetree.ranks import RankId
from router import siblings
from router.siblings import DecisionBatch, Outbox, SharedDecision, decode_batch
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
    assert decode_batch(body) == [
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
    assert [d.worker_url for d in decode_batch(batch[0])] == [B.worker_url]


def test_the_outbox_never_holds_more_decisions_than_a_batch_may_carry() -> None:
    box = Outbox()
    for i in range(siblings.MAX_DECISIONS_PER_BATCH + 3):
        box.add(A, [i], 0)
    assert (len(box), box.dropped) == (siblings.MAX_DECISIONS_PER_BATCH, 3)
    batch = box.take()
    assert batch is not None
    assert len(decode_batch(batch[0])) == siblings.MAX_DECISIONS_PER_BATCH


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
        (encoded(*[GOOD] * (siblings.MAX_DECISIONS_PER_BATCH + 1)), "decisions; at most"),
        (b"\x00" * (siblings.MAX_BODY_BYTES + 1), "bytes; at most"),
    ],
)
def test_a_malformed_batch_is_refused_whole_with_its_reason(body: bytes, reason: str) -> None:
    adopted: list[tuple[RankId, Sequence[int], int]] = []
    sharing = siblings.DecisionSharing(
        session=None,  # type: ignore[arg-type]  # receiving posts nothing
        peers=list,
        token="t",
        adopt=lambda rank, keys, held: adopted.append((rank, keys, held)),
        known=lambda rank: True,
    )
    with pytest.raises(ValueError, match=reason):
        sharing.receive(body)
    assert adopted == [] and sharing.stats.refused == 1 and sharing.stats.received == 0


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
