"""Issue 13, row 1, at the registry: subscribers that cannot get a socket, and the health loop.

The subscribers of the ranks past a limit fail with "Too many open files" (the error a replica
past 1,023 sockets saw), through the registry's `subscribe` hook; the others are real
`RankSubscriber`s. Before: those subscriber tasks died silently, the worker's eviction re-raised
their error, and the health loop died with it: the next worker to die was never noticed, and
removing the first raised. Real fake workers, a real pump, real HTTP and ZMQ on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import zmq
import zmq.asyncio

from peer.supervise import Supervisor
from router.dataplane.polling import PollClient
from router.index import IndexRules, Pump
from router.loads import LoadMonitor
from router.subscriber import RankEndpoint, RankSubscriber, SubscriberStats
from router.workers import DOWN_CHECKS_PER_PASS, Worker, WorkerRegistry, subscriber_name
from router.zmq_term import terminate_context
from tests.support.clock import ManualClock
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import router_in_process
from tests.support.waiting import eventually

SOCKET_LIMIT = 4


@contextlib.asynccontextmanager
async def registry(context: zmq.asyncio.Context) -> AsyncIterator[WorkerRegistry]:
    pump = Pump(IndexRules())
    pump.start()

    async def subscribe(endpoint: RankEndpoint, stats: SubscriberStats) -> None:
        """Past SOCKET_LIMIT ranks a worker's subscribers cannot get a socket."""
        if endpoint.rank.dp_rank >= SOCKET_LIMIT:
            raise OSError(errno.EMFILE, "Too many open files")
        await RankSubscriber(
            endpoint, pump.deliver, context=context, stats=stats, offer=pump.offer
        ).run()

    async with aiohttp.ClientSession() as session:
        loads = LoadMonitor(PollClient(), interval_s=10)
        workers = WorkerRegistry(
            pump,
            session,
            loads,
            block_size=16,
            health_interval_s=0.05,
            evict_after_s=0.2,
            zmq_context=context,
            subscribe=subscribe,
        )
        workers.start()
        try:
            yield workers
        finally:
            await workers.close()
            await pump.stop()


async def test_the_health_loop_outlives_subscribers_that_cannot_get_a_socket() -> None:
    context = zmq.asyncio.Context()
    try:
        async with (
            fake_worker_in_process(dp_size=SOCKET_LIMIT + 4) as wide,
            fake_worker_in_process() as other,
            registry(context) as workers,
        ):
            await workers.add(wide.url)
            ranks = workers.get(wide.url).ranks()  # type: ignore[union-attr]
            supervised = [r for r in ranks if workers.supervisor.state(subscriber_name(r))]
            assert supervised == list(ranks)  # every rank has a supervised subscriber

            async def refused_sockets() -> bool:
                return workers.supervisor.failures["subscriber"] >= 4

            await eventually(refused_sockets, 5)  # the ranks past the limit, restarting
            states = [workers.supervisor.state(subscriber_name(r)) for r in ranks]
            assert all(s is not None for s in states)  # none of them died
            assert any("Too many open files" in s.last_error for s in states if s is not None)

            await workers.add(other.url)
            assert {w.url for w in workers.routable()} == {wide.url, other.url}
            assert wide.worker is not None and other.worker is not None

            # The wide worker crashes: it is evicted, its subscribers cancelled, nothing raised.
            await wide.worker.stop(send_end=False)

            async def evicted() -> bool:
                return workers.get(wide.url).state == "down"  # type: ignore[union-attr]

            await eventually(evicted, 10)
            assert workers.stats.evictions == 1 and workers.subscribed_ranks == 1

            # The health loop still runs: the next worker to crash is noticed.
            await other.worker.stop(send_end=False)

            async def noticed() -> bool:
                return not workers.routable()

            await eventually(noticed, 10)
            assert await workers.remove(wide.url) and await workers.remove(other.url)
            assert workers.supervisor.failures["health"] == 0
    finally:
        await terminate_context(context, within_s=2.0, what="test")


