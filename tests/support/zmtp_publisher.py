"""A scripted KV-event publisher speaking ZMTP 3.0 as a libzmq PUB does, for subscriber tests.

Written by hand from RFC 23 (ZMTP 3.0), independently of `router.zmtp`, so a mistake there is
not mirrored here; the component tests check the router against real libzmq PUB sockets.
Each connection the subscriber opens plays the next script: the greeting and READY (or what
the script says instead), then, once the subscriber has subscribed, the script's messages;
`CLOSE` ends the connection. A connection past its script stays open, silent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Final

GREETING: Final = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL" + bytes(16) + bytes(32)
READY_PUB: Final = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB"
CLOSE: Final = "close"


@dataclass(frozen=True, slots=True)
class Raw:
    """Bytes written as they are, in place of a message."""

    data: bytes


Step = list[bytes] | Raw | str


@dataclass(frozen=True, slots=True)
class Script:
    steps: list[Step]
    handshake: bytes = GREETING + READY_PUB  # what the publisher sends first


def frame(body: bytes, more: bool = False) -> bytes:
    if len(body) < 256:
        return bytes([1 if more else 0, len(body)]) + body
    return bytes([3 if more else 2]) + len(body).to_bytes(8, "big") + body


def message(frames: list[bytes]) -> bytes:
    return b"".join(frame(f, i < len(frames) - 1) for i, f in enumerate(frames))


@dataclass
class Seen:
    """What one connection's subscriber sent: its greeting, its commands, its subscription."""

    greeting: bytes = b""
    commands: list[bytes] = field(default_factory=list)  # bodies
    subscriptions: list[bytes] = field(default_factory=list)  # topics
    after: bytearray = field(default_factory=bytearray)  # sent after subscribing (PONGs)
    closed: bool = False  # by the script
    hung_up: bool = False  # by the subscriber


class ScriptedPublisher:
    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.seen: list[Seen] = []
        self.url = ""
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        seen = Seen()
        self.seen.append(seen)
        script = self.scripts.pop(0) if self.scripts else Script([])
        try:
            writer.write(script.handshake)
            seen.greeting = await reader.readexactly(64)
            while not seen.subscriptions:
                flags = (await reader.readexactly(1))[0]
                size_bytes = await reader.readexactly(8 if flags & 2 else 1)
                body = await reader.readexactly(int.from_bytes(size_bytes, "big"))
                if flags & 4:
                    seen.commands.append(body)
                elif body[:1] == b"\x01":
                    seen.subscriptions.append(body[1:])
            for step in script.steps:
                if step == CLOSE:
                    writer.close()
                    seen.closed = True
                    return
                writer.write(step.data if isinstance(step, Raw) else message(step))  # type: ignore[arg-type]
            await writer.drain()
            while data := await reader.read(4096):  # its PONGs, say; until it hangs up
                seen.after += data
            seen.hung_up = True
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedPublisher]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.url = f"tcp://127.0.0.1:{port}"
        try:
            yield self
        finally:
            server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()
