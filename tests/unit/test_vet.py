import random
from array import array
from collections.abc import Callable, Sequence

import pytest

from cachetree.keys import KEY_SCHEME
from cachetree.ranks import RankId
from cachetree.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotRestore,
    canonical_view,
    export,
    restore,
)
from cachetree.tiers import DEVICE, DISK, HOST
from cachetree.tree import BlockTree
from peer import wire
from peer.vet import (
    COLD_PEER,
    REASONS,
    REJECTED,
    Retaining,
    VetError,
    VettedSnapshot,
    Vetting,
)
from peer.wire import PeerSnapshot, WireNode, WireWorker

BS = 4
A0 = RankId("http://a:8000", 0)
A1 = RankId("http://a:8000", 1)
B0 = RankId("http://b:8000", 0)
STRANGER = RankId("http://stranger:8000", 0)
LIVE = frozenset({A0, A1, B0})


# -- builders ------------------------------------------------------------------------------


def body(
    nodes: list,
    workers: Sequence = (A0, A1, B0),
    cursors: list | None = None,
    **fields,
) -> PeerSnapshot:
    """A format-1 body. `nodes` are (parent, key, [(worker index, bits, engine hash)])."""
    table = [w if isinstance(w, WireWorker) else WireWorker(w[0], w[1]) for w in workers]
    values = {
        "format": 1,
        "block_size": BS,
        "key_scheme": KEY_SCHEME,
        "producer_ready": True,
        "workers": table,
        "cursors": [(i, 10 + i) for i in range(len(table))] if cursors is None else cursors,
        "nodes": [WireNode(p, k, [tuple(c) for c in cs]) for p, k, cs in nodes],
        "empty_ranks": [],
    }
    values.update(fields)
    return PeerSnapshot(**values)


# Two chains: 11 -> 12 -> 13 and 21. Node 12 has two carriers.
CHAIN = [
    (None, 11, [(0, DEVICE, 101)]),
    (0, 12, [(0, DEVICE, 102), (2, HOST, 202)]),
    (1, 13, [(1, DEVICE, 303)]),
    (None, 21, [(2, DEVICE, 221)]),
]


def vet(snap: PeerSnapshot, live=LIVE, block_size: int | None = BS) -> VettedSnapshot:
    return VettedSnapshot.from_wire(snap, live, block_size)


def refused(snap: PeerSnapshot, live=LIVE, block_size: int | None = BS) -> VetError:
    with pytest.raises(VetError) as caught:
        vet(snap, live, block_size)
    return caught.value


def records(vetted: VettedSnapshot) -> list[tuple]:
    """Records with carriers named by rank: (parent, key, ((rank, bits, hash), ...))."""
    workers = vetted.snapshot.workers
    return [
        (parent, key, tuple((workers[w], bits, h) for w, bits, h in carriers))
        for parent, key, carriers in vetted.snapshot.records()
    ]


def populated(seed: int, chains: int = 80) -> BlockTree:
    """A tree with shared prefixes, three ranks, mixed tiers and some removals."""
    rng = random.Random(seed)
    tree = BlockTree(BS)
    prefixes = [[rng.randrange(1, 500) for _ in range(BS * 3)] for _ in range(5)]
    next_hash = 1
    for _ in range(chains):
        rank = rng.choice([A0, A1, B0])
        tail = [rng.randrange(1, 500) for _ in range(BS * rng.randint(0, 4))]
        tokens = rng.choice(prefixes) + tail
        n = len(tokens) // BS
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        tree.store(rank, None, hashes, tokens, BS, tier=rng.choice([DEVICE, HOST, DEVICE | DISK]))
        if rng.random() < 0.3:
            tree.remove(rank, hashes[: rng.randint(1, n)], rng.choice([None, HOST]))
    return tree


def to_wire(snap: Snapshot, cursors: dict[RankId, int] | None = None) -> PeerSnapshot:
    index = {rank: i for i, rank in enumerate(snap.workers)}
    return PeerSnapshot(
        format=wire.FORMAT,
        block_size=BS,
        key_scheme=KEY_SCHEME,
        producer_ready=True,
        workers=[WireWorker(r.worker_url, r.dp_rank) for r in snap.workers],
        cursors=[(index[r], seq) for r, seq in (cursors or {}).items()],
        nodes=[WireNode(p, k, list(c)) for p, k, c in snap.records()],
    )


def restored(vetted: VettedSnapshot) -> BlockTree:
    tree = BlockTree(BS)
    restore(tree, vetted.snapshot)
    return tree


