"""One client request answered from upstream: the shell joining a client to a connection.

`Relay` is the client half every answer shares: it writes the head `exchange.plan_response`
chose, frames the body each upstream read brings as it arrives, one chunk a read (never
buffered, but for a streamed SSE answer's event not ended yet: `exchange.WholeEvents`), ends
the exchange, or cuts the connection as `exchange.cut_tail` says.
It carries backpressure both ways: the client's full write buffer pauses the upstream
connection's reading, the worker's full write buffer pauses the client's.

`WorkerRelay` answers a generation request from the ranks of a routing decision, failing
over before the first byte as `exchange.FAILURES` says, with the breaker, the in-flight
counts and the request metrics. A 5xx head from the last rank it may try is relayed as the
worker wrote it (a 503's `Retry-After` and body reach the client, which can honour them),
not turned into a 502 of the relay's own. A 5xx that may be the request's own doing (not one
of `exchange.WORKER_UNAVAILABLE`) is held from its worker's breaker until the request's
outcome shows whose it was (`_settle_held`): another worker's answer makes it the worker's,
another worker's 5xx of the same kind makes it the request's (relayed at once, with no third
attempt: one client's poison request must not open every worker's breaker in turn), and so
does a 4xx. No failure's worker has its other ranks tried (`FailureRule.whole_worker`): they
share its host, port and engine front, and the same engine's second answer to the request is
no second opinion on it (a worker failing every request would pass for a poison request on
its own two ranks). `ControlRelay` answers any other path from the control app,
over the client connection's in-process link (`control_link`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Final, Literal, Protocol

from cachetree.ranks import RankId
from router.dataplane.cors import lines as cors_lines
from router.dataplane.exchange import (
    FAILURES,
    GENERATION_ROUTES,
    LAST_CHUNK,
    RETRY_SOON,
    WORKER_UNAVAILABLE,
    Failure,
    Framing,
    Refusal,
    RequestHead,
    ResponseHead,
    ResponsePlan,
    WholeEvents,
    chunk,
    cut_tail,
    plan_response,
    upstream_request,
)
from router.dataplane.flow import PEER_BACKPRESSURE
from router.dataplane.upstream import UpstreamConnection, UpstreamPool
from router.log_tally import LogTally
from router.policy import Candidate, Decision
from router.workers import FAIL_OVER_AFTER_FAILED_CHECKS, Worker

if TYPE_CHECKING:
    from router.dataplane.server import ClientConnection, DataPlane
    from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

# The request metrics' labels, made once instead of a string per request (and its hash per
# count): the generation routes a `WorkerRelay` answers, and every status code.
_ROUTE_LABELS: Final = {route: route.decode("latin-1") for route in GENERATION_ROUTES}
_STATUS_LABELS: Final = {status: str(status) for status in range(100, 600)}


def route_label(head: RequestHead | None) -> str:
    """The `route` label of a request the data plane refuses itself: its generation route, or
    `other` (its head did not parse, or another path: the label set stays bounded)."""
    return "other" if head is None else _ROUTE_LABELS.get(head.path, "other")


def count_refused(metrics: RouterMetrics, head: RequestHead | None, status: int) -> None:
    """A request the router answered itself, with no worker: in kvrouter_requests_total as
    `worker="none"`, as every 4xx and 5xx of the router's own is."""
    metrics.requests[route_label(head), "none", _STATUS_LABELS[status]] += 1


def _worker_label(worker: Worker) -> str:
    """The `worker` label of an answer or failed attempt of `worker`'s: its URL, or `removed`
    once it left the registry. Its series went then (`RouterMetrics.forget_worker`), and a
    request still in flight to it, counted under its URL, would bring them back for good."""
    return "removed" if worker.state == "removed" else worker.url


_NO_FAILURE: Final[tuple[Failure | None, str]] = (None, "no routable worker")
# The most often one worker's failed attempts are said (`WorkerRelay._say_failed`): a worker
# failing every request wrote a line an attempt, 2,965 for 1,000 requests.
FAILURE_LOG_EVERY_S: Final = 60.0


class WorkerLookup(Protocol):
    def get(self, url: str) -> Worker | None: ...


