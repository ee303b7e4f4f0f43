"""The simulated paged prefix cache: hits, insertion, LRU eviction of leaves only."""

from __future__ import annotations

import pytest

from fake_kv_worker.cache import PagedPrefixCache
from fake_kv_worker.hashing import VllmSha256Hasher

BS = 4


def blocks(*ids: int) -> list[int]:
    """A token sequence made of one distinct block per id (block `i` = [i]*BS)."""
    return [i for i in ids for _ in range(BS)]


def new_cache(capacity: int) -> PagedPrefixCache:
    return PagedPrefixCache(capacity, BS, VllmSha256Hasher())


def evicted_tokens(evicted: list) -> list[int]:
    return [b.token_ids[0] for b in evicted]


def test_a_new_prompt_stores_its_full_blocks_chained_from_the_root() -> None:
    cache = new_cache(16)
    adm = cache.admit([*blocks(1, 2, 3), 9, 9], medium="GPU")  # a partial tail is not cached
    assert (adm.total_blocks, adm.hit_blocks, adm.parent) == (3, 0, None)
    assert [b.token_ids for b in adm.stored] == [(1,) * BS, (2,) * BS, (3,) * BS]
    assert adm.stored[0].parent is None
    assert adm.stored[1].parent == adm.stored[0].digest
    assert len(cache) == 3


def test_a_repeated_prefix_is_hit_and_only_the_rest_is_stored() -> None:
    cache = new_cache(16)
    first = cache.admit(blocks(1, 2), medium="GPU")
    adm = cache.admit(blocks(1, 2, 3), medium="GPU")
    assert adm.hit_blocks == 2
    assert adm.parent is first.stored[-1]
    assert [b.token_ids[0] for b in adm.stored] == [3]
    assert cache.cached_prefix(blocks(1, 2, 3, 4)) == 3


def test_a_fully_cached_prompt_stores_nothing_unless_reannounced() -> None:
    cache = new_cache(16)
    cache.admit(blocks(1, 2), medium="GPU")
    assert cache.admit(blocks(1, 2), medium="GPU").stored == []
    again = cache.admit(blocks(1, 2), medium="CPU", reannounce_cached=True)
    assert again.parent is None
    assert [b.token_ids[0] for b in again.stored] == [1, 2]
    assert {b.medium for b in cache.blocks()} == {"CPU"}


def test_same_block_content_under_another_prefix_is_another_block() -> None:
    cache = new_cache(16)
    cache.admit(blocks(1, 2), medium="GPU")
    adm = cache.admit(blocks(3, 2), medium="GPU")
    assert adm.hit_blocks == 0
    assert len(cache) == 4


def test_eviction_takes_the_least_recently_used_leaf_first() -> None:
    cache = new_cache(4)
    cache.admit(blocks(1, 2), medium="GPU")  # chain A
    cache.admit(blocks(5, 6), medium="GPU")  # chain B
    cache.admit(blocks(1, 2), medium="GPU")  # touch A: B is now least recently used
    adm = cache.admit(blocks(7), medium="GPU")
    assert evicted_tokens(adm.evicted) == [6]  # B's leaf, not its parent, not A
    assert len(cache) == 4


def test_a_parent_is_never_evicted_before_its_children() -> None:
    cache = new_cache(3)
    cache.admit(blocks(1, 2, 3), medium="GPU")
    # The root block is the oldest, but it has a child: the tail goes first, then its parent.
    adm = cache.admit(blocks(8, 9), medium="GPU")
    assert evicted_tokens(adm.evicted) == [3, 2]
    remaining = {b.token_ids[0] for b in cache.blocks()}
    assert remaining == {1, 8, 9}
    for blk in cache.blocks():
        assert blk.parent is None or blk.parent in cache


def test_the_prompts_own_hits_are_never_evicted_to_make_room_for_it() -> None:
    cache = new_cache(3)
    cache.admit(blocks(1), medium="GPU")
    cache.admit(blocks(5, 6), medium="GPU")
    cache.admit(blocks(5, 6), medium="GPU")  # block 1 is now least recently used...
    adm = cache.admit(blocks(1, 2), medium="GPU")  # ...but it is this prompt's hit
    assert adm.hit_blocks == 1
    assert evicted_tokens(adm.evicted) == [6]


def test_a_prompt_longer_than_the_cache_keeps_its_first_capacity_blocks() -> None:
    cache = new_cache(2)
    cache.admit(blocks(7), medium="GPU")
    adm = cache.admit(blocks(1, 2, 3), medium="GPU")
    assert adm.total_blocks == 3
    assert [b.token_ids[0] for b in adm.stored] == [1, 2]
    assert evicted_tokens(adm.evicted) == [7]
    assert cache.cached_prefix(blocks(1, 2, 3)) == 2


def test_evict_lru_counts_blocks_and_frees_parents_as_they_become_leaves() -> None:
    cache = new_cache(16)
    cache.admit(blocks(1, 2), medium="GPU")
    cache.admit(blocks(5), medium="GPU")
    assert evicted_tokens(cache.evict_lru(2)) == [2, 1]
    assert evicted_tokens(cache.evict_lru(5)) == [5]
    assert len(cache) == 0


def test_evict_chain_removes_the_tail_and_keeps_a_shared_prefix() -> None:
    cache = new_cache(16)
    cache.admit(blocks(1, 2, 3), medium="GPU")
    cache.admit(blocks(1, 2, 4), medium="GPU")
    assert evicted_tokens(cache.evict_chain(blocks(1, 2, 3))) == [3]  # block 2 is shared
    assert evicted_tokens(cache.evict_chain(blocks(1, 2, 4), keep_blocks=1)) == [4, 2]
    assert [b.token_ids[0] for b in cache.blocks()] == [1]


def test_blocks_are_listed_parent_before_child_after_churn() -> None:
    cache = new_cache(5)
    for prompt in (blocks(1, 2), blocks(1, 3), blocks(4, 5, 6), blocks(1, 2, 7), blocks(4, 8)):
        cache.admit(prompt, medium="GPU")
    seen: set[bytes] = set()
    for blk in cache.blocks():
        assert blk.parent is None or blk.parent in seen
        seen.add(blk.digest)
    assert len(seen) == 5


def test_clear_forgets_everything() -> None:
    cache = new_cache(16)
    cache.admit(blocks(1, 2), medium="GPU")
    assert cache.clear() == 2
    assert cache.cached_prefix(blocks(1, 2)) == 0
    assert cache.admit(blocks(1, 2), medium="GPU").hit_blocks == 0


def test_stale_heap_entries_do_not_grow_without_bound() -> None:
    cache = new_cache(4)
    for _ in range(3000):
        cache.admit(blocks(1, 2), medium="GPU")
    assert len(cache._leaves) <= 2 * len(cache) + 1024 + 1


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(ValueError):
        new_cache(capacity)
