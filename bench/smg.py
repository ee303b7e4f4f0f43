"""smg (the Shepherd Model Gateway, a Rust router from PyPI) as a comparison target.

It is installed into a throwaway virtual environment under `bench/results/` (git-ignored), never
into the project's own, on first use; later runs reuse it. When it cannot be installed or does
not start, `Smg.reason` says why in one line and the benchmarks print that in place of its rows.

How it is run: `smg launch --worker-urls ... --policy P` on 127.0.0.1 with its Prometheus
listener on a free loopback port, the router's readiness taken from `GET /readiness` (200 once
every worker registered healthy). Its process renames itself (`smg::router`), so it is found
and stopped only by the pid this module started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import aiohttp

from router.tools.demo import Child
from tests.support.ports import free_tcp_port

SMG_REQUIREMENT: Final = "smg==1.13.0"
INSTALL_TIMEOUT_S: Final = 600.0
READY_TIMEOUT_S: Final = 60.0
# smg's default waits 180 s for in-flight requests on SIGTERM; the benchmarks have none left.
STOP_FLAGS: Final = ("--shutdown-grace-period-secs", "1")


@dataclass
class Smg:
    """A lazily installed smg; `binary` once installed, else `reason` says why not."""

    venv: Path
    binary: Path | None = None
    reason: str | None = None
    tried: bool = False

    def ensure(self, progress: Callable[[str], None]) -> bool:
        """Install on first call (a few tens of seconds); True when smg can be launched."""
        if self.tried:
            return self.binary is not None
        self.tried = True
        binary = self.venv / "bin" / "smg"
        if not binary.exists():
            progress(f"installing {SMG_REQUIREMENT} into {self.venv} (first use only)")
            problem = _install(self.venv)
            if problem is not None:
                self.reason = f"smg not installed: {problem}"
                return False
        if not binary.exists():
            self.reason = f"smg not installed: {binary} missing after pip install"
            return False
        self.binary = binary
        return True

    def skip(self, why: str) -> None:
        self.tried, self.binary, self.reason = True, None, why


def _install(venv: Path) -> str | None:
    """None on success, else one line on what failed."""
    try:
        if not (venv / "bin" / "pip").exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                timeout=INSTALL_TIMEOUT_S,
            )
        subprocess.run(
            [
                str(venv / "bin" / "pip"),
                "install",
                "--quiet",
                "--disable-pip-version-check",
                SMG_REQUIREMENT,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or [f"exit status {exc.returncode}"]
        return f"`{' '.join(map(str, exc.cmd[:3]))} ...` failed: {tail[0]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class SmgRouter:
    url: str
    child: Child
    metrics_url: str

    @property
    def pid(self) -> int:
        assert self.child.proc is not None
        return self.child.proc.pid


def launch_argv(
    binary: Path, port: int, metrics_port: int, workers: Sequence[str], policy: str
) -> list[str]:
    return [
        str(binary),
        "launch",
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
        *("--worker-urls", *workers),
        *("--policy", policy, "--log-level", "warn", *STOP_FLAGS),
    ]


async def wait_ready(
    session: aiohttp.ClientSession,
    url: str,
    alive: Callable[[], bool],
    workers: int,
    timeout_s: float = READY_TIMEOUT_S,
) -> float:
    """Poll `/readiness` until every worker is healthy; the monotonic time it answered so."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("smg exited before it was ready")
        with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
            async with session.get(url + "/readiness") as resp:
                body = await resp.json(content_type=None)
                if resp.status == 200 and body.get("healthy_workers", 0) >= workers:
                    return time.monotonic()
        await asyncio.sleep(0.02)
    raise RuntimeError(f"smg was not ready within {timeout_s:g} s")


@contextlib.asynccontextmanager
async def smg_router(
    binary: Path,
    workers: Sequence[str],
    policy: str,
    log_dir: Path,
    extra: Sequence[str] = (),
    name: str = "smg",
) -> AsyncIterator[SmgRouter]:
    """One smg process in front of `workers`, ready; stopped (by its pid) on exit."""
    port, metrics_port = free_tcp_port(), free_tcp_port()
    argv = [*launch_argv(binary, port, metrics_port, workers, policy), *extra]
    child = Child(name, argv, log_dir / f"{name}.log")
    await child.start()
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            try:
                await wait_ready(session, url, lambda: child.running, len(workers))
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; its log ends:\n{child.log_tail()}") from None
        yield SmgRouter(url, child, f"http://127.0.0.1:{metrics_port}")
    finally:
        await child.stop()


def default_venv() -> Path:
    return Path(__file__).resolve().parent / "results" / "smg-venv"


def from_environment() -> Smg:
    """`BENCH_SMG_VENV` overrides where the throwaway environment lives."""
    return Smg(Path(os.environ.get("BENCH_SMG_VENV") or default_venv()))
