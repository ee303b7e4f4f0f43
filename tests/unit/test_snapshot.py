import dataclasses
import random
from array import array
from bisect import bisect_right
from itertools import accumulate

import pytest

from cachetree.ranks import RankId
from cachetree.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotExport,
    SnapshotRestore,
    canonical_view,
    export,
    restore,
)
from cachetree.tiers import DEVICE, DISK, HOST
from cachetree.tree import COMPILED_LAYOUT, PURE_LAYOUT, BlockTree, TreeLayout

BS = 4
A = RankId("http://a:8000", 0)
B = RankId("http://b:8000", 0)
C = RankId("http://c:8000", 1)


def populated(seed: int = 7, chains: int = 60, layout: TreeLayout | None = None) -> BlockTree:
    """A tree with shared prefixes, several ranks, mixed tiers and a few removals."""
    rng = random.Random(seed)
    tree = BlockTree(BS, layout)
    prefixes = [[rng.randrange(1, 500) for _ in range(BS * 3)] for _ in range(5)]
    next_hash = 1
    for _ in range(chains):
        rank = rng.choice([A, B, C])
        tokens = rng.choice(prefixes) + [
            rng.randrange(1, 500) for _ in range(BS * rng.randint(0, 4))
        ]
        n = len(tokens) // BS
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        tier = rng.choice([DEVICE, DEVICE, HOST, DISK | DEVICE])
        tree.store(rank, None, hashes, tokens, BS, tier=tier)
        if rng.random() < 0.3:
            tree.remove(rank, hashes[-1:], rng.choice([None, HOST]))
    return tree


def test_round_trip_gives_an_identical_canonical_view() -> None:
    tree = populated()
    snap = export(tree)
    copy = BlockTree(BS)
    assert restore(copy, snap) == len(snap)
    assert canonical_view(copy) == canonical_view(tree)
    assert len(copy) == len(tree)
    assert copy.block_counts() == tree.block_counts()


def test_records_are_parent_before_child_and_only_on_carried_paths() -> None:
    tree = populated()
    snap = export(tree)
    records = list(snap.records())
    carried = [False] * len(records)
    for i in range(len(records) - 1, -1, -1):
        parent, _, carriers = records[i]
        assert parent is None or parent < i
        carried[i] = carried[i] or bool(carriers)
        if parent is not None and carried[i]:
            carried[parent] = True
    assert all(carried)


def test_restored_tree_resolves_later_removals_by_engine_hash() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], list(range(8)), BS)
    copy = BlockTree(BS)
    restore(copy, export(tree))
    assert copy.remove(A, [11], None) == 1
    assert copy.remove(A, [10], None) == 1
    assert len(copy) == 0


def test_restore_onto_a_non_empty_tree_unions_carriers_and_tiers() -> None:
    source = BlockTree(BS)
    source.store(A, None, [10, 11], list(range(8)), BS, tier=HOST)
    target = BlockTree(BS)
    target.store(A, None, [10], list(range(4)), BS)
    target.store(B, None, [20], list(range(4)), BS)
    restore(target, export(source))
    from cachetree.keys import block_keys

    k0, k1 = block_keys(list(range(8)), BS)
    assert target.carriers(k0) == {A: DEVICE | HOST, B: DEVICE}
    assert target.carriers(k1) == {A: HOST}


def test_chunked_export_and_restore_equal_the_one_shot_versions() -> None:
    tree = populated(chains=200)
    job = SnapshotExport(tree)
    steps = 0
    while not job.step(7):
        steps += 1
    assert steps > 3
    snap = job.result()
    assert list(snap.records()) == list(export(tree).records())
    copy = BlockTree(BS)
    restore_job = SnapshotRestore(copy, snap)
    while not restore_job.step(5):
        pass
    assert canonical_view(copy) == canonical_view(tree)


def test_export_between_chunks_skips_subtrees_pruned_meanwhile() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [1, 2, 3], list(range(12)), BS)
    tree.store(B, None, [9], list(range(100, 104)), BS)
    job = SnapshotExport(tree)
    job.step(1)  # the first root only
    tree.remove(A, [3, 2], None)  # block 1 and 2 of A's chain vanish mid-export
    while not job.step(1):
        pass
    snap = job.result()
    copy = BlockTree(BS)
    restore(copy, snap)
    assert canonical_view(copy) == canonical_view(tree)


