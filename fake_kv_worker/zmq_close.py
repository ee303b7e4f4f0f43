"""Ending the fake engine's ZeroMQ context with a bound, as its own code (no router import).

libzmq's `zmq_ctx_term` can block forever under load even when every socket is closed (libzmq
issues 2586 and 2733), so term runs on a daemon thread and the caller waits a bounded time;
past it the context is left to that thread with a warning. The sockets are closed first, so
no published frame is lost, and a daemon thread never holds up the process's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import zmq

log = logging.getLogger(__name__)


async def close_context(ctx: zmq.Context, within_s: float) -> bool:
    """Term `ctx` off the loop; False (and a warning) when it did not end within `within_s`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def report(error: BaseException | None) -> None:
        if not done.done():
            done.set_result(error)

    def term() -> None:
        error: BaseException | None = None
        try:
            ctx.term()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed while term was blocked
            loop.call_soon_threadsafe(report, error)

    threading.Thread(target=term, name="fake-worker-zmq-term", daemon=True).start()
    try:
        error = await asyncio.wait_for(asyncio.shield(done), within_s)
    except TimeoutError:
        log.warning("ZeroMQ context still terminating after %.1f s; left to its thread", within_s)
        return False
    if error is not None:
        raise error
    return True
