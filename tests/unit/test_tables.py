"""`cachetree._tables` against what it replaces: `NodeMap`/`HashMap` against dict, `Node` against
the pure layout's `PyNode`, under random operations; and the bounds of the maps' memory."""

from __future__ import annotations

import itertools
import random
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cachetree.tree import PyNode

tables = pytest.importorskip(
    "cachetree._tables", reason="the compiled accelerator is not built (pip install -e .)"
)

U64 = 2**64


def values_of(m: Any) -> list[Any]:
    return [m[k] for k in m]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["node", "hash"])
def test_a_map_answers_every_operation_as_a_dict_in_the_same_order(seed: int, kind: str) -> None:
    rng = random.Random(seed)
    native = tables.NodeMap() if kind == "node" else tables.HashMap()
    ref: dict[int, Any] = {}
    # A small key space so keys come back after deletion; the edges of u64 included.
    space = [0, 1, U64 - 1, *(rng.randrange(U64) for _ in range(300))]

    def value() -> Any:
        return PyNode(None, rng.randrange(8), 0) if kind == "node" else rng.choice(space)

    for step in range(6000):
        k = rng.choice(space)
        op = rng.random()
        if op < 0.35:
            v = value()
            native[k] = v
            ref[k] = v
        elif op < 0.5:
            v = value()
            inserted = k not in ref
            got = native.setdefault(k, v)
            assert got == ref.setdefault(k, v)
            if inserted:
                assert got is v  # the default itself (the graft's take-back relies on it)
        elif op < 0.7:
            if k in ref:
                del native[k], ref[k]
            else:
                with pytest.raises(KeyError):
                    del native[k]
        elif op < 0.72:
            run = [rng.choice(space) for _ in range(rng.randrange(40))]  # repeats included
            v = value()
            got = native.setdefault_run(run, v)
            assert got == [ref.setdefault(key, v) for key in run]
        elif op < 0.75:
            assert native.pop(k, "absent") == ref.pop(k, "absent")
        elif op < 0.8 and ref:
            assert native.popitem() == ref.popitem()
        else:
            assert native.get(k) == ref.get(k) and (k in native) == (k in ref)
            assert native.get(k, "d") == ref.get(k, "d")
        assert len(native) == len(ref)
        if step % 500 == 0:
            assert list(native) == list(ref)
    assert list(native.items()) == list(ref.items())
    assert list(native.keys()) == list(ref.keys())
    assert list(native.values()) == list(ref.values())
    native.clear()
    assert len(native) == 0 and list(native) == []


def test_lookups_of_what_no_u64_map_can_hold_are_misses_and_inserts_are_refused() -> None:
    m = tables.HashMap()
    m[5] = 6
    for edge in (2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, U64 - 1):  # 1, 2 and 3 digits
        m[edge] = edge
        assert m[edge] == edge and edge in m
        del m[edge]
    for odd in (-1, -(2**40), U64, U64 + 2**30, 2**90, "5", 5.0, None):
        assert odd not in m and m.get(odd) is None and m.pop(odd, 7) == 7
        with pytest.raises(KeyError):
            m[odd]
    for bad_key in (-1, U64, "5"):
        with pytest.raises(TypeError, match="keys are ints"):
            m[bad_key] = 1
        with pytest.raises(TypeError, match="keys are ints"):
            m.setdefault(bad_key, 1)
        with pytest.raises(TypeError, match="keys are ints"):
            m.setdefault_run([7, bad_key, 8], 1)
        assert m.pop(7) == 1 and 8 not in m  # the keys before it set, none after
    with pytest.raises(TypeError, match="values are ints"):
        m[6] = -3
    with pytest.raises(KeyError, match="empty"):
        tables.NodeMap().popitem()
    assert dict(m.items()) == {5: 6}  # nothing half-applied


def test_a_large_map_finds_every_key_it_holds_and_none_it_does_not() -> None:
    # Enough keys that many share a slot's tag byte (1 in 254 of the slots probed): a tag
    # match with another key must go on probing, a miss must end at an empty slot.
    rng = random.Random(3)
    held_set = {rng.randrange(U64) for _ in range(150_000)}
    held = list(held_set)
    absent = [k for k in (rng.randrange(U64) for _ in range(50_000)) if k not in held_set]
    m = tables.HashMap()
    for i, k in enumerate(held):
        m[k] = i
    assert all(m[k] == i for i, k in enumerate(held))
    assert not any(k in m for k in absent)
    for k in held[::2]:
        del m[k]  # dummies on the probe chains of the rest
    assert m.setdefault_run(held[1::2], -1 % U64) == list(range(1, len(held), 2))
    assert not any(k in m for k in held[::2]) and len(m) == len(held) // 2


