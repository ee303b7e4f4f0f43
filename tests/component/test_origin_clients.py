"""`peer.origin` against the clients a replica talks to workers and siblings with: aiohttp
(`/server_info`, snapshots, a sibling's snapshot) and the data plane's pools (`PollClient`:
health and loads; the relay uses the same pools), over real sockets on loopback.

Whatever the check accepts both clients reach; whatever aiohttp refuses the check refuses
first, naming the dotted quad to write instead (a `127.1` worker was accepted, answered the
health checks and never registered).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from peer.origin import origin_problem
from router.dataplane.polling import PollClient

pytestmark = pytest.mark.timeout(30)

# Spellings of the loopback addresses, as a user might type them.
LOOPBACK = [
    "127.0.0.1",
    "127.1",
    "127.0.1",
    "2130706433",
    "127.000.000.001",
    "127.0.0.01",
    "0177.0.0.1",
    "0x7f.1",
    "0x7F.0.0.1",
    "0x7f000001",
    "127.0.0.1.",
    "localhost",
    "LOCALHOST",
    "[::1]",
    "[0:0:0:0:0:0:0:1]",
    "[::ffff:127.0.0.1]",
    "[::FFFF:7f00:1]",
]
# Refused by aiohttp before any connection is tried (no lookup, nothing reached).
NOT_ADDRESSES = ["1.2.3", "256.1.1.1", "1.2.3.4.5", "01.2.3.4", "0"]


def _ipv6_loopback() -> bool:
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            return False
    return True


@contextlib.asynccontextmanager
async def loopback_server() -> AsyncIterator[int]:
    """An HTTP server on one port of 127.0.0.1 (and of ::1 when there is one)."""
    app = web.Application()
    app.router.add_get("/health", _ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    if _ipv6_loopback():
        await web.TCPSite(runner, "::1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _aiohttp_status(session: aiohttp.ClientSession, url: str) -> int | str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status
    except aiohttp.InvalidUrlClientError as exc:
        return f"refused: {exc}"
    except aiohttp.ClientError as exc:
        return f"failed: {exc}"


async def test_both_clients_reach_what_the_check_accepts_and_it_refuses_what_aiohttp_does() -> None:
    poll = PollClient()
    wrong: dict[str, str] = {}
    accepted = []
    try:
        async with loopback_server() as port, aiohttp.ClientSession() as session:
            ipv6 = _ipv6_loopback()
            for host in LOOPBACK + NOT_ADDRESSES:
                if host.startswith("[::1]") and not ipv6:
                    continue
                url = f"http://{host}:{port}"
                problem = origin_problem(url)
                via_aiohttp = await _aiohttp_status(session, f"{url}/health")
                if problem is None:
                    accepted.append(host)
                    via_pools = await poll.get(f"{url}/health", 5, 1024)
                    if via_aiohttp != 200 or via_pools.status != 200:
                        wrong[host] = f"accepted, but aiohttp: {via_aiohttp}, pools: {via_pools}"
                elif host in LOOPBACK and "127.0.0.1" not in problem:
                    wrong[host] = f"refused without naming 127.0.0.1: {problem}"
                elif host in NOT_ADDRESSES and "IPv4" not in problem:
                    wrong[host] = f"refused without saying why: {problem}"
    finally:
        poll.close()
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())
    # The dotted quad, the names and the IPv6 forms; no other IPv4 spelling.
    assert [h for h in accepted if not h.startswith("[")] == ["127.0.0.1", "localhost", "LOCALHOST"]
