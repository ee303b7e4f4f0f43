"""The subscribing side of ZMTP 3.0 (ZeroMQ's wire protocol), as plain code over bytes.

An engine publishes its KV events on a libzmq PUB socket. Reading them through a libzmq SUB
socket of our own costs two thread wake-ups per batch: libzmq's I/O thread reads the TCP
stream and queues the message, then signals the event loop's thread through a mailbox fd,
which pyzmq reads frame by frame. A one-off prototype, a PUB at 400 messages/s of 4 KB (the
churn benchmark's rate): 83-89 us of CPU per message through libzmq against 43-47 us read
straight off the TCP socket by the event loop; in a replica, 12-15% less CPU per stored block
under eviction churn (BENCHMARKS.md, "Live streams read in ZMTP").
So the router speaks the protocol itself for the live streams: RFC 23 (ZMTP 3.0), the NULL
mechanism, a SUB talking to a PUB or XPUB. Replay stays on a libzmq DEALER: it runs only to
repair a gap.

This module is the protocol and nothing else (no sockets, no clock), in the sans-I/O way:
`greeting_and_ready()` and `subscription()` are what the subscriber sends, `ZmtpReader` takes
the bytes it receives and hands back whole messages.

The exchange, as the subscriber sees it:
- it sends its greeting (64 bytes: signature, version 3.0, mechanism NULL, client) and its
  READY command (Socket-Type SUB); once the peer's READY has arrived, its subscription, as a
  message whose first byte is 1 (ZMTP 3.0's form; the router announces 3.0, so a libzmq 4.3
  peer speaks 3.0 to it; libzmq drops a connection whose first message comes while it is
  still reading the handshake);
- it receives the peer's greeting, which must carry the signature, major version 3 or later
  and the NULL mechanism, then the peer's READY, whose Socket-Type must be PUB or XPUB;
- then messages: frames of one flags byte (MORE, LONG, COMMAND), a 1- or 8-byte size, the
  body. A PING command (ZMTP 3.1, a peer with heartbeats on) is answered with a PONG; an
  ERROR command ends the connection with the peer's reason; other commands are skipped.

Bounds: a message (all its frames) over `max_message_bytes`, more than `MAX_FRAMES` frames,
or a command over `MAX_COMMAND_BYTES` ends the connection with `ZmtpError` before the oversized
part is buffered, as libzmq's ZMQ_MAXMSGSIZE does. Anything malformed is a `ZmtpError` with a
reason; the caller drops the connection and subscribes again.
"""

from __future__ import annotations

from typing import Final

SIGNATURE_HEAD: Final = 0xFF
SIGNATURE_TAIL: Final = 0x7F
GREETING_BYTES: Final = 64
MECHANISM_NULL: Final = b"NULL"
MAX_FRAMES: Final = 16  # a live message has 3; more is a peer that is not an engine publisher
MAX_COMMAND_BYTES: Final = 1 << 16
PEER_SOCKET_TYPES: Final = frozenset({b"PUB", b"XPUB"})

_MORE: Final = 0x01  # another frame of the message follows
_LONG: Final = 0x02
_COMMAND: Final = 0x04
_RESERVED: Final = 0xF8

_GREETING: Final = (
    bytes([SIGNATURE_HEAD]) + bytes(8) + bytes([SIGNATURE_TAIL, 3, 0])
    + MECHANISM_NULL.ljust(20, b"\x00") + b"\x00" + bytes(31)
)  # fmt: skip


class ZmtpError(ValueError):
    """The peer broke the protocol or a bound; `reason` says how. The connection must end."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _frame(flags: int, body: bytes) -> bytes:
    """One frame: its flags, its size (1 byte, or 8 with LONG), its body."""
    if len(body) <= 255:
        return bytes([flags, len(body)]) + body
    return bytes([flags | _LONG]) + len(body).to_bytes(8, "big") + body


def command(name: bytes, data: bytes = b"") -> bytes:
    """A command frame: its name (1-byte length) and data."""
    return _frame(_COMMAND, bytes([len(name)]) + name + data)


def ready_command(socket_type: bytes) -> bytes:
    return command(b"READY", _property(b"Socket-Type", socket_type))


def greeting_and_ready() -> bytes:
    """What a subscriber sends first: its greeting and its READY."""
    return _GREETING + ready_command(b"SUB")


def subscription(topic: bytes) -> bytes:
    """The subscription to `topic` (b"": every message), as a ZMTP 3.0 message."""
    return _frame(0, b"\x01" + topic)


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """READY's metadata: name (1-byte length), value (4-byte length), repeated."""
    out: dict[bytes, bytes] = {}
    pos, n = 0, len(data)
    while pos < n:
        size = data[pos]
        name_end = pos + 1 + size
        if size == 0 or name_end + 4 > n:
            raise ZmtpError("READY metadata is truncated")
        value_size = int.from_bytes(data[name_end : name_end + 4], "big")
        end = name_end + 4 + value_size
        if end > n:
            raise ZmtpError("READY metadata is truncated")
        out[bytes(data[pos + 1 : name_end]).lower()] = bytes(data[name_end + 4 : end])
        pos = end
    return out


