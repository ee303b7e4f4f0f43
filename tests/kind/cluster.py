"""A kind cluster running manifests/, for the e2e suite: create, build, load, deploy, reach.

`skip_reason()` says why the suite cannot run here (None when it can): it runs only with
`RUN_KIND_E2E=1`, kind and kubectl on PATH, and a Docker daemon that answers `docker info`
(a docker client without a daemon is common; the daemon is what matters).

`KindCluster.up()` creates the cluster from manifests/kind-config.yaml (or reuses one of that
name), builds the image the manifests name from the repo's Dockerfile, side-loads it with
`kind load`, applies `kubectl apply -k manifests/` and waits for both rollouts. Its kubeconfig
is private to the run, so the developer's own contexts are never touched. `down()` deletes a
cluster it created unless `KEEP_CLUSTER=1`. Knobs: `KIND_CLUSTER_NAME` (default kvrouter-e2e).

Each pod is reached through its own `kubectl port-forward` (never through the Service, which
would pick a pod at random) on a local port handed out once per run (tests.support.ports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

from fake_kv_worker.__main__ import parse_args as fake_worker_args
from fake_kv_worker.config import WorkerConfig
from tests.support.manifests import (
    GEN_TOKEN,
    MANIFESTS,
    REPO,
    ROUTER_PROGRAM,
    WORKER_PROGRAM,
    Rendering,
    Workload,
    container_env,
    raw_flags,
    render,
)
from tests.support.ports import free_tcp_port
from tests.support.waiting import eventually

DEFAULT_NAME: Final = "kvrouter-e2e"
KIND_CONFIG: Final = MANIFESTS / "kind-config.yaml"
CREATE_TIMEOUT_S: Final = 600.0
BUILD_TIMEOUT_S: Final = 1200.0
ROLLOUT_TIMEOUT_S: Final = 600
POLL_S: Final = 1.0
# Set on a test item by tests/kind/conftest.py: whether the test's call phase failed.
CALL_FAILED: Final = pytest.StashKey[bool]()


def skip_reason() -> str | None:
    """Why the kind e2e cannot run here; None when it can."""
    if os.environ.get("RUN_KIND_E2E") != "1":
        return "RUN_KIND_E2E=1 is not set (the kind e2e also needs a Docker daemon and kind)"
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    try:
        answered = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "no Docker daemon answers (docker info timed out)"
    if answered.returncode != 0:
        return "no Docker daemon answers (docker info failed)"
    return None


class CommandError(RuntimeError):
    pass


async def run(*argv: str, timeout_s: float = 120.0, ok: tuple[int, ...] = (0,)) -> str:
    """Run a command to completion; its stdout, or CommandError (with its stderr) when its
    exit status is not in `ok`."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise CommandError(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from None
    if proc.returncode not in ok:
        raise CommandError(f"{' '.join(argv)} exited {proc.returncode}: {err.decode().strip()}")
    return out.decode()


@dataclass(frozen=True)
class Pod:
    name: str
    ip: str


