"""SIGTERM on a real `kvrouter serve` process: stop being ready, finish what is in flight, exit 0.

A fake worker process decodes at 20 ms a token, so a 60-token stream is ~1.2 s of work in
flight when the router is told to stop; every wait is on something observable (the first SSE
event, `/readyz`, the process exit) with a bound. Both run as `cluster` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import httptools
import pytest
from aiohttp import web

from router.auth import TOKEN_ENV
from tests.support.cluster import ROUTER_READY, TEST_TOKEN, Cluster, RouterProcess
from tests.support.fake_worker import FakeWorkerHandle, wait_healthy
from tests.support.ports import free_tcp_port
from tests.support.processes import run_to_end
from tests.support.sse import assert_complete_completion, first_event, sse_data
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

DECODE_MS = 20


async def worker_and_router(
    cluster: Cluster, drain_timeout_s: float
) -> tuple[FakeWorkerHandle, RouterProcess]:
    fw = await cluster.worker("w", decode_ms_per_token=DECODE_MS)
    rt = await cluster.router("r", "--drain-timeout-s", str(drain_timeout_s), workers=[fw])
    await wait_healthy(fw)
    await rt.wait_ready(10)
    return fw, rt


async def test_sigterm_lets_an_inflight_stream_finish_then_exits_0(cluster: Cluster) -> None:
    max_tokens = 60
    drain_timeout_s = 10.0
    fw, rt = await worker_and_router(cluster, drain_timeout_s)
    loop = asyncio.get_running_loop()
    body = {"prompt": "tell me a long story", "max_tokens": max_tokens, "stream": True}
    async with rt.session.post(rt.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        raw = await first_event(resp)
        rt.child.send(signal.SIGTERM)
        signalled = loop.time()

        async def not_ready() -> bool:
            return await rt.readyz() == (503, "draining")

        await eventually(not_ready, 2, poll_s=0.01)
        assert loop.time() - signalled < 1.0
        assert rt.child.returncode is None  # draining, not gone
        # What reaches a draining replica is still served (the balancer may lag).
        status, _, _ = await rt.post("/v1/completions", {"prompt": "late", "max_tokens": 1})
        assert status == 200
        raw += await asyncio.wait_for(resp.read(), drain_timeout_s)
    status = await rt.child.wait_exit(drain_timeout_s)
    exited_after = loop.time() - signalled
    # The worker served exactly the stream and the late request, nothing retried.
    assert (await fw.state())["requests"] == 2

    assert_complete_completion(raw, max_tokens)
    assert status == 0, rt.child.output()
    assert exited_after < drain_timeout_s
    assert "drain timeout" not in rt.child.output()


async def test_an_idle_router_exits_0_promptly_on_sigterm(cluster: Cluster) -> None:
    rt = await cluster.router("idle", "--drain-timeout-s", "30", fleet_flags=False)
    loop = asyncio.get_running_loop()
    rt.child.send(signal.SIGTERM)
    started = loop.time()
    status = await rt.child.wait_exit(10)
    assert status == 0, rt.child.output()
    assert loop.time() - started < 3.0  # nothing to wait for: not the 30 s drain timeout


async def test_a_stream_longer_than_the_drain_timeout_is_cut_at_the_timeout_and_exit_is_0(
    cluster: Cluster,
) -> None:
    max_tokens = 500  # 10 s of decoding
    drain_timeout_s = 1.0
    fw, rt = await worker_and_router(cluster, drain_timeout_s)
    loop = asyncio.get_running_loop()
    body = {"prompt": "an endless story", "max_tokens": max_tokens, "stream": True}
    async with rt.session.post(rt.url + "/v1/completions", json=body) as resp:
        raw = await first_event(resp)
        rt.child.send(signal.SIGTERM)
        signalled = loop.time()
        with contextlib.suppress(aiohttp.ClientPayloadError):
            raw += await asyncio.wait_for(resp.read(), 15)
    status = await rt.child.wait_exit(15)
    exited_after = loop.time() - signalled

    async def upstream_idle() -> bool:
        return (await fw.state())["running"] == 0

    await eventually(upstream_idle, 5)  # the cut reached the worker too

    assert status == 0, rt.child.output()
    # The drain timeout plus the 1 s shutdown grace (and slack for a loaded machine), far
    # from the 10 s the stream would take.
    assert exited_after < drain_timeout_s + 4, exited_after
    assert b"[DONE]" not in raw
    assert len(sse_data(raw)) < max_tokens
    assert "drain timeout: 1 request(s) still in flight are cut" in rt.child.output()


class _Answer:
    """An answer's body, de-chunked, and whether its framing ended it."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.complete = False

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True


