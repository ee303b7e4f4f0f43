"""`RankSubscriber` over real ZMQ on 127.0.0.1, against the fake worker or hand-made sockets.

Every test gates first: it publishes probe batches until one is delivered (a connecting SUB
misses whatever is published before its subscription reaches the publisher), then drains up
to the last probe and forgets what came before. Only then does it publish what it asserts on.
Absence is shown by order, never by waiting: items are delivered in seq order, so once the
item after a hole has arrived, the items for the hole have arrived too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from cachetree.ranks import RankId
from router import subscriber
from router.events import BlockStored
from router.subscriber import (
    LiveBatch,
    PublisherReset,
    RankEndpoint,
    RankSubscriber,
    SubscriberItem,
    UnrepairedGap,
)
from router.zmq_term import terminate_context
from tests.support.clock import ManualClock
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(20)

CHAIN_A = list(range(100, 132))  # two blocks of 16
CHAIN_B = list(range(200, 248))  # three blocks
CHAIN_C = list(range(300, 316))  # one block
ATTEMPT_S = 0.1  # how long one gate probe waits before publishing another
WITHIN_S = 5.0


@dataclass
class Harness:
    """Collects what a subscriber delivers and waits on it."""

    items: list[SubscriberItem] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    sub: RankSubscriber | None = None

    async def deliver(self, item: SubscriberItem) -> None:
        async with self.changed:
            self.items.append(item)
            self.changed.notify_all()

    async def wait_for(self, done: Callable[[], bool], within_s: float = WITHIN_S) -> None:
        async with asyncio.timeout(within_s), self.changed:
            await self.changed.wait_for(done)

    async def until_seq(self, seq: int, within_s: float = WITHIN_S) -> list[SubscriberItem]:
        """Wait until a LiveBatch at `seq` is delivered; returns every item so far."""
        await self.wait_for(
            lambda: any(type(i) is LiveBatch and i.seq == seq for i in self.items), within_s
        )
        return list(self.items)

    async def gate(self, probe: Callable[[], Awaitable[int]]) -> int:
        """Probe until a batch is delivered, drain through the last probe, forget the items."""
        async with asyncio.timeout(WITHIN_S * 2):
            while True:
                last = await probe()
                try:
                    await self.wait_for(lambda: bool(self.items), ATTEMPT_S)
                except TimeoutError:
                    continue  # the subscription had not propagated yet: probe again
                await self.until_seq(last)
                self.items.clear()
                return last

    @property
    def stats(self) -> Any:
        assert self.sub is not None
        return self.sub.stats


@contextlib.asynccontextmanager
async def subscribed(endpoint: RankEndpoint, **kwargs: Any) -> AsyncIterator[Harness]:
    """Run a RankSubscriber on its own ZMQ context; on exit, cancel it and terminate the
    context, which only returns once every socket the subscriber opened is closed."""
    ctx = zmq.asyncio.Context()
    h = Harness()
    h.sub = RankSubscriber(endpoint, h.deliver, context=ctx, **kwargs)
    task = asyncio.create_task(h.sub.run())
    try:
        yield h
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await terminate_context(ctx, within_s=WITHIN_S, what="test")


def endpoint_of(fw: FakeWorkerHandle, dp_rank: int = 0, *, replay: bool = True) -> RankEndpoint:
    return RankEndpoint(
        RankId(fw.url, dp_rank),
        fw.kv_endpoint(dp_rank),
        replay_endpoint=fw.replay_endpoint(dp_rank) if replay else None,
    )


def shape(items: list[SubscriberItem]) -> list[tuple[object, ...]]:
    """Items as ("batch", seq), ("gap", first, last) or ("reset",), for readable asserts."""
    out: list[tuple[object, ...]] = []
    for i in items:
        if isinstance(i, LiveBatch):
            out.append(("batch", i.seq))
        elif isinstance(i, UnrepairedGap):
            out.append(("gap", i.first, i.last))
        else:
            out.append(("reset",))
    return out


def first_tokens(item: SubscriberItem) -> list[int]:
    assert isinstance(item, LiveBatch)
    event = item.batch.events[0]
    assert isinstance(event, BlockStored)
    return event.token_ids


# --- against the fake worker ----------------------------------------------------------------


async def test_batches_arrive_decoded_with_dense_seqs_in_order() -> None:
    async with fake_worker_in_process(dp_size=2, replay=True) as fw:
        ep = endpoint_of(fw, 1)
        async with subscribed(ep) as h:
            gate = await h.gate(fw.probe_for(1))
            last = await fw.store([CHAIN_A, CHAIN_B, CHAIN_C], dp_rank=1)
            items = await h.until_seq(last)
        assert shape(items) == [("batch", gate + 1), ("batch", gate + 2), ("batch", gate + 3)]
        assert all(isinstance(i, LiveBatch) and i.rank == RankId(fw.url, 1) for i in items)
        stored = [i.batch.events for i in items if isinstance(i, LiveBatch)]
        assert [[type(e) for e in ev] for ev in stored] == [[BlockStored]] * 3
        assert [first_tokens(i) for i in items] == [CHAIN_A, CHAIN_B, CHAIN_C]
        assert [i.batch.dp_rank for i in items if isinstance(i, LiveBatch)] == [1, 1, 1]
        assert (h.stats.gaps, h.stats.resets, h.stats.bad_frames, h.stats.replay) == (0, 0, 0, {})


async def test_dropped_batches_are_recovered_by_replay_in_order() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        subscribed(endpoint_of(fw)) as h,
    ):
        gate = await h.gate(fw.probe)
        await fw.post("/control/drop-next", {"count": 2})
        last = await fw.store([CHAIN_A, CHAIN_B, CHAIN_C])
        items = await h.until_seq(last)
        assert shape(items) == [("batch", gate + 1), ("batch", gate + 2), ("batch", gate + 3)]
        assert [first_tokens(i) for i in items] == [CHAIN_A, CHAIN_B, CHAIN_C]
        assert h.stats.replay == {"repaired": 1}
        assert (h.stats.gaps, h.stats.replayed, h.stats.lost_batches) == (1, 2, 0)


async def test_a_skipped_seq_is_an_unrepaired_gap_and_later_batches_still_arrive() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        subscribed(endpoint_of(fw)) as h,
    ):
        gate = await h.gate(fw.probe)
        skipped = (await fw.post("/control/skip-seq", {}))["last_seq"]
        after = await fw.store([CHAIN_A])
        later = await fw.store([CHAIN_B])
        items = await h.until_seq(later)
        assert skipped == gate + 1
        assert shape(items) == [("gap", skipped, skipped), ("batch", after), ("batch", later)]
        assert items[0] == UnrepairedGap(RankId(fw.url, 0), skipped, skipped)
        # Replay answered, but its buffer skips the hole too: nothing recovered.
        assert h.stats.replay == {"failed": 1}
        assert (h.stats.gaps, h.stats.lost_batches) == (1, 1)


async def test_a_partly_replayable_gap_delivers_what_replay_has_and_reports_the_hole() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        subscribed(endpoint_of(fw)) as h,
    ):
        gate = await h.gate(fw.probe)
        await fw.post("/control/drop-next", {"count": 1})
        dropped = await fw.store([CHAIN_A])  # buffered for replay, not sent live
        hole = (await fw.post("/control/skip-seq", {}))["last_seq"]  # exists nowhere
        last = await fw.store([CHAIN_B])
        items = await h.until_seq(last)
        assert (dropped, hole, last) == (gate + 1, gate + 2, gate + 3)
        assert shape(items) == [("batch", dropped), ("gap", hole, hole), ("batch", last)]
        assert h.stats.replay == {"incomplete": 1}
        assert (h.stats.replayed, h.stats.lost_batches) == (1, 1)


async def test_without_replay_a_dropped_range_is_one_unrepaired_gap() -> None:
    async with (
        fake_worker_in_process() as fw,
        subscribed(endpoint_of(fw, replay=False)) as h,
    ):
        gate = await h.gate(fw.probe)
        await fw.post("/control/drop-next", {"count": 2})
        last = await fw.store([CHAIN_A, CHAIN_B, CHAIN_C])
        items = await h.until_seq(last)
        assert shape(items) == [("gap", gate + 1, gate + 2), ("batch", last)]
        assert items[0] == UnrepairedGap(RankId(fw.url, 0), gate + 1, gate + 2)
        assert h.stats.replay == {}
        assert (h.stats.gaps, h.stats.lost_batches) == (1, 2)


async def test_a_publisher_restart_is_delivered_as_seq_zero_without_a_reset() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        subscribed(endpoint_of(fw)) as h,
    ):
        gate = await h.gate(fw.probe)
        await fw.store([CHAIN_A])
        await fw.post("/control/restart-publisher", {"dp_rank": 0})
        assert await fw.store([CHAIN_B, CHAIN_C]) == 1
        # Seq 1 may also be CHAIN_A's (gate 0), so wait for the count, not for a seq.
        await h.wait_for(lambda: len(h.items) >= 3)
        assert shape(h.items) == [("batch", gate + 1), ("batch", 0), ("batch", 1)]
        assert (h.stats.resets, h.stats.gaps) == (0, 0)


async def test_end_seq_on_worker_stop_is_a_publisher_reset() -> None:
    async with fake_worker_in_process(replay=True) as fw, subscribed(endpoint_of(fw)) as h:
        await h.gate(fw.probe)
        assert fw.worker is not None
        await fw.worker.stop()  # sends END_SEQ; the context exit's stop is then a no-op
        await h.wait_for(lambda: bool(h.items))
        assert h.items == [PublisherReset(RankId(fw.url, 0))]
        assert h.stats.resets == 1
        assert h.sub is not None and h.sub.tracker.last is None


async def test_a_slow_deliver_loses_no_batches() -> None:
    """The pump's bounded queue is full and nobody reads it while 200 batches are published:
    the subscriber waits (ZMQ holds the frames), then delivers every one, in order."""
    queue: asyncio.Queue[SubscriberItem] = asyncio.Queue(maxsize=4)
    blocked = asyncio.Event()

    async def deliver(item: SubscriberItem) -> None:
        if queue.full():
            blocked.set()
        await queue.put(item)

    n = 200
    chains = [[7, 7, 7, *range(1000 + 16 * i, 1000 + 16 * i + 13)] for i in range(n)]
    async with fake_worker_in_process(cache_blocks=4096) as fw:
        ctx = zmq.asyncio.Context()
        sub = RankSubscriber(endpoint_of(fw, replay=False), deliver, context=ctx)
        task = asyncio.create_task(sub.run())
        try:
            gate = None
            async with asyncio.timeout(WITHIN_S * 2):
                while gate is None:  # the gate, on the queue instead of a Harness
                    last = await fw.probe()
                    try:
                        item = await asyncio.wait_for(queue.get(), ATTEMPT_S)
                    except TimeoutError:
                        continue
                    while not (isinstance(item, LiveBatch) and item.seq == last):
                        item = await queue.get()
                    gate = last
            before = sub.stats.batches
            last = await fw.store(chains)
            assert last == gate + n
            await asyncio.wait_for(blocked.wait(), WITHIN_S)
            # Stuck on the full queue: what fits, plus the one being put, left the subscriber.
            assert sub.stats.batches - before == queue.maxsize + 1
            got: list[SubscriberItem] = []
            async with asyncio.timeout(WITHIN_S):
                while not got or not isinstance(got[-1], LiveBatch) or got[-1].seq != last:
                    got.append(await queue.get())
            assert shape(got) == [("batch", s) for s in range(gate + 1, last + 1)]
            assert (sub.stats.gaps, sub.stats.lost_batches) == (0, 0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert await terminate_context(ctx, within_s=WITHIN_S, what="test")


# --- against hand-made sockets --------------------------------------------------------------

RANK = RankId("http://127.0.0.1:1", 0)
GOOD = msgspec.msgpack.encode([1.0, [], 0])


def seq_b(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


@contextlib.asynccontextmanager
async def bound(kind: int, url: str | None = None) -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    """A socket bound at `url`, or at a free loopback port."""
    sock = zmq.asyncio.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if url is None:
        url = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        sock.bind(url)
    try:
        yield sock, url
    finally:
        sock.close(linger=0)


def pub_probe(pub: zmq.asyncio.Socket, seqs: itertools.count[int]) -> Callable[[], Awaitable[int]]:
    async def probe() -> int:
        seq = next(seqs)
        await pub.send_multipart([b"", seq_b(seq), GOOD])
        return seq

    return probe


async def test_malformed_messages_are_counted_and_dropped() -> None:
    async with bound(zmq.PUB) as (pub, url), subscribed(RankEndpoint(RANK, url)) as h:
        seqs = itertools.count()
        gate = await h.gate(pub_probe(pub, seqs))
        frames_before = h.stats.frames
        await pub.send_multipart([b"", seq_b(gate + 1)])  # 2 frames
        await pub.send_multipart([b"", b"\x00" * 7, GOOD])  # a 7-byte seq
        await pub.send_multipart([b"", seq_b(gate + 1), GOOD, b"extra"])  # 4 frames
        await pub.send_multipart([b"", seq_b(gate + 1), b"\xc1 not msgpack"])
        await pub.send_multipart([b"", seq_b(gate + 2), GOOD])
        items = await h.until_seq(gate + 2)
        # The batch that did not decode is a hole; the malformed messages left no trace.
        assert shape(items) == [("gap", gate + 1, gate + 1), ("batch", gate + 2)]
        assert h.stats.bad_frames == 3
        assert h.stats.decode_errors == {"malformed_msgpack": 1}
        assert h.stats.frames - frames_before == 5
        assert h.stats.lost_batches == 1


async def publish_gap(pub: zmq.asyncio.Socket, h: Harness, missing: int) -> int:
    """Gate, then publish the batch after `missing` unsent ones; returns the gate's seq."""
    gate = await h.gate(pub_probe(pub, itertools.count()))
    await pub.send_multipart([b"", seq_b(gate + missing + 1), GOOD])
    return gate