def test_an_iterator_refuses_to_go_on_once_the_map_changed_shape() -> None:
    m = tables.NodeMap()
    for k in range(10):
        m[k] = PyNode(None, 1, 0)
    it = iter(m.values())
    next(it)
    m[3] = PyNode(None, 2, 0)  # replacing a value is no change of shape, as with dict
    next(it)
    del m[9]
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(it)


def test_churn_at_a_steady_size_keeps_the_table_small_and_terminates() -> None:
    """Insert-then-delete of ever new keys leaves only dummies behind; they must count toward
    a rebuild (else the table fills with dummies and a probe never ends)."""
    m = tables.HashMap()
    for k in range(8):
        m[k] = k
    for k in range(100, 200_100):
        m[k] = k
        del m[k]
    assert len(m) == 8 and list(m) == list(range(8))
    assert m.__sizeof__() < 1024  # a 32-slot table, not 200,000 dummies


def test_a_map_shrinks_at_its_next_rebuild_once_most_of_it_is_removed() -> None:
    m = tables.HashMap()
    for k in range(200_000):
        m[k] = k
    full = m.__sizeof__()
    for k in range(199_000):
        del m[k]
    # New keys use up the entries left; the rebuild they cause sizes for the live ones, and
    # gives the larger blocks back once it is done.
    for k in range(10**6, 10**6 + 1_000_000):
        m[k] = k
        del m[k]
        if m.__sizeof__() != full and not m.rehash_left():
            break
    assert m.__sizeof__() < full / 20
    assert len(m) == 1000 and list(m)[:2] == [199_000, 199_001]


def test_a_node_is_48_bytes_and_its_fields_read_back_as_the_pure_nodes() -> None:
    assert sys.getsizeof(tables.Node(None, 1, 0, None, 5)) == 48
    rng = random.Random(7)
    choices = {
        "parent": [None, 0, 5, U64 - 1],
        "mask": [0, 1, 6, U64 - 1, U64, 1 << 70, (1 << 70) | 3],
        "children": [0, 1, 2**32 - 1],
        "tiers": [None, {0: 2}, {3: 6, 70: 4}],
        "ehash": [None, 0, 9, U64 - 1, -5, U64 + 3, {0: 9, 1: 10}],
    }
    native, pure = tables.Node(None, 0, 0), PyNode(None, 0, 0)
    for _ in range(3000):
        field = rng.choice(list(choices))
        value = rng.choice(choices[field])
        setattr(native, field, value)
        setattr(pure, field, value)
        for name in choices:
            assert getattr(native, name) == getattr(pure, name), name
    assert tables.Node(3, 1, 0, ehash=4) == tables.Node(3, 1, 0, None, 4)
    assert tables.Node(parent=None, mask=2, children=1).ehash is None


def test_a_nodes_dicts_are_its_own_so_edits_in_place_stick() -> None:
    node = tables.Node(None, 3, 0, {1: 2}, {0: 7, 1: 8})
    node.tiers[1] = 6  # type: ignore[index]
    node.ehash.pop(0)  # type: ignore[union-attr]
    assert node.tiers == {1: 6} and node.ehash == {1: 8}
    node.mask += 1 << 80  # past one machine word and back
    node.mask -= 1 << 80
    assert node.mask == 3 and node.tiers == {1: 6}


def test_a_node_refuses_values_it_cannot_mean() -> None:
    node = tables.Node(None, 1, 0)
    with pytest.raises(ValueError, match="children"):
        node.children = -1
    with pytest.raises(TypeError, match="parent"):
        node.parent = -1
    with pytest.raises(TypeError, match="tiers"):
        node.tiers = [1]
    with pytest.raises(TypeError, match="ehash"):
        node.ehash = "x"
    with pytest.raises(AttributeError):
        del node.mask
    with pytest.raises(TypeError, match="missing"):
        tables.Node(None, 1)
    assert node == tables.Node(None, 1, 0)  # nothing half-applied


def test_reserve_makes_room_once_and_keeps_what_the_map_holds() -> None:
    # The rebuild reserve starts reads REHASH_STEP entries at once and the rest with the
    # insertions that follow, as any rebuild does: no call reads all of a large map.
    m, step = tables.HashMap(), tables.REHASH_STEP
    for k in range(100):
        m[k] = k + 1
    del m[5]
    m.reserve(100_000)
    assert m.rehash_left() == 100 - step
    assert list(m.items()) == [(k, k + 1) for k in range(100) if k != 5]
    m[1000] = 0
    assert m.rehash_left() == 0
    reserved = m.__sizeof__()
    for k in range(1001, 100_900):
        m[k] = 0
    assert m.__sizeof__() == reserved  # no rebuild on the way
    m.reserve(10)  # already room: nothing moves
    assert m.__sizeof__() == reserved
    with pytest.raises(ValueError, match="out of range"):
        m.reserve(-1)


