"""`kvrouter` command line.

Every `serve` flag also reads an environment variable, `KVROUTER_` plus the flag name in upper
case with dashes as underscores (`--block-size` <- `KVROUTER_BLOCK_SIZE`); a flag on the
command line wins. Repeatable flags take a comma-separated list from the environment.
Invalid values (a malformed number, an unknown choice, a worker that is not an http(s) URL, a
tokenizer that does not load, ...) stop the command before it listens, with one line on stderr
and exit code 2; a listen address that cannot be bound, with one line and exit code 1.

SIGTERM or SIGINT (held from the moment the `kvrouter` entry point runs, `router.launch`, so
one that arrives while Python imports the command, during start-up or right after the ready
line is a drain too): `/readyz` turns 503, in-flight requests keep running up to
`--drain-timeout-s`, whatever is left is cut, and the process exits 0. The other commands
give both signals their default actions back before they run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, NoReturn

from cachetree import accel
from cachetree.keys import MAX_BLOCK_SIZE
from peer.kubeconfig import KubeConfigError
from peer.origin import AllowList, origin_problem, url_problem, worker_origin_problem
from router import launch
from router.auth import TOKEN_ENV, token_problem
from router.dataplane.cors import CorsPolicy
from router.dataplane.routing import DEFAULT_OFFLOAD_CHARS
from router.homes import DEFAULT_MAX_HOMES, MAX_HOMES_BOUND
from router.index import DEFAULT_INDEX_MAX_BLOCKS
from router.ingest_pool import DEFAULT_INGEST_PROCESSES, DEFAULT_SILENCE_S
from router.ingest_pool import MAX_PROCESSES as MAX_INGEST_PROCESSES
from router.ingest_pool import MAX_SILENCE_S as MAX_INGEST_SILENCE_S
from router.ingest_pool import MIN_SILENCE_S as MIN_INGEST_SILENCE_S
from router.placement import DEFAULT_TIMEOUT_MS as DEFAULT_PLACEMENT_TIMEOUT_MS
from router.placement import MAX_TIMEOUT_MS as MAX_PLACEMENT_TIMEOUT_MS
from router.policy import POLICY_NAMES
from router.pressure import DEFAULT_MAX_TRACKED_BLOCKS
from router.replica import AUTO_CHAT_RULES_START, ServeConfig
from router.serving import StartError, serve_until, start_serving, stop_serving
from router.subscriber import DEFAULT_MAX_MESSAGE_BYTES
from router.tokenize import ENGINES, load_tokenizer
from router.tools import demo, pools, view
from router.workers import DEFAULT_MAX_WORKERS, MODELS_REFRESH_S

log = logging.getLogger("kvrouter")

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
EVENT_LOOPS: Final = ("auto", "asyncio", "uvloop")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump), exit code 2."""

    def error(self, message: str) -> NoReturn:
        _fail(message)


def _env(name: str) -> str:
    return "KVROUTER_" + name.upper().replace("-", "_")


@dataclass(frozen=True, slots=True)
class _EnvValue:
    """A flag's value from the environment, parsed only if the command line does not set it."""

    env: str
    raw: str
    kind: Callable[[str], Any]
    repeat: bool
    choices: Sequence[str] | None
    secret: bool

    @property
    def shown(self) -> str:
        """The variable as messages name it: a secret's value never reaches a terminal or log."""
        return f"{self.env} (set, value not shown)" if self.secret else f"{self.env}={self.raw!r}"

    def parse(self) -> Any:
        try:
            value = (
                [self.kind(v) for v in self.raw.split(",") if v]
                if self.repeat
                else (self.kind(self.raw))
            )
        except (ValueError, argparse.ArgumentTypeError):
            _fail(f"{self.shown} is not a valid value for --{_flag(self.env)}")
        # argparse checks choices on the command line only, never on a default.
        if self.choices is not None and not self.repeat and value not in self.choices:
            _fail(f"{self.shown} is not one of {', '.join(self.choices)}")
        return value


MAX_NUMBER: Final = 10**12  # past it a duration overflows a timer, a size any host


def whole(text: str) -> int:
    """An integer flag's value, at most `MAX_NUMBER` in size: 10**400 passed every range check
    written as `>= 1`, then overflowed a float in the replica's start-up (a traceback)."""
    value = int(text)
    if not -MAX_NUMBER <= value <= MAX_NUMBER:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer up to {MAX_NUMBER:g}")
    return value


