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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import aiohttp
import zmq.asyncio

from cachetree import accel
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from peer.capacity import CapacityBlocks, overfull_ranks
from peer.fetch import SnapshotFetcher
from peer.kubeconfig import kube_api_client, resolve_namespace
from peer.origin import AllowList, origin_problem
from peer.producer import SnapshotProducer
from peer.registry import PeerRegistry
from peer.slice_view import Listing
from peer.slices import Extraction, Family, SelfIdentity, listen_family
from peer.spellings import Listener, machine_hosts, sort_out
from peer.supervise import Supervisor
from peer.tasks import cancel_and_wait
from peer.tracker import BootstrapTracker
from router import heap, socket_budget
from router.bootstrap import PeerBootstrap
from router.breaker import CircuitBreaker
from router.dataplane.inflight import InflightTracker
from router.dataplane.polling import PollClient
from router.dataplane.routing import DEFAULT_OFFLOAD_CHARS, INDEX_POLICIES
from router.homes import DEFAULT_MAX_HOMES, CacheAwareHome, HomeSettings, HomeTable
from router.index import DEFAULT_INDEX_MAX_BLOCKS, IndexRules, Pump
from router.ingest_pool import DEFAULT_INGEST_PROCESSES, DEFAULT_SILENCE_S, IngestPool
from router.loads import LoadMonitor
from router.metrics import RouterMetrics
from router.placement import DEFAULT_TIMEOUT_MS, Placement, Placer, own_url
from router.policy import CacheAware, Policy, make_policy
from router.pressure import DEFAULT_MAX_TRACKED_BLOCKS, PressureLedger, PressureSettings
from router.siblings import DecisionSharing
from router.socket_budget import SocketBudget
from router.subscriber import DEFAULT_MAX_MESSAGE_BYTES
from router.tokenize import RequestTokenizer, load_tokenizer
from router.workers import (
    DEFAULT_MAX_WORKERS,
    MODELS_REFRESH_S,
    DiscoveryDefaults,
    WorkerRegistry,
)
from router.zmq_term import terminate_context

if TYPE_CHECKING:
    from peer.endpointslices import SliceDiscovery

log = logging.getLogger(__name__)

AUTO_CHAT_RULES_START = "vllm"  # what --chat-rules auto renders by until a worker names its engine

CAPACITY_CHECK_S = 10.0  # how often the index's per-rank counts meet the engines' capacity
# A sibling's columnar snapshot costs ~37 B per (rank, block) pair (bench/bench_memory.py):
# by default its body may hold a full index (--kv-index-max-blocks) with room to spare.
SNAPSHOT_BODY_BYTES_PER_CARRIED_BLOCK: Final = 48
MIN_SNAPSHOT_BODY_BYTES: Final = 24 << 20

_ZMQ_TERM_WITHIN_S = 2.0  # the subscribers close with linger 0: term has nothing to wait for


