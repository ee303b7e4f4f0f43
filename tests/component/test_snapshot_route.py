"""GET /internal/kv_snapshot on a real replica fed by real fake workers, over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest

from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, canonical_view, restore
from cachetree.tree import BlockTree
from peer.producer import SnapshotProducer
from peer.wire import COLUMNS, JSON, MSGPACK, PeerColumns, PeerSnapshot, as_format1, decode
from router.tokenize import BytesTokenizer
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

TOK = BytesTokenizer()
PATH = "/internal/kv_snapshot"
SYSTEM = "You are a careful assistant. " * 4  # 116 bytes: 7 blocks of 16


class Gate:
    """A yield point that parks the build at its first yield until `release()`."""

    def __init__(self) -> None:
        self.parked = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self) -> None:
        self.parked.set()
        await self._open.wait()

    def release(self) -> None:
        self._open.set()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def warm_replica(
    **router_kw: Any,
) -> AsyncIterator[tuple[RouterHandle, list[FakeWorkerHandle]]]:
    """Two workers (the second with two ranks) whose blocks the replica has applied.

    Both workers hold the same system prompt (nodes with two carriers), one stores on the
    host tier, and rank 1 of the second worker stored and then cleared everything: it has a
    cursor but no blocks.
    """
    async with (
        fake_worker_in_process() as w0,
        fake_worker_in_process(dp_size=2) as w1,
        router_in_process(workers=[w0.url, w1.url], **router_kw) as rt,
    ):
        await rt.gate(w0)
        await rt.gate(w1, 0)
        await rt.gate(w1, 1)
        await w0.store([TOK.encode(SYSTEM + "first question"), TOK.encode("another topic " * 5)])
        await w1.store([TOK.encode(SYSTEM + "second question")])
        await w1.store([TOK.encode("kept on the host tier " * 3)], medium="CPU")
        await w1.store([TOK.encode("soon gone " * 4)], dp_rank=1)
        await w1.post("/control/clear", {"dp_rank": 1})
        for fw, rank in ((w0, 0), (w1, 0), (w1, 1)):
            await rt.wait_cursor(fw.url, rank, (await fw.state(rank))["last_seq"])
        yield rt, [w0, w1]


@contextlib.asynccontextmanager
async def plain_client() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that neither advertises nor undoes gzip unless a test asks."""
    async with aiohttp.ClientSession(
        auto_decompress=False, skip_auto_headers=("Accept-Encoding",)
    ) as session:
        yield session


async def get(
    session: aiohttp.ClientSession, rt: RouterHandle, query: str = "", **headers: str
) -> tuple[int, bytes, Mapping[str, str]]:
    async with session.get(rt.url + PATH + query, headers={**rt.headers(PATH), **headers}) as resp:
        return resp.status, await resp.read(), resp.headers


def producer_of(rt: RouterHandle) -> SnapshotProducer:
    producer = rt.replica.producer
    assert producer is not None
    return producer


def parked(rt: RouterHandle) -> Gate:
    """Make the replica's next build yield after every step and park at its first yield."""
    producer = producer_of(rt)
    producer.slice_s = 0.0
    producer.walk_step = 1
    gate = Gate()
    producer.yield_point = gate
    return gate


def restored(snap: PeerSnapshot, block_size: int) -> BlockTree:
    tree = BlockTree(block_size)
    records = [(n.parent, n.key, tuple(n.carriers)) for n in snap.nodes]
    restore(tree, Snapshot.from_records([(w.url, w.dp_rank) for w in snap.workers], records))
    return tree


def cursors_of(snap: PeerSnapshot) -> dict[RankId, int]:
    return {RankId(snap.workers[i].url, snap.workers[i].dp_rank): seq for i, seq in snap.cursors}


