"""Engine KV-event decoder: every batch shape in the field, normalized to one internal form.

Rules of this file: it turns one ZMQ payload (the msgpack frame after topic and seq) into one
`EventBatch`, or raises `EventDecodeError` and nothing else. It does no I/O, keeps no state
between calls and knows nothing about ranks, keys or the tree. After it, nothing in the router
knows which engine or version sent a batch.

Theory of operation
-------------------
What arrives (reference-engine-wire.md sections 1.2, 1.3, 2.2, 2.3):

- The batch is a msgpack array `[ts, events]` (vLLM 0.9) or `[ts, events, dp_rank]` (every
  later vLLM, every SGLang). Elements past the third are ignored.
- An event is a tagged map with a `"type"` key (vLLM >= 0.24, SGLang >= 0.5.20) or a positional
  array whose first element is the tag (older releases). The tags are `BlockStored`,
  `BlockRemoved` and `AllBlocksCleared`. Positional layouts (msgspec writes every slot of an
  array-like struct, trailing nulls included; older releases simply have fewer slots):
    BlockStored   [tag, block_hashes, parent, token_ids, block_size, lora_id, medium,
                   lora_name | {"cache_salt": s}, extra_keys, group_idx, kv_cache_spec_kind, ...]
    BlockRemoved  [tag, block_hashes, medium, group_idx, ...]
  The first five BlockStored slots and the first two BlockRemoved slots are required; any
  longer prefix is accepted and elements past the known ones are ignored. Slot 7 is vLLM's
  `lora_name` (0.14+) or the metadata map SGLang 0.5.18-0.5.19 appends when a request has a
  cache salt (`BlockStoredWithMetadata`); the two are told apart by type.
- A block hash is a signed int64 (SGLang), an unsigned uint64 (vLLM) or `bin` bytes (vLLM with
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). All become u64: a negative int by two's complement,
  bytes by their last 8 bytes big-endian, which is exactly the int vLLM sends for the same
  digest (and what llm-d and smg do). The hash is only an opaque id for parents and removals.
- `token_ids` is flat (len == n_blocks * block_size) or, in SGLang's EAGLE bigram mode, a list
  of pairs `[t_i, t_(i+1)]`. Pairs are normalized to their first element, the token at that
  position, so `BlockStored.token_ids` is always the flat token list the router keys on; the
  pair count is what must equal n_blocks * block_size. The second elements are validated as
  tokens but not checked against the next pair.

What comes out: `BlockStored` / `BlockRemoved` / `AllBlocksCleared` in wire order, plus
`EventBatch.ignored`, a count per reason (`IGNORE_REASONS`) of events that were valid but are
not for the index:

- `non_primary_group`: `group_idx` set and not 0, or a `kv_cache_spec_kind` that is not full
  attention. Full, MLA and sink-full attention in any spelling ("full_attention",
  "FullAttentionSpec", ...), or no kind at all, are primary. Every other kind is not, including
  "unknown" and kinds this file has never seen: a sliding-window, Mamba, chunked-local, cross
  or encoder group caching a block does not mean the prompt prefix is reusable, and indexing
  it would promise hits the engine cannot deliver. Only group 0 counts: the decoder keeps no
  state, so it cannot learn that some other group is the full-attention one.
- `remote`: `locality` set and not "LOCAL", in any case (vLLM 0.26+ also reports blocks held
  elsewhere).
- `empty`: a BlockStored or BlockRemoved with zero hashes, validated and then dropped, so the
  tree never sees a no-op event.
- `unknown_type`: an event whose tag is a string this file does not know. Tolerated, because an
  engine that adds an event type must not stop the router indexing the types it knows; the
  count makes the new type visible. Only its tag can be checked. It leaves the rest of its
  batch to the fast paths (below).
A valid event is counted once, under the first of these reasons that applies.

Tolerant where the wire has variants in the field: shapes, hash and token encodings, unknown
keys, trailing elements, unknown tags, unknown media. Strict everywhere else. Anything
malformed anywhere fails the WHOLE batch, and no half-decoded batch is ever returned: bad
msgpack, a field of the wrong type (a bool is not an int here), a token outside [0, 2**32),
a token count that does not match, a non-finite ts, a negative dp_rank, or an event over a
cap. Ignored events are validated like any other before they are dropped. Fields the router
does not read (`lora_id`, `extra_keys`, `ownership`, `session_id`, ...) are not validated. The
caps (65,536 hashes and 1,048,576 tokens per event) bound the work one event can cause in the
key and tree code. The reasons are the labels in `DECODE_ERROR_REASONS`.

`medium` maps to a tier bit via `cachetree.tiers` (absent means device), and the raw string is
kept. A BlockStored on an unknown medium gets tier 0 (the tree drops and counts it). A
BlockRemoved with no medium, or an unknown one, gets tier None: remove from every tier.

`lora_name` and SGLang's `cache_salt` become `BlockStored.namespace` via `namespace_of`, which
the request path must use too. A `lora_name` no adapter may have (empty, or holding the NUL
that separates a namespace's parts: `cachetree.keys.is_adapter_name`) fails the batch as
`bad_event`: its blocks would share another adapter's salted namespace. vLLM writes its cache
salt only into the untagged `extra_keys` of a request's first block, where it cannot be told
apart from other extra keys, so that is not read. Neither is the deprecated numeric
`lora_id`: requests name adapters, not ids.

How it is fast: an engine sends one shape per batch, so a sniff of the first event's msgpack
type byte picks the typed msgspec decoder for tagged maps or for positional arrays; if that one
refuses the batch, its twin for bigram token pairs (SGLang with EAGLE sends them in every
event) gets one try. msgspec then checks every type, range and cap in C while it decodes, and
the Python loop only normalizes hashes and builds the output. With the compiled accelerator
(`cachetree.accel`), a batch of map events is first offered to `_speedups.decode_map_batch`,
which reads the batch itself and builds the two events a busy engine sends (the one-block
removals an evicting engine sends by the dozen, and a BlockStored of the usual shape: flat
token ids, no salt, primary group, local) straight from the bytes; the other events go one at
a time through the typed decoders; anything unusual about the batch returns None and the
paths above take it whole. With `fold_removals` (the subscriber's decode), consecutive
one-block removals of one medium come out as one `RemovedRun`, which the index removes as one
run anyway: the compiled reader appends each hash to the open run instead of building an event
per block (half a churn batch's decode), and the other paths fold what they decoded
(`fold_removal_runs`, the twin). The typed decoders then
leave `token_ids` undecoded (`msgspec.Raw`) and `_speedups.parse_tokens` reads the ids, flat
or bigram pairs, straight into a `TokenIds` u32 array, with the same checks and without a
Python int per token. `TokenIds` compares equal to the list of the same ids, so a batch
decodes to equal events on every path. The events the compiled reader does not build go to
`_decode_event` with their index in the batch: the typed decoders of their shape, and where
those refuse, the generic path's reading of that one event, which names an error as the
generic path names it for the batch. Elsewhere a batch the typed decoders refuse is read for
its events' tags, and one holding events of an unknown type is decoded again by the fast paths
without them (`_decode_without_unknown`). Whatever else they refuse (mixed shapes, any
malformation) is read one event at a time (`_decode_each`), each by `_decode_event`: so no
batch, however malformed, has the generic path build all its events in Python (60,000
one-block stores and one malformed event held the loop 0.5-1.9 s there; now 1-3 times what
the batch without it costs). The generic path is the reference: a plain msgpack decode followed
by explicit Python checks. It accepts everything the typed path accepts, with the same
result, and it alone chooses the error reason and detail, so neither depends on which path
ran. The differences: a string the decoder never reads (an unknown key, an ignored field,
anything after the first bad event) is skipped by the other paths without a UTF-8 check,
which the generic path would refuse (`malformed_msgpack`, ahead of any event's error); and
an event whose msgpack the batch's framing passed over but which does not decode (a map key
that is a map) is `malformed_msgpack` on every path, named by its index with the byte offset
counted in its own bytes where the event is read alone, in the payload's by the generic path.
Engines encode Python strings, so only corruption produces that, and no decoder catches
corruption in general: a flipped bit in a token id is still valid msgpack. The tests fuzz
the paths against each other.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter
from typing import Annotated, Any, ClassVar, Final, Union

import msgspec
from msgspec import Meta, Raw, Struct

from cachetree.accel import speedups
from cachetree.keys import is_adapter_name
from cachetree.tiers import tier_of_medium

MAX_HASHES_PER_EVENT: Final = 65_536
MAX_TOKENS_PER_EVENT: Final = 1_048_576
MAX_HASH_BYTES: Final = 64  # longest digest an engine sends as `bin` (sha512); 32 in practice

# Labels for metrics: every `EventDecodeError.reason` and every `EventBatch.ignored` key.
DECODE_ERROR_REASONS: Final = frozenset(
    {
        "malformed_msgpack",  # not one well-formed msgpack object
        "not_a_batch",  # root is not [ts, events, ...], or events is not an array
        "bad_ts",  # ts not an int or float, or not finite
        "bad_dp_rank",  # dp_rank not null or an int >= 0
        "bad_event",  # event not a map/array, no string tag, missing or mistyped field
        "bad_hash",  # block hash not an int64/uint64 or 1..64 bytes
        "bad_tokens",  # token not an int in [0, 2**32), bad pair, or count != hashes * block_size
        "bad_block_size",  # block_size not an int >= 1
        "over_cap",  # more than MAX_HASHES_PER_EVENT hashes or MAX_TOKENS_PER_EVENT tokens
    }
)
IGNORE_REASONS: Final = frozenset({"non_primary_group", "remote", "empty", "unknown_type"})

_U64_MASK: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_TOKEN_LIMIT: Final = 1 << 32
_from_bytes: Final = int.from_bytes
_PRIMARY_KINDS: Final = frozenset({"fullattention", "mlaattention", "sinkfullattention"})
# Exact spellings engines send, looked up before `tier_of_medium`'s case-folding.
_TIER_BY_MEDIUM: Final[dict[str | None, int]] = {
    m: tier_of_medium(m) for m in (None, "GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL")
}
# What a BlockRemoved on those media clears, as `_removed` computes it (None: every tier).
_REMOVAL_TIER: Final[dict[str | None, int | None]] = {
    m: None if m is None else tier or None for m, tier in _TIER_BY_MEDIUM.items()
}


class EventDecodeError(ValueError):
    """A batch that cannot be applied whole. `reason` is a short stable label for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TokenIds(array):  # type: ignore[type-arg]
    """Token ids packed as u32 (`array("I")`), as the compiled decoder produces them.

    Equal to a list or tuple of the same ids, so an event compares equal whichever decoder
    made it; `cachetree.keys` hashes it without unpacking.
    """

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list | tuple):
            return len(self) == len(other) and self.tolist() == list(other)
        return array.__eq__(self, other)  # type: ignore[no-any-return]

    __hash__ = None  # type: ignore[assignment]


