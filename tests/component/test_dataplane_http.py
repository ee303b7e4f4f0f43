"""HTTP conformance of the data plane over real sockets: one case per promise of issue 11.

Every case runs a replica in process (`router_in_process`) in front of fake workers or
scripted ones (`tests.support.scripted_worker`: exact bytes, misbehaviour included), and
talks to it with `RawClient` where the bytes on the wire are the point. Each asserts the cost
as well: which worker got how many requests, over how many connections, how many attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.dataplane import server
from router.dataplane.exchange import STALE_WINDOW_S
from router.dataplane.relay import WorkerRelay
from router.dataplane.upstream import MAX_ANSWER_HEAD_BYTES, UpstreamConnection, UpstreamPool
from router.serving import serve_until
from tests.support.fake_worker import fake_worker_in_process
from tests.support.model_dirs import build_fixture_model
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.support.scripted_worker import (
    RawClient,
    Request,
    Script,
    ScriptedWorker,
    answer_ok,
    post,
    respond,
    scripted_worker,
)
from tests.support.sse import sse_events
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(30)

COMPLETION = b'{"prompt": "tell me about caches", "max_tokens": 4}'
STREAM = b'{"prompt": "tell me about caches", "max_tokens": 4, "stream": true}'


async def routable(rt: RouterHandle, *urls: str) -> None:
    """Until the replica routes to every one of `urls`."""

    def ready() -> bool:
        return {w.url for w in rt.replica.workers.routable()} >= set(urls)

    await eventually(ready, 10)


def reading_held(rt: RouterHandle, url: str) -> bool:
    """Whether the replica stopped reading one of its busy connections to the worker `url`
    (its client's side is full)."""
    pool = rt.plane.pools.get(url)
    return pool is not None and any(
        c.transport is not None and not c.transport.is_reading() for c in pool.busy
    )


@contextlib.asynccontextmanager
async def one_worker_and_a_client(
    script: Script | None = None, **config: Any
) -> AsyncIterator[tuple[ScriptedWorker, RouterHandle, RawClient]]:
    """A scripted worker (`script`, else it answers 200), a replica routing to it (with
    `config`), and a raw connection to the replica."""
    async with (
        scripted_worker(*([script] if script else [])) as w,
        router_in_process(workers=[w.url], **config) as rt,
    ):
        await routable(rt, w.url)
        yield w, rt, await RawClient.open(rt.url)


async def queued_behind_one(
    w: ScriptedWorker, rt: RouterHandle, client: RawClient
) -> tuple[asyncio.Task[Any], UpstreamPool]:
    """A request holding the worker's one pooled connection (its task), and `client`'s
    request queued for that connection behind it (the pool it waits in)."""
    holder = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
    await eventually(lambda: len(w.posts()) == 1)
    client.send(post(b"/v1/completions", COMPLETION))
    pool = rt.plane.pools[w.url]
    await eventually(lambda: len(pool.waiting) == 1)
    return holder, pool


# -- section 1: the server side ------------------------------------------------------------


async def test_keep_alive_serves_many_requests_over_one_client_and_one_worker_connection() -> None:
    async with one_worker_and_a_client() as (w, rt, client):
        for _ in range(3):
            client.send(post(b"/v1/completions", COMPLETION))
            answer = await client.answer()
            assert answer is not None and answer.status == 200 and answer.complete
        assert len(rt.plane.connections) == 1
        posts = w.posts()
        assert len(posts) == 3
        assert {p.connection for p in posts} == {posts[0].connection}  # one upstream connection
        client.close()


async def test_pipelined_requests_are_answered_in_order_even_when_the_first_is_slowest() -> None:
    release = asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        n = json.loads(request.body)["max_tokens"]
        if n == 1:
            await release.wait()  # the first request's answer waits
        writer.write(respond(200, b'{"n": %d}' % n))

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        bodies = [b'{"prompt": "p", "max_tokens": %d}' % n for n in (1, 2, 3)]
        client.send(b"".join(post(b"/v1/completions", b) for b in bodies))
        await eventually(lambda: len(w.posts()) == 1)
        release.set()
        answers = [await client.answer() for _ in bodies]
        assert [json.loads(a.body)["n"] for a in answers if a] == [1, 2, 3]
        # One after the other: the worker never had two of them at once.
        assert len(w.posts()) == 3 and w.most_answering == 1
        client.close()


async def test_pipelined_requests_with_large_bodies_are_all_read_and_answered() -> None:
    """The reading of a connection pauses while a pipelined request waits its turn; when an
    answer ended with the next request's body still coming, nothing resumed it: three 100 kB
    POSTs sent at once got two answers, then a 408 at the body timeout."""
    body = b'{"prompt": "' + b"z" * 100_000 + b'", "max_tokens": 1}'
    async with one_worker_and_a_client(client_body_timeout_s=30) as (w, _, client):
        client.send(post(b"/v1/completions", body) * 3)
        answers = [await client.answer(within_s=10) for _ in range(3)]
        assert [a.status for a in answers if a is not None] == [200, 200, 200]
        assert [len(p.body) for p in w.posts()] == [len(body)] * 3
        client.close()


async def test_a_chunked_request_body_reaches_the_worker_whole_with_a_content_length() -> None:
    async with one_worker_and_a_client() as (w, _rt, client):
        body = COMPLETION
        pieces = [body[:5], body[5:6], body[6:20], body[20:]]
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for piece in pieces:
            client.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        client.send(b"0\r\n\r\n")
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        (got,) = w.posts()
        assert got.body == body
        assert got.header(b"Content-Length") == b"%d" % len(body)
        assert got.header(b"Transfer-Encoding") is None
        client.close()


async def test_a_request_body_in_a_transfer_coding_the_relay_cannot_decode_is_a_501() -> None:
    async with one_worker_and_a_client() as (w, rt, client):
        gzipped = gzip.compress(COMPLETION)
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(gzipped), gzipped)
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 501
        assert b"'gzip' is not supported" in answer.body
        await client.closed()
        assert w.posts() == []  # nothing reached a worker unlabelled
        # The client's doing on a head that parsed: under its route, as its 413 and 400 are
        # (it was `other`), so that the error alert can leave the router's own 501s out.
        counted = {k: n for k, n in rt.plane.metrics.requests.items() if n}
        assert counted == {("/v1/completions", "none", "501"): 1}, counted


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(COMPLETION)
        )
        await eventually(lambda: b"100 Continue" in client.raw or client._read(), 5)
        assert bytes(client.raw) == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.send(COMPLETION)
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert [p.header(b"Expect") for p in w.posts()] == [None]  # never sent upstream
        client.close()


async def test_expect_with_a_body_over_the_limit_is_a_413_and_no_100() -> None:
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_request_bytes=100) as rt,
    ):
        client = await RawClient.open(rt.url)
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            b"Content-Length: 101\r\n\r\n"
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 413
        assert b"100 Continue" not in client.raw
        assert await client.closed()
        assert w.posts() == []


async def test_an_http_1_0_client_gets_a_stream_de_chunked_and_the_connection_closed() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        await routable(rt, fw.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", STREAM, version=b"1.0"))
        await client.closed()
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert not answer.has(b"Transfer-Encoding") and not answer.has(b"Content-Length")
        assert answer.header(b"Connection") == b"close"
        assert answer.body.endswith(b"data: [DONE]\n\n")
        assert b"\r\n0\r\n" not in answer.body  # no chunk framing inside
        assert (await fw.state(0))["requests"] == 1


async def test_an_http_1_0_client_asking_for_keep_alive_keeps_its_connection() -> None:
    async with one_worker_and_a_client() as (w, _rt, client):
        for _ in range(2):
            client.send(
                post(b"/v1/completions", COMPLETION, b"Connection: keep-alive", version=b"1.0")
            )
            answer = await client.answer()
            assert answer is not None and answer.status == 200 and answer.complete
            assert answer.header(b"Connection") == b"keep-alive"
        assert len(w.posts()) == 2
        client.close()


async def test_head_is_answered_without_a_body_and_the_connection_stays_usable() -> None:
    async with router_in_process() as rt:
        client = await RawClient.open(rt.url)
        client.send(b"HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await client.answer(head_only=True)
        assert head is not None and head.status == 200 and head.body == b""
        assert int(head.header(b"Content-Length") or 0) > 0  # the GET's length
        client.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        get = await client.answer()
        assert get is not None and get.status == 200
        assert len(get.body) == int(head.header(b"Content-Length") or 0)
        client.send(b"HEAD /v1/completions HTTP/1.1\r\nHost: t\r\n\r\n")
        refused = await client.answer(head_only=True)
        assert refused is not None and refused.status == 405
        assert refused.header(b"Allow") == b"POST"
        # The refusal had no body either: the next answer on the connection is read whole.
        client.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        after = await client.answer()
        assert after is not None and after.status == 200 and after.complete
        assert b"accepts POST only" not in client.raw  # the 405's body never came
        client.close()


async def test_a_chunked_body_with_trailer_fields_is_served_and_the_trailers_dropped() -> None:
    """RFC 9112 7.1.2: trailer fields after the last chunk; a recipient may drop them."""
    async with one_worker_and_a_client() as (w, rt, client):
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(COMPLETION), COMPLETION)
            + b"0\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 200 and answer.complete
        (got,) = w.posts()
        assert got.body == COMPLETION
        assert got.header(b"X-Checksum") is None and got.header(b"X-Other") is None
        assert rt.replica.inflight.total == 0
        client.send(post(b"/v1/completions", COMPLETION))  # the connection is still in step
        again = await client.answer()
        assert again is not None and again.status == 200
        assert len(w.posts()) == 2
        client.close()


async def test_endless_trailer_fields_count_against_the_body_bound_and_are_a_413() -> None:
    """Trailers are dropped, not kept, but their bytes still count: a body cannot go on in
    fields after its last chunk past `--max-request-bytes`."""
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_request_bytes=1024) as rt,
    ):
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n" % (len(COMPLETION), COMPLETION)
            + b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(20))
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 413
        await client.closed()
        assert w.posts() == []


async def test_an_absolute_form_target_is_routed_and_the_worker_gets_the_origin_form() -> None:
    """RFC 9112 3.2.2: a server MUST accept a request target in absolute form."""
    async with one_worker_and_a_client() as (w, rt, client):
        host = rt.url.removeprefix("http://").encode()
        client.send(
            b"POST http://%s/v1/completions?x=1 HTTP/1.1\r\nHost: %s\r\n" % (host, host)
            + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        (got,) = w.posts()
        assert got.path == b"/v1/completions?x=1"
        client.close()


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (b"POST /v1/completions HTTP/1.1\r\n", "needs a Host field"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nHost: b\r\n", "more than one Host"),
        (b"POST /v1/completions HTTP/1.0\r\nHost: a\r\nHost: b\r\n", "more than one Host"),
        (b"GET * HTTP/1.1\r\nHost: a\r\n", "asterisk"),
    ],
)
async def test_a_head_rfc_9112_makes_a_400_is_refused_before_any_worker_sees_it(
    head: bytes, why: str
) -> None:
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(head + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 400, why
        error = json.loads(answer.body)["error"]
        assert error["type"] == "invalid_request_error" and why in error["message"]
        await client.closed()
        assert w.posts() == []


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/completions HTTP/2.0\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
        b"GET /v1/models\r\n\r\n",  # no version at all, and a blank line
        b"GET /v1/models\r\n",  # HTTP/0.9 as it is: one line, then the client waits
        b"GET /healthz\n",  # a probe's path, which the accept thread hands to the loop
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 by prior knowledge
    ],
)
async def test_a_request_in_an_http_version_other_than_1_x_is_a_400(request_bytes: bytes) -> None:
    """llhttp reads `HTTP/2.0` in a request line as any version and a line without one as
    HTTP/0.9: both were served (as HTTP/1.0); the HTTP/2 preface got llhttp's own words."""
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(request_bytes)
        answer = await client.answer()
        # A 400, not RFC 9110's 505: a malformed head always gets a 4xx or a close (issue 11).
        assert answer is not None and answer.status == 400
        assert b"send HTTP/1.1" in answer.body
        await client.closed()
        assert w.posts() == []


def reading_target(rt: RouterHandle, target: bytes) -> Callable[[], bool]:
    """Whether a client connection of the replica read `target` of the head it reads."""

    def read() -> bool:
        return any(
            c._incoming is not None and c._incoming.url == target for c in rt.plane.connections
        )

    return read


async def test_an_http_09_line_is_a_400_at_once_in_pieces_or_after_an_http_11_request() -> None:
    """HTTP/0.9 is one line with nothing after it: llhttp reads its version only at the next
    byte, which never comes, and the client got the head's 408 after 30 s. A read that ends
    with a field line holding such a line's words is no request line."""
    async with one_worker_and_a_client(client_header_timeout_s=30) as (w, rt, client):
        # In three reads: the line's end comes alone.
        client.send(b"GET /v1/mo")
        await eventually(reading_target(rt, b"/v1/mo"))
        client.send(b"dels")
        await eventually(reading_target(rt, b"/v1/models"))
        client.send(b"\r\n")
        answer = await client.answer()
        assert answer is not None and answer.status == 400 and b"HTTP/0.9" in answer.body
        await client.closed()
        await eventually(lambda: not rt.plane.connections)

        # Not a probe's path (the accept thread would answer it): the loop's parser reads it.
        kept = await RawClient.open(rt.url)
        kept.send(b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-Line: GET /v1/models\r\n")
        await eventually(reading_target(rt, b"/v1/models"))
        kept.send(b"\r\n")
        assert (await kept.answer()).status == 200  # type: ignore[union-attr]
        kept.send(b"GET /v1/models\r\n")  # llhttp still reports the last request's 1.1
        answer = await kept.answer()
        assert answer is not None and answer.status == 400 and b"HTTP/0.9" in answer.body
        await kept.closed()
        assert w.posts() == []


async def test_a_request_asking_to_switch_protocols_is_served_as_a_plain_one() -> None:
    """`curl --http2` over plain HTTP sends `Upgrade: h2c` on a POST with its body; a
    WebSocket handshake is a GET with Upgrade. RFC 9110 7.8 lets a server ignore the
    Upgrade: each is served over HTTP/1.1 as it is, once, and the connection stays usable."""
    async with one_worker_and_a_client() as (w, _rt, client):
        upgrade = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMA\r\n"
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
            + upgrade
            + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
            + b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
            + b"Upgrade: websocket\r\n\r\n"
            + post(b"/v1/completions", COMPLETION)
        )
        statuses = [(await client.answer()) for _ in range(3)]
        assert [a.status for a in statuses if a] == [200, 200, 200]
        posts = w.posts()
        assert [p.body for p in posts] == [COMPLETION, COMPLETION]
        assert posts[0].header(b"Upgrade") is None and posts[0].header(b"HTTP2-Settings") is None
        client.send(b"CONNECT worker:443 HTTP/1.1\r\nHost: worker:443\r\n\r\n")
        refused = await client.answer()
        assert refused is not None and refused.status == 400
        assert b"CONNECT is not supported" in refused.body
        await client.closed()
        assert bytes(client.raw).count(b"HTTP/1.1 ") == 4  # one answer per request, no more