def test_the_graft_refuses_columns_that_disagree_and_changes_nothing() -> None:
    from array import array

    nodes, ranks = tables.NodeMap(), [tables.HashMap()]
    keys, parents = array("Q", [10, 11]), array("q", [-1, 0])
    counts, workers, hashes = array("I", [1, 1]), array("I", [0, 0]), array("Q", [5, 6])
    new = b"\x01\x01"
    bad = [
        (array("I", [1, 3]), workers, hashes, new, 0, 2, "overrun"),  # counts past the carriers
        (counts, array("I", [0, 1]), hashes, new, 0, 2, "out of range"),  # no such worker
        (counts, workers, hashes, b"\x01", 0, 2, "disagree"),  # one flag for two records
        (counts, workers, hashes, new, 1, 3, "disagree"),  # a range past the records
        (counts, workers, array("q", [5, 6]), new, 0, 2, "array"),  # signed hashes
    ]
    for c, w, h, n, a, b, reason in bad:
        with pytest.raises((ValueError, TypeError), match=reason):
            tables.graft_new(nodes, ranks, [0], keys, parents, c, w, h, n, a, b, 0)
        assert len(nodes) == 0 and len(ranks[0]) == 0
    with pytest.raises(ValueError, match="rank indices"):
        tables.graft_new(nodes, ranks, [64], keys, parents, counts, workers, hashes, new, 0, 2, 0)
    done = tables.graft_new(nodes, ranks, [0], keys, parents, counts, workers, hashes, new, 0, 2, 0)
    assert done == (0, -1)
    assert len(nodes) == 2 and dict(ranks[0].items()) == {5: 10, 6: 11}


def test_the_walk_refuses_nodes_and_keys_that_disagree() -> None:
    from array import array

    node = tables.Node(None, 1, 0, None, 5)
    with pytest.raises(ValueError, match="differ in length"):
        tables.walk_chunk((node, node), array("Q", [1]), [0], 0, None)
    with pytest.raises(TypeError, match="array"):
        tables.walk_chunk((node,), array("q", [1]), [0], 0, None)


def _runs_over_random_pairs(
    rng: random.Random, batches: list[object], native: Any, ref: dict[int, object]
) -> Iterator[list[int]]:
    """300 random sets of both maps (a key to one of `batches`, the ledger's batches: values
    compared by identity), and now and then a run of keys to play on both: repeats,
    absentees, and sometimes -1, a key no map can hold (passed over)."""
    space = [rng.randrange(U64) for _ in range(200)]
    for _ in range(300):
        k, v = rng.choice(space), rng.choice(batches)
        native[k] = ref[k] = v
        if rng.random() < 0.3:
            keys = [rng.choice(space) for _ in range(rng.randrange(60))]
            if keys and rng.random() < 0.3:
                keys.insert(rng.randrange(len(keys)), -1)
            yield keys


@pytest.mark.parametrize("seed", range(4))
def test_drop_run_drops_what_the_pure_twin_drops_and_stops_where_it_stops(seed: int) -> None:
    from router.pressure import _drop_run_py

    rng = random.Random(seed)
    batches = [object() for _ in range(3)]
    native, ref = tables.NodeMap(), {}
    for keys in _runs_over_random_pairs(rng, batches, native, ref):
        start, goal, batch = rng.randrange(70), rng.randrange(40), rng.choice(batches)
        as_array = -1 not in keys and rng.random() < 0.5  # how the ledger keeps them
        got = native.drop_run(array("Q", keys) if as_array else keys, start, goal, batch)
        assert got == _drop_run_py(ref, keys, start, goal, batch)
        assert list(native.items()) == list(ref.items())
    with pytest.raises(TypeError, match="NodeMap"):
        tables.HashMap().drop_run([1], 0, 1, 1)
    for wrong in (array("i", [1]), b"\x01" * 8):  # a buffer, but not of u64
        with pytest.raises(TypeError, match="buffer of u64"):
            native.drop_run(wrong, 0, 1, batches[0])


@pytest.mark.parametrize("seed", range(4))
def test_kept_run_keeps_what_the_pure_twin_keeps(seed: int) -> None:
    from router.pressure import _kept_run_py

    rng = random.Random(seed)
    batches = [object() for _ in range(3)]
    native, ref = tables.NodeMap(), {}
    for keys in _runs_over_random_pairs(rng, batches, native, ref):
        listed = array("Q", [k for k in keys if k >= 0])  # how the ledger keeps them
        start, batch = rng.randrange(-2, 70), rng.choice(batches)
        got = native.kept_run(listed, start, batch)
        assert got == _kept_run_py(ref, listed, max(start, 0), batch)
        assert list(native.items()) == list(ref.items())  # read, never changed
    with pytest.raises(TypeError, match="NodeMap"):
        tables.HashMap().kept_run(array("Q", [1]), 0, 1)
    with pytest.raises(TypeError, match="array"):
        native.kept_run([1, 2], 0, batches[0])


