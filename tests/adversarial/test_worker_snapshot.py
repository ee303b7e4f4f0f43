"""Issue 13, row 5: a worker serving an 800 MB `/v1/kv-snapshot`.

Before: the whole body was read into memory before the 512 MB check. Now it is read as it
streams against `--worker-snapshot-max-body-mb` (32), and a declared length over the bound
is refused before a byte is read. The replica is a real process; the hostile worker a stub on
loopback that makes its body up as it sends it (the test never holds 800 MB either).
"""

from __future__ import annotations

import pytest
from aiohttp import web

from tests.support.adversary import (
    HealthWatch,
    MiB,
    peak_rss,
    stream_forever,
    stub_server,
    stub_worker_routes,
)
from tests.support.cluster import Cluster
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

BODY = 800 * MiB
BOUND_MB = 32


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
async def test_an_800_mb_worker_snapshot_costs_at_most_its_bound(
    cluster: Cluster, declared: bool
) -> None:
    sent: list[int] = []

    async def huge(request: web.Request) -> web.StreamResponse:
        chunk = b'{"ranks": [' + b" " * (MiB - 11)
        if declared:
            response = web.StreamResponse(headers={"Content-Length": str(BODY)})
            await response.prepare(request)
            try:
                for i in range(BODY // MiB):
                    await response.write(chunk)
                    sent.append(i)
            except ConnectionError:
                pass
            return response
        sent.append(0)
        return await stream_forever(request, chunk, BODY)

    async with stub_server(stub_worker_routes({("GET", "/v1/kv-snapshot"): huge})) as worker:
        rt = await cluster.router(
            "a", "--worker-snapshot-max-body-mb", str(BOUND_MB), workers=[worker]
        )
        await rt.wait_ready()
        base = peak_rss(rt.child.pid)
        async with HealthWatch(rt.url).running() as health:

            async def refused() -> float:
                return (
                    (await rt.scrape())
                    .by("kvrouter_worker_snapshot_pulls_total", "outcome")
                    .get("rejected", 0)
                )

            assert await eventually(refused, 20) == 1
        grown = peak_rss(rt.child.pid) - base
        assert grown < 2 * BOUND_MB * MiB, f"peak RSS grew {grown / MiB:.0f} MiB"
        assert len(sent) * MiB < BODY // 4  # the rest was never asked for
        assert health.failures == [] and health.worst_s < 1.0, health.worst_s
        assert (await rt.readyz())[0] == 200  # still serving
