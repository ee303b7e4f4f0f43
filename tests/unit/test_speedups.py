"""cachetree._speedups against its pure twins: bit-exact keys, the same token parsing, the switch.

The compiled module is imported directly (not through `cachetree.accel`), so these tests hold
it to its twins in both passes of the suite; the rest of the suite exercises whichever path
`cachetree.accel` chose. Skipped, with the reason, only when the extension is not built
(`scripts/test` refuses to run without it).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
from xxhash import xxh3_64_intdigest

from cachetree.keys import ROOT_SEED, block_keys_py
from cachetree.ranks import RankId
from cachetree.tiers import DEVICE, HOST
from router.events import (
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    RemovedRun,
    TokenIds,
    _decode_event,
    _decode_generic,
    decode_batch,
    fold_removal_runs,
)

speedups = pytest.importorskip(
    "cachetree._speedups", reason="the compiled accelerator is not built (pip install -e .)"
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
U32 = (1 << 32) - 1
_TOKENS = msgspec.msgpack.Decoder(list[Annotated[int, msgspec.Meta(ge=0, le=U32)]])


# --- XXH3-64 ---------------------------------------------------------------------------------

# Every length class of the specification, its edges, and long inputs over several 1 KiB blocks.
LENGTHS = [
    *range(0, 18),
    *(31, 32, 33, 63, 64, 65, 96, 127, 128, 129, 130, 143, 144, 200, 239, 240, 241, 255, 256),
    *(257, 511, 512, 1023, 1024, 1025, 1087, 1088, 2047, 2048, 2049, 4096, 5000, 100_003),
]


@pytest.mark.parametrize("length", LENGTHS)
def test_xxh3_64_is_bit_exact_with_the_xxhash_package(length: int) -> None:
    rng = random.Random(length)
    for seed in (0, ROOT_SEED, rng.getrandbits(64), (1 << 64) - 1, 1 << 63):
        data = rng.randbytes(length)
        assert speedups.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed), (length, seed)


def test_xxh3_64_is_bit_exact_over_random_lengths_and_seeds() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        data = rng.randbytes(rng.choice((rng.randrange(0, 300), rng.randrange(0, 3000))))
        seed = rng.getrandbits(64)
        assert speedups.xxh3_64(data, seed) == xxh3_64_intdigest(data, seed), (len(data), seed)


# --- block keys ------------------------------------------------------------------------------


def test_the_compiled_keys_of_tokens_1_to_32_are_the_pinned_ones() -> None:
    assert speedups.block_keys(list(range(1, 33)), 16, ROOT_SEED) == [
        0xEA06FC71A5EE6E88,
        0x0C067075397666B7,
    ]


# Block sizes whose blocks fall in each XXH3 length class (4 bytes a token).
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16, 32, 33, 60, 61, 256, 300])
def test_block_keys_equal_the_pure_twin_for_every_input_type(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(20):
        n = rng.randrange(0, 6 * block_size + 2)
        tokens = [
            rng.choice((0, U32, rng.randrange(50_000), rng.getrandbits(32))) for _ in range(n)
        ]
        seed = rng.choice((ROOT_SEED, rng.getrandbits(64)))
        want = block_keys_py(tokens, block_size, seed)
        assert len(want) == n // block_size
        for shaped in (
            tokens,
            tuple(tokens),
            array("I", tokens),
            TokenIds("I", tokens),
            memoryview(array("I", tokens)),
            array("L", tokens),  # not a u32 buffer: read as a sequence of ints
            iter(tokens),
        ):
            assert speedups.block_keys(shaped, block_size, seed) == want, type(shaped)
        small = [t & 0xFF for t in tokens]  # ids one a byte: the `bytes` tokenizer's
        want = block_keys_py(small, block_size, seed)
        for shaped in (bytes(small), bytearray(small), array("B", small)):
            assert block_keys_py(shaped, block_size, seed) == want, type(shaped)
            assert speedups.block_keys(shaped, block_size, seed) == want, type(shaped)


@pytest.mark.parametrize(
    "bad",
    [[-1], [U32 + 1], [1.5], ["a"], [None], [1 << 70], 5, None],
    ids=["negative", "2**32", "float", "str", "none", "huge", "not-a-sequence", "null"],
)
def test_block_keys_refuse_what_the_pure_twin_refuses(bad: Any) -> None:
    with pytest.raises((OverflowError, TypeError)) as pure:
        block_keys_py(bad, 1, ROOT_SEED)
    with pytest.raises(pure.type):
        speedups.block_keys(bad, 1, ROOT_SEED)


def test_block_keys_take_bools_and_index_ints_as_the_pure_twin_does() -> None:
    class Index:
        def __index__(self) -> int:
            return 7

    tokens = [True, False, Index(), 9]
    assert speedups.block_keys(tokens, 2, 1) == block_keys_py(tokens, 2, 1)


@pytest.mark.parametrize("block_size", [0, -16])
def test_block_keys_refuse_a_non_positive_block_size(block_size: int) -> None:
    for tokens in ([1, 2], array("I", [1, 2])):
        with pytest.raises(ValueError):
            speedups.block_keys(tokens, block_size, ROOT_SEED)


# --- token ids from msgpack ------------------------------------------------------------------


def _int_encodings(value: int) -> list[bytes]:
    """Every msgpack encoding of a non-negative int, minimal or not."""
    out = []
    if value < 0x80:
        out.append(bytes([value]))
    for tag, width, signed in (
        (0xCC, 1, False),
        (0xCD, 2, False),
        (0xCE, 4, False),
        (0xCF, 8, False),
        (0xD0, 1, True),
        (0xD1, 2, True),
        (0xD2, 4, True),
        (0xD3, 8, True),
    ):
        limit = 1 << (8 * width - 1 if signed else 8 * width)
        if value < limit:
            out.append(bytes([tag]) + value.to_bytes(width, "big"))
    return out


def _array(items: list[bytes], header: str = "min") -> bytes:
    n = len(items)
    if header == "min" and n < 16:
        head = bytes([0x90 | n])
    elif header in ("min", "16") and n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(items)


def _parsed(raw: bytes, pairs: bool = False) -> list[int]:
    return array("I", speedups.parse_tokens(raw, MAX_TOKENS_PER_EVENT, pairs)).tolist()


def test_parse_tokens_reads_every_msgpack_encoding_of_an_id() -> None:
    for value in (0, 1, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, U32 - 1, U32):
        for encoded in _int_encodings(value):
            for header in ("min", "16", "32"):
                raw = _array([encoded, encoded], header)
                assert _TOKENS.decode(raw) == [value, value]
                assert _parsed(raw) == [value, value], (value, encoded.hex(), header)


def test_parse_tokens_equals_msgspec_on_random_arrays() -> None:
    rng = random.Random(3)
    for _ in range(500):
        values = [rng.choice((rng.randrange(200), rng.getrandbits(32))) for _ in range(70)]
        items = [rng.choice(_int_encodings(v)) for v in values[: rng.randrange(70)]]
        raw = _array(items, rng.choice(("min", "16", "32")))
        assert _parsed(raw) == _TOKENS.decode(raw)


def test_parse_tokens_keeps_the_first_id_of_each_bigram_pair() -> None:
    pairs = [[t, t + 1] for t in range(1, 33)]
    raw = msgspec.msgpack.encode(pairs)
    assert _parsed(raw, pairs=True) == list(range(1, 33))
    wide = _array([_array([_int_encodings(5)[-1], b"\x06"], "32")])  # array32 pair, int64 id
    assert _parsed(wide, pairs=True) == [5]


def test_a_folding_decode_equals_the_pure_fold_and_builds_no_removal_per_block() -> None:
    """The churn batches' ~63 one-block removals come as one RemovedRun, built in C."""
    for payload in _engine_map_payloads():
        got = _compiled_batch(payload, fold=True)
        want = _decode_generic(payload)
        assert got.events == fold_removal_runs(want.events)
        assert (got.ts, got.dp_rank, got.ignored) == (want.ts, want.dp_rank, want.ignored)
    from bench.ingest_churn import workload

    for payload in workload(1, 256, 20).measured:
        kinds = [type(e) for e in _compiled_batch(payload, fold=True).events]
        assert BlockRemoved not in kinds and kinds.count(RemovedRun) == 1, kinds


