"""Vetting a sibling's snapshot: the only road from the wire to the tree.

Rules of this file: no I/O, no asyncio, no tree. The input is a decoded `PeerSnapshot`
(msgspec checked its shapes and types, nothing more) and this replica's own set of live ranks;
the output is a `VettedSnapshot` whose columns `cachetree.snapshot.restore` can graft, or a
`VetError` saying whether the peer is worth asking again. Nothing else in the code base turns
wire data into tree data.

Theory of operation
-------------------
A sibling is trusted for one thing: what its tree held, as of its cursors. It is not trusted
about who our workers are. The wire *names* workers by (url, dp_rank); vetting looks each name
up in the live set the caller passed and uses the live set's own `RankId`. A url is compared
as the registry keys it (`peer.origin.canonical_origin`: `http://localhost:P` is
`http://127.0.0.1:P`, `http://w:80` is `http://w`, a trailing slash is ignored), once per
worker table entry, never per block: a sibling of another version, given the same `--worker`
flags, may export the spelling as written. A name that matches no live rank is dropped,
together with every carrier and cursor that points at it. So a rank this replica did not
discover itself can never enter the tree through a sibling, which is what keeps a stale or
confused peer from planting ranks that no stream will ever clear.

A verdict is one of two outcomes:

    rejected    the body is malformed, or was built for another fleet (format, key scheme,
                block size). Permanent: the sweep never asks this peer again.
    cold_peer   the body is sound but of no use yet (not ready, or nothing survives).
                Retriable: the peer may warm up, or we may discover its workers later.

A rejection depends only on the body and our block size, never on the live set, with three
exceptions for bodies that are implausible rather than stale: a rank of a worker we know
that the worker does not have (`unknown_rank`: a dp rank past its dp size), a rank
carrying more device blocks than its engine reports it can hold (`over_capacity`,
`peer.capacity`: made-up blocks no `BlockRemoved` would ever clear), and a worker table none
of whose workers this replica knows (`unknown_workers`: the sibling finds or spells its
workers otherwise, a different `--worker` list or version, and asking it again brings the
same; counted as a cold peer, it held `/readyz` for the whole bootstrap timeout and looked
like a fleet with nothing cached). All end the peer's part in this sweep only. Otherwise a
verdict must not hinge on worker churn, so duplicates are judged on the identities as the
registry spells them, whatever the live set, and the carriers of unknown workers are
type-checked like any other.

The checks, in the order they run (the first failure wins). `REASONS` below is the same list
as data, reason -> outcome.

    header        format != 1                                  unknown_format       rejected
                  key_scheme is not ours                       key_scheme_mismatch  rejected
                  not producer_ready, or no nodes              producer_cold        cold_peer
                  block size differs from ours (when known)    block_size_mismatch  rejected
                  block size < 1 (ours unknown)                invalid_block_size   rejected
    worker table  entry not (str, int)                         malformed_worker     rejected
                  two entries name one worker                  duplicate_worker     rejected
                  a live worker's dp rank it does not have     unknown_rank         rejected
    cursors       entry not (int, int)                         malformed_cursor     rejected
                  seq not a u64 (negative)                     invalid_seq          rejected
                  one worker index twice                       duplicate_cursor     rejected
    adapters      more names than MAX_ADAPTER_NAMES            too_many_adapters    rejected
                  a name empty or holding a NUL                malformed_adapter    rejected
    live set      workers named, and none of them live here    unknown_workers      rejected
    each node     parent not null and not an earlier index     invalid_parent       rejected
                  key not a u64                                invalid_key          rejected
                  carrier not (int, int, int)                  malformed_carrier    rejected
                  tier bits negative                           invalid_tier_bits    rejected
                  engine hash not a u64                        invalid_engine_hash  rejected
                  one worker index twice in one node           duplicate_carrier    rejected
    result        no carrier of a live rank survives           nothing_usable       cold_peer
                  a rank's device blocks over its capacity     over_capacity        rejected

Adapter names (`peer.wire`) are learned by a graft as they come. A producer exports the
names its index learned, which are never empty, never hold a NUL (the separator of a namespace's
parts, `router.events.namespace_of`) and are never more than `MAX_ADAPTER_NAMES`: a list that
breaks one of those rules was not written by our export, and refuses the body like any other
malformed table, rather than teaching the replica names no engine published.

The reference runs the node structure checks before the worker table; we check the tables
first because they are small and every failure among them is the same verdict (rejected), so
only the named reason can differ.

The body may come in either encoding (`peer.wire`): format-1 nodes, whose every field must be
type-checked, or the columnar body, whose typed columns can only hold u64 keys and hashes, u8
tier bits and u32 worker indices, so only the whole-column checks are left (parents, tiers,
workers named twice, unknown workers).

A key repeated at two nodes is not looked for here. Finding one takes a set of every key (at
a million nodes half a second, a tenth of the bootstrap budget), while the graft inserts each
key into the tree's own index anyway: `cachetree.snapshot.SnapshotRestore` refuses the graft
at the chunk holding the repeat, before it places it, and the pump runs the ranks cold
(`tree_rejected`). This differs from a rejection in one way only: the peer may be asked again.

What is dropped rather than refused (counted, never an error):
- a worker that is not live (`dropped_workers`): expected during worker churn;
- a carrier whose worker index is out of range or names a dropped worker, and a carrier whose
  tier bits, masked to the tiers we know (`ALL_TIERS`), come out empty (`dropped_carriers`):
  unknown bits are a newer producer's tiers, and our own tree drops a store on no known tier;
- a cursor for an out-of-range index or a dropped worker;
- an `empty_ranks` or `cold_ranks` entry that names no live rank;
- a node left with no carrier and no carrying descendant (pruned). Carrier-less nodes on a
  path to a carrier are kept as structure, since a child's position needs its parent.

A node that names one worker twice is refused, not repaired: our export never writes that,
the two entries may disagree on the engine hash, and keeping the wrong one would leave a
carrier that the rank's later `BlockRemoved` cannot clear, a permanent false cache hit.

Pruning is one backward sweep. Parents precede children, so walking the carrier-less nodes
from the last to the first, a node is kept if a kept node names it as parent; a kept node then
marks its own parent. Only carrier-less nodes are visited one at a time; the carried nodes'
parents are gathered with C-level set updates. Compaction then renumbers parents through a
prefix sum of the keep mask. Pruning never removes a carrier, so the carrier columns survive
it untouched. The result's worker table lists exactly the ranks that carry a surviving block
(`restore` registers every rank in the table with the tree, so a rank carrying nothing must
not appear there).

Cost. A million-node body is a million msgspec structs, and a Python statement per node is
what would make vetting slow. Each chunk is therefore handled column by column with C-level
iteration (`map`, `compress`, `accumulate`, `array` constructors, `bytes` operations): one
column of parents, one of keys, one flattened column per carrier field. Range checks come free from
`array` (a 'Q' array refuses a negative or oversized value). Python-level loops run only to
name the node behind a failure and, while pruning, over the carrier-less nodes. Apart from
a transient set per node with three or more carriers, no container is made per node, so the
cyclic garbage collector gets nothing new to trace.

Chunking. `Vetting` and `Retaining` are jobs: the constructor runs the cheap checks (and
raises at once), then `step(budget)` handles about `budget` nodes per call until it returns
True, so a caller on the event loop can yield between steps. A 4096-node step takes a few
milliseconds of format-1 nodes and about a millisecond of columns. `VettedSnapshot.from_wire`
and `retain_workers` run a job to the end in one call. A job reads only the wire object it was
given (which the caller owns and must not change meanwhile) and its own columns, never the
tree, so `asyncio.to_thread(VettedSnapshot.from_wire, ...)` is also safe; the live set is
read once, in the constructor. Even then the work stays chunked, because one C-level call
over a million items would hold the GIL, and with it the event loop, for its whole length.
A `VettedSnapshot` is immutable by convention: its columns may be shared with the snapshot it
was derived from.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Collection, Generator, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, count, islice, repeat
from operator import and_, attrgetter, eq, ge, gt, itemgetter, lt, not_, sub, truth
from typing import Final, Generic, TypeVar

from cachetree.keys import KEY_SCHEME, MAX_ADAPTER_NAMES, is_adapter_name
from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot
from cachetree.tiers import ALL_TIERS, DEVICE
from peer.capacity import CapacityBlocks, over_capacity, unknown_capacity
from peer.origin import canonical_origin
from peer.wire import FORMAT, PeerBody, PeerColumns, WireColumns, WireWorker

REJECTED: Final = "rejected"
COLD_PEER: Final = "cold_peer"

# reason -> outcome, in the order the checks run (see the table above).
REASONS: Final[dict[str, str]] = {
    "unknown_format": REJECTED,
    "key_scheme_mismatch": REJECTED,
    "producer_cold": COLD_PEER,
    "block_size_mismatch": REJECTED,
    "invalid_block_size": REJECTED,
    "malformed_worker": REJECTED,
    "duplicate_worker": REJECTED,
    "unknown_rank": REJECTED,
    "malformed_cursor": REJECTED,
    "invalid_seq": REJECTED,
    "duplicate_cursor": REJECTED,
    "too_many_adapters": REJECTED,
    "malformed_adapter": REJECTED,
    "unknown_workers": REJECTED,
    "invalid_parent": REJECTED,
    "invalid_key": REJECTED,
    "malformed_carrier": REJECTED,
    "invalid_tier_bits": REJECTED,
    "invalid_engine_hash": REJECTED,
    "duplicate_carrier": REJECTED,
    "nothing_usable": COLD_PEER,
    "over_capacity": REJECTED,
}

_NAMES_SHOWN: Final = 3  # worker ranks named on either side in an unknown_workers refusal
DEFAULT_BUDGET: Final = 4096  # nodes per step: a few milliseconds on a slow core
_U64: Final = 1 << 64
_KNOWN_TIERS: Final = bytes(b & ALL_TIERS for b in range(256))  # bytes.translate table
_IS_ZERO: Final = b"\x01" + bytes(255)  # bytes.translate table: 0 -> 1, the rest -> 0
# bytes.translate-like lookup: a node's carrier count -> its carriers' "begins a node" flags
_NODE_OPENING: Final = [b""] + [b"\x01" + bytes(n - 1) for n in range(1, 256)]
_KNOWN_NONZERO: Final = bytes(range(1, ALL_TIERS + 1))  # tier bytes that need no masking

_get_parent = attrgetter("parent")
_get_key = attrgetter("key")
_get_carriers = attrgetter("carriers")
_carrier_worker = itemgetter(0)
_carrier_bits = itemgetter(1)
_carrier_hash = itemgetter(2)
_first = itemgetter(0)
_second = itemgetter(1)


class VetError(ValueError):
    """A snapshot that may not touch the tree. `outcome` is `rejected` or `cold_peer`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.outcome = REASONS[reason]
        super().__init__(f"{reason}: {detail}" if detail else reason)

    @property
    def retriable(self) -> bool:
        return self.outcome == COLD_PEER


