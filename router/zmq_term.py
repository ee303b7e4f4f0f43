"""Terminating a ZeroMQ context without ever hanging the caller.

`zmq_ctx_term` returns once every socket of the context is closed and has lingered. libzmq has
a long-standing race (libzmq issues 2586 and 2733: "hangs on slow machines") in which the
reaper never reports a closed socket, and term then blocks forever although every socket is
closed. We met it about once in 40 runs of the fake worker's stream tests on a loaded 2-core
machine, and once it held a whole CI run until its 90-minute limit: term ran in the event
loop's default executor, and closing the loop joins that executor.

So term runs in a daemon thread of its own, and the caller waits for it a bounded time. Past
the bound the context is abandoned with a warning. The sockets are closed by then (callers
close their own sockets first, from the thread that used them), so what leaks is one blocked
thread and one context's I/O threads; a daemon thread never holds up interpreter exit, and the
thread keeps the context referenced, so its garbage collection never runs term again on the
thread that happens to collect it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import zmq

log = logging.getLogger(__name__)

TERM_THREAD_NAME = "zmq-term"


async def terminate_context(ctx: zmq.Context, *, within_s: float, what: str) -> bool:
    """Terminate `ctx`, waiting at most `within_s`; False (and a warning) if it did not end.

    `what` names the context's owner in the warning.
    """
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        else:
            ended.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            ctx.term()
        except BaseException as exc:  # handed to the waiting coroutine, not lost in the thread
            error = exc
        # RuntimeError: the loop closed while term blocked, and nobody waits any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name=TERM_THREAD_NAME, daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.shield(ended), within_s)
    except TimeoutError:
        log.warning(
            "%s: the ZeroMQ context did not terminate within %.1f s (a known libzmq race under "
            "load); left to a background thread. Its sockets are closed: no frame is lost",
            what,
            within_s,
        )
        return False
    return True
