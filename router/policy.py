"""Routing policies: order a request's candidate ranks best first.

Every policy is plain synchronous code: `decide(candidates, prompt)` returns a `Decision` whose
`ranked` list the proxy walks in order, failing over to the next rank before the first byte.
The caller builds the candidates (healthy ranks, their router-side in-flight count and the
engine's last reported load) and, for `cache_aware`, the prompt's `PrefixDepths` and block
keys. Randomness comes from an injected `random.Random`, so a seeded policy decides the same
way every run; `cache_aware`'s ledger takes an injected clock.

Load
----
One number per candidate, used by every policy: `load = inflight + engine waiting`.
`inflight` is what this replica has sent and not yet seen finish: fresh, but blind to other
replicas. The engine's `waiting` queue is everyone's, but up to one poll interval old. Requests
this replica queued are counted in both; that double count only pushes harder away from a
queueing rank, which is the direction we want. An unknown engine load counts as no waiting.
Engine `running` is left out: continuous batching admits a new request next to running ones,
so running requests slow it down only a little, while waiting ones delay its first token by
their whole prefill.

cache_aware prices that load by what a new request would wait behind (`_queued`). An engine
that states how many requests it runs at once (`slots`: SGLang's `max_running_requests` in
`/v1/loads`, which the fake worker reports as its `--max-concurrency`) admits a new request at
once while fewer than `slots` are in flight: the requests it waits behind are
`ahead = max(load - slots + 1, 0)`, each priced as a queued request, and the others run beside
it, each priced `running_share` (0.25) of one: they share the engine's compute with it but do
not hold its first token back by their whole prefill. Where the slots are unknown (vLLM
states none; a load gone stale) the whole load is priced, as with one slot. Priced whole, one
request running on a prefix's holder outweighed a short prefix's hit (8-16 blocks, 128-256
tokens, against 256 a request), and its next request went to an idle rank, a copy the cache
had no room for (`bench/pressure_sim.py`, BENCHMARKS.md "Requests beside a free slot").

cache_aware: the cost function
------------------------------
For each candidate rank, with B the block size, T the prompt's token count, n = T // B its
full blocks, and from the index `d_dev` (leading blocks held on the device tier) and `d_any`
(on any tier, >= d_dev):

    cached   = B * (d_dev + (d_any - d_dev) * lower_tier_discount)
    new      = max(T - cached, 0)                    # prompt tokens this rank must prefill
    busy     = k * mean load of the candidates but the busiest   # k replicas share traffic
    queued   = ahead + running_share * (load - ahead)   # the load as the queue prices it
    cost     = prefill * new + queue * queued_request_tokens * queued / (1 + backlog * busy)
             + B * (evict * spill + fill * fullness * stored)      # cache pressure, below

The unit is "prefill-token equivalents": roughly the time before this request's first token.
Its own prefill is `new` tokens; each request queued ahead of it costs about
`queued_request_tokens` tokens of prefill (an average uncached prompt), each one running beside
it a quarter of that (`ahead` and `running_share`: "Load" above). A host- or disk-tier
block must be copied back before use, which is cheaper than recomputing it but not free:
`lower_tier_discount` is the fraction of a device block's saving it is credited with.

Backlog. When the typical rank is busy (`busy` requests in flight), a rank that looks
lighter fills up again with the next arrivals, so the queue difference a request buys by
going there is brief, while what it leaves behind lasts: the tokens it makes that rank
prefill hold up the requests queued behind them, and a copy of a prefix takes cache room the
fleet is short of. So the queue term is divided by `1 + backlog * busy`: with every rank idle
the cost is the plain one (c=1, a quiet fleet); in a saturated fleet a prefix stays on its
holder through load differences that would otherwise send copies of it around, and the
cache-pressure terms, which price what lasts, weigh more against a passing queue (a new
prefix goes where it fits rather than to whichever rank is a request lighter at that
moment). `busy` leaves the busiest rank out, so one hot rank among idle ones does not raise
it (a holder with a long queue still loses to an idle rank, as before); this replica sees
only its own share of each rank's in-flight, hence the factor k. Estimating a queued
request's prefill from what was routed (a decayed mean of the chosen ranks' `new` tokens,
instead of the fixed `queued_request_tokens`) was tried first and did not help: early in a
burst the queued requests are misses, so the estimate rose above 256 just when prefixes were
being copied (`bench/pressure_sim.py`, BENCHMARKS.md).

Cache pressure. A rank's cache is bounded: what a placement stores pushes something out once
it is full, and what it pushes out may be a prefix another request needs next. Four inputs,
per rank: its capacity C (device blocks, from what the engine states: `LoadMonitor`), what the
index shows it holding (`held`, device tier, plus blocks this replica booked there that the
index does not show yet), this replica's recent demand on it (`demand`: distinct blocks routed
there, halving every `--demand-half-life-s`; `router.pressure`), and bookings: a routed
prompt's new blocks count as held by the rank it went to until their store event arrives
(or `--booking-ttl-ms` passes), so the requests of a new prefix that arrive before its first
store event follow it rather than each looking like a miss. When the proxy fails over, the
data plane calls `Decision.served(rank)` and the booking and demand move to the rank that
served (`CacheAware.served`). Replicas that know each other share their decisions (`share`,
`adopt`; the transport is `router.siblings`): each records its siblings' routed blocks as its
own demand and bookings, so its ledger covers the fleet's traffic, not its share of it.
A new prefix on a replica with siblings is placed by one of them, the placer
(`router.placement`): it decides as here and shares it; the asker books the answer with
`place` (the placer's rank first, the rest by load to fail over to).
With `depth` = d_dev extended by bookings, `stored` = n - depth blocks the rank must newly
store:

    other    = max(demand - depth, 0) + unseen * max(held - demand, 0)
    free     = max(C - held, 0)
    spill    = max(stored - max(free, C - other - depth), 0)   # demanded blocks it evicts
    fleet    = min(sum(demand + unseen * max(held - demand, 0)) / sum(C), 1)   # candidates
    fullness = min((other + depth) / C, 1) * fleet

`other` is the demand the rank must keep besides this prompt. Storing fills free slots first,
then evicts blocks nobody asked for lately (pre-filled or gone-quiet content costs nothing to
evict), and only then blocks in demand: those are `spill`, each charged `evict` blocks of
prefill, since it will be prefilled again when asked for. `fill` charges each newly stored
block by how full of demand the rank is, so a new prefix goes where it is least likely to
push anything out, before anything is certain to be (with equal loads, a miss goes to the
least-demanded rank), scaled by how full of demand the fleet is: when the caches together
have room, a second copy of a prefix (a request sent away from a busy holder) costs nothing
later and the queue term alone decides; when they do not, the copy pushes some other prefix
out sooner or later. `unseen` is the share of the blocks a rank holds beyond this replica's
demand that are counted as demand: 0 for a lone replica (they are stale) or for replicas that
share their decisions (the siblings' demand is in the ledger), (k-1)/k with k replicas that
do not (a guess at the siblings' placements this replica cannot see; it also counts a
pre-filled cache's old blocks as theirs, which is why sharing does better: in
`bench/pressure_sim.py` the two-replica workloads went from 0.96-0.98x the ideal partition to
0.99-1.00x, as good as one ledger shared by both). A rank whose capacity is unknown (its
engine states none, 0, less than a block or a figure past `router.loads.MAX_REPORTED`, or its
loads endpoint never answered) counts as the median of the candidates' known capacities (the
lower of the two middle ones; `assumed_capacities`) in every term and sum: it pays the
pressure terms a typical rank would. Paying none, as it once did, it drew nearly every new
prefix (28 of 30 on three workers, where each draws its share), so the engine whose loads
endpoint was too slow to answer got the most traffic. The median rather than the smallest
known: one small (or lying) rank does not make every unknown one look full and starve it.
Only when no candidate's capacity is known are there no pressure terms (no fleet sum to
scale them). The replica reads capacities as a worker registers, then at every load tick;
the substitution is made per decision only when a candidate's is unknown (a C-level scan of
the list otherwise).

Shared preamble. A prompt that goes on past its deepest match, where that match is held as
deep (bookings included) by several ranks but not by every one, is a new prefix below a shared
preamble: a system prompt that several prefixes continue differently. So is one held by one
rank alone when the prompt's next block was routed nowhere lately (`PressureLedger.routed`;
the siblings' decisions count): a new prefix's own block, where the rest of a prefix whose
tail its holder evicted was routed there before. Its holders save the
preamble's prefill, once; the prefix's own blocks then live where it goes, and its later
requests follow them there. Left to the terms above, a 40-block preamble (640 tokens) outweighs
any fill and spill a 20-block prefix can be charged, so new prefixes follow the preamble to its
holders until they thrash, while a rank without it stays empty (`bench/pressure_sim.py`,
4w-12p-header40-c6: the first placements spread the prefixes' blocks over the workers by 232,
the ideal partition 3). So a holder is charged the preamble's saving back on as many blocks
as the prompt would store there, `prefill * B * min(depth, stored) * min(after, 1)`, when it
would end fuller of demand than the fleet,

    after    = (max(kept, depth) + stored) / C  >  fleet' = (sum(kept) + stored) / sum(C)

(`kept` = demand + unseen * max(held - demand, 0), the demand `other` counts; sums over the
candidates of known capacity), and a rank without the preamble would end less full than it
even storing the whole prompt, `(kept + n) / C < after`. In a fleet short of room the
preamble is then copied to a rank with room before the holder spills, rather than after; a
holder with room keeps most of the saving (a copy would cost its prefill for little). The
charge is scaled by how full the holder would end, not by the fleet's fullness as `fill` is:
a cold fleet's first placements, the ones that decide where prefixes live, see a fleet nearly
empty whatever its working set, and a charge scaled by it did not act then (in
`bench/pressure_sim.py`, u2026.22, an 8-block preamble over 8 prefixes of 32-56 blocks: the
first two prefixes on the preamble's one holder, 0.958x the ideal partition; charged with one
holder and scaled by the fleet 0.953x, by the holder 1.000x; BENCHMARKS.md, round 10).
A match held by one rank alone, the next block routed before, is not charged (the rest of a
prefix: it must stay with its holder), nor one every rank holds (nobody to compare with: a
system prompt cached fleet-wide). A repeat of a prefix looks like a new prefix below a
preamble, save for its length: it stores only its tail, so the `min` charges it a block or
two, where charging the whole prefix moved repeats between copies (6w-30p-shuffled-c16-2rep
0.968x -> 0.963x in the simulator, 12 and 24 seeds). No weight of its own: the charge is the
saving itself. In `bench/pressure_sim.py` (12 seeds) the rule with two holders took
4w-12p-header40-c6 from 0.968x the ideal partition to 0.984x and four other preamble shapes up
by 0.005-0.012, left 38 of the 46 shapes as they were and three within 0.006; live,
4w-12p-header40-c6 0.958 -> 0.970 (24 runs a side), the routing trace unchanged
(BENCHMARKS.md). Its cost: a `max` over the candidates' depths on every decision (1-3% of a
decision's instructions), and where it applies, one ledger lookup and a few passes over the
candidates (a quarter of a decision).

Outgrown holder. A prefix's holder that no longer has the blocks of it that were routed to
it (its engine evicted them: the index shows it `d` deep, and the block past that was last
routed there) has a working set larger than its cache, and under a cyclic order it loses as
much on every request of its prefixes, round after round: the cost above keeps the prefix
there (the blocks it still holds outweigh a copy's prefill), and placement online, not
knowing the sizes still to come, leaves such ranks behind (`bench/pressure_sim.py`, u2034.6,
46 pre-filled prefixes of 8-40 blocks in cyclic order over 7 workers: the first placements
spread the prefixes' blocks over the workers by 36, the ideal partition 9). So when the
prompt's deepest holder alone shows such a loss at this look and at its previous one (one
loss is noise: a copy's first rounds, a booking that expired), its n blocks go instead to the
candidate whose working set (`PressureLedger.working_sets`: demand less the requests' own
tails) has room for them, `ws + n <= C`, with no loss at its own
latest look and no more load than the holder; the least full of those. Once, not back and
forth: the move must also leave the receiver less full than the holder was, `(ws + n) / C <
ws_holder / C_holder`, so a move back would need the opposite. No weight of its own. In
`bench/pressure_sim.py` (12 seeds) u2034.6 went from 0.980x the ideal partition to 0.995x
(median; mean 0.979 -> 0.983), the fresh draws 2034-2036 up by 0.0001-0.0012 in mean and
2031-2033 as they were, no shape newly below 0.97x; the tuning family's mean 0.99500 ->
0.99498 (one move, in one seed of 5w-15p-header4-c8: 0.990x -> 0.989x). Demand alone could
not tell a rank with room: by then every rank's demand is past its capacity with the
requests' own tails (`router.pressure`, "Working sets"), and moves priced on it sent the
overflow from rank to rank (the tuning family's mean down to 0.990-0.994). Its cost: one
ledger lookup per decision whose deepest holder is one rank and whose prompt goes on past it
(`bench/relay_instructions.py`, cache_aware: 435,856 -> 439,593 instructions a request;
counting every lost block instead of looking at the first cost 88,711; BENCHMARKS.md, "An
outgrown holder").

A prefix gone from every cache. A prompt that every candidate holds equally deep (a header
cached fleet-wide, or nothing) whose next block was routed lately is a prefix its rank's
engine evicted whole. In a fleet whose demand exceeds its caches the fill and spill terms
saturate (every rank full of demand), the costs then differ by load alone, and the prefix
went to whichever rank was a request lighter: where it lands decides which prefixes share a
rank from then on, and the idlest rank may be the fullest (`bench/pressure_sim.py`,
u2037.6, 4 workers, an 8-block header, 9 prefixes of 16-32 blocks, demand 1.2x the caches:
3.8 such re-placements a run, each prefix on 1.56 ranks). So it goes where it would end the
least full of its capacity: its last rank (`PressureLedger.last_routed` of the prompt's next
block) by its working set as it is (`PressureLedger.working_sets`, as for an outgrown
holder; it counts the prefix already), at any load; another candidate by its working set
with the blocks the prompt would store there, `(ws + n - depth) / C`, if it is within one
request of the lightest load; the last rank on a tie, then the cost's order (ranks of unknown
capacity are not candidates for it). A prefix whose requests each add a tail of their own
(a question, a document) is evicted whole by its rank's churn even when the prefixes it
shares the rank with fit: every rank's working set then also counted each prefix's latest
tail (until round 16: `router.pressure`, "Working sets"), the fullness of ranks differed by
noise, and sending the prefix to whichever was a request lighter and emptier started a
cascade (its new rank evicted another prefix, which moved in turn: in
`bench/pressure_sim.py`'s tailed shapes, 100-300-token tails, u3004.0, 31
prefixes over 6 workers at c=16, 16.7 such moves a run and 0.76x the ideal partition). Until
round 15 the last rank was judged as the others (its working set plus the prompt again, and
only within a request of the lightest load), so a prefix went home only when that rank was
the least full even counting it twice. With short tails (8-40 tokens) judging it fairly
changes little (204 drawn shapes of 12 seeds, `pressure_sim --unseen`: the mean of median
ratios to the ideal partition 0.99570 -> 0.99594, 9 shapes below 0.97x before and after);
with longer ones it keeps the partition (116 drawn shapes, `pressure_sim --tailed`, tails of
64-500 tokens: 0.98222 -> 0.99599, 32 -> 22 below 0.97x, the worst 0.698x -> 0.847x;
BENCHMARKS.md, "A gone prefix goes home"). Going home whatever the other ranks' fullness
did better still with long tails (0.99869, 21 below) and worse with short ones (0.99507, 11
below). A new prefix (its next block routed nowhere) is placed by the cost as before. No
weight of its own. Its cost: one ledger lookup per decision where every candidate holds the
prompt equally deep, and a working-set read when that block was routed.

A repeat stays with its holder. The repeat of a prefix one rank holds deeper than the others
was sent to another rank whenever the holder's queue (a few requests more in flight) or its
pressure terms outweighed the few blocks it held beyond a shared header: its demand counts the
requests' own tails, so a holder looked fuller than it was. In a fleet whose demand exceeds its
caches, each such request made a copy that pushed some other prefix out of its new rank
(`bench/pressure_sim.py`'s "away" copies: u2203.4, 7 workers, 15 prefixes of 16-40 blocks
under a 12-block header at c=12, 5.2 a run, its prefixes on 1.42 ranks). So when the cost puts
another rank first, the one deepest holder keeps the prompt if it has no more than
`keep_holder_load` (4) requests in flight beyond that rank and that rank would end at least as
full of its capacity, by its working set with the blocks the prompt would store there,
`(ws + n - depth) / C`, as the holder is by its own (`ws / C`, which counts the prefix).
It applies at any fullness: in a fleet with room, a repeat then waits behind up to 4 requests
on its holder where the queue term alone sent it to an idler rank (the routing trace, inside
every cache, kept its ratio and TTFT: BENCHMARKS.md).
It is a repeat when the block past the holder's match was routed lately (the rest of a prefix
its engine evicted; as in "Shared preamble", it stays with its holder) or when the holder has
more of the prompt beyond the others' depth than it lacks (a tail below the prefix); otherwise
it is a new prefix below a preamble that rank holds, which the cost places. In
`bench/pressure_sim.py` (`--unseen 8 --placer --placer-rtt-ms 7`, draws 2201-2204 and
2301-2304, 12 seeds) u2203.4 went from 0.964x the ideal partition to 0.982x and u2204.1 from
0.973x to 0.980x (BENCHMARKS.md, "A repeat stays with its holder"). Without the load bound, a
holder kept its repeats through any queue, u2304.7's simulated TTFT p99 +12%; without telling a
repeat from a new prefix, a new prefix below a one-rank preamble stayed with it (u2302.3
0.988x -> 0.981x). No other shape of the 64 lost more than 0.002. Its cost: one ledger lookup
and a working-set read of two ranks when the cost's choice is not the one deepest holder.

Defaults (`CacheAwareWeights`): prefill 1.0, queue 1.0, queued_request_tokens 256,
lower_tier_discount 0.5, backlog 1.0 (a typical rank with one request in flight halves a
queued request's price; in `bench/pressure_sim.py` 0.5 and 2 did no better, and multiplying
the prefill price instead, which keeps the pressure terms' weight against the queue, did
worse at c=16: 0.936x the ideal partition against 0.956x; pricing by each rank's own load
did worse than no rule at all, driving new prefixes off busy ranks), running_share 0.25 (a
request running beside a free slot; in `bench/pressure_sim.py`, 204 drawn shapes of 12 seeds,
the fake engine's 2 slots: the mean of their median ratios to the ideal partition 0.9942 ->
0.9957, shapes below 0.97x 13 -> 9; 0 and 0.5 did a little less well, and pricing only the
holders' slots, which leaves a new prefix's placement to whole loads, less again; the
simulated TTFT p50 and p99 unchanged in the median shape), evict 1.0 (an evicted
demanded block is prefilled again once), fill 2.0 (a new block on a rank full of demand, in a
fleet full of demand, displaces a demanded block, which displaces another when it returns; in
`bench/pressure_sim.py` 2 kept every workload of the pressure benchmark's family at the ideal
partition's ratio where 0.5 and 1 let a one-request load difference place a prefix on a fuller
rank; unscaled by the fleet it cost the routing trace 8% of TTFT p50, see BENCHMARKS.md),
keep_holder_load 4 (a repeat stays with its holder through that many requests in flight more
than the cost's choice; in `bench/pressure_sim.py`, 12 seeds, 2 left u2204.1 where it was,
0.973x against 0.980x with 4, u2203.4 at 0.972x against 0.982x, and took u2304.7 from 0.991x
to 0.984x; with no bound, u2304.7's simulated TTFT p99 rose 12%), and tie_margin 32. So a
fully cached 2,048-token prompt (128 blocks of 16) is worth 2048 / 256 = 8
queued requests against an empty idle rank with no demand (on an engine that states no slots):
the holder wins with up to 7 waiting, ties at 8 (the tie goes to the lower load, the idle one),
and loses at 9; against a rank full of demand in a full fleet the move would also pay 2 x 2048
in fill, so the holder keeps it up to 23; when the other ranks have 2 in flight each, a queued
request counts 256 / 3 and the holder keeps it with up to 25 in flight (2 + 2048 / (256 / 3) =
26 ties).

Prefix homes (`--prefix-homes`, off by default; `router.homes.CacheAwareHome` wraps this
policy). The cost above places a new prefix by the moment's load or the siblings' tie hash,
blind to how many prefix blocks each rank was already given, and a prefix's demand follows
each routed request. With homes on, a prefix keeps the rank it was first placed on, chosen by
the fewest homed blocks (decayed like demand) among the ranks within `place_bound` (4)
requests of the lightest; its requests go home while the home is within `keep_bound` (8) of
the lightest, and cache_aware's order decides otherwise (the booking and demand follow the
home through `Decision.served`). The rules and the other knobs (`tail_blocks` 11, `settle_s`
0.1, `half_life_s` 30) are in `router/homes.py`; their defaults and why in README.

Lowest cost first; ties by lower load, then more room (`2C - held - demand`: free and stale
blocks), then an order every replica computes alike: rendezvous hashing of the rank against
the prompt's first block nobody holds (a new prefix's own first block), or its deepest held
block when some ranks hold more than others (a prompt shorter than a block has no prefix to
place: its ties go at random). With siblings (k > 1), costs within
`tie_margin` (32 tokens, an eighth of a queued request) of the best also tie, and the
rendezvous order alone picks among them: replicas whose ledgers differ a little then still
send a new prefix's first requests to the same rank, and settle a prefix held twice on one
copy (the margin was chosen on live two-replica runs: 16-32 best, 0 and 128 worse).

Imbalance. Before scoring, if the fleet is strongly imbalanced (max load - min load >
imbalance_abs (32) AND max load > min load * imbalance_rel (1.5)), the ranks past both
thresholds of the lightest are set aside, last in the order by load, and the cost orders the
others as above (`imbalance_fallback`): a hot prefix should not keep piling onto one rank
while others idle, and the cost's linear queue term can lag a sudden burst. The others are
not imbalanced among themselves (the lightest is one of them, and each is within one
threshold of it), so one pass does. The whole fleet was once ordered by load instead,
the cache ignored: one rank stuck, or lying, at 1,000 waiting made every decision a
least-load one, and the same prompt sent 20 times went 12/8 over the healthy ranks instead
of staying on one.

Outcomes
--------
`Decision.outcome` labels the decision for metrics: `cache_hit` when the chosen rank holds at
least one leading block of the prompt on any tier, `cache_miss` otherwise,
`imbalance_fallback` when `cache_aware` set ranks aside for their load ("Imbalance"),
`no_candidates` for an empty list. `matched_blocks` is the chosen rank's any-tier depth.
Baseline policies report hit/miss the same way when given depths, so cache hit rates compare
across policies.

Speed (`bench/bench_policy.py`): every step is a flat comprehension or a C-level map/sort,
never a method call per candidate, and the cost's two passes over the candidates run in C
when the accelerator is built (`_speedups.cost_rows`, float for float the twin
`_cost_rows_py`: the same operations in the same order, fused multiply-adds off). Over 64
candidates on the development VM (a slow shared core: `sum(range(1000))` takes ~11 us there)
a decision costs ~65 us when ranks share a system prompt and ~80 us when every rank holds a
different depth (with the costs in Python: ~140 and ~155); a seventh of it is expanding
`PrefixDepths` into per-rank dicts, which is cachetree's code.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import add, and_, attrgetter, truediv
from typing import ClassVar, Final, Protocol

from xxhash import xxh3_64_intdigest

from cachetree.accel import speedups
from cachetree.ranks import RankId
from cachetree.tree import PrefixDepths
from router.loads import EngineLoad
from router.pressure import PressureLedger

CACHE_HIT: Final = "cache_hit"
CACHE_MISS: Final = "cache_miss"
IMBALANCE_FALLBACK: Final = "imbalance_fallback"
NO_CANDIDATES: Final = "no_candidates"
OUTCOMES: Final = (CACHE_HIT, CACHE_MISS, IMBALANCE_FALLBACK, NO_CANDIDATES)


@dataclass(slots=True)
class Candidate:
    rank: RankId
    inflight: int = 0  # requests this replica sent to the rank and has not seen finish
    engine: EngineLoad | None = None  # the load monitor's latest, None when unknown


@dataclass(slots=True)  # made per request: not frozen (a frozen one sets each field slowly)
class Prompt:
    """What a policy knows of the request: its size and, for cache_aware, the index's view
    and its block keys (which cache_aware books on the rank it picks)."""

    tokens: int
    block_size: int
    depths: PrefixDepths | None = None
    keys: Sequence[int] = ()

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size


@dataclass(slots=True)
class Decision:
    ranked: list[Candidate]  # best first; the proxy fails over down this list
    outcome: str  # one of OUTCOMES
    matched_blocks: int  # the chosen rank's leading blocks held on any tier
    prompt: Prompt | None = None  # what the decision was about, when `on_failover` needs it
    on_failover: Callable[[Decision, RankId], None] | None = None  # the policy's `served`
    on_refusal: Callable[[Decision], None] | None = None  # the policy's `refused`

    def served(self, rank: RankId) -> None:
        """The proxy's answer came from `rank`: when that is not the first choice (it failed
        over), the policy hears of it (cache_aware moves its booking there)."""
        if self.on_failover is not None and self.ranked and rank != self.ranked[0].rank:
            self.on_failover(self, rank)

    def refused(self) -> None:
        """The engine answered a 4xx: it refused the prompt and cached none of it, so the
        policy hears of it (cache_aware ends its booking)."""
        if self.on_refusal is not None and self.ranked:
            self.on_refusal(self)


class Policy(Protocol):
    name: str

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision: ...


def load_of(c: Candidate) -> int:
    """Router in-flight plus engine waiting (see the module docstring)."""
    engine = c.engine
    if engine is None or engine.waiting is None:
        return c.inflight
    return c.inflight + engine.waiting


def _loads(candidates: Sequence[Candidate]) -> list[int]:
    # load_of, inlined: a function call per candidate is a third of this list's cost.
    return [
        c.inflight if (e := c.engine) is None or (q := e.waiting) is None else c.inflight + q
        for c in candidates
    ]


def _queued(candidates: Sequence[Candidate], loads: list[int], share: float) -> Sequence[float]:
    """Each candidate's load as the queue term prices it (module docstring, "Load"): on a
    rank whose engine states its slots, the requests a new one would wait behind count whole
    and the ones running beside it `share` each; elsewhere the load itself."""
    out: list[float] | None = None
    for i, c in enumerate(candidates):
        e = c.engine
        if e is None or (slots := e.slots) is None or slots < 2:
            continue
        if out is None:
            out = list(map(float, loads))
        load = loads[i]
        ahead = load - slots + 1 if load >= slots else 0
        out[i] = ahead + share * (load - ahead)
    return loads if out is None else out


def _depth_maps(depths: PrefixDepths | None) -> tuple[dict[RankId, int], dict[RankId, int]]:
    """(any-tier depths, device depths) by rank; one dict for both when no block is off-device."""
    if depths is None:
        return {}, {}
    any_runs = depths.depth_runs()
    if not any_runs:
        return {}, {}
    any_tier = depths.any_tier
    if depths.depth_runs(device=True) == any_runs:
        return any_tier, any_tier
    return any_tier, depths.device


def _labelled(ranked: list[Candidate], depths: PrefixDepths | None) -> Decision:
    """A baseline policy's decision, with hit/miss read from the depths when given."""
    if not ranked:
        return Decision([], NO_CANDIDATES, 0)
    matched = depths.any_tier.get(ranked[0].rank, 0) if depths is not None else 0
    return Decision(ranked, CACHE_HIT if matched else CACHE_MISS, matched)


