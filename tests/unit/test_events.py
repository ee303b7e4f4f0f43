"""router.events: every engine batch shape decodes to one internal form; anything bad fails whole.

Real captures first (every `*_frame2.bin` fixture), then each shape and rule built by hand
with msgspec, then every malformed variant with the reason it must report. Every successful
decode is also checked against the generic (reference) path, and every failure against the
typed fast path, so the two paths cannot drift apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cachetree.accel import speedups
from cachetree.keys import MAX_ADAPTER_NAME_CHARS
from cachetree.tiers import DEVICE, DISK, EXTERNAL, HOST
from router import events
from router.events import (
    DECODE_ERROR_REASONS,
    IGNORE_REASONS,
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    RemovedRun,
    _decode_generic,
    _decode_typed,
    decode_batch,
    fold_removal_runs,
    namespace_of,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
FIXTURE_PAYLOADS = sorted(FIXTURES.glob("*_live*_frame2.bin"))
TS0 = 1767225600.0
TOKENS = list(range(1, 33))
VLLM_HASHES = [1403909460543360175, 1643945449041937783]  # low 64 bits of the sha256 digests
SGLANG_HASHES = [8635429971592222890, 1256577331724852459]  # SGLang's page-chain ints
U64 = (1 << 64) - 1

# --- helpers ---------------------------------------------------------------------------------


def enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def batch(*events: Any, ts: Any = 1.5, dp_rank: Any = 0) -> bytes:
    return enc([ts, list(events), dp_rank])


def stored_map(**fields: Any) -> dict[str, Any]:
    """A vLLM 0.33 BlockStored map (tokens 1..32, two blocks of 16), with `fields` replaced."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [11, 22],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    event.update(fields)
    return {k: v for k, v in event.items() if v is not _DROP}


def removed_map(**fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [22], "medium": "GPU"}
    event.update(fields)
    return {k: v for k, v in event.items() if v is not _DROP}


def stored_array(*tail: Any, hashes: Any = (11, 22), parent: Any = None) -> list[Any]:
    """A positional BlockStored: the 5 required slots, then `tail` from slot 5 (lora_id) on."""
    return ["BlockStored", list(hashes), parent, TOKENS, 16, *tail]


