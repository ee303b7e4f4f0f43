"""The pump: the single writer of the block index.

Rules of this file: everything that mutates the tree or the per-rank cursors happens in
`IndexRules`, plain synchronous code driven by messages. `Pump` is the thin asyncio shell
that feeds it: subscribers hand it items (applied at once when the pump is idle, else queued
in a bounded queue, so backpressure reaches the engine's publisher, never a silent drop in the
router), and everything else sends control calls, which always run before the next queued
item.

Theory of operation
-------------------
A rank's *cursor* is the seq of the last batch whose effects are in the tree.

- A batch with `seq <= cursor` is skipped: it is already reflected (a replay overlap, or a
  duplicate after a snapshot seeded the cursor). Unless it is more than `MAX_SEQ_JUMP` behind:
  no stream is, so the cursor was never true (a sibling's graft that claimed 2**64-1), and
  the batch is a new stream, as a forward jump that long is (below).
- A batch with `seq > cursor + 1` is applied, and the `seq - cursor - 1` batches between are
  counted as lost: a lost `BlockRemoved` can leave a false cache hit, so a loss is always
  visible in metrics and logged (per rank at most once a `LOSS_WARN_EVERY_S`, with the batches
  lost since), and it asks for the worker's snapshot to be pulled again.
  Unless more than `MAX_SEQ_JUMP` (2**20) batches would be lost: no publisher does that (see
  `router.subscriber`), so it is a new stream: the rank is cleared first, as for a restart at
  0, the jump is counted in `seq_jumps`, nothing is counted lost, and the worker's snapshot is
  asked for. A rogue seq cannot inflate the lost-batches counter.
- A batch with `seq == 0` behind an existing cursor is an engine restart that sent no
  END_SEQ: the rank's state is cleared and batch 0 applied, since a new incarnation starts
  with an empty cache.
- `PublisherReset` (END_SEQ, or a seq that regressed to a non-zero value) clears the rank and
  its cursor; the next batch, whatever its seq, starts the new stream. One that is a seq jump
  (`jumped`: a new stream whose start the subscriber never saw) also asks for the worker's
  snapshot, and counts no loss.
- `UnrepairedGap` asks for the worker's snapshot; the next batch's cursor jump counts the loss.
  On a rank with no cursor (a restarted publisher's first batches, which the subscriber asked
  replay for in vain) no jump will: the gap's batches are counted lost here.
- Items for ranks that are not live (a worker being removed) are dropped, so a subscriber
  still draining cannot resurrect a removed rank.
- `replace_ranks` installs a worker's own snapshot: it replaces each rank's state and sets its
  cursor, unless the snapshot is older than what the stream already applied; a body with one
  refused rank is refused whole. The pump runs it in steps (`replace_ranks_steps`): the body
  checked in slices, each rank's new state built aside (`BlockTree.stage_rank`) while readers
  keep the old one, then swapped in at once and the old one dropped out of sight.

- A rank is *cold* (`IndexRules.cold`) when its view may miss blocks the engine holds: its
  bootstrap failed (`router.graft`: marked at once, before any batch), the
  first batch applied with no cursor was past seq 0 (the stream was joined mid-way: a replica
  with no sibling to graft from, or a bootstrap that ran cold and replayed its held batches),
  batches were lost, a seq jump began a stream mid-way, the index cap cleared the rank while
  its cursor stayed, or an ingest restart left a doubt. It is whole again from a batch at
  seq 0 (the stream from its origin), a worker's own snapshot, or a graft from a sibling that
  was not cold for it (a cold sibling's graft passes its mark on: `router.graft`). The mark
  goes with the cursor: wherever the cursor is dropped, so is the mark, and the next batch
  decides. The snapshot producer exports the marks (`cold_ranks`), so a joining sibling
  prefers a sibling whose view is whole (`peer.sweep`). A cold view is incomplete, never
  wrong: it still beats no graft at all.

- Index cap (`max_blocks`, `--kv-index-max-blocks`): after a batch, if the index carries
  more (rank, block) pairs than the cap, the rank carrying the most is cleared (repeated
  until under the cap), counted per rank in `cap_clears`, and logged as an error naming the
  flag. That rank keeps its cursor and re-warms from its next stores; its snapshot is not
  re-pulled (it would overflow again). Why this policy: it only forgets, so the index is never
  wrong (no false hit; stores under a forgotten parent are dropped as `unknown_parent`,
  removals of forgotten blocks count as `unknown_removal`); one runaway or rogue rank, the
  likely cause, is the one that loses its blocks, rather than every rank losing new stores;
  and it is cheap, amortized: a clear of n blocks happens at most once per n blocks stored.
  The overshoot is at most one batch (bounded by the ZMQ message size).

Long work is sliced: an item is applied through `IndexRules.steps`, a generator that yields
after every `SLICE_BLOCKS` blocks of work (a long event is cut into runs of that many blocks:
a store as consecutive sub-chains under each other, a removal as consecutive hash runs; a
rank clear as consecutive parts). The pump lets the loop run at each yield, so `/healthz` and
routing stay responsive while millions of blocks arrive. A reader may then see a batch applied
up to a slice boundary, which is a state the engine itself went through (its events are
ordered, and a clear goes leaf first); the cursor moves only when the whole batch is applied,
so it always lags the tree, as the snapshot producer requires. Control calls (`Pump.call`) and
other items never run inside an item, nor inside a control call in steps (`Pump.call_steps`):
a removal that awaits `forget_ranks_steps` knows the tree no longer holds the ranks when it
returns, and a registration of the same worker after it starts with the ranks empty.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from cachetree.accel import speedups
from cachetree.keys import namespace_seed
from cachetree.ranks import RankId
from cachetree.tiers import MEDIUM_TIERS
from cachetree.tree import BlockTree, run_through
from peer.tasks import cancel_and_wait
from router.adapter_names import AdapterNames
from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    RemovedRun,
)
from router.graft import BootstrapRules
from router.log_tally import LogTally
from router.pressure import BYTES_PER_TRACKED_PAIR, DEFAULT_MAX_TRACKED_BLOCKS
from router.subscriber import (
    LOSS_WARN_EVERY_S,
    MAX_SEQ_JUMP,
    LiveBatch,
    PublisherReset,
    SubscriberItem,
    UnrepairedGap,
    beyond_stream,
)
from router.worker_snapshot import (
    SnapshotRank,
    WorkerSnapshot,
    WorkerSnapshotError,
    adapter_names,
    check_steps,
    stage_steps,
)

log = logging.getLogger(__name__)

SnapshotVerdict = Literal["applied", "stale", "rejected", "ignored"]  # `replace_rank`'s

T = TypeVar("T")
DEFAULT_QUEUE_SIZE = 1024
# Blocks the pump's queue holds, over its items (`_blocks_in`: hashes, and tokens by 16):
# 1,024 one-megabyte batches (20,000 blocks each, well within --kv-events-max-message-bytes)
# held 1.5 GB, a replica's whole memory limit in manifests/. A decoded block of 16 tokens
# weighs 2 here and is ~100 bytes compiled (its hash's int and its token ids; ~600 on the
# pure path), so this is ~50 MB, and over a second of backlog at 400k blocks/s.
DEFAULT_QUEUE_BLOCKS: Final = 1 << 20
SLICE_BLOCKS: Final = 1024  # blocks of work between two yields to the loop (~1 ms)
DEFAULT_INDEX_MAX_BLOCKS: Final = 4_000_000  # a 1.4 GiB replica: see `max_blocks_for`
# Memory sizing (README, "Index memory"; measured by bench/scale.py): a replica's resident
# memory is about PROCESS_BYTES plus BYTES_PER_CARRIED_BLOCK per (rank, block) pair: ~157 B of
# index (RSS with the compiled tables, at 1.25 carriers a block with distinct engine hashes),
# ~28 B for the export a sibling may be fetching, and ~18% for a graft's peak (the pure
# layout, without the compiled accelerator, takes ~290 B of index a pair: size it at 375);
# plus the pressure ledger at its bound (`router.pressure.BYTES_PER_TRACKED_PAIR`).
PROCESS_BYTES: Final = 200 << 20
BYTES_PER_CARRIED_BLOCK: Final = 250


def max_blocks_for(memory_limit_bytes: int, ledger_pairs: int = DEFAULT_MAX_TRACKED_BLOCKS) -> int:
    """The `--kv-index-max-blocks` a replica with this memory limit can hold beside a pressure
    ledger bounded at `ledger_pairs` (`--pressure-max-tracked-blocks`)."""
    spare = memory_limit_bytes - PROCESS_BYTES - ledger_pairs * BYTES_PER_TRACKED_PAIR
    return max(0, spare) // BYTES_PER_CARRIED_BLOCK


Steps = Generator[None, None, None]


def medium_label(medium: str | None) -> str:
    """The `medium` label of kvrouter_kv_events_total: an engine's spelling of a tier
    (`cachetree.tiers`; "gpu" as "GPU"), "none" when absent, "other" for any other string.
    The publisher picks the string: a label per string it sent grew the series, and the
    tally, without bound."""
    if medium is None:
        return "none"
    if medium in MEDIUM_TIERS:
        return medium
    upper = medium.upper()
    return upper if upper in MEDIUM_TIERS else "other"


def apply_events(
    tree: BlockTree,
    rank: RankId,
    events: Iterable[KVEvent],
    tally: Counter[tuple[str, str]] | None = None,
) -> None:
    """Apply events in order, counting them into `tally` by (kind, `medium_label`)."""
    run_through(apply_steps(tree, rank, events, tally))


def apply_steps(
    tree: BlockTree,
    rank: RankId,
    events: Iterable[KVEvent],
    tally: Counter[tuple[str, str]] | None = None,
    slice_blocks: int = SLICE_BLOCKS,
    adapters: AdapterNames | None = None,
) -> Steps:
    """`apply_events`, yielding after every `slice_blocks` blocks of work; the LoRA adapter
    names the stores carry are added to `adapters` (see `IndexRules.adapters`).

    Consecutive removals of the same tier become one `tree.remove` call (and one tally
    update): an engine evicting under pressure sends one BlockRemoved per block, dozens per
    batch. A `RemovedRun` (the subscriber's decoder folds them) is one such run already.
    """
    if tally is None:
        tally = Counter()
    if type(events) is not list:
        events = list(events)
    work = 0  # blocks handled since the last yield; yields come before the next event
    i, n = 0, len(events)
    while i < n:
        event = events[i]
        kind = type(event)
        if kind is BlockRemoved or kind is RemovedRun:
            if kind is RemovedRun:
                removing = event.engine_hashes
                end, count = i + 1, len(removing)  # each hash was one event
            else:
                end, removing = _removal_run(events, i, BlockRemoved)
                count = end - i
            if len(removing) > slice_blocks:
                for start in range(0, len(removing), slice_blocks):
                    if start:
                        yield
                    tree.remove(rank, removing[start : start + slice_blocks], event.tier)
            else:
                tree.remove(rank, removing, event.tier)
            tally["removed", medium_label(event.medium)] += count
            work += len(removing)
            i = end
            continue
        i += 1
        if work >= slice_blocks:
            work = 0
            yield
        if kind is BlockStored:
            if event.namespace is not None and adapters is not None:
                _learn_adapter(adapters, event.namespace)
            n_blocks = len(event.engine_hashes)
            if n_blocks > slice_blocks:
                yield from _store_sliced(tree, rank, event, slice_blocks)
            elif event.keys is not None and _seed_holds(tree, rank, event):
                tree.store_keyed(
                    rank, event.parent_engine_hash, event.engine_hashes, event.keys, event.tier
                )
            else:
                tree.store(
                    rank,
                    event.parent_engine_hash,
                    event.engine_hashes,
                    event.token_ids,
                    event.block_size,
                    event.tier,
                    event.namespace,
                )
            tally["stored", medium_label(event.medium)] += 1
            work += n_blocks
        elif kind is AllBlocksCleared:
            yield from tree.clear_rank_steps(rank, slice_blocks)
            tally["cleared", "none"] += 1


def _learn_adapter(adapters: AdapterNames, namespace: str) -> None:
    """The adapter part of a store's namespace (`events.namespace_of`: "lora", "lora\0salt"
    or "\0salt"; a bare adapter name is its own), learned or made the most recent."""
    lora = namespace.partition("\x00")[0]
    if lora:
        adapters.use(lora)


def _seed_holds(tree: BlockTree, rank: RankId, event: BlockStored) -> bool:
    """Were the event's precomputed keys seeded with the parent key the tree has now?"""
    if event.block_size != tree.block_size:
        return False  # let `store` refuse and count it
    parent = event.parent_engine_hash
    if parent is None:
        return event.seed == namespace_seed(event.namespace)
    return event.seed is not None and tree.key_of(rank, parent) == event.seed