def _by_load(
    candidates: Sequence[Candidate], loads: Sequence[int], rng: random.Random
) -> list[Candidate]:
    """Lowest load first, ties in random order."""
    n = len(loads)
    if len(set(loads)) == n:
        order = sorted(range(n), key=loads.__getitem__)
    else:
        # A random number per candidate as the second key: cheaper than shuffling each tie
        # group (random.shuffle is Python code), and as uniform.
        rnd = rng.random
        keys = list(zip(loads, [rnd() for _ in range(n)], strict=True))
        order = sorted(range(n), key=keys.__getitem__)
    return list(map(candidates.__getitem__, order))


_rank = attrgetter("rank")


# --- baselines ------------------------------------------------------------------------------


class RoundRobin:
    """Each decision starts one further along the candidate list."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        n = len(candidates)
        if not n:
            return Decision([], NO_CANDIDATES, 0)
        start = self._next % n
        self._next = start + 1
        ranked = [*candidates[start:], *candidates[:start]]
        return _labelled(ranked, prompt.depths)


class RandomPolicy:
    """A uniformly random order."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        return _labelled(self._rng.sample(list(candidates), len(candidates)), prompt.depths)


class LeastLoad:
    """Lowest load first; ties at random."""

    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        return _labelled(_by_load(candidates, _loads(candidates), self._rng), prompt.depths)