def test_a_folding_decode_equals_the_pure_fold_on_random_event_mixes() -> None:
    """Runs across media, multi-block removals, ignored events, stores, clears, and one-block
    removals the C reader leaves to the Python decoder (an unusual key): one fold for all."""
    rng = random.Random(17)
    makers = [
        lambda: {"type": "BlockRemoved", "block_hashes": [rng.randrange(1 << 64)], "medium": "GPU"},
        lambda: {"type": "BlockRemoved", "block_hashes": [rng.randrange(9)], "medium": "CPU"},
        lambda: {"type": "BlockRemoved", "block_hashes": [rng.randrange(9)], "medium": None},
        lambda: {"type": "BlockRemoved", "block_hashes": [3], "medium": "NVMe?"},  # unknown
        lambda: {"type": "BlockRemoved", "block_hashes": [4, 5], "medium": "GPU"},
        lambda: {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU", "x": 1},
        lambda: {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 2},
        lambda: {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"},
        lambda: {
            "type": "BlockStored",
            "block_hashes": [8],
            "parent_block_hash": None,
            "token_ids": list(range(16)),
            "block_size": 16,
            "medium": "GPU",
        },
        lambda: {"type": "AllBlocksCleared"},
    ]
    taken = 0
    for _ in range(3000):
        events = [rng.choice(makers)() for _ in range(rng.randint(0, 14))]
        payload = msgspec.msgpack.encode([1.5, events, 0])
        got = _compiled_batch(payload, fold=True)
        if got is None:
            continue
        taken += 1
        assert got.events == fold_removal_runs(_decode_generic(payload).events), events
    assert taken > 2900


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("raw", "pairs"),
    [
        (_enc([1, -1]), False),
        (_array([b"\x01", b"\xd0\xff"]), False),  # int8 -1
        (_array([b"\xd3" + (-5).to_bytes(8, "big", signed=True)]), False),
        (_array([b"\xcf" + (U32 + 1).to_bytes(8, "big")]), False),
        (_array([b"\xd3" + (1 << 40).to_bytes(8, "big")]), False),
        (_enc([1, True]), False),
        (_enc([1, None]), False),
        (_enc([1, 1.0]), False),
        (_enc([1, "1"]), False),
        (_enc([1, [1, 2]]), False),  # a pair among flat ids
        (_enc([[1, 2], 3]), True),  # an id among pairs
        (_enc([[1, 2], [3]]), True),
        (_enc([[1, 2], [3, 4, 5]]), True),
        (_enc([[1, -2]]), True),  # the second element is checked too
        (_enc([[1, 2]]), False),
        (_enc([1, 2]), True),
        (_enc(5), False),
        (_enc(None), False),
        (_enc({"a": 1}), False),
        (_enc(b"\x00" * 8), False),
        (_enc([1, 2]) + b"\x01", False),  # trailing bytes
        (_enc([1, 2])[:-1], False),  # truncated
        (b"\xdc\x00", False),
        (b"", False),
    ],
)
def test_parse_tokens_refuses_what_the_typed_decoder_refuses(raw: bytes, pairs: bool) -> None:
    with pytest.raises(ValueError):
        speedups.parse_tokens(raw, MAX_TOKENS_PER_EVENT, pairs)


def test_parse_tokens_refuses_more_ids_than_the_cap_before_reading_them() -> None:
    raw = b"\xdd" + (1 << 31).to_bytes(4, "big")  # claims 2**31 ids, holds none
    with pytest.raises(ValueError, match="too many"):
        speedups.parse_tokens(raw, MAX_TOKENS_PER_EVENT, False)
    assert _parsed(_enc([1] * 10)) == [1] * 10
    with pytest.raises(ValueError, match="too many"):
        speedups.parse_tokens(_enc([1] * 10), 9, False)


# --- whole batches of map events -------------------------------------------------------------


def _compiled_batch(
    payload: bytes, decode_event: Callable[[bytes, int], Any] | None = None, *, fold: bool = False
) -> Any:
    from router import events

    return speedups.decode_map_batch(
        payload,
        events._MAP_BATCH_SPEC,
        decode_event or events._decode_event,
        RemovedRun if fold else None,
    )


def _engine_map_payloads() -> list[bytes]:
    from bench.bench_ingest import stream
    from bench.ingest_churn import workload

    captured = [
        p.read_bytes()
        for p in sorted(FIXTURES.glob("*_live*_frame2.bin"))
        if "arraylike" not in p.name
    ]
    assert len(captured) >= 9, "vLLM 0.33 (int and bytes hashes) and SGLang 0.5.23 captures"
    return [*captured, *workload(1, 256, 20).measured, *stream(True, batches=50)[0]]


def test_decode_map_batch_takes_every_map_batch_engines_send_and_equals_the_reference() -> None:
    for payload in _engine_map_payloads():
        got = _compiled_batch(payload)
        assert got is not None, payload[:40].hex()
        assert got == _decode_generic(payload)


def test_decode_map_batch_builds_churn_batches_without_the_python_decoder() -> None:
    """A churn batch, ~63 one-block removals and one ~63-block store, is built wholly in C."""
    from bench.ingest_churn import workload

    handed: list[bytes] = []

    def decode_event(span: bytes, index: int) -> Any:
        handed.append(span)
        return _decode_event(span, index)

    batches = workload(1, 256, 20).measured
    removals = stores = 0
    for payload in batches:
        got = _compiled_batch(payload, decode_event)
        assert got == _decode_generic(payload)
        removals += sum(type(e) is BlockRemoved for e in got.events)
        stores += sum(type(e) is BlockStored for e in got.events)
        assert all(type(e.token_ids) is TokenIds for e in got.events if type(e) is BlockStored)
    assert removals > 20 * 50
    assert stores == len(batches)
    assert handed == []


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


REMOVED = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        _enc([1.5, [["BlockRemoved", [7], "GPU"]], 0]),  # positional events
        _enc([1.5, [REMOVED], 0, "extra"]),  # an element past dp_rank
        _enc([1.5]),
        _enc({"ts": 1.5}),
        _enc([True, [REMOVED], 0]),  # a bool ts
        _enc([float("nan"), [REMOVED], 0]),
        _enc([1.5, [REMOVED], -1]),  # a negative dp_rank
        _enc([1.5, [REMOVED], True]),
        _enc([1.5, [REMOVED], 0]) + b"\x00",  # trailing bytes
        _enc([1.5, [REMOVED, 5], 0]),  # an event that is not a map
        _enc([1.5, [{**REMOVED, "x": msgspec.msgpack.Ext(1, b"a")}], 0]),  # an ext value
        _enc([1.5, [{**REMOVED, "x": _nested(40)}], 0]),
    ],
    ids=[
        "positional",
        "extra-root-element",
        "no-events",
        "map-root",
        "bool-ts",
        "nan-ts",
        "negative-dp-rank",
        "bool-dp-rank",
        "trailing-bytes",
        "int-event",
        "ext-value",
        "deep-nesting",
    ],
)
def test_decode_map_batch_leaves_anything_unusual_to_the_python_decoders(payload: bytes) -> None:
    assert _compiled_batch(payload) is None