def test_unfinished_export_has_no_result() -> None:
    job = SnapshotExport(populated())
    with pytest.raises(RuntimeError):
        job.result()


def bad_snapshots() -> dict[str, Snapshot]:
    good = export(populated())
    cases: dict[str, Snapshot] = {}

    def variant(name: str, **columns: object) -> None:
        fields = {f: getattr(good, f) for f in Snapshot.__slots__}
        fields.update({k: v for k, v in columns.items()})
        cases[name] = Snapshot(**fields)

    parents = array("q", good.parents)
    parents[3] = 5
    variant("forward_parent", parents=parents)
    parents = array("q", good.parents)
    parents[4] = 4
    variant("self_parent", parents=parents)
    parents = array("q", good.parents)
    parents[2] = -7
    variant("negative_parent", parents=parents)
    workers = array("I", good.carrier_workers)
    workers[0] = len(good.workers)
    variant("worker_out_of_range", carrier_workers=workers)
    tiers = array("B", good.carrier_tiers)
    tiers[0] = 16
    variant("unknown_tier_bits", carrier_tiers=tiers)
    tiers = array("B", good.carrier_tiers)
    tiers[0] = 0
    variant("empty_tier_bits", carrier_tiers=tiers)
    keys = array("Q", good.keys)
    keys[5] = keys[2]
    variant("duplicate_key", keys=keys)
    variant("short_parents", parents=array("q", good.parents[:-1]))
    variant("carrier_count_mismatch", carrier_hashes=array("Q", good.carrier_hashes[:-1]))
    counts = array("I", good.carrier_counts)
    counts[0] += 1
    variant("counts_do_not_add_up", carrier_counts=counts)
    variant("duplicate_worker_row", workers=[*good.workers, good.workers[0]])
    variant("malformed_worker_row", workers=[("http://x", -1)])
    return cases


@pytest.mark.parametrize("case", sorted(bad_snapshots()))
def test_every_rejection_leaves_the_tree_untouched(case: str) -> None:
    snap = bad_snapshots()[case]
    target = BlockTree(BS)
    target.store(A, None, [500], list(range(900, 904)), BS)
    before = canonical_view(target)
    with pytest.raises(SnapshotError):
        restore(target, snap)
    assert canonical_view(target) == before
    assert target.ranks() == [A]


def prevalidated_graft(tree: BlockTree, snap: Snapshot, budget: int) -> SnapshotRestore:
    job = SnapshotRestore(tree, snap, prevalidated=True)
    while not job.step(budget):
        pass
    return job


def test_a_prevalidated_graft_refuses_a_repeated_key_before_placing_its_chunk() -> None:
    snap = export(populated())
    keys = array("Q", snap.keys)
    keys[7] = keys[2]  # records 2 and 7: one key, two places
    repeated = Snapshot(
        snap.workers,
        snap.parents,
        keys,
        snap.carrier_counts,
        snap.carrier_workers,
        snap.carrier_tiers,
        snap.carrier_hashes,
    )
    for budget in (len(snap), 5):  # one chunk; or the repeat in a later chunk than the first
        tree = BlockTree(BS)
        tree.store(A, None, [500], list(range(900, 904)), BS)
        before = canonical_view(tree)
        with pytest.raises(SnapshotError, match="appears twice"):
            prevalidated_graft(tree, repeated, budget)
        # What earlier chunks placed is consistent: clearing the grafted ranks restores it.
        for rank in repeated.workers:
            if rank != A:
                tree.clear_rank(rank)
        tree.clear_rank(A)
        tree.store(A, None, [500], list(range(900, 904)), BS)
        assert canonical_view(tree) == before and len(tree) == 1


def test_a_graft_onto_an_engine_hash_the_rank_already_uses_moves_it_to_the_new_block() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [7], list(range(4)), BS)  # A maps engine hash 7 to this block
    (old_key,) = tree._iter_keys()
    snap = Snapshot.from_records([A, B], [(None, 99, ((0, DEVICE, 7), (1, HOST, 8)))])
    prevalidated_graft(tree, snap, 4096)
    assert tree.carriers(99) == {A: DEVICE, B: HOST}
    assert old_key not in tree  # the newest placement of hash 7 wins; the old block is bare
    assert tree.engine_hash(A, 99) == 7 and tree.block_count(A) == 1
    assert tree.remove(A, [7]) == 1 and tree.carriers(99) == {B: HOST}