async def test_legacy_three_frame_replay_replies_repair_a_gap() -> None:
    async with bound(zmq.PUB) as (pub, url), bound(zmq.ROUTER) as (router, replay_url):
        requests: list[list[bytes]] = []

        async def serve_one_legacy_replay() -> None:
            identity, *request = await router.recv_multipart()
            requests.append(request)
            start = int.from_bytes(request[1], "big")
            for reply in (
                [b"", seq_b(start), GOOD],
                [b"", b"short", GOOD],  # malformed: ignored
                [b"", seq_b(start), GOOD],  # a repeat: ignored
                [b"", seq_b(start + 1), GOOD],
                [b"", seq_b(start + 2), GOOD],  # the live batch itself: reading stops
            ):
                await router.send_multipart([identity, *reply])

        server = asyncio.create_task(serve_one_legacy_replay())
        ep = RankEndpoint(RANK, url, replay_endpoint=replay_url)
        async with subscribed(ep) as h:
            gate = await publish_gap(pub, h, missing=2)
            items = await h.until_seq(gate + 3)
            await server
        assert requests == [[b"", seq_b(gate + 1)]]
        assert shape(items) == [("batch", gate + 1), ("batch", gate + 2), ("batch", gate + 3)]
        assert h.stats.replay == {"repaired": 1}


