"""Background loops that survive their own errors, and say so.

Rules of this file: `Supervision` is the rule for one supervised task, plain code driven by an
injected clock: how long to back off after a failure, when a task counts as one that cannot
be kept alive, when it has recovered. `Supervisor` is the asyncio shell that runs tasks under
it; it is shared by `peer` and `router` (it knows neither).

Theory of operation
-------------------
A supervised task is a coroutine factory. The supervisor awaits one run of it; a run that
returns ends the task (its work is done: a subscriber whose ZMQ context was terminated); a run
that raises is a failure:

  - logged once with its traceback (the same error again in a row is one line, and only the
    first few and then every hundredth: a loop failing every tick must not flood the log),
  - counted by kind (`kvrouter_task_failures_total{task}`),
  - followed by a backoff of 0.5 s, doubling, capped at 30 s, and a fresh run.

A run that lasted `STABLE_AFTER_S` counts as a recovery: the next failure starts the backoff
over. After `FAILING_AFTER` failures in a row, and until a run has lasted `STABLE_AFTER_S`
again, the task is *failing*: one the supervisor cannot keep alive. A failing task of a
critical kind (the health loop, load polling, discovery, bootstrap) turns `/readyz` 503 with
its name and last error; per-rank tasks (subscribers) are reported per rank instead, because
one rank's lost stream must not take a replica out of service.

A loop that wants one bad item not to cost the others (the health check of one worker) keeps
its own `try` around the item and reports the failure with `Supervisor.failed`, which logs
and counts it the same way without restarting anything.

Cancellation is never a failure: it passes through, whether it lands in a run or a backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 30.0
FAILING_AFTER: Final = 5  # failures in a row
STABLE_AFTER_S: Final = 60.0  # a run this long is a recovery
_REMEMBERED_ERRORS: Final = 4096  # last error logged per task name, for "again" lines


def doubling_s(first_s: float, max_s: float, nth: int) -> float:
    """The wait after the `nth` failure in a row (n >= 1): `first_s`, doubling each time, at
    most `max_s` (the exponent bounded, so no count overflows it)."""
    return min(first_s * 2.0 ** min(max(nth, 1) - 1, 62), max_s)


def backoff_s(failures_in_a_row: int) -> float:
    """The wait before the next run after the `n`-th failure in a row (n >= 1)."""
    return doubling_s(BACKOFF_FIRST_S, BACKOFF_MAX_S, failures_in_a_row)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _often(n: int) -> bool:
    return n <= 3 or n % 100 == 0


@dataclass(slots=True)
class Supervision:
    """One supervised task's state. Every method takes the time; nothing here waits."""

    kind: str
    critical: bool = True
    in_a_row: int = 0  # failures since the last recovery
    running_since: float | None = None
    last_error: str = ""
    total: int = 0

    def started(self, now: float) -> None:
        self.running_since = now

    def failed(self, now: float, error: str) -> float:
        """Record a failure of the current run; returns the backoff before the next one."""
        if self.running_since is not None and now - self.running_since >= STABLE_AFTER_S:
            self.in_a_row = 0  # it ran long enough to count as alive in between
        self.running_since = None
        self.in_a_row += 1
        self.total += 1
        self.last_error = error
        return backoff_s(self.in_a_row)

    def failing(self, now: float) -> bool:
        """Cannot be kept alive: many failures in a row and no stable run since."""
        if self.in_a_row < FAILING_AFTER:
            return False
        return self.running_since is None or now - self.running_since < STABLE_AFTER_S


@dataclass(frozen=True, slots=True)
class FailingTask:
    name: str
    kind: str
    critical: bool
    error: str  # the last one


class Supervisor:
    """Runs named tasks under `Supervision`; counts failures by kind; lists failing tasks."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.failures: Counter[str] = Counter()  # kind -> failures, for the metric
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[str, Supervision] = {}
        self._last_logged: dict[str, str] = {}

    def spawn(
        self,
        kind: str,
        name: str,
        factory: Callable[[], Awaitable[None]],
        *,
        critical: bool = True,
    ) -> asyncio.Task[None]:
        """Start `factory()` as task `name` (unique while it runs), restarted on failure."""
        state = Supervision(kind, critical)
        self._tasks[name] = state
        return asyncio.create_task(self._run(name, state, factory), name=name)

    async def _run(
        self, name: str, state: Supervision, factory: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            while True:
                state.started(self._clock())
                try:
                    await factory()
                    return
                except Exception as exc:
                    delay = state.failed(self._clock(), describe(exc))
                    fresh = state.in_a_row == 1
                    self._report(name, state.kind, exc, f"restarting in {delay:.1f} s", fresh)
                await self._sleep(delay)
        finally:
            if self._tasks.get(name) is state:
                del self._tasks[name]
                self._last_logged.pop(name, None)

    def failed(self, kind: str, name: str, exc: BaseException) -> None:
        """A failure a loop contained itself (one item of many): logged and counted."""
        self._report(name, kind, exc, "the loop goes on", fresh=False)

    def _report(self, name: str, kind: str, exc: BaseException, then: str, fresh: bool) -> None:
        self.failures[kind] += 1
        error = describe(exc)
        if fresh or self._last_logged.get(name) != error:
            if len(self._last_logged) >= _REMEMBERED_ERRORS:
                self._last_logged.clear()  # names of contained failures come and go
            self._last_logged[name] = error
            log.error("%s failed (%s); %s", name, error, then, exc_info=exc)
        elif _often(self.failures[kind]):
            log.error(
                "%s failed again (%s; %d %s failures so far); %s",
                name,
                error,
                self.failures[kind],
                kind,
                then,
            )

    def running_kinds(self) -> set[str]:
        """The kinds of the tasks running now (for metrics: a series per kind from the start)."""
        return {state.kind for state in self._tasks.values()}

    def state(self, name: str) -> Supervision | None:
        return self._tasks.get(name)

    def failing(self) -> list[FailingTask]:
        """Every task that cannot be kept alive now, by name."""
        now = self._clock()
        return [
            FailingTask(name, s.kind, s.critical, s.last_error)
            for name, s in sorted(self._tasks.items())
            if s.failing(now)
        ]