@pytest.mark.parametrize("behind_another", [False, True])
async def test_a_request_asking_to_switch_protocols_and_for_a_100_continue_gets_one_100(
    behind_another: bool,
) -> None:
    """Its head was parsed twice, with Upgrade and then written again without it, and each
    parse sent a `100 Continue` (two interim answers); behind another request, the one 100 it
    is owed goes out in its turn."""
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(
            (post(b"/v1/completions", COMPLETION) if behind_another else b"")
            + b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\n"
            + b"Upgrade: h2c\r\nExpect: 100-continue\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(COMPLETION)
        )
        await eventually(lambda: b"100 Continue" in client.raw or client._read(), 5)
        client.send(COMPLETION)
        answers = [(await client.answer()) for _ in range(1 + behind_another)]
        assert [a.status for a in answers if a] == [200] * (1 + behind_another)
        assert bytes(client.raw).count(b"HTTP/1.1 100 Continue\r\n\r\n") == 1
        assert [p.body for p in w.posts()] == [COMPLETION] * (1 + behind_another)
        assert [p.header(b"Upgrade") for p in w.posts()] == [None] * (1 + behind_another)
        client.close()


@pytest.mark.parametrize("served_first", [False, True])
@pytest.mark.parametrize("target", [b"/v1/completions", b"/metrics"])
async def test_connect_to_a_path_is_a_400_and_a_close_with_nothing_logged_at_error(
    target: bytes, served_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """llhttp stops at every CONNECT head as a protocol switch, and one whose target was a
    path was served again without its Upgrade field (it has none), which stopped again: an
    unbounded recursion, ~175 kB of traceback a request in the log and no answer."""
    async with one_worker_and_a_client() as (w, rt, client):
        with caplog.at_level(logging.ERROR):
            connect = b"CONNECT %s HTTP/1.1\r\nHost: r\r\n\r\n" % target
            client.send((post(b"/v1/completions", COMPLETION) if served_first else b"") + connect)
            if served_first:
                served = await client.answer()
                assert served is not None and served.status == 200
            refused = await client.answer()
            assert refused is not None and refused.status == 400
            assert b"CONNECT is not supported" in refused.body
            await client.closed()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert len(w.posts()) == int(served_first)
        assert rt.plane.stats.closed["malformed"] == 1 and rt.plane.stats.closed["error"] == 0


async def test_pipelined_protocol_switch_probes_in_one_write_are_all_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each head asking to switch protocols was parsed again one call deeper, and a probe's
    answer goes out at once, so the queue (`MAX_PIPELINED`) never grew to bound the depth:
    553 of 600 were answered, then a RecursionError."""
    count = 2000
    probe = b"GET /healthz HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    async with one_worker_and_a_client() as (w, rt, client):
        with caplog.at_level(logging.ERROR):
            client.send(probe * count)
            statuses = [(await client.answer()) for _ in range(count)]
            assert [a.status if a else None for a in statuses] == [200] * count
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
        assert rt.plane.stats.closed["error"] == 0 and len(rt.plane.connections) == 1
        client.send(post(b"/v1/completions", COMPLETION))  # and the connection serves on
        answer = await client.answer()
        assert answer is not None and answer.status == 200 and len(w.posts()) == 1


@pytest.mark.parametrize(
    ("after", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 999999\r\n\r\n", 413),
        (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nExpect: foo\r\n\r\n", 417),
    ],
)
async def test_a_refusal_after_a_protocol_switch_request_is_that_refusal_not_a_500(
    after: bytes, status: int
) -> None:
    """The request after an `Upgrade` one is parsed again with it; a refusal raised there took
    the upgrade as its context and was read as a bug: a logged traceback, and the client got a
    500 or a bare close, the valid request's answer before it lost."""
    async with one_worker_and_a_client(max_request_bytes=1000) as (w, rt, client):
        upgrade = b"Connection: Upgrade\r\nUpgrade: h2c\r\n"
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
            + upgrade
            + b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
            + after
        )
        first, second = await client.answer(), await client.answer()
        assert first is not None and first.status == 200
        assert second is not None and second.status == status
        assert len(w.posts()) == 1
        assert rt.plane.stats.closed.get("error", 0) == 0


async def test_an_http_1_0_request_framed_by_transfer_encoding_closes_its_connection() -> None:
    """RFC 9112 6.1: HTTP/1.0 with Transfer-Encoding may be faulty framing (a smuggling
    vector): served, then the connection closes whatever Connection says."""
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(
            b"POST /v1/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(COMPLETION), COMPLETION)
            + b"GET /healthz HTTP/1.0\r\n\r\n"
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert answer.header(b"Connection") == b"close"
        await client.closed()
        assert len(w.posts()) == 1


async def test_an_http_1_0_client_expecting_100_continue_gets_no_interim_answer() -> None:
    """RFC 9110 15.2: no 1xx to an HTTP/1.0 client (it would read it as the answer)."""
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(
            b"POST /v1/completions HTTP/1.0\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert bytes(client.raw).startswith(b"HTTP/1.1 200 ")  # no interim answer before it
        assert len(w.posts()) == 1


async def test_a_chat_part_whose_text_is_not_a_string_is_a_400_naming_it() -> None:
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
        status, payload, _ = await rt.post("/v1/chat/completions", body)
        assert status == 400
        assert payload["error"]["param"] == "messages"
        assert "content[0].text must be a string" in payload["error"]["message"]
        assert w.posts() == []


@pytest.mark.parametrize(
    ("rules", "template"), [(None, None), ("vllm", "qwen3.jinja"), ("sglang", "qwen3.jinja")]
)
async def test_tool_call_arguments_nested_past_pythons_limit_are_forwarded_not_a_500(
    rules: str | None, template: str | None, tmp_path: Path
) -> None:
    """Arguments the engine's own json.loads cannot take whole: with a model's template,
    rendered unlike the engine would, so forwarded and routed by load (counted); with the
    plain rendering, forwarded as any chat. Never a 500."""
    model = {} if template is None else {"tokenizer": str(build_fixture_model(tmp_path, template))}
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], chat_rules=rules or "auto", **model) as rt,
    ):
        await routable(rt, w.url)
        call = {"id": "c1", "type": "function", "function": {"name": "f"}}
        call["function"]["arguments"] = "[" * 1000 + "]" * 1000
        body = {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [call]},
            ],
            "max_tokens": 1,
        }
        status, _, _ = await rt.post("/v1/chat/completions", body)
        assert status == 200
        assert len(w.posts()) == 1
        failures = rt.plane.router.metrics.tokenize_failures[("tool_arguments",)]
        assert failures == (0 if template is None else 1)


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        (b"/generate", {"text": "hello", "input_ids": None}, 200, None),
        (b"/generate", {"input_ids": [-1, 5]}, 400, "input_ids"),
        (b"/generate", {"input_ids": "hello"}, 400, "input_ids"),
        (b"/generate", {"text": "hello", "input_ids": [1.5]}, 400, "input_ids"),
    ],
)
async def test_a_generate_prompt_is_read_from_the_field_sglang_reads(
    route: bytes, body: dict[str, object], status: int, param: str | None
) -> None:
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        got, payload, _ = await rt.post(route.decode(), body)
        assert got == status, payload
        if param is not None:
            assert payload["error"]["param"] == param
        assert len(w.posts()) == (1 if status == 200 else 0)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        # What the engines' lax request models take is forwarded ...
        ("/v1/completions", {"prompt": [1.0, 2.0]}, 200, None),
        ("/v1/completions", {"prompt": [7, "8", True]}, 200, None),
        ("/generate", {"input_ids": [True, 5]}, 200, None),
        ("/v1/chat/completions", {"add_generation_prompt": 0}, 200, None),
        ("/v1/chat/completions", {"add_generation_prompt": "false"}, 200, None),
        # ... and what they refuse is a 400 naming the field, forwarded nowhere.
        ("/v1/completions", {"prompt": [1.5]}, 400, "prompt"),
        ("/generate", {"input_ids": [1.0, 2.0]}, 400, "input_ids"),
        ("/v1/chat/completions", {"add_generation_prompt": "maybe"}, 400, "add_generation_prompt"),
    ],
)
async def test_bodies_the_engines_lax_request_models_take_are_forwarded_under_every_policy(
    policy: str, route: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    if route.endswith("/chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    async with scripted_worker() as w, router_in_process(workers=[w.url], policy=policy) as rt:
        await routable(rt, w.url)
        got, payload, _ = await rt.post(route, body)
        if policy == "round_robin":
            # An index-free policy reads neither ids nor flags: what the engine alone refuses
            # is left to it to refuse.
            status, param = 200, None
        assert got == status, payload
        assert len(w.posts()) == (1 if status == 200 else 0)
        if param is not None:
            assert payload["error"]["param"] == param


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_prompts_given_as_embeddings_are_forwarded_routed_by_load_and_counted(
    policy: str,
) -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        router_in_process(workers=[a.url, b.url], policy=policy) as rt,
    ):
        await routable(rt, a.url, b.url)
        before = [(await fw.state())["requests"] for fw in (a, b)]
        for route, body in (
            ("/v1/completions", {"prompt_embeds": "AAAAAA==", "max_tokens": 1}),
            ("/v1/completions", {"prompt_embeds": ["AAAAAA=="], "prompt": None}),
            ("/generate", {"input_embeds": [[0.5, 0.25]]}),
        ):
            status, payload, _ = await rt.post(route, body)
            assert status == 200, (route, payload)
        # An empty list of embeddings is what vLLM refuses: a 400, forwarded nowhere.
        status, payload, _ = await rt.post("/v1/completions", {"prompt_embeds": []})
        assert (status, payload["error"]["param"]) == (400, "prompt")
        after = [(await fw.state())["requests"] for fw in (a, b)]
        assert sum(after) - sum(before) == 3
        metrics = rt.plane.router.metrics
        assert metrics.tokenize_failures[("embeds",)] == (3 if policy == "cache_aware" else 0)
        assert metrics.decisions[policy, "cache_hit"] == 0


async def test_token_ids_the_engine_coerces_are_keyed_as_the_ids_it_coerces_them_to() -> None:
    ids = list(range(100, 148))
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        router_in_process(workers=[a.url, b.url], expose_route_headers=True) as rt,
    ):
        for fw in (a, b):
            await rt.gate(fw)
        await rt.wait_cursor(b.url, 0, await b.store([ids[:32]]))
        lax = [float(t) for t in ids[:16]] + [str(t) for t in ids[16:]]
        status, body, headers = await rt.post("/v1/completions", {"prompt": lax, "max_tokens": 1})
        assert status == 200, body
        assert headers["X-Kvrouter-Worker"] == b.url
        # The engine (the fake worker reads the prompt as vLLM does) held the two blocks.
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_an_sglang_tool_choice_naming_its_function_wrongly_is_a_400_naming_it(
    tmp_path: Path,
) -> None:
    model = str(build_fixture_model(tmp_path, "qwen3.jinja"))
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], chat_rules="sglang", tokenizer=model) as rt,
    ):
        await routable(rt, w.url)
        tool = {"type": "function", "function": {"name": "g", "parameters": {}}}
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": "g"},
        }
        status, payload, _ = await rt.post("/v1/chat/completions", body)
        assert status == 400
        assert payload["error"]["param"] == "tool_choice"
        assert w.posts() == []