@dataclass(slots=True)
class ServeConfig:
    host: str = "0.0.0.0"
    port: int = 8080
    workers: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    block_size: int | None = None
    tokenizer: str = "bytes"
    # Whose chat rendering the tokenizer follows: vllm, sglang, or auto (the engine the
    # workers' /v1/models name, vllm until one does).
    chat_rules: str = "auto"
    tokenize_cache_mb: float = 64.0  # bound of the chat segment tokenization cache
    # A longer prompt (a chat: body) is encoded off the event loop; 0: never.
    tokenize_offload_chars: int = DEFAULT_OFFLOAD_CHARS
    kv_events_port_base: int = 5557
    kv_events_replay_port_base: int = 0
    dp_size: int = 1
    load_interval_ms: int = 500
    health_interval_s: float = 2.0
    # The health loop reads the workers' /v1/models again this often (0: never).
    worker_models_refresh_s: float = MODELS_REFRESH_S
    max_workers: int = DEFAULT_MAX_WORKERS
    worker_evict_after_s: float = 30.0
    max_request_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    # The data plane's bounds (router.dataplane.server.Limits; one flag each).
    max_connections: int = 4096
    max_header_count: int = 100
    max_head_bytes: int = 64 * 1024
    client_header_timeout_s: float = 30.0
    client_body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 60.0
    upstream_connect_timeout_s: float = 5.0
    upstream_head_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 300.0
    client_write_timeout_s: float = 120.0
    upstream_idle_expiry_s: float = 4.0
    upstream_connections_per_worker: int = 256
    control_port: int = 0  # also serve the control app alone on this port; 0 = not
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 60.0
    expose_route_headers: bool = False
    # Origins whose pages may call the browser routes (router.dataplane.cors); "*": any.
    cors_allow_origin: list[str] = field(default_factory=list)
    # Never in a repr (a traceback's locals, a debug log of the config): a secret.
    internal_token: str | None = field(default=None, repr=False)
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
    kv_events_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    kv_index_max_blocks: int = DEFAULT_INDEX_MAX_BLOCKS
    kv_bootstrap_max_body_mb: int = 0  # 0: derived from kv_index_max_blocks (README "Memory")
    worker_snapshot_max_body_mb: int = 32
    worker_allow_cidr: list[str] = field(default_factory=list)  # for admin-added workers
    booking_ttl_ms: int = 5000
    demand_half_life_s: float = 30.0
    pressure_max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS
    share_decisions: bool = True  # cache_aware with siblings: post decisions to them
    # cache_aware with siblings: a new prefix waits this long for the placer's answer
    # (router.placement); 0 = never ask, decide alone.
    placement_timeout_ms: int = DEFAULT_TIMEOUT_MS
    prefix_homes: bool = False  # cache_aware: a home rank per prefix (router.homes)
    prefix_homes_max: int = DEFAULT_MAX_HOMES
    kv_ingest_processes: int = DEFAULT_INGEST_PROCESSES
    kv_ingest_silence_s: float = DEFAULT_SILENCE_S
    kv_events: str = "auto"  # on | off | auto: on for policies that read the index

    @property
    def keeps_index(self) -> bool:
        """Whether this replica subscribes to KV events and keeps the index: `--kv-events on`,
        or `auto` with a policy that reads it (cache_aware)."""
        return self.kv_events == "on" or (
            self.kv_events == "auto" and self.policy in INDEX_POLICIES
        )

    @property
    def bootstrap_enabled(self) -> bool:
        return bool(self.peer or self.kv_peer_selector) and self.keeps_index


@dataclass(slots=True)
class Replica:
    """Every long-lived part of one router replica."""

    config: ServeConfig
    pump: Pump
    workers: WorkerRegistry
    loads: LoadMonitor
    policy: Policy
    tokenizer: RequestTokenizer
    metrics: RouterMetrics
    inflight: InflightTracker
    sessions: list[aiohttp.ClientSession]
    zmq_context: zmq.asyncio.Context  # the worker subscriptions' sockets; terminated on stop
    supervisor: Supervisor  # every background loop runs under it (peer.supervise)
    socket_budget: SocketBudget
    draining: bool = False
    was_ready: bool = False  # /readyz answered 200 once: the first subscriptions are no gate
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    producer: SnapshotProducer | None = None  # serves /internal/kv_snapshot
    bootstrap: PeerBootstrap | None = None  # peer snapshot bootstrap, when siblings are known
    discovery: SliceDiscovery | None = None  # EndpointSlice watches, when a selector is given
    ingest: IngestPool | None = None  # ingest processes, with --kv-ingest-processes > 0
    sharing: DecisionSharing | None = None  # decisions to and from siblings (cache_aware)
    # The placement authority's rules (router.placement): with decision sharing, when
    # prefix homes are off. Its `own` URL is set once the data plane listens.
    placement: Placement | None = None
    placer: Placer | None = None  # answers POST /internal/place; set by the data plane


async def start_replica(config: ServeConfig) -> Replica:
    if accel.speedups is None and not accel.FORCED_PURE:  # `serve` logs the choice itself
        log.warning(
            "ingest accelerator: pure Python, %s; KV events cost about 1.4x the CPU of the "
            "compiled path. To build it, install with a C compiler and the Python headers "
            "(README, 'The compiled accelerator')",
            accel.REASON,
        )
    tokenizer = load_tokenizer(
        config.tokenizer,
        engine=AUTO_CHAT_RULES_START if config.chat_rules == "auto" else config.chat_rules,
        cache_mb=config.tokenize_cache_mb,
    )
    pump = Pump(IndexRules(max_blocks=config.kv_index_max_blocks))
    pump.start()
    # Only the peer snapshot fetcher may advertise gzip.
    control_session = aiohttp.ClientSession(skip_auto_headers=("Accept-Encoding",))
    try:
        return await _compose(config, tokenizer, pump, control_session)
    except BaseException:
        await pump.stop()
        await control_session.close()
        raise


