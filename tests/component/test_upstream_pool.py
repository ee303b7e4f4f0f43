"""`UpstreamPool` over real sockets on 127.0.0.1: what an acquirer is handed when a worker
drops connections as it accepts them, and how long one waits when every connection is busy."""

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


class Holder(Acquirer):
    """Keeps the connection it is handed (a request being answered)."""

    conn: UpstreamConnection

    def connection_ready(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        self.done.set_result("open")


async def test_a_queued_acquirer_fails_after_the_connect_timeout_and_leaves_the_queue() -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # a worker that never answers: until the router closes

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    bound = 0.3
    pool = UpstreamPool(
        loop,
        f"http://127.0.0.1:{port}",
        cap=1,
        connect_timeout_s=bound,
        idle_expiry_s=60.0,
        idle_timeout_s=60.0,
    )
    try:
        holder = Holder()
        pool.acquire(holder)
        assert await asyncio.wait_for(holder.done, 5) == "open"
        first, second, leaving = Acquirer(), Acquirer(), Acquirer()
        started = loop.time()
        for who in (first, second, leaving):
            pool.acquire(who)
        pool.cancel(leaving)
        assert [who for who, _ in pool.waiting] == [first, second]
        assert await asyncio.wait_for(first.done, 5) == "failed: queue"
        assert await asyncio.wait_for(second.done, 5) == "failed: queue"
        assert loop.time() - started >= bound
        assert not pool.waiting and not leaving.done.done()
        # One queued after the queue emptied gets a bound of its own, not the last one's.
        later = Acquirer()
        started = loop.time()
        pool.acquire(later)
        assert await asyncio.wait_for(later.done, 5) == "failed: queue"
        assert loop.time() - started >= bound
        # The held connection, back, goes idle: handed to none of those that gave up.
        pool.release(holder.conn, keep=True)
        assert list(pool.idle) == [holder.conn] and pool.total == 1
        assert not leaving.done.done()
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
