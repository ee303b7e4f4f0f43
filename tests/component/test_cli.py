"""`kvrouter serve` as a real process: its help, its refusals at start, its environment.

One-shot commands run through `run_to_end` (stdout and stderr apart, a bound, killed past
it); a serving replica is a `cluster` process (tests/support/cluster.py), stopped whatever
the test does.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Mapping
from pathlib import Path

import pytest

from router.auth import PLACEHOLDER_TOKEN
from router.cli import build_parser
from tests.support.cluster import ROUTER_READY, Cluster
from tests.support.fake_worker import fake_worker_in_process
from tests.support.ports import free_tcp_port
from tests.support.processes import Finished, kvrouter_argv, run_to_end

pytestmark = pytest.mark.timeout(60)


async def run_cli(
    *args: str, env: Mapping[str, str] | None = None, within_s: float = 20.0
) -> Finished:
    """`kvrouter ARGS` to completion (status None: still running after `within_s`, killed)."""
    return await run_to_end(kvrouter_argv(*args), env=env, within_s=within_s)


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
        # what a pod given the manifests' placeholder Secret sees
        "placeholder token from env": (
            [],
            {"KVROUTER_INTERNAL_TOKEN": PLACEHOLDER_TOKEN},
            "placeholder",
        ),
        "peer without a token": (["--peer", "http://127.0.0.1:9"], {}, "--internal-token"),
        "worker URL with a path": (["--worker", "http://127.0.0.1:9/meta#"], {}, "origin"),
    }


async def test_invalid_settings_stop_it_at_start_with_one_error_line_and_exit_2(
    tmp_path: Path,
) -> None:
    cases = invalid_cases(tmp_path)

    limit = asyncio.Semaphore(3)  # a few at a time: each is a Python start-up

    async def one(args: list[str], env: dict[str, str]) -> Finished:
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
            and ROUTER_READY not in out
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
    assert ROUTER_READY not in out


# --- the environment ------------------------------------------------------------------------


async def test_env_vars_set_the_port_the_worker_list_and_a_bool(cluster: Cluster) -> None:
    port = free_tcp_port()
    async with fake_worker_in_process() as a, fake_worker_in_process() as b:
        rt = await cluster.router(
            "env",
            "--health-interval-s",
            "0.2",
            env={
                "KVROUTER_PORT": str(port),
                "KVROUTER_WORKER": f"{a.url},{b.url}",
                "KVROUTER_EXPOSE_ROUTE_HEADERS": "true",
            },
            port=0,
            fleet_flags=False,
        )
        assert rt.url == f"http://127.0.0.1:{port}"
        status, body = await rt.get("/workers")
        assert status == 200, body
        assert sorted(w["url"] for w in body["workers"]) == sorted([a.url, b.url])
        assert all(w["state"] == "ready" for w in body["workers"]), body
        await rt.wait_ready(5)
        # And it routes: one request reaches one of the two workers, which the route header
        # (on, from the environment too) names.
        status, payload, headers = await rt.post(
            "/v1/completions", {"prompt": "hi there", "max_tokens": 1}
        )
        assert status == 200, payload
        chosen = headers["X-Kvrouter-Worker"]
        served = {fw.url: (await fw.state())["requests"] for fw in (a, b)}
        assert served == {a.url: int(chosen == a.url), b.url: int(chosen == b.url)}


# --- the data plane's process-level flags ---------------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_the_event_loop_flag_picks_the_loop_and_either_serves(
    cluster: Cluster, loop: str
) -> None:
    pytest.importorskip(loop, reason="uvloop is the fast extra: pip install 'kvrouter[fast]'")
    control_port = free_tcp_port()
    async with fake_worker_in_process() as fw:
        rt = await cluster.router(
            loop,
            "--health-interval-s",
            "0.2",
            "--event-loop",
            loop,
            "--control-port",
            str(control_port),
            "--log-level",
            "info",
            workers=[fw.url],
        )
        await rt.wait_ready(10)
        assert f"{loop} event loop" in rt.child.output()
        status, payload, _ = await rt.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 200, payload
        assert (await fw.state())["requests"] == 1
        # The control plane answers on its own port too, and only the control plane.
        control = f"http://127.0.0.1:{control_port}"
        async with rt.session.get(control + "/workers", headers=rt.headers("/workers")) as resp:
            assert resp.status == 200
            assert [w["url"] for w in (await resp.json())["workers"]] == [fw.url]
        async with rt.session.post(control + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status in (404, 405)
        assert (await fw.state())["requests"] == 1


async def test_a_replica_no_worker_can_ever_reach_warns_once_at_start(cluster: Cluster) -> None:
    # No --worker, no --worker-selector and no token (POST /workers refused): it started
    # silently and answered every request 503.
    warning = "no worker can be registered: no --worker, no --worker-selector"
    lonely = await cluster.router("lonely", env={"KVROUTER_INTERNAL_TOKEN": ""})
    assert lonely.child.output().count(warning) == 1
    assert "--internal-token (KVROUTER_INTERNAL_TOKEN)" in lonely.child.output()
    status, _, _ = await lonely.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 503
    # With the token, POST /workers can register them: nothing to warn about.
    open_to_registration = await cluster.router("token")
    assert warning not in open_to_registration.child.output()
