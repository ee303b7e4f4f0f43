"""One engine rank's KV-event stream: a ZMQ SUB socket turned into ordered items for the pump.

Rules of this file: the decisions (is a frame valid, did the publisher restart, which seqs are
missing, which replay replies to keep) live in pure code at the top, `SequenceTracker` and a
few functions, which never touch a socket and are tested as tables. `RankSubscriber` at the
bottom is a thin shell: it owns the sockets, feeds frames to that code and awaits `deliver`
for every item, in order. It never writes the index and never sees the pump's cursor.

Theory of operation
-------------------
A live message is exactly 3 frames `[topic, seq, payload]`, where `seq` is 8 bytes big-endian
(reference-bootstrap.md 2.2, reference-engine-wire.md 1.4). Anything else is dropped and
counted (`bad_frames`). `seq == -1` (eight 0xff bytes, END_SEQ) means the publisher is shutting
down: deliver `PublisherReset` and forget the last seq. Other negative seqs are bad frames.

A payload is decoded before its seq counts. One that fails `decode_batch` is dropped and
counted by reason, and the tracker never hears of it, so it surfaces as a gap when the next
batch arrives (replay can repair it only if the replayed payload decodes).

The tracker keeps `last`, the last seq delivered from this socket (never the pump's cursor).
For a decoded batch at `seq`:

    last      seq                          step               delivered before the batch
    None      any                          FIRST              nothing (joined mid-stream)
    n         n + 1                        NEXT               nothing
    n         0                            RESTART_AT_ZERO    nothing: the pump resolves a
                                                              restart at 0 itself
    n > 0     n                            DUPLICATE          nothing, and the batch is
                                                              dropped (`duplicates`)
    n         1 <= seq <= min(n - 1, J)    RESET [0, seq-1]   PublisherReset, then the new
                                                              stream's first batches as a
                                                              gap: GAP's items for [0, seq-1]
    n         J < seq < n                  JUMP               PublisherReset, jumped
    n         n + 1 < seq <= n + 1 + J     GAP [n+1, seq-1]   what replay recovers, in seq
                                                              order, with an UnrepairedGap
                                                              at every hole that remains
    n         seq > n + 1 + J              JUMP               PublisherReset, jumped
    None      after END_SEQ: 0             FIRST              nothing
    None      after END_SEQ: 1..J          RESUMED [0, seq-1] GAP's items for [0, seq-1]
    None      after END_SEQ: > J           JUMP               PublisherReset, jumped

After every step `last = seq`. END_SEQ sets `last = None`.

A restarted engine numbers its batches from 0 again, and a PUB socket drops what it sends
before the subscriber has reconnected: so a stream seen again at seq k > 0 after a restart (a
regression, or a first batch after END_SEQ) has batches [0, k-1] this subscriber never saw.
They are a gap like any other: replayed when the new engine's buffer holds them, else an
`UnrepairedGap`, which re-pulls the worker's snapshot; the pump, which has no cursor for the
new stream yet, counts them lost itself. What is counted lost is what the new stream's seq
says it sent unseen, never the old stream's position. The same seq again is taken as no
restart (a new stream would have to stand at exactly the old one's seq, every batch before it
unseen): it is the last batch sent again, which the rank holds already, dropped and counted
(`duplicates`). Read as a restart, each copy of seq 1,000,002 cleared the rank and counted
1,000,002 batches lost. A restart that does land there is the worker registry's to find
(`WorkerRegistry._look_at_drops`: its connections dropped).

J is `MAX_SEQ_JUMP` (2**20 batches). No publisher skips that many seqs and lives on: engines
buffer 10,000 batches for replay, so a router that missed 2**20 could repair none of them, and
at a busy engine's ~1,000 batches/s that is 17 minutes of a stream. A jump that long (a rogue
or corrupted publisher, e.g. seq 2**63-1) is a new stream, not 9.2e18 lost batches: the rank
is reset (cleared, a fresh cursor from this batch, the worker's snapshot asked for:
`PublisherReset(jumped=True)`), counted as `seq_jumps`, and nothing is counted as lost, so no
loss alert fires on a publisher's say-so. So is a regression, or a first batch after END_SEQ,
more than J batches into its new stream: too far back to replay.

A gap with a replay endpoint opens a DEALER to it and asks for everything from `n + 1`
(`[b"", seq as 8 bytes]`). Replies are `[b"", topic, seq, payload]` (4 frames) or, from older
engines, `[b"", seq, payload]`. Reading stops at the end marker (seq -1), at a seq >= the
current batch's, once `seq - 1` itself arrived, or when `replay_timeout_s` has passed in total.
Only strictly increasing seqs inside the missing range are kept, and only those whose payload
decodes count as recovered. The replay is tallied `repaired` (every missing batch recovered),
`incomplete` (some) or `failed` (none: no answer, timeout, socket error, or the batches were no
longer buffered). Without a replay endpoint the whole range is one `UnrepairedGap`.
`UnrepairedGap` is the pump's signal to re-pull the worker's snapshot; the pump counts lost
batches from its own cursor jump.

Backpressure: every item is handed over before the next message is read (taken at once by
`offer`, or `deliver` awaited with reading paused meanwhile), so a slow pump leaves the
publisher's messages in the kernel's socket buffers and then in the publisher's queue, which
drops past its high-water mark, where the next seq reveals the loss. Nothing is dropped
silently inside the router.

How it receives: the live stream is read without libzmq. The event loop owns the TCP
connection to the publisher and speaks ZMTP 3.0 itself (`router.zmtp`: greeting, READY,
subscription, frames), so a batch costs one loop wake-up and no libzmq I/O thread hand-off
(12-15% less CPU per stored block under eviction churn, BENCHMARKS.md). Each read's messages are
handled at once, in the transport's callback (`_LiveStream`), up to `DRAIN_BATCH` messages or
`DRAIN_BYTES` of payload per turn of the loop, so a burst of huge batches still lets
`/healthz` in between them. Items go to `offer` (the pump's form of `deliver` that never
waits: it applies a batch at once when idle) while it takes them; the first it cannot take
now, a replay, and every item behind them are awaited by the subscriber's task, in order,
with reading paused meanwhile. Without an `offer`, every item is awaited that way. The replay
DEALER is a libzmq socket (`context`): it runs only to repair a gap.

Connections: a refused or failed connect is retried with a backoff (50 ms doubling to 2 s,
`connect_backoff_s`). The fifth attempt in a row without a frame warns, and then at most one
warning every `CONNECT_WARN_EVERY_S` with the failures since (a healthy engine started without
KV events is never evicted, and its ranks would otherwise warn every 2 s for good). The
subscription is logged once the publisher's handshake completes. A connection
that ends (the publisher went away, broke the protocol, sent a message over
`max_message_bytes`, or did not finish its handshake within `HANDSHAKE_TIMEOUT_S`) is counted
(`disconnects`, a warning with the reason) once what arrived before it is handled, and the
subscriber connects and subscribes again (`socket_rebuilds`); what was published meanwhile
shows up as a gap at the next batch: replayed if the replay buffer holds it, else an
`UnrepairedGap` (counted lost, the worker's snapshot re-pulled). A drop whose next connect is
refused (ECONNREFUSED: nothing listens on the port) is counted once in `listener_gone`: the
listener went away with the connection, so the publisher's process ended (or closed its
port), which a blip of a live engine or a drop the subscriber made itself never shows. The
worker registry takes it as an engine restart its new stream may not show
(`WorkerRegistry._look_at_drops`).

Size bound: a message over `max_message_bytes` (`--kv-events-max-message-bytes`, 8 MiB by
default; a real batch, one scheduler step, is far smaller: a 100k-token prefill is ~0.5 MB) ends
the connection as soon as its frame sizes show it, before its body is buffered (the replay
DEALER has `ZMQ_MAXMSGSIZE` set to the same bound).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import zmq
import zmq.asyncio
from msgspec import Struct

from cachetree.ranks import RankId
from peer.supervise import describe, doubling_s
from router.events import EventBatch, EventDecodeError, decode_batch
from router.log_tally import LogTally
from router.zmtp import ZmtpError, ZmtpReader, greeting_and_ready, subscription, tcp_host_port

log = logging.getLogger(__name__)

END_SEQ: Final = -1
END_SEQ_BYTES: Final = b"\xff" * 8
SEQ_BYTES: Final = 8

CONNECT_BACKOFF_FIRST_S: Final = 0.05
CONNECT_BACKOFF_MAX_S: Final = 2.0
CONNECT_WARN_AFTER: Final = 5  # connections in a row without a frame before warning
CONNECT_WARN_EVERY_S: Final = 60.0  # the most often a rank's failing connects warn after that
# The most often a rank's gaps without replay warn, with the batches lost since: a publisher
# whose every batch is a gap (dropping half of them) wrote a line a batch, thousands a second.
LOSS_WARN_EVERY_S: Final = 60.0
CONNECT_TIMEOUT_S: Final = 5.0
HANDSHAKE_TIMEOUT_S: Final = 30.0  # libzmq's own ZMQ_HANDSHAKE_IVL default
MAX_SEQ_JUMP: Final = 1 << 20  # a longer forward jump is a new stream (see above)


def beyond_stream(cursor: int, seq: int) -> bool:
    """Whether a snapshot's `cursor` is more than `MAX_SEQ_JUMP` past `seq`, where this
    replica's own subscription has the stream: no true cursor is that far ahead (a worker's
    or a sibling's snapshot is taken after this replica subscribed). Installed, such a cursor
    would mark every later batch of the stream as already reflected."""
    return cursor - seq > MAX_SEQ_JUMP


DEFAULT_MAX_MESSAGE_BYTES: Final = 8 << 20
# Handled per turn of the loop at most, whichever comes first: a payload's bytes are what its
# decoding costs (~20 ns a byte), so a burst of large batches cannot hold the loop either.
DRAIN_BATCH: Final = 64  # messages
DRAIN_BYTES: Final = 1 << 20

ReplayOutcome = Literal["repaired", "incomplete", "failed"]


# --- items handed to the pump ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    rank: RankId
    endpoint: str  # "tcp://host:port"
    topic: bytes = b""
    replay_endpoint: str | None = None


# LiveBatch and LiveFrame are msgspec Structs rather than dataclasses, as the events are: one
# of each is built per batch on the ingest path, and a frozen dataclass's __init__ (a setattr
# call per field) took ~0.5 us, msgspec's, built in C, ~0.07. gc=False: they hold no cycles.
class LiveBatch(Struct, frozen=True, gc=False):
    """A decoded batch, in seq order per rank (replayed batches included)."""

    rank: RankId
    seq: int
    batch: EventBatch


@dataclass(frozen=True, slots=True)
class PublisherReset:
    """END_SEQ, or seq regressed to a non-zero value: the engine restarted. `jumped`: a seq
    jump past `MAX_SEQ_JUMP`, a new stream whose start was never seen: the pump asks for the
    worker's snapshot too."""

    rank: RankId
    jumped: bool = False


