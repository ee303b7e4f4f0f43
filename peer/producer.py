"""The producer of `GET /internal/kv_snapshot`: builds, caches and serves exports of the index.

Rules of this file: it reads the index through `IndexView` (the pump's tree, cursors and
live set) and never writes it. Everything runs on the event loop that the pump runs on, so a
read between two awaits never sees a half-applied batch; long work is cut into slices of
half a millisecond with a yield to the loop between them, so `/healthz`, routing and the
pump keep running while a million-block export is built (bench/bench_export.py prints
/healthz latency during the build and each first encoding; the budget is p99 < 50 ms).
Only the byte copies (joining the body, gzip) leave the loop, for a worker thread: they
release the GIL.

Theory of operation
-------------------
An export is what a booting sibling grafts beneath the live stream it is already holding, so
what matters is the order in which it samples the index:

1. `exported_at` is stamped before anything is read. A consumer that asks for an export no
   older than some instant gets one whose every byte was read after that instant.
2. The cursors (last applied seq per rank) are read before the tree is walked. The pump
   changes the tree before it advances a cursor, so this order makes each cursor lag the
   tree: the consumer replays a few batches the snapshot already reflects, which is harmless
   (store and remove are idempotent). The other order could hand out a cursor ahead of the
   tree and silently lose a removal.
3. The tree's nodes are listed, then walked, in chunks (`cachetree.snapshot.SnapshotExport`).
   The listing runs while the pump is held (`hold_writer`: a dict cannot be iterated across a
   change), a slice at a time with the loop turning between slices, so neither it nor the
   pump's queued batches stall the loop; at 6M nodes it takes ~0.2 s in all. During the walk
   the pump keeps applying batches between chunks; a node pruned mid-walk is skipped with its
   subtree, one added after the listing is missing. Both are repaired by the replay from the
   pre-walk cursors.
4. Each pre-walk cursor is checked against the live one after the walk. It is kept only if
   the live cursor is still at or past it (a lower or missing one means the publisher reset,
   or the rank was removed and maybe re-added, mid-walk) and the rank carries at least one
   exported node. So the full body lists cursors only for carrier ranks.
5. `empty_ranks` are the live ranks (read after the walk) that carry no exported node. That
   can only err toward a consumer settling a rank cold, never toward a wrong graft.
   `cold_ranks` are the table's ranks the index held as cold (`router.index`) before the walk
   or after it: a rank warmed mid-walk (a worker snapshot between two chunks) may have been
   walked partly as it was, so only a rank whole at both ends is exported as whole.
   `adapters` are the LoRA adapter names the index had learned, read after the walk (a
   name learned mid-walk names blocks the replay brings).
6. An export keeps the walk's columns, not a body. The columnar body (`peer.wire`, what our
   own fetch client asks for) is the columns themselves, written from views of them: no copy
   (~33 B a node, where a joined copy would double it). JSON and msgpack, for siblings that
   only speak format 1 and for humans with curl, are encoded in slices (~0.5 s each for 1M
   nodes) on the first request that asks for one and kept with the export as parts, never
   joined. A gzip of a body is made on first demand too, in a worker thread. A failed
   encoding or compression is never kept: that request answers 503, the next one tries again.
7. Memory: the cached export is dropped `cache_ttl_s` after it was stamped (the default
   `max_age`, 2 s: a request stating a longer one gets a new build), by a timer, so a replica
   that served one export does not keep its size for the rest of its life; `release` then
   hands the freed pages back to the OS (`router.heap.trim` in a replica). Its bytes are
   exported as `kvrouter_kv_snapshot_cached_bytes`, and README's sizing adds them to the
   index's (an export is about 33 B a node, a sixth of the index).

Herd sharing: one build at a time. The in-flight build is a detached task and is itself the
lock: a caller that finds one joins it (shielded), so a caller that goes away (a client that
hangs up) neither cancels the build nor loses its result; it still fills the cache. A request
that arrives at `requested_at` stating `max_age_ms` reuses the cached export when
`exported_at >= requested_at` (the export began after the request arrived) or
`requested_at - exported_at < max_age`. Age is measured from arrival, so a request queued
behind a build that began after it arrived accepts that build, whatever age it stated. A stale
export is dropped before a rebuild, so two full bodies are never held at once.

`cursors_only` bodies are read live from the cursor map (every rank with a cursor, including
ranks whose blocks are all gone: they are still valid witnesses for a splice probe), carry no
nodes and never touch the cache. Their `empty_ranks` are the live ranks with no cursor yet, so
that a reader of the table alone (`kvrouter view --watch`) lists every registered rank, as the
export's `empty_ranks` let `kvrouter view` do, and their `adapters` are the names learned by
then, so that it can tell replicas that would key a request naming an adapter differently.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import struct
import time
import zlib
from array import array
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Final, Protocol, TypeVar

import msgspec
from aiohttp import web

from cachetree.keys import KEY_SCHEME
from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, SnapshotExport
from cachetree.tree import BlockTree
from peer import wire
from peer.wire import (
    COLUMNS,
    FORMAT,
    JSON,
    MSGPACK,
    ColumnsHead,
    Envelope,
    PeerSnapshot,
    WireWorker,
    envelope,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE_MS: Final = 2000
MAX_AGE_LIMIT_MS: Final = 2**64 - 1  # the largest value a u64 query parameter can state
# The longest stretch of export work between two yields to the loop. A request needs several
# loop iterations (read, handler, write), and a busy export takes a slice in each, so the
# slice sets /healthz latency during an export: measured p50 16 / 9.5 / 4 ms at 2 / 1 / 0.5 ms.
SLICE_S: Final = 0.0005
WALK_STEP: Final = 512  # nodes per SnapshotExport.step (~0.2 ms); a slice runs as many as fit
LIST_STEP: Final = 16384  # nodes listed per SnapshotExport.list_step (~0.3 ms at 6M nodes)
ENCODE_CHUNK: Final = 512  # nodes per encode call, both encodings (~0.4 ms)
SCAN_CHUNK: Final = 16384  # carrier entries per step when listing or renumbering carriers
GZIP_LEVEL: Final = 1  # the fastest level: 2.6x smaller JSON; level 6 saves 7% at 4.5x time
GZIP_FEED: Final = 1 << 20  # bytes per zlib call, so the loop thread gets the GIL in between
WRITE_CHUNK: Final = 1 << 20  # bytes per response write, so no write copies a whole body
VARY: Final = "Accept-Encoding, Accept"
ENCODE_FAILED: Final = "snapshot could not be encoded"


class IndexView(Protocol):
    """What the producer reads: the pump's `IndexRules` satisfies it.

    The block size is the tree's: the tree exists exactly when the fleet block size is known.
    """

    @property
    def tree(self) -> BlockTree | None: ...

    @property
    def cursors(self) -> Mapping[RankId, int]: ...

    @property
    def live(self) -> AbstractSet[RankId]: ...

    @property
    def cold(self) -> AbstractSet[RankId]: ...

    @property
    def adapters(self) -> AbstractSet[str]: ...


Encode = Callable[[Any, str], bytes]  # (value, content type) -> body bytes
Parts = list[bytes | memoryview]  # a body as buffers written one after the other
T = TypeVar("T")
HoldWriter = Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]


async def _unheld(job: Callable[[], Awaitable[None]]) -> None:
    """The default `hold_writer`: no writer to hold (tests that write the tree themselves)."""
    await job()


def encode_value(value: Any, content_type: str) -> bytes:
    """The default encoder: msgpack when asked, JSON otherwise."""
    if content_type == MSGPACK:
        return _msgpack.encode(value)
    return _json.encode(value)


_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()


async def _yield_to_loop() -> None:
    await asyncio.sleep(0)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a synchronous stretch (no await inside)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class SnapshotUnavailable(Exception):
    """The export (or its compression) could not be encoded; nothing was cached."""


@dataclass(slots=True)
class ProducerStats:
    builds: int = 0  # exports started
    failed: int = 0  # builds or compressions that failed (never cached)
    reused: int = 0  # requests answered from the cache
    cursors_only: int = 0


@dataclass(slots=True)
class Export:
    """One cached export: its stamp, its envelope and node columns, and its bodies, each
    encoding made once, on first demand (identity, then gzip)."""

    exported_at: float
    producer_ready: bool
    nodes: int
    head: Envelope
    columns: Snapshot  # carrier worker indices already in the envelope's table
    timings: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds
    bodies: dict[str, asyncio.Task[Parts]] = field(default_factory=dict)
    gzipped: dict[str, asyncio.Task[Parts]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held: the columns, and every encoding and gzip made so far."""
        c = self.columns
        held = sum(
            a.itemsize * len(a)
            for a in (
                c.parents,
                c.keys,
                c.carrier_counts,
                c.carrier_workers,
                c.carrier_tiers,
                c.carrier_hashes,
            )
        )
        for tasks in (self.bodies, self.gzipped):
            for content_type, task in tasks.items():
                if content_type != COLUMNS and task.done() and not task.exception():
                    held += sum(map(len, task.result()))
        return held


