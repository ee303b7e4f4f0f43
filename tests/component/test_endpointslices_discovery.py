"""EndpointSlice discovery end to end: a real replica finds its workers and its siblings
through the fake API server, with real fake workers on loopback."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from cachetree.ranks import RankId
from cachetree.snapshot import canonical_view
from router.tokenize import BytesTokenizer
from tests.component.test_cli import run_cli
from tests.support.fake_apiserver import FakeApiServer, endpoint, endpoint_slice
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.metrics import Scrape
from tests.support.ports import free_tcp_port
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually

WORKERS = "kubernetes.io/service-name=fake-kv-worker"
SIBLINGS = "kubernetes.io/service-name=kvrouter"
TOK = BytesTokenizer()


def worker_slice(fw: FakeWorkerHandle, **conditions: bool | None) -> dict:
    """One slice per worker: they share 127.0.0.1, so each keeps its own port."""
    port = urlsplit(fw.url).port
    assert port is not None
    pod = endpoint("127.0.0.1", f"fake-kv-worker-{port}", **conditions)  # type: ignore[arg-type]
    return endpoint_slice(f"fake-kv-worker-{port}", "fake-kv-worker", [pod], ports=[port])


def routable(rt: RouterHandle) -> set[str]:
    return {w.url for w in rt.replica.workers.routable()}


async def served(fw: FakeWorkerHandle) -> int:
    return (await fw.state())["requests"]


async def send(rt: RouterHandle, n: int) -> None:
    for i in range(n):
        status, body, _ = await rt.post(
            "/v1/completions", {"prompt": f"hello {i}", "max_tokens": 1}
        )
        assert status == 200, body


async def requests_taken(workers: list[FakeWorkerHandle], rt: RouterHandle, n: int) -> list[int]:
    """Send n requests; how many each worker served."""
    before = [await served(fw) for fw in workers]
    await send(rt, n)
    return [await served(fw) - b for fw, b in zip(workers, before, strict=True)]


async def joined_through_slices(
    stack: contextlib.AsyncExitStack, fw: FakeWorkerHandle, fake: FakeApiServer, timeout_ms: int
) -> RouterHandle:
    """A replica finding its siblings through the EndpointSlices, once it is ready."""
    new = await stack.enter_async_context(
        router_in_process(
            workers=[fw.url],
            kv_peer_selector=SIBLINGS,
            kube_api_server=fake.url,
            kv_bootstrap_timeout_ms=timeout_ms,
        )
    )

    async def is_ready() -> bool:
        return (await new.get("/readyz"))[0] == 200

    await eventually(is_ready, 20.0)
    return new


async def test_discovered_workers_take_traffic_and_departed_ones_are_drained_and_removed() -> None:
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        w1 = await stack.enter_async_context(fake_worker_in_process())
        w2 = await stack.enter_async_context(fake_worker_in_process())
        fake.put(worker_slice(w1))
        rt = await stack.enter_async_context(
            router_in_process(
                worker_selector=WORKERS,
                kube_api_server=fake.url,
                namespace="default",
                policy="round_robin",
            )
        )
        await eventually(lambda: routable(rt) == {w1.url}, 10.0)
        assert await requests_taken([w1, w2], rt, 4) == [4, 0]

        fake.put(worker_slice(w2))
        await eventually(lambda: routable(rt) == {w1.url, w2.url}, 10.0)
        assert await requests_taken([w1, w2], rt, 4) == [2, 2]

        # Terminating: removed at once, not after --worker-evict-after-s (30 s here).
        fake.put(worker_slice(w1, ready=False, serving=True, terminating=True))
        await eventually(lambda: rt.replica.workers.get(w1.url) is None, 10.0)
        assert RankId(w1.url, 0) not in rt.replica.pump.rules.live
        assert await requests_taken([w1, w2], rt, 4) == [0, 4]

        # Back and ready: registered again. Not ready (no termination): drained, and kept
        # for its grace (--worker-evict-after-s).
        fake.put(worker_slice(w1))
        fake.put(worker_slice(w2, ready=False))
        await eventually(lambda: routable(rt) == {w1.url}, 10.0)
        assert {w.url for w in rt.replica.workers.workers()} == {w1.url, w2.url}
        assert await requests_taken([w1, w2], rt, 4) == [4, 0]

        fake.delete(worker_slice(w1)["metadata"]["name"])
        fake.delete(worker_slice(w2)["metadata"]["name"])
        await eventually(lambda: rt.replica.workers.workers() == [], 10.0)
        status, _, _ = await rt.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 503
        assert [await served(w) for w in (w1, w2)] == [10, 6]
        scrape = Scrape.parse((await rt.text("/metrics"))[1])
        assert scrape.value("kvrouter_discovery_urls", what="workers") == 0
        assert scrape.value("kvrouter_discovery_relists_total", what="workers") == 1
        # After the list that found w1, the watch saw w2 added, w1 terminating, w1 back, w2
        # unready, both deleted.
        events = scrape.series("kvrouter_discovery_events_total")
        assert {dict(labels)["type"]: n for labels, n in events.items()} == {
            "ADDED": 1,
            "MODIFIED": 3,
            "DELETED": 2,
        }


async def discovered_fleet(
    stack: contextlib.AsyncExitStack, fake: FakeApiServer, n: int, **config: object
) -> tuple[RouterHandle, list[FakeWorkerHandle]]:
    """n fake workers in the slices, and a replica routing to all of them, subscribed."""
    workers = [await stack.enter_async_context(fake_worker_in_process()) for _ in range(n)]
    for fw in workers:
        fake.put(worker_slice(fw))
    rt = await stack.enter_async_context(
        router_in_process(
            worker_selector=WORKERS, kube_api_server=fake.url, namespace="default", **config
        )
    )
    await eventually(lambda: routable(rt) == {fw.url for fw in workers}, 10.0)
    for fw in workers:
        await rt.gate(fw)
    return rt, workers


async def test_a_readiness_flap_within_the_grace_keeps_the_blocks_and_the_prefix_goes_back() -> (
    None
):
    """A worker whose pod turns unready for a moment (engine up, cache intact) takes no new
    request meanwhile, but keeps its ranks: ready again, its prefix is routed back to it. Its
    blocks were forgotten at once, and the prefix routed cold and copied elsewhere."""
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        rt, (w1, w2) = await discovered_fleet(stack, fake, 2, worker_evict_after_s=600)
        registry = rt.replica.workers
        first = registry.get(w1.url)
        system = "You are a careful assistant. " * 20  # 580 bytes: 36 blocks
        held = (await rt.wait_cursor(w1.url, 0, await w1.store([TOK.encode(system)])))["blocks"]
        assert held == 36 + 1  # the chain and the gate's probe

        fake.put(worker_slice(w1, ready=False))
        await eventually(lambda: routable(rt) == {w2.url}, 10.0)
        assert await requests_taken([w1, w2], rt, 2) == [0, 2]  # no new requests
        view = await rt.rank_view(w1.url, 0)
        assert view is not None and view["blocks"] == held

        fake.put(worker_slice(w1))
        await eventually(lambda: routable(rt) == {w1.url, w2.url}, 10.0)
        assert registry.get(w1.url) is first  # never removed, never registered anew
        view = await rt.rank_view(w1.url, 0)
        assert view is not None and view["blocks"] == held
        before = [await served(w) for w in (w1, w2)]
        status, body, _ = await rt.post(
            "/v1/completions", {"prompt": f"{system}question?", "max_tokens": 1}
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 36 * 16
        assert [await served(w) - b for w, b in zip((w1, w2), before, strict=True)] == [1, 0]


async def test_a_worker_unready_past_the_grace_is_removed_then_registered_anew_when_ready() -> None:
    grace_s = 1.0
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        rt, (w1, w2) = await discovered_fleet(stack, fake, 2, worker_evict_after_s=grace_s)
        registry = rt.replica.workers
        unready_at = time.monotonic()
        fake.put(worker_slice(w1, ready=False))
        await eventually(lambda: registry.get(w1.url) is None, 10.0)
        assert time.monotonic() - unready_at >= grace_s
        assert RankId(w1.url, 0) not in rt.replica.pump.rules.live
        assert routable(rt) == {w2.url}
        fake.put(worker_slice(w1))  # ready again: registered anew
        await eventually(lambda: routable(rt) == {w1.url, w2.url}, 10.0)
        assert registry.get(w1.url) is not None


async def test_a_worker_port_the_slices_do_not_list_is_warned_of_once_and_nothing_registered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--worker-port` naming a port the slices do not carry (a Service's port, not the
    container's): the slice's first port, the engine's KV-event port here, was taken instead
    and the worker registered there; the only log line was about its /server_info."""
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        fw = await stack.enter_async_context(fake_worker_in_process())
        http = urlsplit(fw.url).port
        kv = urlsplit(fw.kv_endpoint()).port
        assert http is not None and kv is not None
        absent = free_tcp_port()
        pods = [endpoint("127.0.0.1", "engine-a")]
        fake.put(endpoint_slice("engines", "fake-kv-worker", pods, ports=[kv, http]))
        rt = await stack.enter_async_context(
            router_in_process(
                worker_selector=WORKERS,
                kube_api_server=fake.url,
                namespace="default",
                worker_port=absent,
            )
        )
        discovery = rt.replica.discovery
        assert discovery is not None
        (watch,) = discovery.watches
        await eventually(lambda: watch.stats.relists == 1, 10.0)
        # The same slice again, its ports as they were: no second warning.
        pods.append(endpoint("127.0.0.2", "engine-b"))
        fake.put(endpoint_slice("engines", "fake-kv-worker", pods, ports=[kv, http]))
        await eventually(lambda: watch.stats.events["MODIFIED"] == 1, 10.0)
        assert rt.replica.workers.workers() == []
        warnings = [r.getMessage() for r in caplog.records if "--worker-port" in r.getMessage()]
        assert warnings == [
            f"workers: EndpointSlice default/engines lists port(s) {kv}, {http}, not "
            f"--worker-port {absent}: its endpoints are skipped, not registered at another "
            "port; give --worker-port the port the slices list for the engines' HTTP API (the "
            "container's, not a Service's)"
        ]


