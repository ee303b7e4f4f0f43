"""Engine block hashes, computed the way the real engines compute them.

The router never trusts these values as keys (it rehashes token ids), but it does keep them as
opaque ids: `parent_block_hash` and `BlockRemoved` speak in engine hashes. So the fake worker
produces the same numbers a real engine would for the same tokens, which lets a test compare
a fake worker's stream with the captured fixtures, and lets a router test catch a decoder that
mangles signedness or byte order.

Both schemes chain a 32-byte sha256 digest from block to block; they differ in what is hashed
and in which 8 bytes go on the wire:

- vLLM (0.29+, default `sha256`, no PYTHONHASHSEED): digest_i = sha256(pickle((parent digest or
  NONE_HASH, tuple(block tokens), extra_keys))); the wire carries the LAST 8 bytes as unsigned.
- SGLang (0.5.6+): digest_i = sha256(digest_{i-1} || block tokens as u32 little-endian), the root
  "parent" being empty; the wire carries the FIRST 8 bytes as a signed int64.

A LoRA adapter's blocks hash apart from the base model's, as in the engines: vLLM adds the
extra key `("lora", name, path)` to every block (the fake's adapters have no files: the path is
the name); SGLang seeds the root's chain with a namespace digest. The SGLang form is only a
likeness (its namespaced wire hashes are derived further, and no fixture pins them here): what
a router depends on, that an adapter's blocks never share an engine hash with the base model's,
holds all the same.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from typing import Final, Protocol

U64_MASK: Final = (1 << 64) - 1
_U32_MAX: Final = (1 << 32) - 1

# vLLM >= 0.29 seeds NONE_HASH with this string for the sha256 algorithms when PYTHONHASHSEED
# is unset (earlier releases drew it from os.urandom, so their hashes changed on every restart).
VLLM_NONE_HASH_SEED: Final = "vllm-none-hash"


def _vllm_sha256(obj: object) -> bytes:
    # vLLM's `sha256` hash_fn: pickle with the highest protocol, then sha256. Pickle of tuples of
    # bytes/ints/None is stable across CPython versions for a fixed protocol.
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


VLLM_NONE_HASH: Final = _vllm_sha256(VLLM_NONE_HASH_SEED)


class EngineHasher(Protocol):
    """One engine's block hash chain."""

    name: str

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], lora_name: str | None = None
    ) -> bytes:
        """The digest of one full block, given its parent's digest (None at the root) and the
        LoRA adapter it was computed under (None: the base model)."""
        ...

    def wire_int(self, digest: bytes) -> int:
        """The integer this engine publishes for a digest."""
        ...


class VllmSha256Hasher:
    """vLLM's default prefix-caching hash (`--prefix-caching-hash-algo sha256`)."""

    name = "vllm-sha256"

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], lora_name: str | None = None
    ) -> bytes:
        # extra_keys: the adapter's on every block, else None (no multimodal input, cache salt
        # or prompt embeds here).
        extra = None if lora_name is None else (("lora", lora_name, lora_name),)
        return _vllm_sha256(
            (parent if parent is not None else VLLM_NONE_HASH, tuple(tokens), extra)
        )

    def wire_int(self, digest: bytes) -> int:
        # maybe_convert_block_hash: int.from_bytes(digest, "big") & (2**64 - 1).
        return int.from_bytes(digest[-8:], "big", signed=False)


class SglangPageHasher:
    """SGLang's page-chain hash (0.5.6 onwards; an adapter's chain as the module says)."""

    name = "sglang-sha256-page"

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], lora_name: str | None = None
    ) -> bytes:
        if parent is not None:
            prefix = parent
        elif lora_name is not None:
            name = lora_name.encode("utf-8")
            prefix = hashlib.sha256(
                b"sglang-cache-namespace-v1" + struct.pack("<I", len(name)) + name
            ).digest()
        else:
            prefix = b""
        if all(0 <= t <= _U32_MAX for t in tokens):
            body = struct.pack(f"<{len(tokens)}I", *tokens)
        else:
            # Pages holding an id beyond u32 are tagged 0xff and packed as u64 words.
            body = b"\xff" + struct.pack(f"<{len(tokens)}Q", *(t & U64_MASK for t in tokens))
        return hashlib.sha256(prefix + body).digest()

    def wire_int(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "big", signed=True)


HASHERS: Final[dict[str, EngineHasher]] = {
    "vllm": VllmSha256Hasher(),
    "sglang": SglangPageHasher(),
}


def chain_digests(hasher: EngineHasher, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Digests of every full block of `token_ids`, chained from the root."""
    digests: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher.block_digest(parent, token_ids[start : start + block_size])
        digests.append(parent)
    return digests


def engine_block_hashes(engine: str, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The integers engine `engine` ("vllm" or "sglang") would publish for these tokens.

    A convenience for tests: e.g. to predict which engine hash a BlockRemoved will name.
    """
    hasher = HASHERS[engine]
    return [hasher.wire_int(d) for d in chain_digests(hasher, token_ids, block_size)]
