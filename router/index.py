"""The pump: the single writer of the block index.

Rules of this file: everything that mutates the tree or the per-rank cursors happens in
`IndexRules`, plain synchronous code driven by messages. `Pump` is the thin asyncio shell
that feeds it: subscribers hand it items through a bounded queue (so backpressure reaches
the engine's publisher, never a silent drop in the router), and everything else sends control
calls, which always run before the next queued item.

Theory of operation
-------------------
A rank's *cursor* is the seq of the last batch whose effects are in the tree.

- A batch with `seq <= cursor` is skipped: it is already reflected (a replay overlap, or a
  duplicate after a snapshot seeded the cursor).
- A batch with `seq > cursor + 1` is applied, and the `seq - cursor - 1` batches between are
  counted as lost: a lost `BlockRemoved` can leave a false cache hit, so a loss is always
  visible in metrics and logged, and it asks for the worker's snapshot to be pulled again.
- A batch with `seq == 0` behind an existing cursor is an engine restart that sent no
  END_SEQ: the rank's state is cleared and batch 0 applied, since a new incarnation starts
  with an empty cache.
- `PublisherReset` (END_SEQ, or a seq that regressed to a non-zero value) clears the rank and
  its cursor; the next batch, whatever its seq, starts the new stream.
- Items for ranks that are not live (a worker being removed) are dropped, so a subscriber
  still draining cannot resurrect a removed rank.
- `replace_rank` installs a worker's own snapshot: it replaces the rank's state and sets its
  cursor, unless the snapshot is older than what the stream already applied.

Control calls (`Pump.call`) run between items, never inside one, so a reader on the event loop
never observes a half-applied batch, and a removal that awaits `forget_ranks` knows the tree
no longer holds the ranks when it returns.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from peer.tasks import cancel_and_wait
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from router.graft import BootstrapRules
from router.subscriber import LiveBatch, PublisherReset, SubscriberItem, UnrepairedGap
from router.worker_snapshot import SnapshotRank, WorkerSnapshotError, rebuild_rank

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_QUEUE_SIZE = 1024


def apply_events(
    tree: BlockTree, rank: RankId, events: Iterable[KVEvent], tally: Counter[tuple] | None = None
) -> None:
    """Apply events in order, counting them into `tally` by (kind, medium) for metrics.

    Consecutive removals of the same tier become one `tree.remove` call: an engine evicting
    under pressure sends one BlockRemoved per block, dozens per batch.
    """
    if tally is None:
        tally = Counter()
    removing: list[int] = []
    removing_tier: int | None = None
    for event in events:
        kind = type(event)
        if kind is BlockRemoved:
            if removing and event.tier != removing_tier:
                tree.remove(rank, removing, removing_tier)
                removing = []
            removing_tier = event.tier
            removing.extend(event.engine_hashes)
            tally["removed", event.medium] += 1
            continue
        if removing:
            tree.remove(rank, removing, removing_tier)
            removing = []
        if kind is BlockStored:
            tree.store(
                rank,
                event.parent_engine_hash,
                event.engine_hashes,
                event.token_ids,
                event.block_size,
                event.tier,
                event.namespace,
            )
            tally["stored", event.medium] += 1
        elif kind is AllBlocksCleared:
            tree.clear_rank(rank)
            tally["cleared", None] += 1
    if removing:
        tree.remove(rank, removing, removing_tier)


@dataclass(slots=True)
class PumpStats:
    batches_applied: int = 0
    batches_skipped: int = 0  # seq <= cursor: already reflected
    batches_dropped_not_live: int = 0
    lost_batches: Counter[RankId] = field(default_factory=Counter)
    publisher_resets: int = 0
    restarts_at_zero: int = 0
    worker_snapshots_applied: int = 0
    worker_snapshots_stale: int = 0
    worker_snapshots_rejected: int = 0
    events: Counter[tuple] = field(default_factory=Counter)  # (kind, medium)
    ignored_events: Counter[str] = field(default_factory=Counter)  # decoder's reasons


class IndexRules:
    """The tree, the cursors and the live set, changed only through these methods."""

    def __init__(self, tree: BlockTree | None = None) -> None:
        # None until the fleet block size is known; no rank is live before then.
        self.tree = tree
        self.cursors: dict[RankId, int] = {}
        self.live: set[RankId] = set()
        self.stats = PumpStats()
        self._on_loss: Callable[[RankId], None] = lambda rank: None
        # Set when peer bootstrap is on: it holds Pending ranks' batches and grafts.
        self.bootstrap: BootstrapRules | None = None

    def set_loss_handler(self, on_loss: Callable[[RankId], None]) -> None:
        """Called when a rank provably missed batches, so its owner can re-pull a snapshot."""
        self._on_loss = on_loss

    @property
    def _tree(self) -> BlockTree:
        assert self.tree is not None, "a rank became live before the block size was known"
        return self.tree

    def add_ranks(self, ranks: Iterable[RankId]) -> None:
        self.live.update(ranks)

    def forget_ranks(self, ranks: Iterable[RankId]) -> None:
        ranks = list(ranks)
        if self.bootstrap is not None:
            self.bootstrap.forget(ranks)
        for rank in ranks:
            self.live.discard(rank)
            self.clear_rank_state(rank)

    def clear_rank_state(self, rank: RankId) -> None:
        self.cursors.pop(rank, None)
        if self.tree is not None:
            self.tree.clear_rank(rank)

    def handle(self, item: SubscriberItem) -> None:
        if item.rank not in self.live:
            self.stats.batches_dropped_not_live += 1
            return
        bootstrap = self.bootstrap
        if type(item) is LiveBatch:
            if bootstrap is not None and bootstrap.intercepts(item.rank):
                bootstrap.on_live_batch(item.rank, item.seq, item.batch)
            else:
                self.apply_batch(item.rank, item.seq, item.batch)
        elif type(item) is PublisherReset:
            if bootstrap is not None:
                bootstrap.on_publisher_reset(item.rank)
            self.reset_rank(item.rank)
        elif type(item) is UnrepairedGap:
            # The cursor jump on the next batch counts the loss; this only asks for repair.
            self._on_loss(item.rank)

    def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        cursor = self.cursors.get(rank)
        if cursor is not None:
            if seq == 0:  # batch 0 again: a new incarnation, even right after batch 0
                log.info("%s: stream restarted at seq 0 without END_SEQ; clearing the rank", rank)
                self.stats.restarts_at_zero += 1
                if self.bootstrap is not None:
                    self.bootstrap.on_restart_at_zero(rank)
                self._tree.clear_rank(rank)
            elif seq <= cursor:
                self.stats.batches_skipped += 1
                return
            elif seq > cursor + 1:
                lost = seq - cursor - 1
                self.stats.lost_batches[rank] += lost
                log.warning(
                    "%s: %d batch(es) lost (seq %d..%d); its index may hold stale blocks "
                    "until the worker snapshot is re-pulled or they are re-announced",
                    rank,
                    lost,
                    cursor + 1,
                    seq - 1,
                )
                self._on_loss(rank)
        apply_events(self._tree, rank, batch.events, self.stats.events)
        if batch.ignored:
            self.stats.ignored_events.update(batch.ignored)
        self.cursors[rank] = seq
        self.stats.batches_applied += 1

    def reset_rank(self, rank: RankId) -> None:
        log.info("%s: publisher reset (END_SEQ or seq regression); clearing the rank", rank)
        self.stats.publisher_resets += 1
        self.clear_rank_state(rank)

    def replace_rank(self, rank: RankId, snap: SnapshotRank, block_size: int) -> bool:
        """Install a worker's own snapshot of `rank` unless the stream is already past it."""
        if rank not in self.live:
            return False
        if self.bootstrap is not None and self.bootstrap.intercepts(rank):
            return False  # a bootstrapping rank takes snapshots only through the graft path
        cursor = self.cursors.get(rank)
        if cursor is not None and snap.last_seq < cursor:
            self.stats.worker_snapshots_stale += 1
            return False
        try:
            placed = rebuild_rank(self._tree, rank, snap, block_size)
        except WorkerSnapshotError as exc:
            self.stats.worker_snapshots_rejected += 1
            log.warning("%s: worker snapshot refused: %s", rank, exc)
            return False
        if snap.last_seq >= 0:
            self.cursors[rank] = snap.last_seq
        self.stats.worker_snapshots_applied += 1
        log.info("%s: worker snapshot applied: %d blocks at seq %d", rank, placed, snap.last_seq)
        return True


