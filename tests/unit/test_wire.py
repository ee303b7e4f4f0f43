"""The format-1 body: every encoding round trips, and decoding checks shapes, not meaning."""

import struct
from array import array

import msgspec
import pytest

from peer import wire
from peer.wire import (
    COLUMNS,
    JSON,
    MSGPACK,
    PeerColumns,
    PeerSnapshot,
    WireDecodeError,
    WireNode,
    WireWorker,
    as_format1,
)
from tests.support.steps import counted_steps

BODY = PeerSnapshot(
    format=1,
    block_size=16,
    key_scheme="xxh3-chain-1337",
    producer_ready=True,
    workers=[WireWorker("http://10.0.0.1:8000", 0), WireWorker("http://10.0.0.2:8000", 1)],
    cursors=[(0, 41), (1, 7)],
    nodes=[
        WireNode(None, 2**64 - 1, [(0, 1, 2**63)]),
        WireNode(0, 5, [(0, 3, 9), (1, 1, 10)]),
    ],
    empty_ranks=[WireWorker("http://10.0.0.3:8000", 0)],
    cold_ranks=[WireWorker("http://10.0.0.2:8000", 1)],
    adapters=["sql-lora"],
)


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, "application/msgpack; charset=x"])
def test_a_body_round_trips_in_every_encoding(content_type: str) -> None:
    encoded = wire.encode(BODY, content_type.split(";")[0])
    assert wire.decode(encoded, content_type) == BODY


def test_nodes_are_compact_arrays_and_empty_ranks_is_omitted_when_empty() -> None:
    body = PeerSnapshot(1, 16, "xxh3-chain-1337", False, [], [], nodes=[WireNode(None, 1, [])])
    raw = msgspec.json.decode(wire.encode(body))
    assert raw["nodes"] == [[None, 1, []]]
    assert "empty_ranks" not in raw


def test_u64_keys_survive_json_without_losing_precision() -> None:
    decoded = wire.decode(wire.encode(BODY))
    assert decoded.nodes[0].key == 2**64 - 1


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"format": 1}',
        b'{"format": "1", "block_size": 16, "key_scheme": "k", "producer_ready": true,'
        b' "workers": [], "cursors": [], "nodes": []}',
        b'{"format": 1, "block_size": 16, "key_scheme": "k", "producer_ready": true,'
        b' "workers": [], "cursors": [], "nodes": [[null, 1]]}',
    ],
)
def test_a_malformed_body_is_a_typed_error(raw: bytes) -> None:
    with pytest.raises(WireDecodeError):
        wire.decode(raw)


# -- the columnar encoding -----------------------------------------------------------------


def columnar(head: dict | None = None, tail: bytes | None = None, **columns: array) -> bytes:
    """BODY as a columnar body, with header fields or columns replaced."""
    fields = msgspec.structs.asdict(wire.head_of(BODY)) | (head or {})
    cols = wire.columns_of(BODY.nodes)
    for name, column in columns.items():
        setattr(cols, name, column)
    header = msgspec.msgpack.encode(fields)
    body = [struct.pack("<8sI", wire.COLUMNS_MAGIC, len(header)), header]
    body += [memoryview(getattr(cols, name)).cast("B") for name in COLUMN_NAMES]
    return b"".join(body) + (tail or b"")


COLUMN_NAMES = (
    "parents",
    "keys",
    "carrier_counts",
    "carrier_workers",
    "carrier_tiers",
    "carrier_hashes",
)


def test_a_columnar_body_round_trips_to_the_same_format_1_body() -> None:
    encoded = wire.encode(BODY, COLUMNS)
    decoded = wire.decode(encoded, f"{COLUMNS}; v=1")
    assert isinstance(decoded, PeerColumns) and decoded.node_count == 2
    assert as_format1(decoded) == BODY
    assert wire.encode(as_format1(decoded), COLUMNS) == encoded == columnar()


def test_columns_are_little_endian_arrays_after_the_header() -> None:
    encoded = wire.encode(BODY, COLUMNS)
    magic, header_len = struct.unpack_from("<8sI", encoded)
    assert magic == b"KVRCOLS1"
    head = msgspec.msgpack.decode(encoded[12 : 12 + header_len])
    assert (head["nodes"], head["carriers"], head["key_scheme"]) == (2, 3, "xxh3-chain-1337")
    parents = struct.unpack_from("<2q", encoded, 12 + header_len)
    keys = struct.unpack_from("<2Q", encoded, 12 + header_len + 16)
    assert parents == (-1, 0) and keys == (2**64 - 1, 5)
    assert len(encoded) == 12 + header_len + 20 * 2 + 13 * 3


def test_an_empty_columnar_body_decodes() -> None:
    empty = PeerSnapshot(1, 0, "xxh3-chain-1337", False, [], [], nodes=[])
    decoded = wire.decode(wire.encode(empty, COLUMNS), COLUMNS)
    assert decoded.node_count == 0 and as_format1(decoded) == empty


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "shorter than its prefix"),
        (b"KVRCOLS1\x05", "shorter than its prefix"),
        (b"KVRCOLS9" + columnar()[8:], "magic"),
        (struct.pack("<8sI", b"KVRCOLS1", 1 << 31) + b"\x80", "header in"),
        (struct.pack("<8sI", b"KVRCOLS1", 3) + b"abc", "bad header"),
        (columnar(head={"nodes": -1}), "bad header"),
        (columnar(head={"nodes": "2"}), "bad header"),
        (columnar(head={"format": None}), "bad header"),
        (columnar()[:-1], "need"),  # truncated
        (columnar(tail=b"\0"), "need"),  # trailing bytes
        (columnar(head={"nodes": 3}), "need"),  # lengths that disagree with the header
        (columnar(head={"carriers": 2}), "need"),
        (columnar(head={"nodes": 2**61, "carriers": 2**62}), "need"),  # absurd counts
        (columnar(carrier_counts=array("I", [1, 1])), "add up"),  # counts that lie
    ],
)
def test_a_malformed_columnar_body_is_a_typed_error(body: bytes, message: str) -> None:
    with pytest.raises(WireDecodeError, match=message):
        wire.decode(body, COLUMNS)


def test_a_columnar_body_is_not_encoded_from_columns_that_disagree_with_the_header() -> None:
    head = wire.head_of(BODY)
    cols = wire.columns_of(BODY.nodes)
    cols.carrier_tiers.pop()
    with pytest.raises(ValueError, match="carrier_tiers"):
        wire.encode_columns(head, cols)


def test_a_columnar_body_decodes_in_steps_of_a_few_bytes_each() -> None:
    body = wire.encode(BODY, COLUMNS)
    yields, decoded = counted_steps(wire.decode_columns_steps(body, piece=8))
    assert yields >= 6  # at least one step per column
    assert as_format1(decoded) == BODY
    bad_counts = columnar(carrier_counts=array("I", [2, 2]))  # 4 carriers, the header says 3
    with pytest.raises(WireDecodeError):
        wire.decode_columns(bad_counts)