async def test_a_worker_leaving_the_discovered_set_is_out_of_routing_in_that_same_call() -> None:
    async with (
        fake_worker_in_process() as w1,
        fake_worker_in_process() as w2,
        router_in_process() as rt,
    ):
        registry = rt.replica.workers
        registry.discovered([w1.url, w2.url])
        await eventually(lambda: routable(rt) == {w1.url, w2.url}, 10.0)
        first = registry.get(w1.url)
        registry.discovered([w2.url])
        assert routable(rt) == {w2.url}  # no await in between: no request can slip through
        assert registry.get(w1.url) is first  # drained now, removed later
        registry.discovered([w1.url, w2.url])  # back before its removal: it just stops draining
        assert routable(rt) == {w1.url, w2.url}
        registry.discovered([w2.url])
        await eventually(lambda: registry.get(w1.url) is None, 10.0)
        registry.discovered([w1.url, w2.url])
        await eventually(lambda: routable(rt) == {w1.url, w2.url}, 10.0)
        assert registry.get(w1.url) is not first  # registered anew after its removal
        assert await requests_taken([w1, w2], rt, 4) == [2, 2]


async def test_a_replica_bootstraps_from_a_sibling_found_in_endpointslices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(11)
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        fw = await stack.enter_async_context(fake_worker_in_process(cache_blocks=10_000))
        warm = await stack.enter_async_context(router_in_process(workers=[fw.url]))
        await warm.gate(fw)
        chains = [
            [rng.randrange(3, 50_000) for _ in range(16 * rng.randint(1, 4))] for _ in range(12)
        ]
        last = await fw.store(chains)
        await warm.wait_cursor(fw.url, 0, last)

        warm_port = urlsplit(warm.url).port
        assert warm_port is not None
        # The warm sibling is ready; the joining replica itself is listed, still unready.
        fake.put(
            endpoint_slice(
                "kvrouter-abcde",
                "kvrouter",
                [
                    endpoint("127.0.0.1", "kvrouter-warm"),
                    endpoint("127.0.0.1", "kvrouter-new", ready=False),
                ],
                ports=[warm_port],
            )
        )
        monkeypatch.setenv("POD_NAME", "kvrouter-new")
        monkeypatch.setenv("POD_NAMESPACE", "default")
        monkeypatch.delenv("POD_IP", raising=False)
        new = await joined_through_slices(stack, fw, fake, 20_000)
        bootstrap = new.replica.bootstrap
        assert bootstrap is not None
        assert bootstrap.registry.peers == (warm.url,) and bootstrap.registry.synced
        assert bootstrap.sources["peer"] == 1 and bootstrap.snapshot_outcomes["accepted"] >= 1
        assert canonical_view(new.replica.pump.rules.tree) == canonical_view(
            warm.replica.pump.rules.tree
        )
        assert len(canonical_view(new.replica.pump.rules.tree)) >= 12


