"""The benchmark's relay floor (kvrouter's data plane, round-robin, no routing) over real HTTP."""

from __future__ import annotations

import aiohttp
import pytest

from bench.proxy_compare import FLOOR_LABEL, cpu_verdict
from bench.relay_floor import start
from tests.support.fake_worker import fake_worker_in_process

pytestmark = pytest.mark.timeout(20)


async def test_the_relay_round_robins_and_returns_each_answer_with_its_headers() -> None:
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        aiohttp.ClientSession() as client,
    ):
        plane, control = await start("127.0.0.1", 0, [a.url, b.url])
        url = f"http://127.0.0.1:{plane.addresses[0][1]}/v1/completions"
        try:
            cached = []
            for _ in range(4):
                body = {"prompt": "x" * 64, "max_tokens": 1}
                async with client.post(url, json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["usage"]["prompt_tokens"] == 64
                    cached.append(resp.headers["X-Fake-Worker-Cached-Tokens"])
        finally:
            await plane.close()
            await control.cleanup()
        # Two requests each, alternating: the second one on each worker finds its 4 blocks.
        assert [(await a.state())["requests"], (await b.state())["requests"]] == [2, 2]
        assert cached == ["0", "0", "64", "64"]
        # Keep-alive upstream: one connection per worker served both of its requests.
        assert plane.stats.upstream_connects == 2


def test_the_cpu_verdict_names_the_floor_beside_kvrouter_and_smg() -> None:
    def row(target: str, not_full: float, full: float) -> dict:
        c32 = {"not full": {"router_cpu_us": not_full}, "full": {"router_cpu_us": full}}
        return {"target": target, "c32": c32}

    result = {
        "smg_skipped": None,
        "targets": [
            row("kvrouter cache_aware", 1000, 1500),
            row("smg cache_aware", 500, 600),
            row(FLOOR_LABEL, 450, 520),
        ],
    }
    assert cpu_verdict(result) == (
        "Target (kvrouter cache_aware CPU per request below smg's): caches not full: 1,000 vs "
        "500 us (NOT met, 2.0x smg's), the bare aiohttp relay 450 us; caches full: 1,500 vs "
        "600 us (NOT met, 2.5x smg's), the bare aiohttp relay 520 us."
    )
