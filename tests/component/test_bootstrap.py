"""Peer bootstrap end to end: real replicas, real fake workers, real HTTP and ZMQ on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec
import pytest
from aiohttp import web

from cachetree.keys import KEY_SCHEME, block_keys
from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from peer import wire
from peer.fetch import ACCEPT, SnapshotFetcher
from peer.producer import accepts
from peer.wire import COLUMNS, JSON, MSGPACK
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, gate, router_in_process
from tests.support.waiting import eventually

BS = 16


def chain(rng: random.Random, shared: list[int], blocks: int) -> list[int]:
    return shared + [rng.randrange(3, 50_000) for _ in range(blocks * BS)]


@contextlib.asynccontextmanager
async def warm_fleet(n_chains: int = 40) -> AsyncIterator[tuple[list, RouterHandle, list]]:
    """Two fake workers (one with 2 ranks) and a warm replica that indexed n_chains chains."""
    rng = random.Random(5)
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(fake_worker_in_process(cache_blocks=100_000)),
            await stack.enter_async_context(
                fake_worker_in_process(dp_size=2, cache_blocks=100_000)
            ),
        ]
        warm = await stack.enter_async_context(router_in_process(workers=[w.url for w in workers]))
        ranks = [(workers[0], 0), (workers[1], 0), (workers[1], 1)]
        for fw, r in ranks:
            await warm.gate(fw, r)
        systems = [[rng.randrange(3, 50_000) for _ in range(4 * BS)] for _ in range(4)]
        chains = []
        for i in range(n_chains):
            fw, r = ranks[i % len(ranks)]
            tokens = chain(rng, rng.choice(systems), rng.randint(1, 6))
            chains.append(tokens)
            last = await fw.store([tokens], dp_rank=r)
            await warm.wait_cursor(fw.url, r, last)
        yield workers, warm, chains


def view(rt: RouterHandle) -> frozenset:
    return canonical_view(rt.replica.pump.rules.tree)


def held_by(rt: RouterHandle, rank: RankId) -> set:
    """(key, tier bits, engine hash) of every block `rank` carries in the replica's index."""
    return {
        (key, *carrier[2:])
        for key, _, carriers in view(rt)
        for carrier in carriers
        if (carrier[0], carrier[1]) == rank
    }


async def ready(rt: RouterHandle, within_s: float = 15.0) -> None:
    async def is_ready() -> bool:
        status, _ = await rt.get("/readyz")
        return status == 200

    await eventually(is_ready, within_s)


async def join(warm: RouterHandle, stack: contextlib.AsyncExitStack, **kw) -> RouterHandle:
    """A new replica that knows `warm` as its sibling."""
    kw.setdefault("kv_bootstrap_timeout_ms", 20_000)
    return await stack.enter_async_context(router_in_process(peer=[warm.url], **kw))


async def add_workers(rt: RouterHandle, workers: list[FakeWorkerHandle]) -> None:
    for fw in workers:
        status, body, _ = await rt.post("/workers", {"url": fw.url})
        assert status == 200, body


