"""Prefix homes: each prefix keeps one rank, placed by the blocks each rank was given.

cache_aware alone places a new prefix by the momentary cost, where one request of load
difference or the siblings' tie hash decides, blind to how many prefix blocks each rank was
already given; and a prefix follows each routed request, so a request sent to a lighter rank
takes its prefix's demand along. Under sustained concurrency (c=12-16 on 4-8 workers) that
spreads the prefixes unevenly and copies them, and the over-given ranks thrash (measured in
`bench/pressure_sim.py --diagnose`, BENCHMARKS.md "Routing under cache pressure"). An online
greedy placement (each new prefix onto the rank given the fewest blocks, for good) reaches
the ideal partition there; this table is what a replica can keep of it with what it knows.

Theory of operation
-------------------
- A *home* is registered when a prefix is placed, at its *anchor*: the prompt's first block
  that no rank held (index and this replica's bookings) when it was placed. A preamble held
  wherever it is used is nobody's anchor, so each prefix below it gets its own home. A home
  is found by the deepest registered key along a prompt's chain (its anchor, or its *join*
  key: a tail above the placing prompt's end rounded down to a power of two blocks past the
  anchor, so siblings placing one prefix at once with different tails register one key).
- A home keeps the placing prompt's chain of keys (`Home.chain`, at most
  `MAX_CHAIN_BLOCKS`), so a prompt that found it leaves it at an exact depth, `shared`,
  however much of the prefix the caches still hold. `CacheAwareHome._split` then reads the
  prompt as a repeat of the homed prefix (its own part, at most `tail_blocks`, registered as
  a *tail's home* on the same rank, homing no blocks until a later prompt shares it), or as
  a new prefix below their shared part (leaving above the depth the home's prompts
  confirmed, going on more than `tail_blocks`, or held deeper by another rank).
- A homed prompt goes home unless the home is more than `keep_bound` requests above the
  lightest rank (then cache_aware decides that request; the home stays: *kept away*). A new
  prefix's home is the rank given the fewest blocks (homed there, decayed, plus the prompt's
  held part it would newly store) among the ranks at most `place_bound` above the
  lightest. A home that does not hold its anchor `settle_s` after it was set lost it to its
  cache (it was given more than it holds): the prefix is placed again, one generation later.
- Homes reach the siblings like the decisions (`router.siblings`): a sibling's home replaces
  one of the same key only when preferred (`_preference`: the later generation, then the
  earlier placement by the wall clock, then the lower rank), so replicas converge.
- Bounded: at most `max_homes` entries, least recently used out; an entry's blocks count for
  its rank halved every `half_life_s` since its last use, and an entry unused for
  `forget_half_lives` half-lives is forgotten (swept from the least recently used end on
  every decision). Per-rank homed blocks are kept as running sums, so a placement reads
  each candidate's in O(1).

Off by default (`--prefix-homes`): live, it was level with plain cache_aware on most pressure
workloads, lower on two, and lost the routing trace's growing conversations (BENCHMARKS.md,
"The prefix home LIVE"). `bench/pressure_sim.py` plays this code as `cache_aware_home`.

Sans-I/O: plain code over an injected monotonic clock (ages, settling) and wall clock (the
placement stamp siblings compare); the decision wrapper adds no I/O to cache_aware's.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar, Final

from cachetree.ranks import RankId
from router.policy import (
    CACHE_HIT,
    CACHE_MISS,
    IMBALANCE_FALLBACK,
    CacheAware,
    Candidate,
    Decision,
    Prompt,
    load_of,
)

# A home remembers at most this many keys of its placing prompt (4,096 tokens at 16 per
# block), packed 8 bytes each: a prompt that matches all of them is taken to hold the whole
# prefix. So a home takes at most about 2.3 KiB (a chain of 40-100 keys: 0.5-1 KiB), and the
# default table at most about 45 MiB.
MAX_CHAIN_BLOCKS: Final = 256
DEFAULT_MAX_HOMES: Final = 20_000
MAX_HOMES_BOUND: Final = 1_000_000


@dataclass(frozen=True)
class HomeSettings:
    """The home table's knobs (module docstring; defaults chosen in `bench/pressure_sim.py`
    on the pressure family and its hold-outs, BENCHMARKS.md).

    `tail_blocks` (11): a request's own tail, at most; it must cover the longest tail (a
    repeat whose tail is longer is copied to another rank), while prefixes below a preamble
    whose own part is shorter go to the preamble's home until their repeats confirm them.
    `join_tail_blocks` (8) only places the join key. `place_bound` (4): bounds of 1 placed
    by load where blocks should decide. `keep_bound` (8): bounds of 2-4 copied prefixes away
    from their homes. `settle_s` (0.1): 0.03 re-placed prefixes whose first request still
    queued. `half_life_s` (30) as the ledger's demand."""

    tail_blocks: int = 11
    join_tail_blocks: int = 8
    place_bound: int = 4
    keep_bound: int = 8
    max_homes: int = DEFAULT_MAX_HOMES
    half_life_s: float = 30.0
    forget_half_lives: float = 8.0
    settle_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_homes < 1:
            raise ValueError("max_homes must be >= 1")
        if min(self.tail_blocks, self.join_tail_blocks, self.place_bound, self.keep_bound) < 0:
            raise ValueError(
                "tail_blocks, join_tail_blocks, place_bound and keep_bound must be >= 0"
            )
        if not (self.half_life_s > 0 and self.forget_half_lives > 0 and self.settle_s >= 0):
            raise ValueError("half_life_s and forget_half_lives must be > 0, settle_s >= 0")

    @property
    def forget_after_s(self) -> float:
        return self.half_life_s * self.forget_half_lives


