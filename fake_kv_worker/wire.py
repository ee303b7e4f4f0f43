"""KV-event payloads, encoded by our own mirror of each engine's msgspec structs.

The fake worker must not borrow the router's decoder types: a router test is only worth
something if the bytes it decodes come from an independent encoder, as they would from a real
engine. So every flavour below re-declares the engine's structs field for field, in declaration
order (which is the wire order), with the same struct options. That is enough for msgspec to
produce the very bytes the engines produce; `tests/unit/test_fake_worker_wire.py` checks this
against the captured fixtures.

Flavours (`--wire`):

| name             | engine release      | events                     | block hash on the wire     |
|------------------|---------------------|----------------------------|----------------------------|
| `vllm`           | vLLM 0.33           | tagged maps (`"type"` key) | u64, low 8 bytes of sha256 |
| `vllm-byteshash` | vLLM 0.33, env      | tagged maps                | the 32-byte digest (`bin`) |
|                  | `..._USE_INT_BLOCK_HASHES=0` |                   |                            |
| `vllm-legacy`    | vLLM 0.23           | positional arrays, 12 long | u64                        |
| `sglang`         | SGLang 0.5.23       | tagged maps, 7 keys        | signed i64                 |
| `sglang-legacy`  | SGLang 0.5.16       | positional arrays, 7 long, | signed i64                 |
|                  |                     | one event per page         |                            |

Two msgspec behaviours the mirrors rely on:
- `omit_defaults` drops defaulted fields from a map but never required ones, so a vLLM
  BlockStored always carries `lora_id`, `medium` and `lora_name`, even when null.
- msgspec ignores `omit_defaults` for `array_like` structs, so positional events always carry
  every field, trailing nulls included. Map structs with more than 15 keys get a map16 header,
  which is why the vLLM BlockStored mirror declares all 15 fields even though we set few.

The engine-neutral `Stored`/`Removed`/`Cleared` below are what the rest of the fake worker
builds; a flavour turns a list of them into one batch payload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from fake_kv_worker.hashing import HASHERS

WireHash = int | bytes

MEDIUM_GPU: Final = "GPU"


# --- engine-neutral events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks newly cached, chained: block i's parent is block i-1, block 0's is `parent`."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]  # every block's tokens, concatenated
    block_size: int
    medium: str = MEDIUM_GPU
    lora_name: str | None = None  # the LoRA adapter they were computed under


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[WireHash]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


# --- vLLM 0.33 (tagged maps; also the byteshash variant) -------------------------------------


class _VllmEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's `KVCacheEvent`: since 0.24 a tagged map, tag field "type" = class name."""