@pytest.mark.parametrize(
    "event",
    [
        {**REMOVED, "block_hashes": [(1 << 64) - 1]},
        {**REMOVED, "block_hashes": [-5]},  # signed: two's complement, via msgspec
        {**REMOVED, "block_hashes": [b"\x01" * 32]},
        {**REMOVED, "block_hashes": [1, 2]},
        {**REMOVED, "block_hashes": []},
        {**REMOVED, "medium": None},
        {**REMOVED, "medium": "CPU"},
        {**REMOVED, "medium": "NVME"},  # unknown medium: every tier
        {**REMOVED, "medium": "GPÜ"},
        {**REMOVED, "group_idx": 0},
        {**REMOVED, "group_idx": 1},
        {**REMOVED, "locality": None},
        {**REMOVED, "locality": "remote"},
        {**REMOVED, "locality": "Local"},
        {**REMOVED, "lora_id": None},
        {"block_hashes": [7], "type": "BlockRemoved"},
        {"type": "AllBlocksCleared"},
        {"type": "Future", "x": 1},
    ],
)
def test_decode_map_batch_equals_the_reference_for_every_removal_shape(event: Any) -> None:
    payload = _enc([1767225600.0, [REMOVED, event, REMOVED], 3])
    try:
        got = _compiled_batch(payload)
    except (msgspec.DecodeError, EventDecodeError):
        got = None  # decode_batch then asks the Python decoders
    want = _decode_generic(payload)
    assert got is None or got == want
    assert decode_batch(payload) == want