@pytest.mark.parametrize(
    "accept,gzip",
    [(ACCEPT, False), (ACCEPT, True), (MSGPACK, True), (JSON, True), (JSON, False)],
)
async def test_a_joining_replica_answers_prefix_queries_like_the_warm_one(
    accept: str, gzip: bool
) -> None:
    async with warm_fleet() as (workers, warm, chains), contextlib.AsyncExitStack() as stack:
        new = await join(warm, stack)
        bootstrap = new.replica.bootstrap
        assert bootstrap is not None
        await bootstrap.fetcher.close()
        bootstrap.fetcher = SnapshotFetcher(
            accept=accept, gzip=gzip, per_fetch_s=10, token=new.token
        )
        await add_workers(new, workers)
        await ready(new)
        assert view(new) == view(warm)
        # Thousands of prompts: every stored chain, cut at every length, plus strangers.
        rng = random.Random(9)
        queries = [
            c[: n * BS] + [rng.randrange(3, 50_000) for _ in range(rng.randrange(2 * BS))]
            for c in chains
            for n in range(1, len(c) // BS + 1)
            for _ in range(5)
        ]
        queries += [[rng.randrange(3, 50_000) for _ in range(64)] for _ in range(1000)]
        assert len(queries) > 2000
        warm_tree, new_tree = warm.replica.pump.rules.tree, new.replica.pump.rules.tree
        for tokens in queries:
            keys = block_keys(tokens, BS)
            assert new_tree.prefix_depths(keys).any_tier == warm_tree.prefix_depths(keys).any_tier
            assert new_tree.match(keys) == warm_tree.match(keys)
        assert bootstrap.snapshot_outcomes["accepted"] >= 1
        assert bootstrap.sources["peer"] == 3


async def format_1_sibling(warm: RouterHandle) -> tuple[web.AppRunner, str, list[str]]:
    """A sibling that predates the columnar body: it relays `warm`'s export, choosing the
    encoding as such a sibling did (msgpack when `Accept` lists it, else JSON)."""
    served: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        content_type = MSGPACK if accepts(request.headers.get("Accept"), MSGPACK) else JSON
        async with warm.session.get(
            warm.url + "/internal/kv_snapshot",
            params=request.query,
            headers={"Accept": content_type, **warm.headers("/internal/kv_snapshot")},
        ) as resp:
            body = await resp.read()
        served.append(resp.headers["Content-Type"])
        return web.Response(body=body, headers={"Content-Type": resp.headers["Content-Type"]})

    runner, url = await serve_snapshot_route(handler)
    return runner, url, served


async def test_a_sibling_that_only_speaks_format_1_is_answered_in_msgpack_and_grafted() -> None:
    async with warm_fleet() as (workers, warm, _), contextlib.AsyncExitStack() as stack:
        runner, url, served = await format_1_sibling(warm)
        stack.push_async_callback(runner.cleanup)
        new = await stack.enter_async_context(
            router_in_process(peer=[url], kv_bootstrap_timeout_ms=20_000)
        )
        await add_workers(new, workers)
        await ready(new)
        assert view(new) == view(warm)
        assert served and set(served) == {MSGPACK}
        assert new.replica.bootstrap.snapshot_outcomes["accepted"] >= 1
        producer = warm.replica.producer
        assert producer is not None and producer.cached is not None
        assert COLUMNS not in producer.cached.bodies


async def test_the_joined_replica_keeps_up_and_proves_the_splice() -> None:
    async with warm_fleet(n_chains=12) as (workers, warm, _), contextlib.AsyncExitStack() as s:
        new = await join(warm, s, workers=[w.url for w in workers])
        await ready(new)
        rng = random.Random(3)
        for fw, r in [(workers[0], 0), (workers[1], 0), (workers[1], 1)]:
            await new.gate(fw, r)  # a subscription may still be joining after /readyz
            last = await fw.store([chain(rng, [], 3)], dp_rank=r)
            await warm.wait_cursor(fw.url, r, last)
            await new.wait_cursor(fw.url, r, last)
        assert view(new) == view(warm)
        tracker = new.replica.bootstrap.tracker
        assert tracker.rank_outcomes["warm"] == 3  # each rank's first live batch proved it
        _, metrics = await new.get("/workers")
        assert all(r["blocks"] > 0 for w in metrics["workers"] for r in w["ranks"])


async def test_a_cold_sibling_is_not_used_and_the_replica_turns_ready_cold() -> None:
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process())
        cold = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        new = await join(cold, stack, workers=[fw.url])
        await ready(new)
        tracker = new.replica.bootstrap.tracker
        assert tracker.rank_outcomes["abandoned"] == 1
        assert tracker.sweep_outcomes["fleet_cold"] == 1
        assert new.replica.bootstrap.sources["peer"] == 0


async def test_an_idle_workers_own_empty_snapshot_settles_its_rank_warm_not_cold() -> None:
    """An engine that never published (its /v1/kv-snapshot: no blocks, `last_seq` -1) was
    left to the siblings and, none holding it, settled `abandoned`: cold until its first
    batch, though the engine itself said it holds nothing."""
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process(serve_kv_snapshot=True))
        sibling = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        new = await join(sibling, stack, workers=[fw.url])
        await ready(new)
        bootstrap = new.replica.bootstrap
        assert dict(bootstrap.tracker.rank_outcomes) == {"warm": 1}
        assert dict(bootstrap.sources) == {"worker": 1}
        assert dict(bootstrap.snapshot_outcomes) == {}  # no sibling was asked
        scrape = await new.scrape()
        assert scrape.value("kvrouter_index_cold_ranks") == 0
        assert scrape.by("kvrouter_kv_bootstrap_grafts_total", "source") == {"worker": 1}
        view = await new.rank_view(fw.url, 0)
        assert view is not None and (view["blocks"], view["cursor"]) == (0, None)
        assert (await fw.state())["last_seq"] == -1


