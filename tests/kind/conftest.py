"""Remember each test's outcome on its item, so the suite can dump the cluster on failure."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.kind.cluster import CALL_FAILED


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report