class PowerOfTwo:
    """Two candidates drawn at random, the less loaded of them first, the other second;
    then everyone else by load (for failover). Spreads load without herding every router
    onto the one least-loaded rank."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        n = len(candidates)
        loads = _loads(candidates)
        if n <= 2:
            return _labelled(_by_load(candidates, loads, self._rng), prompt.depths)
        i, j = self._rng.sample(range(n), 2)
        pair = _by_load([candidates[i], candidates[j]], [loads[i], loads[j]], self._rng)
        rest = [k for k in range(n) if k != i and k != j]
        tail = _by_load([candidates[k] for k in rest], [loads[k] for k in rest], self._rng)
        return _labelled(pair + tail, prompt.depths)


# --- cache_aware ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheAwareWeights:
    """Tunables of the cost function in the module docstring."""

    prefill: float = 1.0  # cost per prompt token the rank must prefill
    queue: float = 1.0  # multiplier on the queue term
    queued_request_tokens: float = 256.0  # prefill tokens one queued request stands for
    lower_tier_discount: float = 0.5  # credit for a host/disk block, relative to device
    evict: float = 1.0  # cost per token of recently demanded blocks a placement evicts
    backlog: float = 1.0  # the queue term is divided by 1 + backlog * (typical load)
    running_share: float = 0.25  # an in-flight request with an engine slot, of a queued one
    fill: float = 2.0  # surcharge per newly stored token, times the rank's demand / capacity
    # A repeat stays on its prefix's holder with up to this many requests in flight more than
    # the rank the cost chose (module docstring, "A repeat stays with its holder").
    keep_holder_load: int = 4
    tie_margin: float = 32.0  # with siblings, costs this close to the best tie (rendezvous)
    imbalance_abs: int = 32  # fall back to least load when max - min load exceeds this ...
    imbalance_rel: float = 1.5  # ... and max load exceeds min load times this

    def __post_init__(self) -> None:
        weights = (
            self.prefill,
            self.queue,
            self.queued_request_tokens,
            self.evict,
            self.fill,
            self.backlog,
        )
        if min(*weights, self.tie_margin) < 0:
            raise ValueError("cost weights and the tie margin must be >= 0")
        if not 0.0 <= self.lower_tier_discount <= 1.0:
            raise ValueError("lower_tier_discount must be within [0, 1]")
        if not 0.0 <= self.running_share <= 1.0:  # a share of a queued request's price
            raise ValueError("running_share must be within [0, 1]")
        if self.keep_holder_load < 0:
            raise ValueError("keep_holder_load must be >= 0")
        if self.imbalance_abs < 0 or self.imbalance_rel < 1.0:
            raise ValueError("need imbalance_abs >= 0 and imbalance_rel >= 1")


class IndexView(Protocol):
    """What cache_aware reads of the block index besides a prompt's depths (a BlockTree)."""

    def block_count(self, rank: RankId, tier: int | None = None) -> int: ...

    def device_blocks(self, ranks: Iterable[RankId]) -> list[int]: ...

    def holds(self, rank: RankId, key: int) -> bool: ...


