"""`PollClient` over real HTTP on 127.0.0.1: answers, bounds and failures of the replica's own GETs.

Each test asserts what the caller got and what the server saw (its requests and connections).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from router.dataplane.polling import PollAnswer, PollClient, split_url
from tests.support.ports import free_tcp_port

pytestmark = pytest.mark.timeout(20)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Server:
    """One route per path; `requests` logs (path, the client's port) in order."""

    def __init__(self, routes: dict[str, Handler], keepalive_timeout: float = 75.0) -> None:
        self.routes = routes
        self.requests: list[tuple[str, int]] = []
        self.release = asyncio.Event()
        self.url = ""
        self._keepalive = keepalive_timeout
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.requests.append((request.path_qs, peer[1] if peer else 0))
        handler = self.routes.get(request.path)
        if handler is None:
            return web.Response(status=404, text="no such path")
        return await handler(request)

    async def __aenter__(self) -> Server:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=self._keepalive)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def connections(self) -> int:
        return len({port for _, port in self.requests})


@contextlib.asynccontextmanager
async def poll_client() -> AsyncIterator[PollClient]:
    f = PollClient()
    try:
        yield f
    finally:
        f.close()


def text(body: str, status: int = 200) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        return web.Response(status=status, text=body)

    return handle


def streamed(chunks: int, size: int) -> Handler:
    """A chunked body of `chunks` pieces of `size` bytes (no Content-Length)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(chunks):
            await resp.write(b"x" * size)
        await resp.write_eof()
        return resp

    return handle


async def test_an_answer_comes_whole_and_many_gets_share_one_connection() -> None:
    async with Server({"/v1/loads": text('{"loads": []}')}) as srv, poll_client() as f:
        got = [await f.get(srv.url + "/v1/loads?x=1", 1.0, 1024) for _ in range(5)]
    assert got == [PollAnswer(200, b'{"loads": []}')] * 5
    assert [path for path, _ in srv.requests] == ["/v1/loads?x=1"] * 5
    assert srv.connections == 1  # kept alive


async def test_a_status_is_the_answer_and_redirects_are_not_followed() -> None:
    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async with Server({"/gone": text("nope", 503), "/moved": moved}) as srv, poll_client() as f:
        assert await f.get(srv.url + "/missing", 1.0, 1024) == PollAnswer(404, b"no such path")
        assert await f.get(srv.url + "/gone", 1.0, 1024) == PollAnswer(503, b"nope")
        moved_to = await f.get(srv.url + "/moved", 1.0, 1024)
    assert moved_to.status == 302
    assert [path for path, _ in srv.requests] == ["/missing", "/gone", "/moved"]


@pytest.mark.parametrize("body", ["declared", "streamed"])
async def test_a_body_over_the_bound_is_dropped_with_its_connection(body: str) -> None:
    if body == "declared":
        big, whole = text("y" * 5000), b"y" * 5000
    else:
        big, whole = streamed(10, 500), b"x" * 5000
    async with Server({"/big": big, "/small": text("ok")}) as srv, poll_client() as f:
        assert await f.get(srv.url + "/big", 1.0, 4096) == PollAnswer(200, None, "too_large")
        assert await f.get(srv.url + "/big", 1.0, 5000) == PollAnswer(200, whole)
        assert await f.get(srv.url + "/small", 1.0, 4096) == PollAnswer(200, b"ok")
    assert srv.connections == 2  # the one that carried the refused body was not reused


async def test_no_answer_within_the_timeout_is_a_timeout_and_the_next_get_works() -> None:
    async with Server({}) as srv:

        async def hang(request: web.Request) -> web.Response:
            await srv.release.wait()
            return web.Response(text="late")

        srv.routes["/hang"] = hang
        srv.routes["/ok"] = text("ok")
        async with poll_client() as f:
            started = asyncio.get_running_loop().time()
            assert await f.get(srv.url + "/hang", 0.2, 1024) == PollAnswer(None, None, "timeout")
            assert asyncio.get_running_loop().time() - started < 2.0
            assert await f.get(srv.url + "/ok", 1.0, 1024) == PollAnswer(200, b"ok")
        assert srv.connections == 2  # the hung one was dropped


async def test_a_refused_connection_is_a_connection_error() -> None:
    async with poll_client() as f:
        got = await f.get(f"http://127.0.0.1:{free_tcp_port()}/v1/loads", 1.0, 1024)
    assert got == PollAnswer(None, None, "connection")


async def test_an_idle_connection_the_server_closed_is_replaced_without_an_error() -> None:
    # The server closes idle connections after 0.05 s; the fetcher's pool keeps its own for
    # 4 s: the second GET finds a dead connection (or writes into a closing one) and goes on
    # a fresh one, once, as the relay's safe retry does.
    async with Server({"/ok": text("ok")}, keepalive_timeout=0.05) as srv, poll_client() as f:
        assert await f.get(srv.url + "/ok", 1.0, 1024) == PollAnswer(200, b"ok")
        await asyncio.sleep(0.3)  # past the server's keep-alive: it closed the connection
        assert await f.get(srv.url + "/ok", 1.0, 1024) == PollAnswer(200, b"ok")
    assert srv.connections == 2


async def test_forget_closes_the_connections_to_one_origin() -> None:
    async with Server({"/ok": text("ok")}) as srv, poll_client() as f:
        await f.get(srv.url + "/ok", 1.0, 1024)
        f.forget(srv.url)
        await f.get(srv.url + "/ok", 1.0, 1024)
    assert srv.connections == 2


@pytest.mark.parametrize(
    ("url", "split"),
    [
        ("http://h:1/v1/loads", ("http://h:1", b"/v1/loads")),
        ("https://h/metrics?a=b", ("https://h", b"/metrics?a=b")),
        ("http://[::1]:80", ("http://[::1]:80", b"/")),
    ],
)
def test_split_url_gives_the_origin_and_the_target(url: str, split: tuple[str, bytes]) -> None:
    assert split_url(url) == split


@pytest.mark.parametrize("url", ["ftp://h/x", "h:1/x", "http://"])
def test_split_url_refuses_what_is_not_an_http_url(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        split_url(url)


async def test_a_get_that_timed_out_closes_its_connection_at_once() -> None:
    """The timeout cancels the future the GET waits on; its exchange was given up only when
    that future was not done, so the connection stayed open: a host that accepts and never
    answers held a descriptor per check (800 of them exhausted a 1,024 limit)."""
    closed = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    try:
        async with poll_client() as f:
            assert await f.get(url, 0.2, 1024) == PollAnswer(None, None, "timeout")
            await asyncio.wait_for(closed.wait(), 2.0)  # while the client is still open
    finally:
        server.close()
