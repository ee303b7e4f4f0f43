#!/usr/bin/env python3
"""Write manifests/observability/dashboard.json, the Grafana dashboard of a kvrouter fleet.

The JSON is generated from the panel table below, so adding a panel for a new series is one
entry in `ROWS` (a title, a description, a unit, and its PromQL with a legend), then running
`python3 scripts/dashboard.py`. With `--check` it writes nothing and exits 1 when the
checked-in JSON is not what the table generates (tests/unit/test_observability.py runs it).

Counters of rare events that appear with their first one (a label per outcome or reason:
failovers, lost batches, replays, discovery failures) are drawn as totals since the replica
started, not as rates: `rate()` needs two samples of a series, so it never shows the event
that created it, and the first failover would draw as a flat 0.

Every router query filters on the dashboard's variables `namespace`, `job` and `instance`
(`_sel`) and every panel reads from the `datasource` variable, never from a hard-coded data
source UID, so the file imports into any Grafana, and the dashboard sidecar of
kube-prometheus-stack loads it from the ConfigMap as it is. Rates use Grafana's
`$__rate_interval` (at least four scrape intervals).

Stdlib only: it runs with any python3.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

OUT: Final = Path(__file__).resolve().parents[1] / "manifests" / "observability" / "dashboard.json"
TITLE: Final = "kvrouter fleet"
UID: Final = "kvrouter-fleet"  # the dashboard's own, so links and provisioning stay stable
DATASOURCE: Final = {"type": "prometheus", "uid": "${datasource}"}
RATE: Final = "$__rate_interval"
ROUTED: Final = 'worker!="none"'  # answered by a worker, not by the router itself
NOT_2XX: Final = 'status!~"2.."'
CHATS: Final = 'route="/v1/chat/completions"'
NOT_EMBEDS: Final = 'reason!="embeds"'  # prompts as embeddings: not chats, not failures
HIT: Final = 'result="hit"'
GRID_WIDTH: Final = 24
PANEL_HEIGHT: Final = 8


def _sel(extra: str = "") -> str:
    """The router replicas' selector (the ServiceMonitor's job is the Service name)."""
    base = 'namespace=~"$namespace", job=~"$job", instance=~"$instance"'
    return "{" + (f"{base}, {extra}" if extra else base) + "}"


def _engines() -> str:
    """The engines' selector: another job; the namespace is what ties them to this fleet."""
    return '{namespace=~"$namespace"}'


def _rate(series: str, extra: str = "") -> str:
    return f"rate({series}{_sel(extra)}[{RATE}])"


def _quantile(q: float, buckets: str, by: str = "") -> str:
    """The `q` quantile of a histogram's buckets over the selected replicas (or per `by`)."""
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({_rate(buckets)}))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 8
    stack: bool = False


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


