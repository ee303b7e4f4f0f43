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
Per owed rank: no cursor -> `uncovered`; first held seq past `cursor + 1`, or the last one more
than `MAX_SEQ_JUMP` behind the cursor (no true cursor is that far ahead of the stream) -> gap
resolution; nothing held -> a deferred proof, judged by the first live batch (the same two
tests) or the splice probe. Then
the cursor is seeded with max(existing, watermark), the rank is Recovered, and the held batches
replay through the cursor filter; `warm` is counted only if a held batch proved the splice.
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
from typing import Protocol

import msgspec

from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, SnapshotError, SnapshotRestore, export, restore
from cachetree.tree import BlockTree, run_through
from peer.sweep import Gapped
from peer.tracker import BootstrapState, BootstrapTracker, Obligation
from router.events import BlockStored, EventBatch
from router.subscriber import MAX_SEQ_JUMP, beyond_stream
from router.worker_snapshot import WorkerSnapshot, adapter_names, check_steps, stage_steps

log = logging.getLogger(__name__)

HELD_QUEUE_CAP = 1024
MAX_UNKNOWN_PROBES = 3


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


def _far_behind(rank: RankId, seq: int, watermark: int) -> bool:
    """Whether the live stream at `seq` is more than `MAX_SEQ_JUMP` behind a snapshot's
    cursor: no sibling's cursor can be that far ahead of a stream this replica receives too
    (it subscribed first). Grafted, such a cursor marked every batch of the stream as already
    reflected and froze the rank on what the snapshot said (a sibling sending 2**63 did).
    Resolved as a gap: the stream does not join the watermark."""
    if not beyond_stream(watermark, seq):
        return False
    log.warning(
        "%s: the snapshot's cursor %d is more than %d batches past the live stream (seq %d): "
        "it cannot be true; the graft is resolved as a gap (a retry elsewhere, else cold)",
        rank,
        watermark,
        MAX_SEQ_JUMP,
        seq,
    )
    return True


@dataclass(slots=True)
class LocalGraft:
    """A graft source built in this process: a worker's own `/v1/kv-snapshot`.

    It is trusted like a vetted snapshot because its ranks were minted from our own worker
    registry and its blocks were placed by our own tree code.
    """

    tree: BlockTree
    cursors: dict[RankId, int]
    adapters: frozenset[str] = frozenset()  # its chain roots' (`adapter_names`)

    @property
    def snapshot(self) -> Snapshot:
        return export(self.tree)

    def covered_ranks(self) -> frozenset[RankId]:
        return frozenset(self.cursors)

    @property
    def cold_ranks(self) -> frozenset[RankId]:
        return frozenset()  # the worker's whole cache

    def retain_workers(self, keep: Iterable[RankId]) -> LocalGraft:
        keep = set(keep)
        copy = BlockTree(self.tree.block_size)
        restore(copy, export(self.tree))
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
            yield from check_steps(rank_snap, snap.block_size, block_size, slice_blocks)
            yield from stage_steps(tree, rank, rank_snap, snap.block_size, slice_blocks)
            yield from tree.swap_staged_steps(rank, slice_blocks)
            if rank_snap.last_seq >= 0:
                cursors[rank] = rank_snap.last_seq
        return cls(tree, cursors, frozenset(adapter_names(snap.ranks)))


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
    unknown_probes: int = 0


@dataclass(frozen=True, slots=True)
class HeldBatch:
    seq: int
    batch: EventBatch


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
            if seq == 0:
                # The engine restarted: nothing is left to prove, the stream starts over.
                del self.proofs[rank]
                self.tracker.record_outcome(rank, "from_origin")
                self.index.apply_batch(rank, seq, batch)
                return
            if seq > proof.watermark + 1 or _far_behind(rank, seq, proof.watermark):
                self.held.setdefault(rank, []).append(HeldBatch(seq, _packed(batch)))
                del self.proofs[rank]
                self._resolve_gap(rank, proof.source, proof.watermark)
                return
            del self.proofs[rank]
            self.tracker.record_outcome(rank, "warm")
            self.index.apply_batch(rank, seq, batch)
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
            self.tracker.record_outcome(rank, "publisher_reset")
        if self.tracker.is_pending(rank):
            self.fail(rank, "publisher_reset", discard_held=True)
        elif self.tracker.state(rank) is BootstrapState.RECOVERED:
            self.tracker.set(rank, BootstrapState.FAILED)

    def on_restart_at_zero(self, rank: RankId) -> None:
        if self.proofs.pop(rank, None) is not None:
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
        filtered = set(vetted.snapshot.workers) <= owed_ranks and set(vetted.cursors) <= owed_ranks
        mine = vetted if filtered else vetted.retain_workers(owed_ranks)
        try:
            # Every graft source is vetted (`peer.vet`) or built by our own tree code.
            restore_job = SnapshotRestore(index._tree, mine.snapshot, prevalidated=True)
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
            held = self.held.get(rank)
            if held and (held[0].seq > watermark + 1 or _far_behind(rank, held[-1].seq, watermark)):
                self._resolve_gap(rank, job.source, watermark)
                continue
            if not held:
                self.proofs[rank] = PendingProof(watermark, o.epoch, self._clock(), job.source)
            index.cursors[rank] = max(index.cursors.get(rank, -1), watermark)
            if rank in job.vetted.cold_ranks:  # a partial view grafted stays partial
                index.cold.add(rank)
            else:
                index.cold.discard(rank)
            self.tracker.set(rank, BootstrapState.RECOVERED)
            self._replay_held(rank)
            if held:
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
            del self.proofs[rank]
            self.tracker.record_outcome(rank, "warm")
        else:
            proof.unknown_probes += 1
            if proof.unknown_probes >= MAX_UNKNOWN_PROBES:
                del self.proofs[rank]
                self.tracker.record_outcome(rank, "warm_unwitnessed")

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

    def fail(self, rank: RankId, outcome: str, *, discard_held: bool) -> None:
        """Fail a Pending rank cold: clear it, then replay what was held unless discarded."""
        self.retried.pop(rank, None)
        if not self.tracker.is_pending(rank):
            self.held.pop(rank, None)
            return
        self.tracker.set(rank, BootstrapState.FAILED)
        self.tracker.record_outcome(rank, outcome)
        self.index.clear_rank_state(rank)
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
