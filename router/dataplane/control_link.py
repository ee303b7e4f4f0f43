"""The hand-off of non-data-plane paths to the aiohttp control app, in process, on one port.

Users keep one port: the data-plane server parses every request, answers the generation
routes itself, and sends every other one to the control app (`router.control`) over a link
made of two in-memory transports: aiohttp's own `RequestHandler` protocol on one end, the
data plane's `UpstreamConnection` on the other. To aiohttp the link is a client connection
(with the real client's peer and socket names); to the data plane it is one more upstream,
so a control answer is parsed and relayed by the very code that relays a worker's (framing
for HTTP/1.0 clients, HEAD, pipelining order, backpressure, a client leaving mid-answer).

Why not hand the client's transport to aiohttp: a client keeps one keep-alive connection for
everything (aiohttp's and httpx's pools do), so the connection that asked for `/workers`
will carry the next completion, and aiohttp cannot give a connection back. Why not a
loopback socket to an internal aiohttp listener: two more file descriptors per client
connection and a syscall per write, when the fd budget is what issue 13 starved. The link
costs aiohttp's own parse of a request the data plane re-serialized, which only control
traffic (health probes, scrapes, the peer and admin APIs) pays.

A link is made at a connection's first control request and closed with the connection, so
aiohttp's request state (keep-alive, `handler_cancellation`: a client leaving cancels the
handler) follows the client's. Data crossing the link is delivered with `call_soon`, never
inside the writer's call, so neither side's parser is re-entered; each end's inbox is its
peer's write buffer, with the usual high- and low-water marks.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from aiohttp import web

from router.dataplane.upstream import UpstreamConnection

_HIGH_WATER: Final = 256 * 1024
_LOW_WATER: Final = 64 * 1024


class PipeTransport(asyncio.Transport):
    """One end of an in-memory, in-order, flow-controlled byte stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop, extra: dict[str, Any]) -> None:
        super().__init__(extra)
        self._loop = loop
        self._protocol: asyncio.Protocol | None = None
        self.peer: PipeTransport | None = None
        self._inbox = bytearray()  # written by the peer, not yet delivered
        self._reading = True
        self._scheduled = False
        self._peer_writer_paused = False  # the peer's protocol was told to pause writing
        self._closing = False
        self._lost = False
        self._eof = False  # the peer closed: deliver what is left, then report the loss
        self._high = _HIGH_WATER
        self._low = _LOW_WATER

    # -- asyncio.Transport -----------------------------------------------------------------

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self._protocol is not None
        return self._protocol

    def is_closing(self) -> bool:
        return self._closing

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        self._schedule()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        peer = self.peer
        if self._closing or peer is None or peer._closing:
            return
        peer._receive(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return len(self.peer._inbox) if self.peer is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        peer = self.peer
        return (peer._low, peer._high) if peer is not None else (_LOW_WATER, _HIGH_WATER)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self.peer is not None:
            self.peer._high = _HIGH_WATER if high is None else high
            self.peer._low = self.peer._high // 4 if low is None else low

    def close(self) -> None:
        """Close after the peer received what was written; both ends report the loss."""
        if self._closing:
            return
        self._closing = True
        self._inbox.clear()
        peer = self.peer
        if peer is not None and not peer._closing:
            peer._eof = True
            peer._schedule(force=True)
        self._loop.call_soon(self._report_lost)

    def abort(self) -> None:
        if self.peer is not None:
            self.peer._inbox.clear()
        self.close()

    # -- inside ----------------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        self._inbox += data
        self._schedule()
        if not self._peer_writer_paused and len(self._inbox) > self._high:
            self._peer_writer_paused = True
            peer = self.peer
            if peer is not None and peer._protocol is not None:
                peer._protocol.pause_writing()

    def _schedule(self, force: bool = False) -> None:
        if not self._scheduled and (self._reading or force):
            self._scheduled = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False
        protocol = self._protocol
        if protocol is None or self._lost:
            return
        if self._inbox and (self._reading or self._eof):
            data = bytes(self._inbox)
            self._inbox.clear()
            protocol.data_received(data)
        if self._peer_writer_paused and len(self._inbox) <= self._low:
            self._peer_writer_paused = False
            peer = self.peer
            if peer is not None and peer._protocol is not None and not peer._closing:
                peer._protocol.resume_writing()
        if self._eof and not self._inbox:
            self._closing = True
            self._report_lost()

    def _report_lost(self) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        if self._protocol is not None:
            self._protocol.connection_lost(None)


def pipe_pair(
    loop: asyncio.AbstractEventLoop, extra: dict[str, Any]
) -> tuple[PipeTransport, PipeTransport]:
    a, b = PipeTransport(loop, extra), PipeTransport(loop, extra)
    a.peer, b.peer = b, a
    return a, b


def open_control_link(
    loop: asyncio.AbstractEventLoop,
    control: web.Server,
    extra: dict[str, Any],
    idle_timeout_s: float,
) -> UpstreamConnection:
    """A fresh link to the control app; the returned connection speaks to it."""
    server_end, client_end = pipe_pair(loop, extra)
    handler = control()
    server_end.set_protocol(handler)
    conn = UpstreamConnection(loop, None, idle_timeout_s)
    client_end.set_protocol(conn)
    handler.connection_made(server_end)
    conn.connection_made(client_end)
    return conn
