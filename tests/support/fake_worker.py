"""Run fake KV workers for tests in-process (fast, injectable clocks), and drive any worker.

    async with fake_worker_in_process(dp_size=2, replay=True) as fw:
        async with KvTap(fw.kv_endpoint(0)) as tap:
            await tap.gate(fw.probe)
            seq = await fw.store([list(range(1, 33))])
            ...

`fake_worker_in_process` picks free loopback ports (HTTP, one KV port per rank, and replay
ports when `replay=True`), yields a `FakeWorkerHandle`, and stops the worker on exit (END_SEQ
included). Any other keyword is a `WorkerConfig` field. A worker as a real process comes from
`tests.support.cluster.Cluster.worker`, with the same handle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

import aiohttp

from fake_kv_worker.config import WorkerConfig
from fake_kv_worker.engine import Sleep
from fake_kv_worker.server import FakeWorker
from tests.support.ports import free_port_range
from tests.support.processes import Child

# Token id 2 is never produced by the bytes tokenizer (it starts at 3), so probe blocks never
# collide with a test's prompts.
PROBE_TOKEN: Final = 2


def worker_config(*, replay: bool = False, **overrides: Any) -> WorkerConfig:
    """A `WorkerConfig` on loopback with free KV (and replay) ports and HTTP port 0."""
    dp_size = overrides.get("dp_size", 1)
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "kv_port_base": free_port_range(dp_size),
        "replay_port_base": free_port_range(dp_size) if replay else 0,
    }
    values.update(overrides)
    return WorkerConfig(**values)


@dataclass
class FakeWorkerHandle:
    """A started fake worker and a client for its test controls."""

    config: WorkerConfig
    url: str
    session: aiohttp.ClientSession
    worker: FakeWorker | None = None  # in-process only
    child: Child | None = None  # a real process (`tests.support.cluster.Cluster.worker`)
    probes: int = field(default=0)

    def kv_endpoint(self, dp_rank: int = 0) -> str:
        return f"tcp://{self.config.host}:{self.config.kv_port_base + dp_rank}"

    def replay_endpoint(self, dp_rank: int = 0) -> str:
        if not self.config.replay_port_base:
            raise ValueError("this worker was started without replay")
        return f"tcp://{self.config.host}:{self.config.replay_port_base + dp_rank}"

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        async with self.session.post(self.url + path, json=body, headers=headers) as resp:
            payload = await resp.json()
            if resp.status != 200:
                raise AssertionError(f"POST {path} -> {resp.status}: {payload}")
            return payload

    async def get(self, path: str) -> dict[str, Any]:
        async with self.session.get(self.url + path) as resp:
            payload = await resp.json()
            if resp.status != 200:
                raise AssertionError(f"GET {path} -> {resp.status}: {payload}")
            return payload

    async def store(
        self,
        chains: Sequence[Sequence[int]],
        dp_rank: int = 0,
        medium: str | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Publish one BlockStored batch per chain (under `lora_name`, a loaded adapter, when
        given); returns the last seq."""
        body: dict[str, Any] = {"token_chains": [list(c) for c in chains], "dp_rank": dp_rank}
        if medium is not None:
            body["medium"] = medium
        if lora_name is not None:
            body["lora_name"] = lora_name
        return (await self.post("/control/store", body))["last_seq"]

    def probe_for(self, dp_rank: int = 0) -> Callable[[], Awaitable[int]]:
        """A `KvTap.gate` probe for one rank: store a one-block chain of PROBE_TOKEN."""

        async def probe() -> int:
            self.probes += 1
            return await self.store([[PROBE_TOKEN] * self.config.block_size], dp_rank)

        return probe

    async def probe(self) -> int:
        """A probe batch on rank 0 (a one-block chain of PROBE_TOKEN); returns its seq."""
        return await self.probe_for(0)()

    async def state(self, dp_rank: int = 0) -> dict[str, Any]:
        return (await self.get("/control/state"))["ranks"][dp_rank]

    async def models_reads(self) -> int:
        """The `/v1/models` reads it answered."""
        return int((await self.get("/control/state"))["models_reads"])

    async def lora_adapter(self, action: str, name: str) -> tuple[int, str]:
        """vLLM's runtime LoRA route: `action` "load" (the path is the name) or "unload"."""
        body = {"lora_name": name, "lora_path": name} if action == "load" else {"lora_name": name}
        async with self.session.post(f"{self.url}/v1/{action}_lora_adapter", json=body) as resp:
            return resp.status, await resp.text()


@contextlib.asynccontextmanager
async def fake_worker_in_process(
    *,
    replay: bool = False,
    clock: Callable[[], float] | None = None,
    wall_clock: Callable[[], float] | None = None,
    sleep: Sleep | None = None,
    **overrides: Any,
) -> AsyncIterator[FakeWorkerHandle]:
    config = worker_config(replay=replay, **overrides)
    kwargs: dict[str, Any] = {}
    if clock is not None:
        kwargs["clock"] = clock
    if wall_clock is not None:
        kwargs["wall_clock"] = wall_clock
    if sleep is not None:
        kwargs["sleep"] = sleep
    worker = FakeWorker(config, **kwargs)
    await worker.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield FakeWorkerHandle(config=config, url=worker.url, session=session, worker=worker)
    finally:
        await worker.stop()


def cli_args(config: WorkerConfig) -> list[str]:
    """The `fake-kv-worker` command line that reproduces `config`."""
    defaults = WorkerConfig()
    args: list[str] = []
    for f in fields(WorkerConfig):
        value = getattr(config, f.name)
        if f.name in ("max_tokens_default", "replay_buffer_steps"):
            if value != getattr(defaults, f.name):
                raise ValueError(f"{f.name} has no command-line flag")
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
        elif value is not None:
            args += [flag, str(value)]
    return args


async def wait_healthy(handle: FakeWorkerHandle, within_s: float = 10.0) -> None:
    """Poll `/health` until it answers 200."""
    async with asyncio.timeout(within_s):
        while True:
            async with handle.session.get(handle.url + "/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.02)