@pytest.mark.parametrize("version", [b"1.0", b"1.1"])
async def test_a_stream_cut_at_the_drain_timeout_ends_with_an_error_event_as_a_worker_cut_does(
    cluster: Cluster, version: bytes
) -> None:
    """Cut at the drain's end, a stream closed with no error event: over HTTP/1.0 (no chunk
    framing) a clean close, which reads as a complete answer."""
    max_tokens = 500  # 10 s of decoding
    fw, rt = await worker_and_router(cluster, drain_timeout_s=1.0)
    host, port = rt.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "an endless story", "max_tokens": %d, "stream": true}' % max_tokens
    writer.write(
        b"POST /v1/completions HTTP/%b\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (version, len(body), body)
    )
    raw = await asyncio.wait_for(
        reader.readuntil(b"\n\n\r\n" if version == b"1.1" else b"}\n\n"), 10
    )
    rt.child.send(signal.SIGTERM)
    raw += await asyncio.wait_for(reader.read(), 15)  # to the close
    writer.close()
    assert await rt.child.wait_exit(15) == 0, rt.child.output()

    answer = _Answer()
    httptools.HttpResponseParser(answer).feed_data(raw)
    assert raw.startswith(b"HTTP/1.1 200")
    if version == b"1.1":
        assert b"transfer-encoding: chunked" in raw.partition(b"\r\n\r\n")[0].lower()
        assert not answer.complete  # no last chunk: the cut shows
    events = sse_data(bytes(answer.body))
    assert b"[DONE]" not in events and 0 < len(events) < max_tokens
    error = json.loads(events[-1])["error"]
    assert error["type"] == "service_unavailable"
    assert "shut down before the answer ended" in error["message"]
    assert (await fw.state())["requests"] == 1  # nothing retried


@contextlib.asynccontextmanager
async def slow_server_info_worker() -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """A worker whose /server_info answers only when released: (url, entered, release)."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def server_info(request: web.Request) -> web.Response:
        entered.set()
        await release.wait()
        return web.json_response({"error": "not served"}, status=404)

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", entered, release
    finally:
        release.set()
        await runner.cleanup()


async def test_a_sigterm_during_start_up_is_a_drain_and_exits_0(cluster: Cluster) -> None:
    # Start-up awaits the worker's /server_info: SIGTERM while it is blocked there.
    async with slow_server_info_worker() as (url, entered, release):
        rt = await cluster.router(
            "starting", "--block-size", "16", workers=[url], fleet_flags=False, wait_listening=False
        )
        await asyncio.wait_for(entered.wait(), 15)
        rt.child.send(signal.SIGTERM)
        release.set()
        status = await rt.child.wait_exit(10)
    assert status == 0, rt.child.output()
    assert ROUTER_READY in rt.child.output()  # it finished starting, then drained at once


# A command that held the signals as the entry point does, then got SIGTERM (as one would
# while Python imports the router), then runs `kvrouter ARGS`.
SIGTERM_WHILE_IMPORTING = (
    "import os, signal, sys\n"
    "from router import launch\n"
    "launch.hold()\n"
    "os.kill(os.getpid(), signal.SIGTERM)\n"
    "launch.main(sys.argv[1:])\n"
)


async def test_a_sigterm_while_the_command_is_imported_is_a_drain_and_exits_0() -> None:
    port = free_tcp_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--drain-timeout-s", "30"]
    status, _out, err = await run_to_end(
        [sys.executable, "-c", SIGTERM_WHILE_IMPORTING, *argv],
        env={TOKEN_ENV: TEST_TOKEN},
        within_s=20,
    )
    assert status == 0, err
    assert "SIGTERM arrived during start-up: draining at once" in err
    assert "stopped" in err


async def test_another_command_ends_on_a_sigterm_held_while_it_was_imported() -> None:
    # `view` against a port nobody serves would fail (status 1) if it ran at all.
    argv = ["view", f"http://127.0.0.1:{free_tcp_port()}", "--timeout-s", "1"]
    status, _out, err = await run_to_end(
        [sys.executable, "-c", SIGTERM_WHILE_IMPORTING, *argv], within_s=20
    )
    assert status == -signal.SIGTERM, (status, err)
