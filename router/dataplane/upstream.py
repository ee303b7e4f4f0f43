"""The upstream side: one keep-alive connection pool per worker, on Protocols and httptools.

`UpstreamConnection` sends one request at a time and parses the answer with
`httptools.HttpResponseParser`, reporting to the exchange that sent it (a `ResponseSink`):
the final head (1xx answers are skipped, see `exchange`), the body each read brings, in one
piece however many chunks it held, the end, or why it stopped. The parser has no per-field
callbacks: it checks the head and says when it is complete, and the head is then read from
the bytes received (`exchange.read_response_head`: most heads go to the client as they are,
a splice instead of a Python call per field). Its `Deadline` bounds the wait for the head,
then every gap in the body (the stream idle timeout; not while the client's backpressure
holds reading). It reports completion only after `feed_data` returns, so no sink ever
re-enters the parser; bytes after a complete answer end the parse, and go with the
connection, never reused (as do bytes on an idle connection; stray bytes arriving once the
connection was reused are read as the next answer: an early answer is legal, so nothing
tells them apart).

`UpstreamPool` holds one worker's connections: idle ones are reused most-recent first and
closed after `idle_expiry_s` (shorter than an engine's keep-alive: uvicorn closes idle
connections after 5 s, and a request written into a connection the server is closing is the
race the one safe retry covers); at most `cap` connections exist at once, and acquirers beyond
it wait in order for one to come back, each for `connect_timeout_s` at most: to its client,
waiting for a pooled connection and making one are the same step, getting a connection. One
that waited that long is told it failed (`queue`, a request never sent: safe to send
elsewhere), and leaves the queue, as does one that no longer wants a connection (`cancel`).
A connection attempt is the only task the data plane makes (the loop's `create_connection`
is a coroutine), bounded by `connect_timeout_s` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import Final, Protocol, cast

import httptools

from router.dataplane.door import HEARTBEAT_S
from router.dataplane.exchange import (
    BadAnswer,
    Failure,
    Framing,
    ResponseHead,
    classify_lost,
    close_came_by,
    read_response_head,
)
from router.dataplane.flow import Deadline
from router.log_tally import LogTally

log = logging.getLogger(__name__)
BUSY_LOG_EVERY_S: Final = 10.0  # the most often requests queued past their bound are said

# A worker's answer head (with any 1xx answers before it) larger than this is refused as a lost
# answer: its reads are kept until the head completes, and llhttp bounds no head's size. The
# client side's own default (`--max-head-bytes`) is the same: no engine writes heads near it.
MAX_ANSWER_HEAD_BYTES = 64 * 1024


class ResponseSink(Protocol):
    """The exchange an upstream connection answers to."""

    def upstream_head(self, answer: ResponseHead) -> None: ...

    def upstream_body(self, data: bytes) -> None:
        """The body bytes of one read (never empty), as they arrived."""

    def upstream_end(self) -> None: ...

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        """Stopped before a final head: `failure` says how (see `exchange.FAILURES`)."""

    def upstream_cut(self, reason: str) -> None:
        """Stopped after the head, before the end of the body."""

    def upstream_paused(self, paused: bool) -> None:
        """The worker is (not) keeping up with the request bytes written to it."""

    def upstream_read(self) -> None:
        """After the parse of each read but the one that ended the answer (`upstream_end`
        writes its own): what it relayed may go out now, in one write."""


class Acquirer(Protocol):
    def connection_ready(self, conn: UpstreamConnection) -> None: ...

    def connection_failed(self, failure: Failure, detail: str) -> None: ...


# In place of a lost connection's parser (`UpstreamConnection.connection_lost`): it has no
# callbacks, and is never fed (a closed connection reads nothing).
_DETACHED: Final = httptools.HttpResponseParser(object())


class UpstreamConnection(asyncio.Protocol):
    def __init__(
        self, loop: asyncio.AbstractEventLoop, pool: UpstreamPool | None, idle_timeout_s: float
    ) -> None:
        self.loop = loop
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.reused = False  # served an answer before the current request
        self.idle_since = 0.0
        self._idle_timeout_s = idle_timeout_s
        # The body pieces the parse of a read yields, joined for the sink at its end
        # (`_pass_body`): a worker may send chunks of a byte each (legal), and a Python call
        # a piece cost ~600 times the CPU of the same bytes in large chunks, and a client
        # chunk a piece six times their size. Appended by llhttp's callback itself, the
        # parser takes `on_body` as it is made.
        self._pieces: list[bytes] = []
        self.on_body = self._pieces.append
        self._parser = httptools.HttpResponseParser(self)
        self._deadline = Deadline(loop, self._expired)
        self._sink: ResponseSink | None = None  # the exchange in progress
        self._method = b""
        # The reads of the answer until its final head is parsed: the head is read from them
        # (`exchange.read_response_head`), not field by field from the parser's callbacks.
        self._reads: list[bytes] = []
        self._head_at = 0  # where the head starts in them (past any 1xx answer)
        self._head_done = False
        self._framing = Framing.NONE
        self.answered = 0  # bytes received for the current request
        self._sent_at = 0.0  # the loop's time as the current request was written
        self._complete = False
        self._keep_alive = False  # the worker keeps the connection open after this answer
        self._reusable = True
        self._held = False  # reading paused for the client's backpressure (`hold_reading`)

    # -- use -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    @property
    def deadline_pending(self) -> bool:
        """Its head or idle deadline has not passed yet (an idle pooled connection may keep its
        last request's, ignored when it passes)."""
        return self._deadline.pending

    def send(
        self, sink: ResponseSink, method: bytes, head: bytes, body: bytes, head_timeout_s: float
    ) -> None:
        assert self.transport is not None and self._sink is None
        self._sink = sink
        self._method = method
        self._reads = []
        self._head_at = 0
        self._head_done = False
        self.answered = 0
        self._sent_at = self.loop.time()
        self._complete = False
        if self._held:  # left paused by the last answer's client, which filled up at its end
            self._held = False
            self.transport.resume_reading()
        self._deadline.set(head_timeout_s)
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)

    def abort(self) -> None:
        """Drop the current request: close without notifying the sink (which is gone)."""
        self._sink = None
        self._deadline.cancel()
        if self.transport is not None:
            self.transport.abort()

    def hold_reading(self, paused: bool) -> None:
        """Stop or resume reading the answer (the client's side is full, or drained). While
        held, the stream's idle gap is not timed: the worker is not idle, the router stopped
        reading it; resumed, the gap starts again."""
        self._held = paused
        if self.transport is not None and not self.transport.is_closing():
            if paused:
                self.transport.pause_reading()
                if self._head_done:
                    self._deadline.cancel()
            else:
                self.transport.resume_reading()
                if self._head_done and self._sink is not None:
                    self._deadline.set(self._idle_timeout_s)

    @property
    def held(self) -> bool:
        """Reading its answer is paused: its client does not read as fast as the worker
        writes."""
        return self._held

    @property
    def sink(self) -> ResponseSink | None:
        return self._sink

    @property
    def waiting_for_head(self) -> bool:
        return self._sink is not None and not self._head_done

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._sink is None:
            # Bytes on an idle connection: the worker broke the protocol; never reuse it.
            self._reusable = False
            if self.transport is not None:
                self.transport.close()
            return
        self.answered += len(data)
        if not self._head_done:
            self._reads.append(data)
        sink = self._sink
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._pass_body()  # what parsed before the error goes before its cut
            self._reusable = False
            if not self._complete:
                if isinstance(exc, httptools.HttpParserUpgrade):  # its text is a byte offset
                    self._stop("the worker switched protocols (101), which the relay does not")
                else:
                    self._stop(f"malformed response: {exc}")
                sink.upstream_read()
                return
            # Bytes after a complete answer in the same read (another answer, junk): dropped
            # with the connection (RFC 9112 6.3), the answer ends as it is.
        else:
            self._pass_body()
        if self._complete:
            # No `upstream_read` after it: `upstream_end` is the sink's last word, and writes
            # what it holds (most answers: the whole answer in this one read).
            self._finish()
            return
        if self._head_done:
            if self._sink is not None and not self._held:
                # Once a read, not once a callback: the gap it bounds is between reads.
                self._deadline.set(self._idle_timeout_s)
        elif self.answered > MAX_ANSWER_HEAD_BYTES and self._sink is not None:
            self._head_too_large()  # still growing
        sink.upstream_read()

    def eof_received(self) -> bool:
        return False  # close; connection_lost reports

    def connection_lost(self, exc: Exception | None) -> None:
        # Freed once it is told, not by a pass of the cyclic collector (`cli._tune_gc` makes
        # them rare): the deadline (`_expired`) and the parser (its callbacks) hold this
        # connection, which holds them.
        self._deadline.close()
        try:
            self._lost(exc)
        finally:
            self._parser = _DETACHED

    def _lost(self, exc: Exception | None) -> None:
        transport, self.transport = self.transport, None
        if self.pool is not None and transport is not None:
            self.pool.lost(self)
        sink, self._sink = self._sink, None
        if sink is None:
            return
        if self._head_done and self._framing is Framing.CLOSE and exc is None:
            sink.upstream_end()  # a close-delimited body ends here (RFC 9112 6.3 item 8)
        elif self._head_done:  # a reset is no end, even of a close-delimited body
            sink.upstream_cut(f"the worker closed the connection ({exc or 'EOF'})")
        else:
            now, sent = self.loop.time(), self._sent_at
            free_at = None if self.pool is None else self.pool.free_at()
            came_by = close_came_by(sent, now, free_at, HEARTBEAT_S)
            held = f"; the loop was held {now - came_by:.2f} s more" if came_by < now else ""
            sink.upstream_failed(
                classify_lost(self.reused, self.answered, sent, came_by),
                f"connection closed before a head, by {came_by - sent:.2f} s after the "
                f"request{held} ({exc or 'EOF'})",
            )

    def pause_writing(self) -> None:
        if self._sink is not None:
            self._sink.upstream_paused(True)

    def resume_writing(self) -> None:
        if self._sink is not None:
            self._sink.upstream_paused(False)

    # -- httptools callbacks ---------------------------------------------------------------

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        sink = self._sink
        if sink is None:
            return
        reads = self._reads
        raw = reads[0] if len(reads) == 1 else b"".join(reads)
        # llhttp accepts only CRLF line ends: the first blank line after its start ends a head.
        start = self._head_at
        end = raw.index(b"\r\n\r\n", start) + 4
        if end > MAX_ANSWER_HEAD_BYTES:  # ended in the read that crossed the bound
            self._head_too_large()
            return
        if 100 <= status < 200:
            # An interim answer (RFC 9110 15.2): skipped; its own message end is ignored.
            # Below 100 is no status: `read_response_head` refuses it.
            self._reads = [raw]
            self._head_at = end
            return
        try:
            answer = read_response_head(status, raw[start:end], self._method)
        except BadAnswer as exc:
            self._reusable = False
            self._stop(str(exc))  # before the head is taken: a lost answer, failed over
            return
        self._reads = []
        self._head_done = True
        # Asked now: llhttp forgets the message's flags once it completes.
        self._keep_alive = self._parser.should_keep_alive()
        self._framing = answer.framing
        if answer.framing is Framing.NONE and self._method == b"HEAD":
            # The parser cannot be told that a HEAD answer has no body: it would wait for the
            # declared length. The answer ends here, and the connection is not reused.
            self._reusable = False
            self._complete = True
        sink.upstream_head(answer)

    def _pass_body(self) -> None:
        """The body pieces of the read just parsed go to the sink, in one (none when the
        exchange was dropped in the read: a 5xx head failed over, a refused head)."""
        pieces = self._pieces
        if not pieces:
            return
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if self._sink is not None:
            self._sink.upstream_body(body)

    def on_message_begin(self) -> None:
        if self._complete:  # another answer after the complete one: see `data_received`
            raise BadAnswer("bytes after a complete answer")

    def on_message_complete(self) -> None:
        if self._head_done:
            self._complete = True

    # -- ends ------------------------------------------------------------------------------

    def _finish(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return  # discarded at its head
        # The deadline is left pending, not cleared on every answer: the next `send` moves
        # it, and if it fires first `_expired` ignores a connection with no exchange.
        keep = self._reusable and self._keep_alive
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size():
            # Answered before it read the whole request: the rest of it goes with the
            # connection (RFC 9112 9.3), aborted, as a close would wait for a worker that may
            # never read it.
            keep = False
            transport.abort()
        self.reused = True
        if self.pool is not None:
            self.pool.release(self, keep)
        elif not keep and self.transport is not None:
            self.transport.close()
        if sink is not None:
            sink.upstream_end()

    def discard(self) -> None:
        """Close the connection after the current head, the sink done with it (a 5xx head)."""
        self._sink = None
        self._reusable = False
        self._deadline.cancel()
        if self.transport is not None:
            self.transport.close()

    def _expired(self) -> None:
        if self._sink is None:
            return
        if self._head_done:
            self._stop(f"no byte from the worker for {self._idle_timeout_s:g} s")
        else:
            sink, self._sink = self._sink, None
            self.abort()
            sink.upstream_failed("timeout", "no response head in time")

    def _head_too_large(self) -> None:
        """A head (interim answers included) over the bound, however the reads fell: a lost
        answer, failed over, its connection never reused."""
        self._reusable = False
        self._stop(f"response head over {MAX_ANSWER_HEAD_BYTES} bytes")

    def _stop(self, reason: str) -> None:
        sink, self._sink = self._sink, None
        self.abort()
        if sink is None:
            return
        if self._head_done:
            sink.upstream_cut(reason)
        else:
            sink.upstream_failed("lost", reason)


class UpstreamPool:
    """Keep-alive connections to one worker (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        url: str,
        *,
        cap: int,
        connect_timeout_s: float,
        idle_expiry_s: float,
        idle_timeout_s: float,
        on_connect: Callable[[], None] | None = None,
        free_at: Callable[[], float | None] = lambda: None,
    ) -> None:
        scheme, _, rest = url.partition("://")
        host, _, port = rest.rpartition(":") if ":" in rest.split("]")[-1] else (rest, "", "")
        self.url = url
        self.host_header = rest.encode("latin-1")
        self._host = host.strip("[]")
        self._port = int(port) if port else (443 if scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if scheme == "https" else None
        )
        self._loop = loop
        self.cap = cap
        self._connect_timeout_s = connect_timeout_s
        self._idle_expiry_s = idle_expiry_s
        self._idle_timeout_s = idle_timeout_s
        self._on_connect = on_connect
        # The loop's time when it was last seen free, at a heartbeat on time (every
        # `HEARTBEAT_S`; None: no heartbeat): a close noticed after a held loop may have come
        # well before it was noticed.
        self.free_at = free_at
        self.idle: deque[UpstreamConnection] = deque()  # oldest left, most recent right
        self.busy: set[UpstreamConnection] = set()
        self.total = 0  # connecting, busy and idle
        # Acquirers waiting for a connection, each with the loop time it began to wait: the
        # oldest left, so one deadline, for the oldest, bounds them all (`_expire_waiting`).
        self.waiting: deque[tuple[Acquirer, float]] = deque()
        self._connecting: dict[asyncio.Task[object], Acquirer | None] = {}
        self._expiry = Deadline(loop, self._expire_idle)
        self._wait_expiry = Deadline(loop, self._expire_waiting)
        self._closed = False
        self._expired_tally = LogTally(BUSY_LOG_EVERY_S)  # waiters that found none in time

    def acquire(self, who: Acquirer, fresh: bool = False) -> None:
        """Hand `who` a connection now, after a connect, or when one comes back."""
        while self.idle and not fresh:
            conn = self.idle.pop()
            if not conn.closed:
                self.busy.add(conn)
                who.connection_ready(conn)
                return
        if self.total < self.cap or fresh:
            self._open(who)
            return
        waiting = self.waiting
        waiting.append((who, self._loop.time()))
        if len(waiting) == 1:
            self._wait_expiry.set(self._connect_timeout_s)

    def cancel(self, who: Acquirer) -> None:
        """`who` no longer wants a connection (its client left, its worker went down)."""
        for i, (waiter, _) in enumerate(self.waiting):
            if waiter is who:
                del self.waiting[i]
                break
        for task, waiter in self._connecting.items():
            if waiter is who:
                self._connecting[task] = None  # the connection, once made, goes idle

    def release(self, conn: UpstreamConnection, keep: bool) -> None:
        self.busy.discard(conn)
        if not keep or self._closed or conn.closed:
            if conn.transport is not None:
                conn.transport.close()
            return
        if self.waiting:
            self.busy.add(conn)
            self.waiting.popleft()[0].connection_ready(conn)
            return
        conn.idle_since = self._loop.time()
        self.idle.append(conn)
        if len(self.idle) == 1:
            self._expiry.set(self._idle_expiry_s)

    def lost(self, conn: UpstreamConnection) -> None:
        self.total -= 1
        self.busy.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        if self.waiting and self.total < self.cap and not self._closed:
            self._open(self.waiting.popleft()[0])

    def waiting_for_head(self) -> list[UpstreamConnection]:
        return [c for c in self.busy if c.waiting_for_head]

    def take_waiting(self) -> list[Acquirer]:
        """Every acquirer still without a connection (queued or connecting), now released."""
        out = [who for who, _ in self.waiting]
        self.waiting.clear()
        for task, who in list(self._connecting.items()):
            if who is not None:
                out.append(who)
                self._connecting[task] = None
        return out

    def retire(self) -> list[Acquirer]:
        """Its worker left the fleet: no connection is opened or kept any more. The idle ones
        close now, a busy one when its answer ends (`release`); the acquirers still without a
        connection are returned, for the caller to fail over."""
        self._closed = True
        self._expiry.cancel()
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()
        return self.take_waiting()

    def close(self) -> None:
        self._closed = True
        self._expiry.cancel()
        self._wait_expiry.cancel()
        for conn in [*self.idle, *self.busy]:
            if conn.transport is not None:
                conn.transport.abort()
        for task in self._connecting:
            task.cancel()

    # -- inside ----------------------------------------------------------------------------

    def _open(self, who: Acquirer) -> None:
        self.total += 1
        loop = self._loop
        task = loop.create_task(
            loop.create_connection(
                lambda: UpstreamConnection(loop, self, self._idle_timeout_s),
                self._host,
                self._port,
                ssl=self._ssl,
            )
        )
        self._connecting[task] = who
        timer = loop.call_later(self._connect_timeout_s, task.cancel)
        task.add_done_callback(lambda t: self._connected(t, timer))

    def _connected(self, task: asyncio.Task[object], timer: asyncio.TimerHandle) -> None:
        timer.cancel()
        who = self._connecting.pop(task, None)
        if task.cancelled() or task.exception() is not None:
            self.total -= 1
            if task.cancelled():
                failure, detail = "connect", f"no connection within {self._connect_timeout_s:g} s"
            else:
                exc = task.exception()
                failure, detail = "connect", f"{type(exc).__name__}: {exc}"
            if who is not None:
                who.connection_failed(failure, detail)  # type: ignore[arg-type]
            elif self.waiting and self.total < self.cap and not self._closed:
                self._open(self.waiting.popleft()[0])
            return
        if self._on_connect is not None:
            self._on_connect()
        _, conn = task.result()  # type: ignore[misc]
        if conn.closed:
            # The worker closed it before this callback ran (a worker killed as it accepted:
            # its reset can reach the loop first); `connection_lost` gives its slot back.
            if who is not None:
                who.connection_failed("connect", "the worker closed the new connection at once")
            return
        if self._closed:
            conn.abort()
            return
        if who is None:
            self.release(conn, keep=True)  # nobody waits for it any more: idle (or a waiter's)
            return
        self.busy.add(conn)
        who.connection_ready(conn)

    def _expire_idle(self) -> None:
        now = self._loop.time()
        idle = self.idle
        while idle and (idle[0].closed or now - idle[0].idle_since >= self._idle_expiry_s):
            conn = idle.popleft()
            if conn.transport is not None:
                conn.transport.close()
        if idle:
            self._expiry.set(idle[0].idle_since + self._idle_expiry_s - now)

    def _expire_waiting(self) -> None:
        """Acquirers that waited their bound fail, oldest first (each may fail over into this
        very pool again, behind the rest: a newer wait, not yet due)."""
        now = self._loop.time()
        bound = self._connect_timeout_s
        waiting = self.waiting
        expired = 0
        while waiting and now - waiting[0][1] >= bound:
            who, _ = waiting.popleft()
            expired += 1
            who.connection_failed(
                "queue",
                f"all {self.cap} connection(s) to the worker stayed busy for {bound:g} s",
            )
        if waiting:
            self._wait_expiry.set(waiting[0][1] + bound - now)
        if expired and (said := self._expired_tally.count(now, expired)):
            held = sum(1 for conn in self.busy if conn.held)
            log.warning(
                "%d request(s) since the last such warning found all %d connection(s) to %s "
                "busy with this replica's requests for --upstream-connect-timeout-s; each went "
                "to another worker, or got a 503 with Retry-After (said at most every %g s; "
                'kvrouter_upstream_failures_total{reason="queue"} counts them all). The worker '
                "is busy, not failing: raise --upstream-connections-per-worker if it can take "
                "more at once%s",
                said,
                self.cap,
                self.url,
                BUSY_LOG_EVERY_S,
                f"; {held} of them wait for clients reading slower than the worker writes "
                "(one that reads nothing for --client-write-timeout-s is cut)"
                if held
                else "",
            )