@dataclass(frozen=True, slots=True)
class VettedSnapshot:
    """A peer snapshot that passed vetting, ready for `cachetree.snapshot.restore`.

    `snapshot.workers` are live `RankId`s (the caller's own objects), each carrying at least
    one record. `cursors` names the last seq the peer had applied per rank: the graft's filter
    and watermark. A rank may have a cursor and no blocks (its cache was empty at that seq).
    `cold_ranks` are those the peer said its view of is partial (`peer.wire`), `adapters` the
    LoRA adapter names it had learned. Treat every field as read-only; derived snapshots share
    unchanged columns.
    """

    snapshot: Snapshot
    cursors: dict[RankId, int]
    empty_ranks: frozenset[RankId]
    block_size: int
    dropped_workers: int = 0  # wire workers that named no live rank
    dropped_carriers: int = 0  # carriers of unknown workers or on no known tier
    wire_nodes: int = 0  # nodes in the body, before vetting
    cold_ranks: frozenset[RankId] = frozenset()
    adapters: frozenset[str] = frozenset()

    @classmethod
    def from_wire(
        cls,
        snap: PeerBody,
        live: Collection[RankId],
        local_block_size: int | None,
        capacity_blocks: CapacityBlocks = unknown_capacity,
    ) -> VettedSnapshot:
        """Vet `snap` in one call; raises `VetError`. See `Vetting` for the chunked form."""
        return Vetting(snap, live, local_block_size, capacity_blocks).run()

    def covers_any(self, ranks: Iterable[RankId]) -> bool:
        """True when the snapshot has a cursor for at least one of `ranks`."""
        cursors = self.cursors
        return any(rank in cursors for rank in ranks)

    def covered_ranks(self) -> frozenset[RankId]:
        """The ranks the snapshot has a cursor for."""
        return frozenset(self.cursors)

    def covers_warm(self, ranks: Iterable[RankId]) -> bool:
        """True when the snapshot has a cursor for at least one of `ranks` it is not cold for."""
        cursors, cold = self.cursors, self.cold_ranks
        return any(rank in cursors and rank not in cold for rank in ranks)

    def carrier_counts(self) -> tuple[int, int]:
        """(nodes with a carrier, carrier-less nodes kept as structure)."""
        structure = self.snapshot.carrier_counts.count(0)
        return len(self.snapshot) - structure, structure

    def retain_workers(self, keep: Collection[RankId]) -> VettedSnapshot:
        """A new snapshot speaking only for `keep`: other ranks' carriers, cursors and
        empty-rank entries are dropped and what they leave bare is pruned. Identities are
        never re-resolved: a rank in `keep` that this snapshot does not name stays absent.
        See `Retaining` for the chunked form."""
        return Retaining(self, keep).run()


