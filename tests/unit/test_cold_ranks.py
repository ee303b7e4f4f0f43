"""Cold ranks: which views the pump holds as partial, and how the mark travels.

A rank's view is cold when it may miss blocks the engine holds (it joined the stream past
seq 0, lost batches, was cleared at the cap); the producer exports the marks as
`cold_ranks`, vetting reads them back, and a graft hands its source's mark on.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from cachetree.ranks import RankId
from cachetree.tiers import DEVICE
from cachetree.tree import BlockTree
from peer.producer import SnapshotProducer
from peer.vet import VettedSnapshot
from peer.wire import COLUMNS, JSON, MSGPACK, WireWorker, decode
from router.events import BlockStored, EventBatch
from router.graft import LocalGraft
from router.index import IndexRules
from router.subscriber import MAX_SEQ_JUMP, LiveBatch, PublisherReset
from router.worker_snapshot import SnapshotBlock, SnapshotRank
from tests.unit.test_graft import Rig

BS = 4
R = RankId("http://w", 0)
OTHER = RankId("http://q", 0)


def chain(seq: int, blocks: int = 1) -> EventBatch:
    """`blocks` blocks under one another, hashes and tokens unique to `seq`."""
    base = 1000 * (seq % MAX_SEQ_JUMP + 1)
    hashes = list(range(base, base + blocks))
    tokens = list(range(base, base + blocks * BS))
    return EventBatch(0.0, [BlockStored(hashes, None, tokens, BS, DEVICE, "GPU", None)], 0)


Step = Callable[[IndexRules], object]


def batch(seq: int, blocks: int = 1) -> Step:
    return lambda rules: rules.handle(LiveBatch(R, seq, chain(seq, blocks)))


def reset(rules: IndexRules) -> None:
    rules.handle(PublisherReset(R))


def worker_snapshot(last_seq: int) -> Step:
    block = SnapshotBlock(7, None, list(range(7, 7 + BS)))
    return lambda rules: rules.replace_rank(R, SnapshotRank(0, last_seq, [block]), BS)


def doubt(rules: IndexRules) -> None:
    rules.report_doubt(R)


def forget(rules: IndexRules) -> None:
    rules.forget_ranks([R])


# (case, steps, cold afterwards). The index cap is 4 blocks; `batch(seq, 5)` goes over it.
TRANSITIONS: list[tuple[str, list[Step], bool]] = [
    ("first batch at seq 0: the stream from its origin", [batch(0)], False),
    ("first batch past seq 0: joined mid-stream", [batch(3)], True),
    ("a stream followed batch by batch", [batch(0), batch(1), batch(2)], False),
    ("batches lost", [batch(0), batch(4)], True),
    ("joined mid-stream, then the engine restarts at 0", [batch(3), batch(0)], False),
    ("a seq jump: a new stream whose start was missed", [batch(0), batch(MAX_SEQ_JUMP + 2)], True),
    ("publisher reset, the new stream seen from 0", [batch(3), reset, batch(0)], False),
    ("publisher reset, the new stream joined past 0", [batch(0), reset, batch(2)], True),
    ("publisher reset: no cursor, nothing to say yet", [batch(3), reset], False),
    ("the worker's own snapshot", [batch(3), worker_snapshot(5)], False),
    ("a stale worker snapshot changes nothing", [batch(9), worker_snapshot(4)], True),
    ("cleared at the index cap, the cursor kept", [batch(0), batch(1, 5)], True),
    ("an ingest restart's doubt", [batch(0), doubt], True),
    ("a forgotten rank", [batch(3), forget], False),
]


@pytest.mark.parametrize(
    "steps,cold", [case[1:] for case in TRANSITIONS], ids=[case[0] for case in TRANSITIONS]
)
def test_the_pump_marks_a_rank_cold_exactly_when_its_view_may_miss_blocks(
    steps: list[Step], cold: bool
) -> None:
    rules = IndexRules(BlockTree(BS), max_blocks=4)
    rules.add_ranks([R, OTHER])
    for step in steps:
        step(rules)
    assert (R in rules.cold) is cold
    assert OTHER not in rules.cold


# -- the export and vetting ----------------------------------------------------------------


async def export_of(rules: IndexRules, content_type: str) -> bytes:
    producer = SnapshotProducer(rules)
    return await producer.body(await producer.export(), content_type, gzip=False)


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, COLUMNS])
async def test_the_export_names_the_cold_ranks_it_carries_in_every_encoding(
    content_type: str,
) -> None:
    rules = IndexRules(BlockTree(BS))
    empty = RankId("http://e", 0)
    rules.add_ranks([R, OTHER, empty])
    rules.handle(LiveBatch(R, 3, chain(3)))  # joined mid-stream
    rules.handle(LiveBatch(OTHER, 0, chain(0)))  # from the origin
    rules.report_doubt(empty)  # cold, carrying nothing: an empty rank, and a cold one
    body = decode(await export_of(rules, content_type), content_type)
    assert body.cold_ranks == [WireWorker(R.worker_url, R.dp_rank), WireWorker(*empty)]
    assert body.empty_ranks == [WireWorker(*empty)]
    vetted = VettedSnapshot.from_wire(body, {R, OTHER, empty}, BS)
    assert vetted.cold_ranks == {R, empty}
    assert vetted.covers_warm([OTHER]) and not vetted.covers_warm([R])
    assert vetted.retain_workers([OTHER]).cold_ranks == frozenset()


async def test_an_export_with_no_cold_rank_omits_the_field_and_an_old_body_reads_warm() -> None:
    rules = IndexRules(BlockTree(BS))
    rules.add_ranks([R])
    rules.handle(LiveBatch(R, 0, chain(0)))
    raw = msgspec.json.decode(await export_of(rules, JSON))
    assert "cold_ranks" not in raw
    # A body from a producer that predates the field: no evidence, so not cold.
    vetted = VettedSnapshot.from_wire(decode(msgspec.json.encode(raw)), {R}, BS)
    assert vetted.cold_ranks == frozenset() and vetted.covers_warm([R])


# -- grafts hand the mark on ---------------------------------------------------------------


async def sibling_body(first_seq: int) -> VettedSnapshot:
    """A sibling that saw R's stream from `first_seq` to 5, as vetted by the joiner."""
    sibling = IndexRules(BlockTree(BS))
    sibling.add_ranks([R])
    for seq in range(first_seq, 6):
        sibling.handle(LiveBatch(R, seq, chain(seq)))
    body = decode(await export_of(sibling, COLUMNS), COLUMNS)
    return VettedSnapshot.from_wire(body, {R}, BS)


