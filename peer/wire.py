"""The `/internal/kv_snapshot` body, format 1, and its codecs.

```
{"format": 1, "block_size": 16, "key_scheme": "xxh3-chain-1337", "producer_ready": true,
 "workers": [{"url": "http://10.0.0.1:8000", "dp_rank": 0}, ...],
 "cursors": [[0, 41], ...],                  # [worker index, last applied seq]
 "nodes": [[null, 16866869152428715656, [[0, 1, 1403909460543360175]]], ...],
                                             # [parent index or null, key, carriers]
                                             # carrier = [worker index, tier bits, engine hash]
 "empty_ranks": [{"url": ..., "dp_rank": ...}],  # omitted when empty
 "cold_ranks": [{"url": ..., "dp_rank": ...}],   # omitted when empty
 "adapters": ["sql-lora", ...]}                  # omitted when empty
```

`cold_ranks` is our addition to the reference's format 1, additive as `empty_ranks` is (the
format number is unchanged; an older peer ignores it, and a body without it says nothing, read
as "not cold"). It names the ranks of the body's worker table whose view the producer holds
as partial (`router.index`: joined mid-stream, lost batches, cleared at the cap): the blocks
are true, but some the engine holds are missing. A joining sibling prefers a body that is not
cold for its ranks and takes a cold one only when no other comes (`peer.sweep`).

`adapters` is another such addition: the LoRA adapter names the producer learned from its
engines (`router.index`, at most `cachetree.keys.MAX_ADAPTER_NAMES`). The nodes hold chained
keys only, an adapter's namespace hashed into its chains' first key, so without the names a
joining sibling would key a request naming an adapter as the base model's and miss the
adapter's grafted blocks until a live store named it. A body without it names none.

Nodes are compact arrays rather than maps: a million-node body is mostly nodes, and field
names would double it. A node's `parent` is the index of an earlier node (strictly backward);
keys are our chained block keys (`cachetree.keys`), so a parent index is a compression and a
structural check, not a disambiguation. The engine hash per carrier is what lets a grafted
replica apply that rank's later `BlockRemoved` events.

JSON is the default encoding; msgpack is served to clients that send
`Accept: application/msgpack`. Nothing here validates meaning: decoding checks only types and
shapes; `peer.vet` decides what may touch the tree.

The columnar encoding (`application/vnd.kvrouter.columns`)
----------------------------------------------------------
An extra encoding of the same format-1 snapshot, for siblings that ask for it first (our own
fetch client does; a sibling that only speaks JSON and msgpack answers with one of those).
Every field of format 1 is there; the nodes are sent as the six columns `cachetree.snapshot`
keeps them in, raw little-endian arrays, so encoding is a join of buffers and decoding a copy
(at a million nodes, ~0.05 s against ~1.5 s to encode and ~1-2 s to decode node by node):

```
offset 0       b"KVRCOLS1"                      8 bytes, magic and layout version
offset 8       header length H                  u32
offset 12      header (msgpack map, H bytes)    format, block_size, key_scheme,
                                                producer_ready, workers, cursors,
                                                empty_ranks, cold_ranks, adapters,
                                                nodes (N), carriers (C)
then, back to back, no padding:
               parents          N x i64         earlier node index, -1 for a chain root
               keys             N x u64
               carrier_counts   N x u32         carriers of each node, in node order
               carrier_workers  C x u32         worker index       } carrier j belongs to
               carrier_tiers    C x u8          tier bits          } the node whose counts
               carrier_hashes   C x u64         engine hash        } reach past j
```

The body's length must equal 12 + H + 20 N + 13 C exactly, and the counts must add up to C;
both are checked before a column is copied, so a lying header allocates nothing. Node i is
format 1's `[parents[i] or null, keys[i], carriers]` with its `carrier_counts[i]` carriers
taken in order from the carrier columns; `nodes_of` gives that view back.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Generator
from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Annotated, Any, Final

import msgspec

from cachetree.tree import run_through

FORMAT: Final = 1
MSGPACK: Final = "application/msgpack"
JSON: Final = "application/json"
COLUMNS: Final = "application/vnd.kvrouter.columns"
COLUMNS_MAGIC: Final = b"KVRCOLS1"
_PREFIX = struct.Struct("<8sI")  # magic, header length
# (name, typecode, bytes per item, per node or per carrier), in body order. The typecodes are
# `cachetree.snapshot.Snapshot`'s; `cachetree.keys` refuses a host where they differ in size
# or byte order, so a column is its array's raw bytes.
_COLUMNS: Final = (
    ("parents", "q", 8, "nodes"),
    ("keys", "Q", 8, "nodes"),
    ("carrier_counts", "I", 4, "nodes"),
    ("carrier_workers", "I", 4, "carriers"),
    ("carrier_tiers", "B", 1, "carriers"),
    ("carrier_hashes", "Q", 8, "carriers"),
)


class WireWorker(msgspec.Struct, frozen=True):
    url: str
    dp_rank: int


class WireNode(msgspec.Struct, array_like=True, gc=False):
    parent: int | None
    key: int
    carriers: list[tuple[int, int, int]]


class Envelope(msgspec.Struct, omit_defaults=True):
    """Format 1's fields but `nodes`: what every encoding carries beside the nodes."""

    format: int
    block_size: int
    key_scheme: str
    producer_ready: bool
    workers: list[WireWorker]
    cursors: list[tuple[int, int]]
    empty_ranks: list[WireWorker] = []
    cold_ranks: list[WireWorker] = []
    adapters: list[str] = []


