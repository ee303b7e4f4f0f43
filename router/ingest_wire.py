"""What an ingest process hands the pump: compact, already-keyed batches, and its key mirror.

Rules of this file: pure code, no sockets. `pack` turns a subscriber item (after
`router.events.decode_batch`, in the ingest process) into one msgpack message; `unpack` turns
it back into the same item for the pump, in the replica. Commands travel the other way
(`Subscribe`, `Unsubscribe`). `KeyMirror` is the ingest process's memory of recent blocks.

Theory of operation
-------------------
The per-message work of ingest is receiving, decoding (a Python int per token) and hashing
token ids into chained block keys. An ingest process does all of it and sends the pump, per
event, the engine hashes as a u64 array, the tokens as a u32 array (4 bytes a token, copied
back in one call) and, when it could, the blocks' keys with the `seed` they were chained
from. The pump stays the only writer of the tree: it decodes a message with a few C-level
calls and applies it under exactly the rules it applies to a batch decoded in its own process
(`router.index`), so subscriber and pump rules are unchanged by where the decoding ran.

Keys: a chain root's seed is its namespace's (always known); a block stored under a parent
needs the parent's key, which only the tree knows for sure. The ingest process keeps a bounded
mirror `engine hash -> key` per rank from the stream it decodes, and keys an event when its
parent is in the mirror. The mirror can be wrong (the pump grafted a snapshot, cleared a rank
at the cap, a block left and came back): so the event carries the seed it used, and the pump
uses the keys only if the tree's own key for the parent is that seed (`router.index`);
otherwise it keys the tokens itself. Keys are a pure function of (tokens, seed), so a matching
seed makes them exactly the keys the pump would compute: the mirror can cost work, never
correctness.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import fields
from typing import Annotated, Any, Final

import msgspec

from cachetree.keys import chain_keys, namespace_seed, token_bytes
from cachetree.ranks import RankId
from router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    RemovedRun,
)
from router.subscriber import (
    LiveBatch,
    PublisherReset,
    SubscriberItem,
    SubscriberStats,
    UnrepairedGap,
)

MIRROR_PER_RANK: Final = 4096  # recent blocks remembered per rank (parents of the next stores)


U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1


class _Stored(msgspec.Struct, array_like=True, tag=1, gc=False):
    hashes: list[U64]
    parent: U64 | None
    tokens: bytes  # u32 little-endian
    block_size: int
    tier: int
    medium: str | None
    namespace: str | None
    keys: list[U64] | None  # chained from `seed`
    seed: U64 | None


class _Removed(msgspec.Struct, array_like=True, tag=2, gc=False):
    hashes: list[U64]
    tier: int | None
    medium: str | None


class _Cleared(msgspec.Struct, array_like=True, tag=3, gc=False):
    pass


class _RemovedRun(msgspec.Struct, array_like=True, tag=4, gc=False):
    hashes: list[U64]  # each one event
    tier: int | None
    medium: str | None


class _Batch(msgspec.Struct, array_like=True, tag=10, gc=False):
    url: str
    dp: int
    seq: int
    ts: float
    dp_rank: int | None
    events: list[_Stored | _Removed | _Cleared | _RemovedRun]
    ignored: dict[str, int]


class _Reset(msgspec.Struct, array_like=True, tag=11, gc=False):
    url: str
    dp: int
    jumped: bool = False


class _Gap(msgspec.Struct, array_like=True, tag=12, gc=False):
    url: str
    dp: int
    first: int
    last: int


class Stats(msgspec.Struct, array_like=True, tag=13):
    """A rank's `SubscriberStats`, as the ingest process counts them (sent when they move)."""

    url: str
    dp: int
    values: dict[str, Any]

    @property
    def rank(self) -> RankId:
        return RankId(self.url, self.dp)


class Hello(msgspec.Struct, array_like=True, tag=14):
    """An ingest process is connected and takes commands."""

    pid: int


class Beat(msgspec.Struct, array_like=True, tag=15):
    """An ingest process is alive: sent at a fixed interval, events or not, so a process that
    is stopped or stuck shows as silence (`router.ingest_pool.hung`)."""


# Messages queued each way on a process's channel before the sender waits, at each end. Few:
# a batch may be up to `--kv-events-max-message-bytes` (8 MiB), and what waits here is held in
# memory on top of the pump's own queue (1,024 per process was 1.4 GB more at 2 processes
# under a burst of 1 MB batches).
PAIR_HWM: Final = 64


class Subscribe(msgspec.Struct, array_like=True, tag=20):
    url: str
    dp: int
    endpoint: str
    topic: bytes
    replay_endpoint: str | None
    # The last seq the replica's index applied for the rank, if any: a process started again
    # in place of one that died takes it as its last seen, so the batches the dead one did
    # not hand over are a gap its subscriber asks replay for, not a loss.
    last_seq: int | None = None


class Unsubscribe(msgspec.Struct, array_like=True, tag=21):
    url: str
    dp: int


Upward = _Batch | _Reset | _Gap | Stats | Hello | Beat
Command = Subscribe | Unsubscribe

_encoder = msgspec.msgpack.Encoder()
_upward = msgspec.msgpack.Decoder(Upward)
_commands = msgspec.msgpack.Decoder(Command)


