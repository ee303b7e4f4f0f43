"""Ingest beyond one core: KV-event subscribers in child processes, the pump still the writer.

Rules of this file: the replica's side of `--kv-ingest-processes N`. It starts N ingest
processes (`router.ingest_child`), gives each rank to the one with the fewest, reads what they
send and hands every item to the pump's `deliver`, in order per process (so per rank), exactly
as an in-process `RankSubscriber` would. The decisions (which process takes a rank, how long
to wait before a restart, when the pool is unhealthy) are the plain functions at the top.

Theory of operation
-------------------
A replica's event loop spends most of its ingest time per message: receiving, decoding a
Python int per token, hashing tokens into block keys. An ingest process does that for its
ranks and sends compact, already-keyed batches (`router.ingest_wire`); the pump decodes each
with a few C-level calls and applies it under its usual rules. So the pump's core does the
tree work only, and decoding scales with processes (up to the machine's cores).

Channels: one ZMQ PAIR per process incarnation, bound by the replica on an ipc path inside a
directory created for it with mode 0700 (only the replica's user can connect: that is the
channel's authentication), the child connecting. Commands go down, items and counters come up
on it, in order. The replica drains it from the loop's watch of its fd, up to DRAIN_BATCH
messages a turn, and awaits the pump for each item: when the pump is behind, the PAIR fills,
the child's send waits, its subscribers stop reading and the engines' publishers hold or
drop, which the next seq reveals (as in one process). A message that does not decode is
counted (`bad_messages`) and dropped: a bug, never half applied.

Supervision: a process that exits, or cannot be started, is started again after a backoff
(0.1 s doubling to 5 s, reset after RESET_AFTER_S of life), counted in `restarts`, its ranks
resubscribed from the seq the index applied last (`applied`, sent as `Subscribe.last_seq`):
what its subscribers had not yet handed over, and what was published while none listened, is
a gap at each rank's next batch, which replay fills (else counted lost and the worker's
snapshot re-pulled), never silently; the ranks' counters go on from the dead process's last
report. After UNHEALTHY_AFTER
restarts in a row without RESET_AFTER_S of life, `unhealthy` names the process and its last
exit status: `/readyz` reports it and answers 503 until a process lives again.

Liveness: a process that is alive but stuck (stopped, deadlocked, starved) never exits, and
its ranks would silently stop updating the index. So each process sends a `Beat` every
`silence_s / BEATS_PER_SILENCE`, events or not (cheaper than the replica pinging: one message
an interval one way, and no state in the process), and the reader, when it finds the channel
empty, notes when it last heard anything; `hung` decides from that. Silence is measured only
while the replica waits on an empty channel, never while it reads or delivers (a slow pump
holds the process's beats back in the channel: that process is not the one behind), and the
clock is read twice per wait, not per message. A wait that overran its tick was the replica
not running (a stalled loop, a pod frozen whole by a CPU quota or a VM pause), and that time
is no silence of the process (`overrun`): frozen with it, its beats could not come. A hung
process is counted in `hung`, SIGKILLed (a stopped process takes no SIGTERM until it is
continued) and reaped, and the restart path above takes over: its ranks resume from their
last seq, their snapshots pulled again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec
import zmq
import zmq.asyncio

from cachetree.ranks import RankId
from peer.supervise import doubling_s
from peer.tasks import cancel_and_wait
from router.ingest_wire import (
    PAIR_HWM,
    Beat,
    Hello,
    Stats,
    Subscribe,
    Unsubscribe,
    pack_command,
    unpack,
)
from router.subscriber import (
    DEFAULT_MAX_MESSAGE_BYTES,
    Deliver,
    LiveBatch,
    RankEndpoint,
    SubscriberStats,
)

log = logging.getLogger(__name__)

MAX_PROCESSES: Final = 64
DEFAULT_INGEST_PROCESSES: Final = 0  # see README, "Ingest processes"
BACKOFF_FIRST_S: Final = 0.1
BACKOFF_MAX_S: Final = 5.0
RESET_AFTER_S: Final = 30.0  # a process that lived this long starts its backoff afresh
UNHEALTHY_AFTER: Final = 5  # restarts in a row, each dead within RESET_AFTER_S
DRAIN_BATCH: Final = 64
DEFAULT_SILENCE_S: Final = 5.0  # --kv-ingest-silence-s
MIN_SILENCE_S: Final = 1.0  # a largest message decodes in well under it (0.2 killed busy ones)
MAX_SILENCE_S: Final = 600.0
BEATS_PER_SILENCE: Final = 4  # a live process's beats within the bound: one late is no harm
# The bound before a process's Hello: its imports, on a host busy enough to slow them, may take
# longer than a running process ever stays silent.
START_SILENCE_S: Final = 30.0


def pick_process(loads: list[int]) -> int:
    """The process that takes a new rank: the one with the fewest ranks (the lowest index
    on a tie)."""
    return min(range(len(loads)), key=loads.__getitem__)


def restart_backoff_s(failures: int) -> float:
    """The wait before restart number `failures` (>= 1) in a row."""
    return doubling_s(BACKOFF_FIRST_S, BACKOFF_MAX_S, failures)


def overrun(waited: float, woke: float, tick_s: float) -> float:
    """How much longer than `tick_s` the reader's wait from `waited` to `woke` lasted. The
    tick wakes a waiting reader within `tick_s`, so the rest is time the replica itself did
    not run (its loop stalled; the pod frozen, processes and all, by a CPU quota or a VM
    pause): no silence of the process, which was frozen with it."""
    return max(woke - waited - tick_s, 0.0)


def hung(now: float, heard: float, up: bool, silence_s: float) -> bool:
    """Whether a process the replica last heard from at `heard`, and has waited on since
    with its channel empty, is taken as hung: silent past `silence_s` (START_SILENCE_S
    before its Hello)."""
    return now - heard > (silence_s if up else max(silence_s, START_SILENCE_S))


@dataclass(slots=True)
class IngestStats:
    restarts: Counter[int] = field(default_factory=Counter)  # process index -> restarts
    hung: Counter[int] = field(default_factory=Counter)  # process index -> killed as hung
    bad_messages: int = 0
    items: int = 0


@dataclass(slots=True)
class _Process:
    index: int
    ranks: dict[RankId, tuple[RankEndpoint, SubscriberStats]] = field(default_factory=dict)
    # Per rank, the counters its subscribers in earlier incarnations reached (a new one
    # counts from zero), and the latest the current incarnation reported.
    carried: dict[RankId, dict[str, object]] = field(default_factory=dict)
    reported: dict[RankId, dict[str, object]] = field(default_factory=dict)
    socket: zmq.Socket | None = None
    generation: int = 0
    failures: int = 0  # restarts in a row without RESET_AFTER_S of life
    last_status: int | None = None
    started: float = 0.0
    pid: int | None = None
    up: asyncio.Event = field(default_factory=asyncio.Event)


class IngestPool:
    """N supervised ingest processes feeding `deliver` (the pump's)."""

    def __init__(
        self,
        processes: int,
        deliver: Deliver,
        *,
        context: zmq.asyncio.Context,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replay_timeout_s: float = 2.0,
        silence_s: float = DEFAULT_SILENCE_S,
        log_level: str = "info",
        clock: Callable[[], float] = time.monotonic,
        command: Sequence[str] = (sys.executable, "-m", "router.ingest_child"),
        applied: Callable[[RankId], int | None] = lambda rank: None,
        resumed: Callable[[RankId], None] = lambda rank: None,
    ) -> None:
        """`command`: how a process is started (its flags are appended); tests replace it.
        `applied`: the last seq the index applied for a rank (the pump's cursor), which a
        process started again resumes from (`Subscribe.last_seq`); `resumed` is told of each
        rank so resumed (the seqs cannot show an engine that restarted while no process
        listened: its new stream's seqs would continue the old one's), to re-pull its
        worker's snapshot. `silence_s`: how long a process may send nothing, not even its
        beat, before it is taken as hung and killed (`hung`)."""
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"ingest processes must be 1..{MAX_PROCESSES}")
        if not MIN_SILENCE_S <= silence_s <= MAX_SILENCE_S:
            raise ValueError(f"ingest silence must be {MIN_SILENCE_S}..{MAX_SILENCE_S} s")
        self._deliver = deliver
        self._ctx = zmq.Context.shadow(context.underlying)
        self._child_args = [
            "--max-message-bytes",
            str(max_message_bytes),
            "--replay-timeout-s",
            str(replay_timeout_s),
            "--heartbeat-s",
            str(silence_s / BEATS_PER_SILENCE),
            "--log-level",
            log_level,
        ]
        self._silence_s = silence_s
        self._clock = clock
        self._command = list(command)
        self._applied = applied
        self._resumed = resumed
        self._dir = tempfile.mkdtemp(prefix="kvrouter-ingest-")  # mode 0700
        self._procs = [_Process(i) for i in range(processes)]
        self._tasks: list[asyncio.Task[None]] = []
        self.stats = IngestStats()

    @property
    def processes(self) -> int:
        return len(self._procs)

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def ranks_per_process(self) -> list[int]:
        return [len(p.ranks) for p in self._procs]

    @property
    def unhealthy(self) -> str | None:
        """Why the pool cannot keep its processes alive, or None."""
        now = self._clock()
        for p in self._procs:
            alive_long = p.up.is_set() and now - p.started >= RESET_AFTER_S
            if p.failures >= UNHEALTHY_AFTER and not alive_long:
                return (
                    f"ingest process {p.index} restarted {p.failures} times in a row "
                    f"(last exit status {p.last_status})"
                )
        return None

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._supervise(p), name=f"ingest-{p.index}") for p in self._procs
        ]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        shutil.rmtree(self._dir, ignore_errors=True)

    async def wait_up(self) -> None:
        """Until every process has connected once (tests)."""
        for p in self._procs:
            await p.up.wait()

    async def subscription(self, endpoint: RankEndpoint, stats: SubscriberStats) -> None:
        """The life of one rank's subscription, as a task: it runs in an ingest process
        until this coroutine is cancelled (the worker's removal)."""
        proc = self._procs[pick_process(self.ranks_per_process())]
        rank = endpoint.rank
        proc.ranks[rank] = (endpoint, stats)
        try:
            if proc.up.is_set():  # else its Hello subscribes every rank it owns
                self._send_now(proc, pack_command(_subscribe(endpoint, None)))
            await asyncio.Event().wait()
        finally:
            proc.ranks.pop(rank, None)
            proc.carried.pop(rank, None)
            proc.reported.pop(rank, None)
            with contextlib.suppress(zmq.ZMQError):
                self._send_now(proc, pack_command(Unsubscribe(rank.worker_url, rank.dp_rank)))

    # -- the processes ---------------------------------------------------------------------

    def _send_now(self, proc: _Process, message: bytes) -> None:
        if proc.socket is not None:
            proc.socket.send(message, zmq.NOBLOCK)

    async def _supervise(self, proc: _Process) -> None:
        """Run the process, and again after it exits, for good: a failure to start one (out
        of file descriptors, an ipc path the system refuses) is counted as an exit and
        retried after the same backoff, never the end of the supervision."""
        while True:
            started = proc.started = self._clock()
            pid: int | None = None
            try:
                pid, status = await self._run_once(proc)
            except (OSError, zmq.ZMQError) as exc:
                status = None
                log.error(
                    "ingest process %d could not be started (%s: %s); trying again after a "
                    "backoff. Check the replica's file limit and its temporary directory (%s)",
                    proc.index,
                    type(exc).__name__,
                    exc,
                    self._dir,
                )
            lived = self._clock() - started
            proc.failures = 1 if lived >= RESET_AFTER_S else proc.failures + 1
            proc.last_status = status
            self.stats.restarts[proc.index] += 1
            for rank, values in proc.reported.items():  # the next incarnation counts from 0
                proc.carried[rank] = _added(proc.carried.get(rank, {}), values)
            proc.reported.clear()
            wait = restart_backoff_s(proc.failures)
            if pid is not None:
                log.error(
                    "ingest process %d (pid %d) exited with status %s after %.1f s; its %d "
                    "rank(s) resubscribe in a new one in %.2f s, asking replay for what it "
                    "had not handed over",
                    proc.index,
                    pid,
                    status,
                    lived,
                    len(proc.ranks),
                    wait,
                )
            await asyncio.sleep(wait)

    async def _run_once(self, proc: _Process) -> tuple[int, int | None]:
        """One incarnation of the process, from its channel's bind to its exit: (pid, exit
        status). Its channel is closed and its ipc path removed however it ends."""
        proc.generation += 1
        path = os.path.join(self._dir, f"{proc.index}-{proc.generation}.sock")
        sock = self._ctx.socket(zmq.PAIR)
        reader: asyncio.Task[None] | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, PAIR_HWM)
            sock.setsockopt(zmq.RCVHWM, PAIR_HWM)
            sock.bind(f"ipc://{path}")
            child = await asyncio.create_subprocess_exec(
                *self._command,
                "--control",
                f"ipc://{path}",
                "--parent",
                str(os.getpid()),
                *self._child_args,
                stdin=asyncio.subprocess.DEVNULL,
            )
            proc.pid = child.pid
            proc.socket = sock
            reader = asyncio.create_task(
                self._read(proc, sock, child), name=f"ingest-read-{proc.index}"
            )
            try:
                return child.pid, await child.wait()
            except asyncio.CancelledError:
                with contextlib.suppress(ProcessLookupError):
                    child.terminate()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await asyncio.wait_for(asyncio.shield(child.wait()), 2.0)
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                raise
        finally:
            proc.up.clear()
            proc.socket = None
            if reader is not None:
                await cancel_and_wait([reader])
            sock.close(linger=0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def _read(
        self, proc: _Process, sock: zmq.Socket, child: asyncio.subprocess.Process
    ) -> None:
        """Drain the process's messages into the pump, in order (edge-triggered fd); kill the
        process if it stays silent past the bound (`hung`), checked when woken by a tick with
        nothing to read."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fd = sock.getsockopt(zmq.FD)
        loop.add_reader(fd, readable.set)
        tick_s = self._silence_s / BEATS_PER_SILENCE
        ticker = asyncio.create_task(_tick(readable, tick_s), name=f"ingest-tick-{proc.index}")
        heard = self._clock()
        fresh = False  # anything received since the last wait (noted then, on the clock)
        try:
            while True:
                for received in range(DRAIN_BATCH):  # noqa: B007 - read after: this turn's count
                    try:
                        message = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    await self._handle(proc, message.buffer)
                else:
                    fresh = True
                    await asyncio.sleep(0)
                    continue
                fresh = fresh or received > 0
                readable.clear()
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    continue
                now = self._clock()
                if fresh:
                    heard, fresh = now, False
                elif hung(now, heard, proc.up.is_set(), self._silence_s):
                    self._kill_hung(proc, child, now - heard)
                    return
                await readable.wait()
                heard += overrun(now, self._clock(), tick_s)
        finally:
            loop.remove_reader(fd)
            await cancel_and_wait([ticker])

    def _kill_hung(
        self, proc: _Process, child: asyncio.subprocess.Process, silent_s: float
    ) -> None:
        """SIGKILL, not SIGTERM: a stopped process takes no other signal until it is
        continued. `_run_once` reaps it and the supervision starts the next one."""
        self.stats.hung[proc.index] += 1
        log.warning(
            "ingest process %d (pid %d) sent nothing, not even its heartbeat, for %.1f s "
            "(--kv-ingest-silence-s %.1f): taken as hung (stopped, deadlocked or starved of "
            "CPU) and killed; its %d rank(s) resume in a new one. If this repeats, look at the "
            "host's CPU throttling, or dump the process's stacks (py-spy dump --pid) before "
            "the bound",
            proc.index,
            child.pid,
            silent_s,
            self._silence_s,
            len(proc.ranks),
        )
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile: reaped anyway
            child.kill()

    async def _handle(self, proc: _Process, message: memoryview) -> None:
        try:
            item = unpack(message)
        except (msgspec.DecodeError, ValueError) as exc:
            self.stats.bad_messages += 1
            log.error("ingest process %d sent a message that does not decode: %s", proc.index, exc)
            return
        kind = type(item)
        if kind is not LiveBatch:  # most messages: one check on their way to the pump
            if kind is Beat:
                return  # its arrival is all it says (`_read` noted it)
            if kind is Stats:
                self._took_stats(proc, item)  # type: ignore[arg-type]
                return
            if kind is Hello:
                self._took_hello(proc, item)  # type: ignore[arg-type]
                return
        self.stats.items += 1
        await self._deliver(item)  # type: ignore[arg-type]

    def _took_stats(self, proc: _Process, item: Stats) -> None:
        owned = proc.ranks.get(item.rank)
        if owned is not None:
            proc.reported[item.rank] = item.values
            _copy_stats(owned[1], _added(proc.carried.get(item.rank, {}), item.values))

    def _took_hello(self, proc: _Process, item: Hello) -> None:
        # Connected: every rank it owns, again (a new incarnation knows nothing), each from
        # where the index is (`Subscribe.last_seq`).
        for endpoint, _ in proc.ranks.values():
            last = self._applied(endpoint.rank)
            self._send_now(proc, pack_command(_subscribe(endpoint, last)))
            if last is not None and proc.generation > 1:
                self._resumed(endpoint.rank)
        proc.up.set()
        log.info("ingest process %d (pid %d) is up", proc.index, item.pid)


async def _tick(event: asyncio.Event, every_s: float) -> None:
    """Wake the reader every `every_s`, so it looks at a silent process's silence."""
    while True:
        await asyncio.sleep(every_s)
        event.set()


def _subscribe(endpoint: RankEndpoint, last_seq: int | None) -> Subscribe:
    rank = endpoint.rank
    return Subscribe(
        rank.worker_url,
        rank.dp_rank,
        endpoint.endpoint,
        endpoint.topic,
        endpoint.replay_endpoint,
        last_seq,
    )


def _added(base: dict[str, object], values: dict[str, object]) -> dict[str, object]:
    """Counter values `base` + `values`, name by name (ints and label -> int maps)."""
    out = dict(base)
    for name, value in values.items():
        before = out.get(name)
        if isinstance(value, dict):
            total = Counter(before if isinstance(before, dict) else {})
            total.update(value)
            out[name] = dict(total)
        elif isinstance(value, int) and not isinstance(value, bool):
            out[name] = (before if isinstance(before, int) else 0) + value
        else:
            out[name] = value
    return out


def _copy_stats(stats: SubscriberStats, values: dict[str, object]) -> None:
    for name, value in values.items():
        current = getattr(stats, name, None)
        if isinstance(current, Counter) and isinstance(value, dict):
            setattr(stats, name, Counter(value))
        elif isinstance(current, int) and isinstance(value, int):
            setattr(stats, name, value)