def finite(text: str) -> float:
    """A number flag's value: finite and at most `MAX_NUMBER` in size (`inf` would turn a
    bound off, and a timer of 1e300 s fails only when it is first armed)."""
    value = float(text)
    if not -MAX_NUMBER <= value <= MAX_NUMBER:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number up to {MAX_NUMBER:g}")
    return value


def _flag(env: str) -> str:
    return env.removeprefix("KVROUTER_").lower().replace("_", "-")


class _Flags:
    """Adds flags whose defaults come from the environment, remembering how to parse them.

    An environment value is parsed after the command line, and only for a flag the command
    line leaves unset: a flag given explicitly wins even over a variable that does not parse.
    Kubernetes injects `KVROUTER_PORT=tcp://...` into pods beside a Service named kvrouter,
    which must not stop a replica started with `--port`.
    """

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        # Unset flags come back as None; these fill them in afterwards. argparse's "append"
        # would add command-line values to a default list, so repeatable flags need it too.
        self.defaults: dict[str, Any] = {}
        self.from_env: dict[str, _EnvValue] = {}
        self.names: list[str] = []  # every flag, without the dashes

    def add(
        self,
        name: str,
        kind: Callable[[str], Any],
        default: Any,
        help: str,
        *,
        repeat: bool = False,
        choices: Sequence[str] | None = None,
        secret: bool = False,
    ) -> None:
        """`secret`: the value is never shown (`--help` inside a pod with the Secret mounted
        printed the token), only whether the environment sets it."""
        self.names.append(name)
        env, dest = _env(name), name.replace("-", "_")
        raw = os.environ.get(env)
        if raw is not None:
            self.from_env[dest] = _EnvValue(env, raw, kind, repeat, choices, secret)
        self.defaults[dest] = default
        if secret:
            shown = "unset" if raw is None else f"set from {env}, value not shown"
        else:
            shown = repr(default) if raw is None else f"{raw!r} from {env}"
        # A boolean flag may stand alone (`--expose-route-headers`) or take a value.
        bare = {"nargs": "?", "const": True} if kind is _flag_bool else {}
        self.parser.add_argument(
            f"--{name}",
            type=kind,
            default=None,
            action="append" if repeat else "store",
            choices=choices,
            help=f"{help} [env {env}; default {shown}]",
            **bare,
        )

    def apply_defaults(self, args: argparse.Namespace) -> None:
        """Fill every flag the command line left unset: from the environment, else the default."""
        for dest, default in self.defaults.items():
            if getattr(args, dest) is not None:
                continue
            env_value = self.from_env.get(dest)
            value = env_value.parse() if env_value is not None else default
            setattr(args, dest, list(value) if isinstance(value, list) else value)


def _flag_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    # argparse shows this message as it is (a ValueError would show "invalid _flag_bool").
    raise argparse.ArgumentTypeError(f"{raw!r} is not a boolean (true/false, 1/0, yes/no, on/off)")


