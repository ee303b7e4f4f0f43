"""The accept path: a thread that owns the listening sockets and answers health probes itself.

Why a thread: on a saturated replica one turn of the event loop takes tens of milliseconds,
and a probe on a new connection needs three or four turns (accept, connection made, read,
write) before the loop answers it, so `/healthz` and `/readyz` waited 80-130 ms at p99
(issue 11 asks for 50). The door accepts every connection off the loop, looks at its first
bytes (`read_probe`, without consuming them), and

- a `GET` or `HEAD` of a probe path, with nothing after its head and nothing in it the
  loop's parser would refuse (a malformed field line), is answered here. A loop
  keeping up (its last heartbeat ran less than `BUSY_LAG_S` late) is asked for its answer
  (over `call_soon_threadsafe`), so the answer is as fresh as the loop's own; a busy one, or
  one that does not answer within `PROBE_WAIT_S`, is not waited for: the answer is the one the
  loop published at its last heartbeat (every `HEARTBEAT_S`). A loop that has not beaten for
  `LOOP_STALL_S` gets a 503 on both paths: `/healthz` keeps its meaning, "the loop runs".
  A probe asking for keep-alive is then handed to the loop like any connection;
- anything else (another path, a body, bytes that are no probe, nothing within
  `FIRST_BYTES_WAIT_S`) is handed to the loop untouched, as the connection it is
  (`loop.connect_accepted_socket`), with the bytes the door read of it for the loop's own
  parser. (Read, not peeked: a socket with unread bytes stays readable, and the door would
  spin until the rest of a head arrived.)

The thread holds the GIL only to accept, peek, and write a probe's few hundred bytes; it waits
in `select`, which releases it. What it holds is bounded: at most `MAX_SORTING` connections
waiting for their first bytes (past that, new ones go to the loop at once), each for at most
`FIRST_BYTES_WAIT_S`, and at most `MAX_PEEK` bytes read. Accept errors (out of file
descriptors) pause accepting for `ACCEPT_RETRY_S` and are logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from router.dataplane.exchange import json_response
from router.log_tally import LogTally

log = logging.getLogger(__name__)

PROBE_WAIT_S: Final = 0.010
BUSY_LAG_S: Final = 0.005  # a heartbeat this late: the loop is busy, not asked
HEARTBEAT_S: Final = 0.1
LOOP_STALL_S: Final = 2.0  # the probes' timeoutSeconds in manifests/router/deployment.yaml
FIRST_BYTES_WAIT_S: Final = 0.05
MAX_SORTING: Final = 256
MAX_PEEK: Final = 4096
ACCEPT_RETRY_S: Final = 0.1
SWITCH_INTERVAL_S: Final = 0.0005  # see Door.start
_ACCEPT_LOG_EVERY_S: Final = 60.0
_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BODY_FIELDS: Final = (b"content-length:", b"transfer-encoding:", b"expect:", b"upgrade:")
# What the loop's parser (llhttp) takes as it is, and the door with it: a field line that is a
# token, its colon and a value of HTAB, SP, VCHAR and obs-text; a request target of VCHAR.
# Else (whitespace before the colon or at a line's start, a bare CR or LF, a control byte)
# llhttp refuses the head, and a door answering it would read the bytes after it as the next
# request, where a lenient front proxy saw this one's body.
_PLAIN_FIELD: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*")
_PLAIN_TARGET: Final = re.compile(rb"[\x21-\x7e]+")

# A health probe's answer: the status and a JSON-able body (`router.control.readiness`).
Probe = Callable[[], tuple[int, Any]]


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    path: bytes
    head_only: bool  # HEAD
    http_11: bool
    keep_alive: bool


WAIT: Final = "wait"  # maybe a probe, the head is not complete yet


def read_probe(
    data: bytes, paths: Mapping[bytes, object], max_fields: int, max_head_bytes: int
) -> ProbeRequest | str | None:
    """The probe `data` begins with, `WAIT` while it may still become one, else None.

    Only the plainest probe is the door's: `GET` or `HEAD` of one of `paths` (a query is
    allowed), HTTP/1.0 or 1.1, one Host field (none for HTTP/1.0 either), within the head
    limits, every byte of it one the loop's parser takes as it is (`_PLAIN_FIELD`,
    `_PLAIN_TARGET`), no field that announces a body or a change of protocol, and no byte
    after the head. Anything unusual is left to the loop's parser, which has every rule (and
    every refusal: a 400 for an HTTP/1.1 request without its one Host, as kubelet never
    sends; a 400 for a malformed field line, whose connection it closes).
    """
    end = data.find(b"\r\n\r\n")
    line_end = data.find(b"\r\n")
    first = data if line_end < 0 else data[:line_end]
    parts = first.split(b" ")
    if not _may_be_probe(parts, paths, complete=line_end >= 0):
        return None
    if end < 0:
        return WAIT if len(data) < min(MAX_PEEK, max_head_bytes) else None
    if end + 4 != len(data) or end + 4 > max_head_bytes:
        return None  # pipelined bytes behind it: the loop answers them all, in order
    method, target, version = parts
    if _PLAIN_TARGET.fullmatch(target) is None:
        return None
    keep_alive = version == b"HTTP/1.1"
    fields = data[line_end + 2 : end].split(b"\r\n") if end > line_end else []
    if len(fields) > max_fields:
        return None
    hosts = 0
    for field in fields:
        if _PLAIN_FIELD.fullmatch(field) is None:
            return None
        low = field.lower()
        if low.startswith(_BODY_FIELDS):
            return None
        hosts += low.startswith(b"host:")
        if low.startswith(b"connection:"):
            tokens = {t.strip() for t in low[len(b"connection:") :].split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
    if hosts > 1 or (hosts == 0 and version == b"HTTP/1.1"):
        return None
    return ProbeRequest(
        target.split(b"?", 1)[0], method == b"HEAD", version == b"HTTP/1.1", keep_alive
    )


def _may_be_probe(parts: list[bytes], paths: Mapping[bytes, object], complete: bool) -> bool:
    """Whether a request line (or its beginning, when not `complete`) can be a probe's."""
    if not complete:
        if len(parts) > 3:
            return False
        wanted = [(b"GET", b"HEAD"), tuple(paths), (b"HTTP/1.1", b"HTTP/1.0")]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            options = wanted[i]
            if i == 1 and b"?" in part:
                part = part.split(b"?", 1)[0]
                last = False
            if not any(o.startswith(part) if last else o == part for o in options):
                return False
        return True
    return (
        len(parts) == 3
        and parts[0] in (b"GET", b"HEAD")
        and parts[1].split(b"?", 1)[0] in paths
        and parts[2] in (b"HTTP/1.1", b"HTTP/1.0")
    )


