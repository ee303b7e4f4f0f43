"""Bootstrap rules of the pump: holding a Pending rank's stream, grafting, proving the splice.

Rules of this file: it is part of the pump's single writer. Every method runs on the pump,
between two items, and changes the tree, cursors, held queues and proofs only through the
`IndexRules` it is attached to. It never awaits and never does I/O; what must leave the pump
(a gap retry for the coordinator) goes through a non-blocking callback.

Theory of operation
-------------------
A booting replica subscribes first and fetches second. While a rank is Pending (per the
`BootstrapTracker`), its live batches are *held*, not applied: a snapshot taken later will
contain their effects, and applying them under it would let the snapshot's cursor filter a
later removal as "already reflected". After the graft the snapshot's cursor for the rank is
both a filter (held batches at or below it are in the snapshot) and a watermark (the stream
must continue at `cursor + 1`).

Pending rank, live batch (`last` = tail of the held queue, else the cursor):
  - nothing held and seq 0          -> from origin: the stream starts with the engine's empty
                                       cache, no snapshot is needed (Recovered, `from_origin`)
  - seq < last: 0                   -> from origin
  - seq < last: other               -> publisher restarted: fail `publisher_reset`, discard held
  - held queue full                 -> fail `overflow`, replay held as live deltas (cold)
  - otherwise                       -> hold it (token ids packed, a ninth of the list's memory)

Graft (`apply_snapshot`): only obligations still owed (same epoch, live, Pending) count; the
snapshot is filtered to their ranks and restored (failure: `tree_rejected` for all of them).
Per owed rank, with W its cursor (the watermark): no cursor -> `uncovered`; then the splice.
Only a batch at seq W + 1 proves it, held or live:
  - a held batch is W + 1                  -> proven: `warm`
  - held seqs pass W + 1 without it        -> gap resolution (the stream skipped the splice)
  - nothing held, or held ends at or
    below W                                -> a pending proof: the held batches stay held
  - nothing held and W is -1 (a worker's
    own empty snapshot: it never published) -> `warm` at once, no cursor (`_splice`)
Then the cursor is seeded with max(existing, W), the rank is Recovered, and once the stream
has reached W the held batches replay through the cursor filter (those at or below W are
reflected in the snapshot). A pending proof is judged by the next live batches:
  - seq 0                                  -> the engine restarted: `from_origin`
  - seq W + 1                              -> `warm`
  - seq past W + 1                         -> gap resolution
  - seq at or below W                      -> held, proving nothing: a sibling may have
                                              received a batch a few ms before this replica.
                                              Tolerated while it is within `BEHIND_MAX`
                                              batches of W and `BEHIND_WINDOW_S` of the
                                              graft, else gap resolution (also checked at
                                              the probe's tick, for a rank gone idle)
or, when the rank is idle, by the splice probe (`peer.probe`). A probe witness whose cursor
is below W (a sibling whose stream reset under the graft) is not acted on: the batches of the
new stream reach this replica too and settle it within `BEHIND_WINDOW_S`, and a lagging
sibling gives the same answer.

Deviation from the reference (ARCHITECTURE.md and the README win): the reference counts
`warm` on any batch that leaves no gap, including one at or below W, and grafts any held queue
whose head is not past W + 1. Such a batch proves nothing: after an engine restart whose
batch 0 was lost (its seqs start over under the old cursor), or under a sibling's cursor
shifted ahead of the stream, the rank was counted `warm`, kept the old blocks as ghosts and
filtered every new batch as "already reflected" until the seqs passed the cursor, possibly
hours. The project promises "never wrong", so the proof waits for W + 1, within bounds.
The rank takes the source's cold mark (`router.index`): a sibling that was cold for it hands
on a partial view, which this replica's own export must not present as whole. A graft that
covered a rank teaches the index the source's LoRA adapter names (`Grafted.adapters`), so the
grafted adapter blocks are found by the requests naming them before any new store names them.

Gap resolution: the rank is Failed; if the tracker grants its one retry and the coordinator
takes it, the rank's tree state is cleared and its held queue *kept unapplied* (the retry's
graft will need the filter again); otherwise `gap`, clear, replay held (cold). Each gap is
counted against the source whose snapshot did not join (`gaps`, by sibling), and the retry
carries a `peer.sweep.Gapped` note: that source, and the least cursor that joins the held
queue, so the retry's sweep asks that sibling last and refuses a body as old as the one that
gapped (a sibling whose stream stalled would otherwise be taken again).

Every failure runs the rank cold (live deltas only), never wrong. Each outcome is counted
once per rank per incarnation by the tracker.

Deviation from the reference: held batches keep their token ids (packed as u32 arrays)
instead of dropping them, because our block keys are computed from token ids; an engine
hash alone cannot place a block in our index.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Final, Protocol

import msgspec

from cachetree.ranks import RankId
from cachetree.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotExport,
    SnapshotRestore,
    export,
    restore,
)
from cachetree.tree import BlockTree, run_through
from peer.probe import MAX_UNKNOWN_PROBES
from peer.sweep import Gapped
from peer.tracker import BootstrapState, BootstrapTracker, Obligation
from router.events import BlockStored, EventBatch
from router.worker_snapshot import (
    NOTHING_PUBLISHED,
    WorkerSnapshot,
    adapter_names,
    rebuild_steps,
)

log = logging.getLogger(__name__)

HELD_QUEUE_CAP = 1024
# How far a sibling's cursor may be ahead of this replica's stream, in batches and in time
# after the graft. A sibling exports what it applied; this replica subscribed to the same
# publisher first, so the batches up to the sibling's cursor it lacks at the graft are only
# those still in flight to it: ZMQ delivery and its own pump queue, milliseconds, and at a
# busy engine's ~1,000 batches a second a few dozen batches. More (a cursor 1,000 ahead) or
# later (a restarted publisher's new stream, seq 1, 2, ... under an old cursor of 40) is a
# stream that does not join the snapshot. Erring short only runs a rank cold, never wrong.
BEHIND_MAX: Final = 64
BEHIND_WINDOW_S: Final = 5.0  # also the probe's tick, which checks idle ranks (`expire_behind`)


class IndexSurface(Protocol):
    """What the bootstrap rules may touch of the index (`router.index.IndexRules`).

    Declared here rather than imported, so the index depends on these rules and not the
    other way round: the index attaches its `BootstrapRules`, which see it only through this.
    """

    cursors: dict[RankId, int]
    live: set[RankId]
    cold: set[RankId]

    @property
    def _tree(self) -> BlockTree: ...

    def learn_adapters(self, names: Iterable[str]) -> None: ...

    def apply_batch(self, rank: RankId, seq: int, batch: EventBatch) -> None: ...

    def clear_rank_state(self, rank: RankId) -> None: ...

    def forget_streams(self, ranks: Iterable[RankId]) -> None: ...


class Grafted(Protocol):
    """A vetted snapshot, as the pump needs it (`peer.vet.VettedSnapshot`)."""

    snapshot: Snapshot
    cursors: dict[RankId, int]

    @property
    def cold_ranks(self) -> frozenset[RankId]:
        """Ranks the source's own view of was partial (`router.index`: cold)."""
        ...

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapter names the source had learned (`IndexRules.adapters`)."""
        ...

    def retain_workers(self, keep: Iterable[RankId]) -> Grafted: ...


@dataclass(slots=True)
class LocalGraft:
    """A graft source built in this process: a worker's own `/v1/kv-snapshot`.

    It is trusted like a vetted snapshot because its ranks were minted from our own worker
    registry and its blocks were placed by our own tree code. A rank the engine says it never
    published and holds nothing of has the cursor `NOTHING_PUBLISHED`: it covers the rank, as
    empty.
    """

    tree: BlockTree
    cursors: dict[RankId, int]
    adapters: frozenset[str] = frozenset()  # its chain roots' (`adapter_names`)
    # The tree's export, taken once (in slices by `build_steps`): nothing writes the tree
    # after its build, and each export of 140k blocks held the loop 30-40 ms.
    exported: Snapshot | None = None

    @property
    def snapshot(self) -> Snapshot:
        if self.exported is None:
            self.exported = export(self.tree)
        return self.exported

    def covered_ranks(self) -> frozenset[RankId]:
        return frozenset(self.cursors)

    @property
    def cold_ranks(self) -> frozenset[RankId]:
        return frozenset()  # the worker's whole cache

    def retain_workers(self, keep: Iterable[RankId]) -> LocalGraft:
        keep = set(keep)
        copy = BlockTree(self.tree.block_size)
        restore(copy, self.snapshot)
        for rank in copy.ranks():
            if rank not in keep:
                copy.clear_rank(rank)
        cursors = {r: c for r, c in self.cursors.items() if r in keep}
        return LocalGraft(copy, cursors, self.adapters)

    @classmethod
    def from_worker_snapshot(
        cls, worker_url: str, snap: WorkerSnapshot, block_size: int
    ) -> LocalGraft:
        """Raises WorkerSnapshotError when the body does not fit together."""
        return run_through(cls.build_steps(worker_url, snap, block_size, 1 << 62))

    @classmethod
    def build_steps(
        cls, worker_url: str, snap: WorkerSnapshot, block_size: int, slice_blocks: int
    ) -> Generator[None, None, LocalGraft]:
        """`from_worker_snapshot` in steps of `slice_blocks` blocks (a tree of its own: no
        reader sees it before the graft)."""
        tree = BlockTree(block_size)
        cursors = {}
        for rank_snap in snap.ranks:
            rank = RankId(worker_url, rank_snap.dp_rank)
            yield from rebuild_steps(tree, rank, rank_snap, snap.block_size, slice_blocks)
            if rank_snap.last_seq >= 0:
                cursors[rank] = rank_snap.last_seq
            elif not rank_snap.blocks:
                # The engine itself says it never published and holds nothing: complete
                # knowledge of an empty rank, which no sibling can better (one may still hold
                # a restarted engine's old blocks). Blocks without a seq cannot be spliced.
                cursors[rank] = NOTHING_PUBLISHED
        exporting = SnapshotExport(tree)
        while not exporting.list_step(slice_blocks):
            yield
        while not exporting.step(slice_blocks):
            yield
        return cls(tree, cursors, frozenset(adapter_names(snap.ranks)), exporting.result())


@dataclass(slots=True)
class GraftJob:
    owed: list[Obligation]
    vetted: Grafted
    restore: SnapshotRestore
    source: str  # the sibling (or worker) the snapshot came from


@dataclass(slots=True)
class PendingProof:
    watermark: int
    epoch: int
    since: float
    source: str
    grafted_at: float  # `since` restarts at every probe; the window for batches behind does not
    unknown_probes: int = 0


@dataclass(frozen=True, slots=True)
class HeldBatch:
    seq: int
    batch: EventBatch


class Splice(Enum):
    """What a graft's held queue says of its watermark (`_splice`)."""

    PROVEN = "proven"  # a held batch is watermark + 1
    PENDING = "pending"  # held, if anything, ends at or below the watermark
    GAP = "gap"  # the stream skipped watermark + 1


