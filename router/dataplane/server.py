"""The client side: one Protocol per connection, httptools' request parser, the listening server.

`ClientConnection` parses requests with `httptools.HttpRequestParser` and answers them in
order (pipelined requests wait their turn with reading paused). Its decisions come from
`exchange` (admission, framing), `cors` (a web page's preflight, answered here, and the fields
its answers carry) and `routing` (the routing decision, run synchronously in the
parser's message-complete callback, or once the placer replica answered for a new prefix:
`router.placement.AskFirst`, cancelled if the client leaves first, or once a worker thread
encoded a long prompt: `routing.EncodeFirst`, run by `encodes.EncodeQueue`, its slot freed if
the client leaves first); `relay` moves the answer.
One `Deadline` per connection bounds, in turn, the request head, the request body and the
idle time between requests; another, made at its first `pause_writing`, checks that a client
whose writes are paused still reads (`flow.WriteStall`): one that stopped is cut, its upstream
request aborted, so that it holds no connection to a worker.

`DataPlane` holds what every connection shares: the listening sockets and their accept thread
(`door`), the limits, the routing parts, one `UpstreamPool` per worker, the control app's
aiohttp server (for `control_link`), the open connections (at most `max_connections`: one
more is answered with a 503 and closed, counted, and logged at most once a minute, but for a
scrape of the metrics, let in past it for one answer; the `--control-port` listener's are
bounded and logged apart; it answers no CORS) and the counters
behind the data plane's metrics.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain
from typing import Any, Final, Literal, cast

import httptools
from aiohttp import web

from router.dataplane.control_link import open_control_link
from router.dataplane.cors import CorsPolicy
from router.dataplane.door import Door, Probe
from router.dataplane.encodes import EncodeQueue, Job
from router.dataplane.exchange import (
    CONTINUE,
    RETRY_SOON,
    Malformed,
    Refusal,
    RequestHead,
    admit,
    body_too_large,
    control_path,
    head_without_upgrade,
    json_response,
    no_content_response,
    not_allowed,
    read_request_head,
    refusal_response,
    route_of,
    uninvited,
)
from router.dataplane.flow import PIPELINED, YIELDING, Deadline, Pending, ReadGate, WriteStall
from router.dataplane.inflight import InflightTracker
from router.dataplane.relay import ControlRelay, Relay, WorkerLookup, WorkerRelay, count_refused
from router.dataplane.routing import EncodeFirst, Routed, Router
from router.dataplane.upstream import UpstreamConnection, UpstreamPool
from router.log_tally import LogTally
from router.metrics import RouterMetrics
from router.placement import AskFirst
from router.policy import Decision

log = logging.getLogger(__name__)

_ROUTING_FAILED: Final = Refusal(
    500, "the router failed to route this request", type="server_error"
)
# A head that stops the parser as a protocol switch and cannot be served as a plain request.
_SWITCH_REFUSED: Final = Refusal(400, "malformed HTTP request: a protocol switch", close=True)
# A request not routed yet (its placer's answer, its long prompt's encode) when the drain
# ended: never sent, so safe for its client to send again elsewhere.
_DRAINED: Final = Refusal(
    503,
    "the router stopped before this request was routed: send it again",
    type="service_unavailable",
    extra=RETRY_SOON,
)

# Complete requests one connection may have waiting behind the one being answered. A
# pipelining client gains nothing past a few; the bound keeps one read's worth of tiny
# requests from queueing thousands of exchanges.
MAX_PIPELINED: Final = 32
# After refusing a request whose bytes were left unread (a body over the limit, a malformed
# head), the connection is half-closed and what the client still sends is read and dropped
# for up to this long (a lingering close, RFC 9112 9.6), so that the client reads the
# refusal: closed at once, the kernel answers the unread bytes with a reset, which destroys
# the refusal before the client reads it (a 5 MB body over the limit got ECONNRESET, not
# its 413).
LINGER_S: Final = 2.0
MAX_LINGERING_REFUSALS: Final = 64
CONTROL_MAX_CONNECTIONS: Final = 256  # on the `--control-port` listener
# Metrics scrapes admitted past `--max-connections` at once (`ClientConnection._admit_scrape`):
# a Prometheus pair, an operator's curl, and some to spare.
SCRAPE_MAX_CONNECTIONS: Final = 8
# A connection whose first bytes are one of these asks for the metrics.
_SCRAPE_LINES: Final = (b"GET /metrics ", b"GET /metrics?")
# Linux's SIOCOUTQ (TIOCOUTQ's number): the bytes a TCP socket's send queue holds that its
# peer has not acknowledged (`_unacknowledged`). None elsewhere.
_SIOCOUTQ: Final = 0x5411 if sys.platform.startswith("linux") else None
_SERVED_VERSIONS: Final = frozenset({"1.1", "1.0"})
# Routing work (decode, tokenize, keys, index, policy, the first write upstream) one turn of
# the event loop may do before the rest waits for the next turn. On a saturated loop every
# turn would otherwise route every request that arrived, and a turn of 64 routings takes
# tens of milliseconds, which every probe, stream chunk and accept then waits for.
ROUTING_SLICE_S: Final = 0.004
_LOG_EVERY_S: Final = 60.0
# What a chunk of a chunked request body costs of its bound besides its data: its framing at
# the least (a one-digit size line and the CRLF after the data, RFC 9112 7.1).
CHUNK_FRAMING: Final = 5
# Chunks of request bodies one connection's reads may parse before its reading waits a turn of
# the loop: uvloop (libuv) reads a ready socket up to 32 times a turn, and 32 reads of tiny
# chunks are ~1 M parser callbacks, which every other connection (a probe too) waited ~1 s for.
CHUNKS_PER_TURN: Final = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    """Every bound of the data plane (each one a `kvrouter serve` flag)."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_header_count: int = 100
    max_head_bytes: int = 64 * 1024
    max_connections: int = 4096
    header_timeout_s: float = 30.0  # from a request's first byte (or the connection's start)
    body_timeout_s: float = 60.0  # from the end of the head to the end of the body
    keepalive_timeout_s: float = 60.0  # an idle client connection between requests
    connect_timeout_s: float = 5.0  # to connect to a worker, or to wait for a pooled connection
    head_timeout_s: float = 300.0  # from sending a request upstream to its response head
    stream_idle_timeout_s: float = 300.0  # the longest gap between pieces of an answer
    # A client whose writes are paused and which takes none of the answer for this long.
    client_write_timeout_s: float = 120.0
    upstream_idle_expiry_s: float = 4.0  # an idle pooled connection is closed after this
    upstream_connections_per_worker: int = 256
    max_attempts: int = 3


