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
non-zero seq puts a `PublisherReset` first, the last seq again is dropped), or, in "raw"
examples, straight to the pump, so the pump's own regression rules are reached too.

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
   Pending rank has held batches, or one with an open proof (batches below its
   watermark). At the end of the run, abandoning every outstanding
   obligation (queued retries included) leaves no rank Pending; three `unknown` probes per
   open proof then leave every registered rank with its outcome.

P2 Outcomes. Every registered rank is in exactly one of: Pending, holding a proof (Recovered,
   same epoch, cursor = watermark), or settled with its incarnation's one outcome. That
   outcome never changes within the incarnation, and the tracker's counters equal the model's
   sum of one outcome per incarnation. A gap retry is asked for at most once per incarnation;
   when granted the rank is Pending with no outcome and an empty tree; when refused it is
   Failed with `gap`, and so it is when the granted retry is abandoned (every sibling behind
   the stream). Each outcome appears only on the step that justifies it (`_justify`); in
   particular `warm` only when
     - a graft found a held batch at exactly `watermark + 1` (the held stream joins), or
     - a live batch after a deferred graft had `seq == watermark + 1` (one at or below the
       watermark is reflected in the snapshot and proves nothing: router.graft), or
     - a probe reported `no_advance` for the rank's proof (same epoch and watermark);
   a batch 0 after a deferred graft is `from_origin`, a PublisherReset settles a Pending or
   unproven rank as `publisher_reset` (and always leaves the rank empty, without a cursor),
   and `tree_rejected` never happens (a LocalGraft of a consistent engine always fits).

P3 Readiness latches: once `settled()` or `admit_ready()` has answered True it always does.
   When ranks are registered and none is Pending, `settled()` is True.

P4 Safety (run cold, never wrong). For every rank, let T be the blocks the tree says it
   carries (found by key and engine hash), C the engine's current cache, and D the batches
   handed to the pump during the rank's current registration. Then:
     (a) T contains no block the rank's engine never stored, and only blocks that reached the
         pump legitimately: stored by a batch in D, or carried by a graft the rank was owed;
     (b) every block of T not in C was removed by a batch that is NOT in D (lost, still in
         flight, or published before this registration) and NOT reflected in the graft the
         tree keeps (a graft at watermark w from the same engine incarnation reflects every
         removal at seq <= w, until the pump clears the rank), or by an engine restart the
         pump was never shown (no END_SEQ or regression reset after it, no batch 0 of it or
         of a later incarnation, and, for a Pending rank, no regression below its held
         tail, reference 5.4.2).
   So the only stale blocks are those of lost batches, which is the accepted degradation the
   pump counts in `stats.lost_batches` (or leaves to a pending splice proof). A graft whose
   watermark is stale must never let a delivered removal be filtered out as "already
   reflected", and a graft must never land on a rank it was not owed.
   A rank that is not live carries nothing, and has no cursor, held queue or proof.

P5 Completeness (nothing missing where nothing was lost). A live rank that is not Pending, has
   no open proof and nothing in flight, and lost no batch and saw no engine restart since it
   registered, carries every block of its engine's cache, provided the engine published nothing
   before the registration or the tree keeps a graft of the same incarnation at or after the
   last seq published before it. So a duplicate batch applied, a held queue dropped, or a
   filter that discards a batch the graft does not reflect, all fail here.

Coverage: `hypothesis.event()` labels each interesting path (`--hypothesis-show-statistics`),
and the test asserts that gaps, granted and refused retries, overflow, origin resolution,
publisher resets (END_SEQ, regressions, batch 0 behind a cursor), stale grafts, deferred proofs
and probe verdicts all happened across the run (REQUIRED).

Bugs it found (fixed in a76b1e4; the unit tests at the end pin them): a batch 0 at cursor 0 was
skipped instead of replacing the rank (stale blocks kept for good, P4); a batch 0 after a
deferred graft counted `warm` (P2); a graft naming an obligation twice grafted it twice (P2).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, seed, settings
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
from peer.probe import MAX_UNKNOWN_PROBES
from peer.sweep import Gapped
from peer.tracker import BootstrapState, BootstrapTracker, Obligation, RankOutcome, SweepOutcome
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from router.graft import BEHIND_MAX, HELD_QUEUE_CAP, BootstrapRules, LocalGraft
from router.index import IndexRules, apply_events
from router.subscriber import LiveBatch, PublisherReset, SequenceTracker, Step, UnrepairedGap

