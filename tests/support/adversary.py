"""What the adversarial tier (`tests/adversarial/`) attacks with, and how it measures the cost.

- `stub_server`: an aiohttp app on a free loopback port, for hostile workers and siblings
  whose answers a test scripts (a body that never ends, a gzip bomb, a trickle).
- `front`: a fake worker behind a front that answers some paths itself (a hostile body, or
  a 404 for `/server_info` as real vLLM answers) and relays the rest.
- `stub_worker`: the routes a replica reads from a worker (`/server_info`, `/health`,
  `/v1/models`), plus whatever the test adds; its KV events point at a port nothing serves.
- `HealthWatch`: polls a replica's `/healthz` all through an attack and keeps every latency,
  so a test asserts the replica kept answering, not just that it is alive afterwards.
- `peak_rss`: a process's peak resident memory (VmHWM), the figure the memory rows assert.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

import aiohttp
import zmq
from aiohttp import web

from fake_kv_worker.wire import Stored, encode_sglang
from tests.support.fake_worker import FakeWorkerHandle
from tests.support.ports import free_tcp_port

MiB: Final = 1 << 20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    return _status_kib(pid, "VmHWM") * 1024


def rss(pid: int) -> int:
    return _status_kib(pid, "VmRSS") * 1024


def _status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(f"{field_name} not in /proc/{pid}/status")


@contextlib.asynccontextmanager
async def stub_server(routes: dict[tuple[str, str], Handler]) -> AsyncIterator[str]:
    """Serve `{(method, path): handler}` on 127.0.0.1; yields the base URL."""
    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def front(
    fw: FakeWorkerHandle, answers: Mapping[str, tuple[int, bytes]]
) -> AsyncIterator[str]:
    """A front for `fw` on 127.0.0.1 that answers the paths of `answers` itself (status, body)
    and relays every other request; yields its URL."""
    async with aiohttp.ClientSession() as session:

        async def handle(request: web.Request) -> web.StreamResponse:
            answer = answers.get(request.path)
            if answer is not None:
                return web.Response(status=answer[0], body=answer[1])
            async with session.request(
                request.method,
                fw.url + request.path_qs,
                data=await request.read(),
                headers={"Content-Type": request.content_type},
            ) as resp:
                headers = {k: v for k, v in resp.headers.items() if k.startswith("X-")}
                return web.Response(status=resp.status, body=await resp.read(), headers=headers)

        async with stub_server({("*", "/{tail:.*}"): handle}) as url:
            yield url


def stub_worker_routes(
    extra: dict[tuple[str, str], Handler] | None = None,
    block_size: int = 16,
    kv_port: int | None = None,
) -> dict[tuple[str, str], Handler]:
    """A worker's read-only routes; KV events at `kv_port` (a `RawPublisher`'s), else at a
    port nothing listens on."""
    kv_port = kv_port or free_tcp_port()

    async def server_info(request: web.Request) -> web.Response:
        kv = {"endpoint_host": "127.0.0.1", "endpoint_port_base": kv_port, "topic": ""}
        return web.json_response({"kv_events": {**kv, "block_size": block_size, "dp_size": 1}})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    return {
        ("GET", "/server_info"): server_info,
        ("GET", "/health"): health,
        ("GET", "/v1/models"): models,
        **(extra or {}),
    }


async def stream_forever(
    request: web.Request, chunk: bytes, total: int, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """Write `chunk` until `total` bytes or the client goes away (chunked, no length)."""
    response = web.StreamResponse(headers=headers or {})
    await response.prepare(request)
    sent = 0
    with contextlib.suppress(ConnectionError):
        while sent < total:
            await response.write(chunk)
            sent += len(chunk)
    return response


def gzip_bomb(inflated: int) -> tuple[bytes, bytes, int]:
    """(gzip header and first block, a repeatable block, blocks needed) for a gzip body of
    zeros inflating to about `inflated` bytes, made without ever holding that much."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    piece = bytes(MiB)
    head = z.compress(piece) + z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(piece) + z.flush(zlib.Z_FULL_FLUSH)
    return head, block, inflated // MiB


class RawPublisher:
    """A bound ZMQ PUB that sends whatever frames a test makes up, as a hostile engine would."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")

    def send(self, seq: int, payload: bytes, topic: bytes = b"") -> None:
        self._socket.send_multipart([topic, seq.to_bytes(8, "big", signed=True), payload])

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def batch(events: list[Stored] | None = None) -> bytes:
    """An SGLang event batch for rank 0 (no events: a probe that only moves the cursor)."""
    return encode_sglang(time.time(), events or [], 0)


def stored_chain(first_hash: int, blocks: int, block_size: int = 16) -> Stored:
    """One BlockStored of `blocks` chained blocks whose hashes start at `first_hash`.

    Block `first_hash + b` opens with two tokens spelling its number, so chains that start at
    different hashes never share a block key: N blocks sent are N blocks indexed."""
    filler = [3] * (block_size - 2)
    tokens: list[int] = []
    for g in range(first_hash, first_hash + blocks):
        tokens += [3 + g % 50_000, 3 + g // 50_000, *filler]
    return Stored(
        block_hashes=list(range(first_hash, first_hash + blocks)),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=block_size,
    )


@dataclass
class HealthWatch:
    """Polls `url`/healthz every `every_s` until stopped; every answer's latency is kept."""

    url: str
    every_s: float = 0.02
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def worst_s(self) -> float:
        return max(self.latencies, default=0.0)

    def p99_s(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[HealthWatch]:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(self._poll(session))
            try:
                yield self
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        while True:
            started = time.perf_counter()
            try:
                async with session.get(self.url + "/healthz", timeout=timeout) as resp:
                    await resp.read()
                    if resp.status != 200:
                        self.failures.append(f"HTTP {resp.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(self.every_s)