def graft_record_by_record(tree: BlockTree, snap: Snapshot) -> None:
    """The graft's meaning, spelled out: each record's carriers placed one at a time by the
    tree's own `_place` (creating a carrier-less record as bare structure)."""
    ranks = [tree._ranks.get(rank) or tree._add_rank(rank) for rank in snap.workers]
    for parent, key, carriers in snap.records():
        parent_key = None if parent is None else snap.keys[parent]
        if not carriers and key not in tree:
            tree._nodes[key] = tree._layout.node(parent_key, 0, 0)
            if parent_key is not None:
                tree._nodes[parent_key].children += 1
        for worker, bits, engine_hash in carriers:
            tree._place(ranks[worker], parent_key, (key,), (engine_hash,), bits)


@pytest.mark.parametrize("budget", [1, 3, 4096])
def test_a_chunked_graft_onto_a_warm_tree_equals_placing_each_carrier(budget: int) -> None:
    snap = export(populated(seed=3, chains=200))
    # The same first 80 chains: the graft both creates blocks and merges into held ones.
    warm, expected = populated(seed=3, chains=80), populated(seed=3, chains=80)
    assert 0 < sum(key in warm for key in snap.keys) < len(snap)
    graft_record_by_record(expected, snap)
    prevalidated_graft(warm, snap, budget)
    assert canonical_view(warm) == canonical_view(expected)
    assert warm.block_counts() == expected.block_counts()
    for key in warm._iter_keys():  # child counts are exact, so pruning will work
        node = warm._node(key)
        assert node is not None
        assert node.children == sum(1 for k in warm._iter_keys() if warm._node(k).parent == key)


def test_duplicate_carrier_in_one_record_is_rejected() -> None:
    snap = Snapshot.from_records([A], [(None, 5, ((0, DEVICE, 1), (0, HOST, 2)))])
    with pytest.raises(SnapshotError, match="listed twice"):
        restore(BlockTree(BS), snap)


def test_a_key_held_under_another_parent_is_rejected() -> None:
    tree = BlockTree(BS)
    tree.store(A, None, [10, 11], list(range(8)), BS)
    existing_child = list(tree._iter_keys())[1]
    snap = Snapshot.from_records([B], [(None, existing_child, ((0, DEVICE, 1),))])
    before = canonical_view(tree)
    with pytest.raises(SnapshotError, match="another parent"):
        restore(tree, snap)
    assert canonical_view(tree) == before


@pytest.mark.parametrize(
    "records",
    [
        [(None, -5, ())],
        [(None, 2**64, ())],
        [(None, "k", ())],
        [(None, 5, ((0, DEVICE, -1),))],
        [(None, 5, ((0, True, 1),))],
        [(0.5, 5, ())],
        [(None, 5, ((0, DEVICE),))],
    ],
)
def test_malformed_records_are_refused_when_building_columns(records: list) -> None:
    with pytest.raises(SnapshotError):
        Snapshot.from_records([A], records)


def test_records_without_a_carrier_below_them_are_not_grafted() -> None:
    snap = Snapshot.from_records(
        [A],
        [(None, 1, ()), (0, 2, ()), (None, 3, ()), (2, 4, ((0, DEVICE, 44),))],
    )
    tree = BlockTree(BS)
    assert restore(tree, snap) == 2
    assert set(tree._iter_keys()) == {3, 4}


def test_canonical_view_differs_when_a_tier_differs() -> None:
    one = BlockTree(BS)
    two = BlockTree(BS)
    one.store(A, None, [10], list(range(4)), BS)
    two.store(A, None, [10], list(range(4)), BS, tier=HOST)
    assert canonical_view(one) != canonical_view(two)


def test_a_prevalidated_restore_skips_only_structure_and_still_refuses_a_conflict() -> None:
    tree = populated()
    copy = BlockTree(BS)
    job = SnapshotRestore(copy, export(tree), prevalidated=True)
    while not job.step(7):
        pass
    assert canonical_view(copy) == canonical_view(tree)
    other = BlockTree(BS)
    other.store(A, None, [10, 11], list(range(8)), BS)
    child = list(other._iter_keys())[1]
    conflicting = Snapshot.from_records([B], [(None, child, ((0, DEVICE, 1),))])
    before = canonical_view(other)
    with pytest.raises(SnapshotError, match="another parent"):
        restore_job = SnapshotRestore(other, conflicting, prevalidated=True)
        while not restore_job.step():
            pass
    assert canonical_view(other) == before