def without(tree: BlockTree, *ranks: RankId) -> BlockTree:
    """A copy of `tree` with `ranks` cleared, as its own stream would leave it."""
    copy = BlockTree(BS)
    restore(copy, export(tree))
    for rank in ranks:
        copy.clear_rank(rank)
    return copy


# -- the header ----------------------------------------------------------------------------


def test_the_only_retriable_verdicts_are_a_cold_producer_and_nothing_usable() -> None:
    assert set(REASONS.values()) == {REJECTED, COLD_PEER}
    assert {r for r, outcome in REASONS.items() if outcome == COLD_PEER} == {
        "producer_cold",
        "nothing_usable",
    }


def test_a_body_of_another_format_is_rejected_for_good() -> None:
    error = refused(body(CHAIN, format=2))
    assert (error.outcome, error.reason) == (REJECTED, "unknown_format")
    assert not error.retriable


def test_a_body_keyed_by_another_scheme_is_rejected_for_good() -> None:
    error = refused(body(CHAIN, key_scheme="sha256-page"))
    assert (error.outcome, error.reason) == (REJECTED, "key_scheme_mismatch")


def test_a_producer_that_is_not_ready_is_a_cold_peer_even_with_nodes() -> None:
    error = refused(body(CHAIN, producer_ready=False))
    assert (error.outcome, error.reason) == (COLD_PEER, "producer_cold")
    assert error.retriable


def test_a_ready_producer_with_no_nodes_is_a_cold_peer() -> None:
    error = refused(body([]))
    assert (error.outcome, error.reason) == (COLD_PEER, "producer_cold")


def test_coldness_is_judged_before_the_block_size() -> None:
    error = refused(body(CHAIN, producer_ready=False, block_size=0))
    assert error.reason == "producer_cold"


def test_a_block_size_mismatch_is_rejected() -> None:
    error = refused(body(CHAIN, block_size=16))
    assert (error.outcome, error.reason) == (REJECTED, "block_size_mismatch")


def test_the_peers_block_size_is_taken_when_ours_is_unknown() -> None:
    assert vet(body(CHAIN, block_size=16), block_size=None).block_size == 16


def test_a_ready_producer_without_a_block_size_is_rejected() -> None:
    error = refused(body(CHAIN, block_size=0), block_size=None)
    assert (error.outcome, error.reason) == (REJECTED, "invalid_block_size")


# -- the worker table: identities come from the live set -----------------------------------


def test_carriers_of_workers_this_replica_does_not_know_are_dropped_not_trusted() -> None:
    nodes = [
        (None, 11, [(1, DEVICE, 101), (0, DEVICE, 901)]),
        (0, 12, [(0, DEVICE, 902)]),  # only the stranger: pruned
        (None, 21, [(0, DEVICE, 921)]),  # only the stranger: pruned
    ]
    vetted = vet(body(nodes, workers=[STRANGER, A0]))
    assert records(vetted) == [(None, 11, ((A0, DEVICE, 101),))]
    assert vetted.snapshot.workers == [A0]
    assert vetted.snapshot.carrier_workers == array("I", [0])  # remapped from wire index 1
    assert vetted.cursors == {A0: 11}
    assert vetted.dropped_workers == 1
    assert vetted.dropped_carriers == 3
    assert vetted.wire_nodes == 3


def test_rank_ids_are_the_live_sets_own_objects_never_minted_from_the_wire() -> None:
    live_a0 = RankId("http://a:8000", 0)
    vetted = vet(body([(None, 11, [(0, DEVICE, 101)])], workers=[("http://a:8000/", 0)]), [live_a0])
    assert vetted.snapshot.workers[0] is live_a0
    (cursor_rank,) = vetted.cursors
    assert cursor_rank is live_a0


def test_a_live_rank_spelled_with_a_trailing_slash_still_matches() -> None:
    live = [RankId("http://a:8000/", 0)]
    vetted = vet(body([(None, 11, [(0, DEVICE, 101)])], workers=[A0]), live)
    assert vetted.snapshot.workers == live


