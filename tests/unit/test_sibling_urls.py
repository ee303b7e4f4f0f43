"""The sibling watch's URLs on their way into the peer registry (`router.replica._reachable`)."""

from __future__ import annotations

import logging

import pytest

from peer.registry import PeerRegistry
from peer.slice_view import Listing
from router.replica import _reachable


def test_a_sibling_no_client_reaches_is_left_out_and_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = PeerRegistry("http://10.0.0.1:8080")
    replace = _reachable(registry)
    urls = ("http://10.0.0.2:8080", "http://010.0.0.3:8080")
    with caplog.at_level(logging.WARNING, logger="router.replica"):
        for _ in range(3):  # the watch calls it at every slice event
            replace(Listing(urls))
    assert registry.peers == ("http://10.0.0.2:8080",)
    named = [r.getMessage() for r in caplog.records if "010.0.0.3" in r.getMessage()]
    assert len(named) == 1 and "left out" in named[0], named