async def test_a_sibling_in_two_services_slices_is_one_sibling_asked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The main port's Service and a --control-port Service (for a NetworkPolicy) both match
    the selector: the sibling is one sibling, on the port the joiner shares as control port."""
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        fw = await stack.enter_async_context(fake_worker_in_process(cache_blocks=10_000))
        control = free_tcp_port()
        # Its own loopback address, so the joiner can listen on the same control port.
        warm = await stack.enter_async_context(
            router_in_process(workers=[fw.url], host="127.0.0.2", control_port=control)
        )
        last = await warm.gate(fw)
        await warm.wait_cursor(fw.url, 0, last)
        main = urlsplit(warm.url).port
        assert main is not None
        pods = [endpoint("127.0.0.2", "kvrouter-warm"), endpoint("127.0.0.1", "kvrouter-new")]
        for service, port in (("kvrouter", main), ("kvrouter-control", control)):
            fake.put(
                endpoint_slice(f"{service}-abc", service, pods, ports=[port], labels={"app": "k"})
            )
        monkeypatch.setenv("POD_NAME", "kvrouter-new")
        monkeypatch.setenv("POD_NAMESPACE", "default")
        monkeypatch.delenv("POD_IP", raising=False)
        new = await stack.enter_async_context(
            router_in_process(
                workers=[fw.url],
                kv_peer_selector="app=k",
                kube_api_server=fake.url,
                control_port=control,  # the Deployment's flag: the same on every replica
                kv_bootstrap_timeout_ms=20_000,
            )
        )
        bootstrap = new.replica.bootstrap
        assert bootstrap is not None
        await eventually(lambda: bootstrap.registry.synced, 20.0)
        assert bootstrap.registry.peers == (f"http://127.0.0.2:{control}",)
        await eventually(lambda: bootstrap.sources["peer"] == 1, 20.0)
        assert sum(bootstrap.snapshot_outcomes.values()) == 1  # one sibling asked, once
        scrape = await new.scrape()
        assert scrape.value("kvrouter_kv_bootstrap_peers") == 1


async def test_a_replica_that_cannot_reach_any_api_server_exits_1_saying_what_to_set(
    tmp_path: Path,
) -> None:
    # Not in a pod, and a kubeconfig that does not exist.
    env = {"KUBERNETES_SERVICE_HOST": "", "KUBECONFIG": str(tmp_path / "missing")}
    port = str(free_tcp_port())
    status, out, err = await run_cli(
        "serve", "--host", "127.0.0.1", "--port", port, "--worker-selector", WORKERS, env=env
    )
    assert status == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvrouter: error: cannot reach the Kubernetes API")
    assert "KUBECONFIG" in last and "--kube-api-server" in last
    assert "listening" not in out


async def test_a_sibling_listed_at_a_legacy_ipv4_spelling_is_left_out_and_named_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The API server takes an IPv4 address with leading zeros; aiohttp refuses it, so a
    # joiner held itself unready for its whole bootstrap timeout asking a sibling it never
    # reached. Left out, the slice names no sibling: the joiner runs cold at once.
    monkeypatch.setenv("POD_NAME", "kvrouter-new")
    monkeypatch.setenv("POD_NAMESPACE", "default")
    monkeypatch.delenv("POD_IP", raising=False)
    port = free_tcp_port()
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        fw = await stack.enter_async_context(fake_worker_in_process())
        fake.put(
            endpoint_slice(
                "kvrouter-abcde",
                "kvrouter",
                [endpoint("127.000.000.001", "kvrouter-odd")],
                ports=[port],
            )
        )
        new = await joined_through_slices(stack, fw, fake, 60_000)
        bootstrap = new.replica.bootstrap
        assert bootstrap is not None
        assert bootstrap.registry.synced and bootstrap.registry.peers == ()
        assert bootstrap.sources["peer"] == 0
        assert any(
            "127.000.000.001" in r.getMessage() and "write it as 127.0.0.1" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]


async def test_the_bootstrap_start_line_names_where_siblings_are_found_not_a_static_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It read "peer bootstrap on: 0 static sibling(s)", as if this replica had none.
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeApiServer())
        with caplog.at_level(logging.INFO, logger="router.replica"):
            await stack.enter_async_context(
                router_in_process(
                    kv_peer_selector=SIBLINGS, kube_api_server=fake.url, namespace="fleet"
                )
            )
    lines = [r.getMessage() for r in caplog.records if "peer bootstrap on" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"peer bootstrap on: siblings from the EndpointSlices matching {SIBLINGS!r} in "
        "namespace 'fleet', timeout "
    ), lines
    assert "static" not in lines[0]