class Relay:
    __slots__ = ("body", "client", "conn", "done", "events", "head", "plan")

    def __init__(self, client: ClientConnection, head: RequestHead, body: bytes) -> None:
        self.client = client
        self.head = head
        self.body = body
        self.conn: UpstreamConnection | None = None
        self.plan: ResponsePlan | None = None
        self.done = False
        # A streamed SSE answer's whole events (None for any other answer): a cut sends an
        # error event after them.
        self.events: WholeEvents | None = None

    # -- what subclasses decide ------------------------------------------------------------

    def accept_head(self, status: int) -> bool:
        """False: the head is a failure of the worker, and the relay moved on."""
        return True

    def route_headers(self) -> bytes:
        """Field lines added to the answer (each ending with a CRLF): the CORS policy's, for
        a page's request on a browser route (`cors`)."""
        cors = self.client.cors
        return b"" if cors is None else cors_lines(cors.fields(self.head))

    def settle(self, outcome: str) -> None:
        """The exchange ended ("ok", "cut" or "gone"): release what it held."""

    # -- ResponseSink ----------------------------------------------------------------------

    def upstream_head(self, answer: ResponseHead) -> None:
        if not self.accept_head(answer.status):
            return
        client, head = self.client, self.head
        plan = plan_response(
            answer,
            client_11=head.http_11,
            client_keep_alive=client.keep_alive(head),
            route_headers=self.route_headers(),
        )
        self.plan = plan
        # Streamed (no length: a cut's error event has a place) and SSE. The type is read
        # only then, not for an answer with a length (most JSON ones).
        framing = plan.framing
        if (framing is Framing.CHUNKED or framing is Framing.CLOSE) and answer.sse:
            self.events = WholeEvents(bytearray())
        client.hold(plan.head)
        if client.write_paused and self.conn is not None:
            # The client's buffer went over its mark while the answer before this one ended
            # (asyncio says so once): this answer waits for it as a paused one would.
            self.conn.hold_reading(True)

    def upstream_body(self, data: bytes) -> None:
        plan = self.plan
        if plan is None or not data:
            return
        events = self.events
        if events is not None:
            data = events.take(data)
            if not data:
                return
        self.client.hold(chunk(data) if plan.framing is Framing.CHUNKED else data)

    def upstream_end(self) -> None:
        plan = self.plan
        assert plan is not None
        self.conn = None
        if self.events is not None and (rest := self.events.rest()):
            self.client.hold(chunk(rest) if plan.framing is Framing.CHUNKED else rest)
        if plan.framing is Framing.CHUNKED:
            self.client.hold(LAST_CHUNK)
        self._end("ok")
        self.client.exchange_done(plan.keep_alive)

    def upstream_cut(self, reason: str) -> None:
        plan = self.plan
        assert plan is not None
        self.conn = None
        log.warning("%s: the answer broke after its first byte: %s", self.describe(), reason)
        self.client.write(self._cut_tail(plan, f"the worker's stream broke: {reason}"))
        self._end("cut")
        self.client.cut()

    def shut_down(self) -> None:
        """The replica stops (its drain ran out) with this answer begun: the worker's request
        is dropped, and the client gets what a stream its worker cut gets (`cut_tail`), so
        that an answer cut here never looks complete either (over HTTP/1.0 the close alone
        reads as its end). Its outcome is counted as the client's connection closes
        (`client_gone`), as before."""
        plan = self.plan
        assert plan is not None
        if self.conn is not None:
            self.conn.abort()  # the pools' close would report it to this relay as a cut
            self.conn = None
        message = "the router shut down before the answer ended: send the request again"
        self.client.write(self._cut_tail(plan, message, "service_unavailable"))

    def _cut_tail(
        self, plan: ResponsePlan, message: str, error_type: str = "upstream_error"
    ) -> bytes:
        # The event the stream broke off in was held, and goes with it.
        events = self.events
        inside = events is not None and events.inside_event
        return cut_tail(plan.framing, events is not None, message, inside, error_type)

    def upstream_read(self) -> None:
        self.client.flush()

    def upstream_paused(self, paused: bool) -> None:
        gate = self.client.gate
        if gate is not None:
            if paused:
                gate.pause(PEER_BACKPRESSURE)
            else:
                gate.resume(PEER_BACKPRESSURE)

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        raise NotImplementedError

    # -- from the client connection --------------------------------------------------------

    def client_paused(self, paused: bool) -> None:
        if self.conn is not None:
            self.conn.hold_reading(paused)

    def client_gone(self) -> None:
        """The client left: the upstream request is dropped at once (the worker stops)."""
        if self.done:
            return
        if self.conn is not None:
            self.conn.abort()
            self.conn = None
        self._end("gone")

    def describe(self) -> str:
        return self.head.path.decode("latin-1")

    def _end(self, outcome: str) -> None:
        if not self.done:
            self.done = True
            self.upstream_paused(False)  # see `_let_go`
            self.settle(outcome)

    def _let_go(self) -> None:
        """The attempt's connection is done with: its full write buffer no longer holds the
        client back (asyncio tells a connection it has drained only while it lives, and a worker
        that answered without reading the whole request never drains it)."""
        self.conn = None
        self.upstream_paused(False)