async def test_a_routing_failure_is_a_logged_500_and_never_a_hang(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: the policy raises. The client gets a 500 at once and the traceback
    is logged; the next request is served."""
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        policy = type(rt.plane.router.policy)

        def broken(*args: object) -> object:
            raise RuntimeError("a bug in the policy")

        monkeypatch.setattr(policy, "decide", broken)
        with caplog.at_level(logging.ERROR, logger="router.dataplane.server"):
            status, payload, _ = await rt.post("/v1/completions", None, data=COMPLETION)
        assert status == 500 and payload["error"]["type"] == "server_error"
        assert any("a bug in the policy" in (r.exc_text or "") for r in caplog.records)
        monkeypatch.undo()
        status, _, _ = await rt.post("/v1/completions", None, data=COMPLETION)
        assert status == 200
        assert len(w.posts()) == 1 and rt.replica.inflight.total == 0


@pytest.mark.parametrize("deferred", [False, True])
async def test_an_answer_that_fails_to_start_closes_the_connection_logged_never_a_hang(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, deferred: bool
) -> None:
    """Fault injection: starting the relay raises after the request was routed, inside the
    parser's callback or in a later turn of the loop (a routing slice spent: every routing
    deferred here). The client sees its connection close at once (nothing of an answer can be
    trusted), the traceback is logged, and no in-flight count is left behind."""
    if deferred:
        monkeypatch.setattr(server, "ROUTING_SLICE_S", -1.0)
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)

        def broken(self: object) -> None:
            raise RuntimeError("a bug in the relay")

        monkeypatch.setattr(WorkerRelay, "start", broken)
        client = await RawClient.open(rt.url)
        with caplog.at_level(logging.ERROR, logger="router.dataplane.server"):
            client.send(post(b"/v1/completions", COMPLETION))
            assert await client.answer() is None
            assert await client.closed()
        assert any("a bug in the relay" in (r.exc_text or "") for r in caplog.records)
        assert rt.plane.stats.closed["error"] == 1
        assert rt.replica.inflight.total == 0 and w.posts() == []
        assert rt.plane.stats.routing_deferred == (1 if deferred else 0)


async def test_hop_by_hop_headers_are_dropped_both_ways() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            respond(
                200,
                b"{}",
                b"Keep-Alive: timeout=5",
                b"Connection: keep-alive, X-Upstream-Hop",
                b"X-Upstream-Hop: 1",
                b"X-Engine: kept",
                b"X-Kvrouter-Worker: forged",
            )
        )

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(
            post(
                b"/v1/completions",
                COMPLETION,
                b"Connection: keep-alive, X-Client-Hop",
                b"X-Client-Hop: 1",
                b"Keep-Alive: 300",
                b"TE: trailers",
                b"Proxy-Authorization: Basic eDp5",
                b"Accept-Encoding: gzip",
                b"X-Data-Parallel-Rank: 7",
                b"X-Request-Id: abc",
            )
        )
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        (got,) = w.posts()
        sent = {n.lower() for n, _ in got.headers}
        assert sent.isdisjoint(
            {
                b"connection",
                b"x-client-hop",
                b"keep-alive",
                b"te",
                b"proxy-authorization",
                b"accept-encoding",
                b"x-data-parallel-rank",
            }
        )
        assert got.header(b"X-Request-Id") == b"abc"
        assert got.header(b"Host") == w.url.removeprefix("http://").encode()
        received = {n.lower() for n, _ in answer.headers}
        assert received.isdisjoint({b"keep-alive", b"x-upstream-hop", b"x-kvrouter-worker"})
        assert answer.header(b"X-Engine") == b"kept"
        client.close()


async def test_route_headers_are_added_and_the_rank_is_sent_to_a_multi_rank_worker() -> None:
    async with (
        fake_worker_in_process(dp_size=2) as fw,
        router_in_process(workers=[fw.url], expose_route_headers=True, policy="round_robin") as rt,
    ):
        await routable(rt, fw.url)
        ranks = []
        for _ in range(4):
            status, _, headers = await rt.post(
                "/v1/completions",
                json.loads(COMPLETION),
                headers={"X-Data-Parallel-Rank": "1"},  # the client's wish is not the route
            )
            assert status == 200
            assert headers["X-Kvrouter-Worker"] == fw.url
            assert headers["X-Kvrouter-Dp-Rank"] == headers["X-Fake-Worker-DP-Rank"]
            ranks.append(headers["X-Kvrouter-Dp-Rank"])
        assert sorted(ranks) == ["0", "0", "1", "1"]
        assert [(await fw.state(r))["requests"] for r in (0, 1)] == [2, 2]


# -- section 1: the upstream side ------------------------------------------------------------


async def close_delimited(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"n": 1, ')
    await writer.drain()
    writer.write(b'"end": true}')
    writer.close()


async def test_an_answer_ended_by_the_worker_closing_is_complete_and_re_chunked() -> None:
    async with scripted_worker(close_delimited) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        for _ in range(2):
            client.send(post(b"/v1/completions", COMPLETION))
            answer = await client.answer()
            assert answer is not None and answer.complete
            assert answer.header(b"Transfer-Encoding") == b"chunked"
            assert json.loads(answer.body) == {"n": 1, "end": True}
        # The worker's close ended each answer: a new upstream connection for the second.
        assert [p.connection for p in w.posts()] == [0, 1] or len(
            {p.connection for p in w.posts()}
        ) == 2
        assert rt.plane.stats.ended == {}
        client.close()


async def test_interim_1xx_answers_are_dropped_and_the_final_one_relayed() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        await writer.drain()
        writer.write(respond(200, b'{"final": true}'))

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert json.loads(answer.body) == {"final": True}
        assert bytes(client.raw).count(b"HTTP/1.1") == 1  # no interim answer reached us
        assert not answer.has(b"Link")
        # And the upstream connection stays in use.
        client.send(post(b"/v1/completions", COMPLETION))
        assert (await client.answer()).status == 200  # type: ignore[union-attr]
        assert len({p.connection for p in w.posts()}) == 1
        client.close()


async def test_an_answer_head_split_across_reads_is_relayed_as_the_worker_wrote_it() -> None:
    # Cut inside the status line, a field, the blank line, and between an interim head and
    # the final one; each piece is read by the replica before the next is written.
    answer_bytes = (
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 2",
        b"00 OK\r\nX-Split:v  \r\nContent-Le",
        b"ngth: 2\r\n\r",
        b"\n{",
        b"}",
    )

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        (conn,) = rt.plane.pools[w.url].busy
        sent = 0
        for piece in answer_bytes:
            await eventually(lambda: conn.answered == sent, 5)  # noqa: B023
            writer.write(piece)
            await writer.drain()
            sent += len(piece)

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        for _ in range(2):  # and the upstream connection is reused after it
            client.send(post(b"/v1/completions", COMPLETION))
            answer = await client.answer()
            assert answer is not None and answer.status == 200 and answer.body == b"{}"
            assert not answer.has(b"Link")
        # The field line as the worker wrote it (llhttp would have read the value "v  ").
        assert bytes(client.raw).count(b"\r\nX-Split:v  \r\n") == 2
        assert len({p.connection for p in w.posts()}) == 1
        client.close()


async def test_a_worker_reason_phrase_with_a_control_byte_is_not_relayed() -> None:
    """A status the relay has no phrase for keeps the worker's, which went to the client byte
    for byte, control bytes and all (llhttp lets them by in a status line)."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 299 Whatever\x01Phrase\r\nContent-Length: 2\r\n\r\n{}")

    async with one_worker_and_a_client(script) as (w, _rt, client):
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 299 and answer.body == b"{}"
        assert bytes(client.raw).startswith(b"HTTP/1.1 299 \r\n")
        assert len(w.posts()) == 1
        client.close()


async def test_a_worker_s_204_reaches_the_client_without_its_content_length() -> None:
    """RFC 9110 8.6: a 204 MUST NOT carry a Content-Length; a worker's was relayed as it was."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nX-Engine: e\r\n\r\n")

    async with one_worker_and_a_client(script) as (w, _rt, client):
        for _ in range(2):  # the connection stays in step: no body was awaited
            client.send(post(b"/v1/completions", COMPLETION))
            answer = await client.answer()
            assert answer is not None and answer.status == 204 and answer.body == b""
            assert answer.header(b"X-Engine") == b"e" and not answer.has(b"Content-Length")
        assert len(w.posts()) == 2
        client.close()


async def test_a_404_for_an_openai_path_names_the_target_as_the_client_sent_it() -> None:
    """`/v1/%63ompletions` is not the route the data plane serves (it matches the target as
    sent); the control app's 404 named it decoded: "serves no POST /v1/completions"."""
    async with one_worker_and_a_client() as (w, _rt, client):
        client.send(post(b"/v1/%63ompletions?x=1", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 404
        message = json.loads(answer.body)["error"]["message"]
        assert message == "this router serves no POST /v1/%63ompletions?x=1"
        assert w.posts() == []
        client.close()


async def test_idle_upstream_connections_expire() -> None:
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], upstream_idle_expiry_s=0.2) as rt,
    ):
        await routable(rt, w.url)
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        first = w.posts()[0].connection
        await eventually(lambda: first in w.closed_by_peer, 5)
        assert rt.plane.pools[w.url].total == 0
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        assert w.posts()[1].connection != first


async def test_an_idle_upstream_connection_outlives_its_last_answer_s_head_timeout() -> None:
    """The head deadline of an answered request is left pending on the pooled connection:
    passing, it neither closes the connection nor fails the next request on it."""
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], upstream_head_timeout_s=0.2) as rt,
    ):
        await routable(rt, w.url)
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        (pooled,) = rt.plane.pools[w.url].idle
        assert pooled.deadline_pending  # the answered request's head deadline, left pending
        await eventually(lambda: not pooled.deadline_pending, 5)  # ... until it passed
        assert rt.plane.pools[w.url].idle[0] is pooled
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        first, second = (p.connection for p in w.posts())
        assert second == first and not w.closed_by_peer
        assert rt.plane.pools[w.url].total == 1


async def test_a_reused_connection_found_dead_is_retried_once_on_a_fresh_one_uncounted() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.index_on_connection == 1:
            # The worker closes an idle connection just as the router reuses it.
            writer.transport.abort()
            return
        writer.write(respond(200, b"{}"))

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        for _ in range(2):
            status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
            assert status == 200
        posts = w.posts()
        # 1 answered, 1 dropped on the reused connection, 1 resent on a fresh connection.
        assert [(p.connection, p.index_on_connection) for p in posts][1:] == [
            (posts[0].connection, 1),
            (posts[2].connection, 0),
        ]
        assert rt.plane.stats.safe_retries == 1
        worker = rt.replica.workers.get(w.url)
        assert worker is not None and worker.breaker.consecutive_failures == 0
        scrape = await rt.scrape()
        assert sum(scrape.series("kvrouter_upstream_failures_total").values()) == 0


async def test_a_reused_connection_dying_after_the_worker_worked_is_lost_not_sent_again() -> None:
    """A worker that read the request on a reused connection and worked on it (well past
    `STALE_WINDOW_S`) before the connection died, with no head (an engine dying mid-generation
    of a non-streamed completion), is no idle close: the request is not sent to it again (it
    would run twice), the failure is the worker's, counted and failed over."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.index_on_connection == 1:
            await asyncio.sleep(4 * STALE_WINDOW_S)  # the work, not a synchronization
            writer.transport.abort()
            return
        writer.write(respond(200, b"{}"))

    async with (
        scripted_worker(script) as w,
        scripted_worker() as good,
        router_in_process(workers=[w.url, good.url], policy="round_robin") as rt,
    ):
        await routable(rt, w.url, good.url)
        # w, good, then w again on its reused connection: it dies there, and good answers.
        statuses = [(await rt.post("/v1/completions", json.loads(COMPLETION)))[0] for _ in range(3)]
        assert statuses == [200] * 3
        posts = w.posts()
        assert [(p.connection, p.index_on_connection) for p in posts] == [
            (posts[0].connection, 0),
            (posts[0].connection, 1),  # read, worked on, its connection died: not sent again
        ]
        assert len(good.posts()) == 2  # its own turn, and the failover
        assert rt.plane.stats.safe_retries == 0
        assert rt.replica.workers.get(w.url).breaker.consecutive_failures == 1  # type: ignore[union-attr]
        scrape = await rt.scrape()
        assert scrape.by("kvrouter_upstream_failures_total", "reason") == {"lost": 1}


async def test_an_idle_close_noticed_after_a_held_loop_is_still_the_safe_retry() -> None:
    """The worker closes the reused connection as the request arrives (the idle-close race),
    and the replica's loop is then held past `STALE_WINDOW_S` (a large event batch's decode):
    the close was noticed late, not made late. Taken for a worker that worked on the
    request, it was a 502 (one worker) or a failover, and a failure on a healthy worker."""
    held: list[bool] = []

    def hold() -> None:  # the loop held, as by a long callback: the condition under test
        held.append(True)
        time.sleep(2 * STALE_WINDOW_S)

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.index_on_connection == 1 and not held:
            writer.transport.abort()
            asyncio.get_running_loop().call_soon(hold)  # before the replica sees the close
            return
        writer.write(respond(200, b"{}"))

    async with (
        scripted_worker(script) as w,
        router_in_process(workers=[w.url], policy="round_robin") as rt,
    ):
        await routable(rt, w.url)
        statuses = [(await rt.post("/v1/completions", json.loads(COMPLETION)))[0] for _ in range(2)]
        assert statuses == [200, 200] and held
        assert len(w.posts()) == 3  # the first, the one its idle close crossed, the retry
        assert rt.plane.stats.safe_retries == 1
        assert rt.replica.workers.get(w.url).breaker.consecutive_failures == 0  # type: ignore[union-attr]
        scrape = await rt.scrape()
        assert scrape.by("kvrouter_upstream_failures_total", "reason") == {}


async def test_a_second_dead_connection_is_a_failure_of_the_worker() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        if len([r for r in w.posts()]) > 1:
            writer.transport.abort()
            return
        writer.write(respond(200, b"{}"))

    async with (
        scripted_worker(script) as w,
        scripted_worker() as good,
        router_in_process(workers=[w.url, good.url], policy="round_robin") as rt,
    ):
        await routable(rt, w.url, good.url)
        statuses = [(await rt.post("/v1/completions", json.loads(COMPLETION)))[0] for _ in range(4)]
        assert statuses == [200] * 4
        # w: 1 answered, then (reused, dropped) + (fresh, dropped) = a failure, failed over.
        assert len(w.posts()) == 3
        assert len(good.posts()) == 3
        assert rt.plane.stats.safe_retries == 1
        assert rt.replica.workers.get(w.url).breaker.consecutive_failures == 1  # type: ignore[union-attr]


async def test_connections_to_one_worker_are_capped_and_the_rest_wait_their_turn() -> None:
    release = asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.write(respond(200, b"{}"))

    async with (
        scripted_worker(script) as w,
        router_in_process(workers=[w.url], upstream_connections_per_worker=2) as rt,
    ):
        await routable(rt, w.url)
        calls = [
            asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
            for _ in range(5)
        ]
        # Each client connection reaches the loop through the door in its own time: wait
        # until all five requests were routed, then two are at the worker and three wait.
        await eventually(
            lambda: w.url in rt.plane.pools and len(rt.plane.pools[w.url].waiting) == 3
        )
        pool = rt.plane.pools[w.url]
        await eventually(lambda: len(w.posts()) == 2)
        assert len(pool.waiting) == 3 and pool.total == 2
        release.set()
        assert [status for status, _, _ in await asyncio.gather(*calls)] == [200] * 5
        assert w.most_answering == 2
        assert len({p.connection for p in w.posts()}) == 2


def held_until(release: asyncio.Event) -> Script:
    """A worker whose answers are streams that stall after their first event until `release`:
    its first request holds a connection."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
        )
        await release.wait()
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")

    return script


async def test_a_request_queued_for_a_full_pool_fails_over_after_the_connect_timeout() -> None:
    release = asyncio.Event()
    bound = 0.5
    async with (
        scripted_worker(held_until(release)) as busy,
        scripted_worker() as good,
        router_in_process(
            workers=[busy.url, good.url],
            policy="round_robin",
            upstream_connections_per_worker=1,
            upstream_connect_timeout_s=bound,
        ) as rt,
    ):
        await routable(rt, busy.url, good.url)
        body = json.loads(COMPLETION)
        holder = asyncio.create_task(rt.post("/v1/completions", body))  # busy's one connection
        await eventually(lambda: len(busy.posts()) == 1)
        assert (await rt.post("/v1/completions", body))[0] == 200  # round_robin: good first
        loop = asyncio.get_running_loop()
        started = loop.time()
        # busy first: queued behind the held stream, then good once the bound passed.
        status, _, _ = await asyncio.wait_for(rt.post("/v1/completions", body), 10)
        waited = loop.time() - started
        assert status == 200
        assert bound <= waited < bound + 2, waited
        pool = rt.plane.pools[busy.url]
        assert not pool.waiting and pool.total == 1
        assert len(busy.posts()) == 1 and len(good.posts()) == 2
        assert rt.plane.metrics.upstream_failures[busy.url, "queue"] == 1
        worker = rt.replica.workers.get(busy.url)
        assert worker is not None and worker.breaker.consecutive_failures == 0  # busy, not broken
        release.set()
        assert (await holder)[0] == 200
        await eventually(lambda: len(pool.idle) == 1)  # the held connection came back, idle
        assert len(busy.posts()) == 1  # the request given up on was never sent after all
        assert rt.replica.inflight.total == 0