def vllm_023_stored(**slots: Any) -> list[Any]:
    """A vLLM 0.23 positional BlockStored (12 slots), slots named as in the map form."""
    names = ["lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    values = {"lora_id": None, "medium": "GPU", "group_idx": 0} | slots
    return stored_array(*(values.get(n) for n in names), None)


_DROP = object()  # pass as a field value to leave the key out


def decode(payload: bytes) -> EventBatch:
    """decode_batch, checked against the generic reference path."""
    got = decode_batch(payload)
    assert got == _decode_generic(payload)
    return got


def decode_fast(payload: bytes) -> EventBatch:
    """decode(), and the typed fast path must have taken it alone."""
    got = decode(payload)
    assert _decode_typed(payload) == got
    return got


def reason(payload: bytes) -> str:
    """The reason decode_batch refuses `payload`, with the generic path's reason and detail;
    the fast path must refuse it too."""
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    with pytest.raises(EventDecodeError) as reference:
        _decode_generic(payload)
    with pytest.raises((msgspec.DecodeError, EventDecodeError, RecursionError)):
        _decode_typed(payload)
    assert info.value.reason in DECODE_ERROR_REASONS
    assert (info.value.reason, info.value.detail) == (
        reference.value.reason,
        reference.value.detail,
    )
    return info.value.reason


def only_event(payload: bytes) -> Any:
    got = decode(payload)
    assert len(got.events) == 1, got
    return got.events[0]


# --- real captures ---------------------------------------------------------------------------


def _fixture_id(path: Path) -> str:
    return path.name.removesuffix("_frame2.bin")


def _expected_hashes(tag: str) -> list[int]:
    if tag.startswith("sglang"):
        return SGLANG_HASHES
    if not tag.startswith("vllm"):
        pytest.fail(f"fixture {tag}: no expected hashes for this engine; add them here")
    report = json.loads((FIXTURES / f"{tag}_report.json").read_text())["hashes"]
    wires = [report["h1_wire"], report["h2_wire"]]
    if report["int_block_hashes"]:
        return wires
    return [int.from_bytes(bytes.fromhex(w)[-8:], "big") for w in wires]  # bytes: last 8, BE


def test_fixture_payloads_are_present() -> None:
    assert len(FIXTURE_PAYLOADS) >= 15, f"expected the captured payloads in {FIXTURES}"


@pytest.mark.parametrize("path", FIXTURE_PAYLOADS, ids=_fixture_id)
def test_every_captured_engine_payload_decodes_to_the_captured_values(path: Path) -> None:
    tag, live = _fixture_id(path).rsplit("_live", 1)
    n = int(live)
    h1, h2 = _expected_hashes(tag)
    assert [h1, h2] == (VLLM_HASHES if tag.startswith("vllm") else SGLANG_HASHES)
    got = decode_fast(path.read_bytes())

    assert got.ts == TS0 + n
    assert got.dp_rank == 0
    assert got.ignored == {}
    if n == 0:
        # One BlockStored of both blocks, or (SGLang < 0.5.20) one per page, chained by parent.
        assert all(isinstance(e, BlockStored) for e in got.events)
        assert len(got.events) == (2 if tag == "sglang-0.5.16-arraylike" else 1)
        assert [h for e in got.events for h in e.engine_hashes] == [h1, h2]
        assert [t for e in got.events for t in e.token_ids] == TOKENS
        parents = [e.parent_engine_hash for e in got.events]
        assert parents == [None, *[e.engine_hashes[-1] for e in got.events[:-1]]]
        for e in got.events:
            assert (e.block_size, e.tier, e.medium, e.namespace) == (16, DEVICE, "GPU", None)
    elif n == 1:
        # vLLM evicts block by block; SGLang evicts the radix node, which holds both pages.
        removed = [h2] if tag.startswith("vllm") else [h1, h2]
        assert got.events == [BlockRemoved(removed, DEVICE, "GPU")]
    else:
        assert got.events == [AllBlocksCleared()]


def test_a_bytes_hash_normalizes_to_the_int_vllm_sends_for_the_same_digest() -> None:
    assert _expected_hashes("vllm-0.33.0-byteshash") == VLLM_HASHES
    assert _expected_hashes("vllm-0.33.0") == VLLM_HASHES


# --- batch shapes ----------------------------------------------------------------------------


def test_a_two_element_batch_from_vllm_0_9_has_no_dp_rank() -> None:
    got = decode_fast(enc([2.0, [stored_map()]]))
    assert (got.ts, got.dp_rank, len(got.events)) == (2.0, None, 1)


def test_a_three_element_batch_carries_its_dp_rank() -> None:
    assert decode_fast(batch(stored_map(), dp_rank=3)).dp_rank == 3


def test_a_null_dp_rank_is_none() -> None:
    assert decode_fast(batch(stored_map(), dp_rank=None)).dp_rank is None


def test_trailing_batch_elements_are_ignored() -> None:
    got = decode_fast(enc([2.0, [stored_map()], 1, "future", {"x": [1]}]))
    assert (got.dp_rank, len(got.events)) == (1, 1)


def test_an_integer_ts_becomes_a_float() -> None:
    got = decode_fast(batch(ts=1767225600))
    assert got.ts == 1767225600.0 and type(got.ts) is float


def test_an_empty_event_list_is_an_empty_batch() -> None:
    assert decode_fast(batch()) == EventBatch(1.5, [], 0, {})


def test_events_keep_their_wire_order() -> None:
    got = decode_fast(batch(removed_map(), stored_map(), {"type": "AllBlocksCleared"}))
    assert [type(e) for e in got.events] == [BlockRemoved, BlockStored, AllBlocksCleared]


# --- event shapes ----------------------------------------------------------------------------


def test_a_vllm_0_9_positional_block_stored_with_6_elements_decodes() -> None:
    got = decode_fast(enc([1.0, [stored_array(None), ["BlockRemoved", [22]]]]))
    assert got.events == [
        BlockStored([11, 22], None, TOKENS, 16, DEVICE, None, None),
        BlockRemoved([22], None, None),
    ]


def test_a_positional_block_stored_needs_only_its_first_5_elements() -> None:
    assert only_event(batch(stored_array())) == BlockStored(
        [11, 22], None, TOKENS, 16, DEVICE, None, None
    )


def test_a_vllm_0_23_positional_block_stored_with_12_elements_decodes() -> None:
    event = vllm_023_stored(lora_name="adapter-a", kv_cache_spec_kind="full_attention")
    assert len(event) == 12
    assert only_event(batch(event)) == BlockStored(
        [11, 22], None, TOKENS, 16, DEVICE, "GPU", "adapter-a"
    )


def test_trailing_elements_of_a_positional_event_are_ignored() -> None:
    stored = [*vllm_023_stored(), "later", {"field": 1}, [1, 2]]
    removed = ["BlockRemoved", [22], "CPU", 0, "later", None]
    cleared = ["AllBlocksCleared", "later"]
    got = decode_fast(batch(stored, removed, cleared))
    assert got.events == [
        BlockStored([11, 22], None, TOKENS, 16, DEVICE, "GPU", None),
        BlockRemoved([22], HOST, "CPU"),
        AllBlocksCleared(),
    ]


def test_an_sglang_0_5_16_positional_block_stored_with_7_elements_decodes() -> None:
    event = stored_array(None, "CPU_PINNED", hashes=[-5], parent=-6)
    event[3] = TOKENS[:16]
    assert only_event(batch(event)) == BlockStored(
        [U64 - 4], U64 - 5, TOKENS[:16], 16, HOST, "CPU_PINNED", None
    )


@pytest.mark.parametrize("name", ["sql\x00salt", "", "a" * (MAX_ADAPTER_NAME_CHARS + 1)])
def test_a_lora_name_no_adapter_may_have_fails_the_batch(name: str) -> None:
    """Taken as is, "sql\\x00salt" was adapter "sql" with cache salt "salt" (`namespace_of`):
    its blocks shared that salted namespace, and the replica learned the adapter "sql"."""
    ok = stored_map(lora_name="sql")
    assert only_event(batch(stored_map(lora_name="a" * MAX_ADAPTER_NAME_CHARS))).namespace
    assert reason(batch(ok, stored_map(lora_name=name))) == "bad_event"
    assert reason(batch(vllm_023_stored(lora_name=name))) == "bad_event"


def test_sglang_0_5_18_positional_metadata_map_gives_the_cache_salt_namespace() -> None:
    event = stored_array(None, "GPU", {"cache_salt": "tenant-7", "future": 1})
    assert only_event(batch(event)).namespace == namespace_of(None, "tenant-7") == "\x00tenant-7"


def test_unknown_keys_of_a_map_event_are_ignored() -> None:
    extra = {
        "extra_keys": [["mm", 3], None],
        "ownership": "tier-2",
        "session_id": "s",
        "lookahead_token_ids": [[1, 2]],
        "kv_cache_spec_sliding_window": None,
        "some_future_key": {"nested": [1.5, b"x", None]},
    }
    assert only_event(batch(stored_map(**extra))) == only_event(batch(stored_map()))
    assert only_event(batch(removed_map(ownership="x", future=[1]))) == BlockRemoved(
        [22], DEVICE, "GPU"
    )
    assert only_event(batch({"type": "AllBlocksCleared", "medium": "GPU"})) == AllBlocksCleared()


def test_fields_the_router_does_not_use_are_not_validated() -> None:
    event = stored_map(lora_id="not-an-int", extra_keys=12.5)
    assert isinstance(only_event(batch(event)), BlockStored)
    assert isinstance(only_event(batch(vllm_023_stored(lora_id=[1], extra_keys="x"))), BlockStored)


def test_a_sparse_map_block_stored_needs_only_hashes_tokens_and_block_size() -> None:
    event = {"type": "BlockStored", "block_hashes": [7], "token_ids": [5, 6], "block_size": 2}
    assert only_event(batch(event)) == BlockStored([7], None, [5, 6], 2, DEVICE, None, None)


def test_a_batch_mixing_map_and_positional_events_decodes() -> None:
    got = decode(batch(stored_map(), ["BlockRemoved", [22], "GPU"]))
    assert [type(e) for e in got.events] == [BlockStored, BlockRemoved]


@pytest.mark.parametrize(
    "unknown",
    [
        {"type": "BlockPinned", "block_hashes": [1]},
        {"type": ""},
        ["SomeFutureEvent", 1, 2, 3],
    ],
    ids=["map", "empty-tag", "positional"],
)
def test_an_unknown_event_tag_is_ignored_and_counted(unknown: Any) -> None:
    got = decode(batch(stored_map(), unknown, unknown, removed_map()))
    assert [type(e) for e in got.events] == [BlockStored, BlockRemoved]
    assert got.ignored == {"unknown_type": 2}


@pytest.mark.parametrize("fold_removals", [False, True])
@pytest.mark.parametrize(
    ("event", "unknown"),
    [
        (lambda i: stored_map(block_hashes=[i], token_ids=TOKENS[:16]), {"type": "Foo"}),
        (lambda i: ["BlockStored", [i], None, TOKENS[:16], 16], ["Foo", 1]),
        (lambda i: stored_map(block_hashes=[i], token_ids=_PAIRS[:16]), {"type": "Foo"}),
    ],
    ids=["map", "positional", "bigram-map"],
)
def test_an_unknown_event_type_leaves_its_batch_to_the_fast_paths_not_the_generic_one(
    event: Callable[[int], Any],
    unknown: Any,
    fold_removals: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generic path builds every event in Python: a batch of 60,000 one-block stores and
    one event of an unknown type took it 1.9 s of the loop, 0.24 s without that event."""
    removals = [
        removed_map(block_hashes=[i]) if "type" in unknown else ["BlockRemoved", [i]]
        for i in range(1, 51)
    ]
    stores = [event(i) for i in range(100, 2100)]
    payload = batch(*stores[:1000], unknown, *removals, *stores[1000:], unknown)
    want = _decode_generic(payload)
    assert want.ignored == {"unknown_type": 2} and len(want.events) == 2050
    generic_reads: list[bytes] = []

    def generic(payload: bytes) -> EventBatch:
        generic_reads.append(payload)
        return _decode_generic(payload)

    monkeypatch.setattr(events, "_decode_generic", generic)
    got = decode_batch(payload, fold_removals=fold_removals)
    assert generic_reads == []
    assert got.ignored == want.ignored
    assert got.events == (fold_removal_runs(want.events) if fold_removals else want.events)


@pytest.mark.parametrize("fold_removals", [False, True])
@pytest.mark.parametrize(
    ("event", "malformed"),
    [
        (
            lambda i: stored_map(block_hashes=[i], token_ids=TOKENS[:16]),
            stored_map(block_hashes=[7], token_ids=[*TOKENS[:15], "x"]),
        ),
        (
            lambda i: stored_map(block_hashes=[i], token_ids=TOKENS[:16]),
            {"type": "BlockStored", "block_hashes": [7]},
        ),
        (
            lambda i: ["BlockStored", [i], None, TOKENS[:16], 16],
            ["BlockStored", [7], None, [*TOKENS[:15], "x"], 16],
        ),
        (lambda i: ["BlockStored", [i], None, TOKENS[:16], 16], ["BlockStored", [7], None]),
        (
            lambda i: stored_map(block_hashes=[i], token_ids=_PAIRS[:16]),
            stored_map(block_hashes=[7], token_ids=[*([t, t + 1] for t in TOKENS[:15]), ["x", 1]]),
        ),
        (
            lambda i: stored_map(block_hashes=[i], token_ids=TOKENS[:16]),
            stored_map(block_hashes=[7], token_ids=TOKENS[:15]),
        ),
    ],
    ids=["map-token", "map-arity", "positional-token", "positional-arity", "bigram", "count"],
)
def test_a_malformed_event_fails_its_batch_as_the_generic_path_says_reading_it_alone_there(
    event: Callable[[int], Any],
    malformed: Any,
    fold_removals: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generic path builds every event in Python: a batch of 60,000 one-block stores and
    one malformed event held the loop 0.5-1.9 s, where the batch without it takes 0.1-0.2 s."""
    positional = type(malformed) is list
    removals = [
        ["BlockRemoved", [i]] if positional else removed_map(block_hashes=[i]) for i in range(1, 51)
    ]
    stores = [event(i) for i in range(100, 2100)]
    payload = batch(*stores[:1000], *removals, *stores[1000:], malformed)
    with pytest.raises(EventDecodeError) as want:
        _decode_generic(payload)
    read_generically: list[object] = []
    generic_event = events._generic_event

    def counted(raw: object) -> object:
        read_generically.append(raw)
        return generic_event(raw)

    monkeypatch.setattr(events, "_generic_event", counted)
    with pytest.raises(EventDecodeError) as got:
        decode_batch(payload, fold_removals=fold_removals)
    assert (got.value.reason, got.value.detail) == (want.value.reason, want.value.detail)
    assert got.value.detail.startswith("event 2050: ")
    assert len(read_generically) <= 1  # that event alone, or none (the count: typed, then raised)


def test_an_event_that_is_no_msgpack_read_alone_is_named_with_its_own_offset() -> None:
    """The batch's framing passes over an event whose map has a map for a key; read alone,
    msgspec counts its offset from the event's start: the detail said "byte 3", taken for the
    payload's (the generic path, reading it whole, says byte 284), and named no event."""
    stored = [stored_map(block_hashes=[h], token_ids=TOKENS[:16]) for h in (1, 2)]
    payload = batch(*stored, "PLACEHOLDER").replace(b"\xabPLACEHOLDER", b"\x81\x80\x01")
    with pytest.raises(EventDecodeError) as got:
        decode_batch(payload)
    assert got.value.reason == "malformed_msgpack"
    assert got.value.detail.startswith("event 2 (its own bytes): ")
    assert got.value.detail.endswith("map keys must be hashable (byte 3)")


def _positional_decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names ("flat", "bigram") of the positional batch decoders, as they are used."""
    decoded: list[str] = []

    class Counted:
        def __init__(self, name: str, decoder: msgspec.msgpack.Decoder[Any]) -> None:
            self.name, self.decoder = name, decoder

        def decode(self, payload: bytes) -> Any:
            decoded.append(self.name)
            return self.decoder.decode(payload)

    flat, bigram = events._POSITIONAL_DECODERS
    monkeypatch.setattr(
        events, "_POSITIONAL_DECODERS", (Counted("flat", flat), Counted("bigram", bigram))
    )
    return decoded


@pytest.mark.skipif(speedups is None, reason="the twins read token ids apart only when compiled")
def test_a_positional_batch_refused_while_decoding_is_not_decoded_again_by_its_bigram_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiled, the twins differ only in how `normalize` reads the token ids, so the bigram
    one refused at the same event, after as long: 60,000 positional one-block stores and one
    event of an unknown type were decoded three times over, and are twice now."""
    decoded = _positional_decodes(monkeypatch)
    stores = [["BlockStored", [i], None, TOKENS[:16], 16] for i in range(1, 2001)]
    got = decode_batch(batch(*stores, ["Foo", 1]))
    assert len(got.events) == 2000 and got.ignored == {"unknown_type": 1}
    assert decoded == ["flat", "flat"]  # refused at "Foo"; then the batch without it
    decoded.clear()
    pairs = [[t, t + 1] for t in TOKENS[:16]]
    got = decode_batch(batch(*(["BlockStored", [i], None, pairs, 16] for i in range(1, 11))))
    assert len(got.events) == 10 and decoded == ["flat", "bigram"]  # pairs: read by the twin


@pytest.mark.skipif(speedups is None, reason="the twins read token ids apart only when compiled")
def test_a_positional_batch_with_a_malformed_token_later_is_not_decoded_by_its_bigram_twin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Compiled, the token ids are read after the batch decodes: the bigram twin decoded all
    of it again to refuse it at its first store, whose ids are not pairs."""
    decoded = _positional_decodes(monkeypatch)
    stores = [["BlockStored", [i], None, TOKENS[:16], 16] for i in range(1, 2001)]
    assert reason(batch(*stores, ["BlockStored", [7], None, [*TOKENS[:15], "x"], 16])) == (
        "bad_tokens"
    )
    assert decoded == ["flat", "flat"]  # by decode_batch, then by `reason`'s own typed decode


def test_a_malformed_event_behind_a_bad_dp_rank_fails_as_the_dp_rank() -> None:
    """The generic path reads the root before the events; so does the one that reads them one
    at a time, and the compiled reader's error for an event waits for the root to be read."""
    payload = batch(stored_map(), stored_map(token_ids=["x"]), dp_rank=-1)
    assert reason(payload) == "bad_dp_rank"


# --- hashes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "u64"),
    [
        (0, 0),
        (1403909460543360175, 1403909460543360175),
        (U64, U64),
        (-1, U64),
        (-(1 << 63), 1 << 63),
        (-7727314102117328726, (-7727314102117328726) & U64),
        (
            bytes.fromhex("7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf"),
            1403909460543360175,
        ),
        (b"\x01\x02", 0x0102),
        (b"\xff" * 64, U64),
    ],
    ids=[
        "zero",
        "u64",
        "u64-max",
        "minus-one",
        "i64-min",
        "negative",
        "32-bytes",
        "2-bytes",
        "64-bytes",
    ],
)
def test_every_hash_encoding_normalizes_to_u64(wire: Any, u64: int) -> None:
    for event in (
        stored_map(block_hashes=[wire, 5], parent_block_hash=wire),
        stored_array(None, hashes=[wire, 5], parent=wire),
    ):
        got = only_event(batch(event))
        assert (got.engine_hashes, got.parent_engine_hash) == ([u64, 5], u64)
    assert only_event(batch(removed_map(block_hashes=[wire]))).engine_hashes == [u64]


def test_a_block_can_mix_int_and_bytes_hashes() -> None:
    event = stored_map(block_hashes=[b"\x00" * 24 + (9).to_bytes(8, "big"), -2])
    assert only_event(batch(event)).engine_hashes == [9, U64 - 1]


# --- tokens ----------------------------------------------------------------------------------


def test_token_ids_span_every_block_of_the_event() -> None:
    got = only_event(batch(stored_map(token_ids=[0, 2**32 - 1] * 16)))
    assert got.token_ids == [0, 2**32 - 1] * 16
    assert len(got.token_ids) == len(got.engine_hashes) * got.block_size


def test_bigram_token_pairs_normalize_to_the_token_at_each_position() -> None:
    """SGLang's EAGLE mode sends [t_i, t_(i+1)] per position; the router keys on t_i."""
    pairs = [[t, t + 1] for t in TOKENS]
    got = only_event(batch(stored_map(token_ids=pairs)))
    assert got.token_ids == TOKENS
    positional = stored_array(None, "GPU")
    positional[3] = pairs
    assert only_event(batch(positional)).token_ids == TOKENS


def test_bigram_pairs_are_counted_as_positions_against_the_block_count() -> None:
    pairs = [[t, t + 1] for t in TOKENS[:31]]
    assert reason(batch(stored_map(token_ids=pairs))) == "bad_tokens"


@pytest.mark.parametrize(
    "token_ids",
    [
        [[1, 2, 3]] + [[t, t] for t in TOKENS[1:]],
        [[1]] + [[t, t] for t in TOKENS[1:]],
        [[1, 2], *TOKENS[1:]],
        [[1, -2]] + [[t, t] for t in TOKENS[1:]],
        [[1, True]] + [[t, t] for t in TOKENS[1:]],
        [[1, 2**32]] + [[t, t] for t in TOKENS[1:]],
    ],
    ids=["triple", "single", "mixed-flat", "negative", "bool", "too-big"],
)
def test_a_malformed_bigram_list_fails_the_batch(token_ids: list[Any]) -> None:
    assert reason(batch(stored_map(token_ids=token_ids))) == "bad_tokens"


# --- media and tiers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (_DROP, DEVICE),
        (None, DEVICE),
        ("GPU", DEVICE),
        ("gpu", DEVICE),
        ("CPU", HOST),
        ("CPU_PINNED", HOST),
        ("DISK", DISK),
        ("STORAGE", DISK),
        ("EXTERNAL", EXTERNAL),
        ("TAPE", 0),
    ],
)
def test_a_stored_medium_maps_to_its_tier_and_is_kept_raw(medium: Any, tier: int) -> None:
    got = only_event(batch(stored_map(medium=medium)))
    assert (got.tier, got.medium) == (tier, None if medium is _DROP else medium)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [(_DROP, None), (None, None), ("GPU", DEVICE), ("cpu", HOST), ("DISK", DISK), ("TAPE", None)],
)
def test_a_removal_with_no_or_an_unknown_medium_clears_every_tier(medium: Any, tier: Any) -> None:
    got = only_event(batch(removed_map(medium=medium)))
    assert (got.tier, got.medium) == (tier, None if medium is _DROP else medium)