async def test_the_body_restores_to_the_replicas_tree_with_its_cursors() -> None:
    async with warm_replica() as (rt, (_w0, w1)), plain_client() as client:
        status, body, headers = await get(client, rt)
        assert status == 200, body
        assert headers["Content-Type"] == JSON and "Content-Encoding" not in headers
        assert headers["Vary"] == "Accept-Encoding, Accept"
        snap = decode(body)
        rules = rt.replica.pump.rules
        assert rules.tree is not None
        assert snap.producer_ready and snap.block_size == rules.tree.block_size == 16
        assert any(len(n.carriers) == 2 for n in snap.nodes)  # the shared system prompt
        assert canonical_view(restored(snap, 16)) == canonical_view(rules.tree)
        cleared = RankId(w1.url, 1)
        carriers = {r: seq for r, seq in rules.cursors.items() if r != cleared}
        assert cursors_of(snap) == carriers and len(carriers) == 2
        assert [(w.url, w.dp_rank) for w in snap.empty_ranks] == [cleared]


async def test_msgpack_and_gzip_serve_the_same_export() -> None:
    async with warm_replica() as (rt, _), plain_client() as client:
        _, identity, _ = await get(client, rt)
        status, packed, headers = await get(client, rt, Accept=MSGPACK)
        assert status == 200 and headers["Content-Type"] == MSGPACK
        assert decode(packed, MSGPACK) == decode(identity)
        for accept, plain in ((JSON, identity), (MSGPACK, packed)):
            status, zipped, headers = await get(
                client, rt, Accept=accept, **{"Accept-Encoding": "deflate, GZIP"}
            )
            assert status == 200 and headers["Content-Encoding"] == "gzip"
            assert headers["Content-Type"] == accept
            assert headers["Vary"] == "Accept-Encoding, Accept"
            assert gzip.decompress(zipped) == plain  # byte for byte
            assert int(headers["Content-Length"]) == len(zipped) < len(plain)
        status, body, headers = await get(client, rt, **{"Accept-Encoding": "gzip;q=0, x-gzip"})
        assert "Content-Encoding" not in headers and body == identity
        assert producer_of(rt).stats.builds == 1  # every variant came from one export


@pytest.mark.parametrize(
    "query",
    [
        "?cursors_only",
        "?cursors_only=",
        "?cursors_only=yes",
        "?max_age_ms=-1",
        "?max_age_ms=soon",
        "?max_age_ms=18446744073709551616",
    ],
)
async def test_a_malformed_query_is_a_400(query: str) -> None:
    async with router_in_process() as rt, plain_client() as client:
        status, body, _headers = await get(client, rt, query)
        assert status == 400
        error = json.loads(body)["error"]  # the OpenAI shape, as the module docstring says
        assert error["type"] == "invalid_request_error" and error["message"], error
        assert producer_of(rt).stats.builds == 0


async def test_before_the_block_size_is_known_the_body_is_not_a_bootstrap_source() -> None:
    async with router_in_process(block_size=None) as rt, plain_client() as client:
        status, body, _ = await get(client, rt, "?max_age_ms=0")
        assert status == 200
        snap = decode(body)
        assert (snap.block_size, snap.producer_ready, snap.nodes) == (0, False, [])


async def test_concurrent_requests_share_one_build() -> None:
    # Each accepts an export up to a minute old: the five that arrive after the build stamped
    # its export join it (with max_age_ms=0 they would rightly ask for a fresher one).
    async with warm_replica() as (rt, _), plain_client() as client:
        producer = producer_of(rt)
        gate = parked(rt)
        requests = [asyncio.create_task(get(client, rt, "?max_age_ms=60000")) for _ in range(6)]
        await gate.parked.wait()
        await eventually(lambda: producer.waiting == 6)
        gate.release()
        answers = await asyncio.gather(*requests)
        assert {status for status, _, _ in answers} == {200}
        assert len({body for _, body, _ in answers}) == 1
        assert producer.stats.builds == 1


async def test_a_client_that_hangs_up_mid_build_still_fills_the_cache() -> None:
    async with warm_replica() as (rt, _), plain_client() as client:
        producer = producer_of(rt)
        gate = parked(rt)
        request = asyncio.create_task(get(client, rt))
        await gate.parked.wait()
        await eventually(lambda: producer.waiting == 1)
        request.cancel()  # the client hangs up while the export is being built
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await eventually(lambda: producer.waiting == 0)  # the server saw it go
        assert producer.building and producer.cached is None
        gate.release()
        await producer.wait_idle()
        assert producer.cached is not None
        status, body, _ = await get(client, rt)
        assert status == 200 and decode(body).nodes
        assert (producer.stats.builds, producer.stats.reused) == (1, 1)


