"""One simulated engine rank: its prefix cache, its request queue and the events it publishes.

Every cache change and its batch are produced in one synchronous step (no await between them),
so the seq a batch carries always matches the order of cache changes, and `snapshot()` read
at any await point is exactly the state as of `last_seq`.

Batching rules (what a router sees per action):
- a request whose prompt has uncached full blocks publishes ONE batch: first one BlockRemoved
  per block evicted to make room (vLLM evicts while allocating, before it caches the new
  blocks, in the same scheduler step), then one BlockStored of the new blocks, chained from the
  last cached block of the prompt (parent None when nothing was cached). A fully cached prompt,
  or one shorter than a block, publishes nothing;
- a stored chain (`store_chain`) publishes exactly one batch, like a request, except that a
  chain already wholly cached is re-announced in full with parent None (as vLLM does for reused
  blocks), so that every stored chain costs one seq;
- evictions requested by a test publish one batch of BlockRemoved events (one per block), and
  nothing when nothing was evicted; a clear publishes one AllBlocksCleared batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fake_kv_worker.cache import Admission, CachedBlock, PagedPrefixCache
from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.hashing import HASHERS
from fake_kv_worker.wire import MEDIUM_GPU, Cleared, Event, Removed, Stored, normalize_hash

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class EventSink(Protocol):
    """The part of `publisher.RankPublisher` an engine rank drives."""

    @property
    def last_seq(self) -> int: ...

    def publish(self, payload: bytes) -> int: ...

    def restart(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Served:
    """What admitting one request's prompt cost."""

    prompt_tokens: int
    cached_tokens: int
    seq: int | None  # the batch it published, None when nothing changed


