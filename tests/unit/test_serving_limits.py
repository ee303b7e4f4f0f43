"""The start-up check of --max-connections against the process's file limit."""

from __future__ import annotations

import logging
import resource

import pytest

from router.serving import check_file_limit, listening_url


@pytest.mark.parametrize(("soft", "warned"), [(1024, True), (4200, True), (20_000, False)])
def test_a_connection_limit_past_the_file_limit_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, soft: int, warned: bool
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    with caplog.at_level(logging.WARNING, logger="router.serving"):
        check_file_limit(4096)
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) == warned
    if warned:
        assert "--max-connections 4096" in lines[0] and f"file limit of {soft}" in lines[0]


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("::1", "http://[::1]:8000"),  # was http://::1:8000
        ("[::1]", "http://[::1]:8000"),
        ("", "http://127.0.0.1:8000"),  # every address: was http://:8000
        ("localhost", "http://localhost:8000"),
    ],
)
def test_the_url_a_replica_prints_is_one_a_client_can_use(host: str, url: str) -> None:
    assert listening_url(host, 8000) == url