def reusable(exported_at: float, requested_at: float, max_age_s: float) -> bool:
    """May a request that arrived at `requested_at` stating `max_age_s` use this export?"""
    return exported_at >= requested_at or requested_at - exported_at < max_age_s


def recheck_cursors(
    before: Mapping[RankId, int], after: Mapping[RankId, int], table: Sequence[RankId]
) -> list[tuple[int, int]]:
    """The `[table index, seq]` pairs to publish: pre-walk cursors still valid after the walk.

    A cursor is kept when the rank is in the exported worker table and its live cursor is
    still at or past the pre-walk value; a lower or missing one means the rank's stream was
    reset or the rank was removed while the walk ran, and the pre-walk value is meaningless.
    """
    out = []
    for index, rank in enumerate(table):
        seq = before.get(rank)
        now = after.get(rank)
        if seq is not None and now is not None and now >= seq:
            out.append((index, seq))
    return out


class SnapshotProducer:
    """Builds and caches exports of `view`; serves cursor tables live.

    `clock` (seconds, monotonic), `encode` and `yield_point` are attributes so a test can
    replace them on a running replica: a fake clock, an encoder that fails, a yield that
    parks the build mid-walk. `hold_writer(job)` runs `job` while the index's writer (the
    pump) applies nothing; `cache_ttl_s` is how long a built export is kept.
    """

    def __init__(
        self,
        view: IndexView,
        *,
        settled: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        encode: Encode = encode_value,
        slice_s: float = SLICE_S,
        walk_step: int = WALK_STEP,
        encode_chunk: int = ENCODE_CHUNK,
        list_step: int = LIST_STEP,
        hold_writer: HoldWriter = _unheld,
        cache_ttl_s: float = DEFAULT_MAX_AGE_MS / 1000,
        release: Callable[[], object] = lambda: None,
    ) -> None:
        self.view = view
        self.settled = settled
        self.clock = clock
        self.encode = encode
        self.yield_point: Callable[[], Awaitable[None]] = _yield_to_loop
        self.slice_s = slice_s
        self.walk_step = walk_step
        self.encode_chunk = encode_chunk
        self.list_step = list_step
        self.hold_writer = hold_writer
        self.cache_ttl_s = cache_ttl_s
        self.release = release
        self.stats = ProducerStats()
        self._cached: Export | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._build: asyncio.Task[Export | None] | None = None
        self._waiting = 0

    @property
    def cached(self) -> Export | None:
        return self._cached

    @property
    def building(self) -> bool:
        return self._build is not None

    @property
    def waiting(self) -> int:
        """Callers currently waiting for a build."""
        return self._waiting

    async def wait_idle(self) -> None:
        """Until no build is running (tests, orderly shutdown)."""
        while (build := self._build) is not None:
            await asyncio.wait([build])

    @property
    def cached_bytes(self) -> int:
        entry = self._cached
        return 0 if entry is None else entry.nbytes

    def expire(self) -> bool:
        """Drop the cached export if `cache_ttl_s` has passed since it was stamped (the
        timer's call; tests call it with a fake clock). True when one was dropped."""
        entry = self._cached
        if entry is None or self.clock() - entry.exported_at < self.cache_ttl_s:
            return False
        self._drop_cached()
        del entry
        self.release()  # hand the freed columns back to the OS
        log.info(
            "kv snapshot: the cached export expired after %.1f s and was dropped",
            self.cache_ttl_s,
        )
        return True

    def _drop_cached(self) -> None:
        self._cached = None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _keep(self, entry: Export | None) -> None:
        """Cache a finished build and arm its expiry."""
        self._drop_cached()
        self._cached = entry
        if entry is not None:
            self._arm(entry)

    def _arm(self, entry: Export) -> None:
        # A bound method and an argument, not a closure that names itself: such a closure is
        # a reference cycle, which would keep the export alive until a full collection.
        self._expiry = asyncio.get_running_loop().call_later(self.cache_ttl_s, self._fire, entry)

    def _fire(self, entry: Export) -> None:
        self._expiry = None
        if self._cached is entry and not self.expire():
            self._arm(entry)  # the clock says it is not due yet (a test's fake clock)

    async def aclose(self) -> None:
        """Cancel a build in progress (shutdown); its waiters see the cancellation."""
        self._drop_cached()
        build = self._build
        if build is not None:
            build.cancel()
            await asyncio.wait([build])

    # -- full exports ----------------------------------------------------------------------

    async def export(self, max_age_ms: int | None = None) -> Export:
        """The cached export if it meets `max_age_ms` (default 2 s), else a new one.

        Raises SnapshotUnavailable when the build this caller waited for failed to encode.
        """
        requested_at = self.clock()
        max_age_s = (DEFAULT_MAX_AGE_MS if max_age_ms is None else max_age_ms) / 1000
        while True:
            entry = self._cached
            if entry is not None and reusable(entry.exported_at, requested_at, max_age_s):
                self.stats.reused += 1
                return entry
            build = self._build
            started_here = build is None
            if build is None:
                self._drop_cached()  # a stale export goes before its successor is built
                build = self._build = asyncio.create_task(self._run_build(), name="kv-export")
            self._waiting += 1
            try:
                entry = await asyncio.shield(build)
            finally:
                self._waiting -= 1
            if entry is None:
                raise SnapshotUnavailable(ENCODE_FAILED)
            # A build this caller started began after it arrived: it qualifies whatever the
            # clock says. One it joined may have begun earlier: judge it by the rule.
            if started_here or reusable(entry.exported_at, requested_at, max_age_s):
                return entry

    async def body(self, entry: Export, content_type: str, gzip: bool) -> bytes:
        """An export's body as one bytes object (a copy: tests and tools; the route writes
        `body_parts`)."""
        return b"".join(await self.body_parts(entry, content_type, gzip))

    async def body_parts(self, entry: Export, content_type: str, gzip: bool) -> Parts:
        """An export's body as parts to write in order. Each encoding, and the gzip of it,
        is made once, on first demand: JSON and msgpack in slices on the loop, gzip off it;
        the columnar body is views of the columns."""
        identity = await self._once(
            entry.bodies, content_type, lambda: self._encode(entry, content_type), "encoding"
        )
        if not gzip:
            return identity
        return await self._once(
            entry.gzipped,
            content_type,
            lambda: asyncio.to_thread(lambda: [gzip_bytes(identity)]),
            "gzip",
        )

    async def _once(
        self,
        made: dict[str, asyncio.Task[Parts]],
        content_type: str,
        make: Callable[[], Awaitable[Parts]],
        what: str,
    ) -> Parts:
        """Single flight for one product of an export; a failure is not kept."""
        task = made.get(content_type)
        if task is None:
            task = asyncio.create_task(make())
            task.add_done_callback(_retrieve_exception)
            made[content_type] = task
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if made.get(content_type) is task:
                del made[content_type]
                self.stats.failed += 1
                log.error("kv snapshot: %s %s failed: %r", content_type, what, exc)
            raise SnapshotUnavailable(ENCODE_FAILED) from exc

    async def _encode(self, entry: Export, content_type: str) -> Parts:
        started = time.perf_counter()
        columns = entry.columns
        if content_type == COLUMNS:
            head = ColumnsHead(
                **envelope(entry.head), nodes=len(columns), carriers=len(columns.carrier_workers)
            )
            parts = wire.encode_columns(head, wire.node_columns(columns))
        else:
            nodes = NodeEncoder(columns, content_type, self.encode)
            await self._sliced(lambda: nodes.step(self.encode_chunk))
            parts = nodes.body_parts(self.encode(entry.head, content_type))
        entry.timings[f"encode {content_type}"] = time.perf_counter() - started
        log.info(
            "kv snapshot: %d nodes encoded as %s, %d B in %.2f s",
            entry.nodes,
            content_type,
            sum(map(len, parts)),
            entry.timings[f"encode {content_type}"],
        )
        return parts

    async def _run_build(self) -> Export | None:
        self.stats.builds += 1
        try:
            entry: Export | None = await self._build_export()
        except Exception:
            log.exception("kv snapshot: the export could not be built or encoded")
            self.stats.failed += 1
            entry = None
        finally:
            self._build = None
        self._keep(entry)
        return entry

    async def _build_export(self) -> Export:
        clock = time.perf_counter
        started = clock()
        exported_at = self.clock()  # 1. stamped before anything is sampled
        view = self.view
        tree = view.tree
        before = dict(view.cursors)  # 2. cursors before the walk
        cold_before = set(view.cold)
        if tree is None:
            block_size, snap = 0, Snapshot()
        else:
            block_size = tree.block_size
            job = SnapshotExport(tree)  # 3. the listing, writer held, then the walk

            async def listing() -> None:
                await self._sliced(lambda: job.list_step(self.list_step))

            await self.hold_writer(listing)
            listed = clock()
            step = self.walk_step
            await self._sliced(lambda: job.step(step))
            snap = job.result()
            # The pump keeps the last job it ran (`listing`, through its closure's cell) until
            # it runs another: empty the cell, or that reference keeps this export's columns
            # alive past their expiry (~200 MB at 6M blocks, in bench/scale.py).
            del job
        walked = clock()
        table = await self._carrier_table(snap)
        live = view.live
        cursors = recheck_cursors(before, view.cursors, table)  # 4.
        carried = set(table)
        empty = sorted(rank for rank in live if rank not in carried)  # 5.
        cold = cold_before | view.cold
        ready = block_size > 0 and bool(self.settled()) and len(snap) > 0
        head = Envelope(
            format=FORMAT,
            block_size=block_size,
            key_scheme=KEY_SCHEME,
            producer_ready=ready,
            workers=[WireWorker(rank.worker_url, rank.dp_rank) for rank in table],
            cursors=cursors,
            empty_ranks=[WireWorker(rank.worker_url, rank.dp_rank) for rank in empty],
            cold_ranks=[  # an empty rank too: it holds nothing because it ran cold
                WireWorker(rank.worker_url, rank.dp_rank)
                for rank in [*table, *empty]
                if rank in cold
            ],
            adapters=sorted(view.adapters),
        )
        done = clock()
        timings = {
            "list": listed - started if tree is not None else 0.0,
            "walk": walked - started,
            "table": done - walked,
            "export": done - started,
        }
        log.info(
            "kv snapshot: %d nodes, %d ranks (%d empty, %d cold) exported in %.2f s",
            len(snap),
            len(table),
            len(empty),
            len(head.cold_ranks),
            timings["export"],
        )
        return Export(exported_at, ready, len(snap), head, snap, timings)

    async def _carrier_table(self, snap: Snapshot) -> list[RankId]:
        """The worker table restricted to ranks that carry an exported node.

        The walk's table can name a rank that carries nothing (all its blocks went mid-walk,
        or it holds a slot with no blocks); such a rank must appear in `empty_ranks`, not in
        the table. When one is dropped, the carriers are renumbered in `snap` itself.
        """
        workers = snap.workers
        carriers = snap.carrier_workers
        used: set[int] = set()
        pos = 0

        def scan() -> bool:
            nonlocal pos
            used.update(carriers[pos : pos + SCAN_CHUNK])
            pos += SCAN_CHUNK
            return pos >= len(carriers) or len(used) == len(workers)

        if carriers:
            await self._sliced(scan)
        if len(used) == len(workers):
            return list(workers)
        remap = [-1] * len(workers)
        table = []
        for index in sorted(used):
            remap[index] = len(table)
            table.append(workers[index])
        renumbered = array("I")
        pos = 0

        def renumber() -> bool:
            nonlocal pos
            renumbered.extend(map(remap.__getitem__, carriers[pos : pos + SCAN_CHUNK]))
            pos += SCAN_CHUNK
            return pos >= len(carriers)

        await self._sliced(renumber)
        snap.carrier_workers = renumbered
        snap.workers = table
        return table

    async def _sliced(self, step: Callable[[], bool]) -> None:
        """Run `step` until it returns True, yielding to the loop every `slice_s` seconds.

        The cyclic collector is paused within a slice (never across a yield). Every object a
        slice allocates is garbage by its end, so without a collection in the middle none of
        it is promoted; with one, a chunk's live tuples reach the oldest generation and soon
        force a full collection, which has to traverse the whole index (measured: a dozen of
        40-130 ms each during a 1M-block export).
        """
        clock = time.perf_counter
        while True:
            deadline = clock() + self.slice_s
            with _collector_paused():
                while True:
                    if step():
                        return
                    if clock() >= deadline:
                        break
            await self.yield_point()

    # -- cursor tables ---------------------------------------------------------------------

    def cursor_table(self) -> PeerSnapshot:
        """The live cursor table: every rank with a cursor, no nodes, never cached; the live
        ranks with none yet (registered, no batch applied) in `empty_ranks`; the adapter
        names learned in `adapters`."""
        self.stats.cursors_only += 1
        view = self.view
        tree = view.tree
        cursors = view.cursors
        ranks = sorted(cursors)
        empty = sorted(rank for rank in view.live if rank not in cursors)
        ready = tree is not None and bool(self.settled()) and len(tree) > 0
        return PeerSnapshot(
            format=FORMAT,
            block_size=0 if tree is None else tree.block_size,
            key_scheme=KEY_SCHEME,
            producer_ready=ready,
            workers=[WireWorker(rank.worker_url, rank.dp_rank) for rank in ranks],
            cursors=[(i, cursors[rank]) for i, rank in enumerate(ranks)],
            empty_ranks=[WireWorker(rank.worker_url, rank.dp_rank) for rank in empty],
            nodes=[],
            adapters=sorted(view.adapters),
        )