@pytest.mark.parametrize("kind", ["NodeMap", "HashMap"])
def test_put_run_sets_every_key_as_a_dict_update_does(kind: str) -> None:
    rng = random.Random(3)
    values = [object() for _ in range(3)] if kind == "NodeMap" else [7, 8, 9]
    alone = [sys.getrefcount(v) for v in values]
    native, ref = getattr(tables, kind)(), {}
    space = [rng.randrange(U64) for _ in range(300)]
    for _ in range(200):
        keys = [rng.choice(space) for _ in range(rng.randrange(70))]  # repeats, present or not
        value = rng.choice(values)
        native.put_run(keys, value)
        ref.update(dict.fromkeys(keys, value))
        assert list(native.items()) == list(ref.items())
    with pytest.raises(TypeError, match="keys are ints"):
        native.put_run([space[0], -1, space[1]], values[0])
    ref[space[0]] = values[0]  # the keys before the bad one are set, as map[k] = v would
    assert list(native.items()) == list(ref.items())
    native.clear()
    ref.clear()
    del value
    assert [sys.getrefcount(v) for v in values] == alone


@pytest.mark.parametrize("seed", range(4))
def test_move_run_moves_what_the_pure_twin_moves(seed: int) -> None:
    from router.pressure import _move_run_py

    rng = random.Random(seed)
    batches = [object() for _ in range(3)]
    alone = [sys.getrefcount(b) for b in batches]
    native, ref = tables.NodeMap(), {}
    for keys in _runs_over_random_pairs(rng, batches, native, ref):
        start, stop = rng.randrange(-2, 70), rng.randrange(-2, 70)
        old, new = rng.sample(batches, 2)
        got = native.move_run(keys, start, stop, old, new)
        assert got == _move_run_py(ref, keys, max(start, 0), max(stop, 0), old, new)
        assert list(native.items()) == list(ref.items())
    native.clear()
    ref.clear()
    del old, new
    assert [sys.getrefcount(b) for b in batches] == alone  # one reference per entry, no more
    with pytest.raises(TypeError, match="NodeMap"):
        tables.HashMap().move_run([1], 0, 1, 1, 2)


def test_pack_u64_gives_the_array_of_the_keys_from_start_and_refuses_what_is_no_u64() -> None:
    rng = random.Random(9)
    for _ in range(300):
        keys = [rng.choice([0, 1, rng.getrandbits(30), rng.getrandbits(64), (1 << 64) - 1])]
        keys *= rng.randrange(0, 5)
        keys += [rng.getrandbits(64) for _ in range(rng.randrange(0, 300))]
        start = rng.randrange(-3, len(keys) + 3)
        want = array("Q", keys[max(start, 0) :])
        assert array("Q", tables.pack_u64(keys, start)) == want
        assert array("Q", tables.pack_u64(tuple(keys), start)) == want
    for bad in ([1, -1], [1, 1 << 64], [1, 2.0], [True, "x"]):
        with pytest.raises(ValueError, match=r"keys\[1\] is not an int"):
            tables.pack_u64(bad, 0)
    with pytest.raises(TypeError):
        tables.pack_u64(5, 0)


@pytest.mark.parametrize("kind", ["NodeMap", "HashMap"])
def test_a_map_under_steady_churn_stays_a_dict_through_its_rebuilds_at_that_size(kind: str) -> None:
    # As many deletions as insertions (the pressure ledger at its cap): the map's entries run
    # out again and again at one table size, and each time it is rebuilt at that size.
    rng = random.Random(11)
    native, ref = getattr(tables, kind)(), {}
    order: list[int] = []
    for i in range(60_000):
        key = rng.randrange(U64)
        native[key] = ref[key] = i
        order.append(key)
        if len(order) > 3_000:
            old = order.pop(rng.randrange(len(order)) if i % 7 == 0 else 0)
            del native[old], ref[old]
        if i % 9_973 == 0:
            assert list(native.items()) == list(ref.items())
    assert list(native.items()) == list(ref.items())
    assert all(native[k] == v for k, v in ref.items())
    assert native.get(-1) is None and len(native) == len(ref) == 3_000


