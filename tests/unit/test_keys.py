from array import array
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest

from cachetree.keys import ROOT_SEED, block_keys, chain_keys, namespace_seed, token_bytes


def test_first_two_keys_of_tokens_1_to_32_are_pinned() -> None:
    keys = block_keys(list(range(1, 33)), 16)
    assert keys == [0xEA06FC71A5EE6E88, 0x0C067075397666B7]


def test_key_chain_seeds_each_block_with_the_previous_key() -> None:
    tokens = list(range(100, 148))
    keys = block_keys(tokens, 16)
    expected_0 = xxh3_64_intdigest(array("I", tokens[:16]).tobytes(), ROOT_SEED)
    expected_1 = xxh3_64_intdigest(array("I", tokens[16:32]).tobytes(), expected_0)
    assert keys[:2] == [expected_0, expected_1]


def test_only_full_blocks_are_keyed() -> None:
    assert len(block_keys(list(range(47)), 16)) == 2
    assert block_keys(list(range(15)), 16) == []


@pytest.mark.parametrize("shaped", [bytes, bytearray, lambda ids: array("B", ids), memoryview])
def test_ids_given_one_a_byte_key_as_the_same_ids_in_a_list(shaped: Any) -> None:
    # The `bytes` tokenizer's ids come as bytes: each byte is an id, never 4 bytes of one.
    ids = bytes(range(3, 253)) * 3
    assert block_keys(shaped(ids), 16, 99) == block_keys(list(ids), 16, 99)
    assert len(block_keys(shaped(ids), 16)) == len(ids) // 16
    assert token_bytes(ids) == array("I", list(ids)).tobytes()


def test_extending_a_chain_from_a_parent_key_equals_hashing_the_whole_prompt() -> None:
    tokens = list(range(1, 65))
    whole = block_keys(tokens, 16)
    tail = block_keys(tokens[32:], 16, seed=whole[1])
    assert tail == whole[2:]


def test_namespace_changes_every_key_and_is_deterministic() -> None:
    tokens = list(range(1, 33))
    plain = block_keys(tokens, 16)
    lora = block_keys(tokens, 16, namespace_seed("adapter-a"))
    assert namespace_seed(None) == namespace_seed("") == ROOT_SEED
    assert namespace_seed("adapter-a") == ROOT_SEED ^ xxh3_64_intdigest(b"adapter-a")
    assert set(lora).isdisjoint(plain)
    assert lora == block_keys(tokens, 16, namespace_seed("adapter-a"))
    assert lora != block_keys(tokens, 16, namespace_seed("adapter-b"))


def test_same_block_content_at_another_position_gets_another_key() -> None:
    block = list(range(16))
    keys = block_keys(block * 3, 16)
    assert len(set(keys)) == 3


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_token_ids_outside_u32_are_refused(bad: list) -> None:
    with pytest.raises((OverflowError, TypeError)):
        token_bytes(bad)


def test_chain_keys_refuses_a_non_positive_block_size() -> None:
    with pytest.raises(ValueError):
        chain_keys(b"\0" * 64, 0, ROOT_SEED)