@dataclass
class KindCluster:
    name: str
    kubeconfig: Path
    rendering: Rendering
    created: bool = False

    @property
    def namespace(self) -> str:
        namespace = self.rendering.namespace()
        assert namespace is not None, "the manifests render into one namespace"
        return namespace

    def workload(self, program: str) -> Workload:
        workload = self.rendering.workload(program)
        assert workload is not None, f"the manifests run {program}"
        return workload

    def deployment(self, program: str) -> str:
        return self.workload(program).deployment["metadata"]["name"]

    @property
    def router_deployment(self) -> str:
        return self.deployment(ROUTER_PROGRAM)

    @property
    def router_account(self) -> str:
        return self.workload(ROUTER_PROGRAM).pod_spec.get("serviceAccountName", "default")

    def selector(self, program: str) -> str:
        labels = self.workload(program).deployment["spec"]["selector"]["matchLabels"]
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

    @property
    def router_port(self) -> int:
        return int(raw_flags(self.workload(ROUTER_PROGRAM).container["args"])["port"])

    @property
    def worker_config(self) -> WorkerConfig:
        return fake_worker_args(list(self.workload(WORKER_PROGRAM).container["args"]))[0]

    @property
    def image(self) -> str:
        return self.workload(ROUTER_PROGRAM).container["image"]

    @property
    def token(self) -> str:
        env, _ = container_env(self.rendering, self.workload(ROUTER_PROGRAM))
        return env["KVROUTER_INTERNAL_TOKEN"]

    async def kubectl(
        self, *args: str, timeout_s: float = 120.0, ok: tuple[int, ...] = (0,)
    ) -> str:
        return await run(
            "kubectl",
            "--kubeconfig",
            str(self.kubeconfig),
            "--namespace",
            self.namespace,
            *args,
            timeout_s=timeout_s,
            ok=ok,
        )

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    async def up(cls, workdir: Path) -> KindCluster:
        name = os.environ.get("KIND_CLUSTER_NAME", DEFAULT_NAME)
        # The deploy step an operator runs: a token of its own in manifests/internal-token.env
        # (git-ignored; kept if there is one), rendered and applied below.
        await run(str(GEN_TOKEN))
        cluster = cls(name, workdir / "kubeconfig", Rendering(render(MANIFESTS)))
        existing = (await run("kind", "get", "clusters")).split()
        if name in existing:
            await run(
                "kind",
                "export",
                "kubeconfig",
                "--name",
                name,
                "--kubeconfig",
                str(cluster.kubeconfig),
            )
        else:
            await run(
                "kind",
                "create",
                "cluster",
                "--name",
                name,
                "--config",
                str(KIND_CONFIG),
                "--kubeconfig",
                str(cluster.kubeconfig),
                "--wait",
                "180s",
                timeout_s=CREATE_TIMEOUT_S,
            )
            cluster.created = True
        await run("docker", "build", "--tag", cluster.image, str(REPO), timeout_s=BUILD_TIMEOUT_S)
        await run("kind", "load", "docker-image", cluster.image, "--name", name, timeout_s=300)
        await run("kubectl", "--kubeconfig", str(cluster.kubeconfig), "apply", "-k", str(MANIFESTS))
        for program in (WORKER_PROGRAM, ROUTER_PROGRAM):
            if not cluster.created:  # pods of an earlier run still run the image loaded then
                await cluster.kubectl(
                    "rollout", "restart", f"deployment/{cluster.deployment(program)}"
                )
            await cluster.rollout_status(cluster.deployment(program))
        return cluster

    async def down(self) -> None:
        if self.created and os.environ.get("KEEP_CLUSTER") != "1":
            await run("kind", "delete", "cluster", "--name", self.name, timeout_s=300)

    async def rollout_status(self, deployment: str) -> None:
        await self.kubectl(
            "rollout",
            "status",
            f"deployment/{deployment}",
            f"--timeout={ROLLOUT_TIMEOUT_S}s",
            timeout_s=ROLLOUT_TIMEOUT_S + 30,
        )

    async def scale(self, replicas: int) -> None:
        await self.kubectl(
            "scale", f"deployment/{self.router_deployment}", f"--replicas={replicas}"
        )

    async def diagnostics(self) -> str:
        """Pods, slices and recent logs, for a failed test's report."""
        parts = []
        for args in (
            ("get", "pods,endpointslices", "-o", "wide"),
            ("logs", "-l", self.selector(ROUTER_PROGRAM), "--prefix", "--tail=80"),
            ("logs", "-l", self.selector(WORKER_PROGRAM), "--prefix", "--tail=40"),
            ("get", "events", "--sort-by=.lastTimestamp"),
        ):
            try:
                parts.append(f"$ kubectl {' '.join(args)}\n{await self.kubectl(*args)}")
            except CommandError as exc:
                parts.append(str(exc))
        return "\n".join(parts)

    # -- pods -------------------------------------------------------------------------------

    async def ready_pods(self, program: str) -> list[Pod]:
        """Pods whose every container is ready and that are not terminating, by name."""
        listing = json.loads(
            await self.kubectl("get", "pods", "-l", self.selector(program), "-o", "json")
        )
        pods = []
        for item in listing["items"]:
            statuses = item["status"].get("containerStatuses") or []
            if (
                item["metadata"].get("deletionTimestamp") is None
                and item["status"].get("podIP")
                and statuses
                and all(s.get("ready") for s in statuses)
            ):
                pods.append(Pod(item["metadata"]["name"], item["status"]["podIP"]))
        return sorted(pods, key=lambda p: p.name)

    async def wait_pods(
        self,
        program: str,
        count: int,
        *,
        excluding: frozenset[str] = frozenset(),
        within_s: float = 300.0,
    ) -> list[Pod]:
        """Until exactly `count` ready pods run `program`, none of them named in `excluding`."""
        seen: list[Pod] = []

        async def exactly() -> list[Pod] | None:
            nonlocal seen
            seen = await self.ready_pods(program)
            names = {p.name for p in seen}
            return seen if len(seen) == count and not names & excluding else None

        try:
            return await eventually(exactly, within_s, poll_s=POLL_S)
        except TimeoutError:
            raise AssertionError(
                f"not exactly {count} ready {program} pods (without {sorted(excluding)}) within "
                f"{within_s:g} s; last seen {[p.name for p in seen]}"
            ) from None


