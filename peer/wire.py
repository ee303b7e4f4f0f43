"""The `/internal/kv_snapshot` body, format 1, and its codecs.

```
{"format": 1, "block_size": 16, "key_scheme": "xxh3-chain-1337", "producer_ready": true,
 "workers": [{"url": "http://10.0.0.1:8000", "dp_rank": 0}, ...],
 "cursors": [[0, 41], ...],                  # [worker index, last applied seq]
 "nodes": [[null, 16866869152428715656, [[0, 1, 1403909460543360175]]], ...],
                                             # [parent index or null, key, carriers]
                                             # carrier = [worker index, tier bits, engine hash]
 "empty_ranks": [{"url": ..., "dp_rank": ...}]}   # omitted when empty
```

Nodes are compact arrays rather than maps: a million-node body is mostly nodes, and field
names would double it. A node's `parent` is the index of an earlier node (strictly backward);
keys are our chained block keys (`cachetree.keys`), so a parent index is a compression and a
structural check, not a disambiguation. The engine hash per carrier is what lets a grafted
replica apply that rank's later `BlockRemoved` events.

JSON is the default encoding; msgpack is served to clients that send
`Accept: application/msgpack` (our own fetch client does). Nothing here validates meaning:
decoding checks only types and shapes; `peer.vet` decides what may touch the tree.
"""

from __future__ import annotations

from typing import Final

import msgspec

FORMAT: Final = 1
MSGPACK: Final = "application/msgpack"
JSON: Final = "application/json"


class WireWorker(msgspec.Struct, frozen=True):
    url: str
    dp_rank: int


class WireNode(msgspec.Struct, array_like=True, gc=False):
    parent: int | None
    key: int
    carriers: list[tuple[int, int, int]]


class PeerSnapshot(msgspec.Struct, omit_defaults=True):
    format: int
    block_size: int
    key_scheme: str
    producer_ready: bool
    workers: list[WireWorker]
    cursors: list[tuple[int, int]]
    nodes: list[WireNode]
    empty_ranks: list[WireWorker] = []


_json_decoder = msgspec.json.Decoder(PeerSnapshot)
_msgpack_decoder = msgspec.msgpack.Decoder(PeerSnapshot)
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


class WireDecodeError(ValueError):
    pass


def encode(snapshot: PeerSnapshot, content_type: str = JSON) -> bytes:
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(snapshot)
    return _json_encoder.encode(snapshot)


def decode(body: bytes, content_type: str = JSON) -> PeerSnapshot:
    """Decode a body by its content type (JSON unless it says msgpack)."""
    try:
        if content_type.split(";")[0].strip().lower() == MSGPACK:
            return _msgpack_decoder.decode(body)
        return _json_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireDecodeError(f"not a format-1 snapshot body: {exc}") from None