async def test_a_request_queued_with_no_other_worker_is_a_503_with_retry_after_at_the_bound() -> (
    None
):
    release = asyncio.Event()
    bound = 0.5
    async with one_worker_and_a_client(
        held_until(release), upstream_connections_per_worker=1, upstream_connect_timeout_s=bound
    ) as (w, rt, client):
        holder = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
        await eventually(lambda: len(w.posts()) == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer(within_s=10)
        waited = loop.time() - started
        assert answer is not None and answer.status == 503
        assert answer.header(b"Retry-After") == b"1"
        message = json.loads(answer.body)["error"]["message"]
        assert "connection(s) to the worker stayed busy" in message, message
        assert bound <= waited < bound + 2, waited
        pool = rt.plane.pools[w.url]
        assert not pool.waiting and pool.total == 1
        assert rt.plane.metrics.requests["/v1/completions", "none", "503"] == 1
        assert rt.plane.metrics.upstream_failures[w.url, "queue"] == 1
        worker = rt.replica.workers.get(w.url)
        assert worker is not None and worker.breaker.consecutive_failures == 0
        release.set()
        assert (await holder)[0] == 200
        await eventually(lambda: len(pool.idle) == 1)
        assert len(w.posts()) == 1  # the request answered 503 never reached the worker
        client.close()


async def test_a_request_sent_anyway_that_waits_in_vain_leaves_the_breakers_probe_out() -> None:
    """A half-open worker's probe holds its one connection; a request sent anyway (every
    breaker open) queues behind it and gets its 503. Its wait running out freed the probe's
    slot: the breaker read open with its cooldown passed, for the next request to probe again
    while the first probe was still out."""
    release = asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        if b"fail" not in request.body:
            await release.wait()  # the probe's verdict waits for its head
        writer.write(respond(500 if b"fail" in request.body else 200, b"{}"))

    async with one_worker_and_a_client(
        script,
        breaker_failure_threshold=1,
        breaker_cooldown_s=0.2,
        upstream_connections_per_worker=1,
        upstream_connect_timeout_s=0.5,
    ) as (w, rt, client):
        worker = rt.replica.workers.get(w.url)
        assert worker is not None
        failing = {"prompt": "fail", "max_tokens": 1}
        assert (await rt.post("/v1/completions", failing))[0] == 500  # trips the breaker
        assert worker.breaker.state == "open"
        await eventually(lambda: not worker.breaker.is_open())  # its cooldown passed
        probe = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
        await eventually(lambda: len(w.posts()) == 2)
        assert worker.breaker.state == "half_open"
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer(within_s=10)
        assert answer is not None and answer.status == 503
        assert rt.plane.metrics.upstream_failures[w.url, "queue"] == 1
        assert worker.breaker.state == "half_open" and not worker.breaker.allow()
        release.set()
        assert (await probe)[0] == 200
        assert worker.breaker.state == "closed"
        assert len(w.posts()) == 2  # the failing request and the probe; the 503 never sent
        assert worker.breaker.trips == 1
        client.close()


async def test_a_request_still_queued_when_the_drain_times_out_gets_its_503_not_a_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The drain's timeout (1 s here) shorter than the wait for a pooled connection (20 s):
    the queued request, never sent, was cut with what was in flight, with no answer."""
    release = asyncio.Event()
    async with one_worker_and_a_client(
        held_until(release), upstream_connections_per_worker=1, upstream_connect_timeout_s=20
    ) as (w, rt, client):
        holder, pool = await queued_behind_one(w, rt, client)
        stop = asyncio.Event()
        stop.set()  # as SIGTERM sets it
        with caplog.at_level(logging.WARNING, logger="router.serving"):
            await asyncio.wait_for(serve_until(rt.serving, stop, drain_timeout_s=1.0), 10)
        answer = await client.answer(within_s=5)
        assert answer is not None and answer.status == 503
        assert answer.header(b"Retry-After") == b"1"
        message = json.loads(answer.body)["error"]["message"]
        assert "drain ended" in message, message
        assert await client.closed()  # draining: no keep-alive
        assert not pool.waiting
        assert rt.plane.metrics.requests["/v1/completions", "none", "503"] == 1
        assert rt.plane.metrics.upstream_failures[w.url, "queue"] == 1
        worker = rt.replica.workers.get(w.url)
        assert worker is not None and worker.breaker.consecutive_failures == 0
        assert rt.replica.inflight.total == 1  # the held stream alone, cut at the shutdown
        said = [r.getMessage() for r in caplog.records if r.name == "router.serving"]
        assert any("1 request(s) never sent" in m for m in said), said
        assert any("1 request(s) still in flight are cut" in m for m in said), said
        release.set()
        assert (await holder)[0] == 200
        assert len(w.posts()) == 1  # the request answered 503 never reached the worker


async def test_a_request_queued_for_a_busy_worker_waits_one_bound_not_one_per_rank() -> None:
    """A worker's data-parallel ranks share its one pool: a request that found no connection
    in time failed over to the same worker's next rank and queued again, behind newer
    waiters, once per rank (three bounds for three ranks), then got its 503."""
    bound = 0.5
    async with (
        fake_worker_in_process(dp_size=3, decode_ms_per_token=50) as fw,
        router_in_process(
            workers=[fw.url],
            policy="round_robin",
            upstream_connections_per_worker=1,
            upstream_connect_timeout_s=bound,
        ) as rt,
    ):
        await routable(rt, fw.url)
        slow = {"prompt": "tell me about caches", "max_tokens": 400}  # 20 s of decoding
        holder = asyncio.create_task(rt.post("/v1/completions", slow))
        pools = rt.plane.pools
        await eventually(lambda: fw.url in pools and len(pools[fw.url].busy) == 1)
        pool = pools[fw.url]
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _, _ = await asyncio.wait_for(
            rt.post("/v1/completions", json.loads(COMPLETION)), 10
        )
        waited = loop.time() - started
        assert status == 503
        assert bound <= waited < 2 * bound, waited
        assert rt.plane.metrics.upstream_failures[fw.url, "queue"] == 1
        assert not pool.waiting
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


async def test_requests_finding_a_worker_busy_together_are_one_warning_not_one_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under overload they come in crowds: 40 queued requests wrote 82 warning lines, each
    saying the worker failed when it was only busy."""
    release = asyncio.Event()
    async with one_worker_and_a_client(
        held_until(release), upstream_connections_per_worker=1, upstream_connect_timeout_s=0.5
    ) as (w, rt, client):
        holder = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
        await eventually(lambda: len(w.posts()) == 1)
        body = json.loads(COMPLETION)
        answers = await asyncio.gather(*(rt.post("/v1/completions", body) for _ in range(5)))
        assert [a[0] for a in answers] == [503] * 5
        assert rt.plane.metrics.upstream_failures[w.url, "queue"] == 5
        busy = [r for r in caplog.records if "busy with this replica's requests" in r.message]
        assert len(busy) == 1 and busy[0].levelname == "WARNING", [r.message for r in busy]
        assert not [r for r in caplog.records if "failed before the first byte" in r.message]
        release.set()
        assert (await holder)[0] == 200
        client.close()


async def test_a_client_leaving_while_its_request_is_queued_leaves_the_queue() -> None:
    release = asyncio.Event()
    async with one_worker_and_a_client(
        held_until(release), upstream_connections_per_worker=1, upstream_connect_timeout_s=20
    ) as (w, rt, client):
        holder, pool = await queued_behind_one(w, rt, client)
        client.close()
        await eventually(lambda: not pool.waiting)
        release.set()
        assert (await holder)[0] == 200
        await eventually(lambda: len(pool.idle) == 1)  # not handed to the request that left
        assert len(w.posts()) == 1
        assert rt.replica.inflight.total == 0


async def test_an_sse_event_reaches_the_client_before_the_worker_sends_the_next() -> None:
    next_event = asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(b"b\r\ndata: one\n\n\r\n")
        await writer.drain()
        await next_event.wait()
        writer.write(b"b\r\ndata: two\n\n\r\n0\r\n\r\n")

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        async with rt.session.post(f"{rt.url}/v1/completions", data=STREAM) as resp:
            assert await resp.content.readuntil(b"\n\n") == b"data: one\n\n"
            next_event.set()
            assert await resp.content.read() == b"data: two\n\n"


async def test_an_sse_event_split_between_its_blank_lines_cr_and_lf_arrives_at_once() -> None:
    """sse-starlette ends lines with CRLF; a worker write ending between the CR and the LF of
    an event's blank line had the LF held until the next event ended, and a reader that holds
    a CR for the byte after it (httpx's iter_lines) got the event only with the next."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    first = b"c\r\ndata: one\r\n\r\r\n"  # the event up to its blank line's CR
    read_first, next_event = asyncio.Event(), asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head + first)
        await writer.drain()
        await read_first.wait()
        writer.write(b"1\r\n\n\r\n")
        await writer.drain()
        await next_event.wait()
        writer.write(b"d\r\ndata: two\r\n\r\n\r\n0\r\n\r\n")

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)

        def replica_read_first() -> bool:
            pool = rt.plane.pools.get(w.url)
            return pool is not None and any(c.answered >= len(head + first) for c in pool.busy)

        async with rt.session.post(f"{rt.url}/v1/completions", data=STREAM) as resp:
            await eventually(replica_read_first)
            read_first.set()  # the LF comes in a read of its own
            async with asyncio.timeout(5):
                assert await resp.content.readexactly(13) == b"data: one\r\n\r\n"
            next_event.set()
            assert await resp.content.read() == b"data: two\r\n\r\n"
        assert len(w.posts()) == 1


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        (b"application/json", b'{"text": "' + b"x" * 4000 + b'"}'),
        (b"text/event-stream", b"".join(b"data: %d\n\n" % i for i in range(400))),
    ],
)
async def test_a_worker_s_one_byte_chunks_reach_the_client_as_one_chunk_a_read(
    content_type: bytes, body: bytes
) -> None:
    """A worker writing its answer in chunks of one byte (legal) got one client chunk and one
    Python call a chunk: 6x the bytes to the client, and 10 MB of them held a replica's loop
    for seconds (its /metrics, its health checks). The chunks of one read go out as one; an SSE
    answer's events as they end, whole."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
            % content_type
            + b"".join(b"1\r\n%c\r\n" % byte for byte in body)
            + b"0\r\n\r\n"
        )

    async with one_worker_and_a_client(script) as (_w, _rt, client):
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.complete and answer.body == body
        head_end = bytes(client.raw).index(b"\r\n\r\n") + 4
        # The body's framing: a chunk size line a read (a few reads), not one a byte (6x).
        assert len(client.raw) - head_end < len(body) + 200
        if content_type == b"text/event-stream":
            assert sse_events(answer.body) == [b"data: %d" % i for i in range(400)]
        client.close()


async def sse_then_death(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\n"
    )
    await writer.drain()
    writer.transport.abort()


async def test_a_worker_dying_mid_sse_sends_an_error_event_and_no_clean_end() -> None:
    async with scripted_worker(sse_then_death) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", STREAM))
        await client.closed()
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert not answer.complete  # no terminating chunk
        events = [e for e in answer.body.split(b"\n\n") if e]
        assert events[0] == b"data: one"
        assert "error" in json.loads(events[1].removeprefix(b"data: "))
        assert not bytes(client.raw).endswith(b"0\r\n\r\n")
        assert rt.plane.stats.ended["cut"] == 1
        # After the first byte nothing is retried.
        assert len(w.posts()) == 1
        # And an aiohttp client reports the failure.
        async with rt.session.post(f"{rt.url}/v1/completions", data=STREAM) as resp:
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()


async def test_a_worker_dying_mid_body_of_known_length_leaves_it_short_and_closed() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 40)
        await writer.drain()
        writer.transport.abort()

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        await client.closed()
        answer = await client.answer()
        assert answer is not None and not answer.complete and answer.body == b"x" * 40


async def test_a_client_leaving_aborts_the_upstream_request_at_once() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nb\r\ndata: one\n\n\r\n"
        )
        await writer.drain()
        await asyncio.Event().wait()  # a long generation

    async with scripted_worker(script) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", STREAM))
        await eventually(lambda: b"data: one" in client.raw or client._read(), 5)
        loop = asyncio.get_running_loop()
        left = loop.time()
        client.writer.transport.abort()
        connection = w.posts()[0].connection
        await eventually(lambda: connection in w.closed_by_peer, 5, poll_s=0.001)
        # Reported, not asserted as a budget: the abort is synchronous in connection_lost.
        logging.getLogger(__name__).info(
            "upstream aborted %.1f ms after", (loop.time() - left) * 1e3
        )
        assert rt.replica.inflight.total == 0
        assert rt.plane.stats.ended["gone"] == 1


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed process's socket ends."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_close_delimited_stream_ended_by_a_reset_is_cut_not_complete() -> None:
    """A close ends a body with neither length nor chunking (RFC 9112 6.3), a reset does not:
    it was relayed with the last chunk, a crashed worker's stream looking whole."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: one\n\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # the event is relayed before the reset
        reset(writer)

    async with one_worker_and_a_client(script) as (_, rt, client):
        client.send(post(b"/v1/completions", STREAM))
        await client.closed()
        answer = await client.answer()
        assert answer is not None and answer.status == 200 and not answer.complete
        events = [e for e in answer.body.split(b"\n\n") if e]
        assert events[0] == b"data: one"
        assert "error" in json.loads(events[1].removeprefix(b"data: "))
        assert rt.plane.stats.ended["cut"] == 1


async def test_an_sse_stream_cut_inside_an_event_relays_whole_events_then_the_error_event() -> None:
    """The client gets only events the worker ended, an event split across two reads once it
    ends, then the error event: the broken event relayed, ended by a blank line, was parsed
    first (the OpenAI SDK raised a JSONDecodeError on its JSON, never its APIError)."""
    events = [b'data: {"n": %d, "text": "%s"}\n\n' % (n, b"x" * 40) for n in range(3)]
    writes = [events[0] + events[1][:20], events[1][20:] + events[2][:30]]

    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunks = [b"%x\r\n%b\r\n" % (len(data), data) for data in writes]
    go_on = asyncio.Event()

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        for piece in chunks:
            writer.write(piece)
            await writer.drain()
            await go_on.wait()
            go_on.clear()
        writer.transport.abort()  # the engine dies inside the third event

    async def relayed(rt: RouterHandle, url: str, reads: int, client: RawClient) -> bytes:
        """What the client has once the replica read the worker's first `reads` writes."""
        written = len(head) + sum(map(len, chunks[:reads]))

        def read_them() -> bool:
            pool = rt.plane.pools.get(url)
            return pool is not None and any(c.answered >= written for c in pool.busy)

        await eventually(read_them)
        # Relayed in the same callback as the read: the client's bytes are on their way.
        wanted = events[reads - 1]
        async with asyncio.timeout(5):
            while wanted not in client.raw:
                await client._read()
        return bytes(client.raw)

    async with one_worker_and_a_client(script) as (w, rt, client):
        client.send(post(b"/v1/completions", STREAM))
        first = await relayed(rt, w.url, 1, client)
        assert events[1][:20] not in first  # the half event is held
        go_on.set()
        second = await relayed(rt, w.url, 2, client)
        assert events[1] in second and events[2][:30] not in second  # the split one, whole
        go_on.set()
        await client.closed()
        answer = await client.answer()
        assert answer is not None and answer.status == 200 and not answer.complete
        *whole, error = sse_events(answer.body)
        assert whole == [e.strip() for e in events[:2]]
        parsed = [json.loads(e.removeprefix(b"data: ")) for e in [*whole, error]]
        assert parsed[-1]["error"]["type"] == "upstream_error"
        assert rt.plane.stats.ended["cut"] == 1 and len(w.posts()) == 1