async def test_a_silent_replay_endpoint_times_out_as_failed() -> None:
    async with bound(zmq.PUB) as (pub, url), bound(zmq.ROUTER) as (router, replay_url):
        ep = RankEndpoint(RANK, url, replay_endpoint=replay_url)
        async with subscribed(ep, replay_timeout_s=0.2) as h:
            gate = await publish_gap(pub, h, missing=1)
            request = await asyncio.wait_for(router.recv_multipart(), WITHIN_S)
            items = await h.until_seq(gate + 2)
        assert request[1:] == [b"", seq_b(gate + 1)]  # after the ROUTER's identity frame
        assert shape(items) == [("gap", gate + 1, gate + 1), ("batch", gate + 2)]
        assert h.stats.replay == {"failed": 1}


async def test_the_replay_deadline_follows_the_injected_clock() -> None:
    """A 60 s replay timeout on a clock that jumps 100 s per reading gives up at once."""
    clock = itertools.count(0.0, 100.0).__next__
    async with bound(zmq.PUB) as (pub, url), bound(zmq.ROUTER) as (_, replay_url):
        ep = RankEndpoint(RANK, url, replay_endpoint=replay_url)
        async with subscribed(ep, replay_timeout_s=60.0, clock=clock) as h:
            gate = await publish_gap(pub, h, missing=3)
            items = await h.until_seq(gate + 4, within_s=WITHIN_S)
        assert shape(items) == [("gap", gate + 1, gate + 3), ("batch", gate + 4)]
        assert h.stats.replay == {"failed": 1}


