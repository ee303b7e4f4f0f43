"""The fetch client's pure parts: URLs, bounded gunzip, decoding in slices."""

from __future__ import annotations

import gzip
import os
import zlib

import msgspec
import pytest

from peer.fetch import (
    BodyError,
    BoundedGunzip,
    _Envelope,
    body_bound,
    cursors_url,
    decode_sliced,
    snapshot_url,
)
from peer.wire import (
    COLUMNS,
    JSON,
    MSGPACK,
    PeerSnapshot,
    WireDecodeError,
    WireNode,
    WireWorker,
    decode,
    encode,
)


def test_snapshot_url_omits_the_parameter_when_any_age_will_do() -> None:
    assert snapshot_url("http://10.0.0.1:8080", None) == "http://10.0.0.1:8080/internal/kv_snapshot"


def test_snapshot_url_states_the_requirement_in_milliseconds_and_trims_the_slash() -> None:
    assert snapshot_url("http://p:1/", 0) == "http://p:1/internal/kv_snapshot?max_age_ms=0"
    assert snapshot_url("http://p:1//", 1500) == "http://p:1/internal/kv_snapshot?max_age_ms=1500"


def test_snapshot_url_saturates_an_absurd_age() -> None:
    assert snapshot_url("http://p", 10**30).endswith(f"?max_age_ms={2**64 - 1}")
    assert snapshot_url("http://p", -5).endswith("?max_age_ms=0")


def test_cursors_url_asks_for_the_cursor_table_alone() -> None:
    assert cursors_url("http://p:1/") == "http://p:1/internal/kv_snapshot?cursors_only=true"


def test_the_decode_envelope_mirrors_the_body_but_for_raw_nodes() -> None:
    env = [(f.name, f.default) for f in msgspec.structs.fields(_Envelope)]
    body = [(f.name, f.default) for f in msgspec.structs.fields(PeerSnapshot)]
    assert env == body
    types = {f.name: f.type for f in msgspec.structs.fields(_Envelope)}
    assert types == {f.name: f.type for f in msgspec.structs.fields(PeerSnapshot)} | {
        "nodes": list[msgspec.Raw]
    }


# -- gunzip with a bound -------------------------------------------------------------------


async def inflate(data: bytes, limit: int, piece: int = 4096) -> bytearray:
    out = bytearray()
    g = BoundedGunzip(limit)
    for i in range(0, len(data), piece):
        await g.feed(data[i : i + piece], out)
    g.finish()
    return out


async def test_gunzip_restores_the_body() -> None:
    plain = os.urandom(5000) + b"x" * 3_000_000
    assert await inflate(gzip.compress(plain), limit=len(plain)) == plain


async def test_gunzip_stops_one_step_past_the_bound() -> None:
    bomb = gzip.compress(bytes(64 << 20))  # 64 MiB of zeros in ~64 KiB
    out = bytearray()
    g = BoundedGunzip(1 << 20)
    with pytest.raises(BodyError, match="inflated body exceeds"):
        await g.feed(bomb, out)
    assert len(out) <= (1 << 20) + 1  # never more than the bound and a byte


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (gzip.compress(b"hello")[:-6], "truncated"),
        (gzip.compress(b"hello") + b"junk", "after the end"),
        (b"{not gzip at all}", "gzip body"),
        (zlib.compress(b"a zlib stream, not gzip"), "gzip body"),
    ],
)
async def test_gunzip_refuses_a_malformed_stream(data: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        await inflate(data, limit=1 << 20, piece=7)


# -- decoding in slices ------------------------------------------------------------------


def sample(n: int = 50) -> PeerSnapshot:
    nodes = [
        WireNode(None if i % 10 == 0 else i - 1, 2**64 - 1 - i, [(i % 2, 1, i), (2, 3, 2**63 + i)])
        for i in range(n)
    ]
    return PeerSnapshot(
        format=1,
        block_size=16,
        key_scheme="xxh3-chain-1337",
        producer_ready=True,
        workers=[WireWorker("http://a", 0), WireWorker("http://b", 1), WireWorker("http://c", 0)],
        cursors=[(0, 3), (1, 9)],
        nodes=nodes,
        empty_ranks=[WireWorker("http://d", 0)],
    )


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, "application/msgpack; charset=binary"])
@pytest.mark.parametrize("chunk", [1, 7, 4096])
async def test_sliced_decoding_equals_the_one_shot_decoder(content_type: str, chunk: int) -> None:
    snap = sample()
    body = encode(snap, content_type.split(";")[0])
    decoded = await decode_sliced(bytearray(body), content_type, chunk=chunk, slice_s=0)
    assert decoded == decode(body, content_type) == snap


async def test_an_empty_node_list_and_an_absent_empty_ranks_decode() -> None:
    snap = sample(0)
    snap.empty_ranks = []
    body = encode(snap, MSGPACK)
    assert await decode_sliced(body, MSGPACK) == snap


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (encode(sample(), MSGPACK), JSON),  # mislabelled
        (encode(sample(), JSON), MSGPACK),
        (b'{"format": 1}', JSON),
        (encode(sample(), JSON).replace(b'"key_scheme"', b'"kee_scheme"'), JSON),
        (encode(sample(), JSON).replace(b"[null,", b'["x",', 1), JSON),  # a bad node
    ],
)
async def test_a_body_that_is_not_format_1_fails_to_decode(body: bytes, content_type: str) -> None:
    with pytest.raises(WireDecodeError):
        await decode_sliced(body, content_type, chunk=3)


def test_a_format_1_body_gets_half_the_bound_of_a_columnar_one() -> None:
    """Decoded, format 1's nodes are Python objects: 9-18 times the body, against ~6."""
    mib = 1 << 20
    assert body_bound(mib, COLUMNS) == mib
    assert body_bound(mib, f"{COLUMNS}; charset=binary") == mib
    assert body_bound(mib, MSGPACK) == body_bound(mib, JSON) == body_bound(mib, "") == mib // 2
