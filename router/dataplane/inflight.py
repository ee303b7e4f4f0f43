"""Requests this replica has sent to each rank and not yet seen finish.

The data plane counts them (an attempt begins when a rank is chosen, ends when its answer ends
or fails); the policies read them as the fresh half of a rank's load, `/workers` shows them,
and a SIGTERM drain waits until they reach zero.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from cachetree.ranks import RankId


class InflightTracker:
    def __init__(self) -> None:
        self.counts: Counter[RankId] = Counter()
        self.total = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __getitem__(self, rank: RankId) -> int:
        return self.counts[rank]

    def begin(self, rank: RankId) -> None:
        self.counts[rank] += 1
        self.total += 1
        if self.total == 1:  # `_idle` is set exactly while nothing is in flight
            self._idle.clear()

    def end(self, rank: RankId) -> None:
        self.counts[rank] -= 1
        self.total -= 1
        if not self.total:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight, False if `timeout_s` passed first."""
        if self._idle.is_set():
            return True  # wait_for(..., 0) would time out even on a set event
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