# -- the column-wise walk and graft against their meaning, on random trees -------------------


def random_tree(rng: random.Random, ops: int) -> BlockTree:
    """Stores under known parents, engine hashes reused (a small range), mixed tiers,
    removals by tier, cleared ranks: every shape the tree's rules produce."""
    tree = BlockTree(BS)
    stored: dict[RankId, list[int]] = {rank: [] for rank in (A, B, C)}
    for _ in range(ops):
        rank = rng.choice((A, B, C))
        op = rng.random()
        if op < 0.6:
            parent = rng.choice(stored[rank]) if stored[rank] and rng.random() < 0.6 else None
            hashes = [rng.randint(1, 30) for _ in range(rng.randint(1, 3))]
            tokens = [rng.randint(1, 6) for _ in range(len(hashes) * BS)]
            tier = rng.choice([DEVICE, DEVICE, HOST, DEVICE | DISK])
            if tree.store(rank, parent, hashes, tokens, BS, tier=tier):
                stored[rank] += hashes
        elif op < 0.9 and stored[rank]:
            tree.remove(rank, [rng.choice(stored[rank])], rng.choice([None, HOST, DEVICE]))
        elif op >= 0.95:
            tree.clear_rank(rank)
            stored[rank] = []
    return tree


def spelled_out_export(tree: BlockTree) -> list[tuple]:
    """The export's meaning: every node in the tree's order, its parent by record index and
    its carriers as (rank, tier bits, engine hash) in rank-index order."""
    index: dict[int, int] = {}
    out = []
    for key in tree._iter_keys():
        node = tree._node(key)
        assert node is not None
        index[key] = len(out)
        carriers = tuple(
            (tree._rank_of(i), bits, eh) for i, bits, eh in tree._carriers_with_hash(node)
        )
        out.append((None if node.parent is None else index[node.parent], key, carriers))
    return out


@pytest.mark.parametrize("seed", range(0, 300, 3))
def test_the_walk_and_the_graft_mean_what_one_node_at_a_time_would(seed: int) -> None:
    rng = random.Random(seed)
    source = random_tree(rng, rng.randint(0, 40))
    snap = export(source)
    named = [
        (parent, key, tuple((snap.workers[w], bits, eh) for w, bits, eh in carriers))
        for parent, key, carriers in snap.records()
    ]
    assert named == spelled_out_export(source)
    for warm_seed in (None, seed + 1):
        budget = rng.choice([1, 3, 4096])
        target = BlockTree(BS) if warm_seed is None else random_tree(random.Random(warm_seed), 30)
        expected = BlockTree(BS) if warm_seed is None else random_tree(random.Random(warm_seed), 30)
        graft_record_by_record(expected, snap)
        prevalidated_graft(target, snap, budget)
        assert canonical_view(target) == canonical_view(expected)
        assert target.block_counts() == expected.block_counts()


def test_a_listing_in_chunks_exports_what_a_one_shot_listing_does() -> None:
    tree = populated(chains=50)
    job = SnapshotExport(tree)
    chunks = 0
    while not job.list_step(3):
        chunks += 1
    assert chunks == (len(tree) + 2) // 3 - 1
    while not job.step(4):
        pass
    assert list(job.result().records()) == list(export(tree).records())


def test_a_tree_written_between_listing_chunks_is_refused() -> None:
    tree = populated(chains=50)
    job = SnapshotExport(tree)
    job.list_step(3)
    tree.store(A, None, [7777], list(range(900, 900 + BS)), BS)
    with pytest.raises(RuntimeError):
        job.list_step(3)


# -- the compiled graft (`_tables.graft_new`) against the pure layout's ------------------------

LAYOUTS = [PURE_LAYOUT] + ([COMPILED_LAYOUT] if COMPILED_LAYOUT is not None else [])


