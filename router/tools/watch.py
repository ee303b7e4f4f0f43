"""`kvrouter view --watch URL [URL ...]`: the replicas' indexes redrawn every second.

For the person running a rollout by hand: per replica its readiness, index size and ingest
backlog; per rank (a row) and replica (a column) the applied cursor, how far it lags the
replica furthest ahead on that rank, the blocks it holds, its bootstrap state (`pending`,
`recovered`, or `unseeded`: the bootstrap ended without a sibling's view, as when the whole
fleet starts at once) and `cold` when the replica's view of the rank may miss blocks (README,
"Peer bootstrap"; `kvrouter_index_cold_ranks`). A rank on
which a replica differs from the one furthest ahead (another cursor, other blocks, or the
rank missing) is highlighted: reverse video on a terminal, a `*` elsewhere. Replicas that
learned different LoRA adapter names (the cursor table's `adapters`) differ too, each such
name listed: they key a request naming one differently.

Each frame costs every replica three small requests, so watching a replica with a million
blocks is as cheap as watching an empty one: `/readyz`, the cursor table
(`/internal/kv_snapshot?cursors_only=true`, with the bearer token as `kvrouter view` sends
it: the ranks with a cursor, and the registered ones with none yet, its `empty_ranks`) and
`/metrics` (blocks per rank from `kvrouter_index_rank_blocks`, as `kvrouter view` counts
them, bootstrap state per rank from `kvrouter_kv_bootstrap_state`, cold ranks from
`kvrouter_index_rank_cold`, `kvrouter_tree_nodes`, `kvrouter_pump_backlog`). It never
exports the index: `kvrouter view` without `--watch` compares the blocks themselves.

With `--count` it exits as `kvrouter view` does, by its last frame (`verdict`: 0 agree, 1 a
rank or the adapter names differ, 2 a replica not read); stopped by Ctrl-C it exits 0.

`frame` (what to draw from what was fetched) is plain code; `watch` is the loop around it,
with the interval, the number of frames and where to draw injectable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cachetree.ranks import RankId
from peer.fetch import Fetched, Refused, SnapshotFetcher, Unreachable
from peer.wire import MSGPACK, PeerSnapshot, WireWorker
from router.auth import TOKEN_ENV

# kvrouter_kv_bootstrap_state: 0 pending, 1 recovered, 2 failed. Not "cold": a rank whose
# bootstrap failed in a fleet started at once has its whole stream (README's cold: a view
# that may miss blocks, shown from kvrouter_index_rank_cold).
BOOTSTRAP_STATES: Final = {0: "pending", 1: "recovered", 2: "unseeded"}
HIGHLIGHT: Final = ("\x1b[7m", "\x1b[0m")  # reverse video
CLEAR: Final = "\x1b[H\x1b[2J"  # cursor home, clear screen
MARK: Final = "*"
CELL_WIDTH: Final = 37  # cursor 7, lag 5, blocks 8, bootstrap 9, view 4, and the spaces between
NAMES_SHOWN: Final = 5  # adapter names shown of those only one replica learned


@dataclass(slots=True)
class ReplicaState:
    """One replica as one frame saw it. `error` set: the rest may be missing."""

    url: str
    ready: bool | None = None
    ready_detail: str = ""
    ranks: set[RankId] = field(default_factory=set)  # every rank its cursor table names
    cursors: dict[RankId, int] = field(default_factory=dict)
    blocks: dict[RankId, int] = field(default_factory=dict)
    bootstrap: dict[RankId, str] = field(default_factory=dict)
    cold: set[RankId] = field(default_factory=set)
    nodes: int | None = None
    backlog: int | None = None
    adapters: frozenset[str] = frozenset()  # the LoRA adapter names it learned
    error: str | None = None


# -- fetching -------------------------------------------------------------------------------


def _rank(worker: WireWorker) -> RankId:
    return RankId(worker.url.rstrip("/"), worker.dp_rank)


def named_ranks(snap: PeerSnapshot) -> set[RankId]:
    """Every rank a cursor table or export names: those it carries (`workers`) and the live
    ones with nothing to carry (`empty_ranks`: registered, no cursor and no blocks yet)."""
    return {_rank(w) for w in snap.workers} | {_rank(w) for w in snap.empty_ranks}


def cursor_table(snap: PeerSnapshot) -> dict[RankId, int]:
    """The applied cursor per rank of a cursor table or export."""
    out: dict[RankId, int] = {}
    for index, seq in snap.cursors:
        if 0 <= index < len(snap.workers):
            out[_rank(snap.workers[index])] = seq
    return out


def read_metrics(state: ReplicaState, text: str) -> None:
    """The per-rank blocks, bootstrap states and cold marks, node count and backlog from
    `/metrics`."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "kvrouter_index_rank_blocks":
                rank = RankId(labels["worker_url"], int(labels["dp_rank"]))
                state.blocks[rank] = int(sample.value)
            elif sample.name == "kvrouter_index_rank_cold":
                state.cold.add(RankId(labels["worker_url"], int(labels["dp_rank"])))
            elif sample.name == "kvrouter_kv_bootstrap_state":
                rank = RankId(labels["worker_url"], int(labels["dp_rank"]))
                state.bootstrap[rank] = BOOTSTRAP_STATES.get(int(sample.value), "?")
            elif sample.name == "kvrouter_tree_nodes":
                state.nodes = int(sample.value)
            elif sample.name == "kvrouter_pump_backlog":
                state.backlog = int(sample.value)


