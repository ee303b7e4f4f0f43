"""The snapshot producer without HTTP: sampling order, cursor re-check, herd sharing, bodies."""

from __future__ import annotations

import asyncio
import gc
import gzip
import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import pytest

import peer.producer as producer_mod
from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, canonical_view, restore
from cachetree.tiers import DEVICE, HOST
from cachetree.tree import BlockTree
from peer.producer import (
    BadQuery,
    SnapshotProducer,
    SnapshotUnavailable,
    accepts,
    parse_query,
    recheck_cursors,
    reusable,
)
from peer.wire import COLUMNS, JSON, MSGPACK, Envelope, PeerSnapshot, as_format1, decode
from tests.support.waiting import eventually

BS = 4
A = RankId("http://a:8000", 0)
B = RankId("http://b:8000", 0)
C = RankId("http://c:8000", 1)
D = RankId("http://d:8000", 0)
E = RankId("http://e:8000", 2)


@dataclass
class View:
    tree: BlockTree | None
    cursors: dict[RankId, int] = field(default_factory=dict)
    live: set[RankId] = field(default_factory=set)
    cold: set[RankId] = field(default_factory=set)
    adapters: set[str] = field(default_factory=set)


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gate:
    """A yield point that parks the build at its first yield until `release()`."""

    def __init__(self) -> None:
        self.parked = asyncio.Event()
        self._open = asyncio.Event()
        self.yields = 0

    async def __call__(self) -> None:
        self.yields += 1
        self.parked.set()
        await self._open.wait()

    def release(self) -> None:
        self._open.set()


def populated(seed: int = 3, chains: int = 40) -> BlockTree:
    """Shared prefixes over three ranks, mixed tiers, and a removal that leaves a bare node."""
    rng = random.Random(seed)
    tree = BlockTree(BS)
    prefixes = [[rng.randrange(1, 500) for _ in range(BS * 3)] for _ in range(4)]
    next_hash = 1
    for _ in range(chains):
        rank = rng.choice([A, B, C])
        tokens = rng.choice(prefixes) + [
            rng.randrange(1, 500) for _ in range(BS * rng.randint(0, 3))
        ]
        n = len(tokens) // BS
        tree.store(
            rank, None, range(next_hash, next_hash + n), tokens, BS, tier=rng.choice([DEVICE, HOST])
        )
        next_hash += n
    # A block whose only carrier drops it while keeping the next one: a bare interior node.
    tree.store(D, None, [900, 901], [7] * (BS * 2), BS)
    tree.remove(D, [900])
    # E stored and lost its only block: it keeps a slot in the tree but carries nothing.
    tree.store(E, None, [950], [8] * BS, BS)
    tree.remove(E, [950])
    return tree


def view_of(tree: BlockTree | None, seq: int = 5) -> View:
    ranks = set(tree.ranks()) if tree is not None else set()
    return View(tree, {rank: seq for rank in ranks}, set(ranks))


def restored(snap: PeerSnapshot, block_size: int = BS) -> BlockTree:
    records = [(n.parent, n.key, tuple(n.carriers)) for n in snap.nodes]
    tree = BlockTree(block_size)
    restore(tree, Snapshot.from_records([(w.url, w.dp_rank) for w in snap.workers], records))
    return tree


def cursors_by_rank(snap: PeerSnapshot) -> dict[RankId, int]:
    return {RankId(snap.workers[i].url, snap.workers[i].dp_rank): seq for i, seq in snap.cursors}


async def exported(producer: SnapshotProducer, content_type: str = JSON) -> PeerSnapshot:
    """A fresh-enough export, decoded as format 1 whatever its encoding."""
    entry = await producer.export()
    return as_format1(decode(await producer.body(entry, content_type, gzip=False), content_type))


def small_steps(view: View, **kw) -> SnapshotProducer:
    """A producer that yields after every step of one node, to exercise every boundary."""
    return SnapshotProducer(view, slice_s=0.0, walk_step=1, encode_chunk=3, **kw)


