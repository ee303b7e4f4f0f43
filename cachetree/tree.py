"""The block index: which rank holds which chained block, on which storage tiers.

Theory of operation
-------------------
Block keys are chained (see `keys.py`): a key names a block together with its whole prefix.
So the index is a *flat* dict `key -> Node`; a node's position is implied by its key, and a
prompt matches by one dict lookup per block, without walking child pointers. Nodes keep only
what the flat layout cannot derive: the parent key (to prune upward), a child count (to know
when a node may go), and who carries the block.

Carriers are a bitmask over small rank indices. A rank gets the lowest free index when it
first stores a block and gives it back when it is cleared, so masks stay one machine word for
any realistic fleet and `prefix_depths` is a loop of `&`. Most carriers hold a block on the
device tier only; the per-rank tier bits of the rest are kept aside in a dict that exists
only on nodes that need it. The engine's block hash (an opaque id that `BlockRemoved` and
`parent_block_hash` speak in) is one int shared by every carrier in the common case, and a
per-rank dict only when carriers disagree.

Each rank also has `engine hash -> key`, the only way to resolve a removal or a parent.
Invariant: an entry exists exactly while that rank carries that key, under that engine hash.
A store that re-announces a key under a new engine hash re-points the carrier and drops the
old entry, so one (rank, key) pair never has two live engine hashes.

Rules that are deliberate:
- A store whose non-null parent hash the rank does not carry is dropped and counted: the
  block's position is unknowable, and guessing would put false prefixes in the index.
- A store with tier 0 (an unknown medium) is dropped and counted; a remove with tier None
  (no medium, or an unknown one) clears every tier of that carrier.
- A node with no carriers and no children is pruned at once, cascading to its ancestors, so
  every leaf has a carrier and every node lies on a path to one.
- Dict insertion order is always parent-before-child: a node is created only under an
  existing parent, and a parent cannot be pruned while it has children. Snapshot export
  relies on this instead of a tree walk.

A rank's whole state can be replaced behind the old one (a worker's own snapshot): the new
one is built at an index of its own that readers skip (`stage_rank`, `store(staged=True)`;
`prefix_depths`, the carriers, the counts and an export leave hidden indices out), then takes
the old one's place in one step (`swap_staged_steps`), the old one hidden and dropped in slices.
Routing never sees the rank half built or half cleared. `len(tree)` (the kvrouter_tree_nodes
gauge) and `match`'s depth count the hidden states' nodes meanwhile, on purpose: they read the
node map, which holds them (the gauge is its size), and telling a node only hidden states hold
from one on the way to a visible carrier takes a walk of its subtree, which neither a scrape nor
a lookup should pay; `match`'s carriers leave hidden ranks out.

How it is fast: `store` and `remove` hand their blocks to runs (`place_run`, `remove_run`)
that take the cases engines nearly always send (a new block or a new device-only carrier; a
device-only carrier evicted) and stop, having changed nothing for it, at the first block that
needs the general one-block path (other tiers, re-pointed or reused engine hashes).

Layouts (`TreeLayout`): the tables are built by the tree's layout, chosen at import with the
accelerator (`cachetree.accel`). The pure layout is dicts and `PyNode`, a
`msgspec.Struct(gc=False)` (56 bytes, invisible to the cyclic collector), with the runs
`_place_run_py` and `_remove_run_py`. The compiled one (`cachetree._tables`) is the same API
in native words: a `NodeMap` (u64 key -> node) and a `HashMap` per rank (u64 engine hash ->
u64 key), insertion-ordered like dicts, nodes of 48 bytes, and C twins of the runs; about
half the memory a block (no int object per key or engine hash, no dict entry).
tests/unit/test_tree_twins.py holds whole trees of both layouts equal, and each run to its
twin; tests/unit/test_tables.py holds the maps to dict and the nodes to `PyNode`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Generator, Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import and_, attrgetter, neg
from typing import Protocol, TypeVar

import msgspec

from cachetree.accel import tables
from cachetree.keys import block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.tiers import ALL_TIERS, DEVICE, TIER_NAMES

T = TypeVar("T")
_TIER_BITS = tuple(TIER_NAMES)  # (DEVICE, HOST, DISK, EXTERNAL), index = count slot
_get_mask = attrgetter("mask")
_get_tiers = attrgetter("tiers")


class Node(Protocol):
    """A block of the index: what both layouts' nodes have (`PyNode`, `_tables.Node`)."""

    parent: int | None
    mask: int  # bit i set: rank index i carries the block on at least one tier
    children: int
    tiers: dict[int, int] | None  # rank index -> tier bits, for carriers not DEVICE-only
    ehash: int | dict[int, int] | None  # one engine hash for all carriers, or per index