async def serve_snapshot_route(handler: Any) -> tuple[web.AppRunner, str]:
    """A stand-in sibling serving only `/internal/kv_snapshot` on a free loopback port."""
    app = web.Application()
    app.router.add_get("/internal/kv_snapshot", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    await runner.setup()
    port = free_tcp_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def broken_sibling(kind: str) -> tuple[web.AppRunner, str]:
    """A sibling whose /internal/kv_snapshot misbehaves in one way."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if kind == "404":
            return web.Response(status=404)
        if kind == "garbage":
            return web.Response(body=b"\x93not a snapshot", content_type="application/msgpack")
        if kind == "truncated_gzip":
            return web.Response(
                body=b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xab\x56",
                headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            )
        if kind == "oversized":
            return web.Response(
                body=b"{" + b" " * (3 * 1024 * 1024), content_type="application/json"
            )
        await asyncio.sleep(3600)  # hangs
        return web.Response()

    return await serve_snapshot_route(handler)


@pytest.mark.parametrize("kind", ["404", "garbage", "truncated_gzip", "oversized", "hangs"])
async def test_a_misbehaving_sibling_leaves_the_rank_cold_within_the_deadline(kind: str) -> None:
    runner, url = await broken_sibling(kind)
    try:
        async with contextlib.AsyncExitStack() as stack:
            fw = await stack.enter_async_context(fake_worker_in_process())
            new = await stack.enter_async_context(
                router_in_process(
                    workers=[fw.url],
                    peer=[url],
                    kv_bootstrap_timeout_ms=2_000,
                    kv_bootstrap_max_body_mb=2,
                )
            )
            loop = asyncio.get_running_loop()
            started = loop.time()
            await ready(new, within_s=10)
            assert loop.time() - started < 6
            tracker = new.replica.bootstrap.tracker
            # Readiness may come from the deadline a moment before the sweep's own timeout
            # abandons the rank; the verdict follows within the same budget.
            await eventually(lambda: tracker.rank_outcomes["abandoned"], 5)
            assert tracker.rank_outcomes["abandoned"] == 1
            assert new.replica.bootstrap.snapshot_outcomes["accepted"] == 0
            # It runs cold, and indexes what it hears from now on.
            await new.gate(fw)
            assert new.replica.pump.rules.tree.block_count(RankId(fw.url, 0)) >= 1
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def refusing_sibling(
    status: int, fw: FakeWorkerHandle
) -> AsyncIterator[tuple[str, Callable[[], int]]]:
    """A sibling answering a snapshot request with `status`, and how often it was asked: a
    replica with another token (401), one with none (403), or an address no kvrouter serves
    (404)."""
    if status == 404:
        asked: list[str] = []

        async def handler(request: web.Request) -> web.StreamResponse:
            asked.append(request.path_qs)
            return web.Response(status=404)

        runner, url = await serve_snapshot_route(handler)
        try:
            yield url, lambda: len(asked)
        finally:
            await runner.cleanup()
        return
    token = "another-internal-token-fedcba9876543210" if status == 401 else None
    async with router_in_process(workers=[fw.url], internal_token=token) as sibling:
        yield sibling.url, lambda: sibling.replica.metrics.auth_refusals.counts["snapshot"]


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_a_sibling_refusing_the_request_is_asked_once_and_the_joiner_ready_at_once(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A sibling with another --internal-token (401), or none (403), or a --peer that is no
    kvrouter (404) was asked again for the whole bootstrap timeout: /readyz held 120 s at
    every new pod of a token rotation, which then ran cold all the same. Its answer does not
    change while its process runs: it holds nothing for the joiner, which says what to do."""
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process())
        url, asked = await stack.enter_async_context(refusing_sibling(status, fw))
        new = await stack.enter_async_context(
            router_in_process(workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=60_000)
        )
        await ready(new, within_s=20)  # not the 60 s timeout
        outcomes = new.replica.bootstrap.snapshot_outcomes
        assert asked() == 1
        assert outcomes["not_a_sibling"] == 1 and outcomes["unreachable"] == 0, outcomes
        assert new.replica.bootstrap.tracker.rank_outcomes["abandoned"] == 1
    why = {401: "tokens differ", 403: "has no --internal-token", 404: "serves no snapshot"}
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and url in r.getMessage() and "bootstrap" in r.getMessage()
    ]
    assert len(warnings) == 1 and why[status] in warnings[0], warnings


async def test_a_sibling_cutting_its_body_short_is_warned_of_once_by_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A body closed mid Content-Length was retried and counted `unreachable` with nothing
    above INFO in the log until the sweep ended (a 401 warned at once)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 100_000
        await resp.prepare(request)
        await resp.write(b'{"format": 1, "nodes": [')
        assert request.transport is not None
        request.transport.close()
        return resp

    runner, url = await serve_snapshot_route(handler)
    caplog.set_level(logging.INFO, logger="router.bootstrap")
    try:
        async with contextlib.AsyncExitStack() as stack:
            fw = await stack.enter_async_context(fake_worker_in_process())
            new = await stack.enter_async_context(
                router_in_process(workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=3_000)
            )
            await ready(new, within_s=10)
            outcomes = new.replica.bootstrap.snapshot_outcomes
            await eventually(lambda: outcomes["unreachable"] >= 2, 10)
            await eventually(lambda: "bootstrap sweep for" in caplog.text, 10)
    finally:
        await runner.cleanup()
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "gave no snapshot" in r.getMessage()
    ]
    assert len(warned) == 1 and url in warned[0], warned  # the first try, not every one
    sweeps = [r.getMessage() for r in caplog.records if "bootstrap sweep for" in r.getMessage()]
    assert sweeps and "1 rank(s) (1 pending now" in sweeps[0], sweeps