@pytest.mark.parametrize("columnar", [False, True])
def test_a_workers_url_as_written_is_the_registrys_spelling_of_it(columnar: bool) -> None:
    """A sibling of another version exports `--worker` as written; the registry keys the
    worker as `canonical_origin` spells it (localhost as 127.0.0.1, no default port)."""
    local, named = RankId("http://127.0.0.1:27001", 0), RankId("http://w", 1)
    nodes = [(None, 11, [(0, DEVICE, 101), (1, HOST, 201)]), (0, 12, [(1, DEVICE, 202)])]
    written = [("http://localhost:27001", 0), ("HTTP://W:80/", 1)]
    snap = body(nodes, workers=written, empty_ranks=[WireWorker("http://w:80", 1)])
    vetted = vet(as_columns(snap) if columnar else snap, [local, named, RankId("http://w", 0)])
    assert vetted.snapshot.workers == [local, named]
    assert vetted.cursors == {local: 10, named: 11}
    assert vetted.empty_ranks == {named}
    assert (vetted.dropped_workers, vetted.dropped_carriers) == (0, 0)
    assert records(vetted) == [
        (None, 11, ((local, DEVICE, 101), (named, HOST, 201))),
        (0, 12, ((named, DEVICE, 202),)),
    ]


def test_a_worker_named_twice_is_rejected_even_through_another_spelling() -> None:
    local = RankId("http://127.0.0.1:27001", 0)
    twice = [("http://127.0.0.1:27001", 0), ("http://localhost:27001", 0)]
    for live in ([local], [STRANGER]):
        error = refused(body([(None, 11, [(0, DEVICE, 1)])], workers=twice), live)
        assert (error.outcome, error.reason) == (REJECTED, "duplicate_worker")


def test_a_worker_named_twice_is_rejected_even_through_a_trailing_slash() -> None:
    error = refused(body(CHAIN, workers=[A0, A1, ("http://a:8000/", 0)]))
    assert (error.outcome, error.reason) == (REJECTED, "duplicate_worker")


def test_a_worker_named_twice_is_rejected_even_when_this_replica_does_not_know_it() -> None:
    # A rejection is permanent, so it must not depend on which workers happen to be live.
    error = refused(body(CHAIN, workers=[A0, A1, B0, STRANGER, STRANGER]))
    assert error.reason == "duplicate_worker"


def test_a_malformed_worker_entry_is_rejected() -> None:
    error = refused(body(CHAIN, workers=[A0, A1, WireWorker(8000, 0)]))  # type: ignore[arg-type]
    assert (error.outcome, error.reason) == (REJECTED, "malformed_worker")


def test_a_dp_rank_a_live_worker_does_not_have_is_implausible_and_rejected() -> None:
    """Not churn (a worker's ranks come and go together): a rank the fleet does not have."""
    error = refused(body([(None, 11, [(0, DEVICE, 101)])], workers=[("http://a:8000", 5)]))
    assert (error.outcome, error.reason) == (REJECTED, "unknown_rank")


# -- cursors -------------------------------------------------------------------------------


def test_cursors_of_unknown_or_out_of_range_workers_are_dropped() -> None:
    vetted = vet(body(CHAIN, workers=[A0, A1, B0, STRANGER], cursors=[(0, 5), (3, 6), (9, 7)]))
    assert vetted.cursors == {A0: 5}


def test_two_cursors_for_one_worker_are_rejected() -> None:
    error = refused(body(CHAIN, cursors=[(0, 5), (1, 6), (0, 7)]))
    assert (error.outcome, error.reason) == (REJECTED, "duplicate_cursor")


def test_a_negative_seq_is_rejected() -> None:
    error = refused(body(CHAIN, cursors=[(0, -1)]))
    assert (error.outcome, error.reason) == (REJECTED, "invalid_seq")


def test_a_cursor_that_is_not_a_pair_of_ints_is_rejected() -> None:
    assert refused(body(CHAIN, cursors=[(0, 5.0)])).reason == "malformed_cursor"
    assert refused(body(CHAIN, cursors=[(0, 5, 1)])).reason == "malformed_cursor"


def test_a_rank_may_have_a_cursor_and_no_blocks() -> None:
    # B0's cache was empty at seq 12: a valid state to graft (nothing) and resume from.
    vetted = vet(body([(None, 11, [(0, DEVICE, 101)])]))
    assert vetted.covered_ranks() == {A0, A1, B0}
    assert vetted.snapshot.workers == [A0]  # restore registers every table rank: only carriers


# -- node structure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parent",
    [2, 3, 99, -1, -5, 1.0, 2**63, "0"],
    ids=["self", "forward", "out-of-range", "minus-one", "negative", "float", "huge", "str"],
)
def test_a_parent_that_is_not_an_earlier_node_is_rejected(parent) -> None:
    nodes = [*CHAIN[:2], (parent, 13, [(1, DEVICE, 303)]), CHAIN[3]]
    error = refused(body(nodes))
    assert (error.outcome, error.reason) == (REJECTED, "invalid_parent")
    assert "node 2" in str(error)