def _foreign_block_size(events: Iterable[KVEvent], block_size: int) -> int:
    """The first block size of `events`' stores other than `block_size` (one is there)."""
    return next(
        e.block_size for e in events if type(e) is BlockStored and e.block_size != block_size
    )


class _End:
    """Ends the event stream in `apply_steps`, so the last run of removals is flushed there."""


def _removal_run_py(
    events: list[KVEvent], start: int, removed_type: type[BlockRemoved]
) -> tuple[int, list[int]]:
    """The run of removals from `events[start]` on: where it ends, and all their hashes.

    A run is consecutive `removed_type` events of one tier and medium (`events[start]`'s).
    The compiled twin is `_speedups.removal_run`.
    """
    first = events[start]
    tier, medium = first.tier, first.medium  # type: ignore[union-attr]
    hashes = list(first.engine_hashes)  # type: ignore[union-attr]
    i, n = start + 1, len(events)
    while i < n:
        event = events[i]
        if type(event) is not removed_type or event.tier != tier or event.medium != medium:
            break
        hashes.extend(event.engine_hashes)
        i += 1
    return i, hashes


_removal_run = _removal_run_py if speedups is None else speedups.removal_run


def _store_sliced(tree: BlockTree, rank: RankId, event: BlockStored, slice_blocks: int) -> Steps:
    """A long store as consecutive sub-chains, each under the last block of the one before.

    The first sub-chain carries the event's checks (tier, block size, token count, parent);
    if it places nothing, the rest is not tried, so a refused event is counted once.
    """
    hashes = event.engine_hashes
    if len(event.token_ids) != len(hashes) * event.block_size:
        tree.store(rank, None, hashes, event.token_ids, event.block_size, event.tier)
        return  # refused and counted as malformed by the tree
    tokens_per_slice = slice_blocks * event.block_size
    parent = event.parent_engine_hash
    for i, start in enumerate(range(0, len(hashes), slice_blocks)):
        if start:
            yield
        part = hashes[start : start + slice_blocks]
        tokens = event.token_ids[i * tokens_per_slice : (i + 1) * tokens_per_slice]
        namespace = event.namespace if parent is None else None
        if not tree.store(rank, parent, part, tokens, event.block_size, event.tier, namespace):
            return
        parent = part[-1]


