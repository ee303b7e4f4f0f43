"""What a replica can check of a block count against the engine's own KV capacity.

Rules of this file: plain functions, no I/O. An engine reports how many KV blocks a rank can
hold on the device (vLLM `num_gpu_blocks`, SGLang `max_total_num_tokens` / page size); the
load monitor reads it, and a `CapacityBlocks` function hands it over per rank, None while it
is unknown (and then nothing is checked: unknown is never "zero").

A rank cannot cache more device blocks than it has. A count above the capacity is therefore
evidence that blocks were made up (a sibling's snapshot of 200k blocks built from the real
cursors, issue 13 row 8) or that removals were lost: such blocks would be routed on forever,
since no `BlockRemoved` will ever name them. `OVER_CAPACITY_MARGIN` leaves room for the one
thing that can make an honest count run a little ahead: events of a rank applied in the
order they were published, where a store and the eviction it caused may straddle a batch.

Two uses: `over_capacity` vets a sibling's snapshot (`peer.vet`: rejected), and
`overfull_ranks` checks the live index (`router.replica`: the rank is cleared and pulled
again, never trusted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final

from cachetree.ranks import RankId

CapacityBlocks = Callable[[RankId], int | None]
OVER_CAPACITY_MARGIN: Final = 0.10


def unknown_capacity(rank: RankId) -> int | None:
    """The rule with nothing to go on: every capacity unknown, nothing checked."""
    return None


def allowed_blocks(capacity: int) -> int:
    """The most device blocks a rank of `capacity` may be believed to carry."""
    return int(capacity * (1 + OVER_CAPACITY_MARGIN))


def over_capacity(
    device_blocks: Mapping[RankId, int], capacity_blocks: CapacityBlocks
) -> tuple[RankId, int, int] | None:
    """The first rank (in the mapping's order) that carries more device blocks than its
    engine can hold, as (rank, blocks, capacity); None when every known capacity fits."""
    for rank, blocks in device_blocks.items():
        capacity = capacity_blocks(rank)
        if capacity is not None and capacity >= 0 and blocks > allowed_blocks(capacity):
            return rank, blocks, capacity
    return None


def overfull_ranks(
    ranks: Iterable[RankId],
    device_blocks: Callable[[RankId], int],
    capacity_blocks: CapacityBlocks,
) -> list[tuple[RankId, int, int]]:
    """Every rank of `ranks` whose index carries more device blocks than its engine can
    hold, as (rank, blocks, capacity)."""
    out = []
    for rank in ranks:
        capacity = capacity_blocks(rank)
        if capacity is None or capacity < 0:
            continue
        blocks = device_blocks(rank)
        if blocks > allowed_blocks(capacity):
            out.append((rank, blocks, capacity))
    return out
