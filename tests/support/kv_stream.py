"""A test's view of an engine's KV-event stream: a SUB tap on one rank, and a replay client.

Slow joiners: a SUB that connects to a bound PUB misses whatever is published before its
subscription reaches the publisher, and nothing tells the SUB when that happened. `KvTap.gate`
therefore publishes probe batches (through a callable, e.g. the fake worker's
`/control/store`) until one arrives, then drains up to the last probe's seq. Only after the
gate may a test assert on what the stream carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

import msgspec
import zmq
import zmq.asyncio

END_SEQ_BYTES: Final = b"\xff" * 8


@dataclass(frozen=True, slots=True)
class KvFrame:
    topic: bytes
    seq: int  # -1 is the end marker
    payload: bytes

    @property
    def is_end(self) -> bool:
        return self.seq == -1

    def batch(self) -> list[Any]:
        """The payload decoded generically: `[ts, [events...], dp_rank]`."""
        return msgspec.msgpack.decode(self.payload)


def _frame(topic: bytes, seq: bytes, payload: bytes) -> KvFrame:
    return KvFrame(topic, int.from_bytes(seq, "big", signed=True), payload)


class KvTap:
    """A SUB socket connected to one rank's PUB endpoint."""

    def __init__(self, endpoint: str, *, topic: bytes = b"") -> None:
        self.endpoint = endpoint
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(endpoint)

    async def recv(self, within_s: float = 5.0) -> KvFrame:
        frames = await asyncio.wait_for(self._sock.recv_multipart(), within_s)
        if len(frames) != 3:
            raise AssertionError(f"expected 3 frames, got {len(frames)}: {frames!r}")
        return _frame(*frames)

    async def recv_through(self, seq: int, within_s: float = 5.0) -> list[KvFrame]:
        """Receive frames until one carries `seq` (inclusive)."""
        out: list[KvFrame] = []
        async with asyncio.timeout(within_s):
            while not out or out[-1].seq != seq:
                out.append(await self.recv(within_s))
        return out

    async def gate(
        self,
        probe: Callable[[], Awaitable[int]],
        *,
        within_s: float = 10.0,
        attempt_s: float = 0.1,
    ) -> int:
        """Probe until the stream is live; returns the last probe's seq (all drained)."""
        async with asyncio.timeout(within_s):
            while True:
                last = await probe()
                try:
                    frame = await self.recv(attempt_s)
                except TimeoutError:
                    continue  # the subscription had not propagated yet: probe again
                # Frames arrive in order, so everything up to `last` follows promptly.
                while frame.seq != last:
                    frame = await self.recv(within_s)
                return last

    def close(self) -> None:
        self._sock.close(linger=0)

    async def __aenter__(self) -> KvTap:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class ReplayResult:
    batches: list[KvFrame]
    end_marker: list[bytes]  # as received after the identity: [b"", topic?, ff*8, b""]

    @property
    def seqs(self) -> list[int]:
        return [b.seq for b in self.batches]


async def replay(endpoint: str, start_seq: int, *, within_s: float = 5.0) -> ReplayResult:
    """Ask a replay ROUTER for every batch from `start_seq`, over a DEALER, as routers do."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[KvFrame] = []
        async with asyncio.timeout(within_s):
            while True:
                frames = await sock.recv_multipart()
                # 4 frames since vLLM 0.26 / SGLang 0.5.22: [b"", topic, seq, payload].
                if frames[-2] == END_SEQ_BYTES and frames[-1] == b"":
                    return ReplayResult(batches, frames)
                if len(frames) != 4 or frames[0] != b"":
                    raise AssertionError(f"unexpected replay frames: {frames!r}")
                batches.append(_frame(frames[1], frames[2], frames[3]))
    finally:
        sock.close(linger=0)