# -- pure rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exported_at", "requested_at", "max_age_s", "reuse"),
    [
        (10.0, 10.0, 0.0, True),  # began at the request's arrival: always acceptable
        (10.5, 10.0, 0.0, True),  # began after it arrived, whatever age it asked for
        (10.0, 11.9, 2.0, True),  # 1.9 s old at arrival, 2 s allowed
        (10.0, 12.0, 2.0, False),  # exactly the age allowed is too old
        (10.0, 10.001, 0.0, False),  # the strictest age refuses anything older than arrival
    ],
)
def test_reuse_rule_measures_age_from_the_requests_arrival(
    exported_at: float, requested_at: float, max_age_s: float, reuse: bool
) -> None:
    assert reusable(exported_at, requested_at, max_age_s) is reuse


def test_recheck_keeps_only_cursors_that_still_hold_for_ranks_in_the_table() -> None:
    before = {A: 5, B: 7, C: 3, D: 4}
    after = {A: 9, B: 2, D: 4}  # A advanced, B reset to a lower seq, C removed
    table = [D, C, B, A]
    assert recheck_cursors(before, after, table) == [(0, 4), (3, 5)]
    # A rank missing from the table (it carries nothing) never gets a cursor.
    assert recheck_cursors(before, after, [A]) == [(0, 5)]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("gzip", True),
        ("GZip", True),
        ("deflate, gzip;q=0.5", True),
        ("br , gzip ; Q=1", True),
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("gzip;q=nonsense", False),
        ("x-gzip", False),
        ("gzipped", False),
        ("*", False),
        ("identity", False),
        ("", False),
        (None, False),
    ],
)
def test_gzip_is_accepted_only_as_a_whole_token_with_a_positive_q(
    header: str | None, expected: bool
) -> None:
    assert accepts(header, "gzip") is expected


def test_msgpack_is_chosen_by_the_accept_header() -> None:
    assert accepts("application/msgpack", MSGPACK)
    assert accepts("application/json;q=0.5, Application/MsgPack", MSGPACK)
    assert not accepts("application/json", MSGPACK)
    assert not accepts("application/msgpack;q=0", MSGPACK)


@pytest.mark.parametrize(
    ("query", "cursors_only", "max_age_ms"),
    [
        ({}, False, None),
        ({"cursors_only": "true"}, True, None),
        ({"cursors_only": "TRUE"}, True, None),
        ({"cursors_only": "false", "max_age_ms": "0"}, False, 0),
        ({"max_age_ms": str(2**64 - 1)}, False, 2**64 - 1),
    ],
)
def test_query_parameters_parse(query: dict, cursors_only: bool, max_age_ms: int | None) -> None:
    parsed = parse_query(query)
    assert (parsed.cursors_only, parsed.max_age_ms) == (cursors_only, max_age_ms)


@pytest.mark.parametrize(
    "query",
    [
        {"cursors_only": ""},  # valueless: `?cursors_only`
        {"cursors_only": "yes"},
        {"cursors_only": "1"},
        {"max_age_ms": ""},
        {"max_age_ms": "-1"},
        {"max_age_ms": "1.5"},
        {"max_age_ms": "ten"},
        {"max_age_ms": "+5"},
        {"max_age_ms": str(2**64)},
        {"max_age_ms": "١٢"},  # digits, but not ASCII ones
        {"max_age_ms": "9" * 5000},  # past int()'s digit limit: was a ValueError, a 500
        {"max_age_ms": "0" * 30 + "1"},
    ],
)
def test_bad_query_parameters_are_refused(query: dict) -> None:
    with pytest.raises(BadQuery):
        parse_query(query)


def test_the_export_envelope_has_every_body_field_but_nodes() -> None:
    head = [(f.name, f.type, f.default) for f in msgspec.structs.fields(Envelope)]
    body = [(f.name, f.type, f.default) for f in msgspec.structs.fields(PeerSnapshot)]
    assert head == [f for f in body if f[0] != "nodes"]


# -- bodies ------------------------------------------------------------------------------


