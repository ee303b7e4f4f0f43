"""Peer snapshot bootstrap for one replica: the tracker, sweeps, grafts, probes, readiness.

This module only composes. The rules live in `peer.tracker` (per-rank states, deadline,
seed gate), `peer.sweep` (one bounded search), `peer.coordinator` (single-flight sweeps),
`peer.probe` (splice witnesses), `peer.vet` (the trust boundary) and `router.graft` (what the
pump does with held batches and snapshots). Here they meet the pump, the fetch client, the
sibling registry and the worker registry.

Order for a worker that registers (the reference's `add_worker`):
  1. `register_ranks`: the tracker makes its ranks Pending and hands out obligations;
  2. the ranks go live in the pump and the subscribers start, so live batches are held;
  3. `holding_since` is stamped after that;
  4. if the worker serves `/v1/kv-snapshot`, it is itself the source for its own ranks: the
     body is grafted like a sibling's, its seq as the watermark (a rank it never published
     and holds nothing of is covered, empty); only ranks it does not cover are handed to the
     coordinator, which sweeps the siblings for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from cachetree.ranks import RankId
from peer.capacity import CapacityBlocks, unknown_capacity
from peer.coordinator import Coordinator, CoordinatorDeps, ObligationBatch
from peer.fetch import Fetched, Refused, SnapshotFetcher
from peer.origin import canonical_origin
from peer.probe import PROOF_TIMEOUT_S, TICK_S, ProbeTarget, probe_once
from peer.registry import PeerRegistry
from peer.supervise import Supervisor
from peer.sweep import (
    BODY_REFUSED,
    CONNECTION_REFUSED,
    FOUND,
    NOT_A_SIBLING,
    RANKS_RESOLVED,
    UNREACHABLE,
    FetchOutcome,
    Gapped,
    SweepDeps,
    SweepResult,
    VetFailure,
    sweep,
)
from peer.tasks import cancel_and_wait
from peer.tracker import BootstrapTracker, Obligation, PeerAttemptLog, below_floor_warning
from peer.vet import Retaining, VetError, VettedSnapshot, Vetting
from router.graft import BootstrapRules, Grafted, LocalGraft
from router.index import IndexRules, Pump

log = logging.getLogger(__name__)

# A sibling's answers to a snapshot request that no retry changes (a replica's token, and what
# listens at an address, hold for the life of its process): what each means, for the log.
_NOT_A_SIBLING: Final = {
    401: "it refuses this replica's --internal-token: the replicas' tokens differ (give every "
    "replica the same one)",
    403: "it has no --internal-token, so it serves siblings nothing (start it with this "
    "replica's), or it is no kvrouter replica",
    404: "it serves no snapshot there: no kvrouter replica (or one too old) answers at that "
    "address (check --peer, or the port the peer selector's slices give)",
}

GRAFT_CHUNK = 4096
VET_CHUNK = 4096


class PeerBootstrap:
    def __init__(
        self,
        pump: Pump,
        tracker: BootstrapTracker,
        registry: PeerRegistry,
        fetcher: SnapshotFetcher,
        *,
        block_size: Callable[[], int | None],
        clock: Callable[[], float] = time.monotonic,
        capacity_blocks: CapacityBlocks = unknown_capacity,
    ) -> None:
        self.pump = pump
        self.tracker = tracker
        self.registry = registry
        self.fetcher = fetcher
        self._block_size = block_size
        self._clock = clock
        self._capacity_blocks = capacity_blocks
        self.snapshot_outcomes: Counter[str] = Counter()  # per peer fetch
        self.sources: Counter[str] = Counter()  # grafts by source: peer / worker
        self._attempts = PeerAttemptLog()  # how loudly a sibling's failed fetch is said
        self.started_at = clock()
        self.ready_at: float | None = None
        self.coordinator = Coordinator(
            CoordinatorDeps(
                sweep=self._sweep,
                deliver=self._deliver,
                still_owed=tracker.still_owed,
                any_pending=tracker.any_pending,
                record_result=self._record_sweep,
            )
        )
        pump.rules.bootstrap = BootstrapRules(pump.rules, tracker, self._enqueue_retry, clock)
        self._tasks: list[asyncio.Task[None]] = []
        if below_floor_warning(tracker.timeout_s, tracker.fetch_cap_s, enabled=tracker.enabled):
            log.warning(
                "--kv-bootstrap-timeout-ms %.0f gives each peer fetch under 30 s; large "
                "snapshots may not arrive in time (a timeout of 120 s or more is advised)",
                tracker.timeout_s * 1000,
            )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, supervisor: Supervisor) -> None:
        self._tasks = [
            supervisor.spawn("bootstrap", "kv-bootstrap-coordinator", self.coordinator.run),
            supervisor.spawn("bootstrap", "kv-bootstrap-probe", self._probe_loop),
        ]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.coordinator.close()
        await self.fetcher.close()

    # -- worker lifecycle hooks ------------------------------------------------------------

    def register_ranks(self, ranks: Sequence[RankId]) -> list[Obligation]:
        return self.tracker.register(ranks)

    def forget_ranks(self, ranks: Sequence[RankId]) -> None:
        """Before the pump forgets them: makes any in-flight graft for them a no-op."""
        self.tracker.forget(ranks)

    def sweep_for(self, obligations: Sequence[Obligation], holding_since: float) -> None:
        """Queue the obligations for a sweep.

        A rank registered again after this replica forgot it waits for a sweep whose floor
        is its own (`late_join=False`, as a gap retry): a body fetched since before it came
        back may hold blocks its engine dropped while no stream of it was held here, and
        grafted, they stayed as ghosts until the splice probe saw the stream had moved on.
        A first registration still rides the sweep in flight: workers registering across
        the boot sweep share its one fetch.
        """
        rejoins = tuple(o for o in obligations if self.tracker.rejoins(o.rank))
        joins = tuple(o for o in obligations if not self.tracker.rejoins(o.rank))
        for batch, late_join in ((joins, True), (rejoins, False)):
            if batch:
                self.coordinator.enqueue_or_detach(
                    ObligationBatch(batch, holding_since, late_join=late_join)
                )

    async def graft_from_worker(
        self, obligations: Sequence[Obligation], graft: LocalGraft
    ) -> list[Obligation]:
        """Graft a worker's own snapshot for the ranks it covers; returns the other obligations.

        A rank the worker's body has no cursor for (blocks without a `last_seq`) is left to
        the siblings, not settled `uncovered`; one it never published and holds nothing of
        is covered, as empty (`LocalGraft`).
        """
        mine = [o for o in obligations if o.rank in graft.cursors]
        if mine:
            covered = await self._graft(mine, graft, f"worker {mine[0].rank.worker_url}")
            self.sources["worker"] += len(covered)
        return [o for o in obligations if o.rank not in graft.cursors]

    # -- readiness -------------------------------------------------------------------------

    def admit_ready(self) -> bool:
        """Settled and seed gate open; latches at the first True (call it last)."""
        ready = self.tracker.admit_ready()
        for notice in self.tracker.take_notices():
            log.warning("%s", notice.message)
        if ready and self.ready_at is None:
            self.ready_at = self._clock()
            log.info("bootstrap settled after %.2f s", self.ready_at - self.started_at)
        return ready

    # -- coordinator plumbing --------------------------------------------------------------

    def _enqueue_retry(self, obligation: Obligation, gapped: Gapped) -> bool:
        return self.coordinator.enqueue(
            ObligationBatch(
                (obligation,), self._clock(), late_join=False, gaps={obligation.rank: gapped}
            )
        )

    async def _sweep(
        self, obligations: list[Obligation], floor: float, gaps: Mapping[RankId, Gapped]
    ) -> tuple[SweepResult, list[Obligation]]:
        tracker = self.tracker
        budget = tracker.timeout_s if tracker.settled() else tracker.time_remaining()
        deps = SweepDeps(
            registry=self.registry,
            fetch=self._fetch,
            vet=self._vet,
            still_owed=tracker.still_owed,
            abandon=self._abandon,
            clock=self._clock,
            tally=self._tally,
        )
        result, cold = await sweep(obligations, deps, budget, floor, gaps)
        log.info(
            "bootstrap sweep for %d rank(s) (%d pending now, %d settled cold during it): %s%s",
            len(obligations),
            tracker.pending_count(),
            len(cold),
            result.outcome,
            f" ({result.peer})" if result.peer else f": {result.last_reason}".rstrip(": "),
        )
        return result, cold

    async def _deliver(self, result: SweepResult, obligations: list[Obligation]) -> None:
        if result.outcome == FOUND and result.vetted is not None:
            covered = await self._graft(obligations, result.vetted, result.peer or "a sibling")
            self.sources["peer"] += len(covered)
        elif result.outcome != RANKS_RESOLVED:
            await self._abandon(obligations)

    def gaps_by_source(self) -> Counter[str]:
        """Grafts that did not join their rank's stream, by source (`router.graft`)."""
        return _rules(self.pump.rules).gaps

    def _record_sweep(self, result: SweepResult) -> None:
        self.tracker.record_sweep_result(result.outcome, result.peers_tried)

    async def _abandon(self, obligations: list[Obligation]) -> None:
        await self.pump.call(lambda rules: _rules(rules).abandon(obligations))

    async def _graft(
        self, obligations: list[Obligation], vetted: Grafted, source: str
    ) -> list[RankId]:
        if isinstance(vetted, VettedSnapshot):
            # Filtering a million-node snapshot to the owed ranks takes most of a second:
            # do it in slices before the pump call; the graft re-checks what is still owed.
            owed = {o.rank for o in self.tracker.still_owed(obligations)}
            job = Retaining(vetted, owed)
            await run_in_slices(job.step, VET_CHUNK)
            vetted = job.result()

        async def run(rules: IndexRules) -> list[RankId]:
            bootstrap = _rules(rules)
            job = bootstrap.begin_graft(obligations, vetted, source)
            if job is None:
                return []
            try:
                await run_in_slices(job.restore.step, GRAFT_CHUNK)
            except Exception as exc:
                bootstrap.fail_graft(job.owed, exc)
                return []
            return bootstrap.finish_graft(job)

        return await self.pump.call_async(run)

    # -- fetch and vet ---------------------------------------------------------------------

    async def _fetch(self, peer: str, max_age_s: float) -> FetchOutcome:
        result = await self.fetcher.fetch_snapshot(peer, int(max_age_s * 1000))
        if isinstance(result, Fetched):
            return FetchOutcome(result.snapshot, result.arrived_at)
        reason = result.reason
        if isinstance(result, Refused):
            kind = BODY_REFUSED
        elif (meaning := _NOT_A_SIBLING.get(result.status or 0)) is not None:
            # Asking again in this bootstrap brings the same answer: it holds nothing for this
            # replica, a cold witness at once. Waited for as a silence, it held /readyz for the
            # whole bootstrap timeout at every new pod of a token rotation, which then ran cold.
            kind = NOT_A_SIBLING
            reason = f"{reason}: {meaning}"
        else:
            kind = CONNECTION_REFUSED if result.connection_refused else UNREACHABLE
            if kind == UNREACHABLE:
                # Still a silence, not a cold witness, but said: the joiner waited out its whole
                # bootstrap with nothing in its log (a body cut short mid Content-Length, a
                # 5xx). Said again every 100th time or when the cause changes
                # (`PeerAttemptLog`), not at every retry.
                said = self._attempts.attempt(peer, kind, reason)
                level = logging.WARNING if said.level == logging.INFO else logging.DEBUG
                log.log(
                    level,
                    "sibling %s gave no snapshot (attempt %d): %s",
                    peer,
                    said.attempts,
                    reason,
                )
        return FetchOutcome(None, self._clock(), reason, kind)

    async def _vet(self, body: Any) -> VettedSnapshot:
        live = set(self.pump.rules.live)
        try:
            job = Vetting(body, live, self._block_size(), self._capacity_blocks)
            await run_in_slices(job.step, VET_CHUNK)
        except VetError as exc:
            raise VetFailure(exc.outcome, str(exc)) from None  # the reason and its detail
        return job.result()

    def _tally(self, outcome: str) -> None:
        self.snapshot_outcomes[outcome] += 1

    # -- splice probe ----------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            await self.pump.call(lambda rules: _rules(rules).expire_behind())
            due = await self.pump.call(lambda rules: _rules(rules).due_proofs(PROOF_TIMEOUT_S))
            if not due:
                continue
            targets = [ProbeTarget(rank, watermark, epoch) for rank, watermark, epoch in due]
            verdicts = await probe_once(targets, self.registry.candidates(), self._cursor_table)
            for target, verdict in verdicts.items():
                await self.pump.call(
                    lambda rules, t=target, v=verdict: _rules(rules).probe_verdict(
                        t.rank, t.epoch, t.watermark, v
                    )
                )

    async def _cursor_table(self, peer: str) -> dict[RankId, int] | None:
        result = await self.fetcher.fetch_cursors(peer)
        if not isinstance(result, Fetched) or result.snapshot.format != 1:
            return None
        snap = result.snapshot
        table = {}
        for index, seq in snap.cursors:
            if 0 <= index < len(snap.workers):
                worker = snap.workers[index]
                table[RankId(canonical_origin(worker.url), worker.dp_rank)] = seq
        return table


async def run_in_slices(step: Callable[[int], bool], chunk: int) -> None:
    """Run a chunked job to completion, yielding to the event loop between chunks."""
    while not step(chunk):  # noqa: ASYNC110 - a cooperative yield per chunk, not a wait
        await asyncio.sleep(0)


def _rules(rules: IndexRules) -> BootstrapRules:
    assert rules.bootstrap is not None
    return rules.bootstrap
