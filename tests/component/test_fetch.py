"""The fetch client over real HTTP: against a real replica, and against stub peers that
misbehave (oversized bodies, gzip bombs, redirects, silence)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from cachetree.ranks import RankId
from cachetree.snapshot import Snapshot, canonical_view, restore
from cachetree.tree import BlockTree
from peer.fetch import Fetched, Refused, SnapshotFetcher, Unreachable
from peer.wire import (
    COLUMNS,
    JSON,
    MSGPACK,
    PeerColumns,
    PeerSnapshot,
    WireNode,
    WireWorker,
    as_format1,
    encode,
)
from router.tokenize import BytesTokenizer
from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.router import TEST_TOKEN, router_in_process

TOK = BytesTokenizer()
MiB = 1 << 20


@dataclass
class Peer:
    """A stub sibling: what it was asked and how much of its answer it managed to send."""

    url: str = ""
    requests: list[web.Request] = field(default_factory=list)
    sent: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


Handler = Callable[[web.Request, Peer], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def stub_peer(handler: Handler) -> AsyncIterator[Peer]:
    peer = Peer()

    async def snapshot(request: web.Request) -> web.StreamResponse:
        peer.requests.append(request)
        peer.hits[request.path] = peer.hits.get(request.path, 0) + 1
        try:
            return await handler(request, peer)
        finally:
            peer.finished.set()

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        peer.hits[request.path] = peer.hits.get(request.path, 0) + 1
        return web.Response(body=encode(sample()), content_type=JSON)

    app = web.Application()
    app.router.add_get("/internal/kv_snapshot", snapshot)
    app.router.add_get("/elsewhere", elsewhere)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    peer.url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
    try:
        yield peer
    finally:
        await runner.cleanup()


def sample() -> PeerSnapshot:
    return PeerSnapshot(
        format=1,
        block_size=16,
        key_scheme="xxh3-chain-1337",
        producer_ready=True,
        workers=[WireWorker("http://w:1", 0)],
        cursors=[(0, 7)],
        nodes=[WireNode(None, 11, [(0, 1, 5)]), WireNode(0, 2**64 - 1, [(0, 3, 6)])],
    )


def serving(body: bytes, **headers: str) -> Handler:
    async def handler(request: web.Request, peer: Peer) -> web.StreamResponse:
        return web.Response(body=body, headers=headers)

    return handler


def streaming(piece: bytes, total: int, declare_length: bool, **headers: str) -> Handler:
    """Send `piece` over and over, `total` bytes in all, counting what got out."""

    async def handler(request: web.Request, peer: Peer) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        if declare_length:
            response.content_length = total
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            while peer.sent < total:
                await response.write(piece)
                peer.sent += len(piece)
        return response

    return handler


def gzip_bomb(blocks: int) -> tuple[bytes, bytes, int]:
    """A gzip stream of `blocks` MiB of zeros: (head, one repeatable block, inflated size).

    After a full flush the compressor forgets its history, so the same input compresses to
    the same bytes again: the stream is `head + block * (blocks - 1)` (its trailer never
    comes; the client must give up long before).
    """
    zeros = bytes(MiB)
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    head = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH)
    assert z.compress(zeros) + z.flush(zlib.Z_FULL_FLUSH) == block
    return head, block, blocks * MiB


# -- against a real replica ------------------------------------------------------------------


async def test_the_client_fetches_a_replicas_export_and_cursor_table() -> None:
    async with (
        fake_worker_in_process(dp_size=2) as fw,
        router_in_process(workers=[fw.url]) as rt,
        SnapshotFetcher(clock=lambda: 42.0, token=TEST_TOKEN) as fetcher,
    ):
        await rt.gate(fw, 0)
        await rt.gate(fw, 1)
        await fw.store([TOK.encode("a prompt worth caching, " * 8)] * 2)
        seq = await fw.store([TOK.encode("another rank, another prompt " * 4)], dp_rank=1)
        await rt.wait_cursor(fw.url, 0, (await fw.state(0))["last_seq"])
        await rt.wait_cursor(fw.url, 1, seq)
        result = await fetcher.fetch_snapshot(rt.url + "/", 0)
        assert isinstance(result, Fetched), result
        assert result.arrived_at == 42.0 and result.peer == rt.url + "/"
        assert isinstance(result.snapshot, PeerColumns)  # a sibling that has columns sends them
        snap = as_format1(result.snapshot)
        tree = BlockTree(snap.block_size)
        records = [(n.parent, n.key, tuple(n.carriers)) for n in snap.nodes]
        restore(tree, Snapshot.from_records([(w.url, w.dp_rank) for w in snap.workers], records))
        rules = rt.replica.pump.rules
        assert rules.tree is not None
        assert canonical_view(tree) == canonical_view(rules.tree)
        producer = rt.replica.producer
        assert producer is not None and producer.cached is not None
        assert set(producer.cached.bodies) == {COLUMNS}  # format 1 was never encoded
        assert not producer.cached.gzipped  # and nothing was compressed
        cursors = await fetcher.fetch_cursors(rt.url)
        assert isinstance(cursors, Fetched) and cursors.snapshot.node_count == 0
        table = cursors.snapshot
        assert {
            RankId(table.workers[i].url, table.workers[i].dp_rank): s for i, s in table.cursors
        } == rules.cursors


async def test_the_client_sends_its_token() -> None:
    async with router_in_process(internal_token="s3cret") as rt:
        async with SnapshotFetcher() as anonymous:
            refused = await anonymous.fetch_cursors(rt.url)
        assert isinstance(refused, Unreachable) and refused.status == 401
        async with SnapshotFetcher(token="s3cret") as fetcher:
            assert isinstance(await fetcher.fetch_snapshot(rt.url, None), Fetched)


# -- against stub peers ----------------------------------------------------------------------


async def test_the_client_decodes_every_encoding_a_peer_may_send() -> None:
    snap = sample()
    variants = [
        (JSON, None),
        (JSON, "gzip"),
        (MSGPACK, None),
        (MSGPACK, "GZip"),
        (f"{MSGPACK}; charset=binary", " gzip "),
        (COLUMNS, None),
        (COLUMNS, "gzip"),
    ]
    for content_type, coding in variants:
        body = encode(snap, content_type.split(";")[0])
        headers = {"Content-Type": content_type}
        if coding is not None:
            body = gzip.compress(body)
            headers["Content-Encoding"] = coding
        async with stub_peer(serving(body, **headers)) as peer, SnapshotFetcher() as fetcher:
            result = await fetcher.fetch_snapshot(peer.url, 250)
            assert isinstance(result, Fetched), (content_type, coding, result)
            assert as_format1(result.snapshot) == snap
            (request,) = peer.requests
            assert request.path_qs == "/internal/kv_snapshot?max_age_ms=250"
            assert request.headers["Accept"] == f"{COLUMNS}, {MSGPACK};q=0.5"
            assert "Accept-Encoding" not in request.headers  # no gzip unless asked for
            assert "Authorization" not in request.headers


async def test_a_client_that_asks_for_gzip_advertises_it() -> None:
    body = gzip.compress(encode(sample(), COLUMNS))
    handler = serving(body, **{"Content-Type": COLUMNS, "Content-Encoding": "gzip"})
    async with stub_peer(handler) as peer, SnapshotFetcher(gzip=True) as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Fetched) and as_format1(result.snapshot) == sample()
        assert peer.requests[0].headers["Accept-Encoding"] == "gzip"


@pytest.mark.parametrize(
    "body",
    [
        b"KVRCOLS1",  # shorter than its prefix
        encode(sample(), COLUMNS)[:-1],  # truncated
        encode(sample(), COLUMNS) + b"\0",  # trailing bytes
        b"KVRCOLS2" + encode(sample(), COLUMNS)[8:],  # another layout
    ],
)
async def test_a_malformed_columnar_body_is_no_body(body: bytes) -> None:
    handler = serving(body, **{"Content-Type": COLUMNS})
    async with stub_peer(handler) as peer, SnapshotFetcher() as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Refused) and "columnar body" in result.reason


async def test_a_body_under_another_coding_is_not_guessed_at() -> None:
    body = gzip.compress(encode(sample(), MSGPACK))
    handler = serving(body, **{"Content-Type": MSGPACK, "Content-Encoding": "x-gzip"})
    async with stub_peer(handler) as peer, SnapshotFetcher() as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Refused) and "not a format-1" in result.reason


async def test_a_declared_oversized_body_is_refused_before_it_is_read() -> None:
    handler = streaming(b"x" * MiB, 256 * MiB, declare_length=True)
    async with stub_peer(handler) as peer, SnapshotFetcher(max_body_bytes=MiB) as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Refused) and "exceeds" in result.reason
        await peer.finished.wait()
        assert peer.sent < 64 * MiB


async def test_an_oversized_streamed_body_is_cut_off() -> None:
    handler = streaming(b"x" * MiB, 256 * MiB, declare_length=False)
    async with stub_peer(handler) as peer, SnapshotFetcher(max_body_bytes=MiB) as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        # a JSON body (no Content-Type) gets half the bound
        assert isinstance(result, Refused) and "exceeds the 524288-byte bound" in result.reason
        await peer.finished.wait()
        assert peer.sent < 64 * MiB


async def test_a_gzip_bomb_is_refused_without_inflating_it() -> None:
    head, block, inflated = gzip_bomb(blocks=100_000)  # 100 GiB inflated, ~100 MB sent
    bound = 4 * MiB
    compressed = len(head) + len(block) * 99_999
    assert compressed < bound * 100  # far below the bound as received...

    async def handler(request: web.Request, peer: Peer) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Encoding": "gzip"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            await response.write(head)
            peer.sent = len(head)
            piece = block * 1000
            while peer.sent < compressed:
                await response.write(piece)
                peer.sent += len(piece)
        return response

    async with stub_peer(handler) as peer, SnapshotFetcher(max_body_bytes=bound) as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Refused), result
        assert "inflated body exceeds" in result.reason  # ...but far above it inflated
        await peer.finished.wait()
        assert peer.sent < compressed // 4 and inflated > 1000 * bound


async def test_a_redirect_is_not_followed() -> None:
    async def handler(request: web.Request, peer: Peer) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere")

    async with stub_peer(handler) as peer, SnapshotFetcher() as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Unreachable) and result.status == 302
        assert "/elsewhere" not in peer.hits


async def test_a_non_2xx_answer_is_no_body() -> None:
    async def handler(request: web.Request, peer: Peer) -> web.StreamResponse:
        return web.json_response({"error": "not here"}, status=404)

    async with stub_peer(handler) as peer, SnapshotFetcher() as fetcher:
        result = await fetcher.fetch_cursors(peer.url)
        assert isinstance(result, Unreachable) and result.status == 404
        assert peer.requests[0].path_qs == "/internal/kv_snapshot?cursors_only=true"


async def test_a_silent_peer_costs_no_more_than_the_budget() -> None:
    async def silent(request: web.Request, peer: Peer) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with stub_peer(silent) as peer, SnapshotFetcher(per_fetch_s=0.2) as fetcher:
        # The bound is the test's guard, far above the budget: the fetch must end on its own.
        async with asyncio.timeout(20):
            result = await fetcher.fetch_snapshot(peer.url, 0)
        assert isinstance(result, Unreachable) and result.status is None
        assert result.reason == "no answer within the 0.2 s budget"


async def test_a_body_that_stalls_is_abandoned_after_the_stall_timeout() -> None:
    async def stalling(request: web.Request, peer: Peer) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": JSON})
        await response.prepare(request)
        await response.write(encode(sample())[:10])
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    fetcher = SnapshotFetcher(per_fetch_s=30, stall_timeout_s=0.2)
    async with stub_peer(stalling) as peer, fetcher:
        # Ending before this guard means the stall timeout fired, not the 30 s fetch budget.
        async with asyncio.timeout(20):
            result = await fetcher.fetch_snapshot(peer.url, None)
        assert isinstance(result, Unreachable) and "timed out" in result.reason


async def test_a_peer_that_is_not_listening_is_unreachable_with_the_connection_refused() -> None:
    async with SnapshotFetcher() as fetcher:
        result = await fetcher.fetch_snapshot(f"http://127.0.0.1:{free_tcp_port()}", None)
        assert isinstance(result, Unreachable) and result.status is None
        assert result.reason.startswith("transport") and result.connection_refused


async def test_a_silent_peer_is_unreachable_but_not_refused() -> None:
    async def silent(request: web.Request, peer: Peer) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with stub_peer(silent) as peer, SnapshotFetcher(per_fetch_s=0.2) as fetcher:
        result = await fetcher.fetch_snapshot(peer.url, 0)
        assert isinstance(result, Unreachable) and not result.connection_refused