class WorkerRelay(Relay):
    __slots__ = (
        "_every_open",
        "_held",
        "_in_hand",
        "_last_failure",
        "_next_pair",
        "_passed_over",
        "_probe",
        "_retried",
        "_verdict",
        "attempts",
        "decision",
        "plane",
        "pool",
        "rank",
        "route",
        "worker",
    )

    def __init__(
        self,
        plane: DataPlane,
        client: ClientConnection,
        head: RequestHead,
        body: bytes,
        decision: Decision,
    ) -> None:
        super().__init__(client, head, body)
        self.plane = plane
        self.decision = decision
        self.route = _ROUTE_LABELS.get(head.path) or head.path.decode("latin-1")
        # When every candidate's breaker is open, requests go out anyway: refusing all
        # traffic is worse than trying a worker that may have recovered. None until a breaker
        # refuses (`start`): most requests meet a closed one first and never need it.
        self._every_open: bool | None = None
        self._next_pair = 0  # in decision.ranked
        self.attempts = 0
        self.rank: RankId | None = None  # of the attempt in progress
        self.worker: Worker | None = None
        self.pool: UpstreamPool | None = None
        self._retried = False  # the one safe retry on a dead reused connection
        self._verdict = False  # the breaker heard about this attempt
        self._probe = 0  # the ticket of the breaker's probe this attempt holds (0: none)
        self._last_failure: tuple[Failure | None, str] = _NO_FAILURE
        # The connection a 5xx head came on while `start` looks for another rank: dropped if
        # one is tried, relayed if none is left (`_failed_status`).
        self._in_hand: UpstreamConnection | None = None
        # A 5xx that may be the request's doing, its worker and the probe ticket its attempt
        # held, while the request's outcome says whose it was (`_settle_held`).
        self._held: tuple[Worker, int] | None = None
        # Workers whose other ranks this request skips (None until one is): an attempt on
        # one of its ranks failed in a way that is the worker's (`FailureRule.whole_worker`).
        self._passed_over: set[str] | None = None

    def start(self) -> None:
        plane = self.plane
        ranked = self.decision.ranked
        while self._next_pair < len(ranked) and self.attempts < plane.limits.max_attempts:
            rank = ranked[self._next_pair].rank
            self._next_pair += 1
            worker = plane.workers.get(rank.worker_url)
            passed_over = self._passed_over
            if worker is None or (passed_over is not None and rank.worker_url in passed_over):
                continue
            every_open = self._every_open
            if not every_open and not worker.breaker.allow():
                if every_open is None:
                    # Read at the first refusal as it read before the first attempt: until an
                    # attempt goes out nothing is claimed (a refusing `allow` claims nothing),
                    # and one that went out was allowed, so its breaker was not open then.
                    every_open = self.attempts == 0 and _every_breaker_open(plane.workers, ranked)
                    self._every_open = every_open
                if not every_open:
                    continue
            if self._in_hand is not None:
                self._drop_in_hand()
            self.attempts += 1
            self.rank, self.worker, self._verdict = rank, worker, False
            # Sent anyway (every breaker open), it claimed nothing: a probe out is another's.
            self._probe = 0 if every_open else worker.breaker.probe
            plane.inflight.begin(rank)
            pool = self.pool = plane.pool_for(worker.url)
            pool.acquire(self)
            return
        self._settle_held(worker_at_fault=True)  # no other worker was left to ask
        if self._in_hand is not None:
            return  # no rank left: the 5xx answer in hand is relayed (`_failed_status`)
        self._give_up()

    def _give_up(self) -> None:
        """No rank left to try: the client gets the relay's own answer for the last failure."""
        plane = self.plane
        self.done = True
        failure, reason = self._last_failure
        if failure == "queue":
            # The last worker tried did not fail: it is busy with the streams this replica
            # holds open to it (`--upstream-connections-per-worker`). Overload, for the client
            # to retry, not a 502: a 504 would say a worker was too slow to answer, and none
            # was asked.
            refusal = Refusal(
                503,
                f"no connection to a worker came free in time ({self.attempts} attempt(s)): "
                f"{reason}; retry later",
                type="service_unavailable",
                extra=RETRY_SOON,
            )
        else:
            refusal = Refusal(
                502,
                f"no worker answered ({self.attempts} attempt(s)): {reason}",
                type="upstream_unavailable",
            )
        count_refused(plane.metrics, self.head, refusal.status)
        self.client.refuse(refusal)

    # -- Acquirer --------------------------------------------------------------------------

    def connection_ready(self, conn: UpstreamConnection) -> None:
        pool, worker, rank = self.pool, self.worker, self.rank
        assert pool is not None and worker is not None and rank is not None
        if self.done:
            pool.release(conn, keep=True)
            return
        self.conn = conn
        extra = [(b"X-Data-Parallel-Rank", b"%d" % rank.dp_rank)] if worker.dp_size > 1 else None
        request = upstream_request(self.head, len(self.body), pool.host_header, extra)
        conn.send(self, self.head.method, request, self.body, self.plane.limits.head_timeout_s)
        if self.attempts == 1 and not self._retried:  # once a request: the router's own time
            self.plane.metrics.added_seconds.observe(perf_counter() - self.client.turn_started)

    def connection_failed(self, failure: Failure, detail: str) -> None:
        self.upstream_failed(failure, detail)

    # -- ResponseSink ----------------------------------------------------------------------

    def accept_head(self, status: int) -> bool:
        worker = self.worker
        assert worker is not None
        if status >= 500:
            return self._failed_status(status)
        # Another worker served the request that the held 5xx failed: that one was its
        # worker's. A 4xx says the request is at fault, there as here.
        self._settle_held(worker_at_fault=status < 400)
        if status >= 400:
            worker.breaker.release(self._probe)  # a client error says nothing of the worker
            self.decision.refused()  # nor does it cache the prompt
        else:
            worker.breaker.record_success()
            if self._next_pair > 1 and self.rank is not None:  # failed over: tell the policy
                self.decision.served(self.rank)
        self._verdict = True
        label = _STATUS_LABELS.get(status) or str(status)
        self.plane.metrics.requests[self.route, _worker_label(worker), label] += 1
        return True

    def route_headers(self) -> bytes:
        plane = self.plane
        # Inline, not the base's: one attribute read a request when no CORS is set.
        fields = b"" if plane.cors is None else cors_lines(plane.cors.fields(self.head))
        if not plane.expose_route_headers or self.worker is None or self.rank is None:
            return fields
        return fields + b"X-Kvrouter-Worker: %b\r\nX-Kvrouter-Dp-Rank: %d\r\n" % (
            self.worker.url.encode("latin-1"),
            self.rank.dp_rank,
        )

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        self._let_go()
        if self.done:
            return
        rank, pool = self.rank, self.pool
        assert rank is not None and pool is not None
        plane = self.plane
        if FAILURES[failure].same_worker and not self._retried:
            # The worker closed an idle connection as we wrote into it (`classify_lost`): it
            # never saw the request. Once, on a fresh connection, and no one counts it.
            self._retried = True
            plane.stats.safe_retries += 1
            pool.acquire(self, fresh=True)
            return
        if failure == "stale":
            failure = "lost"  # a second dead connection in a row is the worker's
        self._count_failure(failure, detail)
        if FAILURES[failure].whole_worker:
            self._pass_over(pool.url)
        if failure != "queue":  # the pool says so, for every request that waited in vain
            left = self._ranks_left()
            self._say_failed(
                rank.worker_url,
                "%s %s failed before the first byte (%s); %s",
                self.route,
                rank,
                detail,
                "failing over"
                if left and self.attempts < plane.limits.max_attempts
                else "no rank left",
            )
        plane.inflight.end(rank)
        self.rank = None
        self.start()

    def _failed_status(self, status: int) -> bool:
        """A 5xx head: a failure of the worker, failed over before its first byte is relayed;
        but when no rank is left to try, the worker's own answer is the one relayed (True),
        counted under its own status: a 503's `Retry-After` and body say more to the client
        than a 502 of the relay's own would. One that may be the request's doing is held from
        the breaker (the module's opening), and relayed at once when it is the second."""
        rank, conn, worker = self.rank, self.conn, self.worker
        assert conn is not None and worker is not None
        detail = f"status {status}"
        # The rule `upstream_failed` reads for every other failure (a second held 500 ends it).
        if FAILURES["status"].whole_worker:
            self._pass_over(worker.url)
        if status in WORKER_UNAVAILABLE:
            self._count_failure("status", detail)
        elif self._held is None:
            self._held = (worker, self._probe)
            self._verdict = True  # the held attempt's probe is settled with it
            self._note_failure("status", detail)
        else:
            self._settle_held(worker_at_fault=False)
            worker.breaker.release(self._probe)  # nor is it this worker's
            self._verdict = True
            self._note_failure("status", detail)
            self._say_failed(
                worker.url,
                "%s %s answered %d, as another worker did to the same request: taken as the "
                "request's doing, relayed to the client and counted by neither breaker",
                self.route,
                rank,
                status,
            )
            return self._relay_failed(status)
        self._in_hand = conn
        self.start()  # drops the connection in hand if it tries another rank
        if self._in_hand is None:
            self._say_failed(
                worker.url,
                "%s %s answered %d before the first byte; failing over",
                self.route,
                rank,
                status,
            )
            return False
        self._in_hand = None
        self._say_failed(
            worker.url,
            "%s %s answered %d and no rank is left to try: relayed to the client as it is",
            self.route,
            rank,
            status,
        )
        return self._relay_failed(status)

    def _say_failed(self, url: str, message: str, *args: object) -> None:
        """An attempt on the worker `url` failed: said at most every `FAILURE_LOG_EVERY_S`
        for that worker, with how many of its failures there were since."""
        tally = self.plane.failure_warnings.get(url)
        if tally is None:
            tally = self.plane.failure_warnings[url] = LogTally(FAILURE_LOG_EVERY_S)
        said = tally.count(perf_counter())
        if said:
            log.warning(
                message + " (%d failed attempt(s) on this worker since its last such line, "
                "said at most every %g s; kvrouter_upstream_failures_total counts them all)",
                *args,
                said,
                FAILURE_LOG_EVERY_S,
            )

    def _relay_failed(self, status: int) -> bool:
        """The worker's 5xx answer is the client's: counted under its own status."""
        worker = self.worker
        assert worker is not None
        label = _STATUS_LABELS.get(status) or str(status)
        self.plane.metrics.requests[self.route, _worker_label(worker), label] += 1
        return True

    def _count_failure(self, failure: Failure, detail: str) -> None:
        """The attempt failed before its first byte: its breaker hears (unless the failure is
        not the worker's, `exchange.FAILURES`), and the failure is noted."""
        worker = self.worker
        assert worker is not None
        if FAILURES[failure].breaker:
            worker.breaker.record_failure()
        else:
            worker.breaker.release(self._probe)  # a probe that ended without a verdict
        self._verdict = True
        self._note_failure(failure, detail)

    def _note_failure(self, failure: Failure, detail: str) -> None:
        """The failure is counted, and remembered for the answer given if no rank is left."""
        worker = self.worker
        assert worker is not None
        self.plane.metrics.upstream_failures[_worker_label(worker), failure] += 1
        self._last_failure = (failure, f"{failure}: {detail}")

    def _settle_held(self, worker_at_fault: bool) -> None:
        """The request's outcome says whose the held 5xx was: its worker's breaker counts it,
        or hears nothing of it (the probe its attempt held, if any, is given back)."""
        held, self._held = self._held, None
        if held is None:
            return
        worker, probe = held
        if worker_at_fault:
            worker.breaker.record_failure()
        else:
            worker.breaker.release(probe)

    def _ranks_left(self) -> int:
        """The ranked ranks not tried yet, those of the workers passed over left out."""
        rest = self.decision.ranked[self._next_pair :]
        passed_over = self._passed_over
        if not passed_over:
            return len(rest)
        return sum(c.rank.worker_url not in passed_over for c in rest)

    def _pass_over(self, url: str) -> None:
        if self._passed_over is None:
            self._passed_over = set()
        self._passed_over.add(url)

    def _drop_in_hand(self) -> None:
        """Another rank is tried: the 5xx answer in hand goes, with its connection."""
        conn, self._in_hand = self._in_hand, None
        assert conn is not None and self.rank is not None
        conn.discard()
        self._let_go()
        self.plane.inflight.end(self.rank)
        self.rank = None

    def turn_away(self, detail: str) -> None:
        """The replica stops (its drain ended) while this request still waits for a
        connection to a worker: never sent, it gets the 503 with `Retry-After` a wait that
        ran out gets (counted the same), for the client to retry elsewhere, not a connection
        closed without an answer; no other rank is tried."""
        rank = self.rank
        assert rank is not None and self.conn is None
        self._settle_held(worker_at_fault=False)  # whose it was, no other worker said
        self._count_failure("queue", detail)
        self.plane.inflight.end(rank)
        self.rank = None
        self._give_up()

    def worker_gone(self, why: Literal["worker_down", "removed"]) -> None:
        """Health declared the worker down (`worker_down`), or it left the registry
        (`removed`), while this request waited for its head or for a connection."""
        if self.conn is not None:
            self.conn.abort()
        elif self.pool is not None:
            self.pool.cancel(self)
        if why == "removed":
            detail = "the worker was removed from the registry before it answered"
        else:
            detail = (
                f"its health checks failed {FAIL_OVER_AFTER_FAILED_CHECKS} times in a row "
                "before it answered"
            )
        self.upstream_failed(why, detail)

    def settle(self, outcome: str) -> None:
        if outcome == "gone":
            self._settle_held(worker_at_fault=False)  # left before another worker answered
        rank, worker = self.rank, self.worker
        if rank is None or worker is None:
            return
        self.plane.inflight.end(rank)
        self.rank = None
        if outcome == "gone":
            if self.pool is not None and self.conn is None:
                self.pool.cancel(self)
            if not self._verdict:
                worker.breaker.release(self._probe)  # a probe that ended without a verdict
        if outcome != "ok":
            self.plane.stats.ended[outcome] += 1

    def describe(self) -> str:
        return f"{self.route} {self.rank}"