# -- jobs ----------------------------------------------------------------------------------

R = TypeVar("R")


class _Job(Generic[R]):
    """Drives a generator that yields after each chunk of work and returns the result."""

    def __init__(self) -> None:
        self._budget = DEFAULT_BUDGET
        self._work: Generator[None, None, R] = self._run()
        self._result: R | None = None
        self._error: VetError | None = None

    def _run(self) -> Generator[None, None, R]:  # pragma: no cover - abstract
        raise NotImplementedError
        yield

    @property
    def done(self) -> bool:
        return self._result is not None

    def step(self, budget: int = DEFAULT_BUDGET) -> bool:
        """Do about `budget` units of work; True once the result is ready.

        Raises `VetError` when a check fails, and again on every later call.
        """
        if self._error is not None:
            raise self._error
        if self._result is not None:
            return True
        self._budget = max(1, budget)
        try:
            next(self._work)
        except StopIteration as stop:
            self._result = stop.value
            return True
        except VetError as exc:
            self._error = exc
            raise
        return False

    def result(self) -> R:
        if self._result is None:
            raise RuntimeError("job not finished: call step() until it returns True")
        return self._result

    def run(self, budget: int = DEFAULT_BUDGET) -> R:
        """Step to the end in one call. Chunked all the same (it costs nothing measurable),
        so that in a worker thread no single C-level call holds the GIL for long."""
        while not self.step(budget):
            pass
        return self.result()

    def _chunks(self, n: int) -> Generator[tuple[int, int], None, None]:
        """[a, b) ranges over n items, each as large as the budget of the step running it."""
        a = 0
        while a < n:
            b = min(n, a + self._budget)
            yield a, b
            a = b