@dataclass
class PortForwards:
    """`kubectl port-forward` processes, one per (pod, port), all stopped on exit.

    kubectl prints a line per forwarded connection, so each process's output is drained for
    its whole life (a full pipe would stall the forward); the last lines are kept for errors.
    """

    cluster: KindCluster
    _procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    _drains: list[asyncio.Task[None]] = field(default_factory=list)
    _urls: dict[tuple[str, int], str] = field(default_factory=dict)

    async def url(self, pod: Pod, port: int, within_s: float = 30.0) -> str:
        """http://127.0.0.1:LOCAL reaching `port` of `pod`, once kubectl says it forwards."""
        if (pod.name, port) in self._urls:
            return self._urls[(pod.name, port)]
        local = free_tcp_port()
        c = self.cluster
        proc = await asyncio.create_subprocess_exec(
            "kubectl", "--kubeconfig", str(c.kubeconfig), "--namespace", c.namespace,
            "port-forward", "--address", "127.0.0.1", f"pod/{pod.name}", f"{local}:{port}",
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._procs.append(proc)
        forwarding = asyncio.get_running_loop().create_future()
        self._drains.append(asyncio.create_task(_drain(proc, forwarding)))
        try:
            async with asyncio.timeout(within_s):
                await forwarding
        except TimeoutError:
            raise CommandError(f"port-forward to {pod.name}:{port}: not forwarding") from None
        self._urls[(pod.name, port)] = url = f"http://127.0.0.1:{local}"
        return url

    async def close(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
        for task in self._drains:
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        self._procs.clear()
        self._drains.clear()
        self._urls.clear()


async def _drain(proc: asyncio.subprocess.Process, forwarding: asyncio.Future[None]) -> None:
    assert proc.stdout is not None
    tail: list[str] = []
    while line := (await proc.stdout.readline()).decode():
        tail = [*tail[-4:], line.strip()]
        if line.startswith("Forwarding from 127.0.0.1:") and not forwarding.done():
            forwarding.set_result(None)
    if not forwarding.done():
        forwarding.set_exception(CommandError(f"port-forward ended: {' | '.join(tail)}"))


@contextlib.asynccontextmanager
async def port_forwards(cluster: KindCluster) -> AsyncIterator[PortForwards]:
    forwards = PortForwards(cluster)
    try:
        yield forwards
    finally:
        await forwards.close()
