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
is unknown (None), never 0: a rank that seems to hold nothing would look full. So is a pool
below one block of the fleet's size (the capacity check had read it as 0 blocks and cleared
the rank every 10 s, while the policy read it as unknown): read as unknown at the poll once
the block size is known (`block_size`), counted and logged as a figure out of range, and in
`capacity_blocks` whatever was kept before it was known.

Every number read from a worker is bounded here, at the parse, once per poll (the request path
and the scrape read the figures as they are): a count, a capacity in tokens or in blocks times
the block size, or a slot count above `MAX_REPORTED` (2**48, ~2.8e14; the largest real KV pool
is ~1e7 tokens) is unknown, as if not reported, and counted per field in
`LoadMonitor.out_of_range` (logged once per registration of the worker), as is a capacity below
one block. Unbounded, a stated 1e308 reached the cost function (an OverflowError on every
request), the capacity check and the /metrics scrape. A rank at or past `MAX_DP_SIZE` is never
built, and what a poll reads is bounded too: a `/v1/loads` body at most `LOADS_MAX_BODY_BYTES`,
a `/metrics` body at most `METRICS_MAX_BODY_BYTES`, of which at most `MAX_METRIC_SAMPLES` lines
of the gauges we read, `MAX_METRIC_SAMPLE_BYTES` in all, are parsed (more is a parse failure,
`too_many_samples`): the parse runs on the event loop, and 8 MiB of wanted gauge lines took
1.6 s of it every tick, as 900 lines of 250 labels each (1.9 MiB) took 3.3 s with
prometheus_client's parser, which the parse no longer uses (`_SAMPLE_LINE`).

The parsers and the probe are plain functions and a small class; `LoadMonitor` is the thin
asyncio shell that does HTTP and keeps counters. Counters are plain `collections.Counter`s:
the app reads them at scrape time, so nothing here imports prometheus_client's registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

import msgspec

from router.dataplane.polling import PollClient

log = logging.getLogger(__name__)

LOADS_PATH: Final = "/v1/loads?include=core"  # SGLang filters sections; others ignore it
METRICS_PATH: Final = "/metrics"
ABSENT_STATUSES: Final = frozenset({404, 405, 501})
# What real engines send is a few KB (the fake worker: ~270 B a rank in /v1/loads, ~600 B in
# /metrics) to a few hundred KB (a vLLM /metrics is mostly histogram buckets, ~1 MiB with many
# LoRAs); the bounds leave room for that and no more, since the poll parses on the loop.
LOADS_MAX_BODY_BYTES: Final = 512 * 1024  # ~500 B a rank at MAX_DP_SIZE ranks
METRICS_MAX_BODY_BYTES: Final = 2 * 1024 * 1024
# Lines of the gauges we read, and their bytes, that a poll parses on the loop (`_SAMPLE_LINE`,
# a regex call a line): four lines a rank and served model name for vLLM, so 512 ranks of one
# model; ~1.1 KiB of them a rank with its long cache config line, so ~230 ranks by bytes. The
# bytes bound the labels all lines may carry, which the parse pays for one by one: the worst
# shape within both (256 KiB of 5-byte labels) costs ~7x what 2,048 real lines do, and about
# what 2,048 real lines cost prometheus_client's parser.
MAX_METRIC_SAMPLES: Final = 2048
MAX_METRIC_SAMPLE_BYTES: Final = 256 * 1024
MAX_REPORTED: Final = 2**48  # the largest count, capacity or slot figure believed
OUT_OF_RANGE_FIELDS: Final = ("running", "waiting", "usage", "capacity", "slots")
# The most dp ranks one worker may have: registration refuses a worker stating more
# (`router.workers`), and a load body's entries for ranks past it are never built. Real
# deployments run up to a few hundred (DP attention over a few dozen nodes).
MAX_DP_SIZE: Final = 1024


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


