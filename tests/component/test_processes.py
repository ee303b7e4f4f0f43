"""The process layer under the cluster tests: whatever a child does, nothing outlives the test.

Each child here is a few lines of Python run with `-c`, so the properties hold for any child,
not only for the well-behaved `kvrouter` and `fake-kv-worker`.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.processes import Processes, run_to_end
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(30)

READY = "child ready"


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Processes]:
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        await processes.stop_all(within_s=1)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_child_that_ignores_sigterm_is_killed_when_the_bound_runs_out(
    procs: Processes,
) -> None:
    stubborn = await procs.spawn(
        "stubborn",
        python(
            "import signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"print({READY!r}, flush=True)\n"
            "time.sleep(60)\n"
        ),
    )
    await stubborn.wait_line(READY, 10)
    await procs.stop_all(within_s=0.3)
    assert stubborn.returncode == -signal.SIGKILL


async def test_a_frozen_child_is_stopped_by_sigterm(procs: Processes) -> None:
    child = await procs.spawn(
        "frozen", python(f"import time\nprint({READY!r}, flush=True)\ntime.sleep(60)")
    )
    await child.wait_line(READY, 10)
    child.freeze()
    await eventually(child.frozen, 5)
    await procs.stop_all(within_s=5)
    assert child.returncode == -signal.SIGTERM  # thawed first, so the SIGTERM was delivered


async def test_kill_takes_what_the_child_started_with_it(procs: Processes) -> None:
    parent = await procs.spawn(
        "parent",
        python(
            "import subprocess, sys, time\n"
            "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"print({READY!r}, grandchild.pid, flush=True)\n"
            "time.sleep(60)\n"
        ),
    )
    grandchild = int(await parent.wait_line(READY, 10))
    await parent.kill()
    await eventually(lambda: gone(grandchild), 5)


async def test_a_child_that_exits_before_its_ready_line_is_reported_with_its_output(
    procs: Processes,
) -> None:
    child = await procs.spawn(
        "broken",
        python("import sys\nprint('cannot start: port taken', file=sys.stderr)\nsys.exit(3)"),
    )
    with pytest.raises(AssertionError, match="exited with status 3") as failure:
        await child.wait_line(READY, 10)
    assert "cannot start: port taken" in str(failure.value)
    report = procs.report()
    assert "--- broken" in report and "exit status 3" in report
    assert str(procs.log_dir / "broken.log") in report and "cannot start: port taken" in report


async def test_run_to_end_keeps_stdout_and_stderr_apart_and_kills_past_its_bound() -> None:
    done = await run_to_end(python("import sys\nprint('out')\nprint('err', file=sys.stderr)"))
    assert done == (0, "out\n", "err\n")
    late = await run_to_end(python("import time\ntime.sleep(60)"), within_s=0.3)
    assert late.status is None
