"""One bounded search of the siblings for a snapshot that covers the Pending ranks.

Rules of this file: `SweepBook` is the sweep's memory and verdicts, plain synchronous code;
`sweep()` is the loop that drives it, with every effect (fetching, vetting, the clock,
sleeping, abandoning ranks) injected, so both run in tests without sockets.

Theory of operation
-------------------
A sweep owns a set of obligations (rank, epoch). Every 250 ms it drops obligations no longer
owed, makes one pass over the shuffled candidates, and reads the pass:

  - a vetted body that has a cursor for at least one owed rank -> `found` (the caller grafts),
    the producer not cold for it (else see "cold covers" below)
  - every candidate rejected or cold-witnessed                 -> `fleet_cold` (run cold)
  - some ranks every candidate says it holds nothing for       -> abandon just those ranks now,
                                                                  keep sweeping for the rest
  - the registry is synced, empty and never had peers          -> `no_peers`
  - nothing owed any more                                      -> `ranks_resolved`
  - the budget runs out                                        -> `timed_out`

A peer vetoes every cold verdict until it has answered: silence is not evidence. A cold
verdict reached while the candidate *set* changed during the pass (even at the same size) is
discarded, because the newcomer was never asked.

Per peer: a transport failure (`unreachable`) clears what it last told us; each retriable miss
(unreachable, cold, or a body that covers none of our ranks) sits the peer out for
min(4 x 2^(n-1), 120) passes; a `rejected` body (another format, key scheme or block size, a
malformed structure, a body over the size bound or a gzip bomb, an implausible one) excludes
the peer for the rest of the sweep: fetching it again would bring the same. So does an answer
that says the peer is no sibling of ours (`not_a_sibling`: a 401 or 403, its token is another
or none, or a 404, no kvrouter serves there): a replica's token and what listens at an address
hold for the life of its process. A peer whose address refuses the connection has no replica
listening: that is a cold witness at once (`connection_refused`), not a silence that vetoes the
fleet's cold verdict until the deadline.

One pass asks its candidates hedged, not one at a time: the first fetch starts at once, and
whenever `hedge_after_s` passes with no usable answer (or a fetch ends without one) the next
starts, at most `max_in_flight` at a time. The first usable body wins and the fetches still
running are cancelled. A sibling that trickles its body costs the others `hedge_after_s`,
not its whole per-fetch deadline; the bound on fetches in flight bounds the memory that
bodies being received can take.

Cold covers (our addition to the reference, which takes the first vetted body that covers a
rank): a body whose every cursor for the owed ranks is one its producer marks cold
(`cold_ranks`, `peer.wire`: its view of the rank is partial, e.g. it ran cold itself) does not
win the pass. The first such body is kept as the fallback and the pass goes on; a body that
covers an owed rank and is not cold for it wins; at the end of the pass (or when the sweep's
budget runs out during it) the fallback is taken: a partial view is never wrong and beats
none. No time bound changes: the pass only asks the peers it would have asked anyway, each
within its per-fetch deadline, all within the sweep's budget; the fallback is one more body
held beside those being received. A body warm for one owed rank and cold for another still
wins whole: one sweep grafts one body.

Gap retries (our addition: the reference sweeps for a retry exactly as for a first graft, so
it may take the very sibling whose snapshot just gapped, and a sibling whose stream stalled
gaps every time): a retried rank comes with a `Gapped` note, the sibling whose snapshot did
not join its stream and the least cursor that would (its held queue starts one past it; the
queue is kept for the retry). That sibling is asked last in every pass; a body whose cursor
for the rank is below the note's is `stale` for it: it would gap again, so it neither wins
the pass for that rank nor vetoes settling it (every sibling stale, cold or empty for the rank
settles it cold after one pass, not at the deadline). A sibling that has caught up since is
taken like any other. Nothing is added to any bound: the same peers, the same passes.

The freshness ratchet asks
each peer for an export no older than the newer of the sweep's floor (when our ranks started
holding their streams) and the arrival of that peer's previous body: a re-fetch must bring
something newer than the useless answer already received.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from cachetree.ranks import RankId
from peer.origin import canonical_origin

log = logging.getLogger(__name__)

PASS_INTERVAL_S = 0.25
MAX_SIT_OUT_PASSES = 120
HEDGE_AFTER_S = 1.0  # a fetch with no usable answer by then: ask the next candidate too
MAX_IN_FLIGHT = 2  # fetches at once in a pass (each may hold a body up to the bound)
SUMMARY_REASONS = 3  # siblings named, with why they gave nothing, in a sweep's result

# How a fetch came back without a body (`FetchOutcome.kind`).
UNREACHABLE, CONNECTION_REFUSED, BODY_REFUSED = "unreachable", "connection_refused", "rejected"
NOT_A_SIBLING = "not_a_sibling"  # a 401, 403 or 404: another token, none, or no kvrouter there

FETCHED_ACCEPTED = "accepted"
STALE = "stale"  # a body behind what a gap-retried rank's stream needs (see Gapped)
FOUND, NO_PEERS, FLEET_COLD, TIMED_OUT, RANKS_RESOLVED = (
    "found",
    "no_peers",
    "fleet_cold",
    "timed_out",
    "ranks_resolved",
)


@dataclass(frozen=True, slots=True)
class Gapped:
    """Why a rank is swept again: `peer`'s snapshot did not join the rank's stream, and a
    snapshot whose cursor for it is below `min_cursor` would not join it either."""

    peer: str
    min_cursor: int


NO_GAPS: Mapping[RankId, Gapped] = MappingProxyType({})


def asked_last(peers: Sequence[str], shunned: Collection[str]) -> list[str]:
    """`peers` in their order, those in `shunned` moved to the end (still asked: a sibling
    whose snapshot gapped may have caught up, and it may be the only one)."""
    return [p for p in peers if p not in shunned] + [p for p in peers if p in shunned]


def stale_ranks(cursors: Mapping[RankId, int], gaps: Mapping[RankId, Gapped]) -> frozenset[RankId]:
    """The gap-retried ranks a body speaks for with a cursor too old to join their streams."""
    return frozenset(
        rank
        for rank, gap in gaps.items()
        if (seq := cursors.get(rank)) is not None and seq < gap.min_cursor
    )


def sit_out_passes(strikes: int) -> int:
    """Passes a peer skips after its `strikes`-th retriable miss: 4, 8, 16, 32, 64, 120..."""
    return min(4 * 2 ** (strikes - 1), MAX_SIT_OUT_PASSES)


@dataclass(slots=True)
class PeerRecord:
    rejected: bool = False
    answered: bool = False
    cold_witness: bool = False  # its latest body had no nodes
    empty_ranks: frozenset[RankId] = frozenset()  # ranks its latest body says it holds nothing of
    last_arrival: float | None = None
    strikes: int = 0
    sit_out: int = 0


@dataclass(slots=True)
class SweepBook:
    freshness_floor: float
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    # The current pass's first body that covers owed ranks only as cold: (vetted, peer).
    fallback: tuple[Any, str] | None = None

    def record(self, peer: str) -> PeerRecord:
        rec = self.peers.get(peer)
        if rec is None:
            rec = self.peers[peer] = PeerRecord()
        return rec

    def should_skip(self, peer: str) -> bool:
        rec = self.record(peer)
        if rec.rejected:
            return True
        if rec.sit_out > 0:
            rec.sit_out -= 1
            return True
        return False

    def max_age_s(self, peer: str, now: float) -> float:
        """How old an export this peer may serve us: the freshness ratchet."""
        rec = self.record(peer)
        floor = self.freshness_floor
        if rec.last_arrival is not None:
            floor = max(floor, rec.last_arrival)
        return max(0.0, now - floor)

    def unreachable(self, peer: str) -> None:
        rec = self.record(peer)
        rec.answered = False
        rec.cold_witness = False
        rec.empty_ranks = frozenset()
        self._strike(rec)

    def answered(
        self, peer: str, arrival: float, has_nodes: bool, empty_ranks: Iterable[RankId]
    ) -> None:
        rec = self.record(peer)
        rec.answered = True
        rec.last_arrival = arrival
        rec.cold_witness = not has_nodes
        rec.empty_ranks = frozenset(empty_ranks)

    def nobody_listening(self, peer: str) -> None:
        """The peer's address refused the connection: no replica runs there, so it holds
        nothing (a cold witness), and it is asked again only after a sit-out."""
        rec = self.record(peer)
        rec.answered = True
        rec.cold_witness = True
        rec.empty_ranks = frozenset()
        self._strike(rec)

    def stale(self, peer: str, ranks: Iterable[RankId]) -> None:
        """Its body is too old for `ranks` (`stale_ranks`): for them it is as good as empty."""
        rec = self.record(peer)
        rec.empty_ranks = rec.empty_ranks | frozenset(ranks)

    def miss(self, peer: str) -> None:
        """A body we could not use now but may later (cold, or covering none of our ranks)."""
        self._strike(self.record(peer))

    def reject(self, peer: str) -> None:
        rec = self.record(peer)
        rec.rejected = True
        self._strike(rec)

    def fleet_is_cold(self, candidates: Collection[str]) -> bool:
        if not candidates:
            return False
        return all(self._cold(self.peers.get(p)) for p in candidates)

    def nothing_to_recover(self, rank: RankId, candidates: Collection[str]) -> bool:
        if not candidates:
            return False
        for peer in candidates:
            rec = self.peers.get(peer)
            if self._cold(rec):
                continue
            if rec is None or not rec.answered or rank not in rec.empty_ranks:
                return False
        return True

    @staticmethod
    def _cold(rec: PeerRecord | None) -> bool:
        return rec is not None and (rec.rejected or (rec.answered and rec.cold_witness))

    @staticmethod
    def _strike(rec: PeerRecord) -> None:
        rec.strikes += 1
        rec.sit_out = sit_out_passes(rec.strikes)


class Vetted(Protocol):
    @property
    def cursors(self) -> Mapping[RankId, int]: ...
    def covers_any(self, ranks: Collection[RankId]) -> bool: ...
    def covers_warm(self, ranks: Collection[RankId]) -> bool: ...


@dataclass(frozen=True, slots=True)
class FetchOutcome:
    """What one fetch brought: a decoded body, or why there is none."""

    body: Any | None  # peer.wire.PeerBody
    arrival: float
    failure: str = ""
    # Without a body: UNREACHABLE, CONNECTION_REFUSED, BODY_REFUSED, NOT_A_SIBLING.
    kind: str = UNREACHABLE


class VetFailure(Exception):
    """Raised by the injected vet function; `outcome` is `rejected` or `cold_peer`."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SweepResult:
    outcome: str
    vetted: Any | None = None  # the accepted snapshot when `found`
    peer: str | None = None
    peers_tried: int = 0
    last_reason: str = ""