class PyNode(msgspec.Struct, gc=False):
    """The pure layout's node (the compiled one is `cachetree._tables.Node`)."""

    parent: int | None
    mask: int
    children: int
    tiers: dict[int, int] | None = None
    ehash: int | dict[int, int] | None = None


Nodes = MutableMapping[int, Node]  # key -> node: a dict, or a `_tables.NodeMap`
ByHash = MutableMapping[int, int]  # engine hash -> key: a dict, or a `_tables.HashMap`


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """How a tree's tables are made, and the runs that work on them."""

    name: str
    node: Callable[..., Node]  # node(parent, mask, children, tiers=None, ehash=None)
    node_map: Callable[[], Nodes]
    hash_map: Callable[[], ByHash]
    place_run: Callable[..., tuple[int, int]]
    remove_run: Callable[..., tuple[int, int, int, int]]
    # snapshot.py's C parts: SnapshotRestore's creation of records, SnapshotExport's walk
    graft_new: Callable[..., tuple[int, int]] | None = None
    walk_chunk: Callable[..., tuple | None] | None = None
    path_held: Callable[..., tuple[list[int], bool] | None] | None = None  # prefix_depths'


@dataclass(slots=True)
class _Rank:
    rank: RankId
    index: int
    by_engine_hash: ByHash  # engine hash -> key
    counts: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # per tier slot


@dataclass(slots=True)
class TreeStats:
    """Events the tree refused or could not resolve. Each is a count of events or hashes."""

    unknown_parent: int = 0  # stores dropped: parent hash not carried by the rank
    unknown_tier: int = 0  # stores dropped: medium maps to no tier
    wrong_block_size: int = 0  # stores dropped: block size differs from the tree's
    malformed_store: int = 0  # stores dropped: token count does not match the hashes
    unknown_removal: int = 0  # removed hashes the rank did not carry


class PrefixDepths:
    """Per rank, how many leading blocks of a prompt it holds contiguously from block 0.

    `any_tier` counts a block held on any tier; `device` only blocks held on the device tier.
    Ranks holding nothing are absent. Internally the answer is a few runs of
    `(rank index mask, depth)`, because along one prompt the set of holders changes only a
    few times; `depth_runs` exposes them for callers that score ranks by index.
    """

    __slots__ = ("_any", "_by_index", "_device")

    def __init__(
        self,
        any_runs: list[tuple[int, int]],
        device_runs: list[tuple[int, int]],
        by_index: list[_Rank | None],
    ) -> None:
        self._any = any_runs
        self._device = device_runs
        # The tree's own index table: read it before the tree next changes (rank indices are
        # reused after a rank is cleared).
        self._by_index = by_index

    @property
    def any_tier(self) -> dict[RankId, int]:
        return self._expand(self._any)

    @property
    def device(self) -> dict[RankId, int]:
        return self._expand(self._device)

    def depth_runs(self, device: bool = False) -> list[tuple[int, int]]:
        return self._device if device else self._any

    def _expand(self, runs: list[tuple[int, int]]) -> dict[RankId, int]:
        by_index = self._by_index
        out: dict[RankId, int] = {}
        for mask, depth in runs:
            while mask:
                low = mask & -mask
                out[by_index[low.bit_length() - 1].rank] = depth  # type: ignore[union-attr]
                mask ^= low
        return out


@dataclass(slots=True, frozen=True)
class Match:
    blocks: int  # leading blocks present in the index
    carriers: tuple[tuple[RankId, int], ...]  # (rank, tier bits) of the deepest matched node


