"""`cancel_and_wait`: stop background tasks without swallowing the caller's cancellation."""

from __future__ import annotations

import asyncio

import pytest

from peer.tasks import cancel_and_wait


async def test_every_task_is_cancelled_and_finished_when_it_returns() -> None:
    forever = [asyncio.create_task(asyncio.Event().wait()) for _ in range(3)]
    await cancel_and_wait([*forever, None])
    assert all(t.cancelled() for t in forever)


async def test_a_cancellation_aimed_at_the_caller_still_reaches_it() -> None:
    release = asyncio.Event()
    cleaning = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await release.wait()  # a teardown that takes a while

    child = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)  # let it start
    caller = asyncio.create_task(cancel_and_wait([child]))
    await cleaning.wait()  # the caller is now waiting on the child's teardown
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()
    await asyncio.wait([child])
    assert child.cancelled()


async def test_a_task_that_failed_has_its_error_raised_after_all_finished() -> None:
    async def fails() -> None:
        raise RuntimeError("broken before it was stopped")

    broken = asyncio.create_task(fails())
    forever = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="broken"):
        await cancel_and_wait([broken, forever])
    assert forever.cancelled()