async def test_every_encoding_restores_to_the_exported_tree() -> None:
    tree = populated()
    producer = small_steps(view_of(tree))
    entry = await producer.export()
    bodies = [
        as_format1(decode(await producer.body(entry, ct, gzip=False), ct))
        for ct in (JSON, MSGPACK, COLUMNS)
    ]
    assert bodies[0] == bodies[1] == bodies[2]
    snap = bodies[0]
    assert any(len(n.carriers) > 1 for n in snap.nodes), "the slow path was not exercised"
    assert any(not n.carriers for n in snap.nodes), "no carrier-less node was exported"
    assert canonical_view(restored(snap)) == canonical_view(tree)
    assert snap.producer_ready and entry.producer_ready and entry.nodes == len(tree)
    assert (snap.format, snap.block_size, snap.key_scheme) == (1, BS, "xxh3-chain-1337")


async def test_large_chunks_and_one_slice_give_the_same_body() -> None:
    tree = populated(seed=11, chains=200)
    fine = small_steps(view_of(tree))
    coarse = SnapshotProducer(view_of(tree), walk_step=1 << 20, encode_chunk=1 << 20)
    for ct in (JSON, MSGPACK, COLUMNS):
        assert await exported(fine, ct) == await exported(coarse, ct)


async def test_the_walk_yields_to_the_loop_between_slices() -> None:
    tree = populated()
    producer = small_steps(view_of(tree))
    yields = 0

    async def counting() -> None:
        nonlocal yields
        yields += 1

    producer.yield_point = counting
    await producer.export()
    assert yields >= len(tree)  # at least one per node walked, one per chunk encoded


async def test_a_rank_that_carries_nothing_is_an_empty_rank_with_no_cursor() -> None:
    tree = BlockTree(BS)
    # E's only block is gone, but it keeps the first slot in the tree, so every carrier's
    # index in the walk's table moves down by one on the wire.
    tree.store(E, None, [1], [8] * BS, BS)
    tree.remove(E, [1])
    for i, rank in enumerate((A, B, C)):
        tree.store(rank, None, [10 + i, 20 + i], [9] * BS + [i] * BS, BS)
    assert tree.block_count(E) == 0 and E in tree.ranks()
    view = view_of(tree)
    view.cursors[E] = 12
    snap = await exported(small_steps(view))
    assert E not in [(w.url, w.dp_rank) for w in snap.workers]
    assert [(w.url, w.dp_rank) for w in snap.empty_ranks] == [E]
    assert cursors_by_rank(snap) == {A: 5, B: 5, C: 5}
    assert canonical_view(restored(snap)) == canonical_view(tree)


async def test_not_ready_without_a_block_size_without_nodes_or_while_bootstrapping() -> None:
    snap = await exported(SnapshotProducer(View(None)))
    assert (snap.block_size, snap.producer_ready, snap.nodes, snap.workers) == (0, False, [], [])
    empty = View(BlockTree(BS), {A: 3}, {A})
    snap = await exported(SnapshotProducer(empty), COLUMNS)
    assert (snap.block_size, snap.producer_ready, snap.nodes) == (BS, False, [])
    assert [(w.url, w.dp_rank) for w in snap.empty_ranks] == [A]
    settling = SnapshotProducer(view_of(populated()), settled=lambda: False)
    snap = await exported(settling)
    assert snap.nodes and not snap.producer_ready


# -- sampling order ----------------------------------------------------------------------


async def test_the_export_is_stamped_before_anything_is_sampled() -> None:
    tree = populated()
    view = view_of(tree)
    calls = 0

    def clock() -> float:
        nonlocal calls
        calls += 1
        if calls == 2:  # the build's stamp (the first call is the request's arrival)
            view.cursors[A] = 9
        return 100.0

    assert cursors_by_rank(await exported(SnapshotProducer(view, clock=clock)))[A] == 9


async def test_cursors_are_read_before_the_walk_and_rechecked_after_it() -> None:
    tree = populated()
    view = view_of(tree)
    producer = small_steps(view)
    mutated = False

    async def pump_runs_between_slices() -> None:
        nonlocal mutated
        if mutated:
            return
        mutated = True
        tree.store(A, None, [700], [9] * BS, BS)  # A advances to 6 with a new block
        view.cursors[A] = 6
        view.cursors[B] = 1  # B's publisher reset and it started over
        view.cursors.pop(C)  # C was removed
        view.live.discard(C)

    producer.yield_point = pump_runs_between_slices
    snap = await exported(producer, MSGPACK)
    assert cursors_by_rank(snap) == {A: 5, D: 5}  # the pre-walk value; B and C dropped
    # C is no longer live, so it is not an empty rank either; E carries nothing.
    assert [(w.url, w.dp_rank) for w in snap.empty_ranks] == [E]


