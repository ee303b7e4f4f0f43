"""`UpstreamPool` over real sockets on 127.0.0.1: what an acquirer is handed when a worker
drops connections as it accepts them."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest

from router.dataplane.exchange import Failure
from router.dataplane.upstream import UpstreamConnection, UpstreamPool

pytestmark = pytest.mark.timeout(60)


class Acquirer:
    def __init__(self) -> None:
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def connection_ready(self, conn: UpstreamConnection) -> None:
        self.done.set_result("closed" if conn.closed else "open")
        conn.abort()

    def connection_failed(self, failure: Failure, detail: str) -> None:
        self.done.set_result(f"failed: {failure}")


async def test_a_connection_the_worker_drops_as_it_accepts_is_never_handed_over() -> None:
    # The worker resets each connection the moment it accepts it: the reset can reach the
    # loop before the connect task's completion does. Whatever the order, the acquirer is
    # told the connect failed, or handed a connection that is still open; never a dead one
    # (a relay writing into it failed an assertion, and the request hung).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def reset_at_once() -> None:  # a thread, as a worker is another process
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # with a zero linger: a reset

    thread = threading.Thread(target=reset_at_once, daemon=True)
    thread.start()
    loop = asyncio.get_running_loop()
    pool = UpstreamPool(
        loop,
        f"http://127.0.0.1:{port}",
        cap=4,
        connect_timeout_s=2.0,
        idle_expiry_s=4.0,
        idle_timeout_s=2.0,
    )
    outcomes: dict[str, int] = {}
    try:
        for _ in range(300):
            who = Acquirer()
            pool.acquire(who, fresh=True)
            outcome = await asyncio.wait_for(who.done, 5)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            await asyncio.sleep(0)  # the reset and the abort run; the slot comes back
    finally:
        pool.close()
        stop.set()
        listener.close()
        thread.join(timeout=5)
    assert "closed" not in outcomes, outcomes
    assert outcomes.keys() <= {"open", "failed: connect"}, outcomes
    assert pool.busy == set()  # no dead connection left counted as busy