# The normalized events are msgspec Structs rather than dataclasses: one is built per event on
# the ingest hot path (dozens per batch when an engine evicts), and msgspec builds them in C,
# about 3x faster than a slots dataclass's __init__. gc=False: they hold no cycles.
class BlockStored(Struct, gc=False):
    engine_hashes: list[int]  # normalized to u64
    parent_engine_hash: int | None  # normalized to u64
    # Flat, len == len(engine_hashes) * block_size: a list, or TokenIds from the compiled path.
    token_ids: Sequence[int]
    block_size: int
    tier: int  # cachetree.tiers bit; 0 = unknown medium (the tree drops and counts it)
    medium: str | None
    namespace: str | None  # lora_name / cache_salt, mixed into key[0]'s seed
    # Set by an ingest process (router.ingest): the blocks' chained keys, computed from
    # `seed`, the parent's key as that process knew it (the namespace seed for a root). The
    # pump uses them only if the tree's parent key is that seed; otherwise it keys the tokens.
    keys: list[int] | None = None
    seed: int | None = None


class BlockRemoved(Struct, gc=False):
    engine_hashes: list[int]
    tier: int | None  # None = every tier (no medium, or an unknown one)
    medium: str | None


class AllBlocksCleared(Struct, gc=False):
    pass


class RemovedRun(Struct, gc=False):
    """Consecutive one-block `BlockRemoved` events of one medium, folded into one
    (`decode_batch(..., fold_removals=True)`): an engine evicting under pressure sends one
    event per block, dozens a batch, and the index removes them as one run anyway. Each of
    `engine_hashes` was one event."""

    engine_hashes: list[int]
    tier: int | None
    medium: str | None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | RemovedRun


