"""What this replica routed lately, per rank: recent demand and optimistic bookings.

`cache_aware` reads the block index for what each rank holds; the index is the fleet's shared
truth, but it learns of a block only when the engine's store event arrives, and it does not
say which of the blocks a rank holds are still wanted. This ledger adds both from the
replica's own decisions. Plain synchronous code with an injected clock.

Theory of operation
-------------------
Every routed prompt is recorded against the rank it went to, block key by block key:

- Demand: each block key routed counts once, however often it is routed (distinct blocks),
  on the rank this replica last sent it to, with a weight that halves every
  `demand_half_life_s` since then. A rank's demand is the sum: how many blocks this
  replica's recent traffic needs it to keep. Blocks nobody asked for lately (what an engine
  cached before this replica started, a prefix gone quiet) weigh nothing, so a full cache of
  them is as good as an empty one; and a prefix sent to another rank takes its demand along,
  so the copy left behind stops counting as something its old rank must keep.
- Bookings: a routed prompt's blocks beyond what the index already shows on the rank count
  as held by it until the index shows them (its store event arrived) or `booking_ttl_s`
  passes. Requests for a new prefix that arrive before its first request's store event then
  follow it instead of each looking like a miss. A booking ends `confirmed` when the index
  holds its last block on the rank: the prompt's own blocks, not a preamble it shares with
  other prompts (new prefixes below a system prompt nobody held yet: the first one stored
  put the preamble on the rank, and a first-block check ended the bookings of the others
  while they still waited in the engine's queue, so their prefixes looked new again and were
  copied). Blocks an engine has just stored are its most recently used, the last its LRU
  evicts, so the last block is there when this replica looks; and `expired` at the TTL
  otherwise (the engine queued the request longer than that, or it
  failed over): many expired bookings mean the TTL is too short for the engines' queues.
  Bookings are checked oldest first per rank on every decision (an engine admits in order),
  so a confirmed booking stops counting at once: were it kept, it would hide the engine
  evicting those blocks later. A booking also ends early, `moved`, when the proxy failed over
  to another rank, and `refused`, when the engine answered a 4xx: it cached nothing, and kept
  booked, a stream of refused prompts (a hostile client's, or a misconfigured one's) would
  make a rank look full for a TTL. A refused prompt's demand goes with its booking: kept, 60
  refused prompts made a rank's demand 15 times its capacity with nothing cached. What goes is
  what its record put in its batches and is still there (blocks it weighed anew, blocks it
  weighed again, taken from older records, and its own tail), dropped from the ledger; nothing
  older is restored (a block it took from an older record leaves, and a record it superseded
  stays superseded): the ledger keeps no history to restore from, and forgetting only
  under-counts demand. What a fresh record kept (a hot preamble) is not this record's and
  stays. A prompt the rank held whole books nothing, and with bookings off nothing is booked:
  then a refusal takes back nothing.

Working sets. A request's own tail (the blocks after the prefix it shares with the requests
before it) is routed once and never again, yet it counts as demand until it decays: over a
few rounds of a cyclic workload each rank's demand grows past its capacity by the tails
alone, whether or not its prefixes fit (`bench/pressure_sim.py`, u2034.6 seed 1: every
rank's demand 206-227 blocks of 175 after four rounds, its prefixes' blocks 143-170). When a
prompt takes over blocks of one earlier record (routed more than a 64th of a half-life ago;
the blocks above them, a preamble every prefix shares, may come from other records) and goes
on with blocks new to the ledger, what that record keeps beyond them is a continuation this
prompt superseded: a request's own tail, when it is shorter than what it shares (a longer
one is another prefix below a shared preamble, still in use, and is left alone) and no more
than that record's blocks new to the ledger (`first_seen`): what it weighed again is a
prefix routed before, still in use too (a prefix's own blocks routed twice were taken for a
tail whenever fewer than the header a new prefix took over: `pressure_sim` u2401.6, 0.978x
-> 0.984x ideal). A fresher
record keeps its place (one lookup per block for a prefix routed again and again). In either
case the prompt's own continuation, when shorter than what it shares, is a tail too, and
leaves the working set at once, in a batch of its own when the record weighed other blocks
again: waiting for the next request of its prefix to supersede it (as this did until round
16) left each prefix's latest tail in, and with tails of 100-500 tokens those inflated every
rank's working set past its capacity by noise (`pressure_sim --tailed`: u3004.0, prefixes
filling 0.92 of the caches, working sets 1.2-1.5x capacity), so the rules that read them
moved prefixes that fit. A conversation's newest turn has a tail's shape: it leaves the
working set until the next turn takes it up again (it is weighed again there), one turn per
live conversation. (Before tails were superseded at all, no tail ever left it: u2044.4 seed
1 at a replica's 40th decision, the ranks' working sets 36-53 blocks of 40 where their
prefixes held 24-38.) A superseded batch is marked `superseded`, and a rank's working set
(`working_sets`) is its demand less its superseded blocks: what its cache must hold for the
prefixes routed to it to stay. Demand itself is unchanged (every other rule reads it); only
the relief of an outgrown holder and the re-placement of a prefix gone from every cache
(`router.policy`) read the working set. A prompt's own tail is not told to the siblings
(`record` returns the keys worth telling without it): a sibling records what it is told as
blocks new to it, with no prefix to tell a tail by, so every tail told stayed in every
sibling's working set (`pressure_sim` u7.8, three replicas: 33-52 of a rank's 111 blocks), and the
rules reading it found no rank with room.

Weights are stored as 2 ** ((t - t0) / half_life) against a moving origin t0, so a rank's
demand is one running sum scaled by 2 ** -((now - t0) / half_life): recording a block is O(1)
and reading a demand is O(1), however many blocks are tracked.

State per block is one table entry: block key -> the batch that weighed it last, a batch
being what one record weighed on one rank (its rank, its weight, its keys in order), so a
prompt's blocks share one weight and one rank and a new block costs one lookup and one store.
A rank keeps its batches in record order, which is its pairs' last-routed order; a block
weighed again stays listed in its older batch too, as a stale entry skipped (the table no
longer points there) when that batch is pruned. A rank's booked blocks map each key to the
newest booking of it, in one C-level update per booking; bookings end oldest first (a
failover's `move` aside, which rebuilds the map), so a key whose newest booking has ended is
booked no more, and ending one touches none of its blocks.

Bounds: each rank's pairs are kept in last-routed order; pairs older than 16 half-lives
(weight < 1/65536) are dropped as the rank is recorded, and the whole ledger holds at most
`max_tracked_blocks` pairs (each rank its share; a rank's oldest go first), so memory is
bounded whatever the traffic. A rank no longer routed to is swept a little on every record;
one whose worker left the registry is forgotten at once (`forget_ranks`).
Stale entries are compacted away whenever a rank pruned lists more than twice its pairs plus
`_STALE_SLACK`, and a rank's booked map is rebuilt from its live bookings when it holds more
than twice their blocks plus the same slack (emptied when none is left). Booked blocks are
bounded by the same figure as pairs: past it, the oldest booking ends early (and counts as
expired).
"""