@pytest.mark.parametrize("key", [-1, 2**64, 1.5, None], ids=["negative", "2**64", "float", "null"])
def test_a_key_that_is_not_a_u64_is_rejected(key) -> None:
    error = refused(body([*CHAIN, (None, key, [(0, DEVICE, 1)])]))
    assert (error.outcome, error.reason) == (REJECTED, "invalid_key")
    assert "node 4" in str(error)


@pytest.mark.parametrize("engine_hash", [-1, 2**64, 1.5], ids=["negative", "2**64", "float"])
def test_an_engine_hash_that_is_not_a_u64_is_rejected(engine_hash) -> None:
    error = refused(body([*CHAIN, (None, 31, [(0, DEVICE, engine_hash)])]))
    assert (error.outcome, error.reason) == (REJECTED, "invalid_engine_hash")


def test_the_engine_hash_of_an_unknown_workers_carrier_is_checked_too() -> None:
    nodes = [*CHAIN, (None, 31, [(0, DEVICE, 5), (3, DEVICE, -7)])]
    error = refused(body(nodes, workers=[A0, A1, B0, STRANGER]))
    assert error.reason == "invalid_engine_hash"


@pytest.mark.parametrize("bits", [-1, 1.0, "1"], ids=["negative", "float", "str"])
def test_tier_bits_that_are_not_a_non_negative_int_are_rejected(bits) -> None:
    error = refused(body([*CHAIN, (None, 31, [(0, bits, 5)])]))
    assert (error.outcome, error.reason) == (REJECTED, "invalid_tier_bits")


@pytest.mark.parametrize(
    "carrier", [(0.0, DEVICE, 5), (0, DEVICE), (None, DEVICE, 5)], ids=["float", "pair", "null"]
)
def test_a_carrier_that_is_not_three_ints_is_rejected(carrier) -> None:
    error = refused(body([*CHAIN, (None, 31, [carrier])]))
    assert (error.outcome, error.reason) == (REJECTED, "malformed_carrier")


@pytest.mark.parametrize(
    "carriers",
    [
        [(0, DEVICE, 5), (0, HOST, 6)],
        [(1, DEVICE, 5), (2, DEVICE, 6), (1, DEVICE, 7)],
        [(3, DEVICE, 5), (3, DEVICE, 5)],  # a worker this replica does not know
    ],
    ids=["two", "three", "unknown"],
)
def test_a_node_naming_one_worker_twice_is_rejected_not_repaired(carriers) -> None:
    error = refused(body([*CHAIN, (None, 31, carriers)], workers=[A0, A1, B0, STRANGER]))
    assert (error.outcome, error.reason) == (REJECTED, "duplicate_carrier")
    assert "node 4" in str(error)


def test_carriers_that_are_not_a_list_are_rejected() -> None:
    snap = body(CHAIN)
    snap.nodes.append(WireNode(None, 31, None))  # type: ignore[arg-type]
    error = refused(snap)
    assert (error.outcome, error.reason) == (REJECTED, "malformed_carrier")
    assert "node 4" in str(error)


def test_a_key_repeated_at_another_node_is_left_to_the_graft_which_refuses_it() -> None:
    vetted = VettedSnapshot.from_wire(body([*CHAIN, (3, 12, [(0, DEVICE, 5)])]), LIVE, BS)
    assert "duplicate_key" not in REASONS
    tree = BlockTree(BS)
    with pytest.raises(SnapshotError, match="appears twice"):
        job = SnapshotRestore(tree, vetted.snapshot, prevalidated=True)
        while not job.step():
            pass
    assert len(tree) == 0  # refused before the chunk that repeats it placed anything


def test_a_negative_key_decoded_from_json_is_rejected() -> None:
    raw = wire.encode(body(CHAIN)).replace(b"[null,21,", b"[null,-21,")
    error = refused(wire.decode(raw))
    assert error.reason == "invalid_key"


# -- carriers, tiers and pruning -----------------------------------------------------------


def test_out_of_range_carrier_indices_are_dropped() -> None:
    nodes = [(None, 11, [(0, DEVICE, 101), (7, DEVICE, 1), (-1, DEVICE, 2)])]
    vetted = vet(body(nodes))
    assert records(vetted) == [(None, 11, ((A0, DEVICE, 101),))]
    assert vetted.dropped_carriers == 2