ROWS: Final = (
    Row(
        "Requests",
        (
            Panel(
                "Requests by route and status",
                "Client requests answered per second (kvrouter_requests_total), by route and "
                "HTTP status. A 4xx is the client's; a 502 or 503 is the fleet's.",
                "reqps",
                (
                    Query(
                        f"sum by (route, status) ({_rate('kvrouter_requests_total')})",
                        "{{route}} {{status}}",
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Requests by worker",
                "Requests each worker answered per second, over all replicas: where the "
                "routing sends the traffic.",
                "reqps",
                (
                    Query(
                        f"sum by (worker) ({_rate('kvrouter_requests_total', ROUTED)})",
                        "{{worker}}",
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Answers that were not 2xx",
                "Answers per second that were not 2xx, by route and status: 4xx are the "
                "clients' (a malformed body); 502 means every ranked attempt failed (a 5xx "
                "from the last worker tried is relayed as it is), 503 no healthy worker, or "
                "none with a connection free in time.",
                "reqps",
                (
                    Query(
                        f"sum by (route, status) ({_rate('kvrouter_requests_total', NOT_2XX)})",
                        "{{route}} {{status}}",
                    ),
                ),
            ),
            Panel(
                "Failed-over attempts",
                "Upstream attempts that failed before the first byte and went to the next "
                "ranked rank, since each replica started (kvrouter_upstream_failures_total): "
                "a step is a failover the client did not see.",
                "short",
                (
                    Query(
                        f"sum by (worker, reason) (kvrouter_upstream_failures_total{_sel()})",
                        "{{worker}} {{reason}}",
                    ),
                ),
            ),
            Panel(
                "Added latency",
                "What the router adds to a routed request: from its last byte received (its "
                "turn, when pipelined) to its head written to the first worker tried: parsing, "
                "tokenizing, routing, a pooled or new connection (kvrouter_request_added_seconds)."
                " The fleet's median and 99th percentile, and each replica's 99th.",
                "s",
                (
                    Query(_quantile(0.5, "kvrouter_request_added_seconds_bucket"), "p50"),
                    Query(_quantile(0.99, "kvrouter_request_added_seconds_bucket"), "p99"),
                    Query(
                        _quantile(0.99, "kvrouter_request_added_seconds_bucket", "instance"),
                        "p99 {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Answers that broke after their first byte",
                "Answers per second that did not end cleanly (kvrouter_answers_broken_total): "
                "cut, the worker's stream broke (the client sees a truncated answer); gone, "
                "the client left first (the worker is stopped).",
                "ops",
                (
                    Query(
                        f"sum by (instance, outcome) ({_rate('kvrouter_answers_broken_total')})",
                        "{{outcome}} {{instance}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Connections",
        (
            Panel(
                "Client connections",
                "Open client connections per replica (kvrouter_client_connections), and those "
                "refused per second at --max-connections (answered 503 and closed).",
                "short",
                (
                    Query(
                        f"sum by (instance) (kvrouter_client_connections{_sel()})",
                        "open {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_client_connections_refused_total')})",
                        "refused/s {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Client connections the router closed",
                "Client connections closed by the router since each replica started, by reason "
                "(kvrouter_client_connections_closed_total): idle, drain and answered are "
                "routine; malformed, refused and the timeouts are clients that broke the rules; "
                "cut follows a broken answer.",
                "short",
                (
                    Query(
                        "sum by (instance, reason) "
                        f"(kvrouter_client_connections_closed_total{_sel()})",
                        "{{reason}} {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Connections to workers",
                "Connections each worker has from all replicas (connecting, busy, idle: "
                "kvrouter_upstream_connections), new connections per second, and requests "
                "resent because a reused idle connection was found closed.",
                "short",
                (
                    Query(f"sum by (worker) (kvrouter_upstream_connections{_sel()})", "{{worker}}"),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_upstream_connects_total')})",
                        "connects/s {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_upstream_safe_retries_total')})",
                        "safe retries/s {{instance}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Routing",
        (
            Panel(
                "Routing outcomes",
                "Decisions per second by policy and outcome: cache_hit (the chosen rank holds "
                "a leading block of the prompt), cache_miss, imbalance_fallback (ranks far "
                "busier than the lightest set last, the cache deciding among the rest), "
                "no_candidates (no healthy worker).",
                "ops",
                (
                    Query(
                        f"sum by (policy, outcome) ({_rate('kvrouter_routing_decisions_total')})",
                        "{{policy}} {{outcome}}",
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Matched blocks per routed request",
                "Leading prompt blocks the chosen rank held (kvrouter_matched_blocks): the "
                "mean, and the median and 90th percentile from the histogram's buckets.",
                "short",
                (
                    Query(
                        f"sum({_rate('kvrouter_matched_blocks_sum')}) / "
                        f"sum({_rate('kvrouter_matched_blocks_count')})",
                        "mean",
                    ),
                    Query(
                        "histogram_quantile(0.5, sum by (le) "
                        f"({_rate('kvrouter_matched_blocks_bucket')}))",
                        "p50",
                    ),
                    Query(
                        "histogram_quantile(0.9, sum by (le) "
                        f"({_rate('kvrouter_matched_blocks_bucket')}))",
                        "p90",
                    ),
                ),
            ),
            Panel(
                "Fleet cached-token ratio, as the engines report it",
                "Prompt tokens the engines found in their prefix caches over prompt tokens "
                "(vLLM: vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total; "
                "SGLang: the mean of sglang:cache_hit_rate). The payoff of cache-aware routing.",
                "percentunit",
                (
                    Query(
                        f"sum(rate(vllm:prefix_cache_hits_total{_engines()}[{RATE}])) / "
                        f"sum(rate(vllm:prefix_cache_queries_total{_engines()}[{RATE}]))",
                        "vLLM",
                    ),
                    Query(f"avg(sglang:cache_hit_rate{_engines()})", "SGLang"),
                ),
            ),
            Panel(
                "Requests that waited for a routing turn",
                "Requests per second that waited a turn of the event loop to be routed "
                "(kvrouter_routing_deferred_total): routing work per turn is capped, so a "
                "steady rate means the replica's loop is saturated; add replicas.",
                "ops",
                (
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_routing_deferred_total')})",
                        "{{instance}}",
                    ),
                ),
            ),
            Panel(
                "Chats routed without their tokens",
                "Share of chat requests the router could not render as the engine would "
                "(kvrouter_tokenize_failures_total over chat requests), by reason: they are "
                "forwarded and routed by load as misses. The log names the template. Prompts "
                "given as embeddings (reason embeds) are not chats and are left out.",
                "percentunit",
                (
                    Query(
                        "sum by (reason) "
                        f"({_rate('kvrouter_tokenize_failures_total', NOT_EMBEDS)}) "
                        "/ ignoring (reason) group_left "
                        f"sum({_rate('kvrouter_requests_total', CHATS)})",
                        "{{reason}}",
                    ),
                ),
            ),
            Panel(
                "Tokenization cache hit ratio",
                "Chat segments found in each replica's tokenization cache "
                "(kvrouter_tokenize_cache_lookups_total, with a model tokenizer): the share "
                "of rendering work a repeated system prompt or conversation saves.",
                "percentunit",
                (
                    Query(
                        "sum by (instance) "
                        f"({_rate('kvrouter_tokenize_cache_lookups_total', HIT)}) / "
                        "sum by (instance) "
                        f"({_rate('kvrouter_tokenize_cache_lookups_total')})",
                        "{{instance}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Cache pressure",
        (
            Panel(
                "Cache pressure per rank",
                "Per rank, the highest pressure any replica sees: its recent demand over what "
                "the engine can hold (kvrouter_rank_pressure). Above 100% the rank is sent "
                "more than it can keep and cache_aware spills to others.",
                "percentunit",
                (
                    Query(
                        f"max by (worker_url, dp_rank) (kvrouter_rank_pressure{_sel()})",
                        "{{worker_url}} rank {{dp_rank}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Capacity, demand and booked blocks",
                "The fleet's KV capacity in blocks (kvrouter_rank_capacity_blocks, summed "
                "over ranks), and per replica its recent demand and the blocks it booked whose "
                "store events have not arrived (summed over ranks).",
                "short",
                (
                    Query(
                        f"max(sum by (instance) (kvrouter_rank_capacity_blocks{_sel()}))",
                        "capacity",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_rank_demand_blocks{_sel()})",
                        "demand {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_rank_booked_blocks{_sel()})",
                        "booked {{instance}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Bookings",
                "Per replica: routed prompts waiting for their store events "
                "(kvrouter_bookings_held), and bookings ended per second: confirmed by the "
                "index, or expired (engines queue longer than --booking-ttl-ms, or store events "
                "are lost). Each replica books its siblings' shared decisions as well as its "
                "own, so every replica counts each prompt: never sum them over replicas.",
                "short",
                (
                    Query(
                        f"sum by (instance) (kvrouter_bookings_held{_sel()})", "held {{instance}}"
                    ),
                    Query(
                        f"sum by (instance, outcome) ({_rate('kvrouter_bookings_total')})",
                        "{{instance}} {{outcome}}/s",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Spills",
                "Decisions per second whose chosen rank had to evict blocks in recent demand "
                "(kvrouter_pressure_spills_total), and the blocks they evicted per second. A "
                "steady rate: the working set exceeds the fleet's caches.",
                "ops",
                (
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_pressure_spills_total')})",
                        "decisions {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_pressure_spilled_blocks_total')})",
                        "blocks {{instance}}",
                    ),
                ),
                width=6,
            ),
            Panel(
                "Placements of new prefixes",
                "Per replica, questions about new prefixes per second by outcome "
                "(kvrouter_placements_total): answered (routed to the placer's rank), placed "
                "(answered for siblings, on the placer), local, and those decided alone: "
                "timeout, error, busy, unusable. Steady unusable: the placer names workers this "
                "replica lacks or finds unhealthy (give every replica the same worker list).",
                "ops",
                (
                    Query(
                        f"sum by (instance, outcome) ({_rate('kvrouter_placements_total')})",
                        "{{instance}} {{outcome}}",
                    ),
                ),
                width=12,
            ),
            Panel(
                "Shared decisions",
                "Per replica, siblings' routing decisions per second by outcome "
                "(kvrouter_shared_decisions_total): sent, received (booked here), dropped and "
                "skipped (siblings slow or failing), unknown (on a rank this replica does not "
                "know: replicas given different workers when it lasts).",
                "ops",
                (
                    Query(
                        f"sum by (instance, outcome) ({_rate('kvrouter_shared_decisions_total')})",
                        "{{instance}} {{outcome}}",
                    ),
                ),
                width=12,
            ),
        ),
    ),
    Row(
        "Index",
        (
            Panel(
                "Index nodes per replica",
                "Blocks in each replica's index (kvrouter_tree_nodes); replicas that agree hold "
                "the same number, except while one installs a worker's snapshot (its staged "
                "nodes count too).",
                "short",
                (Query(f"kvrouter_tree_nodes{_sel()}", "{{instance}}"),),
            ),
            Panel(
                "Blocks per replica and tier",
                "Blocks the index records, per replica and cache tier, summed over the ranks "
                "(kvrouter_tree_blocks).",
                "short",
                (
                    Query(
                        f"sum by (instance, tier) (kvrouter_tree_blocks{_sel()})",
                        "{{instance}} {{tier}}",
                    ),
                ),
            ),
            Panel(
                "Where replicas differ: block spread per rank",
                "Per rank, the most blocks any replica records minus the fewest: 0 when every "
                "replica agrees; a lasting spread is a replica that lost events or bootstrapped "
                "cold.",
                "short",
                (
                    Query(
                        # Per tier too: a rank's device and host counts are different series.
                        "max by (worker_url, dp_rank, tier) "
                        f"(kvrouter_tree_blocks{_sel()}) - "
                        f"min by (worker_url, dp_rank, tier) (kvrouter_tree_blocks{_sel()})",
                        "{{worker_url}} rank {{dp_rank}} {{tier}}",
                    ),
                ),
            ),
            Panel(
                "Resident memory per replica",
                "process_resident_memory_bytes: the index is about 200 bytes per block.",
                "bytes",
                (Query(f"process_resident_memory_bytes{_sel()}", "{{instance}}"),),
            ),
            Panel(
                "CPU per replica",
                "CPU seconds per second (process_cpu_seconds_total). One replica is one event "
                "loop: near 1.0 it is at capacity.",
                "short",
                (Query(_rate("process_cpu_seconds_total"), "{{instance}}"),),
            ),
            Panel(
                "KV events applied",
                "Engine KV events applied to the index per second, by kind "
                "(kvrouter_kv_events_total).",
                "ops",
                (
                    Query(
                        f"sum by (instance, event) ({_rate('kvrouter_kv_events_total')})",
                        "{{instance}} {{event}}",
                    ),
                ),
            ),
            Panel(
                "Index against its cap",
                "(rank, block) pairs each replica's index carries "
                "(kvrouter_index_carried_blocks) and its cap, --kv-index-max-blocks "
                "(kvrouter_index_max_blocks; 0: none). At the cap the rank carrying the most "
                "is cleared.",
                "short",
                (
                    Query(f"kvrouter_index_carried_blocks{_sel()}", "carried {{instance}}"),
                    Query(f"kvrouter_index_max_blocks{_sel()}", "cap {{instance}}"),
                ),
            ),
            Panel(
                "Cap clears",
                "Ranks cleared because the index went over its cap, since each replica "
                "started (kvrouter_index_cap_clears_total), and the blocks those clears forgot "
                "(kvrouter_index_cap_cleared_blocks_total): raise the cap with the memory limit.",
                "short",
                (
                    Query(
                        "sum by (instance, worker_url, dp_rank) "
                        f"(kvrouter_index_cap_clears_total{_sel()})",
                        "{{instance}} {{worker_url}} rank {{dp_rank}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_index_cap_cleared_blocks_total{_sel()})",
                        "blocks forgotten {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Memory beside the index",
                "Bytes held by the cached export of the index served to siblings "
                "(kvrouter_kv_snapshot_cached_bytes, freed at its max age) and by the "
                "tokenization cache (kvrouter_tokenize_cache_bytes, at most "
                "--tokenize-cache-mb).",
                "bytes",
                (
                    Query(
                        f"kvrouter_kv_snapshot_cached_bytes{_sel()}", "snapshot export {{instance}}"
                    ),
                    Query(f"kvrouter_tokenize_cache_bytes{_sel()}", "tokenize cache {{instance}}"),
                ),
            ),
        ),
    ),
    Row(
        "Event streams",
        (
            Panel(
                "Ingest backlog per replica",
                "Items queued for the pump, the index's single writer (kvrouter_pump_backlog). "
                "Above 1,000 for a minute the replica cannot keep up with the fleet's events.",
                "short",
                (Query(f"kvrouter_pump_backlog{_sel()}", "{{instance}}"),),
            ),
            Panel(
                "Cursor lag per rank",
                "Per rank and replica, how many batches the replica's applied cursor "
                "(kvrouter_kv_cursor) is behind the replica furthest ahead in that rank's "
                "stream. Brief steps are batches in flight; a lasting lag is a replica that "
                "cannot keep up or does not receive the stream.",
                "short",
                (
                    Query(
                        f"max by (worker_url, dp_rank) (kvrouter_kv_cursor{_sel()}) "
                        f"- on (worker_url, dp_rank) group_right kvrouter_kv_cursor{_sel()}",
                        "{{instance}} {{worker_url}} rank {{dp_rank}}",
                    ),
                ),
            ),
            Panel(
                "Lost batches per rank",
                "Batches a rank's stream skipped that replay did not recover, since each "
                "replica started (kvrouter_kv_event_batches_lost_total). The rank's index may "
                "hold stale blocks until they are evicted.",
                "short",
                (
                    Query(
                        "sum by (instance, worker_url, dp_rank) "
                        f"(kvrouter_kv_event_batches_lost_total{_sel()})",
                        "{{instance}} {{worker_url}} rank {{dp_rank}}",
                    ),
                ),
            ),
            Panel(
                "Replay outcomes",
                "Requests to the engines' replay endpoints for gaps in a stream, by outcome, "
                "since each replica started (kvrouter_kv_replay_total).",
                "short",
                (
                    Query(
                        f"sum by (instance, outcome) (kvrouter_kv_replay_total{_sel()})",
                        "{{instance}} {{outcome}}",
                    ),
                ),
            ),
            Panel(
                "Stream faults",
                "Per second: engine publishers that restarted (their rank is cleared and "
                "re-learned), publisher connections that dropped (kvrouter_kv_disconnects_total: "
                "the engine went away, or a message over --kv-events-max-message-bytes), seq "
                "jumps handled as a new stream, the last batch sent again (dropped: a publisher "
                "doing so for long is faulty), ZMQ frames that did not decode, and batches "
                "whose payload did not (kvrouter_kv_decode_errors_total; each counts lost unless "
                "replay returns a good copy): either is an engine version or wire format "
                "mismatch.",
                "ops",
                (
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_publisher_resets_total')})",
                        "resets {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_disconnects_total')})",
                        "disconnects {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_seq_jumps_total')})",
                        "seq jumps {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_duplicate_batches_total')})",
                        "duplicate batches {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_bad_frames_total')})",
                        "bad frames {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) ({_rate('kvrouter_kv_decode_errors_total')})",
                        "undecodable batches {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Ingest processes",
                "With --kv-ingest-processes: the ranks each process subscribes to "
                "(kvrouter_kv_ingest_ranks), its restarts since the replica started (its ranks "
                "see a gap) and messages from them that did not decode (a bug).",
                "short",
                (
                    Query(
                        f"sum by (instance, process) (kvrouter_kv_ingest_ranks{_sel()})",
                        "ranks {{instance}} #{{process}}",
                    ),
                    Query(
                        f"sum by (instance, process) (kvrouter_kv_ingest_restarts_total{_sel()})",
                        "restarts {{instance}} #{{process}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_kv_ingest_bad_messages_total{_sel()})",
                        "bad messages {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Ingest accelerator",
                "Which ingest implementation each replica runs (kvrouter_accelerator_info): "
                "compiled, or pure (the C extension not built, or KVROUTER_NO_EXTENSIONS set), "
                "which spends several times the CPU per KV event.",
                "short",
                (
                    Query(
                        f"max by (instance, implementation) (kvrouter_accelerator_info{_sel()})",
                        "{{instance}} {{implementation}}",
                    ),
                ),
            ),
        ),
    ),
    Row(
        "Bootstrap",
        (
            Panel(
                "Bootstrap: rank outcomes",
                "Ranks per bootstrap verdict since each replica started "
                "(kvrouter_kv_bootstrap_rank_total): warm and from_origin inherited or needed "
                "nothing; gap, abandoned, overflow and tree_rejected started cold.",
                "short",
                (
                    Query(
                        f"sum by (instance, outcome) (kvrouter_kv_bootstrap_rank_total{_sel()})",
                        "{{instance}} {{outcome}}",
                    ),
                ),
            ),
            Panel(
                "Sibling snapshot fetches",
                "Snapshots fetched from siblings since each replica started, by outcome "
                "(kvrouter_kv_peer_snapshot_total): accepted, cold_peer, stale, rejected, "
                "unreachable, connection_refused, not_a_sibling; and the exports each replica "
                "built for its siblings (kvrouter_kv_snapshot_exports_total).",
                "short",
                (
                    Query(
                        f"sum by (instance, outcome) (kvrouter_kv_peer_snapshot_total{_sel()})",
                        "{{instance}} {{outcome}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_kv_snapshot_exports_total{_sel()})",
                        "exports built by {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Time to ready, and settled",
                "Seconds from start to the first admitted readiness "
                "(kvrouter_kv_bootstrap_duration_seconds), and kvrouter_kv_bootstrap_settled: 1 "
                "once every rank settled or --kv-bootstrap-timeout-ms passed. It can read 1 "
                'while /readyz is 503 "seed gate closed" (--kv-bootstrap-seed-required: see '
                "kvrouter_kv_bootstrap_seed_failed).",
                "s",
                (
                    Query(
                        f"kvrouter_kv_bootstrap_duration_seconds{_sel()}",
                        "time to ready {{instance}}",
                    ),
                    Query(f"kvrouter_kv_bootstrap_settled{_sel()}", "settled {{instance}}"),
                ),
            ),
        ),
    ),
    Row(
        "Workers, tasks and discovery",
        (
            Panel(
                "Workers by state",
                "Per replica, its registered workers by state (kvrouter_workers): "
                "discovering, ready, down (failed /health), and refused by reason (listed, "
                "taking no traffic, looked at again until its engine is fixed: the fleet runs "
                "that many workers short).",
                "short",
                (
                    Query(
                        "sum by (instance, state) (kvrouter_workers"
                        + _sel('state!="refused"')
                        + ")",
                        "{{state}} {{instance}}",
                    ),
                    Query(
                        "sum by (instance, reason) (kvrouter_workers"
                        + _sel('state="refused"')
                        + ")",
                        "refused {{reason}} {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Unhealthy workers",
                "Per replica, workers failing their /health check (kvrouter_worker_healthy "
                "0), and workers evicted from the index after failing it too long.",
                "short",
                (
                    Query(
                        f"sum by (instance) (1 - kvrouter_worker_healthy{_sel()})",
                        "unhealthy {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_worker_evictions_total{_sel()})",
                        "evicted {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Circuit breakers",
                "Per worker, the highest breaker state of the replicas whose breaker is not "
                "probe due (kvrouter_breaker_state below 3): 0 closed, 1 open and 2 half-open "
                "(its probe out), the last two refusing requests; and, as a series of its own, "
                "how many replicas hold it probe due (3: the cooldown passed, the next request "
                "routed there is the probe, and a worker none is routed to stays there). Probe "
                "due refuses nothing, and drawn in the maximum it hid another replica's open "
                "breaker.",
                "short",
                (
                    Query(
                        f"max by (worker) (kvrouter_breaker_state{_sel()} < 3)",
                        "{{worker}}",
                    ),
                    Query(
                        f"sum by (worker) (kvrouter_breaker_state{_sel()} == bool 3)",
                        "{{worker}} probe due (replicas)",
                    ),
                ),
            ),
            Panel(
                "Discovery",
                "URLs each EndpointSlice watch publishes (siblings or workers), and list or "
                "watch failures per second by reason (http_403: RBAC; expired: a relist).",
                "short",
                (
                    Query(
                        f"sum by (instance, what) (kvrouter_discovery_urls{_sel()})",
                        "{{what}} {{instance}}",
                    ),
                    Query(
                        f"sum by (what, reason) ({_rate('kvrouter_discovery_failures_total')})",
                        "failures {{what}} {{reason}}",
                    ),
                ),
            ),
            Panel(
                "Workers refused, ranks distrusted",
                "Workers refused at registration since each replica started, by reason "
                "(kvrouter_workers_refused_total: block_size, socket_limit, dp_size, "
                "kv_events_endpoint, shared_kv_events_endpoint, max_workers), and ranks "
                "cleared because the index held "
                "more device blocks "
                "than the engine can "
                "(kvrouter_ranks_distrusted_total: removals lost or made up).",
                "short",
                (
                    Query(
                        f"sum by (instance, reason) (kvrouter_workers_refused_total{_sel()})",
                        "refused {{reason}} {{instance}}",
                    ),
                    Query(
                        f"sum by (instance) (kvrouter_ranks_distrusted_total{_sel()})",
                        "distrusted {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Rank subscriptions and the socket budget",
                "Worker ranks each replica subscribes to, and how many its socket budget "
                "allows (kvrouter_rank_subscriptions; from the open-file limit): a worker past "
                "it is refused (socket_limit).",
                "short",
                (
                    Query(
                        f"sum by (instance, kind) (kvrouter_rank_subscriptions{_sel()})",
                        "{{kind}} {{instance}}",
                    ),
                ),
            ),
            Panel(
                "Background tasks",
                "Failures of background loops since each replica started, by kind "
                "(kvrouter_task_failures_total: each logged with its traceback and retried), "
                "and loops failing over and over (kvrouter_tasks_failing; a critical one turns "
                "/readyz 503).",
                "short",
                (
                    Query(
                        f"sum by (task) (kvrouter_task_failures_total{_sel()})",
                        "failures {{task}}",
                    ),
                    Query(
                        f"sum by (instance, task) (kvrouter_tasks_failing{_sel()})",
                        "failing {{task}} {{instance}}",
                    ),
                ),
            ),
        ),
    ),
)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    """A multi-value query variable whose 'All' is a regex matching every value."""
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "refresh": 2,  # on time range change: replicas come and go
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": 0,
    }


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "custom": {
                    "drawStyle": "line",
                    "lineWidth": 1,
                    "fillOpacity": 10,
                    "showPoints": "never",
                    "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": q.expr,
                "legendFormat": q.legend,
                "range": True,
            }
            for i, q in enumerate(panel.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    panel_id, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + PANEL_HEIGHT
            panels.append(_panel(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += PANEL_HEIGHT
    return {
        "title": TITLE,
        "uid": UID,
        "description": "A kvrouter Deployment: requests and added latency, connections, "
        "routing and tokenization, cache pressure, the replicas' indexes, the engines' event "
        "streams, peer bootstrap, workers, background loops and discovery. Generated by "
        "scripts/dashboard.py.",
        "tags": ["kvrouter"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "regex": "",
                    "refresh": 1,
                    "hide": 0,
                    "current": {},
                },
                _variable("namespace", "Namespace", "label_values(kvrouter_tree_nodes, namespace)"),
                _variable(
                    "job",
                    "Job",
                    'label_values(kvrouter_tree_nodes{namespace=~"$namespace"}, job)',
                ),
                _variable(
                    "instance",
                    "Replica",
                    'label_values(kvrouter_tree_nodes{namespace=~"$namespace", job=~"$job"}, '
                    "instance)",
                ),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the file is stale"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            sys.stderr.write(f"{OUT} is stale: run python3 scripts/dashboard.py\n")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
