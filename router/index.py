"""Applying decoded engine events to the block index.

`apply_events` is the one place where a decoded batch becomes tree mutations. The pump (the
single writer of the tree) calls it for live batches, replays and held queues alike, so the
mapping from event kinds to tree operations exists exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from cachetree.ranks import RankId
from cachetree.tree import BlockTree
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def apply_events(
    tree: BlockTree, rank: RankId, events: Iterable[KVEvent], tally: Counter[tuple] | None = None
) -> None:
    """Apply events in order, counting them into `tally` by (kind, medium) for metrics."""
    if tally is None:
        tally = Counter()
    for event in events:
        if type(event) is BlockStored:
            tree.store(
                rank,
                event.parent_engine_hash,
                event.engine_hashes,
                event.token_ids,
                event.block_size,
                event.tier,
                event.namespace,
            )
            tally["stored", event.medium] += 1
        elif type(event) is BlockRemoved:
            tree.remove(rank, event.engine_hashes, event.tier)
            tally["removed", event.medium] += 1
        elif type(event) is AllBlocksCleared:
            tree.clear_rank(rank)
            tally["cleared", None] += 1