def test_a_map_past_16_mib_keeps_every_key_through_growth_shrinking_and_clearing() -> None:
    # From 1 MiB a map's block is a mapping of its own, and from 16 MiB a map's blocks are on
    # huge pages (where the kernel allows); a growth moves the entries' pages to the larger block:
    # growing into them, growing within them, shrinking out of them and clearing them must
    # each keep (or drop) exactly what a dict would.
    rng = random.Random(5)
    keys = list({rng.randrange(U64) for _ in range(800_000)})  # 2**21 slots: 22 MB of entries
    m = tables.HashMap()
    assert m.setdefault_run(keys, 7) == [7] * len(keys)
    big = sys.getsizeof(m)
    assert big > 16 << 20 and len(m) == len(keys)
    assert all(k in m for k in keys[::97])
    # Keys added and removed use up the entries left; the rebuild they cause sizes the table
    # for the live ones: 200,000 (2**19 slots: plain mappings, the pages past them given
    # back), then 100 (blocks on the heap, copied out of the mappings).
    fresh, gone = itertools.count(), 0

    def churn() -> None:
        k = next(fresh)
        m[k] = k
        del m[k]

    for live, low, high in ((200_000, 1 << 20, 16 << 20), (100, 0, 1 << 20)):
        for k in keys[gone : len(keys) - live]:
            del m[k]
        gone = len(keys) - live
        until(m.rehash_left, churn, limit=3_000_000)
        until(lambda: not m.rehash_left(), churn)
        assert low < sys.getsizeof(m) < high
        assert sorted(m.keys()) == sorted(keys[gone:])
    m.setdefault_run(keys, 8)  # and up again
    assert m.get(keys[0]) == 8 and m.get(keys[-1]) == 7 and len(m) == len(keys)
    m.clear()
    assert len(m) == 0 and keys[0] not in m


def budget(size: int) -> int:
    """The entries (or slots filled) at which a table of `size` slots starts a rebuild
    (cachetree/_tables.c, BUDGET)."""
    room = size * 2 // 3
    return room - room // 32 - 1


