"""Issue 13, row 9: a worker SIGSTOPped with a request in flight.

Before: the request hung until the 300 s head timeout, although health marked the worker down
within 4 s. Nothing was sent to the client yet, so it must fail over as soon as health says
the worker is down (`router/dataplane/`: the relay's `worker_down`).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.support.cluster import Cluster
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)


async def test_a_request_waiting_on_a_frozen_worker_fails_over_when_health_says_down(
    cluster: Cluster,
) -> None:
    # Slow decoding: a completion takes seconds, so the freeze lands before its head.
    slow = {"decode_ms_per_token": 200.0}
    a, b = await asyncio.gather(cluster.worker("a", **slow), cluster.worker("b", **slow))
    rt = await cluster.router("r", workers=[a, b])
    await rt.wait_ready()
    body = {"prompt": "A request that will be caught in a freeze.", "max_tokens": 20}
    started = time.monotonic()
    request = asyncio.create_task(rt.post("/v1/completions", body))

    async def in_flight() -> str | None:
        for fw in (a, b):
            if (await fw.state())["requests"] > 0:
                return fw.url
        return None

    frozen_url = await eventually(in_flight, 10)
    frozen = a if frozen_url == a.url else b
    assert frozen.child is not None
    frozen.child.freeze()  # SIGSTOP
    status, payload, headers = await asyncio.wait_for(request, 30)
    took = time.monotonic() - started
    frozen.child.thaw()
    assert status == 200, payload
    assert headers["X-Kvrouter-Worker"] != frozen_url
    assert took < 15, took  # health notices in well under a second; the rest is decoding