class Vetting(_Job[VettedSnapshot]):
    """One vetting in chunks. The constructor checks the header and the tables and raises
    `VetError` at once; `step(budget)` then vets about `budget` nodes per call."""

    def __init__(
        self,
        snap: PeerBody,
        live: Collection[RankId],
        local_block_size: int | None,
        capacity_blocks: CapacityBlocks = unknown_capacity,
    ) -> None:
        _check_header(snap, local_block_size)
        lookup = _live_lookup(live)
        self._live_urls = {url for url, _ in lookup}
        self._capacity_blocks = capacity_blocks
        self._device: Counter[int] = Counter()  # table position -> device-tier carriers
        self._snap = snap
        self._table: list[RankId] = []  # live ranks the wire names, in wire order
        self._col_of: dict[int, int] = {}  # wire worker index -> position in _table
        self._dropped_workers = 0
        self._resolve_workers(snap.workers, lookup)
        self._position = [self._col_of.get(i, -1) for i in range(len(snap.workers))]
        self._cursors = self._resolve_cursors(snap.cursors)
        self._empty_ranks = _live_ranks(snap.empty_ranks, lookup)
        self._cold_ranks = _live_ranks(snap.cold_ranks, lookup)
        self._adapters = _adapters(snap.adapters)
        if snap.workers and not self._table:
            raise _unknown_workers(snap.workers, lookup)
        self._dropped_carriers = 0
        super().__init__()

    def _resolve_workers(self, workers: list[WireWorker], lookup: dict) -> None:
        seen: set[tuple[str, int]] = set()
        for i, worker in enumerate(workers):
            ident = _identity(worker)
            if ident in seen:
                raise VetError("duplicate_worker", f"worker {i} repeats {ident[0]}#dp{ident[1]}")
            seen.add(ident)
            rank = lookup.get(ident)
            if rank is None and ident[0] in self._live_urls:
                raise VetError(
                    "unknown_rank", f"worker {i}: {ident[0]} has no dp rank {ident[1]} here"
                )
            if rank is None:
                self._dropped_workers += 1
            else:
                self._col_of[i] = len(self._table)
                self._table.append(rank)

    def _resolve_cursors(self, entries: list[tuple[int, int]]) -> dict[RankId, int]:
        cursors: dict[RankId, int] = {}
        seen: set[int] = set()
        for entry in entries:
            try:
                index, seq = entry
            except (TypeError, ValueError):
                raise VetError("malformed_cursor", f"{entry!r} is not [index, seq]") from None
            if type(index) is not int or type(seq) is not int:
                raise VetError("malformed_cursor", f"{entry!r} is not [index, seq]")
            if not 0 <= seq < _U64:
                raise VetError("invalid_seq", f"worker {index}: seq {seq} is not a u64")
            if index in seen:
                raise VetError("duplicate_cursor", f"worker {index} has two cursors")
            seen.add(index)
            col = self._col_of.get(index)
            if col is not None:
                cursors[self._table[col]] = seq
        return cursors

    def _run(self) -> Generator[None, None, VettedSnapshot]:
        snap = self._snap
        cols = Snapshot()
        zeros: list[int] = []  # nodes left with no carrier
        used: set[int] = set()  # table positions that carry something
        if isinstance(snap, PeerColumns):
            carrier = 0  # first carrier of the chunk
            for a, b in self._chunks(snap.node_count):
                carrier = self._vet_columns(snap.columns, a, b, carrier, cols, zeros, used)
                yield
        else:
            for a, b in self._chunks(snap.node_count):
                self._vet_chunk(snap.nodes[a:b], a, cols, zeros, used)
                yield
        if not used:
            raise self._nothing_usable()
        table = self._table
        found = over_capacity({table[p]: n for p, n in self._device.items()}, self._capacity_blocks)
        if found is not None:
            rank, blocks, capacity = found
            raise VetError(
                "over_capacity",
                f"{rank} carries {blocks} device blocks; its engine holds {capacity}",
            )
        cols.workers = self._table
        snapshot = yield from _prune(self, cols, zeros, used)
        if not len(snapshot):  # pragma: no cover - a carried node is never pruned
            raise self._nothing_usable()
        return VettedSnapshot(
            snapshot=snapshot,
            cursors=self._cursors,
            empty_ranks=self._empty_ranks,
            block_size=snap.block_size,
            dropped_workers=self._dropped_workers,
            dropped_carriers=self._dropped_carriers,
            wire_nodes=snap.node_count,
            cold_ranks=self._cold_ranks,
            adapters=self._adapters,
        )

    def _nothing_usable(self) -> VetError:
        return VetError(
            "nothing_usable",
            f"{self._snap.node_count} wire nodes, {self._dropped_workers} dropped workers, "
            f"{self._dropped_carriers} dropped carriers",
        )

    def _vet_chunk(
        self, chunk: list, a: int, cols: Snapshot, zeros: list[int], used: set[int]
    ) -> None:
        """Vet format-1 nodes a .. a+len(chunk)-1 and append their columns, a column at a
        time."""
        # Parents: null is a root (-1); anything else must index an earlier node.
        raw_parents = list(map(_get_parent, chunk))
        parent_list = [-1 if p is None else p for p in raw_parents]
        try:
            parents = array("q", parent_list)
        except (TypeError, OverflowError):
            raise _bad_parent(raw_parents, a) from None
        if -1 in raw_parents:
            raise _bad_parent(raw_parents, a)
        _check_parents(parents, a)

        raw_keys = list(map(_get_key, chunk))
        try:
            keys = array("Q", raw_keys)
        except (TypeError, OverflowError):
            raise _first_bad(raw_keys, a, "invalid_key", "key", _is_u64) from None

        # Carriers, flattened into one column per field.
        carrier_lists = list(map(_get_carriers, chunk))
        try:
            counts = list(map(len, carrier_lists))
            flat = list(chain.from_iterable(carrier_lists))
            workers = list(map(_carrier_worker, flat))
            bits = list(map(_carrier_bits, flat))
            raw_hashes = list(map(_carrier_hash, flat))
        except (TypeError, IndexError, KeyError):
            raise _bad_carrier_shape(carrier_lists, a) from None
        if flat:
            if not set(map(type, workers)) <= {int}:
                raise _bad_carrier_shape(carrier_lists, a)
            tiers = _tier_column(bits)
            if tiers is None:
                raise _bad_tier_bits(carrier_lists, a)
            try:
                hashes = array("Q", raw_hashes)
            except (TypeError, OverflowError):
                raise _bad_engine_hash(carrier_lists, a) from None
            try:
                column: Sequence[int] = array("q", workers)
            except OverflowError:  # an index past 64 bits: out of range, dropped as any other
                column = workers
            _check_distinct_workers(column, counts, a)
        else:
            tiers, hashes = array("B"), array("Q")
        self._append(cols, a, parents, keys, counts, workers, tiers, hashes, zeros, used)

    def _vet_columns(
        self,
        wire: WireColumns,
        a: int,
        b: int,
        carrier: int,
        cols: Snapshot,
        zeros: list[int],
        used: set[int],
    ) -> int:
        """Vet columnar nodes a .. b-1 (their carriers start at `carrier`) and append them.

        The typed columns already hold only u64 keys and hashes and u8 tier bits, so what is
        left are whole-column checks. Returns the first carrier of the next chunk."""
        parents = wire.parents[a:b]
        _check_parents(parents, a)
        counts = wire.carrier_counts[a:b]
        end = carrier + sum(counts)
        workers = wire.carrier_workers[carrier:end]
        bits = wire.carrier_tiers[carrier:end]
        raw_bits = bits.tobytes()
        if raw_bits.translate(None, _KNOWN_NONZERO):  # a zero, or bits we do not know
            bits = array("B", raw_bits.translate(_KNOWN_TIERS))
        _check_distinct_workers(workers, counts, a)
        self._append(
            cols,
            a,
            parents,
            wire.keys[a:b],
            counts,
            workers,
            bits,
            wire.carrier_hashes[carrier:end],
            zeros,
            used,
        )
        return end

    def _append(
        self,
        cols: Snapshot,
        a: int,
        parents: array,
        keys: array,
        counts: Sequence[int],
        workers: Sequence[int],
        tiers: array,
        hashes: array,
        zeros: list[int],
        used: set[int],
    ) -> None:
        """Append vetted nodes a.. to `cols`, dropping the carriers of workers we do not know
        and those on no known tier (a zero in `tiers`)."""
        b = a + len(keys)
        cols.parents.extend(parents)
        cols.keys.extend(keys)
        if not workers:
            cols.carrier_counts.extend(counts)
            zeros.extend(range(a, b))
            return
        # Resolve wire worker index -> table position (-1: out of range or not live). When
        # every wire worker is live the table is the wire table, and an in-range index is
        # already its own position.
        if min(workers) >= 0 and max(workers) < len(self._position):
            if self._dropped_workers:
                positions: Sequence[int] = list(map(self._position.__getitem__, workers))
            else:
                positions = workers
        else:
            positions = list(map(self._col_of.get, workers, repeat(-1)))
        no_tier = 0 in tiers
        if no_tier or (positions is not workers and -1 in positions):
            keep = list(map(ge, positions, repeat(0)))
            if no_tier:
                keep = list(map(and_, keep, map(truth, tiers)))
            counts = _recount(list(counts), keep)
            positions = list(compress(positions, keep))
            tiers = array("B", compress(tiers, keep))
            hashes = array("Q", compress(hashes, keep))
            self._dropped_carriers += len(keep) - len(positions)

        cols.carrier_counts.extend(counts)
        cols.carrier_workers.extend(positions)
        cols.carrier_tiers.extend(tiers)
        cols.carrier_hashes.extend(hashes)
        self._device.update(compress(positions, map(and_, tiers, repeat(DEVICE))))
        if len(used) < len(self._table):  # once every rank was seen there is nothing to learn
            used.update(positions)
        if 0 in counts:
            zeros.extend(compress(range(a, b), map(not_, counts)))