@pytest.mark.parametrize("steady", [False, True])
def test_an_insertion_during_a_rebuild_reads_rehash_step_entries_and_nothing_else_does(
    steady: bool,
) -> None:
    # Each rebuild starts when the entries reach the budget and must be done (its old table
    # freed) before the next one: each insertion adds an entry and reads the next REHASH_STEP
    # (the last one the rest); lookups and deletions read none. A map that grows rebuilds into
    # ever larger tables; one at a steady size (from 100,000 keys on, each insertion's key
    # replaces the oldest: a full cache's churn) into tables of its size, again and again.
    m, step = tables.HashMap(), tables.REHASH_STEP
    rebuilds, reads = 0, []
    for k in range(300_000):
        left = m.rehash_left()
        m[k] = k
        if steady and k >= 100_000:
            del m[k - 100_000]
        after = m.rehash_left()
        if not left:
            rebuilds += after > 0  # this insertion started one (and read its first entries)
            continue
        reads.append(left + 1 - after)
        assert after == max(left + 1 - step, 0), "a rebuild started before the last one was done"
        before = m.__sizeof__()
        assert k - 1 in m and m.get(k * 3 // 4) == k * 3 // 4 and m.get(-1) is None
        del m[k - 1]
        assert m.rehash_left() == after
        m[k - 1] = k - 1  # an insertion again: it reads the next entries
        assert m.rehash_left() == max(after + 1 - step, 0)
        assert m.__sizeof__() <= before  # the old table only ever goes
    # From 8 up to 2**19 slots (2**18 at a steady size, its table rebuilt twice at that size):
    # a rebuild of fewer than REHASH_STEP entries ends in the insertion that starts it.
    growths = sum(1 for e in range(3, 19 - steady) if budget(2**e) >= step)
    assert rebuilds == growths + 2 * steady == (13 if steady else 12)
    assert max(reads) == step and len(reads) > 2_000
    first = 200_000 if steady else 0
    assert len(m) == 300_000 - first and all(m[k] == k for k in range(first, 300_000))


OPS = ["set", "set", "set", "setdefault", "del", "pop", "popitem", "get", "iterate"]
OPS += ["setdefault_run", "put_run", "drop_run", "kept_run", "move_run"]


class Twins:
    """A NodeMap and a HashMap given the same keys, beside the dicts they must answer as: one
    random operation at a time, each answer checked. The same keys make them rebuild in step."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.batches = [object() for _ in range(3)]
        self.nodes, self.hashes = tables.NodeMap(), tables.HashMap()
        self.ref_nodes: dict[int, object] = {}
        self.ref_hashes: dict[int, int] = {}
        self.held: list[int] = []  # keys set, some deleted since

    def rehash_left(self) -> int:
        left = self.nodes.rehash_left()
        assert self.hashes.rehash_left() == left
        return left

    def set_new(self) -> int:
        k = self.rng.randrange(U64)
        self.nodes[k] = self.ref_nodes[k] = self.batches[0]
        self.hashes[k] = self.ref_hashes[k] = k >> 1
        self.held.append(k)
        return k

    def delete(self, k: int) -> None:
        del self.nodes[k], self.ref_nodes[k], self.hashes[k], self.ref_hashes[k]

    def some_keys(self) -> list[int]:
        rng, held = self.rng, self.held
        return [
            rng.choice(held) if held and rng.random() < 0.8 else rng.randrange(U64)
            for _ in range(rng.randrange(1, 40))
        ]

    def clear(self) -> None:
        for m in (self.nodes, self.hashes, self.ref_nodes, self.ref_hashes, self.held):
            m.clear()

    def apply(self, op: str) -> None:
        from router.pressure import _drop_run_py, _kept_run_py, _move_run_py

        rng, batches, held = self.rng, self.batches, self.held
        nodes, hashes, ref_nodes, ref_hashes = (
            self.nodes,
            self.hashes,
            self.ref_nodes,
            self.ref_hashes,
        )
        k = rng.choice(held) if held and rng.random() < 0.3 else rng.randrange(U64)
        if op == "set":
            nodes[k] = ref_nodes[k] = rng.choice(batches)
            hashes[k] = ref_hashes[k] = k >> 1
            held.append(k)
        elif op == "setdefault":
            v = rng.choice(batches)
            assert nodes.setdefault(k, v) is ref_nodes.setdefault(k, v)
            assert hashes.setdefault(k, 5) == ref_hashes.setdefault(k, 5)
            held.append(k)
        elif op == "del":
            if k in ref_nodes:
                self.delete(k)
            else:
                assert k not in nodes and k not in hashes
        elif op == "pop":
            assert nodes.pop(k, None) is ref_nodes.pop(k, None)
            assert hashes.pop(k, None) == ref_hashes.pop(k, None)
        elif op == "popitem" and ref_nodes:
            assert nodes.popitem() == ref_nodes.popitem()
            assert hashes.popitem() == ref_hashes.popitem()
        elif op == "get":
            assert nodes.get(k) is ref_nodes.get(k) and hashes.get(k) == ref_hashes.get(k)
            assert (k in nodes) == (k in ref_nodes) and (k in hashes) == (k in ref_hashes)
        elif op == "setdefault_run":
            keys, v = self.some_keys(), rng.choice(batches)
            assert nodes.setdefault_run(keys, v) == [ref_nodes.setdefault(x, v) for x in keys]
            assert hashes.setdefault_run(keys, 9) == [ref_hashes.setdefault(x, 9) for x in keys]
            held += keys
        elif op == "put_run":
            keys, v = self.some_keys(), rng.choice(batches)
            nodes.put_run(keys, v)
            ref_nodes.update(dict.fromkeys(keys, v))
            hashes.put_run(keys, 3)
            ref_hashes.update(dict.fromkeys(keys, 3))
            held += keys
        elif op == "drop_run":
            keys, batch = self.some_keys(), rng.choice(batches)
            goal = rng.randrange(1, 30)
            assert nodes.drop_run(array("Q", keys), 0, goal, batch) == _drop_run_py(
                ref_nodes, keys, 0, goal, batch
            )
            for x in [x for x in ref_hashes if x not in ref_nodes]:
                del hashes[x], ref_hashes[x]
        elif op == "kept_run":
            keys, batch = array("Q", self.some_keys()), rng.choice(batches)
            assert nodes.kept_run(keys, 0, batch) == _kept_run_py(ref_nodes, keys, 0, batch)
        elif op == "move_run":
            keys, (old, new) = self.some_keys(), rng.sample(batches, 2)
            assert nodes.move_run(keys, 0, len(keys), old, new) == _move_run_py(
                ref_nodes, keys, 0, len(keys), old, new
            )
        elif op == "iterate":
            self.check_all()
        assert len(nodes) == len(ref_nodes) and len(hashes) == len(ref_hashes)

    def check_all(self) -> None:
        assert list(self.nodes.items()) == list(self.ref_nodes.items())
        assert list(self.hashes.items()) == list(self.ref_hashes.items())


@pytest.mark.parametrize("seed", range(4))
def test_every_operation_and_run_answers_as_a_dict_while_a_growth_is_under_way(seed: int) -> None:
    # New keys all the time, and a clear now and then, so the maps grow again and again from
    # their smallest tables and a good part of the operations meet a growth under way: a key
    # then is in the old table or the new one, and each operation must find it in either.
    twins, during = Twins(random.Random(seed)), dict.fromkeys(OPS, 0)
    for step in range(40_000):
        op = twins.rng.choice(OPS)
        if twins.rehash_left():
            during[op] += 1
        twins.apply(op)
        if step % 3_000 == 2_999:
            twins.clear()
    twins.check_all()
    # Each kind of operation met growths under way in both maps, many times.
    assert min(during.values()) > 20, during


def until(done: Callable[[], object], step: Callable[[], object], limit: int = 100_000) -> None:
    """Call `step` until `done()`; fail after `limit` calls (a rebuild that never comes, or
    never ends)."""
    for _ in range(limit):
        if done():
            return
        step()
    pytest.fail(f"not done after {limit} steps")


@pytest.mark.parametrize("kind", ["growth", "steady", "shrinking"])
def test_every_operation_and_run_answers_as_a_dict_during_each_kind_of_rebuild(kind: str) -> None:
    # A rebuild drops the dead entries and places the live ones in a table larger than the old
    # one, of its size (a map at a steady size: the churn of a full cache, every insertion
    # meeting a deletion), or smaller (after mass removals). While it runs a key is in the old
    # table (not read yet) or the new one (read, or inserted since), its entry among those slid
    # down or those not read yet; each operation must find it in either and keep the order.
    twins, during = Twins(random.Random(kind)), dict.fromkeys(OPS, 0)

    def churn() -> None:
        twins.set_new()
        if kind != "growth":  # the oldest key goes (steady), or the one just set (shrinking)
            twins.delete(twins.held.pop(0) if kind == "steady" else twins.held.pop())

    def random_op() -> None:
        op = twins.rng.choice(OPS)
        during[op] += 1
        twins.apply(op)

    for _ in range(4):
        twins.clear()
        for _ in range(20_000):
            twins.set_new()
        if kind == "steady":
            # 20,000 keys take a table of 2**15 slots; the churn's first rebuild sizes it
            # for half as many again (2**16), the ones after keep that size.
            until(twins.rehash_left, churn)
            until(lambda: not twins.rehash_left(), churn)
        elif kind == "shrinking":
            for k in twins.rng.sample(twins.held, 19_000):
                twins.delete(k)
            twins.held = list(twins.ref_nodes)
        size = twins.nodes.__sizeof__()
        until(twins.rehash_left, churn)
        # A rebuild under way is left as it is by reserve (the next rebuild makes the room).
        left = twins.rehash_left()
        twins.nodes.reserve(10**6), twins.hashes.reserve(10**6)
        assert twins.rehash_left() == left
        until(lambda: not twins.rehash_left(), random_op)
        twins.check_all()
        resized = twins.nodes.__sizeof__()
        assert {"growth": resized > size, "steady": resized == size}.get(kind, resized < size)
    assert min(during.values()) > 50, during


def test_a_rebuild_whose_entries_left_to_read_all_go_ends_at_that_deletion() -> None:
    # popitem takes the newest entry: taking every live entry the rebuild (to a smaller table)
    # has not read yet ends it at the last of those, the dead ones among them dropped; what is
    # left is what it read.
    m, ref = tables.HashMap(), {}
    for k in range(20_000):
        m[k] = ref[k] = k
    for k in random.Random(3).sample(range(20_000), 19_000):
        del m[k], ref[k]
    full, fresh = m.__sizeof__(), itertools.count(10**6)

    def churn() -> None:
        k = next(fresh)
        m[k] = k  # insert then delete the newest: dummies fill the table
        del m[k]

    def popitem() -> None:
        assert m.popitem() == ref.popitem()

    until(m.rehash_left, churn)
    assert m.rehash_left() == max(ref) + 1 - tables.REHASH_STEP  # entry k holds key k
    until(lambda: not m.rehash_left(), popitem)
    assert len(m) == sum(k < tables.REHASH_STEP for k in ref) > 0
    assert list(m.items()) == list(ref.items())
    assert m.__sizeof__() < full / 5  # the rebuild is done: its larger blocks are given back
    for k in range(10**7, 10**7 + 5_000):
        m[k] = ref[k] = k
    assert list(m.items()) == list(ref.items())


def test_the_graft_creates_and_takes_back_its_records_while_its_maps_grow() -> None:
    nodes, rank = tables.NodeMap(), tables.HashMap()
    k = 0
    while nodes.rehash_left() < 40_000 or rank.rehash_left() < 40_000:
        nodes[k] = tables.Node(None, 1, 0, None, k)
        rank[k] = k
        k += 1
    before = (list(nodes.items()), list(rank.items()), nodes.rehash_left())

    def chunk(first: int, n: int, taken: int | None) -> tuple[Any, ...]:
        keys = array("Q", range(first, first + n))
        hashes = array("Q", range(first, first + n))
        if taken is not None:
            hashes[-1] = taken  # a hash the rank maps already: the graft refuses it all
        parents, counts = array("q", [-1, *range(n - 1)]), array("I", [1] * n)
        workers, new = array("I", [0] * n), b"\x01" * n
        return tables.graft_new(
            nodes, [rank], [0], keys, parents, counts, workers, hashes, new, 0, n, 0
        )

    assert chunk(10**9, 200, taken=5) == (1, 199)
    assert (list(nodes.items()), list(rank.items())) == before[:2]  # each record taken back
    assert chunk(10**9, 200, taken=None) == (0, -1)
    assert 0 < nodes.rehash_left() < before[2] and 0 < rank.rehash_left() < before[2]
    assert [rank[10**9 + i] for i in range(200)] == list(range(10**9, 10**9 + 200))
    grafted = [nodes[10**9 + i] for i in range(200)]
    assert [(n.parent, n.children, n.mask) for n in grafted] == [
        (None if i == 0 else 10**9 + i - 1, 0 if i == 199 else 1, 1) for i in range(200)
    ]
    assert list(nodes.items())[:k] == before[0] and list(rank.items())[:k] == before[1]


@pytest.mark.skipif(sys.platform != "linux", reason="the tables' own mappings are Linux's")
def test_the_insertions_after_a_growth_starts_find_its_table_paged_in() -> None:
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    # 2**18 slots take 169,300 entries before a rebuild; the growth's table (2**19 slots, 2.5 MB
    # on 4 KiB pages: the map is below 16 MiB) is paged in over the last eighth of them, so the
    # keys each insertion moves into it land on pages already there (without that: a fault for
    # nearly every key moved, until all 640 pages are in).
    m = tables.HashMap()
    keys = iter(range(10**7))
    m.setdefault_run([next(keys) for _ in range(budget(2**18) - 300)], 1)
    while not m.rehash_left():
        m[next(keys)] = 1
    started = m.rehash_left()
    before = faults()
    for _ in range(100):
        m[next(keys)] = 1
    assert faults() - before < 20
    assert m.rehash_left() == started - 100 * (tables.REHASH_STEP - 1)


def test_a_table_paged_in_for_a_growth_that_does_not_come_goes_at_the_rebuild() -> None:
    # 2**17 slots hold 87,381 entries. Filled past seven eighths with live keys, the map pages
    # in the table of its next growth; then most go, and the rebuild the churn comes to keeps
    # the size (in place): the table paged in ahead must go with it, not stay for good.
    m = tables.HashMap()
    m.setdefault_run(list(range(70_000)), 1)
    plain = m.__sizeof__()
    m.setdefault_run(list(range(70_000, 80_000)), 1)
    prepared = m.__sizeof__()
    assert prepared == plain + 2**18 * 5 and m.rehash_left() == 0
    for k in range(40_000):
        del m[k]
    for k in range(10**6, 2 * 10**6):
        m[k] = k
        del m[k]
        if m.__sizeof__() != prepared and not m.rehash_left():
            break  # the rebuild, done
    assert m.__sizeof__() == plain and m.rehash_left() == 0
    assert len(m) == 40_000 and list(m) == list(range(40_000, 80_000))


@pytest.mark.parametrize("seed", range(4))
def test_weigh_run_sums_up_the_values_setdefault_run_reads_as_the_pure_twin_does(seed: int) -> None:
    from router.pressure import _weigh_run_py

    rng = random.Random(seed)
    batches = [object() for _ in range(3)]
    alone = [sys.getrefcount(b) for b in batches]
    native, ref = tables.NodeMap(), {}
    shapes = 0
    head = None
    for keys in _runs_over_random_pairs(rng, batches, native, ref):
        if -1 in keys:
            continue
        if keys and rng.random() < 0.5:  # the ledger's common shape: a run of one, then new
            lead = rng.randrange(len(keys) + 1)
            head = ref.get(keys[0])
            keys = [k for k in keys[:lead] if ref.get(k) is head] + [
                rng.randrange(U64) for _ in range(len(keys) - lead)
            ]
        batch = rng.choice(batches)
        got = native.weigh_run(keys, batch)
        want = _weigh_run_py(ref, keys, batch)
        assert got[:2] == want[:2]
        assert got[2] == want[2]
        shapes += got[2] is None
        assert list(native.items()) == list(ref.items())
    assert shapes  # the summed-up shape came up
    assert native.weigh_run([], batches[0]) == (None, 0, None)
    native.clear()
    ref.clear()
    del batch, got, want, head
    assert [sys.getrefcount(b) for b in batches] == alone  # one reference per entry, no more
    with pytest.raises(TypeError, match="keys are ints"):
        native.weigh_run([1, -1], batches[0])
