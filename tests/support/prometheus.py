"""A real Prometheus server on loopback, for the dashboard's and the alerts' end-to-end tests.

    async with running_prometheus(processes, workdir, rules=rule_file) as prom:
        prom.set_targets("kvrouter", [router.url for router in replicas])
        await prom.wait_scraped("kvrouter", 2)
        result = await prom.query('kvrouter_tree_nodes{job="kvrouter"}')

The server is Debian's `prometheus` binary (`scripts/test` installs the package), run as a
child of `Processes` (own process group, output to a file, stopped however the test ends),
with its TSDB in a temporary directory and its web API on a free loopback port. Targets
come from file-based service discovery, one JSON file per job, so targets can be added
while it runs (a replica that joins later), and every target carries
`namespace="kvrouter"` as the Prometheus Operator would set it. Scrapes and rule evaluations
run every `interval` (1 s by default), so series and alerts appear within seconds; nothing
here sleeps: readiness and scrapes are polled from the server's own API, with a bound.

`query_templated` evaluates a Grafana panel's query with the dashboard's variables bound to
their "All" value and `$__rate_interval` to a few scrape intervals, which is what the panel
asks of Prometheus when the dashboard is opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from tests.support.ports import free_tcp_port
from tests.support.processes import Processes
from tests.support.waiting import eventually

NAMESPACE: Final = "kvrouter"
START_WITHIN_S: Final = 30.0
# What the dashboard's variables are bound to when the dashboard is opened with "All".
TEMPLATE_VALUES: Final = {
    "$namespace": NAMESPACE,
    "$job": "kvrouter",
    "$instance": ".*",
    "$__rate_interval": "10s",  # 10 scrape intervals of 1 s: room for a late scrape or two
}


def binary(name: str) -> str:
    """The path of `prometheus` or `promtool`; skipped with the reason when missing (CI fails)."""
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed (Debian's prometheus package; scripts/test installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def substitute(expr: str) -> str:
    """A panel's query with the dashboard's variables bound as when it is opened."""
    for variable, value in sorted(TEMPLATE_VALUES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(variable, value)
    return expr


@dataclass
class Prometheus:
    url: str
    session: aiohttp.ClientSession
    sd_dir: Path

    def set_targets(self, job: str, urls: Sequence[str]) -> None:
        """Replace a job's targets (file service discovery picks the file up by itself)."""
        targets = [urlsplit(u).netloc for u in urls]
        body = [{"targets": targets, "labels": {"namespace": NAMESPACE}}]
        scratch = self.sd_dir / f".{job}.json"
        scratch.write_text(json.dumps(body))
        scratch.rename(self.sd_dir / f"{job}.json")  # atomic: never a half-written file

    async def api(self, path: str, **params: str) -> Any:
        async with self.session.get(f"{self.url}/api/v1/{path}", params=params) as resp:
            body = await resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (a vector's samples; a scalar as one sample)."""
        data = await self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    async def query_templated(self, expr: str) -> list[dict[str, Any]]:
        return await self.query(substitute(expr))

    async def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        data = await self.api(
            "query_range",
            query=substitute(expr),
            start=f"{start:.3f}",
            end=f"{end:.3f}",
            step=f"{step_s:g}",
        )
        return data["result"]

    async def firing(self) -> set[tuple[str, frozenset[tuple[str, str]]]]:
        """Every firing alert: its name and its labels."""
        alerts = (await self.api("alerts"))["alerts"]
        return {
            (a["labels"]["alertname"], frozenset(a["labels"].items()))
            for a in alerts
            if a["state"] == "firing"
        }

    async def scraped(self, job: str) -> int:
        """How many of the job's targets have been scraped successfully."""
        targets = (await self.api("targets", state="active"))["activeTargets"]
        return sum(1 for t in targets if t["labels"].get("job") == job and t["health"] == "up")

    async def wait_scraped(self, job: str, count: int, within_s: float = 30.0) -> None:
        async def enough() -> bool:
            return await self.scraped(job) >= count

        await eventually(enough, within_s, poll_s=0.1)


def config(sd_dir: Path, jobs: Sequence[str], rules: Path | None, interval: str) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)] if rules else [],
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_timeout": interval,
                "file_sd_configs": [
                    {"files": [str(sd_dir / f"{job}.json")], "refresh_interval": interval}
                ],
            }
            for job in jobs
        ],
    }


@contextlib.asynccontextmanager
async def running_prometheus(
    processes: Processes,
    workdir: Path,
    jobs: Sequence[str],
    *,
    rules: Path | None = None,
    interval: str = "1s",
) -> AsyncIterator[Prometheus]:
    """A Prometheus server scraping `jobs` (targets set later), stopped on the way out."""
    server = binary("prometheus")
    sd_dir = workdir / "targets"
    sd_dir.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        (sd_dir / f"{job}.json").write_text("[]")
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config(sd_dir, jobs, rules, interval)))
    port = free_tcp_port()
    child = await processes.spawn(
        "prometheus",
        [
            server,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ],
    )
    async with aiohttp.ClientSession() as session:
        prom = Prometheus(f"http://127.0.0.1:{port}", session, sd_dir)

        async def ready() -> bool:
            if child.returncode is not None:
                raise AssertionError(f"prometheus exited:\n{child.tail()}")
            try:
                async with session.get(f"{prom.url}/-/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await eventually(ready, START_WITHIN_S, poll_s=0.05)
        try:
            yield prom
        finally:
            await child.stop(10.0)
