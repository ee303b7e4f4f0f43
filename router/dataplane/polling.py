"""GET requests for the replica's own polling (engine loads, health), on the data plane's pools.

A replica polls every worker's load twice a second and its health every two seconds. Through
aiohttp one tick of load polls of two workers cost 555-582 us of CPU on a warm core (request
and response objects, timers, tasks; `LoadMonitor.poll_once` in a loop), and each poll runs
between sleeps, on a cold one. `PollClient.get` sends a fixed request head over a keep-alive
`UpstreamPool` of the worker's origin (`upstream.py`, the pools the data plane's relay uses,
httptools on a Protocol) and collects the answer in a small sink: 256 us for the same tick.

What a caller gets is a `PollAnswer`: the status and the body of an answer that came whole, or
`error` (`connection`, `timeout`, `too_large`, `broken`) when none did. Bounds: `timeout_s`
for the whole exchange (connect included), `max_bytes` for the body (a declared or streamed
body past it is dropped with its connection), `per_origin` connections to one origin.
Redirects are not followed: the status is the answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final

from router.dataplane.exchange import Failure, ResponseHead
from router.dataplane.upstream import UpstreamConnection, UpstreamPool

IDLE_EXPIRY_S: Final = 4.0  # under uvicorn's 5 s keep-alive, as the relay's pools


@dataclass(frozen=True, slots=True)
class PollAnswer:
    status: int | None  # None: no answer (see `error`)
    body: bytes | None  # the whole body of an answer that came whole
    error: str | None = None  # connection, timeout, too_large, broken
    detail: str = field(default="", compare=False)  # what the connection's failure said


class _Exchange:
    """One GET: the pool's acquirer, then the connection's response sink."""

    __slots__ = (
        "_conn",
        "_future",
        "_head",
        "_max_bytes",
        "_parts",
        "_pool",
        "_retried",
        "_size",
        "_status",
    )

    def __init__(
        self, pool: UpstreamPool, future: asyncio.Future[PollAnswer], head: bytes, max_bytes: int
    ) -> None:
        self._pool = pool
        self._future = future
        self._retried = False
        self._head = head
        self._max_bytes = max_bytes
        self._conn: UpstreamConnection | None = None
        self._status: int | None = None
        self._parts: list[bytes] = []
        self._size = 0

    def _end(self, answer: PollAnswer) -> None:
        if not self._future.done():
            self._future.set_result(answer)

    def abandon(self) -> None:
        """The caller stopped waiting (timeout, cancellation): the connection is dropped."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    # -- Acquirer --------------------------------------------------------------------------

    def connection_ready(self, conn: UpstreamConnection) -> None:
        if self._future.done():  # given a connection after the caller gave up: not used
            conn.abort()
            return
        self._conn = conn
        conn.send(self, b"GET", self._head, b"", head_timeout_s=3600.0)  # the caller's bound

    def connection_failed(self, failure: Failure, detail: str) -> None:
        self._end(PollAnswer(None, None, "connection", detail))

    # -- ResponseSink ----------------------------------------------------------------------

    def upstream_head(self, answer: ResponseHead) -> None:
        self._status = answer.status
        if answer.length is not None and answer.length > self._max_bytes:
            self.abandon()
            self._end(PollAnswer(answer.status, None, "too_large"))

    def upstream_body(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._max_bytes:
            self.abandon()
            self._end(PollAnswer(self._status, None, "too_large"))
            return
        self._parts.append(data)

    def upstream_end(self) -> None:
        self._conn = None
        self._end(PollAnswer(self._status, b"".join(self._parts)))

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        self._conn = None
        if failure == "stale" and not self._retried and not self._future.done():
            # The worker closed the idle connection as we wrote into it: it never saw the
            # request. Once, on a fresh connection (the relay's safe retry).
            self._retried = True
            self._pool.acquire(self, fresh=True)
            return
        error = "timeout" if failure == "timeout" else "connection"
        self._end(PollAnswer(None, None, error, detail))

    def upstream_cut(self, reason: str) -> None:
        self._conn = None
        self._end(PollAnswer(self._status, None, "broken"))

    def upstream_paused(self, paused: bool) -> None:
        pass  # a GET has no body to hold back

    def upstream_read(self) -> None:
        pass


class PollClient:
    """Keep-alive GETs to worker origins (see the module docstring). Loop-bound: made and
    used on the replica's event loop; `close()` drops every connection."""

    def __init__(self, *, per_origin: int = 2, idle_expiry_s: float = IDLE_EXPIRY_S) -> None:
        self._per_origin = per_origin
        self._idle_expiry_s = idle_expiry_s
        self._pools: dict[str, UpstreamPool] = {}

    async def get(self, url: str, timeout_s: float, max_bytes: int) -> PollAnswer:
        """GET `url` (an origin and a path): the answer, or why there is none."""
        origin, path = split_url(url)
        pool = self._pool(origin, timeout_s)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PollAnswer] = loop.create_future()
        head = b"GET %b HTTP/1.1\r\nHost: %b\r\nAccept: */*\r\n\r\n" % (path, pool.host_header)
        exchange = _Exchange(pool, future, head, max_bytes)
        pool.acquire(exchange)
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            return PollAnswer(None, None, "timeout")
        finally:
            # A timeout (or the caller's cancellation) cancels the future it waited on: that
            # exchange is given up too, its connection closed. (Checking only `done()` kept
            # every timed-out connection open: a host that accepts and never answers held
            # one descriptor per check, and checks of 800 such workers exhausted a replica's.)
            if not future.done() or future.cancelled():
                future.cancel()
                pool.cancel(exchange)
                exchange.abandon()

    def forget(self, origin: str) -> None:
        """Close the connections to a worker that left."""
        pool = self._pools.pop(origin, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def _pool(self, origin: str, timeout_s: float) -> UpstreamPool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = UpstreamPool(
                asyncio.get_running_loop(),
                origin,
                cap=self._per_origin,
                connect_timeout_s=timeout_s,
                idle_expiry_s=self._idle_expiry_s,
                idle_timeout_s=timeout_s,
            )
            self._pools[origin] = pool
        return pool


def split_url(url: str) -> tuple[str, bytes]:
    """(origin, path with query) of an absolute http(s) URL; `ValueError` otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest:
        raise ValueError(f"not an http(s) URL: {url!r}")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}", b"/" + path.encode("latin-1") if slash else b"/"
