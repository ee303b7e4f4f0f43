"""SIGTERM on one replica of two while it relays a stream, with a balancer in front that
follows `/readyz` as a Kubernetes Service does.

The stream through the stopping replica completes; its `/readyz` turns 503 at once, so the
balancer sends every new request to the other replica, which serves it; the stopping replica
exits 0 once its stream is done. One whose tokenize threads are rendering exits once stopped.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.support.cluster import Cluster, RouterProcess, wait_all_ready
from tests.support.model_dirs import build_model_dir
from tests.support.router import RouterClient
from tests.support.sse import assert_complete_completion, first_event
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

DECODE_MS = 20
STREAM_TOKENS = 100  # 2 s of decoding: the replica drains for that long


async def balanced(replicas: list[RouterProcess]) -> RouterProcess:
    """A balancer's pick: the first replica whose `/readyz` says 200."""
    for replica in replicas:
        if (await replica.readyz())[0] == 200:
            return replica
    raise AssertionError("no replica is ready")


async def completions_forwarded(replica: RouterClient) -> float:
    """Completions the replica forwarded (counted when the worker's answer began)."""
    series = (await replica.scrape()).series("kvrouter_requests_total")
    return sum(v for labels, v in series.items() if ("route", "/v1/completions") in labels)


async def test_sigterm_mid_stream_completes_the_stream_and_new_requests_go_to_the_other_replica(
    cluster: Cluster,
) -> None:
    fw = await cluster.worker("w", decode_ms_per_token=DECODE_MS)
    stopping, staying = await asyncio.gather(
        cluster.router("stopping", workers=[fw]), cluster.router("staying", workers=[fw])
    )
    replicas = [stopping, staying]
    await wait_all_ready(replicas)
    assert await balanced(replicas) is stopping

    body = {"prompt": "tell me a long story", "max_tokens": STREAM_TOKENS, "stream": True}
    async with stopping.session.post(stopping.url + "/v1/completions", json=body) as stream:
        assert stream.status == 200
        raw = await first_event(stream)
        stopping.child.send(signal.SIGTERM)

        async def draining() -> bool:
            return await stopping.readyz() == (503, "draining")

        await eventually(draining, 2, poll_s=0.01)
        # The balancer now picks the other replica for every new request, and it serves them.
        for i in range(3):
            chosen = await balanced(replicas)
            assert chosen is staying
            status, payload, _ = await chosen.post(
                "/v1/completions", {"prompt": f"a new request {i}", "max_tokens": 1}
            )
            assert status == 200, payload
        # Still draining (the stream has seconds to go): the stream is all it ever forwarded.
        assert stopping.child.returncode is None
        assert await completions_forwarded(stopping) == 1
        raw += await asyncio.wait_for(stream.read(), 30)

    assert_complete_completion(raw, STREAM_TOKENS)
    assert await stopping.child.wait_exit(10) == 0, stopping.child.tail()
    assert await completions_forwarded(staying) == 3
    assert (await fw.state())["requests"] == 1 + 3  # nothing retried, nothing lost


# Minutes per chat: 100,000 steps of the template's own loop a message (jinja's range bound).
SLOW_TEMPLATE = (
    "{% for m in messages %}{% for _ in range(99999) %}{% endfor %}{{ m.content }}{% endfor %}"
)


async def test_a_replica_whose_threads_are_rendering_exits_once_stopped(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Its encodes ran in a ThreadPoolExecutor, whose threads the interpreter joins at exit:
    a replica SIGTERMed while a slow template rendered logged "stopped" and lived on ~90 s."""
    pytest.importorskip("transformers", reason="needs the hf extra")
    model = build_model_dir(tmp_path / "slow", "qwen", SLOW_TEMPLATE)
    fw = await cluster.worker("w")
    replica = await cluster.router(
        "r", "--tokenizer", str(model), "--drain-timeout-s", "0.5", workers=[fw]
    )
    await replica.wait_ready()
    chat = {"messages": [{"role": "user", "content": f"turn {i} " * 8} for i in range(5000)]}
    rendering = asyncio.create_task(replica.post("/v1/chat/completions", chat))

    async def started() -> bool:
        scrape = await replica.scrape()
        return scrape.value("kvrouter_tokenize_offloads_total", outcome="started") == 1

    try:
        await eventually(started, 10)
        replica.child.send(signal.SIGTERM)
        assert await replica.child.wait_exit(10) == 0, replica.child.tail()
    finally:
        rendering.cancel()
    assert (await fw.state())["requests"] == 0  # never routed: the render never ended
