"""What an ingest process hands the pump: packed items round-trip, keys only when trustworthy."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from cachetree.keys import ROOT_SEED, block_keys, namespace_seed
from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from cachetree.tiers import DEVICE, HOST
from cachetree.tree import BlockTree
from router.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, RemovedRun
from router.index import IndexRules
from router.ingest_pool import (
    START_SILENCE_S,
    _copy_stats,
    hung,
    overrun,
    pick_process,
    restart_backoff_s,
)
from router.ingest_wire import (
    BEAT,
    Beat,
    KeyMirror,
    Stats,
    pack,
    pack_stats,
    stats_values,
    unpack,
)
from router.subscriber import LiveBatch, PublisherReset, SubscriberStats, UnrepairedGap

BS = 4
A = RankId("http://a:8000", 0)
B = RankId("http://b:8000", 1)
ROOT = list(range(10, 10 + 2 * BS))  # two blocks
CHILD = list(range(50, 50 + BS))


def stored(hashes: list[int], parent: int | None, tokens: list[int], ns: str | None = None):
    return BlockStored(hashes, parent, tokens, BS, DEVICE, "GPU", ns)


def batch(*events: object) -> EventBatch:
    return EventBatch(1767225600.5, list(events), 0, {"remote": 2})  # type: ignore[arg-type]


def plain(item: LiveBatch) -> list[tuple]:
    """A batch's events with token ids as plain lists, keys and seeds left out."""
    out = []
    for e in item.batch.events:
        if type(e) is BlockStored:
            out.append((e.engine_hashes, e.parent_engine_hash, list(e.token_ids), e.tier))
        else:
            out.append(e)
    return out


def test_a_live_batch_comes_back_as_the_same_events_with_keys_the_pump_would_compute() -> None:
    mirror = KeyMirror()
    original = LiveBatch(
        A,
        7,
        batch(
            stored([1, 2], None, ROOT, ns="lora-x"),
            stored([3], 2, CHILD),
            BlockRemoved([3], HOST, "CPU"),
            AllBlocksCleared(),
        ),
    )
    item = unpack(pack(original, mirror))
    assert type(item) is LiveBatch and (item.rank, item.seq) == (A, 7)
    assert item.batch.ts == original.batch.ts and item.batch.ignored == {"remote": 2}
    assert plain(item) == plain(original)
    root, child = item.batch.events[0], item.batch.events[1]
    assert root.seed == namespace_seed("lora-x")
    assert root.keys == block_keys(ROOT, BS, namespace_seed("lora-x"))
    assert child.seed == root.keys[-1]  # the parent's key, from the mirror
    assert child.keys == block_keys(CHILD, BS, root.keys[-1])


def test_a_run_of_removals_comes_back_as_one_run_and_the_mirror_forgets_its_blocks() -> None:
    mirror = KeyMirror()
    pack(LiveBatch(A, 0, batch(stored([1, 2], None, ROOT))), mirror)
    run = RemovedRun([2, 77], DEVICE, "GPU")
    item = unpack(pack(LiveBatch(A, 1, batch(run, BlockRemoved([5, 6], None, None))), mirror))
    assert item.batch.events == [run, BlockRemoved([5, 6], None, None)]
    assert type(item.batch.events[0]) is RemovedRun
    after = unpack(pack(LiveBatch(A, 2, batch(stored([3], 2, CHILD))), mirror))
    assert after.batch.events[0].keys is None  # block 2 was removed by the run


def test_a_store_under_a_parent_the_process_never_saw_is_sent_without_keys() -> None:
    item = unpack(pack(LiveBatch(A, 0, batch(stored([9], 123456, CHILD))), KeyMirror()))
    event = item.batch.events[0]
    assert event.keys is None and event.seed is None
    assert list(event.token_ids) == CHILD