class Pump:
    """Runs `IndexRules` as the only writer: queued items in order, control calls first."""

    def __init__(self, rules: IndexRules, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self.rules = rules
        self._items: asyncio.Queue[SubscriberItem] = asyncio.Queue(queue_size)
        self._control: deque[tuple[Callable[[IndexRules], Any], asyncio.Future[Any]]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def deliver(self, item: SubscriberItem) -> None:
        """Queue an item; waits while the queue is full (backpressure to the subscriber)."""
        await self._items.put(item)
        self._wake.set()

    async def call(self, fn: Callable[[IndexRules], T]) -> T:
        """Run `fn(rules)` in the pump, before any item queued after or before it."""
        if self._task is None or self._task.done():
            return fn(self.rules)  # not running (start-up, shutdown): nothing to race with
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._control.append((fn, future))
        self._wake.set()
        return await future

    async def call_async(self, fn: Callable[[IndexRules], Awaitable[T]]) -> T:
        """Like `call`, for a long operation that yields to the event loop between chunks.

        Readers keep being served while it runs, but no item and no other control call is
        applied until it finishes: it is still the only writer.
        """

        if self._task is None or self._task.done():
            return await fn(self.rules)
        return await self.call(fn)  # type: ignore[return-value] - the pump awaits it

    @property
    def backlog(self) -> int:
        return self._items.qsize()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvrouter-pump")

    async def stop(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None

    async def wait_idle(self) -> None:
        """Until every item queued so far has been handled (tests and orderly shutdown)."""
        await self.call(lambda rules: None)
        while self._items.qsize():
            await self.call(lambda rules: None)

    async def _run(self) -> None:
        rules = self.rules
        items = self._items
        handled = 0
        while True:
            while self._control:
                fn, future = self._control.popleft()
                if future.done():
                    continue
                try:
                    result = fn(rules)
                    if inspect.isawaitable(result):
                        result = await result
                    future.set_result(result)
                except Exception as exc:  # the caller gets it; the pump goes on
                    future.set_exception(exc)
            if items.empty():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                rules.handle(items.get_nowait())
            except Exception:
                log.exception("pump: an item could not be applied; it was dropped")
            handled += 1
            # Yield now and then so readers and control calls interleave with a long backlog.
            if handled % 64 == 0:
                await asyncio.sleep(0)
