"""Each wire flavour encodes exactly what the real engine released, byte for byte.

The fixtures were captured from the engines' own publisher code for tokens 1..32, block size
16: batch 0 a BlockStored of both blocks, batch 1 a BlockRemoved, batch 2 AllBlocksCleared,
with ts = 1767225600.0 + batch index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from fake_kv_worker.hashing import HASHERS, chain_digests
from fake_kv_worker.wire import WIRE_FLAVOURS, Cleared, Event, Removed, Stored

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
TOKENS = list(range(1, 33))
TS0 = 1767225600.0

# flavour -> fixture tag
FIXTURE_TAGS = {
    "vllm": "vllm-0.33.0",
    "vllm-byteshash": "vllm-0.33.0-byteshash",
    "vllm-legacy": "vllm-0.23.0-arraylike",
    "sglang": "sglang-0.5.23",
    "sglang-legacy": "sglang-0.5.16-arraylike",
}


def fixture_payload(tag: str, batch: int) -> bytes:
    return (FIXTURES / f"{tag}_live{batch}_frame2.bin").read_bytes()


def fixture_events(flavour_name: str) -> list[list[Event]]:
    """The three batches of the capture, as engine-neutral events."""
    flavour = WIRE_FLAVOURS[flavour_name]
    digests = chain_digests(HASHERS[flavour.engine], TOKENS, 16)
    h0, h1 = (flavour.wire_hash(d) for d in digests)
    # vLLM's block pool evicts one block per event; SGLang's radix tree evicted the node
    # holding both pages in one event when the fixture was captured.
    removed = [h1] if flavour.engine == "vllm" else [h0, h1]
    return [
        [Stored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=TOKENS, block_size=16)],
        [Removed(block_hashes=removed)],
        [Cleared()],
    ]


def without_ts(decoded: list[Any]) -> list[Any]:
    return decoded[1:]


@pytest.mark.parametrize("flavour_name", sorted(FIXTURE_TAGS))
@pytest.mark.parametrize("batch", [0, 1, 2])
def test_encoding_is_byte_identical_to_the_engine_capture(flavour_name: str, batch: int) -> None:
    flavour = WIRE_FLAVOURS[flavour_name]
    payload = flavour.encode_batch(TS0 + batch, fixture_events(flavour_name)[batch], 0)
    assert payload == fixture_payload(FIXTURE_TAGS[flavour_name], batch)


@pytest.mark.parametrize("flavour_name", sorted(FIXTURE_TAGS))
@pytest.mark.parametrize("batch", [0, 1, 2])
def test_generic_decode_has_the_fixture_layout_whatever_the_ts(
    flavour_name: str, batch: int
) -> None:
    flavour = WIRE_FLAVOURS[flavour_name]
    payload = flavour.encode_batch(1.5, fixture_events(flavour_name)[batch], 0)
    ours = msgspec.msgpack.decode(payload)
    theirs = msgspec.msgpack.decode(fixture_payload(FIXTURE_TAGS[flavour_name], batch))
    assert isinstance(ours[0], float)
    assert without_ts(ours) == without_ts(theirs)


def test_vllm_map_keeps_required_nulls_and_group_idx() -> None:
    payload = WIRE_FLAVOURS["vllm"].encode_batch(TS0, fixture_events("vllm")[0], 3)
    _, events, dp_rank = msgspec.msgpack.decode(payload)
    assert dp_rank == 3
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
    ]


def test_sglang_negative_hashes_are_encoded_as_int64() -> None:
    h, parent = -5675343678154751648, -7
    stored = Stored(block_hashes=[h], parent_block_hash=parent, token_ids=[3] * 16, block_size=16)
    payload = WIRE_FLAVOURS["sglang"].encode_batch(TS0, [stored], 0)
    assert b"\xd3" + h.to_bytes(8, "big", signed=True) in payload
    _, events, _ = msgspec.msgpack.decode(payload)
    assert events[0]["block_hashes"] == [h]
    assert events[0]["parent_block_hash"] == parent


def test_sglang_legacy_splits_a_multi_block_store_into_parent_chained_pages() -> None:
    stored = Stored(
        block_hashes=[11, 12, 13], parent_block_hash=10, token_ids=TOKENS[:3] * 16, block_size=16
    )
    payload = WIRE_FLAVOURS["sglang-legacy"].encode_batch(TS0, [stored], 0)
    _, events, _ = msgspec.msgpack.decode(payload)
    assert [(e[1], e[2]) for e in events] == [([11], 10), ([12], 11), ([13], 12)]
    assert all(len(e) == 7 and len(e[3]) == 16 for e in events)


def test_sglang_flavours_refuse_bytes_hashes() -> None:
    stored = Stored(
        block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[3] * 16, block_size=16
    )
    with pytest.raises(TypeError):
        WIRE_FLAVOURS["sglang"].encode_batch(TS0, [stored], 0)
