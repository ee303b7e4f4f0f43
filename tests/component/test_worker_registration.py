"""A worker's registration over real HTTP: its /server_info cannot point the replica's KV-event
connections outside `--worker-allow-cidr` or at ports that are none, and one engine is one
worker however its address is spelt."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from cachetree.ranks import RankId
from router.workers import METRICS_SOURCE, subscriber_name
from tests.support.adversary import front, stub_server, stub_worker_routes
from tests.support.fake_worker import fake_worker_in_process
from tests.support.router import RouterHandle, router_in_process
from tests.support.waiting import eventually


@dataclass
class Listener:
    """A TCP listener standing where a worker points the replica's subscriptions."""

    host: str
    port: int = 0
    accepted: list[str] = field(default_factory=list)  # peers, one per connection


@contextlib.asynccontextmanager
async def tcp_listener(host: str) -> AsyncIterator[Listener]:
    listener = Listener(host)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.accepted.append(str(writer.get_extra_info("peername")))
        writer.close()

    server = await asyncio.start_server(accept, host, 0)
    listener.port = server.sockets[0].getsockname()[1]
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def worker_announcing(**kv: Any) -> AsyncIterator[str]:
    """A worker on 127.0.0.1 whose /server_info's `kv_events` says `kv`."""

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"kv_events": {"block_size": 16, "dp_size": 1, **kv}})

    async with stub_server(stub_worker_routes({("GET", "/server_info"): server_info})) as url:
        yield url


async def assert_refused_and_never_subscribed(
    rt: RouterHandle, url: str, body: dict[str, Any], words: str
) -> None:
    assert body["error"]["param"] == "url" and words in body["error"]["message"], body
    assert body["worker"]["state"] == "refused" and body["worker"]["url"] == url, body
    registry = rt.replica.workers
    assert registry.stats.refused == {"kv_events_endpoint": 1}
    assert [(w.url, w.state) for w in registry.workers()] == [(url, "refused")]
    assert registry.routable() == [] and registry.subscribed_ranks == 0
    assert registry.get(url).tasks == []  # type: ignore[union-attr]
    assert rt.replica.supervisor.state(subscriber_name(RankId(url, 0))) is None
    assert RankId(url, 0) not in rt.replica.pump.rules.live
    scrape = await rt.scrape()
    assert scrape.value("kvrouter_workers_refused_total", reason="kv_events_endpoint") == 1
    assert scrape.value("kvrouter_rank_subscriptions", kind="in_use") == 0


async def test_an_endpoint_host_outside_the_allow_list_is_a_409_and_never_connected_to() -> None:
    """A worker inside `--worker-allow-cidr 127.0.0.1/32` whose /server_info named 127.0.0.2
    had the replica connect there, for every rank, every 2 s, for good."""
    async with (
        tcp_listener("127.0.0.2") as elsewhere,
        worker_announcing(endpoint_host="127.0.0.2", endpoint_port_base=elsewhere.port) as url,
        router_in_process(worker_allow_cidr=["127.0.0.1/32"]) as rt,
    ):
        for _ in range(2):  # and again: a known refused worker is no success either
            status, body, _ = await rt.post("/workers", {"url": url})
            assert status == 409, body
            await assert_refused_and_never_subscribed(
                rt,
                url,
                body,
                "not on its own host 127.0.0.1, and 127.0.0.2 (127.0.0.2) is "
                "outside --worker-allow-cidr (127.0.0.1/32)",
            )
        assert body["worker"]["kv_events"]["host"] == "127.0.0.2"  # what it announced
        assert elsewhere.accepted == []


async def test_an_endpoint_host_outside_the_allow_list_is_refused_for_a_flag_worker_too() -> None:
    """The flags' worker URL is the operator's; where its /server_info points is not."""
    async with (
        tcp_listener("127.0.0.2") as elsewhere,
        worker_announcing(endpoint_host="127.0.0.2", endpoint_port_base=elsewhere.port) as url,
        router_in_process(workers=[url], worker_allow_cidr=["10.0.0.0/8"]) as rt,
    ):
        worker = rt.replica.workers.get(url)
        assert worker is not None and worker.state == "refused", worker
        assert "outside --worker-allow-cidr" in worker.reason
        assert rt.replica.workers.subscribed_ranks == 0 and elsewhere.accepted == []