def _splice(held: list[HeldBatch], watermark: int) -> Splice:
    """Only `watermark + 1` proves a splice: a batch at or below it is already reflected and
    shows nothing about the next one. Held seqs rise (a regression ended the holding).

    A worker's own empty snapshot from before its first batch (`NOTHING_PUBLISHED`) with
    nothing held needs no proof: its stream must start at seq 0, which the index judges at
    the rank's first batch as for any rank without a cursor (past 0 it is cold). A probe
    could only mislead it: a sibling still holding a restarted engine's old cursor reads as
    a stream that moved on. Held batches are never seq 0 (that settles `from_origin`)."""
    if not held:
        return Splice.PROVEN if watermark == NOTHING_PUBLISHED else Splice.PENDING
    if held[-1].seq <= watermark:
        return Splice.PENDING
    if held[0].seq <= watermark + 1 and any(h.seq == watermark + 1 for h in held):
        return Splice.PROVEN
    return Splice.GAP


class BootstrapRules:
    def __init__(
        self,
        index: IndexSurface,
        tracker: BootstrapTracker,
        enqueue_retry: Callable[[Obligation, Gapped], bool],
        clock: Callable[[], float],
        held_cap: int = HELD_QUEUE_CAP,
    ) -> None:
        self.index = index
        self.tracker = tracker
        self._enqueue_retry = enqueue_retry
        self._clock = clock
        self._held_cap = held_cap
        self.held: dict[RankId, list[HeldBatch]] = {}
        self.proofs: dict[RankId, PendingProof] = {}
        self.gaps: Counter[str] = Counter()  # grafts whose stream did not join, by source
        # Ranks retried after a gap, by the retry's epoch: a retry that finds every sibling
        # behind its stream ends as the gap it is (`abandon`), not as a fleet with nothing.
        self.retried: dict[RankId, tuple[int, Gapped]] = {}

    # -- live path -------------------------------------------------------------------------

    def intercepts(self, rank: RankId) -> bool:
        return rank in self.proofs or self.tracker.is_pending(rank)

    def on_live_batch(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        proof = self.proofs.get(rank)
        if proof is not None:
            self._judge_splice(rank, seq, batch, proof)
            return
        if not self.tracker.is_pending(rank):
            self.index.apply_batch(rank, seq, batch)
            return
        held = self.held.get(rank)
        last = held[-1].seq if held else self.index.cursors.get(rank)
        if not held and seq == 0:
            self._from_origin(rank, seq, batch)
        elif last is not None and seq < last:
            if seq == 0:
                self._from_origin(rank, seq, batch)
            else:
                self.fail(rank, "publisher_reset", discard_held=True)
                self.index.apply_batch(rank, seq, batch)
        elif held is not None and len(held) >= self._held_cap:
            log.warning("%s: held queue full (%d); running the rank cold", rank, len(held))
            self.fail(rank, "overflow", discard_held=False)
            self.index.apply_batch(rank, seq, batch)
        else:
            self.held.setdefault(rank, []).append(HeldBatch(seq, _packed(batch)))

    def on_publisher_reset(self, rank: RankId) -> None:
        """Before the index clears the rank: settle any bootstrap state it had.

        A Recovered rank turns Failed even when its splice was proven long ago: what it
        inherited is being cleared, so the state gauge must stop saying "recovered".
        """
        if self.proofs.pop(rank, None) is not None:
            self.held.pop(rank, None)  # batches of the old stream, at or below its watermark
            self.tracker.record_outcome(rank, "publisher_reset")
        if self.tracker.is_pending(rank):
            self.fail(rank, "publisher_reset", discard_held=True)
        elif self.tracker.state(rank) is BootstrapState.RECOVERED:
            self.tracker.set(rank, BootstrapState.FAILED)

    def on_restart_at_zero(self, rank: RankId) -> None:
        if self.proofs.pop(rank, None) is not None:
            self.held.pop(rank, None)
            self.tracker.record_outcome(rank, "from_origin")

    # -- control messages ------------------------------------------------------------------

    def apply_snapshot(
        self, obligations: Iterable[Obligation], vetted: Grafted, source: str = "a sibling"
    ) -> list[RankId]:
        """Graft `vetted` in one go (small snapshots, tests); returns the ranks it covered."""
        job = self.begin_graft(obligations, vetted, source)
        if job is None:
            return []
        try:
            while not job.restore.step(1 << 30):
                pass
        except SnapshotError as exc:
            self.fail_graft(job.owed, exc)
            return []
        return self.finish_graft(job)

    def begin_graft(
        self, obligations: Iterable[Obligation], vetted: Grafted, source: str
    ) -> GraftJob | None:
        """The owed part of `vetted`, ready to restore in chunks; None when nothing is owed.

        Between `begin_graft` and `finish_graft` (or `fail_graft`) nothing else may write the
        tree: the pump runs the chunks as one control call.
        """
        index = self.index
        # still_owed also drops a (rank, epoch) named twice: grafting it twice would open a
        # stale deferred proof on a rank already proven.
        owed = [o for o in self.tracker.still_owed(obligations) if o.rank in index.live]
        if not owed:
            return None
        owed_ranks = {o.rank for o in owed}
        # A caller may have filtered the snapshot already (in slices, off the pump).
        snapshot = vetted.snapshot
        filtered = set(snapshot.workers) <= owed_ranks and set(vetted.cursors) <= owed_ranks
        mine = vetted if filtered else vetted.retain_workers(owed_ranks)
        try:
            # Every graft source is vetted (`peer.vet`) or built by our own tree code.
            restore_job = SnapshotRestore(
                index._tree, snapshot if filtered else mine.snapshot, prevalidated=True
            )
        except SnapshotError as exc:
            self.fail_graft(owed, exc)
            return None
        return GraftJob(owed, mine, restore_job, source)

    def fail_graft(self, owed: list[Obligation], exc: Exception) -> None:
        log.warning("graft refused by the tree (%s); %d rank(s) run cold", exc, len(owed))
        for o in owed:
            self.fail(o.rank, "tree_rejected", discard_held=False)

    def finish_graft(self, job: GraftJob) -> list[RankId]:
        index = self.index
        covered = []
        for o in job.owed:
            rank = o.rank
            self.retried.pop(rank, None)  # the retry grafted: it settles as this graft does
            watermark = job.vetted.cursors.get(rank)
            if watermark is None:
                self.fail(rank, "uncovered", discard_held=False)
                continue
            held = self.held.get(rank, [])
            splice = _splice(held, watermark)
            if (
                splice is Splice.PENDING
                and held
                and self._too_far_behind(rank, held[-1].seq, watermark, 0.0)
            ):
                splice = Splice.GAP
            if splice is Splice.GAP:
                self._resolve_gap(rank, job.source, watermark)
                continue
            if splice is Splice.PENDING:
                now = self._clock()
                self.proofs[rank] = PendingProof(watermark, o.epoch, now, job.source, now)
            if watermark != NOTHING_PUBLISHED:  # else no cursor: see `_splice`
                index.cursors[rank] = max(index.cursors.get(rank, -1), watermark)
            if rank in job.vetted.cold_ranks:  # a partial view grafted stays partial
                index.cold.add(rank)
            else:
                index.cold.discard(rank)
            self.tracker.set(rank, BootstrapState.RECOVERED)
            if held and held[-1].seq >= watermark:
                # The stream reached the watermark: what it held up to there is reflected
                # (the cursor filters it), what comes after is applied on top.
                self._replay_held(rank)
            if splice is Splice.PROVEN:
                self.tracker.record_outcome(rank, "warm")
            covered.append(rank)
        if covered:
            index.learn_adapters(job.vetted.adapters)
        return covered

    def abandon(self, obligations: Iterable[Obligation]) -> None:
        for o in obligations:
            if o.rank in self.index.live and self.tracker.is_owed(o.rank, o.epoch):
                retried = self.retried.pop(o.rank, None)
                if retried is None or retried[0] != o.epoch:
                    self.fail(o.rank, "abandoned", discard_held=False)
                    continue
                source = retried[1].peer
                log.warning(
                    "%s: the retry after %s's gap found no sibling whose snapshot joins the "
                    "stream (every one behind it, cold or empty for it); running the rank cold "
                    "(if %s keeps lagging, check its event stream)",
                    o.rank,
                    source,
                    source,
                )
                self.fail(o.rank, "gap", discard_held=False)

    def probe_verdict(self, rank: RankId, epoch: int, watermark: int, verdict: str) -> None:
        """A splice probe's judgment: `advanced`, `no_advance` or `unknown`."""
        proof = self.proofs.get(rank)
        if proof is None or proof.watermark != watermark or proof.epoch != epoch:
            return  # stale: the proof was settled, regrafted or restarted meanwhile
        if verdict == "advanced":
            del self.proofs[rank]
            if rank in self.index.live and not self.tracker.is_pending(rank):
                self._resolve_gap(rank, proof.source, proof.watermark)
        elif verdict == "no_advance":
            self._settle_proof(rank, "warm")
        else:
            proof.unknown_probes += 1
            if proof.unknown_probes >= MAX_UNKNOWN_PROBES:
                self._settle_proof(rank, "warm_unwitnessed")

    def expire_behind(self) -> None:
        """Resolve as gaps the proofs still holding batches below their watermark
        `BEHIND_WINDOW_S` after the graft: no batch is in flight that long, so the stream
        never reached the watermark (an idle rank after a publisher restart, a cursor that ran
        ahead of the stream); waiting for the next batch could take hours."""
        now = self._clock()
        for rank, proof in list(self.proofs.items()):
            held = self.held.get(rank)
            if held and self._too_far_behind(
                rank, held[-1].seq, proof.watermark, now - proof.grafted_at
            ):
                del self.proofs[rank]
                if rank in self.index.live and not self.tracker.is_pending(rank):
                    self._resolve_gap(rank, proof.source, proof.watermark)

    def due_proofs(self, timeout_s: float) -> list[tuple[RankId, int, int]]:
        """Proofs at least `timeout_s` old, as (rank, watermark, epoch); restarts their clock."""
        now = self._clock()
        due = []
        for rank, proof in self.proofs.items():
            if now - proof.since >= timeout_s and self.tracker.epoch(rank) == proof.epoch:
                proof.since = now
                due.append((rank, proof.watermark, proof.epoch))
        return due

    def forget(self, ranks: Iterable[RankId]) -> None:
        for rank in ranks:
            self.held.pop(rank, None)
            self.proofs.pop(rank, None)

    # -- resolutions -----------------------------------------------------------------------

    def _judge_splice(self, rank: RankId, seq: int, batch: EventBatch, proof: PendingProof) -> None:
        """A live batch for a grafted rank whose splice is not proven yet (see the top)."""
        watermark = proof.watermark
        if seq == 0:
            # The engine restarted: nothing is left to prove, the stream starts over.
            del self.proofs[rank]
            self.held.pop(rank, None)
            self.tracker.record_outcome(rank, "from_origin")
            self.index.apply_batch(rank, seq, batch)
            return
        if seq == watermark + 1:
            self._settle_proof(rank, "warm")
            self.index.apply_batch(rank, seq, batch)
            return
        held = self.held.get(rank)
        if held and seq < held[-1].seq:
            # A regression under what it held: the publisher restarted (the subscriber says so
            # with a PublisherReset first; a stream handed over raw does not).
            self.index.forget_streams((rank,))  # these rules' `on_publisher_reset`, then cleared
            self.index.apply_batch(rank, seq, batch)
            return
        self.held.setdefault(rank, []).append(HeldBatch(seq, _packed(batch)))
        if seq > watermark + 1 or self._too_far_behind(
            rank, seq, watermark, self._clock() - proof.grafted_at
        ):
            del self.proofs[rank]
            self._resolve_gap(rank, proof.source, watermark)
        elif seq == watermark:
            self._replay_held(rank)  # reached the watermark: all reflected, all filtered

    def _too_far_behind(self, rank: RankId, seq: int, watermark: int, after_s: float) -> bool:
        """Whether the stream at `seq`, `after_s` after the graft, can no longer reach the
        watermark as batches in flight would (`BEHIND_MAX`, `BEHIND_WINDOW_S`)."""
        if watermark - seq <= BEHIND_MAX and after_s <= BEHIND_WINDOW_S:
            return False
        log.warning(
            "%s: the live stream is at seq %d, %.1f s after the graft, and the snapshot's "
            "cursor is %d: more than %d batches ahead, or still ahead after %g s, so it is not "
            "a batch in flight (a publisher restart whose first batch was lost, or a cursor "
            "ahead of the stream); the graft is resolved as a gap",
            rank,
            seq,
            after_s,
            watermark,
            BEHIND_MAX,
            BEHIND_WINDOW_S,
        )
        return True

    def _settle_proof(self, rank: RankId, outcome: str) -> None:
        """End a pending proof with a keeping verdict; what it held is at or below the
        watermark, reflected in the graft (the cursor filters it)."""
        del self.proofs[rank]
        self._replay_held(rank)
        self.tracker.record_outcome(rank, outcome)

    def fail(self, rank: RankId, outcome: str, *, discard_held: bool) -> None:
        """Fail a Pending rank cold: clear it, then replay what was held unless discarded."""
        self.retried.pop(rank, None)
        if not self.tracker.is_pending(rank):
            self.held.pop(rank, None)
            return
        self.tracker.set(rank, BootstrapState.FAILED)
        self.tracker.record_outcome(rank, outcome)
        self.index.clear_rank_state(rank)
        # Cold at once: its view misses what the engine held before this replica subscribed,
        # whether or not a batch comes to say so (an idle rank showed as merely empty). Its
        # next batch decides as ever (`router.index`).
        self.index.cold.add(rank)
        if discard_held:
            self.held.pop(rank, None)
        else:
            self._replay_held(rank)

    def _from_origin(self, rank: RankId, seq: int, batch: EventBatch) -> None:
        self.held.pop(rank, None)
        self.index.clear_rank_state(rank)
        self.tracker.set(rank, BootstrapState.RECOVERED)
        self.tracker.record_outcome(rank, "from_origin")
        self.index.apply_batch(rank, seq, batch)

    def _resolve_gap(self, rank: RankId, source: str, watermark: int) -> None:
        """Precondition: every live batch the rank received since the graft is held.

        `source` and `watermark` name the graft that did not join: where it came from and
        its cursor for the rank.
        """
        self.tracker.set(rank, BootstrapState.FAILED)
        self.gaps[source] += 1
        held = self.held.get(rank)
        # The held queue is kept for a retry, so a cursor below its head's predecessor gaps
        # again; with nothing held (a probe saw the stream move on) the cursor must advance.
        note = Gapped(source, held[0].seq - 1 if held else watermark + 1)
        what = (
            f"{rank}: the stream does not join the snapshot from {source} (its cursor "
            f"{watermark}; a cursor of {note.min_cursor} or later is needed)"
        )
        retry = self.tracker.retry_after_gap(rank)
        self.index.clear_rank_state(rank)
        if retry is not None:
            if self._enqueue_retry(retry, note):
                self.retried[rank] = (retry.epoch, note)
                log.info("%s; retrying once, asking that sibling last", what)
                return  # Pending again; the held queue waits for the retry's graft
            self.tracker.set(rank, BootstrapState.FAILED)  # the retry could not be queued
        log.warning(
            "%s; running the rank cold (if %s keeps lagging, check its event stream)",
            what,
            source,
        )
        self.tracker.record_outcome(rank, "gap")
        self.index.cold.add(rank)  # as `fail` does
        self._replay_held(rank)

    def _replay_held(self, rank: RankId) -> None:
        for held in self.held.pop(rank, []):
            self.index.apply_batch(rank, held.seq, held.batch)


def _packed(batch: EventBatch) -> EventBatch:
    """The batch with token ids as u32 arrays: 4 bytes a token instead of ~36."""
    events = [
        msgspec.structs.replace(e, token_ids=array("I", e.token_ids))
        if type(e) is BlockStored
        else e
        for e in batch.events
    ]
    return EventBatch(batch.ts, events, batch.dp_rank, batch.ignored)
