"""The aiohttp application: routes, composed from the replica's parts.

Nothing here decides anything on its own: requests are parsed and tokenized (`tokenize`),
keyed (`cachetree.keys`), scored (`policy`) and forwarded (`proxy`); workers come and go
through the registry; the pump owns the index. This module wires them and turns errors into
HTTP answers: a malformed request is a 400 naming the field, never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cachetree.keys import block_keys, namespace_seed
from peer.fetch import SnapshotFetcher
from peer.kubeconfig import kube_api_client, resolve_namespace
from peer.producer import SnapshotProducer, serve_snapshot
from peer.registry import PeerRegistry
from peer.slices import Extraction, Family, SelfIdentity, listen_family
from peer.tasks import cancel_and_wait
from peer.tracker import BootstrapTracker
from router.bootstrap import PeerBootstrap
from router.breaker import CircuitBreaker
from router.events import namespace_of
from router.index import IndexRules, Pump
from router.loads import LoadMonitor
from router.metrics import RouterMetrics
from router.policy import Candidate, Policy, Prompt, make_policy
from router.proxy import InflightTracker, Proxy, upstream_session
from router.tokenize import RequestTokenizer, load_tokenizer
from router.workers import DiscoveryDefaults, WorkerRegistry
from router.zmq_term import terminate_context

if TYPE_CHECKING:
    from peer.endpointslices import SliceDiscovery

log = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
_ZMQ_TERM_WITHIN_S = 2.0  # the subscribers close with linger 0: term has nothing to wait for


@dataclass(slots=True)
class ServeConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    workers: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    block_size: int | None = None
    tokenizer: str = "bytes"
    kv_events_port_base: int = 5557
    kv_events_replay_port_base: int = 0
    dp_size: int = 1
    load_interval_ms: int = 500
    health_interval_s: float = 2.0
    worker_evict_after_s: float = 30.0
    max_request_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    expose_route_headers: bool = False
    internal_token: str | None = None
    drain_timeout_s: float = 30.0
    seed: int | None = None
    peer: list[str] = field(default_factory=list)  # static sibling replicas
    kv_peer_selector: str | None = None  # EndpointSlice selector naming the siblings
    self_url: str | None = None  # this replica's own URL, never a candidate sibling
    worker_selector: str | None = None  # EndpointSlice selector naming the workers
    worker_port: int = 0  # the workers' port in their slices; 0: each slice's first port
    namespace: str | None = None  # of both watches; "" = all; None = the pod's own
    kube_api_server: str | None = None  # API server URL used without credentials
    kv_bootstrap_timeout_ms: int = 120_000
    kv_bootstrap_fetch_timeout_cap_ms: int = 300_000
    kv_bootstrap_seed_required: bool = False
    kv_bootstrap_max_body_mb: int = 1024

    @property
    def bootstrap_enabled(self) -> bool:
        return bool(self.peer or self.kv_peer_selector)


@dataclass(slots=True)
class Replica:
    """Every long-lived part of one router replica."""

    config: ServeConfig
    pump: Pump
    workers: WorkerRegistry
    loads: LoadMonitor
    policy: Policy
    tokenizer: RequestTokenizer
    proxy: Proxy
    metrics: RouterMetrics
    inflight: InflightTracker
    sessions: list[aiohttp.ClientSession]
    zmq_context: zmq.asyncio.Context  # the worker subscriptions' sockets; terminated on stop
    draining: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    producer: SnapshotProducer | None = None  # serves /internal/kv_snapshot
    bootstrap: PeerBootstrap | None = None  # peer snapshot bootstrap, when siblings are known
    discovery: SliceDiscovery | None = None  # EndpointSlice watches, when a selector is given


REPLICA: web.AppKey[Replica] = web.AppKey("replica", Replica)


def build_app(config: ServeConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_request_bytes)
    app.cleanup_ctx.append(_lifecycle(config))
    for route in GENERATION_ROUTES:
        app.router.add_post(route, _generation(route))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers", _remove_worker)
    app.router.add_get("/internal/kv_snapshot", _kv_snapshot, allow_head=False)
    return app


def _lifecycle(config: ServeConfig):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        replica = await _start_replica(config)
        app[REPLICA] = replica
        yield
        await _stop_replica(replica)

    return ctx


async def _start_replica(config: ServeConfig) -> Replica:
    tokenizer = load_tokenizer(config.tokenizer)
    rng = random.Random(config.seed)
    policy = make_policy(config.policy, rng=rng)
    pump = Pump(IndexRules())
    pump.start()
    # Only the peer snapshot fetcher may advertise gzip (the SSE proxy path must never get it).
    control_session = aiohttp.ClientSession(skip_auto_headers=("Accept-Encoding",))
    proxy_session = upstream_session()
    try:
        return await _compose(config, tokenizer, policy, pump, control_session, proxy_session)
    except BaseException:
        await pump.stop()
        await control_session.close()
        await proxy_session.close()
        raise


async def _compose(
    config: ServeConfig,
    tokenizer: RequestTokenizer,
    policy: Policy,
    pump: Pump,
    control_session: aiohttp.ClientSession,
    proxy_session: aiohttp.ClientSession,
) -> Replica:
    loads = LoadMonitor(control_session, interval_s=config.load_interval_ms / 1000)

    def breaker() -> CircuitBreaker:
        return CircuitBreaker(
            config.breaker_failure_threshold,
            config.breaker_cooldown_s,
            config.breaker_max_cooldown_s,
        )

    zmq_context = zmq.asyncio.Context()
    workers = WorkerRegistry(
        pump,
        control_session,
        loads,
        block_size=config.block_size,
        defaults=DiscoveryDefaults(
            port_base=config.kv_events_port_base,
            replay_port_base=config.kv_events_replay_port_base,
            dp_size=config.dp_size,
        ),
        breaker_factory=breaker,
        health_interval_s=config.health_interval_s,
        evict_after_s=config.worker_evict_after_s,
        zmq_context=zmq_context,
    )
    bootstrap = _bootstrap(config, pump, workers) if config.bootstrap_enabled else None
    workers.bootstrap = bootstrap
    metrics = RouterMetrics()
    metrics.watch(pump, workers, loads, bootstrap)
    inflight = InflightTracker()
    proxy = Proxy(
        proxy_session,
        workers,
        metrics,
        inflight,
        max_attempts=config.max_attempts,
        expose_route_headers=config.expose_route_headers,
    )
    settled = bootstrap.tracker.settled if bootstrap is not None else (lambda: True)
    # Last of the fallible steps: nothing has started yet if it cannot reach the API server.
    discovery = (
        await _discovery(config) if config.kv_peer_selector or config.worker_selector else None
    )
    replica = Replica(
        config,
        pump,
        workers,
        loads,
        policy,
        tokenizer,
        proxy,
        metrics,
        inflight,
        [control_session, proxy_session],
        zmq_context,
        producer=SnapshotProducer(pump.rules, settled=settled),
        bootstrap=bootstrap,
        discovery=discovery,
    )
    workers.start()
    if bootstrap is not None:
        bootstrap.start()
    if discovery is not None:
        _watch(config, discovery, workers, bootstrap)
        metrics.watch_discovery(discovery)
    replica.tasks.append(asyncio.create_task(loads.run(), name="kvrouter-loads"))
    for url in config.workers:
        await workers.add(url)
    return replica


def _bootstrap(config: ServeConfig, pump: Pump, workers: WorkerRegistry) -> PeerBootstrap:
    tracker = BootstrapTracker(
        config.kv_bootstrap_timeout_ms / 1000,
        config.kv_bootstrap_fetch_timeout_cap_ms / 1000,
        seed_required=config.kv_bootstrap_seed_required,
    )
    if config.peer:
        registry = PeerRegistry.static(config.peer, config.self_url)
    else:
        registry = PeerRegistry(config.self_url)  # synced by the EndpointSlice watch
    fetcher = SnapshotFetcher(
        max_body_bytes=config.kv_bootstrap_max_body_mb * 1024 * 1024,
        per_fetch_s=tracker.fetch_timeout_s,
        token=config.internal_token,
    )
    log.info(
        "peer bootstrap on: %d static sibling(s), timeout %.0f s, per fetch %.0f s",
        len(registry.peers),
        tracker.timeout_s,
        tracker.fetch_timeout_s,
    )
    return PeerBootstrap(pump, tracker, registry, fetcher, block_size=lambda: workers.block_size)


async def _discovery(config: ServeConfig) -> SliceDiscovery:
    # Imported here: kubernetes-asyncio takes seconds to import (see peer.kubeconfig).
    from peer.endpointslices import SliceDiscovery

    namespace, source = resolve_namespace(config.namespace, os.environ)
    log.info("EndpointSlice namespace %r (from %s; empty: all)", namespace, source)
    return SliceDiscovery(await kube_api_client(config.kube_api_server, os.environ), namespace)


def _watch(
    config: ServeConfig,
    discovery: SliceDiscovery,
    workers: WorkerRegistry,
    bootstrap: PeerBootstrap | None,
) -> None:
    if config.kv_peer_selector and bootstrap is not None:
        identity = SelfIdentity.from_env(os.environ)
        if not identity.known:
            log.warning(
                "neither POD_NAME nor POD_IP is set: this replica cannot tell itself from its "
                "siblings in the EndpointSlices; set both from the downward API"
            )
        rules = Extraction(listen_family(config.host), config.port, identity)
        discovery.start("siblings", config.kv_peer_selector, rules, bootstrap.registry.replace)
    if config.worker_selector:
        # Outbound connections to workers do not depend on the family we listen on.
        rules = Extraction(Family.ANY, config.worker_port or None)
        discovery.start("workers", config.worker_selector, rules, workers.discovered)


async def _stop_replica(replica: Replica) -> None:
    if replica.discovery is not None:
        await replica.discovery.close()
    if replica.bootstrap is not None:
        await replica.bootstrap.close()
    if replica.producer is not None:
        await replica.producer.aclose()
    await cancel_and_wait(replica.tasks)
    await replica.workers.close()
    await replica.pump.stop()
    # Every subscriber closed its sockets when its worker was removed, so this is quick;
    # left to the collector, term would run on whatever thread collects the context.
    await terminate_context(replica.zmq_context, within_s=_ZMQ_TERM_WITHIN_S, what="kvrouter")
    for session in replica.sessions:
        await session.close()


# -- client routes -----------------------------------------------------------------------


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _bad_request(exc: BadRequest) -> web.Response:
    return web.json_response(
        {"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param}},
        status=400,
    )


def _prompt_tokens(route: str, body: dict[str, Any], tokenizer: RequestTokenizer) -> list[int]:
    try:
        if route == "/v1/chat/completions":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list", "messages")
            return tokenizer.encode_chat(messages)
        if route == "/generate":
            if "input_ids" in body:
                return tokenizer.encode_prompt(_single(body["input_ids"], "input_ids"))
            if "text" in body:
                return tokenizer.encode_prompt(_single(body["text"], "text"))
            raise BadRequest("one of 'text' or 'input_ids' is required", "text")
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", "prompt")
        return tokenizer.encode_prompt(_single(body["prompt"], "prompt"))
    except ValueError as exc:
        raise BadRequest(str(exc), _param_of(route)) from None


def _single(prompt: Any, param: str) -> Any:
    """A prompt, or the first of a batch of prompts (they are routed together)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return prompt[0]
    if not isinstance(prompt, str | list):
        raise BadRequest(f"'{param}' must be a string or a list of token ids", param)
    return prompt


