"""A worker's own `GET /v1/kv-snapshot`: decoding it and rebuilding a rank's index from it.

Real vLLM and SGLang do not serve this route; our fake worker does, and an engine plugin can.
The body lists, per dp rank, the last seq the state reflects and every cached block in
parent-before-child order with its engine hash (as the engine puts it on the wire: SGLang's are
signed), parent engine hash, token ids and tier name, and optionally the LoRA adapter
(`lora_name`) and cache salt (`cache_salt`) it was cached under, as its BlockStored carried
them. The router replays it as stores, so the rank's index ends up exactly as if it had seen
every event up to `last_seq`: a chain root is keyed in its namespace (`events.namespace_of`)
and the rest of the chain under it, and the adapter names the roots carry are learned
(`adapter_names`) as a live store's are. As for a live store, only a root's fields count: a
block under a parent takes its namespace from the parent's key. A block without them is the
base model's (an engine plugin that predates them sends none).

A body that does not decode (a token id outside [0, 2**32) included), or whose blocks do not
fit together (a block size that differs, tokens that do not fill a block, a parent that comes
later or not at all, a `lora_name` that is empty or holds a NUL), is refused whole with
`WorkerSnapshotError`; the rank's index is then left as it was. So is one whose `last_seq` is
more than `MAX_SEQ_JUMP` past the rank's live stream (`router.index`): installed, it would mark
every batch of that stream as already reflected, and freeze the rank on blocks its engine no
longer holds. A body is refused whole
when any one of its ranks is, a rank the worker does not have included
(`IndexRules.replace_ranks`): nothing of it is installed, not even the ranks that fit.

Bounded memory: `read_body` streams the answer against `--worker-snapshot-max-body-mb`
(a `Content-Length` over it is refused before a byte is read; a body that goes past it is cut
off there), and refuses a compressed answer outright (we never ask for one, and inflating is
where a bomb goes off). It is decoded in slices (`SnapshotDecode`: its structure first, then
its blocks a slice at a time, the event loop turning between them). Decoded, a body takes about
4.6 times its size (token ids as Python ints) and its blocks about 320 B each in the index: the
32 MiB default (~160k blocks of 16 tokens) peaks near 250 MB above the baseline, inside the
manifest's 512 Mi with the rest of the index (README, "Memory").
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterable
from typing import Annotated, Final

import aiohttp
import msgspec
from aiohttp import hdrs

from cachetree.keys import is_adapter_name
from cachetree.ranks import RankId
from cachetree.tiers import TIER_NAMES
from cachetree.tree import BlockTree, run_through
from router.events import namespace_of

_TIER_BY_NAME = {name: bit for bit, name in TIER_NAMES.items()}
# A rank's `last_seq` before its first batch: the engine published nothing yet.
NOTHING_PUBLISHED: Final = -1
_U64_MASK = (1 << 64) - 1
DEFAULT_MAX_BODY_BYTES: Final = 32 * 1024 * 1024  # --worker-snapshot-max-body-mb


class WorkerSnapshotError(ValueError):
    pass


# A token id as the live decoders take it (`router.events`): checked as the body decodes, so a
# block the index could not key refuses the body whole before the rank is touched.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class SnapshotBlock(msgspec.Struct, gc=False):
    engine_hash: int
    parent_engine_hash: int | None
    # A tuple, not a list: the collector stops tracking a tuple of ints at its first pass, so
    # 160k decoded blocks do not pile up into a full collection (a list stays tracked: 70-270
    # ms pauses inside a decode slice, BENCHMARKS.md, issue 13).
    token_ids: tuple[TokenId, ...]
    tier: str | None = "device"
    lora_name: str | None = None
    cache_salt: str | None = None


class SnapshotRank(msgspec.Struct):
    dp_rank: int
    last_seq: int
    blocks: list[SnapshotBlock]


class WorkerSnapshot(msgspec.Struct):
    ranks: list[SnapshotRank]
    block_size: int


class _ListedRank(msgspec.Struct):
    dp_rank: int
    last_seq: int
    blocks: list[msgspec.Raw]  # each block's bytes, decoded later a slice at a time


class _Listed(msgspec.Struct):
    ranks: list[_ListedRank]
    block_size: int


_listing_decoder = msgspec.json.Decoder(_Listed)
_blocks_decoder = msgspec.json.Decoder(list[SnapshotBlock])
# Blocks a step of `decode_worker_snapshot` joins into one copy to decode: one step for the
# whole body copied all of it again (+22 MB at 140k blocks).
_JOINED_BLOCKS: Final = 4096
_SLICE_PATH = re.compile(r"`\$\[(\d+)\]")  # where in a slice a decode error is


async def read_body(resp: aiohttp.ClientResponse, limit: int) -> bytearray:
    """The body of a 200 answer, read against `limit`; WorkerSnapshotError past it."""
    encoding = resp.headers.get(hdrs.CONTENT_ENCODING, "").strip().lower()
    if encoding not in ("", "identity"):
        raise WorkerSnapshotError(f"Content-Encoding {encoding!r} was not asked for")
    if resp.content_length is not None and resp.content_length > limit:
        raise WorkerSnapshotError(
            f"Content-Length {resp.content_length} is over the {limit}-byte bound "
            "(--worker-snapshot-max-body-mb)"
        )
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise WorkerSnapshotError(
                f"body goes past the {limit}-byte bound (--worker-snapshot-max-body-mb)"
            )
    return body


class SnapshotDecode:
    """A body decoded in slices, so a large one never holds the event loop for long: call
    `step()` until it returns True, then `result()`.

    The first pass (at construction) reads the body's structure and leaves each block as its
    raw bytes (`msgspec.Raw`, a view into the body, no copy): ~0.25 us a block, about a sixth
    of a whole decode. Each step then decodes up to `budget` blocks in one C call, their token
    ids range-checked as before. Either raises WorkerSnapshotError, naming the block at fault
    as the whole decode did (`$.ranks[r].blocks[i]`); nothing is installed before the last
    step.
    Memory: the body and its raw views (48 B a block) are held until the job is dropped.
    """

    def __init__(self, body: bytes | bytearray, limit: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if len(body) > limit:
            raise WorkerSnapshotError(f"body of {len(body)} bytes is over {limit}")
        try:
            listed = _listing_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise WorkerSnapshotError(f"not a kv-snapshot body: {exc}") from None
        self._listed = listed.ranks
        self._ranks = [SnapshotRank(r.dp_rank, r.last_seq, []) for r in listed.ranks]
        self._block_size = listed.block_size
        self._rank = 0  # the rank being decoded, and how far into its blocks
        self._pos = 0

    @property
    def done(self) -> bool:
        return self._rank == len(self._listed)

    def step(self, budget: int) -> bool:
        """Decode up to `budget` more blocks; True once every block is decoded."""
        while not self.done and budget > 0:
            raws = self._listed[self._rank].blocks
            a = self._pos
            b = min(a + budget, len(raws))
            try:
                blocks = _blocks_decoder.decode(b"[" + b",".join(raws[a:b]) + b"]")
            except msgspec.DecodeError as exc:
                detail = _in_body(str(exc), self._rank, a)
                raise WorkerSnapshotError(f"not a kv-snapshot body: {detail}") from None
            self._ranks[self._rank].blocks += blocks
            budget -= b - a
            self._pos = b
            if b == len(raws):
                self._rank += 1
                self._pos = 0
        return self.done

    def result(self) -> WorkerSnapshot:
        if not self.done:
            raise RuntimeError("decode not finished: call step() until it returns True")
        return WorkerSnapshot(self._ranks, self._block_size)


def _in_body(detail: str, rank: int, first: int) -> str:
    """A slice's decode error, its path (`$[i]`) as the block's place in the whole body."""
    return _SLICE_PATH.sub(lambda m: f"`$.ranks[{rank}].blocks[{first + int(m[1])}]", detail)


def decode_worker_snapshot(
    body: bytes | bytearray, limit: int = DEFAULT_MAX_BODY_BYTES
) -> WorkerSnapshot:
    """The whole body decoded at once (`SnapshotDecode` run through): tests, benches."""
    job = SnapshotDecode(body, limit)
    while not job.step(_JOINED_BLOCKS):
        pass
    return job.result()


def check_steps(
    snap: SnapshotRank, block_size: int, index_block_size: int, slice_blocks: int
) -> Generator[None, None, None]:
    """WorkerSnapshotError unless `snap`'s blocks fit together: the body's block size is the
    index's, each block holds that many tokens, each parent is a block listed earlier, and
    each `lora_name` is one an adapter may have (`is_adapter_name`, as a sibling's are).
    Yields after every `slice_blocks` blocks."""
    if block_size != index_block_size:
        raise WorkerSnapshotError(f"block size {block_size} differs from the index's")
    seen: set[int] = set()
    for i, block in enumerate(snap.blocks):
        if i and not i % slice_blocks:
            yield
        if len(block.token_ids) != block_size:
            raise WorkerSnapshotError(f"block {i} has {len(block.token_ids)} tokens")
        if block.lora_name is not None and not is_adapter_name(block.lora_name):
            raise WorkerSnapshotError(
                f"block {i}: lora_name {block.lora_name[:64]!r} is not an adapter name "
                "(empty, or holding a NUL)"
            )
        parent = block.parent_engine_hash
        if parent is not None and parent & _U64_MASK not in seen:
            raise WorkerSnapshotError(f"block {i}: parent is not an earlier block")
        seen.add(block.engine_hash & _U64_MASK)


def adapter_names(ranks: Iterable[SnapshotRank]) -> set[str]:
    """The LoRA adapter names the ranks' chain roots carry (the index learns them, within its
    bound: `IndexRules.learn_adapters`)."""
    return {
        block.lora_name
        for rank in ranks
        for block in rank.blocks
        if block.lora_name and block.parent_engine_hash is None
    }


def rebuild_rank(tree: BlockTree, rank: RankId, snap: SnapshotRank, block_size: int) -> int:
    """`rebuild_steps` at once (tests, benches; the pump installs in steps:
    `IndexRules.replace_ranks_steps`). Returns blocks placed."""
    return run_through(rebuild_steps(tree, rank, snap, block_size, len(snap.blocks) + 1))


def rebuild_steps(
    tree: BlockTree, rank: RankId, snap: SnapshotRank, block_size: int, slice_blocks: int
) -> Generator[None, None, int]:
    """Replace `rank`'s blocks in `tree` with those of `snap`, yielding after every
    `slice_blocks` blocks; returns the blocks placed. Checked before anything changes
    (`check_steps`): a refused snapshot leaves the rank as it was. Built aside, then swapped in
    (`stage_steps`, `BlockTree.swap_staged_steps`): no reader sees the rank half built."""
    yield from check_steps(snap, block_size, tree.block_size, slice_blocks)
    placed = yield from stage_steps(tree, rank, snap, block_size, slice_blocks)
    yield from tree.swap_staged_steps(rank, slice_blocks)
    return placed


def stage_steps(
    tree: BlockTree, rank: RankId, snap: SnapshotRank, block_size: int, slice_blocks: int
) -> Generator[None, None, int]:
    """Build `snap`'s blocks as `rank`'s staged state (`BlockTree.stage_rank`: no reader sees
    it before `swap_staged_steps`), yielding after every `slice_blocks` blocks; returns the
    blocks placed. `snap` must have passed `check_steps`.

    Blocks with a tier name we do not know are skipped (an unknown medium is never indexed),
    and so are their descendants (neither counts as a refused store).

    Each run of blocks that continue one another on one tier (the body lists a cached prompt's
    blocks one after the other) is stored as one chain, up to `slice_blocks` blocks, as a live
    BlockStored of them would be: a store per block cost ~2 us each.
    """
    tree.stage_rank(rank)
    placed = 0
    skipped: set[int] = set()  # blocks of an unknown tier, and their descendants
    head: int | None = None  # the parent of the chain being gathered
    namespace: str | None = None  # its root's, when it starts at one (head None)
    hashes: list[int] = []
    tokens: list[int] = []
    chain_tier = 0
    for i, block in enumerate(snap.blocks):
        if i and not i % slice_blocks:
            yield
        engine_hash = block.engine_hash & _U64_MASK
        parent = block.parent_engine_hash
        if parent is not None:
            parent &= _U64_MASK
        tier = _TIER_BY_NAME.get(block.tier) if block.tier is not None else None
        if tier is None or parent in skipped:
            skipped.add(engine_hash)
            continue
        if hashes and parent == hashes[-1] and tier == chain_tier and len(hashes) < slice_blocks:
            hashes.append(engine_hash)
            tokens += block.token_ids
            continue
        if hashes:
            placed += tree.store(
                rank, head, hashes, tokens, block_size, chain_tier, namespace, staged=True
            )
        head, hashes, tokens, chain_tier = parent, [engine_hash], list(block.token_ids), tier
        namespace = namespace_of(block.lora_name, block.cache_salt) if parent is None else None
    if hashes:
        placed += tree.store(
            rank, head, hashes, tokens, block_size, chain_tier, namespace, staged=True
        )
    return placed
