"""The floor under any aiohttp router: a bare relay, measured beside kvrouter and smg.

Run: .venv/bin/python -m bench.relay_floor --port 0 --worker URL [--worker URL ...]

It does the least a router must do per request and nothing else: read the request body, POST
it to the next worker (round-robin), read the whole answer, send it back with a
Content-Length, which is the path kvrouter's proxy takes for a bounded non-streaming answer.
No tokenizing, keys, index, metrics, breaker or retries, and no KV events. Its CPU per request
at c=32 is what CPython's asyncio plus aiohttp's server and client cost on this machine before
a router decides anything, so a kvrouter row can be read as "floor + our own work", and a
target below this floor is out of reach for any router built on this stack.

It prints "relay listening on URL" once it serves, and stops on SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.proxy import HOP_BY_HOP, upstream_session

READY_PREFIX = "relay listening on "


def build_app(workers: Sequence[str]) -> web.Application:
    if not workers:
        raise ValueError("the relay needs at least one --worker")
    app = web.Application()
    upstreams = itertools.cycle([w.rstrip("/") for w in workers])
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        async with upstream_session() as session:  # kvrouter's own upstream client
            app[session_key] = session
            yield

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        url = next(upstreams) + request.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with app[session_key].post(url, data=body, headers=headers) as upstream:
            payload = await upstream.read()
            out = CIMultiDict(
                (k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP
            )
            return web.Response(body=payload, status=upstream.status, headers=out)

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    return app


async def serve(host: str, port: int, workers: Sequence[str]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(build_app(workers), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"{READY_PREFIX}http://{host}:{runner.addresses[0][1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_floor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--worker", action="append", default=[], required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.host, args.port, args.worker))


if __name__ == "__main__":
    main()