def _param_of(route: str) -> str:
    return {"/v1/chat/completions": "messages", "/generate": "text"}.get(route, "prompt")


def _generation(route: str):
    async def handle(request: web.Request) -> web.StreamResponse:
        replica = request.app[REPLICA]

        def answered_here(response: web.Response) -> web.Response:
            replica.metrics.requests.labels(route, "none", str(response.status)).inc()
            return response

        # A draining replica still serves what reaches it: /readyz already tells the load
        # balancer to stop sending, and refusing requests in the meantime would fail them.
        body_bytes = await request.read()
        try:
            body = msgspec.json.decode(body_bytes)
        except msgspec.DecodeError as exc:
            return answered_here(_bad_request(BadRequest(f"body is not valid JSON: {exc}")))
        if not isinstance(body, dict):
            return answered_here(_bad_request(BadRequest("body must be a JSON object")))
        try:
            tokens = _prompt_tokens(route, body, replica.tokenizer)
        except BadRequest as exc:
            return answered_here(_bad_request(exc))
        routable = replica.workers.routable()
        if not routable:
            replica.metrics.decisions.labels(replica.policy.name, "no_candidates").inc()
            return answered_here(
                web.json_response(
                    {"error": {"message": "no healthy worker to route to"}}, status=503
                )
            )
        candidates = [
            Candidate(rank, replica.inflight[rank], replica.loads.get(w.url, rank.dp_rank))
            for w in routable
            for rank in w.ranks()
        ]
        tree = replica.pump.rules.tree
        depths = None
        if tree is not None and replica.policy.name == "cache_aware":
            namespace = namespace_of(
                _str_or_none(body.get("lora_name")), _str_or_none(body.get("cache_salt"))
            )
            keys = block_keys(tokens, tree.block_size, namespace_seed(namespace))
            depths = tree.prefix_depths(keys)
        block_size = tree.block_size if tree is not None else 1
        decision = replica.policy.decide(candidates, Prompt(len(tokens), block_size, depths))
        replica.metrics.decisions.labels(replica.policy.name, decision.outcome).inc()
        replica.metrics.matched_blocks.observe(decision.matched_blocks)
        return await replica.proxy.forward(request, route, body_bytes, decision.ranked)

    return handle


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


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
        return _bad_request(BadRequest("body is not valid JSON"))
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return _bad_request(BadRequest("'url' must be an http(s) URL", "url"))
    replica = request.app[REPLICA]
    try:
        worker = await replica.workers.add(url)
    except ValueError as exc:
        return _bad_request(BadRequest(str(exc), "url"))
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
        return _bad_request(BadRequest("query parameter 'url' is required", "url"))
    removed = await request.app[REPLICA].workers.remove(url)
    if not removed:
        return web.json_response({"error": {"message": f"unknown worker {url}"}}, status=404)
    return web.json_response({"removed": url})
