"""The format-1 body: both encodings round trip, and decoding checks shapes, not meaning."""

import msgspec
import pytest

from peer import wire
from peer.wire import JSON, MSGPACK, PeerSnapshot, WireDecodeError, WireNode, WireWorker

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
)


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, "application/msgpack; charset=x"])
def test_a_body_round_trips_in_every_encoding(content_type: str) -> None:
    encoded = wire.encode(BODY, content_type.split(";")[0])
    assert wire.decode(encoded, content_type) == BODY


def test_nodes_are_compact_arrays_and_empty_ranks_is_omitted_when_empty() -> None:
    body = PeerSnapshot(1, 16, "xxh3-chain-1337", False, [], [], [WireNode(None, 1, [])])
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