from __future__ import annotations

import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import Final

from cachetree.accel import tables
from cachetree.ranks import RankId

Holds = Callable[[RankId, int], bool]  # does the index hold this block key on this rank?

DEFAULT_MAX_TRACKED_BLOCKS: Final = 1_000_000  # --pressure-max-tracked-blocks
# A replica's resident memory per pair of the bound, demand and bookings both at it (each has
# the bound to itself): ~100 B a demand pair (39 B of the ledger's own with the compiled tables,
# `bench/ledger_memory.py`; the rest what the allocator keeps of siblings' decoded batches,
# measured through POST /internal/decisions), ~110-180 B more a booked block, and the allocator
# keeps the bookings' pages once they expired (README, "Memory").
BYTES_PER_TRACKED_PAIR: Final = 300

_FORGET_AFTER_HALF_LIVES = 16.0
_REBASE_AFTER_HALF_LIVES = 256.0  # 2 ** 256 is far from overflowing a double
_REFRESH_FACTOR = 2.0 ** (-1 / 64)
_STALE_SLACK = 4096  # stale batch entries a rank may list beyond its pairs before compaction


@dataclass(frozen=True, slots=True)
class PressureSettings:
    """The ledger's time constants and bound (README: `--booking-ttl-ms`,
    `--demand-half-life-s`, `--pressure-max-tracked-blocks`)."""

    booking_ttl_s: float = 5.0
    demand_half_life_s: float = 30.0
    max_tracked_blocks: int = DEFAULT_MAX_TRACKED_BLOCKS

    def __post_init__(self) -> None:
        if not self.booking_ttl_s >= 0:
            raise ValueError("booking_ttl_s must be >= 0")
        if not self.demand_half_life_s > 0:
            raise ValueError("demand_half_life_s must be > 0")
        if self.max_tracked_blocks < 1:
            raise ValueError("max_tracked_blocks must be >= 1")


