"""The `cluster` fixture: real worker and router processes, stopped whatever the test does.

A test that fails (an assertion, an exception, a pytest-timeout) gets a "child processes"
section in its report: each child's command line, exit status, log file and the end of its
output, read while the children are still running (the report is made before teardown).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster

CLUSTER = pytest.StashKey[Cluster]()


@pytest.fixture
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Cluster]:
    fleet = Cluster(tmp_path / "processes")
    request.node.stash[CLUSTER] = fleet
    try:
        yield fleet
    finally:
        await fleet.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    fleet = item.stash.get(CLUSTER, None)
    if fleet is not None and report.failed:
        report.sections.append(("child processes", fleet.processes.report()))
    return report
