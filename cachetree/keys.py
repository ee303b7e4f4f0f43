"""Token ids -> block keys: the one hashing scheme shared by KV events and requests.

key[0] = xxh3_64(block 0's token ids as u32 little-endian, seed=1337)
key[i] = xxh3_64(block i's token ids as u32 little-endian, seed=key[i-1])

A key names a block *and its whole prefix*, so the index can be a flat `key -> node` map and
matching a prompt is one lookup per block. The previous key rides in the seed: one C call per
block and no packing of (parent, child) pairs, about half the cost of hashing each block and
then hashing the pair. key[0] equals Dynamo's content hash of the first block.

Token ids come as any sequence of ints; a bytes-like object (`bytes`, `bytearray`, an
`array("B")`) holds one id per byte, as the `bytes` tokenizer gives them. With the compiled
accelerator (`cachetree.accel`), `block_keys` runs in C, reading the token ids straight from
the list, the u32 array or the bytes; `chain_keys` and `token_bytes` stay the pure twin it
is tested against.

Only full blocks are keyed; a trailing partial block can never be matched by an engine, which
only announces full blocks.

A namespace (LoRA adapter name, cache salt) changes key[0]'s seed, and with it every key of
the chain, so adapters never share cache entries with the base model. Events and requests
call the same `namespace_seed`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Final

from xxhash import xxh3_64_intdigest

from cachetree.accel import speedups

ROOT_SEED: Final = 1337
KEY_SCHEME: Final = "xxh3-chain-1337"
# The largest block size (tokens) taken from a worker or a flag: engines use 1 to 256, and a
# stated 10**30 overflowed the key loop (every request a 500, the fleet's block size taken).
MAX_BLOCK_SIZE: Final = 1 << 16
# LoRA adapter names a replica learns (`router.index`: from its engines' stores and worker
# snapshots, and from a sibling's export, which lists at most this many, `peer.vet`): far more
# than a fleet serves (vLLM's --max-loras is a handful), and a bound on what a hostile stream
# or sibling can make the replica hold.
MAX_ADAPTER_NAMES: Final = 4096
# The longest adapter name taken (characters; `_speedups.c` holds the same figure for the
# ASCII names its decoder reads): an HF repository id or a path is far shorter, and 4,096
# names of this length hold the learned set to ~4 MiB, where a name was bounded only by the
# batch it came in (a few MB each).
MAX_ADAPTER_NAME_CHARS: Final = 1024

if array("I").itemsize != 4 or sys.byteorder != "little":  # pragma: no cover - exotic hosts
    raise ImportError("cachetree.keys needs a little-endian host with a 4-byte array('I')")


def is_adapter_name(name: object) -> bool:
    """Whether `name` may name a LoRA adapter: a string, not empty, at most
    `MAX_ADAPTER_NAME_CHARS` long, without a NUL. The one rule for every source of names
    (events, worker snapshots, a sibling's export: `peer.vet`). A NUL separates a namespace's
    parts (`router.events.namespace_of`: adapter "a" with cache salt "b" is "a\\x00b"), so an
    adapter named "a\\x00b" would share that namespace's blocks."""
    return type(name) is str and 0 < len(name) <= MAX_ADAPTER_NAME_CHARS and "\x00" not in name


def namespace_seed(namespace: str | None) -> int:
    """key[0]'s seed for a namespace; the plain root seed when there is none."""
    if not namespace:
        return ROOT_SEED
    return ROOT_SEED ^ xxh3_64_intdigest(namespace.encode("utf-8"))


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian bytes.

    Raises OverflowError for an id outside [0, 2**32) and TypeError for a non-integer, so a
    caller validating untrusted input gets the check for free.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    if isinstance(token_ids, bytes | bytearray):  # one id per byte; array() would reinterpret
        return array("I", iter(token_ids)).tobytes()
    return array("I", token_ids).tobytes()


def block_keys(token_ids: Sequence[int], block_size: int, seed: int = ROOT_SEED) -> list[int]:
    """Chained keys of every full block of `token_ids`, the first one seeded with `seed`.

    To extend a chain below an existing block, pass that block's key as `seed`. Token ids
    outside [0, 2**32) raise OverflowError, non-integers TypeError (as `token_bytes`).
    """
    return _block_keys(token_ids, block_size, seed)


def block_keys_py(token_ids: Sequence[int], block_size: int, seed: int = ROOT_SEED) -> list[int]:
    """The pure-Python twin of the compiled `block_keys`."""
    return chain_keys(token_bytes(token_ids), block_size * 4, seed)


_block_keys = block_keys_py if speedups is None else speedups.block_keys


def chain_keys(data: bytes, block_bytes: int, seed: int) -> list[int]:
    """Chained keys over `data` already packed as u32-LE, `block_bytes` per block."""
    if block_bytes <= 0:
        raise ValueError("block size must be positive")
    keys: list[int] = []
    append = keys.append
    # Slicing bytes (a 64-byte copy) measured faster than memoryview slices here.
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        seed = xxh3_64_intdigest(data[start : start + block_bytes], seed)
        append(seed)
    return keys
