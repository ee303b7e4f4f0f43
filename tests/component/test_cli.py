"""`kvrouter serve` as a real process: its help, its refusals at start, its environment.

`kvrouter_process` (also used by the drain tests) starts `python -m router.cli serve` on a free
loopback port, waits for its `kvrouter listening on` line, and SIGTERMs it on exit. Its stdout
and stderr are read continuously (a full pipe would block the router's logging) and kept for
assertions and failure messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.cli import build_parser
from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
READY_PREFIX = "kvrouter listening on "


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any KVROUTER_ variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    env.update(extra or {})
    return env


@dataclass
class Output:
    """A child's stream, read to the end in the background."""

    lines: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.lines)


async def pump_lines(
    stream: asyncio.StreamReader, out: Output, ready: asyncio.Future[str] | None = None
) -> None:
    """Read `stream` to its end into `out`; resolve `ready` with the URL of the ready line."""
    while line := await stream.readline():
        text = line.decode(errors="replace")
        out.lines.append(text)
        if ready is not None and text.startswith(READY_PREFIX) and not ready.done():
            ready.set_result(text[len(READY_PREFIX) :].strip())


@dataclass
class RouterProcess:
    proc: asyncio.subprocess.Process
    url: str
    session: aiohttp.ClientSession
    stdout: Output
    stderr: Output

    async def status(self, path: str) -> int:
        async with self.session.get(self.url + path) as resp:
            await resp.read()
            return resp.status

    async def get(self, path: str) -> Any:
        async with self.session.get(self.url + path) as resp:
            assert resp.status == 200, (path, resp.status, await resp.text())
            return await resp.json()

    async def wait_exit(self, within_s: float) -> int:
        return await asyncio.wait_for(self.proc.wait(), within_s)


