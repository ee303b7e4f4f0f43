"""`kvrouter view URL [URL ...]`: what each router replica's index holds, and whether they agree.

For every replica it fetches the live cursor table (`/internal/kv_snapshot?cursors_only=true`),
a fresh full export (`/internal/kv_snapshot?max_age_ms=0`, msgpack, gzip) and `/readyz`, with
the same client the replicas use for their siblings (`peer.fetch.SnapshotFetcher`). Each body
is restored into a `cachetree.tree.BlockTree` through the one wire -> columns road
(`peer.vet.VettedSnapshot.from_wire`, then `cachetree.snapshot.restore`), with `live` = every
rank any of the bodies names, so nothing a replica holds is dropped for being unknown here.
The replicas' `canonical_view`s are then compared with the first replica's, and so are the LoRA
adapter names each learned (the bodies' `adapters`): replicas that learned different names key
a request naming one of them differently, so they differ even holding the same blocks.

Output, per replica: readiness, block size, node count, and per rank its cursor and blocks,
and, from the replica's `/metrics` when its policy is cache_aware, what the rank's engine can
hold (`capacity`, in blocks), how many requests it runs at once when its engine states it
(`slots`), the replica's bookings not yet in the index (`booked`) and its
recent demand on the rank (`demand`: distinct blocks routed, decayed), and with
`--prefix-homes` the prefix blocks homed there (`homed`, decayed); then the verdict, and
where views differ, per rank: blocks only in one of the two, and blocks in both whose parent,
tiers or engine hash differ.

`--watch` redraws a live picture every second instead (ranks, cursors, lag, blocks and
bootstrap state per replica, differences marked) from cheap reads; see router/tools/watch.py.

Exit status: 0 when the views agree (one replica always agrees with itself), 1 when they
differ, 2 on errors (a replica unreachable, a body that does not decode or fails vetting, a
bad command line). `--cursors-only` fetches only the cursor tables and readiness: the verdict
then compares cursors (every replica names the same ranks at the same seqs) and adapter names.

A comparison means something only when every replica has applied the same stream: views
taken while events flow can differ by the batches in flight. Compare after a quiesce (every
replica's cursor per rank at the worker's last seq); the cursors are printed so a difference
of that kind is visible as such.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, TextIO

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from cachetree.ranks import RankId
from cachetree.snapshot import SnapshotError, canonical_view, restore
from cachetree.tree import BlockTree
from peer.fetch import Fetched, Refused, SnapshotFetcher
from peer.vet import VetError, VettedSnapshot
from peer.wire import MSGPACK, PeerSnapshot
from router.auth import TOKEN_ENV
from router.index import DEFAULT_INDEX_MAX_BLOCKS
from router.replica import SNAPSHOT_BODY_BYTES_PER_CARRIED_BLOCK
from router.tools import watch

DEFAULT_TIMEOUT_S: Final = 30.0
# What a replica of the default `--kv-index-max-blocks` accepts of a sibling (README "Memory"):
# an index any replica may hold is read whole. At the fetcher's own 24 MiB default a replica
# past ~550k blocks was refused, though the index is sized for millions.
DEFAULT_MAX_BODY_MB: Final = -(
    -DEFAULT_INDEX_MAX_BLOCKS * SNAPSHOT_BODY_BYTES_PER_CARRIED_BLOCK >> 20
)
EXAMPLES: Final = 3  # example keys shown per kind of difference

CanonicalView = frozenset[tuple[int, int | None, tuple]]
# key -> (parent key, tier bits, engine hash) of one rank's carried blocks
RankBlocks = dict[int, tuple[int | None, int, int]]


@dataclass(slots=True)
class ReplicaView:
    """One replica as `view` saw it. `error` set: the rest may be partial."""

    url: str
    ready: bool | None = None
    ready_detail: str = ""
    cursors: dict[RankId, int] = field(default_factory=dict)  # the live cursor table
    ranks: set[RankId] = field(default_factory=set)  # every rank its bodies name
    block_size: int = 0
    producer_ready: bool = False
    snapshot: PeerSnapshot | None = None  # the full export, None with --cursors-only
    tree: BlockTree | None = None  # the export restored
    canonical: CanonicalView | None = None
    pressure: dict[RankId, RankPressure] = field(default_factory=dict)  # from /metrics
    adapters: frozenset[str] = frozenset()  # the LoRA adapter names it learned
    error: str | None = None

    @property
    def nodes(self) -> int | None:
        return None if self.snapshot is None else len(self.snapshot.nodes)

    def blocks(self, rank: RankId) -> int | None:
        return None if self.tree is None else self.tree.block_count(rank)


@dataclass(slots=True)
class RankPressure:
    """cache_aware's figures for one rank, as the replica's /metrics states them."""

    capacity: int | None = None
    slots: int | None = None  # requests its engine runs at once, when it states them
    booked: int | None = None
    demand: float | None = None
    homed: float | None = None  # with --prefix-homes: prefix blocks homed on the rank


_PRESSURE_SERIES: Final = {
    "kvrouter_rank_capacity_blocks": "capacity",
    "kvrouter_rank_slots": "slots",
    "kvrouter_rank_booked_blocks": "booked",
    "kvrouter_rank_demand_blocks": "demand",
    "kvrouter_rank_homed_blocks": "homed",
}


MAX_SECONDS: Final = 86400.0  # a day: `inf` overflowed aiohttp's timer, NaN waited forever


def parse_pressure(text: str) -> dict[RankId, RankPressure]:
    """The per-rank pressure series of a replica's /metrics text (empty when it has none)."""
    out: dict[RankId, RankPressure] = {}
    wanted = [line for line in text.splitlines() if line.partition("{")[0] in _PRESSURE_SERIES]
    for family in text_string_to_metric_families("\n".join(wanted) + "\n"):
        for sample in family.samples:
            url, dp_rank = sample.labels.get("worker_url"), sample.labels.get("dp_rank", "")
            if not url or not dp_rank.isdecimal() or not math.isfinite(sample.value):
                continue
            figures = out.setdefault(RankId(url, int(dp_rank)), RankPressure())
            name = _PRESSURE_SERIES[sample.name]
            value = sample.value if name in ("demand", "homed") else round(sample.value)
            setattr(figures, name, value)
    return out


