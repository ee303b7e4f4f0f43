"""Export, validate and restore the index; a canonical view to compare two replicas.

An exported `Snapshot` is a worker table (RankIds) and node records in parent-before-child
order. Record i is `(parent, key, carriers)`: `parent` is the index of an *earlier* record
(-1 for a chain root), `key` the chained block key, and `carriers` a list of
`(worker index, tier bits, engine hash)`. Keys already imply positions; the parent index is
kept as a cheap structural check and so a consumer can graft without hashing anything.

Records are stored as columns of typed arrays, not as a million tuples: building and
checking columns costs no allocations the cyclic garbage collector has to trace (with tuples
a 1M-block export spent most of its time in the collector), a u64 column cannot hold a
negative or oversized value, and most validation runs at C speed (`max`, `set`).

Both directions are chunkable (`SnapshotExport.step`, `SnapshotRestore.step`) so a caller on
an event loop can yield between chunks of a million-block tree.

Consistency: a chunked export is not one instant. A node pruned between chunks is skipped
with the subtree below it, a node added after the export began is not included. A consumer
that replays the live stream from the cursors read *before* the export began sees every such
change again, and store/remove are idempotent, so nothing is lost.

Restore validates everything before it mutates anything: a parent that is not an earlier
record, a worker index out of range, unknown tier bits, a carrier listed twice, a duplicate
key, or a key the tree already holds under a different parent rejects the whole snapshot with
`SnapshotError` and leaves the tree untouched. Between a restore's first and last step nothing
else may write the tree; the pump, the only writer, guarantees that.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from cachetree.ranks import RankId
from cachetree.tiers import ALL_TIERS, DEVICE
from cachetree.tree import BlockTree, Node

Carrier = tuple[int, int, int]  # (worker index, tier bits, engine hash)
NodeRecord = tuple[int | None, int, tuple[Carrier, ...]]

DEFAULT_CHUNK = 4096
_VALID_TIERS = frozenset(range(1, ALL_TIERS + 1))


class SnapshotError(ValueError):
    """A snapshot that cannot be restored. Nothing was changed."""


@dataclass(slots=True)
class Snapshot:
    workers: list[RankId] = field(default_factory=list)
    parents: array = field(default_factory=lambda: array("q"))  # -1 = chain root
    keys: array = field(default_factory=lambda: array("Q"))
    carrier_counts: array = field(default_factory=lambda: array("I"))  # carriers per record
    carrier_workers: array = field(default_factory=lambda: array("I"))
    carrier_tiers: array = field(default_factory=lambda: array("B"))
    carrier_hashes: array = field(default_factory=lambda: array("Q"))

    def __len__(self) -> int:
        return len(self.keys)

    def records(self) -> Iterator[NodeRecord]:
        """The records as tuples: parent (None for a root), key, carriers."""
        pos = 0
        cw, ct, ch = self.carrier_workers, self.carrier_tiers, self.carrier_hashes
        for parent, key, n in zip(self.parents, self.keys, self.carrier_counts, strict=True):
            carriers = tuple((cw[j], ct[j], ch[j]) for j in range(pos, pos + n))
            pos += n
            yield (None if parent < 0 else parent, key, carriers)

    @classmethod
    def from_records(
        cls, workers: Iterable[RankId | tuple[str, int]], records: Iterable[NodeRecord]
    ) -> Snapshot:
        """Columns from tuples, checking types (values are checked by restore)."""
        snap = cls(workers=_validate_workers(workers))
        try:
            for i, (parent, key, carriers) in enumerate(records):
                if parent is not None and type(parent) is not int:
                    raise SnapshotError(f"record {i}: parent {parent!r} is not an index")
                snap.parents.append(-1 if parent is None else parent)
                snap.keys.append(_strict_int(key))
                snap.carrier_counts.append(len(carriers))
                for worker, bits, engine_hash in carriers:
                    snap.carrier_workers.append(_strict_int(worker))
                    snap.carrier_tiers.append(_strict_int(bits))
                    snap.carrier_hashes.append(_strict_int(engine_hash))
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, SnapshotError):
                raise
            raise SnapshotError(f"malformed record: {exc}") from None
        return snap


def _strict_int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an int")
    return value


class SnapshotExport:
    """A chunked export of `tree`: call `step()` until it returns True, then `result()`."""

    def __init__(self, tree: BlockTree) -> None:
        self._tree = tree
        # A u64 array, not a list: the garbage collector need not walk a million entries.
        self._keys = array("Q", tree._iter_keys())
        self._pos = 0
        self._record_of: dict[int, int] = {}  # key -> record index
        self._table_of: dict[RankId, int] = {}
        self._snap = Snapshot()

    @property
    def done(self) -> bool:
        return self._pos >= len(self._keys)

    def step(self, budget: int = DEFAULT_CHUNK) -> bool:
        tree = self._tree
        nodes = tree._nodes
        record_of = self._record_of
        snap = self._snap
        add_parent, add_key, add_count = (
            snap.parents.append,
            snap.keys.append,
            snap.carrier_counts.append,
        )
        add_worker, add_tier, add_hash = (
            snap.carrier_workers.append,
            snap.carrier_tiers.append,
            snap.carrier_hashes.append,
        )
        # Rank indices are stable within one step but may be reused between steps, so the
        # index -> table mapping is rebuilt per step from the ranks' identities.
        table = [-1 if st is None else self._table_index(st.rank) for st in tree._by_index]
        end = min(self._pos + budget, len(self._keys))
        n_records = len(snap.keys)
        for key in self._keys[self._pos : end]:
            node = nodes.get(key)
            if node is None:
                continue
            parent = node.parent
            if parent is None:
                parent_index = -1
            else:
                parent_index = record_of.get(parent, -1)
                if parent_index < 0:
                    continue  # its parent went away mid-export; skip this subtree
            record_of[key] = n_records
            n_records += 1
            add_parent(parent_index)
            add_key(key)
            mask = node.mask
            if mask & (mask - 1) == 0 and node.tiers is None and type(node.ehash) is int:
                # At most one device-only carrier: the common case, without the generic path.
                if mask:
                    add_count(1)
                    add_worker(table[mask.bit_length() - 1])
                    add_tier(DEVICE)
                    add_hash(node.ehash)
                else:
                    add_count(0)
                continue
            carriers = tree._carriers_with_hash(node)
            add_count(len(carriers))
            for index, bits, engine_hash in carriers:
                add_worker(table[index])
                add_tier(bits)
                add_hash(engine_hash)
        self._pos = end
        return self.done

    def result(self) -> Snapshot:
        if not self.done:
            raise RuntimeError("export not finished: call step() until it returns True")
        return self._snap

    def _table_index(self, rank: RankId) -> int:
        index = self._table_of.get(rank)
        if index is None:
            index = self._table_of[rank] = len(self._snap.workers)
            self._snap.workers.append(rank)
        return index


def export(tree: BlockTree) -> Snapshot:
    job = SnapshotExport(tree)
    while not job.step(1 << 30):
        pass
    return job.result()


class SnapshotRestore:
    """A chunked, validated graft of `snapshot` onto `tree`.

    `step()` validates in chunks first (raising SnapshotError with the tree untouched), then
    grafts in chunks: missing nodes are created, carriers and tiers are unioned onto existing
    ones, and each rank's engine-hash map is extended. Records with no carrier anywhere in
    their subtree are dropped rather than grafted as bare structure.
    """

    def __init__(self, tree: BlockTree, snapshot: Snapshot, *, prevalidated: bool = False) -> None:
        """`prevalidated`: the snapshot's structure was already proven by the code that built it
        (`peer.vet`, an export of our own tree) and has no carrier-less subtree. Only the
        checks against this tree (a key held under another parent) still run: at a million
        records the structural re-checks cost about a second."""
        self._tree = tree
        self._snap = snapshot
        self._workers = _validate_workers(snapshot.workers)
        self._prevalidated = prevalidated
        self._pos = 0
        self._carrier_pos = 0
        self._validated = False
        self._keep: bytearray = bytearray()
        self.applied = 0
        if not prevalidated:
            self._check_columns()

    @property
    def done(self) -> bool:
        return self._validated and self._pos >= len(self._snap)

    def step(self, budget: int = DEFAULT_CHUNK) -> bool:
        if not self._validated:
            self._validate_chunk(budget)
        else:
            self._graft_chunk(budget)
        return self.done

    def _check_columns(self) -> None:
        """The checks that run at C speed over whole columns."""
        snap = self._snap
        n = len(snap.keys)
        if len(snap.parents) != n or len(snap.carrier_counts) != n:
            raise SnapshotError("record columns differ in length")
        total = sum(snap.carrier_counts)
        if not len(snap.carrier_workers) == len(snap.carrier_tiers) == len(snap.carrier_hashes):
            raise SnapshotError("carrier columns differ in length")
        if total != len(snap.carrier_workers):
            raise SnapshotError("carrier counts do not add up to the carrier columns")
        if snap.carrier_workers and max(snap.carrier_workers) >= len(self._workers):
            raise SnapshotError(f"a worker index is out of range (table has {len(self._workers)})")
        if not set(snap.carrier_tiers) <= _VALID_TIERS:
            raise SnapshotError("a carrier has unknown or empty tier bits")
        if len(set(snap.keys)) != n:
            raise SnapshotError("a key appears twice")

    def _validate_chunk(self, budget: int) -> None:
        snap = self._snap
        parents, counts = snap.parents, snap.carrier_counts
        start, end = self._pos, min(self._pos + budget, len(snap.keys))
        if not self._prevalidated:
            c_workers = snap.carrier_workers
            cpos = self._carrier_pos
            for i in range(start, end):
                parent = parents[i]
                if not -1 <= parent < i:
                    raise SnapshotError(f"record {i}: parent {parent} is not an earlier record")
                n = counts[i]
                if n > 1 and len(set(c_workers[cpos : cpos + n])) != n:
                    raise SnapshotError(f"record {i}: a worker is listed twice")
                cpos += n
            self._carrier_pos = cpos
        self._check_against_tree(start, end)
        self._pos = end
        if end >= len(snap.keys):
            if self._prevalidated:
                self._keep = bytearray(b"\x01") * len(snap.keys)
            else:
                self._keep = _carried_subtrees(parents, counts)
            self._validated = True
            self._pos = 0
            self._carrier_pos = 0

    def _check_against_tree(self, start: int, end: int) -> None:
        """A key this tree already holds must sit under the same parent in the snapshot."""
        nodes = self._tree._nodes
        if not nodes:
            return
        parents, keys = self._snap.parents, self._snap.keys
        for i in range(start, end):
            existing = nodes.get(keys[i])
            if existing is not None:
                parent = parents[i]
                if existing.parent != (None if parent < 0 else keys[parent]):
                    raise SnapshotError(f"record {i}: key {keys[i]:#x} sits under another parent")

    def _graft_chunk(self, budget: int) -> None:
        tree = self._tree
        nodes = tree._nodes
        snap = self._snap
        parents, keys, counts, keep = snap.parents, snap.keys, snap.carrier_counts, self._keep
        c_workers, c_tiers, c_hashes = snap.carrier_workers, snap.carrier_tiers, snap.carrier_hashes
        ranks = [tree._ranks.get(rank) or tree._add_rank(rank) for rank in self._workers]
        end = min(self._pos + budget, len(keys))
        cpos = self._carrier_pos
        applied = 0
        for i in range(self._pos, end):
            n = counts[i]
            start, cpos = cpos, cpos + n
            if not keep[i]:
                continue
            applied += 1
            parent = parents[i]
            parent_key = None if parent < 0 else keys[parent]
            key = keys[i]
            if n == 1 and c_tiers[start] == DEVICE and key not in nodes:
                st = ranks[c_workers[start]]
                engine_hash = c_hashes[start]
                if engine_hash not in st.by_engine_hash:
                    # A new block with one device carrier: the common case, inlined.
                    nodes[key] = Node(parent_key, 1 << st.index, 0, None, engine_hash)
                    if parent_key is not None:
                        nodes[parent_key].children += 1
                    st.by_engine_hash[engine_hash] = key
                    st.counts[0] += 1
                    continue
            if n == 0:
                if key not in nodes:
                    nodes[key] = Node(parent_key, 0, 0)
                    if parent_key is not None:
                        nodes[parent_key].children += 1
                continue
            for j in range(start, cpos):
                tree._place(ranks[c_workers[j]], parent_key, (key,), (c_hashes[j],), c_tiers[j])
        self._pos = end
        self._carrier_pos = cpos
        self.applied += applied


def restore(tree: BlockTree, snapshot: Snapshot) -> int:
    """Validate then graft a whole snapshot; returns the number of records applied."""
    job = SnapshotRestore(tree, snapshot)
    while not job.step(1 << 30):
        pass
    return job.applied


def canonical_view(tree: BlockTree) -> frozenset[tuple[int, int | None, tuple]]:
    """A comparable value naming every node, its parent and its carriers with tiers and hashes.

    Two trees with equal views route every prompt identically and resolve every future event
    identically. Rank indices are internal and do not appear.
    """
    rank_of = tree._rank_of
    view = set()
    for key, node in tree._nodes.items():
        carriers = tuple(
            sorted((*rank_of(i), bits, eh) for i, bits, eh in tree._carriers_with_hash(node))
        )
        view.add((key, node.parent, carriers))
    return frozenset(view)


def _validate_workers(workers: Iterable[RankId | tuple[str, int]]) -> list[RankId]:
    out: list[RankId] = []
    for i, w in enumerate(workers):
        if (
            not isinstance(w, tuple | list)
            or len(w) != 2
            or not isinstance(w[0], str)
            or type(w[1]) is not int
            or w[1] < 0
        ):
            raise SnapshotError(f"worker {i}: {w!r} is not a (url, dp_rank) pair")
        out.append(RankId(w[0], w[1]))
    if len(set(out)) != len(out):
        raise SnapshotError("worker table lists a rank twice")
    return out


def _carried_subtrees(parents: Sequence[int], counts: Sequence[int]) -> bytearray:
    """keep[i]: record i or one of its descendants has a carrier."""
    keep = bytearray(1 if n else 0 for n in counts)
    for i in range(len(parents) - 1, -1, -1):
        if keep[i]:
            parent = parents[i]
            if parent >= 0:
                keep[parent] = 1
    return keep