@dataclass(slots=True)
class Bound:
    """One listener's bound on its open connections (the client port's, the control port's)."""

    members: set[ClientConnection]  # its open connections
    most: int
    limit: str  # what a refusal's log line says of it: which limit, and what to do
    refusals: LogTally = field(default_factory=lambda: LogTally(_LOG_EVERY_S))


@dataclass(slots=True)
class DataPlaneStats:
    """Read by the metrics collector at scrape time."""

    connections_refused: int = 0
    closed: Counter[str] = field(default_factory=Counter)  # client connections we closed, why
    ended: Counter[str] = field(default_factory=Counter)  # exchanges that did not end well
    safe_retries: int = 0
    upstream_connects: int = 0
    routing_deferred: int = 0  # requests that waited a loop turn for their routing slice


class DataPlane:
    def __init__(
        self,
        router: Router,
        workers: WorkerLookup,
        inflight: InflightTracker,
        metrics: RouterMetrics,
        control: web.Server,
        limits: Limits,
        *,
        expose_route_headers: bool = False,
        probes: Mapping[bytes, Probe] | None = None,
        internal_token: str | None = None,
        cors: CorsPolicy | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        # GET/HEAD on these paths is answered by the door (`door.py`) on a new connection,
        # and in the parser callback on one the loop serves: every hop of the hand-off to the
        # control app costs a loop iteration, which a probe must not wait for.
        self.probes: Mapping[bytes, Probe] = probes or {}
        self.router = router
        self.workers = workers
        self.inflight = inflight
        self.metrics = metrics
        self.control = control
        self.limits = limits
        self.expose_route_headers = expose_route_headers
        self.cors = cors  # which pages may read the browser routes' answers; None: none
        self.internal_token = internal_token  # `router.auth`'s, for `exchange.uninvited`
        self.stats = DataPlaneStats()
        self.write_stalls = LogTally(_LOG_EVERY_S)  # clients cut for not reading
        # Each worker's failed attempts, said at most once a minute (`WorkerRelay._say_failed`).
        self.failure_warnings: dict[str, LogTally] = {}
        self.connections: set[ClientConnection] = set()
        # On the `--control-port` listener, bounded apart (`CONTROL_MAX_CONNECTIONS`), so that
        # clients filling `--max-connections` do not shut peers and admins out.
        self.control_connections: set[ClientConnection] = set()
        self.client_bound = Bound(
            self.connections,
            limits.max_connections,
            "the --max-connections limit; raise it (and the file limit) or add replicas",
        )
        self.control_bound = Bound(
            self.control_connections,
            CONTROL_MAX_CONNECTIONS,
            f"the control port's fixed limit ({CONTROL_MAX_CONNECTIONS}); find what holds "
            "so many peer or admin connections open",
        )
        # Scrapes of the metrics let in past `--max-connections`, for one answer each. Never
        # refused under this bound: one past it is refused under the client port's.
        self.scrape_connections: set[ClientConnection] = set()
        self.scrape_bound = Bound(
            self.scrape_connections, SCRAPE_MAX_CONNECTIONS, self.client_bound.limit
        )
        self.pools: dict[str, UpstreamPool] = {}
        self.draining = False
        self.doors: list[Door] = []
        self._adopting: set[asyncio.Task[Any]] = set()  # handed-over connections being set up
        self._closing = False
        self.addresses: list[tuple[str, int]] = []  # where it listens
        self._lingering = 0  # refused connections closing (`refuse_connection`)
        self._waiting_to_route: deque[ClientConnection] = deque()
        self.encodes = EncodeQueue(self.loop)  # long prompts' encodes (`EncodeFirst`)
        self.asking = Pending()  # new prefixes' questions to their placer (`AskFirst`)
        self._slice_spent = 0.0  # routing time spent in this turn of the loop
        self._slice_scheduled = False

    # -- serving ---------------------------------------------------------------------------

    async def listen(
        self, host: str, port: int, *, control_only: bool = False
    ) -> list[tuple[str, int]]:
        """Start accepting on `host:port`; the bound addresses (port 0 picks one).

        The accept path is a thread (`door`) that answers health probes itself and hands
        every other connection to the loop (`_adopt`). A `control_only` listener (the
        `--control-port`) hands every path to the control app, generation routes included
        (which it does not serve), with the same limits and timeouts as the data plane's."""
        listeners = await bind(self.loop, host, port)
        addresses = [s.getsockname()[:2] for s in listeners]
        limits = self.limits
        door = Door(
            self.loop,
            listeners,
            self.probes,
            partial(self._adopt, control_only=control_only),
            lambda: not self.draining,
            limits.max_header_count,
            limits.max_head_bytes,
        )
        self.doors.append(door)
        door.start()
        if not control_only:
            self.addresses += addresses
        return addresses

    def _adopt(self, sock: socket.socket, data: bytes, idle: bool, *, control_only: bool) -> None:
        """A connection the door handed over, with the bytes it read of it: served by a
        `ClientConnection` from now on (`idle`: between requests, the door answered one)."""
        if self._closing:
            sock.close()
            return
        task = self.loop.create_task(
            self.loop.connect_accepted_socket(
                lambda: ClientConnection(self, idle, data, control_only), sock
            )
        )
        self._adopting.add(task)
        task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task[Any]) -> None:
        self._adopting.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # The client left between the door and the loop: nothing to answer.
            log.debug("a handed-over connection could not be served: %s", exc)

    def begin_drain(self) -> None:
        """Answers from now on close their connection; idle connections close now."""
        self.draining = True
        for conn in self._every_connection():
            conn.close_if_idle()

    async def close(self) -> None:
        """Stop listening and close every connection (what is still in flight is cut)."""
        self._closing = True
        for door in self.doors:
            door.close()
        for task in self._adopting:
            task.cancel()
        for conn in self._every_connection():
            conn.shut_down()
        for pool in self.pools.values():
            pool.close()
        self.encodes.close()
        if self._adopting:
            await asyncio.gather(*self._adopting, return_exceptions=True)

    def _every_connection(self) -> list[ClientConnection]:
        return [*self.connections, *self.control_connections, *self.scrape_connections]

    # -- shared parts ----------------------------------------------------------------------

    def pool_for(self, url: str) -> UpstreamPool:
        pool = self.pools.get(url)
        if pool is None:
            limits = self.limits
            pool = UpstreamPool(
                self.loop,
                url,
                cap=limits.upstream_connections_per_worker,
                connect_timeout_s=limits.connect_timeout_s,
                idle_expiry_s=limits.upstream_idle_expiry_s,
                idle_timeout_s=limits.stream_idle_timeout_s,
                on_connect=self._connected,
                free_at=self._free_at,
            )
            self.pools[url] = pool
        return pool

    def _free_at(self) -> float | None:
        """The loop's time at its doors' last heartbeat on time (None before any)."""
        return max((d.free_at for d in self.doors if d.free_at is not None), default=None)

    def _connected(self) -> None:
        self.stats.upstream_connects += 1

    @property
    def routing_backlog(self) -> int:
        """Complete requests waiting for a routing slice (not in flight yet)."""
        return len(self._waiting_to_route)

    def route_in_turn(self, conn: ClientConnection) -> None:
        """Route `conn`'s request now if this turn's slice has room, else in a later turn."""
        if self._waiting_to_route or self._slice_spent >= ROUTING_SLICE_S:
            self.stats.routing_deferred += 1
            self._waiting_to_route.append(conn)
            self._new_slice_soon()
            return
        self._route(conn)

    def _route(self, conn: ClientConnection) -> None:
        started = time.perf_counter()
        conn.route_now()
        self._slice_spent += time.perf_counter() - started
        self._new_slice_soon()

    def _new_slice_soon(self) -> None:
        if not self._slice_scheduled:
            self._slice_scheduled = True
            self.loop.call_soon(self._new_slice)

    def _new_slice(self) -> None:
        """A new turn of the loop: a fresh slice, spent first on those who waited."""
        self._slice_scheduled = False
        self._slice_spent = 0.0
        waiting = self._waiting_to_route
        if waiting:
            self._route(waiting.popleft())  # at least one a turn, whatever the slice
        while waiting and self._slice_spent < ROUTING_SLICE_S:
            self._route(waiting.popleft())
        if waiting:
            self._new_slice_soon()

    def forget_worker(self, url: str) -> None:
        """A worker left the registry: its pool goes (its connections close as their answers
        end; a request still waiting for a connection fails over), and so do its series."""
        pool = self.pools.pop(url, None)
        if pool is not None:
            _fail_over(pool.retire(), "removed")
        self.failure_warnings.pop(url, None)
        self.metrics.forget_worker(url)

    def worker_down(self, url: str) -> None:
        """Health declared a worker down: requests still waiting for its head fail over."""
        pool = self.pools.get(url)
        if pool is None:
            return
        relays = [c.sink for c in pool.waiting_for_head()]
        relays += pool.take_waiting()
        _fail_over(relays, "worker_down")
        if relays:
            log.warning(
                "worker %s declared down: %d request(s) waiting for its answer fail over",
                url,
                len(relays),
            )

    def turn_away_waiting(self) -> int:
        """The drain ended: each request still waiting for a connection to a worker (queued
        for a full pool, or connecting) was never sent, and is answered the 503 with
        `Retry-After` its wait running out would have given (`WorkerRelay.turn_away`), not cut
        with what is in flight; so is one not routed yet (`turn_away_unrouted`). How many."""
        turned = 0
        for pool in self.pools.values():
            for who in pool.take_waiting():
                if isinstance(who, WorkerRelay) and not who.done:
                    who.turn_away(
                        "the replica stopped (its drain ended) before a connection to the "
                        "worker came free"
                    )
                    turned += 1
        # Not routed yet (a placer's answer, a long prompt's encode): never sent either.
        return turned + sum(conn.turn_away_unrouted() for conn in list(self.connections))

    def refuse_connection(self, transport: asyncio.Transport, bound: Bound) -> None:
        """A new connection past its listener's `bound`: a 503, counted, logged at most once a
        `_LOG_EVERY_S` per bound, with that bound's refusals since (a tally shared by
        both listeners summed their refusals under whichever limit refused last). Its close
        lingers (`LINGER_S`, as after any refusal whose request the router left unread), so a
        client still sending a body reads the 503 rather than a reset; at most
        `MAX_LINGERING_REFUSALS` at once, so that the refusals hold a bounded number of
        descriptors past the limit."""
        transport.write(_BUSY)
        if self._lingering < MAX_LINGERING_REFUSALS and transport.can_write_eof():
            self._lingering += 1
            transport.write_eof()
            self.loop.call_later(LINGER_S, self._end_lingering, transport)
        else:
            transport.close()
        self.stats.connections_refused += 1
        if said := bound.refusals.count(self.loop.time()):
            log.warning(
                "%d connection(s) refused: %d open, %s", said, len(bound.members), bound.limit
            )

    def _end_lingering(self, transport: asyncio.Transport) -> None:
        self._lingering -= 1
        transport.close()


