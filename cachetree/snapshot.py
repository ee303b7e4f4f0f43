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
an event loop can yield between chunks of a million-block tree, and both work a column at a
time with C-level passes (`map`, `compress`, `zip` into `dict.update`/`setdefault`, bytes
operations), so a node costs no Python statement in the common case: one or two carriers on
the device tier. At a million nodes a walk or a graft is a few dozen passes, not a million
trips through the interpreter. On the compiled layout (`cachetree.tree.TreeLayout`) the
walk of a listed chunk, the creation of a chunk's new device-tier records and the sizing of
the tables before a graft run in `cachetree._tables` (`walk_chunk`, `graft_new`, `reserve`):
the same columns and the same tree, held equal to the pure layout by tests/unit/test_snapshot.py.

Consistency: a chunked export is not one instant. A node pruned between chunks is skipped
with the subtree below it, a node added after the export began is not included. A consumer
that replays the live stream from the cursors read *before* the export began sees every such
change again, and store/remove are idempotent, so nothing is lost.

Restore validates everything before it mutates anything: a parent that is not an earlier
record, a worker index out of range, unknown tier bits, a carrier listed twice, a duplicate
key, or a key the tree already holds under a different parent rejects the whole snapshot with
`SnapshotError` and leaves the tree untouched. A `prevalidated` restore (a vetted snapshot)
skips the structural checks and finds a duplicate key while grafting instead, before placing
the chunk that holds it (see `SnapshotRestore`). Between a restore's first and last step nothing
else may write the tree; the pump, the only writer, guarantees that.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from itertools import accumulate, chain, compress, islice, repeat
from operator import and_, attrgetter, call, eq, itemgetter, lt, ne, not_, or_, sub, truth

from cachetree.ranks import RankId
from cachetree.tiers import ALL_TIERS, DEVICE
from cachetree.tree import BlockTree, Node, _count, _indices, _Rank

Carrier = tuple[int, int, int]  # (worker index, tier bits, engine hash)
NodeRecord = tuple[int | None, int, tuple[Carrier, ...]]

DEFAULT_CHUNK = 4096
_VALID_TIERS = frozenset(range(1, ALL_TIERS + 1))
_DEVICE_BYTE = bytes([DEVICE])
_FLIP = bytes([1, 0]) + bytes(254)  # bytes.translate table: 0 <-> 1
_NO_KEY = object()  # compares unequal to every key and to None
_ROOT_PARENT = {-1: None}  # .get(parent index, parent key): a root's parent key is None
_ONE_U32 = array("I", [0])  # padding, so a carrier-less last record can be read past
_ONE_U64 = array("Q", [0])
_ONE_OR_TWO = frozenset((1, 2))
_IS_TWO = bytes(n == 2 for n in range(256))  # bytes.translate table: 2 -> 1, the rest -> 0
# A node's carrier count -> its carriers' "begins a node" flags, one byte per carrier
_NODE_OPENING = [b""] + [b"\x01" + bytes(n - 1) for n in range(1, 256)]
_get_mask = attrgetter("mask")
_get_children = attrgetter("children")
_get_parent = attrgetter("parent")
_get_tiers = attrgetter("tiers")
_get_ehash = attrgetter("ehash")


