"""Peer bootstrap bookkeeping: which ranks still owe a snapshot, and may the replica be ready.

Rules of this file: everything the bootstrap decides about a rank's progress (Pending,
Recovered, Failed), its incarnation, its one outcome, and about the replica's readiness
(settled, the seed gate) lives here, and nowhere else writes it. The file knows nothing about
sockets, tasks, the tree, cursors or held queues: the pump, the coordinator, the sweep and
`/readyz` call in and act on the answers. Time comes from an injected clock (monotonic
seconds). Warnings come out as `Notice`s for the caller to log; the file does no logging itself.

Theory of operation
-------------------
Two machines share one object.

**1. One machine per rank** (`RankId`). Only `register`, `set`, `retry_after_gap` and
`forget` change its state; `record_outcome` only marks the incarnation's verdict:

    state      | register            | set(RECOVERED) | set(FAILED) | retry_after_gap | forget
    -----------+---------------------+----------------+-------------+-----------------+-------
    absent     | PENDING, new epoch  | ignored        | ignored     | None            | -
    PENDING    | kept; no obligation | RECOVERED      | FAILED      | None            | absent
    RECOVERED  | kept; no obligation | RECOVERED      | FAILED      | None            | absent
    FAILED     | kept; no obligation | RECOVERED      | FAILED      | PENDING, same   | absent
               |                     |                |             | epoch; once per |
               |                     |                |             | incarnation     |

- PENDING is the only state in which the pump holds a rank's batches, so a rank enters it only
  together with an `Obligation` that the caller must hand to a sweep. `register` returns one
  for each rank it inserts. `retry_after_gap` returns one for the rank it reopens.
  `set(rank, PENDING)` would hand out none, so it raises `TrackerError`.
- The *epoch* names an incarnation. Each insert takes a fresh number from a counter, so after
  `forget` + `register` every message still carrying the old number is stale.
  `is_owed(rank, epoch)` is the gate each such message must pass: the rank is present, has the
  same epoch, and is PENDING. A gap retry keeps the epoch because it is the same incarnation
  asking again. `forget` also remembers the rank (the last `FORGOTTEN_MEMORY`), so that an
  incarnation registered after it `rejoins`: a sibling's body fetched while it was out may
  show blocks its engine dropped then, so it is swept for on its own (`router.bootstrap`).
- `set` never creates an entry. A graft or abandon racing a `forget` must not resurrect the
  rank without an epoch, or a later `register` would keep that state instead of starting over.
- Every incarnation gets exactly one *outcome* (`RankOutcome`), recorded when its verdict is
  final. `record_outcome` counts the first one and ignores any later one. It refuses (raises)
  a verdict for a rank that is still PENDING: a Pending rank has no verdict yet, and a caller
  that counts one has usually reopened the rank with a gap retry it then failed to queue. A
  gap retry is refused once the incarnation has its outcome.

**2. The readiness gate**, one per replica:

    settled()        latched, or (ranks registered and none PENDING), or now >= deadline;
                     the first True after the first registration latches
    seed_gate_open() not required, or passed, or neither "seed failed" nor "registered but no
                     sweep verdict yet"; else closed until now >= seed deadline, which
                     latches `passed` (with a notice)
    admit_ready()    settled() and seed_gate_open(); the first True latches both

- Both deadlines are armed at construction, so an idle replica still settles. The first
  non-empty `register` re-arms them once (`now + timeout`, `now + max(3 x timeout, 60 s)`), so
  slow worker discovery does not use up the budget. The re-arm is a one-shot flag, not "the
  map was empty": an engine that flaps remove/re-add empties the map on every cycle, and
  re-arming each time would hold readiness for an unbounded number of timeouts.
- Before the first registration an expired deadline makes `settled()` answer True without
  latching. Otherwise a replica whose discovery took longer than the timeout would latch at
  once and never wait for its ranks.
- `admit_ready` latches even before the first registration, because its True is meant to
  reach the world as a 200. Call it last, only when every other readiness check already
  passed. After that, a scale-up or a failed late sweep can never un-ready a serving
  replica.
- The seed gate (`--kv-bootstrap-seed-required`) closes only on `timed_out` over a
  non-empty candidate set, or while the boot sweep has not reported yet. `found` reopens it.
  `no_peers` and `fleet_cold` never close it: an unready replica leaves its own EndpointSlice,
  so a fleet booting together would each wait on siblings that wait on it.
- `enabled` never changes. It answers "may ranks bootstrap at all", which a settled tracker
  still allows (a late worker bootstraps with a full timeout). `disabled()` is settled and
  gate-passed from the start, and owes nothing: its `register` inserts no ranks.

Helpers that are not state: `per_fetch_timeout` (one fetch's bound within the bootstrap
deadline), `below_floor_warning`, `seed_gate_timeout`, and `PeerAttemptLog`, which decides the
log level of a failed peer attempt.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, NamedTuple, TypeVar

from cachetree.ranks import RankId

DEFAULT_FETCH_CAP_S: Final = 300.0
# One fetch gets at least this long, unless the deadline or the cap is shorter. It is also the
# smallest cap the CLI accepts.
PER_FETCH_FLOOR_S: Final = 30.0
# The timeout at which deadline/4 reaches the floor; the below-floor warning suggests it.
SUGGESTED_MIN_TIMEOUT_S: Final = 4 * PER_FETCH_FLOOR_S
SEED_GATE_MIN_S: Final = 60.0
# "Effectively never": an absurd or infinite timeout is clamped to this, so every deadline is a
# finite float. An int too large for a float would otherwise raise OverflowError on `now + t`.
FOREVER_S: Final = 100 * 365 * 24 * 3600.0
ATTEMPT_LOG_EVERY: Final = 100
# Forgotten ranks remembered, so that registering one again is known as a rejoin (`rejoins`);
# the oldest go first. A rank costs a few hundred bytes: bounded under workers that churn.
FORGOTTEN_MEMORY: Final = 4096

_E = TypeVar("_E", bound=StrEnum)


class TrackerError(Exception):
    """A call the tracker cannot honour: a bad setting, or an illegal transition."""


class BootstrapState(StrEnum):
    PENDING = "pending"
    RECOVERED = "recovered"
    FAILED = "failed"

    @property
    def gauge(self) -> int:
        """The value of the `kvrouter_kv_bootstrap_state` gauge."""
        return _GAUGE[self]


_GAUGE: Final = {BootstrapState.PENDING: 0, BootstrapState.RECOVERED: 1, BootstrapState.FAILED: 2}


class RankOutcome(StrEnum):
    """How one incarnation of a rank ended; the `outcome` label on the rank counter."""

    WARM = "warm"  # grafted, and a live batch or a witness proved the splice
    GAP = "gap"  # grafted, but the stream did not join the watermark (after any retry)
    WARM_UNWITNESSED = "warm_unwitnessed"  # grafted and kept with no proof either way
    UNCOVERED = "uncovered"  # the accepted snapshot had no cursor for the rank
    ABANDONED = "abandoned"  # deadline, no peers, cold fleet, or every peer holds nothing
    OVERFLOW = "overflow"  # the held queue hit its cap
    PUBLISHER_RESET = "publisher_reset"  # the publisher restarted mid-bootstrap
    TREE_REJECTED = "tree_rejected"  # the tree refused the restore
    FROM_ORIGIN = "from_origin"  # the held stream began at seq 0: nothing to inherit


class SweepOutcome(StrEnum):
    """How one bounded sweep ended; the `result` label on the sweep counter."""

    FOUND = "found"
    NO_PEERS = "no_peers"
    FLEET_COLD = "fleet_cold"
    TIMED_OUT = "timed_out"
    RANKS_RESOLVED = "ranks_resolved"


@dataclass(frozen=True, slots=True)
class Obligation:
    """The right, and the duty, to resolve one incarnation of a Pending rank."""

    rank: RankId
    epoch: int


class NoticeKind(StrEnum):
    SETTLED_WITH_PENDING = "settled_with_pending"
    SEED_GATE_EXPIRED = "seed_gate_expired"


class Notice(NamedTuple):
    """Something the caller should log at warning level; taken with `take_notices()`."""

    kind: NoticeKind
    message: str


class BootstrapTracker:
    def __init__(
        self,
        timeout_s: float,
        fetch_cap_s: float = DEFAULT_FETCH_CAP_S,
        *,
        seed_required: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout_s = _seconds("timeout_s", timeout_s)
        self._fetch_cap_s = _positive_seconds("fetch_cap_s", fetch_cap_s)
        self._seed_required = seed_required
        self._clock = clock
        self._enabled = True
        now = clock()
        self._deadline = now + self._timeout_s
        self._seed_deadline = now + seed_gate_timeout(self._timeout_s)
        self._rearmed = False  # one-shot: the first non-empty register re-arms both deadlines
        self._latched = False  # settled() stays True from here on
        self._seed_failed = False
        self._seed_gate_passed = False  # seed_gate_open() stays True from here on
        self._admitted = False
        self._states: dict[RankId, BootstrapState] = {}
        self._epochs: dict[RankId, int] = {}
        self._last_epoch = 0
        self._gap_retried: set[RankId] = set()
        self._forgotten: dict[RankId, None] = {}  # oldest first, at most FORGOTTEN_MEMORY
        self._rejoined: set[RankId] = set()  # incarnations begun after a forget of the rank
        self._verdicts: dict[RankId, RankOutcome] = {}  # this incarnation's recorded outcome
        self._rank_outcomes: Counter[RankOutcome] = Counter()
        self._sweep_outcomes: Counter[SweepOutcome] = Counter()
        self._notices: list[Notice] = []

    @classmethod
    def disabled(cls, clock: Callable[[], float] = time.monotonic) -> BootstrapTracker:
        """Peer bootstrap is off: settled and gate-passed from the start; owes nothing."""
        tracker = cls(0.0, clock=clock)
        tracker._enabled = False
        tracker._latched = True
        tracker._seed_gate_passed = True
        return tracker

    # -- settings --------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """May ranks bootstrap at all. Never changes, and stays True after settling."""
        return self._enabled

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def fetch_cap_s(self) -> float:
        return self._fetch_cap_s

    @property
    def fetch_timeout_s(self) -> float:
        """One peer fetch's bound: `per_fetch_timeout(timeout_s, fetch_cap_s)`."""
        return per_fetch_timeout(self._timeout_s, self._fetch_cap_s)

    @property
    def seed_required(self) -> bool:
        return self._seed_required

    # -- the per-rank machine --------------------------------------------------------------

    def register(self, ranks: Iterable[RankId]) -> list[Obligation]:
        """Insert each absent rank as PENDING with a fresh epoch; return obligations for those.

        A rank already present yields nothing: whoever holds its obligation owns it.
        """
        ranks = list(ranks)
        if not self._enabled or not ranks:
            return []
        if not self._rearmed:
            self._rearmed = True
            now = self._clock()
            self._deadline = now + self._timeout_s
            self._seed_deadline = now + seed_gate_timeout(self._timeout_s)
        obligations = []
        for rank in ranks:
            if rank in self._states:
                continue
            self._last_epoch += 1
            self._states[rank] = BootstrapState.PENDING
            self._epochs[rank] = self._last_epoch
            if rank in self._forgotten:
                del self._forgotten[rank]
                self._rejoined.add(rank)
            obligations.append(Obligation(rank, self._last_epoch))
        return obligations

    def forget(self, ranks: Iterable[RankId]) -> None:
        """End each rank's incarnation: state, epoch, retry allowance and outcome mark go."""
        for rank in ranks:
            if rank in self._states:
                self._forgotten.pop(rank, None)
                self._forgotten[rank] = None
                if len(self._forgotten) > FORGOTTEN_MEMORY:
                    del self._forgotten[next(iter(self._forgotten))]
            self._rejoined.discard(rank)
            self._states.pop(rank, None)
            self._epochs.pop(rank, None)
            self._gap_retried.discard(rank)
            self._verdicts.pop(rank, None)

    def set(self, rank: RankId, state: BootstrapState | str) -> bool:
        """Move a present rank to RECOVERED or FAILED; returns False for an absent rank."""
        target = _coerce(BootstrapState, state)
        if target is BootstrapState.PENDING:
            raise TrackerError(
                f"{rank}: set() cannot make a rank Pending; only register() and "
                "retry_after_gap() can, because they hand out the obligation to resolve it"
            )
        if rank not in self._states:
            return False
        self._states[rank] = target
        return True

    def retry_after_gap(self, rank: RankId) -> Obligation | None:
        """Reopen a FAILED rank once per incarnation: PENDING again, under the same epoch.

        The caller must queue the returned obligation (nothing else resolves the Pending state
        it leaves), or, if it cannot, `set(rank, FAILED)` before recording `gap`. Refused
        (None) for a rank that is absent, not FAILED, already retried, or already has its
        outcome.
        """
        if (
            self._states.get(rank) is not BootstrapState.FAILED
            or rank in self._gap_retried
            or rank in self._verdicts
        ):
            return None
        self._gap_retried.add(rank)
        self._states[rank] = BootstrapState.PENDING
        return Obligation(rank, self._epochs[rank])

    def record_outcome(self, rank: RankId, outcome: RankOutcome | str) -> bool:
        """Count the final verdict of `rank`'s current incarnation; False if not counted.

        Not counted: a second verdict for the same incarnation, or a rank that is absent (its
        incarnation is gone). Raises for a PENDING rank, which has no final verdict.
        """
        outcome = _coerce(RankOutcome, outcome)
        state = self._states.get(rank)
        if state is None or rank in self._verdicts:
            return False
        if state is BootstrapState.PENDING:
            raise TrackerError(f"{rank}: cannot record {outcome.value!r} while it is Pending")
        self._verdicts[rank] = outcome
        self._rank_outcomes[outcome] += 1
        return True

    # -- per-rank queries ------------------------------------------------------------------

    def state(self, rank: RankId) -> BootstrapState | None:
        return self._states.get(rank)

    def epoch(self, rank: RankId) -> int | None:
        return self._epochs.get(rank)

    def rejoins(self, rank: RankId) -> bool:
        """Whether the rank's incarnation began after this replica forgot it (a worker removed
        or evicted, then registered again; remembered for the last `FORGOTTEN_MEMORY`)."""
        return rank in self._rejoined

    def is_pending(self, rank: RankId) -> bool:
        return self._states.get(rank) is BootstrapState.PENDING

    def is_owed(self, rank: RankId, epoch: int) -> bool:
        """May a message for incarnation `epoch` of `rank` still act on it?"""
        return self._epochs.get(rank) == epoch and self.is_pending(rank)

    def still_owed(self, obligations: Iterable[Obligation]) -> list[Obligation]:
        """The obligations that pass `is_owed`, in order, each incarnation once."""
        seen: set[Obligation] = set()
        kept = []
        for o in obligations:
            if o not in seen and self.is_owed(o.rank, o.epoch):
                seen.add(o)
                kept.append(o)
        return kept

    def any_pending(self) -> bool:
        return BootstrapState.PENDING in self._states.values()

    def pending_count(self) -> int:
        return sum(1 for s in self._states.values() if s is BootstrapState.PENDING)

    def recorded_outcome(self, rank: RankId) -> RankOutcome | None:
        """The outcome counted for the rank's current incarnation, if any."""
        return self._verdicts.get(rank)

    def states(self) -> dict[RankId, BootstrapState]:
        """A copy of every rank's state, for the state gauge."""
        return dict(self._states)

    # -- readiness -------------------------------------------------------------------------

    def settled(self) -> bool:
        """Is every registered rank terminal, or has the deadline passed? Latches (see top)."""
        if self._latched:
            return True
        pending = self.pending_count()
        all_terminal = bool(self._states) and pending == 0
        expired = self._clock() >= self._deadline
        if not (all_terminal or expired):
            return False
        if not self._rearmed:
            return True  # expired before any registration: do not latch (see top)
        self._latched = True
        if pending:
            self._notices.append(
                Notice(
                    NoticeKind.SETTLED_WITH_PENDING,
                    f"kv-bootstrap: the {self._timeout_s:g} s deadline passed with {pending} "
                    "rank(s) still pending; serving with a partly warmed tree",
                )
            )
        return True

    def time_remaining(self) -> float:
        """Seconds until the readiness deadline; 0 once it has passed."""
        return max(0.0, self._deadline - self._clock())

    def record_sweep_result(self, outcome: SweepOutcome | str, peers_tried: int) -> None:
        """Count one sweep's verdict, and let it move the seed gate.

        `peers_tried` is the size of the candidate set the verdict was reached over. `timed_out`
        over a non-empty set fails the seed. Over an empty one it is only a discovery race.
        `found` clears a failed seed. Nothing else moves it.
        """
        outcome = _coerce(SweepOutcome, outcome)
        if peers_tried < 0:
            raise TrackerError(f"peers_tried must be >= 0, got {peers_tried}")
        self._sweep_outcomes[outcome] += 1
        if outcome is SweepOutcome.TIMED_OUT and peers_tried > 0:
            self._seed_failed = True
        elif outcome is SweepOutcome.FOUND:
            self._seed_failed = False

    @property
    def seed_failed(self) -> bool:
        """Did the last sweep that decided it fail the seed (the seed-failed gauge)."""
        return self._seed_failed

    def seed_gate_open(self) -> bool:
        """May readiness proceed as far as the seed goes? Latches on the hard bound (see top)."""
        if not self._seed_required or self._seed_gate_passed:
            return True
        verdict_pending = self._rearmed and not self._sweep_outcomes
        if not (self._seed_failed or verdict_pending):
            return True
        if self._clock() < self._seed_deadline:
            return False
        self._seed_gate_passed = True
        self._notices.append(
            Notice(
                NoticeKind.SEED_GATE_EXPIRED,
                "kv-bootstrap: the seed-required gate expired after "
                f"{seed_gate_timeout(self._timeout_s):g} s with no usable peer snapshot; "
                "serving cache-blind rather than staying unready",
            )
        )
        return True

    def admit_ready(self) -> bool:
        """`settled() and seed_gate_open()`; the first True latches both (see top)."""
        if self._admitted:
            return True
        if not (self.settled() and self.seed_gate_open()):
            return False
        self._admitted = self._latched = self._seed_gate_passed = True
        return True

    # -- tallies and notices ---------------------------------------------------------------

    @property
    def rank_outcomes(self) -> Counter[RankOutcome]:
        """A copy of the per-rank outcome counts."""
        return Counter(self._rank_outcomes)

    @property
    def sweep_outcomes(self) -> Counter[SweepOutcome]:
        """A copy of the per-sweep verdict counts."""
        return Counter(self._sweep_outcomes)

    def take_notices(self) -> list[Notice]:
        """The warnings raised since the last call, oldest first; each is returned once."""
        notices, self._notices = self._notices, []
        return notices