async def test_an_endpoint_host_inside_the_allow_list_is_subscribed_to() -> None:
    """Another host is fine where the list allows it; and the listener sees a subscription
    when one is made (what the refusals above assert never came)."""
    async with (
        tcp_listener("127.0.0.2") as elsewhere,
        worker_announcing(endpoint_host="127.0.0.2", endpoint_port_base=elsewhere.port) as url,
        router_in_process(worker_allow_cidr=["127.0.0.0/8"]) as rt,
    ):
        status, body, _ = await rt.post("/workers", {"url": url})
        assert status == 200 and body["state"] == "ready", body
        assert rt.replica.workers.subscribed_ranks == 1
        await eventually(lambda: elsewhere.accepted)


@pytest.mark.parametrize(
    "kv,words",
    [
        ({"endpoint_port_base": 70000}, "ports 70000..70000, not all in 1..65535"),
        ({"endpoint_port_base": -5}, "ports -5..-5"),
        ({"endpoint_port_base": 65535, "dp_size": 3}, "ports 65535..65537"),
        ({"endpoint_port_base": 70000, "dp_size": 1024}, "ports 70000..71023"),
        ({"endpoint_port_base": 5557, "replay_endpoint_port_base": 70000}, "replay endpoint"),
        ({"endpoint_host": "127.1", "endpoint_port_base": 5557}, "write it as 127.0.0.1"),
        ({"endpoint_host": "fe80::1%eth0", "endpoint_port_base": 5557}, "(zone eth0) is reached"),
        ({"endpoint_host": "fe80::1", "endpoint_port_base": 5557}, "a named network interface"),
    ],
    ids=[
        "past_65535",
        "negative",
        "last_rank_past",
        "1024_ranks",
        "replay",
        "legacy_ipv4",
        "ipv6_zone",
        "link_local",
    ],
)
async def test_an_endpoint_no_rank_can_be_subscribed_at_is_a_409_and_nothing_subscribes(
    kv: dict[str, Any], words: str
) -> None:
    """Port 70000 (or -5, or 65535 with three ranks) registered ready; each rank's subscriber
    then failed to parse its endpoint and warned every 2 s, for good (1,024 lines every 2 s
    for 1,024 ranks), while `GET /workers` showed no subscriber failing at all."""
    async with worker_announcing(**kv) as url, router_in_process() as rt:
        status, body, _ = await rt.post("/workers", {"url": url})
        assert status == 409, body
        await assert_refused_and_never_subscribed(rt, url, body, words)