@dataclass
class HeadAnsweringWorker:
    url: str
    heads: list[bytes]  # of the POSTs it answered


@contextlib.asynccontextmanager
async def a_worker_answering_at_the_head(answer: bytes) -> AsyncIterator[HeadAnsweringWorker]:
    """A worker that answers a POST as soon as its head is in, then reads nothing more of that
    connection and keeps it open; `GET /health` is 200, other GETs 404."""
    stop = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []
    heads: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"POST"):
                    heads.append(head)
                    writer.write(answer)
                    await stop.wait()
                    return
                status = b"200 OK" if head.startswith(b"GET /health") else b"404 Not Found"
                writer.write(b"HTTP/1.1 %b\r\nContent-Length: 2\r\n\r\n{}" % status)

    listening = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        yield HeadAnsweringWorker(f"http://127.0.0.1:{port}", heads)
    finally:
        stop.set()
        listening.close()
        for writer in writers:
            writer.transport.abort()


async def test_a_worker_answering_before_reading_a_large_body_leaves_the_client_served() -> None:
    """The worker stopped reading: the router's write buffer filled and held the client's
    reading back, and nothing let go once the answer was in (the connection never drained):
    the client's next request on its connection went unread until the keep-alive timeout."""
    big = b'{"prompt": "' + b"y" * (24 * 1024 * 1024) + b'", "max_tokens": 1}'
    refusal = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    async with (
        a_worker_answering_at_the_head(refusal) as w,
        router_in_process(
            workers=[w.url], policy="round_robin", health_interval_s=60, max_request_bytes=len(big)
        ) as rt,
    ):
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", big))
        first = await client.answer()
        assert first is not None and first.status == 400
        client.send(post(b"/v1/completions", COMPLETION))
        second = await client.answer(within_s=5)
        assert second is not None and second.status == 400
        assert len(w.heads) == 2
        # The half-sent request went with its connection (aborted: a close waited to send it
        # to a worker that reads no more), and the second's closed as the worker asked.
        pool = rt.plane.pools[w.url]
        await eventually(lambda: pool.total == 0, 5)
        client.close()


async def test_an_answer_starting_while_its_client_is_over_its_buffer_mark_holds_its_worker() -> (
    None
):
    """asyncio says a transport went over its high-water mark once; when that happened in the
    last write of one answer, the next answer was relayed as fast as its worker wrote, into
    the router's memory (a client pipelining a few answers and reading none: +300 MB). The
    transport's report is delivered here as asyncio delivers it, between two answers."""
    total, piece = 16 * 1024 * 1024, 256 * 1024

    async def flood(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.index_on_connection == 0 and b"small" in request.body:
            writer.write(respond(200, b"{}"))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        for _ in range(total // piece):
            writer.write(b"x" * piece)
            await writer.drain()

    async with one_worker_and_a_client(flood) as (w, rt, client):
        client.send(post(b"/v1/completions", b'{"prompt": "small", "max_tokens": 1}'))
        first = await client.answer()
        assert first is not None and first.status == 200
        (conn,) = rt.plane.connections
        conn.pause_writing()  # the first answer's last write crossed the mark
        client.send(post(b"/v1/completions", COMPLETION))
        await eventually(lambda: reading_held(rt, w.url), 10)
        conn.resume_writing()  # drained
        answer = await client.answer(within_s=60)
        assert answer is not None and answer.complete and len(answer.body) == total
        client.close()


async def test_a_worker_switching_protocols_is_a_lost_answer_saying_so() -> None:
    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n"
        )

    async with one_worker_and_a_client(script) as (w, rt, client):
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 502
        message = json.loads(answer.body)["error"]["message"]
        assert "switched protocols (101)" in message, message
        assert rt.plane.metrics.upstream_failures[w.url, "lost"] == 1 and len(w.posts()) == 1


async def test_cors_answers_an_allowed_pages_preflight_and_marks_its_answers_and_no_others() -> (
    None
):
    """Browser apps send a preflight before each POST with JSON or an `Authorization`: it was a
    405, as vLLM and SGLang answer it. Answered by the router (never a worker's to answer:
    the worker sees no preflight and no Origin), for the allowed origin only, on the browser
    routes only."""
    app = {"Origin": "https://app.example"}
    asks = {**app, "Access-Control-Request-Headers": "authorization,content-type"}
    async with one_worker_and_a_client(cors_allow_origin=["https://app.example"]) as (
        w,
        rt,
        client,
    ):
        client.close()
        for path, method in (("/v1/chat/completions", "POST"), ("/v1/models", "GET")):
            headers = {**asks, "Access-Control-Request-Method": method}
            async with rt.session.options(rt.url + path, headers=headers) as resp:
                assert resp.status == 204 and await resp.read() == b""
                assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert resp.headers["Vary"] == "Origin"
                assert resp.headers["Access-Control-Allow-Methods"] == method
                assert resp.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
                assert resp.headers["Access-Control-Max-Age"] == "600"
        assert not any(r.method == b"OPTIONS" for r in w.requests)

        async def answer(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> Any:
            async with rt.session.request(method, rt.url + path, headers=headers, data=body) as r:
                await r.read()
                return r.status, r.headers.get("Access-Control-Allow-Origin")

        assert await answer("POST", "/v1/completions", app, COMPLETION) == (
            200,
            "https://app.example",
        )
        assert w.posts()[0].header(b"origin") is None  # an engine's own CORS never joins in
        assert await answer("POST", "/v1/completions", app, b"{") == (400, "https://app.example")
        assert await answer("GET", "/v1/models", app) == (200, "https://app.example")
        # Not for another origin, nor on the routes no page is to read.
        evil = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert await answer("OPTIONS", "/v1/completions", evil) == (405, None)
        assert await answer("POST", "/v1/completions", evil, COMPLETION) == (200, None)
        assert await answer("GET", "/metrics", app) == (200, None)
        assert await answer("OPTIONS", "/workers", {**asks, **evil, **app}) == (401, None)
        assert len(w.posts()) == 2


async def test_without_cors_allow_origin_no_page_gets_a_cors_answer() -> None:
    app = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    async with one_worker_and_a_client() as (w, rt, client):
        client.close()
        async with rt.session.options(rt.url + "/v1/completions", headers=app) as resp:
            assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
        async with rt.session.post(rt.url + "/v1/completions", headers=app, data=COMPLETION) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        (post_,) = w.posts()
        assert post_.header(b"origin") is None


async def test_the_control_port_answers_no_page_while_the_main_port_does() -> None:
    """The --control-port listener answered a page's preflight of POST /v1/completions with a
    204 allowing it, then the POST was the control app's 404 carrying
    Access-Control-Allow-Origin: it serves no browser route, so it answers no CORS."""
    origin = "https://app.example"
    asks = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    port = free_tcp_port()
    async with router_in_process(control_port=port, cors_allow_origin=[origin]) as rt:

        async def answer(method: str, url: str, headers: dict[str, str], body: bytes = b"") -> Any:
            async with rt.session.request(method, url, headers=headers, data=body) as r:
                await r.read()
                return r.status, r.headers.get("Access-Control-Allow-Origin")

        assert await answer("OPTIONS", rt.url + "/v1/completions", asks) == (204, origin)
        control = f"http://127.0.0.1:{port}"
        assert await answer("OPTIONS", control + "/v1/completions", asks) == (404, None)
        assert await answer("POST", control + "/v1/completions", asks, COMPLETION) == (404, None)
        page = {"Origin": origin}
        assert await answer("GET", control + "/v1/models", page) == (200, None)
        assert await answer("GET", rt.url + "/v1/models", page) == (200, origin)


async def answer_with_a_cors_field_of_its_own(
    request: Request, writer: asyncio.StreamWriter
) -> None:
    """A worker (or a proxy before it) that lets any page read its answers."""
    writer.write(
        respond(
            200,
            b'{"ok": true}',
            b"Content-Type: application/json",
            b"Access-Control-Allow-Origin: *",
            b"Access-Control-Allow-Credentials: true",
        )
    )


@pytest.mark.parametrize("allowed", [[], ["https://app.example"]])
async def test_a_workers_own_cors_fields_never_reach_the_page(allowed: list[str]) -> None:
    """Relayed, they let any origin read the answers whatever `--cors-allow-origin` says, and
    beside the router's own made two `Access-Control-Allow-Origin` fields, which browsers
    refuse."""
    async with one_worker_and_a_client(
        answer_with_a_cors_field_of_its_own, cors_allow_origin=allowed
    ) as (_w, rt, client):
        client.close()
        for origin in ("https://evil.example", "https://app.example"):
            headers = {"Origin": origin}
            async with rt.session.post(
                rt.url + "/v1/completions", headers=headers, data=COMPLETION
            ) as r:
                assert r.status == 200
                expected = [origin] if origin in allowed else []
                assert r.headers.getall("Access-Control-Allow-Origin", []) == expected
                assert "Access-Control-Allow-Credentials" not in r.headers


# -- section 2: what the current path promises ---------------------------------------------


async def test_json_nested_1000_deep_is_a_400_with_the_openai_error_shape() -> None:
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        body = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        status, payload, _ = await rt.post("/v1/completions", None, data=body)
        assert status == 400
        assert payload["error"]["type"] == "invalid_request_error"
        assert "nested" in payload["error"]["message"]
        assert w.posts() == []


async def test_bodies_over_the_limit_are_413_declared_or_chunked() -> None:
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_request_bytes=64) as rt,
    ):
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", b"x" * 65))
        answer = await client.answer()
        assert answer is not None and answer.status == 413
        assert await client.closed()
        client = await RawClient.open(rt.url)
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(3):
            client.send(b"20\r\n" + b"y" * 32 + b"\r\n")
        answer = await client.answer()
        assert answer is not None and answer.status == 413
        assert json.loads(answer.body)["error"]["param"] == "body"
        assert w.posts() == []


async def test_a_body_over_the_limit_sent_whole_still_lets_the_client_read_its_413() -> None:
    """A client that sends its whole body before reading (no Expect) reads the 413: the
    connection is half-closed and the rest of the body read and dropped (a lingering close),
    where a close at once made the kernel reset the connection under the answer."""
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_request_bytes=1024) as rt,
    ):
        await routable(rt, w.url)
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)
        body = b'{"prompt": "' + b"a" * 5_000_000 + b'"}'

        def send_all_then_read() -> bytes:
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                got = b""
                while chunk := sock.recv(65536):
                    got += chunk
                return got

        got = await asyncio.wait_for(asyncio.to_thread(send_all_then_read), 20)
        assert got.startswith(b"HTTP/1.1 413 ")
        assert b"over the limit of 1024 bytes" in got
        assert w.posts() == []


async def test_a_refused_connection_fails_over_and_the_breaker_counts_it() -> None:
    async with (
        scripted_worker() as gone,
        scripted_worker() as good,
        router_in_process(
            workers=[gone.url, good.url], policy="round_robin", health_interval_s=60
        ) as rt,
    ):
        await routable(rt, gone.url, good.url)
        # Health will not look again for a minute: the worker is still routable, unreachable.
        await gone.stop()
        assert await _refusing(int(gone.url.rsplit(":", 1)[1]))
        statuses = [(await rt.post("/v1/completions", json.loads(COMPLETION)))[0] for _ in range(4)]
        assert statuses == [200] * 4
        assert len(good.posts()) == 4
        worker = rt.replica.workers.get(gone.url)
        assert worker is not None and worker.breaker.consecutive_failures == 2
        assert (await rt.scrape()).value(
            "kvrouter_upstream_failures_total", worker=gone.url, reason="connect"
        ) == 2