STORED = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": 10,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "group_idx": 0,
}

# BlockStored shapes the C path takes itself (no Python decoder), each equal to the reference.
STORED_IN_C = [
    STORED,
    {"type": "BlockStored", "block_hashes": [11], "token_ids": [1, 2], "block_size": 2},
    {**STORED, "block_hashes": [(1 << 64) - 1, 0]},
    {**STORED, "block_hashes": [-5, -(1 << 63)], "parent_block_hash": -1},  # signed
    {**STORED, "block_hashes": [b"\x01" * 32, b"\x07"], "parent_block_hash": b"\x02" * 64},
    {**STORED, "block_hashes": [1 << 40, 1 << 20], "token_ids": [0, 255, 1 << 16, U32]},
    {**STORED, "parent_block_hash": None},
    {**STORED, "medium": None},
    {**STORED, "medium": "CPU"},
    {**STORED, "lora_name": "adapter-1"},
    {**STORED, "group_idx": None, "cache_salt": None, "kv_cache_spec_kind": None},
    {**STORED, "locality": None},
    {**STORED, "extra_keys": [[1, "x"], None], "lora_id": 3},  # keys _MapStored skips
    {"block_size": 2, "token_ids": [1, 2], "block_hashes": [5], "type": "BlockStored"},
]

