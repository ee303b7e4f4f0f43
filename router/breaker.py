"""Per-worker circuit breaker: stop sending requests to a worker that keeps failing.

Theory of operation
-------------------
Three states, changed only by `allow`, `record_success`, `record_failure` and `release`:

    closed     every request is allowed; `failure_threshold` consecutive failures -> open
    open       nothing is allowed until `cooldown` has passed since it opened; then the next
               `allow()` claims the one probe slot -> half_open
    half_open  one probe request is out; everyone else is refused until it resolves:
               success -> closed (cooldown back to base), failure -> open with the cooldown
               doubled (capped at `max_cooldown_s`), `release(probe)` by the probe's holder
               -> open, cooldown already passed, so the next `allow()` claims a fresh probe

    state      | allow()                      | success          | failure
    -----------+------------------------------+------------------+----------------------------
    closed     | True                         | failures = 0     | failures += 1, maybe open
    open       | cooldown passed: claim probe | ignored          | ignored
    half_open  | False                        | close            | re-open, cooldown x2

Why exactly one probe: after a worker comes back, letting every waiting request through at
once would hit it with the whole backlog; if it is still broken they would all fail. One
request is the cheapest question that gets an answer.

Why verdicts in `open` are ignored: they come from requests admitted before the breaker
opened (or dispatched anyway because every candidate was open). A late success says little
about the worker now, and a late failure must not push the next probe further away.

A verdict in `half_open` is taken as the probe's, even if it came from an older request (one
admitted before the trip, or sent while every candidate's breaker was open): it is news about
the worker whoever brings it. The cost is at worst one probe decided by a request that finished
at the same moment, on the same worker.

A release is not a verdict, so only the probe's holder may give the slot back: each claim has
its ticket (`probe`, read right after the `allow()` that claimed it), and `release(probe)`
with any other ticket changes nothing. Another request ending without a verdict (its wait for
one of the worker's busy connections ran out, a 4xx, its client left) freed the slot while
the probe was still out, and the next `allow()` sent a second probe.

What counts as a failure is the caller's decision, and it must not count the client's own
errors: a 4xx (including 429, which is the engine shedding load, not being broken) says the
worker is alive and answering. Record those as `record_success()`, or `release(probe)` if a
probe ended that way and you prefer no verdict. Count connection errors, timeouts and 5xx;
but a 5xx may be the client's error too (an engine that fails on an input answers 500): the
relay counts one only once the request's outcome says it was the worker's (`relay.WorkerRelay`).

What it shows (`status`: `GET /workers` and kvrouter_breaker_state): the state, except that an
`open` breaker whose cooldown passed is `probe_due`. It refuses nothing then (its next
`allow()` claims the probe), but only a request can claim it, and a policy that routes elsewhere
(cache_aware, the worker's prefixes warm on other ranks) may send none for as long as the
worker lives: shown `open`, a worker healthy for minutes fired the breaker alert. Closing it on
a passed health check instead would close it on a worker that answers `/health` and fails
every request (an engine shedding load with 503s), and reset its doubled cooldown each time;
one request is still the only question whose answer is the worker's.

`failure_threshold=0` disables the breaker: it always allows and never opens.

Each opening and each closing is logged once, naming the worker (`name`): an opened breaker
sends a worker no requests for its cooldown, and nothing else said so but a metric.

Plain synchronous code with an injected clock; no tasks, no timers: the cooldown is checked
lazily on `allow()` / `is_open()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, Literal

BreakerState = Literal["closed", "open", "half_open"]
BreakerStatus = Literal["closed", "open", "probe_due", "half_open"]  # what `status` shows

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"
PROBE_DUE: Final = "probe_due"

log = logging.getLogger(__name__)


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "a worker",  # what it guards, for its log lines
    ) -> None:
        if failure_threshold < 0:
            raise ValueError("failure_threshold must be >= 0")
        if cooldown_s < 0 or max_cooldown_s < cooldown_s:
            raise ValueError("need 0 <= cooldown_s <= max_cooldown_s")
        self.failure_threshold = failure_threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.trips = 0  # times it opened, from closed or from a failed probe
        self.name = name
        self._clock = clock
        self._state: BreakerState = CLOSED
        self._failures = 0  # consecutive, while closed
        self._cooldown_s = cooldown_s  # the current one; doubles on each failed probe
        self._opened_at = 0.0
        self._claims = 0  # probes claimed so far: the next one's ticket is one more
        self._probe = 0  # the ticket of the probe out (half_open), else 0

    @property
    def state(self) -> BreakerState:
        """`open` until a probe is claimed, even after the cooldown passed (see `is_open`)."""
        return self._state

    @property
    def status(self) -> BreakerStatus:
        """The state as shown: `probe_due` for an `open` breaker whose cooldown passed (the
        next request to the worker is let through as its probe)."""
        if self._state == OPEN and self._cooldown_passed():
            return PROBE_DUE
        return self._state

    @property
    def cooldown_s(self) -> float:
        """The cooldown the breaker waits (or will wait) after its latest opening."""
        return self._cooldown_s

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def probe(self) -> int:
        """The ticket of the probe out (`half_open`), 0 when none is. Read right after an
        `allow()` that said True: the caller's own ticket if that call claimed the probe, 0 if
        it claimed nothing (the breaker was closed)."""
        return self._probe

    def allow(self) -> bool:
        """May a request go to this worker now? In `open` past the cooldown, this call claims
        the single half-open probe: the caller that gets True must report a verdict or
        `release(probe)` with the ticket it claimed."""
        state = self._state
        if state == CLOSED:
            return True
        if state == HALF_OPEN:
            return False
        if self._cooldown_passed():
            self._state = HALF_OPEN
            self._claims += 1
            self._probe = self._claims
            return True
        return False

    def is_open(self) -> bool:
        """True while the breaker refuses requests without offering a probe: `open` within its
        cooldown, or `half_open` with the probe out. For the caller's "every candidate is open:
        dispatch anyway" check; it claims nothing. An `open` breaker whose cooldown passed is
        not open: its next `allow()` would say yes."""
        if self._state == CLOSED:
            return False
        if self._state == HALF_OPEN:
            return True
        return not self._cooldown_passed()

    def record_success(self) -> None:
        if self._state == CLOSED:
            self._failures = 0
        elif self._state == HALF_OPEN:
            self._state = CLOSED
            self._probe = 0
            self._failures = 0
            self._cooldown_s = self.base_cooldown_s
            log.warning("circuit breaker of %s closed: its probe request succeeded", self.name)

    def record_failure(self) -> None:
        if not self.failure_threshold:
            return
        if self._state == CLOSED:
            self._failures += 1
            if self._failures >= self.failure_threshold:
                self._open(f"{self._failures} failed requests in a row")
        elif self._state == HALF_OPEN:
            self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
            self._open("its probe request failed")

    def release(self, probe: int) -> None:
        """The probe with ticket `probe` ended without a verdict (a 4xx, the client went
        away): free the slot so the next `allow()` probes again at once. A no-op unless
        `probe` is the probe out now (any other ticket, 0 included: see the module's opening)."""
        if self._state == HALF_OPEN and probe == self._probe:
            self._state = OPEN  # _opened_at is unchanged, so the cooldown has passed
            self._probe = 0

    def _open(self, why: str) -> None:
        self._state = OPEN
        self._probe = 0
        self._failures = 0
        self._opened_at = self._clock()
        self.trips += 1
        log.warning(
            "circuit breaker of %s opened (%s): it gets no requests for %g s, then one probe "
            "(the cooldown doubles, up to %g s, at each failed probe); its "
            "kvrouter_upstream_failures_total reasons and the engine's log say what failed",
            self.name,
            why,
            self._cooldown_s,
            self.max_cooldown_s,
        )

    def _cooldown_passed(self) -> bool:
        return self._clock() - self._opened_at >= self._cooldown_s

    def __repr__(self) -> str:
        return (
            f"CircuitBreaker(state={self._state}, failures={self._failures}, "
            f"cooldown_s={self._cooldown_s}, trips={self.trips})"
        )