def _serve_parser(sub: argparse._SubParsersAction) -> _Flags:
    p = sub.add_parser("serve", help="run one router replica")
    f = _Flags(p)
    f.add("host", str, "0.0.0.0", "listen address")
    f.add("port", whole, 8080, "listen port")
    f.add("worker", str, [], "a worker base URL (repeatable)", repeat=True)
    f.add("policy", str, "cache_aware", "routing policy", choices=POLICY_NAMES)
    f.add("block-size", whole, 0, "KV block size of the fleet; 0 learns it from the first worker")
    f.add(
        "tokenizer", str, "bytes", "'bytes', or a model directory / its tokenizer.json (hf extra)"
    )
    f.add(
        "chat-rules",
        str,
        "auto",
        "whose chat rendering the router reproduces: the engine the workers run; auto reads it "
        "from their /v1/models (owned_by)",
        choices=("auto", *ENGINES),
    )
    f.add("tokenize-cache-mb", finite, 64.0, "bound of the chat segment tokenization cache")
    f.add(
        "tokenize-offload-chars",
        whole,
        DEFAULT_OFFLOAD_CHARS,
        "a prompt longer than this (a chat: a body of this many bytes) is rendered and "
        "encoded in a worker thread, off the event loop; 0 = never",
    )
    f.add(
        "kv-events-port-base", whole, 5557, "KV-event PUB port of rank 0 when /server_info has none"
    )
    f.add("kv-events-replay-port-base", whole, 0, "replay ROUTER port of rank 0; 0 = no replay")
    f.add("dp-size", whole, 1, "data-parallel ranks per worker when /server_info has none")
    f.add("load-interval-ms", whole, 500, "how often engine load is polled")
    f.add("health-interval-s", finite, 2.0, "how often each worker's /health is polled")
    f.add(
        "worker-models-refresh-s",
        finite,
        MODELS_REFRESH_S,
        "how often the health loop reads the routable workers' /v1/models again, so an "
        "adapter unloaded (or loaded) at run time is routed by it; 0 = never",
    )
    f.add(
        "worker-evict-after-s",
        finite,
        30.0,
        "a worker failing /health (or unready in its EndpointSlices) this long leaves the "
        "index until it answers (is ready) again; 0 = never",
    )
    f.add(
        "max-workers",
        whole,
        DEFAULT_MAX_WORKERS,
        "workers registered at once (any state, every source); one more is refused",
    )
    f.add("max-request-bytes", whole, 32 * 1024 * 1024, "largest request body accepted")
    f.add("max-connections", whole, 4096, "open client connections; more are answered 503")
    f.add("max-header-count", whole, 100, "header fields in one request")
    f.add("max-head-bytes", whole, 64 * 1024, "size of a request's head (request line and fields)")
    f.add("client-header-timeout-s", finite, 30.0, "a request head must arrive within this")
    f.add("client-body-timeout-s", finite, 60.0, "a request body must arrive within this")
    f.add("keepalive-timeout-s", finite, 60.0, "an idle client connection is closed after this")
    f.add(
        "upstream-connect-timeout-s",
        finite,
        5.0,
        "getting a connection to a worker: connecting, or waiting for a pooled one when all "
        "--upstream-connections-per-worker are busy (then the next rank is tried)",
    )
    f.add("upstream-head-timeout-s", finite, 300.0, "a worker's response head must come within")
    f.add("stream-idle-timeout-s", finite, 300.0, "the longest gap within a worker's answer")
    f.add(
        "client-write-timeout-s",
        finite,
        120.0,
        "a client that reads nothing of its answer for this long, its writes paused, is cut",
    )
    f.add(
        "upstream-idle-expiry-s",
        finite,
        4.0,
        "an idle connection to a worker is closed after this; keep it below the engines' "
        "keep-alive timeout (uvicorn: 5 s)",
    )
    f.add("upstream-connections-per-worker", whole, 256, "open connections to one worker at most")
    f.add("control-port", whole, 0, "also serve the control plane alone on this port; 0 = not")
    f.add(
        "event-loop",
        str.lower,
        "auto",
        "auto: uvloop when installed (the fast extra), else asyncio",
        choices=EVENT_LOOPS,
    )
    f.add("max-attempts", whole, 3, "upstream attempts per request, failovers included")
    f.add(
        "breaker-failure-threshold", whole, 3, "consecutive failures that open a breaker; 0 = off"
    )
    f.add("breaker-cooldown-s", finite, 5.0, "first open period of a breaker")
    f.add("breaker-max-cooldown-s", finite, 60.0, "longest open period (cooldown doubles)")
    f.add("expose-route-headers", _flag_bool, False, "add X-Kvrouter-Worker/-Dp-Rank to responses")
    f.add(
        "cors-allow-origin",
        str,
        [],
        "an origin (scheme://host, and :port unless the default) whose web pages may call the "
        "completion routes and /v1/models (CORS), or * for any (repeatable); none by default",
        repeat=True,
    )
    f.add(
        "internal-token",
        str,
        "",
        "bearer token of /workers and /internal/* (refused without one); the same on every replica",
        secret=True,
    )
    f.add(
        "peer", str, [], "a sibling replica's base URL for peer bootstrap (repeatable)", repeat=True
    )
    f.add("kv-peer-selector", str, "", "EndpointSlice label selector naming sibling replicas")
    f.add("worker-selector", str, "", "EndpointSlice label selector naming the workers")
    f.add(
        "worker-port",
        whole,
        0,
        "the workers' port in their EndpointSlices (a slice not listing it is skipped); "
        "0 = the first listed",
    )
    f.add(
        "namespace",
        str,
        None,
        "namespace of the EndpointSlices; empty = all; unset = POD_NAMESPACE, else the "
        "service-account namespace, else default",
    )
    f.add(
        "kube-api-server",
        str,
        "",
        "Kubernetes API URL used without credentials (kubectl proxy); else in-cluster config "
        "in a pod, else KUBECONFIG",
    )
    f.add("self-url", str, "", "this replica's own base URL, never used as a sibling")
    f.add(
        "worker-allow-cidr",
        str,
        [],
        "a network (CIDR) workers added through POST /workers must resolve into (repeatable); "
        "none: any",
        repeat=True,
    )
    f.add(
        "kv-bootstrap-timeout-ms", whole, 120_000, "bound on the whole bootstrap and /readyz hold"
    )
    f.add("kv-bootstrap-fetch-timeout-cap-ms", whole, 300_000, "cap on one sibling fetch")
    f.add("kv-bootstrap-seed-required", _flag_bool, False, "hold /readyz after a timed-out sweep")
    f.add(
        "kv-bootstrap-max-body-mb",
        whole,
        0,
        "largest columnar sibling snapshot accepted, also inflated (JSON or msgpack: half); "
        "0 = enough for a full index (48 B x --kv-index-max-blocks, at least 24)",
    )
    f.add(
        "worker-snapshot-max-body-mb",
        whole,
        32,
        "largest worker /v1/kv-snapshot body accepted (read as it streams)",
    )
    f.add(
        "kv-events-max-message-bytes",
        whole,
        DEFAULT_MAX_MESSAGE_BYTES,
        "largest KV-event ZMQ message accepted; a larger one is dropped and seen as a gap",
    )
    f.add(
        "kv-index-max-blocks",
        whole,
        DEFAULT_INDEX_MAX_BLOCKS,
        "cap on (rank, block) pairs in the index; over it the largest rank is cleared",
    )
    f.add(
        "booking-ttl-ms",
        whole,
        5000,
        "cache_aware: how long a routed prompt's blocks count as held before the index shows "
        "them; 0 = no bookings",
    )
    f.add("demand-half-life-s", finite, 30.0, "cache_aware: half-life of a rank's recent demand")
    f.add(
        "pressure-max-tracked-blocks",
        whole,
        DEFAULT_MAX_TRACKED_BLOCKS,
        "cache_aware: bound on (rank, block) pairs remembered for demand and bookings",
    )
    f.add(
        "kv-events",
        str,
        "auto",
        "subscribe to the workers' KV events and keep the index: on, off, or auto (on for "
        "policies that read it: cache_aware)",
        choices=("auto", "on", "off"),
    )
    f.add(
        "share-decisions",
        _flag_bool,
        True,
        "cache_aware with siblings: post each routing decision to them (POST "
        "/internal/decisions) so every replica's ledger sees the fleet's demand and bookings",
    )
    f.add(
        "placement-timeout-ms",
        whole,
        DEFAULT_PLACEMENT_TIMEOUT_MS,
        "cache_aware with siblings: how long a request for a new prefix waits for the placer "
        "replica's answer (POST /internal/place) before deciding alone (up to 4x when this "
        "replica itself stalled meanwhile, or while the placer answered the latest question); "
        f"at most {MAX_PLACEMENT_TIMEOUT_MS}; 0 = never ask",
    )
    f.add(
        "prefix-homes",
        _flag_bool,
        False,
        "cache_aware: keep a home rank per prefix, placed by the blocks each rank was given "
        "(router/homes.py); shared with siblings alongside the decisions",
    )
    f.add(
        "prefix-homes-max",
        whole,
        DEFAULT_MAX_HOMES,
        "--prefix-homes: bound on the prefix homes a replica keeps (least recently used out)",
    )
    f.add(
        "kv-ingest-processes",
        whole,
        DEFAULT_INGEST_PROCESSES,
        "processes that receive, decode and key KV events for the pump (0: in the event loop)",
    )
    f.add(
        "kv-ingest-silence-s",
        finite,
        DEFAULT_SILENCE_S,
        "an ingest process that sends nothing, not even its heartbeat, this long is taken as "
        "hung, killed and started again",
    )
    f.add("drain-timeout-s", finite, 30.0, "after SIGTERM, how long in-flight requests may run")
    f.add("log-level", str.lower, "info", "how much to log", choices=LOG_LEVELS)
    return f


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The `serve` settings, checked before anything starts; exits 2 with one line if invalid."""
    checks = [
        (1 <= args.port <= 65535, "--port must be 1..65535"),
        (
            0 <= args.block_size <= MAX_BLOCK_SIZE,
            f"--block-size must be 1..{MAX_BLOCK_SIZE}, or 0 to learn it",
        ),
        (args.dp_size >= 1, "--dp-size must be >= 1"),
        (args.max_attempts >= 1, "--max-attempts must be >= 1"),
        (args.breaker_failure_threshold >= 0, "--breaker-failure-threshold must be >= 0"),
        (
            0 < args.breaker_cooldown_s <= args.breaker_max_cooldown_s,
            "--breaker-cooldown-s must be > 0 and <= --breaker-max-cooldown-s",
        ),
        (args.load_interval_ms > 0, "--load-interval-ms must be > 0"),
        (args.health_interval_s > 0, "--health-interval-s must be > 0"),
        (args.worker_evict_after_s >= 0, "--worker-evict-after-s must be >= 0"),
        (args.worker_models_refresh_s >= 0, "--worker-models-refresh-s must be >= 0"),
        (args.max_workers >= 1, "--max-workers must be >= 1"),
        (
            len({*args.worker}) <= args.max_workers,
            f"{len({*args.worker})} --worker flags, more than --max-workers {args.max_workers}",
        ),
        (args.max_request_bytes > 0, "--max-request-bytes must be > 0"),
        (args.tokenize_cache_mb >= 0, "--tokenize-cache-mb must be >= 0 (0 turns the cache off)"),
        (
            args.tokenize_offload_chars >= 0,
            "--tokenize-offload-chars must be >= 0 (0 encodes every prompt on the event loop)",
        ),
        (args.max_connections >= 1, "--max-connections must be >= 1"),
        (args.max_header_count >= 1, "--max-header-count must be >= 1"),
        (args.max_head_bytes >= 1024, "--max-head-bytes must be >= 1024"),
        (args.client_header_timeout_s > 0, "--client-header-timeout-s must be > 0"),
        (args.client_body_timeout_s > 0, "--client-body-timeout-s must be > 0"),
        (args.keepalive_timeout_s > 0, "--keepalive-timeout-s must be > 0"),
        (args.upstream_connect_timeout_s > 0, "--upstream-connect-timeout-s must be > 0"),
        (args.upstream_head_timeout_s > 0, "--upstream-head-timeout-s must be > 0"),
        (args.stream_idle_timeout_s > 0, "--stream-idle-timeout-s must be > 0"),
        (args.client_write_timeout_s > 0, "--client-write-timeout-s must be > 0"),
        (args.upstream_idle_expiry_s > 0, "--upstream-idle-expiry-s must be > 0"),
        (
            args.upstream_connections_per_worker >= 1,
            "--upstream-connections-per-worker must be >= 1",
        ),
        (
            0 <= args.control_port <= 65535
            and (not args.control_port or args.control_port != args.port),
            "--control-port must be 0 (off) or 1..65535, other than --port",
        ),
        (args.drain_timeout_s >= 0, "--drain-timeout-s must be >= 0"),
        (
            1 <= args.kv_events_port_base <= 65536 - args.dp_size,
            "--kv-events-port-base must be 1..65535, with room for --dp-size ranks",
        ),
        (
            args.kv_events_replay_port_base == 0
            or 1 <= args.kv_events_replay_port_base <= 65536 - args.dp_size,
            "--kv-events-replay-port-base must be 0 (no replay) or 1..65535, "
            "with room for --dp-size ranks",
        ),
        (args.kv_bootstrap_timeout_ms >= 0, "--kv-bootstrap-timeout-ms must be >= 0"),
        (
            args.kv_bootstrap_fetch_timeout_cap_ms >= 1000,
            "--kv-bootstrap-fetch-timeout-cap-ms must be >= 1000",
        ),
        (
            args.kv_bootstrap_max_body_mb >= 0,
            "--kv-bootstrap-max-body-mb must be >= 0 (0: sized for --kv-index-max-blocks)",
        ),
        (
            4096 <= args.kv_events_max_message_bytes <= 1 << 30,
            "--kv-events-max-message-bytes must be 4096..1073741824",
        ),
        (args.kv_index_max_blocks >= 1, "--kv-index-max-blocks must be >= 1"),
        (args.worker_snapshot_max_body_mb >= 1, "--worker-snapshot-max-body-mb must be >= 1"),
        (args.booking_ttl_ms >= 0, "--booking-ttl-ms must be >= 0 (0: no bookings)"),
        (
            0 < args.demand_half_life_s < float("inf"),
            "--demand-half-life-s must be a finite number > 0",
        ),
        (args.pressure_max_tracked_blocks >= 1, "--pressure-max-tracked-blocks must be >= 1"),
        (
            0 <= args.placement_timeout_ms <= MAX_PLACEMENT_TIMEOUT_MS,
            f"--placement-timeout-ms must be 0..{MAX_PLACEMENT_TIMEOUT_MS} (0: never ask)",
        ),
        (
            1 <= args.prefix_homes_max <= MAX_HOMES_BOUND,
            f"--prefix-homes-max must be 1..{MAX_HOMES_BOUND}",
        ),
        (
            0 <= args.kv_ingest_processes <= MAX_INGEST_PROCESSES,
            f"--kv-ingest-processes must be 0..{MAX_INGEST_PROCESSES}",
        ),
        (
            MIN_INGEST_SILENCE_S <= args.kv_ingest_silence_s <= MAX_INGEST_SILENCE_S,
            f"--kv-ingest-silence-s must be {MIN_INGEST_SILENCE_S}..{MAX_INGEST_SILENCE_S}",
        ),
        (0 <= args.worker_port <= 65535, "--worker-port must be 0 (the first listed) or 1..65535"),
        (
            not (args.peer and args.kv_peer_selector),
            "give siblings by --peer or by --kv-peer-selector, not both",
        ),
    ]
    for ok, message in checks:
        if not ok:
            _fail(message)
    for url in args.worker:
        if (problem := worker_origin_problem(url)) is not None:
            _fail(f"--worker {url!r} is not a worker's origin: {problem}")
    for url in [*args.peer, *([args.self_url] if args.self_url else [])]:
        if (problem := origin_problem(url)) is not None:
            _fail(f"--peer/--self-url {url!r} is not an http(s) origin: {problem}")
    try:
        AllowList.parse(args.worker_allow_cidr)
    except ValueError as exc:
        _fail(f"--worker-allow-cidr: {exc}")
    try:
        CorsPolicy.parse(args.cors_allow_origin)
    except ValueError as exc:
        _fail(f"--cors-allow-origin: {exc}")
    if args.internal_token and (problem := token_problem(args.internal_token)):
        _fail(f"--internal-token ({TOKEN_ENV}) refused: {problem}")
    if (args.peer or args.kv_peer_selector) and not args.internal_token:
        _fail(
            f"peer bootstrap (--peer, --kv-peer-selector) needs --internal-token ({TOKEN_ENV}): "
            "siblings serve /internal/kv_snapshot only to replicas that present it"
        )
    if args.kube_api_server and (problem := url_problem(args.kube_api_server)):
        _fail(f"--kube-api-server {args.kube_api_server!r} is not an http(s) URL: {problem}")
    try:
        # Loaded here to fail before listening, with the loader's own message; the app loads
        # it again at start-up (a second read of the same files).
        load_tokenizer(
            args.tokenizer,
            engine=AUTO_CHAT_RULES_START if args.chat_rules == "auto" else args.chat_rules,
            cache_mb=args.tokenize_cache_mb,
        )
    except (ValueError, ImportError) as exc:
        _fail(f"--tokenizer: {exc}")
    known = {f.name for f in fields(ServeConfig)}
    values = {k: v for k, v in vars(args).items() if k in known}
    values["workers"] = list(args.worker)
    values["block_size"] = args.block_size or None
    values["internal_token"] = args.internal_token or None
    values["kv_peer_selector"] = args.kv_peer_selector or None
    values["self_url"] = args.self_url or None
    values["worker_selector"] = args.worker_selector or None
    values["kube_api_server"] = args.kube_api_server or None
    values["peer"] = list(args.peer)
    values["worker_allow_cidr"] = list(args.worker_allow_cidr)
    values["cors_allow_origin"] = list(args.cors_allow_origin)
    return ServeConfig(**values)


def unreachable_workers(config: ServeConfig) -> str | None:
    """Why no worker can ever be registered (the replica could only answer 503), or None."""
    if config.workers or config.worker_selector or config.internal_token:
        return None
    return (
        "no worker can be registered: no --worker, no --worker-selector, and POST /workers "
        f"needs --internal-token ({TOKEN_ENV}); every request will be answered 503 until this "
        "replica is started with one of them"
    )


def _fail(message: str, status: int = 2) -> NoReturn:
    sys.stderr.write(f"kvrouter: error: {message}\n")
    raise SystemExit(status)


def _tune_gc() -> None:
    """Fewer, cheaper cyclic collections on the request path.

    Everything allocated at start-up (modules, the app, the replica's parts) is moved out of
    the collector's sight, and the young generation may grow to 20k objects before a pass:
    with CPython's default of 700, decoding event batches and serving requests triggered a
    collection every few requests, and full passes showed in p99. The index itself is
    invisible to the collector (`gc=False` nodes).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)