class EventBatch(Struct, gc=False):
    ts: float
    events: list[KVEvent]
    dp_rank: int | None
    ignored: dict[str, int] = msgspec.field(default_factory=dict)  # reason -> events skipped


def namespace_of(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The key namespace for a LoRA adapter name and a cache salt; None when neither is set.

    The one definition shared by the event path and the request path. A NUL separates the parts,
    so an adapter named "a" and a salt "a" stay apart: "a", "\\x00a", "a\\x00b".
    """
    if cache_salt is None:
        return lora_name
    return f"{lora_name or ''}\x00{cache_salt}"


def decode_batch(payload: bytes, *, fold_removals: bool = False) -> EventBatch:
    """Decode one engine payload; raise `EventDecodeError` (only) if any part of it is bad.

    `payload` is the third ZMQ frame as bytes (a bytearray or memoryview works too). With
    `fold_removals`, runs of one-block removals come as `RemovedRun`s (`fold_removal_runs`):
    the compiled decoder builds no event per block then.
    """
    batch = _decode_fast(payload, fold_removals)
    if batch is None:
        batch = _decode_without_unknown(payload, fold_removals)
    if batch is None:
        # Anything unusual or wrong: one event at a time, each the typed decoders do not take
        # read by the generic path, which names the reason.
        batch = _decode_each(payload)
        if fold_removals:
            batch.events = fold_removal_runs(batch.events)
    return batch


def _decode_fast(payload: bytes, fold_removals: bool) -> EventBatch | None:
    """The compiled reader, then the typed path; None when they do not take the batch.

    Raises `EventDecodeError` only where `_decode_each` would raise the same: the compiled
    reader hands the events it does not build to `_decode_event`, which names the first
    malformed one, and the rest of the batch is read as `_decode_each` reads it first.
    """
    if speedups is not None:
        run_type = RemovedRun if fold_removals else None
        try:
            batch = speedups.decode_map_batch(payload, _MAP_BATCH_SPEC, _decode_event, run_type)
        except EventDecodeError:
            try:
                _RAW_EVENTS.decode(payload)  # the root, dp_rank included, read before events
            except _REFUSED:
                return None
            raise
        if batch is not None:
            return batch  # type: ignore[no-any-return]
    try:
        batch = _decode_typed(payload)
    except _REFUSED:
        return None
    if fold_removals:
        batch.events = fold_removal_runs(batch.events)
    return batch


def _decode_without_unknown(payload: bytes, fold_removals: bool) -> EventBatch | None:
    """A batch the fast paths refused whole, read by them again without its events of a type
    this file does not know (counted as `unknown_type`); None when it has none, or when they
    refuse the rest too (mixed shapes, any malformation).

    The compiled reader takes such events in its stride; the typed decoders refuse the batch
    at the first, and reading it again without them costs about what `_decode_each` would,
    and less where one-block removals, which the typed path normalizes in C, are many. So
    such a batch costs them two passes: one would need msgspec's tagged unions to pass over a
    tag they do not know, which they cannot, or every batch read one event at a time, which
    made ordinary batches 25-60% slower. Only the tag of an unknown event is read, and must be
    a string, as the generic path checks it."""
    try:
        tagged = (_ARRAY_TAGS if _first_event_is_array(payload) else _MAP_TAGS).decode(payload)
    except _REFUSED:
        return None
    known = [event.tag in _KNOWN_TAGS for event in tagged.events]
    unknown = known.count(False)
    if not unknown:
        return None
    events = _RAW_EVENTS.decode(payload).events
    rest = _ENCODER.encode([tagged.ts, list(compress(events, known)), tagged.dp_rank])
    try:
        batch = _decode_fast(rest, fold_removals)
    except EventDecodeError:  # named for an event of `rest`: `_decode_each` names it anew
        return None
    if batch is not None:
        batch.ignored["unknown_type"] = batch.ignored.get("unknown_type", 0) + unknown
    return batch


def _decode_each(payload: bytes) -> EventBatch:
    """A batch the fast paths do not take, read one event at a time (`_decode_event`): what
    the generic path returns for it, or the error it raises, at about the typed path's cost.

    The generic path builds every event in Python: a batch of 60,000 one-block stores with
    one malformed event held the loop 0.5-1.9 s there. Here it reads only the events the
    typed decoders do not take, and nothing after the first malformed one is read but its
    msgpack framing: so the error is that event's even where a later string is not UTF-8,
    which the generic path, decoding the whole payload first, names `malformed_msgpack`. A
    root that is not `[ts, events, dp_rank?]` is left to the generic path to name.
    """
    try:
        root = _RAW_EVENTS.decode(payload)
    except _REFUSED:
        return _decode_generic(payload)
    ts = root.ts
    if not math.isfinite(ts):
        raise EventDecodeError("bad_ts", f"ts is {_describe(ts)}")
    out: list[KVEvent] = []
    ignored: dict[str, int] = {}
    for index, span in enumerate(root.events):
        result = _decode_event(span, index)
        if type(result) is str:
            ignored[result] = ignored.get(result, 0) + 1
        else:
            out.append(result)  # type: ignore[arg-type]
    return EventBatch(float(ts), out, root.dp_rank, ignored)


def fold_removal_runs(events: list[KVEvent]) -> list[KVEvent]:
    """`events` with each run of consecutive one-block `BlockRemoved`s of one medium (and so
    one tier) as one `RemovedRun`, a lone one included; the rest unchanged, in order. The
    compiled decoder folds the same way as it decodes."""
    out: list[KVEvent] = []
    run: RemovedRun | None = None
    for event in events:
        if type(event) is BlockRemoved and len(event.engine_hashes) == 1:
            if run is not None and run.medium == event.medium and run.tier == event.tier:
                run.engine_hashes.append(event.engine_hashes[0])
                continue
            run = RemovedRun([event.engine_hashes[0]], event.tier, event.medium)
            out.append(run)
        else:
            run = None
            out.append(event)
    return out


# --- shared normalization (both paths; inputs already type-checked) --------------------------


def _u64_list(hashes: list[Any]) -> list[int]:
    """Hashes as u64 (`hashes` is non-empty, every element an int64/uint64 or 1..64 bytes)."""
    if type(hashes[0]) is int:
        try:
            if min(hashes) >= 0:  # all unsigned: already normalized, keep the list
                return hashes
            return [h & _U64_MASK for h in hashes]
        except TypeError:  # ints mixed with bytes
            pass
    return [h & _U64_MASK if type(h) is int else _from_bytes(h[-8:], "big") for h in hashes]


def _u64(h: int | bytes) -> int:
    return h & _U64_MASK if isinstance(h, int) else _from_bytes(h[-8:], "big")


def _tier(medium: str | None) -> int:
    tier = _TIER_BY_MEDIUM.get(medium)
    return tier_of_medium(medium) if tier is None else tier


def _is_primary_kind(kind: str) -> bool:
    if kind == "full_attention":
        return True
    norm = kind.lower().replace("_", "").replace("-", "").replace(" ", "")
    return norm.removesuffix("spec") in _PRIMARY_KINDS


def _stored(
    hashes: list[Any],
    parent: int | bytes | None,
    tokens: Sequence[int],
    block_size: int,
    medium: str | None,
    lora_name: str | None,
    cache_salt: str | None,
    group_idx: int | None,
    kind: str | None,
    locality: str | None,
) -> BlockStored | str:
    """A BlockStored, or the reason it is ignored. Raises for a token count mismatch and for a
    `lora_name` no adapter may have (`is_adapter_name`)."""
    n = len(hashes)
    if len(tokens) != n * block_size:
        raise EventDecodeError("bad_tokens", f"{len(tokens)} tokens for {n} blocks of {block_size}")
    if lora_name is not None and not is_adapter_name(lora_name):
        raise EventDecodeError(
            "bad_event", f"lora_name {lora_name[:64]!r} is not an adapter name (empty, or a NUL)"
        )
    if n == 0:
        return "empty"
    if group_idx or (kind is not None and not _is_primary_kind(kind)):  # group_idx: int | None
        return "non_primary_group"
    if locality is not None and locality.upper() != "LOCAL":
        return "remote"
    # The common cases are inlined: while decoding, vLLM sends one event per newly full block.
    first = hashes[0]
    u64 = hashes if n == 1 and type(first) is int and first >= 0 else _u64_list(hashes)
    tier = _TIER_BY_MEDIUM.get(medium)
    return BlockStored(
        u64,
        None if parent is None else _u64(parent),
        tokens,
        block_size,
        tier_of_medium(medium) if tier is None else tier,
        medium,
        lora_name if cache_salt is None else namespace_of(lora_name, cache_salt),
    )


def _removed(
    hashes: list[Any], medium: str | None, group_idx: int | None, locality: str | None
) -> BlockRemoved | str:
    """A BlockRemoved, or the reason it is ignored."""
    if not hashes:
        return "empty"
    if group_idx:
        return "non_primary_group"
    if locality is not None and locality.upper() != "LOCAL":
        return "remote"
    first = hashes[0]
    u64 = hashes if len(hashes) == 1 and type(first) is int and first >= 0 else _u64_list(hashes)
    tier = None if medium is None else _tier(medium) or None  # unknown medium: every tier
    return BlockRemoved(u64, tier, medium)


# --- typed path: msgspec validates while it decodes ------------------------------------------
#
# Mirrors of the engines' structs, typed so that msgspec refuses in C whatever the generic path
# would refuse. Each event struct normalizes itself; the bigram variants differ only in the
# type of `token_ids` and flatten it first.

_Token = Annotated[int, Meta(ge=0, lt=_TOKEN_LIMIT)]
_Hash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
_Hashes = Annotated[list[_Hash], Meta(max_length=MAX_HASHES_PER_EVENT)]
_Tokens = Annotated[list[_Token], Meta(max_length=MAX_TOKENS_PER_EVENT)]
_Bigrams = Annotated[list[tuple[_Token, _Token]], Meta(max_length=MAX_TOKENS_PER_EVENT)]
_BlockSize = Annotated[int, Meta(ge=1)]
_NULL: Final = Raw(b"\xc0")  # an ignored positional slot, left undecoded
_first: Final = itemgetter(0)


class _MapStored(Struct, tag_field="type", tag="BlockStored", kw_only=True, gc=False):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None = None
    token_ids: _Tokens
    block_size: _BlockSize
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None

    def normalize(self) -> BlockStored | str:
        return _stored(
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.medium,
            self.lora_name,
            self.cache_salt,
            self.group_idx,
            self.kv_cache_spec_kind,
            self.locality,
        )


class _MapStoredBigram(_MapStored):
    token_ids: _Bigrams  # type: ignore[assignment]

    def normalize(self) -> BlockStored | str:
        self.token_ids = list(map(_first, self.token_ids))
        return _MapStored.normalize(self)


class _MapStoredPacked(_MapStored):
    token_ids: Raw  # type: ignore[assignment]  # parsed in C by normalize

    def normalize(self) -> BlockStored | str:
        self.token_ids = _packed_tokens(self.token_ids, False)
        return _MapStored.normalize(self)


class _MapStoredPackedBigram(_MapStored):
    token_ids: Raw  # type: ignore[assignment]

    def normalize(self) -> BlockStored | str:
        self.token_ids = _packed_tokens(self.token_ids, True)
        return _MapStored.normalize(self)


class _MapRemoved(Struct, tag_field="type", tag="BlockRemoved", kw_only=True, gc=False):
    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None

    def normalize(self) -> BlockRemoved | str:
        return _removed(self.block_hashes, self.medium, self.group_idx, self.locality)


class _MapCleared(Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    def normalize(self) -> AllBlocksCleared:
        return AllBlocksCleared()


class _SaltMetadata(Struct, gc=False):
    cache_salt: str | None = None


class _ArrayStored(Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None
    token_ids: _Tokens
    block_size: _BlockSize
    lora_id: Raw = _NULL
    medium: str | None = None
    lora_name_or_metadata: str | _SaltMetadata | None = None
    extra_keys: Raw = _NULL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None

    def normalize(self) -> BlockStored | str:
        meta = self.lora_name_or_metadata
        return _stored(
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.medium,
            meta if type(meta) is str else None,
            meta.cache_salt if type(meta) is _SaltMetadata else None,
            self.group_idx,
            self.kv_cache_spec_kind,
            None,
        )


class _ArrayStoredBigram(_ArrayStored):
    token_ids: _Bigrams  # type: ignore[assignment]

    def normalize(self) -> BlockStored | str:
        self.token_ids = list(map(_first, self.token_ids))
        return _ArrayStored.normalize(self)


class _ArrayStoredPacked(_ArrayStored):
    token_ids: Raw  # type: ignore[assignment]

    def normalize(self) -> BlockStored | str:
        self.token_ids = _packed_tokens(self.token_ids, False)
        return _ArrayStored.normalize(self)


class _ArrayStoredPackedBigram(_ArrayStored):
    token_ids: Raw  # type: ignore[assignment]

    def normalize(self) -> BlockStored | str:
        self.token_ids = _packed_tokens(self.token_ids, True)
        return _ArrayStored.normalize(self)


# What `_speedups.decode_map_batch` builds events with, and the caps it keeps.
_MAP_BATCH_SPEC: Final = (
    _REMOVAL_TIER,
    _TIER_BY_MEDIUM,
    BlockRemoved,
    BlockStored,
    TokenIds,
    EventBatch,
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_EVENT,
    MAX_HASH_BYTES,
)


def _packed_tokens(raw: Raw, pairs: bool) -> TokenIds:
    """Token ids (bigram pairs if `pairs`) as u32, checked as msgspec checks `_Tokens`.

    A refusal is a ValidationError, as msgspec's would be: the batch is tried with the other
    token shape, then by the generic path, which names the reason.
    """
    assert speedups is not None
    try:
        return TokenIds("I", speedups.parse_tokens(raw, MAX_TOKENS_PER_EVENT, pairs))
    except ValueError as exc:
        raise msgspec.ValidationError(str(exc)) from None


class _ArrayRemoved(Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None
    locality: ClassVar[None] = None  # positional releases have no such slot

    def normalize(self) -> BlockRemoved | str:
        return _removed(self.block_hashes, self.medium, self.group_idx, None)


class _ArrayCleared(Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    def normalize(self) -> AllBlocksCleared:
        return AllBlocksCleared()


def _batch_decoder(*event_types: type) -> msgspec.msgpack.Decoder[Any]:
    """A decoder for `[ts, [event, ...], dp_rank?, ...]` whose events are one of `event_types`."""
    batch = msgspec.defstruct(
        "Batch",
        [
            ("ts", float),
            ("events", list[Union[event_types]]),  # type: ignore[valid-type]  # noqa: UP007
            ("dp_rank", Annotated[int, Meta(ge=0)] | None, None),
        ],
        array_like=True,
        gc=False,
    )
    return msgspec.msgpack.Decoder(batch)


# The event types of map events and of positional ones, with flat and with bigram token ids;
# with the compiled accelerator, their twins whose token ids `parse_tokens` reads.
_MAP_EVENTS: Final = (
    ((_MapStored, _MapRemoved, _MapCleared), (_MapStoredBigram, _MapRemoved, _MapCleared))
    if speedups is None
    else (
        (_MapStoredPacked, _MapRemoved, _MapCleared),
        (_MapStoredPackedBigram, _MapRemoved, _MapCleared),
    )
)
_POSITIONAL_EVENTS: Final = (
    (
        (_ArrayStored, _ArrayRemoved, _ArrayCleared),
        (_ArrayStoredBigram, _ArrayRemoved, _ArrayCleared),
    )
    if speedups is None
    else (
        (_ArrayStoredPacked, _ArrayRemoved, _ArrayCleared),
        (_ArrayStoredPackedBigram, _ArrayRemoved, _ArrayCleared),
    )
)
# (flat tokens, bigram tokens) decoders of whole batches, and of one event at a time.
_MAP_DECODERS: Final = tuple(_batch_decoder(*types) for types in _MAP_EVENTS)
_POSITIONAL_DECODERS: Final = tuple(_batch_decoder(*types) for types in _POSITIONAL_EVENTS)
_MAP_EVENT_DECODERS: Final = tuple(
    msgspec.msgpack.Decoder(Union[types])  # type: ignore[valid-type]  # noqa: UP007
    for types in _MAP_EVENTS
)
_POSITIONAL_EVENT_DECODERS: Final = tuple(
    msgspec.msgpack.Decoder(Union[types])  # type: ignore[valid-type]  # noqa: UP007
    for types in _POSITIONAL_EVENTS
)


class _MapTag(Struct, gc=False):
    tag: str = msgspec.field(name="type")


class _ArrayTag(Struct, array_like=True, gc=False):
    tag: str


# A batch's event tags, of map events or of positional ones; and its events left undecoded.
_MAP_TAGS: Final = _batch_decoder(_MapTag)
_ARRAY_TAGS: Final = _batch_decoder(_ArrayTag)
_RAW_EVENTS: Final = _batch_decoder(Raw)
# The tags the typed decoders take, as their event types declare them.
_KNOWN_TAGS: Final = frozenset(
    event.__struct_config__.tag
    for event in (_MapStored, _MapRemoved, _MapCleared, _ArrayStored, _ArrayRemoved, _ArrayCleared)
)
_ENCODER: Final = msgspec.msgpack.Encoder()


def _decode_event(span: bytes | Raw, index: int) -> KVEvent | str:
    """The bytes of a batch's `index`th event as a normalized event, or the reason it is
    ignored: read by the typed decoders of its shape (flat token ids, then bigram pairs), or
    where they refuse it (a type this file does not know, a malformation) as the generic path
    reads it. Raises `EventDecodeError` only, naming the event as the generic path does.
    `_speedups.decode_map_batch` hands it the events it does not build."""
    b = memoryview(span)[0]
    positional = 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD
    try:
        for decoder in _POSITIONAL_EVENT_DECODERS if positional else _MAP_EVENT_DECODERS:
            try:
                return decoder.decode(span).normalize()  # type: ignore[no-any-return]
            except (msgspec.DecodeError, RecursionError):
                pass
        return _generic_event(_GENERIC_DECODER.decode(span))
    except EventDecodeError as exc:
        raise EventDecodeError(exc.reason, f"event {index}: {exc.detail}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        # Read alone, its bytes are counted from its start: named, the offset is not taken
        # for the payload's (the generic path, decoding the payload whole, counts from there).
        raise EventDecodeError(
            "malformed_msgpack", f"event {index} (its own bytes): {exc}"
        ) from None


def _first_event_is_array(p: bytes) -> bool:
    """Whether the first event looks positional, read from the first bytes; False when unsure.

    Only a guess to pick the typed decoder: a wrong guess costs a second decode, never a
    wrong result. Reads what engines send: a fixarray root, a float64/float32/fixint ts, and a
    fixarray/array16/array32 of events.
    """
    n = len(p)
    if n > 11 and p[1] == 0xCB and 0x91 <= p[10] <= 0x9F:  # what every engine sends
        return 0x90 <= p[11] <= 0x9F or p[11] == 0xDC
    if n < 4 or not 0x92 <= p[0] <= 0x9F:
        return False
    b = p[1]
    i = 10 if b == 0xCB else 6 if b == 0xCA else 2 if b < 0x80 else n
    if i >= n:
        return False
    b = p[i]
    i += 1 if 0x91 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else n
    if i >= n:
        return False
    b = p[i]
    return 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD


def _decode_typed(payload: bytes) -> EventBatch:
    """The fast path. Raises msgspec errors or EventDecodeError on anything it does not take."""
    flat, bigram = _POSITIONAL_DECODERS if _first_event_is_array(payload) else _MAP_DECODERS
    # SGLang with EAGLE sends token pairs in every event, which the bigram twin reads. With the
    # compiled accelerator the twins differ only in how `normalize` reads the token ids: a
    # batch one refuses while decoding it (an event of a type this file does not know, say)
    # the other refuses at the same event, after as long; and the other takes no batch whose
    # first stored event's token ids are not pairs (a malformed token later, say).
    try:
        batch = flat.decode(payload)
    except msgspec.ValidationError:
        if speedups is not None:
            raise
        return _normalized(bigram.decode(payload))
    try:
        return _normalized(batch)
    except msgspec.ValidationError:  # packed token ids: pairs, or malformed
        if not _first_tokens_are_pairs(batch.events):
            raise
        return _normalized(bigram.decode(payload))


def _first_tokens_are_pairs(events: list[Any]) -> bool:
    """Whether the token ids of the first typed event that has them start with an array: they
    are still `msgspec.Raw` there unless `normalize` read them (as flat ids) already."""
    for event in events:
        tokens = getattr(event, "token_ids", None)
        if tokens is not None:
            if type(tokens) is not Raw:
                return False
            raw = memoryview(tokens)
            b = raw[0]
            first = 1 if 0x90 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else len(raw)
            if first >= len(raw):
                return False
            b = raw[first]
            return 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD
    return False


def _normalized(batch: Any) -> EventBatch:
    ts = batch.ts
    if not math.isfinite(ts):
        raise EventDecodeError("bad_ts", f"ts is {ts}")
    out, ignored = _normalize_events(batch.events)
    return EventBatch(float(ts), out, batch.dp_rank, ignored)


def _normalize_events_py(events: list[Any]) -> tuple[list[KVEvent], dict[str, int]]:
    """The typed events as `KVEvent`s in order, and the ignored ones counted by reason.

    The compiled twin is `_speedups.normalize_events`.
    """
    out: list[KVEvent] = []
    ignored: dict[str, int] = {}
    for ev in events:
        kind = type(ev)
        if kind is _MapRemoved or kind is _ArrayRemoved:
            # An engine evicting under pressure sends one one-block BlockRemoved per block,
            # dozens a batch: that shape is built here, the rest goes through `_removed`.
            hashes, medium = ev.block_hashes, ev.medium
            if (
                len(hashes) == 1
                and type(hashes[0]) is int
                and hashes[0] >= 0
                and not ev.group_idx
                and ev.locality is None
                and medium in _REMOVAL_TIER
            ):
                out.append(BlockRemoved(hashes, _REMOVAL_TIER[medium], medium))
                continue
        result = ev.normalize()
        if type(result) is str:
            ignored[result] = ignored.get(result, 0) + 1
        else:
            out.append(result)
    return out, ignored


def _normalize_events_compiled(events: list[Any]) -> tuple[list[KVEvent], dict[str, int]]:
    assert speedups is not None
    return speedups.normalize_events(  # type: ignore[no-any-return]
        events, _REMOVED_TYPES, BlockRemoved, _REMOVAL_TIER
    )


_REMOVED_TYPES: Final = (_MapRemoved, _ArrayRemoved)
_normalize_events = _normalize_events_py if speedups is None else _normalize_events_compiled


# --- generic path: the reference decoder, and the one that names errors ---------------------

_GENERIC_DECODER: Final = msgspec.msgpack.Decoder()
_MISSING: Final = object()
# What the decoders other than the generic path raise when they do not take a batch.
_REFUSED: Final = (msgspec.DecodeError, RecursionError, EventDecodeError)


def _decode_generic(payload: bytes) -> EventBatch:
    try:
        root = _GENERIC_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise EventDecodeError("malformed_msgpack", str(exc)) from None
    if type(root) is not list or len(root) < 2:
        raise EventDecodeError("not_a_batch", f"root is {_describe(root)}, not [ts, events, ...]")
    ts, raw_events = root[0], root[1]
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise EventDecodeError("bad_ts", f"ts is {_describe(ts)}")
    if type(raw_events) is not list:
        raise EventDecodeError("not_a_batch", f"events is {_describe(raw_events)}, not an array")
    dp_rank = root[2] if len(root) > 2 else None
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise EventDecodeError("bad_dp_rank", f"dp_rank is {_describe(dp_rank)}")
    out: list[KVEvent] = []
    ignored: dict[str, int] = {}
    for index, raw in enumerate(raw_events):
        try:
            result = _generic_event(raw)
        except EventDecodeError as exc:
            raise EventDecodeError(exc.reason, f"event {index}: {exc.detail}") from None
        if type(result) is str:
            ignored[result] = ignored.get(result, 0) + 1
        else:
            out.append(result)  # type: ignore[arg-type]
    return EventBatch(float(ts), out, dp_rank, ignored)


def _generic_event(raw: object) -> KVEvent | str:
    if type(raw) is dict:
        tag = raw.get("type")
        if type(tag) is not str:
            raise EventDecodeError("bad_event", f"map event has type {_describe(tag)}")
        if tag == "BlockStored":
            return _generic_stored(
                _required(raw, "block_hashes"),
                raw.get("parent_block_hash"),
                _required(raw, "token_ids"),
                _required(raw, "block_size"),
                raw.get("medium"),
                raw.get("lora_name"),
                raw.get("cache_salt"),
                raw.get("group_idx"),
                raw.get("kv_cache_spec_kind"),
                raw.get("locality"),
            )
        if tag == "BlockRemoved":
            return _generic_removed(
                _required(raw, "block_hashes"),
                raw.get("medium"),
                raw.get("group_idx"),
                raw.get("locality"),
            )
        return AllBlocksCleared() if tag == "AllBlocksCleared" else "unknown_type"
    if type(raw) is list:
        tag = raw[0] if raw else _MISSING
        if type(tag) is not str:
            raise EventDecodeError("bad_event", f"array event has tag {_describe(tag)}")
        n = len(raw)
        if tag == "BlockStored":
            if n < 5:
                raise EventDecodeError("bad_event", f"positional BlockStored has {n} elements")
            meta = raw[7] if n > 7 else None
            lora_name: object = None
            cache_salt: object = None
            if type(meta) is dict:
                cache_salt = meta.get("cache_salt")
            elif meta is not None:
                lora_name = meta  # vLLM's lora_name, checked below
            return _generic_stored(
                raw[1],
                raw[2],
                raw[3],
                raw[4],
                raw[6] if n > 6 else None,
                lora_name,
                cache_salt,
                raw[9] if n > 9 else None,
                raw[10] if n > 10 else None,
                None,
            )
        if tag == "BlockRemoved":
            if n < 2:
                raise EventDecodeError("bad_event", "positional BlockRemoved has no hashes")
            return _generic_removed(
                raw[1], raw[2] if n > 2 else None, raw[3] if n > 3 else None, None
            )
        return AllBlocksCleared() if tag == "AllBlocksCleared" else "unknown_type"
    raise EventDecodeError("bad_event", f"event is {_describe(raw)}, not a map or an array")


def _generic_stored(
    hashes: object,
    parent: object,
    tokens: object,
    block_size: object,
    medium: object,
    lora_name: object,
    cache_salt: object,
    group_idx: object,
    kind: object,
    locality: object,
) -> BlockStored | str:
    checked_hashes = _check_hashes(hashes)
    if parent is not None:
        _check_hash(parent, "parent_block_hash")
    flat_tokens = _check_tokens(tokens)
    if type(block_size) is not int or block_size < 1:
        raise EventDecodeError("bad_block_size", f"block_size is {_describe(block_size)}")
    return _stored(
        checked_hashes,
        parent,  # type: ignore[arg-type]
        flat_tokens,
        block_size,
        _opt_str(medium, "medium"),
        _opt_str(lora_name, "lora_name"),
        _opt_str(cache_salt, "cache_salt"),
        _opt_int(group_idx, "group_idx"),
        _opt_str(kind, "kv_cache_spec_kind"),
        _opt_str(locality, "locality"),
    )


def _generic_removed(
    hashes: object, medium: object, group_idx: object, locality: object
) -> BlockRemoved | str:
    return _removed(
        _check_hashes(hashes),
        _opt_str(medium, "medium"),
        _opt_int(group_idx, "group_idx"),
        _opt_str(locality, "locality"),
    )


def _required(raw: dict[Any, Any], key: str) -> object:
    value = raw.get(key, _MISSING)
    if value is _MISSING:
        raise EventDecodeError("bad_event", f"{raw['type']} has no {key}")
    return value


def _check_hashes(hashes: object) -> list[Any]:
    if type(hashes) is not list:
        raise EventDecodeError("bad_hash", f"block_hashes is {_describe(hashes)}, not an array")
    if len(hashes) > MAX_HASHES_PER_EVENT:
        raise EventDecodeError(
            "over_cap", f"{len(hashes)} hashes in one event (cap {MAX_HASHES_PER_EVENT})"
        )
    for h in hashes:
        _check_hash(h, "block hash")
    return hashes


def _check_hash(h: object, what: str) -> None:
    if type(h) is int:
        if _I64_MIN <= h <= _U64_MASK:
            return
    elif type(h) is bytes and 0 < len(h) <= MAX_HASH_BYTES:
        return
    raise EventDecodeError("bad_hash", f"{what} is {_describe(h)}")


_TOKENS_TYPE: Final = list[_Token]
_BIGRAMS_TYPE: Final = list[tuple[_Token, _Token]]  # the generic path checks without the caps


def _check_tokens(tokens: object) -> list[int]:
    if type(tokens) is not list:
        raise EventDecodeError("bad_tokens", f"token_ids is {_describe(tokens)}, not an array")
    if len(tokens) > MAX_TOKENS_PER_EVENT:
        raise EventDecodeError(
            "over_cap", f"{len(tokens)} tokens in one event (cap {MAX_TOKENS_PER_EVENT})"
        )
    bigram = bool(tokens) and type(tokens[0]) is list
    try:
        if bigram:
            return [pair[0] for pair in msgspec.convert(tokens, _BIGRAMS_TYPE)]
        return msgspec.convert(tokens, _TOKENS_TYPE)
    except msgspec.ValidationError as exc:
        shape = "bigram token_ids" if bigram else "token_ids"
        raise EventDecodeError("bad_tokens", f"{shape}: {exc}") from None


def _opt_str(value: object, name: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise EventDecodeError("bad_event", f"{name} is {_describe(value)}")


def _opt_int(value: object, name: str) -> int | None:
    if value is None or type(value) is int:
        return value
    raise EventDecodeError("bad_event", f"{name} is {_describe(value)}")


def _describe(value: object) -> str:
    """A short, bounded description of a bad value for an error detail (never a huge repr)."""
    if value is _MISSING:
        return "missing"
    kind = type(value).__name__
    if isinstance(value, str | bytes):
        return f"{kind} {value[:24]!r}{'...' if len(value) > 24 else ''}"
    if value is None or isinstance(value, int | float):
        return f"{kind} {value!r}"
    if isinstance(value, list | dict):
        return f"{kind} of {len(value)}"
    return kind
