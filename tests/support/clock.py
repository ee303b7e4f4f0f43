"""Time that tests control: a clock they move by hand and a sleep they release.

Production code takes `clock` and `sleep` callables; tests hand it these, so a timeout or a
cooldown is reached by advancing a number, never by waiting.
"""

from __future__ import annotations

import asyncio


class ManualClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class GatedSleep:
    """A sleep that holds every sleeper until the test sets `release`."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.entered.set()
        await self.release.wait()
