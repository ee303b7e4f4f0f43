"""The control plane: health, metrics, the worker admin API, the peer snapshot API, models.

An aiohttp application over a started `Replica` (`router.replica`). Nothing here is on the
request path of a completion; these routes read the replica's parts or send them messages.
Errors are JSON answers in the OpenAI error shape: a malformed call is a 400 naming the field.
`/workers` and every path under `/internal/` are behind the bearer-token rule of
`router.auth` (`_guard`, in front of routing: an unregistered internal path or a wrong method
is refused for its token as a route is, never a 404 or 405 that names which exist);
`/readyz` is 503 while a critical background loop cannot be kept alive (`peer.supervise`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cachetree.ranks import RankId
from peer.origin import canonical_origin, host_of, worker_origin_problem
from peer.producer import serve_snapshot
from peer.supervise import describe
from router import auth, placement, siblings
from router.log_tally import LogTally
from router.replica import Replica
from router.workers import (
    WORKER_JSON_ERRORS,
    Refused,
    TooManyWorkers,
    WorkerRemoved,
    allow_list_refusal,
    get_worker_json,
    subscriber_name,
)

log = logging.getLogger(__name__)

REPLICA: web.AppKey[Replica] = web.AppKey("replica", Replica)
_MODELS_TIMEOUT: Final = aiohttp.ClientTimeout(total=2)  # each worker's, in a replica's own
# How long the replica's own /v1/models answer is reused while its workers stay the same.
MODELS_FRESH_S: Final = 1.0
# How long after its fetch began a kept answer is still served while it is fetched anew: a
# fetch takes at most `_MODELS_TIMEOUT`, so callers at least this often never wait for one.
MODELS_STALE_S: Final = 10.0
MODELS_KEYS: Final = 16  # the keyed listings kept at once, one per credential
MODELS_FETCHES: Final = 4  # keyed listings fetched from the workers at once
MODELS_LOG_EVERY_S: Final = 60.0  # a worker's unreadable /v1/models: warned of at most so often


@dataclass
class _Kept:
    answer: Any = None
    began: float = -math.inf  # when the fetch of `answer` began: never, while there is none
    fetch: asyncio.Future[tuple[float, Any]] | None = None  # the fetch in flight


class SharedListing:
    """Answers fetched once for every caller that asks while one is fetched or fresh.

    `/v1/models` needs no token of the router's (clients read it) and asks every worker:
    uncached, each call of a flood was one request to each worker. An answer is reused for
    `fresh_s` after its fetch began while the `key` it was fetched for stays the same; the
    next caller has it fetched anew, and until that fetch ends the last answer is served while
    it is younger than `stale_s` (then callers await the fetch, as they do while none was
    kept). A fetch that fails leaves the last answer kept. The answers of the last
    `most_keys` keys are kept, and at most `most_fetches` fetches run at once, the others
    waiting their turn: keys varying call by call cost at most that many fetches at a time."""

    def __init__(
        self,
        fresh_s: float = MODELS_FRESH_S,
        stale_s: float = MODELS_STALE_S,
        clock: Callable[[], float] = time.monotonic,
        most_keys: int = MODELS_KEYS,
        most_fetches: int = MODELS_FETCHES,
    ):
        self.fresh_s = fresh_s
        self.stale_s = stale_s
        self._clock = clock
        self._most_keys = most_keys
        self._turns = asyncio.Semaphore(most_fetches)
        self._kept: OrderedDict[object, _Kept] = OrderedDict()  # least recently asked first
        self.fetches = 0

    async def get(self, key: object, fetch: Callable[[], Awaitable[Any]]) -> Any:
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = _Kept()
            while len(self._kept) > self._most_keys:
                self._kept.popitem(last=False)
        self._kept.move_to_end(key)
        age = self._clock() - kept.began
        if age < self.fresh_s:
            return kept.answer
        if kept.fetch is None:
            self.fetches += 1
            kept.fetch = asyncio.ensure_future(self._in_turn(fetch))
            kept.fetch.add_done_callback(functools.partial(self._ended, kept))
        if age < self.stale_s:
            return kept.answer
        return (await asyncio.shield(kept.fetch))[1]

    async def _in_turn(self, fetch: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
        async with self._turns:
            # Its age counts from here: an answer fetched after a wait for its turn is as new.
            began = self._clock()
            return began, await fetch()

    @staticmethod
    def _ended(kept: _Kept, fetch: asyncio.Future[tuple[float, Any]]) -> None:
        kept.fetch = None
        if not fetch.cancelled() and fetch.exception() is None:
            kept.began, kept.answer = fetch.result()


# A worker's /v1/models as read: the models it lists, the status it refused the credential
# with (401 or 403), or None when it could not be read.
WorkerListing = list[dict[str, Any]] | int | None


@dataclass
class ModelListings:
    """The replica's own `/v1/models` answers for the routable workers: the one asked without
    a credential, in a slot of its own (a flood of made-up keys queued its refetch, and every
    caller, behind their fetches), and those asked with a caller's `Authorization`, one per
    credential (an answer read with one caller's credential is never another's)."""

    anonymous: SharedListing = field(
        default_factory=lambda: SharedListing(most_keys=1, most_fetches=1)
    )
    keyed: SharedListing = field(default_factory=SharedListing)
    clock: Callable[[], float] = time.monotonic
    _unreadable: dict[str, LogTally] = field(default_factory=dict)  # per worker: `_failed`

    async def answer(
        self, session: aiohttp.ClientSession, urls: tuple[str, ...], authorization: str | None
    ) -> tuple[int, dict[str, Any]]:
        """The status and body of `GET /v1/models` asked with `authorization` (`_merged`).

        Engines run with an API key (vLLM's and SGLang's `--api-key`) guard their /v1/models
        as their completions: the workers that refuse a read without a credential are asked
        with the caller's, as a completion relayed carries it. The others never see it: a
        worker that lists its models to anyone may be another team's engine."""
        anonymous = await self.anonymous.get(urls, lambda: self._read(session, urls, None))
        refused = tuple(url for url in urls if isinstance(anonymous[url], int))
        keyed: dict[str, WorkerListing] = {}
        if refused and authorization is not None:
            keyed = await self.keyed.get(
                (refused, authorization), lambda: self._read(session, refused, authorization)
            )
        # A worker's keyed read that failed otherwise than by a refusal keeps its refusal.
        read = [anonymous[url] if keyed.get(url) is None else keyed[url] for url in urls]
        return _merged(read, authorization)

    async def _read(
        self, session: aiohttp.ClientSession, urls: tuple[str, ...], authorization: str | None
    ) -> dict[str, WorkerListing]:
        """What each worker of `urls` lists at `/v1/models`, asked with `authorization`."""
        if authorization is None:  # every routable worker's read: the gone ones' tallies go
            for gone in self._unreadable.keys() - set(urls):
                del self._unreadable[gone]

        async def one(url: str) -> WorkerListing:
            try:
                listing = await get_worker_json(
                    session, f"{url}/v1/models", _MODELS_TIMEOUT, authorization
                )
                return _listed_models(listing)
            except WORKER_JSON_ERRORS as exc:  # a redirect included: never followed
                self._failed(url, exc)
                return exc.status if isinstance(exc, Refused) else None

        return dict(zip(urls, await asyncio.gather(*map(one, urls)), strict=True))

    def _failed(self, url: str, exc: Exception) -> None:
        """A refusal is said at debug: an engine run with `--api-key` refuses every read
        without its key, and every made-up one (a line each was a line per worker a second,
        or per call of a flood). Other failures are warned of at most once a
        `MODELS_LOG_EVERY_S` per worker, with how many since."""
        if isinstance(exc, Refused):
            log.debug("worker %s: /v1/models refused (HTTP %d)", url, exc.status)
        elif said := self._unreadable.setdefault(url, LogTally(MODELS_LOG_EVERY_S)).count(
            self.clock()
        ):
            log.warning(
                "worker %s: /v1/models unreadable %d time(s) since the last such warning (the "
                "latest: %s); it is left out of this replica's own /v1/models meanwhile",
                url,
                said,
                describe(exc),
            )


