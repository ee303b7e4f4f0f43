"""The control plane: health, metrics, the worker admin API, the peer snapshot API, models.

An aiohttp application over a started `Replica` (`router.replica`). Nothing here is on the
request path of a completion; these routes read the replica's parts or send them messages.
Errors are JSON answers in the OpenAI error shape: a malformed call is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from peer.producer import serve_snapshot
from router.replica import Replica, ServeConfig, start_replica, stop_replica

log = logging.getLogger(__name__)

REPLICA: web.AppKey[Replica] = web.AppKey("replica", Replica)


def add_control_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers", _remove_worker)
    app.router.add_get("/internal/kv_snapshot", _kv_snapshot, allow_head=False)


def replica_lifecycle(config: ServeConfig):
    """An aiohttp cleanup context that starts the replica with the app and stops it after."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        replica = await start_replica(config)
        app[REPLICA] = replica
        yield
        await stop_replica(replica)

    return ctx


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
    session = replica.sessions[0]
    seen: dict[str, Any] = {}

    async def one(url: str) -> None:
        try:
            async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    for model in (await r.json()).get("data", []):
                        if isinstance(model, dict) and "id" in model:
                            seen.setdefault(model["id"], model)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            log.info("worker %s: /v1/models unreadable", url)

    await asyncio.gather(*(one(w.url) for w in replica.workers.routable()))
    return web.json_response({"object": "list", "data": list(seen.values())})


# -- health and metrics ------------------------------------------------------------------


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    if replica.draining:
        return web.json_response({"ready": False, "reason": "draining"}, status=503)
    if not replica.workers.routable():
        return web.json_response({"ready": False, "reason": "no healthy worker"}, status=503)
    if replica.ingest is not None and (trouble := replica.ingest.unhealthy) is not None:
        return web.json_response({"ready": False, "reason": trouble}, status=503)
    bootstrap = replica.bootstrap
    # Asked last: it latches at the first True, so a later scale-up never un-readies us.
    if bootstrap is not None and not bootstrap.admit_ready():
        tracker = bootstrap.tracker
        reason = "bootstrap pending" if not tracker.settled() else "seed gate closed"
        return web.json_response(
            {"ready": False, "reason": reason, "remaining_s": round(tracker.time_remaining(), 1)},
            status=503,
        )
    return web.json_response({"ready": True})


async def _metrics(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    return web.Response(
        body=generate_latest(replica.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


# -- worker admin ------------------------------------------------------------------------


def _authorized(request: web.Request) -> web.Response | None:
    token = request.app[REPLICA].config.internal_token
    if token and request.headers.get("Authorization") != f"Bearer {token}":
        return web.json_response({"error": {"message": "bearer token required"}}, status=401)
    return None


def _worker_view(replica: Replica, worker: Any) -> dict[str, Any]:
    rules = replica.pump.rules
    tree = rules.tree
    return {
        "url": worker.url,
        "state": worker.state,
        "reason": worker.reason,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "breaker": str(worker.breaker.state),
        "snapshot_served": worker.snapshot_served,
        "kv_events": msgspec.to_builtins(worker.kv) if worker.kv else None,
        "ranks": [
            {
                "dp_rank": rank.dp_rank,
                "cursor": rules.cursors.get(rank),
                "blocks": tree.block_count(rank) if tree is not None else 0,
                "inflight": replica.inflight[rank],
                "load": msgspec.to_builtins(replica.loads.get(worker.url, rank.dp_rank)),
            }
            for rank in worker.ranks()
        ],
    }


async def _list_workers(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    replica = request.app[REPLICA]
    return web.json_response(
        {"workers": [_worker_view(replica, w) for w in replica.workers.workers()]}
    )


async def _add_worker(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError:
        return bad_request(BadRequest("body is not valid JSON"))
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return bad_request(BadRequest("'url' must be an http(s) URL", "url"))
    replica = request.app[REPLICA]
    try:
        worker = await replica.workers.add(url)
    except ValueError as exc:
        return bad_request(BadRequest(str(exc), "url"))
    return web.json_response(_worker_view(replica, worker))


async def _kv_snapshot(request: web.Request) -> web.StreamResponse:
    if (denied := _authorized(request)) is not None:
        return denied
    producer = request.app[REPLICA].producer
    assert producer is not None, "the producer is created with the replica"
    return await serve_snapshot(producer, request)


async def _remove_worker(request: web.Request) -> web.Response:
    if (denied := _authorized(request)) is not None:
        return denied
    url = request.query.get("url")
    if not url:
        return bad_request(BadRequest("query parameter 'url' is required", "url"))
    removed = await request.app[REPLICA].workers.remove(url)
    if not removed:
        return web.json_response({"error": {"message": f"unknown worker {url}"}}, status=404)
    return web.json_response({"removed": url})