async def lagging_proxy(warm: RouterHandle, lag: int) -> tuple[web.AppRunner, str, list]:
    """A sibling that relays `warm`'s snapshot, claiming cursors `lag` batches older the first
    time (newer for a negative lag): the stream will not join that watermark, exactly like a
    snapshot taken too early (or a sibling whose cursors ran ahead of the stream)."""
    served: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        async with warm.session.get(
            warm.url + "/internal/kv_snapshot",
            params=request.query,
            headers=warm.headers("/internal/kv_snapshot"),
        ) as resp:
            snap = wire.decode(await resp.read(), resp.headers["Content-Type"])
        if not served and not request.query.get("cursors_only"):
            snap.cursors = [(w, max(0, seq - lag)) for w, seq in snap.cursors]
        served.append(dict(snap.cursors))
        return web.Response(body=wire.encode(snap), content_type="application/json")

    runner, url = await serve_snapshot_route(handler)
    return runner, url, served


async def test_a_gap_between_snapshot_and_stream_is_retried_once_and_recovers() -> None:
    async with warm_fleet(n_chains=9) as (workers, warm, _), contextlib.AsyncExitStack() as stack:
        fw = workers[0]
        runner, url, served = await lagging_proxy(warm, lag=2)
        stack.push_async_callback(runner.cleanup)
        new = await stack.enter_async_context(
            router_in_process(peer=[url], kv_bootstrap_timeout_ms=20_000)
        )
        bootstrap = new.replica.bootstrap
        await bootstrap.fetcher.close()
        bootstrap.fetcher = SnapshotFetcher(
            accept=JSON, gzip=False, per_fetch_s=10, token=new.token
        )
        await add_workers(new, [fw])
        await ready(new)
        rank = RankId(fw.url, 0)
        tracker = bootstrap.tracker
        assert tracker.recorded_outcome(rank) is None  # grafted, proof deferred
        # The next live batch does not join the (lagging) watermark: gap, then one retry.
        # Probing until one is applied also covers a subscription still joining. The retry's
        # snapshot may hold that batch already, which proves nothing: the next one proves it.
        await new.gate(fw)
        last = await new.gate(fw)
        await warm.wait_cursor(fw.url, 0, last)
        assert len(served) >= 2
        assert str(tracker.recorded_outcome(rank)) == "warm"
        assert tracker.rank_outcomes["gap"] == 0
        # The new replica indexes only fw; compare what each holds for fw's rank.
        assert held_by(new, rank) == held_by(warm, rank)
        assert len(held_by(new, rank)) > 0


async def test_a_sibling_cursor_ahead_of_the_stream_is_a_gap_not_a_frozen_warm_rank() -> None:
    """Cursors 100 ahead (far under MAX_SEQ_JUMP) were grafted and counted `warm` by the first
    live batch, which they filtered as already reflected, as every batch up to them."""
    async with warm_fleet(n_chains=9) as (workers, warm, _), contextlib.AsyncExitStack() as stack:
        fw = workers[0]
        runner, url, served = await lagging_proxy(warm, lag=-100)
        stack.push_async_callback(runner.cleanup)
        new = await stack.enter_async_context(
            router_in_process(peer=[url], kv_bootstrap_timeout_ms=20_000)
        )
        bootstrap = new.replica.bootstrap
        await add_workers(new, [fw])
        await ready(new)
        rank = RankId(fw.url, 0)
        await new.gate(fw)  # the first batch is 100 behind the cursor: a gap, then the retry
        last = await fw.store([chain(random.Random(4), [], 3)])
        await warm.wait_cursor(fw.url, 0, last)
        await new.wait_cursor(fw.url, 0, last)
        assert len(served) >= 2 and bootstrap.gaps_by_source() == {url: 1}
        assert str(bootstrap.tracker.recorded_outcome(rank)) == "warm"  # the retry's graft
        assert held_by(new, rank) == held_by(warm, rank)  # the new stores were not filtered