# --- events that are valid but not for the index ---------------------------------------------


@pytest.mark.parametrize("group_idx", [1, 2, -1])
def test_events_of_a_non_primary_kv_group_are_ignored_and_counted(group_idx: int) -> None:
    payload = batch(
        stored_map(group_idx=group_idx),
        removed_map(group_idx=group_idx),
        vllm_023_stored(group_idx=group_idx),
        ["BlockRemoved", [22], "GPU", group_idx],
        stored_map(group_idx=0),
    )
    got = decode(payload)
    assert [type(e) for e in got.events] == [BlockStored]
    assert got.ignored == {"non_primary_group": 4}


@pytest.mark.parametrize(
    "kind",
    [
        None,
        "full_attention",
        "FullAttentionSpec",
        "FullAttention",
        "mla_attention",
        "MLAAttentionSpec",
        "sink_full_attention",
    ],
)
def test_full_attention_kinds_are_primary(kind: Any) -> None:
    assert isinstance(only_event(batch(stored_map(kv_cache_spec_kind=kind))), BlockStored)
    assert isinstance(only_event(batch(vllm_023_stored(kv_cache_spec_kind=kind))), BlockStored)


@pytest.mark.parametrize(
    "kind",
    [
        "sliding_window",
        "SlidingWindowSpec",
        "sliding_window_mla",
        "mamba",
        "MambaSpec",
        "chunked_local_attention",
        "ChunkedLocalAttentionSpec",
        "cross_attention",
        "encoder_only_attention",
        "unknown",
        "some_future_kind",
    ],
)
def test_other_kv_cache_kinds_are_non_primary_even_in_group_0(kind: str) -> None:
    got = decode(
        batch(stored_map(kv_cache_spec_kind=kind), vllm_023_stored(kv_cache_spec_kind=kind))
    )
    assert (got.events, got.ignored) == ([], {"non_primary_group": 2})


