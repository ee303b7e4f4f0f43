"""An ingest process: the replica's KV-event subscribers for some ranks, outside its event loop.

    python -m router.ingest_child --control ipc:///.../ingest-0-1.sock [--max-message-bytes N]

Started and supervised by `router.ingest_pool.IngestPool`, never by hand. It connects a PAIR
socket to `--control` (an ipc path in a directory only the replica's user can enter) and
from then on takes `Subscribe` / `Unsubscribe` commands from it and sends back, in order,
every item its `RankSubscriber`s deliver, packed by `router.ingest_wire.pack` (decoded,
keyed), and each rank's subscriber counters when they change. The subscribers are the
replica's own class with its own rules (framing, seq, replay, reset, size bound); only where
they run differs. Sending awaits while the replica's pump is behind (the PAIR's high-water
mark), so backpressure reaches the engines' publishers exactly as in one process.

Every `--heartbeat-s` it sends a `Beat`, events or not: the replica takes a process it has
heard nothing from for a while as hung, and kills it (`router.ingest_pool.hung`).

It runs until it is terminated or its parent dies (PR_SET_PDEATHSIG on Linux, and a check of
the parent pid every second as well).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

import zmq
import zmq.asyncio

from cachetree.ranks import RankId
from router.ingest_wire import (
    BEAT,
    PAIR_HWM,
    KeyMirror,
    Subscribe,
    Unsubscribe,
    pack,
    pack_hello,
    pack_stats,
    stats_values,
    unpack_command,
)
from router.subscriber import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RankEndpoint,
    RankSubscriber,
    SubscriberItem,
    SubscriberStats,
)

log = logging.getLogger("router.ingest_child")

STATS_INTERVAL_S = 1.0


class IngestChild:
    def __init__(
        self,
        control: zmq.asyncio.Socket,
        context: zmq.asyncio.Context,
        heartbeat_s: float,
        **sub_kw: object,
    ):
        self._control = control
        self._ctx = context
        self._heartbeat_s = heartbeat_s
        self._sub_kw = sub_kw
        self._mirror = KeyMirror()
        self._subs: dict[RankId, tuple[asyncio.Task[None], SubscriberStats]] = {}
        self._sent: dict[RankId, dict[str, object]] = {}
        self._send_lock = asyncio.Lock()

    async def _send(self, message: bytes) -> None:
        async with self._send_lock:
            await self._control.send(message)

    async def _deliver(self, item: SubscriberItem) -> None:
        await self._send(pack(item, self._mirror))

    def _subscribe(self, cmd: Subscribe) -> None:
        rank = RankId(cmd.url, cmd.dp)
        if rank in self._subs:
            return
        stats = SubscriberStats()
        endpoint = RankEndpoint(rank, cmd.endpoint, cmd.topic, cmd.replay_endpoint)
        sub = RankSubscriber(
            endpoint,
            self._deliver,
            context=self._ctx,
            stats=stats,
            **self._sub_kw,  # type: ignore[arg-type]
        )
        if cmd.last_seq is not None:
            sub.tracker.last = cmd.last_seq  # see `Subscribe.last_seq`
        task = asyncio.create_task(sub.run(), name=f"kv-sub {rank}")
        task.add_done_callback(lambda t, r=rank: self._ended(r, t))
        self._subs[rank] = (task, stats)

    def _ended(self, rank: RankId, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("rank %s: subscriber failed: %r", rank, task.exception())

    async def _unsubscribe(self, cmd: Unsubscribe) -> None:
        rank = RankId(cmd.url, cmd.dp)
        entry = self._subs.pop(rank, None)
        self._mirror.forget(rank)
        self._sent.pop(rank, None)
        if entry is not None:
            entry[0].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await entry[0]

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            for rank, (_, stats) in list(self._subs.items()):
                values = stats_values(stats)
                if values != self._sent.get(rank):
                    self._sent[rank] = values
                    await self._send(pack_stats(rank, values))

    async def _beat(self) -> None:
        # Unconditional: one tiny message an interval costs less than noting when each batch
        # went out. Under backpressure it queues behind the batches, and the replica, which is
        # then reading or delivering them, does not measure silence (`IngestPool._read`).
        while True:
            await asyncio.sleep(self._heartbeat_s)
            await self._send(BEAT)

    async def run(self) -> None:
        reporter = asyncio.create_task(self._report(), name="ingest-stats")
        beat = asyncio.create_task(self._beat(), name="ingest-beat")
        try:
            await self._send(pack_hello(os.getpid()))
            while True:
                command = unpack_command(await self._control.recv())
                if type(command) is Subscribe:
                    self._subscribe(command)
                else:
                    await self._unsubscribe(command)  # type: ignore[arg-type]
        finally:
            reporter.cancel()
            beat.cancel()
            for task, _ in self._subs.values():
                task.cancel()


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:  # noqa: ASYNC110 - polling the only signal there is
        await asyncio.sleep(1.0)
    log.warning("the replica (pid %d) is gone; this ingest process exits", parent)
    os._exit(0)


async def main_async(args: argparse.Namespace) -> None:
    context = zmq.asyncio.Context()
    control = context.socket(zmq.PAIR)
    control.setsockopt(zmq.LINGER, 0)
    control.setsockopt(zmq.SNDHWM, PAIR_HWM)
    control.setsockopt(zmq.RCVHWM, PAIR_HWM)
    control.connect(args.control)
    watcher = asyncio.create_task(_watch_parent(args.parent))
    try:
        await IngestChild(
            control,
            context,
            args.heartbeat_s,
            max_message_bytes=args.max_message_bytes,
            replay_timeout_s=args.replay_timeout_s,
        ).run()
    finally:
        watcher.cancel()
        control.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router.ingest_child")
    parser.add_argument("--control", required=True)
    parser.add_argument("--parent", type=int, default=os.getppid())
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--replay-timeout-s", type=float, default=2.0)
    parser.add_argument("--heartbeat-s", type=float, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s %(name)s[{os.getpid()}]: %(message)s",
    )
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
