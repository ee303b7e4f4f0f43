"""A paged prefix cache with LRU eviction of leaf blocks: an engine's block pool, minus the GPU.

Rules of this file: plain synchronous code, no I/O, no clocks, no events. It says which blocks
were hit, stored and evicted; the caller turns that into KV events. Time is a logical tick.

Theory of operation
-------------------
A block is one full page of `block_size` tokens. It is identified by its engine digest, which
is chained (it covers the block's tokens AND every token before it), so a flat mapping
`digest -> block` is a radix tree: a block's parent is the block whose digest it was chained
from. Partial trailing blocks are never cached, as in the engines. A LoRA adapter's blocks are
digested under its name (`hashing`), so the same tokens under another adapter or the base model
are other blocks: what walks a prompt takes the adapter it runs under (None: the base model).

Admitting a prompt:
1. walk its full blocks from the root while they are cached: those are hits (the longest
   cached prefix). Touch them, root to tail, so they are the most recently used;
2. if the rest does not fit, evict least-recently-used LEAF blocks (never one of this prompt's
   hits) until it does. Evicting leaves only means a parent never leaves before its children,
   which is what keeps the engine's stream coherent: a BlockRemoved never orphans a block a
   router still indexes under it. Once a leaf goes, its parent may become a leaf and compete
   with its own (older) tick;
3. insert the missing blocks, chained to the last hit (or the root).
A prompt longer than the whole cache keeps only its first `capacity` blocks.

Eviction order uses a heap of (tick, digest) over leaves with lazy invalidation: an entry is
live only while the block exists, is still a leaf and still has that tick. Ticks only grow, and
a chain is touched root to tail, so a parent's tick is always below its children's.

Blocks are kept in a dict in insertion order; because a parent is always inserted before its
children and can only leave after them, that order is parent-before-child, which is the order a
snapshot must list them in.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from fake_kv_worker.hashing import EngineHasher


@dataclass(slots=True, eq=False)
class CachedBlock:
    digest: bytes
    parent: bytes | None  # the parent block's digest; None at the root
    token_ids: tuple[int, ...]
    medium: str
    lora_name: str | None = None  # the adapter it was computed under; None: the base model
    children: int = 0  # cached blocks chained directly from this one
    last_used: int = 0  # logical tick of the last touch


@dataclass(slots=True)
class Admission:
    """What admitting one token sequence did to the cache."""

    total_blocks: int  # full blocks in the sequence
    hit_blocks: int  # leading blocks that were already cached
    parent: CachedBlock | None  # the block `stored[0]` chains from
    stored: list[CachedBlock] = field(default_factory=list)  # to announce, root to tail
    evicted: list[CachedBlock] = field(default_factory=list)  # in eviction order


class PagedPrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int, hasher: EngineHasher) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._hasher = hasher
        self._blocks: dict[bytes, CachedBlock] = {}
        self._leaves: list[tuple[int, bytes]] = []  # heap; see "Theory of operation"
        self._tick = 0

    # --- reading ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block, each after its parent."""
        return iter(self._blocks.values())

    def full_blocks(self, token_ids: Sequence[int]) -> int:
        return len(token_ids) // self.block_size

    def cached_prefix(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """How many leading full blocks of `token_ids` are cached. Touches nothing."""
        return len(self._cached_chain(token_ids, lora_name))

    # --- writing ------------------------------------------------------------------------

    def admit(
        self,
        token_ids: Sequence[int],
        *,
        medium: str,
        lora_name: str | None = None,
        reannounce_cached: bool = False,
    ) -> Admission:
        """Serve `token_ids`: count the hits, make room, cache the missing full blocks.

        With `reannounce_cached`, a sequence that is already wholly cached is reported in
        `stored` in full (parent None) and takes `medium`, as an engine re-announcing reused
        blocks would; otherwise nothing is stored for it.
        """
        total = self.full_blocks(token_ids)
        usable = min(total, self.capacity)
        hits = self._cached_chain(token_ids, lora_name, limit=usable)
        self._touch(hits)
        admission = Admission(total_blocks=total, hit_blocks=len(hits), parent=None)
        if len(hits) == usable:
            if reannounce_cached and hits:
                for blk in hits:
                    blk.medium = medium
                admission.stored = hits
            else:
                admission.parent = hits[-1] if hits else None
            return admission

        admission.parent = hits[-1] if hits else None
        overflow = len(self._blocks) + (usable - len(hits)) - self.capacity
        if overflow > 0:
            admission.evicted = self._evict_leaves(overflow, pinned={b.digest for b in hits})
        parent = admission.parent
        bs = self.block_size
        for i in range(len(hits), usable):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = self._hasher.block_digest(parent.digest if parent else None, tokens, lora_name)
            blk = CachedBlock(
                digest=digest,
                parent=parent.digest if parent else None,
                token_ids=tokens,
                medium=medium,
                lora_name=lora_name,
            )
            self._insert(blk)
            admission.stored.append(blk)
            parent = blk
        return admission

    def evict_lru(self, count: int) -> list[CachedBlock]:
        """Evict up to `count` least-recently-used leaves (a freed parent may follow)."""
        return self._evict_leaves(count, pinned=set())

    def evict_chain(self, token_ids: Sequence[int], keep_blocks: int = 0) -> list[CachedBlock]:
        """Evict the cached blocks of `token_ids` beyond its first `keep_blocks`, tail first.

        Stops at the first block that other cached blocks still chain from: a shared prefix
        stays, exactly as leaf-only eviction would leave it.
        """
        chain = self._cached_chain(token_ids)
        evicted: list[CachedBlock] = []
        for blk in reversed(chain[keep_blocks:]):
            if blk.children:
                break
            self._remove(blk)
            evicted.append(blk)
        return evicted

    def clear(self) -> int:
        """Drop everything (AllBlocksCleared / a restarted engine). Returns the count dropped."""
        dropped = len(self._blocks)
        self._blocks.clear()
        self._leaves.clear()
        return dropped

    # --- internals ----------------------------------------------------------------------

    def _cached_chain(
        self, token_ids: Sequence[int], lora_name: str | None = None, limit: int | None = None
    ) -> list[CachedBlock]:
        bs = self.block_size
        n = self.full_blocks(token_ids) if limit is None else limit
        chain: list[CachedBlock] = []
        parent: bytes | None = None
        for i in range(n):
            digest = self._hasher.block_digest(parent, token_ids[i * bs : (i + 1) * bs], lora_name)
            blk = self._blocks.get(digest)
            if blk is None:
                break
            chain.append(blk)
            parent = digest
        return chain

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _touch(self, chain: list[CachedBlock]) -> None:
        for blk in chain:
            blk.last_used = self._next_tick()
            if blk.children == 0:
                self._push_leaf(blk)

    def _insert(self, blk: CachedBlock) -> None:
        blk.last_used = self._next_tick()
        self._blocks[blk.digest] = blk
        if blk.parent is not None:
            self._blocks[blk.parent].children += 1
        self._push_leaf(blk)

    def _remove(self, blk: CachedBlock) -> None:
        del self._blocks[blk.digest]
        if blk.parent is not None:
            parent = self._blocks[blk.parent]
            parent.children -= 1
            if parent.children == 0:
                self._push_leaf(parent)

    def _push_leaf(self, blk: CachedBlock) -> None:
        heapq.heappush(self._leaves, (blk.last_used, blk.digest))
        # Stale entries pile up as blocks are touched; rebuild before they dominate the heap.
        if len(self._leaves) > 2 * len(self._blocks) + 1024:
            live = self._blocks.values()
            self._leaves = [(b.last_used, b.digest) for b in live if not b.children]
            heapq.heapify(self._leaves)

    def _is_live_leaf(self, tick: int, digest: bytes) -> CachedBlock | None:
        blk = self._blocks.get(digest)
        if blk is None or blk.children or blk.last_used != tick:
            return None
        return blk

    def _evict_leaves(self, count: int, pinned: set[bytes]) -> list[CachedBlock]:
        evicted: list[CachedBlock] = []
        skipped: list[tuple[int, bytes]] = []
        while len(evicted) < count and self._leaves:
            tick, digest = heapq.heappop(self._leaves)
            blk = self._is_live_leaf(tick, digest)
            if blk is None:
                continue
            if digest in pinned:
                skipped.append((tick, digest))
                continue
            self._remove(blk)
            evicted.append(blk)
        for entry in skipped:
            heapq.heappush(self._leaves, entry)
        return evicted