class Retaining(_Job[VettedSnapshot]):
    """`VettedSnapshot.retain_workers` in chunks: `step(budget)` filters about `budget` nodes
    per call, then prunes and renumbers."""

    def __init__(self, vetted: VettedSnapshot, keep: Collection[RankId]) -> None:
        self._vetted = vetted
        self._keep = frozenset(keep)
        super().__init__()

    def _run(self) -> Generator[None, None, VettedSnapshot]:
        vetted, keep = self._vetted, self._keep
        src = vetted.snapshot
        cursors = {rank: seq for rank, seq in vetted.cursors.items() if rank in keep}
        empty_ranks = vetted.empty_ranks & keep
        if all(rank in keep for rank in src.workers):
            snapshot = src  # every carrier stays, so nothing is pruned either
        else:
            position = [i if rank in keep else -1 for i, rank in enumerate(src.workers)]
            n_kept = len(position) - position.count(-1)
            cols = Snapshot(workers=src.workers, parents=src.parents, keys=src.keys)
            zeros: list[int] = []
            used: set[int] = set()
            start = 0  # first carrier of the chunk
            for a, b in self._chunks(len(src)):
                counts = src.carrier_counts[a:b]
                end = start + sum(counts)
                positions = list(map(position.__getitem__, src.carrier_workers[start:end]))
                tiers, hashes = src.carrier_tiers[start:end], src.carrier_hashes[start:end]
                if -1 in positions:
                    kept = list(map(ge, positions, repeat(0)))
                    counts = _recount(counts, kept)
                    positions = list(compress(positions, kept))
                    tiers = array("B", compress(tiers, kept))
                    hashes = array("Q", compress(hashes, kept))
                cols.carrier_counts.extend(counts)
                cols.carrier_workers.extend(positions)
                cols.carrier_tiers.extend(tiers)
                cols.carrier_hashes.extend(hashes)
                if len(used) < n_kept:
                    used.update(positions)
                if 0 in counts:
                    zeros.extend(compress(range(a, b), map(not_, counts)))
                start = end
                yield
            snapshot = yield from _prune(self, cols, zeros, used)
        return VettedSnapshot(
            snapshot=snapshot,
            cursors=cursors,
            empty_ranks=empty_ranks,
            block_size=vetted.block_size,
            dropped_workers=vetted.dropped_workers,
            dropped_carriers=vetted.dropped_carriers,
            wire_nodes=vetted.wire_nodes,
            cold_ranks=vetted.cold_ranks & keep,
            adapters=vetted.adapters,
        )