async def serve(config: ServeConfig, ready: Callable[[str], None] | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before anything else: a SIGTERM during start-up, or one sent as soon as the ready line
    # is read, must drain and exit 0, not kill the process with the default disposition.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if held := launch.arrived():  # while the command was imported and its flags parsed
        log.info("%s arrived during start-up: draining at once", signal.Signals(held[0]).name)
        stop.set()
    serving = await start_serving(config)
    try:
        # Once it listens: a start that fails says one thing, why it failed.
        if (problem := unreachable_workers(config)) is not None:
            log.warning(problem)
        _tune_gc()
        url = serving.url
        log.info(
            "kvrouter listening on %s (policy %s, %s event loop; ingest accelerator: %s, %s)%s",
            url,
            config.policy,
            type(loop).__module__.split(".")[0],
            accel.IMPLEMENTATION,
            accel.REASON,
            f", control plane also on {serving.control_url}" if serving.control_url else "",
        )
        print(f"kvrouter listening on {url}", flush=True)
        if ready is not None:
            ready(url)
        await serve_until(serving, stop, config.drain_timeout_s)
    finally:
        await stop_serving(serving)
    log.info("stopped")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop `--event-loop` asks for; None: asyncio's default."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            _fail("--event-loop uvloop: uvloop is not installed (pip install 'kvrouter[fast]')")
        return None
    return uvloop.new_event_loop


def build_parser() -> tuple[argparse.ArgumentParser, _Flags]:
    """The `kvrouter` parser and the `serve` flags (defaults read from the environment now)."""
    parser = _Parser(prog="kvrouter", description="cache-aware LLM router")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_flags = _serve_parser(sub)
    demo.add_parser(sub)
    view.add_parser(sub)
    sub.add_parser("bench", help="run the benchmarks of this source checkout (python -m bench)")
    return parser, serve_flags


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (and KVROUTER_ environment); exits 2 with one line when invalid."""
    parser, serve_flags = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_flags.apply_defaults(args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    rest = list(sys.argv[1:] if argv is None else argv)
    if rest[:1] != ["serve"]:  # only serve drains: the others end as the signals' defaults do
        launch.release()
    if rest[:1] == ["bench"]:  # its flags are bench/__main__.py's; it lives in the checkout only
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if not os.path.isfile(os.path.join(root, "bench", "__main__.py")):
            _fail("kvrouter bench runs from a source checkout (bench/ is not installed)")
        # Replaced by it, not its parent: a signal meant for `kvrouter bench` reaches it (a
        # parent waiting in subprocess.call died of SIGTERM and left it running, orphaned).
        os.chdir(root)
        os.execv(sys.executable, [sys.executable, "-m", "bench", *rest[1:]])
    args = parse_args(argv)
    if args.command == "serve":
        logging.basicConfig(
            level=args.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        config = serve_config(args)
        try:
            with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
                runner.run(serve(config))
        except (StartError, KubeConfigError) as exc:
            _fail(str(exc), status=1)
    elif args.command == "demo":
        raise SystemExit(pools.run(args) if args.pools != 1 else demo.run(args))
    elif args.command == "view":
        raise SystemExit(view.run(args))


if __name__ == "__main__":
    main()
