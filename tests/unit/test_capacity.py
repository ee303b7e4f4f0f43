"""`peer.capacity`: block counts against the engines' capacity; unknown means unchecked."""

from __future__ import annotations

from cachetree.ranks import RankId
from peer.capacity import allowed_blocks, over_capacity, overfull_ranks, unknown_capacity

A = RankId("http://a:1", 0)
B = RankId("http://b:1", 0)
C = RankId("http://c:1", 0)


def test_the_margin_allows_a_tenth_over_the_capacity() -> None:
    assert [allowed_blocks(c) for c in (0, 10, 100, 1000)] == [0, 11, 110, 1100]


def test_over_capacity_names_the_first_rank_past_its_engine() -> None:
    capacity = {A: 100, B: 10}.get
    assert over_capacity({A: 110, B: 11, C: 10**9}, capacity) is None  # C: unknown
    assert over_capacity({A: 111, B: 12}, capacity) == (A, 111, 100)
    assert over_capacity({A: 10**9}, unknown_capacity) is None


def test_overfull_ranks_lists_every_rank_past_its_engine() -> None:
    counts = {A: 500, B: 11, C: 7}
    capacity = {A: 100, B: 10, C: 5}.get
    assert overfull_ranks([A, B, C], counts.__getitem__, capacity) == [(A, 500, 100), (C, 7, 5)]
    assert overfull_ranks([A, B, C], counts.__getitem__, unknown_capacity) == []
