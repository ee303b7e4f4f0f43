"""A worker whose answers to generation requests are scripted bytes, and a raw HTTP client.

For the data plane's conformance tests: what real engines do only when they misbehave (close
mid-stream, answer 1xx first, send a body with neither length nor chunking, never answer) is
written here byte by byte. The worker answers `GET /health` (200, or 503 after `healthy =
False` and to the next `failing_checks`), `GET /server_info` with KV events on a port of its
own where nothing publishes (on the flags' port, a second worker on the host would be refused:
one endpoint is one engine's), and 404 to every other GET, so a replica registers it (with
`--block-size` and no KV events heard); each POST is recorded and handed to `script(request,
writer)`, which writes what it wants and may close. Requests on one connection are read in
turn (keep-alive).

`RawClient` speaks bytes over one TCP connection and reads answers with httptools, so a test
sees exactly what went over the wire: the framing, every header, a missing last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httptools

from tests.support.ports import free_tcp_port


@dataclass
class Request:
    method: bytes
    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    connection: int  # which accepted connection it came on (0, 1, ...)
    index_on_connection: int  # 0 for the first request of its connection

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n.lower() == name.lower():
                return v
        return None


Script = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


def respond(status: int, body: bytes, *headers: bytes, keep_alive: bool = True) -> bytes:
    head = b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n" % (status, len(body))
    head += b"".join(h + b"\r\n" for h in headers)
    if not keep_alive:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


async def answer_ok(request: Request, writer: asyncio.StreamWriter) -> None:
    writer.write(respond(200, b'{"ok": true}', b"Content-Type: application/json"))


class _RequestReader:
    """Parses requests from a stream, one at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[Request] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done.append(
            Request(self.parser.get_method(), self._url, self._headers, b"".join(self._body), 0, 0)
        )
        self._url, self._headers, self._body = b"", [], []


@dataclass
class ScriptedWorker:
    script: Script = answer_ok
    healthy: bool = True
    failing_checks: int = 0  # the next this many /health checks answer 503, healthy or not
    url: str = ""
    requests: list[Request] = field(default_factory=list)
    accepted: int = 0
    open_connections: int = 0
    most_open: int = 0  # the most connections open at once (health checks' included)
    answering: int = 0
    most_answering: int = 0  # the most POSTs being answered at once
    closed_by_peer: list[int] = field(default_factory=list)  # connections the router closed
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set at each POST
    server: asyncio.Server | None = None
    reading: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: reads nothing
    kv_port: int = field(default_factory=free_tcp_port)  # its /server_info's; nothing there

    def __post_init__(self) -> None:
        self.reading.set()

    async def stop(self) -> None:
        """Stop listening and drop every connection: from now on, connecting is refused."""
        await _stop(self)

    def posts(self) -> list[Request]:
        return [r for r in self.requests if r.method == b"POST"]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Requests are read as they come (a close is seen even while a script runs) and
        answered in turn."""
        number = self.accepted
        self.accepted += 1
        self.open_connections += 1
        self.most_open = max(self.most_open, self.open_connections)
        self.writers.append(writer)
        incoming: asyncio.Queue[Request | None] = asyncio.Queue()
        reading = asyncio.create_task(self._read(number, reader, incoming))
        served = 0
        try:
            while (request := await incoming.get()) is not None and not writer.is_closing():
                request.connection, request.index_on_connection = number, served
                served += 1
                await self._answer(request, writer)
        except ConnectionError:
            pass
        finally:
            reading.cancel()
            self.open_connections -= 1
            writer.close()

    async def _read(
        self, number: int, reader: asyncio.StreamReader, out: asyncio.Queue[Request | None]
    ) -> None:
        parsing = _RequestReader()
        try:
            while (await self.reading.wait()) and (data := await reader.read(65536)):
                parsing.parser.feed_data(data)
                while parsing.done:
                    out.put_nowait(parsing.done.pop(0))
        except (ConnectionError, httptools.HttpParserError):
            pass
        self.closed_by_peer.append(number)
        out.put_nowait(None)

    async def _answer(self, request: Request, writer: asyncio.StreamWriter) -> None:
        self.requests.append(request)
        if request.method == b"GET":
            if request.path == b"/health":
                status = 200 if self.healthy and not self.failing_checks else 503
                self.failing_checks = max(0, self.failing_checks - 1)
                writer.write(respond(status, b"{}"))
            elif request.path == b"/server_info":
                info = b'{"kv_events": {"endpoint_port_base": %d}}' % self.kv_port
                writer.write(respond(200, info))
            else:
                writer.write(respond(404, b"{}"))
            return
        self.arrived.set()
        self.answering += 1
        self.most_answering = max(self.most_answering, self.answering)
        try:
            await self.script(request, writer)
        finally:
            self.answering -= 1
        if not writer.is_closing():
            await writer.drain()


@contextlib.asynccontextmanager
async def scripted_worker(script: Script = answer_ok) -> AsyncIterator[ScriptedWorker]:
    worker = ScriptedWorker(script)
    server = await asyncio.start_server(worker._serve, "127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    worker.server = server
    try:
        yield worker
    finally:
        await worker.stop()


async def _stop(worker: ScriptedWorker) -> None:
    assert worker.server is not None
    worker.server.close()
    for writer in worker.writers:
        writer.transport.abort()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(worker.server.wait_closed(), 2)


@dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool  # the message ended by its own framing (not by a close)

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n.lower() == name.lower():
                return v
        return None

    def has(self, name: bytes) -> bool:
        return self.header(name) is not None


class _AnswerReader:
    """Parses a connection's answers in turn (pipelined ones included)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.head_only = False  # the answer being parsed is to a HEAD
        self.answers: list[Answer] = []
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.head_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            self.headers = []
            return
        self.status = status
        self.head_done = True
        if self.head_only:
            self._done(True)
            # The parser would wait for the declared body of a HEAD answer: start afresh.
            self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self._done(True)

    def cut(self) -> None:
        """The connection closed: what was read of an answer becomes an incomplete one."""
        if self.head_done:
            self._done(False)

    def _done(self, complete: bool) -> None:
        self.answers.append(Answer(self.status, self.headers, b"".join(self.body), complete))
        self._reset()


class RawClient:
    """One TCP connection to a server; bytes out, parsed answers in."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._parsing = _AnswerReader()
        self.eof = False
        self.raw = bytearray()  # every byte received

    @classmethod
    async def open(cls, url: str) -> RawClient:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def answer(self, head_only: bool = False, within_s: float = 10.0) -> Answer | None:
        """The next answer; None if the server closed before any byte of it."""
        parsing = self._parsing
        parsing.head_only = head_only
        async with asyncio.timeout(within_s):
            while not parsing.answers:
                if self.eof:
                    return None
                await self._read()
        return parsing.answers.pop(0)

    async def _read(self) -> None:
        try:
            data = await self.reader.read(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            self.eof = True
            self._parsing.cut()
            return
        self.raw += data
        self._parsing.parser.feed_data(data)

    async def closed(self, within_s: float = 10.0) -> bool:
        """Waits until the server closed the connection (what came first is parsed)."""
        async with asyncio.timeout(within_s):
            while not self.eof:
                await self._read()
        return True

    def close(self) -> None:
        self.writer.close()


def post(path: bytes, body: bytes, *headers: bytes, version: bytes = b"1.1") -> bytes:
    head = b"POST %s HTTP/%s\r\nHost: test\r\nContent-Type: application/json\r\n" % (path, version)
    head += b"Content-Length: %d\r\n" % len(body)
    head += b"".join(h + b"\r\n" for h in headers)
    return head + b"\r\n" + body