async def _compose(
    config: ServeConfig,
    tokenizer: RequestTokenizer,
    pump: Pump,
    control_session: aiohttp.ClientSession,
) -> Replica:
    loads = LoadMonitor(
        PollClient(),
        interval_s=config.load_interval_ms / 1000,
        block_size=lambda: None if pump.rules.tree is None else pump.rules.tree.block_size,
    )

    def breaker(url: str) -> CircuitBreaker:
        return CircuitBreaker(
            config.breaker_failure_threshold,
            config.breaker_cooldown_s,
            config.breaker_max_cooldown_s,
            name=url,
        )

    zmq_context = zmq.asyncio.Context()
    budget = socket_budget.apply(zmq_context)  # before the context's first socket
    supervisor = Supervisor()
    ingest = None
    if not config.keeps_index and (config.peer or config.kv_peer_selector):
        why = (
            "--kv-events off"
            if config.kv_events == "off"
            else f"--policy {config.policy} does not read the index"
        )
        log.warning(
            "%s, so this replica subscribes to no KV events and keeps no index: peer "
            "bootstrap is off (--peer / --kv-peer-selector do nothing)",
            why,
        )
    if config.kv_ingest_processes and not config.keeps_index:
        log.warning(
            "--kv-ingest-processes %d is ignored: policy %s reads no KV events; drop the flag, "
            "or route with cache_aware",
            config.kv_ingest_processes,
            config.policy,
        )
    if config.kv_ingest_processes and config.keeps_index:
        ingest = IngestPool(
            config.kv_ingest_processes,
            pump.deliver,
            context=zmq_context,
            max_message_bytes=config.kv_events_max_message_bytes,
            silence_s=config.kv_ingest_silence_s,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
            applied=pump.rules.cursors.get,
            resumed=pump.rules.report_doubt,
        )
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
        supervisor=supervisor,
        max_ranks=budget.max_ranks,
        max_workers=config.max_workers,
        snapshot_max_body_bytes=config.worker_snapshot_max_body_mb * 1024 * 1024,
        subscribe=None if ingest is None else ingest.subscription,
        keeps_index=config.keeps_index,
        allow=AllowList.parse(config.worker_allow_cidr),
        models_refresh_s=config.worker_models_refresh_s,
    )
    capacity_blocks = engine_capacity_blocks(loads, pump)
    bootstrap = (
        _bootstrap(config, pump, workers, capacity_blocks) if config.bootstrap_enabled else None
    )
    workers.bootstrap = bootstrap
    if config.chat_rules == "auto":
        workers.on_engine = ChatRulesFollower(tokenizer).worker_engine
    policy = _policy(config, pump, bootstrap, capacity_blocks)
    sharing = _sharing(config, policy, bootstrap, workers, control_session)
    metrics = RouterMetrics()
    metrics.watch(pump, workers, loads, bootstrap)
    metrics.watch_tokenizer(tokenizer)
    metrics.watch_tasks(supervisor)
    if isinstance(policy, CacheAwareHome):
        metrics.watch_pressure(policy.inner, workers)
        metrics.watch_homes(policy.table)
        workers.on_ranks_left = policy.inner.forget_ranks
    elif isinstance(policy, CacheAware):
        metrics.watch_pressure(policy, workers)
        workers.on_ranks_left = policy.forget_ranks
    placement = None
    if sharing is not None:
        metrics.watch_sharing(sharing)
        if isinstance(policy, CacheAware) and bootstrap is not None:
            registry = bootstrap.registry
            placement = Placement(policy, None, lambda: registry.peers, known=workers.knows)
            metrics.watch_placement(placement)
    inflight = InflightTracker()
    settled = bootstrap.tracker.settled if bootstrap is not None else (lambda: True)
    # Last of the fallible steps: nothing has started yet if it cannot reach the API server.
    discovery = (
        await _discovery(config, supervisor)
        if config.kv_peer_selector or config.worker_selector
        else None
    )
    heap.configure()  # big buffers (exports, grafts) go back to the OS when freed
    replica = Replica(
        config,
        pump,
        workers,
        loads,
        policy,
        tokenizer,
        metrics,
        inflight,
        [control_session],
        zmq_context,
        supervisor,
        budget,
        producer=SnapshotProducer(
            pump.rules, settled=settled, hold_writer=pump.hold, release=heap.trim
        ),
        bootstrap=bootstrap,
        discovery=discovery,
        ingest=ingest,
        sharing=sharing,
        placement=placement,
    )
    if replica.producer is not None:
        metrics.watch_producer(replica.producer)
    if ingest is not None:
        metrics.watch_ingest(ingest)
        ingest.start()  # after the last fallible step: nothing to stop if one raised
    workers.start()
    if bootstrap is not None:
        bootstrap.start(supervisor)
    if discovery is not None:
        _watch(config, discovery, workers, bootstrap)
        metrics.watch_discovery(discovery)
    replica.tasks.append(supervisor.spawn("loads", "kvrouter-loads", loads.run))
    if sharing is not None:
        # Not critical: without it a replica routes as well as it did before sharing existed.
        replica.tasks.append(
            supervisor.spawn("sharing", "kvrouter-sharing", sharing.run, critical=False)
        )
    replica.tasks.append(
        supervisor.spawn(
            "capacity",
            "kvrouter-capacity",
            lambda: _capacity_loop(pump, workers, capacity_blocks, bootstrap),
        )
    )
    # At once, not in turn: each may wait out its timeouts (a worker whose endpoints stall),
    # and the replica listens only after, so a dozen slow workers kept even /healthz from
    # answering for 13 s. The first failure, if any, is raised once all have ended.
    added = await workers.add_listed(config.workers)
    for outcome in added:
        if isinstance(outcome, BaseException):
            raise outcome
    return replica