def _no_index() -> IndexView | None:
    return None


def _no_capacity(rank: RankId) -> int | None:
    return None


def _alone() -> int:
    return 1


@dataclass(slots=True)
class SpillStats:
    spills: int = 0  # decisions whose chosen rank must evict blocks of its recent demand
    spilled_blocks: int = 0  # how many such blocks, in all


@dataclass(slots=True)
class _Pressure:
    """Per candidate (in order): what the index, the engines and the ledger say of its cache."""

    ranks: list[RankId]  # the candidates'
    depth: list[int]  # leading prompt blocks held on the device, bookings included
    booked: dict[RankId, int]  # ranks whose depth bookings extend, and to what
    demand: list[float]  # the ledger's recent distinct blocks
    capacity: list[int | None]  # device blocks the engine can hold; unknown: the median, or None
    held: list[int]  # device blocks the index shows, plus those booked and not shown yet


@dataclass(slots=True)
class CacheAware:
    """Lowest estimated time-to-first-token first, cache pressure included: see the module
    docstring. `index` and `capacity` are read on every decision; the ledger is this
    replica's own (demand and bookings)."""

    weights: CacheAwareWeights = field(default_factory=CacheAwareWeights)
    rng: random.Random = field(default_factory=random.Random)
    ledger: PressureLedger = field(default_factory=PressureLedger)
    index: Callable[[], IndexView | None] = _no_index
    capacity: Callable[[RankId], int | None] = _no_capacity
    replicas: Callable[[], int] = _alone  # replicas sharing the traffic, this one included
    # Tells the siblings of each decision (`router.siblings`); their decisions come back
    # through `adopt`, so the ledger sees the whole fleet's demand and bookings.
    share: Callable[[RankId, Sequence[int], int], None] | None = None
    spill_stats: SpillStats = field(default_factory=SpillStats)
    # Ranks whose latest look showed a loss (module docstring, "Outgrown holder"): a block of
    # a prompt routed to them, evicted. A rank seen whole again is dropped.
    outgrown: set[RankId] = field(default_factory=set)
    name: ClassVar[str] = "cache_aware"

    def imbalanced(self, loads: Sequence[int]) -> bool:
        lo, hi = min(loads), max(loads)
        w = self.weights
        return hi - lo > w.imbalance_abs and hi > lo * w.imbalance_rel

    def costs(self, candidates: Sequence[Candidate], prompt: Prompt) -> list[float]:
        """The cost of each candidate, in order (exposed for tests and debugging)."""
        any_tier, device = _depth_maps(prompt.depths)
        self.settle()
        pressure = self._pressure(candidates, prompt, device, self.index())
        return self._costs(candidates, _loads(candidates), prompt, any_tier, pressure)[0]

    def settle(self) -> None:
        """End the bookings the index has confirmed or whose TTL passed (decisions do this
        too; a scrape calls it so that idle replicas report current figures)."""
        index = self.index()
        self.ledger.settle(None if index is None else index.holds)

    def pressure(self, rank: RankId) -> float | None:
        """The rank's recent demand over its capacity; None when the capacity is unknown."""
        capacity = self.capacity(rank)
        return None if not capacity else self.ledger.demand(rank) / capacity

    def adopt(self, rank: RankId, keys: Sequence[int], held: int) -> None:
        """A sibling replica routed `keys` to `rank`, which held the first `held` of them:
        its demand and booking count here as if this replica had routed it."""
        index = self.index()
        self.ledger.record(rank, keys, held, None if index is None else index.holds)

    def served(self, decision: Decision, rank: RankId) -> None:
        """The proxy failed over: `rank` served the prompt `decision` placed elsewhere. The
        booking and the demand move to it (and the siblings are told)."""
        prompt = decision.prompt
        if prompt is None or not prompt.keys or not decision.ranked:
            return
        keys = prompt.keys
        index = self.index()
        holds = None if index is None else index.holds
        held = 0
        if holds is not None:  # the index now, not the decision's (it may have changed since)
            while held < len(keys) and holds(rank, keys[held]):
                held += 1
        self._tell(
            rank, keys, held, self.ledger.move(decision.ranked[0].rank, rank, keys, held, holds)
        )

    def refused(self, decision: Decision) -> None:
        """The engine refused the prompt `decision` routed (a 4xx: it cached nothing of it):
        its booking on the rank it was routed to ends (counted `refused`). Its demand stays,
        decaying as any other; the siblings told of it keep their booking to its TTL."""
        prompt = decision.prompt
        if prompt is not None and prompt.keys and decision.ranked:
            self.ledger.refuse(decision.ranked[0].rank, prompt.keys)

    def forget_ranks(self, ranks: Sequence[RankId]) -> None:
        """The ranks' worker left the registry: the ledger forgets them now, not ~16
        half-lives later (`PressureLedger.forget_ranks`), and so does `outgrown`."""
        self.ledger.forget_ranks(ranks)
        self.outgrown.difference_update(ranks)

    def place(
        self, candidates: Sequence[Candidate], prompt: Prompt, rank: RankId
    ) -> Decision | None:
        """The placer (`router.placement`) chose `rank` for this new prefix: a decision with it
        first (the rest by load, to fail over to), booked here as this replica's own but not
        shared (the placer shares it). None when `rank` is not one of the candidates."""
        chosen = [c for c in candidates if c.rank == rank]
        if not chosen:
            return None
        index = self.index()
        holds = None if index is None else index.holds
        self.ledger.settle(holds)
        rest = [c for c in candidates if c.rank != rank]
        ranked = chosen + _by_load(rest, _loads(rest), self.rng)
        any_tier, device = _depth_maps(prompt.depths)
        self.ledger.record(rank, prompt.keys, device.get(rank, 0), holds)
        matched = any_tier.get(rank, 0)
        return Decision(
            ranked, CACHE_HIT if matched else CACHE_MISS, matched, prompt, self.served, self.refused
        )

    def _record(
        self,
        rank: RankId,
        keys: Sequence[int],
        held: int,
        holds: Callable[[RankId, int], bool] | None,
    ) -> None:
        self._tell(rank, keys, held, self.ledger.record(rank, keys, held, holds))

    def _tell(self, rank: RankId, keys: Sequence[int], held: int, told: tuple[int, int]) -> None:
        """Share with the siblings what the ledger says is worth it, `keys[first:stop]`: a
        prompt's own tail is not (it leaves the working set at once, and, recorded by a
        sibling as blocks new to it, stayed in that sibling's working set)."""
        first, stop = told
        if self.share is not None and first < stop:
            self.share(rank, keys[first:stop], max(min(held, stop) - first, 0))

    def decide(self, candidates: Sequence[Candidate], prompt: Prompt) -> Decision:
        n = len(candidates)
        if not n:
            return Decision([], NO_CANDIDATES, 0)
        index = self.index()
        holds = None if index is None else index.holds
        self.ledger.settle(holds)
        loads = _loads(candidates)
        any_tier, device = _depth_maps(prompt.depths)
        if n > 1 and self.imbalanced(loads):
            return self._set_aside(candidates, loads, prompt)
        pressure = self._pressure(candidates, prompt, device, index)
        costs, evicted, room = self._costs(candidates, loads, prompt, any_tier, pressure)
        # Alone, only equal costs tie; with siblings, costs within the margin do, so that
        # replicas whose ledgers differ still agree where a new prefix goes and which of two
        # copies of a prefix to keep using.
        margin = self.weights.tie_margin if self.replicas() > 1 else 0.0
        best = min(costs)
        near = [i for i, c in enumerate(costs) if c <= best + margin]
        if len(near) == 1:  # a clear winner: the cost orders them all
            order = sorted(range(n), key=costs.__getitem__)
        elif not prompt.keys:  # not a full block: nothing to place, spread it at random
            rnd = self.rng.random
            keys = list(zip(costs, loads, [rnd() for _ in range(n)], strict=True))
            order = sorted(range(n), key=keys.__getitem__)
        else:  # ties: lower load, then more room, then an order every replica agrees on
            agreed = _rendezvous(candidates, prompt.keys, pressure.depth)
            rooms = [-r for r in room]
            keys = list(zip(costs, loads, rooms, agreed, strict=True))
            order = sorted(range(n), key=keys.__getitem__)
            if margin:
                first = min(near, key=agreed.__getitem__)
                order.remove(first)
                order.insert(0, first)
        relief = self._relief(loads, pressure, prompt)
        if relief is None:
            relief = self._regone(loads, pressure, prompt, order)
        if relief is None:
            relief = self._holder(loads, pressure, prompt, order)
        if relief is not None and relief != order[0]:
            order.remove(relief)
            order.insert(0, relief)
        ranked = list(map(candidates.__getitem__, order))
        if evicted[order[0]]:
            self.spill_stats.spills += 1
            self.spill_stats.spilled_blocks += evicted[order[0]]
        chosen = ranked[0].rank
        self._record(chosen, prompt.keys, device.get(chosen, 0), holds)
        matched = any_tier.get(chosen, 0)
        return Decision(
            ranked, CACHE_HIT if matched else CACHE_MISS, matched, prompt, self.served, self.refused
        )

    def _set_aside(
        self, candidates: Sequence[Candidate], loads: Sequence[int], prompt: Prompt
    ) -> Decision:
        """A strongly imbalanced fleet (module docstring, "Imbalance"): the ranks that make
        it so go last, by load, and the cost decides among the others (which are not
        imbalanced among themselves: the lightest rank is one of them, and each is within
        one of the two thresholds of it)."""
        w = self.weights
        lo = min(loads)
        over = [load > lo + w.imbalance_abs and load > lo * w.imbalance_rel for load in loads]
        heavy = list(compress(candidates, over))
        decision = self.decide([c for c, o in zip(candidates, over, strict=True) if not o], prompt)
        decision.ranked += _by_load(heavy, list(compress(loads, over)), self.rng)
        decision.outcome = IMBALANCE_FALLBACK
        return decision

    def _relief(self, loads: Sequence[int], p: _Pressure, prompt: Prompt) -> int | None:
        """The candidate to take the prompt off its outgrown holder, if any (module docstring,
        "Outgrown holder"); records what this look saw of the holder."""
        keys = prompt.keys
        depth = p.depth
        deepest = max(depth, default=0)
        if not 0 < deepest < len(keys) or depth.count(deepest) != 1:
            return None
        r = depth.index(deepest)
        holder = p.ranks[r]
        outgrown = self.outgrown
        seen_before = holder in outgrown
        if not self.ledger.routed_to(keys[deepest], holder):  # whole: nothing it had was lost
            outgrown.discard(holder)
            return None
        outgrown.add(holder)
        capacity = p.capacity
        c_holder = capacity[r]
        if not seen_before or not c_holder:
            return None
        n = prompt.blocks
        ws = self.ledger.working_sets(p.ranks)
        bar = ws[r] / c_holder  # the holder's fullness: a receiver must end below it
        best: int | None = None
        least = math.inf
        for i, (rank, c, w, load) in enumerate(zip(p.ranks, capacity, ws, loads, strict=True)):
            if i == r or not c or w + n > c or load > loads[r] or rank in outgrown:
                continue
            if (w + n) / c < bar and w / c < least:
                best, least = i, w / c
        return best

    def _regone(
        self, loads: Sequence[int], p: _Pressure, prompt: Prompt, order: Sequence[int]
    ) -> int | None:
        """The candidate to take a prefix gone from every cache, if any (module docstring,
        "A prefix gone from every cache"): the one that would end the least full of its
        capacity, its last rank at any load and by its working set as it is (which counts
        the prefix), the others within one request of the lightest load and with the blocks
        the prompt would store there; the last rank on a tie, then the cost's `order`."""
        keys = prompt.keys
        depth = p.depth
        d = depth[0] if depth else 0
        if d >= len(keys) or depth.count(d) != len(depth):
            return None  # held deeper somewhere, or a prompt within a block
        last = self.ledger.last_routed(keys[d])
        if last is None:
            return None  # a new prefix
        stored = prompt.blocks - d
        ws = self.ledger.working_sets(p.ranks)
        capacity = p.capacity
        bound = min(loads) + 1
        best: int | None = None
        least = math.inf
        home = p.ranks.index(last) if last in p.ranks else -1
        if home >= 0 and (c := capacity[home]):
            best, least = home, ws[home] / c
        for i in order:
            c = capacity[i]
            if c and loads[i] <= bound and i != home and (ws[i] + stored) / c < least:
                best, least = i, (ws[i] + stored) / c
        return best

    def _holder(
        self, loads: Sequence[int], p: _Pressure, prompt: Prompt, order: Sequence[int]
    ) -> int | None:
        """The prompt's one deepest holder, when the cost chose another rank for a repeat of
        the prefix it holds and that rank would end no less full of its capacity (module
        docstring, "A repeat stays with its holder"); None to keep the cost's order."""
        depth = p.depth
        first = order[0]
        deepest = max(depth, default=0)
        if not deepest or depth[first] == deepest or depth.count(deepest) != 1:
            return None
        held = depth.index(deepest)
        keys = prompt.keys
        n = prompt.blocks
        # A repeat: the block past the match was routed lately (the rest of the prefix, its
        # holder's engine evicted it), or the holder has more of the prompt beyond what the
        # others hold than it lacks (a tail below the prefix). Otherwise a new prefix below
        # a preamble one rank holds, which the cost places ("Shared preamble").
        if not (deepest < len(keys) and self.ledger.routed(keys[deepest])):
            second = max(d for i, d in enumerate(depth) if i != held)
            if deepest - second <= n - deepest:
                return None
        if loads[held] > loads[first] + self.weights.keep_holder_load:
            return None
        c_held, c_first = p.capacity[held], p.capacity[first]
        if not c_held or not c_first:
            return None
        ws_held, ws_first = self.ledger.working_sets((p.ranks[held], p.ranks[first]))
        return held if (ws_first + n - depth[first]) / c_first >= ws_held / c_held else None

    def _pressure(
        self,
        candidates: Sequence[Candidate],
        prompt: Prompt,
        device: dict[RankId, int],
        index: IndexView | None,
    ) -> _Pressure:
        ranks = list(map(_rank, candidates))
        booked = self.ledger.booked_depths(prompt.keys, device)
        depth = list(map(device.get, ranks, repeat(0)))
        if booked:  # few ranks: patched by position, not a max per candidate
            at = dict(zip(ranks, range(len(ranks)), strict=True))
            for rank, extended in booked.items():
                i = at.get(rank)
                if i is not None and extended > depth[i]:
                    depth[i] = extended
        capacity = list(map(self.capacity, ranks))
        if not all(capacity):  # one C-level scan: the usual fleet states every capacity
            capacity = assumed_capacities(capacity)
        held = self.ledger.pendings(ranks)
        if index is not None:
            held = list(map(add, held, index.device_blocks(ranks)))
        return _Pressure(ranks, depth, booked, self.ledger.demands(ranks), capacity, held)

    def _costs(
        self,
        candidates: Sequence[Candidate],
        loads: Sequence[int],
        prompt: Prompt,
        any_tier: dict[RankId, int],
        p: _Pressure,
    ) -> tuple[list[float], list[int], list[float]]:
        """(cost, demanded blocks the rank would evict, room) per candidate."""
        w = self.weights
        n = len(candidates)
        # Backlog: when the typical rank is busy, a lighter rank fills up again at once, so
        # a queue difference is brief and counts for less (this replica sees 1/k of each
        # rank's in-flight). The mean load without the busiest rank: one hot rank does not
        # make the fleet busy.
        replicas = self.replicas()
        busy = replicas * (sum(loads) - max(loads)) / (n - 1) if n > 1 else 0.0
        per_request = w.queue * w.queued_request_tokens / (1.0 + w.backlog * busy)
        # Siblings' placements this replica cannot see: none when they share their decisions.
        unseen = 1.0 - 1.0 / replicas if replicas > 1 and self.share is None else 0.0
        rows = _cost_rows(
            p.ranks,
            _queued(candidates, loads, w.running_share),
            any_tier,
            p.capacity,
            p.demand,
            p.held,
            p.depth,
            float(prompt.tokens),
            prompt.block_size,
            prompt.blocks,
            w.prefill,
            per_request,
            # Tokens each rank would not prefill: device blocks (bookings count as device
            # blocks) save `block` tokens each, lower-tier ones `lower` each.
            prompt.block_size * w.lower_tier_discount,
            unseen,
            w.evict,
            w.fill,
        )
        blocks = prompt.tokens // prompt.block_size
        deepest = max(p.depth, default=0)
        if 0 < deepest < blocks:  # held in part: perhaps a new prefix below a shared preamble
            per_block = w.prefill * prompt.block_size
            _charge_shared_preamble(
                rows[0], p, blocks, deepest, per_block, unseen, prompt.keys, self.ledger.routed
            )
        return rows