async def test_an_oversized_message_is_refused_and_its_loss_shows_as_a_gap() -> None:
    """libzmq refuses a message over ZMQ_MAXMSGSIZE before allocating it and drops the
    connection; the SUB reconnects on its own and the refused batch (with whatever was
    published while it reconnected) is reported as an UnrepairedGap at the next batch."""
    limit = 64 * 1024
    async with (
        bound(zmq.PUB) as (pub, url),
        subscribed(RankEndpoint(RANK, url), max_message_bytes=limit) as h,
    ):
        seqs = itertools.count()
        gate = await h.gate(pub_probe(pub, seqs))
        fits = msgspec.msgpack.encode([1.0, [], 0, b"x" * (limit - 100)])  # an extra element
        await pub.send_multipart([b"", seq_b(next(seqs)), fits])
        await h.until_seq(gate + 1)
        h.items.clear()
        frames_before = h.stats.frames
        big = next(seqs)
        await pub.send_multipart([b"", seq_b(big), b"\x00" * (1 << 20)])
        # Reconnected: probes reach it again (those sent while it was away are lost too).
        resumed = await h.gate(pub_probe(pub, seqs))
        # The refused batch and the probes sent while it resubscribed: one gap, exactly them.
        assert (h.stats.gaps, h.stats.lost_batches) == (1, resumed - big)
        assert (h.stats.disconnects, h.stats.socket_rebuilds) == (1, 1)
        assert h.stats.listener_gone == 0  # the reconnect was answered: no restart
        assert h.stats.frames - frames_before == 1  # the 1 MiB frame never reached Python
        assert h.stats.bad_frames == 0 and h.stats.decode_errors == {}


