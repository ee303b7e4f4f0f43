"""Waiting on an observable condition with a bound, never on a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], T | Awaitable[T]], within_s: float = 5.0, poll_s: float = 0.005
) -> T:
    """Poll `check` until it returns something truthy; return it. TimeoutError after `within_s`.

    For state another process or task owns and publishes no event for (a worker's counters, a
    replica's cursor), polling it is the only observation there is.
    """
    async with asyncio.timeout(within_s):
        while True:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            await asyncio.sleep(poll_s)
