"""One rank's KV-event publisher: a ZMQ PUB for the live stream, a ROUTER for replay.

Behaves like vLLM's `ZmqEventPublisher` (and SGLang's, which copies it):
- live frames are `[topic, seq as 8 bytes big-endian, payload]`; seq starts at 0 for each
  publisher incarnation and grows by exactly one per batch;
- the last `buffer_steps` batches are kept; a replay request `[identity, b"", start_seq]` on the
  ROUTER gets every buffered batch with seq >= start_seq as `[identity, b"", topic, seq,
  payload]`, then the end marker `[identity, b"", b"", ff*8, b""]` (the 4-frame shape of vLLM
  0.26+ / SGLang 0.5.22+). Requests of any other shape are ignored, with a warning;
- on a clean shutdown the live stream ends with `[topic, ff*8, b""]`.

Fault injection for tests lives here too, because only the publisher knows seq numbers:
`drop_next(n)` buffers the next n batches but does not send them live (a gap the replay can
heal), `skip_seq()` burns a seq number that exists nowhere (a gap replay cannot heal), and
`restart()` starts a new incarnation (seq back to 0, empty buffer) on the same sockets.

`publish` is synchronous on purpose: the caller mutates its cache and publishes in one step,
with no await in between, so seq order always equals mutation order and a snapshot read between
two steps is exactly the state as of `last_seq`. pyzmq's asyncio socket sends at once when no
earlier send is pending (a PUB never blocks, it drops at the high-water mark), and otherwise
queues sends in FIFO order, so the wire order matches too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Final

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

END_SEQ_BYTES: Final = b"\xff" * 8  # seq -1 as 8 bytes two's complement: the end marker
DEFAULT_BUFFER_STEPS: Final = 10_000  # vLLM's buffer_steps default
_PUB_SNDHWM: Final = 100_000  # vLLM's hwm default
_CLOSE_LINGER_MS: Final = 1_000  # long enough for the END_SEQ frame to leave on shutdown


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class RankPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        host: str,
        port: int,
        replay_port: int | None,
        topic: str,
        dp_rank: int,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
    ) -> None:
        self.dp_rank = dp_rank
        self.topic = topic.encode("utf-8")
        self.endpoint = tcp_endpoint(host, port)
        self.replay_endpoint = tcp_endpoint(host, replay_port) if replay_port else None
        self._ipv6 = ":" in host
        self._ctx = ctx
        self._buffer_steps = buffer_steps
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._drops_pending = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the sockets; raises zmq.ZMQError (e.g. address in use) before serving."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, _PUB_SNDHWM)
        pub.setsockopt(zmq.IPV6, int(self._ipv6))
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        if self.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            # As vLLM 0.33: room for a whole buffer replay (two messages per batch) per peer.
            router.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
            router.setsockopt(zmq.IPV6, int(self._ipv6))
            try:
                router.bind(self.replay_endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                raise
            self._router = router
        log.info(
            "dp rank %d publishing KV events on %s (replay: %s)",
            self.dp_rank,
            self.endpoint,
            self.replay_endpoint or "off",
        )

    def start(self) -> None:
        """Start answering replay requests (needs the running event loop)."""
        if self._router is not None and self._replay_task is None:
            self._replay_task = asyncio.create_task(
                self._serve_replay(self._router), name=f"kv-replay-dp{self.dp_rank}"
            )

    async def close(self, *, send_end: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._pub is not None:
            if send_end:
                self._send([self.topic, END_SEQ_BYTES, b""])
                log.info("dp rank %d published END_SEQ after seq %d", self.dp_rank, self.last_seq)
            self._pub.close(linger=_CLOSE_LINGER_MS)
        if self._router is not None:
            self._router.close(linger=0)

    # --- the stream ---------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The last seq number used (published, dropped or skipped); -1 before any."""
        return self._next_seq - 1

    @property
    def drops_pending(self) -> int:
        return self._drops_pending

    def publish(self, payload: bytes) -> int:
        """Assign the next seq to `payload`, buffer it and send it (unless told to drop it)."""
        if self._closed or self._pub is None:
            raise RuntimeError(f"publisher for dp rank {self.dp_rank} is not running")
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        if self._drops_pending:
            self._drops_pending -= 1
            log.info(
                "dp rank %d dropped seq %d from the live stream (kept for replay)",
                self.dp_rank,
                seq,
            )
        else:
            self._send([self.topic, seq_bytes(seq), payload])
        return seq

    def drop_next(self, count: int) -> None:
        self._drops_pending += count

    def skip_seq(self, count: int = 1) -> int:
        """Burn `count` seq numbers that no batch will ever carry. Returns the new last_seq."""
        self._next_seq += count
        log.info(
            "dp rank %d skipped %d seq number(s); last_seq is now %d",
            self.dp_rank,
            count,
            self.last_seq,
        )
        return self.last_seq

    def restart(self) -> None:
        """Behave like a restarted engine: seq from 0 again, nothing to replay."""
        self._next_seq = 0
        self._buffer.clear()
        self._drops_pending = 0
        log.info(
            "dp rank %d publisher restarted: seq reset to 0, replay buffer cleared", self.dp_rank
        )

    def _send(self, frames: list[bytes]) -> None:
        assert self._pub is not None
        fut = self._pub.send_multipart(frames)
        fut.add_done_callback(self._log_send_failure)

    def _log_send_failure(self, fut: asyncio.Future[object]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.error(
                "dp rank %d failed to send a KV event frame: %s", self.dp_rank, fut.exception()
            )

    # --- replay -------------------------------------------------------------------------

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning(
                    "dp rank %d ignored a malformed replay request (%d frames)",
                    self.dp_rank,
                    len(frames),
                )
                continue
            identity, start_seq = frames[0], int.from_bytes(frames[2], "big")
            # Copy first: publishes during the awaits below must not disturb the iteration.
            entries = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            for seq, payload in entries:
                await router.send_multipart([identity, b"", self.topic, seq_bytes(seq), payload])
            await router.send_multipart([identity, b"", b"", END_SEQ_BYTES, b""])
            log.info(
                "dp rank %d replayed %d batch(es) from seq %d",
                self.dp_rank,
                len(entries),
                start_seq,
            )