def parse_loads_body(
    body: bytes, ranks: int = MAX_DP_SIZE, out_of_range: Counter[str] | None = None
) -> dict[int, EngineLoad] | None:
    """dp rank -> load from a `/v1/loads` JSON body.

    None when the body is not a load body (not JSON, not an object, no `loads` array, an
    entry that is not an object). An empty dict when it is one with an empty `loads` array:
    the engine serves the route but has nothing to say yet. An entry without a usable
    `dp_rank` is taken as the rank at its position; one whose rank is `ranks` or more (the
    worker's dp size) is skipped unread; a field missing, of the wrong type or above
    `MAX_REPORTED` is None in its `EngineLoad` (the last counted by field in `out_of_range`).
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
        if type(entry) is not dict:
            return None
        dp_rank = _count(entry.get("dp_rank"))
        rank = position if dp_rank is None else dp_rank
        if rank >= ranks:
            continue
        get = entry.get
        out[rank] = EngineLoad(
            running=_bounded(get("num_running_reqs"), "running", out_of_range),
            waiting=_bounded(get("num_waiting_reqs"), "waiting", out_of_range),
            kv_usage=_fraction(get("token_usage")),
            capacity_tokens=_positive(
                _bounded(get("max_total_num_tokens"), "capacity", out_of_range)
            ),
            slots=_positive(_bounded(get("max_running_requests"), "slots", out_of_range)),
        )
    return out


def _positive(value: int | None) -> int | None:
    return value if value else None


def _count(value: object) -> int | None:
    """A non-negative whole number as an int (a JSON float that is one included), else None.
    Unbounded: the caller bounds it."""
    if type(value) is int:
        return value if value >= 0 else None
    if type(value) is float and value >= 0 and value.is_integer():
        return int(value)
    return None


def _bounded(value: object, name: str, out_of_range: Counter[str] | None) -> int | None:
    """`_count`, None above `MAX_REPORTED` (counted as `name` in `out_of_range`)."""
    n = _count(value)
    return None if n is None or _past_belief(n, name, out_of_range) else n


def _past_belief(value: float, name: str, out_of_range: Counter[str] | None) -> bool:
    """Whether a stated figure is above `MAX_REPORTED`: then counted as `name`, and unknown."""
    if value > MAX_REPORTED:
        if out_of_range is not None:
            out_of_range[name] += 1
        return True
    return False


def _fraction(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return f if math.isfinite(f) and f >= 0 else None


def classify_loads_response(
    status: int | None,
    body: bytes | None,
    ranks: int = MAX_DP_SIZE,
    out_of_range: Counter[str] | None = None,
) -> tuple[ProbeOutcome, dict[int, EngineLoad] | None]:
    """The probe outcome of one `/v1/loads` request, and its loads when available.

    `status` None means no HTTP answer (timeout, connection error); `body` None means it was
    not read (not a 200, or too large).
    """
    if status in ABSENT_STATUSES:
        return ProbeOutcome.ABSENT, None
    if status != 200 or body is None:
        return ProbeOutcome.INCONCLUSIVE, None
    loads = parse_loads_body(body, ranks, out_of_range)
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
        self,
        status: int | None,
        body: bytes | None,
        ranks: int = MAX_DP_SIZE,
        out_of_range: Counter[str] | None = None,
    ) -> tuple[ProbeOutcome, dict[int, EngineLoad] | None]:
        outcome, loads = classify_loads_response(status, body, ranks, out_of_range)
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
# A sample line of a gauge we read: found by one C-level scan of the text, so a body of
# histogram buckets costs no Python per line. Comment lines are left out: every name read is a
# gauge, whose TYPE and HELP lines say nothing its samples do not.
_WANTED_LINE: Final = re.compile(
    "^(?:" + "|".join(map(re.escape, sorted(_WANTED))) + ")[{ \t][^\r\n]*", re.MULTILINE
)
# A kept line is read by these two, in C but for a Python call a line: prometheus_client's
# parser steps through a line a character at a time in Python (~1.5 us a byte on a busy core),
# so a worker sending long label sets on lines of the gauges we read held the loop seconds a
# poll. A value is what the line states between its label set and an optional timestamp, read
# by float(); a label's value is kept escaped (every label read is a number, which no escape
# spells).
_NAME: Final = r"[a-zA-Z_][a-zA-Z0-9_]*"
_ESCAPED: Final = r'(?:[^"\\\n]|\\.)*'
_LABEL: Final = re.compile(rf'({_NAME})[ \t]*=[ \t]*"({_ESCAPED})"')  # name, value
_ONE_LABEL: Final = rf'[ \t]*{_NAME}[ \t]*=[ \t]*"{_ESCAPED}"[ \t]*'
# name, label set (without its braces), value
_SAMPLE_LINE: Final = re.compile(
    rf"([^{{ \t]+)[ \t]*(?:\{{((?:{_ONE_LABEL},)*(?:{_ONE_LABEL})?)\}})?"
    r"[ \t]+([^\s_]+)(?:[ \t]+\S+)?[ \t]*"  # the value, then a timestamp, not read
)
_NO_LOADS: Final[Mapping[int, EngineLoad]] = MappingProxyType({})
_RANK_LABELS: Final = ("dp_rank", "engine")  # SGLang's, then vLLM's (one engine core per rank)
# The `out_of_range` field each gauge's value is counted under.
_FIELD_OF: Final = {
    **dict.fromkeys(_RUNNING_NAMES, "running"),
    **dict.fromkeys(_WAITING_NAMES, "waiting"),
    **dict.fromkeys(_USAGE_NAMES, "usage"),
    **dict.fromkeys((_VLLM_CACHE_INFO, *_CAPACITY_NAMES), "capacity"),
}


_VLLM_BLOCK_SIZE: Final = re.compile(
    r'^vllm:cache_config_info\{[^}\r\n]*\bblock_size="([0-9]{1,9})"', re.MULTILINE
)


def vllm_block_size(text: str) -> int | None:
    """The KV block size a vLLM `/metrics` states (`vllm:cache_config_info`'s `block_size`
    label, one sample per engine core), or None when it states none or its cores differ."""
    sizes = set(map(int, _VLLM_BLOCK_SIZE.findall(text)))
    return sizes.pop() if len(sizes) == 1 else None


class TooManySamples(ValueError):
    """A `/metrics` body with more lines of the load gauges than `MAX_METRIC_SAMPLES`, or more
    bytes of them than `MAX_METRIC_SAMPLE_BYTES`."""


def parse_metrics_text(
    text: str, ranks: int = MAX_DP_SIZE, out_of_range: Counter[str] | None = None
) -> dict[int, EngineLoad]:
    """dp rank -> load from Prometheus text; an empty dict when no known gauge is present.

    Ranks come from a `dp_rank` or `engine` label; samples without one (or with a value
    that is not a rank number) count as rank 0, and samples of a rank `ranks` or more (the
    worker's dp size) are dropped. Several label sets for the same rank (e.g. per model
    name) are added up for the request counts; for KV usage, a fraction, and for capacity
    the largest one is taken. vLLM's capacity is `num_gpu_blocks * block_size` from the
    labels of `vllm:cache_config_info`. A figure above `MAX_REPORTED` (a sample, or a sum of
    them) is unknown, counted by field in `out_of_range`. Raises ValueError when a line of
    the gauges we read does not parse, and TooManySamples (a ValueError) when there are more
    than `MAX_METRIC_SAMPLES` of them or more than `MAX_METRIC_SAMPLE_BYTES` in all, before
    reading any.

    Only the lines of the gauges we read are parsed: a vLLM `/metrics` is mostly histogram
    buckets, which one regex scan of the text skips.
    """
    kept = _WANTED_LINE.findall(text)
    if len(kept) > MAX_METRIC_SAMPLES:
        raise TooManySamples(
            f"too many samples: {len(kept)} lines of the load gauges, at most {MAX_METRIC_SAMPLES}"
        )
    size = sum(map(len, kept))
    if size > MAX_METRIC_SAMPLE_BYTES:
        raise TooManySamples(
            f"too many samples: {size} bytes of load gauge lines, at most {MAX_METRIC_SAMPLE_BYTES}"
        )
    found: dict[str, dict[int, list[float]]] = {}
    try:
        for line in kept:
            sample = _SAMPLE_LINE.fullmatch(line)
            if sample is None:
                raise ValueError(f"not a sample line: {line[:80]!r}")
            name, label_text, value_text = sample.groups()
            value = float(value_text)
            labels = dict(_LABEL.findall(label_text)) if label_text else {}
            if name == _VLLM_CACHE_INFO:
                # An info gauge: the figures are in the labels, the value is always 1.
                value = _vllm_pool_tokens(labels)
            if not value >= 0:  # NaN too (a vLLM still profiling: "None" blocks)
                continue
            if _past_belief(value, _FIELD_OF[name], out_of_range):
                continue
            rank = _rank_label(labels)
            if rank < ranks:
                found.setdefault(name, {}).setdefault(rank, []).append(value)
    except ValueError as exc:
        raise ValueError(f"unparseable Prometheus text: {exc}") from None
    running = _pick(found, _RUNNING_NAMES, sum)
    waiting = _pick(found, _WAITING_NAMES, sum)
    usage = _pick(found, _USAGE_NAMES, max)
    capacity = _pick(found, (_VLLM_CACHE_INFO, *_CAPACITY_NAMES), max)
    return {
        rank: EngineLoad(
            running=_rounded(running.get(rank), "running", out_of_range),
            waiting=_rounded(waiting.get(rank), "waiting", out_of_range),
            kv_usage=usage.get(rank),
            capacity_tokens=_positive(_rounded(capacity.get(rank), "capacity", out_of_range)),
        )
        for rank in sorted(running.keys() | waiting.keys() | usage.keys() | capacity.keys())
    }


def _vllm_pool_tokens(labels: dict[str, str]) -> float:
    """`num_gpu_blocks * block_size` from vLLM's cache config labels; NaN when either is not
    a number (vLLM writes "None" before it has profiled its memory), inf when either is too
    long to be believed (a 400-digit product overflows a float)."""
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if not (blocks.isdecimal() and block_size.isdecimal()):
        return math.nan
    if len(blocks) > 18 or len(block_size) > 18:  # past 10**18: above MAX_REPORTED anyway
        return math.inf
    return float(int(blocks) * int(block_size))


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


def _rounded(value: float | None, name: str, out_of_range: Counter[str] | None) -> int | None:
    """A gauge's figure as a whole count; None when unknown or, summed over label sets,
    above `MAX_REPORTED` (counted as `name`)."""
    if value is None or _past_belief(value, name, out_of_range):
        return None
    return round(value)


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
    # Set when the poll in flight ends: a registration's poll and a tick meet often (the
    # tick is due while the registration waits on its answer), and the second one waits for
    # the first rather than asking again (a 404 is remembered: asked once, counted once).
    polled: asyncio.Event | None = None
    out_of_range_logged: bool = False  # a figure above MAX_REPORTED was logged once


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
        block_size: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`block_size`: the fleet's block size, None while unknown (a capacity below one
        block is then read as unknown at the poll)."""
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be > 0")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Default: three missed ticks plus one timeout.
        self.stale_after_s = 3 * interval_s + timeout_s if stale_after_s is None else stale_after_s
        self.probe_outcomes: Counter[str] = Counter()  # ProbeOutcome value -> count
        self.poll_errors: Counter[str] = Counter()  # reason -> ticks that yielded no loads
        # field (running, waiting, usage, capacity, slots) -> figures above MAX_REPORTED, and
        # capacities below one block
        self.out_of_range: Counter[str] = Counter()
        self._client = client
        self._clock = clock
        self._sleep = sleep
        self._block_size = block_size
        self._workers: dict[str, _Worker] = {}

    # -- registry --------------------------------------------------------------------------

    def add_worker(self, url: str, dp_size: int = 1) -> None:
        """Register a worker, or register it again: either way `/v1/loads` is probed afresh
        on the next tick (the engine behind a URL may have changed). Figures already read
        are kept until they go stale, except for ranks beyond a smaller `dp_size`; the
        capacity is forgotten until the engine states it again."""
        if not 1 <= dp_size <= MAX_DP_SIZE:
            raise ValueError(f"dp_size must be within [1, {MAX_DP_SIZE}]")
        url = url.rstrip("/")
        w = self._workers.get(url)
        if w is None:
            self._workers[url] = _Worker(url, dp_size)
            return
        w.dp_size = dp_size
        w.probe = LoadsProbe()
        w.loads = {r: load for r, load in w.loads.items() if r < dp_size}
        w.capacity = {}
        w.out_of_range_logged = False
        w.polled = None  # the poll in flight asks the old probe: the next one asks afresh

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
        unknown. The most blocks of that size the engine can hold at once, on the device. A
        pool below one block is unknown too, as a stated 0 is: every reader (the policy's
        pressure terms, the capacity check) reads it so, and none as "holds nothing" (the
        poll reads it so once the fleet's block size is known; one kept from before is read
        so here)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        tokens = self.capacity_tokens(url, dp_rank)
        return None if tokens is None else tokens // block_size or None

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
        if w.polled is not None:
            await w.polled.wait()
            return
        polled = w.polled = asyncio.Event()
        try:
            await self._poll(w)
        except Exception:  # a bug here must not stop the other workers' polls or the loop
            self.poll_errors["internal"] += 1
            if not w.failing:  # once while it lasts, as other failures: not twice a second
                log.exception("load poll of %s failed", w.url)
                w.failing = True
        finally:
            if w.polled is polled:
                w.polled = None
            polled.set()

    async def _poll(self, w: _Worker) -> None:
        probe = w.probe
        if not probe.absent:
            status, body, error = await self._fetch(w.url + LOADS_PATH)
            if not self._current(w, probe):
                return  # removed or registered again while we waited
            seen = sum(self.out_of_range.values())
            outcome, loads = probe.observe(status, body, w.dp_size, self.out_of_range)
            if loads:
                loads = self._pools_below_a_block_unknown(loads)
            self._warn_out_of_range(w, seen, "/v1/loads")
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
        status, body, error = await self._fetch(w.url + METRICS_PATH, METRICS_MAX_BODY_BYTES)
        if not self._current(w, probe):
            return
        if status != 200 or body is None:
            self._failed(w, "/metrics", error or _status_reason(status, body))
            return
        seen = sum(self.out_of_range.values())
        try:
            loads = parse_metrics_text(
                body.decode("utf-8", errors="replace"), w.dp_size, self.out_of_range
            )
        except TooManySamples as exc:
            self._failed(w, "/metrics", "too_many_samples", f"{exc}; not an engine's /metrics?")
            return
        except ValueError as exc:
            self._failed(w, "/metrics", "unparseable", f"{exc}; is it an engine's /metrics?")
            return
        loads = self._pools_below_a_block_unknown(loads)
        self._warn_out_of_range(w, seen, "/metrics")
        if not loads:
            self._failed(w, "/metrics", "no_load_metrics")
            return
        self._store(w, loads, "metrics")

    def _pools_below_a_block_unknown(self, loads: dict[int, EngineLoad]) -> dict[int, EngineLoad]:
        """`loads` with a capacity below one block of the fleet's size read as unknown (as
        if not stated: the last one stated stays) and counted as out of range."""
        block_size = self._block_size()
        if block_size is None:
            return loads
        out: dict[int, EngineLoad] = {}
        for rank, load in loads.items():
            if load.capacity_tokens is not None and load.capacity_tokens < block_size:
                self.out_of_range["capacity"] += 1
                load = dataclasses.replace(load, capacity_tokens=None)
            out[rank] = load
        return out

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

    def _failed(self, w: _Worker, path: str, reason: str, detail: str = "") -> None:
        self.poll_errors[reason] += 1
        if not w.failing:
            # The poll client never follows a redirect: a 3xx is a failed answer.
            redirect = ", a redirect: not followed" if reason.startswith("http_3") else ""
            log.warning(
                "could not read the load of %s from %s: %s%s%s",
                w.url,
                path,
                reason,
                redirect,
                f" ({detail})" if detail else "",
            )
            w.failing = True

    def _warn_out_of_range(self, w: _Worker, seen: int, path: str) -> None:
        """Once per registration: the worker stated figures past belief (`seen`: the
        out-of-range count before this read)."""
        if w.out_of_range_logged or sum(self.out_of_range.values()) == seen:
            return
        w.out_of_range_logged = True
        log.warning(
            "%s states load figures above %d, or a KV capacity below one block, in %s (%s so "
            "far): read as unknown; its ranks are routed as if it had not said. Check what "
            "answers at that URL",
            w.url,
            MAX_REPORTED,
            path,
            ", ".join(f"{name} {n}" for name, n in sorted(self.out_of_range.items())),
        )

    async def _fetch(
        self, url: str, limit: int = LOADS_MAX_BODY_BYTES
    ) -> tuple[int | None, bytes | None, str | None]:
        """(status, body if 200 and at most `limit` bytes, error reason if no usable answer)."""
        got = await self._client.get(url, self.timeout_s, limit)
        if got.status is None or got.error == "broken":
            return None, None, got.error if got.status is None else "connection"
        if got.status != 200:
            return got.status, None, None
        return 200, got.body, got.error  # too_large: no body


# `LoadMonitor.poll_errors`' reasons as exported (`kvrouter_load_poll_errors_total`): a
# bounded set, each HTTP status folded into its class.
POLL_ERROR_LABELS: Final = (
    "timeout",
    "connection",
    "too_large",
    "no_body",
    "empty_loads",
    "http_4xx",
    "http_5xx",
    "http_other",
    "unparseable",
    "too_many_samples",
    "no_load_metrics",
    "internal",
)


def poll_error_label(reason: str) -> str:
    """The exported label of a `poll_errors` reason (`POLL_ERROR_LABELS`)."""
    if reason in POLL_ERROR_LABELS:
        return reason
    if reason.startswith("http_"):
        status = reason[5:]
        return f"http_{status[0]}xx" if status in _HTTP_ERRORS else "http_other"
    return "internal"  # a reason this list missed: a bug, as "internal" counts


_HTTP_ERRORS: Final = frozenset(map(str, range(400, 600)))


def _status_reason(status: int | None, body: bytes | None) -> str:
    if status == 200:
        return "empty_loads" if body is not None else "no_body"
    return f"http_{status}"