class BlockTree:
    """The index. Plain synchronous code; one writer at a time (the pump)."""

    def __init__(self, block_size: int, layout: TreeLayout | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.stats = TreeStats()
        self._layout = layout or DEFAULT_LAYOUT
        self._nodes: Nodes = self._layout.node_map()
        self._ranks: dict[RankId, _Rank] = {}
        self._by_index: list[_Rank | None] = []
        # Sum of the ranks' carried blocks, kept by store/remove/clear; `recount` after
        # anything that fills `by_engine_hash` directly (snapshot restores).
        self._carried = 0
        # A rank's next state, built aside (`stage_rank`), and rank indices readers must not
        # see: those states, and the states they replaced while they are dropped.
        self._staged: dict[RankId, _Rank] = {}
        self._hidden = 0

    # -- queries ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: int) -> bool:
        return key in self._nodes

    def ranks(self) -> list[RankId]:
        return list(self._ranks)

    @property
    def carried_blocks(self) -> int:
        """(rank, block) pairs held, over every rank: what the index cap counts."""
        return self._carried

    def recount(self) -> int:
        """Recompute `carried_blocks` from the ranks (after a snapshot restore filled them)."""
        self._carried = sum(len(st.by_engine_hash) for st in self._ranks.values())
        return self._carried

    def largest_rank(self) -> RankId | None:
        """The rank carrying the most blocks (None when the index is empty)."""
        if not self._ranks:
            return None
        return max(self._ranks.values(), key=lambda st: len(st.by_engine_hash)).rank

    def block_count(self, rank: RankId, tier: int | None = None) -> int:
        """Blocks `rank` holds on `tier` (a single tier bit), or on any tier when None."""
        st = self._ranks.get(rank)
        if st is None:
            return 0
        if tier is None:
            return len(st.by_engine_hash)
        return st.counts[_TIER_BITS.index(tier)]

    def device_blocks(self, ranks: Iterable[RankId]) -> list[int]:
        """`block_count(rank, DEVICE)` of each rank, in order, in one call."""
        get = self._ranks.get
        return [0 if (st := get(r)) is None else st.counts[0] for r in ranks]

    def block_counts(self) -> dict[tuple[RankId, str], int]:
        """Blocks per (rank, tier name), zero rows left out."""
        out: dict[tuple[RankId, str], int] = {}
        for rank, st in self._ranks.items():
            for slot, n in enumerate(st.counts):
                if n:
                    out[(rank, TIER_NAMES[_TIER_BITS[slot]])] = n
        return out

    def carriers(self, key: int) -> dict[RankId, int]:
        """Rank -> tier bits for the block `key` (empty when absent)."""
        node = self._nodes.get(key)
        if node is None:
            return {}
        return {self._rank_of(i): bits for i, bits in self._carrier_bits(node)}

    def holds(self, rank: RankId, key: int) -> bool:
        """Whether `rank` carries the block `key`, on any tier."""
        st = self._ranks.get(rank)
        node = self._nodes.get(key)
        return st is not None and node is not None and node.mask >> st.index & 1 == 1

    def engine_hash(self, rank: RankId, key: int) -> int | None:
        st = self._ranks.get(rank)
        node = self._nodes.get(key)
        if st is None or node is None or not node.mask >> st.index & 1:
            return None
        return _ehash_of(node, st.index)

    def match(self, keys: Sequence[int]) -> Match:
        nodes = self._nodes
        depth = 0
        deepest: Node | None = None
        for key in keys:
            node = nodes.get(key)
            if node is None:
                break
            depth += 1
            deepest = node
        if deepest is None:
            return Match(0, ())
        carriers = tuple((self._rank_of(i), bits) for i, bits in self._carrier_bits(deepest))
        return Match(depth, carriers)

    def prefix_depths(self, keys: Sequence[int]) -> PrefixDepths:
        """One pass down the prompt's keys; a rank's depth ends at the first block it lacks.

        Blocks a rank holds deeper than a gap do not count: an engine can only reuse a cached
        prefix that starts at block 0. The pass is a few C-level sweeps (lookups, masks, a
        running AND) rather than a Python loop per block, which is what keeps a 125-block
        prompt cheap.
        """
        path = self._layout.path_held
        walked = None if path is None else path(self._nodes, keys)
        found: list[Node] | None = None
        if walked is None:
            found = list(map(self._nodes.get, keys))
            # A block's parent always exists, so the hits form a prefix of the lookups.
            if found and found[-1] is None:
                del found[found.index(None) :]
            held = list(accumulate(map(_get_mask, found), and_))
            tiered = any(map(_get_tiers, found))
        else:  # the compiled tables: lookups and the running AND in one C pass
            held, tiered = walked
        if not held:
            return PrefixDepths([], [], self._by_index)
        any_runs = _runs(held)
        if tiered:
            if found is None:
                found = list(map(self._nodes.__getitem__, keys[: len(held)]))
            device_masks = [
                n.mask if n.tiers is None else n.mask & ~_off_device_mask(n.tiers) for n in found
            ]
            device_runs = _runs(list(accumulate(device_masks, and_)))
        else:
            device_runs = any_runs
        if self._hidden:
            any_runs, device_runs = self._visible(any_runs), self._visible(device_runs)
        return PrefixDepths(any_runs, device_runs, self._by_index)

    def _visible(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """`runs` without the hidden ranks (a run is the ranks whose depth it is)."""
        shown = ~self._hidden
        return [(mask & shown, depth) for mask, depth in runs if mask & shown]

    # -- mutations -------------------------------------------------------------------------

    def store(
        self,
        rank: RankId,
        parent_engine_hash: int | None,
        engine_hashes: Sequence[int],
        token_ids: Sequence[int],
        block_size: int,
        tier: int = DEVICE,
        namespace: str | None = None,
        *,
        staged: bool = False,
    ) -> int:
        """Place each full block under its parent and OR `tier` into its carrier bits; into
        the rank's staged state (`stage_rank`) when `staged`.

        Returns the number of blocks placed (0 when the event was dropped and counted).
        """
        if not tier or tier & ~ALL_TIERS:
            self.stats.unknown_tier += 1
            return 0
        if block_size != self.block_size:
            self.stats.wrong_block_size += 1
            return 0
        if len(token_ids) != len(engine_hashes) * block_size:
            self.stats.malformed_store += 1
            return 0
        st = (self._staged if staged else self._ranks).get(rank)
        if parent_engine_hash is None:
            parent_key: int | None = None
            seed = namespace_seed(namespace)
        else:
            parent_key = st.by_engine_hash.get(parent_engine_hash) if st is not None else None
            if parent_key is None:
                self.stats.unknown_parent += 1
                return 0
            seed = parent_key
        keys = block_keys(token_ids, block_size, seed)
        return self._store_keys(st, rank, parent_key, engine_hashes, keys, tier)

    def store_keyed(
        self,
        rank: RankId,
        parent_engine_hash: int | None,
        engine_hashes: Sequence[int],
        keys: Sequence[int],
        tier: int = DEVICE,
    ) -> int:
        """`store` for blocks whose chained keys were computed elsewhere (an ingest process,
        from the tokens), seeded with the parent's key as `key_of` gives it now, or with the
        namespace's seed for a chain root. The caller vouches for the keys; the tree checks
        what it can (tier, lengths, parent carried). Returns the blocks placed."""
        if not tier or tier & ~ALL_TIERS:
            self.stats.unknown_tier += 1
            return 0
        if len(keys) != len(engine_hashes):
            self.stats.malformed_store += 1
            return 0
        st = self._ranks.get(rank)
        parent_key: int | None = None
        if parent_engine_hash is not None:
            parent_key = st.by_engine_hash.get(parent_engine_hash) if st is not None else None
            if parent_key is None:
                self.stats.unknown_parent += 1
                return 0
        return self._store_keys(st, rank, parent_key, engine_hashes, keys, tier)

    def key_of(self, rank: RankId, engine_hash: int) -> int | None:
        """The key `rank` carries under `engine_hash`, if any."""
        st = self._ranks.get(rank)
        return None if st is None else st.by_engine_hash.get(engine_hash)

    def _store_keys(
        self,
        st: _Rank | None,
        rank: RankId,
        parent_key: int | None,
        engine_hashes: Sequence[int],
        keys: Sequence[int],
        tier: int,
    ) -> int:
        if st is None:
            st = self._add_rank(rank)
        before = len(st.by_engine_hash)
        self._place(st, parent_key, keys, engine_hashes, tier)
        if not self._hidden >> st.index & 1:
            self._carried += len(st.by_engine_hash) - before
        return len(keys)

    def remove(self, rank: RankId, engine_hashes: Iterable[int], tier: int | None = None) -> int:
        """Clear `tier` (every tier when None) from the rank's carriers of these blocks.

        Returns how many of the hashes the rank carried.
        """
        st = self._ranks.get(rank)
        # A list is read as it is (an event's own: nothing here changes it), not copied.
        hashes = engine_hashes if type(engine_hashes) is list else list(engine_hashes)
        if st is None:
            self.stats.unknown_removal += len(hashes)
            return 0
        clear = ALL_TIERS if tier is None else tier
        nodes = self._nodes
        remove_run = self._layout.remove_run
        by_hash = st.by_engine_hash
        before = len(by_hash)
        index = st.index
        device = bool(clear & DEVICE)
        found = dropped_device_only = unknown = i = 0
        n = len(hashes)
        while i < n:
            # Device-only carriers (what engines evict nearly always) go in runs, in C when the
            # accelerator is built; the run stops before any other case, handled here.
            i, f, dropped, u = remove_run(nodes, by_hash, hashes, i, index, device)
            found += f
            dropped_device_only += dropped
            unknown += u
            if i == n:
                break
            eh = hashes[i]
            i += 1
            key = by_hash.get(eh)
            if key is None:  # a run that could not start (another tier) stops at any hash
                unknown += 1
                continue
            found += 1
            node = nodes[key]
            old = _bits_of(node, index)
            new = old & ~clear
            if new == old:
                continue
            _count(st.counts, old & ~new, -1)
            if new:
                _set_bits(node, index, new)
            else:
                del by_hash[eh]
                _drop_carrier(nodes, key, node, index)
        self.stats.unknown_removal += unknown
        st.counts[0] -= dropped_device_only
        self._carried -= before - len(by_hash)
        return found

    def clear_rank(self, rank: RankId) -> int:
        """Forget every block of `rank` (AllBlocksCleared, worker removal). Returns blocks."""
        return run_through(self.clear_rank_steps(rank, 1 << 62))

    def clear_rank_steps(self, rank: RankId, chunk: int) -> Generator[None, None, int]:
        """`clear_rank` in slices of `chunk` blocks, yielding between them; returns blocks.

        Between slices the rank holds fewer blocks, as if its engine were evicting them (the
        newest first, so a chain goes leaf first and each prune stops at once): every state a
        reader sees is one the rank could be in. The caller (the pump) must not apply other
        events of the rank before the generator is exhausted.
        """
        st = self._ranks.get(rank)
        if st is None:
            return 0
        return (yield from self._drop_steps(st, chunk))

    # -- a rank's state replaced behind the old one ----------------------------------------

    def stage_rank(self, rank: RankId) -> None:
        """Begin `rank`'s next state, empty, aside: `store(..., staged=True)` fills it, no
        reader sees it (not `prefix_depths`, the carriers, the counts, an export), until
        `swap_staged_steps` puts it in the old state's place at once."""
        if rank in self._staged:
            raise ValueError(f"{rank} already has a staged state")
        st = self._staged[rank] = self._new_rank(rank)
        self._hidden |= 1 << st.index

    def swap_staged_steps(self, rank: RankId, chunk: int) -> Generator[None, None, None]:
        """Put `rank`'s staged state in place of its state, in one step, then drop the old
        one out of sight in slices of `chunk` blocks. The caller must not stage the rank
        again before the generator is exhausted."""
        new = self._staged.pop(rank)
        old = self._ranks.get(rank)
        self._ranks[rank] = new
        self._hidden &= ~(1 << new.index)
        self._carried += len(new.by_engine_hash)
        if old is not None:
            self._carried -= len(old.by_engine_hash)
            self._hidden |= 1 << old.index
            yield from self._drop_steps(old, chunk)

    def drop_staged_steps(self, rank: RankId, chunk: int) -> Generator[None, None, int]:
        """Forget `rank`'s staged state (a refused body), in slices; the rank is as it was."""
        st = self._staged.pop(rank, None)
        if st is None:
            return 0
        return (yield from self._drop_steps(st, chunk))

    def _drop_steps(self, st: _Rank, chunk: int) -> Generator[None, None, int]:
        """Forget every block of `st` in slices, then free its index. A rank the readers see
        (`clear_rank_steps`) stays listed, shrinking, until its last slice; closed before it
        (the pump stopped), it stays as far as it was cleared, a state it could be in. A
        hidden one is then dropped at once: nothing would ever drop it or free its index."""
        total = len(st.by_engine_hash)
        try:
            while st.by_engine_hash:
                self._drop_blocks(st, chunk)
                if st.by_engine_hash:
                    yield
        except GeneratorExit:
            if self._hidden >> st.index & 1:
                self._drop_blocks(st, len(st.by_engine_hash))
                self._free(st)
            raise
        self._free(st)
        return total

    def _drop_blocks(self, st: _Rank, n: int) -> None:
        """Forget up to `n` blocks of `st`, the newest first."""
        nodes = self._nodes
        by_hash = st.by_engine_hash
        counts = st.counts
        index = st.index
        n = min(n, len(by_hash))
        for _ in range(n):
            key = by_hash.popitem()[1]
            node = nodes[key]
            _count(counts, _bits_of(node, index), -1)
            _drop_carrier(nodes, key, node, index)
        if not self._hidden >> index & 1:
            self._carried -= n

    def _free(self, st: _Rank) -> None:
        """`st` holds no block: unlist it and free its index."""
        if self._ranks.get(st.rank) is st:
            del self._ranks[st.rank]
        self._hidden &= ~(1 << st.index)
        self._by_index[st.index] = None
        while self._by_index and self._by_index[-1] is None:
            self._by_index.pop()

    # -- package internals (snapshot.py) ---------------------------------------------------

    def _iter_keys(self) -> list[int]:
        return list(self._nodes)

    def _node(self, key: int) -> Node | None:
        return self._nodes.get(key)

    def _rank_of(self, index: int) -> RankId:
        st = self._by_index[index]
        assert st is not None
        return st.rank

    def _carrier_bits(self, node: Node) -> Iterator[tuple[int, int]]:
        """(rank index, tier bits) for each carrier of `node` readers see, in index order."""
        tiers = node.tiers
        for index in _indices(node.mask & ~self._hidden):
            yield index, DEVICE if tiers is None else tiers.get(index, DEVICE)

    def _carriers_with_hash(self, node: Node) -> list[tuple[int, int, int]]:
        return [(i, bits, _ehash_of(node, i)) for i, bits in self._carrier_bits(node)]

    def _place(
        self,
        st: _Rank,
        parent_key: int | None,
        keys: Sequence[int],
        engine_hashes: Sequence[int],
        tier: int,
    ) -> None:
        """Create or extend the chain `keys` below `parent_key`, carried by `st` on `tier`."""
        nodes = self._nodes
        by_hash = st.by_engine_hash
        counts = st.counts
        index = st.index
        place_run = self._layout.place_run
        i, n = 0, len(keys)
        while i < n:
            if tier == DEVICE:
                # New blocks and new device-only carriers (nearly every store) go in runs, in C
                # when the accelerator is built; the run stops before any other case.
                i, added = place_run(nodes, by_hash, keys, engine_hashes, i, parent_key, index)
                counts[0] += added
                if i == n:
                    return
                if i:
                    parent_key = keys[i - 1]
            key = keys[i]
            self._place_one(st, parent_key, key, engine_hashes[i], tier)
            parent_key = key
            i += 1

    def _place_one(self, st: _Rank, parent_key: int | None, key: int, eh: int, tier: int) -> None:
        """`_place` of one block, every case: tier changes, re-pointed and reused hashes."""
        nodes = self._nodes
        by_hash = st.by_engine_hash
        counts = st.counts
        index = st.index
        bit = 1 << index
        node = nodes.get(key)
        if node is None:
            tiers = None if tier == DEVICE else {index: tier}
            node = self._layout.node(parent_key, bit, 0, tiers, eh)
            nodes[key] = node
            if parent_key is not None:
                nodes[parent_key].children += 1
            _count(counts, tier, 1)
        elif not node.mask & bit:
            node.mask |= bit
            if tier != DEVICE:
                _set_bits(node, index, tier)
            _set_ehash(node, index, bit, eh)
            _count(counts, tier, 1)
        else:
            old = _bits_of(node, index)
            if old | tier != old:
                _set_bits(node, index, old | tier)
                _count(counts, tier & ~old, 1)
            old_eh = _ehash_of(node, index)
            if old_eh != eh:
                if by_hash.get(old_eh) == key:
                    del by_hash[old_eh]
                _set_ehash(node, index, bit, eh)
        stale = by_hash.setdefault(eh, key)
        if stale != key:
            # The engine reused a hash for another block (content-only hashes in old engines).
            # The newest placement wins; the older one can no longer be removed by hash, so
            # drop it rather than leave a carrier nothing can clear.
            old_node = nodes[stale]
            _count(counts, _bits_of(old_node, index), -1)
            _drop_carrier(nodes, stale, old_node, index)
            by_hash[eh] = key

    def _add_rank(self, rank: RankId) -> _Rank:
        st = self._ranks[rank] = self._new_rank(rank)
        return st

    def _new_rank(self, rank: RankId) -> _Rank:
        """A state for `rank` at the lowest free index, listed nowhere but in the index table."""
        try:
            index = self._by_index.index(None)
        except ValueError:
            index = len(self._by_index)
            self._by_index.append(None)
        st = _Rank(rank, index, self._layout.hash_map())
        self._by_index[index] = st
        return st


def run_through(steps: Generator[None, None, T]) -> T:
    """Run a job in steps at once; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def _drop_carrier(nodes: Nodes, key: int, node: Node, index: int) -> None:
    """Remove rank `index` from `node` entirely, then prune what is left bare."""
    node.mask &= ~(1 << index)
    if node.tiers is not None:
        node.tiers.pop(index, None)
        if not node.tiers:
            node.tiers = None
    if type(node.ehash) is dict:
        node.ehash.pop(index, None)
    while not node.mask and not node.children:
        del nodes[key]
        parent = node.parent
        if parent is None:
            return
        node = nodes[parent]
        node.children -= 1
        key = parent


def _remove_run_py(
    nodes: Nodes,
    by_hash: ByHash,
    hashes: list[int],
    start: int,
    index: int,
    device: bool,
) -> tuple[int, int, int, int]:
    """Remove `hashes[start:]` while each is unknown or a device-only carrier of rank `index`.

    Such a carrier goes whole (`device`: the removal clears the device tier), without the
    general path's tier bookkeeping. Returns (where it stopped, hashes found, carriers
    dropped, hashes unknown); it stops before the first hash needing the general path,
    having changed nothing for it. The compiled twin is `_tables.remove_run`.
    """
    bit = 1 << index
    found = unknown = 0
    for i in range(start, len(hashes)):
        eh = hashes[i]
        key = by_hash.get(eh)
        if key is None:
            unknown += 1
            continue
        node = nodes[key]
        tiers = node.tiers
        if not (device and (tiers is None or index not in tiers) and node.mask & bit):
            return i, found, found, unknown
        found += 1
        del by_hash[eh]
        if node.mask == bit and not node.children:
            # Its only carrier, and a leaf (engines evict leaf first): the node goes, and its
            # parent is pruned only if that leaves it bare too.
            node.mask = 0
            del nodes[key]
            parent_key = node.parent
            if parent_key is not None:
                parent = nodes[parent_key]
                parent.children -= 1
                if not parent.children and not parent.mask:
                    _drop_carrier(nodes, parent_key, parent, index)
            continue
        _drop_carrier(nodes, key, node, index)
    return len(hashes), found, found, unknown


def _place_run_py(
    nodes: Nodes,
    by_hash: ByHash,
    keys: Sequence[int],
    engine_hashes: Sequence[int],
    start: int,
    parent_key: int | None,
    index: int,
) -> tuple[int, int]:
    """Place blocks `start:` of a chain on the device tier while each is a simple case.

    Simple: the block is new, or gains rank `index` as a device-only carrier under the engine
    hash it already has for every carrier, or already has it so; and the hash names no other
    block of the rank. Returns (where it stopped, carriers added); it stops before the first
    other block, having changed nothing for it. The compiled twin is `_tables.place_run`.
    """
    bit = 1 << index
    added = 0
    parent = None if parent_key is None else nodes[parent_key]
    for i in range(start, len(keys)):
        key = keys[i]
        eh = engine_hashes[i]
        stale = by_hash.get(eh)
        if stale is not None and stale != key:
            return i, added
        node = nodes.get(key)
        if node is None:
            node = PyNode(parent_key, bit, 0, None, eh)
            nodes[key] = node
            if parent is not None:
                parent.children += 1
            added += 1
        else:
            tiers = node.tiers
            if tiers is not None and index in tiers:
                return i, added
            ehash = node.ehash
            if not node.mask & bit:
                if type(ehash) is dict:
                    ehash[index] = eh
                elif not node.mask:
                    node.ehash = eh
                elif ehash != eh:
                    return i, added
                node.mask |= bit
                added += 1
            elif (ehash[index] if type(ehash) is dict else ehash) != eh:
                return i, added
        if stale is None:
            by_hash[eh] = key
        parent_key, parent = key, node
    return len(keys), added


PURE_LAYOUT = TreeLayout("pure", PyNode, dict, dict, _place_run_py, _remove_run_py)
COMPILED_LAYOUT: TreeLayout | None = (
    None
    if tables is None
    else TreeLayout(
        "compiled",
        tables.Node,
        tables.NodeMap,
        tables.HashMap,
        tables.place_run,
        tables.remove_run,
        tables.graft_new,
        tables.walk_chunk,
        tables.path_held,
    )
)
DEFAULT_LAYOUT = COMPILED_LAYOUT or PURE_LAYOUT


def _indices(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _runs(held: list[int]) -> list[tuple[int, int]]:
    """`held[i]`: ranks holding blocks 0..i. Returns (ranks whose depth is d, d) runs.

    `held` only loses ranks along the path, so its popcount never rises and each run ends
    where the popcount drops: found by bisection instead of a Python loop over blocks.
    """
    if held[-1] == held[0]:
        return [(held[0], len(held))] if held[0] else []
    negated_counts = list(map(neg, map(int.bit_count, held)))  # non-decreasing
    runs = []
    i, n = 0, len(held)
    while i < n and negated_counts[i]:
        j = bisect_left(negated_counts, negated_counts[i] + 1, i)
        runs.append((held[i] & ~(held[j] if j < n else 0), j))
        i = j
    return runs


def _off_device_mask(tiers: dict[int, int]) -> int:
    mask = 0
    for index, bits in tiers.items():
        if not bits & DEVICE:
            mask |= 1 << index
    return mask


def _bits_of(node: Node, index: int) -> int:
    if not node.mask >> index & 1:
        return 0
    tiers = node.tiers
    return DEVICE if tiers is None else tiers.get(index, DEVICE)


def _set_bits(node: Node, index: int, bits: int) -> None:
    """Set a carrier's (non-zero) tier bits; DEVICE-only carriers live in the mask alone."""
    tiers = node.tiers
    if bits == DEVICE:
        if tiers is not None:
            tiers.pop(index, None)
            if not tiers:
                node.tiers = None
    elif tiers is None:
        node.tiers = {index: bits}
    else:
        tiers[index] = bits


def _ehash_of(node: Node, index: int) -> int:
    eh = node.ehash
    if type(eh) is dict:
        return eh[index]
    assert eh is not None
    return eh


def _set_ehash(node: Node, index: int, bit: int, eh: int) -> None:
    """Record carrier `index`'s engine hash; `node.mask` already includes `bit`."""
    current = node.ehash
    if type(current) is dict:
        current[index] = eh
    elif node.mask == bit:
        node.ehash = eh
    elif current != eh:
        shared = {i: current for i in _indices(node.mask & ~bit)}
        shared[index] = eh
        node.ehash = shared


def _count(counts: list[int], bits: int, delta: int) -> None:
    if bits == DEVICE:
        counts[0] += delta
        return
    for slot, tier in enumerate(_TIER_BITS):
        if bits & tier:
            counts[slot] += delta
