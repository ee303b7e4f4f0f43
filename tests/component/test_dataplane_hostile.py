"""The data plane under hostile clients, over real sockets: what a request holds in memory is
bounded by `--max-request-bytes` however its body is chunked (and so are its chunks), and
freed when its connection closes (a connection to a worker too); no client without the token
is invited to upload to a guarded route; each listener's connection refusals are logged apart.

Memory is asserted as a structure, not as RSS (noisy): the growth `tracemalloc` traces while
the replica, in this process, reads a body, and whether a closed connection's protocol
object is freed by reference counting alone (cyclic collection off, as a replica runs it
nearly: `cli._tune_gc`).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import socket
import tracemalloc
import weakref
from collections.abc import Iterator
from typing import Final

import pytest

from router import auth, siblings
from router.dataplane import server
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.support.scripted_worker import RawClient, scripted_worker
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

TOKEN = "hostile-test-token-0123456789"


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def test_a_body_of_tiny_chunks_holds_about_its_size_not_an_object_per_chunk() -> None:
    """One bytes object and a list slot per chunk: 2-byte chunks held ~20 times their data
    (32 MiB of them took a replica from 52 to 947 MiB) before the body's end or its 413."""
    limit = 1_000_000
    chunks = b"2\r\nab\r\n" * 10_000  # 20 kB of data in 10,000 chunks
    async with router_in_process(max_request_bytes=limit) as rt:

        def send_past_the_limit() -> bytes:
            with socket.create_connection(address(rt.url), timeout=30) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for _ in range(limit // 20_000 + 1):
                    sock.sendall(chunks)
                return sock.recv(65536)

        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            answer = await asyncio.to_thread(send_past_the_limit)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert rt.plane.stats.closed["refused"] == 1
        # The body up to the limit, and a read buffer or two: not 500,000 objects.
        assert peak - before < 2 * limit, f"{peak - before} bytes for {limit} of body"


async def test_a_chunked_bodys_framing_counts_against_its_bound_so_tiny_chunks_are_few() -> None:
    """Each chunk is a parser callback, and the bound counted data alone: 32 MiB of 1-byte
    chunks were 32 Mi callbacks (seconds of the loop) for one request within the limit."""
    body = b'{"prompt": "%s", "max_tokens": 1}' % (b"a" * 49)  # 80 bytes
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_request_bytes=100) as rt,
    ):
        await eventually(lambda: rt.replica.workers.routable(), 10)
        for pieces in ((body[:40], body[40:]), [body[i : i + 2] for i in range(0, 80, 2)]):
            client = await RawClient.open(rt.url)
            client.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
                + b"0\r\n\r\n"
            )
            answer = await client.answer()
            assert answer is not None
            # 80 bytes and three chunks' framing (95) fit in 100; 41 chunks' (285) do not.
            assert answer.status == (200 if len(pieces) == 2 else 413), len(pieces)
            client.close()
        assert [p.body for p in w.posts()] == [body]


def test_a_read_of_tiny_chunks_lets_the_loop_turn_before_the_next_one() -> None:
    """uvloop (libuv) reads a ready socket up to 32 times a turn of the loop: 32 reads of tiny
    chunks were ~1 M parser callbacks, and every other connection (a probe too) waited ~1 s
    for them. Seen as the body read in each turn: at most about one read's worth."""
    uvloop = pytest.importorskip("uvloop", reason="the fast extra: pip install 'kvrouter[fast]'")
    sizes: list[int] = []  # the body read so far, at each turn of the loop
    sent = 1_000_000 * (2 + server.CHUNK_FRAMING)  # what it counts for against the bound

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        async with router_in_process(max_request_bytes=64 << 20) as rt:

            def turn() -> None:
                if rt.plane.connections:
                    sizes.append(held_body(rt))
                if not sizes or sizes[-1] < sent:
                    loop.call_soon(turn)

            with socket.create_connection(address(rt.url)) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                turn()
                await asyncio.to_thread(sock.sendall, b"2\r\nab\r\n" * 1_000_000)
                await eventually(lambda: sizes and sizes[-1] == sent, 30)

    uvloop.run(scenario())
    steps = [b - a for a, b in itertools.pairwise(sizes)]
    assert max(steps) <= 1 << 20, f"{max(steps)} bytes of body read in one turn"


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    """Only reference counting frees memory (a replica's cyclic passes are rare)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def held_body(rt: RouterHandle) -> int:
    """Bytes of body the replica's one client connection holds of the request being read."""
    (conn,) = rt.plane.connections
    incoming = conn._incoming
    return 0 if incoming is None else incoming.body_size