BS = 2
EXAMPLES = int(os.environ.get("KVROUTER_PROPERTY_EXAMPLES", "0"))  # > 0: hunt, random
SEEDS = (1, 2, 3)  # the stable run's seeds, the later ones run only if needed (see the test)
TIMEOUT_S = 60.0
PROOF_TIMEOUT_S = 30.0
RANKS = [RankId("http://w", i) for i in range(3)]
R = RANKS[0]
PENDING, RECOVERED, FAILED = BootstrapState.PENDING, BootstrapState.RECOVERED, BootstrapState.FAILED
WARM = RankOutcome.WARM

# Paths reached across the whole run, asserted on at the end of the test.
COVERAGE: Counter[str] = Counter()


def note(label: str, *categories: str) -> None:
    """An hypothesis event, counted in COVERAGE with the broader categories it belongs to."""
    event(label)
    COVERAGE.update((label, *categories))


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
                for b, key, above in zip(
                    ids, block_keys(toks, BS, seed), [parent, *ids[:-1]], strict=True
                ):
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
    graft: tuple[int, int] | None = None  # (engine inc, watermark) of the graft the tree keeps
    sub: SequenceTracker = field(default_factory=SequenceTracker)
    origin: tuple[int, int] = (0, 0)  # (engine inc, first seq published) after registration
    lossy: bool = False  # a batch published since registration was lost, or the engine restarted


@dataclass(frozen=True, slots=True)
class Before:
    """One rank, just before a step."""

    live: bool
    state: BootstrapState | None
    epoch: int | None
    verdict: RankOutcome | None
    proof: tuple[int, int, int] | None  # (watermark, epoch, unknown probes)
    held: tuple[int, ...]


# One published batch, packed in an int to keep hypothesis's draws cheap (see `decode`).
BATCHES = st.lists(st.integers(0, 1023), min_size=1, max_size=4)
KINDS = ("store", "store", "store", "store", "remove", "remove", "remove", "clear")
FATES = ("deliver", "deliver", "queue", "lose")
SECOND = (None, None, "store", "remove")
RANK = st.integers(0, 2)
# A sibling's watermark for a rank, relative to the engine's newest seq, or to the first seq the
# pump holds for the rank (else the next it will receive): -2 leaves a gap of one batch, -1
# joins exactly, 0 overlaps one, 2 is ahead. None: the sibling does not know the rank.
Mark = tuple[str, int] | None
MARK = st.sampled_from(
    [
        ("newest", 0),
        ("first", -2),
        ("first", -1),
        ("first", -3),
        ("first", 0),
        ("first", 2),
        ("newest", -3),
        None,
    ]
)
VERDICT = st.sampled_from(["unknown", "no_advance", "advanced"])
ACCEPT = st.booleans()  # does the coordinator's queue take a gap retry


def decode(code: int) -> tuple[list[tuple[str, int, int]], str]:
    """A batch's plan (events as (kind, blocks, selector)) and its fate, from 10 bits.

    0 is the simplest batch: one fresh root block, delivered at once.
    """
    fate = FATES[code & 3]
    kind, n, sel = KINDS[code >> 2 & 7], 1 + (code >> 5 & 1), code >> 6 & 3
    plan = [(kind, n, sel)]
    if (second := SECOND[code >> 8 & 3]) is not None:
        plan.append((second, 1, sel + 1))
    return plan, fate


