"""Real ZMQ from a fake engine -> router.events -> the tree, checked against the engine's own
view of its cache (`/v1/kv-snapshot`), for every wire flavour."""

from __future__ import annotations

import msgspec
import pytest

from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from cachetree.tree import BlockTree
from router.events import BlockRemoved, BlockStored, decode_batch
from router.index import apply_events
from router.worker_snapshot import decode_worker_snapshot, rebuild_rank
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.kv_stream import KvTap

BS = 16


def chain(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def tree_from_worker_snapshot(fw: FakeWorkerHandle, rank: RankId) -> BlockTree:
    async with fw.session.get(f"{fw.url}/v1/kv-snapshot") as resp:
        assert resp.status == 200
        snap = decode_worker_snapshot(await resp.read())
    tree = BlockTree(BS)
    (rank_snap,) = [r for r in snap.ranks if r.dp_rank == rank.dp_rank]
    rebuild_rank(tree, rank, rank_snap, snap.block_size)
    return tree


async def ingest_through(tap: KvTap, tree: BlockTree, rank: RankId, last_seq: int) -> list:
    events = []
    for frame in await tap.recv_through(last_seq):
        batch = decode_batch(frame.payload)
        events.extend(batch.events)
        apply_events(tree, rank, batch.events)
    return events


@pytest.mark.parametrize("wire", ["vllm", "sglang", "vllm-legacy", "sglang-legacy"])
async def test_tree_fed_by_the_live_stream_equals_the_engines_own_snapshot(wire: str) -> None:
    async with fake_worker_in_process(wire=wire, serve_kv_snapshot=True, cache_blocks=64) as fw:
        rank = RankId(fw.url, 0)
        async with KvTap(fw.kv_endpoint(0)) as tap:
            gate_seq = await tap.gate(fw.probe)
            # The probe blocks were published before the tap was live: index them from the
            # worker's snapshot, as a router does when a worker registers.
            tree = await tree_from_worker_snapshot(fw, rank)
            shared = chain(1000, 4)
            last = await fw.store([shared, [*shared, *chain(5000, 3)], chain(9000, 2)])
            assert last == gate_seq + 3
            await ingest_through(tap, tree, rank, last)
        expected = await tree_from_worker_snapshot(fw, rank)
        assert canonical_view(tree) == canonical_view(expected)
        assert tree.block_count(rank) == (await fw.state(0))["blocks"]
        assert tree.prefix_depths(_keys([*shared, *chain(5000, 3)])).any_tier == {rank: 7}


async def test_eviction_emits_removals_that_keep_the_tree_equal_to_the_engine() -> None:
    async with fake_worker_in_process(serve_kv_snapshot=True, cache_blocks=6) as fw:
        rank = RankId(fw.url, 0)
        async with KvTap(fw.kv_endpoint(0)) as tap:
            await tap.gate(fw.probe)
            tree = await tree_from_worker_snapshot(fw, rank)
            last = await fw.store([chain(100 * i + 1000, 2) for i in range(6)])
            events = await ingest_through(tap, tree, rank, last)
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.engine_hashes]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.engine_hashes]
        assert len(stored) == 12
        assert len(removed) >= 6  # 12 new blocks into a 6-block cache
        assert tree.block_count(rank) == 6
        assert canonical_view(tree) == canonical_view(await tree_from_worker_snapshot(fw, rank))


async def test_two_ranks_of_one_worker_are_indexed_apart() -> None:
    async with fake_worker_in_process(dp_size=2, serve_kv_snapshot=True) as fw:
        r0, r1 = RankId(fw.url, 0), RankId(fw.url, 1)
        tree = BlockTree(BS)
        async with KvTap(fw.kv_endpoint(0)) as tap0, KvTap(fw.kv_endpoint(1)) as tap1:
            await tap0.gate(fw.probe_for(0))
            await tap1.gate(fw.probe_for(1))
            last0 = await fw.store([chain(1, 3)], dp_rank=0)
            last1 = await fw.store([chain(1, 2)], dp_rank=1)
            await ingest_through(tap0, tree, r0, last0)
            await ingest_through(tap1, tree, r1, last1)
        assert tree.prefix_depths(_keys(chain(1, 3))).any_tier == {r0: 3, r1: 2}


def snapshot_body(*blocks: dict[str, object]) -> bytes:
    """A worker's /v1/kv-snapshot body: dp rank 0 at seq 3 holding `blocks`."""
    return msgspec.json.encode(
        {"block_size": BS, "ranks": [{"dp_rank": 0, "last_seq": 3, "blocks": list(blocks)}]}
    )


def test_worker_snapshot_with_a_forward_parent_is_refused_and_changes_nothing() -> None:
    from router.worker_snapshot import WorkerSnapshotError

    body = snapshot_body(
        {"engine_hash": 2, "parent_engine_hash": 1, "token_ids": chain(1, 1)},
        {"engine_hash": 1, "parent_engine_hash": None, "token_ids": chain(1, 1)},
    )
    rank = RankId("http://w", 0)
    tree = BlockTree(BS)
    tree.store(rank, None, [77], chain(500, 1), BS)
    before = canonical_view(tree)
    snap = decode_worker_snapshot(body)
    with pytest.raises(WorkerSnapshotError):
        rebuild_rank(tree, rank, snap.ranks[0], snap.block_size)
    assert canonical_view(tree) == before


@pytest.mark.parametrize("bad", [-5, 2**32, 2**70])
def test_worker_snapshot_with_a_token_id_out_of_range_is_refused_whole(bad: int) -> None:
    """Checked as the body decodes: before, the rank was cleared and then the store of the
    bad block raised (an OverflowError), leaving the rank with the blocks before it."""
    from router.worker_snapshot import WorkerSnapshotError

    tokens = chain(1, 2)
    tokens[BS] = bad  # the second block's first token
    body = snapshot_body(
        {"engine_hash": 1, "parent_engine_hash": None, "token_ids": tokens[:BS]},
        {"engine_hash": 2, "parent_engine_hash": 1, "token_ids": tokens[BS:]},
    )
    with pytest.raises(WorkerSnapshotError, match="not a kv-snapshot body"):
        decode_worker_snapshot(body)


def _keys(tokens: list[int]) -> list[int]:
    from cachetree.keys import block_keys

    return block_keys(tokens, BS)