_root_to_none = {-1: None}.get  # map(_root_to_none, ps, ps): -1 -> None, any other p -> p


class NodeEncoder:
    """Encodes a `Snapshot`'s records as format-1 wire nodes, a chunk per `step()`.

    A node is `[parent or null, key, [[worker, tier bits, engine hash], ...]]`, the layout of
    `peer.wire.WireNode`. Runs of nodes with exactly one carrier (nearly all of a real tree)
    are built by `zip` over the columns, at C speed; the others one by one.
    """

    def __init__(self, snap: Snapshot, content_type: str, encode: Encode) -> None:
        self._snap = snap
        self._content_type = content_type
        self._encode = encode
        self._pos = 0
        self._carrier_pos = 0
        self._parts: list[bytes | memoryview] = []

    def step(self, budget: int) -> bool:
        snap = self._snap
        a = self._pos
        b = min(a + budget, len(snap.keys))
        if a < b:
            chunk = self._chunk(a, b)
            encoded = memoryview(self._encode(chunk, self._content_type))
            if self._content_type == MSGPACK:
                self._parts.append(encoded[_array_header_len(len(chunk)) :])
            else:
                if self._parts:
                    self._parts.append(b",")
                self._parts.append(encoded[1:-1])
        self._pos = b
        return b >= len(snap.keys)

    def _chunk(self, a: int, b: int) -> list[tuple[Any, ...]]:
        snap = self._snap
        parents, keys, counts = snap.parents, snap.keys, snap.carrier_counts
        c_workers, c_tiers, c_hashes = snap.carrier_workers, snap.carrier_tiers, snap.carrier_hashes
        out: list[tuple[Any, ...]] = []
        cpos = self._carrier_pos
        run = a
        # Positions in [a, b) whose node does not have exactly one carrier.
        odd = compress(range(a, b), map((1).__ne__, counts[a:b]))
        for i in (*odd, b):
            if run < i:  # nodes run..i-1 have one carrier each: carrier j is node run + j
                n = i - run
                ps = parents[run:i]
                out += zip(
                    map(_root_to_none, ps, ps),
                    keys[run:i],
                    zip(
                        zip(
                            c_workers[cpos : cpos + n],
                            c_tiers[cpos : cpos + n],
                            c_hashes[cpos : cpos + n],
                            strict=True,
                        ),
                        strict=True,
                    ),
                    strict=True,
                )
                cpos += n
            if i == b:
                break
            n = counts[i]
            parent = parents[i]
            out.append(
                (
                    None if parent < 0 else parent,
                    keys[i],
                    [(c_workers[j], c_tiers[j], c_hashes[j]) for j in range(cpos, cpos + n)],
                )
            )
            cpos += n
            run = i + 1
        self._carrier_pos = cpos
        return out

    def body_parts(self, head: bytes) -> list[bytes | memoryview]:
        """The whole body as parts to join: the envelope with `nodes` appended as the map's
        last entry (JSON and msgpack maps are unordered: the body decodes as a
        `PeerSnapshot`)."""
        total = len(self._snap.keys)
        if self._content_type == MSGPACK:
            fields = head[0]
            if fields & 0xF0 != 0x80:
                raise ValueError(f"envelope is not a small msgpack map (0x{fields:02x})")
            return [
                bytes([fields + 1]),
                memoryview(head)[1:],
                _MSGPACK_NODES_KEY,
                _array_header(total),
                *self._parts,
            ]
        if not head.endswith(b"}"):
            raise ValueError("envelope is not a JSON object")
        return [memoryview(head)[:-1], b',"nodes":[', *self._parts, b"]}"]