async def bind(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` resolves to (as `loop.create_server` binds)."""
    infos = await loop.getaddrinfo(
        host or None,
        port,
        family=socket.AF_UNSPEC,
        type=socket.SOCK_STREAM,
        flags=socket.AI_PASSIVE,
    )
    listeners: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(1024)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners


_BUSY: Final = refusal_response(
    Refusal(
        503,
        "too many connections to this replica; retry",
        type="service_unavailable",
        extra=RETRY_SOON,
    ),
    client_11=True,
    keep_alive=False,
)


def _unserved_version(version: str) -> Refusal:
    return Refusal(400, f"HTTP/{version} is not served here: send HTTP/1.1", close=True)


def _fail_over(relays: Iterable[object], why: Literal["worker_down", "removed"]) -> None:
    """Requests waiting on a worker that is gone or down: each still unanswered fails over."""
    for relay in relays:
        if isinstance(relay, WorkerRelay) and not relay.done:
            relay.worker_gone(why)


# In place of a lost connection's parser (see `ClientConnection.connection_lost`): it has no
# callbacks, and is never fed (a closed connection reads nothing).
_DETACHED: Final = httptools.HttpRequestParser(object())


class _Incoming:
    """One request as it is parsed, then while it waits for its answer."""

    __slots__ = (
        "body",
        "body_size",
        "complete",
        "continue_due",
        "head",
        "headers",
        "refusal",
        "url",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: RequestHead | None = None
        # The first piece as it came (most bodies arrive in one), then one buffer the rest is
        # appended to: a list of the pieces cost ~40 bytes a piece, so a body of 2-byte chunks
        # held ~20 times its size (32 MiB of them: ~900 MiB).
        self.body: bytes | bytearray = b""
        self.body_size = 0  # its bytes, chunk framing and trailer fields, against the limit
        self.complete = False
        self.refusal: Refusal | None = None
        self.continue_due = False  # owes the client a 100 Continue when its turn comes


class _Refused(Exception):
    """Raised from a parser callback to stop parsing with this answer."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class ClientConnection(asyncio.Protocol):
    def __init__(
        self, plane: DataPlane, idle: bool = False, data: bytes = b"", control_only: bool = False
    ) -> None:
        self.plane = plane
        self._control_only = control_only
        self._bound = plane.control_bound if control_only else plane.client_bound
        self._scrape = False  # let in past the bound for one metrics scrape (`_admit_scrape`)
        # None on the `--control-port` listener: it serves no browser route, and a preflight
        # of one answered there let a page send a POST that was the control app's 404.
        self.cors = None if control_only else plane.cors
        self._first = data  # what the door read of the connection before handing it over
        self.transport: asyncio.Transport | None = None
        self.gate: ReadGate | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._deadline = Deadline(plane.loop, self._expired)
        # What the deadline bounds: head, body, idle, or "" (answering).
        self._phase = "idle" if idle else "head"
        self._incoming: _Incoming | None = None  # being parsed
        self._queue: deque[_Incoming] = deque()  # parsed or being parsed, in order
        self._answering = False
        self._relay: Relay | None = None
        self._link: UpstreamConnection | None = None
        self._stopped = False  # no more parsing: a refusal closes the connection
        self._close_reason = "answered"  # what its last answer's close is counted as
        self._closed = False
        self._head_size = 0  # bytes of reads that fell wholly inside the head being parsed
        self._chunks = 0  # body chunks parsed since reading last waited a turn (`YIELDING`)
        self._deferred: tuple[RequestHead, bytes] | None = None  # waits for a routing slice
        self._held: list[bytes] | None = None  # writes gathered by `hold`
        self._asking: AskFirst | None = None  # a new prefix's question to its placer
        self._encoding: Job | None = None  # a long prompt's encode, off the loop
        self.turn_started = 0.0  # perf_counter when the routed request being answered got its turn
        # Over its write buffer's high-water mark: asyncio says so once, maybe as one answer ends
        # (its last write), so the next answer reads it here (`Relay.upstream_head`).
        self.write_paused = False
        self._written = 0  # bytes handed to the transport, for `_write_progress`
        self._fd = -1  # its TCP socket's, for `_unacknowledged`; -1: none
        # Made at the first pause (most connections never pause): the stall rule and its check.
        self._stall: tuple[WriteStall, Deadline] | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport = cast(asyncio.Transport, transport)
        plane = self.plane
        if len(self._bound.members) >= self._bound.most and not self._admit_scrape():
            self._closed = True
            if self._phase == "idle":
                # The door answered a probe on it, which asked to keep it: that answer was
                # the one owed, and a 503 after it would read as the next request's.
                transport.close()
            else:
                plane.refuse_connection(transport, self._bound)
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._fd = sock.fileno()
        self._bound.members.add(self)
        self.gate = ReadGate(transport)
        self._arm()
        first, self._first = self._first, b""
        if first:
            self.data_received(first)

    def _admit_scrape(self) -> bool:
        """Past `--max-connections`, a connection whose first request is a scrape of the
        metrics is let in, up to `SCRAPE_MAX_CONNECTIONS` at once, for that answer alone (it
        closes after it, and what came behind it is never read), as the door answers the
        probes past it: the refusals at the limit are seen by that scrape (the
        `KvrouterConnectionsRefused` alert), which was refused with the rest."""
        plane = self.plane
        scrape = plane.scrape_bound
        if (
            self._bound is not plane.client_bound
            or not self._first.startswith(_SCRAPE_LINES)
            or len(scrape.members) >= scrape.most
        ):
            return False
        self._bound = scrape
        self._scrape = True
        return True

    def data_received(self, data: bytes) -> None:
        if self._stopped or self._closed:
            return
        # The request whose head this read continues, if any.
        in_head = self._incoming if self._incoming and self._incoming.head is None else None
        phase = self._phase
        refusal = self._feed(data)
        if self._stopped and refusal is None:
            return  # a failure inside a callback, dealt with (`_failed`)
        if self._phase != phase and self._phase:
            # The parser callbacks move the phase without touching its deadline: one read
            # often holds a whole request (head, body, end), whose phases it sets once here.
            # Answering ("") is bounded by nothing: see `_arm`.
            self._arm()
        if refusal is not None:
            self._stop(refusal)
            return
        if self._chunks > CHUNKS_PER_TURN and self.gate is not None:
            self._chunks = 0
            self.gate.pause(YIELDING)
            self.plane.loop.call_soon(self.gate.resume, YIELDING)
        incoming = self._incoming
        if incoming is None or incoming.head is not None:
            return
        mid_head = in_head is incoming
        if mid_head:
            # The whole read fell inside one head: bound what the parser buffers of it (a
            # read that ended another head on the way began this one's count afresh).
            self._head_size += len(data)
            if self._head_size > self.plane.limits.max_head_bytes:
                self._stop(self._head_too_large())
                return
        if data[-1:] == b"\n" and incoming.url and self._versionless(data, began=not mid_head):
            self._stop(_unserved_version("0.9"))

    def _versionless(self, data: bytes, began: bool) -> bool:
        """Whether the head being read, `data` its last read (`began`: its first too), is a
        request line that ended without a version: HTTP/0.9, one line and nothing after it.
        llhttp reads its version only at the next byte, and the client, waiting for the
        answer to that line, got the head's 408. No version read on the connection yet says
        so; after a request that had one, llhttp still reports that one's, and the line must
        be in the read whole, after a line end (a header line cannot be `method target`:
        llhttp refuses a field line without a colon)."""
        parser = self._parser
        if parser.get_http_version() == "0.0":
            return True
        incoming = self._incoming
        assert incoming is not None
        line = b"%s %s" % (parser.get_method(), incoming.url)
        ends = (line + b"\r\n", line + b"\n")
        return (began and data in ends) or data.endswith((b"\n" + ends[0], b"\n" + ends[1]))

    def eof_received(self) -> bool:
        # A client that stops sending is gone (as uvicorn and aiohttp see it): TCP does not
        # tell a half-close from a close, and a client that left must stop its generation at
        # once (the upstream request is aborted), not when an answer finds it gone.
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._bound.members.discard(self)
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.client_gone()
        link, self._link = self._link, None
        if link is not None:
            link.abort()
        if self._stop_unrouted():
            # It left while its request waited to be routed (its long prompt's encode, its
            # placer's answer): gone, as a client that leaves after routing is.
            self.plane.stats.ended["gone"] += 1
        # What it read is freed now, not by a pass of the cyclic collector: the parser (its
        # callbacks) and the deadline (`_expired`) hold this connection, which holds them, and
        # the replica's rare passes (`cli._tune_gc`) left the bodies of uploads cut short in
        # memory, 31 MiB each, until some 1,500 other requests went by.
        self._deadline.close()
        if self._stall is not None:
            self._stall[1].close()
        self._parser = _DETACHED
        self._incoming = None
        self._queue.clear()
        self._deferred = None
        self._held = None

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._relay is not None:
            self._relay.client_paused(True)
        stall = self._stall
        if stall is None:
            stall = self._stall = (
                WriteStall(self.plane.limits.client_write_timeout_s),
                Deadline(self.plane.loop, self._check_stall),
            )
        rule, deadline = stall
        deadline.set(rule.start(self.plane.loop.time(), self._write_progress()))

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._relay is not None:
            self._relay.client_paused(False)
        if self._stall is not None:
            self._stall[1].cancel()

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if len(self._queue) > MAX_PIPELINED:
            raise _Refused(Refusal(429, "too many pipelined requests", close=True))
        self._incoming = _Incoming()
        self._head_size = 0
        if not self._answering:  # else its clock starts when the answer before it ends
            self._phase = "head"

    def on_url(self, url: bytes) -> None:
        incoming = self._incoming
        assert incoming is not None
        incoming.url += url
        if len(incoming.url) > self.plane.limits.max_head_bytes:
            raise _Refused(Refusal(414, "request target too long", close=True))

    def on_header(self, name: bytes, value: bytes) -> None:
        # Checked at the end of the head (one call per field is the hot path): until then a
        # head is bounded by one read, and across reads by `data_received`'s count.
        incoming = self._incoming
        assert incoming is not None
        if incoming.head is None:
            incoming.headers.append((name, value))
            return
        # A trailer field of a chunked body (RFC 9112 7.1.2): dropped, as a recipient may; its
        # bytes count against the body's bound, so a body cannot end in endless fields.
        self._body_grows(incoming, len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        incoming = self._incoming
        assert incoming is not None
        limits = self.plane.limits
        headers = incoming.headers
        if len(headers) > limits.max_header_count:
            raise _Refused(
                Refusal(431, f"more than {limits.max_header_count} header fields", close=True)
            )
        # Every name and value and their ": " and CRLF, summed in C (no comprehension's frame).
        size = len(incoming.url) + 4 * len(headers) + sum(map(len, chain.from_iterable(headers)))
        if size > limits.max_head_bytes:
            raise _Refused(self._head_too_large())
        parser = self._parser
        version = parser.get_http_version()
        if version not in _SERVED_VERSIONS:
            # llhttp reads a request line without a version as HTTP/0.9 and takes any digits.
            raise _Refused(_unserved_version(version))
        try:
            head = read_request_head(
                parser.get_method(),
                incoming.url,
                version == "1.1",
                incoming.headers,
                parser.should_keep_alive(),
            )
        except Malformed as exc:
            incoming.head = exc.head  # counted under its route when it parsed (a 501)
            raise _Refused(Refusal(exc.status, str(exc), close=True)) from None
        incoming.head = head
        plane = self.plane
        refusal = admit(head, plane.limits.max_body_bytes)
        if refusal is None and head.expect is not None:
            refusal = uninvited(head, plane.internal_token)
            if refusal is not None:
                peer = self.transport.get_extra_info("peername") if self.transport else None
                plane.metrics.auth_refusals.refused(
                    control_path(head), peer[0] if peer else "?", refusal.status, refusal.message
                )
        if refusal is not None:
            raise _Refused(refusal)
        self._queue.append(incoming)
        if head.expect is not None:
            incoming.continue_due = True
            if self._queue[0] is incoming:
                self._send_continue(incoming)
        if self._phase == "head":
            self._phase = "body"

    def on_chunk_header(self) -> None:
        # A chunk's framing counts against the body's bound too, so that the bound holds the
        # chunks, each a parser callback, to a number its bytes pay for: it let 32 Mi chunks of
        # one byte through (112 MiB on the wire, seconds of the loop's time, for one request).
        incoming = self._incoming
        assert incoming is not None
        self._body_grows(incoming, CHUNK_FRAMING)
        self._chunks += 1

    def on_body(self, data: bytes) -> None:
        incoming = self._incoming
        assert incoming is not None
        self._body_grows(incoming, len(data))
        body = incoming.body
        if isinstance(body, bytearray):
            body += data
        elif body:
            grown = bytearray(body)
            grown += data
            incoming.body = grown
        else:
            incoming.body = data

    def _body_grows(self, incoming: _Incoming, size: int) -> None:
        """`size` more bytes of the body being read (data, chunk framing, trailer fields)."""
        incoming.body_size += size
        if incoming.body_size > self.plane.limits.max_body_bytes:
            raise _Refused(body_too_large(self.plane.limits.max_body_bytes))

    def on_message_complete(self) -> None:
        incoming = self._incoming
        assert incoming is not None
        if self._parser.should_upgrade():
            return  # llhttp stopped before the body: see `_without_upgrade`
        self._incoming = None
        incoming.complete = True
        incoming.continue_due = False
        if self._phase == "body":
            self._phase = ""
        if self._answering or self._queue[0] is not incoming:
            if self.gate is not None:
                self.gate.pause(PIPELINED)
            return
        self._answer_next()

    # -- answering -------------------------------------------------------------------------

    def keep_alive(self, head: RequestHead) -> bool:
        return head.keep_alive and not self.plane.draining and not self._scrape

    def write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        elif self.transport is not None and not self._closed:
            self._written += len(data)
            self.transport.write(data)

    def hold(self, data: bytes) -> None:
        """Write `data` at the next `flush`, with every write until then: what one upstream
        read relays (a response's head and body, several SSE events) goes out in one send, at
        the end of the read, instead of one per piece."""
        held = self._held
        if held is None:
            self._held = [data]
        else:
            held.append(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held and self.transport is not None and not self._closed:
            data = held[0] if len(held) == 1 else b"".join(held)
            self._written += len(data)
            self.transport.write(data)

    def refuse(self, refusal: Refusal) -> None:
        """Answer the request being answered with one of the data plane's own answers."""
        head = self._queue[0].head
        client_11 = head.http_11 if head is not None else True
        keep = head is not None and self.keep_alive(head) and not refusal.close
        head_only = head is not None and head.method == b"HEAD"
        cors = self.cors
        if cors is not None and head is not None and (fields := cors.fields(head)):
            refusal = replace(refusal, extra=refusal.extra + fields)  # for the page to read
        self.write(
            refusal_response(refusal, client_11=client_11, keep_alive=keep, head_only=head_only)
        )
        self.exchange_done(keep)

    def exchange_done(self, keep_alive: bool) -> None:
        """The answer being written is complete."""
        self.flush()
        self._relay = None
        self._answering = False
        if self._closed:
            return
        self._queue.popleft()
        if not keep_alive:
            self._close(self._close_reason)
            return
        if self._queue:
            self._answer_next()
        if not self._answering:
            # Nothing to answer now: no request waits, or the next one's body is still coming,
            # which must be read (its reading was paused while this answer went out, and three
            # pipelined 100 kB requests left the third unread until the body timeout, a 408).
            if self.gate is not None:
                self.gate.resume(PIPELINED)
            # What the client owes now: nothing (idle), or the rest of a request's head or body.
            incoming = self._incoming
            if incoming is None:
                self._phase = "idle"
            else:
                self._phase = "head" if incoming.head is None else "body"
            self._arm()

    def cut(self) -> None:
        """The answer broke after its first byte: close, without a clean end."""
        self.flush()
        self._relay = None
        self._close("cut")

    def close_if_idle(self) -> None:
        if not self._answering and not self._queue and self._incoming is None:
            self._close("drain")

    def shut_down(self) -> None:
        """The replica stops: an answer begun gets a cut stream's tail (`Relay.shut_down`)
        and its connection closes after it; any other connection is aborted."""
        relay = self._relay
        if relay is None or relay.plan is None or relay.done or self._closed:
            self.abort("shutdown")
            return
        relay.shut_down()
        self.flush()
        self._close("shutdown")

    def abort(self, why: str) -> None:
        self.plane.stats.closed[why] += 1
        if self.transport is not None:
            self.transport.abort()

    def control_link(self) -> UpstreamConnection:
        link = self._link
        if link is None or link.closed:
            plane = self.plane
            assert self.transport is not None
            extra = {
                name: self.transport.get_extra_info(name)
                for name in ("peername", "sockname", "socket")
            }
            link = open_control_link(
                plane.loop, plane.control, extra, plane.limits.stream_idle_timeout_s
            )
            self._link = link
        return link

    def _answer_next(self) -> None:
        incoming = self._queue[0]
        if not incoming.complete:
            if incoming.continue_due:
                self._send_continue(incoming)
            return
        self._answering = True
        head = incoming.head
        if incoming.refusal is not None or head is None:
            refusal = incoming.refusal or Refusal(400, "malformed request", close=True)
            count_refused(self.plane.metrics, head, refusal.status)
            self.refuse(refusal)
            return
        body = incoming.body
        incoming.body = b""
        if isinstance(body, bytearray):
            body = bytes(body)
        route = "control" if self._control_only else route_of(head)
        if route == "control":
            probe = self.plane.probes.get(head.path)
            if probe is not None and head.method in (b"GET", b"HEAD"):
                self._answer_probe(head, probe)
                return
            if not self._answered_preflight(head):
                self._start(ControlRelay(self, head, body))
            return
        if route == "not_allowed":
            if self._answered_preflight(head):
                return
            count_refused(self.plane.metrics, head, 405)
            self.refuse(not_allowed(head))
            return
        self.turn_started = time.perf_counter()
        self._deferred = (head, body)
        self.plane.route_in_turn(self)

    def _stop_unrouted(self) -> bool:
        """Drop the wait of a request not routed yet (its placer's question, its long prompt's
        encode), its count with it; whether there was one."""
        asking, self._asking = self._asking, None
        if asking is not None:
            asking.cancel()
            self.plane.asking.done()
        encoding, self._encoding = self._encoding, None
        if encoding is not None:
            self.plane.encodes.cancel(encoding)
        return asking is not None or encoding is not None

    def turn_away_unrouted(self) -> bool:
        """The drain ended while this connection's request waited for its placer's answer or
        its long prompt's encode: never sent, it is answered a 503 with `Retry-After` (its
        client may send it again elsewhere), not cut. Whether it was."""
        if self._closed or not self._stop_unrouted():
            return False
        head = self._queue[0].head
        assert head is not None  # a request is routed only once its head is read
        self._send(head, b"", _DRAINED)
        return True

    def route_now(self) -> None:
        """Route the request waiting at the head of the queue (its turn in the slice came)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None or self._closed:
            return
        head, body = deferred
        try:
            decision = self.plane.router.route(head.path, body)
            if isinstance(decision, EncodeFirst):  # a long prompt: routed once encoded
                then = partial(self._encoded, head, body, decision.work.then)
                late = partial(self._routed_after_wait, head, body, decision.busy)
                self._encoding = self.plane.encodes.submit(decision.work.run, then, late)
                if self._encoding is not None:
                    return
                decision = decision.busy()
        except Exception:  # a bug must not leave the client hanging, nor pass unlogged
            log.exception("routing a request failed: answered 500; please report this")
            decision = _ROUTING_FAILED
        self._decided(head, body, decision)

    def _encoded(
        self,
        head: RequestHead,
        body: bytes,
        then: Callable[[Callable[[], Any]], Routed],
        outcome: Callable[[], Any],
    ) -> None:
        self._routed_after_wait(head, body, partial(then, outcome))

    def _routed_after_wait(
        self, head: RequestHead, body: bytes, decide: Callable[[], Routed]
    ) -> None:
        """A long prompt's decision once encoded, or without its ids once it waited too long
        for a thread (`EncodeQueue.late`)."""
        self._encoding = None
        if self._closed:
            return
        try:
            decision = decide()
        except Exception:  # a bug must not leave the client hanging, nor pass unlogged
            log.exception("routing a long prompt after its encode or wait failed: answered 500")
            decision = _ROUTING_FAILED
        self._decided(head, body, decision)

    def _decided(self, head: RequestHead, body: bytes, decision: Routed) -> None:
        if isinstance(decision, AskFirst):  # a new prefix: routed once its placer answers
            self._asking = decision
            self.plane.asking.add()
            decision.wait(lambda ask: self._placed(head, body, ask))
            return
        self._send(head, body, decision)

    def _placed(self, head: RequestHead, body: bytes, ask: AskFirst) -> None:
        if self._asking is None:  # its client left (`connection_lost` counted it done)
            return
        self._asking = None
        self.plane.asking.done()
        if self._closed:
            return
        try:
            decision = ask.decision()
        except Exception:  # a bug must not leave the client hanging, nor pass unlogged
            log.exception("routing a new prefix after its placer's answer failed: answered 500")
            decision = _ROUTING_FAILED
        self._send(head, body, decision)

    def _send(self, head: RequestHead, body: bytes, decision: Decision | Refusal) -> None:
        plane = self.plane
        if isinstance(decision, Refusal):
            count_refused(plane.metrics, head, decision.status)
            self.refuse(decision)
            return
        self._start(WorkerRelay(plane, self, head, body, decision))

    def _start(self, relay: ControlRelay | WorkerRelay) -> None:
        self._relay = relay
        try:
            relay.start()
        except Exception as exc:  # a bug: see `_failed` (routing runs outside the parser too)
            self._failed(exc)

    def _answer_probe(self, head: RequestHead, probe: Probe) -> None:
        status, body = probe()
        keep = self.keep_alive(head)
        self.write(
            json_response(
                status,
                body,
                client_11=head.http_11,
                keep_alive=keep,
                head_only=head.method == b"HEAD",
            )
        )
        self.exchange_done(keep)

    def _answered_preflight(self, head: RequestHead) -> bool:
        """Whether `head` was a page's preflight the CORS policy answers (`cors`), and was."""
        cors = self.cors
        fields = None if cors is None else cors.preflight(head)
        if fields is None:
            return False
        keep = self.keep_alive(head)
        self.write(no_content_response(fields, client_11=head.http_11, keep_alive=keep))
        self.exchange_done(keep)
        return True

    def _send_continue(self, incoming: _Incoming) -> None:
        incoming.continue_due = False
        self.write(CONTINUE)

    # -- ends ------------------------------------------------------------------------------

    def _stop(self, refusal: Refusal) -> None:
        """Parsing is over: queue `refusal` in this request's turn, then close."""
        self._stopped = True
        incoming = self._incoming or _Incoming()
        self._incoming = None
        incoming.refusal = refusal
        incoming.complete = True
        if not self._queue or self._queue[-1] is not incoming:
            self._queue.append(incoming)
        if self.gate is not None:
            self.gate.pause(PIPELINED)
        # Counted once, when the answer's close comes (`exchange_done`), not here as well.
        self._close_reason = "malformed" if refusal.status == 400 else "refused"
        if not self._answering and self._queue[0] is incoming:
            self._answer_next()

    def _feed(self, data: bytes) -> Refusal | None:
        """Parse `data`: the refusal it ends in, if any.

        A request asking to switch protocols stops llhttp after its head; it is parsed again
        without its Upgrade field (`_without_upgrade`), then what the read held after it, in
        turns of this loop, never a call deeper: a probe's answer goes out as it is parsed,
        so no queue grows with such heads, and 600 of them pipelined in one read recursed
        past Python's limit. Each turn moves past one head of the read: the head written
        again has no Upgrade field, and one that stops the parser all the same ends the
        parse with a 400, so the turns are bounded by the heads the read holds."""
        pieces: list[bytes | memoryview] = [data]  # a stack: the next one to parse last
        again: bytes | None = None  # the head last written again, being parsed
        while pieces:
            piece = pieces.pop()
            try:
                self._parser.feed_data(piece)
            except httptools.HttpParserCallbackError as exc:
                cause = exc.__context__
                if not isinstance(cause, _Refused):
                    self._failed(cause)
                    return None
                return cause.refusal
            except httptools.HttpParserUpgrade as exc:
                if piece is again:
                    return _SWITCH_REFUSED
                rest = memoryview(piece)[exc.args[0] :]
            except httptools.HttpParserError as exc:
                if piece[:14] == b"PRI * HTTP/2.0":  # llhttp calls it "Pause on PRI/Upgrade"
                    return Refusal(
                        400, "HTTP/2 by prior knowledge is not served: send HTTP/1.1", close=True
                    )
                return Refusal(400, f"malformed HTTP request: {exc}", close=True)
            else:
                continue
            # Parsed again outside the handler: a refusal raised by a callback there would
            # have the upgrade as its context, not the `_Refused` that says which answer it is.
            again = self._without_upgrade()
            if again is None:
                return _SWITCH_REFUSED
            if rest:
                pieces.append(rest)
            pieces.append(again)
        return None

    def _without_upgrade(self) -> bytes | None:
        """The request being parsed asked to switch protocols and llhttp stopped after its
        head: it is served as a plain request instead (`head_without_upgrade`), its head
        written again without the Upgrade field for a fresh parser (returned; None if no head
        was read); the parse so far is dropped (the request had not completed, so nothing of
        it was answered but a `100 Continue`, which the head written again does not ask for
        again)."""
        incoming = self._incoming
        if incoming is None or incoming.head is None:
            return None
        head = incoming.head
        self._queue.remove(incoming)
        self._incoming = None
        self._parser = httptools.HttpRequestParser(self)
        invited = head.expect is not None and not incoming.continue_due
        return head_without_upgrade(
            head.method, incoming.url, head.http_11, head.headers, invited=invited
        )

    def _failed(self, error: BaseException | None) -> None:
        """Something other than the client's bytes failed (a bug), inside a parser callback
        or starting an answer: logged with its traceback, and the client answered 500 if
        nothing of an answer was under way, else cut off; either way the connection closes,
        since what the parser has read of it, or the answer has sent, is unknown. Never a
        client left waiting for an answer that will not come."""
        log.error(
            "the data plane failed on a client's request: connection closed; please report this",
            exc_info=error,
        )
        if self._answering or self._closed:
            self._stopped = True
            self.abort("error")
            return
        self._stop(
            Refusal(500, "the router failed on this request", type="server_error", close=True)
        )

    def _head_too_large(self) -> Refusal:
        return Refusal(
            431, f"request head over {self.plane.limits.max_head_bytes} bytes", close=True
        )

    def _arm(self) -> None:
        """Bound the phase the connection is in (head, body or idle) with its deadline.

        Answering is not armed: the deadline set before it is left pending, and if it fires
        meanwhile `_expired` ignores it (the phase is ""); the answer's end arms the next
        phase. That saves clearing it on every request."""
        phase = self._phase
        limits = self.plane.limits
        if phase == "head":
            self._deadline.set(limits.header_timeout_s)
        elif phase == "body":
            self._deadline.set(limits.body_timeout_s)
        elif phase == "idle":
            self._deadline.set(limits.keepalive_timeout_s)

    def _expired(self) -> None:
        phase = self._phase
        if not phase or self._closed:
            return
        if phase == "idle":
            self._close("idle")
            return
        # A client too slow with its head or body: 408 if nothing is being answered.
        self.plane.stats.closed[f"{phase}_timeout"] += 1
        self._closed = True
        if self.transport is not None:
            if not self._answering:
                incoming = self._incoming
                count_refused(
                    self.plane.metrics, incoming.head if incoming is not None else None, 408
                )
                self.transport.write(
                    refusal_response(
                        Refusal(408, f"request {phase} not received in time", close=True),
                        client_11=True,
                        keep_alive=False,
                    )
                )
            self.transport.close()

    def _write_progress(self) -> int:
        """Bytes of what was written that the client has taken: what left the transport's
        buffer for the kernel, less what the kernel holds that the client has not acknowledged
        (where the kernel says, Linux). What left the router's buffer alone moved only when
        the kernel woke the writer, once a third or more of its send buffer was free: a client
        reading 200 B/s through a 100 KB buffer was cut at 120 s, one reading 64 KiB/s over
        loopback at 4 s."""
        assert self.transport is not None
        sent = self._written - self.transport.get_write_buffer_size()
        return sent - _unacknowledged(self._fd)

    def _check_stall(self) -> None:
        """A paused client's progress is checked (`flow.WriteStall`): one that took nothing
        for the timeout is cut (the abort drops what it was owed; `connection_lost` aborts
        the upstream request, which frees its connection to the worker). So is one closed
        already (idle after its answer, draining) whose last answer it does not read: a close
        waits for the buffer to be sent, and kept its socket and buffer for as long."""
        if not self.write_paused or self._stall is None or self.transport is None:
            return
        rule, deadline = self._stall
        plane = self.plane
        delay = rule.check(plane.loop.time(), self._write_progress())
        if delay is not None:
            deadline.set(delay)
            return
        if said := plane.write_stalls.count(plane.loop.time()):
            log.warning(
                "%d client connection(s) cut since the last such warning: their writes were "
                "paused and they took nothing of their answers for --client-write-timeout-s "
                "(%g s); their upstream requests were aborted (said at most every %g s; "
                'kvrouter_client_connections_closed_total{reason="write_timeout"} counts them)',
                said,
                rule.timeout_s,
                _LOG_EVERY_S,
            )
        if self._closed:
            self.transport.abort()  # its close was counted, under the reason it closed for
        else:
            self.abort("write_timeout")

    def _close(self, why: str) -> None:
        if self._closed:
            return
        self._closed = True
        self.plane.stats.closed[why] += 1
        transport = self.transport
        if transport is None:
            return
        if self._stopped and transport.can_write_eof():
            # A lingering close (`LINGER_S`): what arrives now is dropped (`data_received`
            # reads nothing once closed), and the client's own close ends it sooner.
            transport.write_eof()
            if self.gate is not None and self.gate.paused:
                transport.resume_reading()  # the gate's reasons end with the connection
            self.plane.loop.call_later(LINGER_S, transport.close)
            return
        transport.close()


def _unacknowledged(fd: int) -> int:
    """Bytes in the TCP socket `fd`'s send queue its peer has not acknowledged (SIOCOUTQ); 0
    where that cannot be read (another system, no socket, one closed meanwhile)."""
    if _SIOCOUTQ is None or fd < 0:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, _SIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return 0