@dataclass(slots=True)
class Home:
    rank: RankId
    anchor: int  # the key of the prefix's first block no rank held when it was placed ...
    depth: int  # ... at this position: the blocks of shared part above it
    join: int  # the key it is registered at, past the anchor (`HomeTable.join_at`)
    chain: Sequence[int]  # the placing prompt's keys from the anchor on (capped, packed)
    generation: int  # 0 when first placed, +1 each time it is re-placed
    set_at: float  # when it was set, on this table's clock (a sibling's: when adopted)
    stamp: float = 0.0  # when it was placed, wall clock: what siblings compare
    length: int = 0  # the placing prompt's blocks from the anchor on (the chain uncapped)
    used_at: float = 0.0
    # A prompt of this home that leaves its chain above this depth begins a new prefix
    # there: the deepest two of its prompts shared, or one block past the anchor of a tail
    # that a later prompt shared (`HomeTable.observe`).
    confirmed: int = -1
    # A repeat's tail, not yet a prefix: the anchor of the home it left (None for a home
    # placed as a prefix). A later prompt sharing its blocks makes it one.
    tail_of: int | None = None

    def __post_init__(self) -> None:
        self.confirmed = max(self.confirmed, self.depth)
        self.length = max(self.length, len(self.chain))
        self.chain = array("Q", self.chain[:MAX_CHAIN_BLOCKS])

    @property
    def blocks(self) -> int:
        """The blocks it homes on its rank: a tail nobody shared homes none (they are its
        parent's request's own)."""
        return 0 if self.tail_of is not None else self.length

    def shared(self, keys: Sequence[int]) -> int:
        """The depth at which the prompt `keys` leaves the placing prompt's chain (all of
        the prompt when it matches a capped chain to its end)."""
        at = self.depth
        for mine, theirs in zip(self.chain, keys[self.depth :], strict=False):
            if mine != theirs:
                return at
            at += 1
        return len(keys) if len(self.chain) < self.length else at


def _preference(home: Home) -> tuple[int, float, RankId]:
    """Between two homes of one prefix: the latest generation, then the earliest placed,
    then the lower rank (every replica picks the same)."""
    return -home.generation, home.stamp, home.rank


@dataclass(slots=True)
class HomeStats:
    placed: int = 0  # new prefixes given a home by this replica
    replaced: int = 0  # homes that lost their prefix to their cache, placed again
    kept_away: int = 0  # homed requests sent elsewhere: the home over the keep bound
    adopted: int = 0  # siblings' homes (and their news) taken into this table
    forgotten: int = 0  # homes unused for forget_half_lives half-lives, dropped
    evicted: int = 0  # homes dropped at the max_homes bound, least recently used


