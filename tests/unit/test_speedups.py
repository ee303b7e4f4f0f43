"""cachetree._speedups against its pure twins: bit-exact keys, the same token parsing, the switch.

The compiled module is imported directly (not through `cachetree.accel`), so these tests hold
it to its twins in both passes of the suite; the rest of the suite exercises whichever path
`cachetree.accel` chose. Skipped, with the reason, only when the extension is not built
(`scripts/test` refuses to run without it).
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest
from xxhash import xxh3_64_intdigest

from cachetree.keys import ROOT_SEED, block_keys_py
from router.events import MAX_TOKENS_PER_EVENT, TokenIds

speedups = pytest.importorskip(
    "cachetree._speedups", reason="the compiled accelerator is not built (pip install -e .)"
)

ROOT = Path(__file__).resolve().parents[2]
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