@pytest.mark.parametrize("locality", ["REMOTE", "remote", "PEER"])
def test_blocks_not_held_locally_are_ignored_as_remote(locality: str) -> None:
    got = decode(batch(stored_map(locality=locality), removed_map(locality=locality)))
    assert (got.events, got.ignored) == ([], {"remote": 2})


@pytest.mark.parametrize("locality", [None, "LOCAL", "local"])
def test_local_blocks_are_kept(locality: Any) -> None:
    got = decode(batch(stored_map(locality=locality), removed_map(locality=locality)))
    assert ([type(e) for e in got.events], got.ignored) == ([BlockStored, BlockRemoved], {})


def test_events_with_zero_hashes_are_validated_then_ignored_as_empty() -> None:
    got = decode(batch(stored_map(block_hashes=[], token_ids=[]), removed_map(block_hashes=[])))
    assert (got.events, got.ignored) == ([], {"empty": 2})


def test_a_zero_hash_block_stored_with_tokens_fails_the_batch() -> None:
    assert reason(batch(stored_map(block_hashes=[], token_ids=[1]))) == "bad_tokens"


def test_an_ignored_event_is_still_validated() -> None:
    bad = stored_map(group_idx=1, token_ids=TOKENS[:-1])
    assert reason(batch(stored_map(), bad)) == "bad_tokens"