async def test_one_engine_under_other_spellings_is_one_worker() -> None:
    """`http://[::ffff:127.0.0.1]:P` and `http://[::ffff:7f00:1]:P` each registered as a
    worker of their own beside `http://127.0.0.1:P`: one stream subscribed three times, its
    ranks counted three times in the index and the loads. Each is now a re-registration."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        registry = rt.replica.workers
        port = fw.url.rpartition(":")[2]
        for spelt in (
            f"http://[::ffff:127.0.0.1]:{port}",
            f"http://[::FFFF:7f00:1]:{port}/",
            f"http://[0:0:0:0:0:ffff:127.0.0.1]:{port}",
        ):
            status, body, _ = await rt.post("/workers", {"url": spelt})
            assert status == 200, (spelt, body)
            assert body["url"] == fw.url and body["state"] == "ready", body
        assert [w.url for w in registry.workers()] == [fw.url]
        assert registry.subscribed_ranks == 1
        assert rt.replica.pump.rules.live == {RankId(fw.url, 0)}
        scrape = await rt.scrape()
        assert scrape.value("kvrouter_rank_subscriptions", kind="in_use") == 1
        status, body = await rt.delete(f"/workers?url=http://[::ffff:127.0.0.1]:{port}")
        assert status == 200 and body == {"removed": fw.url}, body
        assert registry.workers() == []


async def test_a_default_port_written_or_not_host_case_and_a_trailing_slash_are_one_worker() -> (
    None
):
    """`http://127.0.0.1` and `http://127.0.0.1:80` were two workers (one connection, one
    stream, two listings): its requests, in-flight counts and ranks split between them. Port
    80 has no engine in the test, so each stays down; the listing is what splits."""
    async with router_in_process() as rt:
        for spelt in ("http://127.0.0.1", "http://127.0.0.1:80", "HTTP://127.0.0.1:80/"):
            status, body, _ = await rt.post("/workers", {"url": spelt})
            assert status == 200, (spelt, body)
            assert body["url"] == "http://127.0.0.1", body
        assert [w.url for w in rt.replica.workers.workers()] == ["http://127.0.0.1"]
        status, body = await rt.delete("/workers?url=http://127.0.0.1:80/")
        assert status == 200 and body == {"removed": "http://127.0.0.1"}, body
        assert rt.replica.workers.workers() == []


async def test_localhost_is_127_0_0_1_one_worker_and_the_fold_is_logged_naming_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`--worker http://localhost:P` and `POST /workers http://127.0.0.1:P` were two workers:
    one stream subscribed twice, one engine's requests and in-flight counts split in two."""
    async with fake_worker_in_process() as fw:
        port = fw.url.rpartition(":")[2]
        async with router_in_process(
            workers=[f"http://localhost:{port}"], expose_route_headers=True
        ) as rt:
            registry = rt.replica.workers
            assert [w.url for w in registry.workers()] == [fw.url]  # fw.url: 127.0.0.1
            for spelt in (fw.url, f"http://LOCALHOST:{port}/"):
                status, body, _ = await rt.post("/workers", {"url": spelt})
                assert status == 200 and body["url"] == fw.url, (spelt, body)
            assert [w.url for w in registry.workers()] == [fw.url]
            assert registry.subscribed_ranks == 1
            assert rt.replica.pump.rules.live == {RankId(fw.url, 0)}
            await eventually(lambda: registry.routable() != [], 10)
            for _ in range(2):
                status, _, headers = await rt.post(
                    "/v1/completions", {"prompt": "one engine", "max_tokens": 1}
                )
                assert status == 200 and headers["X-Kvrouter-Worker"] == fw.url, headers
            assert (await fw.state())["requests"] == 2
            status, body = await rt.delete(f"/workers?url=http://localhost:{port}")
            assert status == 200 and body == {"removed": fw.url}, body
            assert registry.workers() == []
    folds = [r.getMessage() for r in caplog.records if "localhost is taken for" in r.getMessage()]
    assert len(folds) == 2, folds  # the flag's and the POST's, each naming both spellings
    assert f"http://localhost:{port} is {fw.url}" in folds[0], folds


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "[::ffff:0.0.0.0]"])
async def test_a_worker_on_the_unspecified_address_is_a_400_and_registers_nothing(
    host: str,
) -> None:
    """`http://0.0.0.0:P` (what an engine's log says it listens on) registered as one more
    worker beside `http://127.0.0.1:P`: the replica connects to its own machine there."""
    async with fake_worker_in_process() as fw, router_in_process(workers=[fw.url]) as rt:
        port = fw.url.rpartition(":")[2]
        status, body, _ = await rt.post("/workers", {"url": f"http://{host}:{port}"})
        assert status == 400, body
        assert "unspecified address" in body["error"]["message"], body
        assert body["error"]["param"] == "url"
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
        assert rt.replica.workers.subscribed_ranks == 1


async def test_an_ipv4_mapped_address_cannot_pass_an_ipv4_allow_list_it_is_outside() -> None:
    async with (
        fake_worker_in_process() as fw,
        router_in_process(worker_allow_cidr=["127.0.0.1/32"]) as rt,
    ):
        port = fw.url.rpartition(":")[2]
        status, body, _ = await rt.post("/workers", {"url": f"http://[::ffff:127.0.0.2]:{port}"})
        assert status == 403 and "outside --worker-allow-cidr" in body["error"]["message"], body
        status, body, _ = await rt.post("/workers", {"url": f"http://[::ffff:7f00:1]:{port}"})
        assert status == 200 and body["url"] == fw.url, body
        assert [w.url for w in rt.replica.workers.workers()] == [fw.url]