# Shapes it leaves to the Python decoders: each decodes there to the reference (or fails).
STORED_IN_PYTHON = [
    {**STORED, "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]]},  # bigram pairs
    {**STORED, "lora_name": "adaptér"},
    {**STORED, "cache_salt": "s"},
    {**STORED, "group_idx": 1},
    {**STORED, "kv_cache_spec_kind": "full_attention"},
    {**STORED, "kv_cache_spec_kind": "sliding_window"},
    {**STORED, "locality": "LOCAL"},
    {**STORED, "locality": "remote"},
    {**STORED, "medium": "NVME"},
    {**STORED, "medium": "GPÜ"},
    {**STORED, "block_hashes": [], "token_ids": []},
    {**STORED, "block_size": 3},  # a token count that does not match
    {**STORED, "block_size": 0},
    {**STORED, "block_size": True},
    {**STORED, "block_hashes": [11, True]},
    {**STORED, "block_hashes": [11, b""]},
    {**STORED, "block_hashes": [11, b"\x01" * 65]},
    {**STORED, "block_hashes": [11, 1.5]},
    {**STORED, "parent_block_hash": "10"},
    {**STORED, "token_ids": [1, 2, 3, 1 << 32]},
    {**STORED, "token_ids": [1, 2, 3, -1]},
    {**STORED, "token_ids": [1, 2, 3, False]},
    {**STORED, "lora_name": 5},
    {**STORED, "extra_keys": msgspec.msgpack.Ext(1, b"a")},
    {k: v for k, v in STORED.items() if k != "block_size"},
    {k: v for k, v in STORED.items() if k != "token_ids"},
    {k: v for k, v in STORED.items() if k != "block_hashes"},
]


@pytest.mark.parametrize("event", STORED_IN_C + STORED_IN_PYTHON)
def test_decode_map_batch_equals_the_reference_for_every_stored_shape(event: Any) -> None:
    handed: list[bytes] = []

    def decode_event(span: bytes, index: int) -> Any:
        handed.append(span)
        return _decode_event(span, index)

    payload = _enc([1767225600.0, [REMOVED, event, REMOVED], 3])
    try:
        got = _compiled_batch(payload, decode_event)
    except (msgspec.DecodeError, msgspec.ValidationError, EventDecodeError):
        got = None  # decode_batch then asks the Python decoders
    try:
        want = _decode_generic(payload)
    except EventDecodeError:
        with pytest.raises(EventDecodeError):
            decode_batch(payload)
        assert got is None
        return
    assert got is None or got == want
    assert decode_batch(payload) == want
    assert (handed == [] and got is not None) is (event in STORED_IN_C)


def test_decode_map_batch_takes_a_stored_event_at_the_caps_and_leaves_one_past_them() -> None:
    def batch(hashes: int, block_size: int) -> bytes:
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(1, hashes + 1)),
            "token_ids": [7] * (hashes * block_size),
            "block_size": block_size,
        }
        return _enc([1.5, [event], 0])

    def refuse(span: bytes) -> Any:
        raise AssertionError("handed to the Python decoder")

    for payload in [batch(MAX_HASHES_PER_EVENT, 16), batch(1, MAX_TOKENS_PER_EVENT)]:
        assert _compiled_batch(payload, refuse) == _decode_generic(payload)
    for payload in [batch(MAX_HASHES_PER_EVENT + 1, 1), batch(1, MAX_TOKENS_PER_EVENT + 1)]:
        with pytest.raises(EventDecodeError, match="over_cap"):
            decode_batch(payload)