class BootstrapMachine(RuleBasedStateMachine):
    @initialize(
        n=st.integers(1, 3),
        cap=st.sampled_from([2, 3, 5, HELD_QUEUE_CAP]),
        raw=st.booleans(),
        seed_required=st.booleans(),
        warm_engines=st.lists(st.sampled_from([2, 1, 3, 0]), min_size=3, max_size=3),
        held=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    )
    def setup(
        self,
        n: int,
        cap: int,
        raw: bool,
        seed_required: bool,
        warm_engines: list[int],
        held: list[int],
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
        # Subscribed first: what the engines publish while the first sweep runs is held.
        for r, k in zip(self.ranks, held, strict=False):
            for _ in range(k):
                self.engines[r].inflight.append(self.engines[r].emit([("store", 1, 1)]))
                self._deliver_head(r)
        if raw:
            note("raw subscriber")
        if cap < HELD_QUEUE_CAP:
            note(f"held cap {cap}")

    # -- plumbing --------------------------------------------------------------------------

    def _enqueue(self, ob: Obligation, note: Gapped) -> bool:
        """The coordinator's queue: runs inside the pump, in the middle of a gap resolution."""
        assert self.tracker.is_pending(ob.rank), "a retry handed out for a rank not Pending"
        assert self.tracker.epoch(ob.rank) == ob.epoch, "a retry under a different epoch"
        assert ob not in self.retried, f"a second gap retry for the incarnation {ob}"
        self.retried.add(ob)
        # The drawn answer, flipped for odd epochs: hypothesis favours one value of a boolean,
        # and every run must see both answers.
        accept = self.retry_accept != bool(ob.epoch % 2)
        self.retries.append((ob, accept))
        if accept:
            self.outstanding.append(ob)
        return accept

    def _rank(self, i: int) -> RankId:
        return self.ranks[i % len(self.ranks)]

    def _pick_rank(self, i: int, ok: Any) -> RankId:
        """The first rank from rank i on (cyclically) for which `ok` holds."""
        n = len(self.ranks)
        return next(self.ranks[(i + k) % n] for k in range(n) if ok(self.ranks[(i + k) % n]))

    def _register(self, ranks: list[RankId]) -> None:
        # WorkerRegistry._register: the tracker first, then the pump, then a new subscriber.
        obligations = self.tracker.register(ranks)
        self.index.add_ranks(ranks)
        assert sorted(o.rank for o in obligations) == sorted(ranks)
        self.outstanding += obligations
        self.minted += obligations
        for o in obligations:
            eng = self.engines[o.rank]
            self.views[o.rank] = View(live=True, origin=(eng.inc, eng.seq_next))
            eng.inflight.clear()  # published before we subscribed: lost
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
        restarts = self.index.stats.restarts_at_zero
        call()
        for r in self.ranks:
            if self.tracker.state(r) is not RECOVERED or r not in self.index.cursors:
                self.views[r].graft = None  # the pump cleared the rank: the graft is gone
        if step[0] == "live" and self.index.stats.restarts_at_zero > restarts:
            self.views[step[1]].graft = None
        for r in self.ranks:
            b = before[r]
            assert self.tracker.epoch(r) == b.epoch, "a pump step changed an epoch"
            now = self.tracker.recorded_outcome(r)
            if b.verdict is not None:
                assert now == b.verdict, f"{r}: outcome {b.verdict} became {now}"
            elif now is not None:
                self.counts[now] += 1
                self._justify(r, now, step, b)
                note(
                    f"outcome {now.value} on {step[0]}",
                    f"outcome {now.value}",
                    f"{step[0]} settled a rank",
                )
        assert self.tracker.rank_outcomes == self.counts, "an outcome counted twice"
        for ob, accepted in self.retries[retries_before:]:
            if accepted:
                note(f"gap retry granted on {step[0]}", "gap retry granted")
                assert self.tracker.is_pending(ob.rank)
                assert self.tracker.recorded_outcome(ob.rank) is None
            else:
                note(f"gap retry refused on {step[0]}", "gap retry refused")
                assert self.tracker.state(ob.rank) is FAILED
                assert self.tracker.recorded_outcome(ob.rank) is RankOutcome.GAP
        if step[0] == "graft":
            self._check_graft(step, before)
        if step[0] == "live":
            # Reference 5.4.2: a seq below the held tail is a restart; the rank stops holding.
            held = before[step[1]].held
            if held and step[2] < held[-1]:
                assert not self.tracker.is_pending(step[1]), f"{step}: still holding {held}"
        if step[0] == "reset":
            r, b = step[1], before[step[1]]
            assert self.index.tree.block_count(r) == 0 and r not in self.index.cursors
            if b.state is PENDING or b.proof is not None:
                outcome = self.tracker.recorded_outcome(r)
                assert outcome is RankOutcome.PUBLISHER_RESET, f"{r}: reset left {outcome}"
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
                if seq == 0:
                    # A batch 0 behind a graft's cursor is a restart: from_origin (reference
                    # 2.4 and 5.9), never a proof of the splice.
                    assert outcome is RankOutcome.FROM_ORIGIN, why
                elif outcome is WARM:
                    # Only watermark + 1 proves the splice (router.graft: a batch at or
                    # below it is reflected and shows nothing of the next one).
                    assert seq == wm + 1, why
                    note("warm on the deferred path")
                elif outcome is RankOutcome.PUBLISHER_RESET:
                    assert b.held and 0 < seq < b.held[-1], why
                    note("publisher_reset from a regression under a proof")
                else:
                    # Past watermark + 1 (a hole), or still behind it beyond what can be in
                    # flight (BEHIND_MAX batches, BEHIND_WINDOW_S after the graft).
                    assert outcome is RankOutcome.GAP and seq != wm + 1, why
                    if seq <= wm:
                        note("gap: the stream stayed behind the watermark")
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
                # A granted gap retry that found every sibling behind the stream is the gap
                # it was; any other abandon is a fleet with nothing for the rank.
                retried = (Obligation(r, b.epoch), True) in self.retries
                assert outcome is (RankOutcome.GAP if retried else RankOutcome.ABANDONED), why
                return
            wm = step[2].get(r)
            if wm is None:
                assert outcome is RankOutcome.UNCOVERED, why
            elif outcome is WARM:
                assert wm + 1 in b.held, why
                note("warm on the held path")
            else:
                assert outcome is RankOutcome.GAP and b.held and wm + 1 not in b.held, why
                assert b.held[-1] > wm + 1 or wm - b.held[-1] > BEHIND_MAX, why
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
            if wm is not None and (not b.held or wm - BEHIND_MAX <= b.held[-1] <= wm):
                note("deferred proof" if not b.held else "deferred proof over held batches")
                proof = self.rules.proofs.get(r)
                assert proof is not None and proof.watermark == wm, f"{r}: no proof at {wm}"
                assert self.tracker.state(r) is RECOVERED and self.index.cursors[r] == wm

    def _check(self) -> None:
        """P1, P2 (states), P4 and P5 after any step."""
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
                # Held while Pending, or under an open proof: batches below its watermark
                # that the stream has not caught up past yet (they prove nothing).
                held = self.rules.held[r]
                assert held, f"{r}: an empty held queue"
                assert state is PENDING or (proof is not None and held[-1].seq < proof.watermark), (
                    f"{r}: held {[h.seq for h in held]} while {state}, proof {proof}"
                )
            self._check_safety(r)
            self._check_complete(r)

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
                # Delivered, or reflected in the graft the tree keeps.
                shown = (why[1], why[2]) in v.delivered or (
                    v.graft is not None and v.graft[0] == why[1] and why[2] <= v.graft[1]
                )
            else:
                shown = why[1] <= v.restart_seen
            assert not shown, (
                f"{r}: the tree still carries block {b}, removed by {why}, which the pump was "
                f"shown (cursor {self.index.cursors.get(r)}, state {self.tracker.state(r)})"
            )
            note("stale block excused: its removal was never delivered")

    def _check_complete(self, r: RankId) -> None:
        """P5 for one live rank: lossless since it registered, it carries exactly its cache."""
        eng, v, tree = self.engines[r], self.views[r], self.index.tree
        if v.lossy or eng.inflight or self.tracker.is_pending(r) or r in self.rules.proofs:
            return
        inc, first = v.origin
        # Published before registration: known only through a graft at or after it.
        if first > 0 and (v.graft is None or v.graft[0] != inc or v.graft[1] < first - 1):
            return
        carried = {b for b, key in eng.keys.items() if tree.engine_hash(r, key) == b}
        missing = sorted(set(eng.cache) - carried)
        assert not missing, (
            f"{r}: lost nothing since it registered at {v.origin}, yet misses blocks {missing} "
            f"(state {self.tracker.state(r)}, outcome {self.tracker.recorded_outcome(r)}, "
            f"graft {v.graft}, cursor {self.index.cursors.get(r)})"
        )
        note("lossless rank carries its whole cache" + (" (grafted)" if first else ""))

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
            if verdict.step is Step.DUPLICATE:
                # The old stream's last seq again, the new one's first seen after a restart
                # whose earlier batches were all lost: dropped as `RankSubscriber` drops it
                # (the pump was shown no restart; the registry's restart detection is what
                # clears such a rank).
                note("the last seq again dropped by the subscriber")
                return
            if verdict.step is Step.RESET:
                v.restart_seen = max(v.restart_seen, item.inc)
                note("regression reset by the subscriber")
                self._step(("reset", r), lambda: self.index.handle(PublisherReset(r)))
            elif verdict.step is Step.GAP:
                gap = UnrepairedGap(r, verdict.missing_first, verdict.missing_last)
                self._step(("unrepaired", r), lambda: self.index.handle(gap))
        held = self.rules.held.get(r)
        if self.raw and held and item.seq < held[-1].seq:
            v.restart_seen = max(v.restart_seen, item.inc)  # reference 5.4.2
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

    @rule(i=RANK, batches=BATCHES, accept=ACCEPT)
    def publish(self, i: int, batches: list[int], accept: bool) -> None:
        """The engine publishes a few batches; each is delivered now, queued, or lost."""
        r = self._rank(i)
        eng = self.engines[r]
        self.retry_accept = accept
        for code in batches:
            plan, fate = decode(code)
            sent = eng.emit(plan)
            if fate == "lose":
                note("batch lost")
                self.views[r].lossy = True
                continue
            eng.inflight.append(sent)
            if fate == "deliver":
                while eng.inflight:
                    self._deliver_head(r)

    @rule(i=RANK, batches=BATCHES, accept=ACCEPT)
    def publish_more(self, i: int, batches: list[int], accept: bool) -> None:
        """The same as `publish`: engines publish more often than anything else happens."""
        self.publish(i, batches, accept)

    @precondition(lambda self: any(e.inflight for e in self.engines.values()))
    @rule(i=RANK, n=st.integers(1, 3), lose=st.booleans(), accept=ACCEPT)
    def deliver_in_flight(self, i: int, n: int, lose: bool, accept: bool) -> None:
        """The oldest in-flight items of a rank arrive (or the oldest one is dropped)."""
        r = self._pick_rank(i, lambda r: bool(self.engines[r].inflight))
        eng = self.engines[r]
        if lose:
            eng.inflight.popleft()
            self.views[r].lossy = True
            note("in-flight item lost")
            return
        self.retry_accept = accept
        for _ in range(min(n, len(eng.inflight))):
            self._deliver_head(r)

    @precondition(lambda self: self.outstanding)
    @rule(
        abandon=st.sampled_from([False, False, False, False, True]),
        picks=st.lists(st.integers(0, 15), min_size=1, max_size=3),
        marks=st.lists(MARK, min_size=3, max_size=3),
        accept=ACCEPT,
        then_probe=st.one_of(st.none(), st.tuples(VERDICT, st.sampled_from([0, 0, 1, -1]))),
    )
    def coordinator(
        self,
        abandon: bool,
        picks: list[int],
        marks: list[Mark],
        accept: bool,
        then_probe: tuple[str, int] | None,
    ) -> None:
        """The coordinator's one message for outstanding obligations: a graft, or abandon.

        `marks[i]`: rank i's watermark in the sibling (see MARK). `then_probe`: a splice probe
        judges every open proof right after the graft, before any live batch; with a non-zero
        offset, about a watermark the proof does not have (a verdict on an earlier graft).
        """
        self._message(self._pick(picks, False), abandon, marks, accept, then_probe)

    @rule(
        abandon=st.booleans(),
        picks=st.lists(st.integers(0, 15), min_size=1, max_size=3),
        marks=st.lists(MARK, min_size=3, max_size=3),
        accept=ACCEPT,
    )
    def stale_message(
        self, abandon: bool, picks: list[int], marks: list[Mark], accept: bool
    ) -> None:
        """A duplicate or late graft or abandon: any obligations ever minted."""
        self._message(self._pick(picks, True), abandon, marks, accept, None)

    def _message(
        self,
        obligations: list[Obligation],
        abandon: bool,
        marks: list[Mark],
        accept: bool,
        then_probe: tuple[str, int] | None,
    ) -> None:
        if abandon:
            self._step(("abandon", frozenset(obligations)), lambda: self.rules.abandon(obligations))
            return
        sibling = BlockTree(BS)
        cursors: dict[RankId, int] = {}
        for r, mark in zip(self.ranks, marks, strict=False):
            eng = self.engines[r]
            if mark is None or eng.seq_next == 0:
                continue
            anchor, delta = mark
            base = eng.seq_next - 1 if anchor == "newest" else self._first_seq(r)
            wm = min(max(0, base + delta), eng.seq_next - 1)  # a sibling is never ahead
            for events in eng.history[: wm + 1]:
                apply_events(sibling, r, events)
            cursors[r] = wm
        before = self._snap()
        owed = []
        for r in self.ranks:
            b = before[r]
            if b.live and b.state is PENDING and Obligation(r, b.epoch) in obligations:
                note("graft for an owed rank" + ("" if r in cursors else " it does not cover"))
                if r in cursors:
                    owed.append(r)
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
        for r in owed:
            if self.tracker.state(r) is RECOVERED:
                self.views[r].graft = (self.engines[r].inc, cursors[r])
        if then_probe is not None:
            verdict, off = then_probe
            targets = [(r, max(0, wm + off), epoch) for r, wm, epoch in self.rules.due_proofs(0)]
            self._judge(targets, lambda: verdict)

    def _first_seq(self, r: RankId) -> int:
        """The first seq the pump holds for the rank, else the next one it will receive."""
        held = self.rules.held.get(r)
        if held:
            return held[0].seq
        eng = self.engines[r]
        return next((s.seq for s in eng.inflight if isinstance(s, Sent)), eng.seq_next)

    def _pick(self, picks: list[int], stale: bool) -> list[Obligation]:
        """Obligations for one message.

        Outstanding ones are consumed: the coordinator sends one message per obligation (a
        granted retry repeats its rank's obligation, so a message may name one twice). Stale
        ones, any obligation ever minted and possibly repeated, make a duplicate or late
        message.
        """
        if stale or not self.outstanding:
            return [self.minted[p % len(self.minted)] for p in picks]
        at = sorted({p % len(self.outstanding) for p in picks}, reverse=True)
        return [self.outstanding.pop(k) for k in at]

    def _classify(self, r: RankId, wm: int, b: Before) -> None:
        if not b.held:
            return
        if b.held[0] > wm + 1:
            note("graft behind the held stream (gap)")
        elif b.held[-1] <= wm:
            note("graft ahead of everything held")
        else:
            note("graft splices into the held stream")

    @rule(
        data=st.data(),
        due_after=st.sampled_from([0.0, PROOF_TIMEOUT_S]),
        stale=st.sampled_from([False, False, True]),
        accept=ACCEPT,
    )
    def probe(self, data: st.DataObject, due_after: float, stale: bool, accept: bool) -> None:
        """Splice-probe verdicts for the due proofs, or one stale verdict."""
        self.retry_accept = accept
        if stale and self.rules.proofs and data.draw(st.booleans(), label="near a proof"):
            # About an open proof, but for another watermark or incarnation.
            r = data.draw(st.sampled_from(sorted(self.rules.proofs)), label="rank")
            proof = self.rules.proofs[r]
            wm, epoch = proof.watermark, proof.epoch
            if data.draw(st.booleans(), label="wrong watermark"):
                wm = max(0, wm + data.draw(st.sampled_from([1, -1]), label="by"))
            else:
                epoch = data.draw(st.sampled_from(self.minted), label="obligation").epoch
            targets = [(r, wm, epoch)]
        elif stale:
            r = self._rank(data.draw(RANK, label="rank"))
            epoch = data.draw(st.sampled_from(self.minted), label="obligation").epoch
            wm = data.draw(st.integers(0, 8), label="watermark")
            targets = [(r, wm, epoch)]
        else:
            # One to three probe ticks, each judging every due proof alike.
            verdict = data.draw(VERDICT, label="verdict")
            for _ in range(data.draw(st.sampled_from([MAX_UNKNOWN_PROBES, 1, 2]), label="ticks")):
                self._judge(self.rules.due_proofs(due_after), lambda: verdict)
            return
        self._judge(targets, lambda: data.draw(VERDICT, label="verdict"))

    def _judge(self, targets: list[tuple[RankId, int, int]], verdicts: Any) -> None:
        for rank, wm, epoch in targets:
            verdict = verdicts()
            note(f"probe {verdict}")
            self._step(
                ("probe", rank, epoch, wm, verdict),
                lambda rank=rank, wm=wm, epoch=epoch, verdict=verdict: self.rules.probe_verdict(
                    rank, epoch, wm, verdict
                ),
            )

    @rule(
        i=RANK,
        kind=st.sampled_from(
            [
                "cycle",
                "restart",
                "announced restart",
                "restart, batch 0 lost",
                "restart, batch 0 delivered",
                "cycle",
                "forget",
            ]
        ),
        accept=ACCEPT,
        between=st.booleans(),
    )
    def disturb(self, i: int, kind: str, between: bool, accept: bool) -> None:
        """An engine restart (silent, or announced by END_SEQ in stream order), or a rank that
        leaves the fleet (and comes back: `cycle`; a forgotten rank always comes back here).
        """
        r = self._rank(i)
        if not self.views[r].live:
            note("rank registered again")
            self._register([r])
        elif kind in ("cycle", "forget"):
            self._forget(r, between)
            if kind == "cycle":
                note("rank registered again")
                self._register([r])
        else:
            eng = self.engines[r]
            eng.restart()
            self.views[r].lossy = True
            if kind == "announced restart":
                eng.inflight.append(EndSeq(eng.inc))
            elif kind != "restart":
                # The new incarnation's first batch arrives at once: batch 0, or batch 1 when
                # 0 was lost (a regression, unless nothing was delivered before).
                if kind == "restart, batch 0 lost":
                    eng.emit([("store", 1, 0)])
                self.retry_accept = accept
                eng.inflight.append(eng.emit([("store", 1, 0)]))
                while eng.inflight:
                    self._deliver_head(r)
            note(f"engine {kind}")

    def _forget(self, r: RankId, between: bool) -> None:
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

    @rule(
        dt=st.sampled_from([0.5, 5.0, 31.0, 61.0]),
        outcome=st.one_of(st.none(), st.sampled_from(list(SweepOutcome))),
        peers=st.integers(0, 2),
    )
    def tick(self, dt: float, outcome: SweepOutcome | None, peers: int) -> None:
        """Time passes; perhaps a sweep verdict reaches the seed gate."""
        self.clock.now += dt
        if outcome is not None:
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
        if self.tracker.states():
            assert self.tracker.settled(), "nothing is Pending, yet not settled"


# What every run must reach (broad categories, so that a change of generated examples does not
# break it); `pytest --hypothesis-show-statistics` lists every finer event.
REQUIRED = [
    "outcome gap",  # gap resolution, run cold
    "gap retry granted",
    "gap retry refused",
    "graft behind the held stream (gap)",
    "graft splices into the held stream",
    "graft ahead of everything held",
    "deferred proof",
    "outcome warm",
    # "outcome warm_unwitnessed" needs three unknown probes on one proof, or a deferred proof
    # still open when an example ends: a few seeds of five miss it. test_graft.py pins it
    # (test_three_unknown_probes_keep_the_graft_unwitnessed).
    "outcome uncovered",
    "outcome abandoned",
    "outcome overflow",
    "outcome from_origin",
    "outcome publisher_reset",
    "END_SEQ delivered",
    "regression reset by the subscriber",
    "restart at seq 0 behind a cursor",
    "graft settled a rank",
    "live settled a rank",
    "probe settled a rank",
    "graft for a rank not owed: ignored",
    "lost batches counted by the pump",
    "stale block excused: its removal was never delivered",
    "lossless rank carries its whole cache",
    "lossless rank carries its whole cache (grafted)",
    "item for a forgotten rank dropped",
    "rank registered again",
    "settled",
]


def test_bootstrap_contract_holds_under_random_interleavings() -> None:
    """200 examples from a fixed seed, so CI and the coverage check are stable (about 6 s);
    KVROUTER_PROPERTY_EXAMPLES=N hunts with N random ones instead.

    A fixed seed rather than `derandomize`: hypothesis derives a derandomized run's seed from
    the machine's source, so any edit of this file drew different examples, and that run's
    examples were narrower (two REQUIRED paths went unreached after unrelated edits). Every
    one of seeds 1-8 reaches every REQUIRED path, the rarest at least 4 times, when run alone;
    but what a seed's examples explore also moves with the process (an unrelated edit of the
    data plane took seed 1's 36 subscriber regression resets to 0 in a whole-suite run, and
    back to 36 run alone). So a path seed 1 leaves unreached gets 200 examples of the next
    seed, up to the third, before the check fails: every example of every seed run is held
    to the contract.
    """
    COVERAGE.clear()
    quiet = [logging.getLogger(name) for name in ("router.index", "router.graft")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)  # thousands of expected loss and gap warnings
    try:
        for number in SEEDS[:1] if EXAMPLES else SEEDS:
            machine = (
                BootstrapMachine
                if EXAMPLES
                else seed(number)(type("Seeded", (BootstrapMachine,), {}))
            )
            run_state_machine_as_test(
                machine,
                settings=settings(
                    max_examples=EXAMPLES or 200,
                    stateful_step_count=40,
                    deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                ),
            )
            if all(COVERAGE[label] for label in REQUIRED):
                break
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    missing = [label for label in REQUIRED if not COVERAGE[label]]
    if not EXAMPLES:  # a hunt of few random examples may miss some; it looks for bugs
        assert not missing, f"paths never reached: {missing}\n{sorted(COVERAGE.items())}"


# -- bugs the state machine found, reduced to unit tests (fixed in a76b1e4) ---------------


class Pump:
    """The rig of the state machine, without hypothesis: one rank R, retries always taken."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.tracker = BootstrapTracker(TIMEOUT_S, clock=self.clock)
        self.index = IndexRules(BlockTree(BS))
        self.rules = BootstrapRules(self.index, self.tracker, lambda ob, note: True, self.clock)
        self.index.bootstrap = self.rules
        self.engine = Engine()

    def register(self) -> list[Obligation]:
        obligations = self.tracker.register([R])
        self.index.add_ranks([R])
        return obligations

    def publish(self, deliver: bool = True) -> Sent:
        sent = self.engine.emit([("store", 1, 0)])
        if deliver:
            self.index.handle(LiveBatch(R, sent.seq, sent.batch))
        return sent

    def sibling(self, watermark: int) -> LocalGraft:
        tree = BlockTree(BS)
        for events in self.engine.history[: watermark + 1]:
            apply_events(tree, R, events)
        return LocalGraft(tree, {R: watermark})

    def carries(self, block: int) -> bool:
        return self.index.tree.engine_hash(R, self.engine.keys[block]) == block


def test_an_engine_restart_after_its_batch_0_replaces_the_rank_state() -> None:
    """Batch 0 delivered (from_origin, cursor 0); the engine restarts without END_SEQ and its
    new batch 0 arrives (the subscriber's RESTART_AT_ZERO leaves it to the pump). It must
    replace the rank's state, not be skipped as "already reflected", which kept the old
    incarnation's block for good and counted no loss (P4). Reference:
    pump_second_batch_zero_at_cursor_zero_replaces_the_rank_state."""
    pump = Pump()
    pump.register()
    pump.publish()  # block 1, from origin
    pump.engine.restart()
    pump.publish()  # block 2: the new incarnation's batch 0
    assert not pump.carries(1) and pump.carries(2)


def test_a_batch_0_after_a_deferred_graft_resolves_from_origin_not_warm() -> None:
    """A graft with nothing held (a deferred proof), then a batch 0: reference 2.4 and 5.9
    drop the proof and count `from_origin`. The proof branch used to count `warm` first (P2),
    leaving `on_restart_at_zero` nothing to settle."""
    pump = Pump()
    for _ in range(4):
        pump.publish(deliver=False)  # seqs 0-3, before this replica subscribed
    obligations = pump.register()
    pump.rules.apply_snapshot(obligations, pump.sibling(3))
    assert R in pump.rules.proofs
    pump.engine.restart()
    pump.publish()  # the new incarnation's batch 0
    assert pump.tracker.recorded_outcome(R) is RankOutcome.FROM_ORIGIN
    assert not pump.carries(1) and pump.carries(5)


def test_an_obligation_named_twice_in_one_graft_is_grafted_once() -> None:
    """A graft naming (rank, epoch) twice used to run finish_graft twice for the rank: the
    second pass found no held queue and opened a deferred proof on a rank already counted
    `warm` (P2), and the next batch "gapped" against that stale proof and threw the good graft
    away."""
    pump = Pump()
    for _ in range(6):
        pump.publish(deliver=False)  # seqs 0-5
    obligations = pump.register()
    pump.publish()  # seq 6: held
    pump.rules.apply_snapshot(obligations * 2, pump.sibling(5))
    assert pump.tracker.recorded_outcome(R) is WARM
    assert R not in pump.rules.proofs
    pump.publish(deliver=False)  # seq 7: lost
    pump.publish()  # seq 8
    assert pump.carries(1) and pump.carries(9)