async def test_an_ipv4_mapped_allow_list_admits_the_ipv4_workers_it_maps_and_no_other() -> None:
    """`--worker-allow-cidr ::ffff:127.0.0.0/104` matched nothing: every worker was a 403,
    the one on 127.0.0.1 it was written for too."""
    async with fake_worker_in_process() as fw:
        port = fw.url.rpartition(":")[2]
        async with router_in_process(worker_allow_cidr=["::ffff:127.0.0.0/104"]) as rt:
            for spelt in (fw.url, f"http://[::ffff:127.0.0.1]:{port}"):
                status, body, _ = await rt.post("/workers", {"url": spelt})
                assert status == 200 and body["url"] == fw.url, (spelt, body)
            assert [w.url for w in rt.replica.workers.workers()] == [fw.url]
            assert rt.replica.workers.subscribed_ranks == 1
        async with router_in_process(worker_allow_cidr=["::ffff:10.0.0.0/104"]) as rt:
            status, body, _ = await rt.post("/workers", {"url": fw.url})
            assert status == 403, body
            assert (
                "127.0.0.1 (127.0.0.1) is outside --worker-allow-cidr (10.0.0.0/8)"
                in (body["error"]["message"])
            ), body
            assert rt.replica.workers.workers() == []


async def test_without_block_size_the_first_listed_worker_decides_it_the_others_waiting() -> None:
    """`--block-size 0` learns it "from the first worker": all registered at once, the one
    that answered first decided, and the first listed (here 32, answering a little later)
    was refused for a later one's 16. The others are not even asked until it decided (the
    first's answer waits a bounded while to see whether the second is asked meanwhile)."""
    second_asked = asyncio.Event()
    asked_before_first_answered: list[bool] = []

    async def first_info(request: web.Request) -> web.Response:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(second_asked.wait(), 0.3)
        asked_before_first_answered.append(second_asked.is_set())
        return web.json_response({"kv_events": {"block_size": 32, "endpoint_port_base": 1}})

    async def second_info(request: web.Request) -> web.Response:
        second_asked.set()
        return web.json_response({"kv_events": {"block_size": 16, "endpoint_port_base": 1}})

    async with (
        stub_server(stub_worker_routes({("GET", "/server_info"): first_info})) as first,
        stub_server(stub_worker_routes({("GET", "/server_info"): second_info})) as second,
        router_in_process(workers=[first, second], block_size=None) as rt,
    ):
        registry = rt.replica.workers
        assert asked_before_first_answered == [False]
        assert registry.block_size == 32
        assert [(w.url, w.state) for w in registry.workers()] == [
            (first, "ready"),
            (second, "refused"),
        ]
        assert "block size 16 differs from the fleet's 32" in registry.get(second).reason  # type: ignore[union-attr]


async def test_a_refused_worker_is_counted_by_state_while_it_stays_refused() -> None:
    """A worker restarted with another block size left /metrics only a counter of its
    refusal, whose increase the alert saw for 10 minutes: then the fleet ran one worker short
    with nothing telling of it (no kvrouter_worker_healthy for a refused worker, its breaker
    closed). The states a worker is admitted in are exposed at 0 too; a refused one with its
    reason, as the alert names it."""

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"kv_events": {"block_size": 32, "endpoint_port_base": 1}})

    async with (
        worker_announcing(endpoint_port_base=1) as good,
        stub_server(stub_worker_routes({("GET", "/server_info"): server_info})) as refused,
        router_in_process(workers=[good, refused], block_size=16) as rt,
    ):
        assert [(w.url, w.state) for w in rt.replica.workers.workers()] == [
            (good, "ready"),
            (refused, "refused"),
        ]
        scrape = await rt.scrape()
        assert {
            dict(labels)["state"]: v for labels, v in scrape.series("kvrouter_workers").items()
        } == {
            "discovering": 0,
            "ready": 1,
            "down": 0,
            "refused": 1,
        }
        assert scrape.value("kvrouter_workers", state="refused", reason="block_size") == 1
        assert scrape.value("kvrouter_workers_refused_total", reason="block_size") == 1
        assert scrape.by("kvrouter_worker_healthy", "worker") == {good: 1}


