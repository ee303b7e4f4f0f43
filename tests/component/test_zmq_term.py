"""`terminate_context` over real ZeroMQ contexts: a term that cannot end never holds the caller.

A context with a socket still open is the deterministic stand-in for libzmq's term race: term
blocks until that socket closes, just as it blocks forever when the reaper loses a close.
"""

from __future__ import annotations

import logging
import threading

import pytest
import zmq

from router.zmq_term import TERM_THREAD_NAME, terminate_context
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(20)


def term_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == TERM_THREAD_NAME]


async def test_a_context_whose_sockets_are_closed_terminates_within_the_bound() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.bind("tcp://127.0.0.1:*")
    sock.close(linger=0)
    assert await terminate_context(ctx, within_s=5.0, what="test") is True
    assert ctx.closed


async def test_a_term_that_blocks_is_abandoned_at_the_bound_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = zmq.Context()
    held_open = ctx.socket(zmq.PUB)
    held_open.bind("tcp://127.0.0.1:*")
    before = set(term_threads())  # an earlier test's abandoned term may still be running
    with caplog.at_level(logging.WARNING, logger="router.zmq_term"):
        assert await terminate_context(ctx, within_s=0.2, what="replica-x") is False
    assert not ctx.closed
    [warning] = [r for r in caplog.records if r.name == "router.zmq_term"]
    assert "replica-x" in warning.getMessage() and "did not terminate" in warning.getMessage()
    # The term still runs, on a daemon thread that cannot hold up exit, until its socket closes.
    [blocked] = [t for t in term_threads() if t not in before]
    assert blocked.daemon and blocked.is_alive()
    held_open.close(linger=0)
    await eventually(lambda: not blocked.is_alive(), within_s=5.0)
    assert ctx.closed


async def test_an_error_from_term_reaches_the_caller() -> None:
    ctx = zmq.Context()
    ctx.term()
    ctx.term = _raise_zmq_error  # type: ignore[method-assign]
    with pytest.raises(zmq.ZMQError, match="injected"):
        await terminate_context(ctx, within_s=5.0, what="test")


def _raise_zmq_error() -> None:
    raise zmq.ZMQError(msg="injected")