# -- pruning and renumbering (shared by both jobs) ----------------------------------------


def _prune(
    job: _Job, cols: Snapshot, zeros: list[int], used: set[int]
) -> Generator[None, None, Snapshot]:
    """Drop carrier-less nodes with no carrying descendant, and ranks that carry nothing.

    `cols` holds every node in wire order with its carriers already filtered; `zeros` lists
    the nodes left with no carrier (ascending) and `used` the table positions still carrying.
    """
    parents, counts = cols.parents, cols.carrier_counts
    n = len(cols.keys)
    keep = None
    if zeros:
        # Carrier-less nodes that some carried node names as parent ...
        is_zero = bytearray(n)
        for z in zeros:
            is_zero[z] = 1
        marked: set[int] = set()
        for a, b in job._chunks(n):
            named = list(compress(parents[a:b], counts[a:b]))
            # (a root's -1 reads the last node's flag: harmless, -1 is never looked up)
            marked.update(compress(named, map(is_zero.__getitem__, named)))
            yield
        # ... and, backwards, carrier-less nodes with a kept child. Children come after their
        # parent, so a node's children are all settled when the walk reaches it.
        keep = bytearray(b"\x01") * n
        pruned = 0
        for a, b in job._chunks(len(zeros)):
            for z in reversed(zeros[len(zeros) - b : len(zeros) - a]):
                if z in marked:
                    marked.add(parents[z])
                else:
                    keep[z] = 0
                    pruned += 1
            yield
        if not pruned:
            keep = None
    if keep is not None:
        out = Snapshot(
            workers=cols.workers,
            carrier_workers=cols.carrier_workers,
            carrier_tiers=cols.carrier_tiers,
            carrier_hashes=cols.carrier_hashes,
        )
        # new_index[p]: node p's index after compaction (the number of kept nodes before it).
        # The extra last slot stays -1, so a root's parent -1 maps to itself.
        new_index = [-1] * (n + 1)
        kept = 0
        for a, b in job._chunks(n):
            mask = keep[a:b]
            before = list(accumulate(mask, initial=kept))
            kept = before.pop()
            new_index[a:b] = before
            out.parents.extend(map(new_index.__getitem__, compress(parents[a:b], mask)))
            out.keys.extend(compress(cols.keys[a:b], mask))
            out.carrier_counts.extend(compress(counts[a:b], mask))
            yield
        cols = out
    if len(used) < len(cols.workers):
        # A rank left carrying nothing must leave the table: restore registers every rank it
        # lists with the tree. Table order (wire order) is kept.
        order = sorted(used)
        renumber = [-1] * len(cols.workers)
        for new, old in enumerate(order):
            renumber[old] = new
        out_workers = array("I")
        source = cols.carrier_workers
        for a, b in job._chunks(len(source)):
            out_workers.extend(map(renumber.__getitem__, source[a:b]))
            yield
        cols = Snapshot(
            workers=[cols.workers[i] for i in order],
            parents=cols.parents,
            keys=cols.keys,
            carrier_counts=cols.carrier_counts,
            carrier_workers=out_workers,
            carrier_tiers=cols.carrier_tiers,
            carrier_hashes=cols.carrier_hashes,
        )
    return cols


