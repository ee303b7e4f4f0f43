"""Prometheus series, all prefixed `kvrouter_`.

Request-path series are instruments updated as requests flow. Everything else (the index,
the streams, breakers, load probes) is read from the components' own counters when Prometheus
scrapes: the hot paths keep plain ints, and the scrape pays for the formatting.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Final

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cachetree import accel
from cachetree.tree import TreeStats
from router.auth import Refusals
from router.breaker import BreakerStatus
from router.dataplane.encodes import MAX_ENCODE_WAIT_S
from router.dataplane.exchange import GENERATION_ROUTES, STALE_WINDOW_S
from router.events import DECODE_ERROR_REASONS
from router.loads import OUT_OF_RANGE_FIELDS, POLL_ERROR_LABELS, poll_error_label
from router.tokenize.chat_rules import FAILURE_REASONS
from router.workers import ADMITTED_STATES, LISTING_READ_REASONS, RESTART_REASONS

if TYPE_CHECKING:
    from cachetree.ranks import RankId
    from peer.endpointslices import SliceDiscovery
    from peer.producer import SnapshotProducer
    from peer.supervise import Supervisor
    from router.bootstrap import PeerBootstrap
    from router.dataplane.server import DataPlane
    from router.homes import HomeTable
    from router.index import Pump
    from router.ingest_pool import IngestPool
    from router.loads import LoadMonitor
    from router.placement import Placement
    from router.policy import CacheAware
    from router.siblings import DecisionSharing
    from router.tokenize import RequestTokenizer
    from router.workers import WorkerRegistry

POLL_LABELS: Final = [(label,) for label in POLL_ERROR_LABELS]
_BREAKER_STATE: Final[dict[BreakerStatus, int]] = {
    "closed": 0,
    "open": 1,
    "half_open": 2,
    "probe_due": 3,
}
# The router's own share of a request's latency is tens of microseconds to a few milliseconds
# when all is well; the upper buckets catch a saturated loop and slow connects to workers.
ADDED_SECONDS_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


@dataclass(slots=True)
class PlainHistogram:
    """A histogram for the request path: an observation is a bisect and two additions on
    plain numbers (prometheus_client's Histogram takes a lock and walks every bucket); the
    collector makes the counts cumulative at scrape."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, then +Inf; not cumulative
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram bounds must increase: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # `le`: a value on a bound is in it
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, n in zip([*map(_le, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


def _le(bound: float) -> str:
    return str(float(bound))  # as prometheus_client writes bucket bounds: "4.0"


MATCHED_BLOCKS_BUCKETS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class LabelledCounts(Counter[tuple[str, ...]]):
    """A counter series kept as plain ints by label values: `counts[route, worker, code] += 1`."""


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The standard process_* and python_* series: CPU, memory and GC pauses are what a
        # router's capacity alerts are written against.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Which implementation of the ingest hot spots this process runs (cachetree.accel):
        # a replica on the pure path spends several times the CPU per KV event.
        Info(
            "kvrouter_accelerator",
            "The ingest accelerator in use: implementation=compiled (cachetree._speedups) or "
            "pure (not built, or KVROUTER_NO_EXTENSIONS set)",
            registry=self.registry,
        ).info({"implementation": accel.IMPLEMENTATION})
        # The request path's series: plain ints bumped per request, formatted at scrape time
        # (a prometheus_client `labels().inc()` costs 1-3 us, several times a request).
        self.requests = LabelledCounts()  # (route, worker, status)
        self.decisions = LabelledCounts()  # (policy, outcome)
        self.matched_blocks = PlainHistogram(MATCHED_BLOCKS_BUCKETS)
        self.upstream_failures = LabelledCounts()  # (worker, reason)
        self.tokenize_failures = LabelledCounts()  # (reason,)
        # Bodies past routing's decode bounds, forwarded unread (`router.dataplane.routing`).
        self.bodies_unread = LabelledCounts()  # (route,)
        # Guarded requests refused for their token, counted by the control app and by the data
        # plane's early check of an `Expect: 100-continue` (`router.auth.Refusals`).
        self.auth_refusals = Refusals()
        self.registry.register(_RequestCollector(self))
        # Every reason exported from the start, at 0: rate() needs a series before its first
        # failure, or the share-of-chats alert would never see the first burst.
        for reason in FAILURE_REASONS:
            self.tokenize_failures[(reason,)] = 0
        for route in sorted(GENERATION_ROUTES):
            self.bodies_unread[(route.decode(),)] = 0
        # Observed by router/dataplane/relay.py when a request's head is written to its first
        # worker: the time the router added (parse, tokenize, route, a pooled or new connection).
        self.added_seconds = PlainHistogram(ADDED_SECONDS_BUCKETS)
        self.registry.register(_AddedLatencyCollector(self.added_seconds))

    def watch_tokenizer(self, tokenizer: RequestTokenizer) -> None:
        self.registry.register(_TokenizerCollector(tokenizer))

    def watch(
        self,
        pump: Pump,
        workers: WorkerRegistry,
        loads: LoadMonitor,
        bootstrap: PeerBootstrap | None = None,
    ) -> None:
        self.registry.register(_StateCollector(pump, workers, loads))
        if bootstrap is not None:
            self.registry.register(_BootstrapCollector(bootstrap))

    def watch_discovery(self, discovery: SliceDiscovery) -> None:
        self.registry.register(_DiscoveryCollector(discovery))

    def watch_tasks(self, supervisor: Supervisor) -> None:
        self.registry.register(_TaskCollector(supervisor))

    def forget_worker(self, url: str) -> None:
        """A worker left the registry: its request and failure series go with it (a worker
        address is a label, and a fleet that rolls its pods would grow them forever). Its
        requests still in flight count under `worker="removed"` (`relay._worker_label`)."""
        for counts, at in ((self.requests, 1), (self.upstream_failures, 0)):
            for labels in [k for k in counts if k[at] == url]:
                del counts[labels]

    def watch_dataplane(self, plane: DataPlane) -> None:
        self.registry.register(_DataPlaneCollector(plane))

    def watch_pressure(self, policy: CacheAware, workers: WorkerRegistry) -> None:
        self.registry.register(_PressureCollector(policy, workers))

    def watch_homes(self, table: HomeTable) -> None:
        self.registry.register(_HomesCollector(table))

    def watch_sharing(self, sharing: DecisionSharing) -> None:
        self.registry.register(_SharingCollector(sharing))

    def watch_placement(self, placement: Placement) -> None:
        self.registry.register(_PlacementCollector(placement))

    def watch_ingest(self, pool: IngestPool) -> None:
        self.registry.register(_IngestCollector(pool))

    def watch_producer(self, producer: SnapshotProducer) -> None:
        self.registry.register(_ProducerCollector(producer))


class _AddedLatencyCollector(Collector):
    def __init__(self, histogram: PlainHistogram) -> None:
        self._histogram = histogram

    def collect(self) -> Iterator[Metric]:
        yield self._histogram.family(
            "kvrouter_request_added_seconds",
            "Latency the router added to a routed request: from its turn to be answered (its "
            "last byte received, unless pipelined behind another) to its head written to the "
            "first worker tried",
        )


class _TaskCollector(Collector):
    """Background loops (`peer.supervise`): their failures, and those that cannot be kept up."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        supervisor = self._supervisor
        # Every kind running or ever failed, at 0 until it fails: a flat line on the panel,
        # and a series for rate() before the first failure.
        kinds = sorted(supervisor.running_kinds() | supervisor.failures.keys())
        yield _counter(
            "kvrouter_task_failures",
            "Failures of background loops by kind (each logged with its traceback, then "
            "retried with backoff)",
            ["task"],
            {(kind,): supervisor.failures[kind] for kind in kinds},
        )
        failing = Counter(task.kind for task in supervisor.failing())
        yield _gauge(
            "kvrouter_tasks_failing",
            "Background loops failing over and over (a critical one turns /readyz 503)",
            [((kind,), failing[kind]) for kind in kinds],
            ["task"],
        )


class _StateCollector(Collector):
    def __init__(self, pump: Pump, workers: WorkerRegistry, loads: LoadMonitor) -> None:
        self._pump = pump
        self._workers = workers
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        rules = self._pump.rules
        stats = rules.stats
        tree = rules.tree
        # Known from --block-size before the first registration makes the index; else 0.
        block_size = tree.block_size if tree else self._workers.block_size or 0
        yield _gauge("kvrouter_block_size", "Fleet KV block size", [((), block_size)])
        yield _gauge(
            "kvrouter_tree_nodes",
            "Nodes in the block index, a worker snapshot's being installed included",
            [((), len(tree) if tree else 0)],
        )
        blocks = GaugeMetricFamily(
            "kvrouter_tree_blocks",
            "Blocks per rank and tier",
            labels=["worker_url", "dp_rank", "tier"],
        )
        if tree is not None:
            for (rank, tier), n in tree.block_counts().items():
                blocks.add_metric([rank.worker_url, str(rank.dp_rank), tier], n)
        yield blocks
        # Every admitted rank, as GET /workers lists it: one holding nothing (a restarted
        # engine's) or with no batch applied yet too, not only the ranks the index carries.
        admitted = _admitted_ranks(self._workers) if tree is not None else []
        # Summing kvrouter_tree_blocks over tiers counts a block held on two tiers twice.
        yield _gauge(
            "kvrouter_index_rank_blocks",
            "Blocks per rank on any tier, a block on two tiers once (GET /workers' blocks)",
            [
                ((r.worker_url, str(r.dp_rank)), tree.block_count(r))
                for r in dict.fromkeys([*admitted, *tree.ranks()])
            ]
            if tree is not None
            else [],
            ["worker_url", "dp_rank"],
        )
        yield _counter(
            "kvrouter_kv_events",
            "KV events received in batches the pump took, by kind and medium (an engine's tier "
            "name, none when absent, other for any other string; those the index could not "
            "apply: kvrouter_kv_events_refused_total)",
            ["event", "medium"],
            dict(stats.events),
        )
        refused = tree.stats if tree is not None else TreeStats()
        yield _counter(
            "kvrouter_kv_events_refused",
            "Stores the index dropped and removed hashes it did not carry, by reason: a parent "
            "the rank does not carry (events lost before it), a medium with no tier, another "
            "block size, a token count that does not fit; unknown_removal counts hashes",
            ["reason"],
            {(f.name,): getattr(refused, f.name) for f in fields(TreeStats)},
        )
        yield _counter(
            "kvrouter_kv_events_ignored",
            "Valid KV events not indexed, by reason",
            ["reason"],
            {(reason,): n for reason, n in stats.ignored_events.items()},
        )
        yield _counter(
            "kvrouter_kv_event_batches_lost",
            "Batches a rank's stream skipped that replay did not recover",
            ["worker_url", "dp_rank"],
            {(r.worker_url, str(r.dp_rank)): n for r, n in stats.lost_batches.items()},
        )
        yield _counter(
            "kvrouter_kv_batches",
            "Event batches by what the pump did with them",
            ["result"],
            {
                ("applied",): stats.batches_applied,
                ("already_reflected",): stats.batches_skipped,
                ("not_live",): stats.batches_dropped_not_live,
            },
        )
        yield _counter(
            "kvrouter_kv_publisher_resets",
            "Engine restarts seen on a stream (END_SEQ, seq regression, or seq 0 again)",
            [],
            {(): stats.publisher_resets + stats.restarts_at_zero},
        )
        yield _gauge(
            "kvrouter_kv_cursor",
            "Per rank, the seq of the last event batch applied: where the replica is in the "
            "rank's stream (a replica behind its siblings lags by the difference); -1 before "
            "the first",
            [
                ((r.worker_url, str(r.dp_rank)), rules.cursors.get(r, -1))
                for r in dict.fromkeys([*admitted, *rules.cursors])
            ],
            ["worker_url", "dp_rank"],
        )
        yield _gauge(
            "kvrouter_pump_backlog", "Items queued for the pump", [((), self._pump.backlog)]
        )
        yield _gauge(
            "kvrouter_index_carried_blocks",
            "(rank, block) pairs in the index, what --kv-index-max-blocks caps",
            [((), tree.carried_blocks if tree else 0)],
        )
        yield _gauge(
            "kvrouter_index_cold_ranks",
            "Ranks whose view may miss blocks the engine holds (the stream joined past its "
            "start, batches lost, cleared at the cap, or grafted from a sibling cold for "
            "them); a joining sibling prefers a sibling not cold for a rank",
            [((), len(rules.cold))],
        )
        yield _gauge(
            "kvrouter_index_rank_cold",
            "1 per rank counted in kvrouter_index_cold_ranks (its view may miss blocks)",
            [((r.worker_url, str(r.dp_rank)), 1) for r in rules.cold],
            ["worker_url", "dp_rank"],
        )
        yield _gauge(
            "kvrouter_index_max_blocks",
            "The index cap (--kv-index-max-blocks); 0 when there is none",
            [((), rules.max_blocks or 0)],
        )
        yield _counter(
            "kvrouter_index_cap_clears",
            "Ranks cleared because the index went over its cap (the rank carrying the most)",
            ["worker_url", "dp_rank"],
            {(r.worker_url, str(r.dp_rank)): n for r, n in stats.cap_clears.items()},
        )
        yield _counter(
            "kvrouter_index_cap_cleared_blocks",
            "Blocks forgotten by cap clears",
            [],
            {(): stats.cap_cleared_blocks},
        )
        replay: Counter[str] = Counter()
        decode_errors: Counter[str] = Counter()
        bad_frames = 0
        duplicates = 0
        seq_jumps = stats.seq_jumps
        disconnects = 0
        breaker_state = []
        breaker_trips = {}
        worker_states: Counter[tuple[str, str]] = Counter({(s, ""): 0 for s in ADMITTED_STATES})
        for worker in self._workers.workers():
            refused = worker.state == "refused"
            worker_states[(worker.state, worker.refused_for if refused else "")] += 1
            for sub in worker.subscriber_stats.values():
                replay.update(sub.replay)
                decode_errors.update(sub.decode_errors)
                bad_frames += sub.bad_frames
                duplicates += sub.duplicates
                seq_jumps += sub.seq_jumps
                disconnects += sub.disconnects
            breaker_state.append(((worker.url,), _BREAKER_STATE[worker.breaker.status]))
            breaker_trips[(worker.url,)] = worker.breaker.trips
        yield _counter(
            "kvrouter_kv_replay",
            "Replay requests by outcome",
            ["outcome"],
            {(k,): v for k, v in replay.items()},
        )
        yield _counter(
            "kvrouter_kv_decode_errors",
            "Event payloads dropped because they did not decode (each reason at 0 from the "
            "start, for rate() and the alert on the first)",
            ["reason"],
            {(k,): decode_errors[k] for k in sorted(DECODE_ERROR_REASONS | decode_errors.keys())},
        )
        yield _counter(
            "kvrouter_kv_bad_frames", "Malformed ZMQ messages dropped", [], {(): bad_frames}
        )
        yield _counter(
            "kvrouter_kv_duplicate_batches",
            "Batches at their rank's last seq again (not 0), dropped: a batch sent again, "
            "not an engine restart (nothing cleared, nothing counted lost)",
            [],
            {(): duplicates},
        )
        yield _counter(
            "kvrouter_kv_seq_jumps",
            "Forward seq jumps past 2**20 batches, handled as a new stream (not counted lost)",
            [],
            {(): seq_jumps},
        )
        yield _counter(
            "kvrouter_kv_disconnects",
            "Publisher connections that dropped (peer gone, or an oversized or malformed "
            "message); the subscriber connects again and the loss shows as a gap",
            [],
            {(): disconnects},
        )
        yield _gauge(
            "kvrouter_breaker_state",
            "Circuit breaker: 0 closed, 1 open (refusing requests), 2 half-open (its probe "
            "out), 3 probe due (the cooldown passed: the next request routed there is the probe)",
            breaker_state,
            ["worker"],
        )
        yield _counter(
            "kvrouter_breaker_trips", "Times a breaker opened", ["worker"], breaker_trips
        )
        registry_stats = self._workers.stats
        yield _gauge(
            "kvrouter_rank_subscriptions",
            "Worker ranks subscribed to, and how many the socket budget allows (open files, "
            "ZMQ sockets); a worker past it is refused with reason socket_limit",
            [(("in_use",), self._workers.subscribed_ranks)]
            + (
                [(("budget",), self._workers.max_ranks)]
                if self._workers.max_ranks is not None
                else []
            ),
            ["kind"],
        )
        yield _counter(
            "kvrouter_workers_refused",
            "Workers refused at registration, by reason",
            ["reason"],
            {(k,): v for k, v in registry_stats.refused.items()},
        )
        yield _counter(
            "kvrouter_worker_evictions",
            "Ready workers whose ranks left the index after failing /health too long",
            [],
            {(): registry_stats.evictions},
        )
        yield _counter(
            "kvrouter_worker_restarts",
            "Ready workers taken as restarted: kv_events_changed, their /server_info describes "
            "other KV-event ranks (registered anew); suspected, /health failed and their event "
            "connections dropped in between; listener_gone, a dropped connection's reconnect "
            "was refused, nothing listened on the port (both: their ranks cleared and "
            "re-learned)",
            ["reason"],
            {(reason,): registry_stats.restarts[reason] for reason in RESTART_REASONS},
        )
        yield _counter(
            "kvrouter_ranks_distrusted",
            "Ranks cleared because the index held more device blocks than the engine reports "
            "it can (made-up or lost removals); re-learned from the worker",
            [],
            {(): registry_stats.distrusted},
        )
        yield _counter(
            "kvrouter_worker_listing_reads",
            "Reads again of the routable workers' /v1/models begun (one read of each), by "
            "reason: unlisted_model, a request named a model no listing holds (at most one "
            "per 5 s); refresh, the health loop's every --worker-models-refresh-s",
            ["reason"],
            {(reason,): registry_stats.listing_reads[reason] for reason in LISTING_READ_REASONS},
        )
        yield _counter(
            "kvrouter_worker_snapshot_pulls",
            "Pulls of workers' /v1/kv-snapshot by outcome",
            ["outcome"],
            {(k,): v for k, v in registry_stats.snapshot_pulls.items()},
        )
        yield _gauge(
            "kvrouter_workers",
            "Registered workers by state (discovering, ready, down: at 0 too), and refused by "
            "reason: a refused one stays listed, takes no traffic and is looked at again until "
            "its engine is fixed",
            list(worker_states.items()),
            ["state", "reason"],
        )
        yield _gauge(
            "kvrouter_worker_healthy",
            "1 when the worker passes its health check (a refused worker is not checked and "
            'not listed: kvrouter_workers{state="refused"} counts it)',
            [((w.url,), int(w.healthy)) for w in self._workers.workers() if w.state != "refused"],
            ["worker"],
        )
        yield _counter(
            "kvrouter_load_probe",
            "Load probes of /v1/loads by outcome",
            ["outcome"],
            {(str(k),): v for k, v in self._loads.probe_outcomes.items()},
        )
        poll_errors: Counter[tuple[str, ...]] = Counter(dict.fromkeys(POLL_LABELS, 0))
        for reason, n in self._loads.poll_errors.items():
            poll_errors[(poll_error_label(reason),)] += n
        yield _counter(
            "kvrouter_load_poll_errors",
            "Worker load reads that yielded no loads, by reason (timeout, connection, "
            "too_large: the body past its bound, http_4xx/5xx, unparseable or too_many_samples "
            "/metrics, no_load_metrics, empty_loads, internal)",
            ["reason"],
            poll_errors,
        )
        yield _counter(
            "kvrouter_load_values_out_of_range",
            "Figures a worker stated above 2**48, or a KV capacity below one block, read as "
            "unknown, by field",
            ["field"],
            {(f,): self._loads.out_of_range[f] for f in OUT_OF_RANGE_FIELDS},
        )


class _BootstrapCollector(Collector):
    """The peer-bootstrap series (reference section 7.2, with our prefix)."""

    def __init__(self, bootstrap: PeerBootstrap) -> None:
        self._bootstrap = bootstrap

    def collect(self) -> Iterator[Metric]:
        b = self._bootstrap
        tracker = b.tracker
        yield _gauge(
            "kvrouter_kv_bootstrap_settled",
            "1 once every rank settled or --kv-bootstrap-timeout-ms passed; /readyz also "
            "needs the seed gate with --kv-bootstrap-seed-required (seed_failed)",
            [((), int(tracker.settled()))],
        )
        yield _gauge(
            "kvrouter_kv_bootstrap_seed_failed",
            "1 after a sweep over live siblings timed out, until one finds a snapshot; with "
            "--kv-bootstrap-seed-required it holds /readyz, at most max(3 x timeout, 60 s)",
            [((), int(tracker.seed_failed))],
        )
        yield _gauge(
            "kvrouter_kv_bootstrap_state",
            "Per rank: 0 pending, 1 recovered, 2 failed",
            [
                ((rank.worker_url, str(rank.dp_rank)), state.gauge)
                for rank, state in tracker.states().items()
            ],
            ["worker_url", "dp_rank"],
        )
        yield _counter(
            "kvrouter_kv_peer_snapshot",
            "Sibling snapshot fetches by outcome",
            ["outcome"],
            {(k,): v for k, v in b.snapshot_outcomes.items()},
        )
        yield _counter(
            "kvrouter_kv_peer_snapshot_gaps",
            "Rank grafts whose live stream did not join the snapshot, by the sibling (or "
            "worker) it came from: one that keeps appearing is lagging (check its event stream)",
            ["peer"],
            {(k,): v for k, v in b.gaps_by_source().items()},
        )
        yield _counter(
            "kvrouter_kv_bootstrap_rank",
            "Bootstrap verdicts, once per rank incarnation",
            ["outcome"],
            {(str(k),): v for k, v in tracker.rank_outcomes.items()},
        )
        yield _counter(
            "kvrouter_kv_bootstrap_grafts",
            "Ranks grafted, by source (a sibling, or the worker's own snapshot)",
            ["source"],
            {(k,): v for k, v in b.sources.items()},
        )
        yield _counter(
            "kvrouter_kv_bootstrap_sweep",
            "Bootstrap sweeps by result",
            ["result"],
            {(str(k),): v for k, v in tracker.sweep_outcomes.items()},
        )
        yield _gauge("kvrouter_kv_bootstrap_peers", "Known siblings", [((), len(b.registry.peers))])
        yield _gauge(
            "kvrouter_kv_bootstrap_peers_synced",
            "1 once the sibling list was delivered",
            [((), int(b.registry.synced))],
        )
        if b.ready_at is not None:
            yield _gauge(
                "kvrouter_kv_bootstrap_duration_seconds",
                "From start to the first admitted readiness",
                [((), b.ready_at - b.started_at)],
            )


def _admitted_ranks(workers: WorkerRegistry) -> list[RankId]:
    """The ranks of the workers admitted (ready) only: a refused worker's dp size is whatever
    it claimed (200,000 ranks were 400,000 series and seconds of a scrape on the loop)."""
    return [r for w in workers.workers() if w.state == "ready" for r in w.ranks()]


def _gauge(
    name: str, doc: str, rows: list[tuple[tuple[str, ...], float]], labels: list[str] | None = None
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels or [])
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


class _IngestCollector(Collector):
    """The ingest processes (--kv-ingest-processes): their restarts, hangs and what they sent."""

    def __init__(self, pool: IngestPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        pool = self._pool
        yield _gauge(
            "kvrouter_kv_ingest_ranks",
            "Ranks each ingest process subscribes to",
            [((str(i),), n) for i, n in enumerate(pool.ranks_per_process())],
            ["process"],
        )
        yield _counter(
            "kvrouter_kv_ingest_restarts",
            "Ingest processes started again after they exited (their ranks see a gap)",
            ["process"],
            {(str(i),): pool.stats.restarts[i] for i in range(pool.processes)},
        )
        yield _counter(
            "kvrouter_kv_ingest_hung",
            "Ingest processes killed as hung: silent, not even a heartbeat, past "
            "--kv-ingest-silence-s (each then started again, counted in restarts too)",
            ["process"],
            {(str(i),): pool.stats.hung[i] for i in range(pool.processes)},
        )
        yield _counter(
            "kvrouter_kv_ingest_bad_messages",
            "Messages from ingest processes that did not decode (dropped; a bug)",
            [],
            {(): pool.stats.bad_messages},
        )


class _ProducerCollector(Collector):
    """The snapshot producer: what its cached export holds (dropped at its max_age)."""

    def __init__(self, producer: SnapshotProducer) -> None:
        self._producer = producer

    def collect(self) -> Iterator[Metric]:
        yield _gauge(
            "kvrouter_kv_snapshot_cached_bytes",
            "Bytes held by the cached export of the index served to siblings (0 once it "
            "expired); count them in the replica's memory budget",
            [((), self._producer.cached_bytes)],
            [],
        )
        yield _counter(
            "kvrouter_kv_snapshot_exports",
            "Exports of the index built for siblings",
            [],
            {(): self._producer.stats.builds},
        )


class _DiscoveryCollector(Collector):
    """The EndpointSlice watches: what each publishes, how often it relisted and failed."""

    def __init__(self, discovery: SliceDiscovery) -> None:
        self._discovery = discovery

    def collect(self) -> Iterator[Metric]:
        watches = self._discovery.watches
        yield _gauge(
            "kvrouter_discovery_urls",
            "URLs the EndpointSlice watch currently publishes (siblings or workers)",
            [((w.what,), len(w.view.urls)) for w in watches],
            ["what"],
        )
        yield _counter(
            "kvrouter_discovery_relists",
            "Complete EndpointSlice lists that replaced the watch's view",
            ["what"],
            {(w.what,): w.stats.relists for w in watches},
        )
        yield _counter(
            "kvrouter_discovery_events",
            "EndpointSlice watch events by type",
            ["what", "type"],
            {(w.what, kind): n for w in watches for kind, n in w.stats.events.items()},
        )
        yield _counter(
            "kvrouter_discovery_failures",
            "EndpointSlice list/watch failures by reason (http_403: RBAC; expired: a relist; "
            "cut: a watch whose connection broke after it ran, watched again at once)",
            ["what", "reason"],
            {(w.what, why): n for w in watches for why, n in w.stats.failures.items()},
        )


class _PressureCollector(Collector):
    """cache_aware's view of cache pressure: per rank what the engine can hold and the slots it
    states, this replica's recent demand and bookings; the bookings' outcomes and the spills it
    chose."""

    def __init__(self, policy: CacheAware, workers: WorkerRegistry) -> None:
        self._policy = policy
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        policy = self._policy
        policy.settle()
        ledger = policy.ledger
        ranks = _admitted_ranks(self._workers)
        loads = self._workers.loads
        capacity, demand, booked, pressure, slots = [], [], [], [], []
        for rank, d in zip(ranks, ledger.demands(ranks), strict=True):
            labels = (rank.worker_url, str(rank.dp_rank))
            demand.append((labels, d))
            booked.append((labels, ledger.pending(rank)))
            blocks = policy.capacity(rank)
            if blocks:
                capacity.append((labels, blocks))
                pressure.append((labels, d / blocks))
            engine = loads.get(rank.worker_url, rank.dp_rank)
            if engine is not None and engine.slots is not None:
                slots.append((labels, engine.slots))
        rank_labels = ["worker_url", "dp_rank"]
        yield _gauge(
            "kvrouter_rank_capacity_blocks",
            "Blocks the rank's engine can hold (its stated KV pool over the block size)",
            capacity,
            rank_labels,
        )
        yield _gauge(
            "kvrouter_rank_slots",
            "Requests the rank's engine runs at once, as it states them (SGLang "
            "max_running_requests); the queue term prices those beside a free slot at a share",
            slots,
            rank_labels,
        )
        yield _gauge(
            "kvrouter_rank_demand_blocks",
            "This replica's recent demand on the rank: distinct blocks routed, decayed",
            demand,
            rank_labels,
        )
        yield _gauge(
            "kvrouter_rank_pressure",
            "Recent demand over capacity (above 1: the rank cannot keep what it is sent)",
            pressure,
            rank_labels,
        )
        yield _gauge(
            "kvrouter_rank_booked_blocks",
            "Blocks booked on the rank whose store events have not arrived yet",
            booked,
            rank_labels,
        )
        yield _gauge(
            "kvrouter_bookings_held",
            "Bookings (routed prompts) neither confirmed by the index nor expired yet",
            [((), sum(ledger.live_bookings(rank) for rank in ledger.ranks()))],
        )
        stats = ledger.bookings
        yield _counter(
            "kvrouter_bookings",
            "Bookings by how they ended: confirmed (the index showed the blocks), expired, "
            "moved (the proxy failed over and another rank served the prompt), refused (the "
            "engine answered a 4xx: it cached nothing), or departed (the rank's worker left "
            "the registry)",
            ["outcome"],
            {
                ("confirmed",): stats.confirmed,
                ("expired",): stats.expired,
                ("moved",): stats.moved,
                ("refused",): stats.refused,
                ("departed",): stats.departed,
            },
        )
        yield _counter(
            "kvrouter_pressure_spills",
            "Decisions whose chosen rank had to evict blocks of its recent demand",
            [],
            {(): policy.spill_stats.spills},
        )
        yield _counter(
            "kvrouter_pressure_spilled_blocks",
            "Blocks of recent demand those decisions evicted",
            [],
            {(): policy.spill_stats.spilled_blocks},
        )


def _counter(
    name: str, doc: str, labels: list[str], rows: dict[tuple[str, ...], float]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for values, value in rows.items():
        family.add_metric(list(values), value)
    return family


class _HomesCollector(Collector):
    """The prefix home table (`router.homes`, --prefix-homes)."""

    def __init__(self, table: HomeTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        table = self._table
        table.forget()
        yield _gauge(
            "kvrouter_prefix_homes",
            "Prefix homes this replica keeps (its own and its siblings'; tails included)",
            [((), len(table))],
        )
        yield _gauge(
            "kvrouter_rank_homed_blocks",
            "Prefix blocks homed on the rank, each home's halved every half-life since its use",
            [((rank.worker_url, str(rank.dp_rank)), table.homed(rank)) for rank in table.ranks()],
            ["worker_url", "dp_rank"],
        )
        stats = table.stats
        yield _counter(
            "kvrouter_prefix_home_events",
            "Prefix homes: placed (a new prefix given a home here), replaced (a home that lost "
            "its prefix to its cache, placed again), kept_away (a homed request sent elsewhere: "
            "its home over the keep bound), adopted (a sibling's home or news of one), "
            "forgotten (unused too long), evicted (at --prefix-homes-max)",
            ["outcome"],
            {
                ("placed",): stats.placed,
                ("replaced",): stats.replaced,
                ("kept_away",): stats.kept_away,
                ("adopted",): stats.adopted,
                ("forgotten",): stats.forgotten,
                ("evicted",): stats.evicted,
            },
        )


class _SharingCollector(Collector):
    """Decision sharing with the sibling replicas (`router.siblings`)."""

    def __init__(self, sharing: DecisionSharing) -> None:
        self._sharing = sharing

    def collect(self) -> Iterator[Metric]:
        stats = self._sharing.stats
        yield _counter(
            "kvrouter_shared_decisions",
            "Routing decisions shared with sibling replicas: sent (taken by a sibling, once "
            "per sibling), dropped (outbox full while siblings were slow), received (adopted "
            "into this replica's ledger), homes_received (prefix homes adopted), unknown (for "
            "a rank this replica does not know), skipped (not posted to a sibling backing off "
            "after failures)",
            ["outcome"],
            {
                ("sent",): stats.sent,
                ("dropped",): stats.dropped,
                ("received",): stats.received,
                ("homes_received",): stats.homes_received,
                ("unknown",): stats.unknown,
                ("skipped",): stats.skipped,
            },
        )
        yield _counter(
            "kvrouter_shared_decision_failures",
            "Decision batches that failed: posts a sibling refused or did not answer "
            "(`post`), received batches refused as malformed (`refused`)",
            ["kind"],
            {("post",): stats.failed, ("refused",): stats.refused},
        )


class _PlacementCollector(Collector):
    """New prefixes placed by the placer replica (`router.placement`)."""

    def __init__(self, placement: Placement) -> None:
        self._placement = placement

    def collect(self) -> Iterator[Metric]:
        yield _counter(
            "kvrouter_placements",
            "New prefixes and the placer: asked (questions sent to the placer), answered "
            "(routed to its rank), unusable (its rank is not a healthy candidate here), "
            "timeout and error (decided here instead), busy (decided here: too many questions "
            "in flight, or the placer backing off after failures), local (placed here, this "
            "replica being the placer), placed (siblings' questions this replica answered)",
            ["outcome"],
            {(outcome,): count for outcome, count in self._placement.counts.items()},
        )


class _TokenizerCollector(Collector):
    """The segment cache of the chat tokenizer (router/tokenize/segments.py), read at scrape."""

    def __init__(self, tokenizer: RequestTokenizer) -> None:
        self._tokenizer = tokenizer

    def collect(self) -> Iterator[Metric]:
        cache = self._tokenizer.segment_cache
        if cache is None:
            return
        yield _counter(
            "kvrouter_tokenize_cache_lookups",
            "Chat segments looked up in the tokenization cache, by result",
            ["result"],
            {("hit",): cache.hits, ("miss",): cache.misses},
        )
        yield _gauge(
            "kvrouter_tokenize_cache_bytes",
            "Bytes the tokenization cache holds (bounded by --tokenize-cache-mb)",
            [((), cache.bytes)],
        )


class _RequestCollector(Collector):
    """The request path's per-request series (`RouterMetrics.requests` and its siblings)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        yield _counter(
            "kvrouter_requests",
            "Client requests by route, the worker that answered and its status (worker none: "
            "the router's own answer, a refusal at the HTTP layer included; worker removed: "
            "a worker answering after it left the registry; route other: its head did not "
            "parse, or a path that is not a generation route)",
            ["route", "worker", "status"],
            dict(m.requests),
        )
        yield _counter(
            "kvrouter_routing_decisions",
            "Routing decisions by policy and outcome",
            ["policy", "outcome"],
            dict(m.decisions),
        )
        yield m.matched_blocks.family(
            "kvrouter_matched_blocks", "Leading prompt blocks the chosen rank held"
        )
        yield _counter(
            "kvrouter_upstream_failures",
            "Upstream attempts that failed before the first byte and were failed over (worker "
            "removed: one that failed after its worker left the registry)",
            ["worker", "reason"],
            dict(m.upstream_failures),
        )
        yield _counter(
            "kvrouter_tokenize_failures",
            "Chat requests the router could not render as the engine would, routed by load as "
            "misses, by reason (see router/tokenize/chat_rules.py FAILURE_REASONS)",
            ["reason"],
            dict(m.tokenize_failures),
        )
        yield _counter(
            "kvrouter_bodies_unread",
            "Request bodies past what the router decodes on its loop (more JSON values or "
            "object keys than any real request), by route: forwarded unread, routed by load "
            "as a miss (a chat's also counts as a tokenize failure, too_large)",
            ["route"],
            dict(m.bodies_unread),
        )
        yield _counter(
            "kvrouter_auth_refusals",
            "Requests to the guarded routes (/workers, /internal/*) refused for their bearer "
            "token (missing, wrong, or none configured here), by route family: workers, "
            "snapshot, decisions, placement, other",
            ["route"],
            {(route,): n for route, n in m.auth_refusals.counts.items()},
        )


class _DataPlaneCollector(Collector):
    """The request path's connections: clients open, refused and closed; upstream pools."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane

    def collect(self) -> Iterator[Metric]:
        plane = self._plane
        stats = plane.stats
        yield _gauge(
            "kvrouter_client_connections", "Open client connections", [((), len(plane.connections))]
        )
        yield _counter(
            "kvrouter_client_connections_refused",
            "Client connections refused at --max-connections (answered 503 and closed)",
            [],
            {(): stats.connections_refused},
        )
        yield _counter(
            "kvrouter_client_connections_closed",
            "Client connections the router closed, by reason (idle, head_timeout, write_timeout, "
            "body_timeout, malformed, refused, cut, drain, ...)",
            ["reason"],
            {(k,): v for k, v in stats.closed.items()},
        )
        yield _counter(
            "kvrouter_answers_broken",
            "Answers that did not end cleanly: cut (the worker's stream broke after the first "
            "byte) or gone (the client left first, routed or still waiting for its long prompt's "
            "encode or its placer's answer)",
            ["outcome"],
            {(k,): stats.ended[k] for k in ("cut", "gone")},
        )
        yield _counter(
            "kvrouter_upstream_safe_retries",
            "Requests resent once because a reused idle connection was found closed within "
            f"{STALE_WINDOW_S:g} s of the request's write (the worker's idle close crossed it)",
            [],
            {(): stats.safe_retries},
        )
        yield _counter(
            "kvrouter_routing_deferred",
            "Requests that waited a turn of the event loop for routing: the replica is "
            "saturated (routing work per turn is capped so probes and streams keep moving)",
            [],
            {(): stats.routing_deferred},
        )
        encodes = plane.encodes
        yield _counter(
            "kvrouter_tokenize_offloads",
            "Prompts past --tokenize-offload-chars, by outcome: started (encoded in a worker "
            "thread), busy (the threads' queue was full) or late (no thread took it within "
            f"{MAX_ENCODE_WAIT_S:g} s): the last two routed by load as misses",
            ["outcome"],
            {("started",): encodes.started, ("busy",): encodes.busy, ("late",): encodes.late},
        )
        yield _counter(
            "kvrouter_upstream_connects",
            "Connections opened to workers",
            [],
            {(): stats.upstream_connects},
        )
        yield _gauge(
            "kvrouter_upstream_connections",
            "Connections to each worker (connecting, busy and idle)",
            [((url,), pool.total) for url, pool in plane.pools.items()],
            ["worker"],
        )