def device_only(seed: int = 3, chains: int = 40) -> BlockTree:
    """Shared prefixes on four ranks, device tier only; some blocks carried by two ranks under
    different engine hashes, some under the same one: what the compiled graft takes."""
    rng = random.Random(seed)
    tree = BlockTree(BS)
    ranks = [A, B, C, RankId("http://d:8000", 0)]
    prefixes = [[rng.randrange(1, 500) for _ in range(BS * 2)] for _ in range(4)]
    for c in range(chains):
        tokens = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(BS * 2)]
        hashes = [1000 * c + i for i in range(len(tokens) // BS)]
        tree.store(rng.choice(ranks), None, hashes, tokens, BS)
        if c % 3 == 0:
            other = [h + (0 if c % 2 else 500) for h in hashes]
            tree.store(rng.choice(ranks), None, other, tokens, BS)
    return tree


def maps_of(tree: BlockTree) -> dict:
    return {r: (dict(st.by_engine_hash.items()), st.counts) for r, st in tree._ranks.items()}


def counted(layout: TreeLayout, codes: list[int]) -> TreeLayout:
    if layout.graft_new is None:
        return layout
    native = layout.graft_new

    def graft_new(*args: object) -> tuple[int, int]:
        out = native(*args)
        codes.append(out[0])
        return out

    return dataclasses.replace(layout, graft_new=graft_new)


@pytest.mark.parametrize("budget", [1, 7, 1 << 20])
def test_both_layouts_graft_a_device_tree_alike(budget: int) -> None:
    source = device_only()
    snap = export(source)
    results = []
    for layout in LAYOUTS:
        codes: list[int] = []
        tree = BlockTree(BS, counted(layout, codes))
        tree.store(A, None, [7], list(range(900, 900 + BS)), BS)  # warm: one block of its own
        prevalidated_graft(tree, snap, budget)
        tree.recount()
        results.append((canonical_view(tree), maps_of(tree)))
        if layout is COMPILED_LAYOUT:
            assert codes and set(codes) == {0}  # the compiled graft did the creating
    assert all(r == results[0] for r in results)
    assert len(results[0][0]) == len(source) + 1


def test_a_repeated_key_is_refused_alike_with_the_tree_as_before_its_chunk() -> None:
    snap = export(device_only())
    keys = array("Q", snap.keys)
    keys[9] = keys[4]
    repeated = dataclasses.replace(snap, keys=keys)
    views = []
    for layout in LAYOUTS:
        codes: list[int] = []
        tree = BlockTree(BS, counted(layout, codes))
        with pytest.raises(SnapshotError, match="appears twice"):
            prevalidated_graft(tree, repeated, 6)  # records 0-5 placed, 6-11 refused
        tree.recount()
        views.append((canonical_view(tree), maps_of(tree)))
        if layout is COMPILED_LAYOUT:
            assert codes == [0, 2]
    assert all(v == views[0] for v in views)
    assert len(views[0][0]) == 6


def test_an_engine_hash_the_rank_uses_elsewhere_goes_the_general_way_alike() -> None:
    snap = export(device_only())
    taken = snap.carrier_hashes[5]
    rank = snap.workers[snap.carrier_workers[5]]
    record = bisect_right(list(accumulate(snap.carrier_counts)), 5)  # the record of carrier 5
    views = []
    for layout in LAYOUTS:
        codes: list[int] = []
        tree = BlockTree(BS, counted(layout, codes))
        tree.store(rank, None, [taken], list(range(900, 900 + BS)), BS)
        prevalidated_graft(tree, snap, 1 << 20)
        tree.recount()
        views.append((canonical_view(tree), maps_of(tree)))
        if layout is COMPILED_LAYOUT:
            assert codes == [1]  # refused, nothing changed, then `_place` one by one
    assert all(v == views[0] for v in views)
    assert tree.key_of(rank, taken) == snap.keys[record]  # the newest placement wins


def test_a_parent_that_left_between_chunks_is_refused_alike() -> None:
    snap = Snapshot.from_records(
        [A], [(None, 10, ((0, DEVICE, 100),)), (0, 11, ((0, DEVICE, 101),))]
    )
    for layout in LAYOUTS:
        tree = BlockTree(BS, layout)
        job = SnapshotRestore(tree, snap, prevalidated=True)
        while 10 not in tree:
            job.step(1)
        assert tree.remove(A, [100]) == 1 and 10 not in tree
        with pytest.raises(SnapshotError, match="record 0: the block left the tree"):
            job.step(1)
        assert len(tree) == 0 and tree.block_count(A) == 0


def many_ranks(seed: int, n_ranks: int, layout: TreeLayout) -> BlockTree:
    """Shared prefixes over `n_ranks` ranks (70: rank indices past one machine word), carriers
    agreeing and disagreeing on engine hashes, other tiers, removals and rank clears."""
    rng = random.Random(seed)
    tree = BlockTree(BS, layout)
    ranks = [RankId(f"http://w{i}:8000", i % 3) for i in range(n_ranks)]
    prefixes = [[rng.randrange(1, 300) for _ in range(BS * 2)] for _ in range(6)]
    for c in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(1, 300) for _ in range(BS * 2)]
        hashes = [10_000 * c + i for i in range(len(tokens) // BS)]
        if rng.random() < 0.3:
            hashes = [h % 997 for h in hashes]  # shared by other chains and ranks
        tier = rng.choice([DEVICE] * 6 + [HOST, DISK | DEVICE])
        rank = rng.choice(ranks)
        tree.store(rank, None, hashes, tokens, BS, tier=tier)
        if rng.random() < 0.2:
            tree.remove(rank, hashes[-2:], rng.choice([None, HOST]))
        if rng.random() < 0.02:
            tree.clear_rank(rng.choice(ranks))
    return tree


def columns(snap: Snapshot) -> tuple:
    return (
        snap.workers,
        *(
            list(c)
            for c in (
                snap.parents,
                snap.keys,
                snap.carrier_counts,
                snap.carrier_workers,
                snap.carrier_tiers,
                snap.carrier_hashes,
            )
        ),
    )


@pytest.mark.skipif(COMPILED_LAYOUT is None, reason="the compiled accelerator is not built")
@pytest.mark.parametrize("n_ranks", [3, 70])
@pytest.mark.parametrize("seed", range(6))
def test_both_layouts_export_the_same_columns(seed: int, n_ranks: int) -> None:
    assert COMPILED_LAYOUT is not None
    walked: list = []
    native = COMPILED_LAYOUT.walk_chunk
    assert native is not None

    def walk_chunk(*args: object) -> tuple | None:
        out = native(*args)
        walked.append(out is not None)
        return out

    compiled = dataclasses.replace(COMPILED_LAYOUT, walk_chunk=walk_chunk)
    for budget in (3, 1 << 20):
        trees = [many_ranks(seed, n_ranks, layout) for layout in (compiled, PURE_LAYOUT)]
        snaps = []
        for tree in trees:
            job = SnapshotExport(tree)
            while not job.step(budget):
                pass
            snaps.append(columns(job.result()))
        assert snaps[0] == snaps[1]
    if n_ranks == 3:
        assert all(walked)  # every chunk walked in C
    else:
        assert not all(walked)  # masks past 64 ranks: those chunks walked in Python


@pytest.mark.skipif(COMPILED_LAYOUT is None, reason="the compiled accelerator is not built")
def test_both_layouts_skip_alike_what_left_the_tree_between_chunks() -> None:
    snaps = []
    for layout in (COMPILED_LAYOUT, PURE_LAYOUT):
        assert layout is not None
        tree = many_ranks(1, 3, layout)
        job = SnapshotExport(tree)
        while not job.list_step(1 << 20):
            pass
        job.step(20)
        for rank in tree.ranks()[:1]:
            tree.clear_rank(rank)
        while not job.step(20):
            pass
        snaps.append(columns(job.result()))
    assert snaps[0] == snaps[1]


@pytest.mark.skipif(COMPILED_LAYOUT is None, reason="the compiled accelerator is not built")
def test_a_graft_sizes_the_compiled_tables_once_before_its_first_chunk() -> None:
    snap = export(device_only(chains=400))
    tree = BlockTree(BS, COMPILED_LAYOUT)
    job = SnapshotRestore(tree, snap, prevalidated=True)
    while not len(tree):  # validation steps, then the first graft step
        job.step(8)
    sizes = [tree._nodes.__sizeof__()]
    while not job.step(8):
        sizes.append(tree._nodes.__sizeof__())
    assert set(sizes) == {sizes[0]} and len(tree) == len(snap)  # no rebuild after the first