def test_the_mirror_forgets_removed_blocks_and_cleared_ranks() -> None:
    mirror = KeyMirror()
    pack(LiveBatch(A, 0, batch(stored([1, 2], None, ROOT))), mirror)
    pack(LiveBatch(A, 1, batch(BlockRemoved([2], None, None))), mirror)
    after_removal = unpack(pack(LiveBatch(A, 2, batch(stored([3], 2, CHILD))), mirror))
    assert after_removal.batch.events[0].keys is None
    pack(LiveBatch(A, 3, batch(stored([4], 1, CHILD))), mirror)
    pack(PublisherReset(A), mirror)
    after_reset = unpack(pack(LiveBatch(A, 0, batch(stored([5], 1, CHILD))), mirror))
    assert after_reset.batch.events[0].keys is None


def test_the_mirror_is_bounded_per_rank() -> None:
    mirror = KeyMirror(per_rank=3)
    pack(LiveBatch(A, 0, batch(stored([1, 2], None, ROOT))), mirror)
    pack(LiveBatch(A, 1, batch(stored([3, 4], None, [t + 1 for t in ROOT]))), mirror)
    keyed = unpack(pack(LiveBatch(A, 2, batch(stored([5], 1, CHILD))), mirror))
    assert keyed.batch.events[0].keys is None  # hash 1 was the oldest of four


def test_resets_gaps_counters_and_beats_round_trip() -> None:
    mirror = KeyMirror()
    assert unpack(pack(PublisherReset(B), mirror)) == PublisherReset(B)
    assert unpack(pack(PublisherReset(B, jumped=True), mirror)) == PublisherReset(B, jumped=True)
    assert unpack(pack(UnrepairedGap(B, 4, 9), mirror)) == UnrepairedGap(B, 4, 9)
    stats = unpack(pack_stats(B, {"frames": 3, "replay": {"repaired": 1}}))
    assert type(stats) is Stats and stats.rank == B and stats.values["frames"] == 3
    assert type(unpack(BEAT)) is Beat


def test_a_ranks_counters_reach_the_replica_as_they_were_counted() -> None:
    """Counters keep their keys through the wire (asdict made them Counters of pairs, and the
    replica's /metrics failed on the first replay of a rank in an ingest process)."""
    counted = SubscriberStats(frames=7, seq_jumps=1)
    counted.replay["repaired"] += 2
    counted.decode_errors["msgpack"] += 1
    message = unpack(pack_stats(B, stats_values(counted)))
    assert type(message) is Stats
    received = SubscriberStats()
    _copy_stats(received, message.values)
    assert received == counted
    assert received.replay == Counter({"repaired": 2})


@pytest.mark.parametrize(
    "message",
    [b"", b"\xc1", msgspec.msgpack.encode([99, "x"]), msgspec.msgpack.encode([11, "u"])],
)
def test_a_message_that_is_not_one_item_whole_is_refused(message: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, ValueError)):
        unpack(message)


def test_tokens_of_a_length_not_a_multiple_of_four_are_refused() -> None:
    good = pack(LiveBatch(A, 0, batch(stored([1], None, CHILD))), KeyMirror())
    bad = msgspec.msgpack.decode(good)
    bad[6][0][3] = b"\x01\x02\x03"  # [tag, url, dp, seq, ts, dp_rank, events, ...]
    with pytest.raises(ValueError):
        unpack(msgspec.msgpack.encode(bad))


# -- the pump's side: precomputed keys are used only with the tree's own parent key --------


def rules_with(*ranks: RankId) -> IndexRules:
    rules = IndexRules(BlockTree(BS))
    rules.add_ranks(ranks)
    return rules


def test_keys_are_used_when_their_seed_is_the_trees_parent_key() -> None:
    rules = rules_with(A)
    rules.apply_batch(A, 0, batch(stored([1, 2], None, ROOT)))
    parent_key = block_keys(ROOT, BS)[-1]
    marker = [0xDEADBEEF]  # not what hashing CHILD gives: proves the keys were taken as sent
    keyed = stored([3], 2, CHILD)
    keyed.keys, keyed.seed = marker, parent_key
    rules.apply_batch(A, 1, batch(keyed))
    assert 0xDEADBEEF in rules._tree and rules._tree.engine_hash(A, 0xDEADBEEF) == 3