async def test_an_engine_restart_under_an_idle_grafted_rank_is_a_gap_not_ghosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Grafted while the rank was idle, then the engine restarts and its batch 0 is lost: its
    new stream sits under the grafted cursor. The joiner counted `warm`, kept the old blocks
    and filtered the new stores until the seqs passed the old cursor."""
    monkeypatch.setattr("router.bootstrap.TICK_S", 0.2)  # expire_behind's check, sooner
    monkeypatch.setattr("router.graft.BEHIND_WINDOW_S", 0.5)
    rng = random.Random(8)
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process())
        warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        await warm.gate(fw)
        for _ in range(40):
            last = await fw.store([chain(rng, [], 2)])
        await warm.wait_cursor(fw.url, 0, last)
        new = await join(warm, stack, workers=[fw.url])
        await ready(new)
        bootstrap = new.replica.bootstrap
        rank = RankId(fw.url, 0)
        assert bootstrap.tracker.recorded_outcome(rank) is None  # idle: the proof waits
        await fw.post("/control/restart-publisher", {})
        await fw.post("/control/drop-next", {"count": 1})
        await fw.store([chain(rng, [], 2)])  # seq 0, lost to every replica
        last = await fw.store([chain(rng, [], 2)])
        assert last == 1
        await warm.wait_cursor(fw.url, 0, last)  # the warm replica saw the seq regress
        await eventually(lambda: bootstrap.gaps_by_source() == {warm.url: 1}, 10.0)
        last = await fw.store([chain(rng, [], 2)])
        await warm.wait_cursor(fw.url, 0, last)
        await new.wait_cursor(fw.url, 0, last)
        assert held_by(new, rank) == held_by(warm, rank)  # no ghost of the old cache
        assert len(held_by(new, rank)) == 4  # seq 1's and seq 2's blocks
        # The retry grafted the warm replica's view (cold since the reset) and seq 2 proved it.
        assert str(bootstrap.tracker.recorded_outcome(rank)) == "warm"
        assert rank in new.replica.pump.rules.cold


async def frozen_sibling(warm: RouterHandle) -> tuple[web.AppRunner, str]:
    """A sibling whose view stopped at `warm`'s current one (as a replica whose event stream
    stalled would): every request, now and later, gets this export, cursors and all."""
    async with warm.session.get(
        warm.url + "/internal/kv_snapshot",
        params={"max_age_ms": "0"},
        headers=warm.headers("/internal/kv_snapshot"),
    ) as resp:
        frozen = wire.encode(wire.decode(await resp.read(), resp.headers["Content-Type"]))

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=frozen, content_type="application/json")

    return await serve_snapshot_route(handler)


async def test_a_gap_retry_grafts_the_warm_sibling_not_the_frozen_one_again() -> None:
    """After the frozen sibling's snapshot gaps, the one retry must not take it again: the
    joiner ends warm whichever sibling its shuffled list asked first, and the gap is counted
    against the frozen sibling."""
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process())
        rank = RankId(fw.url, 0)
        warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        await warm.gate(fw)
        rng = random.Random(3)
        last = await fw.store([chain(rng, [], 3) for _ in range(4)])
        await warm.wait_cursor(fw.url, 0, last)
        runner, frozen = await frozen_sibling(warm)
        stack.push_async_callback(runner.cleanup)
        last = await fw.store([chain(rng, [], 2) for _ in range(3)])  # past the frozen view
        await warm.wait_cursor(fw.url, 0, last)
        frozen_first = 0
        for seed, order in itertools.product(range(4), ([frozen, warm.url], [warm.url, frozen])):
            async with router_in_process(
                workers=[fw.url], peer=order, seed=seed, kv_bootstrap_timeout_ms=20_000
            ) as new:
                await ready(new)
                # The stream moves on: a watermark from the frozen view does not join it. The
                # retry's snapshot may hold that batch already; the next one proves it.
                await gate([warm, new], fw)
                await gate([warm, new], fw)
                tracker = new.replica.bootstrap.tracker
                await eventually(lambda t=tracker: t.recorded_outcome(rank) is not None, 10)
                run = (seed, order.index(frozen))
                assert str(tracker.recorded_outcome(rank)) == "warm", run
                assert held_by(new, rank) == held_by(warm, rank), run
                gaps = (await new.scrape()).get("kvrouter_kv_peer_snapshot_gaps_total", peer=frozen)
                assert gaps in (None, 1.0), run  # the frozen graft gapped once, at most
                frozen_first += gaps == 1.0
        assert frozen_first > 0  # some runs took the frozen sibling first: the retry was tested


async def test_seed_required_holds_readyz_after_a_timed_out_sweep_over_live_peers() -> None:
    runner, url = await broken_sibling("hangs")
    try:
        async with contextlib.AsyncExitStack() as stack:
            fw = await stack.enter_async_context(fake_worker_in_process())
            new = await stack.enter_async_context(
                router_in_process(
                    workers=[fw.url],
                    peer=[url],
                    kv_bootstrap_timeout_ms=1_000,
                    kv_bootstrap_seed_required=True,
                )
            )
            tracker = new.replica.bootstrap.tracker
            await eventually(lambda: tracker.sweep_outcomes["timed_out"], 10)

            async def readyz() -> tuple[int, str]:
                status, body = await new.get("/readyz")
                return status, body.get("reason", "")

            async def readyz_is(status: int, reason: str) -> bool:
                return await readyz() == (status, reason)

            # The sweep can time out before the worker's rank registers (a slow machine): the
            # tracker then re-arms for the rank, and settles at its own deadline. Either way
            # the replica ends held by the seed gate, not ready.
            await eventually(lambda: readyz_is(503, "seed gate closed"), 10)
            assert tracker.settled()
            assert await readyz() == (503, "seed gate closed")
            # Without the flag, the same situation is ready.
            other = await stack.enter_async_context(
                router_in_process(workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=1_000)
            )
            await ready(other, within_s=10)
    finally:
        await runner.cleanup()


async def test_a_later_scale_up_never_unreadies_a_serving_replica() -> None:
    runner, url = await broken_sibling("hangs")
    try:
        async with contextlib.AsyncExitStack() as stack:
            first = await stack.enter_async_context(fake_worker_in_process())
            second = await stack.enter_async_context(fake_worker_in_process())
            new = await stack.enter_async_context(
                router_in_process(workers=[first.url], peer=[url], kv_bootstrap_timeout_ms=2_000)
            )
            await ready(new, within_s=10)
            # A worker discovered later bootstraps (Pending, held) but readiness is latched.
            status, _, _ = await new.post("/workers", {"url": second.url})
            assert status == 200
            tracker = new.replica.bootstrap.tracker
            assert tracker.is_pending(RankId(second.url, 0))
            status, _ = await new.get("/readyz")
            assert status == 200
    finally:
        await runner.cleanup()


async def hostile_sibling(
    fw: FakeWorkerHandle, nodes: list[wire.WireNode], worker_url: str | None = None
) -> tuple[web.AppRunner, str]:
    """A sibling answering one JSON body: `fw`'s rank 0 (named `worker_url`, else its url) at
    cursor 0 and `nodes`."""
    snapshot = wire.PeerSnapshot(
        format=wire.FORMAT,
        block_size=16,
        key_scheme=KEY_SCHEME,
        producer_ready=True,
        workers=[wire.WireWorker(worker_url or fw.url, 0)],
        cursors=[(0, 0)],
        nodes=nodes,
    )

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(snapshot), content_type=JSON)

    return await serve_snapshot_route(handler)


async def test_a_carrier_index_past_64_bits_is_dropped_and_the_rest_grafted() -> None:
    async with fake_worker_in_process() as fw:
        nodes = [wire.WireNode(None, 11, [(0, 1, 101), (2**63, 1, 102)])]
        runner, url = await hostile_sibling(fw, nodes)
        try:
            async with router_in_process(
                workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=5_000
            ) as new:
                await ready(new, within_s=10)
                outcomes = new.replica.bootstrap.snapshot_outcomes
                await eventually(lambda: outcomes["accepted"], 5)  # vetted, not a crash
                assert new.replica.pump.rules.tree.block_count(RankId(fw.url, 0)) == 1
        finally:
            await runner.cleanup()


async def test_a_sibling_naming_the_worker_as_its_flag_was_written_is_grafted_onto_ours() -> None:
    """A sibling of another version exports `--worker http://localhost:P` as written, where
    this replica's registry keys `http://127.0.0.1:P`: before, every fetch was vetted
    `nothing_usable`, counted `cold_peer`, and the rank waited out the bootstrap cold."""
    async with fake_worker_in_process() as fw:
        port = urlsplit(fw.url).port
        nodes = [wire.WireNode(None, 11, [(0, 1, 101)]), wire.WireNode(0, 12, [(0, 1, 102)])]
        runner, url = await hostile_sibling(fw, nodes, f"http://LOCALHOST:{port}/")
        try:
            async with router_in_process(
                workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=20_000
            ) as new:
                await ready(new, within_s=10)
                outcomes = new.replica.bootstrap.snapshot_outcomes
                rank = RankId(fw.url, 0)
                assert dict(outcomes) == {"accepted": 1}, outcomes
                assert new.replica.pump.rules.tree.block_count(rank) == 2
                assert new.replica.pump.rules.tree.ranks() == [rank]
        finally:
            await runner.cleanup()


async def test_a_sibling_none_of_whose_workers_is_known_here_is_rejected_and_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not a cold sibling (retried all through the bootstrap, /readyz held to its timeout,
    one INFO line naming nothing): refused at once, counted `rejected`, and the warning names
    the sibling, the workers it names, ours, and what to do."""
    async with fake_worker_in_process() as fw:
        nodes = [wire.WireNode(None, 11, [(0, 1, 101)])]
        runner, url = await hostile_sibling(fw, nodes, "http://other-name:8000")
        try:
            async with router_in_process(
                workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=60_000
            ) as new:
                await ready(new, within_s=10)  # not at the 60 s timeout
                outcomes = new.replica.bootstrap.snapshot_outcomes
                assert dict(outcomes) == {"rejected": 1}, outcomes
        finally:
            await runner.cleanup()
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "unknown_workers" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert url in warnings[0] and "http://other-name:8000#dp0" in warnings[0], warnings
    assert f"{fw.url}#dp0" in warnings[0] and "same worker list" in warnings[0], warnings


