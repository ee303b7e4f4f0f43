"""Coordinator folding and late-join rules, with an injected sweep."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from cachetree.ranks import RankId
from peer.coordinator import Coordinator, CoordinatorDeps, ObligationBatch
from peer.sweep import FOUND, RANKS_RESOLVED, TIMED_OUT, Gapped, SweepResult


@dataclass(frozen=True)
class Ob:
    rank: RankId
    epoch: int


A, B, C = (Ob(RankId(f"http://w{i}", 0), 1) for i in range(3))


class Vetted:
    def __init__(self, covered: set) -> None:
        self._covered = covered

    def covered_ranks(self) -> frozenset:
        return frozenset(self._covered)


class Harness:
    def __init__(self, results: list[SweepResult]) -> None:
        self.results = results
        self.sweeps: list[tuple[list, float]] = []
        self.gaps: list[dict] = []  # each sweep's gap notes
        self.delivered: list[tuple[str, list]] = []
        self.recorded: list[str] = []
        self.owed: set = {A, B, C}
        self.during_sweep: list[ObligationBatch] = []
        self.coordinator = Coordinator(
            CoordinatorDeps(
                sweep=self.sweep,
                deliver=self.deliver,
                still_owed=lambda obs: [o for o in obs if o in self.owed],
                any_pending=lambda: bool(self.owed),
                record_result=lambda r: self.recorded.append(r.outcome),
            )
        )

    async def sweep(self, obligations: list, floor: float, gaps: Mapping):
        self.sweeps.append((obligations, floor))
        self.gaps.append(dict(gaps))
        for batch in self.during_sweep:
            self.coordinator.enqueue(batch)
        self.during_sweep = []
        return self.results.pop(0), []

    async def deliver(self, result: SweepResult, obligations: list) -> None:
        self.delivered.append((result.outcome, obligations))

    async def rounds(self, n: int) -> None:
        for _ in range(n):
            first = await asyncio.wait_for(self.coordinator.queue.get(), 1)
            await self.coordinator._round([first, *self.coordinator._drain()])


async def test_a_discovery_burst_is_folded_into_one_sweep_with_the_newest_floor() -> None:
    h = Harness([SweepResult(TIMED_OUT)])
    for ob, since in ((A, 1.0), (B, 3.0), (C, 2.0)):
        h.coordinator.enqueue(ObligationBatch((ob,), since))
    await h.rounds(1)
    assert h.sweeps == [([A, B, C], 3.0)]
    assert h.delivered == [(TIMED_OUT, [A, B, C])]


async def test_a_gap_retry_newer_than_the_floor_waits_for_the_next_sweep() -> None:
    h = Harness([SweepResult(TIMED_OUT), SweepResult(TIMED_OUT)])
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    h.during_sweep = [ObligationBatch((B,), 5.0, late_join=False)]
    await h.rounds(2)
    assert [s[0] for s in h.sweeps] == [[A], [B]]


async def test_a_discovery_batch_arriving_mid_sweep_rides_its_delivery() -> None:
    h = Harness([SweepResult(FOUND, vetted=Vetted({A.rank, B.rank}))])
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    h.during_sweep = [ObligationBatch((B,), 5.0, late_join=True)]
    await h.rounds(1)
    assert h.delivered == [(FOUND, [A, B])]


async def test_found_without_a_cursor_for_a_rank_gives_it_one_more_sweep() -> None:
    h = Harness(
        [
            SweepResult(FOUND, vetted=Vetted({A.rank})),
            SweepResult(FOUND, vetted=Vetted({A.rank})),
        ]
    )
    h.coordinator.enqueue(ObligationBatch((A, B), 1.0))
    await h.rounds(2)
    assert h.delivered == [(FOUND, [A]), (FOUND, [B])]  # the second time B is delivered as is


async def test_ranks_resolved_requeues_late_joiners_for_their_own_sweep() -> None:
    h = Harness([SweepResult(RANKS_RESOLVED), SweepResult(TIMED_OUT)])
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    h.during_sweep = [ObligationBatch((B,), 2.0)]
    await h.rounds(2)
    assert [s[0] for s in h.sweeps] == [[A], [B]]
    assert h.delivered[-1] == (TIMED_OUT, [B])


async def test_nothing_owed_anywhere_records_ranks_resolved_without_a_sweep() -> None:
    h = Harness([])
    h.owed = set()
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    await h.rounds(1)
    assert h.sweeps == [] and h.recorded == [RANKS_RESOLVED]


async def test_a_full_queue_never_drops_obligations() -> None:
    h = Harness([SweepResult(TIMED_OUT)])
    h.coordinator.queue = asyncio.Queue(1)
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    h.coordinator.enqueue_or_detach(ObligationBatch((B,), 1.0))
    await asyncio.gather(*h.coordinator.detached)
    assert h.sweeps == [([B], 1.0)]


async def test_a_gap_retry_brings_its_note_to_the_sweep_that_serves_it() -> None:
    h = Harness([SweepResult(TIMED_OUT), SweepResult(TIMED_OUT)])
    note = Gapped("http://frozen", 6)
    h.coordinator.enqueue(ObligationBatch((A,), 1.0))
    h.during_sweep = [ObligationBatch((B,), 5.0, late_join=False, gaps={B.rank: note})]
    await h.rounds(2)
    assert h.gaps == [{}, {B.rank: note}]