def test_decode_map_batch_under_mutation_is_none_an_error_or_the_reference() -> None:
    from tests.unit.test_events_fuzz import _mutate

    rng = random.Random(11)
    seeds = _engine_map_payloads()
    taken = 0
    for _ in range(4000):
        payload = _mutate(rng, rng.choice(seeds))
        try:
            got = _compiled_batch(payload)
        except (msgspec.DecodeError, EventDecodeError, RecursionError):
            continue
        if got is None:
            continue
        taken += 1
        try:
            assert got == _decode_generic(payload)
        except EventDecodeError as exc:  # the documented difference (router/events.py)
            assert (exc.reason, exc.detail) == ("malformed_msgpack", "Invalid UTF-8 encoded string")
    assert taken > 150


# --- runs of removals ------------------------------------------------------------------------


def test_removal_run_equals_the_python_twin() -> None:
    from router.index import _removal_run_py

    rng = random.Random(5)
    kinds = [
        lambda: BlockRemoved([rng.randrange(100)], DEVICE, "GPU"),
        lambda: BlockRemoved([rng.randrange(100) for _ in range(3)], DEVICE, "GPU"),
        lambda: BlockRemoved([1], None, None),
        lambda: BlockRemoved([2], HOST, "CPU"),
        lambda: BlockRemoved([3], DEVICE, "GPU".lower().upper()),  # equal, not identical
        lambda: BlockStored([1], None, [1, 2], 2, DEVICE, "GPU", None),
        lambda: AllBlocksCleared(),
    ]
    for _ in range(2000):
        events = [rng.choice(kinds)() for _ in range(rng.randint(1, 12))]
        starts = [i for i, e in enumerate(events) if type(e) is BlockRemoved]
        for start in starts:
            want = _removal_run_py(events, start, BlockRemoved)
            assert speedups.removal_run(events, start, BlockRemoved) == want


# --- cache_aware's cost rows ---------------------------------------------------------------


