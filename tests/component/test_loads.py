"""LoadMonitor over real HTTP on 127.0.0.1: the fake worker, and scripted engines that answer
/v1/loads with 404, 503, garbage, empty loads or nothing at all.

Each test asserts the probe outcome, which path was read (from the server's own request log)
and the figures that came back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
import pytest
from aiohttp import web

from router.dataplane.polling import PollClient
from router.loads import (
    LOADS_MAX_BODY_BYTES,
    MAX_METRIC_SAMPLES,
    METRICS_MAX_BODY_BYTES,
    EngineLoad,
    LoadMonitor,
)
from tests.support.clock import GatedSleep, ManualClock
from tests.support.fake_worker import FakeWorkerHandle, fake_worker_in_process
from tests.support.ports import free_tcp_port

pytestmark = pytest.mark.timeout(20)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

LOAD_BODY = msgspec.json.encode(
    {"loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 7, "token_usage": 0.5}]}
)
METRICS_TEXT = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75\n'
)
FROM_LOADS = EngineLoad(running=2, waiting=7, kv_usage=0.5)
FROM_METRICS = EngineLoad(running=4, waiting=1, kv_usage=0.75)


def reply(status: int, body: bytes | str = b"") -> Handler:
    async def handle(request: web.Request) -> web.Response:
        data = body.encode() if isinstance(body, str) else body
        return web.Response(status=status, body=data)

    return handle


class ScriptedEngine:
    """An engine stand-in. Each path answers from its script in order, the last reply
    repeating; a path with no script is a 404. `paths` logs every request, in order."""

    def __init__(self, scripts: dict[str, Sequence[Handler]]) -> None:
        self.scripts = {path: list(handlers) for path, handlers in scripts.items()}
        self.paths: list[str] = []
        self.closing = asyncio.Event()  # lets hanging handlers end when the server stops
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        script = self.scripts.get(request.path)
        if not script:
            return web.Response(status=404)
        handler = script.pop(0) if len(script) > 1 else script[0]
        return await handler(request)

    async def hang(self, request: web.Request) -> web.StreamResponse:
        await self.closing.wait()
        return web.Response(status=503)

    async def __aenter__(self) -> ScriptedEngine:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closing.set()
        assert self._runner is not None
        await self._runner.cleanup()

    def count(self, path: str) -> int:
        return self.paths.count(path)


@contextlib.asynccontextmanager
async def monitor(**kw: Any) -> AsyncIterator[LoadMonitor]:
    loads = LoadMonitor(PollClient(), **kw)
    try:
        yield loads
    finally:
        loads.close()


# --- the fake worker ------------------------------------------------------------------------


async def busy_rank_1(fw: FakeWorkerHandle) -> list[asyncio.Task[Any]]:
    """Two requests on dp rank 1 of a max_concurrency=1 worker: one running, one waiting."""

    async def complete() -> int:
        async with fw.session.post(
            fw.url + "/v1/completions",
            json={"prompt": "a prompt long enough for one block", "max_tokens": 0},
            headers={"X-Data-Parallel-Rank": "1"},
        ) as resp:
            return resp.status

    tasks = [asyncio.create_task(complete()) for _ in range(2)]
    async with asyncio.timeout(5):
        while (await fw.state(1))["waiting"] != 1:
            pass
    return tasks


async def test_the_fake_worker_is_read_via_v1_loads_per_rank() -> None:
    sleep = GatedSleep()
    async with (
        fake_worker_in_process(
            dp_size=2, max_concurrency=1, prefill_us_per_token=1.0, sleep=sleep
        ) as fw,
        monitor() as mon,
    ):
        tasks = await busy_rank_1(fw)
        mon.add_worker(fw.url, dp_size=2)
        await mon.poll_once()
        reported = (await fw.get("/v1/loads"))["loads"][1]["token_usage"]
        pool = fw.config.cache_blocks * fw.config.block_size
        assert mon.probe_outcomes == {"available": 1}
        assert mon.source(fw.url) == "loads"
        # max_concurrency=1: one slot a rank, stated as `max_running_requests`.
        assert mon.get(fw.url, 0) == EngineLoad(0, 0, 0.0, capacity_tokens=pool, slots=1)
        assert mon.get(fw.url, 1) == EngineLoad(1, 1, reported, capacity_tokens=pool, slots=1)
        assert mon.capacity_blocks(fw.url, 1, fw.config.block_size) == fw.config.cache_blocks
        sleep.release.set()
        assert await asyncio.gather(*tasks) == [200, 200]
        await mon.poll_once()
        # Idle, its cached blocks count as free: usage falls back to 0.
        assert reported > 0
        assert mon.get(fw.url, 1) == EngineLoad(0, 0, 0.0, capacity_tokens=pool, slots=1)


@contextlib.asynccontextmanager
async def without_v1_loads(fw: FakeWorkerHandle) -> AsyncIterator[ScriptedEngine]:
    """A front for the fake worker that 404s /v1/loads (as vLLM does) and relays /metrics."""

    async def relay_metrics(request: web.Request) -> web.Response:
        async with fw.session.get(fw.url + "/metrics") as resp:
            return web.Response(status=resp.status, body=await resp.read())

    async with ScriptedEngine({"/metrics": [relay_metrics]}) as front:
        yield front


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_worker_without_v1_loads_is_read_via_its_metrics_per_rank(engine: str) -> None:
    sleep = GatedSleep()
    async with (
        fake_worker_in_process(
            dp_size=2, max_concurrency=1, prefill_us_per_token=1.0, sleep=sleep, engine=engine
        ) as fw,
        without_v1_loads(fw) as front,
        monitor() as mon,
    ):
        tasks = await busy_rank_1(fw)
        mon.add_worker(front.url, dp_size=2)
        await mon.poll_once()
        reported = (await fw.get("/v1/loads"))["loads"][1]["token_usage"]
        assert mon.probe_outcomes == {"absent": 1}
        assert front.paths == ["/v1/loads", "/metrics"]  # absent: metrics on the same tick
        assert mon.source(front.url) == "metrics"
        # vLLM's num_gpu_blocks x block_size, or SGLang's max_total_num_tokens: the same pool.
        pool = fw.config.cache_blocks * fw.config.block_size
        assert mon.get(front.url, 0) == EngineLoad(0, 0, 0.0, capacity_tokens=pool)
        assert mon.get(front.url, 1) == EngineLoad(1, 1, reported, capacity_tokens=pool)
        assert mon.capacity_tokens(front.url, 1) == pool
        assert mon.capacity_blocks(front.url, 1, 32) == fw.config.cache_blocks // 2
        await mon.poll_once()
        assert front.paths == ["/v1/loads", "/metrics", "/metrics"]  # absent is remembered
        assert mon.probe_outcomes == {"absent": 1}
        sleep.release.set()
        await asyncio.gather(*tasks)


# --- scripted engines: one per probe outcome ------------------------------------------------


@pytest.mark.parametrize(
    "loads_reply",
    [
        pytest.param(reply(404), id="404"),
        pytest.param(reply(405), id="405"),
        pytest.param(reply(501), id="501"),
        pytest.param(reply(200, "<html>a dashboard</html>"), id="200-not-a-load-body"),
    ],
)
async def test_an_absent_verdict_reads_metrics_at_once_and_never_probes_again(
    loads_reply: Handler,
) -> None:
    scripts = {"/v1/loads": [loads_reply], "/metrics": [reply(200, METRICS_TEXT)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        for _ in range(3):
            await mon.poll_once()
        assert eng.paths == ["/v1/loads", "/metrics", "/metrics", "/metrics"]
        assert mon.probe_outcomes == {"absent": 1}
        assert (mon.source(eng.url), mon.probe_absent(eng.url)) == ("metrics", True)
        assert mon.get(eng.url) == FROM_METRICS


async def test_one_503_does_not_demote_a_worker_to_the_metrics_path() -> None:
    scripts = {
        "/v1/loads": [reply(503, "overloaded"), reply(200, LOAD_BODY)],
        "/metrics": [reply(200, METRICS_TEXT)],
    }
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert mon.probe_outcomes == {"inconclusive": 1}
        assert (mon.get(eng.url), mon.probe_absent(eng.url)) == (None, False)
        await mon.poll_once()
        assert eng.paths == ["/v1/loads", "/v1/loads"]  # /metrics never read
        assert mon.probe_outcomes == {"inconclusive": 1, "available": 1}
        assert (mon.source(eng.url), mon.get(eng.url)) == ("loads", FROM_LOADS)
        assert mon.poll_errors == {"http_503": 1}


@pytest.mark.parametrize("status", [500, 502, 503, 401, 403])
async def test_errors_are_inconclusive_and_retried_on_v1_loads(status: int) -> None:
    scripts = {"/v1/loads": [reply(status)], "/metrics": [reply(200, METRICS_TEXT)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        for _ in range(3):
            await mon.poll_once()
        assert eng.paths == ["/v1/loads"] * 3
        assert mon.probe_outcomes == {"inconclusive": 3}
        assert mon.poll_errors == {f"http_{status}": 3}
        assert mon.get(eng.url) is None


async def test_an_empty_loads_array_is_inconclusive_and_retried() -> None:
    scripts = {
        "/v1/loads": [reply(200, '{"loads": []}'), reply(200, LOAD_BODY)],
        "/metrics": [reply(200, METRICS_TEXT)],
    }
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert (mon.probe_outcomes, mon.poll_errors) == ({"inconclusive": 1}, {"empty_loads": 1})
        await mon.poll_once()
        assert eng.paths == ["/v1/loads", "/v1/loads"]
        assert mon.get(eng.url) == FROM_LOADS


async def test_a_timeout_is_inconclusive_within_the_timeout() -> None:
    async with ScriptedEngine({}) as eng, monitor(timeout_s=0.1) as mon:
        eng.scripts["/v1/loads"] = [eng.hang, reply(200, LOAD_BODY)]
        mon.add_worker(eng.url)
        async with asyncio.timeout(5):
            await mon.poll_once()
        assert (mon.probe_outcomes, mon.poll_errors) == ({"inconclusive": 1}, {"timeout": 1})
        await mon.poll_once()
        assert mon.get(eng.url) == FROM_LOADS


async def test_a_refused_connection_is_inconclusive() -> None:
    url = f"http://127.0.0.1:{free_tcp_port()}"  # nothing listens there
    async with monitor() as mon:
        mon.add_worker(url)
        await mon.poll_once()
        assert (mon.probe_outcomes, mon.poll_errors) == ({"inconclusive": 1}, {"connection": 1})
        assert (mon.get(url), mon.probe_absent(url)) == (None, False)


async def test_metrics_without_any_load_gauge_yield_unknown_and_count_an_error() -> None:
    scripts = {"/metrics": [reply(200, "# TYPE up gauge\nup 1\n")]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert mon.poll_errors == {"no_load_metrics": 1}
        assert mon.get(eng.url) is None


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="' + "9" * 400 + '"} 1.0\n',
            id="400-digit-blocks",
        ),
        pytest.param(
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'
            'vllm:num_requests_waiting{model_name="a"} 1e308\n'
            'vllm:num_requests_waiting{model_name="b"} 1e308\n',
            id="gauge-twice-1e308",
        ),
    ],
)
async def test_crafted_metrics_figures_are_unknown_counted_and_logged_once(
    text: str, caplog: pytest.LogCaptureFixture
) -> None:
    text += 'vllm:num_requests_running{engine="0"} 2.0\n'
    scripts = {"/metrics": [reply(200, text)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        for _ in range(3):
            await mon.poll_once()
        load = mon.get(eng.url)
        assert load is not None and (load.running, load.waiting) == (2, None)
        assert sum(mon.out_of_range.values()) >= 3 and mon.poll_errors == {}
        warnings = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
        assert len(warnings) == 1 and "Check what answers" in warnings[0].getMessage()
        assert warnings[0].exc_info is None  # a figure past belief, not a traceback


def many_labels_metrics(lines: int = 900, labels: int = 250) -> str:
    """Load gauge lines within `MAX_METRIC_SAMPLES` and `METRICS_MAX_BODY_BYTES` (1.9 MiB) whose
    label sets prometheus_client's parser took 3.3 s to read, every poll."""
    many = ",".join(f'l{j}="v"' for j in range(labels))
    return "".join(
        f'vllm:num_requests_running{{engine="0",{many},m="{i}"}} 1\n' for i in range(lines)
    )


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(
            "".join(
                f'vllm:num_requests_waiting{{engine="0",model_name="m{i}"}} 0\n'
                for i in range(MAX_METRIC_SAMPLES + 1)
            ),
            id="lines",
        ),
        pytest.param(many_labels_metrics(), id="labels"),
    ],
)
async def test_a_metrics_body_of_too_many_load_gauge_lines_is_a_counted_failure_logged_once(
    text: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert len(text) < METRICS_MAX_BODY_BYTES
    scripts = {"/metrics": [reply(200, text)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        await mon.poll_once()
        assert mon.poll_errors == {"too_many_samples": 2}
        assert mon.get(eng.url) is None
        assert len([r for r in caplog.records if "too many samples" in r.getMessage()]) == 1


@pytest.mark.parametrize(
    ("path", "limit"), [("/v1/loads", LOADS_MAX_BODY_BYTES), ("/metrics", METRICS_MAX_BODY_BYTES)]
)
async def test_a_load_body_past_its_bound_is_not_read(path: str, limit: int) -> None:
    if path == "/v1/loads":
        entry = b'{"num_waiting_reqs":0},'
        body = b'{"loads":[' + entry * (limit // len(entry)) + b'{"num_waiting_reqs":0}]}'
    else:
        body = METRICS_TEXT.encode() + b"# padding\n" * (limit // 10)
    scripts = {"/v1/loads": [reply(404)], path: [reply(200, body)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert mon.poll_errors == {"too_large": 1}
        assert mon.get(eng.url) is None


# --- registry, concurrency, staleness, the loop ---------------------------------------------


async def test_removing_and_registering_again_forgets_the_absent_verdict() -> None:
    scripts = {
        "/v1/loads": [reply(404), reply(200, LOAD_BODY)],
        "/metrics": [reply(200, METRICS_TEXT)],
    }
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert mon.get(eng.url) == FROM_METRICS
        mon.remove_worker(eng.url)
        assert mon.get(eng.url) is None
        mon.add_worker(eng.url)
        await mon.poll_once()
        assert eng.paths == ["/v1/loads", "/metrics", "/v1/loads"]
        assert (mon.source(eng.url), mon.get(eng.url)) == ("loads", FROM_LOADS)


async def test_registering_a_known_worker_again_reprobes_but_keeps_its_figures() -> None:
    scripts = {"/v1/loads": [reply(404), reply(503)], "/metrics": [reply(200, METRICS_TEXT)]}
    async with ScriptedEngine(scripts) as eng, monitor() as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        mon.add_worker(eng.url + "/")
        assert (mon.probe_absent(eng.url), mon.get(eng.url)) == (False, FROM_METRICS)
        await mon.poll_once()
        assert eng.paths == ["/v1/loads", "/metrics", "/v1/loads"]
        assert mon.get(eng.url) == FROM_METRICS


async def test_a_poll_answered_after_the_worker_was_removed_is_discarded() -> None:
    async with ScriptedEngine({}) as eng, monitor() as mon:
        asked, answer = asyncio.Event(), asyncio.Event()

        async def late(request: web.Request) -> web.Response:
            asked.set()
            await answer.wait()
            return web.Response(body=LOAD_BODY)

        eng.scripts["/v1/loads"] = [late]
        mon.add_worker(eng.url)
        poll = asyncio.create_task(mon.poll_once())
        await asyncio.wait_for(asked.wait(), 5)
        mon.remove_worker(eng.url)
        answer.set()
        await poll
        assert mon.probe_outcomes == {}
        mon.add_worker(eng.url)
        assert mon.get(eng.url) is None


async def test_a_registration_s_poll_and_a_tick_at_once_ask_v1_loads_once() -> None:
    # The tick comes due while the registration's poll waits on its 404: it waits for that
    # poll's verdict rather than asking again, and the absent verdict is counted once.
    async with ScriptedEngine({"/metrics": [reply(200, METRICS_TEXT)]}) as eng, monitor() as mon:
        asked, answer = asyncio.Event(), asyncio.Event()

        async def late_404(request: web.Request) -> web.Response:
            asked.set()
            await answer.wait()
            return web.Response(status=404)

        eng.scripts["/v1/loads"] = [late_404]
        mon.add_worker(eng.url)
        registration = asyncio.create_task(mon.poll_worker(eng.url))
        await asyncio.wait_for(asked.wait(), 5)
        tick = asyncio.create_task(mon.poll_once())
        answer.set()
        await asyncio.gather(registration, tick)
        assert eng.paths == ["/v1/loads", "/metrics"]
        assert mon.probe_outcomes == {"absent": 1}
        assert mon.get(eng.url) == FROM_METRICS
        await mon.poll_once()  # the next tick polls again, on the remembered verdict
        assert eng.paths == ["/v1/loads", "/metrics", "/metrics"]


async def test_workers_are_polled_concurrently() -> None:
    # Each engine answers only once both have been asked: a sequential poll would time out.
    both = asyncio.Barrier(2)

    async def rendezvous(request: web.Request) -> web.Response:
        await both.wait()
        return web.Response(body=LOAD_BODY)

    scripts = {"/v1/loads": [rendezvous]}
    async with (
        ScriptedEngine(scripts) as a,
        ScriptedEngine(scripts) as b,
        monitor(timeout_s=3.0) as mon,
    ):
        mon.add_worker(a.url)
        mon.add_worker(b.url)
        await mon.poll_once()
        assert mon.probe_outcomes == {"available": 2}
        assert mon.get(a.url) == mon.get(b.url) == FROM_LOADS


async def test_figures_survive_failed_ticks_until_they_are_stale() -> None:
    clock = ManualClock(50.0)
    scripts = {"/v1/loads": [reply(200, LOAD_BODY), reply(503)]}
    async with ScriptedEngine(scripts) as eng, monitor(stale_after_s=2.0, clock=clock) as mon:
        mon.add_worker(eng.url)
        await mon.poll_once()
        clock.now += 2.0
        await mon.poll_once()  # 503: nothing new
        assert mon.get(eng.url) == FROM_LOADS
        clock.now += 0.001
        assert mon.get(eng.url) is None


async def test_capacity_outlives_stale_loads_and_is_forgotten_on_registering_again() -> None:
    clock = ManualClock(50.0)
    with_pool = msgspec.json.encode(
        {"loads": [{"dp_rank": 0, "num_waiting_reqs": 1, "max_total_num_tokens": 4096}]}
    )
    without_pool = msgspec.json.encode({"loads": [{"dp_rank": 0, "num_waiting_reqs": 2}]})
    scripts = {"/v1/loads": [reply(200, with_pool), reply(200, without_pool), reply(503)]}
    async with ScriptedEngine(scripts) as eng, monitor(stale_after_s=2.0, clock=clock) as mon:
        mon.add_worker(eng.url)
        assert mon.capacity_tokens(eng.url) is None  # nothing read yet: unknown, not 0
        await mon.poll_once()
        assert mon.capacity_blocks(eng.url, 0, 16) == 256
        # With the registry's URL or one ending in a slash; a rank or worker never reported.
        assert mon.capacity_blocks(eng.url + "/", 0, 64) == 64
        assert mon.capacity_blocks(eng.url, 1, 16) is None
        assert mon.capacity_blocks("http://127.0.0.1:9", 0, 16) is None
        await mon.poll_once()  # a read that does not state the pool keeps the last one
        assert mon.get(eng.url) == EngineLoad(waiting=2)
        assert mon.capacity_tokens(eng.url) == 4096
        clock.now += 10.0
        await mon.poll_once()  # 503, and the loads are stale: the configuration is not
        assert mon.get(eng.url) is None
        assert mon.capacity_tokens(eng.url) == 4096
        assert mon.capacity_tokens(eng.url, 1) is None  # a rank never reported
        mon.add_worker(eng.url)  # perhaps another engine behind the URL now
        assert mon.capacity_tokens(eng.url) is None
        mon.remove_worker(eng.url)
        assert mon.capacity_blocks(eng.url, 0, 16) is None
        with pytest.raises(ValueError, match="block_size"):
            mon.capacity_blocks(eng.url, 0, 0)


async def test_run_polls_every_interval_until_cancelled() -> None:
    naps: asyncio.Queue[float] = asyncio.Queue()
    wake = asyncio.Event()

    async def sleep(seconds: float) -> None:
        naps.put_nowait(seconds)
        await wake.wait()
        wake.clear()

    scripts = {"/v1/loads": [reply(200, LOAD_BODY)]}
    async with (
        ScriptedEngine(scripts) as eng,
        monitor(interval_s=0.25, clock=ManualClock(50.0), sleep=sleep) as mon,
    ):
        mon.add_worker(eng.url)
        task = asyncio.create_task(mon.run())
        assert await asyncio.wait_for(naps.get(), 5) == 0.25
        assert eng.count("/v1/loads") == 1
        wake.set()
        assert await asyncio.wait_for(naps.get(), 5) == 0.25
        assert eng.count("/v1/loads") == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert mon.probe_outcomes == {"available": 2}