@pytest.mark.parametrize("first_seq,cold", [(0, False), (4, True)])
async def test_a_graft_hands_on_its_sources_mark(first_seq: int, cold: bool) -> None:
    rig = Rig()
    rig.live(R, 6, chain(6))  # held until the graft
    assert rig.rules.apply_snapshot(rig.obligations, await sibling_body(first_seq)) == [R]
    assert rig.outcome() == "warm"  # the splice is proven either way: a partial view is true
    assert (R in rig.index.cold) is cold


async def test_a_graft_from_a_warm_source_makes_a_cold_rank_whole_again() -> None:
    rig = Rig()
    rig.index.cold.add(R)  # e.g. a gap retry's rank, cleared and held again
    rig.rules.apply_snapshot(rig.obligations, await sibling_body(0))
    assert R not in rig.index.cold


def test_a_rank_whose_bootstrap_ran_cold_is_cold_once_it_replays_its_held_batches() -> None:
    rig = Rig()
    rig.live(R, 6, chain(6))
    rig.rules.abandon(rig.obligations)
    assert rig.outcome() == "abandoned"
    assert R in rig.index.cold and rig.blocks() == 1


def _abandon(rig: Rig) -> None:
    rig.rules.abandon(rig.obligations)


def _uncovered(rig: Rig) -> None:
    rig.rules.apply_snapshot(rig.obligations, LocalGraft(BlockTree(BS), {}))


def _probe_gap(rig: Rig) -> None:
    rig.rules.apply_snapshot(rig.obligations, LocalGraft(BlockTree(BS), {R: 5}))
    rig.rules.probe_verdict(R, rig.obligations[0].epoch, 5, "advanced")


@pytest.mark.parametrize(
    "settle,outcome", [(_abandon, "abandoned"), (_uncovered, "uncovered"), (_probe_gap, "gap")]
)
def test_a_rank_whose_bootstrap_ran_cold_is_cold_before_its_first_batch(
    settle: Callable[[Rig], None], outcome: str
) -> None:
    """An idle rank that ran cold showed as merely empty (kvrouter_index_cold_ranks 0, the
    export's empty_ranks only, `absent` in view --watch) until its first live batch."""
    rig = Rig(retry_accepts=False)
    settle(rig)
    assert rig.outcome() == outcome
    assert R in rig.index.cold and rig.blocks() == 0 and R not in rig.index.cursors
    rig.live(R, 0, chain(0))  # its next batch decides, as ever: from the origin, whole
    assert R not in rig.index.cold


def test_a_pending_rank_whose_stream_starts_at_0_is_whole() -> None:
    rig = Rig()
    rig.live(R, 0, chain(0))
    assert rig.outcome() == "from_origin"
    assert R not in rig.index.cold