@pytest.mark.parametrize("index", [2**63, 2**64, -(2**63) - 1, 10**30])
def test_a_carrier_index_past_64_bits_is_dropped_as_out_of_range(index: int) -> None:
    nodes = [(None, 11, [(0, DEVICE, 101), (index, DEVICE, 1), (index + 1, DEVICE, 2)])]
    vetted = vet(body(nodes))
    assert records(vetted) == [(None, 11, ((A0, DEVICE, 101),))]
    assert vetted.dropped_carriers == 2


def test_unknown_tier_bits_are_masked_off_and_known_ones_kept() -> None:
    vetted = vet(body([(None, 11, [(0, 0b110011, 101)])]))
    assert records(vetted) == [(None, 11, ((A0, DEVICE | HOST, 101),))]


def test_a_carrier_on_no_known_tier_is_dropped() -> None:
    vetted = vet(body([(None, 11, [(0, DEVICE, 101), (1, 0b10000, 102), (2, 0, 103)])]))
    assert records(vetted) == [(None, 11, ((A0, DEVICE, 101),))]
    assert vetted.dropped_carriers == 2


def test_a_node_carried_only_on_unknown_tiers_is_pruned() -> None:
    vetted = vet(body([(None, 11, [(0, DEVICE, 101)]), (0, 12, [(1, 0b10000, 102)])]))
    assert records(vetted) == [(None, 11, ((A0, DEVICE, 101),))]


def test_a_snapshot_carried_only_on_unknown_tiers_is_nothing_usable() -> None:
    error = refused(body([(None, 11, [(0, 0b10000, 101)]), (0, 12, [(1, 0b100000, 102)])]))
    assert (error.outcome, error.reason) == (COLD_PEER, "nothing_usable")


def test_a_snapshot_none_of_whose_workers_we_know_is_rejected_naming_a_few_of_each() -> None:
    """Not a cold peer: it is asked again and again and brings the same (another --worker
    list or version); the refusal is all the operator sees, so it names the workers."""
    many = [RankId(f"http://w{i}:8000", 0) for i in range(5)]
    error = refused(body(CHAIN, workers=many), live=[STRANGER])
    assert (error.outcome, error.reason) == (REJECTED, "unknown_workers")
    assert not error.retriable
    text = str(error)
    assert "names 5 worker rank(s), none known here" in text
    assert "http://w0:8000#dp0, http://w1:8000#dp0, http://w2:8000#dp0 and 2 more" in text
    assert "this replica's: http://stranger:8000#dp0" in text
    assert "same worker list" in text


def test_a_snapshot_some_of_whose_workers_we_know_is_not_refused_for_the_others() -> None:
    assert vet(body(CHAIN, workers=[A0, STRANGER, B0])).dropped_workers == 1


def test_carrier_less_interior_nodes_on_a_path_to_a_carrier_are_kept_as_structure() -> None:
    nodes = [(None, 11, []), (0, 12, [(1, DEVICE, 1)]), (1, 13, []), (2, 14, [(0, DEVICE, 2)])]
    vetted = vet(body(nodes))
    assert [(p, k) for p, k, _ in records(vetted)] == [(None, 11), (0, 12), (1, 13), (2, 14)]
    assert vetted.carrier_counts() == (2, 2)


def test_pruning_drops_bare_subtrees_and_renumbers_parents() -> None:
    nodes = [
        (None, 11, [(0, DEVICE, 1)]),  # 0 kept
        (0, 12, [(3, DEVICE, 2)]),  # 1 stranger only, no carried child: pruned
        (1, 13, [(3, DEVICE, 3)]),  # 2 pruned
        (None, 21, [(3, DEVICE, 4)]),  # 3 structure for node 4
        (3, 22, []),  # 4 structure for node 6
        (3, 23, []),  # 5 bare leaf: pruned
        (4, 24, [(1, HOST, 5)]),  # 6 kept
        (0, 14, [(3, DEVICE, 6)]),  # 7 pruned
    ]
    vetted = vet(body(nodes, workers=[A0, A1, B0, STRANGER]))
    assert records(vetted) == [
        (None, 11, ((A0, DEVICE, 1),)),
        (None, 21, ()),
        (1, 22, ()),
        (2, 24, ((A1, HOST, 5),)),
    ]
    assert vetted.carrier_counts() == (2, 2)
    assert vetted.snapshot.workers == [A0, A1]