class HomeTable:
    """Prefix homes by their join key, and by anchor the latest home anchored there. Two
    homes with one anchor are two prefixes that diverge below it (placed at once, before the
    first one's blocks were held), or one prefix placed twice by siblings at once with join
    keys apart (its prompts then hold both, and the one siblings prefer is kept)."""

    def __init__(
        self,
        settings: HomeSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else HomeSettings()
        self.clock = clock
        self.wall = wall if wall is not None else clock
        self.stats = HomeStats()
        self._homes: OrderedDict[int, Home] = OrderedDict()  # by join, least recent first
        self._anchors: dict[int, int] = {}  # anchor -> the join of its latest home
        # Per rank: sum of blocks * 2 ** ((used_at - base) / half_life); homed() scales it
        # to now. Recomputed from the entries (no drift) once `base` is a horizon old.
        self._weights: dict[RankId, float] = {}
        self._base = clock()

    def __len__(self) -> int:
        return len(self._homes)

    def join_at(self, depth: int, blocks: int) -> int:
        """Where a prefix anchored at `depth` in a prompt of `blocks` is registered:
        `join_tail_blocks` above the prompt's end, rounded down to a power of two blocks
        past the anchor, so that siblings placing one prefix at once with requests of
        different tails most often register it at the same key."""
        own = blocks - self.settings.join_tail_blocks - depth
        at = depth if own <= 1 else depth + (1 << (own.bit_length() - 1)) - 1
        return min(at, depth + MAX_CHAIN_BLOCKS - 1)

    def home(self, rank: RankId, keys: Sequence[int], depth: int) -> Home:
        """A new home on `rank` for the prefix of `keys` anchored at `depth` (not placed)."""
        join = keys[self.join_at(depth, len(keys))]
        chain = keys[depth : depth + MAX_CHAIN_BLOCKS]
        return Home(rank, keys[depth], depth, join, chain, 0, self.clock(), self.wall(),
                    len(keys) - depth)  # fmt: skip

    def find(self, keys: Sequence[int]) -> Home | None:
        """The home of the deepest registered key along the chain `keys` (a join, or an
        anchor), marked used. One lookup per key from the deepest up, so a prefix's own home
        wins over the home of the prefix that first brought a preamble they share; past a
        join hit the walk goes on to its anchor to drop a second home of the same prefix."""
        homes, anchors = self._homes, self._anchors
        for at in range(len(keys) - 1, -1, -1):
            key = keys[at]
            if key in homes:
                home = self.lookup(key)
                if home is not None:
                    return self._drop_doubles(home, keys, at)
            elif key in anchors:
                home = self.lookup(anchors[key])
                if home is not None:
                    return home
        return None

    def _drop_doubles(self, home: Home, keys: Sequence[int], at: int) -> Home:
        """`home` (joined at `keys[at]`) and the homes of the same anchor joined on the chain
        above it are one prefix placed twice: the one siblings prefer stays."""
        doubles = [
            other
            for key in keys[home.depth : at]
            if (other := self._homes.get(key)) is not None and other.anchor == home.anchor
        ]
        if not doubles:
            return home
        kept = min([home, *doubles], key=_preference)
        for other in [home, *doubles]:
            if other is not kept:
                self._drop(other.join)
        self._touch(kept)
        self._anchors[kept.anchor] = kept.join
        return kept

    def lookup(self, join: int) -> Home | None:
        """The home joined at `join`, marked used; None when unknown or forgotten."""
        home = self._homes.get(join)
        if home is None:
            return None
        if self.clock() - home.used_at > self.settings.forget_after_s:
            self._drop(join)
            self.stats.forgotten += 1
            return None
        self._touch(home)
        return home

    def homed(self, rank: RankId) -> float:
        """The blocks homed on `rank`, each entry's halved every half-life since its use."""
        weight = self._weights.get(rank, 0.0)
        if not weight:
            return 0.0
        return weight * 0.5 ** ((self.clock() - self._base) / self.settings.half_life_s)

    def ranks(self) -> list[RankId]:
        """The ranks some home is on."""
        return [rank for rank, weight in self._weights.items() if weight > 0]

    def forget(self) -> None:
        """Drop the homes unused for `forget_half_lives` half-lives (from the least recently
        used end), and rebase the per-rank sums once their base is that old."""
        now = self.clock()
        horizon = self.settings.forget_after_s
        homes = self._homes
        while homes:
            oldest = next(iter(homes.values()))
            if now - oldest.used_at <= horizon:
                break
            self._drop(oldest.join)
            self.stats.forgotten += 1
        if now - self._base > horizon:
            self._base = now
            self._weights = {}
            for home in homes.values():
                self._weigh(home, 1.0)

    def observe(self, home: Home, keys: Sequence[int], shared: int) -> list[Home]:
        """A repeat of `home` that left its chain at `shared`. The blocks two of its prompts
        share are its prefix's: they confirm it that deep. A tail's home that a second prompt
        shares was a prefix: from then on its parent's prompts that leave at its anchor are
        new prefixes. The prompt's own part past `shared`, if any, is returned as a tail's
        home on the same rank, for a later prompt to confirm or for the table to forget."""
        confirmed: list[Home] = []
        if shared > home.confirmed:
            home.confirmed = shared
            confirmed.append(home)
            if home.tail_of is not None:
                join = self._anchors.get(home.tail_of)
                parent = None if join is None else self.lookup(join)
                if parent is not None and parent.confirmed <= home.depth:
                    parent.confirmed = home.depth + 1
                    confirmed.append(parent)
                self._weigh(home, -1.0)
                home.tail_of = None
                self._weigh(home, 1.0)
        if shared >= len(keys) or keys[shared] in self._anchors:
            return confirmed
        tail = self.home(home.rank, keys, shared)
        tail.tail_of = home.anchor
        return [*confirmed, self.place(tail)]

    def place(self, home: Home, sibling: bool = False) -> Home:
        """Set a home at its join key. A sibling's (`sibling`) replaces only one this table
        prefers less (`_preference`), so replicas converge."""
        old = self._homes.get(home.join)
        if sibling:
            self.stats.adopted += 1
            if old is not None and _preference(old) <= _preference(home):
                if old.anchor == home.anchor:  # what the sibling's prompts confirmed holds
                    old.confirmed = max(old.confirmed, home.confirmed)
                return old  # a sibling's news of a home this table already prefers
        if old is not None:
            self._drop(home.join)
        home.used_at = self.clock()
        self._homes[home.join] = home
        self._anchors[home.anchor] = home.join
        self._weigh(home, 1.0)
        while len(self._homes) > self.settings.max_homes:
            self._drop(next(iter(self._homes)))
            self.stats.evicted += 1
        return home

    def _touch(self, home: Home) -> None:
        self._weigh(home, -1.0)
        home.used_at = self.clock()
        self._weigh(home, 1.0)
        self._homes.move_to_end(home.join)

    def _weigh(self, home: Home, sign: float) -> None:
        blocks = home.blocks
        if blocks:
            age = (home.used_at - self._base) / self.settings.half_life_s
            total = self._weights.get(home.rank, 0.0) + sign * blocks * 2.0**age
            # A rank's last home gone leaves float dust: clear it.
            self._weights[home.rank] = total if total > 1e-9 else 0.0

    def _drop(self, join: int) -> None:
        home = self._homes.pop(join)
        self._weigh(home, -1.0)
        if self._anchors.get(home.anchor) == join:
            del self._anchors[home.anchor]


def _no_share(home: Home) -> None:
    return None


@dataclass
class CacheAwareHome:
    """cache_aware with a prefix home (module docstring): a homed prompt goes to its home
    unless the home is gone or more than `keep_bound` requests above the lightest rank; a
    new prefix (no home on its chain, or one that leaves a home's chain where its prompts
    say a new prefix begins: `_split`) is anchored at its first block no rank holds and goes
    to the rank given the fewest blocks for it, among those within `place_bound` of the
    lightest. A home that lost its anchor is placed again. The ledger's booking and demand
    follow the home (`Decision.served`). `share` tells the siblings of each home placed or
    changed (`router.siblings`); theirs come back through `adopt`."""

    inner: CacheAware
    table: HomeTable = field(default_factory=HomeTable)
    share: Callable[[Home], None] = _no_share
    name: ClassVar[str] = "cache_aware"

    def _held(self, candidates: Sequence[Candidate], prompt: Prompt) -> dict[RankId, int]:
        """How deep each rank holds the prompt, its bookings counted (read before the
        decision books this prompt; past the bookings the index confirmed or that expired)."""
        self.inner.settle()
        any_tier = {} if prompt.depths is None else prompt.depths.any_tier
        booked = self.inner.ledger.booked_depths(prompt.keys, any_tier)
        return {c.rank: max(any_tier.get(c.rank, 0), booked.get(c.rank, 0)) for c in candidates}

    def _place(
        self, ranked: Sequence[Candidate], loads: dict[RankId, int], held: dict[RankId, int]
    ) -> RankId:
        """The fewest blocks given, homed there and held elsewhere (what it would newly
        store of the prompt's part some rank holds), among the ranks within the load bound;
        ties in cache_aware's order."""
        bound = min(loads.values()) + self.table.settings.place_bound
        deepest = max(held.values())
        homed = self.table.homed
        return min(
            (c.rank for c in ranked if loads[c.rank] <= bound),
            key=lambda r: homed(r) + deepest - held[r],
        )

    def _lost(self, home: Home, held: dict[RankId, int]) -> bool:
        """The home no longer holds the anchor though it has had `settle_s` to store it:
        its cache pushed the prefix out, so it was given more than it holds."""
        if self.table.clock() - home.set_at < self.table.settings.settle_s:
            return False
        return held.get(home.rank, 0) <= home.depth

    def _split(
        self, home: Home, held: dict[RankId, int], keys: Sequence[int], shared: int
    ) -> int | None:
        """Where a prompt that found `home` and leaves its chain at `shared` begins a prefix
        of its own, or None when it is a repeat of the homed prefix with a tail of its own.
        Another rank's prefix if another rank holds it past `shared` (a placement this table
        missed or forgot). A new prefix below their shared part if it leaves the chain above
        the depth the home's prompts confirmed (`Home.confirmed`: a block two prompts share
        is a prefix's), or if it goes on more than `tail_blocks` past `shared`. Otherwise a
        repeat, whose own part becomes a tail's home on the same rank
        (`HomeTable.observe`). (`shared` is exact, read from the placing prompt's chain: a
        repeat whose prefix the caches cut short leaves at its prefix's end, not at what is
        still held.)"""
        if shared >= len(keys):
            return None
        if any(depth > shared for rank, depth in held.items() if rank != home.rank):
            return shared
        if shared < home.confirmed or len(keys) - shared > self.table.settings.tail_blocks:
            return shared
        return None

    def adopt(self, home: Home) -> None:
        """A sibling's home (or news of one: a depth its prompts confirmed)."""
        self.table.place(home, sibling=True)

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        keys = prompt.keys
        if not keys or len(candidates) < 2:
            return self.inner.decide(candidates, prompt)
        table = self.table
        table.forget()
        held = self._held(candidates, prompt)
        decision = self.inner.decide(candidates, prompt)
        if decision.outcome == IMBALANCE_FALLBACK:
            return decision
        loads = {c.rank: load_of(c) for c in candidates}
        deepest = max(held.values())
        home = table.find(keys)
        own = len(keys) - 1  # where this prompt's own part begins, when it needs a home
        if home is None:
            own = min(deepest, own)
        else:
            shared = home.shared(keys)
            split = self._split(home, held, keys, shared)
            if split is not None:
                home, own = None, min(split, own)
            elif home.rank in loads and not self._lost(home, held):
                for news in table.observe(home, keys, shared):
                    self.share(news)
                if loads[home.rank] > min(loads.values()) + table.settings.keep_bound:
                    table.stats.kept_away += 1
                    return decision
                return _send(decision, prompt, home.rank)
        target = self._place(decision.ranked, loads, held)
        if home is None:
            home = table.home(target, keys, own)
            table.stats.placed += 1
        else:  # the home lost its anchor (or left the candidates): the same prefix, again
            home = replace(home, rank=target, generation=home.generation + 1,
                           set_at=table.clock(), stamp=table.wall())  # fmt: skip
            table.stats.replaced += 1
        self.share(table.place(home))
        return _send(decision, prompt, target)


def _send(decision: Decision, prompt: Prompt, target: RankId) -> Decision:
    """`decision` with `target` first (the ledger's booking and demand follow)."""
    if target != decision.ranked[0].rank:
        decision.served(target)
        at = next(i for i, c in enumerate(decision.ranked) if c.rank == target)
        decision.ranked.insert(0, decision.ranked.pop(at))
        depths = prompt.depths
        decision.matched_blocks = 0 if depths is None else depths.any_tier.get(target, 0)
        decision.outcome = CACHE_HIT if decision.matched_blocks else CACHE_MISS
    return decision
