"""Stopping background tasks: cancel them all, then wait for each to finish (peer and router)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel every task first (so none waits on another's teardown), then wait for them all.

    The caller's own cancellation still reaches it: `asyncio.wait` raises CancelledError only
    when the caller is cancelled, never for the tasks it waits on, whereas awaiting each task
    under `suppress(CancelledError)` would swallow a cancellation aimed at the caller and leave
    it running. A task that failed with another error has its error raised here (the first
    one's, after every task has finished), as awaiting it would.
    """
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    errors = [t.exception() for t in pending if not t.cancelled()]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