def test_every_ignore_reason_is_a_documented_label() -> None:
    got = decode(
        batch(
            stored_map(group_idx=1),
            removed_map(locality="REMOTE"),
            removed_map(block_hashes=[]),
            {"type": "Future"},
        )
    )
    assert got.events == []
    assert got.ignored == dict.fromkeys(IGNORE_REASONS, 1)


# --- namespace -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "namespace"),
    [
        ({}, None),
        ({"lora_name": "adapter-a"}, "adapter-a"),
        ({"cache_salt": "tenant-7"}, "\x00tenant-7"),
        ({"lora_name": "adapter-a", "cache_salt": "tenant-7"}, "adapter-a\x00tenant-7"),
    ],
)
def test_lora_name_and_cache_salt_become_the_namespace(
    fields: dict[str, str], namespace: Any
) -> None:
    assert only_event(batch(stored_map(**fields))).namespace == namespace
    assert namespace_of(fields.get("lora_name"), fields.get("cache_salt")) == namespace


def test_a_lora_name_and_a_salt_with_the_same_text_are_different_namespaces() -> None:
    assert len({namespace_of("a", None), namespace_of(None, "a"), namespace_of("a", "a")}) == 3


# --- caps ------------------------------------------------------------------------------------


def test_an_event_at_both_caps_decodes() -> None:
    hashes = list(range(MAX_HASHES_PER_EVENT))
    tokens = [7] * MAX_TOKENS_PER_EVENT
    block_size = MAX_TOKENS_PER_EVENT // MAX_HASHES_PER_EVENT
    got = decode_fast(
        batch(
            stored_map(block_hashes=hashes, token_ids=tokens, block_size=block_size),
            removed_map(block_hashes=hashes),
        )
    )
    assert [len(e.engine_hashes) for e in got.events] == [MAX_HASHES_PER_EVENT] * 2
    assert len(got.events[0].token_ids) == MAX_TOKENS_PER_EVENT