async def test_a_real_publisher_jumping_its_seq_past_the_bound_is_reset_not_a_loss() -> None:
    async with (
        fake_worker_in_process(replay=True) as fw,
        subscribed(endpoint_of(fw)) as h,
    ):
        gate = await h.gate(fw.probe)
        await fw.post("/control/skip-seq", {"count": 1 << 21})
        last = await fw.store([CHAIN_A])
        items = await h.until_seq(last)
        assert last == gate + (1 << 21) + 1
        assert shape(items) == [("reset",), ("batch", last)]
        assert (h.stats.seq_jumps, h.stats.lost_batches, h.stats.gaps) == (1, 0, 0)
        assert h.stats.replay == {}  # nothing was asked of the replay endpoint


# --- connecting -----------------------------------------------------------------------------


def _connect_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "router.subscriber" and r.levelno == level and "cannot subscribe" in r.message
    ]


async def test_a_port_that_refuses_warns_once_then_once_an_interval_with_the_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy engine started without KV events is never evicted: its ranks' failing
    connects must not warn every 2 s for good."""
    monkeypatch.setattr(subscriber, "CONNECT_BACKOFF_FIRST_S", 0.001)
    monkeypatch.setattr(subscriber, "CONNECT_BACKOFF_MAX_S", 0.002)
    caplog.set_level(logging.DEBUG, logger="router.subscriber")
    clock = ManualClock()
    with socket.socket() as closed:  # bound, never listening: every connect is refused
        closed.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        async with subscribed(RankEndpoint(RANK, url), clock=clock) as h:
            await eventually(lambda: len(_connect_lines(caplog, logging.DEBUG)) >= 40)
            assert h.stats.listener_gone == 0  # never connected: no listener went away
            first = _connect_lines(caplog, logging.WARNING)
            assert len(first) == 1
            assert "attempt 5:" in first[0] and "since the last warning" not in first[0]
            assert "--kv-events-config" in first[0]
            clock.advance(subscriber.CONNECT_WARN_EVERY_S)
            await eventually(lambda: len(_connect_lines(caplog, logging.WARNING)) == 2)
    said = _connect_lines(caplog, logging.WARNING)[1]
    attempt, failures = re.search(r"attempt (\d+):.*; (\d+) failed since", said).groups()  # type: ignore[union-attr]
    assert int(failures) == int(attempt) - 5  # every failure since the first, in one line


async def test_a_drop_whose_reconnects_are_refused_counts_the_listener_gone_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher's process went away with its connection (its port refuses): the sign of
    an engine restarted faster than a health check can fail, counted once per drop however
    many reconnects are refused, and not again once the new publisher answers."""
    monkeypatch.setattr(subscriber, "CONNECT_BACKOFF_FIRST_S", 0.001)
    monkeypatch.setattr(subscriber, "CONNECT_BACKOFF_MAX_S", 0.002)
    caplog.set_level(logging.DEBUG, logger="router.subscriber")
    async with bound(zmq.PUB) as (pub, url), subscribed(RankEndpoint(RANK, url)) as h:
        await h.gate(pub_probe(pub, itertools.count()))
        pub.close(linger=0)  # the listener and the connection go together, as at a SIGKILL
        await eventually(lambda: len(_connect_lines(caplog, logging.DEBUG)) >= 5)
        assert (h.stats.disconnects, h.stats.listener_gone) == (1, 1)
        async with bound(zmq.PUB, url) as (restarted, _):
            await h.gate(pub_probe(restarted, itertools.count()))
        assert (h.stats.disconnects, h.stats.listener_gone, h.stats.subscriptions) == (1, 1, 2)


