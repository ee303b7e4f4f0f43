"""Lifecycle of one fake worker process: bind the KV-event sockets, serve HTTP, shut down cleanly.

`FakeWorker` is also the in-process entry point for tests:

    async with FakeWorker(WorkerConfig(port=0, kv_port_base=p)) as worker:
        ... worker.url, worker.port, worker.ranks[0], worker.publishers[0] ...

Order matters on both ends. Start: the ZMQ sockets bind first (a taken port fails fast, before
anything answers HTTP), then HTTP. Stop: HTTP first, so no request can publish after the
stream's END_SEQ, then the publishers send END_SEQ and close with a linger long enough for it
to leave.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Final

import zmq
import zmq.asyncio
from aiohttp import web

from fake_kv_worker.app import WorkerState, build_app
from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.engine import RankEngine, Sleep
from fake_kv_worker.publisher import RankPublisher
from fake_kv_worker.zmq_close import close_context

log = logging.getLogger(__name__)

_HTTP_SHUTDOWN_TIMEOUT_S: Final = 2.0  # in-flight requests get this long on stop
# The publishers linger 1 s at most for their last frames; term gets that and room to spare.
_TERM_WITHIN_S: Final = 5.0


class FakeWorker:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """`clock` drives the startup delay, `wall_clock` stamps batches, `sleep` is the
        simulated prefill/decode time: inject them to test without waiting."""
        self.config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._ctx: zmq.asyncio.Context | None = None
        self._runner: web.AppRunner | None = None
        self.publishers: list[RankPublisher] = []
        self.ranks: list[RankEngine] = []
        self.state: WorkerState | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the worker is not started")
        host = self.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://[{shown}]:{self.port}" if ":" in shown else f"http://{shown}:{self.port}"

    async def start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        try:
            for rank in range(cfg.dp_size):
                publisher = RankPublisher(
                    self._ctx,
                    host=cfg.host,
                    port=cfg.kv_port_base + rank,
                    replay_port=cfg.replay_port_base + rank if cfg.replay_port_base else None,
                    topic=cfg.topic,
                    dp_rank=rank,
                    buffer_steps=cfg.replay_buffer_steps,
                )
                publisher.bind()
                self.publishers.append(publisher)
        except zmq.ZMQError:
            await self._close_publishers(send_end=False)
            raise
        for publisher in self.publishers:
            publisher.start()
        self.ranks = [
            RankEngine(
                rank,
                cfg,
                publisher,
                wall_clock=self._wall_clock,
                sleep=self._sleep,
            )
            for rank, publisher in enumerate(self.publishers)
        ]
        self.state = WorkerState(cfg, self.ranks, self.publishers, clock=self._clock)
        runner = web.AppRunner(
            build_app(self.state), access_log=None, shutdown_timeout=_HTTP_SHUTDOWN_TIMEOUT_S
        )
        await runner.setup()
        self._runner = runner
        sock: socket.socket | None = None
        try:
            sock = _listening_socket(cfg.host, cfg.port)
            await web.SockSite(runner, sock).start()
        except OSError:
            if sock is not None:
                sock.close()
            await self.stop(send_end=False)
            raise
        self.port = sock.getsockname()[1]
        log.info(
            "fake-kv-worker serving %s on %s (wire %s, dp_size %d, block_size %d, "
            "%d cache blocks per rank)",
            cfg.model,
            self.url,
            cfg.wire,
            cfg.dp_size,
            cfg.block_size,
            cfg.cache_blocks,
        )

    async def stop(self, *, send_end: bool = True) -> None:
        """Stop HTTP, then end every rank's stream with END_SEQ (unless `send_end` is False)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._close_publishers(send_end=send_end)

    async def _close_publishers(self, *, send_end: bool) -> None:
        for publisher in self.publishers:
            await publisher.close(send_end=send_end)
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            # Term waits out the END_SEQ's linger; bounded, as libzmq can hang it for good.
            await close_context(ctx, within_s=_TERM_WITHIN_S)

    async def __aenter__(self) -> FakeWorker:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        # Its own message names no port ("Address already in use"): which one is the question.
        raise OSError(exc.errno, f"HTTP port {host}:{port}: {exc.strerror}") from exc
    return sock