def _policy(
    config: ServeConfig,
    pump: Pump,
    bootstrap: PeerBootstrap | None,
    capacity_blocks: CapacityBlocks,
) -> Policy:
    """The routing policy. cache_aware reads the index, the engines' stated capacities, and
    how many sibling replicas share the traffic (the peer registry's count); with
    --prefix-homes it decides under a prefix home table (`router.homes`)."""
    if config.policy != "cache_aware":
        return make_policy(config.policy, rng=random.Random(config.seed))

    settings = PressureSettings(
        booking_ttl_s=config.booking_ttl_ms / 1000,
        demand_half_life_s=config.demand_half_life_s,
        max_tracked_blocks=config.pressure_max_tracked_blocks,
    )
    policy = make_policy(
        "cache_aware",
        rng=random.Random(config.seed),
        ledger=PressureLedger(settings),
        index=lambda: pump.rules.tree,
        capacity=capacity_blocks,
        replicas=lambda: 1 + (len(bootstrap.registry.peers) if bootstrap is not None else 0),
    )
    if not config.prefix_homes:
        return policy
    assert isinstance(policy, CacheAware)
    homes = HomeSettings(max_homes=config.prefix_homes_max)
    return CacheAwareHome(policy, HomeTable(homes, time.monotonic, time.time))


def _sharing(
    config: ServeConfig,
    policy: Policy,
    bootstrap: PeerBootstrap | None,
    workers: WorkerRegistry,
    session: aiohttp.ClientSession,
) -> DecisionSharing | None:
    """Decision sharing with the siblings (`router.siblings`): cache_aware, siblings known
    (which implies the internal token), and --share-decisions."""
    homes = policy if isinstance(policy, CacheAwareHome) else None
    if homes is not None:
        policy = homes.inner
    if not (
        isinstance(policy, CacheAware)
        and bootstrap is not None
        and config.share_decisions
        and config.internal_token
    ):
        return None
    registry = bootstrap.registry
    sharing = DecisionSharing(
        session,
        lambda: registry.peers,
        config.internal_token,
        policy.adopt,
        workers.knows,
        adopt_home=None if homes is None else homes.adopt,
    )
    policy.share = sharing.share
    if homes is not None:
        homes.share = sharing.share_home
    return sharing


def engine_capacity_blocks(loads: LoadMonitor, pump: Pump) -> CapacityBlocks:
    """Each rank's device KV capacity in blocks, as its engine reports it (SGLang
    `max_total_num_tokens`, vLLM `cache_config_info` `num_gpu_blocks`, read by the load
    monitor); None while unknown, or before the fleet's block size is known."""

    def capacity(rank: RankId) -> int | None:
        tree = pump.rules.tree
        if tree is None:
            return None
        return loads.capacity_blocks(rank.worker_url, rank.dp_rank, tree.block_size)

    return capacity


