"""The worker registry: which engines this replica routes to, and their KV-event streams.

Workers come from `--worker` flags, the admin API and the `--worker-selector` EndpointSlice
watch; all go through `WorkerRegistry.add` / `remove`, so every source gets the same lifecycle:

add(url), for a URL not yet known:
  1. Read `GET {url}/server_info` for the `kv_events` block (SGLang style); without one, fall
     back to the flags (port base, replay port base, dp size). A wildcard endpoint host means
     the worker's own host. Endpoints no rank can be subscribed at (a rank's port outside
     1..65535, a host that is none or link-local IPv6), or on a host other than its own outside
     `--worker-allow-cidr`, refuse the worker (as in 2) before anything subscribes.
     Read `GET {url}/v1/models` (`parse_models`): its engine, the base model names it serves
     (`served_models`, how a vLLM request's `model` is told from an adapter's name) and its
     LoRA adapters, which the index learns at once (`IndexRules.learn_adapters`); the
     requests naming a model go only to the workers listing it (`router.model_servers`).
     It is read again at a request naming a model no listing holds (`reread_listings`: an
     adapter loaded at run time) and by the health loop every `--worker-models-refresh-s`
     (an adapter unloaded); a read that fails keeps the last listing.
     A rank whose endpoint (its resolved address and port, as its subscriber connects) is
     another registered worker's is refused too (`shared_kv_events_endpoint`): one port is
     one engine's publisher, so its events would be read as this worker's too, and this
     engine's own went unread. The claim is the worker's until its ranks leave (`_detach`).
  2. Settle the fleet block size: `--block-size`, else the first worker that advertises one.
     A worker that disagrees is refused: it stays listed with state `refused` and a reason,
     and takes no traffic, because its events would key blocks the prompts never match.
     One that states none (vLLM) is refused so at its ranks' first batch storing blocks of
     another size (`_refuse_for_events`): its ranks leave the index.
  3. Mark its ranks live in the pump, then start one subscriber per rank.
  4. Pull its `/v1/kv-snapshot` at once (not on a later pass): blocks cached before we
     subscribed are otherwise invisible. A 404 means the worker does not serve one; that is
     remembered and it is never asked again. It is pulled again only after an unrepaired gap.
Re-adding a known URL changes nothing and pulls nothing: discovery sources re-announce
workers all the time, and a pull per announcement would stampede the fleet. Except a refused
one: re-adding it (`POST /workers`) registers it anew, /server_info read again, as the health
loop does one health interval after its refusal, doubling to `REREGISTER_BACKOFF_MAX_S`
(`_recheck_refused`): an engine restarted with the fleet's block size was refused until the
replica restarted. Its refusal is counted and logged when its reason differs from the last one
of the worker; the same again is logged at info.

A ready worker whose engine restarts within `--worker-evict-after-s` is never evicted, so the
health loop looks at it again: at the first pass that finds it healthy after any of its
ranks' publisher connections dropped, its `/server_info` is read again (`_look_at_drops`).
Other KV-event ranks (dp size, endpoints, ports) are registered anew: the old ranks leave as
at an eviction, then steps 1-4 run again. The same ones after a failed health check in
between, or after a reconnect its publisher's port refused (the listener went away with the
connection), are taken as a restart its new stream may not show (a seq that reads as the old
stream's next): the ranks are cleared and the snapshot pulled again where one is served.

remove(url): the ranks leave the live set and the tree (awaited through the pump, so the
removal has taken effect when it returns), then the subscribers stop.

discovered(urls, unready): the EndpointSlice watch's whole current set, ready and listed not
ready (not terminating). A worker that left the ready set is marked draining at once, in the
same call, so not one more request is routed to it; a background reconcile then removes one
gone or terminating (requests already forwarded run to their end: the proxy holds their
connections) and adds the newcomers. One listed unready keeps its ranks (index, subscriptions)
for `--worker-evict-after-s`, then is removed if still not ready: a readiness flap (a slow
/health, its node NotReady for a moment) says nothing of its cache, and its blocks, forgotten,
were routed cold and copied elsewhere (engines never re-announce what they hold). One that
comes back ready before its removal simply stops draining, its index intact (a new process
behind it is the restart detection's to find, above). Only workers the watch named are
removed by it; an unready URL it never registered is not registered until ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq.asyncio

from cachetree.keys import MAX_ADAPTER_NAMES, MAX_BLOCK_SIZE, is_adapter_name
from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from peer.origin import (
    AllowList,
    canonical_origin,
    host_of,
    host_problem,
    is_link_scoped,
    is_unspecified,
    worker_origin_problem,
)
from peer.spellings import canonical_host
from peer.supervise import Supervisor, describe, doubling_s
from peer.tasks import cancel_and_wait
from router.bootstrap import run_in_slices
from router.bounded import read_up_to
from router.breaker import CircuitBreaker
from router.dataplane.polling import PollAnswer, PollClient
from router.graft import LocalGraft
from router.index import SLICE_BLOCKS, Pump, run_steps
from router.loads import (
    MAX_DP_SIZE,
    METRICS_MAX_BODY_BYTES,
    LoadMonitor,
    parse_metrics_text,
    vllm_block_size,
)
from router.subscriber import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RankEndpoint,
    RankSubscriber,
    SubscriberStats,
)
from router.worker_snapshot import (
    DEFAULT_MAX_BODY_BYTES,
    SnapshotDecode,
    WorkerSnapshot,
    WorkerSnapshotError,
    read_body,
)

if TYPE_CHECKING:
    from peer.tracker import Obligation
    from router.bootstrap import PeerBootstrap

log = logging.getLogger(__name__)

# A worker's requests waiting for its head fail over at this many failed health checks in a
# row; the first takes it out of new routing. One check slower than the poll timeout (an
# engine's API loop busy for a moment) is no sign its generations stopped: vLLM writes a
# non-streamed answer's head at its end, so "waiting for the head" is the whole generation,
# and failing over at the first check sent 8 such requests again to another worker, twice the
# work and 6 -> 9.2 s a request. Two checks put it one health interval and one poll timeout
# after the first: a frozen worker's requests fail over 6-8 s after it froze at the defaults
# (measured 7.8 s; 2-4 s at the first check).
FAIL_OVER_AFTER_FAILED_CHECKS: Final = 2
HEALTH_MAX_BODY_BYTES: Final = 64 * 1024  # engines answer /health with nothing or a line
# /server_info and /v1/models answers are a few KB; past this (or a gzip bomb inflating past
# it: 0.5 MB per worker made 512 MB) the answer is unreadable.
MAX_WORKER_JSON_BYTES: Final = 1024 * 1024
# Registered workers, whatever their state (`--max-workers`): each costs connections (health,
# load polls, the data plane's pool) and its ranks' subscriptions; without a bound, 2,000
# registrations of unreachable URLs were taken in under a second.
DEFAULT_MAX_WORKERS: Final = 256
# Down workers checked per health pass, in turn: a down worker's check may hold a connection
# for the whole request timeout (a host that accepts and never answers), and 800 of them at
# once took every descriptor of a 1,024 limit ("Too many open files": completions failed).
# Ready workers are all checked every pass; a down one at least every
# ceil(down / DOWN_CHECKS_PER_PASS) passes.
DOWN_CHECKS_PER_PASS: Final = 16
# A down worker that answers /health but whose registration anew keeps failing (its
# /server_info unreachable or 5xx) is tried again after one health interval, doubling to this.
REREGISTER_BACKOFF_MAX_S: Final = 60.0
# Why a ready worker was taken as restarted (`WorkerRegistry._look_at_drops`):
# `kv_events_changed`, its /server_info describes other KV-event ranks (dp size, endpoints,
# ports), so it is registered anew; `suspected`, its description is the same but /health
# failed and its event connections dropped in between, so its ranks are cleared;
# `listener_gone`, /health passed throughout but a dropped connection's reconnect was refused
# (its process went away, restarted faster than a health check could fail): cleared too.
RESTART_REASONS: Final = ("kv_events_changed", "suspected", "listener_gone")
# What `_forget_restarted` logs as the evidence of each reason that clears ranks.
RESTART_EVIDENCE: Final = {
    "suspected": "failed /health",
    "listener_gone": "refused a reconnect (nothing listened on its KV-event port)",
}
KNOWN_ENGINES: Final = ("vllm", "sglang")  # `owned_by` values of the engines' /v1/models
# Base model names read of a worker's /v1/models: vLLM's --served-model-name takes a few.
MAX_SERVED_NAMES: Final = 64
RESOLVE_TIMEOUT_S: Final = 2.0  # a host checked against --worker-allow-cidr
# The longest a starting replica's /readyz waits for a worker's ranks to be subscribed (an
# ingest process subscribes ~0.1 s after registration, and reports it within a second).
SUBSCRIBE_WAIT_S: Final = 10.0
# A request naming a model no listing holds has the routable workers' /v1/models read again
# at most this often (`reread_listings`): an adapter loaded at run time is routed to its
# workers alone within this and one read, and a flood of names served nowhere costs one read
# of each worker per interval.
MODELS_REREAD_S: Final = 5.0
# The health loop reads them again this often (`--worker-models-refresh-s`): an adapter
# unloaded at run time stops drawing requests its worker answers 404.
MODELS_REFRESH_S: Final = 30.0
# Why the routable workers' /v1/models were read again (`RegistryStats.listing_reads`): a
# request named a model no listing holds, or the health loop's refresh.
LISTING_READ_REASONS: Final = ("unlisted_model", "refresh")
# Workers' /v1/models read at once by a read again: each may hold a connection for the
# request timeout, as a down worker's health check does (`DOWN_CHECKS_PER_PASS`).
LISTING_READS_AT_ONCE: Final = 16


@dataclass(frozen=True, slots=True)
class KvEventsInfo:
    host: str
    port_base: int
    topic: str
    block_size: int | None
    dp_size: int
    replay_port_base: int | None
    source: str  # "server_info", "flags", or `METRICS_SOURCE`


# The source of a worker's KV-event description made of the flags and what its /metrics
# states of its dp size and block size.
METRICS_SOURCE: Final = "flags, /metrics"


@dataclass(frozen=True, slots=True)
class DiscoveryDefaults:
    """Flag values used for a worker whose /server_info has no kv_events block."""

    port_base: int = 5557
    replay_port_base: int = 0
    dp_size: int = 1
    topic: str = ""


def parse_server_info(body: Any, worker_url: str, defaults: DiscoveryDefaults) -> KvEventsInfo:
    """The KV-event endpoints of a worker from its /server_info JSON (or the flags)."""
    worker_host = urlsplit(worker_url).hostname or "127.0.0.1"
    kv = body.get("kv_events") if isinstance(body, dict) else None
    if not isinstance(kv, dict):
        return KvEventsInfo(
            worker_host,
            defaults.port_base,
            defaults.topic,
            None,
            defaults.dp_size,
            defaults.replay_port_base or None,
            "flags",
        )
    host = canonical_host(str(kv.get("endpoint_host") or ""))
    replay = kv.get("replay_endpoint_port_base")
    block_size = kv.get("block_size")
    return KvEventsInfo(
        host=worker_host if host in ("", "*") or is_unspecified(host) else host,
        port_base=_int(kv.get("endpoint_port_base"), defaults.port_base),
        topic=str(kv.get("topic") or ""),
        block_size=block_size if _int(block_size, 0) in range(1, MAX_BLOCK_SIZE + 1) else None,
        dp_size=max(1, _int(kv.get("dp_size"), defaults.dp_size)),
        # 0 or none is no replay; any other number is checked (`endpoint_problem`).
        replay_port_base=replay if _int(replay, 0) else None,
        source="server_info",
    )


@dataclass(frozen=True, slots=True)
class ServedModels:
    """What a worker's `/v1/models` lists, as vLLM's and SGLang's ModelCards say it: the
    engine (the first card's `owned_by`), the base model names it serves (cards without a
    `parent`) and its LoRA adapters (cards whose `parent` names the base model)."""

    engine: str | None = None
    bases: tuple[str, ...] = ()
    adapters: tuple[str, ...] = ()
    # Whether it lists a base model: else what it serves is unknown (unread, or an answer
    # naming none), and requests naming any model may go to it (`router.model_servers`).
    listed: bool = False


def parse_models(body: Any) -> ServedModels:
    """A `/v1/models` answer's `ServedModels`: at most `MAX_SERVED_NAMES` base names and
    `MAX_ADAPTER_NAMES` adapter names, each a string an adapter may have
    (`is_adapter_name`); a card that is not one is skipped. `listed` when it names a base
    model and no name was left out for the bounds."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return ServedModels()
    cards = [card for card in data if isinstance(card, dict)]
    owner = cards[0].get("owned_by") if cards else None
    bases: list[str] = []
    adapters: list[str] = []
    left_out = False  # a name past the bounds
    for card in cards:
        name, parent = card.get("id"), card.get("parent")
        if not is_adapter_name(name):
            continue
        if parent is None:
            names, bound = bases, MAX_SERVED_NAMES
        elif isinstance(parent, str):
            names, bound = adapters, MAX_ADAPTER_NAMES
        else:  # a parent that is no name: neither
            continue
        if len(names) < bound:
            names.append(name)
        else:
            left_out = True
    engine = owner if owner in KNOWN_ENGINES else None
    listed = bool(bases) and not left_out
    return ServedModels(engine, tuple(bases), tuple(adapters), listed)