@dataclass(slots=True)
class BookingStats:
    made: int = 0
    confirmed: int = 0  # the index held the booked blocks when the TTL ended
    expired: int = 0  # it did not
    moved: int = 0  # ended early: the proxy failed over and another rank served the prompt
    refused: int = 0  # ended early: the engine refused the prompt (a 4xx), caching nothing
    departed: int = 0  # ended early: the rank's worker left the registry (`forget_ranks`)


@dataclass(slots=True, eq=False)
class _Booking:
    ends_at: float
    keys: Sequence[int]  # the blocks it books, root first
    batches: tuple[_Batch, ...] = ()  # what its record filed: taken back when refused
    ended: bool = False


@dataclass(slots=True, eq=False)
class _Batch:
    """The pairs one record weighed on one rank, all at one weight. The keys the ledger's
    table maps to this batch are its live pairs; the others listed are stale."""

    rank: _RankLedger
    weight: float
    # In the order weighed, from `start` on (before it: pruned); an array of u64, 8 bytes a key
    # where a list would hold an int object of 32 for each.
    keys: Sequence[int] = ()
    start: int = 0
    live: int = 0
    superseded: bool = False  # its live pairs are a request's own tail (module docstring)
    # How many of its keys were new to the ledger when it was weighed: only that many of its
    # live pairs can be its request's own tail (module docstring, "Working sets").
    first_seen: int = 0


def _booked_map() -> MutableMapping[int, _Booking]:
    return tables.NodeMap() if tables is not None else {}


def _u64_array(keys: Sequence[int], start: int) -> array[int]:
    """`keys[start:]` as an array('Q'): converted in C when compiled (`pack_u64`), where array's
    own conversion of each multi-digit int was a fifth of a record."""
    if tables is not None:
        return array("Q", tables.pack_u64(keys, start))
    return array("Q", keys[start:])


def _reserve(booked: MutableMapping[int, _Booking], entries: int) -> None:
    """Room for `entries` in all before the compiled map rebuilds itself (a dict needs none):
    grown from empty instead, it rebuilds at every doubling."""
    if tables is not None:
        booked.reserve(entries)  # type: ignore[attr-defined]


def _put_run(booked: MutableMapping[int, _Booking], keys: Sequence[int], booking: _Booking) -> None:
    """Map each of `keys` to `booking`: one C-level pass (`NodeMap.put_run`) when compiled."""
    if tables is not None:
        booked.put_run(keys, booking)  # type: ignore[attr-defined]
    else:
        booked.update(zip(keys, repeat(booking)))


@dataclass(slots=True)
class _RankLedger:
    rank: RankId
    batches: deque[_Batch] = field(default_factory=deque)  # oldest first
    pairs: int = 0  # live pairs over its batches
    listed: int = 0  # keys its batches list from `start` on, live or stale
    total: float = 0.0  # sum of its live pairs' weights
    superseded: float = 0.0  # ... of those in superseded batches
    bookings: deque[_Booking] = field(default_factory=deque)  # oldest first
    # key -> the newest booking that booked it, ended or not. Bookings end oldest first
    # (`move` aside, which rebuilds this), so a key whose newest booking ended is booked
    # no more: ending a booking costs nothing per block.
    booked: MutableMapping[int, _Booking] = field(default_factory=_booked_map)
    booked_blocks: int = 0  # over its live bookings