# -- helpers ------------------------------------------------------------------------------


def per_fetch_timeout(timeout_s: float, cap_s: float = DEFAULT_FETCH_CAP_S) -> float:
    """The bound on one peer fetch, given the configured bootstrap timeout (not what remains).

    clamp(timeout / 4, lo, cap) with lo = min(30 s, timeout / 2, cap): a quarter of the budget,
    so one hung peer cannot use up the sweep, but never less than 30 s unless the budget or the
    cap is shorter. The timeout / 2 term keeps every fetch shorter than a short deadline. A zero
    timeout (bootstrap settles at once, and later workers sweep with no budget to share) gets
    the 30 s floor, still under the cap.
    """
    timeout_s = _seconds("timeout_s", timeout_s)
    cap_s = _positive_seconds("cap_s", cap_s)
    if timeout_s == 0:
        return min(PER_FETCH_FLOOR_S, cap_s)
    lo = min(PER_FETCH_FLOOR_S, timeout_s / 2, cap_s)
    return min(max(timeout_s / 4, lo), cap_s)


def below_floor_warning(timeout_s: float, cap_s: float, *, enabled: bool = True) -> bool:
    """Should the sweep warn (once) that one fetch gets less than the 30 s floor?

    Raising the cap does not help. Raising the timeout to `SUGGESTED_MIN_TIMEOUT_S` does.
    """
    return enabled and per_fetch_timeout(timeout_s, cap_s) < PER_FETCH_FLOOR_S


