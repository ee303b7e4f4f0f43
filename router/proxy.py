"""Forwarding a request to the ranked ranks, failing over before the first byte.

Rules:
- The body goes upstream unchanged; only routing headers are added (`X-Data-Parallel-Rank`
  for a worker with more than one rank). An SSE stream, or any answer of unknown or large
  size, is passed through chunk by chunk as it arrives, never buffered; a complete non-SSE
  answer with a Content-Length up to 16 MiB is relayed in one write (it costs a third of the
  CPU of chunked relaying, and the client sees the same bytes).
- A connection error, a timeout before the response head, or a 5xx head is a failure of that
  worker: its breaker counts it and the next rank in the decision's order is tried (at most
  `max_attempts` in all). Once the first byte has gone to the client nothing is retried.
- A 4xx (429 included) is the client's problem, not the worker's: it is passed through, never
  retried, and never counted by the breaker.
- Ranks whose breaker is open are skipped, unless every candidate's is: then requests go out
  anyway, because refusing all traffic is worse than trying a worker that may have recovered.
- The upstream client never advertises gzip: SSE must reach the client as the engine wrote it,
  and only the peer snapshot fetcher asks for compression.
- If the client goes away, the handler is cancelled and so is the upstream request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from cachetree.ranks import RankId
from router.metrics import RouterMetrics
from router.policy import Candidate
from router.workers import Worker, WorkerRegistry

log = logging.getLogger(__name__)

MAX_BUFFERED_BYTES = 16 * 1024 * 1024  # larger non-SSE answers are relayed in chunks

# Headers that describe one hop, not the message; never forwarded either way.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        "Accept-Encoding",
    )
)


def upstream_session(connect_timeout_s: float = 5.0, limit: int = 1024) -> aiohttp.ClientSession:
    """The proxy's client: keep-alive pool, no gzip advertised, no decompression."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        auto_decompress=False,
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )


class InflightTracker:
    """Requests this replica has sent to each rank and not yet finished."""

    def __init__(self) -> None:
        self.counts: Counter[RankId] = Counter()
        self.total = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __getitem__(self, rank: RankId) -> int:
        return self.counts[rank]

    def begin(self, rank: RankId) -> None:
        self.counts[rank] += 1
        self.total += 1
        self._idle.clear()

    def end(self, rank: RankId) -> None:
        self.counts[rank] -= 1
        self.total -= 1
        if not self.total:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight, False if `timeout_s` passed first."""
        if self._idle.is_set():
            return True  # wait_for(..., 0) would time out even on a set event
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


class Proxy:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        workers: WorkerRegistry,
        metrics: RouterMetrics,
        inflight: InflightTracker,
        *,
        max_attempts: int = 3,
        head_timeout_s: float = 300.0,
        expose_route_headers: bool = False,
    ) -> None:
        self._session = session
        self._workers = workers
        self._metrics = metrics
        self._inflight = inflight
        self._max_attempts = max(1, max_attempts)
        # sock_read bounds the wait for the response head and every gap in a stream.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_read=head_timeout_s)
        self._expose = expose_route_headers

    async def forward(
        self, request: web.Request, route: str, body: bytes, ranked: Sequence[Candidate]
    ) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        workers = [self._workers.get(c.rank.worker_url) for c in ranked]
        pairs = [(c.rank, w) for c, w in zip(ranked, workers, strict=True) if w is not None]
        every_breaker_open = all(w.breaker.is_open() for _, w in pairs)
        attempts = 0
        last_failure = "no routable worker"
        for rank, worker in pairs:
            if attempts >= self._max_attempts:
                break
            if not every_breaker_open and not worker.breaker.allow():
                continue
            attempts += 1
            upstream_headers = dict(headers)
            if worker.dp_size > 1:
                upstream_headers["X-Data-Parallel-Rank"] = str(rank.dp_rank)
            self._inflight.begin(rank)
            try:
                result = await self._attempt(request, route, body, rank, upstream_headers)
            finally:
                self._inflight.end(rank)
            if isinstance(result, web.StreamResponse):
                return result
            last_failure = result
            worker.breaker.record_failure()
            self._metrics.upstream_failures.labels(worker.url, result.split(":")[0]).inc()
            log.warning(
                "%s %s failed before the first byte (%s); failing over", route, rank, result
            )
        self._metrics.requests.labels(route, "none", "502").inc()
        return web.json_response(
            {
                "error": {
                    "message": f"no worker answered ({attempts} attempt(s)): {last_failure}",
                    "type": "upstream_unavailable",
                }
            },
            status=502,
        )

    async def _attempt(
        self, request: web.Request, route: str, body: bytes, rank: RankId, headers: dict[str, str]
    ) -> web.StreamResponse | str:
        """Relay one upstream exchange, or return why it failed before the first byte."""
        worker = self._workers.get(rank.worker_url)
        assert worker is not None
        try:
            upstream = await self._session.request(
                request.method,
                f"{worker.url}{route}",
                data=body,
                headers=headers,
                timeout=self._timeout,
            )
        except TimeoutError:
            return "timeout: no response head"
        except aiohttp.ClientError as exc:
            return f"connect: {type(exc).__name__}"
        async with upstream:
            if upstream.status >= 500:
                await upstream.read()
                return f"status: {upstream.status}"
            length = upstream.content_length
            if (
                length is not None
                and length <= MAX_BUFFERED_BYTES
                and not upstream.content_type.startswith("text/event-stream")
            ):
                # A complete, bounded, non-SSE answer: one write with a Content-Length costs
                # far less than chunked relaying, and nothing has reached the client yet.
                try:
                    payload = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    return f"body: {type(exc).__name__}"
                self._settle_breaker(worker, upstream.status)
                response = web.Response(
                    status=upstream.status, reason=upstream.reason, body=payload
                )
                self._copy_headers(upstream, response, worker.url, rank)
                self._metrics.requests.labels(route, worker.url, str(upstream.status)).inc()
                return response
            self._settle_breaker(worker, upstream.status)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            self._copy_headers(upstream, response, worker.url, rank)
            self._metrics.requests.labels(route, worker.url, str(upstream.status)).inc()
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                # After the first byte there is no failover; end the response where it broke.
                log.warning("%s %s: stream broke after the first byte: %s", route, rank, exc)
                return response
            await response.write_eof()
            return response

    @staticmethod
    def _settle_breaker(worker: Worker, status: int) -> None:
        if status >= 400:
            worker.breaker.release()  # a client error says nothing about the worker
        else:
            worker.breaker.record_success()

    def _copy_headers(
        self,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        worker_url: str,
        rank: RankId,
    ) -> None:
        for name, value in upstream.headers.items():
            if name.lower() not in HOP_BY_HOP:
                response.headers.add(name, value)
        if self._expose:
            response.headers["X-Kvrouter-Worker"] = worker_url
            response.headers["X-Kvrouter-Dp-Rank"] = str(rank.dp_rank)