class PressureLedger:
    def __init__(
        self, settings: PressureSettings | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.settings = settings if settings is not None else PressureSettings()
        self._clock = clock if clock is not None else time.monotonic
        self.bookings = BookingStats()
        self._ranks: dict[RankId, _RankLedger] = {}
        self._booking_ranks: set[RankId] = set()  # ranks with live bookings
        self._booked_blocks = 0  # over all live bookings
        # block key -> the batch that weighed it last: the compiled map when the accelerator
        # is built (a prompt's lookups overlapped in C: `_weigh` is most of a record), a dict
        # otherwise.
        self._pairs: MutableMapping[int, _Batch]
        self._weigh_run: Callable[[Sequence[int], _Batch], _Runs]
        self._drop_run: Callable[[Sequence[int], int, int, _Batch], tuple[int, int]]
        self._move_run: Callable[[Sequence[int], int, int, _Batch, _Batch], int]
        self._kept_run: Callable[[array[int], int, _Batch], bytes]
        if tables is not None:
            self._pairs = tables.NodeMap()
            self._weigh_run = self._pairs.weigh_run
            self._drop_run = self._pairs.drop_run
            self._move_run = self._pairs.move_run
            self._kept_run = self._pairs.kept_run
        else:
            self._pairs = pairs = {}
            self._weigh_run = partial(_weigh_run_py, pairs)
            self._drop_run = partial(_drop_run_py, pairs)
            self._move_run = partial(_move_run_py, pairs)
            self._kept_run = partial(_kept_run_py, pairs)
        self._origin = self._clock()
        self._sweep_next = 0  # the rank the next record sweeps, by position

    # -- reads -----------------------------------------------------------------------------

    def demand(self, rank: RankId) -> float:
        """The rank's recent distinct routed blocks, decayed (see the module docstring)."""
        st = self._ranks.get(rank)
        if st is None or st.total <= 0.0:
            return 0.0
        return st.total * self._scale(self._clock())

    def demands(self, ranks: Iterable[RankId]) -> list[float]:
        scale = self._scale(self._clock())
        get = self._ranks.get
        return [0.0 if (st := get(r)) is None else max(st.total * scale, 0.0) for r in ranks]

    def working_sets(self, ranks: Iterable[RankId]) -> list[float]:
        """Each rank's demand less its superseded continuations (module docstring)."""
        scale = self._scale(self._clock())
        get = self._ranks.get
        return [
            0.0 if (st := get(r)) is None else max((st.total - st.superseded) * scale, 0.0)
            for r in ranks
        ]

    def live_bookings(self, rank: RankId) -> int:
        """Bookings (routed prompts) on the rank, neither confirmed nor expired yet."""
        st = self._ranks.get(rank)
        return 0 if st is None else len(st.bookings)

    def pending(self, rank: RankId) -> int:
        """Blocks booked on the rank and not in the index yet: room its cache will lose."""
        st = self._ranks.get(rank)
        return 0 if st is None else st.booked_blocks

    def pendings(self, ranks: Iterable[RankId]) -> list[int]:
        get = self._ranks.get
        return [0 if (st := get(r)) is None else st.booked_blocks for r in ranks]

    @property
    def booked_blocks(self) -> int:
        """Blocks booked over all live bookings."""
        return self._booked_blocks

    @property
    def tracked_blocks(self) -> int:
        return len(self._pairs)

    def routed(self, key: int) -> bool:
        """Whether the block was routed to any rank lately (its weight is still tracked)."""
        return self._pairs.get(key) is not None

    def routed_to(self, key: int, rank: RankId) -> bool:
        """Whether the block was routed lately, to `rank` last."""
        batch = self._pairs.get(key)
        return batch is not None and batch.rank is self._ranks.get(rank)

    def last_routed(self, key: int) -> RankId | None:
        """The rank the block was last routed to, while it is tracked; None otherwise."""
        batch = self._pairs.get(key)
        return None if batch is None else batch.rank.rank

    def ranks(self) -> list[RankId]:
        return list(self._ranks)

    def booked_depths(self, keys: Sequence[int], held: dict[RankId, int]) -> dict[RankId, int]:
        """How deep each rank holds the prompt `keys` once bookings count as held.

        `held` is each rank's depth in the index; from there a rank's depth extends over the
        blocks booked on it. Only ranks where bookings add something are in the answer.
        """
        out: dict[RankId, int] = {}
        n = len(keys)
        if not n:
            return out
        for rank in self._booking_ranks:
            start = depth = held.get(rank, 0)
            get = self._ranks[rank].booked.get
            while depth < n and (booking := get(keys[depth])) is not None and not booking.ended:
                depth += 1
            if depth > start:
                out[rank] = depth
        return out

    # -- writes ----------------------------------------------------------------------------

    def record(
        self, rank: RankId, keys: Sequence[int], held: int = 0, holds: Holds | None = None
    ) -> tuple[int, int]:
        """`keys` (a prompt's block keys, root first) were routed to `rank` now, which the
        index shows holding the first `held` of them: the rest are booked on it.

        Returns `(first, stop)`: what is worth telling the siblings, `keys[first:stop]`, the
        keys this changed (a weight, or a booking) but the prompt's own tail, which leaves the
        working set at once (module docstring, "Working sets"); empty (`first >= stop`) when
        nothing else changed."""
        now = self._clock()
        first = stop = len(keys)
        if now - self._origin > _REBASE_AFTER_HALF_LIVES * self.settings.demand_half_life_s:
            self._rebase(now)
        st = self._ranks.get(rank)
        if st is None:
            st = self._ranks[rank] = _RankLedger(rank)
        if keys:
            batches = st.batches
            filed = len(batches)
            first, tail = self._weigh(st, keys, self._weight(now))
            stop -= tail
            if held < len(keys) and self.settings.booking_ttl_s > 0:
                made = tuple(map(batches.__getitem__, range(filed - len(batches), 0)))
                self._book(now, rank, st, keys, held, made)
                first = min(first, held)
        self._prune(st, now)
        self._sweep(now, st)
        return first, stop

    def move(
        self,
        routed: RankId,
        served: RankId,
        keys: Sequence[int],
        held: int = 0,
        holds: Holds | None = None,
    ) -> tuple[int, int]:
        """A prompt recorded on `routed` was served by `served` instead (the proxy failed over):
        its live booking on `routed` ends (counted `moved`), and the prompt is recorded on
        `served`, which holds its first `held` blocks; its demand follows. Returns as `record`."""
        st = self._ranks.get(routed)
        if st is not None and self._end_newest(routed, st, keys) is not None:
            self.bookings.moved += 1
            self._rebuild_booked(st)  # the older bookings of its keys still hold them
        return self.record(served, keys, held, holds)

    def refuse(self, routed: RankId, keys: Sequence[int]) -> None:
        """The engine behind `routed` refused the prompt `keys` (a 4xx): it caches none of it,
        so the booking its record made ends (counted `refused`), and the demand that record
        put in its batches leaves the ledger (module docstring: nothing older is restored).
        The rank's booked map is not rebuilt (a flood of refused requests must not cost a
        rebuild each): an older live booking of the same keys stops counting with it, which
        only under-counts."""
        st = self._ranks.get(routed)
        if st is None or (booking := self._end_newest(routed, st, keys)) is None:
            return
        self.bookings.refused += 1
        for batch in booking.batches:
            if batch.live > 0:  # its pairs still mapped to it; the others moved on since
                i, dropped = self._drop_run(batch.keys, batch.start, batch.live, batch)
                st.listed -= i - batch.start
                batch.start = i
                self._unweigh(batch, dropped)
        if not st.pairs:
            st.total = st.superseded = 0.0  # no rounding residue on an empty rank

    def forget_ranks(self, ranks: Iterable[RankId]) -> None:
        """The ranks' worker left the registry: their pairs and bookings go now (the bookings
        counted `departed`). Left to decay, their pairs kept their share of
        `max_tracked_blocks` for 16 half-lives, and after a rollout to new addresses the live
        ranks' shares, their demand with them, were cut to about half."""
        for rank in ranks:
            st = self._ranks.pop(rank, None)
            if st is None:
                continue
            for batch in st.batches:
                if batch.live > 0:
                    self._drop_run(batch.keys, batch.start, batch.live, batch)
            self.bookings.departed += len(st.bookings)
            self._booked_blocks -= st.booked_blocks
            self._booking_ranks.discard(rank)

    def _end_newest(self, rank: RankId, st: _RankLedger, keys: Sequence[int]) -> _Booking | None:
        """End the rank's newest live booking of the prompt `keys` (the one its decision made:
        a booking holds the prompt's blocks past what the rank held); None if none is live."""
        if keys:
            for booking in reversed(st.bookings):
                start = len(keys) - len(booking.keys)
                if start >= 0 and booking.keys[0] == keys[start]:
                    st.bookings.remove(booking)
                    self._release(rank, st, booking)
                    return booking
        return None

    def settle(self, holds: Holds | None) -> None:
        """End the bookings whose blocks the index now shows (`holds` asks it), or whose TTL
        has passed: per rank oldest first, stopping at the first one still pending."""
        if not self._booking_ranks:
            return
        now = self._clock()
        for rank in list(self._booking_ranks):
            st = self._ranks[rank]
            queue = st.bookings
            while queue:
                booking = queue[0]
                if holds is not None and holds(rank, booking.keys[-1]):
                    self.bookings.confirmed += 1
                elif booking.ends_at <= now:
                    self.bookings.expired += 1
                else:
                    break
                self._release(rank, st, queue.popleft())

    # -- internals -------------------------------------------------------------------------

    def _weight(self, t: float) -> float:
        return 2.0 ** ((t - self._origin) / self.settings.demand_half_life_s)

    def _scale(self, now: float) -> float:
        return 2.0 ** (-(now - self._origin) / self.settings.demand_half_life_s)

    def _weigh(self, st: _RankLedger, keys: Sequence[int], w: float) -> tuple[int, int]:
        """Weigh `keys` on the rank at `w` in one new batch (two when the prompt's own tail
        goes in one of its own); returns the first key weighed, or `len(keys)`, and the length
        of the prompt's own tail, superseded at once (0: none)."""
        batch = _Batch(st, w)
        pairs = self._pairs
        n = len(keys)
        before = len(pairs)
        # One C-level pass maps the blocks new to the ledger (a new prompt's, most often) to
        # the batch and reads what the others map to: the table's lookups and stores are most
        # of the cost, so no block is looked up twice. It sums the answers up when they are a
        # prefix one record weighed and then blocks new to the ledger (`olds` None), the common
        # case, which needs no list of them.
        head, lead, olds = self._weigh_run(keys, batch)
        added = first_seen = len(pairs) - before
        tail = 0
        if added == n:
            first = 0
        elif olds is None and head is not batch:
            first, reweighed, tail = self._take_prefix(st, batch, keys, head, lead, w)
            added += reweighed
        else:
            first, reweighed, tail = self._reweigh(
                st, batch, keys, [batch] * n if olds is None else olds, w * _REFRESH_FACTOR
            )
            added += reweighed
        if not added:
            return first, 0
        if tail and added > tail:
            # Blocks weighed again and the prompt's own tail: the tail in a batch of its own,
            # so that it alone leaves the working set.
            own = _Batch(st, w)
            moved = self._move_run(keys, n - tail, n, batch, own)
            self._file(st, batch, keys[: n - tail], first, added - moved)
            self._file(st, own, keys, n - tail, moved)
            batch.first_seen, own.first_seen = first_seen - moved, moved
            _supersede(own)
        else:
            self._file(st, batch, keys, first, added)
            batch.first_seen = first_seen
            if tail:
                _supersede(batch)
        return first, tail

    @staticmethod
    def _file(st: _RankLedger, batch: _Batch, keys: Sequence[int], start: int, live: int) -> None:
        """Append `batch`, weighing `live` pairs and listing `keys[start:]`, to the rank's."""
        batch.keys = _u64_array(keys, start)
        batch.live = live
        st.batches.append(batch)
        st.listed += len(keys) - start
        st.pairs += live
        st.total += batch.weight * live

    def _reweigh(
        self,
        st: _RankLedger,
        batch: _Batch,
        keys: Sequence[int],
        olds: list[_Batch],
        fresh: float,
    ) -> tuple[int, int, int]:
        """The slow path of `_weigh`, for a prompt with blocks already weighed (`olds`, what
        each key mapped to) in another shape than `_take_prefix`'s: those weighed on the rank
        within the last 1/64 of a half-life (`fresh`) keep their weight and their place, so a
        hot prefix routed again and again costs one lookup per block; the others are weighed
        again in `batch`. Returns the first key weighed, new ones included, or `len(keys)`;
        how many were weighed again; and how many of the last keys, new to the ledger, are the
        prompt's own tail (0: none is)."""
        pairs = self._pairs
        get = pairs.get
        kept: _Batch | None = None  # the last batch found fresh on this rank
        taken: _Batch | None = None  # the batch the run of keys being reweighed comes from
        run = 0  # their number so far
        reweighed = 0
        n = first = len(keys)
        i = 0
        while i < n:
            old = olds[i]
            if old is kept:
                i += 1
                continue
            if old is not batch:
                key = keys[i]
                if old is not taken:
                    if old.rank is st and old.weight >= fresh:
                        kept = old
                        i += 1
                        continue
                    if get(key) is batch:  # listed twice in the prompt: weighed already
                        i += 1
                        continue
                    if run:
                        self._unweigh(taken, run)  # type: ignore[arg-type]
                    taken = old
                    size = olds.count(old)
                    if olds[i : i + size].count(old) == size:
                        # Every block of the prompt that record weighed, in one run here (a
                        # conversation's history below a system prompt, one record's turn):
                        # moved in one C-level pass, as block by block below.
                        run = self._move_run(keys, i, i + size, old, batch)
                        reweighed += run
                        if i < first:
                            first = i
                        i += size
                        continue
                    run = 1
                elif get(key) is batch:
                    i += 1
                    continue
                else:
                    run += 1
                pairs[key] = batch
                reweighed += 1
            if i < first:
                first = i
            i += 1
        if run:
            self._unweigh(taken, run)  # type: ignore[arg-type]
        new = olds.count(batch)
        tail = 0
        if 0 < new < n and olds[n - new :].count(batch) == new:
            # The prompt ends with blocks new to the ledger, below the record that weighed the
            # block before them: taken over here (its run moved to `batch`), or kept fresh.
            prior = olds[n - new - 1]
            if prior is taken:
                _taken_over(prior, run)
                tail = _tail(run, new)
            elif prior is not batch:
                tail = _tail(n - new, new)
        return first, reweighed, tail

    def _take_prefix(
        self, st: _RankLedger, batch: _Batch, keys: Sequence[int], head: _Batch, lead: int, w: float
    ) -> tuple[int, int, int]:
        """The common path of `_weigh`, as `_reweigh` would take it: the prompt's first `lead`
        keys are weighed by one earlier record (`head`), and the rest are new to the ledger
        (weighed already, in `batch`)."""
        n = len(keys)
        if head.rank is st and head.weight >= w * _REFRESH_FACTOR:
            # A hot prefix (or a whole prompt) kept fresh: kept where it is, the most common
            # case once a system prompt is cached.
            return (n, 0, 0) if lead == n else (lead, 0, _tail(lead, n - lead))
        # On another rank, or weighed long enough ago: the prefix moves to `batch` in one
        # C-level pass. (A system prompt cached on two ranks, routed to each in turn.)
        moved = self._move_run(keys, 0, lead, head, batch)
        self._unweigh(head, moved)
        _taken_over(head, moved)
        return 0, moved, _tail(moved, n - lead)

    @staticmethod
    def _unweigh(batch: _Batch, count: int) -> None:
        """`count` of the batch's pairs were weighed again: they no longer count there."""
        batch.live -= count
        st = batch.rank
        st.pairs -= count
        st.total -= batch.weight * count
        if batch.superseded:
            st.superseded -= batch.weight * count

    def _book(
        self,
        now: float,
        rank: RankId,
        st: _RankLedger,
        keys: Sequence[int],
        held: int,
        batches: tuple[_Batch, ...],
    ) -> None:
        self.bookings.made += 1
        booked_keys = keys[held:]
        size = len(booked_keys)
        booking = _Booking(now + self.settings.booking_ttl_s, booked_keys, batches)
        st.bookings.append(booking)
        if len(st.booked) > 2 * st.booked_blocks + _STALE_SLACK:
            self._rebuild_booked(st)
        elif not st.booked:  # emptied when its last booking ended: at c=1, every request
            _reserve(st.booked, size)
        _put_run(st.booked, booked_keys, booking)
        self._booking_ranks.add(rank)
        st.booked_blocks += size
        self._booked_blocks += size
        while self._booked_blocks > self.settings.max_tracked_blocks:
            oldest = min(self._booking_ranks, key=lambda r: self._ranks[r].bookings[0].ends_at)
            st_old = self._ranks[oldest]
            self.bookings.expired += 1
            self._release(oldest, st_old, st_old.bookings.popleft())

    def _release(self, rank: RankId, st: _RankLedger, booking: _Booking) -> None:
        booking.ended = True
        st.booked_blocks -= len(booking.keys)
        self._booked_blocks -= len(booking.keys)
        if not st.bookings:
            self._booking_ranks.discard(rank)
            st.booked.clear()

    @staticmethod
    def _rebuild_booked(st: _RankLedger) -> None:
        """Map the rank's booked keys from its live bookings alone, newest last."""
        st.booked.clear()
        # Room for all it may hold before the next of these: growing from empty instead, the
        # compiled map copied ~2.5 times its entries between two (a third of a booking's cost).
        _reserve(st.booked, 2 * st.booked_blocks + _STALE_SLACK)
        for booking in st.bookings:
            _put_run(st.booked, booking.keys, booking)

    def _prune(self, st: _RankLedger, now: float) -> None:
        """Drop the rank's pairs that weigh next to nothing, and its oldest beyond its share;
        compact its batches when they list too many stale entries."""
        share = self.settings.max_tracked_blocks // max(1, len(self._ranks))
        floor = self._weight(now - _FORGET_AFTER_HALF_LIVES * self.settings.demand_half_life_s)
        batches = st.batches
        while batches:
            batch = batches[0]
            if batch.live <= 0:
                batches.popleft()
                st.listed -= len(batch.keys) - batch.start
                continue
            if batch.weight >= floor and st.pairs <= share:
                break
            goal = batch.live if batch.weight < floor else min(batch.live, st.pairs - share)
            i, dropped = self._drop_run(batch.keys, batch.start, goal, batch)
            st.listed -= i - batch.start
            batch.start = i
            self._unweigh(batch, dropped)
        if not st.pairs:
            st.total = st.superseded = 0.0  # no rounding residue on an empty rank
        if st.listed > 2 * st.pairs + _STALE_SLACK:
            self._compact(st)

    def _compact(self, st: _RankLedger) -> None:
        """Rewrite the rank's batches with their live pairs alone, in the same order: each
        batch's keys filtered in one C-level pass when compiled (a conversation's turn lists its
        history again, so a chat fleet's ranks compact every few thousand records, each time
        over up to twice their share of `max_tracked_blocks`)."""
        kept_run = self._kept_run
        batches: deque[_Batch] = deque()
        for batch in st.batches:
            if batch.live:
                keys = array("Q", kept_run(batch.keys, batch.start, batch))
                if len(keys) > batch.live:  # a key listed twice (its batch's live are distinct)
                    keys = array("Q", dict.fromkeys(keys))  # its first place
                batch.keys = keys
                batch.start = 0
                batches.append(batch)
        st.batches = batches
        st.listed = st.pairs

    def _sweep(self, now: float, pruned: _RankLedger) -> None:
        """Prune one more rank per record, in turn, so ranks no longer routed to shrink too;
        forget a rank once it has neither pairs nor live bookings. The rank the record has
        just pruned (`pruned`, at the same `now`) is not pruned again: a prune leaves nothing
        the next one at that time would drop or compact (in a two-rank fleet, every other
        record's sweep)."""
        if not self._ranks:
            return
        ranks = list(self._ranks)
        rank = ranks[self._sweep_next % len(ranks)]
        self._sweep_next += 1
        st = self._ranks[rank]
        if st is not pruned:
            self._prune(st, now)
        if not st.pairs and not st.bookings:
            del self._ranks[rank]

    def _rebase(self, now: float) -> None:
        """Move the weights' origin to `now` (keeps 2 ** x far from overflow), recomputing
        each rank's sum exactly, which also clears rounding residue."""
        factor = self._scale(now)
        for st in self._ranks.values():
            for batch in st.batches:
                batch.weight *= factor
            st.total = math.fsum(batch.weight * batch.live for batch in st.batches)
            st.superseded = math.fsum(b.weight * b.live for b in st.batches if b.superseded)
        self._origin = now


def _supersede(batch: _Batch) -> None:
    if batch.live > 0 and not batch.superseded:
        batch.superseded = True
        batch.rank.superseded += batch.weight * batch.live


def _taken_over(prior: _Batch, moved: int) -> None:
    """A prompt took over `moved` blocks from `prior`'s record and went on with blocks new to
    the ledger: what `prior` keeps past them, when shorter than them and no more than its
    record saw first, is its own tail, superseded by this prompt's (module docstring,
    "Working sets")."""
    if 0 < prior.live < moved and prior.live <= prior.first_seen:
        _supersede(prior)


def _tail(shared: int, new: int) -> int:
    """A prompt's `new` last blocks, new to the ledger, after `shared` it took up or kept:
    its own tail when shorter than what it shares (then `new`; module docstring, "Working
    sets"), else another prefix below a shared preamble, still in use (0)."""
    return new if new < shared else 0


_Runs = tuple["_Batch | None", int, "list[_Batch] | None"]


def _weigh_run_py(pairs: MutableMapping[int, _Batch], keys: Sequence[int], batch: _Batch) -> _Runs:
    """Map each of `keys` not in `pairs` to `batch`: (what the first key maps to, the length
    of the leading run of keys mapped to it, None when every key after that run maps to
    `batch`, else the list of what each key maps to). The compiled twin is
    `NodeMap.weigh_run`."""
    olds = list(map(pairs.setdefault, keys, repeat(batch)))
    if not olds:
        return None, 0, None
    head = olds[0]
    n = lead = len(olds)
    for i, old in enumerate(olds):
        if old is not head:
            lead = i
            break
    return head, lead, None if olds[lead:].count(batch) == n - lead else olds


def _move_run_py(
    pairs: MutableMapping[int, _Batch],
    keys: Sequence[int],
    start: int,
    stop: int,
    old: _Batch,
    new: _Batch,
) -> int:
    """Map each of `keys[start:stop]` still mapped to `old` to `new`: how many were. The
    compiled twin is `NodeMap.move_run`."""
    moved = 0
    for key in keys[start:stop]:
        if pairs.get(key) is old:
            pairs[key] = new
            moved += 1
    return moved


def _kept_run_py(
    pairs: MutableMapping[int, _Batch], keys: array[int], start: int, batch: _Batch
) -> bytes:
    """The native u64s of `keys[start:]` still mapped to `batch`, in order (a key listed twice
    each time). The compiled twin is `NodeMap.kept_run`."""
    get = pairs.get
    return array("Q", [k for k in keys[start:] if get(k) is batch]).tobytes()


def _drop_run_py(
    pairs: MutableMapping[int, _Batch], keys: Sequence[int], start: int, goal: int, batch: _Batch
) -> tuple[int, int]:
    """From `keys[start]` on, drop the pairs still mapped to `batch`, until `goal` are dropped
    (or the keys end): (the position after the last key read, how many were dropped). The
    compiled twin is `NodeMap.drop_run`."""
    get = pairs.get
    i, n, dropped = start, len(keys), 0
    while dropped < goal and i < n:
        key = keys[i]
        i += 1
        if get(key) is batch:
            del pairs[key]
            dropped += 1
    return i, dropped