# -- helpers -------------------------------------------------------------------------------


def _check_header(snap: PeerBody, local_block_size: int | None) -> None:
    if snap.format != FORMAT:
        raise VetError("unknown_format", f"format {snap.format!r}, we read {FORMAT}")
    if snap.key_scheme != KEY_SCHEME:
        raise VetError("key_scheme_mismatch", f"{snap.key_scheme!r}, we hash {KEY_SCHEME!r}")
    if not snap.producer_ready or not snap.node_count:
        raise VetError(
            "producer_cold", f"producer_ready={snap.producer_ready}, {snap.node_count} nodes"
        )
    if local_block_size is not None and snap.block_size != local_block_size:
        raise VetError(
            "block_size_mismatch", f"peer block size {snap.block_size}, ours {local_block_size}"
        )
    if type(snap.block_size) is not int or snap.block_size < 1:
        raise VetError("invalid_block_size", f"block size {snap.block_size!r}")


def _live_ranks(workers: list[WireWorker], lookup: dict) -> frozenset[RankId]:
    """The live ranks a list of wire names names; the others are dropped."""
    return frozenset(rank for rank in map(lookup.get, map(_identity, workers)) if rank is not None)


def _adapters(names: list[str]) -> frozenset[str]:
    """A body's adapter names; VetError for a list our export never writes (module docstring)."""
    if len(names) > MAX_ADAPTER_NAMES:
        raise VetError(
            "too_many_adapters", f"{len(names)} adapter names, at most {MAX_ADAPTER_NAMES}"
        )
    for name in names:
        if not is_adapter_name(name):
            raise VetError("malformed_adapter", f"{name!r} is not an adapter name")
    return frozenset(names)


def _identity(worker: WireWorker) -> tuple[str, int]:
    url, dp_rank = getattr(worker, "url", None), getattr(worker, "dp_rank", None)
    if type(url) is not str or type(dp_rank) is not int:
        raise VetError("malformed_worker", f"{worker!r} is not (url, dp_rank)")
    return canonical_origin(url), dp_rank


def _live_lookup(live: Iterable[RankId]) -> dict[tuple[str, int], RankId]:
    """(url as the registry keys it, dp_rank) -> the live RankId. Should the live set hold two
    spellings of one worker, the registry's own wins."""
    lookup: dict[tuple[str, int], RankId] = {}
    for rank in live:
        url = canonical_origin(rank.worker_url)
        ident = (url, rank.dp_rank)
        if ident not in lookup or rank.worker_url == url:
            lookup[ident] = rank
    return lookup


