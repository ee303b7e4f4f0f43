"""The pump's bootstrap contract under random interleavings (hypothesis state machine).

Reference-bootstrap.md sections 2.4, 5 and 13; the reference's
`property_bootstrap_contract_holds_under_random_interleavings`, widened.

What runs
---------
The REAL `IndexRules` + `BootstrapRules` + `BootstrapTracker`, wired as `Rig` in
test_graft.py does: a fake clock, and a gap-retry callback that records each obligation it is
handed and accepts or refuses it by a drawn boolean. 1-3 ranks; the held-queue cap is drawn
(2, 3, 5 or the real 1024) so that overflow happens.

Each rank has a simulated engine: a dense stream of batches (seq 0, 1, 2, ... per engine
incarnation) of `BlockStored` of fresh blocks (engine hash = block id, unique per rank; a root
or a chain under a block the engine holds), `BlockRemoved` of leaf blocks the engine holds, and
rarely `AllBlocksCleared`. A batch is delivered now, queued in flight (delivered later, in
order) or lost (its seq consumed, never delivered). An engine restart empties its cache and
starts again at seq 0, optionally announced by END_SEQ (`PublisherReset`, in stream order).
Delivery goes through the real `SequenceTracker`, as `RankSubscriber` does (a regression to a
non-zero seq puts a `PublisherReset` first), or, in "raw" examples, straight to the pump, so
the pump's own regression rules are reached too.

Other operations: graft a sibling's snapshot (`apply_snapshot`) for outstanding obligations
(the coordinator's one message for them) or for stale ones (any obligation ever minted); the
sibling is a `LocalGraft` rebuilt from the engine's history at a watermark behind, at, or
ahead of what the pump holds, and it may not know a rank (no cursor). Abandon (outstanding or
stale obligations). Splice-probe verdicts for the proofs `due_proofs` hands out, and stale
ones. Forget a rank (tracker first, then the pump, with an item possibly applied between, as
`WorkerRegistry.remove` does) and register it again (a new subscriber: what was in flight is
lost). Time passes. Sweep verdicts reach the seed gate.

Properties
----------
Checked after every item handed to the pump and every control call, except P1's final part.

P1 Pending is always owed and always left. A Pending rank carries nothing in the tree, has no
   cursor, and some obligation for its current epoch is outstanding (minted by `register` or
   by an accepted gap retry, and not yet consumed by a graft or abandon message). Only a
   Pending rank has held batches. At the end of the run, abandoning every outstanding
   obligation (queued retries included) leaves no rank Pending; three `unknown` probes per
   open proof then leave every registered rank with its outcome.

P2 Outcomes. Every registered rank is in exactly one of: Pending, holding a proof (Recovered,
   same epoch, cursor = watermark), or settled with its incarnation's one outcome. That
   outcome never changes within the incarnation, and the tracker's counters equal the model's
   sum of one outcome per incarnation. A gap retry is asked for at most once per incarnation;
   when granted the rank is Pending with no outcome and an empty tree; when refused it is
   Failed with `gap`. Each outcome appears only on the step that justifies it; in particular
   `warm` only when
     - a graft found a held batch at or below `watermark + 1` (the held stream joins), or
     - the first live batch after a deferred graft had `1 <= seq <= watermark + 1`, or
     - a probe reported `no_advance` for the rank's proof (same epoch and watermark).
   `tree_rejected` never happens (a LocalGraft of a consistent engine always fits).

P3 Readiness latches: once `settled()` or `admit_ready()` has answered True it always does.
   When ranks are registered and none is Pending, `settled()` is True.

P4 Safety (run cold, never wrong). For every rank, let T be the blocks the tree says it
   carries (found by key and engine hash), C the engine's current cache, and D the batches
   handed to the pump during the rank's current registration. Then:
     (a) T contains no block the rank's engine never stored, and only blocks that reached the
         pump legitimately: stored by a batch in D, or carried by a graft the rank was owed;
     (b) every block of T not in C was removed by a batch NOT in D (lost, still in flight,
         or published before this registration), or by an engine restart the pump was never
         shown (neither that restart's END_SEQ / a regression reset, nor a batch 0 of it or a
         later incarnation, is in D).
   So the only stale blocks are those of lost batches, which is the accepted degradation the
   pump counts in `stats.lost_batches` (or leaves to a pending splice proof). A graft whose
   watermark is stale must never let a delivered removal be filtered out as "already
   reflected", and a graft must never land on a rank it was not owed.
   A rank that is not live carries nothing, and has no cursor, held queue or proof.

Coverage: `hypothesis.event()` labels each interesting path, and the test asserts that gaps,
granted and refused retries, overflow, origin resolution, publisher resets, stale grafts and
each probe verdict all happened across the run.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachetree.keys import block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from peer.tracker import BootstrapState, BootstrapTracker, Obligation, RankOutcome, SweepOutcome
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from router.graft import HELD_QUEUE_CAP, MAX_UNKNOWN_PROBES, BootstrapRules, LocalGraft
from router.index import IndexRules, apply_events
from router.subscriber import LiveBatch, PublisherReset, SequenceTracker, Step, UnrepairedGap

BS = 2
TIMEOUT_S = 60.0
PROOF_TIMEOUT_S = 30.0
RANKS = [RankId("http://w", i) for i in range(3)]
PENDING, RECOVERED, FAILED = BootstrapState.PENDING, BootstrapState.RECOVERED, BootstrapState.FAILED
WARM = RankOutcome.WARM

# Paths reached across the whole run, asserted on at the end of the test.
COVERAGE: Counter[str] = Counter()


def note(label: str) -> None:
    COVERAGE[label] += 1
    event(label)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(block: int) -> list[int]:
    return [block * BS + i for i in range(BS)]


# -- the simulated engine -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sent:
    """A published batch: engine incarnation, seq, payload, and the blocks it stored."""

    inc: int
    seq: int
    batch: EventBatch
    stored: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EndSeq:
    """END_SEQ of a publisher that restarted into incarnation `restart`."""

    restart: int


class Engine:
    """One rank's engine: its cache, its publisher's history, and what is in flight."""

    def __init__(self) -> None:
        self.inc = 0
        self.seq_next = 0
        self.cache: dict[int, int | None] = {}  # block -> parent block, in store order
        self.children: Counter[int] = Counter()
        self.history: list[list[KVEvent]] = []  # this incarnation's batches, by seq
        self.keys: dict[int, int] = {}  # every block ever stored -> its chained key
        # Why a block left the cache: ("batch", inc, seq) or ("restart", new inc).
        self.removed_at: dict[int, tuple[Any, ...]] = {}
        self.next_id = 1
        self.inflight: deque[Sent | EndSeq] = deque()

    def emit(self, plan: list[tuple[str, int, int]]) -> Sent:
        seq = self.seq_next
        events: list[KVEvent] = []
        stored: list[int] = []
        for kind, n, sel in plan:
            leaves = [b for b in self.cache if not self.children[b]]
            if kind == "remove" and leaves:
                start = sel % len(leaves)
                gone = (leaves[start:] + leaves[:start])[:n]
                for b in gone:
                    parent = self.cache.pop(b)
                    if parent is not None:
                        self.children[parent] -= 1
                    self.removed_at[b] = ("batch", self.inc, seq)
                events.append(BlockRemoved(gone, None, None))
            elif kind == "clear":
                for b in self.cache:
                    self.removed_at[b] = ("batch", self.inc, seq)
                self.cache.clear()
                self.children.clear()
                events.append(AllBlocksCleared())
            else:
                cached = list(self.cache)
                parent = cached[sel % len(cached)] if cached and sel % 3 else None
                ids = list(range(self.next_id, self.next_id + n))
                self.next_id += n
                toks = [t for b in ids for t in tokens(b)]
                seed = namespace_seed(None) if parent is None else self.keys[parent]
                for b, key, above in zip(ids, block_keys(toks, BS, seed), [parent, *ids]):
                    self.keys[b] = key
                    self.cache[b] = above
                    if above is not None:
                        self.children[above] += 1
                stored += ids
                events.append(BlockStored(ids, parent, toks, BS, DEVICE, "GPU", None))
        self.seq_next += 1
        self.history.append(events)
        return Sent(self.inc, seq, EventBatch(0.0, events, 0), tuple(stored))

    def restart(self) -> None:
        self.inc += 1
        for b in self.cache:
            self.removed_at[b] = ("restart", self.inc)
        self.cache.clear()
        self.children.clear()
        self.seq_next = 0
        self.history = []


# -- the router side of the model ---------------------------------------------------------


@dataclass(slots=True)
class View:
    """What the model knows about one rank's current registration in the router."""

    live: bool = False
    delivered: set[tuple[int, int]] = field(default_factory=set)  # (inc, seq) handed over
    restart_seen: int = -1  # the newest engine restart shown to the pump
    introduced: set[int] = field(default_factory=set)  # blocks that reached the pump
    sub: SequenceTracker = field(default_factory=SequenceTracker)
    epoch: int | None = None
    verdict: RankOutcome | None = None


