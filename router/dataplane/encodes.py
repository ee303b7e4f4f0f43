"""Long prompts' encodes, run in worker threads off the event loop (`routing.EncodeFirst`).

At most `threads` run at once: each holds a core while it encodes (the tokenizer releases the
GIL), and the loop needs one too. At most `most` are held for clients at once, running or
waiting their turn in this queue rather than in an executor's, so that one whose client left
is dropped at once, its text with it. Past `most`, `submit` refuses, and the request is routed
by load as a miss (`EncodeFirst.busy`; counted in
`kvrouter_tokenize_offloads_total{outcome="busy"}`): a burst of long prompts that the threads
cannot keep up with would otherwise queue here, each adding its encode (up to ~0.5 s) to the
wait of every one behind it, while a miss costs the engine one prefill, the cost of any new
prompt. One that waited `wait_s` without starting is routed so too, and dropped (counted
`late`): the threads may be held for seconds each by prompts that take that long to render
(a template slow on a legal chat), and 16 waits of those would add up to minutes.

A client that leaves frees its slot at once (`cancel`). An encode already running cannot be
stopped (it is the tokenizer's native code, or the template's Python): its thread finishes it
and the outcome is dropped, the thread counted busy until then, so at most `threads` run
whoever left.

Each encode runs in a daemon thread of its own (started in ~0.1 ms, against the 1 ms and more
of an encode worth offloading): a `ThreadPoolExecutor`'s threads are joined at interpreter exit
(`concurrent.futures` registers that join), so a replica that had stopped stayed alive until
its renders ended, ~90 s for a slow template's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

from router.dataplane.flow import Pending

ENCODE_THREADS: Final = 2
MAX_ENCODES: Final = 16
# How long a prompt waits for a thread before it is routed without its ids: about one long
# encode (512 Ki characters: 180-560 ms).
MAX_ENCODE_WAIT_S: Final = 0.5


@dataclass(eq=False, slots=True)
class Job:
    run: Callable[[], Any]  # in a worker thread
    then: Callable[[Callable[[], Any]], None]  # on the loop, given `run`'s outcome
    late: Callable[[], None]  # on the loop, instead, when it waited `wait_s` without starting
    live: bool = True  # not finished, and its client is still there
    timer: asyncio.TimerHandle | None = None  # while it waits for a thread


class EncodeQueue:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        threads: int = ENCODE_THREADS,
        most: int = MAX_ENCODES,
        wait_s: float = MAX_ENCODE_WAIT_S,
    ) -> None:
        self._loop = loop
        self._threads = threads
        self.most = most
        self.wait_s = wait_s
        self._waiting: deque[Job] = deque()
        self._running = 0  # threads encoding, their clients gone or not
        self._closed = False
        self.held = Pending()  # live jobs, waiting or running
        self.started = 0  # encodes handed to a thread
        self.busy = 0  # refused by `submit`: routed by load as misses
        self.late = 0  # waited `wait_s` without starting: routed by load as misses

    def submit(
        self,
        run: Callable[[], Any],
        then: Callable[[Callable[[], Any]], None],
        late: Callable[[], None],
    ) -> Job | None:
        """Run `run` in a worker thread, then `then` on the loop with its outcome (a callable
        that returns what it returned or raises what it raised), or `late` if no thread took
        it within `wait_s` (`run` is then never run); None when `most` are held."""
        if self.held.count >= self.most:
            self.busy += 1
            return None
        job = Job(run, then, late)
        self.held.add()
        job.timer = self._loop.call_later(self.wait_s, self._expired, job)
        self._waiting.append(job)
        self._next()
        return job

    def cancel(self, job: Job) -> None:
        """Its client left: neither `then` nor `late` will be called, and its slot is free
        now; `run` will never be, unless it started."""
        if not job.live:
            return
        self._release(job)
        with contextlib.suppress(ValueError):  # running: its outcome is dropped
            self._waiting.remove(job)

    def close(self) -> None:
        """Nothing more starts; what runs finishes in its thread, its outcome dropped."""
        self._closed = True
        for job in self._waiting:
            self._release(job)
        self._waiting.clear()

    def _next(self) -> None:
        while self._running < self._threads and self._waiting and not self._closed:
            job = self._waiting.popleft()
            assert job.timer is not None
            job.timer.cancel()
            self.started += 1
            self._running += 1
            threading.Thread(
                target=self._run, args=(job,), name="kvrouter-encode", daemon=True
            ).start()

    def _run(self, job: Job) -> None:
        """In the job's thread."""
        outcome: Future[Any] = Future()
        try:
            outcome.set_result(job.run())
        except BaseException as exc:  # handed to `then`, which raises it on the loop
            outcome.set_exception(exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: the outcome is dropped
            self._loop.call_soon_threadsafe(self._finished, job, outcome)

    def _finished(self, job: Job, outcome: Future[Any]) -> None:
        self._running -= 1
        if self._closed:
            return
        self._next()
        if not job.live:
            return
        self._release(job)
        job.then(outcome.result)

    def _expired(self, job: Job) -> None:
        if not job.live:
            return
        self._waiting.remove(job)
        self._release(job)
        self.late += 1
        job.late()

    def _release(self, job: Job) -> None:
        job.live = False
        if job.timer is not None:
            job.timer.cancel()
        self.held.done()
