"""The fake worker's engine block hashes equal what vLLM and SGLang publish for the same tokens."""

from __future__ import annotations

from fake_kv_worker.hashing import (
    VLLM_NONE_HASH,
    SglangPageHasher,
    VllmSha256Hasher,
    chain_digests,
    engine_block_hashes,
)

TOKENS_1_TO_32 = list(range(1, 33))


def test_vllm_none_hash_is_the_deterministic_sha256_seed_of_0_29() -> None:
    assert VLLM_NONE_HASH.hex() == (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    )


def test_vllm_digests_match_the_reference_worked_example() -> None:
    digests = chain_digests(VllmSha256Hasher(), TOKENS_1_TO_32, 16)
    assert [d.hex() for d in digests] == [
        "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf",
        "8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577",
    ]


def test_vllm_wire_values_are_the_low_64_bits_unsigned() -> None:
    assert engine_block_hashes("vllm", TOKENS_1_TO_32, 16) == [
        1403909460543360175,
        1643945449041937783,
    ]


def test_sglang_wire_values_are_the_first_64_bits_signed() -> None:
    assert engine_block_hashes("sglang", TOKENS_1_TO_32, 16) == [
        8635429971592222890,
        1256577331724852459,
    ]
    # A digest whose first byte is >= 0x80 goes on the wire as a negative int64.
    assert engine_block_hashes("sglang", [3] * 16, 16) == [-5675343678154751648]


def test_hashes_are_chained_so_equal_blocks_at_different_prefixes_differ() -> None:
    second_block = list(range(17, 33))
    for engine in ("vllm", "sglang"):
        a = engine_block_hashes(engine, list(range(1, 17)) + second_block, 16)
        b = engine_block_hashes(engine, list(range(101, 117)) + second_block, 16)
        assert a[1] != b[1], engine


def test_only_full_blocks_are_hashed() -> None:
    assert engine_block_hashes("vllm", list(range(1, 32)), 16) == [1403909460543360175]
    assert engine_block_hashes("sglang", list(range(1, 16)), 16) == []


def test_sglang_tags_pages_with_ids_beyond_u32() -> None:
    hasher = SglangPageHasher()
    small = hasher.block_digest(None, [1, 2])
    big = hasher.block_digest(None, [1, 2**32 + 2])
    assert small != big
    assert len(big) == 32