class PeerSnapshot(Envelope, kw_only=True):
    """A format-1 body, nodes and all."""

    nodes: list[WireNode]

    @property
    def node_count(self) -> int:
        return len(self.nodes)


class ColumnsHead(Envelope, kw_only=True):
    """The columnar body's header: the envelope and the column lengths."""

    nodes: Annotated[int, msgspec.Meta(ge=0)]
    carriers: Annotated[int, msgspec.Meta(ge=0)]


ENVELOPE_FIELDS: Final = msgspec.structs.fields(Envelope)


def envelope(body: object) -> dict[str, Any]:
    """The envelope's fields of any body, header or envelope, as keyword arguments."""
    return {f.name: getattr(body, f.name) for f in ENVELOPE_FIELDS}


@dataclass(slots=True)
class WireColumns:
    """The node columns of a columnar body (the layout of `cachetree.snapshot.Snapshot`)."""

    parents: array = field(default_factory=lambda: array("q"))
    keys: array = field(default_factory=lambda: array("Q"))
    carrier_counts: array = field(default_factory=lambda: array("I"))
    carrier_workers: array = field(default_factory=lambda: array("I"))
    carrier_tiers: array = field(default_factory=lambda: array("B"))
    carrier_hashes: array = field(default_factory=lambda: array("Q"))


def node_columns(source: object) -> WireColumns:
    """The node columns of anything that holds them by name (a `cachetree.snapshot.Snapshot`),
    not copied."""
    return WireColumns(*(getattr(source, f.name) for f in fields(WireColumns)))


class PeerColumns(Envelope, kw_only=True):
    """A decoded columnar body: the envelope, and the nodes as columns."""

    columns: WireColumns

    @property
    def node_count(self) -> int:
        return len(self.columns.keys)


PeerBody = PeerSnapshot | PeerColumns  # what a sibling may answer, decoded

_json_decoder = msgspec.json.Decoder(PeerSnapshot)
_msgpack_decoder = msgspec.msgpack.Decoder(PeerSnapshot)
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


_head_decoder = msgspec.msgpack.Decoder(ColumnsHead)


class WireDecodeError(ValueError):
    pass


def media_type(content_type: str) -> str:
    """`application/msgpack; charset=x` -> `application/msgpack`."""
    return content_type.split(";")[0].strip().lower()


def encode(snapshot: PeerSnapshot, content_type: str = JSON) -> bytes:
    """A format-1 body in any encoding (COLUMNS included, for tests and tools)."""
    if content_type == COLUMNS:
        return b"".join(encode_columns(head_of(snapshot), columns_of(snapshot.nodes)))
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(snapshot)
    return _json_encoder.encode(snapshot)


def decode(body: bytes | bytearray, content_type: str = JSON) -> PeerBody:
    """Decode a body by its content type (JSON unless it says msgpack or columns)."""
    kind = media_type(content_type)
    if kind == COLUMNS:
        return decode_columns(body)
    try:
        if kind == MSGPACK:
            return _msgpack_decoder.decode(body)
        return _json_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"not a format-1 snapshot body: {exc}") from None


# -- the columnar encoding ------------------------------------------------------------------


def encode_columns(head: ColumnsHead, columns: WireColumns) -> list[bytes | memoryview]:
    """The columnar body as parts to join (the columns are not copied here)."""
    counts = (head.nodes, head.carriers)
    for name, _, _, per in _COLUMNS:
        column = getattr(columns, name)
        if len(column) != counts[per == "carriers"]:
            raise ValueError(f"column {name} has {len(column)} items, the header says otherwise")
    header = _msgpack_encoder.encode(head)
    parts: list[bytes | memoryview] = [_PREFIX.pack(COLUMNS_MAGIC, len(header)), header]
    parts += [memoryview(getattr(columns, name)).cast("B") for name, *_ in _COLUMNS]
    return parts