_MSGPACK_NODES_KEY: Final = msgspec.msgpack.encode("nodes")


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def _array_header_len(n: int) -> int:
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


def gzip_bytes(data: bytes | Parts) -> bytes:
    """gzip at the fastest level, fed in slices (each zlib call releases the GIL)."""
    z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # wbits 31: gzip container, mtime 0
    out = []
    for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
        view = memoryview(part).cast("B")
        out += [z.compress(view[i : i + GZIP_FEED]) for i in range(0, len(view), GZIP_FEED)]
    out.append(z.flush())
    return b"".join(out)


def _retrieve_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a failure is reported to the waiters; this silences the loop's log


# -- the HTTP face -----------------------------------------------------------------------


class BadQuery(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class SnapshotQuery:
    cursors_only: bool = False
    max_age_ms: int | None = None


def parse_query(query: Mapping[str, str]) -> SnapshotQuery:
    """`cursors_only` (`true`/`false`, a value is required) and `max_age_ms` (a u64)."""
    cursors_only = False
    if "cursors_only" in query:
        raw = query["cursors_only"].strip().lower()
        if raw not in ("true", "false"):
            raise BadQuery("cursors_only must be true or false")
        cursors_only = raw == "true"
    max_age_ms = None
    if "max_age_ms" in query:
        raw = query["max_age_ms"].strip()
        # The length first: a u64 has at most 20 digits, and int() of thousands of digits
        # raises ValueError (CPython's 4,300-digit limit), which was a 500.
        if not raw.isascii() or not raw.isdigit() or len(raw) > 20 or int(raw) > MAX_AGE_LIMIT_MS:
            raise BadQuery("max_age_ms must be an integer from 0 to 2^64-1")
        max_age_ms = int(raw)
    return SnapshotQuery(cursors_only, max_age_ms)


def accepts(header: str | None, token: str) -> bool:
    """Does a comma-separated header (`Accept`, `Accept-Encoding`) list `token`, q > 0?

    The match is on the whole token, case-insensitive: `x-gzip` is not `gzip`, and neither
    is `*` (our only client names what it wants).
    """
    if not header:
        return False
    token = token.lower()
    for item in header.split(","):
        name, _, params = item.partition(";")
        if name.strip().lower() != token:
            continue
        if _q_value(params) > 0:
            return True
    return False


def negotiate(accept: str | None) -> str:
    """The body's encoding: columns, then msgpack, whichever `Accept` lists first in that
    order of preference (q values only say yes or no); JSON otherwise."""
    for content_type in (COLUMNS, MSGPACK):
        if accepts(accept, content_type):
            return content_type
    return JSON


def _q_value(params: str) -> float:
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "q":
            try:
                return float(value.strip())
            except ValueError:
                return 0.0
    return 1.0


def _error(status: int, message: str) -> web.Response:
    """The OpenAI error shape, as every other route of the control plane answers."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return web.json_response(
        {"error": {"message": message, "type": kind}}, status=status, headers={"Vary": VARY}
    )


async def serve_snapshot(producer: SnapshotProducer, request: web.Request) -> web.StreamResponse:
    """Answer `GET /internal/kv_snapshot` (authorization is the caller's business)."""
    try:
        query = parse_query(request.query)
    except BadQuery as exc:
        return _error(400, str(exc))
    content_type = negotiate(request.headers.get("Accept"))
    if query.cursors_only:
        try:
            table = producer.cursor_table()
            if content_type == COLUMNS:
                body = wire.encode(table, COLUMNS)
            else:
                body = producer.encode(table, content_type)
        except Exception:
            log.exception("kv snapshot: the cursor table could not be encoded")
            return _error(503, ENCODE_FAILED)
        return web.Response(body=body, headers={"Content-Type": content_type, "Vary": VARY})
    gzip = accepts(request.headers.get("Accept-Encoding"), "gzip")
    try:
        entry = await producer.export(query.max_age_ms)
        parts = await producer.body_parts(entry, content_type, gzip)
    except SnapshotUnavailable as exc:
        return _error(503, str(exc))
    headers = {"Content-Type": content_type, "Vary": VARY}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    response = web.StreamResponse(headers=headers)
    response.content_length = sum(memoryview(part).nbytes for part in parts)
    await response.prepare(request)
    for piece in _pieces(parts):
        await response.write(piece)
    await response.write_eof()
    return response


def _pieces(parts: Parts) -> Iterator[memoryview]:
    """The parts as byte views of at most WRITE_CHUNK bytes each."""
    for part in parts:
        view = memoryview(part).cast("B")
        for i in range(0, len(view), WRITE_CHUNK):
            yield view[i : i + WRITE_CHUNK]