async def fetch_state(
    fetcher: SnapshotFetcher, session: aiohttp.ClientSession, url: str, timeout_s: float
) -> ReplicaState:
    base = url.rstrip("/")
    state = ReplicaState(base)
    bound = aiohttp.ClientTimeout(total=timeout_s)
    at = base + "/readyz"
    try:
        async with session.get(at, timeout=bound) as resp:
            state.ready = resp.status == 200
            if not state.ready:
                body = await resp.json(content_type=None)
                reason = body.get("reason", "") if isinstance(body, dict) else ""
                state.ready_detail = reason or f"HTTP {resp.status}"
        at = base + "/metrics"
        async with session.get(at, timeout=bound) as resp:
            text = await resp.text()
            if resp.status != 200:
                state.error = f"/metrics: HTTP {resp.status}"
                return state
        read_metrics(state, text)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        state.error = failure(at, exc, timeout_s)
        return state
    table = await fetcher.fetch_cursors(base, budget_s=timeout_s)
    if not isinstance(table, Fetched):
        state.error = f"cursor table: {table.reason}{token_hint(table)}"
        return state
    state.cursors = cursor_table(table.snapshot)
    state.ranks = named_ranks(table.snapshot)
    state.adapters = frozenset(table.snapshot.adapters)
    return state


def failure(url: str, exc: Exception, timeout_s: float) -> str:
    """What a failed GET of `url` says: a timeout (whose own message is empty) names the wait,
    a body that did not parse the URL that sent it."""
    if isinstance(exc, TimeoutError):
        return f"{url}: no answer within {timeout_s:g} s"
    if isinstance(exc, ValueError):
        return f"{url}: the body does not parse: {exc}"
    return f"{url}: {type(exc).__name__}: {exc}"


def token_hint(result: Unreachable | Refused) -> str:
    """What to do about a cursor table the replica would not give: its token."""
    if isinstance(result, Unreachable) and result.status in (401, 403):
        return f" (pass --token or set {TOKEN_ENV})"
    return ""  # a body that did not decode (`Refused`) has no status: not a token problem


# -- drawing --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    differs: bool


def _reference(states: Sequence[ReplicaState], rank: RankId) -> ReplicaState | None:
    """The replica furthest ahead on the rank (the first of them), or None if none has it."""
    having = [s for s in states if rank in s.cursors]
    return max(having, key=lambda s: s.cursors[rank]) if having else None


def rank_cells(states: Sequence[ReplicaState], rank: RankId) -> list[Cell]:
    """One cell per replica: cursor, lag behind the replica furthest ahead, blocks, bootstrap
    state, cold mark."""
    ref = _reference(states, rank)
    # A rank no replica has a cursor or blocks for holds nothing anywhere: the replicas agree
    # on it, whichever of them name it (a bootstrap state is all `/metrics` says of a rank
    # registered with no batch yet; a replica without bootstrap says nothing of it at all).
    held = ref is not None or any(s.blocks.get(rank) for s in states)
    cells = []
    for s in states:
        if s.error is not None:
            cells.append(Cell(f"{'error':<{CELL_WIDTH}}", False))
            continue
        if held and rank not in s.cursors and rank not in s.blocks and rank not in s.cold:
            cells.append(Cell(f"{'absent':<{CELL_WIDTH}}", True))
            continue
        cursor = s.cursors.get(rank)
        lag = "" if ref is None or cursor is None else ref.cursors[rank] - cursor
        blocks = s.blocks.get(rank, 0)
        differs = ref is not None and (
            cursor != ref.cursors.get(rank) or blocks != ref.blocks.get(rank, 0)
        )
        text = (
            f"{'-' if cursor is None else cursor:>7} {f'-{lag}' if lag else '':>5} "
            f"{blocks:>8} {s.bootstrap.get(rank, '-'):<9} {'cold' if rank in s.cold else '':<4}"
        )
        cells.append(Cell(text, differs))
    return cells