def test_one_hash_over_the_cap_fails_the_batch() -> None:
    hashes = list(range(MAX_HASHES_PER_EVENT + 1))
    stored = stored_map(block_hashes=hashes, token_ids=[1] * len(hashes), block_size=1)
    assert reason(batch(stored)) == "over_cap"
    assert reason(batch(removed_map(block_hashes=hashes))) == "over_cap"
    assert reason(batch(["BlockRemoved", hashes])) == "over_cap"


def test_one_token_over_the_cap_fails_the_batch() -> None:
    n = MAX_TOKENS_PER_EVENT + 1
    assert (
        reason(batch(stored_map(block_hashes=[1], token_ids=[1] * n, block_size=n))) == "over_cap"
    )
    pairs = [[1, 1]] * n
    assert reason(batch(stored_map(block_hashes=[1], token_ids=pairs, block_size=n))) == "over_cap"


# --- malformed payloads ----------------------------------------------------------------------

_GOOD = batch(stored_map())

MALFORMED: list[tuple[str, bytes, str]] = [
    # msgpack itself
    ("empty", b"", "malformed_msgpack"),
    ("reserved-byte", b"\xc1", "malformed_msgpack"),
    ("truncated", _GOOD[:-5], "malformed_msgpack"),
    ("trailing-bytes", _GOOD + b"\x00", "malformed_msgpack"),
    ("deep-nesting", b"\x92\x00\x91" + b"\x91" * 100_000 + b"\xc0", "malformed_msgpack"),
    (
        "deep-nesting-in-an-unknown-key",
        batch(stored_map(future=None))[:-2] + b"\x91" * 100_000 + b"\xc0\x00",
        "malformed_msgpack",
    ),
    # the batch
    ("root-map", enc({"ts": 1.0, "events": []}), "not_a_batch"),
    ("root-int", enc(5), "not_a_batch"),
    ("root-empty", enc([]), "not_a_batch"),
    ("root-one", enc([1.0]), "not_a_batch"),
    ("events-map", enc([1.0, {}, 0]), "not_a_batch"),
    ("events-null", enc([1.0, None, 0]), "not_a_batch"),
    ("ts-str", batch(ts="1.0"), "bad_ts"),
    ("ts-null", batch(ts=None), "bad_ts"),
    ("ts-bool", batch(ts=True), "bad_ts"),
    ("ts-nan", batch(ts=math.nan), "bad_ts"),
    ("ts-inf", batch(ts=-math.inf), "bad_ts"),
    ("dp-negative", batch(dp_rank=-1), "bad_dp_rank"),
    ("dp-bool", batch(dp_rank=True), "bad_dp_rank"),
    ("dp-str", batch(dp_rank="0"), "bad_dp_rank"),
    ("dp-float", batch(dp_rank=1.0), "bad_dp_rank"),
    # the event envelope
    ("event-int", batch(5), "bad_event"),
    ("event-str", batch("BlockStored"), "bad_event"),
    ("event-null", batch(None), "bad_event"),
    ("map-no-type", batch({"block_hashes": [1]}), "bad_event"),
    ("map-int-type", batch({"type": 1}), "bad_event"),
    ("map-null-type", batch({"type": None}), "bad_event"),
    ("array-empty", batch([]), "bad_event"),
    ("array-int-tag", batch([1, [1]]), "bad_event"),
    ("stored-no-hashes", batch(stored_map(block_hashes=_DROP)), "bad_event"),
    ("stored-no-tokens", batch(stored_map(token_ids=_DROP)), "bad_event"),
    ("stored-no-block-size", batch(stored_map(block_size=_DROP)), "bad_event"),
    ("removed-no-hashes", batch({"type": "BlockRemoved"}), "bad_event"),
    ("positional-stored-4", batch(["BlockStored", [1], None, [1]]), "bad_event"),
    ("positional-removed-1", batch(["BlockRemoved"]), "bad_event"),
    ("medium-int", batch(stored_map(medium=1)), "bad_event"),
    ("removed-medium-list", batch(removed_map(medium=["GPU"])), "bad_event"),
    ("lora-name-int", batch(stored_map(lora_name=3)), "bad_event"),
    ("cache-salt-bytes", batch(stored_map(cache_salt=b"s")), "bad_event"),
    ("group-idx-str", batch(stored_map(group_idx="0")), "bad_event"),
    ("group-idx-bool", batch(stored_map(group_idx=False)), "bad_event"),
    ("group-idx-float", batch(removed_map(group_idx=0.0)), "bad_event"),
    ("kind-int", batch(stored_map(kv_cache_spec_kind=1)), "bad_event"),
    ("locality-bool", batch(stored_map(locality=True)), "bad_event"),
    ("positional-medium-int", batch(vllm_023_stored(medium=5)), "bad_event"),
    ("positional-slot7-int", batch(vllm_023_stored(lora_name=5)), "bad_event"),
    ("positional-salt-int", batch(stored_array(None, "GPU", {"cache_salt": 5})), "bad_event"),
    ("positional-group-str", batch(vllm_023_stored(group_idx="1")), "bad_event"),
    ("positional-removed-medium-int", batch(["BlockRemoved", [1], 7]), "bad_event"),
    # hashes
    ("hashes-int", batch(stored_map(block_hashes=5)), "bad_hash"),
    ("hashes-null", batch(stored_map(block_hashes=None)), "bad_hash"),
    ("hash-float", batch(stored_map(block_hashes=[1.0, 2])), "bad_hash"),
    ("hash-str", batch(stored_map(block_hashes=["0x1", 2])), "bad_hash"),
    ("hash-bool", batch(stored_map(block_hashes=[True, 2])), "bad_hash"),
    ("hash-null", batch(stored_map(block_hashes=[None, 2])), "bad_hash"),
    ("hash-empty-bytes", batch(stored_map(block_hashes=[b"", 2])), "bad_hash"),
    ("hash-65-bytes", batch(stored_map(block_hashes=[b"x" * 65, 2])), "bad_hash"),
    ("hash-list", batch(stored_map(block_hashes=[[1], 2])), "bad_hash"),
    ("parent-float", batch(stored_map(parent_block_hash=1.5)), "bad_hash"),
    ("parent-empty-bytes", batch(stored_map(parent_block_hash=b"")), "bad_hash"),
    ("parent-bool", batch(stored_array(None, parent=False)), "bad_hash"),
    ("removed-hash-str", batch(removed_map(block_hashes=["a"])), "bad_hash"),
    ("positional-removed-hashes-int", batch(["BlockRemoved", 5]), "bad_hash"),
    # tokens
    ("tokens-int", batch(stored_map(token_ids=5)), "bad_tokens"),
    ("tokens-null", batch(stored_map(token_ids=None)), "bad_tokens"),
    ("tokens-bytes", batch(stored_map(token_ids=bytes(32))), "bad_tokens"),
    ("token-negative", batch(stored_map(token_ids=[-1, *TOKENS[1:]])), "bad_tokens"),
    ("token-2-32", batch(stored_map(token_ids=[2**32, *TOKENS[1:]])), "bad_tokens"),
    ("token-bool", batch(stored_map(token_ids=[True, *TOKENS[1:]])), "bad_tokens"),
    ("token-float", batch(stored_map(token_ids=[1.0, *TOKENS[1:]])), "bad_tokens"),
    ("token-str", batch(stored_map(token_ids=["1", *TOKENS[1:]])), "bad_tokens"),
    ("token-null", batch(stored_map(token_ids=[None, *TOKENS[1:]])), "bad_tokens"),
    ("tokens-short", batch(stored_map(token_ids=TOKENS[:-1])), "bad_tokens"),
    ("tokens-long", batch(stored_map(token_ids=[*TOKENS, 33])), "bad_tokens"),
    ("tokens-one-block", batch(stored_array(hashes=[1, 2, 3])), "bad_tokens"),
    # block size
    ("block-size-zero", batch(stored_map(block_size=0, token_ids=[])), "bad_block_size"),
    ("block-size-negative", batch(stored_map(block_size=-16)), "bad_block_size"),
    ("block-size-bool", batch(stored_map(block_size=True)), "bad_block_size"),
    ("block-size-str", batch(stored_map(block_size="16")), "bad_block_size"),
    ("block-size-float", batch(stored_map(block_size=16.0)), "bad_block_size"),
    ("block-size-null", batch(stored_map(block_size=None)), "bad_block_size"),
]