@contextlib.asynccontextmanager
async def kvrouter_process(
    *args: str,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    ready_timeout_s: float = 15.0,
) -> AsyncIterator[RouterProcess]:
    """`kvrouter serve --host 127.0.0.1 --port <free> *args`, running until the block ends.

    With `port=0` no `--port` is passed (the caller sets it through `env`).
    """
    port = free_tcp_port() if port is None else port
    argv = ["serve", "--host", "127.0.0.1", *(["--port", str(port)] if port else []), *args]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        *argv,
        cwd=REPO,
        env=clean_env(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    out, err = Output(), Output()
    readers = [
        asyncio.create_task(pump_lines(proc.stdout, out, ready)),
        asyncio.create_task(pump_lines(proc.stderr, err)),
    ]
    try:
        exited = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait(
            {ready, exited}, timeout=ready_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if ready not in done:
            exited.cancel()
            raise AssertionError(f"kvrouter did not start (status {proc.returncode}): {err.text}")
        exited.cancel()
        async with aiohttp.ClientSession() as session:
            yield RouterProcess(proc, ready.result(), session, out, err)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.gather(*readers, return_exceptions=True)


async def run_cli(
    *args: str, env: Mapping[str, str] | None = None, within_s: float = 20.0
) -> tuple[int | None, str, str]:
    """Run `kvrouter *args` to completion: (exit status, stdout, stderr).

    A process still running after `within_s` is killed and reported with status None.
    """
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        *args,
        cwd=REPO,
        env=clean_env(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within_s)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
        return None, out.decode(), err.decode()
    return proc.returncode, out.decode(), err.decode()


# --- --help ---------------------------------------------------------------------------------


def serve_flags() -> list[str]:
    """Every `serve` flag, as the parser defines them."""
    _, flags = build_parser()
    return flags.names


async def test_help_exits_0_and_documents_every_flag_with_its_env_var() -> None:
    status, out, err = await run_cli("serve", "--help", env={"COLUMNS": "80"})
    assert status == 0, err
    flat = " ".join(out.split())  # help text wraps wherever the terminal width says
    missing = []
    for flag in serve_flags():
        env = "KVROUTER_" + flag.upper().replace("-", "_")
        # `--flag METAVAR  help text [env KVROUTER_FLAG; default ...]`; a boolean's METAVAR is
        # optional (`--flag [FLAG]`).
        if not re.search(rf"--{flag} (?:\[?[A-Z_]+\]?|{{[^}}]*}}) [^\[]*\[env {env};", flat):
            missing.append(flag)
    assert missing == [], f"flags without their env var in --help: {missing}\n{out}"


# --- refusals at start ----------------------------------------------------------------------


def _bound_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def invalid_cases(tmp: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (serve args, env, a word the error line must contain).

    One per way of failing (argparse, a range check, a URL, the environment, a choice from the
    environment, the tokenizer); `tests/unit/test_cli_flags.py` runs the full matrix
    (`--port 0`, `--dp-size 0`, `--policy nope`, ...) in-process, through the same functions.
    """
    return {
        "port not an int": (["--port", "abc"], {}, "--port"),
        "cooldown above max": (
            ["--breaker-cooldown-s", "10", "--breaker-max-cooldown-s", "5"],
            {},
            "--breaker-cooldown-s",
        ),
        "worker not http": (["--worker", "ftp://x"], {}, "ftp://x"),
        "env int not an int": ([], {"KVROUTER_DP_SIZE": "abc"}, "KVROUTER_DP_SIZE"),
        "unknown policy from env": ([], {"KVROUTER_POLICY": "nope"}, "nope"),
        "tokenizer path missing": (["--tokenizer", str(tmp / "missing")], {}, "missing"),
    }


async def test_invalid_settings_stop_it_at_start_with_one_error_line_and_exit_2(
    tmp_path: Path,
) -> None:
    cases = invalid_cases(tmp_path)

    limit = asyncio.Semaphore(3)  # a few at a time: each is a Python start-up

    async def one(args: list[str], env: dict[str, str]) -> tuple[int | None, str, str]:
        async with limit:
            # A free --port first: a case's own --port comes later on the line and wins.
            port = str(free_tcp_port())
            return await run_cli(
                "serve", "--host", "127.0.0.1", "--port", port, *args, env=env, within_s=10
            )

    results = await asyncio.gather(*(one(args, env) for args, env, _ in cases.values()))
    wrong = {}
    for (name, (_, _, word)), (status, out, err) in zip(cases.items(), results, strict=True):
        lines = err.splitlines()
        ok = (
            status == 2
            and len(lines) == 1
            and lines[0].startswith("kvrouter: error: ")
            and word in lines[0]
            and READY_PREFIX not in out
        )
        if not ok:
            wrong[name] = (status, err[-600:])
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())


async def test_a_port_already_taken_fails_with_one_line_and_exit_1() -> None:
    sock, port = _bound_port()
    with sock:
        status, out, err = await run_cli("serve", "--host", "127.0.0.1", "--port", str(port))
    lines = err.splitlines()
    assert status == 1, err
    assert len(lines) == 1 and lines[0].startswith("kvrouter: error: "), err
    assert str(port) in lines[0]
    assert READY_PREFIX not in out


# --- the environment ------------------------------------------------------------------------


async def test_env_vars_set_the_port_the_worker_list_and_a_bool() -> None:
    port = free_tcp_port()
    async with (
        fake_worker_in_process() as a,
        fake_worker_in_process() as b,
        kvrouter_process(
            "--health-interval-s",
            "0.2",
            env={
                "KVROUTER_PORT": str(port),
                "KVROUTER_WORKER": f"{a.url},{b.url}",
                "KVROUTER_EXPOSE_ROUTE_HEADERS": "true",
            },
            port=0,
        ) as rt,
    ):
        assert rt.url == f"http://127.0.0.1:{port}"
        body = await rt.get("/workers")
        assert sorted(w["url"] for w in body["workers"]) == sorted([a.url, b.url])
        assert all(w["state"] == "ready" for w in body["workers"]), body

        async def ready() -> bool:
            return await rt.status("/readyz") == 200

        await eventually(ready, 5)
        # And it routes: one request reaches one of the two workers, which the route header
        # (on, from the environment too) names.
        async with rt.session.post(
            rt.url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 1}
        ) as resp:
            assert resp.status == 200, await resp.text()
            chosen = resp.headers["X-Kvrouter-Worker"]
        served = {fw.url: (await fw.state())["requests"] for fw in (a, b)}
        assert served == {a.url: int(chosen == a.url), b.url: int(chosen == b.url)}