def test_keys_from_a_stale_seed_are_ignored_and_the_tokens_keyed_instead() -> None:
    rules = rules_with(A)
    rules.apply_batch(A, 0, batch(stored([1, 2], None, ROOT)))
    stale = stored([3], 2, CHILD)
    stale.keys, stale.seed = [0xDEADBEEF], 12345  # the process thought hash 2 keyed otherwise
    rules.apply_batch(A, 1, batch(stale))
    expected = rules_with(A)
    expected.apply_batch(A, 0, batch(stored([1, 2], None, ROOT)))
    expected.apply_batch(A, 1, batch(stored([3], 2, CHILD)))
    assert 0xDEADBEEF not in rules._tree
    assert canonical_view(rules._tree) == canonical_view(expected._tree)


def test_a_root_keyed_under_another_namespace_is_rekeyed() -> None:
    rules = rules_with(A)
    wrong = stored([1, 2], None, ROOT, ns="adapter")
    wrong.keys, wrong.seed = [11, 12], ROOT_SEED  # keyed as if without the namespace
    rules.apply_batch(A, 0, batch(wrong))
    assert block_keys(ROOT, BS, namespace_seed("adapter"))[0] in rules._tree
    assert 11 not in rules._tree


def test_store_keyed_refuses_what_store_refuses() -> None:
    tree = BlockTree(BS)
    assert tree.store_keyed(A, 77, [1], [100]) == 0
    assert tree.store_keyed(A, None, [1], [100], tier=0) == 0
    assert tree.store_keyed(A, None, [1, 2], [100]) == 0
    s = tree.stats
    assert (s.unknown_parent, s.unknown_tier, s.malformed_store) == (1, 1, 1)
    assert len(tree) == 0 and tree.carried_blocks == 0
    assert tree.store_keyed(A, None, [1, 2], [100, 101]) == 2
    assert tree.store_keyed(A, 2, [3], [102]) == 1
    assert tree.carried_blocks == 3 and tree.key_of(A, 3) == 102 and tree.key_of(B, 3) is None


# -- supervision rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loads", "chosen"), [([0], 0), ([2, 1, 1], 1), ([0, 0], 0), ([5, 3, 4, 3], 1)]
)
def test_a_new_rank_goes_to_the_process_with_the_fewest(loads: list[int], chosen: int) -> None:
    assert pick_process(loads) == chosen


@pytest.mark.parametrize(
    ("failures", "wait_s"), [(1, 0.1), (2, 0.2), (3, 0.4), (6, 3.2), (7, 5.0), (50, 5.0)]
)
def test_restarts_back_off_doubling_to_a_ceiling(failures: int, wait_s: float) -> None:
    assert restart_backoff_s(failures) == pytest.approx(wait_s)


@pytest.mark.parametrize(
    ("now", "heard", "up", "silence_s", "is_hung"),
    [
        (104.9, 100.0, True, 5.0, False),  # within the bound: a late beat is no harm
        (105.0, 100.0, True, 5.0, False),  # at it
        (105.1, 100.0, True, 5.0, True),  # past it
        (100.6, 100.0, True, 0.5, True),  # the bound is the flag's
        (100.0 + START_SILENCE_S - 1, 100.0, False, 5.0, False),  # before its Hello: imports
        (100.0 + START_SILENCE_S + 1, 100.0, False, 5.0, True),  # ... but not for ever
        (100.0 + START_SILENCE_S + 1, 100.0, False, 60.0, False),  # a longer flag holds there too
        (161.0, 100.0, False, 60.0, True),
    ],
)
def test_a_process_is_hung_once_silent_past_its_bound(
    now: float, heard: float, up: bool, silence_s: float, is_hung: bool
) -> None:
    assert hung(now, heard, up, silence_s) is is_hung


@pytest.mark.parametrize(
    ("waited", "woke", "tick_s", "stalled"),
    [
        (10.0, 10.2, 1.25, 0.0),  # woken by a message before the tick
        (10.0, 11.25, 1.25, 0.0),  # by the tick, on time
        (10.0, 11.3, 1.25, 0.05),  # a little late: a busy loop
        (10.0, 17.25, 1.25, 6.0),  # the pod frozen six seconds: no silence of the process's
    ],
)
def test_a_wait_past_its_tick_is_the_replica_not_running(
    waited: float, woke: float, tick_s: float, stalled: float
) -> None:
    assert overrun(waited, woke, tick_s) == pytest.approx(stalled)