# -- herd sharing --------------------------------------------------------------------------


async def test_concurrent_requests_share_one_build() -> None:
    producer = small_steps(view_of(populated()))
    gate = Gate()
    producer.yield_point = gate
    callers = [asyncio.create_task(producer.export(max_age_ms=0)) for _ in range(8)]
    await gate.parked.wait()
    await eventually(lambda: producer.waiting == 8)
    gate.release()
    entries = await asyncio.gather(*callers)
    assert producer.stats.builds == 1
    assert all(e is entries[0] for e in entries)


async def test_a_caller_that_leaves_mid_build_still_fills_the_cache() -> None:
    producer = small_steps(view_of(populated()))
    gate = Gate()
    producer.yield_point = gate
    caller = asyncio.create_task(producer.export())
    await gate.parked.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert producer.building and producer.cached is None
    gate.release()
    await producer.wait_idle()
    assert producer.cached is not None
    again = await producer.export()
    assert again is producer.cached
    assert (producer.stats.builds, producer.stats.reused) == (1, 1)


async def test_max_age_decides_between_reuse_and_rebuild() -> None:
    clock = Clock(100.0)
    producer = SnapshotProducer(view_of(populated()), clock=clock)
    first = await producer.export()
    assert first.exported_at == 100.0
    clock.now = 101.9
    assert await producer.export() is first  # default 2 s
    assert await producer.export(max_age_ms=1900 + 1) is first
    second = await producer.export(max_age_ms=1000)
    assert second is not first and second.exported_at == 101.9
    clock.now = 103.9
    assert await producer.export(max_age_ms=0) is not second  # 2 s old, default would reuse
    assert producer.stats.builds == 3


async def test_a_request_accepts_a_build_that_began_after_it_arrived() -> None:
    clock = Clock(0.0)
    producer = small_steps(view_of(populated()), clock=clock)
    gate = Gate()
    producer.yield_point = gate
    early = asyncio.create_task(producer.export(max_age_ms=0))  # arrives at 0, builds at 0
    await gate.parked.wait()
    clock.now = 1.0
    late = asyncio.create_task(producer.export(max_age_ms=0))  # arrives at 1: build 1 is old
    await eventually(lambda: producer.waiting == 2)
    clock.now = 2.0  # build 2 will be stamped at 2
    gate.release()
    first = await early
    queued = asyncio.create_task(producer.export(max_age_ms=0))  # arrives at 2, joins build 2
    second = await late
    assert (first.exported_at, second.exported_at) == (0.0, 2.0)
    assert await queued is second
    assert producer.stats.builds == 2


async def test_a_failed_encoding_is_unavailable_not_kept_and_made_again_on_the_next_request() -> (
    None
):
    producer = SnapshotProducer(view_of(populated()))
    entry = await producer.export()
    calls = 0

    def failing(value: object, content_type: str) -> bytes:
        nonlocal calls
        calls += 1
        raise OverflowError("cannot encode")

    producer.encode = failing
    with pytest.raises(SnapshotUnavailable):
        await producer.body(entry, JSON, gzip=False)
    assert JSON not in entry.bodies and producer.stats.failed == 1 and calls == 1
    assert gc.isenabled()  # the collector, paused within slices, is back on after a failure
    # The columnar body does not go through the format-1 encoder.
    assert decode(await producer.body(entry, COLUMNS, gzip=False), COLUMNS).node_count
    producer.encode = producer_mod.encode_value
    bodies = await asyncio.gather(*(producer.body(entry, JSON, gzip=False) for _ in range(3)))
    assert bodies[0] == bodies[1] == bodies[2] and decode(bodies[0]).node_count
    assert producer.cached is entry and producer.stats.builds == 1