def test_empty_ranks_resolve_against_the_live_set_and_unknown_ones_are_dropped() -> None:
    named = [WireWorker("http://b:8000/", 0), WireWorker(*STRANGER), WireWorker(*A1)]
    vetted = vet(body(CHAIN, empty_ranks=named))
    assert vetted.empty_ranks == {B0, A1}


def test_covers_any_is_false_when_the_peer_knows_none_of_our_ranks() -> None:
    vetted = vet(body(CHAIN, cursors=[(0, 5)]))
    assert vetted.covers_any([A0, STRANGER])
    assert not vetted.covers_any([A1, B0, STRANGER])
    assert not vetted.covers_any([])
    assert vetted.covered_ranks() == {A0}


# -- retain_workers ------------------------------------------------------------------------


def test_retain_workers_filters_to_pending_ranks_and_prunes_stranded_nodes() -> None:
    vetted = vet(body(CHAIN, empty_ranks=[WireWorker(*B0)]))
    kept = vetted.retain_workers([A1])
    # 11 and 12 stay as structure on the way to A1's 13; 21 (B0 only) goes.
    assert records(kept) == [(None, 11, ()), (0, 12, ()), (1, 13, ((A1, DEVICE, 303),))]
    assert kept.snapshot.workers == [A1]
    assert kept.cursors == {A1: 11}
    assert kept.empty_ranks == frozenset()
    assert kept.carrier_counts() == (1, 2)


def test_retain_workers_returns_a_new_snapshot_and_leaves_the_original_alone() -> None:
    vetted = vet(body(CHAIN))
    before = records(vetted)
    kept = vetted.retain_workers([A0, B0])
    assert kept is not vetted
    assert records(vetted) == before
    assert vetted.cursors == {A0: 10, A1: 11, B0: 12}
    assert records(kept) == [
        (None, 11, ((A0, DEVICE, 101),)),
        (0, 12, ((A0, DEVICE, 102), (B0, HOST, 202))),
        (None, 21, ((B0, DEVICE, 221),)),
    ]


def test_retaining_every_rank_keeps_every_record() -> None:
    vetted = vet(body(CHAIN))
    kept = vetted.retain_workers([A0, A1, B0, STRANGER])
    assert kept is not vetted
    assert records(kept) == records(vetted)
    assert kept.cursors == vetted.cursors


def test_retaining_a_rank_the_snapshot_does_not_name_grafts_nothing() -> None:
    kept = vet(body(CHAIN)).retain_workers([STRANGER])
    assert len(kept.snapshot) == 0
    assert kept.snapshot.workers == []
    assert kept.cursors == {}
    tree = BlockTree(BS)
    assert restore(tree, kept.snapshot) == 0
    assert len(tree) == 0 and tree.ranks() == []


# -- chunking ------------------------------------------------------------------------------


def columns(snap: Snapshot) -> tuple:
    return (
        snap.workers,
        snap.parents,
        snap.keys,
        snap.carrier_counts,
        snap.carrier_workers,
        snap.carrier_tiers,
        snap.carrier_hashes,
    )


def run_in_steps(job, budget: int) -> tuple[VettedSnapshot, int]:
    steps = 1
    while not job.step(budget):
        steps += 1
    return job.result(), steps


@pytest.mark.parametrize("budget", [1, 3, 64])
def test_vetting_in_small_steps_gives_what_one_call_gives(budget: int) -> None:
    tree = populated(seed=5)
    snap = to_wire(export(tree), {A0: 3, B0: 4})
    live = [A0, A1]  # worker b unknown: carriers dropped, nodes pruned, the table renumbered
    whole = VettedSnapshot.from_wire(snap, live, BS)
    chunked, steps = run_in_steps(Vetting(snap, live, BS), budget)
    assert steps > len(snap.nodes) // budget
    assert columns(chunked.snapshot) == columns(whole.snapshot)
    assert chunked == whole
    kept, _ = run_in_steps(Retaining(whole, [A1]), budget)
    assert columns(kept.snapshot) == columns(whole.retain_workers([A1]).snapshot)


def test_a_failure_in_a_later_chunk_surfaces_from_step_and_stays() -> None:
    nodes = [*CHAIN, (None, 31, [(0, DEVICE, 1)]), (None, 32, [(0, -1, 2)])]
    job = Vetting(body(nodes), LIVE, BS)
    assert job.step(2) is False
    assert job.step(2) is False
    with pytest.raises(VetError, match="node 5"):
        job.step(2)
    with pytest.raises(VetError, match="invalid_tier_bits"):
        job.step(2)
    assert not job.done
    with pytest.raises(RuntimeError):
        job.result()


