"""Engine load monitor: what each worker rank reports about its queue, polled in the background.

The router's own in-flight count only sees requests this replica sent. Other replicas, and
clients that bypass the router, load the same engines, so the policy also wants the engine's
view: running and waiting requests, KV usage and KV capacity per dp rank. Engines offer it two
ways:

- `GET /v1/loads` (SGLang >= 0.5.x, smg's `WorkerLoadResponse`, our fake worker): JSON with a
  `loads` array, one entry per dp rank; the KV pool's size is `max_total_num_tokens`. Cheap
  and exact, so it is asked first. It also states how many requests a rank runs at once,
  `max_running_requests` (`slots`); a 0 there is unknown, as for capacity.
- `GET /metrics` (every vLLM, older SGLang): Prometheus text. vLLM names
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (v0
  called it `vllm:gpu_cache_usage_perc`), and states its pool in the labels of the info gauge
  `vllm:cache_config_info{block_size="16",num_gpu_blocks="...",engine="0",...} 1`; ranks are
  told apart by the `engine` label. SGLang: `num_running_reqs`, `num_queue_reqs`,
  `token_usage`, `max_total_num_tokens`, with the `sglang:` prefix up to 0.5.3 and `sglang_`
  after, ranks by the `dp_rank` label.

Which one a worker serves is a tri-state probe per worker URL (`LoadsProbe`, pure):

    outcome       | what the /v1/loads request got                  | next tick
    --------------+-------------------------------------------------+----------------------
    available     | 200 with a load body                            | /v1/loads again
    absent        | 404, 405, 501, or a 200 that is not a load body | /metrics, for good
    inconclusive  | timeout, connection error, 5xx, 401/403, other, | /v1/loads again
                  | or a load body with an empty `loads` array      |

`absent` is remembered until the worker is removed or registered again; an `absent` verdict
reads `/metrics` on the same tick, so loads do not go missing for one interval. Nothing else
demotes a worker: a 503 from an engine that is starting or overloaded says nothing about
whether it serves `/v1/loads`, and demoting on it would lose the exact per-rank view for the
worker's whole lifetime. An empty `loads` array is what SGLang answers before its schedulers
report, so it is retried too.

A field the engine did not report is None ("unknown"), never 0: an idle-looking rank would
attract every request. A tick that yields nothing keeps the previous figures, but `get`
stops returning them once they are older than `stale_after_s`, so a worker that stopped
answering does not keep looking idle (or busy) forever.

Capacity (`capacity_tokens`, `capacity_blocks`) is the engine's configuration, not a load: the
last value a read reported is kept while the worker stays registered, stale or not, and is
forgotten when the worker is removed or registered again. A capacity of 0, a vLLM
`num_gpu_blocks="None"` (an engine still profiling its memory) or a missing `block_size` label
is unknown (None), never 0: a rank that seems to hold nothing would look full.

The parsers and the probe are plain functions and a small class; `LoadMonitor` is the thin
asyncio shell that does HTTP and keeps counters. Counters are plain `collections.Counter`s:
the app reads them at scrape time, so nothing here imports prometheus_client's registry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from router.dataplane.polling import PollClient

log = logging.getLogger(__name__)

LOADS_PATH: Final = "/v1/loads?include=core"  # SGLang filters sections; others ignore it
METRICS_PATH: Final = "/metrics"
ABSENT_STATUSES: Final = frozenset({404, 405, 501})
MAX_BODY_BYTES: Final = 8 * 1024 * 1024  # a vLLM /metrics with many LoRAs is ~1 MiB


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One dp rank's load as its engine reported it. None: the engine did not say."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    capacity_tokens: int | None = None  # the KV pool's size in tokens
    # How many requests the engine runs at once (SGLang's `max_running_requests`); the rest
    # wait for a slot. vLLM states none: unknown.
    slots: int | None = None


class ProbeOutcome(StrEnum):
    AVAILABLE = "available"
    ABSENT = "absent"
    INCONCLUSIVE = "inconclusive"


# --- /v1/loads ------------------------------------------------------------------------------


def parse_loads_body(body: bytes) -> dict[int, EngineLoad] | None:
    """dp rank -> load from a `/v1/loads` JSON body.

    None when the body is not a load body (not JSON, not an object, no `loads` array, an
    entry that is not an object). An empty dict when it is one with an empty `loads` array:
    the engine serves the route but has nothing to say yet. An entry without a usable
    `dp_rank` is taken as the rank at its position; a field missing or of the wrong type is
    None in its `EngineLoad`.
    """
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    entries = doc.get("loads")
    if not isinstance(entries, list):
        return None
    out: dict[int, EngineLoad] = {}
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict):
            return None
        dp_rank = _count(entry.get("dp_rank"))
        out[position if dp_rank is None else dp_rank] = EngineLoad(
            running=_count(entry.get("num_running_reqs")),
            waiting=_count(entry.get("num_waiting_reqs")),
            kv_usage=_fraction(entry.get("token_usage")),
            capacity_tokens=_positive(_count(entry.get("max_total_num_tokens"))),
            slots=_positive(_count(entry.get("max_running_requests"))),
        )
    return out


def _positive(value: int | None) -> int | None:
    return value if value else None


def _count(value: object) -> int | None:
    if type(value) is int:
        return value if value >= 0 else None
    if type(value) is float and value >= 0 and value.is_integer():
        return int(value)
    return None


def _fraction(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) and f >= 0 else None


def classify_loads_response(
    status: int | None, body: bytes | None
) -> tuple[ProbeOutcome, dict[int, EngineLoad] | None]:
    """The probe outcome of one `/v1/loads` request, and its loads when available.

    `status` None means no HTTP answer (timeout, connection error); `body` None means it was
    not read (not a 200, or too large).
    """
    if status in ABSENT_STATUSES:
        return ProbeOutcome.ABSENT, None
    if status != 200 or body is None:
        return ProbeOutcome.INCONCLUSIVE, None
    loads = parse_loads_body(body)
    if loads is None:
        return ProbeOutcome.ABSENT, None
    if not loads:
        return ProbeOutcome.INCONCLUSIVE, None
    return ProbeOutcome.AVAILABLE, loads


@dataclass(slots=True)
class LoadsProbe:
    """Whether one worker URL serves `/v1/loads`; `absent` latches for the probe's lifetime
    (the monitor makes a new probe when the worker is registered again)."""

    absent: bool = False

    def observe(
        self, status: int | None, body: bytes | None
    ) -> tuple[ProbeOutcome, dict[int, EngineLoad] | None]:
        outcome, loads = classify_loads_response(status, body)
        if outcome is ProbeOutcome.ABSENT:
            self.absent = True
        return outcome, loads


# --- /metrics -------------------------------------------------------------------------------

# Per field, the metric names in order of preference: when an engine exports two spellings
# (vLLM during a rename), the first one present wins rather than the two being added up.
_RUNNING_NAMES: Final = (
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "sglang_num_running_reqs",
)
_WAITING_NAMES: Final = (
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "sglang_num_queue_reqs",
)
_USAGE_NAMES: Final = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "sglang_token_usage",
)
_CAPACITY_NAMES: Final = ("sglang:max_total_num_tokens", "sglang_max_total_num_tokens")
_VLLM_CACHE_INFO: Final = "vllm:cache_config_info"
_WANTED: Final = frozenset(
    _RUNNING_NAMES + _WAITING_NAMES + _USAGE_NAMES + _CAPACITY_NAMES + (_VLLM_CACHE_INFO,)
)
_WANTED_PREFIXES: Final = ("#", *sorted(_WANTED))
_NO_LOADS: Final[Mapping[int, EngineLoad]] = MappingProxyType({})
_RANK_LABELS: Final = ("dp_rank", "engine")  # SGLang's, then vLLM's (one engine core per rank)


def parse_metrics_text(text: str) -> dict[int, EngineLoad]:
    """dp rank -> load from Prometheus text; an empty dict when no known gauge is present.

    Ranks come from a `dp_rank` or `engine` label; samples without one (or with a value
    that is not a rank number) count as rank 0. Several label sets for the same rank (e.g.
    per model name) are added up for the request counts; for KV usage, a fraction, and for
    capacity the largest one is taken. vLLM's capacity is `num_gpu_blocks * block_size` from
    the labels of `vllm:cache_config_info`. Raises ValueError when the text does not parse.

    Only the lines of the gauges we read are handed to the parser: a vLLM `/metrics` is
    mostly histogram buckets, and the pure-Python parser would spend its time on them.
    """
    kept = [line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES) and _keep(line)]
    found: dict[str, dict[int, list[float]]] = {}
    try:
        for family in text_string_to_metric_families("\n".join(kept) + "\n"):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                value = float(sample.value)
                if sample.name == _VLLM_CACHE_INFO:
                    # An info gauge: the figures are in the labels, the value is always 1.
                    value = _vllm_pool_tokens(sample.labels)
                if not math.isfinite(value) or value < 0:
                    continue
                rank = _rank_label(sample.labels)
                found.setdefault(sample.name, {}).setdefault(rank, []).append(value)
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"unparseable Prometheus text: {exc}") from None
    running = _pick(found, _RUNNING_NAMES, sum)
    waiting = _pick(found, _WAITING_NAMES, sum)
    usage = _pick(found, _USAGE_NAMES, max)
    capacity = _pick(found, (_VLLM_CACHE_INFO, *_CAPACITY_NAMES), max)
    return {
        rank: EngineLoad(
            running=_rounded(running.get(rank)),
            waiting=_rounded(waiting.get(rank)),
            kv_usage=usage.get(rank),
            capacity_tokens=_positive(_rounded(capacity.get(rank))),
        )
        for rank in sorted(running.keys() | waiting.keys() | usage.keys() | capacity.keys())
    }


def _vllm_pool_tokens(labels: dict[str, str]) -> float:
    """`num_gpu_blocks * block_size` from vLLM's cache config labels; NaN when either is not
    a number (vLLM writes "None" before it has profiled its memory)."""
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdecimal() and block_size.isdecimal()):
        return math.nan
    return float(int(blocks) * int(block_size))


def _keep(line: str) -> bool:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in _WANTED
    return line.partition("{")[0].partition(" ")[0] in _WANTED


def _rank_label(labels: dict[str, str]) -> int:
    for name in _RANK_LABELS:
        value = labels.get(name)
        if value is not None:
            return int(value) if value.isdecimal() else 0
    return 0


def _pick(
    found: dict[str, dict[int, list[float]]],
    names: tuple[str, ...],
    combine: Callable[[Iterable[float]], float],
) -> dict[int, float]:
    for name in names:
        per_rank = found.get(name)
        if per_rank:
            return {rank: combine(values) for rank, values in per_rank.items()}
    return {}


def _rounded(value: float | None) -> int | None:
    return None if value is None else round(value)


# --- the monitor ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Worker:
    url: str  # without a trailing slash
    dp_size: int
    probe: LoadsProbe = field(default_factory=LoadsProbe)
    loads: dict[int, EngineLoad] = field(default_factory=dict)
    capacity: dict[int, int] = field(default_factory=dict)  # dp rank -> tokens, last reported
    read_at: float | None = None  # clock time of the last successful read
    source: str | None = None  # "loads" or "metrics": where `loads` came from
    failing: bool = False  # the last tick yielded nothing (for log de-duplication)


Sleep = Callable[[float], Awaitable[None]]


class LoadMonitor:
    """Polls every registered worker's load every `interval_s`; `get` reads the latest.

    Each poll is at most two requests per worker (`/v1/loads`, then `/metrics` on an
    `absent` verdict), each bounded by `timeout_s`; workers are polled concurrently, so one
    slow worker delays no other.
    """

    def __init__(
        self,
        client: PollClient,
        interval_s: float = 0.5,
        timeout_s: float = 1.0,
        *,
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be > 0")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Default: three missed ticks plus one timeout.
        self.stale_after_s = 3 * interval_s + timeout_s if stale_after_s is None else stale_after_s
        self.probe_outcomes: Counter[str] = Counter()  # ProbeOutcome value -> count
        self.poll_errors: Counter[str] = Counter()  # reason -> ticks that yielded no loads
        self._client = client
        self._clock = clock
        self._sleep = sleep
        self._workers: dict[str, _Worker] = {}

    # -- registry --------------------------------------------------------------------------

    def add_worker(self, url: str, dp_size: int = 1) -> None:
        """Register a worker, or register it again: either way `/v1/loads` is probed afresh
        on the next tick (the engine behind a URL may have changed). Figures already read
        are kept until they go stale, except for ranks beyond a smaller `dp_size`; the
        capacity is forgotten until the engine states it again."""
        if dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        url = url.rstrip("/")
        w = self._workers.get(url)
        if w is None:
            self._workers[url] = _Worker(url, dp_size)
            return
        w.dp_size = dp_size
        w.probe = LoadsProbe()
        w.loads = {r: load for r, load in w.loads.items() if r < dp_size}
        w.capacity = {}

    def close(self) -> None:
        """Drop every connection (the replica is stopping)."""
        self._client.close()

    def remove_worker(self, url: str) -> None:
        """Forget the worker: its probe verdict, its loads and its connections."""
        url = url.rstrip("/")
        if self._workers.pop(url, None) is not None:
            self._client.forget(url)

    def workers(self) -> list[str]:
        return list(self._workers)

    # -- reads -----------------------------------------------------------------------------

    def get(self, url: str, dp_rank: int = 0) -> EngineLoad | None:
        """The rank's latest load, or None when unknown or older than `stale_after_s`."""
        return self.fresh(url).get(dp_rank)

    def fresh(self, url: str) -> Mapping[int, EngineLoad]:
        """The worker's latest loads by dp rank; empty when unknown or older than
        `stale_after_s`. (One read for all of a worker's ranks, on the request path.)"""
        w = self._workers.get(url) or self._workers.get(url.rstrip("/"))
        if w is None or w.read_at is None or self._clock() - w.read_at > self.stale_after_s:
            return _NO_LOADS
        return w.loads

    def capacity_tokens(self, url: str, dp_rank: int = 0) -> int | None:
        """The rank's KV pool in tokens, as its engine last stated it; None when unknown."""
        w = self._workers.get(url.rstrip("/"))
        return None if w is None else w.capacity.get(dp_rank)

    def capacity_blocks(self, url: str, dp_rank: int, block_size: int) -> int | None:
        """The rank's KV pool in blocks of `block_size` tokens (rounded down); None when
        unknown. The most blocks of that size the engine can hold at once, on the device."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        tokens = self.capacity_tokens(url, dp_rank)
        return None if tokens is None else tokens // block_size

    def source(self, url: str) -> str | None:
        """Where the worker's current figures came from: "loads", "metrics" or None."""
        w = self._workers.get(url.rstrip("/"))
        return None if w is None else w.source

    def probe_absent(self, url: str) -> bool:
        """True when the worker was found not to serve `/v1/loads` (it is read via /metrics)."""
        w = self._workers.get(url.rstrip("/"))
        return w is not None and w.probe.absent

    # -- polling ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll every `interval_s` until cancelled."""
        while True:
            started = self._clock()
            await self.poll_once()
            await self._sleep(max(0.0, self.interval_s - (self._clock() - started)))

    async def poll_worker(self, url: str) -> None:
        """Poll one registered worker now, outside the tick: a newly registered worker's
        capacity is then known before its ranks' snapshots are vetted against it."""
        w = self._workers.get(url.rstrip("/"))
        if w is not None:
            await self._poll_guarded(w)

    async def poll_once(self) -> None:
        """One tick: every registered worker, concurrently."""
        workers = list(self._workers.values())
        if workers:
            await asyncio.gather(*(self._poll_guarded(w) for w in workers))

    async def _poll_guarded(self, w: _Worker) -> None:
        try:
            await self._poll(w)
        except Exception:  # a bug here must not stop the other workers' polls or the loop
            log.exception("load poll of %s failed", w.url)
            self.poll_errors["internal"] += 1

    async def _poll(self, w: _Worker) -> None:
        probe = w.probe
        if not probe.absent:
            status, body, error = await self._fetch(w.url + LOADS_PATH)
            if not self._current(w, probe):
                return  # removed or registered again while we waited
            outcome, loads = probe.observe(status, body)
            self.probe_outcomes[outcome.value] += 1
            if outcome is ProbeOutcome.AVAILABLE:
                assert loads is not None
                self._store(w, loads, "loads")
                return
            if outcome is ProbeOutcome.INCONCLUSIVE:
                self._failed(w, "/v1/loads", error or _status_reason(status, body))
                return
            log.info(
                "%s does not serve /v1/loads (HTTP %s%s); reading its /metrics from now on",
                w.url,
                status,
                "" if status != 200 else ", not a load body",
            )
        status, body, error = await self._fetch(w.url + METRICS_PATH)
        if not self._current(w, probe):
            return
        if status != 200 or body is None:
            self._failed(w, "/metrics", error or _status_reason(status, body))
            return
        try:
            loads = parse_metrics_text(body.decode("utf-8", errors="replace"))
        except ValueError:
            self._failed(w, "/metrics", "unparseable")
            return
        if not loads:
            self._failed(w, "/metrics", "no_load_metrics")
            return
        self._store(w, loads, "metrics")

    def _current(self, w: _Worker, probe: LoadsProbe) -> bool:
        return self._workers.get(w.url) is w and w.probe is probe

    def _store(self, w: _Worker, loads: dict[int, EngineLoad], source: str) -> None:
        w.loads = {rank: load for rank, load in loads.items() if 0 <= rank < w.dp_size}
        for rank, load in w.loads.items():
            if load.capacity_tokens is not None:
                w.capacity[rank] = load.capacity_tokens
        w.read_at = self._clock()
        w.source = source
        if w.failing:
            log.info("loads of %s readable again (via %s)", w.url, source)
            w.failing = False

    def _failed(self, w: _Worker, path: str, reason: str) -> None:
        self.poll_errors[reason] += 1
        if not w.failing:
            # The poll client never follows a redirect: a 3xx is a failed answer.
            redirect = ", a redirect: not followed" if reason.startswith("http_3") else ""
            log.warning(
                "could not read the load of %s from %s: %s%s", w.url, path, reason, redirect
            )
            w.failing = True

    async def _fetch(self, url: str) -> tuple[int | None, bytes | None, str | None]:
        """(status, body if 200, error reason if no usable answer)."""
        got = await self._client.get(url, self.timeout_s, MAX_BODY_BYTES)
        if got.status is None or got.error == "broken":
            return None, None, got.error if got.status is None else "connection"
        if got.status != 200:
            return got.status, None, None
        return 200, got.body, got.error  # too_large: no body


def _status_reason(status: int | None, body: bytes | None) -> str:
    if status == 200:
        return "empty_loads" if body is not None else "no_body"
    return f"http_{status}"
