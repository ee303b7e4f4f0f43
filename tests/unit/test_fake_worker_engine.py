"""One simulated rank: which batches its actions publish (no sockets: a list stands in)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.engine import RankEngine
from fake_kv_worker.hashing import engine_block_hashes

BS = 4


class ListSink:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.restarts = 0

    @property
    def last_seq(self) -> int:
        return len(self.payloads) - 1

    def publish(self, payload: bytes) -> int:
        self.payloads.append(payload)
        return len(self.payloads) - 1

    def restart(self) -> None:
        self.payloads.clear()
        self.restarts += 1

    def events(self, seq: int) -> list[dict[str, Any]]:
        return msgspec.msgpack.decode(self.payloads[seq])[1]


def blocks(*ids: int) -> list[int]:
    return [i for i in ids for _ in range(BS)]


def vllm_hashes(tokens: list[int]) -> list[int]:
    return engine_block_hashes("vllm", tokens, BS)


def make_rank(capacity: int = 16, dp_rank: int = 0) -> tuple[RankEngine, ListSink]:
    sink = ListSink()
    cfg = WorkerConfig(block_size=BS, cache_blocks=capacity, wire="vllm")
    return RankEngine(dp_rank, cfg, sink, wall_clock=lambda: 1.0), sink


def test_a_request_publishes_one_stored_batch_of_its_uncached_blocks() -> None:
    rank, sink = make_rank()
    first = rank.admit_request([*blocks(1, 2), 7])
    second = rank.admit_request(blocks(1, 2, 3))
    assert (first.seq, first.cached_tokens, first.prompt_tokens) == (0, 0, 2 * BS + 1)
    assert (second.seq, second.cached_tokens) == (1, 2 * BS)
    [ev] = sink.events(1)
    h = vllm_hashes(blocks(1, 2, 3))
    assert ev["type"] == "BlockStored"
    assert ev["block_hashes"] == [h[2]]
    assert ev["parent_block_hash"] == h[1]
    assert ev["token_ids"] == blocks(3)


def test_a_fully_cached_or_sub_block_prompt_publishes_nothing() -> None:
    rank, sink = make_rank()
    rank.admit_request(blocks(1))
    assert rank.admit_request(blocks(1)).seq is None
    assert rank.admit_request([5, 5]).seq is None
    assert len(sink.payloads) == 1
    assert (rank.hit_blocks, rank.miss_blocks, rank.requests) == (1, 1, 3)


def test_evictions_ride_in_the_same_batch_before_the_store() -> None:
    rank, sink = make_rank(capacity=2)
    rank.admit_request(blocks(1, 2))
    rank.admit_request(blocks(3))
    events = sink.events(1)
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockStored"]
    assert events[0]["block_hashes"] == [vllm_hashes(blocks(1, 2))[1]]  # the leaf, not block 1
    assert events[0]["medium"] == "GPU"


def test_storing_a_cached_chain_reannounces_it_whole_from_the_root() -> None:
    rank, sink = make_rank()
    rank.store_chain(blocks(1, 2))
    seq = rank.store_chain(blocks(1, 2), medium="CPU")
    [ev] = sink.events(seq)
    assert ev["block_hashes"] == vllm_hashes(blocks(1, 2))
    assert ev["parent_block_hash"] is None
    assert ev["medium"] == "CPU"
    assert rank.requests == 0  # controls are not traffic


def test_storing_a_chain_shorter_than_a_block_is_refused() -> None:
    rank, sink = make_rank()
    with pytest.raises(ValueError):
        rank.store_chain([1, 2])
    assert sink.payloads == []


def test_evictions_by_chain_or_count_publish_one_removal_per_block() -> None:
    rank, sink = make_rank()
    rank.store_chain(blocks(1, 2, 3))
    assert rank.evict_chains([blocks(1, 2, 3)], keep_blocks=1) == 2
    assert [e["block_hashes"] for e in sink.events(1)] == [
        [vllm_hashes(blocks(1, 2, 3))[2]],
        [vllm_hashes(blocks(1, 2, 3))[1]],
    ]
    assert rank.evict_lru(5) == 1
    assert rank.evict_lru(5) == 0
    assert len(sink.payloads) == 3  # nothing evicted, nothing published


def test_clear_publishes_all_blocks_cleared_and_restart_publishes_nothing() -> None:
    rank, sink = make_rank()
    rank.store_chain(blocks(1))
    rank.clear()
    assert sink.events(1) == [{"type": "AllBlocksCleared"}]
    rank.store_chain(blocks(2))
    rank.restart()
    assert (sink.restarts, sink.payloads, len(rank.cache)) == (1, [], 0)


def test_snapshot_lists_blocks_parent_first_with_wire_hashes() -> None:
    rank, _ = make_rank(dp_rank=1)
    rank.store_chain(blocks(1, 2))
    rank.store_chain(blocks(1, 3), medium="CPU")
    snap = rank.snapshot(lambda medium: medium.lower())
    h12, h13 = vllm_hashes(blocks(1, 2)), vllm_hashes(blocks(1, 3))
    assert snap["dp_rank"] == 1 and snap["last_seq"] == 1
    assert [(b["engine_hash"], b["parent_engine_hash"], b["tier"]) for b in snap["blocks"]] == [
        (h12[0], None, "gpu"),
        (h12[1], h12[0], "gpu"),
        (h13[1], h13[0], "cpu"),
    ]
    assert snap["blocks"][2]["token_ids"] == blocks(3)


def test_sglang_ranks_publish_signed_hashes_and_report_them_as_such() -> None:
    sink = ListSink()
    cfg = WorkerConfig(block_size=16, wire="sglang")
    rank = RankEngine(0, cfg, sink, wall_clock=lambda: 1.0)
    rank.store_chain([3] * 16)
    [ev] = sink.events(0)
    assert ev["block_hashes"] == [-5675343678154751648]
    assert rank.snapshot(str)["blocks"][0]["engine_hash"] == -5675343678154751648


@pytest.mark.parametrize("wire", ["vllm", "sglang"])
def test_an_adapters_blocks_are_its_own_published_and_listed_under_its_name(wire: str) -> None:
    sink = ListSink()
    cfg = WorkerConfig(block_size=BS, cache_blocks=16, wire=wire, lora_modules=("sql",))
    rank = RankEngine(0, cfg, sink, wall_clock=lambda: 1.0)
    rank.admit_request(blocks(1, 2))
    # The same tokens under the adapter: no hit, new blocks with other engine hashes.
    served = rank.admit_request(blocks(1, 2), "sql")
    assert (served.seq, served.cached_tokens) == (1, 0)
    assert rank.admit_request(blocks(1, 2, 3), "sql").cached_tokens == 2 * BS
    [base], [sql], [more] = sink.events(0), sink.events(1), sink.events(2)
    assert base.get("lora_name") is None and sql["lora_name"] == more["lora_name"] == "sql"
    assert not set(base["block_hashes"]) & set(sql["block_hashes"])
    assert more["parent_block_hash"] == sql["block_hashes"][-1]
    listed = rank.snapshot(lambda medium: "device")["blocks"]
    assert [b.get("lora_name") for b in listed] == [None, None, "sql", "sql", "sql"]


@pytest.mark.parametrize("name", ["", "base:sql"])
def test_an_adapter_must_be_nameable_as_both_engines_read_requests(name: str) -> None:
    with pytest.raises(ValueError, match="lora_modules"):
        WorkerConfig(lora_modules=("sql", name))