MODELS: web.AppKey[ModelListings] = web.AppKey("models", ModelListings)


def build_control_app(replica: Replica) -> web.Application:
    """The control app over a started replica (served through the data plane's hand-off)."""
    app = web.Application(
        client_max_size=replica.config.max_request_bytes,
        middlewares=[_guard, _openai_not_found],
    )
    app[REPLICA] = replica
    app[MODELS] = ModelListings()
    add_control_routes(app)
    return app


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers", _remove_worker)
    app.router.add_get("/internal/kv_snapshot", _kv_snapshot, allow_head=False)
    app.router.add_post(siblings.PATH, _decisions)
    app.router.add_post(placement.PATH, _place)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _openai_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An OpenAI-looking path the router does not serve (`/v1/embeddings`, a trailing slash,
    another case) is a 404 in the OpenAI error shape, as OpenAI clients read it, not
    aiohttp's plain text. It names the target as the client sent it: decoded,
    `/v1/%63ompletions` would read as a route the router serves."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        if not request.path.startswith("/v1/"):
            raise
        message = f"this router serves no {request.method} {request.raw_path[:200]}"
        return web.json_response(
            {"error": {"message": message, "type": "invalid_request_error", "param": None}},
            status=404,
        )


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The bearer-token rule (`router.auth`) in front of every guarded path, whether a route
    answers it or not."""
    if not auth.guarded(request.path):
        return await handler(request)
    token = request.app[REPLICA].config.internal_token
    denial = auth.check(token, request.headers.getall(hdrs.AUTHORIZATION, []))
    if denial is None:
        return await handler(request)
    refusals = request.app[REPLICA].metrics.auth_refusals
    refusals.refused(request.path, request.remote or "?", denial.status, denial.message)
    headers = {hdrs.WWW_AUTHENTICATE: auth.CHALLENGE} if denial.challenge else {}
    return web.json_response(
        {"error": {"message": denial.message, "type": "authentication_error"}},
        status=denial.status,
        headers=headers,
    )


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def bad_request(exc: BadRequest) -> web.Response:
    return web.json_response(
        {"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param}},
        status=400,
    )


async def _models(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    urls = tuple(w.url for w in replica.workers.routable())
    authorization = request.headers.get(hdrs.AUTHORIZATION)
    status, body = await request.app[MODELS].answer(replica.sessions[0], urls, authorization)
    headers = {hdrs.WWW_AUTHENTICATE: "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


def _merged(listings: list[WorkerListing], authorization: str | None) -> tuple[int, dict[str, Any]]:
    """The replica's answer from its workers' `listings`: every model listed, each once (the
    first worker's card), a worker that could not be read left out. When no worker listed its
    models and some refused the credential (401 or 403), their refusal instead (the others
    unreadable): an empty list read as "no model served" where a key would list them."""
    seen: dict[str, Any] = {}
    listed = False
    for listing in listings:
        if isinstance(listing, list):
            listed = True
            for model in listing:
                seen.setdefault(model["id"], model)
    refusals = [listing for listing in listings if isinstance(listing, int)]
    if listed or not refusals:
        return 200, {"object": "list", "data": list(seen.values())}
    unread = len(listings) - len(refusals)
    status = 401 if 401 in refusals else 403
    message = (
        f"every worker refused to list its models ({status})"
        + (f" or could not be read ({unread})" if unread else "")
        + ": "
        + ("send the engines' API key" if authorization is None else "check the API key")
        + " in an 'Authorization: Bearer' header"
    )
    return status, {"error": {"message": message, "type": "authentication_error", "param": None}}


def _listed_models(listing: Any) -> list[dict[str, Any]]:
    """The models a worker's /v1/models answer lists (objects with a string `id`); ValueError
    when `data` is no list. One worker's odd answer made the replica's own /v1/models a 500
    for every client."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise ValueError("no data list")
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


# -- health and metrics ------------------------------------------------------------------


def liveness(replica: Replica) -> tuple[int, dict[str, Any]]:
    """`/healthz`: 200 while the loop runs. (The data plane answers it with this too.)"""
    return 200, {"status": "ok"}


def readiness(replica: Replica) -> tuple[int, dict[str, Any]]:
    """`/readyz`: the status and body. (The data plane answers it with this too.)"""
    if replica.draining:
        return 503, {"ready": False, "reason": "draining"}
    if not replica.workers.routable():
        return 503, {"ready": False, "reason": "no healthy worker"}
    failing = [task for task in replica.supervisor.failing() if task.critical]
    if failing:
        return 503, {
            "ready": False,
            "reason": "background task failing: "
            + "; ".join(f"{task.name}: {task.error}" for task in failing),
        }
    if replica.ingest is not None and (trouble := replica.ingest.unhealthy) is not None:
        return 503, {"ready": False, "reason": trouble}
    # A first request's events published before its rank's subscription are never seen.
    if not replica.was_ready and (pending := replica.workers.subscribing()):
        return 503, {"ready": False, "reason": f"subscribing to {pending} rank(s)"}
    bootstrap = replica.bootstrap
    # Asked last: it latches at the first True, so a later scale-up never un-readies us.
    if bootstrap is not None and not bootstrap.admit_ready():
        tracker = bootstrap.tracker
        reason = "bootstrap pending" if not tracker.settled() else "seed gate closed"
        return 503, {
            "ready": False,
            "reason": reason,
            "remaining_s": round(tracker.time_remaining(), 1),
        }
    replica.was_ready = True
    return 200, {"ready": True}


async def _healthz(request: web.Request) -> web.Response:
    status, body = liveness(request.app[REPLICA])
    return web.json_response(body, status=status)


async def _readyz(request: web.Request) -> web.Response:
    status, body = readiness(request.app[REPLICA])
    return web.json_response(body, status=status)


async def _metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    return web.Response(
        body=generate_latest(replica.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


# -- worker admin ------------------------------------------------------------------------


def _worker_view(replica: Replica, worker: Any) -> dict[str, Any]:
    rules = replica.pump.rules
    tree = rules.tree
    return {
        "url": worker.url,
        "state": worker.state,
        "reason": worker.reason,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "breaker": worker.breaker.status,
        "snapshot_served": worker.snapshot_served,
        "engine": worker.engine,
        "kv_events": msgspec.to_builtins(worker.kv) if worker.kv else None,
        "ranks": [
            {
                "dp_rank": rank.dp_rank,
                "cursor": rules.cursors.get(rank),
                "blocks": tree.block_count(rank) if tree is not None else 0,
                "inflight": replica.inflight[rank],
                "subscriber": _subscriber_view(replica, rank),
                "load": msgspec.to_builtins(replica.loads.get(worker.url, rank.dp_rank)),
                # What the policy and the capacity check price: the last pool stated and
                # believed, kept while `load` (the latest read) goes stale or reads unknown.
                "capacity_tokens": replica.loads.capacity_tokens(worker.url, rank.dp_rank),
            }
            for rank in worker.ranks()
        ],
    }


def _subscriber_view(replica: Replica, rank: RankId) -> str | None:
    """None while the rank's subscriber runs untroubled (or there is none); else its trouble."""
    state = replica.supervisor.state(subscriber_name(rank))
    if state is None or not state.in_a_row:
        return None
    return f"restarted after {state.in_a_row} failure(s) in a row; last: {state.last_error}"


async def _list_workers(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    return web.json_response(
        {
            # False when the policy never reads the index (--kv-events): no cursors will move.
            "keeps_index": replica.config.keeps_index,
            "workers": [_worker_view(replica, w) for w in replica.workers.workers()],
        }
    )


async def _add_worker(request: web.Request) -> web.Response:
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        return bad_request(BadRequest("body is not valid JSON"))
    except RecursionError:  # msgspec's answer to nesting past Python's limit (~1,000 levels)
        return bad_request(BadRequest('body is JSON nested too deep: expected {"url": ...}'))
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str):
        return bad_request(BadRequest("'url' must be an http(s) origin (a string)", "url"))
    if (problem := worker_origin_problem(url)) is not None:
        return bad_request(BadRequest(f"'url' {url!r} is not a worker's origin: {problem}", "url"))
    replica = request.app[REPLICA]
    # The host the replica will connect to: `localhost` is checked as 127.0.0.1 (whatever
    # else it resolves to here), a mapped address as its IPv4 one.
    host = host_of(canonical_origin(url))
    if (refusal := await allow_list_refusal(replica.workers.allow, host)) is not None:
        log.warning("POST /workers %s refused: %s", url, refusal)
        return web.json_response(
            {"error": {"message": refusal, "type": "permission_error", "param": "url"}},
            status=403,
        )
    try:
        worker = await replica.workers.add(url)
    except ValueError as exc:
        return bad_request(BadRequest(str(exc), "url"))
    except (WorkerRemoved, TooManyWorkers) as exc:
        # A DELETE of it came first (what it started is stopped), or the registry is full.
        return web.json_response(
            {"error": {"message": str(exc), "type": "invalid_request_error", "param": "url"}},
            status=409,
        )
    view = _worker_view(replica, worker)
    if worker.state == "refused":
        # Listed (GET /workers says why), but not registered for traffic: a 200 read as
        # success by automation that checks the status.
        error = {"message": worker.reason, "type": "invalid_request_error", "param": "url"}
        return web.json_response({"error": error, "worker": view}, status=409)
    return web.json_response(view)


async def _kv_snapshot(request: web.Request) -> web.StreamResponse:
    producer = request.app[REPLICA].producer
    assert producer is not None, "the producer is created with the replica"
    return await serve_snapshot(producer, request)


async def _remove_worker(request: web.Request) -> web.Response:
    url = request.query.get("url")
    if not url:
        return bad_request(BadRequest("query parameter 'url' is required", "url"))
    removed = await request.app[REPLICA].workers.remove(url)
    if not removed:
        return _error(404, f"unknown worker {url}")
    return web.json_response({"removed": canonical_origin(url)})  # as it was listed


async def _decisions(request: web.Request) -> web.Response:
    """A sibling's routing decisions (`router.siblings`), adopted into cache_aware's ledger."""
    sharing = request.app[REPLICA].sharing
    if sharing is None:
        return _error(
            404,
            "decision sharing is off on this replica: it runs with --policy cache_aware, "
            "siblings (--peer or --kv-peer-selector) and --share-decisions",
        )
    body = await _bounded_body(request, siblings.MAX_BODY_BYTES, "a decision batch")
    if isinstance(body, web.Response):
        sharing.stats.refused += 1  # over the bound: refused as a malformed one is
        return body
    try:
        batch = sharing.decode(body)
    except ValueError as exc:
        return _error(400, f"decision batch refused: {exc}")
    for _ in sharing.adopt_steps(batch):
        await asyncio.sleep(0)  # the loop serves requests between chunks of the batch
    return web.Response(status=204)


async def _place(request: web.Request) -> web.Response:
    """A sibling's new prefix, placed by this replica (`router.placement`): the rank."""
    placer = request.app[REPLICA].placer
    if placer is None:
        return _error(
            404,
            "placement is off on this replica: it runs with --policy cache_aware (no "
            "--prefix-homes), siblings (--peer or --kv-peer-selector) and --share-decisions",
        )
    body = await _bounded_body(request, placement.MAX_BODY_BYTES, "a placement question")
    if isinstance(body, web.Response):
        return body
    try:
        answer = placer.place(body)
    except ValueError as exc:
        return _error(400, f"placement question refused: {exc}")
    if answer is None:
        return web.json_response(
            {"error": {"message": "no healthy worker to place on", "type": "service_unavailable"}},
            status=503,
        )
    return web.Response(body=answer, content_type=placement.CONTENT_TYPE)


async def _bounded_body(request: web.Request, limit: int, what: str) -> bytes | web.Response:
    """The body of a sibling's post, or the answer refusing it: no length given, or too long."""
    length = request.content_length
    if length is None:
        return _error(411, f"{what} needs a Content-Length")
    if length > limit:
        return _error(413, f"{what} is at most {limit} bytes")
    return await request.read()


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error"}}, status=status
    )