async def test_a_failed_build_answers_unavailable_and_is_not_cached() -> None:
    view = view_of(populated())
    producer = SnapshotProducer(view)
    tree = view.tree
    view.tree = BrokenTree()  # type: ignore[assignment]
    with pytest.raises(SnapshotUnavailable):
        await producer.export()
    assert producer.cached is None and producer.stats.failed == 1
    assert gc.isenabled()
    view.tree = tree
    entry = await producer.export()
    assert producer.cached is entry and producer.stats.builds == 2


class BrokenTree(BlockTree):
    """A tree whose walk cannot even begin."""

    def __init__(self) -> None:
        super().__init__(BS)

    @property
    def _nodes(self) -> dict:  # type: ignore[override]
        raise RuntimeError("corrupt index")

    @_nodes.setter
    def _nodes(self, value: dict) -> None:
        pass


async def test_gzip_is_made_once_and_a_failed_one_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer = SnapshotProducer(view_of(populated()))
    entry = await producer.export()
    real: Callable[[bytes], bytes] = producer_mod.gzip_bytes

    def failing(data: bytes) -> bytes:
        raise MemoryError

    monkeypatch.setattr(producer_mod, "gzip_bytes", failing)
    with pytest.raises(SnapshotUnavailable):
        await producer.body(entry, MSGPACK, gzip=True)
    assert MSGPACK not in entry.gzipped
    made = 0

    def counting(data: bytes) -> bytes:
        nonlocal made
        made += 1
        return real(data)

    monkeypatch.setattr(producer_mod, "gzip_bytes", counting)
    bodies = await asyncio.gather(*(producer.body(entry, MSGPACK, gzip=True) for _ in range(3)))
    assert made == 1 and bodies[0] == bodies[1] == bodies[2]
    assert gzip.decompress(bodies[0]) == await producer.body(entry, MSGPACK, gzip=False)


# -- cursor tables -------------------------------------------------------------------------


async def test_the_cursor_table_keeps_witnesses_the_full_export_loses() -> None:
    tree = populated()
    view = view_of(tree)
    tree.clear_rank(B)  # B holds nothing now, but its cursor is still a valid witness
    view.cursors[B] = 41
    producer = SnapshotProducer(view)
    table = producer.cursor_table()
    assert table.nodes == [] and table.producer_ready
    assert cursors_by_rank(table) == {A: 5, B: 41, C: 5, D: 5, E: 5}
    full = await exported(producer)
    assert B not in cursors_by_rank(full)


def test_the_cursor_table_never_touches_the_cache_and_reports_an_empty_tree_not_ready() -> None:
    view = View(BlockTree(BS), {A: 3}, {A})
    producer = SnapshotProducer(view)
    table = producer.cursor_table()
    assert cursors_by_rank(table) == {A: 3} and not table.producer_ready
    assert producer.cached is None and producer.stats.builds == 0
    no_block_size = SnapshotProducer(View(None)).cursor_table()
    assert (no_block_size.block_size, no_block_size.producer_ready) == (0, False)


# -- listing, memory -----------------------------------------------------------------------


async def test_nodes_are_listed_while_the_writer_is_held_and_walked_while_it_runs() -> None:
    tree = populated()
    before = canonical_view(tree)
    view = view_of(tree)
    producer = small_steps(view, list_step=2)
    held = False
    seen: list[bool] = []

    async def hold(job: Callable[[], object]) -> None:
        nonlocal held
        held = True
        try:
            await job()  # type: ignore[misc]
        finally:
            held = False

    async def pump_between_slices() -> None:
        seen.append(held)
        if not held and len(seen) < 50:  # the pump writes only when it is not held
            tree.store(A, None, [2000 + len(seen)], [len(seen) % 256] * BS, BS)

    producer.hold_writer = hold
    producer.yield_point = pump_between_slices
    snap = await exported(producer, MSGPACK)
    listing_yields = (len(before) + 1) // 2 - 1  # a yield between slices of 2 nodes
    assert seen[:listing_yields] == [True] * listing_yields
    assert not any(seen[listing_yields:])  # the walk ran with the pump free
    assert len(tree) > len(before)  # and the pump did write meanwhile
    # Blocks stored after the listing are not in the export (the replay brings them).
    assert canonical_view(restored(snap)) == before