def engines_dp_size(ranks: Iterable[int]) -> int | None:
    """A worker's dp size from the ranks its /metrics labels (`parse_metrics_text`: vLLM's
    `engine`, one engine core per rank): n when they are 0..n-1, else None (none, or an
    engine serving ranks other than its own from 0, as behind an external load balancer)."""
    numbers = sorted(ranks)
    return len(numbers) if numbers and numbers == list(range(len(numbers))) else None


def reregister_after_s(failures: int, interval_s: float) -> float:
    """How long a down worker waits for its next registration anew after `failures` in a
    row: one health interval, doubling, at most `REREGISTER_BACKOFF_MAX_S`."""
    return doubling_s(interval_s, REREGISTER_BACKOFF_MAX_S, failures)


@dataclass(slots=True)
class ListingRereads:
    """When the routable workers' `/v1/models` are read again, as plain code on the
    registry's clock: one read of them all at a time; for requests naming a model no listing
    holds (`WorkerRegistry.reread_listings`) at most once per `interval_s` after the last
    began, so a flood of them costs one read of each worker per interval, not one per
    request; and at a health pass `refresh_s` after the last began (0: never)."""

    interval_s: float
    refresh_s: float
    next_refresh: float  # a health pass from then on reads them (the registrations read them)
    began: float = -math.inf  # when the last read began
    reading: bool = False

    def unheard(self, now: float) -> bool:
        """A request named a model no listing holds: whether a read begins now (`ended` is
        called once it has)."""
        return now - self.began >= self.interval_s and self._begin(now)

    def refresh(self, now: float) -> bool:
        """A health pass: whether a read begins now."""
        return self.refresh_s > 0 and now >= self.next_refresh and self._begin(now)

    def _begin(self, now: float) -> bool:
        if self.reading:
            return False
        self.reading, self.began, self.next_refresh = True, now, now + self.refresh_s
        return True

    def ended(self) -> None:
        self.reading = False


def endpoint_problem(info: KvEventsInfo) -> str | None:
    """Why no rank of the worker can be subscribed where `info` says, or None: a host that
    is none (as a worker URL's, `peer.origin`) or is link-local IPv6 (`is_link_scoped`),
    or a rank's port (the base plus the rank, the replay one's too) outside 1..65535. Its
    subscribers retried such an endpoint for good, one warning per rank every 2 s, while the
    worker was listed ready."""
    if (problem := host_problem(info.host)) is not None:
        return f"its KV-event endpoint host is none: {problem}"
    if is_link_scoped(info.host):
        # Without a zone a connect to it fails (EINVAL); a zone names an interface of the
        # machine that wrote it, the worker's, not of this replica's (and its URL spelling,
        # `%25`, is no name the resolver or libzmq reads): the subscribers retried it for good.
        address, _, zone = info.host.partition("%25")
        return (
            f"its KV-event endpoint host {address}{f' (zone {zone})' if zone else ''} is "
            "reached only through a named network interface (a link-local IPv6 address, or "
            "one given with a zone), an interface of this replica's machine that the worker "
            "cannot name; publish the events on a routable address of the worker, or on a "
            "wildcard (its own host)"
        )
    bases = (("endpoint", info.port_base), ("replay endpoint", info.replay_port_base))
    for name, base in bases:
        if base is not None and not 1 <= base <= 65536 - info.dp_size:
            return (
                f"its {name} port base {base} ({info.source}) with dp size {info.dp_size} "
                f"puts its ranks on ports {base}..{base + info.dp_size - 1}, not all in "
                "1..65535"
            )
    return None


async def host_addresses(host: str) -> set[str]:
    """The addresses `host` resolves to now; OSError, or TimeoutError past
    `RESOLVE_TIMEOUT_S`, when it does not."""
    async with asyncio.timeout(RESOLVE_TIMEOUT_S):
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


async def allow_list_refusal(allow: AllowList, host: str) -> str | None:
    """Why `--worker-allow-cidr` refuses `host`: every address it resolves to must be inside.
    (Checked when it is registered: a name that resolves elsewhere later, DNS rebinding, is
    outside what this can see; SECURITY.md.)"""
    if not allow.restricts:
        return None
    try:
        addresses = await host_addresses(host)
    except (OSError, TimeoutError) as exc:
        return f"{host} does not resolve ({exc or 'timed out'})"
    return allow.refusal(host, sorted(addresses))


Subscribe = Callable[[RankEndpoint, SubscriberStats], Coroutine[None, None, None]]
# A rank's KV-event endpoint as its subscriber connects: an address (or a host name that did
# not resolve) and a port.
Endpoint = tuple[str, int]