@pytest.mark.parametrize(
    ("payload", "expected"), [(p, r) for _, p, r in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_a_malformed_payload_fails_whole_with_its_reason(payload: bytes, expected: str) -> None:
    assert reason(payload) == expected


def test_a_bad_event_after_good_ones_fails_the_whole_batch() -> None:
    payload = batch(stored_map(), removed_map(), {"type": "AllBlocksCleared"}, 42)
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    assert info.value.reason == "bad_event"
    assert "event 3" in info.value.detail


def test_the_first_bad_event_names_the_reason() -> None:
    payload = batch(stored_map(token_ids=TOKENS[:-1]), stored_map(block_hashes=["x"]))
    assert reason(payload) == "bad_tokens"


def test_a_decode_error_is_a_value_error_with_reason_and_detail() -> None:
    with pytest.raises(ValueError, match=r"^bad_ts: ts is str 'now'$") as info:
        decode_batch(batch(ts="now"))
    assert isinstance(info.value, EventDecodeError)
    assert (info.value.reason, info.value.detail) == ("bad_ts", "ts is str 'now'")


def test_every_documented_error_reason_is_pinned_by_a_test() -> None:
    assert {r for _, _, r in MALFORMED} | {"over_cap"} == DECODE_ERROR_REASONS  # caps: above


# --- folded runs of removals ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "want"),
    [
        ([], []),
        ([BlockRemoved([1], DEVICE, "GPU")], [RemovedRun([1], DEVICE, "GPU")]),
        (
            [BlockRemoved([h], DEVICE, "GPU") for h in (1, 2, 3)],
            [RemovedRun([1, 2, 3], DEVICE, "GPU")],
        ),
        (  # another medium starts another run
            [BlockRemoved([1], DEVICE, "GPU"), BlockRemoved([2], HOST, "CPU")],
            [RemovedRun([1], DEVICE, "GPU"), RemovedRun([2], HOST, "CPU")],
        ),
        (  # a removal of several blocks is one event of its own: it stays, and ends the run
            [
                BlockRemoved([1], DEVICE, "GPU"),
                BlockRemoved([2, 3], DEVICE, "GPU"),
                BlockRemoved([4], DEVICE, "GPU"),
            ],
            [
                RemovedRun([1], DEVICE, "GPU"),
                BlockRemoved([2, 3], DEVICE, "GPU"),
                RemovedRun([4], DEVICE, "GPU"),
            ],
        ),
        (  # a store or a clear ends the run: order is kept
            [
                BlockRemoved([1], None, None),
                BlockStored([9], None, TOKENS[:16], 16, DEVICE, "GPU", None),
                BlockRemoved([2], None, None),
                AllBlocksCleared(),
            ],
            [
                RemovedRun([1], None, None),
                BlockStored([9], None, TOKENS[:16], 16, DEVICE, "GPU", None),
                RemovedRun([2], None, None),
                AllBlocksCleared(),
            ],
        ),
    ],
    ids=["empty", "lone", "run", "two-media", "multi-block", "store-and-clear"],
)
def test_one_block_removals_of_one_medium_fold_into_one_run_in_order(
    events: list[Any], want: list[Any]
) -> None:
    assert fold_removal_runs(events) == want


def test_a_folded_decode_is_the_fold_of_the_plain_decode_for_every_capture() -> None:
    evicting = batch(
        *[removed_map(block_hashes=[h]) for h in range(100, 140)],
        removed_map(block_hashes=[5], group_idx=1),  # ignored: the run goes on across it
        removed_map(block_hashes=[6], medium="CPU"),
        removed_map(block_hashes=[7, 8]),
        stored_map(),
        removed_map(block_hashes=[9], locality="LOCAL"),  # not the usual shape: same result
    )
    positional = batch(*[["BlockRemoved", [h], "GPU"] for h in (1, 2, 3)], stored_array())
    payloads = [p.read_bytes() for p in FIXTURE_PAYLOADS]
    for payload in [*payloads, evicting, positional]:
        plain = decode_batch(payload)
        folded = decode_batch(payload, fold_removals=True)
        assert folded.events == fold_removal_runs(plain.events)
        assert (folded.ts, folded.dp_rank, folded.ignored) == (
            plain.ts,
            plain.dp_rank,
            plain.ignored,
        )
    folded = decode_batch(evicting, fold_removals=True)
    assert folded.events[0] == RemovedRun(list(range(100, 140)), DEVICE, "GPU")
    assert [type(e).__name__ for e in folded.events] == [
        "RemovedRun",
        "RemovedRun",
        "BlockRemoved",
        "BlockStored",
        "RemovedRun",
    ]
    assert decode_batch(positional, fold_removals=True).events[0] == RemovedRun(
        [1, 2, 3], DEVICE, "GPU"
    )


def test_a_run_of_removals_that_differ_beside_the_hash_folds_as_each_decodes_alone() -> None:
    """The compiled decoder recognizes a removal repeating the one before it byte for byte
    around the hash; every other difference must still be read as the event says."""
    big = 1 << 63
    events = [
        *[removed_map(block_hashes=[big + h]) for h in range(5)],  # uint64, the usual run
        removed_map(block_hashes=[300]),  # another width: uint16
        removed_map(block_hashes=[70_000]),  # uint32
        removed_map(block_hashes=[200]),  # uint8
        removed_map(block_hashes=[7]),  # a fixint
        removed_map(block_hashes=[big + 9], medium="CPU"),  # another medium, same length
        removed_map(block_hashes=[big + 10], medium="CPU"),
        removed_map(block_hashes=[big + 11]),
        {"medium": "GPU", "block_hashes": [big + 12], "type": "BlockRemoved"},  # key order
        removed_map(block_hashes=[big + 13], group_idx=0),  # one key more
        removed_map(block_hashes=[big + 14], group_idx=0),
        removed_map(block_hashes=[big + 15], group_idx=1),  # ignored: differs in one byte
        removed_map(block_hashes=[big + 16], group_idx=0),
        removed_map(block_hashes=[big + 17, big + 18]),  # two hashes
        removed_map(block_hashes=[big + 19]),
        removed_map(block_hashes=[-5]),  # not u64: decoded (and masked) by the general path
        removed_map(block_hashes=[big + 20]),
        stored_map(),
        removed_map(block_hashes=[big + 21]),
    ]
    payload = batch(*events)
    folded = decode_batch(payload, fold_removals=True)
    assert folded.events == fold_removal_runs(decode_batch(payload).events)
    assert folded.events[:3] == [
        RemovedRun([big + h for h in range(5)] + [300, 70_000, 200, 7], DEVICE, "GPU"),
        RemovedRun([big + 9, big + 10], HOST, "CPU"),
        RemovedRun([big + 11, big + 12, big + 13, big + 14, big + 16], DEVICE, "GPU"),
    ]
    assert folded.ignored == decode_batch(payload).ignored
    assert sum(len(getattr(e, "engine_hashes", ())) for e in folded.events) == 24


# --- which path runs -------------------------------------------------------------------------

_PAIRS = [[t, t + 1] for t in TOKENS]


@pytest.mark.parametrize(
    "payload",
    [
        batch(stored_map(), removed_map(), {"type": "AllBlocksCleared"}),
        batch(vllm_023_stored(), ["BlockRemoved", [1], "GPU", 0], ["AllBlocksCleared"]),
        enc([1.0, [["BlockStored", [1], None, [1], 1, None]]]),
        enc([1.0, [stored_map()] * 20, 0]),  # array16 of events
        batch(stored_map(token_ids=_PAIRS), removed_map()),
        batch([*stored_array(None, "GPU")[:3], _PAIRS, 16], ["BlockRemoved", [1]]),
    ],
    ids=["maps", "positional", "vllm-0.9", "many-events", "bigram-maps", "bigram-positional"],
)
def test_engine_shapes_take_the_typed_fast_path(payload: bytes) -> None:
    decode_fast(payload)


@pytest.mark.parametrize(
    "payload",
    [
        batch({"type": "Future"}),
        batch(stored_map(), ["BlockRemoved", [1]]),
        batch(stored_map(), stored_map(token_ids=_PAIRS)),
    ],
    ids=["unknown-tag", "mixed-shapes", "mixed-token-encodings"],
)
def test_unusual_shapes_fall_back_to_the_generic_path(payload: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, EventDecodeError)):
        _decode_typed(payload)
    decode(payload)