def decode_columns(body: bytes | bytearray) -> PeerColumns:
    """Decode a columnar body; every length is checked against the body before a copy."""
    return run_through(decode_columns_steps(body))


COPY_PIECE: Final = 4 << 20  # bytes copied per step of `decode_columns_steps` (~1 ms)


def decode_columns_steps(
    body: bytes | bytearray, piece: int = COPY_PIECE
) -> Generator[None, None, PeerColumns]:
    """`decode_columns`, yielding after every `piece` bytes copied or summed, so a caller on
    an event loop can let it run between them (a 6M-node body is ~200 MB: ~0.2 s of copies)."""
    view = memoryview(body)
    if len(view) < _PREFIX.size:
        raise WireDecodeError(f"columnar body of {len(view)} bytes: shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != COLUMNS_MAGIC:
        raise WireDecodeError(f"columnar body: magic {bytes(magic)!r}, expected {COLUMNS_MAGIC!r}")
    offset = _PREFIX.size + header_len
    if offset > len(view):
        raise WireDecodeError(f"columnar body: a {header_len}-byte header in {len(view)} bytes")
    try:
        head = _head_decoder.decode(view[_PREFIX.size : offset])
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"columnar body: bad header: {exc}") from None
    counts = {"nodes": head.nodes, "carriers": head.carriers}
    expected = offset + sum(size * counts[per] for _, _, size, per in _COLUMNS)
    if expected != len(view):
        raise WireDecodeError(
            f"columnar body: {head.nodes} nodes and {head.carriers} carriers need "
            f"{expected} bytes, the body has {len(view)}"
        )
    columns = WireColumns()
    piece = max(8, piece - piece % 8)  # whole items of every column
    for name, _, size, per in _COLUMNS:
        end = offset + size * counts[per]
        column = getattr(columns, name)
        for start in range(offset, end, piece):
            column.frombytes(view[start : min(start + piece, end)])
            yield
        offset = end
    carriers = 0
    counts_column = columns.carrier_counts
    step = piece // counts_column.itemsize
    for start in range(0, len(counts_column), step):
        carriers += sum(counts_column[start : start + step])
        yield
    if carriers != head.carriers:
        raise WireDecodeError(
            f"columnar body: carrier counts add up to {carriers}, the header says {head.carriers}"
        )
    return PeerColumns(**envelope(head), columns=columns)


def head_of(body: PeerBody, carriers: int | None = None) -> ColumnsHead:
    """The columnar header for a body's fields (`carriers` when the nodes are not at hand)."""
    if isinstance(body, PeerColumns):
        n_nodes, n_carriers = len(body.columns.keys), len(body.columns.carrier_workers)
    else:
        n_nodes = len(body.nodes)
        n_carriers = sum(len(n.carriers) for n in body.nodes) if carriers is None else carriers
    return ColumnsHead(**envelope(body), nodes=n_nodes, carriers=n_carriers)


def columns_of(nodes: list[WireNode]) -> WireColumns:
    """Format-1 nodes as columns (a root's null parent becomes -1)."""
    cols = WireColumns()
    for node in nodes:
        cols.parents.append(-1 if node.parent is None else node.parent)
        cols.keys.append(node.key)
        cols.carrier_counts.append(len(node.carriers))
        for worker, bits, engine_hash in node.carriers:
            cols.carrier_workers.append(worker)
            cols.carrier_tiers.append(bits)
            cols.carrier_hashes.append(engine_hash)
    return cols


def nodes_of(columns: WireColumns) -> list[WireNode]:
    """The columns as format-1 nodes: the view both encodings must agree on."""
    carriers = list(
        zip(columns.carrier_workers, columns.carrier_tiers, columns.carrier_hashes, strict=True)
    )
    bounds = list(accumulate(columns.carrier_counts, initial=0))
    return [
        WireNode(None if parent < 0 else parent, key, carriers[start:end])
        for parent, key, start, end in zip(
            columns.parents, columns.keys, bounds[:-1], bounds[1:], strict=True
        )
    ]


def as_format1(body: PeerBody) -> PeerSnapshot:
    """Any decoded body as format 1's nodes-and-all view."""
    if isinstance(body, PeerSnapshot):
        return body
    return PeerSnapshot(**envelope(body), nodes=nodes_of(body.columns))
