"""ZMTP 3.0 for a subscriber, as plain code: what it sends, how it reads, what it refuses.

The peer's bytes are written by hand from RFC 23 (`tests.support.zmtp_publisher`), so a
mistake in `router.zmtp` is not mirrored; the component tests hold it to real libzmq PUBs.
"""

from __future__ import annotations

import random

import pytest

from router.zmtp import (
    MAX_COMMAND_BYTES,
    MAX_FRAMES,
    ZmtpError,
    ZmtpReader,
    greeting_and_ready,
    subscription,
    tcp_host_port,
)
from tests.support.zmtp_publisher import GREETING, READY_PUB, frame, message

HANDSHAKE = GREETING + READY_PUB
LIVE = [b"kv", (7).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\x90\x01"]


def read_all(reader: ZmtpReader) -> list[list[bytes]]:
    out = []
    while (frames := reader.next_message()) is not None:
        out.append([bytes(f) for f in frames])
    return out


def test_a_subscriber_opens_with_a_null_greeting_as_client_and_a_ready_naming_sub() -> None:
    sent = greeting_and_ready()
    assert len(sent) == 64 + 27
    assert sent[:1] == b"\xff" and sent[9:12] == b"\x7f\x03\x00"  # signature, ZMTP 3.0
    assert sent[12:32] == b"NULL" + bytes(16) and sent[32:64] == bytes(32)  # client
    assert sent[64:] == b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB"
    assert subscription(b"kv") == b"\x00\x03\x01kv"
    assert subscription(b"") == b"\x00\x01\x01"


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 65, 91, 4096])
def test_messages_come_out_whole_however_the_bytes_are_split(chunk: int) -> None:
    long_payload = bytes(range(256)) * 3  # an 8-byte size
    stream = HANDSHAKE + message(LIVE) + message([b"kv", b"\x00" * 8, long_payload])
    reader = ZmtpReader(1 << 20)
    got: list[list[bytes]] = []
    for i in range(0, len(stream), chunk):
        reader.feed(stream[i : i + chunk])
        got += read_all(reader)
    assert got == [LIVE, [b"kv", b"\x00" * 8, long_payload]]
    assert reader.ready and reader.peer_type == b"PUB"


def test_random_splits_of_many_messages_lose_and_reorder_nothing() -> None:
    rng = random.Random(5)
    sent = [[b"t", i.to_bytes(8, "big"), rng.randbytes(rng.choice([0, 5, 255, 256, 3000]))]
            for i in range(200)]  # fmt: skip
    stream = HANDSHAKE + b"".join(message(m) for m in sent)
    reader = ZmtpReader(1 << 20)
    got: list[list[bytes]] = []
    pos = 0
    while pos < len(stream):
        step = rng.randint(1, 5000)
        reader.feed(stream[pos : pos + step])
        pos += step
        got += read_all(reader)
    assert got == sent


def test_frames_stay_valid_after_the_reader_moves_on() -> None:
    reader = ZmtpReader(1 << 20)
    reader.feed(HANDSHAKE + message(LIVE)[:-3])
    assert reader.next_message() is None
    reader.feed(message(LIVE)[-3:] + message([b"kv", b"x" * 8, b"second"]))
    first = reader.next_message()
    second = reader.next_message()
    assert first is not None and second is not None
    assert [bytes(f) for f in first] == LIVE and bytes(second[2]) == b"second"


def test_a_ping_is_answered_with_a_pong_carrying_its_context_and_other_commands_skipped() -> None:
    reader = ZmtpReader(1 << 20)
    ping = b"\x04\x0b\x04PING\x00\x0actx1"
    subscribe = b"\x04\x0c\x09SUBSCRIBEkv"  # a 3.1 command a PUB never sends: skipped
    reader.feed(HANDSHAKE + ping + subscribe + message(LIVE))
    assert read_all(reader) == [LIVE]
    assert reader.replies == [b"\x04\x09\x04PONGctx1"]


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (b"GET / HTTP/1.1\r\n" + bytes(64), "no ZMTP signature"),
        (GREETING[:10] + b"\x02\x00" + GREETING[12:], "ZMTP 2.x"),
        (GREETING.replace(b"NULL", b"CURV") + READY_PUB, "'CURV' mechanism"),
        (GREETING + READY_PUB.replace(b"PUB", b"REQ"), "b'REQ' socket"),
        (GREETING + b"\x04\x0a\x05READY\x03abc", "truncated"),
        (GREETING + message(LIVE), "before the peer's READY"),
        (GREETING + b"\x04\x06\x04PING\x00\x00", "before READY"),
        (HANDSHAKE + READY_PUB, "a second READY"),
        (HANDSHAKE + b"\x04\x0c\x05ERROR\x05nope!", "ERROR: 'nope!'"),
        (HANDSHAKE + b"\x08\x01x", "reserved bits"),
        (HANDSHAKE + b"\x04\x00", "without a name"),
        (HANDSHAKE + b"\x06" + (MAX_COMMAND_BYTES + 1).to_bytes(8, "big"), "a command of"),
    ],
)
def test_a_peer_breaking_the_protocol_is_refused_with_the_reason(
    stream: bytes, reason: str
) -> None:
    reader = ZmtpReader(1 << 20)
    reader.feed(stream)
    with pytest.raises(ZmtpError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        read_all(reader)


def test_a_message_over_the_bound_is_refused_from_its_sizes_before_its_body_arrives() -> None:
    reader = ZmtpReader(1000)
    reader.feed(HANDSHAKE + frame(b"k" * 600, more=True))
    assert reader.next_message() is None
    reader.feed(b"\x02" + (401).to_bytes(8, "big"))  # the last frame's size: 1001 in all
    with pytest.raises(ZmtpError, match="over 1000 bytes"):
        reader.next_message()
    exact = ZmtpReader(1000)
    exact.feed(HANDSHAKE + message([b"k" * 600, b"v" * 400]))
    assert [len(f) for f in read_all(exact)[0]] == [600, 400]


def test_a_message_of_too_many_frames_is_refused() -> None:
    reader = ZmtpReader(1 << 20)
    reader.feed(HANDSHAKE + message([b"x"] * (MAX_FRAMES + 1)))
    with pytest.raises(ZmtpError, match="more than 16 frames"):
        read_all(reader)
    fits = ZmtpReader(1 << 20)
    fits.feed(HANDSHAKE + message([b"x"] * MAX_FRAMES))
    assert len(read_all(fits)[0]) == MAX_FRAMES


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("tcp://127.0.0.1:5557", ("127.0.0.1", 5557)),
        ("tcp://worker-0.svc:1", ("worker-0.svc", 1)),
        ("tcp://[::1]:5557", ("::1", 5557)),
        ("tcp://*:5557", None),
        ("tcp://host:0", None),
        ("tcp://host:70000", None),
        ("tcp://host", None),
        ("tcp://:5557", None),
        ("ipc:///tmp/kv.sock", None),
        ("inproc://x", None),
    ],
)
def test_tcp_endpoints_parse_and_others_are_refused(
    endpoint: str, expected: tuple[str, int] | None
) -> None:
    if expected is None:
        with pytest.raises(ValueError, match=r"endpoint|tcp://"):
            tcp_host_port(endpoint)
    else:
        assert tcp_host_port(endpoint) == expected