@pytest.mark.parametrize(("engine_dp", "flag_dp"), [(1, 2), (2, 1)])
async def test_a_vllm_worker_without_server_info_has_the_dp_size_its_metrics_state(
    engine_dp: int, flag_dp: int
) -> None:
    """Real vLLM serves no /server_info (nor /v1/loads): `--dp-size` was every such worker's,
    and one with fewer ranks than the flag was routed to a rank it did not have (the engine
    answered 400), its subscriber retrying a port nothing published on; one with more had
    ranks never routed to nor subscribed. Its /metrics label each engine core (`engine`)."""
    hidden = {"/server_info": (404, b""), "/v1/loads": (404, b"")}
    async with (
        fake_worker_in_process(dp_size=engine_dp) as fw,
        front(fw, hidden) as url,
        router_in_process(
            workers=[url],
            dp_size=flag_dp,
            kv_events_port_base=fw.config.kv_port_base,
            expose_route_headers=True,
        ) as rt,
    ):
        served: dict[str, int] = {}
        for i in range(8):
            status, body, headers = await rt.post(
                "/v1/completions",
                {"model": "fake-model", "prompt": f"prompt {i} " + "x" * 64, "max_tokens": 1},
            )
            assert status == 200, body
            rank = headers["X-Kvrouter-Dp-Rank"]
            served[rank] = served.get(rank, 0) + 1
        assert set(served) <= {str(r) for r in range(engine_dp)}, served
        worker = rt.replica.workers.get(url)
        assert worker is not None and worker.state == "ready"
        assert worker.ranks() == tuple(RankId(url, r) for r in range(engine_dp))
        assert rt.replica.pump.rules.live == set(worker.ranks())
        assert worker.kv is not None and worker.kv.source == METRICS_SOURCE


@pytest.mark.parametrize("fleet_block_size", [16, None])
async def test_a_vllm_worker_without_server_info_has_the_block_size_its_metrics_state(
    fleet_block_size: int | None,
) -> None:
    """vLLM's /metrics states its block size (`vllm:cache_config_info`'s `block_size`): one of
    another size than the fleet's was admitted, taking traffic until its first store refused
    it, and admitted again at every later look; and `--block-size 0` could not learn from a
    vLLM. Now it is read at registration: refused at once, or the fleet's size learned."""
    hidden = {"/server_info": (404, b""), "/v1/loads": (404, b"")}
    async with (
        fake_worker_in_process(block_size=32) as fw,
        front(fw, hidden) as url,
        router_in_process(
            workers=[url], block_size=fleet_block_size, kv_events_port_base=fw.config.kv_port_base
        ) as rt,
    ):
        registry = rt.replica.workers
        worker = registry.get(url)
        assert worker is not None and worker.kv is not None
        assert (worker.kv.block_size, worker.kv.source) == (32, METRICS_SOURCE)
        if fleet_block_size is None:
            assert worker.state == "ready" and registry.block_size == 32
        else:
            assert worker.state == "refused" and "block size 32 differs" in worker.reason
            assert registry.stats.refused["block_size"] == 1
            assert registry.routable() == []


VLLM_STYLE = {"/server_info": (404, b""), "/v1/loads": (404, b"")}  # no description of its own


async def completions_to(rt: RouterHandle, n: int) -> set[str]:
    """`n` new prompts through the router: the workers that served them."""
    served = set()
    for i in range(n):
        status, body, headers = await rt.post(
            "/v1/completions", {"prompt": f"shared endpoint {i} " + "x" * 64, "max_tokens": 1}
        )
        assert status == 200, body
        served.add(headers["X-Kvrouter-Worker"])
    return served


