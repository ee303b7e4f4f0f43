"""A recurring event said at most once an interval, with how many there were since.

A connection refused, an accept failing, a request that waited in vain for a pooled
connection, a batch lost, a connect to a publisher failing: under overload or a broken peer
they come in crowds, and a line each would flood the log. Plain code driven by the caller's
clock, shared by the data plane, the ingest and the control plane.
"""

from __future__ import annotations

import math


class LogTally:
    __slots__ = ("_every_s", "_said_at", "_since")

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._said_at = -math.inf
        self._since = 0

    def count(self, now: float, events: int = 1) -> int:
        """`events` more happened at `now`: how many to say now (all since the last time said),
        or 0 while the interval since then runs."""
        self._since += events
        if now - self._said_at < self._every_s:
            return 0
        said, self._since, self._said_at = self._since, 0, now
        return said
