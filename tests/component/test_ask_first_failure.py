"""The data plane's guard around a new prefix's routing once its placer answered
(`ClientConnection._placed`): a failure there is a 500 with the OpenAI error JSON and a log
line, never a client left waiting, and the connection serves its next request.

The data plane runs as in a replica; its `Router` (the interface it routes through) is a small
one of this test's whose every request is a new prefix: a real `PlacementAsker` asks a placer
that is gone (a closed port on 127.0.0.1), and the decision on the answer raises, the bug the
guard contains."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from router.dataplane.exchange import Refusal
from router.dataplane.inflight import InflightTracker
from router.dataplane.server import DataPlane, Limits
from router.metrics import RouterMetrics
from router.placement import AskFirst, Placement, PlacementAsker
from router.policy import CacheAware, Decision, Prompt, make_policy
from router.workers import Worker
from tests.support.ports import free_tcp_port

pytestmark = pytest.mark.timeout(20)


class BrokenAfterTheAnswer:
    """A `Router` and `WorkerLookup`: each request is a new prefix whose decision raises."""

    def __init__(self, asker: PlacementAsker, placer: str) -> None:
        self.asker = asker
        self.placer = placer
        self.resumed = 0

    def route(self, route: bytes, raw: bytes) -> Decision | Refusal | AskFirst:
        prompt = Prompt(32, 16, None, [11, 12])
        return AskFirst(self.placer, prompt, self.asker, self._resume)

    def _resume(self, ask: AskFirst) -> Decision | Refusal:
        self.resumed += 1
        raise RuntimeError("a bug after the placer's answer")

    def get(self, url: str) -> Worker | None:
        return None


async def test_a_failure_routing_after_the_placers_answer_is_a_500_not_a_hung_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead_placer = f"http://127.0.0.1:{free_tcp_port()}"
    policy = make_policy("cache_aware")
    assert isinstance(policy, CacheAware)
    placement = Placement(policy, "http://127.0.0.1:1", lambda: [dead_placer])
    control = web.AppRunner(web.Application(), access_log=None)
    await control.setup()
    assert control.server is not None
    async with aiohttp.ClientSession() as session, aiohttp.ClientSession() as client:
        asker = PlacementAsker(session, "token", placement, timeout_s=2.0)
        router = BrokenAfterTheAnswer(asker, dead_placer)
        plane = DataPlane(
            router, router, InflightTracker(), RouterMetrics(), control.server, Limits()
        )
        await plane.listen("127.0.0.1", 0)
        url = f"http://127.0.0.1:{plane.addresses[0][1]}/v1/completions"
        try:
            for _ in range(2):  # the same keep-alive connection serves the second one
                async with client.post(url, json={"prompt": "x" * 32}) as resp:
                    assert resp.status == 500
                    error = (await resp.json())["error"]
                    assert error["type"] == "server_error"
                    assert "failed to route" in error["message"]
        finally:
            await plane.close()
            await control.cleanup()
    assert router.resumed == 2  # the answer (none: the placer is gone) came, then the bug
    assert placement.counts["error"] == 2  # the asker counted the dead placer
    assert "routing a new prefix after its placer's answer failed" in caplog.text