def seed_gate_timeout(timeout_s: float) -> float:
    """The seed gate's hard bound: max(3 x timeout, 60 s)."""
    return max(3 * _seconds("timeout_s", timeout_s), SEED_GATE_MIN_S)


class LogDecision(NamedTuple):
    level: int  # logging.INFO or logging.DEBUG
    attempts: int  # failed attempts against this peer with this outcome, this one included


class PeerAttemptLog:
    """Decides the log level of each failed fetch from a peer, per (peer, outcome).

    INFO on the first attempt, on every 100th, and whenever the error detail differs from the
    previous attempt's. DEBUG otherwise. A sweep retries an unreachable peer every few hundred
    milliseconds, so logging each miss at info would bury everything else. Still, progress stays
    visible at the default level, and a new cause under the same outcome (refused turning into
    a DNS failure, 404 into 503) is news rather than a repeat.
    """

    __slots__ = ("_logs",)

    def __init__(self) -> None:
        self._logs: dict[tuple[str, str], tuple[int, str]] = {}  # -> (attempts, last detail)

    def attempt(self, peer: str, outcome: str, detail: str = "") -> LogDecision:
        attempts, last_detail = self._logs.get((peer, outcome), (0, detail))
        attempts += 1
        self._logs[(peer, outcome)] = (attempts, detail)
        surface = attempts == 1 or attempts % ATTEMPT_LOG_EVERY == 0 or detail != last_detail
        return LogDecision(logging.INFO if surface else logging.DEBUG, attempts)

    def forget_peer(self, peer: str) -> None:
        """Drop a peer's counts (it left the registry); a return starts again at attempt 1."""
        for key in [k for k in self._logs if k[0] == peer]:
            del self._logs[key]


def _seconds(name: str, value: float) -> float:
    if isinstance(value, float) and math.isnan(value):
        raise TrackerError(f"{name} is NaN")
    if value < 0:
        raise TrackerError(f"{name} must be >= 0, got {value}")
    return float(min(value, FOREVER_S))


def _positive_seconds(name: str, value: float) -> float:
    seconds = _seconds(name, value)
    if seconds == 0:
        raise TrackerError(f"{name} must be > 0")
    return seconds


def _coerce(kind: type[_E], value: _E | str) -> _E:
    try:
        return kind(value)
    except ValueError:
        raise TrackerError(f"{value!r} is not a {kind.__name__}") from None
