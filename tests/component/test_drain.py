"""SIGTERM on a real `kvrouter serve` process: stop being ready, finish what is in flight, exit 0.

A fake worker subprocess decodes at 20 ms a token, so a 60-token stream is ~1.2 s of work in
flight when the router is told to stop; every wait is on something observable (the first SSE
event, `/readyz`, the process exit) with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from fake_kv_worker.protocol import filler_text
from tests.component.test_cli import (
    READY_PREFIX,
    REPO,
    Output,
    RouterProcess,
    clean_env,
    kvrouter_process,
    pump_lines,
)
from tests.support.fake_worker import fake_worker_subprocess, wait_healthy
from tests.support.ports import free_tcp_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

DECODE_MS = 20


def sse_data(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


async def first_event(resp: aiohttp.ClientResponse) -> bytes:
    """Read up to the end of the first SSE event; returns the bytes read."""
    read = b""
    while not read.endswith(b"\n\n"):
        line = await asyncio.wait_for(resp.content.readline(), 10)
        assert line, "the stream ended before its first event"
        read += line
    return read


async def until_ready(rt: RouterProcess) -> None:
    async def ready() -> bool:
        return await rt.status("/readyz") == 200

    await eventually(ready, 10, poll_s=0.02)


async def test_sigterm_lets_an_inflight_stream_finish_then_exits_0() -> None:
    max_tokens = 60
    drain_timeout_s = 10.0
    async with (
        fake_worker_subprocess(decode_ms_per_token=DECODE_MS) as fw,
        kvrouter_process(
            "--worker",
            fw.url,
            "--health-interval-s",
            "0.2",
            "--drain-timeout-s",
            str(drain_timeout_s),
        ) as rt,
    ):
        await wait_healthy(fw)
        await until_ready(rt)
        loop = asyncio.get_running_loop()
        body = {"prompt": "tell me a long story", "max_tokens": max_tokens, "stream": True}
        async with rt.session.post(rt.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            raw = await first_event(resp)
            rt.proc.send_signal(signal.SIGTERM)
            signalled = loop.time()

            async def not_ready() -> bool:
                return await rt.status("/readyz") == 503

            await eventually(not_ready, 2, poll_s=0.01)
            assert loop.time() - signalled < 1.0
            assert rt.proc.returncode is None  # draining, not gone
            # What reaches a draining replica is still served (the balancer may lag).
            async with rt.session.post(
                rt.url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}
            ) as late:
                assert late.status == 200
            raw += await asyncio.wait_for(resp.read(), drain_timeout_s)
        status = await rt.wait_exit(drain_timeout_s)
        exited_after = loop.time() - signalled
        # The worker served exactly the stream and the late request, nothing retried.
        assert (await fw.state())["requests"] == 2

    events = sse_data(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == max_tokens
    assert "".join(c["choices"][0]["text"] for c in chunks) == filler_text(max_tokens)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert status == 0, rt.stderr.text
    assert exited_after < drain_timeout_s
    assert "drain timeout" not in rt.stderr.text


async def test_an_idle_router_exits_0_promptly_on_sigterm() -> None:
    async with kvrouter_process("--drain-timeout-s", "30") as rt:
        loop = asyncio.get_running_loop()
        rt.proc.send_signal(signal.SIGTERM)
        started = loop.time()
        status = await rt.wait_exit(10)
        assert status == 0, rt.stderr.text
        assert loop.time() - started < 3.0  # nothing to wait for: not the 30 s drain timeout


async def test_a_stream_longer_than_the_drain_timeout_is_cut_at_the_timeout_and_exit_is_0() -> None:
    max_tokens = 500  # 10 s of decoding
    drain_timeout_s = 1.0
    async with (
        fake_worker_subprocess(decode_ms_per_token=DECODE_MS) as fw,
        kvrouter_process(
            "--worker",
            fw.url,
            "--health-interval-s",
            "0.2",
            "--drain-timeout-s",
            str(drain_timeout_s),
        ) as rt,
    ):
        await wait_healthy(fw)
        await until_ready(rt)
        loop = asyncio.get_running_loop()
        body = {"prompt": "an endless story", "max_tokens": max_tokens, "stream": True}
        async with rt.session.post(rt.url + "/v1/completions", json=body) as resp:
            raw = await first_event(resp)
            rt.proc.send_signal(signal.SIGTERM)
            signalled = loop.time()
            with contextlib.suppress(aiohttp.ClientPayloadError):
                raw += await asyncio.wait_for(resp.read(), 15)
        status = await rt.wait_exit(15)
        exited_after = loop.time() - signalled

        async def upstream_idle() -> bool:
            return (await fw.state())["running"] == 0

        await eventually(upstream_idle, 5)  # the cut reached the worker too

    assert status == 0, rt.stderr.text
    # The drain timeout plus the 1 s shutdown grace (and slack for a loaded machine), far
    # from the 10 s the stream would take.
    assert exited_after < drain_timeout_s + 4, exited_after
    assert b"[DONE]" not in raw
    assert len(sse_data(raw)) < max_tokens
    assert "drain timeout: 1 request(s) still in flight are cut" in rt.stderr.text


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


async def test_a_sigterm_during_start_up_is_a_drain_and_exits_0() -> None:
    # Start-up awaits the worker's /server_info: SIGTERM while it is blocked there.
    async with slow_server_info_worker() as (url, entered, release):
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_tcp_port()),
            "--block-size",
            "16",
            "--worker",
            url,
            cwd=REPO,
            env=clean_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        out, err = Output(), Output()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        readers = [
            asyncio.create_task(pump_lines(proc.stdout, out, ready)),
            asyncio.create_task(pump_lines(proc.stderr, err)),
        ]
        try:
            await asyncio.wait_for(entered.wait(), 15)
            proc.send_signal(signal.SIGTERM)
            release.set()
            status = await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await asyncio.gather(*readers, return_exceptions=True)
    assert status == 0, err.text
    assert READY_PREFIX in out.text  # it finished starting, then drained at once
