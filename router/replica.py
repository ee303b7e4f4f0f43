"""One router replica's long-lived parts, composed and started, and stopped again.

`start_replica` builds the pump, the worker registry, the load monitor, the policy, the
tokenizer, the metrics and, when siblings are known, the peer bootstrap and the EndpointSlice
watches; `stop_replica` stops them in the reverse order. The HTTP sides (the control plane in
`router.control`, the request path) only read these parts or send them messages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
import zmq.asyncio

from cachetree import accel
from peer.fetch import SnapshotFetcher
from peer.kubeconfig import kube_api_client, resolve_namespace
from peer.producer import SnapshotProducer
from peer.registry import PeerRegistry
from peer.slices import Extraction, Family, SelfIdentity, listen_family
from peer.tasks import cancel_and_wait
from peer.tracker import BootstrapTracker
from router.bootstrap import PeerBootstrap
from router.breaker import CircuitBreaker
from router.index import DEFAULT_INDEX_MAX_BLOCKS, IndexRules, Pump
from router.loads import LoadMonitor
from router.metrics import RouterMetrics
from router.policy import Policy, make_policy
from router.proxy import InflightTracker, Proxy, upstream_session
from router.subscriber import DEFAULT_MAX_MESSAGE_BYTES
from router.tokenize import RequestTokenizer, load_tokenizer
from router.workers import DiscoveryDefaults, WorkerRegistry
from router.zmq_term import terminate_context

if TYPE_CHECKING:
    from peer.endpointslices import SliceDiscovery

log = logging.getLogger(__name__)

_ZMQ_TERM_WITHIN_S = 2.0  # the subscribers close with linger 0: term has nothing to wait for


@dataclass(slots=True)
class ServeConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    workers: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    block_size: int | None = None
    tokenizer: str = "bytes"
    chat_rules: str = "vllm"  # whose chat rendering the tokenizer follows: vllm or sglang
    tokenize_cache_mb: float = 64.0  # bound of the chat segment tokenization cache
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
    kv_events_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    kv_index_max_blocks: int = DEFAULT_INDEX_MAX_BLOCKS

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


async def start_replica(config: ServeConfig) -> Replica:
    if accel.speedups is None and not accel.FORCED_PURE:  # `serve` logs the choice itself
        log.warning(
            "ingest accelerator: pure Python, %s; KV events cost about 1.4x the CPU of the "
            "compiled path. To build it, install with a C compiler and the Python headers "
            "(README, 'The compiled accelerator')",
            accel.REASON,
        )
    tokenizer = load_tokenizer(
        config.tokenizer, engine=config.chat_rules, cache_mb=config.tokenize_cache_mb
    )
    rng = random.Random(config.seed)
    policy = make_policy(config.policy, rng=rng)
    pump = Pump(IndexRules(max_blocks=config.kv_index_max_blocks))
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
        max_message_bytes=config.kv_events_max_message_bytes,
    )
    bootstrap = _bootstrap(config, pump, workers) if config.bootstrap_enabled else None
    workers.bootstrap = bootstrap
    metrics = RouterMetrics()
    metrics.watch(pump, workers, loads, bootstrap)
    metrics.watch_tokenizer(tokenizer)
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


async def stop_replica(replica: Replica) -> None:
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