def test_a_finished_job_keeps_answering_done() -> None:
    job = Vetting(body(CHAIN), LIVE, BS)
    while not job.step():
        pass
    assert job.done and job.step() is True
    assert job.result() == job.run()


def test_cheap_checks_fail_at_construction_before_any_step() -> None:
    with pytest.raises(VetError, match="duplicate_cursor"):
        Vetting(body(CHAIN, cursors=[(0, 1), (0, 2)]), LIVE, BS)


# -- round trips through real trees --------------------------------------------------------


@pytest.mark.parametrize("content_type", [wire.JSON, wire.MSGPACK])
def test_a_real_export_survives_the_wire_vetting_and_restore_unchanged(content_type) -> None:
    tree = populated(seed=1)
    cursors = {A0: 17, A1: 0, B0: 2**64 - 1}
    raw = wire.encode(to_wire(export(tree), cursors), content_type)
    vetted = VettedSnapshot.from_wire(wire.decode(raw, content_type), LIVE, BS)
    copy = restored(vetted)
    assert canonical_view(copy) == canonical_view(tree)
    assert copy.block_counts() == tree.block_counts()
    assert vetted.cursors == cursors
    assert vetted.dropped_workers == vetted.dropped_carriers == 0


@pytest.mark.parametrize("seed", range(6))
def test_vetting_without_a_worker_equals_the_tree_its_ranks_never_stored_in(seed: int) -> None:
    tree = populated(seed)
    gone = random.Random(seed).choice([[A0, A1], [B0]])  # a worker goes with all its ranks
    live = LIVE - set(gone)
    vetted = VettedSnapshot.from_wire(to_wire(export(tree)), live, BS)
    assert canonical_view(restored(vetted)) == canonical_view(without(tree, *gone))
    assert set(vetted.snapshot.workers) <= live


@pytest.mark.parametrize("seed", range(6))
def test_retain_workers_equals_the_tree_with_the_other_ranks_cleared(seed: int) -> None:
    tree = populated(seed)
    vetted = VettedSnapshot.from_wire(to_wire(export(tree)), LIVE, BS)
    keep = random.Random(seed).choice([[A0], [A1, B0], [B0, STRANGER]])
    kept = vetted.retain_workers(keep)
    assert canonical_view(restored(kept)) == canonical_view(without(tree, *(LIVE - set(keep))))


def test_restoring_a_vetted_snapshot_onto_a_warm_tree_unions_carriers() -> None:
    tree = populated(seed=2)
    target = without(tree, A1)
    vetted = VettedSnapshot.from_wire(to_wire(export(tree)), LIVE, BS).retain_workers([A1])
    restore(target, vetted.snapshot)
    assert canonical_view(target) == canonical_view(tree)


def test_the_columns_are_typed_arrays_restore_accepts_as_is() -> None:
    vetted = vet(body(CHAIN))
    snap = vetted.snapshot
    assert [c.typecode for c in columns(snap)[1:]] == ["q", "Q", "I", "I", "B", "Q"]
    assert snap.parents == array("q", [-1, 0, 1, -1])


# -- the columnar body -----------------------------------------------------------------------


def as_columns(snap: PeerSnapshot) -> wire.PeerColumns:
    columns = wire.decode(wire.encode(snap, wire.COLUMNS), wire.COLUMNS)
    assert isinstance(columns, wire.PeerColumns)
    return columns


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 5, 4096])
def test_vetting_columns_gives_what_vetting_the_same_format_1_body_gives(
    seed: int, budget: int
) -> None:
    tree = populated(seed)
    snap = to_wire(export(tree), {A0: 3, B0: 4})
    # Worker b unknown (dropped, pruned, renumbered), a stranger, an unknown tier bit.
    snap.workers.append(WireWorker(STRANGER.worker_url, STRANGER.dp_rank))
    snap.nodes.append(WireNode(None, 7, [(3, DEVICE, 1), (0, HOST | 64, 2)]))
    for live in (LIVE, frozenset({A0, A1})):
        expected = VettedSnapshot.from_wire(snap, live, BS)
        got, _ = run_in_steps(Vetting(as_columns(snap), live, BS), budget)
        assert got == expected and columns(got.snapshot) == columns(expected.snapshot)


