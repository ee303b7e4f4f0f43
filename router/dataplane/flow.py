"""Flow control and timers for the data plane's Protocols: no tasks, a few loop callbacks.

`ReadGate` pauses a transport's reading for any of several reasons at once (the peer's write
buffer is full; a pipelined request waits its turn; a read made a loop turn's share of work)
and resumes it only when none is left, so
one reason going away never undoes another.

`Deadline` is one `loop.call_later` handle per owner, re-armed lazily: moving a deadline later
(every chunk of a stream moves the idle deadline) only stores a number; the handle, when it
fires early, re-schedules itself for the stored time. A new handle is made only when a
deadline moves earlier than the pending one, or none is pending.

`WriteStall` says when a client whose writes are paused has stopped reading: it has taken
(acknowledged) no byte the router wrote it for a whole timeout (`--client-write-timeout-s`).

`Pending` counts requests a drain must wait for that are not in flight yet (a long prompt being
encoded in a worker thread, a new prefix's question to its placer), with a wait for none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

PEER_BACKPRESSURE: Final = 1  # the other side's write buffer is over its high-water mark
PIPELINED: Final = 2  # a complete request waits behind the one being answered
YIELDING: Final = 4  # what was read made a turn's share of work: the rest waits a turn


class ReadGate:
    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._reasons = 0

    @property
    def paused(self) -> bool:
        return self._reasons != 0

    def pause(self, reason: int) -> None:
        if not self._reasons and not self._transport.is_closing():
            self._transport.pause_reading()
        self._reasons |= reason

    def resume(self, reason: int) -> None:
        if not self._reasons & reason:
            return
        self._reasons &= ~reason
        if not self._reasons and not self._transport.is_closing():
            self._transport.resume_reading()


def _nothing() -> None:
    pass


class Deadline:
    """Calls `on_expiry` once the deadline set last passes, unless it is cancelled first (an
    owner that no longer needs it may also leave it pending and ignore it when it fires)."""

    __slots__ = ("_at", "_handle", "_loop", "_on_expiry")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self._loop = loop
        self._on_expiry = on_expiry
        self._at: float | None = None
        self._handle: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> bool:
        """A deadline is set and has not passed (or been cancelled) yet."""
        return self._at is not None

    def set(self, delay_s: float) -> None:
        at = self._loop.time() + delay_s
        self._at = at
        handle = self._handle
        if handle is not None:
            if handle.when() <= at:
                return  # fires early and re-arms itself for `at`
            handle.cancel()
        self._handle = self._loop.call_at(at, self._fire)

    def cancel(self) -> None:
        """No deadline and no pending handle (the owner is going away)."""
        self._at = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        """Cancelled for good (the owner is gone): `on_expiry`, often a method of the owner,
        which holds this deadline, is let go, so that neither waits for the cyclic collector."""
        self.cancel()
        self._on_expiry = _nothing

    def _fire(self) -> None:
        self._handle = None
        at = self._at
        if at is None:
            return
        if self._loop.time() < at:
            self._handle = self._loop.call_at(at, self._fire)
            return
        self._at = None
        self._on_expiry()


# Checks of a paused client's progress within one write timeout: a stall is cut between 1 and
# 1 + 1/STALL_CHECKS timeouts after the client's last progress.
STALL_CHECKS: Final = 4


class WriteStall:
    """When a paused client's answer has made no write progress for `timeout_s`.

    Progress is a count of the bytes the client has taken, read at each check (the
    connection's `_write_progress`: what it wrote, less what its transport still buffers,
    less what the kernel holds unacknowledged). Not `resume_writing` alone: asyncio says that
    only once the buffer is below its low-water mark, which a reader of 16 B/s, behind a 64
    KiB high-water mark, reaches after an hour. Not the buffer's size alone either: a paused
    answer still writes (the rest of an upstream read, a cut's tail), which would hide a
    client's reading. Nor what left the buffer for the kernel: the kernel wakes a writer only
    once a third or more of its send buffer is free, which a reader of 200 B/s through a
    network path's 100 KB did not reach in 120 s. A client acknowledges more once its window
    opens, which a receiver does once an MSS of its buffer is free (RFC 1122's silly-window
    avoidance): the timeout must outlast a slow reader's MSS."""

    __slots__ = ("_sent", "_since", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._sent = 0
        self._since = 0.0  # when progress was last seen

    def start(self, now: float, sent: int) -> float:
        """The client's writes paused at `now` with `sent` bytes gone so far: the delay until
        the first check."""
        self._sent, self._since = sent, now
        return self.timeout_s / STALL_CHECKS

    def check(self, now: float, sent: int) -> float | None:
        """The delay until the next check, or None: stalled, no progress for the timeout."""
        if sent > self._sent:
            self._sent, self._since = sent, now
        elif now - self._since >= self.timeout_s:
            return None
        return min(self.timeout_s / STALL_CHECKS, self._since + self.timeout_s - now)


class Pending:
    """How many requests wait for something before they go in flight, and a wait for none."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()  # set exactly while none waits
        self._idle.set()

    def add(self) -> None:
        self.count += 1
        self._idle.clear()

    def done(self) -> None:
        self.count -= 1
        if not self.count:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once none waits, False if `timeout_s` passed first: for a drain."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