class Registry(Protocol):
    version: int

    def candidates(self) -> list[str]: ...
    def known_to_have_no_peers(self) -> bool: ...
    @property
    def peers(self) -> Sequence[str]: ...


@dataclass(slots=True)
class SweepDeps:
    """Everything a sweep touches outside itself."""

    registry: Registry
    fetch: Callable[[str, float], Awaitable[FetchOutcome]]  # (peer, max_age_s)
    vet: Callable[[Any], Awaitable[Vetted]]  # raises VetFailure; may yield between chunks
    still_owed: Callable[[Sequence[Any]], list[Any]]  # obligations still Pending under epoch
    abandon: Callable[[list[Any]], Awaitable[None]]  # per-rank cold settle
    clock: Callable[[], float]
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    tally: Callable[[str], None] = lambda outcome: None  # per-fetch snapshot outcomes
    hedge_after_s: float = HEDGE_AFTER_S
    max_in_flight: int = MAX_IN_FLIGHT


async def sweep(
    obligations: Sequence[Any],
    deps: SweepDeps,
    budget_s: float,
    freshness_floor: float,
    gaps: Mapping[RankId, Gapped] = NO_GAPS,
) -> tuple[SweepResult, list[Any]]:
    """Search until found, cold, resolved, no peers, or `budget_s` runs out.

    `gaps` notes the ranks swept again after a gap (see "Gap retries" above).

    Returns the result and the obligations it settled cold mid-sweep (already abandoned).
    """
    book = SweepBook(freshness_floor)
    settled_cold: list[Any] = []
    last_reason = ""
    try:
        async with asyncio.timeout(budget_s):
            owed = list(obligations)
            while True:
                owed = deps.still_owed(owed)
                if not owed:
                    return SweepResult(RANKS_RESOLVED), settled_cold
                ranks = {o.rank for o in owed}
                owed_gaps = {r: g for r, g in gaps.items() if r in ranks}
                version = deps.registry.version
                candidates = deps.registry.candidates()
                eligible = asked_last(
                    [peer for peer in candidates if not book.should_skip(peer)],
                    {g.peer for g in owed_gaps.values()},
                )
                found, peer, reasons = await _hedged_pass(eligible, book, deps, ranks, owed_gaps)
                last_reason = _summary(reasons) or last_reason
                if found is not None:
                    return SweepResult(FOUND, found, peer, 1), settled_cold
                if book.fallback is not None:
                    return _take_fallback(book, deps), settled_cold
                if deps.registry.version != version:
                    log.info("sibling set changed during the pass; cold verdicts discarded")
                elif book.fleet_is_cold(candidates):
                    tried = len(candidates)
                    result = SweepResult(FLEET_COLD, peers_tried=tried, last_reason=last_reason)
                    return result, settled_cold
                else:
                    barren = [o for o in owed if book.nothing_to_recover(o.rank, candidates)]
                    if barren:
                        await deps.abandon(barren)
                        settled_cold.extend(barren)
                        owed = [o for o in owed if o not in barren]
                if deps.registry.known_to_have_no_peers():
                    return SweepResult(NO_PEERS), settled_cold
                await deps.sleep(PASS_INTERVAL_S)
    except TimeoutError:
        if book.fallback is not None:  # the budget ran out in a pass that found a cold cover
            return _take_fallback(book, deps), settled_cold
        tried = len(deps.registry.peers)
        return SweepResult(TIMED_OUT, peers_tried=tried, last_reason=last_reason), settled_cold