@dataclass(frozen=True, slots=True)
class Before:
    """One rank, just before a step."""

    live: bool
    state: BootstrapState | None
    epoch: int | None
    verdict: RankOutcome | None
    proof: tuple[int, int, int] | None  # (watermark, epoch, unknown probes)
    held: tuple[int, ...]


EVENT = st.tuples(
    st.sampled_from(["store", "store", "store", "store", "remove", "remove", "remove", "clear"]),
    st.integers(1, 2),
    st.integers(0, 7),
)
PLAN = st.lists(EVENT, min_size=1, max_size=2)
RANK = st.integers(0, 2)
MARK = st.one_of(st.integers(0, 6), st.none())  # watermark: steps back from the newest seq


class BootstrapMachine(RuleBasedStateMachine):
    @initialize(
        n=st.integers(1, 3),
        cap=st.sampled_from([2, 3, 5, HELD_QUEUE_CAP]),
        raw=st.booleans(),
        seed_required=st.booleans(),
        warm_engines=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    )
    def setup(
        self, n: int, cap: int, raw: bool, seed_required: bool, warm_engines: list[int]
    ) -> None:
        self.clock = Clock()
        self.tracker = BootstrapTracker(TIMEOUT_S, seed_required=seed_required, clock=self.clock)
        self.index = IndexRules(BlockTree(BS))
        self.rules = BootstrapRules(self.index, self.tracker, self._enqueue, self.clock, cap)
        self.index.bootstrap = self.rules
        self.cap = cap
        self.raw = raw
        self.ranks = RANKS[:n]
        self.engines = {r: Engine() for r in self.ranks}
        self.views = {r: View() for r in self.ranks}
        self.outstanding: list[Obligation] = []  # messages the coordinator still owes
        self.minted: list[Obligation] = []
        self.retry_accept = True
        self.retries: list[tuple[Obligation, bool]] = []
        self.retried: set[Obligation] = set()
        self.counts: Counter[RankOutcome] = Counter()
        self.was_settled = self.was_admitted = False
        # The engines ran before this replica: their history was published to nobody.
        for r, k in zip(self.ranks, warm_engines, strict=False):
            for _ in range(k):
                self.engines[r].emit([("store", 1, 0)])
        self._register(self.ranks)
        if raw:
            note("raw subscriber")
        if cap < HELD_QUEUE_CAP:
            note(f"held cap {cap}")

    # -- plumbing --------------------------------------------------------------------------

    def _enqueue(self, ob: Obligation) -> bool:
        """The coordinator's queue: runs inside the pump, in the middle of a gap resolution."""
        assert self.tracker.is_pending(ob.rank), "a retry handed out for a rank not Pending"
        assert self.tracker.epoch(ob.rank) == ob.epoch, "a retry under a different epoch"
        assert ob not in self.retried, f"a second gap retry for the incarnation {ob}"
        self.retried.add(ob)
        self.retries.append((ob, self.retry_accept))
        if self.retry_accept:
            self.outstanding.append(ob)
        return self.retry_accept

    def _rank(self, i: int) -> RankId:
        return self.ranks[i % len(self.ranks)]

    def _register(self, ranks: list[RankId]) -> None:
        # WorkerRegistry._register: the tracker first, then the pump, then a new subscriber.
        obligations = self.tracker.register(ranks)
        self.index.add_ranks(ranks)
        assert sorted(o.rank for o in obligations) == sorted(ranks)
        self.outstanding += obligations
        self.minted += obligations
        for o in obligations:
            self.views[o.rank] = View(live=True, epoch=o.epoch)
            self.engines[o.rank].inflight.clear()  # published before we subscribed: lost
        self._check()

    def _snap(self) -> dict[RankId, Before]:
        out = {}
        for r in self.ranks:
            proof = self.rules.proofs.get(r)
            out[r] = Before(
                live=r in self.index.live,
                state=self.tracker.state(r),
                epoch=self.tracker.epoch(r),
                verdict=self.tracker.recorded_outcome(r),
                proof=None
                if proof is None
                else (proof.watermark, proof.epoch, proof.unknown_probes),
                held=tuple(h.seq for h in self.rules.held.get(r, ())),
            )
        return out

    def _step(self, step: tuple[Any, ...], call: Any) -> None:
        """Run one pump call and check every property against the state just before it."""
        before = self._snap()
        retries_before = len(self.retries)
        call()
        for r in self.ranks:
            b = before[r]
            assert self.tracker.epoch(r) == b.epoch, "a pump step changed an epoch"
            now = self.tracker.recorded_outcome(r)
            if b.verdict is not None:
                assert now == b.verdict, f"{r}: outcome {b.verdict} became {now}"
            elif now is not None:
                self.counts[now] += 1
                self.views[r].verdict = now
                self._justify(r, now, step, b)
                note(f"outcome {now.value} on {step[0]}")
        assert self.tracker.rank_outcomes == self.counts, "an outcome counted twice"
        for ob, accepted in self.retries[retries_before:]:
            if accepted:
                note(f"gap retry granted on {step[0]}")
                assert self.tracker.is_pending(ob.rank)
                assert self.tracker.recorded_outcome(ob.rank) is None
            else:
                note(f"gap retry refused on {step[0]}")
                assert self.tracker.state(ob.rank) is FAILED
                assert self.tracker.recorded_outcome(ob.rank) is RankOutcome.GAP
        if step[0] == "graft":
            self._check_graft(step, before)
        self._check()

    def _justify(self, r: RankId, outcome: RankOutcome, step: tuple[Any, ...], b: Before) -> None:
        """P2: the outcome appeared on a step that justifies it."""
        kind = step[0]
        why = f"{r}: {outcome.value} recorded on {step} from {b}"
        assert outcome is not RankOutcome.TREE_REJECTED, why
        if kind in ("live", "reset"):
            assert step[1] == r, why
        if kind == "live":
            seq = step[2]
            if b.proof is not None:
                wm = b.proof[0]
                if outcome is WARM:
                    assert 1 <= seq <= wm + 1, why  # batch 0 proves a restart, not a splice
                    note("warm on the deferred path")
                else:
                    assert outcome is RankOutcome.GAP and seq > wm + 1, why
                return
            assert b.state is PENDING, why
            if outcome is RankOutcome.FROM_ORIGIN:
                assert seq == 0, why
            elif outcome is RankOutcome.PUBLISHER_RESET:
                assert b.held and seq < b.held[-1] and seq != 0, why
                note("publisher_reset from a regression in the pump")
            else:
                assert outcome is RankOutcome.OVERFLOW and len(b.held) >= self.cap, why
        elif kind == "reset":
            assert outcome is RankOutcome.PUBLISHER_RESET, why
            assert b.state is PENDING or b.proof is not None, why
        elif kind in ("graft", "abandon"):
            owed = b.live and b.state is PENDING and Obligation(r, b.epoch) in step[1]
            assert owed, why
            if kind == "abandon":
                assert outcome is RankOutcome.ABANDONED, why
                return
            wm = step[2].get(r)
            if wm is None:
                assert outcome is RankOutcome.UNCOVERED, why
            elif outcome is WARM:
                assert b.held and b.held[0] <= wm + 1, why
                note("warm on the held path")
            else:
                assert outcome is RankOutcome.GAP and b.held and b.held[0] > wm + 1, why
        elif kind == "probe":
            _, rank, epoch, wm, verdict = step
            assert rank == r and b.proof is not None and b.proof[:2] == (wm, epoch), why
            expected = {"advanced": RankOutcome.GAP, "no_advance": WARM}.get(verdict)
            if expected is None:
                assert b.proof[2] + 1 >= MAX_UNKNOWN_PROBES, why
                expected = RankOutcome.WARM_UNWITNESSED
            assert outcome is expected, why
        else:
            raise AssertionError(why)

    def _check_graft(self, step: tuple[Any, ...], before: dict[RankId, Before]) -> None:
        _, obligations, cursors = step
        for r in self.ranks:
            b = before[r]
            if not (b.live and b.state is PENDING and Obligation(r, b.epoch) in obligations):
                continue
            wm = cursors.get(r)
            if wm is not None and not b.held:
                note("deferred proof")
                proof = self.rules.proofs.get(r)
                assert proof is not None and proof.watermark == wm, f"{r}: no proof at {wm}"
                assert self.tracker.state(r) is RECOVERED and self.index.cursors[r] == wm

    def _check(self) -> None:
        """P1, P2 (states) and P4 after any step."""
        owed = {o for o in self.outstanding}
        for r in self.ranks:
            v = self.views[r]
            assert (r in self.index.live) == v.live
            state = self.tracker.state(r)
            blocks = self.index.tree.block_count(r)
            if not v.live:
                assert state is None and blocks == 0 and r not in self.index.cursors
                assert r not in self.rules.held and r not in self.rules.proofs
                continue
            proof = self.rules.proofs.get(r)
            verdict = self.tracker.recorded_outcome(r)
            assert state is not None
            assert (state is PENDING) + (proof is not None) + (verdict is not None) == 1, (
                f"{r}: state {state}, proof {proof}, outcome {verdict}"
            )
            if state is PENDING:
                assert blocks == 0 and r not in self.index.cursors, f"{r}: Pending, not empty"
                assert Obligation(r, self.tracker.epoch(r)) in owed, f"{r}: Pending, unowed"
            if proof is not None:
                assert state is RECOVERED and proof.epoch == self.tracker.epoch(r)
                assert self.index.cursors.get(r) == proof.watermark
            if r in self.rules.held:
                assert self.rules.held[r] and state is PENDING, f"{r}: held while {state}"
            self._check_safety(r)

    def _check_safety(self, r: RankId) -> None:
        """P4 for one live rank."""
        eng, v, tree = self.engines[r], self.views[r], self.index.tree
        carried = []
        for b, key in eng.keys.items():
            eh = tree.engine_hash(r, key)
            if eh is not None:
                assert eh == b, f"{r}: block {b} carried under engine hash {eh}"
                carried.append(b)
        assert tree.block_count(r) == len(carried), f"{r}: carries blocks its engine never made"
        for b in carried:
            assert b in v.introduced, f"{r}: block {b} reached the tree by no owed path"
            if b in eng.cache:
                continue
            why = eng.removed_at[b]
            if why[0] == "batch":
                shown = (why[1], why[2]) in v.delivered
            else:
                shown = why[1] <= v.restart_seen
            assert not shown, (
                f"{r}: the tree still carries block {b}, removed by {why}, which the pump was "
                f"shown (cursor {self.index.cursors.get(r)}, state {self.tracker.state(r)})"
            )
            note("stale block excused: its removal was never delivered")

    # -- delivery --------------------------------------------------------------------------

    def _deliver_head(self, r: RankId) -> None:
        eng, v = self.engines[r], self.views[r]
        item = eng.inflight.popleft()
        if not v.live:
            # A subscriber still draining after the worker was removed.
            dropped = self.index.stats.batches_dropped_not_live
            if isinstance(item, Sent):
                self.index.handle(LiveBatch(r, item.seq, item.batch))
            else:
                self.index.handle(PublisherReset(r))
            assert self.index.stats.batches_dropped_not_live == dropped + 1
            note("item for a forgotten rank dropped")
            self._check()
            return
        if isinstance(item, EndSeq):
            v.sub.end()
            v.restart_seen = max(v.restart_seen, item.restart)
            note("END_SEQ delivered")
            self._step(("reset", r), lambda: self.index.handle(PublisherReset(r)))
            return
        if not self.raw:
            verdict = v.sub.advance(item.seq)
            if verdict.step is Step.RESET:
                v.restart_seen = max(v.restart_seen, item.inc)
                note("regression reset by the subscriber")
                self._step(("reset", r), lambda: self.index.handle(PublisherReset(r)))
            elif verdict.step is Step.GAP:
                gap = UnrepairedGap(r, verdict.missing_first, verdict.missing_last)
                self._step(("unrepaired", r), lambda: self.index.handle(gap))
        v.delivered.add((item.inc, item.seq))
        v.introduced.update(item.stored)
        if item.seq == 0:
            v.restart_seen = max(v.restart_seen, item.inc)
        lost = self.index.stats.lost_batches[r]
        restarts = self.index.stats.restarts_at_zero
        self._step(
            ("live", r, item.seq),
            lambda: self.index.handle(LiveBatch(r, item.seq, item.batch)),
        )
        if self.index.stats.lost_batches[r] > lost:
            note("lost batches counted by the pump")
        if self.index.stats.restarts_at_zero > restarts:
            note("restart at seq 0 behind a cursor")

    # -- rules -----------------------------------------------------------------------------

    @rule(
        i=RANK,
        plan=PLAN,
        fate=st.sampled_from(["deliver", "deliver", "queue", "lose"]),
        accept=st.booleans(),
    )
    def emit(self, i: int, plan: list[tuple[str, int, int]], fate: str, accept: bool) -> None:
        r = self._rank(i)
        eng = self.engines[r]
        sent = eng.emit(plan)
        if fate == "lose":
            note("batch lost")
            return
        eng.inflight.append(sent)
        if fate == "deliver":
            self.retry_accept = accept
            while eng.inflight:
                self._deliver_head(r)

    @precondition(lambda self: any(e.inflight for e in self.engines.values()))
    @rule(i=RANK, n=st.integers(1, 3), lose=st.booleans(), accept=st.booleans())
    def deliver_in_flight(self, i: int, n: int, lose: bool, accept: bool) -> None:
        r = next(r for r in self.ranks[i % len(self.ranks) :] + self.ranks if self._busy(r))
        eng = self.engines[r]
        if lose:
            eng.inflight.popleft()
            note("in-flight item lost")
            return
        self.retry_accept = accept
        for _ in range(min(n, len(eng.inflight))):
            self._deliver_head(r)

    def _busy(self, r: RankId) -> bool:
        return bool(self.engines[r].inflight)

    @rule(i=RANK, announce=st.booleans())
    def restart_engine(self, i: int, announce: bool) -> None:
        r = self._rank(i)
        eng = self.engines[r]
        eng.restart()
        if announce:
            eng.inflight.append(EndSeq(eng.inc))
        note("engine restarted" + (" with END_SEQ" if announce else " silently"))

    def _pick(self, picks: list[int], stale: bool) -> list[Obligation]:
        if stale or not self.outstanding:
            return [self.minted[p % len(self.minted)] for p in picks]
        chosen = sorted({p % len(self.outstanding) for p in picks}, reverse=True)
        return [self.outstanding.pop(k) for k in chosen]

    @rule(
        picks=st.lists(st.integers(0, 15), min_size=1, max_size=3),
        stale=st.booleans(),
        marks=st.lists(MARK, min_size=3, max_size=3),
        accept=st.booleans(),
    )
    def graft(
        self, picks: list[int], stale: bool, marks: list[int | None], accept: bool
    ) -> None:
        obligations = self._pick(picks, stale)
        sibling = BlockTree(BS)
        cursors: dict[RankId, int] = {}
        for r, back in zip(self.ranks, marks, strict=False):
            eng = self.engines[r]
            if back is None or eng.seq_next == 0:
                continue
            wm = max(0, eng.seq_next - 1 - back)
            for events in eng.history[: wm + 1]:
                apply_events(sibling, r, events)
            cursors[r] = wm
        before = self._snap()
        for r in self.ranks:
            b = before[r]
            if b.live and b.state is PENDING and Obligation(r, b.epoch) in obligations:
                note("graft for an owed rank" + ("" if r in cursors else " it does not cover"))
                if r in cursors:
                    self._classify(r, cursors[r], b)
                    v = self.views[r]
                    for blk, key in self.engines[r].keys.items():
                        if sibling.engine_hash(r, key) == blk:
                            v.introduced.add(blk)
            elif any(o.rank == r for o in obligations):
                note("graft for a rank not owed: ignored")
        self.retry_accept = accept
        graft = LocalGraft(sibling, cursors)
        self._step(
            ("graft", frozenset(obligations), cursors),
            lambda: self.rules.apply_snapshot(obligations, graft),
        )

    def _classify(self, r: RankId, wm: int, b: Before) -> None:
        if not b.held:
            return
        if b.held[0] > wm + 1:
            note("graft behind the held stream (gap)")
        elif b.held[-1] <= wm:
            note("graft ahead of everything held")
        else:
            note("graft splices into the held stream")

    @rule(picks=st.lists(st.integers(0, 15), min_size=1, max_size=3), stale=st.booleans())
    def abandon(self, picks: list[int], stale: bool) -> None:
        obligations = self._pick(picks, stale)
        self._step(
            ("abandon", frozenset(obligations)), lambda: self.rules.abandon(obligations)
        )

    @rule(data=st.data(), due_after=st.sampled_from([0.0, PROOF_TIMEOUT_S]), accept=st.booleans())
    def probe(self, data: st.DataObject, due_after: float, accept: bool) -> None:
        self.retry_accept = accept
        for rank, wm, epoch in self.rules.due_proofs(due_after):
            verdict = data.draw(st.sampled_from(["unknown", "no_advance", "advanced"]))
            note(f"probe {verdict}")
            self._step(
                ("probe", rank, epoch, wm, verdict),
                lambda rank=rank, wm=wm, epoch=epoch, verdict=verdict: self.rules.probe_verdict(
                    rank, epoch, wm, verdict
                ),
            )

    @rule(
        i=RANK,
        epoch_pick=st.integers(0, 15),
        wm=st.integers(0, 8),
        verdict=st.sampled_from(["unknown", "no_advance", "advanced"]),
        accept=st.booleans(),
    )
    def stale_probe(self, i: int, epoch_pick: int, wm: int, verdict: str, accept: bool) -> None:
        r = self._rank(i)
        epoch = self.minted[epoch_pick % len(self.minted)].epoch
        self.retry_accept = accept
        self._step(
            ("probe", r, epoch, wm, verdict), lambda: self.rules.probe_verdict(r, epoch, wm, verdict)
        )

    @precondition(lambda self: any(v.live for v in self.views.values()))
    @rule(i=RANK, between=st.booleans())
    def forget(self, i: int, between: bool) -> None:
        r = next(r for r in self.ranks[i % len(self.ranks) :] + self.ranks if self.views[r].live)
        # WorkerRegistry.remove: the tracker first, then the pump; the pump may apply an item
        # in between (the rank is live there and unknown to the tracker).
        self.tracker.forget([r])
        eng = self.engines[r]
        if between and eng.inflight:
            item = eng.inflight.popleft()
            if isinstance(item, Sent):
                self.index.handle(LiveBatch(r, item.seq, item.batch))
            else:
                self.index.handle(PublisherReset(r))
            note("item applied between tracker.forget and forget_ranks")
        self.index.forget_ranks([r])
        self.views[r] = View(live=False)
        note("rank forgotten")
        self._check()

    @precondition(lambda self: any(not v.live for v in self.views.values()))
    @rule(i=RANK)
    def register(self, i: int) -> None:
        ranks = self.ranks[i % len(self.ranks) :] + self.ranks
        r = next(r for r in ranks if not self.views[r].live)
        note("rank registered again")
        self._register([r])

    @rule(dt=st.sampled_from([0.5, 5.0, 31.0, 61.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule(outcome=st.sampled_from(list(SweepOutcome)), peers=st.integers(0, 2))
    def sweep_verdict(self, outcome: SweepOutcome, peers: int) -> None:
        self.tracker.record_sweep_result(outcome, peers)

    # -- P3 --------------------------------------------------------------------------------

    @invariant()
    def readiness_latches(self) -> None:
        if not hasattr(self, "tracker"):
            return
        settled = self.tracker.settled()
        admitted = self.tracker.admit_ready()
        assert settled or not self.was_settled, "settled() un-latched"
        assert admitted or not self.was_admitted, "admit_ready() un-latched"
        states = self.tracker.states()
        if states and PENDING not in states.values():
            assert settled, "every rank is terminal, yet not settled"
        if settled and not self.was_settled:
            note("settled")
        if admitted and not self.was_admitted:
            note("admitted")
        self.was_settled |= settled
        self.was_admitted |= admitted

    # -- P1, at the end --------------------------------------------------------------------

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None or not hasattr(self, "tracker"):
            return  # a step failed: let its error stand
        self.retry_accept = False
        outstanding, self.outstanding = self.outstanding, []
        pending = [o for o in outstanding if self.tracker.is_owed(o.rank, o.epoch)]
        if pending:
            note("abandoned at the end")
        self._step(("abandon", frozenset(outstanding)), lambda: self.rules.abandon(outstanding))
        assert not self.tracker.any_pending(), "a rank stayed Pending with no one owing it"
        for r in list(self.rules.proofs):
            for _ in range(MAX_UNKNOWN_PROBES):
                proof = self.rules.proofs.get(r)
                if proof is None:
                    break
                wm, epoch = proof.watermark, proof.epoch
                self._step(
                    ("probe", r, epoch, wm, "unknown"),
                    lambda r=r, wm=wm, epoch=epoch: self.rules.probe_verdict(
                        r, epoch, wm, "unknown"
                    ),
                )
        for r in self.ranks:
            if self.views[r].live:
                assert self.tracker.recorded_outcome(r) is not None, f"{r}: no outcome"
        assert self.tracker.settled()


REQUIRED = [
    "gap retry granted on graft",
    "gap retry refused on graft",
    "gap retry granted on live",
    "gap retry granted on probe",
    "outcome gap on graft",
    "outcome gap on live",
    "outcome warm on graft",
    "outcome warm on live",
    "outcome warm on probe",
    "outcome warm_unwitnessed on probe",
    "outcome overflow on live",
    "outcome from_origin on live",
    "outcome publisher_reset on reset",
    "outcome publisher_reset on live",
    "outcome uncovered on graft",
    "outcome abandoned on abandon",
    "graft behind the held stream (gap)",
    "graft ahead of everything held",
    "graft splices into the held stream",
    "graft for a rank not owed: ignored",
    "deferred proof",
    "END_SEQ delivered",
    "regression reset by the subscriber",
    "restart at seq 0 behind a cursor",
    "lost batches counted by the pump",
    "stale block excused: its removal was never delivered",
    "item for a forgotten rank dropped",
    "rank registered again",
    "settled",
]


def test_bootstrap_contract_holds_under_random_interleavings() -> None:
    COVERAGE.clear()
    run_state_machine_as_test(
        BootstrapMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    missing = [label for label in REQUIRED if not COVERAGE[label]]
    assert not missing, f"paths never reached: {missing}\n{sorted(COVERAGE.items())}"