class RankEngine:
    def __init__(
        self,
        dp_rank: int,
        config: WorkerConfig,
        sink: EventSink,
        *,
        wall_clock: Callable[[], float],
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.dp_rank = dp_rank
        self.sink = sink
        self._flavour = config.flavour
        self._block_size = config.block_size
        self.cache = PagedPrefixCache(
            config.cache_blocks, config.block_size, HASHERS[self._flavour.engine]
        )
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._prefill_s_per_token = config.prefill_us_per_token / 1e6
        self._decode_s_per_token = config.decode_ms_per_token / 1e3
        self.max_running = config.max_concurrency
        self._slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        # Counters (requests only; test controls do not count as traffic).
        self.requests = 0
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.running = 0
        self._referenced_blocks = 0
        self.waiting = 0
        self.waiting_uncached_tokens = 0

    @property
    def last_seq(self) -> int:
        return self.sink.last_seq

    # --- serving requests ---------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> AsyncIterator[Served]:
        """Queue for a slot, admit the prompt (publishing its batch), charge the prefill time.

        The slot is held until the block exits, so decoding counts as running.
        """
        cached_blocks = self.cache.cached_prefix(token_ids, lora_name)
        uncached = len(token_ids) - cached_blocks * self._block_size
        self.waiting += 1
        self.waiting_uncached_tokens += uncached
        try:
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.waiting_uncached_tokens -= uncached
        blocks = -(-len(token_ids) // self._block_size)  # a partial last block is allocated too
        self.running += 1
        self._referenced_blocks += blocks
        try:
            served = self.admit_request(token_ids, lora_name)
            prefill_s = self._prefill_s_per_token * (served.prompt_tokens - served.cached_tokens)
            if prefill_s > 0:
                await self._sleep(prefill_s)
            yield served
        finally:
            self.running -= 1
            self._referenced_blocks -= blocks
            if self._slots is not None:
                self._slots.release()

    async def decode_step(self) -> None:
        """Charge the time of one generated token."""
        if self._decode_s_per_token > 0:
            await self._sleep(self._decode_s_per_token)

    def admit_request(self, token_ids: Sequence[int], lora_name: str | None = None) -> Served:
        admission = self.cache.admit(token_ids, medium=MEDIUM_GPU, lora_name=lora_name)
        seq = self._publish(self._events_for(admission, MEDIUM_GPU, lora_name))
        cached = admission.hit_blocks * self._block_size
        self.requests += 1
        self.hit_blocks += admission.hit_blocks
        self.miss_blocks += admission.total_blocks - admission.hit_blocks
        self.prompt_tokens += len(token_ids)
        self.cached_tokens += cached
        return Served(prompt_tokens=len(token_ids), cached_tokens=cached, seq=seq)

    @property
    def used_blocks(self) -> int:
        """KV blocks held by running requests: what the engines report as used.

        An idle cached block is evictable, so both engines count it as free: SGLang's usage is
        the pool less its available and evictable tokens, vLLM v1's free queue holds cached
        blocks no request references. Counting the cache instead reads a warm engine as full.
        Capped at the pool, which a real engine never exceeds (it queues instead).
        """
        return min(self._referenced_blocks, self.cache.capacity)

    # --- test controls ------------------------------------------------------------------

    def store_chain(
        self, token_ids: Sequence[int], medium: str = MEDIUM_GPU, lora_name: str | None = None
    ) -> int:
        """Cache a token chain as a request would and publish exactly one batch for it."""
        if self.cache.full_blocks(token_ids) == 0:
            raise ValueError("a chain needs at least one full block")
        admission = self.cache.admit(
            token_ids, medium=medium, lora_name=lora_name, reannounce_cached=True
        )
        seq = self._publish(self._events_for(admission, medium, lora_name))
        assert seq is not None  # a chain with a full block always announces something
        return seq

    def evict_chains(self, chains: Sequence[Sequence[int]], keep_blocks: int = 0) -> int:
        evicted: list[CachedBlock] = []
        for chain in chains:
            evicted.extend(self.cache.evict_chain(chain, keep_blocks))
        self._publish(self._removals(evicted))
        return len(evicted)

    def evict_lru(self, count: int) -> int:
        evicted = self.cache.evict_lru(count)
        self._publish(self._removals(evicted))
        return len(evicted)

    def clear(self) -> int:
        dropped = self.cache.clear()
        self._publish([Cleared()])
        return dropped

    def restart(self) -> None:
        """A new engine incarnation: empty cache, seq from 0. It announces nothing."""
        dropped = self.cache.clear()
        self.sink.restart()
        log.info("dp rank %d restarted: %d cached block(s) forgotten", self.dp_rank, dropped)

    # --- views --------------------------------------------------------------------------

    def snapshot(self, tier_name: Callable[[str], str | None]) -> dict[str, Any]:
        """The cache as `/v1/kv-snapshot` reports it, parent before child. An adapter's block
        names it (`lora_name`, as its BlockStored does); a base-model block has no such key."""
        wire_hash = self._flavour.wire_hash
        blocks = []
        for b in self.cache.blocks():
            block: dict[str, Any] = {
                "engine_hash": self._snapshot_hash(wire_hash(b.digest)),
                "parent_engine_hash": (
                    None if b.parent is None else self._snapshot_hash(wire_hash(b.parent))
                ),
                "token_ids": list(b.token_ids),
                "tier": tier_name(b.medium),
            }
            if b.lora_name is not None:
                block["lora_name"] = b.lora_name
            blocks.append(block)
        return {"dp_rank": self.dp_rank, "last_seq": self.last_seq, "blocks": blocks}

    def state(self) -> dict[str, Any]:
        return {
            "dp_rank": self.dp_rank,
            "last_seq": self.last_seq,
            "blocks": len(self.cache),
            "hits": self.hit_blocks,
            "misses": self.miss_blocks,
            "requests": self.requests,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "running": self.running,
            "waiting": self.waiting,
        }

    # --- internals ----------------------------------------------------------------------

    @staticmethod
    def _snapshot_hash(value: int | bytes) -> int:
        # JSON has no bytes: a bytes-hash engine's block is reported as the u64 routers use.
        return normalize_hash(value) if isinstance(value, bytes) else value

    def _events_for(self, admission: Admission, medium: str, lora_name: str | None) -> list[Event]:
        events: list[Event] = self._removals(admission.evicted)
        if admission.stored:
            wire_hash = self._flavour.wire_hash
            parent = admission.parent
            events.append(
                Stored(
                    block_hashes=[wire_hash(b.digest) for b in admission.stored],
                    parent_block_hash=None if parent is None else wire_hash(parent.digest),
                    token_ids=[t for b in admission.stored for t in b.token_ids],
                    block_size=self._block_size,
                    medium=medium,
                    lora_name=lora_name,
                )
            )
        return events

    def _removals(self, evicted: list[CachedBlock]) -> list[Event]:
        # One event per block, as vLLM's block pool emits them.
        wire_hash = self._flavour.wire_hash
        return [Removed(block_hashes=[wire_hash(b.digest)], medium=b.medium) for b in evicted]

    def _publish(self, events: list[Event]) -> int | None:
        if not events:
            return None
        payload = self._flavour.encode_batch(self._wall_clock(), events, self.dp_rank)
        seq = self.sink.publish(payload)
        log.debug(
            "dp rank %d published seq %d: %s",
            self.dp_rank,
            seq,
            ", ".join(_describe(e) for e in events),
        )
        return seq


def _describe(event: Event) -> str:
    if isinstance(event, Stored):
        return f"BlockStored({len(event.block_hashes)})"
    if isinstance(event, Removed):
        return "BlockRemoved"
    return "AllBlocksCleared"