@pytest.mark.usefixtures("no_cyclic_collection")
async def test_an_upload_cut_short_is_freed_when_its_connection_closes() -> None:
    """The parser's callbacks and the deadline's held the connection, which held them: bodies
    of uploads cut short stayed until a cyclic pass (12 clients of 31 MiB each: 436 -> 820
    -> 1205 MiB, freed ~1,500 requests later)."""
    async with router_in_process() as rt:
        client = await RawClient.open(rt.url)
        client.send(
            b"POST /workers HTTP/1.1\r\nHost: t\r\nContent-Length: 2000000\r\n\r\n"
            + b"x" * 1_000_000
        )
        await eventually(lambda: rt.plane.connections and held_body(rt) == 1_000_000, 10)
        conn = weakref.ref(next(iter(rt.plane.connections)))
        client.close()
        await eventually(lambda: not rt.plane.connections)
        await eventually(lambda: conn() is None)  # freed with all it held, no collection
        assert rt.replica.workers.workers() == []  # the upload reached nothing


@pytest.mark.usefixtures("no_cyclic_collection")
async def test_an_upstream_connection_is_freed_when_its_worker_closes_it() -> None:
    """The same two holds on a connection to a worker (its parser's callbacks, its deadline's):
    one the worker closed waited for a cyclic pass, with its buffers."""
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await eventually(lambda: rt.replica.workers.routable(), 10)
        status, _, _ = await rt.post("/v1/completions", {"prompt": "x" * 64, "max_tokens": 1})
        assert status == 200
        (pool,) = rt.plane.pools.values()
        await eventually(lambda: len(pool.idle) == 1)  # kept alive for the next request
        conn = weakref.ref(pool.idle[0])
        for writer in w.writers:  # the worker closes it
            writer.transport.close()
        await eventually(lambda: not pool.idle)
        await eventually(lambda: conn() is None)  # freed with all it held, no collection


async def expect_100(url: str, path: bytes, *fields: bytes) -> RawClient:
    client = await RawClient.open(url)
    client.send(
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s"
        b"Expect: 100-continue\r\nContent-Length: 30000000\r\n\r\n"
        % (path, b"".join(f + b"\r\n" for f in fields))
    )
    return client


@pytest.mark.parametrize(
    ("path", "family"),
    [
        (b"/workers", "workers"),
        (siblings.PATH.encode(), "decisions"),
        (b"/%77orkers", "workers"),
    ],
)
async def test_an_upload_to_a_guarded_route_without_the_token_is_refused_not_invited(
    path: bytes, family: str
) -> None:
    """`Expect: 100-continue` was answered before the token was checked: a client without it
    was invited to upload 32 MiB before its 401 (a target with a fragment, which aiohttp cut
    before it routed, is a 400 now: `test_a_target_with_a_fragment_is_a_400_never_invited`)."""
    async with router_in_process(internal_token=TOKEN) as rt:
        for fields in ((), (b"Authorization: Bearer wrong",), (b"Authorization: Basic eDp5",)):
            client = await expect_100(rt.url, path, *fields)
            answer = await client.answer()
            assert answer is not None and answer.status == 401, fields
            assert answer.header(b"WWW-Authenticate") == auth.CHALLENGE.encode()
            assert b"100 Continue" not in client.raw
            assert await client.closed()  # the body is not read
        assert rt.plane.stats.closed["refused"] == 3
        refusals = rt.replica.metrics.auth_refusals.counts
        assert refusals[family] == 3  # counted
        # With the token it is invited (the data plane does not answer it: the control app does).
        client = await expect_100(rt.url, path, b"Authorization: Bearer " + TOKEN.encode())
        await eventually(lambda: b"\r\n\r\n" in client.raw or client._read(), 5)
        assert bytes(client.raw) == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.close()
        assert rt.replica.workers.workers() == []


