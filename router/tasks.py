"""Stopping background tasks: cancel them all, then wait for each to finish."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel every task first (so none waits on another's teardown), then await each."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