async def check_capacity_once(
    pump: Pump,
    workers: WorkerRegistry,
    capacity_blocks: CapacityBlocks,
    bootstrap: PeerBootstrap | None = None,
) -> list[tuple[RankId, int, int]]:
    """Clear and re-pull every ready rank whose index holds more device blocks than its
    engine can (`peer.capacity`); ranks still bootstrapping are the graft's business."""
    tree = pump.rules.tree
    if tree is None:
        return []
    ranks = [
        rank
        for worker in workers.workers()
        if worker.state == "ready"
        for rank in worker.ranks()
        if bootstrap is None or not bootstrap.tracker.is_pending(rank)
    ]
    over = overfull_ranks(ranks, lambda rank: tree.block_count(rank, DEVICE), capacity_blocks)
    for rank, blocks, capacity in over:
        why = f"{blocks} device blocks indexed, its engine reports room for {capacity}"
        await workers.distrust(rank, why)
    return over


async def _capacity_loop(
    pump: Pump,
    workers: WorkerRegistry,
    capacity_blocks: CapacityBlocks,
    bootstrap: PeerBootstrap | None,
) -> None:
    while True:
        await asyncio.sleep(CAPACITY_CHECK_S)
        await check_capacity_once(pump, workers, capacity_blocks, bootstrap)


def _static_siblings(config: ServeConfig) -> tuple[str, ...]:
    """--peer without this replica and without second spellings of one sibling
    (`peer.spellings`): each was asked for snapshots and sent decisions twice, and counted
    as one replica more in the cost."""
    pod_ip = os.environ.get("POD_IP") or None
    ports = frozenset(p for p in (config.port, config.control_port) if p)
    own = {url for port in ports if (url := own_url(config.self_url, config.host, port, pod_ip))}
    me = Listener(config.host, ports, frozenset(own))
    if me.guesses_itself:
        me = Listener(config.host, ports, me.own_urls, machine_hosts())
    result = sort_out(config.peer, me)
    for url, kept in result.duplicates:
        log.warning("--peer %s is %s spelled another way: asking that sibling once", url, kept)
    for url in result.guessed_self:
        log.warning(
            "--peer %s left out: it names this machine on this replica's port, and on --host "
            "%s with neither --self-url nor POD_IP that is taken for this replica itself; "
            "set --self-url to the URL its siblings list it by",
            url,
            config.host or "0.0.0.0",
        )
    return result.peers


def _bootstrap(
    config: ServeConfig, pump: Pump, workers: WorkerRegistry, capacity_blocks: CapacityBlocks
) -> PeerBootstrap:
    tracker = BootstrapTracker(
        config.kv_bootstrap_timeout_ms / 1000,
        config.kv_bootstrap_fetch_timeout_cap_ms / 1000,
        seed_required=config.kv_bootstrap_seed_required,
    )
    if config.peer:
        # A seeded replica asks its siblings in a reproducible order (tests, benches).
        rng = random.Random(config.seed) if config.seed is not None else None
        registry = PeerRegistry.static(_static_siblings(config), config.self_url, rng)
        siblings = f"{len(registry.peers)} static sibling(s)"
    else:
        registry = PeerRegistry(config.self_url)  # synced by the EndpointSlice watch
        # Named, not counted: none are known before the watch's first list ("0 static
        # siblings" read as a replica with none).
        namespace, _ = resolve_namespace(config.namespace, os.environ)
        siblings = f"siblings from the EndpointSlices matching {config.kv_peer_selector!r} " + (
            f"in namespace {namespace!r}" if namespace else "in every namespace"
        )
    fetcher = SnapshotFetcher(
        max_body_bytes=snapshot_body_bound(config),
        per_fetch_s=tracker.fetch_timeout_s,
        token=config.internal_token,
    )
    log.info(
        "peer bootstrap on: %s, timeout %.0f s, per fetch %.0f s",
        siblings,
        tracker.timeout_s,
        tracker.fetch_timeout_s,
    )
    return PeerBootstrap(
        pump,
        tracker,
        registry,
        fetcher,
        block_size=lambda: workers.block_size,
        capacity_blocks=capacity_blocks,
    )