@dataclass(frozen=True, slots=True)
class UnrepairedGap:
    """Batches [first, last] (inclusive) were lost and replay could not fetch them."""

    rank: RankId
    first: int
    last: int


SubscriberItem = LiveBatch | PublisherReset | UnrepairedGap
Deliver = Callable[[SubscriberItem], Awaitable[None]]
# Takes an item at once when it can (True); on False the subscriber awaits `Deliver` instead.
Offer = Callable[[SubscriberItem], bool]


@dataclass(slots=True)
class SubscriberStats:
    frames: int = 0  # multipart messages received on the SUB socket
    bad_frames: int = 0  # dropped: not 3 frames, seq not 8 bytes, negative seq other than -1
    decode_errors: Counter[str] = field(default_factory=Counter)  # live or replayed payloads
    batches: int = 0  # LiveBatch items delivered (live and replayed)
    replayed: int = 0  # of which recovered through replay
    resets: int = 0  # PublisherReset items delivered
    gaps: int = 0  # forward seq jumps seen, repaired or not
    replay: Counter[str] = field(default_factory=Counter)  # repaired / incomplete / failed
    lost_batches: int = 0  # batches reported in UnrepairedGap items
    socket_rebuilds: int = 0  # SUB sockets rebuilt after repeated recv errors
    seq_jumps: int = 0  # forward jumps past MAX_SEQ_JUMP, delivered as PublisherReset
    duplicates: int = 0  # batches at the last seq again (not 0), dropped
    disconnects: int = 0  # publisher connections dropped (then the socket is rebuilt)
    # Drops whose next connect was refused: nothing listened on the port, so the publisher's
    # process (or its port) went away with the connection, never a blip of a live engine.
    listener_gone: int = 0
    subscriptions: int = 0  # subscriptions sent, each once the publisher's handshake completed