async def test_a_cached_export_is_dropped_once_its_ttl_has_passed() -> None:
    clock = Clock(100.0)
    producer = SnapshotProducer(view_of(populated()), clock=clock)
    entry = await producer.export()
    columns = entry.columns
    assert producer.cached_bytes == sum(
        len(a) * a.itemsize
        for a in (
            columns.parents,
            columns.keys,
            columns.carrier_counts,
            columns.carrier_workers,
            columns.carrier_tiers,
            columns.carrier_hashes,
        )
    )
    clock.now = 101.99
    assert not producer.expire()
    assert producer.cached is entry
    clock.now = 102.0
    assert producer.expire()
    assert producer.cached is None and producer.cached_bytes == 0
    assert await producer.export() is not entry
    assert producer.stats.builds == 2


async def test_the_expiry_timer_drops_the_cached_export_by_itself() -> None:
    producer = SnapshotProducer(view_of(populated()), cache_ttl_s=0.05)
    await producer.export()
    assert producer.cached is not None
    await eventually(lambda: producer.cached is None)
    assert producer.cached_bytes == 0


async def test_the_columnar_body_is_written_from_the_columns_not_a_copy() -> None:
    producer = SnapshotProducer(view_of(populated()))
    entry = await producer.export()
    parts = await producer.body_parts(entry, COLUMNS, gzip=False)
    owners = {id(memoryview(part).obj) for part in parts if isinstance(part, memoryview)}
    assert id(entry.columns.keys) in owners and id(entry.columns.carrier_hashes) in owners
    # The JSON body is made once and counted in what the export holds.
    held = producer.cached_bytes
    json_body = await producer.body(entry, JSON, gzip=False)
    assert producer.cached_bytes == held + len(json_body)
    assert as_format1(decode(await producer.body(entry, COLUMNS, gzip=False), COLUMNS)) == (
        as_format1(decode(json_body, JSON))
    )
    zipped = await producer.body(entry, COLUMNS, gzip=True)
    assert gzip.decompress(zipped) == await producer.body(entry, COLUMNS, gzip=False)


async def test_an_expired_export_is_freed_at_once_not_at_the_next_full_collection() -> None:
    clock = Clock(100.0)
    producer = SnapshotProducer(view_of(populated()), clock=clock, cache_ttl_s=0.05)
    entry = await producer.export()
    await producer.body(entry, JSON, gzip=False)
    keys = weakref.ref(entry.columns.keys)
    del entry
    gc.disable()  # a reference cycle would survive until a collection
    try:
        clock.now = 101.0
        await eventually(lambda: producer.cached is None)  # the timer's own call
        assert keys() is None
    finally:
        gc.enable()


async def test_an_expired_export_is_freed_though_the_writer_keeps_the_last_job_it_ran() -> None:
    """The pump holds the last job it ran until it runs another: that reference must not keep
    the export's columns alive (it did: ~200 MB at 6M blocks after the expiry)."""
    kept: list[Callable[[], object]] = []

    async def hold_like_the_pump(job: Callable[[], object]) -> None:
        kept.append(job)
        await job()  # type: ignore[misc]

    clock = Clock(100.0)
    producer = SnapshotProducer(
        view_of(populated()), clock=clock, hold_writer=hold_like_the_pump, cache_ttl_s=0.05
    )
    entry = await producer.export()
    keys = weakref.ref(entry.columns.keys)
    del entry
    clock.now = 101.0
    await eventually(lambda: producer.cached is None)
    gc.collect()
    assert kept and keys() is None


async def test_an_expired_export_is_released_to_the_os_once_dropped() -> None:
    clock = Clock(100.0)
    released: list[bool] = []
    producer = SnapshotProducer(
        view_of(populated()), clock=clock, release=lambda: released.append(producer.cached is None)
    )
    await producer.export()
    assert not producer.expire() and released == []
    clock.now = 103.0
    assert producer.expire()
    assert released == [True]  # after the export was dropped, once
    assert not producer.expire() and released == [True]