class KeyMirror:
    """Per rank, `engine hash -> key` of the most recent MIRROR_PER_RANK blocks stored."""

    def __init__(self, per_rank: int = MIRROR_PER_RANK) -> None:
        self._per_rank = per_rank
        self._ranks: dict[RankId, OrderedDict[int, int]] = {}

    def keys_for(self, rank: RankId, event: BlockStored) -> tuple[list[int], int] | None:
        """The event's keys and the seed they were chained from, or None when its parent
        is not remembered (or its shape is wrong: the pump refuses and counts it)."""
        known = self._ranks.setdefault(rank, OrderedDict())
        parent = event.parent_engine_hash
        seed = namespace_seed(event.namespace) if parent is None else known.get(parent)
        hashes = event.engine_hashes
        if seed is None or len(event.token_ids) != len(hashes) * event.block_size:
            return None
        keys = chain_keys(token_bytes(event.token_ids), event.block_size * 4, seed)
        known.update(zip(hashes, keys, strict=True))
        while len(known) > self._per_rank:
            known.popitem(last=False)
        return keys, seed

    def removed(self, rank: RankId, hashes: Sequence[int]) -> None:
        known = self._ranks.get(rank)
        if known:
            for h in hashes:
                known.pop(h, None)

    def forget(self, rank: RankId) -> None:
        self._ranks.pop(rank, None)


def pack(item: SubscriberItem, mirror: KeyMirror) -> bytes:
    """One subscriber item as a message to the pump (in the ingest process)."""
    rank = item.rank
    if type(item) is LiveBatch:
        batch = item.batch
        events: list[_Stored | _Removed | _Cleared | _RemovedRun] = []
        for event in batch.events:
            if type(event) is BlockStored:
                keyed = mirror.keys_for(rank, event)
                events.append(
                    _Stored(
                        event.engine_hashes,
                        event.parent_engine_hash,
                        token_bytes(event.token_ids),
                        event.block_size,
                        event.tier,
                        event.medium,
                        event.namespace,
                        None if keyed is None else keyed[0],
                        None if keyed is None else keyed[1],
                    )
                )
            elif type(event) is BlockRemoved:
                mirror.removed(rank, event.engine_hashes)
                events.append(_Removed(event.engine_hashes, event.tier, event.medium))
            elif type(event) is RemovedRun:
                mirror.removed(rank, event.engine_hashes)
                events.append(_RemovedRun(event.engine_hashes, event.tier, event.medium))
            else:
                mirror.forget(rank)
                events.append(_Cleared())
        message: Upward = _Batch(
            rank.worker_url, rank.dp_rank, item.seq, batch.ts, batch.dp_rank, events, batch.ignored
        )
    elif type(item) is PublisherReset:
        mirror.forget(rank)
        message = _Reset(rank.worker_url, rank.dp_rank, item.jumped)
    else:
        message = _Gap(rank.worker_url, rank.dp_rank, item.first, item.last)
    return _encoder.encode(message)


def stats_values(stats: SubscriberStats) -> dict[str, Any]:
    """A rank's counts as `pack_stats` sends them: plain ints and dicts, copied.

    Not `dataclasses.asdict`: it rebuilds a Counter from its (key, count) pairs, which makes a
    Counter of pairs ({("repaired", 1): 1}), and the replica's /metrics failed on such labels.
    """
    return {
        f.name: dict(value) if isinstance(value := getattr(stats, f.name), Counter) else value
        for f in fields(stats)
    }


def pack_stats(rank: RankId, values: dict[str, Any]) -> bytes:
    return _encoder.encode(Stats(rank.worker_url, rank.dp_rank, values))


def pack_hello(pid: int) -> bytes:
    return _encoder.encode(Hello(pid))


BEAT: Final = _encoder.encode(Beat())


def unpack(message: bytes | memoryview) -> SubscriberItem | Stats | Hello | Beat:
    """A message from an ingest process as the item the pump takes (in the replica).

    Raises `msgspec.DecodeError` (or ValueError) for anything that is not one message whole.
    """
    msg = _upward.decode(message)
    if type(msg) is _Batch:
        return LiveBatch(
            RankId(msg.url, msg.dp),
            msg.seq,
            EventBatch(msg.ts, [_event(e) for e in msg.events], msg.dp_rank, msg.ignored),
        )
    if type(msg) is _Reset:
        return PublisherReset(RankId(msg.url, msg.dp), msg.jumped)
    if type(msg) is _Gap:
        return UnrepairedGap(RankId(msg.url, msg.dp), msg.first, msg.last)
    return msg  # type: ignore[return-value] - Stats, Hello or Beat


def _event(e: _Stored | _Removed | _Cleared | _RemovedRun) -> KVEvent:
    if type(e) is _Stored:
        if len(e.tokens) % 4:
            raise ValueError("a u32 array of a length that is not a multiple of 4")
        if e.keys is None:  # the pump keys these: one copy into the array the key code reads
            tokens: Sequence[int] = array("I")
            tokens.frombytes(e.tokens)  # type: ignore[attr-defined]
        else:  # read only if the seed turns out stale: a view, no copy
            tokens = memoryview(e.tokens).cast("I")
        return BlockStored(
            e.hashes,
            e.parent,
            tokens,  # type: ignore[arg-type]
            e.block_size,
            e.tier,
            e.medium,
            e.namespace,
            e.keys,
            e.seed,
        )
    if type(e) is _Removed:
        return BlockRemoved(e.hashes, e.tier, e.medium)
    if type(e) is _RemovedRun:
        return RemovedRun(e.hashes, e.tier, e.medium)
    return AllBlocksCleared()


def pack_command(command: Command) -> bytes:
    return _encoder.encode(command)


def unpack_command(message: bytes) -> Command:
    return _commands.decode(message)