def _cost_case(rng: random.Random) -> tuple[Any, ...]:
    from cachetree.ranks import RankId

    n = rng.choice([1, 2, 3, rng.randrange(1, 70)])
    ranks = [RankId(f"http://w{i}:8000", rng.randrange(2)) for i in range(n)]
    block = rng.choice([1, 16, 64])
    blocks = rng.randrange(0, 300)
    tokens = float(blocks * block + rng.randrange(block))

    def capacity() -> int | None:
        return rng.choice([None, 0, rng.randrange(1, 50), rng.randrange(1, 500_000)])

    def demand() -> float:
        return rng.choice(
            [0.0, rng.random() * 1000, rng.random() * 600_000, float(rng.randrange(90))]
        )

    def load() -> int | float:  # a plain load, or the queue term's (`policy._queued`)
        return rng.choice([rng.randrange(0, 80), rng.randrange(0, 80) + 0.25 * rng.randrange(9)])

    return (
        ranks,
        [load() for _ in ranks],
        {r: rng.randrange(0, blocks + 3) for r in ranks if rng.random() < 0.6},
        [capacity() for _ in ranks],
        [demand() for _ in ranks],
        [rng.randrange(0, 600_000) for _ in ranks],
        [rng.randrange(0, blocks + 3) for _ in ranks],
        tokens,
        block,
        blocks,
        rng.choice([1.0, 0.0, rng.random() * 3]),
        rng.choice([256.0, rng.random() * 300, 256.0 / 3]),
        block * rng.choice([0.5, 0.0, 1.0, rng.random()]),
        rng.choice([0.0, 0.5, 2 / 3]),
        rng.choice([1.0, 0.0, rng.random() * 4]),
        rng.choice([2.0, 0.0, rng.random() * 4]),
    )


def test_cost_rows_equal_the_python_twin_float_for_float() -> None:
    from router.policy import _cost_rows_py

    rng = random.Random(29)
    spilled = 0
    for _ in range(20_000):
        case = _cost_case(rng)
        want = _cost_rows_py(*case)
        got = speedups.cost_rows(*case)
        assert got == want, case
        # The same floats, not merely equal values: the bits, and no -0.0 for 0.0.
        assert [c.hex() for c in got[0]] == [float(c).hex() for c in want[0]], case
        assert [float(r).hex() for r in got[2]] == [float(r).hex() for r in want[2]], case
        spilled += any(got[1])
    assert spilled > 1000


def test_cost_rows_refuses_lists_of_different_lengths_and_other_types() -> None:
    case = list(_cost_case(random.Random(3)))
    case[1] = [*case[1], 0]
    with pytest.raises(ValueError, match="differ in length"):
        speedups.cost_rows(*case)
    case = list(_cost_case(random.Random(3)))
    case[3] = tuple(case[3])
    with pytest.raises(TypeError, match="lists"):
        speedups.cost_rows(*case)
    with pytest.raises(TypeError, match="16 arguments"):
        speedups.cost_rows(*case[:15])


def test_cost_rows_equal_the_python_twin_at_the_bound_of_stated_capacities_and_past_it() -> None:
    from router.loads import MAX_REPORTED
    from router.policy import _cost_rows_py

    # router.loads believes a pool up to MAX_REPORTED tokens (that many blocks at block size
    # 1); the C arithmetic must not overflow for any value of a 64-bit word either (`2 *
    # capacity - held` did from 2**62: the rank's room went negative, undefined behaviour).
    extremes = [MAX_REPORTED - 1, MAX_REPORTED, 2**53, 2**62, 2**63 - 1]
    rng = random.Random(31)
    for _ in range(5_000):
        case = list(_cost_case(rng))
        n = len(case[0])
        case[3] = [rng.choice([None, *extremes]) if rng.random() < 0.7 else c for c in case[3]]
        case[5] = [rng.choice([0, h, MAX_REPORTED, 2**62]) for h in case[5]]
        want = _cost_rows_py(*case)
        got = speedups.cost_rows(*case)
        assert got == want, case
        assert [c.hex() for c in got[0]] == [float(c).hex() for c in want[0]], case
        assert [float(r).hex() for r in got[2]] == [float(r).hex() for r in want[2]], case
        assert len(got[0]) == n
    # The room of a rank stating a pool of 2**62 blocks is positive, as the twin says.
    ranks = [RankId("http://w:8000", 0)]
    case = (ranks, [0], {}, [2**62], [0.0], [0], [0], 16.0, 16, 1, 1.0, 256.0, 8.0, 0.0, 1.0, 2.0)
    assert speedups.cost_rows(*case)[2] == _cost_rows_py(*case)[2] == [float(2**63)]