@dataclass(frozen=True, slots=True)
class Published:
    """What the loop said at its last heartbeat: each probe's answer, when, and how late the
    heartbeat ran (how busy the loop is)."""

    at: float
    answers: Mapping[bytes, tuple[int, Any]]
    lag: float = 0.0


def published_answer(published: Published, path: bytes, now: float) -> tuple[int, Any]:
    """A probe's answer from the loop's last heartbeat: a 503 once the loop stalled."""
    stalled_s = now - published.at
    answer = published.answers.get(path)
    if stalled_s > LOOP_STALL_S or answer is None:
        reason = f"the event loop has not run for {stalled_s:.1f}s"
        return 503, {"status": "stalled", "reason": reason}
    return answer


class Door:
    """The accept thread (see the module docstring). `start`, then `close` from the loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        listeners: list[socket.socket],
        probes: Mapping[bytes, Probe],
        adopt: Callable[[socket.socket, bytes, bool], None],
        keep_alive: Callable[[], bool],
        max_fields: int,
        max_head_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loop = loop
        self._listeners = listeners
        self._probes = probes
        # Called on the loop with each connection it takes, the bytes the door read of it,
        # and whether the door answered a probe on it (then idle, between requests).
        self._adopt = adopt
        self._keep_alive = keep_alive  # False while draining: probes close their connection
        self._clock = clock
        self._max_fields = max_fields
        self._max_head_bytes = max_head_bytes
        self._published = Published(clock(), {})
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        # Connections the door is reading the first bytes of: their deadline and the bytes.
        self._sorting: dict[socket.socket, tuple[float, bytes]] = {}
        self._stopping = False
        self._accept_paused_until = 0.0
        self._accept_errors = LogTally(_ACCEPT_LOG_EVERY_S)
        self._heartbeat: asyncio.TimerHandle | None = None
        self._beat_due = 0.0
        # The loop's own time at its last heartbeat that ran on time (None: none yet): after a
        # callback held the loop, a timer may run before the I/O it held back (uvloop's do),
        # so the late beat does not count as the loop seen free.
        self.free_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="kvrouter-door", daemon=True)
        self.answered = 0  # probes answered by the door
        self.from_heartbeat = 0  # of which with the heartbeat's answer (the loop was busy)

    @property
    def published(self) -> Published:
        return self._published

    def start(self) -> None:
        # A thread waiting for the GIL asks the running one to drop it after the switch
        # interval (5 ms by default), and the door waits once per system call it makes: on a
        # busy loop a probe then took tens of milliseconds. Only a thread that wants to run
        # pays the interval, and the door is the replica's only Python thread that does often.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._beat()
        for sock in self._listeners:
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, "listener")
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; connections still being sorted are closed."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for sock in [*self._listeners, *self._sorting, self._wake_r, self._wake_w]:
            sock.close()
        self._sorting.clear()
        self._selector.close()

    # -- the loop's side -------------------------------------------------------------------

    def _beat(self) -> None:
        """On the loop: publish every probe's answer now, and beat again soon."""
        now = self._clock()
        lag = max(0.0, now - self._beat_due) if self._beat_due else 0.0
        answers = {}
        for path, probe in self._probes.items():
            try:
                answers[path] = probe()
            except Exception as exc:  # a probe that raises answers 503; the heart beats on
                log.exception("health probe %s failed", path.decode())
                answers[path] = (503, {"status": "error", "reason": str(exc)})
        self._published = Published(now, answers, lag)
        if lag <= HEARTBEAT_S:  # on time: the loop was free until now; late, held since
            self.free_at = self._loop.time()
        self._beat_due = now + HEARTBEAT_S
        self._heartbeat = self._loop.call_later(HEARTBEAT_S, self._beat)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._turn()
        except Exception:
            # Without the door nothing is accepted: the replica must not look alive.
            log.exception("the accept thread failed; the replica stops accepting connections")
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _turn(self) -> None:
        now = self._clock()
        deadlines = [deadline for deadline, _ in self._sorting.values()]
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self._selector.select(timeout):
            if self._stopping:
                return
            if key.data == "listener":
                self._accept(key.fileobj)  # type: ignore[arg-type]
            elif key.data == "wake":
                return
            else:
                self._sort(key.fileobj)  # type: ignore[arg-type]
        now = self._clock()
        for sock, (deadline, _) in list(self._sorting.items()):
            if deadline <= now:
                self._hand_over(sock)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            for sock in self._listeners:
                self._selector.register(sock, selectors.EVENT_READ, "listener")

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause_accepting(exc)
                    return
                raise
            sock.setblocking(False)
            if len(self._sorting) >= MAX_SORTING:
                self._give(sock, b"", answered=False)
                continue
            self._sorting[sock] = (self._clock() + FIRST_BYTES_WAIT_S, b"")
            self._sort(sock)  # a client usually sends its request with the connection
            if sock in self._sorting:
                self._selector.register(sock, selectors.EVENT_READ, "sorting")

    def _pause_accepting(self, exc: OSError) -> None:
        now = self._clock()
        if said := self._accept_errors.count(now):
            log.warning(
                "%d connection(s) could not be accepted (%s): raise the file limit (ulimit -n) "
                "or lower --max-connections; accepting pauses %.1fs each time",
                said,
                exc.strerror or exc,
                ACCEPT_RETRY_S,
            )
        for sock in self._listeners:
            self._selector.unregister(sock)
        self._accept_paused_until = now + ACCEPT_RETRY_S

    def _sort(self, sock: socket.socket) -> None:
        deadline, before = self._sorting[sock]
        try:
            data = sock.recv(MAX_PEEK - len(before))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(sock)
            return
        if not data:
            self._drop(sock)  # closed before it finished asking
            return
        data = before + data
        seen = read_probe(data, self._probes, self._max_fields, self._max_head_bytes)
        if seen == WAIT:
            self._sorting[sock] = (deadline, data)
        elif isinstance(seen, ProbeRequest):
            self._answer(sock, seen)
        else:
            self._sorting[sock] = (deadline, data)
            self._hand_over(sock)

    def _answer(self, sock: socket.socket, request: ProbeRequest) -> None:
        status, body = self._probe_answer(request.path)
        keep = request.keep_alive and self._keep_alive()
        payload = json_response(
            status, body, client_11=request.http_11, keep_alive=keep, head_only=request.head_only
        )
        self._forget(sock)
        try:
            sent = sock.send(payload)  # a fresh socket's buffer takes a probe's answer whole
            if sent < len(payload):
                sock.settimeout(1.0)
                sock.sendall(payload[sent:])
        except OSError:
            sock.close()
            return
        self.answered += 1
        if keep:
            sock.setblocking(False)
            self._give(sock, b"", answered=True)
        else:
            sock.close()

    def _probe_answer(self, path: bytes) -> tuple[int, Any]:
        """The loop's own answer if it is keeping up and gives one within PROBE_WAIT_S, else
        its last one (a busy loop is not asked: the answer would come too late anyway)."""
        published = self._published
        if published.lag < BUSY_LAG_S:
            fresh = self._ask_loop(self._probes[path])
            if fresh is not None:
                return fresh
        self.from_heartbeat += 1
        return published_answer(published, path, self._clock())

    def _ask_loop(self, probe: Probe) -> tuple[int, Any] | None:
        done = threading.Event()
        fresh: list[tuple[int, Any]] = []

        def ask() -> None:
            try:
                fresh.append(probe())
            finally:
                done.set()

        try:
            self._loop.call_soon_threadsafe(ask)
        except RuntimeError:  # the loop is closed
            return None
        return fresh[0] if done.wait(PROBE_WAIT_S) and fresh else None

    def _hand_over(self, sock: socket.socket) -> None:
        self._give(sock, self._forget(sock), answered=False)

    def _forget(self, sock: socket.socket) -> bytes:
        """No longer sorted by the door: the bytes it read of it."""
        _, data = self._sorting.pop(sock)
        with contextlib.suppress(KeyError):  # not registered yet: sorted as it was accepted
            self._selector.unregister(sock)
        return data

    def _give(self, sock: socket.socket, data: bytes, answered: bool) -> None:
        try:
            self._loop.call_soon_threadsafe(self._adopt, sock, data, answered)
        except RuntimeError:  # the loop is closed
            sock.close()

    def _drop(self, sock: socket.socket) -> None:
        self._forget(sock)
        sock.close()