async def _hedged_pass(
    peers: list[str],
    book: SweepBook,
    deps: SweepDeps,
    ranks: set[RankId],
    gaps: Mapping[RankId, Gapped],
) -> tuple[Any | None, str | None, list[str]]:
    """Ask `peers` in order, hedged (see the module docstring); (vetted, peer, why each peer
    that gave nothing gave nothing).

    A body that covers `ranks` only as cold is kept in `book.fallback` (the first one) and
    the pass goes on; the caller takes it when the pass ends without a warm cover.
    """
    book.fallback = None
    waiting = list(reversed(peers))  # popped from the end: in order
    running: dict[asyncio.Task[tuple[Any | None, str]], str] = {}
    reasons: list[str] = []
    try:
        while waiting or running:
            if waiting and len(running) < max(1, deps.max_in_flight):
                peer = waiting.pop()
                running[asyncio.create_task(_try_peer(peer, book, deps, ranks, gaps))] = peer
                if waiting and len(running) < deps.max_in_flight:
                    # Another may start now unless this one answers usefully in time.
                    done, _ = await asyncio.wait(
                        running, timeout=deps.hedge_after_s, return_when=FIRST_COMPLETED
                    )
                else:
                    done, _ = await asyncio.wait(running, return_when=FIRST_COMPLETED)
            else:
                done, _ = await asyncio.wait(running, return_when=FIRST_COMPLETED)
            for task in done:
                peer = running.pop(task)
                found, reason = task.result()
                if reason:
                    reasons.append(reason)
                if found is None:
                    continue
                if found.covers_warm(ranks - stale_ranks(found.cursors, gaps)):
                    if book.fallback is not None:
                        deps.tally("cold_peer")  # the fallback is not taken
                        book.fallback = None
                    deps.tally(FETCHED_ACCEPTED)
                    return found, peer, reasons
                if book.fallback is None:
                    book.fallback = (found, peer)
                else:
                    deps.tally("cold_peer")
        return None, None, reasons
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)


