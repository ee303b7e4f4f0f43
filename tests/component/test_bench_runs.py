"""One run of the pressure and routing benchmarks' kvrouter rows, as `python -m bench` does it:
fake workers and a router as real processes on 127.0.0.1.

A replica of a policy that reads no index subscribes to no KV events (`--kv-events auto`), so
its cursors never move: a run that waited for them (quiesce) hung until its timeout instead of
measuring. Each test asserts what the run measured: how many requests, on which workers.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from bench import pressure, routing_quality
from bench.pressure_sim import Workload, build_requests
from router.tools import demo

pytestmark = pytest.mark.timeout(90)


async def test_a_pressure_run_of_round_robin_measures_without_waiting_for_cursors(
    tmp_path: Path,
) -> None:
    # Pre-filled, so both of the run's waits (before and after the prefill) are crossed.
    w = Workload("tiny", 2, 2, (2, 3), 0.85, 3, concurrency=2, prefilled=True)
    cluster = demo.Cluster(tmp_path)
    row = pressure.Row("kvrouter", "round_robin")
    requests, _ = build_requests(w, seed=0)
    try:
        await routing_quality.start_fleet(cluster, w.workers, w.cache_blocks, 0.0)
        async with aiohttp.ClientSession() as session:
            await pressure.kvrouter_run(session, cluster, row, w, requests, "rr")
    finally:
        await cluster.stop_all()
    [run] = row.runs
    assert (run.requests, run.failed) == (6, 0)
    assert sorted(run.per_rank.values()) == [3, 3]  # round robin over the two workers


async def test_a_routing_run_of_round_robin_measures_without_waiting_for_cursors(
    tmp_path: Path,
) -> None:
    s = routing_quality.Spec(2, 4, 2, 2, 64, 0.0, 2, repeats=1, max_tokens=2)
    cluster = demo.Cluster(tmp_path)
    row = routing_quality.Row("kvrouter", "round_robin")
    sessions = routing_quality.build_trace(s)
    try:
        await routing_quality.start_fleet(cluster, 2, s.cache_blocks, 0.0)
        async with aiohttp.ClientSession() as session:
            await routing_quality.kvrouter_run(session, cluster, row, sessions, s)
    finally:
        await cluster.stop_all()
    [run] = row.runs
    sent = sum(len(requests) for requests in sessions)
    assert (run.requests, run.failed) == (sent, 0)
    assert sum(run.per_rank.values()) == sent and len(run.per_rank) == 2
