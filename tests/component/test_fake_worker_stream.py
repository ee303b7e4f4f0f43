"""The fake worker's KV-event stream over real ZMQ sockets: seqs, gaps, replay, restarts.

Every test gates its SUB tap first (probe batches until one arrives), so a frame a test waits
for is one the tap can see. Absence of a live frame is shown by order, never by waiting: ZMQ
delivers a publisher's frames in order, so if the next frame received is seq N+k, frames N..N+k-1
were not sent live.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from fake_kv_worker.hashing import engine_block_hashes
from tests.support.fake_worker import fake_worker_in_process
from tests.support.kv_stream import KvTap, replay

pytestmark = pytest.mark.timeout(20)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
CHAIN_A = list(range(100, 132))  # two blocks of 16
CHAIN_B = list(range(200, 248))  # three blocks


def stored_hashes(frame_events: list) -> list[int]:
    [ev] = frame_events
    assert ev["type"] == "BlockStored"
    return ev["block_hashes"]


async def test_each_stored_chain_is_one_batch_with_dense_seqs() -> None:
    async with fake_worker_in_process() as fw, KvTap(fw.kv_endpoint()) as tap:
        gate = await tap.gate(fw.probe)
        last = await fw.store([CHAIN_A, CHAIN_B, CHAIN_A + CHAIN_B[:16]])
        assert last == gate + 3
        frames = await tap.recv_through(last)
        assert [f.seq for f in frames] == [gate + 1, gate + 2, gate + 3]
        a, b, ab = ([ev for ev in f.batch()[1]] for f in frames)
        assert stored_hashes(a) == engine_block_hashes("vllm", CHAIN_A, 16)
        assert a[0]["parent_block_hash"] is None
        assert a[0]["token_ids"] == CHAIN_A
        assert stored_hashes(b) == engine_block_hashes("vllm", CHAIN_B, 16)
        # The third chain extends A: only its new block, chained to A's tail.
        full = engine_block_hashes("vllm", CHAIN_A + CHAIN_B[:16], 16)
        assert stored_hashes(ab) == [full[2]]
        assert ab[0]["parent_block_hash"] == full[1]
        assert (await fw.state())["last_seq"] == last


async def test_a_fully_cached_chain_is_reannounced_from_the_root() -> None:
    async with fake_worker_in_process() as fw, KvTap(fw.kv_endpoint()) as tap:
        await tap.gate(fw.probe)
        await fw.store([CHAIN_A])
        last = await fw.store([CHAIN_A])
        [_, again] = await tap.recv_through(last)
        [ev] = again.batch()[1]
        assert ev["block_hashes"] == engine_block_hashes("vllm", CHAIN_A, 16)
        assert ev["parent_block_hash"] is None


async def test_dropped_batches_are_missing_live_but_replayed() -> None:
    async with fake_worker_in_process(replay=True) as fw, KvTap(fw.kv_endpoint()) as tap:
        gate = await tap.gate(fw.probe)
        await fw.post("/control/drop-next", {"count": 2})
        last = await fw.store([CHAIN_A, CHAIN_B, CHAIN_A + CHAIN_B])
        # The next live frame is the third store: the two before it never went out.
        assert (await tap.recv()).seq == gate + 3 == last
        result = await replay(fw.replay_endpoint(), gate + 1)
        assert result.seqs == [gate + 1, gate + 2, gate + 3]
        assert stored_hashes(result.batches[0].batch()[1]) == engine_block_hashes(
            "vllm", CHAIN_A, 16
        )
        assert stored_hashes(result.batches[1].batch()[1]) == engine_block_hashes(
            "vllm", CHAIN_B, 16
        )
        assert result.end_marker == [b"", b"", b"\xff" * 8, b""]


async def test_replay_from_the_start_returns_the_whole_buffer_with_topic() -> None:
    async with (
        fake_worker_in_process(replay=True, topic="kv@demo") as fw,
        KvTap(fw.kv_endpoint(), topic=b"kv@demo") as tap,
    ):
        gate = await tap.gate(fw.probe)
        result = await replay(fw.replay_endpoint(), 0)
        assert result.seqs == list(range(gate + 1))
        assert {b.topic for b in result.batches} == {b"kv@demo"}
        assert (await tap.recv_through(await fw.store([CHAIN_A])))[-1].topic == b"kv@demo"
        assert (await replay(fw.replay_endpoint(), gate + 5)).seqs == []


async def test_a_skipped_seq_is_a_hole_nowhere_to_be_found() -> None:
    async with fake_worker_in_process(replay=True) as fw, KvTap(fw.kv_endpoint()) as tap:
        gate = await tap.gate(fw.probe)
        skipped = await fw.post("/control/skip-seq", {})
        assert skipped["last_seq"] == gate + 1
        last = await fw.store([CHAIN_A])
        assert (await tap.recv()).seq == last == gate + 2
        assert (await replay(fw.replay_endpoint(), gate + 1)).seqs == [gate + 2]


async def test_restart_publisher_starts_a_new_incarnation_at_seq_zero() -> None:
    async with fake_worker_in_process(replay=True) as fw, KvTap(fw.kv_endpoint()) as tap:
        await tap.gate(fw.probe)
        await fw.store([CHAIN_A])
        restarted = await fw.post("/control/restart-publisher", {"dp_rank": 0})
        assert restarted["last_seq"] == -1
        state = await fw.state()
        assert (state["blocks"], state["last_seq"]) == (0, -1)
        assert await fw.store([CHAIN_B]) == 0
        # Skip the old incarnation's frames still in flight, if any, up to the new seq 0.
        frames = await tap.recv_through(0)
        [ev] = frames[-1].batch()[1]
        assert ev["parent_block_hash"] is None  # CHAIN_A is forgotten, nothing chains to it
        assert (await replay(fw.replay_endpoint(), 0)).seqs == [0]


async def test_eviction_beyond_capacity_publishes_removals_of_leaves() -> None:
    async with fake_worker_in_process(cache_blocks=4) as fw, KvTap(fw.kv_endpoint()) as tap:
        gate = await tap.gate(fw.probe)  # the probe holds 1 block
        await fw.store([CHAIN_B])  # 3 more: full
        last = await fw.store([CHAIN_A])  # 2 new blocks: evict 2 LRU leaves
        frames = await tap.recv_through(last)
        events = frames[-1].batch()[1]
        assert [e["type"] for e in events] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
        probe_hash = engine_block_hashes("vllm", [2] * 16, 16)[0]
        b_hashes = engine_block_hashes("vllm", CHAIN_B, 16)
        # The probe block is least recently used and a leaf; then B's tail (never B's root
        # while B's middle block still chains from it).
        assert [e["block_hashes"] for e in events[:2]] == [[probe_hash], [b_hashes[2]]]
        assert last == gate + 2
        assert (await fw.state())["blocks"] == 4


async def test_control_evict_and_clear_publish_removals_and_cleared() -> None:
    async with fake_worker_in_process() as fw, KvTap(fw.kv_endpoint()) as tap:
        await tap.gate(fw.probe)
        await fw.store([CHAIN_B])
        evicted = await fw.post("/control/evict", {"token_chains": [CHAIN_B], "keep_blocks": 2})
        assert evicted["evicted"] == 1
        by_count = await fw.post("/control/evict", {"count": 1})
        cleared = await fw.post("/control/clear", {})
        frames = await tap.recv_through(cleared["last_seq"])
        b_hashes = engine_block_hashes("vllm", CHAIN_B, 16)
        assert frames[-3].seq == evicted["last_seq"]
        assert frames[-3].batch()[1][0]["block_hashes"] == [b_hashes[2]]
        assert frames[-2].seq == by_count["last_seq"]
        assert frames[-2].batch()[1][0]["type"] == "BlockRemoved"
        assert frames[-1].batch()[1] == [{"type": "AllBlocksCleared"}]
        assert (await fw.state())["blocks"] == 0


async def test_each_dp_rank_has_its_own_port_seqs_and_rank_field() -> None:
    async with (
        fake_worker_in_process(dp_size=2) as fw,
        KvTap(fw.kv_endpoint(0)) as tap0,
        KvTap(fw.kv_endpoint(1)) as tap1,
    ):
        g0 = await tap0.gate(fw.probe_for(0))
        g1 = await tap1.gate(fw.probe_for(1))
        last1 = await fw.store([CHAIN_A], dp_rank=1)
        [frame] = await tap1.recv_through(last1)
        assert frame.seq == g1 + 1
        assert frame.batch()[2] == 1
        assert (await fw.state(0))["last_seq"] == g0
        # A request routed to rank 1 lands in rank 1's cache and stream.
        async with fw.session.post(
            fw.url + "/v1/completions",
            json={"prompt": "x" * 40, "max_tokens": 1},
            headers={"X-Data-Parallel-Rank": "1"},
        ) as resp:
            assert resp.status == 200
            assert resp.headers["X-Fake-Worker-DP-Rank"] == "1"
        assert (await tap1.recv()).seq == g1 + 2
        assert (await fw.state(1))["requests"] == 1
        assert (await fw.state(0))["requests"] == 0


@pytest.mark.parametrize(
    ("wire", "tag"),
    [
        ("vllm", "vllm-0.33.0"),
        ("vllm-byteshash", "vllm-0.33.0-byteshash"),
        ("vllm-legacy", "vllm-0.23.0-arraylike"),
        ("sglang", "sglang-0.5.23"),
        ("sglang-legacy", "sglang-0.5.16-arraylike"),
    ],
)
async def test_a_stored_chain_on_the_wire_equals_the_engine_capture(wire: str, tag: str) -> None:
    async with (
        fake_worker_in_process(wire=wire, topic="kv@demo") as fw,
        KvTap(fw.kv_endpoint(), topic=b"kv@demo") as tap,
    ):
        await tap.gate(fw.probe)
        await fw.post("/control/clear", {})
        last = await fw.store([list(range(1, 33))])
        frame = (await tap.recv_through(last))[-1]
        assert frame.topic == (FIXTURES / f"{tag}_live0_frame0.bin").read_bytes()
        theirs = (FIXTURES / f"{tag}_live0_frame2.bin").read_bytes()
        assert msgspec.msgpack.decode(frame.payload)[1:] == msgspec.msgpack.decode(theirs)[1:]
        # Same bytes but the float64 ts (9 bytes after the array header).
        assert frame.payload[:2] == theirs[:2] and frame.payload[10:] == theirs[10:]


async def test_stopping_the_worker_ends_the_stream_with_end_seq() -> None:
    async with fake_worker_in_process() as fw:
        tap = KvTap(fw.kv_endpoint())
        try:
            await tap.gate(fw.probe)
            assert fw.worker is not None
            await fw.worker.stop()
            end = await tap.recv()
            assert (end.topic, end.is_end, end.payload) == (b"", True, b"")
        finally:
            tap.close()