async def _try_peer(
    peer: str,
    book: SweepBook,
    deps: SweepDeps,
    ranks: set[RankId],
    gaps: Mapping[RankId, Gapped],
) -> tuple[Any | None, str]:
    outcome = await deps.fetch(peer, book.max_age_s(peer, deps.clock()))
    body = outcome.body
    if body is None:
        if outcome.kind == BODY_REFUSED:
            log.warning("sibling %s rejected for this bootstrap: %s", peer, outcome.failure)
            book.reject(peer)
        elif outcome.kind == NOT_A_SIBLING:
            log.warning(
                "%s left out of this bootstrap as holding nothing: %s", peer, outcome.failure
            )
            book.reject(peer)
        elif outcome.kind == CONNECTION_REFUSED:
            book.nobody_listening(peer)
        else:
            book.unreachable(peer)
        deps.tally(outcome.kind)
        return None, f"{peer}: {outcome.failure}"
    book.answered(peer, outcome.arrival, body.node_count > 0, _empty_ranks(body))
    try:
        vetted = await deps.vet(body)
    except VetFailure as exc:
        if exc.outcome == "rejected":
            log.warning("sibling %s rejected for this bootstrap: %s", peer, exc.reason)
            book.reject(peer)
        else:
            book.miss(peer)
        deps.tally(exc.outcome)
        return None, f"{peer}: {exc.reason}"
    if not vetted.covers_any(ranks):
        book.miss(peer)
        deps.tally("cold_peer")
        return None, f"{peer}: covers none of the pending ranks"
    stale = stale_ranks(vetted.cursors, gaps)
    if stale:
        book.stale(peer, stale)
        if not vetted.covers_any(ranks - stale):
            book.miss(peer)
            deps.tally(STALE)
            return None, f"{peer}: too old to join the stream of {_names(stale, gaps)}"
    return vetted, ""


