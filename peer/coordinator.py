"""Single-flight sweeps: folding bursts of obligations into one fleet-wide fetch.

Rules of this file: the coordinator owns the queue of `ObligationBatch`es and runs at most
one sweep at a time. What a sweep does and how a result reaches the pump are injected.

Theory of operation
-------------------
Workers are discovered in bursts (a Deployment starts, an EndpointSlice relists), and every
new worker brings obligations for its ranks. Sweeping once per worker would fetch the same
sibling snapshot N times, so the coordinator blocks for the first batch, then takes whatever
else is already queued *without waiting* (no debounce to tune) and sweeps once for all of it.
The sweep's freshness floor is the newest `holding_since` among the absorbed batches: a
snapshot exported before a rank started holding its stream cannot be spliced onto it.

While a sweep runs, more batches arrive. Afterwards:
  - a discovery batch (`late_join=True`) rides along: its ranks started holding before the
    delivery, and if the snapshot predates them they will gap and get their one retry;
  - a gap-retry batch (`late_join=False`) newer than the frozen floor is deferred to the
    next sweep: riding a snapshot taken before its gap would gap again by construction.
    Its `gaps` note (`peer.sweep.Gapped`) goes with its ranks into the sweep that serves them.
    So is a rejoin's (a rank registered again after this replica forgot it,
    `BootstrapTracker.rejoins`): a snapshot taken before it came back may hold blocks its
    engine dropped while it was out, and no held batch of this replica says so.
  - `found` but some obligations have no cursor in it: each gets ONE more sweep (remembered
    per (rank, epoch)) instead of being resolved `uncovered`, which is final.
  - `ranks_resolved` sends nothing, so late joiners are re-queued for a sweep of their own.
Obligations are never dropped: a full queue falls back to a detached sweep for that batch,
and a round that fails half-way (a bug, an error nobody foresaw) runs its ranks cold, never
Pending until the deadline, before the error ends `run` for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachetree.ranks import RankId
from peer.sweep import FOUND, NO_GAPS, RANKS_RESOLVED, Gapped, SweepResult

log = logging.getLogger(__name__)

QUEUE_DEPTH = 1024
ROUND_FAILED = "round_failed"  # not a sweep outcome: what a round that raised delivers


@dataclass(frozen=True, slots=True)
class ObligationBatch:
    obligations: tuple[Any, ...]  # (rank, epoch) obligations
    holding_since: float
    late_join: bool = True  # discovery: may ride an in-flight sweep; gap retries, rejoins not
    # A gap retry's notes: whose snapshot gapped, and the least cursor that joins (by rank).
    gaps: Mapping[RankId, Gapped] = field(default_factory=lambda: NO_GAPS)


@dataclass(slots=True)
class CoordinatorDeps:
    sweep: Callable[
        [list[Any], float, Mapping[RankId, Gapped]], Awaitable[tuple[SweepResult, list[Any]]]
    ]
    deliver: Callable[[SweepResult, list[Any]], Awaitable[None]]
    still_owed: Callable[[Sequence[Any]], list[Any]]
    any_pending: Callable[[], bool]
    record_result: Callable[[SweepResult], None]


@dataclass(slots=True)
class Coordinator:
    deps: CoordinatorDeps
    queue: asyncio.Queue[ObligationBatch] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_DEPTH)
    )
    retried_for_coverage: set[tuple[Any, int]] = field(default_factory=set)
    detached: set[asyncio.Task[None]] = field(default_factory=set)
    sweeps: int = 0

    def enqueue(self, batch: ObligationBatch) -> bool:
        """Queue a batch without blocking; False when the queue is full."""
        try:
            self.queue.put_nowait(batch)
        except asyncio.QueueFull:
            return False
        return True

    def enqueue_or_detach(self, batch: ObligationBatch) -> None:
        """Never drop obligations: without room in the queue, sweep for them on the side."""
        if self.enqueue(batch):
            return
        log.warning(
            "bootstrap queue full; sweeping %d obligation(s) on the side", len(batch.obligations)
        )
        task = asyncio.create_task(self._round([batch]))
        self.detached.add(task)
        task.add_done_callback(self.detached.discard)

    async def run(self) -> None:
        while True:
            first = await self.queue.get()
            batches = [first, *self._drain()]
            try:
                await self._round(batches)
            except Exception:
                await self._settle_cold(batches)
                raise

    async def _settle_cold(self, batches: list[ObligationBatch]) -> None:
        try:
            owed = self.deps.still_owed([o for b in batches for o in b.obligations])
            if owed:
                await self.deps.deliver(SweepResult(ROUND_FAILED), owed)
        except Exception:  # the round's own error is the one worth reporting
            log.exception("could not run the ranks of a failed bootstrap round cold")

    async def close(self) -> None:
        for task in list(self.detached):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _drain(self) -> list[ObligationBatch]:
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except asyncio.QueueEmpty:
                return out

    async def _round(self, batches: list[ObligationBatch]) -> None:
        deps = self.deps
        floor = max(b.holding_since for b in batches)
        obligations = _dedupe(deps.still_owed([o for b in batches for o in b.obligations]))
        if not obligations:
            if not deps.any_pending():
                deps.record_result(SweepResult(RANKS_RESOLVED))
            return
        self.sweeps += 1
        gaps = _merged_gaps(batches)
        result, settled_cold = await deps.sweep(obligations, floor, gaps)
        joined: list[Any] = []
        newest = floor
        for batch in self._drain():
            if not batch.late_join and batch.holding_since > floor:
                self._requeue(batch)  # a gap retry must not ride an older snapshot
                continue
            joined.extend(batch.obligations)
            gaps = {**gaps, **batch.gaps}
            newest = max(newest, batch.holding_since)
        cold = set(settled_cold)
        obligations = _dedupe(
            deps.still_owed([o for o in [*obligations, *joined] if o not in cold])
        )
        if result.outcome == FOUND and result.vetted is not None:
            covered = result.vetted.covered_ranks()
            second_chance = [
                o
                for o in obligations
                if o.rank not in covered and (o.rank, o.epoch) not in self.retried_for_coverage
            ]
            if second_chance:
                self.retried_for_coverage.update((o.rank, o.epoch) for o in second_chance)
                self._requeue(
                    ObligationBatch(tuple(second_chance), newest, True, _for(gaps, second_chance))
                )
                obligations = [o for o in obligations if o not in second_chance]
        elif result.outcome == RANKS_RESOLVED and joined:
            self._requeue(ObligationBatch(tuple(joined), newest, True, _for(gaps, joined)))
        deps.record_result(result)
        await deps.deliver(result, obligations)

    def _requeue(self, batch: ObligationBatch) -> None:
        self.enqueue_or_detach(batch)


def _merged_gaps(batches: Iterable[ObligationBatch]) -> Mapping[RankId, Gapped]:
    merged: dict[RankId, Gapped] = {}
    for batch in batches:
        merged.update(batch.gaps)
    return merged or NO_GAPS


def _for(gaps: Mapping[RankId, Gapped], obligations: Iterable[Any]) -> Mapping[RankId, Gapped]:
    """The notes of the ranks in `obligations` (they go to a sweep of their own)."""
    mine = {o.rank: gaps[o.rank] for o in obligations if o.rank in gaps}
    return mine or NO_GAPS


def _dedupe(obligations: Sequence[Any]) -> list[Any]:
    seen: set[Any] = set()
    out = []
    for o in obligations:
        if o not in seen:
            seen.add(o)
            out.append(o)
    return out