async def test_a_worker_on_a_kv_event_endpoint_another_is_subscribed_at_is_a_409_naming_it() -> (
    None
):
    """Two vLLM-style workers on one host (no /server_info) both took the flags' port base:
    both were subscribed to the first's publisher, the second "held" every block the first
    cached and drew half of its repeats, missing each, while its own events went unread.
    Refused now, until the holder leaves; then the holder, registered again, is refused."""
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as c,
        front(a, VLLM_STYLE) as a_url,
        front(c, VLLM_STYLE) as c_url,
        router_in_process(
            workers=[a_url], kv_events_port_base=a.config.kv_port_base, expose_route_headers=True
        ) as rt,
    ):
        registry = rt.replica.workers
        endpoint = f"tcp://127.0.0.1:{a.config.kv_port_base}"
        status, body, _ = await rt.post("/workers", {"url": c_url})
        assert status == 409, body
        assert body["worker"]["state"] == "refused", body
        assert (
            f"rank 0's KV-event endpoint {endpoint} (flags, /metrics) is where worker {a_url}'s "
            "rank 0 is subscribed already" in body["error"]["message"]
        ), body
        assert registry.stats.refused == {"shared_kv_events_endpoint": 1}
        assert registry.subscribed_ranks == 1
        assert rt.replica.pump.rules.live == {RankId(a_url, 0)}
        scrape = await rt.scrape()
        assert (
            scrape.value("kvrouter_workers_refused_total", reason="shared_kv_events_endpoint") == 1
        )
        await eventually(lambda: registry.routable() != [], 10)
        assert await completions_to(rt, 4) == {a_url}
        assert ((await a.state())["requests"], (await c.state())["requests"]) == (4, 0)

        status, _ = await rt.delete(f"/workers?url={a_url}")
        assert status == 200
        # The health loop's next look at the refused worker admits it: the endpoint is free.
        await eventually(lambda: registry.get(c_url).state == "ready", 10)  # type: ignore[union-attr]
        assert rt.replica.pump.rules.live == {RankId(c_url, 0)}
        status, body, _ = await rt.post("/workers", {"url": a_url})
        assert status == 409, body
        assert f"is where worker {c_url}'s rank 0 is subscribed already" in body["error"]["message"]


async def test_of_two_listed_workers_on_one_kv_event_endpoint_one_is_refused_naming_the_other() -> (
    None
):
    """`--worker A --worker C` register at once: both passed any check made before either
    was subscribed."""
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as c,
        front(a, VLLM_STYLE) as a_url,
        front(c, VLLM_STYLE) as c_url,
        router_in_process(workers=[a_url, c_url], kv_events_port_base=a.config.kv_port_base) as rt,
    ):
        states = {w.url: (w.state, w.reason) for w in rt.replica.workers.workers()}
        assert sorted(state for state, _ in states.values()) == ["ready", "refused"], states
        (refused, (_, reason)), *_ = [(u, s) for u, s in states.items() if s[0] == "refused"]
        other = c_url if refused == a_url else a_url
        assert f"is where worker {other}'s rank 0 is subscribed already" in reason, reason
        assert rt.replica.workers.subscribed_ranks == 1


async def test_a_server_info_naming_another_workers_endpoint_by_a_host_name_is_refused() -> None:
    """A worker's /server_info may name any host: `localhost` resolves to the address the
    first worker's events are subscribed at, and that worker drew all of the first's repeats."""
    async with (
        fake_worker_in_process() as a,
        router_in_process(workers=[a.url]) as rt,
        worker_announcing(
            endpoint_host="localhost", endpoint_port_base=a.config.kv_port_base
        ) as url,
    ):
        status, body, _ = await rt.post("/workers", {"url": url})
        assert status == 409, body
        assert f"is where worker {a.url}'s rank 0 is subscribed already" in body["error"]["message"]
        assert rt.replica.workers.subscribed_ranks == 1