async def _discovery(config: ServeConfig, supervisor: Supervisor) -> SliceDiscovery:
    # Imported here: kubernetes-asyncio takes seconds to import (see peer.kubeconfig).
    from peer.endpointslices import SliceDiscovery

    namespace, source = resolve_namespace(config.namespace, os.environ)
    log.info("EndpointSlice namespace %r (from %s; empty: all)", namespace, source)
    client = await kube_api_client(config.kube_api_server, os.environ)
    return SliceDiscovery(client, namespace, supervisor=supervisor)


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
        rules = Extraction(
            listen_family(config.host),
            config.port,
            identity,
            one_per_pod=True,
            control_port=config.control_port or None,
        )
        discovery.start("siblings", config.kv_peer_selector, rules, _reachable(bootstrap.registry))
    if config.worker_selector:
        # Outbound connections to workers do not depend on the family we listen on.
        rules = Extraction(
            Family.ANY, config.worker_port or None, keep_unready=True, exact_port=True
        )
        discovery.start(
            "workers",
            config.worker_selector,
            rules,
            lambda listing: workers.discovered(listing.urls, listing.unready),
        )


_MAX_NAMED_SIBLINGS: Final = 1024  # refused sibling URLs remembered as logged


def _reachable(registry: PeerRegistry) -> Callable[[Listing], None]:
    """The sibling watch's URLs into `registry`, less those no client of ours reaches
    (`peer.origin`; the API server takes an IPv4 address with leading zeros, which aiohttp
    refuses), each named in the log once (the watch calls this at every slice event): a
    joiner would wait out its bootstrap for it."""
    named: set[str] = set()

    def replace(listing: Listing) -> None:
        kept = []
        for url in listing.urls:
            if (problem := origin_problem(url)) is None:
                kept.append(url)
            elif url not in named and len(named) < _MAX_NAMED_SIBLINGS:
                named.add(url)
                log.warning("sibling %s in the EndpointSlices left out: %s", url, problem)
        registry.replace(kept)

    return replace


async def stop_replica(replica: Replica) -> None:
    if replica.discovery is not None:
        await replica.discovery.close()
    if replica.bootstrap is not None:
        await replica.bootstrap.close()
    if replica.producer is not None:
        await replica.producer.aclose()
    await cancel_and_wait(replica.tasks)
    replica.loads.close()
    await replica.workers.close()
    if replica.ingest is not None:
        await replica.ingest.close()
    await replica.pump.stop()
    # Every subscriber closed its sockets when its worker was removed, so this is quick;
    # left to the collector, term would run on whatever thread collects the context.
    await terminate_context(replica.zmq_context, within_s=_ZMQ_TERM_WITHIN_S, what="kvrouter")
    for session in replica.sessions:
        await session.close()


@dataclass(slots=True)
class ChatRulesFollower:
    """`--chat-rules auto`: render chats by the rules of the engine the workers run.

    The first worker whose `/v1/models` names its engine decides; a fleet is one engine in
    practice. A worker naming another one is logged (its chats may render unlike the engine
    would: set `--chat-rules`), never switched to, so routing does not flap between rules.
    """

    tokenizer: RequestTokenizer
    decided_by: str | None = None

    def worker_engine(self, worker_url: str, engine: str) -> None:
        if self.decided_by is None:
            self.decided_by = worker_url
            if engine != self.tokenizer.engine:
                self.tokenizer.follow_engine(engine)
            log.info("chat requests render by %s's rules (named by %s)", engine, worker_url)
        elif engine != self.tokenizer.engine:
            log.warning(
                "worker %s runs %s but chats render by %s's rules (named by %s): a mixed "
                "fleet; set --chat-rules to the engine most traffic goes to",
                worker_url,
                engine,
                self.tokenizer.engine,
                self.decided_by,
            )


def snapshot_body_bound(config: ServeConfig) -> int:
    """The largest sibling snapshot body accepted (also once inflated): the flag when given,
    else enough for a full index of `--kv-index-max-blocks` as columns, never under 24 MiB."""
    if config.kv_bootstrap_max_body_mb:
        return config.kv_bootstrap_max_body_mb << 20
    return max(
        MIN_SNAPSHOT_BODY_BYTES,
        config.kv_index_max_blocks * SNAPSHOT_BODY_BYTES_PER_CARRIED_BLOCK,
    )