@dataclass(slots=True)
class PumpStats:
    batches_applied: int = 0
    batches_skipped: int = 0  # seq <= cursor: already reflected
    batches_dropped_not_live: int = 0
    lost_batches: Counter[RankId] = field(default_factory=Counter)
    publisher_resets: int = 0
    restarts_at_zero: int = 0
    seq_jumps: int = 0  # forward jumps past MAX_SEQ_JUMP: a new stream, not a loss
    cap_clears: Counter[RankId] = field(default_factory=Counter)  # ranks cleared at the cap
    cap_cleared_blocks: int = 0
    worker_snapshots_applied: int = 0
    worker_snapshots_stale: int = 0
    worker_snapshots_rejected: int = 0
    events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, medium label)
    ignored_events: Counter[str] = field(default_factory=Counter)  # decoder's reasons


class IndexRules:
    """The tree, the cursors and the live set, changed only through these methods."""

    def __init__(
        self,
        tree: BlockTree | None = None,
        *,
        max_blocks: int | None = None,
        slice_blocks: int = SLICE_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("max_blocks must be >= 1 (or None: no cap)")
        # None until the fleet block size is known; no rank is live before then.
        self.tree = tree
        self.max_blocks = max_blocks
        self.slice_blocks = slice_blocks
        self.cursors: dict[RankId, int] = {}
        self.live: set[RankId] = set()
        self.cold: set[RankId] = set()  # ranks whose view may miss blocks (module docstring)
        self.stats = PumpStats()
        # The LoRA adapter names the engines' stores have carried (vLLM's and SGLang's
        # `lora_name`), and the worker snapshots, workers' /v1/models and sibling grafts
        # taught (`learn_adapters`): a request naming one of them is keyed in that adapter's
        # namespace, as its blocks were published (`routing.namespace_for`). Bounded, the
        # least recently learned forgotten first (`router.adapter_names`).
        self.adapters = AdapterNames()
        self._on_loss: Callable[[RankId], bool] = lambda rank: False
        self._on_foreign_block_size: Callable[[RankId, int], None] = lambda rank, size: None
        self._clock = clock
        self._loss_warnings: dict[RankId, LogTally] = {}  # per rank: see `_lost`
        # Set when peer bootstrap is on: it holds Pending ranks' batches and grafts.
        self.bootstrap: BootstrapRules | None = None

    def learn_adapters(self, names: Iterable[str]) -> None:
        """Learn adapter names a worker snapshot, a worker's `/v1/models` or a sibling's
        graft carried, as a live store's (`AdapterNames.learn`)."""
        self.adapters.learn(names)

    def set_loss_handler(self, on_loss: Callable[[RankId], bool]) -> None:
        """Called when a rank provably missed batches, so its owner can re-pull a snapshot;
        it says whether it does (False: the worker serves none)."""
        self._on_loss = on_loss

    def set_block_size_handler(self, on_foreign: Callable[[RankId, int], None]) -> None:
        """Called with a rank and the block size its stores carry when a batch of it held a
        store of another block size than the tree's (the tree drops those): its worker, whose
        /server_info stated none (vLLM), runs another block size than the fleet."""
        self._on_foreign_block_size = on_foreign

    def report_doubt(self, rank: RankId) -> None:
        """A rank may have missed what its seqs cannot show (an ingest process started
        again resumed it: had its engine restarted meanwhile, the new stream's seqs would
        continue the old one's): its owner re-pulls a snapshot, as after a loss, and until
        then the rank is cold."""
        if rank in self.live:
            self.cold.add(rank)
        self._on_loss(rank)

    @property
    def _tree(self) -> BlockTree:
        assert self.tree is not None, "a rank became live before the block size was known"
        return self.tree

    def add_ranks(self, ranks: Iterable[RankId]) -> None:
        self.live.update(ranks)

    def forget_ranks(self, ranks: Iterable[RankId]) -> None:
        run_through(self.forget_ranks_steps(ranks))

    def forget_ranks_steps(self, ranks: Iterable[RankId]) -> Steps:
        """`forget_ranks` in steps, for `Pump.call_steps` (a worker's removal): the ranks
        leave the live set at once, then each its cursor, cold mark and blocks, those in
        slices, as a publisher reset's do (a rank of a million blocks held the loop 1.2 s in
        one step)."""
        ranks = list(ranks)
        if self.bootstrap is not None:
            self.bootstrap.forget(ranks)
        for rank in ranks:
            self.live.discard(rank)
            self._loss_warnings.pop(rank, None)
        for rank in ranks:
            yield from self.clear_rank_state_steps(rank)

    def forget_streams(self, ranks: Iterable[RankId]) -> None:
        """Live ranks whose engine is taken as restarted though their streams cannot show it
        (`WorkerRegistry._forget_restarted`): cleared as for a publisher reset, and the next
        batch decides their cursor and cold mark."""
        for rank in ranks:
            if rank not in self.live:
                continue
            if self.bootstrap is not None:
                self.bootstrap.on_publisher_reset(rank)
            self.clear_rank_state(rank)

    def clear_rank_state(self, rank: RankId) -> None:
        run_through(self.clear_rank_state_steps(rank))

    def clear_rank_state_steps(self, rank: RankId) -> Steps:
        """`clear_rank_state`, the rank's blocks leaving the tree in slices of `slice_blocks`."""
        self.cursors.pop(rank, None)
        self.cold.discard(rank)
        if self.tree is not None:
            yield from self.tree.clear_rank_steps(rank, self.slice_blocks)

    def after_control(self) -> None:
        """After a control call (a graft, a worker snapshot): recount what restores filled."""
        if self.tree is not None:
            self.tree.recount()

    def handle(self, item: SubscriberItem) -> None:
        run_through(self.steps(item))

    def steps(self, item: SubscriberItem) -> Steps:
        """Handle one item, yielding between slices of long work (see the module docstring)."""
        if item.rank not in self.live:
            self.stats.batches_dropped_not_live += 1
            return
        bootstrap = self.bootstrap
        if type(item) is LiveBatch:
            if bootstrap is not None and bootstrap.intercepts(item.rank):
                bootstrap.on_live_batch(item.rank, item.seq, item.batch)
            else:
                yield from self.apply_batch_steps(item.rank, item.seq, item.batch)
        elif type(item) is PublisherReset:
            if bootstrap is not None:
                bootstrap.on_publisher_reset(item.rank)
            if item.jumped:  # counted in the subscriber's seq_jumps
                log.info("%s: a new stream (seq jump); clearing the rank", item.rank)
            else:
                log.info(
                    "%s: publisher reset (END_SEQ or seq regression); clearing the rank", item.rank
                )
                self.stats.publisher_resets += 1
            self.cursors.pop(item.rank, None)
            self.cold.discard(item.rank)
            if self.tree is not None:
                yield from self.tree.clear_rank_steps(item.rank, self.slice_blocks)
            if item.jumped:
                self._on_loss(item.rank)
        elif type(item) is UnrepairedGap:
            rank = item.rank
            held = bootstrap is not None and bootstrap.intercepts(rank)
            if rank not in self.cursors and not held:
                self._lost(rank, item.first, item.last)
            else:
                self._on_loss(rank)

    def _lost(self, rank: RankId, first: int, last: int) -> None:
        """Batches [first, last] of `rank` are lost: counted, its owner asked to repair it, and
        a warning at most once a `LOSS_WARN_EVERY_S` per rank with the batches lost since (a
        publisher that drops every other batch wrote a line a batch, thousands a second)."""
        lost = last - first + 1
        self.stats.lost_batches[rank] += lost
        repulled = self._on_loss(rank)
        tally = self._loss_warnings.get(rank)
        if tally is None:
            tally = self._loss_warnings[rank] = LogTally(LOSS_WARN_EVERY_S)
        if said := tally.count(self._clock(), lost):
            log.warning(
                "%s: %d batch(es) lost since the last such warning (the latest seq %d..%d); "
                "its index may hold stale blocks and miss others until %s",
                rank,
                said,
                first,
                last,
                "the worker's snapshot is re-pulled or they are re-announced"
                if repulled
                else "they are re-announced or evicted (the worker serves no /v1/kv-snapshot)",
            )

    def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        run_through(self.apply_batch_steps(rank, seq, batch))

    def apply_batch_steps(self, rank: RankId, seq: int, batch: EventBatch) -> Steps:
        cursor = self.cursors.get(rank)
        if seq == 0:  # the stream from its origin: the view will be whole
            self.cold.discard(rank)
        elif cursor is None:  # joined mid-stream: what came before is missing
            self.cold.add(rank)
        if cursor is not None:
            if seq == 0:  # batch 0 again: a new incarnation, even right after batch 0
                log.info("%s: stream restarted at seq 0 without END_SEQ; clearing the rank", rank)
                self.stats.restarts_at_zero += 1
                if self.bootstrap is not None:
                    self.bootstrap.on_restart_at_zero(rank)
                yield from self._tree.clear_rank_steps(rank, self.slice_blocks)
            elif seq <= cursor and not beyond_stream(cursor, seq):
                self.stats.batches_skipped += 1
                return
            elif seq <= cursor or seq - cursor - 1 > MAX_SEQ_JUMP:
                # Far behind: no live stream is, so the cursor was never true (a sibling's
                # graft that lied), and skipping would freeze the rank. Far ahead: no
                # publisher skips that many. Either way a new stream, not a loss.
                log.warning(
                    "%s: batch %d is more than %d batches %s the rank's cursor %d: a new "
                    "stream, not a loss; clearing the rank and asking for the worker's snapshot",
                    rank,
                    seq,
                    MAX_SEQ_JUMP,
                    "behind" if seq <= cursor else "past",
                    cursor,
                )
                self.stats.seq_jumps += 1
                self.cold.add(rank)
                if self.bootstrap is not None:
                    self.bootstrap.on_restart_at_zero(rank)
                yield from self._tree.clear_rank_steps(rank, self.slice_blocks)
                self._on_loss(rank)
            elif seq > cursor + 1:
                self.cold.add(rank)
                self._lost(rank, cursor + 1, seq - 1)
        tree = self._tree
        foreign_before = tree.stats.wrong_block_size
        yield from apply_steps(
            tree, rank, batch.events, self.stats.events, self.slice_blocks, self.adapters
        )
        if tree.stats.wrong_block_size != foreign_before:
            self._on_foreign_block_size(rank, _foreign_block_size(batch.events, tree.block_size))
        if batch.ignored:
            self.stats.ignored_events.update(batch.ignored)
        self.cursors[rank] = seq
        self.stats.batches_applied += 1
        if self.max_blocks is not None and tree.carried_blocks > self.max_blocks:
            yield from self._shed(tree, self.max_blocks)

    def _shed(self, tree: BlockTree, cap: int) -> Steps:
        """Clear the largest rank until the index is under the cap (module docstring)."""
        while tree.carried_blocks > cap and (largest := tree.largest_rank()) is not None:
            held = tree.block_count(largest)
            self.stats.cap_clears[largest] += 1
            self.stats.cap_cleared_blocks += held
            log.error(
                "index cap reached: %d blocks carried, --kv-index-max-blocks is %d; cleared "
                "%s, the rank carrying the most (%d blocks; %d clear(s) of it so far). It "
                "re-warms from its next events. If the fleet's caches really hold this much, "
                "raise the cap (README: memory per block) and the memory limit with it",
                tree.carried_blocks,
                cap,
                largest,
                held,
                self.stats.cap_clears[largest],
            )
            self.cold.add(largest)
            yield from tree.clear_rank_steps(largest, self.slice_blocks)

    def replace_rank(self, rank: RankId, snap: SnapshotRank, block_size: int) -> SnapshotVerdict:
        """`replace_ranks` of a body holding `rank` alone."""
        return run_through(self._replace_steps([(rank, snap)], block_size))

    def replace_ranks(self, worker_url: str, snap: WorkerSnapshot) -> SnapshotVerdict:
        """Install a worker's own snapshot, every rank of it, unless the stream is already past
        a rank (`stale`, that rank alone is left as it is) or the body is refused (`rejected`:
        see `router.worker_snapshot`; a rank the worker does not have, or listed twice, or a
        `last_seq` more than `MAX_SEQ_JUMP` past the live stream's, included). A body is
        refused whole when one of its ranks is: nothing of it is installed (one rank's was,
        next to a refused one). `ignored`: its ranks are bootstrapping, and take snapshots
        only through the graft path."""
        return run_through(self.replace_ranks_steps(worker_url, snap))

    def replace_ranks_steps(
        self, worker_url: str, snap: WorkerSnapshot
    ) -> Generator[None, None, SnapshotVerdict]:
        """`replace_ranks` in steps of `slice_blocks` blocks, for `Pump.call_steps`: the body
        checked, each rank's new state built aside (`BlockTree.stage_rank`), then put in place
        of the old one in one step, the old one dropped out of sight after. Routing reads a
        rank's old state until its swap, its new one from then on, never a half-built or
        half-cleared one; a refused body leaves nothing behind. The pump applies no batch
        meanwhile: the ones that arrive queue, and the new cursor filters them after."""
        pairs = [(RankId(worker_url, rank_snap.dp_rank), rank_snap) for rank_snap in snap.ranks]
        return (yield from self._replace_steps(pairs, snap.block_size))

    def _replace_steps(
        self, pairs: list[tuple[RankId, SnapshotRank]], block_size: int
    ) -> Generator[None, None, SnapshotVerdict]:
        refusal = yield from self._snapshot_refusal(pairs, block_size)
        if refusal is not None:
            self.stats.worker_snapshots_rejected += 1
            log.warning("%s: worker snapshot refused, nothing of it installed: %s", *refusal)
            return "rejected"
        tree = self._tree
        verdicts: set[SnapshotVerdict] = set()
        staged: list[tuple[RankId, SnapshotRank, int]] = []
        try:
            for rank, snap in pairs:
                if self.bootstrap is not None and self.bootstrap.intercepts(rank):
                    verdicts.add("ignored")
                    continue
                cursor = self.cursors.get(rank)
                if cursor is not None and snap.last_seq < cursor:
                    self.stats.worker_snapshots_stale += 1
                    verdicts.add("stale")
                    continue
                placed = yield from stage_steps(tree, rank, snap, block_size, self.slice_blocks)
                staged.append((rank, snap, placed))
            for rank, snap, placed in staged:
                # The cursor and the cold mark change in the step that swaps the state in.
                if snap.last_seq >= 0:
                    self.cursors[rank] = snap.last_seq
                self.cold.discard(rank)  # the worker's whole cache
                self.stats.worker_snapshots_applied += 1
                log.info(
                    "%s: worker snapshot applied: %d blocks at seq %d", rank, placed, snap.last_seq
                )
                verdicts.add("applied")
                yield from tree.swap_staged_steps(rank, self.slice_blocks)
        finally:
            # Closed before its end (the pump stopped): no state is left aside for good.
            for rank, _ in pairs:
                run_through(tree.drop_staged_steps(rank, 1 << 62))
        self.learn_adapters(adapter_names(snap for _, snap, _ in staged))
        return next((v for v in ("applied", "stale") if v in verdicts), "ignored")

    def _snapshot_refusal(
        self, pairs: list[tuple[RankId, SnapshotRank]], block_size: int
    ) -> Generator[None, None, tuple[RankId, str] | None]:
        """(the first rank refused, why), or None when every rank of the body may go in."""
        seen: set[RankId] = set()
        for rank, snap in pairs:
            if rank in seen:
                return rank, "the rank is listed twice"
            seen.add(rank)
            if rank not in self.live:
                return rank, "no such live rank (not the worker's, or it left)"
            cursor = self.cursors.get(rank)
            if cursor is not None and beyond_stream(snap.last_seq, cursor):
                return rank, (
                    f"its last_seq {snap.last_seq} is more than {MAX_SEQ_JUMP} past the live "
                    f"stream's {cursor}: every batch of the stream would look already reflected"
                )
            try:
                yield from check_steps(snap, block_size, self._tree.block_size, self.slice_blocks)
            except WorkerSnapshotError as exc:
                return rank, str(exc)
        return None


class Pump:
    """Runs `IndexRules` as the only writer: items in order, control calls first.

    An item delivered while the pump is parked (nothing queued, no control call pending or
    running, no item half-applied) is applied at once by `deliver` (or `offer`, its form that
    never waits, which a subscriber calls from its socket's callback), on the subscriber's turn
    of the loop: still one writer at a time, without a queue round trip and a task switch per
    batch. If it turns out long (its steps yield), the rest is handed to the pump task, which
    finishes it in slices before anything else; items delivered meanwhile queue behind it.
    """

    def __init__(
        self,
        rules: IndexRules,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        queue_blocks: int = DEFAULT_QUEUE_BLOCKS,
    ) -> None:
        self.rules = rules
        self._queue_size = queue_size
        self._queue_blocks = queue_blocks
        # Each an item, or one begun inline, with the blocks it weighs (`_blocks_in`).
        self._items: deque[tuple[SubscriberItem | Steps, int]] = deque()
        self._queued_blocks = 0
        self._room = asyncio.Event()  # set when a waiting deliverer may retry
        self._control: deque[tuple[Callable[[IndexRules], Any], asyncio.Future[Any]]] = deque()
        self._wake = asyncio.Event()
        self._parked = False  # the task waits for work and nobody has woken it since
        self._task: asyncio.Task[None] | None = None

    def offer(self, item: SubscriberItem) -> bool:
        """Take an item without waiting if it can: applied at once while the pump is parked,
        else queued while there is room. False when the queue is full: await `deliver`."""
        if self._parked:
            steps = self.rules.steps(item)
            try:
                if next(steps, _DONE) is _DONE:
                    return True
            except Exception:
                log.exception("pump: an item could not be applied; it was dropped")
                return True
            # Long: the task finishes it before anything else (its blocks queued nowhere).
            self._items.appendleft((steps, 0))
            self._wake_up()
            return True
        blocks = _blocks_in(item)
        if self._items and (
            len(self._items) >= self._queue_size
            or self._queued_blocks + blocks > self._queue_blocks
        ):
            return False  # an empty queue takes any one item, however large
        self._items.append((item, blocks))
        self._queued_blocks += blocks
        self._wake_up()
        return True

    async def deliver(self, item: SubscriberItem) -> None:
        """Apply or queue an item; waits while the queue is full (backpressure)."""
        while not self.offer(item):
            self._room.clear()
            await self._room.wait()

    async def call(self, fn: Callable[[IndexRules], T]) -> T:
        """Run `fn(rules)` in the pump, before any item queued after or before it."""
        if self._task is None or self._task.done():
            return fn(self.rules)  # not running (start-up, shutdown): nothing to race with
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._control.append((fn, future))
        self._wake_up()
        return await future

    async def call_async(self, fn: Callable[[IndexRules], Awaitable[T]]) -> T:
        """Like `call`, for a long operation that yields to the event loop between chunks.

        Readers keep being served while it runs, but no item and no other control call is
        applied until it finishes: it is still the only writer.
        """

        if self._task is None or self._task.done():
            return await fn(self.rules)
        return await self.call(fn)  # type: ignore[return-value] - the pump awaits it

    async def call_steps(self, fn: Callable[[IndexRules], Generator[None, None, T]]) -> T:
        """Like `call_async`, for a job in steps (`IndexRules.replace_ranks_steps`): the loop
        turns at each step; no item and no other control call is applied before its last."""
        return await self.call_async(lambda rules: run_steps(fn(rules)))

    async def hold(self, job: Callable[[], Awaitable[None]]) -> None:
        """Run `job` while nothing is applied to the index; it may await (readers run
        meanwhile). The snapshot producer lists the tree's nodes this way."""
        await self.call_async(lambda rules: job())

    @property
    def backlog(self) -> int:
        return len(self._items)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvrouter-pump")

    async def stop(self) -> None:
        self._parked = False
        await cancel_and_wait([self._task])
        self._task = None

    async def wait_idle(self) -> None:
        """Until every item queued so far has been handled (tests and orderly shutdown)."""
        await self.call(lambda rules: None)
        while self._items:
            await self.call(lambda rules: None)

    def _wake_up(self) -> None:
        self._parked = False
        self._wake.set()

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
                    if not future.done():  # a caller cancelled while its job awaited
                        future.set_result(result)
                except Exception as exc:  # the caller gets it; the pump goes on
                    if not future.done():
                        future.set_exception(exc)
                rules.after_control()
            if not items:
                self._wake.clear()
                self._parked = True
                await self._wake.wait()
                continue
            work, blocks = items.popleft()
            self._queued_blocks -= blocks
            self._room.set()
            steps = work if inspect.isgenerator(work) else rules.steps(work)
            try:
                for _ in steps:
                    await asyncio.sleep(0)  # a slice boundary: let readers and /healthz run
            except Exception:
                log.exception("pump: an item could not be applied; it was dropped")
            handled += 1
            # Yield now and then so readers and control calls interleave with a long backlog.
            if handled % 64 == 0:
                await asyncio.sleep(0)


_DONE: Final = object()


async def run_steps(steps: Generator[None, None, T]) -> T:
    """Run a job in steps with the loop turning at each; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)  # a slice boundary: let readers and /healthz run


def _blocks_in(item: SubscriberItem) -> int:
    """What an item holds in memory, in blocks of 16 tokens: its hashes, and its tokens
    counted apart (a store may state any block size: seven stores of one hash each and
    2**20 tokens, 7.3 MB a batch, weighed 7 blocks, and 49 of them held 1.2 GB)."""
    if type(item) is not LiveBatch:
        return 0
    return sum(
        len(getattr(event, "engine_hashes", ())) + len(getattr(event, "token_ids", ())) // 16
        for event in item.batch.events
    )