@dataclass(slots=True)
class RankDiff:
    rank: RankId
    only_ref: list[int] = field(default_factory=list)  # keys carried only in the reference
    only_other: list[int] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)  # same key, other parent/tiers/hash
    cursor_ref: int | None = None
    cursor_other: int | None = None


@dataclass(slots=True)
class PairDiff:
    """How one replica differs from the reference (the first replica)."""

    ref: str
    other: str
    ranks: list[RankDiff] = field(default_factory=list)
    note: str = ""  # a difference not attributable to a rank (block size, structure)
    adapters: str = ""  # the adapter names only one of the two learned (`names_only_in`)


@dataclass(slots=True)
class Comparison:
    agree: bool
    diffs: list[PairDiff] = field(default_factory=list)
    cursors_only: bool = False


# -- fetching -------------------------------------------------------------------------------


async def _readiness(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[bool, str]:
    async with session.get(
        url.rstrip("/") + "/readyz", timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = None
        reason = body.get("reason", "") if isinstance(body, dict) else ""
        if resp.status == 200:
            return True, ""
        return False, reason or f"HTTP {resp.status}"


async def _pressure(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> dict[RankId, RankPressure]:
    """The per-rank pressure figures of the replica's /metrics; empty when it does not have
    them (another policy) or the text does not parse."""
    async with session.get(
        url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        if resp.status != 200:
            return {}
        try:
            return parse_pressure(await resp.text())
        except ValueError:
            return {}


async def fetch_view(
    fetcher: SnapshotFetcher,
    session: aiohttp.ClientSession,
    url: str,
    *,
    cursors_only: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ReplicaView:
    """Readiness, the cursor table and (unless `cursors_only`) a fresh full export."""
    view = ReplicaView(url.rstrip("/"))
    at = view.url + "/readyz"
    try:
        view.ready, view.ready_detail = await _readiness(session, url, timeout_s)
        at = view.url + "/metrics"
        view.pressure = await _pressure(session, url, timeout_s)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        view.error = watch.failure(at, exc, timeout_s)
        return view
    table = await fetcher.fetch_cursors(url, budget_s=timeout_s)
    if not isinstance(table, Fetched):
        view.error = f"cursor table: {table.reason}{watch.token_hint(table)}"
        return view
    view.cursors = watch.cursor_table(table.snapshot)
    view.ranks |= watch.named_ranks(table.snapshot)
    view.adapters = frozenset(table.snapshot.adapters)
    view.block_size = table.snapshot.block_size
    view.producer_ready = table.snapshot.producer_ready
    if cursors_only:
        return view
    # max_age_ms=0: an export that began after this request arrived, never a cached one.
    full = await fetcher.fetch_snapshot(url, 0, budget_s=timeout_s)
    if not isinstance(full, Fetched):
        view.error = f"snapshot: {full.reason}"
        if isinstance(full, Refused) and "-byte bound" in full.reason:
            view.error += " (raise --max-body-mb)"
        return view
    view.snapshot = full.snapshot
    view.ranks |= watch.named_ranks(full.snapshot)
    view.adapters = frozenset(full.snapshot.adapters)
    view.block_size = full.snapshot.block_size or view.block_size
    view.producer_ready = full.snapshot.producer_ready
    return view


def restore_snapshot(snap: PeerSnapshot, live: set[RankId]) -> BlockTree | None:
    """The export as a tree, through the path a booting replica takes (vet, then restore).

    Readiness is not this tool's business, so a body from a replica that is not ready yet is
    vetted as if it were. None when the replica has no tree (block size unknown yet).
    Raises VetError or SnapshotError when the body cannot be restored.
    """
    if snap.block_size < 1:
        return None
    tree = BlockTree(snap.block_size)
    if not snap.nodes:
        return tree
    vetted = VettedSnapshot.from_wire(
        msgspec.structs.replace(snap, producer_ready=True), live, snap.block_size
    )
    restore(tree, vetted.snapshot)
    return tree


def restore_views(views: Sequence[ReplicaView]) -> None:
    """Restore every fetched export, `live` being the union of the ranks all bodies name."""
    live: set[RankId] = set()
    for view in views:
        live |= view.ranks
    for view in views:
        if view.error is not None or view.snapshot is None:
            continue
        try:
            view.tree = restore_snapshot(view.snapshot, live)
        except (VetError, SnapshotError) as exc:
            view.error = f"snapshot does not restore: {exc}"
            continue
        view.canonical = frozenset() if view.tree is None else canonical_view(view.tree)


async def collect(
    urls: Sequence[str],
    *,
    token: str | None = None,
    cursors_only: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_body_mb: int = DEFAULT_MAX_BODY_MB,
) -> list[ReplicaView]:
    """Every replica's view, fetched concurrently and restored."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        # Format 1 (msgpack, gzip) rather than the replicas' columns: this tool reads nodes.
        SnapshotFetcher(
            max_body_bytes=max_body_mb << 20,
            token=token,
            per_fetch_s=timeout_s,
            accept=MSGPACK,
            gzip=True,
        ) as fetcher,
        aiohttp.ClientSession(headers=headers) as session,
    ):
        views = list(
            await asyncio.gather(
                *(
                    fetch_view(
                        fetcher, session, url, cursors_only=cursors_only, timeout_s=timeout_s
                    )
                    for url in urls
                )
            )
        )
    if not cursors_only:
        restore_views(views)
    return views


# -- comparing ------------------------------------------------------------------------------


def rank_blocks(view: CanonicalView) -> dict[RankId, RankBlocks]:
    """A canonical view regrouped per rank: key -> (parent, tier bits, engine hash)."""
    out: dict[RankId, RankBlocks] = {}
    for key, parent, carriers in view:
        for url, dp_rank, bits, engine_hash in carriers:
            out.setdefault(RankId(url, dp_rank), {})[key] = (parent, bits, engine_hash)
    return out


def _diff_views(ref: ReplicaView, other: ReplicaView) -> PairDiff:
    diff = PairDiff(ref.url, other.url)
    if ref.block_size != other.block_size:
        # In `render`'s order, "{other} vs {ref}", and spelt as each replica's line spells it.
        diff.note = f"block size {other.block_size or '-'} vs {ref.block_size or '-'}"
        return diff
    assert ref.canonical is not None and other.canonical is not None
    a, b = rank_blocks(ref.canonical), rank_blocks(other.canonical)
    for rank in sorted(a.keys() | b.keys()):
        ra, rb = a.get(rank, {}), b.get(rank, {})
        if ra == rb:
            continue
        diff.ranks.append(
            RankDiff(
                rank,
                only_ref=sorted(ra.keys() - rb.keys()),
                only_other=sorted(rb.keys() - ra.keys()),
                changed=sorted(k for k in ra.keys() & rb.keys() if ra[k] != rb[k]),
                cursor_ref=ref.cursors.get(rank),
                cursor_other=other.cursors.get(rank),
            )
        )
    if not diff.ranks:
        diff.note = "same blocks per rank, but the tree structure differs"
    return diff


def _diff_cursors(ref: ReplicaView, other: ReplicaView) -> PairDiff:
    diff = PairDiff(ref.url, other.url)
    for rank in sorted(ref.cursors.keys() | other.cursors.keys()):
        a, b = ref.cursors.get(rank), other.cursors.get(rank)
        if a != b:
            diff.ranks.append(RankDiff(rank, cursor_ref=a, cursor_other=b))
    return diff


def compare(views: Sequence[ReplicaView], *, cursors_only: bool = False) -> Comparison:
    """Every replica against the first. Views with errors are not compared."""
    usable = [v for v in views if v.error is None]
    result = Comparison(agree=True, cursors_only=cursors_only)
    if not usable:
        return result
    ref = usable[0]
    for other in usable[1:]:
        if cursors_only:
            same = ref.cursors == other.cursors
            diff = PairDiff(ref.url, other.url) if same else _diff_cursors(ref, other)
        else:
            same = ref.block_size == other.block_size and ref.canonical == other.canonical
            diff = PairDiff(ref.url, other.url) if same else _diff_views(ref, other)
        if other.adapters != ref.adapters:
            # They key a request naming one of these differently, whatever blocks they hold.
            diff.adapters = watch.names_only_in(other.adapters, ref.adapters, other.url, ref.url)
        if not same or diff.adapters:
            result.agree = False
            result.diffs.append(diff)
    return result


def exit_status(views: Sequence[ReplicaView], comparison: Comparison) -> int:
    if any(v.error is not None for v in views):
        return 2
    return 0 if comparison.agree else 1


# -- printing -------------------------------------------------------------------------------


def _examples(keys: list[int]) -> str:
    if not keys:
        return ""
    shown = ", ".join(f"{k:#018x}" for k in keys[:EXAMPLES])
    more = f", ... ({len(keys) - EXAMPLES} more)" if len(keys) > EXAMPLES else ""
    return f" [{shown}{more}]"


def _seq(value: int | None) -> str:
    return "-" if value is None else str(value)


def render(views: Sequence[ReplicaView], comparison: Comparison) -> list[str]:
    lines: list[str] = []
    for view in views:
        if view.ready is None:
            readiness = "readiness unknown"
        elif view.ready:
            readiness = "ready"
        else:
            readiness = f"not ready ({view.ready_detail})"
        head = f"replica {view.url}: {readiness}"
        if view.error is None or view.cursors:
            head += f", block size {view.block_size or '-'}"
            if view.nodes is not None:
                head += f", {view.nodes} nodes"
            if not view.producer_ready:
                head += ", producer not ready"
        lines.append(head)
        if view.error is not None:
            lines.append(f"  error: {view.error}")
        ranks = sorted(view.ranks | view.cursors.keys())
        if ranks:
            width = max(len(str(r)) for r in ranks)
            head = f"  {'rank':<{width}}  {'cursor':>8}  {'blocks':>8}"
            homes = any(p.homed is not None for p in view.pressure.values())
            if view.pressure:
                head += f"  {'capacity':>8}  {'slots':>5}  {'booked':>8}  {'demand':>8}"
            if homes:
                head += f"  {'homed':>8}"
            lines.append(head)
            for rank in ranks:
                blocks = view.blocks(rank)
                line = (
                    f"  {rank!s:<{width}}  {_seq(view.cursors.get(rank)):>8}  "
                    f"{'-' if blocks is None else blocks:>8}"
                )
                if view.pressure:
                    p = view.pressure.get(rank, RankPressure())
                    demand = "-" if p.demand is None else f"{p.demand:.1f}"
                    line += (
                        f"  {_seq(p.capacity):>8}  {_seq(p.slots):>5}  {_seq(p.booked):>8}"
                        f"  {demand:>8}"
                    )
                    if homes:
                        line += f"  {'-' if p.homed is None else f'{p.homed:.1f}':>8}"
                lines.append(line)
        elif view.error is None:
            lines.append("  no ranks")
    compared = [v for v in views if v.error is None]
    what = "cursor tables" if comparison.cursors_only else "views"
    if len(compared) < 2:
        lines.append(f"{what}: nothing to compare ({len(compared)} replica(s) answered)")
    elif comparison.agree:
        if comparison.cursors_only:
            detail = f"{len(compared[0].ranks | compared[0].cursors.keys())} ranks"
        else:
            detail = f"{compared[0].nodes} nodes, {len(compared[0].canonical or ())} in the view"
        lines.append(f"{what}: agree ({len(compared)} replicas, {detail})")
    else:
        lines.append(f"{what}: differ")
        for diff in comparison.diffs:
            lines.append(f"  {diff.other} vs {diff.ref}:")
            if diff.note:
                lines.append(f"    {diff.note}")
            if diff.adapters:
                lines.append(f"    adapter names differ: {diff.adapters}")
            for rd in diff.ranks:
                cursors = f"cursor {_seq(rd.cursor_other)} vs {_seq(rd.cursor_ref)}"
                if comparison.cursors_only:
                    lines.append(f"    rank {rd.rank}: {cursors}")
                    continue
                lines.append(
                    f"    rank {rd.rank}: {len(rd.only_other)} block(s) only in {diff.other}, "
                    f"{len(rd.only_ref)} only in {diff.ref}, {len(rd.changed)} differ "
                    f"(parent/tier/hash); {cursors}"
                )
                if rd.only_other:
                    lines.append(f"      only in {diff.other}:{_examples(rd.only_other)}")
                if rd.only_ref:
                    lines.append(f"      only in {diff.ref}:{_examples(rd.only_ref)}")
                if rd.changed:
                    lines.append(f"      differ:{_examples(rd.changed)}")
        if not comparison.cursors_only and any(
            v.cursors != compared[0].cursors for v in compared[1:]
        ):
            lines.append(
                "  (the cursors differ too: a replica that has not applied the same batches "
                "yet differs by them; compare after a quiesce)"
            )
    return lines


# -- command line ---------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "view",
        help="show and compare router replicas' KV indexes",
        description="Fetch each replica's /internal/kv_snapshot and /readyz; print ranks, "
        "cursors, node counts, readiness, and whether the canonical views agree. "
        "Exit 0: they agree; 1: they differ; 2: errors.",
    )
    p.add_argument("urls", nargs="+", metavar="URL", help="a router replica's base URL")
    p.add_argument(
        "--cursors-only",
        action="store_true",
        help="fetch only the cursor tables (and readiness); the verdict compares cursors",
    )
    p.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV, ""),
        help=f"bearer token for /internal/* [env {TOKEN_ENV}]",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        help=f"bound on each request [default {DEFAULT_TIMEOUT_S:g}; with --watch, "
        "--interval-s or 1 s, whichever is longer, so that a silent replica does not hold "
        "the frames back]",
    )
    p.add_argument(
        "--max-body-mb",
        type=int,
        default=DEFAULT_MAX_BODY_MB,
        help="bound on each replica's export, as sent and inflated (msgpack: half of it goes; "
        "decoded here it takes 9-18 times its size) [default %(default)s: what a replica of the "
        "default --kv-index-max-blocks accepts of a sibling, a full index]",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="redraw ranks, cursors, lag, blocks and bootstrap state per replica every "
        "--interval-s, marking where replicas differ, until Ctrl-C (see router/tools/watch.py)",
    )
    p.add_argument(
        "--interval-s", type=float, default=1.0, help="--watch: seconds between frames [1]"
    )
    p.add_argument(
        "--count",
        type=int,
        default=0,
        help="--watch: stop after this many frames, exiting as view does by the last one "
        "[0: never; Ctrl-C exits 0]",
    )
    return p


def _draw_on(stream: TextIO) -> Callable[[list[str]], None]:
    """A terminal is cleared before each frame; anything else gets frames one after another."""
    tty = stream.isatty()

    def draw(lines: list[str]) -> None:
        stream.write((watch.CLEAR if tty else "") + "\n".join(lines) + "\n" + ("" if tty else "\n"))
        stream.flush()  # BrokenPipeError when the reader left: see `run_watch`

    return draw


def run_watch(args: argparse.Namespace) -> int:
    if not 0 < args.interval_s <= MAX_SECONDS or args.count < 0:
        sys.stderr.write(
            f"kvrouter: error: --interval-s must be > 0 and at most {MAX_SECONDS:g}, "
            "and --count >= 0\n"
        )
        return 2
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    try:
        return asyncio.run(
            watch.watch(
                args.urls,
                _draw_on(sys.stdout),
                token=args.token or None,
                interval_s=args.interval_s,
                count=args.count,
                color=color,
                timeout_s=max(args.interval_s, 1.0) if args.timeout_s is None else args.timeout_s,
            )
        )
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader left (`| head`): the end of the watch, as Ctrl-C is. stdout is pointed at
        # /dev/null so that the interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def run(args: argparse.Namespace) -> int:
    """`kvrouter view`: print the report, return the exit status."""
    for url in args.urls:
        if not url.startswith(("http://", "https://")):
            sys.stderr.write(f"kvrouter: error: {url!r} is not an http(s) URL\n")
            return 2
    if args.timeout_s is not None and not 0 < args.timeout_s <= MAX_SECONDS:  # NaN too
        sys.stderr.write(f"kvrouter: error: --timeout-s must be > 0 and at most {MAX_SECONDS:g}\n")
        return 2
    if args.max_body_mb < 1:
        sys.stderr.write("kvrouter: error: --max-body-mb must be >= 1\n")
        return 2
    if args.count and not args.watch:  # it was ignored: one report, whatever count was asked
        sys.stderr.write("kvrouter: error: --count counts --watch frames: add --watch\n")
        return 2
    if args.watch:
        return run_watch(args)
    views = asyncio.run(
        collect(
            args.urls,
            token=args.token or None,
            cursors_only=args.cursors_only,
            timeout_s=DEFAULT_TIMEOUT_S if args.timeout_s is None else args.timeout_s,
            max_body_mb=args.max_body_mb,
        )
    )
    comparison = compare(views, cursors_only=args.cursors_only)
    for line in render(views, comparison):
        print(line)
    return exit_status(views, comparison)