class VllmBlockStored(_VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[object] | None = None
    # The scheduler always sets group_idx (0 for a single KV-cache group), so it is on the wire.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(_VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(_VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


# --- vLLM 0.23 (positional arrays) ----------------------------------------------------------


class _VllmLegacyEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    """vLLM <= 0.23: `array_like`, so the tag is element 0 and every field follows."""


class VllmLegacyBlockStored(_VllmLegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[object] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmLegacyBlockRemoved(_VllmLegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmLegacyAllBlocksCleared(_VllmLegacyEvent, tag="AllBlocksCleared"):
    pass


class VllmLegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmLegacyBlockStored | VllmLegacyBlockRemoved | VllmLegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


# --- SGLang 0.5.23 (tagged maps) ------------------------------------------------------------


class _SglangEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """SGLang >= 0.5.20: tagged map, "the same encoding vLLM uses"."""


class SglangBlockStored(_SglangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # always None in SGLang
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangBlockRemoved(_SglangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangAllBlocksCleared(_SglangEvent, tag="AllBlocksCleared"):
    pass


class SglangEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared]
    attn_dp_rank: int | None = None


# --- SGLang 0.5.16 (positional arrays) ------------------------------------------------------


class _SglangLegacyEvent(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class SglangLegacyBlockStored(_SglangLegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SglangLegacyBlockRemoved(_SglangLegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SglangLegacyAllBlocksCleared(_SglangLegacyEvent, tag="AllBlocksCleared"):
    pass


class SglangLegacyEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[SglangLegacyBlockStored | SglangLegacyBlockRemoved | SglangLegacyAllBlocksCleared]
    attn_dp_rank: int | None = None


_SglangLegacyAny = SglangLegacyBlockStored | SglangLegacyBlockRemoved | SglangLegacyAllBlocksCleared

# --- encoders --------------------------------------------------------------------------------

_encoder: Final = msgspec.msgpack.Encoder()


def _int_hashes(hashes: Sequence[WireHash]) -> list[int]:
    # SGLang structs only know ints; a bytes hash here is a programming error, not input.
    out: list[int] = []
    for h in hashes:
        if not isinstance(h, int):
            raise TypeError(f"SGLang wire hashes are ints, got {type(h).__name__}")
        out.append(h)
    return out


def _int_parent(parent: WireHash | None) -> int | None:
    return None if parent is None else _int_hashes([parent])[0]


BatchEncoder = Callable[[float, Sequence[Event], int], bytes]


@dataclass(frozen=True, slots=True)
class _VllmSchema:
    """The struct types of one vLLM release's wire (they differ only in field layout)."""

    stored: type[VllmBlockStored] | type[VllmLegacyBlockStored]
    removed: type[VllmBlockRemoved] | type[VllmLegacyBlockRemoved]
    cleared: type[VllmAllBlocksCleared] | type[VllmLegacyAllBlocksCleared]
    batch: type[VllmEventBatch] | type[VllmLegacyEventBatch]


def _vllm_encoder(schema: _VllmSchema) -> BatchEncoder:
    def encode(ts: float, events: Sequence[Event], dp_rank: int) -> bytes:
        out: list[Any] = []
        for ev in events:
            if isinstance(ev, Stored):
                out.append(
                    schema.stored(
                        block_hashes=list(ev.block_hashes),
                        parent_block_hash=ev.parent_block_hash,
                        token_ids=ev.token_ids,
                        block_size=ev.block_size,
                        lora_id=None,
                        medium=ev.medium,
                        lora_name=ev.lora_name,
                        group_idx=0,
                    )
                )
            elif isinstance(ev, Removed):
                hashes = list(ev.block_hashes)
                out.append(schema.removed(block_hashes=hashes, medium=ev.medium, group_idx=0))
            else:
                out.append(schema.cleared())
        return _encoder.encode(schema.batch(ts=ts, events=out, data_parallel_rank=dp_rank))

    return encode


encode_vllm = _vllm_encoder(
    _VllmSchema(VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared, VllmEventBatch)
)
encode_vllm_legacy = _vllm_encoder(
    _VllmSchema(
        VllmLegacyBlockStored,
        VllmLegacyBlockRemoved,
        VllmLegacyAllBlocksCleared,
        VllmLegacyEventBatch,
    )
)


def encode_sglang(ts: float, events: Sequence[Event], dp_rank: int) -> bytes:
    out: list[SglangBlockStored | SglangBlockRemoved | SglangAllBlocksCleared] = []
    for ev in events:
        if isinstance(ev, Stored):
            # The 0.5.20+ recorder coalesces consecutive pages of one insertion into one event.
            out.append(
                SglangBlockStored(
                    block_hashes=_int_hashes(ev.block_hashes),
                    parent_block_hash=_int_parent(ev.parent_block_hash),
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=None,
                    medium=ev.medium,
                    lora_name=ev.lora_name,
                )
            )
        elif isinstance(ev, Removed):
            hashes = _int_hashes(ev.block_hashes)
            out.append(SglangBlockRemoved(block_hashes=hashes, medium=ev.medium))
        else:
            out.append(SglangAllBlocksCleared())
    return _encoder.encode(SglangEventBatch(ts=ts, events=out, attn_dp_rank=dp_rank))


def encode_sglang_legacy(ts: float, events: Sequence[Event], dp_rank: int) -> bytes:
    out: list[_SglangLegacyAny] = []
    for ev in events:
        if isinstance(ev, Stored):
            # Before 0.5.20 the recorder emitted one event per page, each naming the page before
            # it as parent; split our multi-block Stored the same way. No `lora_name` before
            # 0.5.22: an adapter's pages go out unnamed, as that release sent them.
            hashes = _int_hashes(ev.block_hashes)
            parent = _int_parent(ev.parent_block_hash)
            for i, h in enumerate(hashes):
                tokens = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                out.append(
                    SglangLegacyBlockStored(
                        block_hashes=[h],
                        parent_block_hash=parent,
                        token_ids=tokens,
                        block_size=ev.block_size,
                        lora_id=None,
                        medium=ev.medium,
                    )
                )
                parent = h
        elif isinstance(ev, Removed):
            hashes = _int_hashes(ev.block_hashes)
            out.append(SglangLegacyBlockRemoved(block_hashes=hashes, medium=ev.medium))
        else:
            out.append(SglangLegacyAllBlocksCleared())
    return _encoder.encode(SglangLegacyEventBatch(ts=ts, events=out, attn_dp_rank=dp_rank))


# --- flavours --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireFlavour:
    """One engine release's wire: which hash chain it uses, how hashes and batches are written."""

    name: str
    engine: Literal["vllm", "sglang"]  # the hash family, and the default `--engine`
    hash_form: Literal["int", "bytes"]
    encode_batch: BatchEncoder

    def wire_hash(self, digest: bytes) -> WireHash:
        if self.hash_form == "bytes":
            return digest
        return HASHERS[self.engine].wire_int(digest)


WIRE_FLAVOURS: Final[dict[str, WireFlavour]] = {
    f.name: f
    for f in (
        WireFlavour("vllm", "vllm", "int", encode_vllm),
        WireFlavour("vllm-byteshash", "vllm", "bytes", encode_vllm),
        WireFlavour("vllm-legacy", "vllm", "int", encode_vllm_legacy),
        WireFlavour("sglang", "sglang", "int", encode_sglang),
        WireFlavour("sglang-legacy", "sglang", "int", encode_sglang_legacy),
    )
}


def normalize_hash(value: WireHash) -> int:
    """A wire hash as the u64 a router normalizes it to (bytes: last 8, big-endian)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & ((1 << 64) - 1)