# `_tables.graft_new` outcomes
_HASH_TAKEN, _DUPLICATE_KEY, _PARENT_GONE = 1, 2, 3


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
    """A chunked export of `tree`: call `step()` until it returns True, then `result()`.

    The nodes are listed first, in the dict's parent-before-child order (`list_step`); each
    step then reads a run of them column by column (masks, tiers, engine hashes, parents) with
    C-level passes, so a node costs no Python statement in the common case.

    Listing: the keys go into u64 arrays and the node objects into tuples, one pair per chunk
    of `list_step`'s budget, so a caller can spread the listing of millions of nodes over
    several turns of its event loop, as long as nothing writes the tree in between (a dict
    iterator cannot survive a change; the pump, the only writer, is held meanwhile). Neither
    arrays nor tuples of `gc=False` nodes are traced by the cyclic collector (a tuple of
    untracked objects is untracked at its first collection), so a full collection during the
    walk does not rescan millions of references, and each chunk is freed as soon as it is
    walked, not a million references at once at the end. `step()` on an export not yet listed
    lists the rest in one go first (a caller that holds no loop).

    A node removed from the tree since the listing has no carrier and no child (that is the
    only way one leaves), so it is recognised and skipped; its subtree left before it did. A
    node still in the tree has had its parent in the tree since before the listing, so the
    parent is an earlier record. Most parents are the record just before (a chain is stored
    block after block); the others (a chain branching off an older prefix) are resolved by key
    in a last pass, which is cheaper than a million-entry key -> record map.
    """

    def __init__(self, tree: BlockTree) -> None:
        self._tree = tree
        nodes = tree._nodes
        self._total = len(nodes)
        self._key_iter: Iterator[int] | None = iter(nodes)
        self._obj_iter: Iterator[Node] | None = iter(nodes.values())
        self._listed = 0
        # Listed chunks not walked yet: (keys, node objects); the first one is being walked.
        self._chunks: deque[tuple[array, tuple[Node, ...]]] = deque()
        self._pos = 0  # within the first chunk
        self._last_key: object = _NO_KEY  # key of the last record written
        self._branches: list[tuple[int, int]] = []  # (record, parent key) left to resolve
        self._resolved = 0  # records scanned while resolving branches
        self._table_of: dict[RankId, int] = {}
        self._snap = Snapshot()

    @property
    def listed(self) -> bool:
        return self._key_iter is None

    def list_step(self, budget: int = 1 << 16) -> bool:
        """List up to `budget` more nodes; True once every node is listed. Nothing may write
        the tree between the first call and the one that returns True."""
        if self._key_iter is None or self._obj_iter is None:
            return True
        n = min(max(1, budget), self._total - self._listed)
        keys = array("Q", islice(self._key_iter, n))
        objs = tuple(islice(self._obj_iter, n))
        if len(keys) != n or len(objs) != n or len(self._tree._nodes) != self._total:
            raise RuntimeError("the tree changed while its nodes were being listed")
        if n:
            self._chunks.append((keys, objs))
        self._listed += n
        if self._listed >= self._total:
            self._key_iter = self._obj_iter = None
            return True
        return False

    @property
    def done(self) -> bool:
        return self.listed and not self._chunks and not self._branches

    def step(self, budget: int = DEFAULT_CHUNK) -> bool:
        if not self.listed:
            while not self.list_step(1 << 30):
                pass
        if self._chunks:
            self._walk(max(1, budget))
        elif self._branches:
            self._resolve(max(1, budget))
        return self.done

    def _walk(self, budget: int) -> None:
        chunk_keys, chunk_objs = self._chunks[0]
        a = self._pos
        b = min(a + budget, len(chunk_keys))
        if b == len(chunk_keys):
            self._chunks.popleft()
            self._pos = 0
        else:
            self._pos = b
        objs: Sequence[Node] = chunk_objs[a:b]
        keys = chunk_keys[a:b]
        walk_chunk = self._tree._layout.walk_chunk
        if walk_chunk is not None and self._walk_native(walk_chunk, objs, keys):
            return
        masks = list(map(_get_mask, objs))
        if self._tree._hidden:  # a staged state, or a replaced one being dropped (`stage_rank`)
            masks = list(map(and_, masks, repeat(~self._tree._hidden)))
        if 0 in masks:
            # Carrier-less: structure above carriers, or a node that has left the tree.
            alive = list(map(truth, map(or_, masks, map(_get_children, objs))))
            if not all(alive):
                objs = list(compress(objs, alive))
                keys = array("Q", compress(keys, alive))
                masks = list(compress(masks, alive))
        if not objs:
            return
        snap = self._snap
        first = len(snap.keys)
        n = len(objs)
        # Parents: mostly the previous record; the rest are roots or branches.
        parent_keys = list(map(_get_parent, objs))
        follows = bytes(map(eq, parent_keys, chain((self._last_key,), keys)))
        parents = array("q", range(first - 1, first + n - 1))
        if 0 in follows:
            others = follows.translate(_FLIP)
            for j, parent_key in zip(
                compress(range(n), others), compress(parent_keys, others), strict=True
            ):
                if parent_key is None:
                    parents[j] = -1
                else:
                    self._branches.append((first + j, parent_key))
        self._last_key = keys[-1]
        snap.parents.extend(parents)
        snap.keys.extend(keys)
        counts = array("I", map(int.bit_count, masks))
        snap.carrier_counts.extend(counts)
        # Rank indices are stable within one step but may be reused between steps, so the
        # layout (mask -> carriers) is rebuilt per step from the ranks' identities.
        layout = _Layout(self._tree, self._table_index)
        snap.carrier_workers.extend(chain.from_iterable(map(layout.__getitem__, masks)))
        tiers = list(map(_get_tiers, objs))
        if tiers.count(None) == n:
            snap.carrier_tiers.frombytes(_DEVICE_BYTE * sum(counts))
        else:
            per_node: list = list(map(repeat, repeat(DEVICE), counts))
            for j in compress(range(n), tiers):
                got = tiers[j].get  # type: ignore[union-attr]
                per_node[j] = [got(i, DEVICE) for i in _bit_indices(masks[j])]
            snap.carrier_tiers.extend(chain.from_iterable(per_node))
        hashes = list(map(_get_ehash, objs))
        per_carrier = list(map(isinstance, hashes, repeat(dict)))
        if not any(per_carrier) and counts.count(1) == n:
            snap.carrier_hashes.extend(hashes)
        else:
            # One engine hash shared by every carrier, or a dict read in carrier order.
            per_node: list[Sequence[int]] = list(zip(hashes))
            if counts.count(1) != n:
                for j in compress(range(n), map(ne, counts, repeat(1))):
                    if not per_carrier[j]:
                        per_node[j] = (hashes[j],) * counts[j]  # type: ignore[operator]
            where = compress(range(n), per_carrier)
            getters = map(_carrier_getter, compress(masks, per_carrier))
            values = map(call, getters, compress(hashes, per_carrier))
            deque(map(per_node.__setitem__, where, values), maxlen=0)
            snap.carrier_hashes.extend(chain.from_iterable(per_node))

    def _walk_native(
        self, walk_chunk: Callable[..., tuple | None], objs: Sequence[Node], keys: array
    ) -> bool:
        """`_walk`'s columns from `_tables.walk_chunk` (the compiled layout); False, having
        changed nothing, for a chunk it leaves to the Python walk (masks past 64 ranks)."""
        tree, snap = self._tree, self._snap
        # A hidden rank's index maps nowhere: a chunk it carries is left to the Python walk.
        table = [
            -1 if st is None or tree._hidden >> i & 1 else self._table_index(st.rank)
            for i, st in enumerate(tree._by_index)
        ]
        last = None if self._last_key is _NO_KEY else self._last_key
        out = walk_chunk(objs, keys, table, len(snap.keys), last)
        if out is None:
            return False
        parents, node_keys, counts, workers, tiers, hashes, branches, last = out
        snap.parents.frombytes(parents)
        snap.keys.frombytes(node_keys)
        snap.carrier_counts.frombytes(counts)
        snap.carrier_workers.frombytes(workers)
        snap.carrier_tiers.frombytes(tiers)
        snap.carrier_hashes.frombytes(hashes)
        self._branches.extend(branches)
        self._last_key = _NO_KEY if last is None else last
        return True

    def _resolve(self, budget: int) -> None:
        """Find the branches' parents among the records, `budget` records per step."""
        keys = self._snap.keys
        if self._resolved == 0:
            self._wanted: dict[int, int] = dict.fromkeys((k for _, k in self._branches), -1)
        a = self._resolved
        b = min(a + budget, len(keys))
        wanted = self._wanted
        for i in compress(range(a, b), map(wanted.__contains__, keys[a:b])):
            wanted[keys[i]] = i
        self._resolved = b
        if b == len(keys):
            parents = self._snap.parents
            for record, parent_key in self._branches:
                parents[record] = wanted[parent_key]
            self._branches = []

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