async def test_a_connection_without_a_zmtp_handshake_is_not_logged_as_subscribed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.subscriber")
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, silent
    async with server:
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with subscribed(RankEndpoint(RANK, url), handshake_timeout_s=0.05) as h:
            await eventually(lambda: h.stats.disconnects >= 1)  # the handshake's deadline
    assert not [r for r in caplog.records if "subscribed to" in r.getMessage()]


async def test_end_seq_before_any_batch_is_logged_without_a_made_up_seq(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank grafted from a snapshot, or registered again, sees no batch before its engine
    stops: its END_SEQ line must not say "after seq None"."""
    caplog.set_level(logging.INFO, logger="router.subscriber")
    async with bound(zmq.XPUB) as (pub, url), subscribed(RankEndpoint(RANK, url)) as h:
        async with asyncio.timeout(WITHIN_S):
            assert await pub.recv() == b"\x01"  # the subscription reached the publisher
        await pub.send_multipart([b"", seq_b(-1), b""])
        await h.wait_for(lambda: bool(h.items))
        assert shape(h.items) == [("reset",)]
    said = [r.getMessage() for r in caplog.records if "END_SEQ" in r.getMessage()]
    assert said == [
        f"rank {RANK}: publisher sent END_SEQ before any batch reached this subscriber "
        "(engine stopping); its blocks are forgotten until it publishes again"
    ]