async def test_max_age_decides_between_the_cached_export_and_a_new_one() -> None:
    async with warm_replica() as (rt, (w0, _)), plain_client() as client:
        producer = producer_of(rt)
        clock = Clock(1000.0)
        producer.clock = clock
        _, first, _ = await get(client, rt)
        seq = await w0.store([TOK.encode("a block stored after the first export " * 2)])
        await rt.wait_cursor(w0.url, 0, seq)
        clock.now = 1001.5
        _, again, _ = await get(client, rt)  # 1.5 s old: the default 2 s accepts it
        assert again == first and producer.stats.builds == 1
        _, same, _ = await get(client, rt, "?max_age_ms=1501")
        assert same == first and producer.stats.builds == 1
        _, fresh, _ = await get(client, rt, "?max_age_ms=1500")
        assert producer.stats.builds == 2
        assert cursors_of(decode(fresh))[RankId(w0.url, 0)] == seq
        assert cursors_of(decode(first))[RankId(w0.url, 0)] < seq
        clock.now = 1004.0
        await get(client, rt)  # 2.5 s old: too old even for the default
        assert producer.stats.builds == 3


async def test_cursors_only_is_read_live_and_never_builds() -> None:
    async with warm_replica() as (rt, (_, w1)), plain_client() as client:
        producer = producer_of(rt)
        status, body, headers = await get(client, rt, "?cursors_only=true&max_age_ms=0")
        assert status == 200 and headers["Content-Type"] == JSON
        assert "Content-Encoding" not in headers
        snap = decode(body)
        assert snap.nodes == [] and snap.producer_ready
        assert cursors_of(snap) == rt.replica.pump.rules.cursors
        assert RankId(w1.url, 1) in cursors_of(snap)  # a witness with no blocks
        status, body, headers = await get(client, rt, "?cursors_only=TRUE", Accept=MSGPACK)
        assert headers["Content-Type"] == MSGPACK and decode(body, MSGPACK) == snap
        assert producer.stats.builds == 0 and producer.cached is None


async def test_an_encoding_that_fails_is_a_503_and_is_made_again_on_the_next_request() -> None:
    async with warm_replica() as (rt, _), plain_client() as client:
        producer = producer_of(rt)
        encode = producer.encode

        def failing(value: object, content_type: str) -> bytes:
            if content_type == MSGPACK:
                raise ValueError("no msgpack today")
            return encode(value, content_type)

        producer.encode = failing
        status, body, _headers = await get(client, rt, Accept=MSGPACK)
        assert status == 503
        assert json.loads(body) == {
            "error": {"message": "snapshot could not be encoded", "type": "service_unavailable"}
        }
        entry = producer.cached
        assert entry is not None and MSGPACK not in entry.bodies
        status, body, _ = await get(client, rt)  # JSON still encodes
        assert status == 200 and decode(body).nodes
        producer.encode = encode
        status, body, _ = await get(client, rt, Accept=MSGPACK)
        assert status == 200 and decode(body, MSGPACK).nodes
        assert producer.stats.builds == 1 and producer.stats.failed == 1


async def test_columns_are_served_to_who_asks_first_and_agree_with_format_1() -> None:
    async with warm_replica() as (rt, _), plain_client() as client:
        _, identity, _ = await get(client, rt)
        accept = f"{MSGPACK};q=0.9, {COLUMNS};q=0.5"  # any positive q: columns win
        status, body, headers = await get(client, rt, Accept=accept)
        assert status == 200 and headers["Content-Type"] == COLUMNS
        assert "Content-Encoding" not in headers
        columns = decode(body, COLUMNS)
        assert isinstance(columns, PeerColumns)
        assert as_format1(columns) == decode(identity)
        status, zipped, headers = await get(
            client, rt, Accept=COLUMNS, **{"Accept-Encoding": "gzip"}
        )
        assert status == 200 and headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(zipped) == body
        status, table, headers = await get(client, rt, "?cursors_only=true", Accept=COLUMNS)
        assert headers["Content-Type"] == COLUMNS
        cursor_table = decode(table, COLUMNS)
        assert cursor_table.node_count == 0
        assert cursors_of(as_format1(cursor_table)) == rt.replica.pump.rules.cursors
        assert producer_of(rt).stats.builds == 1