def _unknown_workers(workers: list[WireWorker], lookup: dict) -> VetError:
    """The refusal of a worker table of which this replica knows no one: a few of the names
    on either side, and what to do, for the log line that is all an operator sees of it."""

    def some(names: list[str]) -> str:
        more = len(names) - _NAMES_SHOWN
        return ", ".join(names[:_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")

    theirs = sorted({f"{w.url}#dp{w.dp_rank}" for w in workers})
    ours = sorted({f"{url}#dp{dp_rank}" for url, dp_rank in lookup})
    return VetError(
        "unknown_workers",
        f"its export names {len(theirs)} worker rank(s), none known here: {some(theirs)} "
        f"(this replica's: {some(ours) or 'none'}); give every replica the same worker list "
        "(--worker, discovery) or finish the rollout: a replica of another version may spell "
        "its workers otherwise",
    )


def _recount(counts: list[int], keep: list[bool]) -> list[int]:
    """Carriers per node once the flat carrier column is filtered by `keep`."""
    kept_before = list(accumulate(keep, initial=0))  # [j]: kept among the first j carriers
    at_bounds = list(map(kept_before.__getitem__, accumulate(counts, initial=0)))
    return list(map(sub, islice(at_bounds, 1, None), at_bounds))


def _tier_column(bits: list) -> array | None:
    """Tier bits masked to the tiers we know, as a 'B' column; None if any is not a
    non-negative int. A zero in the result marks a carrier on no known tier."""
    try:
        low, high = min(bits), max(bits)
        if low < 0:
            return None
        if low > 0 and high <= ALL_TIERS:
            return array("B", bits)  # all known already; 'B' refuses a float
        return array("B", map(and_, bits, repeat(ALL_TIERS)))  # `&` refuses a float
    except TypeError:
        return None


def _check_distinct_workers(workers: Sequence[int], counts: Sequence[int], a: int) -> None:
    """Refuse a node that names one worker index twice (`workers` is the flat carrier
    column of the nodes `counts` describes).

    Two neighbouring carriers that name one worker are a repeat unless the second begins a
    node; that covers every two-carrier node (the common shared-prefix case) with byte
    strings of 0/1 combined as big integers, at C speed. Larger nodes also go through a set.
    """
    top = max(counts, default=0)
    if top < 2:
        return
    if top < 256 and isinstance(workers, array) and max(workers) < 256:
        # One byte per item (the low byte of each little-endian u32) does the comparing.
        low = workers.tobytes()[:: workers.itemsize]
        diff = int.from_bytes(low[:-1], "little") ^ int.from_bytes(low[1:], "little")
        same = diff.to_bytes(len(low) - 1, "little").translate(_IS_ZERO)
        sizes = array("I", counts).tobytes()[::4]
        begins = b"".join(map(_NODE_OPENING.__getitem__, sizes)) + b"\x01"
    else:
        same = bytes(map(eq, workers, islice(workers, 1, None)))
        begins = bytearray(len(workers) + 1)
        deque(map(begins.__setitem__, accumulate(counts, initial=0), repeat(1)), maxlen=0)
    # carrier j: it and j+1 name one worker, and j+1 does not begin a node
    inside = int.from_bytes(same, "little") & ~int.from_bytes(begins[1:], "little")
    repeat_at = ((inside & -inside).bit_length() - 1) // 8 if inside else None
    if repeat_at is None and top < 3:
        return
    starts = list(accumulate(counts, initial=0))  # [i]: node i's first carrier
    if top > 2:
        for i in compress(range(len(counts)), map(gt, counts, repeat(2))):
            if repeat_at is not None and starts[i] > repeat_at:
                break
            if len(set(workers[starts[i] : starts[i + 1]])) != counts[i]:
                raise VetError("duplicate_carrier", f"node {a + i} names one worker twice")
    if repeat_at is not None:
        node = bisect_right(starts, repeat_at) - 1
        raise VetError("duplicate_carrier", f"node {a + node} names one worker twice")


def _check_parents(parents: array, a: int) -> None:
    """Node a+k's parent must be -1 (a root) or an earlier node."""
    if parents and (min(parents) < -1 or not all(map(lt, parents, count(a)))):
        raise _bad_parent([None if p == -1 else p for p in parents], a)


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _first_bad(values: list, a: int, reason: str, what: str, ok) -> VetError:
    for k, value in enumerate(values):
        if not ok(value):
            return VetError(reason, f"node {a + k}: {what} {value!r}")
    return VetError(reason, f"a {what} in nodes {a}..")  # pragma: no cover - found above


def _bad_parent(raw_parents: list, a: int) -> VetError:
    for k, parent in enumerate(raw_parents):
        if parent is not None and not (type(parent) is int and 0 <= parent < a + k):
            return VetError("invalid_parent", f"node {a + k}: parent {parent!r} is not earlier")
    return VetError("invalid_parent", f"in nodes {a}..")  # pragma: no cover - found above


def _carriers_of(carrier_lists: list, a: int) -> Iterable[tuple[int, object]]:
    for k, carriers in enumerate(carrier_lists):
        for carrier in carriers:
            yield a + k, carrier


def _bad_carrier_shape(carrier_lists: list, a: int) -> VetError:
    for i, carriers in enumerate(carrier_lists, a):
        try:
            entries = list(carriers)
        except TypeError:
            return VetError("malformed_carrier", f"node {i}: carriers {carriers!r}")
        for carrier in entries:
            try:
                worker = carrier[0]
                carrier[1], carrier[2]
            except (TypeError, IndexError, KeyError):
                return VetError("malformed_carrier", f"node {i}: carrier {carrier!r}")
            if type(worker) is not int:
                return VetError("malformed_carrier", f"node {i}: worker index {worker!r}")
    return VetError("malformed_carrier", f"in nodes {a}..")  # pragma: no cover - found above


def _bad_tier_bits(carrier_lists: list, a: int) -> VetError:
    for i, carrier in _carriers_of(carrier_lists, a):
        bits = carrier[1]
        if not isinstance(bits, int) or bits < 0:
            return VetError("invalid_tier_bits", f"node {i}: tier bits {bits!r}")
    return VetError("invalid_tier_bits", f"in nodes {a}..")  # pragma: no cover - found above


def _bad_engine_hash(carrier_lists: list, a: int) -> VetError:
    for i, carrier in _carriers_of(carrier_lists, a):
        if not _is_u64(carrier[2]):
            return VetError("invalid_engine_hash", f"node {i}: engine hash {carrier[2]!r}")
    return VetError("invalid_engine_hash", f"in nodes {a}..")  # pragma: no cover - found above