def assumed_capacities(capacity: list[int | None]) -> list[int | None]:
    """Each unknown capacity (None or 0) as the median of the known ones (the lower of the
    two middle ones), so that a rank whose engine does not say pays the pressure terms a
    typical rank would; unchanged when none is known (module docstring, "Cache pressure")."""
    known = sorted(c for c in capacity if c)
    if not known:
        return capacity
    median = known[(len(known) - 1) // 2]
    return [c or median for c in capacity]


def _charge_shared_preamble(
    costs: list[float],
    p: _Pressure,
    blocks: int,
    deepest: int,
    per_block: float,
    unseen: float,
    keys: Sequence[int],
    routed: Callable[[int], bool],
) -> None:
    """A new prefix below a shared preamble (module docstring, "Shared preamble"): the
    holders of the prompt's `deepest` blocks that would end fuller than the fleet, while a
    rank without them would not, are charged the preamble's saving back, in the measure they
    would end full. `routed` (the ledger's) is asked about the prompt's block past them only
    when one rank holds them. C-level passes where it can: with a system prompt held on part
    of a fleet, every new conversation below it comes through here."""
    depth = p.depth
    n = len(depth)
    holders = depth.count(deepest)
    # Nobody to compare with; or one holder and the block past it routed lately (or no key
    # past it): the rest of a prefix its holder evicted, which must stay with its holder (a
    # new prefix's own block, or a new tail's, was routed nowhere).
    if holders == n or (holders < 2 and (deepest >= len(keys) or routed(keys[deepest]))):
        return
    capacity = p.capacity
    # Demand each rank must keep, as `_cost_rows_py` counts it (the siblings' unseen share
    # of what it holds included).
    kept = p.demand
    if unseen:
        kept = [d + unseen * (h - d) if h > d else d for d, h in zip(kept, p.held, strict=True)]
    outside = list(map(deepest.__gt__, depth))  # the ranks without the preamble
    if None in capacity or 0 in capacity:  # an unknown capacity counts in no fleet sum
        known = list(map(bool, capacity))
        outside = list(map(and_, outside, known))
        room = sum(compress(capacity, known))  # type: ignore[arg-type]
        total = sum(compress(kept, known))
        if not room:
            return
    else:
        room = sum(capacity)  # type: ignore[arg-type]
        total = sum(kept)
    # The least full a rank without the preamble would end, storing the whole prompt.
    ends = map(
        truediv, map(add, compress(kept, outside), repeat(blocks)), compress(capacity, outside)
    )
    lightest = min(ends, default=None)
    if lightest is None:
        return
    new = blocks - deepest
    fleet = (total + new) / room  # the fleet's demand over its capacity, this prompt placed
    # Counted once, against the blocks this prompt would store: a repeat's short tail below
    # a prefix held twice is charged its few blocks, not the whole prefix.
    saving = per_block * min(deepest, new)
    for i in compress(range(n), map(deepest.__eq__, depth)):
        c = capacity[i]
        if c:
            k = kept[i]
            after = ((k if k > deepest else deepest) + new) / c  # its demand, this prefix there
            if after > fleet and lightest < after:
                costs[i] += saving * (after if after < 1.0 else 1.0)


def _cost_rows_py(
    ranks: Sequence[RankId],
    loads: Sequence[float],  # plain loads, or the queue term's (`_queued`)
    any_tier: dict[RankId, int],
    capacities: Sequence[int | None],
    demands: Sequence[float],
    helds: Sequence[int],
    depths: Sequence[int],
    tokens: float,
    block: int,
    blocks: int,
    per_token: float,
    per_request: float,
    lower: float,
    unseen: float,
    evict: float,
    fill: float,
) -> tuple[list[float], list[int], list[float]]:
    """`CacheAware._costs`' two passes over the candidates, given its scalars. The compiled
    twin is `_speedups.cost_rows`, float for float: the same operations in the same order."""
    get_any = any_tier.get
    # How full of demand the fleet is: the fill surcharge scales with it, so it steers
    # placements only when the caches together are short of room, not when they idle.
    # (One pass over the ranks whose capacity is known; the next computes each rank's.)
    known = fallback = 0
    others = 0.0
    for capacity, demand, held in zip(capacities, demands, helds, strict=True):
        if capacity:
            known += capacity
            if capacity > fallback:
                fallback = capacity
            others += demand + unseen * (held - demand) if held > demand else demand
    fleet = min(others / known, 1.0) if known else 0.0
    n = len(ranks)
    costs: list[float] = []
    evicted = [0] * n
    room: list[float] = []
    for i, (rank, load, capacity, demand, held, depth) in enumerate(
        zip(ranks, loads, capacities, demands, helds, depths, strict=True)
    ):
        a = get_any(rank, 0)
        saved = lower * a + (block - lower) * depth if a > depth else block * depth
        cost = per_token * (tokens - saved if saved < tokens else 0.0) + per_request * load
        if not capacity:
            room.append(2 * fallback - held - demand)
            costs.append(cost)
            continue
        room.append(2 * capacity - held - demand)
        new = blocks - depth if depth < blocks else 0
        if new:
            # The rank's other demand: its recent blocks, less the ones this prompt
            # reuses, plus the siblings' share of what it holds beyond this replica's.
            other = demand - depth if demand > depth else 0.0
            if unseen and held > demand:
                other += unseen * (held - demand)
            free = capacity - held if capacity > held else 0
            # Storing `new` blocks first fills free slots, then evicts blocks nobody asked
            # for lately, and only then blocks in demand: this prompt's own `depth` blocks
            # stay, so `capacity - other - depth` can go before anything demanded does.
            spill = new - max(free, capacity - other - depth)
            if spill > 0:
                evicted[i] = math.ceil(spill)
            occupied = other + depth
            fullness = occupied / capacity if occupied < capacity else 1.0
            cost += block * (evict * max(spill, 0.0) + fill * fleet * fullness * new)
        costs.append(cost)
    return costs, evicted, room


_cost_rows = _cost_rows_py if speedups is None else speedups.cost_rows


def _rendezvous(
    candidates: Sequence[Candidate], keys: Sequence[int], depth: Sequence[int]
) -> list[int]:
    """A per-prompt order of the candidates that every replica computes alike (rendezvous
    hashing): replicas that cannot see each other's bookings still send the first requests of
    a new prefix to the same rank. The anchor is the prompt's first block no rank holds (the
    new prefix's own first block), or its last block when some rank holds it all."""
    deepest = max(depth)
    if min(depth) == deepest:  # nobody holds more than the others: the first new block
        anchor = keys[deepest] if deepest < len(keys) else keys[-1]
    else:  # the deepest block held, the same for every request of that prefix
        anchor = keys[deepest - 1]
    return [
        xxh3_64_intdigest(c.rank.worker_url.encode(), seed=anchor ^ c.rank.dp_rank)
        for c in candidates
    ]


# --- factory --------------------------------------------------------------------------------

POLICY_NAMES: Final = ("cache_aware", "round_robin", "random", "least_load", "power_of_two")


def make_policy(
    name: str,
    *,
    rng: random.Random | None = None,
    weights: CacheAwareWeights | None = None,
    ledger: PressureLedger | None = None,
    index: Callable[[], IndexView | None] = _no_index,
    capacity: Callable[[RankId], int | None] = _no_capacity,
    replicas: Callable[[], int] = _alone,
    share: Callable[[RankId, Sequence[int], int], None] | None = None,
) -> Policy:
    """A policy by name. `rng` seeds the randomized ones; the rest is for cache_aware only:
    its weights, its ledger, and where it reads the index and the ranks' capacities."""
    if name != "cache_aware" and (weights is not None or ledger is not None):
        raise ValueError(f"policy {name!r} takes no cache_aware weights or ledger")
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy(rng)
    if name == "least_load":
        return LeastLoad(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "cache_aware":
        return CacheAware(
            weights if weights is not None else CacheAwareWeights(),
            rng if rng is not None else random.Random(),
            ledger if ledger is not None else PressureLedger(),
            index,
            capacity,
            replicas,
            share,
        )
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