async def test_a_refused_sibling_is_logged_with_what_was_wrong(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with fake_worker_in_process() as fw:
        nodes = [wire.WireNode(1, 11, [(0, 1, 101)]), wire.WireNode(None, 12, [(0, 1, 102)])]
        runner, url = await hostile_sibling(fw, nodes)
        try:
            async with router_in_process(
                workers=[fw.url], peer=[url], kv_bootstrap_timeout_ms=2_000
            ) as new:
                await ready(new, within_s=10)
                await eventually(lambda: new.replica.bootstrap.snapshot_outcomes["rejected"], 5)
        finally:
            await runner.cleanup()
    refusals = [r.getMessage() for r in caplog.records if "rejected for this" in r.getMessage()]
    assert refusals and "invalid_parent: node 0" in refusals[0], refusals


async def test_a_replica_given_the_fleets_peer_list_leaves_itself_out_of_it() -> None:
    """Every replica is often given one list, itself included; without --self-url a replica
    asked itself for snapshots and posted its decisions to itself and adopted them (its
    replica count, which the cost's backlog term reads, one too many)."""
    port = free_tcp_port()
    me = f"http://127.0.0.1:{port}"
    other = f"http://127.0.0.1:{free_tcp_port()}"  # nobody listens: a cold witness
    async with router_in_process(port=port, peer=[me, f"{other}/"]) as rt:
        assert list(rt.replica.bootstrap.registry.peers) == [other]
    control = free_tcp_port()  # the port meant for peer traffic, listed as the fleet's address
    listed = [f"http://127.0.0.1:{control}", other]
    async with router_in_process(port=free_tcp_port(), control_port=control, peer=listed) as rt:
        assert list(rt.replica.bootstrap.registry.peers) == [other]


async def test_a_sibling_listed_under_two_spellings_is_one_sibling_asked_once() -> None:
    """`http://127.0.0.1:P` and `http://localhost:P/` name one replica (this one listens on
    loopback): it was asked twice, sent every decision twice and counted twice."""
    async with contextlib.AsyncExitStack() as stack:
        fw = await stack.enter_async_context(fake_worker_in_process())
        warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        last = await warm.gate(fw)
        await warm.wait_cursor(fw.url, 0, last)
        port = urlsplit(warm.url).port
        listed = [warm.url, f"http://localhost:{port}/"]
        new = await stack.enter_async_context(
            router_in_process(workers=[fw.url], peer=listed, kv_bootstrap_timeout_ms=20_000)
        )
        await ready(new)
        bootstrap = new.replica.bootstrap
        assert bootstrap.registry.peers == (warm.url,)
        assert (await new.scrape()).value("kvrouter_kv_bootstrap_peers") == 1
        assert sum(bootstrap.snapshot_outcomes.values()) == 1  # asked once, grafted
        assert bootstrap.sources["peer"] == 1


async def test_a_wildcard_replica_without_its_url_leaves_its_machine_on_its_port_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On --host 0.0.0.0 with neither --self-url nor POD_IP, the fleet's list (itself
    included) named it by a loopback URL: it asked itself for snapshots and posted its
    decisions to itself. Now such a URL on its own port is left out, and the log says why."""
    monkeypatch.delenv("POD_IP", raising=False)
    port = free_tcp_port()
    other = f"http://127.0.0.1:{free_tcp_port()}"  # nobody listens: a cold witness
    listed = [f"http://127.0.0.1:{port}", f"http://localhost:{port}", other]
    with caplog.at_level(logging.WARNING, logger="router.replica"):
        async with router_in_process(host="0.0.0.0", port=port, peer=listed) as rt:
            assert list(rt.replica.bootstrap.registry.peers) == [other]
    warned = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(warned) == 2 and all("--self-url" in w for w in warned), warned
    assert {f"http://127.0.0.1:{port}", f"http://localhost:{port}"} == {
        w.split()[1] for w in warned
    }


async def test_a_joiner_grafts_the_sibling_warm_for_a_rank_not_one_that_ran_cold() -> None:
    """A sibling whose own bootstrap ran cold holds a true but partial view (what it heard
    live since); a joiner offered it and a warm sibling must graft the warm one's whole view,
    whichever order its shuffled peer list puts them in."""
    runner, hanging = await broken_sibling("hangs")
    try:
        async with contextlib.AsyncExitStack() as stack:
            fw = await stack.enter_async_context(fake_worker_in_process())
            rank = RankId(fw.url, 0)
            warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
            await warm.gate(fw)
            # A new engine incarnation, seen from its seq 0 on: the warm view is whole.
            await fw.post("/control/restart-publisher", {"dp_rank": 0})
            rng = random.Random(11)
            await fw.store([chain(rng, [], 9) for _ in range(3)])
            # The cold sibling's only sibling hangs: it settles cold, then hears one chain.
            cold = await stack.enter_async_context(
                router_in_process(workers=[fw.url], peer=[hanging], kv_bootstrap_timeout_ms=2_000)
            )
            await ready(cold, within_s=10)
            await eventually(lambda: cold.replica.bootstrap.tracker.rank_outcomes["abandoned"], 5)
            await gate([warm, cold], fw)
            last = await fw.store([chain(rng, [], 1)])
            for rt in (warm, cold):
                await rt.wait_cursor(fw.url, 0, last)
            whole = held_by(warm, rank)
            assert len(whole) == 3 * 9 + 2  # the chains, the probe and the cold one's chain
            assert len(held_by(cold, rank)) == 2
            assert (await cold.scrape()).value("kvrouter_index_cold_ranks") == 1
            assert (await warm.scrape()).value("kvrouter_index_cold_ranks") == 0
            for seed, order in itertools.product(range(3), ([warm, cold], [cold, warm])):
                async with router_in_process(
                    workers=[fw.url],
                    peer=[rt.url for rt in order],
                    seed=seed,
                    kv_bootstrap_timeout_ms=20_000,
                ) as new:
                    await ready(new)
                    await new.wait_cursor(fw.url, 0, last)
                    assert held_by(new, rank) == whole, (seed, order.index(warm))
                    assert new.replica.bootstrap.sources["peer"] == 1
                    assert (await new.scrape()).value("kvrouter_index_cold_ranks") == 0
    finally:
        await runner.cleanup()


async def test_a_body_fetched_before_a_worker_was_removed_and_added_again_is_not_grafted() -> None:
    """A sweep's fetch started, the worker was removed, evicted blocks while out, and was
    registered again: the body exported before all that was grafted onto the new registration
    (README: "an export no older than when the rank started holding"), its evicted blocks kept
    as ghosts until the 30-s splice probe. The rejoin now waits for a sweep of its own."""
    async with warm_fleet(n_chains=9) as (workers, warm, _), contextlib.AsyncExitStack() as stack:
        fw = workers[0]
        rank = RankId(fw.url, 0)
        asked = asyncio.Event()
        release = asyncio.Event()
        served: list[dict] = []

        async def held_back(request: web.Request) -> web.Response:
            """Relays `warm`'s export taken at the request; the first one only once released."""
            async with warm.session.get(
                warm.url + "/internal/kv_snapshot",
                params=request.query,
                headers=warm.headers("/internal/kv_snapshot"),
            ) as resp:
                body, content_type = await resp.read(), resp.headers["Content-Type"]
            served.append(dict(wire.decode(body, content_type).cursors))
            if len(served) == 1:
                asked.set()
                await release.wait()
            return web.Response(body=body, content_type=content_type)

        runner, url = await serve_snapshot_route(held_back)
        stack.push_async_callback(runner.cleanup)
        new = await stack.enter_async_context(
            router_in_process(peer=[url], kv_bootstrap_timeout_ms=20_000)
        )
        await add_workers(new, [fw])
        await asyncio.wait_for(asked.wait(), 10)
        status, _ = await new.delete(f"/workers?url={fw.url}")
        assert status == 200
        evicted = await fw.post("/control/evict", {"count": 3})
        assert evicted["evicted"] > 0
        await warm.wait_cursor(fw.url, 0, evicted["last_seq"])
        await add_workers(new, [fw])
        coordinator = new.replica.bootstrap.coordinator
        await eventually(lambda: coordinator.queue.qsize() > 0, 10)
        release.set()
        await ready(new)
        assert held_by(new, rank) == held_by(warm, rank) != set()  # no evicted block kept
        assert len(served) == 2  # the rejoin's own sweep, with an export taken after it