async def test_readyz_is_503_naming_a_critical_loop_that_cannot_be_kept_alive() -> None:
    clock = ManualClock()

    async def instant(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    async def hopeless() -> None:
        raise OSError(24, "Too many open files")

    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        assert (await rt.readyz())[0] == 200
        supervisor = Supervisor(clock=clock, sleep=instant)
        rt.replica.supervisor = supervisor  # a real supervisor whose backoff takes no time
        loops = [
            supervisor.spawn("health", "kvrouter-health", hopeless),
            supervisor.spawn("subscriber", "kv-sub x#dp0", hopeless, critical=False),
        ]
        await eventually(lambda: len(supervisor.failing()) == 2, 5)
        status, reason = await rt.readyz()
        assert status == 503 and reason.startswith("background task failing: kvrouter-health")
        assert "Too many open files" in reason and "kv-sub" not in reason  # per rank: no
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        assert (await rt.readyz())[0] == 200


async def test_a_worker_whose_health_check_raises_does_not_stop_the_others_checks() -> None:
    """`add` refuses a host its pool cannot spell now; this one is put in place the way the
    old `add` left it. Its check raising is counted and logged as a failed check, and the
    others' checks go on (a gather of them all raised as one, every pass)."""
    context = zmq.asyncio.Context()
    try:
        async with fake_worker_in_process() as fw, registry(context) as workers:
            await workers.add(fw.url)
            bad = "http://①②⑦.0.0.1:1"
            workers._workers[bad] = Worker(bad, state="ready", healthy=True)
            assert fw.worker is not None
            await fw.worker.stop(send_end=False)

            async def noticed() -> bool:
                good = workers.get(fw.url)
                return good is not None and not good.healthy

            await eventually(noticed, 10)
            assert workers.supervisor.failures["health"] >= 1  # the bad one's, counted
            assert not workers._workers[bad].healthy
            assert workers.supervisor.state("kvrouter-health") is not None
            assert workers.supervisor.state("kvrouter-health").in_a_row == 0  # type: ignore[union-attr]
            del workers._workers[bad]
    finally:
        await terminate_context(context, within_s=2.0, what="test")


async def test_down_workers_are_health_checked_a_bounded_number_at_a_time() -> None:
    """40 workers whose host accepts and never answers: each check holds a connection for
    the whole timeout. All checked at once they took every descriptor of a 1,024 limit at
    800; now at most `DOWN_CHECKS_PER_PASS` are checked at a time, each in its turn."""
    open_checks = 0
    most = 0
    checked: set[int] = set()

    def holder(
        index: int,
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal open_checks, most
            head = await reader.readuntil(b"\r\n\r\n")
            health = head.startswith(b"GET /health ")
            if health:
                checked.add(index)
                open_checks += 1
                most = max(most, open_checks)
            try:
                await reader.read()  # never answers; until the router gives up
            finally:
                if health:
                    open_checks -= 1
                writer.close()

        return hold

    servers = [await asyncio.start_server(holder(i), "127.0.0.1", 0) for i in range(40)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    pump = Pump(IndexRules())
    pump.start()
    try:
        async with aiohttp.ClientSession() as session:
            workers = WorkerRegistry(
                pump,
                session,
                LoadMonitor(PollClient(), interval_s=10),
                block_size=16,
                health_interval_s=0.05,
                request_timeout_s=0.3,
            )
            registered = await asyncio.gather(*(workers.add(url) for url in urls))
            assert {w.state for w in registered} == {"down"}  # /server_info never answered
            workers.start()
            try:
                await eventually(lambda: len(checked) == len(urls), 15)
            finally:
                await workers.close()
        assert 0 < most <= DOWN_CHECKS_PER_PASS, most
    finally:
        await pump.stop()
        for server in servers:
            server.close()