async def resolved_endpoints(info: KvEventsInfo) -> frozenset[Endpoint]:
    """The addresses and ports the worker's ranks' subscribers connect to: each address its
    endpoint host resolves to (a subscriber tries them in turn) by each rank's port. A name
    that does not resolve now is kept as it is spelt."""
    addresses = {info.host}
    try:
        ipaddress.ip_address(info.host)
    except ValueError:  # a name
        try:
            found = await host_addresses(info.host)
        except (OSError, TimeoutError):
            pass
        else:
            addresses = {canonical_host(address) for address in found} or addresses
    ports = range(info.port_base, info.port_base + info.dp_size)
    return frozenset((address, port) for address in addresses for port in ports)


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _RoutingEpoch:
    """Moves on whenever something a routing decision reads of the workers changes: one of
    `ROUTING_FIELDS` of any `Worker`, or the set of a registry's workers. What is derived from
    them (`WorkerRegistry.routable_ranks`) is recomputed only when it moved."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


ROUTING_EPOCH: Final = _RoutingEpoch()
# What `Worker.routable` and `Worker.ranks` read, and the models a request may ask it for.
ROUTING_FIELDS: Final = frozenset({"url", "state", "healthy", "draining", "kv", "models"})


# The states of a registered worker (`Worker.state`) but `refused`, which goes with its
# reason; `removed` is one that left the registry.
ADMITTED_STATES: Final = ("discovering", "ready", "down")


@dataclass(slots=True)
class Worker:
    url: str
    state: str = "discovering"  # discovering -> ready | refused; ready <-> down; -> removed
    reason: str = ""
    kv: KvEventsInfo | None = None
    healthy: bool = False
    unhealthy_since: float | None = None  # clock time of the first failed check in a row
    failed_checks: int = 0  # failed health checks in a row
    reregister_failures: int = 0  # down or refused: registrations anew that failed in a row
    reregister_at: float = 0.0  # down or refused: the next registration anew, at earliest
    refusal: str = ""  # why it was last refused (kept once admitted again): counted once
    refused_for: str = ""  # refused: the reason counted (`block_size`, ...), as its metrics say
    # Its ranks' publisher connection drops and refused reconnects after them as of its last
    # look at them (`_look_at_drops`), and whether a health check failed since: an engine
    # restarted in between shows a drop and either of the others.
    drops_seen: int = 0
    listener_gone_seen: int = 0
    failed_since_drops_seen: bool = False
    draining: bool = False
    # Its ranks' KV-event endpoints as subscribed (`resolved_endpoints`): claimed once they
    # pass `_shared_endpoint_refusal`, given up when its ranks leave (`_detach`).
    event_endpoints: frozenset[Endpoint] = frozenset()
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    snapshot_served: bool | None = None  # None: not asked yet; False: 404
    models: ServedModels = ServedModels()  # what its /v1/models lists
    subscriber_stats: dict[int, SubscriberStats] = field(default_factory=dict)
    subscribing_since: float = 0.0  # clock time its ranks' subscribers started
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _ranks: tuple[RankId, ...] = field(default=(), repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in ROUTING_FIELDS:
            ROUTING_EPOCH.value += 1

    @property
    def engine(self) -> str | None:
        """What its /v1/models calls itself (owned_by): vllm, sglang; None: it does not say."""
        return self.models.engine

    @property
    def dp_size(self) -> int:
        return self.kv.dp_size if self.kv else 1

    def ranks(self) -> tuple[RankId, ...]:
        ranks = self._ranks
        if len(ranks) != self.dp_size:  # made again only when the engine's dp size changes
            ranks = self._ranks = tuple(RankId(self.url, r) for r in range(self.dp_size))
        return ranks

    @property
    def routable(self) -> bool:
        return self.state == "ready" and self.healthy and not self.draining


@dataclass(slots=True)
class RegistryStats:
    refused: Counter[str] = field(default_factory=Counter)  # reason
    evictions: int = 0  # ready workers whose ranks left the index after failing /health
    snapshot_pulls: Counter[str] = field(default_factory=Counter)  # outcome
    distrusted: int = 0  # ranks cleared because they carried more than their engine can hold
    # Ready workers taken as restarted (`RESTART_REASONS`): registered anew, or ranks cleared.
    restarts: Counter[str] = field(default_factory=Counter)
    health_checks_failed: int = 0
    # Reads again of the routable workers' /v1/models begun, by `LISTING_READ_REASONS`.
    listing_reads: Counter[str] = field(default_factory=Counter)


class WorkerRegistry:
    def __init__(
        self,
        pump: Pump,
        session: aiohttp.ClientSession,
        loads: LoadMonitor,
        *,
        block_size: int | None,
        defaults: DiscoveryDefaults = DiscoveryDefaults(),
        breaker_factory: Callable[[str], CircuitBreaker] = lambda url: CircuitBreaker(name=url),
        health_interval_s: float = 2.0,
        evict_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        request_timeout_s: float = 2.0,
        replay_timeout_s: float = 2.0,
        zmq_context: zmq.asyncio.Context | None = None,
        supervisor: Supervisor | None = None,
        max_ranks: int | None = None,
        max_workers: int = DEFAULT_MAX_WORKERS,
        snapshot_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        subscribe: Subscribe | None = None,
        keeps_index: bool = True,
        allow: AllowList | None = None,
        models_reread_s: float = MODELS_REREAD_S,
        models_refresh_s: float = MODELS_REFRESH_S,
    ) -> None:
        """`subscribe(endpoint, stats)`: the life of a rank's subscription as a coroutine
        (`router.ingest_pool.IngestPool.subscription`); None runs a `RankSubscriber` here.
        `keeps_index` False: a replica whose policy never reads the index registers workers
        for routing only (no KV-event subscriptions, no snapshot pulls, no block size).
        `allow`: `--worker-allow-cidr`, where `POST /workers` may point and where a worker's
        KV-event endpoints may be when not on its own host (None: anywhere).
        `models_reread_s`: how often a request naming a model no listing holds may have the
        listings read again (`reread_listings`); `models_refresh_s`: how often the health loop
        reads them (0: never)."""
        self.keeps_index = keeps_index
        self.allow = allow if allow is not None else AllowList()
        self.pump = pump
        self.session = session
        self.loads = loads
        self.block_size = block_size
        self._block_size_known = asyncio.Event()  # set once `block_size` is (`add_listed`)
        if block_size is not None:
            self._block_size_known.set()
        self.defaults = defaults
        self.stats = RegistryStats()
        self._breaker_factory = breaker_factory
        self._health_interval_s = health_interval_s
        self._evict_after_s = evict_after_s
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._request_timeout_s = request_timeout_s
        # The health checks' GETs, on the data plane's lean keep-alive pools (as load polls).
        self._health = PollClient()
        self._replay_timeout_s = replay_timeout_s
        self._max_message_bytes = max_message_bytes
        self._subscribe = subscribe
        self._zmq = zmq_context or zmq.asyncio.Context.instance()
        self.supervisor = supervisor or Supervisor()
        self.max_ranks = max_ranks  # the socket budget (router.socket_budget); None: unbounded
        self.subscribed_ranks = 0  # ranks with subscribers now
        self.max_workers = max_workers
        self._down_turn = 0  # where the next pass's down checks start (`DOWN_CHECKS_PER_PASS`)
        self.snapshot_max_body_bytes = snapshot_max_body_bytes
        # One worker snapshot in memory at a time: each may take its bound several times over.
        self._snapshot_slot = asyncio.Semaphore(1)
        self._workers: dict[str, Worker] = {}
        # The base model names the registered workers' /v1/models list (`Worker.models`): a
        # vLLM request naming another model names an adapter (`routing.namespace_for`).
        self.served_models: frozenset[str] = frozenset()
        self._routable: list[tuple[Worker, tuple[RankId, ...]]] = []
        self._routable_epoch = -1  # `ROUTING_EPOCH` when `_routable` was made
        self._locks: dict[str, _UrlLock] = {}  # per URL, while someone holds or waits
        self._pulls: dict[str, asyncio.Task[None]] = {}
        self._repull: set[str] = set()
        self._health_task: asyncio.Task[None] | None = None
        self._bootstraps: set[asyncio.Task[None]] = set()
        self._discovered: set[str] = set()  # added by the EndpointSlice watch
        self._wanted: set[str] = set()  # the watch's latest ready set
        # The watch's latest unready URLs (listed, not ready, not terminating): since when.
        self._unready_since: dict[str, float] = {}
        self._reconcile_wake = asyncio.Event()
        self._reconciler: asyncio.Task[None] | None = None
        self._closing = False
        # Set by the app when peer bootstrap is on (a --peer or --kv-peer-selector is given).
        self.bootstrap: PeerBootstrap | None = None
        # Set by the data plane: told when health declares a worker down (its checks failed
        # `FAIL_OVER_AFTER_FAILED_CHECKS` times in a row), so that requests still waiting for
        # that worker's answer fail over at once.
        self.on_unhealthy: Callable[[str], None] | None = None
        self.on_removed: Callable[[str], None] | None = None  # the data plane drops its pool
        # Set by the replica under cache_aware: told a removed worker's ranks, which the
        # pressure ledger then stops giving a share of its bound.
        self.on_ranks_left: Callable[[Sequence[RankId]], None] | None = None
        # Set by the replica under --chat-rules auto: told which engine a worker runs.
        self.on_engine: Callable[[str, str], None] | None = None
        pump.rules.set_loss_handler(self._on_rank_loss)
        pump.rules.set_block_size_handler(self._on_foreign_block_size)
        self._refusals: dict[str, asyncio.Task[None]] = {}  # by URL: `_refuse_for_events`
        self._rereads = ListingRereads(
            models_reread_s, models_refresh_s, next_refresh=clock() + models_refresh_s
        )
        self._rereading: asyncio.Task[None] | None = None  # `reread_listings`' read

    # -- queries ---------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, url: str) -> Worker | None:
        # The keys are canonical origins: a canonical `url` (every rank's, on the request
        # path) is found without parsing it again.
        worker = self._workers.get(url)
        return worker if worker is not None else self._workers.get(_normalize(url))

    def knows(self, rank: RankId) -> bool:
        """Whether `rank` is one of a registered worker's (a sibling's decision or placement
        may name a worker this replica was not given)."""
        worker = self.get(rank.worker_url)
        return worker is not None and rank.dp_rank < worker.dp_size

    def routable(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.routable]

    def subscribing(self) -> int:
        """Ranks of routable workers not subscribed yet (no handshake with their publisher
        completed), within `SUBSCRIBE_WAIT_S` of their subscribers' start: past it, a port
        that does not answer (an engine without KV events) holds nothing up; its subscriber
        warns of it."""
        now = self._clock()
        return sum(
            not stats.subscriptions
            for worker in self.routable()
            if now - worker.subscribing_since < SUBSCRIBE_WAIT_S
            for stats in worker.subscriber_stats.values()
        )

    def routable_ranks(self) -> list[tuple[Worker, tuple[RankId, ...]]]:
        """The routable workers with their ranks, as on the request path: recomputed only
        when `ROUTING_EPOCH` moved (a worker's routing fields, or the set of workers)."""
        if self._routable_epoch != ROUTING_EPOCH.value:
            self._routable = [(w, w.ranks()) for w in self._workers.values() if w.routable]
            self._routable_epoch = ROUTING_EPOCH.value
        return self._routable

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._health_task = self.supervisor.spawn("health", "kvrouter-health", self._health_loop)

    async def close(self) -> None:
        self._closing = True
        self._reconcile_wake.set()
        await cancel_and_wait(
            [self._health_task, self._rereading, *self._bootstraps, *self._refusals.values()]
        )
        if self._reconciler is not None:
            # Awaited, not cancelled: a removal cut half-way would leave its subscribers running.
            await self._reconciler
        for url in list(self._workers):
            await self.remove(url)
        self._health.close()

    async def add(self, url: str) -> Worker:
        """Register a worker (idempotent). Raises ValueError for a URL that cannot be one,
        `WorkerRemoved` when it was removed before its registration ended."""
        if (problem := worker_origin_problem(url)) is not None:
            raise ValueError(f"{url!r} is not a worker URL: {problem}")
        given, url = url, _normalize(url)
        if host_of(given) == "localhost":
            log.warning(
                "worker %s is %s: localhost is taken for 127.0.0.1, one worker under either "
                "spelling (peer.origin); give an engine listening on IPv6 loopback only as "
                "http://[::1]:port",
                given,
                url,
            )
        async with self._exclusive(url):
            known = self._workers.get(url)
            if known is not None and known.state not in ("discovering", "down", "refused"):
                return known  # re-registration: no new subscription, no new pull
            if known is None and len(self._workers) >= self.max_workers:
                self.stats.refused["max_workers"] += 1
                raise TooManyWorkers(
                    f"{url} not registered: this replica has {len(self._workers)} workers, "
                    f"its --max-workers; remove one (DELETE /workers) or raise --max-workers"
                )
            worker = known or Worker(url, breaker=self._breaker_factory(url))
            self._workers[url] = worker
            try:
                await self._register(worker)
            except WorkerRemoved:
                await self._teardown(worker)
                log.info("worker %s removed while it was being registered: stopped", url)
                raise
            except BaseException as exc:  # cancelled too: a client that left cancels its POST
                await self._undo_registration(worker, exc, new=known is None)
                raise
            # Only an admitted worker names the fleet's engine: told before its refusals (its
            # block size, its endpoints), a refused SGLang worker that registered first set
            # the chat rules of a vLLM fleet.
            if worker.state == "ready" and worker.engine is not None and self.on_engine:
                self.on_engine(worker.url, worker.engine)
            return worker

    async def add_listed(self, urls: Sequence[str]) -> list[Worker | BaseException]:
        """Register the `--worker` list, all at once (each may wait out its timeouts), each
        one's outcome in order. With no `--block-size`, the first listed decides it, as the
        flag's help says: the others wait until it is learned or the first's registration
        ends (its reads bounded by the request timeout: one unreachable, or stating none,
        leaves it to the first of the others to answer). Registered together, whichever
        answered first decided, and the first listed could be refused for the fleet's."""
        if not urls:
            return []
        first = asyncio.ensure_future(self.add(urls[0]))
        try:
            if self.keeps_index and not self._block_size_known.is_set():
                known = asyncio.ensure_future(self._block_size_known.wait())
                try:
                    await asyncio.wait((first, known), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    known.cancel()
            rest = await asyncio.gather(*map(self.add, urls[1:]), return_exceptions=True)
        except BaseException:  # cancelled: the first's registration goes with the others'
            first.cancel()
            raise
        head = await asyncio.gather(first, return_exceptions=True)
        return [*head, *rest]

    async def remove(self, url: str) -> bool:
        url = _normalize(url)
        worker = self._workers.pop(url, None)
        if worker is None:
            return False
        self._count_served()
        # Out of the registry at once: routed to no more, and a registration of it under way
        # stops at its next step (`_check_still_added`). The lock then waits for that
        # registration, so what it started is stopped before this returns (it outlived a
        # removal before).
        ROUTING_EPOCH.value += 1
        async with self._exclusive(url):
            await self._teardown(worker)
        log.info("worker %s removed: its %d rank(s) left the index", url, worker.dp_size)
        return True

    @contextlib.asynccontextmanager
    async def _exclusive(self, url: str) -> AsyncIterator[None]:
        """One add, remove or eviction of `url` at a time. The lock goes when nobody holds
        or waits for it: one kept per URL ever added grew without bound."""
        entry = self._locks.get(url)
        if entry is None:
            entry = self._locks[url] = _UrlLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0 and self._locks.get(url) is entry:
                del self._locks[url]

    def _check_still_added(self, worker: Worker) -> None:
        """After each await of a registration: raises `WorkerRemoved` once it was removed."""
        if self._workers.get(worker.url) is not worker:
            raise WorkerRemoved(
                f"worker {worker.url} was removed while it was being registered; nothing of "
                "it was kept"
            )

    async def _teardown(self, worker: Worker) -> None:
        """Stop all a worker that left the registry has running (once, however many ask)."""
        if worker.state == "removed":
            return
        # A down worker left the index already, unless a registration anew had claimed its
        # endpoints and put its ranks back before this removal came.
        if worker.state != "down" or worker.event_endpoints:
            await self._detach(worker)
        worker.state = "removed"
        self._health.forget(worker.url)
        if self.on_removed is not None:
            self.on_removed(worker.url)
        if self.on_ranks_left is not None:
            self.on_ranks_left(worker.ranks())

    async def _undo_registration(self, worker: Worker, exc: BaseException, *, new: bool) -> None:
        """A registration that raised leaves nothing running: what it started is stopped, a
        new worker leaves the registry, a known one (down, being registered anew) stays down
        for the health loop to try again. Before this, a worker whose registration raised
        stayed listed `ready` with nothing checking it (and broke every health pass)."""
        why = describe(exc) if isinstance(exc, Exception) else "the registration was cancelled"
        if new:
            if self._workers.get(worker.url) is worker:
                del self._workers[worker.url]
                ROUTING_EPOCH.value += 1
                self._count_served()
            await self._teardown(worker)
            log.error("worker %s not registered: %s", worker.url, why)
            return
        if worker.state == "ready" or worker.event_endpoints:  # its ranks may be live: out
            await self._detach(worker)
        worker.state = "down"
        worker.healthy = False
        worker.reason = f"registration failed ({why}); tried again when /health answers"
        log.error("worker %s: %s", worker.url, worker.reason)

    async def _detach(self, worker: Worker) -> None:
        """Take the worker's ranks out of bootstrap, the index, event ingest and load polling."""
        url, ranks = worker.url, worker.ranks()
        if self.bootstrap is not None:
            self.bootstrap.forget_ranks(ranks)  # first: makes an in-flight graft a no-op
        # Leave the live set and the tree first, so nothing a subscriber still delivers
        # can bring the ranks back.
        await self.pump.call_steps(lambda rules: rules.forget_ranks_steps(ranks))
        tasks, worker.tasks = worker.tasks, []  # taken at once: a second detach finds none
        if tasks:
            self.subscribed_ranks -= len(ranks)
        await cancel_and_wait(tasks)  # supervised: they end only by cancellation
        pull = self._pulls.pop(url, None)
        if pull is not None:
            pull.cancel()
        self._repull.discard(url)
        self.loads.remove_worker(url)
        worker.subscriber_stats.clear()
        worker.event_endpoints = frozenset()  # its subscribers stopped: free for another

    # -- EndpointSlice discovery -----------------------------------------------------------

    def discovered(self, urls: Iterable[str], unready: Iterable[str] = ()) -> None:
        """The discovered set changed: drain the departed and the unready now, reconcile in
        the background."""
        if self._closing:
            return
        self._wanted = {_normalize(u) for u in urls}
        now = self._clock()
        since = self._unready_since
        self._unready_since = {
            u: since.get(u, now) for u in map(_normalize, unready) if u not in self._wanted
        }
        for url in self._discovered:
            worker = self._workers.get(url)
            if worker is not None:
                draining = url not in self._wanted
                if draining and not worker.draining:
                    if url in self._unready_since:
                        log.info(
                            "worker %s is not ready in its EndpointSlices: no new requests; "
                            "its ranks are kept while it is listed, for at most "
                            "--worker-evict-after-s (%g s; 0: no limit)",
                            url,
                            self._evict_after_s,
                        )
                    else:
                        log.info("worker %s left its EndpointSlices: no new requests", url)
                worker.draining = draining
        self._reconcile_wake.set()
        if self._reconciler is None:
            self._reconciler = self.supervisor.spawn(
                "discovery", "kvrouter-discovered", self._reconcile
            )

    async def _reconcile(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reconcile_wake.wait(), self._unready_wait_s())
            self._reconcile_wake.clear()
            if self._closing:
                return
            now = self._clock()
            for url in sorted(self._discovered - self._wanted):
                since = self._unready_since.get(url)
                if since is not None and not evict_due(since, now, self._evict_after_s):
                    continue  # unready within its grace: drained, its ranks kept
                if since is not None:
                    log.warning(
                        "worker %s not ready in its EndpointSlices for %g s "
                        "(--worker-evict-after-s): removing it",
                        url,
                        self._evict_after_s,
                    )
                self._discovered.discard(url)
                await self.remove(url)
            new = sorted(self._wanted - self._discovered)
            # Ours from the start of the add, so that leaving again mid-add drains it too.
            self._discovered.update(new)
            results = await asyncio.gather(*(self.add(u) for u in new), return_exceptions=True)
            for url, result in zip(new, results, strict=True):
                if isinstance(result, BaseException):
                    self._discovered.discard(url)
                    log.error("discovered worker %s not added: %s", url, result)
                else:
                    # It may have left before the add created it.
                    result.draining = url not in self._wanted

    def _unready_wait_s(self) -> float | None:
        """How long until the first registered unready worker's grace runs out; None: no
        such worker, or no grace ends (`--worker-evict-after-s 0`)."""
        if self._evict_after_s <= 0:
            return None
        ends = [
            since + self._evict_after_s
            for url, since in self._unready_since.items()
            if url in self._discovered
        ]
        return max(min(ends) - self._clock(), 0.0) if ends else None

    async def _register(self, worker: Worker) -> None:
        # The reason of the last try stays while this one runs (what /workers shows meanwhile
        # is why the worker is down), and goes when it is ready.
        try:
            body = await get_worker_json(self.session, f"{worker.url}/server_info", self._timeout)
        except _Absent:
            body = None
        except (aiohttp.ClientError, TimeoutError, _Unavailable) as exc:
            self._check_still_added(worker)
            # Not up yet (a fleet and its routers start together): the flags' guess at its
            # ranks could be wrong for good (an SGLang worker's dp size), so it waits, down,
            # and the health loop registers it anew once /health answers.
            worker.state = "down"
            why = describe(exc)
            worker.reason = f"/server_info unreachable ({why})"
            log.warning(
                "worker %s: /server_info unreachable (%s); registering it once /health answers",
                worker.url,
                why,
            )
            return
        except ValueError as exc:
            log.warning(
                "worker %s: /server_info unreadable (%s); using --kv-events-* flags",
                worker.url,
                exc,
            )
            body = None
        info = await self._described(worker.url, body)
        self._check_still_added(worker)
        if info.dp_size > MAX_DP_SIZE:  # before `kv` is set: its ranks are never built
            self._refuse(
                worker,
                "dp_size",
                f"dp size {info.dp_size} ({info.source}) is past the {MAX_DP_SIZE} ranks a "
                "worker may have; check what answers its /server_info (or --dp-size)",
            )
            return
        worker.kv = info
        worker.models = await self._models_of(worker.url)
        self._check_still_added(worker)
        self._count_served()
        if worker.models.adapters:
            # Before any store names them: a request naming one is keyed in its namespace.
            await self.pump.call(lambda rules: rules.learn_adapters(worker.models.adapters))
            self._check_still_added(worker)
        if not self.keeps_index:
            await self._register_for_routing(worker)
            return
        # Before its block size is read: a refused worker sets nothing for the fleet.
        if (refusal := await self._endpoint_refusal(worker, info)) is not None:
            self._refuse(worker, "kv_events_endpoint", refusal)
            return
        if info.block_size is not None:
            if self.block_size is None:
                self.block_size = info.block_size
                self._block_size_known.set()
                log.info("fleet block size %d, learned from %s", info.block_size, worker.url)
            elif info.block_size != self.block_size:
                self._refuse(
                    worker,
                    "block_size",
                    f"block size {info.block_size} differs from the fleet's {self.block_size}; "
                    "start the engine with the fleet's page/block size",
                )
                return
        if self.block_size is None:
            self._refuse(
                worker,
                "no_block_size",
                "no block size known: pass --block-size (vLLM does not advertise one)",
            )
            return
        ranks = worker.ranks()
        if self.max_ranks is not None and self.subscribed_ranks + len(ranks) > self.max_ranks:
            self._refuse(
                worker,
                "socket_limit",
                f"its {len(ranks)} rank(s) would take this replica past the {self.max_ranks} "
                f"rank subscriptions its open-file and ZMQ socket limits allow "
                f"({self.subscribed_ranks} in use); raise the container's RLIMIT_NOFILE "
                "(ulimit -n) or split the fleet across router deployments",
            )
            return
        endpoints = await resolved_endpoints(info)
        self._check_still_added(worker)
        # Checked and claimed with no await between: two registrations at once (the --worker
        # list) cannot both pass.
        if (refusal := self._shared_endpoint_refusal(worker, info, endpoints)) is not None:
            self._refuse(worker, "shared_kv_events_endpoint", refusal)
            return
        worker.event_endpoints = endpoints
        rules = self.pump.rules
        if rules.tree is None:
            rules.tree = BlockTree(self.block_size)
        await self.pump.call(lambda r: r.add_ranks(ranks))
        self._check_still_added(worker)  # a removal from now on takes the live ranks out
        obligations = self.bootstrap.register_ranks(ranks) if self.bootstrap else []
        for rank in ranks:
            stats = SubscriberStats()
            worker.subscriber_stats[rank.dp_rank] = stats
            endpoint = RankEndpoint(
                rank=rank,
                endpoint=_tcp(info.host, info.port_base + rank.dp_rank),
                topic=info.topic.encode(),
                replay_endpoint=(
                    _tcp(info.host, info.replay_port_base + rank.dp_rank)
                    if info.replay_port_base
                    else None
                ),
            )
            worker.tasks.append(
                self.supervisor.spawn(
                    "subscriber",
                    subscriber_name(rank),
                    self._subscriber(endpoint, stats),
                    critical=False,
                )
            )
        self.subscribed_ranks += len(ranks)
        # Fresh subscriber stats.
        worker.drops_seen, worker.listener_gone_seen, worker.failed_since_drops_seen = 0, 0, False
        worker.subscribing_since = self._clock()
        holding_since = time.monotonic()  # after the subscribers started holding
        worker.state, worker.reason = "ready", ""
        worker.healthy = await self._check_health(worker) is None
        self._check_still_added(worker)
        self.loads.add_worker(worker.url, worker.dp_size)
        # Its load and capacity, now rather than at the next load tick (up to an interval
        # away): cache_aware prices cache pressure by the capacity and has none to price
        # before it is known, so a fresh replica's first placements went blind to it (a new
        # prefix onto a holder of its preamble with no room left: BENCHMARKS.md, "the first
        # tick"); and the capacity bounds what a sibling's snapshot may claim for its ranks
        # (peer.vet), read before the bootstrap vets one.
        await self.loads.poll_worker(worker.url)
        self._check_still_added(worker)
        log.info(
            "worker %s registered: %d rank(s), events at %s:%d (%s)%s",
            worker.url,
            worker.dp_size,
            info.host,
            info.port_base,
            info.source,
            f", replay at :{info.replay_port_base}" if info.replay_port_base else "",
        )
        if obligations:
            task = asyncio.create_task(
                self._bootstrap_worker(worker, obligations, holding_since),
                name=f"bootstrap {worker.url}",
            )
            self._bootstraps.add(task)
            task.add_done_callback(self._bootstraps.discard)
        else:
            self._kick_snapshot_pull(worker.url)

    async def _endpoint_refusal(self, worker: Worker, info: KvEventsInfo) -> str | None:
        """Why the worker's ranks are not to be subscribed where `info` says, or None: a
        malformed endpoint, or a host other than its own outside `--worker-allow-cidr` (the
        replica connected wherever a worker's /server_info pointed it, for every rank,
        retrying every 2 s for good)."""
        if (problem := endpoint_problem(info)) is not None:
            return (
                f"{problem}; check what answers its /server_info (kv_events), or "
                "--kv-events-port-base / --kv-events-replay-port-base / --dp-size"
            )
        own = host_of(worker.url)
        if info.host == own:
            return None
        refusal = await allow_list_refusal(self.allow, info.host)
        self._check_still_added(worker)
        if refusal is None:
            return None
        return (
            f"its /server_info puts its KV-event endpoints on {info.host}, not on its own "
            f"host {own}, and {refusal}: publish them on its own host (or a wildcard), or "
            "widen --worker-allow-cidr"
        )

    def _shared_endpoint_refusal(
        self, worker: Worker, info: KvEventsInfo, endpoints: frozenset[Endpoint]
    ) -> str | None:
        """Why the worker's ranks may not be subscribed at `endpoints`: another registered
        worker's are subscribed at one of them. Two vLLM engines on one host, both taking
        the flags' port base, were both subscribed to the one publishing there: the second
        "held" every block the first cached and drew its requests, missing, while its own
        events went to a port nobody read; a /server_info naming another worker's port drew
        that worker's prompts alike."""
        for other in self._workers.values():
            shared = other.event_endpoints & endpoints if other is not worker else None
            if not shared or other.kv is None:
                continue
            address, port = min(shared)
            return (
                f"its rank {port - info.port_base}'s KV-event endpoint "
                f"{_tcp(address, port)} ({info.source}) is where worker {other.url}'s rank "
                f"{port - other.kv.port_base} is subscribed already: one port is one engine's "
                "publisher, so that engine's events would be read as this worker's too, and "
                "this engine's own would go unread. Give each engine its own KV-event port, "
                "described by its /server_info: --kv-events-port-base is one port base for "
                "the whole fleet, so engines without /server_info (vLLM) sharing a host "
                "cannot be told apart by it"
            )
        return None

    async def _register_for_routing(self, worker: Worker) -> None:
        """Ready for traffic, with no KV-event subscription: the index is not kept."""
        worker.state, worker.reason = "ready", ""
        worker.healthy = await self._check_health(worker) is None
        self._check_still_added(worker)
        self.loads.add_worker(worker.url, worker.dp_size)
        log.info(
            "worker %s registered: %d rank(s); no KV-event subscription (this replica's policy "
            "does not read the index)",
            worker.url,
            worker.dp_size,
        )

    def _subscriber(
        self, endpoint: RankEndpoint, stats: SubscriberStats
    ) -> Callable[[], Awaitable[None]]:
        """A factory of runs: each restart is a new subscriber (a fresh stream), as
        `RankSubscriber.run` asks; the stats carry over."""

        def run() -> Awaitable[None]:
            if self._subscribe is not None:  # an ingest process subscribes for us
                return self._subscribe(endpoint, stats)
            return RankSubscriber(
                endpoint,
                self.pump.deliver,
                context=self._zmq,
                replay_timeout_s=self._replay_timeout_s,
                stats=stats,
                max_message_bytes=self._max_message_bytes,
                offer=self.pump.offer,
            ).run()

        return run

    def _refuse(self, worker: Worker, reason: str, message: str) -> None:
        """Refused: listed, no traffic, registered anew after a backoff (`_recheck_refused`).
        Counted and logged as an error only when the reason changed: a worker refused again
        for the same one at every look would count as many refusals as looks."""
        worker.state, worker.refused_for = "refused", reason
        worker.reason = message
        worker.reregister_failures += 1
        wait = reregister_after_s(worker.reregister_failures, self._health_interval_s)
        worker.reregister_at = self._clock() + wait
        if message == worker.refusal:
            log.info("worker %s still refused: %s; next look in %.3g s", worker.url, message, wait)
            return
        worker.refusal = message
        self.stats.refused[reason] += 1
        log.error(
            "worker %s refused: %s (looked at again in %.3g s, doubling to %g s)",
            worker.url,
            message,
            wait,
            REREGISTER_BACKOFF_MAX_S,
        )

    def _on_foreign_block_size(self, rank: RankId, block_size: int) -> None:
        """A rank's stores carry another block size than the fleet's (the index drops them):
        its worker is refused as a /server_info stating it is, from the pump, so in a task."""
        url = rank.worker_url
        worker = self._workers.get(url)
        if worker is None or worker.state != "ready" or url in self._refusals:
            return
        task = asyncio.create_task(
            self._refuse_for_events(worker, block_size), name=f"refuse {url}"
        )
        self._refusals[url] = task
        task.add_done_callback(lambda _: self._refusals.pop(url, None))

    async def _refuse_for_events(self, worker: Worker, block_size: int) -> None:
        """A vLLM worker states no block size (no /server_info): one started with another
        than the fleet's was admitted, its stores all dropped by the index, and it kept its
        share of the traffic with nothing cached ever seen (repeats booked to it missed).
        Its ranks leave the index and it is refused as at registration (`block_size`)."""
        async with self._exclusive(worker.url):
            if self._workers.get(worker.url) is not worker or worker.state != "ready":
                return  # removed, evicted or registered anew meanwhile
            await self._detach(worker)
            self._refuse(
                worker,
                "block_size",
                f"its KV events store blocks of {block_size} tokens, not the fleet's "
                f"{self.block_size}; its ranks left the index. Start the engine with the "
                f"fleet's block size (vLLM --block-size {self.block_size})",
            )

    # -- worker snapshots ------------------------------------------------------------------

    async def _bootstrap_worker(
        self, worker: Worker, obligations: list[Obligation], holding_since: float
    ) -> None:
        """A worker that serves its own snapshot is the source for its ranks; else siblings."""
        assert self.bootstrap is not None
        rest: list[Obligation] = obligations
        try:
            async with self._snapshot_slot:
                outcome, snap = await self._fetch_worker_snapshot(worker)
                self.stats.snapshot_pulls[outcome] += 1
                if snap is not None and self.block_size is not None:
                    # Built in steps: in one go, a 32 MiB body held the loop ~150 ms.
                    build = LocalGraft.build_steps(worker.url, snap, self.block_size, SLICE_BLOCKS)
                    try:
                        graft = await run_steps(build)
                    except WorkerSnapshotError as exc:
                        log.warning("worker %s: /v1/kv-snapshot refused: %s", worker.url, exc)
                    else:
                        del snap  # the graft holds what it needs
                        rest = await self.bootstrap.graft_from_worker(obligations, graft)
        except Exception as exc:  # the siblings are still asked: nothing is left Pending
            self.supervisor.failed("bootstrap", f"worker snapshot graft of {worker.url}", exc)
        self.bootstrap.sweep_for(rest, holding_since)

    async def distrust(self, rank: RankId, why: str) -> None:
        """Clear a rank whose index cannot be true, and pull the worker's snapshot again
        when it serves one; otherwise the rank is re-learned from its live events."""
        self.stats.distrusted += 1
        log.warning("%s: %s; its index is cleared and re-learned", rank, why)
        await self.pump.call(lambda rules: rules.clear_rank_state(rank))
        self._on_rank_loss(rank)

    def _on_rank_loss(self, rank: RankId) -> bool:
        """Pull the rank's worker's snapshot again, unless it is known to serve none:
        whether it is pulled."""
        worker = self._workers.get(rank.worker_url)
        if worker is None or worker.snapshot_served is False:
            return False
        self._kick_snapshot_pull(worker.url)
        return True

    def _kick_snapshot_pull(self, url: str) -> None:
        running = self._pulls.get(url)
        if running is not None and not running.done():
            self._repull.add(url)  # one more pull after this one, never a pile of them
            return
        self._pulls[url] = asyncio.create_task(self._pull_snapshot(url), name=f"snap {url}")

    async def _pull_snapshot(self, url: str) -> None:
        while True:
            self._repull.discard(url)
            worker = self._workers.get(url)
            if worker is None or worker.snapshot_served is False:
                return
            try:
                outcome = await self._pull_once(worker)
            except Exception as exc:
                self.supervisor.failed("snapshot_pull", f"snapshot pull of {url}", exc)
                outcome = "error"
            self.stats.snapshot_pulls[outcome] += 1
            if url not in self._repull:
                return

    async def _pull_once(self, worker: Worker) -> str:
        async with self._snapshot_slot:
            return await self._pull_and_apply(worker)

    async def _pull_and_apply(self, worker: Worker) -> str:
        outcome, snap = await self._fetch_worker_snapshot(worker)
        if snap is None:
            return outcome
        # One control call for the whole body: checked whole, then installed whole or not at
        # all (rank by rank, a good rank went in next to a refused one); in steps, each rank's
        # new state built behind its old one (a 32 MiB body held the loop ~150 ms in one go).
        return await self.pump.call_steps(lambda rules: rules.replace_ranks_steps(worker.url, snap))

    async def _fetch_worker_snapshot(self, worker: Worker) -> tuple[str, WorkerSnapshot | None]:
        try:
            async with self.session.get(
                f"{worker.url}/v1/kv-snapshot", timeout=self._timeout, allow_redirects=False
            ) as resp:
                if is_redirect(resp.status):
                    log.warning(
                        "worker %s: /v1/kv-snapshot %s; no snapshot pulled",
                        worker.url,
                        redirect_not_followed(resp.status, resp.headers.get("Location")),
                    )
                    return "error", None
                if resp.status == 404:
                    worker.snapshot_served = False
                    log.info("worker %s serves no /v1/kv-snapshot; not asking again", worker.url)
                    return "not_served", None
                if resp.status != 200:
                    return "error", None
                worker.snapshot_served = True
                try:
                    body = await read_body(resp, self.snapshot_max_body_bytes)
                except WorkerSnapshotError:
                    resp.close()  # drop the connection rather than drain the rest
                    raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("worker %s: /v1/kv-snapshot failed: %s", worker.url, describe(exc))
            return "error", None
        except WorkerSnapshotError as exc:
            log.warning("worker %s: /v1/kv-snapshot refused: %s", worker.url, exc)
            return "rejected", None
        try:
            # In slices with the loop turning between them: a 32 MiB body decoded in one
            # call held the loop for a quarter of a second (BENCHMARKS.md, issue 13).
            job = SnapshotDecode(body, self.snapshot_max_body_bytes)
            await run_in_slices(job.step, SLICE_BLOCKS)
            return "fetched", job.result()
        except WorkerSnapshotError as exc:
            log.warning("worker %s: /v1/kv-snapshot refused: %s", worker.url, exc)
            return "rejected", None

    # -- health ----------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            await self.check_health_once()

    async def check_health_once(self) -> None:
        """Probe every ready or down worker; evict the long-dead, re-register the revived;
        register anew the refused whose backoff ended; every `models_refresh_s`, read the
        routable workers' `/v1/models` again (`ListingRereads`): an adapter unloaded at run
        time."""
        workers = [w for w in self._workers.values() if w.state == "ready"]
        workers += self._down_in_turn()
        results = await asyncio.gather(*(self._check_health_contained(w) for w in workers))
        now = self._clock()
        for worker, failure in zip(workers, results, strict=True):
            try:
                await self._health_verdict(worker, failure, now)
            except Exception as exc:  # one worker's eviction or re-registration must not
                # stop the others' checks, nor the loop (issue 13, row 1)
                self.supervisor.failed("health", f"health verdict for {worker.url}", exc)
        await self._recheck_refused(now)
        if not self._closing and self._rereads.refresh(now):  # in the background
            self._begin_rereading("refresh")

    async def _recheck_refused(self, now: float) -> None:
        """Register anew the refused workers whose backoff ended, at most
        `DOWN_CHECKS_PER_PASS` a pass, at once (each may wait out its timeouts): an engine
        restarted with what it was refused for fixed (its block size, as the refusal's log
        and KvrouterWorkerRefused say) stays at its address, and was refused until the
        replica restarted."""
        due = [w for w in self._workers.values() if w.state == "refused" and now >= w.reregister_at]
        await asyncio.gather(*map(self._recheck, due[:DOWN_CHECKS_PER_PASS]))

    async def _recheck(self, worker: Worker) -> None:
        try:
            with contextlib.suppress(WorkerRemoved):  # removed meanwhile: nothing to do
                await self.add(worker.url)
            if worker.state == "ready":
                log.warning(
                    "worker %s, refused before (%s), is admitted now", worker.url, worker.refusal
                )
            self._back_off_if_down(worker)
        except Exception as exc:  # one worker's look must not stop the others', nor the loop
            self.supervisor.failed("health", f"a look again at refused {worker.url}", exc)

    def _down_in_turn(self) -> list[Worker]:
        """This pass's share of the down workers: `DOWN_CHECKS_PER_PASS`, taking turns."""
        down = [w for w in self._workers.values() if w.state == "down"]
        if len(down) <= DOWN_CHECKS_PER_PASS:
            return down
        start = self._down_turn % len(down)
        self._down_turn = start + DOWN_CHECKS_PER_PASS
        return (down[start:] + down[:start])[:DOWN_CHECKS_PER_PASS]

    async def _health_verdict(self, worker: Worker, failure: str | None, now: float) -> None:
        """`failure`: None for a passed check, else what the failed one met."""
        healthy = failure is None
        if worker.state == "down":
            if healthy and self._workers.get(worker.url) is worker and now >= worker.reregister_at:
                log.info("worker %s answers /health again: registering it anew", worker.url)
                try:
                    with contextlib.suppress(WorkerRemoved):  # removed meanwhile: nothing to do
                        await self.add(worker.url)
                finally:
                    self._back_off_if_down(worker)
            return
        if worker.healthy and not healthy:
            log.warning(
                "worker %s is now unhealthy: /health %s; it takes no new requests, and those "
                "waiting for its answer fail over if %d checks in a row fail",
                worker.url,
                failure,
                FAIL_OVER_AFTER_FAILED_CHECKS,
            )
        elif healthy and not worker.healthy:
            log.warning("worker %s is now healthy", worker.url)
        worker.healthy = healthy  # out of new routing at the first failed check
        worker.failed_checks = 0 if healthy else worker.failed_checks + 1
        if fails_over_in_flight(worker.failed_checks) and self.on_unhealthy is not None:
            self.on_unhealthy(worker.url)
        if healthy:
            worker.unhealthy_since = None
            await self._look_at_drops(worker)
            return
        worker.failed_since_drops_seen = True
        if worker.unhealthy_since is None:
            worker.unhealthy_since = now
        if evict_due(worker.unhealthy_since, now, self._evict_after_s):
            await self._evict(worker)

    async def _look_at_drops(self, worker: Worker) -> None:
        """A healthy worker whose ranks' publisher connections dropped since the last look
        may be a new engine process: its /server_info is read again. Other KV-event ranks
        than it was registered with are registered anew (`_register_anew`); the same ones,
        after a failed health check in between (`suspected`) or a reconnect refused after a
        drop (`listener_gone`: the process went away, restarted faster than a health check
        could fail), are taken as a restart and cleared (`_forget_restarted`). A drop with
        /health passing and the listener kept throughout (an oversized message, a blip) or a
        failed check with every connection kept (a slow engine) clears nothing."""
        stats = worker.subscriber_stats.values()
        drops = sum(rank.disconnects for rank in stats)
        # Counted by the subscriber just after the drop, possibly after a look that saw the
        # drop: one seen late is a restart all the same.
        gone = sum(rank.listener_gone for rank in stats)
        if drops == worker.drops_seen and gone == worker.listener_gone_seen:
            worker.failed_since_drops_seen = False
            return
        info = await self._kv_events_now(worker)
        if info is None or self._workers.get(worker.url) is not worker or worker.state != "ready":
            return  # looked at again at the next pass
        failed, listener_gone = worker.failed_since_drops_seen, gone != worker.listener_gone_seen
        worker.drops_seen, worker.listener_gone_seen = drops, gone
        worker.failed_since_drops_seen = False
        if info != worker.kv:
            await self._register_anew(worker, info)
        elif failed:
            await self._forget_restarted(worker, "suspected")
        elif listener_gone:
            await self._forget_restarted(worker, "listener_gone")

    async def _kv_events_now(self, worker: Worker) -> KvEventsInfo | None:
        """What the worker's /server_info says of its KV events now, read as `_register`
        reads it (the flags' guess when it serves none or it is unreadable); None when it
        cannot be reached or answers 5xx."""
        try:
            body = await get_worker_json(self.session, f"{worker.url}/server_info", self._timeout)
        except (_Absent, ValueError):
            body = None
        except (aiohttp.ClientError, TimeoutError, _Unavailable) as exc:
            log.info(
                "worker %s: /server_info unreachable (%s) after its KV-event connections "
                "dropped; read again at the next health pass",
                worker.url,
                describe(exc),
            )
            return None
        return await self._described(worker.url, body)

    async def _described(self, url: str, body: Any) -> KvEventsInfo:
        """`parse_server_info` of the worker's /server_info answer (`body`); for one without a
        kv_events block (vLLM), with the dp size (`engines_dp_size`) and block size
        (`vllm_block_size`) its /metrics states in place of the flags' when it states them.
        One `--dp-size` for a fleet of engines with different dp sizes routed to ranks an
        engine did not have (the engine answered 400) and subscribed to ports nothing
        published on; and a vLLM of another block size was learned of only at its first
        store, then admitted again at every look and refused again at its next store."""
        info = parse_server_info(body, url, self.defaults)
        if info.source != "flags":
            return info
        dp_size, block_size = await self._metrics_description(url)
        if dp_size is None and block_size is None:
            return info
        return replace(
            info,
            dp_size=dp_size or info.dp_size,
            block_size=block_size if block_size in range(1, MAX_BLOCK_SIZE + 1) else None,
            source=METRICS_SOURCE,
        )

    async def _metrics_description(self, url: str) -> tuple[int | None, int | None]:
        """The dp size (`engines_dp_size`) and block size (`vllm_block_size`) the worker's
        /metrics states, each None when it is unreadable or states none. Read as /health is
        (the bounded poll client: no redirect followed, the body bounded)."""
        answer = await self._health.get(
            f"{url}/metrics", self._request_timeout_s, METRICS_MAX_BODY_BYTES
        )
        if answer.status != 200 or answer.body is None:
            return None, None
        text = answer.body.decode("utf-8", "replace")
        try:
            ranks = parse_metrics_text(text)
        except ValueError:
            return None, None
        return engines_dp_size(ranks), vllm_block_size(text)

    async def _register_anew(self, worker: Worker, info: KvEventsInfo) -> None:
        """A worker whose KV-event ranks changed while it was registered (its engine
        restarted with another dp size, ports or endpoints) leaves the index and its
        subscribers stop, then it is registered as a down worker is: its new ranks
        subscribed, its snapshot pulled. Kept as they were, a rank the engine no longer had
        kept its blocks and was routed to (the engine answered 400 for it), its subscriber
        retried a dead port for good, and a rank it gained was never subscribed."""
        change = kv_events_change(worker.kv, info)
        async with self._exclusive(worker.url):
            if self._workers.get(worker.url) is not worker or worker.state != "ready":
                return  # removed, evicted or registered anew meanwhile
            await self._detach(worker)
            worker.state, worker.healthy = "down", False
            worker.reason = f"its /server_info changed ({change}); registering it anew"
            worker.reregister_failures, worker.reregister_at = 0, 0.0
        self.stats.restarts["kv_events_changed"] += 1
        log.warning(
            "worker %s restarted with other KV-event ranks (%s): its old ranks left the index; "
            "registering it anew",
            worker.url,
            change,
        )
        try:
            with contextlib.suppress(WorkerRemoved):  # removed meanwhile: nothing to do
                await self.add(worker.url)
        finally:
            self._back_off_if_down(worker)

    async def _forget_restarted(self, worker: Worker, reason: str) -> None:
        """Clear the ranks of a worker taken as restarted (`_look_at_drops`). A new engine
        starts with an empty cache and numbers its batches from 0, and ZeroMQ drops what it
        publishes before the replica has subscribed again, so its stream can look like the
        old one's continuation (seq 3 after the old 0..2, or a gap that replay fills from the
        new stream): nothing else would ever take the old process's blocks out, and the
        index would send their prefixes to a cold cache for good. A false positive (a blip
        that failed /health and dropped the connections of an engine that lived on, or a
        publisher port closed and opened again by a live engine) costs misses until the ranks
        re-learn: its snapshot is pulled again where it serves one, else the ranks re-learn
        from their next batches (cold until one at seq 0). Its `/v1/models` is read again."""
        ranks = worker.ranks()
        self.stats.restarts[reason] += 1
        log.warning(
            "worker %s: its KV-event connections dropped and it %s meanwhile: taken as a "
            "restarted engine (its new stream may read as the old one's continuation); its %d "
            "rank(s) are cleared and re-learned from %s",
            worker.url,
            RESTART_EVIDENCE[reason],
            len(ranks),
            "its next events" if worker.snapshot_served is False else "its /v1/kv-snapshot",
        )
        await self.pump.call(lambda rules: rules.forget_streams(ranks))
        if worker.snapshot_served is not False:
            self._kick_snapshot_pull(worker.url)
        # The new process may serve other models: read now, not at the next refresh.
        await self._reread_listing(worker)

    def _back_off_if_down(self, worker: Worker) -> None:
        """A registration anew that left the worker down waits longer before the next one:
        it was tried at every health pass, forever, two log lines each."""
        if worker.state != "down":
            return
        worker.reregister_failures += 1
        wait = reregister_after_s(worker.reregister_failures, self._health_interval_s)
        worker.reregister_at = self._clock() + wait
        log.warning(
            "worker %s answers /health but its registration failed %d time(s) in a row (%s); "
            "next try in %.3g s: check what answers its /server_info",
            worker.url,
            worker.reregister_failures,
            worker.reason,
            wait,
        )

    async def _evict(self, worker: Worker) -> None:
        # Its cache is most likely gone (a crashed or rescheduled engine): keeping its ranks
        # would hold stale blocks for good, and the engine's next start replays nothing old.
        async with self._exclusive(worker.url):
            if self._workers.get(worker.url) is not worker or worker.state != "ready":
                return  # removed (or registered anew) while the check ran
            await self._detach(worker)
        worker.state = "down"
        worker.reason = (
            f"/health failing for {self._evict_after_s:g} s: its ranks left the index; "
            "registered anew when /health answers 200"
        )
        worker.unhealthy_since, worker.failed_checks = None, 0
        worker.reregister_failures, worker.reregister_at = 0, 0.0  # a new down spell
        self.stats.evictions += 1
        log.warning("worker %s evicted: %s", worker.url, worker.reason)

    async def _check_health_contained(self, worker: Worker) -> str | None:
        """`_check_health`, a raise counted as a failed check: one worker's check that
        cannot even be made must not stop the others' (a gather of them raised as a whole)."""
        try:
            return await self._check_health(worker)
        except Exception as exc:
            self.stats.health_checks_failed += 1
            self.supervisor.failed("health", f"health check of {worker.url}", exc)
            return f"the check raised {describe(exc)}"

    async def _check_health(self, worker: Worker) -> str | None:
        """None when the worker's `/health` answered 200, else what went wrong."""
        answer = await self._health.get(
            f"{worker.url}/health", self._request_timeout_s, HEALTH_MAX_BODY_BYTES
        )
        if answer.status == 200 and answer.error is None:
            return None
        self.stats.health_checks_failed += 1
        if answer.status is not None and is_redirect(answer.status) and worker.healthy:
            log.warning(
                "worker %s: /health %s; a failed check",
                worker.url,
                redirect_not_followed(answer.status, None),
            )
        return health_failure(answer, self._request_timeout_s)

    async def _models_of(self, url: str) -> ServedModels:
        """What a worker's `/v1/models` lists (`parse_models`); nothing when it is unreadable."""
        try:
            body = await get_worker_json(self.session, f"{url}/v1/models", self._timeout)
        except WORKER_JSON_ERRORS as exc:
            log.warning(
                "worker %s: /v1/models unreadable (%s): its engine, model and adapter names "
                "are unknown until a read again succeeds (--worker-models-refresh-s). Check "
                "that the route answers without credentials",
                url,
                "not served" if isinstance(exc, _Absent) else describe(exc),
            )
            return ServedModels()
        return parse_models(body)

    def reread_listings(self) -> None:
        """A request named a model no listing holds (`ModelServers.unheard`): the routable
        workers' `/v1/models` are read again in the background, at most once per
        `MODELS_REREAD_S` (`ListingRereads`), so an adapter loaded at run time (vLLM's
        `/v1/load_lora_adapter`, a LoRA resolver on a first request) goes to its workers
        alone after one read; until then such requests go to any worker."""
        if not self._closing and self._rereads.unheard(self._clock()):
            self._begin_rereading("unlisted_model")

    def _begin_rereading(self, reason: str) -> None:
        self.stats.listing_reads[reason] += 1
        self._rereading = asyncio.get_running_loop().create_task(
            self._reread_listings(), name="kvrouter-reread-listings"
        )

    async def _reread_listings(self) -> None:
        slots = asyncio.Semaphore(LISTING_READS_AT_ONCE)

        async def reread(worker: Worker) -> None:
            async with slots:
                await self._reread_listing(worker)

        try:
            await asyncio.gather(*map(reread, self.routable()))
        finally:
            self._rereads.ended()

    async def _reread_listing(self, worker: Worker) -> None:
        """The worker's `/v1/models` read again: a listing that changed is its `models` (a
        routing field: the model table is made anew), its new adapters learned by the index;
        a failed read keeps the last listing."""
        before = worker.models
        try:
            body = await get_worker_json(self.session, f"{worker.url}/v1/models", self._timeout)
        except WORKER_JSON_ERRORS as exc:
            # At debug for one never read: its registration warned, and every read fails alike
            # (a vLLM with --api-key).
            log.log(
                logging.INFO if before.listed else logging.DEBUG,
                "worker %s: /v1/models unreadable (%s) when read again: its last listing is kept",
                worker.url,
                "not served" if isinstance(exc, _Absent) else describe(exc),
            )
            return
        except Exception as exc:  # one worker's read must not stop the others'
            self.supervisor.failed("health", f"a read again of {worker.url}/v1/models", exc)
            return
        models = parse_models(body)
        if models == before or worker.models is not before or worker.state != "ready":
            return  # the same, or registered anew (its own read is newer) or removed meanwhile
        worker.models = models
        self._count_served()
        log.info(
            "worker %s: /v1/models lists %s now (it listed %s)",
            worker.url,
            list((*models.bases, *models.adapters)),
            list((*before.bases, *before.adapters)),
        )
        if learned := set(models.adapters) - set(before.adapters):
            await self.pump.call(lambda rules: rules.learn_adapters(learned))

    def _count_served(self) -> None:
        """`served_models` anew, from the registered workers' `/v1/models`."""
        self.served_models = frozenset(
            name for worker in self._workers.values() for name in worker.models.bases
        )


async def get_worker_json(
    session: aiohttp.ClientSession,
    url: str,
    limits: aiohttp.ClientTimeout,
    authorization: str | None = None,
) -> Any:
    """A worker's JSON answer at `url` (`/server_info`, `/v1/models`), read within
    `MAX_WORKER_JSON_BYTES`, asked with the `Authorization` field `authorization` if given.
    Raises `_Absent` (the route is not served), `_Unavailable` (a 5xx), `Refused` (a 401 or
    403), ValueError (a redirect, which is never followed, another status, too long, not
    JSON), or the transport's errors: `WORKER_JSON_ERRORS` are all of them."""
    headers = {"Authorization": authorization} if authorization is not None else None
    async with session.get(url, timeout=limits, allow_redirects=False, headers=headers) as resp:
        if is_redirect(resp.status):
            raise ValueError(redirect_not_followed(resp.status, resp.headers.get("Location")))
        if resp.status in (404, 405, 501):
            raise _Absent
        if resp.status >= 500:
            raise _Unavailable(f"HTTP {resp.status}")
        if resp.status in (401, 403):
            raise Refused(resp.status)
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        body = await read_up_to(resp.content, MAX_WORKER_JSON_BYTES)
        if len(body) > MAX_WORKER_JSON_BYTES:
            raise ValueError(f"an answer over {MAX_WORKER_JSON_BYTES} bytes")
        try:
            return msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise ValueError(f"not JSON: {exc}") from None


def is_redirect(status: int) -> bool:
    return 300 <= status < 400


def redirect_not_followed(status: int, location: str | None) -> str:
    """What the logs say of a worker's redirect. None is ever followed: the router fetches
    what it chose of a worker's origin, never what the worker names (a 302 to a metadata
    service was fetched and its answer relayed; a redirect target's snapshot installed)."""
    to = f" to {location[:200]!r}" if location else ""
    return f"answered {status}, a redirect{to}: redirects are not followed"


def subscriber_name(rank: RankId) -> str:
    """The supervised task name of a rank's subscriber (`Supervisor.state` looks it up)."""
    return f"kv-sub {rank.worker_url}#dp{rank.dp_rank}"


def kv_events_change(old: KvEventsInfo | None, new: KvEventsInfo) -> str:
    """What differs between two descriptions of a worker's KV events, for the logs."""
    if old is None:
        return "none known before"
    return ", ".join(
        f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in fields(KvEventsInfo)
        if getattr(old, f.name) != getattr(new, f.name)
    )


def health_failure(answer: PollAnswer, timeout_s: float) -> str:
    """What a failed `/health` check met, for the log line saying the worker is unhealthy."""
    if answer.error == "timeout":
        return f"no answer within {timeout_s:g} s"
    if answer.error == "connection":
        return f"no connection: {answer.detail}" if answer.detail else "no connection"
    if answer.error is not None:
        return f"answered {answer.status}, its body {answer.error.replace('_', ' ')}"
    return f"answered {answer.status}"


def fails_over_in_flight(failed_checks: int) -> bool:
    """Whether the worker's requests waiting for its head fail over at this check (once a
    spell of failed checks): `FAIL_OVER_AFTER_FAILED_CHECKS` in a row."""
    return failed_checks == FAIL_OVER_AFTER_FAILED_CHECKS


def evict_due(unhealthy_since: float | None, now: float, evict_after_s: float) -> bool:
    """Whether a worker failing /health since `unhealthy_since` leaves the index; 0 = never."""
    if evict_after_s <= 0 or unhealthy_since is None:
        return False
    return now - unhealthy_since >= evict_after_s


class TooManyWorkers(Exception):
    """`--max-workers` are registered already."""


class WorkerRemoved(Exception):
    """The worker was removed before its registration ended; nothing of it was kept."""


@dataclass(slots=True)
class _UrlLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # holding or waiting


class _Absent(Exception):
    """The worker does not serve this route."""


class _Unavailable(Exception):
    """The worker answered 5xx: up, but not serving yet (or failing)."""


class Refused(ValueError):
    """The worker answered 401 or 403: it wants credentials (an engine's `--api-key`)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}: the worker wants credentials")
        self.status = status


WORKER_JSON_ERRORS: Final = (_Absent, _Unavailable, aiohttp.ClientError, TimeoutError, ValueError)


def _normalize(url: str) -> str:
    return canonical_origin(url)