class ControlRelay(Relay):
    """A request for the control app, over the client connection's in-process link."""

    __slots__ = ("_retried",)

    def __init__(self, client: ClientConnection, head: RequestHead, body: bytes) -> None:
        super().__init__(client, head, body)
        self._retried = False

    def start(self) -> None:
        conn = self.client.control_link()
        self.conn = conn
        host = self.head.header(b"host") or b"localhost"
        request = upstream_request(self.head, len(self.body), host, to_worker=False)
        conn.send(
            self, self.head.method, request, self.body, self.client.plane.limits.head_timeout_s
        )

    def upstream_failed(self, failure: Failure, detail: str) -> None:
        self._let_go()
        if self.done:
            return
        if failure == "stale" and not self._retried:
            self._retried = True  # the control app closed the idle link as we wrote into it
            self.start()
            return
        self.done = True
        self.client.refuse(
            Refusal(502, f"the control plane did not answer: {detail}", type="internal_error")
        )


def _every_breaker_open(workers: WorkerLookup, ranked: Sequence[Candidate]) -> bool:
    """Whether the breaker of every known candidate's worker is open (True for none): a loop
    that stops at the first closed one, run on every request."""
    for c in ranked:
        worker = workers.get(c.rank.worker_url)
        if worker is not None and not worker.breaker.is_open():
            return False
    return True