def _summary(reasons: list[str]) -> str:
    """Why a pass's siblings gave nothing, each named: a few, then how many more (the line
    stays short in a large fleet)."""
    shown = "; ".join(reasons[:SUMMARY_REASONS])
    more = len(reasons) - SUMMARY_REASONS
    return f"{shown}; and {more} more" if more > 0 else shown


def _names(stale: Iterable[RankId], gaps: Mapping[RankId, Gapped]) -> str:
    return ", ".join(
        f"{rank} (cursor {gaps[rank].min_cursor} or later needed)" for rank in sorted(stale)
    )


def _take_fallback(book: SweepBook, deps: SweepDeps) -> SweepResult:
    """The pass's cold cover, taken: no sibling warm for the ranks answered."""
    assert book.fallback is not None
    vetted, peer = book.fallback
    book.fallback = None
    log.info(
        "no sibling whose view of the pending ranks is whole answered; grafting %s's, which "
        "it holds as cold (partial, never wrong)",
        peer,
    )
    deps.tally(FETCHED_ACCEPTED)
    return SweepResult(FOUND, vetted, peer, 1)


def _empty_ranks(body: Any) -> list[RankId]:
    """The ranks a body says it holds nothing of, as the registry spells their workers."""
    return [RankId(canonical_origin(w.url), w.dp_rank) for w in getattr(body, "empty_ranks", ())]