@pytest.mark.parametrize(
    "path",
    [b"/workers#frag", b"/workers?#x", siblings.PATH.encode() + b"#x?y", b"/v1/completions#x"],
)
async def test_a_target_with_a_fragment_is_a_400_never_invited(path: bytes) -> None:
    """No form of a request target has a fragment (RFC 9112 3.2); the control app cut it and
    routed the rest: `/workers#frag` as `/workers`, `/v1/completions#x` to its 404 saying the
    router serves no POST /v1/completions."""
    async with router_in_process(internal_token=TOKEN) as rt:
        client = await expect_100(rt.url, path, b"Authorization: Bearer " + TOKEN.encode())
        answer = await client.answer()
        assert answer is not None and answer.status == 400
        assert b"fragment" in answer.body
        assert b"100 Continue" not in client.raw
        assert await client.closed()  # the body is not read
        assert rt.plane.stats.closed["malformed"] == 1
        assert not any(rt.replica.metrics.auth_refusals.counts.values())  # refused before


async def test_with_no_token_configured_an_upload_to_a_guarded_route_is_a_403_not_invited() -> None:
    port = free_tcp_port()
    async with router_in_process(internal_token=None, control_port=port) as rt:
        for url in (rt.url, f"http://127.0.0.1:{port}"):
            client = await expect_100(url, b"/workers", b"Authorization: Bearer x")
            answer = await client.answer()
            assert answer is not None and answer.status == 403
            assert auth.TOKEN_FLAG.encode() in answer.body
            assert b"100 Continue" not in client.raw
            assert await client.closed()
        # An open route is invited as before.
        client = await expect_100(rt.url, b"/v1/completions")
        await eventually(lambda: b"\r\n\r\n" in client.raw or client._read(), 5)
        assert bytes(client.raw) == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.close()