class _Layout(dict[int, tuple[int, ...]]):
    """mask -> the worker-table index of each carrier, in rank-index order; filled on demand
    (a tree has few distinct masks), so the lookup per node is a C-level dict hit."""

    def __init__(self, tree: BlockTree, table_index: Callable[[RankId], int]) -> None:
        super().__init__()
        self._by_index = tree._by_index
        self._table_index = table_index
        # Every rank of the tree enters the table in index order, carrier or not (a caller
        # trims the ones that carry nothing), so the table does not depend on the walk.
        for st in self._by_index:
            if st is not None:
                table_index(st.rank)

    def __missing__(self, mask: int) -> tuple[int, ...]:
        by_index = self._by_index
        out = self[mask] = tuple(
            self._table_index(by_index[i].rank)  # type: ignore[union-attr]
            for i in _bit_indices(mask)
        )
        return out


@lru_cache(maxsize=4096)
def _bit_indices(mask: int) -> tuple[int, ...]:
    """The rank indices of `mask`'s bits, lowest first (cached: a tree has few masks)."""
    return tuple(_indices(mask))


@lru_cache(maxsize=4096)
def _carrier_getter(mask: int) -> Callable[[dict[int, int]], Sequence[int]]:
    """A C-level reader of a per-carrier dict's values, in `mask`'s carrier order."""
    indices = _bit_indices(mask)
    if len(indices) > 1:
        return itemgetter(*indices)
    return partial(_values_of, indices)  # itemgetter of one index returns a bare value