def check_greeting(greeting: bytes) -> None:
    """The peer's 64-byte greeting: the signature, ZMTP 3 or later, the NULL mechanism."""
    if greeting[0] != SIGNATURE_HEAD or greeting[9] != SIGNATURE_TAIL:
        raise ZmtpError("no ZMTP signature: the peer is not a ZeroMQ socket")
    if greeting[10] < 3:
        raise ZmtpError(f"the peer speaks ZMTP {greeting[10]}.x; 3.0 or later is needed")
    mechanism = bytes(greeting[12:32]).rstrip(b"\x00")
    if mechanism != MECHANISM_NULL:
        raise ZmtpError(
            f"the peer asks for the {mechanism.decode('latin-1')!r} mechanism; NULL only"
        )


class ZmtpReader:
    """Turns the bytes a subscriber receives into whole messages (lists of frames).

    `feed` the bytes as they arrive, then call `next_message` until it returns None (it needs
    more bytes). A message's frames are memoryviews of the received bytes (nothing copied);
    they stay valid after later calls. Bytes the subscriber must send in answer (a PONG) gather
    in `replies`, for the caller to write and clear.
    """

    __slots__ = (
        "_buf",
        "_frames",
        "_max",
        "_need",
        "_pending",
        "_pending_size",
        "_pos",
        "_size",
        "greeted",
        "peer_type",
        "ready",
        "replies",
    )  # fmt: skip

    def __init__(self, max_message_bytes: int) -> None:
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be >= 1")
        self._max = max_message_bytes
        self._buf = b""
        self._pos = 0
        self._pending: list[bytes] = []  # received past `_buf`, joined once `_need` is met
        self._pending_size = 0
        self._need = GREETING_BYTES  # bytes from `_pos` the next step needs
        self._frames: list[memoryview] = []  # of the message being read
        self._size = 0  # its bytes so far
        self.greeted = False
        self.ready = False
        self.peer_type: bytes | None = None
        self.replies: list[bytes] = []

    def feed(self, data: bytes) -> None:
        if self._pos >= len(self._buf) and not self._pending:
            self._buf, self._pos = data, 0
            return
        self._pending.append(data)
        self._pending_size += len(data)
        if len(self._buf) - self._pos + self._pending_size >= self._need:
            self._buf = b"".join([memoryview(self._buf)[self._pos :], *self._pending])
            self._pos = 0
            self._pending.clear()
            self._pending_size = 0

    def next_message(self) -> list[memoryview] | None:
        """The next whole message, or None until more bytes arrive; `ZmtpError` if the peer
        broke the protocol."""
        buf, pos = self._buf, self._pos
        n = len(buf)
        if not self.greeted:
            if n - pos < GREETING_BYTES:
                self._need = GREETING_BYTES
                return None
            check_greeting(buf[pos : pos + GREETING_BYTES])
            self.greeted = True
            pos = self._pos = pos + GREETING_BYTES
        view: memoryview | None = None
        while True:
            if n - pos < 2:
                self._need = 2
                return None
            flags = buf[pos]
            if flags & _LONG:
                if n - pos < 9:
                    self._need = 9
                    return None
                size = int.from_bytes(buf[pos + 1 : pos + 9], "big")
                start = pos + 9
            else:
                size = buf[pos + 1]
                start = pos + 2
            if flags & _RESERVED:
                raise ZmtpError(f"frame flags {flags:#04x} set reserved bits")
            if flags & _COMMAND:
                if size > MAX_COMMAND_BYTES:
                    raise ZmtpError(f"a command of {size} bytes (at most {MAX_COMMAND_BYTES})")
            elif self._size + size > self._max:
                raise ZmtpError(f"a message over {self._max} bytes (--kv-events-max-message-bytes)")
            end = start + size
            if end > n:
                self._need = end - pos
                return None
            self._pos = pos = end
            if flags & _COMMAND:
                self._command(buf[start:end])
                continue
            if not self.ready:
                raise ZmtpError("a message before the peer's READY")
            if view is None:
                view = memoryview(buf)
            frames = self._frames
            frames.append(view[start:end])
            if flags & _MORE:
                self._size += size
                if len(frames) >= MAX_FRAMES:
                    raise ZmtpError(f"a message of more than {MAX_FRAMES} frames")
                continue
            self._frames = []
            self._size = 0
            self._need = 2
            return frames

    def _command(self, body: bytes) -> None:
        if not body or body[0] + 1 > len(body):
            raise ZmtpError("a command without a name")
        name = body[1 : 1 + body[0]]
        data = body[1 + body[0] :]
        if name == b"READY":
            if self.ready:
                raise ZmtpError("a second READY")
            peer_type = parse_properties(data).get(b"socket-type")
            if peer_type not in PEER_SOCKET_TYPES:
                raise ZmtpError(f"the peer is a {peer_type!r} socket, not a PUB")
            self.peer_type = peer_type
            self.ready = True
        elif name == b"ERROR":  # the peer's handshake failed, or it is ending the connection
            reason = data[1 : 1 + data[0]] if data else b""
            raise ZmtpError(f"the peer sent ERROR: {reason.decode('latin-1')!r}")
        elif not self.ready:
            raise ZmtpError(f"a {name.decode('latin-1')!r} command before READY")
        elif name == b"PING":
            # PING: a 2-byte TTL, then up to 16 bytes of context, which the PONG returns.
            self.replies.append(command(b"PONG", data[2:18]))


def tcp_host_port(endpoint: str) -> tuple[str, int]:
    """The host and port of a ZeroMQ `tcp://host:port` endpoint (`[v6]` hosts unbracketed);
    `ValueError` for anything else (the router's subscribers only connect over TCP)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} is not a tcp:// endpoint")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or host == "*":
        raise ValueError(f"{endpoint!r} is not tcp://host:port")
    return host, int(port)