def frame(states: Sequence[ReplicaState], *, color: bool, header: str = "") -> list[str]:
    """The lines of one frame. Replicas are lettered A, B, ... in the order given."""
    letters = [chr(ord("A") + i) for i in range(len(states))]
    lines = [header] if header else []
    for letter, s in zip(letters, states, strict=True):
        if s.error is not None:
            status = f"error: {s.error}"
        elif s.ready:
            status = "ready"
        else:
            status = f"not ready ({s.ready_detail})"
        size = "" if s.nodes is None else f", {s.nodes} nodes"
        backlog = "" if s.backlog is None else f", backlog {s.backlog}"
        lines.append(f"{letter} {s.url}  {status}{size}{backlog}")
    ranks = ranks_of(states)
    if not ranks:
        lines.append("no ranks yet")
        return lines
    width = max(len(str(r)) for r in ranks)
    columns = "".join(
        f" | {letter + ' cursor':>7} {'lag':>5} {'blocks':>8} {'bootstrap':<9} {'view':<4} "
        for letter in letters
    )
    lines.append(f"{'rank':<{width}}{columns}")
    differing = 0
    for rank in ranks:
        cells = rank_cells(states, rank)
        differing += any(c.differs for c in cells)
        row = "".join(f" | {_mark(c, color)}" for c in cells)
        lines.append(f"{rank!s:<{width}}{row}")
    usable = sum(1 for s in states if s.error is None)
    adapters = adapter_differences(states)
    lines.extend(adapters)
    if differing:
        lines.append(f"{differing} of {len(ranks)} ranks differ between replicas (marked)")
    elif adapters:
        lines.append("the replicas differ on adapter names")
    elif usable > 1:
        lines.append(f"the {usable} replicas agree on cursors and blocks of {len(ranks)} ranks")
    return lines


def adapter_differences(states: Sequence[ReplicaState]) -> list[str]:
    """A line for each replica whose adapter names differ from the first readable one's: the
    two key a request naming one of those differently (in its namespace, or as the base
    model's), so their caches are matched differently."""
    letters = [chr(ord("A") + i) for i in range(len(states))]
    usable = [(letter, s) for letter, s in zip(letters, states, strict=True) if s.error is None]
    lines: list[str] = []
    if not usable:
        return lines
    ref_letter, ref = usable[0]
    for letter, s in usable[1:]:
        if s.adapters != ref.adapters:
            names = names_only_in(s.adapters, ref.adapters, letter, ref_letter)
            lines.append(f"adapter names differ, {letter} vs {ref_letter}: {names}")
    return lines


def names_only_in(other: frozenset[str], ref: frozenset[str], other_is: str, ref_is: str) -> str:
    """Which adapter names only one of two replicas learned, a few of each: "only in B: a, b;
    only in A: c (and 3 more)"."""
    parts = []
    for where, names in ((other_is, other - ref), (ref_is, ref - other)):
        if names:
            shown = sorted(names)[:NAMES_SHOWN]
            more = f" (and {len(names) - NAMES_SHOWN} more)" if len(names) > NAMES_SHOWN else ""
            parts.append(f"only in {where}: {', '.join(map(repr, shown))}{more}")
    return "; ".join(parts)


def ranks_of(states: Sequence[ReplicaState]) -> list[RankId]:
    """The rows: every rank a replica names, as `kvrouter view` lists them. A rank registered
    with no batch yet has no cursor and no blocks: its cursor table names it (`empty_ranks`),
    and with bootstrap on its bootstrap state (pending, or unseeded) does too; named by the
    bootstrap state alone, it was left out on a replica without bootstrap."""
    return sorted({r for s in states for r in (*s.ranks, *s.cursors, *s.blocks, *s.bootstrap)})


def verdict(states: Sequence[ReplicaState]) -> int:
    """`kvrouter view`'s exit status for one frame: 2 if a replica could not be read, 1 if a
    rank differs between replicas, else 0."""
    if any(s.error is not None for s in states):
        return 2
    differ = any(c.differs for rank in ranks_of(states) for c in rank_cells(states, rank))
    return 1 if differ or adapter_differences(states) else 0


def _mark(cell: Cell, color: bool) -> str:
    if not cell.differs:
        return f"{cell.text} "
    if color:
        return f"{HIGHLIGHT[0]}{cell.text}{HIGHLIGHT[1]} "
    return f"{cell.text}{MARK}"


# -- the loop -------------------------------------------------------------------------------


async def watch(
    urls: Sequence[str],
    draw: Callable[[list[str]], None],
    *,
    token: str | None = None,
    interval_s: float = 1.0,
    count: int = 0,
    color: bool = False,
    timeout_s: float = 5.0,
) -> int:
    """Draw a frame every `interval_s` until `count` frames were drawn (0: until cancelled).

    Returns the last frame's `verdict` (0 agree, 1 differ, 2 a replica not read), as
    `kvrouter view` exits. A frame that takes longer than the interval is followed by the
    next one at once, never by a backlog.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    drawn = 0
    async with (
        SnapshotFetcher(token=token, per_fetch_s=timeout_s, accept=MSGPACK) as fetcher,
        aiohttp.ClientSession(headers=headers) as session,
    ):
        while True:
            started = time.monotonic()
            states = await asyncio.gather(
                *(fetch_state(fetcher, session, url, timeout_s) for url in urls)
            )
            stamp = time.strftime("%H:%M:%S")
            header = f"kvrouter view --watch: every {interval_s:g} s, {stamp}; Ctrl-C stops"
            draw(frame(states, color=color, header=header))
            drawn += 1
            if count and drawn >= count:
                return verdict(states)
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