async def _refusing(port: int) -> bool:
    """Whether connecting to `port` is refused (nothing listens there any more)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_a_worker_that_health_declares_down_while_a_request_waits_is_failed_over(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def never(request: Request, writer: asyncio.StreamWriter) -> None:
        stuck.healthy = False  # the engine froze: its health check fails from now on
        await asyncio.Event().wait()

    async with (
        scripted_worker(never) as stuck,
        scripted_worker() as good,
        router_in_process(
            workers=[stuck.url, good.url], policy="round_robin", health_interval_s=0.1
        ) as rt,
    ):
        await routable(rt, stuck.url, good.url)
        # round_robin starts with the first worker.
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        assert len(stuck.posts()) == 1 and len(good.posts()) == 1
        assert (await rt.scrape()).value(
            "kvrouter_upstream_failures_total", worker=stuck.url, reason="worker_down"
        ) == 1
        assert rt.replica.inflight.total == 0
        said = [r.getMessage() for r in caplog.records if "is now unhealthy" in r.getMessage()]
        assert said and "/health answered 503" in said[0], said  # what the check met
        # Health took it out, not a failed request: the breaker is for those.
        worker = rt.replica.workers.get(stuck.url)
        assert worker is not None and worker.breaker.consecutive_failures == 0
        assert not worker.breaker.is_open()


async def test_one_failed_health_check_leaves_the_workers_requests_in_flight_where_they_are() -> (
    None
):
    """A /health answer slower than the poll timeout (an engine's API loop busy a moment)
    takes the worker out of new routing, but the generations it works on are no reason to
    run again elsewhere: it fails over only after `FAIL_OVER_AFTER_FAILED_CHECKS`."""
    release = asyncio.Event()

    async def slow(request: Request, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # a non-streamed generation: its head comes at its end
        await answer_ok(request, writer)

    async with (
        scripted_worker(slow) as busy,
        scripted_worker() as good,
        router_in_process(
            workers=[busy.url, good.url], policy="round_robin", health_interval_s=0.1
        ) as rt,
    ):
        await routable(rt, busy.url, good.url)
        worker = rt.replica.workers.get(busy.url)
        assert worker is not None
        request = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
        await eventually(lambda: len(busy.posts()) == 1)
        busy.failing_checks = 1
        await eventually(lambda: not worker.healthy)
        await eventually(lambda: worker.healthy)  # the next check passed
        release.set()
        status, _, _ = await request
        assert status == 200
        assert len(busy.posts()) == 1 and good.posts() == []  # run once, where it was
        assert rt.plane.metrics.upstream_failures[busy.url, "worker_down"] == 0
        assert worker.breaker.consecutive_failures == 0


# -- item 5: health probes off the event loop -----------------------------------------------


async def test_a_probe_on_a_new_connection_is_answered_while_the_event_loop_is_blocked() -> None:
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        door = rt.plane.doors[0]
        await eventually(lambda: door.published.answers[b"/readyz"][0] == 200, 10)
        host, port = rt.plane.addresses[0]
        answers: list[bytes] = []
        answered = threading.Event()

        def kubelet() -> None:
            with socket.create_connection((host, port), timeout=5) as sock:
                sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: k\r\nConnection: close\r\n\r\n")
                answer = b""
                while data := sock.recv(4096):
                    answer += data
            answers.append(answer)
            answered.set()

        threading.Thread(target=kubelet, daemon=True).start()
        # The loop is held (as a saturated loop is, for a turn) until the probe is answered.
        assert answered.wait(5), "the probe waited for the event loop"
        assert answers[0].startswith(b"HTTP/1.1 200 OK\r\n") and answers[0].endswith(
            b'{"ready":true}'
        )
        assert door.answered == 1 and door.from_heartbeat == 1
        assert rt.plane.connections == set()  # the loop never saw the connection
        # A keep-alive probe is answered by the door, then the loop serves the connection.
        client = await RawClient.open(rt.url)
        client.send(b"GET /healthz HTTP/1.1\r\nHost: k\r\n\r\n")
        assert (await client.answer()).status == 200  # type: ignore[union-attr]
        await eventually(lambda: len(rt.plane.connections) == 1, 5)
        client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: k\r\nContent-Length: %d\r\n\r\n%s"
            % (len(COMPLETION), COMPLETION)
        )
        assert (await client.answer()).status == 200  # type: ignore[union-attr]
        assert door.answered == 2 and (await fw.state())["requests"] == 1


@pytest.mark.parametrize(
    "field",
    [
        b"Content-Length : %d",  # whitespace before the colon
        b"X-A: a\r\n Transfer-Encoding: chunked",  # an obs-fold line hiding the framing
        b" Content-Length: %d",  # whitespace at a line's start
        b"X-A: a\nContent-Length: %d",  # a bare LF
        b"X-A: a\x01Content-Length: %d",  # a control byte
    ],
)
async def test_a_probe_head_the_loops_parser_refuses_is_a_400_and_a_close_never_served(
    field: bytes,
) -> None:
    """The door answered these heads 200 and handed the connection on idle, so the bytes after
    them (what a lenient front proxy took for this request's body) were served as a request
    of their own; the loop's parser refuses each one."""
    smuggled = b"GET /workers HTTP/1.1\r\nHost: r\r\n\r\n"
    if b"%d" in field:
        field %= len(smuggled)
    async with router_in_process() as rt:
        door = rt.plane.doors[0]
        client = await RawClient.open(rt.url)
        client.send(b"GET /healthz HTTP/1.1\r\nHost: r\r\n" + field + b"\r\n\r\n")
        refused = await client.answer()
        assert refused is not None and refused.status == 400
        assert b"malformed HTTP request" in refused.body
        with contextlib.suppress(ConnectionError):  # what a front proxy sends next
            client.send(smuggled)
        await client.closed()
        assert bytes(client.raw).count(b"HTTP/1.1 ") == 1  # its one answer, no other
        assert door.answered == 0 and rt.plane.stats.closed["malformed"] == 1


# -- section 4: timeouts and limits -----------------------------------------------------------


async def test_a_head_not_finished_in_time_is_a_counted_408_and_a_close() -> None:
    async with router_in_process(client_header_timeout_s=0.2) as rt:
        client = await RawClient.open(rt.url)
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")  # and nothing more
        answer = await client.answer()
        assert answer is not None and answer.status == 408
        assert await client.closed()
        silent = await RawClient.open(rt.url)  # a connection that never sends a byte
        assert await silent.closed()
        assert rt.plane.stats.closed["head_timeout"] == 2
        # Each 408 is a request the router refused itself; no head parsed, so no route.
        assert rt.plane.metrics.requests["other", "none", "408"] == 2


async def test_a_body_not_finished_in_time_is_a_counted_408_and_a_close() -> None:
    async with router_in_process(client_body_timeout_s=0.2) as rt:
        client = await RawClient.open(rt.url)
        client.send(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 50\r\n\r\n{")
        answer = await client.answer()
        assert answer is not None and answer.status == 408
        assert await client.closed()
        assert rt.plane.stats.closed["body_timeout"] == 1
        assert rt.plane.metrics.requests["/v1/completions", "none", "408"] == 1


async def test_an_idle_client_connection_is_closed_after_the_keep_alive_timeout() -> None:
    async with router_in_process(keepalive_timeout_s=0.2) as rt:
        client = await RawClient.open(rt.url)
        client.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await client.answer()).status == 200  # type: ignore[union-attr]
        assert await client.closed()
        assert rt.plane.stats.closed["idle"] == 1
        assert len(rt.plane.connections) == 0


async def test_an_answer_slower_than_every_client_timeout_is_relayed_whole() -> None:
    """While a request is answered its connection owes nothing: the head deadline armed when
    it connected passes meanwhile, and the answer still arrives and the connection stays."""

    async def slow(request: Request, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.6)
        writer.write(respond(200, b'{"ok": true}'))

    timeouts = {"client_header_timeout_s": 0.2, "client_body_timeout_s": 0.2}
    async with (
        scripted_worker(slow) as w,
        router_in_process(workers=[w.url], keepalive_timeout_s=0.2, **timeouts) as rt,
    ):
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.status == 200 and answer.complete
        assert rt.plane.stats.closed == {}
        assert await client.closed()  # then idle past the keep-alive timeout
        assert rt.plane.stats.closed == {"idle": 1}


async def test_an_unreachable_worker_connect_times_out_and_fails_over() -> None:
    # A listener whose accept queue is full: the kernel drops further SYNs, connect hangs.
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    try:
        async with (
            scripted_worker() as hidden,
            scripted_worker() as good,
            router_in_process(
                workers=[hidden.url, good.url],
                policy="round_robin",
                health_interval_s=60,
                upstream_connect_timeout_s=0.3,
            ) as rt,
        ):
            await routable(rt, hidden.url, good.url)
            # Point the healthy-looking worker's pool at the full listener.
            pool = rt.plane.pool_for(hidden.url)
            pool._port = port
            status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
            assert status == 200
            assert hidden.posts() == [] and len(good.posts()) == 1
            assert (await rt.scrape()).value(
                "kvrouter_upstream_failures_total", worker=hidden.url, reason="connect"
            ) == 1
    finally:
        for s in [*fillers, full]:
            s.close()


async def test_a_worker_without_a_head_in_time_is_failed_over_and_counted() -> None:
    async def never(request: Request, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    async with (
        scripted_worker(never) as slow,
        scripted_worker() as good,
        router_in_process(
            workers=[slow.url, good.url], policy="round_robin", upstream_head_timeout_s=0.3
        ) as rt,
    ):
        await routable(rt, slow.url, good.url)
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        assert len(slow.posts()) == 1 and len(good.posts()) == 1
        await eventually(
            lambda: 0 in slow.closed_by_peer or slow.posts()[0].connection in slow.closed_by_peer
        )
        worker = rt.replica.workers.get(slow.url)
        assert worker is not None and worker.breaker.consecutive_failures == 1
        assert (await rt.scrape()).value(
            "kvrouter_upstream_failures_total", worker=slow.url, reason="timeout"
        ) == 1


BUSY = b'{"error": {"message": "the engine is overloaded", "type": "overloaded"}}'


async def answer_busy(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(respond(503, BUSY, b"Retry-After: 7", b"Content-Type: application/json"))


async def test_a_5xx_from_the_last_rank_is_relayed_with_its_retry_after_and_body() -> None:
    async with (
        scripted_worker(answer_busy) as a,
        scripted_worker(answer_busy) as b,
        router_in_process(
            workers=[a.url, b.url], policy="round_robin", expose_route_headers=True
        ) as rt,
    ):
        await routable(rt, a.url, b.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.complete
        assert answer.status == 503
        assert answer.header(b"Retry-After") == b"7"
        assert answer.body == BUSY
        # round_robin tried a, failed over to b, the last rank, whose own answer this is.
        assert answer.header(b"X-Kvrouter-Worker") == b.url.encode()
        assert len(a.posts()) == 1 and len(b.posts()) == 1
        for w in (a, b):  # both breakers heard of the failure, both attempts are counted
            worker = rt.replica.workers.get(w.url)
            assert worker is not None and worker.breaker.consecutive_failures == 1
            assert rt.plane.metrics.upstream_failures[w.url, "status"] == 1
        scrape = await rt.scrape()
        requests = {
            (labels["worker"], labels["status"]): scrape.value("kvrouter_requests_total", **labels)
            for labels in scrape.names("kvrouter_requests_total")
        }
        assert requests == {(b.url, "503"): 1}  # counted as the 503 it is, none as a 502
        await eventually(lambda: rt.replica.inflight.total == 0)
        # The answer ended cleanly: the client's connection serves the next request.
        client.send(post(b"/v1/completions", COMPLETION))
        again = await client.answer()
        assert again is not None and again.status == 503 and again.body == BUSY
        client.close()


async def test_a_5xx_followed_by_a_200_from_the_next_rank_is_the_200() -> None:
    async with (
        scripted_worker(answer_busy) as busy,
        scripted_worker() as good,
        router_in_process(workers=[busy.url, good.url], policy="round_robin") as rt,
    ):
        await routable(rt, busy.url, good.url)
        status, body, headers = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert (status, body) == (200, {"ok": True})
        assert "Retry-After" not in headers
        assert len(busy.posts()) == 1 and len(good.posts()) == 1
        assert rt.plane.metrics.upstream_failures[busy.url, "status"] == 1
        # Its answer dropped unread, with its connection.
        await eventually(lambda: busy.posts()[0].connection in busy.closed_by_peer)


async def never_answer(request: Request, writer: asyncio.StreamWriter) -> None:
    await asyncio.Event().wait()


async def close_unanswered(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.close()


@pytest.mark.parametrize(
    ("script", "failure"),
    [
        (None, "connect"),  # stopped: refused
        (never_answer, "timeout"),
        (answer_busy, "status"),
        (close_unanswered, "lost"),
    ],
)
async def test_a_failing_multi_rank_worker_costs_one_attempt_not_one_per_rank(
    script: Script | None, failure: str
) -> None:
    """Its ranks share its host, port and engine: a request fails over to another worker at
    once (it tried three of the failing worker's four ranks in turn, a 502 or three head
    timeouts though another worker was healthy)."""
    async with (
        scripted_worker(script or answer_ok) as bad,
        scripted_worker() as good,
        router_in_process(
            workers=[bad.url, good.url],
            policy="round_robin",
            dp_size=4,
            health_interval_s=60,
            upstream_head_timeout_s=0.3,
            expose_route_headers=True,
        ) as rt,
    ):
        await routable(rt, bad.url, good.url)
        if script is None:
            await bad.stop()
        for _ in range(2):  # round_robin starts each request at another of bad's ranks
            status, _, headers = await rt.post("/v1/completions", json.loads(COMPLETION))
            assert status == 200 and headers["X-Kvrouter-Worker"] == good.url
        assert len(bad.posts()) == (0 if script is None else 2)
        assert len(good.posts()) == 2
        assert rt.plane.metrics.upstream_failures[bad.url, failure] == 2


async def test_a_failed_attempt_with_only_the_failing_workers_ranks_left_says_none_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its other ranks are passed over, so none is left to try: the warning said "failing
    over" (it counted them), and the client got a 502 right after."""
    async with (
        scripted_worker(answer_ok) as bad,
        router_in_process(
            workers=[bad.url], policy="round_robin", dp_size=2, health_interval_s=60
        ) as rt,
    ):
        await routable(rt, bad.url)
        await bad.stop()
        with caplog.at_level(logging.WARNING, logger="router.dataplane.relay"):
            status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 502
        said = [r.getMessage() for r in caplog.records if r.name == "router.dataplane.relay"]
        assert len(said) == 1 and "; no rank left (" in said[0], said


async def test_a_worker_failing_every_request_is_one_warning_a_minute_not_one_an_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every worker answering 503: 1,000 requests wrote 2,965 warnings, one an attempt. Each
    worker's are said once a minute, with how many there were since."""
    async with (
        scripted_worker(answer_busy) as a,
        scripted_worker(answer_busy) as b,
        router_in_process(workers=[a.url, b.url], policy="round_robin") as rt,
    ):
        await routable(rt, a.url, b.url)
        with caplog.at_level(logging.WARNING, logger="router.dataplane.relay"):
            for _ in range(5):
                status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
                assert status == 503
        assert len(a.posts()) == len(b.posts()) == 5
        said = [r.getMessage() for r in caplog.records if r.name == "router.dataplane.relay"]
        assert len(said) == 2, said  # one a worker
        assert all("(1 failed attempt(s) on this worker since its last" in m for m in said), said
        assert rt.plane.metrics.upstream_failures[a.url, "status"] == 5


async def test_a_request_queued_for_a_removed_worker_fails_over_counted_as_removed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def slow(request: Request, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        await answer_ok(request, writer)

    async with (
        scripted_worker(slow) as leaving,
        scripted_worker() as good,
        router_in_process(
            workers=[leaving.url, good.url],
            policy="round_robin",
            upstream_connections_per_worker=1,
        ) as rt,
    ):
        await routable(rt, leaving.url, good.url)
        # round_robin: the first request holds leaving's one connection, the second goes to
        # good, the third queues for leaving's.
        holder = asyncio.create_task(rt.post("/v1/completions", json.loads(COMPLETION)))
        await eventually(lambda: len(leaving.posts()) == 1)
        assert (await rt.post("/v1/completions", json.loads(COMPLETION)))[0] == 200
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        pool = rt.plane.pools[leaving.url]
        await eventually(lambda: len(pool.waiting) == 1)
        with caplog.at_level(logging.WARNING, logger="router.dataplane.relay"):
            assert await rt.replica.workers.remove(leaving.url)
            answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert len(leaving.posts()) == 1 and len(good.posts()) == 2
        # Under worker="removed", as every count of a worker that left (`_worker_label`).
        assert rt.plane.metrics.upstream_failures["removed", "removed"] == 1
        assert rt.plane.metrics.upstream_failures["removed", "worker_down"] == 0
        said = [r.getMessage() for r in caplog.records if r.name == "router.dataplane.relay"]
        assert len(said) == 1 and "was removed from the registry" in said[0], said
        release.set()
        assert (await holder)[0] == 200
        client.close()


async def test_a_lone_workers_500_is_relayed_with_its_body() -> None:
    async def broken(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(respond(500, b'{"detail": "CUDA error"}', b"Content-Type: application/json"))

    async with one_worker_and_a_client(broken) as (w, rt, client):
        client.send(post(b"/v1/completions", COMPLETION))
        answer = await client.answer()
        assert answer is not None and answer.complete
        assert (answer.status, answer.body) == (500, b'{"detail": "CUDA error"}')
        assert answer.header(b"Content-Type") == b"application/json"
        assert len(w.posts()) == 1
        worker = rt.replica.workers.get(w.url)
        assert worker is not None and worker.breaker.consecutive_failures == 1
        assert rt.plane.metrics.requests["/v1/completions", w.url, "500"] == 1
        client.close()


POISON = b'{"prompt": "poison", "max_tokens": 4}'
POISONED = b'{"detail": "the engine failed on this input"}'


async def fails_on_poison(request: Request, writer: asyncio.StreamWriter) -> None:
    """An engine with an input-triggered 500: it fails on the prompt `poison`, whatever rank."""
    if b"poison" in request.body:
        writer.write(respond(500, POISONED, b"Content-Type: application/json"))
    else:
        await answer_ok(request, writer)


async def test_poison_requests_cost_two_attempts_each_and_leave_every_breaker_closed() -> None:
    """A request two workers answer 500 is taken as the cause: the second 500 is relayed, no
    third worker is asked, and no breaker counts either (six such requests opened all three
    breakers, at three attempts each)."""
    async with (
        scripted_worker(fails_on_poison) as a,
        scripted_worker(fails_on_poison) as b,
        scripted_worker(fails_on_poison) as c,
        router_in_process(workers=[a.url, b.url, c.url], policy="round_robin") as rt,
    ):
        await routable(rt, a.url, b.url, c.url)
        client = await RawClient.open(rt.url)
        for _ in range(6):  # twice the breakers' threshold, first attempts spread over all
            client.send(post(b"/v1/completions", POISON))
            answer = await client.answer()
            assert answer is not None and (answer.status, answer.body) == (500, POISONED)
        assert sum(len(w.posts()) for w in (a, b, c)) == 12
        for w in (a, b, c):
            worker = rt.replica.workers.get(w.url)
            assert worker is not None
            assert (worker.breaker.trips, worker.breaker.consecutive_failures) == (0, 0)
        # Every worker still takes requests, first choice or not.
        for _ in range(3):
            client.send(post(b"/v1/completions", COMPLETION))
            answer = await client.answer()
            assert answer is not None and answer.status == 200
        assert sum(len(w.posts()) for w in (a, b, c)) == 15
        client.close()


async def test_a_worker_that_500s_what_another_serves_still_trips_its_breaker() -> None:
    async def broken(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(respond(500, b'{"detail": "CUDA error"}', b"Content-Type: application/json"))

    async with (
        scripted_worker(broken) as bad,
        scripted_worker() as good,
        router_in_process(workers=[bad.url, good.url], policy="round_robin") as rt,
    ):
        await routable(rt, bad.url, good.url)
        for _ in range(10):
            status, body, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
            assert (status, body) == (200, {"ok": True})
        assert len(bad.posts()) == 3  # the breaker's threshold; its cooldown outlasts the test
        assert len(good.posts()) == 10
        worker = rt.replica.workers.get(bad.url)
        assert worker is not None and worker.breaker.trips == 1
        assert rt.plane.metrics.upstream_failures[bad.url, "status"] == 3


async def assert_lost_and_failed_over(script: Script) -> None:
    """A worker answering as `script` does is a lost answer: the next rank answers the client,
    the breaker and the failure metric count it, and its connection is never reused."""
    async with (
        scripted_worker(script) as bad,
        scripted_worker() as good,
        router_in_process(workers=[bad.url, good.url], policy="round_robin") as rt,
    ):
        await routable(rt, bad.url, good.url)
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200
        assert len(bad.posts()) == 1 and len(good.posts()) == 1
        worker = rt.replica.workers.get(bad.url)
        assert worker is not None and worker.breaker.consecutive_failures == 1
        assert (await rt.scrape()).value(
            "kvrouter_upstream_failures_total", worker=bad.url, reason="lost"
        ) == 1
        assert rt.plane.pools[bad.url].total == 0  # that connection is never reused


async def test_a_worker_head_over_the_bound_is_a_lost_answer_and_fails_over() -> None:
    async def endless_head(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(MAX_ANSWER_HEAD_BYTES // 1024 + 2):  # field lines, never the blank line
            writer.write(b"X-Pad: " + b"a" * 1015 + b"\r\n")
            await writer.drain()
        await asyncio.Event().wait()

    await assert_lost_and_failed_over(endless_head)


async def test_a_worker_head_crossing_the_bound_in_the_read_that_ends_it_is_lost() -> None:
    """The bound counts a head however the reads fell: one that ends in the read crossing
    64 KiB (one write of the whole answer) is refused like one still growing past it."""

    async def big_head(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_ANSWER_HEAD_BYTES + 400) + b"\r\n"
            b"Content-Length: 2\r\n\r\n{}"
        )

    await assert_lost_and_failed_over(big_head)


CHUNKED_ANSWER = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    ("answer", "extra", "body"),
    [
        (CHUNKED_ANSWER, b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nSECOND", b"{}"),
        (respond(200, b"{}"), b"GARBAGE", b"{}"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n",
            b"junk\r\n",
            b"data: [DONE]\n\n",
        ),
    ],
)
async def test_bytes_after_a_complete_answer_are_dropped_with_the_worker_connection(
    answer: bytes, extra: bytes, body: bytes
) -> None:
    """RFC 9112 6.3: what a worker sends after a complete answer is no part of it. The
    answer reaches the client whole and its connection stays open; only the worker's
    connection is dropped (it is out of step). Arriving in the same read as the answer, the
    bytes used to turn it into a cut stream (no last chunk, an error event after [DONE])."""

    async def script(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(answer + extra if request.index_on_connection == 0 else respond(200, b"{}"))

    async with (
        scripted_worker(script) as w,
        router_in_process(workers=[w.url]) as rt,
    ):
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        got = await client.answer()
        assert got is not None and got.status == 200 and got.complete
        assert got.body == body and b"error" not in got.body
        client.send(post(b"/v1/completions", COMPLETION))  # the client's connection stays
        again = await client.answer()
        assert again is not None and again.status == 200
        posts = w.posts()
        assert posts[0].connection != posts[1].connection  # the worker's was not reused
        assert rt.plane.stats.ended["cut"] == 0
        client.close()


@pytest.mark.parametrize("status", [b"099", b"000"])
async def test_a_worker_status_below_100_is_lost_and_fails_over_not_taken_for_a_1xx(
    status: bytes,
) -> None:
    """A complete answer with a status below 100 was skipped as an interim 1xx: its request
    waited for a head until --upstream-head-timeout-s (300 s by default)."""

    async def odd(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %s Odd\r\nContent-Length: 2\r\n\r\n{}" % status)

    await assert_lost_and_failed_over(odd)


async def test_a_worker_answer_in_a_transfer_coding_never_offered_is_lost_and_fails_over() -> None:
    async def gzipped(request: Request, writer: asyncio.StreamWriter) -> None:
        body = gzip.compress(b'{"choices": []}')
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: gzip, chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        await writer.drain()

    # The client never gets gzip bytes under a plain chunked label: the next rank answers.
    await assert_lost_and_failed_over(gzipped)


async def test_a_stream_idle_too_long_is_cut_with_an_error_event() -> None:
    async def stall(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nb\r\ndata: one\n\n\r\n"
        )
        await writer.drain()
        await asyncio.Event().wait()

    async with one_worker_and_a_client(stall, stream_idle_timeout_s=0.3) as (_, rt, client):
        client.send(post(b"/v1/completions", STREAM))
        await client.closed()
        answer = await client.answer()
        assert answer is not None and not answer.complete
        assert b'"error"' in answer.body and b"no byte from the worker" in answer.body
        assert rt.replica.inflight.total == 0


async def test_connections_over_the_maximum_are_refused_with_a_503_and_few_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with router_in_process(max_connections=3) as rt:
        held = [await RawClient.open(rt.url) for _ in range(3)]
        await eventually(lambda: len(rt.plane.connections) == 3)
        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                extra = await RawClient.open(rt.url)
                answer = await extra.answer()
                assert answer is not None and answer.status == 503
                assert await extra.closed()
        assert rt.plane.stats.connections_refused == 20
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
        # The held ones still work.
        held[0].send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await held[0].answer()).status == 200  # type: ignore[union-attr]
        for client in held:
            client.close()


async def test_no_healthy_worker_and_too_many_connections_are_503s_saying_retry_after_1() -> None:
    """They carried none, where its other 503s say `Retry-After: 1`: a client honouring it (the
    openai SDK) fell back to its own backoff."""
    async with router_in_process(max_connections=1) as rt:  # no worker at all
        held = await RawClient.open(rt.url)
        held.send(post(b"/v1/completions", COMPLETION))
        answer = await held.answer()
        assert answer is not None and answer.status == 503
        assert b"no healthy worker" in answer.body
        assert answer.header(b"Retry-After") == b"1"
        extra = await RawClient.open(rt.url)  # past the maximum: held is the one
        refused = await extra.answer()
        assert refused is not None and refused.status == 503
        assert b"too many connections" in refused.body
        assert refused.header(b"Retry-After") == b"1"
        assert rt.plane.stats.connections_refused == 1
        held.close()


async def test_a_client_sending_a_body_past_the_maximum_reads_its_503_not_a_reset() -> None:
    """Closed at once with the body unread, the refused connection was reset, and a client
    still sending (urllib, a 5 MB POST) saw `Connection reset by peer` instead of the 503."""
    async with router_in_process(max_connections=1) as rt:
        held = await RawClient.open(rt.url)
        await eventually(lambda: len(rt.plane.connections) == 1)
        host, port = rt.url.removeprefix("http://").rsplit(":", 1)

        def send_all_then_read() -> bytes:
            # As urllib does: the whole request sent (blocking) before reading.
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(post(b"/v1/completions", b"x" * (4 * 1024 * 1024)))
                return sock.recv(65536)

        answer = await asyncio.to_thread(send_all_then_read)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert rt.plane.stats.connections_refused == 1
        held.close()


async def test_a_kept_alive_probe_the_door_answered_gets_no_503_after_it_at_the_maximum() -> None:
    """The door answers a probe on a new connection and hands it on to the loop when it asked
    for keep-alive; at the maximum the loop refused it with a 503, which a keep-alive prober
    would read as the answer to its next probe."""
    async with router_in_process(max_connections=1) as rt:
        held = await RawClient.open(rt.url)
        await eventually(lambda: len(rt.plane.connections) == 1)
        probe = await RawClient.open(rt.url)
        probe.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = await probe.answer()
        assert answer is not None and answer.status == 200
        assert await probe.closed()
        assert bytes(probe.raw).count(b"HTTP/1.1 ") == 1
        assert rt.plane.stats.connections_refused == 0
        held.close()


async def test_the_control_port_has_the_head_timeout_and_a_connection_bound_of_its_own() -> None:
    """It was a plain aiohttp site: half-open heads were held forever and nothing bounded its
    connections, so a flood on it (no token needed to open one) took the replica's file
    descriptors. Now the data plane listens there too, handing every path to the control
    app, with the same timeouts and `CONTROL_MAX_CONNECTIONS`, apart from the client port's."""
    port = free_tcp_port()
    async with router_in_process(control_port=port, client_header_timeout_s=0.3) as rt:
        control = f"http://127.0.0.1:{port}"
        slow = await RawClient.open(control)
        slow.send(b"GET /workers HTTP/1.1\r\nHo")
        answer = await slow.answer(within_s=5)
        assert answer is not None and answer.status == 408
        assert await slow.closed()
        # Each asks at once and stays, idle between requests: a connection that has sent
        # nothing meets the 0.3 s head timeout, which the opens of the others may outlast on a
        # loaded machine, so the bound would never be reached.
        held = []
        for _ in range(server.CONTROL_MAX_CONNECTIONS):
            held.append(client := await RawClient.open(control))
            client.send(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        answers = await asyncio.gather(*(client.answer() for client in held))
        assert {a.status for a in answers if a is not None} == {200}
        await eventually(
            lambda: len(rt.plane.control_connections) == server.CONTROL_MAX_CONNECTIONS, 10
        )
        extra = await RawClient.open(control)
        refused = await extra.answer()
        assert refused is not None and refused.status == 503
        # The client port is not touched by it, and the control port serves its paths only.
        main = await RawClient.open(rt.url)
        main.send(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n")
        models = await main.answer()
        assert models is not None and models.status == 200
        for client in (*held, extra, main):
            client.close()
        again = await RawClient.open(control)
        await eventually(lambda: len(rt.plane.control_connections) <= 1, 10)
        again.send(post(b"/v1/completions", COMPLETION))
        not_here = await again.answer()
        assert not_here is not None and not_here.status in (404, 405)
        again.close()


async def test_too_many_or_too_large_header_fields_are_431() -> None:
    async with router_in_process(max_header_count=10, max_head_bytes=4096) as rt:
        many = await RawClient.open(rt.url)
        many.send(
            b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(11)) + b"\r\n"
        )
        assert (await many.answer()).status == 431  # type: ignore[union-attr]
        assert await many.closed()
        large = await RawClient.open(rt.url)
        large.send(b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        assert (await large.answer()).status == 431  # type: ignore[union-attr]
        # A value that never ends, sent a piece at a time: refused once past the bound.
        endless = await RawClient.open(rt.url)
        endless.send(b"GET /healthz HTTP/1.1\r\nX-Endless: ")
        # Until its head ends this may be a probe, which the door (reading at most 4 KiB of it,
        # tests/unit/test_door.py) holds for FIRST_BYTES_WAIT_S before the loop gets it; from
        # then on the loop's parser bounds it. (Counted from here, `sent` is not what the
        # kernel took while the door's thread waited for a core.)
        await eventually(lambda: len(rt.plane.connections) == 1, 5)
        answered = asyncio.create_task(endless.answer())
        sent = 0
        with contextlib.suppress(ConnectionError):  # the replica closed after its answer
            while not answered.done() and sent < 1_000_000:
                endless.send(b"b" * 1000)
                sent += 1000
                await endless.writer.drain()
                await asyncio.sleep(0)  # a turn of the loop for the replica, not a timed wait
        answer = await answered
        assert answer is not None and answer.status == 431
        assert sent < 100_000  # refused near the 4 KiB bound, not after a megabyte


async def test_a_malformed_request_line_is_a_400_and_a_close() -> None:
    async with router_in_process() as rt:
        client = await RawClient.open(rt.url)
        client.send(b"BLAH\x00 / HTTP/1.1\r\n\r\n")
        answer = await client.answer()
        assert answer is not None and answer.status == 400
        assert await client.closed()
        smuggle = await RawClient.open(rt.url)
        smuggle.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        assert (await smuggle.answer()).status == 400  # type: ignore[union-attr]


# -- backpressure ------------------------------------------------------------------------


async def test_a_client_that_does_not_read_holds_the_worker_back_not_the_routers_memory() -> None:
    total, piece = 96 * 1024 * 1024, 1024 * 1024
    sent = 0

    async def flood(request: Request, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * piece
        while sent < total:
            writer.write(block)
            await writer.drain()
            sent += piece

    async with scripted_worker(flood) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION))
        await eventually(lambda: reading_held(rt, w.url), 10)
        (conn,) = rt.plane.connections
        assert conn.transport is not None
        # The worker is held back by the kernel's buffers and the router's small one.
        assert conn.transport.get_write_buffer_size() <= 1024 * 1024
        held_at = sent
        logging.getLogger(__name__).info("the worker was held at %d MiB", held_at >> 20)
        assert held_at < total // 3
        answer = await client.answer(within_s=60)
        assert answer is not None and answer.complete and len(answer.body) == total
        client.close()


FLOOD_BYTES, FLOOD_PIECE = 24 * 1024 * 1024, 256 * 1024


async def chunked_flood(request: Request, writer: asyncio.StreamWriter) -> None:
    """A chunked answer of `FLOOD_BYTES`, written as fast as it is taken."""
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(FLOOD_BYTES // FLOOD_PIECE):
        writer.write(b"%x\r\n%s\r\n" % (FLOOD_PIECE, b"x" * FLOOD_PIECE))
        await writer.drain()
    writer.write(b"0\r\n\r\n")


async def test_a_stream_its_client_holds_back_is_not_timed_as_an_idle_worker() -> None:
    """The stream idle gap times the worker: while the router stops reading it because the
    client does not read, the worker is not idle, and the answer must not be cut for it."""
    async with one_worker_and_a_client(chunked_flood, stream_idle_timeout_s=0.2) as (w, rt, client):
        client.send(post(b"/v1/completions", COMPLETION))

        def held() -> list[UpstreamConnection]:
            pool = rt.plane.pools.get(w.url)
            return [
                c
                for c in (pool.busy if pool is not None else ())
                if c.transport is not None and not c.transport.is_reading()
            ]

        await eventually(held, 10)
        (conn,) = held()
        assert not conn.deadline_pending  # no idle gap timed while held
        await asyncio.sleep(0.5)  # the client reads nothing for longer than the idle gap
        answer = await client.answer(within_s=60)
        assert answer is not None and answer.complete and len(answer.body) == FLOOD_BYTES
        assert rt.plane.stats.ended["cut"] == 0
        client.close()


async def sse_forever(request: Request, writer: asyncio.StreamWriter) -> None:
    """A streamed SSE answer that never ends: 1 KiB events as fast as they are taken."""
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    event = b'data: {"text": "%s"}\n\n' % (b"x" * 1000)
    while True:
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()


async def test_a_client_that_stops_reading_is_cut_and_frees_its_worker_connection() -> None:
    """A streaming client that never reads held its connection to the worker for good: with
    one connection per worker, every other request waited for it in vain (a 503)."""
    async with one_worker_and_a_client(
        sse_forever, client_write_timeout_s=0.5, upstream_connections_per_worker=1
    ) as (w, rt, stuck):
        stuck.send(post(b"/v1/completions", STREAM))  # and never reads
        await eventually(lambda: reading_held(rt, w.url), 10)
        await eventually(lambda: rt.plane.stats.closed["write_timeout"] == 1, 10)
        assert await stuck.closed()
        # Its upstream request was aborted: the worker saw the close, the pool has its slot.
        await eventually(lambda: w.posts()[0].connection in w.closed_by_peer, 5)
        pool = rt.plane.pools[w.url]
        assert not pool.busy and not pool.waiting
        assert rt.plane.stats.ended["gone"] == 1
        w.script = answer_ok
        status, _, _ = await rt.post("/v1/completions", json.loads(COMPLETION))
        assert status == 200 and len(w.posts()) == 2
        stuck.close()


async def open_small_window(
    rt: RouterHandle, receive_buffer: int = 4096, send_buffer: int | None = 64 * 1024
) -> tuple[RawClient, server.ClientConnection]:
    """A client with a small receive buffer, and its connection in the replica with the send
    buffer of a network path (loopback's grows to 4 MiB and takes whole answers in), or
    loopback's own (`send_buffer` None)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    host, port = rt.url.removeprefix("http://").rsplit(":", 1)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    client = RawClient(*await asyncio.open_connection(sock=sock))
    await eventually(lambda: rt.plane.connections)
    (conn,) = rt.plane.connections
    assert conn.transport is not None
    if send_buffer is not None:
        conn.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer
        )
    return client, conn


async def test_a_connection_closed_idle_with_its_last_answer_unread_goes_at_the_write_timeout() -> (
    None
):
    """A close waits for the write buffer to be sent: a client that took its answer's head
    and nothing more, then idled past the keep-alive timeout, kept its socket and buffer."""
    body = b"x" * 300_000

    async def big(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(respond(200, body, b"Content-Type: application/json"))

    async with (
        scripted_worker(big) as w,
        router_in_process(
            workers=[w.url], keepalive_timeout_s=0.2, client_write_timeout_s=0.5
        ) as rt,
    ):
        await routable(rt, w.url)
        client, conn = await open_small_window(rt)
        client.send(post(b"/v1/completions", COMPLETION))  # and never reads
        await eventually(lambda: rt.plane.stats.closed["idle"] == 1, 10)
        assert conn.write_paused  # its answer was relayed whole, and is still unsent
        await eventually(lambda: not rt.plane.connections, 10)
        assert rt.plane.stats.closed == {"idle": 1}  # each connection counted once
        client.close()


async def test_a_client_that_does_not_read_big_sse_events_costs_a_bounded_share_of_memory() -> None:
    """Events of 1,000,000 B (a vLLM `echo` of a long prompt) were held whole, up to 1 MiB,
    then written whole past the write buffer's mark: ~1 MB of the router's memory for each
    client that does not read (300 of them: RSS 52 -> 319 MB)."""
    event = b'data: {"text": "%s"}\n\n' % (b"x" * 1_000_000)

    async def big_events(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(4):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        await asyncio.Event().wait()  # the stream goes on, silent

    async with scripted_worker(big_events) as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        client, conn = await open_small_window(rt)
        client.send(post(b"/v1/completions", STREAM))  # and never reads
        await eventually(lambda: reading_held(rt, w.url), 10)
        # README "Memory": the event held (64 KiB at most), the write buffer's high-water mark
        # (64 KiB) and the upstream read that went past it (256 KiB at most).
        kept = conn.transport.get_write_buffer_size()
        assert kept <= 384 * 1024, kept
        client.close()


async def test_a_slow_client_that_keeps_reading_is_not_cut_for_its_paused_writes() -> None:
    total, piece = FLOOD_BYTES, FLOOD_PIECE
    async with one_worker_and_a_client(chunked_flood, client_write_timeout_s=1.0) as (
        w,
        rt,
        client,
    ):
        client.send(post(b"/v1/completions", COMPLETION))
        await eventually(lambda: reading_held(rt, w.url), 10)  # its writes are paused
        got = bytearray()
        async with asyncio.timeout(20):
            while not got.endswith(b"\r\n0\r\n\r\n"):
                data = await client.reader.read(piece)
                assert data, "the router closed the connection"
                got += data
                await asyncio.sleep(0.02)  # reads slower than the worker writes, steadily
        assert len(got) > total and rt.plane.stats.closed["write_timeout"] == 0
        assert len(rt.plane.connections) == 1
        client.close()


async def test_a_client_reading_steadily_through_a_small_window_is_never_cut() -> None:
    """Progress was what left the router's buffer for the kernel, which wakes a writer only
    once a third or more of its send buffer is free: over loopback (a send buffer of MiBs) a
    client reading 64 KiB/s was cut at a 4 s timeout, and at 120 s one reading 200 B/s
    through a network path's 100 KB. What the client acknowledges is progress now."""
    async with (
        scripted_worker(sse_forever) as w,
        router_in_process(workers=[w.url], client_write_timeout_s=0.5) as rt,
    ):
        await routable(rt, w.url)
        client, conn = await open_small_window(rt, receive_buffer=8192, send_buffer=None)
        client.send(post(b"/v1/completions", STREAM))
        await eventually(lambda: conn.write_paused, 10)
        got = 0
        while got < 1_000_000:  # ~5 s: ten timeouts
            data = await client.reader.read(4096)
            assert data, f"the router closed the connection after {got} bytes"
            got += len(data)
            await asyncio.sleep(0.02)  # ~200 KB/s, steadily: slower than the worker writes
        assert rt.plane.stats.closed["write_timeout"] == 0
        assert conn.write_paused and rt.plane.connections == {conn}  # held back all along
        client.close()


async def test_a_worker_that_does_not_read_pauses_reading_from_the_client() -> None:
    big = b'{"prompt": "' + b"y" * (24 * 1024 * 1024) + b'", "max_tokens": 1}'
    async with (
        scripted_worker() as w,
        router_in_process(
            workers=[w.url], policy="round_robin", health_interval_s=60, max_request_bytes=len(big)
        ) as rt,
    ):
        await routable(rt, w.url)
        w.reading.clear()  # the worker stops reading its sockets
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", big))
        await eventually(lambda: any(c.gate and c.gate.paused for c in rt.plane.connections), 20)
        w.reading.set()
        answer = await client.answer(within_s=60)
        assert answer is not None and answer.status == 200
        (got,) = w.posts()
        assert got.body == big
        assert not any(c.gate and c.gate.paused for c in rt.plane.connections)
        client.close()


async def test_a_large_head_within_the_limit_is_accepted_however_it_is_split() -> None:
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], max_head_bytes=8192) as rt,
    ):
        await routable(rt, w.url)
        fields = b"".join(b"X-F%d: %s\r\n" % (i, b"v" * 1000) for i in range(6))  # ~6 KiB
        request = post(b"/v1/completions", COMPLETION, fields.rstrip(b"\r\n"))
        client = await RawClient.open(rt.url)
        for i in range(0, len(request), 700):  # reads wholly inside the head, and not
            client.send(request[i : i + 700])
            await client.writer.drain()
            await asyncio.sleep(0)  # a turn of the loop for the replica, not a timed wait
        answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert w.posts()[0].header(b"X-F5") == b"v" * 1000
        client.close()


async def test_reads_of_many_small_pipelined_heads_never_add_up_to_one_head_over_the_bound() -> (
    None
):
    """A read that began inside one head and ended inside another was counted whole against
    the second, as if it fell inside one head: 2,000 probes of 70 bytes pipelined in one
    write got 431s from about the 1,880th on (64 KiB of such reads, the default bound)."""
    probe = b"GET /healthz HTTP/1.1\r\nHost: r\r\n\r\n"
    stream = probe * 100  # 3.4 kB, in pieces that begin and end inside heads
    async with router_in_process(max_head_bytes=1024) as rt:
        client = await RawClient.open(rt.url)
        for i in range(0, len(stream), 500):
            client.send(stream[i : i + 500])
            await client.writer.drain()
            await asyncio.sleep(0)  # a turn of the loop for the replica, not a timed wait
        answers = [await client.answer() for _ in range(100)]
        assert [a.status if a else None for a in answers] == [200] * 100
        assert rt.plane.stats.closed == {} and len(rt.plane.connections) == 1
        client.close()


async def test_a_control_path_takes_any_head_the_documented_limits_allow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The control app reads what the data plane hands it under the data plane's limits
    (`--max-head-bytes`, 64 KiB by default), not aiohttp's 8190-byte lines; and logs no
    traceback for a client's head."""
    async with router_in_process() as rt:
        client = await RawClient.open(rt.url)
        with caplog.at_level(logging.ERROR):
            client.send(
                b"GET /v1/models?q=" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: t\r\n"
                b"X-Big: " + b"b" * 30_000 + b"\r\n\r\n"
            )
            answer = await client.answer()
        assert answer is not None and answer.status == 200
        assert json.loads(answer.body)["object"] == "list"
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
        client.close()


async def test_routing_past_a_turns_slice_waits_for_the_next_turn_and_every_request_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "ROUTING_SLICE_S", 0.0)  # one routing per turn of the loop
    async with scripted_worker() as w, router_in_process(workers=[w.url]) as rt:
        await routable(rt, w.url)
        clients = [await RawClient.open(rt.url) for _ in range(20)]
        for client in clients:
            client.send(post(b"/v1/completions", COMPLETION))
        answers = await asyncio.gather(*(c.answer() for c in clients))
        assert [a.status for a in answers if a] == [200] * 20
        assert len(w.posts()) == 20
        assert rt.plane.stats.routing_deferred >= 1 and rt.plane.routing_backlog == 0
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_routing_deferred_total") == rt.plane.stats.routing_deferred
        for client in clients:
            client.close()


async def test_a_partial_request_pipelined_behind_an_answer_gets_the_head_timeout_after_it() -> (
    None
):
    async with (
        scripted_worker() as w,
        router_in_process(workers=[w.url], client_header_timeout_s=0.3) as rt,
    ):
        await routable(rt, w.url)
        client = await RawClient.open(rt.url)
        client.send(post(b"/v1/completions", COMPLETION) + b"POST /v1/completions HTTP/1.1\r\nHo")
        first = await client.answer()
        assert first is not None and first.status == 200
        timed_out = await client.answer()  # the partial one is never finished
        assert timed_out is not None and timed_out.status == 408
        assert await client.closed()
        assert rt.plane.stats.closed["head_timeout"] == 1