def _values_of(indices: tuple[int, ...], values: dict[int, int]) -> list[int]:
    return [values[i] for i in indices]


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

    Grafting a chunk: the records whose key the tree did not hold are created together, with
    C-level passes over the columns (masks, engine hashes, parent keys, child counts) and one
    `dict.update` per map; only records with several carriers or off-device tiers take a
    Python statement each. Records whose key the tree held, and a chunk in which an engine
    hash is already taken by the rank (the tree's rule for that is "the newest placement
    wins", which `BlockTree._place` implements), go through `_place` one carrier at a time.

    A node's child count is raised as its children are created, never ahead of them, so a
    graft stopped between chunks leaves a consistent tree: clearing the grafted ranks removes
    everything it added.
    """

    def __init__(self, tree: BlockTree, snapshot: Snapshot, *, prevalidated: bool = False) -> None:
        """`prevalidated`: the snapshot's structure was already proven by the code that built it
        (`peer.vet`, an export of our own tree) and has no carrier-less subtree. Only the
        checks against this tree (a key held under another parent) still run before the graft:
        at a million records the structural re-checks cost about a second. A key that appears
        twice is then found while grafting, at the chunk that repeats it: `step` raises
        SnapshotError before placing anything of that chunk, and the ranks it grafted so far
        must be cleared by the caller (the pump runs them cold)."""
        self._tree = tree
        self._snap = snapshot
        self._workers = _validate_workers(snapshot.workers)
        self._prevalidated = prevalidated
        self._pos = 0
        self._carrier_pos = 0
        self._validated = False
        self._keep = b""
        # Some record's key was in the tree before the graft. Until then every key is new,
        # and stays new until its own record is grafted (keys are unique).
        self._any_present = False
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
            n = len(snap.keys)
            if self._prevalidated:
                self._keep = b"\x01" * n
            else:
                self._keep = bytes(_carried_subtrees(parents, counts))
            self._validated = True
            self._pos = 0
            self._carrier_pos = 0

    def _check_against_tree(self, start: int, end: int) -> None:
        """A key this tree already holds must sit under the same parent in the snapshot."""
        nodes = self._tree._nodes
        if not nodes:
            return
        parents, keys = self._snap.parents, self._snap.keys
        found = list(map(nodes.get, keys[start:end]))
        if found.count(None) == len(found):
            return
        self._any_present = True
        for i in compress(range(start, end), found):
            existing = found[i - start]
            parent = parents[i]
            if existing.parent != (None if parent < 0 else keys[parent]):  # type: ignore[union-attr]
                raise SnapshotError(f"record {i}: key {keys[i]:#x} sits under another parent")

    def _graft_chunk(self, budget: int) -> None:
        tree = self._tree
        counts = self._snap.carrier_counts
        a, b = self._pos, min(self._pos + budget, len(self._snap))
        c0 = self._carrier_pos
        c1 = c0 + sum(counts[a:b])
        ranks = [tree._ranks.get(rank) or tree._add_rank(rank) for rank in self._workers]
        if a == 0:
            self._reserve(ranks)
        kept = self._keep[a:b]
        if self._any_present:
            # Held now, not at validation: a block another rank's stale engine hash had
            # pinned may have left the tree since, and is then created like any new one.
            held_now = int.from_bytes(
                bytes(map(tree._nodes.__contains__, self._snap.keys[a:b])), "little"
            )
            both = int.from_bytes(kept, "little")
            new = (both & ~held_now).to_bytes(b - a, "little")
            held = (both & held_now).to_bytes(b - a, "little")
        else:
            new, held = kept, b""
        if 1 in new and not self._create(a, b, c0, c1, new, held, ranks):
            # In record order, as the tree's rule for a reused engine hash is order-bound.
            self._place_each(compress(range(a, b), kept), a, b, c0, ranks)
        elif 1 in held:
            self._place_each(compress(range(a, b), held), a, b, c0, ranks)
        self._pos = b
        self._carrier_pos = c1
        self.applied += new.count(1) + held.count(1)

    def _reserve(self, ranks: list[_Rank]) -> None:
        """Make room in the compiled tables for what the graft brings, once, before its first
        chunk, so they do not rebuild again and again on the way (each rebuild reads all their
        entries again, in steps: cachetree/_tables.c, "Rebuilding without a stall"). A dict
        cannot be presized; and a tree already bigger than the snapshot is left as is
        (reserving would read it all again, for a graft that may add little)."""
        nodes, snap = self._tree._nodes, self._snap
        reserve = getattr(nodes, "reserve", None)
        if reserve is None or len(nodes) >= len(snap):
            return
        reserve(len(nodes) + len(snap))
        if len(ranks) < 256:  # one byte per carrier: counting is memchr-fast
            by_worker = snap.carrier_workers.tobytes()[:: snap.carrier_workers.itemsize]
            for w, st in enumerate(ranks):
                st.by_engine_hash.reserve(len(st.by_engine_hash) + by_worker.count(w))  # type: ignore[attr-defined]

    def _create(
        self, a: int, b: int, c0: int, c1: int, new: bytes, held: bytes, ranks: list[_Rank]
    ) -> bool:
        """Create the chunk's new records at C speed. Returns False, having changed nothing,
        when a rank already maps one of their engine hashes to a key, or a held record of
        the chunk names it too: then the chunk must go through `_place`, which applies the
        tree's rule for that ("the newest placement wins", so order matters). Raises
        SnapshotError, having changed nothing, when a key appears twice in the snapshot.

        Both maps are filled with `setdefault`, which never overwrites: a repeat shows as a
        map that grew by less than it was given, and what this chunk inserted is taken out
        again before refusing (the rare path; the common one pays no extra lookup)."""
        snap = self._snap
        nodes = self._tree._nodes
        counts = snap.carrier_counts[a:b]
        workers = snap.carrier_workers[c0:c1]
        tiers = snap.carrier_tiers[c0:c1]
        hashes = snap.carrier_hashes[c0:c1]
        parents = snap.parents[a:b]
        records: Sequence[int] = range(a, b)
        if 1 in held:  # a held record's engine hash among the new ones: order matters
            by_carrier = bytes(chain.from_iterable(map(repeat, held, counts)))
            held_pairs = zip(
                compress(workers, by_carrier), compress(hashes, by_carrier), strict=True
            )
            by_carrier = bytes(chain.from_iterable(map(repeat, new, counts)))
            new_pairs = set(
                zip(compress(workers, by_carrier), compress(hashes, by_carrier), strict=True)
            )
            if not new_pairs.isdisjoint(held_pairs):
                return False
        every = new.count(1) == len(new)
        graft_new = self._tree._layout.graft_new
        if (
            graft_new is not None
            and tiers.count(DEVICE) == len(tiers)
            and all(st.index < 64 for st in ranks)
        ):
            return self._create_native(graft_new, a, b, c0, new, every, ranks)
        keys = list(snap.keys[a:b] if every else compress(snap.keys[a:b], new))
        if not every:  # leave out the records that are not new
            by_carrier = bytes(chain.from_iterable(map(repeat, new, counts)))
            workers = array("I", compress(workers, by_carrier))
            tiers = array("B", compress(tiers, by_carrier))
            hashes = array("Q", compress(hashes, by_carrier))
            counts = array("I", compress(counts, new))
            parents = array("q", compress(parents, new))
            records = list(compress(records, new))
        n = len(keys)
        ones = counts.count(1)
        bit_of = [1 << st.index for st in ranks]
        # Carriers as (workers, engine hashes, keys) runs, for the rank maps below.
        carriers: list[tuple[Sequence[int], Sequence[int], Sequence[int]]]
        if ones == n:
            masks = list(map(bit_of.__getitem__, workers))
            engine_hashes: list = list(hashes)
            carriers = [(workers, hashes, keys)]
        elif ones + counts.count(2) == n:
            masks, engine_hashes, carriers = _pair_fields(
                ranks, bit_of, workers, hashes, counts, keys
            )
        else:
            masks, engine_hashes = _node_fields(ranks, bit_of, workers, hashes, counts)
            carriers = [(workers, hashes, list(chain.from_iterable(map(repeat, keys, counts))))]
        raw_tiers = tiers.tobytes()
        node_tiers: Iterable[dict[int, int] | None] = repeat(None)
        if raw_tiers.count(DEVICE) != len(raw_tiers):
            node_tiers = _tier_fields(ranks, workers, tiers, counts)
        if every:
            parent_keys, children, outside = self._chunk_links(parents, keys, a)
        else:
            parent_keys = self._parent_keys(parents, None, a)
            counted = Counter(parents)
            children = list(map(counted.get, records, repeat(0)))
            outside = self._parents_outside(parents, new, a)
        make = self._tree._layout.node
        created = list(map(make, parent_keys, masks, children, node_tiers, engine_hashes))
        before = len(nodes)
        placed = list(map(nodes.setdefault, keys, created))
        if len(nodes) - before != n:
            _take_back(nodes, keys, placed, created)
            raise SnapshotError(f"records {a}..{b - 1}: a key appears twice in the snapshot")

        # Each carrier's hash -> key goes into its rank's map, through C-level passes that
        # call that map's setdefault.
        maps = [st.by_engine_hash for st in ranks]
        setdefaults = _setdefault_of(maps).__getitem__
        before = sum(map(len, maps))
        mapped = [
            list(map(call, map(setdefaults, run_workers), run_hashes, run_keys))
            for run_workers, run_hashes, run_keys in carriers
        ]
        if sum(map(len, maps)) - before != len(hashes):
            for (run_workers, run_hashes, run_keys), values in zip(carriers, mapped, strict=True):
                for w, engine_hash, value, key in zip(
                    run_workers, run_hashes, values, run_keys, strict=True
                ):
                    if value is key and maps[w].get(engine_hash) == key:
                        del maps[w][engine_hash]
            _take_back(nodes, keys, placed, created)
            return False
        _count_carriers(ranks, workers, raw_tiers)
        all_keys = self._snap.keys
        for parent, n_children in outside.items():
            nodes[all_keys[parent]].children += n_children
        return True

    def _create_native(
        self,
        graft_new: Callable[..., tuple[int, int]],
        a: int,
        b: int,
        c0: int,
        new: bytes,
        every: bool,
        ranks: list[_Rank],
    ) -> bool:
        """`_create` for a chunk of device-tier carriers on the compiled layout: the nodes
        and the rank maps are filled by `_tables.graft_new`, with the same outcomes."""
        snap = self._snap
        code, record = graft_new(
            self._tree._nodes,
            [st.by_engine_hash for st in ranks],
            [st.index for st in ranks],
            snap.keys,
            snap.parents,
            snap.carrier_counts,
            snap.carrier_workers,
            snap.carrier_hashes,
            new,
            a,
            b,
            c0,
        )
        if code == _HASH_TAKEN:
            return False
        if code == _DUPLICATE_KEY:
            raise SnapshotError(f"records {a}..{b - 1}: a key appears twice in the snapshot")
        if code == _PARENT_GONE:
            parent = snap.parents[record]
            raise SnapshotError(f"record {parent}: the block left the tree during the graft")
        counts = snap.carrier_counts[a:b]
        workers = snap.carrier_workers[c0 : c0 + sum(counts)]
        if not every:
            workers = array("I", compress(workers, chain.from_iterable(map(repeat, new, counts))))
        _count_carriers(ranks, workers, _DEVICE_BYTE * len(workers))
        return True

    def _chunk_links(
        self, parents: array, keys: list[int], a: int
    ) -> tuple[list[int | None], list[int], Counter[int]]:
        """(parent keys, child counts, parents outside) of a chunk whose every record is new.

        Most records hang under the record just before them (a chain is stored block after
        block), so both lists start as the chunk shifted by one, and only the other records
        (roots, and branches off an older block) are looked at one by one."""
        all_keys = self._snap.keys
        n = len(parents)
        follows = bytes(map(eq, parents, range(a - 1, a + n - 1)))
        if a == 0 and follows[0]:  # a root at record 0: its -1 is no record
            follows = b"\x00" + follows[1:]
        parent_keys: list[int | None] = keys[:-1]
        parent_keys.insert(0, all_keys[a - 1] if follows[0] else None)
        children = list(follows[1:])
        children.append(0)
        outside: Counter[int] = Counter()
        if follows[0]:
            outside[a - 1] = 1
        others = follows.translate(_FLIP)
        for k, parent in zip(compress(range(n), others), compress(parents, others), strict=True):
            if parent < 0:
                parent_keys[k] = None
            elif parent >= a:
                parent_keys[k] = keys[parent - a]
                children[parent - a] += 1
            else:
                parent_keys[k] = all_keys[parent]
                outside[parent] += 1
        nodes = self._tree._nodes
        for parent in outside:
            if all_keys[parent] not in nodes:
                raise SnapshotError(f"record {parent}: the block left the tree during the graft")
        return parent_keys, children, outside

    def _parent_keys(self, parents: array, keys: list[int] | None, a: int) -> list[int | None]:
        """The parent key of each new record. With `keys` (the chunk's keys, every record of
        it new) a parent inside the chunk shares the int its own dict entry holds."""
        all_keys = self._snap.keys
        if keys is None:
            return list(map(_ROOT_PARENT.get, parents, map(all_keys.__getitem__, parents)))
        # (reads keys[0] for a parent before the chunk, a root's too; those are set below)
        out = list(map(keys.__getitem__, map(sub, map(max, parents, repeat(a)), repeat(a))))
        before = list(compress(range(len(parents)), map(lt, parents, repeat(a))))
        if before:
            outside = list(map(parents.__getitem__, before))
            values = map(_ROOT_PARENT.get, outside, map(all_keys.__getitem__, outside))
            deque(map(out.__setitem__, before, values), maxlen=0)
        return out

    def _parents_outside(self, parents: array, new: bytes, a: int) -> Counter[int]:
        """The records outside this creation (earlier chunks, or held) that the new records
        hang under, with how many each. Refuses one that is not in the tree: its record was
        grafted, then the block left again (another record moved its engine hash away)."""
        # new[p - a] marks a parent created with its children; p < a reads the padding 0.
        flags = (new + b"\x00").__getitem__
        inside = map(flags, map(max, map(sub, parents, repeat(a)), repeat(-1)))
        outside = Counter(compress(parents, map(not_, inside)))
        outside.pop(-1, None)  # roots
        nodes, keys = self._tree._nodes, self._snap.keys
        for parent in outside:
            if keys[parent] not in nodes:
                raise SnapshotError(f"record {parent}: the block left the tree during the graft")
        return outside

    def _place_each(
        self, records: Iterable[int], a: int, b: int, c0: int, ranks: list[_Rank]
    ) -> None:
        """Place records of the chunk [a, b) one carrier at a time."""
        tree = self._tree
        snap = self._snap
        parents, keys, counts = snap.parents, snap.keys, snap.carrier_counts
        c_workers, c_tiers, c_hashes = snap.carrier_workers, snap.carrier_tiers, snap.carrier_hashes
        firsts = list(accumulate(counts[a:b], initial=c0))
        for i in records:
            parent = parents[i]
            parent_key = None if parent < 0 else keys[parent]
            key = keys[i]
            start, end = firsts[i - a], firsts[i - a + 1]
            if start == end:
                if key not in tree._nodes:
                    tree._nodes[key] = tree._layout.node(parent_key, 0, 0)
                    if parent_key is not None:
                        tree._nodes[parent_key].children += 1
                continue
            for j in range(start, end):
                tree._place(ranks[c_workers[j]], parent_key, (key,), (c_hashes[j],), c_tiers[j])


def _pair_fields(
    ranks: list[_Rank],
    bit_of: list[int],
    workers: array,
    hashes: array,
    counts: array,
    keys: list[int],
) -> tuple[list[int], list, list[tuple[Sequence[int], Sequence[int], Sequence[int]]]]:
    """`_node_fields` for nodes of one or two carriers each (the shape of a real tree), and
    the carriers as two runs, first carriers and second ones, with their nodes' keys.

    A node's first carrier is picked out of the carrier columns by a byte mask (one byte
    per carrier, 1 where a node begins), the second ones by the same mask flipped, so each
    column is read by `compress` instead of an index per node."""
    sizes = counts.tobytes()[:: counts.itemsize]  # counts are 1 or 2: one byte each
    begins = b"".join(map(_NODE_OPENING.__getitem__, sizes))
    seconds = begins.translate(_FLIP)
    first_workers = list(compress(workers, begins))
    first_hashes = list(compress(hashes, begins))
    masks = list(map(bit_of.__getitem__, first_workers))
    fields: list = list(first_hashes)
    two = list(compress(range(len(sizes)), sizes.translate(_IS_TWO)))
    second_workers = list(compress(workers, seconds))
    second_hashes = list(compress(hashes, seconds))
    two_keys = list(map(keys.__getitem__, two))
    pair_masks = map(or_, map(masks.__getitem__, two), map(bit_of.__getitem__, second_workers))
    deque(map(masks.__setitem__, two, pair_masks), maxlen=0)
    differ = list(compress(range(len(two)), map(ne, map(fields.__getitem__, two), second_hashes)))
    if differ:
        index_of = [st.index for st in ranks]
        where = list(map(two.__getitem__, differ))
        per_index = zip(
            zip(
                map(index_of.__getitem__, map(first_workers.__getitem__, where)),
                map(first_hashes.__getitem__, where),
                strict=True,
            ),
            zip(
                map(index_of.__getitem__, map(second_workers.__getitem__, differ)),
                map(second_hashes.__getitem__, differ),
                strict=True,
            ),
            strict=True,
        )
        deque(map(fields.__setitem__, where, map(dict, per_index)), maxlen=0)
    runs = [(first_workers, first_hashes, keys), (second_workers, second_hashes, two_keys)]
    return masks, fields, runs


def _node_fields(
    ranks: list[_Rank], bit_of: list[int], workers: array, hashes: array, counts: array
) -> tuple[list[int], list[int | dict[int, int] | None]]:
    """Each node's mask and engine-hash field (one int when its carriers agree, else a dict
    by rank index), for nodes with any number of carriers.

    Nodes of one or two carriers (nearly all) are read at C speed from their first and last
    carrier, which are the same carrier for one; a carrier-less node gets (0, None), a node
    of three or more a loop of its own."""
    n = len(counts)
    ends = list(accumulate(counts))
    firsts = list(map(sub, ends, counts))
    lasts = list(map(sub, ends, repeat(1)))
    carrier_bits = list(map(bit_of.__getitem__, workers))
    carrier_bits.append(0)  # read by a carrier-less last node; patched below
    hashes_padded = hashes + _ONE_U64
    masks = list(
        map(or_, map(carrier_bits.__getitem__, firsts), map(carrier_bits.__getitem__, lasts))
    )
    fields: list = list(map(hashes_padded.__getitem__, firsts))
    last_hashes = list(map(hashes_padded.__getitem__, lasts))
    differing = map(ne, fields, last_hashes)
    if 0 in counts:  # a carrier-less node read its neighbours' carriers: leave it out
        differing = map(and_, map(truth, counts), differing)
    differ = list(compress(range(n), differing))
    if differ:
        index_of = [st.index for st in ranks]
        per_index = zip(
            zip(
                map(
                    index_of.__getitem__, map(workers.__getitem__, map(firsts.__getitem__, differ))
                ),
                map(fields.__getitem__, differ),
                strict=True,
            ),
            zip(
                map(index_of.__getitem__, map(workers.__getitem__, map(lasts.__getitem__, differ))),
                map(last_hashes.__getitem__, differ),
                strict=True,
            ),
            strict=True,
        )
        deque(map(fields.__setitem__, differ, map(dict, per_index)), maxlen=0)
    if counts.count(1) + counts.count(2) == n:
        return masks, fields
    for i in compress(range(n), map(not_, map(_ONE_OR_TWO.__contains__, counts))):
        mask = 0
        per: dict[int, int] = {}
        for j in range(firsts[i], ends[i]):
            index = ranks[workers[j]].index
            mask |= 1 << index
            per[index] = hashes[j]
        values = set(per.values())
        masks[i] = mask
        fields[i] = values.pop() if len(values) == 1 else per or None
    return masks, fields


def _count_carriers(ranks: list[_Rank], workers: array, raw_tiers: bytes) -> None:
    """Add grafted carriers (table positions `workers`, tier bits `raw_tiers`) to the ranks'
    per-tier counts."""
    if raw_tiers.count(DEVICE) == len(raw_tiers):
        if len(ranks) < 256:  # one byte per carrier: counting is memchr-fast
            by_worker = workers.tobytes()[:: workers.itemsize]
            for w, st in enumerate(ranks):
                st.counts[0] += by_worker.count(w)
        else:
            for w, n_carried in Counter(workers).items():
                ranks[w].counts[0] += n_carried
    else:
        for w, st in enumerate(ranks):
            rank_tiers = bytes(compress(raw_tiers, map(eq, workers, repeat(w))))
            for bits in set(rank_tiers):
                _count(st.counts, bits, rank_tiers.count(bits))


def _take_back(mapping: dict, keys: Sequence, got: list, given: Sequence) -> None:
    """Undo `got = list(map(mapping.setdefault, keys, given))`: drop the entries it added."""
    for key, value, mine in zip(keys, got, given, strict=True):
        if value is mine and mapping.get(key) is mine:
            del mapping[key]


def _tier_fields(
    ranks: list[_Rank], workers: array, tiers: array, counts: array
) -> list[dict[int, int] | None]:
    """Each node's `tiers` field: rank index -> bits, for its carriers not on DEVICE alone."""
    out: list[dict[int, int] | None] = [None] * len(counts)
    firsts = list(accumulate(counts, initial=0))
    for j in compress(range(len(tiers)), map(ne, tiers, repeat(DEVICE))):
        i = bisect_right(firsts, j) - 1
        entry = out[i]
        if entry is None:
            entry = out[i] = {}
        entry[ranks[workers[j]].index] = tiers[j]
    return out


def _setdefault_of(maps: list[dict[int, int]]) -> list[Callable[[int, int], int]]:
    return [m.setdefault for m in maps]


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
