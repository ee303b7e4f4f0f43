"""`kvrouter demo` as a user runs it: a subprocess that starts its own cluster, with a bound.

Asserted from its output: both policies' cached-token ratios (cache_aware higher), the third
replica ready, the three views equal, the routing check, exit 0; and afterwards every process
it started is gone (each URL it printed refuses connections). A Ctrl-C mid-run stops them too.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.support.ports import listening
from tests.support.waiting import eventually

URL = re.compile(r"http://127\.0\.0\.1:(\d+)")
# Smaller than the default workload, and still enough for the policies to differ.
SMALL = ["--conversations", "8", "--turns", "3", "--system-prompts", "3", "--concurrency", "4"]


async def start_demo(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "demo",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def ports_in(text: str) -> set[int]:
    return {int(p) for p in URL.findall(text)}


def log_sizes(log_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in log_dir.iterdir()}


def ratio(out: str, policy: str) -> float:
    match = re.search(rf"^  {policy} +cached-token ratio (\d\.\d+) ", out, re.MULTILINE)
    assert match, out
    return float(match.group(1))


@pytest.mark.timeout(60)
async def test_the_demo_runs_checks_and_cleans_up(tmp_path: Path) -> None:
    proc = await start_demo(*SMALL, "--log-dir", str(tmp_path))
    out_b, err_b = await asyncio.wait_for(proc.communicate(), 45)
    out, err = out_b.decode(), err_b.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"

    assert ratio(out, "cache_aware") > ratio(out, "round_robin"), out
    assert re.search(r"^  ca-c ready \d+\.\d+ s after it was started", out, re.MULTILINE), out
    assert re.search(r"/readyz 200 ready", out), out
    assert "  views: agree (3 replicas" in out, out
    routing = re.search(r"^  routing: (\d+)/(\d+) prompts routed to the same rank", out, re.M)
    assert routing and routing.group(1) == routing.group(2) and int(routing.group(2)) > 0, out
    assert "all checks passed" in out
    # The progress bar went to stderr, not into the report.
    assert "cache_aware [" in err and "[" not in out.split("summary")[-1]

    # Every worker and router it started is stopped: nothing listens on their ports.
    ports = ports_in(out)
    assert len(ports) >= 4 + 4 + 1, out
    assert [p for p in ports if listening(p)] == []
    # The children's logs were kept where asked.
    assert log_sizes(tmp_path)["router-ca-c.log"] > 0
    assert "worker-w1.log" in log_sizes(tmp_path)


@pytest.mark.timeout(60)
async def test_ctrl_c_stops_every_child(tmp_path: Path) -> None:
    proc = await start_demo(*SMALL, "--log-dir", str(tmp_path))
    assert proc.stdout is not None
    seen: list[str] = []

    async def until_ready() -> None:
        assert proc.stdout is not None
        while True:
            line = (await proc.stdout.readline()).decode()
            assert line, "".join(seen)
            seen.append(line)
            if line.startswith("cluster ready"):
                return

    await asyncio.wait_for(until_ready(), 30)
    ports = ports_in("".join(seen))
    assert ports and all(listening(p) for p in ports)
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 130, err.decode()
    assert "interrupted; every child process is stopped" in err.decode()
    assert [p for p in ports if listening(p)] == []


@pytest.mark.parametrize("pools", [(), ("--pools", "2")], ids=["demo", "pools"])
async def test_a_log_dir_that_cannot_be_made_is_a_one_line_error(
    tmp_path: Path, pools: tuple[str, ...]
) -> None:
    """It was a FileNotFoundError traceback, exit 1 (`--pools` kept it after the demo's
    own was fixed)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = await start_demo(*pools, "--log-dir", str(blocker / "logs"))
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2, err.decode()
    assert err.decode().startswith("kvrouter: error: --log-dir ") and b"Traceback" not in err
    assert err.count(b"\n") == 1 and out == b""


def files_held_open_under(root: Path) -> list[str]:
    """The files under `root` some process holds open (Linux: /proc/*/fd)."""
    held = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            target = os.readlink(fd)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if target.startswith(str(root)):
            held.append(target)
    return held


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.timeout(90)
async def test_the_pools_demo_interrupted_stops_every_child_and_says_so(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """It ended in a KeyboardInterrupt traceback (Ctrl-C) or status 143 (SIGTERM), and did
    not say where the children's logs were left."""
    proc = await start_demo("--pools", "2", "--log-dir", str(tmp_path))
    # Its children write their logs here: interrupted once one is running.
    await eventually(lambda: any(tmp_path.glob("*.log")), within_s=60)
    proc.send_signal(sig)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130, err.decode()
    assert "interrupted; every child process is stopped" in err.decode()
    assert "Traceback" not in err.decode()
    assert files_held_open_under(tmp_path) == []  # no child of it lives on
