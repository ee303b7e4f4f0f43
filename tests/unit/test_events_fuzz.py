"""router.events under fuzz: nothing but EventDecodeError ever escapes, and both paths agree.

Three seeded generators: random bytes, random mutations of real captures and hand-built
batches, and structure-aware batches whose every field is drawn from valid and invalid values.
For each input: decode_batch returns a batch or raises EventDecodeError (nothing else); when it
returns, the generic reference path returns the same batch, and when it raises, the reference
raises the same reason and detail (but for one documented difference); when the typed fast path
accepts an input, the reference accepts it too, with the same result. So the fast path is
never more lenient than the reference, and never different.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.events import (
    DECODE_ERROR_REASONS,
    EventBatch,
    EventDecodeError,
    _decode_generic,
    _decode_typed,
    decode_batch,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
TOKENS = list(range(1, 33))


def check(payload: bytes) -> EventBatch | None:
    """The fuzz property for one input; returns the batch when it decodes."""
    try:
        got = decode_batch(payload)
    except EventDecodeError as exc:
        assert exc.reason in DECODE_ERROR_REASONS
        with pytest.raises(EventDecodeError) as reference:
            _decode_generic(payload)
        if str(reference.value) != str(exc):  # the same reason and detail, as the metric and log
            # The generic path decodes the whole payload before any event; the others read no
            # further than the first bad event, and skip strings they do not read, and count an
            # event's bytes from its start where they read it alone.
            alone = exc.reason == "malformed_msgpack" and " (its own bytes): " in exc.detail
            assert alone or str(reference.value) == (
                "malformed_msgpack: Invalid UTF-8 encoded string"
            )
        return None
    # decode_batch returned the typed path's result when that path took the input, so this
    # also checks that the typed path never accepts what the reference refuses or reads apart.
    try:
        assert _decode_generic(payload) == got
    except EventDecodeError as exc:
        # The one documented difference: a string the decoder never reads (an unknown key, an
        # ignored field) is skipped by the typed path without a UTF-8 check.
        assert (exc.reason, exc.detail) == ("malformed_msgpack", "Invalid UTF-8 encoded string")
    return got


def _seeds() -> list[bytes]:
    enc = msgspec.msgpack.encode
    captured = [p.read_bytes() for p in sorted(FIXTURES.glob("*_live*_frame2.bin"))]
    assert captured, f"no captured payloads in {FIXTURES}"
    built = [
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [-1, b"\x01" * 32],
                        "parent_block_hash": 3,
                        "token_ids": [[t, t + 1] for t in TOKENS],
                        "block_size": 16,
                        "medium": "CPU",
                        "lora_name": "a",
                        "cache_salt": "s",
                        "group_idx": 0,
                        "kv_cache_spec_kind": "full_attention",
                        "locality": "LOCAL",
                    }
                ],
                2,
            ]
        ),
        enc(
            [
                1.0,
                [
                    [
                        "BlockStored",
                        [5],
                        None,
                        TOKENS[:16],
                        16,
                        None,
                        "GPU",
                        {"cache_salt": "x"},
                        None,
                        0,
                        "mamba",
                        None,
                    ],
                    ["BlockRemoved", [5], "DISK", 1],
                    ["AllBlocksCleared"],
                    ["Unknown", 1],
                ],
            ]
        ),
        enc(
            [
                1.0,
                [
                    {"type": "BlockRemoved", "block_hashes": [1, 2], "locality": "REMOTE"},
                    {"type": "AllBlocksCleared"},
                    {"type": "Other"},
                ],
                0,
                "extra",
            ]
        ),
    ]
    return captured + built


SEEDS = _seeds()


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            b[i % len(b)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # set an interesting byte
            b[i % len(b)] = rng.choice(
                [
                    0x00,
                    0x7F,
                    0x80,
                    0x90,
                    0x9F,
                    0xC0,
                    0xC1,
                    0xC2,
                    0xC3,
                    0xC4,
                    0xCA,
                    0xCB,
                    0xCF,
                    0xD3,
                    0xDC,
                    0xDE,
                    0xFF,
                ]
            )
        elif op == 2:  # insert bytes
            b[i:i] = rng.randbytes(rng.randint(1, 4))
        elif op == 3:  # delete a run
            del b[i : i + rng.randint(1, 8)]
        elif op == 4:  # truncate
            del b[i:]
        elif op == 5 and b:  # duplicate a slice
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randint(1, 16)]
        else:  # splice in a piece of another seed
            other = rng.choice(SEEDS)
            j = rng.randrange(len(other))
            b[i:] = other[j:]
    return bytes(b)


def test_random_bytes_only_ever_decode_or_raise_event_decode_error() -> None:
    rng = random.Random(20260101)
    for _ in range(3000):
        head = rng.choice([b"", b"\x92", b"\x93", b"\x93\xcb", b"\x92\x00\x91", b"\xdc\x00\x03"])
        check(head + rng.randbytes(rng.randint(0, 200)))


def test_mutated_engine_payloads_only_ever_decode_or_raise_event_decode_error() -> None:
    rng = random.Random(7)
    decoded = 0
    for i in range(6000):
        seed = rng.choice(SEEDS) if i % 3 else _batch(rng)
        decoded += check(_mutate(rng, seed)) is not None
    assert decoded > 100  # the mutations also reach the success paths


# --- structure-aware generation --------------------------------------------------------------


def _pick(rng: random.Random, good: list[Any], bad: list[Any], p_bad: float = 0.08) -> Any:
    return rng.choice(bad) if rng.random() < p_bad else rng.choice(good)


_MISSING = object()
BAD_ANY = [1.5, True, "x", b"x", [1], {"k": 1}, None, -3]


def _hash(rng: random.Random) -> Any:
    return _pick(
        rng,
        [0, 1, 2**64 - 1, -1, -(2**63), rng.getrandbits(64), b"\x05" * 32, b"\x01", b"y" * 64],
        [b"", b"z" * 65, 1.0, True, "h", None, [1]],
    )


def _event(rng: random.Random) -> Any:
    tag = _pick(
        rng,
        ["BlockStored", "BlockRemoved", "AllBlocksCleared"],
        ["Future", "", 5, None, b"BlockStored"],
        0.05,
    )
    n = rng.choice([0, 1, 1, 2, 3])
    hashes: Any = [_hash(rng) for _ in range(n)]
    hashes = _pick(rng, [hashes], [None, 5, "h", {"a": 1}], 0.03)
    block_size = _pick(rng, [1, 2, 4], [0, -1, True, 2.0, None, "2"], 0.05)
    size = n * block_size if type(block_size) is int and block_size > 0 else 2
    flat = [rng.choice([0, 1, 255, 65_535, 2**32 - 1, rng.randrange(2**32)]) for _ in range(size)]
    tokens: Any = _pick(
        rng,
        [flat, flat, [[t, t] for t in flat]],
        [
            flat[:-1],
            [*flat, 1],
            [-1, *flat[1:]],
            [True] * size,
            None,
            3,
            [[1, 2, 3]] * size,
            [2**32] * size,
            [1.0] * size,
        ],
        0.08,
    )
    fields = {
        "block_hashes": hashes,
        "parent_block_hash": _pick(rng, [None, None, _hash(rng)], BAD_ANY),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": rng.choice([None, 3, "junk", [1]]),
        "medium": _pick(rng, [None, "GPU", "cpu", "CPU_PINNED", "DISK", "TAPE"], [1, True, b"G"]),
        "lora_name": _pick(rng, [None, None, "adapter"], [1, b"a"]),
        "cache_salt": _pick(rng, [None, None, "salt"], [1, b"s"]),
        "group_idx": _pick(rng, [None, 0, 0, 1], [True, "0", 0.0]),
        "kv_cache_spec_kind": _pick(
            rng, [None, "full_attention", "FullAttentionSpec", "sliding_window", "x"], [1]
        ),
        "locality": _pick(rng, [None, "LOCAL", "REMOTE"], [0, True]),
        "extra_keys": rng.choice([None, [["mm", 1]], 1.5]),
    }
    if rng.random() < 0.6:  # tagged map, a random subset of the keys
        event = {"type": tag} if rng.random() > 0.02 else {}
        for key, value in fields.items():
            if rng.random() < 0.9:
                event[key] = value
        if rng.random() < 0.1:
            event["future_key"] = rng.choice(BAD_ANY)
        return event
    if tag == "BlockStored":
        slot7 = rng.choice([fields["lora_name"], {"cache_salt": fields["cache_salt"]}, None])
        slots = [
            tag,
            hashes,
            fields["parent_block_hash"],
            tokens,
            block_size,
            fields["lora_id"],
            fields["medium"],
            slot7,
            fields["extra_keys"],
            fields["group_idx"],
            fields["kv_cache_spec_kind"],
            None,
            "trailing",
        ]
    elif tag == "BlockRemoved":
        slots = [tag, hashes, fields["medium"], fields["group_idx"], "trailing"]
    else:
        slots = [tag, "trailing"]
    return slots[: rng.randint(1, len(slots))] if rng.random() < 0.3 else slots[: len(slots) - 1]


def _batch(rng: random.Random) -> bytes:
    events = [_event(rng) for _ in range(rng.choice([0, 1, 1, 2, 3, 5]))]
    if rng.random() < 0.05:
        events = _pick(rng, [events], [None, {"e": events}, 5], 1.0)
    ts = _pick(rng, [1767225600.0, 0, 12, 1.5], [True, None, "t", float("nan"), float("inf")])
    dp = _pick(rng, [0, 3, None], [-1, True, "0", 1.0])
    root = [ts, events, dp, "extra"][: rng.choice([2, 3, 3, 3, 4])]
    if rng.random() < 0.02:
        root = root[:1]
    return msgspec.msgpack.encode(root)


def _cases(seed: int, count: int, make: Callable[[random.Random], bytes]) -> Iterator[bytes]:
    rng = random.Random(seed)
    for _ in range(count):
        yield make(rng)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_generated_batches_decode_the_same_on_both_paths_or_fail_whole(seed: int) -> None:
    outcomes = {"failed": 0, "generic": 0, "typed": 0, "events": 0, "ignored": 0}
    for payload in _cases(seed, 4000, _batch):
        got = check(payload)
        if got is None:
            outcomes["failed"] += 1
            continue
        try:
            _decode_typed(payload)
            outcomes["typed"] += 1
        except (msgspec.DecodeError, EventDecodeError):
            outcomes["generic"] += 1
        outcomes["events"] += bool(got.events)
        outcomes["ignored"] += bool(got.ignored)
    # The generator reaches every outcome often enough for the comparison to mean something.
    assert min(outcomes.values()) > 300, outcomes