@pytest.mark.parametrize(
    ("nodes", "reason", "where"),
    [
        ([*CHAIN[:2], (2, 13, [(1, DEVICE, 303)])], "invalid_parent", "node 2"),
        ([*CHAIN[:2], (7, 13, [(1, DEVICE, 303)])], "invalid_parent", "node 2"),
        ([*CHAIN, (None, 31, [(0, DEVICE, 5), (0, HOST, 6)])], "duplicate_carrier", "node 4"),
        (
            [*CHAIN, (None, 31, [(1, DEVICE, 5), (2, DEVICE, 6), (1, DEVICE, 7)])],
            "duplicate_carrier",
            "node 4",
        ),
        (
            [*CHAIN, (None, 31, [(3, DEVICE, 5), (3, DEVICE, 5)])],  # unknown to us, still refused
            "duplicate_carrier",
            "node 4",
        ),
    ],
    ids=["self-parent", "forward-parent", "two", "three", "unknown"],
)
def test_a_columnar_body_is_refused_for_what_a_format_1_body_is_refused_for(
    nodes: list, reason: str, where: str
) -> None:
    snap = body(nodes, workers=[A0, A1, B0, STRANGER])
    for form in (snap, as_columns(snap)):
        error = refused(form)  # type: ignore[arg-type]
        assert (error.outcome, error.reason) == (REJECTED, reason)
        assert where in str(error)


def test_a_parent_below_minus_one_in_a_column_is_rejected() -> None:
    columns_body = as_columns(body(CHAIN))
    columns_body.columns.parents[2] = -2
    error = refused(columns_body)  # type: ignore[arg-type]
    assert error.reason == "invalid_parent" and "node 2" in str(error)


def test_columns_carried_only_on_unknown_tiers_are_dropped_then_nothing_usable() -> None:
    snap = as_columns(body([(None, 11, [(0, 0, 1)]), (None, 12, [(1, 64, 2)])]))
    error = refused(snap)  # type: ignore[arg-type]
    assert (error.outcome, error.reason) == (COLD_PEER, "nothing_usable")


def test_a_cold_columnar_body_is_a_cold_peer() -> None:
    error = refused(as_columns(body(CHAIN, producer_ready=False)))  # type: ignore[arg-type]
    assert (error.outcome, error.reason) == (COLD_PEER, "producer_cold")


# -- capacity: more device blocks than the engine holds (issue 13, row 8) ------------------


def capacity_of(table: dict[RankId, int]) -> Callable[[RankId], int | None]:
    return table.get


def chain_on(worker: int, n: int, tier: int = DEVICE) -> list:
    return [(None if i == 0 else i - 1, 1000 + i, [(worker, tier, 5000 + i)]) for i in range(n)]


@pytest.mark.parametrize(
    "capacity,accepted",
    [
        (None, True),  # unknown: nothing to check
        (100, True),
        (91, True),  # 100 <= 91 * 1.1: within the margin
        (90, False),  # 100 > 99
        (0, False),
    ],
)
def test_a_rank_with_more_device_blocks_than_its_engine_holds_is_rejected(
    capacity: int | None, accepted: bool
) -> None:
    snap = body(chain_on(0, 100), cursors=[(0, 5)])
    table = {} if capacity is None else {A0: capacity}
    if accepted:
        assert len(VettedSnapshot.from_wire(snap, LIVE, BS, capacity_of(table)).snapshot) == 100
    else:
        with pytest.raises(VetError) as caught:
            VettedSnapshot.from_wire(snap, LIVE, BS, capacity_of(table))
        assert (caught.value.outcome, caught.value.reason) == (REJECTED, "over_capacity")
        assert "A0" not in str(caught.value) and "100 device blocks" in str(caught.value)


def test_blocks_on_slower_tiers_do_not_count_against_the_device_capacity() -> None:
    snap = body(chain_on(0, 50, HOST), cursors=[(0, 5)])
    vetted = VettedSnapshot.from_wire(snap, LIVE, BS, capacity_of({A0: 10}))
    assert len(vetted.snapshot) == 50


def test_the_capacity_check_gives_the_same_verdict_on_columns(budget: int = 7) -> None:
    snap = body(chain_on(1, 40), cursors=[(1, 5)])
    for encoded in (snap, as_columns(snap)):
        job = Vetting(encoded, LIVE, BS, capacity_of({A1: 20}))
        with pytest.raises(VetError, match="over_capacity"):
            run_in_steps(job, budget)