# --- frames ---------------------------------------------------------------------------------


# A frame: bytes, or anything with the buffer protocol (a received zmq.Frame) and a length.
Buffer = bytes | bytearray | memoryview | zmq.Frame


class FrameError(ValueError):
    """A live message that is not `[topic, 8-byte seq, payload]`; `reason` says what is off."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LiveFrame(Struct, frozen=True, gc=False):
    topic: bytes
    seq: int  # END_SEQ (-1) is the end marker
    payload: bytes


def parse_seq(raw: Buffer) -> int:
    """An 8-byte big-endian signed seq; raises `FrameError` on any other length."""
    if len(raw) != SEQ_BYTES:
        raise FrameError(f"seq frame is {len(raw)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(raw, "big", signed=True)


def parse_live_frames(frames: Sequence[Buffer]) -> LiveFrame:
    """Validate one live message; raises `FrameError` for anything but a well-formed one."""
    if len(frames) != 3:
        raise FrameError(f"{len(frames)} frames, not 3")
    topic, raw_seq, payload = frames
    seq = parse_seq(raw_seq)
    if seq < 0 and seq != END_SEQ:
        raise FrameError(f"negative seq {seq}")
    return LiveFrame(bytes(topic), seq, bytes(payload))


# --- sequencing -----------------------------------------------------------------------------


class Step(enum.Enum):
    FIRST = "first"  # no last seq: the subscriber joined mid-stream; the pump decides
    NEXT = "next"  # last + 1
    RESTART_AT_ZERO = "restart_at_zero"  # 0 after a last: left for the pump to resolve
    DUPLICATE = "duplicate"  # seq == last > 0: the last batch again, dropped
    RESET = "reset"  # 1 <= seq < last: PublisherReset, the new stream's [0, seq-1], the batch
    GAP = "gap"  # seq > last + 1: batches [missing_first, missing_last] were not seen
    JUMP = "jump"  # a new stream begun unseen: PublisherReset(jumped), then the batch
    RESUMED = "resumed"  # the first batch after END_SEQ, at seq > 0: [0, seq-1] first


@dataclass(frozen=True, slots=True)
class Verdict:
    step: Step
    missing_first: int = 0  # GAP, RESET and RESUMED only
    missing_last: int = -1  # inclusive

    @property
    def missing(self) -> int:
        return self.missing_last - self.missing_first + 1


# The verdicts without a range, built once (one per batch otherwise).
_FIRST: Final = Verdict(Step.FIRST)
_NEXT: Final = Verdict(Step.NEXT)
_RESTART_AT_ZERO: Final = Verdict(Step.RESTART_AT_ZERO)
_DUPLICATE: Final = Verdict(Step.DUPLICATE)
_JUMP: Final = Verdict(Step.JUMP)


class SequenceTracker:
    """The per-socket sequencing state: the last seq seen on this socket, nothing else.

    `advance` is called only for batches that decoded and will be delivered, so a batch that
    failed to decode shows up as part of the next gap.
    """

    __slots__ = ("ended", "last")

    def __init__(self) -> None:
        self.last: int | None = None
        self.ended = False  # END_SEQ came, and no batch since

    def advance(self, seq: int) -> Verdict:
        """Classify a decoded batch at `seq` (>= 0) and make it the last seq seen."""
        if seq < 0:
            raise ValueError(f"seq {seq} is not a batch seq")
        last, self.last = self.last, seq
        if last is None:
            ended, self.ended = self.ended, False
            if not ended or seq == 0:
                return _FIRST
            return Verdict(Step.RESUMED, 0, seq - 1) if seq <= MAX_SEQ_JUMP else _JUMP
        if seq == last + 1:
            return _NEXT
        if seq == 0:
            return _RESTART_AT_ZERO
        if seq == last:
            return _DUPLICATE
        if seq < last:
            return Verdict(Step.RESET, 0, seq - 1) if seq <= MAX_SEQ_JUMP else _JUMP
        if seq - last - 1 > MAX_SEQ_JUMP:
            return _JUMP
        return Verdict(Step.GAP, last + 1, seq - 1)

    def end(self) -> None:
        """END_SEQ: the publisher is gone; its next incarnation starts a stream at 0."""
        self.last = None
        self.ended = True


# --- replay ---------------------------------------------------------------------------------


class ReplayCollector:
    """Filters the replies to one replay request for the missing range [first, stop).

    Keeps strictly increasing seqs inside the range; `done` turns true at the end marker, at a
    seq >= `stop`, or once `stop - 1` was kept. Malformed replies are ignored and counted.
    """

    __slots__ = ("done", "first", "ignored", "kept", "stop", "topic")

    def __init__(self, first: int, stop: int, topic: bytes = b"") -> None:
        if not 0 <= first < stop:
            raise ValueError(f"empty replay range [{first}, {stop})")
        self.first = first
        self.stop = stop
        self.topic = topic  # the SUB's prefix: a 4-frame reply on another topic is not ours
        self.kept: list[tuple[int, bytes]] = []
        self.ignored = 0
        self.done = False

    def feed(self, frames: Sequence[bytes]) -> None:
        if self.done:
            return
        if len(frames) == 4 and frames[0] == b"":
            topic, raw_seq, payload = frames[1], frames[2], frames[3]
        elif len(frames) == 3 and frames[0] == b"":
            topic, raw_seq, payload = None, frames[1], frames[2]
        else:
            self.ignored += 1
            return
        try:
            seq = parse_seq(raw_seq)
        except FrameError:
            self.ignored += 1
            return
        if seq == END_SEQ or seq >= self.stop:
            self.done = True
            return
        last_kept = self.kept[-1][0] if self.kept else self.first - 1
        if seq <= last_kept or (topic is not None and not bytes(topic).startswith(self.topic)):
            self.ignored += 1
            return
        self.kept.append((seq, bytes(payload)))
        if seq == self.stop - 1:
            self.done = True


def replay_request(first: int) -> list[bytes]:
    """What a DEALER sends to a replay ROUTER to get every buffered batch from `first`."""
    return [b"", first.to_bytes(SEQ_BYTES, "big")]


def fill_gap(
    rank: RankId, first: int, stop: int, recovered: Sequence[tuple[int, EventBatch]]
) -> list[LiveBatch | UnrepairedGap]:
    """The items for the missing range [first, stop), in seq order.

    `recovered` holds strictly increasing seqs inside the range. Every hole between them
    becomes one `UnrepairedGap`, placed where it is in the stream.
    """
    items: list[LiveBatch | UnrepairedGap] = []
    expected = first
    for seq, batch in recovered:
        if not expected <= seq < stop:
            raise ValueError(f"recovered seq {seq} is outside [{expected}, {stop})")
        if seq > expected:
            items.append(UnrepairedGap(rank, expected, seq - 1))
        items.append(LiveBatch(rank, seq, batch))
        expected = seq + 1
    if expected < stop:
        items.append(UnrepairedGap(rank, expected, stop - 1))
    return items


def replay_outcome(missing: int, recovered: int) -> ReplayOutcome:
    if recovered >= missing:
        return "repaired"
    return "incomplete" if recovered else "failed"


def connect_backoff_s(setups: int) -> float:
    """The wait before socket setup number `setups + 1`, after `setups` in a row (>= 1)."""
    return doubling_s(CONNECT_BACKOFF_FIRST_S, CONNECT_BACKOFF_MAX_S, setups)


def _seqs(first: int, last: int) -> str:
    return f"seq {first}" if first == last else f"seq {first}..{last}"


def _often(count: int) -> bool:
    """Log the first few of a repeating problem, then every thousandth."""
    return count <= 3 or count % 1000 == 0


# --- the socket shell -----------------------------------------------------------------------


class RankSubscriber:
    """Subscribes to one rank's publisher and delivers its items in order until cancelled."""

    def __init__(
        self,
        endpoint: RankEndpoint,
        deliver: Deliver,
        *,
        context: zmq.asyncio.Context,
        replay_timeout_s: float = 2.0,
        stats: SubscriberStats | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        offer: Offer | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        if not handshake_timeout_s > 0:
            raise ValueError("handshake_timeout_s must be > 0")
        self._handshake_timeout_s = handshake_timeout_s
        self.endpoint = endpoint
        self.rank = endpoint.rank
        self.stats = stats if stats is not None else SubscriberStats()
        self.tracker = SequenceTracker()
        self._deliver = deliver
        self._offer = offer
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._clock = clock
        self._max_message_bytes = max_message_bytes
        self._setups = 0  # socket setups since the last frame received
        self._dropped_unanswered = False  # a connection dropped, and no connect answered since
        self._connect_failures = LogTally(CONNECT_WARN_EVERY_S)  # those past CONNECT_WARN_AFTER
        self._unreplayed = LogTally(LOSS_WARN_EVERY_S)  # batches lost with no replay to ask

    async def run(self) -> None:
        """Receive until cancelled; closes its connection on exit.

        An exception raised by `deliver` or `offer` is not caught: it ends `run()`. The item it
        was delivering already counts as seen, so a supervisor should start a new
        `RankSubscriber` (a fresh stream: its first batch is never a gap) rather than call
        `run()` again.
        """
        try:
            while True:
                stream = await self._connect()
                try:
                    await stream.run()
                finally:
                    stream.close()
                self.stats.socket_rebuilds += 1
        except zmq.ContextTerminated:  # the replay socket's context, at shutdown
            log.info("rank %s: ZMQ context terminated; subscriber stopped", self.rank)

    # --- connection lifecycle ---------------------------------------------------------------

    async def _connect(self) -> _LiveStream:
        """Connect to the publisher and start the ZMTP exchange, retrying with a backoff."""
        loop = asyncio.get_running_loop()
        if not self._setups:  # a frame came since the last failures: a new run of them
            self._connect_failures = LogTally(CONNECT_WARN_EVERY_S)
        while True:
            if self._setups:
                await asyncio.sleep(connect_backoff_s(self._setups))
            self._setups += 1
            try:
                host, port = tcp_host_port(self.endpoint.endpoint)
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    _, stream = await loop.create_connection(
                        functools.partial(_LiveStream, self, loop), host, port
                    )
            except (OSError, ValueError, TimeoutError) as exc:
                if self._dropped_unanswered and isinstance(exc, ConnectionRefusedError):
                    self.stats.listener_gone += 1
                    self._dropped_unanswered = False
                self._connect_failed(describe(exc))  # a TimeoutError's str() is empty
                continue
            self._dropped_unanswered = False
            return stream

    def _connect_failed(self, why: str) -> None:
        said = 0
        if self._setups >= CONNECT_WARN_AFTER:
            said = self._connect_failures.count(self._clock())
        if not said:
            log.debug(
                "rank %s: cannot subscribe to %s (attempt %d: %s)",
                self.rank,
                self.endpoint.endpoint,
                self._setups,
                why,
            )
            return
        log.warning(
            "rank %s: cannot subscribe to %s (attempt %d: %s%s); retrying every %g s at most, "
            "warning again in %g s. Is the engine publishing KV events on that port? vLLM and "
            "SGLang need --kv-events-config (see README); check the worker's kv_events "
            "endpoint and --kv-events-port-base.",
            self.rank,
            self.endpoint.endpoint,
            self._setups,
            why,
            f"; {said} failed since the last warning" if said > 1 else "",
            CONNECT_BACKOFF_MAX_S,
            CONNECT_WARN_EVERY_S,
        )

    def _subscribed(self) -> None:
        self.stats.subscriptions += 1
        log.info(
            "rank %s: subscribed to %s (topic %r, replay %s)",
            self.rank,
            self.endpoint.endpoint,
            self.endpoint.topic,
            self.endpoint.replay_endpoint or "off",
        )

    def _dropped(self, why: str) -> None:
        """The connection to the publisher ended: counted, and a warning that says why."""
        self.stats.disconnects += 1
        self._dropped_unanswered = True
        log.warning(
            "rank %s: the connection to %s dropped (%s); resubscribing. Batches published "
            "meanwhile surface as a gap at the next one",
            self.rank,
            self.endpoint.endpoint,
            why,
        )

    # --- one live message -------------------------------------------------------------------

    def _handle(self, frames: Sequence[Buffer]) -> Coroutine[Any, Any, None] | None:
        """Handle one live message at once. What must wait (a replay, an item the pump cannot
        take now) is returned as a coroutine, which the task awaits before the next message."""
        stats = self.stats
        stats.frames += 1
        try:
            frame = parse_live_frames(frames)
        except FrameError as exc:
            stats.bad_frames += 1
            if _often(stats.bad_frames):
                log.warning(
                    "rank %s: dropped a malformed message from %s (%s; %d so far). "
                    "Is something other than an engine KV publisher on that port?",
                    self.rank,
                    self.endpoint.endpoint,
                    exc.reason,
                    stats.bad_frames,
                )
            return None
        if frame.seq == END_SEQ:
            # No batch seen on this stream is common (the rank grafted from a snapshot, or
            # registered again): the stream's position is then the index's, not known here.
            last = self.tracker.last
            log.info(
                "rank %s: publisher sent END_SEQ %s (engine stopping); "
                "its blocks are forgotten until it publishes again",
                self.rank,
                "before any batch reached this subscriber" if last is None else f"after seq {last}",
            )
            self.tracker.end()
            return self._put(PublisherReset(self.rank))
        batch = self._decode(frame.seq, frame.payload, replayed=False)
        if batch is None:
            return None
        previous = self.tracker.last
        verdict = self.tracker.advance(frame.seq)
        step = verdict.step
        live = LiveBatch(self.rank, frame.seq, batch)
        if step is Step.NEXT:
            return self._put(live)
        if step is Step.DUPLICATE:
            self.stats.duplicates += 1
            if _often(self.stats.duplicates):
                log.warning(
                    "rank %s: seq %d came again, the last batch sent again (no restart: a new "
                    "engine numbers from 0 on a new connection); dropped (%d such so far). If "
                    "it repeats, check what publishes on %s",
                    self.rank,
                    frame.seq,
                    self.stats.duplicates,
                    self.endpoint.endpoint,
                )
            return None
        if step is Step.FIRST:
            log.info("rank %s: first batch seen is seq %d", self.rank, frame.seq)
        elif step is Step.RESTART_AT_ZERO:
            log.info("rank %s: seq restarted at 0 (engine restarted without END_SEQ)", self.rank)
        elif step is Step.RESET:
            log.warning(
                "rank %s: seq went back to %d (engine restarted); resetting the rank's index "
                "and asking for the new stream's batches 0..%d",
                self.rank,
                frame.seq,
                frame.seq - 1,
            )
            return self._reset_then_fill(verdict.missing_first, live)
        elif step is Step.RESUMED:
            log.info(
                "rank %s: first batch after END_SEQ is seq %d; asking for its stream's batches "
                "0..%d",
                self.rank,
                frame.seq,
                frame.seq - 1,
            )
            return self._fill_then(verdict.missing_first, live)
        elif step is Step.GAP:
            return self._fill_then(verdict.missing_first, live)
        elif step is Step.JUMP:
            self.stats.seq_jumps += 1
            if _often(self.stats.seq_jumps):
                log.warning(
                    "rank %s: seq went from %s to %d, a stream more than %d batches from where "
                    "this one was or began: a new stream, not a loss; resetting the rank's "
                    "index and asking for the worker's snapshot (%d such jumps so far). If it "
                    "repeats, check what publishes on %s",
                    self.rank,
                    previous,
                    frame.seq,
                    MAX_SEQ_JUMP,
                    self.stats.seq_jumps,
                    self.endpoint.endpoint,
                )
            return self._put(PublisherReset(self.rank, jumped=True), live)
        return self._put(live)

    def _decode(self, seq: int, payload: Buffer, *, replayed: bool) -> EventBatch | None:
        try:
            return decode_batch(payload, fold_removals=True)
        except EventDecodeError as exc:
            self.stats.decode_errors[exc.reason] += 1
            if _often(self.stats.decode_errors.total()):
                log.warning(
                    "rank %s: dropped %s batch seq %d that does not decode (%s); "
                    "it will count as lost unless replay returns a good copy",
                    self.rank,
                    "replayed" if replayed else "live",
                    seq,
                    exc,
                )
            return None

    # --- handing items over -----------------------------------------------------------------

    def _count(self, item: SubscriberItem) -> None:
        stats = self.stats
        kind = type(item)
        if kind is LiveBatch:
            stats.batches += 1
        elif kind is PublisherReset:
            stats.resets += 1
        else:
            stats.lost_batches += item.last - item.first + 1  # type: ignore[union-attr]

    def _put(self, *items: SubscriberItem) -> Coroutine[Any, Any, None] | None:
        """Hand items over in order: offered while the taker takes them at once, the rest
        (from the first it cannot take now) in a coroutine that awaits `deliver`."""
        offer = self._offer
        for i, item in enumerate(items):
            self._count(item)
            if offer is None or not offer(item):
                return self._deliver_from(items, i)
        return None

    async def _deliver_from(self, items: Sequence[SubscriberItem], first: int) -> None:
        await self._deliver(items[first])  # counted by `_put`
        for item in items[first + 1 :]:
            await self._emit(item)

    async def _emit(self, item: SubscriberItem) -> None:
        self._count(item)
        await self._deliver(item)

    # --- gaps -------------------------------------------------------------------------------

    async def _reset_then_fill(self, first: int, live: LiveBatch) -> None:
        """A restarted publisher: the reset, its new stream's batches [first, live.seq) as a
        gap, then `live`."""
        await self._emit(PublisherReset(self.rank))
        await self._fill_then(first, live)

    async def _fill_then(self, first: int, live: LiveBatch) -> None:
        """The missing range [first, live.seq) as `_fill` has it, then the batch itself."""
        await self._fill(first, live.seq)
        await self._emit(live)

    async def _fill(self, first: int, stop: int) -> None:
        """Deliver what can be had of the missing range [first, stop), holes included."""
        self.stats.gaps += 1
        missing = stop - first
        replay_endpoint = self.endpoint.replay_endpoint
        if replay_endpoint is None:
            if said := self._unreplayed.count(self._clock(), missing):
                # What the index does about it (a snapshot pulled or not) is the pump's to say.
                log.warning(
                    "rank %s: %d batch(es) lost since the last such warning (the latest %s), "
                    "replay unavailable: give the engine a replay endpoint to recover them",
                    self.rank,
                    said,
                    _seqs(first, stop - 1),
                )
            await self._emit(UnrepairedGap(self.rank, first, stop - 1))
            return
        started = self._clock()
        kept, problem = await self._fetch(replay_endpoint, first, stop)
        recovered = [
            (seq, batch)
            for seq, payload in kept
            if (batch := self._decode(seq, payload, replayed=True)) is not None
        ]
        outcome = replay_outcome(missing, len(recovered))
        self.stats.replay[outcome] += 1
        self.stats.replayed += len(recovered)
        items = fill_gap(self.rank, first, stop, recovered)
        elapsed_ms = (self._clock() - started) * 1000
        if outcome == "repaired":
            log.info(
                "rank %s: %d batch(es) missed (%s), all recovered by replay in %.1f ms",
                self.rank,
                missing,
                _seqs(first, stop - 1),
                elapsed_ms,
            )
        else:
            holes = [i for i in items if type(i) is UnrepairedGap]
            log.warning(
                "rank %s: %d batch(es) missed (%s); replay from %s %s (%s) and recovered %d; "
                "lost %s. Its index may miss blocks until the worker's snapshot is re-pulled",
                self.rank,
                missing,
                _seqs(first, stop - 1),
                replay_endpoint,
                outcome,
                problem or "not buffered or did not decode",
                len(recovered),
                ", ".join(_seqs(h.first, h.last) for h in holes),
            )
        for item in items:
            await self._emit(item)

    async def _fetch(
        self, replay_endpoint: str, first: int, stop: int
    ) -> tuple[list[tuple[int, bytes]], str | None]:
        """Ask the replay ROUTER for [first, stop). Returns what was kept and what went wrong."""
        collector = ReplayCollector(first, stop, self.endpoint.topic)
        deadline = self._clock() + self._replay_timeout_s
        problem: str | None = None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            sock.setsockopt(zmq.IPV6, int("[" in replay_endpoint))
            sock.connect(replay_endpoint)
            await sock.send_multipart(replay_request(first), flags=zmq.NOBLOCK)
            while not collector.done:
                remaining_ms = int((deadline - self._clock()) * 1000)
                if remaining_ms <= 0 or not await sock.poll(remaining_ms, zmq.POLLIN):
                    problem = f"timed out after {self._replay_timeout_s:g} s"
                    break
                collector.feed(await sock.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:
            problem = f"socket error: {exc}"
        finally:
            sock.close(linger=0)
        if collector.ignored:
            log.warning(
                "rank %s: ignored %d replay repl(ies) from %s (malformed, out of range or "
                "out of order)",
                self.rank,
                collector.ignored,
                replay_endpoint,
            )
        return collector.kept, problem


# --- receiving: one publisher connection --------------------------------------------------


class _LiveStream(asyncio.Protocol):
    """One TCP connection to a rank's publisher, spoken to in ZMTP (`router.zmtp`).

    Each read's messages are handled at once, in the callback: a busy stream costs one loop
    wake-up per burst and no task switch. Up to DRAIN_BATCH messages or DRAIN_BYTES of payload
    are handled per turn of the loop; past that, reading pauses and the rest are handled on the
    next turn, so a burst of huge batches still lets `/healthz` in between them.

    When a message's handling must wait (a replay, an item the pump cannot take now), reading
    pauses and the subscriber's task awaits it in `run`, then reads on: the messages behind it
    are handled after it, in order. While reading is paused the publisher's messages wait in
    the kernel's socket buffers, then in the publisher's queue, which drops past its high-water
    mark: the next seq reveals the loss. The task also ends the connection's life: once the
    peer closed it (what had arrived before is handled first), broke the protocol or a bound,
    did not finish its handshake within `handshake_timeout_s`, or with the exception a callback
    met (one from `offer`).
    """

    __slots__ = (
        "ending",
        "failure",
        "held",
        "loop",
        "lost",
        "paused",
        "reader",
        "sub",
        "subscribed",
        "timer",
        "transport",
        "wake",
    )  # fmt: skip

    def __init__(self, sub: RankSubscriber, loop: asyncio.AbstractEventLoop) -> None:
        self.sub = sub
        self.loop = loop
        self.reader = ZmtpReader(sub._max_message_bytes)
        self.transport: asyncio.Transport | None = None
        self.held: Coroutine[Any, Any, None] | None = None  # a message's handling, awaited
        self.lost = ""  # why the connection closed, once it did
        self.paused = False
        self.subscribed = False
        self.ending = False  # the task returns: connect again
        self.failure: Exception | None = None  # the task raises it
        self.wake: asyncio.Future[None] | None = None  # what the task waits on
        self.timer: asyncio.TimerHandle | None = None  # the handshake's deadline

    # -- the task's side -----------------------------------------------------------------------

    async def run(self) -> None:
        self.read_on()  # what arrived before the task got here
        while True:
            if self.failure is not None:
                raise self.failure
            if self.held is not None:
                await self.held
                self.held = None
                self.read_on()
                continue
            if self.ending:
                return
            self.wake = self.loop.create_future()
            await self.wake

    def close(self) -> None:
        """The connection is done with: callbacks still scheduled do nothing, held work is
        dropped."""
        self.ending = True
        if self.timer is not None:
            self.timer.cancel()
        if self.held is not None:
            self.held.close()  # never started (the task was cancelled first)
            self.held = None
        if self.transport is not None:
            self.transport.abort()

    def _signal(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _end(self, why: str) -> None:
        """End the connection (counted and logged with `why`) and let the task return."""
        if self.ending:
            return
        self.ending = True
        self.sub._dropped(why)
        if self.transport is not None:
            self.transport.abort()
        self._signal()

    # -- the transport's side ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        # The subscription waits for the peer's READY: libzmq drops a connection whose
        # first message arrives while it still reads the handshake.
        self.transport.write(greeting_and_ready())
        timeout = self.sub._handshake_timeout_s
        self.timer = self.loop.call_later(timeout, self._handshake_expired, timeout)

    def _handshake_expired(self, timeout: float) -> None:
        if not self.reader.ready:
            self._end(f"no ZMTP handshake within {timeout:g} s: is it a ZMQ publisher?")

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        self.read_on()

    def eof_received(self) -> bool:
        return False  # half-closed by the publisher: it is gone

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = "the publisher closed it" + (f": {exc}" if exc else "")
        if self.timer is not None:
            self.timer.cancel()
        # What arrived before the close is handled first (over later turns if it is a long
        # burst, after a held item if one waits); `read_on` ends the connection once it is.
        self.read_on()

    # -- reading ---------------------------------------------------------------------------------

    def read_on(self) -> None:
        if self.held is not None or self.ending or self.failure is not None:
            return
        reader, sub = self.reader, self.sub
        topic = sub.endpoint.topic
        budget = DRAIN_BYTES
        try:
            for _ in range(DRAIN_BATCH):
                frames = reader.next_message()
                if reader.replies:
                    self._answer(reader)
                if frames is None:
                    if not self.subscribed and reader.ready and not self.lost:
                        # The handshake is done: now the subscription (see connection_made).
                        self.subscribed = True
                        if self.timer is not None:
                            self.timer.cancel()
                            self.timer = None
                        self.transport.write(subscription(topic))  # type: ignore[union-attr]
                        sub._subscribed()
                    if self.lost:
                        self._end(self.lost)
                    elif self.paused:
                        self.paused = False
                        self.transport.resume_reading()  # type: ignore[union-attr]
                    return
                sub._setups = 0
                if topic and frames[0][: len(topic)] != topic:
                    # libzmq publishers filter by the subscription themselves; a SUB drops
                    # what does not match all the same, as libzmq's own would.
                    continue
                held = sub._handle(frames)
                if held is not None:
                    self.held = held
                    self._pause()
                    self._signal()
                    return
                budget -= len(frames[-1])
                if budget <= 0:
                    break
        except ZmtpError as exc:
            self._end(exc.reason)
            return
        except Exception as exc:  # an error handling a message (from `offer`): the task raises
            self.failure = exc
            self._signal()
            return
        # A long burst: the rest on the next turn of the loop, so others run meanwhile.
        self._pause()
        self.loop.call_soon(self.read_on)

    def _pause(self) -> None:
        if not self.paused and not self.lost and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _answer(self, reader: ZmtpReader) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(b"".join(reader.replies))
        reader.replies.clear()