async def test_each_listeners_refusals_are_logged_apart_with_their_own_limit_and_count(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One tally for both listeners: 390 refusals of the client port were logged as the
    control port's, with its limit (`391 connection(s) refused: 256 open, the control port's
    fixed limit`), or the control port's first refusal not at all."""
    monkeypatch.setattr(server, "CONTROL_MAX_CONNECTIONS", 1)
    port = free_tcp_port()
    control = f"http://127.0.0.1:{port}"
    async with router_in_process(max_connections=2, control_port=port) as rt:
        held = [await RawClient.open(u) for u in (rt.url, rt.url, control)]
        await eventually(
            lambda: len(rt.plane.connections) == 2 and len(rt.plane.control_connections) == 1
        )
        with caplog.at_level(logging.WARNING, logger=server.__name__):
            for url, times in ((rt.url, 3), (control, 2)):
                for _ in range(times):
                    extra = await RawClient.open(url)
                    answer = await extra.answer()
                    assert answer is not None and answer.status == 503
                    assert await extra.closed()
        assert rt.plane.stats.connections_refused == 5
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert said == [
            "1 connection(s) refused: 2 open, the --max-connections limit; raise it (and the "
            "file limit) or add replicas",
            "1 connection(s) refused: 1 open, the control port's fixed limit (1); find what "
            "holds so many peer or admin connections open",
        ]
        for client in held:
            client.close()


async def test_the_metrics_are_scraped_at_the_connection_limit_and_nothing_else_gets_in() -> None:
    """At `--max-connections` the scrape of /metrics was refused with the rest (the probes
    were answered by the door): the refusals, which the critical `KvrouterConnectionsRefused`
    alert reads, could not be scraped while they happened."""
    async with router_in_process(max_connections=2) as rt:
        held = [await RawClient.open(rt.url) for _ in range(2)]
        await eventually(lambda: len(rt.plane.connections) == 2)
        refused = await RawClient.open(rt.url)
        refused.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = await refused.answer()
        assert answer is not None and answer.status == 503
        # A scrape gets its answer, then the close: what it sent behind it is never served.
        scrape = await RawClient.open(rt.url)
        scrape.send(
            b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{}"
        )
        answer = await scrape.answer()
        assert answer is not None and answer.status == 200
        assert answer.header(b"Connection") == b"close"
        assert b"kvrouter_client_connections_refused_total 1.0" in answer.body
        assert await scrape.closed()
        assert await scrape.answer() is None
        assert rt.plane.stats.connections_refused == 1
        assert not rt.plane.scrape_connections and len(rt.plane.connections) == 2
        # The reserve is for scrapes at once: as many as it holds, then refused.
        scrapes = [await RawClient.open(rt.url) for _ in range(server.SCRAPE_MAX_CONNECTIONS)]
        for client in scrapes:
            client.send(b"GET /metrics HTTP/1.1\r\nHo")  # its head not ended: it stays
        await eventually(lambda: len(rt.plane.scrape_connections) == server.SCRAPE_MAX_CONNECTIONS)
        extra = await RawClient.open(rt.url)
        extra.send(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = await extra.answer()
        assert answer is not None and answer.status == 503
        assert rt.plane.stats.connections_refused == 2
        for client in [*held, *scrapes]:
            client.close()


# One request each, the router answers itself: a 413, a 501 and a 400 that close, a 405 asked
# to close.
HTTP_LAYER_REFUSALS: Final = {
    b"413": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 99999999\r\n\r\n",
    b"501": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
    b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"400": b"GARBAGE / HTTP/1.1\r\nHost: t\r\n\r\n",
    b"405": b"GET /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
}


async def refused_at_the_http_layer(rt: RouterHandle) -> None:
    """Each of `HTTP_LAYER_REFUSALS` on a connection of its own, read to the router's close."""

    def answered(request: bytes) -> bytes:
        with socket.create_connection(address(rt.url), timeout=10) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):  # to its close: the close is counted first
                answer += chunk
            return answer

    for status, request in HTTP_LAYER_REFUSALS.items():
        answer = await asyncio.to_thread(answered, request)
        assert answer.startswith(b"HTTP/1.1 " + status), answer


async def test_a_connection_closed_after_a_refusal_is_counted_closed_once() -> None:
    """A 413, a 501 or a malformed head counted its connection twice in
    kvrouter_client_connections_closed_total: `refused` or `malformed`, then `answered` as the
    refusal's answer closed it."""
    async with router_in_process() as rt:
        await refused_at_the_http_layer(rt)
        assert dict(rt.plane.stats.closed) == {"refused": 2, "malformed": 1, "answered": 1}


async def test_a_request_refused_at_the_http_layer_counts_in_the_requests() -> None:
    """A 413, a 501, a malformed head's 400 and a 405 never reached kvrouter_requests_total,
    where a 400 for a body that is not JSON did: dashboards and alerts on non-2xx answers
    missed them."""
    async with router_in_process() as rt:
        await refused_at_the_http_layer(rt)
        assert {k: n for k, n in rt.replica.metrics.requests.items() if n} == {
            ("/v1/completions", "none", "413"): 1,
            ("/v1/completions", "none", "405"): 1,
            # A transfer coding not served: the head parsed, so its route (the alert on 5xx
            # answers leaves the router's own 501 out by its worker="none").
            ("/v1/completions", "none", "501"): 1,
            # A head that did not parse (garbage): no route.
            ("other", "none", "400"): 1,
        }
